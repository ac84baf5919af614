// shardlib/nn/transformer.hpp — TransformerEncoderLayer: self-attention and a
// feed-forward block, each with a residual and a LayerNorm (torch.nn.TransformerEncoderLayer).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/activation.hpp"
#include "shardlib/nn/attention.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/layer_norm.hpp"
#include "shardlib/nn/linear.hpp"

#include <cstdint>  // std::int64_t
#include <variant>  // std::variant, std::visit

namespace shardlib::nn {

// torch's activation="relu" | "gelu" (gelu is the exact erf form, as F.gelu).
enum class transformer_activation { relu, gelu };

namespace detail {
// The residual connection's a + b for tensors in Space: the host's here, the
// device's in nn/cuda/transformer.cuh.
template <class Space>
struct residual;

template <>
struct residual<host_space> {
  template <class T>
  static Tensor<T> sum(const Tensor<T>& a, const Tensor<T>& b) {
    Tensor<T> s(a.shape());
    const T *ap = a.data(), *bp = b.data();
    T* sp = s.data();
    const std::int64_t n = a.numel();
    for (std::int64_t i = 0; i < n; ++i) sp[i] = ap[i] + bp[i];  // plain pointers: vectorises
    return s;
  }
};
}  // namespace detail

// torch.nn.TransformerEncoderLayer's constructor arguments, with its defaults.
struct transformer_encoder_options {
  std::int64_t d_model = 0;
  std::int64_t nhead = 1;
  std::int64_t dim_feedforward = 2048;
  double dropout = 0.1;  // attention weights, dropout1, dropout2 and the feed-forward's dropout
  transformer_activation activation = transformer_activation::relu;
  double layer_norm_eps = 1e-5;
  bool batch_first = false;  // input [N, L, d_model] instead of [L, N, d_model]
  bool norm_first = false;   // pre-norm instead of post-norm
};

// Post-norm (torch's default):  x = norm1(x + sa(x));  x = norm2(x + ff(x))
// pre-norm (norm_first):        x = x + sa(norm1(x));  x = x + ff(norm2(x))
// with sa(x) = dropout1(self_attn(x)) and ff(x) = dropout2(linear2(dropout(act(linear1(x))))).
// Children carry torch's names, so parameters are self_attn.in_proj_weight, ...,
// norm2.bias in torch's state-dict order. Every child is called through the
// context, so a sharded context can wrap any of them as a unit. The key-padding
// mask reaches self_attn through the context (see attention.hpp). Space is
// where the children run (host_space, or cuda_space with nn/cuda/transformer.cuh).
template <class T, class Space = host_space>
class TransformerEncoderLayer {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;
  using options = transformer_encoder_options;

  explicit TransformerEncoderLayer(const options& o)
      : self_attn({.embed_dim = validated(o).d_model,
                   .num_heads = o.nhead,
                   .dropout = o.dropout,
                   .batch_first = o.batch_first}),
        linear1(o.d_model, o.dim_feedforward),
        dropout(o.dropout),
        linear2(o.dim_feedforward, o.d_model),
        norm1(o.d_model, o.layer_norm_eps),
        norm2(o.d_model, o.layer_norm_eps),
        dropout1(o.dropout),
        dropout2(o.dropout),
        o_(o),
        activation_(o.activation == transformer_activation::relu ? activation_layer(ReLU<T, Space>{})
                                                                  : activation_layer(GELU<T, Space>{})) {}

  MultiheadAttention<T, Space> self_attn;
  Linear<T, Space> linear1;
  Dropout<T, Space> dropout;
  Linear<T, Space> linear2;
  LayerNorm<T, Space> norm1, norm2;
  Dropout<T, Space> dropout1, dropout2;

  // torch's named_children(); the activation is a function there, not a module.
  template <class V>
  void children(V&& v) {
    v("self_attn", self_attn);
    v("linear1", linear1);
    v("dropout", dropout);
    v("linear2", linear2);
    v("norm1", norm1);
    v("norm2", norm2);
    v("dropout1", dropout1);
    v("dropout2", dropout2);
  }
  template <class V>
  void parameters(V&& v) {
    visit_parameters("self_attn", self_attn, v);
    visit_parameters("linear1", linear1, v);
    visit_parameters("linear2", linear2, v);
    visit_parameters("norm1", norm1, v);
    visit_parameters("norm2", norm2, v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    require<shape_error>(x.rank() == 3 && x.dim(2) == o_.d_model, "TransformerEncoderLayer(d_model ", o_.d_model,
                         ", nhead ", o_.nhead, "): input must be ", o_.batch_first ? "[N, L, " : "[L, N, ", o_.d_model,
                         "] (", o_.batch_first ? "batch" : "sequence", " first), got shape ", x.shape());
    if (o_.norm_first) {
      const input h = sum(x, attention_block(ctx, ctx.forward(norm1, x)));
      return sum(h, feedforward_block(ctx, ctx.forward(norm2, h)));
    }
    const input h = ctx.forward(norm1, sum(x, attention_block(ctx, x)));
    return ctx.forward(norm2, sum(h, feedforward_block(ctx, h)));
  }

  // Children in exactly the reverse of forward's order; each residual adds the
  // gradient that skips its block to the one that went through it.
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    if (o_.norm_first) {
      const input dh = sum(dy, ctx.backward(norm2, feedforward_backward(ctx, dy)));
      return sum(dh, ctx.backward(norm1, attention_backward(ctx, dh)));
    }
    const input dz2 = ctx.backward(norm2, dy);
    const input dz1 = ctx.backward(norm1, sum(dz2, feedforward_backward(ctx, dz2)));
    return sum(dz1, attention_backward(ctx, dz1));
  }

 private:
  using activation_layer = std::variant<ReLU<T, Space>, GELU<T, Space>>;

  // Checked before self_attn is built, so the message names this layer's options.
  static const options& validated(const options& o) {
    require<shape_error>(o.d_model > 0 && o.nhead > 0 && o.d_model % o.nhead == 0, "TransformerEncoderLayer: d_model (",
                         o.d_model, ") must be a positive multiple of nhead (", o.nhead, ")");
    require<shape_error>(o.dim_feedforward > 0, "TransformerEncoderLayer: dim_feedforward must be positive, got ",
                         o.dim_feedforward);
    return o;
  }

  template <class Ctx>
  output attention_block(Ctx& ctx, const input& x) {
    return ctx.forward(dropout1, ctx.forward(self_attn, x));
  }
  template <class Ctx>
  input attention_backward(Ctx& ctx, const output& dy) {
    return ctx.backward(self_attn, ctx.backward(dropout1, dy));
  }
  template <class Ctx>
  output feedforward_block(Ctx& ctx, const input& x) {
    const input a = std::visit(
        [&](auto& act) { return detail::linear_activation<Space>::forward(ctx, linear1, act, x); }, activation_);
    return ctx.forward(dropout2, ctx.forward(linear2, ctx.forward(dropout, a)));
  }
  template <class Ctx>
  input feedforward_backward(Ctx& ctx, const output& dy) {
    const input da = ctx.backward(dropout, ctx.backward(linear2, ctx.backward(dropout2, dy)));
    return std::visit(
        [&](auto& act) { return detail::linear_activation<Space>::backward(ctx, linear1, act, da); }, activation_);
  }

  static input sum(const input& a, const input& b) { return detail::residual<Space>::sum(a, b); }

  options o_;
  activation_layer activation_;
};

}  // namespace shardlib::nn
