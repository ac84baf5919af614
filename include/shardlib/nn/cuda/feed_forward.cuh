// shardlib/nn/cuda/feed_forward.cuh — the decoders' feed-forward blocks on the
// device: nn::LlamaMLP<T, cuda_space> and nn::GPT2MLP<T, cuda_space> are the host
// templates (nn/feed_forward.hpp) over the device's Linear, SiLU, GELU and
// Dropout; this header adds LlamaMLP's fused SwiGLU kernels.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/cuda/activation.cuh"    // SiLU, GELU
#include "shardlib/nn/cuda/dropout.cuh"       // Dropout
#include "shardlib/nn/cuda/linear.cuh"        // Linear
#include "shardlib/nn/feed_forward.hpp"       // LlamaMLP, GPT2MLP, swiglu_ops
#include "shardlib/ops/cuda/elementwise.cuh"  // add
#include "shardlib/ops/cuda/swiglu.cuh"       // swiglu, swiglu_backward

namespace shardlib::nn::detail {

// LlamaMLP's element-wise work on the current stream: one kernel each, in
// float whatever T is (ops/cuda/swiglu.cuh).
template <class T>
struct swiglu_ops<T, cuda_space> {
  using tensor = Tensor<T, cuda_space>;

  static tensor forward(const tensor& gate, const tensor& up) {
    tensor h(gate.shape());
    ops::cuda::swiglu<T>(gate.span(), up.span(), h.span(), cuda::current_stream());
    return h;
  }
  static void backward(const tensor& gate, const tensor& up, const tensor& dh, tensor& dgate, tensor& dup) {
    dgate = tensor(gate.shape());
    dup = tensor(gate.shape());
    ops::cuda::swiglu_backward<T>(gate.span(), up.span(), dh.span(), dgate.span(), dup.span(), cuda::current_stream());
  }
  static tensor add(const tensor& a, const tensor& b) {
    tensor y(a.shape());
    ops::cuda::add<T>(a.span(), b.span(), y.span(), cuda::current_stream());
    return y;
  }
};

}  // namespace shardlib::nn::detail
