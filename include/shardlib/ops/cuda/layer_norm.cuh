// shardlib/ops/cuda/layer_norm.cuh — LayerNorm forward and backward kernels
// over rows of d elements: one block per row for the row math
// (ops/cuda/layer_norm.hpp), and a deterministic two-stage column sum for the
// parameter gradients.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/caching_allocator.hpp"  // caching_allocator, device_buffer
#include "shardlib/ops/cuda/launch.cuh"         // block_team, row_threads
#include "shardlib/ops/cuda/layer_norm.hpp"     // row math

#include <cuda_runtime.h>

#include <algorithm>  // std::max
#include <cstdint>    // std::int64_t

namespace shardlib::ops::cuda {

namespace detail {
template <class T, class P>
__global__ void layer_norm_forward_kernel(const T* x, const P* weight, const P* bias, T* y, row_stats* stats, int d,
                                          float eps) {
  const std::int64_t r = blockIdx.x;
  const row_stats s = layer_norm_forward_row(block_team{}, x + r * d, weight, bias, y + r * d, d, eps);
  if (stats && threadIdx.x == 0) stats[r] = s;
}

template <class T, class P>
__global__ void layer_norm_backward_kernel(const T* x, const T* dy, const P* weight, const row_stats* stats, T* dx,
                                           int d) {
  const std::int64_t r = blockIdx.x;
  layer_norm_backward_row(block_team{}, x + r * d, dy + r * d, weight, stats[r], dx + r * d, d);
}

// Stage 1: chunk blockIdx.y of rows, column i: partial[chunk * d + i].
template <class T>
__global__ void layer_norm_param_grads_kernel(const T* x, const T* dy, const row_stats* stats, std::int64_t rows,
                                              int d, std::int64_t chunk_rows, param_grads* partial) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= d) return;
  const std::int64_t begin = blockIdx.y * chunk_rows, end = begin + chunk_rows < rows ? begin + chunk_rows : rows;
  partial[blockIdx.y * d + i] = layer_norm_param_grads(x, dy, stats, begin, end, d, i, param_grads{0, 0});
}

// Stage 2: the chunks in order, added to the gradients.
template <class P>
__global__ void layer_norm_param_grads_finish_kernel(const param_grads* partial, int chunks, int d, P* dweight,
                                                     P* dbias) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= d) return;
  param_grads acc{dweight ? float(dweight[i]) : 0.0f, dbias ? float(dbias[i]) : 0.0f};
  for (int c = 0; c < chunks; ++c) {
    acc.weight += partial[c * d + i].weight;
    acc.bias += partial[c * d + i].bias;
  }
  if (dweight) dweight[i] = P(acc.weight);
  if (dbias) dbias[i] = P(acc.bias);
}
}  // namespace detail

// y[rows, d] = LayerNorm(x) with optional affine weight[d], bias[d] (both null
// for none); stats[rows] (may be null) keeps mean and rstd for backward.
template <class T, class P>
void layer_norm_forward(const T* x, const P* weight, const P* bias, T* y, row_stats* stats, std::int64_t rows, int d,
                        float eps, cudaStream_t stream) {
  if (rows == 0 || d == 0) return;
  launch_kernel("layer_norm_forward", detail::layer_norm_forward_kernel<T, P>, row_blocks(rows, "layer_norm_forward"),
                row_threads(d), 0, stream, x, weight, bias, y, stats, d, eps);
}

// dx[rows, d] from dy and forward's stats; dweight and dbias, where not null,
// accumulate (+=) like the host layer's gradients. Scratch for the column sums
// comes from `alloc` on `stream`.
template <class T, class P>
void layer_norm_backward(const T* x, const T* dy, const P* weight, const row_stats* stats, T* dx, P* dweight,
                         P* dbias, std::int64_t rows, int d, cudaStream_t stream,
                         shardlib::cuda::caching_allocator& alloc) {
  if (rows == 0 || d == 0) return;
  launch_kernel("layer_norm_backward", detail::layer_norm_backward_kernel<T, P>,
                row_blocks(rows, "layer_norm_backward"), row_threads(d), 0, stream, x, dy, weight, stats, dx, d);
  if (!dweight && !dbias) return;
  // 64 rows per chunk keeps enough blocks in flight for a few hundred rows
  // and the partials small (8 bytes per column and chunk); more on inputs
  // whose chunks would exceed the grid's 65535 in y.
  const std::int64_t chunk_rows = std::max<std::int64_t>(64, (rows + 65534) / 65535);
  const int chunks = int((rows + chunk_rows - 1) / chunk_rows), threads = 128;
  shardlib::cuda::device_buffer<param_grads> partial(std::size_t(chunks) * d, category::activations, stream, alloc);
  const dim3 grid(unsigned((d + threads - 1) / threads), unsigned(chunks));
  launch_kernel("layer_norm_param_grads", detail::layer_norm_param_grads_kernel<T>, grid, threads, 0, stream, x, dy,
                stats, rows, d, chunk_rows, partial.data());
  launch_kernel("layer_norm_param_grads_finish", detail::layer_norm_param_grads_finish_kernel<P>,
                unsigned((d + threads - 1) / threads), threads, 0, stream, partial.data(), chunks, d, dweight, dbias);
}

}  // namespace shardlib::ops::cuda
