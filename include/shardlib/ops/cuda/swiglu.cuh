// shardlib/ops/cuda/swiglu.cuh — SiLU and LLaMA's gated product (SwiGLU) on the
// device, forward and backward, each one pass over its elements with the host
// layers' per-element functions (nn::silu, nn::silu_backward) in float.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"          // FloatingElement
#include "shardlib/nn/activation.hpp"         // silu, silu_backward
#include "shardlib/ops/cuda/elementwise.cuh"  // detail::require_same_size
#include "shardlib/ops/cuda/launch.cuh"       // map_elements, for_each_index

#include <cuda_runtime.h>

#include <cstdint>  // std::int64_t
#include <span>     // std::span

namespace shardlib::ops::cuda {

namespace detail {
template <class T>
struct silu_of {
  __device__ T operator()(std::int64_t, T x) const { return T(nn::silu(float(x))); }
};
template <class T>
struct silu_backward_of {
  __device__ T operator()(std::int64_t, T x, T dy) const { return T(nn::silu_backward(float(x), float(dy))); }
};
template <class T>
struct swiglu_of {
  __device__ T operator()(std::int64_t, T gate, T up) const { return T(nn::silu(float(gate)) * float(up)); }
};
// Two outputs per element: not a map_elements map.
template <class T>
struct swiglu_backward_at {
  const T *gate, *up, *dh;
  T *dgate, *dup;
  __device__ void operator()(std::int64_t i) const {
    const float g = float(gate[i]), u = float(up[i]), d = float(dh[i]);
    dup[i] = T(d * nn::silu(g));
    dgate[i] = T(nn::silu_backward(g, d * u));
  }
};
}  // namespace detail

// y = silu(x) = x sigmoid(x).
template <FloatingElement T>
void silu(std::span<const T> x, std::span<T> y, cudaStream_t stream) {
  detail::require_same_size("silu", x.size(), y.size());
  map_elements(std::int64_t(x.size()), detail::silu_of<T>{}, stream, "silu", y.data(), x.data());
}

// dx = dy * silu'(x).
template <FloatingElement T>
void silu_backward(std::span<const T> x, std::span<const T> dy, std::span<T> dx, cudaStream_t stream) {
  detail::require_same_size("silu_backward", x.size(), dy.size());
  detail::require_same_size("silu_backward", x.size(), dx.size());
  map_elements(std::int64_t(x.size()), detail::silu_backward_of<T>{}, stream, "silu_backward", dx.data(), x.data(),
               dy.data());
}

// h = silu(gate) * up (one rounding to T): LlamaMLP's gated product, without
// materialising silu(gate).
template <FloatingElement T>
void swiglu(std::span<const T> gate, std::span<const T> up, std::span<T> h, cudaStream_t stream) {
  detail::require_same_size("swiglu", gate.size(), up.size());
  detail::require_same_size("swiglu", gate.size(), h.size());
  map_elements(std::int64_t(h.size()), detail::swiglu_of<T>{}, stream, "swiglu", h.data(), gate.data(), up.data());
}

// Both gradients of h = silu(gate) * up in one pass: dup = dh * silu(gate),
// dgate = dh * up * silu'(gate) (as nn::silu_backward(gate, dh * up)).
template <FloatingElement T>
void swiglu_backward(std::span<const T> gate, std::span<const T> up, std::span<const T> dh, std::span<T> dgate,
                     std::span<T> dup, cudaStream_t stream) {
  detail::require_same_size("swiglu_backward", gate.size(), up.size());
  detail::require_same_size("swiglu_backward", gate.size(), dh.size());
  detail::require_same_size("swiglu_backward", gate.size(), dgate.size());
  detail::require_same_size("swiglu_backward", gate.size(), dup.size());
  for_each_index(std::int64_t(dh.size()),
                 detail::swiglu_backward_at<T>{gate.data(), up.data(), dh.data(), dgate.data(), dup.data()}, stream,
                 "swiglu_backward");
}

}  // namespace shardlib::ops::cuda
