// shardlib/models/token_ids.hpp — token_ids: the special tokens a Hugging Face
// config.json names for generation, kept with a model's config so that a checkpoint
// saved again names the same ones.
#pragma once
#include "shardlib/config.hpp"

#include <cstdint>   // std::int64_t
#include <optional>  // std::optional
#include <vector>    // std::vector

namespace shardlib::models {

// transformers' bos_token_id, eos_token_id (one id or several: Llama 3.1's instruct
// models end at any of three) and pad_token_id. The models compute nothing with them;
// models::generate's options take them: {.eos_token_id = c.tokens.eos, .pad_token_id = c.tokens.pad}.
struct token_ids {
  std::optional<std::int64_t> bos = std::nullopt;
  std::vector<std::int64_t> eos{};  // empty: none
  std::optional<std::int64_t> pad = std::nullopt;
};

}  // namespace shardlib::models
