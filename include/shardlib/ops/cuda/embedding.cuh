// shardlib/ops/cuda/embedding.cuh — embedding lookup (gather) and its gradient
// (scatter-add) as nn::Embedding. The gradient sorts the ids with CUB (stably,
// so each row's uses stay in input order) and gives each run of equal ids to
// one block: deterministic, no atomics, and bit for bit the host's in float.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"              // category
#include "shardlib/cuda/caching_allocator.hpp"   // caching_allocator, device_buffer
#include "shardlib/cuda/error.hpp"               // check
#include "shardlib/ops/cuda/embedding.hpp"       // row math
#include "shardlib/ops/cuda/index_report.hpp"    // index_report
#include "shardlib/ops/cuda/launch.cuh"          // block_team, row_threads, map_elements, report_index, with_cub_scratch

#include <cub/device/device_radix_sort.cuh>

#include <cuda_runtime.h>

#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

namespace detail {
template <class T>
__global__ void embedding_forward_kernel(const T* weight, std::int64_t num, int dim, const std::int64_t* ids, T* out,
                                         unsigned long long* bad_id) {
  const std::int64_t i = blockIdx.x;
  const std::int64_t id = ids[i];
  if (id < 0 || id >= num) {  // zeros, and the position is reported
    for (int j = int(threadIdx.x); j < dim; j += int(blockDim.x)) out[i * dim + j] = T(0.0f);
    if (threadIdx.x == 0) report_index(bad_id, i);
    return;
  }
  embedding_row(block_team{}, weight, id, dim, out + i * dim);
}

struct index_of {
  __device__ std::int64_t operator()(std::int64_t i) const { return i; }
};

// Block k handles the run of equal sorted ids starting at k, if one starts there.
template <class T>
__global__ void embedding_backward_kernel(const std::int64_t* sorted_ids, const std::int64_t* positions,
                                          std::int64_t n, std::int64_t num, int dim, const T* dy, T* grad) {
  const std::int64_t k = blockIdx.x;
  const std::int64_t id = sorted_ids[k];
  if ((k > 0 && sorted_ids[k - 1] == id) || id < 0 || id >= num) return;
  std::int64_t end = k + 1;
  while (end < n && sorted_ids[end] == id) ++end;
  embedding_accumulate_run(block_team{}, grad + id * dim, dy, positions + k, int(end - k), dim);
}
}  // namespace detail

// out[n, dim] = weight[ids[i]] for the n ids. An id outside [0, num) gives a
// zero row and its position is reported to bad_id.
template <class T>
void embedding_forward(const T* weight, std::int64_t num, int dim, const std::int64_t* ids, std::int64_t n, T* out,
                       index_report& bad_id, cudaStream_t stream) {
  if (n == 0 || dim == 0) return;
  launch_kernel("embedding_forward", detail::embedding_forward_kernel<T>, row_blocks(n, "embedding_forward"),
                row_threads(dim), 0, stream, weight, num, dim, ids, out, bad_id.slot());
}

// grad[num, dim] += the rows of dy[n, dim] at the ids they were looked up with
// (ids outside [0, num) are skipped: forward reported them).
template <class T>
void embedding_backward(const std::int64_t* ids, std::int64_t n, const T* dy, T* grad, std::int64_t num, int dim,
                        cudaStream_t stream, shardlib::cuda::caching_allocator& alloc) {
  if (n == 0 || dim == 0) return;
  using shardlib::cuda::device_buffer;
  device_buffer<std::int64_t> positions(std::size_t(n), category::activations, stream, alloc);
  device_buffer<std::int64_t> sorted_ids(std::size_t(n), category::activations, stream, alloc);
  device_buffer<std::int64_t> sorted_positions(std::size_t(n), category::activations, stream, alloc);
  map_elements(n, detail::index_of{}, stream, "embedding_backward (positions)", positions.data());
  detail::with_cub_scratch(
      [&](void* scratch, std::size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(scratch, bytes, ids, sorted_ids.data(), positions.data(),
                                               sorted_positions.data(), n, 0, 64, stream);
      },
      stream, alloc, "cub::DeviceRadixSort::SortPairs (embedding ids)");
  launch_kernel("embedding_backward", detail::embedding_backward_kernel<T>, row_blocks(n, "embedding_backward"),
                row_threads(dim), 0, stream, sorted_ids.data(), sorted_positions.data(), n, num, dim, dy, grad);
}

}  // namespace shardlib::ops::cuda
