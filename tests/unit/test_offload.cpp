// options.offload (ZeRO-Offload, FSDP's CPUOffload): masters, reduced gradients and
// optimizer state in a second memory space, here host_offload_space (host memory under
// its own tag and ledger), so the whole path runs without a device. Offloading must
// change where bytes live and nothing else: the runs are compared bit for bit with the
// same runs not offloaded, and both spaces' ledgers byte for byte with the planner.
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/nn/freeze.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/param_groups.hpp"
#include "shardlib/plan/describe.hpp"
#include "shardlib/plan/memory_plan.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/shard_fixture.hpp"

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

namespace test_offload {

using namespace shardlib;
using namespace fixture;

namespace {

// What a rank ends with: its losses, every unit's master piece and optimizer state
// (buffers in for_each_buffer order, then the step count) as raw bits.
struct outcome {
  std::vector<std::uint32_t> losses, masters, state;
  bool offloaded = false;  // the engine says so
};
void append(std::vector<std::uint32_t>& out, std::span<const float> values) {
  for (float v : values) out.push_back(std::bit_cast<std::uint32_t>(v));
}
template <class Engine, class O>
void record_state(Engine& model, O& opt, outcome& o) {
  for (std::size_t i = 0; i < model.unit_count(); ++i) {
    append(o.masters, model.master_piece(i));
    auto& st = model.optimizer_state(opt, i);
    st.for_each_buffer([&](std::string_view, auto& b) { append(o.state, std::span<const float>(b.span())); });
    o.state.push_back(std::uint32_t(st.step));
  }
}

// Four train_steps of Adam (or param groups of it) on rank-local rows, clipped to a
// norm the gradients exceed, over the model `make` returns (fp32 or bf16 layers).
constexpr float clip_at = 0.05f;
// (The strategy as shard::AnyStrategy: one engine type per model and optimizer.)
template <class Opt, class Make>
std::vector<outcome> train(int w, shard::AnyStrategy strategy, Make make, shard::mixed_precision mp, bool offload,
                           Opt opt0) {
  std::vector<outcome> out(static_cast<std::size_t>(w));
  comm::launch(w, [&](comm::ThreadComm& c) {
    auto m = make();
    using H = typename decltype(m)::output::value_type;
    auto model = shard::fully_shard<Opt>(m, c, strategy,
                                         {.wrap = shard::wrap_names{{"1.layers.0", "1.layers.1", "1.layers.2"}},
                                          .seed = 42, .precision = mp, .offload = offload});
    Opt opt = opt0;
    const int rows = 3;
    auto& o = out[std::size_t(c.rank())];
    for (int s = 0; s < 4; ++s) {
      const auto first = c.rank() * rows;
      auto r = model.train_step(opt, as<H>(batch(s, rows, 5, 1, first)), as<H>(batch(s, rows, 3, 2, first)), mse_h<H>,
                                {.max_norm = clip_at});
      append(o.losses, std::span<const float>(&r.loss, 1));
      append(o.losses, std::span<const float>(&*r.grad_norm, 1));
    }
    o.offloaded = model.offloaded();
    record_state(model, opt, o);
  });
  return out;
}

// The offloaded run a and the plain run b: equal bits, and nothing but finite
// masters (a NaN would also equal itself bitwise).
bool same_and_finite(const std::vector<outcome>& a, const std::vector<outcome>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t r = 0; r < a.size(); ++r) {
    if (!a[r].offloaded || b[r].offloaded) return false;
    if (a[r].losses != b[r].losses || a[r].masters != b[r].masters || a[r].state != b[r].state) return false;
    if (a[r].masters.empty() || a[r].state.empty()) return false;
    for (auto bits : a[r].masters)
      if (!std::isfinite(std::bit_cast<float>(bits))) return false;
  }
  return true;
}

template <class Strategy>
std::vector<int> worlds() {
  if constexpr (std::is_same_v<Strategy, shard::HybridShard>) return {2, 4};
  else return {1, 2, 4};
}
template <class Strategy>
Strategy make_strategy() {
  if constexpr (std::is_same_v<Strategy, shard::HybridShard>) return {.group_size = 2};
  else return {};
}
}  // namespace

TEMPLATE_TEST_CASE("offload trains bit for bit as without it: fp32 layers, fp32/bf16/fp16 gathers", "[offload]",
                   shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer, shard::NoShard, shard::HybridShard) {
  const shard::mixed_precision precisions[] = {{}, {.param = dtype::bf16, .reduce = dtype::bf16},
                                               {.param = dtype::f16, .reduce = dtype::f16}};  // fp16: loss scaling
  for (int w : worlds<TestType>())
    for (const auto& mp : precisions) {
      auto plain = train(w, make_strategy<TestType>(), make_model, mp, false, optim::Adam{});
      auto offloaded = train(w, make_strategy<TestType>(), make_model, mp, true, optim::Adam{});
      INFO("W = " << w << ", param " << name(mp.param));
      CHECK(same_and_finite(offloaded, plain));
    }
}

TEMPLATE_TEST_CASE("offload trains bit for bit as without it: bf16 layers", "[offload][compute16]", shard::FullShard,
                   shard::ShardGradOp, shard::ShardOptimizer, shard::HybridShard) {
  for (int w : worlds<TestType>())
    for (dtype reduce : {dtype::f32, dtype::bf16}) {
      const shard::mixed_precision mp{.param = dtype::bf16, .reduce = reduce};
      auto plain = train(w, make_strategy<TestType>(), make_model16, mp, false, optim::Adam{});
      auto offloaded = train(w, make_strategy<TestType>(), make_model16, mp, true, optim::Adam{});
      INFO("W = " << w << ", reduce " << name(reduce));
      CHECK(same_and_finite(offloaded, plain));
    }
}

TEST_CASE("offload with parameter groups: each group steps its own segments in the offload space", "[offload][groups]") {
  using Groups = optim::param_groups<optim::AdamW>;
  const auto groups = Groups::no_decay_split({.lr = 1e-2f, .weight_decay = 0.1f});
  for (int w : {1, 2, 4}) {
    INFO("W = " << w);
    CHECK(same_and_finite(train(w, shard::FullShard{}, make_model, {}, true, groups),
                          train(w, shard::FullShard{}, make_model, {}, false, groups)));
    CHECK(same_and_finite(train(w, shard::ShardOptimizer{}, make_model16, {.param = dtype::bf16}, true, groups),
                          train(w, shard::ShardOptimizer{}, make_model16, {.param = dtype::bf16}, false, groups)));
  }
}

namespace {
// Both spaces' ledger peaks against the planner, category by category, after three
// steps of Adam. The model's activations are the layers' own (no strategy changes
// them; test_shard checks them), so that category is left out of the model space.
template <class Strategy, class Make>
void check_memory(int w, Make make, shard::mixed_precision mp, int prefetch) {
  std::vector<std::string> report(static_cast<std::size_t>(w));
  std::vector<int> ok(static_cast<std::size_t>(w), 0);
  comm::launch(w, [&](comm::ThreadComm& c, ledger& l) {
    auto m = make();
    using H = typename decltype(m)::output::value_type;
    auto model = shard::fully_shard<optim::Adam>(
        m, c, shard::AnyStrategy(make_strategy<Strategy>()),
        {.wrap = shard::wrap_names{{"1.layers.0", "1.layers.1", "1.layers.2"}}, .seed = 42, .prefetch = prefetch,
         .precision = mp, .offload = true});
    optim::Adam adam;
    for (int s = 0; s < 3; ++s) {
      const auto first = c.rank() * 4;
      model.train_step(adam, as<H>(batch(s, 4, 5, 1, first)), as<H>(batch(s, 4, 3, 2, first)), mse_h<H>);
    }
    const auto precision = std::is_same_v<H, float> ? plan::precision::fp32_layers(mp) : plan::precision::param_layers(mp);
    const auto want = plan::make_plan(plan::describe(model), {.policy = make_strategy<Strategy>().policy(), .world = w,
                                                              .prefetch = prefetch, .precision = precision,
                                                              .optimizer_bytes = plan::adam_state_bytes,
                                                              .offload = true});
    bool all = true;
    for (int k = 0; k < category_count; ++k) {
      const auto kind = category(k);
      const std::size_t got_model = l.peak(kind), got_offload = l.offload().peak(kind);
      report[std::size_t(c.rank())] += cat(name(kind), " ", got_model, " vs ", want.memory[kind], " | offload ",
                                           got_offload, " vs ", want.offloaded[kind], "; ");
      all = all && got_offload == want.offloaded[kind] && (kind == category::activations || got_model == want.memory[kind]);
    }
    ok[std::size_t(c.rank())] = all && want.offloaded.optimizer_state > 0 && want.memory.optimizer_state == 0;
  });
  for (int r = 0; r < w; ++r) {
    INFO("rank " << r << " of " << w << ", prefetch " << prefetch << ": " << report[std::size_t(r)]);
    CHECK(ok[std::size_t(r)] == 1);
  }
}
}  // namespace

TEMPLATE_TEST_CASE("offload: both spaces' ledgers equal the planner byte for byte", "[offload][memory]",
                   shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer, shard::NoShard, shard::HybridShard) {
  for (int w : worlds<TestType>()) {
    check_memory<TestType>(w, make_model, {}, 1);
    check_memory<TestType>(w, make_model, {.param = dtype::bf16, .reduce = dtype::bf16}, 0);
    if constexpr (!std::is_same_v<TestType, shard::NoShard>)
      for (dtype reduce : {dtype::f32, dtype::bf16}) check_memory<TestType>(w, make_model16, {.param = dtype::bf16, .reduce = reduce}, 1);
  }
}

TEST_CASE("offload: checkpoints save from and load into the offload space, resharded", "[offload][checkpoint]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / cat("shardlib_test_offload_", ::getpid());
  fs::remove_all(dir);
  const shard::options opts{.wrap = shard::wrap_names{{"1.layers.0", "1.layers.1", "1.layers.2"}}, .seed = 42,
                            .offload = true};
  auto step = [](auto& model, optim::Adam& adam, int s) {
    const int rows = 12 / model.comm().size(), first = model.comm().rank() * rows;
    model.train_step(adam, batch(s, rows, 5, 1, first), batch(s, rows, 3, 2, first), mse);
  };
  // Saved from two offloaded FullShard ranks after two steps.
  fs::path saved;
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = make_model();
    auto model = shard::fully_shard<optim::Adam>(m, c, shard::AnyStrategy(shard::FullShard{}), opts);
    optim::Adam adam;
    for (int s = 0; s < 2; ++s) step(model, adam, s);
    const auto path = io::save_checkpoint(dir, model, adam);
    if (c.rank() == 0) saved = path;
  });
  // Loaded at three ranks under ShardOptimizer, offloaded and not: one more step
  // each must agree bit for bit (the masters and the Adam moments were restored).
  // The loaded moments are charged where the engine keeps its own: the offload ledger.
  std::vector<std::vector<std::uint32_t>> after(2);
  std::vector<std::size_t> state_bytes(3), offloaded_state_bytes(3);
  for (bool offload : {true, false})
    comm::launch(3, [&](comm::ThreadComm& c, ledger& l) {
      Model m = make_model();
      auto o = opts;
      o.offload = offload;
      auto model = shard::fully_shard<optim::Adam>(m, c, shard::AnyStrategy(shard::ShardOptimizer{}), o);
      optim::Adam adam;
      io::load_checkpoint(saved, model, adam);
      if (offload) {
        state_bytes[std::size_t(c.rank())] = l.current(category::optimizer_state);
        offloaded_state_bytes[std::size_t(c.rank())] = l.offload().current(category::optimizer_state);
      }
      step(model, adam, 2);
      auto full = model.full_state_dict();
      if (c.rank() == 0)
        for (auto& [n, t] : full) append(after[offload ? 0 : 1], t.span());
    });
  fs::remove_all(dir);
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    CHECK(state_bytes[std::size_t(r)] == 0);
    CHECK(offloaded_state_bytes[std::size_t(r)] > 0);
  }
  REQUIRE(!after[0].empty());
  CHECK(after[0] == after[1]);
  for (auto bits : after[0]) CHECK(std::isfinite(std::bit_cast<float>(bits)));
}

TEMPLATE_TEST_CASE("offload: summon_full_params' writeback reaches the offloaded master", "[offload][summon]",
                   shard::FullShard, shard::NoShard) {
  // One step, every parameter halved through summon_full_params, one more step:
  // the second step must start from the halved values in both runs.
  auto run = [](bool offload) {
    std::vector<outcome> out(2);
    comm::launch(2, [&](comm::ThreadComm& c) {
      Model m = make_model();
      auto model = shard::fully_shard<optim::Adam>(
          m, c, shard::AnyStrategy(TestType{}), {.wrap = shard::wrap_types<Block>{}, .seed = 42, .offload = offload});
      optim::Adam adam;
      auto& o = out[std::size_t(c.rank())];
      for (int s = 0; s < 2; ++s) {
        if (s == 1)
          model.summon_full_params([&] {
            m.parameters([](std::string_view, nn::Param<float>& p) {
              for (std::int64_t k = 0; k < p.shape.numel(); ++k) p.value[k] *= 0.5f;
            });
          });
        const auto r = model.train_step(adam, batch(s, 3, 5, 1, 3 * c.rank()), batch(s, 3, 3, 2, 3 * c.rank()), mse);
        append(o.losses, std::span<const float>(&r.loss, 1));
      }
      o.offloaded = model.offloaded();
      record_state(model, adam, o);
    });
    return out;
  };
  CHECK(same_and_finite(run(true), run(false)));
}

// 16-bit layers: a wholly frozen unit keeps its master and its offloaded compute copy, which
// its step (nothing to update) sends back to the layers' copy as it is. summon_full_params'
// writeback must refresh that offloaded copy too, or the next step would put the values
// from before the writeback back (as it did until compute_copies::write_back).
TEST_CASE("offload with bf16 layers: a writeback to a frozen unit survives the steps after it", "[offload][summon][compute16]") {
  auto run = [](bool offload) {
    std::vector<outcome> out(2);
    comm::launch(2, [&](comm::ThreadComm& c) {
      Model16 m = make_model16();
      nn::freeze(m, {"1.layers.1.*"});
      auto model = shard::fully_shard<optim::Adam>(
          m, c, shard::AnyStrategy(shard::FullShard{}),
          {.wrap = shard::wrap_names{{"1.layers.0", "1.layers.1", "1.layers.2"}},
           .seed = 42,
           .precision = {.param = dtype::bf16, .reduce = dtype::bf16},
           .offload = offload});
      optim::Adam adam;
      auto& o = out[std::size_t(c.rank())];
      for (int s = 0; s < 3; ++s) {
        if (s == 1)
          model.summon_full_params([&] {
            m.parameters([](std::string_view, auto& p) {
              for (std::int64_t k = 0; k < p.shape.numel(); ++k) p.value[k] = bfloat16(0.5f * float(p.value[k]));
            });
          });
        const auto first = 3 * c.rank();
        const auto r = model.train_step(adam, as<bfloat16>(batch(s, 3, 5, 1, first)),
                                        as<bfloat16>(batch(s, 3, 3, 2, first)), mse_h<bfloat16>);
        append(o.losses, std::span<const float>(&r.loss, 1));
      }
      o.offloaded = model.offloaded();
      record_state(model, adam, o);
    });
    return out;
  };
  CHECK(same_and_finite(run(true), run(false)));
}

}  // namespace test_offload
