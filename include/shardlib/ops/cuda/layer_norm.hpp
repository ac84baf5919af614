// shardlib/ops/cuda/layer_norm.hpp — the per-row math of LayerNorm forward and
// backward (nn::LayerNorm's arithmetic), shared by the CUDA kernels
// (ops/cuda/layer_norm.cuh) and the host, where the tests check it.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/cuda/team.hpp"  // Team

#include <cmath>    // std::sqrt
#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

// What forward keeps per row for backward.
struct row_stats {
  float mean;
  float rstd;  // 1 / sqrt(biased variance + eps)
};

// One row of d elements: y = (x - mean) * rstd * weight + bias, two passes
// (no cancellation when |mean| >> std), in float whatever T is. weight and bias
// are null without elementwise affine.
template <Team Tm, class T, class P>
SHARDLIB_HD row_stats layer_norm_forward_row(const Tm& team, const T* x, const P* weight, const P* bias, T* y, int d,
                                             float eps) {
  float s = 0;
  for (int i = team.rank(); i < d; i += team.size()) s += float(x[i]);
  const float mean = team.sum(s) / float(d);
  float q = 0;
  for (int i = team.rank(); i < d; i += team.size()) q += (float(x[i]) - mean) * (float(x[i]) - mean);
  const float rstd = 1.0f / std::sqrt(team.sum(q) / float(d) + eps);
  for (int i = team.rank(); i < d; i += team.size()) {
    const float xhat = (float(x[i]) - mean) * rstd;
    y[i] = T(weight ? xhat * float(weight[i]) + float(bias[i]) : xhat);
  }
  return {mean, rstd};
}

// dx of one row, with g = dy * weight and xhat the normalised input (llm.c's
// layernorm_backward): dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
template <Team Tm, class T, class P>
SHARDLIB_HD void layer_norm_backward_row(const Tm& team, const T* x, const T* dy, const P* weight, row_stats st, T* dx,
                                         int d) {
  float g_sum = 0, gx_sum = 0;
  for (int i = team.rank(); i < d; i += team.size()) {
    const float g = weight ? float(dy[i]) * float(weight[i]) : float(dy[i]);
    g_sum += g;
    gx_sum += g * (float(x[i]) - st.mean) * st.rstd;
  }
  const float g_mean = team.sum(g_sum) / float(d);
  const float gx_mean = team.sum(gx_sum) / float(d);
  for (int i = team.rank(); i < d; i += team.size()) {
    const float xhat = (float(x[i]) - st.mean) * st.rstd;
    const float g = weight ? float(dy[i]) * float(weight[i]) : float(dy[i]);
    dx[i] = T(st.rstd * (g - g_mean - xhat * gx_mean));
  }
}

struct param_grads {
  float weight;
  float bias;
};

// Column i of the parameter gradients over rows [row_begin, row_end), added
// to acc in row order: weight += dy * xhat, bias += dy. Rows in order from the
// current gradient reproduce nn::LayerNorm's accumulation exactly; the kernel
// sums fixed chunks of rows and then the chunks in order (deterministic).
template <class T>
SHARDLIB_HD param_grads layer_norm_param_grads(const T* x, const T* dy, const row_stats* stats, std::int64_t row_begin,
                                               std::int64_t row_end, int d, int i, param_grads acc) {
  for (std::int64_t r = row_begin; r < row_end; ++r) {
    const float g = float(dy[r * d + i]);
    const float xhat = (float(x[r * d + i]) - stats[r].mean) * stats[r].rstd;
    acc.weight += g * xhat;
    acc.bias += g;
  }
  return acc;
}

}  // namespace shardlib::ops::cuda
