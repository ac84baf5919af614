// Checkpoints of models whose memory the host cannot read in place (device memory), on
// the host: io/staging.hpp's chunked copies over host_space and over a test space that
// counts them; io's own collectives over a communicator of such memory; and a whole
// save / resharding load / safetensors export and import of a model trained in
// negated_space (tests/support/negated_space.hpp: every value stored negated, so any
// in-place read gives wrong bytes), equal byte for byte to the files of the same run in
// host memory.
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/io/staging.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/plan/memory_plan.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/checkpoint_files.hpp"
#include "support/negated_space.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace test_device_staging {

using namespace shardlib;
using negated::negated_space;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

std::vector<float> ramp(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 0.25f * float(i) - 3.f;
  return v;
}

// The values negated_space stores for v, and what it holds read back through its copies.
std::vector<float> stored(const std::vector<float>& v) {
  std::vector<float> s(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) s[i] = negated::flip(v[i]);
  return s;
}

}  // namespace

TEST_CASE("the stager copies host memory both ways in bounded chunks", "[staging]") {
  for (const std::size_t n : {0, 1, 15, 16, 17, 53}) {
    io::stager<host_space> staging(64);  // 16 floats a chunk
    const auto want = ramp(n);
    std::vector<float> back(n, -1.f), device(n, -1.f);
    staging.upload(std::span<const float>(want), std::span<float>(device));
    staging.download(std::span<const float>(device), std::span<float>(back));
    INFO(n << " elements");
    CHECK(device == want);
    CHECK(back == want);
    CHECK(staging.staging_bytes() == std::min<std::size_t>(n, 16) * sizeof(float));  // never more than a chunk
  }
  // Ever larger copies grow the buffer by at least doubling, up to the chunk.
  io::stager<host_space> grows(64);
  std::vector<std::size_t> sizes;
  for (const std::size_t n : {3, 2, 5, 7, 17}) {
    std::vector<float> from = ramp(n), to(n);
    grows.upload(std::span<const float>(from), std::span<float>(to));
    CHECK(to == from);
    sizes.push_back(grows.staging_bytes());
  }
  CHECK(sizes == std::vector<std::size_t>{12, 12, 24, 48, 64});
}

TEST_CASE("the stager moves every element through the space's copies, a chunk per copy", "[staging]") {
  auto& c = negated::counts();
  SECTION("sizes that are and are not multiples of the chunk, and none") {
    for (const std::size_t n : {0, 1, 7, 8, 9, 40, 41}) {
      c.reset();
      io::stager<negated_space> staging(32);  // 8 floats a chunk
      const auto want = ramp(n);
      Buffer<float, negated_space> device(n, category::parameters);
      staging.upload(std::span<const float>(want), device.span());
      const std::vector<float> raw(device.data(), device.data() + n);
      std::vector<float> back(n, 99.f);
      staging.download(std::span<const float>(device.span()), std::span<float>(back));
      const std::size_t chunks = (n + 7) / 8;
      INFO(n << " elements");
      CHECK(raw == stored(want));  // the space holds its own form: an in-place read would be wrong
      CHECK(back == want);
      CHECK(c.from_host == chunks);
      CHECK(c.to_host == chunks);
      CHECK(c.from_host_elements == n);
      CHECK(c.to_host_elements == n);
      CHECK(staging.staging_bytes() == std::min<std::size_t>(n, 8) * sizeof(float));
    }
  }
  SECTION("a chunk size that is not a multiple of the element size rounds down to whole elements") {
    c.reset();
    io::stager<negated_space> staging(10);  // 2 floats a chunk
    const auto want = ramp(5);
    Buffer<float, negated_space> device(5, category::parameters);
    staging.upload(std::span<const float>(want), device.span());
    CHECK(c.from_host == 3);
    std::vector<double> wide(3);
    io::stager<negated_space> one(8);  // one double a chunk
    Buffer<double, negated_space> d(3, category::parameters);
    one.upload(std::span<const double>(std::vector<double>{1.5, -2.5, 3.0}), d.span());
    one.download(std::span<const double>(d.span()), std::span<double>(wide));
    CHECK(wide == std::vector<double>{1.5, -2.5, 3.0});
    CHECK(c.from_host == 6);
  }
  c.reset();
}

TEST_CASE("staging errors name the space, the operation and the sizes", "[staging][bad]") {
  auto& c = negated::counts();
  c.reset();
  std::vector<float> host(4);
  Buffer<float, negated_space> device(5, category::parameters);
  io::stager<negated_space> staging(16);
  CHECK_THROWS_WITH(staging.download(std::span<const float>(device.span()), std::span<float>(host)),
                    Contains("io staging (negated (test)) download") && Contains("the source has 5 elements") &&
                        Contains("the destination 4"));
  CHECK_THROWS_AS(staging.upload(std::span<const float>(host), device.span()), shape_error);
  CHECK_THROWS_WITH(io::stager<negated_space>(0), Contains("the chunk size must be at least one byte"));
  std::vector<double> d(1);
  Buffer<double, negated_space> dd(1, category::parameters);
  io::stager<negated_space> small(4);
  CHECK_THROWS_WITH(small.download(std::span<const double>(dd.span()), std::span<double>(d)),
                    Contains("chunks of 4 bytes cannot hold one element of 8 bytes"));
  // A copy that fails (a device error) reaches the caller as it is.
  c.fail_at = 2;  // the second chunk
  std::vector<float> five(5);
  CHECK_THROWS_WITH(staging.download(std::span<const float>(device.span()), std::span<float>(five)),
                    Contains("negated_space to_host: injected copy failure"));
  c.reset();
}

TEST_CASE("io's agreement and broadcasts run through the space's value collectives", "[staging][comm]") {
  constexpr int world = 3;
  std::vector<std::string> message(world), broadcast(world);
  comm::launch(world, [&](comm::ThreadComm& tc) {
    negated::negated_comm nc(tc);
    io::detail::host_collectives<negated_space, negated::negated_comm> values(nc);
    // A max over the stored (inverted) integers, read in place, would pick the lowest rank's flag.
    try {
      io::detail::on_all_ranks(values, "agreeing", [&] {
        if (nc.rank() == 1) throw io_error("rank 1 cannot");
      });
    } catch (const io_error& e) {
      message[std::size_t(nc.rank())] = e.what();
    }
    broadcast[std::size_t(nc.rank())] =
        io::detail::broadcast_string(values, nc.rank() == 2 ? "from rank 2, thirty-one bytes." : "", 2);
  });
  CHECK_THAT(message[0], Contains("rank 0: agreeing: stopped because rank 1 failed: rank 1 cannot"));
  CHECK_THAT(message[1], Contains("rank 1: agreeing: rank 1 cannot"));
  CHECK_THAT(message[2], Contains("rank 2: agreeing: stopped because rank 1 failed"));
  for (const auto& b : broadcast) CHECK(b == "from rank 2, thirty-one bytes.");
}

namespace {

// V: the layers' element type (bfloat16 takes the engine's 16-bit compute path).
template <class Space, class V = float>
using Layer = negated::Linear<Space, V>;
template <class Space, class V = float>
using Model = nn::Sequential<Layer<Space, V>, nn::Stack<Layer<Space, V>>, Layer<Space, V>>;
template <class Space, class V = float>
Model<Space, V> make_model() {
  return Model<Space, V>{Layer<Space, V>(5, 8), nn::Stack<Layer<Space, V>>(3, Layer<Space, V>(8, 8)),
                         Layer<Space, V>(8, 3)};
}

// Rows [rank * 12 / W, (rank + 1) * 12 / W) of step s's global batch.
constexpr std::int64_t global_rows = 12;
Tensor<float> batch(int step, std::int64_t cols, std::uint64_t stream, int rank, int world) {
  const std::int64_t rows = global_rows / world, first = rows * rank;
  Tensor<float> t({rows, cols});
  counter_rng rng(500 + std::uint64_t(step), stream);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = 2 * rng.uniform_float(std::uint64_t(first * cols + i)) - 1;
  return t;
}

template <class Space, class Engine, class Opt>
void train(Engine& sharded, Opt& opt, int first_step, int steps) {
  using V = typename Engine::compute_type;
  const int rank = sharded.comm().rank(), world = sharded.comm().size();
  for (int s = first_step; s < first_step + steps; ++s) {
    sharded.zero_grad();
    const auto y = sharded.forward(negated::to_space<Space, V>(batch(s, 5, 1, rank, world)));
    sharded.backward(negated::mse(y, batch(s, 3, 2, rank, world)).grad);
    sharded.step(opt);
  }
}

// What a run leaves besides its files: rank 0's full state dicts, flattened by name.
struct run_values {
  std::vector<float> params, state;
  std::string problem;  // the first check a rank failed (Catch is not thread-safe)
};
void flatten(const io::sharded_tensors& ts, std::vector<float>& out) {
  for (const auto& [name, t] : ts)
    for (const auto& p : t.pieces) out.insert(out.end(), p.values.span().begin(), p.values.span().end());
}

// One scenario in Space: train at W = 2 (FullShard), save, export with the optimizer,
// take the full and sharded state dicts, load the sharded ones at W = 4 and save; load
// the checkpoint at W = 3 (ShardGradOp) into a model initialised otherwise, train on and
// save again; import the export at W = 1 (NoShard) and export it again. With offload the
// optimizer (host Adam) steps in host memory beside the model's space; with V = bfloat16
// too, the layers compute in 16 bits and the fp32 master lives only there.
template <class Space, bool offload, class V = float>
run_values scenario(const fs::path& dir) {
  using Opt = std::conditional_t<offload || std::is_same_v<Space, host_space>, optim::Adam, negated::Adam<Space>>;
  using Strategy = shard::AnyStrategy;  // one engine type for the three strategies: compile time
  const Opt opt_init{{.lr = 0.02, .weight_decay = 0.01}};
  auto comm_of = [](comm::ThreadComm& c) {
    if constexpr (std::is_same_v<Space, host_space>) return c;
    else return negated::negated_comm(c);
  };
  auto options = [](std::uint64_t seed) {
    const shard::mixed_precision mp{.param = std::is_same_v<V, float> ? dtype::f32 : dtype::bf16};
    return shard::options{.wrap = shard::wrap_types<Layer<Space, V>>{}, .seed = seed, .precision = mp,
                          .offload = offload};
  };
  run_values out;
  // The state dicts are made and dropped inside the launch: their memory is in the ranks' ledgers.
  std::vector<io::model_state_dict> models(2);
  std::vector<io::optim_state_dict> optims(2);
  comm::launch(4, [&](comm::ThreadComm& c) {
    const int rank = c.rank();
    auto all = comm_of(c);
    auto pair = all.split(rank < 2 ? 0 : 1, rank);
    if (rank < 2) {
      auto model = make_model<Space, V>();
      auto sharded = shard::fully_shard<Opt>(model, pair, Strategy(shard::FullShard{}), options(7));
      Opt opt = opt_init;
      train<Space>(sharded, opt, 0, 3);
      io::save_checkpoint(dir / "ckpt", sharded, opt, {.tag = "first", .chunk_bytes = 256});
      io::export_safetensors(dir / "first.safetensors", sharded, opt);
      const auto params = io::get_model_state(sharded, {.full = true, .rank0_only = true});
      const auto state = io::get_optimizer_state(sharded, opt, {.full = true, .rank0_only = true});
      models[std::size_t(rank)] = io::get_model_state(sharded);
      optims[std::size_t(rank)] = io::get_optimizer_state(sharded, opt);
      if (rank == 0) {
        flatten(params.params, out.params);
        for (const auto& [buffer, ts] : state.buffers) flatten(ts, out.state);
      }
    }
    c.barrier();
    {
      auto model = make_model<Space, V>();
      auto sharded = shard::fully_shard<Opt>(model, all, Strategy(shard::FullShard{}), options(11));
      Opt opt = opt_init;
      io::set_state(sharded, opt, std::span<const io::model_state_dict>(models),
                    std::span<const io::optim_state_dict>(optims));
      io::save_checkpoint(dir / "ckpt", sharded, opt, {.tag = "from-dicts"});
    }
    c.barrier();
    if (rank < 2) {
      models[std::size_t(rank)] = {};
      optims[std::size_t(rank)] = {};
    }
  });
  comm::launch(3, [&](comm::ThreadComm& c) {
    auto cc = comm_of(c);
    auto model = make_model<Space, V>();
    auto sharded = shard::fully_shard<Opt>(model, cc, Strategy(shard::ShardGradOp{}), options(99));
    Opt opt{{.lr = 0.5}};  // the checkpoint's hyperparameters replace these
    io::load_checkpoint(dir / "ckpt" / "first", sharded, opt);
    if (c.rank() == 0 && sharded.steps() != 3) out.problem = cat("steps after the load: ", sharded.steps());
    train<Space>(sharded, opt, 3, 2);
    io::save_checkpoint(dir / "ckpt", sharded, opt, {.tag = "resharded"});
  });
  comm::launch(1, [&](comm::ThreadComm& c) {
    auto cc = comm_of(c);
    auto model = make_model<Space, V>();
    // 16-bit layers keep fp32 masters beside them, which NoShard refuses: ShardOptimizer at W = 1.
    using Alone = std::conditional_t<std::is_same_v<V, float>, shard::NoShard, shard::ShardOptimizer>;
    auto sharded = shard::fully_shard<Opt>(model, cc, Strategy(Alone{}), options(5));
    Opt opt = opt_init;
    io::load_safetensors(dir / "first.safetensors", sharded, opt);
    io::export_safetensors(dir / "again.safetensors", sharded, opt);
  });
  return out;
}

template <bool offload, class V = float>
void compare_with_host() {
  const std::string tag = cat(offload ? "_offload" : "", std::is_same_v<V, float> ? "" : "_bf16");
  const test_support::temp_dir host_dir("staging_host" + tag), neg_dir("staging_negated" + tag);
  const auto want = scenario<host_space, offload, V>(host_dir.path);
  negated::counts().reset();
  const auto got = scenario<negated_space, offload, V>(neg_dir.path);
  const std::size_t staged = negated::counts().to_host_elements, loaded = negated::counts().from_host_elements;
  CHECK(want.problem.empty());
  CHECK(got.problem.empty());
  INFO(want.problem << got.problem);

  const auto want_files = test_support::files_under(host_dir.path);
  const auto got_files = test_support::files_under(neg_dir.path);
  std::vector<std::string> names;
  for (const auto& [name, bytes] : want_files) names.push_back(name);
  // Three checkpoints (each a metadata.json and one file per partition: 2, 3, 4) and two exports.
  CHECK(names.size() == 3 + (2 + 3 + 4) + 2);
  for (const auto& [name, bytes] : want_files) {
    INFO(name);
    const auto it = got_files.find(name);
    REQUIRE(it != got_files.end());
    CHECK(bytes.size() > 0);
    CHECK(it->second == bytes);
  }
  CHECK(got_files.size() == want_files.size());
  // The export imported and exported again is the same file.
  CHECK(want_files.at("again.safetensors") == want_files.at("first.safetensors"));
  // The full state dicts: 291 parameters, and Adam's two buffers of each.
  CHECK(want.params.size() == 291);
  CHECK(want.state.size() == 2 * 291);
  CHECK(got.params == want.params);
  CHECK(got.state == want.state);
  // Everything io saved or loaded of the negated model went through the space's copies.
  CHECK(staged >= 291 * 3);
  CHECK(loaded >= 291);
}

}  // namespace

TEST_CASE("a model in memory the host cannot read saves, reshards and exports the host's files byte for byte",
          "[staging][checkpoint]") {
  compare_with_host<false>();
}

TEST_CASE("the same with the optimizer offloaded to host memory beside the model's space",
          "[staging][checkpoint][offload]") {
  compare_with_host<true>();
}

TEST_CASE("the same with 16-bit layers, whose fp32 master lives only in the offload space",
          "[staging][checkpoint][offload][compute16]") {
  compare_with_host<true, bfloat16>();
}

// The planner's engine_refusal against the engine itself: 16-bit layers under each
// strategy and reduction dtype are built, or refused, alike.
TEST_CASE("16-bit layers: the engine refuses exactly the setups plan::engine_refusal names", "[plan][compute16]") {
  const auto check = [](auto strategy, plan::strategy s, dtype param, dtype reduce, auto value) {
    using V = decltype(value);
    std::string engine;
    comm::launch(2, [&](comm::ThreadComm& c) {
      auto model = make_model<host_space, V>();
      try {
        auto sharded = shard::fully_shard<optim::Adam>(
            model, c, strategy, {.wrap = shard::wrap_types<Layer<host_space, V>>{}, .precision = {param, reduce}});
      } catch (const error& e) {
        if (c.rank() == 0) engine = e.what();
      }
    });
    const std::string planned = plan::engine_refusal(
        {.strategy = s, .world = 2, .group = 2, .precision = plan::precision::param_layers({param, reduce})});
    INFO(plan::name(s) << ", " << name(param) << " layers, " << name(reduce) << " reduction: engine \"" << engine
                       << "\", planner \"" << planned << "\"");
    CHECK(engine.empty() == planned.empty());
  };
  for (dtype reduce : {dtype::f32, dtype::bf16, dtype::f16}) {
    check(shard::FullShard{}, plan::strategy::full_shard, dtype::bf16, reduce, bfloat16{});
    check(shard::ShardGradOp{}, plan::strategy::shard_grad_op, dtype::bf16, reduce, bfloat16{});
    check(shard::ShardOptimizer{}, plan::strategy::shard_optimizer, dtype::f16, reduce, half{});
    check(shard::NoShard{}, plan::strategy::no_shard, dtype::bf16, reduce, bfloat16{});
    check(shard::HybridShard{.group_size = 2}, plan::strategy::hybrid_shard, dtype::f16, reduce, half{});
  }
}

// --- train_step deciding in the model's space -----------------------------------------------
// With fp16 loss scaling and clipping, a device step decides in device memory whether it
// is taken (shard/step_decision.hpp) and an optimizer with a skip_flag step cancels it
// there. Here the same engine path runs in negated_space (negated::Adam has such a step)
// against the host's path (the host reads the flags and decides), step for step.
namespace {

struct decided_run {
  std::vector<float> losses, norms;
  std::vector<int> skipped;
  std::vector<float> params, state;
  std::vector<std::int64_t> optimizer_steps;
  shard::loss_scaler scaler, scaler_after_set;
  std::uint64_t steps = 0;
  std::size_t reads_while_training = 0;  // the host's reads of per-step scalars before any result was read
  std::string error;                     // rank 0's, when a step raised
};

// Bit patterns, every NaN as one (their payloads depend on which operand carried it).
std::vector<std::uint32_t> bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> b;
  for (const float x : v) b.push_back(std::isnan(x) ? 0x7fc00000u : std::bit_cast<std::uint32_t>(x));
  return b;
}

// W = 2, FullShard, Adam; layers of V (half: fp16 with loss scaling by `rule`); step s
// clips to max_norm(s) (0: not) and has NaN in its (last micro-batch's) targets when
// poisoned(s); with micro > 1, each step is train_step over that many micro-batches.
template <class Space, class V>
decided_run decided_steps(int steps, const shard::loss_scaler& rule, const std::function<float(int)>& max_norm,
                          const std::function<bool(int)>& poisoned, int micro = 1) {
  using Opt = std::conditional_t<std::is_same_v<Space, host_space>, optim::Adam, negated::Adam<Space>>;
  constexpr bool fp16 = std::is_same_v<V, half>;
  decided_run out;
  negated::counts().reset();
  comm::launch(2, [&](comm::ThreadComm& c) {
    const int rank = c.rank();
    auto cc = [&] {
      if constexpr (std::is_same_v<Space, host_space>) return c;
      else return negated::negated_comm(c);
    }();
    auto model = make_model<Space, V>();
    auto sharded = shard::fully_shard<Opt>(
        model, cc, shard::FullShard{},
        shard::options{.wrap = shard::wrap_types<Layer<Space, V>>{}, .seed = 3,
                       .precision = {.param = fp16 ? dtype::f16 : dtype::f32}, .scaler = rule});
    Opt opt{{.lr = 0.01}};
    auto loss = [](const Tensor<V, Space>& y, const Tensor<float>& target) { return negated::mse(y, target); };
    std::vector<shard::step_result_of<Space>> results;
    try {
      for (int s = 0; s < steps; ++s) {
        if (micro == 1) {
          Tensor<float> target = batch(s, 3, 2, rank, 2);
          if (poisoned(s)) target[0] = std::numeric_limits<float>::quiet_NaN();
          results.push_back(sharded.train_step(opt, negated::to_space<Space, V>(batch(s, 5, 1, rank, 2)), target,
                                               loss, {.max_norm = max_norm(s)}));
          continue;
        }
        std::vector<Tensor<V, Space>> xs;
        std::vector<Tensor<float>> targets;
        for (int k = 0; k < micro; ++k) {
          xs.push_back(negated::to_space<Space, V>(batch(100 * s + k, 5, 1, rank, 2)));
          targets.push_back(batch(100 * s + k, 3, 2, rank, 2));
        }
        if (poisoned(s)) targets.back()[0] = std::numeric_limits<float>::quiet_NaN();
        results.push_back(sharded.train_step(opt, xs, targets, loss, {.max_norm = max_norm(s), .no_sync = s % 2 == 1}));
      }
      c.barrier();
      if (rank == 0) out.reads_while_training = negated::counts().reads;
      c.barrier();
      for (const auto& r : results) {
        const float l = r.loss;
        const bool skipped = r.skipped;
        const float norm = r.grad_norm ? float(*r.grad_norm) : -1.f;
        if (rank != 0) continue;
        out.losses.push_back(l);
        out.skipped.push_back(skipped);
        out.norms.push_back(norm);
      }
    } catch (const error& e) {
      if (rank == 0) out.error = e.what();
      return;
    }
    const auto params = io::get_model_state(sharded, {.full = true, .rank0_only = true});
    const auto state = io::get_optimizer_state(sharded, opt, {.full = true, .rank0_only = true});
    std::vector<std::int64_t> counts;
    for (std::size_t i = 0; i < sharded.unit_count(); ++i) counts.push_back(sharded.optimizer_state(opt, i).step);
    shard::loss_scaler scaler, replaced;
    if constexpr (fp16) {
      scaler = *sharded.scaler();
      sharded.set_scaler({.scale = 64.f, .good_steps = 5, .skipped = 9});
      replaced = *sharded.scaler();
    }
    if (rank != 0) return;
    flatten(params.params, out.params);
    for (const auto& [buffer, ts] : state.buffers) flatten(ts, out.state);
    out.optimizer_steps = counts;
    out.scaler = scaler;
    out.scaler_after_set = replaced;
    out.steps = sharded.steps();
  });
  return out;
}

void require_same_run(const decided_run& got, const decided_run& want) {
  REQUIRE(want.error.empty());
  INFO(got.error);
  REQUIRE(got.error.empty());
  CHECK(got.reads_while_training == 0);  // nothing read before the results were (the host's path reads every step)
  CHECK(bits(got.losses) == bits(want.losses));  // a poisoned step's loss is NaN
  CHECK(got.skipped == want.skipped);
  CHECK(bits(got.norms) == bits(want.norms));  // skipped steps' norms are inf or NaN
  CHECK(got.params == want.params);
  CHECK(got.state == want.state);
  CHECK(got.optimizer_steps == want.optimizer_steps);
  CHECK(got.steps == want.steps);
  CHECK(got.scaler.scale == want.scaler.scale);
  CHECK(got.scaler.good_steps == want.scaler.good_steps);
  CHECK(got.scaler.skipped == want.scaler.skipped);
  CHECK(got.scaler.skipped_in_row == want.scaler.skipped_in_row);
}

}  // namespace

TEST_CASE("train_step with fp16 loss scaling and clipping decides in the model's space as the host does, "
          "reading nothing until a result is read",
          "[staging][train_step][compute16]") {
  // 2^20 overflows fp16 gradients at first: steps are skipped and the scale backs off;
  // growth every 3 good steps brings overflows back. max_norm 0.05 clips most steps.
  const shard::loss_scaler rule{.scale = 1048576.f, .growth_interval = 3};
  const auto clip = [](int) { return 0.05f; };
  const auto clean = [](int) { return false; };
  const auto want = decided_steps<host_space, half>(14, rule, clip, clean);
  const auto got = decided_steps<negated_space, half>(14, rule, clip, clean);
  require_same_run(got, want);
  // The scenario covers what it is for: skipped and taken steps, clipped ones, and growth.
  const auto taken = std::count(want.skipped.begin(), want.skipped.end(), 0);
  CHECK(taken >= 5);
  CHECK(taken <= 12);
  CHECK(std::count_if(want.norms.begin(), want.norms.end(), [](float n) { return n > 0.05f; }) >= 3);
  CHECK(want.scaler.skipped >= 2);
  CHECK(got.optimizer_steps.front() == taken);  // the cancelled steps are not counted
  // set_scaler replaces the scaler in the space, which scaler() then reads.
  CHECK(got.scaler_after_set.scale == 64.f);
  CHECK(got.scaler_after_set.good_steps == 5);
  CHECK(got.scaler_after_set.skipped == 9);
  CHECK(got.scaler_after_set.skipped_in_row == 0);
}

// Gradient accumulation: train_step over three micro-batches (odd steps under no_sync) with
// fp16 loss scaling and clipping decides in the space as the host does; the overflow vote
// and the norm cover every micro-batch, so NaN targets in the last one alone cancel the step.
TEST_CASE("train_step over micro-batches with fp16 loss scaling and clipping decides in the model's space as the host "
          "does",
          "[staging][train_step][compute16][accumulation]") {
  const shard::loss_scaler rule{.scale = 1048576.f, .growth_interval = 3};
  const auto clip = [](int) { return 0.05f; };
  const auto clean = [](int) { return false; };
  const auto want = decided_steps<host_space, half>(10, rule, clip, clean, 3);
  const auto got = decided_steps<negated_space, half>(10, rule, clip, clean, 3);
  require_same_run(got, want);
  const auto taken = std::count(want.skipped.begin(), want.skipped.end(), 0);
  CHECK(taken >= 3);
  CHECK(taken <= 8);
  CHECK(want.scaler.skipped >= 2);
  // fp32, the last micro-batch's targets poisoned at step 2: that step alone is cancelled
  const auto poisoned = [](int s) { return s == 2; };
  const auto want32 = decided_steps<host_space, float>(5, {}, clip, poisoned, 3);
  const auto got32 = decided_steps<negated_space, float>(5, {}, clip, poisoned, 3);
  require_same_run(got32, want32);
  CHECK(want32.skipped == std::vector<int>{0, 0, 1, 0, 0});
  CHECK(std::isnan(want32.norms[2]));
  CHECK(got32.optimizer_steps.front() == 4);
}

TEST_CASE("clipping alone: a non-finite norm cancels the step in the space, and later unclipped steps count only "
          "the steps taken",
          "[staging][train_step]") {
  // Even steps clip, odd ones do not (no decision: the optimizer steps through the gate
  // with a flag that never cancels); step 2's NaN targets make its norm NaN.
  const auto clip = [](int s) { return s % 2 == 0 ? 0.05f : 0.f; };
  const auto poisoned = [](int s) { return s == 2; };
  const auto want = decided_steps<host_space, float>(9, {}, clip, poisoned);
  const auto got = decided_steps<negated_space, float>(9, {}, clip, poisoned);
  require_same_run(got, want);
  CHECK(want.skipped == std::vector<int>{0, 0, 1, 0, 0, 0, 0, 0, 0});
  CHECK(std::isnan(want.norms[2]));
  CHECK(got.optimizer_steps.front() == 8);
}

TEST_CASE("too many skipped steps in a row raise the host's error when the space's result is read",
          "[staging][train_step][compute16][bad]") {
  const shard::loss_scaler rule{.max_skipped_in_row = 3};
  const auto always = [](int) { return true; };
  const auto no_clip = [](int) { return 0.f; };
  const auto want = decided_steps<host_space, half>(5, rule, no_clip, always);    // raises in the third train_step
  const auto got = decided_steps<negated_space, half>(5, rule, no_clip, always);  // all issued; the third result raises
  CHECK_THAT(want.error, Contains("rank 0: loss scaling: 3 steps in a row were skipped"));
  CHECK(got.error == want.error);
}

TEST_CASE("the scaler's error stays: a result read after the exhausting step's raises it too",
          "[staging][train_step][compute16][bad]") {
  // Steps 0-2 overflow (the third exhausts the scaler), 3-5 are good; only the last is read.
  const shard::loss_scaler rule{.max_skipped_in_row = 3};
  std::string raised;
  comm::launch(1, [&](comm::ThreadComm& c) {
    negated::negated_comm cc(c);
    auto model = make_model<negated_space, half>();
    auto sharded = shard::fully_shard<negated::Adam<negated_space>>(
        model, cc, shard::FullShard{},
        shard::options{.wrap = shard::wrap_types<Layer<negated_space, half>>{}, .precision = {.param = dtype::f16},
                       .scaler = rule});
    negated::Adam<negated_space> opt{{.lr = 0.01}};
    auto loss = [](const Tensor<half, negated_space>& y, const Tensor<float>& t) { return negated::mse(y, t); };
    std::optional<shard::pending_step_result> last;
    for (int s = 0; s < 6; ++s) {
      Tensor<float> target = batch(s, 3, 2, 0, 1);
      if (s < 3) target[0] = std::numeric_limits<float>::quiet_NaN();
      last = sharded.train_step(opt, negated::to_space<negated_space, half>(batch(s, 5, 1, 0, 1)), target, loss);
    }
    try {
      (void)float(last->loss);
    } catch (const error& e) {
      raised = e.what();
    }
  });
  CHECK_THAT(raised, Contains("rank 0: loss scaling: 3 steps in a row were skipped") &&
                        Contains("the loss scale fell to 8192 (min_scale 1)"));
}

}  // namespace test_device_staging
