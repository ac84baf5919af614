// shardlib/shard/packing.hpp — a part-frozen unit's trained gradients, piece by piece,
// packed so that its reduction sends them alone (as FSDP2 reduces only what has gradients).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/optim/param_groups.hpp"  // optim::segment, optim::cut_frozen
#include "shardlib/shard/sharded_tensor.hpp"

#include <algorithm>    // std::max
#include <cstddef>      // std::size_t
#include <span>         // std::span
#include <type_traits>  // std::is_same_v
#include <vector>       // std::vector

namespace shardlib::shard {

// A reduction over pieces of `width` elements, piece q's slot holding the trained elements of
// the unit's piece q (every element outside a frozen parameter: alignment gaps and padding
// too) in order, then zeros (sent, never read). Reduce-scattered (or all-reduced: one piece,
// the whole unit), each rank receives its own piece's trained elements. Empty (not packed)
// unless the unit has frozen and trained parameters, the slot is narrower than a piece (so
// that less is sent) and the slots sent and the one received (`received`: a reduce-scatter's)
// fit in the unit's padded size (so that their scratch is no more than the full gradients
// they stand for, which go as they are made, or than the widened copy an unpacked reduction
// of 16-bit layers sends).
struct reduce_packing {
  std::vector<std::vector<optim::segment>> runs{};  // per piece: optim::cut_frozen's, from its first element
  std::vector<std::size_t> trained{};             // per piece: elements of its trained runs
  std::size_t piece = 0, width = 0;               // elements of a piece, and of a slot
  bool packed() const { return !runs.empty(); }
};

template <class Layout>
reduce_packing trained_packing(const Layout& layout, shard_layout part, bool received) {
  reduce_packing p{.piece = part.shard_size()};
  if (layout.all_frozen()) return {};
  for (int q = 0; q < part.world; ++q) {
    p.runs.push_back(optim::cut_frozen({{0, p.piece, 0}}, layout, part.begin(q), p.piece));
    p.trained.push_back(optim::trained_size(p.runs.back()));
    p.width = std::max(p.width, p.trained.back());
  }
  const std::size_t slots = std::size_t(part.world) + (received ? 1 : 0);
  return p.width < p.piece && slots * p.width <= part.padded_size() ? p : reduce_packing{};
}

// Ops is space_ops<Space>; From is the layers' dtype, To the reduction's (equal, or float from 16 bits).
template <class Ops, class From, class To>
void pack(const reduce_packing& p, std::span<const From> full, std::span<To> out) {
  for (std::size_t q = 0; q < p.runs.size(); ++q) {
    const auto slot = out.subspan(q * p.width, p.width);
    optim::for_each_trained_run(p.runs[q], [&](const optim::segment& r, std::size_t at) {
      const auto from = full.subspan(q * p.piece + r.begin, r.size);
      if constexpr (std::is_same_v<From, To>) Ops::copy(from, slot.subspan(at, r.size));
      else Ops::widen_add(from, slot.subspan(at, r.size), true);
    });
    if (p.trained[q] < p.width) Ops::fill(slot.subspan(p.trained[q]), To(0));
  }
}

// The same from full gradients that hold the unit's trained elements alone, end to end
// (options.frozen_grads = false): piece q's are the next p.trained[q] of them.
template <class Ops, class From, class To>
void pack_trained(const reduce_packing& p, std::span<const From> trained, std::span<To> out) {
  std::size_t at = 0;
  for (std::size_t q = 0; q < p.runs.size(); ++q) {
    const auto from = trained.subspan(at, p.trained[q]);
    const auto slot = out.subspan(q * p.width, p.width);
    if constexpr (std::is_same_v<From, To>) Ops::copy(from, slot.first(from.size()));
    else Ops::widen_add(from, slot.first(from.size()), true);
    if (p.trained[q] < p.width) Ops::fill(slot.subspan(p.trained[q]), To(0));
    at += p.trained[q];
  }
}

// An all-reduced slot (one piece: the whole unit) written over the trained runs of the full gradients.
template <class Ops, class T>
void unpack(const reduce_packing& p, std::span<const T> slot, std::span<T> full) {
  optim::for_each_trained_run(p.runs.at(0), [&](const optim::segment& r, std::size_t at) {
    Ops::copy(slot.subspan(at, r.size), full.subspan(r.begin, r.size));
  });
}

}  // namespace shardlib::shard
