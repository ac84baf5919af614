// shardlib/io/hf_checkpoint.hpp — Hugging Face's conventions for GPT2LMHeadModel and
// LlamaForCausalLM checkpoints, as io::state_dict_options for load_state_dict and
// save_state_dict, for models whose parameters carry transformers' own names
// ("transformer.h.0.attn.c_attn.weight", "model.layers.0.self_attn.q_proj.weight").
//
//   io::load_state_dict("gpt2-dir", model, io::hf::gpt2());      // model.safetensors, or the index
//   io::save_state_dict("out/model.safetensors", model, io::hf::gpt2());
//
// Saving writes what save_pretrained writes: F32 (set save_dtype for another dtype),
// metadata {"format": "pt"}, the tied lm_head.weight left out; config.json is the caller's.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"   // dtype
#include "shardlib/io/state_dict.hpp"  // state_dict_options, name_map

#include <optional>     // std::optional
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <utility>      // std::move

namespace shardlib::io::hf {

// GPT2LMHeadModel: Conv1D stores the weights of c_attn, c_proj (attention and MLP) and
// c_fc as [in, out], transposed from a Linear's [out, in]; lm_head.weight is tied to
// transformer.wte.weight and absent from the files transformers writes. Files saved from
// a GPT2Model (the hub's "gpt2" is one) name tensors without "transformer." and keep the
// attention's causal-mask buffers (attn.bias, attn.masked_bias): loading adds the prefix
// and ignores the buffers.
inline state_dict_options gpt2(bool strict = true) {
  const std::string prefix = "transformer.";
  name_map names(
      [prefix](std::string_view n) -> std::optional<std::string> {
        if (n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias")) return std::nullopt;
        if (n.starts_with(prefix) || n.starts_with("lm_head.")) return std::string(n);
        return prefix + std::string(n);
      },
      [](std::string_view n) { return std::string(n); });
  return {.names = std::move(names),
          .transposed = {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"},
          .tied = {{"lm_head.weight", "transformer.wte.weight"}},
          .strict = strict,
          .save_dtype = dtype::f32};
}

// LlamaForCausalLM: every projection is an nn.Linear ([out, in], as shardlib's), so the
// names and layouts are the model's own; lm_head.weight is tied to model.embed_tokens.weight
// only when the config says tie_word_embeddings (LLaMA-2 does not tie; some derivatives do).
// Files converted by transformers before 4.31 keep RoPE's inv_freq buffers: ignored.
inline state_dict_options llama(bool tie_word_embeddings = false, bool strict = true) {
  name_map names(
      [](std::string_view n) -> std::optional<std::string> {
        if (n.ends_with(".rotary_emb.inv_freq")) return std::nullopt;
        return std::string(n);
      },
      [](std::string_view n) { return std::string(n); });
  state_dict_options o{.names = std::move(names), .strict = strict, .save_dtype = dtype::f32};
  if (tie_word_embeddings) o.tied = {{"lm_head.weight", "model.embed_tokens.weight"}};
  return o;
}

}  // namespace shardlib::io::hf
