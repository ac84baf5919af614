// shardlib/nn/frozen_prefix.hpp — frozen_prefix: the children at the start of a chain
// whose input has no gradient (token ids) that need no backward.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/nn/freeze.hpp"     // trains
#include "shardlib/nn/grad_mode.hpp"  // without_grad

#include <algorithm>    // std::ranges::find
#include <type_traits>  // std::is_integral_v
#include <vector>       // std::vector

namespace shardlib::nn {

// A chain of children (an embedding, then blocks, ...) whose input carries no gradient:
// the children before the first one with a trained parameter have no gradient to make,
// so backward stops there, as PyTorch's autograd never reaches layers whose parameters
// and inputs all have requires_grad false (frozen embeddings and lower layers: partial
// fine-tuning). Their forwards run without gradients (nn::without_grad): they keep no
// activations, and a sharding engine frees their units at once.
//
// The chain calls forward(ctx, child, x) for each child in order after begin(), and in
// backward runs a child only while runs_backward(child) (backward(ctx, child, g) for
// children whose gradient has the type of their output).
class frozen_prefix {
 public:
  void begin() {
    frozen_.clear();
    open_ = true;
  }
  template <class Ctx, class L, class X>
  auto forward(Ctx& ctx, L& child, const X& x) {
    if (open_ && trains(child)) open_ = false;
    if (!open_) return ctx.forward(child, x);
    frozen_.push_back(&child);
    return without_grad(ctx, [&] { return ctx.forward(child, x); });
  }
  template <class L>
  bool runs_backward(const L& child) const {
    return std::ranges::find(frozen_, static_cast<const void*>(&child)) == frozen_.end();
  }
  // g = the child's backward of g, unless it is in the prefix: then false, where the
  // chain's backward stops.
  template <class Ctx, class L, class G>
  bool backward(Ctx& ctx, L& child, G& g) const {
    if (!runs_backward(child)) return false;
    g = ctx.backward(child, g);
    return true;
  }

 private:
  std::vector<const void*> frozen_;  // the children run without gradients, in order
  bool open_ = true;
};

// Whether a chain taking X starts without gradients: integer tensors (token ids).
template <class X>
concept carries_no_gradient = std::is_integral_v<typename X::value_type>;

}  // namespace shardlib::nn
