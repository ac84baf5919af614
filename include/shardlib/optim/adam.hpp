// shardlib/optim/adam.hpp — Adam and AdamW with PyTorch's semantics, stepped in one fused pass.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"        // Buffer
#include "shardlib/core/element.hpp"       // FloatingElement
#include "shardlib/core/error.hpp"         // require
#include "shardlib/optim/optimizer.hpp"   // detail::zeroed_state, require_size, with_flag

#include <cmath>        // std::pow, std::sqrt, math_errhandling
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t, std::uint64_t
#include <span>         // std::span
#include <string_view>  // std::string_view

namespace shardlib::optim {

namespace detail {

// The square root of x rounded to the nearest float: std::sqrt(x) for every
// float (NaN payloads aside), from operations a compiler vectorises. Under
// math_errhandling & MATH_ERRNO (GCC's and Clang's default) std::sqrt must set
// errno for x < 0, so the compiler guards each call with a branch and the Adam
// loop stays scalar: 4-6x slower than memory. With -fno-math-errno (PyTorch is
// built with it) std::sqrt vectorises and is used instead; the results agree.
//
// How: in double, an estimate of 1/sqrt(d) from the exponent bits (relative
// error < 3.5%) goes through three coupled Goldschmidt iterations, s -> sqrt(d)
// and h -> 1/(2 sqrt(d)), each squaring the error, then one Newton correction
// from the residual d - s^2: the error ends below 2^-52, while sqrt(x) of a
// float is never within 2^-51 (relative) of a midpoint between two floats, so
// rounding s to float gives the correctly rounded root. The iteration commutes
// exactly with scaling x by 4^k, and every float is 4^k times a float in [1, 4),
// so the test that checks all floats in [1, 4) (with or without fused
// multiply-adds) checks them all. +inf becomes DBL_MAX, whose root rounds to
// +inf; a negative x (not -0) becomes NaN; both without branches, which would
// stop the vectorisation.
SHARDLIB_HD inline float sqrt_rn(float x) {
  if constexpr ((math_errhandling & MATH_ERRNO) == 0) {
    return std::sqrt(x);
  } else {
    std::uint64_t u = __builtin_bit_cast(std::uint64_t, static_cast<double>(x));
    u -= std::uint64_t{u == 0x7FF0000000000000};                                  // +inf -> DBL_MAX
    u |= (std::uint64_t{0} - std::uint64_t{u > 0x8000000000000000}) & 0x7FF8000000000000;  // x < 0 -> NaN
    const double d = __builtin_bit_cast(double, u);
    const double r = __builtin_bit_cast(double, std::uint64_t{0x5FE6EB50C7B537A9} - (u >> 1));
    double s = d * r;
    double h = 0.5 * r;
    for (int i = 0; i < 3; ++i) {
      const double e = 0.5 - s * h;
      s += s * e;
      h += h * e;
    }
    s += (d - s * s) * h;
    return static_cast<float>(s);
  }
}

// One step's scalars, computed in double from the options and rounded to float
// once, as PyTorch's Python floats are when they reach float32 tensor ops.
struct adam_scalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float neg_step_size;          // -lr / (1 - beta1^t)
  float eps;
  float decay;                  // Adam: weight_decay; AdamW: 1 - lr * weight_decay
};

// One element of torch.optim's _single_tensor_adam / _single_tensor_adamw
// (torch 1.13, fp32, no capturable/differentiable), each tensor op's
// arithmetic in its order; vmax is read only with Amsgrad. Sums are written
// product-first (alpha * g + m * beta1): a compiler that contracts a * b + c
// (GCC across statements, Clang within one expression) then fuses the same
// product as PyTorch's vectorised add_ and addcmul_ (x + alpha * y as
// fmadd(y, alpha, x)), so that float32 results match torch's bit for bit.
template <bool Decoupled, bool Decay, bool Amsgrad>
SHARDLIB_HD inline void adam_update(float& p, float g, float& m, float& v, float& vmax, const adam_scalars& k) {
  if constexpr (Decay && Decoupled) p = p * k.decay;       // param.mul_(1 - lr * weight_decay)
  if constexpr (Decay && !Decoupled) g = k.decay * p + g;  // grad = grad.add(param, alpha=weight_decay)
  m = k.one_minus_beta1 * g + m * k.beta1;      // exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
  v = k.one_minus_beta2 * g * g + v * k.beta2;  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  float second = v;
  if constexpr (Amsgrad) {
    // torch.maximum(max_exp_avg_sq, exp_avg_sq): the max of the *uncorrected*
    // moments, divided below by the current sqrt(1 - beta2^t); NaN propagates.
    vmax = (vmax < v || v != v) ? v : vmax;
    second = vmax;
  }
  const float denom = sqrt_rn(second) / k.bias_correction2_sqrt + k.eps;  // (sqrt(v) / bc2_sqrt).add_(eps)
  p = p + k.neg_step_size * m / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
}

// k by value: floats behind a reference might alias the arrays, and checking
// that too would exceed the alias checks GCC versions a loop for.
template <bool Decoupled, bool Decay, bool Amsgrad, class G>
void adam_pass(std::span<float> p, std::span<const G> g, float* m, float* v, float* vmax, const adam_scalars k) {
  const std::size_t n = p.size();
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (Amsgrad) {
      adam_update<Decoupled, Decay, true>(p[i], static_cast<float>(g[i]), m[i], v[i], vmax[i], k);
    } else {
      float unused = 0.0f;
      adam_update<Decoupled, Decay, false>(p[i], static_cast<float>(g[i]), m[i], v[i], unused, k);
    }
  }
}

}  // namespace detail

// How weight decay enters: Adam adds weight_decay * p to the gradient (an L2
// penalty); AdamW shrinks p by lr * weight_decay before the update
// (Loshchilov & Hutter, "Decoupled Weight Decay Regularization").
enum class decay_style { l2, decoupled };

// Adam (https://pytorch.org/docs/1.13/generated/torch.optim.Adam.html) and
// AdamW (.../torch.optim.AdamW.html). At step t, with g the gradient:
//   Adam:  g <- g + weight_decay * p          AdamW: p <- p * (1 - lr * weight_decay)
//   m <- beta1 m + (1 - beta1) g              v <- beta2 v + (1 - beta2) g^2
//   amsgrad: vmax <- max(vmax, v), used for v below
//   p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// in float, in the order of PyTorch's single-tensor implementation (eps is added
// after dividing by sqrt(1 - beta2^t)); each element is read and written once.
template <decay_style Style>
struct BasicAdam {
  static constexpr bool decoupled = Style == decay_style::decoupled;
  static constexpr std::string_view name = decoupled ? "AdamW" : "Adam";

  struct options_type {
    double lr = 1e-3;
    double beta1 = 0.9;  // PyTorch's betas = (beta1, beta2)
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = decoupled ? 1e-2 : 0.0;  // PyTorch's defaults
    bool amsgrad = false;
  };

  struct state {
    Buffer<float> exp_avg;         // m
    Buffer<float> exp_avg_sq;      // v
    Buffer<float> max_exp_avg_sq;  // vmax; empty unless made with amsgrad
    std::int64_t step = 0;

    template <class F>
    void for_each_buffer(F&& f) {
      f(std::string_view("exp_avg"), exp_avg);
      f(std::string_view("exp_avg_sq"), exp_avg_sq);
      if (!max_exp_avg_sq.empty()) f(std::string_view("max_exp_avg_sq"), max_exp_avg_sq);
    }
  };

  options_type options;

  // The scalars of step number t (1 for the first), after checking the
  // options: what step uses, and what the device's fused step (ops/cuda/adam.cuh)
  // passes to its kernel, so that both update with the same bits (a step the device
  // may cancel computes them there: see scalars_at).
  detail::adam_scalars step_scalars(std::int64_t t) const {
    check_options();
    return scalars_at(options, t);
  }
  void check_options() const {
    const auto& o = options;
    require(o.lr >= 0, name, ": invalid learning rate ", o.lr);
    require(o.beta1 >= 0 && o.beta1 < 1, name, ": invalid beta1 ", o.beta1, " (needs 0 <= beta1 < 1)");
    require(o.beta2 >= 0 && o.beta2 < 1, name, ": invalid beta2 ", o.beta2, " (needs 0 <= beta2 < 1)");
    require(o.eps >= 0, name, ": invalid eps ", o.eps);
    require(o.weight_decay >= 0, name, ": invalid weight_decay ", o.weight_decay);
  }
  // The options, and that a state of n elements has what they need.
  void check(const state& s, std::size_t n) const {
    check_options();
    require(!options.amsgrad || !s.max_exp_avg_sq.empty() || n == 0, name,
            ": amsgrad is set but the state was made without it (no max_exp_avg_sq); make the state after "
            "setting options.amsgrad");
  }
  // The arithmetic alone, for checked options (host and device code: a device that
  // counts the steps itself computes them there, with CUDA's pow, within 2 ulp in
  // double where glibc's is correctly rounded; the product is kept out of a fused
  // multiply-add so that 1 - lr * weight_decay rounds as on the host).
  SHARDLIB_HD static detail::adam_scalars scalars_at(const options_type& o, std::int64_t t) {
#if defined(__CUDA_ARCH__)
    const double lr_decay = __dmul_rn(o.lr, o.weight_decay);
#else
    const double lr_decay = o.lr * o.weight_decay;
#endif
    const double bias_correction1 = 1 - std::pow(o.beta1, static_cast<double>(t));
    const double bias_correction2 = 1 - std::pow(o.beta2, static_cast<double>(t));
    return {
        static_cast<float>(o.beta1),
        static_cast<float>(1 - o.beta1),
        static_cast<float>(o.beta2),
        static_cast<float>(1 - o.beta2),
        static_cast<float>(std::sqrt(bias_correction2)),
        static_cast<float>(-(o.lr / bias_correction1)),
        static_cast<float>(o.eps),
        static_cast<float>(decoupled ? 1 - lr_decay : o.weight_decay),
    };
  }

  // 8 bytes per parameter, 12 with amsgrad.
  state make_state(std::size_t n) const {
    return {detail::zeroed_state(n), detail::zeroed_state(n),
            options.amsgrad ? detail::zeroed_state(n) : Buffer<float>{}, 0};
  }

  void step(std::span<float> params, std::span<const float> grads, state& s) const {
    step<float>(params, grads, s);
  }

  // Gradients in another dtype (the reduction dtype) are widened per element in the same pass.
  template <FloatingElement G>
  void step(std::span<float> params, std::span<const G> grads, state& s) const {
    const std::size_t n = params.size();
    detail::require_size(name, "gradients", grads.size(), n);
    detail::require_size(name, "exp_avg entries", s.exp_avg.size(), n);
    detail::require_size(name, "exp_avg_sq entries", s.exp_avg_sq.size(), n);
    if (options.amsgrad && !s.max_exp_avg_sq.empty())
      detail::require_size(name, "max_exp_avg_sq entries", s.max_exp_avg_sq.size(), n);
    step_segment(params, grads, s, 0);
    ++s.step;
  }

  // Elements [first, first + params.size()) of the state, updated as step number
  // s.step + 1 without counting it: parameter groups (optim/param_groups.hpp) step
  // the segments of one shard with their own options, then count the step once.
  template <FloatingElement G>
  void step_segment(std::span<float> params, std::span<const G> grads, state& s, std::size_t first) const {
    const auto& o = options;
    const std::size_t n = params.size();
    check(s, n);
    const detail::adam_scalars k = scalars_at(o, s.step + 1);
    detail::require_size(name, "gradients", grads.size(), n);
    require<shape_error>(first + n <= s.exp_avg.size() && first + n <= s.exp_avg_sq.size(), name,
                         "::step: elements [", first, ", ", first + n, ") of a state of ", s.exp_avg.size(),
                         " (exp_avg) and ", s.exp_avg_sq.size(), " (exp_avg_sq)");
    if (o.amsgrad) {
      require<shape_error>(first + n <= s.max_exp_avg_sq.size(), name, "::step: elements [", first, ", ", first + n,
                           ") of ", s.max_exp_avg_sq.size(), " max_exp_avg_sq entries");
    }
    float* vmax = o.amsgrad ? s.max_exp_avg_sq.data() + first : nullptr;
    detail::with_flag(o.weight_decay != 0, [&](auto decay) {
      detail::with_flag(o.amsgrad, [&](auto amsgrad) {
        detail::adam_pass<decoupled, decay(), amsgrad()>(params, grads, s.exp_avg.data() + first,
                                                         s.exp_avg_sq.data() + first, vmax, k);
      });
    });
  }
};

using Adam = BasicAdam<decay_style::l2>;
using AdamW = BasicAdam<decay_style::decoupled>;

}  // namespace shardlib::optim
