// shardlib/shard/strategy.hpp — a sharding strategy is a type that states its policy
// as data; the engine reads the policy and nothing else of it.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <concepts>     // std::same_as, std::convertible_to
#include <string>       // std::string
#include <string_view>  // std::string_view

namespace shardlib::shard {

// When a gathered unit's full parameters are freed (FSDP2's reshard_after_forward).
enum class free_point { never, after_backward, after_forward };
// How a unit's gradients are reduced across ranks.
enum class reduction {
  all_reduce,      // full gradients averaged in place on every rank (DDP)
  reduce_scatter,  // each rank receives the average of its shard only (ZeRO-1/2/3)
  hierarchical,    // reduce-scatter within the shard group, then all-reduce of the shard across groups (HSDP)
};

// What a strategy keeps sharded, over which ranks, when it frees gathered
// parameters and how it reduces gradients. The engine (shard/sharded_model.hpp),
// the planner (plan/) and checkpoints (io/) read only this.
struct policy {
  bool shard_parameters = true;  // parameters live as shards, gathered around each use
  bool shard_gradients = true;   // reduced gradients live as shards; full gradients only until reduced
  bool shard_optimizer = true;   // fp32 master weights and optimizer state live as shards
  int group_size = 0;            // ranks one shard is split over: 0 = all; G = groups of G, replicated across groups
  free_point free = free_point::after_forward;
  reduction reduce = reduction::reduce_scatter;
  // Freed after forward: 0 frees a unit's full values; R (dividing the shard group) keeps
  // this rank's 1/R of them until its backward, which all-gathers them within groups of R
  // consecutive ranks (one node's, say) instead of across the shard group: FSDP2's
  // reshard_after_forward=R, ZeRO++'s hpZ. R = 1 keeps them whole, R = the group frees them.
  int reshard_to = 0;

  // The ZeRO ladder: sharding parameters implies sharding gradients implies
  // sharding optimizer state (the engine implements no other combination).
  constexpr bool valid() const { return problem() == nullptr; }
  constexpr const char* problem() const {
    if (shard_parameters && !shard_gradients) return "sharded parameters need sharded gradients";
    if (shard_gradients && !shard_optimizer) return "sharded gradients need sharded optimizer state";
    if (shard_parameters == (free == free_point::never))
      return "gathered parameters are freed (after forward or backward) exactly when parameters are sharded";
    if (group_size < 0) return "group_size must be 0 (all ranks) or positive";
    if (group_size > 0 && !shard_parameters) return "shard groups (group_size > 0) need sharded parameters";
    if (reshard_to < 0) return "reshard_to must be 0 (free after forward) or positive";
    if (reshard_to > 0 && free != free_point::after_forward)
      return "reshard_to (keeping part of the full values after forward) needs parameters freed after forward";
    if ((reduce == reduction::all_reduce) == shard_optimizer)
      return "all-reduce is the reduction exactly when nothing is sharded";
    if ((reduce == reduction::hierarchical) != (group_size > 0))
      return "hierarchical reduction is the reduction exactly when shards live in groups";
    return nullptr;
  }
  // The shard group's size in a world of `world` ranks.
  constexpr int group(int world) const { return group_size > 0 ? group_size : world; }
  // The ranks a unit's backward all-gathers over when freed after forward: reshard_to where
  // fewer than the shard group (1: none, the unit is kept whole), else the shard group.
  constexpr int regather(int world) const {
    return reshard_to > 0 && reshard_to < group(world) ? reshard_to : group(world);
  }
  // reshard_to = 1 below the shard group: units are not freed after forward at all.
  constexpr bool keeps_whole(int world) const { return regather(world) == 1 && group(world) > 1; }
};

// A strategy: a name and a policy, both read from the value (HybridShard's policy
// depends on its group size; AnyStrategy's name on the strategy it holds). The
// library's own name themselves with a static member, which `s.name` reads too.
template <class S>
concept ShardingStrategy = std::copyable<S> && requires(const S& s) {
  { s.name } -> std::convertible_to<std::string_view>;
  { s.policy() } -> std::same_as<shard::policy>;
};

// The five the library ships: PyTorch FSDP's ShardingStrategy and DeepSpeed's ZeRO stages.
//
//                          parameters  gradients   optimizer   freed after       reduction
//  FullShard (ZeRO-3)      sharded     sharded     sharded     forward+backward  reduce-scatter
//  ShardGradOp (ZeRO-2)    sharded     sharded     sharded     backward          reduce-scatter
//  ShardOptimizer (ZeRO-1) replicated  replicated  sharded     (never gathered)  reduce-scatter
//  NoShard (DDP)           replicated  replicated  replicated  (never gathered)  all-reduce
//  HybridShard (HSDP)      FullShard within groups of group_size ranks, replicated across groups
struct FullShard {
  static constexpr std::string_view name = "FullShard";
  int reshard_to = 0;  // policy::reshard_to: 0 frees the full values after forward
  constexpr shard::policy policy() const { return {.reshard_to = reshard_to}; }
};
struct ShardGradOp {
  static constexpr std::string_view name = "ShardGradOp";
  constexpr shard::policy policy() const { return {.free = free_point::after_backward}; }
};
struct ShardOptimizer {
  static constexpr std::string_view name = "ShardOptimizer";
  constexpr shard::policy policy() const {
    return {.shard_parameters = false, .shard_gradients = false, .free = free_point::never};
  }
};
struct NoShard {
  static constexpr std::string_view name = "NoShard";
  constexpr shard::policy policy() const {
    return {.shard_parameters = false, .shard_gradients = false, .shard_optimizer = false,
            .free = free_point::never, .reduce = reduction::all_reduce};
  }
};
struct HybridShard {
  static constexpr std::string_view name = "HybridShard";
  int group_size = 1;  // ranks that shard one replica; must divide the world size
  int reshard_to = 0;  // policy::reshard_to: must divide group_size
  constexpr shard::policy policy() const {
    return {.group_size = group_size, .reduce = reduction::hierarchical, .reshard_to = reshard_to};
  }
};

// Any strategy chosen at run time, as FSDP's ShardingStrategy is an enum: the name
// and policy of the strategy it was made from. The engine reads only those, so one
// ShardedModel type serves a trainer's every --strategy (one instantiation instead of
// one per strategy); checkpoints record the original name.
struct AnyStrategy {
  std::string name{FullShard::name};
  shard::policy chosen{};

  AnyStrategy() = default;
  template <class S>
    requires(!std::same_as<S, AnyStrategy> && ShardingStrategy<S>)  // in this order: copying is not a recursion
  AnyStrategy(const S& s) : name(s.name), chosen(s.policy()) {}  // NOLINT: implicit on purpose
  shard::policy policy() const { return chosen; }
};

// The policy, checked: raises naming the strategy and what is inconsistent.
template <ShardingStrategy S>
shard::policy checked_policy(const S& s) {
  const shard::policy p = s.policy();
  require(p.valid(), "sharding strategy ", s.name, ": ", p.problem() ? p.problem() : "");
  return p;
}

}  // namespace shardlib::shard
