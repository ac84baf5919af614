// shardlib/nn/lora_adapter.hpp — a Linear's LoRA adapter: the trained low-rank update
// s (x A^T) B^T added to its output (LoRA; Hugging Face PEFT's lora.Linear). A Linear
// holds one after Linear::add_lora; nn/lora.hpp adds them across a model.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/saved_input.hpp"
#include "shardlib/ops/gemm.hpp"

#include <algorithm>    // std::fill_n
#include <cmath>        // std::sqrt
#include <cstdint>      // std::int64_t
#include <string>       // std::string

namespace shardlib::nn {

// PEFT's LoraConfig fields that shape one adapter (its defaults).
struct lora_options {
  std::int64_t r = 8;     // the update's rank
  double alpha = 8;       // lora_alpha: the update is scaled by alpha / r
  bool rslora = false;    // use_rslora: scaled by alpha / sqrt(r) instead
  double dropout = 0;     // lora_dropout: on the adapter's input, in training (nn::Dropout's masks)
  friend bool operator==(const lora_options&, const lora_options&) = default;
};

namespace detail {
// C = alpha op(A) op(B) + beta C, row-major, in Space: the host's here (alpha and beta
// rounded to T, as ops::gemm takes them), the device's (to float) in nn/cuda/lora.cuh;
// and y += x, y = 0 over n elements.
template <class Space>
struct lora_product;

template <>
struct lora_product<host_space> {
  template <class T>
  static void run(ops::trans ta, ops::trans tb, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
                  const T* a, std::int64_t lda, const T* b, std::int64_t ldb, double beta, T* c, std::int64_t ldc) {
    ops::gemm(ta, tb, m, n, k, T(alpha), a, lda, b, ldb, T(beta), c, ldc);
  }
  template <class T>
  static void zero(T* x, std::int64_t n) {
    std::fill_n(x, n, T(0));
  }
  template <class T>
  static void add(T* y, const T* x, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) y[i] += x[i];
  }
};

// lora_A [r, in] starts as a Linear's weight does (kaiming_uniform, a = sqrt(5)),
// lora_B [out, r] at zero, so a new adapter changes nothing. Its Linear calls
// forward after its own product and backward after its own gradients; what the
// products need of x and x A^T is kept only when a backward follows and that
// matrix trains (a frozen one gets no gradient, as a frozen weight). With dropout,
// in training the update reads x through an nn::Dropout (PEFT's lora_dropout: the
// base product sees x whole), whose mask backward applies to the update's dx.
template <class T, class Space>
class lora_adapter {
 public:
  using tensor = Tensor<T, Space>;

  lora_adapter(std::int64_t in, std::int64_t out, const lora_options& o)
      : o_(o), in_(in), out_(out), what_(cat("Linear(", in, " -> ", out, ") LoRA")) {
    require<shape_error>(o.r >= 1, what_, ": rank r must be at least 1, got ", o.r);
    require(o.dropout >= 0 && o.dropout < 1, what_, ": dropout must be in [0, 1), got ", o.dropout);
    dropout_ = Dropout<T, Space>(o.dropout);
    lora_A.shape = Shape{o.r, in};
    lora_A.init = init_rule::linear_default(in);
    lora_B.shape = Shape{out, o.r};
    lora_B.init = init_rule::constant_zero();
  }

  Param<T> lora_A, lora_B;

  const lora_options& options() const { return o_; }
  // alpha / r, or alpha / sqrt(r) with rslora (PEFT's scaling).
  double scaling() const { return o_.alpha / (o_.rslora ? std::sqrt(double(o_.r)) : double(o_.r)); }

  template <class V>
  void parameters(V&& v) {
    v("lora_A.weight", lora_A);
    v("lora_B.weight", lora_B);
  }

  // y += s (d(x) A^T) B^T, d the dropout (the identity unless training with dropout > 0).
  template <class Ctx>
  void forward(Ctx& ctx, const tensor& x_in, tensor& y) {
    lora_A.require_bound(what_);
    lora_B.require_bound(what_);
    const tensor x = dropout_.forward(ctx, x_in);
    const std::int64_t rows = x.numel() / in_, r = o_.r;
    tensor h(Shape{rows, r});
    product::run(ops::trans::no, ops::trans::yes, rows, r, in_, 1.0, x.data(), in_, lora_A.value, in_, 0.0, h.data(),
                 r);  // h = x A^T
    product::run(ops::trans::no, ops::trans::yes, rows, out_, r, scaling(), h.data(), r, lora_B.value, r, 1.0,
                 y.data(), out_);  // y += s h B^T
    x_.save(ctx, x, lora_A.requires_grad);
    h_.save(ctx, h, lora_B.requires_grad);
  }

  // dA += (s dy B)^T d(x), dB += s dy^T (d(x) A^T), dx += d'(s dy B A).
  template <class Ctx>
  void backward(Ctx& ctx, const tensor& dy, tensor& dx) {
    x_.require(lora_A.requires_grad, what_, " lora_A");
    h_.require(lora_B.requires_grad, what_, " lora_B");
    lora_A.require_bound(what_, lora_A.requires_grad);
    lora_B.require_bound(what_, lora_B.requires_grad);
    const std::int64_t rows = x_.numel() / in_, r = o_.r;
    const double s = scaling();
    tensor dh(Shape{rows, r});
    product::run(ops::trans::no, ops::trans::no, rows, r, out_, s, dy.data(), out_, lora_B.value, r, 0.0, dh.data(),
                 r);  // dh = s dy B
    if (lora_B.requires_grad)
      product::run(ops::trans::yes, ops::trans::no, out_, r, rows, s, dy.data(), out_, h_.values().data(), r, 1.0,
                   lora_B.grad, r);  // dB += s dy^T h
    if (lora_A.requires_grad)
      product::run(ops::trans::yes, ops::trans::no, r, in_, rows, 1.0, dh.data(), r, x_.values().data(), in_, 1.0,
                   lora_A.grad, in_);  // dA += dh^T x
    if (o_.dropout == 0) {
      product::run(ops::trans::no, ops::trans::no, rows, in_, r, 1.0, dh.data(), r, lora_A.value, in_, 1.0, dx.data(),
                   in_);  // dx += dh A
    } else {
      tensor dxd(dx.shape());
      product::run(ops::trans::no, ops::trans::no, rows, in_, r, 1.0, dh.data(), r, lora_A.value, in_, 0.0,
                   dxd.data(), in_);  // dh A, then through the dropout's mask
      const tensor d = dropout_.backward(ctx, dxd);
      product::add(dx.data(), d.data(), dx.numel());
    }
    x_.clear();
    h_.clear();
  }

  // weight += s B A, then B = 0: the Linear computes what it did (up to the weight's
  // rounding) from its weight alone, PEFT's merge followed by a fresh adapter.
  void merge(Param<T>& weight) {
    for (const Param<T>* p : {&weight, &lora_A, &lora_B}) p->require_bound(cat(what_, " merge"));
    product::run(ops::trans::no, ops::trans::no, out_, in_, o_.r, scaling(), lora_B.value, o_.r, lora_A.value, in_,
                 1.0, weight.value, in_);
    product::zero(lora_B.value, out_ * o_.r);
  }

 private:
  using product = lora_product<Space>;
  lora_options o_;
  std::int64_t in_, out_;
  std::string what_;  // "Linear(6 -> 5) LoRA", for errors
  Dropout<T, Space> dropout_{0.0};
  saved_input<tensor> x_, h_;  // x_: x after the dropout
};
}  // namespace detail

}  // namespace shardlib::nn
