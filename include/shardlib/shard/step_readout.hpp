// shardlib/shard/step_readout.hpp — how a train_step's loss and outcome reach the host:
// the loss put where the model's values are, read together with the step's other
// scalars in one wait, and on a device read only when the caller reads the result.
// Ops is the model's space_ops (shard/space_ops.hpp).
#pragma once
#include "shardlib/core/error.hpp"
#include "shardlib/core/pending.hpp"
#include "shardlib/shard/options.hpp"        // pending_step_result, step_options
#include "shardlib/shard/precision.hpp"      // loss_scaler
#include "shardlib/shard/step_decision.hpp"  // outcome_slot

#include <functional>   // std::function
#include <limits>       // std::numeric_limits
#include <memory>       // std::make_shared, std::shared_ptr
#include <span>         // std::span
#include <type_traits>  // std::conditional_t, std::is_same_v
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::shard {

// What a step reports a loss of type L in: a float64 model's in double, every other in float
// (a device's pending loss, a 16-bit model's loss).
template <class L>
using reported_t = std::conditional_t<std::is_same_v<L, double>, double, float>;

// A loss function's loss into slot[0] of the model's space: a host value as it is, a
// device one (pending) copied there on the device while unread.
template <class Ops, class L, class V>
void put_loss(const L& loss, std::span<V> slot) {
  if constexpr (requires { loss.device(); }) {
    if (const float* d = loss.device()) Ops::copy(std::span<const float>(d, 1), slot);
    else Ops::fill(slot, loss.get());
  } else {
    Ops::fill(slot, V(loss));  // slot is the model's memory: a device's on a device
  }
}

// The loss, with the copies `issue` makes read in the same wait: a pending loss's
// own read waits once for both (and raises the loss function's deferred errors).
template <class Ops, class L, class Issue>
reported_t<L> read_with(const L& loss, Issue&& issue) {
  if constexpr (requires { loss.get_with(issue); }) {
    if (!loss.ready()) return loss.get_with(issue);
    issue();
    Ops::wait_for_reads();
    return loss.get();
  } else {
    issue();
    Ops::wait_for_reads();
    return reported_t<L>(loss);
  }
}

// The micro-batches' mean loss (train_step's accumulation), in float (a float64 model's in
// double): summed in order, each times its weight, or with none given all times 1 / their
// number. A weight of 0 leaves its loss out (a micro-batch without items: NaN); all 0 gives
// NaN. Host values at once; device ones (pending) averaged in the model's space, whose slot
// the result's device() is, read when the caller reads it, each micro-batch's loss read with
// it (raising its loss function's deferred errors: one wait each). One loss of weight 1, or
// of none, is itself.
template <class Ops, class L>
auto mean_loss(std::vector<L> losses, const std::vector<double>& weights = {}) {
  const std::size_t n = losses.size();
  const bool equal = weights.empty();
  if constexpr (requires { losses[0].device(); }) {
    if (n == 1 && (equal || weights[0] == 1)) return losses[0];
    auto slots = std::make_shared<typename Ops::template scalars<float>>(Ops::template make_scalars<float>(n + 1));
    const std::span<float> mean(slots->data() + n, 1);
    bool any = false;
    for (std::size_t i = 0; i < n; ++i) {
      if (!equal && weights[i] == 0) continue;
      const std::span<float> slot(slots->data() + i, 1);
      put_loss<Ops>(losses[i], slot);
      if (!equal) Ops::scale(slot, float(weights[i]));
      Ops::add(std::span<const float>(slot), mean, !any);
      any = true;
    }
    if (!any) Ops::fill(mean, std::numeric_limits<float>::quiet_NaN());
    else if (equal) Ops::scale(mean, 1.f / float(n));
    return L(
        [losses = std::move(losses), slots, n, at = Ops::issued_here()](const std::function<void()>& before_wait) {
          float value = 0;
          std::function<void(std::size_t)> read_from = [&](std::size_t i) {
            if (i < n) return void(read_with<Ops>(losses[i], [&] { read_from(i + 1); }));
            Ops::issue_to_host(std::span<const float>(slots->data() + n, 1), std::span<float>(&value, 1));
            before_wait();
          };
          at.run([&] { read_from(0); });
          return value;
        },
        mean.data());
  } else {
    using R = reported_t<L>;
    if (equal) {
      R sum = 0;  // as the device sums: in order, then times 1 / n
      for (const auto& l : losses) sum += R(l);
      return sum * (R(1) / R(n));
    }
    R sum = 0;  // as the device sums: each times its weight, in order
    bool any = false;
    for (std::size_t i = 0; i < n; ++i)
      if (weights[i] != 0) sum += R(losses[i]) * R(weights[i]), any = true;
    return any ? sum : std::numeric_limits<R>::quiet_NaN();
  }
}

// The global mean, read when the caller reads it: shared[0] / world, in the same
// wait as the loss function's own loss (whose read raises its deferred errors).
template <class Ops, class Scalars>
pending<float> deferred_mean(const pending<float>& loss, Scalars shared, float world) {
  auto kept = std::make_shared<Scalars>(std::move(shared));
  return pending<float>(
      [loss, kept, world, at = Ops::issued_here()](const std::function<void()>& before_wait) {
        float sum = 0;
        at.run([&] {
          read_with<Ops>(loss, [&] {
            Ops::issue_to_host(std::span<const float>(kept->data(), 1), std::span<float>(&sum, 1));
            before_wait();
          });
        });
        return sum / world;
      },
      nullptr);  // the mean is not in device memory as such: only its sum
}

// The result of a step decided in the model's space, read when the caller reads one of
// its fields: one wait for the loss (the loss function's own, and shared[0], the sum
// over ranks, for the global mean) and the decision's `outcome` slots. The read raises
// loss_scaler's error when this step or an earlier unread one was the last skip allowed
// in a row (`min_scale` completes the message).
template <class Ops, class L, class Scalars, class Outcome>
pending_step_result read_step_result(const L& loss, Scalars shared, std::shared_ptr<Outcome> outcome,
                                     const step_options& so, float world, int rank, float min_scale) {
  struct readout {
    float loss;
    double outcome[outcome_slots];
  };
  const bool mean = so.loss == loss_report::global_mean;
  auto kept = std::make_shared<Scalars>(std::move(shared));
  const pending<readout> all(
      [loss, kept, outcome, mean, world, rank, min_scale,
       at = Ops::issued_here()](const std::function<void()>& before_wait) {
        readout r{};
        float sum = 0;
        at.run([&] {
          const float own = read_with<Ops>(loss, [&] {
            if (mean) Ops::issue_to_host(std::span<const float>(kept->data(), 1), std::span<float>(&sum, 1));
            Ops::issue_to_host(std::span<const double>(outcome->data(), outcome_slots), std::span<double>(r.outcome));
            before_wait();
          });
          r.loss = mean ? sum / world : own;
        });
        if (r.outcome[exhausted_scale_out] != 0) {  // this step, or an earlier one not read
          loss_scaler s{};
          s.skipped_in_row = int(r.outcome[exhausted_in_row_out]);
          s.scale = float(r.outcome[exhausted_scale_out]);
          s.min_scale = min_scale;
          throw error(cat("rank ", rank, ": ", s.exhausted_message()));
        }
        return r;
      },
      nullptr);
  // Each field reads `all`, once for all three. (A caller's before_wait passed to a
  // second field's read would run with no wait after it; nothing passes one to these.)
  pending_step_result r{pending<float>([all](const auto& bw) { return all.get_with(bw).loss; }, nullptr),
                        std::nullopt,
                        pending<bool>([all](const auto& bw) { return all.get_with(bw).outcome[skip_slot] != 0; },
                                      nullptr)};
  if (so.max_norm > 0)
    r.grad_norm = pending<float>([all](const auto& bw) { return float(all.get_with(bw).outcome[norm_slot]); },
                                 nullptr);
  return r;
}

}  // namespace shardlib::shard
