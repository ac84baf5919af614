// shardlib/shard/sharded_tensor.hpp — shard_layout (padding and ranges) and ShardedTensor<T, Space>.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/core/buffer.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/memory_space.hpp"
#include "shardlib/shard/space_ops.hpp"

#include <algorithm>  // std::min, std::max, std::copy_n, std::fill_n
#include <cstddef>    // std::size_t
#include <span>       // std::span

namespace shardlib::shard {

// A logical 1-D tensor of `numel` elements padded to a multiple of `world` and
// split into `world` equal shards; rank r holds global elements
// [r * shard_size, (r + 1) * shard_size). Equal shards let all_gather and
// reduce_scatter run on the flat buffer directly (as FSDP's FlatParameter does);
// padding sits at the end of the last shards and is always zero.
struct shard_layout {
  std::size_t numel = 0;
  int world = 1;

  SHARDLIB_HD constexpr std::size_t shard_size() const { return (numel + world - 1) / world; }
  SHARDLIB_HD constexpr std::size_t padded_size() const { return shard_size() * world; }
  SHARDLIB_HD constexpr std::size_t padding() const { return padded_size() - numel; }

  // Global range [begin, end) of rank r's shard, padding included.
  SHARDLIB_HD constexpr std::size_t begin(int r) const { return shard_size() * r; }
  SHARDLIB_HD constexpr std::size_t end(int r) const { return shard_size() * (r + 1); }
  // How many of rank r's elements are real (not padding).
  SHARDLIB_HD constexpr std::size_t valid(int r) const {
    return numel > begin(r) ? (numel - begin(r) < shard_size() ? numel - begin(r) : shard_size()) : 0;
  }

  struct location {
    int rank;
    std::size_t local;
  };
  SHARDLIB_HD constexpr location locate(std::size_t global) const {
    return {int(global / shard_size()), global % shard_size()};
  }
  SHARDLIB_HD constexpr std::size_t global(int r, std::size_t local) const { return begin(r) + local; }
};

// The local shard of a shard_layout, owned in memory space Space and recorded in
// the ledger under `kind` (parameters, gradients, optimizer_state, ...).
template <Element T, MemorySpace Space = host_space>
class ShardedTensor {
 public:
  ShardedTensor(std::size_t numel, int world, int rank, category kind)
      : layout_{numel, world}, rank_(rank), local_(layout_.shard_size(), kind) {
    require<shape_error>(world >= 1 && rank >= 0 && rank < world, "ShardedTensor: rank ", rank,
                         " is not in a world of ", world);
    space_ops<Space>::fill(local_.span(), T{});
  }
  template <comm::Communicator C>
  ShardedTensor(std::size_t numel, C& comm, category kind) : ShardedTensor(numel, comm.size(), comm.rank(), kind) {}

  const shard_layout& layout() const { return layout_; }
  int rank() const { return rank_; }
  std::size_t numel() const { return layout_.numel; }

  std::span<T> local() { return local_.span(); }
  std::span<const T> local() const { return local_.span(); }
  // The real (non-padding) part of the local shard.
  std::span<T> local_valid() { return local().first(layout_.valid(rank_)); }

  // full (padded_size elements, on every rank) <- the shards of all ranks.
  template <comm::Communicator C>
  void gather(C& comm, std::span<T> full) const {
    check_full(comm, full.size(), "gather");
    comm.all_gather(local(), full);
  }
  template <comm::Communicator C>
  auto gather_async(C& comm, std::span<T> full) const {
    check_full(comm, full.size(), "gather_async");
    return comm.all_gather_async(local(), full);
  }

  // Takes this rank's slice of a full tensor every rank holds (numel or padded_size
  // elements); padding stays zero.
  void assign_local(std::span<const T> full)
    requires can_access<host_space, Space>
  {
    require<shape_error>(full.size() == layout_.numel || full.size() == layout_.padded_size(), "rank ", rank_,
                         ": ShardedTensor::assign_local needs ", layout_.numel, " (or padded ", layout_.padded_size(),
                         ") elements, got ", full.size());
    const std::size_t n = layout_.valid(rank_);  // 0 where the shard is padding alone: begin may lie past the end
    if (n) std::copy_n(full.data() + layout_.begin(rank_), n, local_.data());
    std::fill_n(local_.data() + n, local_.size() - n, T{});
  }

  // Every rank's shard <- its slice of `full`, which only `root` holds (others may
  // pass an empty span). Rank by rank, root broadcasts one shard; the others keep
  // theirs, so no rank but root ever holds more than one shard of scratch.
  template <comm::Communicator C>
  void scatter(C& comm, std::span<const T> full, int root)
    requires can_access<host_space, Space>
  {
    if (comm.rank() == root)
      require<shape_error>(full.size() == layout_.numel, "rank ", rank_, ": ShardedTensor::scatter needs ",
                           layout_.numel, " elements on root ", root, ", got ", full.size());
    Buffer<T, Space> piece(layout_.shard_size(), category::comm_scratch);
    for (int r = 0; r < layout_.world; ++r) {
      std::fill_n(piece.data(), piece.size(), T{});
      if (comm.rank() == root && layout_.valid(r)) std::copy_n(full.data() + layout_.begin(r), layout_.valid(r), piece.data());
      comm.broadcast(piece.span(), root);
      if (r == rank_) std::copy_n(piece.data(), piece.size(), local_.data());
    }
  }

 private:
  template <comm::Communicator C>
  void check_full(C& comm, std::size_t got, const char* what) const {
    require<shape_error>(comm.size() == layout_.world && comm.rank() == rank_, "rank ", comm.rank(), ": ", what,
                         " on a communicator of size ", comm.size(), " for a tensor sharded over ", layout_.world);
    require<shape_error>(got == layout_.padded_size(), "rank ", rank_, ": ", what, " needs a full buffer of ",
                         layout_.padded_size(), " elements (", layout_.numel, " padded to a multiple of ",
                         layout_.world, "), got ", got);
  }

  shard_layout layout_;
  int rank_;
  Buffer<T, Space> local_;
};

}  // namespace shardlib::shard
