// Device tests of the runtime layer: the caching allocator's reuse rules and
// ledger, errors that name the call and the device, copies between spaces.
#include <shardlib/core/buffer.hpp>
#include <shardlib/core/ledger.hpp>
#include <shardlib/cuda/caching_allocator.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/error.hpp>
#include <shardlib/cuda/memory_space.hpp>
#include <shardlib/cuda/stream.hpp>

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <numeric>
#include <vector>

#include "device_test.hpp"

namespace sl = shardlib;
using namespace device_test;

static_assert(sl::can_access<sl::cuda_space, sl::cuda_space> && sl::can_access<sl::cuda_space, sl::pinned_space>);
static_assert(sl::can_access<sl::host_space, sl::pinned_space> && sl::can_access<sl::pinned_space, sl::host_space>);
static_assert(!sl::can_access<sl::host_space, sl::cuda_space> && !sl::can_access<sl::cuda_space, sl::host_space>);

namespace {
// Keeps a stream busy for about `ms` milliseconds while touching p, so that
// work using a block is still running when the block is freed.
__global__ void busy_kernel(int* p, unsigned ms) {
  for (unsigned i = 0; i < ms; ++i) __nanosleep(1000000);
  if (p) *p = 1;
}
void keep_busy(cudaStream_t s, void* p, unsigned ms = 300) {
  busy_kernel<<<1, 1, 0, s>>>(static_cast<int*>(p), ms);
  sl::cuda::check_launch("busy_kernel");
}
}  // namespace

TEST_CASE("a freed block is reused at once on its own stream", "[cuda][allocator]") {
  if (!have_device()) return;
  sl::cuda::caching_allocator alloc(0);
  sl::cuda::stream s(0);
  void* a = alloc.allocate(1 << 20, s, sl::category::gathered_parameters);
  keep_busy(s, a);
  alloc.deallocate(a);
  // Stream order already puts new work on s after the old: no need to wait.
  void* b = alloc.allocate(1 << 20, s, sl::category::gathered_parameters);
  CHECK(b == a);
  CHECK(alloc.stats().cuda_mallocs == 1);
  alloc.deallocate(b);
  s.synchronize();
}

TEST_CASE("a freed block is reused on another stream only after the streams that used it are done",
          "[cuda][allocator]") {
  if (!have_device()) return;
  sl::cuda::caching_allocator alloc(0);
  sl::cuda::stream s1(0), s2(0), s3(0);

  void* a = alloc.allocate(4 << 20, s1, sl::category::gathered_parameters);
  keep_busy(s1, a);
  alloc.deallocate(a);
  void* b = alloc.allocate(4 << 20, s2, sl::category::gathered_parameters);
  CHECK(b != a);  // s1 still uses a
  s1.synchronize();
  void* c = alloc.allocate(4 << 20, s2, sl::category::gathered_parameters);
  CHECK(c == a);  // s1 is done with it
  alloc.deallocate(b);
  alloc.deallocate(c);

  SECTION("record_stream: a use on another stream holds the block back on the allocation's own stream too") {
    void* d = alloc.allocate(4 << 20, s1, sl::category::gathered_parameters);
    alloc.record_stream(d, s3);
    keep_busy(s3, d);
    alloc.deallocate(d);
    void* e = alloc.allocate(4 << 20, s1, sl::category::gathered_parameters);
    CHECK(e != d);
    s3.synchronize();
    void* g = alloc.allocate(4 << 20, s1, sl::category::gathered_parameters);
    CHECK(g == d);
    alloc.deallocate(e);
    alloc.deallocate(g);
  }
  cudaDeviceSynchronize();
}

TEST_CASE("steady-state steps do not call cudaMalloc, and the ledger sees every allocation", "[cuda][allocator]") {
  if (!have_device()) return;
  sl::ledger l;
  sl::ledger_scope scope(l);
  sl::cuda::caching_allocator alloc(0);
  sl::cuda::stream s(0);
  // Floats: 12 kB (rounded to 512 B), exactly 1 MiB (the first large size,
  // rounded to 2 MiB), 5 MiB and a bit.
  const std::size_t sizes[] = {3000, 1 << 18, (5 << 18) + 17};
  const std::size_t total = (3000 + (1 << 18) + (5 << 18) + 17) * sizeof(float);
  std::size_t mallocs_after_first_step = 0;
  for (int step = 0; step < 50; ++step) {
    std::vector<sl::cuda::device_buffer<float>> gathered;
    for (std::size_t n : sizes) gathered.emplace_back(n, sl::category::gathered_parameters, s, alloc);
    CHECK(l.current(sl::category::gathered_parameters) == total);
    if (step == 0) mallocs_after_first_step = alloc.stats().cuda_mallocs;
  }
  CHECK(mallocs_after_first_step == 3);
  CHECK(alloc.stats().cuda_mallocs == 3);
  CHECK(alloc.stats().reuses == 3 * 49);
  CHECK(l.current(sl::category::gathered_parameters) == 0);
  CHECK(l.peak(sl::category::gathered_parameters) == total);
  CHECK(alloc.stats().in_use == 0);
  alloc.empty_cache();
  CHECK(alloc.stats().reserved == 0);
  CHECK(alloc.stats().cuda_frees == 3);
}

TEST_CASE("running out of device memory raises cuda_error naming the request and the device", "[cuda][allocator]") {
  if (!have_device()) return;
  sl::cuda::caching_allocator alloc(0);
  sl::cuda::stream s(0);
  std::size_t free_bytes = 0, total_bytes = 0;
  sl::cuda::check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  const std::size_t too_much = total_bytes + (std::size_t(1) << 30);
  try {
    alloc.allocate(too_much, s, sl::category::activations);
    FAIL("allocated more than the device has");
  } catch (const sl::cuda_error& e) {
    CHECK(e.code() == int(cudaErrorMemoryAllocation));
    CHECK(e.device() == 0);
    CHECK_THAT(e.what(), Catch::Contains("cudaMalloc") && Catch::Contains("on device 0"));
  }
  // The failure was cleared: the allocator and the device still work.
  void* p = alloc.allocate(1024, s, sl::category::activations);
  CHECK(p != nullptr);
  alloc.deallocate(p);
}

TEST_CASE("failed CUDA calls and launches raise cuda_error naming them", "[cuda][error]") {
  if (!have_device()) return;
  try {
    sl::cuda::check(cudaSetDevice(9999), "cudaSetDevice(", 9999, ")");
    FAIL("cudaSetDevice(9999) succeeded");
  } catch (const sl::cuda_error& e) {
    CHECK(e.code() == int(cudaErrorInvalidDevice));
    CHECK_THAT(e.what(), Catch::Contains("cudaSetDevice(9999) failed on device 0"));
  }
  busy_kernel<<<1, 4096>>>(nullptr, 0);  // more threads than a block may have
  CHECK_THROWS_WITH(sl::cuda::check_launch("busy_kernel"), Catch::Contains("launch of kernel busy_kernel"));
  busy_kernel<<<1, 1>>>(nullptr, 0);  // the launch error did not stick
  CHECK_NOTHROW(sl::cuda::check_launch("busy_kernel"));
  CHECK_NOTHROW(sl::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
}

TEST_CASE("copies move data between host, pinned and device memory on a stream", "[cuda][copy]") {
  if (!have_device()) return;
  sl::ledger l;
  sl::ledger_scope scope(l);
  sl::cuda::stream s(0);
  const std::size_t n = 100000;
  std::vector<int> host(n);
  std::iota(host.begin(), host.end(), 7);
  sl::Buffer<int, sl::pinned_space> pinned(n, sl::category::activations), back(n, sl::category::activations);
  sl::Buffer<int, sl::cuda_space> device(n, sl::category::activations);
  sl::cuda::device_buffer<int> cached(n, sl::category::activations, s);
  CHECK(l.current(sl::category::activations) == 4 * n * sizeof(int));

  sl::cuda::copy_async(pinned.span(), std::span<const int>(host), s);
  sl::cuda::copy_async(device.span(), std::span<const int>(pinned.span()), s);
  sl::cuda::copy_async(cached.span(), std::span<const int>(device.span()), s);
  sl::cuda::copy_async(back.span(), std::span<const int>(cached.span()), s);
  s.synchronize();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(back[i] == host[i]);

  cudaPointerAttributes a{};
  sl::cuda::check(cudaPointerGetAttributes(&a, device.data()), "cudaPointerGetAttributes");
  CHECK(a.type == cudaMemoryTypeDevice);
  sl::cuda::check(cudaPointerGetAttributes(&a, pinned.data()), "cudaPointerGetAttributes");
  CHECK(a.type == cudaMemoryTypeHost);
  CHECK_THROWS_AS(sl::cuda::copy_async(back.span(), std::span<const int>(host).first(3), s), sl::shape_error);
}
