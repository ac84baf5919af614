// Tied parameters (a layer reading another layer's Param, as GPT-2's lm_head reads
// the token embedding): discovery gives the Param to the lowest common unit of its
// users, every strategy trains a tied model as unsharded training does, the tied
// gradient is the sum of both uses, state dicts list every name, checkpoints
// round-trip, the planner counts the Param once, and ties that cannot hold raise.
// Then the engine around them: size-based wrapping, eval mode, summon_full_params, and
// train_step's per-item mean over padded tokens.
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/nn/tied_linear.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/plan/describe.hpp"
#include "shardlib/plan/memory_plan.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/compare.hpp"
#include "support/raised.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>  // getpid

namespace test_tied {

using namespace shardlib;
using Catch::Contains;

namespace {

constexpr std::int64_t vocab = 13, dim = 6;

// Embedding -> two Linear blocks -> a head tied to the embedding: logits = h W_te^T.
template <class T>
using Model = nn::Sequential<nn::Embedding<T>, nn::Stack<nn::Linear<T>>, nn::TiedLinear<T>>;

// Sequential moves its layers in, and moves untie: tie once the model is in place.
template <class T>
void tie(Model<T>& m) {
  m.template get<2>().tie(m.template get<0>().weight);
}
template <class T>
Model<T> make_model() {
  return Model<T>{nn::Embedding<T>(vocab, dim), nn::Stack<nn::Linear<T>>(2, nn::Linear<T>(dim, dim)),
                  nn::TiedLinear<T>(dim, vocab)};
}
// Every block a unit, and the embedding and the head units of their own: the tied
// weight's users sit in different units, so the root owns it.
template <class T>
shard::options each_layer_a_unit(std::uint64_t seed = 42) {
  return {.wrap = shard::wrap_types<nn::Embedding<T>, nn::Linear<T>, nn::TiedLinear<T>>{}, .seed = seed};
}

// Rows [first, first + rows) of step s's token ids (stream 1) or targets (stream 2):
// any rank takes its slice of the global batch.
Tensor<std::int64_t> tokens(int step, std::int64_t rows, std::uint64_t stream, std::int64_t first = 0) {
  Tensor<std::int64_t> t({rows});
  const counter_rng rng(500 + std::uint64_t(step), stream);
  for (std::int64_t i = 0; i < rows; ++i)
    t[i] = std::min<std::int64_t>(vocab - 1, std::int64_t(rng.uniform_double(std::uint64_t(first + i)) * vocab));
  return t;
}

// Step s's targets for rows [first, first + rows) of a global batch of `total` rows, padded:
// row g ignored (-100) with probability 0.8 g / total, so that later ranks hold fewer tokens,
// at odd steps rows [total / 2, total / 2 + 3) all ignored and at step 4 the second half (at
// W = 2 and 6 rows a rank, rank 1's micro-batches of 1 and 2 rows then hold none, and at step
// 4 rank 1 none at all).
Tensor<std::int64_t> padded_targets(int step, std::int64_t rows, std::int64_t first, std::int64_t total) {
  auto t = tokens(step, rows, 2, first);
  const counter_rng rng(700 + std::uint64_t(step), 3);
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int64_t g = first + i, half = total / 2;
    const bool hole = g >= half && ((step % 2 == 1 && g < half + 3) || step == 4);
    if (hole || rng.uniform_double(std::uint64_t(g)) < 0.8 * double(g) / double(total)) t[i] = -100;
  }
  return t;
}

// Plain SGD.
template <class T>
struct sgd {
  T lr = T(0.5);
  struct state {};
  state make_state(std::size_t) { return {}; }
  void step(std::span<T> p, std::span<const T> g, state&) {
    for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * g[i];
  }
};

// The values under every name the model lists, in its order (as full_state_dict);
// the unsharded reference is nn::Replicated, which lays a tied weight out once
// under its first name, as the engine does.
template <class T, class M>
std::vector<T> listed(M& m) {
  std::vector<T> out;
  m.parameters([&](std::string_view, nn::Param<T>& p) { out.insert(out.end(), p.value, p.value + p.numel()); });
  return out;
}

struct trace {
  std::vector<double> losses, params;
  bool edit_seen = false;  // the state dict right after the edit showed it
  bool clipped = false;    // train_step's norm was above step_options::max_norm at least once
};

// The edit summon_full_params tests make between steps: a row of the tied weight
// (read by both users) and one bias element.
template <class T>
void edit(Model<T>& m) {
  std::fill_n(m.template get<0>().weight.value, dim, T(0.25));
  m.template get<1>()[1].bias.value[2] = T(-0.5);
}
bool shows_edit(const auto& state_dict) {
  auto at = [&](std::string_view name) {
    for (const auto& e : state_dict)
      if (e.name == name) return e.value.span();
    throw error(cat("no parameter ", name));
  };
  const auto emb = at("0.weight"), head = at("2.weight"), bias = at("1.layers.1.bias");
  return std::all_of(emb.begin(), emb.begin() + dim, [](float v) { return v == 0.25f; }) &&
         std::all_of(head.begin(), head.begin() + dim, [](float v) { return v == 0.25f; }) && bias[2] == -0.5f;
}

// Unsharded training in double on the global batch (world * per_rank tokens a
// step), edited before step edit_at (if any), the gradients clipped to max_norm as
// PyTorch's clip_grad_norm_ clips them (max_norm / (norm + 1e-6)) when max_norm > 0;
// padded: on padded_targets, the loss a mean over the tokens not ignored.
trace unsharded(int world, int per_rank, int steps, int edit_at = -1, double max_norm = 0, bool padded = false) {
  auto m = make_model<double>();
  tie(m);
  nn::Replicated<double, Model<double>> owner(m, 42);
  nn::context ctx;
  sgd<double> opt;
  sgd<double>::state st;
  trace t;
  for (int s = 0; s < steps; ++s) {
    if (s == edit_at) edit(m);
    owner.zero_grad();
    const std::int64_t rows = world * per_rank;
    const auto l = nn::cross_entropy(ctx.forward(m, tokens(s, rows, 1)),
                                     padded ? padded_targets(s, rows, 0, rows) : tokens(s, rows, 2));
    ctx.backward(m, l.grad);
    double squared = 0;
    for (double g : owner.grads()) squared += g * g;
    if (const double norm = std::sqrt(squared); max_norm > 0 && norm + 1e-6 > max_norm)
      for (double& g : owner.grads()) g *= max_norm / (norm + 1e-6);
    opt.step(owner.values(), owner.grads(), st);
    t.losses.push_back(l.loss);
  }
  t.params = listed<double>(m);
  return t;
}

// micro > 1: each step is train_step over that many micro-batches of the rank's rows, the
// gradients clipped to so.max_norm.
template <class T = float>
std::vector<trace> sharded(int world, int per_rank, int steps, shard::AnyStrategy strategy, shard::wrap_policy wrap,
                           int edit_at = -1, int micro = 1, const shard::step_options& so = {}) {
  std::vector<trace> out(static_cast<std::size_t>(world));
  comm::launch(world, [&](comm::ThreadComm& c) {
    auto m = make_model<T>();
    tie(m);
    auto model = shard::fully_shard<sgd<T>, T>(m, c, strategy, {.wrap = wrap, .seed = 42});
    sgd<T> opt;
    auto& t = out[std::size_t(c.rank())];
    for (int s = 0; s < steps; ++s) {
      if (s == edit_at) {
        model.summon_full_params([&] { edit(m); });
        t.edit_seen = shows_edit(model.full_state_dict(false));
      }
      if (micro > 1) {
        std::vector<Tensor<std::int64_t>> xs, ys;
        const int rows = per_rank / micro;
        for (int k = 0; k < micro; ++k) {
          xs.push_back(tokens(s, rows, 1, c.rank() * per_rank + k * rows));
          ys.push_back(tokens(s, rows, 2, c.rank() * per_rank + k * rows));
        }
        const auto r = model.train_step(opt, xs, ys, nn::cross_entropy, so);
        static_assert(std::is_same_v<decltype(r.loss), T>);  // float64's loss in float64
        t.losses.push_back(r.loss);                           // the global mean
        t.clipped = t.clipped || r.grad_norm > so.max_norm;
        continue;
      }
      model.zero_grad();
      const auto l = nn::cross_entropy(model.forward(tokens(s, per_rank, 1, c.rank() * per_rank)),
                                       tokens(s, per_rank, 2, c.rank() * per_rank));
      model.backward(l.grad);
      model.step(opt);
      std::vector<T> all(static_cast<std::size_t>(c.size()));
      c.all_gather(std::span<const T>(&l.loss, 1), std::span<T>(all));
      double mean = 0;
      for (T v : all) mean += double(v) / double(c.size());
      t.losses.push_back(mean);
    }
    for (auto& [name, value] : model.full_state_dict(false))
      t.params.insert(t.params.end(), value.span().begin(), value.span().end());
  });
  return out;
}

// train_step on each rank's rows of the padded batch (padded_targets), in micro-batches of
// `sizes` rows (one: the single-batch train_step), each step's loss as reported.
template <class T>
std::vector<trace> padded_run(int world, int steps, shard::AnyStrategy strategy, const std::vector<int>& sizes,
                              const shard::step_options& so) {
  int per_rank = 0;
  for (int n : sizes) per_rank += n;
  std::vector<trace> out(static_cast<std::size_t>(world));
  comm::launch(world, [&](comm::ThreadComm& c) {
    auto m = make_model<T>();
    tie(m);
    auto model = shard::fully_shard<sgd<T>, T>(m, c, strategy, each_layer_a_unit<T>());
    sgd<T> opt;
    auto& t = out[std::size_t(c.rank())];
    for (int s = 0; s < steps; ++s) {
      std::vector<Tensor<std::int64_t>> xs, ys;
      for (std::int64_t first = c.rank() * per_rank; int n : sizes) {
        xs.push_back(tokens(s, n, 1, first));
        ys.push_back(padded_targets(s, n, first, world * per_rank));
        first += n;
      }
      const auto r = sizes.size() == 1 ? model.train_step(opt, xs[0], ys[0], nn::cross_entropy, so)
                                       : model.train_step(opt, xs, ys, nn::cross_entropy, so);
      t.losses.push_back(r.loss);
    }
    for (auto& [name, value] : model.full_state_dict(false))
      t.params.insert(t.params.end(), value.span().begin(), value.span().end());
  });
  return out;
}

// fp32 sharded training against the float64 unsharded reference, 12 steps: they
// differ by fp32 rounding (~1e-7 a step, growing over the steps), seen relative
// to max(|value|, 1e-3) for parameters, which makes small ones the worst: 4.6e-6
// with GCC -march=native, 2.7e-5 with Clang's generic x86-64 GEMM. Losses within
// 2e-5 and parameters within 1e-4 leave room for that and fail on any missed or
// doubled gradient term (the head's and the embedding's parts of the tied
// gradient are each ~1e-1).
void check_equivalence(int w, shard::AnyStrategy strategy, shard::wrap_policy wrap = each_layer_a_unit<float>().wrap,
                       int edit_at = -1) {
  const int steps = 12, per_rank = 4;
  const auto want = unsharded(w, per_rank, steps, edit_at);
  const auto got = sharded(w, per_rank, steps, strategy, wrap, edit_at);
  test_support::max_error worst_loss, worst_param;
  for (int r = 0; r < w; ++r) {
    REQUIRE(got[std::size_t(r)].params.size() == want.params.size());
    CHECK(got[std::size_t(r)].edit_seen == (edit_at >= 0));
    worst_loss.relative(got[std::size_t(r)].losses, want.losses, 1e-6);
    worst_param.relative(got[std::size_t(r)].params, want.params, 1e-3);
  }
  INFO(strategy.name << " world " << w << ": worst relative loss difference " << worst_loss << ", parameters "
                      << worst_param);
  CHECK(worst_loss <= 2e-5);
  CHECK(worst_param <= 1e-4);
  CHECK(want.losses.back() < want.losses.front());  // it trained
}

}  // namespace

TEST_CASE("a tied model trains under every strategy as unsharded training does", "[tied][equivalence]") {
  for (int w : {2, 4}) {
    check_equivalence(w, shard::FullShard{});
    check_equivalence(w, shard::ShardGradOp{});
    check_equivalence(w, shard::ShardOptimizer{});
    check_equivalence(w, shard::NoShard{});
  }
  check_equivalence(2, shard::HybridShard{.group_size = 1});
  check_equivalence(4, shard::HybridShard{.group_size = 2});
}

// float64 masters and layers on the host: the sharded run is the unsharded one up
// to the order of the gradient averaging (~1e-16 a step), so 1e-12 leaves no room
// for a missed term; 16-bit gathers or reductions, which would round a float64
// master, are refused at wrap time.
TEST_CASE("a tied model trains with float64 masters under every strategy", "[tied][equivalence][f64]") {
  const int w = 2, steps = 6, per_rank = 4;
  const auto want = unsharded(w, per_rank, steps);
  auto check = [&](auto strategy) {
    const auto got = sharded<double>(w, per_rank, steps, strategy, each_layer_a_unit<double>().wrap);
    for (int r = 0; r < w; ++r) {
      test_support::max_error loss, param;
      loss.relative(got[std::size_t(r)].losses, want.losses, 1e-6);
      param.relative(got[std::size_t(r)].params, want.params, 1e-3);
      INFO(strategy.name << " rank " << r << ": loss " << loss << ", parameters " << param);
      CHECK(loss <= 1e-12);
      CHECK(param <= 1e-12);
    }
  };
  check(shard::FullShard{});
  check(shard::ShardGradOp{});
  check(shard::ShardOptimizer{});
  check(shard::NoShard{});
  check(shard::HybridShard{.group_size = 1});
  // train_step over three micro-batches of two rows: each loss gradient times 1/3 in float64
  // (1/3 rounded to float would put ~3e-8 into every gradient: 2.9e-6 in the parameters after
  // six steps), and clipped to norm 0.5 by a float64 coefficient (it was rounded to float too);
  // the loss and norm it reports are float64's too.
  const double max_norm = 0.5;
  const auto whole = unsharded(w, 6, steps), clipped = unsharded(w, 6, steps, -1, max_norm);
  for (const auto& strategy : {shard::AnyStrategy(shard::FullShard{}), shard::AnyStrategy(shard::NoShard{})})
    for (const bool clip : {false, true}) {
      const auto got = sharded<double>(w, 6, steps, strategy, each_layer_a_unit<double>().wrap, -1, 3,
                                       {.max_norm = clip ? float(max_norm) : 0.f});
      const auto& want = clip ? clipped : whole;
      for (int r = 0; r < w; ++r) {
        test_support::max_error loss, param;
        loss.relative(got[std::size_t(r)].losses, want.losses, 1e-6);
        param.relative(got[std::size_t(r)].params, want.params, 1e-3);
        INFO(strategy.name << " rank " << r << " over micro-batches, clipped " << clip << ": loss " << loss
                           << ", parameters " << param);
        CHECK(got[std::size_t(r)].clipped == clip);
        CHECK(loss <= 1e-12);
        CHECK(param <= 1e-12);
      }
    }
  std::string bf16_error;
  comm::launch(1, [&](comm::ThreadComm& c) {
    auto m = make_model<double>();
    tie(m);
    bf16_error = test_support::raised([&] {
      shard::fully_shard<sgd<double>, double>(m, c, shard::FullShard{}, {.precision = {.param = dtype::bf16}});
    });
  });
  CHECK_THAT(bf16_error, Contains("float64 masters gather and reduce in float64") && Contains("BF16"));
}

// Padding spreads a token loss's items unevenly over ranks and micro-batches (here also of 1,
// 2 and 3 rows, some without a token at odd steps): averaging each micro-batch's mean and
// each rank's weighs a token by where it sits. loss_mean::per_item weighs each loss by its
// tokens' share of the step's, which is the unsharded mean over the global batch's tokens:
// within 1e-12 in float64 (as above), whatever the strategy, split or reduction.
TEST_CASE("per-item loss means train as the unsharded mean over the global batch's tokens",
          "[tied][equivalence][f64][items]") {
  const int w = 2, steps = 6;
  const std::vector<int> sizes{1, 2, 3};
  const auto want = unsharded(w, 6, steps, -1, 0, true);
  auto error_of = [&](const std::vector<trace>& got, const char* what) {
    test_support::max_error loss, param;
    for (const auto& t : got) {
      loss.relative(t.losses, want.losses, 1e-6);
      param.relative(t.params, want.params, 1e-3);
    }
    INFO(what << ": loss " << loss << ", parameters " << param);
    CHECK(loss <= 1e-12);
    return param;
  };
  auto per_item = [](shard::step_options so) {
    so.mean = shard::loss_mean::per_item;
    return so;
  };
  for (const auto& strategy : {shard::AnyStrategy(shard::FullShard{}), shard::AnyStrategy(shard::ShardGradOp{}),
                               shard::AnyStrategy(shard::ShardOptimizer{}), shard::AnyStrategy(shard::NoShard{}),
                               shard::AnyStrategy(shard::HybridShard{.group_size = 1})})
    CHECK(error_of(padded_run<double>(w, steps, strategy, sizes, per_item({})), strategy.name.c_str()) <= 1e-12);
  CHECK(error_of(padded_run<double>(w, steps, shard::FullShard{}, sizes, per_item({.no_sync = true})), "no_sync") <=
        1e-12);
  CHECK(error_of(padded_run<double>(w, steps, shard::FullShard{}, sizes,
                                    per_item({.reduction = shard::grad_reduction::sum})),
                 "summed") <= 1e-12);
  CHECK(error_of(padded_run<double>(w, steps, shard::NoShard{}, {6}, per_item({})), "one batch") <= 1e-12);

  // The inputs hold the cases: a micro-batch without tokens, and a rank without any at a step.
  bool empty_micro_batch = false, empty_rank = false;
  for (int s = 0; s < steps; ++s)
    for (std::int64_t first = 6; int n : sizes) {
      const auto t = padded_targets(s, n, first, 12);
      empty_micro_batch = empty_micro_batch || std::all_of(t.data(), t.data() + n, [](auto y) { return y < 0; });
      first += n;
    }
  for (int s = 0; s < steps; ++s) {
    const auto t = padded_targets(s, 6, 6, 12);
    empty_rank = empty_rank || std::all_of(t.data(), t.data() + 6, [](auto y) { return y < 0; });
  }
  CHECK(empty_micro_batch);
  CHECK(empty_rank);

  // Each rank's own loss (loss_report::local) is its mean over its tokens (NaN without any):
  // weighed by their counts they make the global one.
  const auto local =
      padded_run<double>(w, steps, shard::FullShard{}, sizes, per_item({.loss = shard::loss_report::local}));
  test_support::max_error combined;
  for (int s = 0; s < steps; ++s) {
    double sum = 0, all = 0;
    for (int r = 0; r < w; ++r) {
      const auto t = padded_targets(s, 6, 6 * r, 12);
      const double count = double(std::count_if(t.data(), t.data() + 6, [](auto y) { return y >= 0; }));
      const double loss = local[std::size_t(r)].losses[std::size_t(s)];
      if (count == 0) CHECK(std::isnan(loss));
      else sum += loss * count;
      all += count;
    }
    combined.relative(std::vector<double>{sum / all}, std::vector<double>{want.losses[std::size_t(s)]}, 1e-6);
  }
  INFO("the ranks' own losses, weighed: " << combined);
  CHECK(combined <= 1e-12);

  // Without it micro-batches and ranks weigh alike: not the global mean.
  test_support::max_error alike;
  for (const auto& t : padded_run<double>(w, steps, shard::FullShard{}, {2, 2, 2}, {}))
    alike.relative(t.params, want.params, 1e-3);
  INFO("per micro-batch: parameters " << alike);
  CHECK(alike.value() > 1e-3);
}

TEST_CASE("per-item loss means: ranks that cannot count raise together", "[tied][items][errors]") {
  std::vector<std::string> errors(2);
  auto run = [&](auto&& step) {
    errors.assign(2, "");
    comm::launch(2, [&](comm::ThreadComm& c) {
      auto m = make_model<float>();
      tie(m);
      auto model = shard::fully_shard<sgd<float>, float>(m, c, shard::FullShard{}, each_layer_a_unit<float>());
      sgd<float> opt;
      errors[std::size_t(c.rank())] = test_support::raised([&] { step(model, opt, c.rank()); });
    });
  };
  const auto x = tokens(0, 4, 1), y = tokens(0, 4, 2);
  const shard::step_options per_item{.mean = shard::loss_mean::per_item};
  // A loss that sums on rank 1: no mean to weigh.
  run([&](auto& model, auto& opt, int rank) {
    const nn::cross_entropy_loss loss{{.reduction = rank == 1 ? nn::loss_reduction::sum : nn::loss_reduction::mean}};
    model.train_step(opt, x, y, loss, per_item);
  });
  CHECK_THAT(errors[1], Contains("rank 1: train_step with loss_mean::per_item, counting micro-batch 0's items") &&
                            Contains("needs reduction mean"));
  CHECK_THAT(errors[0], Contains("rank 0: train_step: 1 other rank(s) cannot run it"));
  // Every token ignored on every rank.
  run([&](auto& model, auto& opt, int) {
    Tensor<std::int64_t> none({4});
    std::fill(none.data(), none.data() + 4, -100);
    model.train_step(opt, x, none, nn::cross_entropy, per_item);
  });
  for (int r = 0; r < 2; ++r)
    CHECK_THAT(errors[std::size_t(r)], Contains(cat("rank ", r, ": train_step with loss_mean::per_item: no rank's "
                                                    "targets hold an item")));
  // A loss that cannot count.
  run([&](auto& model, auto& opt, int) {
    model.train_step(opt, x, y, [](const auto& out, const auto& t) { return nn::cross_entropy(out, t); }, per_item);
  });
  for (int r = 0; r < 2; ++r)
    CHECK_THAT(errors[std::size_t(r)], Contains(cat("rank ", r, ": train_step with loss_mean::per_item: the loss "
                                                    "function does not count")));
  // One batch, and rank 1 cannot run the step: its own error, and rank 0 is not left waiting.
  run([&](auto& model, auto& opt, int rank) {
    model.train_step(opt, x, y, nn::cross_entropy,
                     {.max_norm = rank == 1 ? -1.f : 0.f, .mean = shard::loss_mean::per_item});
  });
  CHECK_THAT(errors[1], Contains("rank 1: step_options.max_norm must be >= 0"));
  CHECK_THAT(errors[0], Contains("rank 0: train_step: 1 other rank(s) cannot run it"));
  // One batch, and the ranks weigh it differently: one counts while the other gathers, and
  // the communicator's comparison of the ranks' calls raises on both.
  run([&](auto& model, auto& opt, int rank) {
    model.train_step(opt, x, y, nn::cross_entropy,
                     {.mean = rank == 1 ? shard::loss_mean::per_item : shard::loss_mean::per_micro_batch});
  });
  for (int r = 0; r < 2; ++r)
    CHECK_THAT(errors[std::size_t(r)],
               Contains(cat("rank ", r, ": ranks disagree about a collective")) && Contains("all_reduce(2 x I64, sum)"));
  // Micro-batches, and the ranks weigh them differently.
  run([&](auto& model, auto& opt, int rank) {
    const std::vector<Tensor<std::int64_t>> xs{x, x}, ys{y, y};
    model.train_step(opt, xs, ys, nn::cross_entropy,
                     {.mean = rank == 1 ? shard::loss_mean::per_item : shard::loss_mean::per_micro_batch});
  });
  for (int r = 0; r < 2; ++r)
    CHECK_THAT(errors[std::size_t(r)], Contains("the ranks passed other loss_mean (from 0 to 1)"));
}

TEST_CASE("the tied weight is owned once, by the lowest unit around both users", "[tied][discover]") {
  auto m = make_model<double>();
  tie(m);
  const auto flat = shard::discover_units<double>(m, each_layer_a_unit<double>().wrap);
  std::vector<std::string> units;
  for (const auto& u : flat) units.push_back(u.name + ":" + std::to_string(u.params.size()));
  CHECK(units == std::vector<std::string>{":1", "0:0", "1.layers.0:2", "1.layers.1:2", "2:0"});
  REQUIRE(flat[0].layout.entries.size() == 1);
  CHECK(flat[0].layout.entries[0].name == "0.weight");
  REQUIRE(flat[0].aliases.size() == 1);
  CHECK(flat[0].aliases[0].name == "2.weight");
  CHECK(flat[0].params[0] == &m.get<0>().weight);

  // Nested one level down: the unit around both users owns it, not the root.
  using Outer = nn::Sequential<Model<double>, nn::Linear<double>>;
  Outer outer{make_model<double>(), nn::Linear<double>(vocab, 3)};
  outer.get<0>().get<2>().tie(outer.get<0>().get<0>().weight);
  const auto nested = shard::discover_units<double>(outer, shard::wrap_names{{"0", "0.0", "0.2"}});
  REQUIRE(nested.size() == 4);
  CHECK(nested[1].name == "0");
  REQUIRE(nested[1].layout.entries.size() == 5);  // the tied weight and both blocks
  CHECK(nested[1].layout.entries[0].name == "0.0.weight");
  REQUIRE(nested[1].aliases.size() == 1);
  CHECK(nested[1].aliases[0].name == "0.2.weight");
  CHECK(nested[0].layout.entries.size() == 2);  // the outer Linear
  CHECK(nested[2].params.empty());
  CHECK(nested[3].params.empty());

  // The planner counts it once: the units' sizes sum to the distinct parameters (aligned).
  const auto d = plan::describe_model<double>(m, each_layer_a_unit<double>().wrap);
  CHECK(d.units == std::vector<std::size_t>{std::size_t(vocab * dim), 0, 48 + 6, 48 + 6, 0});  // weight 36, aligned to 48, bias
}

TEST_CASE("the tied weight's gradient is the sum of both uses", "[tied][gradient]") {
  // The engine's gradient after one backward at W = 2: one SGD step with lr 1.
  const int w = 2, per_rank = 5;
  std::vector<double> before, after;
  comm::launch(w, [&](comm::ThreadComm& c) {
    auto m = make_model<float>();
    tie(m);
    auto model =
        shard::fully_shard<sgd<float>>(m, c, shard::AnyStrategy(shard::FullShard{}), each_layer_a_unit<float>());
    auto values = [&] {
      auto sd = model.full_state_dict();
      return sd.empty() ? std::vector<double>{} : std::vector<double>(sd[0].value.span().begin(), sd[0].value.span().end());
    };
    const auto v0 = values();
    sgd<float> opt{.lr = 1};
    model.zero_grad();
    const auto l = nn::cross_entropy(model.forward(tokens(0, per_rank, 1, c.rank() * per_rank)),
                                     tokens(0, per_rank, 2, c.rank() * per_rank));
    model.backward(l.grad);
    model.step(opt);
    const auto v1 = values();
    if (c.rank() == 0) before = v0, after = v1;
  });
  std::vector<double> engine(before.size());
  for (std::size_t i = 0; i < engine.size(); ++i) engine[i] = before[i] - after[i];

  // Central differences of the unsharded loss on the global batch, and each use's own part.
  auto m = make_model<double>();
  tie(m);
  nn::Replicated<double, Model<double>> owner(m, 42);
  nn::context ctx;
  const auto x = tokens(0, w * per_rank, 1), y = tokens(0, w * per_rank, 2);
  auto loss = [&] { return nn::cross_entropy(ctx.forward(m, x), y).loss; };
  const double h = 1e-5;
  std::vector<double> numeric(engine.size());
  for (std::size_t i = 0; i < numeric.size(); ++i) {
    const double v = owner.values()[i];
    owner.values()[i] = v + h;
    const double up = loss();
    owner.values()[i] = v - h;
    const double down = loss();
    owner.values()[i] = v;
    numeric[i] = (up - down) / (2 * h);
  }
  const auto l = nn::cross_entropy(ctx.forward(m, x), y);
  auto g = m.get<2>().backward(ctx, l.grad);  // the head's use alone
  const std::vector<double> head(owner.grads().begin(), owner.grads().begin() + vocab * dim);
  ctx.backward(m.get<0>(), ctx.backward(m.get<1>(), g));
  std::vector<double> embedding(head.size());
  for (std::size_t i = 0; i < head.size(); ++i) embedding[i] = owner.grads()[i] - head[i];

  // Central differences in double with h = 1e-5: truncation ~h^2 and rounding
  // ~1e-16 / h, both far below the engine's fp32 rounding of a step with lr 1
  // (~1e-7 of the weights, O(1)), hence 1e-6; each use alone misses by the other's part.
  test_support::max_error err, head_only, embedding_only;
  err.absolute(engine, numeric);
  head_only.absolute(head, numeric);
  embedding_only.absolute(embedding, numeric);
  INFO("engine vs finite differences " << err << "; head alone " << head_only << "; embedding alone "
                                       << embedding_only);
  CHECK(err <= 1e-6);
  CHECK(!(head_only <= 1e-3));
  CHECK(!(embedding_only <= 1e-3));
}

TEST_CASE("full_state_dict lists a tied parameter under each of its names", "[tied][state_dict]") {
  comm::launch(2, [](comm::ThreadComm& c) {
    auto m = make_model<float>();
    tie(m);
    auto model =
        shard::fully_shard<sgd<float>>(m, c, shard::AnyStrategy(shard::FullShard{}), each_layer_a_unit<float>());
    const auto sd = model.full_state_dict(false);
    std::vector<std::string> names;
    for (const auto& [name, value] : sd) names.push_back(name);
    const std::vector<std::string> want{"0.weight",          "1.layers.0.weight", "1.layers.0.bias",
                                        "1.layers.1.weight", "1.layers.1.bias",   "2.weight"};
    if (names != want) throw error(cat("rank ", c.rank(), ": state dict names ", names.size()));
    // One tensor under two names, as torch's state_dict() gives.
    if (sd.front().value.data() != sd.back().value.data()) throw error("the tied entries do not share storage");
  });
}

using test_support::raised;  // ranks collect messages, the main thread checks them

TEST_CASE("ties that cannot hold raise at fully_shard, naming the parameter", "[tied][errors]") {
  std::vector<std::vector<std::string>> what(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto& w = what[std::size_t(c.rank())];
    auto m = make_model<float>();
    tie(m);
    Model<float> copy = m;  // copies are untied: the copy's head would read m's weight
    w.push_back(raised([&] {
      shard::fully_shard<sgd<float>>(copy, c, shard::AnyStrategy(shard::FullShard{}), each_layer_a_unit<float>());
    }));
    nn::context ctx;
    w.push_back(raised([&] { copy.get<2>().forward(ctx, Tensor<float>({1, dim})); }));
    nn::Embedding<float> outside(vocab, dim);  // not part of the wrapped model
    m.get<2>().tie(outside.weight);
    w.push_back(raised([&] {
      shard::fully_shard<sgd<float>>(m, c, shard::AnyStrategy(shard::NoShard{}), each_layer_a_unit<float>());
    }));
    w.push_back(raised([&] { m.get<2>().tie(m.get<1>()[0].weight); }));
  });
  for (const auto& w : what) {
    REQUIRE(w.size() == 4);
    CHECK_THAT(w[0], Contains("parameter '2.weight' is not tied to anything"));
    CHECK_THAT(w[1], Contains("not tied to a weight"));
    CHECK_THAT(w[2], Contains("parameter '2.weight' is tied to a Param that no other layer of the model lists"));
    CHECK_THAT(w[3], Contains("tie needs a weight [13, 6], got [6, 6]"));
  }
}

namespace {
// fp32 masters (checkpoints and the planner's formulas are fp32).
void train(auto& model, optim::Adam& adam, int first, int steps, int world, int per_rank) {
  auto& c = model.comm();
  for (int s = first; s < first + steps; ++s) {
    model.zero_grad();
    const std::int64_t rows = std::int64_t(world) * per_rank, mine = rows / c.size();
    const auto x = tokens(s, mine, 1, c.rank() * mine), y = tokens(s, mine, 2, c.rank() * mine);
    const auto l = nn::cross_entropy(model.forward(x), y);
    model.backward(l.grad);
    model.step(adam);
  }
}
std::vector<std::pair<std::string, std::vector<float>>> state_of(auto& model) {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (auto& [name, value] : model.full_state_dict())
    out.emplace_back(name, std::vector<float>(value.span().begin(), value.span().end()));
  return out;
}
}  // namespace

TEST_CASE("a tied model's checkpoint round-trips through a resharding load", "[tied][checkpoint]") {
  const auto dir = std::filesystem::temp_directory_path() / cat("shardlib_test_tied_", ::getpid());
  std::filesystem::remove_all(dir);
  std::vector<std::pair<std::string, std::vector<float>>> saved, loaded, continued, reference;
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto m = make_model<float>();
    tie(m);
    auto model = shard::fully_shard(m, c, shard::FullShard{}, each_layer_a_unit<float>());
    optim::Adam adam;
    train(model, adam, 0, 3, 4, 2);
    io::save_checkpoint(dir, model, adam);
    auto s = state_of(model);
    train(model, adam, 3, 2, 4, 2);
    auto r = state_of(model);
    if (c.rank() == 0) saved = std::move(s), reference = std::move(r);
  });
  comm::launch(4, [&](comm::ThreadComm& c) {
    auto m = make_model<float>();
    tie(m);
    auto model = shard::fully_shard(m, c, shard::ShardOptimizer{}, each_layer_a_unit<float>(7));
    optim::Adam adam;
    io::load_checkpoint(dir, model, adam);
    auto s = state_of(model);
    train(model, adam, 3, 2, 4, 2);
    auto r = state_of(model);
    if (c.rank() == 0) loaded = std::move(s), continued = std::move(r);
  });
  std::filesystem::remove_all(dir);
  REQUIRE(saved.size() == 6);
  CHECK(saved.front().first == "0.weight");
  CHECK(saved.back().first == "2.weight");
  CHECK(saved.back().second == saved.front().second);
  CHECK(loaded == saved);  // bit for bit, under both names
  // Training continues as if uninterrupted: the world changed (2 -> 4 ranks, the
  // same global batch), so gradients are averaged in another order; fp32 rounding.
  test_support::max_error worst;
  REQUIRE(continued.size() == reference.size());
  for (std::size_t i = 0; i < continued.size(); ++i) worst.relative(continued[i].second, reference[i].second, 1e-3);
  INFO("continued after the resharding load vs uninterrupted: " << worst);
  CHECK(worst <= 1e-5);
}

namespace {
void check_memory(int w, shard::AnyStrategy strategy) {
  std::vector<std::string> report(static_cast<std::size_t>(w));
  std::vector<int> ok(static_cast<std::size_t>(w), 0);
  comm::launch(w, [&](comm::ThreadComm& c, ledger& l) {
    auto m = make_model<float>();
    tie(m);
    auto model = shard::fully_shard(m, c, strategy, each_layer_a_unit<float>());
    optim::Adam adam;
    train(model, adam, 0, 2, w, 3);
    const auto want = plan::make_plan(plan::describe(model), {.policy = strategy.policy(), .world = w,
                                                              .precision = plan::precision::fp32_layers({}),
                                                              .optimizer_bytes = plan::adam_state_bytes})
                          .memory;
    report[std::size_t(c.rank())] =
        cat("parameters ", l.peak(category::parameters), " vs ", want.parameters, "; gradients ",
            l.peak(category::gradients), " vs ", want.gradients, "; gathered ", l.peak(category::gathered_parameters),
            " vs ", want.gathered_parameters, "; optimizer ", l.peak(category::optimizer_state), " vs ",
            want.optimizer_state);
    ok[std::size_t(c.rank())] = l.peak(category::parameters) == want.parameters &&
                                l.peak(category::gradients) == want.gradients &&
                                l.peak(category::gathered_parameters) == want.gathered_parameters &&
                                l.peak(category::optimizer_state) == want.optimizer_state;
  });
  for (int r = 0; r < w; ++r) {
    INFO(strategy.name << " rank " << r << ": " << report[std::size_t(r)]);
    CHECK(ok[std::size_t(r)] == 1);
  }
}
}  // namespace

TEST_CASE("per-rank memory of a tied model equals the planner's", "[tied][memory]") {
  check_memory(2, shard::FullShard{});
  check_memory(2, shard::ShardGradOp{});
  check_memory(2, shard::ShardOptimizer{});
  check_memory(2, shard::NoShard{});
  check_memory(4, shard::HybridShard{.group_size = 2});
}

TEST_CASE("size-based wrapping: a layer is a unit when the parameters it would own reach the minimum",
          "[wrap][size]") {
  using Mlp = nn::Sequential<nn::Linear<float>, nn::Stack<nn::Linear<float>>, nn::Linear<float>>;
  auto units_of = [](shard::wrap_policy wrap) {
    Mlp m{nn::Linear<float>(5, 8), nn::Stack<nn::Linear<float>>(3, nn::Linear<float>(8, 8)), nn::Linear<float>(8, 3)};
    std::vector<std::string> names;
    for (const auto& u : shard::discover_units<float>(m, wrap)) names.push_back(u.name);
    return names;
  };
  using names = std::vector<std::string>;
  // Linear(5, 8) owns 40 + 8 = 48 elements (56 in the aligned layout: the count
  // has no gaps), each block 64 + 8 = 72, Linear(8, 3) 27.
  CHECK(units_of(shard::wrap_min_params{48}) == names{"", "0", "1.layers.0", "1.layers.1", "1.layers.2"});
  CHECK(units_of(shard::wrap_min_params{49}) == names{"", "1.layers.0", "1.layers.1", "1.layers.2"});
  // Nested units claim first: the stack owns 216 without its blocks, nothing with them.
  CHECK(units_of(shard::wrap_min_params{73}) == names{"", "1"});
  CHECK(units_of(shard::wrap_min_params{217}) == names{""});
  CHECK(units_of(shard::wrap_any{shard::wrap_names{{"2"}}, shard::wrap_min_params{200}}) == names{"", "1", "2"});
  CHECK(units_of(shard::wrap_any{shard::wrap_names{{"1"}}, shard::wrap_min_params{72}}) ==
        names{"", "1", "1.layers.0", "1.layers.1", "1.layers.2"});

  // A tied weight counts only for a layer holding both its users: neither the
  // embedding nor the head owns anything here, the inner model owns it below.
  auto m = make_model<float>();
  tie(m);
  std::vector<std::string> tied;
  for (const auto& u : shard::discover_units<float>(m, shard::wrap_min_params{1})) tied.push_back(u.name);
  CHECK(tied == names{"", "1.layers.0", "1.layers.1"});
  using Outer = nn::Sequential<Model<float>, nn::Linear<float>>;
  Outer outer{make_model<float>(), nn::Linear<float>(vocab, 3)};
  outer.get<0>().get<2>().tie(outer.get<0>().get<0>().weight);
  std::vector<std::string> nested;  // blocks 42 each, the stack 84, the inner model 78, the outer Linear 42
  for (const auto& u : shard::discover_units<float>(outer, shard::wrap_min_params{70})) nested.push_back(u.name);
  CHECK(nested == names{"", "0", "0.1"});

  // Training under a size-based policy: the blocks are units, the root owns the tied weight.
  check_equivalence(2, shard::FullShard{}, shard::wrap_min_params{40});
  check_equivalence(2, shard::ShardGradOp{}, shard::wrap_any{shard::wrap_types<nn::Embedding<float>>{},
                                                            shard::wrap_min_params{40}});
}

TEST_CASE("eval mode frees every unit after its forward, keeps no activations and refuses backward",
          "[eval]") {
  const int w = 2, per_rank = 4;
  // The unsharded logits of step 0's global batch, in double.
  auto ref = make_model<double>();
  tie(ref);
  nn::Replicated<double, Model<double>> owner(ref, 42);
  nn::context plain;
  const auto want = ref.get<2>().forward(
      plain, plain.forward(ref.get<1>(), plain.forward(ref.get<0>(), tokens(0, w * per_rank, 1))));
  auto run = [&](shard::AnyStrategy strategy) {  // one engine type for the four
    std::vector<std::string> failures(w);
    comm::launch(w, [&](comm::ThreadComm& c, ledger& l) {
      auto m = make_model<float>();
      tie(m);
      auto model = shard::fully_shard<sgd<float>>(m, c, strategy, each_layer_a_unit<float>());
      auto& why = failures[std::size_t(c.rank())];
      const auto x = tokens(0, per_rank, 1, c.rank() * per_rank), y = tokens(0, per_rank, 2, c.rank() * per_rank);
      model.forward(x);  // a training forward without its backward (ShardGradOp keeps its units gathered)
      model.eval();
      const auto logits = model.forward(x);
      if (model.context().training() || model.training()) why += "eval left the training flag on; ";
      for (const auto& u : model.units())
        if (strategy.policy().shard_parameters && u.where != std::decay_t<decltype(model)>::state::sharded) why += cat("unit '", u.name, "' gathered; ");
      if (l.current(category::gathered_parameters) != 0) why += "gathered bytes remain; ";
      test_support::max_error err;
      err.relative(logits.span(), std::span(want.data() + c.rank() * per_rank * vocab, std::size_t(per_rank * vocab)),
                   1e-3);
      if (!(err <= 1e-5)) why += cat("eval logits differ from the unsharded ones by ", err, "; ");
      try {
        model.backward(nn::cross_entropy(logits, y).grad);
        why += "backward in eval did not raise; ";
      } catch (const error& e) {
        if (std::string(e.what()).find("backward in eval mode: its forwards keep no activations") == std::string::npos)
          why += cat("unexpected message: ", e.what(), "; ");
      }
      try {
        m.get<2>().backward(model.context(), logits);
        why += "the head kept its input in eval; ";
      } catch (const shape_error&) {
      }
      const auto piece = model.master_piece(0);
      model.load_master(0, std::vector<float>(piece.begin(), piece.end()));  // refused while units are gathered
      model.train();
      sgd<float> opt;
      model.zero_grad();
      model.backward(nn::cross_entropy(model.forward(x), y).grad);
      model.step(opt);
      if (!model.training()) why += "train() did not restore training; ";
    });
    for (int r = 0; r < w; ++r) {
      INFO(strategy.name << " rank " << r << ": " << failures[std::size_t(r)]);
      CHECK(failures[std::size_t(r)].empty());
    }
  };
  run(shard::FullShard{});
  run(shard::ShardGradOp{});
  run(shard::ShardOptimizer{});
  run(shard::NoShard{});
}

TEST_CASE("summon_full_params: edits reach every strategy's shards and training continues as unsharded",
          "[summon]") {
  for (int w : {2, 4}) {
    check_equivalence(w, shard::FullShard{}, each_layer_a_unit<float>().wrap, 5);
    check_equivalence(w, shard::ShardGradOp{}, each_layer_a_unit<float>().wrap, 5);
    check_equivalence(w, shard::ShardOptimizer{}, each_layer_a_unit<float>().wrap, 5);
    check_equivalence(w, shard::NoShard{}, each_layer_a_unit<float>().wrap, 5);
  }
  check_equivalence(4, shard::HybridShard{.group_size = 2}, each_layer_a_unit<float>().wrap, 5);
}

TEST_CASE("summon_full_params without writeback, on rank 0 only, and over 16-bit gathers", "[summon]") {
  auto same_bits = [](const auto& a, const auto& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (a[i].name != b[i].name || !std::equal(a[i].value.span().begin(), a[i].value.span().end(),
                                                b[i].value.span().begin(), b[i].value.span().end(),
                                                [](float x, float y) { return std::bit_cast<std::uint32_t>(x) ==
                                                                              std::bit_cast<std::uint32_t>(y); }))
        return false;
    return true;
  };
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto m = make_model<float>();
    tie(m);
    auto model =
        shard::fully_shard<sgd<float>>(m, c, shard::AnyStrategy(shard::FullShard{}), each_layer_a_unit<float>());
    const auto before = model.full_state_dict(false);
    bool bound = false;
    model.summon_full_params([&] { edit(m); }, {.writeback = false});
    if (!same_bits(model.full_state_dict(false), before)) throw error("writeback = false changed the masters");
    model.summon_full_params([&] { bound = m.get<0>().weight.value != nullptr; }, {.writeback = false, .rank0_only = true});
    if (bound != (c.rank() == 0)) throw error(cat("rank ", c.rank(), ": rank0_only bound the Params: ", bound));
    const std::string refused = raised([&] { model.summon_full_params([] {}, {.rank0_only = true}); });
    if (refused.find("summon_full_params: rank0_only needs writeback = false") == std::string::npos)
      throw error(cat("rank ", c.rank(), ": rank0_only with writeback gave '", refused, "'"));

    // bf16 gathers of fp32 layers: the scope shows the rounded values; writeback
    // changes the elements written and leaves every other fp32 bit as it was.
    auto m16 = make_model<float>();
    tie(m16);
    auto opts = each_layer_a_unit<float>();
    opts.precision = {.param = dtype::bf16};
    auto half = shard::fully_shard<sgd<float>>(m16, c, shard::FullShard{}, opts);
    auto want = half.full_state_dict(false);
    half.summon_full_params([&] { edit(m16); });
    std::fill_n(want[0].value.data(), dim, 0.25f);
    want[4].value[2] = -0.5f;  // "1.layers.1.bias"; want[5] ("2.weight") shares want[0]'s tensor
    if (!same_bits(half.full_state_dict(false), want)) throw error("bf16 writeback touched elements not written");
  });
}

}  // namespace test_tied
