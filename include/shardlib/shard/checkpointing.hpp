// shardlib/shard/checkpointing.hpp — activation checkpointing (which layers keep only
// their input and run forward again in backward) and the context layers see inside a
// sharded model, which runs an engine's hooks around each unit.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // require, cat
#include "shardlib/nn/context.hpp"  // nn::context
#include "shardlib/nn/layer.hpp"    // nn::Layer, nn::Composite, nn::parameter_count, nn::join_name
#include "shardlib/shard/wrap.hpp"  // wrap_policy

#include <any>          // std::any (a checkpointed layer's kept input)
#include <cstdint>      // std::uint64_t
#include <map>          // std::map
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <typeindex>    // std::type_index
#include <utility>      // std::move, std::pair

namespace shardlib::shard {

// The layers a checkpoint policy picks (the root never: recomputing the whole model
// saves nothing), and the inputs their forwards keep until their backward.
class checkpoints {
 public:
  checkpoints() = default;
  template <nn::Layer Model>
  checkpoints(Model& model, const wrap_policy& policy) {
    if constexpr (nn::Composite<Model>)
      model.children([&](std::string_view name, auto& child) { pick(child, std::string(name), policy); });
  }

  template <class L>
  bool picked(const L& layer) const {
    return picked_.contains(key(layer));
  }
  // Keeps x (a tensor's copy shares its storage) and the context's draw count.
  template <class L>
  void keep(const L& layer, const typename L::input& x, std::uint64_t draws) {
    const bool fresh = kept_.try_emplace(key(layer), std::any(x), draws).second;
    require(fresh, "checkpointing: layer ", name_of(layer), " ran forward twice before its backward; a "
            "checkpointed layer keeps one input (call it once per step, or do not checkpoint it)");
  }
  template <class L>
  bool holds(const L& layer) const {
    return kept_.contains(key(layer));
  }
  // Hands back (and forgets) what keep() kept.
  template <class L>
  std::pair<typename L::input, std::uint64_t> take(const L& layer) {
    auto node = kept_.extract(key(layer));
    return {std::any_cast<typename L::input>(std::move(node.mapped().first)), node.mapped().second};
  }
  void clear() { kept_.clear(); }

 private:
  using layer_key = std::pair<const void*, std::type_index>;
  template <class L>
  static layer_key key(const L& layer) {
    return {static_cast<const void*>(&layer), std::type_index(typeid(L))};
  }
  template <class L>
  std::string name_of(const L& layer) const {
    auto it = picked_.find(key(layer));
    return it == picked_.end() ? std::string("?") : cat("'", it->second, "'");
  }
  template <class L>
  void pick(L& layer, const std::string& name, const wrap_policy& policy) {
    if constexpr (nn::Composite<L>)
      layer.children([&](std::string_view child, auto& c) { pick(c, nn::join_name(name, child), policy); });
    if (policy(name, std::type_index(typeid(L)), nn::parameter_count(layer))) picked_.emplace(key(layer), name);
  }

  std::map<layer_key, std::string> picked_;  // with their dotted names, for errors
  std::map<layer_key, std::pair<std::any, std::uint64_t>> kept_;
};

namespace detail {
// An engine without units: checkpoint_context's.
struct no_units {
  struct unit {};
  template <class L>
  unit* find(const L&) {
    return nullptr;
  }
  void pre_forward(unit&) {}
  void post_forward(unit&) {}
  void pre_backward(unit&) {}
  void post_backward(unit&) {}
};
inline no_units no_units_engine;
}  // namespace detail

// The context layers see inside a sharded model: running a child that is a unit
// runs the engine's hooks around it; anything else runs as in the plain context.
//
// Activation checkpointing: the forward of a picked layer runs with grad_enabled()
// false (layers cache nothing; a nested unit is gathered and freed as in any
// forward) and keeps its input and the draw count of random_stream(). Its backward
// gathers its unit (pre_backward, as always), runs the forward again from the kept
// input with the draw count rewound, so dropout draws the same masks, and then the
// backward: the same operations in the same order as without checkpointing.
template <class Engine>
class sharded_context : public nn::context {
 public:
  sharded_context(Engine* e, nn::context::options o, checkpoints c = {}) : nn::context(o), e_(e), ckpt_(std::move(c)) {}

  template <class L, class X>
  auto forward(L& layer, const X& x) {
    auto* u = e_->find(layer);
    if (u) e_->pre_forward(*u);
    auto y = grad_enabled() && ckpt_.picked(layer) ? forward_keeping_input(layer, x) : layer.forward(*this, x);
    if (u) e_->post_forward(*u);
    return y;
  }
  template <class L, class DY>
  auto backward(L& layer, const DY& dy) {
    auto* u = e_->find(layer);
    if (u) e_->pre_backward(*u);
    if (ckpt_.holds(layer)) recompute(layer);
    auto dx = layer.backward(*this, dy);
    if (u) e_->post_backward(*u);
    return dx;
  }

  // False in eval mode (no backward follows), inside a checkpointed layer's first
  // forward and inside no_grad(f): layers then keep no activations (nn::grad_enabled).
  bool grad_enabled() const { return grad_ && checkpointing_ == 0 && nn::context::grad_enabled(); }
  void set_grad_enabled(bool on) {
    grad_ = on;
    if (!on) ckpt_.clear();  // eval(): a forward without its backward keeps nothing
  }
  bool evaluating() const { return !grad_; }
  void forget_kept() { ckpt_.clear(); }
  bool recomputing() const { return recomputing_ > 0; }

 private:
  template <class L>
  typename L::output forward_keeping_input(L& layer, const typename L::input& x) {
    ckpt_.keep(layer, x, draws());
    nn::detail::scoped_depth off(checkpointing_);
    return layer.forward(*this, x);
  }
  template <class L>
  void recompute(L& layer) {
    auto [x, at] = ckpt_.take(layer);
    const std::uint64_t now = draws();
    rewind_draws(at);
    try {
      nn::detail::scoped_depth on(recomputing_);
      layer.forward(*this, x);  // caches what backward needs; the output goes
    } catch (...) {
      rewind_draws(now);
      throw;
    }
    rewind_draws(now);
  }

  Engine* e_;
  checkpoints ckpt_;
  bool grad_ = true;
  int checkpointing_ = 0, recomputing_ = 0;
};

// The plain context with the same activation checkpointing, for unsharded training
// and plan::measure_activations: checkpoint_context ctx({}, checkpoints(model, wrap_types<Block>{})).
class checkpoint_context : public sharded_context<detail::no_units> {
 public:
  explicit checkpoint_context(nn::context::options o = {}, checkpoints c = {})
      : sharded_context(&detail::no_units_engine, o, std::move(c)) {}
};

}  // namespace shardlib::shard
