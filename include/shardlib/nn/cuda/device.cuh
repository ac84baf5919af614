// shardlib/nn/cuda/device.cuh — what the device layers share: products on the
// thread's current stream and parameter-gradient column sums.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream, current_blas
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/ops/cuda/elementwise.cuh"  // fill
#include "shardlib/ops/cuda/gemm.hpp"         // gemm, gemm_strided_batched

#include <cuda_runtime.h>

#include <cstdint>  // std::int64_t
#include <span>     // std::span

namespace shardlib::nn::detail {

// ops::cuda::gemm on the current stream (row-major, as ops::gemm).
template <class T>
void device_gemm(ops::trans ta, ops::trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const T* a,
                 std::int64_t lda, const T* b, std::int64_t ldb, float beta, T* c, std::int64_t ldc) {
  ops::cuda::gemm(cuda::current_blas(), cuda::current_stream(), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// ops::cuda::gemm_strided_batched on the current stream.
template <class T>
void device_gemm_batched(ops::trans ta, ops::trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                         const T* a, std::int64_t lda, std::int64_t stride_a, const T* b, std::int64_t ldb,
                         std::int64_t stride_b, float beta, T* c, std::int64_t ldc, std::int64_t stride_c,
                         std::int64_t batch) {
  ops::cuda::gemm_strided_batched(cuda::current_blas(), cuda::current_stream(), ta, tb, m, n, k, alpha, a, lda, stride_a, b,
                                  ldb, stride_b, beta, c, ldc, stride_c, batch);
}

// g[c] += sum over r of d[r, c] for a [rows, cols] row-major d on the device:
// d^T times a vector of ones, accumulated in fp32 by cuBLAS and added to g (beta 1).
template <class T>
void add_column_sums_device(const T* d, std::int64_t rows, std::int64_t cols, T* g) {
  if (rows == 0) return;
  Tensor<T, cuda_space> ones(Shape{rows});
  ops::cuda::fill(ones.span(), T(1.0f), cuda::current_stream());
  device_gemm(ops::trans::yes, ops::trans::no, cols, 1, rows, 1.0f, d, cols, ones.data(), 1, 1.0f, g, 1);
}

}  // namespace shardlib::nn::detail
