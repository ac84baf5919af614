// bench_generate — text generation on one rank, one thread, unsharded: models::generate
// with the KV cache on GPT-2 or LLaMA in float, the prompt's forward (prefill) and each
// new token's (decode) timed apart, then the sampling step alone.
//
// The limit a decode step is measured against: it reads every weight it uses once (all
// of them but the input embedding tables, of which it reads one row a token) and the
// KV cache so far, so it takes at least those bytes over the read bandwidth measured in
// the same run (one thread scanning twice the last-level cache; a model that fits in the
// cache can beat it). At batch 1 a decode step is
// that memory-bound; larger batches reuse each weight and move towards the GEMM rate
// (bench_model measures that).
//
// Sampling (detail::pick_token: top-k, then top-p as transformers' warpers) runs on the
// host for every row and step; it is timed on one row of the vocabulary's logits drawn
// N(0, sigma) for a few spreads (a trained model's are wide; a random model's, as here,
// are flat, which is top-p's slowest case), against one pass over the row at the same
// read bandwidth.
//
//   taskset -c 0 bench_generate [--model gpt2|llama] [--layers 4] [--d-model 512] [--heads 8]
//                               [--kv-heads 0] [--ff 2048] [--vocab 50257] [--batch 1]
//                               [--prompt 32] [--new-tokens 32] [--top-p 0.9] [--json FILE]
#include <shardlib/models/gpt2.hpp>
#include <shardlib/models/llama.hpp>
#include <shardlib/nn/replicated.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>  // sysconf

#include "bench_common.hpp"
#include "common/flags.hpp"

using namespace shardlib;

namespace {

struct settings {
  std::string model = "gpt2";
  example::model_flags m{.layers = 4};
  long vocab = 50257, kv_heads = 0, batch = 1, prompt = 32, new_tokens = 32, repeats = 3;
  double top_p = 0.9;
};

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + long(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// The last-level cache's bytes (0 where the system does not say).
std::size_t last_level_cache() {
  for (const int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE})
    if (const long b = ::sysconf(name); b > 0) return std::size_t(b);
  return 0;
}

// Bytes per second of one thread reading memory once, as a decode step reads its weights:
// memchr for a byte that is not there (libc's vectorised scan; a loop of ours would measure
// its own instructions in a quick build) over twice the last-level cache, at least 256 MiB.
double read_rate() {
  const std::size_t bytes = std::max<std::size_t>(2 * last_level_cache(), std::size_t(256) << 20);
  const std::vector<char> buffer(bytes, 0);
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    const double t0 = bench::now_s();
    const void* found = std::memchr(buffer.data(), 1, bytes);
    t.push_back(bench::now_s() - t0);
    if (found) throw error("bench_generate: the read pass found a byte it was not given");
  }
  return double(bytes) / median(t);
}

Tensor<std::int64_t> prompt_ids(long batch, long len, long vocab) {
  Tensor<std::int64_t> t({batch, len});
  std::mt19937_64 g(3);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = std::int64_t(g() % std::uint64_t(vocab));
  return t;
}

// Median seconds of generate(model, prompt, {new_tokens}) over the repeats.
template <class M>
double time_generate(M& model, const Tensor<std::int64_t>& prompt, long new_tokens, long repeats) {
  std::vector<double> t;
  for (long r = 0; r < repeats; ++r) {
    const double t0 = bench::now_s();
    const auto out = models::generate(model, prompt, {.max_new_tokens = new_tokens});
    t.push_back(bench::now_s() - t0);
    if (out.dim(1) != prompt.dim(1) + new_tokens) throw error("bench_generate: generate stopped early");
  }
  return median(t);
}

// `untouched`: parameters a decode step does not read whole (the input embedding tables);
// `kv_width`: keys plus values per token and layer.
template <class M>
void measure(const settings& s, const std::string& description, M& model, std::size_t untouched, long kv_width,
             std::FILE* json) {
  nn::Replicated<float, M> owner(model, 0);
  const std::size_t params = nn::parameter_count(model);
  const auto prompt = prompt_ids(s.batch, s.prompt, s.vocab);
  time_generate(model, prompt, 2, 1);  // warm-up
  const double first = time_generate(model, prompt, 1, s.repeats);  // prefill and one pick
  const double all = time_generate(model, prompt, s.new_tokens, s.repeats);
  const double decode = s.new_tokens > 1 ? (all - first) / double(s.new_tokens - 1) : 0;

  // A decode step's bytes: the weights it reads and the cache at its mean length.
  const double mean_len = double(s.prompt) + double(s.new_tokens) / 2;
  const double step_bytes = 4.0 * (double(params - untouched) +
                                   double(s.batch) * double(s.m.layers) * double(kv_width) * mean_len);
  const double bw = read_rate();
  const double limit = step_bytes / bw;

  std::printf("bench_generate: %s; %zu parameters; batch %ld, prompt %ld, %ld new tokens (greedy, KV cache); one "
              "thread; float GEMM backend: %s\n",
              description.c_str(), params, s.batch, s.prompt, s.new_tokens, std::string(ops::gemm_backend).c_str());
  std::printf("%-40s %10s %12s\n", "", "ms", "tokens/s");
  std::printf("%-40s %10.2f %12.1f\n", "prefill + first token", first * 1e3, double(s.batch * s.prompt) / first);
  if (s.new_tokens > 1) {
    std::printf("%-40s %10.2f %12.1f\n", "decode, per new token", decode * 1e3, double(s.batch) / decode);
    const double cache = double(last_level_cache());
    std::printf("limit: a decode step reads %.1f MB (weights %zu, KV cache at length %.0f) at the %.1f GB/s one "
                "thread reads from memory = %.2f ms; reached %.2fx of it%s\n\n",
                step_bytes / 1e6, params - untouched, mean_len, bw / 1e9, limit * 1e3, limit / decode,
                step_bytes < cache ? cat(" (the step's bytes fit in the ", cache / 1048576,
                                         " MiB last-level cache, which may beat memory)").c_str() : "");
  }
  if (json)
    std::fprintf(json,
                 "{\"bench\":\"generate\",\"model\":\"%s\",\"what\":\"decode\",\"params\":%zu,\"batch\":%ld,"
                 "\"prompt\":%ld,\"new_tokens\":%ld,\"prefill_s\":%.6g,\"decode_s\":%.6g,\"step_bytes\":%.6g,"
                 "\"read_GBps\":%.6g,\"limit_s\":%.6g,\"vs_limit\":%.4g}\n",
                 s.model.c_str(), params, s.batch, s.prompt, s.new_tokens, first, decode, step_bytes, bw / 1e9, limit,
                 s.new_tokens > 1 ? limit / decode : 0.0);

  // Sampling one row: top-p over the whole vocabulary (top_k 0), the default top-k 50
  // of transformers' do_sample with the same top-p, against one read of the row.
  const double row_limit = 4.0 * double(s.vocab) / bw;
  std::printf("sampling one row of %ld logits drawn N(0, sigma); limit: one read of the row at that rate, "
              "%.3f ms\n",
              s.vocab, row_limit * 1e3);
  std::printf("%-8s %-24s %10s %10s\n", "sigma", "options", "ms", "vs limit");
  std::mt19937_64 g(5);
  for (const double sigma : {1.0, 3.0, 6.0}) {
    std::normal_distribution<float> n(0, float(sigma));
    std::vector<float> z(std::size_t(s.vocab));
    for (auto& x : z) x = n(g);
    for (const long k : {0L, 50L}) {
      const models::generate_options o{.top_k = k, .top_p = s.top_p};
      std::vector<double> t;
      for (int i = 0; i < 7; ++i) {
        const double t0 = bench::now_s();
        (void)models::detail::pick_token(z.data(), s.vocab, o, (i + 0.5) / 7);
        t.push_back(bench::now_s() - t0);
      }
      const double ms = median(t) * 1e3;
      const std::string opts = cat("top_k ", k, ", top_p ", s.top_p);
      std::printf("%-8.0f %-24s %10.3f %10.3f\n", sigma, opts.c_str(), ms, row_limit * 1e3 / ms);
      if (json)
        std::fprintf(json,
                     "{\"bench\":\"generate\",\"model\":\"%s\",\"what\":\"sampling\",\"vocab\":%ld,\"sigma\":%g,"
                     "\"top_k\":%ld,\"top_p\":%g,\"seconds\":%.6g,\"limit_s\":%.6g}\n",
                     s.model.c_str(), s.vocab, sigma, k, s.top_p, ms / 1e3, row_limit);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  std::string json_path;
  example::command_line cli("Text generation (models::generate with the KV cache) on one rank, one thread: prefill "
                            "and decode against the bytes a decode step reads at the read bandwidth, and sampling.",
                            "bench_generate");
  cli.add_option("--model", s.model, "the model")->check(CLI::IsMember({"gpt2", "llama"}));
  const CLI::Validator size = example::whole(1, example::max_size);
  cli.add_option("--layers", s.m.layers, "decoder blocks")->check(size);
  cli.add_option("--d-model", s.m.d_model, "model width")->check(size);
  cli.add_option("--heads", s.m.heads, "attention heads (divides --d-model)")->check(size);
  cli.add_option("--kv-heads", s.kv_heads, "llama: key/value heads (divides --heads; 0 = --heads)")
      ->check(example::whole(0, example::max_size));
  cli.add_option("--ff", s.m.ff, "feed-forward width")->check(size);
  cli.add_option("--vocab", s.vocab, "vocabulary size")->check(size);
  cli.add_option("--batch", s.batch, "rows generated together")->check(size);
  cli.add_option("--prompt", s.prompt, "prompt tokens per row")->check(size);
  cli.add_option("--new-tokens", s.new_tokens, "tokens generated per row")->check(size);
  cli.add_option("--repeats", s.repeats, "timed runs (the median is reported)")->check(size);
  cli.add_option("--top-p", s.top_p, "the sampling table's top_p")->check(example::real(0, 1));
  cli.add_option("--json", json_path, "appends the results as JSON lines");
  cli.callback([&] {
    example::check_model_flags(s.m);
    if (s.kv_heads > 0 && s.m.heads % s.kv_heads != 0)
      throw CLI::ValidationError("--kv-heads", cat(s.kv_heads, " does not divide --heads ", s.m.heads));
    if (s.top_p <= 0) throw CLI::ValidationError("--top-p", "must be in (0, 1]");
  });
  cli.parse_or_exit(argc, argv);
  std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "a");
  const long positions = s.prompt + s.new_tokens, d = s.m.d_model, head_dim = d / s.m.heads;
  if (s.model == "gpt2") {
    models::GPT2LMHeadModel<float> model({.vocab_size = s.vocab, .n_positions = positions, .n_embd = d,
                                          .n_layer = s.m.layers, .n_head = s.m.heads, .n_inner = s.m.ff});
    measure(s,
            cat("GPT2LMHeadModel(", s.m.layers, " blocks, n_embd ", d, ", ", s.m.heads, " heads, n_inner ", s.m.ff,
                ", vocabulary ", s.vocab, ", tied head)"),
            model, std::size_t(positions * d), 2 * d, json);
  } else {
    const long kv = s.kv_heads > 0 ? s.kv_heads : s.m.heads;
    models::LlamaForCausalLM<float> model({.vocab_size = s.vocab, .hidden_size = d, .intermediate_size = s.m.ff,
                                           .num_hidden_layers = s.m.layers, .num_attention_heads = s.m.heads,
                                           .num_key_value_heads = s.kv_heads, .max_position_embeddings = positions});
    measure(s,
            cat("LlamaForCausalLM(", s.m.layers, " layers, hidden ", d, ", ", s.m.heads, " heads, ", kv,
                " kv heads, intermediate ", s.m.ff, ", vocabulary ", s.vocab, ")"),
            model, std::size_t(s.vocab * d), 2 * kv * head_dim, json);
  }
  if (json) std::fclose(json);
  return 0;
}
