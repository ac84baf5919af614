// tests/emulated/include/cub/device/device_reduce.cuh — stands in for CUB's header in
// the emulated tests: TransformReduce in order on the CPU (CUB's tree sums in another
// order; the tests' tolerances allow for that, as on a GPU). CUB's two-pass protocol
// is kept: a call without scratch asks for its size, which is never zero.
#pragma once
#include "../../cuda_runtime.h"

#include <cstddef>  // std::size_t

namespace cub {
struct DeviceReduce {
  template <class In, class Out, class N, class Reduce, class Transform, class T>
  static cudaError_t TransformReduce(void* scratch, std::size_t& bytes, In in, Out out, N n, Reduce reduce,
                                     Transform transform, T init, cudaStream_t = nullptr) {
    if (!scratch) {
      bytes = 16;
      return cudaSuccess;
    }
    T acc = init;
    for (N i = 0; i < n; ++i) acc = reduce(acc, transform(in[i]));
    *out = acc;
    return cudaSuccess;
  }
};
}  // namespace cub
