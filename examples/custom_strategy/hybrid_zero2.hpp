// examples/custom_strategy/hybrid_zero2.hpp — a sharding strategy the library does
// not ship, defined by its policy alone: PyTorch FSDP's _HYBRID_SHARD_ZERO2. Inside
// each group of `group_size` ranks it is ZeRO-2 (parameters gathered for the whole
// forward and backward, gradients and optimizer state sharded); across groups the
// shards are replicated and their gradients averaged. The engine, the planner and
// checkpoints read the policy; none of them names this type.
#pragma once
#include <shardlib/shard/strategy.hpp>

#include <string_view>

namespace example {

struct HybridShardZeRO2 {
  static constexpr std::string_view name = "HybridShardZeRO2";
  int group_size = 1;  // must divide the world size
  constexpr shardlib::shard::policy policy() const {
    return {.group_size = group_size,
            .free = shardlib::shard::free_point::after_backward,
            .reduce = shardlib::shard::reduction::hierarchical};
  }
};
static_assert(shardlib::shard::ShardingStrategy<HybridShardZeRO2>);

}  // namespace example
