// shardlib/nn/param.hpp — Param<T>: a layer's non-owning parameter view, and its init rule.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/shape.hpp"
#include "shardlib/core/tensor_view.hpp"

#include <cmath>        // std::sqrt
#include <cstdint>      // std::uint64_t
#include <span>         // std::span
#include <string_view>  // std::string_view

namespace shardlib::nn {

// How an owner fills a parameter: PyTorch's default for the layer, drawn from
// the same distribution (not the same numbers: the stream is shardlib's own).
struct init_rule {
  enum kind_t { zeros, ones, uniform, normal } kind = zeros;
  double a = 0, b = 0;  // uniform: [a, b); normal: mean a, standard deviation b

  static constexpr init_rule constant_zero() { return {zeros}; }
  static constexpr init_rule constant_one() { return {ones}; }
  static constexpr init_rule uniform_in(double lo, double hi) { return {uniform, lo, hi}; }
  static constexpr init_rule normal_with(double mean, double stddev) { return {normal, mean, stddev}; }
  // nn.Linear's weight and bias: kaiming_uniform_(a = sqrt(5)) gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  static init_rule linear_default(std::int64_t fan_in) {
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(double(fan_in)) : 0.0;
    return uniform_in(-bound, bound);
  }
  // xavier_uniform_: U(-sqrt(6 / (fan_in + fan_out)), +...).
  static init_rule xavier_uniform(std::int64_t fan_in, std::int64_t fan_out) {
    const double bound = std::sqrt(6.0 / double(fan_in + fan_out));
    return uniform_in(-bound, bound);
  }

  // Element i of the parameter whose random stream is `rng`; the same i gives the
  // same value whichever rank materialises it.
  double value(const counter_rng& rng, std::uint64_t i) const {
    switch (kind) {
      case zeros: return 0.0;
      case ones: return 1.0;
      case uniform: return a + (b - a) * rng.uniform_double(i);
      case normal: return a + b * rng.normal(i);
    }
    return 0.0;
  }
};

// A parameter as a layer sees it: a shape, an init rule, and pointers to value
// and gradient storage that an owner binds (replicated storage, or a sharded
// unit's gathered buffer while the layer runs). Layers never allocate parameters.
template <class T>
struct Param {
  using value_type = T;
  Shape shape;
  init_rule init;
  T* value = nullptr;
  T* grad = nullptr;
  std::string_view owner_name{};  // its dotted name, set by a sharded owner (for errors)
  // PyTorch's requires_grad: false freezes the parameter for a sharding engine, which
  // then keeps its gradient at zero and never steps it (docs/design.md, "Frozen
  // parameters"). The library's layers skip its gradient (a frozen weight's product
  // keeps no input for it, nn::saved_input); a user layer may still write one, which
  // the engine zeroes, unless it was wrapped with options.frozen_grads = false: then a
  // frozen parameter's grad is null in backward (in a wholly frozen unit, or one whose
  // reduction packs its trained elements), as FSDP2 keeps no .grad for it.
  bool requires_grad = true;

  std::size_t numel() const { return std::size_t(shape.numel()); }
  bool bound() const { return value != nullptr || numel() == 0; }
  // Layers call this before reading a parameter: an unbound one means the layer
  // ran outside the context that gathers it (a composite that called
  // child.forward(...) directly instead of ctx.forward(child, ...)).
  // Backward (with_grad) needs the gradient bound too, unless the parameter is frozen.
  void require_bound(std::string_view layer, bool with_grad = false) const {
    if (bound() && (!with_grad || !requires_grad || grad != nullptr || numel() == 0)) return;
    throw error(cat(layer, ": parameter '", owner_name.empty() ? std::string_view("?") : owner_name, "' has no ",
                    bound() ? "gradient" : "values", " bound — its layer ran outside the context that owns it; a ",
                    "composite must run its children through ctx.forward(child, x) and ctx.backward(child, dy)"));
  }
  std::span<T> values() const { return {value, numel()}; }
  std::span<T> grads() const { return {grad, numel()}; }
  TensorView<T> value_view() const { return {value, shape}; }
  TensorView<T> grad_view() const { return {grad, shape}; }
};

}  // namespace shardlib::nn
