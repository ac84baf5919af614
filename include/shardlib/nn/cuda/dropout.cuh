// shardlib/nn/cuda/dropout.cuh — Dropout on the device: nn::Dropout<T, cuda_space>,
// drawing the host layer's mask bit for bit (ops::cuda::dropout).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/dropout.hpp"            // the host layer
#include "shardlib/ops/cuda/elementwise.cuh"  // dropout

namespace shardlib::nn {

namespace detail {
// Element i draws at index i, as the host's mask: backward regenerates it.
template <>
struct dropout_mask<cuda_space> {
  template <class T>
  static Tensor<T, cuda_space> apply(const Tensor<T, cuda_space>& x, const counter_rng& stream, double p) {
    Tensor<T, cuda_space> y(x.shape());
    ops::cuda::dropout<T>(x.span(), y.span(), stream, 0, p, cuda::current_stream());
    return y;
  }
};
}  // namespace detail

// The host layer (detail::dropout_base in nn/dropout.hpp) with the mask drawn
// by a kernel on the current stream.
template <class T>
class Dropout<T, cuda_space> : public detail::dropout_base<T, cuda_space> {
 public:
  using detail::dropout_base<T, cuda_space>::dropout_base;
};

}  // namespace shardlib::nn
