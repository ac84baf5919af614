// shardlib/ops/cuda/gemm.hpp — matrix products on the device through cuBLAS,
// with the row-major signature of the host ops::gemm (ops/gemm.hpp).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"            // bfloat16, half
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/blas.hpp"               // blas
#include "shardlib/cuda/caching_allocator.hpp"  // caching_allocator, device_buffer
#include "shardlib/cuda/error.hpp"              // check
#include "shardlib/ops/gemm.hpp"                // trans

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <library_types.h>  // cudaDataType_t

#include <algorithm>    // std::max, std::min
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t, std::uintptr_t
#include <type_traits>  // std::is_same_v
#include <utility>      // std::move

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

// --- Rows that do not start on 16-byte boundaries ----------------------------------------------
// cuBLAS's fast kernels move whole 16-byte pieces of rows (TMA on sm_90, 16-byte
// cp.async and stores before it); a matrix whose rows do not all start on 16-byte
// boundaries (its pointer, or a leading dimension that is not a multiple of 16 bytes,
// as GPT-2's vocabulary of 50257 bf16 logits) sends the whole product to kernels that
// move an element at a time. gemm_staged copies each such operand (and C) into scratch
// rows padded to 16 bytes, one cudaMemcpy2DAsync pass at copy bandwidth, and C back
// after. Only where every dimension is at least staging_min_dim: each staged element
// then takes part in 64 or more multiply-adds, so the copy is small beside the product
// (a rule of thumb; bench_cuda's "LM head" rows time the two paths).
inline constexpr std::int64_t staging_min_dim = 64;

struct staged_operands {
  bool a = false, b = false, c = false;
  bool any() const { return a || b || c; }
};

// An operand with its rows 16 bytes apart: the operand itself, or an aligned copy.
template <GemmElement T>
struct aligned_operand {
  const T* data;
  std::int64_t ld;
  shardlib::cuda::device_buffer<T> copy;  // holds data where it is a copy
};

namespace detail {
template <class T>
bool rows_aligned(const T* p, std::int64_t ld) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && (ld * std::int64_t(sizeof(T))) % 16 == 0;
}
// The leading dimension of cols elements padded to 16 bytes.
template <class T>
std::int64_t aligned_pitch(std::int64_t cols) {
  constexpr std::int64_t step = 16 / std::int64_t(sizeof(T));
  return (cols + step - 1) / step * step;
}
// rows x cols elements from `from` (rows ld_from apart) to `to` (ld_to apart), on `stream`.
template <class T>
void copy_rows(T* to, std::int64_t ld_to, const T* from, std::int64_t ld_from, std::int64_t rows, std::int64_t cols,
               cudaStream_t stream) {
  constexpr std::size_t e = sizeof(T);
  shardlib::cuda::check(cudaMemcpy2DAsync(to, std::size_t(ld_to) * e, from, std::size_t(ld_from) * e,
                                          std::size_t(cols) * e, std::size_t(rows), cudaMemcpyDeviceToDevice, stream),
                        "cudaMemcpy2DAsync (gemm_staged: ", rows, " rows of ", cols, ")");
}
// rows x cols of p (rows ld apart) copied to scratch rows 16 bytes apart, booked as
// activations (a transient: 823 MB for GPT-2's logits of 8192 tokens).
template <class T>
aligned_operand<T> aligned_copy(const T* p, std::int64_t ld, std::int64_t rows, std::int64_t cols, cudaStream_t stream,
                                shardlib::cuda::caching_allocator& alloc) {
  const std::int64_t pitch = aligned_pitch<T>(cols);
  shardlib::cuda::device_buffer<T> copy(std::size_t(rows * pitch), category::activations, stream, alloc);
  copy_rows(copy.data(), pitch, p, ld, rows, cols, stream);
  T* const data = copy.data();
  return {data, pitch, std::move(copy)};
}
}  // namespace detail

// The operands of gemm's call with these arguments that gemm_staged copies.
template <GemmElement T>
staged_operands staged_for(std::int64_t m, std::int64_t n, std::int64_t k, const T* a, std::int64_t lda, const T* b,
                           std::int64_t ldb, const T* c, std::int64_t ldc) {
  if (std::min({m, n, k}) < staging_min_dim) return {};
  return {!detail::rows_aligned(a, lda), !detail::rows_aligned(b, ldb), !detail::rows_aligned(c, ldc)};
}

// A rows x cols operand of several products whose third dimension is `other` (a
// backward's dy: dW += dy^T x and dx = dy W), copied once where gemm_staged would
// copy it for each product, else itself.
template <GemmElement T>
aligned_operand<T> operand_for_products(const T* p, std::int64_t ld, std::int64_t rows, std::int64_t cols,
                                        std::int64_t other, cudaStream_t stream,
                                        shardlib::cuda::caching_allocator& alloc) {
  if (std::min({rows, cols, other}) < staging_min_dim || detail::rows_aligned(p, ld)) return {p, ld, {}};
  return detail::aligned_copy(p, ld, rows, cols, stream, alloc);
}

// gemm, with the operands staged_for names copied to rows 16 bytes apart first (C
// only where beta != 0 reads it) and C copied back after; the scratch comes from
// `alloc` on `stream`, booked as activations. The same values reach cuBLAS, aligned;
// it may pick another kernel, so the last bits may differ from gemm's.
template <GemmElement T>
void gemm_staged(const shardlib::cuda::blas& handle, cudaStream_t stream, shardlib::cuda::caching_allocator& alloc,
                 trans ta, trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const T* a,
                 std::int64_t lda, const T* b, std::int64_t ldb, float beta, T* c, std::int64_t ldc,
                 fp32_math math = fp32_math::exact) {
  const staged_operands s = staged_for(m, n, k, a, lda, b, ldb, c, ldc);
  if (!s.any()) return gemm(handle, stream, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, math);
  const bool at = ta == trans::yes, bt = tb == trans::yes;
  const aligned_operand<T> sa = s.a ? detail::aligned_copy(a, lda, at ? k : m, at ? m : k, stream, alloc)
                                    : aligned_operand<T>{a, lda, {}};
  const aligned_operand<T> sb = s.b ? detail::aligned_copy(b, ldb, bt ? n : k, bt ? k : n, stream, alloc)
                                    : aligned_operand<T>{b, ldb, {}};
  shardlib::cuda::device_buffer<T> sc;
  T* pc = c;
  std::int64_t lc = ldc;
  if (s.c) {
    lc = detail::aligned_pitch<T>(n);
    sc = shardlib::cuda::device_buffer<T>(std::size_t(m * lc), category::activations, stream, alloc);
    pc = sc.data();
    if (beta != 0.0f) detail::copy_rows(pc, lc, c, ldc, m, n, stream);
  }
  gemm(handle, stream, ta, tb, m, n, k, alpha, sa.data, sa.ld, sb.data, sb.ld, beta, pc, lc, math);
  if (s.c) detail::copy_rows(c, ldc, pc, lc, m, n, stream);
}

}  // namespace shardlib::ops::cuda
