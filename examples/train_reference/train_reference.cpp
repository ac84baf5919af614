// train_reference — the FSDP article's model trained on one rank, unsharded:
// a 6-layer transformer encoder (d_model 512, 8 heads, feed-forward 2048),
// mean-pooled, a linear head to 10 classes, Adam lr 1e-3, cross-entropy, on a
// synthetic task the model can learn (the loss falls clearly below ln 10).
#include <shardlib/nn/linear.hpp>
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/pooling.hpp>
#include <shardlib/nn/replicated.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/nn/transformer.hpp>
#include <shardlib/optim/adam.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "common/flags.hpp"
#include "common/reference_model.hpp"
#include "common/synthetic.hpp"

using namespace shardlib;
using example::Encoder;
using example::Model;

int main(int argc, char** argv) {
  example::flags f(argc, argv,
                   {{"steps", "100"}, {"batch", "32"}, {"seq", "10"}, {"d-model", "512"}, {"heads", "8"},
                    {"ff", "2048"}, {"layers", "6"}, {"classes", "10"}, {"lr", "1e-3"}, {"dropout", "0.1"},
                    {"seed", "0"}, {"every", "10"}});
  const long steps = f.num("steps"), batch = f.num("batch"), every = f.num("every");
  example::synthetic_task task{.seq = f.num("seq"), .d = f.num("d-model"), .classes = f.num("classes")};

  Model model = example::reference_model(f, task);
  nn::Replicated<float, Model> params(model, std::uint64_t(f.num("seed")));
  optim::Adam adam{{.lr = f.real("lr")}};
  auto state = adam.make_state(params.values().size());
  nn::context ctx({.seed = std::uint64_t(f.num("seed"))});

  std::printf("train_reference: %zu parameters, batch %ld x seq %ld, %ld steps (chance loss ln %ld = %.3f)\n",
              nn::parameter_count(model), batch, task.seq, steps, task.classes, std::log(double(task.classes)));
  double seconds = 0;
  float loss = 0;
  for (long step = 0; step < steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    params.zero_grad();
    ctx.set_step(std::uint64_t(step));
    auto x = task.inputs(step * batch, batch);
    auto y = task.labels(step * batch, batch);
    auto logits = ctx.forward(model, x);
    auto l = nn::cross_entropy(logits, y);
    ctx.backward(model, l.grad);
    adam.step(params.values(), std::span<const float>(params.grads()), state);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    loss = l.loss;
    if (step % every == 0 || step == steps - 1) std::printf("Step %ld, Loss: %f\n", step, double(loss));
  }
  std::printf("train_reference: %.3f s per step (data generation included), final loss %f\n", seconds / double(steps),
              double(loss));
  return 0;
}
