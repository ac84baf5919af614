// Parity with PyTorch: each primitive, the losses and a 2-layer encoder classifier
// against torch's forward and backward in float64 and float32, from the goldens
// that tests/golden/make_layer_goldens.py writes (docs/parity.md lists the errors
// observed), read and compared by tests/support/golden.hpp. Parameters are loaded
// by torch's state_dict names, so this also checks that names and layouts match
// torch's exactly.
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

#include <filesystem>
#include <set>
#include <string>
#include <type_traits>

#include "support/golden.hpp"

using namespace shardlib;
using namespace shardlib::nn;
using golden::cross_entropy_with;
using golden::loss_parity;
using golden::parity;
using io::safetensors;

namespace {

constexpr std::int64_t d_model = 16, nhead = 4, dim_ff = 32, classes = 4;

}  // namespace

// The decoder layers' cases are compared in test_decoder_layers.cpp.
TEST_CASE("every golden file belongs to a parity case", "[nn][parity]") {
  std::set<std::string> files, expected;
  for (const auto& entry : std::filesystem::directory_iterator(golden::layers_dir()))
    files.insert(entry.path().filename());
  for (const auto& c : golden::layer_cases)
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

TEST_CASE("MultiheadAttention matches torch in both layouts, with and without key padding, and with an attention mask", "[nn][parity][attention]") {
  for (bool batch_first : {false, true})
    for (bool mask : {false, true})
      parity(std::string(batch_first ? "mha_batch_first" : "mha_seq_first") + (mask ? "_mask" : ""), [&](auto t) {
        return MultiheadAttention<decltype(t)>({.embed_dim = d_model, .num_heads = nhead, .batch_first = batch_first});
      });
  // torch's additive attn_mask [L, L] (causal -inf plus finite values) with key padding.
  parity("mha_batch_first_attn_mask", [&](auto t) {
    return MultiheadAttention<decltype(t)>({.embed_dim = d_model, .num_heads = nhead, .batch_first = true});
  });
}

TEST_CASE("TransformerEncoderLayer matches torch post-norm and pre-norm, with key padding or an attention mask", "[nn][parity][attention]") {
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
  parity("encoder_post_relu_attn_mask", [](auto t) {  // torch's src_mask, additive [L, L]
    return TransformerEncoderLayer<decltype(t)>({.d_model = d_model, .nhead = nhead, .dim_feedforward = dim_ff,
                                                 .dropout = 0});
  });
}

TEST_CASE("losses match torch", "[nn][parity][loss]") {
  loss_parity("cross_entropy", cross_entropy_with({}));
  loss_parity("cross_entropy_ignore_index", cross_entropy_with({.ignore_index = 3}));
  loss_parity("cross_entropy_label_smoothing", cross_entropy_with({.label_smoothing = 0.1}));
  loss_parity("cross_entropy_ignore_smoothing", cross_entropy_with({.ignore_index = 3, .label_smoothing = 0.1}));
  loss_parity("mse_loss", [](const auto& input, const safetensors& f) {
    return mse_loss(input, golden::read<typename std::decay_t<decltype(input)>::value_type>(f, "target"));
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
