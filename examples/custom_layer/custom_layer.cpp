// custom_layer — a user-written layer (GatedMLP, gated_mlp.hpp) composed with the
// library's layers in nn::Sequential and trained with Adam on 4 thread ranks, the
// user's layer a FullShard unit: nothing in the library knows the layer, it only
// models nn::Layer.
//
// Task: 8 features uniform in [-1, 1]; the class is the ring that (x0, x1) falls
// in (radius < 0.5, < 0.9, or beyond), the other six features are noise. Not
// linearly separable, so the loss falls only if the gated MLP learns.
#include "gated_mlp.hpp"

#include <shardlib/core/random.hpp>
#include <shardlib/core/tensor.hpp>
#include <shardlib/comm/launch.hpp>
#include <shardlib/nn/layer_norm.hpp>
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/optim/adam.hpp>
#include <shardlib/shard/sharded_model.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <utility>
#include <vector>

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
  constexpr int world = 4;
  std::vector<double> means;  // rank 0's 20-step mean losses (of the global batch)
  double accuracy = 0;
  comm::launch(world, [&](comm::ThreadComm& c) {
    Model model{nn::Linear<float>(features, width), nn::LayerNorm<float>(width), GatedMLP<float>(width, hidden),
                nn::Linear<float>(width, classes)};
    // The user's layer is a sharded unit like any library layer: FullShard gathers
    // its three weights before it runs and reduce-scatters their gradients after.
    auto sharded = shard::fully_shard(model, c, shard::FullShard{}, {.wrap = shard::wrap_types<GatedMLP<float>>{}, .seed = 1});
    if (c.rank() == 0) {
      std::printf("units:");
      for (std::size_t i = 0; i < sharded.unit_count(); ++i)
        std::printf(" '%s' (%zu parameters)", sharded.unit_name(i).c_str(), sharded.unit_layout(i).entries.size());
      std::printf("\n");
    }
    optim::Adam adam{{.lr = 2e-3}};
    // Each step draws a fresh global batch; every rank trains on its quarter.
    constexpr int steps = 200, window = 20;
    constexpr std::int64_t local = batch / world;
    double sum = 0;
    for (int step = 0; step < steps; ++step) {
      auto [x, y] = make_batch(std::uint64_t(step), batch);
      Tensor<float> xr(Shape{local, features});
      Tensor<std::int64_t> yr(Shape{local});
      std::copy_n(x.data() + c.rank() * local * features, local * features, xr.data());
      std::copy_n(y.data() + c.rank() * local, local, yr.data());
      float loss = sharded.train_step(adam, xr, yr, nn::cross_entropy);
      c.all_reduce(std::span<float>(&loss, 1), comm::reduce_op::avg);  // the global batch's loss
      sum += loss;
      if ((step + 1) % window == 0) {
        if (c.rank() == 0) {
          std::printf("steps %3d-%3d  mean loss %.4f\n", step + 1 - window, step, sum / window);
          means.push_back(sum / window);
        }
        sum = 0;
      }
    }
    sharded.context().set_training(false);
    auto [x, y] = make_batch(1'000'000, 1024);  // held out: a stream no training step used
    const Tensor<float> logits = sharded.forward(x);
    std::int64_t correct = 0;
    for (std::int64_t i = 0; i < y.numel(); ++i) {
      std::int64_t best = 0;
      for (std::int64_t k = 1; k < classes; ++k)
        if (logits[i * classes + k] > logits[i * classes + best]) best = k;
      correct += best == y[i];
    }
    if (c.rank() == 0) accuracy = double(correct) / double(y.numel());
  });
  std::printf("held-out accuracy %.1f%%\n", 100.0 * accuracy);
  return means.back() < means.front() / 2 ? 0 : 1;  // a smoke test: training must at least halve the mean loss
}
