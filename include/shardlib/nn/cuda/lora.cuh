// shardlib/nn/cuda/lora.cuh — a device Linear's LoRA adapter: its products on the
// current stream (nn/lora_adapter.hpp holds the adapter, nn/cuda/linear.cuh includes this).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/cuda/device.cuh"        // device_gemm
#include "shardlib/nn/cuda/dropout.cuh"       // the adapter's Dropout<T, cuda_space>
#include "shardlib/nn/lora_adapter.hpp"
#include "shardlib/ops/cuda/elementwise.cuh"  // fill, add

#include <cstdint>  // std::int64_t
#include <span>     // std::span

namespace shardlib::nn::detail {

template <>
struct lora_product<cuda_space> {
  template <class T>
  static void run(ops::trans ta, ops::trans tb, std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
                  const T* a, std::int64_t lda, const T* b, std::int64_t ldb, double beta, T* c, std::int64_t ldc) {
    device_gemm(ta, tb, m, n, k, float(alpha), a, lda, b, ldb, float(beta), c, ldc);
  }
  template <class T>
  static void zero(T* x, std::int64_t n) {
    ops::cuda::fill<T>(std::span<T>(x, std::size_t(n)), T(0), cuda::current_stream());
  }
  template <class T>
  static void add(T* y, const T* x, std::int64_t n) {
    const std::span<T> out(y, std::size_t(n));
    ops::cuda::add<T>(out, std::span<const T>(x, std::size_t(n)), out, cuda::current_stream());
  }
};

}  // namespace shardlib::nn::detail
