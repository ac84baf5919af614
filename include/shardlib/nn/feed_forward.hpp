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
#include <functional>   // std::plus

namespace shardlib::nn {

namespace detail {
// LlamaMLP's element-wise work in one space: the gated product h = silu(gate) *
// up, both its gradients in one pass, and the sum of the branches' input
// gradients. The host's is below, the device's (one kernel each) in
// nn/cuda/feed_forward.cuh.
template <class T, class Space>
struct swiglu_ops;

template <class T>
struct swiglu_ops<T, host_space> {
  static Tensor<T> forward(const Tensor<T>& gate, const Tensor<T>& up) {
    return elementwise(gate, up, [](T g, T u) { return silu(g) * u; });
  }
  // dup = dh * silu(gate), dgate = dh * up * silu'(gate).
  static void backward(const Tensor<T>& gate, const Tensor<T>& up, const Tensor<T>& dh, Tensor<T>& dgate,
                       Tensor<T>& dup) {
    dgate = Tensor<T>(gate.shape());
    dup = Tensor<T>(gate.shape());
    const T *gp = gate.data(), *upp = up.data(), *dhp = dh.data();
    T *dgp = dgate.data(), *dupp = dup.data();
    const std::int64_t n = gate.numel();
    for (std::int64_t i = 0; i < n; ++i) {
      dupp[i] = dhp[i] * silu(gp[i]);
      dgp[i] = silu_backward(gp[i], dhp[i] * upp[i]);
    }
  }
  static Tensor<T> add(const Tensor<T>& a, const Tensor<T>& b) { return elementwise(a, b, std::plus<T>{}); }
};
}  // namespace detail

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
// its state-dict order. The projections run through the context; silu and the
// product are one fused step (detail::swiglu_ops: one loop on the host, one
// kernel on the device), so act_fn is a child for Hugging Face's structure
// only and is never run. Space is where tensors and parameters live; for
// cuda_space include shardlib/nn/cuda/feed_forward.cuh.
template <class T, class Space = host_space>
class LlamaMLP {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;
  using options = llama_mlp_options;

  explicit LlamaMLP(const options& o)
      : gate_proj(validated(o).hidden_size, o.intermediate_size, o.bias),
        up_proj(o.hidden_size, o.intermediate_size, o.bias),
        down_proj(o.intermediate_size, o.hidden_size, o.bias),
        o_(o) {}

  Linear<T, Space> gate_proj, up_proj, down_proj;
  SiLU<T, Space> act_fn;

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
    const Tensor<T, Space> gate = ctx.forward(gate_proj, x), up = ctx.forward(up_proj, x);
    if (grad_enabled(ctx)) {  // kept only for backward
      gate_ = gate;
      up_ = up;
    }
    return ctx.forward(down_proj, gated::forward(gate, up));
  }

  // h = silu(gate) * up, so dh flows to up as dh * silu(gate) and to gate as
  // dh * up * silu'(gate); the children run in exactly the reverse of forward's order.
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    require<shape_error>(!gate_.empty(), "LlamaMLP(", o_.hidden_size, " -> ", o_.intermediate_size,
                         "): backward without a forward");
    const Tensor<T, Space> dh = ctx.backward(down_proj, dy);
    Tensor<T, Space> dgate, dup;
    gated::backward(gate_, up_, dh, dgate, dup);
    gate_ = up_ = {};
    const input dx_up = ctx.backward(up_proj, dup);
    const input dx_gate = ctx.backward(gate_proj, dgate);
    return gated::add(dx_gate, dx_up);
  }

 private:
  using gated = detail::swiglu_ops<T, Space>;

  static const options& validated(const options& o) {
    require<shape_error>(o.hidden_size > 0 && o.intermediate_size > 0,
                         "LlamaMLP: hidden_size and intermediate_size must be positive, got ", o.hidden_size, " and ",
                         o.intermediate_size);
    return o;
  }

  options o_;
  Tensor<T, Space> gate_, up_;  // gate_proj(x) and up_proj(x), cached for backward
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
// weights load transposed. Space is where tensors and parameters live; for
// cuda_space include shardlib/nn/cuda/feed_forward.cuh. There the tanh-GELU is
// c_fc's (Linear::fuse_activation: cuBLASLt's epilogue in 16 bits where n_inner is
// a multiple of 8, else the Linear's own GELU kernel) and `act` is not called, so
// after a forward c_fc alone gives GELU(c_fc(x)); the erf GELU is `act` as here.
template <class T, class Space = host_space>
class GPT2MLP {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;
  using options = gpt2_mlp_options;

  explicit GPT2MLP(const options& o)
      : c_fc(validated(o).n_embd, inner(o)),
        c_proj(inner(o), o.n_embd),
        act(o.activation),
        dropout(o.resid_pdrop),
        o_(o) {}

  Linear<T, Space> c_fc, c_proj;
  GELU<T, Space> act;
  Dropout<T, Space> dropout;

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
    return ctx.forward(dropout, ctx.forward(c_proj, detail::linear_activation<Space>::forward(ctx, c_fc, act, x)));
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    return detail::linear_activation<Space>::backward(ctx, c_fc, act, ctx.backward(c_proj, ctx.backward(dropout, dy)));
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
