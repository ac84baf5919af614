// shardlib/shard/loss_scale_state.hpp — fp16 loss scaling as the engine keeps it: the
// host's loss_scaler and, once train_step decides in the model's space, the scaler's
// changing fields there (shard/step_decision.hpp's slots), which the host's copy is
// refreshed from when read.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"          // Buffer
#include "shardlib/core/error.hpp"           // require
#include "shardlib/core/ledger.hpp"          // category
#include "shardlib/shard/precision.hpp"      // loss_scaler
#include "shardlib/shard/space_ops.hpp"      // space_ops
#include "shardlib/shard/step_decision.hpp"  // scaler_slots, scaler_to_slots, scaler_from_slots

#include <optional>     // std::optional
#include <span>         // std::span
#include <type_traits>  // std::is_same_v
#include <utility>      // std::move

namespace shardlib::shard {

// f(g) on a loss gradient: g itself when it is fp32 (or wider), else a widened copy, rounded
// back once after f (16-bit layers' loss gradients are scaled in fp32).
template <class Space, class C, class F>
void in_fp32(std::span<C> g, F&& f) {
  using ops = space_ops<Space>;
  if constexpr (sizeof(C) >= 4) {
    f(g);
  } else {
    Buffer<float, Space> wide(g.size(), category::activations);
    ops::widen_add(std::span<const C>(g), wide.span(), true);
    f(wide.span());
    ops::narrow(std::span<const float>(wide.span()), g);
  }
}

template <class Space>
class loss_scale_state {
  using ops = space_ops<Space>;

 public:
  using slots_type = typename ops::template scalars<double>;

  loss_scale_state(std::optional<loss_scaler> s, int rank) : host_(std::move(s)), rank_(rank) {}

  // With fp16 loss scaling.
  explicit operator bool() const { return host_.has_value(); }
  // The host's scaler: its fixed fields, and its changing ones while the host decides.
  loss_scaler& host() { return *host_; }
  const loss_scaler& host() const { return *host_; }

  // A copy as of the steps issued so far (empty without scaling); when the space
  // decides, reading it waits for those steps on their stream.
  std::optional<loss_scaler> read() const {
    if (host_ && slots_) {
      double slots[scaler_slots];
      issued_.run([&] {
        ops::issue_to_host(std::span<const double>(slots_->data(), scaler_slots), std::span<double>(slots));
        ops::wait_for_reads();
      });
      host_ = scaler_from_slots(*host_, slots);
    }
    return host_;
  }
  // Resuming: the scaler a checkpoint recorded, in both places.
  void set(const loss_scaler& s) {
    *host_ = s;
    if (!slots_) return;
    double slots[scaler_slots];
    scaler_to_slots(s, slots);
    issued_.run([&] { ops::from_host(std::span<const double>(slots), std::span<double>(slots_->data(), scaler_slots)); });
  }
  // The changing fields in the model's space, made from the host's at first use; the
  // work issued from here on is where read() waits.
  slots_type& in_space() {
    issued_ = ops::issued_here();
    if (!slots_) {
      slots_.emplace(ops::template make_scalars<double>(scaler_slots));
      double slots[scaler_slots];
      scaler_to_slots(*host_, slots);
      ops::from_host(std::span<const double>(slots), std::span<double>(slots_->data(), scaler_slots));
    }
    return *slots_;
  }

  // x times the scale (or 1 / it): the one in the model's space at `scale_in_space`, or the host's.
  template <class E>
  void scale(std::span<E> x, const double* scale_in_space, bool reciprocal) const {
    if constexpr (std::is_same_v<E, float>) {
      if (scale_in_space) return ops::scale_by(x, scale_in_space, reciprocal);
    } else {
      require(!scale_in_space, "rank ", rank_, ": fp16 loss scaling in the model's space needs float values");
    }
    ops::scale(x, reciprocal ? 1.f / host_->scale : host_->scale);
  }
 private:
  mutable std::optional<loss_scaler> host_;  // read() refreshes it from slots_
  std::optional<slots_type> slots_;          // when the space decides (in_space())
  typename ops::issue_point issued_{};       // where the steps that use slots_ are issued
  int rank_;
};

}  // namespace shardlib::shard
