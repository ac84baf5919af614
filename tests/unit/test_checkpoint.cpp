// Sharded checkpoints: exact round trips; resharding across world sizes, strategies and
// wrap policies with training continuing as if uninterrupted; ranged reads; atomic saves
// under injected failures and a full disk; keep-last-K; consolidation to and from
// safetensors; and bad input of every kind, each raising on every rank and losing nothing.
#include "custom_strategy/hybrid_zero2.hpp"
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/io/safetensors.hpp"
#include "shardlib/io/state_dict_files.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/sgd.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/checkpoint_files.hpp"
#include "support/compare.hpp"
#include "support/raised.hpp"

#include <catch2/catch.hpp>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>      // open: waking a reader blocked on a FIFO
#include <sys/mount.h>  // mount, umount2: the full-disk test's small tmpfs
#include <sys/stat.h>   // mkfifo
#include <sys/wait.h>   // waitpid
#include <unistd.h>     // getpid, fork, setuid, pipe

namespace test_checkpoint {

using namespace shardlib;
using Catch::Contains;
using Catch::StartsWith;
namespace fs = std::filesystem;

namespace {

using Block = nn::Linear<float>;
using Model = nn::Sequential<nn::Linear<float>, nn::Stack<Block>, nn::Linear<float>>;

Model make_model(int hidden = 12, int blocks = 3, int out = 3) {
  return Model{nn::Linear<float>(5, hidden), nn::Stack<Block>(std::size_t(blocks), Block(hidden, hidden)),
               nn::Linear<float>(hidden, out)};
}
shard::options wrap_blocks(std::uint64_t seed = 42) { return {.wrap = shard::wrap_types<Block>{}, .seed = seed}; }

// A fresh directory under /tmp, removed with its contents at scope exit.
struct temp_dir {
  fs::path path;
  explicit temp_dir(std::string_view name)
      : path(fs::temp_directory_path() / cat("shardlib_test_checkpoint_", name, "_", ::getpid())) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path operator/(std::string_view p) const { return path / p; }
};

// The global batch of step s has 24 rows (divisible by every world size used here);
// a rank takes rows [rank * 24 / W, (rank + 1) * 24 / W).
constexpr int global_rows = 24;
Tensor<float> batch(int step, std::int64_t rows, std::int64_t cols, std::uint64_t stream, std::int64_t first) {
  Tensor<float> t({rows, cols});
  counter_rng rng(1000 + std::uint64_t(step), stream);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = 2 * rng.uniform_float(std::uint64_t(first * cols + i)) - 1;
  return t;
}

// Adam steps [first, first + steps) on this rank's rows; the losses averaged over ranks.
template <class Sharded, class O>
std::vector<float> train(Sharded& model, O& opt, int first, int steps) {
  auto& c = model.comm();
  const int rows = global_rows / c.size();
  std::vector<float> losses;
  for (int s = first; s < first + steps; ++s) {
    auto x = batch(s, rows, 5, 1, c.rank() * rows), y = batch(s, rows, 3, 2, c.rank() * rows);
    std::vector<float> l{model.train_step(opt, x, y, nn::mse_loss)};
    c.all_reduce(std::span<float>(l), comm::reduce_op::avg);
    losses.push_back(l[0]);
  }
  return losses;
}

// Everything a model and its optimizer hold, as a consolidated export writes it.
struct snapshot {
  std::map<std::string, std::vector<float>> tensors;
  nlohmann::json info;  // the "shardlib" metadata: steps, optimizer step and hyperparameters, scaler
};
snapshot read_snapshot(const fs::path& file) {
  const auto f = io::safetensors::load(file);
  snapshot s;
  for (const auto& t : f.tensors()) s.tensors[t.name] = f.get<float>(t.name);
  s.info = nlohmann::json::parse(f.metadata().at("shardlib"));
  return s;
}
// Collective; rank 0 returns the snapshot, the others an empty one.
template <class Sharded, class O>
snapshot take_snapshot(Sharded& model, O& opt, const fs::path& file) {
  io::export_safetensors(file, model, opt);
  snapshot s;
  if (model.comm().rank() == 0) s = read_snapshot(file);
  model.comm().barrier();
  return s;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}
// The first tensor that differs in any bit, or "" when all are identical.
std::string first_difference(const snapshot& a, const snapshot& b) {
  if (a.tensors.size() != b.tensors.size()) return cat(a.tensors.size(), " vs ", b.tensors.size(), " tensors");
  for (const auto& [name, v] : a.tensors) {
    const auto it = b.tensors.find(name);
    if (it == b.tensors.end()) return cat("'", name, "' missing");
    if (!same_bits(v, it->second)) return cat("'", name, "' differs");
  }
  return "";
}

double rel(double a, double b, double floor) { return test_support::relative_error(a, b, floor); }  // NaN: +inf
// Worst relative difference of the parameters (not the optimizer state) of two
// snapshots, for the fp32 tolerance of tests/unit/test_shard.cpp (1e-5: runs on other
// world sizes sum the same terms in another order). Its floor there is 1e-3 for SGD,
// whose steps scale with the gradient; Adam's steps are about lr in size whatever the
// gradient's scale, so a rounding difference moves a parameter near zero by a few ulps
// of lr: the floor here is lr = 1e-2. Observed: at most 1e-6 (3e-8 absolute).
test_support::max_error worst_parameter_difference(const snapshot& got, const snapshot& want) {
  test_support::max_error worst;  // NaN and infinities count as +inf
  for (const auto& [name, v] : want.tensors) {
    if (name.starts_with("optimizer.")) continue;
    worst.relative(got.tensors.at(name), v, 1e-2);
  }
  return worst;
}

// body(model, optimizer, comm) on every rank, the model wrapped for optimizer O (every
// strategy as shard::AnyStrategy: one engine type per optimizer, not one per strategy).
template <class O = optim::Adam, class Body>
void on_ranks(int world, shard::AnyStrategy strategy, shard::options opts, Body&& body, int hidden = 12,
              int blocks = 3) {
  comm::launch(world, [&](comm::ThreadComm& c) {
    Model m = make_model(hidden, blocks);
    auto model = shard::fully_shard<O>(m, c, strategy, opts);
    O opt{{.lr = 1e-2}};
    body(model, opt, c);
  });
}

std::vector<std::byte> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), {});
  std::vector<std::byte> b(c.size());
  std::memcpy(b.data(), c.data(), c.size());
  return b;
}
void write_bytes(const fs::path& p, const std::vector<std::byte>& b) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(b.data()),
                                                               std::streamsize(b.size()));
}
void flip_byte(const fs::path& p, std::size_t at) {
  auto b = read_bytes(p);
  b.at(at) ^= std::byte{0x20};
  write_bytes(p, b);
}

// Writes metadata.json around the body text given, with its checksum.
void write_metadata_body(const fs::path& file, const std::string& dumped) {
  std::array<char, 17> hash{};
  std::snprintf(hash.data(), hash.size(), "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(dumped.data(), dumped.size())));
  const std::string out = cat("{\"xxh3_64\":\"", hash.data(), "\",\"metadata\":", dumped, "}\n");
  std::vector<std::byte> b(out.size());
  std::memcpy(b.data(), out.data(), out.size());
  write_bytes(file, b);
}

// Rewrites metadata.json after edit(body) with a correct checksum, as someone who
// edits it by hand (or a buggy tool) would: the checksum cannot catch this.
template <class Edit>
void edit_metadata(const fs::path& ckpt, Edit&& edit) {
  const auto file = ckpt / "metadata.json";
  const auto bytes = read_bytes(file);
  const std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  const std::string head = "{\"xxh3_64\":\"0000000000000000\",\"metadata\":";
  auto body = nlohmann::json::parse(text.substr(head.size(), text.size() - head.size() - 2));
  edit(body);
  write_metadata_body(file, body.dump(1));
}

std::vector<std::string> dir_names(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A trained 3-rank FullShard checkpoint in root/step-00000002 and its snapshot.
snapshot make_checkpoint(const fs::path& root, const fs::path& snap_file) {
  snapshot saved;
  on_ranks(3, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, auto&) {
    train(model, adam, 0, 2);
    io::save_checkpoint(root, model, adam, {.chunk_bytes = 256});
    auto s = take_snapshot(model, adam, snap_file);
    if (model.comm().rank() == 0) saved = std::move(s);
  });
  return saved;
}

// Loads `path` on 3 FullShard ranks into a fresh model and returns every rank's error
// (empty: none) and whether each rank's state was left exactly as it was.
struct load_outcome {
  std::vector<std::string> errors;
  std::vector<int> untouched;
};
template <class Load>
load_outcome try_load(const fs::path& scratch, Load&& load, int hidden = 12, int blocks = 3) {
  load_outcome r{std::vector<std::string>(3), std::vector<int>(3, 0)};
  on_ranks(
      3, shard::FullShard{}, wrap_blocks(7),
      [&](auto& model, auto& adam, comm::ThreadComm& c) {
        const auto before = take_snapshot(model, adam, scratch / "before.safetensors");
        try {
          load(model, adam);
        } catch (const io_error& e) {
          r.errors[std::size_t(c.rank())] = e.what();
        }
        const auto after = take_snapshot(model, adam, scratch / "after.safetensors");
        r.untouched[std::size_t(c.rank())] = c.rank() != 0 || first_difference(before, after).empty();
      },
      hidden, blocks);
  return r;
}
// Every rank raised; the failing rank's error says `what`, the others name that rank.
void check_raised_everywhere(const load_outcome& r, const std::string& what) {
  for (std::size_t i = 0; i < r.errors.size(); ++i) {
    INFO("rank " << i << ": " << r.errors[i]);
    CHECK_THAT(r.errors[i], Contains(cat("rank ", i, ": loading")));
    CHECK_THAT(r.errors[i], Contains(what));
    CHECK(r.untouched[i] == 1);
  }
}

}  // namespace

TEST_CASE("a checkpoint round trip at the same world size restores everything exactly", "[checkpoint]") {
  temp_dir dir("round_trip");
  const nlohmann::json user{{"epoch", 2}, {"rng", {1, 2, 3}}, {"note", "resume me"}};
  snapshot saved, loaded;
  std::vector<float> after_saved, after_loaded;
  io::load_result result;
  optim::AdamW::options_type restored_options;
  comm::launch(3, [&](comm::ThreadComm& c) {
    Model m = make_model();
    auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, wrap_blocks());
    optim::AdamW adamw{{.lr = 2e-2, .weight_decay = 0.1, .amsgrad = true}};
    train(model, adamw, 0, 3);
    const auto path = io::save_checkpoint(dir.path, model, adamw, {.user = user});
    auto s = take_snapshot(model, adamw, dir / "saved.safetensors");
    auto continued = train(model, adamw, 3, 2);

    Model m2 = make_model();
    auto fresh = shard::fully_shard<optim::AdamW>(m2, c, shard::FullShard{}, wrap_blocks(7));  // other values
    optim::AdamW other;                                                                        // default options
    auto r = io::load_checkpoint(path, fresh, other);
    auto l = take_snapshot(fresh, other, dir / "loaded.safetensors");
    auto continued_loaded = train(fresh, other, 3, 2);
    if (c.rank() == 0) {
      saved = std::move(s);
      loaded = std::move(l);
      result = r;
      restored_options = other.options;
      after_saved = continued;
      after_loaded = continued_loaded;
    }
  });
  CHECK(first_difference(loaded, saved).empty());
  CHECK(saved.tensors.contains("optimizer.1.layers.0.weight.max_exp_avg_sq"));  // amsgrad's buffer too
  CHECK(loaded.info == saved.info);  // steps, optimizer step and hyperparameters
  CHECK(result.metadata.steps == 3);
  CHECK(result.metadata.user == user);
  CHECK(result.path == dir / "step-00000003");
  CHECK(restored_options.lr == 2e-2);
  CHECK(restored_options.amsgrad);
  CHECK(same_bits(after_loaded, after_saved));  // same world and strategy: training continues bit for bit
}

TEST_CASE("the step count and the fp16 loss scaler are restored", "[checkpoint][precision]") {
  temp_dir dir("scaler");
  shard::loss_scaler before, after;
  std::uint64_t steps = 0;
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto opts = wrap_blocks();
    opts.precision = {.param = dtype::f16, .reduce = dtype::f16};
    opts.scaler = {.scale = 1024.f, .growth_interval = 2, .min_scale = 2.f, .max_scale = 1e6f, .max_skipped_in_row = 7};
    Model m = make_model();
    auto model = shard::fully_shard(m, c, shard::FullShard{}, opts);
    optim::Adam adam;
    train(model, adam, 0, 3);  // one growth: scale 2048, one good step since
    io::save_checkpoint(dir.path, model, adam);
    Model m2 = make_model();
    auto fresh = shard::fully_shard(m2, c, shard::NoShard{}, opts);
    optim::Adam adam2;
    io::load_checkpoint(dir.path, fresh, adam2);
    if (c.rank() == 0) {
      before = *model.scaler();
      after = *fresh.scaler();
      steps = fresh.steps();
    }
  });
  CHECK(before.scale == 2048.f);
  CHECK(after.scale == before.scale);
  CHECK(after.good_steps == before.good_steps);
  CHECK(after.growth_interval == 2);
  CHECK(after.min_scale == 2.f);
  CHECK(after.max_scale == 1e6f);
  CHECK(after.max_skipped_in_row == 7);
  CHECK(steps == 3);
}

namespace {
// Trains n1 steps on `from`, saves, loads on `to` (another seed: every value must come
// from the checkpoint), trains n2 more: the state right after loading equals the saved
// one bit for bit, and the continued run matches an uninterrupted one on `from` within
// the fp32 tolerance of tests/unit/test_shard.cpp (the sums run in another order).
template <class From, class To>
void check_reshard(int wf, From sf, int wt, To st, shard::options to_opts = wrap_blocks(7)) {
  INFO(wf << " ranks " << sf.name << " -> " << wt << " ranks " << st.name);
  temp_dir dir(cat("reshard_", wf, "_", wt));
  const int n1 = 3, n2 = 3;
  std::vector<float> ref_losses, losses;
  snapshot ref, saved, loaded, final_state;
  std::vector<std::vector<int>> files_read(static_cast<std::size_t>(wt));
  std::string recorded_strategy;
  on_ranks(wf, sf, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    auto l = train(model, adam, 0, n1 + n2);
    auto s = take_snapshot(model, adam, dir / "ref.safetensors");
    if (c.rank() == 0) {
      ref_losses = l;
      ref = std::move(s);
    }
  });
  on_ranks(wf, sf, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, n1);
    io::save_checkpoint(dir / "ckpt", model, adam);
    auto s = take_snapshot(model, adam, dir / "saved.safetensors");
    if (c.rank() == 0) saved = std::move(s);
  });
  on_ranks(wt, st, to_opts, [&](auto& model, auto& adam, comm::ThreadComm& c) {
    auto r = io::load_checkpoint(dir / "ckpt", model, adam);
    files_read[std::size_t(c.rank())] = r.files_read;
    if (c.rank() == 0) recorded_strategy = r.metadata.strategy;
    auto s = take_snapshot(model, adam, dir / "loaded.safetensors");
    auto l = train(model, adam, n1, n2);
    auto f = take_snapshot(model, adam, dir / "final.safetensors");
    if (c.rank() == 0) {
      losses = l;
      loaded = std::move(s);
      final_state = std::move(f);
    }
  });
  CHECK(first_difference(loaded, saved) == "");
  CHECK(recorded_strategy == std::string(sf.name));  // the saving strategy's own name, also through AnyStrategy
  REQUIRE(losses.size() == std::size_t(n2));
  test_support::max_error worst_loss;
  for (int s = 0; s < n2; ++s) worst_loss.relative(losses[std::size_t(s)], ref_losses[std::size_t(n1 + s)], 1e-6);
  const auto worst_param = worst_parameter_difference(final_state, ref);
  INFO("worst relative loss difference " << worst_loss << ", parameters " << worst_param);
  CHECK(worst_loss <= 1e-5);
  CHECK(worst_param <= 1e-5);
  CHECK(ref_losses.back() < ref_losses.front());  // it trained
  for (const auto& f : files_read) CHECK(!f.empty());
}
}  // namespace

TEST_CASE("a resharding load continues training as if uninterrupted", "[checkpoint][reshard]") {
  check_reshard(4, shard::FullShard{}, 2, shard::FullShard{});
  check_reshard(2, shard::FullShard{}, 3, shard::FullShard{});
  check_reshard(3, shard::FullShard{}, 8, shard::FullShard{});
  check_reshard(4, shard::FullShard{}, 3, shard::FullShard{});
  check_reshard(4, shard::FullShard{}, 4, shard::FullShard{});
  check_reshard(4, shard::FullShard{}, 4, shard::NoShard{});
  check_reshard(4, shard::HybridShard{.group_size = 2}, 4, shard::FullShard{});
  check_reshard(1, shard::FullShard{}, 4, shard::HybridShard{.group_size = 2});
  check_reshard(2, shard::ShardOptimizer{}, 3, shard::ShardGradOp{});
  check_reshard(3, shard::NoShard{}, 2, shard::ShardOptimizer{});
  // Strategies chosen at run time (one engine type for all).
  check_reshard(4, shard::AnyStrategy(shard::HybridShard{.group_size = 2}), 3, shard::AnyStrategy(shard::ShardGradOp{}));
  check_reshard(2, shard::AnyStrategy(shard::NoShard{}), 4, shard::FullShard{});
}

TEST_CASE("a strategy defined by the user saves, reshards and exports with no code of its own",
          "[checkpoint][reshard][custom_strategy]") {
  check_reshard(4, example::HybridShardZeRO2{.group_size = 2}, 3, shard::FullShard{});
  check_reshard(2, shard::FullShard{}, 4, example::HybridShardZeRO2{.group_size = 2});
  check_reshard(4, example::HybridShardZeRO2{.group_size = 2}, 2, example::HybridShardZeRO2{.group_size = 1});
}

TEST_CASE("ZeRO-1 in bf16 saves its sharded fp32 master, and loads it on any world and strategy",
          "[checkpoint][reshard][precision]") {
  temp_dir dir("zero1_bf16");
  shard::options bf16 = wrap_blocks(7);
  bf16.precision = {.param = dtype::bf16, .reduce = dtype::bf16};
  snapshot saved;
  on_ranks(2, shard::ShardOptimizer{}, bf16, [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, 3);
    io::save_checkpoint(dir / "ckpt", model, adam);
    auto s = take_snapshot(model, adam, dir / "saved.safetensors");
    if (c.rank() == 0) saved = std::move(s);
  });
  const auto check_load = [&](int world, auto strategy) {
    snapshot loaded;
    on_ranks(world, strategy, bf16, [&](auto& model, auto& adam, comm::ThreadComm& c) {
      io::load_checkpoint(dir / "ckpt", model, adam);
      auto s = take_snapshot(model, adam, dir / "loaded.safetensors");
      if (c.rank() == 0) loaded = std::move(s);
    });
    INFO(world << " ranks " << decltype(strategy)::name);
    CHECK(first_difference(loaded, saved) == "");
  };
  check_load(3, shard::ShardOptimizer{});
  check_load(4, shard::FullShard{});
  check_load(1, shard::NoShard{});
}

TEST_CASE("a resharding load maps parameters by name when the wrap policy differs", "[checkpoint][reshard]") {
  check_reshard(4, shard::FullShard{}, 2, shard::FullShard{}, {.seed = 7});  // one unit instead of four
  check_reshard(2, shard::ShardGradOp{}, 3, shard::FullShard{},
                {.wrap = shard::wrap_names{{"1.layers.1"}}, .seed = 7});
}

TEST_CASE("each rank reads only the byte ranges of its own shards", "[checkpoint][reshard]") {
  temp_dir dir("ranged");
  std::uint64_t total = 0;
  on_ranks(4, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, auto&) {
    train(model, adam, 0, 1);
    io::save_checkpoint(dir.path, model, adam, {.chunk_bytes = 64});
  });
  for (const auto& e : fs::recursive_directory_iterator(dir.path))
    if (e.path().extension() == ".safetensors") total += e.file_size();
  std::vector<io::load_result> results(2);
  on_ranks(2, shard::FullShard{}, wrap_blocks(7), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    results[std::size_t(c.rank())] = io::load_checkpoint(dir.path, model, adam);
  });
  // The first half of every unit is in files 0-1, the second half in files 2-3.
  CHECK(results[0].files_read == std::vector<int>{0, 1});
  CHECK(results[1].files_read == std::vector<int>{2, 3});
  for (const auto& r : results) {
    INFO("read " << r.bytes_read << " of " << total << " bytes");
    CHECK(r.bytes_read > total / 4);
    CHECK(r.bytes_read < total * 3 / 4);
  }
}

TEST_CASE("a failure on one rank mid-save raises on every rank and keeps the previous checkpoint",
          "[checkpoint][atomic]") {
  temp_dir dir("atomic");
  snapshot first, reloaded;
  std::vector<std::string> errors(3);
  on_ranks(3, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, 2);
    io::save_checkpoint(dir.path, model, adam);
    auto s = take_snapshot(model, adam, dir / "first.safetensors");
    train(model, adam, 2, 1);
    const io::save_options failing{.chunk_bytes = 64, .write_hook = [](const io::write_event& e) {
                                     if (e.rank == 2 && e.offset > 0) throw std::runtime_error("injected failure");
                                     return 0;
                                   }};
    try {
      io::save_checkpoint(dir.path, model, adam, failing);
    } catch (const io_error& e) {
      errors[std::size_t(c.rank())] = e.what();
    }
    if (c.rank() == 0) first = std::move(s);
  });
  CHECK_THAT(errors[2], Contains("rank 2: saving checkpoint") && Contains("injected failure"));
  for (int r : {0, 1})
    CHECK_THAT(errors[std::size_t(r)], Contains("stopped because rank 2 failed") && Contains("injected failure"));
  CHECK(dir_names(dir.path) == std::vector<std::string>{"first.safetensors", "step-00000002"});
  on_ranks(2, shard::FullShard{}, wrap_blocks(7), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    io::load_checkpoint(dir.path, model, adam);
    auto s = take_snapshot(model, adam, dir / "reloaded.safetensors");
    if (c.rank() == 0) reloaded = std::move(s);
  });
  CHECK(first_difference(reloaded, first) == "");
}

// --- async_save_checkpoint ----------------------------------------------------------------------
namespace {
// A write hook that holds each rank's first write until the rank's training thread says
// so (or 30 s pass): a save that wrote on the calling thread would hold that thread, and
// the rank would report that it never released its own writes.
struct held_writes {
  std::array<std::atomic<bool>, 3> go{};
  std::array<int, 3> released{-1, -1, -1};  // per rank: 1 released by its thread, 0 timed out
  io::write_callback hook() {
    return [this](const io::write_event& e) {
      auto& r = released[std::size_t(e.rank)];
      if (r == -1) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (!go[std::size_t(e.rank)].load() && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        r = go[std::size_t(e.rank)].load() ? 1 : 0;
      }
      return 0;
    };
  }
};
}  // namespace

TEST_CASE("async_save_checkpoint writes while training goes on, the values of its call, as save_checkpoint does",
          "[checkpoint][async]") {
  temp_dir dir("async");
  held_writes held;
  std::vector<int> written_before_wait(3, -1);
  std::vector<std::string> paths(3);
  on_ranks(3, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, 2);
    io::save_checkpoint(dir / "sync", model, adam, {.tag = "t", .chunk_bytes = 256});
    auto pending =
        io::async_save_checkpoint(dir / "async", model, adam, {.tag = "t", .chunk_bytes = 256, .write_hook = held.hook()});
    train(model, adam, 2, 2);  // collectives and new values while the files are being written
    const int r = c.rank();
    written_before_wait[std::size_t(r)] = pending.written();  // held: not yet
    held.go[std::size_t(r)] = true;
    paths[std::size_t(r)] = pending.wait().string();
  });
  CHECK(held.released == std::array<int, 3>{1, 1, 1});
  CHECK(written_before_wait == std::vector<int>{0, 0, 0});
  for (const auto& p : paths) CHECK(p == (dir / "async" / "t").string());
  const auto sync = test_support::files_under(dir / "sync" / "t"), async = test_support::files_under(dir / "async" / "t");
  CHECK(sync.size() == 4);  // metadata.json and three shard files
  CHECK(async == sync);     // byte for byte: the values of step 2, not step 4
  CHECK(dir_names(dir / "async") == std::vector<std::string>{"t"});
}

TEST_CASE("an async save that fails on one rank raises at wait on every rank and keeps the previous checkpoint",
          "[checkpoint][async][atomic]") {
  temp_dir dir("async_fail");
  std::vector<std::string> errors(3);
  std::vector<int> written(3, 0);
  on_ranks(3, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, 2);
    io::save_checkpoint(dir.path, model, adam);
    auto pending = io::async_save_checkpoint(dir.path, model, adam, {.write_hook = [](const io::write_event& e) {
                                                                      return e.rank == 1 ? ENOSPC : 0;
                                                                    }});
    train(model, adam, 2, 1);
    while (!pending.written()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    written[std::size_t(c.rank())] = 1;
    errors[std::size_t(c.rank())] = test_support::raised([&] { pending.wait(); });
  });
  CHECK(written == std::vector<int>{1, 1, 1});
  CHECK_THAT(errors[1], StartsWith("rank 1: saving checkpoint") && Contains("No space left on device"));
  for (int r : {0, 2})
    CHECK_THAT(errors[std::size_t(r)], Contains("stopped because rank 1 failed") && Contains("No space left"));
  CHECK(dir_names(dir.path) == std::vector<std::string>{"step-00000002"});  // no step 3, no temporary directory
}

TEST_CASE("a save under a tag in flight is refused, others go on beside it, and an abandoned one leaves nothing",
          "[checkpoint][async]") {
  temp_dir dir("async_tags");
  held_writes held;
  std::vector<std::string> refused(3), respelled(3);
  on_ranks(3, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, 1);
    auto x = io::async_save_checkpoint(dir.path, model, adam, {.tag = "x", .write_hook = held.hook()});
    refused[std::size_t(c.rank())] =
        test_support::raised([&] { io::save_checkpoint(dir.path, model, adam, {.tag = "x"}); });
    respelled[std::size_t(c.rank())] =  // the same directory spelled another way
        test_support::raised([&] { io::save_checkpoint(dir.path / "." / "", model, adam, {.tag = "x"}); });
    train(model, adam, 1, 1);
    io::save_checkpoint(dir.path, model, adam, {.tag = "y"});  // completes first; its pruning spares x's directory
    held.go[std::size_t(c.rank())] = true;
    x.wait();  // commits after y, numbered before it: begun before it
    {
      auto abandoned = io::async_save_checkpoint(dir.path, model, adam, {.tag = "z"});
    }  // destroyed without wait: nothing committed
    io::save_checkpoint(dir.path, model, adam, {.keep_last = 3, .tag = "w"});  // removes z's temporary directory
  });
  CHECK_THAT(refused[0], Contains("rank 0: saving checkpoint") && Contains("a save under this tag is still in flight"));
  for (int r : {1, 2}) CHECK_THAT(refused[std::size_t(r)], Contains("stopped because rank 0 failed"));
  CHECK_THAT(respelled[0], Contains("a save under this tag is still in flight"));
  CHECK(dir_names(dir.path) == std::vector<std::string>{"w", "x", "y"});
  CHECK(io::read_checkpoint_metadata(dir / "y").sequence == io::read_checkpoint_metadata(dir / "x").sequence + 1);
  CHECK(io::read_checkpoint_metadata(dir / "w").sequence == io::read_checkpoint_metadata(dir / "y").sequence + 1);
  CHECK(io::read_checkpoint_metadata(dir / "x").steps == 1);  // the values of its call
  CHECK(io::read_checkpoint_metadata(dir / "y").steps == 2);
}

TEST_CASE("an async save's keep_last takes old checkpoints out of sight at once and deletes them in the background",
          "[checkpoint][async][keep]") {
  temp_dir dir("async_keep");
  fs::create_directories(dir / ".tmp-#purge-left-by-a-killed-process" / "x");  // cleaned up too
  std::vector<std::vector<std::string>> listed(2);  // rank 0's list after each wait
  auto& deleter = io::detail::background_deleter::instance();
  deleter.pause(true);  // what wait() leaves to the thread stays on the disk until resumed
  on_ranks(3, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    for (int k = 0; k < 3; ++k) {
      train(model, adam, k, 1);
      auto pending = io::async_save_checkpoint(dir.path, model, adam, {.keep_last = 1});
      pending.wait();
      if (k == 0 || c.rank() != 0) continue;
      for (const auto& e : io::list_checkpoints(dir.path)) listed[std::size_t(k - 1)].push_back(e.path.filename().string());
    }
  });
  CHECK(listed[0] == std::vector<std::string>{"step-00000002"});  // at once: the old one is no checkpoint any more
  CHECK(listed[1] == std::vector<std::string>{"step-00000003"});
  CHECK(dir_names(dir.path) == std::vector<std::string>{".tmp-#purge-left-by-a-killed-process",
                                                         ".tmp-#purge-step-00000001", ".tmp-#purge-step-00000002",
                                                         "step-00000003"});  // renamed, not deleted, by wait()
  deleter.pause(false);
  io::finish_background_deletions();
  CHECK(dir_names(dir.path) == std::vector<std::string>{"step-00000003"});  // and then gone from the disk
}

TEST_CASE("a full disk mid-write (an injected ENOSPC) and a failed metadata write lose nothing",
          "[checkpoint][atomic]") {
  temp_dir dir("enospc");
  std::vector<std::string> data_errors(3), metadata_errors(3);
  on_ranks(3, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, 1);
    io::save_checkpoint(dir.path, model, adam);
    train(model, adam, 1, 1);
    try {
      io::save_checkpoint(dir.path, model, adam, {.chunk_bytes = 256, .write_hook = [](const io::write_event& e) {
                                                     return e.rank == 1 && e.offset >= 256 ? ENOSPC : 0;
                                                   }});
    } catch (const io_error& e) {
      data_errors[std::size_t(c.rank())] = e.what();
    }
    try {
      io::save_checkpoint(dir.path, model, adam, {.write_hook = [](const io::write_event& e) {
                                                     return e.file.filename() == "metadata.json" ? EIO : 0;
                                                   }});
    } catch (const io_error& e) {
      metadata_errors[std::size_t(c.rank())] = e.what();
    }
  });
  CHECK_THAT(data_errors[1], Contains("rank 1: saving") && Contains("shard-00001-of-00003.safetensors: cannot write "
                                                                     "bytes [256, 512): No space left on device"));
  CHECK_THAT(data_errors[0], Contains("stopped because rank 1 failed") && Contains("No space left on device"));
  CHECK_THAT(metadata_errors[0], Contains("metadata.json: cannot write") && Contains("Input/output error"));
  CHECK_THAT(metadata_errors[2], Contains("stopped because rank 0 failed"));
  CHECK(dir_names(dir.path) == std::vector<std::string>{"step-00000001"});
  CHECK(io::verify_checkpoint(dir.path).empty());
}

namespace {
// A tmpfs of `size` mounted on dir while in scope (needs CAP_SYS_ADMIN).
struct tmpfs_mount {
  fs::path dir;
  bool mounted = false;
  tmpfs_mount(fs::path d, const char* size) : dir(std::move(d)) {
    fs::create_directories(dir);
    mounted = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, cat("size=", size).c_str()) == 0;
  }
  ~tmpfs_mount() {
    if (mounted) ::umount2(dir.c_str(), MNT_DETACH);
  }
};
}  // namespace

TEST_CASE("a real full disk (a 64 KiB tmpfs) fails the save on every rank and keeps the previous checkpoint",
          "[checkpoint][atomic][tmpfs]") {
  temp_dir dir("tmpfs");
  tmpfs_mount disk(dir / "disk", "64k");
  if (!disk.mounted) {
    WARN("skipped: cannot mount a tmpfs here (" << std::strerror(errno) << "); the injected ENOSPC test covers the logic");
    return;
  }
  std::vector<std::string> errors(2);
  snapshot first, reloaded;
  // 2787 parameters: 33 KiB of state per checkpoint, so the first fits and the second cannot.
  on_ranks(
      2, shard::FullShard{}, wrap_blocks(),
      [&](auto& model, auto& adam, comm::ThreadComm& c) {
        train(model, adam, 0, 1);
        io::save_checkpoint(disk.dir, model, adam);
        auto s = take_snapshot(model, adam, dir / "first.safetensors");
        train(model, adam, 1, 1);
        try {
          io::save_checkpoint(disk.dir, model, adam);
        } catch (const io_error& e) {
          errors[std::size_t(c.rank())] = e.what();
        }
        if (c.rank() == 0) first = std::move(s);
      },
      48, 1);
  for (const auto& e : errors) CHECK_THAT(e, Contains("No space left on device"));
  CHECK(dir_names(disk.dir) == std::vector<std::string>{"step-00000001"});
  on_ranks(
      3, shard::FullShard{}, wrap_blocks(7),
      [&](auto& model, auto& adam, comm::ThreadComm& c) {
        io::load_checkpoint(disk.dir, model, adam);
        auto s = take_snapshot(model, adam, dir / "reloaded.safetensors");
        if (c.rank() == 0) reloaded = std::move(s);
      },
      48, 1);
  CHECK(first_difference(reloaded, first) == "");
}

TEST_CASE("keep_last keeps the newest K complete checkpoints, and a failed save deletes none", "[checkpoint][keep]") {
  temp_dir dir("keep");
  std::uint64_t latest_steps = 0;
  on_ranks(2, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, auto&) {
    for (int s = 0; s < 4; ++s) {
      train(model, adam, s, 1);
      io::save_checkpoint(dir.path, model, adam, {.keep_last = 2});
    }
    train(model, adam, 4, 1);
    try {
      io::save_checkpoint(dir.path, model, adam, {.keep_last = 2, .write_hook = [](const io::write_event&) {
                                                     return ENOSPC;
                                                   }});
    } catch (const io_error&) {
    }
  });
  CHECK(dir_names(dir.path) == std::vector<std::string>{"step-00000003", "step-00000004"});
  const auto entries = io::list_checkpoints(dir.path);
  REQUIRE(entries.size() == 2);
  CHECK(entries[1].metadata->sequence == 4);
  on_ranks(1, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, auto&) {
    latest_steps = io::load_checkpoint(dir.path, model, adam).metadata.steps;
  });
  CHECK(latest_steps == 4);
}

TEST_CASE("saving under an existing tag replaces it in one atomic step", "[checkpoint][atomic]") {
  temp_dir dir("retag");
  on_ranks(2, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, auto&) {
    train(model, adam, 0, 1);
    io::save_checkpoint(dir.path, model, adam, {.tag = "best"});
    train(model, adam, 1, 1);
    io::save_checkpoint(dir.path, model, adam, {.tag = "best"});
  });
  CHECK(dir_names(dir.path) == std::vector<std::string>{"best"});
  const auto m = io::read_checkpoint_metadata(dir / "best");
  CHECK(m.steps == 2);
  CHECK(m.sequence == 2);
  CHECK(io::verify_checkpoint(dir / "best").empty());
}

// Metadata shapes: too many elements, or an empty shape whose other extents multiply
// past what Shape holds, are the file's error (io_error naming it), not a shape_error.
TEST_CASE("metadata shapes that no Shape holds are the file's error", "[checkpoint][bad]") {
  const auto error_of = [](const nlohmann::json& j) {
    try {
      io::detail::shape_from_json(j, "meta.json", "unit 0: ");
    } catch (const io_error& e) {
      return std::string(e.what());
    }
    return std::string("no io_error");
  };
  const std::int64_t big = std::int64_t(1) << 40;
  CHECK_THAT(error_of({big, big}), Contains("meta.json: unit 0: shape [1099511627776,1099511627776] has too many"));
  CHECK_THAT(error_of({0, big, big}), Contains("meta.json: unit 0: Shape [0, 1099511627776, 1099511627776]: more than 2^60"));
  CHECK(io::detail::shape_from_json({0, big}, "meta.json", "") == Shape{0, big});
}

TEST_CASE("a tag naming a directory that is not a checkpoint leaves it alone", "[checkpoint][atomic]") {
  temp_dir dir("not_a_checkpoint");
  fs::create_directories(dir / "data");
  std::ofstream(dir / "data" / "keep.txt") << "the user's\n";
  std::vector<std::string> errors(2);
  on_ranks(2, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, auto& c) {
    try {
      io::save_checkpoint(dir.path, model, adam, {.tag = "data"});
    } catch (const io_error& e) {
      errors[std::size_t(c.rank())] = e.what();
    }
  });
  for (const auto& e : errors)
    CHECK_THAT(e, Contains((dir / "data").string() + ": exists and is not a checkpoint (it has no metadata.json)"));
  CHECK(fs::exists(dir / "data" / "keep.txt"));
  CHECK(dir_names(dir.path) == std::vector<std::string>{"data"});
}

TEST_CASE("bad input: each case raises a clear error on every rank and changes nothing", "[checkpoint][bad]") {
  temp_dir dir("bad");
  const auto root = dir / "root";
  make_checkpoint(root, dir / "saved.safetensors");
  const auto ckpt = root / "step-00000002";
  const auto work = dir / "work";
  auto fresh_copy = [&] {
    fs::remove_all(work);
    fs::copy(ckpt, work);
    return work;
  };
  auto load = [&](const fs::path& p) { return [p](auto& model, auto& adam) { io::load_checkpoint(p, model, adam); }; };

  SECTION("a missing shard file") {
    fs::remove(fresh_copy() / "shard-00001-of-00003.safetensors");
    const auto r = try_load(dir.path, load(work));
    check_raised_everywhere(r, "shard-00001-of-00003.safetensors: cannot open for reading: No such file or directory");
    CHECK_THAT(r.errors[0], Contains("stopped because rank 1 failed"));
  }
  SECTION("a truncated shard file") {
    const auto file = fresh_copy() / "shard-00002-of-00003.safetensors";
    fs::resize_file(file, fs::file_size(file) - 10);
    check_raised_everywhere(try_load(dir.path, load(work)), "bytes but the checkpoint's metadata records");
  }
  SECTION("a flipped byte in a shard file's header and in its data") {
    for (std::size_t at : {std::size_t(12), fs::file_size(ckpt / "shard-00000-of-00003.safetensors") - 5}) {
      flip_byte(fresh_copy() / "shard-00000-of-00003.safetensors", at);
      check_raised_everywhere(try_load(dir.path, load(work)), "do not match their checksum");
      CHECK(io::verify_checkpoint(work).size() == 1);
    }
  }
  SECTION("a flipped byte in metadata.json") {
    flip_byte(fresh_copy() / "metadata.json", 200);
    check_raised_everywhere(try_load(dir.path, load(work)), "the metadata does not match its checksum");
  }
  SECTION("metadata from another model: the error names the first difference") {
    fresh_copy();
    on_ranks(
        3, shard::FullShard{}, wrap_blocks(),
        [&](auto& model, auto& adam, auto&) { io::save_checkpoint(dir / "other", model, adam); }, 12, 2);
    fs::copy_file(dir / "other" / "step-00000000" / "metadata.json", work / "metadata.json",
                  fs::copy_options::overwrite_existing);
    check_raised_everywhere(try_load(dir.path, load(work)),
                            "this model's parameter '1.layers.2.weight' [12, 12] is not in it (the first difference");
  }
  SECTION("an unknown format version") {
    edit_metadata(fresh_copy(), [](nlohmann::json& m) { m["version"] = 2; });
    check_raised_everywhere(try_load(dir.path, load(work)), "unknown format version 2 (this build reads version 1)");
  }
  SECTION("a loss scaler that could not work") {
    edit_metadata(fresh_copy(), [](nlohmann::json& m) {
      m["loss_scaler"] = io::detail::scaler_to_json({.scale = 8.f, .min_scale = 16.f});
    });
    check_raised_everywhere(try_load(dir.path, load(work)), "loss_scaler.scale must lie in [min_scale, max_scale]");
  }
  SECTION("a model with another structure") {
    check_raised_everywhere(try_load(dir.path, load(ckpt), 12, 4),
                            "this model's parameter '1.layers.3.weight' [12, 12] is not in it");
    check_raised_everywhere(try_load(dir.path, load(ckpt), 16, 3),
                            "parameter '0.weight' has shape [12, 5] there but [16, 5] in this model");
  }
  SECTION("another optimizer") {
    std::vector<std::string> errors(2);
    on_ranks<optim::SGD>(2, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto&, comm::ThreadComm& c) {
      optim::SGD sgd{{.lr = 0.1, .momentum = 0.9}};
      try {
        io::load_checkpoint(ckpt, model, sgd);
      } catch (const io_error& e) {
        errors[std::size_t(c.rank())] = e.what();
      }
    });
    for (const auto& e : errors) CHECK_THAT(e, Contains("it holds Adam optimizer state; this optimizer is SGD"));
  }
  SECTION("a path that is not a checkpoint") {
    fs::create_directories(dir / "empty");
    check_raised_everywhere(try_load(dir.path, load(dir / "empty")), "holds no checkpoint");
    check_raised_everywhere(try_load(dir.path, load(dir / "nowhere")), "no such checkpoint or directory");
    check_raised_everywhere(try_load(dir.path, load(dir / "saved.safetensors")), "not a directory");
  }
  SECTION("an unreadable directory") {
    fresh_copy();
    fs::permissions(work, fs::perms::none);
    std::string error;
    if (::geteuid() != 0) {
      const auto r = try_load(dir.path, load(work));
      check_raised_everywhere(r, "Permission denied");
      error = r.errors[0];
    } else {  // root reads any directory: load as nobody in a child process
      int fds[2];
      REQUIRE(::pipe(fds) == 0);
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::close(fds[0]);
        std::string msg = "the load did not fail";
        if (::setgid(65534) != 0 || ::setuid(65534) != 0) msg = "cannot become nobody";
        try {
          comm::launch(1, [&](comm::ThreadComm& c) {
            Model m = make_model();
            auto model = shard::fully_shard(m, c, shard::FullShard{}, wrap_blocks());
            optim::Adam adam;
            io::load_checkpoint(work, model, adam);
          });
        } catch (const std::exception& e) {
          msg = e.what();
        }
        [[maybe_unused]] auto n = ::write(fds[1], msg.data(), msg.size());
        ::_exit(0);
      }
      ::close(fds[1]);
      char buf[4096];
      for (::ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) error.append(buf, std::size_t(n));
      ::close(fds[0]);
      ::waitpid(pid, nullptr, 0);
    }
    fs::permissions(work, fs::perms::owner_all);
    CHECK_THAT(error, Contains(cat(work.string(), ": cannot read the directory: Permission denied")));
  }
  SECTION("a corrupt safetensors file") {
    on_ranks(2, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, auto&) {
      io::export_safetensors(dir / "model.safetensors", model, adam);
    });
    flip_byte(dir / "model.safetensors", 8);  // the header's opening '{'
    auto from_file = [&](auto& model, auto&) { io::load_safetensors(dir / "model.safetensors", model); };
    check_raised_everywhere(try_load(dir.path, from_file), "the header must be a JSON object");
    fs::resize_file(dir / "model.safetensors", 100);
    check_raised_everywhere(try_load(dir.path, from_file), "runs past the end of the file");
  }
}

namespace {
// read() on another thread. If it blocks on the FIFO (the bug this guards against), the
// FIFO is opened for writing until read() returns, so that the test fails (nullopt)
// instead of hanging.
template <class Read>
auto without_blocking(const fs::path& fifo, Read&& read) -> std::optional<decltype(read())> {
  auto result = std::async(std::launch::async, read);
  if (result.wait_for(std::chrono::seconds(10)) == std::future_status::ready) return result.get();
  do {
    if (const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC); fd >= 0) ::close(fd);
  } while (result.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready);
  result.get();
  return std::nullopt;
}
}  // namespace

TEST_CASE("metadata nested deeper than the readers allow, or with a duplicate key, is refused, never a crash",
          "[checkpoint][bad]") {
  // Copying a parsed JSON value recurses: a metadata.json of a few MB whose user field
  // nests a million arrays deep (its checksum right: a checksum is no signature) crashed
  // every reader of its root, and every save into it, which lists the root first.
  temp_dir dir("deep");
  const auto root = dir / "root";
  make_checkpoint(root, dir / "model.safetensors");
  const auto ckpt = root / "step-00000002";
  std::string body;
  edit_metadata(ckpt, [&](nlohmann::json& j) {
    j["user"] = "@";
    body = j.dump(1);
  });
  const auto at = body.find("\"@\"");
  REQUIRE(at != std::string::npos);
  const auto nest = [](int levels) { return std::string(std::size_t(levels), '[') + std::string(std::size_t(levels), ']'); };
  write_metadata_body(ckpt / "metadata.json", body.substr(0, at) + nest(400) + body.substr(at + 3));
  CHECK(io::read_checkpoint_metadata(ckpt).user.is_array());
  // A duplicate key is refused too: a reader keeping the first would see another checkpoint.
  write_metadata_body(ckpt / "metadata.json", body.substr(0, at) + R"({"k": 1, "k": 2})" + body.substr(at + 3));
  CHECK_THROWS_WITH(io::read_checkpoint_metadata(ckpt),
                    StartsWith((ckpt / "metadata.json").string()) &&
                        Contains(R"(duplicate key "k" in the metadata)"));
  write_metadata_body(ckpt / "metadata.json", body.substr(0, at) + nest(1'000'000) + body.substr(at + 3));
  const std::string deep = "the metadata is not valid JSON here: it nests objects and arrays deeper than 512 levels";
  CHECK_THROWS_WITH(io::read_checkpoint_metadata(ckpt),
                    StartsWith((ckpt / "metadata.json").string()) && Contains(deep));
  const auto listed = io::list_checkpoints(root);
  REQUIRE(listed.size() == 1);
  CHECK_THAT(listed[0].error, Contains(deep));
  check_raised_everywhere(
      try_load(dir.path, [&](auto& model, auto& adam) { io::load_checkpoint(ckpt, model, adam); }), deep);

  // The library's entry in a consolidated safetensors file, likewise.
  io::safetensors_writer w;
  const float x[] = {1};
  w.add<float>("x", Shape{1}, std::span(x));
  w.set_metadata("shardlib", nest(1'000'000));
  w.write(dir / "deep.safetensors");
  CHECK_THROWS_WITH(io::safetensors_to_checkpoint(dir / "deep.safetensors", dir / "converted", {}),
                    StartsWith((dir / "deep.safetensors").string()) &&
                        Contains("\"shardlib\" metadata: the entry is not valid JSON here: it nests objects and "
                                 "arrays deeper than 512 levels"));
}

TEST_CASE("a checkpoint is committed only with metadata its readers accept, and equal sequences order by name",
          "[checkpoint][convert][bad]") {
  temp_dir dir("commit");
  const auto root = dir / "root";
  const float a[] = {1, 2};
  io::safetensors_writer good;
  good.add<float>("w", Shape{2}, std::span(a));
  good.write(dir / "good.safetensors");
  io::safetensors_to_checkpoint(dir / "good.safetensors", root, {.tag = "good"});
  // safetensors allows a tensor named "", which no checkpoint may hold as a parameter: the
  // conversion made the checkpoint anyway, and then no load could tell which of the root's
  // checkpoints was the latest.
  io::safetensors_writer odd = good;
  odd.add<float>("", Shape{2}, std::span(a));
  odd.write(dir / "odd.safetensors");
  CHECK_THROWS_WITH(io::safetensors_to_checkpoint(dir / "odd.safetensors", root, {.tag = "odd"}),
                    StartsWith((root / "odd" / "metadata.json").string()) &&
                        Contains("parameter names must be non-empty and unique"));
  CHECK(dir_names(root) == std::vector<std::string>{"good"});
  CHECK(io::resolve_checkpoint(root) == root / "good");

  // Copies of one checkpoint share its sequence number: the latest is the last by name,
  // whatever order the directory lists them in.
  for (const char* copy : {"a-copy", "z-copy", "m-copy"})
    fs::copy(root / "good", root / copy, fs::copy_options::recursive);
  CHECK(io::resolve_checkpoint(root) == root / "z-copy");
  const auto listed = io::list_checkpoints(root);
  std::vector<std::string> order;
  for (const auto& e : listed) order.push_back(e.path.filename().string());
  CHECK(order == std::vector<std::string>{"a-copy", "good", "m-copy", "z-copy"});
}

TEST_CASE("a FIFO where a file is expected is refused at once by every reader", "[checkpoint][bad][fifo]") {
  temp_dir dir("fifo");
  const auto root = dir / "root";
  make_checkpoint(root, dir / "model.safetensors");
  const auto ckpt = root / "step-00000002";
  const auto fifo_at = [](const fs::path& p) {
    fs::remove(p);
    REQUIRE(::mkfifo(p.c_str(), 0600) == 0);
    return p;
  };
  // The io_error f raises, or what went wrong.
  const auto error_of = [](const fs::path& fifo, auto f) -> std::string {
    const auto e = without_blocking(fifo, [&]() -> std::string {
      try {
        f();
      } catch (const io_error& e) {
        return e.what();
      }
      return "no io_error";
    });
    return e ? *e : "blocked on the FIFO";
  };
  const std::string refused = ": not a regular file: it is a FIFO";

  SECTION("a safetensors file") {
    const auto f = fifo_at(dir / "model.safetensors");
    CHECK_THAT(error_of(f, [&] { io::safetensors::load(f); }), StartsWith(f.string() + refused));
    CHECK_THAT(error_of(f, [&] { io::read_safetensors_header(f); }), StartsWith(f.string() + refused));
    CHECK_THAT(error_of(f, [&] { io::safetensors_to_checkpoint(f, dir / "converted", {}); }),
               StartsWith(f.string() + refused));
    const auto r = without_blocking(f, [&] {
      return try_load(dir.path, [&](auto& model, auto&) { io::load_safetensors(f, model); });
    });
    REQUIRE(r);
    check_raised_everywhere(*r, f.string() + refused);
  }
  SECTION("a checkpoint's metadata.json") {
    const auto f = fifo_at(ckpt / "metadata.json");
    CHECK_THAT(error_of(f, [&] { io::read_checkpoint_metadata(ckpt); }), StartsWith(f.string() + refused));
    const auto listed = without_blocking(f, [&] { return io::list_checkpoints(root); });
    REQUIRE(listed);
    REQUIRE(listed->size() == 1);
    CHECK_THAT(listed->at(0).error, StartsWith(f.string() + refused));
    const auto r = without_blocking(f, [&] {
      return try_load(dir.path, [&](auto& model, auto& adam) { io::load_checkpoint(ckpt, model, adam); });
    });
    REQUIRE(r);
    check_raised_everywhere(*r, f.string() + refused);
  }
  SECTION("Hugging Face's index") {
    fs::create_directory(dir / "hf");
    const auto f = fifo_at(dir / "hf" / "model.safetensors.index.json");
    CHECK_THAT(error_of(f, [&] { io::detail::state_dict_files files(dir / "hf"); }), StartsWith(f.string() + refused));
  }
  SECTION("a shard file") {
    const auto f = fifo_at(ckpt / "shard-00001-of-00003.safetensors");
    const auto problems = without_blocking(f, [&] { return io::verify_checkpoint(ckpt); });
    REQUIRE(problems);
    REQUIRE(problems->size() == 1);
    CHECK_THAT(problems->at(0), StartsWith(f.string() + refused));
    const auto r = without_blocking(f, [&] {
      return try_load(dir.path, [&](auto& model, auto& adam) { io::load_checkpoint(ckpt, model, adam); });
    });
    REQUIRE(r);
    check_raised_everywhere(*r, f.string() + refused);
  }
}

TEST_CASE("ranks saving different optimizers fail the save on every rank, naming the ranks and the difference",
          "[checkpoint][bad]") {
  temp_dir dir("mixed_optimizers");
  const auto root = dir / "root";
  // Rank 0 saves and exports with Adam, rank 1 with `other`; returns each rank's save error.
  const auto save_mixed = [&](auto other) {
    std::vector<std::string> errors(2), exported(2);
    comm::launch(2, [&](comm::ThreadComm& c) {
      Model m = make_model();
      const auto save = [&](auto& model, auto& opt) {
        train(model, opt, 0, 1);
        try {
          io::save_checkpoint(root, model, opt);
        } catch (const io_error& e) {
          errors[std::size_t(c.rank())] = e.what();
        }
        try {
          io::export_safetensors(dir / "model.safetensors", model, opt);
        } catch (const io_error& e) {
          exported[std::size_t(c.rank())] = e.what();
        }
      };
      // Each rank's engine keeps the state of its own optimizer type.
      if (c.rank() == 0) {
        optim::Adam adam{{.lr = 1e-2}};
        auto model = shard::fully_shard(m, c, shard::FullShard{}, adam, wrap_blocks());
        save(model, adam);
      } else {
        auto mine = other;
        auto model = shard::fully_shard(m, c, shard::FullShard{}, mine, wrap_blocks());
        save(model, mine);
      }
    });
    for (const auto& e : exported) CHECK_THAT(e, Contains("ranks 0 and 1 save different optimizers"));
    CHECK(dir_names(root).empty());  // nothing written, no temporary directory left
    CHECK(!fs::exists(dir / "model.safetensors"));
    return errors;
  };

  const auto types = save_mixed(optim::SGD{{.lr = 0.1, .momentum = 0.9}});
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << types[std::size_t(r)]);
    CHECK_THAT(types[std::size_t(r)],
               StartsWith(cat("rank ", r, ": saving checkpoint")) &&
                   Contains(R"(ranks 0 and 1 save different optimizers, which one checkpoint cannot hold: )"
                            R"(optimizer type "Adam" on rank 0, "SGD" on rank 1)"));
  }
  CHECK_THAT(types[0], Contains("stopped because rank 1 failed"));

  const auto layouts = save_mixed(optim::Adam{{.lr = 1e-2, .amsgrad = true}});
  for (const auto& e : layouts)
    CHECK_THAT(e, Contains(R"(optimizer state ["exp_avg","exp_avg_sq"] on rank 0, )"
                           R"(["exp_avg","exp_avg_sq","max_exp_avg_sq"] on rank 1)"));
}

TEST_CASE("ranks passing different save options fail the save on every rank, naming the option", "[checkpoint][bad]") {
  // Rank 0's chunk size went into the metadata while rank 1 hashed its file in its own:
  // the save succeeded and nothing could load it (nor the root, its newest entry unreadable).
  temp_dir dir("mixed_save_options");
  const auto root = dir / "root";
  struct variant {
    const char* key;
    io::save_options rank0, rank1;
  };
  const std::vector<variant> variants{
      {"chunk_bytes", {.chunk_bytes = 256}, {.chunk_bytes = 1024}},
      {"tag", {.tag = "a"}, {.tag = "b"}},
      {"keep_last", {.keep_last = 0}, {.keep_last = 2}},
      {"user", {.user = {{"epoch", 1}}}, {.user = {{"epoch", 2}}}},
      {"user", {.user = {{"rng", "\xff\xfe"}}}, {.user = {{"rng", "ok"}}}},  // not UTF-8 on one rank only
  };
  std::vector<std::vector<std::string>> errors(variants.size(), std::vector<std::string>(2));
  std::vector<std::vector<float>> before(2), after(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = make_model();
    auto model = shard::fully_shard<optim::AdamW>(m, c, shard::FullShard{}, wrap_blocks());
    optim::AdamW adamw{{.lr = 1e-2}};
    train(model, adamw, 0, 1);
    io::save_checkpoint(root, model, adamw, {.tag = "good"});
    for (std::size_t v = 0; v < variants.size(); ++v) {
      try {
        io::save_checkpoint(root, model, adamw, c.rank() == 0 ? variants[v].rank0 : variants[v].rank1);
      } catch (const io_error& e) {
        errors[v][std::size_t(c.rank())] = e.what();
      }
    }
    // Alike on every rank, an infinite user field saves (as null), as it did before the check.
    io::save_checkpoint(root, model, adamw, {.user = {{"best_loss", INFINITY}}, .tag = "good"});
    const auto piece = model.master_piece(0);
    before[std::size_t(c.rank())].assign(piece.begin(), piece.end());
    train(model, adamw, 1, 1);
    io::load_checkpoint(root, model, adamw);  // the root still resolves to the good one
    const auto loaded = model.master_piece(0);
    after[std::size_t(c.rank())].assign(loaded.begin(), loaded.end());
  });
  for (std::size_t v = 0; v < variants.size(); ++v)
    for (int r = 0; r < 2; ++r) {
      INFO(variants[v].key << ", rank " << r << ": " << errors[v][std::size_t(r)]);
      CHECK_THAT(errors[v][std::size_t(r)],
                 Contains("ranks 0 and 1 pass different save options, which one checkpoint cannot follow: ") &&
                     Contains(cat(variants[v].key, " ")));
    }
  CHECK_THAT(errors[0][1], Contains("chunk_bytes 256 on rank 0, 1024 on rank 1"));
  CHECK(dir_names(root) == std::vector<std::string>{"good"});  // nothing written, no temporary left
  CHECK(after == before);
}

TEST_CASE("randomized mutations of metadata and shard files never load silently wrong", "[checkpoint][mutation]") {
  temp_dir dir("mutation");
  const auto root = dir / "root";
  snapshot pristine;
  on_ranks(2, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, 2);
    io::save_checkpoint(root, model, adam, {.tag = "ckpt", .chunk_bytes = 128});
    auto s = take_snapshot(model, adam, dir / "pristine.safetensors");
    if (c.rank() == 0) pristine = std::move(s);
  });
  const auto ckpt = root / "ckpt", work = dir / "work";
  const std::vector<std::string> files{"metadata.json", "shard-00000-of-00002.safetensors",
                                       "shard-00001-of-00002.safetensors"};
  // Values a hand edit or a bug might put anywhere in the metadata.
  const std::vector<nlohmann::json> values{-1, 0, 1, 3, 17, std::uint64_t(1) << 62, 1e30, 0.5, "x", "F32", nullptr,
                                           true, nlohmann::json::array(), nlohmann::json::object(), {1, 2}};
  std::mt19937_64 rng(20240611);
  std::vector<std::string> failures;
  int rejected = 0;
  for (int iter = 0; iter < 150; ++iter) {
    fs::remove_all(work);
    fs::copy(ckpt, work);
    const auto& name = files[rng() % files.size()];
    const auto file = work / name;
    auto bytes = read_bytes(file);
    const int kind = int(rng() % (name == "metadata.json" ? 5 : 4));
    std::string what;
    if (kind == 0) {  // flip one bit
      const std::size_t at = rng() % bytes.size();
      bytes[at] ^= std::byte(1u << (rng() % 8));
      what = cat("bit flip at ", at);
    } else if (kind == 1) {  // a random byte value
      const std::size_t at = rng() % bytes.size();
      const auto v = std::byte(rng() % 256);
      if (bytes[at] == v) continue;
      bytes[at] = v;
      what = cat("byte ", at, " set");
    } else if (kind == 2) {  // truncate
      bytes.resize(rng() % bytes.size());
      what = cat("truncated to ", bytes.size());
    } else if (kind == 3) {  // append
      for (std::size_t n = 1 + rng() % 16; n > 0; --n) bytes.push_back(std::byte(rng() % 256));
      what = "appended";
    }
    if (kind < 4) {
      write_bytes(file, bytes);
    } else {  // replace or remove one JSON node, with a correct checksum
      edit_metadata(work, [&](nlohmann::json& m) {
        const auto flat = m.flatten();
        std::vector<nlohmann::json::json_pointer> nodes;
        for (const auto& item : flat.items())
          for (auto p = nlohmann::json::json_pointer(item.key()); !p.empty(); p = p.parent_pointer())
            nodes.push_back(p);
        const auto at = nodes[rng() % nodes.size()];
        if (rng() % 4 == 0 && m.at(at.parent_pointer()).is_object()) {
          m.at(at.parent_pointer()).erase(at.back());
          what = cat("removed ", at.to_string());
        } else {
          m.at(at) = values[rng() % values.size()];
          what = cat(at.to_string(), " = ", m.at(at).dump());
        }
      });
    }
    const bool flagged = !io::verify_checkpoint(work).empty();
    std::string error;
    snapshot got;
    REQUIRE_NOTHROW(comm::launch(1, [&](comm::ThreadComm& c) {  // only io_error may escape a load
      Model m = make_model();
      auto model = shard::fully_shard(m, c, shard::FullShard{}, wrap_blocks(7));
      optim::Adam adam;
      try {
        io::load_checkpoint(work, model, adam);
        got = take_snapshot(model, adam, dir / "got.safetensors");
      } catch (const io_error& e) {
        error = e.what();
      }
    }));
    if (kind < 4 && !flagged) failures.push_back(cat(name, ": ", what, ": verify found nothing"));
    if (error.empty() && first_difference(got, pristine) != "")
      failures.push_back(cat(name, ": ", what, ": loaded without error but ", first_difference(got, pristine)));
    rejected += !error.empty();
  }
  INFO("rejected " << rejected << " of 150; first failures: "
                   << (failures.empty() ? "" : failures.front()) << (failures.size() > 1 ? " | " + failures[1] : ""));
  CHECK(failures.empty());
  CHECK(rejected > 75);  // most mutations break something a load needs
}

TEST_CASE("export streams one unit at a time, and import initialises any sharding", "[checkpoint][safetensors]") {
  temp_dir dir("export");
  std::vector<std::size_t> peaks(3), largest_unit(3);
  std::size_t model_bytes = 0;
  std::map<std::string, std::vector<float>> state_dict;
  snapshot exported, imported;
  comm::launch(3, [&](comm::ThreadComm& c, ledger& l) {
    Model m = make_model();
    auto model = shard::fully_shard(m, c, shard::FullShard{}, wrap_blocks());
    optim::Adam adam{{.lr = 1e-2}};
    train(model, adam, 0, 2);
    for (auto& [name, t] : model.full_state_dict(false))
      if (c.rank() == 0) state_dict[name].assign(t.span().begin(), t.span().end());
    for (const auto& u : model.units()) {
      largest_unit[std::size_t(c.rank())] =
          std::max(largest_unit[std::size_t(c.rank())], u.master->layout().padded_size() * sizeof(float));
      if (c.rank() == 0) model_bytes += u.master->layout().padded_size() * sizeof(float);
    }
    l.reset_peaks();
    io::export_safetensors(dir / "model.safetensors", model, adam);
    peaks[std::size_t(c.rank())] = l.peak(category::gathered_parameters);
  });
  CHECK(peaks == largest_unit);  // one unit gathered at a time, on every rank
  CHECK(largest_unit[0] < model_bytes / 2);
  const auto file = io::safetensors::load(dir / "model.safetensors");
  CHECK(file.metadata().at("format") == "pt");
  for (const auto& [name, values] : state_dict) CHECK(same_bits(file.get<float>(name), values));
  CHECK(file.contains("optimizer.1.layers.2.bias.exp_avg_sq"));

  // Parameters only, into two ranks of ShardGradOp with another wrap policy and seed.
  std::vector<int> same(2, 0);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = make_model();
    auto model = shard::fully_shard(m, c, shard::ShardGradOp{}, {.seed = 9});
    io::load_safetensors(dir / "model.safetensors", model);
    bool ok = true;
    for (auto& [name, t] : model.full_state_dict(false))
      ok = ok && same_bits(std::vector<float>(t.span().begin(), t.span().end()), state_dict.at(name));
    same[std::size_t(c.rank())] = ok;
  });
  CHECK(same == std::vector<int>{1, 1});
  // With the optimizer: the whole training state, as from a checkpoint.
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model m = make_model();
    auto model = shard::fully_shard(m, c, shard::HybridShard{.group_size = 1}, wrap_blocks(9));
    optim::Adam adam;
    io::load_safetensors(dir / "model.safetensors", model, adam);
    auto s = take_snapshot(model, adam, dir / "imported.safetensors");
    if (c.rank() == 0) imported = std::move(s);
  });
  CHECK(first_difference(imported, read_snapshot(dir / "model.safetensors")) == "");
  CHECK(imported.info["steps"] == 2);
}

TEST_CASE("a PyTorch-style safetensors file initialises a sharded model, converting dtypes", "[checkpoint][safetensors]") {
  temp_dir dir("torch");
  Model reference = make_model();
  std::map<std::string, std::vector<float>> want;
  io::safetensors_writer w;
  int i = 0;
  reference.parameters([&](std::string_view name, nn::Param<float>& p) {
    std::vector<float> v(std::size_t(p.numel()));
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = float(k % 7) * 0.25f - float(i);
    if (i % 3 == 0) {
      std::vector<bfloat16> b(v.begin(), v.end());
      w.add<bfloat16>(std::string(name), p.shape, b);
    } else if (i % 3 == 1) {
      std::vector<double> d(v.begin(), v.end());
      w.add<double>(std::string(name), p.shape, d);
    } else {
      w.add<float>(std::string(name), p.shape, v);
    }
    want[std::string(name)] = v;  // exact in bf16 and f64: multiples of 1/4 below 256
    ++i;
  });
  w.write(dir / "torch.safetensors");
  std::vector<int> ok(3, 0);
  comm::launch(3, [&](comm::ThreadComm& c) {
    Model m = make_model();
    auto model = shard::fully_shard(m, c, shard::FullShard{}, wrap_blocks());
    io::load_safetensors(dir / "torch.safetensors", model);
    bool same = true;
    for (auto& [name, t] : model.full_state_dict(false))
      same = same && same_bits(std::vector<float>(t.span().begin(), t.span().end()), want.at(name));
    ok[std::size_t(c.rank())] = same;
  });
  CHECK(ok == std::vector<int>(3, 1));

  auto rewrite = [&](auto&& change) {
    io::safetensors_writer bad;
    reference.parameters([&](std::string_view name, nn::Param<float>& p) {
      change(bad, std::string(name), p.shape, want.at(std::string(name)));
    });
    bad.write(dir / "bad.safetensors");
    return [&](auto& model, auto&) { io::load_safetensors(dir / "bad.safetensors", model); };
  };
  auto as_is = [](io::safetensors_writer& b, const std::string& n, Shape s, const std::vector<float>& v) {
    b.add<float>(n, s, v);
  };
  check_raised_everywhere(try_load(dir.path, rewrite([&](auto& b, const std::string& n, Shape s, const auto& v) {
                            if (n != "1.layers.1.bias") as_is(b, n, s, v);
                          })),
                          "this model's parameter '1.layers.1.bias' [12] is not in it");
  check_raised_everywhere(try_load(dir.path, rewrite([&](auto& b, const std::string& n, Shape s, const auto& v) {
                            as_is(b, n, s, v);
                            if (n == "2.bias") b.template add<float>("head.extra", s, v);
                          })),
                          "it holds parameter 'head.extra' [3], which this model does not have");
  check_raised_everywhere(try_load(dir.path, rewrite([&](auto& b, const std::string& n, Shape s, const auto& v) {
                            if (n == "2.bias") b.template add<std::int64_t>(n, s, std::vector<std::int64_t>(3));
                            else as_is(b, n, s, v);
                          })),
                          "tensor \"2.bias\" has dtype I64");
  // An F64 value beyond float's range is an error naming the tensor, the element and
  // the value, with or without a model, rather than an inf.
  const auto overflowing = rewrite([&](auto& b, const std::string& n, Shape s, const auto& v) {
    if (n != "2.bias") return as_is(b, n, s, v);
    std::vector<double> d(v.begin(), v.end());
    d[1] = -1e39;
    b.template add<double>(n, s, d);
  });
  const std::string beyond = "tensor \"2.bias\" element 1 is -1e+39, beyond float's range";
  check_raised_everywhere(try_load(dir.path, overflowing), beyond);
  CHECK_THROWS_WITH(io::safetensors_to_checkpoint(dir / "bad.safetensors", dir / "converted", {}),
                    StartsWith((dir / "bad.safetensors").string()) && Contains(beyond));
}

TEST_CASE("sharded -> safetensors -> sharded at another world size without a model, then resume",
          "[checkpoint][convert]") {
  temp_dir dir("convert");
  const int n1 = 2, n2 = 2;
  std::vector<float> ref_losses, losses;
  snapshot ref, saved, loaded, final_state;
  on_ranks(4, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    auto l = train(model, adam, 0, n1 + n2);
    auto s = take_snapshot(model, adam, dir / "ref.safetensors");
    if (c.rank() == 0) {
      ref_losses = l;
      ref = std::move(s);
    }
  });
  on_ranks(4, shard::FullShard{}, wrap_blocks(), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    train(model, adam, 0, n1);
    io::save_checkpoint(dir / "four", model, adam, {.user = {{"epoch", 1}}});
    auto s = take_snapshot(model, adam, dir / "saved.safetensors");
    if (c.rank() == 0) saved = std::move(s);
  });
  io::checkpoint_to_safetensors(dir / "four", dir / "consolidated.safetensors", true);
  CHECK(first_difference(read_snapshot(dir / "consolidated.safetensors"), saved) == "");
  const auto three = io::safetensors_to_checkpoint(dir / "consolidated.safetensors", dir / "three",
                                                   {.world = 3, .strategy = "FullShard", .chunk_bytes = 512});
  CHECK(three == dir / "three" / "step-00000002");
  CHECK(io::verify_checkpoint(three).empty());
  const auto m = io::read_checkpoint_metadata(three);
  CHECK(m.partitions == 3);
  CHECK(m.units.size() == 1);
  CHECK(m.user == nlohmann::json{{"epoch", 1}});
  on_ranks(3, shard::FullShard{}, wrap_blocks(7), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    io::load_checkpoint(dir / "three", model, adam);
    auto s = take_snapshot(model, adam, dir / "loaded.safetensors");
    auto l = train(model, adam, n1, n2);
    auto f = take_snapshot(model, adam, dir / "final.safetensors");
    if (c.rank() == 0) {
      losses = l;
      loaded = std::move(s);
      final_state = std::move(f);
    }
  });
  CHECK(first_difference(loaded, saved) == "");
  for (int s = 0; s < n2; ++s) CHECK(rel(losses[std::size_t(s)], ref_losses[std::size_t(n1 + s)], 1e-6) <= 1e-5);
  CHECK(worst_parameter_difference(final_state, ref) <= 1e-5);

  // Weights only: the parameters load, the optimizer keeps its own (fresh) state.
  io::checkpoint_to_safetensors(dir / "four", dir / "weights.safetensors", false);
  io::safetensors_to_checkpoint(dir / "weights.safetensors", dir / "weights",
                                {.world = 4, .strategy = "HybridShard", .group_size = 2});
  CHECK(!io::read_checkpoint_metadata(dir / "weights" / "step-00000002").optimizer);
  snapshot weights_loaded;
  on_ranks(2, shard::FullShard{}, wrap_blocks(7), [&](auto& model, auto& adam, comm::ThreadComm& c) {
    io::load_checkpoint(dir / "weights", model, adam);
    auto s = take_snapshot(model, adam, dir / "weights_loaded.safetensors");
    if (c.rank() == 0) weights_loaded = std::move(s);
  });
  for (const auto& [name, v] : saved.tensors) {
    INFO(name);
    if (name.starts_with("optimizer.")) CHECK(std::all_of(weights_loaded.tensors.at(name).begin(),
                                                          weights_loaded.tensors.at(name).end(),
                                                          [](float x) { return x == 0.f; }));
    else CHECK(same_bits(weights_loaded.tensors.at(name), v));
  }
  CHECK_THROWS_WITH(io::checkpoint_to_safetensors(dir / "weights", dir / "x.safetensors", true),
                    Contains("holds no optimizer state"));
  CHECK_THROWS_WITH(io::safetensors_to_checkpoint(dir / "weights.safetensors", dir / "x", {.world = 4, .strategy = "HybridShard", .group_size = 3}),
                    Contains("HybridShard group size 3 must divide the world size 4"));

  // Converting again under the same tag replaces the checkpoint only when asked to.
  const auto shards_of = [](const fs::path& p) { return io::read_checkpoint_metadata(p).partitions; };
  CHECK_THROWS_WITH(io::safetensors_to_checkpoint(dir / "weights.safetensors", dir / "weights",
                                                  {.world = 2, .strategy = "FullShard"}),
                    Contains("step-00000002: exists; a conversion replaces a checkpoint only when asked to"));
  CHECK(shards_of(dir / "weights" / "step-00000002") == 2);  // HybridShard groups of 2: two partitions
  io::safetensors_to_checkpoint(dir / "weights.safetensors", dir / "weights",
                                {.world = 3, .strategy = "FullShard", .replace = true});
  CHECK(shards_of(dir / "weights" / "step-00000002") == 3);
  // An export into its own checkpoint would replace one of its files.
  const auto inside = dir / "four" / "step-00000002" / "metadata.json";
  CHECK_THROWS_WITH(io::checkpoint_to_safetensors(dir / "four", inside, false),
                    Contains("lies inside the checkpoint"));
  CHECK(io::verify_checkpoint(dir / "four" / "step-00000002").empty());
}

}  // namespace test_checkpoint
