// shardlib/shard/sharded_model_step.hpp — ShardedModel's step: train_step over one batch or
// micro-batches (the checks every rank makes together, the loss, overflow and norm reduced,
// the skip decided on the host or in the model's space) and the optimizer's step itself, in
// place or offloaded.
// Member definitions: shard/sharded_model.hpp includes this at its end.
#pragma once
#include "shardlib/shard/sharded_model.hpp"
#include "shardlib/shard/step_items.hpp"  // loss_mean::per_item

#include <cmath>        // std::sqrt, std::isfinite
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <memory>       // std::make_shared
#include <optional>     // std::optional
#include <span>         // std::span
#include <string>       // std::string
#include <type_traits>  // std::conditional_t, std::is_same_v, std::remove_cvref_t
#include <utility>      // std::declval, std::move
#include <vector>       // std::vector

namespace shardlib::shard {

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
template <class O, class Target, class LossFn>
auto ShardedModel<Model, Comm, Strategy, T, Optimizer>::run_step(O& opt, std::span<const input> xs,
                                                                 std::span<const Target> ys, LossFn& loss_fn,
                                                                 const step_options& so, bool micro_batches)
    -> step_result_of<space, T> {
  const int rank = comm_->rank();
  std::string problem;  // why this rank cannot run the step ("": it can)
  if (so.max_norm < 0)
    problem = cat("rank ", rank, ": step_options.max_norm must be >= 0 (0: no clipping), got ", so.max_norm);
  else if (!sync_)
    problem = cat("rank ", rank, ": train_step under set_sync(false) (no_sync): its backward would not reduce the "
                  "gradients across ranks, and it runs one whole step; call it with sync on");
  else if (xs.empty() || xs.size() != ys.size())
    problem = cat("rank ", rank, ": train_step over ", xs.size(), " micro-batches of inputs and ", ys.size(),
                  " of targets: it needs one or more of each, as many");
  else if (xs.size() > 1 && !so.no_sync && so.reduction == grad_reduction::sum &&
           (policy_.reduce == reduction::all_reduce || policy_.reduce == reduction::hierarchical))
    problem = cat("rank ", rank, ": train_step over ", xs.size(), " micro-batches each reduced with "
                  "grad_reduction::sum under ", strategy_.name, ": its all-reduce would sum again what the earlier "
                  "micro-batches reduced; use no_sync (one reduction a step) or average");
  if (micro_batches) check_micro_batches(xs.size(), so, problem);
  std::optional<step_items> items;  // loss_mean::per_item: its all-reduce also agrees on `problem`
  if (so.mean == loss_mean::per_item) items.emplace(count_step_items<ops>(*comm_, loss_fn, ys, problem));
  require(problem.empty(), problem);
  const std::size_t n = xs.size();
  const float world = float(comm_->size());  // the ranks an averaging reduction divides by
  const bool on_space = (scaler_ || so.max_norm > 0) && decides_on_space<O>();
  const double* loss_scale = on_space && scaler_ ? scaler_.in_space().data() + scale_slot : nullptr;
  zero_grad();
  using loss_type = std::remove_cvref_t<decltype(loss_fn(std::declval<output&>(), ys[0]).loss)>;
  std::vector<loss_type> losses;
  const bool reshard_last = reshard_after_backward_;  // as the caller set it
  reducer_.set_op(so.reduction == grad_reduction::sum ? comm::reduce_op::sum : comm::reduce_op::avg);
  try {
    for (std::size_t k = 0; k < n; ++k) {
      const bool last = k + 1 == n;
      sync_ = last || !so.no_sync;
      reshard_after_backward_ = last ? reshard_last : so.reshard_after_backward;
      using replicas = typename decltype(reducer_)::replicas;
      reducer_.set_replicas_mode(so.replica_all_reduce ? replicas::each
                                 : !last                ? replicas::skip
                                 : so.no_sync           ? replicas::each
                                                        : replicas::after_skip);
      auto out = forward(xs[k]);
      auto l = loss_fn(out, ys[k]);
      if (n > 1 || scaler_ || items)  // rounded once, in fp32, when the layers compute in 16 bits
        in_fp32<space>(l.grad.span(), [&](auto g) {
          using wide = typename decltype(g)::element_type;  // float, or a float64 model's double
          if (items)
            ops::scale(g, wide(items->gradient_factor(k, so.reduction == grad_reduction::average ? world : 1)));
          else if (n > 1)
            ops::scale(g, wide(1) / wide(n));
          if (scaler_) scaler_.scale(g, loss_scale, false);
        });
      backward(l.grad);
      losses.push_back(std::move(l.loss));
    }
  } catch (...) {
    sync_ = true;
    reshard_after_backward_ = reshard_last;
    reducer_.set_op(comm::reduce_op::avg);  // a later backward of the caller's averages
    reducer_.set_replicas_mode(decltype(reducer_)::replicas::each);
    throw;
  }
  reducer_.set_op(comm::reduce_op::avg);
  reducer_.set_replicas_mode(decltype(reducer_)::replicas::each);
  const auto loss = mean_loss<ops>(std::move(losses), items ? items->loss_weights() : std::vector<double>{});
  // The loss and the units whose gradients overflowed, in the model's space: in float, and a
  // float64 model's on the host in double (R).
  using R = std::conditional_t<std::is_same_v<space, host_space>, T, float>;
  auto shared = ops::template make_scalars<R>(2);
  const bool global = scaler_ || so.loss == loss_report::global_mean;  // every rank decides alike
  if (global) {
    // The sum over ranks, divided by their number when read: per item, each rank's mean over
    // its items weighed by their share (none: nothing, where its mean is NaN).
    const std::span<R> slot(shared.data(), 1);
    if (items && items->mine == 0) {
      ops::fill(slot, R(0));
    } else {
      put_loss<ops>(loss, slot);
      if (items) ops::scale(slot, R(double(items->mine) * world / double(items->all)));
    }
  }
  if constexpr (std::is_same_v<T, float>)  // fp16 loss scaling has float masters (a float64 model has no scaler)
    if (scaler_)
      for (auto& u : units_) ops::add_nonfinite(std::span<const float>(u.grad.span()), shared.data() + 1);
  if (global) ops::all_reduce_in_place(*comm_, std::span<R>(shared.data(), 2), comm::reduce_op::sum);
  if (scaler_)  // also after an overflow, so that the norm reported is the unscaled one (inf or NaN)
    for (auto& u : units_) scaler_.scale(u.grad.span(), loss_scale, true);
  std::optional<typename ops::template scalars<double>> norm_squared;
  if (so.max_norm > 0) norm_squared.emplace(grad_norm_squared());
  if constexpr (!std::is_same_v<space, host_space>)
    if (on_space) return step_decided_on_space(opt, loss, std::move(shared), std::move(norm_squared), so);

  const bool mean = so.loss == loss_report::global_mean;
  step_result_of<space, T> r{};
  R seen[2] = {0, 0};  // shared, on the host once read
  double squared = 0;
  auto issue_reads = [&] {
    ops::issue_to_host(std::span<const R>(shared.data(), 2), std::span<R>(seen));
    if (norm_squared)
      ops::issue_to_host(std::span<const double>(norm_squared->data(), 1), std::span<double>(&squared, 1));
  };
  if (scaler_ || so.max_norm > 0) {  // the host decides: one read of everything, the loss's own read with it
    const R own = read_with<ops>(loss, issue_reads);
    r.loss = mean ? seen[0] / R(world) : own;
  } else if constexpr (std::is_same_v<space, host_space>) {
    issue_reads();
    r.loss = mean ? seen[0] / R(world) : R(loss);
  } else {
    r.loss = mean ? deferred_mean<ops>(loss, std::move(shared), world) : pending<float>(loss);
  }
  const bool overflow = seen[1] != 0;
  r.skipped = overflow;
  if (so.max_norm > 0) {
    const double norm = std::sqrt(squared);
    r.grad_norm = R(norm);
    r.skipped = r.skipped || !std::isfinite(norm);
    if (!r.skipped) {
      const T coefficient = optim::clip_coefficient<T>(norm, so.max_norm);  // a float64 model's in float64
      for (auto& u : units_) ops::scale(u.grad.span(), coefficient);
    }
  }
  if (r.skipped) ++step_;  // parameters and optimizer state stay as they were
  else apply_step(opt);
  if (scaler_) with_rank([&] { scaler_.host().update(overflow); });  // raises on every rank alike: the flag is shared
  return r;
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::check_micro_batches(std::size_t inputs, const step_options& so,
                                                                            const std::string& problem) {
  const int rank = comm_->rank();
  constexpr std::size_t n = 6;
  const std::int64_t mine[n] = {problem.empty(),           std::int64_t(inputs),   so.no_sync,
                                so.reshard_after_backward, so.replica_all_reduce, std::int64_t(so.mean)};
  std::vector<std::int64_t> both(2 * n);
  for (std::size_t i = 0; i < n; ++i) both[i] = mine[i], both[i + n] = -mine[i];
  ops::all_reduce_values(*comm_, std::span<std::int64_t>(both), comm::reduce_op::max);
  require(problem.empty(), problem);
  require(both[n] < 0, "rank ", rank, ": train_step over micro-batches: another rank cannot run it (its error "
          "says why)");
  static constexpr const char* what[n] = {"", "micro-batch counts", "no_sync", "reshard_after_backward",
                                          "replica_all_reduce", "loss_mean"};
  for (std::size_t i = 1; i < n; ++i)
    require(both[i] == -both[i + n], "rank ", rank, ": train_step over ", inputs, " micro-batches (no_sync ",
            so.no_sync, ", reshard_after_backward ", so.reshard_after_backward, ", replica_all_reduce ",
            so.replica_all_reduce, ", loss_mean ", int(so.mean), "): the ranks passed other ", what[i], " (from ",
            -both[i + n], " to ", both[i], "); every rank must run the same micro-batches");
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
template <class O>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::apply_step(O& opt, optim::skip_flag flag) {
  static_assert(std::is_same_v<std::remove_cvref_t<O>, Optimizer>,
                "ShardedModel::step: the model keeps optimizer state of the type it was wrapped for; wrap it "
                "with fully_shard<YourOptimizer>(...) or fully_shard(model, comm, strategy, optimizer, options)");
  // A forward without its backward left units gathered (the root, kept units, ShardGradOp's):
  // their values would be the old ones at the next forward, which finds them gathered.
  release_full_params();
  forwarded_ = false;
  steps_.check(opt, units_, [&](std::size_t i) { return piece(i); });
  if (offload_) {
    require(!flag.skip, "rank ", comm_->rank(), ": a step cancelled on the device cannot be offloaded");
    offloaded_step(opt);
  } else {
    for (std::size_t i = 0; i < units_.size(); ++i) {
      auto& u = units_[i];
      // a compact unit's optimizer steps its trained runs end to end, rounded into place after
      steps_.template step<ops>(opt, u, i, piece(i), master_local(u), std::span<const T>(u.grad.span()),
                                u.compact() ? std::span<C>{} : u.compute_shard.span(), flag);
      if constexpr (compute16)
        if (u.compact()) copies_.template round_runs<ops>(u, master_local(u), u.compute_shard.span());
    }
  }
  if (!policy_.shard_parameters) refresh_values(false);  // a wholly frozen unit's values did not change
  ++step_;
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
template <class O>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::offloaded_step(O& opt) {
  auto& channel = *offload_;
  std::vector<typename space_ops<space>::offload_channel::ticket> sent(units_.size());
  auto send = [&](std::size_t i) {
    sent[i] = channel.to_offload(std::span<const T>(units_[i].grad.span()), units_[i].offload->grad.span());
  };
  try {
    if (!units_.empty()) send(0);
    for (std::size_t i = 0; i < units_.size(); ++i) {
      if (i + 1 < units_.size()) send(i + 1);
      channel.wait(sent[i]);
      auto& u = units_[i];
      auto& o = *u.offload;
      steps_.template step<offload_ops>(opt, u, i, piece(i), o.master.span(), std::span<const T>(o.grad.span()),
                                        u.compact() ? std::span<C>{} : o.compute_copy.span());
      if constexpr (compute16) {
        if (u.compact()) copies_.template round_runs<offload_ops>(u, o.master.span(), o.compute_copy.span());
        channel.from_offload(std::span<const C>(o.compute_copy.span()), u.compute_shard.span());
      } else {
        channel.from_offload(std::span<const T>(o.master.span()), master_local(u));
      }
    }
  } catch (...) {
    // Copies issued before a step raised are fenced too: the next forward's reads
    // (and writes to the gradients sent ahead) must not race them.
    try {
      channel.fence();
    } catch (...) {  // the step's own error is the one to report
    }
    throw;
  }
  channel.fence();
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
template <class O, class L, class Scalars, class Norm>
pending_step_result ShardedModel<Model, Comm, Strategy, T, Optimizer>::step_decided_on_space(
    O& opt, const L& loss, Scalars shared, Norm norm_squared, const step_options& so) {
  auto outcome = std::make_shared<typename ops::template scalars<double>>(
      ops::template make_scalars<double>(outcome_slots));
  const step_rule rule{so.max_norm, bool(scaler_), scaler_ ? scaler_.host() : loss_scaler{}};
  ops::decide_step(rule, shared.data(), norm_squared ? norm_squared->data() : nullptr,
                   scaler_ ? scaler_.in_space().data() : nullptr, outcome->data());
  if (so.max_norm > 0)
    for (auto& u : units_) ops::scale_by(u.grad.span(), outcome->data() + coefficient_slot, false);
  apply_step(opt, optim::skip_flag{outcome->data() + skip_slot});
  return read_step_result<ops>(loss, std::move(shared), std::move(outcome), so, float(comm_->size()), comm_->rank(),
                               rule.scaler.min_scale);
}

}  // namespace shardlib::shard
