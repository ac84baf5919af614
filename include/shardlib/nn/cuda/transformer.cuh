// shardlib/nn/cuda/transformer.cuh — TransformerEncoderLayer on the device:
// nn::TransformerEncoderLayer<T, cuda_space> is the host's template with the
// device children; this header brings them and the residual sum's kernel
// (linear1 and its ReLU are one product: nn/cuda/linear.cuh's linear_activation).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/cuda/activation.cuh"    // ReLU, GELU
#include "shardlib/nn/cuda/attention.cuh"     // MultiheadAttention
#include "shardlib/nn/cuda/dropout.cuh"       // Dropout
#include "shardlib/nn/cuda/layer_norm.cuh"    // LayerNorm
#include "shardlib/nn/cuda/linear.cuh"        // Linear, linear_activation
#include "shardlib/nn/transformer.hpp"        // the layer
#include "shardlib/ops/cuda/elementwise.cuh"  // add

namespace shardlib::nn::detail {

template <>
struct residual<cuda_space> {
  template <class T>
  static Tensor<T, cuda_space> sum(const Tensor<T, cuda_space>& a, const Tensor<T, cuda_space>& b) {
    Tensor<T, cuda_space> s(a.shape());
    ops::cuda::add<T>(a.span(), b.span(), s.span(), cuda::current_stream());
    return s;
  }
};

}  // namespace shardlib::nn::detail
