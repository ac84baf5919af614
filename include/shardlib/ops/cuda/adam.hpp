// shardlib/ops/cuda/adam.hpp — the per-element update of the fused Adam/AdamW
// kernel (ops/cuda/adam.cuh): optim::Adam's own per-element function, followed
// by the rounded compute copy. Its scalars come from optim::BasicAdam::step_scalars.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/optim/adam.hpp"  // detail::adam_scalars, detail::adam_update

#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

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
