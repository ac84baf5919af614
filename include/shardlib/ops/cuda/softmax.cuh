// shardlib/ops/cuda/softmax.cuh — the attention softmax over rows of scores
// with a key-padding mask, and its backward; one block per row
// (ops/cuda/softmax.hpp holds the row math).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/cuda/launch.cuh"   // block_team, row_threads
#include "shardlib/ops/cuda/softmax.hpp"  // row math

#include <cuda_runtime.h>

#include <cstdint>  // std::int64_t, std::uint8_t

namespace shardlib::ops::cuda {

namespace detail {
template <class T>
__global__ void masked_softmax_kernel(T* scores, const std::uint8_t* mask, int n, std::int64_t rows_per_mask) {
  const std::int64_t r = blockIdx.x;
  masked_softmax_row(block_team{}, scores + r * n, mask ? mask + (r / rows_per_mask) * n : nullptr, n);
}
template <class T>
__global__ void softmax_backward_kernel(const T* p, T* dp, int n) {
  const std::int64_t r = blockIdx.x;
  softmax_backward_row(block_team{}, p + r * n, dp + r * n, n);
}
}  // namespace detail

// In place over scores[rows, n]. mask (null for none) has one row of n bytes
// per rows_per_mask consecutive score rows: for attention scores [N, H, L, L]
// and a key-padding mask [N, L], rows_per_mask = H * L.
template <class T>
void masked_softmax(T* scores, const std::uint8_t* mask, std::int64_t rows, int n, std::int64_t rows_per_mask,
                    cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  launch_kernel("masked_softmax", detail::masked_softmax_kernel<T>, row_blocks(rows, "masked_softmax"), row_threads(n),
                0, stream, scores, mask, n, rows_per_mask > 0 ? rows_per_mask : 1);
}

// In place over dp[rows, n]: the gradient of the scores from that of the weights p.
template <class T>
void softmax_backward(const T* p, T* dp, std::int64_t rows, int n, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  launch_kernel("softmax_backward", detail::softmax_backward_kernel<T>, row_blocks(rows, "softmax_backward"),
                row_threads(n), 0, stream, p, dp, n);
}

}  // namespace shardlib::ops::cuda
