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
  example::model_flags m;
  example::train_flags run{.batch = 32};
  example::command_line cli("The FSDP article's model trained on one rank, unsharded.", "train_reference");
  example::add_model_flags(cli, m);
  example::add_train_flags(cli, run, false);
  cli.callback([&] { example::check_model_flags(m); });
  cli.parse_or_exit(argc, argv);
  const long steps = run.steps, batch = run.batch, every = run.every;
  const example::synthetic_task task = example::task_for(m);

  Model model = example::reference_model(m);
  nn::Replicated<float, Model> params(model, run.seed);
  optim::Adam adam{{.lr = run.lr}};
  auto state = adam.make_state(params.values().size());
  nn::context ctx({.seed = run.seed});

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
