// train_fsdp — the FSDP article's training script in C++: a 6-layer transformer
// encoder classifier (d_model 512, 8 heads, feed-forward 2048), every encoder
// layer its own sharded unit, 4 ranks, Adam lr 1e-3, 100 steps, printing
// "Rank r, Step s, Loss: x" every 10 steps, then the consolidated model written
// to a safetensors file for inference. Rank 0 adds a progress line (throughput, ETA)
// after each printout; --metrics FILE writes one JSON line per step and rank (loss,
// tokens/s, and the step's ledger peaks by category) for tools/plot.py. --grad-accum K makes
// each step train_step over K micro-batches of --batch rows per rank (--no-sync,
// --no-reshard-after-backward: how those before the last run).
//
// Ranks are threads of this process by default; started by tools/launch, torchrun
// or Slurm (with MASTER_ADDR and MASTER_PORT), each process is one rank over
// SocketComm; under mpirun (built with MPI), one rank over MpiComm.
#include <shardlib/comm/run.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/shard/sharded_model.hpp>
#if SHARDLIB_EXAMPLE_WITH_MPI
#include <shardlib/comm/mpi_backend.hpp>
#endif

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>

#include "common/flags.hpp"
#include "common/launched.hpp"
#include "common/reference_model.hpp"
#include "common/synthetic.hpp"
#include "common/training.hpp"

using namespace shardlib;
using example::Encoder;
using example::Model;

namespace {

struct settings {
  int world = 4, group = 2;
  std::string strategy = "full";
  example::model_flags model;
  example::train_flags run;
};

// The strategy chosen by the flag, as shard::AnyStrategy: one engine type for all five.
shard::AnyStrategy strategy_of(const settings& s) {
  if (s.strategy == "full") return shard::FullShard{};
  if (s.strategy == "grad-op") return shard::ShardGradOp{};
  if (s.strategy == "optimizer") return shard::ShardOptimizer{};
  if (s.strategy == "none") return shard::NoShard{};
  return shard::HybridShard{.group_size = s.group};
}

template <comm::Communicator Comm>
void train(Comm& c, const settings& s, std::FILE* metrics) {
  const example::synthetic_task task = example::task_for(s.model);
  Model model = example::reference_model(s.model);
  auto sharded =
      shard::fully_shard(model, c, strategy_of(s), {.wrap = shard::wrap_types<Encoder>{}, .seed = s.run.seed});
  optim::Adam adam{{.lr = s.run.lr}};
  example::train_loop("train_fsdp", sharded, adam, task, s.run, metrics, [&](long first, long count) {
    return std::pair(task.inputs(first, count), task.labels(first, count));
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a launcher's pipe gets each line as it comes
  settings s;
  example::command_line cli("The FSDP article's training script: a transformer encoder classifier, every encoder "
                            "layer a sharded unit, on --world rank threads (or one rank per process under tools/launch, "
                            "torchrun, Slurm or mpirun).",
                            "train_fsdp");
  cli.add_option("--world", s.world, "ranks, as threads of this process (under a launcher: one per process)")
      ->check(example::whole(1, std::numeric_limits<int>::max()));
  cli.add_option("--strategy", s.strategy, "sharding strategy")
      ->check(CLI::IsMember({"full", "grad-op", "optimizer", "none", "hybrid"}));
  cli.add_option("--group", s.group, "HybridShard: ranks one replica is sharded over")
      ->check(example::whole(1, example::max_thread_ranks));
  example::add_model_flags(cli, s.model);
  example::add_train_flags(cli, s.run);
  example::add_accumulation_flags(cli, s.run.accumulation, true);
  cli.callback([&] {
    example::check_model_flags(s.model);
    example::check_accumulation_flags(s.run.accumulation);
    if (s.run.accumulation.no_replica_all_reduce && s.strategy != "hybrid")
      throw CLI::ValidationError("--no-replica-all-reduce", "only HybridShard has replicas (--strategy hybrid)");
    // Rank threads: --world is the world. Under a launcher the world is the launcher's, checked at run time
    // (as are malformed launcher variables).
    const bool threads = example::ranks_are_threads(cli, s.world);
    if (s.strategy == "hybrid" && threads && s.world % s.group != 0)
      throw CLI::ValidationError("--group", std::to_string(s.group) + " does not divide --world " +
                                                std::to_string(s.world));
  });
  cli.parse_or_exit(argc, argv);
  const std::string& metrics_path = s.run.metrics;
  auto open_metrics = [&](const char* mode) {
    std::FILE* m = std::fopen(metrics_path.c_str(), mode);
    require(m != nullptr, "cannot write --metrics ", metrics_path);
    return m;
  };
  std::FILE* metrics = nullptr;
  try {
    const comm::launch_environment env = comm::discover_environment();
    const bool processes = env.kind != comm::launcher::none;  // one rank per process
    if (!metrics_path.empty() && !processes) metrics = open_metrics("w");
    auto body = [&](auto& c) {
      if (!processes) return train(c, s, metrics);
      std::FILE* own = nullptr;
      if (!metrics_path.empty()) {  // rank 0 empties the file, then every process appends
        if (c.rank() == 0) std::fclose(open_metrics("w"));
        c.barrier();
        own = open_metrics("a");
      }
      train(c, s, own);
      if (own) std::fclose(own);
    };
    const comm::run_options options{.threads = s.world, .environment = env};
#if SHARDLIB_EXAMPLE_WITH_MPI
    comm::run_from_environment(body, options, comm::mpi_backend{});
#else
    comm::run_from_environment(body, options);
#endif
    if (metrics) std::fclose(metrics);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fsdp: %s\n", e.what());
    return 1;
  }
  return 0;
}
