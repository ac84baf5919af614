// The custom_layer example's GatedMLP (examples/custom_layer/gated_mlp.hpp, the
// same header the example compiles): the Layer concept, names, forward against
// the formula, backward against finite differences, and sharded training.
#include "custom_layer/gated_mlp.hpp"

#include "shardlib/comm/launch.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/shard/sharded_model.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "support/gradcheck.hpp"
#include "support/shard_fixture.hpp"
#include "support/compare.hpp"
#include "support/raised.hpp"

namespace test_custom_layer {

using namespace shardlib;
using example::GatedMLP;

TEST_CASE("GatedMLP models Layer and names its weights", "[nn][custom_layer]") {
  STATIC_REQUIRE(nn::check_layer<GatedMLP<float>>());
  STATIC_REQUIRE(nn::Layer<nn::Sequential<nn::Linear<double>, GatedMLP<double>>>);
  GatedMLP<float> l(4, 6);
  nn::Replicated<float, GatedMLP<float>> owner(l, 0);
  std::vector<std::string> names;
  for (const auto& e : owner.layout().entries) names.push_back(e.name + cat(e.shape));
  CHECK(names == std::vector<std::string>{"gate_proj.weight[6, 4]", "up_proj.weight[6, 4]", "down_proj.weight[4, 6]"});
}

TEST_CASE("GatedMLP: forward is W_down(silu(W_gate x) * W_up x)", "[nn][custom_layer]") {
  const std::int64_t d = 3, h = 5;
  GatedMLP<double> l(d, h);
  nn::Replicated<double, GatedMLP<double>> owner(l, 4);
  auto x = gradcheck::random_tensor({2, d}, 3);
  nn::context ctx;
  auto y = l.forward(ctx, x);
  REQUIRE(y.shape() == Shape{2, d});
  auto wg = owner.value("gate_proj.weight"), wu = owner.value("up_proj.weight"), wd = owner.value("down_proj.weight");
  for (std::int64_t r = 0; r < 2; ++r)
    for (std::int64_t o = 0; o < d; ++o) {
      double want = 0;
      for (std::int64_t j = 0; j < h; ++j) {
        double g = 0, u = 0;
        for (std::int64_t k = 0; k < d; ++k) {
          g += wg[std::size_t(j * d + k)] * x[r * d + k];
          u += wu[std::size_t(j * d + k)] * x[r * d + k];
        }
        want += wd[std::size_t(o * h + j)] * g / (1 + std::exp(-g)) * u;
      }
      CHECK(y[r * d + o] == Approx(want).epsilon(1e-12));
    }
}

TEST_CASE("GatedMLP: backward matches finite differences", "[nn][custom_layer][gradcheck]") {
  GatedMLP<double> l(6, 10);
  auto r = gradcheck::check(l, gradcheck::random_tensor({3, 4, 6}, 5, 2.0));
  INFO("worst: " << r.worst);
  CHECK(r.max_rel_error < 1e-6);
  CHECK(r.compared > 100);

  // And inside a Sequential with a library layer, so dx flows on into Linear's gradients.
  nn::Sequential<nn::Linear<double>, GatedMLP<double>> m{nn::Linear<double>(5, 6), GatedMLP<double>(6, 8)};
  auto rs = gradcheck::check(m, gradcheck::random_tensor({7, 5}, 6));
  INFO("worst in Sequential: " << rs.worst);
  CHECK(rs.max_rel_error < 1e-6);
}

TEST_CASE("GatedMLP: backward accumulates into the gradients", "[nn][custom_layer]") {
  GatedMLP<double> l(4, 6);
  nn::Replicated<double, GatedMLP<double>> owner(l, 2);
  auto x = gradcheck::random_tensor({3, 4}, 8);
  auto dy = gradcheck::random_tensor({3, 4}, 9);
  nn::context ctx;
  l.forward(ctx, x);
  l.backward(ctx, dy);
  const std::vector<double> once(owner.grads().begin(), owner.grads().end());
  l.forward(ctx, x);
  l.backward(ctx, dy);
  for (std::size_t i = 0; i < once.size(); ++i) CHECK(owner.grads()[i] == Approx(2 * once[i]).margin(1e-15));
}

namespace {

using Net = nn::Sequential<nn::Linear<float>, GatedMLP<float>, nn::Linear<float>>;
Net make_net() { return Net{nn::Linear<float>(6, 8), GatedMLP<float>(8, 12), nn::Linear<float>(8, 3)}; }

}  // namespace

// The user's layer as a FullShard unit on W ranks, each with its rows of the global
// batch, against one process training on the whole batch. Tolerance 1e-5 relative to
// max(|want|, lr): the ranks' partial gradients are averaged in another order, a float
// rounding difference, and Adam moves every parameter by about lr whatever its
// gradient's scale, so a parameter near zero is compared against lr (as in
// test_checkpoint).
TEST_CASE("GatedMLP trains sharded (FullShard, W = 2 and 4) as it trains unsharded", "[nn][custom_layer][shard]") {
  constexpr int steps = 10;
  constexpr std::int64_t global = 8;
  std::vector<float> want;
  {
    Net net = make_net();
    nn::Replicated<float, Net> owner(net, 3);
    optim::Adam adam{{.lr = 1e-2}};
    auto st = adam.make_state(owner.values().size());
    nn::context ctx;
    for (int s = 0; s < steps; ++s) {
      owner.zero_grad();
      auto l = fixture::mse(ctx.forward(net, fixture::batch(s, global, 6, 1)), fixture::batch(s, global, 3, 2));
      ctx.backward(net, l.grad);
      adam.step(owner.values(), owner.grads(), st);
    }
    for (const auto& e : owner.layout().entries)
      want.insert(want.end(), owner.values().begin() + std::ptrdiff_t(e.offset),
                  owner.values().begin() + std::ptrdiff_t(e.offset + e.numel()));
  }
  for (int world : {2, 4}) {
    std::vector<float> got;
    comm::launch(world, [&](comm::ThreadComm& c) {
      Net net = make_net();
      auto sharded =
          shard::fully_shard(net, c, shard::FullShard{}, {.wrap = shard::wrap_types<GatedMLP<float>>{}, .seed = 3});
      if (sharded.unit_count() != 2 || sharded.unit_name(1) != "1") throw error("the GatedMLP is not its own unit");
      optim::Adam adam{{.lr = 1e-2}};
      const std::int64_t local = global / world, first = c.rank() * local;
      for (int s = 0; s < steps; ++s)
        sharded.train_step(adam, fixture::batch(s, local, 6, 1, first), fixture::batch(s, local, 3, 2, first),
                           fixture::mse);
      auto sd = sharded.full_state_dict();
      if (c.rank() == 0)
        for (auto& [name, t] : sd) got.insert(got.end(), t.span().begin(), t.span().end());
    });
    INFO("world " << world);
    REQUIRE(got.size() == want.size());
    test_support::max_error worst;  // NaN and infinities count as +inf
    worst.relative(got, want, 1e-2);
    CHECK(worst <= 1e-5);
  }
}

namespace {
// A composite that runs its child directly instead of through the context: the
// child's unit is never gathered.
struct bypass {
  using input = Tensor<float>;
  using output = Tensor<float>;
  GatedMLP<float> inner{4, 6};
  template <class V>
  void children(V&& v) {
    v("inner", inner);
  }
  template <class V>
  void parameters(V&& v) {
    nn::visit_parameters("inner", inner, v);
  }
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    return inner.forward(ctx, x);
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    return inner.backward(ctx, dy);
  }
};
}  // namespace

TEST_CASE("a composite that bypasses the context gets an error naming the parameter, not a crash",
          "[nn][custom_layer][shard]") {
  std::vector<std::string> errors(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    bypass model;
    auto sharded = shard::fully_shard(model, c, shard::FullShard{}, {.wrap = shard::wrap_types<GatedMLP<float>>{}});
    errors[std::size_t(c.rank())] = test_support::raised([&] { sharded.forward(fixture::batch(0, 2, 4, 1)); });
  });
  for (const auto& e : errors)
    CHECK_THAT(e, Catch::Contains("GatedMLP: parameter 'inner.gate_proj.weight' has no values bound") &&
                      Catch::Contains("ctx.forward(child, x)"));
}

}  // namespace test_custom_layer
