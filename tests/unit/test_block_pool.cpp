// block_pool, the caching allocator's bookkeeping, on the host: segments come
// from malloc (never touched: only addresses matter), streams are integers.
#include "shardlib/cuda/block_pool.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <random>
#include <vector>

namespace test_block_pool {

namespace sl = shardlib;

namespace {
using pool_t = sl::cuda::block_pool<int>;
constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

// Segments from malloc, with a log of what was obtained and given back.
struct source {
  std::map<char*, std::size_t> live;  // segment start -> bytes
  std::size_t obtained = 0, released = 0;
  bool fail = false;  // the next obtain reports no memory
  void* obtain(std::size_t bytes) {
    if (fail) return nullptr;
    char* p = static_cast<char*>(std::malloc(bytes));
    REQUIRE(p != nullptr);
    live.emplace(p, bytes);
    ++obtained;
    return p;
  }
  void release(void* p, std::size_t bytes) {
    auto it = live.find(static_cast<char*>(p));
    REQUIRE(it != live.end());  // released once, and only what was obtained, whole
    REQUIRE(it->second == bytes);
    live.erase(it);
    std::free(p);
    ++released;
  }
  ~source() {
    for (auto& [p, n] : live) std::free(p);
  }
  auto obtainer() {
    return [this](std::size_t n) { return obtain(n); };
  }
  auto releaser() {
    return [this](void* p, std::size_t n) { release(p, n); };
  }
};

char* at(void* p) { return static_cast<char*>(p); }
}  // namespace

TEST_CASE("block_pool rounds requests and sizes segments by kind", "[block_pool]") {
  STATIC_REQUIRE(pool_t::round_size(1) == 512);
  STATIC_REQUIRE(pool_t::round_size(512) == 512);
  STATIC_REQUIRE(pool_t::round_size(513) == 1024);
  STATIC_REQUIRE(pool_t::segment_size(512) == 2 * MiB);
  STATIC_REQUIRE(pool_t::segment_size(MiB) == 2 * MiB);  // 1 MiB is still small
  STATIC_REQUIRE(pool_t::segment_size(MiB + 512) == 20 * MiB);
  STATIC_REQUIRE(pool_t::segment_size(10 * MiB - 512) == 20 * MiB);
  STATIC_REQUIRE(pool_t::segment_size(10 * MiB) == 10 * MiB);
  STATIC_REQUIRE(pool_t::segment_size(11 * MiB + 1) == 12 * MiB);
}

TEST_CASE("block_pool splits a segment for small requests and merges freed neighbours on both sides",
          "[block_pool]") {
  source src;
  pool_t pool;
  void* a = pool.allocate(1000, 0, src.obtainer());
  void* b = pool.allocate(3000, 0, src.obtainer());
  void* c = pool.allocate(512, 0, src.obtainer());
  REQUIRE(src.obtained == 1);  // one 2 MiB segment serves all three
  CHECK(at(b) == at(a) + 1024);
  CHECK(at(c) == at(b) + 3072);
  CHECK(pool.size_of(a) == 1024);
  auto s = pool.stats();
  CHECK(s.splits == 3);
  CHECK(s.reuses == 2);
  CHECK(s.allocated == 1024 + 3072 + 512);
  CHECK(s.free_blocks == 1);
  CHECK(s.largest_free == 2 * MiB - s.allocated);

  pool.free(a);  // a stays alone: b is in use
  pool.free(c);  // c joins the free rest after it
  s = pool.stats();
  CHECK(s.free_blocks == 2);
  CHECK(s.merges == 1);
  CHECK(s.largest_free == 2 * MiB - 1024 - 3072);
  CHECK(pool.release_free_segments(src.releaser()) == 0);  // b still holds the segment

  pool.free(b);  // joins a before it and the rest after it: one block, the whole segment
  s = pool.stats();
  CHECK(s.free_blocks == 1);
  CHECK(s.merges == 3);
  CHECK(s.largest_free == 2 * MiB);
  CHECK(s.allocated == 0);
  CHECK(pool.release_free_segments(src.releaser()) == 2 * MiB);
  CHECK(src.released == 1);
  CHECK(pool.stats().reserved == 0);
  CHECK(pool.stats().segments == 0);
}

TEST_CASE("block_pool reuses a freed block for the next request that fits, best fit first", "[block_pool]") {
  source src;
  pool_t pool;
  void* big = pool.allocate(12 * MiB, 0, src.obtainer());  // its own 12 MiB segment
  void* mid = pool.allocate(5 * MiB, 0, src.obtainer());   // a 20 MiB segment, split
  REQUIRE(src.obtained == 2);
  pool.free(big);
  pool.free(mid);  // merges back into its whole 20 MiB segment
  // 11 MiB: the 12 MiB segment fits better than the 20 MiB one, and its 1 MiB
  // rest is too small to split off a large block.
  void* again = pool.allocate(11 * MiB, 0, src.obtainer());
  CHECK(again == big);
  CHECK(pool.size_of(again) == 12 * MiB);
  void* other = pool.allocate(3 * MiB, 0, src.obtainer());
  CHECK(other == mid);  // the 20 MiB segment, split again
  CHECK(pool.size_of(other) == 3 * MiB);
  CHECK(src.obtained == 2);
  CHECK(pool.stats().reuses == 2);
  CHECK(pool.stats().largest_free == 17 * MiB);
}

TEST_CASE("block_pool never gives a block of one stream to another", "[block_pool]") {
  source src;
  pool_t pool;
  void* a = pool.allocate(4 * MiB, 1, src.obtainer());
  CHECK(pool.stream_of(a) == 1);
  pool.free(a);
  void* b = pool.allocate(4 * MiB, 2, src.obtainer());
  CHECK(src.obtained == 2);  // stream 2 got a segment of its own
  CHECK((at(b) >= at(a) + 20 * MiB || at(b) + 20 * MiB <= at(a)));
  CHECK(pool.stream_of(b) == 2);
  void* c = pool.allocate(4 * MiB, 1, src.obtainer());
  CHECK(c == a);  // stream 1 still has its block
  // Small blocks too, and stream 2's free rest is not stream 1's to use.
  void* s2 = pool.allocate(1000, 2, src.obtainer());
  void* s1 = pool.allocate(1000, 1, src.obtainer());
  CHECK(src.obtained == 4);
  CHECK(pool.stream_of(s1) == 1);
  CHECK(pool.stream_of(s2) == 2);
}

// round_size and segment_size wrapped for requests near 2^64, which then got a block
// of 512 bytes (a caller's negative count converted to size_t).
TEST_CASE("block_pool refuses a request larger than any memory, obtaining nothing", "[block_pool]") {
  source src;
  pool_t pool;
  for (const std::size_t bytes : {std::size_t(-1), std::size_t(-100), std::size_t(-1) - MiB, std::size_t(1) << 63})
    CHECK_THROWS_WITH(pool.allocate(bytes, 0, src.obtainer()),
                      Catch::Contains(sl::cat("a request of ", bytes, " bytes is more than any memory holds")));
  CHECK(src.obtained == 0);
  CHECK(pool.stats().allocated_blocks == 0);
}

TEST_CASE("block_pool returns null without changing anything when no memory is obtained", "[block_pool]") {
  source src;
  pool_t pool;
  void* a = pool.allocate(1000, 0, src.obtainer());
  src.fail = true;
  CHECK(pool.allocate(4 * MiB, 0, src.obtainer()) == nullptr);
  CHECK(pool.allocate(1000, 0, src.obtainer()) != nullptr);  // the small segment still has room
  const auto s = pool.stats();
  CHECK(s.segments == 1);
  CHECK(s.allocated_blocks == 2);
  CHECK(pool.owns(a));
  CHECK_FALSE(pool.owns(at(a) + 512));  // inside a block, not its start
  CHECK_THROWS_AS(pool.free(at(a) + 512), sl::error);
  pool.free(a);
  CHECK_FALSE(pool.owns(a));
  CHECK_THROWS_AS(pool.free(a), sl::error);  // twice
}

// Random requests and frees on three streams against a model of which bytes
// are in use: no two live blocks ever overlap, each lies inside a segment that
// was obtained and not released, on its own stream; the stats add up; and at
// the end every segment goes back exactly once.
TEST_CASE("block_pool under random requests never hands out overlapping bytes and returns all memory",
          "[block_pool]") {
  const std::uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937 gen(seed);
  source src;
  pool_t pool;
  struct live_block {
    std::size_t bytes;
    int stream;
  };
  std::map<char*, live_block> live;  // by start
  auto random_size = [&]() -> std::size_t {
    switch (gen() % 4) {
      case 0: return 1 + gen() % 4096;                     // tiny
      case 1: return 1 + gen() % MiB;                      // small
      case 2: return MiB + 1 + gen() % (9 * MiB);          // large, from 20 MiB segments
      default: return 10 * MiB + gen() % (30 * MiB);       // large, own segments
    }
  };
  auto inside_live_segment = [&](char* p, std::size_t n) {
    auto it = src.live.upper_bound(p);
    if (it == src.live.begin()) return false;
    --it;
    return p + n <= it->first + it->second;
  };
  for (int step = 0; step < 20000; ++step) {
    const auto r = gen() % 100;
    if (r < 50 || live.empty()) {
      const std::size_t n = random_size();
      const int stream = int(gen() % 3);
      char* p = static_cast<char*>(pool.allocate(n, stream, src.obtainer()));
      REQUIRE(p != nullptr);
      REQUIRE(pool.size_of(p) >= n);
      REQUIRE(pool.stream_of(p) == stream);
      REQUIRE(inside_live_segment(p, pool.size_of(p)));
      auto next = live.lower_bound(p);  // no overlap with the neighbours on either side
      if (next != live.end()) REQUIRE(p + pool.size_of(p) <= next->first);
      if (next != live.begin()) REQUIRE(std::prev(next)->first + pool.size_of(std::prev(next)->first) <= p);
      live.emplace(p, live_block{n, stream});
    } else if (r < 98) {
      auto it = std::next(live.begin(), std::ptrdiff_t(gen() % live.size()));
      pool.free(it->first);
      live.erase(it);
    } else {
      pool.release_free_segments(src.releaser());
    }
    if (step % 500 == 0) {
      const auto s = pool.stats();
      std::size_t allocated = 0, reserved = 0;
      for (auto& [p, b] : live) allocated += pool.size_of(p);
      for (auto& [p, n] : src.live) reserved += n;
      REQUIRE(s.allocated == allocated);
      REQUIRE(s.allocated_blocks == live.size());
      REQUIRE(s.reserved == reserved);
      REQUIRE(s.segments == src.live.size());
      REQUIRE(s.largest_free <= s.reserved - s.allocated);
    }
  }
  const auto s = pool.stats();
  CHECK(s.splits > 0);
  CHECK(s.merges > 0);
  CHECK(s.reuses > 0);
  for (auto& [p, b] : live) pool.free(p);
  live.clear();
  pool.release_free_segments(src.releaser());
  CHECK(src.live.empty());
  CHECK(src.released == src.obtained);
  const auto end = pool.stats();
  CHECK(end.reserved == 0);
  CHECK(end.segments == 0);
  CHECK(end.free_blocks == 0);
  CHECK(end.allocated == 0);
}

}  // namespace test_block_pool
