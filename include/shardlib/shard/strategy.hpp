// shardlib/shard/strategy.hpp — sharding strategies as compile-time policies.
#pragma once
#include "shardlib/config.hpp"

#include <concepts>     // std::same_as
#include <string_view>  // std::string_view

namespace shardlib::shard {

// What each strategy keeps sharded, and when gathered parameters are freed.
//
//                      parameters     gradients      optimizer state   gathered params freed
//  FullShard (ZeRO-3)  sharded        sharded        sharded           after forward and after backward
//  ShardGradOp (ZeRO-2) sharded       sharded        sharded           after backward only
//  ShardOptimizer (ZeRO-1) replicated replicated     sharded           never (always full)
//  NoShard (DDP)       replicated     replicated     replicated        never (always full)
//  HybridShard         FullShard inside groups of group_size ranks, replicated across groups
struct FullShard {
  static constexpr std::string_view name = "FullShard";
  static constexpr bool shards_parameters = true;
  static constexpr bool shards_optimizer = true;
  static constexpr bool frees_after_forward = true;
};
struct ShardGradOp {
  static constexpr std::string_view name = "ShardGradOp";
  static constexpr bool shards_parameters = true;
  static constexpr bool shards_optimizer = true;
  static constexpr bool frees_after_forward = false;
};
struct ShardOptimizer {
  static constexpr std::string_view name = "ShardOptimizer";
  static constexpr bool shards_parameters = false;
  static constexpr bool shards_optimizer = true;
  static constexpr bool frees_after_forward = false;
};
struct NoShard {
  static constexpr std::string_view name = "NoShard";
  static constexpr bool shards_parameters = false;
  static constexpr bool shards_optimizer = false;
  static constexpr bool frees_after_forward = false;
};
struct HybridShard {
  static constexpr std::string_view name = "HybridShard";
  static constexpr bool shards_parameters = true;
  static constexpr bool shards_optimizer = true;
  static constexpr bool frees_after_forward = true;
  int group_size = 1;  // ranks that shard one replica; must divide the world size
};

template <class S>
concept ShardingStrategy = requires {
  { S::name } -> std::convertible_to<std::string_view>;
  { S::shards_parameters } -> std::convertible_to<bool>;
  { S::shards_optimizer } -> std::convertible_to<bool>;
  { S::frees_after_forward } -> std::convertible_to<bool>;
};

}  // namespace shardlib::shard
