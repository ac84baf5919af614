// shardlib/cuda/blas.hpp — blas: an owned cuBLAS handle for one device.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/cuda/error.hpp"   // check
#include "shardlib/cuda/stream.hpp"  // device_guard

#include <cublas_v2.h>

#include <utility>  // std::exchange

namespace shardlib::cuda {

// A cuBLAS handle is tied to the device current when it was made and is not
// to be used by two threads at once: one per device and thread. The stream is
// not part of it; every ops::cuda call names its stream.
class blas {
 public:
  explicit blas(int device) : device_(device) {
    device_guard g(device);
    check(cublasCreate(&h_), "cublasCreate");
  }
  blas(blas&& o) noexcept : h_(std::exchange(o.h_, nullptr)), device_(o.device_) {}
  blas& operator=(blas&& o) noexcept {
    std::swap(h_, o.h_);
    std::swap(device_, o.device_);
    return *this;
  }
  blas(const blas&) = delete;
  blas& operator=(const blas&) = delete;
  ~blas() {
    if (h_) (void)cublasDestroy(h_);
  }

  cublasHandle_t get() const { return h_; }
  int device() const { return device_; }

  // The handle for work on `stream`.
  cublasHandle_t on(cudaStream_t stream) const {
    check(cublasSetStream(h_, stream), "cublasSetStream");
    return h_;
  }

 private:
  cublasHandle_t h_ = nullptr;
  int device_ = 0;
};

}  // namespace shardlib::cuda
