// shardlib/ops/cuda/gemm_lt.hpp — matrix products with a fused epilogue (bias,
// ReLU, GELU, their gradients, bias gradients) through cuBLASLt, with the
// row-major signature of ops::cuda::gemm (ops/cuda/gemm.hpp).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"      // require
#include "shardlib/cuda/blas_lt.hpp"    // blas_lt, lt_problem, lt_choice, lt_workspace
#include "shardlib/cuda/error.hpp"      // check
#include "shardlib/ops/cuda/gemm.hpp"   // GemmElement, fp32_math, detail::cuda_type, op, compute
#include "shardlib/ops/gemm.hpp"        // trans

#include <cublasLt.h>

#include <algorithm>  // std::min
#include <cstdint>    // std::int64_t, std::uint32_t, std::uint64_t, std::uintptr_t

namespace shardlib::ops::cuda {

// What cuBLASLt applies to P = alpha op(A) op(B) + beta C (+ bias) before it
// writes C[M, N], in row-major terms. GELU here is cuBLASLt's: the tanh
// approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), PyTorch's
// gelu(approximate="tanh") and nn::gelu_approx::tanh, never the erf form
// (cuBLASLt's documentation says only "GELU"; the tanh form is what its
// results match, see tests/cuda/test_cuda_gemm.cu). Bias vectors, GELU inputs
// and bias gradients have C's element type (cuBLASLt's rule outside int8 and fp8).
enum class epilogue {
  none,           // C = P
  bias,           // C = P + bias[j] on every row
  relu_bias,      // C = relu(P + bias); cuBLASLt's ReLU turns NaN into 0 (nn::relu keeps it)
  relu_aux_bias,  // as relu_bias, and mask bit (i, j) set where P + bias >= 0
  gelu_bias,      // C = gelu_tanh(P + bias)
  gelu_aux_bias,  // as gelu_bias, and aux[i, j] = P + bias (the GELU input, for backward)
  drelu,          // C = P where mask bit (i, j) is set, else 0
  drelu_bgrad,    // as drelu, and bias_grad[j] = sum over i of C[i, j]
  dgelu,          // C = P gelu_tanh'(aux[i, j])
  dgelu_bgrad,    // as dgelu, and bias_grad[j] = sum over i of C[i, j]
  bgrad_a,        // C = P, and bias_grad[i] = sum over p of op(A)[i, p]; needs ta == trans::yes (cuBLASLt's BGRADB)
  bgrad_b,        // C = P, and bias_grad[j] = sum over p of op(B)[p, j]; needs tb == trans::no (cuBLASLt's BGRADA)
};

// The epilogue and its vectors. Bias gradients are written, not added to, and
// not scaled by alpha. aux and mask are [M, aux_ld] row-major: aux_ld >= N, a
// multiple of 8 elements for aux (gelu_aux_ld) and of 128 bits for the ReLU
// mask (relu_mask_ld, relu_mask_bytes); pointers from the caching allocator
// have every alignment cuBLASLt asks for.
template <class T>
struct epilogue_args {
  epilogue kind = epilogue::none;
  const T* bias = nullptr;   // [N]: bias, relu_bias, relu_aux_bias, gelu_bias, gelu_aux_bias
  T* bias_grad = nullptr;    // [N]: drelu_bgrad, dgelu_bgrad, bgrad_b; [M]: bgrad_a
  T* aux = nullptr;          // GELU input: written by gelu_aux_bias, read by dgelu, dgelu_bgrad
  void* mask = nullptr;      // ReLU bit mask: written by relu_aux_bias, read by drelu, drelu_bgrad
  std::int64_t aux_ld = 0;   // elements (aux) or bits (mask) from one row of C's to the next
};

constexpr std::int64_t gelu_aux_ld(std::int64_t n) { return (n + 7) / 8 * 8; }
constexpr std::int64_t relu_mask_ld(std::int64_t n) { return (n + 127) / 128 * 128; }
constexpr std::int64_t relu_mask_bytes(std::int64_t m, std::int64_t n) { return m * relu_mask_ld(n) / 8; }

namespace detail {

constexpr cublasLtEpilogue_t lt_epilogue(epilogue e) {
  switch (e) {
    case epilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
    case epilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case epilogue::relu_bias: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case epilogue::relu_aux_bias: return CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
    case epilogue::gelu_bias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case epilogue::gelu_aux_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case epilogue::drelu: return CUBLASLT_EPILOGUE_DRELU;
    case epilogue::drelu_bgrad: return CUBLASLT_EPILOGUE_DRELU_BGRAD;
    case epilogue::dgelu: return CUBLASLT_EPILOGUE_DGELU;
    case epilogue::dgelu_bgrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case epilogue::bgrad_a: return CUBLASLT_EPILOGUE_BGRADB;  // cuBLASLt's B is the row-major A (see gemm_lt)
    case epilogue::bgrad_b: return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}
constexpr bool reads_bias(epilogue e) {
  return e == epilogue::bias || e == epilogue::relu_bias || e == epilogue::relu_aux_bias || e == epilogue::gelu_bias ||
         e == epilogue::gelu_aux_bias;
}
constexpr bool writes_bias_grad(epilogue e) {
  return e == epilogue::drelu_bgrad || e == epilogue::dgelu_bgrad || e == epilogue::bgrad_a || e == epilogue::bgrad_b;
}
constexpr bool uses_aux(epilogue e) {
  return e == epilogue::gelu_aux_bias || e == epilogue::dgelu || e == epilogue::dgelu_bgrad;
}
constexpr bool uses_mask(epilogue e) {
  return e == epilogue::relu_aux_bias || e == epilogue::drelu || e == epilogue::drelu_bgrad;
}
constexpr const char* name(epilogue e) {
  constexpr const char* names[] = {"none",  "bias",        "relu_bias", "relu_aux_bias", "gelu_bias", "gelu_aux_bias",
                                   "drelu", "drelu_bgrad", "dgelu",     "dgelu_bgrad",   "bgrad_a",   "bgrad_b"};
  return names[int(e)];
}

// The alignment cuBLASLt may assume of p: the largest power of two dividing
// its address, up to the 256 bytes it assumes by default.
inline std::int64_t alignment(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return a == 0 ? 256 : std::int64_t(std::min<std::uintptr_t>(a & (~a + 1), 256));
}

// Owned cuBLASLt descriptors.
struct lt_matmul_desc {
  cublasLtMatmulDesc_t d = nullptr;
  explicit lt_matmul_desc(cublasComputeType_t compute) {
    shardlib::cuda::check(cublasLtMatmulDescCreate(&d, compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
  }
  ~lt_matmul_desc() { (void)cublasLtMatmulDescDestroy(d); }
  lt_matmul_desc(const lt_matmul_desc&) = delete;
  lt_matmul_desc& operator=(const lt_matmul_desc&) = delete;
  template <class V>
  void set(cublasLtMatmulDescAttributes_t a, const V& v) {
    shardlib::cuda::check(cublasLtMatmulDescSetAttribute(d, a, &v, sizeof v), "cublasLtMatmulDescSetAttribute(",
                          int(a), ")");
  }
};
struct lt_layout {
  cublasLtMatrixLayout_t l = nullptr;
  lt_layout(cudaDataType_t t, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    shardlib::cuda::check(cublasLtMatrixLayoutCreate(&l, t, std::uint64_t(rows), std::uint64_t(cols), ld),
                          "cublasLtMatrixLayoutCreate [", rows, " x ", cols, ", ld ", ld, "]");
  }
  ~lt_layout() { (void)cublasLtMatrixLayoutDestroy(l); }
  lt_layout(const lt_layout&) = delete;
  lt_layout& operator=(const lt_layout&) = delete;
};
struct lt_preference {
  cublasLtMatmulPreference_t p = nullptr;
  lt_preference() { shardlib::cuda::check(cublasLtMatmulPreferenceCreate(&p), "cublasLtMatmulPreferenceCreate"); }
  ~lt_preference() { (void)cublasLtMatmulPreferenceDestroy(p); }
  lt_preference(const lt_preference&) = delete;
  lt_preference& operator=(const lt_preference&) = delete;
  template <class V>
  void set(cublasLtMatmulPreferenceAttributes_t a, V v) {
    shardlib::cuda::check(cublasLtMatmulPreferenceSetAttribute(p, a, &v, sizeof v),
                          "cublasLtMatmulPreferenceSetAttribute(", int(a), ")");
  }
};

template <class T>
void check_epilogue(trans ta, trans tb, std::int64_t n, const epilogue_args<T>& e) {
  const char* what = name(e.kind);
  require(!reads_bias(e.kind) || e.bias, "ops::cuda::gemm_lt: epilogue ", what, " needs a bias");
  require(!writes_bias_grad(e.kind) || e.bias_grad, "ops::cuda::gemm_lt: epilogue ", what, " needs bias_grad");
  require(!uses_aux(e.kind) || (e.aux && e.aux_ld >= n && e.aux_ld % 8 == 0), "ops::cuda::gemm_lt: epilogue ", what,
          " needs aux with aux_ld >= N (", n, ") and a multiple of 8, got aux_ld ", e.aux_ld);
  require(!uses_mask(e.kind) || (e.mask && e.aux_ld >= n && e.aux_ld % 128 == 0), "ops::cuda::gemm_lt: epilogue ",
          what, " needs a mask with aux_ld >= N (", n, ") and a multiple of 128 bits, got aux_ld ", e.aux_ld);
  require(e.kind != epilogue::bgrad_a || ta == trans::yes,
          "ops::cuda::gemm_lt: bgrad_a needs op(A) = A^T (cuBLASLt's BGRADB supports no other)");
  require(e.kind != epilogue::bgrad_b || tb == trans::no,
          "ops::cuda::gemm_lt: bgrad_b needs op(B) = B (cuBLASLt's BGRADA supports no other)");
}

}  // namespace detail

// C[M, N] = epilogue(alpha op(A) op(B) + beta C), row-major with leading
// dimensions lda, ldb, ldc as ops::cuda::gemm, on `stream`; beta == 0 does not
// read C. fp32 computes in fp32 (COMPUTE_32F, no TF32 unless asked), bf16 and
// fp16 accumulate in fp32 and round once when C is written.
//
// Returns false, having done nothing, where cuBLASLt has no algorithm for this
// product and epilogue (the heuristic finds none, or cublasLtMatmul answers
// NOT_SUPPORTED to the one it found; either is kept for the problem), or M, N or
// K is 0: the caller then runs ops::cuda::gemm and the epilogue's kernels. Throws
// on arguments the epilogue cannot take.
//
// As ops::cuda::gemm, row-major C is column-major C^T = op(B)^T op(A)^T:
// cuBLASLt's A is our B and its B our A, its M our N. So the bias runs along
// our rows (cuBLASLt's "D rows" are our columns), and the row-major bgrad_a
// (sums over op(A)'s rows) is cuBLASLt's BGRADB.
template <GemmElement T>
[[nodiscard]] bool gemm_lt(const shardlib::cuda::blas_lt& handle, cudaStream_t stream, trans ta, trans tb,
                           std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const T* a, std::int64_t lda,
                           const T* b, std::int64_t ldb, float beta, T* c, std::int64_t ldc,
                           const epilogue_args<T>& e = {}, fp32_math math = fp32_math::exact) {
  detail::check_epilogue(ta, tb, n, e);
  if (m == 0 || n == 0 || k == 0) return false;
  constexpr cudaDataType_t t = detail::cuda_type<T>();
  const cublasComputeType_t compute = detail::compute<T>(math);

  detail::lt_matmul_desc desc(compute);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, detail::op(tb));
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, detail::op(ta));
  desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, std::uint32_t(detail::lt_epilogue(e.kind)));
  const void* vec = nullptr;  // the bias or bias-gradient vector
  if (detail::reads_bias(e.kind)) vec = e.bias;
  if (detail::writes_bias_grad(e.kind)) vec = e.bias_grad;
  if (vec) desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, vec);
  const void* aux = detail::uses_aux(e.kind)    ? static_cast<const void*>(e.aux)
                    : detail::uses_mask(e.kind) ? e.mask
                                                : nullptr;
  if (aux) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, e.aux_ld);
  }
  // cuBLASLt's column-major operands: A = op(B)^T is n x k, B = op(A)^T is k x m, D is n x m.
  const detail::lt_layout la(t, tb == trans::no ? n : k, tb == trans::no ? k : n, ldb);
  const detail::lt_layout lb(t, ta == trans::no ? k : m, ta == trans::no ? m : k, lda);
  const detail::lt_layout lc(t, n, m, ldc);

  const shardlib::cuda::lt_problem key{
      std::int64_t(ta), std::int64_t(tb),     m, n, k, lda, ldb, ldc, std::int64_t(t), std::int64_t(compute),
      std::int64_t(e.kind), e.aux_ld, detail::alignment(a), detail::alignment(b), detail::alignment(c),
      std::min(detail::alignment(vec), detail::alignment(aux))};
  const shardlib::cuda::lt_choice& choice = handle.choice(key, [&] {
    detail::lt_preference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t(shardlib::cuda::blas_lt::max_workspace));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, std::uint32_t(detail::alignment(b)));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, std::uint32_t(detail::alignment(a)));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, std::uint32_t(detail::alignment(c)));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, std::uint32_t(detail::alignment(c)));
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    const cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(handle.get(), desc.d, la.l, lb.l, lc.l, lc.l, pref.p, 1, &r, &found);
    shardlib::cuda::lt_choice ch;
    // The arguments passed check_epilogue: a refusal here is a combination
    // this cuBLASLt does not take (NOT_SUPPORTED, or INVALID_VALUE as it
    // answers some), so no fused algorithm; test_cuda_gemm requires one for
    // every case it runs, so a refusal on a supported GPU still shows.
    if (s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_INVALID_VALUE ||
        (s == CUBLAS_STATUS_SUCCESS && found == 0))
      return ch;
    shardlib::cuda::check(s, "cublasLtMatmulAlgoGetHeuristic [", m, " x ", n, " x ", k, ", epilogue ",
                          detail::name(e.kind), "]");
    ch.found = true;
    ch.algo = r.algo;
    ch.workspace = r.workspaceSize;
    return ch;
  });
  if (!choice.found) return false;

  const shardlib::cuda::lt_workspace ws(choice.workspace, stream);
  const cublasStatus_t s = cublasLtMatmul(handle.get(), desc.d, &alpha, b, la.l, a, lb.l, &beta, c, lc.l, c, lc.l,
                                          &choice.algo, ws.data(), ws.bytes(), stream);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED) {  // the heuristic's algorithm after all not for these arguments
    handle.refuse(key);
    return false;
  }
  shardlib::cuda::check(s, "cublasLtMatmul [", m, " x ", n, " x ", k, ", epilogue ", detail::name(e.kind), "]");
  return true;
}

}  // namespace shardlib::ops::cuda
