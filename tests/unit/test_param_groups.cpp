// Parameter groups (per-group hyperparameters over sharded optimizer state) and
// train_step's options, each against an unsharded reference.
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/pooling.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/nn/transformer.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/param_groups.hpp"
#include "shardlib/optim/schedule.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/compare.hpp"
#include "support/shard_fixture.hpp"

#include <catch2/catch.hpp>

#include <unistd.h>  // getpid

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace test_param_groups {

using namespace shardlib;
using fixture::Block;
using fixture::Model;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

using Groups = optim::param_groups<optim::AdamW>;
constexpr int rows = 6;  // the global batch: divides by W = 1, 2, 3

// The groups every test trains with: the usual split, where no_decay also has its own
// betas and eps, its own schedule and an lr_scale; decay follows the shared schedule.
const optim::warmup_cosine shared_schedule{.peak_lr = 0.01, .min_lr = 0.001, .warmup_steps = 2, .total_steps = 8,
                                           .start_factor = 0.5};
double own_schedule(std::int64_t t) { return 0.004 * double(1 + t); }
Groups make_groups() {
  auto g = Groups::no_decay_split({.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1});
  auto& nd = g["no_decay"];
  nd.options.beta1 = 0.8;
  nd.options.beta2 = 0.95;
  nd.options.eps = 1e-6;
  nd.lr_scale = 2;
  nd.schedule = own_schedule;
  return g;
}

// --- the float64 reference: the same model and data in double, AdamW per parameter ----------

struct adamw_hyper {
  double beta1, beta2, eps, weight_decay;
};

// Unsharded training on the global batch in double, from the float initial values;
// 1-D parameters step with no_decay's hyperparameters, the others with decay's.
// Returns the final parameters in the model's order.
std::vector<double> reference(int steps) {
  fixture::double_model d(42);
  auto& owner = d.owner;
  auto values = owner.values();
  std::vector<double> exp_avg(values.size(), 0.0), exp_avg_sq(values.size(), 0.0);
  const adamw_hyper decay{0.9, 0.99, 1e-8, 0.1}, none{0.8, 0.95, 1e-6, 0.0};
  for (int s = 0; s < steps; ++s) {
    d.mse_gradients(s, rows);
    const double t = s + 1;
    for (const auto& e : owner.layout().entries) {
      const bool is_none = e.shape.rank() < 2;
      const adamw_hyper& h = is_none ? none : decay;
      const double lr = is_none ? own_schedule(s) * 2 : double(shared_schedule(s));
      for (std::size_t i = e.offset; i < e.offset + e.numel(); ++i) {
        const double g = owner.grads()[i];
        values[i] *= 1 - lr * h.weight_decay;
        exp_avg[i] = h.beta1 * exp_avg[i] + (1 - h.beta1) * g;
        exp_avg_sq[i] = h.beta2 * exp_avg_sq[i] + (1 - h.beta2) * g * g;
        const double m_hat = exp_avg[i] / (1 - std::pow(h.beta1, t));
        const double v_hat = exp_avg_sq[i] / (1 - std::pow(h.beta2, t));
        values[i] -= lr * m_hat / (std::sqrt(v_hat) + h.eps);
      }
    }
  }
  std::vector<double> out;
  for (const auto& e : owner.layout().entries)
    for (std::size_t i = 0; i < e.numel(); ++i) out.push_back(values[e.offset + i]);
  return out;
}

// This rank's rows of step s's global batch.
std::pair<Tensor<float>, Tensor<float>> rank_batch(int s, const comm::ThreadComm& c) {
  const int per_rank = rows / c.size();
  const int first = c.rank() * per_rank;
  return {fixture::batch(s, per_rank, 5, 1, first), fixture::batch(s, per_rank, 3, 2, first)};
}

// Steps [first, first + steps) with the groups' learning rates set from the schedules.
template <class Sharded>
void train_groups(Sharded& model, Groups& opt, int first, int steps) {
  for (int s = first; s < first + steps; ++s) {
    opt.set_lr(shared_schedule, s);
    auto [x, y] = rank_batch(s, model.comm());
    model.train_step(opt, x, y, fixture::mse);
  }
}

template <class Sharded>
std::vector<float> full_params(Sharded& model) {
  std::vector<float> out;
  for (auto& [name, t] : model.full_state_dict(false)) out.insert(out.end(), t.span().begin(), t.span().end());
  return out;
}

shard::options wrapped(shard::options o = {}) {
  o.wrap = shard::wrap_types<Block>{};
  o.seed = 42;
  return o;
}

std::vector<float> sharded_groups(int world, int steps, shard::AnyStrategy strategy) {
  std::vector<std::vector<float>> params(static_cast<std::size_t>(world));
  comm::launch(world, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    Groups opt = make_groups();
    auto model = shard::fully_shard(m, c, strategy, opt, wrapped());
    train_groups(model, opt, 0, steps);
    params[std::size_t(c.rank())] = full_params(model);
  });
  for (int r = 1; r < world; ++r) REQUIRE(params[std::size_t(r)] == params[0]);  // replicas agree
  return params[0];
}

}  // namespace

// Tolerance 5e-5 relative to max(|want|, 0.1), the parameters' scale (initial values
// ~U(+-1/sqrt(fan_in)) = +-0.35..0.45): the sharded run is float, the reference double.
// AdamW divides m by sqrt(v), so where a gradient is small and changes sign the float
// rounding of the averaged gradient grows: 1.6e-5 measured at W = 3 (one bias, the same
// for every strategy, NoShard included, which cuts nothing), at most 1.1e-5 at W = 1, 2.
// A group's hyperparameters on another group's element move it by ~lr = 1e-2.
TEST_CASE("two parameter groups train as a float64 reference with per-parameter hyperparameters",
          "[param_groups][equivalence]") {
  const int steps = 8;
  const auto want = reference(steps);
  auto check = [&](auto strategy, int w) {
    INFO(strategy.name << " at W = " << w);
    const auto got = sharded_groups(w, steps, strategy);
    test_support::max_error worst;
    worst.relative(got, want, 0.1);
    CHECK(worst <= 5e-5);
  };
  for (int w : {1, 2, 3}) {  // the fixture's units (56, 72, 72, 72, 35) split by 2 or 3 cut through parameters
    check(shard::FullShard{}, w);
    check(shard::ShardGradOp{}, w);
    check(shard::ShardOptimizer{}, w);
    check(shard::NoShard{}, w);
  }
}

TEST_CASE("a shard cutting through parameters of different groups steps as segments",
          "[param_groups][segments]") {
  Model m = fixture::make_model();
  nn::Replicated<float, Model> owner(m, 42);
  const auto& layout = owner.layout();  // unit-like: 0.weight [8, 5] at 0, 0.bias [8] at 48, ...
  const Groups g = make_groups();
  // Elements [38, 53): the end of 0.weight (decay), the gap, the start of 0.bias (no_decay).
  const auto runs = g.segments(layout, 38, 15);
  REQUIRE(runs.size() == 2);
  CHECK((runs[0].begin == 0 && runs[0].size == 10 && runs[0].group == 0));  // 0.weight's tail and the gap after it
  CHECK((runs[1].begin == 10 && runs[1].size == 5 && runs[1].group == 1));
  // A run that starts in a gap takes the next parameter's group; a range of padding, group 0.
  const auto in_gap = g.segments(layout, 42, 10);
  REQUIRE(in_gap.size() == 1);
  CHECK((in_gap[0].begin == 0 && in_gap[0].size == 10 && in_gap[0].group == 1));
  CHECK(g.segments(layout, layout.numel + 5, 3).size() == 1);
  // A parameter no group takes is named.
  const Groups only_matrices(
      {{.name = "decay", .rule = [](std::string_view, const Shape& s) { return s.rank() == 2; }}});
  CHECK_THROWS_WITH(only_matrices.segments(layout, 0, layout.numel),
                    Contains("parameter '0.bias' [8] is in no group (decay)"));
  CHECK_THROWS_WITH(Groups({{.name = "a", .rule = optim::no_decay}, {.name = "a", .rule = optim::no_decay}}),
                    Contains("two groups are named 'a'"));
}

// Bit for bit: a segment is the same per-element update with the same scalars.
TEST_CASE("groups step each segment as that group's own optimizer steps it alone (SGD and Adam)",
          "[param_groups][segments]") {
  auto check = [](auto groups, auto first, auto second) {
    using O = decltype(first);
    const std::size_t n = 37, cut = 13;  // [0, 13) in group 0, [13, 37) in group 1
    std::vector<float> p(n), alone(n);
    for (std::size_t i = 0; i < n; ++i) p[i] = alone[i] = std::sin(float(i));
    auto st = groups.make_state(n);
    auto st0 = first.make_state(cut), st1 = second.make_state(n - cut);
    const std::vector<optim::segment> runs{{0, cut, 0}, {cut, n - cut, 1}};
    for (int t = 0; t < 3; ++t) {
      std::vector<float> g(n);
      for (std::size_t i = 0; i < n; ++i) g[i] = std::cos(float(i * 7 + std::size_t(t)));
      groups.step(std::span<float>(p), std::span<const float>(g), st, runs);
      first.step(std::span<float>(alone).first(cut), std::span<const float>(g).first(cut), st0);
      second.step(std::span<float>(alone).subspan(cut), std::span<const float>(g).subspan(cut), st1);
    }
    CHECK(p == alone);
    CHECK(st.step == 3);
    static_assert(std::is_same_v<typename decltype(groups)::optimizer, O>);
  };
  using SGDGroups = optim::param_groups<optim::SGD>;
  const optim::SGD::options_type heavy{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true};
  const optim::SGD::options_type plain{.lr = 0.03};
  check(SGDGroups({{.name = "heavy", .rule = optim::no_decay, .options = heavy},
                   {.name = "plain", .rule = optim::no_decay, .options = plain}}),
        optim::SGD{heavy}, optim::SGD{plain});
  const optim::Adam::options_type ams{.lr = 0.01, .beta2 = 0.9, .weight_decay = 0.1, .amsgrad = true};
  const optim::Adam::options_type usual{.lr = 0.002, .beta1 = 0.5, .eps = 1e-4};
  check(optim::param_groups<optim::Adam>({{.name = "usual", .rule = optim::no_decay, .options = usual},
                                          {.name = "ams", .rule = optim::no_decay, .options = ams}}),
        optim::Adam{usual}, optim::Adam{ams});
}

// Options are checked for every group before any segment steps: a later group's bad
// option must not leave the earlier segments stepped with the step uncounted (a retry
// would step them twice as the same step).
TEST_CASE("a group's invalid options leave every segment, moment and the step count unchanged",
          "[param_groups][segments]") {
  const std::size_t n = 20, cut = 8;
  Groups g = make_groups();
  g["no_decay"].options.beta2 = 1.5;
  std::vector<float> p(n, 1.f), grads(n, 0.5f);
  auto st = g.make_state(n);
  const std::vector<optim::segment> runs{{0, cut, 0}, {cut, n - cut, 1}};  // decay first, then no_decay
  CHECK_THROWS_WITH(g.step(std::span<float>(p), std::span<const float>(grads), st, runs),
                    "param_groups: group 'no_decay': AdamW: invalid beta2 1.5 (needs 0 <= beta2 < 1)");
  CHECK(p == std::vector<float>(n, 1.f));
  for (std::size_t i = 0; i < n; ++i) CHECK((st.exp_avg[i] == 0 && st.exp_avg_sq[i] == 0));
  CHECK(st.step == 0);
}

// In the engine the groups are assigned over every parameter and checked before any
// unit steps, on every rank alike: a rank whose piece holds none of the offending
// parameters raises too (it would otherwise go on and wait for the others), and the
// model is unchanged. After the groups are fixed, the next step trains.
TEST_CASE("bad groups raise on every rank before any unit steps, and a fixed group trains on",
          "[param_groups][engine]") {
  for (const bool no_group : {true, false}) {
    INFO((no_group ? "a parameter in no group" : "a group's invalid beta2"));
    std::vector<std::string> errors(2);
    std::vector<int> trained(2, 0), unchanged(2, 0);
    comm::launch(2, [&](comm::ThreadComm& c) {
      Model m = fixture::make_model();
      // decay holds the matrices; in the first case no group takes the biases
      Groups g({{.name = "decay", .rule = [](std::string_view, const Shape& s) { return s.rank() == 2; },
                 .options = {.lr = 0.01}}});
      if (!no_group) g.groups().push_back({.name = "no_decay", .rule = optim::no_decay, .options = {.beta2 = 1.5}});
      auto model = shard::fully_shard(m, c, shard::FullShard{}, g, {.wrap = shard::wrap_types<Block>{}, .seed = 42});
      const auto x = fixture::batch(0, 2, 5, 1, 2 * c.rank()), y = fixture::batch(0, 2, 3, 2, 2 * c.rank());
      const auto before = model.full_state_dict();
      try {
        model.train_step(g, x, y, fixture::mse);
      } catch (const error& e) {
        errors[std::size_t(c.rank())] = e.what();
      }
      const auto after = model.full_state_dict();
      bool same = before.size() == after.size();
      for (std::size_t i = 0; same && i < before.size(); ++i)
        same = std::ranges::equal(before[i].value.span(), after[i].value.span());
      unchanged[std::size_t(c.rank())] = same;
      if (no_group) g.groups().push_back({.name = "no_decay", .rule = optim::no_decay, .options = {.lr = 0.01}});
      else g["no_decay"].options.beta2 = 0.999;
      model.train_step(g, x, y, fixture::mse);
      trained[std::size_t(c.rank())] = int(model.steps());
    });
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << ": " << errors[std::size_t(r)]);
      if (no_group)
        CHECK_THAT(errors[std::size_t(r)], Catch::StartsWith(cat("rank ", r, ": param_groups: parameter '")) &&
                                               Contains("' [8] is in no group (decay)"));
      else
        CHECK_THAT(errors[std::size_t(r)],
                   Catch::StartsWith(cat("rank ", r, ", unit '")) &&
                       Catch::EndsWith("': param_groups: group 'no_decay': AdamW: invalid beta2 1.5 (needs 0 <= beta2 "
                                       "< 1)"));
    }
    CHECK(unchanged == std::vector<int>{1, 1});
    CHECK(trained == std::vector<int>{1, 1});
  }
}

TEST_CASE("the no-decay split on the encoder classifier: matrices decay, biases and norm weights do not",
          "[param_groups][no_decay]") {
  using Encoder = nn::TransformerEncoderLayer<float>;
  using Classifier = nn::Sequential<nn::Stack<Encoder>, nn::MeanPool<float>, nn::Linear<float>>;
  Classifier model{nn::Stack<Encoder>(1, {.d_model = 8, .nhead = 2, .dim_feedforward = 16, .batch_first = true}),
                   nn::MeanPool<float>(1), nn::Linear<float>(8, 3)};
  const auto g = Groups::no_decay_split({.lr = 1e-3, .weight_decay = 0.1});
  std::map<std::string, std::vector<std::string>> split;
  model.parameters([&](std::string_view name, auto& p) {
    split[g.groups()[std::size_t(g.group_of(name, p.shape))].name].emplace_back(name);
  });
  CHECK(split["decay"] == std::vector<std::string>{"0.layers.0.self_attn.in_proj_weight",
                                                   "0.layers.0.self_attn.out_proj.weight",
                                                   "0.layers.0.linear1.weight", "0.layers.0.linear2.weight",
                                                   "2.weight"});
  CHECK(split["no_decay"] == std::vector<std::string>{"0.layers.0.self_attn.in_proj_bias",
                                                      "0.layers.0.self_attn.out_proj.bias",
                                                      "0.layers.0.linear1.bias",
                                                      "0.layers.0.linear2.bias",
                                                      "0.layers.0.norm1.weight",
                                                      "0.layers.0.norm1.bias",
                                                      "0.layers.0.norm2.weight",
                                                      "0.layers.0.norm2.bias",
                                                      "2.bias"});
  CHECK(g.groups()[0].options.weight_decay == 0.1);
  CHECK(g.groups()[1].options.weight_decay == 0.0);
}

TEST_CASE("set_lr: each group's own schedule or the shared one, times its lr_scale", "[param_groups][schedule]") {
  Groups g = make_groups();
  g["decay"].lr_scale = 0.5;
  for (std::int64_t t : {0, 1, 2, 5, 9}) {
    g.set_lr(shared_schedule, t);
    CHECK(g["decay"].options.lr == double(shared_schedule(t)) * 0.5);
    CHECK(g["no_decay"].options.lr == own_schedule(t) * 2);
  }
  // The first test trains with these schedules: a wrong lr there fails it too.
}

namespace {
struct temp_dir {
  fs::path path;
  explicit temp_dir(std::string_view name)
      : path(fs::temp_directory_path() / cat("shardlib_test_param_groups_", name, "_", ::getpid())) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
};
}  // namespace

// Tolerance 1e-5: the resumed run reduces over another world (3 ranks, not 2), which
// changes only the order of float sums.
TEST_CASE("checkpoints keep the groups: a resharding load resumes, a different group is refused by name",
          "[param_groups][checkpoint]") {
  temp_dir dir("groups");
  std::vector<float> uninterrupted;
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    Groups opt = make_groups();
    auto model = shard::fully_shard(m, c, shard::FullShard{}, opt, wrapped());
    train_groups(model, opt, 0, 3);
    io::save_checkpoint(dir.path, model, opt, {.tag = "three"});
    train_groups(model, opt, 3, 3);
    auto p = full_params(model);
    if (c.rank() == 0) uninterrupted = p;
  });

  std::vector<float> resumed;
  std::vector<std::string> errors(3);
  double restored_lr = 0, other_weight_decay = 0;  // rank 0's, checked after launch
  nlohmann::json loaded_groups;
  comm::launch(3, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    Groups opt = make_groups();
    auto model = shard::fully_shard(m, c, shard::ShardOptimizer{}, opt, wrapped());
    opt["decay"].options.lr = 123;  // restored from the checkpoint
    const auto loaded = io::load_checkpoint(dir.path / "three", model, opt);
    if (c.rank() == 0) {
      restored_lr = opt["decay"].options.lr;
      loaded_groups = loaded.metadata.optimizer->hyperparameters.at("param_groups");
    }
    train_groups(model, opt, 3, 3);
    auto p = full_params(model);
    if (c.rank() == 0) resumed = p;

    // The same checkpoint into groups that differ: every rank raises, naming the group and field.
    Model m2 = fixture::make_model();
    Groups other = make_groups();
    other["no_decay"].options.weight_decay = 0.05;
    auto model2 = shard::fully_shard(m2, c, shard::NoShard{}, other, wrapped());
    try {
      io::load_checkpoint(dir.path / "three", model2, other);
    } catch (const error& e) {
      errors[std::size_t(c.rank())] = e.what();
    }
    if (c.rank() == 0) other_weight_decay = other["no_decay"].options.weight_decay;
  });
  CHECK(restored_lr == double(shared_schedule(2)));
  CHECK(loaded_groups.at(0).at("params") ==
        nlohmann::json({"0.weight", "1.layers.0.weight", "1.layers.1.weight", "1.layers.2.weight", "2.weight"}));
  CHECK(loaded_groups.at(1).at("params") ==
        nlohmann::json({"0.bias", "1.layers.0.bias", "1.layers.1.bias", "1.layers.2.bias", "2.bias"}));
  CHECK(loaded_groups.at(1).at("beta1") == 0.8);
  CHECK(other_weight_decay == 0.05);  // the refused load changed nothing
  test_support::max_error worst;
  worst.relative(resumed, uninterrupted, 1e-3);
  CHECK(worst <= 1e-5);
  for (const auto& e : errors)
    CHECK_THAT(e, Contains("parameter group 'no_decay': weight_decay is 0.0 there, 0.05 here"));

  // Other members: a group taking other parameters is refused, naming one of them.
  std::vector<std::string> member_errors(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    Groups moved = make_groups();
    moved["no_decay"].rule = optim::match_names({"*.bias", "2.weight"});
    moved["decay"].rule = [](std::string_view n, const Shape&) { return n != "2.weight" && !n.ends_with(".bias"); };
    auto model = shard::fully_shard(m, c, shard::FullShard{}, moved, wrapped());
    try {
      io::load_checkpoint(dir.path / "three", model, moved);
    } catch (const error& e) {
      member_errors[std::size_t(c.rank())] = e.what();
    }
  });
  for (const auto& e : member_errors)
    CHECK_THAT(e, Contains("parameter group 'decay': params: '2.weight' is in it there, not here"));
}

// --- train_step's options ---------------------------------------------------------------------
namespace {

struct run {
  std::vector<float> params;                          // rank 0's full parameters at the end
  std::vector<std::vector<shard::step_result>> steps;  // [rank][step]
};

// Plain SGD (lr) over `steps` steps of the global batch of 2 rows per rank.
run train_sgd(int world, int steps, shard::AnyStrategy strategy, float lr, const shard::step_options& so,
              shard::options o = {}) {
  run out;
  out.steps.resize(std::size_t(world));
  comm::launch(world, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    auto model = shard::fully_shard<fixture::sgd>(m, c, strategy, wrapped(o));
    fixture::sgd opt{lr};
    for (int s = 0; s < steps; ++s) {
      auto x = fixture::batch(s, 2, 5, 1, c.rank() * 2), y = fixture::batch(s, 2, 3, 2, c.rank() * 2);
      out.steps[std::size_t(c.rank())].push_back(model.train_step(opt, x, y, fixture::mse, so));
    }
    auto p = full_params(model);
    if (c.rank() == 0) out.params = p;
  });
  return out;
}

}  // namespace

// Tolerance 1e-5 relative: summing then stepping with lr equals averaging then stepping
// with W * lr up to the rounding of the division by W.
TEST_CASE("train_step: a summed reduction steps W times the averaged gradients", "[train_step][reduction]") {
  const int steps = 5;
  auto check = [&](auto strategy, int w) {
    INFO(strategy.name << " at W = " << w);
    const auto sum = train_sgd(w, steps, strategy, 0.01f, {.reduction = shard::grad_reduction::sum});
    const auto avg = train_sgd(w, steps, strategy, 0.01f * float(w), {});
    test_support::max_error worst;
    worst.relative(sum.params, avg.params, 1e-3);
    CHECK(worst <= 1e-5);
  };
  check(shard::FullShard{}, 3);
  check(shard::ShardOptimizer{}, 3);
  check(shard::NoShard{}, 3);
  check(shard::HybridShard{.group_size = 2}, 4);
  // The average is the unsharded gradient of the global batch (fixture::sgd's lr 0.05).
  const auto avg = train_sgd(3, steps, shard::FullShard{}, 0.05f, {});
  test_support::max_error worst;
  worst.relative(avg.params, fixture::unsharded(3, 2, steps).params, 1e-3);
  CHECK(worst <= 1e-5);
}

TEST_CASE("train_step: the global mean loss is the mean of the ranks' own losses", "[train_step][loss]") {
  const auto global = train_sgd(3, 4, shard::FullShard{}, 0.05f, {});
  const auto local = train_sgd(3, 4, shard::FullShard{}, 0.05f, {.loss = shard::loss_report::local});
  for (std::size_t s = 0; s < 4; ++s) {
    float mean = 0;
    for (int r = 0; r < 3; ++r) mean += local.steps[std::size_t(r)][s].loss;
    mean /= 3;
    CHECK(test_support::relative_error(global.steps[0][s].loss, mean, 1e-6) <= 1e-6);
    for (int r = 1; r < 3; ++r) CHECK(global.steps[std::size_t(r)][s].loss == global.steps[0][s].loss);
    CHECK(local.steps[0][s].loss != local.steps[1][s].loss);  // the ranks' batches differ
    CHECK(!global.steps[0][s].grad_norm);                     // not clipping: no norm
  }
  CHECK(global.params == local.params);  // what is reported does not change the step
}

// Tolerance 1e-3 relative: fp16 reduction rounds every gradient to 11 bits (relative
// 2^-11 ~ 5e-4); clipping the still-scaled gradients instead would report norms 1024
// times too large and clip 1024 times too hard.
TEST_CASE("train_step: clipping under fp16 loss scaling equals clipping without it", "[train_step][clip]") {
  const int steps = 6, w = 3;
  const float max_norm = 0.05f;  // below every step's norm: clipping acts each time
  const auto want = fixture::unsharded(w, 2, steps, max_norm);
  const auto fp32 = train_sgd(w, steps, shard::FullShard{}, 0.05f, {.max_norm = max_norm});
  const auto fp16 = train_sgd(w, steps, shard::FullShard{}, 0.05f, {.max_norm = max_norm},
                              {.precision = {.reduce = dtype::f16}, .scaler = {.scale = 1024}});
  test_support::max_error exact, scaled;
  exact.relative(fp32.params, want.params, 1e-3);
  scaled.relative(fp16.params, fp32.params, 1e-3);
  for (std::size_t s = 0; s < std::size_t(steps); ++s) {
    REQUIRE(fp32.steps[0][s].grad_norm);
    REQUIRE(fp16.steps[0][s].grad_norm);
    CHECK(!fp16.steps[0][s].skipped);
    CHECK(want.norms[s] > max_norm);
    exact.relative(*fp32.steps[0][s].grad_norm, want.norms[s], 1e-6);
    scaled.relative(*fp16.steps[0][s].grad_norm, want.norms[s], 1e-6);
  }
  CHECK(exact <= 1e-5);
  CHECK(scaled <= 1e-3);
}

TEST_CASE("train_step: a step skipped for an fp16 overflow still reports its loss and norm", "[train_step][skip]") {
  bool first_skipped = true, unchanged = false;  // rank 0's, checked after launch
  shard::step_result r;
  float scale = 0;
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = fixture::make_model();
    auto model = shard::fully_shard<fixture::sgd>(
        m, c, shard::FullShard{}, wrapped({.precision = {.reduce = dtype::f16}, .scaler = {.scale = 1024}}));
    fixture::sgd opt;
    auto x = fixture::batch(0, 2, 5, 1, c.rank() * 2), y = fixture::batch(0, 2, 3, 2, c.rank() * 2);
    const bool skipped = model.train_step(opt, x, y, fixture::mse, {.max_norm = 1}).skipped;
    const auto before = full_params(model);
    Tensor<float> huge(x.shape());
    for (std::int64_t i = 0; i < x.numel(); ++i) huge[i] = x[i] * 1e4f;  // gradients beyond fp16's 65504
    const auto result = model.train_step(opt, huge, y, fixture::mse, {.max_norm = 1});
    const auto after = full_params(model);
    if (c.rank() != 0) return;
    first_skipped = skipped;
    r = result;
    unchanged = after == before;
    scale = model.scaler()->scale;
  });
  CHECK(!first_skipped);
  CHECK(r.skipped);
  CHECK(std::isfinite(r.loss));
  CHECK(r.loss > 1e4f);
  REQUIRE(r.grad_norm);
  CHECK(!std::isfinite(*r.grad_norm));
  CHECK(unchanged);
  CHECK(scale == 512);
}

}  // namespace test_param_groups
