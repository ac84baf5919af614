// tests/emulated/include/cublasLt.h — stands in for cuBLASLt's header in the emulated
// tests: the matmul with the epilogues ops::cuda::gemm_lt asks for, summed on the CPU in
// float64 and rounded through float to D's type, in cuBLASLt's column-major terms.
// As its documentation states: D = epilogue(alpha op(A) op(B) + beta C); the bias runs
// along D's rows (one value per row, broadcast over the columns); BGRADA sums op(A) over K
// (one value per row of D), BGRADB op(B) over K (one per column); vectors and aux have D's
// type; aux leading dimensions count elements (GELU: a multiple of 8; the ReLU mask: bits,
// a multiple of 128), at least D's rows. Where it is silent, as the library assumes
// (ops/cuda/gemm_lt.hpp), so these points show on a GPU only: GELU is the tanh form (its
// aux the pre-activation); the mask holds bit (i + j ld) of D[i, j], lowest bit of each
// byte first, set where the pre-activation is >= 0; ReLU turns NaN into 0; DRELU_BGRAD and
// DGELU_BGRAD sum the epilogue's output along D's rows; BGRADA takes transa N only and
// BGRADB transb T only (NOT_SUPPORTED otherwise, which gemm_lt takes as "no algorithm").
//
// A call cuBLASLt would answer INVALID_VALUE (layouts that do not make the product, leading
// dimensions, missing vectors, aux rules) throws instead: gemm_lt would take that answer as
// "no algorithm" and run unfused, hiding the library's mistake from tests that compare
// values only. cuda_emulator::lt_refuses makes the heuristic find nothing, as a cuBLASLt
// without the epilogue would, so the callers' unfused path runs; cuda_emulator::lt_matmuls
// counts the products run.
#pragma once
#include "cublas_v2.h"

#include <atomic>
#include <cmath>    // std::tanh
#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t, std::uint8_t, std::uint32_t, std::uint64_t
#include <cstring>  // std::memcpy
#include <string>   // std::string, std::to_string
#include <vector>

enum cublasLtEpilogue_t {
  CUBLASLT_EPILOGUE_DEFAULT = 1,
  CUBLASLT_EPILOGUE_RELU_BIAS = 6,
  CUBLASLT_EPILOGUE_BIAS = 4,
  CUBLASLT_EPILOGUE_RELU_AUX_BIAS = 134,
  CUBLASLT_EPILOGUE_DRELU = 136,
  CUBLASLT_EPILOGUE_DRELU_BGRAD = 152,
  CUBLASLT_EPILOGUE_GELU_BIAS = 36,
  CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 164,
  CUBLASLT_EPILOGUE_DGELU = 192,
  CUBLASLT_EPILOGUE_DGELU_BGRAD = 208,
  CUBLASLT_EPILOGUE_BGRADA = 256,
  CUBLASLT_EPILOGUE_BGRADB = 512,
};
enum cublasLtMatmulDescAttributes_t {
  CUBLASLT_MATMUL_DESC_TRANSA = 3,
  CUBLASLT_MATMUL_DESC_TRANSB = 4,
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
};
enum cublasLtMatmulPreferenceAttributes_t {
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
};

struct cublasLtContext {};
struct cublasLtMatmulDescOpaque_t {
  cublasOperation_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
  std::int64_t aux_ld = 0;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType_t type;
  std::int64_t rows, cols, ld;
};
struct cublasLtMatmulPreferenceOpaque_t {
  std::uint64_t max_workspace = 0;
};
using cublasLtHandle_t = cublasLtContext*;
using cublasLtMatmulDesc_t = cublasLtMatmulDescOpaque_t*;
using cublasLtMatrixLayout_t = cublasLtMatrixLayoutOpaque_t*;
using cublasLtMatmulPreference_t = cublasLtMatmulPreferenceOpaque_t*;
struct cublasLtMatmulAlgo_t {
  std::uint64_t data[8];  // data[0]: the workspace bytes the algorithm needs
};
struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  std::size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
};

namespace cuda_emulator {
inline std::atomic<bool> lt_refuses = false;      // the heuristic finds no algorithm at all
inline std::atomic<bool> lt_matmul_refuses = false;  // the heuristic finds one, cublasLtMatmul refuses it
inline std::atomic<std::int64_t> lt_matmuls = 0;  // cublasLtMatmul calls that computed a product
constexpr std::uint64_t lt_workspace_bytes = std::uint64_t(1) << 20;  // what every "algorithm" asks for

template <class T>
cublasStatus_t make(T** p) {
  *p = new T{};
  return CUBLAS_STATUS_SUCCESS;
}
template <class T>
cublasStatus_t destroy(T* p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
constexpr bool lt_reads_bias(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_RELU_BIAS || e == CUBLASLT_EPILOGUE_RELU_AUX_BIAS ||
         e == CUBLASLT_EPILOGUE_GELU_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}
constexpr bool lt_writes_bgrad(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_DRELU_BGRAD || e == CUBLASLT_EPILOGUE_DGELU_BGRAD || e == CUBLASLT_EPILOGUE_BGRADA ||
         e == CUBLASLT_EPILOGUE_BGRADB;
}
constexpr bool lt_relu_mask(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_RELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DRELU || e == CUBLASLT_EPILOGUE_DRELU_BGRAD;
}
constexpr bool lt_gelu_aux(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
}
constexpr bool lt_known(cublasLtEpilogue_t e) {
  return e == CUBLASLT_EPILOGUE_DEFAULT || lt_reads_bias(e) || lt_writes_bgrad(e) || lt_relu_mask(e) || lt_gelu_aux(e);
}

// What cuBLASLt would answer to this problem: SUCCESS where it is well formed, NOT_SUPPORTED
// for a bias gradient on the other transpose; a malformed call raises (see above).
inline cublasStatus_t lt_check(const cublasLtMatmulDescOpaque_t& d, const cublasLtMatrixLayoutOpaque_t& a,
                               const cublasLtMatrixLayoutOpaque_t& b, const cublasLtMatrixLayoutOpaque_t& c,
                               const cublasLtMatrixLayoutOpaque_t& dl) {
  const std::int64_t m = dl.rows, n = dl.cols;
  const std::int64_t a_m = d.transa == CUBLAS_OP_N ? a.rows : a.cols, a_k = d.transa == CUBLAS_OP_N ? a.cols : a.rows;
  const std::int64_t b_k = d.transb == CUBLAS_OP_N ? b.rows : b.cols, b_n = d.transb == CUBLAS_OP_N ? b.cols : b.rows;
  const bool shapes = a_m == m && b_n == n && a_k == b_k && c.rows == m && c.cols == n;
  const bool lds = a.ld >= a.rows && b.ld >= b.rows && c.ld >= c.rows && dl.ld >= dl.rows;
  const bool types = a.type == b.type && c.type == dl.type && a.type == dl.type;
  const auto malformed = [&](const char* what) {
    throw emulation_error(std::string("cuBLASLt stand-in: ") + what + " (D " + std::to_string(m) + " x " +
                          std::to_string(n) + ", epilogue " + std::to_string(int(d.epilogue)) +
                          "): cuBLASLt answers CUBLAS_STATUS_INVALID_VALUE");
  };
  if (!shapes) malformed("op(A), op(B), C and D do not make the product");
  if (!lds) malformed("a leading dimension below its matrix's rows");
  if (!types) malformed("A, B, C and D of different types");
  if (!lt_known(d.epilogue)) malformed("an epilogue the stand-in does not know");
  const cublasLtEpilogue_t e = d.epilogue;
  if ((lt_reads_bias(e) || lt_writes_bgrad(e)) && !d.bias) malformed("no bias pointer");
  if (lt_relu_mask(e) && (!d.aux || d.aux_ld < m || d.aux_ld % 128 != 0))
    malformed("the ReLU mask missing, or its leading dimension below D's rows or not a multiple of 128");
  if (lt_gelu_aux(e) && (!d.aux || d.aux_ld < m || d.aux_ld % 8 != 0))
    malformed("the GELU aux missing, or its leading dimension below D's rows or not a multiple of 8");
  if (e == CUBLASLT_EPILOGUE_BGRADA && d.transa != CUBLAS_OP_N) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (e == CUBLASLT_EPILOGUE_BGRADB && d.transb != CUBLAS_OP_T) return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}

inline double gelu_tanh(double x) {
  return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
inline double dgelu_tanh(double x) {
  const double k = 0.7978845608028654, c = 0.044715, t = std::tanh(k * (x + c * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * c * x * x);
}

inline void lt_matmul(const cublasLtMatmulDescOpaque_t& d, float alpha, const void* a,
                      const cublasLtMatrixLayoutOpaque_t& al, const void* b, const cublasLtMatrixLayoutOpaque_t& bl,
                      float beta, const void* c, const cublasLtMatrixLayoutOpaque_t& cl, void* out,
                      const cublasLtMatrixLayoutOpaque_t& dl) {
  const std::int64_t m = dl.rows, n = dl.cols, k = d.transa == CUBLAS_OP_N ? al.cols : al.rows;
  const cudaDataType_t t = dl.type;
  const cublasLtEpilogue_t e = d.epilogue;
  const auto op_a = [&](std::int64_t i, std::int64_t l) {
    return load_element(a, al.type, d.transa == CUBLAS_OP_N ? i + l * al.ld : l + i * al.ld);
  };
  const auto op_b = [&](std::int64_t l, std::int64_t j) {
    return load_element(b, bl.type, d.transb == CUBLAS_OP_N ? l + j * bl.ld : j + l * bl.ld);
  };
  auto* mask = static_cast<std::uint8_t*>(d.aux);
  std::vector<double> row_sums(std::size_t(m), 0.0);
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t i = 0; i < m; ++i) {
      double sum = 0;
      for (std::int64_t l = 0; l < k; ++l) sum += op_a(i, l) * op_b(l, j);
      double z = double(alpha) * sum + (beta == 0 ? 0.0 : double(beta) * load_element(c, cl.type, i + j * cl.ld));
      if (lt_reads_bias(e)) z += load_element(d.bias, t, i);
      const std::int64_t at = i + j * d.aux_ld;
      double v = z;
      switch (e) {
        case CUBLASLT_EPILOGUE_RELU_AUX_BIAS:
          if (z >= 0) mask[at / 8] |= std::uint8_t(1u << (at % 8));
          else mask[at / 8] &= std::uint8_t(~(1u << (at % 8)));
          [[fallthrough]];
        case CUBLASLT_EPILOGUE_RELU_BIAS: v = z > 0 ? z : 0.0; break;  // NaN becomes 0
        case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: store_element(d.aux, t, at, z); [[fallthrough]];
        case CUBLASLT_EPILOGUE_GELU_BIAS: v = gelu_tanh(z); break;
        case CUBLASLT_EPILOGUE_DRELU:
        case CUBLASLT_EPILOGUE_DRELU_BGRAD: v = (mask[at / 8] >> (at % 8)) & 1 ? z : 0.0; break;
        case CUBLASLT_EPILOGUE_DGELU:
        case CUBLASLT_EPILOGUE_DGELU_BGRAD: v = z * dgelu_tanh(load_element(d.aux, t, at)); break;
        default: break;
      }
      row_sums[std::size_t(i)] += v;
      store_element(out, t, i + j * dl.ld, v);
    }
  // The bias gradients, written (not added) in D's type.
  void* bgrad = const_cast<void*>(d.bias);
  if (e == CUBLASLT_EPILOGUE_DRELU_BGRAD || e == CUBLASLT_EPILOGUE_DGELU_BGRAD)
    for (std::int64_t i = 0; i < m; ++i) store_element(bgrad, t, i, row_sums[std::size_t(i)]);
  if (e == CUBLASLT_EPILOGUE_BGRADA)
    for (std::int64_t i = 0; i < m; ++i) {
      double s = 0;
      for (std::int64_t l = 0; l < k; ++l) s += op_a(i, l);
      store_element(bgrad, t, i, s);
    }
  if (e == CUBLASLT_EPILOGUE_BGRADB)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t l = 0; l < k; ++l) s += op_b(l, j);
      store_element(bgrad, t, j, s);
    }
}
}  // namespace cuda_emulator

inline cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) { return cuda_emulator::make(h); }
inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { return cuda_emulator::destroy(h); }
inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t, cudaDataType_t) {
  return cuda_emulator::make(d);
}
inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { return cuda_emulator::destroy(d); }
// Takes the attributes gemm_lt sets, with the sizes cuBLASLt gives them.
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a,
                                                     const void* v, std::size_t bytes) {
  const auto take = [&](auto& field) {
    if (bytes != sizeof field) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&field, v, bytes);
    return CUBLAS_STATUS_SUCCESS;
  };
  switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return take(d->transa);
    case CUBLASLT_MATMUL_DESC_TRANSB: return take(d->transb);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return take(d->epilogue);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return take(d->bias);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return take(d->aux);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return take(d->aux_ld);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}
inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t t, std::uint64_t rows,
                                                 std::uint64_t cols, std::int64_t ld) {
  *l = new cublasLtMatrixLayoutOpaque_t{t, std::int64_t(rows), std::int64_t(cols), ld};
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { return cuda_emulator::destroy(l); }
inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) { return cuda_emulator::make(p); }
inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  return cuda_emulator::destroy(p);
}
inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                           cublasLtMatmulPreferenceAttributes_t a, const void* v,
                                                           std::size_t bytes) {
  if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    if (bytes != sizeof p->max_workspace) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(&p->max_workspace, v, bytes);
  } else if (bytes != sizeof(std::uint32_t)) {  // the alignments
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d,
                                                     cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                     cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dl,
                                                     cublasLtMatmulPreference_t p, int requested,
                                                     cublasLtMatmulHeuristicResult_t* r, int* found) {
  *found = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  if (const cublasStatus_t s = cuda_emulator::lt_check(*d, *a, *b, *c, *dl); s != CUBLAS_STATUS_SUCCESS) return s;
  if (cuda_emulator::lt_refuses || p->max_workspace < cuda_emulator::lt_workspace_bytes) return CUBLAS_STATUS_SUCCESS;
  *r = {};
  r->algo.data[0] = cuda_emulator::lt_workspace_bytes;
  r->workspaceSize = cuda_emulator::lt_workspace_bytes;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void* alpha, const void* a,
                                     cublasLtMatrixLayout_t al, const void* b, cublasLtMatrixLayout_t bl,
                                     const void* beta, const void* c, cublasLtMatrixLayout_t cl, void* out,
                                     cublasLtMatrixLayout_t dl, const cublasLtMatmulAlgo_t* algo, void* workspace,
                                     std::size_t workspace_bytes, cudaStream_t) {
  if (const cublasStatus_t s = cuda_emulator::lt_check(*d, *al, *bl, *cl, *dl); s != CUBLAS_STATUS_SUCCESS) return s;
  if (cuda_emulator::lt_matmul_refuses) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!algo || workspace_bytes < algo->data[0] || (workspace_bytes > 0 && !workspace))
    return CUBLAS_STATUS_INVALID_VALUE;
  cuda_emulator::lt_matmul(*d, *static_cast<const float*>(alpha), a, *al, b, *bl, *static_cast<const float*>(beta), c,
                           *cl, out, *dl);
  ++cuda_emulator::lt_matmuls;
  return CUBLAS_STATUS_SUCCESS;
}
