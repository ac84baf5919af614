// custom_layer — a user-written layer (GatedMLP, gated_mlp.hpp) composed with the
// library's layers in nn::Sequential and trained with Adam: nothing in the
// library knows the layer, it only models nn::Layer.
//
// Task: 8 features uniform in [-1, 1]; the class is the ring that (x0, x1) falls
// in (radius < 0.5, < 0.9, or beyond), the other six features are noise. Not
// linearly separable, so the loss falls only if the gated MLP learns.
#include "gated_mlp.hpp"

#include <shardlib/core/random.hpp>
#include <shardlib/core/tensor.hpp>
#include <shardlib/nn/context.hpp>
#include <shardlib/nn/layer_norm.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/replicated.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/optim/adam.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <utility>

using namespace shardlib;
using example::GatedMLP;

// Names the first Layer requirement the type misses, if any.
static_assert(nn::check_layer<GatedMLP<float>>());

namespace {

constexpr std::int64_t features = 8, width = 32, hidden = 64, classes = 3, batch = 128;

// A deterministic batch: `stream` selects it (training steps and the held-out set
// use different streams).
std::pair<Tensor<float>, Tensor<std::int64_t>> make_batch(std::uint64_t stream, std::int64_t n) {
  const counter_rng rng(2024, stream);
  Tensor<float> x(Shape{n, features});
  Tensor<std::int64_t> y(Shape{n});
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t f = 0; f < features; ++f)
      x[i * features + f] = float(2 * rng.uniform_double(std::uint64_t(i * features + f)) - 1);
    const double r = std::hypot(x[i * features], x[i * features + 1]);
    y[i] = r < 0.5 ? 0 : r < 0.9 ? 1 : 2;
  }
  return {x, y};
}

}  // namespace

int main() {
  using Model = nn::Sequential<nn::Linear<float>, nn::LayerNorm<float>, GatedMLP<float>, nn::Linear<float>>;
  Model model{nn::Linear<float>(features, width), nn::LayerNorm<float>(width), GatedMLP<float>(width, hidden),
              nn::Linear<float>(width, classes)};
  nn::Replicated<float, Model> owner(model, /*seed=*/1);  // binds and initialises every Param, ours included
  std::printf("parameters:");
  for (const auto& e : owner.layout().entries) std::printf(" %s", e.name.c_str());  // 2.gate_proj.weight, ...
  std::printf("\n");

  optim::Adam adam{{.lr = 2e-3}};
  auto state = adam.make_state(owner.values().size());
  nn::context ctx;
  // Each step draws a fresh batch, so single losses are noisy: report 20-step means.
  constexpr int steps = 200, window = 20;
  double sum = 0, first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = make_batch(std::uint64_t(step), batch);
    owner.zero_grad();
    auto [loss, dlogits] = nn::cross_entropy(ctx.forward(model, x), y);
    ctx.backward(model, dlogits);
    adam.step(owner.values(), owner.grads(), state);
    sum += loss;
    if ((step + 1) % window == 0) {
      last = sum / window;
      if (step + 1 == window) first = last;
      std::printf("steps %3d-%3d  mean loss %.4f\n", step + 1 - window, step, last);
      sum = 0;
    }
  }

  ctx.set_training(false);
  auto [x, y] = make_batch(1'000'000, 1024);  // held out: a stream no training step used
  const Tensor<float> logits = ctx.forward(model, x);
  std::int64_t correct = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    std::int64_t best = 0;
    for (std::int64_t c = 1; c < classes; ++c)
      if (logits[i * classes + c] > logits[i * classes + best]) best = c;
    correct += best == y[i];
  }
  std::printf("held-out accuracy %.1f%% (%lld of %lld)\n", 100.0 * double(correct) / double(y.numel()),
              static_cast<long long>(correct), static_cast<long long>(y.numel()));
  return last < first / 2 ? 0 : 1;  // a smoke test: training must at least halve the mean loss
}
