// shardlib/nn/rms_norm.hpp — RMSNorm over the last dimension (LLaMA's, as Hugging
// Face's LlamaRMSNorm and torch.nn.RMSNorm with a weight).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/param.hpp"

#include <cmath>        // std::sqrt
#include <cstdint>      // std::int64_t
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

namespace detail {
// What RMSNorm's two versions share (the host's below, the device's in
// nn/cuda/rms_norm.cuh): the weight, its init rule, the accessors, parameters()
// and the checks with their messages.
template <class T>
class rms_norm_base {
 public:
  explicit rms_norm_base(std::int64_t normalized_dim, double eps = 1e-6) : d_(normalized_dim), eps_(eps) {
    require<shape_error>(d_ > 0, "RMSNorm: normalized_dim must be positive, got ", d_);
    require(eps_ >= 0, "RMSNorm(", d_, "): eps must not be negative, got ", eps_);
    weight.shape = Shape{d_};
    weight.init = init_rule::constant_one();
  }

  Param<T> weight;

  std::int64_t normalized_dim() const { return d_; }
  double eps() const { return eps_; }

  template <class V>
  void parameters(V&& v) {
    v("weight", weight);
  }

 protected:
  // forward's check of x's shape.
  void check_input(const Shape& x) const {
    require<shape_error>(x.rank() >= 1 && x[x.rank() - 1] == d_, "RMSNorm(", d_,
                         "): input's last dimension must be ", d_, ", got shape ", x);
    weight.require_bound("RMSNorm");
  }
  // backward's check of dy against the input x cached by forward.
  template <class X, class Y>
  void check_grad(const X& x, const Y& dy) const {
    require_activations(!x.empty(), "RMSNorm(", d_, ")");
    require<shape_error>(dy.shape() == x.shape(), "RMSNorm(", d_,
                         "): backward needs the gradient of the last forward's output (shape ", x.shape(),
                         "), got shape ", dy.shape());
    weight.require_bound("RMSNorm", true);
  }

  std::int64_t d_;
  double eps_;
};
}  // namespace detail

// y = weight * x / sqrt(mean(x^2) + eps) per row of the last dimension, in T
// (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467): no mean is
// subtracted and there is no bias. weight [D] starts at ones, as LlamaRMSNorm's;
// eps defaults to LLaMA's 1e-6 (torch.nn.RMSNorm's default is the dtype's epsilon).
// Space is where tensors and the weight live: the device's layer (cuda_space)
// is in nn/cuda/rms_norm.cuh, with the same parameter.
template <class T, class Space = host_space>
class RMSNorm : public detail::rms_norm_base<T> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::RMSNorm: the host layer; for cuda_space include shardlib/nn/cuda/rms_norm.cuh");
  using base = detail::rms_norm_base<T>;
  using base::d_, base::eps_;

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;
  using base::weight;

  using base::base;  // RMSNorm(normalized_dim, eps = 1e-6)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    this->check_input(x.shape());
    const std::int64_t rows = x.numel() / d_;
    const bool keep = grad_enabled(ctx);  // x and rstd for backward
    x_ = keep ? x : input{};
    rstd_ = keep ? Tensor<T>(Shape{rows}) : Tensor<T>{};
    output y(x.shape());
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x.data() + r * d_;
      T sq = 0;
      for (std::int64_t i = 0; i < d_; ++i) sq += xr[i] * xr[i];
      const T rstd = T(1) / std::sqrt(sq / T(d_) + T(eps_));
      if (keep) rstd_[r] = rstd;
      T* yr = y.data() + r * d_;
      for (std::int64_t i = 0; i < d_; ++i) yr[i] = weight.value[i] * (xr[i] * rstd);
    }
    return y;
  }

  // With g = dy * weight and xhat = x * rstd (rstd depends on every x of the row):
  // dx = rstd * (g - xhat * mean(g * xhat)); dweight += dy * xhat.
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / d_;
    input dx(x_.shape());
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x_.data() + r * d_;
      const T* dyr = dy.data() + r * d_;
      const T rstd = rstd_[r];
      T gx_mean = 0;
      for (std::int64_t i = 0; i < d_; ++i) gx_mean += dyr[i] * weight.value[i] * xr[i] * rstd;
      gx_mean /= T(d_);
      T* dxr = dx.data() + r * d_;
      for (std::int64_t i = 0; i < d_; ++i) {
        const T xhat = xr[i] * rstd;
        dxr[i] = rstd * (dyr[i] * weight.value[i] - xhat * gx_mean);
        if (weight.requires_grad) weight.grad[i] += dyr[i] * xhat;  // frozen: no gradient
      }
    }
    x_ = rstd_ = {};
    return dx;
  }

 private:
  input x_;         // cached for backward
  Tensor<T> rstd_;  // 1 / rms per row, cached for backward
};

}  // namespace shardlib::nn
