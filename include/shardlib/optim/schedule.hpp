// shardlib/optim/schedule.hpp — learning-rate schedules: small value types mapping a step to a rate.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // require

#include <cmath>     // std::cos
#include <concepts>  // std::convertible_to
#include <cstdint>   // std::int64_t
#include <numbers>   // std::numbers::pi

namespace shardlib::optim {

// A schedule gives the learning rate of the update made at `step`, counted
// from 0 (the number of steps already taken: an optimizer state's `step`
// before the call), as PyTorch's LR schedulers and Hugging Face's do:
//   opt.options.lr = schedule(state.step);
// Rates are doubles, as PyTorch's schedulers compute them: the optimizer rounds once,
// where torch does (Adam's step size lr / (1 - beta1^t) is rounded to float from a
// double lr, not from an lr already rounded to float).
template <class S>
concept Schedule = requires(const S& s, std::int64_t step) {
  { s(step) } -> std::convertible_to<double>;
};

struct constant_lr {
  double lr = 1e-3;

  double operator()(std::int64_t) const { return lr; }
};

// Linear warmup, then cosine decay to min_lr, then min_lr; with W = warmup_steps,
// T = total_steps (warmup included) and f = start_factor:
//   t <  W:      lr = peak_lr * (f + (1 - f) * t / W)
//   W <= t < T:  lr = min_lr + (peak_lr - min_lr) * (1 + cos(pi * (t - W) / (T - W))) / 2
//   t >= T:      lr = min_lr
// f = 0 is Hugging Face's get_cosine_schedule_with_warmup (which ends at 0) and
// PyTorch's LinearLR warmup; like them, the first update then has lr 0.
struct warmup_cosine {
  double peak_lr = 1e-3;
  double min_lr = 0;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;
  double start_factor = 0;

  double operator()(std::int64_t t) const {
    const std::int64_t w = warmup_steps, n = total_steps;
    require(t >= 0, "warmup_cosine: negative step ", t);
    require(w >= 0 && n >= w, "warmup_cosine: needs 0 <= warmup_steps <= total_steps, got ", w, " and ", n);
    require(min_lr >= 0 && min_lr <= peak_lr, "warmup_cosine: needs 0 <= min_lr <= peak_lr, got min_lr ", min_lr,
            " and peak_lr ", peak_lr);
    require(start_factor >= 0 && start_factor <= 1, "warmup_cosine: start_factor ", start_factor,
            " is not in [0, 1]");
    if (t < w) return peak_lr * (start_factor + (1 - start_factor) * double(t) / double(w));
    if (t >= n) return min_lr;
    const double progress = double(t - w) / double(n - w);
    return min_lr + (peak_lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
  }
};

}  // namespace shardlib::optim
