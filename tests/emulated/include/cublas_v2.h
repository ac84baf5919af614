// tests/emulated/include/cublas_v2.h — stands in for cuBLAS's header in the emulated
// tests: handles and status names only (what shardlib/cuda/error.hpp and blas.hpp
// name), no product: the emulated tests run no cuBLAS call.
#pragma once
#include "cuda_runtime.h"

enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_INITIALIZED = 1 };
inline const char* cublasGetStatusName(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_NOT_INITIALIZED";
}
inline const char* cublasGetStatusString(cublasStatus_t s) { return cublasGetStatusName(s); }

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
