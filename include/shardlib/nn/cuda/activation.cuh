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
// What the device activations share: y = f(x) and dx = f'(x) dy through Derived's
// kernels (forward_kernel(x, y, stream), backward_kernel(x, dy, dx, stream)) on the
// current stream, the input kept for backward (when one follows: nn::grad_enabled)
// and checked against dy, naming Derived::layer_name.
template <class Derived, class T>
class device_activation {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    x_ = grad_enabled(ctx) ? x : input{};  // kept only when a backward follows
    output y(x.shape());
    self().forward_kernel(x.span(), y.span(), cuda::current_stream());
    return y;
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    require_backward_of(Derived::layer_name, x_, dy);
    input dx(x_.shape());
    self().backward_kernel(x_.span(), dy.span(), dx.span(), cuda::current_stream());
    x_ = {};
    return dx;
  }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  input x_;  // cached for backward
};
}  // namespace detail

// The host layers' (no) parameters, GELU's approximation and the checks
// (detail::activation_base, gelu_base in nn/activation.hpp).
template <class T>
class ReLU<T, cuda_space> : public detail::activation_base, public detail::device_activation<ReLU<T, cuda_space>, T> {
 public:
  static constexpr const char* layer_name = "ReLU";
  static void forward_kernel(std::span<const T> x, std::span<T> y, cudaStream_t s) { ops::cuda::relu<T>(x, y, s); }
  static void backward_kernel(std::span<const T> x, std::span<const T> dy, std::span<T> dx, cudaStream_t s) {
    ops::cuda::relu_backward<T>(x, dy, dx, s);
  }
};

template <class T>
class GELU<T, cuda_space> : public detail::gelu_base, public detail::device_activation<GELU<T, cuda_space>, T> {
 public:
  using gelu_base::gelu_base;  // GELU(), GELU(approximate)

  static constexpr const char* layer_name = "GELU";
  void forward_kernel(std::span<const T> x, std::span<T> y, cudaStream_t s) const {
    ops::cuda::gelu<T>(x, y, approx_, s);
  }
  void backward_kernel(std::span<const T> x, std::span<const T> dy, std::span<T> dx, cudaStream_t s) const {
    ops::cuda::gelu_backward<T>(x, dy, dx, approx_, s);
  }
};

template <class T>
class SiLU<T, cuda_space> : public detail::activation_base, public detail::device_activation<SiLU<T, cuda_space>, T> {
 public:
  static constexpr const char* layer_name = "SiLU";
  static void forward_kernel(std::span<const T> x, std::span<T> y, cudaStream_t s) { ops::cuda::silu<T>(x, y, s); }
  static void backward_kernel(std::span<const T> x, std::span<const T> dy, std::span<T> dx, cudaStream_t s) {
    ops::cuda::silu_backward<T>(x, dy, dx, s);
  }
};

}  // namespace shardlib::nn
