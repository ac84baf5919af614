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

// The host layer's parameters, shapes, init rules and checks; parameters and
// tensors in device memory, products by cuBLAS on the current stream (16-bit
// T accumulates in fp32). Parameter gradients accumulate (+=) as on the host.
template <class T>
class Linear<T, cuda_space> {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  Linear(std::int64_t in_features, std::int64_t out_features, bool bias = true)
      : in_(in_features), out_(out_features), has_bias_(bias) {
    weight.shape = Shape{out_features, in_features};
    weight.init = init_rule::linear_default(in_features);
    if (bias) {
      this->bias.shape = Shape{out_features};
      this->bias.init = init_rule::linear_default(in_features);
    }
  }

  Param<T> weight, bias;

  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }

  template <class V>
  void parameters(V&& v) {
    v("weight", weight);
    if (has_bias_) v("bias", bias);
  }

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    require<shape_error>(x.rank() >= 1 && x.dim(x.rank() - 1) == in_, "Linear(", in_, " -> ", out_,
                         "): input's last dimension must be ", in_, ", got shape ", x.shape());
    x_ = x;
    const std::int64_t rows = x.numel() / in_;
    Shape ys = x.shape();
    ys[ys.rank() - 1] = out_;
    output y(ys);
    if (has_bias_)  // y starts as the bias, which the product adds to (beta 1)
      ops::cuda::repeat_rows(std::span<const T>(bias.value, std::size_t(out_)), y.span(), cuda::current_stream());
    detail::device_gemm(ops::trans::no, ops::trans::yes, rows, out_, in_, 1.0f, x.data(), in_, weight.value, in_,
                        has_bias_ ? 1.0f : 0.0f, y.data(), out_);
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    require<shape_error>(!x_.empty() && dy.numel() == x_.numel() / in_ * out_, "Linear(", in_, " -> ", out_,
                         "): backward needs the gradient of the last forward's output, got shape ", dy.shape());
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
  std::int64_t in_, out_;
  bool has_bias_;
  input x_;  // cached for backward
};

}  // namespace shardlib::nn
