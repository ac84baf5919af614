// shardlib/plan/zero_states.hpp — the model states per rank as the ZeRO paper counts them
// (16-bit parameters and gradients, K bytes of optimizer state per parameter), read off a
// sharding policy: the paper's arithmetic beside the planner's exact plan.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/plan/step_replay.hpp"  // accumulation
#include "shardlib/shard/strategy.hpp"    // shard::policy, free_point

namespace shardlib::plan {

// The model states as the ZeRO paper counts them (Rajbhandari et al. 2020, sec. 5):
// 16-bit parameters 2Ψ, 16-bit gradients 2Ψ, and K·Ψ of optimizer state (fp32
// master and moments: K = 12 for mixed-precision Adam), each divided by the shard
// group where the policy keeps it sharded at the step's peak. Parameters count as
// sharded only when freed after forward (FullShard); a strategy that holds them
// gathered through backward (ShardGradOp) peaks with all of them, as ZeRO-2 does.
struct model_states {
  double parameters = 0, gradients = 0, optimizer = 0;
  double total() const { return parameters + gradients + optimizer; }
};
// With policy::reshard_to = R (1 < R < G) the peak holds each unit's 1/R part beside the
// shards, as ZeRO++'s hpZ counts its secondary partition; R = 1 keeps them whole (as ZeRO-2).
// Accumulated micro-batches under no_sync hold every gradient unreduced (2Ψ), and units kept
// gathered after backward every parameter (2Ψ), until the last micro-batch.
inline model_states zero_model_states(const shard::policy& pol, int world, double psi, double k = 12,
                                      const accumulation& acc = {}) {
  const double G = double(pol.group(world)), R = double(pol.regather(world));
  const bool accumulating = acc.micro_batches > 1;
  const bool params_sharded = pol.shard_parameters && pol.free == shard::free_point::after_forward && R > 1 &&
                              !(accumulating && acc.keep_after_backward);
  const bool grads_sharded = pol.shard_gradients && !(accumulating && acc.no_sync);
  return {params_sharded ? 2 * psi / G + (R < G ? 2 * psi / R : 0) : 2 * psi, 2 * psi / (grads_sharded ? G : 1),
          k * psi / (pol.shard_optimizer ? G : 1)};
}

}  // namespace shardlib::plan
