// shardlib/nn/llama_attention.hpp — LlamaAttention: LLaMA's causal self-attention
// with grouped-query attention and rotary embeddings (Hugging Face's
// LlamaAttention), parameters under its names.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/decoder_attention.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/rotary.hpp"
#include "shardlib/nn/transformer.hpp"  // detail::residual: the sum of the three projections' dx

#include <array>    // std::array
#include <cstdint>  // std::int64_t

namespace shardlib::nn {

// LlamaConfig's names for what the attention uses.
struct llama_attention_options {
  std::int64_t hidden_size = 0;
  std::int64_t num_attention_heads = 1;
  std::int64_t num_key_value_heads = 0;  // 0 = num_attention_heads (no grouping)
  std::int64_t head_dim = 0;             // 0 = hidden_size / num_attention_heads
  double rope_theta = 10000;             // RoPE's base
  nn::rope_scaling rope_scaling{};       // RoPE's frequencies stretched (nn/rotary.hpp); none by default
  bool attention_bias = false;           // biases on all four projections
  double attention_dropout = 0;          // on the attention weights, in training
  double initializer_range = 0.02;       // weights ~ N(0, initializer_range), biases 0
};

// x [batch, seq, hidden] -> y of the same shape. Children as Hugging Face names
// them: q_proj [H hd, hidden], k_proj and v_proj [Hkv hd, hidden], o_proj
// [hidden, H hd] (torch's [out, in], as Hugging Face stores them: no transpose on
// import). Head h of a projection is columns [h hd, (h + 1) hd). RoPE
// (nn/rotary.hpp, base rope_theta, frequencies scaled by rope_scaling) turns q
// and k at positions 0.. (or after the cached ones), query head h reads kv head
// h / (H / Hkv), scores are q.k / sqrt(hd), causal, with the context's key
// padding and attention masks. Parameter binding checks, the KV cache and Space
// as GPT2Attention's (on the device RoPE is ops::cuda's rotary kernel).
template <class T, class Space = host_space>
class LlamaAttention {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;
  using options = llama_attention_options;

  explicit LlamaAttention(const options& o)
      : o_(resolved(o)),
        q_proj(o_.hidden_size, o_.num_attention_heads * o_.head_dim, o_.attention_bias),
        k_proj(o_.hidden_size, o_.num_key_value_heads * o_.head_dim, o_.attention_bias),
        v_proj(o_.hidden_size, o_.num_key_value_heads * o_.head_dim, o_.attention_bias),
        o_proj(o_.num_attention_heads * o_.head_dim, o_.hidden_size, o_.attention_bias),
        core_(cat("LlamaAttention(hidden_size ", o_.hidden_size, ", heads ", o_.num_attention_heads, ", kv_heads ",
                  o_.num_key_value_heads, ", head_dim ", o_.head_dim, ")"),
              {.heads = o_.num_attention_heads,
               .kv_heads = o_.num_key_value_heads,
               .head_dim = o_.head_dim,
               .dropout = o_.attention_dropout,
               .rotary = rotary_options{.head_dim = o_.head_dim, .base = o_.rope_theta, .scaling = o_.rope_scaling}}) {
    for (Linear<T, Space>* l : projections()) {
      l->weight.init = init_rule::normal_with(0, o_.initializer_range);
      l->bias.init = init_rule::constant_zero();
    }
  }

 private:
  options o_;  // resolved: no zeros standing for defaults; before the children, which it sizes

 public:
  Linear<T, Space> q_proj, k_proj, v_proj, o_proj;

  const options& config() const { return o_; }

  template <class V>
  void children(V&& v) {
    v("q_proj", q_proj);
    v("k_proj", k_proj);
    v("v_proj", v_proj);
    v("o_proj", o_proj);
  }
  template <class V>
  void parameters(V&& v) {
    visit_parameters("q_proj", q_proj, v);
    visit_parameters("k_proj", k_proj, v);
    visit_parameters("v_proj", v_proj, v);
    visit_parameters("o_proj", o_proj, v);
  }

  void enable_kv_cache(std::int64_t max_seq) { core_.enable_kv_cache(max_seq); }
  void disable_kv_cache() { core_.disable_kv_cache(); }
  void reset_kv_cache() { core_.reset_kv_cache(); }
  std::int64_t kv_cache_length() const { return core_.kv_cache_length(); }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    require<shape_error>(x.rank() == 3 && x.dim(2) == o_.hidden_size, core_.name(), ": input must be [batch, seq, ",
                         o_.hidden_size, "], got shape ", x.shape());
    q_ = ctx.forward(q_proj, x);
    k_ = ctx.forward(k_proj, x);
    v_ = ctx.forward(v_proj, x);
    attn_ = Tensor<T, Space>({x.dim(0), x.dim(1), o_.num_attention_heads * o_.head_dim});
    core_.forward(ctx, heads(q_), heads(k_), heads(v_), heads(attn_));
    const Tensor<T, Space> attn = attn_;
    if (!grad_enabled(ctx)) q_ = k_ = v_ = attn_ = {};  // kept only for backward
    return ctx.forward(o_proj, attn);
  }

  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    require_activations(!q_.empty(), core_.name());
    require<shape_error>(dy.rank() == 3 && dy.dim(0) == q_.dim(0) && dy.dim(1) == q_.dim(1) &&
                             dy.dim(2) == o_.hidden_size,
                         core_.name(), ": backward needs the gradient of the last forward's output, got shape ",
                         dy.shape());
    const Tensor<T, Space> dattn = ctx.backward(o_proj, dy);
    Tensor<T, Space> dq(q_.shape()), dk(k_.shape()), dv(v_.shape());
    core_.backward(heads(dattn), heads(dq), heads(dk), heads(dv));
    q_ = k_ = v_ = attn_ = {};
    const input dx_v = ctx.backward(v_proj, dv), dx_k = ctx.backward(k_proj, dk);
    return detail::residual<Space>::sum(detail::residual<Space>::sum(dx_v, dx_k), ctx.backward(q_proj, dq));
  }

 private:
  static options resolved(options o) {
    const std::int64_t H = o.num_attention_heads;
    if (o.num_key_value_heads == 0) o.num_key_value_heads = H;
    require<shape_error>(o.hidden_size > 0 && H > 0, "LlamaAttention: hidden_size (", o.hidden_size,
                         ") and num_attention_heads (", H, ") must be positive");
    if (o.head_dim == 0) {
      require<shape_error>(o.hidden_size % H == 0, "LlamaAttention: hidden_size (", o.hidden_size,
                           ") must be a multiple of num_attention_heads (", H, ") unless head_dim is given");
      o.head_dim = o.hidden_size / H;
    }
    return o;
  }
  std::array<Linear<T, Space>*, 4> projections() { return {&q_proj, &k_proj, &v_proj, &o_proj}; }
  // The heads of a [B, S, heads * head_dim] projection.
  head_view<T> heads(const Tensor<T, Space>& t) const {
    return head_view<T>::rows(t.data(), t.dim(0), t.dim(1), t.dim(2) / o_.head_dim, o_.head_dim, t.dim(2));
  }

  detail::decoder_attention<T, Space> core_;
  // Cached by forward for backward: the projections, q and k rotated, and the
  // attention's output (the device's fused backward reads it).
  Tensor<T, Space> q_, k_, v_, attn_;
};

}  // namespace shardlib::nn
