// shardlib/nn/cuda/linear.cuh — Linear on the device: nn::Linear<T, cuda_space>.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/blas_lt.hpp"          // current_blas_lt
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/cuda/device.cuh"        // device_gemm, add_column_sums_device
#include "shardlib/nn/linear.hpp"             // the host layer
#include "shardlib/nn/param.hpp"
#include "shardlib/ops/cuda/elementwise.cuh"  // repeat_rows, add
#include "shardlib/ops/cuda/gemm_lt.hpp"      // gemm_lt

#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

// The host layer's parameters, shapes, init rules and checks (detail::linear_base
// in nn/linear.hpp); parameters and tensors in device memory, products on the
// current stream (16-bit T accumulates in fp32). Parameter gradients accumulate
// (+=) as on the host.
//
// The bias is cuBLASLt's epilogue: added to the product in fp32 before the one
// rounding to T, as cuBLAS's beta 1 over a bias-filled output did. In fp32
// the bias gradient comes from the weight-gradient product too (cuBLASLt's
// BGRADB sums dy while it reads it), written to a scratch vector and added to
// bias.grad; cuBLASLt writes that vector in T, so 16-bit layers take the
// fp32 column-sum kernel instead, which rounds once (sum + gradient) as before.
// Where cuBLASLt has no algorithm the products run as cuBLAS plus kernels.
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
    const bool fused =
        has_bias_ && ops::cuda::gemm_lt(cuda::current_blas_lt(), cuda::current_stream(), ops::trans::no,
                                        ops::trans::yes, rows, out_, in_, 1.0f, x.data(), in_, weight.value, in_, 0.0f,
                                        y.data(), out_, {.kind = ops::cuda::epilogue::bias, .bias = bias.value});
    if (!fused) {
      if (has_bias_)  // y starts as the bias, which the product adds to (beta 1)
        ops::cuda::repeat_rows(std::span<const T>(bias.value, std::size_t(out_)), y.span(), cuda::current_stream());
      detail::device_gemm(ops::trans::no, ops::trans::yes, rows, out_, in_, 1.0f, x.data(), in_, weight.value, in_,
                          has_bias_ ? 1.0f : 0.0f, y.data(), out_);
    }
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / in_;
    if (!(has_bias_ && weight_and_bias_grad(dy, rows))) {
      detail::device_gemm(ops::trans::yes, ops::trans::no, out_, in_, rows, 1.0f, dy.data(), out_, x_.data(), in_,
                          1.0f, weight.grad, in_);  // dW += dy^T x
      if (has_bias_) detail::add_column_sums_device(dy.data(), rows, out_, bias.grad);
    }
    input dx(x_.shape());
    detail::device_gemm(ops::trans::no, ops::trans::no, rows, in_, out_, 1.0f, dy.data(), out_, weight.value, in_, 0.0f,
                        dx.data(), in_);  // dx = dy W
    x_ = {};
    return dx;
  }

 private:
  // dW += dy^T x with db = the column sums of dy from the same product, then
  // bias.grad += db; false (nothing done) where that is not taken (see above).
  bool weight_and_bias_grad(const output& dy, std::int64_t rows) {
    if constexpr (!std::is_same_v<T, float>) {
      return false;
    } else {
      Tensor<T, cuda_space> db(Shape{out_});
      if (!ops::cuda::gemm_lt(cuda::current_blas_lt(), cuda::current_stream(), ops::trans::yes, ops::trans::no, out_,
                              in_, rows, 1.0f, dy.data(), out_, x_.data(), in_, 1.0f, weight.grad, in_,
                              {.kind = ops::cuda::epilogue::bgrad_a, .bias_grad = db.data()}))
        return false;
      const std::span<T> g(bias.grad, std::size_t(out_));
      ops::cuda::add<T>(g, db.span(), g, cuda::current_stream());
      return true;
    }
  }

  input x_;  // cached for backward
};

}  // namespace shardlib::nn
