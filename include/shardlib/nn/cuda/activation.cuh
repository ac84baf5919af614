// shardlib/nn/cuda/activation.cuh — ReLU and GELU on the device:
// nn::ReLU<T, cuda_space>, nn::GELU<T, cuda_space> (the host layers' per-element
// functions, through ops::cuda's kernels, on the current stream).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/activation.hpp"         // the host layers
#include "shardlib/ops/cuda/elementwise.cuh"  // relu, gelu and their backward

namespace shardlib::nn {

namespace detail {
template <class T>
void require_backward_of(const char* layer, const Tensor<T, cuda_space>& x, const Tensor<T, cuda_space>& dy) {
  require<shape_error>(!x.empty() && dy.shape() == x.shape(), layer,
                       ": backward needs the gradient of the last forward's output (shape ", x.shape(), "), got shape ",
                       dy.shape());
}
}  // namespace detail

template <class T>
class ReLU<T, cuda_space> {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  template <class V>
  void parameters(V&&) {}

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    x_ = x;
    output y(x.shape());
    ops::cuda::relu<T>(x.span(), y.span(), cuda::current_stream());
    return y;
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    detail::require_backward_of("ReLU", x_, dy);
    input dx(x_.shape());
    ops::cuda::relu_backward<T>(x_.span(), dy.span(), dx.span(), cuda::current_stream());
    x_ = {};
    return dx;
  }

 private:
  input x_;  // cached for backward
};

template <class T>
class GELU<T, cuda_space> {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  GELU() = default;
  explicit GELU(gelu_approx approximate) : approx_(approximate) {}

  gelu_approx approximate() const { return approx_; }

  template <class V>
  void parameters(V&&) {}

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    x_ = x;
    output y(x.shape());
    ops::cuda::gelu<T>(x.span(), y.span(), approx_, cuda::current_stream());
    return y;
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    detail::require_backward_of("GELU", x_, dy);
    input dx(x_.shape());
    ops::cuda::gelu_backward<T>(x_.span(), dy.span(), dx.span(), approx_, cuda::current_stream());
    x_ = {};
    return dx;
  }

 private:
  gelu_approx approx_ = gelu_approx::none;
  input x_;  // cached for backward
};

}  // namespace shardlib::nn
