// shardlib/plan/step_replay.hpp — one training step replayed in the engine's order of
// gathers, frees, full gradients and reductions: the peaks that depend on how they interleave.
#pragma once
#include "shardlib/config.hpp"

#include <algorithm>  // std::max
#include <cstddef>    // std::size_t
#include <optional>   // std::optional
#include <vector>     // std::vector

namespace shardlib::plan {

// Gradient accumulation: one optimizer step over `micro_batches` forwards and backwards, as
// ShardedModel::train_step over micro-batches runs them. no_sync (step_options::no_sync):
// those before the last keep their full local gradients unreduced, and the last reduces them
// all; keep_after_backward (step_options::reshard_after_backward = false): each unit stays
// gathered from their backward to the next forward; replica_all_reduce = false
// (step_options::replica_all_reduce): HybridShard averages across its replica groups once, at
// the last micro-batch. A loop by hand (set_sync, set_reshard_after_backward, step()) holds and
// sends the same but for train_step's small all-reduces (memory_plan.hpp).
struct accumulation {
  int micro_batches = 1;
  bool no_sync = false, keep_after_backward = false;
  bool replica_all_reduce = true;
};

namespace detail {
// One step replayed in the engine's order (sharded_model.hpp: pre_forward,
// post_forward, pre_backward, post_backward, finish_backward; gather.hpp; reduce.hpp),
// for what depends on how gathers, reductions and frees interleave. Per unit i (0 is the
// root, the rest in forward order):
//   gathered[i]  elements of full values when sharded (0: replicated)
//   send[i]      bytes of scratch its all-gather sends from, held until waited for
//   full[i]      elements of full local gradients (sharded optimizer state only), made
//                at its backward and dropped once reduced; under ZeRO-1 (keeps_full)
//                made with the unit and kept, but a wholly frozen unit's
//   reduce[i]    bytes of scratch its reduction needs, held until the next is issued;
//                reduce_again[i] when its reduced gradients already hold an earlier
//                micro-batch's (received apart, then added)
//   released[i]  its full gradients are dropped as its reduction is issued (widened or
//                packed into the scratch), not once it is done
//   frozen[i]    every parameter frozen: it reduces nothing; backward[i]: it runs one (not a frozen prefix's)
//   kept[i]      not freed after its forward when the policy frees there (options.keep_gathered)
//   part[i]      elements kept when freed after its forward (policy::reshard_to: 1/R of gathered[i],
//                made before the full values go), its backward's all-gather sent from them
//                within groups of R and holding part_send[i] bytes of scratch; 0: none
struct step_units {
  std::vector<std::size_t> gathered, send, full, reduce, reduce_again, part, part_send;
  std::vector<bool> released, frozen, backward, kept;
};
struct step_replay {
  std::size_t gathered_peak = 0, scratch_peak = 0, full_grad_peak = 0;  // elements (parts among them), bytes, elements
  double gathered_sent = 0;    // elements: gathered[i] summed over the gathers issued from the shards
  double regathered_sent = 0;  // and over those issued from the parts kept after forward
};
inline step_replay replay(const step_units& u, std::size_t prefetch, bool frees_after_forward, bool keeps_full,
                          accumulation loop = {}) {
  const std::size_t n = u.gathered.size();
  enum class state { sharded, gathering, gathered };
  std::vector<state> st(n, state::sharded);
  std::vector<bool> has_full(n, false), has_part(n, false), reduced(n, false);
  step_replay r;
  std::size_t gathered = 0, scratch = 0, full = 0;
  std::optional<std::size_t> reducing;  // the unit whose reduction is in flight
  auto add = [](std::size_t& now, std::size_t& peak, std::size_t b) { peak = std::max(peak, now += b); };
  auto sending = [&](std::size_t i) { return has_part[i] ? u.part_send[i] : u.send[i]; };
  auto reducing_with = [&](std::size_t i) { return reduced[i] ? u.reduce_again[i] : u.reduce[i]; };
  auto issue = [&](std::size_t i) {
    if (st[i] != state::sharded) return;
    add(gathered, r.gathered_peak, u.gathered[i]);
    add(scratch, r.scratch_peak, sending(i));
    (has_part[i] ? r.regathered_sent : r.gathered_sent) += double(u.gathered[i]);
    st[i] = state::gathering;
  };
  auto ensure = [&](std::size_t i) {
    issue(i);
    if (st[i] == state::gathering) {  // completed: its scratch and the part it was sent from go
      scratch -= sending(i);
      if (has_part[i]) gathered -= u.part[i];
      has_part[i] = false;
    }
    st[i] = state::gathered;
  };
  auto free = [&](std::size_t i) {
    if (st[i] != state::sharded) gathered -= u.gathered[i];
    st[i] = state::sharded;
  };
  auto make_full = [&](std::size_t i) {
    if (!has_full[i]) add(full, r.full_grad_peak, u.full[i]);
    has_full[i] = true;
  };
  auto drop_full = [&](std::size_t i) {
    if (has_full[i]) full -= u.full[i];
    has_full[i] = false;
  };
  auto finish = [&] {  // the reduction in flight completes: its scratch and full gradients go
    if (!reducing) return;
    scratch -= reducing_with(*reducing);
    reduced[*reducing] = true;
    if (!keeps_full) drop_full(*reducing);
    reducing.reset();
  };
  auto post_backward = [&](std::size_t i, bool sync) {
    if (u.frozen[i]) return drop_full(i);  // nothing to send, nothing to keep
    if (!sync) return;                     // its full gradients wait for a backward that reduces
    finish();
    add(scratch, r.scratch_peak, reducing_with(i));
    if (u.released[i] && !keeps_full) drop_full(i);
    reducing = i;
  };
  if (keeps_full)
    for (std::size_t i = 0; i < n; ++i)
      if (!u.frozen[i]) make_full(i);
  for (int micro = 0; micro < loop.micro_batches; ++micro) {
    const bool last = micro + 1 == loop.micro_batches;
    const bool sync = last || !loop.no_sync, reshard = last || !loop.keep_after_backward;
    for (std::size_t i = 0; i < n; ++i) {
      ensure(i);
      for (std::size_t k = i + 1; k <= i + prefetch && k < n; ++k) issue(k);
      if (i > 0 && u.backward[i] && frees_after_forward && !u.kept[i] && u.part[i] > 0) {
        add(gathered, r.gathered_peak, u.part[i]);
        has_part[i] = true;
      }
      if (i > 0 && (!u.backward[i] || (frees_after_forward && !u.kept[i]))) free(i);
    }
    make_full(0);  // the root's backward hook runs first; it stays gathered
    for (std::size_t i = n - 1; i >= 1; --i) {
      if (!u.backward[i]) continue;
      ensure(i);
      for (std::size_t k = i - 1; k + prefetch >= i; --k) {  // down to i - prefetch, the root at most
        if (u.backward[k]) issue(k);
        if (k == 0) break;
      }
      make_full(i);
      if (reshard) free(i);
      post_backward(i, sync);
    }
    post_backward(0, sync);
    finish();
    if (reshard)  // the end of backward frees every unit, the root too
      for (std::size_t i = 0; i < n; ++i) free(i);
  }
  return r;
}
}  // namespace detail

}  // namespace shardlib::plan
