// shardlib/ops/cuda/adam.cuh — one fused Adam/AdamW step over a flat shard on
// the device: fp32 master and moments, gradients in the reduction dtype, and
// the 16-bit compute copy written in the same pass. Memory-bound, so the fp32
// arrays move in 16-byte vectors when they are aligned for it.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"             // FloatingElement, bfloat16
#include "shardlib/core/error.hpp"               // require, shape_error
#include "shardlib/core/ledger.hpp"              // category
#include "shardlib/cuda/caching_allocator.hpp"   // caching_allocator, device_buffer
#include "shardlib/cuda/copy.hpp"                // fill_bytes_async
#include "shardlib/optim/adam.hpp"               // BasicAdam (step_scalars), detail::adam_scalars
#include "shardlib/optim/optimizer.hpp"          // detail::with_flag
#include "shardlib/ops/cuda/adam.hpp"            // fused_adam_element
#include "shardlib/ops/cuda/launch.cuh"          // grid_blocks, load4, store4
#include "shardlib/ops/cuda/step_gate.cuh"       // step_gate, take_gate, launch_step_gate

#include <cuda_runtime.h>

#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t
#include <span>     // std::span

namespace shardlib::ops::cuda {

using adam_gate = step_gate<optim::detail::adam_scalars>;

namespace detail {
// Step number t's scalars on the device, for a gated step.
template <optim::decay_style Style>
struct adam_scalars_at {
  typename optim::BasicAdam<Style>::options_type options;
  __device__ optim::detail::adam_scalars operator()(std::int64_t t) const {
    return optim::BasicAdam<Style>::scalars_at(options, t);
  }
};

// Vec: elements [0, 4 * (n / 4)) in groups of four through registers (every
// pointer aligned to its group), the rest one by one; otherwise all one by one.
// With a gate, its scalars replace k, or nothing is written when it is inactive.
template <bool Vec, bool Decoupled, bool Decay, bool Amsgrad, class G, class C>
__global__ void fused_adam_kernel(std::int64_t n, float* p, const G* g, float* m, float* v, float* vmax, C* copy,
                                  optim::detail::adam_scalars k,
                                  const gated_scalars<optim::detail::adam_scalars>* gate) {
  if (!take_gate(gate, k)) return;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  const std::int64_t first = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t done = 0;
  if constexpr (Vec) {
    for (std::int64_t q = first; q < n / 4; q += stride) {
      const std::int64_t i = 4 * q;
      float pl[4], ml[4], vl[4], vmaxl[4];
      G gl[4];
      C cl[4];
      load4(p + i, pl);
      load4(g + i, gl);
      load4(m + i, ml);
      load4(v + i, vl);
      if constexpr (Amsgrad) load4(vmax + i, vmaxl);
      for (int l = 0; l < 4; ++l) fused_adam_element<Decoupled, Decay, Amsgrad>(l, pl, gl, ml, vl, vmaxl, cl, k);
      store4(pl, p + i);
      store4(ml, m + i);
      store4(vl, v + i);
      if constexpr (Amsgrad) store4(vmaxl, vmax + i);
      if (copy) store4(cl, copy + i);
    }
    done = n / 4 * 4;
  }
  for (std::int64_t i = done + first; i < n; i += stride)
    fused_adam_element<Decoupled, Decay, Amsgrad>(i, p, g, m, v, vmax, copy, k);
}

}  // namespace detail

// Adam's state for a shard on the device (optim::BasicAdam::state's buffers).
struct adam_device_state {
  shardlib::cuda::device_buffer<float> exp_avg, exp_avg_sq, max_exp_avg_sq;  // the last empty without amsgrad
  std::int64_t step = 0;
};

template <optim::decay_style Style>
adam_device_state make_adam_state(const optim::BasicAdam<Style>& opt, std::size_t n, cudaStream_t stream,
                                  shardlib::cuda::caching_allocator& alloc) {
  auto zeroed = [&](std::size_t count) {
    shardlib::cuda::device_buffer<float> b(count, category::optimizer_state, stream, alloc);
    shardlib::cuda::fill_bytes_async(b.span(), 0, stream);
    return b;
  };
  return {zeroed(n), zeroed(n), zeroed(opt.options.amsgrad ? n : 0), 0};
}

// The device memory a fused step updates besides the parameters, whoever owns it.
struct adam_moments {
  std::span<float> exp_avg, exp_avg_sq;
  std::span<float> max_exp_avg_sq;  // read and written only with amsgrad
};

// Step number step + 1's scalars, the step counted: from the host, or, with a gate,
// made on the device by the gate kernel (the k returned is then unused).
template <optim::decay_style Style>
optim::detail::adam_scalars begin_adam_step(const optim::BasicAdam<Style>& opt, std::int64_t& step,
                                            cudaStream_t stream, const adam_gate* gate) {
  optim::detail::adam_scalars k{};
  if (gate) {
    opt.check_options();
    launch_step_gate("fused_adam gate", detail::adam_scalars_at<Style>{opt.options}, step + 1, *gate, stream);
  } else {
    k = opt.step_scalars(step + 1);
  }
  ++step;
  return k;
}

// The update of one step over params and the same elements of the moments and the
// copy (spans of equal length), with scalars k or the gate's.
template <optim::decay_style Style, FloatingElement G, FloatingElement C>
void adam_update(const optim::BasicAdam<Style>& opt, adam_moments state, std::span<float> params,
                 std::span<const G> grads, std::span<C> copy, optim::detail::adam_scalars k, cudaStream_t stream,
                 const adam_gate* gate) {
  using A = optim::BasicAdam<Style>;
  const std::size_t n = params.size();
  if (n == 0) return;
  float* vmax = state.max_exp_avg_sq.data();
  C* out = copy.empty() ? nullptr : copy.data();
  const bool vec = detail::aligned(params.data(), 16) && detail::aligned(grads.data(), 4 * sizeof(G)) &&
                   detail::aligned(state.exp_avg.data(), 16) && detail::aligned(state.exp_avg_sq.data(), 16) &&
                   (!opt.options.amsgrad || detail::aligned(vmax, 16)) && (!out || detail::aligned(out, 4 * sizeof(C)));
  constexpr int threads = 256;
  const unsigned blocks = grid_blocks(std::int64_t(vec ? (n + 3) / 4 : n), threads);
  optim::detail::with_flag(opt.options.weight_decay != 0, [&](auto decay) {
    optim::detail::with_flag(opt.options.amsgrad, [&](auto amsgrad) {
      optim::detail::with_flag(vec, [&](auto v) {
        launch_kernel("fused_adam", detail::fused_adam_kernel<v(), A::decoupled, decay(), amsgrad(), G, C>, blocks,
                      threads, 0, stream, std::int64_t(n), params.data(), grads.data(), state.exp_avg.data(),
                      state.exp_avg_sq.data(), vmax, out, k, gate ? gate->scalars : nullptr);
      });
    });
  });
}

// That the moments have `stepped` entries (the parameters' elements that are not
// frozen), the gradients n (as the parameters) or `stepped`, and the copy (when not empty) n.
template <optim::decay_style Style, FloatingElement G, FloatingElement C>
void require_adam_sizes(const optim::BasicAdam<Style>& opt, const adam_moments& state, std::size_t stepped,
                        std::size_t n, std::span<const G> grads, std::span<C> copy) {
  auto require_size = [&](const char* what, std::size_t got, std::size_t want, const char* of) {
    require<shape_error>(got == want, optim::BasicAdam<Style>::name, " (CUDA): ", what, " has ", got, " entries, ",
                         of, " ", want);
  };
  if (grads.size() != stepped) require_size("gradients", grads.size(), n, "the parameters");
  require_size("exp_avg", state.exp_avg.size(), stepped, "the parameters stepped");
  require_size("exp_avg_sq", state.exp_avg_sq.size(), stepped, "the parameters stepped");
  if (opt.options.amsgrad)
    require_size("max_exp_avg_sq", state.max_exp_avg_sq.size(), stepped, "the parameters stepped");
  if (!copy.empty()) require_size("the compute copy", copy.size(), n, "the parameters");
}

// One step of `opt` (optim::Adam or optim::AdamW, the same update as its host
// step, element by element, with its step_scalars) over params with grads, on
// `stream`; `step` counts the steps taken, as the host state's does. copy, when
// not empty, receives the new params rounded to C. With a gate the device decides
// whether the step is taken: `step` then counts attempts, gate->cancelled the
// ones cancelled.
template <optim::decay_style Style, FloatingElement G, FloatingElement C = bfloat16>
void fused_adam_step(const optim::BasicAdam<Style>& opt, adam_moments state, std::int64_t& step,
                     std::span<float> params, std::span<const G> grads, std::span<C> copy, cudaStream_t stream,
                     const adam_gate* gate = nullptr) {
  require_adam_sizes(opt, state, params.size(), params.size(), grads, copy);
  const auto k = begin_adam_step(opt, step, stream, gate);
  adam_update(opt, state, params, grads, copy, k, stream, gate);
}

// The same over an adam_device_state.
template <optim::decay_style Style, FloatingElement G, FloatingElement C = bfloat16>
void fused_adam_step(const optim::BasicAdam<Style>& opt, adam_device_state& state, std::span<float> params,
                     std::span<const G> grads, std::span<C> copy, cudaStream_t stream) {
  fused_adam_step(opt, {state.exp_avg.span(), state.exp_avg_sq.span(), state.max_exp_avg_sq.span()}, state.step,
                  params, grads, copy, stream);
}

}  // namespace shardlib::ops::cuda
