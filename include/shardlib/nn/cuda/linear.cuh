// shardlib/nn/cuda/linear.cuh — Linear on the device: nn::Linear<T, cuda_space>.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/blas_lt.hpp"          // current_blas_lt
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/activation.hpp"         // ReLU, GELU, gelu_approx
#include "shardlib/nn/cuda/device.cuh"        // device_gemm, add_column_sums_device
#include "shardlib/nn/cuda/lora.cuh"          // lora_product<cuda_space>
#include "shardlib/nn/linear.hpp"             // the host layer, detail::linear_activation
#include "shardlib/nn/param.hpp"
#include "shardlib/ops/cuda/elementwise.cuh"  // repeat_rows, add
#include "shardlib/ops/cuda/gemm_lt.hpp"      // gemm_lt

#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

// The activation a device Linear applies to its output (Linear::fuse_activation).
enum class fused_activation { none, relu, gelu_tanh };

// The host layer's parameters, shapes, init rules and checks (detail::linear_base
// in nn/linear.hpp); parameters and tensors in device memory, products on the
// current stream (16-bit T accumulates in fp32). Parameter gradients accumulate
// (+=) as on the host, and a frozen weight or bias gets none, as there.
//
// The bias is cuBLASLt's epilogue: added to the product in fp32 before the one
// rounding to T, as cuBLAS's beta 1 over a bias-filled output did. In fp32
// the bias gradient comes from the weight-gradient product too (cuBLASLt's
// BGRADB sums dy while it reads it), written to a scratch vector and added to
// bias.grad; cuBLASLt writes that vector in T, so 16-bit layers take the
// fp32 column-sum kernel instead, which rounds once (sum + gradient) as before.
// Where cuBLASLt has no algorithm the products run as cuBLAS plus kernels, and
// so do products whose rows are off 16-byte boundaries (ops::cuda::gemm_staged:
// cuBLAS on aligned copies; an out_features of 50257 in bf16, say).
//
// fuse_activation(a) makes the layer Linear followed by that activation (its
// output and backward are the pair's), the activation applied by the
// product's epilogue where the math is the activation layer's own:
// - relu: cuBLASLt's relu_bias; backward is nn::relu_backward on the output
//   (y > 0 exactly where x W^T + b > 0), so no mask and no pre-activation is
//   kept; cuBLASLt maps a NaN pre-activation to 0 where nn::relu keeps it;
// - gelu_tanh: cuBLASLt's GELU is the tanh form, but its fp32 tanh is
//   approximate (~1e-4), so it is fused for 16-bit T only (below T's own
//   rounding) and where out_features is a multiple of 8 (the pre-activation
//   it writes for backward then has no padding); otherwise the product and
//   the GELU kernel run one after the other, keeping the same pre-activation.
// The erf GELU (torch's "gelu") has no epilogue: a GELU layer after a plain Linear.
// Nor does a LoRA adapter's update, which the activation must follow: with one,
// activation() is none and the activation layer runs after the Linear.
template <class T>
class Linear<T, cuda_space> : public detail::linear_base<T, cuda_space> {
  using base = detail::linear_base<T, cuda_space>;
  using base::in_, base::out_, base::has_bias_, base::lora_;

 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using base::weight, base::bias;

  using base::base;  // Linear(in_features, out_features, bias = true)

  // From the next forward on, the layer is Linear then `a` (see above).
  void fuse_activation(fused_activation a) { act_ = a; }
  fused_activation activation() const { return lora_ ? fused_activation::none : act_; }

  // Keeps what backward needs (x, or only its shape for a frozen weight, and the fused
  // activation's output or input) only when a backward follows (nn::grad_enabled), as
  // the host layer does.
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    this->check_input(x.shape());
    const bool keep = grad_enabled(ctx);
    x_.save(ctx, x, weight.requires_grad);
    const std::int64_t rows = x.numel() / in_;
    output y(this->output_shape(x.shape()));
    switch (activation()) {
      case fused_activation::none:
        if (!fused_product(x, rows, ops::cuda::epilogue::bias, y)) plain_product(x, rows, y);
        break;
      case fused_activation::relu:
        if (!fused_product(x, rows, ops::cuda::epilogue::relu_bias, y)) {
          plain_product(x, rows, y);
          ops::cuda::relu<T>(y.span(), y.span(), cuda::current_stream());
        }
        y_ = keep ? y : output{};
        break;
      case fused_activation::gelu_tanh:
        pre_ = output(y.shape());
        if (!fused_product(x, rows, ops::cuda::epilogue::gelu_aux_bias, y)) {
          plain_product(x, rows, pre_);
          ops::cuda::gelu<T>(pre_.span(), y.span(), gelu_approx::tanh, cuda::current_stream());
        }
        if (!keep) pre_ = {};  // the product's aux output, needed by backward only
        break;
    }
    if (lora_) lora_->forward(ctx, x, y);
    return y;
  }

  template <class Ctx>
  input backward(Ctx& ctx, const output& dy_out) {
    this->check_grad(x_, dy_out);
    const std::int64_t rows = x_.numel() / in_;
    const output dy = activation_backward(dy_out);
    const auto d = detail::gradient_operand(dy.data(), rows, out_, in_);  // dy, its rows 16 bytes apart
    const bool dw = weight.requires_grad, db = has_bias_ && bias.requires_grad;  // frozen: no gradient (host's)
    if (!(dw && db && weight_and_bias_grad(d, rows))) {
      if (dw)
        detail::device_gemm(ops::trans::yes, ops::trans::no, out_, in_, rows, 1.0f, d.data, d.ld, x_.values().data(),
                            in_, 1.0f, weight.grad, in_);  // dW += dy^T x
      if (db) detail::add_column_sums_device(dy.data(), rows, out_, bias.grad);
    }
    input dx(x_.shape());
    detail::device_gemm(ops::trans::no, ops::trans::no, rows, in_, out_, 1.0f, d.data, d.ld, weight.value, in_, 0.0f,
                        dx.data(), in_);  // dx = dy W
    if (lora_) lora_->backward(ctx, dy, dx);
    x_.clear();
    return dx;
  }

 private:
  // y = the epilogue `kind` of x W^T + b (gelu_aux_bias: the pre-activation
  // in pre_ as well); false, having done nothing, where it is not taken.
  bool fused_product(const input& x, std::int64_t rows, ops::cuda::epilogue kind, output& y) {
    const bool gelu = kind == ops::cuda::epilogue::gelu_aux_bias;
    if (!has_bias_ || (gelu && (std::is_same_v<T, float> || out_ % 8 != 0))) return false;
    if (ops::cuda::staged_for<T>(rows, out_, in_, x.data(), in_, weight.value, in_, y.data(), out_).any())
      return false;  // rows off 16-byte boundaries: cuBLAS on aligned copies (plain_product) instead
    return ops::cuda::gemm_lt(cuda::current_blas_lt(), cuda::current_stream(), ops::trans::no, ops::trans::yes, rows,
                              out_, in_, 1.0f, x.data(), in_, weight.value, in_, 0.0f, y.data(), out_,
                              {.kind = kind, .bias = bias.value, .aux = gelu ? pre_.data() : nullptr,
                               .aux_ld = gelu ? out_ : 0});
  }
  // y = x W^T (+ b) by cuBLAS.
  void plain_product(const input& x, std::int64_t rows, output& y) {
    if (has_bias_)  // y starts as the bias, which the product adds to (beta 1)
      ops::cuda::repeat_rows(std::span<const T>(bias.value, std::size_t(out_)), y.span(), cuda::current_stream());
    detail::device_gemm(ops::trans::no, ops::trans::yes, rows, out_, in_, 1.0f, x.data(), in_, weight.value, in_,
                        has_bias_ ? 1.0f : 0.0f, y.data(), out_);
  }

  // The gradient of x W^T + b from the gradient of the layer's output.
  output activation_backward(const output& dy) {
    if (activation() == fused_activation::none) return dy;
    output d(dy.shape());
    const cudaStream_t s = cuda::current_stream();
    if (activation() == fused_activation::relu) ops::cuda::relu_backward<T>(y_.span(), dy.span(), d.span(), s);
    else ops::cuda::gelu_backward<T>(pre_.span(), dy.span(), d.span(), gelu_approx::tanh, s);
    y_ = {};
    pre_ = {};
    return d;
  }

  // dW += dy^T x with db = the column sums of dy from the same product, then
  // bias.grad += db; false (nothing done) where that is not taken (see above).
  bool weight_and_bias_grad(const ops::cuda::aligned_operand<T>& dy, std::int64_t rows) {
    if constexpr (!std::is_same_v<T, float>) {
      return false;
    } else {
      const T* x = x_.values().data();
      if (ops::cuda::staged_for<T>(out_, in_, rows, dy.data, dy.ld, x, in_, weight.grad, in_).any())
        return false;  // as fused_product
      Tensor<T, cuda_space> db(Shape{out_});
      if (!ops::cuda::gemm_lt(cuda::current_blas_lt(), cuda::current_stream(), ops::trans::yes, ops::trans::no, out_,
                              in_, rows, 1.0f, dy.data, dy.ld, x, in_, 1.0f, weight.grad, in_,
                              {.kind = ops::cuda::epilogue::bgrad_a, .bias_grad = db.data()}))
        return false;
      const std::span<T> g(bias.grad, std::size_t(out_));
      ops::cuda::add<T>(g, db.span(), g, cuda::current_stream());
      return true;
    }
  }

  saved_input<input> x_;
  output y_, pre_;  // kept for backward: with relu, the output; with gelu_tanh, the pre-activation
  fused_activation act_ = fused_activation::none;
};

namespace detail {
// A Linear and the activation after it on the device (the encoder's linear1 and its
// ReLU, GPT-2's c_fc and its tanh-GELU): one Linear with fuse_activation, the
// activation layer not called (nor hooks on it). Its math is the layer's (see
// above); torch's erf GELU has no epilogue: the Linear, then the GELU layer.
template <>
struct linear_activation<cuda_space> {
  template <class T, class A>
  static fused_activation fusable([[maybe_unused]] const A& act) {
    if constexpr (std::is_same_v<A, ReLU<T, cuda_space>>)
      return fused_activation::relu;
    else if constexpr (std::is_same_v<A, GELU<T, cuda_space>>)
      return act.approximate() == gelu_approx::tanh ? fused_activation::gelu_tanh : fused_activation::none;
    else
      return fused_activation::none;
  }
  template <class Ctx, class T, class A>
  static Tensor<T, cuda_space> forward(Ctx& ctx, Linear<T, cuda_space>& linear, A& act,
                                       const Tensor<T, cuda_space>& x) {
    linear.fuse_activation(fusable<T>(act));
    if (linear.activation() == fused_activation::none) return ctx.forward(act, ctx.forward(linear, x));
    return ctx.forward(linear, x);
  }
  template <class Ctx, class T, class A>
  static Tensor<T, cuda_space> backward(Ctx& ctx, Linear<T, cuda_space>& linear, A& act,
                                        const Tensor<T, cuda_space>& dy) {
    if (linear.activation() == fused_activation::none) return ctx.backward(linear, ctx.backward(act, dy));
    return ctx.backward(linear, dy);
  }
};
}  // namespace detail

}  // namespace shardlib::nn
