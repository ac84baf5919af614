// train_fsdp — the FSDP article's training script in C++: a 6-layer transformer
// encoder classifier (d_model 512, 8 heads, feed-forward 2048), every encoder
// layer its own sharded unit, 4 ranks, Adam lr 1e-3, 100 steps, printing
// "Rank r, Step s, Loss: x" every 10 steps, then the consolidated model written
// to a safetensors file for inference.
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

#include "common/flags.hpp"
#include "common/synthetic.hpp"

using namespace shardlib;
using Encoder = nn::TransformerEncoderLayer<float>;
using Model = nn::Sequential<nn::Stack<Encoder>, nn::MeanPool<float>, nn::Linear<float>>;

namespace {

template <comm::Communicator Comm, shard::ShardingStrategy Strategy>
void train(Comm& c, Strategy strategy, const example::flags& f) {
  const long steps = f.num("steps"), batch = f.num("batch"), every = f.num("every");
  example::synthetic_task task{.seq = f.num("seq"), .d = f.num("d-model"), .classes = f.num("classes")};
  Model model{nn::Stack<Encoder>(std::size_t(f.num("layers")), {.d_model = task.d,
                                                                .nhead = f.num("heads"),
                                                                .dim_feedforward = f.num("ff"),
                                                                .dropout = f.real("dropout"),
                                                                .batch_first = true}),
              nn::MeanPool<float>(1), nn::Linear<float>(task.d, task.classes)};
  auto sharded = shard::fully_shard(model, c, strategy,
                                    {.wrap = shard::wrap_types<Encoder>{}, .seed = std::uint64_t(f.num("seed"))});
  optim::Adam adam{{.lr = f.real("lr")}};
  if (c.rank() == 0)
    std::printf("train_fsdp: %zu parameters in %zu units, %s over %d ranks, per-rank batch %ld\n",
                nn::parameter_count(model), sharded.units().size(), std::string(Strategy::name).c_str(), c.size(),
                batch);
  auto t0 = std::chrono::steady_clock::now();
  for (long step = 0; step < steps; ++step) {
    // Each rank takes its own slice of the global batch of step `step`.
    const long first = (step * c.size() + c.rank()) * batch;
    float loss = sharded.train_step(adam, task.inputs(first, batch), task.labels(first, batch), nn::cross_entropy);
    if (step % every == 0) std::printf("Rank %d, Step %ld, Loss: %f\n", c.rank(), step, double(loss));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
void train(Comm& c, const example::flags& f) {
  const std::string s = f.str("strategy");
  if (s == "full") train(c, shard::FullShard{}, f);
  else if (s == "grad-op") train(c, shard::ShardGradOp{}, f);
  else if (s == "optimizer") train(c, shard::ShardOptimizer{}, f);
  else if (s == "none") train(c, shard::NoShard{}, f);
  else if (s == "hybrid") train(c, shard::HybridShard{.group_size = int(f.num("group"))}, f);
  else throw error(cat("train_fsdp: unknown --strategy '", s, "' (full, grad-op, optimizer, none, hybrid)"));
}

}  // namespace

int main(int argc, char** argv) {
  example::flags f(argc, argv,
                   {{"world", "4"}, {"strategy", "full"}, {"group", "2"}, {"steps", "100"}, {"batch", "8"},
                    {"seq", "10"}, {"d-model", "512"}, {"heads", "8"}, {"ff", "2048"}, {"layers", "6"},
                    {"classes", "10"}, {"lr", "1e-3"}, {"dropout", "0.1"}, {"seed", "0"}, {"every", "10"},
                    {"out", "model.safetensors"}});
  try {
#if SHARDLIB_EXAMPLE_WITH_MPI
    if (std::getenv("OMPI_COMM_WORLD_SIZE")) {  // one rank per process
      comm::mpi_session mpi(&argc, &argv);
      auto world = comm::MpiComm::world();
      train(world, f);
      return 0;
    }
#endif
    comm::launch(int(f.num("world")), [&](comm::ThreadComm& c) { train(c, f); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fsdp: %s\n", e.what());
    return 1;
  }
  return 0;
}
