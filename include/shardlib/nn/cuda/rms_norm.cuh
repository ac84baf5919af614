// shardlib/nn/cuda/rms_norm.cuh — RMSNorm on the device: nn::RMSNorm<T, cuda_space>
// (ops::cuda::rms_norm_forward/backward on the current stream).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/caching_allocator.hpp"  // device_allocator
#include "shardlib/cuda/current.hpp"            // current_stream
#include "shardlib/cuda/error.hpp"              // current_device
#include "shardlib/cuda/memory_space.hpp"       // cuda_space
#include "shardlib/nn/grad_mode.hpp"            // grad_enabled
#include "shardlib/nn/rms_norm.hpp"             // the host layer
#include "shardlib/ops/cuda/rms_norm.cuh"       // rms_norm_forward, rms_norm_backward

#include <cstdint>  // std::int64_t

namespace shardlib::nn {

// The host layer's parameter and checks (detail::rms_norm_base in
// nn/rms_norm.hpp); the rows in float whatever T is (ops/cuda/rms_norm.hpp),
// rstd kept per row in float for backward. The weight gradient accumulates
// (+=), summed over rows deterministically.
template <class T>
class RMSNorm<T, cuda_space> : public detail::rms_norm_base<T> {
  using base = detail::rms_norm_base<T>;
  using base::d_, base::eps_;

 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using base::weight;

  using base::base;  // RMSNorm(normalized_dim, eps = 1e-6)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    this->check_input(x.shape());
    const std::int64_t rows = x.numel() / d_;
    const bool keep = grad_enabled(ctx);  // x and rstd for backward
    x_ = keep ? x : input{};
    rstd_ = keep ? Tensor<float, cuda_space>(Shape{rows}) : Tensor<float, cuda_space>{};
    output y(x.shape());
    ops::cuda::rms_norm_forward(x.data(), weight.value, y.data(), keep ? rstd_.data() : nullptr, rows, int(d_),
                                float(eps_), cuda::current_stream());
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / d_;
    input dx(x_.shape());
    ops::cuda::rms_norm_backward(x_.data(), dy.data(), weight.value, rstd_.data(), dx.data(),
                                 weight.requires_grad ? weight.grad : nullptr, rows,  // frozen: no gradient
                                 int(d_), cuda::current_stream(), cuda::device_allocator(cuda::current_device()));
    x_ = {};
    rstd_ = {};
    return dx;
  }

 private:
  input x_;                          // cached for backward
  Tensor<float, cuda_space> rstd_;  // 1 / rms per row, cached for backward
};

}  // namespace shardlib::nn
