// What a backward skips for frozen parameters (requires_grad = false), as PyTorch's
// autograd does: every library layer leaves a frozen parameter's gradient as it was
// (a sentinel written there survives) while dx and the other gradients keep their
// bits; a Linear whose weight is frozen keeps no input for backward; and a chain whose
// input is token ids (Sequential, GPT-2, LLaMA) runs its frozen prefix without
// gradients and stops its backward there (a counting context says which children ran;
// the trained gradients keep their bits): nothing is left cached, the sharded engine
// neither gathers nor prefetches those units in backward (counted bytes) and frees
// them after forward under ShardGradOp, as the plan says; the planner's figures equal
// the ledger and the bytes sent with frozen parameters, rank by rank; a flag changed
// after wrapping is refused, on one rank alone too.
#include "../../benchmarks/counting_comm.hpp"  // bytes sent per rank, ring model
#include "shardlib/comm/launch.hpp"
#include "shardlib/core/ledger.hpp"
#include "shardlib/models/gpt2.hpp"
#include "shardlib/models/llama.hpp"
#include "shardlib/nn/attention.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/feed_forward.hpp"
#include "shardlib/nn/freeze.hpp"
#include "shardlib/nn/gpt2_attention.hpp"
#include "shardlib/nn/layer_norm.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/llama_attention.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/rms_norm.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/sgd.hpp"
#include "shardlib/plan/describe.hpp"
#include "shardlib/plan/memory_plan.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/compare.hpp"
#include "support/parameter_names.hpp"
#include "support/raised.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <typeindex>
#include <vector>

namespace test_frozen_backward {

using namespace shardlib;
using Catch::Matchers::Contains;

namespace {

// A NaN no layer computes: what a skipped gradient still holds after backward.
constexpr std::uint32_t sentinel = 0x7fc0beefu;

template <class T>
std::vector<std::uint32_t> bits(std::span<const T> v) {
  std::vector<std::uint32_t> out;
  for (T x : v) out.push_back(std::bit_cast<std::uint32_t>(x));
  return out;
}

Tensor<float> filled(Shape s, std::uint64_t stream) {
  Tensor<float> t(s);
  const counter_rng rng(7, stream);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = 2 * rng.uniform_float(std::uint64_t(i)) - 1;
  return t;
}
Tensor<std::int64_t> token_ids(Shape s, std::int64_t vocab) {
  Tensor<std::int64_t> t(s);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = (i * 5 + 3) % vocab;
  return t;
}

using test_support::parameter_names;

// One forward and backward of a copy of `layer` on x with the named parameters frozen,
// their gradients starting as the sentinel (the others at zero); the parameters'
// gradients and dx (float inputs) as bits, and what stays cached after backward.
struct backward_run {
  std::vector<std::vector<std::uint32_t>> grads;  // in parameters() order
  std::vector<bool> frozen;                       // each one's flag (a tied one's is both names')
  std::vector<std::uint32_t> dx;
  std::size_t cached_after = 0;  // activation bytes still allocated once y, dy and dx are gone
};

template <class L, class X>
backward_run run_backward(const L& prototype, const X& x, const std::set<std::string>& frozen) {
  ledger l;
  backward_run out;
  {
    ledger_scope scope(l);
    L layer = prototype;
    if constexpr (requires { layer.tie(); }) layer.tie();
    layer.parameters([&](std::string_view, auto& p) { p.requires_grad = true; });
    layer.parameters([&](std::string_view name, auto& p) {
      if (frozen.contains(std::string(name))) p.requires_grad = false;
    });
    nn::Replicated<float, L> owner(layer, 11);
    layer.parameters([&](std::string_view, auto& p) {
      if (!p.requires_grad) std::ranges::fill(p.grads(), std::bit_cast<float>(sentinel));
    });
    nn::context ctx;
    {
      const auto y = layer.forward(ctx, x);
      const auto dy = filled(y.shape(), 2);
      const auto dx = layer.backward(ctx, dy);
      if constexpr (std::is_same_v<std::remove_cvref_t<decltype(dx)>, Tensor<float>>)
        out.dx = bits(std::span<const float>(dx.span()));
    }
    layer.parameters([&](std::string_view, auto& p) {
      out.grads.push_back(bits(std::span<const float>(p.grads())));
      out.frozen.push_back(!p.requires_grad);
    });
    out.cached_after = l.current(category::activations);
  }
  return out;
}

// Every parameter frozen alone, then all of them: the frozen gradients hold the
// sentinel, the others and dx the bits of the run that freezes nothing.
template <class L, class X>
void check_skips(const std::string& what, const L& prototype, const X& x) {
  L probe = prototype;
  const auto names = parameter_names(probe);
  const auto want = run_backward(prototype, x, {});
  REQUIRE(want.grads.size() == names.size());
  for (const auto& g : want.grads) {  // a gradient to compare: finite, and not all zero
    bool any = false;
    for (std::uint32_t b : g) {
      REQUIRE(std::isfinite(std::bit_cast<float>(b)));
      any = any || std::bit_cast<float>(b) != 0.0f;
    }
    REQUIRE(any);
  }
  std::vector<std::set<std::string>> cases;
  for (const auto& n : names) cases.push_back({n});
  cases.emplace_back(names.begin(), names.end());
  for (const auto& frozen : cases) {
    INFO(what << " with " << frozen.size() << " frozen, the first '" << *frozen.begin() << "'");
    const auto got = run_backward(prototype, x, frozen);
    CHECK(got.dx == want.dx);
    CHECK(got.cached_after == want.cached_after);
    for (std::size_t i = 0; i < names.size(); ++i) {
      INFO("gradient of " << names[i]);
      if (got.frozen[i]) CHECK(got.grads[i] == std::vector<std::uint32_t>(got.grads[i].size(), sentinel));
      else CHECK(got.grads[i] == want.grads[i]);
    }
  }
}

const models::gpt2_config tiny_gpt2{.vocab_size = 23, .n_positions = 8, .n_embd = 8, .n_layer = 3, .n_head = 2,
                                    .resid_pdrop = 0, .embd_pdrop = 0, .attn_pdrop = 0};
const models::llama_config tiny_llama{.vocab_size = 19, .hidden_size = 8, .intermediate_size = 12,
                                      .num_hidden_layers = 3, .num_attention_heads = 2, .num_key_value_heads = 1,
                                      .max_position_embeddings = 8};

// A layer without parameters that records whether its forward kept activations and
// how often its backward ran.
struct spy {
  using input = Tensor<float>;
  using output = Tensor<float>;
  std::shared_ptr<std::vector<bool>> grad_at_forward = std::make_shared<std::vector<bool>>();
  std::shared_ptr<int> backwards = std::make_shared<int>(0);
  template <class V>
  void parameters(V&&) {}
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    grad_at_forward->push_back(nn::grad_enabled(ctx));
    return x;
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    ++*backwards;
    return dy;
  }
};

}  // namespace

TEST_CASE("every library layer leaves a frozen parameter's gradient as it was, dx and the rest unchanged",
          "[frozen][backward]") {
  const auto x = filled({2, 3, 8}, 1);
  check_skips("Linear", nn::Linear<float>(8, 5), x);
  check_skips("LayerNorm", nn::LayerNorm<float>(8), x);
  check_skips("RMSNorm", nn::RMSNorm<float>(8), x);
  check_skips("MultiheadAttention", nn::MultiheadAttention<float>({.embed_dim = 8, .num_heads = 2, .batch_first = true}),
              x);
  check_skips("GPT2Attention", nn::GPT2Attention<float>({.n_embd = 8, .n_head = 2}), x);
  check_skips("LlamaAttention",
              nn::LlamaAttention<float>({.hidden_size = 8, .num_attention_heads = 2, .num_key_value_heads = 1}), x);
  check_skips("LlamaMLP", nn::LlamaMLP<float>({.hidden_size = 8, .intermediate_size = 12}), x);
  check_skips("PositionEmbedding", nn::PositionEmbedding<float>(5, 8), x);
  check_skips("Embedding", nn::Embedding<float>(7, 8), token_ids({2, 3}, 7));
  // the tied head (TiedLinear) with its embedding, and the decoders' frozen prefixes
  check_skips("GPT-2", models::GPT2LMHeadModel<float>(tiny_gpt2), token_ids({2, 5}, tiny_gpt2.vocab_size));
  check_skips("LLaMA", models::LlamaForCausalLM<float>(tiny_llama), token_ids({2, 5}, tiny_llama.vocab_size));
}

TEST_CASE("a Linear whose weight is frozen keeps x's shape and not x for backward", "[frozen][backward][memory]") {
  for (bool frozen : {false, true}) {
    INFO("weight frozen " << frozen);
    ledger l;
    ledger_scope scope(l);
    nn::Linear<float> lin(64, 8);
    nn::Replicated<float, nn::Linear<float>> owner(lin, 1);
    lin.weight.requires_grad = !frozen;
    nn::context ctx;
    Tensor<float> y;
    {
      const Tensor<float> x = filled({4, 64}, 1);
      y = lin.forward(ctx, x);
    }
    const std::size_t x_bytes = 4 * 64 * sizeof(float), y_bytes = 4 * 8 * sizeof(float);
    CHECK(l.current(category::activations) == y_bytes + (frozen ? 0 : x_bytes));
    const auto dx = lin.backward(ctx, filled(y.shape(), 2));
    CHECK(dx.shape() == Shape{4, 64});
    // a weight unfrozen between forward and backward has no x to make dW from
    (void)lin.forward(ctx, filled({4, 64}, 1));
    lin.weight.requires_grad = true;
    if (frozen)
      CHECK_THROWS_WITH(lin.backward(ctx, filled(y.shape(), 2)),
                        "Linear(64 -> 8): its weight was frozen at forward, which kept no input for a weight "
                        "gradient; set requires_grad before the forward");
  }
}

namespace {
// The plain context, counting each child's backward by address and type (a first member
// shares its parent's address); it passes itself down, so nested calls come back here.
struct counting_context : nn::context {
  std::map<std::pair<const void*, std::type_index>, int> backwards;
  template <class L, class X>
  auto forward(L& layer, const X& x) {
    return layer.forward(*this, x);
  }
  template <class L, class DY>
  auto backward(L& layer, const DY& dy) {
    ++backwards[{&layer, typeid(L)}];
    return layer.backward(*this, dy);
  }
};

// One step of a decoder with `frozen` (globs) frozen, their gradients starting as the
// sentinel: every gradient's bits, and whether the embedding and each block ran backward.
template <class M>
std::pair<std::vector<std::vector<std::uint32_t>>, std::vector<int>> decoder_step(
    const typename M::config_type& config, const std::vector<std::string>& frozen) {
  M m(config);
  if (!frozen.empty()) nn::freeze(m, frozen);
  nn::Replicated<float, M> owner(m, 11);
  m.parameters([&](std::string_view, auto& p) {
    if (!p.requires_grad) std::ranges::fill(p.grads(), std::bit_cast<float>(sentinel));
  });
  counting_context ctx;
  const auto y = ctx.forward(m, token_ids({2, 5}, config.vocab_size));
  (void)ctx.backward(m, filled(y.shape(), 2));
  std::vector<std::vector<std::uint32_t>> grads;
  m.parameters([&](std::string_view, auto& p) { grads.push_back(bits(std::span<const float>(p.grads()))); });
  std::vector<int> ran;
  const auto count = [&](const auto& child) { ran.push_back(ctx.backwards[{&child, typeid(child)}]); };
  if constexpr (requires { m.transformer; }) {
    count(m.transformer.wte);
    for (const auto& block : m.transformer.h) count(block);
    count(m.transformer.ln_f);
  } else {
    count(m.model.embed_tokens);
    for (const auto& layer : m.model.layers) count(layer);
    count(m.model.norm);
  }
  return {grads, ran};
}

// Frozen sets and which children then run backward (embedding, blocks 0..2, final norm).
template <class M>
void check_prefixes(const typename M::config_type& config, const std::vector<std::string>& embedding,
                    const std::string& blocks, const std::string& norm, const std::vector<std::string>& head) {
  const auto [all_grads, all_ran] = decoder_step<M>(config, {});
  CHECK(all_ran == std::vector<int>{1, 1, 1, 1, 1});
  const auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::string b0 = blocks + ".0.*", b1 = blocks + ".1.*", b2 = blocks + ".2.*";
  const auto everything_but_norm = with(with(embedding, {b0, b1, b2}), head);
  const std::pair<std::vector<std::string>, std::vector<int>> cases[] = {
      {embedding, {0, 1, 1, 1, 1}},  // the embedding: block 0 still runs (its parameters train)
      {with(embedding, {b0, b1}), {0, 0, 0, 1, 1}},
      {{b0, b1}, {1, 1, 1, 1, 1}},              // the embedding trains: everything runs
      {with(embedding, {b1}), {0, 1, 1, 1, 1}},  // block 0 trains: block 1 passes dx down
      {everything_but_norm, {0, 0, 0, 0, 1}},
      {with(everything_but_norm, {norm + ".*"}), {0, 0, 0, 0, 0}},  // nothing trains: the head returns at once
  };
  for (const auto& [frozen, want_ran] : cases) {
    INFO("frozen: " << frozen.front() << " and " << frozen.size() - 1 << " more");
    const auto [grads, ran] = decoder_step<M>(config, frozen);
    CHECK(ran == want_ran);
    M probe(config);
    nn::freeze(probe, frozen);
    std::size_t i = 0;
    probe.parameters([&](std::string_view name, auto& p) {
      INFO("gradient of " << name);
      if (!p.requires_grad) CHECK(grads[i] == std::vector<std::uint32_t>(grads[i].size(), sentinel));
      else CHECK(grads[i] == all_grads[i]);
      ++i;
    });
  }
}
}  // namespace

TEST_CASE("GPT-2 and LLaMA run backward from the top down to their lowest trained parameter, no further",
          "[frozen][backward]") {
  // GPT-2's head is its embedding (tied); LLaMA's is a weight of its own
  check_prefixes<models::GPT2LMHeadModel<float>>(tiny_gpt2, {"transformer.wte.*", "transformer.wpe.*"},
                                                 "transformer.h", "transformer.ln_f", {});
  check_prefixes<models::LlamaForCausalLM<float>>(tiny_llama, {"model.embed_tokens.*"}, "model.layers", "model.norm",
                                                  {"lm_head.*"});
}

TEST_CASE("a chain of token ids runs its frozen prefix without gradients and stops its backward there",
          "[frozen][backward]") {
  using Chain = nn::Sequential<nn::Embedding<float>, spy, nn::Linear<float>>;
  const auto ids = token_ids({2, 3}, 7);
  for (int frozen_children : {0, 1, 2}) {  // none; the embedding; the embedding and the head
    INFO(frozen_children << " frozen children");
    Chain chain(nn::Embedding<float>(7, 4), spy{}, nn::Linear<float>(4, 3));
    nn::Replicated<float, Chain> owner(chain, 5);
    chain.get<0>().weight.requires_grad = frozen_children < 1;
    chain.get<2>().weight.requires_grad = chain.get<2>().bias.requires_grad = frozen_children < 2;
    nn::context ctx;
    for (int step = 0; step < 2; ++step) {
      const auto y = chain.forward(ctx, ids);
      (void)chain.backward(ctx, filled(y.shape(), 2));
    }
    const auto& seen = *chain.get<1>().grad_at_forward;
    // the spy has no parameters: it needs a backward only for a trained embedding below it
    CHECK(seen == std::vector<bool>(2, frozen_children == 0));
    CHECK(*chain.get<1>().backwards == (frozen_children == 0 ? 2 : 0));
  }
  // A float chain may owe its caller dx: it runs every backward.
  using FloatChain = nn::Sequential<spy, nn::Linear<float>>;
  FloatChain chain(spy{}, nn::Linear<float>(4, 3));
  nn::Replicated<float, FloatChain> owner(chain, 5);
  nn::freeze(chain, {"*"});
  nn::context ctx;
  const auto y = chain.forward(ctx, filled({2, 4}, 1));
  CHECK(chain.backward(ctx, filled(y.shape(), 2)).shape() == Shape{2, 4});
  CHECK(*chain.get<0>().backwards == 1);
}

namespace {
struct engine_run {
  double gathered = 0;  // all-gather bytes rank 0 sent per step (ring model)
  std::size_t gathered_peak = 0;  // rank 0's ledger: gathered parameters
  plan::rank_plan plan;           // the planner's, from the wrapped model after its steps
  std::size_t block_numel = 0;  // h.0's unit, alignment gaps included
  std::vector<float> params;
  bool prefix_gathered_after_forward = true;  // ShardGradOp: h.0's unit still gathered after forward
};

engine_run train_gpt2(shard::AnyStrategy strategy, const std::vector<std::string>& frozen) {
  const int world = 2, steps = 2;
  std::vector<engine_run> runs(world);
  comm::launch(world, [&](comm::ThreadComm& inner, ledger& l) {
    auto tally = std::make_shared<bench::traffic>();
    bench::counting_comm<comm::ThreadComm> c(inner, tally);
    models::GPT2LMHeadModel<float> m(tiny_gpt2);
    nn::freeze(m, frozen);
    auto model = shard::fully_shard<optim::SGD>(m, c, strategy,
                                                {.wrap = shard::wrap_types<models::GPT2Block<float>>{}, .seed = 3});
    optim::SGD opt({.lr = 0.1, .momentum = 0.9});
    auto& run = runs[std::size_t(c.rank())];
    const auto ids = token_ids({2, 6}, tiny_gpt2.vocab_size);
    Tensor<std::int64_t> targets(ids.shape());
    for (std::int64_t i = 0; i < ids.numel(); ++i) targets[i] = (ids[i] + 1 + c.rank()) % tiny_gpt2.vocab_size;
    tally->reset();
    for (int s = 0; s < steps; ++s) {
      model.zero_grad();
      model.backward(nn::cross_entropy(model.forward(ids), targets).grad);
      model.step(opt);
    }
    run.gathered = tally->all_gather / steps;
    run.gathered_peak = l.peak(category::gathered_parameters);
    run.plan = plan::make_plan(plan::describe(model),
                               {.policy = strategy.policy(), .world = world, .optimizer_bytes = plan::sgd_momentum_state_bytes});
    run.block_numel = model.units()[1].numel();  // units: the root, then h.0, h.1, h.2
    (void)model.forward(ids);
    run.prefix_gathered_after_forward = model.gather_finished(1);
    model.zero_grad();
    for (auto& [name, t] : model.full_state_dict(false)) run.params.insert(run.params.end(), t.span().begin(), t.span().end());
  });
  return runs[0];
}
}  // namespace

// FullShard gathers every unit in forward and again in backward (prefetched one ahead):
// frozen, h.0 is the prefix and is neither gathered nor prefetched in backward, where a
// frozen h.1 (of the same size) is, since h.0 below it trains. Both train as NoShard does.
TEST_CASE("the sharded engine skips a frozen prefix's backward: no gather, no prefetch, freed after forward",
          "[frozen][backward][traffic]") {
  const std::vector<std::string> prefix{"transformer.wte.*", "transformer.wpe.*", "transformer.h.0.*"},
      middle{"transformer.wte.*", "transformer.wpe.*", "transformer.h.1.*"};
  const auto full_prefix = train_gpt2(shard::FullShard{}, prefix), full_middle = train_gpt2(shard::FullShard{}, middle);
  const double one_gather = double(shard::shard_layout{full_prefix.block_numel, 2}.padded_size()) * sizeof(float) / 2;
  CHECK(full_middle.gathered - full_prefix.gathered == Approx(one_gather).epsilon(1e-12));
  for (const auto& [frozen, run] : {std::pair{prefix, full_prefix}, std::pair{middle, full_middle}}) {
    const auto want = train_gpt2(shard::NoShard{}, frozen);
    test_support::max_error worst;
    worst.relative(run.params, want.params, 0.1);
    CHECK(worst <= 1e-5);  // float sums in another order
  }
  const auto zero2_prefix = train_gpt2(shard::ShardGradOp{}, prefix), zero2_middle = train_gpt2(shard::ShardGradOp{}, middle);
  CHECK_FALSE(zero2_prefix.prefix_gathered_after_forward);
  CHECK(zero2_middle.prefix_gathered_after_forward);  // h.0 trains: kept for backward
  // The planner reads the prefix off the wrapped model: what it saves is in the plan.
  for (const auto* run : {&full_prefix, &full_middle, &zero2_prefix, &zero2_middle}) {
    CHECK(run->gathered == Approx(run->plan.sent.all_gather).epsilon(1e-12));
    CHECK(run->gathered_peak == run->plan.memory.gathered_parameters);
  }
}

namespace {
// Rank by rank, what three train_steps of tiny GPT-2 (every block a unit) held and
// sent, and the plan of that rank from the wrapped model.
struct planned_rank {
  std::vector<std::size_t> peak = std::vector<std::size_t>(category_count);
  double sent = 0;
  plan::model_desc desc;
  plan::setup setup;
  plan::rank_plan plan;
  bool prefix_after_eval = false;  // describe() names a frozen prefix after a forward under no_grad
};

std::vector<planned_rank> plan_gpt2(shard::AnyStrategy strategy, int world, int prefetch, shard::mixed_precision mp,
                                    const std::vector<std::string>& frozen) {
  std::vector<planned_rank> out(static_cast<std::size_t>(world));
  comm::launch(world, [&](comm::ThreadComm& inner, ledger& l) {
    auto tally = std::make_shared<bench::traffic>();
    bench::counting_comm<comm::ThreadComm> c(inner, tally);
    models::GPT2LMHeadModel<float> m(tiny_gpt2);
    nn::freeze(m, frozen);
    auto model = shard::fully_shard(m, c, strategy, {.wrap = shard::wrap_types<models::GPT2Block<float>>{}, .seed = 3,
                                                     .prefetch = prefetch, .precision = mp});
    optim::Adam adam{{.lr = 1e-3}};
    const auto ids = token_ids({2, 6}, tiny_gpt2.vocab_size);
    Tensor<std::int64_t> targets(ids.shape());
    for (std::int64_t i = 0; i < ids.numel(); ++i) targets[i] = (ids[i] + 1 + c.rank()) % tiny_gpt2.vocab_size;
    tally->reset();  // construction compares the ranks' models; only steps count
    const int steps = 3;
    for (int s = 0; s < steps; ++s) (void)model.train_step(adam, ids, targets, nn::cross_entropy);
    auto& o = out[std::size_t(c.rank())];
    for (int k = 0; k < category_count; ++k) o.peak[std::size_t(k)] = l.peak(category(k));
    o.sent = tally->total() / steps;
    o.desc = plan::describe(model);
    o.setup = {.policy = strategy.policy(), .world = world, .prefetch = prefetch,
               .precision = plan::precision::fp32_layers(mp), .rank = c.rank()};
    o.plan = plan::make_plan(o.desc, o.setup);
    // A last forward wholly without grad (an evaluation) says nothing of a frozen prefix.
    model.context().no_grad([&] { (void)model.forward(ids); });
    for (const auto& f : plan::describe(model).frozen) o.prefix_after_eval = o.prefix_after_eval || f.no_backward;
  });
  return out;
}
}  // namespace

// With frozen parameters the plan is the ledger's, rank by rank: optimizer state
// without the frozen elements (which differ from rank to rank when a unit is part
// frozen), no reduced gradients or reduction for a wholly frozen unit, no backward
// gathers or full gradients for a frozen prefix's; unset, setup::rank gives each
// category's largest over the ranks.
TEST_CASE("with frozen parameters the plan equals the ledger on every rank, for every strategy and precision",
          "[frozen][plan][ledger]") {
  const std::vector<std::pair<std::string, std::vector<std::string>>> freezings{
      {"none", {}},
      {"prefix", {"transformer.wte.*", "transformer.wpe.*", "transformer.h.0.*"}},
      {"middle", {"transformer.h.1.*"}},
      {"part of units", {"transformer.wpe.*", "transformer.h.0.ln_1.*", "transformer.h.2.attn.*"}}};
  const shard::mixed_precision precisions[] = {{},
                                               {.param = dtype::bf16},
                                               {.param = dtype::bf16, .reduce = dtype::bf16},
                                               {.param = dtype::f16, .reduce = dtype::f16}};
  const std::pair<shard::AnyStrategy, int> strategies[] = {{shard::FullShard{}, 3},
                                                           {shard::ShardGradOp{}, 3},
                                                           {shard::ShardOptimizer{}, 3},
                                                           {shard::NoShard{}, 3},
                                                           {shard::HybridShard{.group_size = 2}, 4}};
  bool saw_prefix = false, saw_uneven_state = false;
  for (const auto& [what, frozen] : freezings)
    for (const auto& [strategy, world] : strategies)
      for (const auto& mp : precisions)
        for (int prefetch : {0, 1, 2}) {
          INFO(what << " frozen, " << strategy.name << ", W " << world << ", prefetch " << prefetch << ", param "
                    << name(mp.param) << ", reduce " << name(mp.reduce));
          const auto ranks = plan_gpt2(strategy, world, prefetch, mp, frozen);
          std::vector<std::size_t> largest(category_count, 0);
          for (const auto& o : ranks) {
            CHECK(o.desc.frozen.empty() == frozen.empty());
            for (int k = 0; k < category_count; ++k) {
              if (category(k) == category::activations) continue;  // measured, not planned, here
              INFO(name(category(k)));
              CHECK(o.peak[std::size_t(k)] == o.plan.memory[category(k)]);
              largest[std::size_t(k)] = std::max(largest[std::size_t(k)], o.peak[std::size_t(k)]);
            }
            CHECK(o.sent == Approx(o.plan.sent.total()).epsilon(1e-12));
            CHECK_FALSE(o.prefix_after_eval);
            saw_prefix = saw_prefix || (!o.desc.frozen.empty() && o.desc.frozen[1].no_backward);
          }
          plan::setup any = ranks[0].setup;
          any.rank.reset();
          const auto fullest = plan::make_plan(ranks[0].desc, any);
          for (int k = 0; k < category_count; ++k)
            if (category(k) != category::activations) CHECK(fullest.memory[category(k)] == largest[std::size_t(k)]);
          const auto state = [&](const planned_rank& o) { return o.peak[std::size_t(category::optimizer_state)]; };
          saw_uneven_state = saw_uneven_state || state(ranks[0]) != state(ranks[1]);
        }
  CHECK(saw_prefix);        // h.0 ran without backward
  CHECK(saw_uneven_state);  // a part-frozen unit left ranks different optimizer state
}

TEST_CASE("requires_grad changed after fully_shard is refused at the next forward, naming the parameter",
          "[frozen][errors]") {
  std::vector<std::string> errors(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    models::GPT2LMHeadModel<float> m(tiny_gpt2);
    auto model = shard::fully_shard<optim::SGD>(m, c, shard::FullShard{},
                                                {.wrap = shard::wrap_types<models::GPT2Block<float>>{}, .seed = 3});
    m.transformer.h[1].mlp.c_fc.weight.requires_grad = false;
    errors[std::size_t(c.rank())] = test_support::raised([&] { (void)model.forward(token_ids({1, 4}, 23)); });
  });
  for (int r = 0; r < 2; ++r)
    CHECK(errors[std::size_t(r)] == cat("rank ", r, ": parameter 'transformer.h.1.mlp.c_fc.weight' has requires_grad ",
                                        "false but was wrapped with true: set requires_grad (nn::freeze) before "
                                        "fully_shard"));
  // One rank alone, between forward and backward: it raises, and the other, waiting in a
  // collective, is woken (comm_aborted) rather than left to hang.
  CHECK_THROWS_WITH(comm::launch(2, [&](comm::ThreadComm& c) {
                      models::GPT2LMHeadModel<float> m(tiny_gpt2);
                      auto model = shard::fully_shard<optim::SGD>(
                          m, c, shard::FullShard{}, {.wrap = shard::wrap_types<models::GPT2Block<float>>{}, .seed = 3});
                      const auto ids = token_ids({1, 4}, 23);
                      const auto logits = model.forward(ids);
                      if (c.rank() == 1) m.transformer.h[2].attn.c_attn.bias.requires_grad = false;
                      model.backward(nn::cross_entropy(logits, ids).grad);
                    }),
                    "rank 1 of 2 failed: rank 1: parameter 'transformer.h.2.attn.c_attn.bias' has requires_grad false "
                    "but was wrapped with true: set requires_grad (nn::freeze) before fully_shard");
}

}  // namespace test_frozen_backward
