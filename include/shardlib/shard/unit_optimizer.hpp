// shardlib/shard/unit_optimizer.hpp — the optimizer's side of a sharded model's units:
// each unit's optimizer state, parameter groups' runs over this rank's piece, the
// checks made before any unit steps, and one unit's step.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/ledger.hpp"         // ledger_scope, current_ledger
#include "shardlib/optim/optimizer.hpp"     // optim::skip_flag
#include "shardlib/optim/param_groups.hpp"  // optim::is_param_groups, optim::segment

#include <cstddef>      // std::size_t
#include <optional>     // std::optional
#include <span>         // std::span
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::shard {

// An optimizer whose step a flag in the model's space can cancel (optim::skip_flag):
// the step over masters T, gradients T and the C-typed compute copy.
template <class O, class T, class C, class State>
concept skips_on_space = requires(const O& o, std::span<T> v, std::span<const T> g, State& st, std::span<C> c) {
  o.step(v, g, st, c, optim::skip_flag{});
};

// This rank's piece of a unit's flat values: where it starts and how many elements.
struct unit_piece {
  std::size_t begin = 0, size = 0;
};

// This rank's piece of unit u as runs (optim::cut_frozen): its frozen parameters',
// which have no optimizer state, and the others (`runs`' groups: one group 0 unless
// given), whose state lies end to end.
template <class Unit>
std::vector<optim::segment> piece_runs(const Unit& u, unit_piece p, std::vector<optim::segment> runs = {}) {
  if (runs.empty()) runs = {{0, p.size, 0}};
  return optim::cut_frozen(runs, u.layout, p.begin, p.size);
}

// Unit is shard/unit.hpp's unit with master dtype T and compute dtype C; Optimizer
// the type whose state each unit keeps. Every error names the rank, and the unit
// where one is at fault.
template <class Unit, class Optimizer, class T, class C>
class unit_optimizer {
  static constexpr bool compute16 = !std::is_same_v<C, T>;

 public:
  using state = typename Optimizer::state;

  explicit unit_optimizer(int rank) : rank_(rank) {}

  // The unit's optimizer state, made (zeroed) on first use for its piece's elements
  // that are not frozen, and charged to the offload ledger when the unit's optimizer
  // side lives there.
  template <class O>
  state& state_of(O& opt, Unit& u, unit_piece piece) {
    if (!u.optimizer_state) {
      std::optional<ledger_scope> in_offload;
      if (u.offload) in_offload.emplace(current_ledger().offload());
      u.optimizer_state.emplace(opt.make_state(optim::trained_size(piece_runs(u, piece))));
    }
    return *u.optimizer_state;
  }

  // What the optimizer can check (its options and groups, each unit's state) is
  // checked for every unit before any steps: a later unit's error must not leave the
  // earlier ones stepped, and every rank, whatever its piece, raises alike.
  // piece(i) is this rank's piece of units[i].
  template <class O, class Piece>
  void check(O& opt, std::vector<Unit>& units, Piece&& piece) {
    make_segments(opt, units, piece);
    if constexpr (requires(const state& s) { opt.check(s, std::size_t{}); })
      for (std::size_t i = 0; i < units.size(); ++i) {
        const unit_piece p = piece(i);
        const std::size_t stepped = optim::trained_size(piece_runs(units[i], p));
        with_unit(units[i], [&] { opt.check(state_of(opt, units[i], p), stepped); });
      }
  }

  // Unit i's step over values and grads in the memory Ops works on, and the 16-bit
  // compute copy for the next gather (in the same pass where the optimizer can; none
  // when copy16 is empty). A compact unit's values are its piece's trained runs alone.
  // After check() for the same optimizer. A unit of frozen parameters that keeps no
  // gradients (empty grads) only counts the step: a step over nothing.
  template <class Ops, class O>
  void step(O& opt, Unit& u, std::size_t i, unit_piece piece, std::span<T> values, std::span<const T> grads,
            std::span<C> copy16, optim::skip_flag flag = {}) {
    auto& st = state_of(opt, u, piece);
    const bool counted_only = grads.empty() && u.frozen();
    if (counted_only) {
      values = values.first(0);
      copy16 = copy16.first(0);
    }
    const std::span<const optim::segment> runs = segments_.empty() || counted_only
                                                     ? std::span<const optim::segment>{}
                                                     : std::span<const optim::segment>(segments_.at(i));
    const std::span<C> copy = compute16 ? copy16 : std::span<C>{};
    if (flag.skip) {
      if constexpr (skips_on_space<O, T, C, state>) {
        if (runs.empty()) opt.step(values, grads, st, copy, flag);
        else if constexpr (steps_runs_on_space<O>) opt.step(values, grads, st, copy, runs, flag);
        else cannot_leave_runs_out();
      } else {
        throw error(cat("rank ", rank_, ": this optimizer has no step a flag in the model's space can cancel"));
      }
      return;
    }
    with_unit(u, [&] {
      if constexpr (compute16 && requires { opt.step(values, grads, st, copy16); }) {
        if (runs.empty()) opt.step(values, grads, st, copy16);
        else if constexpr (steps_runs_on_space<O>) opt.step(values, grads, st, copy16, runs, optim::skip_flag{});
        else cannot_leave_runs_out();
      } else {
        if constexpr (optim::is_param_groups<Optimizer>) opt.step(values, grads, st, runs);
        else if (runs.empty()) opt.step(values, grads, st);
        else if constexpr (steps_runs_on_host<O>) optim::step_unfrozen(opt, values, grads, st, runs);
        else if constexpr (steps_runs_on_space<O>)
          opt.step(values, grads, st, std::span<C>{}, runs, optim::skip_flag{});
        else cannot_leave_runs_out();
        if constexpr (compute16)
          if (!copy16.empty()) Ops::narrow(std::span<const T>(values), copy16);  // empty: the caller rounds
      }
    });
  }

 private:
  // The else of steps over runs: make_segments refuses such an optimizer first.
  [[noreturn]] void cannot_leave_runs_out() const {
    throw error(cat("rank ", rank_, ": this optimizer cannot leave frozen parameters out of a step"));
  }

  // Runs f; the optimizer's own errors (its options, its state) then name the rank and unit too.
  template <class F>
  void with_unit(const Unit& u, F&& f) const {
    try {
      f();
    } catch (const error& e) {
      if (std::string_view(e.what()).starts_with("rank ")) throw;
      throw error(cat("rank ", rank_, ", unit '", u.name, "': ", e.what()));
    }
  }

  // Whether an optimizer can step a shard but its frozen runs: on the host through
  // step_segment (optim::step_unfrozen), in the model's space through a step over runs.
  template <class O>
  static constexpr bool steps_runs_on_host = requires(const O& o, std::span<T> v, std::span<const T> g, state& st) {
    optim::step_unfrozen(o, v, g, st, std::span<const optim::segment>{});
  };
  template <class O>
  static constexpr bool steps_runs_on_space =
      requires(const O& o, std::span<T> v, std::span<const T> g, state& st, std::span<C> c) {
        o.step(v, g, st, c, std::span<const optim::segment>{}, optim::skip_flag{});
      };
  template <class O>
  static constexpr bool steps_runs() {
    if constexpr (optim::is_param_groups<O>) return true;
    else if constexpr (compute16 && requires(const O& o, std::span<T> v, std::span<const T> g, state& st,
                                             std::span<C> c) { o.step(v, g, st, c); })
      return steps_runs_on_space<O>;  // the optimizer's own pass writes the compute copy
    else return steps_runs_on_host<O> || steps_runs_on_space<O>;
  }

  // Each unit's runs over this rank's piece, made at the first step: parameter groups'
  // runs, and frozen parameters' runs, which no step touches. Without either, none.
  // Every parameter is looked up, not only those of this rank's piece, so that a
  // parameter in no group, or a frozen one an optimizer cannot leave out, is an error
  // on every rank; the table is assigned only once whole.
  template <class Piece>
  void make_segments(const Optimizer& opt, const std::vector<Unit>& units, Piece& piece) {
    if (made_) return;
    std::vector<std::vector<optim::segment>> made;
    bool frozen = false;
    try {
      for (std::size_t i = 0; i < units.size(); ++i) {
        for (const auto& e : units[i].layout.entries) {
          if constexpr (optim::is_param_groups<Optimizer>) opt.group_of(e.name, e.shape);
          if (!e.requires_grad && !frozen) {
            frozen = true;
            require(steps_runs<Optimizer>(), "unit '", units[i].name, "': parameter '", e.name, "' is frozen ",
                    "(requires_grad = false) and this optimizer cannot leave part of a shard out of its step: use ",
                    "one with step_segment (Adam, AdamW, SGD, param_groups) or a device Adam");
          }
        }
        const unit_piece p = piece(i);
        std::vector<optim::segment> runs;
        if constexpr (optim::is_param_groups<Optimizer>)
          runs = piece_runs(units[i], p, opt.segments(units[i].layout, p.begin, p.size));
        else runs = piece_runs(units[i], p);
        // a compact unit's values are its trained runs alone (shard/unit.hpp)
        made.push_back(units[i].compact() ? optim::trained_runs(runs) : std::move(runs));
      }
    } catch (const error& e) {
      throw error(cat("rank ", rank_, ": ", e.what()));
    }
    if (frozen || optim::is_param_groups<Optimizer>) segments_ = std::move(made);
    made_ = true;
  }

  int rank_;
  bool made_ = false;
  std::vector<std::vector<optim::segment>> segments_;  // runs per unit (groups', frozen); empty: none
};

}  // namespace shardlib::shard
