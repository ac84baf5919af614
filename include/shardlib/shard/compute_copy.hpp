// shardlib/shard/compute_copy.hpp — 16-bit layers: each unit's compute copy kept as its fp32
// master rounded, and the master pieces io reads and loads.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"
#include "shardlib/core/ledger.hpp"
#include "shardlib/optim/param_groups.hpp"
#include "shardlib/shard/space_ops.hpp"

#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint64_t
#include <span>         // std::span
#include <type_traits>  // std::type_identity

namespace shardlib::shard {

// With 16-bit layers (C bfloat16 or half, T float) a unit keeps this rank's piece twice:
// the master the optimizer steps, and `compute_shard`, the master rounded to C, which its
// all-gathers send. Where the master lives:
//   u.master                 the piece, in Space
//   u.offload->master        options.offload: in host memory, beside `compute_copy`, the
//                            rounded copy the offload channel carries to compute_shard
//   u.trained_master         a compact unit (options.frozen_masters = false): the piece's
//                            trained runs alone, end to end (offloaded: in u.offload->master);
//                            its frozen elements live only in the compute copy
// The class keeps the copies equal to the masters rounded, and lends and takes whole pieces
// in T for checkpoints, construction and summon_full_params' writeback.
template <class Unit, class T, class C, class Space>
class compute_copies {
  using ops = space_ops<Space>;
  using offload_space = offload_space_t<Space>;
  using offload_ops = space_ops<host_space>;  // the offload space is host memory
  using channel = typename ops::offload_channel;

 public:
  explicit compute_copies(std::uint64_t seed) : seed_(seed) {}
  // options.offload's channel, or null.
  void set_offload(channel* c) { offload_ = c; }

  // The master this rank steps: its piece, or a compact unit's trained runs alone.
  static std::span<T> master(Unit& u) {
    if (u.offload) return u.offload->master.span();
    if (u.compact()) return u.trained_master.span();
    return u.master->local();
  }

  // The master's runs rounded into their places in `copy` (the piece in C, in the memory
  // Ops works on); a compact unit's frozen elements are left as they are.
  template <class Ops>
  static void round_runs(const Unit& u, std::span<const T> master, std::span<C> copy) {
    optim::segment whole;
    optim::for_each_trained_run(runs(u, whole), [&](const optim::segment& r, std::size_t at) {
      Ops::narrow(master.subspan(at, r.size), copy.subspan(r.begin, r.size));
    });
  }
  // The compute copy rounded from the master, where the master lives: offloaded, in host
  // memory and then copied over the offload channel, as a step does.
  void narrow(Unit& u) {
    if (!u.offload) return round_runs<ops>(u, master(u), u.compute_shard.span());
    round_runs<offload_ops>(u, master(u), u.offload->compute_copy.span());
    send(u);
  }

  // f(values, std::type_identity<S>{}): this rank's piece of u's master values in memory of
  // space S, the model's or the offload space. A compact unit lends a copy: its compute copy
  // widened exactly, its trained masters over it.
  template <class F>
  decltype(auto) with_piece(Unit& u, F&& f) {
    if (u.compact()) {
      if (u.offload) {
        auto whole = offload_scratch(u.compute_shard.size());
        compact_piece<offload_ops>(u, u.offload->compute_copy.span(), whole.span());
        return f(std::span<const T>(whole.span()), std::type_identity<offload_space>{});
      }
      Buffer<T, Space> whole(u.compute_shard.size(), category::comm_scratch);
      compact_piece<ops>(u, u.compute_shard.span(), whole.span());
      return f(std::span<const T>(whole.span()), std::type_identity<Space>{});
    }
    if (u.offload) return f(std::span<const T>(master(u)), std::type_identity<offload_space>{});
    return f(std::span<const T>(master(u)), std::type_identity<Space>{});
  }

  // Replaces the piece with host values (a checkpoint's): a compact unit's frozen elements
  // are rounded into the compute copy, which holds them alone.
  void load(Unit& u, std::span<const T> values) {
    if (u.compact()) {
      if (u.offload) return take<offload_ops>(u, values);  // host memory already
      Buffer<T, Space> whole(values.size(), category::comm_scratch);
      ops::from_host(values, whole.span());
      return take<ops>(u, whole.span());
    }
    if (u.offload) offload_ops::copy(values, master(u));
    else ops::from_host(values, master(u));
    narrow(u);
  }
  // The piece drawn as every unit is (`first`: its first element), in the memory the master
  // lives in; a compact unit's through one piece of fp32 scratch.
  void draw(Unit& u, std::size_t first) {
    const std::size_t n = u.compute_shard.size();
    if (!u.compact()) {
      if (u.offload) offload_ops::initialize(u.layout, seed_, first, master(u));
      else ops::initialize(u.layout, seed_, first, master(u));
      return narrow(u);
    }
    if (u.offload) {
      auto whole = offload_scratch(n);
      offload_ops::initialize(u.layout, seed_, first, whole.span());
      return take<offload_ops>(u, whole.span());
    }
    Buffer<T, Space> whole(n, category::comm_scratch);
    ops::initialize(u.layout, seed_, first, whole.span());
    take<ops>(u, whole.span());
  }

  // summon_full_params' writeback (host memory): `full`, this rank's piece of the values as
  // written, into the master where its rounding does not read as the value written, and
  // into the compute copy where a compact unit keeps no master; the copy rounded again.
  void write_back(Unit& u, std::span<const C> full)
    requires std::is_same_v<Space, host_space>
  {
    const auto m = master(u);
    const auto copy = u.compute_shard.span();
    optim::segment whole;
    std::size_t at = 0;  // where the run's master starts
    for (const auto& r : runs(u, whole)) {
      const bool frozen = r.group == optim::segment::frozen;
      for (std::size_t k = 0; k < r.size; ++k) {
        const C v = full[r.begin + k];
        if (frozen) copy[r.begin + k] = v;
        else if (float(v) != float(C(m[at + k]))) m[at + k] = T(float(v));
      }
      if (!frozen) at += r.size;
    }
    round_runs<ops>(u, m, copy);
    if (u.offload) ops::copy(std::span<const C>(copy), u.offload->compute_copy.span());
  }

 private:
  // u's piece as runs: a compact unit's, or the whole piece as one trained run (in `whole`).
  static std::span<const optim::segment> runs(const Unit& u, optim::segment& whole) {
    if (u.compact()) return u.compact_runs;
    whole = {0, u.compute_shard.size(), 0};
    return {&whole, 1};
  }
  // The offloaded compute copy to the model's space, waited for.
  void send(Unit& u) {
    offload_->from_offload(std::span<const C>(u.offload->compute_copy.span()), u.compute_shard.span());
    offload_->fence();
  }
  // A compact unit's whole piece in T into `whole`, in the memory Ops works on: `copy` (its
  // compute copy there) widened, its trained masters over it.
  template <class Ops>
  static void compact_piece(Unit& u, std::span<const C> copy, std::span<T> whole) {
    Ops::widen(copy, whole);
    const std::span<const T> m = master(u);
    optim::for_each_trained_run(u.compact_runs, [&](const optim::segment& r, std::size_t at) {
      Ops::copy(m.subspan(at, r.size), whole.subspan(r.begin, r.size));
    });
  }
  // A compact unit's piece from `whole` (its values in T, in the memory Ops works on: the
  // offload space when offloaded, else the model's): its trained runs into the master, every
  // element rounded into the compute copy (through its offloaded mirror).
  template <class Ops>
  void take(Unit& u, std::span<const T> whole) {
    const auto m = master(u);
    optim::for_each_trained_run(u.compact_runs, [&](const optim::segment& r, std::size_t at) {
      Ops::copy(whole.subspan(r.begin, r.size), m.subspan(at, r.size));
    });
    if (!u.offload) return Ops::narrow(whole, u.compute_shard.span());
    Ops::narrow(whole, u.offload->compute_copy.span());
    send(u);
  }
  // n elements of T scratch in the offload space, booked in the offload ledger.
  static Buffer<T, offload_space> offload_scratch(std::size_t n) {
    ledger_scope in_offload(current_ledger().offload());
    return Buffer<T, offload_space>(n, category::comm_scratch);
  }

  std::uint64_t seed_;
  channel* offload_ = nullptr;
};

}  // namespace shardlib::shard
