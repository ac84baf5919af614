// shardlib/shard/sharded_model_parameters.hpp — ShardedModel's full parameters outside a step:
// summon_full_params and its writeback, full_state_dict, and replicated values refreshed from
// their masters.
// Member definitions: shard/sharded_model.hpp includes this at its end.
#pragma once
#include "shardlib/shard/sharded_model.hpp"

#include <cstddef>      // std::size_t
#include <map>          // std::map
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::shard {

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
template <class F>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::summon_full_params(F&& f, summon_options o) {
  const int r = comm_->rank();
  require(!(o.rank0_only && o.writeback), "rank ", r, ": summon_full_params: rank0_only needs writeback = false");
  if constexpr (!std::is_same_v<space, host_space>)
    require(!o.writeback || (!compute16 && opts_.precision.param == dtype::f32), "rank ", r,
            ": summon_full_params: writing back 16-bit values is a host path; use writeback = false");
  for (auto& u : units_)
    require(!policy_.shard_parameters || u.where == state::sharded, "rank ", r, ": summon_full_params while unit '",
            u.name, "' is gathered: call it between steps (eval() releases a forward without its backward)");
  const bool keep = !o.rank0_only || r == 0;
  if (policy_.shard_parameters)
    for (auto& u : units_) {
      gather(u, true);
      if (keep) u.bind(u.values.data(), nullptr);
      else gathers_.free(u);
    }
  try {
    f();
  } catch (...) {
    release_full_params();
    throw;
  }
  if (o.writeback)
    for (auto& u : units_) write_back(u);
  release_full_params();
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
auto ShardedModel<Model, Comm, Strategy, T, Optimizer>::full_state_dict(bool rank0_only) -> std::vector<named_tensor> {
  const bool keep = !rank0_only || comm_->rank() == 0;
  std::map<std::string, std::size_t> position;  // the model's own order
  model_->parameters([&](std::string_view name, auto&) { position.emplace(std::string(name), position.size()); });
  std::vector<named_tensor> out(keep ? position.size() : 0);
  for (std::size_t i = 0; i < units_.size(); ++i) {
    // An offloaded master is host memory: gathered, it goes to the model's space first
    // (the communicator's memory); alone, the host reads it in place.
    auto collect = [&](std::span<const T> values, bool on_host, bool whole) {
      Buffer<T, space> full, uploaded;
      if (!whole && partitions() > 1) {
        if (on_host) {
          uploaded = Buffer<T, space>(values.size(), category::comm_scratch);
          ops::from_host(values, uploaded.span());
          values = uploaded.span();
        }
        full = Buffer<T, space>(partition(i).padded_size(), category::gathered_parameters);
        shard_comm().all_gather(values, full.span());
        values = full.span();
        on_host = false;
      }
      if (!keep) return;
      for (const auto& e : units_[i].layout.entries) {
        Tensor<T> t(e.shape, category::parameters);
        if (on_host) offload_ops::copy(values.subspan(e.offset, e.numel()), t.span());
        else ops::to_host(values.subspan(e.offset, e.numel()), t.span());
        out[position.at(e.name)] = {e.name, std::move(t)};
      }
    };
    bool whole = false;  // replicated values that hold the master: everything is here
    if constexpr (!compute16)
      if (master_in_values()) {
        collect(std::span<const T>(units_[i].values.span()), false, true);
        whole = true;
      }
    if (!whole)
      with_master_piece(i, [&](std::span<const T> values, auto where) {
        collect(values, !std::is_same_v<typename decltype(where)::type, space>, false);
      });
    if (!keep) continue;
    for (const auto& a : units_[i].aliases)
      out[position.at(a.name)] = {a.name, out[position.at(units_[i].layout.entries[a.entry].name)].value};
  }
  return out;
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::refresh_values(unit_type& u) {
  if (partitions() > 1) {
    gathers_.issue(u, shard_comm(), u.values.span(), master_local(u));
    gathers_.complete(u);
  } else if (!master_in_values()) {
    if constexpr (compute16) {
      ops::copy(std::span<const C>(u.compute_shard.span()), u.values.span());
    } else {
      with_16bit<T>(opts_.precision.param, [&](auto h) {
        ops::template round_to<decltype(h)>(std::span<const T>(u.master->local()), u.values.span());
      });
    }
  }
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::refresh_values(bool frozen_too) {
  auto changed = [&](const unit_type& u) { return frozen_too || !u.frozen(); };
  if (partitions() == 1) {
    for (auto& u : units_)
      if (changed(u)) refresh_values(u);
    return;
  }
  for (auto& u : units_)
    if (changed(u)) gathers_.issue(u, shard_comm(), u.values.span(), master_local(u));
  for (auto& u : units_)
    if (changed(u)) gathers_.complete(u);
}

template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T, class Optimizer>
void ShardedModel<Model, Comm, Strategy, T, Optimizer>::write_back(unit_type& u) {
  const auto part = partition(std::size_t(index_of(u)));
  auto master = master_local(u);
  const auto full = std::span<const C>(u.values.span()).subspan(part.begin(partition_rank()), part.shard_size());
  if constexpr (compute16) {
    if constexpr (std::is_same_v<space, host_space>) copies_.write_back(u, full);
  } else if (opts_.precision.param == dtype::f32) {
    if (!master_in_values()) ops::copy(full, master);
  } else if constexpr (std::is_same_v<space, host_space>) {
    with_16bit<T>(opts_.precision.param, [&](auto h) {
      using H = decltype(h);
      for (std::size_t k = 0; k < master.size(); ++k)
        if (full[k] != T(H(master[k]))) master[k] = full[k];
    });
  }
  if (u.offload && !compute16)
    offload_->wait(offload_->to_offload(std::span<const T>(master), u.offload->master.span()));
  if (!policy_.shard_parameters) refresh_values(u);
}

}  // namespace shardlib::shard
