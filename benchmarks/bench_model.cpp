// bench_model — one training step of a model on one rank, unsharded, one thread:
// forward+backward and the optimizer step timed apart, and the rate its matrix products
// reach against the GEMM peak measured in the same run through the same seam (ops::gemm, on
// the model's largest product). A profiled pass then shows where forward+backward goes,
// per kind of layer, with that kind's matrix products replayed alone. The model:
//   --model encoder  the FSDP article's 6-layer transformer encoder (d_model 512, 8 heads,
//                    feed-forward 2048, batch 32 x seq 10, mean pool, Linear to 10 classes), Adam
//   --model gpt2     models::GPT2LMHeadModel (tied head) of --layers, --d-model, --heads,
//                    --ff (n_inner), --seq, --vocab, AdamW
//   --model llama    models::LlamaForCausalLM of the same, --kv-heads for grouped-query
//                    attention, --ff the SwiGLU width, AdamW
// Run it pinned to one core:
//
//   taskset -c 0 bench_model [--model encoder] [--batch 32] [--seq 10] [--d-model 512] [--heads 8]
//                            [--ff 2048] [--layers 6] [--classes 10] [--vocab 8192] [--kv-heads 0]
//                            [--dropout 0.1] [--lora q_proj v_proj] [--lora-r 8] [--steps 10] [--json FILE]
//
// --lora (gpt2, llama) times a LoRA fine-tune's step: adapters on the projections it
// names (nn::add_lora), every base weight frozen (no weight-gradient products), AdamW over
// the adapters alone.
//
// PyTorch's figure for the same step: benchmarks/torch_reference_step.py (encoder) and
// benchmarks/compare_pytorch.py --model gpt2.
#include <shardlib/models/gpt2.hpp>
#include <shardlib/models/llama.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/lora.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/pooling.hpp>
#include <shardlib/nn/replicated.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/nn/transformer.hpp>
#include <shardlib/ops/gemm.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/param_groups.hpp>
#include <shardlib/plan/presets.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "bench_common.hpp"
#include "common/flags.hpp"
#include "common/reference_model.hpp"
#include "common/synthetic.hpp"

using namespace shardlib;

namespace {

using example::Encoder;
using example::Model;

using GPT2 = models::GPT2LMHeadModel<float>;
using Llama = models::LlamaForCausalLM<float>;

struct sizes {
  long batch, seq, d, heads, ff, layers, classes, vocab, kv_heads;
};

// Where forward+backward goes, by the kind of layer that spends the time.
enum kind { linear, attention, layer_norm, activation, dropout, block_own, other, loss, kinds };
constexpr std::array<const char*, kinds> kind_names{
    "Linear, LM head", "attention",    "LayerNorm/RMSNorm",  "ReLU/GELU/SiLU",
    "Dropout",         "residual adds, gating", "pool, embeddings", "cross_entropy"};

template <class L>
constexpr kind kind_of() {
  if constexpr (std::is_same_v<L, nn::Linear<float>> || std::is_same_v<L, models::LMHead<float>>)
    return linear;
  else if constexpr (std::is_same_v<L, nn::MultiheadAttention<float>> || std::is_same_v<L, nn::GPT2Attention<float>> ||
                     std::is_same_v<L, nn::LlamaAttention<float>>)
    return attention;
  else if constexpr (std::is_same_v<L, nn::LayerNorm<float>> || std::is_same_v<L, nn::RMSNorm<float>>)
    return layer_norm;
  else if constexpr (std::is_same_v<L, nn::ReLU<float>> || std::is_same_v<L, nn::GELU<float>> ||
                     std::is_same_v<L, nn::SiLU<float>>)
    return activation;
  else if constexpr (std::is_same_v<L, nn::Dropout<float>>)
    return dropout;
  else if constexpr (std::is_same_v<L, Encoder> || std::is_same_v<L, models::GPT2Block<float>> ||
                     std::is_same_v<L, models::LlamaDecoderLayer<float>> || std::is_same_v<L, nn::LlamaMLP<float>>)
    return block_own;  // its own work: the residual sums (and SwiGLU's product)
  else
    return other;
}

// The plain context, timing every layer call: a call's time less the calls it makes
// through the context is charged to its kind.
class timing_context : public nn::context {
 public:
  using nn::context::context;
  std::array<double, kinds> seconds{};

  template <class L, class X>
  auto forward(L& layer, const X& x) {
    return timed(kind_of<L>(), [&] { return layer.forward(*this, x); });
  }
  template <class L, class DY>
  auto backward(L& layer, const DY& dy) {
    return timed(kind_of<L>(), [&] { return layer.backward(*this, dy); });
  }
  template <class F>
  auto timed(kind k, F&& f) {
    const double outer = inner_;
    inner_ = 0;
    const double t0 = bench::now_s();
    auto y = f();
    const double dt = bench::now_s() - t0;
    seconds[k] += dt - inner_;
    inner_ = outer + dt;
    return y;
  }

 private:
  double inner_ = 0;  // time of the calls made inside the current one
};

// One ops::gemm call shape of the model, `count` times per forward+backward.
struct product {
  kind owner;
  ops::trans ta, tb;
  long m, n, k, lda, ldb, ldc;
  float beta;
  long count;
  double flop() const { return 2.0 * double(m) * double(n) * double(k) * double(count); }
};

// Every ops::gemm call of one forward+backward, from the sizes, as nn/linear.hpp and
// nn/attention.hpp (batch first), nn/sdpa.hpp and the models make them. Linear(in -> out)
// on R rows: y = b + x W^T [R x out x in], dW += dy^T x [out x in x R], dx = dy W
// [R x in x out]. Attention per (sample, query head): the scores Q K^T and P V forward,
// then dP = dO V^T, dV = P^T dO, dQ = dS K and dK = dS^T Q, reading q, k, v and writing
// the output as rows of their projections (leading dimensions q_ld, kv_ld, o_ld).
void linear_products(std::vector<product>& p, kind owner, long rows, long in, long out, long count) {
  using ops::trans;
  p.push_back({owner, trans::no, trans::yes, rows, out, in, in, in, out, 1, count});
  p.push_back({owner, trans::yes, trans::no, out, in, rows, out, in, in, 1, count});
  p.push_back({owner, trans::no, trans::no, rows, in, out, out, in, in, 0, count});
}
void attention_products(std::vector<product>& p, long L, long D, long count, long q_ld, long kv_ld, long o_ld) {
  using ops::trans;
  p.push_back({attention, trans::no, trans::yes, L, L, D, q_ld, kv_ld, L, 0, count});  // S = Q K^T
  p.push_back({attention, trans::no, trans::no, L, D, L, L, kv_ld, o_ld, 0, count});   // O = P V
  p.push_back({attention, trans::no, trans::yes, L, L, D, o_ld, kv_ld, L, 0, count});  // dP = dO V^T
  p.push_back({attention, trans::yes, trans::no, L, D, L, L, o_ld, kv_ld, 0, count});  // dV = P^T dO
  p.push_back({attention, trans::no, trans::no, L, D, L, L, kv_ld, q_ld, 0, count});   // dQ = dS K
  p.push_back({attention, trans::yes, trans::no, L, D, L, L, q_ld, kv_ld, 0, count});  // dK = dS^T Q
}

std::vector<product> encoder_products(const sizes& s) {
  const long R = s.batch * s.seq, E = s.d, F = s.ff, D = s.d / s.heads, NH = s.layers * s.batch * s.heads;
  std::vector<product> p;
  linear_products(p, attention, R, E, 3 * E, s.layers);  // in_proj
  attention_products(p, s.seq, D, NH, 3 * E, 3 * E, E);
  linear_products(p, linear, R, E, E, s.layers);              // out_proj
  linear_products(p, linear, R, E, F, s.layers);              // linear1
  linear_products(p, linear, R, F, E, s.layers);              // linear2
  linear_products(p, linear, s.batch, E, s.classes, 1);       // the head, after the mean pool
  return p;
}

// A LoRA fine-tune (--lora): the adapters' rank, and how many blocks adapt each
// projection (by its name in the block: "attn.c_attn", "self_attn.q_proj").
struct lora_counts {
  long r = 0;  // 0: every parameter trains, no adapters
  std::map<std::string, long, std::less<>> adapted;
  long of(std::string_view projection) const {
    const auto it = adapted.find(projection);
    return it == adapted.end() ? 0 : it->second;
  }
};

// Linear(in -> out) in `count` blocks, `adapted` of them with a LoRA adapter of rank r
// (nn/lora_adapter.hpp): forward h = x A^T [R x r x in], y += s h B^T [R x out x r];
// backward dh = s dy B [R x r x out], dB += s dy^T h [out x r x R], dA += dh^T x
// [r x in x R], dx += dh A [R x in x r]. Under LoRA the base weight is frozen: no dW.
void projection_products(std::vector<product>& p, long rows, long in, long out, long count, const lora_counts& lora,
                         std::string_view name) {
  using ops::trans;
  if (lora.r == 0) return linear_products(p, linear, rows, in, out, count);
  p.push_back({linear, trans::no, trans::yes, rows, out, in, in, in, out, 1, count});
  p.push_back({linear, trans::no, trans::no, rows, in, out, out, in, in, 0, count});
  const long a = lora.of(name), r = lora.r;
  if (a == 0) return;
  p.push_back({linear, trans::no, trans::yes, rows, r, in, in, in, r, 0, a});
  p.push_back({linear, trans::no, trans::yes, rows, out, r, r, r, out, 1, a});
  p.push_back({linear, trans::no, trans::no, rows, r, out, out, r, r, 0, a});
  p.push_back({linear, trans::yes, trans::no, out, r, rows, out, r, r, 1, a});
  p.push_back({linear, trans::yes, trans::no, r, in, rows, r, in, in, 1, a});
  p.push_back({linear, trans::no, trans::no, rows, in, r, r, in, in, 1, a});
}

// Per block, each projection of plan::block_modules in its order (GPT-2's c_attn E -> 3E,
// q k v side by side; LLaMA's k_proj and v_proj E -> kv heads x D), the attention before
// the projection that reads its output; then the head (E -> vocab; frozen under LoRA).
std::vector<product> decoder_products(const sizes& s, bool llama, const lora_counts& lora) {
  const long R = s.batch * s.seq, E = s.d, D = s.d / s.heads, NH = s.layers * s.batch * s.heads;
  const long KV = (s.kv_heads > 0 ? s.kv_heads : s.heads) * D;
  const plan::decoder_shape shape{.family = llama ? plan::family::llama : plan::family::gpt2, .layers = s.layers,
                                  .hidden = E, .heads = s.heads, .kv_heads = KV / D, .intermediate = s.ff};
  std::vector<product> p;
  for (const auto& mod : plan::block_modules(shape)) {
    if (mod.norm > 0) continue;
    // the attention's output is the input of the projection after it, which it keeps
    if (mod.input_kept) attention_products(p, s.seq, D, NH, llama ? E : 3 * E, llama ? KV : 3 * E, E);
    projection_products(p, R, long(mod.in), long(mod.out), s.layers, lora, mod.name);
  }
  projection_products(p, R, E, s.vocab, 1, lora, "lm_head");
  return p;
}

// nn::add_lora's adapters on `model` as lora_counts: each adapted Linear's name past its
// block's prefix ("transformer.h.3.", "model.layers.3.").
template <class M>
lora_counts adapt(M& model, const std::vector<std::string>& targets, long r) {
  lora_counts c;
  if (targets.empty()) return c;
  c.r = r;
  for (const auto& name : nn::add_lora(model, targets, {.r = r, .alpha = 2.0 * double(r)})) {
    std::size_t at = name.find('.', name.find('.') + 1);  // past "transformer.h" or "model.layers"
    at = name.find('.', at + 1);                            // past the block's index
    ++c.adapted[name.substr(at + 1)];
  }
  return c;
}

// Operands for replaying any of the products, with small values (no overflow, no subnormals).
struct operands {
  std::vector<float> a, b, c;
  explicit operands(const std::vector<product>& ps) {
    std::size_t na = 0, nb = 0, nc = 0;
    for (const auto& p : ps) {
      na = std::max(na, std::size_t((p.ta == ops::trans::no ? p.m : p.k) * p.lda));
      nb = std::max(nb, std::size_t((p.tb == ops::trans::no ? p.k : p.n) * p.ldb));
      nc = std::max(nc, std::size_t(p.m * p.ldc));
    }
    a.assign(na, 0.01f);
    b.assign(nb, 0.02f);
    c.assign(nc, 0.f);
  }
  void run(const product& p, long times) {
    for (long i = 0; i < times; ++i)
      ops::gemm(p.ta, p.tb, p.m, p.n, p.k, 1.f, a.data(), p.lda, b.data(), p.ldb, p.beta, c.data(), p.ldc);
  }
};

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + long(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Times `model`'s training step on (x, y) with `opt` (the steps and the profiled pass),
// against the GEMM peak on the largest of `products`, and prints and records the results.
template <class M, class X, class Y, class Opt>
void measure(const std::string& model_name, const std::string& description, M& model, const X& x, const Y& y,
             Opt opt, const std::vector<product>& products, const sizes& s, double dropout, long steps,
             std::FILE* json) {
  nn::Replicated<float, M> params(model, 0);
  const std::size_t n = params.values().size();
  const auto runs = optim::cut_frozen({{0, n, 0}}, params.layout(), 0, n);  // all of it, or LoRA's adapters
  auto state = opt.make_state(optim::trained_size(runs));

  // Matrix products: counted from the sizes, and the peak on the largest one.
  double gflop = 0;
  long calls = 0;
  for (const auto& p : products) {
    gflop += p.flop() / 1e9;
    calls += p.count;
  }
  operands ops_buffers(products);
  const product& big = *std::max_element(products.begin(), products.end(), [](const product& a, const product& b) {
    return a.flop() / double(a.count) < b.flop() / double(b.count);
  });
  ops_buffers.run(big, 3);
  double peak_s = 1e30;  // the fastest call over about a second: what the backend reaches on a quiet core
  for (double spent = 0; spent < 1.0;) {
    const double t0 = bench::now_s();
    ops_buffers.run(big, 1);
    const double dt = bench::now_s() - t0;
    peak_s = std::min(peak_s, dt);
    spent += dt;
  }
  const double peak = 2 * double(big.m * big.n * big.k) / peak_s / 1e9;

  std::printf("bench_model: %s; %zu parameters, %zu trained; %s; one thread; float GEMM backend: %s\n",
              description.c_str(), nn::parameter_count(model), optim::trained_size(runs),
              std::string(Opt::name).c_str(), std::string(ops::gemm_backend).c_str());
  std::printf(
      "matrix products of one forward+backward: %ld ops::gemm calls, %.2f GFLOP (2 M N K summed over the "
      "shapes the sizes give)\n",
      calls, gflop);
  std::printf(
      "GEMM peak: %.1f GFLOP/s (ops::gemm on the largest product, [%ld x %ld x %ld], its best call of a "
      "second's repeats)\n\n",
      peak, big.m, big.n, big.k);

  // train_reference's step, on one batch made once outside the timing (zero_grad after the optimizer, not before the forward).
  auto step = [&](auto& ctx, long i, double& fwd_bwd_s, double& optimizer_s) {
    ctx.set_step(std::uint64_t(i));
    const double t0 = bench::now_s();
    const auto logits = ctx.forward(model, x);
    const auto l = nn::cross_entropy(logits, y);
    ctx.backward(model, l.grad);
    const double t1 = bench::now_s();
    optim::step_unfrozen(opt, params.values(), std::span<const float>(params.grads()), state, runs);
    params.zero_grad();
    fwd_bwd_s = t1 - t0;
    optimizer_s = bench::now_s() - t1;
  };
  nn::context ctx({.seed = 0});
  double fb = 0, op = 0;
  for (long i = 0; i < 2; ++i) step(ctx, i, fb, op);  // warm-up: first-touch page faults, the backend's set-up
  std::vector<double> fwd_bwd(std::size_t(steps), 0), optimizer(std::size_t(steps), 0), total(std::size_t(steps), 0);
  for (long i = 0; i < steps; ++i) {
    step(ctx, i + 2, fwd_bwd[std::size_t(i)], optimizer[std::size_t(i)]);
    total[std::size_t(i)] = fwd_bwd[std::size_t(i)] + optimizer[std::size_t(i)];
  }
  const double fb_s = median(fwd_bwd), opt_s = median(optimizer), step_s = median(total);
  const double rate = gflop / fb_s;
  std::printf("%-36s %9s\n", "part (median of steps)", "ms");
  std::printf("%-36s %9.1f   matrix products at %.1f GFLOP/s = %.2f of the GEMM peak\n", "forward+backward", fb_s * 1e3,
              rate, rate / peak);
  std::printf("%-36s %9.1f\n", (std::string("optimizer (") + std::string(Opt::name) + " step + zero_grad)").c_str(),
              opt_s * 1e3);
  std::printf("%-36s %9.1f\n\n", "training step", step_s * 1e3);

  // Where forward+backward goes: a profiled pass, and each kind's products replayed alone.
  std::vector<std::array<double, kinds>> profiled;
  for (long i = 0; i < std::max(3L, steps / 2); ++i) {
    timing_context tctx({.seed = 0});
    tctx.set_step(std::uint64_t(i));
    const auto logits = tctx.forward(model, x);
    const auto l = tctx.timed(loss, [&] { return nn::cross_entropy(logits, y); });
    tctx.backward(model, l.grad);
    params.zero_grad();
    profiled.push_back(tctx.seconds);
  }
  std::array<double, kinds> gemm_s{};
  for (const auto& p : products) {
    ops_buffers.run(p, std::min(p.count, 4L));
    std::vector<double> t(5);
    for (auto& ti : t) {
      const double t0 = bench::now_s();
      ops_buffers.run(p, p.count);
      ti = bench::now_s() - t0;
    }
    gemm_s[p.owner] += median(t);
  }
  double gemm_total = 0;
  for (double g : gemm_s) gemm_total += g;
  std::printf(
      "where forward+backward goes (a profiled pass: each layer call less the calls it makes; gemm: that "
      "kind's products replayed alone)\n");
  std::printf("%-22s %9s %9s %9s %7s\n", "kind", "ms", "gemm ms", "rest ms", "share");
  for (int k = 0; k < kinds; ++k) {
    std::vector<double> t;
    for (const auto& p : profiled) t.push_back(p[std::size_t(k)]);
    const double ms = median(t) * 1e3, g = gemm_s[std::size_t(k)] * 1e3;
    std::printf("%-22s %9.1f %9.1f %9.1f %6.1f%%\n", kind_names[std::size_t(k)], ms, g, ms - g,
                100 * ms / (fb_s * 1e3));
    if (json)
      std::fprintf(json,
                   "{\"bench\":\"model\",\"model\":\"%s\",\"what\":\"breakdown\",\"kind\":\"%s\",\"seconds\":%.6g,"
                   "\"gemm_seconds\":%.6g}\n",
                   model_name.c_str(), kind_names[std::size_t(k)], ms / 1e3, g / 1e3);
  }
  std::printf("%-22s %9.1f %9.1f %9.1f %6.1f%%   (all products replayed alone: %.1f GFLOP/s)\n", "forward+backward",
              fb_s * 1e3, gemm_total * 1e3, (fb_s - gemm_total) * 1e3, 100.0, gflop / gemm_total);

  if (json)
    std::fprintf(json,
                 "{\"bench\":\"model\",\"model\":\"%s\",\"what\":\"step\",\"backend\":\"%s\",\"batch\":%ld,\"seq\":%ld,"
                 "\"d_model\":%ld,\"heads\":%ld,\"kv_heads\":%ld,\"ff\":%ld,\"layers\":%ld,\"classes\":%ld,"
                 "\"vocab\":%ld,\"dropout\":%g,\"steps\":%ld,\"forward_backward_s\":%.6g,\"optimizer_s\":%.6g,"
                 "\"step_s\":%.6g,\"gemm_calls\":%ld,\"gemm_gflop\":%.6g,\"gemm_gflops\":%.6g,"
                 "\"gemm_replayed_s\":%.6g,\"peak_gflops\":%.6g,\"vs_peak\":%.4g}\n",
                 model_name.c_str(), std::string(ops::gemm_backend).c_str(), s.batch, s.seq, s.d, s.heads, s.kv_heads,
                 s.ff, s.layers, s.classes, s.vocab, dropout, steps, fb_s, opt_s, step_s, calls, gflop, rate,
                 gemm_total, peak, rate / peak);
}

// Token ids [batch, seq] uniform over the vocabulary.
Tensor<std::int64_t> token_ids(long batch, long seq, long vocab, std::uint64_t stream) {
  Tensor<std::int64_t> t({batch, seq});
  const counter_rng rng(7, stream);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t[i] = std::min<std::int64_t>(vocab - 1, std::int64_t(rng.uniform_double(std::uint64_t(i)) * double(vocab)));
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  example::model_flags m;
  long batch = 32, steps = 10, vocab = 8192, kv_heads = 0, lora_r = 8;
  std::string model_name = "encoder", json_path;
  std::vector<std::string> lora;
  example::command_line cli("One training step of a model (the reference encoder, GPT-2 or LLaMA) on one rank, "
                            "unsharded, one thread, against the GEMM peak measured in the same run.",
                            "bench_model");
  cli.add_option("--model", model_name, "the model")->check(CLI::IsMember({"encoder", "gpt2", "llama"}));
  example::add_model_flags(cli, m);
  cli.add_option("--batch", batch, "sequences per step")->check(example::whole(1, example::max_size));
  cli.add_option("--vocab", vocab, "gpt2, llama: vocabulary size")->check(example::whole(1, example::max_size));
  cli.add_option("--kv-heads", kv_heads, "llama: key/value heads (divides --heads; 0 = --heads)")
      ->check(example::whole(0, example::max_size));
  cli.add_option("--lora", lora, "gpt2, llama: a LoRA fine-tune, adapters on the projections these name "
                 "(nn::add_lora), everything else frozen");
  cli.add_option("--lora-r", lora_r, "--lora: the adapters' rank")->check(example::whole(1, 4096));
  cli.add_option("--steps", steps, "measured steps")->check(example::whole(1, example::max_size));
  cli.add_option("--json", json_path, "appends the results as JSON lines");
  cli.callback([&] {
    example::check_model_flags(m);
    if (!lora.empty() && model_name == "encoder")
      throw CLI::ValidationError("--lora", "adapts the decoders' projections (--model gpt2 or llama)");
    if (kv_heads > 0 && m.heads % kv_heads != 0)
      throw CLI::ValidationError("--kv-heads", std::to_string(kv_heads) + " does not divide --heads " +
                                                   std::to_string(m.heads));
  });
  cli.parse_or_exit(argc, argv);
  const sizes s{batch, m.seq, m.d_model, m.heads, m.ff, m.layers, m.classes, vocab, kv_heads};
  std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "a");

  if (model_name == "encoder") {
    Model model = example::reference_model(m);
    const example::synthetic_task task = example::task_for(m);
    measure(model_name,
            cat(s.layers, " x TransformerEncoderLayer(d_model ", s.d, ", nhead ", s.heads, ", ff ", s.ff, ", dropout ",
                m.dropout, "), batch ", s.batch, " x seq ", s.seq, ", mean pool, Linear to ", s.classes),
            model, task.inputs(0, s.batch), task.labels(0, s.batch), optim::Adam{{.lr = 1e-3}}, encoder_products(s), s,
            m.dropout, steps, json);
  } else {
    const auto x = token_ids(s.batch, s.seq, s.vocab, 1), y = token_ids(s.batch, s.seq, s.vocab, 2);
    std::string shape = cat(", batch ", s.batch, " x seq ", s.seq, ", vocabulary ", s.vocab);
    if (!lora.empty()) {
      shape += cat("; LoRA r ", lora_r, " on");
      for (const auto& t : lora) shape += cat(" ", t);
    }
    if (model_name == "gpt2") {
      GPT2 model({.vocab_size = s.vocab, .n_positions = s.seq, .n_embd = s.d, .n_layer = s.layers, .n_head = s.heads,
                  .n_inner = s.ff, .resid_pdrop = m.dropout, .embd_pdrop = m.dropout, .attn_pdrop = m.dropout});
      const lora_counts adapters = adapt(model, lora, lora_r);
      measure(model_name,
              cat("GPT2LMHeadModel(", s.layers, " blocks, n_embd ", s.d, ", ", s.heads, " heads, n_inner ", s.ff,
                  ", dropout ", m.dropout, ", tied head)", shape),
              model, x, y, optim::AdamW{{.lr = 1e-3}}, decoder_products(s, false, adapters), s, m.dropout, steps,
              json);
    } else {
      Llama model({.vocab_size = s.vocab, .hidden_size = s.d, .intermediate_size = s.ff, .num_hidden_layers = s.layers,
                   .num_attention_heads = s.heads, .num_key_value_heads = s.kv_heads, .max_position_embeddings = s.seq});
      const lora_counts adapters = adapt(model, lora, lora_r);
      measure(model_name,
              cat("LlamaForCausalLM(", s.layers, " layers, hidden ", s.d, ", ", s.heads, " heads, ",
                  s.kv_heads > 0 ? s.kv_heads : s.heads, " kv heads, intermediate ", s.ff, ")", shape),
              model, x, y, optim::AdamW{{.lr = 1e-3}}, decoder_products(s, true, adapters), s, 0.0, steps, json);
    }
  }
  if (json) std::fclose(json);
  return 0;
}
