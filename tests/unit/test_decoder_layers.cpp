// The decoder language models' building blocks: RMSNorm, SiLU and tanh-GELU,
// LlamaMLP (SwiGLU) and GPT2MLP with Hugging Face's names, learned positions with
// an offset, and token-level cross-entropy. Names and shapes, forward against
// float64 loops, backward against finite differences, error messages, PyTorch's
// goldens (tests/golden/make_layer_goldens.py), and a small stack of them trained
// sharded against unsharded training.
#include "shardlib/comm/launch.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/nn/activation.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/feed_forward.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/rms_norm.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/shard/sharded_model.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "support/compare.hpp"
#include "support/golden.hpp"
#include "support/gradcheck.hpp"

namespace test_decoder_layers {

using namespace shardlib;
using namespace shardlib::nn;
using gradcheck::random_tensor;

namespace {

// "name[shape]" of every parameter, in the layer's order.
template <Layer L>
std::vector<std::string> parameter_names(L layer) {
  Replicated<double, L> owner(layer, 0);
  std::vector<std::string> names;
  for (const auto& e : owner.layout().entries) names.push_back(e.name + cat(e.shape));
  return names;
}
template <Composite L>
std::vector<std::string> child_names(L& layer) {
  std::vector<std::string> names;
  layer.children([&](std::string_view name, auto&) { names.emplace_back(name); });
  return names;
}

template <class T>
Tensor<T> converted(const Tensor<double>& x) {
  Tensor<T> t(x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) t[i] = T(x[i]);
  return t;
}

// Moves every parameter by U(-0.5, 0.5), so unit weights and zero biases are not all the tests see.
template <class T, Layer L>
void perturb(Replicated<T, L>& owner, std::uint64_t stream) {
  counter_rng rng(77, stream);
  for (std::size_t i = 0; i < owner.values().size(); ++i) owner.values()[i] += T(rng.uniform_double(i) - 0.5);
}

// y[r, o] = sum_k x[r, k] w[o, k] + b[o] in double (b empty: no bias).
std::vector<double> linear_ref(const std::vector<double>& x, std::int64_t in, std::span<const double> w,
                               std::span<const double> b) {
  const std::int64_t rows = std::int64_t(x.size()) / in, out = std::int64_t(w.size()) / in;
  std::vector<double> y(std::size_t(rows * out));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : b[std::size_t(o)];
      for (std::int64_t k = 0; k < in; ++k) s += x[std::size_t(r * in + k)] * w[std::size_t(o * in + k)];
      y[std::size_t(r * out + o)] = s;
    }
  return y;
}

std::vector<double> values_of(const Tensor<double>& t) { return {t.data(), t.data() + t.numel()}; }

// A gradient check passes when the analytic and central-difference gradients agree
// to 1e-6 norm-wise (gradcheck.hpp: the differences' own error is ~1e-10).
template <Layer L>
void check_gradients(L layer, const Tensor<double>& x) {
  const auto r = gradcheck::check(layer, x);
  INFO("worst: " << r.worst << " " << r.max_rel_error);
  CHECK(r.max_rel_error < 1e-6);
  CHECK(r.compared > 20);
}

constexpr std::int64_t d_model = 16, dim_ff = 32, vocab = 10, max_positions = 8;

}  // namespace

TEST_CASE("decoder layers model Layer and carry Hugging Face's parameter names", "[nn][decoder]") {
  STATIC_REQUIRE(check_layer<RMSNorm<float>>());
  STATIC_REQUIRE(check_layer<SiLU<double>>());
  STATIC_REQUIRE(check_layer<PositionEmbedding<float>>());
  STATIC_REQUIRE(Composite<LlamaMLP<float>>);
  STATIC_REQUIRE(Composite<GPT2MLP<double>>);

  CHECK(parameter_names(RMSNorm<double>(6)) == std::vector<std::string>{"weight[6]"});
  CHECK(parameter_names(SiLU<double>{}).empty());
  CHECK(parameter_names(PositionEmbedding<double>(8, 4)) == std::vector<std::string>{"weight[8, 4]"});
  CHECK(parameter_names(LlamaMLP<double>({.hidden_size = 4, .intermediate_size = 10})) ==
        std::vector<std::string>{"gate_proj.weight[10, 4]", "up_proj.weight[10, 4]", "down_proj.weight[4, 10]"});
  CHECK(parameter_names(LlamaMLP<double>({.hidden_size = 4, .intermediate_size = 10, .bias = true})) ==
        std::vector<std::string>{"gate_proj.weight[10, 4]", "gate_proj.bias[10]", "up_proj.weight[10, 4]",
                                 "up_proj.bias[10]", "down_proj.weight[4, 10]", "down_proj.bias[4]"});
  CHECK(parameter_names(GPT2MLP<double>({.n_embd = 4})) ==
        std::vector<std::string>{"c_fc.weight[16, 4]", "c_fc.bias[16]", "c_proj.weight[4, 16]", "c_proj.bias[4]"});
  CHECK(parameter_names(GPT2MLP<double>({.n_embd = 4, .n_inner = 6})) ==
        std::vector<std::string>{"c_fc.weight[6, 4]", "c_fc.bias[6]", "c_proj.weight[4, 6]", "c_proj.bias[4]"});

  LlamaMLP<float> llama({.hidden_size = 4, .intermediate_size = 10});
  GPT2MLP<float> gpt2({.n_embd = 4});
  CHECK(child_names(llama) == std::vector<std::string>{"gate_proj", "up_proj", "down_proj", "act_fn"});
  CHECK(child_names(gpt2) == std::vector<std::string>{"c_fc", "c_proj", "act", "dropout"});
  CHECK(gpt2.act.approximate() == gelu_approx::tanh);
  CHECK(gpt2.dropout.p() == 0.1);  // GPT2Config's resid_pdrop

  // Init as the libraries': RMSNorm's weight ones, the positions N(0, 1) as nn.Embedding.
  RMSNorm<float> norm(5);
  Replicated<float, RMSNorm<float>> owner(norm, 9);
  for (float w : owner.value("weight")) CHECK(w == 1.0f);
  CHECK(norm.eps() == 1e-6);
  PositionEmbedding<float> pos(8, 4);
  CHECK(pos.weight.init.kind == init_rule::normal);
  CHECK(pos.weight.init.b == 1.0);
}

TEMPLATE_TEST_CASE("RMSNorm: y = weight * x / sqrt(mean(x^2) + eps), as a float64 loop", "[nn][decoder]", float,
                   double) {
  using T = TestType;
  const std::int64_t d = 24, rows = 6;
  for (double eps : {1e-6, 0.5}) {  // a large eps shows that it is used
    RMSNorm<T> norm(d, eps);
    Replicated<T, RMSNorm<T>> owner(norm, 1);
    perturb(owner, 2);
    const auto x64 = random_tensor({2, 3, d}, 3, 2.0);
    const auto x = converted<T>(x64);
    context ctx;
    const auto y = ctx.forward(norm, x);
    REQUIRE(y.shape() == x.shape());
    test_support::max_error worst;
    for (std::int64_t r = 0; r < rows; ++r) {
      double sq = 0;
      for (std::int64_t i = 0; i < d; ++i) sq += double(x[r * d + i]) * double(x[r * d + i]);
      const double rstd = 1 / std::sqrt(sq / double(d) + eps);
      for (std::int64_t i = 0; i < d; ++i)
        worst.relative(double(y[r * d + i]), double(owner.value("weight")[std::size_t(i)]) * double(x[r * d + i]) * rstd,
                       1e-3);
    }
    // float: a sum of 24 squares, a square root and two products, each rounded once (~2e-6 at worst).
    INFO("eps " << eps << ": " << worst);
    CHECK(worst <= (std::is_same_v<T, float> ? 1e-5 : 1e-13));
  }
}

TEST_CASE("SiLU and tanh-GELU: the closed forms, finite at the extremes", "[nn][decoder]") {
  // |x| <= 3: further out 1 + tanh(inner) cancels, and an ulp of difference in the
  // constant sqrt(2/pi) would show as a large relative error.
  const auto x = random_tensor({40}, 4, 3.0);
  context ctx;
  SiLU<double> silu_layer;
  GELU<double> gelu_layer(gelu_approx::tanh);
  const auto ys = ctx.forward(silu_layer, x), yg = ctx.forward(gelu_layer, x);
  test_support::max_error worst;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double v = x[i];
    worst.relative(ys[i], v / (1 + std::exp(-v)), 1e-12);
    const double inner = std::sqrt(2 / std::acos(-1.0)) * (v + 0.044715 * v * v * v);
    worst.relative(yg[i], 0.5 * v * (1 + std::tanh(inner)), 1e-12);
  }
  CHECK(worst <= 1e-13);

  // Far out, exp overflows to inf: silu and its gradient go to 0 (or x and 1), never NaN.
  for (float v : {-1000.0f, -100.0f, 100.0f, 1000.0f}) {
    INFO("x = " << v);
    CHECK(std::isfinite(silu(v)));
    CHECK(std::isfinite(silu_backward(v, 1.0f)));
    CHECK(silu(v) == (v < 0 ? 0.0f : v));
    CHECK(silu_backward(v, 1.0f) == (v < 0 ? 0.0f : 1.0f));
  }
}

TEST_CASE("LlamaMLP: down_proj(silu(gate_proj(x)) * up_proj(x)), as a float64 loop", "[nn][decoder]") {
  for (bool bias : {false, true}) {
    LlamaMLP<double> mlp({.hidden_size = 5, .intermediate_size = 7, .bias = bias});
    Replicated<double, LlamaMLP<double>> owner(mlp, 5);
    perturb(owner, 6);
    const auto x = random_tensor({3, 2, 5}, 7, 1.5);
    context ctx;
    const auto y = ctx.forward(mlp, x);
    REQUIRE(y.shape() == x.shape());
    auto b = [&](const char* name) {
      return bias ? std::span<const double>(owner.value(std::string(name) + ".bias")) : std::span<const double>{};
    };
    const auto g = linear_ref(values_of(x), 5, owner.value("gate_proj.weight"), b("gate_proj"));
    const auto u = linear_ref(values_of(x), 5, owner.value("up_proj.weight"), b("up_proj"));
    std::vector<double> h(g.size());
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    const auto want = linear_ref(h, 7, owner.value("down_proj.weight"), b("down_proj"));
    test_support::max_error worst;
    worst.relative(y.span(), want, 1e-6);
    INFO("bias " << bias << ": " << worst);
    CHECK(worst <= 1e-12);
  }
}

TEST_CASE("GPT2MLP: c_proj(gelu_tanh(c_fc(x))), dropout only in training", "[nn][decoder]") {
  GPT2MLP<double> mlp({.n_embd = 4, .resid_pdrop = 0.5});
  Replicated<double, GPT2MLP<double>> owner(mlp, 8);
  perturb(owner, 9);
  const auto x = random_tensor({2, 3, 4}, 10, 1.5);
  context eval({.training = false});
  const auto y = eval.forward(mlp, x);
  auto h = linear_ref(values_of(x), 4, owner.value("c_fc.weight"), owner.value("c_fc.bias"));
  for (auto& v : h) v = gelu(v, gelu_approx::tanh);
  const auto want = linear_ref(h, 16, owner.value("c_proj.weight"), owner.value("c_proj.bias"));
  test_support::max_error worst;
  worst.relative(y.span(), want, 1e-6);
  CHECK(worst <= 1e-12);

  // Training: each output is dropped (0) or kept and scaled by 1 / (1 - p) = 2.
  context train({.training = true, .seed = 3});
  const auto yt = train.forward(mlp, x);
  int dropped = 0;
  test_support::max_error kept;
  for (std::int64_t i = 0; i < yt.numel(); ++i) {
    if (yt[i] == 0) ++dropped;
    else kept.relative(yt[i], 2 * want[std::size_t(i)], 1e-6);
  }
  CHECK(kept <= 1e-12);
  CHECK(dropped > 0);
  CHECK(dropped < yt.numel());
}

TEST_CASE("PositionEmbedding adds rows offset..offset+seq-1 and sends their gradient there", "[nn][decoder]") {
  const std::int64_t d = 3, seq = 4, batch = 2;
  PositionEmbedding<double> pos(max_positions, d);
  Replicated<double, PositionEmbedding<double>> owner(pos, 11);
  const auto w = owner.value("weight");
  const auto x = random_tensor({batch, seq, d}, 12);
  const auto dy = random_tensor({batch, seq, d}, 13);
  context ctx;
  for (std::int64_t offset : {0, 4}) {
    INFO("offset " << offset);
    pos.set_offset(offset);
    owner.zero_grad();
    const auto y = ctx.forward(pos, x);
    pos.set_offset(0);  // backward uses the offset its forward ran with
    const auto dx = ctx.backward(pos, dy);
    test_support::max_error out, in, grad;
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t s = 0; s < seq; ++s)
        for (std::int64_t i = 0; i < d; ++i) {
          const std::int64_t at = (b * seq + s) * d + i;
          out.absolute(y[at], x[at] + w[std::size_t((offset + s) * d + i)]);
          in.absolute(dx[at], dy[at]);
        }
    for (std::int64_t p = 0; p < max_positions; ++p)
      for (std::int64_t i = 0; i < d; ++i) {
        const bool used = p >= offset && p < offset + seq;
        const double want = used ? dy[(p - offset) * d + i] + dy[(seq + p - offset) * d + i] : 0.0;
        grad.absolute(owner.grad("weight")[std::size_t(p * d + i)], want);
      }
    CHECK(out == 0);  // one addition each: exact
    CHECK(in == 0);
    CHECK(grad == 0);
  }

  // [seq, D] without a batch dimension works too.
  pos.set_offset(1);
  const auto y2 = ctx.forward(pos, random_tensor({seq, d}, 14));
  CHECK(y2.shape() == Shape{seq, d});
}

TEST_CASE("decoder layers' backward matches finite differences", "[nn][decoder][gradcheck]") {
  const auto x = random_tensor({2, 3, d_model}, 20, 2.0);
  SECTION("RMSNorm") { check_gradients(RMSNorm<double>(d_model), x); }
  SECTION("RMSNorm, large eps") { check_gradients(RMSNorm<double>(d_model, 0.5), x); }
  SECTION("SiLU") { check_gradients(SiLU<double>{}, x); }
  SECTION("GELU tanh") { check_gradients(GELU<double>(gelu_approx::tanh), x); }
  SECTION("LlamaMLP") { check_gradients(LlamaMLP<double>({.hidden_size = d_model, .intermediate_size = dim_ff}), x); }
  SECTION("LlamaMLP with biases") {
    check_gradients(LlamaMLP<double>({.hidden_size = d_model, .intermediate_size = dim_ff, .bias = true}), x);
  }
  SECTION("GPT2MLP with dropout in training") {  // gradcheck replays the same masks
    check_gradients(GPT2MLP<double>({.n_embd = d_model, .resid_pdrop = 0.3}), x);
  }
  SECTION("PositionEmbedding at offset 5") {
    PositionEmbedding<double> pos(max_positions, d_model);
    pos.set_offset(5);
    check_gradients(pos, x);
  }
  SECTION("a LLaMA-style block") {
    using Block = Sequential<RMSNorm<double>, LlamaMLP<double>, PositionEmbedding<double>, RMSNorm<double>>;
    check_gradients(Block{RMSNorm<double>(d_model), LlamaMLP<double>({.hidden_size = d_model, .intermediate_size = 8}),
                          PositionEmbedding<double>(max_positions, d_model), RMSNorm<double>(d_model)},
                    x);
  }
}

TEST_CASE("decoder layers' errors name the layer, the limit and what was expected", "[nn][decoder]") {
  context ctx;
  PositionEmbedding<float> pos(max_positions, 4);
  Replicated<float, PositionEmbedding<float>> owner(pos, 0);
  pos.set_offset(6);
  CHECK_THROWS_WITH(ctx.forward(pos, Tensor<float>({1, 3, 4})),
                    "PositionEmbedding(8, 4): positions 6..8 (offset 6, sequence 3) exceed the table's "
                    "max_positions 8");
  CHECK_NOTHROW(ctx.forward(pos, Tensor<float>::zeros({1, 2, 4})));  // 6..7 fits exactly
  CHECK_THROWS_WITH(pos.set_offset(-1), "PositionEmbedding(8, 4): offset must not be negative, got -1");
  CHECK_THROWS_WITH(ctx.forward(pos, Tensor<float>({2, 0, 4})),
                    "PositionEmbedding(8, 4): the input [2, 0, 4] has no positions");
  CHECK_THROWS_WITH(ctx.forward(pos, Tensor<float>({3, 5})),
                    "PositionEmbedding(8, 4): input must be [..., sequence, 4], got shape [3, 5]");
  CHECK_THROWS_WITH(ctx.backward(pos, Tensor<float>({1, 3, 4})),
                    Catch::Contains("backward needs the gradient of the last forward's output (shape [1, 2, 4])"));

  RMSNorm<float> norm(4);
  CHECK_THROWS_WITH(ctx.forward(norm, Tensor<float>({2, 4})),
                    Catch::StartsWith("RMSNorm: parameter '?' has no values bound"));
  Replicated<float, RMSNorm<float>> norm_owner(norm, 0);
  CHECK_THROWS_WITH(ctx.forward(norm, Tensor<float>({2, 5})),
                    "RMSNorm(4): input's last dimension must be 4, got shape [2, 5]");
  CHECK_THROWS_WITH(ctx.backward(norm, Tensor<float>({2, 4})), Catch::StartsWith("RMSNorm(4): backward needs"));
  CHECK_THROWS_WITH(RMSNorm<float>(0), "RMSNorm: normalized_dim must be positive, got 0");

  LlamaMLP<float> llama({.hidden_size = 4, .intermediate_size = 6});
  Replicated<float, LlamaMLP<float>> llama_owner(llama, 0);
  CHECK_THROWS_WITH(ctx.forward(llama, Tensor<float>({2, 5})),
                    "LlamaMLP(4 -> 6): input's last dimension must be 4, got shape [2, 5]");
  CHECK_THROWS_WITH(ctx.backward(llama, Tensor<float>({2, 4})), "LlamaMLP(4 -> 6): backward without a forward");
  CHECK_THROWS_WITH(LlamaMLP<float>({.hidden_size = 4}),
                    "LlamaMLP: hidden_size and intermediate_size must be positive, got 4 and 0");
  GPT2MLP<float> gpt2({.n_embd = 4});
  Replicated<float, GPT2MLP<float>> gpt2_owner(gpt2, 0);
  CHECK_THROWS_WITH(ctx.forward(gpt2, Tensor<float>({2, 5})),
                    "GPT2MLP(4 -> 16): input's last dimension must be 4, got shape [2, 5]");
}

// Token-level cross-entropy is nn::cross_entropy with logits [batch, seq, vocab]
// and targets [batch, seq]: the mean over the tokens not ignored (-100).
TEST_CASE("token-level cross-entropy: the mean over the tokens not ignored, and its gradient", "[nn][decoder][loss]") {
  const std::int64_t batch = 2, seq = 5, v = 7;
  const auto logits = random_tensor({batch, seq, v}, 30, 3.0);
  Tensor<std::int64_t> targets({batch, seq});
  for (std::int64_t i = 0; i < targets.numel(); ++i) targets[i] = (3 * i + 1) % v;
  targets[4] = targets[9] = -100;  // the last position of each sequence
  targets[6] = -100;               // and one inside

  const auto [loss, grad] = cross_entropy(logits, targets);
  REQUIRE(grad.shape() == logits.shape());
  auto reference = [&](const Tensor<double>& z) {
    double total = 0;
    int counted = 0;
    for (std::int64_t r = 0; r < batch * seq; ++r) {
      if (targets[r] == -100) continue;
      double s = 0;
      for (std::int64_t c = 0; c < v; ++c) s += std::exp(z[r * v + c]);
      total += std::log(s) - z[r * v + targets[r]];
      ++counted;
    }
    return total / counted;
  };
  CHECK(test_support::relative_error(loss, reference(logits), 1e-12) <= 1e-13);
  // Central differences on every logit (float64: ~1e-10 error, gradcheck.hpp).
  Tensor<double> z = random_tensor({batch, seq, v}, 30, 3.0);
  std::vector<double> analytic, numeric;
  for (std::int64_t i = 0; i < z.numel(); ++i) {
    const double keep = z[i], h = 1e-6;
    z[i] = keep + h;
    const double up = reference(z);
    z[i] = keep - h;
    const double down = reference(z);
    z[i] = keep;
    analytic.push_back(grad[i]);
    numeric.push_back((up - down) / (2 * h));
  }
  CHECK(gradcheck::rel_error(analytic, numeric) < 1e-6);
  for (std::int64_t c = 0; c < v; ++c) CHECK(grad[6 * v + c] == 0.0);  // an ignored token has no gradient

  // All ignored: NaN as torch (0 / 0), with a zero gradient: the batch adds
  // nothing to the gradients, and the NaN shows in the log.
  Tensor<std::int64_t> none({batch, seq});
  for (std::int64_t i = 0; i < none.numel(); ++i) none[i] = -100;
  const auto empty = cross_entropy(logits, none);
  CHECK(std::isnan(empty.loss));
  for (double g : empty.grad.span()) CHECK(g == 0.0);

  targets[3] = v;
  CHECK_THROWS_WITH(cross_entropy(logits, targets),
                    "cross_entropy: target 7 in row 3 is out of range for 7 classes (ignore_index is -100)");
  CHECK_THROWS_WITH(cross_entropy(logits, Tensor<std::int64_t>({seq, batch})),
                    Catch::StartsWith("cross_entropy: targets must have the logits' leading shape [2, 5]"));
}

TEST_CASE("decoder layers match torch", "[nn][decoder][parity]") {
  using golden::parity;
  parity("rms_norm", [](auto t) { return RMSNorm<decltype(t)>(d_model); });
  parity("silu", [](auto t) { return SiLU<decltype(t)>{}; });
  parity("llama_mlp", [](auto t) {
    return LlamaMLP<decltype(t)>({.hidden_size = d_model, .intermediate_size = dim_ff});
  });
  parity("gpt2_mlp", [](auto t) { return GPT2MLP<decltype(t)>({.n_embd = d_model, .resid_pdrop = 0}); });
  parity("position_embedding_offset", [](auto t) {
    PositionEmbedding<decltype(t)> pos(max_positions, d_model);
    pos.set_offset(2);
    return pos;
  });
  golden::loss_parity("token_cross_entropy", golden::cross_entropy_with({}));
  // torch: Sequential(Embedding, positions, RMSNorm, LlamaMLP, RMSNorm, GPT2MLP, Linear) with token cross-entropy.
  parity("decoder_stack", [](auto t) {
    using T = decltype(t);
    return Sequential<Embedding<T>, PositionEmbedding<T>, RMSNorm<T>, LlamaMLP<T>, RMSNorm<T>, GPT2MLP<T>, Linear<T>>(
        Embedding<T>(vocab, d_model), PositionEmbedding<T>(max_positions, d_model), RMSNorm<T>(d_model),
        LlamaMLP<T>({.hidden_size = d_model, .intermediate_size = dim_ff}), RMSNorm<T>(d_model),
        GPT2MLP<T>({.n_embd = d_model, .resid_pdrop = 0}), Linear<T>(d_model, vocab));
  }, golden::cross_entropy_with({}));
}

namespace {

using LlamaBlock = Sequential<RMSNorm<float>, LlamaMLP<float>>;
using GPT2Block = Sequential<RMSNorm<float>, GPT2MLP<float>>;
using TinyDecoder =
    Sequential<Embedding<float>, PositionEmbedding<float>, Stack<LlamaBlock>, GPT2Block, RMSNorm<float>, Linear<float>>;
constexpr std::int64_t tiny_vocab = 11, tiny_d = 8, tiny_seq = 6;

TinyDecoder make_tiny_decoder() {
  return TinyDecoder{Embedding<float>(tiny_vocab, tiny_d), PositionEmbedding<float>(tiny_seq, tiny_d),
                     Stack<LlamaBlock>(2, LlamaBlock{RMSNorm<float>(tiny_d),
                                                     LlamaMLP<float>({.hidden_size = tiny_d, .intermediate_size = 12})}),
                     GPT2Block{RMSNorm<float>(tiny_d), GPT2MLP<float>({.n_embd = tiny_d, .resid_pdrop = 0})},
                     RMSNorm<float>(tiny_d), Linear<float>(tiny_d, tiny_vocab, false)};
}

// Sequences [first, first + rows) of step s: token ids, and as targets the next
// token, -100 after the last (every sequence ignores the same count, so each
// rank's mean over its tokens averages to the global batch's mean).
struct tokens {
  Tensor<std::int64_t> ids, targets;
};
tokens token_batch(int step, std::int64_t rows, std::int64_t first = 0) {
  tokens t{Tensor<std::int64_t>({rows, tiny_seq}), Tensor<std::int64_t>({rows, tiny_seq})};
  counter_rng rng(500 + std::uint64_t(step), 1);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t s = 0; s < tiny_seq; ++s) {
      const std::uint64_t at = std::uint64_t((first + r) * tiny_seq + s);
      t.ids[r * tiny_seq + s] = std::int64_t(rng.uniform_double(at) * double(tiny_vocab));
    }
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t s = 0; s < tiny_seq; ++s)
      t.targets[r * tiny_seq + s] = s + 1 < tiny_seq ? t.ids[r * tiny_seq + s + 1] : -100;
  return t;
}

}  // namespace

// Tolerance 1e-5 relative to max(|want|, lr): the ranks' partial gradients are
// averaged in another order than one process sums them, a float rounding
// difference, and Adam moves every parameter by about lr whatever its gradient's
// scale, so a parameter near zero is compared against lr (as test_custom_layer).
// Two wrappings: each block a unit, and each Linear a unit, which holds only if
// LlamaMLP and GPT2MLP run their children through the context (a unit's values
// are bound only there) and in backward in the reverse of forward's order.
TEST_CASE("a tiny decoder of these layers trains sharded (FullShard, W = 2) as it trains unsharded",
          "[nn][decoder][shard]") {
  constexpr int steps = 6, world = 2;
  constexpr std::int64_t global = 4;
  constexpr double lr = 1e-2;
  std::vector<float> want, want_losses;
  {
    TinyDecoder net = make_tiny_decoder();
    Replicated<float, TinyDecoder> owner(net, 3);
    optim::Adam adam{{.lr = lr}};
    auto st = adam.make_state(owner.values().size());
    context ctx;
    for (int s = 0; s < steps; ++s) {
      owner.zero_grad();
      const auto b = token_batch(s, global);
      const auto l = cross_entropy(ctx.forward(net, b.ids), b.targets);
      ctx.backward(net, l.grad);
      adam.step(owner.values(), owner.grads(), st);
      want_losses.push_back(l.loss);
    }
    for (const auto& e : owner.layout().entries)
      want.insert(want.end(), owner.values().begin() + std::ptrdiff_t(e.offset),
                  owner.values().begin() + std::ptrdiff_t(e.offset + e.numel()));
  }
  CHECK(want_losses.back() < want_losses.front());  // it trained

  struct wrapping {
    const char* what;
    shard::wrap_policy policy;
    std::size_t units;
  };
  for (const wrapping& w :
       {wrapping{"each block a unit", shard::wrap_types<LlamaBlock, GPT2Block>{}, 4},
        wrapping{"each Linear a unit", shard::wrap_types<Linear<float>>{}, 10}}) {
    std::vector<float> got;
    std::vector<std::vector<float>> losses(world);
    std::size_t unit_count = 0;
    comm::launch(world, [&](comm::ThreadComm& c) {
      TinyDecoder net = make_tiny_decoder();
      auto sharded = shard::fully_shard(net, c, shard::FullShard{}, {.wrap = w.policy, .seed = 3});
      optim::Adam adam{{.lr = lr}};
      const std::int64_t local = global / world, first = c.rank() * local;
      for (int s = 0; s < steps; ++s) {
        const auto b = token_batch(s, local, first);
        losses[std::size_t(c.rank())].push_back(sharded.train_step(adam, b.ids, b.targets, cross_entropy));
      }
      auto sd = sharded.full_state_dict();
      if (c.rank() == 0) {
        unit_count = sharded.unit_count();
        for (auto& [name, t] : sd) got.insert(got.end(), t.span().begin(), t.span().end());
      }
    });
    INFO(w.what);
    CHECK(unit_count == w.units);  // with the root
    REQUIRE(got.size() == want.size());
    test_support::max_error worst, worst_loss;  // NaN and infinities count as +inf
    worst.relative(got, want, lr);
    for (int s = 0; s < steps; ++s)
      worst_loss.relative((losses[0][std::size_t(s)] + losses[1][std::size_t(s)]) / 2, want_losses[std::size_t(s)],
                          1e-6);
    INFO("parameters " << worst << ", losses " << worst_loss);
    CHECK(worst <= 1e-5);
    CHECK(worst_loss <= 1e-5);
  }
}

}  // namespace test_decoder_layers
