// shardlib/shard/reduce.hpp — gradient reduction: a unit's full local gradients
// averaged (or summed) across ranks into the gradients its optimizer steps, as the policy says.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/shard/packing.hpp"
#include "shardlib/shard/precision.hpp"
#include "shardlib/shard/space_ops.hpp"
#include "shardlib/shard/strategy.hpp"

#include <span>         // std::span
#include <type_traits>  // std::is_same_v
#include <vector>       // std::vector, std::erase_if

namespace shardlib::shard {

// policy.reduce picks the collective:
//   all_reduce       the full gradients (u.grad, which layers write) averaged in place
//   reduce_scatter   u.full_grad averaged into this rank's shard of u.grad, over the shard group
//   hierarchical     reduce_scatter, then the shard averaged across the replica groups
// and the reduce dtype and the layers' dtype the buffers:
//   same dtype (fp32 layers and reduction, or 16-bit both)
//                    sent as they are; received in u.grad when it holds nothing yet,
//                    else (or when 16-bit) in scratch, added (widened) after
//   16-bit layers, fp32 reduction
//                    widened into scratch.wide first
//   fp32 layers, 16-bit reduction (host)
//                    narrowed in place, received in the first half of scratch.reduce
// A unit of frozen and trained parameters whose packing is narrower than its pieces
// (u.packing, shard/packing.hpp) sends its trained elements alone: packed (and widened,
// as above) into scratch.wide, or scratch.packed when 16-bit both; its full gradients
// released at once; received in scratch.reduce (or scratch.narrow) and added into u.grad,
// which holds the trained elements of this rank's piece alone. An all-reduce's (one piece,
// u.grad the layers' own gradients) goes back into the trained runs of u.grad. Full local
// gradients of the trained elements alone (options.frozen_grads = false) are packed
// piece by piece as they lie.
// At most one unit's reduction is in flight while the next unit computes.
template <class Unit, class T, class C, class Space, class Comm>
class gradient_reducer {
  using ops = space_ops<Space>;
  using unit_type = Unit;
  static constexpr bool compute16 = !std::is_same_v<C, T>;
  static constexpr bool on_host = std::is_same_v<Space, host_space>;

 public:
  gradient_reducer(const policy& p, const mixed_precision& m) : policy_(p), precision_(m) {}
  // HybridShard's replica group (the ranks that hold the same shard), for hierarchical reduction.
  void set_replicas(Comm* replicas) { replicas_ = replicas; }
  // avg (the default) or sum over every rank; hierarchical reduction applies it in both stages.
  void set_op(comm::reduce_op op) { op_ = op; }
  // Hierarchical reduction's second stage across the replicas: run by each reduction (each),
  // left out (skip: micro-batches before the last, FSDP2's set_requires_all_reduce(False)), or
  // run over the whole reduced piece, which then holds the skipped ones' too (after_skip).
  enum class replicas { each, skip, after_skip };
  void set_replicas_mode(replicas m) { replicas_mode_ = m; }

  void issue(unit_type& u, Comm& shard_group, Comm& world) {
    finish_all_except(&u);
    in_flight_.push_back(&u);  // from here on: drain() drops its scratch, should the issue fail
    const dtype rd = precision_.reduce;
    if (u.packing.packed()) {
      issue_packed(u, shard_group, world);
    } else if (policy_.reduce == reduction::all_reduce) {
      all_reduce(u, world, u.grad.span());
    } else if (compute16 && rd != dtype::f32) {
      u.scratch.narrow = Buffer<C, Space>(u.grad.span().size(), category::comm_scratch);
      u.reduce_work =
          shard_group.reduce_scatter_async(std::span<const C>(u.full_grad.span()), u.scratch.narrow.span(), op_);
    } else {
      std::span<T> send;
      if constexpr (compute16) {
        u.scratch.wide = Buffer<T, Space>(u.full_grad.size(), category::comm_scratch);
        ops::widen_add(std::span<const C>(u.full_grad.span()), u.scratch.wide.span(), true);
        release_full_grad(u);
        send = u.scratch.wide.span();
      } else {
        send = u.full_grad.span();
      }
      auto into = u.grad.span();
      if (!u.grad_clean || (!compute16 && rd != dtype::f32)) {
        u.scratch.reduce = Buffer<T, Space>(into.size(), category::comm_scratch);
        into = u.scratch.reduce.span();
      }
      reduce_scatter(u, shard_group, send, into);
    }
    u.reducing = true;
  }

  void finish(unit_type& u) {
    if (!u.reducing) return;
    u.reduce_work.wait();
    u.reducing = false;
    const dtype rd = precision_.reduce;
    if (u.packing.packed()) {
      finish_packed(u);
    } else if (policy_.reduce == reduction::all_reduce) {
      if constexpr (on_host && !compute16)
        if (rd != dtype::f32) with_16bit<T>(rd, [&](auto h) { widen_in_place<decltype(h)>(u.grad.span()); });
    } else {
      const bool widened = !u.scratch.wide.empty();  // full gradients released when widened
      u.scratch.wide.reset();
      if constexpr (compute16)  // the 16-bit reduction's target
        if (!u.scratch.narrow.empty()) {
          take_received(u, std::span<const C>(u.scratch.narrow.span()));
          u.scratch.narrow.reset();
        }
      if (!u.scratch.reduce.empty()) {
        if constexpr (on_host && !compute16)
          if (rd != dtype::f32) with_16bit<T>(rd, [&](auto h) { widen_in_place<decltype(h)>(u.scratch.reduce.span()); });
        take_received(u, std::span<const T>(u.scratch.reduce.span()));
        u.scratch.reduce.reset();
      }
      if (!widened) release_full_grad(u);
      if (policy_.reduce == reduction::hierarchical && replicas_mode_ != replicas::skip)
        replicas_->all_reduce(u.grad.span(), op_);
    }
    u.grad_clean = false;
  }

  // Waits for every reduction in flight but `keep`'s (null: all of them).
  void finish_all_except(const unit_type* keep) {
    for (auto* u : in_flight_)
      if (u != keep) finish(*u);
    std::erase_if(in_flight_, [](const unit_type* u) { return !u->reducing; });
  }
  // Waits for every reduction in flight and drops its result and scratch: a rank that
  // fails mid-step must not free buffers a collective still writes, and a later
  // reduction must not add this one's scratch (a unit issued or finished only in part
  // too: it is in flight from its issue until finish_all_except drops it).
  void drain() noexcept {
    for (auto* u : in_flight_) {
      if (u->reducing) {
        try {
          u->reduce_work.wait();
        } catch (...) {
        }
        u->reducing = false;
      }
      u->scratch.reduce.reset();
      u->scratch.wide.reset();
      u->scratch.narrow.reset();
      u->scratch.packed.reset();
    }
    in_flight_.clear();
  }

 private:
  void issue_packed(unit_type& u, Comm& shard_group, Comm& world) {
    const reduce_packing& k = u.packing;
    const dtype rd = precision_.reduce;
    if (policy_.reduce == reduction::all_reduce) {  // one piece: the layers' gradients themselves
      u.scratch.wide = Buffer<T, Space>(k.width, category::comm_scratch);
      pack<ops>(k, std::span<const T>(u.grad.span()), u.scratch.wide.span());
      all_reduce(u, world, u.scratch.wide.span());
      return;
    }
    const std::size_t all = k.width * k.runs.size();
    if (compute16 && rd != dtype::f32) {
      u.scratch.packed = Buffer<C, Space>(all, category::comm_scratch);
      pack_from(u, u.scratch.packed.span());
      u.scratch.narrow = Buffer<C, Space>(k.width, category::comm_scratch);
      u.reduce_work = shard_group.reduce_scatter_async(std::span<const C>(u.scratch.packed.span()),
                                                       u.scratch.narrow.span(), op_);
    } else {
      u.scratch.wide = Buffer<T, Space>(all, category::comm_scratch);
      pack_from(u, u.scratch.wide.span());
      u.scratch.reduce = Buffer<T, Space>(k.width, category::comm_scratch);
      reduce_scatter(u, shard_group, u.scratch.wide.span(), u.scratch.reduce.span());
    }
    release_full_grad(u);
  }

  // u's full local gradients packed into `out`: laid out as the unit, or as its trained elements alone.
  template <class To>
  void pack_from(unit_type& u, std::span<To> out) {
    const std::span<const C> full(u.full_grad.span());
    if (u.local_trained_only()) pack_trained<ops>(u.packing, full, out);
    else pack<ops>(u.packing, full, out);
  }

  // x all-reduced in place; in the reduce dtype, narrowed in place first when that is 16-bit
  // (fp32 layers on the host), widened back by finish().
  void all_reduce(unit_type& u, Comm& world, std::span<T> x) {
    if (precision_.reduce == dtype::f32) {
      u.reduce_work = world.all_reduce_async(std::span<const T>(x), x, op_);
    } else if constexpr (on_host && !compute16) {
      with_16bit<T>(precision_.reduce, [&](auto h) {
        using H = decltype(h);
        auto g = narrow_in_place<H>(x);
        u.reduce_work = world.all_reduce_async(std::span<const H>(g), g, op_);
      });
    }
  }
  // send reduce-scattered into `into` likewise: 16-bit ones narrowed in place, received in
  // the first half of `into`.
  void reduce_scatter(unit_type& u, Comm& group, std::span<T> send, std::span<T> into) {
    if (precision_.reduce == dtype::f32 || compute16) {
      u.reduce_work = group.reduce_scatter_async(std::span<const T>(send), into, op_);
    } else if constexpr (on_host && !compute16) {
      with_16bit<T>(precision_.reduce, [&](auto h) {
        using H = decltype(h);
        auto narrow = narrow_in_place<H>(send);
        std::span<H> recv(reinterpret_cast<H*>(into.data()), into.size());
        u.reduce_work = group.reduce_scatter_async(std::span<const H>(narrow), recv, op_);
      });
    }
  }

  void finish_packed(unit_type& u) {
    const reduce_packing& k = u.packing;
    const dtype rd = precision_.reduce;
    if (policy_.reduce == reduction::all_reduce) {
      auto packed = u.scratch.wide.span();
      if constexpr (on_host && !compute16)
        if (rd != dtype::f32) with_16bit<T>(rd, [&](auto h) { widen_in_place<decltype(h)>(packed); });
      unpack<ops>(k, std::span<const T>(packed), u.grad.span());
      u.scratch.wide.reset();
      return;
    }
    u.scratch.wide.reset();  // what was sent
    u.scratch.packed.reset();
    const bool hierarchical = policy_.reduce == reduction::hierarchical;
    if constexpr (compute16)
      if (!u.scratch.narrow.empty()) {
        const std::span<const C> got(u.scratch.narrow.span());
        if (!hierarchical) {
          take_received(u, got);
          u.scratch.narrow.reset();
          return;
        }
        u.scratch.reduce = Buffer<T, Space>(k.width, category::comm_scratch);  // averaged across replicas in fp32
        ops::widen_add(got, u.scratch.reduce.span(), true);
        u.scratch.narrow.reset();
      }
    auto got = u.scratch.reduce.span();
    if constexpr (on_host && !compute16)
      if (rd != dtype::f32) with_16bit<T>(rd, [&](auto h) { widen_in_place<decltype(h)>(got); });
    if (hierarchical && replicas_mode_ == replicas::each) replicas_->all_reduce(got.first(u.grad.size()), op_);
    take_received(u, std::span<const T>(got));
    if (hierarchical && replicas_mode_ == replicas::after_skip) replicas_->all_reduce(u.grad.span(), op_);
    u.scratch.reduce.reset();
  }
  // What a reduce-scatter received (this rank's shard, or a packed slot: its piece's trained
  // elements, then zeros) added into u.grad (widened from 16 bits), or, when u.grad holds
  // nothing yet, written over it; u.grad's size says how much of it counts.
  template <class From>
  void take_received(unit_type& u, std::span<const From> received) {
    const auto got = received.first(u.grad.size());
    if constexpr (!std::is_same_v<From, T>) ops::widen_add(got, u.grad.span(), u.grad_clean);
    else ops::add(got, u.grad.span(), u.grad_clean);
  }

  // Full gradients are dropped once reduced when gradients are sharded; kept,
  // zeroed, for the next backward when they are not (ZeRO-1).
  void release_full_grad(unit_type& u) {
    if (policy_.shard_gradients) u.release_full_grad();
    else ops::fill(u.full_grad.span(), C(0));
  }

  policy policy_;
  mixed_precision precision_;
  Comm* replicas_ = nullptr;
  comm::reduce_op op_ = comm::reduce_op::avg;
  replicas replicas_mode_ = replicas::each;
  std::vector<unit_type*> in_flight_;
};

}  // namespace shardlib::shard
