// shardlib/nn/cuda/transformer.cuh — TransformerEncoderLayer on the device:
// nn::TransformerEncoderLayer<T, cuda_space> is the host's template with the
// device children; this header brings them, the residual sum's kernel and the
// fusion of linear1 with a ReLU.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/cuda/activation.cuh"    // ReLU, GELU
#include "shardlib/nn/cuda/attention.cuh"     // MultiheadAttention
#include "shardlib/nn/cuda/dropout.cuh"       // Dropout
#include "shardlib/nn/cuda/layer_norm.cuh"    // LayerNorm
#include "shardlib/nn/cuda/linear.cuh"        // Linear
#include "shardlib/nn/transformer.hpp"        // the layer
#include "shardlib/ops/cuda/elementwise.cuh"  // add

#include <type_traits>  // std::is_same_v

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

// linear1 then ReLU is one product: Linear's relu_bias epilogue, nn::relu's
// math exactly (nn/cuda/linear.cuh), the ReLU layer not called. The encoder's
// "gelu" is the erf form (torch's), for which cuBLASLt has no epilogue (its
// GELU is the tanh form): linear1, then the GELU layer.
template <>
struct linear_activation<cuda_space> {
  template <class Ctx, class T, class A>
  static Tensor<T, cuda_space> forward(Ctx& ctx, Linear<T, cuda_space>& linear, A& act,
                                       const Tensor<T, cuda_space>& x) {
    if constexpr (std::is_same_v<A, ReLU<T, cuda_space>>) {
      linear.fuse_activation(fused_activation::relu);
      return ctx.forward(linear, x);
    } else {
      return ctx.forward(act, ctx.forward(linear, x));
    }
  }
  template <class Ctx, class T, class A>
  static Tensor<T, cuda_space> backward(Ctx& ctx, Linear<T, cuda_space>& linear, A& act,
                                        const Tensor<T, cuda_space>& dy) {
    if constexpr (std::is_same_v<A, ReLU<T, cuda_space>>) return ctx.backward(linear, dy);
    else return ctx.backward(linear, ctx.backward(act, dy));
  }
};

}  // namespace shardlib::nn::detail
