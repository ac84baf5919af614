// shardlib/plan/presets.hpp — decoder language models by architecture (GPT-2, LLaMA):
// their parameters counted from the shapes of every tensor, each block a unit and the
// embeddings, final norm and head in the root, and the published sizes as presets.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"      // dtype
#include "shardlib/core/error.hpp"        // require, cat
#include "shardlib/nn/flat.hpp"           // flat_layout::alignment
#include "shardlib/plan/memory_plan.hpp"  // model_desc

#include <cstddef>      // std::size_t
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <vector>       // std::vector

namespace shardlib::plan {

// GPT-2: learned positions, LayerNorms and Linear layers with biases, a 4·hidden GELU MLP.
// LLaMA: rotary positions (no table), RMSNorms, no biases unless its config asks,
// grouped-query attention (kv_heads ≤ heads), a SwiGLU MLP (gate, up, down).
enum class family { gpt2, llama };

struct decoder_shape {
  std::string_view name;
  plan::family family = family::gpt2;
  long layers = 0, hidden = 0, heads = 0, kv_heads = 0, vocab = 0, intermediate = 0;
  long positions = 0;  // GPT-2's learned position table (n_positions); 0 for LLaMA
  long seq = 0;        // the context length it was trained with: the planner's default
  bool tied = false;   // the LM head shares the token embedding (counted once)
  long head_dim = 0;   // LLaMA's head size where it is not hidden / heads (0: it is)
  bool attention_bias = false, mlp_bias = false;  // LLaMA's projections with biases

  long head_size() const { return head_dim > 0 ? head_dim : hidden / heads; }
  long q_width() const { return heads * head_size(); }  // q's and the attention output's
  long kv_width() const { return kv_heads * head_size(); }
};

// One parameter-holding module of a block, in the order the library's block lists its
// parameters: a projection (weight [out, in], a bias when `bias`) or a norm of `norm`
// elements a tensor (`tensors` of them: weight, and bias for LayerNorm). A projection
// keeps its input for its weight's gradient; what a frozen one saves (nn::saved_input):
// `shares_input`, it reads the input of the projection before it (LLaMA's k and v after
// q, up after gate), kept while any of them keeps it; `input_kept`, another layer keeps
// that input anyway (the attention's output, which the attention keeps for backward).
struct block_module {
  std::string_view name;  // within the block: "attn.c_attn", "self_attn.q_proj", "ln_1"
  std::size_t in = 0, out = 0;
  bool bias = false;
  std::size_t norm = 0, tensors = 0;
  bool shares_input = false, input_kept = false;
  std::size_t parameters() const { return in * out + (bias ? out : 0) + norm * tensors; }
};
// GPT-2: ln_1, attn (c_attn: q, k, v fused; c_proj), ln_2, mlp (c_fc, c_proj). LLaMA:
// self_attn (q, k, v: kv heads × head size wide, o), mlp (gate, up, down), the two RMSNorms.
inline std::vector<block_module> block_modules(const decoder_shape& m) {
  const std::size_t h = std::size_t(m.hidden), i = std::size_t(m.intermediate);
  const std::size_t q = std::size_t(m.q_width()), kv = std::size_t(m.kv_width());
  const bool ab = m.attention_bias, mb = m.mlp_bias;
  if (m.family == family::gpt2)
    return {{.name = "ln_1", .norm = h, .tensors = 2},
            {.name = "attn.c_attn", .in = h, .out = 3 * h, .bias = true},
            {.name = "attn.c_proj", .in = h, .out = h, .bias = true, .input_kept = true},
            {.name = "ln_2", .norm = h, .tensors = 2},
            {.name = "mlp.c_fc", .in = h, .out = i, .bias = true},
            {.name = "mlp.c_proj", .in = i, .out = h, .bias = true}};
  return {{.name = "self_attn.q_proj", .in = h, .out = q, .bias = ab},
          {.name = "self_attn.k_proj", .in = h, .out = kv, .bias = ab, .shares_input = true},
          {.name = "self_attn.v_proj", .in = h, .out = kv, .bias = ab, .shares_input = true},
          {.name = "self_attn.o_proj", .in = q, .out = h, .bias = ab, .input_kept = true},
          {.name = "mlp.gate_proj", .in = h, .out = i, .bias = mb},
          {.name = "mlp.up_proj", .in = h, .out = i, .bias = mb, .shares_input = true},
          {.name = "mlp.down_proj", .in = i, .out = h, .bias = mb},
          {.name = "input_layernorm", .norm = h, .tensors = 1},
          {.name = "post_attention_layernorm", .norm = h, .tensors = 1}};
}

// The engine's flat layout of a unit (nn::flat_layout): each tensor placed after the
// last at the next multiple of the alignment; `end` counts the unit's flat elements,
// gaps included.
struct aligned_placement {
  std::size_t end = 0;
  std::size_t place(std::size_t n) {  // where a tensor of n elements starts
    constexpr std::size_t a = nn::flat_layout::alignment;
    const std::size_t at = (end + a - 1) / a * a;
    end = at + n;
    return at;
  }
};

// One block's tensors in the order the block lists them: each module's weight and bias,
// each norm's weight (and LayerNorm's bias).
inline std::vector<std::size_t> block_tensors(const decoder_shape& m) {
  std::vector<std::size_t> sizes;
  for (const auto& mod : block_modules(m)) {
    if (mod.norm > 0) sizes.insert(sizes.end(), mod.tensors, mod.norm);
    if (mod.in > 0) sizes.push_back(mod.in * mod.out);
    if (mod.bias) sizes.push_back(mod.out);
  }
  return sizes;
}

// Everything outside the blocks, in the model's order: token (and position) embeddings,
// the final norm's tensors, the head unless tied.
inline std::vector<std::size_t> root_tensors(const decoder_shape& m) {
  const std::size_t h = std::size_t(m.hidden), v = std::size_t(m.vocab);
  std::vector<std::size_t> sizes{v * h};
  if (m.positions > 0) sizes.push_back(std::size_t(m.positions) * h);
  sizes.insert(sizes.end(), m.family == family::gpt2 ? 2 : 1, h);
  if (!m.tied) sizes.push_back(v * h);
  return sizes;
}

namespace detail {
inline std::size_t total(const std::vector<std::size_t>& sizes) {
  std::size_t n = 0;
  for (std::size_t x : sizes) n += x;
  return n;
}
inline std::size_t laid_out(const std::vector<std::size_t>& sizes) {
  aligned_placement p;
  for (std::size_t x : sizes) p.place(x);
  return p.end;
}
}  // namespace detail

// One block's parameters (attention, MLP and its two norms) and its flat elements, the
// unit's size; the same of the root.
inline std::size_t block_parameters(const decoder_shape& m) { return detail::total(block_tensors(m)); }
inline std::size_t block_elements(const decoder_shape& m) { return detail::laid_out(block_tensors(m)); }
inline std::size_t root_parameters(const decoder_shape& m) { return detail::total(root_tensors(m)); }
inline std::size_t root_elements(const decoder_shape& m) { return detail::laid_out(root_tensors(m)); }

inline std::size_t parameters(const decoder_shape& m) {
  return root_parameters(m) + std::size_t(m.layers) * block_parameters(m);
}

// The parameters a token multiplies (6 FLOPs each in forward and backward, PaLM's N):
// all but the embedding lookups, GPT-2's positions and an untied token embedding (a
// tied one is the head's weight). Biases and norms stay in: 0.05% of GPT-2 124M.
inline std::size_t multiplied_parameters(const decoder_shape& m) {
  const std::size_t h = std::size_t(m.hidden);
  return parameters(m) - std::size_t(m.positions) * h - (m.tied ? 0 : std::size_t(m.vocab) * h);
}

// The published configurations (Hugging Face's gpt2, gpt2-medium, Llama-2-7b, Llama-2-70b).
inline constexpr decoder_shape decoder_presets[] = {
    {.name = "gpt2-124m", .family = family::gpt2, .layers = 12, .hidden = 768, .heads = 12, .kv_heads = 12,
     .vocab = 50257, .intermediate = 3072, .positions = 1024, .seq = 1024, .tied = true},
    {.name = "gpt2-350m", .family = family::gpt2, .layers = 24, .hidden = 1024, .heads = 16, .kv_heads = 16,
     .vocab = 50257, .intermediate = 4096, .positions = 1024, .seq = 1024, .tied = true},
    {.name = "llama-7b", .family = family::llama, .layers = 32, .hidden = 4096, .heads = 32, .kv_heads = 32,
     .vocab = 32000, .intermediate = 11008, .positions = 0, .seq = 4096, .tied = false},
    {.name = "llama-70b", .family = family::llama, .layers = 80, .hidden = 8192, .heads = 64, .kv_heads = 8,
     .vocab = 32000, .intermediate = 28672, .positions = 0, .seq = 4096, .tied = false},
};

inline const decoder_shape& decoder_preset(std::string_view name) {
  for (const auto& m : decoder_presets)
    if (m.name == name) return m;
  std::string known;
  for (const auto& m : decoder_presets) known += cat(known.empty() ? "" : ", ", m.name);
  throw error(cat("plan: no model preset '", name, "' (known: ", known, ")"));
}

// What one step of a decoder keeps for backward, in bytes (plan::decoder's
// activations): the library's layers, counted tensor by tensor and checked equal to
// measure_activations on the host layers for both families, several widths, heads,
// sequences and vocabularies (a test; the device models are the same templates over
// device operations, so the same tensors, not yet measured on a GPU). Elements are in
// the activation dtype, norm statistics floats, token ids int64.
//   block, per token: GPT-2 8·hidden + 2·intermediate elements (ln_1's input, c_attn's
//     input, q, k and v, c_proj's input, ln_2's input, c_fc's input; the GELU's input and
//     output) and 4 floats (two LayerNorms' mean and rstd); LLaMA 4·hidden +
//     2·q_width + 2·kv_width + 3·intermediate (two RMSNorms' inputs and outputs;
//     rotated q and the attention's output; k and v; gate, up and their SwiGLU) and 2
//     floats (rstd).
//     Dropout keeps no masks (drawn again in backward).
//   block, attention: heads·seq² weights a sequence (the softmax; transformer_shape's
//     k = 2 bytes in 16 bits), or with fused_attention (the device's) one float of
//     log-sum-exp per (head, query).
//   outside the blocks, per token at the step's peak (the last block's backward, the
//     loss's logits and their gradient alive beside it): 2·vocab (logits, gradient) +
//     2·hidden (the final norm's input and output) + the last block's backward
//     transients (GPT-2 intermediate, LLaMA 2·intermediate), GPT-2's embedding dropout
//     output (hidden; transformers' embd_pdrop is 0.1), and the int64 ids.
struct decoder_activations {
  double block = 0;    // one block's, for the whole batch
  double outside = 0;  // the rest at the peak
};
inline decoder_activations decoder_activation_bytes(const decoder_shape& m, long batch, long seq, dtype activations,
                                                    bool fused_attention) {
  const double h = double(m.hidden), i = double(m.intermediate), a = double(m.heads), v = double(m.vocab);
  const double q = double(m.q_width()), kv = double(m.kv_width()), s = double(seq), tokens = s * double(batch);
  const double size = double(size_of(activations));
  const bool gpt2 = m.family == family::gpt2;
  const double elements = gpt2 ? 8 * h + 2 * i : 4 * h + 2 * q + 2 * kv + 3 * i, stats = gpt2 ? 4 : 2;
  const double attention = fused_attention ? 4 * a : a * s * size;
  const double outside = 2 * v + 2 * h + (gpt2 ? i + h : 2 * i);
  return {.block = tokens * (elements * size + stats * 4 + attention), .outside = tokens * (outside * size + 8)};
}

// The model as the planner sees it: the root, then each block a unit (an exact count,
// where plan::transformer approximates a block as 12·hidden²). Activations for `seq`
// tokens (the preset's when 0) per sequence as decoder_activation_bytes counts them
// (fused_attention: the device's attention). Units are flat elements, the engine's
// alignment gaps included (none in the presets). FLOPs: 6 per multiplied parameter and
// token and attention's 12·layers·q_width·seq per token (Narayanan et al. 2021, eq. 3,
// where q_width is hidden).
inline model_desc decoder(const decoder_shape& m, long batch = 1, long seq = 0, dtype activations = dtype::bf16,
                          bool fused_attention = false) {
  require(m.layers >= 1 && m.hidden >= 1 && m.heads >= 1 && m.kv_heads >= 1 &&
              (m.head_dim > 0 ? m.family == family::llama : m.hidden % m.heads == 0) && m.heads % m.kv_heads == 0 &&
              m.intermediate >= 1 && m.vocab >= 1 && batch >= 1 && (seq > 0 || m.seq > 0),
          "plan::decoder ", m.name, ": layers, hidden, heads, kv heads, intermediate, vocab, batch and seq must be "
          "positive, heads must divide hidden (unless a LLaMA's head_dim is given) and kv heads must divide heads");
  require(m.family == family::llama || !(m.attention_bias || m.mlp_bias), "plan::decoder ", m.name,
          ": GPT-2's projections always have biases; attention_bias and mlp_bias are LLaMA's switches");
  const long s = seq > 0 ? seq : m.seq;
  model_desc d;
  d.units.assign(std::size_t(m.layers) + 1, block_elements(m));
  d.units[0] = root_elements(m);
  const auto act = decoder_activation_bytes(m, batch, s, activations, fused_attention);
  const double bytes = double(m.layers) * act.block + act.outside;
  require(bytes < 0x1p64, "plan::decoder ", m.name, ": ", bytes,
          " bytes of activations are more than a 64-bit count holds");
  d.activation_bytes = std::size_t(bytes);
  const double tokens = double(s) * double(batch);
  d.flops = 6 * double(multiplied_parameters(m)) * tokens + 12 * double(m.layers) * double(m.q_width()) * double(s) * tokens;
  return d;
}

// What a plan::decoder(m, batch, seq, activations, fused) keeps per block, from its own
// figure: the prefix and adapter variants below take blocks off it.
inline double decoder_block_bytes(const model_desc& d, const decoder_shape& m, long batch, long seq, dtype activations) {
  const double outside = decoder_activation_bytes(m, batch, seq > 0 ? seq : m.seq, activations, false).outside;
  return (double(d.activation_bytes) - outside) / double(m.layers);
}

// The same model fine-tuned with its token (and position) embeddings and its lower
// `layers` blocks frozen: a frozen prefix (docs/design.md, "Frozen parameters"), whose
// blocks run forward only, keep no activations and no gradients, and are neither
// gathered in backward nor reduced (model_desc::frozen). The embeddings lead the root's
// tensors, so they are its first ranges; a tied head is the embedding, frozen with it.
// Activations drop by the prefix's blocks (`activations` is d's dtype); FLOPs by the prefix's backward
// (4 per parameter and token, and two thirds of its attention) and a frozen head's dW.
inline model_desc with_frozen_prefix(model_desc d, const decoder_shape& m, long layers, long batch = 1, long seq = 0,
                                     dtype activations = dtype::bf16) {
  require(layers >= 0 && layers <= m.layers, "plan::with_frozen_prefix ", m.name, ": ", layers,
          " frozen blocks of its ", m.layers);
  require(d.units.size() == std::size_t(m.layers) + 1, "plan::with_frozen_prefix ", m.name,
          ": the model is not plan::decoder's (the root and one unit per block)");
  const std::size_t h = std::size_t(m.hidden);
  d.frozen.assign(d.units.size(), unit_freezing{});
  aligned_placement root;
  for (std::size_t n : {std::size_t(m.vocab) * h, std::size_t(m.positions) * h})
    if (n > 0) {
      const std::size_t at = root.place(n);
      d.frozen[0].ranges.emplace_back(at, at + n);
    }
  for (std::size_t i = 1; i <= std::size_t(layers); ++i) d.frozen[i] = {.ranges = {{0, d.units[i]}}, .all = true, .no_backward = true};
  const double s = double(seq > 0 ? seq : m.seq), tokens = s * double(batch);
  d.activation_bytes -= std::size_t(double(layers) * decoder_block_bytes(d, m, batch, seq, activations));
  d.flops -= tokens * (double(layers) * (4 * double(block_parameters(m)) + 8 * double(m.q_width()) * s) +
                       (m.tied ? 2 * double(m.vocab) * double(h) : 0));
  return d;
}

}  // namespace shardlib::plan
