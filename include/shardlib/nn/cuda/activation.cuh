// shardlib/nn/cuda/activation.cuh — ReLU, GELU and SiLU on the device:
// nn::ReLU<T, cuda_space>, nn::GELU<T, cuda_space>, nn::SiLU<T, cuda_space> (the
// host layers' per-element functions, through ops::cuda's kernels, on the
// current stream).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/activation.hpp"         // the host layers
#include "shardlib/ops/cuda/elementwise.cuh"  // relu, gelu and their backward
#include "shardlib/ops/cuda/swiglu.cuh"       // silu, silu_backward

#include <span>  // std::span

namespace shardlib::nn {

namespace detail {
// The device's counterparts of detail::elementwise and elementwise_backward:
// kernel(x, y, stream) and, after the check, kernel(x, dy, dx, stream) on the
// current stream.
template <class T, class K>
Tensor<T, cuda_space> device_elementwise(const Tensor<T, cuda_space>& x, K kernel) {
  Tensor<T, cuda_space> y(x.shape());
  kernel(x.span(), y.span(), cuda::current_stream());
  return y;
}
template <class T, class K>
Tensor<T, cuda_space> device_elementwise_backward(const char* layer, const Tensor<T, cuda_space>& x,
                                                  const Tensor<T, cuda_space>& dy, K kernel) {
  require_backward_of(layer, x, dy);
  Tensor<T, cuda_space> dx(x.shape());
  kernel(x.span(), dy.span(), dx.span(), cuda::current_stream());
  return dx;
}
}  // namespace detail

// The host layers' (no) parameters, GELU's approximation and the checks
// (detail::activation_base, gelu_base in nn/activation.hpp).
template <class T>
class ReLU<T, cuda_space> : public detail::activation_base {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    x_ = x;
    return detail::device_elementwise(x, ops::cuda::relu<T>);
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    input dx = detail::device_elementwise_backward("ReLU", x_, dy, ops::cuda::relu_backward<T>);
    x_ = {};
    return dx;
  }

 private:
  input x_;  // cached for backward
};

template <class T>
class GELU<T, cuda_space> : public detail::gelu_base {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  using gelu_base::gelu_base;  // GELU(), GELU(approximate)

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    x_ = x;
    return detail::device_elementwise(
        x, [a = approx_](std::span<const T> in, std::span<T> y, cudaStream_t s) { ops::cuda::gelu<T>(in, y, a, s); });
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    input dx = detail::device_elementwise_backward(
        "GELU", x_, dy, [a = approx_](std::span<const T> in, std::span<const T> d, std::span<T> out, cudaStream_t s) {
          ops::cuda::gelu_backward<T>(in, d, out, a, s);
        });
    x_ = {};
    return dx;
  }

 private:
  input x_;  // cached for backward
};

template <class T>
class SiLU<T, cuda_space> : public detail::activation_base {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    x_ = x;
    return detail::device_elementwise(x, ops::cuda::silu<T>);
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    input dx = detail::device_elementwise_backward("SiLU", x_, dy, ops::cuda::silu_backward<T>);
    x_ = {};
    return dx;
  }

 private:
  input x_;  // cached for backward
};

}  // namespace shardlib::nn
