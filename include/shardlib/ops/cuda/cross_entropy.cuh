// shardlib/ops/cuda/cross_entropy.cuh — cross-entropy over rows of logits with
// its gradient, as nn::cross_entropy_loss: rows counted with CUB, one block per
// row for the row math (ops/cuda/cross_entropy.hpp), the loss summed with CUB.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"               // require
#include "shardlib/core/ledger.hpp"              // category
#include "shardlib/cuda/caching_allocator.hpp"   // caching_allocator, device_buffer
#include "shardlib/cuda/error.hpp"               // check
#include "shardlib/nn/loss.hpp"                  // cross_entropy_options, loss_reduction
#include "shardlib/ops/cuda/cross_entropy.hpp"   // row math
#include "shardlib/ops/cuda/index_report.hpp"    // index_report
#include "shardlib/ops/cuda/launch.cuh"          // block_team, row_threads, report_index, with_cub_scratch

#include <cub/device/device_reduce.cuh>
#include <cuda/std/functional>  // cuda::std::plus

#include <cuda_runtime.h>

#include <cmath>    // NAN
#include <cstddef>  // std::size_t, std::byte
#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

namespace detail {
template <class Index>
struct counts_row {
  Index ignore_index;
  __host__ __device__ int operator()(Index y) const { return y != ignore_index ? 1 : 0; }
};
struct as_double {
  __host__ __device__ double operator()(float x) const { return double(x); }
};

template <class T>
__global__ void cross_entropy_kernel(const T* logits, const std::int64_t* targets, int classes,
                                     std::int64_t ignore_index, float smoothing, bool mean, const int* counted,
                                     T* grad, float* row_loss, unsigned long long* bad_row) {
  const std::int64_t r = blockIdx.x;
  const float scale = mean && *counted > 0 ? 1.0f / float(*counted) : 1.0f;
  const auto res = cross_entropy_row(block_team{}, logits + r * classes, targets[r], classes, ignore_index, smoothing,
                                     scale, grad + r * classes);
  if (threadIdx.x == 0) {
    row_loss[r] = res.loss;
    if (res.status == row_status::bad_target) report_index(bad_row, r);
  }
}

// The mean over counted rows (NaN when none, as torch), or the sum. (A
// template, as every kernel in a header: a __global__ function cannot be inline.)
template <class L>
__global__ void cross_entropy_finish_kernel(const double* total, const int* counted, bool mean, L* loss) {
  *loss = !mean ? L(*total) : *counted > 0 ? L(*total / double(*counted)) : L(NAN);
}
}  // namespace detail

// The rows whose target is not ignore_index, into *counted on the stream. (A template, so
// that CUB's reduction kernels are compiled only where it is called: nvcc compiles the kernels
// an inline function launches into every translation unit including it, called or not.)
template <class Index>
void count_rows(const Index* targets, std::int64_t rows, std::int64_t ignore_index, int* counted, cudaStream_t stream,
                shardlib::cuda::caching_allocator& alloc) {
  detail::with_cub_scratch(
      [&](void* scratch, std::size_t& bytes) {
        return cub::DeviceReduce::TransformReduce(scratch, bytes, targets, counted, rows, ::cuda::std::plus<>{},
                                                  detail::counts_row<Index>{Index(ignore_index)}, 0, stream);
      },
      stream, alloc, "cub::DeviceReduce::TransformReduce (counting cross_entropy rows)");
}

// Cross-entropy of logits [rows, classes] against targets [rows] (class
// indices), as nn::cross_entropy_loss{options}: grad [rows, classes] gets
// dloss/dlogits and *loss (device memory) the loss, both ordered on `stream`.
// A target out of range (and not ignore_index) gets a zero gradient and its
// row is reported to bad_target; the caller reads it and throws.
template <class T>
void cross_entropy(const T* logits, const std::int64_t* targets, std::int64_t rows, int classes,
                   const nn::cross_entropy_options& options, T* grad, float* loss, index_report& bad_target,
                   cudaStream_t stream, shardlib::cuda::caching_allocator& alloc) {
  require(options.label_smoothing >= 0 && options.label_smoothing < 1,
          "ops::cuda::cross_entropy: label_smoothing must be in [0, 1), got ", options.label_smoothing);
  require(classes > 0, "ops::cuda::cross_entropy: needs at least one class");
  const bool mean = options.reduction == nn::loss_reduction::mean;
  shardlib::cuda::device_buffer<int> counted(1, category::activations, stream, alloc);
  shardlib::cuda::device_buffer<double> total(1, category::activations, stream, alloc);
  shardlib::cuda::device_buffer<float> row_loss(std::size_t(rows), category::activations, stream, alloc);
  count_rows(targets, rows, options.ignore_index, counted.data(), stream, alloc);
  if (rows > 0) {
    launch_kernel("cross_entropy", detail::cross_entropy_kernel<T>, row_blocks(rows, "cross_entropy"),
                  row_threads(classes), 0, stream, logits, targets, classes, options.ignore_index,
                  float(options.label_smoothing), mean, counted.data(), grad, row_loss.data(), bad_target.slot());
  }
  // Row losses summed in double, as the host layer does: rows can be many.
  detail::with_cub_scratch(
      [&](void* scratch, std::size_t& bytes) {
        return cub::DeviceReduce::TransformReduce(scratch, bytes, row_loss.data(), total.data(), rows,
                                                  ::cuda::std::plus<>{}, detail::as_double{}, 0.0, stream);
      },
      stream, alloc, "cub::DeviceReduce::TransformReduce (summing cross_entropy losses)");
  launch_kernel("cross_entropy_finish", detail::cross_entropy_finish_kernel<float>, 1, 1, 0, stream, total.data(),
                counted.data(), mean, loss);
}

}  // namespace shardlib::ops::cuda
