// A Linear's LoRA adapter (Linear::add_lora, nn/lora_adapter.hpp): its output is the formula's in float64, its gradients the
// central differences of its output; a new adapter changes nothing; its base is frozen
// and keeps no input, the adapter keeps x and x A^T only for a trained matrix; and a
// model of adapters trains under every strategy as unsharded, its base weights
// untouched, each rank keeping the adapters' reduced gradients alone; a base model's
// checkpoint loads into it, merge_lora folds it into the base, and adapter files hold the
// adapters alone (state_dict_options::only).
#include "shardlib/comm/launch.hpp"
#include "shardlib/core/ledger.hpp"
#include "shardlib/io/safetensors.hpp"
#include "shardlib/io/state_dict.hpp"
#include "shardlib/nn/activation.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/lora.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/plan/describe.hpp"
#include "shardlib/plan/memory_plan.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/compare.hpp"
#include "support/gradcheck.hpp"
#include "support/shard_fixture.hpp"

#include <catch2/catch.hpp>

#include <unistd.h>  // getpid

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace test_lora {

using namespace shardlib;
using Catch::Matchers::Contains;

// x [2, 3, 6] -> [2, 3, 5], r = 3, alpha 6 (scaling 2; rslora: 6 / sqrt(3)), lora_B drawn
// as lora_A is (a trained adapter). The forward against the formula summed in another
// order: 1e-12 relative to max(|want|, 1). The gradients against central differences
// (support/gradcheck.hpp, 1e-6 norm-wise), with the base trained; frozen, its gradients
// stay as they were and the rest keep their bits.
TEST_CASE("a LoRA Linear's output is the formula's and its gradients the output's differences", "[lora]") {
  for (bool rslora : {false, true}) {
    INFO("rslora " << rslora);
    nn::Linear<double> l(6, 5);
    l.add_lora({.r = 3, .alpha = 6, .rslora = rslora});
    auto& lora = *l.lora();
    CHECK(lora.scaling() == (rslora ? 6 / std::sqrt(3.0) : 2.0));
    CHECK(!l.weight.requires_grad);  // frozen by add_lora, as PEFT freezes it
    CHECK(!l.bias.requires_grad);
    lora.lora_B.init = lora.lora_A.init;
    const Tensor<double> x = gradcheck::random_tensor({2, 3, 6}, 1);
    std::vector<std::vector<double>> frozen_grads;
    for (bool base_trained : {false, true}) {
      INFO("base trained " << base_trained);
      l.weight.requires_grad = l.bias.requires_grad = base_trained;
      nn::Replicated<double, nn::Linear<double>> owner(l, 5);
      for (const char* name : {"base_layer.weight", "base_layer.bias"}) std::ranges::fill(owner.grad(name), 7.0);
      nn::context ctx;
      const Tensor<double> y = l.forward(ctx, x);
      const Tensor<double> dx = l.backward(ctx, gradcheck::random_tensor(y.shape(), 2));
      std::vector<std::vector<double>> grads{{dx.span().begin(), dx.span().end()}};
      for (const char* name : {"lora_A.weight", "lora_B.weight"})
        grads.emplace_back(owner.grad(name).begin(), owner.grad(name).end());
      if (!base_trained) {
        frozen_grads = grads;
        for (const char* name : {"base_layer.weight", "base_layer.bias"})
          for (double g : owner.grad(name)) REQUIRE(g == 7.0);
        continue;
      }
      CHECK(grads == frozen_grads);  // == fails on NaN
      const auto W = owner.value("base_layer.weight"), bias = owner.value("base_layer.bias");
      const auto A = owner.value("lora_A.weight"), B = owner.value("lora_B.weight");
      test_support::max_error forward;
      for (std::int64_t row = 0; row < 6; ++row)
        for (std::int64_t o = 0; o < 5; ++o) {
          double want = bias[std::size_t(o)];
          for (std::int64_t k = 0; k < 6; ++k) want += x[row * 6 + k] * W[std::size_t(o * 6 + k)];
          for (std::int64_t j = 0; j < 3; ++j) {
            double h = 0;
            for (std::int64_t k = 0; k < 6; ++k) h += x[row * 6 + k] * A[std::size_t(j * 6 + k)];
            want += lora.scaling() * h * B[std::size_t(o * 3 + j)];
          }
          forward.relative(y[row * 5 + o], want, 1.0);
        }
      CHECK(forward <= 1e-12);
    }
    const auto r = gradcheck::check(l, x, 1000);  // every element
    INFO("worst: " << r.worst);
    CHECK(r.max_rel_error < 1e-6);
    CHECK(r.compared == 30 + 5 + 18 + 15 + 36);
  }
}

// PEFT's lora_dropout: in training the update reads x through a Dropout mask, which is
// nn::Dropout's for the context's first draw (the base product reads x whole), and
// backward applies the same mask to the update's dx; in evaluation the update reads x.
// Against the formulas in float64 with that mask: 1e-12 relative to max(|want|, 1).
TEST_CASE("a LoRA adapter's dropout masks the update's input in training and nothing in evaluation", "[lora]") {
  nn::Linear<double> l(6, 5);
  l.add_lora({.r = 3, .alpha = 6, .dropout = 0.5});
  auto& lora = *l.lora();
  lora.lora_B.init = lora.lora_A.init;
  nn::Replicated<double, nn::Linear<double>> owner(l, 5);
  const Tensor<double> x = gradcheck::random_tensor({4, 6}, 1), dy = gradcheck::random_tensor({4, 5}, 2);
  const auto W = owner.value("base_layer.weight"), bias = owner.value("base_layer.bias");
  const auto A = owner.value("lora_A.weight"), B = owner.value("lora_B.weight");
  const double s = lora.scaling();
  for (bool training : {true, false}) {
    INFO("training " << training);
    owner.zero_grad();
    const nn::context::options o{.training = training, .seed = 9, .step = 2};
    nn::context probe(o), ctx(o);
    const Tensor<double> xd = training ? nn::detail::dropout_mask<host_space>::apply(x, probe.random_stream(), 0.5) : x;
    std::int64_t dropped = 0;
    for (std::int64_t i = 0; i < x.numel(); ++i) dropped += xd[i] == 0;
    CHECK((dropped > 0) == training);
    const Tensor<double> y = l.forward(ctx, x);
    const Tensor<double> dx = l.backward(ctx, dy);
    // h = xd A^T, g = s dy B (dh), then y, dx = dy W + mask(g A), dA = g^T xd, dB = s dy^T h.
    Tensor<double> h({4, 3}), g({4, 3}), gA({4, 6});
    for (auto* t : {&h, &g, &gA}) std::ranges::fill(t->span(), 0.0);
    for (std::int64_t row = 0; row < 4; ++row)
      for (std::int64_t j = 0; j < 3; ++j)
        for (std::int64_t k = 0; k < 6; ++k) h[row * 3 + j] += xd[row * 6 + k] * A[std::size_t(j * 6 + k)];
    for (std::int64_t row = 0; row < 4; ++row)
      for (std::int64_t j = 0; j < 3; ++j)
        for (std::int64_t o2 = 0; o2 < 5; ++o2) g[row * 3 + j] += s * dy[row * 5 + o2] * B[std::size_t(o2 * 3 + j)];
    for (std::int64_t row = 0; row < 4; ++row)
      for (std::int64_t k = 0; k < 6; ++k)
        for (std::int64_t j = 0; j < 3; ++j) gA[row * 6 + k] += g[row * 3 + j] * A[std::size_t(j * 6 + k)];
    test_support::max_error ey, edx, eA, eB;
    nn::context again(o);
    const auto stream = again.random_stream();  // the forward's draw: backward masks with it again
    for (std::int64_t row = 0; row < 4; ++row) {
      for (std::int64_t o2 = 0; o2 < 5; ++o2) {
        double want = bias[std::size_t(o2)];
        for (std::int64_t k = 0; k < 6; ++k) want += x[row * 6 + k] * W[std::size_t(o2 * 6 + k)];
        for (std::int64_t j = 0; j < 3; ++j) want += s * h[row * 3 + j] * B[std::size_t(o2 * 3 + j)];
        ey.relative(y[row * 5 + o2], want, 1.0);
      }
      for (std::int64_t k = 0; k < 6; ++k) {
        const std::int64_t i = row * 6 + k;
        double want = training ? (nn::dropout_keep(stream, std::uint64_t(i), 0.5f) ? 2 * gA[i] : 0.0) : gA[i];
        for (std::int64_t o2 = 0; o2 < 5; ++o2) want += dy[row * 5 + o2] * W[std::size_t(o2 * 6 + k)];
        edx.relative(dx[i], want, 1.0);
      }
    }
    const auto dA = owner.grad("lora_A.weight"), dB = owner.grad("lora_B.weight");
    for (std::int64_t j = 0; j < 3; ++j) {
      for (std::int64_t k = 0; k < 6; ++k) {
        double want = 0;
        for (std::int64_t row = 0; row < 4; ++row) want += g[row * 3 + j] * xd[row * 6 + k];
        eA.relative(dA[std::size_t(j * 6 + k)], want, 1.0);
      }
      for (std::int64_t o2 = 0; o2 < 5; ++o2) {
        double want = 0;
        for (std::int64_t row = 0; row < 4; ++row) want += s * dy[row * 5 + o2] * h[row * 3 + j];
        eB.relative(dB[std::size_t(o2 * 3 + j)], want, 1.0);
      }
    }
    CHECK(ey <= 1e-12);
    CHECK(edx <= 1e-12);
    CHECK(eA <= 1e-12);
    CHECK(eB <= 1e-12);
  }
  nn::Linear<double> bad(6, 5);
  CHECK_THROWS_WITH(bad.add_lora({.dropout = 1}), Contains("Linear(6 -> 5) LoRA: dropout must be in [0, 1), got 1"));
}

// lora_B starts at zero: a new adapter's output is its base layer's, bit for bit. The
// adapter renames the base's parameters as PEFT does. A rank below 1 and a second
// adapter are refused.
TEST_CASE("a new LoRA adapter leaves its Linear's output as it was", "[lora]") {
  nn::Linear<float> l(16, 8);
  l.add_lora({.r = 4, .alpha = 16});
  nn::Replicated<float, nn::Linear<float>> owner(l, 3);
  std::vector<std::string> names;
  l.parameters([&](std::string_view name, auto&) { names.emplace_back(name); });
  CHECK(names == std::vector<std::string>{"base_layer.weight", "base_layer.bias", "lora_A.weight", "lora_B.weight"});
  for (float b : owner.value("lora_B.weight")) REQUIRE(b == 0.0f);
  bool moved = false;
  for (float a : owner.value("lora_A.weight")) moved = moved || (a != 0.0f && std::abs(a) <= 0.25f);  // U(-1/4, 1/4)
  CHECK(moved);
  const Tensor<float> x = fixture::batch(0, 5, 16, 1);
  nn::context ctx;
  nn::Linear<float> plain(16, 8);
  plain.weight.value = l.weight.value;
  plain.bias.value = l.bias.value;
  const auto y = l.forward(ctx, x), base = plain.forward(ctx, x);
  REQUIRE(y.numel() == base.numel());
  for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(y[i] == base[i]);
  CHECK_THROWS_WITH(plain.add_lora({.r = 0}), Contains("Linear(16 -> 8) LoRA: rank r must be at least 1"));
  CHECK_THROWS_WITH(l.add_lora(), Contains("Linear(16 -> 8): add_lora on a layer that has a LoRA adapter already"));
  CHECK_THROWS_WITH(plain.merge_lora(), Contains("Linear(16 -> 8): merge_lora on a layer without a LoRA adapter"));
}

// nn::add_lora checks before it changes anything: a target naming no Linear, or naming one
// with an adapter, leaves the model as it was (its names and flags); a second call adapts
// more Linears and keeps the first call's adapters trained.
TEST_CASE("add_lora refuses before it changes the model, and a second call keeps the first's adapters", "[lora]") {
  using Model = nn::Sequential<nn::Linear<float>, nn::ReLU<float>, nn::Linear<float>>;
  Model m{nn::Linear<float>(4, 8), nn::ReLU<float>{}, nn::Linear<float>(8, 2)};
  const auto flags = [&] {
    std::vector<std::pair<std::string, bool>> v;
    m.parameters([&](std::string_view name, auto& p) { v.emplace_back(name, p.requires_grad); });
    return v;
  };
  const auto before = flags();
  CHECK_THROWS_WITH(nn::add_lora(m, {"0", "5"}),
                    Contains("add_lora: target '5' names no Linear of the model (a module's dotted name, its last "
                             "components, or a glob); its Linears: 0, 2"));
  CHECK(flags() == before);
  CHECK(nn::add_lora(m, {"0"}, {.r = 2}) == std::vector<std::string>{"0"});
  const auto once = flags();
  CHECK_THROWS_WITH(nn::add_lora(m, {"*"}), Contains("add_lora: 0 has a LoRA adapter already"));
  CHECK(flags() == once);
  CHECK(nn::add_lora(m, {"2"}, {.r = 2}) == std::vector<std::string>{"2"});
  using flag = std::pair<std::string, bool>;
  CHECK(flags() == std::vector<flag>{{"0.base_layer.weight", false}, {"0.base_layer.bias", false},
                                     {"0.lora_A.weight", true},      {"0.lora_B.weight", true},
                                     {"2.base_layer.weight", false}, {"2.base_layer.bias", false},
                                     {"2.lora_A.weight", true},      {"2.lora_B.weight", true}});
}

// What forward keeps: x for lora_A's gradient, x A^T for lora_B's, nothing of the frozen
// base's input but its shape; with gradients disabled, nothing; a matrix unfrozen between
// forward and backward is refused, naming the layer.
TEST_CASE("a LoRA adapter keeps x and x A^T only for a trained adapter matrix", "[lora][memory]") {
  const std::size_t x_bytes = 4 * 64 * sizeof(float), h_bytes = 4 * 8 * sizeof(float), y_bytes = 4 * 32 * sizeof(float);
  struct setting {
    bool a, b;
    std::size_t kept;
  };
  for (const auto [a, b, kept] : {setting{true, true, x_bytes + h_bytes}, setting{false, true, h_bytes},
                                  setting{true, false, x_bytes}, setting{false, false, 0}}) {
    INFO("lora_A trained " << a << ", lora_B trained " << b);
    ledger l;
    ledger_scope scope(l);
    nn::Linear<float> lora(64, 32);
    lora.add_lora({.r = 8});
    nn::Replicated<float, nn::Linear<float>> owner(lora, 1);
    lora.lora()->lora_A.requires_grad = a;
    lora.lora()->lora_B.requires_grad = b;
    nn::context ctx;
    Tensor<float> y;
    {
      const Tensor<float> x = fixture::batch(0, 4, 64, 1);
      y = lora.forward(ctx, x);
    }
    CHECK(l.current(category::activations) == y_bytes + kept);
    const auto dx = lora.backward(ctx, fixture::batch(1, 4, 32, 1));
    CHECK(dx.shape() == Shape{4, 64});
    y = {};
    ctx.no_grad([&] { y = lora.forward(ctx, fixture::batch(0, 4, 64, 1)); });
    CHECK(l.current(category::activations) == y_bytes + dx.numel() * sizeof(float));
    if (!a) {
      (void)lora.forward(ctx, fixture::batch(0, 4, 64, 1));
      lora.lora()->lora_A.requires_grad = true;
      CHECK_THROWS_WITH(lora.backward(ctx, fixture::batch(1, 4, 32, 1)),
                        Contains("Linear(64 -> 32) LoRA lora_A: its weight was frozen at forward"));
    }
  }
}

namespace {

using Adapters = nn::Sequential<nn::Linear<float>, nn::ReLU<float>, nn::Linear<float>>;
constexpr std::int64_t in = 16, hidden = 64, out = 32, rows = 12;
Adapters make_adapters() {
  Adapters m{nn::Linear<float>(in, hidden), nn::ReLU<float>{}, nn::Linear<float>(hidden, out)};
  m.get<0>().add_lora({.r = 4});
  m.get<2>().add_lora({.r = 4, .alpha = 16});
  return m;
}

// Each Linear a unit.
shard::options adapter_units() { return {.wrap = shard::wrap_types<nn::Linear<float>>{}, .seed = 42}; }

// `steps` train_steps of the mse on the rows of rank `rank` of `world`.
template <class Model>
void train_steps(Model& model, optim::AdamW& opt, int steps, int world, int rank) {
  const std::int64_t per_rank = rows / world, first = rank * per_rank;
  for (int s = 0; s < steps; ++s)
    model.train_step(opt, fixture::batch(s, per_rank, in, 1, first), fixture::batch(s, per_rank, out, 2, first),
                     fixture::mse);
}

// The full parameters by name (collective): into `to` when `keep`.
template <class Model>
void full_state(Model& model, std::map<std::string, std::vector<float>>& to, bool keep = true) {
  for (auto& [name, t] : model.full_state_dict(false))
    if (keep) to[name].assign(t.span().begin(), t.span().end());
}

struct adapters_run {
  std::map<std::string, std::vector<float>> initial, final;
  std::vector<std::size_t> grads;  // rank 0's reduced gradients in each adapter unit
  bool plan_equal = true;          // every rank's ledger equals its plan (activations aside)
  std::size_t gradient_peak = 0;   // rank 0's
};

// Three AdamW steps of the adapters model on `rows` rows split over the ranks, each
// Linear a unit; without gradient storage for the frozen base when frozen_grads is false.
adapters_run train_adapters(int w, shard::AnyStrategy strategy, bool frozen_grads = true) {
  std::vector<adapters_run> runs(std::size_t(w), adapters_run{});
  comm::launch(w, [&](comm::ThreadComm& c, ledger& l) {
    Adapters m = make_adapters();
    auto options = adapter_units();
    options.frozen_grads = frozen_grads;
    auto model = shard::fully_shard<optim::AdamW>(m, c, strategy, options);
    auto& run = runs[std::size_t(c.rank())];
    full_state(model, run.initial);
    l.reset_peaks();  // the state dict's gathers and tensors are not the step's
    optim::AdamW opt{{.lr = 1e-2, .weight_decay = 0.1}};
    train_steps(model, opt, 3, w, c.rank());
    const auto plan = plan::make_plan(
        plan::describe(model),
        {.policy = strategy.policy(), .world = w, .frozen_grads = frozen_grads, .rank = c.rank()});
    for (int k = 0; k < category_count; ++k)
      if (category(k) != category::activations && l.peak(category(k)) != plan.memory[category(k)])
        run.plan_equal = false;
    run.gradient_peak = l.peak(category::gradients);
    full_state(model, run.final);
    for (std::size_t i = 0; i < model.unit_count(); ++i) {
      if (model.unit_name(i).empty()) continue;  // the root holds no parameter
      run.grads.push_back(model.units()[i].grad.size());
    }
  });
  for (int r = 1; r < w; ++r) runs[0].plan_equal = runs[0].plan_equal && runs[std::size_t(r)].plan_equal;
  return runs[0];
}

}  // namespace

// Against one rank: the same global batch, so the trained adapters end equal up to the
// reductions' order (bound 1e-5 relative to max(|want|, 0.1); a wrong gradient moves an
// element by about lr = 1e-2); the base weights keep their bits. The adapter units, flat:
//   0: base weight [0, 1024), bias [1024, 1088), lora_A [1088, 1152), lora_B [1152, 1408)
//   2: base weight [0, 2048), bias [2048, 2080), lora_A [2080, 2336), lora_B [2336, 2464)
// At W = 2 rank 0's pieces (704 and 1232) are base weight alone and rank 1's hold the
// adapters (320 and 384 elements), so the reductions pack and rank 0 keeps no reduced
// gradients; HybridShard with groups of 1 keeps each unit's adapters (one piece each);
// NoShard the whole units, where its layers write.
TEST_CASE("a model of LoRA adapters trains under every strategy as on one rank", "[lora][shard]") {
  const auto one = train_adapters(1, shard::NoShard{});
  {
    // The same without sharding: a plain owner whose step leaves the frozen runs out
    // (its layout records the flags), bit for bit.
    INFO("nn::Replicated with step_unfrozen");
    Adapters m = make_adapters();
    nn::Replicated<float, Adapters> owner(m, 42);
    const std::size_t n = owner.values().size();
    const auto runs = optim::cut_frozen({{0, n, 0}}, owner.layout(), 0, n);
    const optim::AdamW opt{{.lr = 1e-2, .weight_decay = 0.1}};
    auto st = opt.make_state(optim::trained_size(runs));
    nn::context ctx;
    for (int s = 0; s < 3; ++s) {
      owner.zero_grad();
      const auto l = fixture::mse(ctx.forward(m, fixture::batch(s, rows, in, 1)), fixture::batch(s, rows, out, 2));
      ctx.backward(m, l.grad);
      optim::step_unfrozen(opt, owner.values(), std::span<const float>(owner.grads()), st, runs);
    }
    for (const auto& e : owner.layout().entries) {
      INFO(e.name);
      const auto v = owner.value(e.name);
      CHECK(std::vector<float>(v.begin(), v.end()) == one.final.at(e.name));  // == fails on NaN
    }
  }
  struct setting {
    shard::AnyStrategy strategy;
    std::vector<std::size_t> grads;  // rank 0's reduced gradients in units 0 and 2
  };
  for (const auto& [strategy, grads] : {setting{shard::FullShard{}, {0, 0}}, setting{shard::ShardGradOp{}, {0, 0}},
                                        setting{shard::ShardOptimizer{}, {0, 0}},
                                        setting{shard::HybridShard{.group_size = 1}, {320, 384}},
                                        setting{shard::NoShard{}, {1408, 2464}}}) {
    INFO(strategy.name);
    const auto run = train_adapters(2, strategy);
    REQUIRE(run.final.size() == one.final.size());
    test_support::max_error adapters;
    for (const auto& [name, values] : run.final) {
      INFO(name);
      if (name.find("base_layer") != std::string::npos) {
        CHECK(values == run.initial.at(name));  // == fails on NaN
        continue;
      }
      CHECK(values != run.initial.at(name));
      adapters.relative(values, one.final.at(name), 0.1);
    }
    CHECK(adapters <= 1e-5);
    CHECK(run.grads == grads);
    CHECK(run.plan_equal);
    if (strategy.name == "NoShard") continue;  // its layers write into the gradients it reduces
    // The base's Params without gradient storage (options.frozen_grads = false): Linear and
    // its adapter skip them, the same bits; the full local gradients the adapters' alone.
    const auto adapters_only = train_adapters(2, strategy, false);
    CHECK(adapters_only.final == run.final);  // == fails on NaN
    CHECK(adapters_only.plan_equal);
    CHECK(adapters_only.gradient_peak < run.gradient_peak);
  }
}

// PEFT's order: a base model's checkpoint loads into the adapted model under the base
// names (nn::peft_base_names), the adapters reported missing and kept as drawn; with B at
// zero the sharded adapted model then computes the base model's output, bit for bit. A
// strict load names the four adapter matrices.
TEST_CASE("a base model's checkpoint loads into its LoRA adapters, which start as the base", "[lora][checkpoint]") {
  const auto dir = std::filesystem::temp_directory_path() / cat("shardlib-lora-", ::getpid());
  std::filesystem::create_directories(dir);
  const auto path = dir / "base.safetensors";
  Adapters plain{nn::Linear<float>(in, hidden), nn::ReLU<float>{}, nn::Linear<float>(hidden, out)};
  nn::Replicated<float, Adapters> owner(plain, 7);
  io::save_state_dict(path, owner);
  const Tensor<float> x = fixture::batch(0, rows, in, 1);
  nn::context ctx;
  const Tensor<float> want = plain.forward(ctx, x);

  Adapters probe = make_adapters();
  const auto pairs = nn::peft_base_names(probe);
  CHECK(pairs == std::vector<std::pair<std::string, std::string>>{{"0.weight", "0.base_layer.weight"},
                                                                   {"0.bias", "0.base_layer.bias"},
                                                                   {"2.weight", "2.base_layer.weight"},
                                                                   {"2.bias", "2.base_layer.bias"}});
  std::vector<io::load_report> reports(2);
  std::vector<std::vector<float>> outputs(2);
  std::vector<std::string> strict_errors(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Adapters m = make_adapters();
    auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, adapter_units());
    const io::state_dict_options options{.names = io::name_map::table(pairs), .strict = false};
    reports[std::size_t(c.rank())] = io::load_state_dict(path, model, options);
    try {
      io::load_state_dict(path, model, {.names = io::name_map::table(pairs)});
    } catch (const io_error& e) {
      strict_errors[std::size_t(c.rank())] = e.what();
    }
    model.eval();
    const auto y = model.forward(x);
    outputs[std::size_t(c.rank())].assign(y.span().begin(), y.span().end());
  });
  std::filesystem::remove_all(dir);
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const auto& report = reports[std::size_t(r)];
    CHECK(report.missing ==
          std::vector<std::string>{"0.lora_A.weight", "0.lora_B.weight", "2.lora_A.weight", "2.lora_B.weight"});
    CHECK(report.unexpected.empty());
    CHECK(report.mismatched.empty());
    CHECK_THAT(strict_errors[std::size_t(r)], Contains("missing (4): 0.lora_A.weight, 0.lora_B.weight"));
    CHECK(outputs[std::size_t(r)] == std::vector<float>(want.span().begin(), want.span().end()));  // fails on NaN
  }
}

// merge_lora folds the update into the base weight and zeroes lora_B: the output stays (1e-12
// relative in float64: W's one rounding; 1e-5 in float, over a sharded model's
// summon_full_params with writeback), and a base checkpoint saved then holds the fine-tune.
TEST_CASE("merge folds a LoRA adapter into its base weight", "[lora]") {
  {
    nn::Linear<double> l(6, 5);
    l.add_lora({.r = 3, .alpha = 6});
    l.lora()->lora_B.init = l.lora()->lora_A.init;
    nn::Replicated<double, nn::Linear<double>> owner(l, 5);
    const Tensor<double> x = gradcheck::random_tensor({4, 6}, 1);
    nn::context ctx;
    const Tensor<double> before = l.forward(ctx, x);
    const auto w = owner.value("base_layer.weight");
    const std::vector<double> w0(w.begin(), w.end());
    const auto A = owner.value("lora_A.weight"), B = owner.value("lora_B.weight");
    const double want01 = w0[1] + l.lora()->scaling() * (B[0] * A[1] + B[1] * A[7] + B[2] * A[13]);  // W[0, 1]
    l.merge_lora();
    CHECK(std::abs(w[1] - want01) <= 1e-15);
    for (double b : B) REQUIRE(b == 0.0);
    const Tensor<double> after = l.forward(ctx, x);
    test_support::max_error e;
    e.relative(after.span(), before.span(), 1.0);
    CHECK(e <= 1e-12);
  }
  std::vector<std::vector<float>> before(2), after(2);
  std::vector<int> trained_b(2), zero_b(2);  // lora_B elements not zero before merging, zero after
  std::vector<std::size_t> merged(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Adapters m = make_adapters();
    auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, adapter_units());
    optim::AdamW opt{{.lr = 1e-2}};
    train_steps(model, opt, 2, 2, c.rank());
    const Tensor<float> x = fixture::batch(5, rows, in, 1);
    model.eval();
    auto& b = before[std::size_t(c.rank())];
    auto& a = after[std::size_t(c.rank())];
    const auto y0 = model.forward(x);
    b.assign(y0.span().begin(), y0.span().end());
    auto count_b = [&](auto keep) {
      int n = 0;
      for (const auto& [name, t] : model.full_state_dict(false))
        if (name.find("lora_B") != std::string::npos)
          for (float v : t.span()) n += keep(v) ? 1 : 0;
      return n;
    };
    trained_b[std::size_t(c.rank())] = count_b([](float v) { return v != 0.0f; });
    model.summon_full_params([&] { merged[std::size_t(c.rank())] = nn::merge_lora(m); });
    zero_b[std::size_t(c.rank())] = count_b([](float v) { return v == 0.0f; });
    const auto y1 = model.forward(x);
    a.assign(y1.span().begin(), y1.span().end());
  });
  for (int r = 0; r < 2; ++r) {
    test_support::max_error e;
    e.relative(after[std::size_t(r)], before[std::size_t(r)], 0.1);
    CHECK(e <= 1e-5);
    CHECK(merged[std::size_t(r)] == 2);
    CHECK(trained_b[std::size_t(r)] > 0);
    CHECK(zero_b[std::size_t(r)] == hidden * 4 + out * 4);
  }
}

// PEFT's adapter files: options.only saves the adapters alone (4 tensors of the model's 8)
// from a trained sharded model, and loads them alone into another, strictly: its adapters
// become the saved ones and its base weights stay as they were, not reported missing; the
// full file loaded with the same glob reads the adapters alone too. A glob that matches no
// parameter is refused on save and on load, naming it.
TEST_CASE("adapter files: state_dict_options::only saves and loads the adapters alone", "[lora][checkpoint]") {
  const auto dir = std::filesystem::temp_directory_path() / cat("shardlib-adapters-", ::getpid());
  std::filesystem::create_directories(dir);
  const auto adapters = dir / "adapter_model.safetensors", whole = dir / "model.safetensors";
  const std::vector<std::string> lora{"*lora_*"};
  std::map<std::string, std::vector<float>> saved, fresh, loaded, from_whole;
  std::vector<io::load_report> reports(2);
  std::vector<std::string> errors(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    const bool keep = c.rank() == 0;
    {
      Adapters m = make_adapters();
      auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, adapter_units());
      optim::AdamW opt{{.lr = 1e-2}};
      train_steps(model, opt, 2, 2, c.rank());
      io::save_state_dict(adapters, model, {.only = lora});
      io::save_state_dict(whole, model);
      full_state(model, saved, keep);
      try {
        io::save_state_dict(dir / "none.safetensors", model, {.only = {"*lora_C*"}});
      } catch (const io_error& e) {
        errors[std::size_t(c.rank())] = e.what();
      }
    }
    Adapters m = make_adapters();
    auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, adapter_units());
    full_state(model, fresh, keep);
    reports[std::size_t(c.rank())] = io::load_state_dict(adapters, model, {.only = lora});
    full_state(model, loaded, keep);
    (void)io::load_state_dict(whole, model, {.only = {"0.lora_*"}});  // the full file, one layer's adapters
    full_state(model, from_whole, keep);
    try {
      (void)io::load_state_dict(adapters, model, {.only = {"*lora_C*"}});
    } catch (const io_error& e) {
      errors[std::size_t(c.rank())] += e.what();
    }
  });
  std::vector<std::string> names;
  const auto file = io::safetensors::load(adapters);
  for (const auto& t : file.tensors()) names.push_back(t.name);
  std::ranges::sort(names);
  std::filesystem::remove_all(dir);
  CHECK(names == std::vector<std::string>{"0.lora_A.weight", "0.lora_B.weight", "2.lora_A.weight", "2.lora_B.weight"});
  for (const auto& r : reports) CHECK(r.ok());
  REQUIRE(saved.size() == 8);
  for (const auto& [name, values] : saved) {
    INFO(name);
    const bool adapter = name.find("lora_") != std::string::npos;
    CHECK(loaded.at(name) == (adapter ? values : fresh.at(name)));  // == fails on NaN
    CHECK(from_whole.at(name) == loaded.at(name));  // the same values again, or untouched
    if (adapter && name.find("lora_B") != std::string::npos) CHECK(values != fresh.at(name));  // it trained
  }
  for (const auto& e : errors) {
    CHECK_THAT(e, Contains("none.safetensors: state_dict_options::only: no parameter matches '*lora_C*'"));
    CHECK_THAT(e, Contains("adapter_model.safetensors: state_dict_options::only: no parameter matches '*lora_C*'"));
  }
}

}  // namespace test_lora
