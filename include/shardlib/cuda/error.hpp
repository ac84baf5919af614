// shardlib/cuda/error.hpp — cuda_error, and the checks every CUDA runtime call,
// kernel launch and cuBLAS call goes through.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // error, cat

#include <cublas_v2.h>     // cublasStatus_t, cublasGetStatusName
#include <cuda_runtime.h>  // cudaError_t, cudaGetErrorName

#include <string>   // std::string
#include <utility>  // std::move

namespace shardlib {

// A CUDA runtime call, a kernel launch or a cuBLAS call failed. The message
// names the call, the device and CUDA's own description; code() is the
// cudaError_t (or cublasStatus_t) value.
class cuda_error : public error {
 public:
  cuda_error(std::string what, int code, int device) : error(std::move(what)), code_(code), device_(device) {}
  int code() const noexcept { return code_; }
  int device() const noexcept { return device_; }  // -1 when no device was current

 private:
  int code_;
  int device_;
};

namespace cuda {

// The calling thread's current device, or -1 when there is none (no GPU).
inline int current_device() noexcept {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    (void)cudaGetLastError();  // do not leave the failure for the next check to find
    return -1;
  }
  return d;
}

namespace detail {
template <class... Where>
[[noreturn]] void throw_cuda(cudaError_t e, const Where&... where) {
  (void)cudaGetLastError();  // a non-sticky error must not resurface at the next check
  const int device = current_device();
  throw cuda_error(cat(where..., " failed on device ", device, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                       ")"),
                   int(e), device);
}
}  // namespace detail

// check(cudaMalloc(&p, n), "cudaMalloc(", n, " bytes)"): the pieces name the
// call and are only assembled when it failed.
template <class... Where>
void check(cudaError_t e, const Where&... where) {
  if (e != cudaSuccess) [[unlikely]]
    detail::throw_cuda(e, where...);
}

template <class... Where>
void check(cublasStatus_t s, const Where&... where) {
  if (s != CUBLAS_STATUS_SUCCESS) [[unlikely]] {
    const int device = current_device();
    throw cuda_error(cat(where..., " failed on device ", device, ": ", cublasGetStatusName(s), " (",
                         cublasGetStatusString(s), ")"),
                     int(s), device);
  }
}

}  // namespace cuda
}  // namespace shardlib
