// The custom_layer example's GatedMLP (examples/custom_layer/gated_mlp.hpp, the
// same header the example compiles): the Layer concept, names, forward against
// the formula, and backward against finite differences.
#include "custom_layer/gated_mlp.hpp"

#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "support/gradcheck.hpp"

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
