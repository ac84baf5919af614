// State dicts in memory (io/sharded_state.hpp): sharded dicts of model and optimizer
// loaded at the same world size (bit for bit) and resharded (4 -> 3, 2 -> 4, FullShard ->
// ShardOptimizer with parameter groups), full dicts equal to the shards put together and
// loaded into another sharding, training continuing after each load, and bad dicts.
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/sharded_state.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/param_groups.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/compare.hpp"
#include "support/shard_fixture.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace test_state_dict {

using namespace shardlib;
using Catch::Contains;

namespace {

using Groups = optim::param_groups<optim::AdamW>;
Groups no_decay_groups() { return Groups::no_decay_split({.lr = 1e-2, .weight_decay = 0.1}); }
optim::Adam adam() { return optim::Adam{{.lr = 1e-2}}; }

shard::options wrap_blocks(std::uint64_t seed) { return {.wrap = shard::wrap_types<fixture::Block>{}, .seed = seed}; }

// Adam steps [first, first + steps) on this rank's rows of a 24-row global batch; the
// global mean losses.
template <class Sharded, class O>
std::vector<float> train(Sharded& model, O& opt, int first, int steps) {
  const int world = model.comm().size(), rank = model.comm().rank(), rows = 24 / world;
  std::vector<float> losses;
  for (int s = first; s < first + steps; ++s) {
    auto x = fixture::batch(s, rows, 5, 1, rank * rows), y = fixture::batch(s, rows, 3, 2, rank * rows);
    losses.push_back(model.train_step(opt, x, y, nn::mse_loss));
  }
  return losses;
}

// Every tensor of some dicts put together by offset, as "<kind>/<name>" (kind "master" or
// a buffer); elements in no piece stay NaN.
using flat_state = std::map<std::string, std::vector<float>>;
void add_flat(flat_state& out, const std::string& kind, const io::sharded_tensors& tensors) {
  for (const auto& [name, t] : tensors) {
    auto& v = out[kind + "/" + name];
    if (v.empty()) v.assign(std::size_t(t.shape.numel()), std::nanf(""));
    for (const auto& p : t.pieces) std::copy_n(p.values.span().begin(), p.values.numel(), v.begin() + long(p.offset));
  }
}
flat_state flatten(std::span<const io::model_state_dict> models, std::span<const io::optim_state_dict> optims) {
  flat_state out;
  for (const auto& m : models) add_flat(out, "master", m.params);
  for (const auto& o : optims)
    for (const auto& [buffer, tensors] : o.buffers) add_flat(out, buffer, tensors);
  return out;
}
// The whole state of a model and optimizer, gathered (collective); empty but on rank 0.
template <class Sharded, class O>
flat_state full_state(Sharded& model, O& opt) {
  const auto m = io::get_model_state(model, {.full = true, .rank0_only = true});
  const auto o = io::get_optimizer_state(model, opt, {.full = true, .rank0_only = true});
  return model.comm().rank() == 0 ? flatten(std::span(&m, 1), std::span(&o, 1)) : flat_state{};
}

// The first tensor whose bits differ or that holds a value that is not finite; "" if none.
std::string first_difference(const flat_state& got, const flat_state& want) {
  if (got.size() != want.size()) return cat(got.size(), " tensors, want ", want.size());
  for (const auto& [name, w] : want) {
    const auto g = got.find(name);
    if (g == got.end()) return cat("'", name, "' missing");
    if (!std::all_of(w.begin(), w.end(), [](float x) { return std::isfinite(x); })) return cat("'", name, "' not finite");
    if (g->second.size() != w.size() || std::memcmp(g->second.data(), w.data(), w.size() * sizeof(float)) != 0)
      return cat("'", name, "' differs");
  }
  return "";
}
// Parameters (not optimizer state) relative to max(|want|, lr): Adam's steps are about lr
// whatever the gradient's scale (the floor tests/unit/test_checkpoint.cpp explains).
test_support::max_error worst_parameter_difference(const flat_state& got, const flat_state& want) {
  test_support::max_error worst;
  for (const auto& [name, w] : want)
    if (name.starts_with("master/")) worst.relative(got.at(name), w, 1e-2);
  return worst;
}

struct run {
  std::vector<float> losses;  // the steps after the load (or all, uninterrupted)
  flat_state saved, loaded, final_state;
};

// Uninterrupted: n steps on wf ranks with strategy sf.
template <class O, class From, class MakeOpt>
run uninterrupted(int wf, From sf, MakeOpt make_opt, int n) {
  run r;
  comm::launch(wf, [&](comm::ThreadComm& c) {
    auto m = fixture::make_model();
    auto model = shard::fully_shard<O>(m, c, sf, wrap_blocks(42));
    O opt = make_opt();
    auto l = train(model, opt, 0, n);
    auto f = full_state(model, opt);
    if (c.rank() == 0) r = {l, {}, {}, std::move(f)};
  });
  return r;
}

// In one launch of max(wf, wt) rank threads (dicts hold memory of their rank's ledger,
// which lives as long as the thread): ranks [0, wf) train n1 steps with strategy sf and
// offer their dicts (sharded, or full: then one dict holds everything); ranks [0, wt)
// wrap a model with strategy st and another seed, load every dict offered, train n2 more.
template <class O, class From, class To, class MakeOpt>
run offer_and_load(int wf, From sf, int wt, To st, MakeOpt make_opt, bool full, int n1, int n2) {
  run r;
  std::vector<io::model_state_dict> models(std::size_t(wf), io::model_state_dict{});
  std::vector<io::optim_state_dict> optims(std::size_t(wf), io::optim_state_dict{});
  comm::launch(std::max(wf, wt), [&](comm::ThreadComm& c) {
    const int rank = c.rank();
    auto from_comm = c.split(rank < wf ? 0 : 1, rank);
    auto to_comm = c.split(rank < wt ? 0 : 1, rank);
    if (rank < wf) {
      auto m = fixture::make_model();
      auto model = shard::fully_shard<O>(m, from_comm, sf, wrap_blocks(42));
      O opt = make_opt();
      train(model, opt, 0, n1);
      models[std::size_t(rank)] = io::get_model_state(model, {.full = full});
      optims[std::size_t(rank)] = io::get_optimizer_state(model, opt, {.full = full});
      auto s = full_state(model, opt);
      if (rank == 0) r.saved = std::move(s);
    }
    c.barrier();
    if (rank < wt) {
      auto m = fixture::make_model();
      auto model = shard::fully_shard<O>(m, to_comm, st, wrap_blocks(7));  // every value must come from the dicts
      O opt = make_opt();
      const std::size_t offered = full ? 1 : std::size_t(wf);
      io::set_state(model, opt, std::span<const io::model_state_dict>(models).first(offered),
                    std::span<const io::optim_state_dict>(optims).first(offered));
      auto s = full_state(model, opt);
      auto l = train(model, opt, n1, n2);
      auto f = full_state(model, opt);
      if (rank == 0) {
        r.loaded = std::move(s);
        r.losses = std::move(l);
        r.final_state = std::move(f);
      }
    }
    c.barrier();  // everyone has loaded: each rank frees its own dicts
    if (rank < wf) {
      models[std::size_t(rank)] = {};
      optims[std::size_t(rank)] = {};
    }
  });
  return r;
}

// Loads wf -> wt and checks: the state right after loading is the saved one bit for bit;
// training on matches the uninterrupted run bit for bit (same world and strategy) or
// within 1e-5 (the sums run in another order: test_checkpoint's tolerance).
template <class O, class From, class To, class MakeOpt>
void check_load(int wf, From sf, int wt, To st, MakeOpt make_opt, bool full, bool exact) {
  INFO(wf << " ranks " << From::name << " -> " << wt << " ranks " << To::name << (full ? ", full dicts" : ""));
  const int n1 = 3, n2 = 3;
  const run ref = uninterrupted<O>(wf, sf, make_opt, n1 + n2);
  const run got = offer_and_load<O>(wf, sf, wt, st, make_opt, full, n1, n2);
  CHECK(first_difference(got.loaded, got.saved) == "");
  REQUIRE(got.losses.size() == std::size_t(n2));
  REQUIRE(ref.losses.size() == std::size_t(n1 + n2));
  CHECK(ref.losses.back() < ref.losses.front());  // it trained
  const std::vector<float> ref_tail(ref.losses.begin() + n1, ref.losses.end());
  if (exact) {
    CHECK(std::memcmp(got.losses.data(), ref_tail.data(), ref_tail.size() * sizeof(float)) == 0);
    CHECK(first_difference(got.final_state, ref.final_state) == "");
  } else {
    test_support::max_error worst_loss;
    worst_loss.relative(got.losses, ref_tail, 1e-6);
    const auto worst_param = worst_parameter_difference(got.final_state, ref.final_state);
    INFO("worst relative loss difference " << worst_loss << ", parameters " << worst_param);
    CHECK(worst_loss <= 1e-5);
    CHECK(worst_param <= 1e-5);
  }
}

}  // namespace

TEST_CASE("a sharded state dict loads bit for bit at the same world size, and training continues identically",
          "[state_dict]") {
  check_load<optim::Adam>(4, shard::FullShard{}, 4, shard::FullShard{}, adam, false, true);
  check_load<Groups>(3, shard::ShardOptimizer{}, 3, shard::ShardOptimizer{}, no_decay_groups, false, true);
}

TEST_CASE("a sharded state dict reshards across world sizes, strategies and parameter groups", "[state_dict]") {
  check_load<optim::Adam>(4, shard::FullShard{}, 3, shard::FullShard{}, adam, false, false);
  check_load<optim::Adam>(2, shard::FullShard{}, 4, shard::FullShard{}, adam, false, false);
  check_load<Groups>(4, shard::FullShard{}, 2, shard::ShardOptimizer{}, no_decay_groups, false, false);
}

TEST_CASE("full dicts load into any sharding", "[state_dict][full]") {
  check_load<optim::Adam>(4, shard::FullShard{}, 4, shard::FullShard{}, adam, true, true);
  check_load<Groups>(4, shard::FullShard{}, 2, shard::NoShard{}, no_decay_groups, true, false);
  check_load<optim::Adam>(2, shard::ShardOptimizer{}, 3, shard::ShardGradOp{}, adam, true, false);
}

TEST_CASE("the full dicts are the shards put together, and the model's is the engine's full_state_dict",
          "[state_dict][full]") {
  std::vector<io::model_state_dict> models(4);
  std::vector<io::optim_state_dict> optims(4);
  flat_state from_shards, full, engine;
  std::vector<std::uint64_t> held(4);  // elements each rank's pieces hold
  std::uint64_t total = 0;
  io::checkpoint_optimizer record;  // rank 0's full optimizer record, checked after launch
  comm::launch(4, [&](comm::ThreadComm& c) {
    auto m = fixture::make_model();
    auto model = shard::fully_shard<Groups>(m, c, shard::FullShard{}, wrap_blocks(42));
    auto opt = no_decay_groups();
    train(model, opt, 0, 2);
    const auto r = std::size_t(c.rank());
    models[r] = io::get_model_state(model);
    optims[r] = io::get_optimizer_state(model, opt);
    for (const auto& [name, t] : models[r].params)
      for (const auto& p : t.pieces) held[r] += std::uint64_t(p.values.numel());
    const auto fm = io::get_model_state(model, {.full = true});  // every rank keeps it
    const auto fo = io::get_optimizer_state(model, opt, {.full = true});
    const auto e = model.full_state_dict();
    c.barrier();
    if (r == 0) {
      from_shards = flatten(models, optims);
      full = flatten(std::span(&fm, 1), std::span(&fo, 1));
      for (const auto& t : e) engine["master/" + t.name].assign(t.value.span().begin(), t.value.span().end());
      for (const auto& [name, t] : fm.params) total += std::uint64_t(t.shape.numel());
      record = fo.record;
    }
    c.barrier();
    models[r] = {};
    optims[r] = {};
  });
  CHECK(record.state == std::vector<std::string>{"exp_avg", "exp_avg_sq"});
  CHECK(record.step == 2);
  CHECK(record.hyperparameters.at("param_groups").size() == 2);
  REQUIRE(full.size() == 3 * engine.size());  // master, exp_avg, exp_avg_sq of every parameter
  CHECK(first_difference(from_shards, full) == "");
  flat_state masters;
  for (const auto& [k, v] : full)
    if (k.starts_with("master/")) masters[k] = v;
  CHECK(first_difference(masters, engine) == "");
  // FullShard's pieces tile each parameter once: no rank repeats another's elements.
  std::uint64_t sum = 0;
  for (auto h : held) sum += h;
  CHECK(sum == total);
  for (auto h : held) CHECK(h > 0);
}

TEST_CASE("bad dicts raise on every rank, name what is wrong and change nothing", "[state_dict][bad]") {
  std::vector<io::model_state_dict> models(2);
  std::vector<io::optim_state_dict> optims(2);
  std::map<std::string, std::vector<std::string>> errors;  // case -> each rank's message
  std::vector<std::string> unchanged(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    const auto r = std::size_t(c.rank());
    auto m = fixture::make_model();
    auto model = shard::fully_shard<Groups>(m, c, shard::FullShard{}, wrap_blocks(42));
    auto opt = no_decay_groups();
    train(model, opt, 0, 1);
    models[r] = io::get_model_state(model);
    optims[r] = io::get_optimizer_state(model, opt);
    c.barrier();

    auto m2 = fixture::make_model();
    auto other = shard::fully_shard<Groups>(m2, c, shard::FullShard{}, wrap_blocks(7));
    auto opt2 = no_decay_groups();
    train(other, opt2, 0, 1);
    const auto before = full_state(other, opt2);
    auto attempt = [&](const std::string& name, auto&& offered_models, auto&& offered_optims, auto& o) {
      std::string message = "no error";
      try {
        io::set_state(other, o, std::span<const io::model_state_dict>(offered_models),
                      std::span<const io::optim_state_dict>(offered_optims));
      } catch (const io_error& e) {
        message = e.what();
      }
      c.barrier();
      if (r == 0) errors[name].resize(2);
      c.barrier();
      errors[name][r] = message;
    };

    auto misplaced = models;  // the copies share the tensors; only the offset moves
    misplaced[1].params.at("0.weight").pieces.at(0).offset = 30;
    attempt("misplaced", misplaced, optims, opt2);

    auto missing = models;
    for (auto& d : missing) d.params.erase("2.bias");
    attempt("missing", missing, optims, opt2);

    attempt("one rank only", std::vector<io::model_state_dict>{models[0]},
            std::vector<io::optim_state_dict>{optims[0]}, opt2);

    Groups one({{.name = "all", .rule = [](std::string_view, const Shape&) { return true; }, .options = {.lr = 1e-2}}});
    attempt("groups", models, optims, one);

    const auto after = full_state(other, opt2);
    if (r == 0) unchanged[0] = first_difference(after, before);
    c.barrier();
    models[r] = {};
    optims[r] = {};
  });
  auto check = [&](const std::string& name, const std::string& what) {
    INFO(name);
    REQUIRE(errors[name].size() == 2);
    for (const auto& e : errors[name]) CHECK_THAT(e, Contains(what));
  };
  // 0.weight is [8, 5] in a unit of 56 elements: rank 1's piece is its elements [28, 40), moved to [30, 42).
  check("misplaced", "a piece of parameter '0.weight' (master) holds elements [30, ");
  check("misplaced", "which do not fit its shape [8, 5] (40 elements)");
  check("missing", "the state dict: this model's parameter '2.bias' [3] is not in it");
  check("one rank only", ") are in no piece offered; offer the dicts of every rank");
  check("groups", "the state dict: it holds 2 parameter groups; this optimizer has 1 ('all')");
  CHECK(unchanged[0] == "");
}

}  // namespace test_state_dict
