// shardlib/io/staging.hpp — how io/ reaches values kept in any memory space: copies
// between that memory and host memory in bounded chunks through one staging buffer in
// the space's offload space (pinned memory beside cuda_space), and io's own small
// collectives (failure flags, sizes, checksums, strings) through the space's value
// collectives, since a device communicator reads only device memory.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"  // reduce_op
#include "shardlib/core/buffer.hpp"        // Buffer
#include "shardlib/core/error.hpp"         // require, shape_error
#include "shardlib/core/ledger.hpp"        // category, ledger_scope, current_ledger
#include "shardlib/core/memory_space.hpp"  // MemorySpace, can_access, host_space, offload_space_t
#include "shardlib/shard/space_ops.hpp"    // space_ops

#include <algorithm>    // std::copy_n, std::min, std::fill
#include <concepts>     // std::integral
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <type_traits>  // std::is_same_v, std::remove_reference_t, std::type_identity
#include <vector>       // std::vector

namespace shardlib::io {

// A memory space io can stage: space_ops<Space> copies to and from host memory
// (complete on return), and its offload space, where the staging buffer lives, is
// host memory. Every engine space is one (shard::OffloadSpace).
template <class Space>
concept StagingSpace = MemorySpace<Space> && can_access<host_space, offload_space_t<Space>> &&
                       requires(std::span<const float> in, std::span<float> out) {
                         shard::space_ops<Space>::to_host(in, out);
                         shard::space_ops<Space>::from_host(in, out);
                       };

// 16 MiB: large enough that a device copy runs at full bandwidth, small enough to pin
// once per save or load.
inline constexpr std::size_t default_staging_bytes = std::size_t(16) << 20;

// Copies between memory of Space and host memory at most chunk_bytes at a time, each
// chunk through one staging buffer in offload_space_t<Space> (allocated at the first
// copy, no larger than the chunk, grown by doubling, and recorded in the rank's
// offload ledger). Each copy is complete when the call returns.
template <StagingSpace Space>
class stager {
 public:
  using staging_space = offload_space_t<Space>;

  explicit stager(std::size_t chunk_bytes = default_staging_bytes) : chunk_(chunk_bytes) {
    require(chunk_bytes > 0, "io staging (", Space::name, "): the chunk size must be at least one byte");
  }

  // host = src (src in Space).
  template <class T>
  void download(std::span<const T> src, std::span<T> host) {
    check_sizes("download", src.size(), host.size());
    const std::size_t step = chunk_elements<T>();
    for (std::size_t done = 0; done < src.size(); done += step) {
      const std::size_t n = std::min(step, src.size() - done);
      const std::span<T> part = staging<T>(n);
      shard::space_ops<Space>::to_host(src.subspan(done, n), part);
      std::copy_n(part.data(), n, host.data() + done);
    }
  }
  // dst = host (dst in Space).
  template <class T>
  void upload(std::span<const T> host, std::span<T> dst) {
    check_sizes("upload", host.size(), dst.size());
    const std::size_t step = chunk_elements<T>();
    for (std::size_t done = 0; done < host.size(); done += step) {
      const std::size_t n = std::min(step, host.size() - done);
      const std::span<T> part = staging<T>(n);
      std::copy_n(host.data() + done, n, part.data());
      shard::space_ops<Space>::from_host(std::span<const T>(part), dst.subspan(done, n));
    }
  }

  std::size_t chunk_bytes() const { return chunk_; }
  // The staging buffer's size now (0 before the first copy).
  std::size_t staging_bytes() const { return buffer_.bytes(); }

 private:
  template <class T>
  std::size_t chunk_elements() const {
    require(chunk_ >= sizeof(T), "io staging (", Space::name, "): chunks of ", chunk_,
            " bytes cannot hold one element of ", sizeof(T), " bytes");
    return chunk_ / sizeof(T);
  }
  void check_sizes(const char* op, std::size_t from, std::size_t to) const {
    require<shape_error>(from == to, "io staging (", Space::name, ") ", op, ": the source has ", from,
                         " elements, the destination ", to);
  }
  // The staging buffer as n elements of T (n at most a chunk), grown if it is smaller:
  // at least doubled, so that a run of ever larger copies pins memory only a few times.
  template <class T>
  std::span<T> staging(std::size_t n) {
    static_assert(alignof(T) <= staging_space::alignment);
    if (buffer_.bytes() < n * sizeof(T)) {
      const std::size_t bytes = std::min(chunk_elements<T>() * sizeof(T), std::max(n * sizeof(T), 2 * buffer_.bytes()));
      buffer_.reset();
      const ledger_scope in_offload(current_ledger().offload());
      buffer_ = Buffer<std::byte, staging_space>(bytes, category::comm_scratch);
    }
    return {reinterpret_cast<T*>(buffer_.data()), n};
  }

  std::size_t chunk_;
  Buffer<std::byte, staging_space> buffer_;
};

namespace detail {

// Values of memory space S to host memory and back, for io code that holds a stager of
// the model's space: in place when host code reaches S (host memory, pinned or offload
// memory), else through the stager, whose space S must then be.
template <class S, class Space, class T>
void copy_to_host(stager<Space>& staging, std::span<const T> src, std::span<T> host) {
  if constexpr (can_access<host_space, S>) {
    require<shape_error>(src.size() == host.size(), "io: copying ", src.size(), " values into ", host.size());
    std::copy_n(src.data(), src.size(), host.data());
  } else {
    static_assert(std::is_same_v<S, Space>, "io: values in a memory space the host cannot reach must be in the "
                                            "model's space, which the stager copies from");
    staging.download(src, host);
  }
}
template <class S, class Space, class T>
void copy_from_host(stager<Space>& staging, std::span<const T> host, std::span<T> dst) {
  if constexpr (can_access<host_space, S>) {
    require<shape_error>(host.size() == dst.size(), "io: copying ", host.size(), " values into ", dst.size());
    std::copy_n(host.data(), host.size(), dst.data());
  } else {
    static_assert(std::is_same_v<S, Space>, "io: values in a memory space the host cannot reach must be in the "
                                            "model's space, which the stager copies to");
    staging.upload(host, dst);
  }
}

// The collectives io runs over small host arrays of integers — whether every rank
// succeeded, file sizes and checksums, strings — on a communicator over memory of
// Space: through space_ops<Space>'s value collectives, which stage them into Space
// where the communicator needs it (NcclComm), and call it directly on the host.
// A broadcast is a sum to which only the root contributes (exact for integers).
template <class Space, class Comm>
class host_collectives {
 public:
  explicit host_collectives(Comm& comm) : comm_(&comm) {}
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }

  template <std::integral T>
  void all_reduce(std::span<T> values, comm::reduce_op op) {
    shard::space_ops<Space>::all_reduce_values(*comm_, values, op);
  }
  template <std::integral T>
  void all_gather(std::span<const T> mine, std::span<T> all) {
    shard::space_ops<Space>::all_gather_values(*comm_, mine, all);
  }
  template <std::integral T>
  void broadcast(std::span<T> values, int root) {
    if (rank() != root) std::fill(values.begin(), values.end(), T(0));
    all_reduce(values, comm::reduce_op::sum);
  }

 private:
  Comm* comm_;
};

// Calls f(piece, std::type_identity<S>{}) with this rank's master piece of unit i and the
// memory space S it lives in: the model's space, or its offload space (host memory) where
// the engine keeps it there (shard::ShardedModel::with_master_piece).
template <class Engine, class F>
decltype(auto) with_master(Engine& model, std::size_t i, F&& f) {
  if constexpr (requires { model.with_master_piece(i, f); }) return model.with_master_piece(i, f);
  else return f(model.master_piece(i), std::type_identity<typename Engine::space>{});
}

// io's collectives over a sharded model's communicator.
template <class Engine>
auto host_collectives_of(Engine& model) {
  return host_collectives<typename Engine::space, std::remove_reference_t<decltype(model.comm())>>(model.comm());
}

}  // namespace detail

}  // namespace shardlib::io
