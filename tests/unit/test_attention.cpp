// Multi-head self-attention and the transformer encoder layer: torch's names and
// layout, forward against naive loops, key padding and attention masks, dropout,
// finite-difference gradients, and shape errors.
#include "shardlib/nn/attention.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/nn/transformer.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "support/gradcheck.hpp"
#include "support/compare.hpp"

namespace test_attention {

using namespace shardlib;
using namespace shardlib::nn;

namespace {

// Runs its layer with a key-padding mask and an attention mask in the context, so
// gradcheck (which makes its own plain context) sees them on every evaluation.
template <class L>
struct with_mask {
  using input = typename L::input;
  using output = typename L::output;
  L inner;
  Tensor<std::uint8_t> mask;
  attn_mask attn{};

  template <class V>
  void parameters(V&& v) { inner.parameters(v); }
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    ctx.set_key_padding_mask(mask);
    if (!attn.allowed.empty()) ctx.set_attention_mask(attn.allowed);
    if (!attn.bias.empty()) ctx.set_attention_mask(attn.bias);
    return ctx.forward(inner, x);
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) { return ctx.backward(inner, dy); }
};

Tensor<std::uint8_t> padding_mask(std::int64_t n, std::int64_t l, const std::vector<std::int64_t>& lengths) {
  auto m = Tensor<std::uint8_t>::zeros({n, l});
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t j = lengths[std::size_t(b)]; j < l; ++j) m[b * l + j] = 1;
  return m;
}

// A boolean mask letting query i see keys j <= i: a [L, L] causal mask.
Tensor<std::uint8_t> causal_mask(std::int64_t l) {
  auto m = Tensor<std::uint8_t>::zeros({l, l});
  for (std::int64_t i = 0; i < l; ++i)
    for (std::int64_t j = 0; j <= i; ++j) m[i * l + j] = 1;
  return m;
}
// An additive mask of the given shape: entries in (-1, 1), and -inf at every
// third one (a query whose keys are all -inf gets zero weights).
Tensor<float> additive_mask(const Shape& shape, std::uint64_t seed) {
  const auto r = gradcheck::random_tensor(shape, seed, 1.0);
  Tensor<float> m(shape);
  for (std::int64_t i = 0; i < m.numel(); ++i) m[i] = i % 3 == 1 ? -INFINITY : float(r[i]);
  return m;
}

std::vector<std::string> names_and_shapes(const flat_layout& f) {
  std::vector<std::string> out;
  for (const auto& e : f.entries) out.push_back(e.name + cat(e.shape));
  return out;
}

// The attention mask's term for query i, key j of head h of batch element n, its
// shape aligned on the right of [N, H, L, L] with 1 broadcasting: -inf where a
// boolean mask forbids the pair, the additive entry, or 0 without a mask.
double mask_term(const attn_mask& m, std::int64_t n, std::int64_t h, std::int64_t i, std::int64_t j) {
  if (m.empty()) return 0;
  const Shape& s = m.shape();
  const std::int64_t at[4] = {n, h, i, j};
  std::int64_t index = 0;
  for (int d = 0; d < s.rank(); ++d) index = index * s[d] + (s[d] == 1 ? 0 : at[4 - s.rank() + d]);
  if (!m.allowed.empty()) return m.allowed[index] ? 0.0 : -INFINITY;
  return m.bias[index];
}

// torch's MultiheadAttention in plain loops over double: x is [L, N, E] or
// [N, L, E]; mask [N, L] or empty; attn as the context's attention mask (nonzero
// = may attend, scaled_dot_product_attention's convention); param(name) gives a
// parameter's values.
template <class Params>
std::vector<double> reference_attention(Params param, const Tensor<double>& x, std::int64_t heads, bool batch_first,
                                        const Tensor<std::uint8_t>& mask, const attn_mask& attn = {}) {
  const std::int64_t E = x.dim(2), L = x.dim(batch_first ? 1 : 0), N = x.dim(batch_first ? 0 : 1), D = E / heads;
  auto w = param("in_proj_weight"), b = param("in_proj_bias");
  auto wo = param("out_proj.weight"), bo = param("out_proj.bias");
  auto row = [&](std::int64_t n, std::int64_t l) { return batch_first ? n * L + l : l * N + n; };
  std::vector<double> qkv(std::size_t(L * N * 3 * E)), y(std::size_t(L * N * E));
  for (std::int64_t r = 0; r < L * N; ++r)
    for (std::int64_t c = 0; c < 3 * E; ++c) {
      double s = b[std::size_t(c)];
      for (std::int64_t e = 0; e < E; ++e) s += w[std::size_t(c * E + e)] * x[r * E + e];
      qkv[std::size_t(r * 3 * E + c)] = s;
    }
  auto at = [&](std::int64_t n, std::int64_t l, std::int64_t c) { return qkv[std::size_t(row(n, l) * 3 * E + c)]; };
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t i = 0; i < L; ++i) {
      std::vector<double> o(std::size_t(E), 0.0);
      for (std::int64_t h = 0; h < heads; ++h) {
        std::vector<double> s(std::size_t(L), -INFINITY);
        double mx = -INFINITY;
        for (std::int64_t j = 0; j < L; ++j) {
          if (!mask.empty() && mask[n * L + j]) continue;
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d) dot += at(n, i, h * D + d) * at(n, j, E + h * D + d);
          s[std::size_t(j)] = dot / std::sqrt(double(D)) + mask_term(attn, n, h, i, j);
          mx = test_support::max_keeping_nan(mx, s[std::size_t(j)]);
        }
        double z = 0;
        for (auto& v : s) z += v = std::isinf(v) ? 0.0 : std::exp(v - mx);
        for (std::int64_t j = 0; j < L; ++j)
          for (std::int64_t d = 0; d < D; ++d)
            o[std::size_t(h * D + d)] += z > 0 ? s[std::size_t(j)] / z * at(n, j, 2 * E + h * D + d) : 0.0;
      }
      for (std::int64_t c = 0; c < E; ++c) {
        double s = bo[std::size_t(c)];
        for (std::int64_t e = 0; e < E; ++e) s += wo[std::size_t(c * E + e)] * o[std::size_t(e)];
        y[std::size_t(row(n, i) * E + c)] = s;
      }
    }
  return y;
}

// Biases start at zero and LayerNorm weights at one (torch's init); move them
// so tests see them.
template <class Owner>
void randomise_biases(Owner& owner) {
  for (const auto& e : owner.layout().entries) {
    const bool norm_weight = e.name.find("norm") != std::string::npos && e.name.ends_with("weight");
    if (!e.name.ends_with("bias") && !norm_weight) continue;
    auto r = gradcheck::random_tensor(e.shape, fnv1a(e.name), 0.5);
    auto v = owner.value(e.name);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = (norm_weight ? 1.0 : 0.0) + r[std::int64_t(i)];
  }
}

// torch's TransformerEncoderLayer in evaluation (no dropout), in plain loops.
std::vector<double> reference_encoder(Replicated<double, TransformerEncoderLayer<double>>& p, const Tensor<double>& x,
                                      const transformer_encoder_options& o, const Tensor<std::uint8_t>& mask,
                                      const attn_mask& attn = {}) {
  using vec = std::vector<double>;
  const std::int64_t E = o.d_model, F = o.dim_feedforward, R = x.numel() / E;
  auto norm = [&](const std::string& name, const vec& v) {
    auto w = p.value(name + ".weight"), b = p.value(name + ".bias");
    vec y(v.size());
    for (std::int64_t r = 0; r < R; ++r) {
      double mean = 0, var = 0;
      for (std::int64_t e = 0; e < E; ++e) mean += v[std::size_t(r * E + e)] / double(E);
      for (std::int64_t e = 0; e < E; ++e) var += std::pow(v[std::size_t(r * E + e)] - mean, 2) / double(E);
      for (std::int64_t e = 0; e < E; ++e)
        y[std::size_t(r * E + e)] =
            (v[std::size_t(r * E + e)] - mean) / std::sqrt(var + o.layer_norm_eps) * w[std::size_t(e)] + b[std::size_t(e)];
    }
    return y;
  };
  auto attention = [&](const vec& v) {
    Tensor<double> t(x.shape());
    std::copy(v.begin(), v.end(), t.data());
    return reference_attention([&](std::string_view n) { return p.value(cat("self_attn.", n)); }, t, o.nhead,
                               o.batch_first, mask, attn);
  };
  auto feedforward = [&](const vec& v) {
    auto w1 = p.value("linear1.weight"), b1 = p.value("linear1.bias");
    auto w2 = p.value("linear2.weight"), b2 = p.value("linear2.bias");
    vec y(v.size()), hidden(static_cast<std::size_t>(F));
    for (std::int64_t r = 0; r < R; ++r) {
      for (std::int64_t f = 0; f < F; ++f) {
        double a = b1[std::size_t(f)];
        for (std::int64_t e = 0; e < E; ++e) a += w1[std::size_t(f * E + e)] * v[std::size_t(r * E + e)];
        hidden[std::size_t(f)] = o.activation == transformer_activation::relu ? std::max(a, 0.0)
                                                                             : 0.5 * a * (1 + std::erf(a / std::sqrt(2.0)));
      }
      for (std::int64_t e = 0; e < E; ++e) {
        double a = b2[std::size_t(e)];
        for (std::int64_t f = 0; f < F; ++f) a += w2[std::size_t(e * F + f)] * hidden[std::size_t(f)];
        y[std::size_t(r * E + e)] = a;
      }
    }
    return y;
  };
  auto add = [](vec a, const vec& b) {
    for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    return a;
  };
  vec v(x.span().begin(), x.span().end());
  if (o.norm_first) {
    v = add(v, attention(norm("norm1", v)));
    return add(v, feedforward(norm("norm2", v)));
  }
  v = norm("norm1", add(v, attention(v)));
  return norm("norm2", add(v, feedforward(v)));
}

}  // namespace

TEST_CASE("MultiheadAttention models Composite", "[nn][attention][concepts]") {
  STATIC_REQUIRE(check_layer<MultiheadAttention<float>>());
  STATIC_REQUIRE(Composite<MultiheadAttention<double>>);
  STATIC_REQUIRE(Layer<with_mask<MultiheadAttention<double>>>);
}

TEST_CASE("MultiheadAttention has torch's parameter names, shapes and init", "[nn][attention][init]") {
  MultiheadAttention<float> m({.embed_dim = 8, .num_heads = 2});
  Replicated<float, MultiheadAttention<float>> owner(m, 3);
  CHECK(names_and_shapes(owner.layout()) == std::vector<std::string>{"in_proj_weight[24, 8]", "in_proj_bias[24]",
                                                                     "out_proj.weight[8, 8]", "out_proj.bias[8]"});
  for (float v : owner.value("in_proj_bias")) CHECK(v == 0);
  for (float v : owner.value("out_proj.bias")) CHECK(v == 0);
  auto w = owner.value("in_proj_weight");
  const float xavier = std::sqrt(6.0f / (8 + 24));
  // the largest, NaN if any is (max_element would skip a NaN past the first element)
  const double top = std::accumulate(w.begin(), w.end(), double(-INFINITY), test_support::max_keeping_nan);
  CHECK(top <= xavier);
  CHECK(top > 0.8f * xavier);  // spans the range, not Linear's 1/sqrt(8)
  for (float v : owner.value("out_proj.weight")) CHECK(std::abs(v) <= 1 / std::sqrt(8.0f));

  std::vector<std::string> children;
  m.children([&](std::string_view name, auto&) { children.emplace_back(name); });
  CHECK(children == std::vector<std::string>{"out_proj"});

  MultiheadAttention<float> nobias({.embed_dim = 6, .num_heads = 3, .bias = false});
  Replicated<float, MultiheadAttention<float>> o2(nobias, 3);
  CHECK(names_and_shapes(o2.layout()) == std::vector<std::string>{"in_proj_weight[18, 6]", "out_proj.weight[6, 6]"});
}

TEST_CASE("MultiheadAttention forward matches a naive reference", "[nn][attention]") {
  const std::int64_t L = 5, N = 3, E = 8, H = 2;
  for (bool batch_first : {false, true})
    for (bool masked : {false, true}) {
      INFO("batch_first " << batch_first << ", masked " << masked);
      MultiheadAttention<double> m({.embed_dim = E, .num_heads = H, .batch_first = batch_first});
      Replicated<double, MultiheadAttention<double>> owner(m, 11);
      randomise_biases(owner);
      const auto x = gradcheck::random_tensor(batch_first ? Shape{N, L, E} : Shape{L, N, E}, 4);
      context ctx({.training = false});
      if (masked) ctx.set_key_padding_mask(padding_mask(N, L, {5, 2, 0}));  // the last sees no keys
      const auto y = m.forward(ctx, x);
      REQUIRE(y.shape() == x.shape());
      const auto want = reference_attention([&](std::string_view p) { return owner.value(p); }, x, H, batch_first,
                                            ctx.key_padding_mask());
      test_support::max_error worst;  // NaN and infinities count as +inf
      for (std::int64_t i = 0; i < y.numel(); ++i) worst.absolute(y[i], want[std::size_t(i)]);
      CHECK(worst < 1e-12);
      if (masked)  // all keys masked: zero weights, so the output is out_proj.bias
        for (std::int64_t l = 0; l < L; ++l)
          for (std::int64_t e = 0; e < E; ++e)
            CHECK(y[(batch_first ? 2 * L + l : l * N + 2) * E + e] == owner.value("out_proj.bias")[std::size_t(e)]);
    }
}

TEST_CASE("MultiheadAttention applies the context's attention mask as torch's attn_mask", "[nn][attention]") {
  const std::int64_t L = 5, N = 3, E = 8, H = 2;
  auto forbidding_a_row = Tensor<std::uint8_t>::zeros({N, 1, L, L});  // batch element 1's query 2 sees no key
  for (std::int64_t i = 0; i < forbidding_a_row.numel(); ++i) forbidding_a_row[i] = (i * 7) % 5 != 0;
  for (std::int64_t j = 0; j < L; ++j) forbidding_a_row[(1 * L + 2) * L + j] = 0;
  const std::vector<std::pair<const char*, attn_mask>> masks{
      {"causal [L, L]", {causal_mask(L), {}}},
      {"boolean [N, 1, L, L]", {forbidding_a_row, {}}},
      {"additive [N, H, L, L]", {{}, additive_mask({N, H, L, L}, 3)}},
      {"additive [L, L]", {{}, additive_mask({L, L}, 5)}},
  };
  for (const auto& [what, attn] : masks)
    for (bool batch_first : {false, true})
      for (bool padded : {false, true}) {
        INFO(what << ", batch_first " << batch_first << ", padded " << padded);
        MultiheadAttention<double> m({.embed_dim = E, .num_heads = H, .batch_first = batch_first});
        Replicated<double, MultiheadAttention<double>> owner(m, 11);
        randomise_biases(owner);
        const auto x = gradcheck::random_tensor(batch_first ? Shape{N, L, E} : Shape{L, N, E}, 4);
        context ctx({.training = false});
        if (padded) ctx.set_key_padding_mask(padding_mask(N, L, {5, 3, 4}));
        const auto plain = m.forward(ctx, x);
        if (!attn.allowed.empty()) ctx.set_attention_mask(attn.allowed);
        else ctx.set_attention_mask(attn.bias);
        const auto y = m.forward(ctx, x);
        const auto want = reference_attention([&](std::string_view p) { return owner.value(p); }, x, H, batch_first,
                                              ctx.key_padding_mask(), attn);
        test_support::max_error worst, moved;  // NaN and infinities count as +inf
        for (std::int64_t i = 0; i < y.numel(); ++i) {
          worst.absolute(y[i], want[std::size_t(i)]);
          moved.absolute(y[i], plain[i]);
        }
        CHECK(worst < 1e-12);
        CHECK(moved.value() > 1e-3);  // the mask changed the output
      }
}

TEST_CASE("MultiheadAttention batch_first is the transpose of sequence first", "[nn][attention]") {
  const std::int64_t L = 4, N = 2, E = 6;
  MultiheadAttention<double> seq({.embed_dim = E, .num_heads = 3}), bat({.embed_dim = E, .num_heads = 3, .batch_first = true});
  Replicated<double, MultiheadAttention<double>> o1(seq, 5), o2(bat, 5);  // same seed, same names: same values
  const auto x = gradcheck::random_tensor({L, N, E}, 8);
  Tensor<double> xt({N, L, E});
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t e = 0; e < E; ++e) xt[(n * L + l) * E + e] = x[(l * N + n) * E + e];
  context ctx;
  const auto y = seq.forward(ctx, x), yt = bat.forward(ctx, xt);
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t e = 0; e < E; ++e) CHECK(yt[(n * L + l) * E + e] == Approx(y[(l * N + n) * E + e]).epsilon(1e-12));
}

TEST_CASE("MultiheadAttention dropout acts on the weights in training only", "[nn][attention][dropout]") {
  const std::int64_t L = 6, N = 2, E = 4;
  MultiheadAttention<double> plain({.embed_dim = E, .num_heads = 2}), drop({.embed_dim = E, .num_heads = 2, .dropout = 0.5});
  Replicated<double, MultiheadAttention<double>> o1(plain, 2), o2(drop, 2);
  const auto x = gradcheck::random_tensor({L, N, E}, 3);
  context eval({.training = false}), train({.training = true, .seed = 9});
  const auto y0 = plain.forward(eval, x), y_eval = drop.forward(eval, x);
  train.set_step(0);
  const auto y1 = drop.forward(train, x);
  train.set_step(0);
  const auto y1_again = drop.forward(train, x);
  train.set_step(1);
  const auto y2 = drop.forward(train, x);
  int differs = 0, steps_differ = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    CHECK(y_eval[i] == y0[i]);      // eval: no dropout
    CHECK(y1_again[i] == y1[i]);    // the same (seed, step): the same mask
    differs += y1[i] != y0[i];
    steps_differ += y2[i] != y1[i];
  }
  CHECK(differs > x.numel() / 2);
  CHECK(steps_differ > x.numel() / 2);
}

TEST_CASE("MultiheadAttention dropout 1 drops every weight", "[nn][attention][dropout]") {
  // torch and nn::Dropout allow p = 1: the attention output is zero, so y is
  // out_proj.bias alone and no gradient reaches x or in_proj.
  const std::int64_t L = 3, N = 2, E = 4;
  MultiheadAttention<double> m({.embed_dim = E, .num_heads = 2, .dropout = 1});
  Replicated<double, MultiheadAttention<double>> owner(m, 2);
  randomise_biases(owner);
  context train({.training = true, .seed = 9});
  const auto y = m.forward(train, gradcheck::random_tensor({L, N, E}, 3));
  for (std::int64_t i = 0; i < y.numel(); ++i) CHECK(y[i] == owner.value("out_proj.bias")[std::size_t(i % E)]);
  const auto dx = m.backward(train, gradcheck::random_tensor({L, N, E}, 4));
  for (std::int64_t i = 0; i < dx.numel(); ++i) CHECK(dx[i] == 0);
  for (const char* p : {"in_proj_weight", "in_proj_bias", "out_proj.weight"})
    for (double g : owner.grad(p)) CHECK(g == 0);
}

TEST_CASE("MultiheadAttention backward matches finite differences", "[nn][attention][gradcheck]") {
  const std::int64_t L = 5, N = 3, E = 8, H = 2;
  struct variant {
    const char* name;
    bool batch_first;
    bool masked;
    double dropout;
  };
  for (const variant v : {variant{"sequence first", false, false, 0.0}, variant{"batch first", true, false, 0.0},
                          variant{"sequence first, mask", false, true, 0.0}, variant{"batch first, mask", true, true, 0.0},
                          variant{"dropout 0.3", false, false, 0.3}, variant{"batch first, mask, dropout 0.3", true, true, 0.3}}) {
    INFO(v.name);
    with_mask<MultiheadAttention<double>> m{
        MultiheadAttention<double>({.embed_dim = E, .num_heads = H, .dropout = v.dropout, .batch_first = v.batch_first}),
        v.masked ? padding_mask(N, L, {3, 5, 0}) : Tensor<std::uint8_t>{}};
    auto r = gradcheck::check(m, gradcheck::random_tensor(v.batch_first ? Shape{N, L, E} : Shape{L, N, E}, 6));
    INFO("worst: " << r.worst);
    CHECK(r.max_rel_error < 1e-6);
    CHECK(r.compared > 100);
  }
  for (bool additive : {false, true}) {  // attention masks, with key padding and dropout
    INFO((additive ? "additive [N, H, L, L]" : "causal [L, L]") << " attention mask");
    with_mask<MultiheadAttention<double>> m{
        MultiheadAttention<double>({.embed_dim = E, .num_heads = H, .dropout = 0.3, .batch_first = true}),
        padding_mask(N, L, {3, 5, 4}), additive ? attn_mask{{}, additive_mask({N, H, L, L}, 9)}
                                                : attn_mask{causal_mask(L), {}}};
    auto r = gradcheck::check(m, gradcheck::random_tensor(Shape{N, L, E}, 6));
    INFO("worst: " << r.worst);
    CHECK(r.max_rel_error < 1e-6);
    CHECK(r.compared > 100);
  }
  MultiheadAttention<double> nobias({.embed_dim = 6, .num_heads = 1, .bias = false});
  auto r = gradcheck::check(nobias, gradcheck::random_tensor({4, 2, 6}, 7));
  INFO("no bias, one head; worst: " << r.worst);
  CHECK(r.max_rel_error < 1e-6);
}

TEST_CASE("MultiheadAttention names what is wrong with a shape", "[nn][attention][errors]") {
  CHECK_THROWS_AS(MultiheadAttention<float>({.embed_dim = 10, .num_heads = 3}), shape_error);
  CHECK_THROWS_WITH(MultiheadAttention<float>({.embed_dim = 10, .num_heads = 3}),
                    Catch::Contains("embed_dim (10) must be a positive multiple of num_heads (3)"));
  CHECK_THROWS_WITH(MultiheadAttention<float>({.embed_dim = 8, .num_heads = 0}),
                    Catch::Contains("embed_dim (8) must be a positive multiple of num_heads (0)"));

  MultiheadAttention<float> m({.embed_dim = 8, .num_heads = 2});
  Replicated<float, MultiheadAttention<float>> owner(m, 0);
  context ctx;
  CHECK_THROWS_WITH(m.forward(ctx, Tensor<float>({5, 2, 7})),
                    Catch::Contains("MultiheadAttention(embed_dim 8, num_heads 2): input must be [L, N, 8] "
                                    "(sequence first), got shape [5, 2, 7]"));
  CHECK_THROWS_WITH(m.forward(ctx, Tensor<float>({10, 8})), Catch::Contains("got shape [10, 8]"));
  ctx.set_key_padding_mask(Tensor<std::uint8_t>({5, 2}));
  CHECK_THROWS_WITH(m.forward(ctx, Tensor<float>::zeros({5, 2, 8})),
                    Catch::Contains("key_padding_mask must be [N, L] = [2, 5] (batch, keys), got [5, 2]"));
  CHECK_THROWS_WITH(m.backward(ctx, Tensor<float>({5, 2, 8})), Catch::Contains("backward needs the gradient"));

  // A bad attention mask raises before the forward changes anything: the last
  // forward's backward still gives its own gradient.
  ctx.set_key_padding_mask({});
  const auto x = gradcheck::random_tensor({5, 2, 8}, 1), dy = gradcheck::random_tensor({5, 2, 8}, 2);
  Tensor<float> xf({5, 2, 8}), dyf({5, 2, 8});
  for (std::int64_t i = 0; i < x.numel(); ++i) xf[i] = float(x[i]), dyf[i] = float(dy[i]);
  m.forward(ctx, xf);
  const auto want = m.backward(ctx, dyf);
  m.forward(ctx, xf);
  ctx.set_attention_mask(Tensor<float>::zeros({5, 4}));
  CHECK_THROWS_WITH(m.forward(ctx, Tensor<float>::zeros({3, 2, 8})),
                    Catch::Contains("MultiheadAttention(embed_dim 8, num_heads 2): the attention mask must broadcast "
                                    "to [batch, heads, queries, keys] = [2, 2, 3, 3] (rank 2 to 4, each dimension "
                                    "equal or 1), got [5, 4]"));
  // A context whose attention mask holds both kinds (nn::context's setters cannot make
  // one) is refused before the forward too.
  struct both_kinds : context {
    attn_mask both{Tensor<std::uint8_t>::zeros({3, 3}), Tensor<float>::zeros({3, 3})};
    const attn_mask& attention_mask() const { return both; }
  } odd;
  CHECK_THROWS_WITH(m.forward(odd, Tensor<float>::zeros({3, 2, 8})),
                    Catch::Contains("num_heads 2): the attention mask is either boolean or additive, not both"));
  owner.zero_grad();
  const auto got = m.backward(ctx, dyf);
  REQUIRE(got.shape() == want.shape());
  for (std::int64_t i = 0; i < got.numel(); ++i) CHECK(got[i] == want[i]);
  ctx.clear_attention_mask();

  MultiheadAttention<float> bf({.embed_dim = 8, .num_heads = 2, .batch_first = true});
  Replicated<float, MultiheadAttention<float>> o2(bf, 0);
  CHECK_THROWS_WITH(bf.forward(ctx, Tensor<float>({2, 5, 4})), Catch::Contains("input must be [N, L, 8] (batch first)"));
}

TEST_CASE("TransformerEncoderLayer models Composite, alone and stacked", "[nn][attention][transformer][concepts]") {
  STATIC_REQUIRE(check_layer<TransformerEncoderLayer<float>>());
  STATIC_REQUIRE(Composite<TransformerEncoderLayer<double>>);
  STATIC_REQUIRE(Composite<Stack<TransformerEncoderLayer<float>>>);
  STATIC_REQUIRE(std::constructible_from<TransformerEncoderLayer<float>, transformer_encoder_options>);
}

TEST_CASE("TransformerEncoderLayer has torch's defaults, names and shapes", "[nn][attention][transformer][init]") {
  const transformer_encoder_options defaults;
  CHECK(defaults.dim_feedforward == 2048);
  CHECK(defaults.dropout == 0.1);
  CHECK(defaults.activation == transformer_activation::relu);
  CHECK(defaults.layer_norm_eps == 1e-5);
  CHECK_FALSE(defaults.batch_first);
  CHECK_FALSE(defaults.norm_first);

  TransformerEncoderLayer<float> layer({.d_model = 8, .nhead = 2, .dim_feedforward = 16});
  Replicated<float, TransformerEncoderLayer<float>> owner(layer, 1);
  CHECK(names_and_shapes(owner.layout()) ==
        std::vector<std::string>{"self_attn.in_proj_weight[24, 8]", "self_attn.in_proj_bias[24]",
                                 "self_attn.out_proj.weight[8, 8]", "self_attn.out_proj.bias[8]", "linear1.weight[16, 8]",
                                 "linear1.bias[16]", "linear2.weight[8, 16]", "linear2.bias[8]", "norm1.weight[8]",
                                 "norm1.bias[8]", "norm2.weight[8]", "norm2.bias[8]"});
  for (float v : owner.value("norm1.weight")) CHECK(v == 1);
  for (float v : owner.value("self_attn.out_proj.bias")) CHECK(v == 0);
  std::vector<std::string> children;
  layer.children([&](std::string_view name, auto&) { children.emplace_back(name); });
  CHECK(children == std::vector<std::string>{"self_attn", "linear1", "dropout", "linear2", "norm1", "norm2", "dropout1",
                                             "dropout2"});

  Stack<TransformerEncoderLayer<float>> stack(3, transformer_encoder_options{.d_model = 8, .nhead = 2, .dim_feedforward = 16});
  Replicated<float, Stack<TransformerEncoderLayer<float>>> o3(stack, 1);
  CHECK(o3.layout().entries.size() == 36);
  CHECK(o3.layout().entries.back().name == "layers.2.norm2.bias");
  CHECK(parameter_count(stack) == 3 * (24 * 8 + 24 + 8 * 8 + 8 + 16 * 8 + 16 + 8 * 16 + 8 + 4 * 8));
}

TEST_CASE("TransformerEncoderLayer forward matches a naive reference", "[nn][attention][transformer]") {
  const std::int64_t L = 4, N = 3, E = 8;
  for (bool norm_first : {false, true})
    for (auto act : {transformer_activation::relu, transformer_activation::gelu})
      for (bool batch_first : {false, true}) {
        const transformer_encoder_options o{.d_model = E, .nhead = 2, .dim_feedforward = 12, .dropout = 0.3,
                                            .activation = act, .batch_first = batch_first, .norm_first = norm_first};
        INFO("norm_first " << norm_first << ", gelu " << (act == transformer_activation::gelu) << ", batch_first "
                           << batch_first);
        TransformerEncoderLayer<double> layer(o);
        Replicated<double, TransformerEncoderLayer<double>> owner(layer, 21);
        randomise_biases(owner);
        const auto x = gradcheck::random_tensor(batch_first ? Shape{N, L, E} : Shape{L, N, E}, 5, 2.0);
        context ctx({.training = false});  // dropout is the identity
        ctx.set_key_padding_mask(padding_mask(N, L, {4, 1, 3}));
        for (bool causal : {false, true}) {  // the attention mask reaches self_attn through the context
          INFO("causal " << causal);
          if (causal) ctx.set_attention_mask(causal_mask(L));
          const auto y = layer.forward(ctx, x);
          const auto want = reference_encoder(owner, x, o, ctx.key_padding_mask(), ctx.attention_mask());
          REQUIRE(y.shape() == x.shape());
          test_support::max_error worst;  // NaN and infinities count as +inf
          for (std::int64_t i = 0; i < y.numel(); ++i) worst.absolute(y[i], want[std::size_t(i)]);
          CHECK(worst < 1e-12);
        }
      }
}

TEST_CASE("TransformerEncoderLayer applies dropout in training only", "[nn][attention][transformer][dropout]") {
  TransformerEncoderLayer<double> layer({.d_model = 8, .nhead = 2, .dim_feedforward = 12, .dropout = 0.2});
  Replicated<double, TransformerEncoderLayer<double>> owner(layer, 4);
  const auto x = gradcheck::random_tensor({4, 2, 8}, 6);
  context eval({.training = false}), train({.training = true, .seed = 3});
  const auto y0 = layer.forward(eval, x);
  train.set_step(0);
  const auto y1 = layer.forward(train, x);
  train.set_step(0);
  const auto y1_again = layer.forward(train, x);
  int differs = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    CHECK(y1_again[i] == y1[i]);
    differs += y1[i] != y0[i];
  }
  CHECK(differs > x.numel() / 2);
  const auto want = reference_encoder(owner, x, {.d_model = 8, .nhead = 2, .dim_feedforward = 12}, {});
  for (std::int64_t i = 0; i < x.numel(); ++i) CHECK(y0[i] == Approx(want[std::size_t(i)]).epsilon(1e-12));
}

TEST_CASE("TransformerEncoderLayer backward matches finite differences", "[nn][attention][transformer][gradcheck]") {
  const std::int64_t L = 4, N = 3, E = 8;
  for (bool norm_first : {false, true})
    for (auto act : {transformer_activation::relu, transformer_activation::gelu})
      for (double p : {0.0, 0.2}) {
        const bool batch_first = p > 0 && norm_first;  // vary the layout and the mask too
        INFO("norm_first " << norm_first << ", gelu " << (act == transformer_activation::gelu) << ", dropout " << p
                           << ", batch_first and masked " << batch_first);
        with_mask<TransformerEncoderLayer<double>> m{
            TransformerEncoderLayer<double>({.d_model = E, .nhead = 2, .dim_feedforward = 12, .dropout = p,
                                             .activation = act, .batch_first = batch_first, .norm_first = norm_first}),
            batch_first ? padding_mask(N, L, {2, 4, 3}) : Tensor<std::uint8_t>{}};
        auto r = gradcheck::check(m, gradcheck::random_tensor(batch_first ? Shape{N, L, E} : Shape{L, N, E}, 9));
        INFO("worst: " << r.worst);
        CHECK(r.max_rel_error < 1e-6);
        CHECK(r.compared > 300);
      }
  Stack<TransformerEncoderLayer<double>> stack(
      2, transformer_encoder_options{.d_model = E, .nhead = 4, .dim_feedforward = 16, .dropout = 0.1, .norm_first = true});
  auto r = gradcheck::check(stack, gradcheck::random_tensor({L, N, E}, 10));
  INFO("stack of two; worst: " << r.worst);
  CHECK(r.max_rel_error < 1e-6);
}

TEST_CASE("TransformerEncoderLayer names what is wrong with a shape", "[nn][attention][transformer][errors]") {
  CHECK_THROWS_WITH(TransformerEncoderLayer<float>({.d_model = 10, .nhead = 3}),
                    Catch::Contains("TransformerEncoderLayer: d_model (10) must be a positive multiple of nhead (3)"));
  CHECK_THROWS_WITH(TransformerEncoderLayer<float>({.d_model = 8, .nhead = 2, .dim_feedforward = 0}),
                    Catch::Contains("dim_feedforward must be positive, got 0"));
  for (bool norm_first : {false, true}) {
    TransformerEncoderLayer<float> layer({.d_model = 8, .nhead = 2, .dim_feedforward = 16, .norm_first = norm_first});
    Replicated<float, TransformerEncoderLayer<float>> owner(layer, 0);
    context ctx;
    CHECK_THROWS_WITH(layer.forward(ctx, Tensor<float>({5, 2, 6})),
                      Catch::Contains("TransformerEncoderLayer(d_model 8, nhead 2): input must be [L, N, 8] "
                                      "(sequence first), got shape [5, 2, 6]"));
    ctx.set_key_padding_mask(Tensor<std::uint8_t>({2, 4}));
    CHECK_THROWS_WITH(layer.forward(ctx, Tensor<float>::zeros({5, 2, 8})),
                      Catch::Contains("key_padding_mask must be [N, L] = [2, 5] (batch, keys), got [2, 4]"));
  }
}

}  // namespace test_attention
