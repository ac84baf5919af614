// examples/common/byte_models.hpp — the decoders train_gpt and train_gpt_cuda train, from
// their shared flags: byte-level on a text (vocabulary 256: one token per byte), or over
// the vocabulary of llm.c's token files (--vocab), context --seq.
#pragma once
#include <shardlib/models/gpt2.hpp>
#include <shardlib/models/hf.hpp>
#include <shardlib/models/llama.hpp>
#include <shardlib/plan/hf_config.hpp>  // read_decoder_shape (--init)

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "common/flags.hpp"
#include "common/launched.hpp"

namespace example {

// The flags both examples take for the model's shape.
struct byte_model_shape {
  std::string model = "gpt2";  // gpt2 or llama
  long layers = 4, d_model = 128, heads = 4, kv_heads = 2, seq = 128;
  long vocab = 0;  // --vocab; 0 until the data sets it (use_vocab): 256 for a text, else its tokenizer's
  double dropout = 0;  // GPT-2: residual, embedding and attention; LLaMA: attention; below 0: the config's (--init)
  std::string config;  // a Hugging Face checkpoint whose config.json is the model (take_init_shape)
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
  cli.add_option("--dropout", s.dropout,
                 "GPT-2: residual, embedding and attention dropout; LLaMA: attention dropout (with --init: replaces "
                 "the config's)")
      ->check(real(0, 0.99));
}

// --heads must divide --d-model; LLaMA's RoPE needs an even head dimension and its
// --kv-heads must divide --heads. Raised as CLI11 validation errors, naming the flag.
inline void check_byte_model(const byte_model_shape& s) {
  if (!s.config.empty()) return;  // the config's own, checked as the model is built
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

// --init DIR: the model is the one DIR's config.json describes, as from_pretrained builds it:
// the architecture, sizes and vocabulary, and the fields no flag sets (LLaMA's MLP width,
// head_dim, RoPE, the norms' eps). A shape flag given with another value is refused (GPT-2
// has no --kv-heads to compare), --seq must fit the config's context (its default is cut
// to it), and --dropout, when given, replaces the config's dropouts. Before
// check_byte_model, which it makes moot.
inline void take_init_shape(const CLI::App& cli, byte_model_shape& s, const std::string& init) {
  if (init.empty()) return;
  namespace plan = shardlib::plan;
  plan::decoder_shape c;
  try {
    c = plan::read_decoder_shape(init, "--init");
  } catch (const shardlib::error& e) {
    throw CLI::ValidationError("--init", e.what());
  }
  const std::string type = c.family == plan::family::gpt2 ? "gpt2" : "llama";
  if (cli.count("--model") > 0 && s.model != type)
    throw CLI::ValidationError("--model", shardlib::cat(s.model, ", but --init's config.json is ", type));
  s.model = type;
  for (auto [flag, value, from] : {std::tuple{"--layers", &s.layers, c.layers}, std::tuple{"--d-model", &s.d_model, c.hidden},
                                   std::tuple{"--heads", &s.heads, c.heads}, std::tuple{"--kv-heads", &s.kv_heads, c.kv_heads},
                                   std::tuple{"--vocab", &s.vocab, c.vocab}}) {
    const bool read = type == "llama" || std::string_view(flag) != "--kv-heads";  // GPT-2 ignores --kv-heads
    if (read && cli.count(flag) > 0 && *value != from)
      throw CLI::ValidationError(flag, shardlib::cat(*value, ", but --init's config.json says ", from));
    *value = from;
  }
  const long context = c.seq;  // the config's n_positions or max_position_embeddings
  if (cli.count("--seq") == 0) s.seq = std::min(s.seq, context);  // the default fits a shorter context
  if (s.seq > context)
    throw CLI::ValidationError("--seq", shardlib::cat(s.seq, " is more than --init's context of ", context,
                                                      " positions"));
  if (cli.count("--dropout") == 0) s.dropout = -1;
  s.config = init;
}

// The model's vocabulary: --vocab, or the data's when it was not given; every id of the
// data must fall inside it.
template <class Data>
void use_vocab(byte_model_shape& s, Data& data, const char* program) {
  if (s.vocab == 0) s.vocab = data.vocab;
  data.check_vocab(s.vocab);
  if (data.bytes && s.vocab > 256 && process_rank() == 0)  // once per job
    std::printf("%s: note: the text's bytes are token ids 0 to 255 of a vocabulary of %ld, not its tokenizer's "
                "(llm.c's token files: --tokens)\n", program, s.vocab);
}

// The dropout the model trains with: GPT-2's residual one (the flag sets all three alike),
// LLaMA's on the attention weights.
inline double dropout_of(const shardlib::models::gpt2_config& c) { return c.resid_pdrop; }
inline double dropout_of(const shardlib::models::llama_config& c) { return c.attention_dropout; }

// The model: --init's config (take_init_shape), or the flags'.
template <class T, class Space>
shardlib::models::GPT2LMHeadModel<T, Space> make_byte_model(const byte_model_shape& s,
                                                            std::type_identity<shardlib::models::gpt2_config>) {
  using shardlib::models::gpt2_config;
  if (!s.config.empty()) {
    auto c = shardlib::models::read_hf_config<gpt2_config>(s.config);
    if (s.dropout >= 0) c.resid_pdrop = c.embd_pdrop = c.attn_pdrop = s.dropout;
    return shardlib::models::GPT2LMHeadModel<T, Space>(c);
  }
  return shardlib::models::GPT2LMHeadModel<T, Space>(gpt2_config{.vocab_size = s.vocab,
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
  using shardlib::models::llama_config;
  if (!s.config.empty()) {
    auto c = shardlib::models::read_hf_config<llama_config>(s.config);
    if (s.dropout >= 0) c.attention_dropout = s.dropout;
    return shardlib::models::LlamaForCausalLM<T, Space>(c);
  }
  return shardlib::models::LlamaForCausalLM<T, Space>(llama_config{.vocab_size = s.vocab,
                                                                   .hidden_size = s.d_model,
                                                                   .intermediate_size = s.d_model * 8 / 3 / 64 * 64 + 64,
                                                                   .num_hidden_layers = s.layers,
                                                                   .num_attention_heads = s.heads,
                                                                   .num_key_value_heads = s.kv_heads,
                                                                   .max_position_embeddings = s.seq,
                                                                   .attention_dropout = s.dropout,
                                                                   .tokens = {}});  // none: samples run to their length
}

}  // namespace example
