// train_fsdp — the FSDP article's training script in C++: a 6-layer transformer
// encoder classifier (d_model 512, 8 heads, feed-forward 2048), every encoder
// layer its own sharded unit, 4 ranks, Adam lr 1e-3, 100 steps, printing
// "Rank r, Step s, Loss: x" every 10 steps, then the consolidated model written
// to a safetensors file for inference. Rank 0 adds a progress line (throughput, ETA)
// after each printout; --metrics FILE writes one JSON line per step and rank (loss,
// tokens/s, and the step's ledger peaks by category) for tools/plot.py.
//
// Ranks are threads of this process by default; started under mpirun (and built
// with MPI), each process is one rank.
#include <shardlib/comm/launch.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/shard/sharded_model.hpp>
#if SHARDLIB_EXAMPLE_WITH_MPI
#include <shardlib/mpi.hpp>
#endif

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "common/flags.hpp"
#include "common/reference_model.hpp"
#include "common/synthetic.hpp"
#include "common/training.hpp"

using namespace shardlib;
using example::Encoder;
using example::Model;

namespace {

template <comm::Communicator Comm, shard::ShardingStrategy Strategy>
void train(Comm& c, Strategy strategy, const example::flags& f, std::FILE* metrics) {
  example::synthetic_task task{.seq = f.num("seq"), .d = f.num("d-model"), .classes = f.num("classes")};
  Model model = example::reference_model(f, task);
  auto sharded = shard::fully_shard(model, c, strategy,
                                    {.wrap = shard::wrap_types<Encoder>{}, .seed = std::uint64_t(f.num("seed"))});
  optim::Adam adam{{.lr = f.real("lr")}};
  example::train_loop("train_fsdp", sharded, adam, task, f, metrics, [&](long first, long count) {
    return std::pair(task.inputs(first, count), task.labels(first, count));
  });
}

template <comm::Communicator Comm>
void train(Comm& c, const example::flags& f, std::FILE* metrics) {
  const std::string s = f.str("strategy");
  if (s == "full") train(c, shard::FullShard{}, f, metrics);
  else if (s == "grad-op") train(c, shard::ShardGradOp{}, f, metrics);
  else if (s == "optimizer") train(c, shard::ShardOptimizer{}, f, metrics);
  else if (s == "none") train(c, shard::NoShard{}, f, metrics);
  else if (s == "hybrid") train(c, shard::HybridShard{.group_size = int(f.num("group"))}, f, metrics);
  else throw error(cat("train_fsdp: unknown --strategy '", s, "' (full, grad-op, optimizer, none, hybrid)"));
}

}  // namespace

int main(int argc, char** argv) {
  example::flags f(argc, argv,
                   {{"world", "4"}, {"strategy", "full"}, {"group", "2"}, {"steps", "100"}, {"batch", "8"},
                    {"seq", "10"}, {"d-model", "512"}, {"heads", "8"}, {"ff", "2048"}, {"layers", "6"},
                    {"classes", "10"}, {"lr", "1e-3"}, {"dropout", "0.1"}, {"seed", "0"}, {"every", "10"},
                    {"out", "model.safetensors"}, {"metrics", ""}});
  const std::string metrics_path = f.str("metrics");
  auto open_metrics = [&](const char* mode) {
    std::FILE* m = std::fopen(metrics_path.c_str(), mode);
    require(m != nullptr, "cannot write --metrics ", metrics_path);
    return m;
  };
  std::FILE* metrics = nullptr;
  try {
#if SHARDLIB_EXAMPLE_WITH_MPI
    if (std::getenv("OMPI_COMM_WORLD_SIZE")) {  // one rank per process
      comm::mpi_session mpi(&argc, &argv);
      auto world = comm::MpiComm::world();
      if (!metrics_path.empty()) {  // rank 0 empties the file, then every process appends
        if (world.rank() == 0) std::fclose(open_metrics("w"));
        world.barrier();
        metrics = open_metrics("a");
      }
      train(world, f, metrics);
      if (metrics) std::fclose(metrics);
      return 0;
    }
#endif
    if (!metrics_path.empty()) metrics = open_metrics("w");
    comm::launch(int(f.num("world")), [&](comm::ThreadComm& c) { train(c, f, metrics); });
    if (metrics) std::fclose(metrics);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fsdp: %s\n", e.what());
    return 1;
  }
  return 0;
}
