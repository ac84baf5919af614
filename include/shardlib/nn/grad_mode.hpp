// shardlib/nn/grad_mode.hpp — grad_enabled(ctx): whether a backward may follow this
// forward, for layers that cache activations only for their backward.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <concepts>  // std::convertible_to

namespace shardlib::nn {

// A context that knows answers grad_enabled(): the plain and the sharded context say
// false inside their no_grad(f) (a frozen prefix, generate()), the sharded one also in
// eval mode, where backward raises, and inside a checkpointed layer's first forward;
// any other context may be followed by a backward. Layers call this rather than
// ctx.grad_enabled(), so the Layer concept's context_archetype need not offer it.
template <class Ctx>
bool grad_enabled(const Ctx& ctx) {
  if constexpr (requires { { ctx.grad_enabled() } -> std::convertible_to<bool>; }) return ctx.grad_enabled();
  else return true;
}

// Runs f() as forwards that no backward follows, where the context can say so (its
// no_grad(f): the plain and the sharded context); with any other context f just runs,
// and its layers keep activations that nothing reads.
template <class Ctx, class F>
decltype(auto) without_grad(Ctx& ctx, F&& f) {
  if constexpr (requires { ctx.no_grad(f); }) return ctx.no_grad(f);
  else return f();
}

// What a layer's backward raises when no forward left it activations; `layer`
// names the layer as its other errors do ("Linear(4 -> 8)"). A shape_error, as a
// backward whose gradient does not match the forward's output.
template <class... Parts>
void require_activations(bool cached, const Parts&... layer) {
  require<shape_error>(cached, layer..., ": backward needs a forward that kept activations: the last forward ran ",
                       "with gradients disabled (eval mode, no_grad, a frozen prefix or a checkpointed layer's first ",
                       "pass) or its backward already ran");
}

}  // namespace shardlib::nn
