// shardlib/plan/chooser.hpp — which sharding strategies fit a device, ranked by
// predicted step time, each with a one-line reason.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"        // cat
#include "shardlib/core/ledger.hpp"       // category, name
#include "shardlib/plan/memory_plan.hpp"  // make_plan

#include <algorithm>    // std::max, std::stable_sort
#include <cstdio>       // std::snprintf
#include <optional>     // std::optional
#include <string>       // std::string
#include <type_traits>  // std::is_invocable_r_v
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::plan {

struct machine {
  double memory_bytes = 80e9;       // per rank
  double link_bytes_per_s = 100e9;  // what one rank sends per second (nccl-tests' bus bandwidth)
  double flops_per_s = 100e12;      // sustained, per rank
  // Nodes of node_size consecutive ranks (0: one link speed for everything): a collective
  // whose groups lie within a node sends at node_link_bytes_per_s (NVLink's bus bandwidth,
  // say), one that crosses nodes at link_bytes_per_s.
  int node_size = 0;
  double node_link_bytes_per_s = 0;
};

struct choice {
  setup config;
  rank_plan plan;
  bool fits = false;
  bool runs = true;  // false: the engine refuses the setup (engine_refusal), and why says why
  double compute_s = 0, comm_s = 0, step_s = 0;
  std::string why;  // one line
};

// "FullShard (ZeRO-3/FSDP)", "HybridShard (HSDP, groups of 2)", "FullShard (ZeRO-3/FSDP, reshard to 8)".
inline std::string label(const setup& s) {
  const int reshard = s.resolved().reshard_to < s.shard_group() ? s.resolved().reshard_to : 0;  // R = G: FullShard's
  return cat(name(s.strategy), " (", alias(s.strategy),
             s.strategy == strategy::hybrid_shard ? cat(", groups of ", s.group) : std::string(),
             reshard > 0 ? cat(", reshard to ", reshard) : std::string(), ")");
}

namespace detail {
// Decimal units, as device memory and link speeds are quoted.
inline std::string human(double bytes) {
  const char* unit = bytes >= 1e9 ? "GB" : bytes >= 1e6 ? "MB" : bytes >= 1e3 ? "kB" : "B";
  const double scale = bytes >= 1e9 ? 1e9 : bytes >= 1e6 ? 1e6 : bytes >= 1e3 ? 1e3 : 1;
  char b[32];
  std::snprintf(b, sizeof b, "%.1f %s", bytes / scale, unit);
  return b;
}
inline std::string seconds(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g s", s);
  return b;
}
}  // namespace detail

namespace detail {
// The setups choose compares: every strategy for base's world (HybridShard once per group size
// in hybrid_groups, by default every divisor of the world between 1 and it; with
// base.reshard_to, those it divides). Told the node size (mc.node_size) and no reshard_to,
// FullShard and each HybridShard whose shard group spans several whole nodes come a second
// time resharded to a node (FSDP2's reshard_after_forward = ranks per node, ZeRO++'s hpZ):
// backward then gathers within nodes, for 1/node of every unit held from forward to backward.
inline std::vector<setup> candidates(const model_desc& d, const setup& base, const machine& mc,
                                     std::vector<int> hybrid_groups) {
  require(mc.memory_bytes > 0 && mc.link_bytes_per_s > 0 && mc.flops_per_s > 0,
          "plan::choose: memory, link bandwidth and compute rate must be positive");
  require(mc.node_size == 0 || mc.node_link_bytes_per_s > 0,
          "plan::choose: nodes of ", mc.node_size, " ranks need their link bandwidth (node_link_bytes_per_s)");
  require(!base.policy, "plan::choose: base.policy is set, and a set policy overrides every candidate's strategy: "
          "leave it unset (choose compares the library's strategies; plan your own with make_plan)");
  require(d.flops > 0, "plan::choose: model_desc.flops is ", d.flops, "; set the forward + backward FLOPs of one "
          "rank's batch (6 x parameters x tokens, plus attention's 12 x layers x hidden x seq x tokens, for a "
          "transformer) so that compute is weighed against communication");
  if (hybrid_groups.empty())
    for (int g = 2; g < base.world; ++g)
      if (base.world % g == 0) hybrid_groups.push_back(g);
  std::vector<setup> out;
  const auto add = [&](setup c) {
    out.push_back(c);
    const int shard_group = c.shard_group(), node = mc.node_size;
    const bool resharded = c.strategy == strategy::full_shard || c.strategy == strategy::hybrid_shard;
    if (resharded && base.reshard_to == 0 && node > 1 && node < shard_group && shard_group % node == 0) {
      c.reshard_to = node;
      out.push_back(c);
    }
  };
  for (strategy s : all_strategies) {
    setup c = base;
    c.strategy = s;
    c.node_size = mc.node_size;
    if (s != strategy::hybrid_shard) {
      add(c);
      continue;
    }
    for (int g : hybrid_groups) {
      c.group = g;
      if (base.reshard_to == 0 || g % base.reshard_to == 0) add(c);
    }
  }
  return out;
}

// One setup planned, timed and explained; `title` opens its line.
inline choice evaluate(const model_desc& d, const setup& c, const machine& mc, const std::string& title) {
  choice ch;
  ch.config = c;
  ch.plan = make_plan(d, c);
  if (const std::string refusal = engine_refusal(c); !refusal.empty()) {
    ch.runs = false;
    ch.why = cat(title, " cannot run: ", refusal);
    return ch;
  }
  const double total = double(ch.plan.memory.total()), sent = ch.plan.sent.total();
  const traffic& t = ch.plan.sent;
  const double node_link = mc.node_size > 0 ? mc.node_link_bytes_per_s : mc.link_bytes_per_s;
  ch.fits = total <= mc.memory_bytes;
  ch.compute_s = double(c.accumulation.micro_batches) * d.flops / mc.flops_per_s;
  ch.comm_s = (sent - t.within_node) / mc.link_bytes_per_s + t.within_node / node_link;
  const double exposed_s =
      (t.exposed - t.exposed_within_node) / mc.link_bytes_per_s + t.exposed_within_node / node_link;
  ch.step_s = std::max(ch.compute_s, ch.comm_s - exposed_s) + exposed_s;
  if (!ch.fits) {
    category largest = category::parameters;
    for (int k = 0; k < category_count; ++k)
      if (ch.plan.memory[category(k)] > ch.plan.memory[largest]) largest = category(k);
    ch.why = cat(title, " does not fit: needs ", human(total), " of ", human(mc.memory_bytes), " (", name(largest), " ",
                 human(double(ch.plan.memory[largest])), ")");
    return ch;
  }
  const bool bound = ch.comm_s - exposed_s > ch.compute_s;
  ch.why = cat(title, " fits in ", human(total), " of ", human(mc.memory_bytes), "; sends ", human(sent), " per step",
               mc.node_size > 0 ? cat(" (", human(t.within_node), " within nodes)") : std::string(), ", ",
               seconds(ch.comm_s), " against ", seconds(ch.compute_s), " of compute",
               // under a thousandth of the step (the loss's all-reduce): not worth a clause
               exposed_s > 1e-3 * ch.step_s ? cat(" (", seconds(exposed_s), " of it not overlapped)") : std::string(),
               bound ? ": communication-bound" : ": compute-bound", ", ", seconds(ch.step_s), " per step");
  return ch;
}

// Those that fit first, fastest first, then those that do not, smallest first, then those the
// engine refuses. Equal step times: fewer bytes sent (less exposed to a slower link than
// assumed), then less memory (room for a larger batch).
inline void order(std::vector<choice>& out) {
  std::stable_sort(out.begin(), out.end(), [](const choice& a, const choice& b) {
    if (a.runs != b.runs) return a.runs;
    if (a.fits != b.fits) return a.fits;
    if (a.fits && a.step_s != b.step_s) return a.step_s < b.step_s;
    if (a.fits && a.plan.sent.total() != b.plan.sent.total()) return a.plan.sent.total() < b.plan.sent.total();
    return a.plan.memory.total() < b.plan.memory.total();
  });
}
}  // namespace detail

// Every strategy for base's world, precision, prefetch and optimizer (HybridShard once
// per group size in hybrid_groups; by default every divisor of the world between 1 and
// it; with base.reshard_to, those it divides; with mc.node_size, FullShard and HybridShard
// resharded to a node too): those that fit first, fastest first, then those that do not,
// smallest first, then those the engine refuses (engine_refusal).
// d.flops must be set (one micro-batch's: base.accumulation.micro_batches of them make a step): the step
// time weighs compute against communication; base.policy
// must not be (it would replace every candidate's strategy).
// A strategy fits when the sum of its category peaks fits (an upper bound on the
// peak). Step time = max(compute, overlapped communication) + exposed communication:
// prefetched gathers and reductions issued as each unit's backward ends run during
// compute; ZeRO-1's parameter all-gather after the step and HybridShard's replica
// all-reduce do not. Communication takes the bytes over the link they use: with
// mc.node_size, what collectives within a node send over the node's links.
inline std::vector<choice> choose(const model_desc& d, const setup& base, const machine& mc,
                                  std::vector<int> hybrid_groups = {}) {
  std::vector<choice> out;
  for (const setup& c : detail::candidates(d, base, mc, std::move(hybrid_groups)))
    out.push_back(detail::evaluate(d, c, mc, label(c)));
  detail::order(out);
  return out;
}

// The same for a step of `batch` sequences per rank, split for each strategy into the fewest
// micro-batches that fit (DeepSpeed's train_micro_batch_size_per_gpu, searched): k micro-batches
// of batch / k sequences, k a divisor of batch from 1 up, as base.accumulation says they run
// (each reduced by default). describe(b) is the model at micro-batch b sequences (its
// activations and one micro-batch's FLOPs). A strategy that fits at no k is listed at
// k = batch, one sequence a micro-batch; one the engine refuses, at k = 1. Ranked as choose
// ranks them: the whole step's compute is the same at every k, while each micro-batch reduces
// (and, where parameters are sharded, gathers) again, so fewer micro-batches are faster.
template <class Describe>
  requires std::is_invocable_r_v<model_desc, Describe&, long>
std::vector<choice> choose_micro_batches(Describe&& describe, long batch, const setup& base, const machine& mc,
                                         std::vector<int> hybrid_groups = {}) {
  require(batch > 0, "plan::choose_micro_batches: the step's batch is ", batch, "; it needs one sequence at least");
  std::vector<long> splits;  // k, fewest first
  for (long k = 1; k <= batch; ++k)
    if (batch % k == 0) splits.push_back(k);
  std::vector<std::optional<model_desc>> models(splits.size());  // describe(batch / k), made when first needed
  const auto model_at = [&](std::size_t i) -> const model_desc& {
    if (!models[i]) models[i] = describe(batch / splits[i]);
    return *models[i];
  };
  std::vector<choice> out;
  for (setup c : detail::candidates(model_at(0), base, mc, std::move(hybrid_groups))) {
    for (std::size_t i = 0; i < splits.size(); ++i) {
      c.accumulation.micro_batches = int(splits[i]);
      const long micro = batch / splits[i];
      auto ch = detail::evaluate(
          model_at(i), c, mc,
          cat(label(c), ", ", splits[i], splits[i] == 1 ? " micro-batch of " : " micro-batches of ", micro,
              micro == 1 ? " sequence" : " sequences"));
      if (ch.fits || !ch.runs || i + 1 == splits.size()) {
        out.push_back(std::move(ch));
        break;
      }
    }
  }
  detail::order(out);
  return out;
}

}  // namespace shardlib::plan
