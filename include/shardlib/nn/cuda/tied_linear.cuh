// shardlib/nn/cuda/tied_linear.cuh — TiedLinear on the device:
// nn::TiedLinear<T, cuda_space>, the tied LM head (logits = h W_te^T).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/memory_space.hpp"  // cuda_space
#include "shardlib/nn/cuda/device.cuh"     // device_gemm
#include "shardlib/nn/tied_linear.hpp"     // the host layer, detail::tied_linear_base

#include <cstdint>  // std::int64_t

namespace shardlib::nn {

// The host layer's tie, parameters and checks (detail::tied_linear_base); the
// borrowed weight is wherever the engine bound the embedding's Param (the
// gathered device copy under FullShard), the products are cuBLAS's on the
// current stream (16-bit T accumulates in fp32). Backward adds dW into the
// embedding's gradient (beta 1): the embedding's own backward adds there too,
// so the one Param receives the sum of both uses.
template <class T>
class TiedLinear<T, cuda_space> : public detail::tied_linear_base<T> {
  using base = detail::tied_linear_base<T>;
  using base::in_, base::out_, base::weight_;

 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  using base::base;  // TiedLinear(in_features, out_features)
  TiedLinear(const TiedLinear& o) : base(o) {}
  TiedLinear& operator=(const TiedLinear& o) {
    base::operator=(o);
    x_.clear();
    return *this;
  }

  // Keeps x for backward (saved_input: its shape alone if the weight is frozen).
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    output y(this->check_input(x.shape()));
    x_.save(ctx, x, weight_->requires_grad);
    const std::int64_t rows = x.numel() / in_;
    detail::device_gemm(ops::trans::no, ops::trans::yes, rows, out_, in_, 1.0f, x.data(), in_, weight_->value, in_,
                        0.0f, y.data(), out_);
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / in_;
    const auto d = detail::gradient_operand(dy.data(), rows, out_, in_);  // dy, its rows 16 bytes apart
    if (weight_->requires_grad)  // frozen: no gradient, as on the host
      detail::device_gemm(ops::trans::yes, ops::trans::no, out_, in_, rows, 1.0f, d.data, d.ld, x_.values().data(),
                          in_, 1.0f, weight_->grad, in_);  // dW += dy^T x
    input dx(x_.shape());
    detail::device_gemm(ops::trans::no, ops::trans::no, rows, in_, out_, 1.0f, d.data, d.ld, weight_->value, in_, 0.0f,
                        dx.data(), in_);  // dx = dy W
    x_.clear();
    return dx;
  }

 private:
  saved_input<input> x_;
};

}  // namespace shardlib::nn
