// shardlib/models/llmc.hpp — llm.c's GPT-2 checkpoints in and out: the file its
// train_gpt2.py writes and train_gpt2.c / train_gpt2.cu read and write, for a GPT-2 held
// whole by an nn::Replicated; llmc_to_hf and hf_to_llmc (shardlib-ckpt from-llmc /
// to-llmc) convert it to and from a Hugging Face checkpoint, which a sharded model loads
// with models::load_hf.
//
//   auto header = models::read_llmc_header("gpt2_124M.bin");
//   models::GPT2LMHeadModel<float> model(header.config);
//   nn::Replicated<float, decltype(model)> whole(model, 0);
//   models::load_llmc(whole, "gpt2_124M.bin");
//   models::save_hf(whole, "gpt2-hf");
//
// The file: 256 little-endian int32 of header (magic 20240326; version 3, every tensor
// fp32, or 5, every tensor bf16; then max_seq_len, vocab_size, num_layers, num_heads,
// channels, padded_vocab_size), then the tensors in one order: wte with its rows padded to
// padded_vocab_size, wpe, then each kind of block tensor for every layer in turn (ln_1
// weight and bias, attn.c_attn weight and bias, attn.c_proj weight and bias, ln_2 weight
// and bias, mlp.c_fc weight and bias, mlp.c_proj weight and bias), then ln_f's weight and
// bias. Weights are [out, in], as nn.Linear and the library keep them; the head is wte
// (tied), the MLP 4·channels wide, and there is no dropout.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"  // bfloat16, dtype
#include "shardlib/core/error.hpp"    // io_error, cat
#include "shardlib/io/safetensors.hpp"  // detail::atomic_file
#include "shardlib/models/gpt2.hpp"   // gpt2_config, GPT2LMHeadModel
#include "shardlib/models/hf.hpp"     // load_hf, save_hf, read_hf_config
#include "shardlib/nn/replicated.hpp"  // Replicated

#include <cstddef>     // std::size_t
#include <cstdint>     // std::int32_t, std::int64_t, std::uint16_t
#include <cstring>     // std::memcpy
#include <filesystem>  // std::filesystem::path, file_size
#include <fstream>     // std::ifstream
#include <span>        // std::span
#include <string>      // std::string
#include <vector>      // std::vector

namespace shardlib::models {

struct llmc_header {
  gpt2_config config;            // the model the file holds
  std::int64_t padded_vocab = 0;  // wte's rows in the file (llm.c pads the vocabulary to a multiple of 128)
  dtype type = dtype::f32;       // every tensor's: f32 (version 3) or bf16 (version 5)
};

namespace detail {
inline constexpr std::int32_t llmc_magic = 20240326;
inline constexpr std::size_t llmc_header_bytes = 256 * 4;

// Each tensor in file order: its name in the library's GPT-2, its elements in the model and
// in the file (wte's padded rows).
struct llmc_tensor {
  std::string name;
  std::size_t numel, stored;
};
inline std::vector<llmc_tensor> llmc_tensors(const gpt2_config& c, std::int64_t padded_vocab) {
  const auto C = std::size_t(c.n_embd), L = std::size_t(c.n_layer);
  std::vector<llmc_tensor> t{{"transformer.wte.weight", std::size_t(c.vocab_size) * C, std::size_t(padded_vocab) * C},
                             {"transformer.wpe.weight", std::size_t(c.n_positions) * C, std::size_t(c.n_positions) * C}};
  const std::pair<const char*, std::size_t> kinds[] = {
      {"ln_1.weight", C},           {"ln_1.bias", C},          {"attn.c_attn.weight", 3 * C * C},
      {"attn.c_attn.bias", 3 * C},  {"attn.c_proj.weight", C * C}, {"attn.c_proj.bias", C},
      {"ln_2.weight", C},           {"ln_2.bias", C},          {"mlp.c_fc.weight", 4 * C * C},
      {"mlp.c_fc.bias", 4 * C},     {"mlp.c_proj.weight", 4 * C * C}, {"mlp.c_proj.bias", C}};
  for (const auto& [leaf, n] : kinds)
    for (std::size_t i = 0; i < L; ++i) t.push_back({cat("transformer.h.", i, ".", leaf), n, n});
  t.push_back({"transformer.ln_f.weight", C, C});
  t.push_back({"transformer.ln_f.bias", C, C});
  return t;
}
inline std::size_t llmc_stored_elements(const gpt2_config& c, std::int64_t padded_vocab) {
  std::size_t n = 0;
  for (const auto& t : llmc_tensors(c, padded_vocab)) n += t.stored;
  return n;
}
}  // namespace detail

// The header of llm.c's GPT-2 checkpoint `file`, checked against the file's size. The
// config is llm.c's model: a tied head, a 4·channels MLP, no dropout, GPT-2's end token
// where the vocabulary has it.
inline llmc_header read_llmc_header(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw io_error(cat(file.string(), ": cannot open llm.c's checkpoint"));
  std::int32_t h[8] = {};
  in.read(reinterpret_cast<char*>(h), sizeof h);
  if (!in) throw io_error(cat(file.string(), ": shorter than llm.c's 1024-byte header"));
  if (h[0] != detail::llmc_magic || (h[1] != 3 && h[1] != 5))
    throw io_error(cat(file.string(), ": magic ", h[0], " version ", h[1], " is not llm.c's GPT-2 checkpoint (magic ",
                       detail::llmc_magic, ", version 3: fp32 or 5: bf16, the padded vocabulary in the header)"));
  for (int i = 2; i < 8; ++i)
    if (h[i] <= 0)
      throw io_error(cat(file.string(), ": header field ", i, " (max_seq_len, vocab_size, num_layers, num_heads, "
                                        "channels, padded_vocab_size from 2) is ", h[i], ", not positive"));
  if (h[6] % h[5] != 0 || h[7] < h[3])
    throw io_error(cat(file.string(), ": channels ", h[6], " is not a multiple of num_heads ", h[5],
                       ", or padded_vocab_size ", h[7], " is below vocab_size ", h[3]));
  llmc_header r;
  r.config = {.vocab_size = h[3], .n_positions = h[2], .n_embd = h[6], .n_layer = h[4], .n_head = h[5],
              .resid_pdrop = 0, .embd_pdrop = 0, .attn_pdrop = 0};
  if (h[3] <= 50256) r.config.tokens = {};  // a vocabulary without GPT-2's <|endoftext|>
  r.padded_vocab = h[7];
  r.type = h[1] == 3 ? dtype::f32 : dtype::bf16;
  const std::uintmax_t want =
      detail::llmc_header_bytes + detail::llmc_stored_elements(r.config, r.padded_vocab) * size_of(r.type);
  const std::uintmax_t have = std::filesystem::file_size(file);
  if (have != want)
    throw io_error(cat(file.string(), ": ", have, " bytes, but its header (", h[4], " layers, channels ", h[6],
                       ", vocabulary ", h[3], " padded to ", h[7], ", context ", h[2], ", ", name(r.type), ") makes ",
                       want));
  return r;
}

// Reads llm.c's checkpoint into `whole` (an nn::Replicated<float, GPT2LMHeadModel<float>>
// or anything with value(name) over the library's GPT-2 names), whose model must have the
// header's shape; wte's padded rows are left out.
template <class Holder>
void load_llmc(Holder& whole, const std::filesystem::path& file) {
  const llmc_header h = read_llmc_header(file);
  const gpt2_config& m = whole.layer().config();
  if (m.vocab_size != h.config.vocab_size || m.n_positions != h.config.n_positions || m.n_embd != h.config.n_embd ||
      m.n_layer != h.config.n_layer || m.n_head != h.config.n_head || (m.n_inner != 0 && m.n_inner != 4 * m.n_embd) ||
      !m.tie_word_embeddings)
    throw io_error(cat(file.string(), ": the model (", m.n_layer, " layers, n_embd ", m.n_embd, ", ", m.n_head,
                       " heads, vocabulary ", m.vocab_size, ", n_positions ", m.n_positions,
                       ") is not the checkpoint's, or not llm.c's GPT-2 (tied head, MLP 4 n_embd wide)"));
  std::ifstream in(file, std::ios::binary);
  in.seekg(std::streamoff(detail::llmc_header_bytes));
  std::vector<char> buffer;
  for (const auto& t : detail::llmc_tensors(h.config, h.padded_vocab)) {
    buffer.resize(t.stored * size_of(h.type));
    if (!in.read(buffer.data(), std::streamsize(buffer.size())))
      throw io_error(cat(file.string(), ": cannot read ", t.name));
    std::span<float> to = whole.value(t.name);
    if (h.type == dtype::f32) {
      std::memcpy(to.data(), buffer.data(), t.numel * sizeof(float));
    } else {
      for (std::size_t i = 0; i < t.numel; ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, buffer.data() + 2 * i, 2);
        to[i] = float(bfloat16::from_bits(bits));
      }
    }
  }
}

// Writes `whole` (as load_llmc takes it) as llm.c's checkpoint: version 3 (fp32) or 5
// (bf16, rounded to nearest even), the vocabulary padded with zero rows to a multiple of
// 128 as llm.c pads it. The model must be llm.c's GPT-2: a tied head, an MLP 4·n_embd wide.
template <class Holder>
void save_llmc(Holder& whole, const std::filesystem::path& file, dtype type = dtype::f32) {
  const gpt2_config& c = whole.layer().config();
  if (type != dtype::f32 && type != dtype::bf16)
    throw error(cat("save_llmc ", file.string(), ": llm.c's checkpoints hold fp32 or bf16, not ", name(type)));
  if (!c.tie_word_embeddings || (c.n_inner != 0 && c.n_inner != 4 * c.n_embd))
    throw error(cat("save_llmc ", file.string(), ": llm.c's GPT-2 ties its head to wte and has an MLP 4 n_embd (",
                    4 * c.n_embd, ") wide; this model has ", c.tie_word_embeddings ? "a tied" : "an untied",
                    " head and n_inner ", c.n_inner));
  const std::int64_t padded = (c.vocab_size + 127) / 128 * 128;
  std::int32_t header[256] = {detail::llmc_magic,     type == dtype::f32 ? 3 : 5, std::int32_t(c.n_positions),
                              std::int32_t(c.vocab_size), std::int32_t(c.n_layer),  std::int32_t(c.n_head),
                              std::int32_t(c.n_embd),     std::int32_t(padded)};
  io::detail::atomic_file out(file);
  out.write(std::as_bytes(std::span(header)));
  std::vector<std::byte> bytes;
  for (const auto& t : detail::llmc_tensors(c, padded)) {
    const std::span<const float> from = whole.value(t.name);
    bytes.assign(t.stored * size_of(type), std::byte{0});
    if (type == dtype::f32) {
      std::memcpy(bytes.data(), from.data(), t.numel * sizeof(float));
    } else {
      for (std::size_t i = 0; i < t.numel; ++i) {
        const std::uint16_t bits = bfloat16(from[i]).bits;
        std::memcpy(bytes.data() + 2 * i, &bits, 2);
      }
    }
    out.write(bytes);
  }
  out.commit();
}

// llm.c's checkpoint `file` as the Hugging Face checkpoint `dir` (config.json and
// model.safetensors, as save_pretrained writes them; the vocabulary's padding left out).
inline void llmc_to_hf(const std::filesystem::path& file, const std::filesystem::path& dir) {
  GPT2LMHeadModel<float> model(read_llmc_header(file).config);
  nn::Replicated<float, GPT2LMHeadModel<float>> whole(model, 0);
  load_llmc(whole, file);
  save_hf(whole, dir);
}

// The Hugging Face GPT-2 in `dir` as llm.c's checkpoint `file` (save_llmc's rules).
inline void hf_to_llmc(const std::filesystem::path& dir, const std::filesystem::path& file, dtype type = dtype::f32) {
  GPT2LMHeadModel<float> model(read_hf_config<gpt2_config>(dir));
  nn::Replicated<float, GPT2LMHeadModel<float>> whole(model, 0);
  load_hf(whole, dir);
  save_llmc(whole, file, type);
}

}  // namespace shardlib::models
