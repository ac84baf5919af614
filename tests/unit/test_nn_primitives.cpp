// Layer primitives and losses: forward values, finite-difference gradients,
// parameter names and init, and the errors bad input raises.
#include "shardlib/nn/activation.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/layer_norm.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/pooling.hpp"
#include "shardlib/nn/replicated.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "support/gradcheck.hpp"

namespace test_nn_primitives {

using namespace shardlib;
using namespace shardlib::nn;

namespace {

void check_gradients(const gradcheck::result& r, int min_compared) {
  INFO("worst: " << r.worst << ", relative error " << r.max_rel_error);
  CHECK(r.max_rel_error < 1e-6);
  CHECK(r.compared >= min_compared);
}

// Central differences of the scalar f(x) at every element of x (f may read x only).
template <class F>
std::vector<double> numeric_gradient(F f, const Tensor<double>& x) {
  const double h = 1e-6;
  std::vector<double> g;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = f(x);
    x[i] = keep - h;
    const double down = f(x);
    x[i] = keep;
    g.push_back((up - down) / (2 * h));
  }
  return g;
}

std::vector<double> values(const Tensor<double>& t) { return {t.data(), t.data() + t.numel()}; }

double dot(const Tensor<double>& a, const Tensor<double>& b) {
  double s = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) s += a[i] * b[i];
  return s;
}

template <class T>
Tensor<T> tensor(Shape s, std::initializer_list<T> v) {
  Tensor<T> t(s);
  REQUIRE(std::int64_t(v.size()) == t.numel());
  std::copy(v.begin(), v.end(), t.data());
  return t;
}

std::vector<std::string> names_and_shapes(const flat_layout& f) {
  std::vector<std::string> out;
  for (const auto& e : f.entries) out.push_back(e.name + cat(e.shape));
  return out;
}

}  // namespace

TEST_CASE("every primitive models Layer", "[nn][concepts]") {
  STATIC_REQUIRE(check_layer<Embedding<float>>());
  STATIC_REQUIRE(check_layer<LayerNorm<float>>());
  STATIC_REQUIRE(check_layer<ReLU<float>>());
  STATIC_REQUIRE(check_layer<GELU<double>>());
  STATIC_REQUIRE(check_layer<Dropout<float>>());
  STATIC_REQUIRE(check_layer<MeanPool<double>>());
}

// --- Embedding ----------------------------------------------------------------------------

TEST_CASE("Embedding: weight [num, dim] drawn from N(0, 1)", "[nn][embedding][init]") {
  Embedding<double> e(1000, 64);
  Replicated<double, Embedding<double>> owner(e, 3);
  CHECK(names_and_shapes(owner.layout()) == std::vector<std::string>{"weight[1000, 64]"});
  auto w = owner.value("weight");
  double mean = 0, sq = 0;
  for (double v : w) mean += v / double(w.size());
  for (double v : w) sq += (v - mean) * (v - mean) / double(w.size());
  // 64000 draws: the sample mean's standard error is 0.004, the std's about 0.003.
  CHECK(std::abs(mean) < 0.02);
  CHECK(std::abs(std::sqrt(sq) - 1) < 0.02);
}

TEST_CASE("Embedding: forward looks rows up, backward scatter-adds", "[nn][embedding][gradcheck]") {
  Embedding<double> e(10, 4);
  auto ids = tensor<std::int64_t>({2, 3}, {3, 0, 9, 3, 3, 7});  // 3 repeats: its gradient accumulates
  auto r = gradcheck::check(e, ids, 40);
  check_gradients(r, 40);

  Replicated<double, Embedding<double>> owner(e, 1);
  context ctx;
  auto y = e.forward(ctx, ids);
  REQUIRE(y.shape() == Shape{2, 3, 4});
  auto w = owner.value("weight");
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 4; ++j) CHECK(y[i * 4 + j] == w[std::size_t(ids[i] * 4 + j)]);

  auto dy = gradcheck::random_tensor(y.shape(), 5);
  owner.zero_grad();
  auto dx = e.backward(ctx, dy);
  CHECK(dx.empty());
  auto g = owner.grad("weight");
  for (int j = 0; j < 4; ++j) {
    CHECK(g[3 * 4 + j] == Approx(dy[0 * 4 + j] + dy[3 * 4 + j] + dy[4 * 4 + j]).epsilon(1e-12));
    CHECK(g[1 * 4 + j] == 0);  // unused row
  }
}

TEST_CASE("Embedding: out-of-range ids and wrong gradients raise shape_error", "[nn][embedding]") {
  Embedding<float> e(10, 4);
  Replicated<float, Embedding<float>> owner(e, 0);
  context ctx;
  CHECK_THROWS_MATCHES(
      e.forward(ctx, tensor<std::int64_t>({2, 3}, {1, 2, 3, 4, 5, 10})), shape_error,
      Catch::Matchers::Message("Embedding(10, 4): id 10 at position [1, 2] of the input [2, 3] is out of range "
                               "for a table of 10 rows"));
  CHECK_THROWS_WITH(e.forward(ctx, tensor<std::int64_t>({2}, {-1, 0})), Catch::Contains("id -1 at position [0]"));
  CHECK_THROWS_AS(e.forward(ctx, Tensor<std::int64_t>()), shape_error);
  e.forward(ctx, tensor<std::int64_t>({3}, {1, 2, 3}));
  CHECK_THROWS_WITH(e.backward(ctx, Tensor<float>({3, 5})), Catch::Contains("(shape [3, 4]), got shape [3, 5]"));
}

// --- LayerNorm ----------------------------------------------------------------------------

TEST_CASE("LayerNorm: weight ones and bias zeros, or no parameters", "[nn][layernorm][init]") {
  LayerNorm<float> ln(6);
  Replicated<float, LayerNorm<float>> owner(ln, 9);
  CHECK(names_and_shapes(owner.layout()) == std::vector<std::string>{"weight[6]", "bias[6]"});
  for (float v : owner.value("weight")) CHECK(v == 1.0f);
  for (float v : owner.value("bias")) CHECK(v == 0.0f);
  LayerNorm<float> plain(6, 1e-5, false);
  CHECK(parameter_count(plain) == 0);
}

TEST_CASE("LayerNorm: forward is the biased-variance formula", "[nn][layernorm]") {
  LayerNorm<double> ln(4, 1e-5);
  Replicated<double, LayerNorm<double>> owner(ln, 0);
  auto w = owner.value("weight");
  auto b = owner.value("bias");
  for (int i = 0; i < 4; ++i) {
    w[i] = 0.5 * (i + 1);
    b[i] = -0.25 * i;
  }
  context ctx;
  auto y = ln.forward(ctx, tensor<double>({2, 4}, {1, 2, 3, 4, 10, 10, 10, 10}));
  const double rstd = 1 / std::sqrt(1.25 + 1e-5);  // row 0: mean 2.5, biased variance 1.25
  const double x0[] = {1, 2, 3, 4};
  for (int i = 0; i < 4; ++i) CHECK(y[i] == Approx((x0[i] - 2.5) * rstd * w[i] + b[i]).epsilon(1e-12));
  for (int i = 0; i < 4; ++i) CHECK(y[4 + i] == Approx(b[i]).margin(1e-12));  // a constant row normalises to 0
}

TEST_CASE("LayerNorm: backward matches finite differences", "[nn][layernorm][gradcheck]") {
  LayerNorm<double> ln(8);
  // Start from non-trivial weight and bias so dx depends on the weight.
  ln.weight.init = init_rule::uniform_in(0.5, 1.5);
  ln.bias.init = init_rule::uniform_in(-1, 1);
  check_gradients(gradcheck::check(ln, gradcheck::random_tensor({3, 2, 8}, 11, 3.0)), 60);
  LayerNorm<double> plain(8, 1e-5, false);
  check_gradients(gradcheck::check(plain, gradcheck::random_tensor({5, 8}, 12)), 20);
}

TEST_CASE("LayerNorm: wrong shapes raise shape_error", "[nn][layernorm]") {
  LayerNorm<float> ln(4);
  Replicated<float, LayerNorm<float>> owner(ln, 0);
  context ctx;
  CHECK_THROWS_MATCHES(ln.forward(ctx, Tensor<float>({2, 5})), shape_error,
                       Catch::Matchers::Message("LayerNorm(4): input's last dimension must be 4, got shape [2, 5]"));
  ln.forward(ctx, Tensor<float>::zeros({2, 4}));
  CHECK_THROWS_WITH(ln.backward(ctx, Tensor<float>({4, 2})), Catch::Contains("(shape [2, 4]), got shape [4, 2]"));
}

// --- activations --------------------------------------------------------------------------

TEST_CASE("activations: per-element values match torch's", "[nn][activation]") {
  CHECK(relu(-1.5) == 0.0);
  CHECK(relu(2.0f) == 2.0f);
  CHECK(std::isnan(relu(std::numeric_limits<double>::quiet_NaN())));
  CHECK(relu_backward(0.0, 3.0) == 0.0);
  CHECK(relu_backward(0.5, 3.0) == 3.0);
  CHECK(relu_backward(std::numeric_limits<double>::quiet_NaN(), 3.0) == 0.0);  // torch: dy where relu(x) > 0
  // x Φ(x) with Φ(1) = 0.8413447460685429; the tanh form from its definition.
  CHECK(gelu(1.0) == Approx(0.8413447460685429).epsilon(1e-15));
  CHECK(gelu(-1.0) == Approx(-0.15865525393145707).epsilon(1e-15));
  CHECK(gelu(1.0, gelu_approx::tanh) == Approx(0.8411919906082768).epsilon(1e-15));
  CHECK(gelu(2.5, gelu_approx::tanh) == Approx(2.484915733910001).epsilon(1e-15));
  CHECK(gelu(1.0f) == Approx(0.8413447f).epsilon(1e-6));
  // d/dx x Φ(x) = Φ(x) + x φ(x); at 0 both forms give 1/2.
  CHECK(gelu_backward(1.0, 2.0) == Approx(2 * (0.8413447460685429 + std::exp(-0.5) / std::sqrt(2 * std::numbers::pi))));
  CHECK(gelu_backward(0.0, 1.0, gelu_approx::tanh) == 0.5);
}

TEST_CASE("activations: layers apply the functions and backward matches finite differences",
          "[nn][activation][gradcheck]") {
  context ctx;
  auto x = gradcheck::random_tensor({4, 25}, 21, 3.0);
  ReLU<double> relu_layer;
  auto y = relu_layer.forward(ctx, x);
  for (std::int64_t i = 0; i < x.numel(); ++i) CHECK(y[i] == std::max(x[i], 0.0));
  check_gradients(gradcheck::check(relu_layer, x), 100);

  for (auto approx : {gelu_approx::none, gelu_approx::tanh}) {
    GELU<double> g(approx);
    CHECK(g.approximate() == approx);
    auto gy = g.forward(ctx, x);
    for (std::int64_t i = 0; i < x.numel(); ++i) CHECK(gy[i] == gelu(x[i], approx));
    check_gradients(gradcheck::check(g, x), 100);
  }
  CHECK(GELU<float>().approximate() == gelu_approx::none);
}

TEST_CASE("activations: backward needs the last forward's output gradient", "[nn][activation]") {
  context ctx;
  GELU<float> g;
  CHECK_THROWS_AS(g.backward(ctx, Tensor<float>({3})), shape_error);
  g.forward(ctx, Tensor<float>::zeros({2, 3}));
  CHECK_THROWS_MATCHES(g.backward(ctx, Tensor<float>({3, 2})), shape_error,
                       Catch::Matchers::Message("GELU: backward needs the gradient of the last forward's output "
                                                "(shape [2, 3]), got shape [3, 2]"));
}

// --- Dropout ------------------------------------------------------------------------------

TEST_CASE("Dropout: identity in evaluation and at p = 0", "[nn][dropout]") {
  auto x = gradcheck::random_tensor({10, 10}, 31);
  context eval({.training = false});
  Dropout<double> d(0.5);
  auto y = d.forward(eval, x);
  CHECK(y.data() == x.data());
  CHECK(d.backward(eval, x).data() == x.data());
  context train;
  Dropout<double> none(0.0);
  CHECK(none.forward(train, x).data() == x.data());
}

TEST_CASE("Dropout: keeps 1 - p of the elements, scaled, with the context's stream", "[nn][dropout]") {
  const std::int64_t n = 100000;
  Tensor<float> x(Shape{n});
  for (std::int64_t i = 0; i < n; ++i) x[i] = 1.0f + float(i % 7);
  context ctx({.seed = 5, .rank = 1, .step = 3});
  Dropout<float> d(0.3);
  auto y = d.forward(ctx, x);
  // The same stream the layer drew: the context's first draw of step 3.
  context twin({.seed = 5, .rank = 1, .step = 3});
  const counter_rng stream = twin.random_stream();
  std::int64_t kept = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const bool keep = dropout_keep(stream, std::uint64_t(i), 0.3f);
    kept += keep;
    REQUIRE(y[i] == (keep ? x[i] * float(1 / 0.7) : 0.0f));
  }
  CHECK(std::abs(double(kept) / n - 0.7) < 0.01);  // binomial standard error 0.0015

  auto dy = Tensor<float>::zeros({n});
  dy[0] = dy[1] = dy[2] = 2.0f;
  auto dx = d.backward(ctx, dy);
  for (int i = 0; i < 3; ++i) CHECK(dx[i] == (y[i] != 0 ? 2.0f * float(1 / 0.7) : 0.0f));

  auto dropped = Dropout<float>(1.0).forward(ctx, x);
  CHECK(std::all_of(dropped.data(), dropped.data() + n, [](float v) { return v == 0.0f; }));
  CHECK_THROWS_WITH(Dropout<float>(1.5), Catch::Contains("probability must be in [0, 1], got 1.5"));
}

TEST_CASE("Dropout: masks are reproducible per (seed, rank, step) and differ otherwise", "[nn][dropout]") {
  auto x = Tensor<double>::zeros({1000});
  for (std::int64_t i = 0; i < 1000; ++i) x[i] = 1;
  auto mask = [&](context::options o, int draws_before) {
    context ctx(o);
    for (int i = 0; i < draws_before; ++i) ctx.random_stream();
    Dropout<double> d(0.5);
    return values(d.forward(ctx, x));
  };
  const context::options base{.seed = 1, .rank = 0, .step = 2};
  CHECK(mask(base, 0) == mask(base, 0));
  CHECK(mask(base, 0) != mask({.seed = 2, .rank = 0, .step = 2}, 0));
  CHECK(mask(base, 0) != mask({.seed = 1, .rank = 1, .step = 2}, 0));
  CHECK(mask(base, 0) != mask({.seed = 1, .rank = 0, .step = 3}, 0));
  CHECK(mask(base, 0) != mask(base, 1));  // a second dropout layer in the same step
}

TEST_CASE("Dropout: backward matches finite differences with a fixed mask", "[nn][dropout][gradcheck]") {
  Dropout<double> d(0.4);
  auto x = gradcheck::random_tensor({6, 20}, 41);
  check_gradients(gradcheck::check(d, x), 100);
  context ctx;
  auto y = d.forward(ctx, x);
  std::int64_t zeros = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) zeros += y[i] == 0;
  CHECK(zeros > 0);  // the check above ran through a real mask
}

// --- MeanPool -----------------------------------------------------------------------------

TEST_CASE("MeanPool: the mean over one dimension, that dimension removed", "[nn][pooling]") {
  context ctx;
  auto x = tensor<double>({2, 3, 2}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  MeanPool<double> seq(1);
  auto y = seq.forward(ctx, x);
  REQUIRE(y.shape() == Shape{2, 2});
  CHECK(values(y) == std::vector<double>{3, 4, 9, 10});
  MeanPool<double> first(0);
  auto z = first.forward(ctx, x);
  REQUIRE(z.shape() == Shape{3, 2});
  CHECK(values(z) == std::vector<double>{4, 5, 6, 7, 8, 9});
  CHECK_THROWS_MATCHES(MeanPool<double>(3).forward(ctx, x), shape_error,
                       Catch::Matchers::Message("MeanPool(3): the input has no dimension 3, got shape [2, 3, 2]"));
}

TEST_CASE("MeanPool: a key padding mask averages only the non-padded positions", "[nn][pooling]") {
  // mask [N = 2, L = 3]: sequence 0 keeps positions 0 and 1, sequence 1 keeps position 2.
  context ctx;
  ctx.set_key_padding_mask(tensor<std::uint8_t>({2, 3}, {0, 0, 1, 1, 1, 0}));

  // Batch-first [N, L, E] = [2, 3, 2], pooled over dim 1.
  auto nle = tensor<double>({2, 3, 2}, {1, 2, 3, 4, 50, 60, 70, 80, 90, 100, 11, 12});
  MeanPool<double> batch_first(1);
  CHECK(values(batch_first.forward(ctx, nle)) == std::vector<double>{2, 3, 11, 12});

  // The same batch sequence-first [L, N, E] = [3, 2, 2], pooled over dim 0.
  Tensor<double> lne(Shape{3, 2, 2});
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 3; ++l)
      for (int e = 0; e < 2; ++e) lne[(l * 2 + n) * 2 + e] = nle[(n * 3 + l) * 2 + e];
  MeanPool<double> seq_first(0);
  CHECK(values(seq_first.forward(ctx, lne)) == std::vector<double>{2, 3, 11, 12});

  // Gradients: padded positions get none, the others 1 / (their sequence's count).
  for (auto* pool : {&batch_first, &seq_first}) {
    auto& x = pool == &batch_first ? nle : lne;
    auto r = gradcheck::random_tensor({2, 2}, 51);
    auto analytic = values(pool->backward(ctx, r));
    auto numeric = numeric_gradient([&](const Tensor<double>& in) { return dot(pool->forward(ctx, in), r); }, x);
    CHECK(gradcheck::rel_error(analytic, numeric) < 1e-6);
    pool->forward(ctx, x);
    auto dx = pool->backward(ctx, r);
    const int padded = pool == &batch_first ? (0 * 3 + 2) * 2 : (2 * 2 + 0) * 2;  // sequence 0, position 2
    CHECK(dx[padded] == 0);
  }

  // Other ranks ignore the mask: a plain mean.
  MeanPool<double> rank2(1);
  CHECK(values(rank2.forward(ctx, tensor<double>({1, 4}, {1, 2, 3, 6}))) == std::vector<double>{3});
}

TEST_CASE("MeanPool: a mismatched mask or an all-padding sequence raises", "[nn][pooling]") {
  context ctx;
  MeanPool<float> pool(1);
  ctx.set_key_padding_mask(Tensor<std::uint8_t>::zeros({3, 2}));
  CHECK_THROWS_MATCHES(pool.forward(ctx, Tensor<float>::zeros({2, 3, 4})), shape_error,
                       Catch::Matchers::Message("MeanPool(1): the key padding mask must be [batch, sequence] = [2, 3] "
                                                "for the input [2, 3, 4] (batch-first [N, L, E]), got [3, 2]"));
  ctx.set_key_padding_mask(tensor<std::uint8_t>({2, 3}, {0, 1, 0, 1, 1, 1}));
  CHECK_THROWS_WITH(pool.forward(ctx, Tensor<float>::zeros({2, 3, 4})),
                    Catch::Contains("sequence 1 of the batch is all padding"));
}

TEST_CASE("MeanPool: backward matches finite differences without a mask", "[nn][pooling][gradcheck]") {
  MeanPool<double> pool(1);
  check_gradients(gradcheck::check(pool, gradcheck::random_tensor({2, 5, 3, 2}, 61)), 60);
}

// --- losses -------------------------------------------------------------------------------

namespace {
// torch's definition, written independently of loss.hpp: the loss of a row is the
// cross-entropy -sum_c q[c] log p[c] against the smoothed target distribution
// q = (1 - e) onehot(y) + e / C, and its gradient is p - q. Rows equal to
// `ignore` are skipped; mean divides by the rows kept.
struct ce_reference {
  double loss = 0;
  std::vector<double> grad;
};
ce_reference reference_cross_entropy(const Tensor<double>& z, const std::vector<std::int64_t>& y, double e,
                                     std::int64_t ignore, bool mean) {
  const std::int64_t c = z.dim(z.rank() - 1), rows = z.numel() / c;
  ce_reference ref;
  ref.grad.assign(std::size_t(z.numel()), 0.0);
  int kept = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (y[r] == ignore) continue;
    ++kept;
    double s = 0;
    for (std::int64_t k = 0; k < c; ++k) s += std::exp(z[r * c + k]);
    for (std::int64_t k = 0; k < c; ++k) {
      const double p = std::exp(z[r * c + k]) / s, q = (k == y[r] ? 1 - e : 0) + e / double(c);
      ref.loss -= q * std::log(p);
      ref.grad[r * c + k] = p - q;
    }
  }
  if (mean) {
    ref.loss /= kept;
    for (double& g : ref.grad) g /= kept;
  }
  return ref;
}

Tensor<std::int64_t> ids(Shape s, const std::vector<std::int64_t>& v) {
  Tensor<std::int64_t> t(s);
  REQUIRE(std::int64_t(v.size()) == t.numel());
  std::copy(v.begin(), v.end(), t.data());
  return t;
}
}  // namespace

TEST_CASE("cross_entropy: value and gradient match the float64 reference and finite differences",
          "[nn][loss][gradcheck]") {
  auto z = gradcheck::random_tensor({2, 3, 5}, 71, 3.0);  // [..., C]: 6 rows of 5 classes
  const std::vector<std::int64_t> y = {4, 0, 2, 2, 1, 3};
  for (std::int64_t ignore : {std::int64_t(-100), std::int64_t(2)}) {
    for (double e : {0.0, 0.1}) {
      for (auto red : {loss_reduction::mean, loss_reduction::sum}) {
        INFO("ignore_index " << ignore << ", label_smoothing " << e << ", sum " << (red == loss_reduction::sum));
        const cross_entropy_loss ce{{.ignore_index = ignore, .reduction = red, .label_smoothing = e}};
        auto got = ce(z, ids({2, 3}, y));
        auto ref = reference_cross_entropy(z, y, e, ignore, red == loss_reduction::mean);
        CHECK(got.loss == Approx(ref.loss).epsilon(1e-12));
        REQUIRE(got.grad.shape() == z.shape());
        CHECK(gradcheck::rel_error(values(got.grad), ref.grad) < 1e-12);
        auto numeric = numeric_gradient([&](const Tensor<double>& in) { return ce(in, ids({6}, y)).loss; }, z);
        CHECK(gradcheck::rel_error(values(got.grad), numeric) < 1e-6);
      }
    }
  }
}

TEST_CASE("cross_entropy: defaults, ignore_index, smoothing and reductions as torch", "[nn][loss]") {
  // All-zero logits: p = 1/C whatever the target and smoothing, so the loss is log C.
  auto zero = Tensor<double>::zeros({3, 4});
  CHECK(cross_entropy(zero, ids({3}, {0, 1, 3})).loss == Approx(std::log(4.0)).epsilon(1e-15));
  CHECK(cross_entropy_loss{{.label_smoothing = 0.3}}(zero, ids({3}, {0, 1, 3})).loss ==
        Approx(std::log(4.0)).epsilon(1e-15));

  // Smoothing by hand for one row z = [0, ln 3] (p = [1/4, 3/4]), target 1, e = 0.2, C = 2:
  // (1 - e) (-ln 3/4) + (e / 2) (-ln 1/4 - ln 3/4).
  auto row = tensor<double>({1, 2}, {0, std::log(3.0)});
  const double want = 0.8 * -std::log(0.75) + 0.1 * (-std::log(0.25) - std::log(0.75));
  CHECK(cross_entropy_loss{{.label_smoothing = 0.2}}(row, ids({1}, {1})).loss == Approx(want).epsilon(1e-14));

  // A -inf logit (a masked-out class) is probability 0: without smoothing the loss stays
  // finite, as torch's; with smoothing it is +inf (the smoothed target puts mass there).
  const double inf = std::numeric_limits<double>::infinity();
  auto masked = tensor<double>({1, 3}, {0, std::log(3.0), -inf});
  const auto unsmoothed = cross_entropy(masked, ids({1}, {1}));
  CHECK(unsmoothed.loss == Approx(-std::log(0.75)).epsilon(1e-14));
  CHECK(unsmoothed.grad[2] == 0);
  CHECK(cross_entropy_loss{{.label_smoothing = 0.2}}(masked, ids({1}, {1})).loss == inf);

  // ignore_index (default -100): no loss, no gradient, and the mean counts only the rest.
  auto z = gradcheck::random_tensor({4, 3}, 81);
  auto with_ignored = cross_entropy(z, ids({4}, {1, -100, 2, -100}));
  auto kept_rows = tensor<double>({2, 3}, {z[0], z[1], z[2], z[6], z[7], z[8]});
  auto kept_only = cross_entropy(kept_rows, ids({2}, {1, 2}));
  CHECK(with_ignored.loss == Approx(kept_only.loss).epsilon(1e-15));
  for (int k = 0; k < 3; ++k) {
    CHECK(with_ignored.grad[3 + k] == 0);
    CHECK(with_ignored.grad[9 + k] == 0);
    CHECK(with_ignored.grad[k] == Approx(kept_only.grad[k]).epsilon(1e-15));
  }
  // A custom ignore_index inside the class range.
  auto ignore0 = cross_entropy_loss{{.ignore_index = 0, .label_smoothing = 0.1}}(z, ids({4}, {0, 1, 0, 2}));
  for (int k = 0; k < 3; ++k) CHECK(ignore0.grad[k] == 0);

  // mean = sum / (rows kept), gradient too.
  const cross_entropy_loss sum{{.reduction = loss_reduction::sum}};
  auto s = sum(z, ids({4}, {1, -100, 2, 0}));
  auto m = cross_entropy(z, ids({4}, {1, -100, 2, 0}));
  CHECK(s.loss == Approx(3 * m.loss).epsilon(1e-14));
  for (std::int64_t i = 0; i < z.numel(); ++i) CHECK(s.grad[i] == Approx(3 * m.grad[i]).epsilon(1e-14));

  // Every row ignored: the mean is 0/0 = NaN as torch's, the gradient zero.
  auto none = cross_entropy(z, ids({4}, {-100, -100, -100, -100}));
  CHECK(std::isnan(none.loss));
  for (std::int64_t i = 0; i < z.numel(); ++i) CHECK(none.grad[i] == 0);
}

TEST_CASE("cross_entropy: float logits are stable and match the float64 result", "[nn][loss]") {
  auto big = tensor<float>({2, 2}, {1000.0f, 0.0f, -1000.0f, 1000.0f});
  auto r = cross_entropy(big, ids({2}, {0, 0}));
  CHECK(r.loss == Approx(1000.0f));  // row 0: about 0; row 1: 2000; mean 1000
  CHECK(std::isfinite(r.grad[0]));
  CHECK(r.grad[2] == Approx(-0.5f));

  auto zd = gradcheck::random_tensor({8, 11}, 91, 4.0);
  Tensor<float> zf(zd.shape());
  for (std::int64_t i = 0; i < zd.numel(); ++i) zf[i] = float(zd[i]);
  auto y = ids({8}, {0, 10, 3, 3, 5, 9, 1, 7});
  const cross_entropy_loss ce{{.label_smoothing = 0.05}};
  auto d = ce(zd, y);
  auto f = ce(zf, y);
  CHECK(f.loss == Approx(d.loss).epsilon(1e-6));
  for (std::int64_t i = 0; i < zd.numel(); ++i) CHECK(f.grad[i] == Approx(d.grad[i]).margin(1e-7));
}

TEST_CASE("cross_entropy: bad targets and shapes raise", "[nn][loss]") {
  auto z = Tensor<float>::zeros({2, 3, 4});
  CHECK(cross_entropy(z, ids({6}, {0, 1, 2, 3, 0, 1})).grad.shape() == Shape{2, 3, 4});  // flattened targets
  CHECK_THROWS_MATCHES(cross_entropy(z, ids({2, 3}, {0, 1, 2, 3, 4, 0})), shape_error,
                       Catch::Matchers::Message("cross_entropy: target 4 in row 4 is out of range for 4 classes "
                                                "(ignore_index is -100)"));
  CHECK_THROWS_WITH(cross_entropy(z, ids({2, 3}, {0, -1, 0, 0, 0, 0})), Catch::Contains("target -1 in row 1"));
  CHECK_THROWS_MATCHES(cross_entropy(z, ids({3, 2}, {0, 0, 0, 0, 0, 0})), shape_error,
                       Catch::Matchers::Message("cross_entropy: targets must have the logits' leading shape [2, 3] "
                                                "or be [6] for logits [2, 3, 4], got shape [3, 2]"));
  CHECK_THROWS_AS(cross_entropy(z, Tensor<std::int64_t>()), shape_error);
  CHECK_THROWS_WITH(cross_entropy_loss{{.label_smoothing = 1.0}}(z, ids({6}, {0, 0, 0, 0, 0, 0})),
                    Catch::Contains("label_smoothing must be in [0, 1), got 1"));
}

TEST_CASE("mse_loss: mean or sum of squared differences, and its gradient", "[nn][loss][gradcheck]") {
  auto x = tensor<double>({3}, {1, 2, 3});
  auto t = tensor<double>({3}, {0, 0, 1});
  auto m = mse_loss(x, t);
  CHECK(m.loss == Approx(9.0 / 3).epsilon(1e-15));  // (1 + 4 + 4) / 3
  CHECK(values(m.grad) == std::vector<double>{2.0 / 3, 4.0 / 3, 4.0 / 3});
  const squared_error_loss sum{{.reduction = loss_reduction::sum}};
  CHECK(sum(x, t).loss == 9.0);
  CHECK(values(sum(x, t).grad) == std::vector<double>{2, 4, 4});

  auto a = gradcheck::random_tensor({4, 5}, 101);
  auto b = gradcheck::random_tensor({4, 5}, 102);
  auto numeric = numeric_gradient([&](const Tensor<double>& in) { return mse_loss(in, b).loss; }, a);
  CHECK(gradcheck::rel_error(values(mse_loss(a, b).grad), numeric) < 1e-6);

  CHECK_THROWS_MATCHES(mse_loss(a, Tensor<double>({5, 4})), shape_error,
                       Catch::Matchers::Message("mse_loss: input and target must have the same shape, got [4, 5] and "
                                                "[5, 4]"));
}

TEST_CASE("losses are callables that can be passed as values", "[nn][loss]") {
  auto apply = [](auto loss, const auto& out, const auto& target) { return loss(out, target).loss; };
  auto z = Tensor<float>::zeros({2, 2});
  CHECK(apply(cross_entropy, z, ids({2}, {0, 1})) == Approx(std::log(2.0f)));
  CHECK(apply(mse_loss, z, Tensor<float>::zeros({2, 2})) == 0.0f);
}

}  // namespace test_nn_primitives
