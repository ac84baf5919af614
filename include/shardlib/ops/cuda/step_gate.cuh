// shardlib/ops/cuda/step_gate.cuh — a device optimizer's step that the device may cancel
// (optim::skip_flag), for any optimizer whose step runs on scalars K made from its step
// number: one thread reads the flag and either counts the step cancelled or makes the
// scalars from the steps taken so far (attempts less those cancelled), which the update's
// threads then read; and the optimizer state's side, which counts and settles them.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/core/pending.hpp"            // count_host_sync
#include "shardlib/cuda/caching_allocator.hpp"  // device_buffer
#include "shardlib/cuda/copy.hpp"               // copy_async, fill_bytes_async
#include "shardlib/cuda/error.hpp"              // check
#include "shardlib/ops/cuda/launch.cuh"         // launch_kernel

#include <cuda_runtime.h>

#include <cstdint>      // std::int64_t
#include <optional>     // std::optional
#include <span>         // std::span
#include <string_view>  // std::string_view

namespace shardlib::ops::cuda {

template <class K>
struct gated_scalars {
  K k;
  int active;  // 0: the step is cancelled
};
template <class K>
struct step_gate {
  const double* skip;         // nonzero: cancel
  double* cancelled;          // steps cancelled (the state's count, on the device)
  gated_scalars<K>* scalars;  // this step's, written by the gate kernel
};

namespace detail {
// at(t): step number t's scalars (the optimizer's scalars_at over its options).
template <class K, class ScalarsAt>
__global__ void step_gate_kernel(ScalarsAt at, std::int64_t attempt, step_gate<K> gate) {
  if (*gate.skip != 0) {
    *gate.cancelled += 1;
    gate.scalars->active = 0;
    return;
  }
  gate.scalars->k = at(attempt - std::int64_t(*gate.cancelled));
  gate.scalars->active = 1;
}

// In an update kernel: the scalars to use (the gate's when there is one, else k), and
// false when the gate cancelled the step.
template <class K>
__device__ bool take_gate(const gated_scalars<K>* gate, K& k) {
  if (!gate) return true;
  if (!gate->active) return false;
  k = gate->k;
  return true;
}
}  // namespace detail

// Step number `attempt`'s gate on the stream: the update kernels after it read its scalars.
template <class K, class ScalarsAt>
void launch_step_gate(const char* name, ScalarsAt at, std::int64_t attempt, const step_gate<K>& gate,
                      cudaStream_t stream) {
  launch_kernel(name, detail::step_gate_kernel<K, ScalarsAt>, 1, 1, 0, stream, at, attempt, gate);
}

// The state's side: made at the first gated step, `cancelled` holds [0] the steps the
// device has cancelled since settle() and [1] a flag that is always 0 (later ungated steps
// go through the gate with it, so that their step number leaves the cancelled steps out
// too); `scalars` the gated step's; `gated_on` the stream the gated steps ran on;
// `unsettled` whether one has run since settle().
template <class K>
struct gate_state {
  shardlib::cuda::device_buffer<double> cancelled;
  shardlib::cuda::device_buffer<gated_scalars<K>> scalars;
  cudaStream_t gated_on = nullptr;
  bool unsettled = false;

  // This step's gate, given the caller's flag (null: ungated), or none.
  std::optional<step_gate<K>> open(const double* skip, cudaStream_t stream) {
    if (skip) {
      if (cancelled.empty()) {
        // Persistent, but not optimizer state in the planner's sense: a few bytes of scratch.
        cancelled = shardlib::cuda::device_buffer<double>(2, category::comm_scratch, stream);
        shardlib::cuda::fill_bytes_async(cancelled.span(), 0, stream);
        scalars = shardlib::cuda::device_buffer<gated_scalars<K>>(1, category::comm_scratch, stream);
      }
      if (skip != cancelled.data() + 1) unsettled = true;
      gated_on = stream;
    } else if (!cancelled.empty()) {
      skip = cancelled.data() + 1;  // the always-0 flag: the step number leaves the cancelled steps out
    }
    if (!skip) return std::nullopt;
    return step_gate<K>{skip, cancelled.data(), scalars.data()};
  }

  // `step` becomes the count of steps taken: after gated steps, the cancelled ones are
  // read on the gated steps' stream (one wait) and taken off.
  void settle(std::int64_t& step, std::string_view optimizer) {
    if (!unsettled) return;
    double n = 0;
    shardlib::cuda::copy_async(std::span<double>(&n, 1), std::span<const double>(cancelled.span().first(1)), gated_on);
    count_host_sync();
    shardlib::cuda::check(cudaStreamSynchronize(gated_on), "optim::cuda::", optimizer,
                          "::state::settle: cudaStreamSynchronize");
    step -= std::int64_t(n);
    shardlib::cuda::fill_bytes_async(cancelled.span().first(1), 0, gated_on);
    unsettled = false;
  }
};

}  // namespace shardlib::ops::cuda
