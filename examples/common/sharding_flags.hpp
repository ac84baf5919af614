// examples/common/sharding_flags.hpp — how the language-model examples (train_gpt,
// train_gpt_cuda) shard and step: FullShard, every block a unit; --reshard-to R keeps this
// rank's 1/R of each block from its forward to its backward, whose all-gather then runs
// within groups of R ranks (shard::policy::reshard_to: FSDP2's reshard_after_forward=R,
// ZeRO++'s hpZ); --grad-accum K makes each step K micro-batches of --batch sequences per
// rank (train_step over them), --no-sync and --no-reshard-after-backward say how those
// before the last run (shard::step_options).
#pragma once
#include <shardlib/core/error.hpp>
#include <shardlib/shard/options.hpp>
#include <shardlib/shard/strategy.hpp>

#include <string>
#include <vector>

#include "common/flags.hpp"

namespace example {

struct sharding_settings : accumulation_flags {
  int reshard_to = 0;  // 0: blocks freed whole after forward
};

inline void add_sharding_flags(command_line& cli, sharding_settings& s) {
  cli.add_option("--reshard-to", s.reshard_to,
                 "after forward each block keeps 1/R of its values, gathered again within groups of R ranks in "
                 "backward (one node's, say; shard::policy::reshard_to); R divides the ranks")
      ->check(whole(1, max_size));
  add_accumulation_flags(cli, s);
}

// The step over this rank's micro-batches with the flags' accumulation options (one
// micro-batch: the plain train_step, which compares nothing across ranks).
template <class Sharded, class Optimizer, class X, class Y, class LossFn>
auto train_step(Sharded& sharded, Optimizer& opt, const std::vector<X>& xs, const std::vector<Y>& ys, LossFn&& loss,
                const accumulation_flags& s, shardlib::shard::step_options so) {
  so.no_sync = s.no_sync;
  so.reshard_after_backward = !s.no_reshard_after_backward;
  so.replica_all_reduce = !s.no_replica_all_reduce;
  if (xs.size() == 1) return sharded.train_step(opt, xs[0], ys[0], loss, so);
  return sharded.train_step(opt, xs, ys, loss, so);
}

inline shardlib::shard::FullShard full_shard(const sharding_settings& s) { return {.reshard_to = s.reshard_to}; }

// For the programs' first lines: "" or ", resharded to R after forward", and the micro-batches.
inline std::string sharding_note(const sharding_settings& s) {
  using shardlib::cat;
  return cat(s.reshard_to > 0 ? cat(", resharded to ", s.reshard_to, " after forward") : std::string(),
             s.grad_accum > 1 ? cat(", ", accumulation_note(s)) : std::string());
}

}  // namespace example
