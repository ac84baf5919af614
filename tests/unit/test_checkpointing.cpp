// Activation checkpointing (options.checkpoint): the same losses and parameters,
// bit for bit, as training without it under every strategy with dropout on (an
// encoder classifier and a tiny decoder of GPT-2 and LLaMA attention), whether the
// checkpointed layers are units, layers inside units, or layers holding units; the
// ledger's activation peak lower than without it and equal to the planner's
// (plan::measure_activations with the same policy); eval() with checkpointing; and
// every library layer refusing a backward after a forward that kept nothing.
#include "shardlib/comm/launch.hpp"
#include "shardlib/nn/attention.hpp"
#include "shardlib/nn/activation.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/feed_forward.hpp"
#include "shardlib/nn/gpt2_attention.hpp"
#include "shardlib/nn/layer_norm.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/llama_attention.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/pooling.hpp"
#include "shardlib/nn/rms_norm.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/nn/transformer.hpp"
#include "shardlib/plan/describe.hpp"
#include "shardlib/plan/memory_plan.hpp"
#include "shardlib/shard/sharded_model.hpp"

#include "support/shard_fixture.hpp"  // fixture::sgd

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace test_checkpointing {

using namespace shardlib;
using Catch::Matchers::Contains;

namespace {

// --- the encoder classifier: three encoder layers (dropout 0.1), mean pool, head ---------------
using Encoder = nn::TransformerEncoderLayer<float>;
using Classifier = nn::Sequential<nn::Stack<Encoder>, nn::MeanPool<float>, nn::Linear<float>>;
constexpr std::int64_t d_model = 16, seq = 4, rows = 2, classes = 3;

Classifier make_classifier() {
  return Classifier{
      nn::Stack<Encoder>(3, {.d_model = d_model, .nhead = 2, .dim_feedforward = 24, .dropout = 0.1, .batch_first = true}),
      nn::MeanPool<float>(1), nn::Linear<float>(d_model, classes)};
}
Tensor<float> uniform(Shape s, int step, int rank) {
  Tensor<float> x(s);
  const counter_rng rng{std::uint64_t(100 + step), std::uint64_t(rank)};
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 2 * rng.uniform_float(std::uint64_t(i)) - 1;
  return x;
}
std::pair<Tensor<float>, Tensor<std::int64_t>> classifier_batch(int step, int rank) {
  Tensor<std::int64_t> y({rows});
  for (std::int64_t i = 0; i < rows; ++i) y[i] = (step + rank + i) % classes;
  return {uniform({rows, seq, d_model}, step, rank), std::move(y)};
}

// --- a tiny decoder: GPT-2 and LLaMA attention blocks (attention and residual dropout) ----------
using GPT2Block = nn::Sequential<nn::RMSNorm<float>, nn::GPT2Attention<float>>;
using LlamaBlock = nn::Sequential<nn::RMSNorm<float>, nn::LlamaAttention<float>, nn::RMSNorm<float>, nn::LlamaMLP<float>>;
using Decoder = nn::Sequential<nn::Embedding<float>, nn::PositionEmbedding<float>, GPT2Block, LlamaBlock,
                               nn::RMSNorm<float>, nn::Linear<float>>;
constexpr std::int64_t vocab = 11, width = 8, tokens = 5;

Decoder make_decoder() {
  return Decoder{nn::Embedding<float>(vocab, width),
                 nn::PositionEmbedding<float>(tokens, width),
                 GPT2Block{nn::RMSNorm<float>(width),
                           nn::GPT2Attention<float>({.n_embd = width, .n_head = 2, .attn_pdrop = 0.1, .resid_pdrop = 0.1})},
                 LlamaBlock{nn::RMSNorm<float>(width),
                            nn::LlamaAttention<float>({.hidden_size = width, .num_attention_heads = 2,
                                                       .num_key_value_heads = 1, .attention_dropout = 0.1}),
                            nn::RMSNorm<float>(width), nn::LlamaMLP<float>({.hidden_size = width, .intermediate_size = 12})},
                 nn::RMSNorm<float>(width),
                 nn::Linear<float>(width, vocab, false)};
}
std::pair<Tensor<std::int64_t>, Tensor<std::int64_t>> decoder_batch(int step, int rank) {
  Tensor<std::int64_t> ids({rows, tokens}), next({rows, tokens});
  const counter_rng rng{std::uint64_t(200 + step), std::uint64_t(rank)};
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = std::int64_t(rng.uniform_double(std::uint64_t(i)) * vocab);
  for (std::int64_t i = 0; i < ids.numel(); ++i) next[i] = i % tokens + 1 < tokens ? ids[i + 1] : -100;
  return {std::move(ids), std::move(next)};
}

const auto loss = [](const auto& out, const Tensor<std::int64_t>& y) { return nn::cross_entropy(out, y); };

struct outcome {
  std::vector<float> losses, params;  // this rank's losses; the final full parameters
  std::size_t activations = 0;        // the ledger's activation peak
  bool planner_agrees = false;        // every category's peak equals make_plan's
  std::string report;
};

// Three train_steps on `world` ranks; the planner is given `activation_bytes`. With
// `offload`, both ledgers (the model's space and the offload space) meet the plan.
template <class Make, class Data>
std::vector<outcome> train(Make make, Data data, int world, shard::AnyStrategy strategy, shard::wrap_policy wrap,
                           shard::wrap_policy checkpoint, std::size_t activation_bytes = 0, bool offload = false) {
  auto out = std::vector<outcome>(std::size_t(world));
  comm::launch(world, [&](comm::ThreadComm& c, ledger& l) {
    auto net = make();
    auto model = shard::fully_shard<fixture::sgd>(
        net, c, strategy, {.wrap = wrap, .checkpoint = checkpoint, .seed = 7, .offload = offload});
    fixture::sgd opt;
    auto& o = out[std::size_t(c.rank())];
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = data(s, c.rank());
      o.losses.push_back(model.train_step(opt, x, y, loss, {.loss = shard::loss_report::local}));
    }
    o.activations = l.peak(category::activations);
    const auto plan = plan::make_plan(plan::describe(model, activation_bytes),
                                      {.policy = strategy.policy(), .world = world,
                                       .optimizer_bytes = plan::sgd_state_bytes, .offload = offload});
    o.planner_agrees = true;
    for (int k = 0; k < category_count; ++k) {
      const auto cat_k = static_cast<category>(k);
      o.planner_agrees = o.planner_agrees && l.peak(cat_k) == plan.memory[cat_k] &&
                         l.offload().peak(cat_k) == plan.offloaded[cat_k];
      o.report += cat(" ", k, ": ", l.peak(cat_k), " vs ", plan.memory[cat_k], ", offloaded ", l.offload().peak(cat_k),
                      " vs ", plan.offloaded[cat_k], ";");
    }
    for (const auto& t : model.full_state_dict(false))
      for (std::int64_t i = 0; i < t.value.numel(); ++i) o.params.push_back(t.value[i]);
  });
  return out;
}

// With and without checkpointing: equal bit for bit (== fails on NaN).
template <class Make, class Data>
void check_bitwise(Make make, Data data, int world, const shard::AnyStrategy& strategy, const shard::wrap_policy& wrap,
                   const shard::wrap_policy& checkpoint) {
  const auto plain = train(make, data, world, strategy, wrap, shard::wrap_none{});
  const auto recomputed = train(make, data, world, strategy, wrap, checkpoint);
  for (int r = 0; r < world; ++r) {
    INFO(strategy.name << ", rank " << r);
    REQUIRE(!plain[std::size_t(r)].params.empty());
    CHECK(recomputed[std::size_t(r)].losses == plain[std::size_t(r)].losses);
    CHECK(recomputed[std::size_t(r)].params == plain[std::size_t(r)].params);
  }
}

template <class Make, class Data>
void check_every_layout(Make make, Data data, int world, const shard::AnyStrategy& strategy) {
  // the encoders are units and checkpointed
  check_bitwise(make, data, world, strategy, shard::wrap_types<Encoder>{}, shard::wrap_types<Encoder>{});
  // layers inside the units (and the root's head), by type and by name
  check_bitwise(make, data, world, strategy, shard::wrap_types<Encoder>{},
                shard::wrap_any{shard::wrap_types<nn::LayerNorm<float>>{}, shard::wrap_names{{"2", "0.layers.1.linear2"}}});
  // each Linear a unit, inside checkpointed encoders that are not units: the
  // recompute gathers them as a forward does
  check_bitwise(make, data, world, strategy, shard::wrap_types<nn::Linear<float>>{}, shard::wrap_types<Encoder>{});
}

}  // namespace

TEMPLATE_TEST_CASE("checkpointing gives the same training, bit for bit, under every strategy", "[checkpoint]",
                   shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer, shard::NoShard) {
  check_every_layout(make_classifier, classifier_batch, 2, TestType{});
}

TEST_CASE("checkpointing under HybridShard", "[checkpoint][hybrid]") {
  check_every_layout(make_classifier, classifier_batch, 4, shard::HybridShard{.group_size = 2});
}

// policy::reshard_to: a checkpointed unit's backward gathers from its part, and units inside
// a checkpointed layer are gathered by the recompute from theirs and keep a new one.
TEST_CASE("checkpointing with units resharded to pairs after forward", "[checkpoint][reshard]") {
  check_every_layout(make_classifier, classifier_batch, 4, shard::FullShard{.reshard_to = 2});
}

TEST_CASE("a decoder of GPT-2 and LLaMA attention blocks checkpointed trains bit for bit the same",
          "[checkpoint][decoder]") {
  const shard::wrap_types<GPT2Block, LlamaBlock> blocks;
  check_bitwise(make_decoder, decoder_batch, 2, shard::FullShard{}, blocks, blocks);
  check_bitwise(make_decoder, decoder_batch, 2, shard::ShardGradOp{}, blocks,
                shard::wrap_types<nn::GPT2Attention<float>, nn::LlamaAttention<float>>{});
  check_bitwise(make_decoder, decoder_batch, 2, shard::NoShard{}, shard::wrap_types<nn::Linear<float>>{}, blocks);
}

namespace {
void check_activation_peak(int world, const shard::AnyStrategy& strategy) {
  const shard::wrap_types<Encoder> encoders;
  const auto run = [](auto& ctx, auto& m) {
    auto [x, y] = classifier_batch(0, 0);
    auto out = ctx.forward(m, x);
    ctx.backward(m, nn::cross_entropy(out, y).grad);
  };
  Classifier probe = make_classifier();
  const std::size_t full = plan::measure_activations(probe, [&](nn::context& ctx) { run(ctx, probe); });
  Classifier probe2 = make_classifier();
  const std::size_t kept = plan::measure_activations(probe2, encoders, [&](auto& ctx) { run(ctx, probe2); });
  INFO(strategy.name << ": activations " << kept << " with checkpointing, " << full << " without");
  CHECK(kept < full);
  for (bool offload : {false, true})  // the planner's memory with checkpointing and offload on together
    for (const auto& o : train(make_classifier, classifier_batch, world, strategy, encoders, encoders, kept, offload)) {
      INFO("offload " << offload << ":" << o.report);
      CHECK(o.activations == kept);
      CHECK(o.planner_agrees);
    }
}
}  // namespace

TEMPLATE_TEST_CASE("the ledger's activation peak with checkpointing is the planner's, below the peak without",
                   "[checkpoint][memory]", shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer,
                   shard::NoShard) {
  check_activation_peak(2, TestType{});
}
TEST_CASE("the activation peak with checkpointing under HybridShard", "[checkpoint][memory][hybrid]") {
  check_activation_peak(4, shard::HybridShard{.group_size = 2});
}
TEST_CASE("the ledger with checkpointing and units resharded to pairs is the planner's",
          "[checkpoint][memory][reshard]") {
  check_activation_peak(4, shard::FullShard{.reshard_to = 2});
}

TEST_CASE("eval() with checkpointing: the same outputs, nothing kept, training resumes", "[checkpoint][eval]") {
  std::vector<std::string> why(2);  // each rank's findings (Catch's assertions are not thread-safe)
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto& w = why[std::size_t(c.rank())];
    Classifier a = make_classifier(), b = make_classifier();
    const shard::wrap_types<Encoder> encoders;
    auto plain = shard::fully_shard<fixture::sgd>(a, c, shard::FullShard{}, {.wrap = encoders, .seed = 7});
    auto ckpt =
        shard::fully_shard<fixture::sgd>(b, c, shard::FullShard{}, {.wrap = encoders, .checkpoint = encoders, .seed = 7});
    fixture::sgd opt;
    auto [x, y] = classifier_batch(0, c.rank());
    plain.train_step(opt, x, y, loss);
    ckpt.train_step(opt, x, y, loss);
    plain.eval();
    ckpt.eval();
    const auto want = plain.forward(x), got = ckpt.forward(x);
    if (std::vector<float>(got.data(), got.data() + got.numel()) !=
        std::vector<float>(want.data(), want.data() + want.numel()))
      w += "eval outputs differ; ";
    try {
      ckpt.backward(got);
      w += "backward in eval did not raise; ";
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("eval mode") == std::string::npos) w += cat("backward: ", e.what(), "; ");
    }
    plain.train();
    ckpt.train();
    auto [x1, y1] = classifier_batch(1, c.rank());
    const float with = ckpt.train_step(opt, x1, y1, loss).loss, without = plain.train_step(opt, x1, y1, loss).loss;
    if (!(with == without)) w += cat("losses ", with, " and ", without, "; ");  // == fails on NaN
    const auto p = plain.full_state_dict(false), q = ckpt.full_state_dict(false);
    for (std::size_t k = 0; k < p.size(); ++k)
      if (std::vector<float>(q[k].value.data(), q[k].value.data() + q[k].value.numel()) !=
          std::vector<float>(p[k].value.data(), p[k].value.data() + p[k].value.numel()))
        w += cat("parameter ", p[k].name, " differs; ");
  });
  for (const auto& w : why) CHECK(w == "");
}

namespace {
// A context whose forwards are followed by no backward.
struct no_grad_context : nn::context {
  bool grad_enabled() const { return false; }
};
template <class L, class X>
void check_refuses(L layer, const X& x, const std::string& name) {
  nn::Replicated<float, L> owner(layer, 1);
  no_grad_context ctx;
  const auto y = layer.forward(ctx, x);
  INFO(name);
  CHECK_THROWS_WITH(layer.backward(ctx, y), Contains(name) && Contains("backward"));
}
}  // namespace

TEST_CASE("a backward after a forward with gradients disabled raises, naming the layer", "[checkpoint][no_grad]") {
  const auto x = uniform({2, 3, 4}, 0, 0);
  {
    nn::Linear<float> linear(4, 3);
    nn::Replicated<float, nn::Linear<float>> owner(linear, 1);
    no_grad_context ctx;
    const auto y = linear.forward(ctx, x);
    CHECK_THROWS_WITH(linear.backward(ctx, y),
                      "Linear(4 -> 3): backward needs a forward that kept activations: the last forward ran with "
                      "gradients disabled (eval mode, no_grad, a frozen prefix or a checkpointed layer's first pass) or "
                      "its backward already ran");
  }
  check_refuses(nn::Linear<float>(4, 3), x, "Linear(4 -> 3)");
  check_refuses(nn::LayerNorm<float>(4), x, "LayerNorm(4)");
  check_refuses(nn::RMSNorm<float>(4), x, "RMSNorm(4)");
  check_refuses(nn::ReLU<float>(), x, "ReLU");
  check_refuses(nn::GELU<float>(), x, "GELU");
  check_refuses(nn::SiLU<float>(), x, "SiLU");
  check_refuses(nn::Dropout<float>(0.5), x, "Dropout(0.5)");
  check_refuses(nn::MeanPool<float>(1), x, "MeanPool(1)");
  check_refuses(nn::PositionEmbedding<float>(6, 4), x, "PositionEmbedding(6, 4)");
  Tensor<std::int64_t> ids({2, 3});
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = i % 5;
  check_refuses(nn::Embedding<float>(5, 4), ids, "Embedding(5, 4)");
  check_refuses(nn::LlamaMLP<float>({.hidden_size = 4, .intermediate_size = 6}), x, "LlamaMLP(4 -> 6)");
  check_refuses(nn::GPT2Attention<float>({.n_embd = 4, .n_head = 2}), x, "GPT2Attention(n_embd 4");
  check_refuses(nn::LlamaAttention<float>({.hidden_size = 4, .num_attention_heads = 2}), x,
                "LlamaAttention(hidden_size 4");
  check_refuses(nn::MultiheadAttention<float>({.embed_dim = 4, .num_heads = 2, .batch_first = true}), x,
                "MultiheadAttention(embed_dim 4");
}

TEST_CASE("a checkpointed layer run twice in one forward is refused, naming it", "[checkpoint]") {
  nn::Sequential<nn::Linear<float>> holder{nn::Linear<float>(4, 4)};
  nn::Replicated<float, decltype(holder)> owner(holder, 1);
  shard::checkpoint_context ctx({}, shard::checkpoints(holder, shard::wrap_names{{"0"}}));
  auto& inner = holder.get<0>();
  const auto x = uniform({2, 4}, 0, 0);
  const auto y = ctx.forward(inner, x);
  CHECK_THROWS_WITH(ctx.forward(inner, y), Contains("'0'") && Contains("ran forward twice"));
}

}  // namespace test_checkpointing
