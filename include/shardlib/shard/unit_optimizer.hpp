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

// Unit is shard/unit.hpp's unit with master dtype T and compute dtype C; Optimizer
// the type whose state each unit keeps. Every error names the rank, and the unit
// where one is at fault.
template <class Unit, class Optimizer, class T, class C>
class unit_optimizer {
  static constexpr bool compute16 = !std::is_same_v<C, T>;

 public:
  using state = typename Optimizer::state;

  explicit unit_optimizer(int rank) : rank_(rank) {}

  // The unit's optimizer state, made (zeroed) on first use for its piece, and charged
  // to the offload ledger when the unit's optimizer side lives there.
  template <class O>
  state& state_of(O& opt, Unit& u, unit_piece piece) {
    if (!u.optimizer_state) {
      std::optional<ledger_scope> in_offload;
      if (u.offload) in_offload.emplace(current_ledger().offload());
      u.optimizer_state.emplace(opt.make_state(piece.size));
    }
    return *u.optimizer_state;
  }

  // What the optimizer can check (its options and groups, each unit's state) is
  // checked for every unit before any steps: a later unit's error must not leave the
  // earlier ones stepped, and every rank, whatever its piece, raises alike.
  // piece(i) is this rank's piece of units[i].
  template <class O, class Piece>
  void check(O& opt, std::vector<Unit>& units, Piece&& piece) {
    if constexpr (optim::is_param_groups<Optimizer>) make_segments(opt, units, piece);
    if constexpr (requires(const state& s) { opt.check(s, std::size_t{}); })
      for (std::size_t i = 0; i < units.size(); ++i) {
        const unit_piece p = piece(i);
        with_unit(units[i], [&] { opt.check(state_of(opt, units[i], p), p.size); });
      }
  }

  // Unit i's step over values and grads in the memory Ops works on, and the 16-bit
  // compute copy for the next gather (in the same pass where the optimizer can).
  // After check() for the same optimizer.
  template <class Ops, class O>
  void step(O& opt, Unit& u, std::size_t i, unit_piece piece, std::span<T> values, std::span<const T> grads,
            std::span<C> copy16, optim::skip_flag flag = {}) {
    auto& st = state_of(opt, u, piece);
    if (flag.skip) {
      if constexpr (skips_on_space<O, T, C, state>) opt.step(values, grads, st, compute16 ? copy16 : std::span<C>{}, flag);
      else throw error(cat("rank ", rank_, ": this optimizer has no step a flag in the model's space can cancel"));
      return;
    }
    with_unit(u, [&] {
      if constexpr (compute16 && requires { opt.step(values, grads, st, copy16); }) {
        opt.step(values, grads, st, copy16);
      } else {
        if constexpr (optim::is_param_groups<Optimizer>) opt.step(values, grads, st, segments_.at(i));
        else opt.step(values, grads, st);
        if constexpr (compute16) Ops::narrow(std::span<const T>(values), copy16);
      }
    });
  }

 private:
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

  // Each unit's runs of parameter groups over this rank's piece, made at the first
  // grouped step. Every parameter's group is looked up, not only those of this rank's
  // piece, so that a parameter in no group is an error on every rank; the table is
  // assigned only once whole.
  template <class Piece>
  void make_segments(const Optimizer& opt, const std::vector<Unit>& units, Piece& piece) {
    if (!segments_.empty()) return;
    std::vector<std::vector<optim::segment>> made;
    try {
      for (std::size_t i = 0; i < units.size(); ++i) {
        for (const auto& e : units[i].layout.entries) opt.group_of(e.name, e.shape);
        const unit_piece p = piece(i);
        made.push_back(opt.segments(units[i].layout, p.begin, p.size));
      }
    } catch (const error& e) {
      throw error(cat("rank ", rank_, ": ", e.what()));
    }
    segments_ = std::move(made);
  }

  int rank_;
  std::vector<std::vector<optim::segment>> segments_;  // parameter groups' runs per unit
};

}  // namespace shardlib::shard
