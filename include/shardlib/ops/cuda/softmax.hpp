// shardlib/ops/cuda/softmax.hpp — the per-row math of the attention softmax
// (nn::MultiheadAttention's masked rows) and its backward, for host and device.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/cuda/team.hpp"  // Team

#include <cmath>    // std::exp, INFINITY
#include <cstdint>  // std::uint8_t

namespace shardlib::ops::cuda {

// In place over one row of n scores: softmax over the keys not masked
// (mask[j] != 0 masks key j; mask may be null), subtracting the maximum so exp
// never overflows. Masked keys get weight 0, and a row whose keys are all
// masked becomes all zeros (the library's rule, not torch's NaN; see
// nn/attention.hpp).
template <Team Tm, class T>
SHARDLIB_HD void masked_softmax_row(const Tm& team, T* row, const std::uint8_t* mask, int n) {
  float mx = -INFINITY, kept = 0;
  for (int j = team.rank(); j < n; j += team.size()) {
    if (mask && mask[j]) continue;
    mx = float(row[j]) > mx ? float(row[j]) : mx;
    kept += 1;
  }
  mx = team.max(mx);
  const bool any = team.sum(kept) > 0;
  float s = 0;
  for (int j = team.rank(); j < n; j += team.size()) {
    row[j] = (mask && mask[j]) ? T(0.0f) : T(std::exp(float(row[j]) - mx));
    s += float(row[j]);
  }
  s = team.sum(s);
  if (any)
    for (int j = team.rank(); j < n; j += team.size()) row[j] = T(float(row[j]) / s);
}

// In place over one row: dp_j <- p_j (dp_j - sum_k dp_k p_k), the gradient of
// the scores from the gradient of the weights p.
template <Team Tm, class T>
SHARDLIB_HD void softmax_backward_row(const Tm& team, const T* p, T* dp, int n) {
  float dot = 0;
  for (int j = team.rank(); j < n; j += team.size()) dot += float(dp[j]) * float(p[j]);
  dot = team.sum(dot);
  for (int j = team.rank(); j < n; j += team.size()) dp[j] = T(float(p[j]) * (float(dp[j]) - dot));
}

}  // namespace shardlib::ops::cuda
