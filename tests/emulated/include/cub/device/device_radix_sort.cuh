// tests/emulated/include/cub/device/device_radix_sort.cuh — stands in for CUB's header
// in the emulated tests: SortPairs as a stable sort by key on the CPU (a radix sort is
// stable), over the whole key (the library sorts every bit).
#pragma once
#include "../../cuda_runtime.h"

#include <algorithm>  // std::stable_sort
#include <cstddef>    // std::size_t
#include <numeric>    // std::iota
#include <vector>     // std::vector

namespace cub {
struct DeviceRadixSort {
  template <class K, class V, class N>
  static cudaError_t SortPairs(void* scratch, std::size_t& bytes, const K* keys_in, K* keys_out, const V* values_in,
                               V* values_out, N n, int = 0, int = int(sizeof(K) * 8), cudaStream_t = nullptr) {
    if (!scratch) {
      bytes = 16;
      return cudaSuccess;
    }
    std::vector<std::size_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return keys_in[a] < keys_in[b]; });
    for (std::size_t i = 0; i < order.size(); ++i) {
      keys_out[i] = keys_in[order[i]];
      values_out[i] = values_in[order[i]];
    }
    return cudaSuccess;
  }
};
}  // namespace cub
