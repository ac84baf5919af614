// tests/support/golden.hpp — reading the PyTorch goldens that
// tests/golden/make_layer_goldens.py (tests/golden/layers) and
// make_decoder_goldens.py (tests/golden/decoder) write, and comparing a layer or
// a loss with them: parameters are loaded by torch's state_dict names (so names
// and layouts must match torch's exactly), then the output, the loss, dL/dx and
// every parameter's gradient are compared in float64 and float32.
#pragma once
#include "shardlib/io/safetensors.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/loss.hpp"
#include "shardlib/nn/replicated.hpp"

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

namespace golden {

using namespace shardlib;
using io::safetensors;

// Every case make_layer_goldens.py writes, each as <case>.f64 and <case>.f32;
// test_parity checks that tests/golden/layers holds exactly these files.
inline const std::set<std::string> layer_cases{
    // test_parity.cpp
    "linear_bias", "linear_nobias", "embedding", "layer_norm", "relu", "gelu", "gelu_tanh", "meanpool_dim0",
    "meanpool_dim1", "mha_seq_first", "mha_seq_first_mask", "mha_batch_first", "mha_batch_first_mask",
    "mha_batch_first_attn_mask", "encoder_post_relu", "encoder_pre_gelu_mask", "encoder_post_relu_attn_mask",
    "cross_entropy", "cross_entropy_ignore_index",
    "cross_entropy_label_smoothing", "cross_entropy_ignore_smoothing", "mse_loss", "classifier",
    // test_decoder_layers.cpp
    "rms_norm", "silu", "llama_mlp", "gpt2_mlp", "position_embedding_offset", "token_cross_entropy",
    "decoder_stack"};

// The golden tensors that are not parameters (parameter gradients end in ".grad"):
// "mask" is the key padding mask, "attn_mask" an additive attention mask.
inline const std::set<std::string> data_tensors{"input", "mask", "attn_mask", "target", "r", "output", "loss"};

template <class T>
constexpr const char* precision = std::is_same_v<T, double> ? "f64" : "f32";
// Norm-wise relative error per tensor: float64 agrees to rounding (~1e-15), float32
// to ~1e-6 after two encoder layers.
template <class T>
constexpr double tolerance = std::is_same_v<T, double> ? 1e-10 : 1e-5;

inline std::filesystem::path layers_dir() { return std::filesystem::path(SHARDLIB_GOLDEN_DIR) / "layers"; }
inline std::filesystem::path decoder_dir() { return std::filesystem::path(SHARDLIB_GOLDEN_DIR) / "decoder"; }

// <dir>/<name>.<f64|f32>.safetensors; a case of layers_dir() must be listed in layer_cases.
template <class T>
safetensors load(const std::string& name, const std::filesystem::path& dir = layers_dir()) {
  if (dir == layers_dir()) REQUIRE(layer_cases.contains(name));
  return safetensors::load(dir / (name + "." + precision<T> + ".safetensors"));
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

// Copies torch's parameters into the layer by name (every one, no more), runs
// forward and backward with the file's masks in the context (dL/dy = r, or the
// loss's gradient), and compares the output, the loss, dL/dx and every
// parameter's gradient with torch's.
template <class T, nn::Layer L, class Loss>
comparison<T> against_torch(const std::string& name, L layer, Loss loss,
                            const std::filesystem::path& dir = layers_dir()) {
  const safetensors f = load<T>(name, dir);
  nn::Replicated<T, L> owner(layer, 0);
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

  nn::context ctx({.training = false});
  if (f.contains("mask")) ctx.set_key_padding_mask(read<std::uint8_t>(f, "mask"));
  if (f.contains("attn_mask")) ctx.set_attention_mask(read<float>(f, "attn_mask"));
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
  const safetensors f = load<T>(name);
  comparison<T> cmp{name};
  auto [value, grad] = loss(read<T>(f, "input"), f);
  cmp("loss", std::span<const T>(&value, 1), f.get<T>("loss"));
  cmp("input.grad", grad, f);
  return cmp;
}

inline void report(const comparison<double>& f64, const comparison<float>& f32) {
  std::printf("parity %-32s f64 %.1e (%s)  f32 %.1e (%s)\n", f64.name.c_str(), f64.max_error, f64.worst.c_str(),
              f32.max_error, f32.worst.c_str());
}

// make(T{}) builds the layer in precision T with the golden case's options.
template <class Make, class Loss = weighted_sum>
void parity(const std::string& name, Make make, Loss loss = {}, const std::filesystem::path& dir = layers_dir()) {
  report(against_torch<double>(name, make(double{}), loss, dir), against_torch<float>(name, make(float{}), loss, dir));
}

template <class Loss>
void loss_parity(const std::string& name, Loss loss) {
  report(loss_against_torch<double>(name, loss), loss_against_torch<float>(name, loss));
}

// The cross-entropy of the logits against the file's "target" (class ids).
inline auto cross_entropy_with(nn::cross_entropy_options o) {
  return [o](const auto& logits, const safetensors& f) {
    return nn::cross_entropy_loss{o}(logits, read<std::int64_t>(f, "target"));
  };
}

}  // namespace golden
