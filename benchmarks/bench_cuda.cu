// bench_cuda — the GPU numbers, each against the limit it should approach,
// measured in the same run:
//   fused AdamW and SGD bytes/s vs device-to-device copy bandwidth (goal >= 0.9x)
//   NCCL all_gather, reduce_scatter, all_reduce bus bandwidth (nccl-tests
//                               definitions), world size 1 .. #GPUs, one thread per GPU
//   cublasGemmEx bf16 TFLOP/s   at 8192^3 on random values: the compute peak reference (and fp32)
//   LM head products            GPT-2's vocabulary (50257: rows off 16-byte boundaries) by cuBLAS
//                               as it is, by gemm_staged, and padded to 50304: vs that GEMM rate
//   fused attention             causal, bf16, L 2048, head_dim 64 and 128, forward + backward, on
//                               tensor cores and on CUDA cores: TFLOP/s vs that bf16 GEMM rate
//                               (at 128 on tensor cores also with the blocks in tile-fastest order,
//                               and with dropout 0.1 on the weights, GPT-2's attn_pdrop)
//   model steps                 FullShard, bf16 compute, fp32 master + AdamW, on one GPU:
//                               model FLOP utilisation vs that bf16 GEMM rate (goal >= 45%):
//                               GPT-2 and LLaMA (~1B parameters at sequence 2048 by default)
//                               and the reference encoder classifier; with --peak-tflops, also
//                               against the GPU's datasheet dense bf16 rate (MFU as PaLM and
//                               torchtitan state it; the measured GEMM rate is below that)
// Usage: bench_cuda [--json FILE] [--model encoder,gpt2,llama|none] [--layers N] [--d N]
//                   [--heads N] [--kv-heads N] [--seq N] [--batch N] [--peak-tflops T]
//                   [--profile-step] [--quick]
// Prints the tables, then a short summary last. --quick runs every part at a small size
// and a few repetitions: a check, in seconds, that the program works on a machine (CI
// runs it on the CPU's emulated GPU); its figures measure nothing. --profile-step runs,
// after each model's timed steps, one more step between cudaProfilerStart and
// cudaProfilerStop: what a profiler started with capture off (ncu --profile-from-start
// off, nsys --capture-range=cudaProfilerApi) records is that one step, and the timing is
// untouched (tools/gpu_check.sh sums it by kernel with tools/step-kernels).
#include <shardlib/comm/launch.hpp>
#include <shardlib/comm/nccl_comm.hpp>
#include <shardlib/comm/thread_comm.hpp>
#include <shardlib/cuda.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/models/cuda.cuh>
#include <shardlib/nn/cuda.cuh>
#include <shardlib/optim/cuda/adam.cuh>
#include <shardlib/optim/cuda/sgd.cuh>
#include <shardlib/shard/cuda/space_ops.cuh>
#include <shardlib/shard/sharded_model.hpp>
#include <shardlib/ops/cuda/flash_attention.cuh>
#include <shardlib/ops/cuda/launch.cuh>

#include <cuda_profiler_api.h>

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

// The sizes and repetitions of the fixed parts (all but the models, whose sizes are flags).
struct run_sizes {
  bool quick = false;
  std::size_t copy_bytes = std::size_t(1) << 30, adam_params = std::size_t(1) << 28,
              nccl_bytes = std::size_t(256) << 20;
  std::int64_t gemm_n = 8192, attention_batch = 4, attention_heads = 16, attention_seq = 2048;
  std::int64_t head_rows = 8192, head_d = 2048, head_vocab = 50257;  // GPT-2's head at the models' sizes
  int warmup(int full) const { return quick ? 1 : full; }
  int iters(int full) const { return quick ? 3 : full; }
};
constexpr run_sizes quick_sizes{.quick = true,
                                .copy_bytes = std::size_t(1) << 20,
                                .adam_params = std::size_t(1) << 14,
                                .nccl_bytes = std::size_t(64) << 10,
                                .gemm_n = 128,
                                .attention_batch = 1,
                                .attention_heads = 2,
                                .attention_seq = 128,
                                .head_rows = 128,
                                .head_d = 64,
                                .head_vocab = 257};

// One JSON line per measurement; a quick run's lines say so.
struct json_lines {
  std::FILE* f = nullptr;
  bool quick = false;
  void operator()(const std::string& body) const {
    if (!f) return;
    std::fprintf(f, "{%s%s}\n", quick ? "\"quick\":true," : "", body.c_str());
    std::fflush(f);
  }
};

// --- fused optimizer steps against the copy bandwidth ----------------------------------------
// step() over n parameters, which reads and writes `bytes_per_param` bytes of each, against
// the copy bandwidth measured in the same run.
template <class Step>
double fused_step_gbps(std::size_t n, double bytes_per_param, const char* kind, const run_sizes& z,
                       sl::cuda::stream& s, const char* label, double copy_gbps, const json_lines& json,
                       std::vector<summary_line>& summary, Step&& step) {
  const double ms = median_ms(s, z.warmup(3), z.iters(20), step);
  const double gbps = double(n) * bytes_per_param / (ms * 1e-3) / 1e9;
  std::printf("%-44s %10zu %10.3f %10.1f %9.2fx copy\n", label, n, ms, gbps, gbps / copy_gbps);
  json(sl::cat("\"bench\":\"", kind, "\",\"grads\":\"", label, "\",\"params\":", n, ",\"ms\":", ms,
               ",\"GBps\":", gbps, ",\"vs_copy\":", gbps / copy_gbps));
  char v[64], vs[64];
  std::snprintf(v, sizeof v, "%.0f GB/s", gbps);
  std::snprintf(vs, sizeof vs, "%.2fx copy (goal >= 0.90x): %s", gbps / copy_gbps,
                gbps >= 0.9 * copy_gbps ? "met" : "MISSED");
  summary.push_back({label, v, vs});
  return gbps;
}

// Fused AdamW and SGD with momentum (optim::cuda::AdamW, optim::cuda::SGD) over n parameters
// with gradients in G, each writing the bf16 copy.
template <class G>
void optimizer_gbps(std::size_t n, const run_sizes& z, sl::cuda::stream& s, const char* grads, double copy_gbps,
                    const json_lines& json, std::vector<summary_line>& summary) {
  sl::cuda::stream_scope scope(s.get());
  auto& alloc = sl::cuda::device_allocator(0);
  sl::cuda::device_buffer<float> p(n, sl::category::parameters, s, alloc);
  sl::cuda::device_buffer<G> g(n, sl::category::gradients, s, alloc);
  sl::cuda::device_buffer<sl::bfloat16> copy(n, sl::category::gathered_parameters, s, alloc);
  sl::cuda::fill_bytes_async(p.span(), 0, s);
  sl::cuda::fill_bytes_async(g.span(), 0, s);
  const std::span<const G> gs(g.span());
  {
    const sl::optim::cuda::AdamW adamw{{.lr = 1e-3, .weight_decay = 0.01}};
    auto state = adamw.make_state(n);
    // Read p, g, m, v; write p, m, v and the bf16 copy.
    fused_step_gbps(n, 4 * 3 + sizeof(G) + 4 * 3 + 2, "cuda_adam", z, s, sl::cat("fused AdamW, ", grads).c_str(),
                    copy_gbps, json, summary, [&] { adamw.step(p.span(), gs, state, copy.span()); });
  }
  const sl::optim::cuda::SGD sgd{{.lr = 1e-3, .momentum = 0.9, .weight_decay = 0.01}};
  auto state = sgd.make_state(n);
  // Read p, g, the momentum buffer; write p, the buffer and the bf16 copy.
  fused_step_gbps(n, 4 * 2 + sizeof(G) + 4 * 2 + 2, "cuda_sgd", z, s, sl::cat("fused SGD (momentum), ", grads).c_str(),
                  copy_gbps, json, summary, [&] { sgd.step(p.span(), gs, state, copy.span()); });
}

// --- NCCL bus bandwidth ------------------------------------------------------------------------
std::vector<bench::row> nccl_rows(int world, std::size_t bytes, const run_sizes& z) {
  std::vector<bench::row> rows(3);
  sl::comm::launch(world, [&](sl::comm::ThreadComm& host) {
    const int dev = host.rank();
    sl::cuda::check(cudaSetDevice(dev), "cudaSetDevice(", dev, ")");  // a thread starts on device 0
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
      const double ms = median_ms(s, z.warmup(5), z.iters(20), [&] {
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
// p[i] uniform in [-1, 1) from a counter-based stream: a tensor core's power, and so
// its clock, depends on the bits it multiplies (zeros run ~12% faster on an H200),
// so the peak is timed on values like a model's.
template <class T>
struct uniform_fill {
  T* p;
  sl::counter_rng rng;
  __device__ void operator()(std::int64_t i) const { p[i] = T(2.0f * rng.uniform_float(std::uint64_t(i)) - 1.0f); }
};

template <class T>
double gemm_tflops(std::int64_t n, const run_sizes& z, sl::cuda::stream& s, sl::cuda::blas& handle) {
  auto& alloc = sl::cuda::device_allocator(0);
  const std::size_t count = std::size_t(n * n);
  sl::cuda::device_buffer<T> a(count, sl::category::activations, s, alloc), b(count, sl::category::activations, s, alloc),
      c(count, sl::category::activations, s, alloc);
  oc::for_each_index(std::int64_t(count), uniform_fill<T>{a.data(), sl::counter_rng(1, 0)}, s, "uniform_fill");
  oc::for_each_index(std::int64_t(count), uniform_fill<T>{b.data(), sl::counter_rng(1, 1)}, s, "uniform_fill");
  const double ms = median_ms(s, z.warmup(2), z.iters(10), [&] {
    oc::gemm(handle, s, sl::ops::trans::no, sl::ops::trans::no, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
             c.data(), n);
  });
  return 2.0 * double(n) * double(n) * double(n) / (ms * 1e-3) / 1e12;
}

// --- the LM head's products, logits rows off 16-byte boundaries ---------------------------------
// GPT-2's tied head: logits [R, V] = h [R, d] W^T (W [V, d]), dW += dlogits^T h, dh = dlogits W
// (the logits stand in for their gradient), bf16. With V = 50257 the logits' rows are 100,514
// bytes apart: cuBLAS on them as they are, then gemm_staged (the library's path: aligned copies
// first, their time included), then V padded to a multiple of 64 as nanoGPT and llm.c pad
// GPT-2's vocabulary (every row aligned; the products 0.1% larger). Milliseconds for the three.
struct head_times {
  double direct, staged, padded;
};
head_times lm_head_ms(const run_sizes& z, sl::cuda::stream& s, sl::cuda::blas& handle) {
  using T = sl::bfloat16;
  const std::int64_t R = z.head_rows, D = z.head_d, V = z.head_vocab, Vp = (V + 63) / 64 * 64;
  auto& alloc = sl::cuda::device_allocator(0);
  const auto filled = [&](std::int64_t count, std::uint64_t stream_id) {
    sl::cuda::device_buffer<T> b(std::size_t(count), sl::category::activations, s, alloc);
    oc::for_each_index(count, uniform_fill<T>{b.data(), sl::counter_rng(3, stream_id)}, s, "uniform_fill");
    return b;
  };
  auto h = filled(R * D, 0), w = filled(Vp * D, 1), logits = filled(R * Vp, 2), dw = filled(Vp * D, 3),
       dh = filled(R * D, 4);
  const auto head = [&](auto&& gemm, std::int64_t v) {  // v: the vocabulary, the logits' leading dimension
    using sl::ops::trans;
    gemm(trans::no, trans::yes, R, v, D, 1.0f, h.data(), D, w.data(), D, 0.0f, logits.data(), v);
    gemm(trans::yes, trans::no, v, D, R, 1.0f, logits.data(), v, h.data(), D, 1.0f, dw.data(), D);
    gemm(trans::no, trans::no, R, D, v, 1.0f, logits.data(), v, w.data(), D, 0.0f, dh.data(), D);
  };
  const auto cublas = [&](auto... args) { oc::gemm(handle, s, args...); };
  const auto staged = [&](auto... args) { oc::gemm_staged(handle, s, alloc, args...); };
  head_times t{};
  t.direct = median_ms(s, z.warmup(2), z.iters(10), [&] { head(cublas, V); });
  t.staged = median_ms(s, z.warmup(2), z.iters(10), [&] { head(staged, V); });
  t.padded = median_ms(s, z.warmup(2), z.iters(10), [&] { head(cublas, Vp); });
  return t;
}

// --- fused attention against the GEMM rate ----------------------------------------------------
// Causal attention, batch 4, 16 heads, sequence 2048 (unless quick), bf16, forward and backward,
// by each kernel set. FLOPs as FlashAttention's papers count them: 4 B H L^2 D forward (Q K^T and P V), 2.5
// times that backward (Q K^T again, dO V^T, P^T dO, dS^T Q, dS K), halved for the causal mask.
struct attention_result {
  double forward_ms, backward_ms, tflops;
};
attention_result attention_step(std::int64_t dim, bool tensor_cores, bool longest_first, float dropout,
                                const run_sizes& z, sl::cuda::stream& s) {
  using T = sl::bfloat16;
  const std::int64_t B = z.attention_batch, H = z.attention_heads, L = z.attention_seq;
  auto& alloc = sl::cuda::device_allocator(0);
  const std::size_t count = std::size_t(B * H * L * dim);
  std::vector<sl::cuda::device_buffer<T>> t;  // q k v out dout dq dk dv
  for (int i = 0; i < 8; ++i) {
    t.emplace_back(count, sl::category::activations, s, alloc);
    oc::for_each_index(std::int64_t(count), uniform_fill<T>{t.back().data(), sl::counter_rng(2, std::uint64_t(i))}, s,
                       "uniform_fill");
  }
  sl::cuda::device_buffer<float> lse(std::size_t(B * H * L), sl::category::activations, s, alloc);
  const auto view = [&](int i) {
    return sl::nn::head_view<T>{t[std::size_t(i)].data(), B, H, L, dim, H * L * dim, L * dim, dim};
  };
  oc::flash_options o{.is_causal = true};
  o.tensor_cores = tensor_cores;
  o.longest_first = longest_first;
  if (dropout > 0) {
    o.dropout_p = dropout;
    o.dropout = sl::counter_rng(3, 0);
  }
  const double fwd = median_ms(s, z.warmup(2), z.iters(10), [&] {
    oc::flash_attention_forward<T>(oc::as_const(view(0)), oc::as_const(view(1)), oc::as_const(view(2)), view(3),
                                   lse.data(), o, s);
  });
  const double bwd = median_ms(s, z.warmup(2), z.iters(10), [&] {
    oc::flash_attention_backward<T>(oc::as_const(view(0)), oc::as_const(view(1)), oc::as_const(view(2)),
                                    oc::as_const(view(3)), oc::as_const(view(4)), lse.data(), view(5), view(6), view(7),
                                    o, s);
  });
  const double forward_flop = 4.0 * double(B * H) * double(L) * double(L) * double(dim) / 2;
  return {fwd, bwd, 3.5 * forward_flop / ((fwd + bwd) * 1e-3) / 1e12};
}

// --- model training steps --------------------------------------------------------------------
// Sizes from the flags; 0 = the model's default. Defaults put GPT-2 and LLaMA near
// 1B parameters at sequence 2048: d 2048, 16 heads, GPT-2 20 layers (vocabulary
// 50257, MLP 4d: 1.11B), LLaMA 22 layers (vocabulary 32000, 4 kv heads, SwiGLU
// 5632: 1.12B); the reference encoder 24 layers, ff 4d.
struct model_size {
  std::string model;
  long layers, d, heads, kv_heads, ff, seq, batch;
};
struct model_result {
  double step_ms, parameters, matmul_parameters, flop_per_token, tflop_per_step;
};

// Elements of the weights every token multiplies: each rank-2 parameter but the
// token and position embeddings' lookups (a tied head's weight counts once, under
// its head's name).
template <class Model>
double matmul_parameters(Model& model) {
  double n = 0;
  model.parameters([&](std::string_view name, auto& p) {
    if (p.shape.rank() == 2 && !name.ends_with("wte.weight") && !name.ends_with("wpe.weight") &&
        !name.ends_with("embed_tokens.weight"))
      n += double(p.numel());
  });
  return n;
}

// FLOPs per token, as PaLM (appendix B) and Megatron count them: 6 N for the
// forward and backward products of the N weights every token multiplies, plus
// 12 * layers * seq * d for attention's q k^T and P V (2 * 2 * seq * d forward,
// twice that backward), counted in full though causal attention skips half.
constexpr const char* flop_formula = "6N + 12 * layers * seq * d (N: weights in matrix products, head included)";
double flop_per_token(double matmul, const model_size& m) {
  return 6 * matmul + 12.0 * double(m.layers) * double(m.seq) * double(m.d);
}

// Median wall time of `steps` training steps after `warmup`, each ending when the
// compute stream has finished its backward and AdamW: one batch, uploaded once,
// so the host's data generation is not timed.
template <class Sharded, class Opt, class X, class Y>
double median_step_ms(Sharded& sharded, Opt& opt, const X& x, const Y& y, cudaStream_t s, int warmup, int steps) {
  for (int i = 0; i < warmup; ++i) sharded.train_step(opt, x, y, sl::nn::cross_entropy);
  sl::cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize (after the warm-up)");
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    sharded.train_step(opt, x, y, sl::nn::cross_entropy);
    sl::cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize (end of step)");
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(ms.begin(), ms.begin() + steps / 2, ms.end());
  return ms[std::size_t(steps / 2)];
}

// FullShard over NCCL at world size 1 (every gather and reduce-scatter still
// runs), every block a unit, layers in bf16, fp32 master weights and AdamW: the
// examples' step, each Block a unit. make() builds the model, batch() gives (x, y)
// on the device.
template <class Block, class Make, class Batch>
model_result model_step(const model_size& m, int warmup, int steps, bool profile, Make&& make, Batch&& batch) {
  model_result r{};
  sl::comm::launch(1, [&](sl::comm::ThreadComm& host) {
    sl::cuda::check(cudaSetDevice(0), "cudaSetDevice(0)");
    sl::cuda::stream compute(0);
    sl::cuda::stream_scope scope(compute.get());
    auto c = sl::comm::NcclComm::bootstrap(host, 0).on(compute.get());
    auto model = make();
    auto sharded = sl::shard::fully_shard<sl::optim::cuda::AdamW>(
        model, c, sl::shard::FullShard{},
        {.wrap = sl::shard::wrap_types<Block>{},
         .precision = {.param = sl::dtype::bf16, .reduce = sl::dtype::f32}});
    sl::optim::cuda::AdamW opt{{.lr = 1e-4}};
    const auto [x, y] = batch();
    r.step_ms = median_step_ms(sharded, opt, x, y, compute.get(), warmup, steps);
    if (profile) {  // one step more, for a profiler that records between these two calls
      sl::cuda::check(cudaProfilerStart(), "cudaProfilerStart");
      sharded.train_step(opt, x, y, sl::nn::cross_entropy);
      sl::cuda::check(cudaStreamSynchronize(compute.get()), "cudaStreamSynchronize (the profiled step)");
      sl::cuda::check(cudaProfilerStop(), "cudaProfilerStop");
    }
    r.parameters = double(sl::nn::parameter_count(model));
    r.matmul_parameters = matmul_parameters(model);
  });
  r.flop_per_token = flop_per_token(r.matmul_parameters, m);
  r.tflop_per_step = double(m.batch * m.seq) * r.flop_per_token / 1e12;
  return r;
}

model_result run_model(const model_size& m, int warmup, int steps, bool profile) {
  if (m.model == "encoder") {
    const example::model_flags sizes{.layers = m.layers, .d_model = m.d, .heads = m.heads, .ff = m.ff, .seq = m.seq};
    const example::synthetic_task task = example::task_for(sizes);
    return model_step<example::EncoderOf<sl::bfloat16, sl::cuda_space>>(
        m, warmup, steps, profile, [&] { return example::reference_model<sl::bfloat16, sl::cuda_space>(sizes); },
        [&] {
          return std::pair(example::to_device<sl::bfloat16>(task.inputs(0, m.batch)),
                           sl::cuda::to_device(task.labels(0, m.batch)));
        });
  }
  // Random token ids, the next token as each position's target.
  const auto tokens = [&](std::int64_t vocab) {
    const sl::counter_rng draws(3, sl::fnv1a("bench_cuda tokens"));
    sl::Tensor<std::int64_t> ids({m.batch, m.seq});
    for (std::int64_t i = 0; i < ids.numel(); ++i)
      ids[i] = std::int64_t(draws.uniform_double(std::uint64_t(i)) * double(vocab)) % vocab;
    return std::pair(sl::cuda::to_device(ids), sl::cuda::to_device(sl::models::causal_lm_targets(ids)));
  };
  if (m.model == "gpt2") {
    const sl::models::gpt2_config config{.vocab_size = 50257,
                                         .n_positions = m.seq,
                                         .n_embd = m.d,
                                         .n_layer = m.layers,
                                         .n_head = m.heads,
                                         .n_inner = m.ff,
                                         .resid_pdrop = 0,
                                         .embd_pdrop = 0,
                                         .attn_pdrop = 0};
    using model_t = sl::models::GPT2LMHeadModel<sl::bfloat16, sl::cuda_space>;
    return model_step<model_t::block_type>(
        m, warmup, steps, profile, [&] { return model_t(config); },
        [&] { return tokens(config.vocab_size); });
  }
  const sl::models::llama_config config{.vocab_size = 32000,
                                        .hidden_size = m.d,
                                        .intermediate_size = m.ff,
                                        .num_hidden_layers = m.layers,
                                        .num_attention_heads = m.heads,
                                        .num_key_value_heads = m.kv_heads,
                                        .max_position_embeddings = m.seq};
  using model_t = sl::models::LlamaForCausalLM<sl::bfloat16, sl::cuda_space>;
  return model_step<model_t::block_type>(
      m, warmup, steps, profile, [&] { return model_t(config); },
      [&] { return tokens(config.vocab_size); });
}

// The flags' sizes with each model's defaults filled in.
model_size sized(const std::string& model, model_size flags) {
  flags.model = model;
  if (flags.layers == 0) flags.layers = model == "encoder" ? 24 : model == "gpt2" ? 20 : 22;
  if (flags.ff == 0)  // LLaMA: 8d/3 rounded up to a multiple of 256, as its configs
    flags.ff = model == "llama" ? (8 * flags.d / 3 + 255) / 256 * 256 : 4 * flags.d;
  if (model != "llama") flags.kv_heads = flags.heads;
  return flags;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string json_path;
  std::vector<std::string> models{"encoder", "gpt2", "llama"};
  model_size flags{.model = "", .layers = 0, .d = 2048, .heads = 16, .kv_heads = 4, .ff = 0, .seq = 2048, .batch = 4};
  bool quick = false, profile = false;
  double datasheet = 0;  // TFLOP/s; 0: not given
  example::command_line cli("The GPU numbers (copy, fused Adam, NCCL, GEMM, the models' MFU), each against the limit "
                            "it should approach.",
                            "bench_cuda");
  cli.add_option("--json", json_path, "writes one JSON line per measurement");
  cli.add_option("--model", models, "models to time, comma-separated (encoder, gpt2, llama; none skips them)")
      ->delimiter(',')
      ->check(CLI::IsMember({"encoder", "gpt2", "llama", "none"}));
  const CLI::Validator size = example::whole(1, example::max_size);
  CLI::Option* model_options[] = {
      cli.add_option("--layers", flags.layers, "blocks (0: encoder 24, gpt2 20, llama 22)")
          ->check(example::whole(0, example::max_size)),
      cli.add_option("--d", flags.d, "model width")->check(size),
      cli.add_option("--heads", flags.heads, "attention heads (divides --d)")->check(size),
      cli.add_option("--kv-heads", flags.kv_heads, "LLaMA's key/value heads (divides --heads)")->check(size),
      cli.add_option("--seq", flags.seq, "sequence length")->check(size),
      cli.add_option("--batch", flags.batch, "sequences per step")->check(size)};
  cli.add_option("--ff", flags.ff, "MLP width (0: 4d; LLaMA 8d/3 rounded up to 256)")
      ->check(example::whole(0, example::max_size));
  cli.add_option("--peak-tflops", datasheet,
                 "the GPU's datasheet dense bf16 tensor-core rate in TFLOP/s (H100 SXM and H200: 989): MFU is "
                 "then also given against it")
      ->check(example::positive());
  cli.add_flag("--profile-step", profile,
               "after each model's timed steps, one more between cudaProfilerStart and cudaProfilerStop (for ncu "
               "--profile-from-start off or nsys --capture-range=cudaProfilerApi)");
  cli.add_flag("--quick", quick,
               "every part small and repeated a few times (model flags not given: 1 layer, d 64, 4 heads, 2 kv "
               "heads, seq 32, batch 2): checks that the program runs; the figures measure nothing");
  cli.callback([&] {
    if (quick) {  // the model sizes not given
      long* value[] = {&flags.layers, &flags.d, &flags.heads, &flags.kv_heads, &flags.seq, &flags.batch};
      const long small[] = {1, 64, 4, 2, 32, 2};
      for (std::size_t i = 0; i < std::size(small); ++i)
        if (model_options[i]->count() == 0) *value[i] = small[i];
    }
    if (flags.d % flags.heads != 0 || flags.heads % flags.kv_heads != 0)
      throw CLI::ValidationError("--heads", sl::cat("--heads ", flags.heads, " must divide --d ", flags.d,
                                                    " and --kv-heads ", flags.kv_heads, " must divide --heads"));
    // Known before any timing starts: the fused attention's head sizes, RoPE's pairs.
    const long head = flags.d / flags.heads;
    if (head > oc::detail::fused::max_dim || head % 2 != 0)
      throw CLI::ValidationError("--heads", sl::cat("--d ", flags.d, " / --heads ", flags.heads, " = ", head,
                                                    ": a head's size must be even and at most ",
                                                    oc::detail::fused::max_dim));
  });
  cli.parse_or_exit(argc, argv);
  const run_sizes z = quick ? quick_sizes : run_sizes{};
  const json_lines json{json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w"), quick};
  sl::require(json_path.empty() || json.f != nullptr, "bench_cuda: cannot open ", json_path);
  const std::string problem = sl::cuda::device_problem();
  sl::require(problem.empty(), "bench_cuda needs a GPU: ", problem);
  const int gpus = sl::cuda::device_count();
  cudaDeviceProp prop{};
  sl::cuda::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device 0: %s, %zu GiB, %d SMs; %d GPU(s)\n\n", prop.name, prop.totalGlobalMem >> 30,
              prop.multiProcessorCount, gpus);
  if (quick) std::printf("--quick: small sizes, few repetitions; the figures below measure nothing\n\n");
  std::vector<summary_line> summary;
  sl::cuda::stream s(0);

  // 1. Device-to-device copy: the bandwidth every memory-bound kernel is held to.
  const std::size_t copy_bytes = z.copy_bytes;
  double copy_gbps = 0;
  {
    sl::Buffer<std::byte, sl::cuda_space> src(copy_bytes, sl::category::activations),
        dst(copy_bytes, sl::category::activations);
    sl::cuda::check(cudaMemsetAsync(src.data(), 1, copy_bytes, s), "cudaMemsetAsync");
    const double ms = median_ms(s, z.warmup(3), z.iters(20), [&] {
      sl::cuda::check(cudaMemcpyAsync(dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice, s),
                      "cudaMemcpyAsync");
    });
    copy_gbps = 2.0 * double(copy_bytes) / (ms * 1e-3) / 1e9;  // read + write
    std::printf("%-44s %10s %10s %10s\n", "memory-bound kernels", "elements", "ms", "GB/s");
    std::printf("%-44s %10zu %10.3f %10.1f   (bytes read + written)\n", "cudaMemcpy device-to-device", copy_bytes, ms,
                copy_gbps);
    json(sl::cat("\"bench\":\"cuda_copy\",\"bytes\":", copy_bytes, ",\"ms\":", ms, ",\"GBps\":", copy_gbps));
    char v[64];
    std::snprintf(v, sizeof v, "%.0f GB/s", copy_gbps);
    summary.push_back({"device-to-device copy", v, "the reference"});
  }

  // 2. Fused AdamW and SGD over 256 M parameters (up to 5 GiB of state and gradients).
  optimizer_gbps<sl::bfloat16>(z.adam_params, z, s, "bf16 grads, bf16 copy", copy_gbps, json, summary);
  optimizer_gbps<float>(z.adam_params, z, s, "fp32 grads, bf16 copy", copy_gbps, json, summary);
  sl::cuda::device_allocator(0).empty_cache();

  // 3. NCCL at every world size this machine has.
  std::printf("\n");
  bench::print_header();
  for (int w = 1; w <= gpus; ++w)
    for (const auto& r : nccl_rows(w, z.nccl_bytes, z)) {
      bench::print_row(r, w == 1 ? "W=1: busbw is 0 by definition, algbw is a local copy" : "");
      bench::json_row(json.f, r, quick ? ",\"quick\":true" : "");
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
  const std::int64_t g = z.gemm_n;
  const double bf16 = gemm_tflops<sl::bfloat16>(g, z, s, handle), fp32 = gemm_tflops<float>(g, z, s, handle);
  std::printf("cublasGemmEx %lld^3: bf16 inputs %.1f TFLOP/s, fp32 (no TF32) %.1f TFLOP/s\n", (long long)g, bf16, fp32);
  json(sl::cat("\"bench\":\"cuda_gemm\",\"n\":", g, ",\"bf16_TFLOPs\":", bf16, ",\"fp32_TFLOPs\":", fp32));
  char v[64], vs[128];
  std::snprintf(v, sizeof v, "%.0f TFLOP/s", bf16);
  std::snprintf(vs, sizeof vs, "fp32 without TF32: %.1f TFLOP/s", fp32);
  summary.push_back({sl::cat("GEMM bf16 ", g, "^3 (cuBLAS)"), v, vs});
  sl::cuda::device_allocator(0).empty_cache();

  // 4b. The LM head's products where the logits' rows are off 16-byte boundaries.
  {
    const head_times t = lm_head_ms(z, s, handle);
    const std::int64_t V = z.head_vocab, Vp = (V + 63) / 64 * 64;
    const double flop = 3 * 2.0 * double(z.head_rows) * double(z.head_d);  // per vocabulary entry
    const auto rate = [&](double ms, std::int64_t v) { return flop * double(v) / (ms * 1e-3) / 1e12; };
    const std::string label = sl::cat("LM head products (fwd, dW, dx), bf16, rows ", z.head_rows, ", d ", z.head_d);
    std::printf("\n%-58s %10s %10s %10s\n", label.c_str(), "ms", "TFLOP/s", "of GEMM");
    const auto row = [&](const std::string& what, double ms, std::int64_t v) {
      std::printf("%-58s %10.3f %10.1f %9.1f%%\n", what.c_str(), ms, rate(ms, v), 100 * rate(ms, v) / bf16);
    };
    row(sl::cat("V ", V, ", cuBLAS on unaligned rows"), t.direct, V);
    row(sl::cat("V ", V, ", gemm_staged (aligned copies, included)"), t.staged, V);
    row(sl::cat("V padded to ", Vp, " (every row aligned)"), t.padded, Vp);
    json(sl::cat("\"bench\":\"cuda_lm_head\",\"rows\":", z.head_rows, ",\"d\":", z.head_d, ",\"vocab\":", V,
                 ",\"padded_vocab\":", Vp, ",\"direct_ms\":", t.direct, ",\"staged_ms\":", t.staged,
                 ",\"padded_ms\":", t.padded, ",\"gemm_bf16_TFLOPs\":", bf16));
    std::snprintf(v, sizeof v, "%.0f TFLOP/s", rate(t.staged, V));
    std::snprintf(vs, sizeof vs, "staged; unaligned %.0f, V padded to %lld %.0f", rate(t.direct, V), (long long)Vp,
                  rate(t.padded, Vp));
    summary.push_back({sl::cat("LM head products, V ", V), v, vs});
    sl::cuda::device_allocator(0).empty_cache();
  }

  // 5. The fused attention by each kernel set, against that GEMM rate.
  const std::string attention_label = sl::cat("fused attention, bf16, causal, B ", z.attention_batch, ", H ",
                                             z.attention_heads, ", L ", z.attention_seq);
  std::printf("\n%-48s %10s %10s %10s %10s\n", attention_label.c_str(), "fwd ms", "bwd ms", "TFLOP/s", "of GEMM");
  // Blocks longest first (the library's order), and at head_dim 128 on tensor cores also in the
  // tile-fastest grid (flash_options::longest_first = false), to compare the two orders, and
  // with dropout 0.1 (its masks are drawn in forward, dq and dk/dv alike).
  struct attention_run {
    std::int64_t dim;
    bool tensor_cores, longest_first;
    float dropout = 0;
  };
  for (const attention_run a : {attention_run{64, true, true}, attention_run{64, false, true},
                                attention_run{128, true, true}, attention_run{128, true, false},
                                attention_run{128, true, true, 0.1f}, attention_run{128, false, true}}) {
    const std::int64_t dim = a.dim;
    const bool tc = a.tensor_cores && oc::flash_uses_tensor_cores<sl::bfloat16>(dim, {});
    if (a.tensor_cores && !tc) continue;  // this GPU takes the CUDA-core kernels only
    const attention_result r = attention_step(dim, a.tensor_cores, a.longest_first, a.dropout, z, s);
    const std::string label = sl::cat("head_dim ", dim, tc ? ", tensor cores" : ", CUDA cores",
                                      a.longest_first ? "" : ", tile-fastest order",
                                      a.dropout > 0 ? sl::cat(", dropout ", a.dropout) : "");
    std::printf("%-48s %10.2f %10.2f %10.1f %9.1f%%\n", label.c_str(), r.forward_ms, r.backward_ms, r.tflops,
                100 * r.tflops / bf16);
    json(sl::cat("\"bench\":\"cuda_attention\",\"head_dim\":", dim, ",\"tensor_cores\":", tc ? "true" : "false",
                 ",\"longest_first\":", a.longest_first ? "true" : "false", ",\"dropout\":", a.dropout,
                 ",\"forward_ms\":", r.forward_ms,
                 ",\"backward_ms\":", r.backward_ms, ",\"TFLOPs\":", r.tflops, ",\"gemm_bf16_TFLOPs\":", bf16));
    if (dim == 128 && !a.longest_first) {
      std::snprintf(v, sizeof v, "%.0f TFLOP/s", r.tflops);
      summary.push_back({"attention, D 128, tile-fastest order", v, "the longest-first order's is above"});
    } else if (dim == 128 && a.dropout > 0) {
      std::snprintf(v, sizeof v, "%.0f TFLOP/s", r.tflops);
      summary.push_back({"attention, D 128, dropout 0.1", v, "without dropout's is above"});
    } else if (dim == 128) {
      std::snprintf(v, sizeof v, "%.0f TFLOP/s", r.tflops);
      std::snprintf(vs, sizeof vs, "%.0f%% of the bf16 GEMM rate", 100 * r.tflops / bf16);
      summary.push_back({std::string("attention fwd+bwd, D 128, ") + (tc ? "tensor" : "CUDA") + " cores", v, vs});
    }
    sl::cuda::device_allocator(0).empty_cache();
  }

  // 6. The models at sizes that fill the GPU, against that GEMM rate.
  for (const std::string& name : models) {
    if (name == "none") continue;
    const model_size m = sized(name, flags);
    const model_result r = run_model(m, z.warmup(2), z.iters(8), profile);
    const double achieved = r.tflop_per_step / (r.step_ms * 1e-3), mfu = achieved / bf16;
    const double mfu_peak = datasheet > 0 ? achieved / datasheet : 0;
    std::printf("\n%s: %ld layers, d %ld, %ld heads (%ld kv), ff %ld, seq %ld, batch %ld: %.3f B parameters, %.3f B in "
                "matrix products\n  FLOPs per token = %s = %.3g\n  FullShard W=1, bf16 compute, fp32 master + AdamW: "
                "%.1f ms/step, %.1f TFLOP per step, %.1f TFLOP/s = %.1f%% of the bf16 GEMM rate above\n",
                m.model.c_str(), m.layers, m.d, m.heads, m.kv_heads, m.ff, m.seq, m.batch, r.parameters / 1e9,
                r.matmul_parameters / 1e9, flop_formula, r.flop_per_token, r.step_ms, r.tflop_per_step, achieved,
                100 * mfu);
    json(sl::cat("\"bench\":\"cuda_model\",\"model\":\"", m.model, "\",\"layers\":", m.layers, ",\"d_model\":", m.d,
                     ",\"heads\":", m.heads, ",\"kv_heads\":", m.kv_heads, ",\"ff\":", m.ff, ",\"seq\":", m.seq,
                     ",\"batch\":", m.batch, ",\"parameters\":", r.parameters, ",\"matmul_parameters\":",
                     r.matmul_parameters, ",\"flop_per_token\":", r.flop_per_token, ",\"flop_formula\":\"",
                     flop_formula, "\",\"step_ms\":", r.step_ms, ",\"TFLOPs\":", achieved,
                     ",\"gemm_bf16_TFLOPs\":", bf16, ",\"mfu\":", mfu,
                     datasheet > 0 ? sl::cat(",\"peak_TFLOPs\":", datasheet, ",\"mfu_peak\":", mfu_peak) : std::string()));
    std::snprintf(v, sizeof v, "%.1f%% MFU vs GEMM", 100 * mfu);  // the goal's measure; the datasheet's ratio follows
    if (datasheet > 0) {
      std::printf("  = %.1f%% of the datasheet's %.0f TFLOP/s (--peak-tflops)\n", 100 * mfu_peak, datasheet);
      std::snprintf(vs, sizeof vs, "%.0f ms/step, %.0f TFLOP/s = %.1f%% of the datasheet's %.0f (goal >= 45%% of the "
                    "GEMM rate)", r.step_ms, achieved, 100 * mfu_peak, datasheet);
    } else {
      std::snprintf(vs, sizeof vs, "%.0f ms/step, %.0f TFLOP/s (goal >= 45%%)", r.step_ms, achieved);
    }
    summary.push_back({m.model + " step, bf16, " + std::to_string(int(std::lround(r.parameters / 1e6))) + "M", v, vs});
    sl::cuda::device_allocator(0).empty_cache();
  }

  std::printf("\n== summary ==\n");
  for (const auto& l : summary) std::printf("%-46s %-18s %s\n", l.what.c_str(), l.value.c_str(), l.versus.c_str());
  if (json.f) std::fclose(json.f);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_cuda: %s\n", e.what());
  return 1;
}
