// shardlib/optim/cuda/sgd.cuh — SGD with momentum, dampening, Nesterov and weight decay
// over a shard in device memory: optim::SGD's options and semantics, its momentum buffer
// in cuda_space, each step one fused kernel (ops/cuda/sgd.cuh) on the thread's current
// stream, a step the device may cancel (optim::skip_flag) as optim::cuda::Adam's.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"         // Buffer
#include "shardlib/core/element.hpp"        // FloatingElement
#include "shardlib/core/error.hpp"          // require, shape_error
#include "shardlib/core/ledger.hpp"         // category
#include "shardlib/cuda/copy.hpp"           // fill_bytes_async
#include "shardlib/cuda/current.hpp"        // current_stream
#include "shardlib/cuda/memory_space.hpp"   // cuda_space
#include "shardlib/ops/cuda/sgd.cuh"        // sgd_update, begin_sgd_step
#include "shardlib/ops/cuda/step_gate.cuh"  // gate_state
#include "shardlib/optim/cuda/step_forms.hpp"  // step_forms
#include "shardlib/optim/optimizer.hpp"     // skip_flag
#include "shardlib/optim/param_groups.hpp"  // segment, check_runs
#include "shardlib/optim/sgd.hpp"           // SGD

#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <string_view>  // std::string_view
#include <utility>      // std::move

namespace shardlib::optim::cuda {

// optim::SGD's update (the same per-element function and scalars; nvcc may fuse
// multiply-adds that g++ does not, so results agree to a few ulps) with the momentum
// buffer in device memory, which, as PyTorch's, starts as the first step's gradient: with
// gated steps, the first step taken. params, grads and the compute copy must be device
// memory too; step returns without waiting for the device.
struct SGD : step_forms<SGD> {
  using host_optimizer = optim::SGD;
  using options_type = host_optimizer::options_type;
  static constexpr std::string_view name = host_optimizer::name;

  SGD(options_type o = {}) : options(o) {}  // not explicit: SGD{{.lr = 1e-2}}, as the host optimizer

  struct state {
    Buffer<float, cuda_space> momentum_buffer;  // empty unless made with momentum != 0
    std::int64_t step = 0;
    ops::cuda::gate_state<optim::detail::sgd_scalars> gate;  // steps the device may cancel

    template <class F>
    void for_each_buffer(F&& f) {
      if (!momentum_buffer.empty()) f(std::string_view("momentum_buffer"), momentum_buffer);
    }
    // `step` becomes the count of steps taken (after gated steps: one read).
    void settle() { gate.settle(step, name); }
  };

  options_type options;

  // Zeroed state for n parameters (4 bytes each with momentum, none without), allocated
  // for and zeroed on the current stream.
  state make_state(std::size_t n) const {
    Buffer<float, cuda_space> b(options.momentum != 0 ? n : 0, category::optimizer_state);
    shardlib::cuda::fill_bytes_async(b.span(), 0, shardlib::cuda::current_stream());
    return {std::move(b), 0, {}};
  }

  // The options, and that a state of n elements has what they need (the engine checks
  // every unit's before any steps).
  void check(const state& s, std::size_t n) const {
    host_optimizer{options}.check_options();
    require(options.momentum == 0 || !s.momentum_buffer.empty() || n == 0, name, " (CUDA): momentum is ",
            options.momentum, " but the state was made with momentum 0 (no momentum buffer); make the state after "
            "setting options.momentum");
  }

  using step_forms<SGD>::step;  // the whole shard, with or without a copy and a flag

  // The same over a shard that `runs` tile (optim::segment), one pass per run, leaving the
  // frozen runs' parameters and compute copy as they are; the momentum buffer holds the
  // other runs' elements end to end, and the gradients are the shard's or the other runs'
  // alone (optim::require_run_grads). The step is counted once, and with flag.skip one gate
  // decides it for every run.
  template <FloatingElement G, FloatingElement H>
  void step(std::span<float> params, std::span<const G> grads, state& s, std::span<H> compute_copy,
            std::span<const optim::segment> runs, optim::skip_flag flag) const {
    const cudaStream_t stream = shardlib::cuda::current_stream();
    const host_optimizer host{options};
    const std::size_t trained = optim::trained_size(runs), n = params.size();
    check(s, trained);
    optim::check_runs(name, n, runs, 1);
    auto require_size = [&](const char* what, std::size_t got, std::size_t want, const char* of) {
      require<shape_error>(got == want, name, " (CUDA): ", what, " has ", got, " entries, ", of, " ", want);
    };
    if (grads.size() != trained) require_size("gradients", grads.size(), n, "the parameters");
    if (options.momentum != 0)
      require_size("momentum_buffer", s.momentum_buffer.size(), trained, "the parameters stepped");
    if (!compute_copy.empty()) require_size("the compute copy", compute_copy.size(), n, "the parameters");
    const auto gate = s.gate.open(flag.skip, stream);
    const ops::cuda::sgd_gate* gated = gate ? &*gate : nullptr;
    const auto k = ops::cuda::begin_sgd_step(host, s.step, stream, gated);
    const std::span<float> buffer = s.momentum_buffer.span();
    optim::for_each_trained_run(runs, [&](const optim::segment& r, std::size_t first) {
      auto part = [&](auto b) { return b.empty() ? b : b.subspan(r.begin, r.size); };
      ops::cuda::sgd_update(host, buffer.empty() ? buffer : buffer.subspan(first, r.size), part(params),
                            optim::run_grads(grads, n, r, first), part(compute_copy), k, stream, gated);
    });
  }
};

}  // namespace shardlib::optim::cuda
