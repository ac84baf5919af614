// Layers: the Layer concept, parameter names and init, and finite-difference gradients.
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/nn/pooling.hpp"
#include "shardlib/nn/transformer.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <numeric>

#include "support/compare.hpp"
#include "support/gradcheck.hpp"

namespace test_nn {

using namespace shardlib;
using namespace shardlib::nn;

namespace {
struct no_backward {
  using input = Tensor<float>;
  using output = Tensor<float>;
  template <class V> void parameters(V&&) {}
  template <class C> output forward(C&, const input& x) { return x; }
};
struct wrong_backward_type : no_backward {
  template <class C> output backward(C&, const Tensor<double>& dy);
};
}  // namespace

TEST_CASE("Layer accepts the library's layers and rejects incomplete ones", "[nn][concepts]") {
  STATIC_REQUIRE(Layer<Linear<float>>);
  STATIC_REQUIRE(Layer<Sequential<Linear<double>, Linear<double>>>);
  STATIC_REQUIRE(Composite<Stack<Linear<float>>>);
  STATIC_REQUIRE_FALSE(Composite<Linear<float>>);
  STATIC_REQUIRE(check_layer<Linear<double>>());
  STATIC_REQUIRE_FALSE(Layer<no_backward>);
  STATIC_REQUIRE_FALSE(nn::detail::has_backward<no_backward>);
  STATIC_REQUIRE_FALSE(Layer<wrong_backward_type>);
  STATIC_REQUIRE_FALSE(Layer<int>);
}

TEST_CASE("parameters carry PyTorch names, layouts and default init ranges", "[nn][init]") {
  using M = Sequential<Stack<Linear<float>>, Linear<float>>;
  M m{Stack<Linear<float>>(2, Linear<float>(4, 4)), Linear<float>(4, 3, false)};
  Replicated<float, M> owner(m, 1);
  std::vector<std::string> names;
  for (auto& e : owner.layout().entries) names.push_back(e.name + cat(e.shape));
  CHECK(names == std::vector<std::string>{"0.layers.0.weight[4, 4]", "0.layers.0.bias[4]", "0.layers.1.weight[4, 4]",
                                          "0.layers.1.bias[4]", "1.weight[3, 4]"});
  for (auto& e : owner.layout().entries) CHECK(e.offset % 16 == 0);
  auto w = owner.value("1.weight");
  for (float v : w) CHECK(std::abs(v) <= 0.5f);  // U(-1/sqrt(4), 1/sqrt(4))
  CHECK(owner.value("0.layers.0.weight")[0] != owner.value("0.layers.1.weight")[0]);  // own streams
  Replicated<float, M> again(m, 1), other(m, 2);
  CHECK(std::equal(again.values().begin(), again.values().end(), owner.values().begin()));
  CHECK_FALSE(std::equal(other.values().begin(), other.values().end(), owner.values().begin()));
}

TEST_CASE("initialising any range equals the whole-model initialisation there", "[nn][init]") {
  Linear<double> l(13, 7);
  auto f = flatten<double>(l);
  std::vector<double> whole(f.numel);
  initialize_range<double>(f, 5, 0, whole);
  for (std::size_t begin : {0, 3, 50, 97}) {
    std::vector<double> part(std::min<std::size_t>(29, f.numel - begin));
    initialize_range<double>(f, 5, begin, part);
    CHECK(std::equal(part.begin(), part.end(), whole.begin() + begin));
  }
  std::vector<double> w(whole.begin(), whole.begin() + 91);  // weight values: U(-1/sqrt(13), ...)
  double mean = 0;
  for (double v : w) mean += v / w.size();
  CHECK(std::abs(mean) < 0.1);
  // the largest, NaN if any is (max_element would skip a NaN past the first element)
  CHECK(std::accumulate(w.begin(), w.end(), double(-INFINITY), test_support::max_keeping_nan) <= 1 / std::sqrt(13.0));
}

TEST_CASE("Linear: forward matches the formula and backward matches finite differences", "[nn][linear][gradcheck]") {
  for (bool bias : {true, false}) {
    Linear<double> l(5, 3, bias);
    auto x = gradcheck::random_tensor({2, 4, 5}, 1);
    auto r = gradcheck::check(l, x);
    INFO("worst: " << r.worst);
    CHECK(r.max_rel_error < 1e-6);
    CHECK(r.compared > 20);

    Replicated<double, Linear<double>> owner(l, 3);
    context ctx;
    auto y = l.forward(ctx, x);
    REQUIRE(y.shape() == Shape{2, 4, 3});
    double want = bias ? owner.value("bias")[2] : 0.0;
    for (int k = 0; k < 5; ++k) want += x[5 + k] * owner.value("weight")[2 * 5 + k];
    CHECK(y[3 + 2] == Approx(want).epsilon(1e-12));
  }
}

TEST_CASE("Sequential and Stack compose forward and backward", "[nn][composite][gradcheck]") {
  using M = Sequential<Linear<double>, Stack<Linear<double>>, Linear<double>>;
  M m{Linear<double>(6, 4), Stack<Linear<double>>(3, Linear<double>(4, 4)), Linear<double>(4, 2)};
  auto r = gradcheck::check(m, gradcheck::random_tensor({3, 6}, 2));
  INFO("worst: " << r.worst);
  CHECK(r.max_rel_error < 1e-6);
  CHECK(parameter_count(m) == 6 * 4 + 4 + 3 * 20 + 4 * 2 + 2);
}

TEST_CASE("a layer refuses an input of the wrong shape", "[nn][linear]") {
  Linear<float> l(5, 3);
  Replicated<float, Linear<float>> owner(l, 0);
  context ctx;
  CHECK_THROWS_WITH(l.forward(ctx, Tensor<float>({2, 4})),
                    Catch::Contains("Linear(5 -> 3): input's last dimension must be 5, got shape [2, 4]"));
}

TEST_CASE("the whole encoder classifier matches finite differences", "[nn][gradcheck][classifier]") {
  using Encoder = TransformerEncoderLayer<double>;
  using Classifier = Sequential<Stack<Encoder>, MeanPool<double>, Linear<double>>;
  for (bool norm_first : {false, true}) {
    Classifier m{Stack<Encoder>(2, {.d_model = 8, .nhead = 2, .dim_feedforward = 16, .dropout = 0.0,
                                    .batch_first = true, .norm_first = norm_first}),
                 MeanPool<double>(1), Linear<double>(8, 3)};
    auto r = gradcheck::check(m, gradcheck::random_tensor({3, 4, 8}, 5), 12);
    INFO("norm_first " << norm_first << ", worst: " << r.worst << " " << r.max_rel_error);
    CHECK(r.max_rel_error < 1e-6);
    CHECK(r.compared > 200);
  }
}

}  // namespace test_nn
