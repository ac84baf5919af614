// shardlib/cuda/block_pool.hpp — block_pool: the bookkeeping of the caching
// allocator (cuda/caching_allocator.hpp) without any CUDA call: segments
// obtained through a callback, cut into blocks, free blocks by stream and
// size, splitting and merging. Host code, tested on the host
// (tests/unit/test_block_pool.cpp).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"         // require
#include "shardlib/core/memory_space.hpp"  // detail::largest_allocation

#include <algorithm>      // std::max
#include <cstddef>        // std::size_t
#include <functional>     // std::less
#include <memory>         // std::unique_ptr
#include <set>            // std::set
#include <tuple>          // std::tie
#include <unordered_map>  // std::unordered_map

namespace shardlib::cuda {

struct block_pool_stats {
  std::size_t segments = 0;          // segments held now
  std::size_t reserved = 0;          // their bytes
  std::size_t allocated = 0;         // bytes of allocated blocks (rounded sizes)
  std::size_t allocated_blocks = 0;  // allocated blocks now
  std::size_t free_blocks = 0;       // free blocks now (reserved - allocated bytes in all)
  std::size_t largest_free = 0;      // the largest free block: what a request can get without a new segment
  std::size_t segments_obtained = 0;  // ever
  std::size_t segments_released = 0;  // ever
  std::size_t reuses = 0;             // allocations served by free blocks, no new segment
  std::size_t splits = 0;             // blocks cut in two, ever
  std::size_t merges = 0;             // free neighbours joined, ever
};

// After PyTorch's CUDA caching allocator
// (https://pytorch.org/docs/stable/notes/cuda.html#memory-management):
//
// - Requests round up to 512 bytes. Requests up to 1 MiB ("small") are cut
//   from 2 MiB segments, larger ones from 20 MiB segments up to 10 MiB and
//   from segments of their own size rounded to 2 MiB beyond. Small and large
//   requests never share a segment, so small, short-lived blocks cannot
//   pin down the large segments that gathered parameters come and go in.
// - A request takes the smallest free block of its kind and stream that holds
//   it (best fit), and splits it when the rest is worth keeping: at least
//   512 bytes in a small segment, more than 1 MiB in a large one (a smaller
//   rest of a large block could only serve small requests, which never look
//   there: it stays with the block instead).
// - A freed block merges with its free neighbours in the segment, so a
//   segment whose blocks are all free is one block again, which
//   release_free_segments can give back.
// - Every segment, and so every block, belongs to the stream it was obtained
//   for: streams never share a block. Work on one stream is ordered, so a
//   block freed there can serve the next request at once; the allocator
//   returns a block used by other streams only once their work is done.
//
// Stream is the stream handle (cudaStream_t on the device), ordered with
// std::less. Not thread-safe: the allocator holds its lock around every call.
template <class Stream>
class block_pool {
 public:
  static constexpr std::size_t granule = 512;                         // every size a multiple
  static constexpr std::size_t small_request = std::size_t{1} << 20;  // up to this: small
  static constexpr std::size_t small_segment = std::size_t{2} << 20;
  static constexpr std::size_t large_segment = std::size_t{20} << 20;
  static constexpr std::size_t own_segment_from = std::size_t{10} << 20;  // requests this large get their own
  static constexpr std::size_t large_round = std::size_t{2} << 20;

  static constexpr std::size_t round_size(std::size_t bytes) {
    return std::max<std::size_t>(granule, (bytes + granule - 1) / granule * granule);
  }
  static constexpr bool is_small(std::size_t rounded) { return rounded <= small_request; }
  // The segment a request of `rounded` bytes obtains when no free block holds it.
  static constexpr std::size_t segment_size(std::size_t rounded) {
    if (is_small(rounded)) return small_segment;
    if (rounded < own_segment_from) return large_segment;
    return (rounded + large_round - 1) / large_round * large_round;
  }

  block_pool() = default;
  block_pool(const block_pool&) = delete;
  block_pool& operator=(const block_pool&) = delete;

  // A block of at least `bytes` (> 0) for work on `stream`: a free block of
  // the stream (split if worth it), else a new segment of segment_size bytes
  // from obtain(bytes), which returns its start or nullptr when there is no
  // memory. Returns nullptr then.
  template <class Obtain>
  void* allocate(std::size_t bytes, Stream stream, Obtain&& obtain) {
    // Larger requests would wrap round_size or segment_size and get a 512-byte block.
    require(bytes <= shardlib::detail::largest_allocation, "block_pool: a request of ", bytes,
            " bytes is more than any memory holds");
    const std::size_t size = round_size(bytes);
    const bool small = is_small(size);
    auto& pool = free_of(small);
    block* b = nullptr;
    auto it = pool.lower_bound(key{stream, size, nullptr});
    if (it != pool.end() && !less(stream, (*it)->stream) && !less((*it)->stream, stream)) {
      b = *it;
      pool.erase(it);
      ++stats_.reuses;
    } else {
      const std::size_t seg = segment_size(size);
      char* p = static_cast<char*>(obtain(seg));
      if (!p) return nullptr;
      b = add_block(p, seg, stream, small);
      ++stats_.segments;
      ++stats_.segments_obtained;
      stats_.reserved += seg;
    }
    if (b->size - size >= (small ? granule : small_request + 1)) split(*b, size);
    b->allocated = true;
    stats_.allocated += b->size;
    ++stats_.allocated_blocks;
    return b->ptr;
  }

  // Returns block p (from allocate, not yet freed) to its stream's free
  // blocks, merged with the free neighbours in its segment.
  void free(void* p) {
    block& b = allocated_block(p);
    b.allocated = false;
    stats_.allocated -= b.size;
    --stats_.allocated_blocks;
    block* m = &b;
    if (m->prev && !m->prev->allocated) m = merge(*m->prev, *m);
    if (m->next && !m->next->allocated) m = merge(*m, *m->next);
    free_of(m->small).insert(m);
  }

  // The size (rounded) and stream of allocated block p.
  std::size_t size_of(const void* p) const { return allocated_block(p).size; }
  Stream stream_of(const void* p) const { return allocated_block(p).stream; }
  // Whether p is the start of an allocated block.
  bool owns(const void* p) const {
    auto it = blocks_.find(p);
    return it != blocks_.end() && it->second->allocated;
  }

  // Gives every segment that is one free block back through release(ptr,
  // bytes); returns how many bytes that was.
  template <class Release>
  std::size_t release_free_segments(Release&& release) {
    std::size_t bytes = 0;
    for (auto* pool : {&small_free_, &large_free_})
      for (auto it = pool->begin(); it != pool->end();) {
        block* b = *it;
        if (b->prev || b->next) {
          ++it;
          continue;
        }
        it = pool->erase(it);
        release(static_cast<void*>(b->ptr), b->size);
        bytes += b->size;
        stats_.reserved -= b->size;
        --stats_.segments;
        ++stats_.segments_released;
        blocks_.erase(b->ptr);
      }
    return bytes;
  }

  block_pool_stats stats() const {
    block_pool_stats s = stats_;
    s.free_blocks = small_free_.size() + large_free_.size();
    s.largest_free = 0;
    for (const auto* pool : {&small_free_, &large_free_})
      for (const block* b : *pool) s.largest_free = std::max(s.largest_free, b->size);
    return s;
  }

 private:
  // A piece of a segment; prev and next are its neighbours in the segment
  // (null at the segment's ends), so a segment is the chain from a block
  // without prev to one without next.
  struct block {
    char* ptr = nullptr;
    std::size_t size = 0;
    Stream stream{};
    bool small = false;
    bool allocated = false;
    block* prev = nullptr;
    block* next = nullptr;
  };
  struct key {
    Stream stream;
    std::size_t size;
    const char* ptr;
  };
  static bool less(const Stream& a, const Stream& b) { return std::less<Stream>{}(a, b); }
  // Free blocks by stream, then size, then address: lower_bound finds the
  // best fit of a stream, the lowest address among equal sizes.
  struct by_stream_size {
    using is_transparent = void;
    static bool before(const Stream& sa, std::size_t za, const char* pa, const Stream& sb, std::size_t zb,
                       const char* pb) {
      if (less(sa, sb)) return true;
      if (less(sb, sa)) return false;
      return za != zb ? za < zb : std::less<const char*>{}(pa, pb);
    }
    bool operator()(const block* a, const block* b) const {
      return before(a->stream, a->size, a->ptr, b->stream, b->size, b->ptr);
    }
    bool operator()(const key& a, const block* b) const { return before(a.stream, a.size, a.ptr, b->stream, b->size, b->ptr); }
    bool operator()(const block* a, const key& b) const { return before(a->stream, a->size, a->ptr, b.stream, b.size, b.ptr); }
  };
  using free_set = std::set<block*, by_stream_size>;

  free_set& free_of(bool small) { return small ? small_free_ : large_free_; }

  block* add_block(char* p, std::size_t size, Stream stream, bool small) {
    auto owned = std::make_unique<block>();
    block* b = owned.get();
    b->ptr = p;
    b->size = size;
    b->stream = stream;
    b->small = small;
    blocks_.emplace(p, std::move(owned));
    return b;
  }

  block& allocated_block(const void* p) const {
    auto it = blocks_.find(p);
    require(it != blocks_.end() && it->second->allocated, "block_pool: ", p, " is not an allocated block");
    return *it->second;
  }

  // Cuts b to `size` bytes; the rest becomes a free block right after it.
  void split(block& b, std::size_t size) {
    block* rest = add_block(b.ptr + size, b.size - size, b.stream, b.small);
    rest->prev = &b;
    rest->next = b.next;
    if (b.next) b.next->prev = rest;
    b.next = rest;
    b.size = size;
    free_of(b.small).insert(rest);
    ++stats_.splits;
  }

  // Joins neighbours a and b (a just before b, neither allocated) into a,
  // taking them out of the free set first (the one being freed is not in it).
  block* merge(block& a, block& b) {
    free_of(a.small).erase(&a);
    free_of(b.small).erase(&b);
    a.size += b.size;
    a.next = b.next;
    if (b.next) b.next->prev = &a;
    blocks_.erase(b.ptr);
    ++stats_.merges;
    return &a;
  }

  std::unordered_map<const void*, std::unique_ptr<block>> blocks_;  // every block, by start
  free_set small_free_, large_free_;
  block_pool_stats stats_;
};

}  // namespace shardlib::cuda
