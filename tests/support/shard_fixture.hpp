// tests/support/shard_fixture.hpp — a small model, data, loss and optimizer for the
// sharding-engine tests, and the unsharded reference run they are compared with.
#pragma once
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "support/compare.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace fixture {

using namespace shardlib;
using Block = nn::Linear<float>;
using Model = nn::Sequential<nn::Linear<float>, nn::Stack<Block>, nn::Linear<float>>;

// 291 parameters in units of 56, 72, 72, 72 and 35 elements: none divides by 2, 3 or 4.
inline Model make_model() {
  return Model{nn::Linear<float>(5, 8), nn::Stack<Block>(3, Block(8, 8)), nn::Linear<float>(8, 3)};
}

// Plain SGD (the optimizers have their own tests).
struct sgd {
  float lr = 0.05f;
  struct state {};
  state make_state(std::size_t) { return {}; }
  void step(std::span<float> p, std::span<const float> g, state&) {
    for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * g[i];
  }
};

struct mse_result {
  float loss;
  Tensor<float> grad;
};
// Mean squared error over all elements.
inline mse_result mse(const Tensor<float>& y, const Tensor<float>& target) {
  mse_result r{0.f, Tensor<float>(y.shape())};
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    float d = y[i] - target[i];
    r.loss += d * d / float(y.numel());
    r.grad[i] = 2 * d / float(y.numel());
  }
  return r;
}

// Rows [first, first + rows) of step s's data set: any rank can take its slice.
inline Tensor<float> batch(int step, std::int64_t rows, std::int64_t cols, std::uint64_t stream, std::int64_t first = 0) {
  Tensor<float> t({rows, cols});
  counter_rng rng(1000 + step, stream);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = 2 * rng.uniform_float(std::uint64_t(first * cols + i)) - 1;
  return t;
}

// The fixture's model in double, starting from the float model's initial values drawn
// with `seed`: the float64 reference engine tests compare with. mse_gradients(s, rows)
// leaves in owner.grads() the gradient of the mean squared error on the first `rows`
// rows of step s's batch.
struct double_model {
  using type = nn::Sequential<nn::Linear<double>, nn::Stack<nn::Linear<double>>, nn::Linear<double>>;
  type m{nn::Linear<double>(5, 8), nn::Stack<nn::Linear<double>>(3, nn::Linear<double>(8, 8)),
         nn::Linear<double>(8, 3)};
  nn::Replicated<double, type> owner;
  nn::context ctx;

  explicit double_model(std::uint64_t seed) : owner(m, seed) {
    Model mf = make_model();
    nn::Replicated<float, Model> init(mf, seed);
    auto values = owner.values();
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = double(init.values()[i]);
  }
  double_model(const double_model&) = delete;
  double_model& operator=(const double_model&) = delete;

  void mse_gradients(int step, std::int64_t rows) {
    auto xf = batch(step, rows, 5, 1), yf = batch(step, rows, 3, 2);
    Tensor<double> x(xf.shape()), y(yf.shape());
    for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = xf[i];
    for (std::int64_t i = 0; i < y.numel(); ++i) y[i] = yf[i];
    owner.zero_grad();
    auto out = ctx.forward(m, x);
    Tensor<double> dy(out.shape());
    for (std::int64_t i = 0; i < out.numel(); ++i) dy[i] = 2 * (out[i] - y[i]) / double(out.numel());
    ctx.backward(m, dy);
  }
};

struct trace {
  std::vector<float> losses;
  std::vector<float> norms;   // gradient norms before clipping, when clipping
  std::vector<float> params;  // final values, in the model's parameter order
};

// Unsharded training on the global batch (world * per_rank rows per step);
// max_norm > 0 clips the gradients to that global norm before each step. With a
// 16-bit H, forward and backward run on the fp32 master rounded to H — what the
// sharded units gather under mixed_precision{.param = H}.
template <class H = float>
trace unsharded(int world, int per_rank, int steps, float max_norm = 0);

// Relative difference of a loss or a norm; +inf when either is NaN or infinite.
inline double rel(float a, float b) { return test_support::relative_error(a, b, 1e-6); }

// Largest relative difference of losses and parameters (parameters relative to
// max(|want|, 1e-3), so values near zero are compared absolutely); NaN, infinities
// and different lengths count as +inf.
inline test_support::max_error worst_difference(const trace& got, const trace& want) {
  test_support::max_error worst;
  worst.relative(got.losses, want.losses, 1e-6);
  worst.relative(got.norms, want.norms, 1e-6);
  worst.relative(got.params, want.params, 1e-3);
  return worst;
}

// A Linear layer that keeps its parameters, inputs, outputs and gradients in 16
// bits and computes in fp32, as the GPU layers do: the host's stand-in for a
// model that computes in bfloat16, which takes the engine's 16-bit compute path.
template <class H>
struct Linear16 {
  using input = Tensor<H>;
  using output = Tensor<H>;
  nn::Param<H> weight, bias;
  std::int64_t in, out;
  Tensor<H> x_;

  Linear16(std::int64_t i, std::int64_t o) : in(i), out(o) {
    weight.shape = Shape{o, i};
    weight.init = nn::init_rule::linear_default(i);
    bias.shape = Shape{o};
    bias.init = nn::init_rule::linear_default(i);
  }
  template <class V>
  void parameters(V&& v) {
    v("weight", weight);
    v("bias", bias);
  }
  template <class Ctx>
  output forward(Ctx&, const input& x) {
    x_ = x;
    const std::int64_t rows = x.numel() / in;
    output y({rows, out});
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t o = 0; o < out; ++o) {
        float acc = float(bias.value[o]);
        for (std::int64_t k = 0; k < in; ++k) acc += float(x[r * in + k]) * float(weight.value[o * in + k]);
        y[r * out + o] = H(acc);
      }
    return y;
  }
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    const std::int64_t rows = x_.numel() / in;
    input dx({rows, in});
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < in; ++k) {
        float acc = 0;
        for (std::int64_t o = 0; o < out; ++o) acc += float(dy[r * out + o]) * float(weight.value[o * in + k]);
        dx[r * in + k] = H(acc);
      }
    // A frozen parameter's gradient too, where it has storage (the engine zeroes it), as a
    // user layer may; none where its grad is null (options.frozen_grads = false).
    for (std::int64_t o = 0; o < out; ++o) {
      float db = 0;
      for (std::int64_t r = 0; r < rows; ++r) db += float(dy[r * out + o]);
      if (bias.grad) bias.grad[o] = H(float(bias.grad[o]) + db);
      for (std::int64_t k = 0; k < in && weight.grad; ++k) {
        float dw = 0;
        for (std::int64_t r = 0; r < rows; ++r) dw += float(dy[r * out + o]) * float(x_[r * in + k]);
        weight.grad[o * in + k] = H(float(weight.grad[o * in + k]) + dw);
      }
    }
    return dx;
  }
};
// The model of bf16 Linear16 layers, shaped as make_model()'s.
using Linear16b = Linear16<bfloat16>;
using Model16 = nn::Sequential<Linear16b, nn::Stack<Linear16b>, Linear16b>;
inline Model16 make_model16() {
  return Model16{Linear16b(5, 8), nn::Stack<Linear16b>(3, Linear16b(8, 8)), Linear16b(8, 3)};
}

// x rounded to H (float: a copy), and mse on H outputs: computed in float, its gradient rounded.
template <class H, class X>
Tensor<H> as(const Tensor<X>& x) {
  Tensor<H> t(x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) t[i] = H(x[i]);
  return t;
}
template <class H>
struct mse_h_result {
  float loss;
  Tensor<H> grad;
};
template <class H>
mse_h_result<H> mse_h(const Tensor<H>& y, const Tensor<H>& target) {
  auto r = mse(as<float>(y), as<float>(target));
  return {r.loss, as<H>(r.grad)};
}

}  // namespace fixture

#include "shardlib/optim/clip.hpp"

template <class H>
fixture::trace fixture::unsharded(int world, int per_rank, int steps, float max_norm) {
  Model m = make_model();
  nn::Replicated<float, Model> owner(m, 42);
  std::vector<float> master(owner.values().begin(), owner.values().end());
  nn::context ctx;
  sgd opt;
  sgd::state st;
  trace t;
  for (int s = 0; s < steps; ++s) {
    for (std::size_t i = 0; i < master.size(); ++i) owner.values()[i] = float(H(master[i]));
    owner.zero_grad();
    auto x = batch(s, world * per_rank, 5, 1), y = batch(s, world * per_rank, 3, 2);
    auto l = mse(ctx.forward(m, x), y);
    ctx.backward(m, l.grad);
    if (max_norm > 0) {
      std::span<float> g = owner.grads();
      t.norms.push_back(optim::clip_grad_norm(std::span<const std::span<float>>(&g, 1), max_norm));
    }
    opt.step(master, owner.grads(), st);
    t.losses.push_back(l.loss);
  }
  for (auto& e : owner.layout().entries)
    for (std::size_t i = 0; i < e.numel(); ++i) t.params.push_back(master[e.offset + i]);
  return t;
}
