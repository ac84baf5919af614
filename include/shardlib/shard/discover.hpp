// shardlib/shard/discover.hpp — which layers of a model become units, and which
// parameters each unit owns: the walk the engine and the planner share.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/tied_linear.hpp"
#include "shardlib/shard/wrap.hpp"

#include <cstddef>        // std::size_t
#include <string>         // std::string
#include <string_view>    // std::string_view
#include <type_traits>    // std::is_same_v, std::remove_reference_t, std::remove_pointer_t
#include <typeindex>      // std::type_index
#include <unordered_map>  // std::unordered_map
#include <unordered_set>  // std::unordered_set
#include <utility>        // std::pair, std::move
#include <vector>         // std::vector

namespace shardlib::shard {

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
  std::unordered_map<const nn::Param<C>*, std::size_t> uses;  // how often the whole model lists each Param
  std::unordered_set<const nn::Param<C>*> claimed;            // by the units found so far
  std::vector<unit_spec<C>> units;                            // in depth-first (pre-)order
  listing<C> borrowed;  // Params layers list without owning them (nn::BorrowsParameters)
};

// Children first, so a layer is offered to the wrap policy knowing what nested
// units claimed; it takes its place before them in the unit order.
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
  const std::size_t place = w.units.size();
  if constexpr (nn::Composite<L>)
    layer.children([&](std::string_view child, auto& c) { discover<C>(c, nn::join_name(name, child), false, w); });
  // What this layer would own: every Param of its subtree used nowhere outside it
  // (all of a tied Param's users inside) and not claimed by a nested unit.
  listing<C> listed;
  std::unordered_map<const nn::Param<C>*, std::size_t> here;
  layer.parameters([&](std::string_view pname, nn::Param<C>& p) {
    listed.emplace_back(&p, nn::join_name(name, pname));
    ++here[&p];
  });
  unit_spec<C> u{name, static_cast<const void*>(&layer), std::type_index(typeid(L)), {}, {}, {}};
  std::unordered_map<const nn::Param<C>*, std::size_t> entry;
  std::size_t numel = 0;
  for (auto& [p, pname] : listed) {
    if (here[p] != w.uses[p] || w.claimed.contains(p)) continue;
    if (auto it = entry.find(p); it != entry.end()) {
      u.aliases.push_back({std::move(pname), it->second});
    } else {
      entry.emplace(p, u.params.size());
      u.layout.append(std::move(pname), p->shape, p->init, p->requires_grad);
      u.params.push_back(p);
      numel += p->numel();
    }
  }
  if (!root && !w.wrap(name, std::type_index(typeid(L)), numel)) return;
  w.claimed.insert(u.params.begin(), u.params.end());
  w.units.insert(w.units.begin() + std::ptrdiff_t(place), std::move(u));
}
}  // namespace detail

// The model is always unit 0 (the root); every layer `wrap` picks is another,
// in depth-first order (the forward order for Sequential and Stack models).
// A parameter belongs to the innermost unit that holds every use of it: a
// Param listed once, to the innermost unit around its layer; a tied Param
// (listed under several names), to the lowest common ancestor of the units
// around its users, so it is gathered while either runs and both add into one
// gradient (as FSDP requires of shared parameters). Its first name in the
// model's order names it in the layout; the others are aliases.
template <class C, nn::Layer Model>
std::vector<unit_spec<C>> discover_units(Model& model, const wrap_policy& wrap) {
  detail::walk_state<C> w{wrap, {}, {}, {}, {}};
  model.parameters([&](std::string_view, auto& p) {
    static_assert(std::is_same_v<std::remove_reference_t<decltype(p)>, nn::Param<C>>,
                  "shard: every parameter must be a Param<C> of the model output's element type");
    ++w.uses[&p];
  });
  detail::discover<C>(model, std::string(), true, w);
  for (const auto& [p, name] : w.borrowed) {
    std::size_t borrowings = 0;
    for (const auto& b : w.borrowed) borrowings += b.first == p;
    require(w.uses[p] > borrowings, "fully_shard: parameter '", name, "' is tied to a Param that no other layer of ",
            "the model lists (tied to a layer outside the wrapped model, or to one that was copied or moved since)");
  }
  return std::move(w.units);
}

}  // namespace shardlib::shard
