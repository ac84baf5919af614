// shardlib/plan/transformer.hpp — a coarse transformer as the planner sees it: blocks of
// 12·hidden² parameters, the rest in the root, activations and FLOPs estimated from the
// published formulas (when no model is at hand to describe or measure).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"      // dtype, size_of
#include "shardlib/core/error.hpp"        // require
#include "shardlib/plan/memory_plan.hpp"  // model_desc

#include <cstddef>  // std::size_t

namespace shardlib::plan {

// A coarse transformer: `layers` blocks of 12·hidden² parameters each (attention
// 4·hidden², a 4·hidden feed-forward 8·hidden²; biases and norms neglected), each
// block a unit, and the rest of `parameters` (embeddings, head) in the root.
struct transformer_shape {
  double parameters = 0;  // all of them; 0 means the blocks alone
  long layers = 0, hidden = 0, heads = 1, seq = 0;
  long batch = 1;  // per rank
  // The layers' attention is the device's fused one (nn/cuda/attention.cuh): it keeps
  // no [batch, heads, seq, seq] weights for backward, only the output and a float
  // log-sum-exp per (batch, head, query). The host layers keep the weights (false).
  bool fused_attention = false;
  // Bytes per attention weight (in 16 bits) the layers keep for backward otherwise:
  // Korthikanti's 5 (softmax 2, dropout mask 1, dropout output 2) for layers in general;
  // the library's host attention keeps the softmax alone and draws its dropout mask
  // again (nn/sdpa.hpp): 2, as plan::decoder counts it for GPT-2 and LLaMA.
  double kept_per_weight = 5;
};

// Activations are estimated as Korthikanti et al. 2022 ("Reducing Activation
// Recomputation in Large Transformer Models", eq. 1, no parallelism, no recomputation):
// seq·batch·hidden·(34 + k·heads·seq/hidden) bytes per layer with 16-bit activations,
// scaled by size_of(activations)/2, k = kept_per_weight (the paper's 5; the library's
// host attention 2). A fused attention replaces the k term by its 4·heads·seq bytes of
// log-sum-exp (floats, whatever the activations' dtype; the output it keeps is among the
// 34). FLOPs: 6 per parameter per token plus attention's 12·layers·hidden·seq per token
// (Narayanan et al. 2021, eq. 3 without recomputation).
inline model_desc transformer(const transformer_shape& t, dtype activations = dtype::bf16) {
  require(t.layers >= 1 && t.hidden >= 1 && t.heads >= 1 && t.seq >= 1 && t.batch >= 1,
          "plan::transformer: layers, hidden, heads, seq and batch must be positive");
  const std::size_t block = std::size_t(12) * std::size_t(t.hidden) * std::size_t(t.hidden);
  const double blocks = double(block) * double(t.layers);
  require(t.parameters == 0 || t.parameters >= blocks, "plan::transformer: ", t.layers, " blocks of hidden size ",
          t.hidden, " alone have ", blocks, " parameters, more than the ", t.parameters, " given");
  model_desc d;
  d.units.push_back(t.parameters == 0 ? 0 : std::size_t(t.parameters - blocks));
  d.units.insert(d.units.end(), std::size_t(t.layers), block);
  const double s = double(t.seq), b = double(t.batch), h = double(t.hidden), a = double(t.heads);
  const double weights = t.fused_attention ? 0 : t.kept_per_weight * a * s / h, lse = t.fused_attention ? 4 * a * s * b : 0;
  const double bytes = double(t.layers) * (s * b * h * (34 + weights) * double(size_of(activations)) / 2 + lse);
  require(bytes < 0x1p64, "plan::transformer: ", bytes, " bytes of activations are more than a 64-bit count holds");
  d.activation_bytes = std::size_t(bytes);
  d.flops = 6 * double(d.parameters()) * s * b + 12 * double(t.layers) * h * s * s * b;
  return d;
}

}  // namespace shardlib::plan
