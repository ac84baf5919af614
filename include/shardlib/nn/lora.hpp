// shardlib/nn/lora.hpp — LoRA across a model, as Hugging Face PEFT's get_peft_model
// does it: adapters on the Linears a list of target modules names (add_lora), the rest
// frozen; merging them into the base weights; and the names a base checkpoint loads
// under. The adapter itself: Linear::add_lora (nn/linear.hpp, nn/lora_adapter.hpp).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/glob.hpp"   // glob_match
#include "shardlib/nn/layer.hpp"    // Layer, Composite, join_name
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/lora_adapter.hpp"

#include <algorithm>    // std::find
#include <cstddef>      // std::size_t
#include <map>          // std::map
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::true_type, std::false_type
#include <unordered_set>  // std::unordered_set
#include <utility>      // std::pair
#include <vector>       // std::vector

namespace shardlib::nn {

namespace detail {
template <class L>
struct is_linear : std::false_type {};
template <class T, class Space>
struct is_linear<Linear<T, Space>> : std::true_type {};

// f(dotted name, linear) for every Linear among layer's children, depth first.
template <class L, class F>
void each_linear(L& layer, const std::string& name, F& f) {
  if constexpr (is_linear<L>::value)
    f(std::string_view(name), layer);
  else if constexpr (Composite<L>)
    layer.children([&](std::string_view child, auto& c) { each_linear(c, join_name(name, child), f); });
}
}  // namespace detail

// Whether PEFT's target_modules entry `target` names the module `name`: the whole
// dotted name or its last components ("c_attn" names "transformer.h.0.attn.c_attn"),
// '*' matching any run of characters (core/glob.hpp).
inline bool lora_target_matches(std::string_view target, std::string_view name) {
  return glob_match(target, name) || glob_match(cat("*.", target), name);
}
// Whether any of `targets` names `name`, marking in `used` each that does.
inline bool lora_targets_name(const std::vector<std::string>& targets, std::string_view name, std::vector<bool>& used) {
  bool named = false;
  for (std::size_t k = 0; k < targets.size(); ++k)
    if (lora_target_matches(targets[k], name)) named = used[k] = true;
  return named;
}

// Adds a LoRA adapter with options `o` to every Linear of `model` (reached through
// children()) that one of `targets` names (lora_target_matches), then freezes every
// parameter but the adapters', as PEFT's get_peft_model(model, LoraConfig(target_modules
// = targets, r, lora_alpha, use_rslora, lora_dropout)) does with bias = "none": only the
// adapters train (those of an earlier call too). Returns the adapted Linears' dotted
// names. A target that names no Linear, or a named Linear that has an adapter already,
// raises before the model is changed, naming it. Call it before the model is wrapped,
// as nn::freeze.
template <Layer L>
std::vector<std::string> add_lora(L& model, const std::vector<std::string>& targets, const lora_options& o = {}) {
  require(!targets.empty(), "add_lora: no target modules (PEFT's target_modules: e.g. {\"c_attn\"} for GPT-2, ",
          "{\"q_proj\", \"v_proj\"} for LLaMA)");
  std::vector<bool> used(targets.size(), false);
  std::vector<std::string> named, linears;
  auto find = [&](std::string_view name, auto& linear) {
    linears.emplace_back(name);
    if (!lora_targets_name(targets, name, used)) return;
    require(!linear.lora(), "add_lora: ", name, " has a LoRA adapter already (one adapter a Linear)");
    named.emplace_back(name);
  };
  detail::each_linear(model, "", find);
  for (std::size_t k = 0; k < targets.size(); ++k) {
    if (used[k]) continue;
    std::string some;
    for (std::size_t i = 0; i < linears.size() && i < 8; ++i) some += cat(i ? ", " : "", linears[i]);
    throw error(cat("add_lora: target '", targets[k], "' names no Linear of the model (a module's dotted name, its ",
                    "last components, or a glob); its Linears: ", linears.empty() ? "none" : some,
                    linears.size() > 8 ? ", ..." : ""));
  }
  std::unordered_set<const void*> adapters;
  auto add = [&](std::string_view name, auto& linear) {
    if (std::find(named.begin(), named.end(), name) != named.end()) linear.add_lora(o);
    if (!linear.lora()) return;
    adapters.insert(&linear.lora()->lora_A);
    adapters.insert(&linear.lora()->lora_B);
  };
  detail::each_linear(model, "", add);
  model.parameters([&](std::string_view, auto& p) {
    if (!adapters.contains(&p)) p.requires_grad = false;
  });
  return named;
}

// The adapted Linears of `model` by dotted name, with their adapters' options.
template <Layer L>
std::map<std::string, lora_options> lora_modules(L& model) {
  std::map<std::string, lora_options> found;
  auto see = [&](std::string_view name, auto& linear) {
    if (linear.lora()) found.emplace(name, linear.lora()->options());
  };
  detail::each_linear(model, "", see);
  return found;
}

// Linear::merge_lora on every adapted Linear of `model` (PEFT's merge, then a fresh
// adapter): the fine-tune folded into the base weights, the adapters reset to B = 0. On
// bound values: an nn::Replicated owner's, or inside a sharded model's
// summon_full_params with writeback (which the engine refuses for 16-bit layers).
// Returns how many it merged.
template <Layer L>
std::size_t merge_lora(L& model) {
  std::size_t n = 0;
  auto merge = [&](std::string_view, auto& linear) {
    if (!linear.lora()) return;
    linear.merge_lora();
    ++n;
  };
  detail::each_linear(model, "", merge);
  return n;
}

// {file name, model name} for every base-layer parameter of the LoRA adapters in
// `model`: the names the base model's checkpoint holds them under ("attn.q.weight" for
// the model's "attn.q.base_layer.weight"). With io::name_map::table a base checkpoint loads
// into the adapted model, the adapters keeping their values (strict = false reports them
// missing; models::load_hf leaves them out with state_dict_options::only instead).
template <Layer L>
std::vector<std::pair<std::string, std::string>> peft_base_names(L& model) {
  std::vector<std::pair<std::string, std::string>> pairs;
  model.parameters([&](std::string_view name, auto&) {
    for (std::string_view leaf : {"base_layer.weight", "base_layer.bias"}) {  // an adapted Linear's own names
      if (!name.ends_with(leaf)) continue;
      const std::size_t at = name.size() - leaf.size();
      if (at == 0 || name[at - 1] == '.')
        pairs.emplace_back(cat(name.substr(0, at), leaf.substr(leaf.find('.') + 1)), std::string(name));
    }
  });
  return pairs;
}

}  // namespace shardlib::nn
