// shardlib/nn/layer.hpp — the Layer concept, its diagnostic, and parameter-name helpers.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/param.hpp"

#include <concepts>     // std::same_as
#include <cstddef>      // std::size_t
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <unordered_set>  // std::unordered_set
#include <utility>      // std::forward

namespace shardlib::nn {

// What parameters(v) and children(v) call: v(name, Param<T>&) and v(name, child&).
struct param_visitor_archetype {
  template <class T>
  void operator()(std::string_view name, Param<T>& p) const;
};
struct child_visitor_archetype {
  template <class L>
  void operator()(std::string_view name, L& child) const;
};

// A layer says what it takes and gives (`input`, `output`: tensor types), lists
// its parameters under dotted names, and computes forward and backward with
// explicit gradients: backward(dy) adds the parameter gradients into the bound
// gradient storage (+=, so micro-batches accumulate) and returns dL/dx (an empty
// tensor when the input has no gradient, e.g. token ids). Anything backward
// needs, forward caches in the layer.
namespace detail {
template <class L>
concept has_io_types = requires {
  typename L::input;
  typename L::output;
};
template <class L>
concept has_parameters = requires(L& l, param_visitor_archetype v) { l.parameters(v); };
template <class L>
concept has_forward = has_io_types<L> && requires(L& l, context_archetype& c, const typename L::input& x) {
  { l.forward(c, x) } -> std::same_as<typename L::output>;
};
template <class L>
concept has_backward = has_io_types<L> && requires(L& l, context_archetype& c, const typename L::output& dy) {
  { l.backward(c, dy) } -> std::same_as<typename L::input>;
};
}  // namespace detail

template <class L>
concept Layer = detail::has_io_types<L> && detail::has_parameters<L> && detail::has_forward<L> &&
                detail::has_backward<L>;

// A layer made of layers exposes them, so wrapping can walk the model.
template <class L>
concept Composite = Layer<L> && requires(L& l, child_visitor_archetype v) { l.children(v); };

// static_assert(check_layer<MyLayer>()) names the first requirement MyLayer misses.
template <class L>
constexpr bool check_layer() {
  static_assert(detail::has_io_types<L>, "Layer: missing member types `input` and `output` (the tensor types of x and y)");
  static_assert(detail::has_parameters<L>, "Layer: missing `parameters(visitor)` calling visitor(name, Param<T>&)");
  static_assert(detail::has_forward<L>, "Layer: missing `template <class Ctx> output forward(Ctx&, const input&)`");
  static_assert(detail::has_backward<L>, "Layer: missing `template <class Ctx> input backward(Ctx&, const output&)`");
  return Layer<L>;
}

// "a" + "b" -> "a.b"; an empty prefix leaves the name as it is.
inline std::string join_name(std::string_view prefix, std::string_view name) {
  std::string s(prefix);
  if (!s.empty() && !name.empty()) s += '.';
  s += name;
  return s;
}

// Visits child's parameters with names prefixed by `prefix` (how composites name theirs).
template <class Child, class Visitor>
void visit_parameters(std::string_view prefix, Child& child, Visitor&& v) {
  child.parameters([&](std::string_view name, auto& p) { v(join_name(prefix, name), p); });
}

// Elements of the layer's distinct Params: a tied weight, listed under two names,
// counts once (as Hugging Face and the sharded layout count it).
template <Layer L>
std::size_t parameter_count(L& layer) {
  std::size_t n = 0;
  std::unordered_set<const void*> seen;
  layer.parameters([&](std::string_view, auto& p) {
    if (seen.insert(&p).second) n += p.numel();
  });
  return n;
}

}  // namespace shardlib::nn
