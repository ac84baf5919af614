// shardlib/nn/grad_mode.hpp — grad_enabled(ctx): whether a backward may follow this
// forward, for layers that cache activations only for their backward.
#pragma once
#include "shardlib/config.hpp"

#include <concepts>  // std::convertible_to

namespace shardlib::nn {

// A context that knows answers grad_enabled() (the sharded context says false in
// eval mode, where backward raises); any other context may be followed by a
// backward. Layers call this rather than ctx.grad_enabled(), so the Layer
// concept's context_archetype need not offer it.
template <class Ctx>
bool grad_enabled(const Ctx& ctx) {
  if constexpr (requires { { ctx.grad_enabled() } -> std::convertible_to<bool>; }) return ctx.grad_enabled();
  else return true;
}

}  // namespace shardlib::nn
