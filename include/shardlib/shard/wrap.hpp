// shardlib/shard/wrap.hpp — wrap policies: which layers of a model become sharded units.
#pragma once
#include "shardlib/config.hpp"

#include <cstddef>      // std::size_t
#include <functional>   // std::function
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <typeindex>    // std::type_index
#include <vector>       // std::vector

namespace shardlib::shard {

// Which layers become units: a function of the layer's dotted name, its type,
// and the parameters it would own as a unit — the elements (numel, without the
// layout's alignment gaps) of the distinct Params its subtree lists that no unit
// nested in it claimed and that are used nowhere outside it (a tied Param whose
// other user lies outside counts for the enclosing layer). Layers are asked
// innermost first, so nested units have claimed theirs by then.
using wrap_policy = std::function<bool(std::string_view name, std::type_index type, std::size_t params)>;

// Every layer whose type is one of Ts becomes its own unit (the analogue of
// PyTorch's transformer_auto_wrap_policy); the model itself is always the root
// unit, holding every parameter no nested unit claims.
template <class... Ts>
struct wrap_types {
  bool operator()(std::string_view, std::type_index type, std::size_t) const {
    return ((type == typeid(Ts)) || ...);
  }
};

// The whole model as one unit.
struct wrap_none {
  bool operator()(std::string_view, std::type_index, std::size_t) const { return false; }
};

// Explicit nesting by name: the layers with exactly these dotted names (as the
// model's children(...) name them, e.g. "0.layers.3") become units.
struct wrap_names {
  std::vector<std::string> names;
  bool operator()(std::string_view name, std::type_index, std::size_t) const {
    for (const auto& n : names)
      if (n == name) return true;
    return false;
  }
};

// A layer becomes a unit when the parameters it would own (wrap_policy's count)
// number at least min_params (PyTorch's size_based_auto_wrap_policy and its
// min_num_params). Layers without parameters of their own never do.
struct wrap_min_params {
  std::size_t min_params = 100'000'000;  // torch's default
  bool operator()(std::string_view, std::type_index, std::size_t params) const {
    return params > 0 && params >= min_params;
  }
};

// A layer any of the policies picks becomes a unit:
//   wrap_any{wrap_types<Block>{}, wrap_min_params{1'000'000}}
template <class... Ps>
struct wrap_any : Ps... {
  bool operator()(std::string_view name, std::type_index type, std::size_t params) const {
    return (static_cast<const Ps&>(*this)(name, type, params) || ...);
  }
};
template <class... Ps>
wrap_any(Ps...) -> wrap_any<Ps...>;

}  // namespace shardlib::shard
