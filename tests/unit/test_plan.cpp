// The memory planner: its per-rank plan equals the ledger's peaks, category by
// category, and the bytes a rank sends per step, for every strategy, world sizes that
// do not divide the units, prefetch 0-2 and 16-bit gathers and reductions; the FSDP
// article's scenario by hand arithmetic; the chooser's ranking; the GPT-2 and LLaMA
// presets' parameter counts and LLaMA-2-7B's model states.
#include "shardlib/comm/launch.hpp"
#include "shardlib/models/causal_lm.hpp"
#include "shardlib/models/gpt2.hpp"
#include "shardlib/models/llama.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/lora.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/pooling.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/nn/transformer.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/plan/chooser.hpp"
#include "shardlib/plan/describe.hpp"
#include "shardlib/plan/hf_config.hpp"
#include "shardlib/plan/lora.hpp"
#include "shardlib/plan/memory_plan.hpp"
#include "shardlib/plan/presets.hpp"
#include "shardlib/plan/transformer.hpp"
#include "shardlib/plan/zero_states.hpp"
#include "shardlib/shard/sharded_model.hpp"

#include "../../benchmarks/counting_comm.hpp"  // bytes sent per rank, ring model
#include "../support/checkpoint_files.hpp"     // temp_dir

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeindex>
#include <vector>

using namespace shardlib;

namespace {

// A small version of the model bench_strategies and train_fsdp train.
using Encoder = nn::TransformerEncoderLayer<float>;
using Model = nn::Sequential<nn::Stack<Encoder>, nn::MeanPool<float>, nn::Linear<float>>;
constexpr long d_model = 16, seq = 4, batch = 2, classes = 3;

Model make_model() {
  return Model{nn::Stack<Encoder>(3, {.d_model = d_model, .nhead = 2, .dim_feedforward = 24, .batch_first = true}),
               nn::MeanPool<float>(1), nn::Linear<float>(d_model, classes)};
}
Tensor<float> inputs(int step, int rank) {
  Tensor<float> x({batch, seq, d_model});
  const counter_rng rng{std::uint64_t(step), std::uint64_t(rank)};
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 2 * rng.uniform_float(std::uint64_t(i)) - 1;
  return x;
}
Tensor<std::int64_t> labels(int step, int rank) {
  Tensor<std::int64_t> y({batch});
  for (std::int64_t i = 0; i < batch; ++i) y[i] = (step + rank + i) % classes;
  return y;
}

std::size_t reference_activations() {
  Model m = make_model();
  return plan::measure_activations(m, [&](nn::context& ctx) {
    auto out = ctx.forward(m, inputs(0, 0));
    ctx.backward(m, nn::cross_entropy(out, labels(0, 0)).grad);
  });
}

using Counted = bench::counting_comm<comm::ThreadComm>;

// What one rank measured over three train_steps, and what the plan says.
struct outcome {
  std::vector<std::size_t> peak = std::vector<std::size_t>(category_count);
  std::size_t peak_total = 0;
  double sent_per_step = 0;
  double reduced_per_step = 0;  // reduce-scatters and all-reduces
  plan::rank_plan plan;
  std::vector<std::size_t> units;  // as describe(sharded) reports them
  std::vector<bool> kept;          // the same
  std::vector<float> losses;
};

template <class Strategy>
std::vector<outcome> run(Strategy strategy, int world, int prefetch, shard::mixed_precision mp,
                         std::size_t activations, shard::wrap_policy keep = shard::wrap_none{},
                         plan::accumulation acc = {}, bool per_item = false) {
  const auto mean = per_item ? shard::loss_mean::per_item : shard::loss_mean::per_micro_batch;
  std::vector<outcome> out(world);
  const int steps = 3;
  comm::launch(world, [&](comm::ThreadComm& c, ledger& l) {
    auto tally = std::make_shared<bench::traffic>();
    Counted counted(c, tally);
    Model m = make_model();
    auto sharded = shard::fully_shard(m, counted, strategy,
                                      {.wrap = shard::wrap_types<Encoder>{}, .keep_gathered = keep, .seed = 1,
                                       .prefetch = prefetch, .precision = mp});
    tally->reset();  // construction compares the ranks' models; only steps count
    optim::Adam adam{{.lr = 1e-3}};
    auto& o = out[c.rank()];
    for (int s = 0; s < steps; ++s) {
      if (acc.micro_batches == 1) {
        o.losses.push_back(
            sharded.train_step(adam, inputs(s, c.rank()), labels(s, c.rank()), nn::cross_entropy, {.mean = mean}));
        continue;
      }
      std::vector<Tensor<float>> xs;
      std::vector<Tensor<std::int64_t>> ys;
      for (int micro = 0; micro < acc.micro_batches; ++micro) {
        xs.push_back(inputs(s * acc.micro_batches + micro, c.rank()));
        ys.push_back(labels(s * acc.micro_batches + micro, c.rank()));
      }
      o.losses.push_back(sharded.train_step(adam, xs, ys, nn::cross_entropy,
                                            {.no_sync = acc.no_sync,
                                             .reshard_after_backward = !acc.keep_after_backward,
                                             .replica_all_reduce = acc.replica_all_reduce,
                                             .mean = mean}));
    }
    for (int k = 0; k < category_count; ++k) o.peak[k] = l.peak(category(k));
    o.peak_total = l.peak();
    o.sent_per_step = tally->total() / steps;
    o.reduced_per_step = (tally->reduce_scatter + tally->all_reduce) / steps;
    const auto desc = plan::describe(sharded, activations);
    o.units = desc.units;
    o.kept = desc.kept_gathered;
    const plan::setup s{.policy = strategy.policy(),
                        .world = world,
                        .prefetch = prefetch,
                        .precision = plan::precision::fp32_layers(mp),
                        .per_item_mean = per_item,
                        .accumulation = acc};
    o.plan = plan::make_plan(desc, s);
  });
  return out;
}

const shard::mixed_precision precisions[] = {{},
                                             {.param = dtype::bf16},
                                             {.param = dtype::bf16, .reduce = dtype::bf16},
                                             {.param = dtype::f16, .reduce = dtype::f16}};

template <class Strategy>
void check_plan(Strategy strategy, int world) {
  const std::size_t activations = reference_activations();
  Model shape = make_model();
  const auto walked = plan::describe_model(shape, shard::wrap_types<Encoder>{});
  REQUIRE(walked.units.size() == 4);  // the root (the head) and three encoder layers
  for (const auto& mp : precisions)
    for (int prefetch : {0, 1, 2}) {
      INFO("W " << world << ", prefetch " << prefetch << ", param " << name(mp.param) << ", reduce "
                << name(mp.reduce));
      for (const auto& o : run(strategy, world, prefetch, mp, activations)) {
        CHECK(o.units == walked.units);  // the walk finds the engine's units
        for (int k = 0; k < category_count; ++k) {
          INFO(name(category(k)));
          CHECK(o.peak[k] == o.plan.memory[category(k)]);
        }
        // Not `peak_total <= plan.memory.total()`: total() is the sum of the category
        // peaks, each equal to the ledger's above, and the peak of a sum never exceeds
        // the sum of the peaks, so that check held whatever the engine or the ledger did.
        // Parameters and optimizer state are allocated through steps 2 and 3, so the
        // peak of the sum holds them on top of each other category's own peak:
        const std::size_t held = o.peak[int(category::parameters)] + o.peak[int(category::optimizer_state)];
        for (category c : {category::gradients, category::gathered_parameters, category::activations,
                           category::comm_scratch})
          CHECK(o.peak_total >= held + o.peak[int(c)]);
        // Without per-unit gathers or collective scratch (NoShard; ShardOptimizer in fp32)
        // every category but the activations is constant, so all peak together and the
        // plan's total is the ledger's peak, byte for byte.
        if constexpr (std::is_same_v<Strategy, shard::NoShard> || std::is_same_v<Strategy, shard::ShardOptimizer>)
          if (o.plan.memory.comm_scratch == 0) CHECK(o.peak_total == o.plan.memory.total());
        CHECK(o.sent_per_step == Approx(o.plan.sent.total()).epsilon(1e-12));
      }
    }
}

}  // namespace

TEMPLATE_TEST_CASE("the plan equals the ledger's peaks and the bytes sent, for every strategy", "[plan][ledger]",
                   shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer, shard::NoShard) {
  check_plan(TestType{}, 3);  // 3 divides no unit: every unit is padded
}

TEST_CASE("the plan equals the ledger's peaks and the bytes sent under hybrid sharding", "[plan][ledger][hybrid]") {
  check_plan(shard::HybridShard{.group_size = 2}, 4);
}

// options.keep_gathered (FSDP2's reshard_after_forward=False on chosen modules): the last
// encoder layer, or the first and the last, stay gathered from their forward to their
// backward. The plan equals the ledger and the bytes sent, which are one all-gather of each
// kept unit fewer per step than without; training is the same bit for bit.
TEST_CASE("units kept gathered after forward: the plan equals the ledger and the bytes sent",
          "[plan][ledger][keep_gathered]") {
  const std::size_t activations = reference_activations();
  const auto check = [&](auto strategy, int world) {
    for (const auto& mp : {precisions[0], precisions[2]})
      for (int prefetch : {0, 1, 2}) {
        const auto plain = run(strategy, world, prefetch, mp, activations);
        for (const std::vector<std::string>& names :
             {std::vector<std::string>{"0.layers.2"}, std::vector<std::string>{"0.layers.0", "0.layers.2"}}) {
          INFO(strategy.name << ", W " << world << ", prefetch " << prefetch << ", param " << name(mp.param)
                             << ", kept " << Catch::Detail::stringify(names));
          const auto kept = run(strategy, world, prefetch, mp, activations, shard::wrap_names{names});
          const std::vector<bool> flags{false, names.size() == 2, false, true};  // the root, then layers 0-2
          for (int r = 0; r < world; ++r) {
            const auto& o = kept[std::size_t(r)];
            CHECK(o.kept == flags);
            for (int k = 0; k < category_count; ++k) {
              INFO(name(category(k)));
              CHECK(o.peak[k] == o.plan.memory[category(k)]);
            }
            CHECK(o.sent_per_step == Approx(o.plan.sent.total()).epsilon(1e-12));
            // one all-gather of each kept unit fewer: (G - 1) / G of its padded values
            const int g = strategy.policy().group(world);
            double saved = 0;
            for (std::size_t i = 1; i < flags.size(); ++i)
              if (flags[i])
                saved += double(g - 1) / g * double(shard::shard_layout{o.units[i], g}.padded_size()) *
                         double(size_of(mp.param));
            CHECK(plain[std::size_t(r)].sent_per_step - o.sent_per_step == Approx(saved).epsilon(1e-12));
            CHECK(o.losses == plain[std::size_t(r)].losses);  // bit for bit
          }
        }
      }
  };
  check(shard::FullShard{}, 3);
  check(shard::HybridShard{.group_size = 2}, 4);
}

// policy::reshard_to = R (FSDP2's reshard_after_forward=R, ZeRO++'s hpZ): after forward each
// unit but the root keeps 1/R of its full values, and its backward all-gathers them within
// groups of R ranks. The plan equals the ledger and the bytes sent, which are each such
// unit's backward all-gather at (R - 1) / R of its values where it was (G - 1) / G (R = 1
// keeps it whole: no second all-gather; R = G is FullShard's); training is the same bit for bit.
TEST_CASE("units resharded to smaller groups after forward: the plan equals the ledger and the bytes sent",
          "[plan][ledger][reshard]") {
  const std::size_t activations = reference_activations();
  const auto check = [&](auto plain_strategy, auto strategy, int world, shard::wrap_policy keep) {
    const int g = strategy.policy().group(world), R = strategy.policy().regather(world);
    for (const auto& mp : {precisions[0], precisions[2]})
      for (int prefetch : {0, 1, 2}) {
        INFO(strategy.name << " reshard_to " << strategy.reshard_to << ", W " << world << ", prefetch " << prefetch
                           << ", param " << name(mp.param));
        const auto plain = run(plain_strategy, world, prefetch, mp, activations, keep);
        const auto resharded = run(strategy, world, prefetch, mp, activations, keep);
        for (int r = 0; r < world; ++r) {
          const auto& o = resharded[std::size_t(r)];
          for (int k = 0; k < category_count; ++k) {
            INFO(name(category(k)));
            CHECK(o.peak[k] == o.plan.memory[category(k)]);
          }
          CHECK(o.sent_per_step == Approx(o.plan.sent.total()).epsilon(1e-12));
          double saved = 0;  // each unit freed after forward: its backward's all-gather over R ranks, not g
          for (std::size_t i = 1; i < o.units.size(); ++i)
            if (o.kept.empty() || !o.kept[i])
              saved += (double(g - 1) / g - double(R - 1) / R) *
                       double(shard::shard_layout{o.units[i], g}.padded_size()) * double(size_of(mp.param));
          CHECK(plain[std::size_t(r)].sent_per_step - o.sent_per_step == Approx(saved).epsilon(1e-12));
          if (R > 1 && R < g)  // the parts kept: more held than FullShard's gathers alone
            CHECK(o.peak[int(category::gathered_parameters)] >
                  plain[std::size_t(r)].peak[int(category::gathered_parameters)]);
          CHECK(o.losses == plain[std::size_t(r)].losses);  // bit for bit
        }
      }
  };
  check(shard::FullShard{}, shard::FullShard{.reshard_to = 2}, 4, shard::wrap_none{});
  check(shard::FullShard{}, shard::FullShard{.reshard_to = 2}, 4, shard::wrap_names{{"0.layers.2"}});
  check(shard::FullShard{}, shard::FullShard{.reshard_to = 1}, 3, shard::wrap_none{});
  check(shard::FullShard{}, shard::FullShard{.reshard_to = 3}, 3, shard::wrap_none{});
  check(shard::HybridShard{.group_size = 4}, shard::HybridShard{.group_size = 4, .reshard_to = 2}, 8,
        shard::wrap_none{});
}

// Gradient accumulation, train_step over two or three micro-batches per step: each reduced
// (FSDP2's default) or, under no_sync (set_requires_gradient_sync(False), DDP's no_sync), the
// last one reducing all, with units kept gathered after the backwards before the last
// (reshard_after_backward = false) or freed. The plan equals the ledger and the bytes sent;
// no_sync sends the reductions of one micro-batch per step where each sent its own; keeping
// units gathered trains the same bit for bit. The last loop averages HybridShard's pieces across
// its replicas once a step (replica_all_reduce = false; the other policies have no replicas).
TEST_CASE("accumulated micro-batches: the plan equals the ledger and the bytes sent",
          "[plan][ledger][accumulation]") {
  const std::size_t activations = reference_activations();
  const plan::accumulation loops[] = {{.micro_batches = 3},
                                      {.micro_batches = 3, .no_sync = true},
                                      {.micro_batches = 3, .no_sync = true, .keep_after_backward = true},
                                      {.micro_batches = 2, .keep_after_backward = true},
                                      {.micro_batches = 3, .replica_all_reduce = false}};
  const auto check = [&](auto strategy, int world) {
    for (const auto& mp : precisions)
      for (int prefetch : {0, 1, 2}) {
        std::vector<std::vector<outcome>> runs;
        for (const plan::accumulation& acc : loops) {
          INFO(strategy.name << " W " << world << ", prefetch " << prefetch << ", param " << name(mp.param)
                             << ", reduce " << name(mp.reduce) << ", " << acc.micro_batches << " micro-batches, no_sync "
                             << acc.no_sync << ", kept after backward " << acc.keep_after_backward
                             << ", replica all-reduce each " << acc.replica_all_reduce);
          runs.push_back(run(strategy, world, prefetch, mp, activations, shard::wrap_none{}, acc));
          // train_step takes every micro-batch at once: the caller's tensors of the others (the
          // ledger counts them among the activations) on top of one micro-batch's activations
          const std::size_t others = std::size_t(acc.micro_batches - 1) *
                                     std::size_t(batch * seq * d_model * sizeof(float) + batch * sizeof(std::int64_t));
          for (const auto& o : runs.back()) {
            for (int k = 0; k < category_count; ++k) {
              INFO(name(category(k)));
              CHECK(o.peak[k] == o.plan.memory[category(k)] + (category(k) == category::activations ? others : 0));
            }
            CHECK(o.sent_per_step == Approx(o.plan.sent.total()).epsilon(1e-12));
          }
        }
        INFO(strategy.name << " W " << world << ", prefetch " << prefetch << ", param " << name(mp.param));
        for (int r = 0; r < world; ++r) {
          const auto rank = std::size_t(r);
          // three reductions per step, or one, beside train_step's all-reduces of the loss (and the
          // overflow vote, 8 bytes) and of the ranks' counts and options (96 bytes)
          const double scalars = 2 * double(world - 1) / world * (8 + 96);
          CHECK(runs[0][rank].reduced_per_step - scalars ==
                Approx(3 * (runs[1][rank].reduced_per_step - scalars)).epsilon(1e-12));
          CHECK(runs[2][rank].reduced_per_step == runs[1][rank].reduced_per_step);
          CHECK(runs[2][rank].losses == runs[1][rank].losses);  // bit for bit
        }
      }
  };
  check(shard::FullShard{}, 3);
  check(shard::ShardGradOp{}, 3);
  check(shard::ShardOptimizer{}, 3);
  check(shard::NoShard{}, 3);
  check(shard::HybridShard{.group_size = 2}, 4);
  check(shard::FullShard{.reshard_to = 2}, 4);
}

// loss_mean::per_item adds an all-reduce of the ranks' items (two 8-byte integers) a step,
// on one batch or over micro-batches; the rest is as without it.
TEST_CASE("the plan's traffic counts a per-item mean's all-reduce", "[plan][accumulation][items]") {
  const std::size_t activations = reference_activations();
  for (int micro : {1, 3}) {
    const plan::accumulation acc{.micro_batches = micro};
    const auto without = run(shard::FullShard{}, 3, 1, {}, activations, shard::wrap_none{}, acc);
    const auto with = run(shard::FullShard{}, 3, 1, {}, activations, shard::wrap_none{}, acc, true);
    for (int r = 0; r < 3; ++r) {
      const auto& o = with[std::size_t(r)];
      INFO(micro << " micro-batches, rank " << r);
      CHECK(o.sent_per_step == Approx(o.plan.sent.total()).epsilon(1e-12));
      CHECK(o.sent_per_step - without[std::size_t(r)].sent_per_step == Approx(2 * 2.0 / 3 * 16).epsilon(1e-9));
    }
  }
}

TEST_CASE("the planner's walk finds the units fully_shard makes", "[plan][describe]") {
  using Block = nn::Linear<float>;
  using Mlp = nn::Sequential<nn::Linear<float>, nn::Stack<Block>, nn::Linear<float>>;
  auto mlp = [] { return Mlp{nn::Linear<float>(5, 8), nn::Stack<Block>(3, Block(8, 8)), nn::Linear<float>(8, 3)}; };
  const std::vector<shard::wrap_policy> policies{
      shard::wrap_none{}, shard::wrap_types<Block>{}, shard::wrap_names{{"1.layers.1", "2"}},
      shard::wrap_min_params{48}, shard::wrap_any{shard::wrap_names{{"2"}}, shard::wrap_min_params{200}}};
  for (const auto& wrap : policies) {
    Mlp shape = mlp();
    const auto walked = plan::describe_model(shape, wrap);
    std::vector<std::size_t> engine;
    comm::launch(1, [&](comm::ThreadComm& c) {
      Mlp m = mlp();
      auto sharded = shard::fully_shard(m, c, shard::FullShard{}, {.wrap = wrap});
      for (const auto& u : sharded.units()) engine.push_back(u.numel());
    });
    CHECK(walked.units == engine);
  }
  // Each parameter starts at a multiple of 16 elements. The root keeps the outer
  // Linears: 40 weights, the bias at 48, 24 weights at 64, 3 biases at 96: 99.
  Mlp shape = mlp();
  CHECK(plan::describe_model(shape, shard::wrap_names{{"1.layers.0", "1.layers.1", "1.layers.2"}}).units ==
        std::vector<std::size_t>{99, 64 + 8, 64 + 8, 64 + 8});
}

namespace {
// The FSDP article's scenario: a 6e9-parameter transformer (28 blocks of hidden size
// 4096, GPT-J's shape), 4 ranks, Adam, one sequence of 2048 tokens per rank.
plan::model_desc article_model(dtype activations) {
  return plan::transformer({.parameters = 6e9, .layers = 28, .hidden = 4096, .heads = 16, .seq = 2048, .batch = 1},
                           activations);
}
plan::rank_plan article(plan::strategy s, plan::precision p) {
  return plan::make_plan(article_model(p.compute), {.strategy = s, .world = 4, .prefetch = 1, .precision = p});
}
constexpr std::size_t root = 6'000'000'000 - 28 * std::size_t(12 * 4096 * 4096);  // embeddings and head
constexpr std::size_t block = 12 * 4096 * 4096;
}  // namespace

TEST_CASE("the article's scenario in fp32, by hand", "[plan][article]") {
  CHECK(root == 362'855'424);
  CHECK(article_model(dtype::f32).units == [] {
    std::vector<std::size_t> u{root};
    u.insert(u.end(), 28, block);
    return u;
  }());
  // Every unit divides by 4: no padding, so ΣP = 6e9 and a shard is 1.5e9 parameters.
  const plan::precision fp32{};
  auto ddp = article(plan::strategy::no_shard, fp32);
  CHECK(ddp.memory.parameters == 24'000'000'000);  // 6e9 × 4 B, not the article's 12 GB
  CHECK(ddp.memory.gradients == 24'000'000'000);
  CHECK(ddp.memory.optimizer_state == 48'000'000'000);  // two fp32 moments
  CHECK(ddp.memory.gathered_parameters == 0);
  const double loss = 2 * 0.75 * 8;  // train_step's global-mean loss: one all-reduce of two floats
  CHECK(ddp.sent.total() == 2 * 0.75 * 24e9 + loss);  // all-reduce: 2(W-1)/W of the gradients

  auto zero1 = article(plan::strategy::shard_optimizer, fp32);
  CHECK(zero1.memory.parameters == 24'000'000'000);
  CHECK(zero1.memory.gradients == 24'000'000'000 + 6'000'000'000);  // full local + the reduced quarter
  CHECK(zero1.memory.optimizer_state == 12'000'000'000);            // ZeRO-1 shards only this
  CHECK(zero1.sent.total() == 0.75 * 24e9 + 0.75 * 24e9 + loss);    // reduce-scatter, then all-gather the update

  // ZeRO-2 (ShardGradOp): sharded at rest, but every unit gathered from forward to backward.
  const std::size_t full_grads = 4 * (root + 2 * block);  // the root's and two adjacent blocks' full gradients
  auto zero2 = article(plan::strategy::shard_grad_op, fp32);
  CHECK(zero2.memory.parameters == 6'000'000'000);
  CHECK(zero2.memory.gradients == 6'000'000'000 + full_grads);
  CHECK(full_grads == 3'062'034'432);
  CHECK(zero2.memory.optimizer_state == 12'000'000'000);  // sharded too: ZeRO-2 shards the optimizer state
  CHECK(zero2.memory.gathered_parameters == 24'000'000'000);
  CHECK(zero2.sent.total() == 0.75 * 24e9 + 0.75 * 24e9 + loss);

  auto fsdp = article(plan::strategy::full_shard, fp32);
  CHECK(fsdp.memory.parameters == 6'000'000'000);
  CHECK(fsdp.memory.gradients == 9'062'034'432);
  CHECK(fsdp.memory.optimizer_state == 12'000'000'000);
  CHECK(fsdp.memory.gathered_parameters == 4 * (root + 2 * block));  // the root, the running block, the prefetched one
  CHECK(fsdp.memory.comm_scratch == 0);
  CHECK(fsdp.sent.all_gather == 0.75 * 4 * (2 * 6e9 - double(root)));  // blocks gathered twice, the root once
  CHECK(fsdp.sent.reduce_scatter == 0.75 * 24e9);
  // Activations: 28 layers × 2048 × 4096 × (34 + 5·16·2048/4096) bytes in 16 bits, twice that in fp32.
  CHECK(fsdp.memory.activations == 2 * std::size_t(28) * 2048 * 4096 * 74);
  CHECK(fsdp.memory.total() == 6'000'000'000 + 9'062'034'432 + 12'000'000'000 + 3'062'034'432 + 34'762'391'552);
}

TEST_CASE("the article's scenario in bf16 mixed precision, by hand", "[plan][article]") {
  // Gathers, reductions and compute in bf16; master weights, gradient shards and Adam in fp32.
  const auto bf16 = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16});
  auto ddp = article(plan::strategy::no_shard, bf16);
  CHECK(ddp.memory.parameters == 24'000'000'000);           // fp32 master
  CHECK(ddp.memory.gathered_parameters == 12'000'000'000);  // the bf16 copy layers read
  CHECK(ddp.memory.gradients == 12'000'000'000);
  CHECK(ddp.memory.optimizer_state == 48'000'000'000);
  CHECK(ddp.memory.total() - ddp.memory.activations == 16 * std::size_t(6'000'000'000));  // 16 B per parameter
  CHECK(ddp.sent.total() == 2 * 0.75 * 12e9 + 2 * 0.75 * 8);  // and the global loss's two floats

  auto zero1 = article(plan::strategy::shard_optimizer, bf16);
  CHECK(zero1.memory.parameters == 6'000'000'000 + 3'000'000'000);  // fp32 master quarter (ZeRO's P_os) and its bf16 copy
  CHECK(zero1.memory.gathered_parameters == 12'000'000'000);        // the full bf16 values layers read
  CHECK(zero1.memory.gradients == 12'000'000'000 + 6'000'000'000);  // bf16 full, fp32 reduced quarter
  CHECK(zero1.memory.comm_scratch == root / 2);  // the largest unit's quarter, reduced in bf16 (2 B × root / 4)
  CHECK(zero1.sent.reduce_scatter == 0.75 * 12e9);
  CHECK(zero1.sent.all_gather == 0.75 * 12e9);  // the updated quarters go out in bf16

  auto zero2 = article(plan::strategy::shard_grad_op, bf16);
  CHECK(zero2.memory.parameters == 6'000'000'000 + 3'000'000'000);  // fp32 master shard and its bf16 copy
  CHECK(zero2.memory.gradients == 6'000'000'000 + 2 * (root + 2 * block));
  CHECK(zero2.memory.gathered_parameters == 12'000'000'000);
  CHECK(zero2.memory.comm_scratch == root / 2);  // the root's gradient shard, reduced in bf16 (2 B × root / 4)

  auto fsdp = article(plan::strategy::full_shard, bf16);
  CHECK(fsdp.memory.parameters == 9'000'000'000);
  CHECK(fsdp.memory.gathered_parameters == 2 * (root + 2 * block));
  CHECK(fsdp.memory.comm_scratch == root / 2);  // gathers send the bf16 shard itself: only reductions need scratch
  CHECK(fsdp.memory.activations == std::size_t(28) * 2048 * 4096 * 74);
  CHECK(fsdp.sent.all_gather == 0.75 * 2 * (2 * 6e9 - double(root)));
  CHECK(fsdp.sent.reduce_scatter == 0.75 * 12e9);
}

TEST_CASE("HybridShard shards over its group and all-reduces the shard across groups", "[plan][hybrid]") {
  plan::model_desc d{.units = {16, 64, 64}};
  auto h = plan::make_plan(d, {.strategy = plan::strategy::hybrid_shard, .world = 8, .group = 2, .optimizer_bytes = 0});
  CHECK(h.memory.parameters == 4 * 144 / 2);
  CHECK(h.sent.all_gather == 0.5 * 4 * (2 * 144 - 16));
  CHECK(h.sent.all_reduce == 2 * 0.75 * 4 * 144 / 2 + 2 * 0.875 * 8);  // 4 replicas of a 72-element shard; the loss
  CHECK(h.sent.exposed == h.sent.all_reduce);
  CHECK_THROWS_WITH(plan::make_plan(d, {.strategy = plan::strategy::hybrid_shard, .world = 8, .group = 3}),
                    Catch::Contains("group size 3 must divide the world size 8"));
  CHECK_THROWS_WITH(plan::transformer({.parameters = 1e6, .layers = 2, .hidden = 512, .seq = 8}),
                    Catch::Contains("more than the 1e+06 given"));
}

TEST_CASE("the chooser keeps what fits and ranks it by predicted step time", "[plan][chooser]") {
  const auto d = article_model(dtype::bf16);
  const plan::setup base{.world = 4,
                         .precision = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16})};
  // 50 GB: only FullShard (47.6 GB with activations, the bf16 copy of its shard included) fits.
  auto tight = plan::choose(d, base, {.memory_bytes = 50e9});
  REQUIRE(tight.size() == 5);  // four strategies and HybridShard in groups of 2
  // A base carrying a policy would give every candidate that policy under another name.
  plan::setup with_policy = base;
  with_policy.policy = shard::ShardGradOp{}.policy();
  CHECK_THROWS_WITH(plan::choose(d, with_policy, {.memory_bytes = 50e9}),
                    Catch::Contains("plan::choose: base.policy is set, and a set policy overrides every candidate"));
  CHECK(tight[0].config.strategy == plan::strategy::full_shard);
  CHECK(tight[0].fits);
  CHECK_THAT(tight[0].why, Catch::StartsWith("FullShard (ZeRO-3/FSDP) fits in 47.6 GB of 50.0 GB"));
  for (std::size_t i = 1; i < 4; ++i) {
    CHECK(!tight[i].fits);
    CHECK_THAT(tight[i].why, Catch::Contains("does not fit"));
    CHECK(tight[i].plan.memory.total() >= tight[i - 1].plan.memory.total());
  }
  // bf16 compute under NoShard: the engine refuses it, so it comes last, whatever it needs.
  CHECK(tight[4].config.strategy == plan::strategy::no_shard);
  CHECK(!tight[4].runs);
  CHECK_THAT(tight[4].why, Catch::StartsWith("NoShard (DDP) cannot run: BF16 compute keeps fp32 masters"));
  // Unlimited memory, a slow link (1 GB/s), instant compute: step time is bytes sent.
  // ZeRO-2's gather + reduce-scatter and ZeRO-1's reduce-scatter + bf16 all-gather of
  // its updated quarters send 18 GB each (ties go to the smaller memory: ZeRO-2, then
  // ZeRO-1); FullShard gathers again in backward (26.5 GB); HybridShard all-reduces fp32
  // shards across its 2 replicas (17.6 + 12 GB); NoShard would fit but cannot run.
  auto slow = plan::choose(d, base, {.memory_bytes = 1e15, .link_bytes_per_s = 1e9, .flops_per_s = 1e30});
  std::vector<plan::strategy> order;
  for (const auto& c : slow) order.push_back(c.config.strategy);
  CHECK(order == std::vector<plan::strategy>{plan::strategy::shard_grad_op, plan::strategy::shard_optimizer,
                                             plan::strategy::full_shard, plan::strategy::hybrid_shard,
                                             plan::strategy::no_shard});
  CHECK(slow[0].step_s == Approx(18.0));
  CHECK(slow[1].step_s == Approx(18.0));
  CHECK(slow[2].step_s == Approx(0.75 * 2 * (2 * 6e9 - double(root)) / 1e9 + 9.0));
  CHECK_THAT(slow[0].why, Catch::Contains("communication-bound"));
  CHECK(!slow[4].runs);

  // No FLOPs: no compute time to weigh, which would call every setup communication-bound.
  auto no_flops = d;
  no_flops.flops = 0;
  CHECK_THROWS_WITH(plan::choose(no_flops, base, {}), Catch::Contains("plan::choose: model_desc.flops is 0"));
}

// Gradient accumulation in the chooser: a step is every micro-batch's compute, and what the
// step sends depends on how often it gathers and reduces. ZeRO-2 (the article's model, four
// ranks, bf16, a 1 GB/s link, instant compute) gathers 9 GB and reduce-scatters 9 GB per
// micro-batch; no_sync reduces once per step; kept after backward, it gathers once.
TEST_CASE("accumulation: the chooser weighs every micro-batch's compute against the step's traffic",
          "[plan][chooser][accumulation]") {
  const auto d = article_model(dtype::bf16);
  plan::setup base{.world = 4, .precision = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16})};
  const auto zero2 = [&](const plan::setup& s, const plan::machine& mc) {
    for (const auto& c : plan::choose(d, s, mc))
      if (c.config.strategy == plan::strategy::shard_grad_op) return c;
    FAIL("no ShardGradOp candidate");
    return plan::choice{};
  };
  const plan::machine slow{.memory_bytes = 1e15, .link_bytes_per_s = 1e9, .flops_per_s = 1e30};
  const double one_micro_batch = zero2(base, {}).compute_s;
  base.accumulation.micro_batches = 4;
  CHECK(zero2(base, {}).compute_s == Approx(4 * one_micro_batch).epsilon(1e-12));
  // and train_step's all-reduces of the loss (8 bytes) and of the ranks' counts and options (96)
  const double scalars = 2 * 0.75 * (8 + 96) / 1e9;
  const auto each = zero2(base, slow);
  CHECK(each.step_s == Approx(4 * 18.0 + scalars).epsilon(1e-12));
  base.accumulation.no_sync = true;
  const auto once = zero2(base, slow);
  CHECK(once.step_s == Approx(4 * 9.0 + 9.0 + scalars).epsilon(1e-12));
  // every unit's full bf16 gradients held from its first backward to the last: 2 x 6e9 bytes
  // beside the fp32 quarter the optimizer steps
  CHECK(once.plan.memory.gradients == 4 * std::size_t(1'500'000'000) + 2 * std::size_t(6'000'000'000));
  CHECK(once.plan.memory.gradients > each.plan.memory.gradients);
  base.accumulation.keep_after_backward = true;
  CHECK(zero2(base, slow).step_s == Approx(9.0 + 9.0 + scalars).epsilon(1e-12));
  CHECK(zero2(base, slow).plan.memory.gathered_parameters == 2 * std::size_t(6'000'000'000));
  // The ZeRO paper's count: no_sync holds every gradient unreduced, kept units every parameter
  // (one micro-batch has no micro-batch before the last: the flags change nothing)
  const auto states = [](shard::policy p, plan::accumulation acc) { return plan::zero_model_states(p, 4, 1e9, 12, acc); };
  const auto zero3 = shard::FullShard{}.policy();
  CHECK(states(zero3, {.micro_batches = 4}).total() == Approx(0.5e9 + 0.5e9 + 3e9).epsilon(1e-12));
  CHECK(states(zero3, {.micro_batches = 4, .no_sync = true}).gradients == Approx(2e9).epsilon(1e-12));
  CHECK(states(zero3, {.micro_batches = 4, .keep_after_backward = true}).parameters == Approx(2e9).epsilon(1e-12));
  CHECK(states(zero3, {.micro_batches = 1, .no_sync = true, .keep_after_backward = true}).total() ==
        Approx(4e9).epsilon(1e-12));
  CHECK(states(shard::ShardGradOp{}.policy(), {.micro_batches = 2, .no_sync = true}).gradients ==
        Approx(2e9).epsilon(1e-12));
}

// A step's batch split by the chooser: the article's model at 8 sequences per rank and step
// (one sequence's activations are 17.4 GB in bf16), each strategy at the fewest micro-batches
// that fit. Each choice is make_plan's at its micro-batch, its compute the whole step's, and
// the next split down (fewer, larger micro-batches) does not fit.
TEST_CASE("the chooser splits a step's batch into the fewest micro-batches that fit",
          "[plan][chooser][accumulation]") {
  const auto at = [](long batch) {
    return plan::transformer({.parameters = 6e9, .layers = 28, .hidden = 4096, .heads = 16, .seq = 2048,
                              .batch = batch},
                             dtype::bf16);
  };
  const plan::setup base{.world = 4,
                         .precision = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16})};
  const auto splits_of = [&](long batch, const plan::machine& mc) {
    const auto got = plan::choose_micro_batches(at, batch, base, mc);
    std::map<plan::strategy, int> k;
    for (const auto& c : got) {
      const int K = c.config.accumulation.micro_batches;
      INFO(c.why);
      k[c.config.strategy] = K;
      REQUIRE(batch % K == 0);
      if (!c.runs) {
        CHECK(K == 1);
        continue;
      }
      const auto made = plan::make_plan(at(batch / K), c.config);
      CHECK(c.plan.memory.total() == made.memory.total());
      CHECK(c.plan.sent.total() == made.sent.total());
      CHECK(c.compute_s == Approx(at(batch).flops / mc.flops_per_s).epsilon(1e-12));
      CHECK(c.fits == (double(made.memory.total()) <= mc.memory_bytes));
      int fewer = K - 1;  // the next divisor down
      while (fewer > 0 && batch % fewer != 0) --fewer;
      if (fewer > 0 && c.fits) {
        plan::setup larger = c.config;
        larger.accumulation.micro_batches = fewer;
        CHECK(double(plan::make_plan(at(batch / fewer), larger).memory.total()) > mc.memory_bytes);
      }
      if (!c.fits) CHECK(K == batch);  // listed at its least memory
    }
    return std::pair{got, k};
  };
  using plan::strategy;
  const auto [roomy, k80] = splits_of(8, {.memory_bytes = 80e9});
  CHECK(k80 == std::map<strategy, int>{{strategy::full_shard, 4}, {strategy::shard_grad_op, 4},
                                       {strategy::shard_optimizer, 8}, {strategy::hybrid_shard, 8},
                                       {strategy::no_shard, 1}});
  // Compute-bound alike (the whole step's FLOPs at 100 TFLOP/s): fewer bytes sent first.
  CHECK_THAT(roomy[0].why, Catch::StartsWith("ShardGradOp (ZeRO-2), 4 micro-batches of 2 sequences fits in 75.5 GB of "
                                             "80.0 GB"));
  CHECK_THAT(roomy[1].why, Catch::StartsWith("FullShard (ZeRO-3/FSDP), 4 micro-batches of 2 sequences fits"));
  for (std::size_t i = 0; i < 4; ++i) CHECK(roomy[i].fits);  // ZeRO-1 and HSDP too, at one sequence a micro-batch
  CHECK_THAT(roomy[4].why, Catch::StartsWith("NoShard (DDP), 1 micro-batch of 8 sequences cannot run"));
  // 50 GB: FullShard alone fits, at one sequence a micro-batch; the others at their least.
  const auto [tight, k50] = splits_of(8, {.memory_bytes = 50e9});
  CHECK(tight[0].fits);
  CHECK(k50.at(strategy::full_shard) == 8);
  CHECK(!tight[1].fits);
  // Six sequences: splits of 1, 2, 3 and 6; at 80 GB FullShard takes three of two.
  CHECK(splits_of(6, {.memory_bytes = 80e9}).second.at(strategy::full_shard) == 3);
  // Memory enough for the whole step at once: one micro-batch each.
  const auto [ample, k1] = splits_of(8, {.memory_bytes = 1e15});
  for (const auto& [st, K] : k1) CHECK(K == 1);
  CHECK_THAT(ample[0].why, Catch::Contains(", 1 micro-batch of 8 sequences fits"));
  CHECK_THROWS_WITH(plan::choose_micro_batches(at, 0, base, {}),
                    Catch::Contains("plan::choose_micro_batches: the step's batch is 0"));
}

// reshard_to in the planner's outputs beside the replay (tested against the ledger above):
// the chooser's candidates and labels, the ZeRO paper's model states, and a size that does
// not divide the shard group.
TEST_CASE("reshard_to: the chooser's candidates and labels, the model states, a size that does not divide",
          "[plan][chooser][reshard]") {
  const auto d = article_model(dtype::bf16);
  const plan::setup base{.world = 16,
                         .reshard_to = 4,
                         .precision = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16})};
  std::vector<std::string> labels;
  for (const auto& c : plan::choose(d, base, {.memory_bytes = 1e15})) labels.push_back(plan::label(c.config));
  std::sort(labels.begin(), labels.end());
  // HybridShard's groups of 2 cannot reshard to 4; in groups of 4 it is their own size (FullShard's rule)
  CHECK(labels == std::vector<std::string>{"FullShard (ZeRO-3/FSDP, reshard to 4)",
                                           "HybridShard (HSDP, groups of 4)",
                                           "HybridShard (HSDP, groups of 8, reshard to 4)",
                                           "NoShard (DDP)",
                                           "ShardGradOp (ZeRO-2)",
                                           "ShardOptimizer (ZeRO-1)"});
  // The backward's all-gathers of the 28 blocks go within groups of 4: 3/4 of their bf16 values.
  const auto p = plan::make_plan(d, base);
  const double blocks = 28.0 * 12 * 4096 * 4096;
  CHECK(p.sent.within_reshard_groups == Approx(0.75 * 2 * blocks).epsilon(1e-12));
  // The model states: the shard and, where units keep a part, 1/R of the parameters at the peak.
  const double psi = 6e9;
  CHECK(plan::zero_model_states(shard::FullShard{.reshard_to = 8}.policy(), 64, psi).parameters ==
        Approx(2 * psi / 64 + 2 * psi / 8).epsilon(1e-12));
  CHECK(plan::zero_model_states(shard::FullShard{.reshard_to = 1}.policy(), 64, psi).parameters == 2 * psi);
  CHECK(plan::zero_model_states(shard::FullShard{.reshard_to = 64}.policy(), 64, psi).parameters == 2 * psi / 64);
  plan::setup indivisible = base;
  indivisible.reshard_to = 3;
  CHECK_THROWS_WITH(plan::make_plan(d, indivisible), Catch::Contains("plan: reshard_to 3 must divide the shard "
                                                                     "group's 16 ranks"));
}

// Two levels of links: collectives whose groups lie within a node of 8 ranks (HybridShard's
// shard groups of 8, reshard groups of 8) send over the node's links, the rest across nodes.
TEST_CASE("nodes: what collectives within a node send, and the chooser timing it at the node's links",
          "[plan][chooser][nodes]") {
  const auto d = article_model(dtype::bf16);
  const auto bf16 = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16});
  const plan::setup two_nodes{.world = 16, .node_size = 8, .precision = bf16};
  const auto plan_of = [&](plan::strategy st, int group, int reshard_to, int world) {
    plan::setup s = two_nodes;
    s.strategy = st;
    s.group = group;
    s.reshard_to = reshard_to;
    s.world = world;
    return plan::make_plan(d, s).sent;
  };
  const auto full = plan_of(plan::strategy::full_shard, 0, 0, 16);
  CHECK(full.within_node == 0);  // every collective spans both nodes
  const auto resharded = plan_of(plan::strategy::full_shard, 0, 8, 16);
  CHECK(resharded.within_node == resharded.within_reshard_groups);
  CHECK(resharded.within_node > 0);
  const auto hybrid = plan_of(plan::strategy::hybrid_shard, 8, 0, 16);
  CHECK(hybrid.within_node == hybrid.all_gather + hybrid.reduce_scatter);  // the shard group is a node
  CHECK(hybrid.exposed_within_node == 0);  // the replica all-reduce and the loss's cross the nodes
  CHECK(hybrid.exposed == hybrid.all_reduce);
  const auto one_node = plan_of(plan::strategy::full_shard, 0, 0, 8);
  CHECK(one_node.within_node == one_node.total());
  CHECK(one_node.exposed_within_node == one_node.exposed);
  // A slow network (1 GB/s), fast nodes (1 TB/s), no memory limit, instant compute: HybridShard
  // in groups of a node sends least across nodes and comes first.
  const plan::machine mc{.memory_bytes = 1e15, .link_bytes_per_s = 1e9, .flops_per_s = 1e30, .node_size = 8,
                         .node_link_bytes_per_s = 1e12};
  const auto ranked = plan::choose(d, {.world = 16, .precision = bf16}, mc);
  REQUIRE(!ranked.empty());
  CHECK(plan::label(ranked[0].config) == "HybridShard (HSDP, groups of 8)");
  const auto& t = ranked[0].plan.sent;
  CHECK(ranked[0].comm_s == Approx((t.total() - t.within_node) / 1e9 + t.within_node / 1e12).epsilon(1e-12));
  CHECK_THAT(ranked[0].why, Catch::Contains("within nodes)"));
  // Told the nodes, the chooser also tries FullShard resharded to a node (HybridShard's groups
  // of 2 and 4 lie within one, of 8 are one: none spans several): backward's gathers stay
  // within the nodes, and it sends less across them than FullShard.
  std::vector<std::string> labels;
  for (const auto& c : ranked) labels.push_back(plan::label(c.config));
  CHECK(std::count(labels.begin(), labels.end(), "FullShard (ZeRO-3/FSDP, reshard to 8)") == 1);
  CHECK(std::count_if(labels.begin(), labels.end(),
                      [](const std::string& l) { return l.find("reshard to") != std::string::npos; }) == 1);
  const auto by_label = [&](std::string_view l) {
    const auto is = [&](const plan::choice& c) { return plan::label(c.config) == l; };
    return *std::find_if(ranked.begin(), ranked.end(), is);
  };
  const auto to_node = by_label("FullShard (ZeRO-3/FSDP, reshard to 8)"), whole = by_label("FullShard (ZeRO-3/FSDP)");
  CHECK(to_node.plan.sent.within_reshard_groups == resharded.within_reshard_groups);
  const auto across = [](const plan::choice& c) { return c.plan.sent.total() - c.plan.sent.within_node; };
  CHECK(across(to_node) < across(whole));
  CHECK(to_node.step_s < whole.step_s);
  // At W = 32, HybridShard in groups of 16 (two nodes each) is resharded to a node too.
  const auto wider = plan::choose(d, {.world = 32, .precision = bf16}, mc, {16});
  labels.clear();
  for (const auto& c : wider) labels.push_back(plan::label(c.config));
  CHECK(std::count(labels.begin(), labels.end(), "HybridShard (HSDP, groups of 16, reshard to 8)") == 1);
  CHECK(std::count(labels.begin(), labels.end(), "FullShard (ZeRO-3/FSDP, reshard to 8)") == 1);
  // Given a reshard_to, or no nodes, nothing more.
  for (const auto& c : plan::choose(d, {.world = 16, .reshard_to = 4, .precision = bf16}, mc))
    CHECK(c.config.reshard_to == 4);
  // A node size that neither divides the world nor holds it, and nodes without a bandwidth.
  plan::setup ragged = two_nodes;
  ragged.world = 12;
  CHECK_THROWS_WITH(plan::make_plan(d, ragged), Catch::Contains("plan: node_size 8 must be 0 (not known), hold the 12 "
                                                                "ranks or divide their number"));
  CHECK_THROWS_WITH(plan::choose(d, {.world = 16, .precision = bf16}, {.node_size = 8}),
                    Catch::Contains("plan::choose: nodes of 8 ranks need their link bandwidth"));
}

// engine_refusal mirrors ShardedModel's constructor: what one refuses, the other does too.
TEST_CASE("the planner refuses the setups the engine refuses", "[plan][chooser]") {
  const auto bf16 = [](dtype reduce) { return plan::precision::param_layers({.param = dtype::bf16, .reduce = reduce}); };
  const auto f16 = plan::precision::param_layers({.param = dtype::f16, .reduce = dtype::bf16});
  CHECK_THAT(plan::engine_refusal({.strategy = plan::strategy::no_shard, .world = 4, .precision = bf16(dtype::bf16)}),
             Catch::Contains("BF16 compute keeps fp32 masters beside the values"));
  CHECK_THAT(plan::engine_refusal({.strategy = plan::strategy::full_shard, .world = 4, .precision = f16}),
             Catch::Contains("with F16 compute the reduction is in F32 or F16, not BF16"));
  for (plan::strategy s : {plan::strategy::full_shard, plan::strategy::shard_grad_op, plan::strategy::shard_optimizer})
    for (dtype r : {dtype::f32, dtype::bf16}) CHECK(plan::engine_refusal({.strategy = s, .world = 4, .precision = bf16(r)}).empty());
  for (plan::strategy s : plan::all_strategies)  // fp32 layers: any strategy, any 16-bit communication
    CHECK(plan::engine_refusal({.strategy = s, .world = 4, .group = 2,
                                .precision = plan::precision::fp32_layers({.param = dtype::bf16, .reduce = dtype::f16})})
              .empty());
}

// The ZeRO paper's example (Rajbhandari et al. 2020, fig. 1): a 7.5B-parameter model on
// 64 GPUs with mixed-precision Adam (K = 12) holds 120, 31.4, 16.6 and 1.9 GB of model
// states per GPU under the baseline, P_os, P_os+g and P_os+g+p. The strategies' policies
// give the same arithmetic: 2Ψ + 2Ψ + KΨ, each term / N_d where it is sharded at the peak.
TEST_CASE("model states per rank reproduce the ZeRO paper's 7.5B example", "[plan][zero]") {
  const double psi = 7.5e9;
  const auto gb = [&](plan::strategy s) { return plan::zero_model_states(plan::policy_of(s), 64, psi).total() / 1e9; };
  CHECK(gb(plan::strategy::no_shard) == Approx(120.0).epsilon(1e-12));
  CHECK(gb(plan::strategy::shard_optimizer) == Approx(2 * 7.5 + 2 * 7.5 + 12 * 7.5 / 64).epsilon(1e-12));  // 31.41
  CHECK(gb(plan::strategy::shard_grad_op) == Approx(2 * 7.5 + (2 + 12) * 7.5 / 64).epsilon(1e-12));        // 16.64
  CHECK(gb(plan::strategy::full_shard) == Approx(16 * 7.5 / 64).epsilon(1e-12));                           // 1.875
  // HSDP in groups of 8: ZeRO-3 arithmetic over 8 ranks.
  CHECK(plan::zero_model_states(plan::policy_of(plan::strategy::hybrid_shard, 8), 64, psi).total() ==
        Approx(16 * psi / 8).epsilon(1e-12));
  // And the engine's own ZeRO-1 under 16-bit compute: the fp32 master is a 1/64 slice, not a full copy.
  const auto d = plan::transformer({.parameters = psi, .layers = 32, .hidden = 4096, .heads = 32, .seq = 1024});
  const auto zero1 = plan::make_plan(d, {.strategy = plan::strategy::shard_optimizer, .world = 64,
                                        .precision = plan::precision::param_layers({.param = dtype::bf16,
                                                                                    .reduce = dtype::bf16})});
  const double padded = double(zero1.memory.gathered_parameters) / 2;  // the bf16 full values: Ψ padded to 64
  CHECK(double(zero1.memory.parameters) == Approx((4 + 2) * padded / 64).epsilon(1e-12));
  CHECK(double(zero1.memory.optimizer_state) == Approx(8 * padded / 64).epsilon(1e-12));
  CHECK(padded >= psi);
  CHECK(padded < psi + 64 * 33);  // at most 63 padding elements per unit
}

// The presets' parameter counts, tensor by tensor as Hugging Face's models hold them
// (the published totals: gpt2 124,439,808 with the head tied, gpt2-medium 354,823,168,
// Llama-2-7b 6,738,415,616, Llama-2-70b 68,976,648,192 with 8 kv heads).
TEST_CASE("decoder presets count their parameters from the architecture", "[plan][presets]") {
  const auto& gpt2 = plan::decoder_preset("gpt2-124m");
  // A GPT-2 block: c_attn h×3h + 3h, c_proj h² + h, c_fc h×4h + 4h, c_proj 4h×h + h, two LayerNorms 2h each.
  const std::size_t h = 768;
  CHECK(plan::block_parameters(gpt2) == 12 * h * h + 13 * h);
  // wte 50257×768, wpe 1024×768, ln_f; lm_head is wte.
  CHECK(plan::root_parameters(gpt2) == 50257 * h + 1024 * h + 2 * h);
  CHECK(plan::parameters(gpt2) == 124'439'808);
  CHECK(plan::parameters(plan::decoder_preset("gpt2-350m")) == 354'823'168);

  // LLaMA-2-7B: q, k, v, o 4096², gate, up, down 4096×11008, two RMSNorms; embed and lm_head 32000×4096.
  const auto& l7 = plan::decoder_preset("llama-7b");
  CHECK(plan::block_parameters(l7) == 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096);
  CHECK(plan::parameters(l7) == 6'738'415'616);
  // LLaMA-2-70B: k and v are 8192 × (8 kv heads × 128).
  const auto& l70 = plan::decoder_preset("llama-70b");
  CHECK(plan::block_parameters(l70) == std::size_t(2) * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * std::size_t(28672) +
                                           2 * 8192);
  CHECK(plan::parameters(l70) == 68'976'648'192);
  auto untied = gpt2;
  untied.tied = false;
  CHECK(plan::parameters(untied) - plan::parameters(gpt2) == 50257 * h);  // a tied head is counted once
  // FLOPs count the weights a token multiplies: not wpe, nor an untied embedding (the head is multiplied).
  CHECK(plan::multiplied_parameters(gpt2) == 124'439'808 - 1024 * h);
  CHECK(plan::multiplied_parameters(untied) == plan::multiplied_parameters(gpt2));
  CHECK(plan::multiplied_parameters(l7) == 6'738'415'616 - 32000 * 4096);
  CHECK(plan::decoder(l7, 2, 1024).flops == 6.0 * double(6'738'415'616 - 32000 * 4096) * 2048 +
                                                12.0 * 32 * 4096 * 1024 * 2048);

  const auto d = plan::decoder(l70, 1);
  CHECK(d.units.size() == 81);
  CHECK(d.parameters() == 68'976'648'192);
  CHECK(d.units[1] == plan::block_parameters(l70));
  // Seq 4096 in bf16: per block and token 6·8192 + 2·1024 (8 kv heads of 128) + 3·28672
  // elements, 2 floats of rstd and 64 · 4096 attention weights; outside, 2·32000 +
  // 2·8192 + 2·28672 elements and 8 bytes of id.
  const std::size_t tokens = 4096, outside = tokens * ((2 * 32000 + 2 * 8192 + 2 * 28672) * 2 + 8);
  const std::size_t linear = tokens * ((6 * 8192 + 2 * 1024 + 3 * 28672) * 2 + 2 * 4);
  CHECK(d.activation_bytes == 80 * (linear + tokens * 64 * 4096 * 2) + outside);
  // The device's fused attention: no 64 x 4096 x 4096 weights, 64 x 4096 floats of log-sum-exp per layer.
  CHECK(plan::decoder(l70, 1, 0, dtype::bf16, true).activation_bytes == 80 * (linear + tokens * 64 * 4) + outside);
  CHECK_THROWS_WITH(plan::decoder_preset("gpt3"), Catch::Contains("no model preset 'gpt3' (known: gpt2-124m, "));
}

// A Hugging Face config.json plans the model the library builds from it: plan::decoder's
// units are fully_shard's flat units, alignment gaps included (width 40, MLP width 100,
// 30 positions and a vocabulary of 97 leave gaps after norms, biases and embeddings);
// parameters(m) is the model's count; a frozen prefix's ranges are where the layout puts
// the embeddings and the first block; LLaMA's head_dim (q 48 wide for hidden 40),
// attention_bias, mlp_bias, GQA, tied and untied heads included. FLOPs take attention's
// width from q. Llama 3 8B's, TinyLlama's and Llama 3.2 1B's published configs give their published
// parameter counts.
TEST_CASE("a Hugging Face config plans the model the library builds from it, alignment gaps included",
          "[plan][presets][hf]") {
  test_support::temp_dir dir("plan_hf_config");
  const auto write = [&](std::string_view name, const nlohmann::json& j) {
    const auto path = dir.path / cat(name, ".json");
    std::ofstream(path) << j.dump();
    return path;
  };
  const auto compare = [](const plan::decoder_shape& m, auto& model, const auto& wrap, std::string_view root_embeddings,
                          std::string_view first_block) {
    INFO(m.name);
    const plan::model_desc planned = plan::decoder(m, 2, 8, dtype::f32);
    CHECK(planned.units == plan::describe_model(model, wrap).units);
    CHECK(plan::parameters(m) == nn::parameter_count(model));
    CHECK(planned.flops == 6.0 * double(plan::multiplied_parameters(m)) * 16 +
                               12.0 * double(m.layers) * double(m.q_width()) * 8 * 16);
    model.parameters([&](std::string_view name, auto& p) {
      if (name.starts_with(root_embeddings) || name.starts_with(first_block)) p.requires_grad = false;
    });
    const auto walked = plan::describe_model(model, wrap);
    const auto tuned = plan::with_frozen_prefix(planned, m, 1, 2, 8, dtype::f32);
    REQUIRE(walked.frozen.size() == tuned.frozen.size());
    for (std::size_t i = 0; i < tuned.frozen.size(); ++i) {
      INFO("unit " << i);
      CHECK(tuned.frozen[i].all == walked.frozen[i].all);
      if (!tuned.frozen[i].all) CHECK(tuned.frozen[i].ranges == walked.frozen[i].ranges);  // a whole unit is one range
    }
    CHECK(tuned.frozen[1].all);
    CHECK(tuned.frozen[0].ranges.size() == (m.positions > 0 ? 2 : 1));  // GPT-2's wpe after a gap past wte
  };
  const nlohmann::json gpt2 = {{"model_type", "gpt2"}, {"vocab_size", 97}, {"n_positions", 30}, {"n_embd", 40},
                               {"n_layer", 2},         {"n_head", 4},      {"n_inner", 100}};
  for (const bool tied : {true, false}) {
    auto j = gpt2;
    j["tie_word_embeddings"] = tied;
    const auto path = write(tied ? "gpt2_tied" : "gpt2_untied", j);
    const auto m = plan::read_decoder_shape(path, "gpt2-odd");
    CHECK(m.family == plan::family::gpt2);
    CHECK((m.intermediate == 100 && m.positions == 30 && m.seq == 30 && m.tied == tied));
    models::GPT2LMHeadModel<float> model(models::read_hf_config<models::gpt2_config>(path));
    compare(m, model, shard::wrap_types<models::GPT2Block<float>>{}, "transformer.w", "transformer.h.0.");
  }
  const nlohmann::json llama = {{"model_type", "llama"},         {"vocab_size", 97},       {"hidden_size", 40},
                                {"intermediate_size", 100},      {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                                {"num_key_value_heads", 2},      {"head_dim", 12},         {"attention_bias", true},
                                {"mlp_bias", true},              {"max_position_embeddings", 64}};
  for (const bool tied : {true, false}) {
    auto j = llama;
    j["tie_word_embeddings"] = tied;
    if (tied) j.erase("head_dim"), j["attention_bias"] = false;  // 10 a head, biases on the MLP alone
    const auto path = write(tied ? "llama_tied" : "llama_untied", j);
    const auto m = plan::read_decoder_shape(path, "llama-odd");
    CHECK(m.family == plan::family::llama);
    CHECK((m.kv_heads == 2 && m.seq == 64 && m.tied == tied && m.mlp_bias && m.attention_bias == !tied));
    CHECK(m.q_width() == (tied ? 40 : 48));
    models::LlamaForCausalLM<float> model(models::read_hf_config<models::llama_config>(path));
    compare(m, model, shard::wrap_types<models::LlamaDecoderLayer<float>>{}, "model.embed_tokens.", "model.layers.0.");
  }

  // Llama 3 8B (meta-llama/Meta-Llama-3-8B's config.json, the fields the shape reads) and
  // TinyLlama 1.1B: their model cards' 8.03B and 1.1B parameters, exactly (8,030,261,248 and
  // 1,100,048,384 as their safetensors count them).
  const auto llama3 = write("llama3", {{"model_type", "llama"},          {"vocab_size", 128256},
                                       {"hidden_size", 4096},            {"intermediate_size", 14336},
                                       {"num_hidden_layers", 32},        {"num_attention_heads", 32},
                                       {"num_key_value_heads", 8},       {"max_position_embeddings", 8192},
                                       {"rope_theta", 500000.0},         {"tie_word_embeddings", false},
                                       {"rope_scaling", nullptr},        {"hidden_act", "silu"}});
  const auto l3 = plan::read_decoder_shape(llama3, "llama3-8b");
  CHECK(plan::parameters(l3) == 8'030'261'248);
  CHECK(plan::decoder(l3).units[0] == 2 * 128256 * 4096 + 4096);  // no gaps: every size divides by 16
  const auto tiny = write("tinyllama", {{"model_type", "llama"},     {"vocab_size", 32000},
                                        {"hidden_size", 2048},       {"intermediate_size", 5632},
                                        {"num_hidden_layers", 22},   {"num_attention_heads", 32},
                                        {"num_key_value_heads", 4},  {"max_position_embeddings", 2048}});
  CHECK(plan::parameters(plan::read_decoder_shape(tiny, "tinyllama")) == 1'100'048'384);
  // Llama 3.2 1B: the head tied to the embedding, counted once (1.24B).
  const auto l32 = write("llama32", {{"model_type", "llama"},    {"vocab_size", 128256},
                                     {"hidden_size", 2048},      {"intermediate_size", 8192},
                                     {"num_hidden_layers", 16},  {"num_attention_heads", 32},
                                     {"num_key_value_heads", 8}, {"head_dim", 64},
                                     {"max_position_embeddings", 131072}, {"tie_word_embeddings", true},
                                     {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 32.0},
                                                       {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                                                       {"original_max_position_embeddings", 8192}}}});
  CHECK(plan::parameters(plan::read_decoder_shape(l32, "llama3.2-1b")) == 1'235'814'400);
  // The presets are these configs' shapes: gpt2-124m is transformers' GPT2Config().
  const auto gpt2_default = write("gpt2_default", {{"model_type", "gpt2"}});
  CHECK(plan::decoder(plan::read_decoder_shape(gpt2_default, "gpt2")).units ==
        plan::decoder(plan::decoder_preset("gpt2-124m")).units);

  // What it refuses, naming the file.
  const auto mistral = write("mistral", {{"model_type", "mistral"}, {"hidden_size", 4096}});
  CHECK_THROWS_WITH(plan::read_decoder_shape(mistral, "m"),
                    Catch::Contains("mistral.json: model_type \"mistral\" is not one the library builds"));
  const auto untyped = write("untyped", {{"hidden_size", 4096}});
  CHECK_THROWS_WITH(plan::read_decoder_shape(untyped, "u"), Catch::Contains("untyped.json: model_type (none)"));
  const auto relu = write("relu", {{"model_type", "gpt2"}, {"activation_function", "relu"}});
  CHECK_THROWS_WITH(plan::read_decoder_shape(relu, "r"),
                    Catch::Contains("relu.json: gpt2_config: activation_function \"relu\" is not supported"));
  const auto zero = write("zero", {{"model_type", "llama"}, {"num_hidden_layers", 0}});
  CHECK_THROWS_WITH(plan::read_decoder_shape(zero, "z"), Catch::Contains("zero.json: llama_config: vocab_size"));
  CHECK_THROWS_WITH(plan::read_decoder_shape(dir.path / "absent", "a"),
                    Catch::Contains("absent: cannot open the model's config.json"));
  std::ofstream(dir.path / "config.json") << "{\"model_type\": ";
  CHECK_THROWS_WITH(plan::read_decoder_shape(dir.path, "d"), Catch::Contains("config.json: [json.exception.parse_error"));
  // A GPT-2 shape with LLaMA's switches is refused by the shape's own check.
  auto odd = plan::decoder_preset("gpt2-124m");
  odd.mlp_bias = true;
  CHECK_THROWS_WITH(plan::decoder(odd), Catch::Contains("attention_bias and mlp_bias are LLaMA's switches"));
  odd = plan::decoder_preset("gpt2-124m");
  odd.head_dim = 32;
  CHECK_THROWS_WITH(plan::decoder(odd), Catch::Contains("unless a LLaMA's head_dim is given"));
}

// The stored attention weights (Korthikanti's 5·heads·seq² bytes per layer in 16 bits,
// transformer()'s default) are the host layers'; the device's fused attention (nn/cuda/attention.cuh) keeps the
// output (among the 34·seq·hidden) and one float log-sum-exp per (batch, head, query),
// whatever the activations' dtype. The article's shape, 2 sequences per rank.
TEST_CASE("activations: the host layers keep attention's seq x seq weights, the fused attention a log-sum-exp",
          "[plan][activations]") {
  const std::size_t L = 28, s = 2048, h = 4096, a = 16, b = 2;
  for (dtype act : {dtype::bf16, dtype::f32}) {
    INFO(name(act));
    const std::size_t bytes = size_of(act);
    plan::transformer_shape shape{.parameters = 6e9, .layers = 28, .hidden = 4096, .heads = 16, .seq = 2048, .batch = 2};
    const auto host = plan::transformer(shape, act);
    shape.fused_attention = true;
    const auto fused = plan::transformer(shape, act);
    CHECK(host.activation_bytes == L * (s * b * h * 34 + 5 * a * s * s * b) * bytes / 2);
    CHECK(fused.activation_bytes == L * (s * b * h * 34 * bytes / 2 + 4 * a * s * b));
    CHECK(fused.units == host.units);
    CHECK(fused.flops == host.flops);  // the estimate counts no recomputation (the fused backward recomputes scores)
    // What the planner's plans carry: only the activations differ.
    const auto pf = plan::make_plan(fused, {.strategy = plan::strategy::full_shard, .world = 4});
    const auto ph = plan::make_plan(host, {.strategy = plan::strategy::full_shard, .world = 4});
    CHECK(ph.memory.activations - pf.memory.activations == host.activation_bytes - fused.activation_bytes);
  }
}

// Mixed-precision Adam holds 16 bytes a parameter (ZeRO paper, sec. 3.1): 2 (bf16
// parameters) + 2 (bf16 gradients) + 12 (fp32 master, two moments). LLaMA-2-7B's
// model states by that arithmetic, and the plan's DDP at 16 B a parameter exactly.
TEST_CASE("LLaMA-2-7B's model states follow the ZeRO paper's 2 + 2 + 12 bytes", "[plan][presets][zero]") {
  const auto& l7 = plan::decoder_preset("llama-7b");
  const double psi = double(plan::parameters(l7)), n = 64;
  const auto gb = [&](plan::strategy s) { return plan::zero_model_states(plan::policy_of(s), 64, psi).total() / 1e9; };
  CHECK(gb(plan::strategy::no_shard) == Approx(16 * psi / 1e9).epsilon(1e-12));  // 107.81 GB
  CHECK(gb(plan::strategy::no_shard) == Approx(107.814649856).epsilon(1e-12));
  CHECK(gb(plan::strategy::shard_optimizer) == Approx((4 + 12 / n) * psi / 1e9).epsilon(1e-12));  // 28.22
  CHECK(gb(plan::strategy::shard_grad_op) == Approx((2 + 14 / n) * psi / 1e9).epsilon(1e-12));    // 14.95
  CHECK(gb(plan::strategy::full_shard) == Approx(16 / n * psi / 1e9).epsilon(1e-12));             // 1.68

  // Every unit divides by 8 (no padding): DDP in bf16 holds exactly 16 bytes a parameter
  // beside its activations, FullShard at W = 8 its fp32 master and bf16 copy sharded (6 B / 8).
  const auto bf16 = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16});
  const auto d = plan::decoder(l7, 1, 0, dtype::bf16);
  for (std::size_t u : d.units) CHECK(u % 8 == 0);
  const auto ddp = plan::make_plan(d, {.strategy = plan::strategy::no_shard, .world = 8, .precision = bf16});
  CHECK(ddp.memory.total() - ddp.memory.activations == 16 * plan::parameters(l7));
  const auto fsdp = plan::make_plan(d, {.strategy = plan::strategy::full_shard, .world = 8, .precision = bf16});
  CHECK(fsdp.memory.parameters == 6 * plan::parameters(l7) / 8);
  CHECK(fsdp.memory.optimizer_state == 8 * plan::parameters(l7) / 8);
}

// A partial fine-tune of LLaMA-2-7B at W = 8 in bf16 (every unit divides by 8): the
// embeddings and the lower 16 blocks frozen. The trained parameters' optimizer state
// and reduction; the frozen prefix's blocks not gathered again in backward; the
// activations of the 16 trained blocks; the FLOPs without the prefix's backward.
TEST_CASE("a preset with a frozen prefix plans the trained parameters' state and traffic", "[plan][presets][frozen]") {
  const auto& l7 = plan::decoder_preset("llama-7b");
  const auto bf16 = plan::precision::param_layers({.param = dtype::bf16, .reduce = dtype::bf16});
  const auto all = plan::decoder(l7, 1, 0, dtype::bf16, true);
  const auto tuned = plan::with_frozen_prefix(all, l7, 16);
  const std::size_t block = plan::block_parameters(l7), embed = 32000 * 4096, P = plan::parameters(l7);
  const std::size_t trained = P - embed - 16 * block;  // the upper 16 blocks, the final norm, the head
  REQUIRE(tuned.frozen.size() == 33);
  CHECK_FALSE(tuned.frozen[0].all);
  CHECK(tuned.frozen[1].no_backward);
  CHECK(tuned.frozen[16].all);
  CHECK_FALSE(tuned.frozen[17].all);
  // The 16 frozen blocks' (fused attention, bf16): 6·4096 + 2·4096 + 3·11008 elements, 2 floats and 32 of lse a token.
  CHECK(tuned.activation_bytes == all.activation_bytes - std::size_t(16) * 4096 * ((6 * 4096 + 2 * 4096 + 3 * 11008) * 2 + 8 + 4 * 32));
  CHECK(tuned.flops == Approx(all.flops - 4096.0 * (16 * (4.0 * double(block) + 8 * 4096.0 * 4096))).epsilon(1e-12));
  for (auto strategy : {plan::strategy::full_shard, plan::strategy::shard_grad_op, plan::strategy::shard_optimizer}) {
    INFO(plan::name(strategy));
    const auto p = plan::make_plan(tuned, {.strategy = strategy, .world = 8, .precision = bf16});
    const auto q = plan::make_plan(all, {.strategy = strategy, .world = 8, .precision = bf16});
    CHECK(p.memory.parameters == q.memory.parameters);  // masters and their bf16 copies stay
    CHECK(p.sent.reduce_scatter == Approx(7.0 / 8 * 2 * double(P - 16 * block)).epsilon(1e-12));  // the root reduces
    // FullShard gathers every unit in forward and the trained blocks again in backward;
    // ZeRO-2 once; ZeRO-1 refreshes the trained units after the step.
    const double gathered = strategy == plan::strategy::full_shard      ? double(2 * P - all.units[0] - 16 * block)
                            : strategy == plan::strategy::shard_grad_op ? double(P)
                                                                        : double(P - 16 * block);
    CHECK(p.sent.all_gather == Approx(7.0 / 8 * 2 * gathered).epsilon(1e-12));
    // Adam's 8 bytes for each trained element, held once over the ranks; the frozen
    // embedding fills the root's first pieces, so ranks 0-3 hold less, and unset the
    // plan is the fullest rank's.
    std::vector<std::size_t> state;
    for (int r = 0; r < 8; ++r)
      state.push_back(
          plan::make_plan(tuned, {.strategy = strategy, .world = 8, .precision = bf16, .rank = r}).memory.optimizer_state);
    CHECK(std::accumulate(state.begin(), state.end(), std::size_t(0)) == 8 * trained);
    CHECK(p.memory.optimizer_state == *std::max_element(state.begin(), state.end()));
    CHECK(state[0] < state[7]);
    CHECK(state[7] == 8 * (16 * block / 8 + all.units[0] / 8));  // rank 7's piece of the root is the head's
  }
  CHECK_THROWS_WITH(plan::with_frozen_prefix(all, l7, 33), Catch::Contains("llama-7b: 33 frozen blocks of its 32"));
  // What make_plan refuses, naming it: a rank outside the world, freezing that does not
  // describe the units, a range past its unit, a root without backward.
  const plan::setup at8{.world = 8};
  auto refused = [](const plan::model_desc& d, plan::setup s) {
    try {
      (void)plan::make_plan(d, s);
    } catch (const error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto with_rank = at8;
  with_rank.rank = 8;
  CHECK_THAT(refused(tuned, with_rank), Catch::Contains("rank 8 is not one of the 8 ranks"));
  with_rank.rank = -1;
  CHECK_THAT(refused(tuned, with_rank), Catch::Contains("rank -1 is not one of the 8 ranks"));
  auto short_desc = tuned;
  short_desc.frozen.pop_back();
  CHECK_THAT(refused(short_desc, at8), Catch::Contains("describes 32 units of the model's 33"));
  auto past = tuned;
  past.frozen[2].ranges = {{0, block + 1}};
  CHECK_THAT(refused(past, at8), Catch::Contains("unit 2's frozen range [0, " + std::to_string(block + 1) +
                                                 ") is not within its " + std::to_string(block) + " elements"));
  auto overlapping = tuned;
  overlapping.frozen[0].ranges.emplace_back(10, 20);  // inside the embedding's [0, 32000 x 4096)
  CHECK_THAT(refused(overlapping, at8), Catch::Contains("unit 0's frozen range [10, 20) is not within its " +
                                                        std::to_string(all.units[0]) +
                                                        " elements after the range before it (ending at " +
                                                        std::to_string(embed) + ")"));
  auto root = tuned;
  root.frozen[0].no_backward = true;
  CHECK_THAT(refused(root, at8), Catch::Contains("the root (unit 0) always runs backward"));
}

// plan::with_lora lays a preset's blocks out as fully_shard lays out the library's GPT-2
// and LLaMA after nn::add_lora: the same flat sizes (width 40: the norms leave alignment
// gaps) and frozen ranges, unit by unit, rank 3 adapters on the projections the targets
// name; the root wholly frozen. FLOPs: the frozen weights' gradient products (2 per
// multiplied parameter and token) out, the adapters' 6 in; activations gain r values a token
// per adapted projection.
TEST_CASE("a preset with LoRA adapters is laid out and frozen as add_lora leaves the models", "[plan][presets][lora]") {
  // Layouts and frozen ranges against describe_model's; which units run no backward
  // against the engine's own account after a step (plan::describe of the sharded model).
  const auto compare = [](const plan::model_desc& got, const plan::model_desc& want) {
    REQUIRE(got.units.size() == want.units.size());
    REQUIRE(got.frozen.size() == want.frozen.size());
    CHECK(got.frozen[0].all);
    CHECK(want.frozen[0].all);
    for (std::size_t i = 1; i < got.units.size(); ++i) {
      INFO("unit " << i);
      CHECK(got.units[i] == want.units[i]);
      CHECK(got.frozen[i].ranges == want.frozen[i].ranges);
      CHECK(got.frozen[i].all == want.frozen[i].all);
    }
  };
  const auto skips_backward = [](auto& model, std::int64_t vocab) {
    std::vector<bool> skips;
    comm::launch(1, [&](comm::ThreadComm& c) {
      using block = typename std::remove_cvref_t<decltype(model)>::block_type;
      auto sharded = shard::fully_shard<optim::AdamW>(model, c, shard::FullShard{}, {.wrap = shard::wrap_types<block>{}});
      Tensor<std::int64_t> ids({2, 8});
      for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = (i * 7) % vocab;
      optim::AdamW adamw{{.lr = 1e-3}};
      sharded.train_step(adamw, ids, models::causal_lm_targets(ids), nn::cross_entropy);
      for (const auto& f : plan::describe(sharded).frozen) skips.push_back(f.no_backward);
    });
    return skips;
  };
  const auto no_backward = [](const plan::model_desc& d) {
    std::vector<bool> v;
    for (const auto& f : d.frozen) v.push_back(f.no_backward);
    return v;
  };
  const std::vector<std::string> gpt2_targets{"c_attn", "mlp.c_proj"}, llama_targets{"q_proj", "v_proj", "down_proj"};
  {
    const plan::decoder_shape m{.name = "gpt2-40", .family = plan::family::gpt2, .layers = 2, .hidden = 40,
                                .heads = 4, .kv_heads = 4, .vocab = 96, .intermediate = 160, .positions = 32,
                                .seq = 32, .tied = true};
    models::GPT2LMHeadModel<float> model({.vocab_size = 96, .n_positions = 32, .n_embd = 40, .n_layer = 2, .n_head = 4});
    nn::add_lora(model, gpt2_targets, {.r = 3});
    const auto all = plan::decoder(m, 2, 32);
    const auto got = plan::with_lora(all, m, gpt2_targets, 3, 2, 32);
    compare(got, plan::describe_model(model, shard::wrap_types<models::GPT2Block<float>>{}));
    const double adapters = 2 * 3 * (40 + 120 + 160 + 40), tokens = 64;
    CHECK(got.flops == Approx(all.flops + tokens * (6 * adapters - 2 * double(plan::multiplied_parameters(m)))));
    // 2 adapted a block; c_fc frozen without one keeps no input (40 a token); bf16
    CHECK(got.activation_bytes == all.activation_bytes + 64 * 2 * 2 * 3 * 2 - 64 * 2 * 40 * 2);
    CHECK(no_backward(got) == skips_backward(model, 96));  // none: block 0 trains

    // The last block's c_attn alone: block 0 is wholly frozen and, before the first
    // adapter, a frozen prefix that runs forward only (no activations, no backward).
    models::GPT2LMHeadModel<float> last({.vocab_size = 96, .n_positions = 32, .n_embd = 40, .n_layer = 2, .n_head = 4});
    const std::vector<std::string> one{"transformer.h.1.attn.c_attn"};
    nn::add_lora(last, one, {.r = 3});
    const auto tail = plan::with_lora(all, m, one, 3, 2, 32);
    compare(tail, plan::describe_model(last, shard::wrap_types<models::GPT2Block<float>>{}));
    CHECK(tail.frozen[1].all);
    CHECK(no_backward(tail) == std::vector<bool>{false, true, false});
    CHECK(no_backward(tail) == skips_backward(last, 96));
    // Less block 0's (8·40 + 2·160 elements, 4 floats, 4·32 weights a token, bf16).
    const std::size_t block0 = 64 * ((8 * 40 + 2 * 160) * 2 + 16 + 4 * 32 * 2);
    CHECK(tail.activation_bytes == all.activation_bytes - block0 + 64 * 3 * 2 - 64 * (40 + 160) * 2);  // c_fc, c_proj
    const double block = double(plan::block_parameters(m));
    CHECK(tail.flops == Approx(all.flops + tokens * (6 * 3.0 * (40 + 120) - 2 * double(plan::multiplied_parameters(m)) -
                                                      (2 * block + 8 * 40.0 * 32))));
  }
  {
    const plan::decoder_shape m{.name = "llama-40", .family = plan::family::llama, .layers = 2, .hidden = 40,
                                .heads = 4, .kv_heads = 2, .vocab = 96, .intermediate = 112, .seq = 32};
    models::LlamaForCausalLM<float> model({.vocab_size = 96, .hidden_size = 40, .intermediate_size = 112,
                                           .num_hidden_layers = 2, .num_attention_heads = 4,
                                           .num_key_value_heads = 2, .max_position_embeddings = 32});
    nn::add_lora(model, llama_targets, {.r = 3});
    const auto got = plan::with_lora(plan::decoder(m), m, llama_targets, 3);
    compare(got, plan::describe_model(model, shard::wrap_types<models::LlamaDecoderLayer<float>>{}));
    CHECK(no_backward(got) == skips_backward(model, 96));
    CHECK_THROWS_WITH(plan::with_lora(plan::decoder(m), m, {"q_proj", "c_attn"}, 3),
                      Catch::Contains("plan::with_lora llama-40: target 'c_attn' names no projection"));
  }
}

// What a LoRA run saves in activations, measured: each model trained whole and with
// adapters (measure_activations, fp32), against what with_lora takes off the plan (in
// f32). The estimate the two share (Korthikanti's) is not the layers' exact figure, but
// the difference is: the inputs of frozen projections without an adapter that no other
// layer keeps (the attention keeps its output, o_proj's input; LLaMA's q, k, v read one
// input, gate and up another), less the adapters' r values a token. The plan counts
// what forward keeps; where a block's last projection is frozen the measured peak moves
// into the last block's backward, which holds that projection's input gradient
// ([tokens, intermediate]) beside it; the adapters' backward adds at most one
// adapter's output [tokens, r].
// The planner's seq² term against the layers: what a step keeps, measured at three
// sequence lengths s, s + d, s + 2d, has the second difference 2·c·d² for its
// c·seq² part, which must be the plan's (one weight of 4 bytes per batch, head, query
// and key and layer in fp32), with dropout on, GPT-2's and LLaMA's attention alike.
// Korthikanti's 5 (a mask and dropout's output kept too) overstated it 2.5 times.
TEST_CASE("the planned attention weights are what the host layers keep, as measured", "[plan][activations]") {
  const std::int64_t batch = 2, vocab = 96, layers = 3, heads = 4;
  const auto measure = [&](auto& model, std::int64_t seq) {
    Tensor<std::int64_t> ids({batch, seq});
    for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = (i * 7) % vocab;
    return double(plan::measure_activations(model, [&](nn::context& ctx) {
      auto out = ctx.forward(model, ids);
      ctx.backward(model, nn::cross_entropy(out, models::causal_lm_targets(ids)).grad);
    }));
  };
  const auto second_difference = [&](auto make) {
    auto m0 = make(32), m1 = make(64), m2 = make(96);
    return measure(m2, 96) - 2 * measure(m1, 64) + measure(m0, 32);
  };
  const auto plan_second_difference = [&](plan::decoder_shape m) {
    double out = 0;
    for (const auto& [seq, weight] : {std::pair{32L, 1.0}, std::pair{64L, -2.0}, std::pair{96L, 1.0}}) {
      m.seq = m.positions = seq;
      out += weight * double(plan::decoder(m, batch, seq, dtype::f32).activation_bytes);
    }
    return out;
  };
  const double want = 2.0 * double(layers * heads * batch) * 4 * 32 * 32;  // 2·c·d², c = layers·heads·batch·4 bytes
  const auto gpt2 = [&](std::int64_t seq) {
    return models::GPT2LMHeadModel<float>(
        {.vocab_size = vocab, .n_positions = seq, .n_embd = 64, .n_layer = layers, .n_head = heads, .attn_pdrop = 0.1});
  };
  const auto llama = [&](std::int64_t seq) {
    return models::LlamaForCausalLM<float>({.vocab_size = vocab, .hidden_size = 64, .intermediate_size = 176,
                                            .num_hidden_layers = layers, .num_attention_heads = heads,
                                            .num_key_value_heads = 2, .max_position_embeddings = seq,
                                            .attention_dropout = 0.1});
  };
  CHECK(second_difference(gpt2) == want);
  CHECK(second_difference(llama) == want);
  CHECK(plan_second_difference({.name = "gpt2-64", .family = plan::family::gpt2, .layers = layers, .hidden = 64,
                                .heads = heads, .kv_heads = heads, .vocab = vocab, .intermediate = 256,
                                .tied = true}) == want);
}

// plan::decoder's activations against the layers: one step's peak, measured
// (measure_activations, fp32), equals the plan to the byte, for both families over
// widths, MLP widths, heads, kv heads, vocabularies, batches, sequences and depths, with
// dropout on (masks are drawn again, not kept). Korthikanti's 34·hidden a token,
// which the presets took until 2026-12-07, leaves out the MLP's width, GQA and the
// logits: it planned 0.47 to 0.92 of the measured peak of 3-layer models of hidden 64
// with MLPs 176 to 512 wide.
TEST_CASE("the planned decoder activations are what the host layers keep, to the byte", "[plan][activations]") {
  struct shape {
    long layers, hidden, intermediate, heads, kv_heads, vocab, batch, seq;
    long head_dim = 0;  // LLaMA's, and its projections' biases (GPT-2 has them always)
    bool biases = false;
  };
  const auto measure = [](auto& model, const shape& x) {
    Tensor<std::int64_t> ids({x.batch, x.seq});
    for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = (i * 7) % x.vocab;
    return plan::measure_activations(model, [&](nn::context& ctx) {
      auto out = ctx.forward(model, ids);
      ctx.backward(model, nn::cross_entropy(out, models::causal_lm_targets(ids)).grad);
    });
  };
  for (const shape& x : {shape{1, 64, 176, 4, 2, 96, 2, 16}, shape{3, 64, 512, 8, 2, 96, 2, 64},
                         shape{2, 128, 176, 4, 4, 1000, 1, 32}, shape{2, 32, 2000, 4, 1, 192, 3, 24},
                         shape{2, 40, 100, 4, 2, 97, 2, 16, 12, true}}) {
    INFO("layers " << x.layers << ", hidden " << x.hidden << ", intermediate " << x.intermediate << ", heads "
                   << x.heads << " (" << x.kv_heads << " kv), head_dim " << x.head_dim << ", biases " << x.biases
                   << ", vocab " << x.vocab << ", " << x.batch << " x " << x.seq);
    models::LlamaForCausalLM<float> llama({.vocab_size = x.vocab, .hidden_size = x.hidden,
                                           .intermediate_size = x.intermediate, .num_hidden_layers = x.layers,
                                           .num_attention_heads = x.heads, .num_key_value_heads = x.kv_heads,
                                           .head_dim = x.head_dim, .max_position_embeddings = x.seq,
                                           .attention_bias = x.biases, .mlp_bias = x.biases, .attention_dropout = 0.1});
    const plan::decoder_shape l{.name = "llama", .family = plan::family::llama, .layers = x.layers,
                                .hidden = x.hidden, .heads = x.heads, .kv_heads = x.kv_heads, .vocab = x.vocab,
                                .intermediate = x.intermediate, .seq = x.seq, .head_dim = x.head_dim,
                                .attention_bias = x.biases, .mlp_bias = x.biases};
    CHECK(measure(llama, x) == plan::decoder(l, x.batch, x.seq, dtype::f32).activation_bytes);
    models::GPT2LMHeadModel<float> gpt2({.vocab_size = x.vocab, .n_positions = x.seq, .n_embd = x.hidden,
                                         .n_layer = x.layers, .n_head = x.heads, .n_inner = x.intermediate});
    const plan::decoder_shape g{.name = "gpt2", .family = plan::family::gpt2, .layers = x.layers, .hidden = x.hidden,
                                .heads = x.heads, .kv_heads = x.heads, .vocab = x.vocab,
                                .intermediate = x.intermediate, .positions = x.seq, .seq = x.seq, .tied = true};
    CHECK(measure(gpt2, x) == plan::decoder(g, x.batch, x.seq, dtype::f32).activation_bytes);
  }
}

TEST_CASE("a LoRA plan's activations drop by the inputs frozen projections no longer keep, as measured",
          "[plan][presets][lora][activations]") {
  const std::int64_t batch = 2, seq = 32, vocab = 96, tokens = batch * seq, r = 3, bytes = 4;
  const auto measure = [&](auto& model) {
    Tensor<std::int64_t> ids({batch, seq});
    for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = (i * 7) % vocab;
    return std::int64_t(plan::measure_activations(model, [&](nn::context& ctx) {
      auto out = ctx.forward(model, ids);
      ctx.backward(model, nn::cross_entropy(out, models::causal_lm_targets(ids)).grad);
    }));
  };
  // The targets, and whether the block's last projection (mlp.c_proj, down_proj) is frozen.
  const auto compare = [&](const plan::decoder_shape& m, auto make, const std::vector<std::string>& targets,
                           bool last_frozen) {
    INFO(m.name << ", adapters on " << Catch::Detail::stringify(targets));
    auto whole = make(), tuned = make();
    nn::add_lora(tuned, targets, {.r = r});
    const auto all = plan::decoder(m, batch, seq, dtype::f32);
    const auto lora = plan::with_lora(all, m, targets, r, batch, seq, dtype::f32);
    const std::int64_t planned = std::int64_t(all.activation_bytes) - std::int64_t(lora.activation_bytes);
    const std::int64_t measured = measure(whole) - measure(tuned);
    const std::int64_t adapter = tokens * r * bytes, inner = tokens * m.intermediate * bytes;
    if (last_frozen) {
      CHECK(planned - measured >= -adapter);
      CHECK(planned - measured <= inner + adapter);
    } else {
      CHECK(std::abs(planned - measured) <= adapter);
    }
  };
  const plan::decoder_shape gpt2{.name = "gpt2-64", .family = plan::family::gpt2, .layers = 4, .hidden = 64,
                                 .heads = 4, .kv_heads = 4, .vocab = vocab, .intermediate = 256, .positions = seq,
                                 .seq = seq, .tied = true};
  const auto make_gpt2 = [&] {
    return models::GPT2LMHeadModel<float>({.vocab_size = vocab, .n_positions = seq, .n_embd = 64, .n_layer = 4,
                                           .n_head = 4});
  };
  compare(gpt2, make_gpt2, {"c_attn"}, true);
  compare(gpt2, make_gpt2, {"attn.c_proj"}, true);
  compare(gpt2, make_gpt2, {"mlp.c_proj"}, false);
  compare(gpt2, make_gpt2, {"c_attn", "mlp.c_proj"}, false);
  compare(gpt2, make_gpt2, {"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"}, false);
  const plan::decoder_shape llama{.name = "llama-64", .family = plan::family::llama, .layers = 4, .hidden = 64,
                                  .heads = 4, .kv_heads = 2, .vocab = vocab, .intermediate = 176, .seq = seq};
  const auto make_llama = [&] {
    return models::LlamaForCausalLM<float>({.vocab_size = vocab, .hidden_size = 64, .intermediate_size = 176,
                                            .num_hidden_layers = 4, .num_attention_heads = 4,
                                            .num_key_value_heads = 2, .max_position_embeddings = seq});
  };
  compare(llama, make_llama, {"q_proj", "v_proj"}, true);
  compare(llama, make_llama, {"o_proj"}, true);
  compare(llama, make_llama, {"gate_proj"}, true);
  compare(llama, make_llama, {"down_proj"}, false);
  compare(llama, make_llama, {"q_proj", "v_proj", "down_proj"}, false);
}
