// train_fsdp_cuda — train_fsdp on GPUs: the same classifier, data, optimizer
// settings and printout, with the model in device memory (cuda_space), layers
// computing in bfloat16 over fp32 master weights and Adam state, FullShard over
// NCCL, every encoder layer its own unit. The only changes to the user's code
// are the types: the model's element type and memory space, the communicator,
// and the device optimizer.
//
//   train_fsdp_cuda                              one GPU (world size 1)
//   mpirun -np 8 train_fsdp_cuda                 one process per GPU (device = local rank)
//   --dtype fp32                                 fp32 compute instead of bf16
#include <shardlib/comm/launch.hpp>
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/cuda.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/nn/cuda.cuh>
#include <shardlib/optim/cuda/adam.cuh>
#include <shardlib/shard/cuda/space_ops.cuh>
#include <shardlib/shard/sharded_model.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "common/flags.hpp"
#include "common/reference_model.hpp"
#include "common/device_data.cuh"
#include "common/device_world.cuh"
#include "common/synthetic.hpp"
#include "common/training.hpp"

namespace sl = shardlib;  // not `using namespace`: CUDA declares a global `half`

namespace {

struct settings {
  std::string dtype = "bf16";
  example::model_flags model;
  example::train_flags run;
};

template <class T>
void train(const sl::comm::NcclComm& nccl, const settings& s, std::FILE* metrics) {
  sl::cuda::stream compute(nccl.device());
  sl::cuda::stream_scope on_compute(compute.get());  // where tensors are allocated and layers run
  auto c = nccl.on(compute.get());                   // collectives ordered after that stream's work
  const example::synthetic_task task = example::task_for(s.model);
  auto model = example::reference_model<T, sl::cuda_space>(s.model);
  sl::shard::mixed_precision precision{};
  if constexpr (!std::is_same_v<T, float>) precision = {.param = sl::dtype_of<T>, .reduce = sl::dtype::f32};
  auto sharded = sl::shard::fully_shard<sl::optim::cuda::Adam>(model, c, sl::shard::FullShard{},
                                        {.wrap = sl::shard::wrap_types<example::EncoderOf<T, sl::cuda_space>>{},
                                         .seed = s.run.seed,
                                         .precision = precision});
  sl::optim::cuda::Adam adam{{.lr = s.run.lr}};
  example::train_loop(
      "train_fsdp_cuda", sharded, adam, task, s.run, metrics,
      [&](long first, long count) {
        return std::pair(example::to_device<T>(task.inputs(first, count)), sl::cuda::to_device(task.labels(first, count)));
      },
      [&] { sl::cuda::check(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize (end of step)"); });
}

void train(const sl::comm::NcclComm& nccl, const settings& s, std::FILE* metrics) {
  if (s.dtype == "bf16") train<sl::bfloat16>(nccl, s, metrics);
  else train<float>(nccl, s, metrics);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a launcher's pipe gets each line as it comes
  settings s;
  example::command_line cli("train_fsdp on GPUs: the same classifier, FullShard over NCCL, one GPU, or one process "
                            "per GPU under mpirun.",
                            "train_fsdp_cuda");
  cli.add_option("--dtype", s.dtype, "compute dtype")->check(CLI::IsMember({"bf16", "fp32"}));
  example::add_model_flags(cli, s.model);
  example::add_train_flags(cli, s.run);
  example::add_accumulation_flags(cli, s.run.accumulation);
  cli.callback([&] {
    example::check_model_flags(s.model);
    example::check_accumulation_flags(s.run.accumulation);
  });
  cli.parse_or_exit(argc, argv);
  const std::string& metrics_path = s.run.metrics;
  auto open_metrics = [&](const char* mode) {
    std::FILE* m = std::fopen(metrics_path.c_str(), mode);
    sl::require(m != nullptr, "cannot write --metrics ", metrics_path);
    return m;
  };
  std::FILE* metrics = nullptr;
  try {
    if (const std::string problem = sl::cuda::device_problem(); !problem.empty())
      throw sl::error(sl::cat("no usable GPU: ", problem));
    example::on_device_world(argc, argv, [&](const sl::comm::NcclComm& nccl, auto&& barrier) {
      if (!metrics_path.empty()) {  // rank 0 empties the file, then every process appends
        if (nccl.rank() == 0) std::fclose(open_metrics("w"));
        barrier();
        metrics = open_metrics("a");
      }
      train(nccl, s, metrics);
    });
    if (metrics) std::fclose(metrics);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fsdp_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
