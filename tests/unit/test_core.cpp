// Core types: errors, shapes, memory spaces, buffers, tensor views, the ledger.
#include "shardlib/core/buffer.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/ledger.hpp"
#include "shardlib/core/memory_space.hpp"
#include "shardlib/core/shape.hpp"
#include "shardlib/core/tensor_view.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <thread>

namespace test_core {

using namespace shardlib;

TEST_CASE("errors derive from shardlib::error and carry the built message", "[core][error]") {
  CHECK_THROWS_AS(require<shape_error>(false, "x"), error);
  CHECK_THROWS_AS(throw comm_aborted("y"), comm_error);
  CHECK_THROWS_WITH(require(false, "rank ", 3, ": expected ", 4, " got ", 5.5), "rank 3: expected 4 got 5.5");
  CHECK_NOTHROW(require(true, "never built"));
}

TEST_CASE("Shape counts elements, compares, prints and rejects bad extents", "[core][shape]") {
  Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(Shape{}.numel() == 1);
  CHECK(Shape{0, 5}.numel() == 0);
  CHECK(s == Shape{2, 3, 4});
  CHECK_FALSE(s == Shape{2, 3});
  CHECK(cat(s) == "[2, 3, 4]");
  CHECK_THROWS_AS((Shape{2, -1}), shape_error);
  CHECK_THROWS_WITH((Shape{1, 1, 1, 1, 1, 1, 1, 1, 1}), Catch::Contains("rank 9 exceeds the maximum 8"));
  // A product past 2^60 is refused, not wrapped (2^32 · 2^32 would be 0 elements).
  CHECK_THROWS_WITH((Shape{std::int64_t(1) << 32, std::int64_t(1) << 32, 3}),
                    "Shape [4294967296, 4294967296, 3]: more than 2^60 elements (its nonzero extents' product)");
  CHECK_THROWS_AS((Shape{(std::int64_t(1) << 33) + 1, std::int64_t(1) << 31}), shape_error);
  CHECK(Shape{std::int64_t(1) << 30, std::int64_t(1) << 30}.numel() == Shape::max_numel);
  CHECK(Shape{std::int64_t(1) << 30, 0, std::int64_t(1) << 30}.numel() == 0);  // empty, no partial product past 2^60
  CHECK_THROWS_AS((Shape{std::int64_t(1) << 32, std::int64_t(1) << 32, 0}), shape_error);  // as safetensors counts
}

TEST_CASE("host memory space and reachability", "[core][space]") {
  STATIC_REQUIRE(MemorySpace<host_space>);
  STATIC_REQUIRE(can_access<host_space, host_space>);
  struct other_space {};
  STATIC_REQUIRE_FALSE(MemorySpace<other_space>);
  STATIC_REQUIRE_FALSE(can_access<host_space, other_space>);
}

TEST_CASE("Buffer is 64-byte aligned, move-only, and recorded in the ledger", "[core][buffer][ledger]") {
  ledger l;
  ledger_scope scope(l);
  {
    Buffer<float> a(1000, category::parameters);
    CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % 64 == 0);
    CHECK(a.size() == 1000);
    CHECK(l.current(category::parameters) == 4000);
    Buffer<double> odd(3, category::activations);  // 24 bytes: still aligned
    CHECK(reinterpret_cast<std::uintptr_t>(odd.data()) % 64 == 0);
    Buffer<float> b = std::move(a);
    CHECK(a.empty());
    CHECK(b.size() == 1000);
    CHECK(l.current(category::parameters) == 4000);  // moved, not copied
    b.reset();
    CHECK(l.current(category::parameters) == 0);
    CHECK(l.peak(category::parameters) == 4000);
    CHECK(l.current() == 24);
  }
  CHECK(l.current() == 0);
  CHECK(l.peak() == 4024);
  Buffer<float> empty(0, category::comm_scratch);
  CHECK(empty.data() == nullptr);
  CHECK(l.current() == 0);
  // A negative count converted to size_t: n * sizeof(T), and the rounding to 64 bytes,
  // wrapped to a few bytes, and the buffer claimed 2^64 - 1 elements over them.
  CHECK_THROWS_WITH((Buffer<float>(std::size_t(-1), category::activations)),
                    Catch::StartsWith("a host buffer of 18446744073709551615 elements of 4 bytes is more than any "
                                      "memory holds"));
  CHECK_THROWS_AS(host_space::allocate(std::size_t(-32)), std::bad_alloc);
  CHECK(l.current() == 0);
}

TEST_CASE("ledger peaks per category and in total", "[core][ledger]") {
  ledger l;
  l.allocate(category::gradients, 100);
  l.allocate(category::gathered_parameters, 50);
  l.release(category::gathered_parameters, 50);
  l.allocate(category::activations, 70);
  CHECK(l.peak(category::gradients) == 100);
  CHECK(l.peak(category::gathered_parameters) == 50);
  CHECK(l.peak() == 170);  // the peak of the sum, not 220
  l.reset_peaks();
  CHECK(l.peak() == 170);
  CHECK(l.peak(category::gathered_parameters) == 0);
  CHECK_THROWS_WITH(l.release(category::gradients, 101),
                    Catch::Contains("releasing 101 bytes of gradients but only 100 are recorded"));
  CHECK(l.current(category::gradients) == 100);  // a refused release changes nothing
  CHECK(name(category::optimizer_state) == "optimizer_state");
}

TEST_CASE("each thread has its own ledger unless pointed at one", "[core][ledger]") {
  ledger shared;
  std::size_t seen_in_thread = 1;
  std::thread t([&] {
    Buffer<char> b(10, category::activations);
    seen_in_thread = shared.current();
  });
  t.join();
  CHECK(seen_in_thread == 0);
  std::thread u([&] {
    ledger_scope scope(shared);
    Buffer<char> b(10, category::activations);
    seen_in_thread = shared.current();
  });
  u.join();
  CHECK(seen_in_thread == 10);
  CHECK(shared.current() == 0);
}

TEST_CASE("TensorView indexes row-major and reshapes", "[core][tensor]") {
  Buffer<int> b(24, category::activations);
  for (int i = 0; i < 24; ++i) b[i] = i;
  TensorView<int> t(b, Shape{2, 3, 4});
  CHECK(t(1, 2, 3) == 23);
  CHECK(t(0, 1, 0) == 4);
  CHECK(t.numel() == 24);
  TensorView<const int> c = t;
  CHECK(c.reshape({6, 4})(5, 3) == 23);
  CHECK_THROWS_WITH(t.reshape({5, 5}), Catch::Contains("has 24 elements, the new shape [5, 5] has 25"));
  CHECK_THROWS_AS(TensorView<int>(b, Shape{5}), shape_error);
}

TEST_CASE("large freed host blocks are kept for reuse below the ledger", "[core][space][cache]") {
  host_space::release_cached();
  ledger l;
  ledger_scope scope(l);
  const std::size_t n = (std::size_t(2) << 20) / sizeof(float);  // 2 MiB: cached
  const float* first = nullptr;
  {
    Buffer<float> a(n, category::gathered_parameters);
    first = a.data();
  }
  CHECK(l.current() == 0);                              // the ledger counts bytes in use only
  CHECK(host_space::cached_bytes() == n * sizeof(float));  // the block is kept
  {
    Buffer<float> b(n, category::gradients);
    CHECK(b.data() == first);  // and handed out again for the same size
    CHECK(host_space::cached_bytes() == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 64 == 0);
  }
  {
    Buffer<char> small(1000, category::activations);  // small blocks go straight back to malloc
  }
  CHECK(host_space::cached_bytes() == n * sizeof(float));
  host_space::release_cached();
  CHECK(host_space::cached_bytes() == 0);
}

}  // namespace test_core
