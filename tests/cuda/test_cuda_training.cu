// Whole sharded training runs on the GPU: the reference classifier in device
// memory, every strategy, against the same run on the host; bf16 compute against
// fp32; NCCL against the thread communicator. Several ranks share one GPU through
// device_thread_comm (ThreadComm over device memory).
#include <shardlib/comm/launch.hpp>
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/stream.hpp>
#include <shardlib/core/pending.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/nn/cuda.cuh>
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/cuda/adam.cuh>
#include <shardlib/shard/cuda/space_ops.cuh>
#include <shardlib/shard/sharded_model.hpp>

#include "common/device_data.cuh"
#include "common/flags.hpp"
#include "common/reference_model.hpp"
#include "common/synthetic.hpp"
#include "device_test.hpp"
#include "device_thread_comm.hpp"
#include "support/compare.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace test_cuda_training {

namespace {

using namespace device_test;
namespace shard = sl::shard;

// A small classifier (2 encoder layers of width 32, 4 heads) so that a run takes
// a second; the batch rows of rank r at step s are rows of the global batch.
const example::model_flags sizes{.layers = 2, .d_model = 32, .heads = 4, .ff = 64, .classes = 5, .seq = 6};
const example::synthetic_task task = example::task_for(sizes);
constexpr long per_rank = 4;
constexpr int steps = 8;
constexpr double lr = 1e-3;

struct trace {
  std::vector<float> losses;   // the mean over ranks, per step
  std::vector<float> initial;  // parameter values before the first step, in the model's order
  std::vector<float> params;   // and after the last
};

// Every parameter but the key projection's bias (the middle third of
// in_proj_bias): softmax ignores a constant added to a row of scores, so its
// gradient is zero but for rounding noise (~1e-10 in fp32), which Adam turns
// into steps whose sign differs between any two implementations.
template <class Sharded>
std::vector<float> compared_parameters(Sharded& sharded) {
  std::vector<float> v;
  for (auto& [name, value] : sharded.full_state_dict(false)) {
    const auto x = value.span();
    if (name.ends_with("in_proj_bias")) {
      const std::size_t e = x.size() / 3;
      v.insert(v.end(), x.begin(), x.begin() + e);
      v.insert(v.end(), x.begin() + 2 * e, x.end());
    } else {
      v.insert(v.end(), x.begin(), x.end());
    }
  }
  return v;
}

// Labels of rows [first, first + rows) of the global batch; padded: row g ignored (-100) when
// g % 3 == 0, and every fourth pair of rows wholly (a micro-batch of two rows without any).
sl::Tensor<std::int64_t> labels(long first, long rows, bool padded) {
  auto y = task.labels(first, rows);
  for (long i = 0; padded && i < rows; ++i)
    if ((first + i) % 3 == 0 || (first + i) / 2 % 4 == 3) y[i] = -100;
  return y;
}

// read_late: every step's loss is read after the last step (a device step's loss
// stays pending on the device until then), instead of right after its step. micro > 1:
// each step is train_step over that many micro-batches of the rank's rows (gradient
// accumulation; the micro-batches before the last under no_sync, kept gathered).
// batch(first, rows) gives rows [first, first + rows) of the global batch. per_item: its
// losses weighed by their items (shard::loss_mean::per_item; the batch's labels padded).
template <class Sharded, class Optimizer, class Batch>
trace train(sl::comm::ThreadComm& host, Sharded& sharded, Optimizer& opt, Batch&& batch, bool read_late = false,
            int micro = 1, bool per_item = false) {
  const auto mean = per_item ? shard::loss_mean::per_item : shard::loss_mean::per_micro_batch;
  trace t;
  t.initial = compared_parameters(sharded);
  std::vector<sl::pending<float>> unread;
  auto record = [&](float loss) {
    std::vector<float> all(host.size());
    host.all_gather(std::span<const float>(&loss, 1), std::span<float>(all));
    t.losses.push_back(std::accumulate(all.begin(), all.end(), 0.f) / float(host.size()));
  };
  for (int s = 0; s < steps; ++s) {
    const long first = (long(s) * host.size() + host.rank()) * per_rank;
    auto r = [&] {
      if (micro == 1) {
        auto [x, y] = batch(first, per_rank);
        return sharded.train_step(opt, x, y, sl::nn::cross_entropy, {.mean = mean});
      }
      using pair = decltype(batch(first, per_rank));
      std::vector<typename pair::first_type> xs;
      std::vector<typename pair::second_type> ys;
      for (long k = 0; k < micro; ++k) {
        auto [x, y] = batch(first + k * per_rank / micro, per_rank / micro);
        xs.push_back(std::move(x));
        ys.push_back(std::move(y));
      }
      return sharded.train_step(opt, xs, ys, sl::nn::cross_entropy,
                                {.no_sync = true, .reshard_after_backward = false, .mean = mean});
    }();
    if (read_late) unread.push_back(r.loss);
    else record(r.loss);
  }
  for (const auto& loss : unread) record(loss);
  t.params = compared_parameters(sharded);
  return t;
}

template <class Strategy>
trace host_run(int world, Strategy strategy, int micro = 1, bool per_item = false) {
  std::vector<trace> out(world);
  sl::comm::launch(world, [&](sl::comm::ThreadComm& c) {
    auto model = example::reference_model<float>(sizes);
    auto sharded = shard::fully_shard(model, c, strategy, {.wrap = shard::wrap_types<example::Encoder>{}, .seed = 7});
    sl::optim::Adam adam{{.lr = lr}};
    out[c.rank()] = train(
        c, sharded, adam,
        [&](long first, long rows) { return std::pair(task.inputs(first, rows), labels(first, rows, per_item)); },
        false, micro, per_item);
  });
  return out[0];
}

template <class T>
shard::mixed_precision compute_precision() {
  if constexpr (std::is_same_v<T, float>) return {};
  else return {.param = sl::dtype_of<T>, .reduce = sl::dtype::f32};
}

// The same run with the model in device memory on GPU 0, one stream per rank, or with
// gpu_per_rank on GPU r for rank r; make_comm(host, stream) gives the rank's device
// communicator.
template <class T, class Strategy, class MakeComm>
trace device_run(int world, Strategy strategy, MakeComm&& make_comm, bool read_late = false,
                 bool gpu_per_rank = false, int micro = 1, bool per_item = false) {
  std::vector<trace> out(world);
  sl::comm::launch(world, [&](sl::comm::ThreadComm& host) {
    const int device = gpu_per_rank ? host.rank() : 0;
    sl::cuda::check(cudaSetDevice(device), "cudaSetDevice(", device, ")");
    sl::cuda::stream stream(device);
    sl::cuda::stream_scope scope(stream.get());
    auto c = make_comm(host, stream.get());
    auto model = example::reference_model<T, sl::cuda_space>(sizes);
    auto sharded = shard::fully_shard<sl::optim::cuda::Adam>(model, c, strategy,
                                      {.wrap = shard::wrap_types<example::EncoderOf<T, sl::cuda_space>>{},
                                       .seed = 7,
                                       .precision = compute_precision<T>()});
    sl::optim::cuda::Adam adam{{.lr = lr}};
    out[host.rank()] = train(
        host, sharded, adam,
        [&](long first, long rows) {
          return std::pair(example::to_device<T>(task.inputs(first, rows)),
                           sl::cuda::to_device(labels(first, rows, per_item)));
        },
        read_late, micro, per_item);
  });
  return out[0];
}

auto thread_comm = [](sl::comm::ThreadComm& host, cudaStream_t) { return device_thread_comm(host); };
auto nccl_comm = [](sl::comm::ThreadComm& host, cudaStream_t s) {
  return sl::comm::NcclComm::bootstrap(host, 0).on(s);
};
auto nccl_comm_per_gpu = [](sl::comm::ThreadComm& host, cudaStream_t s) {
  return sl::comm::NcclComm::bootstrap(host, host.rank()).on(s);
};

// The device run against the host's: losses within 1e-4; parameters within 1e-5 of
// theirs in the 2-norm, and each within 1e-2 of max(|p|, lr) (the decoder test's
// bounds). Adam moves every parameter by about lr per step whatever its gradient's
// scale, so a parameter near zero is compared on that scale, and an element whose
// gradient nearly cancels has its rounding normalised into a whole step: one such
// element differs by 2.4e-4 of its value in the emulated run (float64 products), which
// makes the whole 1.0e-6 in the 2-norm. A lost or doubled gradient piece moves whole
// tensors by ~lr per step: 1e-2 and more in the 2-norm.
void require_trains_alike(const trace& got, const trace& want) {
  test_support::max_error losses, params;  // NaN and infinities count as +inf
  losses.relative(got.losses, want.losses, 0.0);
  params.relative(got.params, want.params, lr);
  const double norm = test_support::relative_norm_error(got.params, want.params);
  INFO("losses " << losses << ", parameters " << params << ", in the 2-norm " << norm);
  CHECK(losses <= 1e-4);
  CHECK(params <= 1e-2);
  CHECK(norm <= 1e-5);
}

}  // namespace

// fp32 on both sides: the same initial values (drawn by parameter name and index),
// the same dropout masks (counter-based, drawn alike on host and device), the same
// batches and rank-ordered reductions; what differs is cuBLAS's and oneDNN's
// summation order and nvcc's fused multiply-adds, ~1e-6 relative per op, which 8
// Adam steps of lr 1e-3 carry into the parameters (require_trains_alike's bounds).
TEMPLATE_TEST_CASE("every strategy trains on the GPU as on the host (fp32, two ranks on one GPU)",
                   "[cuda][training]", shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer, shard::NoShard) {
  if (!have_device()) return;
  const auto want = host_run(2, TestType{});
  const auto got = device_run<float>(2, TestType{}, thread_comm);
  require_trains_alike(got, want);
}

TEST_CASE("hybrid sharding trains on the GPU as on the host (fp32, four ranks on one GPU)", "[cuda][training]") {
  if (!have_device()) return;
  const auto want = host_run(4, shard::HybridShard{.group_size = 2});
  const auto got = device_run<float>(4, shard::HybridShard{.group_size = 2}, thread_comm);
  require_trains_alike(got, want);
}

// policy::reshard_to on the device: each unit's bf16 part kept after forward in device memory,
// backward's all-gather from it within pairs of ranks; the same values move, so the training
// is FullShard's bit for bit.
TEST_CASE("bf16 compute resharded to pairs after forward trains on the GPU as FullShard (four ranks on one GPU)",
          "[cuda][training][reshard]") {
  if (!have_device()) return;
  const auto want = device_run<sl::bfloat16>(4, shard::FullShard{}, thread_comm);
  const auto got = device_run<sl::bfloat16>(4, shard::FullShard{.reshard_to = 2}, thread_comm);
  CHECK(got.losses == want.losses);
  CHECK(got.params == want.params);
}

// bf16 compute rounds every activation, weight and gradient to 8 significant
// bits (relative error up to 2^-8 per rounding); through 2 encoder layers the
// logits carry a few such errors, so the loss agrees with fp32's to ~1e-2. The
// parameters move by ~lr per Adam step whatever the gradient's size, so their
// values say little; their updates say whether the bf16 gradients point where
// fp32's do: Adam's update is about lr times the gradient's sign, which bf16
// rounding flips only where a gradient is within rounding of zero, so the
// updates of the two runs are nearly parallel (cosine ~1; random or wrong
// gradients give ~0).
TEST_CASE("bf16 compute over fp32 masters trains as fp32 within bf16 tolerance", "[cuda][training][bf16]") {
  if (!have_device()) return;
  const auto want = host_run(2, shard::FullShard{});
  const auto got = device_run<sl::bfloat16>(2, shard::FullShard{}, thread_comm);
  test_support::max_error loss_worst;  // NaN and infinities count as +inf
  loss_worst.relative(got.losses, want.losses, 0.0);
  REQUIRE(got.initial == want.initial);  // the same initialisation, drawn on the device's host side
  double dot = 0, got2 = 0, want2 = 0;
  for (std::size_t i = 0; i < want.params.size(); ++i) {
    const double g = double(got.params[i]) - got.initial[i], w = double(want.params[i]) - want.initial[i];
    dot += g * w;
    got2 += g * g;
    want2 += w * w;
  }
  const double cosine = dot / std::sqrt(got2 * want2);
  INFO("worst loss difference " << loss_worst << ", cosine of the parameter updates " << cosine);
  CHECK(loss_worst <= 2e-2);
  CHECK(cosine >= 0.9);
}

// One rank: NCCL's average over one rank is the identity and the kernels are the
// same, so the runs agree bit for bit — NcclComm's stream ordering (collectives
// after the compute stream's work, the compute stream after the collectives) is
// what this checks.
TEST_CASE("FullShard bf16 over NCCL equals the thread communicator at world size 1", "[cuda][training][nccl]") {
  if (!have_device()) return;
  const auto over_threads = device_run<sl::bfloat16>(1, shard::FullShard{}, thread_comm);
  const auto over_nccl = device_run<sl::bfloat16>(1, shard::FullShard{}, nccl_comm);
  CHECK(over_nccl.losses == over_threads.losses);
  CHECK(over_nccl.params == over_threads.params);
}

// What a multi-GPU node runs: one thread and one GPU per rank, NCCL between them (every
// buffer, stream, event and launch of a rank on its own device). NCCL's reductions sum in
// ring order, not the host's rank order: the fp32 bounds above hold either way.
TEST_CASE("FullShard and HybridShard train over NCCL with one GPU per rank as on the host (fp32)",
          "[cuda][training][nccl]") {
  if (!have_device()) return;
  const int gpus = sl::cuda::device_count();
  if (gpus < 2) {
    WARN("one GPU: training over NCCL with a GPU per rank runs on machines with several");
    return;
  }
  require_trains_alike(device_run<float>(2, shard::FullShard{}, nccl_comm_per_gpu, false, true),
                       host_run(2, shard::FullShard{}));
  if (gpus < 4) return;
  require_trains_alike(device_run<float>(4, shard::HybridShard{.group_size = 2}, nccl_comm_per_gpu, false, true),
                       host_run(4, shard::HybridShard{.group_size = 2}));
}

// The global mean loss is left on the device (its sum, all-reduced there) until it is
// read: read after the last step, each step's loss is the one read right after its step,
// bit for bit, and so is the training (the same kernels and the same reductions in the
// same order; only when the host reads differs).
TEST_CASE("losses read after the last step equal those read after each step (two ranks)", "[cuda][training]") {
  if (!have_device()) return;
  const auto prompt = device_run<float>(2, shard::FullShard{}, thread_comm);
  const auto late = device_run<float>(2, shard::FullShard{}, thread_comm, true);
  REQUIRE(late.losses.size() == std::size_t(steps));
  CHECK(late.losses == prompt.losses);
  CHECK(late.params == prompt.params);
  for (float loss : late.losses) CHECK(std::isfinite(loss));
}

// Gradient accumulation on the device: train_step over two micro-batches of two rows, the
// first unreduced and kept gathered, trains as the host's; each step's mean loss stays on
// the device until read, and read after the last step it is the one read after its step.
TEST_CASE("train_step over micro-batches trains on the GPU as on the host (two ranks)",
          "[cuda][training][accumulation]") {
  if (!have_device()) return;
  const auto want = host_run(2, shard::FullShard{}, 2);
  const auto got = device_run<float>(2, shard::FullShard{}, thread_comm, false, false, 2);
  require_trains_alike(got, want);
  const auto late = device_run<float>(2, shard::FullShard{}, thread_comm, true, false, 2);
  CHECK(late.losses == got.losses);
  CHECK(late.params == got.params);
}

// Padded labels weighed per item (shard::loss_mean::per_item): each micro-batch's rows counted
// on the device (one read each) and its loss gradient scaled by its share of the step's, a
// micro-batch without items left out of the mean loss, which stays on the device until read.
TEST_CASE("train_step weighing micro-batches by their items trains on the GPU as on the host (two ranks)",
          "[cuda][training][accumulation][items]") {
  if (!have_device()) return;
  require_trains_alike(device_run<float>(2, shard::FullShard{}, thread_comm, false, false, 2, true),
                       host_run(2, shard::FullShard{}, 2, true));
  require_trains_alike(device_run<float>(2, shard::FullShard{}, thread_comm, false, false, 1, true),
                       host_run(2, shard::FullShard{}, 1, true));
  // The device count is the host's.
  for (long first : {0L, 6L, 8L}) {
    const auto y = labels(first, 4, true);
    CHECK(sl::nn::cross_entropy.items(sl::cuda::to_device(y)) == sl::nn::cross_entropy.items(y));
  }
}

}  // namespace test_cuda_training
