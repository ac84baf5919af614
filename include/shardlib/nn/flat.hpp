// shardlib/nn/flat.hpp — a layer's parameters laid out in one flat buffer: offsets,
// binding the views, and seeded initialisation of any element range.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/nn/layer.hpp"

#include <algorithm>    // std::max, std::min, std::fill
#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint64_t
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v
#include <unordered_map>  // std::unordered_map
#include <unordered_set>  // std::unordered_set
#include <utility>      // std::move, std::pair
#include <vector>       // std::vector

namespace shardlib::nn {

struct flat_entry {
  std::string name;  // dotted, PyTorch-style
  Shape shape;
  init_rule init;
  std::size_t offset;  // first element in the flat buffer
  bool requires_grad = true;  // its Param's: false is a frozen parameter
  std::size_t numel() const { return std::size_t(shape.numel()); }
};

// Parameters in visiting order, each starting at a multiple of `align` elements
// (16 floats = one cache line, so every parameter starts vector-aligned). The
// gaps stay zero in values and gradients, so optimizers may step them harmlessly.
// This is the one place the rule is written: nn::flatten, the sharding engine's
// units and the planner's unit sizes all lay parameters out through append().
struct flat_layout {
  static constexpr std::size_t alignment = 16;
  std::vector<flat_entry> entries;
  std::size_t numel = 0;  // including the alignment gaps

  // Places one more parameter after the last, at the next aligned offset.
  const flat_entry& append(std::string name, const Shape& shape, const init_rule& init, bool requires_grad = true) {
    numel = (numel + alignment - 1) / alignment * alignment;
    entries.push_back({std::move(name), shape, init, numel, requires_grad});
    numel += entries.back().numel();
    return entries.back();
  }
  // Every parameter is frozen (requires_grad = false), and there are some.
  bool all_frozen() const {
    for (const auto& e : entries)
      if (e.requires_grad) return false;
    return !entries.empty();
  }
};

// A Param the layer lists under several names (a tied weight, nn/tied_linear.hpp)
// is laid out once, under its first name, as the sharding engine does; each entry
// records its Param's requires_grad as it is now.
template <class T, Layer L>
flat_layout flatten(L& layer) {
  flat_layout f;
  std::unordered_set<const void*> seen;
  layer.parameters([&](std::string_view name, auto& p) {
    static_assert(std::is_same_v<typename std::remove_reference_t<decltype(p)>::value_type, T>,
                  "flatten<T>: the layer has a parameter of another element type");
    if (seen.insert(&p).second) f.append(std::string(name), p.shape, p.init, p.requires_grad);
  });
  return f;
}

// The further names of the Params the layer lists under several names, {later name, first
// name}: the names flatten leaves out, each with the one it lays the Param out under.
template <Layer L>
std::vector<std::pair<std::string, std::string>> tied_names(L& layer) {
  std::unordered_map<const void*, std::string> first;
  std::vector<std::pair<std::string, std::string>> ties;
  layer.parameters([&](std::string_view name, auto& p) {
    if (const auto [it, fresh] = first.emplace(&p, std::string(name)); !fresh) ties.emplace_back(name, it->second);
  });
  return ties;
}

// Points every Param of `layer` into values/grads (each f.numel elements, or
// null for grads when not needed). The layer must be the one f was made from.
template <class T, Layer L>
void bind(L& layer, const flat_layout& f, T* values, T* grads) {
  std::size_t i = 0;
  std::unordered_set<const void*> seen;
  layer.parameters([&](std::string_view name, Param<T>& p) {
    if (!seen.insert(&p).second) return;  // a tied weight's later name: bound under its first
    require(i < f.entries.size() && f.entries[i].name == name && f.entries[i].shape == p.shape,
            "bind: parameter ", name, " ", p.shape, " does not match the flat layout's entry ", i);
    p.value = values + f.entries[i].offset;
    p.grad = grads ? grads + f.entries[i].offset : nullptr;
    ++i;
  });
  require(i == f.entries.size(), "bind: the layer has ", i, " parameters, the flat layout ", f.entries.size());
}

// Writes the initial values of flat elements [begin, begin + out.size()) into
// out: element j of parameter `name` is init.value(counter_rng(seed, fnv1a(name)), j),
// so any rank can materialise any range — its shard alone — and get exactly the
// values a whole-model initialisation gets there. Gaps and padding are zero.
template <class T>
void initialize_range(const flat_layout& f, std::uint64_t seed, std::size_t begin, std::span<T> out) {
  std::fill(out.begin(), out.end(), T(0));
  const std::size_t end = begin + out.size();
  for (const auto& e : f.entries) {
    const std::size_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + e.numel());
    if (lo >= hi) continue;
    const counter_rng rng(seed, fnv1a(e.name));
    for (std::size_t g = lo; g < hi; ++g) out[g - begin] = T(e.init.value(rng, g - e.offset));
  }
}

}  // namespace shardlib::nn
