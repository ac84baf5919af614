// Device tests of the layers: each nn::Layer<T, cuda_space> against the host
// layer with the same parameter values on fresh random inputs, forward and
// backward (dx and the accumulated parameter gradients), then the reference
// model with cross-entropy; the decoder's layers (RMSNorm, SiLU, the LLaMA and
// GPT-2 feed-forward blocks, token and position embeddings) and rotary
// embeddings the same way. The layers run on a stream of their own (the
// thread's current stream), and the blocks their outputs come from are
// poisoned with NaN first, so an element a kernel fails to write shows.
//
// Tolerances: fp32 within 1e-5 relative (both sides compute in fp32; only the
// order of sums and nvcc's fused multiply-adds differ), bf16 within 1e-2
// (the device rounds every activation to bf16, up to 2^-8 relative each, while
// the host reference computes in float on the same bf16-rounded inputs and
// parameters). Absolute slack is scaled by the largest value compared,
// because sums cancel. bf16 layers made of many rounded steps (attention, the
// encoder layer, the feed-forward blocks, the model) are held to 3e-2 on the
// norm of the error vector:
// scores rounded to bf16 before the softmax already put ~1% into the weights
// (an emulation of the forward's roundings on the host gave 0.6% on average,
// 0.9% at worst over 200 seeds), and backward goes through the softmax again.
// Parameters are drawn with standard deviation 0.2, about Xavier's for these
// widths, so scores stay in the range a trained model's do. With ReLU, the
// encoder layers' linear1.bias is +6 or -6 (alternately), far from the spread of
// the products (std ~1.1): a pre-activation within bf16's rounding of zero would
// fall on the other side of ReLU's mask than on the host and move that element's
// gradient by all of it (with random biases the device code, run on the CPU
// emulator in tests/emulated, was off by up to 16% over 150 seeds). Each unit is
// then on or off for every token; the activation tests above mask element by
// element.
//
// The same file runs on the CPU as tests/emulated/test_emulated_layers.cpp.
#include <shardlib/comm/launch.hpp>
#include <shardlib/cuda/current.hpp>
#include <shardlib/nn/context.hpp>
#include <shardlib/nn/cuda.cuh>
#include <shardlib/nn/cuda/embedding.cuh>     // Embedding, PositionEmbedding
#include <shardlib/nn/cuda/feed_forward.cuh>  // LlamaMLP, GPT2MLP
#include <shardlib/nn/cuda/rms_norm.cuh>      // RMSNorm
#include <shardlib/nn/layer.hpp>
#include <shardlib/nn/lora.hpp>  // add_lora
#include <shardlib/nn/loss.hpp>
#include <shardlib/nn/sequential.hpp>
#include <shardlib/nn/stack.hpp>
#include <shardlib/ops/cuda/index_report.hpp>  // deferred_index_reports
#include <shardlib/ops/cuda/rotary.cuh>
#include <shardlib/ops/cuda/swiglu.cuh>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "device_test.hpp"
#include "support/compare.hpp"

namespace test_cuda_layers {

namespace sl = shardlib;
namespace nn = shardlib::nn;
using namespace device_test;
using sl::cuda_space;
using sl::Shape;
using sl::Tensor;

template <class T>
using Encoder = nn::TransformerEncoderLayer<T, cuda_space>;
template <class T>
using Model = nn::Sequential<nn::Stack<Encoder<T>>, nn::MeanPool<T, cuda_space>, nn::Linear<T, cuda_space>>;
using HostModel = nn::Sequential<nn::Stack<nn::TransformerEncoderLayer<float>>, nn::MeanPool<float>, nn::Linear<float>>;

static_assert(nn::check_layer<nn::Linear<float, cuda_space>>() && nn::check_layer<nn::LayerNorm<float, cuda_space>>() &&
              nn::check_layer<nn::MultiheadAttention<float, cuda_space>>() &&
              nn::check_layer<nn::Dropout<float, cuda_space>>() && nn::check_layer<nn::ReLU<float, cuda_space>>() &&
              nn::check_layer<nn::GELU<float, cuda_space>>() && nn::check_layer<nn::MeanPool<float, cuda_space>>() &&
              nn::check_layer<Encoder<float>>() && nn::check_layer<Model<float>>() &&
              nn::check_layer<Model<sl::bfloat16>>() && nn::Composite<Encoder<sl::bfloat16>>);
static_assert(nn::check_layer<nn::RMSNorm<float, cuda_space>>() && nn::check_layer<nn::SiLU<float, cuda_space>>() &&
              nn::check_layer<nn::LlamaMLP<float, cuda_space>>() &&
              nn::check_layer<nn::GPT2MLP<sl::bfloat16, cuda_space>>() &&
              nn::check_layer<nn::Embedding<float, cuda_space>>() &&
              nn::check_layer<nn::PositionEmbedding<sl::bfloat16, cuda_space>>() &&
              nn::Composite<nn::LlamaMLP<sl::bfloat16, cuda_space>> && nn::Composite<nn::GPT2MLP<float, cuda_space>>);

namespace {

using device_test::values;  // beside the device overload below

// Device tensors (on the current stream) to and from host values.

template <class T>
Tensor<T, cuda_space> device_tensor(Shape s, const std::vector<float>& v) {
  const std::vector<T> cast = as<T>(v);
  Tensor<T, cuda_space> t(s);
  sl::cuda::copy_async(t.span(), std::span<const T>(cast), sl::cuda::current_stream());
  return t;
}
// Ids (or targets) all equal to `value`.
Tensor<std::int64_t, cuda_space> device_ids(Shape s, std::int64_t value) {
  const std::vector<std::int64_t> v(std::size_t(s.numel()), value);
  Tensor<std::int64_t, cuda_space> t(s);
  sl::cuda::copy_async(t.span(), std::span<const std::int64_t>(v), sl::cuda::current_stream());
  return t;
}
// The same ids in device memory.
Tensor<std::int64_t, cuda_space> device_ids(const Tensor<std::int64_t>& ids) {
  Tensor<std::int64_t, cuda_space> t(ids.shape());
  sl::cuda::copy_async(t.span(), std::span<const std::int64_t>(ids.span()), sl::cuda::current_stream());
  return t;
}
template <class T>
std::vector<T> raw_values(const Tensor<T, cuda_space>& t) {
  std::vector<T> v(std::size_t(t.numel()));
  sl::cuda::copy_async(std::span<T>(v), std::span<const T>(t.span()), sl::cuda::current_stream());
  sl::cuda::check(cudaStreamSynchronize(sl::cuda::current_stream()), "cudaStreamSynchronize");
  return v;
}
template <class T>
std::vector<float> values(const Tensor<T, cuda_space>& t) {
  return widened(raw_values(t));
}

// The caching allocator hands a freed block back at once to the next request
// of its size on the same stream: poisoning such blocks makes the layer's
// next outputs of these shapes start as NaN.
template <class T>
void poison_next(std::initializer_list<Shape> shapes) {
  std::vector<Tensor<T, cuda_space>> blocks;
  for (const Shape& s : shapes) {
    blocks.emplace_back(s);
    sl::cuda::fill_bytes_async(blocks.back().span(), 0xFF, sl::cuda::current_stream());
  }
}

template <class T>
void require_near(const std::vector<float>& got, const std::vector<float>& want) {
  require_close(got, want, rtol<T>, rtol<T> * max_abs(want));
}
// ||got - want|| <= 3e-2 ||want|| (see the top of the file): for bf16 layers
// whose roundings add up over many steps, the error of the vector rather than
// of each element.
inline void require_norm_near(const std::vector<float>& got, const std::vector<float>& want) {
  constexpr double composite_rtol = 3e-2;
  const double error = test_support::relative_norm_error(got, want);  // +inf for NaN
  INFO("relative error " << error << " (bound " << composite_rtol << ")");
  REQUIRE(error <= composite_rtol);
}
// Layers made of many rounded steps (attention, the encoder layer, the model):
// bf16 is held to its bound on the whole vector, fp32 still element by element.
template <class T>
void require_composite_near(const std::vector<float>& got, const std::vector<float>& want) {
  if constexpr (std::is_same_v<T, float>) require_near<T>(got, want);
  else require_norm_near(got, want);
}

// The same parameter values (rounded to T) and starting gradients for a host
// layer and a device layer, bound to host vectors and device tensors; the
// starting gradients are random so that accumulation (+=) is checked. `chosen`
// may replace a parameter's random values (by name) before both get them.
template <class T>
struct bound_parameters {
  std::vector<std::string> names;
  std::vector<std::vector<float>> host_values, host_grads, start_grads;
  std::vector<Tensor<T, cuda_space>> device_values, device_grads;

  using choice = std::function<void(const std::string& name, std::vector<float>& values)>;

  template <class HostLayer, class DeviceLayer>
  bound_parameters(HostLayer& host, DeviceLayer& dev, random_inputs& rnd, const choice& chosen = {}) {
    std::vector<nn::Param<float>*> hp;
    std::vector<nn::Param<T>*> dp;
    std::vector<std::string> dev_names;
    host.parameters([&](const auto& name, nn::Param<float>& p) {
      names.emplace_back(name);
      hp.push_back(&p);
    });
    dev.parameters([&](const auto& name, nn::Param<T>& p) {
      dev_names.emplace_back(name);
      dp.push_back(&p);
    });
    // Thrown, not asserted: a rank thread binds parameters too, and Catch is not thread-safe.
    if (names != dev_names) throw std::logic_error("the host and device layers name their parameters differently");
    for (std::size_t i = 0; i < hp.size(); ++i) {
      if (hp[i]->shape != dp[i]->shape) throw std::logic_error("parameter " + names[i] + ": the shapes differ");
      const std::size_t n = hp[i]->numel();
      host_values.push_back(rounded<T>(rnd.normal(n, 0.2f)));
      if (chosen) chosen(names[i], host_values.back());
      host_grads.push_back(rounded<T>(rnd.normal(n)));
      start_grads.push_back(host_grads.back());
      device_values.push_back(device_tensor<T>(hp[i]->shape, host_values.back()));
      device_grads.push_back(device_tensor<T>(hp[i]->shape, host_grads.back()));
    }
    for (std::size_t i = 0; i < hp.size(); ++i) {
      hp[i]->value = host_values[i].data();
      hp[i]->grad = host_grads[i].data();
      dp[i]->value = device_values[i].data();
      dp[i]->grad = device_grads[i].data();
    }
  }

  // The gradients of the frozen parameters (by name) are the starting ones, on both sides.
  void require_untouched(const std::set<std::string>& frozen) const {
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (!frozen.contains(names[i])) continue;
      INFO("frozen " << names[i]);
      REQUIRE(host_grads[i] == start_grads[i]);  // == fails on NaN
      REQUIRE(values(device_grads[i]) == start_grads[i]);
    }
  }

  template <auto Compare>
  void compare_grads() const {
    for (std::size_t i = 0; i < names.size(); ++i) {
      INFO("gradient of " << names[i]);
      Compare(values(device_grads[i]), host_grads[i]);
    }
  }
};

// The thread's current stream for a test: a stream of its own, not the default one.
struct on_stream {
  sl::cuda::stream stream{0};
  sl::cuda::stream_scope scope{stream};
};

// Forward and backward of a host layer and its device twin on the same input
// x (shape in_shape) and output gradient; outputs, dx and parameter gradients compared.
// The parameters named in `frozen` are frozen on both sides: their gradients stay as they were.
template <class T, auto Compare = require_near<T>, class HostLayer, class DeviceLayer>
void compare_layers(HostLayer& host, DeviceLayer& dev, Shape in_shape, random_inputs& rnd, nn::context host_ctx,
                    nn::context dev_ctx, float x_scale = 1.0f,
                    const typename bound_parameters<T>::choice& chosen = {}, const std::set<std::string>& frozen = {}) {
  const auto set_flags = [&](std::string_view name, auto& p) { p.requires_grad = !frozen.contains(std::string(name)); };
  host.parameters(set_flags);
  dev.parameters(set_flags);
  bound_parameters<T> params(host, dev, rnd, chosen);
  const auto x = rounded<T>(rnd.normal(std::size_t(in_shape.numel()), x_scale));
  const Tensor<float> y_host = host.forward(host_ctx, host_tensor(in_shape, x));
  const auto dy = rounded<T>(rnd.normal(std::size_t(y_host.numel())));
  const Tensor<float> dx_host = host.backward(host_ctx, host_tensor(y_host.shape(), dy));

  const auto x_dev = device_tensor<T>(in_shape, x);
  poison_next<T>({y_host.shape()});
  const auto y_dev = dev.forward(dev_ctx, x_dev);
  REQUIRE(y_dev.shape() == y_host.shape());
  const auto dy_dev = device_tensor<T>(y_host.shape(), dy);
  poison_next<T>({in_shape});
  const auto dx_dev = dev.backward(dev_ctx, dy_dev);
  REQUIRE(dx_dev.shape() == in_shape);
  {
    INFO("output");
    Compare(values(y_dev), values(y_host));
  }
  {
    INFO("input gradient");
    Compare(values(dx_dev), values(dx_host));
  }
  params.template compare_grads<Compare>();
  params.require_untouched(frozen);
}

// The encoder's ReLU kept off its step (see the top of the file): every linear1.bias
// +6 and -6 alternately; `count` counts the biases set.
auto firm_relu_biases(int& count) {
  return [&count](const std::string& name, std::vector<float>& v) {
    if (!name.ends_with("linear1.bias")) return;
    for (std::size_t j = 0; j < v.size(); ++j) v[j] = j % 2 ? -6.0f : 6.0f;
    ++count;
  };
}

nn::context::options training_options(std::uint64_t seed) { return {.training = true, .seed = seed, .rank = 0, .step = 3}; }
nn::context training(std::uint64_t seed) { return nn::context(training_options(seed)); }

Tensor<std::uint8_t> padding_mask(std::int64_t n, std::int64_t l, random_inputs& rnd) {
  Tensor<std::uint8_t> m(Shape{n, l});
  for (std::int64_t b = 0; b < n; ++b) {
    const std::int64_t kept = rnd.integer(1, l);  // every sample keeps at least one position
    for (std::int64_t i = 0; i < l; ++i) m[b * l + i] = i >= kept;
  }
  return m;
}

}  // namespace

TEMPLATE_TEST_CASE("device Linear equals the host layer, gradients accumulating", "[cuda][layers]", float,
                   sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (bool bias : {true, false}) {
    INFO("bias " << bias);
    nn::Linear<float> host(24, 40, bias);
    nn::Linear<T, cuda_space> dev(24, 40, bias);
    compare_layers<T>(host, dev, Shape{3, 7, 24}, rnd, training(1), training(1));
  }
  nn::Linear<T, cuda_space> dev(24, 40);
  nn::context ctx;
  CHECK_THROWS_AS(dev.forward(ctx, Tensor<T, cuda_space>(Shape{3, 23})), sl::shape_error);
}

// A LoRA Linear, its base frozen (add_lora's default) and trained, with and without the
// adapter's dropout: the frozen base gradients stay as they were on both sides. In GPT2MLP an adapted c_fc gives up the
// fused GELU epilogue (the update comes before the activation), and still equals the host.
TEMPLATE_TEST_CASE("device LoRA Linear equals the host layer, its base frozen or trained", "[cuda][layers][lora]",
                   float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const nn::lora_options lora{.r = 8, .alpha = 16};
  for (const auto& frozen : {std::set<std::string>{"base_layer.weight", "base_layer.bias"}, std::set<std::string>{}})
    for (double dropout : {0.0, 0.3}) {  // the same counter-based masks on both sides
      INFO(frozen.size() << " frozen, dropout " << dropout);
      nn::Linear<float> host(24, 40);
      nn::Linear<T, cuda_space> dev(24, 40);
      host.add_lora({.r = lora.r, .alpha = lora.alpha, .dropout = dropout});
      dev.add_lora({.r = lora.r, .alpha = lora.alpha, .dropout = dropout});
      compare_layers<T>(host, dev, Shape{3, 7, 24}, rnd, training(1), training(1), 1.0f, {}, frozen);
    }
  {
    INFO("GPT2MLP, c_fc adapted, n_inner 48, tanh GELU");
    const nn::gpt2_mlp_options o{.n_embd = 24, .n_inner = 48, .activation = nn::gelu_approx::tanh};
    nn::GPT2MLP<float> host(o);
    nn::GPT2MLP<T, cuda_space> dev(o);
    CHECK(nn::add_lora(host, {"c_fc"}, lora) == std::vector<std::string>{"c_fc"});
    CHECK(nn::add_lora(dev, {"c_fc"}, lora) == std::vector<std::string>{"c_fc"});
    compare_layers<T, require_composite_near<T>>(host, dev, Shape{3, 7, 24}, rnd, training(1), training(1), 1.0f,
                                                 {}, {"c_fc.base_layer.weight", "c_fc.base_layer.bias",
                                                      "c_proj.weight", "c_proj.bias"});
    CHECK(dev.c_fc.activation() == nn::fused_activation::none);
  }
  // merge_lora: W += s B A and B = 0, as the host's
  nn::Linear<float> host(24, 40);
  nn::Linear<T, cuda_space> dev(24, 40);
  host.add_lora(lora);
  dev.add_lora(lora);
  bound_parameters<T> params(host, dev, rnd);
  host.merge_lora();
  dev.merge_lora();
  for (std::size_t i = 0; i < params.names.size(); ++i) {
    INFO("merged " << params.names[i]);
    require_near<T>(values(params.device_values[i]), params.host_values[i]);
  }
  for (float b : values(params.device_values[3])) REQUIRE(b == 0.0f);  // lora_B
}

TEMPLATE_TEST_CASE("device LayerNorm equals the host layer", "[cuda][layers]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (bool affine : {true, false}) {
    INFO("affine " << affine);
    nn::LayerNorm<float> host(96, 1e-5, affine);
    nn::LayerNorm<T, cuda_space> dev(96, 1e-5, affine);
    compare_layers<T>(host, dev, Shape{70, 96}, rnd, training(1), training(1), 2.0f);  // 70 rows: two gradient chunks
  }
}

TEMPLATE_TEST_CASE("device ReLU, GELU and SiLU equal the host layers", "[cuda][layers]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  {
    nn::ReLU<float> host;
    nn::ReLU<T, cuda_space> dev;
    compare_layers<T>(host, dev, Shape{5, 33}, rnd, training(1), training(1));
  }
  for (auto approx : {nn::gelu_approx::none, nn::gelu_approx::tanh}) {
    nn::GELU<float> host(approx);
    nn::GELU<T, cuda_space> dev(approx);
    compare_layers<T>(host, dev, Shape{5, 33}, rnd, training(1), training(1));
  }
  {
    nn::SiLU<float> host;
    nn::SiLU<T, cuda_space> dev;
    compare_layers<T>(host, dev, Shape{5, 33}, rnd, training(1), training(1), 4.0f);  // both tails of the sigmoid
  }
}

TEST_CASE("device Dropout draws the host's mask bit for bit", "[cuda][layers]") {
  if (!have_device()) return;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (double p : {0.0, 0.1, 0.5, 1.0}) {
    INFO("p " << p);
    nn::Dropout<float> host(p);
    nn::Dropout<float, cuda_space> dev(p);
    nn::context hctx = training(rnd.seed), dctx = training(rnd.seed);
    const auto x = rnd.normal(1000), dy = rnd.normal(1000);
    const auto y_host = values(host.forward(hctx, host_tensor({10, 100}, x)));
    const auto dx_host = values(host.backward(hctx, host_tensor({10, 100}, dy)));
    poison_next<float>({Shape{10, 100}});
    const auto y_dev = values(dev.forward(dctx, device_tensor<float>({10, 100}, x)));
    poison_next<float>({Shape{10, 100}});
    const auto dx_dev = values(dev.backward(dctx, device_tensor<float>({10, 100}, dy)));
    REQUIRE(y_dev == y_host);  // same mask, same float product
    REQUIRE(dx_dev == dx_host);
  }
  SECTION("bf16 keeps the same elements") {
    nn::Dropout<float> host(0.3);
    nn::Dropout<sl::bfloat16, cuda_space> dev(0.3);
    nn::context hctx = training(5), dctx = training(5);
    const auto x = rounded<sl::bfloat16>(rnd.normal(777));
    const auto y_host = values(host.forward(hctx, host_tensor({777}, x)));
    const auto y_dev = values(dev.forward(dctx, device_tensor<sl::bfloat16>({777}, x)));
    for (std::size_t i = 0; i < x.size(); ++i) REQUIRE((y_dev[i] == 0) == (y_host[i] == 0));
    require_near<sl::bfloat16>(y_dev, y_host);
  }
  SECTION("evaluation is the identity") {
    nn::Dropout<float, cuda_space> dev(0.5);
    nn::context ctx({.training = false});
    const auto x = device_tensor<float>({4}, {1, 2, 3, 4});
    REQUIRE(dev.forward(ctx, x).data() == x.data());
  }
}

TEMPLATE_TEST_CASE("device MeanPool equals the host layer, with and without padding", "[cuda][layers]", float,
                   sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (int dim : {0, 1}) {
    for (bool masked : {false, true}) {
      INFO("dim " << dim << ", masked " << masked);
      const std::int64_t n = 4, l = 6, e = 10;
      nn::context hctx, dctx;
      if (masked) {
        const auto m = padding_mask(n, l, rnd);
        hctx.set_key_padding_mask(m);
        dctx.set_key_padding_mask(m);
      }
      nn::MeanPool<float> host(dim);
      nn::MeanPool<T, cuda_space> dev(dim);
      compare_layers<T>(host, dev, dim == 1 ? Shape{n, l, e} : Shape{l, n, e}, rnd, hctx, dctx);
    }
  }
  nn::MeanPool<T, cuda_space> dev(1);
  nn::context ctx;
  Tensor<std::uint8_t> all_padding(Shape{2, 3});
  std::fill_n(all_padding.data(), 6, std::uint8_t(1));
  ctx.set_key_padding_mask(all_padding);
  CHECK_THROWS_WITH(dev.forward(ctx, Tensor<T, cuda_space>(Shape{2, 3, 4})),
                    "MeanPool(1): sequence 0 of the batch is all padding; its mean is undefined");
}

TEMPLATE_TEST_CASE("device MultiheadAttention equals the host layer: layouts, padding, dropout", "[cuda][layers]",
                   float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t n = 3, l = 7, e = 32;
  for (bool batch_first : {true, false})
    for (bool masked : {false, true})
      for (double dropout : {0.0, 0.25}) {
        INFO("batch_first " << batch_first << ", masked " << masked << ", dropout " << dropout);
        const nn::attention_options o{.embed_dim = e, .num_heads = 4, .dropout = dropout, .batch_first = batch_first};
        nn::MultiheadAttention<float> host(o);
        nn::MultiheadAttention<T, cuda_space> dev(o);
        nn::context hctx = training(rnd.seed), dctx = training(rnd.seed);
        if (masked) {
          const auto m = padding_mask(n, l, rnd);
          hctx.set_key_padding_mask(m);
          dctx.set_key_padding_mask(m);
        }
        compare_layers<T, require_composite_near<T>>(host, dev, batch_first ? Shape{n, l, e} : Shape{l, n, e}, rnd,
                                                     hctx, dctx);
      }
  nn::MultiheadAttention<T, cuda_space> dev({.embed_dim = e, .num_heads = 4});
  nn::context ctx;
  ctx.set_key_padding_mask(Tensor<std::uint8_t>(Shape{n, l + 1}));
  CHECK_THROWS_AS(dev.forward(ctx, Tensor<T, cuda_space>(Shape{l, n, e})), sl::shape_error);
  ctx.set_key_padding_mask({});
  ctx.set_attention_mask(Tensor<std::uint8_t>::zeros(Shape{l, l}));  // the host applies it; the device refuses
  CHECK_THROWS_WITH(dev.forward(ctx, Tensor<T, cuda_space>(Shape{l, n, e})),
                    Catch::Contains("MultiheadAttention(embed_dim 32, num_heads 4): on the device only a key padding "
                                    "mask is supported, not an attention mask (got one of shape [7, 7])"));
}

TEMPLATE_TEST_CASE("device TransformerEncoderLayer equals the host layer", "[cuda][layers]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (bool norm_first : {false, true})
    for (auto act : {nn::transformer_activation::relu, nn::transformer_activation::gelu}) {
      INFO("norm_first " << norm_first << ", gelu " << (act == nn::transformer_activation::gelu));
      const nn::transformer_encoder_options o{.d_model = 32,
                                              .nhead = 4,
                                              .dim_feedforward = 64,
                                              .dropout = 0.1,
                                              .activation = act,
                                              .batch_first = true,
                                              .norm_first = norm_first};
      nn::TransformerEncoderLayer<float> host(o);
      Encoder<T> dev(o);
      const bool relu = act == nn::transformer_activation::relu;
      int firmed = 0;
      using choice = typename bound_parameters<T>::choice;
      compare_layers<T, require_composite_near<T>>(host, dev, Shape{3, 5, 32}, rnd, training(rnd.seed),
                                                   training(rnd.seed), 1.0f,
                                                   relu ? choice(firm_relu_biases(firmed)) : choice());
      REQUIRE(firmed == int(relu));
    }
}

TEMPLATE_TEST_CASE("the reference model on the device: forward, cross-entropy and backward equal the host's",
                   "[cuda][layers][model]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t n = 4, l = 6, d = 32, classes = 7;
  const nn::transformer_encoder_options o{.d_model = d, .nhead = 4, .dim_feedforward = 64, .dropout = 0.1,
                                          .batch_first = true};
  HostModel host{nn::Stack<nn::TransformerEncoderLayer<float>>(2, o), nn::MeanPool<float>(1),
                 nn::Linear<float>(d, classes)};
  Model<T> dev{nn::Stack<Encoder<T>>(2, o), nn::MeanPool<T, cuda_space>(1), nn::Linear<T, cuda_space>(d, classes)};
  int firmed = 0;  // the layers' ReLU (the default activation)
  bound_parameters<T> params(host, dev, rnd, firm_relu_biases(firmed));
  REQUIRE(firmed == 2);

  nn::context hctx = training(rnd.seed), dctx = training(rnd.seed);
  const auto mask = padding_mask(n, l, rnd);
  hctx.set_key_padding_mask(mask);
  dctx.set_key_padding_mask(mask);
  const auto x = rounded<T>(rnd.normal(std::size_t(n * l * d)));
  Tensor<std::int64_t> y(Shape{n});
  for (std::int64_t i = 0; i < n; ++i) y[i] = rnd.integer(0, classes - 1);
  Tensor<std::int64_t, cuda_space> y_dev(Shape{n});
  sl::cuda::copy_async(y_dev.span(), std::span<const std::int64_t>(y.span()), sl::cuda::current_stream());

  const Tensor<float> logits_host = hctx.forward(host, host_tensor({n, l, d}, x));
  const auto loss_host = nn::cross_entropy(logits_host, y);
  const Tensor<float> dx_host = hctx.backward(host, loss_host.grad);

  const auto logits_dev = dctx.forward(dev, device_tensor<T>({n, l, d}, x));
  const nn::loss_result<T, cuda_space> loss_dev = nn::cross_entropy(logits_dev, y_dev);
  const auto dx_dev = dctx.backward(dev, loss_dev.grad);
  {
    INFO("logits with gradients disabled (still training: the same dropout masks)");
    no_grad_context no_grad(training_options(rnd.seed));
    no_grad.set_key_padding_mask(mask);
    CHECK(values(dev.forward(no_grad, device_tensor<T>({n, l, d}, x))) == values(logits_dev));  // the same bits
  }

  CHECK(loss_dev.loss == Approx(loss_host.loss).epsilon(rtol<T>));
  {
    INFO("logits");
    require_composite_near<T>(values(logits_dev), values(logits_host));
  }
  {
    INFO("loss gradient");
    require_composite_near<T>(values(loss_dev.grad), values(loss_host.grad));
  }
  {
    INFO("input gradient");
    require_composite_near<T>(values(dx_dev), values(dx_host));
  }
  params.template compare_grads<require_composite_near<T>>();
}

TEMPLATE_TEST_CASE("device RMSNorm equals the host layer, over many rows and odd widths", "[cuda][layers][decoder]",
                   float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  // 70 rows: two weight-gradient chunks; 1001: an odd width, several elements a
  // thread; 4096 rows of 2048: a LLaMA-sized batch of rows.
  const std::pair<std::int64_t, std::int64_t> sizes[] = {{70, 96}, {33, 1001}, {4096, 2048}};
  for (const auto& [rows, d] : sizes) {
    INFO(rows << " rows of " << d);
    nn::RMSNorm<float> host(d, 1e-5);
    nn::RMSNorm<T, cuda_space> dev(d, 1e-5);
    compare_layers<T>(host, dev, Shape{rows, d}, rnd, training(1), training(1), 2.0f);
  }
  nn::RMSNorm<T, cuda_space> dev(16);
  nn::context ctx;
  CHECK_THROWS_WITH(dev.forward(ctx, Tensor<T, cuda_space>(Shape{2, 15})),
                    "RMSNorm(16): input's last dimension must be 16, got shape [2, 15]");
}

TEMPLATE_TEST_CASE("device LlamaMLP (fused SwiGLU) and GPT2MLP equal the host layers", "[cuda][layers][decoder]", float,
                   sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (bool bias : {false, true}) {
    INFO("LlamaMLP, bias " << bias);
    const nn::llama_mlp_options o{.hidden_size = 24, .intermediate_size = 37, .bias = bias};
    nn::LlamaMLP<float> host(o);
    nn::LlamaMLP<T, cuda_space> dev(o);
    compare_layers<T, require_composite_near<T>>(host, dev, Shape{3, 7, 24}, rnd, training(1), training(1), 2.0f);
  }
  // n_inner 48, a multiple of 8: in bf16 c_fc's product applies the tanh-GELU in cuBLASLt's epilogue
  // (50: the Linear's product, then its GELU kernel); torch's erf GELU is the act layer after c_fc.
  for (double p : {0.0, 0.1})
    for (std::int64_t inner : {50, 48})
      for (auto gelu : {nn::gelu_approx::tanh, nn::gelu_approx::none}) {
        INFO("GPT2MLP, dropout " << p << ", n_inner " << inner << ", GELU " << (gelu == nn::gelu_approx::tanh ? "tanh" : "erf"));
        const nn::gpt2_mlp_options o{.n_embd = 24, .n_inner = inner, .resid_pdrop = p, .activation = gelu};
        nn::GPT2MLP<float> host(o);
        nn::GPT2MLP<T, cuda_space> dev(o);
        compare_layers<T, require_composite_near<T>>(host, dev, Shape{3, 7, 24}, rnd, training(rnd.seed),
                                                     training(rnd.seed));
        CHECK(dev.c_fc.activation() ==
              (gelu == nn::gelu_approx::tanh ? nn::fused_activation::gelu_tanh : nn::fused_activation::none));
      }
  nn::LlamaMLP<T, cuda_space> dev({.hidden_size = 4, .intermediate_size = 6});
  nn::context ctx;
  CHECK_THROWS_WITH(dev.backward(ctx, Tensor<T, cuda_space>(Shape{2, 4})),
                    "LlamaMLP(4 -> 6): backward without a forward");
}

TEST_CASE("swiglu kernels over more than 2^24 elements equal the host's fused loop", "[cuda][layers][decoder]") {
  if (!have_device()) return;
  on_stream s;
  const cudaStream_t st = sl::cuda::current_stream();
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t n = (std::int64_t(1) << 24) + 4099;  // past one grid-stride round of for_each_index
  const auto g = rnd.normal(std::size_t(n), 3.0f), u = rnd.normal(std::size_t(n)), d = rnd.normal(std::size_t(n));
  using host_ops = nn::detail::swiglu_ops<float, sl::host_space>;
  const Tensor<float> gate = host_tensor({n}, g), up = host_tensor({n}, u), dh = host_tensor({n}, d);
  Tensor<float> dgate_host, dup_host;
  host_ops::backward(gate, up, dh, dgate_host, dup_host);
  const auto gd = upload(g, st), ud = upload(u, st), dd = upload(d, st);
  auto h = poisoned<float>(std::size_t(n), st), dgate = poisoned<float>(std::size_t(n), st),
       dup = poisoned<float>(std::size_t(n), st);
  sl::ops::cuda::swiglu<float>(gd.span(), ud.span(), h.span(), st);
  sl::ops::cuda::swiglu_backward<float>(gd.span(), ud.span(), dd.span(), dgate.span(), dup.span(), st);
  {
    INFO("h");
    require_near<float>(download(h, st), values(host_ops::forward(gate, up)));
  }
  {
    INFO("dgate");
    require_near<float>(download(dgate, st), values(dgate_host));
  }
  {
    INFO("dup");
    require_near<float>(download(dup, st), values(dup_host));
  }
}

TEMPLATE_TEST_CASE("device Embedding equals the host layer: repeated ids, accumulated gradients, the host's error",
                   "[cuda][layers][decoder]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t num = 50, dim = 37;
  nn::Embedding<float> host(num, dim);
  nn::Embedding<T, cuda_space> dev(num, dim);
  bound_parameters<T> params(host, dev, rnd);
  Tensor<std::int64_t> ids(Shape{4, 33});
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = rnd.integer(0, 19);  // most rows used several times
  auto ids_dev = device_ids(ids);

  nn::context hctx, dctx;
  const Tensor<float> y_host = host.forward(hctx, ids);
  const auto dy = rounded<T>(rnd.normal(std::size_t(y_host.numel())));
  (void)host.backward(hctx, host_tensor(y_host.shape(), dy));
  poison_next<T>({y_host.shape()});
  const auto y_dev = dev.forward(dctx, ids_dev);
  REQUIRE(y_dev.shape() == y_host.shape());
  REQUIRE(values(y_dev) == values(y_host));  // copies of rows holding T values
  (void)dev.backward(dctx, device_tensor<T>(y_host.shape(), dy));
  params.template compare_grads<require_near<T>>();

  // Two ids out of range: the first (flat position 17) is named, as the host does.
  ids[17] = num + 3;
  ids[40] = -1;
  sl::cuda::copy_async(ids_dev.span(), std::span<const std::int64_t>(ids.span()), sl::cuda::current_stream());
  std::string host_message;
  try {
    (void)host.forward(hctx, ids);
  } catch (const sl::shape_error& e) {
    host_message = e.what();
  }
  REQUIRE(host_message == "Embedding(50, 37): id 53 at position [0, 17] of the input [4, 33] is out of range for a "
                          "table of 50 rows");
  // The device checks the ids without waiting: the error comes with the next loss read
  // (here a cross-entropy on the forward's output with valid targets).
  const auto targets = device_ids(ids.shape(), 1);
  const auto bad_y = dev.forward(dctx, ids_dev);
  const auto loss = nn::cross_entropy(bad_y, targets).loss;
  CHECK_THROWS_WITH(float(loss), host_message);
  CHECK_THROWS_AS(float(loss), sl::shape_error);  // kept: every read raises it
  CHECK_THROWS_AS(dev.forward(dctx, Tensor<std::int64_t, cuda_space>{}), sl::shape_error);
}

// requires_grad = false: the layer's product, column sums or reduction for that
// parameter is skipped (fp32 Linear with both trained takes cuBLASLt's bias-gradient
// epilogue, so each case of it runs another path), the rest as the host's.
TEMPLATE_TEST_CASE("device layers leave a frozen parameter's gradient as it was, as the host layers do",
                   "[cuda][layers][frozen]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  using names = std::set<std::string>;
  for (const names& frozen : {names{"weight"}, names{"bias"}, names{"weight", "bias"}}) {
    INFO("Linear and LayerNorm, " << frozen.size() << " frozen, the first " << *frozen.begin());
    nn::Linear<float> host(24, 40);
    nn::Linear<T, cuda_space> dev(24, 40);
    compare_layers<T>(host, dev, Shape{3, 7, 24}, rnd, training(1), training(1), 1.0f, {}, frozen);
    nn::LayerNorm<float> host_norm(96);
    nn::LayerNorm<T, cuda_space> dev_norm(96);
    compare_layers<T>(host_norm, dev_norm, Shape{70, 96}, rnd, training(1), training(1), 2.0f, {}, frozen);
  }
  {
    nn::RMSNorm<float> host(96, 1e-5);
    nn::RMSNorm<T, cuda_space> dev(96, 1e-5);
    compare_layers<T>(host, dev, Shape{70, 96}, rnd, training(1), training(1), 2.0f, {}, {"weight"});
  }
  {
    nn::PositionEmbedding<float> host(16, 24);
    nn::PositionEmbedding<T, cuda_space> dev(16, 24);
    compare_layers<T>(host, dev, Shape{3, 7, 24}, rnd, training(1), training(1), 1.0f, {}, {"weight"});
  }
  {  // n_inner 48: in bf16 c_fc's GELU is its product's epilogue
    const nn::gpt2_mlp_options o{.n_embd = 24, .n_inner = 48, .resid_pdrop = 0};
    nn::GPT2MLP<float> host(o);
    nn::GPT2MLP<T, cuda_space> dev(o);
    compare_layers<T, require_composite_near<T>>(host, dev, Shape{3, 7, 24}, rnd, training(1), training(1), 1.0f, {},
                                                 {"c_fc.weight", "c_proj.bias"});
  }
  {
    const nn::attention_options o{.embed_dim = 32, .num_heads = 4, .batch_first = true};
    nn::MultiheadAttention<float> host(o);
    nn::MultiheadAttention<T, cuda_space> dev(o);
    compare_layers<T, require_composite_near<T>>(host, dev, Shape{2, 5, 32}, rnd, training(1), training(1), 1.0f, {},
                                                 {"in_proj_weight", "in_proj_bias"});
  }
  // Embedding: a frozen table gets no scatter of dy.
  nn::Embedding<float> host(50, 37);
  nn::Embedding<T, cuda_space> dev(50, 37);
  host.weight.requires_grad = dev.weight.requires_grad = false;
  bound_parameters<T> params(host, dev, rnd);
  Tensor<std::int64_t> ids(Shape{4, 33});
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = rnd.integer(0, 49);
  const auto ids_dev = device_ids(ids);
  nn::context hctx, dctx;
  const Tensor<float> y_host = host.forward(hctx, ids);
  const auto dy = rounded<T>(rnd.normal(std::size_t(y_host.numel())));
  (void)host.backward(hctx, host_tensor(y_host.shape(), dy));
  (void)dev.forward(dctx, ids_dev);
  (void)dev.backward(dctx, device_tensor<T>(y_host.shape(), dy));
  params.require_untouched({"weight"});
}

// The Embedding's bad-id check is read with the next loss, in that loss's one wait;
// a loss takes the reports when it is made; forwards without any loss read the
// oldest report alone past deferred_reports::limit (64).
TEST_CASE("device Embedding leaves its check to the next loss read", "[cuda][layers][decoder][pending]") {
  if (!have_device()) return;
  on_stream s;
  random_inputs rnd;
  auto& reports = sl::ops::cuda::deferred_index_reports();
  (void)reports.take();  // what earlier tests left unread
  const std::int64_t num = 8, dim = 5;
  nn::Embedding<float> host(num, dim);
  nn::Embedding<float, cuda_space> dev(num, dim);
  bound_parameters<float> params(host, dev, rnd);
  const auto good = device_ids({2, 3}, 2), bad = device_ids({2, 3}, num), targets = device_ids({2, 3}, 0);
  nn::context ctx;
  (void)float(nn::cross_entropy(dev.forward(ctx, good), targets).loss);  // allocations may wait
  const std::string message =
      "Embedding(8, 5): id 8 at position [0, 0] of the input [2, 3] is out of range for a table of 8 rows";

  auto before = sl::host_syncs();
  auto loss = nn::cross_entropy(dev.forward(ctx, good), targets).loss;
  CHECK(sl::host_syncs() - before == 0);  // forward and loss: no wait
  CHECK(reports.size() == 0);             // the loss took the report
  CHECK(std::isfinite(float(loss)));
  CHECK(sl::host_syncs() - before == 1);  // the loss and both reports in one wait

  // A bad forward's report is taken by the first loss after it, even one never read.
  (void)dev.forward(ctx, bad);
  (void)nn::cross_entropy(dev.forward(ctx, good), targets).loss;
  CHECK(std::isfinite(float(nn::cross_entropy(dev.forward(ctx, good), targets).loss)));
  (void)dev.forward(ctx, bad);
  CHECK_THROWS_WITH(float(nn::cross_entropy(dev.forward(ctx, good), targets).loss), message);

  // Without a loss: limit forwards wait for nothing, the next reads the oldest alone.
  before = sl::host_syncs();
  (void)dev.forward(ctx, bad);
  for (std::size_t i = 1; i < reports.limit; ++i) (void)dev.forward(ctx, good);
  CHECK(sl::host_syncs() - before == 0);
  CHECK(reports.size() == reports.limit);
  CHECK_THROWS_WITH(dev.forward(ctx, good), message);  // the oldest, the bad one
  CHECK(sl::host_syncs() - before == 2);                 // its report, then its id for the message
  CHECK(reports.size() == reports.limit);
  before = sl::host_syncs();
  (void)dev.forward(ctx, good);
  CHECK(sl::host_syncs() - before == 1);
  (void)reports.take();
}

// Inference without a loss leaves the checks unread in the thread's list: a rank
// thread that ends so releases them at its very end, into its rank's ledger, which
// launch keeps until every thread has ended (one in the thread's own frame would be
// gone by then, and the release would write into a dead frame: silent, or heap
// corruption; test_thread_comm checks the ledger's lifetime under ASan).
TEST_CASE("a rank thread that ends with device Embedding checks unread releases them safely",
          "[cuda][layers][decoder][pending]") {
  if (!have_device()) return;
  std::vector<std::size_t> unread(2);
  sl::comm::launch(2, [&](sl::comm::ThreadComm& c) {
    sl::cuda::check(cudaSetDevice(0), "cudaSetDevice(0)");
    on_stream s;
    random_inputs rnd;
    nn::Embedding<float> host(8, 5);
    nn::Embedding<float, cuda_space> dev(8, 5);
    bound_parameters<float> params(host, dev, rnd);
    nn::context ctx({.training = false});
    for (int i = 0; i < 3; ++i) (void)dev.forward(ctx, device_ids({2, 3}, 1));
    unread[std::size_t(c.rank())] = sl::ops::cuda::deferred_index_reports().size();
  });
  CHECK(unread == std::vector<std::size_t>{3, 3});
}

TEMPLATE_TEST_CASE("device PositionEmbedding equals the host layer at offsets 0 and 3 and at position ids",
                   "[cuda][layers][decoder]",
                   float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  for (std::int64_t offset : {0, 3}) {
    INFO("offset " << offset);
    nn::PositionEmbedding<float> host(16, 24);
    nn::PositionEmbedding<T, cuda_space> dev(16, 24);
    host.set_offset(offset);
    dev.set_offset(offset);
    compare_layers<T>(host, dev, Shape{3, 7, 24}, rnd, training(1), training(1));
  }
  {  // Position ids, repeated and out of order: each token's own row, rows added up in backward.
    nn::PositionEmbedding<float> host(16, 24);
    nn::PositionEmbedding<T, cuda_space> dev(16, 24);
    Tensor<std::int64_t> ids(Shape{3, 7});
    for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = rnd.integer(0, 15);
    nn::context hctx = training(1), dctx = training(1);
    hctx.set_position_ids(ids);
    dctx.set_position_ids(ids);
    compare_layers<T>(host, dev, Shape{3, 7, 24}, rnd, hctx, dctx);
    ids[5] = 16;
    dctx.set_position_ids(ids);
    CHECK_THROWS_WITH(dev.forward(dctx, Tensor<T, cuda_space>(Shape{3, 7, 24})),
                      "PositionEmbedding(16, 24): position id 16 (row 0, token 5) is outside [0, 16)");
  }
  nn::PositionEmbedding<T, cuda_space> dev(16, 24);
  dev.set_offset(3);
  nn::context ctx;
  CHECK_THROWS_WITH(dev.forward(ctx, Tensor<T, cuda_space>(Shape{2, 14, 24})),
                    "PositionEmbedding(16, 24): positions 3..16 (offset 3, sequence 14) exceed the table's "
                    "max_positions 16");
}

namespace {
template <class L, class X>
void check_refuses(L layer, const X& x, const std::string& name) {
  INFO(name);
  no_grad_context ctx;
  const auto y = layer.forward(ctx, x);
  CHECK_THROWS_WITH(layer.backward(ctx, y), Catch::Contains(name) && Catch::Contains("backward"));
}
}  // namespace

// Eval mode (and a checkpointed layer's first pass) keeps no input for backward; the
// products must still read the input they were given (they read the kept copy once: a
// null operand, found when train_gpt_cuda's evaluation ran on the emulator).
TEMPLATE_TEST_CASE("device Linear gives the same output with gradients disabled: each activation, bias or not",
                   "[cuda][layers]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const auto x = device_tensor<T>({3, 5, 24}, rnd.normal(360));
  for (const bool bias : {true, false})
    for (const auto act : {nn::fused_activation::none, nn::fused_activation::relu, nn::fused_activation::gelu_tanh}) {
      INFO("bias " << bias << ", activation " << int(act));
      nn::Linear<float> host(24, 40, bias);
      nn::Linear<T, cuda_space> dev(24, 40, bias);
      bound_parameters<T> p(host, dev, rnd);
      dev.fuse_activation(act);
      nn::context with_grad;
      no_grad_context without_grad;
      const std::vector<float> want = values(dev.forward(with_grad, x)), got = values(dev.forward(without_grad, x));
      REQUIRE(max_abs(want) > 0);
      CHECK(got == want);  // the same kernels on the same values: the same bits (a NaN never compares equal)
    }
}

TEST_CASE("device layers keep nothing with gradients disabled and refuse a backward, naming the layer",
          "[cuda][layers][decoder]") {
  if (!have_device()) return;
  on_stream s;
  random_inputs rnd;
  const auto x = device_tensor<float>({2, 3, 4}, rnd.normal(24));
  nn::RMSNorm<float, cuda_space> norm(4);
  nn::LlamaMLP<float, cuda_space> mlp({.hidden_size = 4, .intermediate_size = 6});
  nn::PositionEmbedding<float, cuda_space> pos(6, 4);
  nn::Embedding<float, cuda_space> emb(5, 4);
  nn::RMSNorm<float> host_norm(4);
  nn::LlamaMLP<float> host_mlp({.hidden_size = 4, .intermediate_size = 6});
  nn::PositionEmbedding<float> host_pos(6, 4);
  nn::Embedding<float> host_emb(5, 4);
  bound_parameters<float> p1(host_norm, norm, rnd), p2(host_mlp, mlp, rnd), p3(host_pos, pos, rnd),
      p4(host_emb, emb, rnd);  // values for the device layers (the host layers only name them)
  check_refuses(norm, x, "RMSNorm(4)");
  check_refuses(mlp, x, "LlamaMLP(4 -> 6)");
  check_refuses(pos, x, "PositionEmbedding(6, 4)");
  check_refuses(nn::MeanPool<float, cuda_space>(1), x, "MeanPool(1)");
  Tensor<std::int64_t> ids(Shape{2, 3});
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids[i] = i % 5;
  const auto ids_dev = device_ids(ids);
  check_refuses(emb, ids_dev, "Embedding(5, 4)");
}

namespace {
// A contiguous [B, H, L, D] device tensor as a head view.
template <class T>
nn::head_view<T> bhsd(Tensor<T, cuda_space>& t) {
  const std::int64_t H = t.dim(1), L = t.dim(2), D = t.dim(3);
  return {t.data(), t.dim(0), H, L, D, H * L * D, L * D, D};
}
}  // namespace

TEMPLATE_TEST_CASE("device rotary embeddings equal the host table: offsets, head dims, strided views, inverse",
                   "[cuda][layers][decoder][rotary]", float, sl::bfloat16) {
  if (!have_device()) return;
  using T = TestType;
  on_stream s;
  const cudaStream_t st = sl::cuda::current_stream();
  random_inputs rnd;
  INFO("seed " << rnd.seed);
  const std::int64_t B = 2, H = 3, L = 9, positions = 64;
  for (const std::int64_t D : {64, 128}) {
    const nn::rope_scaling llama3{.type = nn::rope_scaling::kind::llama3, .factor = 8,
                                  .original_max_position_embeddings = 32};  // the host's scaled frequencies at 128
    const nn::rotary_options o{.head_dim = D, .base = 10000, .scaling = D == 128 ? llama3 : nn::rope_scaling{}};
    const sl::ops::cuda::rotary_device_table table(o, positions, st);  // once, for every offset
    for (const std::int64_t offset : {0, 17})
      for (const bool inverse : {false, true}) {
        INFO("head_dim " << D << ", offset " << offset << ", inverse " << inverse);
        const nn::rotary_table<float> host_table(o, offset, L);
        {
          INFO("[B, H, L, D], in place");
          const auto x = rounded<T>(rnd.normal(std::size_t(B * H * L * D)));
          Tensor<float> want = host_tensor({B, H, L, D}, x);
          host_table.apply(nn::head_view<float>::bhsd(want), inverse);
          auto dev = device_tensor<T>({B, H, L, D}, x);
          sl::ops::cuda::apply_rotary(bhsd(dev), table.cos(), table.sin(), offset, inverse, st);
          require_near<T>(values(dev), values(want));
        }
        {
          INFO("the q part of [B, L, 3 H D], out of place into [B, H, L, D]");
          const std::int64_t width = 3 * H * D;
          const auto x = rounded<T>(rnd.normal(std::size_t(B * L * width)));
          Tensor<float> host_qkv = host_tensor({B, L, width}, x);
          const auto q = nn::head_view<float>::rows(host_qkv.data(), B, L, H, D, width);
          host_table.apply(q, inverse);
          std::vector<float> want(std::size_t(B * H * L * D));
          for (std::int64_t n = 0; n < B; ++n)
            for (std::int64_t h = 0; h < H; ++h)
              for (std::int64_t l = 0; l < L; ++l)
                for (std::int64_t j = 0; j < D; ++j) want[((n * H + h) * L + l) * D + j] = q.at(n, h)[l * width + j];
          auto qkv = device_tensor<T>({B, L, width}, x);
          poison_next<T>({Shape{B, H, L, D}});
          Tensor<T, cuda_space> out(Shape{B, H, L, D});
          sl::ops::cuda::apply_rotary(nn::head_view<T>::rows(qkv.data(), B, L, H, D, width), bhsd(out), table, offset,
                                      inverse, st);
          require_near<T>(values(out), want);
          REQUIRE(values(qkv) == x);  // the input is untouched
        }
      }
    auto x = device_tensor<T>({B, H, L, D}, rnd.normal(std::size_t(B * H * L * D)));
    CHECK_THROWS_WITH(sl::ops::cuda::apply_rotary(bhsd(x), bhsd(x), table, positions - L + 1, false, st),
                      Catch::Contains("cannot rotate heads of shape [2, 3, 9, " + std::to_string(D) + "] at positions " +
                                      std::to_string(positions - L + 1) + ".." + std::to_string(positions)));
  }
}

TEST_CASE("device cross-entropy raises the host's error for a bad target", "[cuda][layers][loss]") {
  if (!have_device()) return;
  on_stream s;
  random_inputs rnd;
  const std::vector<float> z = rnd.normal(20);
  Tensor<std::int64_t> y(Shape{5});
  const std::int64_t ids[] = {0, -100, 9, 2, 4};  // 4 classes: rows 2 and 4 are bad, row 2 is named
  std::copy(std::begin(ids), std::end(ids), y.data());
  Tensor<std::int64_t, cuda_space> y_dev(Shape{5});
  sl::cuda::copy_async(y_dev.span(), std::span<const std::int64_t>(y.span()), sl::cuda::current_stream());
  std::string host_message;
  try {
    (void)nn::cross_entropy(host_tensor({5, 4}, z), y);
  } catch (const sl::shape_error& e) {
    host_message = e.what();
  }
  REQUIRE(host_message == "cross_entropy: target 9 in row 2 is out of range for 4 classes (ignore_index is -100)");
  // On the device the report travels with the loss: the error comes when the loss is read.
  CHECK_THROWS_WITH(float(nn::cross_entropy(device_tensor<float>({5, 4}, z), y_dev).loss), host_message);
  CHECK_THROWS_AS(float(nn::cross_entropy(device_tensor<float>({5, 4}, z), y_dev).loss), sl::shape_error);
  SECTION("and the host's shape errors before any work") {
    CHECK_THROWS_AS(nn::cross_entropy(device_tensor<float>({5, 4}, z), Tensor<std::int64_t, cuda_space>(Shape{4})),
                    sl::shape_error);
  }
}

}  // namespace test_cuda_layers
