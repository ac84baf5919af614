// shardlib/nn/cuda/device.cuh — what the device layers share: products on the
// thread's current stream, a backward's dy aligned once for them, and
// parameter-gradient column sums.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/cuda/current.hpp"            // current_stream, current_blas
#include "shardlib/cuda/caching_allocator.hpp"  // device_allocator
#include "shardlib/ops/cuda/gemm.hpp"           // gemm_staged, gemm_strided_batched
#include "shardlib/ops/cuda/reduce.cuh"         // add_column_sums

#include <cuda_runtime.h>

#include <cstdint>  // std::int64_t

namespace shardlib::nn::detail {

// ops::cuda::gemm on the current stream (row-major, as ops::gemm), rows not on
// 16-byte boundaries staged (gemm_staged: a vocabulary of 50257 logits).
template <class T>
void device_gemm(ops::trans ta, ops::trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const T* a,
                 std::int64_t lda, const T* b, std::int64_t ldb, float beta, T* c, std::int64_t ldc) {
  ops::cuda::gemm_staged(cuda::current_blas(), cuda::current_stream(), cuda::device_allocator(cuda::current_device()),
                         ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// A backward's dy [rows, cols] for its two products (dW += dy^T x, dx = dy W, third
// dimension `other`): copied once to rows 16 bytes apart where each would stage it
// (ops::cuda::operand_for_products), on the current stream.
template <class T>
ops::cuda::aligned_operand<T> gradient_operand(const T* dy, std::int64_t rows, std::int64_t cols,
                                               std::int64_t other) {
  return ops::cuda::operand_for_products(dy, cols, rows, cols, other, cuda::current_stream(),
                                         cuda::device_allocator(cuda::current_device()));
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

// g[c] += sum over r of d[r, c] for a [rows, cols] row-major d on the device
// (a bias gradient), on the current stream, summed in fp32.
template <class T>
void add_column_sums_device(const T* d, std::int64_t rows, std::int64_t cols, T* g) {
  ops::cuda::add_column_sums(d, rows, cols, g, cuda::current_stream(), cuda::device_allocator(cuda::current_device()));
}

}  // namespace shardlib::nn::detail
