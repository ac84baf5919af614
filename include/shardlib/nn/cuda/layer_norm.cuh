// shardlib/nn/cuda/layer_norm.cuh — LayerNorm on the device: nn::LayerNorm<T, cuda_space>
// (ops::cuda::layer_norm_forward/backward on the current stream).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/caching_allocator.hpp"  // device_allocator
#include "shardlib/cuda/current.hpp"            // current_stream
#include "shardlib/cuda/error.hpp"              // current_device
#include "shardlib/cuda/memory_space.hpp"       // cuda_space
#include "shardlib/nn/layer_norm.hpp"           // the host layer
#include "shardlib/nn/param.hpp"
#include "shardlib/ops/cuda/layer_norm.cuh"     // layer_norm_forward, layer_norm_backward, row_stats

#include <cstdint>  // std::int64_t

namespace shardlib::nn {

// The host layer's parameters and checks (detail::layer_norm_base in
// nn/layer_norm.hpp); the rows in float whatever T is (ops/cuda/layer_norm.hpp),
// mean and rstd kept per row in float for backward.
// weight and bias gradients accumulate (+=), summed over rows deterministically.
template <class T>
class LayerNorm<T, cuda_space> : public detail::layer_norm_base<T> {
  using base = detail::layer_norm_base<T>;
  using base::d_, base::eps_, base::affine_;

 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using base::weight, base::bias;

  using base::base;  // LayerNorm(normalized_dim, eps = 1e-5, elementwise_affine = true)

  // Keeps x and the row statistics only when a backward follows (nn::grad_enabled).
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    this->check_input(x.shape());
    const std::int64_t rows = x.numel() / d_;
    Tensor<ops::cuda::row_stats, cuda_space> stats(Shape{rows});
    output y(x.shape());
    ops::cuda::layer_norm_forward(x.data(), affine_ ? weight.value : nullptr, affine_ ? bias.value : nullptr, y.data(),
                                  stats.data(), rows, int(d_), float(eps_), cuda::current_stream());
    const bool keep = grad_enabled(ctx);
    x_ = keep ? x : input{};
    stats_ = keep ? std::move(stats) : Tensor<ops::cuda::row_stats, cuda_space>{};
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / d_;
    input dx(x_.shape());
    ops::cuda::layer_norm_backward(x_.data(), dy.data(), affine_ ? weight.value : nullptr, stats_.data(), dx.data(),
                                   affine_ && weight.requires_grad ? weight.grad : nullptr,  // frozen: none
                                   affine_ && bias.requires_grad ? bias.grad : nullptr, rows, int(d_),
                                   cuda::current_stream(), cuda::device_allocator(cuda::current_device()));
    x_ = {};
    stats_ = {};
    return dx;
  }

 private:
  input x_;                                         // cached for backward
  Tensor<ops::cuda::row_stats, cuda_space> stats_;  // per row, cached for backward
};

}  // namespace shardlib::nn
