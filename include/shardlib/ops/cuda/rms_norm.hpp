// shardlib/ops/cuda/rms_norm.hpp — the per-row math of RMSNorm forward and
// backward (nn::RMSNorm's arithmetic), shared by the CUDA kernels
// (ops/cuda/rms_norm.cuh) and the host, where it can be checked against the layer.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/cuda/team.hpp"  // Team

#include <cmath>    // std::sqrt
#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

// One row of d elements: y = weight * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps),
// in float whatever T is; returns rstd, which backward needs.
template <Team Tm, class T, class P>
SHARDLIB_HD float rms_norm_forward_row(const Tm& team, const T* x, const P* weight, T* y, int d, float eps) {
  float q = 0;
  for (int i = team.rank(); i < d; i += team.size()) q += float(x[i]) * float(x[i]);
  const float rstd = 1.0f / std::sqrt(team.sum(q) / float(d) + eps);
  for (int i = team.rank(); i < d; i += team.size()) y[i] = T(float(weight[i]) * (float(x[i]) * rstd));
  return rstd;
}

// dx of one row, with g = dy * weight and xhat = x * rstd:
// dx = rstd * (g - xhat * mean(g * xhat)).
template <Team Tm, class T, class P>
SHARDLIB_HD void rms_norm_backward_row(const Tm& team, const T* x, const T* dy, const P* weight, float rstd, T* dx,
                                       int d) {
  float gx = 0;
  for (int i = team.rank(); i < d; i += team.size()) gx += float(dy[i]) * float(weight[i]) * float(x[i]) * rstd;
  const float gx_mean = team.sum(gx) / float(d);
  for (int i = team.rank(); i < d; i += team.size()) {
    const float xhat = float(x[i]) * rstd;
    dx[i] = T(rstd * (float(dy[i]) * float(weight[i]) - xhat * gx_mean));
  }
}

// Column i of the weight gradient over rows [row_begin, row_end), added to acc
// in row order: acc += dy * xhat. From the current gradient over all rows in
// order this is nn::RMSNorm's accumulation; the kernel sums fixed chunks of
// rows, then the chunks in order (deterministic).
template <class T>
SHARDLIB_HD float rms_norm_weight_grad(const T* x, const T* dy, const float* rstd, std::int64_t row_begin,
                                       std::int64_t row_end, int d, int i, float acc) {
  for (std::int64_t r = row_begin; r < row_end; ++r) acc += float(dy[r * d + i]) * (float(x[r * d + i]) * rstd[r]);
  return acc;
}

}  // namespace shardlib::ops::cuda
