// shardlib/ops/cuda/gemm.hpp — matrix products on the device through cuBLAS,
// with the row-major signature of the host ops::gemm (ops/gemm.hpp).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"  // bfloat16, half
#include "shardlib/cuda/blas.hpp"     // blas
#include "shardlib/cuda/error.hpp"    // check
#include "shardlib/ops/gemm.hpp"      // trans

#include <cublas_v2.h>
#include <library_types.h>  // cudaDataType_t

#include <algorithm>    // std::max
#include <cstdint>      // std::int64_t
#include <type_traits>  // std::is_same_v

namespace shardlib::ops::cuda {

// Element types cuBLAS multiplies here: float, and bfloat16 and half inputs,
// all accumulated in fp32 (CUBLAS_COMPUTE_32F; no TF32 unless asked, so fp32
// products match the host to float rounding). shardlib's bfloat16 and half
// are bit-compatible with CUDA's __nv_bfloat16 and __half.
template <class T>
concept GemmElement = std::is_same_v<T, float> || std::is_same_v<T, bfloat16> || std::is_same_v<T, half>;

enum class fp32_math { exact, tf32 };  // tf32: tensor cores for fp32 inputs, ~1e-3 relative error

namespace detail {
template <class T>
constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
  else if constexpr (std::is_same_v<T, bfloat16>) return CUDA_R_16BF;
  else return CUDA_R_16F;
}
constexpr cublasOperation_t op(trans t) { return t == trans::no ? CUBLAS_OP_N : CUBLAS_OP_T; }
template <class T>
constexpr cublasComputeType_t compute(fp32_math math) {
  return std::is_same_v<T, float> && math == fp32_math::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}
// With k == 0 cuBLAS only scales C but still wants leading dimensions >= 1.
constexpr std::int64_t ld(std::int64_t v) { return std::max<std::int64_t>(v, 1); }
}  // namespace detail

// C[M, N] = alpha * op(A) * op(B) + beta * C, row-major with leading
// dimensions lda, ldb, ldc, as ops::gemm; on `stream`. beta == 0 overwrites C
// without reading it (NaN there does not propagate).
//
// Row-major C is column-major C^T = op(B)^T op(A)^T, so cuBLAS gets B before A
// and N before M; no data moves.
template <GemmElement T>
void gemm(const shardlib::cuda::blas& handle, cudaStream_t stream, trans ta, trans tb, std::int64_t m, std::int64_t n,
          std::int64_t k, float alpha, const T* a, std::int64_t lda, const T* b, std::int64_t ldb, float beta, T* c,
          std::int64_t ldc, fp32_math math = fp32_math::exact) {
  if (m == 0 || n == 0) return;
  constexpr cudaDataType_t t = detail::cuda_type<T>();
  shardlib::cuda::check(cublasGemmEx_64(handle.on(stream), detail::op(tb), detail::op(ta), n, m, k, &alpha, b, t,
                                        detail::ld(ldb), a, t, detail::ld(lda), &beta, c, t, ldc,
                                        detail::compute<T>(math), CUBLAS_GEMM_DEFAULT),
                        "cublasGemmEx [", m, " x ", n, " x ", k, "]");
}

// `batch` products C_i = alpha op(A_i) op(B_i) + beta C_i with A_i = a + i
// stride_a (likewise B_i, C_i): attention's per-head products in one call.
template <GemmElement T>
void gemm_strided_batched(const shardlib::cuda::blas& handle, cudaStream_t stream, trans ta, trans tb, std::int64_t m,
                          std::int64_t n, std::int64_t k, float alpha, const T* a, std::int64_t lda,
                          std::int64_t stride_a, const T* b, std::int64_t ldb, std::int64_t stride_b, float beta, T* c,
                          std::int64_t ldc, std::int64_t stride_c, std::int64_t batch,
                          fp32_math math = fp32_math::exact) {
  if (m == 0 || n == 0 || batch == 0) return;
  constexpr cudaDataType_t t = detail::cuda_type<T>();
  shardlib::cuda::check(
      cublasGemmStridedBatchedEx_64(handle.on(stream), detail::op(tb), detail::op(ta), n, m, k, &alpha, b, t,
                                    detail::ld(ldb), stride_b, a, t, detail::ld(lda), stride_a, &beta, c, t, ldc,
                                    stride_c, batch, detail::compute<T>(math), CUBLAS_GEMM_DEFAULT),
      "cublasGemmStridedBatchedEx [", batch, " x ", m, " x ", n, " x ", k, "]");
}

}  // namespace shardlib::ops::cuda
