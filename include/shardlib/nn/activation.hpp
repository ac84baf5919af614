// shardlib/nn/activation.hpp — ReLU, GELU and SiLU (torch.nn.ReLU, torch.nn.GELU,
// torch.nn.SiLU), and the per-element functions they are made of, shared with the
// CUDA kernels.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"

#include <bit>          // std::bit_cast
#include <cmath>        // std::erf, std::exp, std::tanh
#include <cstdint>      // std::int32_t, std::int64_t
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

// torch.nn.GELU's `approximate`: none = x Φ(x) with the exact erf; tanh = the
// tanh approximation (https://pytorch.org/docs/stable/generated/torch.nn.GELU.html).
enum class gelu_approx { none, tanh };

// Per-element forward and backward (backward returns dy * f'(x)). SHARDLIB_HD so
// device kernels call the same code; nvcc provides device overloads of std::erf,
// std::exp and std::tanh for float and double.

// NaN propagates (clamp_min semantics, as torch.relu); the gradient at 0 and at NaN is 0,
// as torch's (its backward passes dy where relu(x) > 0).
template <class T>
SHARDLIB_HD constexpr T relu(T x) {
  return x < T(0) ? T(0) : x;
}
template <class T>
SHARDLIB_HD constexpr T relu_backward(T x, T dy) {
  return x > T(0) ? dy : T(0);
}

template <class T>
SHARDLIB_HD T gelu(T x, gelu_approx approx = gelu_approx::none) {
  if (approx == gelu_approx::tanh) {
    const T inner = T(0.7978845608028654) * (x + T(0.044715) * x * x * x);  // sqrt(2/pi) (x + 0.044715 x^3)
    return T(0.5) * x * (T(1) + std::tanh(inner));
  }
  return T(0.5) * x * (T(1) + std::erf(x * T(0.7071067811865476)));  // x Φ(x), Φ(x) = (1 + erf(x/√2)) / 2
}

template <class T>
SHARDLIB_HD T gelu_backward(T x, T dy, gelu_approx approx = gelu_approx::none) {
  if (approx == gelu_approx::tanh) {
    const T k = T(0.7978845608028654), c = T(0.044715);
    const T t = std::tanh(k * (x + c * x * x * x));
    return dy * (T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * k * (T(1) + T(3) * c * x * x));
  }
  const T cdf = T(0.5) * (T(1) + std::erf(x * T(0.7071067811865476)));
  const T pdf = T(0.3989422804014327) * std::exp(T(-0.5) * x * x);  // φ(x) = exp(-x^2/2) / √(2π)
  return dy * (cdf + x * pdf);
}

// silu(x) = x sigmoid(x) (LLaMA's activation); for x -> -inf, exp(-x) -> inf and
// both the value and the gradient go to 0 without a NaN.
template <class T>
SHARDLIB_HD T silu(T x) {
  return x / (T(1) + std::exp(-x));
}
template <class T>
SHARDLIB_HD T silu_backward(T x, T dy) {
  const T s = T(1) / (T(1) + std::exp(-x));
  return dy * s * (T(1) + x * (T(1) - s));  // silu'(x) = s (1 + x (1 - s))
}

namespace detail {
// The host's float tanh-GELU, written so that its loops vectorise: std::tanh and
// std::exp are scalar library calls, which made GELU a quarter of GPT-2's step
// (bench_model --model gpt2). 0.5 (1 + tanh(u)) = sigmoid(2u) and 1 - tanh(u)^2 =
// 4 sigmoid(2u) (1 - sigmoid(2u)), so one exp serves value and gradient.
//
// e^v for v in [-87, 88] (outside, clamped: the sigmoid is then 0 or 1 to float
// precision): e^v = 2^n e^r, n = round(v / ln 2), |r| <= ln 2 / 2 (ln 2 split in two
// parts so that r is exact), e^r by its Taylor series to r^7 (remainder < 1e-8,
// below float's half ulp), 2^n built in the exponent bits.
inline float exp_clamped(float v) {
  v = v > 88 ? 88.0f : v >= -87 ? v : -87.0f;  // NaN to -87 (a NaN x still makes a NaN result); not std::clamp,
                                               // whose references keep the loop scalar
  // round to nearest by adding and taking away 1.5 * 2^23 (std::nearbyint and std::floor keep the loop scalar)
  const float n = (v * 1.44269504f + 12582912.0f) - 12582912.0f;
  const float r = (v - n * 0.693359375f) + n * 2.12194440e-4f;  // 0.693359375 - 2.12194440e-4 = ln 2
  const float p =
      1 + r * (1 + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 + r / 5040))))));
  return p * std::bit_cast<float>((std::int32_t(n) + 127) << 23);
}
// sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), and du/dx.
struct gelu_tanh_parts {
  float s, du;
  explicit gelu_tanh_parts(float x)
      : s(1.0f / (1.0f + exp_clamped(-2.0f * 0.7978845608f * (x + 0.044715f * x * x * x)))),
        du(0.7978845608f * (1.0f + 3.0f * 0.044715f * x * x)) {}
};
inline float gelu_tanh(float x) { return x * gelu_tanh_parts(x).s; }
inline float gelu_tanh_backward(float x, float dy) {
  const gelu_tanh_parts g(x);
  return dy * (g.s + 2.0f * x * g.s * (1.0f - g.s) * g.du);
}

// What the element-wise layers' two versions share (the host's below, the
// device's in nn/cuda/activation.cuh): no parameters, GELU's approximation, and
// the check that backward gets the gradient of the last forward's output x.
struct activation_base {
  template <class V>
  void parameters(V&&) {}
};
class gelu_base : public activation_base {
 public:
  gelu_base() = default;
  explicit gelu_base(gelu_approx approximate) : approx_(approximate) {}

  gelu_approx approximate() const { return approx_; }

 protected:
  gelu_approx approx_ = gelu_approx::none;
};
template <class X, class Y>
void require_backward_of(const char* layer, const X& x, const Y& dy) {
  require_activations(!x.empty(), layer);
  require<shape_error>(dy.shape() == x.shape(), layer,
                       ": backward needs the gradient of the last forward's output (shape ", x.shape(), "), got shape ",
                       dy.shape());
}

// Shared body of the host's element-wise layers: y[i] = f(x[i]), and dx[i] =
// df(x[i], dy[i]) after the check. Plain pointers and a count read once, so the
// loops vectorise (Tensor's operator[] kept them scalar).
template <class T, class F>
Tensor<T> elementwise(const Tensor<T>& x, F f) {
  Tensor<T> y(x.shape());
  const T* xp = x.data();
  T* yp = y.data();
  const std::int64_t n = x.numel();
  for (std::int64_t i = 0; i < n; ++i) yp[i] = f(xp[i]);
  return y;
}
// out[i] = f(a[i], b[i]) for two tensors of one shape (the gated product and the
// sums of branch gradients in nn/feed_forward.hpp).
template <class T, class F>
Tensor<T> elementwise(const Tensor<T>& a, const Tensor<T>& b, F f) {
  Tensor<T> out(a.shape());
  const T *ap = a.data(), *bp = b.data();
  T* op = out.data();
  const std::int64_t n = a.numel();
  for (std::int64_t i = 0; i < n; ++i) op[i] = f(ap[i], bp[i]);
  return out;
}
template <class T, class F>
Tensor<T> elementwise_backward(const char* layer, const Tensor<T>& x, const Tensor<T>& dy, F df) {
  require_backward_of(layer, x, dy);
  Tensor<T> dx(x.shape());
  const T *xp = x.data(), *dyp = dy.data();
  T* dxp = dx.data();
  const std::int64_t n = x.numel();
  for (std::int64_t i = 0; i < n; ++i) dxp[i] = df(xp[i], dyp[i]);
  return dx;
}

// What the host activations share, as the device's do (device_activation in
// nn/cuda/activation.cuh): y = Derived's values(x) and dx = its gradients(x, dy), the
// input kept for backward (when one follows: nn::grad_enabled).
template <class Derived, class T>
class host_activation {
 public:
  using input = Tensor<T>;
  using output = Tensor<T>;

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    x_ = grad_enabled(ctx) ? x : input{};
    return self().values(x);
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    input dx = self().gradients(x_, dy);
    x_ = {};
    return dx;
  }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  input x_;  // cached for backward
};
}  // namespace detail

template <class T, class Space = host_space>
class ReLU : public detail::activation_base, public detail::host_activation<ReLU<T, Space>, T> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::ReLU: the host layer; for cuda_space include shardlib/nn/cuda/activation.cuh");

 public:
  static Tensor<T> values(const Tensor<T>& x) { return detail::elementwise(x, [](T v) { return relu(v); }); }
  static Tensor<T> gradients(const Tensor<T>& x, const Tensor<T>& dy) {
    return detail::elementwise_backward("ReLU", x, dy, [](T v, T g) { return relu_backward(v, g); });
  }
};

template <class T, class Space = host_space>
class GELU : public detail::gelu_base, public detail::host_activation<GELU<T, Space>, T> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::GELU: the host layer; for cuda_space include shardlib/nn/cuda/activation.cuh");

 public:
  using gelu_base::gelu_base;  // GELU(), GELU(approximate)

  // float's tanh form by detail::gelu_tanh, whose loops vectorise.
  Tensor<T> values(const Tensor<T>& x) const {
    if constexpr (std::is_same_v<T, float>)
      if (approx_ == gelu_approx::tanh) return detail::elementwise(x, [](T v) { return detail::gelu_tanh(v); });
    return detail::elementwise(x, [a = approx_](T v) { return gelu(v, a); });
  }
  Tensor<T> gradients(const Tensor<T>& x, const Tensor<T>& dy) const {
    if constexpr (std::is_same_v<T, float>)
      if (approx_ == gelu_approx::tanh)
        return detail::elementwise_backward("GELU", x, dy, [](T v, T g) { return detail::gelu_tanh_backward(v, g); });
    return detail::elementwise_backward("GELU", x, dy, [a = approx_](T v, T g) { return gelu_backward(v, g, a); });
  }
};

// torch.nn.SiLU: y = x sigmoid(x).
template <class T, class Space = host_space>
class SiLU : public detail::activation_base, public detail::host_activation<SiLU<T, Space>, T> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::SiLU: the host layer; for cuda_space include shardlib/nn/cuda/activation.cuh");

 public:
  static Tensor<T> values(const Tensor<T>& x) { return detail::elementwise(x, [](T v) { return silu(v); }); }
  static Tensor<T> gradients(const Tensor<T>& x, const Tensor<T>& dy) {
    return detail::elementwise_backward("SiLU", x, dy, [](T v, T g) { return silu_backward(v, g); });
  }
};

}  // namespace shardlib::nn
