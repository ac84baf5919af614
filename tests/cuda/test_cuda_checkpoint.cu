// Device checkpoints: a model trained in device memory (fp32 or bf16 layers over fp32
// masters, optim::cuda::AdamW) saves, loads at another world size, exports and imports
// safetensors through pinned staging buffers, and every file is byte for byte the file
// the host path writes for a host model holding the same values (copied over with
// cudaMemcpy, not through io). Several ranks share one GPU through device_thread_comm;
// one rank also runs over NCCL, whose collectives read device memory only.
#include <shardlib/comm/launch.hpp>
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/cuda/copy.hpp>
#include <shardlib/cuda/stream.hpp>
#include <shardlib/ops/cuda/elementwise.cuh>
#include <shardlib/cuda/current.hpp>
#include <shardlib/io/checkpoint.hpp>
#include <shardlib/nn/cuda.cuh>
#include <shardlib/nn/freeze.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/lora.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/cuda/adam.cuh>
#include <shardlib/optim/cuda/sgd.cuh>
#include <shardlib/optim/sgd.hpp>
#include <shardlib/shard/cuda/space_ops.cuh>
#include <shardlib/shard/sharded_model.hpp>

#include "device_test.hpp"
#include "device_thread_comm.hpp"
#include "support/checkpoint_files.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace test_cuda_checkpoint {

namespace {

using namespace device_test;
namespace shard = sl::shard;
namespace io = sl::io;
namespace fs = std::filesystem;

template <class T, class Space>
using Layer = sl::nn::Linear<T, Space>;
template <class T, class Space>
using Model = sl::nn::Sequential<Layer<T, Space>, sl::nn::Stack<Layer<T, Space>>, Layer<T, Space>>;
template <class T, class Space>
Model<T, Space> make_model() {
  return Model<T, Space>{Layer<T, Space>(6, 16), sl::nn::Stack<Layer<T, Space>>(3, Layer<T, Space>(16, 16)),
                         Layer<T, Space>(16, 5)};
}
template <class T>
shard::options options_for(std::uint64_t seed) {
  shard::options o{.wrap = shard::wrap_types<Layer<T, sl::cuda_space>>{}, .seed = seed};
  if constexpr (!std::is_same_v<T, float>) o.precision = {.param = sl::dtype_of<T>, .reduce = sl::dtype::f32};
  return o;
}
// The host twin: fp32 layers, the same wrap, and the same precision record (16-bit
// gathers of fp32 layers write the same param_dtype into the metadata).
template <class T>
shard::options host_options() {
  shard::options o{.wrap = shard::wrap_types<Layer<float, sl::host_space>>{}, .seed = 1};
  o.precision = options_for<T>(1).precision;
  return o;
}
const sl::optim::AdamW::options_type adamw{.lr = 1e-2, .weight_decay = 0.1};

// Rank r's rows of step s's global batch of 12: inputs in [-1, 1), labels in [0, 5).
template <class T>
std::pair<sl::Tensor<T, sl::cuda_space>, sl::Tensor<std::int64_t, sl::cuda_space>> batch(int step, int rank,
                                                                                        int world) {
  const std::int64_t rows = 12 / world, first = rows * rank;
  sl::Tensor<float> x({rows, 6});
  sl::Tensor<std::int64_t> y({rows});
  sl::counter_rng rng(300 + std::uint64_t(step), 1);
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = 2 * rng.uniform_float(std::uint64_t(first * 6 + i)) - 1;
  for (std::int64_t r = 0; r < rows; ++r)
    y[r] = std::int64_t(rng.uniform_float(std::uint64_t(1000 + first + r)) * 5) % 5;
  auto wide = sl::cuda::to_device(x);
  auto labels = sl::cuda::to_device(y);
  if constexpr (std::is_same_v<T, float>) {
    return {wide, labels};
  } else {
    sl::Tensor<T, sl::cuda_space> narrow(x.shape());
    sl::ops::cuda::cast(std::span<const float>(wide.span()), narrow.span(), sl::cuda::current_stream());
    return {narrow, labels};
  }
}

// Values in device or host memory, read with cudaMemcpy (unified addressing tells which).
std::vector<float> read(std::span<const float> v) {
  std::vector<float> h(v.size());
  if (v.empty()) return h;
  const cudaStream_t s = sl::cuda::current_stream();
  sl::cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize (before reading values)");
  sl::cuda::check(cudaMemcpy(h.data(), v.data(), v.size_bytes(), cudaMemcpyDefault), "cudaMemcpy (reading values)");
  return h;
}

// What a rank holds: each unit's master piece and optimizer buffers, the steps.
struct held {
  std::vector<std::vector<float>> masters;
  std::vector<std::map<std::string, std::vector<float>>> buffers;
  std::vector<std::int64_t> optimizer_steps;
  std::uint64_t steps = 0;
  bool operator==(const held&) const = default;
};
template <class Sharded, class Opt>
held hold(Sharded& sharded, Opt& opt) {
  held h;
  h.steps = sharded.steps();
  for (std::size_t i = 0; i < sharded.unit_count(); ++i) {
    h.masters.push_back(read(sharded.master_piece(i)));
    auto& st = sharded.optimizer_state(opt, i);
    auto& mine = h.buffers.emplace_back();
    st.for_each_buffer([&](std::string_view name, auto& b) { mine[std::string(name)] = read(b.span()); });
    h.optimizer_steps.push_back(st.step);
  }
  return h;
}
// The same values into a host model of the same world size, strategy and wrap.
template <class Sharded, class Opt>
void put(Sharded& sharded, Opt& opt, const held& h) {
  for (std::size_t i = 0; i < sharded.unit_count(); ++i) {
    sharded.load_master(i, std::span<const float>(h.masters.at(i)));
    auto& st = sharded.optimizer_state(opt, i);
    st.for_each_buffer([&](std::string_view name, sl::Buffer<float>& b) {
      const auto& v = h.buffers.at(i).at(std::string(name));
      std::copy(v.begin(), v.end(), b.span().begin());
    });
    st.step = h.optimizer_steps.at(i);
  }
  sharded.set_steps(h.steps);
}

// Runs fn(device communicator, host communicator, stream) on `world` thread ranks
// sharing GPU 0, one stream each. Ranks record what they find (Catch is not
// thread-safe); the main thread checks.
template <class Fn>
void on_ranks(int world, Fn&& fn) {
  sl::comm::launch(world, [&](sl::comm::ThreadComm& host) {
    sl::cuda::check(cudaSetDevice(0), "cudaSetDevice(0)");
    sl::cuda::stream stream(0);
    sl::cuda::stream_scope scope(stream.get());
    device_thread_comm dc(host);
    fn(dc, host, stream.get());
  });
}

void require_same_files(const fs::path& got_dir, const fs::path& want_dir, std::size_t expected) {
  const auto got = test_support::files_under(got_dir), want = test_support::files_under(want_dir);
  CHECK(want.size() == expected);
  CHECK(got.size() == want.size());
  for (const auto& [name, bytes] : want) {
    INFO(name);
    const auto it = got.find(name);
    REQUIRE(it != got.end());
    CHECK(!bytes.empty());
    CHECK(it->second == bytes);
  }
}


// fp32: a device step and a host step differ by rounding, so the host model does not
// train: it takes the device's values, and then both must write the same bytes. Every
// model, device and host, is made by make_model and then `prepare` (freezing, adapters).
template <class T, class Prepare>
void device_files_match_host(const std::string& tag, Prepare prepare) {
  const test_support::temp_dir dev_dir("cuda_checkpoint_device" + tag), host_dir("cuda_checkpoint_host" + tag);
  const fs::path dev = dev_dir.path, hst = host_dir.path;
  std::vector<std::string> problems(4);

  // W = 2, FullShard: train 3 steps on the device, save and export; the host twin takes the values and does the same.
  on_ranks(2, [&](device_thread_comm& dc, sl::comm::ThreadComm& host, cudaStream_t) {
    auto model = make_model<T, sl::cuda_space>();
    prepare(model);
    auto sharded = shard::fully_shard<sl::optim::cuda::AdamW>(model, dc, shard::FullShard{}, options_for<T>(7));
    sl::optim::cuda::AdamW opt{adamw};
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = batch<T>(s, host.rank(), 2);
      sharded.train_step(opt, x, y, sl::nn::cross_entropy);
    }
    io::save_checkpoint(dev / "ckpt", sharded, opt, {.tag = "trained", .chunk_bytes = 512});
    io::export_safetensors(dev / "model.safetensors", sharded, opt);
    const held values = hold(sharded, opt);

    auto host_model = make_model<float, sl::host_space>();
    prepare(host_model);
    auto twin = shard::fully_shard<sl::optim::AdamW>(host_model, host, shard::FullShard{}, host_options<T>());
    sl::optim::AdamW host_opt{adamw};
    put(twin, host_opt, values);
    io::save_checkpoint(hst / "ckpt", twin, host_opt, {.tag = "trained", .chunk_bytes = 512});
    io::export_safetensors(hst / "model.safetensors", twin, host_opt);
    if (hold(twin, host_opt) != values) problems[std::size_t(host.rank())] += "the host twin holds other values; ";
  });
  // W = 3, ShardGradOp: each side loads its own checkpoint (a resharding load); the device
  // must then hold the host's values exactly, and save the same files again.
  on_ranks(3, [&](device_thread_comm& dc, sl::comm::ThreadComm& host, cudaStream_t) {
    auto model = make_model<T, sl::cuda_space>();
    prepare(model);
    auto sharded = shard::fully_shard<sl::optim::cuda::AdamW>(model, dc, shard::ShardGradOp{}, options_for<T>(99));
    sl::optim::cuda::AdamW opt{{.lr = 0.5}};  // the checkpoint's hyperparameters replace these
    io::load_checkpoint(dev / "ckpt" / "trained", sharded, opt);

    auto host_model = make_model<float, sl::host_space>();
    prepare(host_model);
    auto twin = shard::fully_shard<sl::optim::AdamW>(host_model, host, shard::ShardGradOp{}, host_options<T>());
    sl::optim::AdamW host_opt{{.lr = 0.5}};
    io::load_checkpoint(hst / "ckpt" / "trained", twin, host_opt);
    io::save_checkpoint(hst / "ckpt", twin, host_opt, {.tag = "resharded"});
    auto& problem = problems[std::size_t(host.rank())];
    if (hold(sharded, opt) != hold(twin, host_opt))
      problem += "after the resharding load the device holds other values than the host; ";
    // The device saves in the background while it trains on: the files hold the values of the call.
    auto pending = io::async_save_checkpoint(dev / "ckpt", sharded, opt, {.tag = "resharded"});
    auto [x, y] = batch<T>(3, host.rank(), 3);
    sharded.train_step(opt, x, y, sl::nn::cross_entropy);
    pending.wait();
    if (opt.options.lr != adamw.lr || opt.options.weight_decay != adamw.weight_decay)
      problem += "the optimizer's hyperparameters were not restored; ";
  });
  // W = 1 over NCCL (device memory only, io's own collectives included), ShardOptimizer
  // (16-bit layers' fp32 masters need a strategy that shards optimizer state): import the
  // export and export it again; and over the thread communicator the same.
  on_ranks(1, [&](device_thread_comm& dc, sl::comm::ThreadComm& host, cudaStream_t s) {
    auto nccl = sl::comm::NcclComm::bootstrap(host, 0).on(s);
    auto model = make_model<T, sl::cuda_space>();
    prepare(model);
    auto sharded = shard::fully_shard<sl::optim::cuda::AdamW>(model, nccl, shard::ShardOptimizer{}, options_for<T>(5));
    sl::optim::cuda::AdamW opt{adamw};
    io::load_safetensors(dev / "model.safetensors", sharded, opt);
    io::export_safetensors(dev / "again.safetensors", sharded, opt);
    io::load_checkpoint(dev / "ckpt" / "trained", sharded, opt);
    io::save_checkpoint(dev / "ckpt", sharded, opt, {.tag = "one-rank"});

    auto host_model = make_model<float, sl::host_space>();
    prepare(host_model);
    auto twin = shard::fully_shard<sl::optim::AdamW>(host_model, host, shard::ShardOptimizer{}, host_options<T>());
    sl::optim::AdamW host_opt{adamw};
    io::load_safetensors(hst / "model.safetensors", twin, host_opt);
    io::export_safetensors(hst / "again.safetensors", twin, host_opt);
    io::load_checkpoint(hst / "ckpt" / "trained", twin, host_opt);
    io::save_checkpoint(hst / "ckpt", twin, host_opt, {.tag = "one-rank"});
    (void)dc;
  });
  for (const auto& p : problems) CHECK(p == "");
  // Three checkpoints (metadata.json and 2, 3 and 1 shard files) and two exports.
  require_same_files(dev, hst, 3 + 2 + 3 + 1 + 2);
  const auto files = test_support::files_under(dev);
  CHECK(files.at("again.safetensors") == files.at("model.safetensors"));
}

}  // namespace

TEMPLATE_TEST_CASE("a device model's checkpoints and exports are the host's files byte for byte",
                   "[cuda][checkpoint]", float, sl::bfloat16) {
  if (!have_device()) return;
  device_files_match_host<TestType>("", [](auto&) {});
}

// Frozen elements have no optimizer state; the files spread it over whole pieces, zeros
// where frozen, from device memory as from host memory, and a device load gathers the
// runs back (at W = 3 the piece after 1.layers.1.bias keeps a run of padding: two runs).
TEMPLATE_TEST_CASE("a device model with frozen parameters writes and loads the host's files",
                   "[cuda][checkpoint][frozen]", float, sl::bfloat16) {
  if (!have_device()) return;
  device_files_match_host<TestType>("_frozen", [](auto& m) { sl::nn::freeze(m, {"0.weight", "1.layers.1.bias"}); });
}

// LoRA adapters on three of the five Linears (nn::add_lora: everything else frozen): each
// of those units holds its frozen base beside the adapters, whose state alone the files
// keep, from device memory as from host memory.
TEMPLATE_TEST_CASE("a device model with LoRA adapters writes and loads the host's files",
                   "[cuda][checkpoint][lora]", float, sl::bfloat16) {
  if (!have_device()) return;
  device_files_match_host<TestType>("_lora", [](auto& m) { sl::nn::add_lora(m, {"0", "1.layers.1", "2"}, {.r = 2}); });
}

// The device SGD's momentum buffer is recorded as the host SGD's (torch.optim.SGD's
// momentum_buffer): a device model trained by it writes the host's files for the same
// values, and a device model at another world size loads them back with the checkpoint's
// hyperparameters.
TEST_CASE("a device model trained by SGD with momentum writes the host's files and loads them back",
          "[cuda][checkpoint][sgd]") {
  if (!have_device()) return;
  const test_support::temp_dir dev_dir("cuda_checkpoint_sgd_device"), host_dir("cuda_checkpoint_sgd_host");
  const fs::path dev = dev_dir.path, hst = host_dir.path;
  const sl::optim::SGD::options_type sgd{.lr = 1e-2, .momentum = 0.9, .weight_decay = 1e-3};
  std::vector<std::string> problems(3);
  on_ranks(2, [&](device_thread_comm& dc, sl::comm::ThreadComm& host, cudaStream_t) {
    auto model = make_model<float, sl::cuda_space>();
    auto sharded = shard::fully_shard<sl::optim::cuda::SGD>(model, dc, shard::FullShard{}, options_for<float>(7));
    sl::optim::cuda::SGD opt{sgd};
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = batch<float>(s, host.rank(), 2);
      sharded.train_step(opt, x, y, sl::nn::cross_entropy, {.max_norm = 1});  // gated: decided on the device
    }
    io::save_checkpoint(dev / "ckpt", sharded, opt, {.tag = "trained"});
    io::export_safetensors(dev / "model.safetensors", sharded, opt);
    const held values = hold(sharded, opt);
    auto& mine = problems[std::size_t(host.rank())];
    if (values.buffers.at(1).count("momentum_buffer") == 0) mine += "no momentum buffer; ";
    if (values.optimizer_steps.at(1) != 3) mine += "other than 3 steps counted; ";

    auto host_model = make_model<float, sl::host_space>();
    auto twin = shard::fully_shard<sl::optim::SGD>(host_model, host, shard::FullShard{}, host_options<float>());
    sl::optim::SGD host_opt{sgd};
    put(twin, host_opt, values);
    io::save_checkpoint(hst / "ckpt", twin, host_opt, {.tag = "trained"});
    io::export_safetensors(hst / "model.safetensors", twin, host_opt);
  });
  on_ranks(3, [&](device_thread_comm& dc, sl::comm::ThreadComm& host, cudaStream_t) {
    auto model = make_model<float, sl::cuda_space>();
    auto sharded = shard::fully_shard<sl::optim::cuda::SGD>(model, dc, shard::ShardGradOp{}, options_for<float>(99));
    sl::optim::cuda::SGD opt{{.lr = 0.5, .momentum = 0.5}};  // the checkpoint's hyperparameters replace these
    io::load_checkpoint(dev / "ckpt" / "trained", sharded, opt);
    auto host_model = make_model<float, sl::host_space>();
    auto twin = shard::fully_shard<sl::optim::SGD>(host_model, host, shard::ShardGradOp{}, host_options<float>());
    sl::optim::SGD host_opt{{.lr = 0.5, .momentum = 0.5}};
    io::load_checkpoint(hst / "ckpt" / "trained", twin, host_opt);
    auto& mine = problems[std::size_t(host.rank())];
    if (hold(sharded, opt) != hold(twin, host_opt)) mine += "the device holds other values than the host; ";
    if (opt.options.lr != sgd.lr || opt.options.momentum != sgd.momentum) mine += "hyperparameters not loaded; ";
  });
  for (const auto& p : problems) CHECK(p.empty());
  require_same_files(dev, hst, 3 + 1);
}

}  // namespace test_cuda_checkpoint
