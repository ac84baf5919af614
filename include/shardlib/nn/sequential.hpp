// shardlib/nn/sequential.hpp — Sequential<Ls...>: layers applied in order (torch.nn.Sequential).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/nn/frozen_prefix.hpp"
#include "shardlib/nn/layer.hpp"

#include <concepts>  // std::same_as
#include <string>    // std::to_string
#include <tuple>     // std::tuple
#include <utility>   // std::index_sequence

namespace shardlib::nn {

// Children are named "0", "1", ... as in PyTorch, so Sequential<Stack<E>, MeanPool,
// Linear<float>> names its head's weight "2.weight". Each child's output type must
// be the next child's input type (checked at compile time). Taking token ids (an
// integer input), its backward stops below the first child with a trained parameter
// (nn::frozen_prefix).
template <Layer... Ls>
  requires(sizeof...(Ls) > 0)
class Sequential {
  using types = std::tuple<Ls...>;
  template <std::size_t... I>
  static constexpr bool chained(std::index_sequence<I...>) {
    return (std::same_as<typename std::tuple_element_t<I, types>::output,
                         typename std::tuple_element_t<I + 1, types>::input> && ...);
  }
  static_assert(chained(std::make_index_sequence<sizeof...(Ls) - 1>{}),
                "Sequential: a child's output type differs from the next child's input type");

 public:
  using input = typename std::tuple_element_t<0, types>::input;
  using output = typename std::tuple_element_t<sizeof...(Ls) - 1, types>::output;

  explicit Sequential(Ls... layers) : layers_(std::move(layers)...) {}

  template <std::size_t I>
  auto& get() { return std::get<I>(layers_); }

  template <class V>
  void children(V&& v) {
    for_each([&](auto& child, std::size_t i) { v(std::to_string(i), child); });
  }
  template <class V>
  void parameters(V&& v) {
    for_each([&](auto& child, std::size_t i) { visit_parameters(std::to_string(i), child, v); });
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    return forward_from<0>(ctx, x);
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    return backward_from<sizeof...(Ls) - 1>(ctx, dy);
  }

 private:
  template <class F>
  void for_each(F&& f) {
    std::apply([&](auto&... child) {
      std::size_t i = 0;
      (f(child, i++), ...);
    }, layers_);
  }
  static constexpr bool skips_frozen = carries_no_gradient<input>;
  template <std::size_t I, class Ctx, class X>
  output forward_from(Ctx& ctx, const X& x) {
    if constexpr (I == 0 && skips_frozen) prefix_.begin();
    auto y = [&] {
      if constexpr (skips_frozen) return prefix_.forward(ctx, std::get<I>(layers_), x);
      else return ctx.forward(std::get<I>(layers_), x);
    }();
    if constexpr (I + 1 == sizeof...(Ls)) return y;
    else return forward_from<I + 1>(ctx, y);
  }
  template <std::size_t I, class Ctx, class DY>
  input backward_from(Ctx& ctx, const DY& dy) {
    if (!prefix_.runs_backward(std::get<I>(layers_))) return input{};
    auto dx = ctx.backward(std::get<I>(layers_), dy);
    if constexpr (I == 0) return dx;
    else return backward_from<I - 1>(ctx, dx);
  }

  types layers_;
  frozen_prefix prefix_;  // begun only by a chain of token ids; else every child runs backward
};

}  // namespace shardlib::nn
