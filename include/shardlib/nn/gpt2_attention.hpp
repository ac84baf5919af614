// shardlib/nn/gpt2_attention.hpp — GPT2Attention: GPT-2's causal self-attention
// (Hugging Face's GPT2Attention), parameters under its names.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/decoder_attention.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/param.hpp"

#include <array>    // std::array
#include <cstdint>  // std::int64_t
#include <optional> // std::nullopt

namespace shardlib::nn {

// GPT2Config's names for what the attention uses.
struct gpt2_attention_options {
  std::int64_t n_embd = 0;
  std::int64_t n_head = 1;
  double attn_pdrop = 0;            // on the attention weights, in training
  double resid_pdrop = 0;           // on the output (resid_dropout), in training
  double initializer_range = 0.02;  // weights ~ N(0, initializer_range), biases 0
};

// x [batch, seq, n_embd] -> y of the same shape. Children as Hugging Face names
// them: c_attn = Linear(E, 3E) whose output holds q, k, v in that order (head h
// is columns [h D, (h + 1) D) of each third, D = E / n_head), c_proj =
// Linear(E, E), resid_dropout. Scores are q.k / sqrt(D), causal, with the
// context's key padding and attention masks (nn::attn_mask; torch SDPA's
// meaning); dropout on the weights as attn_dropout does.
//
// Layout: Hugging Face stores GPT-2's Conv1D weights transposed, [in, out]
// (c_attn.weight [E, 3E]); Linear keeps torch's [out, in], so importing a GPT-2
// checkpoint transposes c_attn.weight and c_proj.weight (biases as they are).
// Init: normal(0, initializer_range) weights and zero biases, as Conv1D; GPT-2's
// scaled c_proj init (std / sqrt(2 n_layer)) is the model's to set on
// c_proj.weight.init.
//
// The parameters are the children's, and each Linear checks its own binding
// (Param::require_bound) when the context runs it: checked here up front they
// would fail under FullShard, where a child that is a unit is gathered only
// when ctx.forward reaches it.
//
// KV cache: enable_kv_cache(max_seq) and, not training, each forward takes only
// the new positions and attends to every cached one (key padding mask [batch,
// cached + new]); reset_kv_cache() starts a new sequence. Backward then raises.
//
// Space: the host's layer by default; with cuda_space (include
// shardlib/nn/cuda/decoder_attention.cuh) the projections are device Linears and
// the attention between them the fused kernel (detail::decoder_attention<T,
// cuda_space>: causal and key padding only, the KV cache in device memory).
template <class T, class Space = host_space>
class GPT2Attention {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;
  using options = gpt2_attention_options;

  explicit GPT2Attention(const options& o)
      : c_attn(o.n_embd, 3 * o.n_embd), c_proj(o.n_embd, o.n_embd), resid_dropout(o.resid_pdrop), o_(o),
        core_(cat("GPT2Attention(n_embd ", o.n_embd, ", n_head ", o.n_head, ")"), core_options(o)) {
    for (Linear<T, Space>* l : {&c_attn, &c_proj}) {
      l->weight.init = init_rule::normal_with(0, o.initializer_range);
      l->bias.init = init_rule::constant_zero();
    }
  }

  Linear<T, Space> c_attn, c_proj;
  Dropout<T, Space> resid_dropout;

  template <class V>
  void children(V&& v) {
    v("c_attn", c_attn);
    v("c_proj", c_proj);
    v("resid_dropout", resid_dropout);
  }
  template <class V>
  void parameters(V&& v) {
    visit_parameters("c_attn", c_attn, v);
    visit_parameters("c_proj", c_proj, v);
  }

  void enable_kv_cache(std::int64_t max_seq) { core_.enable_kv_cache(max_seq); }
  void disable_kv_cache() { core_.disable_kv_cache(); }
  void reset_kv_cache() { core_.reset_kv_cache(); }
  std::int64_t kv_cache_length() const { return core_.kv_cache_length(); }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const std::int64_t E = o_.n_embd;
    require<shape_error>(x.rank() == 3 && x.dim(2) == E, core_.name(), ": input must be [batch, seq, ", E,
                         "], got shape ", x.shape());
    qkv_ = ctx.forward(c_attn, x);
    attn_ = Tensor<T, Space>(x.shape());
    const auto [q, k, v] = thirds(qkv_);
    core_.forward(ctx, q, k, v, heads(attn_.data(), E));
    const Tensor<T, Space> attn = attn_;
    if (!grad_enabled(ctx)) qkv_ = attn_ = {};  // kept only for backward
    return ctx.forward(resid_dropout, ctx.forward(c_proj, attn));
  }

  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    require_activations(!qkv_.empty(), core_.name());
    require<shape_error>(dy.rank() == 3 && dy.dim(0) == qkv_.dim(0) && dy.dim(1) == qkv_.dim(1) &&
                             dy.dim(2) == o_.n_embd,
                         core_.name(), ": backward needs the gradient of the last forward's output, got shape ",
                         dy.shape());
    const Tensor<T, Space> dattn = ctx.backward(c_proj, ctx.backward(resid_dropout, dy));
    Tensor<T, Space> dqkv(qkv_.shape());
    const auto [dq, dk, dv] = thirds(dqkv);
    core_.backward(heads(dattn.data(), o_.n_embd), dq, dk, dv);
    qkv_ = attn_ = {};
    return ctx.backward(c_attn, dqkv);
  }

 private:
  static detail::decoder_attention_options core_options(const options& o) {
    require<shape_error>(o.n_embd > 0 && o.n_head > 0 && o.n_embd % o.n_head == 0, "GPT2Attention: n_embd (", o.n_embd,
                         ") must be a positive multiple of n_head (", o.n_head, ")");
    return {.heads = o.n_head,
            .kv_heads = o.n_head,
            .head_dim = o.n_embd / o.n_head,
            .dropout = o.attn_pdrop,
            .rotary = std::nullopt};
  }
  // The heads of rows [B, S, ...] of `row_stride` columns starting at data.
  head_view<T> heads(T* data, std::int64_t row_stride) const {
    return head_view<T>::rows(data, qkv_.dim(0), qkv_.dim(1), o_.n_head, o_.n_embd / o_.n_head, row_stride);
  }
  // q, k, v of a [B, S, 3E] tensor.
  std::array<head_view<T>, 3> thirds(const Tensor<T, Space>& t) const {
    const std::int64_t E = o_.n_embd;
    return {heads(t.data(), 3 * E), heads(t.data() + E, 3 * E), heads(t.data() + 2 * E, 3 * E)};
  }

  options o_;
  detail::decoder_attention<T, Space> core_;
  // Cached for backward: c_attn's output [B, S, 3E] (q and k as attention read
  // them) and the attention's output [B, S, E] (the device's fused backward reads it).
  Tensor<T, Space> qkv_, attn_;
};

}  // namespace shardlib::nn
