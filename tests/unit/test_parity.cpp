// Parity with PyTorch: each primitive, the losses and a 2-layer encoder classifier
// against torch's forward and backward in float64 and float32, from the goldens
// that tests/golden/make_layer_goldens.py writes (docs/parity.md lists the errors
// observed). Parameters are loaded by torch's state_dict names, so this also
// checks that names and layouts match torch's exactly.
#include "shardlib/io/safetensors.hpp"
#include "shardlib/nn/activation.hpp"
#include "shardlib/nn/attention.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/layer_norm.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/pooling.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/nn/transformer.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/gradcheck.hpp"

using namespace shardlib;
using namespace shardlib::nn;
using io::safetensors;

namespace {

// Every case the script writes, each as <case>.f64 and <case>.f32.
const std::set<std::string> golden_cases{
    "linear_bias", "linear_nobias", "embedding", "layer_norm", "relu", "gelu", "gelu_tanh", "meanpool_dim0",
    "meanpool_dim1", "mha_seq_first", "mha_seq_first_mask", "mha_batch_first", "mha_batch_first_mask",
    "encoder_post_relu", "encoder_pre_gelu_mask", "cross_entropy", "cross_entropy_ignore_index",
    "cross_entropy_label_smoothing", "cross_entropy_ignore_smoothing", "mse_loss", "classifier"};

// The golden tensors that are not parameters (parameter gradients end in ".grad").
const std::set<std::string> data_tensors{"input", "mask", "target", "r", "output", "loss"};

template <class T>
constexpr const char* precision = std::is_same_v<T, double> ? "f64" : "f32";
// Norm-wise relative error per tensor: float64 agrees to rounding (~1e-15), float32
// to ~1e-6 after two encoder layers.
template <class T>
constexpr double tolerance = std::is_same_v<T, double> ? 1e-10 : 1e-5;

std::filesystem::path golden_dir() { return std::filesystem::path(SHARDLIB_GOLDEN_DIR) / "layers"; }

template <class T>
safetensors load_golden(const std::string& name) {
  REQUIRE(golden_cases.contains(name));
  return safetensors::load(golden_dir() / (name + "." + precision<T> + ".safetensors"));
}

template <class E>
Tensor<E> read(const safetensors& f, std::string_view name) {
  const std::vector<E> v = f.get<E>(name);
  Tensor<E> t(f.info(name).shape);
  std::copy(v.begin(), v.end(), t.data());
  return t;
}

// The largest error over a case's tensors; every tensor must be within tolerance<T>.
template <class T>
struct comparison {
  explicit comparison(std::string case_name) : name(std::move(case_name)) {}

  std::string name, worst;
  double max_error = 0;

  void operator()(const std::string& what, std::span<const T> ours, const std::vector<T>& torch) {
    INFO(name << " (" << precision<T> << "): " << what);
    REQUIRE(ours.size() == torch.size());
    const double e = gradcheck::rel_error(std::vector<double>(ours.begin(), ours.end()),
                                          std::vector<double>(torch.begin(), torch.end()));
    CHECK(e <= tolerance<T>);
    if (e >= max_error) max_error = e, worst = what;
  }
  void operator()(const std::string& what, const Tensor<T>& ours, const safetensors& f) {
    INFO(name << " (" << precision<T> << "): " << what);
    REQUIRE(ours.shape() == f.info(what).shape);
    (*this)(what, std::span<const T>(ours.span()), f.get<T>(what));
  }
};

// Objective of the cases without a loss: sum(y * r), so dL/dy = r.
struct weighted_sum {};

// Copies torch's parameters into the layer by name, runs forward and backward
// (dL/dy = r, or the loss's gradient), and compares the output, the loss, dL/dx
// and every parameter's gradient with torch's.
template <class T, Layer L, class Loss>
comparison<T> against_torch(const std::string& name, L layer, Loss loss) {
  const safetensors f = load_golden<T>(name);
  Replicated<T, L> owner(layer, 0);
  std::set<std::string> ours, theirs;
  for (const auto& e : owner.layout().entries) ours.insert(e.name);
  for (const auto& t : f.tensors())
    if (!data_tensors.contains(t.name) && !t.name.ends_with(".grad")) theirs.insert(t.name);
  REQUIRE(ours == theirs);
  for (const auto& e : owner.layout().entries) {
    INFO(e.name);
    REQUIRE(f.info(e.name).shape == e.shape);
    const std::vector<T> v = f.get<T>(e.name);
    std::copy(v.begin(), v.end(), owner.value(e.name).begin());
  }

  context ctx({.training = false});
  if (f.contains("mask")) ctx.set_key_padding_mask(read<std::uint8_t>(f, "mask"));
  comparison<T> cmp{name};
  const auto y = ctx.forward(layer, read<typename L::input::value_type>(f, "input"));
  cmp("output", y, f);
  Tensor<T> dy;
  if constexpr (std::is_same_v<Loss, weighted_sum>) {
    dy = read<T>(f, "r");
  } else {
    auto [value, grad] = loss(y, f);
    cmp("loss", std::span<const T>(&value, 1), f.get<T>("loss"));
    dy = grad;
  }
  const auto dx = ctx.backward(layer, dy);
  if constexpr (std::is_same_v<typename L::input, Tensor<T>>) {
    cmp("input.grad", dx, f);
  } else {  // token ids have no gradient
    CHECK(dx.empty());
    CHECK_FALSE(f.contains("input.grad"));
  }
  for (const auto& e : owner.layout().entries)
    cmp(e.name + ".grad", std::span<const T>(owner.grad(e.name)), f.get<T>(e.name + ".grad"));
  return cmp;
}

// A bare loss: its value and its gradient with respect to the input.
template <class T, class Loss>
comparison<T> loss_against_torch(const std::string& name, Loss loss) {
  const safetensors f = load_golden<T>(name);
  comparison<T> cmp{name};
  auto [value, grad] = loss(read<T>(f, "input"), f);
  cmp("loss", std::span<const T>(&value, 1), f.get<T>("loss"));
  cmp("input.grad", grad, f);
  return cmp;
}

void report(const comparison<double>& f64, const comparison<float>& f32) {
  std::printf("parity %-32s f64 %.1e (%s)  f32 %.1e (%s)\n", f64.name.c_str(), f64.max_error, f64.worst.c_str(),
              f32.max_error, f32.worst.c_str());
}

// make(T{}) builds the layer in precision T with the golden case's options.
template <class Make, class Loss = weighted_sum>
void parity(const std::string& name, Make make, Loss loss = {}) {
  report(against_torch<double>(name, make(double{}), loss), against_torch<float>(name, make(float{}), loss));
}

template <class Loss>
void loss_parity(const std::string& name, Loss loss) {
  report(loss_against_torch<double>(name, loss), loss_against_torch<float>(name, loss));
}

auto cross_entropy_with(cross_entropy_options o) {
  return [o](const auto& logits, const safetensors& f) {
    return cross_entropy_loss{o}(logits, read<std::int64_t>(f, "target"));
  };
}

constexpr std::int64_t d_model = 16, nhead = 4, dim_ff = 32, classes = 4;

}  // namespace

TEST_CASE("every golden file belongs to a parity case", "[nn][parity]") {
  std::set<std::string> files, expected;
  for (const auto& entry : std::filesystem::directory_iterator(golden_dir())) files.insert(entry.path().filename());
  for (const auto& c : golden_cases)
    for (const char* p : {"f64", "f32"}) expected.insert(c + "." + p + ".safetensors");
  CHECK(files == expected);
}

TEST_CASE("Linear and Embedding match torch", "[nn][parity]") {
  parity("linear_bias", [](auto t) { return Linear<decltype(t)>(d_model, 8); });
  parity("linear_nobias", [](auto t) { return Linear<decltype(t)>(d_model, 8, false); });
  parity("embedding", [](auto t) { return Embedding<decltype(t)>(10, d_model); });
}

TEST_CASE("LayerNorm, activations and MeanPool match torch", "[nn][parity]") {
  parity("layer_norm", [](auto t) { return LayerNorm<decltype(t)>(d_model); });
  parity("relu", [](auto t) { return ReLU<decltype(t)>{}; });
  parity("gelu", [](auto t) { return GELU<decltype(t)>{}; });
  parity("gelu_tanh", [](auto t) { return GELU<decltype(t)>(gelu_approx::tanh); });
  parity("meanpool_dim0", [](auto t) { return MeanPool<decltype(t)>(0); });
  parity("meanpool_dim1", [](auto t) { return MeanPool<decltype(t)>(1); });
}

TEST_CASE("MultiheadAttention matches torch in both layouts, with and without key padding", "[nn][parity][attention]") {
  for (bool batch_first : {false, true})
    for (bool mask : {false, true})
      parity(std::string(batch_first ? "mha_batch_first" : "mha_seq_first") + (mask ? "_mask" : ""), [&](auto t) {
        return MultiheadAttention<decltype(t)>({.embed_dim = d_model, .num_heads = nhead, .batch_first = batch_first});
      });
}

TEST_CASE("TransformerEncoderLayer matches torch post-norm and pre-norm", "[nn][parity][attention]") {
  parity("encoder_post_relu", [](auto t) {
    return TransformerEncoderLayer<decltype(t)>({.d_model = d_model, .nhead = nhead, .dim_feedforward = dim_ff,
                                                 .dropout = 0});
  });
  parity("encoder_pre_gelu_mask", [](auto t) {
    return TransformerEncoderLayer<decltype(t)>({.d_model = d_model,
                                                 .nhead = nhead,
                                                 .dim_feedforward = dim_ff,
                                                 .dropout = 0,
                                                 .activation = transformer_activation::gelu,
                                                 .batch_first = true,
                                                 .norm_first = true});
  });
}

TEST_CASE("losses match torch", "[nn][parity][loss]") {
  loss_parity("cross_entropy", cross_entropy_with({}));
  loss_parity("cross_entropy_ignore_index", cross_entropy_with({.ignore_index = 3}));
  loss_parity("cross_entropy_label_smoothing", cross_entropy_with({.label_smoothing = 0.1}));
  loss_parity("cross_entropy_ignore_smoothing", cross_entropy_with({.ignore_index = 3, .label_smoothing = 0.1}));
  loss_parity("mse_loss", [](const auto& input, const safetensors& f) {
    return mse_loss(input, read<typename std::decay_t<decltype(input)>::value_type>(f, "target"));
  });
}

TEST_CASE("a 2-layer encoder classifier with cross-entropy matches torch", "[nn][parity]") {
  // torch: nn.Sequential(nn.TransformerEncoder(layer, 2), MeanPool(1), nn.Linear(d_model, classes)).
  parity("classifier", [](auto t) {
    using T = decltype(t);
    using Encoder = TransformerEncoderLayer<T>;
    return Sequential<Stack<Encoder>, MeanPool<T>, Linear<T>>(
        Stack<Encoder>(2, {.d_model = d_model, .nhead = nhead, .dim_feedforward = dim_ff, .dropout = 0,
                           .batch_first = true}),
        MeanPool<T>(1), Linear<T>(d_model, classes));
  }, cross_entropy_with({}));
}
