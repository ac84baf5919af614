// shardlib/shard/wrap.hpp — wrap policies: which layers of a model become sharded units.
#pragma once
#include "shardlib/config.hpp"

#include <string>       // std::string
#include <string_view>  // std::string_view
#include <typeindex>    // std::type_index
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::shard {

// Every layer whose type is one of Ts becomes its own unit (the analogue of
// PyTorch's transformer_auto_wrap_policy); the model itself is always the root
// unit, holding every parameter no nested unit claims.
template <class... Ts>
struct wrap_types {
  bool operator()(std::string_view, std::type_index type) const { return ((type == typeid(Ts)) || ...); }
};

// The whole model as one unit.
struct wrap_none {
  bool operator()(std::string_view, std::type_index) const { return false; }
};

// Explicit nesting by name: the layers with exactly these dotted names (as the
// model's children(...) name them, e.g. "0.layers.3") become units.
struct wrap_names {
  std::vector<std::string> names;
  bool operator()(std::string_view name, std::type_index) const {
    for (const auto& n : names)
      if (n == name) return true;
    return false;
  }
};

}  // namespace shardlib::shard
