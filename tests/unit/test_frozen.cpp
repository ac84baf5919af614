// Frozen parameters (nn::Param::requires_grad = false) under every strategy: they
// keep their values, count nowhere in the gradient norm, and the others train as a
// float64 reference that steps only them.
#include "../../benchmarks/counting_comm.hpp"  // bytes sent per rank, ring model
#include "shardlib/comm/launch.hpp"
#include "shardlib/core/glob.hpp"
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/nn/freeze.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/param_groups.hpp"
#include "shardlib/optim/sgd.hpp"
#include "shardlib/plan/describe.hpp"
#include "shardlib/plan/memory_plan.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/compare.hpp"
#include "support/raised.hpp"
#include "support/shard_fixture.hpp"

#include <catch2/catch.hpp>

#include <unistd.h>  // getpid

#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace test_frozen {

using namespace shardlib;
using fixture::Block;
using fixture::Model;
using Catch::Matchers::Contains;

namespace {

constexpr int rows = 12;  // the global batch: divides by W = 1, 2, 3, 4
// A whole parameter that opens a unit, and a bias inside a unit of the stack: shards of
// 2 and 3 cut through both (units of 56, 72, 72, 72 and 35 elements).
const std::set<std::string> frozen_names{"0.weight", "1.layers.1.bias"};
const optim::AdamW::options_type adamw{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
constexpr float clip_at = 0.5f;  // below the first steps' norms (checked): clipping acts

// Exactly the parameters named are frozen (the test's own, not nn::freeze).
template <class L>
void freeze_only(L& model, const std::set<std::string>& names) {
  model.parameters([&](std::string_view name, auto& p) { p.requires_grad = !names.contains(std::string(name)); });
}

struct reference_run {
  std::vector<double> params;  // final values in the model's order
  std::vector<double> norms;   // each step's norm before clipping, over the trained parameters
};

// Unsharded AdamW in double on the global batch from the float initial values, as
// PyTorch trains with requires_grad = false: frozen parameters have no gradient, so
// clip_grad_norm_ and the optimizer never see them.
reference_run reference(int steps, float max_norm, const std::set<std::string>& frozen = frozen_names) {
  fixture::double_model d(42);
  auto& owner = d.owner;
  auto values = owner.values();
  std::vector<double> exp_avg(values.size(), 0.0), exp_avg_sq(values.size(), 0.0);
  reference_run out;
  for (int s = 0; s < steps; ++s) {
    d.mse_gradients(s, rows);
    double squares = 0;
    for (const auto& e : owner.layout().entries)
      if (!frozen.contains(e.name))
        for (std::size_t i = e.offset; i < e.offset + e.numel(); ++i) squares += owner.grads()[i] * owner.grads()[i];
    const double norm = std::sqrt(squares);
    out.norms.push_back(norm);
    const double clip = max_norm > 0 ? std::min(1.0, double(max_norm) / (norm + 1e-6)) : 1.0;
    const double t = s + 1;
    for (const auto& e : owner.layout().entries) {
      if (frozen.contains(e.name)) continue;
      for (std::size_t i = e.offset; i < e.offset + e.numel(); ++i) {
        const double g = owner.grads()[i] * clip;
        values[i] *= 1 - adamw.lr * adamw.weight_decay;
        exp_avg[i] = adamw.beta1 * exp_avg[i] + (1 - adamw.beta1) * g;
        exp_avg_sq[i] = adamw.beta2 * exp_avg_sq[i] + (1 - adamw.beta2) * g * g;
        const double m_hat = exp_avg[i] / (1 - std::pow(adamw.beta1, t));
        const double v_hat = exp_avg_sq[i] / (1 - std::pow(adamw.beta2, t));
        values[i] -= adamw.lr * m_hat / (std::sqrt(v_hat) + adamw.eps);
      }
    }
  }
  for (const auto& e : owner.layout().entries)
    for (std::size_t i = 0; i < e.numel(); ++i) out.params.push_back(values[e.offset + i]);
  return out;
}

// What rank 0 ends with, every rank's values compared with rank 0's.
struct sharded_run {
  std::vector<float> initial, params, norms;  // full values before and after, each step's reported norm
  std::vector<std::string> names;             // the parameter of each full value, in the model's order
  bool replicas_agree = true;
  double reduced_bytes = 0;  // what rank 0 sent reducing gradients, per step (ring model)
  std::size_t frozen_unit_grads = 0;  // reduced gradients rank 0 keeps for units of frozen parameters
  std::size_t grads = 0;              // reduced gradients rank 0 keeps, every unit's
  std::size_t masters = 0;            // fp32 master elements rank 0 keeps, every unit's
  std::size_t gradient_peak = 0;      // rank 0's ledger, the steps' peak of category::gradients
  bool plan_equal = true;             // each rank's gradients and parameters are its plan's (micro = 1)
};

// The model make() returns: make_model()'s fp32 layers, or make_model16()'s bf16 ones
// (with wrap_types<fixture::Linear16b> and precision.param bf16). With micro > 1, each step
// runs that many forwards and backwards (each reduced, and added to the last) and no clipping.
// `extra` gives options.frozen_masters and frozen_grads.
template <class Opt, class Make = Model (*)()>
sharded_run train(int world, shard::AnyStrategy strategy, Opt opt0, const std::set<std::string>& frozen, int steps,
                  float max_norm, bool offload = false, shard::wrap_policy wrap = shard::wrap_types<Block>{},
                  shard::mixed_precision mp = {}, Make make = fixture::make_model, int micro = 1,
                  shard::options extra = {}) {
  std::vector<sharded_run> runs(static_cast<std::size_t>(world));
  comm::launch(world, [&](comm::ThreadComm& inner, ledger& l) {
    auto tally = std::make_shared<bench::traffic>();
    bench::counting_comm<comm::ThreadComm> c(inner, tally);
    auto m = make();
    using H = typename decltype(m)::output::value_type;
    freeze_only(m, frozen);
    auto model = shard::fully_shard<Opt>(
        m, c, strategy,
        {.wrap = wrap,
         .seed = 42,
         .precision = mp,
         .offload = offload,
         .frozen_masters = extra.frozen_masters,
         .frozen_grads = extra.frozen_grads});
    Opt opt = opt0;
    auto& run = runs[std::size_t(c.rank())];
    auto flatten = [&](std::vector<float>& out, bool names) {
      for (auto& [name, t] : model.full_state_dict(false)) {
        for (float v : t.span()) {
          out.push_back(v);
          if (names) run.names.push_back(name);
        }
      }
    };
    flatten(run.initial, true);
    const int per_rank = rows / world, first = c.rank() * per_rank;
    tally->reset();  // construction and the state dict: only steps count
    l.reset_peaks();
    for (int s = 0; s < steps && micro > 1; ++s) {
      model.zero_grad();
      for (int k = 0; k < micro; ++k) {
        const int b = s * micro + k;
        const auto l = fixture::mse_h<H>(model.forward(fixture::as<H>(fixture::batch(b, per_rank, 5, 1, first))),
                                         fixture::as<H>(fixture::batch(b, per_rank, 3, 2, first)));
        model.backward(l.grad);
      }
      model.step(opt);
    }
    for (int s = 0; s < steps && micro == 1; ++s) {
      auto r = model.train_step(opt, fixture::as<H>(fixture::batch(s, per_rank, 5, 1, first)),
                                fixture::as<H>(fixture::batch(s, per_rank, 3, 2, first)), fixture::mse_h<H>,
                                {.max_norm = max_norm});
      if (r.grad_norm) run.norms.push_back(*r.grad_norm);
    }
    run.reduced_bytes = (tally->reduce_scatter + tally->all_reduce) / steps;
    run.gradient_peak = l.peak(category::gradients);
    if (micro == 1) {
      const auto plan = plan::make_plan(
          plan::describe(model), {.policy = strategy.policy(),
                                  .world = world,
                                  .precision = std::is_same_v<H, float> ? plan::precision::fp32_layers(mp)
                                                                        : plan::precision::param_layers(mp),
                                  .offload = offload,
                                  .frozen_masters = extra.frozen_masters,
                                  .frozen_grads = extra.frozen_grads,
                                  .rank = c.rank()});
      for (category k : {category::gradients, category::parameters})
        if (l.peak(k) != plan.memory[k]) runs[std::size_t(c.rank())].plan_equal = false;
    }
    for (const auto& u : model.units()) {
      run.frozen_unit_grads += u.frozen() ? u.grad.size() : 0;
      run.grads += u.grad.size();
      run.masters += u.master ? u.master->local().size() : u.offload ? u.offload->master.size() : u.trained_master.size();
    }
    flatten(run.params, false);
  });
  for (int r = 1; r < world; ++r) {
    runs[0].replicas_agree = runs[0].replicas_agree && runs[std::size_t(r)].params == runs[0].params;
    runs[0].plan_equal = runs[0].plan_equal && runs[std::size_t(r)].plan_equal;
  }
  return runs[0];
}

// Whether the frozen parameters' values are the initial ones, bit for bit (and finite).
bool frozen_unchanged(const sharded_run& run, const std::set<std::string>& frozen) {
  std::size_t seen = 0;
  for (std::size_t i = 0; i < run.params.size(); ++i) {
    if (!frozen.contains(run.names[i])) continue;
    ++seen;
    if (!std::isfinite(run.params[i]) ||
        std::bit_cast<std::uint32_t>(run.params[i]) != std::bit_cast<std::uint32_t>(run.initial[i]))
      return false;
  }
  return seen > 0;
}

// make_model16's units (56, 72, 72, 72 and 35 elements, a bias 16-aligned) with these frozen:
// unit 0 wholly; 1.layers.1 packs (its weight frozen); 1.layers.2 (its bias frozen) does not
// pack at W = 2 or 3, a piece of it being all trained ([0, 36), [24, 48)).
const std::set<std::string> frozen16{"0.weight", "0.bias", "1.layers.1.weight", "1.layers.2.bias"};

// FullShard's options for make_model16, each Linear a unit.
shard::options options16(shard::mixed_precision mp, bool offload, bool frozen_masters) {
  return {.wrap = shard::wrap_types<fixture::Linear16b>{},
          .seed = 42,
          .precision = mp,
          .offload = offload,
          .frozen_masters = frozen_masters};
}

std::vector<std::uint32_t> bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> out;
  for (float x : v) out.push_back(std::bit_cast<std::uint32_t>(x));
  return out;
}

}  // namespace

// Tolerance as test_param_groups' float64 comparison (5e-5 relative to max(|want|, 0.1),
// measured there at most 1.6e-5): the sharded run is float, the reference double.
// A frozen element stepped moves by ~lr = 1e-2; a frozen gradient counted in the norm
// changes every clipped step.
TEST_CASE("frozen parameters keep their values and the others train as a float64 reference",
          "[frozen][equivalence]") {
  const int steps = 6;
  const auto want = reference(steps, clip_at);
  REQUIRE(want.norms.front() > clip_at);  // the clipping is exercised
  auto check = [&](shard::AnyStrategy strategy, int w, bool offload) {
    INFO(strategy.name << " at W = " << w << (offload ? ", offloaded" : ""));
    const auto got = train(w, strategy, optim::AdamW{adamw}, frozen_names, steps, clip_at, offload);
    CHECK(got.replicas_agree);
    CHECK(frozen_unchanged(got, frozen_names));
    test_support::max_error params, norms;
    params.relative(got.params, want.params, 0.1);
    norms.relative(got.norms, want.norms, 1e-6);
    CHECK(params <= 5e-5);
    CHECK(norms <= 1e-5);
  };
  for (int w : {1, 2, 3}) {
    check(shard::FullShard{}, w, false);
    check(shard::ShardGradOp{}, w, false);
    check(shard::ShardOptimizer{}, w, false);
    check(shard::NoShard{}, w, false);
  }
  check(shard::FullShard{}, 3, true);
  check(shard::HybridShard{.group_size = 2}, 4, false);
  // One unit of everything: pieces where trained runs lie on both sides of a frozen one.
  for (int w : {1, 2, 3}) {
    INFO("one unit at W = " << w);
    const auto got = train(w, shard::FullShard{}, optim::AdamW{adamw}, frozen_names, steps, clip_at, false,
                           shard::wrap_none{});
    CHECK(frozen_unchanged(got, frozen_names));
    test_support::max_error params;
    params.relative(got.params, want.params, 0.1);
    CHECK(params <= 5e-5);
  }
}

// Bit for bit: a shard's trained runs step as they would beside parameters that are
// not frozen but stepped with lr 0 and no weight decay (param groups), without
// clipping (which would count the latter's gradients); param groups over frozen
// parameters and plain AdamW agree too, and so does an SGD with momentum.
TEST_CASE("frozen runs are left out of a shard's step, which steps the rest as before", "[frozen][segments]") {
  using Groups = optim::param_groups<optim::AdamW>;
  auto held = adamw;
  held.lr = 0;
  held.weight_decay = 0;
  const Groups lr0({{.name = "held", .rule = optim::match_names({"0.weight", "1.layers.1.bias"}), .options = held},
                    {.name = "rest", .rule = [](std::string_view, const Shape&) { return true; }, .options = adamw}});
  const Groups one({{.name = "all", .rule = [](std::string_view, const Shape&) { return true; }, .options = adamw}});
  for (int w : {2, 3}) {
    INFO("W = " << w);
    const auto plain = train(w, shard::FullShard{}, optim::AdamW{adamw}, frozen_names, 4, 0);
    const auto groups = train(w, shard::FullShard{}, one, frozen_names, 4, 0);
    const auto stepped_at_zero = train(w, shard::FullShard{}, lr0, {}, 4, 0);
    CHECK(frozen_unchanged(plain, frozen_names));
    CHECK(bits(plain.params) == bits(groups.params));
    CHECK(bits(plain.params) == bits(stepped_at_zero.params));
    CHECK(plain.params != plain.initial);  // the rest trained
  }
  const optim::SGD sgd{{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01}};
  const auto plain = train(3, shard::ShardOptimizer{}, sgd, frozen_names, 4, clip_at);
  CHECK(frozen_unchanged(plain, frozen_names));
  CHECK(plain.params != plain.initial);
}

// A unit of frozen and trained parameters sends its trained elements alone (shard/packing.hpp):
// each piece's packed into a slot as wide as the largest piece's. The sums are the same, so
// its trained parameters end as when the frozen one is trained with lr 0 (and nothing is
// packed), bit for bit, in every precision and through each kind of reduction; and the bytes
// saved are counted by hand (ring model; unit 1.layers.1: weight [0, 64), bias [64, 72)):
//   FullShard W = 2  pieces of 36, trained 0 and 8: 2 slots of 8 sent for 72, (1/2) 56 x 4 = 112
//   FullShard W = 3  pieces of 24, trained 0, 0, 8: 3 x 8 for 72, (2/3) 48 x 4 = 128; bf16 reduce 64
//   NoShard W = 3    one piece of 72 (all-reduce), trained 8: 2 (2/3) 64 x 4 = 341.33
//   HybridShard G = 2, W = 4, rank 0: 112 as FullShard W = 2, and its piece averaged across the
//                    2 replicas, 0 elements for 36: 2 (1/2) 36 x 4 = 144; 256 in all
//   HybridShard G = 1, W = 2: one piece of 72, nothing reduce-scattered; averaged across the 2
//                    replicas, 8 elements for 72: 2 (1/2) 64 x 4 = 256
// and rank 0 keeps the trained elements of its piece alone as reduced gradients: 0 for 36
// (FullShard W = 2, HybridShard G = 2), 0 for 24 (W = 3), 8 for 72 (G = 1); NoShard keeps the
// whole unit, where its layers write.
// Then one unit of everything (wrap_none, 339 elements with the alignment gaps), every weight
// but the last frozen: at W = 3 pieces of 113 with 24, 32 (two runs of 16) and 51 trained
// elements, slots of 51; rank 0 keeps 24 reduced gradients for 113.
TEST_CASE("a unit of frozen and trained parameters reduces its trained elements alone", "[frozen][traffic]") {
  const std::set<std::string> weight{"1.layers.1.weight"};
  auto held = adamw;
  held.lr = 0;
  held.weight_decay = 0;
  using Groups = optim::param_groups<optim::AdamW>;
  const Groups lr0({{.name = "held", .rule = optim::match_names({"1.layers.1.weight"}), .options = held},
                    {.name = "rest", .rule = [](std::string_view, const Shape&) { return true; }, .options = adamw}});
  struct setting {
    shard::AnyStrategy strategy;
    int world;
    double saved;       // bytes per step, fp32 reduction
    std::size_t grads;  // fewer reduced gradients rank 0 keeps
  };
  const setting settings[] = {{shard::FullShard{}, 2, 112, 36},
                              {shard::FullShard{}, 3, 128, 24},
                              {shard::ShardOptimizer{}, 3, 128, 24},
                              {shard::NoShard{}, 3, 2 * (2. / 3) * 64 * 4, 0},
                              {shard::HybridShard{.group_size = 2}, 4, 256, 36},
                              {shard::HybridShard{.group_size = 1}, 2, 256, 64}};
  const shard::mixed_precision precisions[] = {{},
                                               {.param = dtype::bf16, .reduce = dtype::bf16},
                                               {.param = dtype::f16, .reduce = dtype::f16}};
  for (const auto& [strategy, w, saved, fewer] : settings)
    for (const auto& mp : precisions) {
      INFO(strategy.name << " at W = " << w << ", reduce " << name(mp.reduce));
      const auto packed = train(w, strategy, optim::AdamW{adamw}, weight, 3, 0, false, shard::wrap_types<Block>{}, mp);
      const auto whole = train(w, strategy, lr0, {}, 3, 0, false, shard::wrap_types<Block>{}, mp);
      CHECK(frozen_unchanged(packed, weight));
      CHECK(packed.params != packed.initial);
      CHECK(bits(packed.params) == bits(whole.params));
      if (mp.reduce == dtype::f32) CHECK(whole.reduced_bytes - packed.reduced_bytes == Approx(saved).epsilon(1e-12));
      CHECK(whole.grads - packed.grads == fewer);
      if (strategy.name == "FullShard" && w == 3 && mp.reduce == dtype::bf16)
        CHECK(whole.reduced_bytes - packed.reduced_bytes == Approx(64).epsilon(1e-12));
    }
  const std::set<std::string> weights{"0.weight", "1.layers.0.weight", "1.layers.1.weight", "1.layers.2.weight"};
  const Groups weights_lr0(
      {{.name = "held", .rule = optim::match_names({weights.begin(), weights.end()}), .options = held},
       {.name = "rest", .rule = [](std::string_view, const Shape&) { return true; }, .options = adamw}});
  for (const auto& [strategy, w] : {std::pair<shard::AnyStrategy, int>{shard::FullShard{}, 3},
                                    {shard::ShardOptimizer{}, 3},
                                    {shard::FullShard{}, 2}})
    for (const auto& mp : precisions) {
      INFO("one unit, " << strategy.name << " at W = " << w << ", reduce " << name(mp.reduce));
      const auto packed = train(w, strategy, optim::AdamW{adamw}, weights, 3, 0, false, shard::wrap_none{}, mp);
      const auto whole = train(w, strategy, weights_lr0, {}, 3, 0, false, shard::wrap_none{}, mp);
      CHECK(frozen_unchanged(packed, weights));
      CHECK(packed.params != packed.initial);
      CHECK(bits(packed.params) == bits(whole.params));
      CHECK(whole.reduced_bytes > packed.reduced_bytes);
      if (w == 3) CHECK(whole.grads - packed.grads == 113 - 24);
    }
  // bf16 layers: packed widened into fp32, or sent in bf16 and widened into the shard; and
  // offloaded (the reduced shard copied to host memory for the step)
  for (dtype reduce : {dtype::f32, dtype::bf16})
    for (const auto& [strategy, w, offload] : {std::tuple<shard::AnyStrategy, int, bool>{shard::FullShard{}, 3, false},
                                               {shard::HybridShard{.group_size = 2}, 4, false},
                                               {shard::FullShard{}, 3, true}}) {
      INFO("bf16 layers, " << strategy.name << " at W = " << w << ", reduce " << name(reduce)
                           << (offload ? ", offloaded" : ""));
      const shard::mixed_precision mp{.param = dtype::bf16, .reduce = reduce};
      const shard::wrap_policy wrap = shard::wrap_types<fixture::Linear16b>{};
      const auto packed =
          train(w, strategy, optim::AdamW{adamw}, weight, 3, 0, offload, wrap, mp, fixture::make_model16);
      const auto whole = train(w, strategy, lr0, {}, 3, 0, offload, wrap, mp, fixture::make_model16);
      CHECK(frozen_unchanged(packed, weight));
      CHECK(packed.params != packed.initial);
      CHECK(bits(packed.params) == bits(whole.params));
      CHECK(whole.reduced_bytes > packed.reduced_bytes);
      CHECK(whole.grads - packed.grads == (w == 3 ? 24u : 36u));  // unit 1.layers.1 as above
    }
  // Two micro-batches a step, each reduced: the second added into the shard's trained runs.
  // HybridShard averages a packed piece across the replicas before adding it, where a whole
  // one is added first and the sum averaged: the same up to a rounding of each (2^-24).
  for (const auto& [strategy, w] : {std::pair<shard::AnyStrategy, int>{shard::FullShard{}, 3},
                                    {shard::ShardOptimizer{}, 3},
                                    {shard::NoShard{}, 3},
                                    {shard::HybridShard{.group_size = 2}, 4}})
    for (const shard::mixed_precision mp : {shard::mixed_precision{}, {.param = dtype::bf16, .reduce = dtype::bf16}}) {
      INFO("two micro-batches, " << strategy.name << " at W = " << w << ", reduce " << name(mp.reduce));
      const auto wrap = shard::wrap_types<Block>{};
      const auto packed =
          train(w, strategy, optim::AdamW{adamw}, weight, 3, 0, false, wrap, mp, fixture::make_model, 2);
      const auto whole = train(w, strategy, lr0, {}, 3, 0, false, wrap, mp, fixture::make_model, 2);
      CHECK(packed.params != packed.initial);
      if (strategy.name != "HybridShard") {
        CHECK(bits(packed.params) == bits(whole.params));
      } else {
        test_support::max_error params;
        params.relative(packed.params, whole.params, 0.1);
        CHECK(params <= 1e-6);  // measured 3.7e-8: Adam steps from gradients a rounding apart
      }
    }
}

// options.frozen_masters = false: 16-bit layers keep no fp32 master for the frozen elements
// their reductions leave out (a wholly frozen unit's, a packed unit's). Layers read the
// rounded values either way, so training is the same bit for bit; what reads the masters
// back (state dicts, checkpoints) reads the frozen values as layers hold them, in bf16.
TEST_CASE("without frozen masters 16-bit layers train the same and keep no fp32 copy of frozen elements",
          "[frozen][memory]") {
  // frozen16: unpacked, 1.layers.2 keeps its whole master and its bias in fp32.
  const std::set<std::string> without_master{"0.weight", "0.bias", "1.layers.1.weight"};
  struct setting {
    shard::AnyStrategy strategy;
    int world;
    bool offload;
    std::size_t saved;  // master elements rank 0 does not keep: its pieces of units 0 and 1.layers.1
  };
  const setting settings[] = {{shard::FullShard{}, 3, false, 19 + 24},
                              {shard::ShardOptimizer{}, 3, false, 19 + 24},
                              {shard::FullShard{}, 2, false, 28 + 36},
                              {shard::HybridShard{.group_size = 2}, 4, false, 28 + 36},
                              {shard::FullShard{}, 3, true, 19 + 24}};
  const shard::wrap_policy wrap = shard::wrap_types<fixture::Linear16b>{};
  for (dtype reduce : {dtype::f32, dtype::bf16})
    for (const auto& [strategy, w, offload, saved] : settings) {
      INFO(strategy.name << " at W = " << w << ", reduce " << name(reduce) << (offload ? ", offloaded" : ""));
      const shard::mixed_precision mp{.param = dtype::bf16, .reduce = reduce};
      const auto whole = train(w, strategy, optim::AdamW{adamw}, frozen16, 3, clip_at, offload, wrap, mp,
                               fixture::make_model16, 1, {});
      const auto compact = train(w, strategy, optim::AdamW{adamw}, frozen16, 3, clip_at, offload, wrap, mp,
                                 fixture::make_model16, 1, {.frozen_masters = false});
      CHECK(compact.replicas_agree);
      CHECK(compact.params != compact.initial);
      CHECK(whole.masters - compact.masters == saved);
      CHECK(compact.norms == whole.norms);
      REQUIRE(compact.params.size() == whole.params.size());
      std::size_t rounded = 0, mismatched = 0;
      for (std::size_t k = 0; k < whole.params.size(); ++k) {
        const bool in_bf16 = without_master.contains(whole.names[k]);
        const float want = in_bf16 ? float(bfloat16(whole.params[k])) : whole.params[k];
        mismatched += std::bit_cast<std::uint32_t>(compact.params[k]) != std::bit_cast<std::uint32_t>(want);
        rounded += in_bf16 && want != whole.params[k];
      }
      CHECK(mismatched == 0);
      CHECK(rounded > 0);  // the fp32 masters of frozen elements were not already bf16 values
    }
  // Parameter groups: a compact unit's runs of one group joined (optim::trained_runs), the
  // biases' group without weight decay; again the same bits but for the frozen values' rounding.
  const auto groups = optim::param_groups<optim::AdamW>::no_decay_split(adamw);
  const shard::mixed_precision mp{.param = dtype::bf16, .reduce = dtype::f32};
  for (bool offload : {false, true}) {
    INFO("param groups" << (offload ? ", offloaded" : ""));
    const auto whole = train(3, shard::FullShard{}, groups, frozen16, 3, clip_at, offload, wrap, mp,
                             fixture::make_model16, 1, {});
    const auto compact = train(3, shard::FullShard{}, groups, frozen16, 3, clip_at, offload, wrap, mp,
                               fixture::make_model16, 1, {.frozen_masters = false});
    CHECK(whole.masters - compact.masters == 19 + 24);
    std::size_t mismatched = 0;
    for (std::size_t k = 0; k < whole.params.size(); ++k) {
      const float want = without_master.contains(whole.names[k]) ? float(bfloat16(whole.params[k])) : whole.params[k];
      mismatched += std::bit_cast<std::uint32_t>(compact.params[k]) != std::bit_cast<std::uint32_t>(want);
    }
    CHECK(mismatched == 0);
    CHECK(compact.params != compact.initial);
  }
}

// options.frozen_grads = false: backward binds no gradient storage for frozen parameters
// (their Param::grad is null; every layer here skips them): a wholly frozen unit keeps no
// full local gradients, a packed one its trained elements' alone, which it packs piece by
// piece as they lie. Training is the same bit for bit, in fp32 and bf16, offloaded, with
// two micro-batches a step (accumulated in the trained elements' buffer), and the plan
// counts it.
TEST_CASE("without frozen gradients backward keeps the trained elements' alone and trains the same",
          "[frozen][memory]") {
  // fp32: unit 1.layers.0 wholly frozen, 1.layers.1 packs (its weight frozen), unit 0 (its
  // weight frozen) packs at W = 2 (at W = 3 its slots would not fit: it keeps its frozen grads)
  const std::set<std::string> frozen32{"0.weight", "1.layers.0.weight", "1.layers.0.bias", "1.layers.1.weight"};
  struct setting {
    shard::AnyStrategy strategy;
    int world;
    bool offload;
    int micro;
  };
  const setting settings[] = {{shard::FullShard{}, 3, false, 1},      {shard::ShardGradOp{}, 2, false, 1},
                              {shard::ShardOptimizer{}, 3, false, 1}, {shard::HybridShard{.group_size = 2}, 4, false, 1},
                              {shard::FullShard{}, 3, true, 1},       {shard::FullShard{}, 3, false, 2},
                              {shard::ShardOptimizer{}, 3, false, 2}};
  for (const auto& [strategy, w, offload, micro] : settings) {
    const float clip = micro == 1 ? clip_at : 0.f;
    {
      INFO("fp32, " << strategy.name << " at W = " << w << (offload ? ", offloaded" : "") << ", micro " << micro);
      const auto with = train(w, strategy, optim::AdamW{adamw}, frozen32, 3, clip, offload, shard::wrap_types<Block>{},
                              {}, fixture::make_model, micro);
      const auto without = train(w, strategy, optim::AdamW{adamw}, frozen32, 3, clip, offload,
                                 shard::wrap_types<Block>{}, {}, fixture::make_model, micro, {.frozen_grads = false});
      CHECK(without.params != without.initial);
      CHECK(bits(without.params) == bits(with.params));
      CHECK(without.gradient_peak < with.gradient_peak);
      CHECK(without.plan_equal);
      CHECK(with.plan_equal);
    }
    for (dtype reduce : {dtype::f32, dtype::bf16}) {
      INFO("bf16, reduce " << name(reduce) << ", " << strategy.name << " at W = " << w
                           << (offload ? ", offloaded" : "") << ", micro " << micro);
      const shard::mixed_precision mp{.param = dtype::bf16, .reduce = reduce};
      const shard::wrap_policy wrap = shard::wrap_types<fixture::Linear16b>{};
      const auto with = train(w, strategy, optim::AdamW{adamw}, frozen16, 3, clip, offload, wrap, mp,
                              fixture::make_model16, micro);
      const auto without = train(w, strategy, optim::AdamW{adamw}, frozen16, 3, clip, offload, wrap, mp,
                                 fixture::make_model16, micro, {.frozen_masters = false, .frozen_grads = false});
      CHECK(without.params != without.initial);
      // widened into fp32 for an fp32 reduction, 16-bit full gradients go at once: the peak
      // is then another unit's
      if (reduce == dtype::bf16) CHECK(without.gradient_peak < with.gradient_peak);
      else CHECK(without.gradient_peak <= with.gradient_peak);
      CHECK(without.plan_equal);
      std::size_t differ = 0;  // frozen values without masters are their bf16 roundings
      for (std::size_t k = 0; k < with.params.size(); ++k) {
        const float want = frozen16.contains(with.names[k]) && with.names[k] != "1.layers.2.bias"
                               ? float(bfloat16(with.params[k]))
                               : with.params[k];
        differ += std::bit_cast<std::uint32_t>(without.params[k]) != std::bit_cast<std::uint32_t>(want);
      }
      CHECK(differ == 0);
    }
  }
}

// The same where one unit's trained elements lie in every piece and a trained weight is cut
// by a piece boundary (the whole model one unit: 1.layers.1.weight spans pieces 0 and 1 at
// W = 2 and 4, 1.layers.0.weight at W = 3), so that the trained-elements buffer packs
// slot after slot from where the last one ended.
TEST_CASE("without frozen gradients a unit packs trained elements of every piece", "[frozen][memory]") {
  struct setting {
    int world;
    std::set<std::string> frozen;
  };
  const setting settings[] = {{2, {"1.layers.0.weight", "1.layers.2.weight"}},
                              {3, {"0.weight", "1.layers.1.weight", "1.layers.2.weight"}},
                              {4, {"1.layers.0.weight", "1.layers.2.weight"}}};
  for (const auto& [w, frozen] : settings)
    for (bool bf16 : {false, true}) {
      INFO("W = " << w << (bf16 ? ", bf16" : ", fp32"));
      const auto run = [&](bool frozen_grads) {
        if (!bf16)
          return train(w, shard::FullShard{}, optim::AdamW{adamw}, frozen, 3, clip_at, false, shard::wrap_none{}, {},
                       fixture::make_model, 1, {.frozen_grads = frozen_grads});
        return train(w, shard::FullShard{}, optim::AdamW{adamw}, frozen, 3, clip_at, false, shard::wrap_none{},
                     {.param = dtype::bf16, .reduce = dtype::bf16}, fixture::make_model16, 1,
                     {.frozen_grads = frozen_grads});
      };
      const auto with = run(true), without = run(false);
      CHECK(without.params != without.initial);
      CHECK(bits(without.params) == bits(with.params));
      CHECK(without.gradient_peak < with.gradient_peak);
      CHECK(without.plan_equal);
    }
}

// A frozen element's gradient is zero and it has no optimizer state: each rank's state
// holds its piece's other elements only (gaps and padding included), in order.
TEST_CASE("a frozen parameter's gradient is zero and it has no optimizer state", "[frozen][memory]") {
  const int w = 3;
  std::vector<std::string> problems(w);
  std::vector<std::size_t> state_elements(w), frozen_total(w), padded_total(w);
  comm::launch(w, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    freeze_only(m, frozen_names);
    auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, {.wrap = shard::wrap_types<Block>{},
                                                                             .seed = 42});
    optim::AdamW opt{adamw};
    const int per_rank = rows / w, first = c.rank() * per_rank;
    for (int s = 0; s < 3; ++s)
      model.train_step(opt, fixture::batch(s, per_rank, 5, 1, first), fixture::batch(s, per_rank, 3, 2, first),
                       fixture::mse);
    auto& problem = problems[std::size_t(c.rank())];
    for (std::size_t i = 0; i < model.unit_count(); ++i) {
      const std::size_t begin = model.partition(i).begin(model.partition_rank());
      const auto grads = model.units()[i].grad.span();
      const std::size_t piece = model.partition(i).shard_size();
      const bool trained_only = grads.size() < piece;  // a packed reduction's: the trained elements alone
      auto& st = model.optimizer_state(opt, i);
      state_elements[std::size_t(c.rank())] += st.exp_avg.size();
      padded_total[std::size_t(c.rank())] += model.partition(i).padded_size();
      // Element k of the piece is frozen or is the next element of the state, which moved.
      std::size_t next = 0;
      for (std::size_t k = 0; k < piece; ++k) {
        bool frozen = false;
        for (const auto& e : model.unit_layout(i).entries)
          frozen = frozen || (!e.requires_grad && begin + k >= e.offset && begin + k < e.offset + e.numel());
        if (frozen) {
          if (!trained_only && grads[k] != 0)
            problem += cat("unit ", i, " element ", begin + k, ": a frozen gradient ", grads[k], "; ");
          continue;
        }
        if (next >= st.exp_avg.size()) problem += cat("unit ", i, ": the state ends before element ", begin + k, "; ");
        ++next;
      }
      if (next != st.exp_avg.size()) problem += cat("unit ", i, ": ", st.exp_avg.size(), " state elements for ", next);
      if (trained_only && grads.size() != next) problem += cat("unit ", i, ": ", grads.size(), " gradients for ", next);
      for (const auto& e : model.unit_layout(i).entries)
        frozen_total[std::size_t(c.rank())] += e.requires_grad ? 0 : e.numel();
    }
  });
  for (const auto& p : problems) CHECK(p == "");
  // 0.weight (40) and 1.layers.1.bias (8) have no state on any rank.
  std::size_t total = 0;
  for (auto n : state_elements) total += n;
  CHECK(frozen_total[0] == 48);
  CHECK(total == padded_total[0] - 48);
}

// Replicated parameters stay bound to their unit's buffers from one forward to the next.
// A wholly frozen unit's full gradients were freed after backward (ZeRO-1), and ZeRO-2
// style policies free them after each reduction, with the Params still pointing there.
struct ReplicatedZeRO2 {  // parameters replicated, gradients and optimizer state sharded
  static constexpr std::string_view name = "ReplicatedZeRO2";
  constexpr shard::policy policy() const {
    return {.shard_parameters = false, .free = shard::free_point::never};
  }
};

TEST_CASE("after a step every Param's gradient is null or inside its unit's live gradients", "[frozen][memory]") {
  for (const shard::AnyStrategy& strategy : {shard::AnyStrategy(shard::FullShard{}), shard::AnyStrategy(shard::ShardGradOp{}),
                                             shard::AnyStrategy(shard::ShardOptimizer{}), shard::AnyStrategy(shard::NoShard{}),
                                             shard::AnyStrategy(ReplicatedZeRO2{})}) {
    std::vector<std::string> problems(2);
    comm::launch(2, [&](comm::ThreadComm& c) {
      Model m = fixture::make_model();
      freeze_only(m, {"1.layers.0.weight", "1.layers.0.bias"});  // a whole unit
      auto model = shard::fully_shard<optim::AdamW>(m, c, strategy, {.wrap = shard::wrap_types<Block>{}, .seed = 42});
      optim::AdamW opt{adamw};
      model.train_step(opt, fixture::batch(0, 4, 5, 1, 4 * c.rank()), fixture::batch(0, 4, 3, 2, 4 * c.rank()),
                       fixture::mse);
      const auto inside = [](const float* p, std::span<const float> live) {
        const std::less<const float*> before;
        return !before(p, live.data()) && before(p, live.data() + live.size());
      };
      for (const auto& u : model.units())  // full gradients, or NoShard's reduced ones in place
        for (const auto* p : u.params)
          if (p->grad && !inside(p->grad, u.full_grad.span()) && !inside(p->grad, u.grad.span()))
            problems[std::size_t(c.rank())] += cat("unit '", u.name, "': a Param's gradient points outside its ",
                                                   u.full_grad.size(), " live full gradients; ");
    });
    INFO(strategy.name);
    for (const auto& p : problems) CHECK(p == "");
  }
}

// Files and state dicts hold every element of each piece, zeros where frozen (the same
// as before freezing was known to the state), so they load into any world size: the
// whole optimizer state read back after a resharding load is the one saved.
TEST_CASE("checkpoints of a model with frozen parameters reshard and resume", "[frozen][checkpoint]") {
  const auto root = std::filesystem::temp_directory_path() / cat("shardlib-frozen-", ::getpid());
  std::filesystem::remove_all(root);
  auto full_state = [](auto& model, auto& opt) {
    std::map<std::string, std::vector<float>> out;
    const auto d = io::get_optimizer_state(model, opt, {.full = true});
    for (const auto& [buffer, tensors] : d.buffers)
      for (const auto& [name, t] : tensors)
        for (const auto& p : t.pieces)
          out[buffer + "/" + name].assign(p.values.span().begin(), p.values.span().end());
    return out;
  };
  std::map<std::string, std::vector<float>> saved, loaded;
  std::vector<float> resumed, straight;
  auto run = [&](int w, int steps, bool save, bool load, std::vector<float>* params) {
    comm::launch(w, [&](comm::ThreadComm& c) {
      Model m = fixture::make_model();
      freeze_only(m, frozen_names);
      // One unit of everything: W = 2 and 3 both cut pieces with trained runs on both sides of a frozen one.
      auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, {.wrap = shard::wrap_none{}, .seed = 42});
      optim::AdamW opt{adamw};
      if (load) io::load_checkpoint(root, model, opt);
      const int per_rank = rows / w, first = c.rank() * per_rank;
      const int start = int(model.steps());
      for (int s = start; s < start + steps; ++s)
        model.train_step(opt, fixture::batch(s, per_rank, 5, 1, first), fixture::batch(s, per_rank, 3, 2, first),
                         fixture::mse);
      auto state = full_state(model, opt);
      if (save) io::save_checkpoint(root, model, opt);
      const auto values = model.full_state_dict();  // collective; rank 0 keeps the values
      if (c.rank() == 0) {
        (load ? loaded : saved) = std::move(state);
        if (params) {
          params->clear();
          for (const auto& [name, t] : values) params->insert(params->end(), t.span().begin(), t.span().end());
        }
      }
    });
  };
  run(2, 2, true, false, nullptr);
  run(3, 0, false, true, nullptr);  // resharded: W = 2 to 3
  REQUIRE(!saved.empty());
  CHECK(loaded == saved);
  std::size_t zeros = 0;
  for (const auto& name : frozen_names)
    for (float v : saved.at("exp_avg/" + name)) zeros += v == 0.0f;
  CHECK(zeros == 48);
  std::filesystem::remove_all(root);
  run(3, 2, true, false, nullptr);
  run(3, 2, false, true, &resumed);  // resumed at W = 3: the same bits as four steps straight
  run(3, 4, false, false, &straight);
  CHECK(bits(resumed) == bits(straight));
  std::filesystem::remove_all(root);
}

// Without frozen masters a checkpoint holds the frozen values as bf16 holds them; it loads
// into any world size, with frozen masters or without, and a run resumed from it is the
// same bits as one that did not stop. summon_full_params' writeback reaches the frozen
// values too (nn::merge_lora writes the frozen base so): halving every parameter between
// two steps ends the same with masters or without.
TEST_CASE("without frozen masters checkpoints reshard and resume, and writeback reaches frozen values",
          "[frozen][checkpoint]") {
  const auto root = std::filesystem::temp_directory_path() / cat("shardlib-frozen16-", ::getpid());
  std::filesystem::remove_all(root);
  const shard::mixed_precision mp{.param = dtype::bf16, .reduce = dtype::f32};
  struct what {
    int world = 3, steps = 0;
    bool masters = false, save = false, load = false, halve = false;
  };
  auto run = [&](what r) {
    std::vector<float> params;
    comm::launch(r.world, [&](comm::ThreadComm& c) {
      auto m = fixture::make_model16();
      freeze_only(m, frozen16);
      auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, options16(mp, false, r.masters));
      optim::AdamW opt{adamw};
      if (r.load) io::load_checkpoint(root, model, opt);
      const int per_rank = rows / r.world, first = c.rank() * per_rank;
      const int start = int(model.steps());
      for (int s = start; s < start + r.steps; ++s) {
        if (r.halve && s == start + 1)
          model.summon_full_params([&] {
            m.parameters([](std::string_view name, nn::Param<bfloat16>& p) {
              for (std::int64_t k = 0; k < p.shape.numel(); ++k) p.value[k] = bfloat16(0.5f * float(p.value[k]));
              if (name == "0.weight") p.value[0] = bfloat16(-0.0f);  // a frozen zero's sign is kept too
            });
          });
        model.train_step(opt, fixture::as<bfloat16>(fixture::batch(s, per_rank, 5, 1, first)),
                         fixture::as<bfloat16>(fixture::batch(s, per_rank, 3, 2, first)), fixture::mse_h<bfloat16>);
      }
      if (r.save) io::save_checkpoint(root, model, opt);
      const auto values = model.full_state_dict();  // collective; rank 0 keeps the values
      if (c.rank() == 0)
        for (const auto& [name, t] : values) params.insert(params.end(), t.span().begin(), t.span().end());
    });
    return params;
  };
  const auto saved = run({.steps = 2, .save = true});
  // The frozen values saved are bf16 values (the first step's masters of them are not).
  CHECK(saved != run({.steps = 2, .masters = true}));
  CHECK(bits(run({.world = 2, .masters = true, .load = true})) == bits(saved));
  CHECK(bits(run({.world = 2, .load = true})) == bits(saved));
  const auto resumed = run({.steps = 2, .load = true});
  const auto straight = run({.steps = 4});
  CHECK(resumed != saved);
  CHECK(bits(resumed) == bits(straight));
  std::filesystem::remove_all(root);
  // Halved through summon_full_params: a frozen master takes the halved bf16 value as the
  // compute copy does, so from there on both runs hold the same values.
  const auto halved = run({.steps = 3, .halve = true});
  CHECK(halved != run({.steps = 3}));
  CHECK((halved.at(0) == 0 && std::signbit(halved.at(0))));  // 0.weight's first element
  CHECK(bits(halved) == bits(run({.steps = 3, .masters = true, .halve = true})));
}

TEST_CASE("ranks that freeze different parameters all raise, naming the first that differs", "[frozen][errors]") {
  std::vector<std::string> errors(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    freeze_only(m, c.rank() == 1 ? std::set<std::string>{"1.layers.1.bias"} : frozen_names);
    errors[std::size_t(c.rank())] = test_support::raised([&] {
      auto model = shard::fully_shard(m, c, shard::FullShard{}, {.wrap = shard::wrap_types<Block>{}, .seed = 42});
    });
  });
  CHECK_THAT(errors[0], Contains("rank 0: the model differs between ranks 0 and 1") &&
                            Contains("'0.weight' [8, 5], frozen"));
  CHECK_THAT(errors[1],
             Contains("rank 1: the model differs between ranks 0 and 1") && Contains("(here: '0.weight' [8, 5])"));
}

// An optimizer that steps a shard only whole (no step_segment) cannot leave frozen
// elements out: every rank raises at the first step, before any unit steps.
TEST_CASE("an optimizer that cannot step part of a shard is refused with frozen parameters", "[frozen][errors]") {
  std::vector<std::string> errors(2);
  std::vector<std::vector<float>> before(2), after(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    freeze_only(m, {"1.layers.2.weight"});
    auto model = shard::fully_shard<fixture::sgd>(m, c, shard::FullShard{}, {.wrap = shard::wrap_types<Block>{},
                                                                             .seed = 42});
    fixture::sgd opt;
    for (auto& [name, t] : model.full_state_dict(false)) before[std::size_t(c.rank())].push_back(t[0]);
    errors[std::size_t(c.rank())] = test_support::raised([&] {
      model.train_step(opt, fixture::batch(0, 2, 5, 1, 2 * c.rank()), fixture::batch(0, 2, 3, 2, 2 * c.rank()),
                       fixture::mse);
    });
    for (auto& [name, t] : model.full_state_dict(false)) after[std::size_t(c.rank())].push_back(t[0]);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_THAT(errors[std::size_t(r)],
               Contains(cat("rank ", r, ": unit '1.layers.2': parameter '1.layers.2.weight' is frozen")) &&
                                           Contains("cannot leave part of a shard out of its step"));
    CHECK(before[std::size_t(r)] == after[std::size_t(r)]);
  }
}

// cut_frozen's runs over a piece of a layout: frozen entries cut out of group runs,
// gaps kept in the run they fall in, a piece inside one frozen entry.
TEST_CASE("cut_frozen cuts frozen entries out of a piece's runs", "[frozen][segments]") {
  nn::flat_layout layout;  // a [0, 20) gap [20, 32) b [32, 40) gap [40, 48) c [48, 58)
  layout.append("a", Shape{20}, {});
  layout.append("b", Shape{8}, {}, false);
  layout.append("c", Shape{10}, {});
  using optim::segment;
  auto same = [](const std::vector<segment>& got, const std::vector<segment>& want) {
    if (got.size() != want.size()) return false;
    for (std::size_t i = 0; i < got.size(); ++i)
      if (got[i].begin != want[i].begin || got[i].size != want[i].size || got[i].group != want[i].group) return false;
    return true;
  };
  // The whole unit as one group: a and its gap, b frozen, b's gap and c.
  CHECK(same(optim::cut_frozen({{0, 58, 0}}, layout, 0, 58), {{0, 32, 0}, {32, 8, segment::frozen}, {40, 18, 0}}));
  // Two groups meeting inside the gap after a; the piece [10, 50) counted from 10.
  CHECK(same(optim::cut_frozen({{0, 15, 0}, {15, 25, 1}}, layout, 10, 40),
             {{0, 15, 0}, {15, 7, 1}, {22, 8, segment::frozen}, {30, 10, 1}}));
  // Inside b alone; and a piece with no frozen element is returned as it was.
  CHECK(same(optim::cut_frozen({{0, 4, 1}}, layout, 34, 4), {{0, 4, segment::frozen}}));
  CHECK(same(optim::cut_frozen({{0, 10, 0}, {10, 8, 1}}, layout, 40, 18), {{0, 10, 0}, {10, 8, 1}}));
  // Every parameter frozen: the gap between them and the padding after them too.
  nn::flat_layout all;  // a [0, 20) gap [20, 32) b [32, 40)
  all.append("a", Shape{20}, {}, false);
  all.append("b", Shape{8}, {}, false);
  CHECK(same(optim::cut_frozen({{0, 12, 0}}, all, 30, 12), {{0, 12, segment::frozen}}));
  // Runs that do not tile a shard are refused before anything steps.
  optim::SGD::state st;
  const std::vector<segment> gap{{0, 4, 0}, {5, 5, 0}};
  const std::vector<float> g(10);
  CHECK_THROWS_WITH(optim::step_runs("x", 10, std::span<const float>(g), st, gap, 1, [](auto&, std::size_t, auto) {}),
                    Contains("x::step: segment [5, 10) of group 0 does not continue the runs of a shard of 10 at 4"));
  CHECK(st.step == 0);
}

// A step over runs takes the shard's gradients or its trained runs' alone, end to end as
// their state (what a sharded model keeps for a unit whose reduction packs them): the
// same step, bit for bit, for Adam's host and group steps and SGD's; other sizes are
// refused before anything moves.
TEST_CASE("a step over runs takes the shard's gradients or its trained runs' alone", "[frozen][segments]") {
  using optim::segment;
  const std::vector<segment> runs{{0, 3, 0}, {3, 4, segment::frozen}, {7, 2, 0}, {9, 5, segment::frozen}, {14, 2, 0}};
  const std::size_t n = 16, trained = optim::trained_size(runs);
  REQUIRE(trained == 7);
  std::vector<float> params(n), grads(n), compact;
  for (std::size_t k = 0; k < n; ++k) {
    params[k] = 0.25f * float(k) - 1.5f;
    grads[k] = 0.125f * float(k % 5) - 0.3f;
  }
  optim::for_each_trained_run(runs, [&](const segment& r, std::size_t) {
    compact.insert(compact.end(), grads.begin() + std::ptrdiff_t(r.begin), grads.begin() + std::ptrdiff_t(r.begin + r.size));
  });
  auto both = [&](auto opt, auto step) {
    auto full_p = params, compact_p = params;
    auto full_s = opt.make_state(trained), compact_s = opt.make_state(trained);
    for (int s = 0; s < 3; ++s) {
      step(opt, full_p, std::span<const float>(grads), full_s);
      step(opt, compact_p, std::span<const float>(compact), compact_s);
    }
    CHECK(full_p != params);
    CHECK(bits(full_p) == bits(compact_p));
    // Neither the shard's size nor the trained elements': refused, nothing stepped.
    const std::vector<float> odd(trained + 1, 1.0f);
    auto before = compact_p;
    CHECK_THROWS_WITH(step(opt, compact_p, std::span<const float>(odd), compact_s),
                      Contains("a shard of 16 elements, 7 of them trained, but 8 gradients"));
    CHECK(bits(compact_p) == bits(before));
    CHECK(compact_s.step == 3);
  };
  auto unfrozen = [&](const auto& opt, std::vector<float>& p, std::span<const float> g, auto& st) {
    optim::step_unfrozen(opt, std::span<float>(p), g, st, std::span<const segment>(runs));
  };
  both(optim::AdamW{adamw}, unfrozen);
  both(optim::SGD{{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01}}, unfrozen);
  using Groups = optim::param_groups<optim::AdamW>;
  const Groups groups({{.name = "all", .rule = [](std::string_view, const Shape&) { return true; }, .options = adamw}});
  both(groups, [&](const Groups& opt, std::vector<float>& p, std::span<const float> g, auto& st) {
    opt.step(std::span<float>(p), g, st, std::span<const segment>(runs));
  });
}

// A unit whose parameters are all frozen sends nothing for its gradients (FSDP2 reduces
// only parameters with gradients): a reduce-scatter (all-reduce under NoShard) the size
// of its padded flat buffer less per step; and keeps no reduced gradients but where its
// fp32 layers write them (NoShard); and trains as the reference still.
TEST_CASE("a unit whose parameters are all frozen reduces nothing", "[frozen][traffic]") {
  const std::set<std::string> block{"1.layers.0.weight", "1.layers.0.bias"};  // unit 1.layers.0: 72 elements
  const int steps = 4;
  const auto want = reference(steps, 0, block);
  for (int w : {2, 3}) {
    const double padded = double(shard::shard_layout{72, w}.padded_size()) * sizeof(float);
    for (shard::AnyStrategy strategy : {shard::AnyStrategy(shard::FullShard{}), shard::AnyStrategy(shard::NoShard{})}) {
      INFO(strategy.name << " at W = " << w);
      const auto plain = train(w, strategy, optim::AdamW{adamw}, {}, steps, 0);
      const auto got = train(w, strategy, optim::AdamW{adamw}, block, steps, 0);
      const double ring = strategy.name == "NoShard" ? 2.0 * (w - 1) / w : double(w - 1) / w;
      CHECK(plain.reduced_bytes - got.reduced_bytes == Approx(ring * padded).epsilon(1e-12));
      CHECK(frozen_unchanged(got, block));
      CHECK(got.frozen_unit_grads == (strategy.name == "NoShard" ? padded / sizeof(float) : 0));
      test_support::max_error params;
      params.relative(got.params, want.params, 0.1);
      CHECK(params <= 5e-5);
    }
  }
  // Offloaded (the optimizer's side in host memory, no gradient copy for the frozen unit).
  const auto offloaded = train(3, shard::FullShard{}, optim::AdamW{adamw}, block, steps, 0, true);
  CHECK(frozen_unchanged(offloaded, block));
  CHECK(offloaded.frozen_unit_grads == 0);
  test_support::max_error params;
  params.relative(offloaded.params, want.params, 0.1);
  CHECK(params <= 5e-5);
}

// The planner reads the flags (docs/planner.md): every category as planned for the
// rank, the optimizer state Adam's 8 bytes per element the state holds, less than
// without the flags, and the bytes sent (a whole frozen unit reduces nothing); the
// reduced gradients less too (a whole frozen unit keeps none, a packed one its trained elements').
TEST_CASE("with frozen parameters the plan equals the ledger and the bytes sent", "[frozen][plan]") {
  const int w = 3;
  struct measured {
    std::vector<std::size_t> peak = std::vector<std::size_t>(category_count);
    std::size_t state_elements = 0;
    double sent = 0;
    plan::rank_plan plan, unfrozen;  // the second without the flags
  };
  // 1.layers.1.weight frozen too: that unit packs, and its reduced gradients are its trained elements'
  const std::set<std::string> lower{"0.weight", "1.layers.0.weight", "1.layers.0.bias"};
  auto packed = lower;
  packed.insert("1.layers.1.weight");
  for (const auto& frozen : {lower, packed}) {
    INFO(frozen.size() << " frozen");
    std::vector<measured> out(w);
    comm::launch(w, [&](comm::ThreadComm& inner, ledger& l) {
      auto tally = std::make_shared<bench::traffic>();
      bench::counting_comm<comm::ThreadComm> c(inner, tally);
      Model m = fixture::make_model();
      freeze_only(m, frozen);
      auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, {.wrap = shard::wrap_types<Block>{},
                                                                               .seed = 42});
      optim::AdamW opt{adamw};
      tally->reset();
      const int per_rank = rows / w, first = c.rank() * per_rank;
      for (int s = 0; s < 3; ++s)
        model.train_step(opt, fixture::batch(s, per_rank, 5, 1, first), fixture::batch(s, per_rank, 3, 2, first),
                         fixture::mse);
      auto& o = out[std::size_t(c.rank())];
      for (int k = 0; k < category_count; ++k) o.peak[std::size_t(k)] = l.peak(category(k));
      for (std::size_t i = 0; i < model.unit_count(); ++i)
        o.state_elements += model.optimizer_state(opt, i).exp_avg.size();
      o.sent = tally->total() / 3;
      auto desc = plan::describe(model);
      o.plan = plan::make_plan(desc, {.policy = shard::FullShard{}.policy(), .world = w, .rank = c.rank()});
      desc.frozen.clear();
      o.unfrozen = plan::make_plan(desc, {.policy = shard::FullShard{}.policy(), .world = w, .rank = c.rank()});
    });
    for (const auto& o : out) {
      for (int k = 0; k < category_count; ++k) {
        if (category(k) == category::activations) continue;  // not measured for the plan here
        INFO(name(category(k)));
        CHECK(o.peak[std::size_t(k)] == o.plan.memory[category(k)]);
      }
      CHECK(o.peak[std::size_t(category::optimizer_state)] == 8 * o.state_elements);
      CHECK(o.plan.memory.optimizer_state < o.unfrozen.memory.optimizer_state);
      CHECK(o.plan.memory.gradients < o.unfrozen.memory.gradients);
      CHECK(o.sent == Approx(o.plan.sent.total()).epsilon(1e-12));
      CHECK(o.sent < o.unfrozen.sent.total());
    }
  }
}

// The same with 16-bit layers and no masters for frozen elements, offloaded or not: the
// plan counts each rank's master as its trained elements in wholly frozen and packed units.
TEST_CASE("without frozen masters the plan equals the ledger", "[frozen][plan]") {
  const int w = 3;
  const shard::mixed_precision mp{.param = dtype::bf16, .reduce = dtype::bf16};
  for (bool offload : {false, true}) {
    INFO((offload ? "offloaded" : "in the model's space"));
    struct measured {
      std::size_t parameters = 0, offloaded = 0;
      plan::rank_plan plan, with_masters;
    };
    std::vector<measured> out(w);
    comm::launch(w, [&](comm::ThreadComm& c, ledger& l) {
      auto m = fixture::make_model16();
      freeze_only(m, frozen16);
      auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, options16(mp, offload, false));
      auto& o = out[std::size_t(c.rank())];
      o.parameters = l.peak(category::parameters);
      o.offloaded = l.offload().peak(category::parameters);
      const auto desc = plan::describe(model);
      plan::setup s{.policy = shard::FullShard{}.policy(),
                    .world = w,
                    .precision = plan::precision::param_layers(mp),
                    .offload = offload,
                    .frozen_masters = false,
                    .rank = c.rank()};
      o.plan = plan::make_plan(desc, s);
      s.frozen_masters = true;
      o.with_masters = plan::make_plan(desc, s);
    });
    for (const auto& o : out) {
      CHECK(o.parameters == o.plan.memory.parameters);
      if (offload) CHECK(o.offloaded == o.plan.offloaded.parameters);
      const auto fewer = [&](const plan::rank_plan& p) { return offload ? p.offloaded.parameters : p.memory.parameters; };
      CHECK(fewer(o.plan) < fewer(o.with_masters));
    }
    // rank 0 keeps 19 + 24 master elements fewer (test above), rank 1 as many, rank 2 19 + 16
    const auto saved = [&](int r) {
      const auto& o = out[std::size_t(r)];
      return offload ? o.with_masters.offloaded.parameters - o.plan.offloaded.parameters
                     : o.with_masters.memory.parameters - o.plan.memory.parameters;
    };
    CHECK(saved(0) == 4 * (19 + 24));
    CHECK(saved(1) == 4 * (19 + 24));
    CHECK(saved(2) == 4 * (19 + 16));
  }
}

TEST_CASE("nn::freeze freezes the parameters its globs name, each once, and names a glob that matches none",
          "[frozen][freeze]") {
  CHECK(glob_match("1.layers.*.bias", "1.layers.2.bias"));
  CHECK(glob_match("*", ""));
  CHECK(glob_match("0.*", "0.weight"));
  CHECK_FALSE(glob_match("0.*", "10.weight"));
  CHECK_FALSE(glob_match("1.layers.*.bias", "1.layers.2.weight"));
  Model m = fixture::make_model();
  CHECK(nn::freeze(m, {"0.*", "1.layers.*.bias", "0.weight"}) == 5);  // 0.weight matched twice, frozen once
  std::vector<std::string> frozen;
  m.parameters([&](std::string_view name, auto& p) {
    if (!p.requires_grad) frozen.emplace_back(name);
  });
  CHECK(frozen == std::vector<std::string>{"0.weight", "0.bias", "1.layers.0.bias", "1.layers.1.bias",
                                           "1.layers.2.bias"});
  CHECK(nn::freeze(m, {"0.*"}) == 0);  // already frozen
  Model other = fixture::make_model();
  CHECK_THROWS_WITH(nn::freeze(other, {"2.*", "3.*"}), Contains("freeze: no parameter matches '3.*'"));
}

// Unit 0 (Linear(5, 8): weight [0, 40), a gap, bias [48, 56)) frozen whole: its gap, and
// at W = 3 its padding, belong to no parameter, and still no rank keeps optimizer state
// for it or steps it (a rank whose piece held only the gap once raised alone).
TEST_CASE("a unit of frozen parameters with gaps and padding is stepped by no optimizer on any rank",
          "[frozen][segments]") {
  const std::set<std::string> unit0{"0.weight", "0.bias"};
  const auto want = reference(3, 0, unit0);
  using Groups = optim::param_groups<optim::AdamW>;
  const Groups one({{.name = "all", .rule = [](std::string_view, const Shape&) { return true; }, .options = adamw}});
  const optim::SGD sgd{{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01}};
  for (int w : {1, 2, 3})
    for (shard::AnyStrategy strategy : {shard::AnyStrategy(shard::FullShard{}), shard::AnyStrategy(shard::ShardOptimizer{}),
                                        shard::AnyStrategy(shard::NoShard{})}) {
      INFO(strategy.name << " at W = " << w);
      const auto adam = train(w, strategy, optim::AdamW{adamw}, unit0, 3, 0);
      CHECK(frozen_unchanged(adam, unit0));
      test_support::max_error params;
      params.relative(adam.params, want.params, 0.1);
      CHECK(params <= 5e-5);
      const auto groups = train(w, strategy, one, unit0, 3, 0);
      CHECK(bits(groups.params) == bits(adam.params));
      CHECK(frozen_unchanged(train(w, strategy, sgd, unit0, 3, clip_at), unit0));
    }
}

}  // namespace test_frozen
