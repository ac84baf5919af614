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

// The host layer's parameters and checks; the rows in float whatever T is
// (ops/cuda/layer_norm.hpp), mean and rstd kept per row in float for backward.
// weight and bias gradients accumulate (+=), summed over rows deterministically.
template <class T>
class LayerNorm<T, cuda_space> {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  explicit LayerNorm(std::int64_t normalized_dim, double eps = 1e-5, bool elementwise_affine = true)
      : d_(normalized_dim), eps_(eps), affine_(elementwise_affine) {
    if (affine_) {
      weight.shape = Shape{d_};
      weight.init = init_rule::constant_one();
      bias.shape = Shape{d_};
      bias.init = init_rule::constant_zero();
    }
  }

  Param<T> weight, bias;

  std::int64_t normalized_dim() const { return d_; }
  double eps() const { return eps_; }

  template <class V>
  void parameters(V&& v) {
    if (affine_) {
      v("weight", weight);
      v("bias", bias);
    }
  }

  template <class Ctx>
  output forward(Ctx&, const input& x) {
    require<shape_error>(x.rank() >= 1 && x.dim(x.rank() - 1) == d_, "LayerNorm(", d_,
                         "): input's last dimension must be ", d_, ", got shape ", x.shape());
    const std::int64_t rows = x.numel() / d_;
    x_ = x;
    stats_ = Tensor<ops::cuda::row_stats, cuda_space>(Shape{rows});
    output y(x.shape());
    ops::cuda::layer_norm_forward(x.data(), affine_ ? weight.value : nullptr, affine_ ? bias.value : nullptr, y.data(),
                                  stats_.data(), rows, int(d_), float(eps_), cuda::current_stream());
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    require<shape_error>(!x_.empty() && dy.shape() == x_.shape(), "LayerNorm(", d_,
                         "): backward needs the gradient of the last forward's output (shape ", x_.shape(),
                         "), got shape ", dy.shape());
    const std::int64_t rows = x_.numel() / d_;
    input dx(x_.shape());
    ops::cuda::layer_norm_backward(x_.data(), dy.data(), affine_ ? weight.value : nullptr, stats_.data(), dx.data(),
                                   affine_ ? weight.grad : nullptr, affine_ ? bias.grad : nullptr, rows, int(d_),
                                   cuda::current_stream(), cuda::device_allocator(cuda::current_device()));
    x_ = {};
    stats_ = {};
    return dx;
  }

 private:
  std::int64_t d_;
  double eps_;
  bool affine_;
  input x_;                                         // cached for backward
  Tensor<ops::cuda::row_stats, cuda_space> stats_;  // per row, cached for backward
};

}  // namespace shardlib::nn
