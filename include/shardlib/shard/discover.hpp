// shardlib/shard/discover.hpp — which layers of a model become units, and which
// parameters each unit owns: the walk the engine and the planner share.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/param.hpp"

#include <functional>     // std::function
#include <string>         // std::string
#include <string_view>    // std::string_view
#include <type_traits>    // std::is_same_v, std::remove_reference_t
#include <typeindex>      // std::type_index
#include <unordered_set>  // std::unordered_set
#include <vector>         // std::vector

namespace shardlib::shard {

// Which layers become units: a function of the layer's dotted name and type
// (wrap_types<...>{}, wrap_names{...}, wrap_none{}; shard/wrap.hpp).
using wrap_policy = std::function<bool(std::string_view, std::type_index)>;

// One unit as discovery finds it: the layer (address and type identify it: a
// composite and its first child can share an address), its dotted name ("" for
// the root), and the parameters no unit inside it claimed, laid out flat.
template <class C>
struct unit_spec {
  std::string name;
  const void* address = nullptr;
  std::type_index type = typeid(void);
  std::vector<nn::Param<C>*> params;  // in layout order
  nn::flat_layout layout;             // entries carry global names
};

namespace detail {
template <class C, class L>
void discover(L& layer, const std::string& name, bool root, const wrap_policy& wrap, std::vector<unit_spec<C>>& units,
              std::unordered_set<const void*>& claimed) {
  int idx = -1;
  if (root || wrap(name, std::type_index(typeid(L)))) {
    idx = int(units.size());
    units.push_back({name, static_cast<const void*>(&layer), std::type_index(typeid(L)), {}, {}});
  }
  if constexpr (nn::Composite<L>)
    layer.children([&](std::string_view child, auto& c) {
      discover<C>(c, nn::join_name(name, child), false, wrap, units, claimed);
    });
  if (idx < 0) return;
  layer.parameters([&](std::string_view pname, auto& p) {
    static_assert(std::is_same_v<std::remove_reference_t<decltype(p)>, nn::Param<C>>,
                  "shard: every parameter must be a Param<C> of the model output's element type");
    if (!claimed.insert(&p).second) return;
    units[std::size_t(idx)].layout.append(nn::join_name(name, pname), p.shape, p.init);
    units[std::size_t(idx)].params.push_back(&p);
  });
}
}  // namespace detail

// The model is always unit 0 (the root); every layer `wrap` picks is another,
// in depth-first order (the forward order for Sequential and Stack models). Each
// unit claims the parameters no unit nested in it claimed.
template <class C, nn::Layer Model>
std::vector<unit_spec<C>> discover_units(Model& model, const wrap_policy& wrap) {
  std::vector<unit_spec<C>> units;
  std::unordered_set<const void*> claimed;
  detail::discover<C>(model, std::string(), true, wrap, units, claimed);
  return units;
}

}  // namespace shardlib::shard
