// shardlib/ops/cuda/adam.hpp — the scalars of one fused Adam/AdamW step and the
// per-element update of the CUDA kernel (ops/cuda/adam.cuh): optim::Adam's own
// per-element function, followed by the rounded compute copy.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // require
#include "shardlib/optim/adam.hpp"  // BasicAdam, detail::adam_scalars, detail::adam_update

#include <cmath>    // std::pow, std::sqrt
#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

// The scalars of step number `step` (1 for the first), computed in double and
// rounded once, exactly as optim::BasicAdam::step computes them (checked bit
// for bit against it by tests/unit/test_cuda_math.cpp), with its option checks.
template <optim::decay_style Style>
optim::detail::adam_scalars adam_step_scalars(const typename optim::BasicAdam<Style>::options_type& o,
                                              std::int64_t step) {
  constexpr auto name = optim::BasicAdam<Style>::name;
  constexpr bool decoupled = optim::BasicAdam<Style>::decoupled;
  require(o.lr >= 0, name, ": invalid learning rate ", o.lr);
  require(o.beta1 >= 0 && o.beta1 < 1, name, ": invalid beta1 ", o.beta1, " (needs 0 <= beta1 < 1)");
  require(o.beta2 >= 0 && o.beta2 < 1, name, ": invalid beta2 ", o.beta2, " (needs 0 <= beta2 < 1)");
  require(o.eps >= 0, name, ": invalid eps ", o.eps);
  require(o.weight_decay >= 0, name, ": invalid weight_decay ", o.weight_decay);
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1 - std::pow(o.beta1, t);
  const double bias_correction2 = 1 - std::pow(o.beta2, t);
  return {
      static_cast<float>(o.beta1),
      static_cast<float>(1 - o.beta1),
      static_cast<float>(o.beta2),
      static_cast<float>(1 - o.beta2),
      static_cast<float>(std::sqrt(bias_correction2)),
      static_cast<float>(-(o.lr / bias_correction1)),
      static_cast<float>(o.eps),
      static_cast<float>(decoupled ? 1 - o.lr * o.weight_decay : o.weight_decay),
  };
}

// Element i of a fused step over a flat shard: fp32 master p, moments m and v
// (and vmax with amsgrad), the gradient in the reduction dtype G, and, when
// copy is not null, the compute copy in dtype C written from the new p in the
// same pass (so a bf16 gather needs no separate cast kernel).
template <bool Decoupled, bool Decay, bool Amsgrad, class G, class C>
SHARDLIB_HD void fused_adam_element(std::int64_t i, float* p, const G* g, float* m, float* v, float* vmax, C* copy,
                                    const optim::detail::adam_scalars& k) {
  float pi = p[i], mi = m[i], vi = v[i], vmaxi = Amsgrad ? vmax[i] : 0.0f;
  optim::detail::adam_update<Decoupled, Decay, Amsgrad>(pi, float(g[i]), mi, vi, vmaxi, k);
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
  if constexpr (Amsgrad) vmax[i] = vmaxi;
  if (copy) copy[i] = C(pi);
}

}  // namespace shardlib::ops::cuda
