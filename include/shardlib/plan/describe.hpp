// shardlib/plan/describe.hpp — a plan::model_desc from a shardlib model: from the
// units of a wrapped model (exact), from a model walked as fully_shard would walk it,
// and its activations measured by one unsharded forward and backward.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"       // ledger, ledger_scope
#include "shardlib/nn/context.hpp"        // nn::context
#include "shardlib/nn/flat.hpp"           // nn::flat_layout
#include "shardlib/nn/layer.hpp"          // nn::Layer, nn::Composite, nn::join_name
#include "shardlib/nn/replicated.hpp"     // nn::Replicated
#include "shardlib/plan/memory_plan.hpp"  // model_desc
#include "shardlib/shard/discover.hpp"    // shard::discover_units, wrap_policy
#include "shardlib/shard/sharded_model.hpp"  // shard::checkpoint_context, shard::checkpoints
#include "shardlib/shard/wrap.hpp"        // shard::wrap_none

#include <algorithm>      // std::find
#include <cstddef>        // std::size_t
#include <numeric>        // std::iota
#include <string_view>    // std::string_view
#include <utility>        // std::move
#include <vector>         // std::vector

namespace shardlib::plan {

namespace detail {
// A unit's frozen parameters as the planner reads them from its flat layout.
inline unit_freezing freezing_of(const nn::flat_layout& l, bool no_backward = false) {
  unit_freezing f{.all = l.all_frozen(), .no_backward = no_backward};
  for (const auto& e : l.entries)
    if (!e.requires_grad) f.ranges.emplace_back(e.offset, e.offset + e.numel());
  return f;
}
// d.frozen filled only when some unit has a frozen parameter or skips its backward.
inline void keep_if_frozen(model_desc& d, std::vector<unit_freezing> f) {
  for (const auto& u : f)
    if (!u.ranges.empty() || u.no_backward) {
      d.frozen = std::move(f);
      return;
    }
}
}  // namespace detail

// The units of a ShardedModel, in the forward order it recorded (in the order they
// were found before its first forward), with their frozen parameters, those kept
// gathered after forward (options.keep_gathered) and, after a
// training step, which of them a frozen prefix ran without backward (a last forward
// run wholly without grad, as generate's, says nothing of it).
template <class Engine>
  requires requires(const Engine& e) {
    e.unit_layout(0);
    e.unit_skips_backward(0);
    e.unit_keeps_gathered(0);
    e.neighbor(0, 1);
  }
model_desc describe(const Engine& e, std::size_t activation_bytes = 0) {
  std::vector<int> order{0};
  for (int i = e.neighbor(0, +1); i >= 0; i = e.neighbor(i, +1)) order.push_back(i);
  if (order.size() != e.unit_count()) {  // not recorded yet
    order.resize(e.unit_count());
    std::iota(order.begin(), order.end(), 0);
  }
  model_desc d;
  std::vector<unit_freezing> frozen;
  std::vector<bool> kept;
  const bool trained = !e.unit_skips_backward(0);  // else the last forward ran wholly without grad (an eval)
  for (int i : order) {
    const auto k = std::size_t(i);
    d.units.push_back(e.unit_layout(k).numel);
    frozen.push_back(detail::freezing_of(e.unit_layout(k), trained && e.unit_skips_backward(k)));
    kept.push_back(e.unit_keeps_gathered(k));
  }
  detail::keep_if_frozen(d, std::move(frozen));
  if (std::find(kept.begin(), kept.end(), true) != kept.end()) d.kept_gathered = std::move(kept);
  d.activation_bytes = activation_bytes;
  return d;
}

// The units fully_shard(model, comm, strategy, {.wrap = wrap}) makes (the same walk:
// shard/discover.hpp), in the order it finds them, which is the forward order for
// Sequential and Stack models. Layers hold no parameter storage, so a model built
// only to be described costs nothing. Frozen parameters are read from their flags;
// which units a frozen prefix runs without backward shows only when the model runs,
// so describe(the wrapped model) after a step for that.
template <class T = float, nn::Layer Model>
model_desc describe_model(Model& model, shard::wrap_policy wrap = shard::wrap_none{}, std::size_t activation_bytes = 0) {
  model_desc d;
  std::vector<unit_freezing> frozen;
  for (const auto& u : shard::discover_units<T>(model, wrap)) {
    d.units.push_back(u.layout.numel);
    frozen.push_back(detail::freezing_of(u.layout));
  }
  detail::keep_if_frozen(d, std::move(frozen));
  d.activation_bytes = activation_bytes;
  return d;
}

// Peak activation bytes of one step of the unsharded model: run(ctx) makes one rank's
// local batch, runs forward, the loss and backward through ctx, as train_step would
// (the batch and the loss's gradient count as activations too). Every strategy
// reproduces this peak: sharding moves parameters, not activations. The model's
// parameter views are left pointing at freed storage: wrap the model (or bind it)
// before running it again.
template <class T = float, nn::Layer Model, class Run>
std::size_t measure_activations(Model& model, Run&& run) {
  ledger l;
  ledger_scope scope(l);
  nn::Replicated<T, Model> owner(model, 0);
  nn::context ctx;
  run(ctx);
  return l.peak(category::activations);
}

// The same with activation checkpointing as options.checkpoint = `checkpoint` runs
// it (the engine's own recompute, without sharding); run takes `auto& ctx`. The peak
// is then, where the engine reaches it: the inputs the checkpointed layers keep, plus
// one checkpointed layer's full activations while it recomputes and runs backward
// (its kept input handed back, its output recomputed and dropped), plus what the
// layers outside them keep — a sum over the step's order, which is why it is
// measured here rather than added from per-layer figures.
template <class T = float, nn::Layer Model, class Run>
std::size_t measure_activations(Model& model, const shard::wrap_policy& checkpoint, Run&& run) {
  ledger l;
  ledger_scope scope(l);
  nn::Replicated<T, Model> owner(model, 0);
  shard::checkpoint_context ctx({}, shard::checkpoints(model, checkpoint));
  run(ctx);
  return l.peak(category::activations);
}

}  // namespace shardlib::plan
