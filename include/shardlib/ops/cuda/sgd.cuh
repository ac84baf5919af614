// shardlib/ops/cuda/sgd.cuh — one fused SGD step over a flat shard on the device: fp32
// master and momentum buffer, gradients in the reduction dtype, and the 16-bit compute
// copy written in the same pass, with optim::SGD's per-element function and scalars.
// Memory-bound, so the fp32 arrays move in 16-byte vectors when they are aligned for it.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"        // FloatingElement
#include "shardlib/core/error.hpp"          // require
#include "shardlib/ops/cuda/launch.cuh"     // grid_blocks, launch_kernel, load4, store4, aligned
#include "shardlib/ops/cuda/step_gate.cuh"  // step_gate, take_gate, launch_step_gate
#include "shardlib/optim/optimizer.hpp"     // detail::with_flag
#include "shardlib/optim/sgd.hpp"           // SGD, detail::sgd_update

#include <cuda_runtime.h>

#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <type_traits>  // std::false_type, std::true_type

namespace shardlib::ops::cuda {

using sgd_gate = step_gate<optim::detail::sgd_scalars>;

namespace detail {
// Step number t's scalars on the device, for a gated step.
struct sgd_scalars_at {
  optim::SGD::options_type options;
  __device__ optim::detail::sgd_scalars operator()(std::int64_t t) const {
    return optim::SGD::scalars_at(options, t);
  }
};

template <bool Decay, bool Momentum, bool Nesterov, class G, class C>
__device__ void fused_sgd_element(std::int64_t i, float* p, const G* g, float* buf, C* copy,
                                  const optim::detail::sgd_scalars& k) {
  float pi = p[i], bi = Momentum ? buf[i] : 0.0f;
  optim::detail::sgd_update<Decay, Momentum, Nesterov>(pi, float(g[i]), bi, k);
  p[i] = pi;
  if constexpr (Momentum) buf[i] = bi;
  if (copy) copy[i] = C(pi);
}

// Vec: elements [0, 4 * (n / 4)) in groups of four through registers (every pointer
// aligned to its group), the rest one by one; otherwise all one by one. With a gate,
// its scalars replace k, or nothing is written when it cancelled the step.
template <bool Vec, bool Decay, bool Momentum, bool Nesterov, class G, class C>
__global__ void fused_sgd_kernel(std::int64_t n, float* p, const G* g, float* buf, C* copy,
                                 optim::detail::sgd_scalars k, const gated_scalars<optim::detail::sgd_scalars>* gate) {
  if (!take_gate(gate, k)) return;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  const std::int64_t first = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t done = 0;
  if constexpr (Vec) {
    for (std::int64_t q = first; q < n / 4; q += stride) {
      const std::int64_t i = 4 * q;
      float pl[4], bl[4];
      G gl[4];
      C cl[4];
      load4(p + i, pl);
      load4(g + i, gl);
      if constexpr (Momentum) load4(buf + i, bl);
      for (int l = 0; l < 4; ++l)
        fused_sgd_element<Decay, Momentum, Nesterov>(l, pl, gl, bl, copy ? cl : nullptr, k);
      store4(pl, p + i);
      if constexpr (Momentum) store4(bl, buf + i);
      if (copy) store4(cl, copy + i);
    }
    done = n / 4 * 4;
  }
  for (std::int64_t i = done + first; i < n; i += stride)
    fused_sgd_element<Decay, Momentum, Nesterov>(i, p, g, buf, copy, k);
}
}  // namespace detail

// Step number step + 1's scalars, the step counted: from the host, or, with a gate, made
// on the device by the gate kernel (the k returned is then unused).
inline optim::detail::sgd_scalars begin_sgd_step(const optim::SGD& opt, std::int64_t& step, cudaStream_t stream,
                                                 const sgd_gate* gate) {
  opt.check_options();
  optim::detail::sgd_scalars k{};
  if (gate) launch_step_gate("fused_sgd gate", detail::sgd_scalars_at{opt.options}, step + 1, *gate, stream);
  else k = optim::SGD::scalars_at(opt.options, step + 1);
  ++step;
  return k;
}

// The update of one step over params and the same elements of the momentum buffer (empty
// without momentum) and the copy (empty: none), with scalars k or the gate's.
template <FloatingElement G, FloatingElement C>
void sgd_update(const optim::SGD& opt, std::span<float> momentum_buffer, std::span<float> params,
                std::span<const G> grads, std::span<C> copy, optim::detail::sgd_scalars k, cudaStream_t stream,
                const sgd_gate* gate) {
  const std::size_t n = params.size();
  if (n == 0) return;
  const bool momentum = opt.options.momentum != 0;
  float* buf = momentum ? momentum_buffer.data() : nullptr;
  C* out = copy.empty() ? nullptr : copy.data();
  using detail::aligned;
  const bool vec = aligned(params.data(), 16) && aligned(grads.data(), 4 * sizeof(G)) && (!buf || aligned(buf, 16)) &&
                   (!out || aligned(out, 4 * sizeof(C)));
  constexpr int threads = 256;
  const unsigned blocks = grid_blocks(std::int64_t(vec ? (n + 3) / 4 : n), threads);
  const auto launch = [&](auto v, auto decay, auto with_momentum, auto nesterov) {
    launch_kernel("fused_sgd", detail::fused_sgd_kernel<v(), decay(), with_momentum(), nesterov(), G, C>, blocks,
                  threads, 0, stream, std::int64_t(n), params.data(), grads.data(), buf, out, k,
                  gate ? gate->scalars : nullptr);
  };
  // Nesterov only with momentum (check_options): 12 kernels per dtype pair, not 16.
  optim::detail::with_flag(vec, [&](auto v) {
    optim::detail::with_flag(opt.options.weight_decay != 0, [&](auto decay) {
      if (!momentum) return launch(v, decay, std::false_type{}, std::false_type{});
      optim::detail::with_flag(opt.options.nesterov,
                               [&](auto nesterov) { launch(v, decay, std::true_type{}, nesterov); });
    });
  });
}

}  // namespace shardlib::ops::cuda
