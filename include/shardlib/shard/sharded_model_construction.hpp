// shardlib/shard/sharded_model_construction.hpp — ShardedModel's construction: the options
// checked, the shard, replica and reshard groups split, the units found and compared across
// ranks, and each unit's storage drawn in place.
// Member definitions: shard/sharded_model.hpp includes this at its end.
#pragma once
#include "shardlib/shard/sharded_model.hpp"

#include <cstddef>      // std::size_t
#include <type_traits>  // std::is_same_v
#include <utility>      // std::move

namespace shardlib::shard {

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
ShardedModel<Model, Comm, Strategy, T, Optimizer>::ShardedModel(Model& model, Comm& comm, Strategy strategy, options o)
    : model_(&model),
      comm_(&comm),
      strategy_(strategy),
      policy_(checked_policy(strategy)),
      opts_(std::move(o)),
      gathers_(opts_.precision, opts_.prefetch),
      reducer_(policy_, opts_.precision),
      steps_(comm.rank()),
      copies_(opts_.seed),
      ctx_(this, opts_.context, checkpoints(model, opts_.checkpoint)) {
  check_precision(opts_.precision);
  if constexpr (!std::is_same_v<T, float>)
    with_rank([&] {
      require(opts_.precision.param == dtype::f32 && opts_.precision.reduce == dtype::f32,
              "ShardedModel: float64 masters gather and reduce in float64; precision.param and precision.reduce "
              "must stay F32 (no 16-bit rounding), got ", name(opts_.precision.param), " and ",
              name(opts_.precision.reduce));
    });
  ops::check_stream(comm, comm.rank());
  check_options();
  if (opts_.precision.param == dtype::f16 || opts_.precision.reduce == dtype::f16) {
    with_rank([&] { check_scaler(opts_.scaler); });
    scaler_ = loss_scale_state<space>(opts_.scaler, comm.rank());
  }
  make_groups();
  if (opts_.offload) copies_.set_offload(&offload_.emplace());
  for (auto& spec : discover_units<C>(model, opts_.wrap)) {
    index_[{spec.address, spec.type}] = int(units_.size());
    auto& u = units_.emplace_back();
    u.name = std::move(spec.name);
    u.params = std::move(spec.params);
    u.layout = std::move(spec.layout);
    u.aliases = std::move(spec.aliases);
    std::size_t owned = 0;  // as wrap policies count: no alignment gaps
    for (const auto* p : u.params) owned += p->numel();
    u.keep_gathered = units_.size() > 1 && opts_.keep_gathered(u.name, spec.type, owned);
  }
  for (auto& u : units_)  // names for errors: the layouts no longer move
    for (std::size_t k = 0; k < u.params.size(); ++k) u.params[k]->owner_name = u.layout.entries[k].name;
  check_same_model<ops>(comm, units_, strategy_.name, policy_, opts_.seed,
                        cat("prefetch ", opts_.prefetch, ", precision ", name(opts_.precision.param), "/",
                            name(opts_.precision.reduce), ", offload ", opts_.offload ? "true" : "false",
                            ", frozen_masters ", opts_.frozen_masters ? "true" : "false", ", frozen_grads ",
                            opts_.frozen_grads ? "true" : "false"),
                        sizeof(T), sizeof(C));
  make_reshard_group();  // after the check: ranks that disagree on it would split differently
  for (auto& u : units_) materialize(u);
  if (!policy_.shard_parameters && !master_in_values()) {
    try {
      refresh_values();
    } catch (...) {
      drain();  // no destructor runs: the gathers still in flight write into units_
      throw;
    }
  }
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::check_options() {
  const int r = comm_->rank();
  require(opts_.prefetch >= 0, "rank ", r, ": options.prefetch must be at least 0, got ", opts_.prefetch);
  require(std::is_same_v<T, float> || !mixed(), "rank ", r, ": mixed precision needs float parameters");
  if constexpr (compute16) {
    require(opts_.precision.param == dtype_of<C>, "rank ", r, ": the model computes in ", name(dtype_of<C>),
            ", so mixed_precision.param must be ", name(dtype_of<C>), ", got ", name(opts_.precision.param));
    require(opts_.precision.reduce == dtype::f32 || opts_.precision.reduce == dtype_of<C>, "rank ", r, ": with ",
            name(dtype_of<C>), " compute, mixed_precision.reduce must be F32 or ", name(dtype_of<C>), ", got ",
            name(opts_.precision.reduce));
    require(policy_.shard_optimizer, "rank ", r, ": 16-bit compute (a model of ", name(dtype_of<C>),
            " layers) keeps fp32 masters beside the values, which ", strategy_.name,
            " does not shard: use a strategy that shards at least optimizer state (ShardOptimizer and up)");
  } else if constexpr (!std::is_same_v<space, host_space>) {
    // 16-bit gathers and reductions of fp32 layers change dtype in place, which is a host loop.
    require(!mixed(), "rank ", r, ": on the device, 16-bit precision means 16-bit compute: build the "
            "model's layers in bfloat16 or half");
  }
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::make_groups() {
  if (policy_.group_size == 0) return;
  const int g = policy_.group_size, w = comm_->size(), r = comm_->rank();
  require(w % g == 0, "rank ", r, ": ", strategy_.name, " group_size ", g, " must divide the world size ", w);
  shard_comm_.emplace(comm_->split(r / g, r));    // the ranks that shard one replica
  replica_comm_.emplace(comm_->split(r % g, r));  // the same shard in every replica
  reducer_.set_replicas(&*replica_comm_);
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::make_reshard_group() {
  const int g = policy_.group(comm_->size()), r = comm_->rank();
  require(policy_.reshard_to == 0 || g % policy_.reshard_to == 0, "rank ", r, ": ", strategy_.name, " reshard_to ",
          policy_.reshard_to, " must divide the shard group's ", g, " ranks");
  if (const int R = policy_.regather(comm_->size()); R > 1 && R < g) reshard_comm_.emplace(comm_->split(r / R, r));
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::materialize(unit_type& u) {
  const std::size_t i = std::size_t(index_of(u));
  const shard_layout part = partition(i);
  const int pr = partition_rank();
  // A unit of frozen parameters keeps no reduced gradients (none are ever reduced), unless
  // they are where its layers write (replicated fp32 layers, nothing sharded); one whose
  // reduce-scatter packs its trained elements keeps those alone.
  const bool scattered = policy_.reduce != reduction::all_reduce;  // each rank receives its piece
  u.packing = trained_packing(u.layout, part, scattered);
  const bool no_grads = u.frozen() && (compute16 || policy_.shard_optimizer);
  const bool trained_only = u.packing.packed() && scattered;
  const std::size_t reduced = no_grads ? 0 : trained_only ? u.packing.trained[std::size_t(pr)] : part.shard_size();
  // Full local gradients of the trained elements alone: where the reduction sends them alone.
  if (!opts_.frozen_grads && policy_.shard_optimizer && (u.frozen() || trained_only)) {
    std::size_t frozen_before = 0;
    for (const auto& e : u.layout.entries) {
      u.local_offsets.push_back(e.requires_grad ? e.offset - frozen_before : unit_type::npos);
      if (!e.requires_grad) frozen_before += e.numel();
    }
    u.local_size = u.frozen() ? 0 : part.padded_size() - frozen_before;
  }
  // Frozen elements without masters: only where the step's gradients leave them out too.
  if (compute16 && !opts_.frozen_masters && (no_grads || trained_only)) {
    auto runs = shard::piece_runs(u, piece(i));
    if (optim::trained_size(runs) < part.shard_size()) u.compact_runs = std::move(runs);
  }
  const std::size_t mastered = u.compact() ? optim::trained_size(u.compact_runs) : part.shard_size();
  // Masters are drawn in place as the model's space draws them (16-bit layers: by compute_copies::draw).
  if (offload_) {  // the optimizer's side
    ledger_scope in_offload(current_ledger().offload());
    auto& o = u.offload.emplace();
    o.master = Buffer<T, offload_space>(mastered, category::parameters);
    if constexpr (!compute16) offload_ops::initialize(u.layout, opts_.seed, part.begin(pr), o.master.span());
    o.grad = Buffer<T, offload_space>(reduced, category::gradients);
    if constexpr (compute16) o.compute_copy = Buffer<C, offload_space>(part.shard_size(), category::parameters);
  }
  if (u.compact()) {
    if (!offload_) u.trained_master = Buffer<T, space>(mastered, category::parameters);
  } else if (!master_in_values() && !(compute16 && offload_)) {
    u.master.emplace(part.numel, part.world, pr, category::parameters);
    if constexpr (!compute16) ops::initialize(u.layout, opts_.seed, part.begin(pr), u.master->local());
  }
  if constexpr (compute16) {
    u.compute_shard = Buffer<C, space>(part.shard_size(), category::parameters);
    copies_.draw(u, part.begin(pr));
  }
  u.grad = Buffer<T, space>(reduced, category::gradients);
  ops::fill(u.grad.span(), T(0));
  if (policy_.shard_parameters) return;
  // Replicated values, padded like the partition so that ZeRO-1 all-gathers in place.
  u.values = Buffer<C, space>(part.padded_size(),
                              master_in_values() ? category::parameters : category::gathered_parameters);
  if (master_in_values()) ops::initialize(u.layout, opts_.seed, 0, u.values.span());
  u.where = state::gathered;
  // ZeRO-1: full local gradients always kept, but a wholly frozen unit's (made for its backward only)
  if (policy_.shard_optimizer && !policy_.shard_gradients && !u.frozen()) {
    u.full_grad = Buffer<C, space>(local_grad_size(u), category::gradients);
    ops::fill(u.full_grad.span(), C(0));
  }
  u.bind(u.values.data(), full_grads(u));
}

}  // namespace shardlib::shard
