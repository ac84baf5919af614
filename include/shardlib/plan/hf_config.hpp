// shardlib/plan/hf_config.hpp — the planner's decoder_shape of a GPT-2 or LLaMA that a
// Hugging Face config.json describes, read as models::read_hf_config reads it, so that
// a checkpoint's own config plans the model it would build (Llama 3, TinyLlama, a
// fine-tune) without building it.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"     // error, cat
#include "shardlib/models/hf.hpp"      // gpt2_config, llama_config, visit_hf_config
#include "shardlib/plan/presets.hpp"   // decoder_shape

#include <filesystem>   // std::filesystem::path
#include <string_view>  // std::string_view

namespace shardlib::plan {

// The default sequence is the context the config gives (n_positions,
// max_position_embeddings). `name` names the shape in messages and must outlive it.
inline decoder_shape decoder_shape_of(const models::gpt2_config& c, std::string_view name) {
  models::detail::checked(c);
  return {.name = name,
          .family = family::gpt2,
          .layers = long(c.n_layer),
          .hidden = long(c.n_embd),
          .heads = long(c.n_head),
          .kv_heads = long(c.n_head),
          .vocab = long(c.vocab_size),
          .intermediate = long(c.n_inner > 0 ? c.n_inner : 4 * c.n_embd),
          .positions = long(c.n_positions),
          .seq = long(c.n_positions),
          .tied = c.tie_word_embeddings};
}
inline decoder_shape decoder_shape_of(const models::llama_config& c, std::string_view name) {
  models::detail::checked(c);
  return {.name = name,
          .family = family::llama,
          .layers = long(c.num_hidden_layers),
          .hidden = long(c.hidden_size),
          .heads = long(c.num_attention_heads),
          .kv_heads = long(c.num_key_value_heads > 0 ? c.num_key_value_heads : c.num_attention_heads),
          .vocab = long(c.vocab_size),
          .intermediate = long(c.intermediate_size),
          .seq = long(c.max_position_embeddings),
          .tied = c.tie_word_embeddings,
          .head_dim = long(c.head_dim),
          .attention_bias = c.attention_bias,
          .mlp_bias = c.mlp_bias};
}

// The decoder in `dir_or_file` (a folder holding config.json, or the file), by its
// model_type: "gpt2" or "llama" (models::visit_hf_config, which names the file when it
// refuses one).
inline decoder_shape read_decoder_shape(const std::filesystem::path& dir_or_file, std::string_view name) {
  return models::visit_hf_config(dir_or_file, [&](const auto& c) { return decoder_shape_of(c, name); });
}

}  // namespace shardlib::plan
