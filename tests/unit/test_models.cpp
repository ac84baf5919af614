// The reference decoder language models (models/gpt2.hpp, models/llama.hpp):
// Hugging Face's parameter names, its checkpoints (tests/golden/hf, written by
// transformers: same logits, same losses over 20 AdamW steps, unsharded and
// sharded), save -> load round trips, generation with and without the KV cache.
#include <shardlib/comm/launch.hpp>
#include <shardlib/core/ledger.hpp>
#include <shardlib/io/safetensors.hpp>
#include <shardlib/models/gpt2.hpp>
#include <shardlib/models/hf.hpp>
#include <shardlib/models/llama.hpp>
#include <shardlib/models/llmc.hpp>
#include <shardlib/models/peft.hpp>
#include <shardlib/models/sharded_generate.hpp>
#include <shardlib/nn/lora.hpp>
#include <shardlib/nn/replicated.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/param_groups.hpp>
#include <shardlib/plan/describe.hpp>
#include <shardlib/plan/memory_plan.hpp>
#include <shardlib/shard/sharded_model.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/text_corpus.hpp"  // examples/: the language-model examples' data
#include "support/checkpoint_files.hpp"
#include "support/compare.hpp"
#include "support/parameter_names.hpp"
#include "support/golden.hpp"
#include "support/shard_fixture.hpp"

namespace test_models {

using namespace shardlib;
namespace fs = std::filesystem;
using fixture_sgd = fixture::sgd;

namespace {

const fs::path hf_dir = fs::path(SHARDLIB_GOLDEN_DIR) / "hf";

template <class M>
constexpr const char* golden_name = std::is_same_v<typename M::config_type, models::gpt2_config> ? "gpt2" : "llama";

// `json` written to `file`, then read by read_hf_config as a Config.
template <class Config>
Config config_from(const fs::path& file, const std::string& json) {
  std::FILE* f = std::fopen(file.c_str(), "w");
  REQUIRE(f);
  std::fputs(json.c_str(), f);
  std::fclose(f);
  return models::read_hf_config<Config>(file);
}

// The model make_hf_goldens.py built, from the config.json transformers wrote.
template <class M>
M golden_model() {
  return M(models::read_hf_config<typename M::config_type>(hf_dir / golden_name<M> / "initial"));
}

// What make_hf_goldens.py computed with transformers in float64 (see its docstring).
// transformers 4.40's LlamaForCausalLM returns logits.float(): LLaMA's logits and
// loss are float32 roundings of float64 results, GPT-2's float64.
struct hf_expected {
  Tensor<std::int64_t> ids, targets;  // targets: the labels shifted as Hugging Face's loss shifts them
  Tensor<double> logits;              // [2, 8, 96] of the initial model
  std::vector<double> losses;         // losses[k] after k AdamW steps on this batch
  double precision = 0;               // the relative rounding of logits and losses in the file
};
// The file's logits, float32 or float64, as float64.
Tensor<double> logits_of(const io::safetensors& f) {
  Tensor<double> t(f.info("logits").shape);
  const auto copy = [&](const auto& v) { std::copy(v.begin(), v.end(), t.data()); };
  if (f.info("logits").type == dtype::f32) copy(f.template get<float>("logits"));
  else copy(f.template get<double>("logits"));
  return t;
}
template <class M>
hf_expected expected() {
  const auto f = io::safetensors::load(hf_dir / golden_name<M> / "expected.safetensors");
  hf_expected e{golden::read<std::int64_t>(f, "input_ids"),
                models::causal_lm_targets(golden::read<std::int64_t>(f, "labels")), {}, {}, 0};
  e.logits = logits_of(f);
  e.precision = f.info("logits").type == dtype::f32 ? 0x1p-24 : 0x1p-53;
  e.losses = f.template get<double>("losses");
  return e;
}
// The step transformers took: torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).
optim::AdamW golden_adamw() { return {{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01}}; }

// Rows [first, first + count) of a [batch, ...] tensor.
template <class E>
Tensor<E> rows(const Tensor<E>& t, std::int64_t first, std::int64_t count) {
  Shape s = t.shape();
  s[0] = count;
  Tensor<E> r(s);
  const std::int64_t row = t.numel() / t.dim(0);
  std::copy_n(t.data() + first * row, count * row, r.data());
  return r;
}

// want.size() - 1 AdamW steps of an nn::Replicated owner's model on one batch (frozen parameters
// not stepped: optim::step_unfrozen), the loss before each step and after the last
// compared with want[k], relative.
template <class Model>
test_support::max_error train_unsharded(Model& model, nn::Replicated<float, Model>& owner,
                                        const Tensor<std::int64_t>& ids, const Tensor<std::int64_t>& targets,
                                        const std::vector<double>& want, const optim::AdamW& adamw) {
  const std::size_t n = owner.values().size();
  const auto runs = optim::cut_frozen({{0, n, 0}}, owner.layout(), 0, n);
  auto state = adamw.make_state(optim::trained_size(runs));
  nn::context ctx;
  test_support::max_error err;
  for (std::size_t k = 0; k < want.size(); ++k) {
    owner.zero_grad();
    auto l = nn::cross_entropy(ctx.forward(model, ids), targets);
    err.relative(double(l.loss), want[k], 0);
    if (k + 1 == want.size()) break;
    ctx.backward(model, l.grad);
    optim::step_unfrozen(adamw, owner.values(), std::span<const float>(owner.grads()), state, runs);
  }
  return err;
}

// One training step of a sharded model on this rank's batch; its loss (this rank's mean).
template <class Sharded, class Opt>
double train_step(Sharded& sharded, Opt& opt, const Tensor<std::int64_t>& x, const Tensor<std::int64_t>& y) {
  sharded.zero_grad();
  auto l = nn::cross_entropy(sharded.forward(x), y);
  sharded.backward(l.grad);
  sharded.step(opt);
  return double(l.loss);
}

// The largest difference of logits from transformers', relative to the largest
// logit (the scale of the softmax's input: an error that small changes no
// probability by more than it).
template <class T>
test_support::max_error logits_error(const Tensor<T>& ours, const Tensor<double>& want, std::int64_t first_row = 0) {
  double scale = 0;
  for (double v : want.span()) scale = test_support::max_keeping_nan(scale, std::abs(v));
  const std::int64_t row = want.numel() / want.dim(0), n = ours.numel();
  test_support::max_error e;
  for (std::int64_t i = 0; i < n; ++i) e.relative(double(ours[i]), want[first_row * row + i], scale);
  return e;
}

using test_support::parameter_names;

// The tensor names of every safetensors file in a directory.
std::set<std::string> file_names(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().extension() == ".safetensors") {
      const auto file = io::safetensors::load(f.path());
      for (const auto& t : file.tensors()) names.insert(t.name);
    }
  return names;
}

Tensor<std::int64_t> tokens(std::int64_t batch, std::int64_t seq, std::int64_t vocab, std::uint64_t seed) {
  Tensor<std::int64_t> t({batch, seq});
  const counter_rng rng(seed, 1);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = std::int64_t(rng.uniform_double(std::uint64_t(i)) * double(vocab));
  return t;
}

}  // namespace

TEST_CASE("GPT-2 and LLaMA carry Hugging Face's parameter names", "[models]") {
  auto gpt2 = golden_model<models::GPT2LMHeadModel<float>>();
  const auto g = parameter_names(gpt2);
  // Hugging Face's state-dict order; the file leaves out lm_head.weight (tied to wte).
  CHECK(g.front() == "transformer.wte.weight");
  CHECK(g[1] == "transformer.wpe.weight");
  CHECK(g[2] == "transformer.h.0.ln_1.weight");
  CHECK(g.back() == "lm_head.weight");
  std::set<std::string> gs(g.begin(), g.end());
  gs.erase("lm_head.weight");
  CHECK(gs == file_names(hf_dir / "gpt2" / "initial"));
  CHECK(g.size() == gs.size() + 1);

  auto llama = golden_model<models::LlamaForCausalLM<float>>();
  const auto l = parameter_names(llama);
  CHECK(l.front() == "model.embed_tokens.weight");
  CHECK(l[1] == "model.layers.0.self_attn.q_proj.weight");
  CHECK(l.back() == "lm_head.weight");
  CHECK(std::set<std::string>(l.begin(), l.end()) == file_names(hf_dir / "llama" / "initial"));
  CHECK(std::set<std::string>(l.begin(), l.end()).size() == l.size());
}

// The special tokens config.json names for transformers' generate: kept, so that a model
// saved again stops where it did (Llama 3.1's instruct models end at any of three ids).
// Absent, the config class's default (GPT2Config 50256, LlamaConfig 1 and 2); null, none.
TEST_CASE("config.json's token ids are read and written back", "[models][hf]") {
  const fs::path file = fs::temp_directory_path() / cat("shardlib_test_tokens_", ::getpid(), ".json");
  const auto read = [&]<class Config>(const std::string& json, Config) { return config_from<Config>(file, json); };
  const auto l3 = read(R"({"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "pad_token_id": null})",
                       models::llama_config{});
  CHECK(l3.tokens.bos == 128000);
  CHECK(l3.tokens.eos == std::vector<std::int64_t>{128001, 128008, 128009});
  CHECK_FALSE(l3.tokens.pad);
  const auto j = models::hf_config_json(l3);
  CHECK(j["bos_token_id"] == 128000);
  CHECK(j["eos_token_id"] == nlohmann::json::array({128001, 128008, 128009}));
  CHECK(j["pad_token_id"].is_null());
  const auto none = read(R"({"bos_token_id": null, "eos_token_id": null, "pad_token_id": 7})", models::gpt2_config{});
  CHECK((!none.tokens.bos && none.tokens.eos.empty() && none.tokens.pad == 7));
  CHECK(models::hf_config_json(none)["eos_token_id"].is_null());
  const auto defaults = read("{}", models::gpt2_config{});
  CHECK((defaults.tokens.bos == 50256 && defaults.tokens.eos == std::vector<std::int64_t>{50256}));
  CHECK(models::hf_config_json(defaults)["eos_token_id"] == 50256);
  CHECK((models::llama_config{}.tokens.bos == 1 && models::llama_config{}.tokens.eos == std::vector<std::int64_t>{2}));
  CHECK_THROWS_WITH(read(R"({"eos_token_id": [2, "3"]})", models::llama_config{}),
                    Catch::Contains("llama_config: eos_token_id must be a token id (an integer) or null, got \"3\""));
  CHECK_THROWS_WITH(read(R"({"bos_token_id": 1.5})", models::gpt2_config{}),
                    Catch::Contains("gpt2_config: bos_token_id must be a token id (an integer) or null, got 1.5"));
  fs::remove(file);
}

// config.json's fields that change the numbers are read (LLaMA's head_dim and
// attention_dropout) or refused (GPT-2's other attention scalings), never dropped.
TEST_CASE("config.json fields that change the model are read or refused", "[models][hf]") {
  const fs::path file = fs::temp_directory_path() / cat("shardlib_test_config_", ::getpid(), ".json");
  const auto read = [&]<class Config>(const std::string& json, Config) { return config_from<Config>(file, json); };
  const auto llama = read(R"({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "head_dim": 16, "attention_dropout": 0.25, "vocab_size": 50,
                              "intermediate_size": 64, "num_hidden_layers": 1})",
                          models::llama_config{});
  CHECK(llama.head_dim == 16);
  CHECK(llama.attention_dropout == 0.25);
  CHECK(llama.max_position_embeddings == 2048);  // transformers' default when the file has none
  CHECK(models::hf_config_json(llama)["head_dim"] == 16);
  CHECK(models::hf_config_json(llama)["attention_dropout"] == 0.25);
  models::LlamaForCausalLM<float> m(llama);
  std::map<std::string, Shape> shapes;
  m.parameters([&](std::string_view name, auto& p) { shapes[std::string(name)] = p.shape; });
  CHECK(shapes.at("model.layers.0.self_attn.q_proj.weight") == Shape{64, 32});  // 4 heads of 16
  CHECK(shapes.at("model.layers.0.self_attn.k_proj.weight") == Shape{32, 32});  // 2 kv heads of 16
  CHECK(shapes.at("model.layers.0.self_attn.o_proj.weight") == Shape{32, 64});

  CHECK_THROWS_WITH(read(R"({"scale_attn_weights": false})", models::gpt2_config{}),
                    Catch::Contains("scale_attn_weights false (unscaled scores) is not supported"));
  CHECK_THROWS_WITH(read(R"({"scale_attn_by_inverse_layer_idx": true})", models::gpt2_config{}),
                    Catch::Contains("scale_attn_by_inverse_layer_idx true"));
  CHECK_NOTHROW(read(R"({"scale_attn_weights": true, "scale_attn_by_inverse_layer_idx": false})",
                     models::gpt2_config{}));

  // rope_scaling: linear and llama3 read (rope_type, or the older type), written back as
  // read; "default" is none; other kinds and missing fields refused.
  using kind = nn::rope_scaling::kind;
  const auto l3 = read(R"({"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})",
                       models::llama_config{});
  CHECK(l3.rope_scaling.type == kind::llama3);
  CHECK(l3.rope_scaling.factor == 32);
  CHECK(l3.rope_scaling.low_freq_factor == 1);
  CHECK(l3.rope_scaling.high_freq_factor == 4);
  CHECK(l3.rope_scaling.original_max_position_embeddings == 8192);
  const auto back = read(models::hf_config_json(l3).dump(), models::llama_config{});
  CHECK(back.rope_scaling.type == kind::llama3);
  CHECK(back.rope_scaling.factor == 32);
  CHECK(back.rope_scaling.original_max_position_embeddings == 8192);
  const auto lin = read(R"({"rope_scaling": {"type": "linear", "factor": 2.0}})", models::llama_config{});
  CHECK(lin.rope_scaling.type == kind::linear);
  CHECK(lin.rope_scaling.factor == 2);
  CHECK(models::hf_config_json(lin)["rope_scaling"]["rope_type"] == "linear");
  CHECK(read(R"({"rope_scaling": {"rope_type": "default"}})", models::llama_config{}).rope_scaling.type == kind::none);
  CHECK(read(R"({"rope_scaling": null})", models::llama_config{}).rope_scaling.type == kind::none);
  CHECK(models::hf_config_json(models::llama_config{})["rope_scaling"].is_null());
  CHECK_THROWS_WITH(read(R"({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})", models::llama_config{}),
                    Catch::Contains("rope_type 'dynamic' is not supported (linear and llama3 are"));
  CHECK_THROWS_WITH(read(R"({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0}})",
                         models::llama_config{}),
                    Catch::Contains("llama3 scaling needs a number 'original_max_position_embeddings'"));
  CHECK_THROWS_WITH(read(R"({"rope_scaling": {"rope_type": "linear", "factor": 0}})", models::llama_config{}),
                    Catch::Contains("rope_scaling factor must be positive, got 0"));
  CHECK(read(R"({"rope_scaling": {"type": "linear", "rope_type": "linear", "factor": 2.0}})", models::llama_config{})
            .rope_scaling.type == kind::linear);  // transformers 4.4x's own saves carry both, alike
  CHECK_THROWS_WITH(read(R"({"rope_scaling": {"type": "linear", "rope_type": "default", "factor": 4}})",
                         models::llama_config{}),
                    Catch::Contains("'type' and 'rope_type' differ"));
  CHECK_THROWS_WITH(read(R"({"rope_scaling": {"rope_type": null, "factor": 4}})", models::llama_config{}),
                    Catch::Contains("llama_config: rope_scaling {\"factor\":4,\"rope_type\":null}: 'rope_type' must be a string"));
  // transformers 5.x: rope_theta and the scaling in rope_parameters (rope_type "default":
  // none); where the older keys are there too they must agree.
  const auto v5 = read(R"({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}})",
                       models::llama_config{});
  CHECK(v5.rope_theta == 500000);
  CHECK(v5.rope_scaling.type == kind::llama3);
  CHECK(v5.rope_scaling.factor == 8);
  CHECK(v5.rope_scaling.original_max_position_embeddings == 8192);
  const auto plain5 = read(R"({"rope_parameters": {"rope_type": "default", "rope_theta": 250000}})",
                           models::llama_config{});
  CHECK(plain5.rope_theta == 250000);
  CHECK(plain5.rope_scaling.type == kind::none);
  CHECK(read(R"({"rope_theta": 250000, "rope_parameters": {"rope_theta": 250000}})", models::llama_config{})
            .rope_theta == 250000);
  CHECK_THROWS_WITH(read(R"({"rope_theta": 10000, "rope_parameters": {"rope_theta": 500000}})", models::llama_config{}),
                    Catch::Contains("rope_theta 10000 and rope_parameters' 500000 differ"));
  CHECK_THROWS_WITH(read(R"({"rope_scaling": {"rope_type": "linear", "factor": 2},
                             "rope_parameters": {"rope_type": "linear", "factor": 4}})",
                         models::llama_config{}),
                    Catch::Contains("rope_scaling and rope_parameters differ"));
  CHECK_THROWS_WITH(read(R"({"rope_parameters": {"rope_type": "yarn", "factor": 4}})", models::llama_config{}),
                    Catch::Contains("llama_config: rope_parameters") && Catch::Contains("'yarn' is not supported"));
  // Fields of other architectures are refused rather than dropped.
  CHECK_THROWS_WITH(read(R"({"model_type": "mistral", "sliding_window": 4096})", models::llama_config{}),
                    Catch::Contains("model_type \"mistral\" is not LLaMA"));
  CHECK_THROWS_WITH(read(R"({"sliding_window": 4096})", models::llama_config{}),
                    Catch::Contains("sliding_window 4096 is not supported"));
  CHECK_THROWS_WITH(read(R"({"model_type": "llama"})", models::gpt2_config{}),
                    Catch::Contains("gpt2_config: model_type \"llama\" is not GPT-2"));
  CHECK_NOTHROW(read(R"({"model_type": "gpt2", "activation_function": "gelu_pytorch_tanh"})", models::gpt2_config{}));
  for (const char* positions : {"8192.5", "0", "1e30", "18446744073709551615"})
    CHECK_THROWS_WITH(read(cat(R"({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                                   "high_freq_factor": 4, "original_max_position_embeddings": )", positions, "}}"),
                           models::llama_config{}),
                      Catch::Contains("original_max_position_embeddings must be a positive integer"));
  fs::remove(file);
}

// Llama 3.1's rope_scaling against transformers (tests/golden/hf/llama3_rope,
// make_rope_goldens.py: transformers 4.45 in float32). Its frequencies carry
// float32 rounding (a few 6e-8), so they agree to 1e-6 relative; its logits are
// float32 with float32 angles, so both layer types are held to 1e-5 of the largest
// logit, as float32 layers are above. Without the scaling the logits miss by far more.
TEMPLATE_TEST_CASE("LLaMA with llama3 rope_scaling gives transformers' frequencies and logits", "[models][hf][rope]",
                   double, float) {
  using T = TestType;
  const fs::path dir = hf_dir / "llama3_rope";
  const auto config = models::read_hf_config<models::llama_config>(dir);
  REQUIRE(config.rope_scaling.type == nn::rope_scaling::kind::llama3);
  CHECK(config.rope_scaling.factor == 8);
  CHECK(config.rope_scaling.original_max_position_embeddings == 64);
  const auto f = io::safetensors::load(dir / "expected.safetensors");
  const auto freq = [&](nn::rope_scaling r) { return nn::rotary_frequencies({.head_dim = 8, .base = 10000, .scaling = r}); };
  test_support::max_error l3, lin;
  l3.relative(freq(config.rope_scaling), f.template get<float>("inv_freq_llama3"), 0);
  lin.relative(freq({.type = nn::rope_scaling::kind::linear, .factor = 4}), f.template get<float>("inv_freq_linear"), 0);
  INFO("frequencies: llama3 " << l3 << ", linear " << lin);
  CHECK(l3.count() == 4);
  CHECK(l3 <= 1e-6);
  CHECK(lin <= 1e-6);

  Tensor<std::int64_t> ids = golden::read<std::int64_t>(f, "input_ids");
  Tensor<double> want(f.info("logits").shape);
  const auto v = f.template get<float>("logits");
  std::copy(v.begin(), v.end(), want.data());
  const auto logits_of = [&](const models::llama_config& c) {
    models::LlamaForCausalLM<T> model(c);
    nn::Replicated<T, models::LlamaForCausalLM<T>> owner(model, 0);
    CHECK(models::load_hf(owner, dir).ok());
    nn::context ctx({.training = false});
    return ctx.forward(model, ids);
  };
  const auto err = logits_error(logits_of(config), want);
  models::llama_config unscaled = config;
  unscaled.rope_scaling = {};
  const auto without = logits_error(logits_of(unscaled), want);
  INFO("logits differ by " << err << " of the largest; without the scaling by " << without);
  CHECK(err <= 1e-5);
  CHECK(without.value() > 1e-4);  // 2.4e-3 measured: the random model attends almost uniformly
}

// A forward past the position table raises naming the positions, as GPT-2's wpe does.
TEST_CASE("LLaMA refuses positions past max_position_embeddings", "[models]") {
  models::llama_config c{.vocab_size = 20, .hidden_size = 8, .intermediate_size = 16, .num_hidden_layers = 1,
                         .num_attention_heads = 2, .max_position_embeddings = 4};
  models::LlamaForCausalLM<double> m(c);
  nn::Replicated<double, models::LlamaForCausalLM<double>> owner(m, 1);
  nn::context ctx({.training = false});
  CHECK_THROWS_WITH(ctx.forward(m, tokens(1, 5, 20, 1)),
                    Catch::Contains("positions 0..4 (0 cached, sequence 5) exceed max_position_embeddings 4"));
  m.enable_kv_cache(4);
  CHECK_NOTHROW(ctx.forward(m, tokens(1, 3, 20, 2)));
  CHECK_THROWS_WITH(ctx.forward(m, tokens(1, 2, 20, 3)), Catch::Contains("positions 3..4 (3 cached"));
}

TEMPLATE_TEST_CASE("generation with the KV cache equals generation by full forwards", "[models][generate]",
                   models::GPT2LMHeadModel<double>, models::LlamaForCausalLM<double>) {
  using Model = TestType;
  Model model = golden_model<Model>();
  nn::Replicated<double, Model> owner(model, 5);
  const auto prompt = tokens(2, 5, 96, 3);
  const auto cached = models::generate(model, prompt, {.max_new_tokens = 12});
  const auto full = models::generate(model, prompt, {.max_new_tokens = 12, .use_cache = false});
  REQUIRE(cached.shape() == Shape{2, 17});
  CHECK(std::vector<std::int64_t>(cached.span().begin(), cached.span().end()) ==
        std::vector<std::int64_t>(full.span().begin(), full.span().end()));
  for (std::int64_t n = 0; n < 2; ++n)
    for (std::int64_t t = 0; t < 5; ++t) CHECK(cached[n * 17 + t] == prompt[n * 5 + t]);

  // top-k with k = 1 is greedy; larger k draws reproducibly from the seed, with or without the cache.
  const auto top1 = models::generate(model, prompt, {.max_new_tokens = 12, .top_k = 1, .seed = 9});
  CHECK(std::vector<std::int64_t>(top1.span().begin(), top1.span().end()) ==
        std::vector<std::int64_t>(cached.span().begin(), cached.span().end()));
  const auto a = models::generate(model, prompt, {.max_new_tokens = 12, .top_k = 8, .seed = 4});
  const auto b = models::generate(model, prompt, {.max_new_tokens = 12, .top_k = 8, .seed = 4, .use_cache = false});
  CHECK(std::vector<std::int64_t>(a.span().begin(), a.span().end()) ==
        std::vector<std::int64_t>(b.span().begin(), b.span().end()));
  const auto c = models::generate(model, prompt, {.max_new_tokens = 12, .top_k = 8, .seed = 5});
  CHECK(std::vector<std::int64_t>(a.span().begin(), a.span().end()) !=
        std::vector<std::int64_t>(c.span().begin(), c.span().end()));
  // The draws are keyed by (row, position): fewer new tokens give a prefix of every row.
  const auto shorter = models::generate(model, prompt, {.max_new_tokens = 6, .top_k = 8, .seed = 4});
  for (std::int64_t n = 0; n < 2; ++n)
    for (std::int64_t t = 0; t < 11; ++t) {
      INFO("row " << n << ", position " << t);
      CHECK(shorter[n * 11 + t] == a[n * 17 + t]);
    }

  // Its forwards run without gradients: once it returns, the layers keep nothing (only
  // the tokens it returned are left in the ledger), with the cache and without.
  for (bool use_cache : {true, false}) {
    ledger l;
    ledger_scope scope(l);
    const auto out = models::generate(model, prompt, {.max_new_tokens = 3, .use_cache = use_cache});
    CHECK(l.current(category::activations) == std::size_t(out.numel()) * sizeof(std::int64_t));
  }

  // Too long a request is refused; the cache is off again afterwards, so training forwards work.
  CHECK_THROWS_WITH(models::generate(model, prompt, {.max_new_tokens = 28}),
                    Catch::Contains("33 positions exceed the model's 32"));
  nn::context training;
  CHECK(training.forward(model, prompt).shape() == Shape{2, 5, 96});
}

// logits_to_keep (Hugging Face's): the head computes the last k positions' logits alone,
// those of the full forward (other sums of the product: 1e-12 of the largest in float64);
// generate asks its forwards for the last one only, so the prompt's forward never holds
// [batch, prompt, vocab] logits. With gradients on it is refused.
TEMPLATE_TEST_CASE("logits_to_keep computes the last positions' logits alone", "[models][generate]",
                   models::GPT2LMHeadModel<double>, models::LlamaForCausalLM<double>) {
  using Model = TestType;
  Model model = golden_model<Model>();
  nn::Replicated<double, Model> owner(model, 5);
  const auto prompt = tokens(2, 7, 96, 4);
  nn::context ctx({.training = false});
  const Tensor<double> full = ctx.no_grad([&] { return ctx.forward(model, prompt); });
  double scale = 0;
  for (const double z : full.span()) scale = test_support::max_keeping_nan(scale, std::abs(z));
  for (const std::int64_t keep : {1, 3, 7, 9}) {
    ctx.set_logits_to_keep(keep);
    const Tensor<double> last = ctx.no_grad([&] { return ctx.forward(model, prompt); });
    const std::int64_t k = std::min<std::int64_t>(keep, 7);
    REQUIRE(last.shape() == Shape{2, k, 96});
    test_support::max_error e;
    for (std::int64_t n = 0; n < 2; ++n)
      for (std::int64_t i = 0; i < k * 96; ++i) e.relative(last[n * k * 96 + i], full[(n * 7 + 7 - k) * 96 + i], scale);
    INFO("keep " << keep);
    CHECK(e <= 1e-12);
  }
  ctx.set_logits_to_keep(2);
  CHECK_THROWS_WITH(ctx.forward(model, prompt), Catch::Contains("logits_to_keep (2) is for inference"));
  nn::context training;  // training, even where a checkpointed head's first forward has no gradients
  training.set_logits_to_keep(2);
  CHECK_THROWS_WITH(training.no_grad([&] { return training.forward(model, prompt); }),
                    Catch::Contains("logits_to_keep (2) is for inference"));
  // generate's forwards: each asks for one position's logits, and gets them.
  std::vector<Shape> seen;
  nn::context eval({.training = false});
  const auto forward = [&](const Tensor<std::int64_t>& ids, const models::generate_inputs& in) {
    CHECK(in.logits_to_keep == 1);
    eval.set_logits_to_keep(in.logits_to_keep);
    auto z = eval.no_grad([&] { return eval.forward(model, ids); });
    seen.push_back(z.shape());
    return z;
  };
  for (const bool cache : {true, false}) {
    seen.clear();
    const auto got = models::generate(model, forward, prompt, {.max_new_tokens = 3, .use_cache = cache});
    const auto plain = models::generate(model, prompt, {.max_new_tokens = 3, .use_cache = cache});
    CHECK(std::vector<std::int64_t>(got.span().begin(), got.span().end()) ==
          std::vector<std::int64_t>(plain.span().begin(), plain.span().end()));
    CHECK(seen == std::vector<Shape>(3, Shape{2, 1, 96}));
  }
}

// The plain overload's forwards too: a prompt of 30 tokens over a vocabulary of 4096 would
// hold 2 x 30 x 4096 logits at the head (1.9 MB in float64), far more than anything else.
TEST_CASE("generate's prompt forward never holds the whole prompt's logits", "[models][generate]") {
  using Model = models::GPT2LMHeadModel<double>;
  Model model({.vocab_size = 4096, .n_positions = 32, .n_embd = 8, .n_layer = 1, .n_head = 1});
  nn::Replicated<double, Model> owner(model, 3);
  const auto prompt = tokens(2, 30, 4096, 6);
  const std::size_t all_logits = 2 * 30 * 4096 * sizeof(double);
  Tensor<std::int64_t> mask({2, 30});  // row 1 left-padded by 10
  for (std::int64_t i = 0; i < mask.numel(); ++i) mask[i] = i < 30 || i >= 40;
  for (const bool cache : {true, false})
    for (const bool padded : {false, true}) {
      ledger l;
      ledger_scope scope(l);
      const auto out = models::generate(
          model, prompt, {.max_new_tokens = 2, .use_cache = cache, .attention_mask = padded ? mask : Tensor<std::int64_t>{}});
      INFO((cache ? "with" : "without") << " the cache" << (padded ? ", left-padded" : "") << ": peak "
                                        << l.peak(category::activations) << " bytes");
      CHECK(l.peak(category::activations) < all_logits / 4);
      // Once it returns the layers hold nothing, the padding mask included: only its tokens.
      CHECK(l.current(category::activations) == std::size_t(out.numel()) * sizeof(std::int64_t));
    }
  {
    ledger l;  // the same forward with every position's logits
    ledger_scope scope(l);
    nn::context ctx({.training = false});
    ctx.no_grad([&] { return ctx.forward(model, prompt); });
    CHECK(l.peak(category::activations) >= all_logits);
  }
  // A sharded model's forwards (the engine's context), in float.
  std::vector<std::size_t> peaks(2);
  comm::launch(2, [&](comm::ThreadComm& c, ledger& l) {
    models::GPT2LMHeadModel<float> local({.vocab_size = 4096, .n_positions = 32, .n_embd = 8, .n_layer = 1, .n_head = 1});
    auto sharded = shard::fully_shard<fixture_sgd>(local, c, shard::AnyStrategy(shard::FullShard{}),
                                                   {.wrap = shard::wrap_types<models::GPT2Block<float>>{}});
    l.reset_peaks();
    models::generate(sharded, prompt, {.max_new_tokens = 2});
    peaks[std::size_t(c.rank())] = l.peak(category::activations);
  });
  INFO("peaks " << peaks[0] << " and " << peaks[1] << " bytes");
  CHECK(peaks[0] < all_logits / 8);  // the float logits would take all_logits / 2
  CHECK(peaks[1] < all_logits / 8);
}

// A batch of prompts of lengths 3, 6 and 1, left-padded to 6 with pad_id, and its
// attention mask (1 = token), from the rows of `ids` [3, 6].
std::pair<Tensor<std::int64_t>, Tensor<std::int64_t>> left_padded(const Tensor<std::int64_t>& ids,
                                                                   std::int64_t pad_id) {
  const std::int64_t P = ids.dim(1), lengths[] = {3, 6, 1};
  Tensor<std::int64_t> prompt(ids.shape()), mask(ids.shape());
  for (std::int64_t n = 0; n < ids.dim(0); ++n)
    for (std::int64_t j = 0; j < P; ++j) {
      mask[n * P + j] = j >= P - lengths[n];
      prompt[n * P + j] = mask[n * P + j] ? ids[n * P + j] : pad_id;
    }
  return {prompt, mask};
}

// What a forward over a left-padded batch needs, for attention mask `mask` [B, P] (1 =
// token) over `total` >= P positions (those after P generated, all tokens): HF's position
// ids (each token's count of tokens before it; 0 at padding) and the key padding mask.
struct padded_context {
  Tensor<std::int64_t> positions;
  Tensor<std::uint8_t> padding;
};
padded_context padding_of(const Tensor<std::int64_t>& mask, std::int64_t total) {
  const std::int64_t B = mask.dim(0), P = mask.dim(1);
  padded_context c{Tensor<std::int64_t>({B, total}), Tensor<std::uint8_t>({B, total})};
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t j = 0, before = 0; j < total; ++j) {
      const bool token = j >= P || mask[n * P + j] == 1;
      c.positions[n * total + j] = token ? before : 0;
      c.padding[n * total + j] = std::uint8_t(!token);
      before += token;
    }
  return c;
}

// Row n's tokens of a left-padded batch alone, [1, length].
Tensor<std::int64_t> tokens_of_row(const Tensor<std::int64_t>& prompt, const Tensor<std::int64_t>& mask,
                                   std::int64_t n) {
  const std::int64_t P = prompt.dim(1);
  std::vector<std::int64_t> row;
  for (std::int64_t j = 0; j < P; ++j)
    if (mask[n * P + j]) row.push_back(prompt[n * P + j]);
  Tensor<std::int64_t> t({1, std::int64_t(row.size())});
  std::copy(row.begin(), row.end(), t.data());
  return t;
}

// With the context's position ids and key padding mask, each row of a left-padded batch
// gets its own logits and gradients: those of the row alone (sums in another order: 1e-12
// of the largest in float64). The padding's token does not matter.
TEMPLATE_TEST_CASE("position ids and key padding make a left-padded row its own", "[models][generate]",
                   models::GPT2LMHeadModel<double>, models::LlamaForCausalLM<double>) {
  using Model = TestType;
  Model model = golden_model<Model>();
  nn::Replicated<double, Model> owner(model, 5);
  const std::int64_t B = 3, P = 6, V = 96;
  const auto [prompt, mask] = left_padded(tokens(B, P, V, 11), 7);
  const auto [positions, padding] = padding_of(mask, P);
  // A random gradient of the logits, zero at padding (the loss ignores it).
  const auto dlogits = [&](std::int64_t rows, std::int64_t seq, std::uint64_t seed) {
    Tensor<double> d({rows, seq, V});
    const counter_rng rng(seed, 2);
    for (std::int64_t i = 0; i < d.numel(); ++i) d[i] = rng.uniform_double(std::uint64_t(i)) - 0.5;
    return d;
  };
  nn::context ctx;
  ctx.set_position_ids(positions);
  ctx.set_key_padding_mask(padding);
  const Tensor<double> z = ctx.forward(model, prompt);
  Tensor<double> dz = dlogits(B, P, 3);
  for (std::int64_t i = 0; i < B * P; ++i)
    if (!mask[i]) std::fill_n(dz.data() + i * V, V, 0.0);
  ctx.backward(model, dz);
  const std::vector<double> batch_grads(owner.grads().begin(), owner.grads().end());

  owner.zero_grad();
  std::vector<double> want_z, got_z;
  for (std::int64_t n = 0; n < B; ++n) {
    const auto row = tokens_of_row(prompt, mask, n);
    const std::int64_t L = row.dim(1), pad = P - L;
    nn::context alone;
    const Tensor<double> zn = alone.forward(model, row);
    Tensor<double> dzn({1, L, V});
    std::copy_n(dz.data() + (n * P + pad) * V, L * V, dzn.data());
    alone.backward(model, dzn);
    want_z.insert(want_z.end(), zn.data(), zn.data() + L * V);
    got_z.insert(got_z.end(), z.data() + (n * P + pad) * V, z.data() + (n * P + P) * V);
  }
  const auto logits = test_support::normwise_error(got_z, want_z);
  const auto grads = test_support::normwise_error(batch_grads, owner.grads());
  INFO("logits differ by " << logits << ", gradients by " << grads);
  CHECK(logits.value() <= 1e-12);
  CHECK(grads.value() <= 1e-12);

  // Without the position ids GPT-2's padded rows' logits are not their own. (RoPE depends on
  // positions only through their differences, so LLaMA's shifted rows differ by rounding.)
  nn::context eval({.training = false});
  if constexpr (std::is_same_v<Model, models::GPT2LMHeadModel<double>>) {
    eval.set_key_padding_mask(padding);
    const Tensor<double> shifted = eval.forward(model, prompt);
    std::vector<double> shifted_z;
    for (std::int64_t n = 0; n < B; ++n) {
      const std::int64_t L = tokens_of_row(prompt, mask, n).dim(1);
      shifted_z.insert(shifted_z.end(), shifted.data() + (n * P + P - L) * V, shifted.data() + (n * P + P) * V);
    }
    CHECK(std::ranges::all_of(shifted_z, [](double v) { return std::isfinite(v); }));
    CHECK(test_support::normwise_error(shifted_z, want_z).value() > 1e-6);
  }

  // Position ids are checked against the batch and the table.
  eval.set_key_padding_mask({});
  eval.set_position_ids(Tensor<std::int64_t>::zeros({B, P - 1}));
  CHECK_THROWS_WITH(eval.forward(model, prompt), Catch::Contains("position_ids must be [batch, sequence] = [3, 6]"));
  Tensor<std::int64_t> far = Tensor<std::int64_t>::zeros({B, P});
  far[4] = model.max_positions();
  eval.set_position_ids(far);
  CHECK_THROWS_WITH(eval.forward(model, prompt), Catch::Contains("position id 32 (row 0, token 4) is outside [0, 32)"));
}

// A left-padded batch (attention_mask) generates for each row the tokens it generates
// alone, with the cache and without, whatever token pads it; top-k draws by the row's
// position, so row 0 samples as it does alone. A mask of ones changes nothing.
TEMPLATE_TEST_CASE("generation of a left-padded batch gives each row its own tokens", "[models][generate]",
                   models::GPT2LMHeadModel<double>, models::LlamaForCausalLM<double>) {
  using Model = TestType;
  Model model = golden_model<Model>();
  nn::Replicated<double, Model> owner(model, 5);
  const std::int64_t B = 3, P = 6, N = 8, V = 96;
  const auto ids = tokens(B, P, V, 12);
  const auto [prompt, mask] = left_padded(ids, 0);
  const auto all_ones = [](const Shape& shape) {
    Tensor<std::int64_t> t(shape);
    std::fill_n(t.data(), t.numel(), std::int64_t(1));
    return t;
  };
  const auto continuation = [&](const Tensor<std::int64_t>& out, std::int64_t n) {
    const std::int64_t total = out.dim(1);
    return std::vector<std::int64_t>(out.data() + n * total + total - N, out.data() + n * total + total);
  };
  for (bool use_cache : {true, false}) {
    INFO("use_cache " << use_cache);
    const models::generate_options o{.max_new_tokens = N, .use_cache = use_cache, .attention_mask = mask};
    const auto out = models::generate(model, prompt, o);
    REQUIRE(out.shape() == Shape{B, P + N});
    const auto other_pad = models::generate(model, left_padded(ids, 95).first, o);
    for (std::int64_t n = 0; n < B; ++n) {
      INFO("row " << n);
      const auto alone =
          models::generate(model, tokens_of_row(prompt, mask, n), {.max_new_tokens = N, .use_cache = use_cache});
      CHECK(continuation(out, n) == continuation(alone, 0));
      CHECK(continuation(other_pad, n) == continuation(out, n));
    }
    const auto sampled = models::generate(
        model, prompt, {.max_new_tokens = N, .top_k = 8, .seed = 3, .use_cache = use_cache, .attention_mask = mask});
    const auto sampled_alone =
        models::generate(model, tokens_of_row(prompt, mask, 0),
                         {.max_new_tokens = N, .top_k = 8, .seed = 3, .use_cache = use_cache});
    CHECK(continuation(sampled, 0) == continuation(sampled_alone, 0));

    const auto unmasked = models::generate(model, ids, {.max_new_tokens = N, .use_cache = use_cache});
    const auto ones = models::generate(
        model, ids, {.max_new_tokens = N, .use_cache = use_cache, .attention_mask = all_ones({B, P})});
    CHECK(std::vector<std::int64_t>(ones.span().begin(), ones.span().end()) ==
          std::vector<std::int64_t>(unmasked.span().begin(), unmasked.span().end()));
  }

  // A mask it cannot use is refused before the first forward.
  Tensor<std::int64_t> right = all_ones({B, P});
  right[P + P - 1] = 0;
  CHECK_THROWS_WITH(models::generate(model, ids, {.max_new_tokens = N, .attention_mask = right}),
                    Catch::Contains("row 1 of the prompt ends in padding") && Catch::Contains("pad on the left"));
  CHECK_THROWS_WITH(models::generate(model, ids, {.max_new_tokens = N, .attention_mask = all_ones({B, P - 1})}),
                    Catch::Contains("attention_mask must be shaped as the prompt, [3, 6], got [3, 5]"));
  Tensor<std::int64_t> two = all_ones({B, P});
  two[2] = 2;
  CHECK_THROWS_WITH(models::generate(model, ids, {.max_new_tokens = N, .attention_mask = two}),
                    Catch::Contains("attention_mask holds 2 at row 0, position 2"));
  // A forward of the ids alone cannot set the padding.
  nn::context ctx({.training = false});
  const auto ids_only = [&](const Tensor<std::int64_t>& x) {
    return ctx.no_grad([&] { return ctx.forward(model, x); });
  };
  CHECK_THROWS_WITH(models::generate(model, ids_only, prompt, {.max_new_tokens = N, .attention_mask = mask}),
                    Catch::Contains("needs a forward that takes (ids, const generate_inputs&)"));
  CHECK(models::generate(model, ids_only, ids, {.max_new_tokens = 2}).shape() == Shape{B, P + 2});
}

// Top-k keeps every token tied with the k-th, as transformers' TopKLogitsWarper does:
// here k = 2 keeps tokens 0, 1, 2 and 4 (logits 3, 2, 2, 2), drawn in that order.
TEST_CASE("top-k keeps the tokens tied with the k-th", "[models][generate]") {
  const std::vector<double> z = {3, 2, 2, 1, 2};
  const models::generate_options o{.top_k = 2};
  const double e = std::exp(-1.0), sum = 1 + 3 * e;
  CHECK(models::detail::pick_token(z.data(), 5, o, 0.0) == 0);
  CHECK(models::detail::pick_token(z.data(), 5, o, (1 + 0.5 * e) / sum) == 1);
  CHECK(models::detail::pick_token(z.data(), 5, o, (1 + 1.5 * e) / sum) == 2);
  CHECK(models::detail::pick_token(z.data(), 5, o, (1 + 2.5 * e) / sum) == 4);
  CHECK(models::detail::pick_token(z.data(), 5, o, 0.999) == 4);
  CHECK(models::detail::pick_token(z.data(), 5, {.top_k = 1}, 0.999) == 0);  // no tie with the first: greedy
}

// Top-p keeps the nucleus as transformers' TopPLogitsWarper does (after top-k): for logits
// 2, 1, 0, -1, top_p 0.8 keeps tokens 0 and 1, 0.9 also 2, a tiny one token 0 alone; after
// top-k 3, top_p 0.95 keeps 0, 1, 2 and 0.9 keeps 0, 1 (what transformers 5.25's warpers keep
// for these logits, as for the ties below). Draws are against the kept tokens' renormalised
// softmax.
TEST_CASE("top-p keeps the nucleus transformers keeps", "[models][generate]") {
  const std::vector<double> z = {2, 1, 0, -1};
  const double w0 = 1, w1 = std::exp(-1.0);
  const auto last_drawn = [&](const models::generate_options& o) {  // the least likely token u = 0.999 reaches
    return models::detail::pick_token(z.data(), 4, o, 0.999);
  };
  CHECK(last_drawn({.top_p = 0.8}) == 1);
  CHECK(models::detail::pick_token(z.data(), 4, {.top_p = 0.8}, w0 / (w0 + w1) - 1e-9) == 0);
  CHECK(models::detail::pick_token(z.data(), 4, {.top_p = 0.8}, w0 / (w0 + w1) + 1e-9) == 1);
  CHECK(last_drawn({.top_p = 0.9}) == 2);
  CHECK(last_drawn({.top_p = 1e-9}) == 0);
  CHECK(last_drawn({.top_p = 1.0}) == 0);                // top_k 0 and top_p 1: greedy
  CHECK(last_drawn({.top_k = 4, .top_p = 1.0}) == 3);   // top-k alone
  CHECK(last_drawn({.top_k = 3, .top_p = 0.95}) == 2);
  CHECK(last_drawn({.top_k = 3, .top_p = 0.9}) == 1);
  // The temperature comes first: at 0.5 the softmax sharpens and 0.8 keeps token 0 alone
  // (its probability is 0.867), at 2 it flattens and 0.8 keeps three.
  CHECK(last_drawn({.temperature = 0.5, .top_p = 0.8}) == 0);
  CHECK(last_drawn({.temperature = 2.0, .top_p = 0.8}) == 2);
  // A cut through tied logits keeps the tied tokens of highest id, as transformers' does:
  // for 1, 1, 0 top_p 0.4 keeps token 1; for 0, 1, 1, 1, 1 top_p 0.3 keeps 3 and 4.
  const std::vector<double> tied3 = {1, 1, 0}, tied5 = {0, 1, 1, 1, 1};
  CHECK(models::detail::pick_token(tied3.data(), 3, {.top_p = 0.4}, 0.0) == 1);
  CHECK(models::detail::pick_token(tied3.data(), 3, {.top_p = 0.4}, 0.999) == 1);
  CHECK(models::detail::pick_token(tied5.data(), 5, {.top_p = 0.3}, 0.0) == 3);
  CHECK(models::detail::pick_token(tied5.data(), 5, {.top_p = 0.3}, 0.999) == 4);
  // Min-p, last (transformers 5.25's MinPLogitsWarper keeps the same): 0.2 keeps tokens 0
  // and 1 (weights 1 and e^-1 of the largest), 0.1 also 2, 1 token 0 alone; at temperature
  // 2, 0.3 keeps three; after top-p 0.8, 0.1 keeps 0 and 1, after top-p 0.95 (three), 0.2
  // keeps two; after top-k 3 (a partial sort, not the whole vocabulary's), 0.2 keeps two.
  CHECK(last_drawn({.min_p = 0.2}) == 1);
  CHECK(models::detail::pick_token(z.data(), 4, {.min_p = 0.2}, w0 / (w0 + w1) - 1e-9) == 0);
  CHECK(models::detail::pick_token(z.data(), 4, {.min_p = 0.2}, w0 / (w0 + w1) + 1e-9) == 1);
  CHECK(last_drawn({.min_p = 0.1}) == 2);
  CHECK(last_drawn({.min_p = 1.0}) == 0);
  CHECK(last_drawn({.temperature = 2.0, .min_p = 0.3}) == 2);
  CHECK(last_drawn({.top_p = 0.8, .min_p = 0.1}) == 1);
  CHECK(last_drawn({.top_p = 0.95, .min_p = 0.1}) == 2);
  CHECK(last_drawn({.top_p = 0.95, .min_p = 0.2}) == 1);
  CHECK(last_drawn({.top_k = 3, .min_p = 0.2}) == 1);
  CHECK(last_drawn({.top_k = 3, .min_p = 0.1}) == 2);

  using Model = models::GPT2LMHeadModel<double>;
  Model model = golden_model<Model>();
  nn::Replicated<double, Model> owner(model, 5);
  const auto prompt = tokens(2, 5, 96, 3);
  for (const double bad : {0.0, 1.5, double(NAN)})
    CHECK_THROWS_WITH(models::generate(model, prompt, {.max_new_tokens = 2, .top_p = bad}),
                      Catch::Contains("top_p in (0, 1]"));
  // Reproducible from the seed, with the cache and without; not greedy.
  const auto a = models::generate(model, prompt, {.max_new_tokens = 12, .top_p = 0.9, .seed = 4});
  const auto b = models::generate(model, prompt, {.max_new_tokens = 12, .top_p = 0.9, .seed = 4, .use_cache = false});
  const auto greedy = models::generate(model, prompt, {.max_new_tokens = 12});
  CHECK(std::vector<std::int64_t>(a.span().begin(), a.span().end()) ==
        std::vector<std::int64_t>(b.span().begin(), b.span().end()));
  CHECK(std::vector<std::int64_t>(a.span().begin(), a.span().end()) !=
        std::vector<std::int64_t>(greedy.span().begin(), greedy.span().end()));
}

// Over a whole vocabulary top-p sorts only the tokens above a floor (those below it are
// all dropped): every draw must be the one a full sort of the vocabulary gives. Logits
// spread as a trained model's (most tokens far below the largest, some -inf), distinct so
// that the reference needs no tie rule.
TEST_CASE("top-p over a large vocabulary draws what a full sort draws", "[models][generate]") {
  const std::int64_t V = 50000;
  std::mt19937_64 g(7);
  std::normal_distribution<double> n(0, 6);
  std::vector<double> z(static_cast<std::size_t>(V));
  for (auto& x : z) x = n(g);
  for (std::int64_t i = 0; i < V; i += 97) z[std::size_t(i)] = -INFINITY;
  std::vector<std::int64_t> order(z.size());
  std::iota(order.begin(), order.end(), std::int64_t(0));
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return z[std::size_t(a)] > z[std::size_t(b)]; });
  REQUIRE(std::adjacent_find(order.begin(), order.end(), [&](auto a, auto b) {
            return z[std::size_t(a)] == z[std::size_t(b)] && z[std::size_t(a)] > -INFINITY;
          }) == order.end());
  for (const double p : {0.5, 0.9, 0.99, 1.0})
    for (const double t : {0.7, 1.0, 1.5}) {
      const double min_p = p == 1.0 ? 0.01 : p == 0.99 ? 0.05 : 0.0;
      INFO("top_p " << p << ", temperature " << t << ", min_p " << min_p);
      // transformers' rule on the full sort: the weights, the nucleus, then each draw.
      std::vector<double> w(order.size());
      double sum = 0;
      for (std::size_t i = 0; i < order.size(); ++i)
        sum += w[i] = std::exp((z[std::size_t(order[i])] - z[std::size_t(order[0])]) / t);
      std::size_t kept = order.size();
      double tail = 0;
      for (std::size_t i = order.size() - 1; i > 0 && (tail += w[i]) <= (1 - p) * sum; --i) kept = i;
      while (kept > 1 && w[kept - 1] < min_p) --kept;
      const double mass = std::accumulate(w.begin(), w.begin() + std::ptrdiff_t(kept), 0.0);
      CHECK(kept > 1);
      CHECK(kept < std::size_t(V / 10));  // a nucleus much smaller than the vocabulary
      std::size_t differ = 0;
      for (int d = 0; d < 25; ++d) {
        const double u = (d + 0.5) / 25;
        std::size_t i = 0;
        for (double acc = w[0]; i + 1 < kept && !(u * mass < acc); acc += w[++i]) {
        }
        differ += models::detail::pick_token(z.data(), V, {.temperature = t, .top_p = p, .min_p = min_p}, u) !=
                  order[i];
      }
      CHECK(differ == 0);
    }
}

// The repetition penalty as transformers applies it: not to a row's left padding (its
// prompt_ignore_length), but to the same id once generated; in float32 for 16-bit logits.
// A stub forward's last logits: token 0 (the padding's id) 2, token 1 1.5, the rest -1.
TEST_CASE("the repetition penalty skips left padding and penalises 16-bit logits in float32", "[models][generate]") {
  models::GPT2LMHeadModel<float> model({.vocab_size = 5, .n_positions = 8, .n_embd = 4, .n_layer = 1, .n_head = 1});
  const auto stub = [](std::vector<float> last) {
    return [last](const Tensor<std::int64_t>& ids, const models::generate_inputs&) {
      const std::int64_t B = ids.dim(0), S = ids.dim(1), V = std::int64_t(last.size());
      Tensor<float> z({B, S, V});
      for (std::int64_t i = 0; i < z.numel(); ++i) z[i] = last[std::size_t(i % V)];
      return z;
    };
  };
  const auto forward = stub({2.0f, 1.5f, -1.0f, -1.0f, -1.0f});
  Tensor<std::int64_t> prompt({1, 3}), mask({1, 3});
  prompt[0] = 0, prompt[1] = 3, prompt[2] = 4;  // 0 is padding where the mask says so
  mask[0] = 0, mask[1] = 1, mask[2] = 1;
  const auto tokens_of = [](const Tensor<std::int64_t>& t) {  // the new ones
    return std::vector<std::int64_t>(t.span().begin() + 3, t.span().end());
  };
  const models::generate_options o{.max_new_tokens = 2, .repetition_penalty = 1.5};
  auto masked = o;
  masked.attention_mask = mask;
  // 0 is padding: 2 beats 1.5; once generated, 2 / 1.5 = 1.33 does not.
  CHECK(tokens_of(models::generate(model, forward, prompt, masked)) == std::vector<std::int64_t>{0, 1});
  // Without the mask the prompt's 0 is a token, penalised from the first step; then 1 is
  // penalised too (1.5 / 1.5 = 1 below 1.33).
  CHECK(tokens_of(models::generate(model, forward, prompt, o)) == std::vector<std::int64_t>{1, 0});
  CHECK(tokens_of(models::generate(model, forward, prompt, {.max_new_tokens = 2})) == std::vector<std::int64_t>{0, 0});
  // A negative logit is multiplied: -0.5 * 1.5 = -0.75 falls below token 1's -0.6, and then
  // token 1's -0.9 below it.
  const auto negative = stub({-0.5f, -0.6f, -1.0f, -1.0f, -1.0f});
  CHECK(tokens_of(models::generate(model, negative, prompt, o)) == std::vector<std::int64_t>{1, 0});
  // bf16 logits 3 and 2.734375, token 0 seen, penalty 1.1: 3 / 1.1 = 2.727 in float32 loses
  // to token 1; rounded back to bf16 it would tie at 2.734375 and the first (0) would win.
  const auto bf16 = [](const Tensor<std::int64_t>& ids, const models::generate_inputs&) {
    Tensor<bfloat16> z({ids.dim(0), ids.dim(1), 5});
    for (std::int64_t i = 0; i < z.numel(); ++i) z[i] = bfloat16(i % 5 == 0 ? 3.0f : i % 5 == 1 ? 2.734375f : -1.0f);
    return z;
  };
  CHECK(tokens_of(models::generate(model, bf16, prompt, {.max_new_tokens = 1, .repetition_penalty = 1.1})) ==
        std::vector<std::int64_t>{1});
  CHECK(tokens_of(models::generate(model, bf16, prompt, {.max_new_tokens = 1})) == std::vector<std::int64_t>{0});
}

// on_tokens sees each step's tokens as they come (an ended row's filler too), and a
// callback that throws stops generation, leaving the model's KV cache off.
TEST_CASE("on_tokens streams each step's tokens and may stop generation", "[models][generate]") {
  using Model = models::GPT2LMHeadModel<double>;
  Model model = golden_model<Model>();
  nn::Replicated<double, Model> owner(model, 5);
  const auto prompt = tokens(2, 5, 96, 3);
  models::generate_options o{.max_new_tokens = 6, .top_k = 8, .seed = 2};
  const auto whole = models::generate(model, prompt, o);
  std::vector<std::int64_t> streamed, positions;
  o.on_tokens = [&](std::span<const std::int64_t> next, std::int64_t t) {
    positions.push_back(t);
    streamed.insert(streamed.end(), next.begin(), next.end());
  };
  const auto got = models::generate(model, prompt, o);
  CHECK(positions == std::vector<std::int64_t>{5, 6, 7, 8, 9, 10});
  REQUIRE(streamed.size() == 12);
  for (std::int64_t n = 0; n < 2; ++n)
    for (std::int64_t k = 0; k < 6; ++k) CHECK(streamed[std::size_t(2 * k + n)] == whole[n * 11 + 5 + k]);
  CHECK(std::vector<std::int64_t>(got.span().begin(), got.span().end()) ==
        std::vector<std::int64_t>(whole.span().begin(), whole.span().end()));
  // Row 0 ends at its second new token: from then on it streams the pad token.
  streamed.clear();
  o.eos_token_id = whole[6];
  o.pad_token_id = 95;
  models::generate(model, prompt, o);
  CHECK(streamed[2] == whole[6]);
  for (std::size_t k = 2; 2 * k < streamed.size(); ++k) CHECK(streamed[2 * k] == 95);
  // A callback that throws ends generation with its error, the cache off again.
  o = {.max_new_tokens = 6, .on_tokens = [](std::span<const std::int64_t>, std::int64_t t) {
         if (t == 7) throw error("enough");
       }};
  CHECK_THROWS_WITH(models::generate(model, prompt, o), "enough");
  nn::context training;  // a training forward refuses a KV cache that is on
  CHECK(training.forward(model, prompt).shape() == Shape{2, 5, 96});
  for (const double bad : {0.0, -1.0, double(NAN)})
    CHECK_THROWS_WITH(models::generate(model, prompt, {.max_new_tokens = 2, .repetition_penalty = bad}),
                      Catch::Contains("repetition_penalty > 0"));
  for (const double bad : {-0.1, 1.5, double(NAN)})
    CHECK_THROWS_WITH(models::generate(model, prompt, {.max_new_tokens = 2, .min_p = bad}),
                      Catch::Contains("min_p in [0, 1]"));
}

// eos_token_id: a row that picks one of its tokens has ended (its later tokens are
// pad_token_id, or without one the first end token) and generation stops once every row
// has, so the result can be shorter than asked.
TEST_CASE("generation stops at eos_token_id once every row has ended", "[models][generate]") {
  using Model = models::GPT2LMHeadModel<double>;
  Model model = golden_model<Model>();
  nn::Replicated<double, Model> owner(model, 5);
  // What a run with end tokens should give: each row as without them up to its first end
  // token, then `filler`; as long as the longest row, or the whole length if one never ends.
  const auto expected = [](const Tensor<std::int64_t>& free, std::int64_t P, const models::end_tokens& eos,
                           std::int64_t filler) {
    const std::int64_t B = free.dim(0), total = free.dim(1);
    std::vector<std::int64_t> ends;
    for (std::int64_t n = 0; n < B; ++n) {
      std::int64_t end = total;
      for (std::int64_t t = P; t < total && end == total; ++t)
        if (eos.contains(free[n * total + t])) end = t;
      ends.push_back(end);
    }
    const std::int64_t last = *std::max_element(ends.begin(), ends.end());
    const std::int64_t len = last == total ? total : last + 1;
    std::vector<std::int64_t> v;
    for (std::int64_t n = 0; n < B; ++n)
      for (std::int64_t t = 0; t < len; ++t) v.push_back(t > ends[std::size_t(n)] ? filler : free[n * total + t]);
    return std::pair{len, v};
  };
  bool apart = false;  // two rows ended at different steps (or one never): the ended row waited
  bool filled = false, second = false;  // a row got the pad token; the second end token ended one
  for (const std::int64_t rows : {1, 2})
    for (const std::int64_t k : {0, 8})  // greedy, and draws (after its end a row would draw other tokens)
      for (const bool cache : {true, false}) {
        INFO(rows << " rows, top_k " << k << ", " << (cache ? "with" : "without") << " the cache");
        const auto prompt = tokens(rows, 5, 96, 3);
        const models::generate_options o{.max_new_tokens = 12, .top_k = k, .seed = 4, .use_cache = cache};
        const auto free = models::generate(model, prompt, o);
        const std::int64_t eos = free[7];  // row 0's third new token
        if (rows == 2) {
          std::int64_t end[2] = {17, 17};
          for (std::int64_t n = 0; n < 2; ++n)
            for (std::int64_t t = 16; t >= 5; --t)
              if (free[n * 17 + t] == eos) end[n] = t;
          apart = apart || end[0] != end[1];
        }
        models::generate_options until = o;
        until.eos_token_id = eos;
        const auto got = models::generate(model, prompt, until);
        const auto [len, want] = expected(free, 5, eos, eos);
        if (rows == 1) CHECK(len <= 8);  // a lone row stops at its end token
        REQUIRE(got.shape() == Shape{rows, len});
        CHECK(std::vector<std::int64_t>(got.span().begin(), got.span().end()) == want);
        // Several end tokens (row 0's third new token and the last row's fifth) and a pad token.
        until.eos_token_id = {free[(rows - 1) * 17 + 9], eos};
        until.pad_token_id = 95;
        const auto padded = models::generate(model, prompt, until);
        const auto [len2, want2] = expected(free, 5, until.eos_token_id, 95);
        REQUIRE(padded.shape() == Shape{rows, len2});
        CHECK(std::vector<std::int64_t>(padded.span().begin(), padded.span().end()) == want2);
        filled = filled || std::count(want2.begin(), want2.end(), 95) > 0;
        second = second || expected(free, 5, eos, 95) != std::pair{len2, want2};
        // Without the pad token an ended row repeats the first end token.
        until.pad_token_id = std::nullopt;
        const auto repeated = models::generate(model, prompt, until);
        CHECK(std::vector<std::int64_t>(repeated.span().begin(), repeated.span().end()) ==
              expected(free, 5, until.eos_token_id, until.eos_token_id.ids[0]).second);
      }
  CHECK(apart);
  CHECK(filled);
  CHECK(second);
  CHECK_THROWS_WITH(models::generate(model, tokens(1, 5, 96, 3), {.max_new_tokens = 2, .eos_token_id = 96}),
                    Catch::Contains("eos_token_id 96 is not a token of the model's 96"));
  CHECK_THROWS_WITH(models::generate(model, tokens(1, 5, 96, 3), {.max_new_tokens = 2, .eos_token_id = {3, -1}}),
                    Catch::Contains("eos_token_id -1 is not a token of the model's 96"));
  CHECK_THROWS_WITH(
      models::generate(model, tokens(1, 5, 96, 3), {.max_new_tokens = 2, .eos_token_id = 3, .pad_token_id = 96}),
      Catch::Contains("pad_token_id 96 is not a token of the model's 96"));
  // Ranks must agree on each of them (the sharded overload's hash of the options).
  const auto hash = [](const models::generate_options& o) { return models::detail::options_hash(o); };
  CHECK(hash({.eos_token_id = {1, 2}}) != hash({.eos_token_id = 1}));
  CHECK(hash({.eos_token_id = 1, .pad_token_id = 0}) != hash({.eos_token_id = 1}));
  CHECK(hash({.top_p = 0.9}) != hash({}));
  CHECK(hash({.min_p = 0.1}) != hash({}));
  CHECK(hash({.repetition_penalty = 1.2}) != hash({}));
  CHECK(models::generate_options{.eos_token_id = std::nullopt}.eos_token_id.empty());
  // A config's token ids go straight in.
  const models::token_ids llama3{.bos = 1, .eos = {4, 5, 6}, .pad = 7};
  const models::generate_options from_config{.eos_token_id = llama3.eos, .pad_token_id = llama3.pad};
  CHECK(from_config.eos_token_id.ids == std::vector<std::int64_t>{4, 5, 6});
}

// Logits a sampler cannot order or normalise: NaN and a row of -inf raise naming the
// row and position; a +inf logit has all the probability, greedy or top-k.
TEST_CASE("generation picks a +inf logit and raises on NaN or a row of -inf", "[models][generate]") {
  models::GPT2LMHeadModel<float> model({.vocab_size = 5, .n_positions = 8, .n_embd = 4, .n_layer = 1, .n_head = 1});
  const auto prompt = tokens(2, 2, 5, 1);
  const auto with = [&](std::vector<float> last) {
    return [&, last](const Tensor<std::int64_t>& ids) {
      Tensor<float> z({2, ids.dim(1), 5});
      for (std::int64_t i = 0; i < z.numel(); ++i) z[i] = float(i % 5);
      std::copy(last.begin(), last.end(), z.data() + (2 * ids.dim(1) - 1) * 5);  // row 1's last position
      return z;
    };
  };
  for (std::int64_t k : {0, 3}) {
    INFO("top_k " << k);
    const models::generate_options o{.max_new_tokens = 2, .top_k = k, .use_cache = false};
    const auto out = models::generate(model, with({0, 1, INFINITY, 2, -1}), prompt, o);
    CHECK(out[1 * 4 + 2] == 2);  // greedy and top-k alike: the k-th ranked token was picked before
    CHECK(out[1 * 4 + 3] == 2);
    CHECK_THROWS_WITH(models::generate(model, with({0, NAN, 2, 3, -1}), prompt, o),
                      Catch::Contains("generate: the logit of token 1 is NaN (row 1, position 2)"));
    CHECK_THROWS_WITH(models::generate(model, with({-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY}), prompt, o),
                      Catch::Contains("generate: every logit is -inf (row 1, position 2)"));
  }
}

// float64 layers reproduce transformers' float64 logits up to the rounding of a
// two-layer forward (~1e-15 relative; 1e-12 leaves room for other summation
// orders), and its float32 logits (LLaMA's) up to their rounding (2^-24, so 1e-7);
// float32 layers to 1e-5, their own rounding through the same layers.
TEMPLATE_TEST_CASE("GPT-2 and LLaMA loaded from transformers' files give its logits and loss", "[models][hf]",
                   models::GPT2LMHeadModel<double>, models::LlamaForCausalLM<double>, models::GPT2LMHeadModel<float>,
                   models::LlamaForCausalLM<float>) {
  using Model = TestType;
  using T = typename Model::output::value_type;
  const hf_expected e = expected<Model>();
  const double tolerance = std::is_same_v<T, double> ? (e.precision > 1e-12 ? 1e-7 : 1e-12) : 1e-5;
  Model model = golden_model<Model>();
  nn::Replicated<T, Model> owner(model, 0);
  const io::load_report report = models::load_hf(owner, hf_dir / golden_name<Model> / "initial");
  CHECK(report.ok());  // GPT-2's file leaves out lm_head.weight, which is transformer.wte.weight

  nn::context ctx({.training = false});
  const Tensor<T> logits = ctx.forward(model, e.ids);
  REQUIRE(logits.shape() == e.logits.shape());
  const auto err = logits_error(logits, e.logits);
  INFO(golden_name<Model> << ": logits differ by " << err << " of the largest");
  CHECK(err <= tolerance);
  const T loss = nn::cross_entropy(logits, e.targets).loss;
  // The file's loss carries its own rounding too (float32 for LLaMA: a few ulps of a mean).
  CHECK(test_support::relative_error(double(loss), e.losses[0], 0) <= 10 * tolerance);
}

// A model as transformers 5 saved it in tests/golden/hf5, loaded (float32).
template <class Model>
struct hf5_model {
  fs::path dir = fs::path(SHARDLIB_GOLDEN_DIR) / "hf5" / golden_name<Model>;
  Model model{models::read_hf_config<typename Model::config_type>(dir)};
  nn::Replicated<float, Model> owner{model, 0};
  bool loaded = models::load_hf(owner, dir).ok();
};

// llm.c's GPT-2 checkpoints (tests/golden/llmc, make_llmc_goldens.py: hf5's GPT-2 as llm.c's
// train_gpt2.py writes it, version 3 fp32 and version 5 bf16, the vocabulary of 96 padded to
// 128): read, every parameter is transformers' exactly (bf16: transformers' rounded to
// nearest even, torch's rounding); written from transformers' parameters, the same bytes.
// What is not llm.c's GPT-2 is refused, naming the file and what was expected.
TEST_CASE("llm.c's GPT-2 checkpoints read and write as llm.c's train_gpt2.py writes them", "[models][llmc]") {
  hf5_model<models::GPT2LMHeadModel<float>> hf;
  REQUIRE(hf.loaded);
  const fs::path dir = fs::path(SHARDLIB_GOLDEN_DIR) / "llmc";
  const auto bytes = [](const fs::path& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  test_support::temp_dir tmp("llmc");
  for (const auto& [file, type] : {std::pair{"gpt2_f32.bin", dtype::f32}, std::pair{"gpt2_bf16.bin", dtype::bf16}}) {
    INFO(file);
    const models::llmc_header h = models::read_llmc_header(dir / file);
    CHECK(h.type == type);
    CHECK(h.padded_vocab == 128);
    CHECK((h.config.vocab_size == 96 && h.config.n_positions == 32 && h.config.n_embd == 32 &&
           h.config.n_layer == 2 && h.config.n_head == 4 && h.config.tie_word_embeddings));
    models::GPT2LMHeadModel<float> model(h.config);
    nn::Replicated<float, models::GPT2LMHeadModel<float>> whole(model, 7);
    models::load_llmc(whole, dir / file);
    std::size_t compared = 0, differ = 0;
    for (const auto& e : whole.layout().entries) {
      const auto got = whole.value(e.name);
      const auto want = hf.owner.value(e.name);
      for (std::size_t i = 0; i < got.size(); ++i, ++compared)
        differ += !(got[i] == (type == dtype::f32 ? want[i] : float(bfloat16(want[i]))));  // NaN differs
    }
    CHECK(compared == nn::parameter_count(model));
    CHECK(differ == 0);
    models::save_llmc(hf.owner, tmp.path / file, type);
    CHECK(bytes(tmp.path / file) == bytes(dir / file));
  }

  // Through a Hugging Face checkpoint and back (shardlib-ckpt from-llmc, to-llmc): transformers'
  // own files' values, and llm.c's bytes again.
  models::llmc_to_hf(dir / "gpt2_f32.bin", tmp.path / "hf");
  hf5_model<models::GPT2LMHeadModel<float>> converted{.dir = tmp.path / "hf"};
  REQUIRE(converted.loaded);
  CHECK(std::ranges::equal(converted.owner.values(), hf.owner.values()));
  models::hf_to_llmc(tmp.path / "hf", tmp.path / "back.bin", dtype::bf16);
  CHECK(bytes(tmp.path / "back.bin") == bytes(dir / "gpt2_bf16.bin"));

  // Refusals: another version, a header the size does not match, a model of another shape
  // or not llm.c's architecture, a dtype llm.c does not write.
  std::string f32 = bytes(dir / "gpt2_f32.bin");
  const auto write = [&](std::string_view name, const std::string& content) {
    std::ofstream(tmp.path / name, std::ios::binary) << content;
    return tmp.path / name;
  };
  std::string v2 = f32;
  v2[4] = 2;
  CHECK_THROWS_WITH(models::read_llmc_header(write("v2.bin", v2)),
                    Catch::Contains("v2.bin: magic 20240326 version 2 is not llm.c's GPT-2 checkpoint"));
  CHECK_THROWS_WITH(models::read_llmc_header(write("cut.bin", f32.substr(0, f32.size() - 4))),
                    Catch::Contains("cut.bin: 123388 bytes, but its header (2 layers, channels 32, vocabulary 96 padded "
                                    "to 128, context 32, F32) makes 123392"));
  CHECK_THROWS_WITH(models::read_llmc_header(write("short.bin", f32.substr(0, 20))),
                    Catch::Contains("short.bin: shorter than llm.c's 1024-byte header"));
  models::GPT2LMHeadModel<float> wider({.vocab_size = 96, .n_positions = 32, .n_embd = 64, .n_layer = 2, .n_head = 4});
  nn::Replicated<float, models::GPT2LMHeadModel<float>> wide(wider, 0);
  CHECK_THROWS_WITH(models::load_llmc(wide, dir / "gpt2_f32.bin"),
                    Catch::Contains("gpt2_f32.bin: the model (2 layers, n_embd 64, 4 heads, vocabulary 96, n_positions "
                                    "32) is not the checkpoint's"));
  models::GPT2LMHeadModel<float> untied(
      {.vocab_size = 96, .n_positions = 32, .n_embd = 32, .n_layer = 2, .n_head = 4, .tie_word_embeddings = false});
  nn::Replicated<float, models::GPT2LMHeadModel<float>> loose(untied, 0);
  CHECK_THROWS_WITH(models::save_llmc(loose, tmp.path / "untied.bin"),
                    Catch::Contains("llm.c's GPT-2 ties its head to wte and has an MLP 4 n_embd (128) wide; this model "
                                    "has an untied head"));
  CHECK_THROWS_WITH(models::save_llmc(hf.owner, tmp.path / "half.bin", dtype::f16),
                    Catch::Contains("llm.c's checkpoints hold fp32 or bf16, not F16"));
  CHECK_FALSE(fs::exists(tmp.path / "half.bin"));
}

// The language-model examples' data (examples/common/text_corpus.hpp): llm.c's token files
// of both widths, mapped from the files, read as one sequence; a training or held-out window
// never crosses from one file into the next; the held-out tail is cut across files; files of
// two formats are refused.
TEST_CASE("the examples' token files: windows within a file, the tail held out across files", "[models][tokens]") {
  test_support::temp_dir dir("token_files");
  const auto write = [&](std::string_view name, std::int32_t magic, std::int32_t version, int width,
                         const std::vector<std::uint32_t>& tokens) {
    std::vector<std::int32_t> header(256, 0);
    header[0] = magic, header[1] = version, header[2] = std::int32_t(tokens.size());
    std::ofstream out(dir.path / name, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    for (std::uint32_t t : tokens) out.write(reinterpret_cast<const char*>(&t), width);  // little-endian
    return (dir.path / name).string();
  };
  std::vector<std::uint32_t> a(100), b(50), l(40);
  for (std::uint32_t i = 0; i < 100; ++i) a[i] = 3 * i;        // file a: steps of 3
  for (std::uint32_t i = 0; i < 50; ++i) b[i] = 1000 + i;      // file b: steps of 1
  for (std::uint32_t i = 0; i < 40; ++i) l[i] = 70000 + i;     // LLaMA 3: above 65535
  const auto fa = write("a.bin", 20240520, 1, 2, a), fb = write("b.bin", 20240520, 1, 2, b);
  const auto fl = write("l.bin", 20240801, 7, 4, l);

  const long seq = 8;
  const example::corpus c = example::corpus::tokens({fa, fb}, {}, 0.2, seq);  // 150 tokens, the last 30 held out
  CHECK(c.vocab == 50257);
  CHECK((c.train.size() == 120 && c.val.size() == 30));
  CHECK(c.train.positions(seq) == (100 - 9) + (20 - 9));
  CHECK(c.val.positions(seq) == 30 - 9);
  CHECK(c.val[0] == 1020);
  std::vector<std::size_t> every(c.train.positions(seq));
  std::iota(every.begin(), every.end(), std::size_t(0));
  const auto [x, y] = example::windows(c.train, every, seq);
  std::size_t crossing = 0, from_b = 0;
  for (std::int64_t r = 0; r < x.dim(0); ++r) {
    const bool in_b = x[r * seq] >= 1000;
    from_b += in_b;
    for (long t = 0; t < seq; ++t) {
      const std::int64_t next = x[r * seq + t] + (in_b ? 1 : 3);
      crossing += y[r * seq + t] != next || (t + 1 < seq && x[r * seq + t + 1] != next);
    }
  }
  CHECK(crossing == 0);
  CHECK(from_b == 11);
  CHECK_THROWS_WITH(c.train.window(c.train.positions(seq), seq), Catch::Contains("window start past the 102 positions"));

  const example::corpus wide = example::corpus::tokens({fl}, {}, 0.25, 4);
  CHECK(wide.vocab == 128256);
  CHECK((wide.val.size() == 10 && wide.val[0] == 70030 && wide.train[29] == 70029));
  const example::corpus held = example::corpus::tokens({fa}, {fb}, 0.5, seq);  // the fraction unused
  CHECK((held.train.size() == 100 && held.val.size() == 50));
  CHECK_THROWS_WITH(example::corpus::tokens({fa, fl}, {}, 0.1, 4),
                    Catch::Contains("l.bin holds LLaMA 3 tokens and " + fa + " GPT-2 tokens"));
}

// --tokenizer's decoding (examples/common/token_decoder.hpp) against Hugging Face tokenizers'
// own decode (tests/golden/tokens/make_hf_tokenizers.py: tokenizers 0.23, two small
// tokenizers trained on the README): byte-level BPE (GPT-2's, Llama 3's kind) and
// SentencePiece's byte-fallback BPE (LLaMA 2's kind), over accents, an emoji, tabs, newlines,
// a control byte, leading and double spaces, and a special token; llm.c's file too.
TEST_CASE("the examples' --tokenizer decodes as Hugging Face tokenizers and llm.c's file do", "[models][tokens]") {
  const fs::path dir = fs::path(SHARDLIB_GOLDEN_DIR) / "tokens";
  std::ifstream in(dir / "hf_decode.json");
  const auto golden = nlohmann::json::parse(in);
  for (const char* kind : {"bytelevel", "sentencepiece"}) {
    INFO(kind);
    const auto d = example::token_decoder::read((dir / cat(kind, "_tokenizer.json")).string());
    for (const auto& c : golden[kind]) CHECK(d.decode(c["ids"].get<std::vector<std::int64_t>>()) == c["text"].get<std::string>());
    CHECK(d.decode(std::vector<std::int64_t>{-1, 100000}) == "<-1><100000>");
  }
  // Added tokens as tokenizers 0.23 decodes them: one with a character outside the byte table
  // stays whole ("éx☕"; é alone would be the byte 0xE9), and "<0xZZ>" is no byte.
  test_support::temp_dir tmp("token_decoder");
  for (const auto& [kind, token] : {std::pair{"bytelevel", "\u00e9x\u2615"}, std::pair{"sentencepiece", "<0xZZ>"}}) {
    std::ifstream f(dir / cat(kind, "_tokenizer.json"));
    auto j = nlohmann::json::parse(f);
    const std::size_t id = j["model"]["vocab"].size();
    j["added_tokens"].push_back({{"id", id}, {"content", token}, {"special", true}});
    std::ofstream(tmp.path / cat(kind, ".json")) << j.dump();
    const auto d = example::token_decoder::read((tmp.path / cat(kind, ".json")).string());
    CHECK(d.decode(std::vector<std::int64_t>{std::int64_t(id)}) == token);
  }
  // llm.c's: the fixture's token 150 b + 7 is byte b, 50256 "<|endoftext|>".
  const auto llmc = example::token_decoder::read((dir / "tokenizer.bin").string());
  CHECK(llmc.decode(std::vector<std::int64_t>{150 * 'h' + 7, 150 * 'i' + 7, 50256}) == "hi<|endoftext|>");
  std::ofstream(tmp.path / "wordpiece.json") << R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})";
  CHECK_THROWS_WITH(example::token_decoder::read((tmp.path / "wordpiece.json").string()),
                    Catch::Contains("wordpiece.json: not a BPE tokenizer.json (its model's type WordPiece"));
  std::ofstream(tmp.path / "metaspace.json")
      << R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": "Metaspace"}})";
  CHECK_THROWS_WITH(example::token_decoder::read((tmp.path / "metaspace.json").string()),
                    Catch::Contains("metaspace.json: decoder {\"type\":\"Metaspace\"} is neither ByteLevel"));
  std::ofstream(tmp.path / "strip2.json") << R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type":
      "Sequence", "decoders": [{"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 2, "stop": 0}]}})";
  CHECK_THROWS_WITH(example::token_decoder::read((tmp.path / "strip2.json").string()),
                    Catch::Contains("strip2.json: decoder step {\"content\":\" \",\"start\":2,"));
}

// What transformers 5 writes (tests/golden/hf5, make_hf5_goldens.py: transformers 5.25,
// torch 2.15): "dtype" for "torch_dtype", LLaMA's rope_theta only inside
// "rope_parameters", its weights in one file. Its float32 logits, to 1e-5 of the largest
// (two float32 implementations of two layers).
TEMPLATE_TEST_CASE("GPT-2 and LLaMA as transformers 5 saves them load and give its logits", "[models][hf]",
                   models::GPT2LMHeadModel<float>, models::LlamaForCausalLM<float>) {
  using Model = TestType;
  hf5_model<Model> m;
  CHECK(m.loaded);
  const auto f = io::safetensors::load(m.dir / "expected.safetensors");
  nn::context ctx({.training = false});
  const Tensor<float> logits = ctx.forward(m.model, golden::read<std::int64_t>(f, "input_ids"));
  const Tensor<double> want = logits_of(f);
  REQUIRE(logits.shape() == want.shape());
  const auto err = logits_error(logits, want);
  INFO(golden_name<Model> << ": logits differ by " << err << " of the largest");
  CHECK(err <= 1e-5);
}

// A left-padded batch as transformers 5 generates it (hf5/<model>/padded_generate.safetensors,
// make_padded_generate_goldens.py: greedy, 8 new tokens, prompts of 3, 6 and 1 tokens padded
// on the left): the same tokens, and each step's logits, from one forward over the generated
// sequences with the mask's position ids and key padding, to 1e-5 of the largest (float32, as
// above); and with end tokens and a pad token, the same shorter result. Without the position
// ids GPT-2's logits are further off than that.
TEMPLATE_TEST_CASE("a left-padded batch generates as transformers 5 generates it", "[models][hf][generate]",
                   models::GPT2LMHeadModel<float>, models::LlamaForCausalLM<float>) {
  using Model = TestType;
  hf5_model<Model> m;
  CHECK(m.loaded);
  Model& model = m.model;
  const auto f = io::safetensors::load(m.dir / "padded_generate.safetensors");
  const auto prompt = golden::read<std::int64_t>(f, "input_ids"), mask = golden::read<std::int64_t>(f, "attention_mask"),
             want = golden::read<std::int64_t>(f, "sequences");
  const auto steps = golden::read<float>(f, "step_logits");
  const std::int64_t B = prompt.dim(0), P = prompt.dim(1), N = want.dim(1) - P, V = steps.dim(2);
  REQUIRE(steps.shape() == Shape{B, N, V});

  const auto got = models::generate(model, prompt, {.max_new_tokens = N, .attention_mask = mask});
  CHECK(std::vector<std::int64_t>(got.span().begin(), got.span().end()) ==
        std::vector<std::int64_t>(want.span().begin(), want.span().end()));
  // With end tokens (one per row) and pad token 0: rows that end get 0, and it stops once all have.
  const auto ends = golden::read<std::int64_t>(f, "eos_token_ids");
  const auto want_ended = golden::read<std::int64_t>(f, "sequences_eos");
  const auto ended = models::generate(model, prompt,
                                      {.max_new_tokens = N,
                                       .eos_token_id = std::vector<std::int64_t>(ends.span().begin(), ends.span().end()),
                                       .pad_token_id = 0,
                                       .attention_mask = mask});
  REQUIRE(ended.shape() == want_ended.shape());
  CHECK(std::vector<std::int64_t>(ended.span().begin(), ended.span().end()) ==
        std::vector<std::int64_t>(want_ended.span().begin(), want_ended.span().end()));
  // With repetition_penalty 1.5 (on each row's tokens from its first real one on).
  const auto want_rep = golden::read<std::int64_t>(f, "sequences_rep");
  const auto penalised =
      models::generate(model, prompt, {.max_new_tokens = N, .repetition_penalty = 1.5, .attention_mask = mask});
  CHECK(std::vector<std::int64_t>(penalised.span().begin(), penalised.span().end()) ==
        std::vector<std::int64_t>(want_rep.span().begin(), want_rep.span().end()));
  CHECK(std::vector<std::int64_t>(penalised.span().begin(), penalised.span().end()) !=
        std::vector<std::int64_t>(want.span().begin(), want.span().end()));

  const padded_context padded = padding_of(mask, P + N);
  Tensor<double> reference(steps.shape());
  std::copy(steps.span().begin(), steps.span().end(), reference.data());
  // The logits that picked each new token: position P - 1 + k for step k.
  const auto step_logits = [&](bool with_positions) {
    nn::context ctx({.training = false});
    ctx.set_key_padding_mask(padded.padding);
    if (with_positions) ctx.set_position_ids(padded.positions);
    const Tensor<float> z = ctx.forward(model, want);
    Tensor<double> out({B, N, V});
    for (std::int64_t n = 0; n < B; ++n)
      std::copy_n(z.data() + (n * (P + N) + P - 1) * V, N * V, out.data() + n * N * V);
    return out;
  };
  const auto err = logits_error(step_logits(true), reference);
  INFO(golden_name<Model> << ": step logits differ by " << err << " of the largest");
  CHECK(err <= 1e-5);
  if constexpr (std::is_same_v<Model, models::GPT2LMHeadModel<float>>) {
    const auto shifted = step_logits(false);
    CHECK(std::ranges::all_of(shifted.span(), [](double v) { return std::isfinite(v); }));
    const auto off = logits_error(shifted, reference);
    INFO("without position ids: " << off);
    CHECK(off.value() > 1e-5);
  }
}

// Losses over 20 AdamW steps (float32 layers, shardlib's AdamW in float32; the
// reference is float64): within 1e-4 relative, the brief's bound; the measured
// difference is printed.
TEMPLATE_TEST_CASE("GPT-2 and LLaMA train as transformers trains them: 20 AdamW steps, unsharded", "[models][hf]",
                   models::GPT2LMHeadModel<float>, models::LlamaForCausalLM<float>) {
  using Model = TestType;
  const hf_expected e = expected<Model>();
  Model model = golden_model<Model>();
  nn::Replicated<float, Model> owner(model, 0);
  models::load_hf(owner, hf_dir / golden_name<Model> / "initial");
  const auto err = train_unsharded(model, owner, e.ids, e.targets, e.losses, golden_adamw());
  std::printf("hf %-5s unsharded: 20 AdamW steps, loss %.6f -> %.6f, largest relative difference %.2e\n",
              golden_name<Model>, e.losses.front(), e.losses.back(), err.value());
  CHECK(err.count() == 21);
  CHECK(err <= 1e-4);
}

// The same run sharded: FullShard over 2 thread ranks, every block a unit (the
// tied GPT-2 head in the root with the embedding), each rank one of the batch's
// two samples. Both samples count 6 tokens, so the mean of the ranks' losses is
// the batch's loss and the averaged gradient the batch's gradient.
TEMPLATE_TEST_CASE("GPT-2 and LLaMA sharded (FullShard, W = 2) match transformers: logits and 20 AdamW steps",
                   "[models][hf][shard]", models::GPT2LMHeadModel<float>, models::LlamaForCausalLM<float>) {
  using Model = TestType;
  const hf_expected e = expected<Model>();
  for (std::int64_t n = 0; n < 2; ++n) {
    std::int64_t counted = 0;
    for (std::int64_t t = 0; t < 8; ++t) counted += e.targets[n * 8 + t] != -100;
    REQUIRE(counted == 6);
  }
  std::vector<std::vector<double>> losses(2);
  std::vector<test_support::max_error> logits(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model model = golden_model<Model>();
    auto sharded = shard::fully_shard<optim::AdamW>(model, c, shard::FullShard{},
                                                    {.wrap = shard::wrap_types<typename Model::block_type>{}});
    require(sharded.unit_count() == 3, "expected 3 units (the root and two blocks), got ", sharded.unit_count());
    models::load_hf(sharded, hf_dir / golden_name<Model> / "initial");
    const int r = c.rank();
    const auto x = rows(e.ids, r, 1), y = rows(e.targets, r, 1);
    logits[std::size_t(r)] = logits_error(sharded.forward(x), e.logits, r);
    optim::AdamW adamw = golden_adamw();
    for (std::size_t k = 0; k + 1 < e.losses.size(); ++k)
      losses[std::size_t(r)].push_back(train_step(sharded, adamw, x, y));
    losses[std::size_t(r)].push_back(nn::cross_entropy(sharded.forward(x), y).loss);
  });
  for (const auto& l : logits) CHECK(l <= 1e-5);
  test_support::max_error err;
  for (std::size_t k = 0; k < e.losses.size(); ++k) err.relative((losses[0][k] + losses[1][k]) / 2, e.losses[k], 0);
  std::printf("hf %-5s FullShard W=2: 20 AdamW steps, largest relative difference of the loss %.2e\n",
              golden_name<Model>, err.value());
  CHECK(err.count() == 21);
  CHECK(err <= 1e-4);
}

// Saved as save_pretrained saves (the names and layout of transformers' own files,
// GPT-2's tied head left out) and loaded back: the same values, sharded or not.
TEMPLATE_TEST_CASE("GPT-2 and LLaMA save in Hugging Face's layout and load back", "[models][hf][shard]",
                   models::GPT2LMHeadModel<float>, models::LlamaForCausalLM<float>) {
  using Model = TestType;
  const fs::path out = fs::temp_directory_path() / (std::string("shardlib_test_models_") + golden_name<Model>);
  fs::remove_all(out);
  std::vector<std::vector<float>> saved(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model model = golden_model<Model>();
    auto sharded = shard::fully_shard<optim::AdamW>(model, c, shard::FullShard{},
                                                    {.wrap = shard::wrap_types<typename Model::block_type>{}, .seed = 3});
    models::save_hf(sharded, out / "single");
    models::save_hf(sharded, out / "sharded", 20'000);  // several files and the index
    for (const auto& t : sharded.full_state_dict(false))
      saved[std::size_t(c.rank())].insert(saved[std::size_t(c.rank())].end(), t.value.span().begin(),
                                          t.value.span().end());
  });
  CHECK(file_names(out / "single") == file_names(hf_dir / golden_name<Model> / "initial"));
  CHECK(file_names(out / "sharded") == file_names(hf_dir / golden_name<Model> / "initial"));
  CHECK(fs::exists(out / "sharded" / "model.safetensors.index.json"));
  const auto config = models::read_hf_config<typename Model::config_type>(out / "single");
  CHECK(models::hf_config_json(config) == models::hf_config_json(golden_model<Model>().config()));

  for (const char* layout : {"single", "sharded"}) {
    INFO(layout);
    Model model(config);
    nn::Replicated<float, Model> owner(model, 99);  // other values until loaded
    CHECK(models::load_hf(owner, out / layout).ok());
    std::vector<float> loaded;
    model.parameters([&](std::string_view, nn::Param<float>& p) {
      loaded.insert(loaded.end(), p.values().begin(), p.values().end());
    });
    CHECK(loaded == saved[0]);
  }
  CHECK(saved[0] == saved[1]);
  fs::remove_all(out);
}

// save_pretrained's rule: a save replaces what an earlier one left in the directory,
// so that a load never reads the old weights or a mix of two saves.
TEST_CASE("saving again into a directory replaces the earlier save, single or sharded", "[models][hf]") {
  using Model = models::GPT2LMHeadModel<float>;
  const fs::path dir = fs::temp_directory_path() / cat("shardlib_test_resave_", ::getpid());
  fs::remove_all(dir);
  Model model = golden_model<Model>();
  nn::Replicated<float, Model> owner(model, 1);
  const auto values = [&] {
    std::vector<float> v;
    model.parameters([&](std::string_view, nn::Param<float>& p) { v.insert(v.end(), p.values().begin(), p.values().end()); });
    return v;
  };
  const auto loaded = [&] {
    Model other = golden_model<Model>();
    nn::Replicated<float, Model> o(other, 99);
    models::load_hf(o, dir);
    std::vector<float> v;
    other.parameters([&](std::string_view, nn::Param<float>& p) { v.insert(v.end(), p.values().begin(), p.values().end()); });
    return v;
  };
  const auto shards = [&] {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().starts_with("model-")) names.insert(e.path().filename().string());
    return names;
  };
  models::save_hf(owner, dir);
  owner.values()[0] += 1;
  models::save_hf(owner, dir, 20'000);  // sharded over the single file
  CHECK_FALSE(fs::exists(dir / "model.safetensors"));
  CHECK(loaded() == values());
  const auto many = shards();
  CHECK(many.size() > 2);
  owner.values()[0] += 1;
  models::save_hf(owner, dir, 60'000);  // fewer files: the others go
  CHECK(shards().size() < many.size());
  CHECK(loaded() == values());
  std::ifstream in(dir / "model.safetensors.index.json");
  const std::string index((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& f : shards()) CHECK_THAT(index, Catch::Contains(f));
  owner.values()[0] += 1;
  models::save_hf(owner, dir);  // single over sharded: the index and its files go
  CHECK(shards().empty());
  CHECK_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  CHECK(loaded() == values());
  fs::remove_all(dir);
}

// A directory rank 0 cannot create fails the save on every rank, none left waiting.
TEST_CASE("save_hf that fails on rank 0 raises io_error on every rank", "[models][hf][shard]") {
  using Model = models::GPT2LMHeadModel<float>;
  const fs::path file = fs::temp_directory_path() / cat("shardlib_test_not_a_dir_", ::getpid());
  std::ofstream(file) << "a plain file\n";
  std::vector<std::string> errors(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model model = golden_model<Model>();
    auto sharded = shard::fully_shard<optim::AdamW>(model, c, shard::FullShard{},
                                                    {.wrap = shard::wrap_types<Model::block_type>{}, .seed = 3});
    try {
      models::save_hf(sharded, file / "out");  // a directory inside a plain file
    } catch (const io_error& e) {
      errors[std::size_t(c.rank())] = e.what();
    }
    c.barrier();  // the ranks are still in step
  });
  CHECK_THAT(errors[0], Catch::StartsWith("rank 0: creating " + (file / "out").string()));
  CHECK_THAT(errors[1], Catch::Contains("rank 1: creating") && Catch::Contains("stopped because rank 0 failed"));
  fs::remove(file);
}

namespace {

// The unsharded reference's SGD in float64, at the sharded runs' learning rate (fixture::sgd's).
struct sgd64 {
  double lr = double(fixture_sgd{}.lr);
  struct state {};
  state make_state(std::size_t) const { return {}; }
  void step(std::span<double> p, std::span<const double> g, state&) const {
    for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * g[i];
  }
};

constexpr int equivalence_steps = 3;

// Step s's global batch: 4 sequences of 8 tokens and their next tokens.
std::pair<Tensor<std::int64_t>, Tensor<std::int64_t>> step_batch(int s) {
  const auto ids = tokens(4, 9, 96, 100 + std::uint64_t(s));
  Tensor<std::int64_t> x({4, 8}), y({4, 8});
  for (std::int64_t n = 0; n < 4; ++n)
    for (std::int64_t t = 0; t < 8; ++t) {
      x[n * 8 + t] = ids[n * 9 + t];
      y[n * 8 + t] = ids[n * 9 + t + 1];
    }
  return {x, y};
}

// Losses and final parameters (in the model's parameter order, the tied weight under
// both names) of SGD steps on the whole batch, unsharded and in float64.
std::pair<std::vector<double>, std::vector<double>> unsharded_run() {
  using Model = models::GPT2LMHeadModel<double>;
  Model model = golden_model<Model>();
  nn::Replicated<double, Model> owner(model, 11);  // the tied weight once, drawn as the engine draws it
  nn::context ctx;
  const sgd64 sgd;
  sgd64::state st;
  std::vector<double> losses, params;
  for (int s = 0; s < equivalence_steps; ++s) {
    owner.zero_grad();
    const auto [x, y] = step_batch(s);
    auto l = nn::cross_entropy(ctx.forward(model, x), y);
    ctx.backward(model, l.grad);
    sgd.step(owner.values(), owner.grads(), st);
    losses.push_back(l.loss);
  }
  model.parameters([&](std::string_view, nn::Param<double>& p) {
    params.insert(params.end(), p.values().begin(), p.values().end());
  });
  return {losses, params};
}

void check_equivalence(int world, shard::AnyStrategy strategy) {
  static const auto want = unsharded_run();
  const int per_rank = 4 / world;
  std::vector<std::vector<double>> losses(static_cast<std::size_t>(world)), params(static_cast<std::size_t>(world));
  comm::launch(world, [&](comm::ThreadComm& c) {
    using Model = models::GPT2LMHeadModel<float>;
    Model model = golden_model<Model>();
    auto sharded = shard::fully_shard<fixture_sgd>(model, c, strategy,
                                                   {.wrap = shard::wrap_types<models::GPT2Block<float>>{}, .seed = 11});
    fixture_sgd sgd;
    for (int s = 0; s < equivalence_steps; ++s) {
      const auto [x, y] = step_batch(s);
      losses[std::size_t(c.rank())].push_back(
          train_step(sharded, sgd, rows(x, c.rank() * per_rank, per_rank), rows(y, c.rank() * per_rank, per_rank)));
    }
    for (const auto& t : sharded.full_state_dict(false))
      params[std::size_t(c.rank())].insert(params[std::size_t(c.rank())].end(), t.value.span().begin(),
                                           t.value.span().end());
  });
  test_support::max_error loss, param;
  for (int s = 0; s < equivalence_steps; ++s) {
    double mean = 0;  // every rank's tokens count alike: the mean of the ranks' means is the batch's
    for (const auto& l : losses) mean += l[std::size_t(s)] / world;
    loss.relative(mean, want.first[std::size_t(s)], 1e-6);
  }
  for (const auto& p : params) param.relative(p, want.second, 1e-2);
  INFO(strategy.name << " at W = " << world << ": losses differ by " << loss << ", parameters by " << param);
  CHECK(loss <= 1e-5);
  CHECK(param <= 1e-5);
}

}  // namespace

// float32 sharded training against a float64 unsharded reference (the engine's
// masters are float32: its collectives and optimizers step float). They differ by
// float32 rounding, ~1e-7 relative a step; 1e-5 (parameters relative to
// max(|w|, 1e-2)) leaves room for three steps and fails on a lost or doubled
// gradient term of the tied weight: the head's and the embedding's shares of its
// gradient are each of order 1e-1 of it.
TEMPLATE_TEST_CASE("the tied GPT-2 trains sharded as unsharded under every strategy", "[models][shard][tied]",
                   shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer, shard::NoShard, shard::HybridShard) {
  check_equivalence(2, TestType{});
  if constexpr (std::is_same_v<TestType, shard::HybridShard>) check_equivalence(4, shard::HybridShard{.group_size = 2});
}

// Per-rank memory of the tied GPT-2 (float32, SGD) equals the planner's, the tied
// weight counted once: parameters, gradients and gathered parameters at their peaks.
TEMPLATE_TEST_CASE("the tied GPT-2's memory per rank equals the planner's", "[models][shard][memory]",
                   shard::FullShard, shard::ShardGradOp, shard::ShardOptimizer, shard::NoShard, shard::HybridShard) {
  constexpr int world = 2;
  std::vector<std::string> report(world);
  std::vector<int> ok(world, 0);
  comm::launch(world, [&](comm::ThreadComm& c, ledger& l) {
    using Model = models::GPT2LMHeadModel<float>;
    Model model = golden_model<Model>();
    auto sharded = shard::fully_shard<fixture_sgd>(model, c, shard::AnyStrategy(TestType{}),
                                                   {.wrap = shard::wrap_types<models::GPT2Block<float>>{}});
    fixture_sgd sgd;
    for (int s = 0; s < 2; ++s) {
      const auto [x, y] = step_batch(s);
      train_step(sharded, sgd, rows(x, c.rank() * 2, 2), rows(y, c.rank() * 2, 2));
    }
    const auto want = plan::make_plan(plan::describe(sharded), {.policy = TestType{}.policy(), .world = world,
                                                                .precision = plan::precision::fp32_layers({}),
                                                                .optimizer_bytes = plan::sgd_state_bytes})
                          .memory;
    std::size_t unique = 0;  // the model's parameters, the tied weight once
    for (std::size_t i = 0; i < sharded.unit_count(); ++i)
      for (const auto& e : sharded.unit_layout(i).entries) unique += e.numel();
    report[std::size_t(c.rank())] =
        cat("parameters ", l.peak(category::parameters), " vs ", want.parameters, "; gradients ",
            l.peak(category::gradients), " vs ", want.gradients, "; gathered ", l.peak(category::gathered_parameters),
            " vs ", want.gathered_parameters, "; parameters in the layouts ", unique, " = the model's ",
            nn::parameter_count(model), " (the tied weight once)");
    ok[std::size_t(c.rank())] = l.peak(category::parameters) == want.parameters &&
                                l.peak(category::gradients) == want.gradients &&
                                l.peak(category::gathered_parameters) == want.gathered_parameters &&
                                unique == nn::parameter_count(model);
  });
  for (int r = 0; r < world; ++r) {
    INFO(TestType::name << ", rank " << r << ": " << report[std::size_t(r)]);
    CHECK(ok[std::size_t(r)] == 1);
  }
}

// Inference on a sharded model: eval() frees every unit after use and keeps no
// activations; the logits are transformers', and generation with the KV cache
// (each forward gathering the units) gives the unsharded model's tokens.
TEST_CASE("a sharded GPT-2 in eval mode gives transformers' logits and generates as the unsharded one",
          "[models][shard][generate]") {
  using Model = models::GPT2LMHeadModel<float>;
  const hf_expected e = expected<Model>();
  const auto prompt = rows(e.ids, 0, 2);
  Model plain = golden_model<Model>();
  nn::Replicated<float, Model> owner(plain, 0);
  models::load_hf(owner, hf_dir / "gpt2" / "initial");
  const auto want = models::generate(plain, prompt, {.max_new_tokens = 16, .top_k = 4, .seed = 1});
  // With an end token (row 0's fourth new token) every rank stops where the unsharded model does.
  const models::generate_options until{
      .max_new_tokens = 16, .top_k = 4, .seed = 1, .eos_token_id = want[prompt.dim(1) + 3]};
  const auto want_until = models::generate(plain, prompt, until);
  // A left-padded batch: the engine's context takes the padding for generate's forwards only.
  const auto [padded, mask] = left_padded(tokens(3, 6, 96, 13), 0);
  const models::generate_options masked{.max_new_tokens = 6, .top_k = 4, .seed = 1, .attention_mask = mask};
  const auto want_padded = models::generate(plain, padded, masked);

  std::vector<test_support::max_error> logits(2);
  std::vector<std::vector<std::int64_t>> got(2), got_until(2), got_padded(2);
  std::vector<std::string> why(2);  // each rank's findings (Catch's assertions are not thread-safe)
  comm::launch(2, [&](comm::ThreadComm& c, ledger& l) {
    auto& w = why[std::size_t(c.rank())];
    Model model = golden_model<Model>();
    auto sharded = shard::fully_shard<fixture_sgd>(model, c, shard::AnyStrategy(shard::FullShard{}),
                                                   {.wrap = shard::wrap_types<models::GPT2Block<float>>{}});
    models::load_hf(sharded, hf_dir / "gpt2" / "initial");
    sharded.eval();
    logits[std::size_t(c.rank())] = logits_error(sharded.forward(e.ids), e.logits);
    if (l.current(category::gathered_parameters) != 0) w += "gathered bytes after an eval forward; ";
    const auto out = models::generate(sharded, prompt, {.max_new_tokens = 16, .top_k = 4, .seed = 1});
    got[std::size_t(c.rank())].assign(out.span().begin(), out.span().end());
    const auto ended = models::generate(sharded, prompt, until);
    got_until[std::size_t(c.rank())].assign(ended.span().begin(), ended.span().end());
    const auto left = models::generate(sharded, padded, masked);
    got_padded[std::size_t(c.rank())].assign(left.span().begin(), left.span().end());
    if (!sharded.context().position_ids().empty() || !sharded.context().key_padding_mask().empty() ||
        sharded.context().logits_to_keep() != 0)
      w += "generate left its padding or logits_to_keep in the engine's context; ";
    if (l.current(category::gathered_parameters) != 0) w += "gathered bytes after generate; ";
    try {
      sharded.backward(Tensor<float>({2, 8, 96}));
      w += "backward in eval did not raise; ";
    } catch (const std::exception& ex) {
      if (std::string(ex.what()).find("backward in eval mode") == std::string::npos) w += cat("backward: ", ex.what());
    }
  });
  for (const auto& w : why) CHECK(w == "");
  for (const auto& err : logits) CHECK(err <= 1e-5);
  for (const auto& g : got) CHECK(g == std::vector<std::int64_t>(want.span().begin(), want.span().end()));
  for (const auto& g : got_until)
    CHECK(g == std::vector<std::int64_t>(want_until.span().begin(), want_until.span().end()));
  for (const auto& g : got_padded)
    CHECK(g == std::vector<std::int64_t>(want_padded.span().begin(), want_padded.span().end()));
}

// A sharded model in training mode with dropout: generate() runs its forwards in eval
// (the ranks would otherwise draw different dropout masks and tokens), with and
// without the KV cache, and leaves the model in training mode.
TEST_CASE("generate on a sharded model in training mode picks the unsharded model's tokens and trains on",
          "[models][shard][generate]") {
  using Model = models::GPT2LMHeadModel<float>;
  auto config = models::read_hf_config<models::gpt2_config>(hf_dir / "gpt2" / "initial");
  config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.5;
  const auto prompt = rows(expected<Model>().ids, 0, 2);
  Model plain(config);
  nn::Replicated<float, Model> owner(plain, 0);
  models::load_hf(owner, hf_dir / "gpt2" / "initial");
  const models::generate_options o{.max_new_tokens = 16, .top_k = 4, .seed = 1};
  const auto want = models::generate(plain, prompt, o);
  const std::vector<std::int64_t> want_ids(want.span().begin(), want.span().end());

  std::vector<std::string> why(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto& w = why[std::size_t(c.rank())];
    Model model(config);
    auto sharded = shard::fully_shard<fixture_sgd>(model, c, shard::AnyStrategy(shard::FullShard{}),
                                                   {.wrap = shard::wrap_types<models::GPT2Block<float>>{}});
    models::load_hf(sharded, hf_dir / "gpt2" / "initial");
    for (const bool cache : {true, false}) {
      auto with = o;
      with.use_cache = cache;
      const auto out = models::generate(sharded, prompt, with);
      if (std::vector<std::int64_t>(out.span().begin(), out.span().end()) != want_ids)
        w += cat("other tokens with use_cache ", cache, "; ");
      if (!sharded.training()) w += "left in eval; ";
    }
    const auto y = sharded.forward(prompt);  // and a training pass runs after it
    sharded.backward(Tensor<float>(y.shape()));
  });
  for (const auto& w : why) CHECK(w == "");
}

// Ranks that would generate apart raise together, naming what differs: the prompt,
// the options, or (another rank's parameters) the tokens picked; a rank whose pick
// fails (a NaN logit) raises its own error and the others name it.
TEST_CASE("generate on a sharded model raises on every rank when the ranks disagree", "[models][shard][generate]") {
  using Model = models::GPT2LMHeadModel<float>;
  const auto prompt = rows(expected<Model>().ids, 0, 2);
  const models::generate_options o{.max_new_tokens = 8, .top_k = 4, .seed = 1};
  enum class fault { prompt, seed, parameters, nan, mask, callback };
  for (const fault f : {fault::prompt, fault::seed, fault::parameters, fault::nan, fault::mask, fault::callback}) {
    std::vector<std::string> what(2);
    std::vector<int> training(2, 0);
    comm::launch(2, [&](comm::ThreadComm& c) {
      Model model = golden_model<Model>();
      auto sharded = shard::fully_shard<fixture_sgd>(model, c, shard::AnyStrategy(shard::NoShard{}),
                                                     {.wrap = shard::wrap_types<models::GPT2Block<float>>{}});
      models::load_hf(sharded, hf_dir / "gpt2" / "initial");
      auto mine = rows(prompt, 0, prompt.dim(0));  // its own copy (a Tensor copy shares storage)
      auto with = o;
      if (c.rank() == 1) {  // NoShard: each rank computes with its own replica of the values
        const auto bias = model.transformer.ln_f.bias.values();
        if (f == fault::prompt) mine[5] = (mine[5] + 1) % 96;
        if (f == fault::seed) with.seed = 2;
        if (f == fault::parameters)
          for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = float(i % 7) - 3;
        if (f == fault::nan) bias[0] = NAN;
        if (f == fault::callback)  // rank 1's streamer fails at the third step, rank 0's does not
          with.on_tokens = [n = 0](std::span<const std::int64_t>, std::int64_t) mutable {
            if (++n == 3) throw error("the streamer failed");
          };
      }
      if (f == fault::mask) {  // rank 1 pads row 0 by one token more
        with.attention_mask = Tensor<std::int64_t>({prompt.dim(0), prompt.dim(1)});
        std::fill_n(with.attention_mask.data(), with.attention_mask.numel(), std::int64_t(1));
        with.attention_mask[0] = 0;
        if (c.rank() == 1) with.attention_mask[1] = 0;
      }
      try {
        models::generate(sharded, mine, with);
      } catch (const std::exception& e) {
        what[std::size_t(c.rank())] = e.what();
      }
      training[std::size_t(c.rank())] = sharded.training();  // back in training mode after the raise
    });
    INFO("fault " << int(f) << ": rank 0: " << what[0] << "; rank 1: " << what[1]);
    CHECK(training == std::vector<int>{1, 1});
    const char* differ[] = {"different prompts", "different options", "picked different tokens for row ", "",
                            "different prompts (or attention masks)", ""};
    for (int r = 0; r < 2; ++r) {
      CHECK(what[std::size_t(r)].starts_with(cat("rank ", r, ": ")));
      if (f != fault::nan && f != fault::callback) CHECK(what[std::size_t(r)].find(differ[int(f)]) != std::string::npos);
    }
    if (f == fault::nan) {
      CHECK(what[1].find("is NaN (row 0, position 8)") != std::string::npos);
      CHECK(what[0].find("stopped because rank 1 failed: generate: the logit of token") != std::string::npos);
    }
    if (f == fault::callback) {  // rank 0 is not left waiting in the next forward's gathers
      CHECK(what[1].find("the streamer failed") != std::string::npos);
      CHECK(what[0].find("stopped because rank 1 failed: the streamer failed") != std::string::npos);
    }
  }
}

// ---- LoRA on the decoders, against Hugging Face PEFT (tests/golden/peft, written by
// make_peft_goldens.py: PEFT's adapters on the models above, trained 20 AdamW steps) ----

namespace {

const fs::path peft_dir = fs::path(SHARDLIB_GOLDEN_DIR) / "peft";

// What make_peft_goldens.py computed with PEFT in float64.
struct peft_expected {
  Tensor<std::int64_t> ids, targets;
  std::vector<double> losses;  // losses[k] after k AdamW steps of the adapters
  Tensor<double> logits;       // the trained adapted model's
};
template <class M>
peft_expected expected_peft() {
  const auto f = io::safetensors::load(peft_dir / golden_name<M> / "expected.safetensors");
  return {golden::read<std::int64_t>(f, "input_ids"), models::causal_lm_targets(golden::read<std::int64_t>(f, "labels")),
          f.template get<double>("losses"), logits_of(f)};
}
// PEFT's step: torch.optim.AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
// over the adapters (the frozen base has no gradient and is not stepped).
optim::AdamW peft_adamw() { return {{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01}}; }

// The golden model with the adapters PEFT's initial adapter_config.json describes.
template <class M>
M adapted_golden_model() {
  M model = golden_model<M>();
  const auto peft = models::read_peft_config(peft_dir / golden_name<M> / "initial");
  nn::add_lora(model, peft.target_modules, peft.lora);
  return model;
}

// The file's tensors by name, as float.
std::map<std::string, std::vector<float>> tensors_of(const fs::path& file) {
  std::map<std::string, std::vector<float>> out;
  const auto f = io::safetensors::load(file);
  for (const auto& t : f.tensors()) out[t.name] = f.get<float>(t.name);
  return out;
}

// The largest difference of `ours` (the model's adapters, by PEFT's file names) from the
// file's, relative to max(|w|, lr): 1e-4 is the base goldens' bound for trained weights.
test_support::max_error adapters_error(const std::map<std::string, std::vector<float>>& ours, const fs::path& file) {
  test_support::max_error e;
  const auto want = tensors_of(file);
  REQUIRE(ours.size() == want.size());
  for (const auto& [name, w] : want) {
    INFO(name);
    REQUIRE(ours.contains(name));
    e.relative(ours.at(name), w, 1e-2);
  }
  return e;
}

}  // namespace

// PEFT's adapter_config.json read as add_lora takes it; add_lora adapts the Linears those
// targets name ("mlp.c_proj" the MLP's alone) and freezes everything else; the base model's
// checkpoint loads into the base layers (GPT-2's transposed under their base_layer names),
// not reporting the adapters, and PEFT's initial adapter (lora_B zero) leaves transformers'
// logits as they were (1e-5 of the largest, as the base test).
TEMPLATE_TEST_CASE("PEFT's LoRA adapters on GPT-2 and LLaMA: the config, the targets, the base checkpoint",
                   "[models][hf][lora]", models::GPT2LMHeadModel<float>, models::LlamaForCausalLM<float>) {
  using Model = TestType;
  constexpr bool gpt2 = std::is_same_v<typename Model::config_type, models::gpt2_config>;
  const auto peft = models::read_peft_config(peft_dir / golden_name<Model> / "initial");
  CHECK(peft.lora == nn::lora_options{.r = 4, .alpha = 8, .rslora = !gpt2});
  Model model = golden_model<Model>();
  const auto adapted = nn::add_lora(model, peft.target_modules, peft.lora);
  const std::vector<std::string> want =
      gpt2 ? std::vector<std::string>{"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj",
                                      "transformer.h.1.attn.c_attn", "transformer.h.1.mlp.c_proj"}
           : std::vector<std::string>{"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                      "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                                      "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj"};
  CHECK(adapted == want);
  std::size_t trained = 0;
  model.parameters([&](std::string_view name, auto& p) {
    const bool adapter = name.ends_with("lora_A.weight") || name.ends_with("lora_B.weight");
    CHECK(p.requires_grad == adapter);
    trained += p.requires_grad ? p.numel() : 0;
  });
  CHECK(trained == (gpt2 ? 2304u : 1856u));  // PEFT's count of trainable parameters

  nn::Replicated<float, Model> owner(model, 0);
  CHECK(models::load_hf(owner, hf_dir / golden_name<Model> / "initial").ok());
  CHECK(models::load_peft(owner, peft_dir / golden_name<Model> / "initial").ok());
  nn::context ctx({.training = false});
  CHECK(logits_error(ctx.forward(model, expected<Model>().ids), expected<Model>().logits) <= 1e-5);

  Model plain = golden_model<Model>();
  CHECK_THROWS_WITH(nn::add_lora(plain, {"q_proj", "c_attm"}),
                    Catch::Matchers::Contains("add_lora: target '") &&
                        Catch::Matchers::Contains("' names no Linear of the model (a module's dotted name"));
}

// 20 AdamW steps of the adapters as PEFT took them, unsharded and FullShard over 2 ranks
// (each rank one sample of the two; both count 6 tokens): the losses within 1e-4
// relative, the trained adapters within 1e-4 of max(|w|, lr) of PEFT's (float32 here,
// float64 there), and the trained logits within 1e-4 of the largest. save_peft writes
// PEFT's file names, and its files load back into another model bit for bit.
TEMPLATE_TEST_CASE("GPT-2 and LLaMA with LoRA train as PEFT trains them, unsharded and sharded",
                   "[models][hf][lora][shard]", models::GPT2LMHeadModel<float>, models::LlamaForCausalLM<float>) {
  using Model = TestType;
  const peft_expected e = expected_peft<Model>();
  const fs::path trained_file = peft_dir / golden_name<Model> / "trained" / "adapter_model.safetensors";
  const auto by_file_name = [](auto& sharded) {  // the adapters under PEFT's names (collective)
    std::map<std::string, std::vector<float>> out;
    for (auto& [name, t] : sharded.full_state_dict(false))
      if (name.find(".lora_") != std::string::npos) out["base_model.model." + name].assign(t.span().begin(), t.span().end());
    return out;
  };
  {
    INFO("unsharded");
    Model model = adapted_golden_model<Model>();
    nn::Replicated<float, Model> owner(model, 0);
    models::load_hf(owner, hf_dir / golden_name<Model> / "initial");
    models::load_peft(owner, peft_dir / golden_name<Model> / "initial");
    const auto err = train_unsharded(model, owner, e.ids, e.targets, e.losses, peft_adamw());
    std::printf("peft %-5s unsharded: 20 AdamW steps of the adapters, loss %.6f -> %.6f, largest relative "
                "difference %.2e\n", golden_name<Model>, e.losses.front(), e.losses.back(), err.value());
    CHECK(err.count() == 21);
    CHECK(err <= 1e-4);
    nn::context eval({.training = false});
    CHECK(logits_error(eval.forward(model, e.ids), e.logits) <= 1e-4);
    std::map<std::string, std::vector<float>> ours;
    model.parameters([&](std::string_view name, nn::Param<float>& p) {
      if (name.find(".lora_") != std::string_view::npos)
        ours[cat("base_model.model.", name)].assign(p.values().begin(), p.values().end());
    });
    CHECK(adapters_error(ours, trained_file) <= 1e-4);
  }
  const fs::path out = fs::temp_directory_path() / cat("shardlib_test_peft_", golden_name<Model>, "_", ::getpid());
  fs::remove_all(out);
  std::vector<std::vector<double>> losses(2), losses_without(2);
  std::vector<std::map<std::string, std::vector<float>>> trained(2), reloaded(2);
  // Without gradient storage for the frozen base (options.frozen_grads = false): every layer
  // of the decoders skips a frozen parameter's null grad; the same losses, bit for bit.
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model model = adapted_golden_model<Model>();
    auto sharded = shard::fully_shard<optim::AdamW>(
        model, c, shard::FullShard{}, {.wrap = shard::wrap_types<typename Model::block_type>{}, .frozen_grads = false});
    models::load_hf(sharded, hf_dir / golden_name<Model> / "initial");
    models::load_peft(sharded, peft_dir / golden_name<Model> / "initial");
    const int r = c.rank();
    const auto x = rows(e.ids, r, 1), y = rows(e.targets, r, 1);
    optim::AdamW adamw = peft_adamw();
    for (std::size_t k = 0; k + 1 < e.losses.size(); ++k)
      losses_without[std::size_t(r)].push_back(train_step(sharded, adamw, x, y));
    losses_without[std::size_t(r)].push_back(nn::cross_entropy(sharded.forward(x), y).loss);
  });
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model model = adapted_golden_model<Model>();
    auto sharded = shard::fully_shard<optim::AdamW>(model, c, shard::FullShard{},
                                                    {.wrap = shard::wrap_types<typename Model::block_type>{}});
    models::load_hf(sharded, hf_dir / golden_name<Model> / "initial");
    models::load_peft(sharded, peft_dir / golden_name<Model> / "initial");
    const int r = c.rank();
    const auto x = rows(e.ids, r, 1), y = rows(e.targets, r, 1);
    optim::AdamW adamw = peft_adamw();
    for (std::size_t k = 0; k + 1 < e.losses.size(); ++k) losses[std::size_t(r)].push_back(train_step(sharded, adamw, x, y));
    losses[std::size_t(r)].push_back(nn::cross_entropy(sharded.forward(x), y).loss);
    trained[std::size_t(r)] = by_file_name(sharded);
    models::save_peft(sharded, out);

    Model other = adapted_golden_model<Model>();
    auto again = shard::fully_shard<optim::AdamW>(other, c, shard::FullShard{}, {.seed = 5});
    const auto report = models::load_peft(again, out);
    const auto adapters = by_file_name(again);
    if (report.ok()) reloaded[std::size_t(r)] = adapters;
  });
  test_support::max_error err;
  for (std::size_t k = 0; k < e.losses.size(); ++k) err.relative((losses[0][k] + losses[1][k]) / 2, e.losses[k], 0);
  std::printf("peft %-5s FullShard W=2: 20 AdamW steps of the adapters, largest relative difference of the loss "
              "%.2e\n", golden_name<Model>, err.value());
  CHECK(err.count() == 21);
  CHECK(err <= 1e-4);
  CHECK(losses_without == losses);  // == fails on NaN
  CHECK(adapters_error(trained[0], trained_file) <= 1e-4);
  CHECK(trained[1] == trained[0]);  // == fails on NaN
  CHECK(tensors_of(out / "adapter_model.safetensors") == trained[0]);
  CHECK(reloaded[0] == trained[0]);
  CHECK(reloaded[1] == trained[0]);
  const auto written = models::read_peft_config(out), peft = models::read_peft_config(peft_dir / golden_name<Model> / "initial");
  CHECK(written.lora == peft.lora);
  fs::remove_all(out);
}

// PEFT's merge_and_unload: PEFT's trained adapter merged into the base checkpoint
// (models::merge_peft) and loaded into a plain model gives the trained adapted model's
// logits as PEFT computed them (1e-5 of the largest: float32 weights against float64, the
// adapter rounded to F32 as saved; measured 3.2e-7 for GPT-2, 1.9e-7 for LLaMA); the file
// holds the base model's names and nothing else.
TEMPLATE_TEST_CASE("a PEFT adapter merged into its base checkpoint gives PEFT's logits", "[models][hf][lora]",
                   models::GPT2LMHeadModel<float>, models::LlamaForCausalLM<float>) {
  using Model = TestType;
  const fs::path out = fs::temp_directory_path() / cat("shardlib_test_merged_", golden_name<Model>, "_", ::getpid());
  fs::remove_all(out);
  models::merge_peft(hf_dir / golden_name<Model> / "initial", peft_dir / golden_name<Model> / "trained", out);
  CHECK(file_names(out) == file_names(hf_dir / golden_name<Model> / "initial"));
  Model model(models::read_hf_config<typename Model::config_type>(out));
  nn::Replicated<float, Model> owner(model, 1);
  CHECK(models::load_hf(owner, out).ok());
  const peft_expected e = expected_peft<Model>();
  nn::context ctx({.training = false});
  const auto err = logits_error(ctx.forward(model, e.ids), e.logits);
  INFO(golden_name<Model> << ": logits differ by " << err);
  CHECK(err <= 1e-5);
  fs::remove_all(out);
  std::ofstream(out.string() + ".json") << R"({"model_type": "bert"})";
  CHECK_THROWS_WITH(models::merge_peft(out.string() + ".json", peft_dir / golden_name<Model> / "trained", out),
                    Catch::Matchers::Contains("model_type \"bert\" is not one the library builds"));
  fs::remove(out.string() + ".json");
}

// What the adapter cannot be is refused, naming the file and the field; a model adapted
// elsewhere or otherwise than the config says is refused naming the module (sharded: on
// every rank); save_peft needs adapters sharing one r and alpha.
TEST_CASE("PEFT adapter files shardlib cannot take, and models adapted otherwise, are refused", "[models][hf][lora]") {
  using Model = models::GPT2LMHeadModel<float>;
  using Catch::Matchers::Contains;
  const fs::path dir = fs::temp_directory_path() / cat("shardlib_test_peft_refused_", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ifstream in(peft_dir / "gpt2" / "initial" / "adapter_config.json");
  const auto original = nlohmann::json::parse(in);
  struct refusal {
    const char* key;
    nlohmann::json value;
    const char* message;
  };
  for (const auto& [key, value, message] :
       {refusal{"peft_type", "IA3", "peft_type must be \"LORA\", got \"IA3\""},
        refusal{"r", 0, "r must be a positive integer"},
        refusal{"lora_dropout", 1.5, "lora_dropout must be in [0, 1), got 1.5"},
        refusal{"target_modules", ".*attn.*", "target_modules must be a list of module names"},
        refusal{"bias", "all", "bias \"all\" trains the base layers' biases too"},
        refusal{"use_dora", true, "use_dora: DoRA is not supported"},
        refusal{"rank_pattern", {{"c_attn", 8}}, "rank_pattern: per-module ranks and alphas are not supported"},
        refusal{"modules_to_save", {"lm_head"}, "modules_to_save is not supported (it must be null)"}}) {
    INFO(key);
    auto j = original;
    j[key] = value;
    std::ofstream(dir / "adapter_config.json") << j.dump();
    CHECK_THROWS_WITH(models::read_peft_config(dir), Contains(cat((dir / "adapter_config.json").string(), ": ", message)));
  }
  CHECK_THROWS_WITH(models::read_peft_config(dir / "none"), Contains("cannot open the adapter's adapter_config.json"));
  {
    auto j = original;  // a target the model has no Linear for: refused, as PEFT refuses it
    j["target_modules"].push_back("q_proj");
    std::ofstream(dir / "adapter_config.json") << j.dump();
    Model model = golden_model<Model>();
    nn::add_lora(model, {"c_attn", "mlp.c_proj"}, {.r = 4, .alpha = 8});
    nn::Replicated<float, Model> owner(model, 0);
    CHECK_THROWS_WITH(models::load_peft(owner, dir), Contains("target_modules' 'q_proj' names no Linear of the model"));
  }

  const fs::path golden = peft_dir / "gpt2" / "initial";
  const auto load_into = [&](const std::vector<std::string>& targets, nn::lora_options o) {
    Model model = golden_model<Model>();
    nn::add_lora(model, targets, o);
    nn::Replicated<float, Model> owner(model, 0);
    models::load_peft(owner, golden);
  };
  CHECK_THROWS_WITH(load_into({"c_attn"}, {.r = 4, .alpha = 8}),
                    Contains("transformer.h.0.mlp.c_proj is a target of the adapter but has no LoRA adapter in the model"));
  CHECK_THROWS_WITH(load_into({"c_attn", "c_proj"}, {.r = 4, .alpha = 8}),
                    Contains("transformer.h.0.attn.c_proj has a LoRA adapter in the model but is not among the "
                             "adapter's target_modules"));
  CHECK_THROWS_WITH(load_into({"c_attn", "mlp.c_proj"}, {.r = 8, .alpha = 8}),
                    Contains("transformer.h.0.attn.c_attn's adapter has r 8, alpha 8, rslora 0, dropout 0; the file's "
                             "r 4, lora_alpha 8, use_rslora 0, lora_dropout 0"));
  std::vector<std::string> errors(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    Model model = golden_model<Model>();
    nn::add_lora(model, {"c_attn"}, {.r = 4, .alpha = 8});
    auto sharded = shard::fully_shard<optim::AdamW>(model, c, shard::FullShard{}, {});
    try {
      models::load_peft(sharded, golden);
    } catch (const io_error& e) {
      errors[std::size_t(c.rank())] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) CHECK_THAT(errors[std::size_t(r)], Contains(cat("rank ", r, ": loading the adapter")));

  Model plain = golden_model<Model>();
  nn::Replicated<float, Model> plain_owner(plain, 0);
  CHECK_THROWS_WITH(models::save_peft(plain_owner, dir / "out"), Contains("the model has no LoRA adapters"));
  Model mixed = golden_model<Model>();
  mixed.transformer.h[0].attn.c_attn.add_lora({.r = 4});
  mixed.transformer.h[1].attn.c_attn.add_lora({.r = 8});
  nn::Replicated<float, Model> mixed_owner(mixed, 0);
  CHECK_THROWS_WITH(models::save_peft(mixed_owner, dir / "out"),
                    Contains("the adapters differ (transformer.h.0.attn.c_attn has r 4, alpha 8, rslora 0, dropout 0; "
                             "transformer.h.1.attn.c_attn has r 8, alpha 8, rslora 0, dropout 0)"));
  CHECK(!fs::exists(dir / "out" / "adapter_model.safetensors"));
  fs::remove_all(dir);
}

}  // namespace test_models
