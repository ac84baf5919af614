// shardlib/nn/freeze.hpp — freeze: requires_grad = false for the parameters a list of
// patterns names, before a model is wrapped.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // require
#include "shardlib/core/glob.hpp"   // glob_match
#include "shardlib/nn/layer.hpp"    // Layer

#include <cstddef>      // std::size_t
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <vector>       // std::vector

namespace shardlib::nn {

// Freezes every parameter of `layer` whose dotted name matches one of the glob patterns
// (core/glob.hpp), as requires_grad_(False) over PyTorch's named_parameters(), and
// returns how many it froze (a tied parameter once). A pattern that matches no
// parameter raises, naming it: a typo would otherwise train everything. Call it
// before fully_shard, which reads the flags (docs/design.md, "Frozen parameters").
template <Layer L>
std::size_t freeze(L& layer, const std::vector<std::string>& patterns) {
  std::vector<bool> used(patterns.size(), false);
  std::vector<const void*> frozen;
  layer.parameters([&](std::string_view name, auto& p) {
    for (std::size_t k = 0; k < patterns.size(); ++k) {
      if (!glob_match(patterns[k], name)) continue;
      used[k] = true;
      if (p.requires_grad) frozen.push_back(&p);
      p.requires_grad = false;
    }
  });
  for (std::size_t k = 0; k < patterns.size(); ++k)
    require(used[k], "freeze: no parameter matches '", patterns[k], "' (a glob over dotted names, '*' any run of ",
            "characters, e.g. 'transformer.h.0.*')");
  return frozen.size();
}

// Whether any parameter of `layer` has requires_grad (a layer without parameters trains nothing).
template <Layer L>
bool trains(L& layer) {
  bool any = false;
  layer.parameters([&](std::string_view, auto& p) { any = any || p.requires_grad; });
  return any;
}

}  // namespace shardlib::nn
