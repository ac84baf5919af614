// GPT-2 and LLaMA on the device against the same models on the host: tiny
// configs, the same parameter values (the engine's seeded init, by name and
// index), the same token batches. Logits and every parameter's gradient in fp32;
// a few AdamW steps under FullShard at two ranks on one GPU (device_thread_comm)
// against the unsharded host run; bf16 compute against fp32; the KV cache and
// generation on the device against the host and against full forwards.
#include <shardlib/comm/launch.hpp>
#include <shardlib/core/random.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/models/cuda.cuh>
#include <shardlib/models/sharded_generate.hpp>
#include <shardlib/nn/flat.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/lora.hpp>
#include <shardlib/nn/replicated.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/cuda/adam.cuh>
#include <shardlib/shard/cuda/space_ops.cuh>
#include <shardlib/shard/sharded_model.hpp>

#include "device_test.hpp"
#include "device_thread_comm.hpp"
#include "support/compare.hpp"
#include "support/raised.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace test_cuda_decoder {

namespace {

using namespace device_test;
namespace shard = sl::shard;
namespace models = sl::models;

// Dropout off everywhere: the comparisons are of the arithmetic.
const models::gpt2_config gpt2_tiny{.vocab_size = 64,
                                    .n_positions = 16,
                                    .n_embd = 32,
                                    .n_layer = 2,
                                    .n_head = 4,
                                    .resid_pdrop = 0,
                                    .embd_pdrop = 0,
                                    .attn_pdrop = 0};
// Grouped-query attention (4 query heads over 2 kv heads), RoPE, untied head.
const models::llama_config llama_tiny{.vocab_size = 64,
                                      .hidden_size = 32,
                                      .intermediate_size = 48,
                                      .num_hidden_layers = 2,
                                      .num_attention_heads = 4,
                                      .num_key_value_heads = 2,
                                      .max_position_embeddings = 16};

// The model types of a config, on the host and on the device.
template <class Config>
struct family;
template <>
struct family<models::gpt2_config> {
  template <class T, class Space>
  using model = models::GPT2LMHeadModel<T, Space>;
  static const char* name() { return "GPT-2"; }
};
template <>
struct family<models::llama_config> {
  template <class T, class Space>
  using model = models::LlamaForCausalLM<T, Space>;
  static const char* name() { return "LLaMA"; }
};

constexpr std::int64_t seq = 12, per_rank = 2;
constexpr std::uint64_t seed = 11;

// Token ids [count, seq] of rows first.. of a fixed random stream.
sl::Tensor<std::int64_t> tokens(std::int64_t first, std::int64_t count, std::int64_t vocab) {
  const sl::counter_rng draws(5, sl::fnv1a("test_cuda_decoder tokens"));
  sl::Tensor<std::int64_t> ids({count, seq});
  for (std::int64_t i = 0; i < ids.numel(); ++i)
    ids[i] = std::int64_t(draws.uniform_double(std::uint64_t(first * seq + i)) * double(vocab)) % vocab;
  return ids;
}

template <class T>
std::vector<float> host_copy(const sl::Tensor<T, sl::cuda_space>& d) {
  std::vector<T> v(std::size_t(d.numel()));
  sl::cuda::copy_async(std::span<T>(v), std::span<const T>(d.span()), sl::cuda::current_stream());
  sl::cuda::check(cudaStreamSynchronize(sl::cuda::current_stream()), "cudaStreamSynchronize");
  return widened(v);
}

// Largest error of got against want relative to max(|want|, floor); NaN counts as +inf.
double worst_relative(const std::vector<float>& got, const std::vector<float>& want, double floor) {
  test_support::max_error w;
  w.relative(got, want, floor);
  return w.value();
}

// One forward and backward of the fp32 model on the host (nn::Replicated, seeded
// init) and on the device (the host's values uploaded into one flat device
// buffer bound as the host's is), with the host loss's gradient as dy on both.
// padded: the second sequence's first 3 positions are left padding (a key
// padding mask on both contexts; their queries see no key and attend to nothing),
// and position ids on both (see below).
template <class Config>
void check_logits_and_gradients(const Config& config, bool padded = false) {
  using host_model = typename family<Config>::template model<float, sl::host_space>;
  using device_model = typename family<Config>::template model<float, sl::cuda_space>;
  INFO(family<Config>::name() << (padded ? " with key padding" : ""));
  const auto ids = tokens(0, 3, config.vocab_size);
  const auto targets = models::causal_lm_targets(ids);
  sl::Tensor<std::uint8_t> padding({3, seq});
  for (std::int64_t i = 0; i < padding.numel(); ++i) padding[i] = i >= seq && i < seq + 3 ? 1 : 0;
  // Row 1 counts from its first token, as left padding does; row 2 starts again halfway
  // (two sequences packed in one row: a position pattern RoPE cannot take for a shift).
  sl::Tensor<std::int64_t> positions({3, seq});
  for (std::int64_t i = 0; i < positions.numel(); ++i) {
    const std::int64_t n = i / seq, j = i % seq;
    positions[i] = n == 1 ? std::max<std::int64_t>(j - 3, 0) : n == 2 && j >= seq / 2 ? j - seq / 2 : j;
  }
  const auto pad = [&](sl::nn::context& c) {
    if (!padded) return;
    c.set_key_padding_mask(padding);
    c.set_position_ids(positions);
  };

  host_model hm(config);
  sl::nn::Replicated<float, host_model> host(hm, seed);
  sl::nn::context hctx;
  pad(hctx);
  const auto want_logits = hctx.forward(hm, ids);
  const auto loss = sl::nn::cross_entropy(want_logits, targets);
  hctx.backward(hm, loss.grad);

  sl::cuda::stream stream(0);
  sl::cuda::stream_scope scope(stream.get());
  device_model dm(config);
  const sl::nn::flat_layout layout = sl::nn::flatten<float>(dm);
  REQUIRE(layout.numel == host.layout().numel);
  sl::Buffer<float, sl::cuda_space> values(layout.numel, sl::category::parameters),
      grads(layout.numel, sl::category::gradients);
  sl::cuda::copy_async(values.span(), std::span<const float>(host.values()), stream.get());
  sl::cuda::fill_bytes_async(grads.span(), 0, stream.get());
  sl::nn::bind<float>(dm, layout, values.data(), grads.data());
  sl::nn::context dctx;
  pad(dctx);
  const auto logits = dctx.forward(dm, sl::cuda::to_device(ids));
  const float device_loss = sl::nn::cross_entropy(logits, sl::cuda::to_device(targets)).loss;
  dctx.backward(dm, sl::cuda::to_device(loss.grad));
  // Eval mode (gradients disabled, not training: the configs have no dropout) computes
  // the same logits: the same kernels on the same values give the same bits (a NaN never
  // compares equal).
  device_test::no_grad_context eval({.training = false});
  pad(eval);
  CHECK(host_copy(eval.forward(dm, sl::cuda::to_device(ids))) == host_copy(logits));

  // cuBLAS and the fused attention sum in other orders than oneDNN and nn::sdpa
  // (~1e-6 relative per operation in fp32); 1e-4 leaves room for the depth.
  const std::vector<float> want(want_logits.span().begin(), want_logits.span().end());
  CHECK(worst_relative(host_copy(logits), want, 1e-2) <= 1e-4);
  test_support::max_error loss_error;
  loss_error.relative(double(device_loss), double(loss.loss), 0.0);
  CHECK(loss_error.value() <= 1e-5);
  // Gradients per parameter, relative to max(|g|, the parameter's largest |g|):
  // an element's rounding error scales with the terms summed into it, not with
  // its own size, so small elements are judged on their parameter's scale.
  std::vector<float> got_grads(layout.numel);
  sl::cuda::copy_async(std::span<float>(got_grads), std::span<const float>(grads.span()), stream.get());
  sl::cuda::check(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize");
  for (const auto& e : layout.entries) {
    const auto w = host.grads().subspan(e.offset, e.numel());
    const std::vector<float> want_g(w.begin(), w.end()),
        got_g(got_grads.begin() + std::ptrdiff_t(e.offset), got_grads.begin() + std::ptrdiff_t(e.offset + e.numel()));
    INFO("gradient of " << e.name);
    CHECK(max_abs(want_g) > 0);  // every parameter takes part (a tied weight twice)
    CHECK(worst_relative(got_g, want_g, double(max_abs(want_g))) <= 1e-4);
  }
}

// A device model bound to one flat device buffer holding `values` (fp32, the
// layout's order), gradients unbound (inference).
template <class Model>
struct bound_model {
  Model model;
  sl::Buffer<float, sl::cuda_space> values;
  template <class Config>
  bound_model(const Config& config, std::span<const float> host_values)
      : model(config), values(host_values.size(), sl::category::parameters) {
    const sl::nn::flat_layout layout = sl::nn::flatten<float>(model);
    REQUIRE(layout.numel == host_values.size());
    sl::cuda::copy_async(values.span(), host_values, sl::cuda::current_stream());
    sl::nn::bind<float>(model, layout, values.data(), nullptr);
  }
};

// Columns [first, first + count) of ids [batch, seq].
sl::Tensor<std::int64_t> columns(const sl::Tensor<std::int64_t>& ids, std::int64_t first, std::int64_t count) {
  const std::int64_t B = ids.dim(0), S = ids.dim(1);
  sl::Tensor<std::int64_t> out({B, count});
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t t = 0; t < count; ++t) out[n * count + t] = ids[n * S + first + t];
  return out;
}

// The last position's logits of every row, [batch * vocab], from host or device
// logits, as generate reads them (a device read also takes the Embeddings' checks).
template <class T, class Space>
std::vector<float> last_position(const sl::Tensor<T, Space>& logits) {
  const sl::Tensor<T> last = models::detail::generate_io<Space>::logits(logits);
  const std::int64_t B = last.dim(0), S = last.dim(1), V = last.dim(2);
  std::vector<float> v;
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t i = 0; i < V; ++i) v.push_back(float(last[(n * S + S - 1) * V + i]));
  return v;
}

// Every generated token of `got` [batch, total] is the host model's most likely one
// at its position within `tolerance` of the logits' largest magnitude (host and
// device sum in other orders, so a near-tie may go either way; anything else is
// a wrong token). The host runs one forward over each row.
template <class HostModel>
void check_tokens_are_hosts_choice(HostModel& hm, const sl::Tensor<std::int64_t>& got, std::int64_t prompt_len,
                                   double tolerance) {
  sl::nn::context ctx({.training = false});
  const auto logits = ctx.forward(hm, got);
  const std::int64_t B = got.dim(0), S = got.dim(1), V = logits.dim(2);
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t t = prompt_len; t < S; ++t) {
      const float* z = logits.data() + (n * S + t - 1) * V;
      double best = z[0], scale = 0;
      for (std::int64_t i = 0; i < V; ++i) {
        best = test_support::max_keeping_nan(best, z[i]);
        scale = test_support::max_keeping_nan(scale, std::abs(z[i]));
      }
      const double picked = z[got[n * S + t]];
      INFO("row " << n << ", position " << t << ": token " << got[n * S + t] << " has logit " << picked
                  << ", the best " << best);
      CHECK(picked >= best - tolerance * scale);  // false where any is NaN
    }
}

struct run_record {
  std::vector<float> losses;  // the mean over ranks, per step
  std::vector<float> params;  // after the last step, in the model's order
  std::size_t trained = 0, moved = 0;  // host_run: elements with requires_grad, and those the steps changed
};

constexpr int steps = 4;
constexpr double lr = 1e-3;

// Parameters after training, but the key projection's bias of GPT-2 (the
// middle third of c_attn.bias): softmax ignores a constant added to a row of
// scores, so its gradient is zero but for rounding noise, which AdamW turns into
// steps whose sign differs between any two implementations.
template <class Sharded>
std::vector<float> compared_parameters(Sharded& sharded) {
  std::vector<float> v;
  for (auto& [name, value] : sharded.full_state_dict(false)) {
    const auto x = value.span();
    if (name.ends_with("attn.c_attn.bias")) {
      const std::size_t e = x.size() / 3;
      v.insert(v.end(), x.begin(), x.begin() + e);
      v.insert(v.end(), x.begin() + 2 * e, x.end());
    } else {
      v.insert(v.end(), x.begin(), x.end());
    }
  }
  return v;
}

sl::optim::AdamW::options_type adamw_options() { return {.lr = lr, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.1}; }

// The whole global batch on one host rank, unsharded: what W ranks of per_rank
// rows each step together (every row has the same number of counted targets,
// so the mean of the ranks' means is the global mean).
// `lora`: adapters (r 4, alpha 8) on the Linears it names, the rest frozen (nn::add_lora).
template <class Config>
run_record host_run(const Config& config, int world, const std::vector<std::string>& lora = {}) {
  using model_t = typename family<Config>::template model<float, sl::host_space>;
  run_record t;
  sl::comm::launch(1, [&](sl::comm::ThreadComm& c) {
    model_t model(config);
    if (!lora.empty()) sl::nn::add_lora(model, lora, {.r = 4, .alpha = 8});
    model.parameters([&](std::string_view, auto& p) { t.trained += p.requires_grad ? p.numel() : 0; });
    auto sharded = shard::fully_shard<sl::optim::AdamW>(model, c, shard::NoShard{}, {.seed = seed});
    const std::vector<float> initial = compared_parameters(sharded);
    sl::optim::AdamW adamw{adamw_options()};
    for (int s = 0; s < steps; ++s) {
      const auto ids = tokens(std::int64_t(s) * world * per_rank, world * per_rank, config.vocab_size);
      t.losses.push_back(sharded.train_step(adamw, ids, models::causal_lm_targets(ids), sl::nn::cross_entropy));
    }
    t.params = compared_parameters(sharded);
    for (std::size_t i = 0; i < initial.size(); ++i) t.moved += t.params[i] != initial[i];
  });
  return t;
}

// bf16 compute over fp32 masters, reduced in fp32; fp32 as it is.
template <class T>
shard::mixed_precision compute_precision() {
  if constexpr (std::is_same_v<T, float>) return {};
  else return {.param = sl::dtype_of<T>, .reduce = sl::dtype::f32};
}

// W ranks as threads on GPU 0, each block a unit, FullShard over
// device_thread_comm (rank-ordered reductions, as ThreadComm's), the device AdamW;
// `checkpointed`: each block's activations recomputed in its backward.
template <class T, class Config>
run_record device_run(const Config& config, int world, bool checkpointed = false,
                      const std::vector<std::string>& lora = {}) {
  using model_t = typename family<Config>::template model<T, sl::cuda_space>;
  std::vector<run_record> out(static_cast<std::size_t>(world));
  sl::comm::launch(world, [&](sl::comm::ThreadComm& host) {
    sl::cuda::check(cudaSetDevice(0), "cudaSetDevice(0)");
    sl::cuda::stream stream(0);
    sl::cuda::stream_scope scope(stream.get());
    auto c = device_thread_comm(host);
    model_t model(config);
    if (!lora.empty()) sl::nn::add_lora(model, lora, {.r = 4, .alpha = 8});
    shard::options o{.wrap = shard::wrap_types<typename model_t::block_type>{},
                     .seed = seed,
                     .precision = compute_precision<T>()};
    if (checkpointed) o.checkpoint = shard::wrap_types<typename model_t::block_type>{};
    auto sharded = shard::fully_shard<sl::optim::cuda::AdamW>(model, c, shard::FullShard{}, o);
    sl::optim::cuda::AdamW adamw{adamw_options()};
    run_record t;
    for (int s = 0; s < steps; ++s) {
      const auto ids = tokens((std::int64_t(s) * world + host.rank()) * per_rank, per_rank, config.vocab_size);
      const float loss = sharded.train_step(adamw, sl::cuda::to_device(ids),
                                            sl::cuda::to_device(models::causal_lm_targets(ids)), sl::nn::cross_entropy);
      t.losses.push_back(loss);  // the global mean (step_options' default)
    }
    t.params = compared_parameters(sharded);
    out[std::size_t(host.rank())] = t;
  });
  return out[0];
}

// Losses relative to themselves.
double worst_loss(const run_record& got, const run_record& want) {
  test_support::max_error w;
  w.relative(got.losses, want.losses, 0.0);
  return w.value();
}
// Parameters relative to max(|p|, lr): AdamW moves every parameter by about lr
// whatever its gradient's scale.
double worst_parameter(const run_record& got, const run_record& want) {
  test_support::max_error w;
  w.relative(got.params, want.params, lr);
  return w.value();
}

}  // namespace

TEST_CASE("GPT-2 on the device: logits and every gradient equal the host's (fp32, with and without key padding)",
          "[cuda][decoder][gpt2]") {
  if (!have_device()) return;
  check_logits_and_gradients(gpt2_tiny);
  check_logits_and_gradients(gpt2_tiny, true);
}

TEST_CASE("LLaMA on the device (GQA, RoPE): logits and every gradient equal the host's (fp32, key padding too)",
          "[cuda][decoder][llama]") {
  if (!have_device()) return;
  check_logits_and_gradients(llama_tiny);
  check_logits_and_gradients(llama_tiny, true);
}

// fp32 on both sides; the differences are summation orders (~1e-6 relative per
// operation). After 4 AdamW steps of lr 1e-3 the losses stay within 1e-4 and the
// parameters within 1e-5 of the host's in the 2-norm (the device code on the CPU
// emulator, tests/emulated: 1.1e-7 and 2.7e-7), but not every element: where a
// gradient element is a sum that nearly cancels, its rounding is a large part of
// it, and AdamW's normalised step passes that on (there three elements moved by
// 8e-4 and 9e-4 of max(|p|, lr)). Elements are held to 1e-2 of max(|p|, lr); a
// tensor left unsharded-wrong or unupdated shows in the 2-norm.
TEST_CASE("GPT-2 and LLaMA train under FullShard on two device ranks as unsharded on the host (fp32, AdamW)",
          "[cuda][decoder][training]") {
  if (!have_device()) return;
  {
    const run_record want = host_run(gpt2_tiny, 2), got = device_run<float>(gpt2_tiny, 2);
    INFO("GPT-2: losses " << worst_loss(got, want) << ", parameters " << worst_parameter(got, want)
                          << ", in the 2-norm " << test_support::relative_norm_error(got.params, want.params));
    CHECK(worst_loss(got, want) <= 1e-4);
    CHECK(worst_parameter(got, want) <= 1e-2);
    CHECK(test_support::relative_norm_error(got.params, want.params) <= 1e-5);
  }
  {
    const run_record want = host_run(llama_tiny, 2), got = device_run<float>(llama_tiny, 2);
    INFO("LLaMA: losses " << worst_loss(got, want) << ", parameters " << worst_parameter(got, want)
                          << ", in the 2-norm " << test_support::relative_norm_error(got.params, want.params));
    CHECK(worst_loss(got, want) <= 1e-4);
    CHECK(worst_parameter(got, want) <= 1e-2);
    CHECK(test_support::relative_norm_error(got.params, want.params) <= 1e-5);
  }
}

// LoRA (nn::add_lora) on the device as on the host, within the bounds above: on the host
// every adapter element moves and nothing else (GPT-2's c_fc on the device without its
// fused GELU).
TEST_CASE("GPT-2 and LLaMA with LoRA adapters train under FullShard on two device ranks as on the host (fp32)",
          "[cuda][decoder][training][lora]") {
  if (!have_device()) return;
  const auto check = [](const auto& config, const std::vector<std::string>& targets) {
    const run_record want = host_run(config, 2, targets), got = device_run<float>(config, 2, false, targets);
    INFO(targets.front() << ": losses " << worst_loss(got, want) << ", parameters " << worst_parameter(got, want));
    CHECK(worst_loss(got, want) <= 1e-4);
    CHECK(worst_parameter(got, want) <= 1e-2);
    CHECK(test_support::relative_norm_error(got.params, want.params) <= 1e-5);
    CHECK(want.moved == want.trained);  // every adapter element stepped, nothing else
    CHECK(want.trained < want.params.size() / 5);
  };
  check(gpt2_tiny, {"c_attn", "c_fc"});
  check(llama_tiny, {"q_proj", "v_proj", "down_proj"});
}

// Activation checkpointing: each block's first forward keeps nothing (gradients disabled,
// the path eval mode takes too) and its backward runs the forward again. The same kernels
// on the same values: the same losses and parameters, bit for bit.
TEST_CASE("GPT-2 and LLaMA with every block checkpointed train on the device as without", "[cuda][decoder][training]") {
  if (!have_device()) return;
  for (int which = 0; which < 2; ++which) {
    INFO((which == 0 ? "GPT-2" : "LLaMA"));
    const run_record want = which == 0 ? device_run<float>(gpt2_tiny, 2) : device_run<float>(llama_tiny, 2);
    const run_record got = which == 0 ? device_run<float>(gpt2_tiny, 2, true) : device_run<float>(llama_tiny, 2, true);
    CHECK(got.losses == want.losses);  // a NaN never compares equal
    CHECK(got.params == want.params);
  }
}

// bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 2e-3 per value); the
// loss, a mean over many tokens, stays within 2e-2 of fp32's over the steps.
TEST_CASE("GPT-2 and LLaMA in bf16 compute over fp32 masters train as in fp32 within 2e-2 (loss)",
          "[cuda][decoder][bf16]") {
  if (!have_device()) return;
  for (int which = 0; which < 2; ++which) {
    const run_record want = which == 0 ? device_run<float>(gpt2_tiny, 1) : device_run<float>(llama_tiny, 1);
    const run_record got =
        which == 0 ? device_run<sl::bfloat16>(gpt2_tiny, 1) : device_run<sl::bfloat16>(llama_tiny, 1);
    test_support::max_error w;
    w.relative(got.losses, want.losses, 0.0);
    INFO((which == 0 ? "GPT-2" : "LLaMA") << ": worst relative loss difference " << w.value());
    CHECK(w.value() <= 2e-2);
  }
}

// The KV cache on the device: a prompt of 5, then one token at a time, against the
// host model's cached forwards (every position's logits) and against the device's
// own full forward over the sequence so far (the last position's), with and without
// left padding (a key padding mask over every cached key, and position ids that
// start each row at 0). Then models::generate on the device model, with and without
// the cache, and with the padding as an attention mask. fp32; the tolerance as above.
template <class Config>
void check_cached_steps(const Config& config, bool padded) {
  using host_model = typename family<Config>::template model<float, sl::host_space>;
  using device_model = typename family<Config>::template model<float, sl::cuda_space>;
  INFO(family<Config>::name() << (padded ? " with key padding" : ""));
  host_model hm(config);
  sl::nn::Replicated<float, host_model> host(hm, seed);
  sl::cuda::stream stream(0);
  sl::cuda::stream_scope scope(stream.get());
  const std::span<const float> values(host.values());
  bound_model<device_model> cached(config, values), full(config, values);
  const auto ids = tokens(0, 2, config.vocab_size);
  constexpr std::int64_t prompt_len = 5, singles = 4;
  const auto padding = [&](std::int64_t keys) {  // row 1 starts with 2 padding positions
    sl::Tensor<std::uint8_t> m({2, keys});
    for (std::int64_t j = 0; j < keys; ++j) m[j] = 0, m[keys + j] = j < 2 ? 1 : 0;
    return m;
  };
  const auto positions = [&](std::int64_t first, std::int64_t len) {  // row 1's tokens count from its third
    sl::Tensor<std::int64_t> p({2, len});
    for (std::int64_t j = 0; j < len; ++j) p[j] = first + j, p[len + j] = std::max<std::int64_t>(first + j - 2, 0);
    return p;
  };
  hm.enable_kv_cache(seq);
  cached.model.enable_kv_cache(seq);
  sl::nn::context hctx({.training = false}), dctx({.training = false}), fctx({.training = false});
  for (std::int64_t done = 0; done < prompt_len + singles;) {
    const std::int64_t len = done == 0 ? prompt_len : 1;
    INFO("positions " << done << ".." << done + len - 1);
    if (padded) {
      for (auto* c : {&hctx, &dctx, &fctx}) c->set_key_padding_mask(padding(done + len));
      hctx.set_position_ids(positions(done, len));
      dctx.set_position_ids(positions(done, len));
      fctx.set_position_ids(positions(0, done + len));
    }
    const auto want = hctx.forward(hm, columns(ids, done, len));
    const auto got = dctx.forward(cached.model, sl::cuda::to_device(columns(ids, done, len)));
    REQUIRE(got.shape() == want.shape());
    CHECK(worst_relative(host_copy(got), std::vector<float>(want.span().begin(), want.span().end()), 1e-2) <= 1e-4);
    const auto whole = fctx.forward(full.model, sl::cuda::to_device(columns(ids, 0, done + len)));
    CHECK(worst_relative(last_position(got), last_position(whole), 1e-2) <= 1e-4);
    // logits_to_keep 1 (as generate's forwards): the head's product over the last position alone.
    fctx.set_logits_to_keep(1);
    const auto x = sl::cuda::to_device(columns(ids, 0, done + len));
    auto& dm = full.model;
    const auto last = fctx.no_grad([&fctx, &dm, &x] { return fctx.forward(dm, x); });
    fctx.set_logits_to_keep(0);
    REQUIRE(last.shape() == sl::Shape{2, 1, config.vocab_size});
    CHECK(worst_relative(host_copy(last), last_position(whole), 1e-2) <= 1e-6);
    done += len;
  }
  hm.disable_kv_cache();
  cached.model.disable_kv_cache();
  const auto prompt = columns(ids, 0, prompt_len);
  sl::Tensor<std::int64_t> mask({2, prompt_len});
  for (std::int64_t i = 0; i < mask.numel(); ++i) mask[i] = padding(prompt_len)[i] ? 0 : 1;
  for (const bool use_cache : {true, false}) {
    INFO("generate, " << (use_cache ? "with" : "without") << " the cache");
    const auto got = models::generate(cached.model, prompt,
                                      {.max_new_tokens = 7, .use_cache = use_cache,
                                       .attention_mask = padded ? mask : sl::Tensor<std::int64_t>{}});
    REQUIRE(got.shape() == sl::Shape{2, prompt_len + 7});
    if (!padded) {
      check_tokens_are_hosts_choice(hm, got, prompt_len, 1e-4);
      continue;
    }
    // Each row's tokens without its padding are those the host picks for the row alone.
    for (std::int64_t n = 0; n < 2; ++n) {
      const std::int64_t pad = n == 1 ? 2 : 0;
      sl::Tensor<std::int64_t> row({1, prompt_len + 7 - pad});
      for (std::int64_t t = pad; t < prompt_len + 7; ++t) row[t - pad] = got[n * (prompt_len + 7) + t];
      check_tokens_are_hosts_choice(hm, row, prompt_len - pad, 1e-4);
    }
  }
}

TEST_CASE("GPT-2 and LLaMA on the device: the KV cache's logits equal the host's and a full forward's, and generate "
          "picks the host's tokens",
          "[cuda][decoder][generate]") {
  if (!have_device()) return;
  for (const bool padded : {false, true}) {
    check_cached_steps(gpt2_tiny, padded);
    check_cached_steps(llama_tiny, padded);
  }
}

// A sharded device model (FullShard on two ranks, each block a unit) in eval: the
// last position's logits with the cache, step by step, against full forwards
// without it (fp32 1e-4; bf16 compute 2e-2, its rounding as above), and
// models::generate over the ranks, whose tokens the host model would pick (fp32).
template <class T, class Config>
void check_sharded_generation(const Config& config) {
  using model_t = typename family<Config>::template model<T, sl::cuda_space>;
  using host_model = typename family<Config>::template model<float, sl::host_space>;
  INFO(family<Config>::name() << (std::is_same_v<T, float> ? ", fp32" : ", bf16 compute"));
  constexpr std::int64_t prompt_len = 4, total = 9;
  const auto ids = tokens(3, 2, config.vocab_size);
  std::vector<double> errors(2);
  std::vector<std::vector<std::int64_t>> generated(2);  // values: a rank's tensors must not outlive launch
  sl::comm::launch(2, [&](sl::comm::ThreadComm& host) {
    sl::cuda::check(cudaSetDevice(0), "cudaSetDevice(0)");
    sl::cuda::stream stream(0);
    sl::cuda::stream_scope scope(stream.get());
    auto c = device_thread_comm(host);
    model_t model(config);
    auto sharded = shard::fully_shard<sl::optim::cuda::AdamW>(
        model, c, shard::FullShard{},
        {.wrap = shard::wrap_types<typename model_t::block_type>{}, .seed = seed, .precision = compute_precision<T>()});
    sharded.eval();
    std::vector<std::vector<float>> want;
    for (std::int64_t end = prompt_len; end <= total; ++end)
      want.push_back(last_position(sharded.forward(sl::cuda::to_device(columns(ids, 0, end)))));
    model.enable_kv_cache(total);
    test_support::max_error e;
    for (std::int64_t end = prompt_len; end <= total; ++end) {
      const std::int64_t first = end == prompt_len ? 0 : end - 1;
      const auto got = sharded.forward(sl::cuda::to_device(columns(ids, first, end - first)));
      e.relative(last_position(got), want[std::size_t(end - prompt_len)], 1e-2);
    }
    model.disable_kv_cache();
    errors[std::size_t(host.rank())] = e.value();
    const auto out = models::generate(sharded, columns(ids, 0, prompt_len), {.max_new_tokens = 6});
    generated[std::size_t(host.rank())].assign(out.span().begin(), out.span().end());
  });
  for (int r = 0; r < 2; ++r) {  // Catch's assertions here, not on the rank threads
    INFO("rank " << r);
    CHECK(errors[std::size_t(r)] <= (std::is_same_v<T, float> ? 1e-4 : 2e-2));
    REQUIRE(generated[std::size_t(r)].size() == std::size_t(2 * (prompt_len + 6)));
  }
  CHECK(generated[0] == generated[1]);  // generate checks that they agree, and raises if not
  if constexpr (std::is_same_v<T, float>) {
    host_model hm(config);
    sl::nn::Replicated<float, host_model> host(hm, seed);  // the engine's seeded values
    sl::Tensor<std::int64_t> tokens_got({2, prompt_len + 6});
    std::copy(generated[0].begin(), generated[0].end(), tokens_got.data());
    check_tokens_are_hosts_choice(hm, tokens_got, prompt_len, 1e-4);
  }
}

TEST_CASE("GPT-2 and LLaMA sharded on two device ranks generate with the KV cache as full forwards do (fp32, bf16)",
          "[cuda][decoder][generate]") {
  if (!have_device()) return;
  check_sharded_generation<float>(gpt2_tiny);
  check_sharded_generation<float>(llama_tiny);
  check_sharded_generation<sl::bfloat16>(gpt2_tiny);
  check_sharded_generation<sl::bfloat16>(llama_tiny);
}

// What the device layers refuse, with the layer's name in the message: attention
// masks; the KV cache in training, past its capacity, for another batch, and in backward.
TEST_CASE("device decoder attention refuses attention masks and misuse of the KV cache, naming the layer",
          "[cuda][decoder][errors]") {
  if (!have_device()) return;
  sl::cuda::stream stream(0);
  sl::cuda::stream_scope scope(stream.get());
  models::GPT2LMHeadModel<float, sl::cuda_space> model(gpt2_tiny);
  const sl::nn::flat_layout layout = sl::nn::flatten<float>(model);
  sl::Buffer<float, sl::cuda_space> values(layout.numel, sl::category::parameters),
      grads(layout.numel, sl::category::gradients);
  sl::cuda::fill_bytes_async(values.span(), 0, stream.get());
  sl::nn::bind<float>(model, layout, values.data(), grads.data());
  const auto ids = sl::cuda::to_device(tokens(0, 1, gpt2_tiny.vocab_size));
  sl::nn::context masked({.training = false});
  masked.set_attention_mask(sl::Tensor<std::uint8_t>({seq, seq}));
  CHECK_THAT(test_support::raised([&] { masked.forward(model, ids); }),
             Catch::Contains("GPT2Attention") && Catch::Contains("attention mask"));

  model.enable_kv_cache(seq + 2);
  sl::nn::context training, inference({.training = false});
  CHECK_THAT(test_support::raised([&] { training.forward(model, ids); }),
             Catch::Contains("GPT2Attention") && Catch::Contains("KV cache is for inference"));
  const auto logits = inference.forward(model, ids);
  CHECK_THAT(test_support::raised([&] { inference.backward(model, sl::cuda::to_device(sl::Tensor<float>(logits.shape()))); }),
             Catch::Contains("GPT2Attention") && Catch::Contains("backward with the KV cache on"));
  CHECK_THAT(test_support::raised([&] { inference.forward(model, sl::cuda::to_device(columns(tokens(0, 2, gpt2_tiny.vocab_size), 0, 1))); }),
             Catch::Contains("GPT2Attention") && Catch::Contains("reset_kv_cache() before a new batch"));
  const auto three = sl::cuda::to_device(columns(tokens(0, 1, gpt2_tiny.vocab_size), 0, 3));
  CHECK_THAT(test_support::raised([&] { inference.forward(model, three); }),
             Catch::Contains("GPT2Attention") && Catch::Contains("holds 14 positions (max_seq); 12 cached + 3 new exceed it"));
  model.disable_kv_cache();
  CHECK(inference.forward(model, three).shape() == sl::Shape{1, 3, gpt2_tiny.vocab_size});

  // A forward whose attention fails after appending to the cache (here the fused
  // kernels refusing head_dim 264) leaves the cache as it was, as the host's does.
  sl::nn::GPT2Attention<float, sl::cuda_space> wide({.n_embd = 264, .n_head = 1});
  const sl::nn::flat_layout wide_layout = sl::nn::flatten<float>(wide);
  sl::Buffer<float, sl::cuda_space> wide_values(wide_layout.numel, sl::category::parameters);
  sl::cuda::fill_bytes_async(wide_values.span(), 0, stream.get());
  sl::nn::bind<float>(wide, wide_layout, wide_values.data(), nullptr);
  wide.enable_kv_cache(4);
  CHECK_THAT(test_support::raised([&] { inference.forward(wide, sl::cuda::to_device(sl::Tensor<float>::zeros({1, 2, 264}))); }),
             Catch::Contains("head_dim must be in [1, 256], got 264"));
  CHECK(wide.kv_cache_length() == 0);

  // generate reads the Embedding's check of its ids with the first logits: a prompt
  // id out of range raises the layer's error there, and no check is left unread.
  auto prompt = columns(tokens(0, 2, gpt2_tiny.vocab_size), 0, 3);
  prompt[4] = gpt2_tiny.vocab_size + 1;
  (void)sl::ops::cuda::deferred_index_reports().take();  // the forwards' above
  CHECK_THROWS_WITH(models::generate(model, prompt, {.max_new_tokens = 2}),
                    Catch::Contains("Embedding(64, 32): id 65 at position [1, 1] of the input [2, 3] is out of range"));
  CHECK(sl::ops::cuda::deferred_index_reports().size() == 0);
  prompt[4] = 0;
  CHECK(models::generate(model, prompt, {.max_new_tokens = 2}).shape() == sl::Shape{2, 5});
  CHECK(sl::ops::cuda::deferred_index_reports().size() == 0);
}

}  // namespace test_cuda_decoder
