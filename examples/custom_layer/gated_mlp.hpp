// examples/custom_layer/gated_mlp.hpp — a layer shardlib does not ship, written only
// against the Layer concept: a gated MLP (SwiGLU, as in LLaMA's feed-forward),
//   y = W_down (silu(W_gate x) * (W_up x)),   silu(g) = g * sigmoid(g).
// It owns no storage: an owner (nn::Replicated, or a sharded unit) binds its
// Param views, so it shards like any library layer without a line of change. It
// checks they are bound before use, as the library's layers do: run outside the
// context that gathers it, it raises naming the parameter instead of crashing.
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/core/tensor.hpp>
#include <shardlib/nn/layer.hpp>
#include <shardlib/nn/param.hpp>
#include <shardlib/ops/gemm.hpp>

#include <cmath>    // std::exp
#include <cstdint>  // std::int64_t

namespace example {

using shardlib::Shape;
using shardlib::Tensor;
using shardlib::nn::init_rule;
using shardlib::nn::Param;
namespace ops = shardlib::ops;

// x [..., d_model] -> y [..., d_model] through a hidden width `hidden`; weights
// without biases, named as LLaMA's (gate_proj, up_proj, down_proj), each
// initialised as nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
template <class T>
class GatedMLP {
 public:
  using input = Tensor<T>;
  using output = Tensor<T>;

  GatedMLP(std::int64_t d_model, std::int64_t hidden) : d_(d_model), h_(hidden) {
    gate_proj.shape = Shape{h_, d_};
    gate_proj.init = init_rule::linear_default(d_);
    up_proj.shape = Shape{h_, d_};
    up_proj.init = init_rule::linear_default(d_);
    down_proj.shape = Shape{d_, h_};
    down_proj.init = init_rule::linear_default(h_);
  }

  Param<T> gate_proj, up_proj, down_proj;

  template <class V>
  void parameters(V&& v) {
    v("gate_proj.weight", gate_proj);
    v("up_proj.weight", up_proj);
    v("down_proj.weight", down_proj);
  }

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    shardlib::require<shardlib::shape_error>(x.rank() >= 1 && x.dim(x.rank() - 1) == d_, "GatedMLP(", d_, ", ", h_,
                                             "): input's last dimension must be ", d_, ", got shape ", x.shape());
    for (const auto* p : {&gate_proj, &up_proj, &down_proj}) p->require_bound("GatedMLP");
    using enum ops::trans;
    const std::int64_t rows = x.numel() / d_;
    x_ = x;
    g_ = Tensor<T>(Shape{rows, h_});
    u_ = Tensor<T>(Shape{rows, h_});
    ops::gemm(no, yes, rows, h_, d_, T(1), x.data(), d_, gate_proj.value, d_, T(0), g_.data(), h_);
    ops::gemm(no, yes, rows, h_, d_, T(1), x.data(), d_, up_proj.value, d_, T(0), u_.data(), h_);
    Tensor<T> a(Shape{rows, h_});
    for (std::int64_t i = 0; i < a.numel(); ++i) a[i] = g_[i] * sigmoid(g_[i]) * u_[i];
    output y(x.shape());
    ops::gemm(no, yes, rows, d_, h_, T(1), a.data(), h_, down_proj.value, h_, T(0), y.data(), d_);
    return y;
  }

  // With a = silu(g) * u and da = dy W_down:
  //   dg = da * u * silu'(g),  silu'(g) = s (1 + g (1 - s)), s = sigmoid(g);   du = da * silu(g);
  //   dW_down += dy^T a;  dW_gate += dg^T x;  dW_up += du^T x;  dx = dg W_gate + du W_up.
  // Gradients are added (+=), as the Layer contract asks, so micro-batches accumulate.
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    shardlib::require<shardlib::shape_error>(!x_.empty() && dy.shape() == x_.shape(), "GatedMLP(", d_, ", ", h_,
                                             "): backward needs the gradient of the last forward's output (shape ",
                                             x_.shape(), "), got shape ", dy.shape());
    for (const auto* p : {&gate_proj, &up_proj, &down_proj}) p->require_bound("GatedMLP", true);
    using enum ops::trans;
    const std::int64_t rows = x_.numel() / d_;
    Tensor<T> a(Shape{rows, h_}), da(Shape{rows, h_}), dg(Shape{rows, h_}), du(Shape{rows, h_});
    // a is recomputed rather than cached: one [rows, hidden] tensor less held between the passes.
    for (std::int64_t i = 0; i < a.numel(); ++i) a[i] = g_[i] * sigmoid(g_[i]) * u_[i];
    ops::gemm(no, no, rows, h_, d_, T(1), dy.data(), d_, down_proj.value, h_, T(0), da.data(), h_);
    ops::gemm(yes, no, d_, h_, rows, T(1), dy.data(), d_, a.data(), h_, T(1), down_proj.grad, h_);
    for (std::int64_t i = 0; i < da.numel(); ++i) {
      const T s = sigmoid(g_[i]);
      dg[i] = da[i] * u_[i] * s * (T(1) + g_[i] * (T(1) - s));
      du[i] = da[i] * g_[i] * s;
    }
    ops::gemm(yes, no, h_, d_, rows, T(1), dg.data(), h_, x_.data(), d_, T(1), gate_proj.grad, d_);
    ops::gemm(yes, no, h_, d_, rows, T(1), du.data(), h_, x_.data(), d_, T(1), up_proj.grad, d_);
    input dx(x_.shape());
    ops::gemm(no, no, rows, d_, h_, T(1), dg.data(), h_, gate_proj.value, d_, T(0), dx.data(), d_);
    ops::gemm(no, no, rows, d_, h_, T(1), du.data(), h_, up_proj.value, d_, T(1), dx.data(), d_);
    x_ = g_ = u_ = {};
    return dx;
  }

 private:
  static T sigmoid(T v) { return T(1) / (T(1) + std::exp(-v)); }

  std::int64_t d_, h_;
  Tensor<T> x_, g_, u_;  // cached for backward: the input and both projections
};

}  // namespace example
