// shardlib/cuda/memory_space.hpp — cuda_space (device memory) and pinned_space
// (page-locked host memory): memory space tags, and which space reaches which.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/memory_space.hpp"  // MemorySpace, host_space, can_access
#include "shardlib/cuda/error.hpp"         // check

#include <cuda_runtime.h>

#include <cstddef>      // std::size_t
#include <string_view>  // std::string_view

namespace shardlib {

// Device memory of the calling thread's current device, for work on the
// thread's current stream (cuda/current.hpp): from the device's caching
// allocator (cuda/caching_allocator.hpp), so tensors made and dropped every
// step (activations, gathered units) do not call cudaMalloc, and freeing never
// blocks the host. Buffer and Tensor record the bytes in the ledger themselves.
// A buffer used on another stream must be recorded there
// (device_allocator(d).record_stream) before it is freed.
struct cuda_space {
  static constexpr std::string_view name = "cuda";
  static constexpr std::size_t alignment = 256;  // what cudaMalloc guarantees; the allocator's blocks keep it

  static void* allocate(std::size_t bytes);
  static void deallocate(void* p, std::size_t bytes) noexcept;
};

// Page-locked host memory: host code reads and writes it like any host memory,
// copies from and to the device run asynchronously (pageable memory would be
// staged, which blocks the host), and kernels reach it through unified addressing.
struct pinned_space {
  static constexpr std::string_view name = "pinned";
  static constexpr std::size_t alignment = 256;

  static void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    cuda::check(cudaMallocHost(&p, bytes), "cudaMallocHost(", bytes, " bytes)");
    return p;
  }
  static void deallocate(void* p, std::size_t) noexcept {
    if (p) (void)cudaFreeHost(p);
  }
};

static_assert(MemorySpace<cuda_space> && MemorySpace<pinned_space>);

// can_access<Accessor, Space>: code running where Accessor lives reaches Space.
// Host code (host_space, and pinned_space, which is host memory) reaches host
// and pinned memory; device code (cuda_space) reaches device memory and, by
// unified addressing, pinned memory. Host code never dereferences device memory.
template <>
inline constexpr bool can_access<cuda_space, cuda_space> = true;
template <>
inline constexpr bool can_access<cuda_space, pinned_space> = true;
template <>
inline constexpr bool can_access<host_space, pinned_space> = true;
template <>
inline constexpr bool can_access<pinned_space, pinned_space> = true;
template <>
inline constexpr bool can_access<pinned_space, host_space> = true;

}  // namespace shardlib

// cuda_space's functions need the allocator, which needs cuda_space's declaration.
#include "shardlib/cuda/caching_allocator.hpp"  // device_allocator
#include "shardlib/cuda/current.hpp"            // current_stream

inline void* shardlib::cuda_space::allocate(std::size_t bytes) {
  return cuda::device_allocator(cuda::current_device()).allocate_unrecorded(bytes, cuda::current_stream());
}
inline void shardlib::cuda_space::deallocate(void* p, std::size_t) noexcept {
  if (!p) return;
  try {
    cuda::device_allocator_of(p).deallocate(p);
  } catch (...) {  // the context is gone (process exit): nothing left to free into
  }
}
