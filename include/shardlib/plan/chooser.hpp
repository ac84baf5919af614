// shardlib/plan/chooser.hpp — which sharding strategies fit a device, ranked by
// predicted step time, each with a one-line reason.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"        // cat
#include "shardlib/core/ledger.hpp"       // category, name
#include "shardlib/plan/memory_plan.hpp"  // make_plan

#include <algorithm>  // std::max, std::stable_sort
#include <cstdio>     // std::snprintf
#include <string>     // std::string
#include <vector>     // std::vector

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

// Every strategy for base's world, precision, prefetch and optimizer (HybridShard once
// per group size in hybrid_groups; by default every divisor of the world between 1 and
// it; with base.reshard_to, those it divides): those that fit first, fastest first, then
// those that do not, smallest first, then those the engine refuses (engine_refusal).
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
  std::vector<setup> candidates;
  for (strategy s : all_strategies) {
    setup c = base;
    c.strategy = s;
    c.node_size = mc.node_size;
    if (s != strategy::hybrid_shard) {
      candidates.push_back(c);
      continue;
    }
    for (int g : hybrid_groups) {
      c.group = g;
      if (base.reshard_to == 0 || g % base.reshard_to == 0) candidates.push_back(c);
    }
  }
  std::vector<choice> out;
  for (const setup& c : candidates) {
    choice ch;
    ch.config = c;
    ch.plan = make_plan(d, c);
    if (const std::string refusal = engine_refusal(c); !refusal.empty()) {
      ch.runs = false;
      ch.why = cat(label(c), " cannot run: ", refusal);
      out.push_back(std::move(ch));
      continue;
    }
    const double total = double(ch.plan.memory.total()), sent = ch.plan.sent.total();
    const traffic& t = ch.plan.sent;
    const double node_link = mc.node_size > 0 ? mc.node_link_bytes_per_s : mc.link_bytes_per_s;
    ch.fits = total <= mc.memory_bytes;
    ch.compute_s = double(c.accumulation.micro_batches) * d.flops / mc.flops_per_s;
    ch.comm_s = (sent - t.within_node) / mc.link_bytes_per_s + t.within_node / node_link;
    const double exposed_s = (t.exposed - t.exposed_within_node) / mc.link_bytes_per_s + t.exposed_within_node / node_link;
    ch.step_s = std::max(ch.compute_s, ch.comm_s - exposed_s) + exposed_s;
    if (!ch.fits) {
      category largest = category::parameters;
      for (int k = 0; k < category_count; ++k)
        if (ch.plan.memory[category(k)] > ch.plan.memory[largest]) largest = category(k);
      ch.why = cat(label(c), " does not fit: needs ", detail::human(total), " of ", detail::human(mc.memory_bytes),
                   " (", name(largest), " ", detail::human(double(ch.plan.memory[largest])), ")");
    } else {
      const bool bound = ch.comm_s - exposed_s > ch.compute_s;
      ch.why = cat(label(c), " fits in ", detail::human(total), " of ", detail::human(mc.memory_bytes), "; sends ",
                   detail::human(sent), " per step",
                   mc.node_size > 0 ? cat(" (", detail::human(t.within_node), " within nodes)") : std::string(), ", ",
                   detail::seconds(ch.comm_s), " against ",
                   detail::seconds(ch.compute_s), " of compute",
                   // under a thousandth of the step (the loss's all-reduce): not worth a clause
                   exposed_s > 1e-3 * ch.step_s ? cat(" (", detail::seconds(exposed_s), " of it not overlapped)")
                                                : std::string(),
                   bound ? ": communication-bound" : ": compute-bound", ", ", detail::seconds(ch.step_s), " per step");
    }
    out.push_back(std::move(ch));
  }
  // Equal step times: fewer bytes sent (less exposed to a slower link than assumed),
  // then less memory (room for a larger batch).
  std::stable_sort(out.begin(), out.end(), [](const choice& a, const choice& b) {
    if (a.runs != b.runs) return a.runs;
    if (a.fits != b.fits) return a.fits;
    if (a.fits && a.step_s != b.step_s) return a.step_s < b.step_s;
    if (a.fits && a.plan.sent.total() != b.plan.sent.total()) return a.plan.sent.total() < b.plan.sent.total();
    return a.plan.memory.total() < b.plan.memory.total();
  });
  return out;
}

}  // namespace shardlib::plan
