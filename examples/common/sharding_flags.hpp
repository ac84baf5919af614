// examples/common/sharding_flags.hpp — how the language-model examples (train_gpt,
// train_gpt_cuda) shard: FullShard, every block a unit; --reshard-to R keeps this rank's 1/R
// of each block from its forward to its backward, whose all-gather then runs within groups
// of R ranks (shard::policy::reshard_to: FSDP2's reshard_after_forward=R, ZeRO++'s hpZ).
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/shard/strategy.hpp>

#include <string>

#include "common/flags.hpp"

namespace example {

struct sharding_settings {
  int reshard_to = 0;  // 0: blocks freed whole after forward
};

inline void add_sharding_flags(command_line& cli, sharding_settings& s) {
  cli.add_option("--reshard-to", s.reshard_to,
                 "after forward each block keeps 1/R of its values, gathered again within groups of R ranks in "
                 "backward (one node's, say; shard::policy::reshard_to); R divides the ranks")
      ->check(whole(1, max_size));
}

inline shardlib::shard::FullShard full_shard(const sharding_settings& s) { return {.reshard_to = s.reshard_to}; }

// For the programs' first lines: "" or ", resharded to R after forward".
inline std::string sharding_note(const sharding_settings& s) {
  return s.reshard_to > 0 ? shardlib::cat(", resharded to ", s.reshard_to, " after forward") : std::string();
}

}  // namespace example
