// shardlib/nn/layer_norm.hpp — LayerNorm over the last dimension (torch.nn.LayerNorm).
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
// What LayerNorm's two versions share (the host's below, the device's in
// nn/cuda/layer_norm.cuh): the parameters and their init rules, the accessors,
// parameters() and the shape checks with their messages.
template <class T>
class layer_norm_base {
 public:
  explicit layer_norm_base(std::int64_t normalized_dim, double eps = 1e-5, bool elementwise_affine = true)
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

 protected:
  // forward's check of x's shape.
  void check_input(const Shape& x) const {
    require<shape_error>(x.rank() >= 1 && x[x.rank() - 1] == d_, "LayerNorm(", d_,
                         "): input's last dimension must be ", d_, ", got shape ", x);
    check_bound(false);
  }
  void check_bound(bool with_grad) const {
    if (!affine_) return;
    weight.require_bound("LayerNorm", with_grad);
    bias.require_bound("LayerNorm", with_grad);
  }
  // backward's check of dy against the input x cached by forward.
  template <class X, class Y>
  void check_grad(const X& x, const Y& dy) const {
    require<shape_error>(!x.empty() && dy.shape() == x.shape(), "LayerNorm(", d_,
                         "): backward needs the gradient of the last forward's output (shape ", x.shape(),
                         "), got shape ", dy.shape());
    check_bound(true);
  }

  std::int64_t d_;
  double eps_;
  bool affine_;
};
}  // namespace detail

// y = (x - mean) / sqrt(var + eps) * weight + bias per row of the last dimension,
// var biased (divided by D, as torch). weight [D] starts at ones, bias [D] at zeros;
// elementwise_affine = false leaves no parameters (weight 1, bias 0).
template <class T, class Space = host_space>
class LayerNorm : public detail::layer_norm_base<T> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::LayerNorm: the host layer; for cuda_space include shardlib/nn/cuda/layer_norm.cuh");
  using base = detail::layer_norm_base<T>;
  using base::d_, base::eps_, base::affine_;

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;
  using base::weight, base::bias;

  using base::base;  // LayerNorm(normalized_dim, eps = 1e-5, elementwise_affine = true)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    this->check_input(x.shape());
    const std::int64_t rows = x.numel() / d_;
    const bool keep = grad_enabled(ctx);  // x, mean and rstd for backward
    x_ = keep ? x : input{};
    mean_ = keep ? Tensor<T>(Shape{rows}) : Tensor<T>{};
    rstd_ = keep ? Tensor<T>(Shape{rows}) : Tensor<T>{};
    output y(x.shape());
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x.data() + r * d_;
      T sum = 0;
      for (std::int64_t i = 0; i < d_; ++i) sum += xr[i];
      const T mean = sum / T(d_);
      T sq = 0;  // two passes: no cancellation when |mean| >> std
      for (std::int64_t i = 0; i < d_; ++i) sq += (xr[i] - mean) * (xr[i] - mean);
      const T rstd = T(1) / std::sqrt(sq / T(d_) + T(eps_));
      if (keep) {
        mean_[r] = mean;
        rstd_[r] = rstd;
      }
      T* yr = y.data() + r * d_;
      for (std::int64_t i = 0; i < d_; ++i) {
        const T xhat = (xr[i] - mean) * rstd;
        yr[i] = affine_ ? xhat * weight.value[i] + bias.value[i] : xhat;
      }
    }
    return y;
  }

  // With g = dy * weight and xhat the normalised input (llm.c's layernorm_backward):
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dweight += dy * xhat; dbias += dy.
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    require_activations(!x_.empty(), "LayerNorm(", d_, ")");
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / d_;
    input dx(x_.shape());
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x_.data() + r * d_;
      const T* dyr = dy.data() + r * d_;
      const T mean = mean_[r], rstd = rstd_[r];
      T g_mean = 0, gx_mean = 0;
      for (std::int64_t i = 0; i < d_; ++i) {
        const T g = affine_ ? dyr[i] * weight.value[i] : dyr[i];
        g_mean += g;
        gx_mean += g * (xr[i] - mean) * rstd;
      }
      g_mean /= T(d_);
      gx_mean /= T(d_);
      T* dxr = dx.data() + r * d_;
      for (std::int64_t i = 0; i < d_; ++i) {
        const T xhat = (xr[i] - mean) * rstd;
        const T g = affine_ ? dyr[i] * weight.value[i] : dyr[i];
        dxr[i] = rstd * (g - g_mean - xhat * gx_mean);
        if (affine_ && weight.requires_grad) weight.grad[i] += dyr[i] * xhat;  // frozen: no gradient
        if (affine_ && bias.requires_grad) bias.grad[i] += dyr[i];
      }
    }
    x_ = mean_ = rstd_ = {};
    return dx;
  }

 private:
  input x_;                // cached for backward
  Tensor<T> mean_, rstd_;  // per row, cached for backward
};

}  // namespace shardlib::nn
