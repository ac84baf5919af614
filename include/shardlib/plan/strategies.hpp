// shardlib/plan/strategies.hpp — the library's sharding strategies as values, so that one
// program can plan them all: their names, what PyTorch and DeepSpeed call them, their policies.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/shard/strategy.hpp"  // the strategy tags and shard::policy

#include <string_view>  // std::string_view

namespace shardlib::plan {

// The strategies as values, so one program can plan them all.
enum class strategy { no_shard, shard_optimizer, shard_grad_op, full_shard, hybrid_shard };
inline constexpr strategy all_strategies[] = {strategy::no_shard, strategy::shard_optimizer, strategy::shard_grad_op,
                                              strategy::full_shard, strategy::hybrid_shard};

// The shard:: tag's name.
constexpr std::string_view name(strategy s) {
  switch (s) {
    case strategy::no_shard:
      return "NoShard";
    case strategy::shard_optimizer:
      return "ShardOptimizer";
    case strategy::shard_grad_op:
      return "ShardGradOp";
    case strategy::full_shard:
      return "FullShard";
    case strategy::hybrid_shard:
      return "HybridShard";
  }
  return "?";
}
// What DeepSpeed and PyTorch call it.
constexpr std::string_view alias(strategy s) {
  switch (s) {
    case strategy::no_shard:
      return "DDP";
    case strategy::shard_optimizer:
      return "ZeRO-1";
    case strategy::shard_grad_op:
      return "ZeRO-2";
    case strategy::full_shard:
      return "ZeRO-3/FSDP";
    case strategy::hybrid_shard:
      return "HSDP";
  }
  return "?";
}

// The policy of the library's strategy `s` (HybridShard with groups of `group`).
constexpr shard::policy policy_of(strategy s, int group = 0) {
  switch (s) {
    case strategy::no_shard:
      return shard::NoShard{}.policy();
    case strategy::shard_optimizer:
      return shard::ShardOptimizer{}.policy();
    case strategy::shard_grad_op:
      return shard::ShardGradOp{}.policy();
    case strategy::full_shard:
      return shard::FullShard{}.policy();
    case strategy::hybrid_shard:
      return shard::HybridShard{.group_size = group}.policy();
  }
  return {};
}

}  // namespace shardlib::plan
