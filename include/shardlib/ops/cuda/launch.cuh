// shardlib/ops/cuda/launch.cuh — what every shardlib kernel shares: block_team
// (a Team of one CUDA block), launch shapes, and the element-wise loop.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/caching_allocator.hpp"  // caching_allocator, device_buffer
#include "shardlib/cuda/error.hpp"              // check, check_launch
#include "shardlib/ops/cuda/team.hpp"           // Team

#include <cuda_runtime.h>

#include <algorithm>  // std::clamp
#include <cmath>      // INFINITY
#include <cstddef>    // std::size_t, std::byte
#include <cstdint>    // std::int64_t

namespace shardlib::ops::cuda {

// The threads of one block as a Team, one row per block. blockDim.x must be a
// multiple of 32 (row_threads gives one). sum and max reduce within each warp
// by shuffles, then across warps through shared memory; every warp reduces the
// per-warp partials itself, so all threads get the result after two barriers.
struct block_team {
  __device__ int rank() const { return int(threadIdx.x); }
  __device__ int size() const { return int(blockDim.x); }
  __device__ float sum(float x) const { return reduce(x, 0.0f, [](float a, float b) { return a + b; }); }
  __device__ float max(float x) const { return reduce(x, -INFINITY, [](float a, float b) { return fmaxf(a, b); }); }

 private:
  template <class Op>
  __device__ static float reduce(float x, float identity, Op op) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xFFFFFFFFu, x, offset));
    const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, warps = int(blockDim.x) / 32;
    __syncthreads();  // the previous reduction has finished reading `partial`
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    x = lane < warps ? partial[lane] : identity;
    for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xFFFFFFFFu, x, offset));
    return x;
  }
};

// Threads for a block that handles one row of n elements: n rounded up to
// whole warps, at most 512 (then each thread takes several elements).
inline int row_threads(std::int64_t n) { return int(std::clamp<std::int64_t>((n + 31) / 32 * 32, 32, 512)); }

// Blocks for a grid-stride loop over n items: enough to fill any current GPU
// several times over, without launching one block per item on huge inputs.
inline unsigned grid_blocks(std::int64_t n, int threads) {
  return unsigned(std::clamp<std::int64_t>((n + threads - 1) / threads, 1, 65536));
}

// f(i) for every i in [0, n): the body of every element-wise kernel.
template <class F>
__global__ void for_each_index_kernel(std::int64_t n, F f) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

template <class F>
void for_each_index(std::int64_t n, F f, cudaStream_t stream, const char* name) {
  if (n <= 0) return;
  constexpr int threads = 256;
  for_each_index_kernel<<<grid_blocks(n, threads), threads, 0, stream>>>(n, f);
  shardlib::cuda::check_launch(name);
}

// A kernel's report of a bad input (a target or id out of range) into an
// index_report slot: the smallest index wins, so the report is deterministic.
__device__ inline void report_index(unsigned long long* slot, std::int64_t index) {
  if (slot) atomicMin(slot, static_cast<unsigned long long>(index));
}

namespace detail {
// CUB's two-pass protocol: ask for the scratch size, then run with scratch
// from the caching allocator on the same stream.
template <class Run>
void with_cub_scratch(Run run, cudaStream_t stream, shardlib::cuda::caching_allocator& alloc, const char* what) {
  std::size_t bytes = 0;
  shardlib::cuda::check(run(nullptr, bytes), what, " (scratch size)");
  shardlib::cuda::device_buffer<std::byte> scratch(bytes, category::activations, stream, alloc);
  shardlib::cuda::check(run(scratch.data(), bytes), what);
}
}  // namespace detail

}  // namespace shardlib::ops::cuda
