// shardlib/plan/lora.hpp — a preset decoder (plan/presets.hpp) fine-tuned with LoRA
// adapters as nn::add_lora puts them on the library's GPT-2 and LLaMA: each block's
// flat layout with the adapters where the targets name a projection, everything else
// frozen.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"  // dtype, size_of
#include "shardlib/core/error.hpp"    // require, cat
#include "shardlib/nn/lora.hpp"       // lora_target_matches
#include "shardlib/plan/presets.hpp"  // decoder_shape, block_modules, aligned_placement, decoder

#include <algorithm>    // std::min
#include <cstddef>      // std::size_t
#include <string>       // std::string
#include <vector>       // std::vector

namespace shardlib::plan {

// `d` (plan::decoder(m, ...)) with LoRA adapters of rank r on every projection of every
// block that one of `targets` names (nn::lora_target_matches over the library's dotted
// names: "transformer.h.3.attn.c_attn", "model.layers.3.self_attn.q_proj"), as
// nn::add_lora puts them: each block unit laid out as the engine lays it out (each
// parameter at a multiple of nn::flat_layout::alignment; an adapted projection lists its
// base weight and bias, then lora_A [r, in] and lora_B [out, r]), every parameter but the
// adapters frozen, the root wholly, a block without adapters wholly. The blocks before
// the first adapter are a frozen prefix (forward only, no activations kept), as
// with_frozen_prefix plans one. Activations: d's estimate for the other blocks, less the
// inputs their frozen projections without an adapter no longer keep (a frozen weight
// needs no input for its gradient; block_module says which inputs other layers keep
// anyway), plus the adapters' r values a token for each adapted projection (x A^T, in
// `activations`, plan::decoder's dtype; no adapter dropout). FLOPs lose the frozen
// weights' gradient products (2 a multiplied parameter and token) and the prefix's
// backward, and gain the adapters' 6. A target that names no projection raises, naming it.
inline model_desc with_lora(model_desc d, const decoder_shape& m, const std::vector<std::string>& targets, long r,
                            long batch = 1, long seq = 0, dtype activations = dtype::bf16) {
  require(r >= 1, "plan::with_lora ", m.name, ": the adapters' rank must be at least 1, got ", r);
  require(d.units.size() == std::size_t(m.layers) + 1, "plan::with_lora ", m.name,
          ": the model is not plan::decoder's (the root and one unit per block)");
  const auto modules = block_modules(m);
  const std::string prefix = m.family == family::gpt2 ? "transformer.h." : "model.layers.";
  const std::size_t rank = std::size_t(r);
  std::vector<bool> used(targets.size(), false);
  std::size_t adapter_elements = 0, adapted_outputs = 0;  // over all blocks
  // Per block and token: the inputs its frozen projections would have kept and nothing keeps now.
  std::vector<std::size_t> unkept(std::size_t(m.layers), 0);
  d.frozen.assign(d.units.size(), unit_freezing{});
  d.frozen[0] = {.ranges = {{0, d.units[0]}}, .all = true};
  for (long b = 0; b < m.layers; ++b) {
    unit_freezing& f = d.frozen[std::size_t(b) + 1];
    aligned_placement unit;
    f.all = true;
    const auto place = [&](std::size_t n, bool frozen) {
      const std::size_t at = unit.place(n);
      if (frozen) f.ranges.emplace_back(at, at + n);
      f.all = f.all && frozen;
    };
    std::size_t input = 0;  // the input the projections since the last that reads its own take
    bool kept = true;       // and whether one of them, or another layer, keeps it
    const auto close_input = [&] { unkept[std::size_t(b)] += kept ? 0 : input; };
    for (const auto& mod : modules) {
      if (mod.norm > 0) {
        for (std::size_t t = 0; t < mod.tensors; ++t) place(mod.norm, true);
        continue;
      }
      if (!mod.shares_input) {
        close_input();
        input = mod.in;
        kept = mod.input_kept;
      }
      place(mod.out * mod.in, true);
      if (mod.bias) place(mod.out, true);
      if (!nn::lora_targets_name(targets, cat(prefix, b, ".", mod.name), used)) continue;
      place(rank * mod.in, false);
      place(mod.out * rank, false);
      adapter_elements += rank * (mod.in + mod.out);
      adapted_outputs += rank;
      kept = true;  // lora_A's gradient reads it
    }
    close_input();
    d.units[std::size_t(b) + 1] = unit.end;
  }
  for (std::size_t k = 0; k < targets.size(); ++k)
    require(used[k], "plan::with_lora ", m.name, ": target '", targets[k], "' names no projection (e.g. ",
            m.family == family::gpt2 ? "c_attn, attn.c_proj, c_fc" : "q_proj, v_proj, down_proj", ")");
  long lead = 0;  // the frozen prefix: blocks before the first adapter
  while (lead < m.layers && d.frozen[std::size_t(lead) + 1].all) d.frozen[std::size_t(++lead)].no_backward = true;
  const double s = double(seq > 0 ? seq : m.seq), tokens = s * double(batch), q = double(m.q_width());
  d.activation_bytes -= std::size_t(double(lead) * decoder_block_bytes(d, m, batch, seq, activations));
  std::size_t dropped = 0;
  for (long b = lead; b < m.layers; ++b) dropped += unkept[std::size_t(b)];
  d.activation_bytes += std::size_t(tokens) * adapted_outputs * size_of(activations);
  d.activation_bytes -= std::min(d.activation_bytes, std::size_t(tokens) * dropped * size_of(activations));
  d.flops += tokens * (6 * double(adapter_elements) - 2 * double(multiplied_parameters(m)) -
                       double(lead) * (2 * double(block_parameters(m)) + 8 * q * s));
  return d;
}

}  // namespace shardlib::plan
