// shardlib/shard/discover.hpp — which layers of a model become units, and which
// parameters each unit owns: the walk the engine and the planner share.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/tied_linear.hpp"

#include <cstddef>        // std::size_t
#include <functional>     // std::function
#include <string>         // std::string
#include <string_view>    // std::string_view
#include <type_traits>    // std::is_same_v, std::remove_reference_t
#include <typeindex>      // std::type_index
#include <unordered_map>  // std::unordered_map
#include <unordered_set>  // std::unordered_set
#include <utility>        // std::pair
#include <vector>         // std::vector

namespace shardlib::shard {

// Which layers become units: a function of the layer's dotted name and type
// (wrap_types<...>{}, wrap_names{...}, wrap_none{}; shard/wrap.hpp).
using wrap_policy = std::function<bool(std::string_view, std::type_index)>;

// Another name of a unit's parameter: a Param the model lists more than once
// (tied weights) is laid out once, under the first name the model lists it by.
struct param_alias {
  std::string name;   // dotted, global
  std::size_t entry;  // index into the unit's layout entries
};

// One unit as discovery finds it: the layer (address and type identify it: a
// composite and its first child can share an address), its dotted name ("" for
// the root), and the parameters it owns, laid out flat.
template <class C>
struct unit_spec {
  std::string name;
  const void* address = nullptr;
  std::type_index type = typeid(void);
  std::vector<nn::Param<C>*> params;  // in layout order
  nn::flat_layout layout;             // entries carry global names
  std::vector<param_alias> aliases;   // further names of tied parameters
};

namespace detail {
template <class C>
using listing = std::vector<std::pair<nn::Param<C>*, std::string>>;  // (Param, global name), in visiting order

template <class C>
struct walk_state {
  const wrap_policy& wrap;
  std::vector<unit_spec<C>> units;
  std::vector<listing<C>> listed;  // per unit: what its parameters() visits (its whole subtree)
  listing<C> borrowed;             // Params layers list without owning them (nn::BorrowsParameters)
};

template <class C, class L>
void discover(L& layer, const std::string& name, bool root, walk_state<C>& w) {
  if constexpr (nn::BorrowsParameters<L>)
    layer.borrowed_parameters([&](std::string_view pname, auto* source) {
      static_assert(std::is_same_v<std::remove_pointer_t<decltype(source)>, nn::Param<C>>,
                    "shard: every parameter must be a Param<C> of the model output's element type");
      const std::string full = nn::join_name(name, pname);
      require(source != nullptr, "fully_shard: parameter '", full, "' is not tied to anything (ties are dropped ",
              "when a layer is copied or moved): tie it once the model is in place");
      w.borrowed.emplace_back(source, full);
    });
  int idx = -1;
  if (root || w.wrap(name, std::type_index(typeid(L)))) {
    idx = int(w.units.size());
    w.units.push_back({name, static_cast<const void*>(&layer), std::type_index(typeid(L)), {}, {}, {}});
    w.listed.emplace_back();
  }
  if constexpr (nn::Composite<L>)
    layer.children([&](std::string_view child, auto& c) { discover<C>(c, nn::join_name(name, child), false, w); });
  if (idx < 0) return;
  layer.parameters([&](std::string_view pname, auto& p) {
    static_assert(std::is_same_v<std::remove_reference_t<decltype(p)>, nn::Param<C>>,
                  "shard: every parameter must be a Param<C> of the model output's element type");
    w.listed[std::size_t(idx)].emplace_back(&p, nn::join_name(name, pname));
  });
}
}  // namespace detail

// The model is always unit 0 (the root); every layer `wrap` picks is another,
// in depth-first order (the forward order for Sequential and Stack models).
// A parameter belongs to the innermost unit that holds every use of it: a
// Param listed once, by the innermost unit around its layer; a tied Param
// (listed under several names), by the lowest common ancestor of the units
// around its users, so it is gathered while either runs and both add into one
// gradient (as FSDP requires of shared parameters). Its first name in the
// model's order names it in the layout; the others are aliases.
template <class C, nn::Layer Model>
std::vector<unit_spec<C>> discover_units(Model& model, const wrap_policy& wrap) {
  detail::walk_state<C> w{wrap, {}, {}, {}};
  detail::discover<C>(model, std::string(), true, w);
  std::unordered_map<const nn::Param<C>*, std::size_t> uses;  // listings in the whole model
  for (const auto& [p, name] : w.listed[0]) ++uses[p];
  for (const auto& [p, name] : w.borrowed) {
    std::size_t borrowings = 0;
    for (const auto& b : w.borrowed) borrowings += b.first == p;
    require(uses[p] > borrowings, "fully_shard: parameter '", name, "' is tied to a Param that no other layer of ",
            "the model lists (tied to a layer outside the wrapped model, or to one that was copied or moved since)");
  }
  std::unordered_set<const nn::Param<C>*> claimed;
  for (std::size_t i = w.units.size(); i-- > 0;) {  // nested units come after their ancestors: innermost first
    auto& u = w.units[i];
    std::unordered_map<const nn::Param<C>*, std::size_t> here;
    for (const auto& [p, name] : w.listed[i]) ++here[p];
    std::unordered_map<const nn::Param<C>*, std::size_t> mine;
    for (auto& [p, name] : w.listed[i]) {
      if (here[p] != uses[p]) continue;  // used outside this unit too: an enclosing unit owns it
      if (auto it = mine.find(p); it != mine.end()) {
        u.aliases.push_back({std::move(name), it->second});
      } else if (claimed.insert(p).second) {
        mine.emplace(p, u.params.size());
        u.layout.append(std::move(name), p->shape, p->init);
        u.params.push_back(p);
      }
    }
  }
  return std::move(w.units);
}

}  // namespace shardlib::shard
