// bench_cuda — the GPU numbers, each against the limit it should approach,
// measured in the same run:
//   fused Adam bytes/s          vs device-to-device copy bandwidth (goal >= 0.9x)
//   NCCL all_gather, reduce_scatter, all_reduce bus bandwidth (nccl-tests
//                               definitions), world size 1 .. #GPUs, one thread per GPU
//   cublasGemmEx bf16 TFLOP/s   at 8192^3: the compute peak reference (and fp32)
//   reference model step        FullShard, bf16 compute, fp32 master + AdamW, on one GPU:
//                               model FLOP utilisation vs that bf16 GEMM rate (goal >= 45%)
// Usage: bench_cuda [--json FILE] [--model-layers N] (default 24; 0 skips the model).
// Prints the tables, then a short summary last.
#include <shardlib/comm/launch.hpp>
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/comm/thread_comm.hpp>
#include <shardlib/cuda.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/nn/cuda.cuh>
#include <shardlib/optim/cuda/adam.cuh>
#include <shardlib/shard/cuda/space_ops.cuh>
#include <shardlib/shard/sharded_model.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "common/device_data.cuh"
#include "common/flags.hpp"
#include "common/reference_model.hpp"
#include "common/synthetic.hpp"

namespace sl = shardlib;
namespace oc = shardlib::ops::cuda;

namespace {

// Median milliseconds of fn() (work issued on s) over `iters` runs after
// `warmup`, timed by events on s.
template <class F>
double median_ms(cudaStream_t s, int warmup, int iters, F fn) {
  cudaEvent_t a, b;
  sl::cuda::check(cudaEventCreate(&a), "cudaEventCreate");
  sl::cuda::check(cudaEventCreate(&b), "cudaEventCreate");
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    sl::cuda::check(cudaEventRecord(a, s), "cudaEventRecord");
    fn();
    sl::cuda::check(cudaEventRecord(b, s), "cudaEventRecord");
    sl::cuda::check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    sl::cuda::check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::nth_element(t.begin(), t.begin() + iters / 2, t.end());
  return t[iters / 2];
}

struct summary_line {
  std::string what, value, versus;
};

void json(std::FILE* f, const std::string& body) {
  if (!f) return;
  std::fprintf(f, "{%s}\n", body.c_str());
  std::fflush(f);
}

// --- fused Adam against the copy bandwidth ---------------------------------------------------
template <class G>
double adam_gbps(std::size_t n, sl::cuda::stream& s, const char* label, double copy_gbps, std::FILE* jf,
                 std::vector<summary_line>& summary) {
  auto& alloc = sl::cuda::device_allocator(0);
  sl::cuda::device_buffer<float> p(n, sl::category::parameters, s, alloc);
  sl::cuda::device_buffer<G> g(n, sl::category::gradients, s, alloc);
  sl::cuda::device_buffer<sl::bfloat16> copy(n, sl::category::gathered_parameters, s, alloc);
  sl::cuda::fill_bytes_async(p.span(), 0, s);
  sl::cuda::fill_bytes_async(g.span(), 0, s);
  const sl::optim::AdamW opt{{.lr = 1e-3, .weight_decay = 0.01}};
  auto state = oc::make_adam_state(opt, n, s, alloc);
  const double ms = median_ms(s, 3, 20, [&] {
    oc::fused_adam_step(opt, state, p.span(), std::span<const G>(g.span()), copy.span(), s);
  });
  // Read p, g, m, v; write p, m, v and the bf16 copy.
  const double bytes = double(n) * (4 * 3 + sizeof(G) + 4 * 3 + 2);
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  std::printf("%-36s %10zu %10.3f %10.1f %9.2fx copy\n", label, n, ms, gbps, gbps / copy_gbps);
  json(jf, sl::cat("\"bench\":\"cuda_adam\",\"grads\":\"", label, "\",\"params\":", n, ",\"ms\":", ms,
                   ",\"GBps\":", gbps, ",\"vs_copy\":", gbps / copy_gbps));
  char v[64], vs[64];
  std::snprintf(v, sizeof v, "%.0f GB/s", gbps);
  std::snprintf(vs, sizeof vs, "%.2fx copy (goal >= 0.90x): %s", gbps / copy_gbps,
                gbps >= 0.9 * copy_gbps ? "met" : "MISSED");
  summary.push_back({label, v, vs});
  return gbps;
}

// --- NCCL bus bandwidth ------------------------------------------------------------------------
std::vector<bench::row> nccl_rows(int world, std::size_t bytes) {
  std::vector<bench::row> rows(3);
  sl::comm::launch(world, [&](sl::comm::ThreadComm& host) {
    const int dev = host.rank();
    sl::cuda::stream s(dev);
    sl::comm::NcclComm c = sl::comm::NcclComm::bootstrap(host, dev).on(s);
    const std::size_t total = bytes / sizeof(float), shard = total / std::size_t(world);
    sl::cuda::device_buffer<float> full(total, sl::category::gathered_parameters, s, sl::cuda::device_allocator(dev));
    sl::cuda::device_buffer<float> part(shard, sl::category::gradients, s, sl::cuda::device_allocator(dev));
    sl::cuda::fill_bytes_async(full.span(), 0, s);
    sl::cuda::fill_bytes_async(part.span(), 0, s);
    const bench::collective ops[] = {bench::collective::all_gather, bench::collective::reduce_scatter,
                                     bench::collective::all_reduce};
    for (int k = 0; k < 3; ++k) {
      const double ms = median_ms(s, 5, 20, [&] {
        switch (ops[k]) {
          case bench::collective::all_gather:
            c.all_gather(std::span<const float>(part.span()), full.span().first(shard * world));
            break;
          case bench::collective::reduce_scatter:
            c.reduce_scatter(std::span<const float>(full.span().first(shard * world)), part.span(),
                             sl::comm::reduce_op::sum);
            break;
          case bench::collective::all_reduce:
            c.all_reduce(full.span(), sl::comm::reduce_op::sum);
            break;
        }
      });
      host.barrier();
      if (host.rank() == 0) rows[k] = {"nccl", ops[k], false, world, bytes, ms * 1e-3};
    }
  });
  return rows;
}

// --- GEMM peak reference ----------------------------------------------------------------------
template <class T>
double gemm_tflops(std::int64_t n, sl::cuda::stream& s, sl::cuda::blas& handle) {
  auto& alloc = sl::cuda::device_allocator(0);
  const std::size_t count = std::size_t(n * n);
  sl::cuda::device_buffer<T> a(count, sl::category::activations, s, alloc), b(count, sl::category::activations, s, alloc),
      c(count, sl::category::activations, s, alloc);
  sl::cuda::fill_bytes_async(a.span(), 0, s);  // zeros: the timing does not depend on the values
  sl::cuda::fill_bytes_async(b.span(), 0, s);
  const double ms = median_ms(s, 2, 10, [&] {
    oc::gemm(handle, s, sl::ops::trans::no, sl::ops::trans::no, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
             c.data(), n);
  });
  return 2.0 * double(n) * double(n) * double(n) / (ms * 1e-3) / 1e12;
}

// --- the reference model's training step ---------------------------------------------------
struct model_size {
  long layers, d, heads, ff, seq, batch;
};
struct model_result {
  double step_ms, parameters, tflop_per_step;
};
// FullShard over NCCL at world size 1 (every gather and reduce-scatter still
// runs), layers in bf16, fp32 master weights and AdamW: train_fsdp_cuda's step.
// One batch, uploaded once, so the host's data generation is not timed; each
// timed step ends when the compute stream has finished its backward and Adam.
// FLOPs per step as llm.c and PaLM count them: 6 per matrix-product parameter
// per token (forward and backward), plus 12 * layers * seq * d per token for
// attention's two products.
model_result model_step(const model_size& m, int warmup, int steps) {
  model_result r{};
  sl::comm::launch(1, [&](sl::comm::ThreadComm& host) {
    sl::cuda::check(cudaSetDevice(0), "cudaSetDevice(0)");
    sl::cuda::stream compute(0);
    sl::cuda::stream_scope scope(compute.get());
    auto c = sl::comm::NcclComm::bootstrap(host, 0).on(compute.get());
    const example::model_flags sizes{.layers = m.layers, .d_model = m.d, .heads = m.heads, .ff = m.ff, .seq = m.seq};
    const example::synthetic_task task = example::task_for(sizes);
    auto model = example::reference_model<sl::bfloat16, sl::cuda_space>(sizes);
    auto sharded = sl::shard::fully_shard<sl::optim::cuda::AdamW>(
        model, c, sl::shard::FullShard{},
        {.wrap = sl::shard::wrap_types<example::EncoderOf<sl::bfloat16, sl::cuda_space>>{},
         .precision = {.param = sl::dtype::bf16, .reduce = sl::dtype::f32}});
    sl::optim::cuda::AdamW opt{{.lr = 1e-4}};
    const auto x = example::to_device<sl::bfloat16>(task.inputs(0, m.batch));
    const auto y = sl::cuda::to_device(task.labels(0, m.batch));
    for (int i = 0; i < warmup; ++i) sharded.train_step(opt, x, y, sl::nn::cross_entropy);
    sl::cuda::check(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize (after the warm-up)");
    std::vector<double> ms;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      sharded.train_step(opt, x, y, sl::nn::cross_entropy);
      sl::cuda::check(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize (end of step)");
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(ms.begin(), ms.begin() + steps / 2, ms.end());
    r.step_ms = ms[steps / 2];
    r.parameters = double(sl::nn::parameter_count(model));
    const double matmul = double(m.layers) * double(4 * m.d * m.d + 2 * m.d * m.ff) + double(m.d) * 10;
    const double tokens = double(m.batch * m.seq);
    r.tflop_per_step = tokens * (6 * matmul + 12.0 * double(m.layers * m.seq * m.d)) / 1e12;
  });
  return r;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string json_path;
  long model_layers = 24;
  example::command_line cli("The GPU numbers (copy, fused Adam, NCCL, GEMM, the reference model's MFU), each "
                            "against the limit it should approach.",
                            "bench_cuda");
  cli.add_option("--json", json_path, "writes one JSON line per measurement");
  cli.add_option("--model-layers", model_layers, "encoder layers of the reference model (0 skips it)")
      ->check(example::whole(0, example::max_size));
  cli.parse_or_exit(argc, argv);
  std::FILE* jf = nullptr;
  if (!json_path.empty()) {
    jf = std::fopen(json_path.c_str(), "w");
    sl::require(jf != nullptr, "bench_cuda: cannot open ", json_path);
  }
  const std::string problem = sl::cuda::device_problem();
  sl::require(problem.empty(), "bench_cuda needs a GPU: ", problem);
  const int gpus = sl::cuda::device_count();
  cudaDeviceProp prop{};
  sl::cuda::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device 0: %s, %zu GiB, %d SMs; %d GPU(s)\n\n", prop.name, prop.totalGlobalMem >> 30,
              prop.multiProcessorCount, gpus);
  std::vector<summary_line> summary;
  sl::cuda::stream s(0);

  // 1. Device-to-device copy: the bandwidth every memory-bound kernel is held to.
  const std::size_t copy_bytes = std::size_t(1) << 30;
  double copy_gbps = 0;
  {
    sl::Buffer<std::byte, sl::cuda_space> src(copy_bytes, sl::category::activations),
        dst(copy_bytes, sl::category::activations);
    sl::cuda::check(cudaMemsetAsync(src.data(), 1, copy_bytes, s), "cudaMemsetAsync");
    const double ms = median_ms(s, 3, 20, [&] {
      sl::cuda::check(cudaMemcpyAsync(dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice, s),
                      "cudaMemcpyAsync");
    });
    copy_gbps = 2.0 * double(copy_bytes) / (ms * 1e-3) / 1e9;  // read + write
    std::printf("%-36s %10s %10s %10s\n", "memory-bound kernels", "elements", "ms", "GB/s");
    std::printf("%-36s %10zu %10.3f %10.1f   (bytes read + written)\n", "cudaMemcpy device-to-device", copy_bytes, ms,
                copy_gbps);
    json(jf, sl::cat("\"bench\":\"cuda_copy\",\"bytes\":", copy_bytes, ",\"ms\":", ms, ",\"GBps\":", copy_gbps));
    char v[64];
    std::snprintf(v, sizeof v, "%.0f GB/s", copy_gbps);
    summary.push_back({"device-to-device copy", v, "the reference"});
  }

  // 2. Fused AdamW over 256 M parameters (4.5-5 GiB of state and gradients).
  const std::size_t n = std::size_t(1) << 28;
  adam_gbps<sl::bfloat16>(n, s, "fused AdamW, bf16 grads, bf16 copy", copy_gbps, jf, summary);
  adam_gbps<float>(n, s, "fused AdamW, fp32 grads, bf16 copy", copy_gbps, jf, summary);
  sl::cuda::device_allocator(0).empty_cache();

  // 3. NCCL at every world size this machine has.
  std::printf("\n");
  bench::print_header();
  const std::size_t nccl_bytes = std::size_t(256) << 20;
  for (int w = 1; w <= gpus; ++w)
    for (const auto& r : nccl_rows(w, nccl_bytes)) {
      bench::print_row(r, w == 1 ? "W=1: busbw is 0 by definition, algbw is a local copy" : "");
      bench::json_row(jf, r, "");
      if (w == gpus) {
        char v[64], vs[96];
        std::snprintf(v, sizeof v, "%.0f GB/s busbw", r.busbw());
        std::snprintf(vs, sizeof vs, "W=%d, %s, algbw %.0f GB/s", w, bench::human(r.bytes).c_str(), r.algbw());
        summary.push_back({std::string("NCCL ") + bench::name(r.op), v, vs});
      }
    }

  // 4. GEMM: the compute peak reference.
  std::printf("\n");
  sl::cuda::blas handle(0);
  const std::int64_t g = 8192;
  const double bf16 = gemm_tflops<sl::bfloat16>(g, s, handle), fp32 = gemm_tflops<float>(g, s, handle);
  std::printf("cublasGemmEx %lld^3: bf16 inputs %.1f TFLOP/s, fp32 (no TF32) %.1f TFLOP/s\n", (long long)g, bf16, fp32);
  json(jf, sl::cat("\"bench\":\"cuda_gemm\",\"n\":", g, ",\"bf16_TFLOPs\":", bf16, ",\"fp32_TFLOPs\":", fp32));
  char v[64], vs[64];
  std::snprintf(v, sizeof v, "%.0f TFLOP/s", bf16);
  std::snprintf(vs, sizeof vs, "fp32 without TF32: %.1f TFLOP/s", fp32);
  summary.push_back({"GEMM bf16 8192^3 (cuBLAS)", v, vs});
  sl::cuda::device_allocator(0).empty_cache();

  // 5. The reference model at a size that fills the GPU, against that GEMM rate.
  if (model_layers > 0) {
    const model_size m{.layers = model_layers, .d = 2048, .heads = 16, .ff = 8192, .seq = 2048, .batch = 4};
    const model_result r = model_step(m, 2, 8);
    const double achieved = r.tflop_per_step / (r.step_ms * 1e-3), mfu = achieved / bf16;
    std::printf("\nreference model: %ld layers, d_model %ld, %ld heads, ff %ld, seq %ld, batch %ld (%.2f B parameters)\n"
                "  FullShard W=1, bf16 compute, fp32 master + AdamW: %.1f ms/step, %.1f TFLOP per step, %.1f TFLOP/s "
                "= %.1f%% of the bf16 GEMM rate above\n",
                m.layers, m.d, m.heads, m.ff, m.seq, m.batch, r.parameters / 1e9, r.step_ms, r.tflop_per_step, achieved,
                100 * mfu);
    json(jf, sl::cat("\"bench\":\"cuda_model\",\"layers\":", m.layers, ",\"d_model\":", m.d, ",\"seq\":", m.seq,
                     ",\"batch\":", m.batch, ",\"parameters\":", r.parameters, ",\"step_ms\":", r.step_ms,
                     ",\"TFLOPs\":", achieved, ",\"mfu\":", mfu));
    std::snprintf(v, sizeof v, "%.1f%% MFU", 100 * mfu);
    std::snprintf(vs, sizeof vs, "%.0f ms/step, %.0f TFLOP/s (goal >= 45%%)", r.step_ms, achieved);
    summary.push_back({"reference model step, bf16", v, vs});
  }

  std::printf("\n== summary ==\n");
  for (const auto& l : summary) std::printf("%-38s %-18s %s\n", l.what.c_str(), l.value.c_str(), l.versus.c_str());
  if (jf) std::fclose(jf);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_cuda: %s\n", e.what());
  return 1;
}
