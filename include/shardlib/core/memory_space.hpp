// shardlib/core/memory_space.hpp — memory spaces as tag types, and which space can reach which.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <concepts>     // std::same_as
#include <cstddef>      // std::size_t
#include <cstdlib>      // std::aligned_alloc, std::free
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

struct host_space {
  static constexpr std::string_view name = "host";
  // 64 bytes: one cache line, and the width of an AVX-512 register.
  static constexpr std::size_t alignment = 64;

  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;  // aligned_alloc needs a multiple
    void* p = std::aligned_alloc(alignment, rounded);
    if (!p) throw std::bad_alloc();
    return p;
  }
  static void deallocate(void* p, std::size_t) noexcept { std::free(p); }
};

// can_access<Accessor, Space>: code running where memory space Accessor lives can
// dereference pointers into Space (after Kokkos' SpaceAccessibility). Backends
// specialise it for their pairs; anything not specialised is unreachable.
template <class Accessor, class Space>
inline constexpr bool can_access = false;
template <>
inline constexpr bool can_access<host_space, host_space> = true;

}  // namespace shardlib
