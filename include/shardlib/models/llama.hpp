// shardlib/models/llama.hpp — LLaMA (Touvron et al. 2023) as Hugging Face's
// LlamaForCausalLM builds it, any size from a config: RMSNorm pre-norm blocks,
// rotary positions, grouped-query attention, SwiGLU, an untied head by default.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/models/causal_lm.hpp"
#include "shardlib/models/token_ids.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/feed_forward.hpp"
#include "shardlib/nn/frozen_prefix.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/llama_attention.hpp"
#include "shardlib/nn/position_ids.hpp"
#include "shardlib/nn/rms_norm.hpp"
#include "shardlib/nn/transformer.hpp"  // nn::detail::residual

#include <cstdint>  // std::int64_t
#include <string>   // std::to_string
#include <vector>   // std::vector

namespace shardlib::models {

// LlamaConfig's fields, with transformers' defaults (LLaMA-1-7B's sizes).
struct llama_config {
  std::int64_t vocab_size = 32000;
  std::int64_t hidden_size = 4096;
  std::int64_t intermediate_size = 11008;
  std::int64_t num_hidden_layers = 32;
  std::int64_t num_attention_heads = 32;
  std::int64_t num_key_value_heads = 0;  // 0 = num_attention_heads (no grouping)
  std::int64_t head_dim = 0;             // 0 = hidden_size / num_attention_heads
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000;
  nn::rope_scaling rope_scaling{};  // none; Llama 3.1 and later: llama3 (nn/rotary.hpp)
  double initializer_range = 0.02;
  bool attention_bias = false, mlp_bias = false;
  double attention_dropout = 0;  // on the attention weights, in training
  bool tie_word_embeddings = false;
  token_ids tokens{.bos = 1, .eos = {2}};  // LlamaConfig's (Llama 2's tokenizer)
};

// layers.{i}: x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.)).
// Children in Hugging Face's registration order (self_attn, mlp, input_layernorm,
// post_attention_layernorm), so the parameters come in its state-dict order. The
// unit to wrap: shard::wrap_types<models::LlamaDecoderLayer<T>>{}
// (LlamaDecoderLayer<T, cuda_space> on the device).
template <class T, class Space = host_space>
class LlamaDecoderLayer {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;

  explicit LlamaDecoderLayer(const llama_config& c)
      : self_attn({.hidden_size = c.hidden_size,
                   .num_attention_heads = c.num_attention_heads,
                   .num_key_value_heads = c.num_key_value_heads,
                   .head_dim = c.head_dim,
                   .rope_theta = c.rope_theta,
                   .rope_scaling = c.rope_scaling,
                   .attention_bias = c.attention_bias,
                   .attention_dropout = c.attention_dropout,
                   .initializer_range = c.initializer_range}),
        mlp({.hidden_size = c.hidden_size, .intermediate_size = c.intermediate_size, .bias = c.mlp_bias}),
        input_layernorm(c.hidden_size, c.rms_norm_eps),
        post_attention_layernorm(c.hidden_size, c.rms_norm_eps) {
    for (nn::Linear<T, Space>* l : {&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj}) {  // Hugging Face's _init_weights
      l->weight.init = nn::init_rule::normal_with(0, c.initializer_range);
      l->bias.init = nn::init_rule::constant_zero();
    }
  }

  nn::LlamaAttention<T, Space> self_attn;
  nn::LlamaMLP<T, Space> mlp;
  nn::RMSNorm<T, Space> input_layernorm, post_attention_layernorm;

  template <class V>
  void children(V&& v) {
    v("self_attn", self_attn);
    v("mlp", mlp);
    v("input_layernorm", input_layernorm);
    v("post_attention_layernorm", post_attention_layernorm);
  }
  template <class V>
  void parameters(V&& v) {
    nn::visit_parameters("self_attn", self_attn, v);
    nn::visit_parameters("mlp", mlp, v);
    nn::visit_parameters("input_layernorm", input_layernorm, v);
    nn::visit_parameters("post_attention_layernorm", post_attention_layernorm, v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const output h = sum(x, ctx.forward(self_attn, ctx.forward(input_layernorm, x)));
    return sum(h, ctx.forward(mlp, ctx.forward(post_attention_layernorm, h)));
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    const output dh = sum(dy, ctx.backward(post_attention_layernorm, ctx.backward(mlp, dy)));
    return sum(dh, ctx.backward(input_layernorm, ctx.backward(self_attn, dh)));
  }

  void enable_kv_cache(std::int64_t max_seq) { self_attn.enable_kv_cache(max_seq); }
  void disable_kv_cache() { self_attn.disable_kv_cache(); }

 private:
  static output sum(const output& a, const output& b) { return nn::detail::residual<Space>::sum(a, b); }
};

namespace detail {
inline const llama_config& checked(const llama_config& c) {
  require<shape_error>(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.num_hidden_layers > 0 &&
                           c.max_position_embeddings > 0,
                       "llama_config: vocab_size (", c.vocab_size, "), hidden_size (", c.hidden_size,
                       "), intermediate_size (", c.intermediate_size, "), num_hidden_layers (", c.num_hidden_layers,
                       ") and max_position_embeddings (", c.max_position_embeddings, ") must be positive");
  return c;
}
}  // namespace detail

// `model`: ids [batch, seq] -> norm(layers.{n-1}(...layers.0(embed_tokens(ids)))).
template <class T, class Space = host_space>
class LlamaModel {
 public:
  using input = Tensor<std::int64_t, Space>;
  using output = Tensor<T, Space>;

  explicit LlamaModel(const llama_config& c)
      : embed_tokens(detail::checked(c).vocab_size, c.hidden_size),
        layers(std::size_t(c.num_hidden_layers), LlamaDecoderLayer<T, Space>(c)),
        norm(c.hidden_size, c.rms_norm_eps),
        max_position_embeddings_(c.max_position_embeddings) {
    embed_tokens.weight.init = nn::init_rule::normal_with(0, c.initializer_range);
  }

  nn::Embedding<T, Space> embed_tokens;
  std::vector<LlamaDecoderLayer<T, Space>> layers;
  nn::RMSNorm<T, Space> norm;

  template <class V>
  void children(V&& v) {
    v("embed_tokens", embed_tokens);
    for (std::size_t i = 0; i < layers.size(); ++i) v("layers." + std::to_string(i), layers[i]);
    v("norm", norm);
  }
  template <class V>
  void parameters(V&& v) {
    nn::visit_parameters("embed_tokens", embed_tokens, v);
    for (std::size_t i = 0; i < layers.size(); ++i) nn::visit_parameters("layers." + std::to_string(i), layers[i], v);
    nn::visit_parameters("norm", norm, v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& ids) {
    require<shape_error>(ids.rank() == 2, "LlamaModel: input_ids must be [batch, seq], got ", ids.shape());
    if (!ctx.position_ids().empty()) {
      nn::detail::check_position_ids(ctx.position_ids(), ids.dim(0), ids.dim(1), max_position_embeddings_,
                                     cat("LlamaModel (max_position_embeddings ", max_position_embeddings_, ")"));
    } else if constexpr (requires { layers[0].self_attn.kv_cache_length(); }) {
      const std::int64_t cached = layers.empty() ? 0 : layers[0].self_attn.kv_cache_length();
      require<shape_error>(cached + ids.shape()[1] <= max_position_embeddings_, "LlamaModel: positions ", cached, "..",
                           cached + ids.shape()[1] - 1, " (", cached, " cached, sequence ", ids.shape()[1],
                           ") exceed max_position_embeddings ", max_position_embeddings_);
    }
    prefix_.begin();
    output x = prefix_.forward(ctx, embed_tokens, ids);
    for (auto& layer : layers) x = prefix_.forward(ctx, layer, x);
    return prefix_.forward(ctx, norm, x);
  }
  // Stops below the lowest trained parameter (nn::frozen_prefix).
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    if (!prefix_.runs_backward(norm)) return {};
    output g = ctx.backward(norm, dy);
    for (auto it = layers.rbegin(); it != layers.rend(); ++it)
      if (!prefix_.backward(ctx, *it, g)) return {};
    if (!prefix_.runs_backward(embed_tokens)) return {};
    return ctx.backward(embed_tokens, g);
  }

  // RoPE's positions continue after the cached ones inside each attention layer.
  void enable_kv_cache(std::int64_t max_seq) {
    for (auto& layer : layers) layer.enable_kv_cache(max_seq);
  }
  void disable_kv_cache() {
    for (auto& layer : layers) layer.disable_kv_cache();
  }

 private:
  std::int64_t max_position_embeddings_;
  nn::frozen_prefix prefix_;
};

// Hugging Face's LlamaForCausalLM: ids [batch, seq] -> logits [batch, seq,
// vocab_size], parameters named exactly as its state dict
// (model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ...,
// lm_head.weight), all stored as Hugging Face stores them ([out, in]).
// LlamaForCausalLM<T, cuda_space> is the same model on the device (include
// shardlib/models/cuda.cuh): ids, logits and the KV cache in device memory.
template <class T, class Space = host_space>
class LlamaForCausalLM {
 public:
  using input = Tensor<std::int64_t, Space>;
  using output = Tensor<T, Space>;
  using config_type = llama_config;
  using block_type = LlamaDecoderLayer<T, Space>;

  explicit LlamaForCausalLM(const llama_config& c)
      : model(c), lm_head(c.hidden_size, c.vocab_size, c.tie_word_embeddings), c_(c) {
    if (!lm_head.tied()) lm_head.own_weight().init = nn::init_rule::normal_with(0, c.initializer_range);
    tie();
  }
  LlamaForCausalLM(const LlamaForCausalLM& o) : model(o.model), lm_head(o.lm_head), c_(o.c_) { tie(); }
  LlamaForCausalLM& operator=(const LlamaForCausalLM& o) {
    model = o.model;
    lm_head = o.lm_head;
    c_ = o.c_;
    tie();
    return *this;
  }

  LlamaModel<T, Space> model;
  LMHead<T, Space> lm_head;

  const llama_config& config() const { return c_; }
  std::int64_t max_positions() const { return c_.max_position_embeddings; }

  template <class V>
  void children(V&& v) {
    v("model", model);
    v("lm_head", lm_head);
  }
  template <class V>
  void parameters(V&& v) {
    nn::visit_parameters("model", model, v);
    nn::visit_parameters("lm_head", lm_head, v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& ids) {
    return ctx.forward(lm_head, ctx.forward(model, ids));
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    return ctx.backward(model, ctx.backward(lm_head, dy));
  }

  void enable_kv_cache(std::int64_t max_seq) { model.enable_kv_cache(max_seq); }
  void disable_kv_cache() { model.disable_kv_cache(); }

 private:
  void tie() {
    if (lm_head.tied()) lm_head.tie(model.embed_tokens.weight);
  }

  llama_config c_;
};

}  // namespace shardlib::models
