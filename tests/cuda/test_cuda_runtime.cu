// Device tests of the runtime layer: the caching allocator's reuse rules,
// splitting and merging over real cudaMalloc, device guard and ledger; errors
// that name the call and the device; copies between spaces.
#include <shardlib/core/buffer.hpp>
#include <shardlib/core/ledger.hpp>
#include <shardlib/cuda/caching_allocator.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/error.hpp>
#include <shardlib/cuda/kernel_facts.hpp>
#include <shardlib/cuda/memory_space.hpp>
#include <shardlib/cuda/stream.hpp>
#include <shardlib/ops/cuda/launch.cuh>

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "device_test.hpp"

namespace test_cuda_runtime {

namespace sl = shardlib;
namespace oc = shardlib::ops::cuda;
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
  oc::launch_kernel("busy_kernel", busy_kernel, 1, 1, 0, s, static_cast<int*>(p), ms);
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

TEST_CASE("a block never serves another stream, and one used by another stream returns once that stream is done",
          "[cuda][allocator]") {
  if (!have_device()) return;
  sl::cuda::caching_allocator alloc(0);
  sl::cuda::stream s1(0), s2(0), s3(0);

  char* a = static_cast<char*>(alloc.allocate(4 << 20, s1, sl::category::gathered_parameters));
  keep_busy(s1, a);
  alloc.deallocate(a);
  char* b = static_cast<char*>(alloc.allocate(4 << 20, s2, sl::category::gathered_parameters));
  CHECK((b >= a + (20 << 20) || b + (20 << 20) <= a));  // s2 has a segment of its own
  CHECK(alloc.stats().cuda_mallocs == 2);
  void* c = alloc.allocate(4 << 20, s1, sl::category::gathered_parameters);
  CHECK(c == a);  // s1 takes its block back at once: its own work is ordered
  alloc.deallocate(b);
  alloc.deallocate(c);

  SECTION("record_stream: a use on another stream holds the block back until that work is done") {
    void* d = alloc.allocate(4 << 20, s1, sl::category::gathered_parameters);
    alloc.record_stream(d, s3);
    keep_busy(s3, d);
    alloc.deallocate(d);
    CHECK(alloc.stats().in_use == std::size_t(4 << 20));  // freed, still used by s3
    char* e = static_cast<char*>(alloc.allocate(4 << 20, s1, sl::category::gathered_parameters));
    CHECK((e >= static_cast<char*>(d) + (4 << 20) || e + (4 << 20) <= static_cast<char*>(d)));
    s3.synchronize();
    void* g = alloc.allocate(4 << 20, s1, sl::category::gathered_parameters);
    CHECK(g == d);  // back in s1's cache, the best fit
    alloc.deallocate(e);
    alloc.deallocate(g);
  }
  cudaDeviceSynchronize();
}

namespace {
__global__ void fill_kernel(unsigned char* p, std::size_t n, unsigned char v) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = v;
}
// Writes v over n bytes at p on s, then reads them back: all v, or the block
// is not the memory it claims to be.
bool holds_writes(void* p, std::size_t n, unsigned char v, cudaStream_t s) {
  oc::launch_kernel("fill_kernel", fill_kernel, 64, 256, 0, s, static_cast<unsigned char*>(p), n, v);
  std::vector<unsigned char> back(n);
  sl::cuda::check(cudaMemcpyAsync(back.data(), p, n, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
  sl::cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return std::all_of(back.begin(), back.end(), [v](unsigned char x) { return x == v; });
}
}  // namespace

TEST_CASE("cached segments split for smaller requests and merge again when freed", "[cuda][allocator]") {
  if (!have_device()) return;
  sl::cuda::caching_allocator alloc(0);
  sl::cuda::stream s(0);
  // Small requests share a 2 MiB segment, one after the other.
  char* a = static_cast<char*>(alloc.allocate(1000, s, sl::category::activations));
  char* b = static_cast<char*>(alloc.allocate(3000, s, sl::category::activations));
  CHECK(b == a + 1024);
  CHECK(alloc.stats().cuda_mallocs == 1);
  CHECK(alloc.stats().in_use == 1024 + 3072);
  CHECK(holds_writes(a, 1024, 0x11, s));
  CHECK(holds_writes(b, 3072, 0x22, s));
  CHECK(holds_writes(a, 1024, 0x11, s));  // b's writes did not reach a
  alloc.deallocate(a);
  alloc.deallocate(b);
  CHECK(alloc.stats().largest_free == std::size_t(2 << 20));  // merged into the whole segment again

  // Large requests: two 5 MiB blocks from one 20 MiB segment; freed, they
  // merge and serve a 12 MiB request without cudaMalloc.
  char* x = static_cast<char*>(alloc.allocate(5 << 20, s, sl::category::activations));
  char* y = static_cast<char*>(alloc.allocate(5 << 20, s, sl::category::activations));
  CHECK(y == x + (5 << 20));
  CHECK(alloc.stats().cuda_mallocs == 2);
  CHECK(holds_writes(y, 5 << 20, 0x33, s));
  alloc.deallocate(x);
  alloc.deallocate(y);
  CHECK(alloc.stats().largest_free == std::size_t(20 << 20));
  void* z = alloc.allocate(12 << 20, s, sl::category::activations);
  CHECK(z == x);
  CHECK(alloc.stats().cuda_mallocs == 2);
  CHECK(holds_writes(z, 12 << 20, 0x44, s));
  alloc.deallocate(z);
  alloc.empty_cache();
  CHECK(alloc.stats().reserved == 0);
  CHECK(alloc.stats().segments == 0);
  CHECK(alloc.stats().cuda_frees == 2);
}

TEST_CASE("the allocator works on its own device and leaves the caller's current", "[cuda][allocator]") {
  if (!have_device()) return;
  SECTION("on its own device") {
    sl::cuda::caching_allocator alloc(0);
    sl::cuda::stream s(0);
    void* p = alloc.allocate(1 << 20, s, sl::category::activations);
    CHECK(sl::cuda::current_device() == 0);
    alloc.deallocate(p);
    alloc.empty_cache();
    CHECK(sl::cuda::current_device() == 0);
    CHECK(alloc.stats().reserved == 0);
  }
  SECTION("called from another device") {
    if (sl::cuda::device_count() < 2) {
      WARN("SKIPPED: the device guard across devices needs two GPUs, this machine has one");
      return;
    }
    sl::cuda::caching_allocator alloc(0);
    sl::cuda::stream s(0);
    sl::cuda::check(cudaSetDevice(1), "cudaSetDevice(1)");
    void* p = alloc.allocate(1 << 20, s, sl::category::activations);
    CHECK(sl::cuda::current_device() == 1);
    cudaPointerAttributes attr{};
    sl::cuda::check(cudaPointerGetAttributes(&attr, p), "cudaPointerGetAttributes");
    CHECK(attr.device == 0);  // cudaMalloc ran on the allocator's device
    sl::cuda::stream other(0);
    alloc.record_stream(p, other);  // the free records an event: on device 0 too
    alloc.deallocate(p);
    alloc.empty_cache();
    CHECK(sl::cuda::current_device() == 1);
    CHECK(alloc.stats().reserved == 0);
    sl::cuda::check(cudaSetDevice(0), "cudaSetDevice(0)");
  }
}

TEST_CASE("device_allocator_of finds the allocator of a pointer from its own books", "[cuda][allocator]") {
  if (!have_device()) return;
  sl::cuda::stream s(0);
  auto& alloc = sl::cuda::device_allocator(0);
  void* p = alloc.allocate(4096, s, sl::category::activations);
  CHECK(&sl::cuda::device_allocator_of(p) == &alloc);
  CHECK(alloc.owns(p));
  alloc.deallocate(p);
  CHECK_FALSE(alloc.owns(p));
  CHECK_THROWS_AS(sl::cuda::device_allocator_of(p), sl::error);  // freed: no longer anyone's
}

TEST_CASE("steady-state steps do not call cudaMalloc, and the ledger sees every allocation", "[cuda][allocator]") {
  if (!have_device()) return;
  sl::ledger l;
  sl::ledger_scope scope(l);
  sl::cuda::caching_allocator alloc(0);
  sl::cuda::stream s(0);
  // Floats: 12 kB and exactly 1 MiB (small: both cut from one 2 MiB
  // segment), 5 MiB and a bit (large: a 20 MiB segment).
  const std::size_t sizes[] = {3000, 1 << 18, (5 << 18) + 17};
  const std::size_t total = (3000 + (1 << 18) + (5 << 18) + 17) * sizeof(float);
  std::size_t mallocs_after_first_step = 0;
  for (int step = 0; step < 50; ++step) {
    std::vector<sl::cuda::device_buffer<float>> gathered;
    for (std::size_t n : sizes) gathered.emplace_back(n, sl::category::gathered_parameters, s, alloc);
    CHECK(l.current(sl::category::gathered_parameters) == total);
    if (step == 0) mallocs_after_first_step = alloc.stats().cuda_mallocs;
  }
  CHECK(mallocs_after_first_step == 2);
  CHECK(alloc.stats().cuda_mallocs == 2);
  CHECK(alloc.stats().reuses == 1 + 3 * 49);  // step 0's 1 MiB buffer came from the small segment's rest
  CHECK(l.current(sl::category::gathered_parameters) == 0);
  CHECK(l.peak(sl::category::gathered_parameters) == total);
  CHECK(alloc.stats().in_use == 0);
  alloc.empty_cache();
  CHECK(alloc.stats().reserved == 0);
  CHECK(alloc.stats().cuda_frees == 2);
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
  // More threads than a block may have: the launch raises, and the error does not stick.
  CHECK_THROWS_WITH(oc::launch_kernel("busy_kernel", busy_kernel, 1, 4096, 0, nullptr, nullptr, 0u),
                    Catch::Contains("launch of kernel busy_kernel"));
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK_NOTHROW(oc::launch_kernel("busy_kernel", busy_kernel, 1, 1, 0, nullptr, nullptr, 0u));
  CHECK_NOTHROW(sl::cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
}

namespace {
template <int Copy>  // two copies: one never opted in
__global__ void shared_kernel(int* out) {
  extern __shared__ int shared_ints[];
  shared_ints[threadIdx.x] = int(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = shared_ints[blockDim.x - 1 - threadIdx.x];
}
}  // namespace

TEST_CASE("kernel facts are the runtime's answers, kept, and shared memory opt-in names what is missing",
          "[cuda][launch]") {
  if (!have_device()) return;
  cudaDeviceProp prop{};
  sl::cuda::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const sl::cuda::device_facts& f = sl::cuda::current_device_facts();
  CHECK(f.device == 0);
  CHECK(f.major == prop.major);
  CHECK(f.shared_optin == int(prop.sharedMemPerBlockOptin));
  CHECK(&sl::cuda::current_device_facts() == &f);  // asked once

  const void* k = reinterpret_cast<const void*>(shared_kernel<0>);
  cudaFuncAttributes attr{};
  sl::cuda::check(cudaFuncGetAttributes(&attr, k), "cudaFuncGetAttributes");
  CHECK(sl::cuda::kernel_ptx_version(k) == attr.ptxVersion);
  CHECK(attr.ptxVersion > 0);

  // The whole opt-in amount: a launch above 48 KiB fails without the attribute, works with it.
  const std::size_t bytes = std::size_t(f.shared_optin);
  REQUIRE(bytes > 48 * 1024);
  sl::cuda::device_buffer<int> out(256, sl::category::activations, nullptr);
  CHECK_THROWS_WITH(oc::launch_kernel("shared_kernel<1>", shared_kernel<1>, 1, 256, bytes, nullptr, out.data()),
                    Catch::Contains("launch of kernel shared_kernel<1>"));
  sl::cuda::allow_shared_memory(k, bytes, "shared_kernel");
  sl::cuda::check(cudaFuncGetAttributes(&attr, k), "cudaFuncGetAttributes");
  CHECK(std::size_t(attr.maxDynamicSharedSizeBytes) == bytes);
  CHECK_NOTHROW(oc::launch_kernel("shared_kernel<0>", shared_kernel<0>, 1, 256, bytes, nullptr, out.data()));
  std::vector<int> host(256);
  sl::cuda::check(cudaMemcpy(host.data(), out.data(), 256 * sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  for (int i = 0; i < 256; ++i) CHECK(host[std::size_t(i)] == 255 - i);

  CHECK_THROWS_WITH(sl::cuda::allow_shared_memory(k, bytes + 1, "shared_kernel"),
                    Catch::Contains("shared_kernel: needs " + std::to_string(bytes + 1) +
                                    " bytes of shared memory per block, GPU 0 has " + std::to_string(bytes)));
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

}  // namespace test_cuda_runtime
