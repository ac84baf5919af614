// tests/emulated/include/cublasLt.h — stands in for cuBLASLt's header in the emulated
// tests: descriptors that hold nothing, and a heuristic that finds no algorithm, so
// ops::cuda::gemm_lt returns false and the layers take their unfused path (cuBLAS and
// the library's kernels), as on a GPU whose cuBLASLt refuses an epilogue. The fused
// epilogues themselves are tested on a GPU only (test_cuda_gemm).
#pragma once
#include "cublas_v2.h"

#include <cstddef>  // std::size_t
#include <cstdint>  // std::uint64_t

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
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 10,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 11,
};
enum cublasLtMatmulPreferenceAttributes_t {
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
};

struct cublasLtContext {};
struct cublasLtMatmulDescOpaque_t {};
struct cublasLtMatrixLayoutOpaque_t {};
struct cublasLtMatmulPreferenceOpaque_t {};
using cublasLtHandle_t = cublasLtContext*;
using cublasLtMatmulDesc_t = cublasLtMatmulDescOpaque_t*;
using cublasLtMatrixLayout_t = cublasLtMatrixLayoutOpaque_t*;
using cublasLtMatmulPreference_t = cublasLtMatmulPreferenceOpaque_t*;
struct cublasLtMatmulAlgo_t {
  std::uint64_t data[8];
};
struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  std::size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
};

namespace cuda_emulator {
template <class T>
cublasStatus_t make(T** p) {
  *p = new T;
  return CUBLAS_STATUS_SUCCESS;
}
template <class T>
cublasStatus_t destroy(T* p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
}  // namespace cuda_emulator

inline cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) { return cuda_emulator::make(h); }
inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { return cuda_emulator::destroy(h); }
inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t, cudaDataType_t) {
  return cuda_emulator::make(d);
}
inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { return cuda_emulator::destroy(d); }
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void*,
                                                     std::size_t) {
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t, std::uint64_t,
                                                 std::uint64_t, std::int64_t) {
  return cuda_emulator::make(l);
}
inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { return cuda_emulator::destroy(l); }
inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) { return cuda_emulator::make(p); }
inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  return cuda_emulator::destroy(p);
}
inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t,
                                                           cublasLtMatmulPreferenceAttributes_t, const void*,
                                                           std::size_t) {
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t,
                                                     cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                                     cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int,
                                                     cublasLtMatmulHeuristicResult_t*, int* found) {
  *found = 0;
  return CUBLAS_STATUS_SUCCESS;
}
// Never reached: no algorithm is ever found.
inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*, const void*,
                                     cublasLtMatrixLayout_t, const void*, cublasLtMatrixLayout_t, const void*,
                                     const void*, cublasLtMatrixLayout_t, void*, cublasLtMatrixLayout_t,
                                     const cublasLtMatmulAlgo_t*, void*, std::size_t, cudaStream_t) {
  return CUBLAS_STATUS_NOT_SUPPORTED;
}
