// examples/common/device_data.cuh — the synthetic task's inputs on the device, in
// the compute dtype (labels go with shardlib::cuda::to_device as they are).
#pragma once
#include <shardlib/core/tensor.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/cuda/memory_space.hpp>
#include <shardlib/ops/cuda/elementwise.cuh>

#include <span>
#include <type_traits>

namespace example {

template <class T>
shardlib::Tensor<T, shardlib::cuda_space> to_device(const shardlib::Tensor<float>& x) {
  namespace sl = shardlib;
  auto wide = sl::cuda::to_device(x);
  if constexpr (std::is_same_v<T, float>) {
    return wide;
  } else {
    sl::Tensor<T, sl::cuda_space> narrow(x.shape());
    sl::ops::cuda::cast(std::span<const float>(wide.span()), narrow.span(), sl::cuda::current_stream());
    return narrow;
  }
}

}  // namespace example
