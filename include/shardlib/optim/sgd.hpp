// shardlib/optim/sgd.hpp — SGD with momentum, dampening, Nesterov and weight decay (PyTorch semantics).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"        // Buffer
#include "shardlib/core/element.hpp"       // FloatingElement
#include "shardlib/core/error.hpp"         // require
#include "shardlib/optim/optimizer.hpp"   // detail::zeroed_state, require_size, with_flag

#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <string_view>  // std::string_view

namespace shardlib::optim {

namespace detail {

struct sgd_scalars {
  float neg_lr;
  float weight_decay;
  float momentum;       // 0 at the first step, so that buf = 0 * 0 + 1 * g = g exactly
  float one_minus_dampening;  // 1 at the first step
  float nesterov_momentum;    // the momentum itself, for g + momentum * buf
};

// One element of torch.optim's _single_tensor_sgd (torch 1.13), each tensor
// op's arithmetic in its order; buf is read only with Momentum. Sums are
// written product-first for the reason given at adam_update.
template <bool Decay, bool Momentum, bool Nesterov>
SHARDLIB_HD inline void sgd_update(float& p, float g, float& buf, const sgd_scalars& k) {
  if constexpr (Decay) g = k.weight_decay * p + g;  // d_p = d_p.add(param, alpha=weight_decay)
  if constexpr (Momentum) {
    buf = k.one_minus_dampening * g + buf * k.momentum;  // buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
    if constexpr (Nesterov) g = k.nesterov_momentum * buf + g;  // d_p = d_p.add(buf, alpha=momentum)
    else g = buf;
  }
  p = k.neg_lr * g + p;  // param.add_(d_p, alpha=-lr)
}

template <bool Decay, bool Momentum, bool Nesterov, class G>
void sgd_pass(std::span<float> p, std::span<const G> g, float* buf, const sgd_scalars k) {  // k by value: see adam_pass
  const std::size_t n = p.size();
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (Momentum) {
      sgd_update<Decay, true, Nesterov>(p[i], static_cast<float>(g[i]), buf[i], k);
    } else {
      float unused = 0.0f;
      sgd_update<Decay, false, false>(p[i], static_cast<float>(g[i]), unused, k);
    }
  }
}

}  // namespace detail

// SGD (https://pytorch.org/docs/1.13/generated/torch.optim.SGD.html). At step t,
// with g the gradient and mu the momentum:
//   g <- g + weight_decay * p
//   if mu != 0: buf <- g at t = 1, else buf <- mu buf + (1 - dampening) g;
//               g <- g + mu buf with Nesterov, else g <- buf
//   p <- p - lr g
// The momentum buffer starts as the first gradient, not as zero (PyTorch's
// "None until the first step").
struct SGD {
  static constexpr std::string_view name = "SGD";

  struct options_type {
    double lr = 1e-3;  // PyTorch >= 2.2's default; 1.13 requires one
    double momentum = 0;
    double dampening = 0;
    double weight_decay = 0;
    bool nesterov = false;
  };

  struct state {
    Buffer<float> momentum_buffer;  // empty unless made with momentum != 0
    std::int64_t step = 0;

    template <class F>
    void for_each_buffer(F&& f) {
      if (!momentum_buffer.empty()) f(std::string_view("momentum_buffer"), momentum_buffer);
    }
  };

  options_type options;

  void check_options() const {
    const auto& o = options;
    require(o.lr >= 0, name, ": invalid learning rate ", o.lr);
    require(o.momentum >= 0, name, ": invalid momentum ", o.momentum);
    require(o.weight_decay >= 0, name, ": invalid weight_decay ", o.weight_decay);
    require(!o.nesterov || (o.momentum > 0 && o.dampening == 0), name,
            ": Nesterov momentum requires a momentum and zero dampening (momentum ", o.momentum, ", dampening ",
            o.dampening, ")");
  }
  // The options, and that a state of n elements has what they need.
  void check(const state& s, std::size_t n) const {
    check_options();
    require(options.momentum == 0 || !s.momentum_buffer.empty() || n == 0, name, ": momentum is ", options.momentum,
            " but the state was made with momentum 0 (no momentum buffer); make the state after setting "
            "options.momentum");
  }

  // The scalars of step number t (1 for the first), for checked options: what step uses,
  // and what the device's SGD (optim/cuda/sgd.cuh) passes to its kernel or, when the
  // device may cancel a step, computes there (the first step taken starts the buffer).
  SHARDLIB_HD static detail::sgd_scalars scalars_at(const options_type& o, std::int64_t t) {
    const bool first_step = t == 1;
    return {
        static_cast<float>(-o.lr),
        static_cast<float>(o.weight_decay),
        first_step ? 0.0f : static_cast<float>(o.momentum),
        first_step ? 1.0f : static_cast<float>(1 - o.dampening),
        static_cast<float>(o.momentum),
    };
  }

  // 4 bytes per parameter with momentum, none without.
  state make_state(std::size_t n) const {
    return {options.momentum != 0 ? detail::zeroed_state(n) : Buffer<float>{}, 0};
  }

  void step(std::span<float> params, std::span<const float> grads, state& s) const {
    step<float>(params, grads, s);
  }

  // Gradients in another dtype (the reduction dtype) are widened per element in the same pass.
  template <FloatingElement G>
  void step(std::span<float> params, std::span<const G> grads, state& s) const {
    detail::require_size(name, "gradients", grads.size(), params.size());
    if (options.momentum != 0 && !s.momentum_buffer.empty())
      detail::require_size(name, "momentum_buffer entries", s.momentum_buffer.size(), params.size());
    step_segment(params, grads, s, 0);
    ++s.step;
  }

  // Elements [first, first + params.size()) of the state, updated as step number
  // s.step + 1 without counting it: parameter groups (optim/param_groups.hpp) step
  // the segments of one shard with their own options, then count the step once.
  template <FloatingElement G>
  void step_segment(std::span<float> params, std::span<const G> grads, state& s, std::size_t first) const {
    const auto& o = options;
    const std::size_t n = params.size();
    check(s, n);
    detail::require_size(name, "gradients", grads.size(), n);
    const bool momentum = o.momentum != 0;
    if (momentum) {
      require<shape_error>(first + n <= s.momentum_buffer.size(), name, "::step: elements [", first, ", ", first + n,
                           ") of ", s.momentum_buffer.size(), " momentum_buffer entries");
    }

    const detail::sgd_scalars k = scalars_at(o, s.step + 1);
    float* buf = momentum ? s.momentum_buffer.data() + first : nullptr;
    detail::with_flag(o.weight_decay != 0, [&](auto decay) {
      detail::with_flag(momentum, [&](auto with_momentum) {
        detail::with_flag(o.nesterov, [&](auto nesterov) {
          detail::sgd_pass<decay(), with_momentum(), nesterov()>(params, grads, buf, k);
        });
      });
    });
  }
};

}  // namespace shardlib::optim
