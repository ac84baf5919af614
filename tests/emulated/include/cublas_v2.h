// tests/emulated/include/cublas_v2.h — stands in for cuBLAS's header in the emulated
// tests: handles, status names, and the two products the library calls (cublasGemmEx_64
// and its strided-batched form) computed on the CPU in float64 and rounded once to the
// output type. As cuBLAS, C is not read when beta is 0 (a NaN there stays out).
// cuda_emulator::unaligned_products counts the products with unaligned rows.
#pragma once
#include "cuda_runtime.h"
#include "library_types.h"

#include <atomic>   // std::atomic
#include <bit>      // std::bit_cast
#include <cmath>    // std::isnan
#include <cstdint>  // std::int64_t, std::uint16_t, std::uint32_t, std::uintptr_t

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
inline const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "an unknown cublasStatus_t";
}
inline const char* cublasGetStatusString(cublasStatus_t s) { return cublasGetStatusName(s); }

enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };

struct cublasContext {};
using cublasHandle_t = cublasContext*;
inline cublasStatus_t cublasCreate(cublasHandle_t* h) {
  *h = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasDestroy(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }

namespace cuda_emulator {
inline double load_element(const void* p, cudaDataType_t t, std::int64_t i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  const std::uint16_t bits = static_cast<const std::uint16_t*>(p)[i];
  if (t == CUDA_R_16BF) return std::bit_cast<float>(std::uint32_t(bits) << 16);
  return double(std::bit_cast<_Float16>(bits));
}
inline void store_element(void* p, cudaDataType_t t, std::int64_t i, double x) {
  const float f = float(x);
  if (t == CUDA_R_32F) {
    static_cast<float*>(p)[i] = f;
  } else if (t == CUDA_R_16BF) {  // round to nearest even, NaN kept NaN
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    static_cast<std::uint16_t*>(p)[i] =
        std::isnan(f) ? std::uint16_t(0x7FC0) : std::uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  } else {
    static_cast<std::uint16_t*>(p)[i] = std::bit_cast<std::uint16_t>(_Float16(f));
  }
}
// Products cuBLAS would run on its slower kernels: an operand whose rows do not all
// start on 16-byte boundaries (pointer or leading dimension), for tests of gemm_staged.
inline std::atomic<std::int64_t> unaligned_products = 0;
inline bool rows_aligned(const void* p, cudaDataType_t t, std::int64_t ld) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && ld * (t == CUDA_R_32F ? 4 : 2) % 16 == 0;
}
// Column-major C[m, n] = alpha op(A) op(B) + beta C, with op(A) [m, k] and op(B) [k, n].
inline void gemm(cublasOperation_t ta, cublasOperation_t tb, std::int64_t m, std::int64_t n, std::int64_t k,
                 float alpha, const void* a, cudaDataType_t at, std::int64_t lda, const void* b, cudaDataType_t bt,
                 std::int64_t ldb, float beta, void* c, cudaDataType_t ct, std::int64_t ldc) {
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t i = 0; i < m; ++i) {
      double sum = 0;
      for (std::int64_t l = 0; l < k; ++l)
        sum += load_element(a, at, ta == CUBLAS_OP_N ? i + l * lda : l + i * lda) *
               load_element(b, bt, tb == CUBLAS_OP_N ? l + j * ldb : j + l * ldb);
      const double prior = beta == 0 ? 0.0 : double(beta) * load_element(c, ct, i + j * ldc);
      store_element(c, ct, i + j * ldc, double(alpha) * sum + prior);
    }
}
}  // namespace cuda_emulator

inline cublasStatus_t cublasGemmEx_64(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, std::int64_t m,
                                      std::int64_t n, std::int64_t k, const void* alpha, const void* a,
                                      cudaDataType_t at, std::int64_t lda, const void* b, cudaDataType_t bt,
                                      std::int64_t ldb, const void* beta, void* c, cudaDataType_t ct, std::int64_t ldc,
                                      cublasComputeType_t, cublasGemmAlgo_t) {
  if (!cuda_emulator::rows_aligned(a, at, lda) || !cuda_emulator::rows_aligned(b, bt, ldb) ||
      !cuda_emulator::rows_aligned(c, ct, ldc))
    ++cuda_emulator::unaligned_products;
  cuda_emulator::gemm(ta, tb, m, n, k, *static_cast<const float*>(alpha), a, at, lda, b, bt, ldb,
                      *static_cast<const float*>(beta), c, ct, ldc);
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasGemmStridedBatchedEx_64(
    cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, std::int64_t m, std::int64_t n, std::int64_t k,
    const void* alpha, const void* a, cudaDataType_t at, std::int64_t lda, std::int64_t stride_a, const void* b,
    cudaDataType_t bt, std::int64_t ldb, std::int64_t stride_b, const void* beta, void* c, cudaDataType_t ct,
    std::int64_t ldc, std::int64_t stride_c, std::int64_t batch, cublasComputeType_t, cublasGemmAlgo_t) {
  const auto at_element = [](const void* p, cudaDataType_t t, std::int64_t offset) {
    return static_cast<const char*>(p) + offset * (t == CUDA_R_32F ? 4 : 2);
  };
  for (std::int64_t i = 0; i < batch; ++i)
    cuda_emulator::gemm(ta, tb, m, n, k, *static_cast<const float*>(alpha), at_element(a, at, i * stride_a), at, lda,
                        at_element(b, bt, i * stride_b), bt, ldb, *static_cast<const float*>(beta),
                        const_cast<char*>(at_element(c, ct, i * stride_c)), ct, ldc);
  return CUBLAS_STATUS_SUCCESS;
}
