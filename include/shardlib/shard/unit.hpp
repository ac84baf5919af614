// shardlib/shard/unit.hpp — unit: one layer's parameters as a flat buffer, sharded as the policy says.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/buffer.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/shard/discover.hpp"
#include "shardlib/shard/packing.hpp"
#include "shardlib/shard/sharded_tensor.hpp"

#include <cstddef>     // std::size_t
#include <functional>  // std::less
#include <optional>    // std::optional
#include <span>        // std::span
#include <string>      // std::string
#include <vector>      // std::vector

namespace shardlib::shard {

// A unit owns the parameters of one layer that no nested unit claims: their
// flat layout (global names, aligned offsets), the fp32 master and optimizer
// state (a shard, a ZeRO-1 slice, or everything), the reduced gradients the
// optimizer steps, and the full values and gradients the layer's Params point
// into while it runs.
//
// T is the master dtype (fp32, or fp64 on the host); C the dtype layers compute
// in: T, or a 16-bit type (then `compute_shard` holds the master rounded to C,
// which is what the all-gather sends; a frozen element without a master, its value).
// Space is where every buffer lives, Work what the communicator's asynchronous
// collectives return, State the optimizer's own per-shard state.
template <class T, class C, class Space, class Work, class State>
struct unit {
  std::string name;                   // the layer's dotted name; "" for the root
  std::vector<nn::Param<C>*> params;  // in layout order
  nn::flat_layout layout;
  std::vector<param_alias> aliases;  // further names of tied parameters (shard/discover.hpp)

  // fp32 master values this rank steps. Absent when they live inside `values`
  // (replicated parameters kept in the master dtype: NoShard, ZeRO-1 in fp32), or
  // in `offload` (16-bit compute with options.offload).
  std::optional<ShardedTensor<T, Space>> master;
  // options.frozen_masters = false, 16-bit compute, and this rank's piece has frozen elements
  // whose reduction leaves them out (`grad` holds its trained elements alone, or none): this
  // piece's runs (optim::cut_frozen's). `master` is then absent: trained_master (or the
  // offloaded master) holds the trained runs alone, end to end as the optimizer state, and
  // the frozen elements live only in compute_shard, in the compute dtype.
  std::vector<optim::segment> compact_runs;
  Buffer<T, Space> trained_master;
  // Reduced gradients this rank steps: its piece of the master's partition or, when a
  // reduce-scatter packs them (`packing`), its piece's trained elements alone, end to end as
  // the optimizer state (optim::require_run_grads); none in a unit of frozen parameters,
  // unless its layers' gradients are bound there (replicated fp32 layers).
  Buffer<T, Space> grad;
  Buffer<C, Space> compute_shard;               // 16-bit compute: the master rounded to C
  std::optional<State> optimizer_state;         // made on the first step (in `offload`'s space when offloaded)

  // options.offload: the optimizer's side of this rank's piece, in host memory of
  // offload_space_t<Space>. With fp32 layers, `master` (or `values`) stays as the
  // parameters' copy in Space, equal to offload->master after every step.
  using offload_space = offload_space_t<Space>;
  struct offloaded {
    Buffer<T, offload_space> master;        // the master the optimizer steps
    Buffer<T, offload_space> grad;          // the reduced gradients, copied from `grad` at the step
    Buffer<C, offload_space> compute_copy;  // 16-bit compute: the master rounded, copied to compute_shard
  };
  std::optional<offloaded> offload;

  // Full values layers read: while gathered (sharded parameters) or always
  // (replicated). Full local gradients layers write: from pre-backward until
  // reduced, or always (replicated).
  Buffer<C, Space> values;
  Buffer<C, Space> full_grad;
  // policy::reshard_to: this rank's 1/R of the full values, kept from its forward (which
  // freed them) until its backward's all-gather within the reshard group completes.
  Buffer<C, Space> resharded;
  enum class state { sharded, gathering, gathered } where = state::sharded;
  Work gather_work, reduce_work;
  bool reducing = false;   // reduce_work is in flight
  bool grad_clean = true;  // `grad` is all zero (a reduction may write straight into it)
  bool no_backward = false;  // its last forward ran inside the context's no_grad(f) (nn::frozen_prefix)
  bool keep_gathered = false;  // options.keep_gathered: not freed after its forward
  reduce_packing packing;    // frozen and trained parameters: what its reduction sends (shard/packing.hpp)

  // Communication scratch, alive only while a collective needs it.
  struct scratch_buffers {
    Buffer<T, Space> send;    // the master narrowed for a 16-bit all-gather (host, fp32 layers)
    Buffer<T, Space> reduce;  // reduce-scatter target when `grad` already holds gradients, or 16-bit
    Buffer<T, Space> wide;    // 16-bit compute, fp32 reduction: full gradients widened; packed: what is sent
    Buffer<C, Space> narrow;  // 16-bit compute and reduction: the reduce-scatter's target
    Buffer<C, Space> packed;  // 16-bit compute and reduction, packed: what is sent
  } scratch;

  // options.frozen_grads = false, in a wholly frozen or packed unit: each parameter's place
  // in the full local gradients, which hold the unit's trained elements alone, end to end
  // (alignment gaps and padding among them, as optim::cut_frozen counts them); `npos` for a
  // frozen one, whose grad is null in backward. Empty: the full local gradients are laid out
  // as the unit.
  static constexpr std::size_t npos = std::size_t(-1);
  std::vector<std::size_t> local_offsets;
  std::size_t local_size = 0;  // elements of the full local gradients with local_offsets
  bool local_trained_only() const { return !local_offsets.empty(); }

  std::size_t numel() const { return layout.numel; }
  bool compact() const { return !compact_runs.empty(); }
  // Every parameter it owns is frozen (requires_grad = false), and it owns some.
  bool frozen() const { return layout.all_frozen(); }

  // The first parameter whose requires_grad differs from the layout's (set after the
  // engine read it), or -1.
  int changed_flag() const {
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i]->requires_grad != layout.entries[i].requires_grad) return int(i);
    return -1;
  }

  // Points every Param at values laid out as `layout`, and at grads (or null) laid out
  // so too, or as local_offsets say.
  void bind(C* v, C* g) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      params[i]->value = v ? v + layout.entries[i].offset : nullptr;
      const std::size_t at = local_trained_only() ? local_offsets[i] : layout.entries[i].offset;
      params[i]->grad = g && at != npos ? g + at : nullptr;
    }
  }
  void unbind() { bind(nullptr, nullptr); }
  // Frees the full gradients. Params still bound to them (replicated parameters stay
  // bound from one forward to the next) lose their gradient rather than keep pointing
  // at freed memory.
  void release_full_grad() {
    const std::less<const C*> before;
    const C* begin = full_grad.data();
    for (auto* p : params)
      if (p->grad && !before(p->grad, begin) && before(p->grad, begin + full_grad.size())) p->grad = nullptr;
    full_grad.reset();
  }
};

}  // namespace shardlib::shard
