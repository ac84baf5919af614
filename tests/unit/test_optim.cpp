// Optimizers, clipping and schedules: against a float64 implementation of
// PyTorch's documented equations, against torch.optim's own trajectories
// (tests/golden/optim_goldens.bin, from tests/golden/make_optim_goldens.py), and
// for the Optimizer concept, the ledger, the gradient-dtype overloads and errors.
//
// Errors are measured normwise, max_i |a_i - b_i| / max_i |b_i|: relative to
// the array's scale. Elementwise relative errors are meaningless for entries
// that pass near zero (torch's own float32 run differs from its float64 run by
// 4e-4 elementwise on such a parameter, and by 2e-6 normwise).
#include "shardlib/core/buffer.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/ledger.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/clip.hpp"
#include "shardlib/optim/optimizer.hpp"
#include "shardlib/optim/schedule.hpp"
#include "shardlib/optim/sgd.hpp"
#include "support/compare.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <numbers>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace test_optim {

using namespace shardlib;
using namespace shardlib::optim;

namespace {

// --- inputs: the integer formulas of make_optim_goldens.py ------------------------------------
constexpr int steps = 100;

double initial_param(std::size_t i) { return (2.0 * double((i * 37 + 11) % 401) - 401.0) / 512.0; }

double gradient(std::int64_t t, std::size_t i) {
  const std::uint64_t h = ((std::uint64_t(t) * 1000003 + i * 7919 + 12345) * 2654435761ULL) % (1ULL << 32);
  return (double((h >> 7) % 2001) - 1000.0) / 512.0 / std::pow(16.0, double(i % 4));
}

// What a run produces, keyed as in the golden file after "<dtype>/<variant>/":
// "param/1", "param/100" and "<state buffer>/100".
using trajectory = std::map<std::string, std::vector<double>>;

bool snapshot(int t) { return t == 1 || t == steps; }

// The learning rate of the update at 0-based step t; nullptr keeps options.lr.
using lr_schedule = std::function<double(std::int64_t)>;

// --- shardlib's optimizers, float32 master parameters -----------------------------------------
template <class O>
trajectory run_shardlib(O opt, std::size_t n, const lr_schedule& lr = nullptr) {
  std::vector<float> p(n), g(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = float(initial_param(i));
  auto s = opt.make_state(n);
  trajectory out;
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = 0; i < n; ++i) g[i] = float(gradient(t, i));
    if (lr) opt.options.lr = lr(s.step);
    opt.step(p, g, s);
    if (snapshot(t)) out["param/" + std::to_string(t)].assign(p.begin(), p.end());
  }
  CHECK(s.step == steps);
  s.for_each_buffer([&](std::string_view name, Buffer<float>& b) {
    out[std::string(name) + "/" + std::to_string(steps)].assign(b.data(), b.data() + b.size());
  });
  return out;
}

// --- float64 reference: the equations of PyTorch's docs, written out ---------------------------
// torch.optim.Adam / AdamW (docs 1.13): with g the gradient at step t,
//   Adam: g += wd p;  AdamW: p -= lr wd p
//   m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2,  m^ = m / (1 - b1^t),  v^ = v / (1 - b2^t)
//   p -= lr m^ / (sqrt(v^) + eps)
// The docs' amsgrad takes max(v^max, v^); the implementation (and so the goldens)
// keeps the max of the uncorrected v and corrects it by the current step:
//   vmax = max(vmax, v),  v^ = vmax / (1 - b2^t). The reference follows the implementation.
template <decay_style Style>
trajectory run_reference(const BasicAdam<Style>& opt, std::size_t n, const lr_schedule& lr_at = nullptr) {
  const auto& o = opt.options;
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0), vmax(n, 0.0);
  for (std::size_t i = 0; i < n; ++i) p[i] = initial_param(i);
  trajectory out;
  for (int t = 1; t <= steps; ++t) {
    const double lr = lr_at ? lr_at(t - 1) : o.lr;
    for (std::size_t i = 0; i < n; ++i) {
      double g = gradient(t, i);
      if (Style == decay_style::decoupled) p[i] -= lr * o.weight_decay * p[i];
      else g += o.weight_decay * p[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      vmax[i] = test_support::max_keeping_nan(vmax[i], v[i]);  // torch.maximum keeps a NaN
      const double m_hat = m[i] / (1 - std::pow(o.beta1, t));
      const double v_hat = (o.amsgrad ? vmax[i] : v[i]) / (1 - std::pow(o.beta2, t));
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + o.eps);
    }
    if (snapshot(t)) out["param/" + std::to_string(t)] = p;
  }
  out["exp_avg/100"] = m;
  out["exp_avg_sq/100"] = v;
  if (o.amsgrad) out["max_exp_avg_sq/100"] = vmax;
  return out;
}

// torch.optim.SGD (docs 1.13): g += wd p; with momentum mu: b = g at t = 1, else
// b = mu b + (1 - dampening) g; g = g + mu b (Nesterov) or g = b; p -= lr g.
trajectory run_reference(const SGD& opt, std::size_t n, const lr_schedule& lr_at = nullptr) {
  const auto& o = opt.options;
  std::vector<double> p(n), b(n, 0.0);
  for (std::size_t i = 0; i < n; ++i) p[i] = initial_param(i);
  trajectory out;
  for (int t = 1; t <= steps; ++t) {
    const double lr = lr_at ? lr_at(t - 1) : o.lr;
    for (std::size_t i = 0; i < n; ++i) {
      double g = gradient(t, i) + o.weight_decay * p[i];
      if (o.momentum != 0) {
        b[i] = t == 1 ? g : o.momentum * b[i] + (1 - o.dampening) * g;
        g = o.nesterov ? g + o.momentum * b[i] : b[i];
      }
      p[i] -= lr * g;
    }
    if (snapshot(t)) out["param/" + std::to_string(t)] = p;
  }
  if (o.momentum != 0) out["momentum_buffer/100"] = b;
  return out;
}

// --- the variants, as in make_optim_goldens.py -------------------------------------------------
using any_optimizer = std::variant<Adam, AdamW, SGD>;
struct variant_case {
  std::string name;
  any_optimizer opt;
};
const std::vector<variant_case>& variants() {
  static const std::vector<variant_case> v = {
      {"adam", Adam{{.lr = 1e-2}}},
      {"adam_l2", Adam{{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1}}},
      {"adam_amsgrad", Adam{{.lr = 1e-2, .amsgrad = true}}},
      {"adamw", AdamW{{.lr = 1e-2, .weight_decay = 0.1}}},
      {"adamw_amsgrad", AdamW{{.lr = 1e-2, .weight_decay = 0.1, .amsgrad = true}}},
      {"sgd", SGD{{.lr = 0.1}}},
      {"sgd_momentum", SGD{{.lr = 0.1, .momentum = 0.9, .dampening = 0.1}}},
      {"sgd_nesterov", SGD{{.lr = 0.1, .momentum = 0.9, .nesterov = true}}},
      {"sgd_weight_decay", SGD{{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01}}},
  };
  return v;
}

// max_i |a_i - b_i| / max_i |b_i|
double normwise_error(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  test_support::max_error diff;  // NaN and infinities count as +inf
  double scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff.absolute(a[i], b[i]);
    scale = test_support::max_keeping_nan(scale, std::abs(b[i]));
  }
  return scale > 0 ? diff.value() / scale : diff.value();
}

// Every array of `expected` against the same key of `actual`; returns the worst error.
double worst_error(const trajectory& actual, const trajectory& expected) {
  REQUIRE(actual.size() == expected.size());
  test_support::max_error worst;
  for (const auto& [key, values] : expected) {
    INFO(key);
    REQUIRE(actual.count(key) == 1);
    worst.add(normwise_error(actual.at(key), values));
  }
  return worst.value();
}

// --- the golden file (format in make_optim_goldens.py) -----------------------------------------
const std::map<std::string, std::vector<double>>& goldens() {
  static const auto records = [] {
    static_assert(std::endian::native == std::endian::little, "the golden file is little-endian");
    const auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / "golden" / "optim_goldens.bin";
    INFO("golden file " << path.string() << " (found from __FILE__)");
    std::ifstream f(path, std::ios::binary);
    REQUIRE(f.good());
    std::map<std::string, std::vector<double>> r;
    std::uint32_t length = 0;
    while (f.read(reinterpret_cast<char*>(&length), sizeof length)) {
      std::string name(length, '\0');
      std::uint64_t count = 0;
      f.read(name.data(), length);
      f.read(reinterpret_cast<char*>(&count), sizeof count);
      std::vector<double> values(count);
      f.read(reinterpret_cast<char*>(values.data()), std::streamsize(count * sizeof(double)));
      REQUIRE(f.good());
      r.emplace(std::move(name), std::move(values));
    }
    return r;
  }();
  return records;
}

// The golden arrays "<dtype>/<variant>/..." with the prefix removed.
trajectory golden(const std::string& dtype, const std::string& variant) {
  const std::string prefix = dtype + "/" + variant + "/";
  trajectory t;
  for (const auto& [key, values] : goldens())
    if (key.starts_with(prefix)) t[key.substr(prefix.size())] = values;
  REQUIRE(!t.empty());
  return t;
}

constexpr std::size_t golden_n = 256;  // N of make_optim_goldens.py

}  // namespace

// --- against the float64 reference --------------------------------------------------------------

TEST_CASE("the golden file's inputs are the test's formulas", "[optim][golden]") {
  const auto& g = goldens();
  std::vector<double> p0(golden_n), g1(golden_n), g100(golden_n);
  for (std::size_t i = 0; i < golden_n; ++i) {
    p0[i] = initial_param(i);
    g1[i] = gradient(1, i);
    g100[i] = gradient(100, i);
    CHECK(double(float(p0[i])) == p0[i]);  // exact in float32, so both runs start alike
    CHECK(double(float(g1[i])) == g1[i]);
  }
  CHECK(g.at("input/param0") == p0);
  CHECK(g.at("input/grad/1") == g1);
  CHECK(g.at("input/grad/100") == g100);
}

TEST_CASE("the float64 reference reproduces torch's float64 trajectories", "[optim][golden]") {
  // Both are float64 evaluations of the same equations in a slightly different
  // order: agreement to 1e-12 (observed: 1.1e-15) shows that the reference
  // implements what torch does.
  for (const auto& [name, opt] : variants()) {
    INFO(name);
    const auto ref = std::visit([&](const auto& o) { return run_reference(o, golden_n); }, opt);
    CHECK(worst_error(ref, golden("f64", name)) <= 1e-12);
  }
}

TEST_CASE("each optimizer follows the float64 reference for 100 steps", "[optim]") {
  // 263 parameters: not a multiple of any vector width, so the loops' tails run.
  // Tolerance 1e-5 (normwise, parameters and state): every step rounds p to
  // float (2^-24 relative) and computes the update in float (a few ulps of it);
  // over 100 steps that is at most ~100 * 1e-7. Observed: at most 1.8e-6
  // (AdamW with amsgrad, parameters), as for torch's own float32 run.
  for (const auto& [name, opt] : variants()) {
    INFO(name);
    std::visit(
        [&](const auto& o) {
          const auto err = worst_error(run_shardlib(o, 263), run_reference(o, 263));
          CHECK(err <= 1e-5);
        },
        opt);
  }
}

TEST_CASE("learning rates changed between steps take effect (warmup + cosine schedule)", "[optim][schedule]") {
  const warmup_cosine sched{.peak_lr = 2e-2, .min_lr = 1e-3, .warmup_steps = 10, .total_steps = 80,
                            .start_factor = 0.1};
  const lr_schedule lr = [&](std::int64_t t) { return double(sched(t)); };
  const Adam adam{{.amsgrad = true}};
  CHECK(worst_error(run_shardlib(adam, 263, lr), run_reference(adam, 263, lr)) <= 1e-5);
  const SGD sgd{{.momentum = 0.9, .nesterov = true}};
  CHECK(worst_error(run_shardlib(sgd, 263, lr), run_reference(sgd, 263, lr)) <= 1e-5);
  // The same runs with a constant rate end elsewhere, so the schedule mattered.
  CHECK(normwise_error(run_shardlib(adam, 263).at("param/100"), run_shardlib(adam, 263, lr).at("param/100")) > 1e-2);
}

// --- against torch ---------------------------------------------------------------------------------

TEST_CASE("each optimizer matches torch's float64 trajectory", "[optim][golden]") {
  // Same bound and reason as against the reference. Observed: at most 1.8e-6.
  for (const auto& [name, opt] : variants()) {
    INFO(name);
    const auto ours = std::visit([&](const auto& o) { return run_shardlib(o, golden_n); }, opt);
    CHECK(worst_error(ours, golden("f64", name)) <= 1e-5);
  }
}

TEST_CASE("each optimizer matches torch's float32 trajectory", "[optim][golden]") {
  // Both compute in float32 with the same operations in the same order, so they
  // differ only where one fuses a multiply-add that the other rounds twice.
  // Observed: 0 (bit for bit) with GCC 12 -O3 -march=native, which fuses the
  // products torch's AVX2 kernels fuse; 3.0e-7 built without FMA. Bound 1e-6.
  for (const auto& [name, opt] : variants()) {
    INFO(name);
    const auto ours = std::visit([&](const auto& o) { return run_shardlib(o, golden_n); }, opt);
    CHECK(worst_error(ours, golden("f32", name)) <= 1e-6);
  }
}

// --- details of the step -------------------------------------------------------------------------

TEST_CASE("a bfloat16 or half gradient steps exactly like its float value", "[optim]") {
  constexpr std::size_t n = 263;
  std::vector<float> p0(n);
  for (std::size_t i = 0; i < n; ++i) p0[i] = float(initial_param(i));
  // Ten steps with gradients G, and with the same gradients widened to float first.
  auto run = [&]<class G>(auto opt, G) {
    std::vector<float> p = p0, q = p0, widened(n);
    std::vector<G> g(n);
    auto s = opt.make_state(n), r = opt.make_state(n);
    for (int t = 1; t <= 10; ++t) {
      for (std::size_t i = 0; i < n; ++i) {
        g[i] = G(gradient(t, i));
        widened[i] = float(g[i]);
      }
      opt.step(p, std::span<const G>(g), s);
      opt.step(q, std::span<const float>(widened), r);
    }
    CHECK(p == q);
    CHECK(p != p0);
    std::vector<std::vector<float>> a, b;
    s.for_each_buffer([&](std::string_view, Buffer<float>& x) { a.emplace_back(x.data(), x.data() + n); });
    r.for_each_buffer([&](std::string_view, Buffer<float>& x) { b.emplace_back(x.data(), x.data() + n); });
    CHECK(a == b);
  };
  run(Adam{{.weight_decay = 0.1, .amsgrad = true}}, bfloat16{});
  run(AdamW{{.amsgrad = true}}, bfloat16{});
  run(SGD{{.momentum = 0.9, .weight_decay = 0.01, .nesterov = true}}, bfloat16{});
  run(Adam{{.weight_decay = 0.1, .amsgrad = true}}, half{});
  run(AdamW{}, half{});
  run(SGD{{.momentum = 0.9, .dampening = 0.1}}, half{});
}

TEST_CASE("empty shards step without touching memory", "[optim]") {
  std::span<float> none;
  auto adam = Adam{{.amsgrad = true}};
  auto a = adam.make_state(0);
  adam.step(none, std::span<const float>(), a);
  SGD sgd{{.momentum = 0.9}};
  auto s = sgd.make_state(0);
  sgd.step(none, std::span<const bfloat16>(), s);
  CHECK(a.step == 1);
  CHECK(s.step == 1);
}

TEST_CASE("SGD's momentum buffer starts as the first gradient", "[optim]") {
  std::vector<float> p{1.0f, -2.0f, 0.5f}, g{0.25f, 0.5f, -3.0f};
  SGD sgd{{.lr = 0.5, .momentum = 0.9, .dampening = 0.5}};
  auto s = sgd.make_state(3);
  sgd.step(p, g, s);
  CHECK(std::vector<float>(s.momentum_buffer.data(), s.momentum_buffer.data() + 3) == g);  // not (1 - dampening) g
  CHECK(p == std::vector<float>{0.875f, -2.25f, 2.0f});
  sgd.step(p, g, s);  // now buf = 0.9 buf + 0.5 g
  CHECK(s.momentum_buffer[0] == 0.9f * 0.25f + 0.5f * 0.25f);
}

TEST_CASE("make_state records zeroed optimizer state in the ledger", "[optim][ledger]") {
  auto& l = current_ledger();
  const std::size_t before = l.current(category::optimizer_state);
  constexpr std::size_t n = 1000;
  auto bytes_of = [&](const auto& opt) {
    auto s = opt.make_state(n);
    const std::size_t used = l.current(category::optimizer_state) - before;
    s.for_each_buffer([&](std::string_view name, Buffer<float>& b) {
      INFO(name);
      CHECK(b.kind() == category::optimizer_state);
      CHECK(std::all_of(b.data(), b.data() + b.size(), [](float x) { return x == 0.0f; }));
    });
    CHECK(s.step == 0);
    return used;
  };
  CHECK(bytes_of(Adam{}) == 8 * n);
  CHECK(bytes_of(Adam{{.amsgrad = true}}) == 12 * n);
  CHECK(bytes_of(AdamW{}) == 8 * n);
  CHECK(bytes_of(SGD{{.momentum = 0.9}}) == 4 * n);
  CHECK(bytes_of(SGD{}) == 0);
  CHECK(l.current(category::optimizer_state) == before);  // released with the state
}

TEST_CASE("bad sizes, states and options throw errors that name the problem", "[optim][error]") {
  std::vector<float> p(4, 1.0f), g(3, 1.0f), g4(4, 1.0f);
  Adam adam;
  auto s = adam.make_state(4);
  CHECK_THROWS_AS(adam.step(p, g, s), shape_error);
  CHECK_THROWS_WITH(adam.step(p, g, s), "Adam::step: 4 parameters but 3 gradients");
  auto small = adam.make_state(2);
  CHECK_THROWS_WITH(adam.step(p, g4, small), "Adam::step: 4 parameters but 2 exp_avg entries");
  adam.options.amsgrad = true;  // the state was made without max_exp_avg_sq
  CHECK_THROWS_WITH(adam.step(p, g4, s), Catch::Contains("amsgrad is set but the state was made without it"));
  adam.options.amsgrad = false;
  adam.options.beta1 = 1.0;
  CHECK_THROWS_WITH(adam.step(p, g4, s), Catch::Contains("invalid beta1 1"));
  CHECK(s.step == 0);  // nothing was stepped
  auto sw = AdamW{}.make_state(4);
  CHECK_THROWS_WITH(AdamW{{.lr = -1}}.step(p, g4, sw), Catch::Contains("AdamW: invalid learning rate -1"));

  SGD sgd;
  auto plain = sgd.make_state(4);
  sgd.options.momentum = 0.9;
  CHECK_THROWS_WITH(sgd.step(p, g4, plain), Catch::Contains("state was made with momentum 0"));
  auto with_momentum = sgd.make_state(4);
  sgd.options.nesterov = true;
  sgd.options.dampening = 0.1;
  CHECK_THROWS_WITH(sgd.step(p, g4, with_momentum), Catch::Contains("Nesterov momentum requires"));
  CHECK(p == std::vector<float>(4, 1.0f));
}

TEST_CASE("sqrt_rn is the correctly rounded square root of every float", "[optim]") {
  // All floats in [1, 4); the iteration commutes exactly with scaling by 4^k, so
  // these stand for every positive float, subnormals included.
  std::uint64_t wrong = 0, checked = 0;
  for (float x = 1.0f; x < 4.0f; x = std::nextafter(x, 4.0f), ++checked)
    wrong += optim::detail::sqrt_rn(x) != std::sqrt(x);
  CHECK(checked == (std::uint64_t{1} << 24));
  CHECK(wrong == 0);
  // A stride through all positive floats, and the special values.
  for (std::uint32_t u = 0; u < 0x7F800000u; u += 4099) {
    const float x = std::bit_cast<float>(u);
    wrong += optim::detail::sqrt_rn(x) != std::sqrt(x);
  }
  CHECK(wrong == 0);
  constexpr float inf = std::numeric_limits<float>::infinity();
  CHECK(optim::detail::sqrt_rn(inf) == inf);
  CHECK(optim::detail::sqrt_rn(0.0f) == 0.0f);
  CHECK(std::signbit(optim::detail::sqrt_rn(-0.0f)));
  CHECK(std::isnan(optim::detail::sqrt_rn(-1.0f)));
  CHECK(std::isnan(optim::detail::sqrt_rn(-inf)));
  CHECK(std::isnan(optim::detail::sqrt_rn(std::numeric_limits<float>::quiet_NaN())));
  CHECK(optim::detail::sqrt_rn(std::numeric_limits<float>::denorm_min()) == std::sqrt(std::numeric_limits<float>::denorm_min()));
  CHECK(optim::detail::sqrt_rn(std::numeric_limits<float>::max()) == std::sqrt(std::numeric_limits<float>::max()));
}

// --- the concept -----------------------------------------------------------------------------------

namespace {
struct user_optimizer {
  struct options_type {
    double lr = 0.1;
  } options;
  struct state {
    Buffer<float> buf;
    std::int64_t step = 0;
    template <class F>
    void for_each_buffer(F&& f) { f(std::string_view("buf"), buf); }
  };
  state make_state(std::size_t) const { return {}; }
  template <class G>
  void step(std::span<float>, std::span<const G>, state&) {}
};
// Only float gradients: the declaration hides the template.
struct float_gradients_only : user_optimizer {
  void step(std::span<float>, std::span<const float>, state&) {}
};
struct no_state {
  struct {
    double lr = 0.1;
  } options;
};
struct no_learning_rate : user_optimizer {
  struct {
    double momentum = 0;
  } options;
};
struct no_step_count {
  user_optimizer::options_type options;
  struct state {
    Buffer<float> buf;
    template <class F>
    void for_each_buffer(F&&) {}
  };
  state make_state(std::size_t) const { return {}; }
  template <class G>
  void step(std::span<float>, std::span<const G>, state&) {}
};
struct no_buffers {
  user_optimizer::options_type options;
  struct state {
    std::int64_t step = 0;
  };
  state make_state(std::size_t) const { return {}; }
  template <class G>
  void step(std::span<float>, std::span<const G>, state&) {}
};
}  // namespace

TEST_CASE("Optimizer accepts complete types and rejects incomplete ones", "[optim][concepts]") {
  STATIC_REQUIRE(Optimizer<Adam>);
  STATIC_REQUIRE(Optimizer<AdamW>);
  STATIC_REQUIRE(Optimizer<SGD>);
  STATIC_REQUIRE(check_optimizer<SGD>());
  STATIC_REQUIRE(Optimizer<user_optimizer>);
  STATIC_REQUIRE(check_optimizer<user_optimizer>());

  STATIC_REQUIRE_FALSE(Optimizer<float_gradients_only>);
  STATIC_REQUIRE(optim::detail::has_step<float_gradients_only, float>);
  STATIC_REQUIRE_FALSE(optim::detail::has_step<float_gradients_only, bfloat16>);
  STATIC_REQUIRE_FALSE(Optimizer<no_state>);
  STATIC_REQUIRE_FALSE(optim::detail::has_state<no_state>);
  STATIC_REQUIRE_FALSE(Optimizer<no_learning_rate>);
  STATIC_REQUIRE_FALSE(optim::detail::has_lr<no_learning_rate>);
  STATIC_REQUIRE_FALSE(Optimizer<no_step_count>);
  STATIC_REQUIRE_FALSE(optim::detail::has_step_count<no_step_count>);
  STATIC_REQUIRE_FALSE(Optimizer<no_buffers>);
  STATIC_REQUIRE_FALSE(optim::detail::has_buffers<no_buffers>);
  STATIC_REQUIRE_FALSE(Optimizer<int>);
}

// --- clipping --------------------------------------------------------------------------------------

TEST_CASE("clip_grad_norm: the global norm, and scaling only above max_norm", "[optim][clip]") {
  std::vector<float> a(1000), b(37);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = float(gradient(1, i));
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(gradient(2, i));
  double squared = 0;  // float64 reference, one running sum
  for (float x : a) squared += double(x) * double(x);
  for (float x : b) squared += double(x) * double(x);
  const double norm = std::sqrt(squared);
  const std::vector<float> a0 = a, b0 = b;
  const std::span<float> both[] = {a, b};

  CHECK(grad_norm_squared(a) + grad_norm_squared(b) == Approx(squared).epsilon(1e-14));
  CHECK(grad_norm_squared(std::span<const float>()) == 0.0);

  // Below max_norm: the norm is returned, nothing changes.
  CHECK(clip_grad_norm(both, float(2 * norm)) == float(norm));
  CHECK((a == a0 && b == b0));

  // Above: every gradient scaled by max_norm / (norm + 1e-6), as PyTorch does.
  const float max_norm = float(norm / 4);
  const float c = float(max_norm / (norm + 1e-6));
  CHECK(clip_grad_norm(both, max_norm) == float(norm));
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == a0[i] * c);
  for (std::size_t i = 0; i < b.size(); ++i) REQUIRE(b[i] == b0[i] * c);
  CHECK(std::sqrt(grad_norm_squared(a) + grad_norm_squared(b)) == Approx(max_norm).epsilon(1e-6));

  // Zero gradients: norm 0, nothing scaled, no NaN.
  std::vector<float> z(17, 0.0f);
  const std::span<float> zs[] = {z};
  CHECK(clip_grad_norm(zs, 1.0f) == 0.0f);
  CHECK(z == std::vector<float>(17, 0.0f));

  // A non-finite norm throws instead of wiping the gradients.
  z[3] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH(clip_grad_norm(zs, 1.0f), Catch::Contains("the total gradient norm is inf"));
  CHECK_THROWS_AS(clip_coefficient(1.0, 0.0f), error);
}

TEST_CASE("clip_coefficient is PyTorch's max_norm / (norm + 1e-6), at most 1", "[optim][clip]") {
  CHECK(clip_coefficient(3.0, 1.0f) == float(1.0 / (3.0 + 1e-6)));
  CHECK(clip_coefficient(0.5, 1.0f) == 1.0f);
  CHECK(clip_coefficient(0.0, 1.0f) == 1.0f);
  CHECK(clip_coefficient(1.0, 1.0f) < 1.0f);  // the 1e-6 scales a norm equal to max_norm a little
}

// --- schedules -------------------------------------------------------------------------------------

TEST_CASE("constant and warmup + cosine schedules at their key steps", "[optim][schedule]") {
  STATIC_REQUIRE(Schedule<constant_lr>);
  STATIC_REQUIRE(Schedule<warmup_cosine>);
  STATIC_REQUIRE_FALSE(Schedule<int>);
  CHECK(constant_lr{.lr = 3e-4}(0) == 3e-4);
  CHECK(constant_lr{.lr = 3e-4}(123456) == 3e-4);

  // W = 10, T = 110: warmup over steps 0..9, cosine over 10..109, min from 110.
  const warmup_cosine s{.peak_lr = 1e-3, .min_lr = 1e-5, .warmup_steps = 10, .total_steps = 110};
  CHECK(s(0) == 0.0f);                                         // warmup starts at 0
  CHECK(s(5) == Approx(5e-4).epsilon(1e-6));                   // half way up
  CHECK(s(9) == Approx(9e-4).epsilon(1e-6));
  CHECK(s(10) == Approx(1e-3).epsilon(1e-6));                  // warmup end: the peak
  CHECK(s(35) == Approx(1e-5 + 9.9e-4 * 0.8535533905932737).epsilon(1e-6));  // cos(pi/4)
  CHECK(s(60) == Approx(5.05e-4).epsilon(1e-6));               // middle: half way between peak and min
  CHECK(s(109) == Approx(1e-5 + 9.9e-4 * 0.5 * (1 + std::cos(std::numbers::pi * 0.99))).epsilon(1e-6));
  CHECK(s(110) == Approx(1e-5).epsilon(1e-6));                 // end: the minimum
  CHECK(s(100000) == Approx(1e-5).epsilon(1e-6));              // beyond: stays there
  for (std::int64_t t = 10; t < 110; ++t) CHECK(s(t + 1) <= s(t));

  const warmup_cosine f{.peak_lr = 1e-3, .warmup_steps = 10, .total_steps = 20, .start_factor = 0.1};
  CHECK(f(0) == Approx(1e-4).epsilon(1e-6));
  CHECK(f(5) == Approx(5.5e-4).epsilon(1e-6));
  CHECK(f(20) == 0.0f);
  CHECK(warmup_cosine{.peak_lr = 1e-3, .total_steps = 100}(0) == Approx(1e-3).epsilon(1e-6));  // no warmup

  // Rates are doubles, as torch's schedulers give them: Adam rounds lr / (1 - beta1^t)
  // to float once. The formula in double, exactly (a rate rounded to float is ~1e-8 off).
  const double x = double(35 - 10) / double(110 - 10);
  CHECK(s(35) == 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + std::cos(std::numbers::pi * x)));
  CHECK(s(5) == 1e-3 * (0 + (1 - 0) * 5.0 / 10.0));
  CHECK(constant_lr{.lr = 3e-4}(7) != double(3e-4f));

  CHECK_THROWS_AS((warmup_cosine{.warmup_steps = 10, .total_steps = 5}(0)), error);
  CHECK_THROWS_AS(s(-1), error);
  // A minimum above the peak would make the "decay" climb.
  CHECK_THROWS_WITH((warmup_cosine{.peak_lr = 1e-4, .min_lr = 3e-4, .total_steps = 10}(0)),
                    "warmup_cosine: needs 0 <= min_lr <= peak_lr, got min_lr 0.0003 and peak_lr 0.0001");
}

}  // namespace test_optim
