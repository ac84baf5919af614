// shardlib/ops/cuda/rms_norm.cuh — RMSNorm forward and backward kernels over
// rows of d elements: one block per row for the row math
// (ops/cuda/rms_norm.hpp), and a deterministic two-stage column sum for the
// weight gradient.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/caching_allocator.hpp"  // caching_allocator, device_buffer
#include "shardlib/ops/cuda/launch.cuh"         // block_team, row_threads
#include "shardlib/ops/cuda/rms_norm.hpp"       // row math

#include <cuda_runtime.h>

#include <algorithm>  // std::max
#include <cstddef>    // std::size_t
#include <cstdint>    // std::int64_t

namespace shardlib::ops::cuda {

namespace detail {
template <class T, class P>
__global__ void rms_norm_forward_kernel(const T* x, const P* weight, T* y, float* rstd, int d, float eps) {
  const std::int64_t r = blockIdx.x;
  const float s = rms_norm_forward_row(block_team{}, x + r * d, weight, y + r * d, d, eps);
  if (rstd && threadIdx.x == 0) rstd[r] = s;
}

template <class T, class P>
__global__ void rms_norm_backward_kernel(const T* x, const T* dy, const P* weight, const float* rstd, T* dx, int d) {
  const std::int64_t r = blockIdx.x;
  rms_norm_backward_row(block_team{}, x + r * d, dy + r * d, weight, rstd[r], dx + r * d, d);
}

// Stage 1: chunk blockIdx.y of rows, column i: partial[chunk * d + i].
template <class T>
__global__ void rms_norm_weight_grad_kernel(const T* x, const T* dy, const float* rstd, std::int64_t rows, int d,
                                            std::int64_t chunk_rows, float* partial) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= d) return;
  const std::int64_t begin = blockIdx.y * chunk_rows, end = begin + chunk_rows < rows ? begin + chunk_rows : rows;
  partial[blockIdx.y * d + i] = rms_norm_weight_grad(x, dy, rstd, begin, end, d, i, 0.0f);
}

// Stage 2: the chunks in order, added to the gradient.
template <class P>
__global__ void rms_norm_weight_grad_finish_kernel(const float* partial, int chunks, int d, P* dweight) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= d) return;
  float acc = float(dweight[i]);
  for (int c = 0; c < chunks; ++c) acc += partial[c * d + i];
  dweight[i] = P(acc);
}
}  // namespace detail

// y[rows, d] = RMSNorm(x) with weight[d]; rstd[rows] (may be null) keeps
// 1 / rms per row for backward.
template <class T, class P>
void rms_norm_forward(const T* x, const P* weight, T* y, float* rstd, std::int64_t rows, int d, float eps,
                      cudaStream_t stream) {
  if (rows == 0 || d == 0) return;
  launch_kernel("rms_norm_forward", detail::rms_norm_forward_kernel<T, P>, row_blocks(rows, "rms_norm_forward"),
                row_threads(d), 0, stream, x, weight, y, rstd, d, eps);
}

// dx[rows, d] from dy and forward's rstd; dweight, unless null, accumulates (+=)
// like the host layer's gradient. Scratch for the column sums comes from `alloc` on `stream`.
template <class T, class P>
void rms_norm_backward(const T* x, const T* dy, const P* weight, const float* rstd, T* dx, P* dweight,
                       std::int64_t rows, int d, cudaStream_t stream, shardlib::cuda::caching_allocator& alloc) {
  if (rows == 0 || d == 0) return;
  launch_kernel("rms_norm_backward", detail::rms_norm_backward_kernel<T, P>, row_blocks(rows, "rms_norm_backward"),
                row_threads(d), 0, stream, x, dy, weight, rstd, dx, d);
  if (!dweight) return;
  // Chunks of 64 rows, as LayerNorm's parameter gradients (ops/cuda/layer_norm.cuh).
  const std::int64_t chunk_rows = std::max<std::int64_t>(64, (rows + 65534) / 65535);
  const int chunks = int((rows + chunk_rows - 1) / chunk_rows), threads = 128;
  shardlib::cuda::device_buffer<float> partial(std::size_t(chunks) * d, category::activations, stream, alloc);
  const dim3 grid(unsigned((d + threads - 1) / threads), unsigned(chunks));
  launch_kernel("rms_norm_weight_grad", detail::rms_norm_weight_grad_kernel<T>, grid, threads, 0, stream, x, dy, rstd,
                rows, d, chunk_rows, partial.data());
  launch_kernel("rms_norm_weight_grad_finish", detail::rms_norm_weight_grad_finish_kernel<P>,
                unsigned((d + threads - 1) / threads), threads, 0, stream, partial.data(), chunks, d, dweight);
}

}  // namespace shardlib::ops::cuda
