// shardlib/optim/optimizer.hpp — the Optimizer concept, a diagnostic for user types, and
// what the library's optimizers share (zeroed state buffers, size checks, bool dispatch).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"   // Buffer
#include "shardlib/core/element.hpp"  // bfloat16, half
#include "shardlib/core/error.hpp"    // require, shape_error
#include "shardlib/core/ledger.hpp"   // category

#include <algorithm>    // std::fill_n
#include <concepts>     // std::same_as, std::movable
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <string_view>  // std::string_view
#include <type_traits>  // std::bool_constant

namespace shardlib::optim {

// An optimizer steps one contiguous span of fp32 master parameters (a rank's
// shard of a unit) with the matching gradient span, in one pass:
//
//   typename O::state                 per-shard state: its buffers are Buffer<float>
//                                     under category::optimizer_state, and
//                                     `std::int64_t step` counts the steps taken
//   o.make_state(n) -> O::state       zeroed state for n parameters
//   o.step(params, grads, state)      grads as span<const G> for G = float,
//                                     bfloat16 and half (the reduction dtype);
//                                     a model must accept all three
//   state.for_each_buffer(f)          calls f(name, Buffer<float>&) for every
//                                     per-parameter buffer (checkpoints and
//                                     resharding walk it; names as in PyTorch's
//                                     optimizer state_dict)
//   o.options.lr                      the learning rate, assignable between steps
//                                     (schedules set it)
//
// An optimizer over device memory may also take a step the device can cancel,
// o.step(params, grads, state, compute_copy, skip_flag): train_step then decides on
// the device whether a step with clipping or fp16 loss scaling is taken, and never
// waits for it. Its state counts every step in `step` and the cancelled ones where the
// values are; state.settle() folds those into `step` (one read), and the model calls
// it before handing the state out.
struct skip_flag {
  const double* skip = nullptr;  // in the values' memory: nonzero cancels the step
};

namespace detail {
template <class O>
concept has_state = requires { typename O::state; } && std::movable<typename O::state>;
template <class O>
concept has_make_state = requires(const O& o, std::size_t n) {
  { o.make_state(n) } -> std::same_as<typename O::state>;
};
template <class O, class G>
concept has_step = requires(O& o, std::span<float> p, std::span<const G> g, typename O::state& s) { o.step(p, g, s); };
template <class O>
concept has_step_count = requires(const typename O::state& s) {
  { s.step } -> std::same_as<const std::int64_t&>;
};
// A probe for for_each_buffer: the visitor the library passes.
struct buffer_visitor {
  void operator()(std::string_view, Buffer<float>&) const {}
};
template <class O>
concept has_buffers = requires(typename O::state& s) { s.for_each_buffer(buffer_visitor{}); };
template <class O>
concept has_lr = requires(O& o, double lr) { o.options.lr = lr; };
}  // namespace detail

template <class O>
concept Optimizer = detail::has_state<O> && detail::has_make_state<O> && detail::has_step<O, float> &&
                    detail::has_step<O, bfloat16> && detail::has_step<O, half> && detail::has_step_count<O> &&
                    detail::has_buffers<O> && detail::has_lr<O>;

// static_assert(check_optimizer<MyOpt>()) reports the first requirement MyOpt
// misses by name, where a failed `Optimizer<MyOpt>` only says "not satisfied".
template <class O>
constexpr bool check_optimizer() {
  static_assert(detail::has_state<O>, "Optimizer: missing a movable nested type `state`");
  if constexpr (detail::has_state<O>) {
    static_assert(detail::has_make_state<O>, "Optimizer: missing `state make_state(std::size_t n) const`");
    static_assert(detail::has_step<O, float>,
                  "Optimizer: missing `step(std::span<float>, std::span<const float>, state&)`");
    static_assert(detail::has_step<O, bfloat16> && detail::has_step<O, half>,
                  "Optimizer: `step` must also take gradients as std::span<const bfloat16> and std::span<const half>");
    static_assert(detail::has_step_count<O>, "Optimizer: `state` lacks a `std::int64_t step` member");
    static_assert(detail::has_buffers<O>,
                  "Optimizer: `state` lacks `for_each_buffer(f)` calling f(std::string_view, Buffer<float>&)");
  }
  static_assert(detail::has_lr<O>, "Optimizer: missing a public `options` member with an assignable `lr`");
  return Optimizer<O>;
}

namespace detail {

// A state buffer for n parameters: recorded as optimizer state, zeroed (the
// moments of Adam and the momentum of SGD start at zero).
inline Buffer<float> zeroed_state(std::size_t n) {
  Buffer<float> b(n, category::optimizer_state);
  std::fill_n(b.data(), n, 0.0f);
  return b;
}

// Throws shape_error unless a buffer (gradients or state) has one element per parameter.
inline void require_size(std::string_view who, std::string_view what, std::size_t size, std::size_t params) {
  require<shape_error>(size == params, who, "::step: ", params, " parameters but ", size, " ", what);
}

// Calls f(std::bool_constant<b>{}): turns a runtime flag into a template
// argument, so that the per-element loop carries no branch on it.
template <class F>
void with_flag(bool b, F&& f) {
  if (b) f(std::true_type{});
  else f(std::false_type{});
}

}  // namespace detail
}  // namespace shardlib::optim
