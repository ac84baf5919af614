// shardlib/cuda/caching_allocator.hpp — caching_allocator: stream-ordered device
// memory that reuses freed blocks instead of calling cudaMalloc every step, and
// device_buffer<T>, the owning buffer that allocates from it.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"          // cat, error, require
#include "shardlib/core/ledger.hpp"         // ledger, category, current_ledger
#include "shardlib/cuda/block_pool.hpp"     // block_pool, block_pool_stats
#include "shardlib/cuda/error.hpp"          // check, current_device, cuda_error
#include "shardlib/cuda/stream.hpp"         // stream, device_guard: what this header's users pair it with

#include <cuda_runtime.h>

#include <algorithm>      // std::find
#include <cstddef>        // std::size_t
#include <memory>         // std::unique_ptr
#include <mutex>          // std::mutex
#include <span>           // std::span
#include <type_traits>    // std::is_trivially_copyable_v
#include <unordered_map>  // std::unordered_map
#include <utility>        // std::exchange
#include <vector>         // std::vector

namespace shardlib {
struct cuda_space;  // cuda/memory_space.hpp, which allocates from here
}  // namespace shardlib

namespace shardlib::cuda {

struct allocator_stats {
  std::size_t cuda_mallocs = 0;  // segments obtained from cudaMalloc, ever
  std::size_t cuda_frees = 0;    // segments returned with cudaFree, ever
  std::size_t reuses = 0;        // allocations served from cached blocks, no cudaMalloc
  std::size_t reserved = 0;      // bytes held from cudaMalloc now (in use + cached)
  std::size_t in_use = 0;        // bytes of blocks handed out now (rounded sizes), freed ones still in use by other streams included
  std::size_t segments = 0;      // cudaMalloc'd segments held now
  std::size_t largest_free = 0;  // the largest cached block: how much one request gets without cudaMalloc
};

// Makes `device` current for the allocator's CUDA calls (cudaMalloc, cudaFree
// and events act on the current device) and gives the caller's back after:
// a caller working on device 1 may free memory of device 0. Never throws, so
// that frees and destructors can use it; error() says whether it worked.
class device_scope {
 public:
  explicit device_scope(int device) noexcept {
    int current = -1;
    error_ = cudaGetDevice(&current);
    if (error_ == cudaSuccess && current != device) {
      error_ = cudaSetDevice(device);
      if (error_ == cudaSuccess) previous_ = current;
    }
    if (error_ != cudaSuccess) (void)cudaGetLastError();
  }
  ~device_scope() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;
  cudaError_t error() const noexcept { return error_; }

 private:
  int previous_ = -1;  // the caller's device, when it had to be changed
  cudaError_t error_ = cudaSuccess;
};

// A per-device cache of device memory, after PyTorch's CUDA caching allocator
// (https://pytorch.org/docs/stable/notes/cuda.html#memory-management).
// block_pool (cuda/block_pool.hpp) keeps the books: cudaMalloc'd segments cut
// into blocks, best fit, splitting, merging, sizes and rounding; this class
// adds the CUDA calls, the streams' events and the ledger.
//
// An allocation belongs to the stream it was made on, and so does its memory
// for good: a freed block serves later requests on that stream only, at once
// (work on the stream is ordered after the old work). record_stream adds
// other streams that use it; freeing such a block records an event on each,
// and the block returns to its stream's cache once they have all completed
// (checked at the next allocation; no host synchronisation). Other streams
// get memory a stream no longer needs through empty_cache, which also runs
// when cudaMalloc fails: cached segments are given back (after their events)
// and the request is tried again.
//
// The allocator knows its blocks: freeing asks no driver query, and
// device_allocator_of finds the owner of a pointer among the devices'
// allocators. Every CUDA call runs under device_scope(device()).
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
    device_scope g(device_);
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
    auto it = live_.find(p);
    require(it != live_.end(), "caching_allocator on device ", device_, ": ", p, " was not allocated here");
    auto& users = it->second.users;
    if (other != pool_.stream_of(p) && std::find(users.begin(), users.end(), other) == users.end())
      users.push_back(other);
  }

  // Returns p to the cache. The memory is reused only as described above, so
  // kernels still reading p keep valid memory until they finish.
  void deallocate(void* p) noexcept {
    if (!p) return;
    std::lock_guard lock(m_);
    auto it = live_.find(p);
    if (it == live_.end()) return;  // not ours: a bug in the caller, but not one to crash in a destructor for
    const live_block b = std::move(it->second);
    live_.erase(it);
    if (b.owner) b.owner->release(b.kind, b.requested);
    if (b.users.empty()) {  // its own stream only: stream order protects the next user
      pool_.free(p);
      return;
    }
    device_scope g(device_);
    pending_free pf{p, {}};
    for (cudaStream_t s : b.users) {
      cudaEvent_t e = nullptr;
      if (g.error() != cudaSuccess || !pooled_event(e) || cudaEventRecord(e, s) != cudaSuccess) {
        // Cannot order the reuse (the context is going away, or it failed; or `s`
        // belongs to another device, where no event of this one can be recorded):
        // wait for every user stream and this device instead, then the block is free.
        (void)cudaGetLastError();
        if (e) event_pool_.push_back(e);
        event_pool_.insert(event_pool_.end(), pf.events.begin(), pf.events.end());
        for (cudaStream_t user : b.users) (void)cudaStreamSynchronize(user);
        (void)cudaDeviceSynchronize();
        (void)cudaGetLastError();
        pool_.free(p);
        return;
      }
      pf.events.push_back(e);
    }
    pending_.push_back(std::move(pf));
  }

  // Gives every cached segment back to the driver (after the events of
  // blocks other streams still used), so that other streams and processes
  // can have the memory.
  void empty_cache() {
    std::lock_guard lock(m_);
    device_scope g(device_);
    check(g.error(), "cudaSetDevice(", device_, ") for caching_allocator::empty_cache");
    release_cached();
  }

  // Whether p is an allocation of this allocator not yet freed.
  bool owns(const void* p) const {
    std::lock_guard lock(m_);
    return live_.contains(p);
  }

  allocator_stats stats() const {
    std::lock_guard lock(m_);
    const block_pool_stats s = pool_.stats();
    return {.cuda_mallocs = s.segments_obtained,
            .cuda_frees = s.segments_released,
            .reuses = s.reuses,
            .reserved = s.reserved,
            .in_use = s.allocated,
            .segments = s.segments,
            .largest_free = s.largest_free};
  }

 private:
  void* allocate(std::size_t bytes, cudaStream_t stream, const category* kind) {
    if (bytes == 0) return nullptr;
    std::lock_guard lock(m_);
    device_scope g(device_);
    check(g.error(), "cudaSetDevice(", device_, ") for caching_allocator");
    collect_pending(false);
    std::size_t tried = 0;  // the last segment cudaMalloc refused
    auto cuda_malloc = [&](std::size_t n) -> void* {
      void* p = nullptr;
      const cudaError_t e = cudaMalloc(&p, n);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        tried = n;
        return nullptr;
      }
      check(e, "caching_allocator: cudaMalloc(", n, " bytes)");
      return p;
    };
    void* p = pool_.allocate(bytes, stream, cuda_malloc);
    if (!p) {
      release_cached();
      p = pool_.allocate(bytes, stream, cuda_malloc);
    }
    if (!p)
      detail::throw_cuda(cudaErrorMemoryAllocation, "caching_allocator: cudaMalloc(", tried,
                         " bytes) for a request of ", bytes, " bytes, with ", pool_.stats().allocated,
                         " bytes in use and the cache emptied,");
    live_block& b = live_[p];
    b.requested = bytes;
    if (kind) {
      b.kind = *kind;
      b.owner = &current_ledger();
      b.owner->allocate(b.kind, bytes);
    }
    return p;
  }

  struct live_block {
    std::size_t requested = 0;        // what the ledger was told
    std::vector<cudaStream_t> users;  // streams other than its own that use it (record_stream)
    category kind = category::comm_scratch;
    ledger* owner = nullptr;  // null: not recorded here
  };
  // A freed block still used by other streams: free once every event has completed.
  struct pending_free {
    void* ptr;
    std::vector<cudaEvent_t> events;
  };

  // Returns to the pool the pending blocks whose streams are done with them;
  // with `wait`, all of them, after waiting for their events.
  void collect_pending(bool wait) {
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool done = true;
      for (cudaEvent_t e : it->events) {
        const cudaError_t r = wait ? cudaEventSynchronize(e) : cudaEventQuery(e);
        if (r == cudaErrorNotReady) {
          done = false;
          break;
        }
        if (!wait) check(r, "cudaEventQuery (a freed block's last use on another stream)");
      }
      if (!done) {
        ++it;
        continue;
      }
      event_pool_.insert(event_pool_.end(), it->events.begin(), it->events.end());
      pool_.free(it->ptr);
      it = pending_.erase(it);
    }
  }

  // Waits for the pending blocks and gives every free segment back.
  void release_cached() noexcept {
    collect_pending(true);
    pool_.release_free_segments([](void* p, std::size_t) { (void)cudaFree(p); });
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

  int device_;
  mutable std::mutex m_;
  block_pool<cudaStream_t> pool_;
  std::unordered_map<const void*, live_block> live_;  // handed out and not yet freed
  std::vector<pending_free> pending_;
  std::vector<cudaEvent_t> event_pool_;
};

namespace detail {
struct allocator_registry {
  std::mutex m;
  std::unordered_map<int, std::unique_ptr<caching_allocator>> by_device;
};
inline allocator_registry& allocators() {
  static allocator_registry r;
  return r;
}
}  // namespace detail

// The process's allocator for `device` (one per device, made on first use).
inline caching_allocator& device_allocator(int device) {
  auto& r = detail::allocators();
  std::lock_guard lock(r.m);
  auto& a = r.by_device[device];
  if (!a) a = std::make_unique<caching_allocator>(device);
  return *a;
}

// The allocator that holds p (device memory from any device_allocator): each
// knows its blocks, the current device's is asked first. No driver query.
inline caching_allocator& device_allocator_of(const void* p) {
  auto& r = detail::allocators();
  std::lock_guard lock(r.m);
  if (auto it = r.by_device.find(current_device()); it != r.by_device.end() && it->second->owns(p)) return *it->second;
  for (auto& [device, a] : r.by_device)
    if (a->owns(p)) return *a;
  throw error(cat("device_allocator_of: ", p, " was not allocated by any device's caching_allocator"));
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
      : data_(static_cast<T*>(a.allocate(shardlib::detail::bytes_of(n, sizeof(T), "cuda"), stream, kind))),
        size_(n),
        alloc_(&a) {}
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
