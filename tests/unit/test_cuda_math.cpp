// The per-element and per-row math of the CUDA kernels (ops/cuda/*.hpp),
// compiled by g++ and run on the host with one lane (serial_team), against the
// host layers and optimizers it must agree with. The kernels call these same
// functions with a block of lanes; tests/cuda checks them on a GPU.
//
// Where both sides run the same arithmetic (Adam) they must agree bit for bit,
// which holds only if the compiler fuses a * b + c into the same FMAs on both
// sides; across differently inlined loops GCC does not always. So this file
// compiles without contraction (before any include, to cover the headers'
// inline functions too). The device fuses as nvcc likes: tests/cuda compares
// with tolerances.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif
#include "shardlib/core/element.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/nn/activation.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/layer_norm.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/ops/cuda/adam.hpp"
#include "shardlib/ops/cuda/cross_entropy.hpp"
#include "shardlib/ops/cuda/deferred_reports.hpp"
#include "shardlib/ops/cuda/elementwise.hpp"
#include "shardlib/ops/cuda/embedding.hpp"
#include "shardlib/ops/cuda/layer_norm.hpp"
#include "shardlib/ops/cuda/softmax.hpp"
#include "shardlib/optim/adam.hpp"

#include "support/compare.hpp"  // max_keeping_nan
#include "support/random_inputs.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace sl = shardlib;
namespace oc = shardlib::ops::cuda;
using sl::Shape;
using sl::Tensor;

namespace {

using test_support::random_inputs;

// |a - b| <= rtol |b| + atol, element by element; reports the worst index.
void require_close(const float* got, const float* want, std::size_t n, double rtol, double atol = 0) {
  std::size_t worst = 0;
  double worst_excess = -1;
  for (std::size_t i = 0; i < n; ++i) {
    const double err = std::abs(double(got[i]) - double(want[i])), bound = rtol * std::abs(double(want[i])) + atol;
    if (!(err <= bound) && err - bound > worst_excess) {
      worst_excess = err - bound;
      worst = i;
    }
  }
  INFO("worst index " << worst << ": got " << got[worst] << ", want " << want[worst]);
  REQUIRE(worst_excess < 0);
}

constexpr oc::serial_team lane{};

}  // namespace

TEST_CASE("layer_norm rows match nn::LayerNorm forward and backward", "[cuda_math][layer_norm]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t rows = 7, d = 45;
  sl::nn::LayerNorm<float> ln(d);
  auto w = rnd.normal(d), b = rnd.normal(d), gw = rnd.normal(d), gb = rnd.normal(d);
  ln.weight.value = w.data();
  ln.bias.value = b.data();
  ln.weight.grad = gw.data();
  ln.bias.grad = gb.data();
  // An offset mean tests the two-pass variance.
  auto xv = rnd.normal(std::size_t(rows * d), 3.0f);
  for (auto& x : xv) x += 10.0f;
  const Tensor<float> x = test_support::host_tensor({rows, d}, xv), dy = test_support::host_tensor({rows, d}, rnd.normal(std::size_t(rows * d)));

  sl::nn::context ctx;
  const Tensor<float> y_host = ln.forward(ctx, x);
  std::vector<float> y(rows * d);
  std::vector<oc::row_stats> stats(rows);
  for (std::int64_t r = 0; r < rows; ++r)
    stats[r] = oc::layer_norm_forward_row(lane, x.data() + r * d, w.data(), b.data(), y.data() + r * d, int(d), 1e-5f);
  require_close(y.data(), y_host.data(), y.size(), 1e-6, 1e-6);

  std::vector<float> gw_dev = gw, gb_dev = gb;  // the row functions accumulate into copies
  const Tensor<float> dx_host = ln.backward(ctx, dy);
  std::vector<float> dx(rows * d);
  for (std::int64_t r = 0; r < rows; ++r)
    oc::layer_norm_backward_row(lane, x.data() + r * d, dy.data() + r * d, w.data(), stats[r], dx.data() + r * d,
                                int(d));
  require_close(dx.data(), dx_host.data(), dx.size(), 1e-5, 1e-6);
  for (int i = 0; i < d; ++i) {
    const auto g = oc::layer_norm_param_grads(x.data(), dy.data(), stats.data(), 0, rows, int(d), i,
                                              oc::param_grads{gw_dev[i], gb_dev[i]});
    gw_dev[i] = g.weight;
    gb_dev[i] = g.bias;
  }
  require_close(gw_dev.data(), gw.data(), std::size_t(d), 1e-5, 1e-6);
  require_close(gb_dev.data(), gb.data(), std::size_t(d), 1e-6, 1e-6);

  SECTION("without affine parameters") {
    sl::nn::LayerNorm<float> plain(d, 1e-5, false);
    const Tensor<float> yp = plain.forward(ctx, x);
    const float* none = nullptr;
    for (std::int64_t r = 0; r < rows; ++r)
      oc::layer_norm_forward_row(lane, x.data() + r * d, none, none, y.data() + r * d, int(d), 1e-5f);
    require_close(y.data(), yp.data(), y.size(), 1e-6, 1e-6);
  }
}

TEST_CASE("masked softmax rows and their backward match double-precision references", "[cuda_math][softmax]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const int n = 37;
  auto scores = rnd.normal(n, 4.0f), dp = rnd.normal(n);
  std::vector<std::uint8_t> mask(n, 0);
  for (int j = 0; j < n; j += 3) mask[j] = 1;

  const std::uint8_t* no_mask = nullptr;
  for (const std::uint8_t* m : {no_mask, static_cast<const std::uint8_t*>(mask.data())}) {
    std::vector<float> p = scores;
    oc::masked_softmax_row(lane, p.data(), m, n);
    double mx = -INFINITY, sum = 0;
    for (int j = 0; j < n; ++j)
      if (!(m && m[j])) mx = test_support::max_keeping_nan(mx, double(scores[j]));
    for (int j = 0; j < n; ++j)
      if (!(m && m[j])) sum += std::exp(double(scores[j]) - mx);
    std::vector<float> want(n);
    for (int j = 0; j < n; ++j) want[j] = (m && m[j]) ? 0.0f : float(std::exp(double(scores[j]) - mx) / sum);
    require_close(p.data(), want.data(), std::size_t(n), 1e-6, 1e-9);
    for (int j = 0; j < n; ++j)
      if (m && m[j]) REQUIRE(p[j] == 0.0f);  // masked keys get exactly zero weight

    std::vector<float> g = dp;
    oc::softmax_backward_row(lane, p.data(), g.data(), n);
    double dot = 0;
    for (int j = 0; j < n; ++j) dot += double(dp[j]) * double(p[j]);
    for (int j = 0; j < n; ++j) want[j] = float(double(p[j]) * (double(dp[j]) - dot));
    require_close(g.data(), want.data(), std::size_t(n), 1e-5, 1e-6);  // dp - dot cancels
  }

  SECTION("a row whose keys are all masked becomes zeros, as in nn::MultiheadAttention") {
    std::vector<std::uint8_t> all(n, 1);
    std::vector<float> p = scores;
    oc::masked_softmax_row(lane, p.data(), all.data(), n);
    REQUIRE(std::all_of(p.begin(), p.end(), [](float v) { return v == 0.0f; }));
  }
}

TEST_CASE("cross_entropy rows match nn::cross_entropy_loss", "[cuda_math][cross_entropy]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t rows = 9, classes = 13;
  const Tensor<float> logits = test_support::host_tensor({rows, classes}, rnd.normal(std::size_t(rows * classes), 3.0f));
  Tensor<std::int64_t> targets(Shape{rows});
  for (std::int64_t r = 0; r < rows; ++r) targets[r] = rnd.integer(0, classes - 1);
  targets[2] = 0;  // with ignore_index 0 below, at least one row is ignored

  const sl::nn::cross_entropy_options cases[] = {
      {},
      {.ignore_index = 0},
      {.label_smoothing = 0.1},
      {.ignore_index = 0, .reduction = sl::nn::loss_reduction::sum, .label_smoothing = 0.2},
  };
  for (const auto& o : cases) {
    INFO("ignore_index " << o.ignore_index << ", smoothing " << o.label_smoothing);
    const auto want = sl::nn::cross_entropy_loss{o}(logits, targets);
    std::int64_t counted = 0;
    for (std::int64_t r = 0; r < rows; ++r) counted += targets[r] != o.ignore_index;
    const bool mean = o.reduction == sl::nn::loss_reduction::mean;
    const float scale = mean ? 1.0f / float(counted) : 1.0f;
    std::vector<float> grad(rows * classes);
    double total = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto res = oc::cross_entropy_row(lane, logits.data() + r * classes, targets[r], int(classes),
                                             o.ignore_index, float(o.label_smoothing), scale, grad.data() + r * classes);
      REQUIRE(res.status == (targets[r] == o.ignore_index ? oc::row_status::ignored : oc::row_status::counted));
      total += res.loss;
    }
    const float loss = mean ? float(total / double(counted)) : float(total);
    CHECK(loss == Approx(want.loss).epsilon(1e-6));
    require_close(grad.data(), want.grad.data(), grad.size(), 1e-5, 1e-8);
  }

  SECTION("a -inf logit without smoothing leaves the loss finite, as the host's") {
    std::vector<float> masked(logits.data(), logits.data() + classes), grad(classes);
    masked[5] = -std::numeric_limits<float>::infinity();
    const auto res = oc::cross_entropy_row(lane, masked.data(), targets[0] == 5 ? 4 : targets[0], int(classes), -100,
                                           0.0f, 1.0f, grad.data());
    REQUIRE(res.status == oc::row_status::counted);
    CHECK(std::isfinite(res.loss));
    CHECK(grad[5] == 0.0f);
  }
  SECTION("a target out of range is reported and gets a zero gradient") {
    std::vector<float> grad(classes, 1.0f);
    const auto res = oc::cross_entropy_row(lane, logits.data(), classes, int(classes), -100, 0.0f, 1.0f, grad.data());
    REQUIRE(res.status == oc::row_status::bad_target);
    REQUIRE(std::all_of(grad.begin(), grad.end(), [](float v) { return v == 0.0f; }));
  }
}

TEST_CASE("embedding rows and sorted-run gradients match nn::Embedding bit for bit", "[cuda_math][embedding]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t num = 11, dim = 6, n = 40;
  sl::nn::Embedding<float> emb(num, dim);
  auto w = rnd.normal(std::size_t(num * dim)), g = rnd.normal(std::size_t(num * dim));
  emb.weight.value = w.data();
  emb.weight.grad = g.data();
  Tensor<std::int64_t> ids(Shape{n});
  for (std::int64_t i = 0; i < n; ++i) ids[i] = rnd.integer(0, num - 1);  // 40 ids over 11 rows: many repeats
  const Tensor<float> dy = test_support::host_tensor({n, dim}, rnd.normal(std::size_t(n * dim)));

  sl::nn::context ctx;
  const Tensor<float> y_host = emb.forward(ctx, ids);
  std::vector<float> y(n * dim);
  for (std::int64_t i = 0; i < n; ++i) oc::embedding_row(lane, w.data(), ids[i], int(dim), y.data() + i * dim);
  REQUIRE(std::memcmp(y.data(), y_host.data(), y.size() * sizeof(float)) == 0);

  // The kernel's order: positions stably sorted by id, one run per id.
  std::vector<float> g_dev = g;
  emb.backward(ctx, dy);
  std::vector<std::int64_t> pos(n);
  std::iota(pos.begin(), pos.end(), 0);
  std::stable_sort(pos.begin(), pos.end(), [&](auto a, auto b) { return ids[a] < ids[b]; });
  for (std::int64_t k = 0; k < n;) {
    std::int64_t end = k + 1;
    while (end < n && ids[pos[end]] == ids[pos[k]]) ++end;
    oc::embedding_accumulate_run(lane, g_dev.data() + ids[pos[k]] * dim, dy.data(), pos.data() + k, int(end - k),
                                 int(dim));
    k = end;
  }
  REQUIRE(std::memcmp(g_dev.data(), g.data(), g.size() * sizeof(float)) == 0);
}

TEST_CASE("dropout_element draws nn::Dropout's mask and scale", "[cuda_math][dropout]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t n = 4096;
  const Tensor<float> x = test_support::host_tensor({n}, rnd.normal(n));
  for (double p : {0.1, 0.5, 1.0}) {
    sl::nn::Dropout<float> drop(p);
    sl::nn::context ctx({.training = true, .seed = rnd.seed});
    const sl::counter_rng stream = sl::nn::context({.training = true, .seed = rnd.seed}).random_stream();
    const Tensor<float> y_host = drop.forward(ctx, x);
    const float scale = oc::dropout_scale<float>(p);
    std::vector<float> y(n);
    for (std::int64_t i = 0; i < n; ++i) y[i] = oc::dropout_element(x[i], stream, std::uint64_t(i), float(p), scale);
    INFO("p = " << p);
    REQUIRE(std::memcmp(y.data(), y_host.data(), y.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("GELU and ReLU in float, as every kernel computes them, match the layers", "[cuda_math][gelu]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t n = 10000;
  const Tensor<float> x = test_support::host_tensor({n}, rnd.normal(n, 3.0f)), dy = test_support::host_tensor({n}, rnd.normal(n));
  for (auto a : {sl::nn::gelu_approx::none, sl::nn::gelu_approx::tanh}) {
    // The kernels evaluate nn::gelu<float> for every element type: it is the layer's function ...
    sl::nn::GELU<float> layer(a);
    sl::nn::context ctx;
    const Tensor<float> y_layer = layer.forward(ctx, x), dx_layer = layer.backward(ctx, dy);
    std::vector<float> f(n), d(n), bf(n), bd(n);
    for (std::int64_t i = 0; i < n; ++i) {
      f[i] = sl::nn::gelu(x[i], a);
      d[i] = float(sl::nn::gelu(double(x[i]), a));
      bf[i] = sl::nn::gelu_backward(x[i], dy[i], a);
      bd[i] = float(sl::nn::gelu_backward(double(x[i]), double(dy[i]), a));
    }
    if (a == sl::nn::gelu_approx::none) {
      REQUIRE(std::memcmp(f.data(), y_layer.data(), f.size() * sizeof(float)) == 0);
      REQUIRE(std::memcmp(bf.data(), dx_layer.data(), bf.size() * sizeof(float)) == 0);
    } else {
      // except the host's float tanh-GELU, which is vectorised (sigmoid(2u) with its own
      // exp, nn/activation.hpp): the same function to float rounding, not bit for bit.
      require_close(y_layer.data(), d.data(), f.size(), 1e-5, 1e-5);
      require_close(dx_layer.data(), bd.data(), bf.size(), 1e-5, 1e-5);
    }
    // ... and float is accurate enough to stand for bf16 and fp16 inputs. The
    // absolute slack covers x << 0, where 1 + erf(x) and the backward's
    // cdf + x pdf cancel (ulps of 1, about 1e-7, times |x| and |dy|).
    require_close(f.data(), d.data(), f.size(), 1e-5, 1e-5);
    require_close(bf.data(), bd.data(), bf.size(), 1e-5, 1e-5);
  }
  sl::nn::ReLU<float> relu;
  sl::nn::context ctx;
  const Tensor<float> y = relu.forward(ctx, x), dx = relu.backward(ctx, dy);
  for (std::int64_t i = 0; i < n; ++i) {
    REQUIRE(sl::nn::relu(x[i]) == y[i]);
    REQUIRE(sl::nn::relu_backward(x[i], dy[i]) == dx[i]);
  }
}

TEST_CASE("casts round-trip every 16-bit pattern through float", "[cuda_math][cast]") {
  int mismatches = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto bits = std::uint16_t(b);
    const auto h = sl::half::from_bits(bits);
    const auto bf = sl::bfloat16::from_bits(bits);
    const float hf = sl::element_cast<float>(h), bff = sl::element_cast<float>(bf);
    if (std::isnan(hf) || std::isnan(bff)) continue;  // NaNs narrow to the canonical NaN (test_element)
    mismatches += sl::element_cast<sl::half>(hf).bits != bits;
    mismatches += sl::element_cast<sl::bfloat16>(bff).bits != bits;
    mismatches += sl::element_cast<sl::bfloat16>(hf).bits != sl::bfloat16(hf).bits;
  }
  REQUIRE(mismatches == 0);
}

namespace {
// Steps `opt` on the host and, element by element, with the kernel's function
// and the scalars the device step passes it (opt.step_scalars, which the host
// step uses too); params, moments and the compute copy must agree bit for bit
// after every step.
template <class Opt, class G>
void check_fused_adam(const Opt& opt, random_inputs& rnd) {
  constexpr bool decoupled = Opt::decoupled;
  const std::size_t n = 257;
  std::vector<float> p_host = rnd.normal(n), p_dev = p_host;
  auto state = opt.make_state(n);
  std::vector<float> m(n, 0.0f), v(n, 0.0f), vmax(n, 0.0f);
  std::vector<sl::bfloat16> copy(n);
  for (std::int64_t step = 1; step <= 4; ++step) {
    const auto gf = rnd.normal(n);
    std::vector<G> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = G(gf[i]);
    opt.step(std::span<float>(p_host), std::span<const G>(g), state);
    const auto k = opt.step_scalars(step);
    for (std::size_t i = 0; i < n; ++i) {
      const auto at = std::int64_t(i);
      const bool decay = opt.options.weight_decay != 0;
      if (opt.options.amsgrad && decay)
        oc::fused_adam_element<decoupled, true, true>(at, p_dev.data(), g.data(), m.data(), v.data(), vmax.data(),
                                                      copy.data(), k);
      else if (opt.options.amsgrad)
        oc::fused_adam_element<decoupled, false, true>(at, p_dev.data(), g.data(), m.data(), v.data(), vmax.data(),
                                                       copy.data(), k);
      else if (decay)
        oc::fused_adam_element<decoupled, true, false>(at, p_dev.data(), g.data(), m.data(), v.data(), nullptr,
                                                       copy.data(), k);
      else
        oc::fused_adam_element<decoupled, false, false>(at, p_dev.data(), g.data(), m.data(), v.data(), nullptr,
                                                        copy.data(), k);
    }
    INFO("step " << step);
    REQUIRE(std::memcmp(p_dev.data(), p_host.data(), n * sizeof(float)) == 0);
    REQUIRE(std::memcmp(m.data(), state.exp_avg.data(), n * sizeof(float)) == 0);
    REQUIRE(std::memcmp(v.data(), state.exp_avg_sq.data(), n * sizeof(float)) == 0);
    for (std::size_t i = 0; i < n; ++i) REQUIRE(copy[i].bits == sl::bfloat16(p_host[i]).bits);
  }
}
}  // namespace

TEST_CASE("the fused Adam element with optim::Adam's step scalars equals its step bit for bit", "[cuda_math][adam]") {
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  SECTION("Adam, fp32 gradients") { check_fused_adam<sl::optim::Adam, float>(sl::optim::Adam{{.lr = 1e-2}}, rnd); }
  SECTION("Adam with L2 decay and amsgrad, bf16 gradients") {
    check_fused_adam<sl::optim::Adam, sl::bfloat16>(
        sl::optim::Adam{{.lr = 3e-3, .weight_decay = 0.1, .amsgrad = true}}, rnd);
  }
  SECTION("AdamW, fp16 gradients") {
    check_fused_adam<sl::optim::AdamW, sl::half>(sl::optim::AdamW{{.lr = 1e-3, .weight_decay = 0.05}}, rnd);
  }
  SECTION("step_scalars refuses invalid options, as the host step does") {
    REQUIRE_THROWS_WITH(sl::optim::Adam{{.lr = -1}}.step_scalars(1), Catch::Contains("invalid learning rate"));
  }
}

namespace {
// A report that records its check in a shared log and fails when it is bad.
struct logged_report {
  int id;
  bool bad;
  std::vector<int>* checked;
  void check() {
    checked->push_back(id);
    if (bad) throw sl::shape_error("report " + std::to_string(id));
  }
};
}  // namespace

TEST_CASE("deferred_reports: take() empties the list in order, and past the limit the oldest is checked",
          "[cuda_math][deferred_reports]") {
  using list = sl::ops::cuda::deferred_reports<logged_report>;
  std::vector<int> checked;
  list reports;
  for (int i = 0; i < 3; ++i) reports.add({i, false, &checked});
  auto taken = reports.take();
  REQUIRE(taken.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(taken[std::size_t(i)].id == i);
  CHECK(reports.size() == 0);
  CHECK(reports.take().empty());  // nothing accumulates once taken

  for (int i = 0; i < int(list::limit); ++i) reports.add({i, i == 0, &checked});
  CHECK(checked.empty());  // up to the limit nothing is checked
  CHECK(reports.size() == list::limit);
  CHECK_THROWS_WITH(reports.add({100, false, &checked}), "report 0");  // the oldest, bad, raises from add
  CHECK(checked == std::vector<int>{0});
  CHECK(reports.size() == list::limit);  // the new one kept, the oldest gone
  reports.add({101, false, &checked});
  CHECK(checked == std::vector<int>{0, 1});
  taken = reports.take();
  REQUIRE(taken.size() == list::limit);
  CHECK(taken.front().id == 2);
  CHECK(taken.back().id == 101);
}
