// examples/common/byte_models.hpp — the decoders train_gpt and train_gpt_cuda train, from
// their shared flags: byte-level on a text (vocabulary 256: one token per byte), or over
// the vocabulary of llm.c's token files (--vocab), context --seq.
#pragma once
#include <shardlib/models/gpt2.hpp>
#include <shardlib/models/llama.hpp>

#include <CLI/CLI.hpp>

#include <string>
#include <type_traits>

#include "common/flags.hpp"

namespace example {

// The flags both examples take for the model's shape.
struct byte_model_shape {
  std::string model = "gpt2";  // gpt2 or llama
  long layers = 4, d_model = 128, heads = 4, kv_heads = 2, seq = 128;
  long vocab = 0;  // --vocab; 0 until the data sets it (use_vocab): 256 for a text, else its tokenizer's
  double dropout = 0;  // GPT-2: residual, embedding and attention
};

inline void add_byte_model_flags(CLI::App& cli, byte_model_shape& s) {
  const CLI::Validator size = whole(1, max_size);
  cli.add_option("--model", s.model, "architecture")->check(CLI::IsMember({"gpt2", "llama"}));
  cli.add_option("--layers", s.layers, "transformer blocks")->check(size);
  cli.add_option("--d-model", s.d_model, "model width (n_embd, hidden_size)")->check(size);
  cli.add_option("--heads", s.heads, "attention heads (divides --d-model)")->check(size);
  cli.add_option("--kv-heads", s.kv_heads, "LLaMA: key/value heads (divides --heads)")->check(size);
  cli.add_option("--seq", s.seq, "context length in tokens, bytes for a text (n_positions)")->check(whole(2, max_size));
  cli.add_option("--vocab", s.vocab,
                 "the model's vocabulary (default: the data's: 256 bytes for a text, 50257 for GPT-2's tokens, "
                 "128256 for LLaMA 3's; llm.c pads GPT-2's to 50304)")
      ->check(whole(1, 1L << 31));
  cli.add_option("--dropout", s.dropout, "GPT-2: residual, embedding and attention dropout")->check(real(0, 0.99));
}

// --heads must divide --d-model; LLaMA's RoPE needs an even head dimension and its
// --kv-heads must divide --heads. Raised as CLI11 validation errors, naming the flag.
inline void check_byte_model(const byte_model_shape& s) {
  if (s.d_model % s.heads != 0)
    throw CLI::ValidationError("--heads",
                               std::to_string(s.heads) + " does not divide --d-model " + std::to_string(s.d_model));
  if (s.model != "llama") return;
  if ((s.d_model / s.heads) % 2 != 0)
    throw CLI::ValidationError("--heads", "LLaMA's rotary embeddings need an even head dimension, and --d-model " +
                                              std::to_string(s.d_model) + " / --heads " + std::to_string(s.heads) +
                                              " is odd");
  if (s.heads % s.kv_heads != 0)
    throw CLI::ValidationError("--kv-heads",
                               std::to_string(s.kv_heads) + " does not divide --heads " + std::to_string(s.heads));
}

// The model's vocabulary: --vocab, or the data's when it was not given; every id of the
// data must fall inside it.
template <class Data>
void use_vocab(byte_model_shape& s, const Data& data) {
  if (s.vocab == 0) s.vocab = data.vocab;
  data.check_vocab(s.vocab);
}

template <class T, class Space>
shardlib::models::GPT2LMHeadModel<T, Space> make_byte_model(const byte_model_shape& s,
                                                            std::type_identity<shardlib::models::gpt2_config>) {
  return shardlib::models::GPT2LMHeadModel<T, Space>({.vocab_size = s.vocab,
                                                      .n_positions = s.seq,
                                                      .n_embd = s.d_model,
                                                      .n_layer = s.layers,
                                                      .n_head = s.heads,
                                                      .resid_pdrop = s.dropout,
                                                      .embd_pdrop = s.dropout,
                                                      .attn_pdrop = s.dropout,
                                                      .tokens = {}});  // none: samples run to their length
}
// LLaMA's MLP width: 8/3 of d_model, rounded down to a multiple of 64, plus 64.
template <class T, class Space>
shardlib::models::LlamaForCausalLM<T, Space> make_byte_model(const byte_model_shape& s,
                                                             std::type_identity<shardlib::models::llama_config>) {
  return shardlib::models::LlamaForCausalLM<T, Space>({.vocab_size = s.vocab,
                                                       .hidden_size = s.d_model,
                                                       .intermediate_size = s.d_model * 8 / 3 / 64 * 64 + 64,
                                                       .num_hidden_layers = s.layers,
                                                       .num_attention_heads = s.heads,
                                                       .num_key_value_heads = s.kv_heads,
                                                       .max_position_embeddings = s.seq,
                                                       .tokens = {}});  // none: samples run to their length
}

}  // namespace example
