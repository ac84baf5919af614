// shardlib/ops/cuda/cross_entropy.hpp — the per-row math of cross-entropy
// (nn::cross_entropy_loss's arithmetic) for host and device.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/cuda/team.hpp"  // Team

#include <cmath>    // std::exp, std::log, INFINITY
#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

enum class row_status { counted, ignored, bad_target };

struct cross_entropy_row_result {
  float loss;  // 0 unless counted
  row_status status;
};

// One row of logits z[classes] with target y and label smoothing e:
//   loss = (1 - e) (lse - z[y]) - (e / C) sum_c (z[c] - lse),  lse = logsumexp(z)
//   grad[c] = (softmax(z)[c] - e / C - (1 - e) [c == y]) * grad_scale
// grad_scale is 1 / (rows counted) for the mean reduction, 1 for the sum. An
// ignored row (y == ignore_index) or a target out of range gets a zero gradient;
// the latter is reported by status (the kernel cannot throw; the caller does).
template <Team Tm, class T>
SHARDLIB_HD cross_entropy_row_result cross_entropy_row(const Tm& team, const T* z, std::int64_t y, int classes,
                                                       std::int64_t ignore_index, float smoothing, float grad_scale,
                                                       T* grad) {
  const bool ignored = y == ignore_index;
  if (ignored || y < 0 || y >= classes) {
    for (int c = team.rank(); c < classes; c += team.size()) grad[c] = T(0.0f);
    return {0.0f, ignored ? row_status::ignored : row_status::bad_target};
  }
  float m = -INFINITY;
  for (int c = team.rank(); c < classes; c += team.size()) m = float(z[c]) > m ? float(z[c]) : m;
  m = team.max(m);
  float s = 0;
  for (int c = team.rank(); c < classes; c += team.size()) s += std::exp(float(z[c]) - m);
  const float lse = m + std::log(team.sum(s));
  const float off = smoothing / float(classes), target_weight = 1.0f - smoothing;
  float sum_lp = 0;
  for (int c = team.rank(); c < classes; c += team.size()) {
    sum_lp += float(z[c]) - lse;
    const float g = std::exp(float(z[c]) - lse) - off;
    grad[c] = T((c == y ? g - target_weight : g) * grad_scale);
  }
  sum_lp = team.sum(sum_lp);
  // Without smoothing the term is absent, not 0 * sum_lp: a -inf logit makes sum_lp -inf.
  return {target_weight * (lse - float(z[y])) - (smoothing > 0 ? off * sum_lp : 0.0f), row_status::counted};
}

}  // namespace shardlib::ops::cuda
