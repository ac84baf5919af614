// shardlib/nn/feed_forward.hpp — the decoders' feed-forward blocks, with Hugging
// Face's child names: LlamaMLP (SwiGLU) and GPT2MLP (tanh-GELU).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/activation.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/linear.hpp"

#include <cstdint>      // std::int64_t
#include <functional>   // std::multiplies, std::plus
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

struct llama_mlp_options {
  std::int64_t hidden_size = 0;        // D
  std::int64_t intermediate_size = 0;  // I
  bool bias = false;                   // LlamaConfig.mlp_bias
};

// LLaMA's feed-forward (Shazeer 2020, https://arxiv.org/abs/2002.05202):
//   y = down_proj(silu(gate_proj(x)) * up_proj(x))
// gate_proj and up_proj are Linear(D -> I), down_proj Linear(I -> D), without
// biases unless options.bias; the children are named as Hugging Face's
// LlamaMLP (gate_proj, up_proj, down_proj, act_fn), so its parameters are
// gate_proj.weight [I, D], up_proj.weight [I, D], down_proj.weight [D, I] in
// its state-dict order. Every child runs through the context; the product is
// this layer's own.
template <class T, class Space = host_space>
class LlamaMLP {
  static_assert(std::is_same_v<Space, host_space>, "nn::LlamaMLP: a host layer only (no device version yet)");

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;
  using options = llama_mlp_options;

  explicit LlamaMLP(const options& o)
      : gate_proj(validated(o).hidden_size, o.intermediate_size, o.bias),
        up_proj(o.hidden_size, o.intermediate_size, o.bias),
        down_proj(o.intermediate_size, o.hidden_size, o.bias),
        o_(o) {}

  Linear<T> gate_proj, up_proj, down_proj;
  SiLU<T> act_fn;

  template <class V>
  void children(V&& v) {
    v("gate_proj", gate_proj);
    v("up_proj", up_proj);
    v("down_proj", down_proj);
    v("act_fn", act_fn);
  }
  template <class V>
  void parameters(V&& v) {
    visit_parameters("gate_proj", gate_proj, v);
    visit_parameters("up_proj", up_proj, v);
    visit_parameters("down_proj", down_proj, v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    require<shape_error>(x.rank() >= 1 && x.dim(x.rank() - 1) == o_.hidden_size, "LlamaMLP(", o_.hidden_size, " -> ",
                         o_.intermediate_size, "): input's last dimension must be ", o_.hidden_size, ", got shape ",
                         x.shape());
    a_ = ctx.forward(act_fn, ctx.forward(gate_proj, x));
    u_ = ctx.forward(up_proj, x);
    const Tensor<T> h = detail::elementwise(a_, u_, std::multiplies<T>{});
    if (!grad_enabled(ctx)) a_ = u_ = {};  // kept only for backward
    return ctx.forward(down_proj, h);
  }

  // h = a * u with a = silu(gate), so dh flows to a as dh * u and to u as dh * a;
  // the children run in exactly the reverse of forward's order.
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    require<shape_error>(!a_.empty(), "LlamaMLP(", o_.hidden_size, " -> ", o_.intermediate_size,
                         "): backward without a forward");
    const Tensor<T> dh = ctx.backward(down_proj, dy);
    const input dx_up = ctx.backward(up_proj, detail::elementwise(dh, a_, std::multiplies<T>{}));
    const Tensor<T> dgate = ctx.backward(act_fn, detail::elementwise(dh, u_, std::multiplies<T>{}));
    const input dx_gate = ctx.backward(gate_proj, dgate);
    a_ = u_ = {};
    return detail::elementwise(dx_gate, dx_up, std::plus<T>{});
  }

 private:
  static const options& validated(const options& o) {
    require<shape_error>(o.hidden_size > 0 && o.intermediate_size > 0,
                         "LlamaMLP: hidden_size and intermediate_size must be positive, got ", o.hidden_size, " and ",
                         o.intermediate_size);
    return o;
  }

  options o_;
  Tensor<T> a_, u_;  // silu(gate_proj(x)) and up_proj(x), cached for backward
};

struct gpt2_mlp_options {
  std::int64_t n_embd = 0;                  // D
  std::int64_t n_inner = 0;                 // the hidden width; 0 = 4 * n_embd, as GPT2Config
  double resid_pdrop = 0.1;                 // the dropout on the output, GPT2Config's default
  gelu_approx activation = gelu_approx::tanh;  // GPT-2's "gelu_new"
};

// GPT-2's feed-forward: y = dropout(c_proj(gelu_tanh(c_fc(x)))), with c_fc
// Linear(D -> n_inner) and c_proj Linear(n_inner -> D), both with biases. The
// children are named as Hugging Face's GPT2MLP (c_fc, c_proj, act, dropout); the
// residual dropout of the feed-forward branch is this layer's `dropout` child, as
// there, so a GPT-2 block adds none after it. HF stores c_fc and c_proj as Conv1D,
// whose weight is [in, out]: these are Linear's [out, in], so a checkpoint's
// weights load transposed.
template <class T, class Space = host_space>
class GPT2MLP {
  static_assert(std::is_same_v<Space, host_space>, "nn::GPT2MLP: a host layer only (no device version yet)");

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;
  using options = gpt2_mlp_options;

  explicit GPT2MLP(const options& o)
      : c_fc(validated(o).n_embd, inner(o)),
        c_proj(inner(o), o.n_embd),
        act(o.activation),
        dropout(o.resid_pdrop),
        o_(o) {}

  Linear<T> c_fc, c_proj;
  GELU<T> act;
  Dropout<T> dropout;

  std::int64_t inner_size() const { return inner(o_); }

  template <class V>
  void children(V&& v) {
    v("c_fc", c_fc);
    v("c_proj", c_proj);
    v("act", act);
    v("dropout", dropout);
  }
  template <class V>
  void parameters(V&& v) {
    visit_parameters("c_fc", c_fc, v);
    visit_parameters("c_proj", c_proj, v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    require<shape_error>(x.rank() >= 1 && x.dim(x.rank() - 1) == o_.n_embd, "GPT2MLP(", o_.n_embd, " -> ",
                         inner(o_), "): input's last dimension must be ", o_.n_embd, ", got shape ", x.shape());
    return ctx.forward(dropout, ctx.forward(c_proj, ctx.forward(act, ctx.forward(c_fc, x))));
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    return ctx.backward(c_fc, ctx.backward(act, ctx.backward(c_proj, ctx.backward(dropout, dy))));
  }

 private:
  static std::int64_t inner(const options& o) { return o.n_inner > 0 ? o.n_inner : 4 * o.n_embd; }
  static const options& validated(const options& o) {
    require<shape_error>(o.n_embd > 0 && o.n_inner >= 0, "GPT2MLP: n_embd must be positive and n_inner not negative, got ",
                         o.n_embd, " and ", o.n_inner);
    return o;
  }

  options o_;
};

}  // namespace shardlib::nn
