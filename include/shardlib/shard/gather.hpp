// shardlib/shard/gather.hpp — the parameter schedule: all-gathering a unit's full
// values from the shards, freeing them, and prefetching along the recorded order.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/shard/precision.hpp"
#include "shardlib/shard/space_ops.hpp"

#include <algorithm>    // std::copy_n, std::find
#include <span>         // std::span
#include <type_traits>  // std::is_same_v
#include <vector>       // std::vector

namespace shardlib::shard {

// One engine's gathers. `Unit` is shard::unit<T, C, Space, ...>. The source of
// an all-gather is what the rank's shard holds in the gather dtype:
//   16-bit compute (C != T)   compute_shard, C into C
//   fp32 gathers              the master shard (or, for replicated fp32
//                             values, this rank's slice of them, in place)
//   16-bit gathers, fp32 layers (host)
//                             the shard narrowed into scratch.send, gathered
//                             into the first half of the full float buffer and
//                             widened in place on arrival
// A backward's all-gather of a unit that kept a part after forward (policy::reshard_to)
// sends that part instead, over the reshard group, in the same dtype.
template <class Unit, class T, class C, class Space, class Comm>
class gather_schedule {
  using ops = space_ops<Space>;
  using state = typename Unit::state;
  static constexpr bool compute16 = !std::is_same_v<C, T>;

 public:
  gather_schedule(const mixed_precision& m, int prefetch) : precision_(m), prefetch_(prefetch) {}

  // Issues the all-gather of u's shards (over `group`) into `full`.
  void issue(Unit& u, Comm& group, std::span<C> full, std::span<const T> shard) {
    if constexpr (compute16) issue_piece(u, group, full, std::span<const C>(u.compute_shard.span()));
    else issue_piece(u, group, full, shard);
  }
  // Issues the all-gather of `piece`, this rank's part of the full values as layers read
  // them (C), over `group` into `full`, in the gather dtype.
  void issue_piece(Unit& u, Comm& group, std::span<C> full, std::span<const C> piece) {
    if (compute16 || precision_.param == dtype::f32) {  // C is the gather dtype
      u.gather_work = group.all_gather_async(piece, full);
    } else if constexpr (!compute16 && std::is_same_v<Space, host_space>) {
      with_16bit<T>(precision_.param, [&](auto h) {
        using H = decltype(h);
        u.scratch.send = Buffer<T, Space>(piece.size(), category::comm_scratch);
        std::copy_n(piece.data(), piece.size(), u.scratch.send.data());
        auto send = narrow_in_place<H>(u.scratch.send.span());
        std::span<H> recv(reinterpret_cast<H*>(full.data()), full.size());
        u.gather_work = group.all_gather_async(std::span<const H>(send), recv);
      });
    } else {
      throw error("internal: 16-bit gathers of fp32 layers are a host path");
    }
    u.where = state::gathering;
  }
  void complete(Unit& u) {
    u.gather_work.wait();
    if constexpr (std::is_same_v<Space, host_space> && !compute16)
      if (precision_.param != dtype::f32) {
        with_16bit<T>(precision_.param, [&](auto h) { widen_in_place<decltype(h)>(u.values.span()); });
        u.scratch.send.reset();
      }
    u.resharded.reset();  // what a backward's all-gather sent from, if it had a part kept
    u.where = state::gathered;
  }

  // Sharded parameters: the full values, gathered into a fresh buffer from the shards over
  // `group`, or from the part kept after forward (policy::reshard_to) over `regroup`.
  void gather(Unit& u, Comm& group, Comm* regroup, std::size_t padded, std::span<const T> shard) {
    if (u.where != state::sharded) return;
    u.values = Buffer<C, Space>(padded, category::gathered_parameters);
    if (u.resharded.empty()) issue(u, group, u.values.span(), shard);
    else issue_piece(u, *regroup, u.values.span(), std::span<const C>(u.resharded.span()));
  }
  void ensure(Unit& u, Comm& group, Comm* regroup, std::size_t padded, std::span<const T> shard) {
    gather(u, group, regroup, padded, shard);
    if (u.where == state::gathering) complete(u);
  }
  void free(Unit& u) {
    require(u.where != state::gathering, "internal: freeing unit '", u.name, "' while its gather is in flight");
    u.unbind();
    u.values.reset();
    u.where = state::sharded;
  }
  // Frees u's full values but for part `k` of `parts` equal ones, kept until its next gather.
  void reshard(Unit& u, int k, int parts) {
    const std::size_t n = u.values.size() / std::size_t(parts);
    u.resharded = Buffer<C, Space>(n, category::gathered_parameters);
    space_ops<Space>::copy(std::span<const C>(u.values.span()).subspan(std::size_t(k) * n, n), u.resharded.span());
    free(u);
  }

  // --- order and prefetch ----------------------------------------------------------------------
  // The first forward records the order units run in; later passes prefetch
  // along it (dir = +1 forward, -1 backward).
  void record(int i) {
    if (recording_ && std::find(order_.begin(), order_.end(), i) == order_.end()) order_.push_back(i);
  }
  void stop_recording() { recording_ = false; }
  template <class F>
  void for_each_ahead(int current, int dir, F&& f) const {
    if (recording_ || prefetch_ <= 0) return;
    auto pos = std::find(order_.begin(), order_.end(), current);
    if (pos == order_.end()) return;
    const long p = long(pos - order_.begin());
    for (int k = 1; k <= prefetch_; ++k) {
      const long q = p + dir * k;
      if (q < 0 || q >= long(order_.size())) break;
      f(order_[std::size_t(q)]);
    }
  }
  int neighbor(int i, int dir) const {
    auto pos = std::find(order_.begin(), order_.end(), i);
    if (pos == order_.end()) return -1;
    const long q = long(pos - order_.begin()) + dir;
    return q < 0 || q >= long(order_.size()) ? -1 : order_[std::size_t(q)];
  }

 private:
  mixed_precision precision_;
  int prefetch_;
  std::vector<int> order_;
  bool recording_ = true;
};

}  // namespace shardlib::shard
