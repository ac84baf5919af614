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
#include <shardlib/io/safetensors.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/pooling.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/nn/transformer.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/shard/sharded_model.hpp>
#if SHARDLIB_EXAMPLE_WITH_MPI
#include <shardlib/mpi.hpp>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/flags.hpp"
#include "common/reference_model.hpp"
#include "common/synthetic.hpp"

using namespace shardlib;
using example::Encoder;
using example::Model;

namespace {

// One JSON line per step of this rank; one fprintf per line, so the lines of ranks
// sharing the file (threads: a locked FILE; processes: O_APPEND) never interleave.
void log_metrics(std::FILE* out, std::string_view strategy, int world, int rank, long step, float loss, double seconds,
                 double tokens, const ledger& l) {
  std::string peaks;
  for (int k = 0; k < category_count; ++k) peaks += cat("\"", name(category(k)), "\":", l.peak(category(k)), ",");
  std::fprintf(out,
               "{\"bench\":\"train_fsdp\",\"strategy\":\"%s\",\"world\":%d,\"rank\":%d,\"step\":%ld,\"loss\":%.9g,"
               "\"step_s\":%.9g,\"tokens_per_s\":%.9g,\"peak_bytes\":{%s\"total\":%zu}}\n",
               std::string(strategy).c_str(), world, rank, step, double(loss), seconds, tokens / seconds, peaks.c_str(),
               l.peak());
  std::fflush(out);
}

template <comm::Communicator Comm, shard::ShardingStrategy Strategy>
void train(Comm& c, Strategy strategy, const example::flags& f, std::FILE* metrics) {
  const long steps = f.num("steps"), batch = f.num("batch"), every = f.num("every");
  example::synthetic_task task{.seq = f.num("seq"), .d = f.num("d-model"), .classes = f.num("classes")};
  Model model = example::reference_model(f, task);
  auto sharded = shard::fully_shard(model, c, strategy,
                                    {.wrap = shard::wrap_types<Encoder>{}, .seed = std::uint64_t(f.num("seed"))});
  optim::Adam adam{{.lr = f.real("lr")}};
  if (c.rank() == 0)
    std::printf("train_fsdp: %zu parameters in %zu units, %s over %d ranks, per-rank batch %ld\n",
                nn::parameter_count(model), sharded.units().size(), std::string(Strategy::name).c_str(), c.size(),
                batch);
  auto since = [](auto t) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); };
  ledger& l = current_ledger();  // this rank's
  const double tokens = double(batch * task.seq);  // per rank and step
  auto t0 = std::chrono::steady_clock::now();
  for (long step = 0; step < steps; ++step) {
    // Each rank takes its own slice of the global batch of step `step`.
    const long first = (step * c.size() + c.rank()) * batch;
    l.reset_peaks();  // the peaks of this step alone
    const auto t_step = std::chrono::steady_clock::now();
    float loss = sharded.train_step(adam, task.inputs(first, batch), task.labels(first, batch), nn::cross_entropy);
    if (metrics) log_metrics(metrics, Strategy::name, c.size(), c.rank(), step, loss, since(t_step), tokens, l);
    if (step % every == 0) std::printf("Rank %d, Step %ld, Loss: %f\n", c.rank(), step, double(loss));
    if (step % every == 0 && c.rank() == 0) {
      const double elapsed = since(t0), per_step = elapsed / double(step + 1);
      std::printf("train_fsdp: step %ld/%ld, %.0f tokens/s over %d ranks, %.3f s/step, ETA %.1f s\n", step + 1, steps,
                  tokens * c.size() / per_step, c.size(), per_step, per_step * double(steps - step - 1));
    }
  }
  const double seconds = since(t0);
  auto state = sharded.full_state_dict();  // rank 0 holds it, one unit gathered at a time
  if (c.rank() == 0) {
    io::safetensors_writer out;
    for (auto& [name, t] : state) out.add<float>(name, t.shape(), t.span());
    out.set_metadata("format", "pt");
    out.write(f.str("out"));
    std::printf("train_fsdp: %.3f s per step; model written to %s\n", seconds / double(steps), f.str("out").c_str());
  }
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
