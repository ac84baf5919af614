// shardlib/nn/cuda/linear.cuh — Linear on the device: nn::Linear<T, cuda_space>.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/cuda/device.cuh"        // device_gemm, add_column_sums_device
#include "shardlib/nn/linear.hpp"             // the host layer
#include "shardlib/nn/param.hpp"
#include "shardlib/ops/cuda/elementwise.cuh"  // repeat_rows

#include <cstdint>  // std::int64_t
#include <span>     // std::span

namespace shardlib::nn {

// The host layer's parameters, shapes, init rules and checks (detail::linear_base
// in nn/linear.hpp); parameters and tensors in device memory, products by cuBLAS
// on the current stream (16-bit T accumulates in fp32). Parameter gradients accumulate (+=) as on the host.
template <class T>
class Linear<T, cuda_space> : public detail::linear_base<T> {
  using base = detail::linear_base<T>;
  using base::in_, base::out_, base::has_bias_;

 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using base::weight, base::bias;

  using base::base;  // Linear(in_features, out_features, bias = true)

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    this->check_input(x.shape());
    x_ = x;
    const std::int64_t rows = x.numel() / in_;
    output y(this->output_shape(x.shape()));
    if (has_bias_)  // y starts as the bias, which the product adds to (beta 1)
      ops::cuda::repeat_rows(std::span<const T>(bias.value, std::size_t(out_)), y.span(), cuda::current_stream());
    detail::device_gemm(ops::trans::no, ops::trans::yes, rows, out_, in_, 1.0f, x.data(), in_, weight.value, in_,
                        has_bias_ ? 1.0f : 0.0f, y.data(), out_);
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / in_;
    detail::device_gemm(ops::trans::yes, ops::trans::no, out_, in_, rows, 1.0f, dy.data(), out_, x_.data(), in_, 1.0f,
                        weight.grad, in_);  // dW += dy^T x
    if (has_bias_) detail::add_column_sums_device(dy.data(), rows, out_, bias.grad);
    input dx(x_.shape());
    detail::device_gemm(ops::trans::no, ops::trans::no, rows, in_, out_, 1.0f, dy.data(), out_, weight.value, in_, 0.0f,
                        dx.data(), in_);  // dx = dy W
    x_ = {};
    return dx;
  }

 private:
  input x_;  // cached for backward
};

}  // namespace shardlib::nn
