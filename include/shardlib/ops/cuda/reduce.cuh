// shardlib/ops/cuda/reduce.cuh — device-wide reductions with CUB: the squared
// norm of a gradient shard (global-norm clipping) and the count of non-finite
// values (fp16 loss scaling).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"             // FloatingElement
#include "shardlib/cuda/caching_allocator.hpp"   // caching_allocator
#include "shardlib/ops/cuda/launch.cuh"          // detail::with_cub_scratch

#include <cub/device/device_reduce.cuh>
#include <cuda/std/functional>  // cuda::std::plus

#include <cuda_runtime.h>

#include <cmath>    // isfinite
#include <cstddef>  // std::size_t
#include <span>     // std::span

namespace shardlib::ops::cuda {

namespace detail {
template <class T>
struct square_as_double {
  __host__ __device__ double operator()(T x) const { return double(float(x)) * double(float(x)); }
};
template <class T>
struct is_nonfinite {
  __host__ __device__ unsigned long long operator()(T x) const { return isfinite(float(x)) ? 0ULL : 1ULL; }
};
}  // namespace detail

// *out (device) = sum of x[i]^2, each square and the sum in double, as
// optim's grad_norm_squared on the host (the order of the sum differs).
template <FloatingElement T>
void sum_squares(std::span<const T> x, double* out, cudaStream_t stream, shardlib::cuda::caching_allocator& alloc) {
  detail::with_cub_scratch(
      [&](void* scratch, std::size_t& bytes) {
        return cub::DeviceReduce::TransformReduce(scratch, bytes, x.data(), out, x.size(), ::cuda::std::plus<>{},
                                                  detail::square_as_double<T>{}, 0.0, stream);
      },
      stream, alloc, "cub::DeviceReduce::TransformReduce (sum of squares)");
}

// *out (device) = how many x[i] are infinite or NaN.
template <FloatingElement T>
void count_nonfinite(std::span<const T> x, unsigned long long* out, cudaStream_t stream,
                     shardlib::cuda::caching_allocator& alloc) {
  detail::with_cub_scratch(
      [&](void* scratch, std::size_t& bytes) {
        return cub::DeviceReduce::TransformReduce(scratch, bytes, x.data(), out, x.size(), ::cuda::std::plus<>{},
                                                  detail::is_nonfinite<T>{}, 0ULL, stream);
      },
      stream, alloc, "cub::DeviceReduce::TransformReduce (counting non-finite values)");
}

}  // namespace shardlib::ops::cuda
