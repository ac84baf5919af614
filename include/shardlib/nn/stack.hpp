// shardlib/nn/stack.hpp — Stack<L>: N layers of one type applied in order (torch.nn.TransformerEncoder's `layers`).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/nn/layer.hpp"

#include <concepts>  // std::same_as
#include <cstddef>   // std::size_t
#include <string>    // std::string
#include <vector>    // std::vector

namespace shardlib::nn {

namespace detail {
// L::options when L has one, so Stack<L>(n, {.field = ...}) can deduce it.
template <class L>
struct options_of {
  struct type {};
};
template <class L>
  requires requires { typename L::options; }
struct options_of<L> {
  using type = typename L::options;
};
}  // namespace detail

// Children are named "layers.0", "layers.1", ... as in torch.nn.TransformerEncoder,
// so a state dict moves between the two unchanged. Each copy is initialised on
// its own (the owner draws each parameter from its own name's stream).
template <Layer L>
  requires std::same_as<typename L::input, typename L::output>
class Stack {
 public:
  using input = typename L::input;
  using output = typename L::output;

  Stack(std::size_t n, const L& prototype) : layers_(n, prototype) {}
  template <class Options = typename detail::options_of<L>::type>
    requires std::constructible_from<L, Options>
  Stack(std::size_t n, const Options& o) : layers_(n, L(o)) {}

  std::size_t size() const { return layers_.size(); }
  L& operator[](std::size_t i) { return layers_[i]; }

  template <class V>
  void children(V&& v) {
    for (std::size_t i = 0; i < layers_.size(); ++i) v("layers." + std::to_string(i), layers_[i]);
  }
  template <class V>
  void parameters(V&& v) {
    for (std::size_t i = 0; i < layers_.size(); ++i) visit_parameters("layers." + std::to_string(i), layers_[i], v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    input h = x;
    for (auto& l : layers_) h = ctx.forward(l, h);
    return h;
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    output g = dy;
    for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) g = ctx.backward(*it, g);
    return g;
  }

 private:
  std::vector<L> layers_;
};

}  // namespace shardlib::nn
