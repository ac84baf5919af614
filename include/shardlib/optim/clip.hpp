// shardlib/optim/clip.hpp — global-norm gradient clipping, in parts that sharded training can
// combine across ranks (local squared norms, one all-reduce, one coefficient, local scaling).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // require

#include <cmath>      // std::isfinite, std::sqrt
#include <cstddef>    // std::size_t
#include <span>       // std::span

namespace shardlib::optim {

namespace detail {
template <class T>
double norm_squared(std::span<const T> g) {
  constexpr std::size_t lanes = 8;
  double acc[lanes] = {};
  const std::size_t n = g.size();
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (std::size_t j = 0; j < lanes; ++j) acc[j] += static_cast<double>(g[i + j]) * static_cast<double>(g[i + j]);
  for (std::size_t j = 0; i < n; ++i, ++j) acc[j] += static_cast<double>(g[i]) * static_cast<double>(g[i]);
  double sum = 0;
  for (double a : acc) sum += a;
  return sum;
}
}  // namespace detail

// The sum of squares of g, accumulated in double. Eight partial sums in a fixed
// order keep the result independent of how the loop is vectorised (and let it
// vectorise: a single running sum could not be reordered). Float gradients, or
// double ones (float64 masters on the host).
inline double grad_norm_squared(std::span<const float> g) { return detail::norm_squared(g); }
inline double grad_norm_squared(std::span<const double> g) { return detail::norm_squared(g); }

// torch.nn.utils.clip_grad_norm_'s factor: max_norm / (total_norm + 1e-6),
// clamped to at most 1. A non-finite norm throws (PyTorch's
// error_if_nonfinite=True): scaling by it would turn every gradient into NaN or 0.
// The factor alone, for a finite norm and a positive max_norm (host and device code), in
// R: float, or double to scale float64 gradients without rounding it to float.
template <class R = float>
SHARDLIB_HD inline R clip_factor(double total_norm, float max_norm) {
  const double factor = max_norm / (total_norm + 1e-6);
  return static_cast<R>(factor < 1.0 ? factor : 1.0);  // std::min(1.0, factor)
}

template <class R = float>
R clip_coefficient(double total_norm, float max_norm) {
  require(max_norm > 0, "clip_grad_norm: max_norm must be positive, got ", max_norm);
  require(std::isfinite(total_norm), "clip_grad_norm: the total gradient norm is ", total_norm,
          "; the gradients hold inf or NaN");
  return clip_factor<R>(total_norm, max_norm);
}

// g *= coefficient.
inline void scale_grads(std::span<float> g, float coefficient) {
  for (float& x : g) x *= coefficient;
}

// Clips the global norm of all of grads to max_norm in place and returns the
// norm before clipping. Where the coefficient is 1 (a norm up to about
// max_norm - 1e-6) PyTorch's multiply changes nothing, so it is skipped.
// Sharded training does the same across ranks: all-reduce the grad_norm_squared
// of each rank's shards, then clip_coefficient and scale_grads locally.
inline float clip_grad_norm(std::span<const std::span<float>> grads, float max_norm) {
  double squared = 0;
  for (const auto& g : grads) squared += grad_norm_squared(g);
  const double total = std::sqrt(squared);
  const float coefficient = clip_coefficient(total, max_norm);
  if (coefficient < 1.0f)
    for (const auto& g : grads) scale_grads(g, coefficient);
  return static_cast<float>(total);
}

}  // namespace shardlib::optim
