// shardlib/ops/cuda/reduce.cuh — reductions: with CUB, the squared norm of a
// gradient shard (global-norm clipping) and the count of non-finite values
// (fp16 loss scaling); and the column sums of a matrix (bias gradients).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"             // FloatingElement
#include "shardlib/core/ledger.hpp"              // category
#include "shardlib/cuda/caching_allocator.hpp"   // caching_allocator, device_buffer
#include "shardlib/ops/cuda/launch.cuh"          // detail::with_cub_scratch, grid_blocks

#include <cub/device/device_reduce.cuh>
#include <cuda/std/functional>  // cuda::std::plus

#include <cuda_runtime.h>

#include <algorithm>  // std::clamp, std::min
#include <cmath>      // isfinite
#include <cstddef>    // std::size_t
#include <cstdint>    // std::int64_t
#include <span>       // std::span

namespace shardlib::ops::cuda {

namespace detail {
template <class T>
struct square_as_double {
  __host__ __device__ double operator()(T x) const { return double(float(x)) * double(float(x)); }
};
template <class T>
struct is_nonfinite {
  __host__ __device__ unsigned long long operator()(T x) const { return isfinite(float(x)) ? 0ULL : 1ULL; }
};

// Column sums in tiles of 32 columns by 8 lanes of rows: lane (x, y) of block
// (bx, by) adds rows y, y + 8, ... of chunk by in column 32 bx + x in float,
// then lane y = 0 adds the 8 partials in order. A warp reads 32 neighbouring
// columns of one row. With one chunk the sums go straight into g; otherwise
// into partial[chunk, column], which column_chunks_finish_kernel adds in chunk
// order. Nothing depends on scheduling: the same shapes give the same bits.
inline constexpr int column_tile = 32, column_lanes = 8;

template <class T>
__global__ void column_sums_kernel(const T* d, std::int64_t rows, std::int64_t cols, std::int64_t chunk_rows,
                                   float* partial, T* g) {
  static __shared__ float lane_sums[column_lanes][column_tile];
  const std::int64_t c = std::int64_t(blockIdx.x) * column_tile + threadIdx.x;
  const std::int64_t begin = std::int64_t(blockIdx.y) * chunk_rows;
  const std::int64_t end = begin + chunk_rows < rows ? begin + chunk_rows : rows;
  float acc = 0;
  if (c < cols)
    for (std::int64_t r = begin + threadIdx.y; r < end; r += column_lanes) acc += float(d[r * cols + c]);
  lane_sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float sum = 0;
  for (int l = 0; l < column_lanes; ++l) sum += lane_sums[l][threadIdx.x];
  if (partial)
    partial[std::int64_t(blockIdx.y) * cols + c] = sum;
  else
    g[c] = T(float(g[c]) + sum);
}

template <class T>
__global__ void column_chunks_finish_kernel(const float* partial, std::int64_t chunks, std::int64_t cols, T* g) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t c = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cols; c += stride) {
    float sum = 0;
    for (std::int64_t k = 0; k < chunks; ++k) sum += partial[k * cols + c];
    g[c] = T(float(g[c]) + sum);
  }
}
}  // namespace detail

// g[c] += sum over r of d[r, c] for a row-major d[rows, cols] on the device,
// summed in float and rounded to T once: a bias gradient. Deterministic (no
// atomics). Rows are split into chunks only when the columns alone give too
// few blocks to fill the GPU; the chunks' partial sums (float, chunks x cols)
// come from `alloc` on `stream`.
template <FloatingElement T>
void add_column_sums(const T* d, std::int64_t rows, std::int64_t cols, T* g, cudaStream_t stream,
                     shardlib::cuda::caching_allocator& alloc) {
  if (rows <= 0 || cols <= 0) return;
  const std::int64_t tiles = (cols + detail::column_tile - 1) / detail::column_tile;
  // About 2048 blocks in all (an H200 holds 132 x 8 of them), chunks of at
  // least 64 rows (8 per lane), at most 65535 chunks (the grid's y limit).
  constexpr std::int64_t target_blocks = 2048, min_chunk_rows = 64;
  const std::int64_t most_chunks = std::min<std::int64_t>((rows + min_chunk_rows - 1) / min_chunk_rows, 65535);
  std::int64_t chunks = std::clamp<std::int64_t>((target_blocks + tiles - 1) / tiles, 1, most_chunks);
  const std::int64_t chunk_rows = (rows + chunks - 1) / chunks;
  chunks = (rows + chunk_rows - 1) / chunk_rows;
  const dim3 block{unsigned(detail::column_tile), unsigned(detail::column_lanes)}, grid{unsigned(tiles), unsigned(chunks)};
  if (chunks == 1) {
    launch_kernel("add_column_sums", detail::column_sums_kernel<T>, grid, block, 0, stream, d, rows, cols, chunk_rows,
                  nullptr, g);
    return;
  }
  shardlib::cuda::device_buffer<float> partial(std::size_t(chunks * cols), category::activations, stream, alloc);
  launch_kernel("add_column_sums", detail::column_sums_kernel<T>, grid, block, 0, stream, d, rows, cols, chunk_rows,
                partial.data(), g);
  constexpr int threads = 256;
  launch_kernel("add_column_sums (chunks)", detail::column_chunks_finish_kernel<T>, grid_blocks(cols, threads), threads,
                0, stream, partial.data(), chunks, cols, g);
}

// *out (device) = sum of x[i]^2, each square and the sum in double, as
// optim's grad_norm_squared on the host (the order of the sum differs).
template <FloatingElement T>
void sum_squares(std::span<const T> x, double* out, cudaStream_t stream, shardlib::cuda::caching_allocator& alloc) {
  detail::with_cub_scratch(
      [&](void* scratch, std::size_t& bytes) {
        return cub::DeviceReduce::TransformReduce(scratch, bytes, x.data(), out, x.size(), ::cuda::std::plus<>{},
                                                  detail::square_as_double<T>{}, 0.0, stream);
      },
      stream, alloc, "cub::DeviceReduce::TransformReduce (sum of squares)");
}

// *out (device) = how many x[i] are infinite or NaN.
template <FloatingElement T>
void count_nonfinite(std::span<const T> x, unsigned long long* out, cudaStream_t stream,
                     shardlib::cuda::caching_allocator& alloc) {
  detail::with_cub_scratch(
      [&](void* scratch, std::size_t& bytes) {
        return cub::DeviceReduce::TransformReduce(scratch, bytes, x.data(), out, x.size(), ::cuda::std::plus<>{},
                                                  detail::is_nonfinite<T>{}, 0ULL, stream);
      },
      stream, alloc, "cub::DeviceReduce::TransformReduce (counting non-finite values)");
}

}  // namespace shardlib::ops::cuda
