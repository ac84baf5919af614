// shardlib/models/gpt2.hpp — GPT-2 (Radford et al. 2019) as Hugging Face's
// GPT2LMHeadModel builds it, any size from a config: its parameter names, its
// initialisation, its numerics (pre-norm blocks, learned positions, tanh-GELU,
// the LM head tied to the token embedding).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/models/causal_lm.hpp"
#include "shardlib/models/token_ids.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/feed_forward.hpp"
#include "shardlib/nn/frozen_prefix.hpp"
#include "shardlib/nn/gpt2_attention.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/layer_norm.hpp"
#include "shardlib/nn/transformer.hpp"  // nn::detail::residual

#include <cmath>    // std::sqrt
#include <cstdint>  // std::int64_t
#include <string>   // std::to_string
#include <vector>   // std::vector

namespace shardlib::models {

// GPT2Config's fields and defaults (GPT-2 small, 124M parameters).
struct gpt2_config {
  std::int64_t vocab_size = 50257;
  std::int64_t n_positions = 1024;
  std::int64_t n_embd = 768;
  std::int64_t n_layer = 12;
  std::int64_t n_head = 12;
  std::int64_t n_inner = 0;  // the MLP's width; 0 = 4 n_embd
  double resid_pdrop = 0.1, embd_pdrop = 0.1, attn_pdrop = 0.1;
  double layer_norm_epsilon = 1e-5;
  double initializer_range = 0.02;
  bool tie_word_embeddings = true;  // lm_head.weight is transformer.wte.weight
  token_ids tokens{.bos = 50256, .eos = {50256}};  // GPT2Config's: <|endoftext|>
};

// h.{i}: x + attn(ln_1(x)), then + mlp(ln_2(.)) (pre-norm; each branch's residual
// dropout is inside it, as Hugging Face's GPT2Block). The unit to wrap:
// shard::wrap_types<models::GPT2Block<T>>{} (GPT2Block<T, cuda_space> on the device).
template <class T, class Space = host_space>
class GPT2Block {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;

  explicit GPT2Block(const gpt2_config& c)
      : ln_1(c.n_embd, c.layer_norm_epsilon),
        attn({.n_embd = c.n_embd,
              .n_head = c.n_head,
              .attn_pdrop = c.attn_pdrop,
              .resid_pdrop = c.resid_pdrop,
              .initializer_range = c.initializer_range}),
        ln_2(c.n_embd, c.layer_norm_epsilon),
        mlp({.n_embd = c.n_embd, .n_inner = c.n_inner, .resid_pdrop = c.resid_pdrop}) {
    // Hugging Face's init: N(0, r) weights, zero biases, and the projections that
    // write into the residual stream scaled by 1 / sqrt(2 n_layer) (GPT-2 paper, 2.3).
    const double r = c.initializer_range, scaled = r / std::sqrt(2.0 * double(c.n_layer));
    attn.c_proj.weight.init = nn::init_rule::normal_with(0, scaled);
    mlp.c_fc.weight.init = nn::init_rule::normal_with(0, r);
    mlp.c_proj.weight.init = nn::init_rule::normal_with(0, scaled);
    mlp.c_fc.bias.init = mlp.c_proj.bias.init = nn::init_rule::constant_zero();
  }

  nn::LayerNorm<T, Space> ln_1;
  nn::GPT2Attention<T, Space> attn;
  nn::LayerNorm<T, Space> ln_2;
  nn::GPT2MLP<T, Space> mlp;

  template <class V>
  void children(V&& v) {
    v("ln_1", ln_1);
    v("attn", attn);
    v("ln_2", ln_2);
    v("mlp", mlp);
  }
  template <class V>
  void parameters(V&& v) {
    nn::visit_parameters("ln_1", ln_1, v);
    nn::visit_parameters("attn", attn, v);
    nn::visit_parameters("ln_2", ln_2, v);
    nn::visit_parameters("mlp", mlp, v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const output h = sum(x, ctx.forward(attn, ctx.forward(ln_1, x)));
    return sum(h, ctx.forward(mlp, ctx.forward(ln_2, h)));
  }
  // Each residual passes dy on and adds its branch's gradient.
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    const output dh = sum(dy, ctx.backward(ln_2, ctx.backward(mlp, dy)));
    return sum(dh, ctx.backward(ln_1, ctx.backward(attn, dh)));
  }

  void enable_kv_cache(std::int64_t max_seq) { attn.enable_kv_cache(max_seq); }
  void disable_kv_cache() { attn.disable_kv_cache(); }

 private:
  static output sum(const output& a, const output& b) { return nn::detail::residual<Space>::sum(a, b); }
};

namespace detail {
inline const gpt2_config& checked(const gpt2_config& c) {
  require<shape_error>(c.vocab_size > 0 && c.n_positions > 0 && c.n_embd > 0 && c.n_layer > 0 && c.n_head > 0 &&
                           c.n_embd % c.n_head == 0,
                       "gpt2_config: vocab_size (", c.vocab_size, "), n_positions (", c.n_positions, "), n_layer (",
                       c.n_layer, ") and n_head (", c.n_head, ") must be positive and n_embd (", c.n_embd,
                       ") a positive multiple of n_head");
  return c;
}
}  // namespace detail

// `transformer`: ids [batch, seq] -> hidden states [batch, seq, n_embd]:
// ln_f(h.{n-1}(...h.0(drop(wte(ids) + wpe(positions))))).
template <class T, class Space = host_space>
class GPT2Model {
 public:
  using input = Tensor<std::int64_t, Space>;
  using output = Tensor<T, Space>;

  explicit GPT2Model(const gpt2_config& c)
      : wte(detail::checked(c).vocab_size, c.n_embd),
        wpe(c.n_positions, c.n_embd),
        drop(c.embd_pdrop),
        h(std::size_t(c.n_layer), GPT2Block<T, Space>(c)),
        ln_f(c.n_embd, c.layer_norm_epsilon) {
    wte.weight.init = wpe.weight.init = nn::init_rule::normal_with(0, c.initializer_range);
  }

  nn::Embedding<T, Space> wte;
  nn::PositionEmbedding<T, Space> wpe;
  nn::Dropout<T, Space> drop;
  std::vector<GPT2Block<T, Space>> h;
  nn::LayerNorm<T, Space> ln_f;

  template <class V>
  void children(V&& v) {
    v("wte", wte);
    v("wpe", wpe);
    v("drop", drop);
    for (std::size_t i = 0; i < h.size(); ++i) v("h." + std::to_string(i), h[i]);
    v("ln_f", ln_f);
  }
  template <class V>
  void parameters(V&& v) {
    nn::visit_parameters("wte", wte, v);
    nn::visit_parameters("wpe", wpe, v);
    for (std::size_t i = 0; i < h.size(); ++i) nn::visit_parameters("h." + std::to_string(i), h[i], v);
    nn::visit_parameters("ln_f", ln_f, v);
  }

  // With the KV cache on, positions continue after the cached ones; the context's
  // position ids, when set, give each token's position instead (wpe reads them).
  template <class Ctx>
  output forward(Ctx& ctx, const input& ids) {
    require<shape_error>(ids.rank() == 2, "GPT2Model: input_ids must be [batch, seq], got ", ids.shape());
    wpe.set_offset(h.front().attn.kv_cache_length());
    prefix_.begin();
    output x = prefix_.forward(ctx, drop, prefix_.forward(ctx, wpe, prefix_.forward(ctx, wte, ids)));
    for (auto& block : h) x = prefix_.forward(ctx, block, x);
    return prefix_.forward(ctx, ln_f, x);
  }
  // Stops below the lowest trained parameter (nn::frozen_prefix).
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    if (!prefix_.runs_backward(ln_f)) return {};
    output g = ctx.backward(ln_f, dy);
    for (auto it = h.rbegin(); it != h.rend(); ++it)
      if (!prefix_.backward(ctx, *it, g)) return {};
    if (!prefix_.backward(ctx, drop, g) || !prefix_.backward(ctx, wpe, g) || !prefix_.runs_backward(wte)) return {};
    return ctx.backward(wte, g);
  }

  void enable_kv_cache(std::int64_t max_seq) {
    for (auto& block : h) block.enable_kv_cache(max_seq);
  }
  void disable_kv_cache() {
    for (auto& block : h) block.disable_kv_cache();
  }

 private:
  nn::frozen_prefix prefix_;
};

// Hugging Face's GPT2LMHeadModel: ids [batch, seq] -> logits [batch, seq,
// vocab_size], parameters named exactly as its state dict
// (transformer.wte.weight, transformer.h.0.attn.c_attn.weight, ...,
// lm_head.weight). Linear weights are [out, in]: Hugging Face's Conv1D files hold
// them transposed (models::load_hf / save_hf convert). The tied head borrows
// transformer.wte.weight; copies and moves re-tie to their own embedding.
// GPT2LMHeadModel<T, cuda_space> is the same model on the device (include
// shardlib/models/cuda.cuh): ids, logits and the KV cache in device memory.
template <class T, class Space = host_space>
class GPT2LMHeadModel {
 public:
  using input = Tensor<std::int64_t, Space>;
  using output = Tensor<T, Space>;
  using config_type = gpt2_config;
  using block_type = GPT2Block<T, Space>;

  explicit GPT2LMHeadModel(const gpt2_config& c)
      : transformer(c), lm_head(c.n_embd, c.vocab_size, c.tie_word_embeddings), c_(c) {
    if (!lm_head.tied()) lm_head.own_weight().init = nn::init_rule::normal_with(0, c.initializer_range);
    tie();
  }
  GPT2LMHeadModel(const GPT2LMHeadModel& o) : transformer(o.transformer), lm_head(o.lm_head), c_(o.c_) { tie(); }
  GPT2LMHeadModel& operator=(const GPT2LMHeadModel& o) {
    transformer = o.transformer;
    lm_head = o.lm_head;
    c_ = o.c_;
    tie();
    return *this;
  }

  GPT2Model<T, Space> transformer;
  LMHead<T, Space> lm_head;

  const gpt2_config& config() const { return c_; }
  std::int64_t max_positions() const { return c_.n_positions; }

  template <class V>
  void children(V&& v) {
    v("transformer", transformer);
    v("lm_head", lm_head);
  }
  template <class V>
  void parameters(V&& v) {
    nn::visit_parameters("transformer", transformer, v);
    nn::visit_parameters("lm_head", lm_head, v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& ids) {
    return ctx.forward(lm_head, ctx.forward(transformer, ids));
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    return ctx.backward(transformer, ctx.backward(lm_head, dy));
  }

  // For generate(): every attention layer keeps up to max_seq positions; forward
  // then takes only the new tokens (not training). disable_kv_cache() drops them.
  void enable_kv_cache(std::int64_t max_seq) { transformer.enable_kv_cache(max_seq); }
  void disable_kv_cache() { transformer.disable_kv_cache(); }

 private:
  void tie() {
    if (lm_head.tied()) lm_head.tie(transformer.wte.weight);
  }

  gpt2_config c_;
};

}  // namespace shardlib::models
