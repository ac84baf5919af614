// shardlib/shard/unit.hpp — unit<T, C, Space, Work>: one layer's parameters as a flat, sharded buffer.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/buffer.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/shard/sharded_tensor.hpp"

#include <cstddef>  // std::size_t
#include <memory>   // std::shared_ptr
#include <optional> // std::optional
#include <string>   // std::string
#include <vector>   // std::vector

namespace shardlib::shard {

// A unit owns the parameters of one layer that no nested unit claims: their
// flat layout (PyTorch names, aligned offsets), the local shard of master values
// and gradients (the whole flat buffer when the strategy replicates), and, while
// the layer runs, the gathered full values and the full gradients its backward
// writes. The layer's Param views point into the gathered buffers only between
// the unit's pre- and post- hooks.
//
// T is the master dtype (fp32, or fp64 on the host); C the dtype layers compute
// in: T itself, or a 16-bit type (then the gathered values and the layers'
// gradients are C, and `compute_shard` holds this rank's shard rounded to C,
// which is what the all-gather sends). Space is where every buffer lives, Work
// what the communicator's asynchronous collectives return.
template <class T, class C = T, class Space = host_space, class Work = comm::work>
struct unit {
  std::string name;     // the layer's dotted name; "" for the root
  std::vector<nn::Param<C>*> params;  // in layout order
  nn::flat_layout layout;             // entries carry global names, so init matches unsharded init

  std::optional<ShardedTensor<T, Space>> master;  // values: this rank's shard, or everything when replicated
  std::optional<ShardedTensor<T, Space>> grad;    // reduced gradients: the shard the optimizer steps (all under NoShard)
  bool grad_clean = true;  // the gradient shard is all zero (reduce-scatter may write into it)
  Buffer<C, Space> compute_shard;  // 16-bit compute: the master shard rounded to C

  Buffer<C, Space> gathered;   // full values while gathered (sharded strategies)
  Buffer<C, Space> full_grad;  // full local gradients: from pre-backward until reduced (always, under ShardOptimizer)
  // Where the values are: only the shard, an all-gather in flight into `gathered`,
  // or gathered. (A unit may own no parameters, so `gathered` being empty says nothing.)
  enum class state { sharded, gathering, gathered } values = state::sharded;
  Work gather_work;
  Work reduce_work;
  bool reducing = false;   // reduce_work is in flight out of `full_grad` (or `grad` when replicated)
  Buffer<T, Space> reduce_scratch;  // reduce-scatter target when the shard already holds gradients, or in 16 bits
  Buffer<T, Space> send_scratch;    // the shard narrowed to the param dtype while its all-gather is in flight
  Buffer<T, Space> wide_grad;       // 16-bit compute, fp32 reduction: full_grad widened while it is reduced
  Buffer<C, Space> narrow_scratch;  // 16-bit compute and reduction: the reduce-scatter's target

  std::shared_ptr<void> optimizer_state;  // the optimizer's state for this unit's shard
  const void* optimizer_type = nullptr;   // identifies the optimizer type the state was made for

  std::size_t numel() const { return layout.numel; }

  // Points every Param at values (and grads, or null) laid out as `layout`.
  void bind(C* values, C* grads) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      params[i]->value = values ? values + layout.entries[i].offset : nullptr;
      params[i]->grad = grads ? grads + layout.entries[i].offset : nullptr;
    }
  }
  void unbind() { bind(nullptr, nullptr); }
};

}  // namespace shardlib::shard
