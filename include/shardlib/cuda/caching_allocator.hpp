// shardlib/cuda/caching_allocator.hpp — caching_allocator: stream-ordered device
// memory that reuses freed blocks instead of calling cudaMalloc every step, and
// device_buffer<T>, the owning buffer that allocates from it.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"          // cat
#include "shardlib/core/ledger.hpp"         // ledger, category, current_ledger
#include "shardlib/cuda/error.hpp"          // check, cuda_error
#include "shardlib/cuda/stream.hpp"         // device_guard

#include <cuda_runtime.h>

#include <algorithm>      // std::find
#include <cstddef>        // std::size_t
#include <map>            // std::multimap
#include <memory>         // std::unique_ptr
#include <mutex>          // std::mutex
#include <span>           // std::span
#include <type_traits>    // std::is_trivially_copyable_v
#include <unordered_map>  // std::unordered_map
#include <utility>        // std::exchange, std::pair
#include <vector>         // std::vector

namespace shardlib {
struct cuda_space;  // cuda/memory_space.hpp, which allocates from here
}  // namespace shardlib

namespace shardlib::cuda {

struct allocator_stats {
  std::size_t cuda_mallocs = 0;  // blocks obtained from cudaMalloc, ever
  std::size_t cuda_frees = 0;    // blocks returned with cudaFree, ever
  std::size_t reuses = 0;        // allocations served from the cache
  std::size_t reserved = 0;      // bytes held from cudaMalloc now (in use + cached)
  std::size_t in_use = 0;        // bytes of blocks handed out now (rounded sizes)
};

// A per-device cache of cudaMalloc'd blocks, after PyTorch's CUDA caching
// allocator (https://pytorch.org/docs/stable/notes/cuda.html#memory-management).
//
// An allocation belongs to the stream it was made on; record_stream adds the
// other streams that use it. Freeing records an event on each of those streams
// and returns the block to the cache; no host synchronisation. A cached block
// serves a new allocation on stream s once every event recorded on a stream
// other than s has completed — work on s itself is ordered after the old work
// by the stream, so the same stream reuses a block at once, as PyTorch does.
//
// Sizes are rounded (512 bytes below 1 MiB, 2 MiB above) so that a step's
// repeated requests meet blocks of the same class; a request takes a cached
// block of at most 1.25 times its rounded size. When cudaMalloc runs out of
// memory, cached blocks are freed (after their events) and it is tried again.
//
// Every allocation is recorded in the ledger of the calling thread's rank,
// under the category the caller names (the requested bytes, as host Buffers
// record theirs), and released to that ledger when freed. Thread-safe.
class caching_allocator {
 public:
  explicit caching_allocator(int device) : device_(device) {}
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;
  ~caching_allocator() {
    std::lock_guard lock(m_);
    release_cached();
    for (cudaEvent_t e : event_pool_) (void)cudaEventDestroy(e);
  }

  int device() const { return device_; }

  // `bytes` of device memory usable by work on `stream` (nullptr for 0 bytes),
  // recorded in the calling rank's ledger under `kind`.
  void* allocate(std::size_t bytes, cudaStream_t stream, category kind) { return allocate(bytes, stream, &kind); }
  // The same, not recorded: for callers that record it themselves (Buffer<T, cuda_space>).
  void* allocate_unrecorded(std::size_t bytes, cudaStream_t stream) { return allocate(bytes, stream, nullptr); }

  // p, allocated here, is also used by work on `other`: freeing it waits for that work too.
  void record_stream(void* p, cudaStream_t other) {
    std::lock_guard lock(m_);
    block& b = live(p);
    if (other != b.stream && std::find(b.users.begin(), b.users.end(), other) == b.users.end())
      b.users.push_back(other);
  }

  // Returns p to the cache. The memory is reused only as described above, so
  // kernels still reading p keep valid memory until they finish.
  void deallocate(void* p) noexcept {
    if (!p) return;
    std::lock_guard lock(m_);
    auto it = live_.find(p);
    if (it == live_.end()) return;  // not ours: a bug in the caller, but not one to crash in a destructor for
    block b = std::move(it->second);
    live_.erase(it);
    if (b.owner) b.owner->release(b.kind, b.requested);
    stats_.in_use -= b.size;
    b.users.push_back(b.stream);
    for (cudaStream_t s : b.users) {
      cudaEvent_t e = nullptr;
      if (!pooled_event(e) || cudaEventRecord(e, s) != cudaSuccess) {
        // Cannot order the reuse (the context is going away, or it failed):
        // give the block back to the driver, whose cudaFree waits for the device.
        (void)cudaGetLastError();
        if (e) event_pool_.push_back(e);
        for (auto& [st, ev] : b.pending) event_pool_.push_back(ev);
        free_block(b);
        return;
      }
      b.pending.emplace_back(s, e);
    }
    b.users.clear();
    free_.emplace(b.size, std::move(b));
  }

  // Frees every cached block back to the driver (waiting for their events).
  void empty_cache() {
    std::lock_guard lock(m_);
    release_cached();
  }

  allocator_stats stats() const {
    std::lock_guard lock(m_);
    return stats_;
  }

 private:
  void* allocate(std::size_t bytes, cudaStream_t stream, const category* kind) {
    if (bytes == 0) return nullptr;
    const std::size_t size = round_size(bytes);
    std::lock_guard lock(m_);
    block b = take_cached(size, stream);
    if (!b.ptr) b = fresh(size, bytes);
    b.stream = stream;
    b.requested = bytes;
    if (kind) {
      b.kind = *kind;
      b.owner = &current_ledger();
      b.owner->allocate(b.kind, bytes);
    }
    stats_.in_use += b.size;
    void* p = b.ptr;
    live_.emplace(p, std::move(b));
    return p;
  }

  struct block {
    void* ptr = nullptr;
    std::size_t size = 0;       // rounded, as obtained from cudaMalloc
    std::size_t requested = 0;  // what the ledger was told
    cudaStream_t stream = nullptr;       // the allocation's stream
    std::vector<cudaStream_t> users;     // other streams that use it (record_stream)
    std::vector<std::pair<cudaStream_t, cudaEvent_t>> pending;  // once freed: an event per user stream
    category kind = category::comm_scratch;
    ledger* owner = nullptr;  // null: not recorded here
  };

  static constexpr std::size_t small_limit = std::size_t{1} << 20;
  static std::size_t round_size(std::size_t bytes) {
    const std::size_t unit = bytes < small_limit ? 512 : (std::size_t{2} << 20);
    return (bytes + unit - 1) / unit * unit;
  }

  block& live(void* p) {
    auto it = live_.find(p);
    require(it != live_.end(), "caching_allocator on device ", device_, ": ", p, " was not allocated here");
    return it->second;
  }

  // Whether every event recorded on a stream other than s has completed.
  bool usable_on(const block& b, cudaStream_t s) const {
    for (const auto& [st, ev] : b.pending) {
      if (st == s) continue;
      const cudaError_t e = cudaEventQuery(ev);
      if (e == cudaErrorNotReady) return false;
      check(e, "cudaEventQuery (a cached block's last use)");
    }
    return true;
  }

  block take_cached(std::size_t size, cudaStream_t stream) {
    for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= size + size / 4; ++it) {
      if (!usable_on(it->second, stream)) continue;
      block b = std::move(it->second);
      free_.erase(it);
      for (auto& [st, ev] : b.pending) event_pool_.push_back(ev);
      b.pending.clear();
      ++stats_.reuses;
      return b;
    }
    return {};
  }

  block fresh(std::size_t size, std::size_t requested) {
    device_guard g(device_);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      release_cached();
      e = cudaMalloc(&p, size);
    }
    if (e == cudaErrorMemoryAllocation)
      detail::throw_cuda(e, "caching_allocator: cudaMalloc(", size, " bytes) for a request of ", requested,
                         " bytes, with ", stats_.in_use, " bytes in use and the cache emptied,");
    check(e, "caching_allocator: cudaMalloc(", size, " bytes)");
    ++stats_.cuda_mallocs;
    stats_.reserved += size;
    block b;
    b.ptr = p;
    b.size = size;
    return b;
  }

  void free_block(block& b) noexcept {
    device_guard_noexcept g(device_);
    (void)cudaFree(b.ptr);
    ++stats_.cuda_frees;
    stats_.reserved -= b.size;
  }

  void release_cached() noexcept {
    for (auto& [size, b] : free_) {
      for (auto& [st, ev] : b.pending) {
        (void)cudaEventSynchronize(ev);
        event_pool_.push_back(ev);
      }
      free_block(b);
    }
    free_.clear();
    (void)cudaGetLastError();
  }

  bool pooled_event(cudaEvent_t& e) noexcept {
    if (!event_pool_.empty()) {
      e = event_pool_.back();
      event_pool_.pop_back();
      return true;
    }
    return cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess;
  }

  // device_guard for paths that must not throw (destructor, deallocate).
  struct device_guard_noexcept {
    int previous = -1;
    explicit device_guard_noexcept(int d) noexcept {
      if (cudaGetDevice(&previous) == cudaSuccess && previous != d) (void)cudaSetDevice(d);
      (void)cudaGetLastError();
    }
    ~device_guard_noexcept() {
      if (previous >= 0) (void)cudaSetDevice(previous);
    }
  };

  int device_;
  mutable std::mutex m_;
  std::unordered_map<void*, block> live_;
  std::multimap<std::size_t, block> free_;  // by rounded size
  std::vector<cudaEvent_t> event_pool_;
  allocator_stats stats_;
};

// The process's allocator for `device` (one per device, made on first use).
inline caching_allocator& device_allocator(int device) {
  static std::mutex m;
  static std::unordered_map<int, std::unique_ptr<caching_allocator>> allocators;
  std::lock_guard lock(m);
  auto& a = allocators[device];
  if (!a) a = std::make_unique<caching_allocator>(device);
  return *a;
}

// The allocator that holds p (device memory from any device_allocator).
inline caching_allocator& device_allocator_of(const void* p) {
  cudaPointerAttributes a{};
  check(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes(", p, ")");
  return device_allocator(a.device);
}

// n elements of T in device memory from a caching_allocator, for work on one
// stream (record_stream names more). Uninitialised, like cudaMalloc. Freed
// (returned to the cache, stream-ordered) when it goes out of scope, which
// records events on its streams: they must still exist then.
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "device_buffer<T>: T must be trivially copyable (an element type)");

 public:
  using value_type = T;
  using space = cuda_space;

  device_buffer() = default;
  device_buffer(std::size_t n, category kind, cudaStream_t stream)
      : device_buffer(n, kind, stream, device_allocator(current_device())) {}
  device_buffer(std::size_t n, category kind, cudaStream_t stream, caching_allocator& a)
      : data_(static_cast<T*>(a.allocate(n * sizeof(T), stream, kind))), size_(n), alloc_(&a) {}
  device_buffer(device_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), alloc_(o.alloc_) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      alloc_ = o.alloc_;
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  void reset() noexcept {
    if (data_) alloc_->deallocate(data_);
    data_ = nullptr;
    size_ = 0;
  }
  // Work on `s` uses this buffer too; freeing waits for it.
  void record_stream(cudaStream_t s) {
    if (data_) alloc_->record_stream(data_, s);
  }

  T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }
  bool empty() const { return size_ == 0; }
  std::span<T> span() const { return {data_, size_}; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  caching_allocator* alloc_ = nullptr;
};

}  // namespace shardlib::cuda
