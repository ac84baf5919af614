// shardlib/core/memory_space.hpp — memory spaces as tag types, and which space can reach which.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <concepts>     // std::same_as
#include <cstddef>      // std::size_t, std::ptrdiff_t
#include <cstdlib>      // std::aligned_alloc, std::free
#include <limits>       // std::numeric_limits
#include <map>          // std::multimap
#include <mutex>        // std::mutex
#include <new>          // std::bad_alloc
#include <string_view>  // std::string_view

namespace shardlib {

// A memory space allocates and frees raw bytes and has a name for messages.
// `host_space` is ordinary pageable memory; the CUDA backend adds `cuda_space`
// (device memory) and `pinned_space` (page-locked host memory) in its own headers.
template <class S>
concept MemorySpace = requires(std::size_t bytes, void* p) {
  { S::name } -> std::convertible_to<std::string_view>;
  { S::alignment } -> std::convertible_to<std::size_t>;
  { S::allocate(bytes) } -> std::same_as<void*>;
  { S::deallocate(p, bytes) } noexcept;
};

namespace detail {
// No allocation is larger (std::allocator's max_size in bytes): rounding a larger request up
// to an alignment or a segment would wrap and hand out a block smaller than asked for.
inline constexpr std::size_t largest_allocation = std::size_t(std::numeric_limits<std::ptrdiff_t>::max());

// The bytes of n elements of element_size bytes for a buffer in memory space `space`;
// more than largest_allocation (a negative count converted to size_t, say) raises
// rather than wraps.
inline std::size_t bytes_of(std::size_t n, std::size_t element_size, std::string_view space) {
  if (n > largest_allocation / element_size)
    throw error(cat("a ", space, " buffer of ", n, " elements of ", element_size, " bytes is more than any memory ",
                    "holds (", largest_allocation, " bytes at most; a negative count converted to an unsigned size?)"));
  return n * element_size;
}

// Freed host blocks of at least `min_bytes`, kept for reuse by size. A sharded
// step frees and reallocates the same unit-sized buffers (gathered parameters,
// full gradients) every step; glibc hands such large blocks back to the kernel,
// and faulting them in again cost FullShard ~20% of its step on the reference
// model (docs/benchmarks.md). Like PyTorch's caching allocators, the cache sits
// below the ledger: the ledger counts bytes in use, the cache only keeps pages.
class host_block_cache {
 public:
  static constexpr std::size_t min_bytes = std::size_t(1) << 20;

  // Never destroyed: buffers in static storage may be freed after it would be.
  static host_block_cache& instance() {
    static host_block_cache* cache = new host_block_cache;
    return *cache;
  }
  void* take(std::size_t bytes) {
    std::lock_guard lock(m_);
    auto it = free_.find(bytes);
    if (it == free_.end()) return nullptr;
    void* p = it->second;
    free_.erase(it);
    cached_ -= bytes;
    return p;
  }
  void give(void* p, std::size_t bytes) {
    std::lock_guard lock(m_);
    free_.emplace(bytes, p);
    cached_ += bytes;
  }
  // Returns every cached block to the system.
  void release() {
    std::lock_guard lock(m_);
    for (auto& [bytes, p] : free_) std::free(p);
    free_.clear();
    cached_ = 0;
  }
  std::size_t cached_bytes() {
    std::lock_guard lock(m_);
    return cached_;
  }
 private:
  std::mutex m_;
  std::multimap<std::size_t, void*> free_;
  std::size_t cached_ = 0;
};
}  // namespace detail

struct host_space {
  static constexpr std::string_view name = "host";
  // 64 bytes: one cache line, and the width of an AVX-512 register.
  static constexpr std::size_t alignment = 64;

  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    if (bytes > detail::largest_allocation) throw std::bad_alloc();  // rounding up would wrap
    std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;  // aligned_alloc needs a multiple
    if (rounded >= detail::host_block_cache::min_bytes)
      if (void* p = detail::host_block_cache::instance().take(rounded)) return p;
    void* p = std::aligned_alloc(alignment, rounded);
    if (!p) throw std::bad_alloc();
    return p;
  }
  static void deallocate(void* p, std::size_t bytes) noexcept {
    const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    if (p && rounded >= detail::host_block_cache::min_bytes) {
      try {
        detail::host_block_cache::instance().give(p, rounded);
        return;
      } catch (...) {  // no memory for the cache's own node: free the block instead
      }
    }
    std::free(p);
  }
  // Bytes held in freed blocks kept for reuse, and giving them back to the system.
  static std::size_t cached_bytes() { return detail::host_block_cache::instance().cached_bytes(); }
  static void release_cached() { detail::host_block_cache::instance().release(); }
};

// Host memory under a second tag: the offload space of host models. It has no
// use in a real host-only run (the masters are host memory already); it lets
// tests run shard::options::offload's whole path — copies both ways, the second
// ledger, their order — without a device, as pinned_space does beside cuda_space.
struct host_offload_space {
  static constexpr std::string_view name = "host-offload (test)";
  static constexpr std::size_t alignment = host_space::alignment;
  static void* allocate(std::size_t bytes) { return host_space::allocate(bytes); }
  static void deallocate(void* p, std::size_t bytes) noexcept { host_space::deallocate(p, bytes); }
};

// offload_space_t<Space>: where shard::options::offload keeps a model's fp32 masters,
// reduced gradients and optimizer state when the model lives in Space. It must be
// host memory (the optimizer steps there on the CPU). Backends specialise it
// (cuda_space: pinned_space, in shard/cuda/offload.cuh).
template <class Space>
struct offload_space_of {
  using type = host_space;
};
template <>
struct offload_space_of<host_space> {
  using type = host_offload_space;
};
template <class Space>
using offload_space_t = typename offload_space_of<Space>::type;

// can_access<Accessor, Space>: code running where memory space Accessor lives can
// dereference pointers into Space (after Kokkos' SpaceAccessibility). Backends
// specialise it for their pairs; anything not specialised is unreachable.
template <class Accessor, class Space>
inline constexpr bool can_access = false;
template <>
inline constexpr bool can_access<host_space, host_space> = true;
template <>
inline constexpr bool can_access<host_space, host_offload_space> = true;
template <>
inline constexpr bool can_access<host_offload_space, host_offload_space> = true;
template <>
inline constexpr bool can_access<host_offload_space, host_space> = true;

}  // namespace shardlib
