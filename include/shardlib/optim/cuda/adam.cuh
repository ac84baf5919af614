// shardlib/optim/cuda/adam.cuh — Adam and AdamW over a shard in device memory:
// the host optimizers' options and semantics, their state in cuda_space, each
// step one fused kernel (ops/cuda/adam.cuh) on the thread's current stream.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"         // Buffer
#include "shardlib/core/element.hpp"        // FloatingElement
#include "shardlib/core/error.hpp"          // require
#include "shardlib/core/ledger.hpp"         // category
#include "shardlib/cuda/copy.hpp"           // fill_bytes_async
#include "shardlib/cuda/current.hpp"        // current_stream
#include "shardlib/cuda/memory_space.hpp"   // cuda_space
#include "shardlib/ops/cuda/adam.cuh"       // adam_update, adam_moments
#include "shardlib/ops/cuda/step_gate.cuh"  // gate_state
#include "shardlib/optim/adam.hpp"          // BasicAdam, decay_style
#include "shardlib/optim/cuda/step_forms.hpp"  // step_forms
#include "shardlib/optim/optimizer.hpp"     // skip_flag
#include "shardlib/optim/param_groups.hpp"  // segment, check_runs

#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <string_view>  // std::string_view

namespace shardlib::optim::cuda {

// optim::BasicAdam's update (bit for bit the same per-element function and,
// from the host, the same scalars; nvcc may fuse multiply-adds that g++ does not,
// so results agree to a few ulps) with the moments in device memory. After a step
// the device may cancel (optim::skip_flag) the device makes the scalars itself,
// its pow within 2 ulp in double: almost always the same floats. params, grads and the compute
// copy must be device memory too; the work is enqueued on
// shardlib::cuda::current_stream() and step returns without waiting for it.
//
// Not an optim::Optimizer: that concept's state buffers are host
// Buffer<float>s, these are Buffer<float, cuda_space> (for_each_buffer passes them).
template <decay_style Style>
struct BasicAdam : step_forms<BasicAdam<Style>> {
  using host_optimizer = optim::BasicAdam<Style>;
  using options_type = typename host_optimizer::options_type;
  static constexpr std::string_view name = host_optimizer::name;

  BasicAdam(options_type o = {}) : options(o) {}  // not explicit: Adam{{.lr = 1e-3}}, as the host optimizers

  struct state {
    Buffer<float, cuda_space> exp_avg;         // m
    Buffer<float, cuda_space> exp_avg_sq;      // v
    Buffer<float, cuda_space> max_exp_avg_sq;  // vmax; empty unless made with amsgrad
    std::int64_t step = 0;
    ops::cuda::gate_state<optim::detail::adam_scalars> gate;  // steps the device may cancel

    template <class F>
    void for_each_buffer(F&& f) {
      f(std::string_view("exp_avg"), exp_avg);
      f(std::string_view("exp_avg_sq"), exp_avg_sq);
      if (!max_exp_avg_sq.empty()) f(std::string_view("max_exp_avg_sq"), max_exp_avg_sq);
    }
    // `step` becomes the count of steps taken (after gated steps: one read).
    void settle() { gate.settle(step, name); }
  };

  options_type options;

  // Zeroed state for n parameters (8 bytes each, 12 with amsgrad), allocated
  // for and zeroed on the current stream.
  state make_state(std::size_t n) const {
    auto zeroed = [](std::size_t count) {
      Buffer<float, cuda_space> b(count, category::optimizer_state);
      shardlib::cuda::fill_bytes_async(b.span(), 0, shardlib::cuda::current_stream());
      return b;
    };
    return {zeroed(n), zeroed(n), options.amsgrad ? zeroed(n) : Buffer<float, cuda_space>{}, 0, {}};
  }

  // The options, and that a state of n elements has what they need (the engine checks
  // every unit's before any steps).
  void check(const state& s, std::size_t n) const {
    host_optimizer{options}.check_options();
    require(!options.amsgrad || !s.max_exp_avg_sq.empty() || n == 0, name,
            " (CUDA): amsgrad is set but the state was made without it (no max_exp_avg_sq); make the state after "
            "setting options.amsgrad");
  }

  using step_forms<BasicAdam>::step;  // the whole shard, with or without a copy and a flag

  // The same over a shard that `runs` tile (optim::segment), one pass per run, leaving
  // the frozen runs' parameters and compute copy as they are; the state holds the
  // other runs' moments end to end, and the gradients are the shard's or the other runs'
  // alone (optim::require_run_grads). The step is counted once, and with flag.skip one
  // gate decides it for every run.
  template <FloatingElement G, FloatingElement H>
  void step(std::span<float> params, std::span<const G> grads, state& s, std::span<H> compute_copy,
            std::span<const optim::segment> runs, optim::skip_flag flag) const {
    const cudaStream_t stream = shardlib::cuda::current_stream();
    const host_optimizer host{options};
    const ops::cuda::adam_moments moments{s.exp_avg.span(), s.exp_avg_sq.span(), s.max_exp_avg_sq.span()};
    const std::size_t trained = optim::trained_size(runs);
    check(s, trained);
    optim::check_runs(name, params.size(), runs, 1);
    ops::cuda::require_adam_sizes(host, moments, trained, params.size(), grads, compute_copy);
    const auto gate = s.gate.open(flag.skip, stream);
    const ops::cuda::adam_gate* gated = gate ? &*gate : nullptr;
    const auto k = ops::cuda::begin_adam_step(host, s.step, stream, gated);
    optim::for_each_trained_run(runs, [&](const optim::segment& r, std::size_t first) {
      auto part = [&](auto b) { return b.empty() ? b : b.subspan(r.begin, r.size); };
      auto state_part = [&](std::span<float> b) { return b.empty() ? b : b.subspan(first, r.size); };
      ops::cuda::adam_update(host,
                             {state_part(moments.exp_avg), state_part(moments.exp_avg_sq),
                              state_part(moments.max_exp_avg_sq)},
                             part(params), optim::run_grads(grads, params.size(), r, first), part(compute_copy), k,
                             stream, gated);
    });
  }
};

using Adam = BasicAdam<decay_style::l2>;
using AdamW = BasicAdam<decay_style::decoupled>;

}  // namespace shardlib::optim::cuda
