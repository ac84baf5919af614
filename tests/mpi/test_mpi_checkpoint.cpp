// Sharded checkpoints across MPI processes: a checkpoint saved by every process loads on
// sub-communicators of other sizes and strategies, and training continues as if never
// interrupted; a rank failing mid-save raises on every process (none hangs) and keeps
// the previous checkpoint; and, driven by ctest, a rank killed mid-save leaves the
// previous checkpoint loadable:
//
//   mpirun -np 4 test_mpi_checkpoint                          the test cases below
//   mpirun -np 3 test_mpi_checkpoint --kill-during-save DIR   saves, then rank 1 dies mid-save
//   mpirun -np 2 test_mpi_checkpoint --check-after-kill DIR   loads what the killed job left
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/mpi.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/shard/sharded_model.hpp"
#include "support/compare.hpp"

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <csignal>  // raise, SIGKILL
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>  // getpid

using namespace shardlib;
using comm::MpiComm;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

using Block = nn::Linear<float>;
using Model = nn::Sequential<nn::Linear<float>, nn::Stack<Block>, nn::Linear<float>>;
Model make_model() { return Model{nn::Linear<float>(5, 12), nn::Stack<Block>(3, Block(12, 12)), nn::Linear<float>(12, 3)}; }
shard::options wrap_blocks(std::uint64_t seed = 42) { return {.wrap = shard::wrap_types<Block>{}, .seed = seed}; }

// 24 rows per step, divisible by every world size used; a rank takes its own rows.
constexpr int global_rows = 24;
Tensor<float> batch(int step, std::int64_t rows, std::int64_t cols, std::uint64_t stream, std::int64_t first) {
  Tensor<float> t({rows, cols});
  counter_rng rng(1000 + std::uint64_t(step), stream);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = 2 * rng.uniform_float(std::uint64_t(first * cols + i)) - 1;
  return t;
}
template <class Sharded>
std::vector<float> train(Sharded& model, optim::Adam& opt, int first, int steps) {
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
template <class Sharded>
std::map<std::string, std::vector<float>> parameters(Sharded& model) {
  std::map<std::string, std::vector<float>> out;
  for (auto& [name, t] : model.full_state_dict(false)) out[name].assign(t.span().begin(), t.span().end());
  return out;
}
// Relative to max(|want|, lr): Adam's steps are about lr in size whatever the gradient's
// scale (see worst_parameter_difference in tests/unit/test_checkpoint.cpp).
double worst_relative(const std::map<std::string, std::vector<float>>& got,
                      const std::map<std::string, std::vector<float>>& want) {
  test_support::max_error worst;  // NaN and infinities count as +inf
  for (const auto& [name, w] : want) worst.relative(got.at(name), w, 1e-2);
  return worst.value();
}

// A directory every process names alike (rank 0's pid), removed at scope exit.
struct shared_dir {
  MpiComm& world;
  fs::path path;
  shared_dir(MpiComm& w, std::string_view name) : world(w) {
    std::vector<std::int64_t> pid{std::int64_t(::getpid())};
    world.broadcast(std::span<std::int64_t>(pid), 0);
    path = fs::temp_directory_path() / cat("shardlib_mpi_checkpoint_", name, "_", pid[0]);
    if (world.rank() == 0) fs::remove_all(path);
    world.barrier();
  }
  ~shared_dir() {
    world.barrier();
    std::error_code ec;
    if (world.rank() == 0) fs::remove_all(path, ec);
  }
};

}  // namespace

TEST_CASE("a checkpoint saved by every process loads on 3 and on 2 of them, and training goes on as if uninterrupted",
          "[checkpoint][mpi]") {
  auto world = MpiComm::world();
  REQUIRE(world.size() == 4);
  shared_dir dir(world, "reshard");
  const int n1 = 3, n2 = 3;
  std::vector<float> ref_losses;
  std::map<std::string, std::vector<float>> ref_params;
  {
    Model m = make_model();
    auto model = shard::fully_shard(m, world, shard::FullShard{}, wrap_blocks());
    optim::Adam adam{{.lr = 1e-2}};
    ref_losses = train(model, adam, 0, n1 + n2);
    ref_params = parameters(model);
  }
  {
    Model m = make_model();
    auto model = shard::fully_shard(m, world, shard::FullShard{}, wrap_blocks());
    optim::Adam adam{{.lr = 1e-2}};
    train(model, adam, 0, n1);
    io::save_checkpoint(dir.path / "ckpt", model, adam, {.chunk_bytes = 128});
    io::export_safetensors(dir.path / "saved.safetensors", model, adam);
  }
  for (int w : {3, 2}) {
    INFO("loading on " << w << " processes");
    auto group = world.split(world.rank() < w ? 0 : 1, world.rank());
    if (world.rank() < w) {
      Model m = make_model();
      auto run = [&](auto strategy) {
        auto model = shard::fully_shard(m, group, strategy, wrap_blocks(7));
        optim::Adam adam;
        const auto r = io::load_checkpoint(dir.path / "ckpt", model, adam);
        CHECK(r.metadata.world_size == 4);
        CHECK(r.files_read.size() < 4);  // a rank reads the files its shards lie in, not all of them
        const auto file = dir.path / cat("loaded_", w, ".safetensors");
        io::export_safetensors(file, model, adam);
        group.barrier();
        const auto saved = io::safetensors::load(dir.path / "saved.safetensors");
        const auto loaded = io::safetensors::load(file);
        for (const auto& t : saved.tensors()) {
          INFO(t.name);
          CHECK(loaded.get<float>(t.name) == saved.get<float>(t.name));  // moments resharded exactly too
        }
        const auto losses = train(model, adam, n1, n2);
        for (int s = 0; s < n2; ++s)
          CHECK(std::abs(losses[std::size_t(s)] - ref_losses[std::size_t(n1 + s)]) <=
                1e-5 * std::abs(ref_losses[std::size_t(n1 + s)]));
        CHECK(worst_relative(parameters(model), ref_params) <= 1e-5);
      };
      if (w == 3) run(shard::FullShard{});
      else run(shard::ShardGradOp{});
    }
    world.barrier();
  }
}

TEST_CASE("an async save across processes holds the values of its call while training goes on",
          "[checkpoint][mpi][async]") {
  auto world = MpiComm::world();
  shared_dir dir(world, "async");
  if (world.rank() == 0) fs::create_directories(dir.path);
  world.barrier();
  Model m = make_model();
  auto model = shard::fully_shard(m, world, shard::FullShard{}, wrap_blocks());
  optim::Adam adam{{.lr = 1e-2}};
  train(model, adam, 0, 2);
  io::export_safetensors(dir.path / "saved.safetensors", model, adam);
  auto pending = io::async_save_checkpoint(dir.path / "ckpt", model, adam, {.chunk_bytes = 128});
  train(model, adam, 2, 2);  // MPI collectives while each process's thread writes its file
  const auto path = pending.wait();

  Model m2 = make_model();
  auto fresh = shard::fully_shard(m2, world, shard::FullShard{}, wrap_blocks(7));
  optim::Adam other;
  io::load_checkpoint(path, fresh, other);
  io::export_safetensors(dir.path / "loaded.safetensors", fresh, other);
  world.barrier();
  const auto saved = io::safetensors::load(dir.path / "saved.safetensors");
  const auto loaded = io::safetensors::load(dir.path / "loaded.safetensors");
  CHECK(loaded.tensors().size() == saved.tensors().size());
  for (const auto& t : saved.tensors()) {
    INFO(t.name);
    CHECK(loaded.get<float>(t.name) == saved.get<float>(t.name));  // step 2's values, not step 4's
  }
}

TEST_CASE("a process failing mid-save raises on every process and keeps the previous checkpoint",
          "[checkpoint][mpi][atomic]") {
  auto world = MpiComm::world();
  shared_dir dir(world, "atomic");
  Model m = make_model();
  auto model = shard::fully_shard(m, world, shard::FullShard{}, wrap_blocks());
  optim::Adam adam;
  train(model, adam, 0, 2);
  io::save_checkpoint(dir.path, model, adam);
  train(model, adam, 2, 1);
  std::string error;
  try {
    io::save_checkpoint(dir.path, model, adam, {.chunk_bytes = 64, .write_hook = [](const io::write_event& e) {
                                                   if (e.rank == 2 && e.offset > 0) throw std::runtime_error("injected");
                                                   return 0;
                                                 }});
  } catch (const io_error& e) {
    error = e.what();
  }
  if (world.rank() == 2) CHECK_THAT(error, Contains("rank 2: saving checkpoint") && Contains("injected"));
  else CHECK_THAT(error, Contains("stopped because rank 2 failed"));
  world.barrier();
  const auto entries = io::list_checkpoints(dir.path);
  REQUIRE(entries.size() == 1);
  CHECK(entries[0].metadata->steps == 2);
  CHECK(!fs::exists(dir.path / ".tmp-step-00000003"));
  Model m2 = make_model();
  auto fresh = shard::fully_shard(m2, world, shard::NoShard{}, wrap_blocks(7));
  optim::Adam adam2;
  CHECK(io::load_checkpoint(dir.path, fresh, adam2).metadata.steps == 2);
}

TEST_CASE("a missing shard file raises on every process and changes nothing", "[checkpoint][mpi][bad]") {
  auto world = MpiComm::world();
  shared_dir dir(world, "missing");
  Model m = make_model();
  auto model = shard::fully_shard(m, world, shard::FullShard{}, wrap_blocks());
  optim::Adam adam;
  train(model, adam, 0, 1);
  const auto ckpt = io::save_checkpoint(dir.path, model, adam);
  if (world.rank() == 0) fs::remove(ckpt / "shard-00003-of-00004.safetensors");
  world.barrier();
  const auto before = parameters(model);
  std::string error;
  try {
    io::load_checkpoint(ckpt, model, adam);
  } catch (const io_error& e) {
    error = e.what();
  }
  CHECK_THAT(error, Contains(world.rank() == 3 ? "No such file or directory" : "stopped because rank 3 failed"));
  CHECK(parameters(model) == before);
}

namespace {

// Saves step 2, then rank 1 kills itself while writing step 3: mpirun ends the job.
int kill_during_save(const fs::path& dir) {
  auto world = MpiComm::world();
  if (world.rank() == 0) fs::remove_all(dir);
  world.barrier();
  Model m = make_model();
  auto model = shard::fully_shard(m, world, shard::FullShard{}, wrap_blocks());
  optim::Adam adam;
  train(model, adam, 0, 2);
  io::save_checkpoint(dir, model, adam);
  if (world.rank() == 0) {
    std::printf("mpi-checkpoint: saved step 2; killing rank 1 while it writes step 3\n");
    std::fflush(stdout);
  }
  train(model, adam, 2, 1);
  io::save_checkpoint(dir, model, adam, {.chunk_bytes = 64, .write_hook = [](const io::write_event& e) {
                                           if (e.rank == 1 && e.offset > 0) std::raise(SIGKILL);
                                           return 0;
                                         }});
  std::printf("mpi-checkpoint: rank %d: the save was not interrupted\n", world.rank());
  return 1;
}

// What the killed job left: step 2 complete and loadable, step 3's temporary directory,
// which the next save removes. Training resumed on 2 processes matches 4 uninterrupted steps.
int check_after_kill(const fs::path& dir) {
  auto world = MpiComm::world();
  std::vector<std::string> failures;
  const auto expect = [&](bool ok, const std::string& what) {
    if (!ok) failures.push_back(what);
  };
  const auto entries = io::list_checkpoints(dir);
  expect(entries.size() == 1 && entries[0].metadata && entries[0].metadata->steps == 2,
         "exactly one complete checkpoint, of step 2");
  expect(fs::exists(dir / ".tmp-step-00000003"), "the killed save's temporary directory");
  std::vector<float> ref;
  std::map<std::string, std::vector<float>> ref_params;
  {
    Model m = make_model();
    auto model = shard::fully_shard(m, world, shard::FullShard{}, wrap_blocks());
    optim::Adam adam;
    ref = train(model, adam, 0, 4);
    ref_params = parameters(model);
  }
  Model m = make_model();
  auto model = shard::fully_shard(m, world, shard::FullShard{}, wrap_blocks(7));
  optim::Adam adam;
  expect(io::load_checkpoint(dir, model, adam).metadata.steps == 2, "loading step 2");
  const auto losses = train(model, adam, 2, 2);
  for (int s = 0; s < 2; ++s)
    expect(std::abs(losses[std::size_t(s)] - ref[std::size_t(2 + s)]) <= 1e-5 * std::abs(ref[std::size_t(2 + s)]),
           cat("step ", 2 + s, " loss ", losses[std::size_t(s)], " vs uninterrupted ", ref[std::size_t(2 + s)]));
  expect(worst_relative(parameters(model), ref_params) <= 1e-5, "final parameters within 1e-5");
  io::save_checkpoint(dir, model, adam);
  world.barrier();
  expect(!fs::exists(dir / ".tmp-step-00000003"), "the next save removing the stale temporary directory");
  for (const auto& f : failures) std::printf("mpi-checkpoint: rank %d: FAILED: %s\n", world.rank(), f.c_str());
  if (failures.empty() && world.rank() == 0) std::printf("mpi-checkpoint: the checkpoint before the kill loads\n");
  return failures.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  comm::mpi_session session(&argc, &argv);
  int failed = 0;
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode == "--kill-during-save") failed = kill_during_save(argv[2]);
  else if (mode == "--check-after-kill") failed = check_after_kill(argv[2]);
  else failed = Catch::Session().run(argc, argv);
  int any = 0;  // every process exits with the job's verdict
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return any;
}
