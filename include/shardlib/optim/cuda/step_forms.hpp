// shardlib/optim/cuda/step_forms.hpp — the shorter forms of a device optimizer's step,
// written once for optim::cuda::Adam and SGD: each is the optimizer's full step (over the
// runs of a shard, with a skip flag) over one run that holds the whole shard.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"        // FloatingElement, bfloat16
#include "shardlib/core/error.hpp"          // require
#include "shardlib/optim/optimizer.hpp"     // skip_flag
#include "shardlib/optim/param_groups.hpp"  // segment

#include <span>  // std::span

namespace shardlib::optim::cuda {

// Derived (CRTP) has a `name` and defines
//   step(span<float> params, span<const G> grads, state&, span<H> compute_copy,
//        span<const optim::segment> runs, optim::skip_flag)
// beside `using step_forms<Derived>::step;`.
template <class Derived>
struct step_forms {
  template <class State>
  void step(std::span<float> params, std::span<const float> grads, State& s) const {
    step(params, grads, s, std::span<bfloat16>{});
  }
  // Gradients in another dtype (the reduction dtype) are widened per element in the same pass.
  template <FloatingElement G, class State>
  void step(std::span<float> params, std::span<const G> grads, State& s) const {
    step(params, grads, s, std::span<bfloat16>{});
  }
  // The same, also writing the new parameters rounded to H into compute_copy (the 16-bit
  // copy the next all-gather sends) in the same pass.
  template <FloatingElement G, FloatingElement H, class State>
  void step(std::span<float> params, std::span<const G> grads, State& s, std::span<H> compute_copy) const {
    const optim::segment whole{0, params.size(), 0};
    derived().step(params, grads, s, compute_copy, std::span<const optim::segment>(&whole, 1), optim::skip_flag{});
  }
  // The same, cancelled on the device when *flag.skip != 0 (optim::skip_flag); compute_copy
  // may be empty.
  template <FloatingElement G, FloatingElement H, class State>
  void step(std::span<float> params, std::span<const G> grads, State& s, std::span<H> compute_copy,
            optim::skip_flag flag) const {
    require(flag.skip != nullptr, Derived::name, " (CUDA): a gated step needs the flag's device address");
    const optim::segment whole{0, params.size(), 0};
    derived().step(params, grads, s, compute_copy, std::span<const optim::segment>(&whole, 1), flag);
  }

 private:
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
};

}  // namespace shardlib::optim::cuda
