// shardlib/optim/param_groups.hpp — parameter groups (torch.optim's param_groups): one
// optimizer state per shard, each parameter's elements stepped with its group's options.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"      // Buffer
#include "shardlib/core/element.hpp"     // FloatingElement, bfloat16, half
#include "shardlib/core/error.hpp"       // require, cat
#include "shardlib/core/glob.hpp"        // glob_match
#include "shardlib/core/shape.hpp"       // Shape
#include "shardlib/optim/optimizer.hpp"  // Optimizer, detail::require_size
#include "shardlib/optim/schedule.hpp"   // Schedule

#include <algorithm>    // std::max, std::min
#include <concepts>     // std::default_initializable
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <functional>   // std::function
#include <set>          // std::set
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <utility>      // std::move, std::as_const, std::pair
#include <vector>       // std::vector

namespace shardlib::optim {

// Which parameters a group takes: a predicate over the dotted name and the shape.
using group_rule = std::function<bool(std::string_view name, const Shape& shape)>;

// The parameters whose dotted name matches any of the glob patterns, where only '*'
// is special: match_names({"*.bias", "*norm*"}).
inline group_rule match_names(std::vector<std::string> patterns) {
  return [patterns = std::move(patterns)](std::string_view name, const Shape&) {
    for (const auto& p : patterns)
      if (glob_match(p, name)) return true;
    return false;
  };
}

// The parameters exempt from weight decay in the usual split: those with fewer than
// two dimensions — every bias (in_proj_bias included), LayerNorm's weight and bias —
// as nanoGPT's configure_optimizers decides (dim < 2). Matrices and embeddings decay.
inline bool no_decay(std::string_view, const Shape& shape) { return shape.rank() < 2; }

// A run of a shard stepped with one group's options: elements [begin, begin + size);
// or, with group `frozen`, a run of frozen parameters' elements, which no step touches
// and which have no optimizer state: a state over runs holds the other runs' elements
// end to end (without frozen runs, element i of the shard is the state's element i).
struct segment {
  static constexpr int frozen = -1;
  std::size_t begin = 0, size = 0;
  int group = 0;
};

// f(r, state_first) for every run r that is not frozen, in order, with the element of
// a state over the runs (their elements end to end) where r's state starts.
template <class F>
void for_each_trained_run(std::span<const segment> runs, F&& f) {
  std::size_t state_first = 0;
  for (const auto& r : runs) {
    if (r.group == segment::frozen) continue;
    f(r, state_first);
    state_first += r.size;
  }
}

// How many elements of the runs are not frozen: the size of their optimizer state.
inline std::size_t trained_size(std::span<const segment> runs) {
  std::size_t n = 0;
  for_each_trained_run(runs, [&](const segment& r, std::size_t) { n += r.size; });
  return n;
}

// `runs`, which tile flat elements [first, first + n) of a unit laid out as `layout`
// (their begin counted from first), with the elements of frozen parameters (entries
// whose requires_grad is false) cut out as runs of segment::frozen. Alignment gaps and
// padding go with the runs around them, but where every parameter is frozen the whole
// range is one frozen run (no state is kept for a gap alone).
template <class Layout>
std::vector<segment> cut_frozen(const std::vector<segment>& runs, const Layout& layout, std::size_t first,
                                std::size_t n) {
  if (layout.all_frozen()) return {{0, n, segment::frozen}};
  std::vector<std::pair<std::size_t, std::size_t>> frozen;  // [lo, hi) from first, by offset
  for (const auto& e : layout.entries) {
    const std::size_t lo = std::max(first, std::size_t(e.offset));
    const std::size_t hi = std::min(first + n, std::size_t(e.offset + e.numel()));
    if (!e.requires_grad && lo < hi) frozen.emplace_back(lo - first, hi - first);
  }
  if (frozen.empty()) return runs;
  std::vector<segment> out;
  auto emit = [&](std::size_t lo, std::size_t hi, int group) {
    if (!out.empty() && out.back().group == group && out.back().begin + out.back().size == lo)
      out.back().size += hi - lo;
    else
      out.push_back({lo, hi - lo, group});
  };
  std::size_t f = 0;
  for (const auto& r : runs)
    for (std::size_t at = r.begin, end = r.begin + r.size; at < end;) {
      while (f < frozen.size() && frozen[f].second <= at) ++f;
      const bool in = f < frozen.size() && frozen[f].first <= at;
      const std::size_t to = std::min(end, in ? frozen[f].second : f < frozen.size() ? frozen[f].first : end);
      emit(at, to, in ? segment::frozen : r.group);
      at = to;
    }
  return out;
}

// The runs over their trained elements alone, end to end (where a state over `runs` holds
// them), neighbours of one group joined: the runs of a shard that keeps nothing of its
// frozen elements (shard::options::frozen_masters = false).
inline std::vector<segment> trained_runs(std::span<const segment> runs) {
  std::vector<segment> out;
  for_each_trained_run(runs, [&](const segment& r, std::size_t at) {
    if (!out.empty() && out.back().group == r.group) out.back().size += r.size;
    else out.push_back({at, r.size, r.group});
  });
  return out;
}

// That `runs` tile a shard of n elements, each of one of `groups` groups or frozen.
inline void check_runs(std::string_view who, std::size_t n, std::span<const segment> runs, std::size_t groups) {
  std::size_t covered = 0;
  for (const auto& r : runs) {
    require(r.begin == covered && r.size <= n - covered &&
                (r.group == segment::frozen || (r.group >= 0 && std::size_t(r.group) < groups)),
            who, "::step: segment [", r.begin, ", ", r.begin + r.size, ") of group ", r.group,
            " does not continue the runs of a shard of ", n, " at ", covered, " (", groups, " groups)");
    covered += r.size;
  }
  require(covered == n, who, "::step: the segments cover ", covered, " of ", n, " elements");
}

// The gradients of a step over runs cover the whole shard (n elements, where the runs
// lie) or its trained runs alone, end to end as their state (a sharded model keeps the
// reduced gradients of a unit whose reduction packs them so: shard/packing.hpp). Without
// frozen runs both are the same. Throws shape_error when they are neither.
inline void require_run_grads(std::string_view who, std::size_t grads, std::size_t n, std::span<const segment> runs) {
  const std::size_t trained = trained_size(runs);
  require<shape_error>(grads == n || grads == trained, who, "::step: a shard of ", n, " elements, ", trained,
                       " of them trained, but ", grads, " gradients (one per element, or per trained element)");
}
// Run r's gradients, where r's state starts at state_first.
template <class G>
std::span<G> run_grads(std::span<G> grads, std::size_t n, const segment& r, std::size_t state_first) {
  return grads.subspan(grads.size() == n ? r.begin : state_first, r.size);
}

// One step over a shard that `runs` tile: step_run(r, state_first, g) steps every run r
// but the frozen ones, whose state starts at element state_first of the state and whose
// gradients are g (require_run_grads); then the step is counted once. Nothing is
// stepped unless all runs and the gradients are valid.
template <class State, class G, class StepRun>
void step_runs(std::string_view who, std::size_t n, std::span<const G> grads, State& s,
               std::span<const segment> runs, std::size_t groups, StepRun&& step_run) {
  check_runs(who, n, runs, groups);
  require_run_grads(who, grads.size(), n, runs);
  for_each_trained_run(runs, [&](const segment& r, std::size_t state_first) {
    step_run(r, state_first, run_grads(grads, n, r, state_first));
  });
  ++s.step;
}

// An optimizer's step over the runs of a shard that are not frozen (a shard holding
// frozen parameters) with a state of their elements only, counted once: each run as
// step_segment updates it. The gradients cover the shard or its trained runs (require_run_grads).
template <class O, FloatingElement G>
  requires requires(const O& o, std::span<float> p, std::span<const G> g, typename O::state& s) {
    o.step_segment(p, g, s, std::size_t{});
    o.check(std::as_const(s), std::size_t{});
  }
void step_unfrozen(const O& opt, std::span<float> params, std::span<const G> grads, typename O::state& s,
                   std::span<const segment> runs) {
  opt.check(s, trained_size(runs));
  step_runs(O::name, params.size(), grads, s, runs, 1, [&](const segment& r, std::size_t state_first, auto g) {
    opt.step_segment(params.subspan(r.begin, r.size), g, s, state_first);
  });
}

// An optimizer whose options can differ over the elements of one state: it steps a
// segment of its state (elements [first, first + n)) without counting the step, and
// checks its options and a state of n elements before a step changes anything.
template <class O>
concept SegmentOptimizer =
    Optimizer<O> && std::default_initializable<O> && requires { typename O::options_type; } &&
    requires(const O& o, std::span<float> p, std::span<const float> g, std::span<const bfloat16> gb,
             std::span<const half> gh, typename O::state& s, std::size_t first) {
      o.step_segment(p, g, s, first);
      o.step_segment(p, gb, s, first);
      o.step_segment(p, gh, s, first);
      o.check(std::as_const(s), first);  // options and a state of n elements, before any segment changes
    };

template <SegmentOptimizer O>
struct param_group {
  std::string name;                    // unique; names the group in errors and checkpoints
  group_rule rule;                     // the parameters it takes (the first group whose rule matches wins)
  typename O::options_type options{};  // its hyperparameters; options.lr is its current learning rate
  double lr_scale = 1;                 // set_lr: lr = schedule(step) * lr_scale
  std::function<double(std::int64_t)> schedule{};  // its own schedule; empty: set_lr's shared one
};

// Parameter groups over an optimizer O (Adam, AdamW, SGD): a parameter belongs to the
// first group whose rule takes it (one taken by none is an error naming it), and every
// element of a shard is stepped with its parameter's group's options — a shard that cuts
// through parameters of different groups is stepped as segments (a table of runs, no
// per-element memory). One state covers the shard: the state of the group needing the
// most buffers (amsgrad, momentum), so groups may differ there too.
//
//   auto opt = optim::param_groups<optim::AdamW>::no_decay_split({.lr = 1e-3, .weight_decay = 0.1});
//   auto sharded = shard::fully_shard(model, comm, shard::FullShard{}, opt);
//   opt.set_lr(schedule, step);  // each group's lr = schedule(step) * lr_scale (or its own schedule)
//   sharded.train_step(opt, x, y, loss);
//
// The sharding engine assigns groups once, at the first step, as torch.optim fixes
// param_groups at construction; options (lr, weight decay, ...) may change at any step.
template <SegmentOptimizer O>
class param_groups {
 public:
  using optimizer = O;
  using options_type = typename O::options_type;
  using state = typename O::state;
  using group = param_group<O>;
  static constexpr std::string_view name = O::name;

  explicit param_groups(std::vector<group> groups) : groups_(std::move(groups)) {
    require(!groups_.empty(), "param_groups: needs at least one group");
    std::set<std::string_view> names;
    for (const auto& g : groups_) {
      require(!g.name.empty(), "param_groups: a group needs a name");
      require(names.insert(g.name).second, "param_groups: two groups are named '", g.name, "'");
      require(bool(g.rule), "param_groups: group '", g.name, "' has no rule (which parameters it takes)");
      require(g.lr_scale >= 0, "param_groups: group '", g.name, "' has a negative lr_scale ", g.lr_scale);
    }
  }

  // The usual split: "decay" (two or more dimensions) with `options`, and "no_decay"
  // (optim::no_decay: biases and norm weights) with the same options but weight_decay 0.
  static param_groups no_decay_split(const options_type& options) {
    options_type none = options;
    none.weight_decay = 0;
    return param_groups({{.name = "decay", .rule = [](std::string_view n, const Shape& s) { return !no_decay(n, s); },
                          .options = options},
                         {.name = "no_decay", .rule = no_decay, .options = none}});
  }

  std::vector<group>& groups() { return groups_; }
  const std::vector<group>& groups() const { return groups_; }
  group& operator[](std::string_view group_name) {
    for (auto& g : groups_)
      if (g.name == group_name) return g;
    throw error(cat("param_groups: no group named '", group_name, "'"));
  }

  // The index of the group that takes a parameter; an error naming it if none does.
  int group_of(std::string_view param, const Shape& shape) const {
    for (std::size_t i = 0; i < groups_.size(); ++i)
      if (groups_[i].rule(param, shape)) return int(i);
    std::string names;
    for (const auto& g : groups_) names += cat(names.empty() ? "" : ", ", g.name);
    throw error(cat("param_groups: parameter '", param, "' ", shape, " is in no group (", names,
                    "); add a group whose rule takes it"));
  }

  // The segments of flat elements [first, first + n) of a unit laid out as `layout`
  // (entries with name, shape, offset, numel(), by offset): each parameter's elements
  // in its group's run. Gaps and padding join the run before them (the first run when
  // they lead): they hold zeros in values and gradients, which no update moves.
  template <class Layout>
  std::vector<segment> segments(const Layout& layout, std::size_t first, std::size_t n) const {
    std::vector<segment> out;
    const std::size_t end = first + n;
    for (const auto& e : layout.entries) {
      const std::size_t lo = std::max(first, std::size_t(e.offset));
      const std::size_t hi = std::min(end, std::size_t(e.offset + e.numel()));
      if (lo >= hi) continue;
      const int g = group_of(e.name, e.shape);
      if (out.empty()) {
        out.push_back({0, hi - first, g});
      } else if (out.back().group == g) {
        out.back().size = hi - first - out.back().begin;
      } else {
        out.back().size = lo - first - out.back().begin;
        out.push_back({lo - first, hi - lo, g});
      }
    }
    if (out.empty() && n > 0) out.push_back({0, n, 0});
    if (!out.empty()) out.back().size = n - out.back().begin;
    return out;
  }

  state make_state(std::size_t n) const {
    std::size_t most = 0, best = 0;
    for (std::size_t i = 0; i < groups_.size(); ++i) {
      std::size_t count = 0;
      auto probe = of(groups_[i]).make_state(1);
      probe.for_each_buffer([&](std::string_view, Buffer<float>&) { ++count; });
      if (count > most) most = count, best = i;
    }
    return of(groups_[best]).make_state(n);
  }

  // Steps a shard whose runs `segments` tile [0, params.size()), each with its group's
  // options (frozen runs not at all), then counts one step. The gradients cover the shard
  // or its trained runs (require_run_grads).
  template <FloatingElement G>
  void step(std::span<float> params, std::span<const G> grads, state& s, std::span<const segment> segments) const {
    check(s, trained_size(segments));
    step_runs("param_groups", params.size(), grads, s, segments, groups_.size(),
              [&](const segment& r, std::size_t first, auto g) {
                of(groups_[std::size_t(r.group)]).step_segment(params.subspan(r.begin, r.size), g, s, first);
              });
  }

  // Learning rates for the update at `step` (a state's step before it): each group's
  // lr = (its own schedule, else `shared`)(step) * lr_scale.
  template <Schedule S>
  void set_lr(const S& shared, std::int64_t step) {
    for (auto& g : groups_) g.options.lr = (g.schedule ? g.schedule(step) : double(shared(step))) * g.lr_scale;
  }

  // Every group's options, and that a state of n elements has the buffers they need
  // (amsgrad's, momentum's): an error naming the group, before any element changes.
  void check(const state& s, std::size_t n) const {
    for (const auto& g : groups_) {
      try {
        of(g).check(s, n);
      } catch (const error& e) {
        throw error(cat("param_groups: group '", g.name, "': ", e.what()));
      }
    }
  }

 private:
  static O of(const group& g) {
    O o;
    o.options = g.options;
    return o;
  }

  std::vector<group> groups_;
};

template <class O>
inline constexpr bool is_param_groups = false;
template <class O>
inline constexpr bool is_param_groups<param_groups<O>> = true;

// What the sharding engine and checkpoints step and save: an Optimizer, or parameter
// groups over one.
template <class O>
concept OptimizerOrGroups = Optimizer<O> || is_param_groups<O>;

}  // namespace shardlib::optim
