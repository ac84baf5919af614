// Decoder attention: scaled dot-product attention with causal, boolean, additive
// and key-padding masks and grouped-query attention, rotary embeddings, GPT-2's
// and LLaMA's attention layers (Hugging Face's names), the KV cache, against
// naive float64 loops, finite differences and PyTorch's goldens.
#include "shardlib/comm/launch.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/gpt2_attention.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/llama_attention.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/rotary.hpp"
#include "shardlib/nn/sdpa.hpp"
#include "shardlib/shard/sharded_model.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numbers>
#include <span>
#include <string>
#include <vector>

#include "support/compare.hpp"
#include "support/golden.hpp"
#include "support/gradcheck.hpp"
#include "support/shard_fixture.hpp"

namespace test_decoder_attention {

using namespace shardlib;
using namespace shardlib::nn;

namespace {

using vec = std::vector<double>;
constexpr double inf = std::numeric_limits<double>::infinity();

// Runs its layer with the masks in the context, so gradcheck (which makes its
// own plain context) sees them on every evaluation.
template <class L>
struct with_masks {
  using input = typename L::input;
  using output = typename L::output;
  L inner;
  Tensor<std::uint8_t> padding;
  attn_mask mask;
  Tensor<std::int64_t> positions{};  // the context's position ids, empty for 0, 1, ...

  template <class V>
  void parameters(V&& v) { inner.parameters(v); }
  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    ctx.set_key_padding_mask(padding);
    if (!mask.allowed.empty()) ctx.set_attention_mask(mask.allowed);
    if (!mask.bias.empty()) ctx.set_attention_mask(mask.bias);
    ctx.set_position_ids(positions);
    return ctx.forward(inner, x);
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) { return ctx.backward(inner, dy); }
};

// [n, keys]: the keys at and after lengths[b] of sample b are padding.
Tensor<std::uint8_t> right_padding(std::int64_t n, std::int64_t keys, const std::vector<std::int64_t>& lengths) {
  auto m = Tensor<std::uint8_t>::zeros({n, keys});
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t j = lengths[std::size_t(b)]; j < keys; ++j) m[b * keys + j] = 1;
  return m;
}

// Random additive mask values in [-1, 1] with -inf at every `every`-th entry.
Tensor<float> random_bias(Shape s, std::uint64_t stream, int every) {
  const auto r = gradcheck::random_tensor(s, stream);
  Tensor<float> t(s);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = i % every == 1 ? -INFINITY : float(r[i]);
  return t;
}
Tensor<std::uint8_t> random_allowed(Shape s, std::uint64_t stream) {
  const auto r = gradcheck::random_tensor(s, stream);
  Tensor<std::uint8_t> t(s);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = r[i] > -0.5;  // a quarter forbidden
  return t;
}

// Element (n, h, i, j) of a mask of shape m broadcast to [B, H, Lq, Lk]: the
// index of each of m's dimensions (aligned on the right) is 0 where it is 1.
std::int64_t broadcast_index(const Shape& m, std::array<std::int64_t, 4> idx) {
  std::int64_t at = 0;
  for (int d = 0; d < m.rank(); ++d) at = at * m[d] + (m[d] == 1 ? 0 : idx[std::size_t(4 - m.rank() + d)]);
  return at;
}

// Attention in plain loops: q [B, H, Lq, D], k and v [B, Hkv, Lk, D], all
// contiguous; the masks, scale, causal rule and offset as o says (no dropout).
vec reference_sdpa(const vec& q, const vec& k, const vec& v, std::int64_t B, std::int64_t H, std::int64_t Hkv,
                   std::int64_t Lq, std::int64_t Lk, std::int64_t D, const sdpa_options& o) {
  vec out(std::size_t(B * H * Lq * D), 0.0);
  const double scale = o.scale != 0 ? o.scale : 1 / std::sqrt(double(D));
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Lq; ++i) {
        const std::int64_t g = h / (H / Hkv);
        vec s(std::size_t(Lk), -inf);
        double mx = -inf;
        for (std::int64_t j = 0; j < Lk; ++j) {
          if (o.is_causal && j > i + o.query_offset) continue;
          if (!o.key_padding_mask.empty() && o.key_padding_mask[n * Lk + j]) continue;
          const std::int64_t m = o.mask.empty() ? 0 : broadcast_index(o.mask.shape(), {n, h, i, j});
          if (!o.mask.allowed.empty() && !o.mask.allowed[m]) continue;
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d)
            dot += q[std::size_t(((n * H + h) * Lq + i) * D + d)] * k[std::size_t(((n * Hkv + g) * Lk + j) * D + d)];
          s[std::size_t(j)] = dot * scale + (o.mask.bias.empty() ? 0.0 : double(o.mask.bias[m]));
          mx = test_support::max_keeping_nan(mx, s[std::size_t(j)]);
        }
        if (mx == -inf) continue;  // no key: zeros
        double z = 0;
        for (auto& e : s) z += e = e == -inf ? 0.0 : std::exp(e - mx);
        for (std::int64_t j = 0; j < Lk; ++j)
          for (std::int64_t d = 0; d < D; ++d)
            out[std::size_t(((n * H + h) * Lq + i) * D + d)] +=
                s[std::size_t(j)] / z * v[std::size_t(((n * Hkv + g) * Lk + j) * D + d)];
      }
  return out;
}

// x [rows, in] W^T + b, W [out, in]; b may be empty.
vec reference_linear(const vec& x, std::span<const double> w, std::span<const double> b, std::int64_t in,
                     std::int64_t out) {
  const std::int64_t rows = std::int64_t(x.size()) / in;
  vec y(std::size_t(rows * out));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < out; ++c) {
      double s = b.empty() ? 0.0 : b[std::size_t(c)];
      for (std::int64_t e = 0; e < in; ++e) s += w[std::size_t(c * in + e)] * x[std::size_t(r * in + e)];
      y[std::size_t(r * out + c)] = s;
    }
  return y;
}

// Columns [c0, c0 + H D) of rows [B, L, width] as [B, H, L, D], and back.
vec split_heads(const vec& rows, std::int64_t B, std::int64_t L, std::int64_t width, std::int64_t c0, std::int64_t H,
                std::int64_t D) {
  vec t(std::size_t(B * H * L * D));
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t d = 0; d < D; ++d)
          t[std::size_t(((n * H + h) * L + l) * D + d)] = rows[std::size_t((n * L + l) * width + c0 + h * D + d)];
  return t;
}
vec merge_heads(const vec& t, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t D) {
  vec rows(std::size_t(B * L * H * D));
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t d = 0; d < D; ++d)
          rows[std::size_t((n * L + l) * H * D + h * D + d)] = t[std::size_t(((n * H + h) * L + l) * D + d)];
  return rows;
}

// RoPE's frequencies for head_dim D, written as Hugging Face's rope_init_fn
// computes them: the base frequencies, then for llama3 a where() over wavelengths
// (divided by factor beyond the low-frequency wavelength, blended between the two
// thresholds), for linear a division by factor.
vec reference_frequencies(std::int64_t D, double base, const rope_scaling& r = {}) {
  vec f;
  for (std::int64_t i = 0; 2 * i < D; ++i) f.push_back(1.0 / std::pow(base, double(2 * i) / double(D)));
  if (r.type == rope_scaling::kind::linear)
    for (double& v : f) v /= r.factor;
  if (r.type != rope_scaling::kind::llama3) return f;
  const double old_len = double(r.original_max_position_embeddings);
  const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
  for (double& v : f) {
    const double wavelen = 2 * std::numbers::pi / v;
    const double scaled = wavelen > low_wavelen ? v / r.factor : v;
    const double smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
    const double smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
    const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
    v = medium ? smoothed : scaled;
  }
  return f;
}

// RoPE on [B, H, L, D] in place, positions offset.., written from the formula:
// x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
void reference_rope(vec& t, std::int64_t BH, std::int64_t L, std::int64_t D, std::int64_t offset, const vec& freq) {
  const std::int64_t half = D / 2;
  for (std::int64_t bh = 0; bh < BH; ++bh)
    for (std::int64_t l = 0; l < L; ++l) {
      double* x = t.data() + (bh * L + l) * D;
      vec rotated(static_cast<std::size_t>(D));
      for (std::int64_t d = 0; d < D; ++d) {
        const double angle = double(offset + l) * freq[std::size_t(d % half)];
        const double rot_half = d < half ? -x[d + half] : x[d - half];
        rotated[std::size_t(d)] = x[d] * std::cos(angle) + rot_half * std::sin(angle);
      }
      std::copy(rotated.begin(), rotated.end(), x);
    }
}

vec values_of(const Tensor<double>& t) { return {t.data(), t.data() + t.numel()}; }

// Biases start at zero (Hugging Face's init); move them so tests see them.
template <class Owner>
void randomise_biases(Owner& owner) {
  for (const auto& e : owner.layout().entries) {
    if (!e.name.ends_with("bias")) continue;
    auto r = gradcheck::random_tensor(e.shape, fnv1a(e.name), 0.5);
    std::copy(r.data(), r.data() + r.numel(), owner.value(e.name).begin());
  }
}

// GPT2Attention in plain loops from its parameters; x [B, L, E].
template <class Owner>
vec reference_gpt2(Owner& p, const Tensor<double>& x, std::int64_t heads, const sdpa_options& masks) {
  const std::int64_t B = x.dim(0), L = x.dim(1), E = x.dim(2), D = E / heads;
  const vec qkv = reference_linear(values_of(x), p.value("c_attn.weight"), p.value("c_attn.bias"), E, 3 * E);
  sdpa_options o = masks;
  o.is_causal = true;
  const vec a = reference_sdpa(split_heads(qkv, B, L, 3 * E, 0, heads, D), split_heads(qkv, B, L, 3 * E, E, heads, D),
                               split_heads(qkv, B, L, 3 * E, 2 * E, heads, D), B, heads, heads, L, L, D, o);
  return reference_linear(merge_heads(a, B, L, heads, D), p.value("c_proj.weight"), p.value("c_proj.bias"), E, E);
}

// RoPE on t [B, H, L, D] with token (b, l) at positions[b, l].
void reference_rope_at(vec& t, std::int64_t B, std::int64_t H, std::int64_t L, std::int64_t D,
                       const Tensor<std::int64_t>& positions, const vec& freq) {
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t l = 0; l < L; ++l) {
        const auto first = t.begin() + ((b * H + h) * L + l) * D;
        vec token(first, first + D);
        reference_rope(token, 1, 1, D, positions[b * L + l], freq);
        std::copy(token.begin(), token.end(), first);
      }
}

// LlamaAttention in plain loops from its parameters; x [B, L, hidden]; positions
// [B, L] as the context's position ids (empty: 0, 1, ...).
template <class Owner>
vec reference_llama(Owner& p, const Tensor<double>& x, const llama_attention_options& c, const sdpa_options& masks,
                    const Tensor<std::int64_t>& positions = {}) {
  const std::int64_t B = x.dim(0), L = x.dim(1), E = x.dim(2), H = c.num_attention_heads, Hkv = c.num_key_value_heads,
                     D = c.head_dim;
  auto bias = [&](const char* name) { return c.attention_bias ? p.value(name) : std::span<double>{}; };
  const vec xs = values_of(x);
  vec q = split_heads(reference_linear(xs, p.value("q_proj.weight"), bias("q_proj.bias"), E, H * D), B, L, H * D, 0, H, D);
  vec k = split_heads(reference_linear(xs, p.value("k_proj.weight"), bias("k_proj.bias"), E, Hkv * D), B, L, Hkv * D, 0,
                      Hkv, D);
  const vec v = split_heads(reference_linear(xs, p.value("v_proj.weight"), bias("v_proj.bias"), E, Hkv * D), B, L,
                            Hkv * D, 0, Hkv, D);
  const vec freq = reference_frequencies(D, c.rope_theta, c.rope_scaling);
  if (positions.empty()) {
    reference_rope(q, B * H, L, D, 0, freq);
    reference_rope(k, B * Hkv, L, D, 0, freq);
  } else {
    reference_rope_at(q, B, H, L, D, positions, freq);
    reference_rope_at(k, B, Hkv, L, D, positions, freq);
  }
  sdpa_options o = masks;
  o.is_causal = true;
  const vec a = reference_sdpa(q, k, v, B, H, Hkv, L, L, D, o);
  return reference_linear(merge_heads(a, B, L, H, D), p.value("o_proj.weight"), bias("o_proj.bias"), H * D, E);
}

std::vector<std::string> names_and_shapes(const flat_layout& f) {
  std::vector<std::string> out;
  for (const auto& e : f.entries) out.push_back(e.name + cat(e.shape));
  return out;
}

template <class L>
std::vector<std::string> child_names(L& layer) {
  std::vector<std::string> out;
  layer.children([&](std::string_view name, auto&) { out.emplace_back(name); });
  return out;
}

}  // namespace

TEST_CASE("sdpa_forward matches naive loops: causal, masks, key padding, GQA", "[nn][decoder][sdpa]") {
  const std::int64_t B = 2, H = 4, Lq = 3, Lk = 5, D = 6;
  struct variant {
    const char* name;
    std::int64_t kv_heads;
    bool causal;
    int mask;  // 0 none, 1 additive [Lq, Lk], 2 additive [B, H, Lq, Lk], 3 boolean [B, 1, Lq, Lk]
    bool padding;
  };
  for (const variant c : {variant{"plain", 4, false, 0, false}, variant{"causal, offset 2", 4, true, 0, false},
                          variant{"additive [Lq, Lk]", 4, false, 1, false}, variant{"additive [B, H, Lq, Lk]", 2, true, 2, false},
                          variant{"boolean [B, 1, Lq, Lk]", 1, false, 3, true}, variant{"key padding, causal", 2, true, 0, true},
                          variant{"GQA kv_heads 1", 1, true, 1, true}, variant{"GQA kv_heads 2", 2, false, 0, false}}) {
    INFO(c.name);
    const auto q = gradcheck::random_tensor({B, H, Lq, D}, 1, 2.0);
    const auto k = gradcheck::random_tensor({B, c.kv_heads, Lk, D}, 2, 2.0);
    const auto v = gradcheck::random_tensor({B, c.kv_heads, Lk, D}, 3);
    sdpa_options o{.is_causal = c.causal, .query_offset = 2};
    if (c.mask == 1) o.mask.bias = random_bias({Lq, Lk}, 4, 4);
    if (c.mask == 2) o.mask.bias = random_bias({B, H, Lq, Lk}, 5, 5);
    if (c.mask == 3) o.mask.allowed = random_allowed({B, 1, Lq, Lk}, 6);
    if (c.padding) o.key_padding_mask = right_padding(B, Lk, {2, 4});
    Tensor<double> out({B, H, Lq, D}), probs({B, H, Lq, Lk});
    sdpa_forward(head_view<double>::bhsd(q), head_view<double>::bhsd(k), head_view<double>::bhsd(v),
                 head_view<double>::bhsd(out), probs.data(), o);
    const vec want = reference_sdpa(values_of(q), values_of(k), values_of(v), B, H, c.kv_heads, Lq, Lk, D, o);
    test_support::max_error worst;  // NaN counts as +inf
    worst.absolute(out.span(), want);
    CHECK(worst <= 1e-13);  // double sums of a few terms of order 1
  }
}

// A host layer written for T runs in bfloat16 as in float: its -inf is a real -inf
// (std::numeric_limits<bfloat16>), so scores that are all negative are not "masked".
TEST_CASE("sdpa in bfloat16 gives the float softmax of negative scores", "[nn][decoder][sdpa]") {
  const std::int64_t B = 1, H = 1, L = 4, D = 2;
  Tensor<float> q({B, H, L, D}), k({B, H, L, D}), v({B, H, L, D});
  for (std::int64_t i = 0; i < q.numel(); ++i) {  // q.k < 0 everywhere: q > 0, k < 0
    q[i] = 0.5f + 0.25f * float(i % 3);
    k[i] = -1.0f - 0.5f * float(i % 2);
    v[i] = float(i) / 8;
  }
  const auto to16 = [](const Tensor<float>& t) {
    Tensor<bfloat16> r(t.shape());
    for (std::int64_t i = 0; i < t.numel(); ++i) r[i] = bfloat16(t[i]);
    return r;
  };
  const auto q16 = to16(q), k16 = to16(k), v16 = to16(v);
  Tensor<float> out({B, H, L, D}), probs({B, H, L, L});
  Tensor<bfloat16> out16({B, H, L, D}), probs16({B, H, L, L});
  sdpa_options o{};
  sdpa_forward(head_view<float>::bhsd(q), head_view<float>::bhsd(k), head_view<float>::bhsd(v),
               head_view<float>::bhsd(out), probs.data(), o);
  sdpa_forward(head_view<bfloat16>::bhsd(q16), head_view<bfloat16>::bhsd(k16), head_view<bfloat16>::bhsd(v16),
               head_view<bfloat16>::bhsd(out16), probs16.data(), o);
  test_support::max_error worst;  // NaN counts as +inf
  for (std::int64_t i = 0; i < probs.numel(); ++i) worst.absolute(double(probs16[i]), double(probs[i]));
  CHECK(worst <= 2e-2);  // bf16 keeps 8 bits: each probability within a few 2^-8 of float's
  for (std::int64_t r = 0; r < L; ++r) {  // rows of weights, not of zeros
    double sum = 0;
    for (std::int64_t c = 0; c < L; ++c) sum += double(probs16[r * L + c]);
    CHECK(sum == Approx(1.0).margin(2e-2));
  }
}

TEST_CASE("sdpa: a query with no key left gets zeros, not NaN", "[nn][decoder][sdpa]") {
  const std::int64_t B = 1, H = 1, L = 3, D = 2;
  const auto q = gradcheck::random_tensor({B, H, L, D}, 1), k = gradcheck::random_tensor({B, H, L, D}, 2);
  const auto v = gradcheck::random_tensor({B, H, L, D}, 3);
  // Left padding with a causal mask: query 0 sees only key 0, which is padding.
  sdpa_options o{.is_causal = true, .key_padding_mask = Tensor<std::uint8_t>::zeros({1, L})};
  o.key_padding_mask[0] = 1;
  Tensor<float> bias = Tensor<float>::zeros({L, L});
  bias[2 * L + 1] = bias[2 * L + 2] = -INFINITY;  // and query 2 loses its keys to -inf
  o.mask.bias = bias;
  Tensor<double> out({B, H, L, D}), probs({B, H, L, L});
  const auto view = head_view<double>::bhsd;
  sdpa_forward(view(q), view(k), view(v), view(out), probs.data(), o);
  for (std::int64_t d = 0; d < D; ++d) {
    CHECK(out[d] == 0.0);
    CHECK(out[2 * D + d] == 0.0);
    CHECK(out[D + d] == Approx(v[D + d]).margin(1e-15));  // query 1 sees key 1 alone
  }
  Tensor<double> dq({B, H, L, D}), dk({B, H, L, D}), dv({B, H, L, D});
  const auto dout = gradcheck::random_tensor({B, H, L, D}, 4);
  sdpa_backward(view(dout), view(q), view(k), view(v), probs.data(), view(dq), view(dk), view(dv), o);
  for (std::int64_t d = 0; d < D; ++d) CHECK(dq[d] == 0.0);
  for (const auto* t : {&dq, &dk, &dv})
    for (double e : t->span()) CHECK(std::isfinite(e));
}

TEST_CASE("rotary embeddings: Hugging Face's rotate_half layout, offsets, and the inverse", "[nn][decoder][rope]") {
  const std::int64_t B = 2, H = 3, L = 5, D = 8;
  for (const double base : {10000.0, 500000.0})
    for (const std::int64_t offset : {std::int64_t(0), std::int64_t(7)}) {
      INFO("base " << base << ", offset " << offset);
      const auto x = gradcheck::random_tensor({B, H, L, D}, 11);
      Tensor<double> y({B, H, L, D});
      std::copy(x.data(), x.data() + x.numel(), y.data());
      const rotary_table<double> table({.head_dim = D, .base = base}, offset, L);
      table.apply(head_view<double>::bhsd(y));
      vec want = values_of(x);
      reference_rope(want, B * H, L, D, offset, reference_frequencies(D, base));
      test_support::max_error worst;
      worst.absolute(y.span(), want);
      CHECK(worst <= 1e-14);
      table.apply(head_view<double>::bhsd(y), true);  // the inverse rotation
      test_support::max_error back;
      back.absolute(y.span(), x.span());
      CHECK(back <= 1e-14);
    }
  CHECK_THROWS_WITH(rotary_table<float>({.head_dim = 7}, 0, 4), Catch::Contains("head_dim must be even and positive, got 7"));

  // Position ids: token (n, l) turns by the angles of its own position (the reference
  // rotates each token alone at it), and the inverse undoes it.
  Tensor<std::int64_t> ids({B, L});
  const std::int64_t positions[] = {0, 1, 2, 3, 4, 9, 0, 0, 5, 2};
  std::copy(std::begin(positions), std::end(positions), ids.data());
  const auto x = gradcheck::random_tensor({B, H, L, D}, 12);
  Tensor<double> y({B, H, L, D});
  std::copy(x.data(), x.data() + x.numel(), y.data());
  const rotary_table<double> table({.head_dim = D}, 0, 10);
  table.apply_at(head_view<double>::bhsd(y), ids);
  vec want = values_of(x);
  const vec freq = reference_frequencies(D, 10000);
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t l = 0; l < L; ++l) {
        vec token(want.begin() + ((n * H + h) * L + l) * D, want.begin() + ((n * H + h) * L + l + 1) * D);
        reference_rope(token, 1, 1, D, ids[n * L + l], freq);
        std::copy(token.begin(), token.end(), want.begin() + ((n * H + h) * L + l) * D);
      }
  test_support::max_error at;
  at.absolute(y.span(), want);
  CHECK(at <= 1e-14);
  table.apply_at(head_view<double>::bhsd(y), ids, true);
  test_support::max_error undone;
  undone.absolute(y.span(), x.span());
  CHECK(undone <= 1e-14);
  CHECK_THROWS_WITH(rotary_table<double>({.head_dim = D}, 0, 9).apply_at(head_view<double>::bhsd(y), ids),
                    Catch::Contains("position id 9 is outside the table's positions 0..8"));
  CHECK_THROWS_WITH(table.apply_at(head_view<double>::bhsd(y), Tensor<std::int64_t>::zeros({B, L - 1})),
                    Catch::Contains("need position ids [2, 5]"));
}

TEST_CASE("rotary embeddings with rope_scaling: linear and llama3 as Hugging Face computes them", "[nn][decoder][rope]") {
  // Llama 3.1's scaling at head_dim 64 and base 500000 (its 1B/8B config), and a
  // small one where 16 frequencies fall in each of the three llama3 regimes' ranges.
  using kind = rope_scaling::kind;
  const rope_scaling llama31{.type = kind::llama3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                             .original_max_position_embeddings = 8192};
  const rope_scaling small{.type = kind::llama3, .factor = 4, .low_freq_factor = 2, .high_freq_factor = 8,
                           .original_max_position_embeddings = 256};
  const rope_scaling linear{.type = kind::linear, .factor = 2.5};
  struct variant {
    const char* name;
    std::int64_t D;
    double base;
    rope_scaling scaling;
  };
  for (const variant v : {variant{"llama 3.1", 64, 500000, llama31}, variant{"small llama3", 96, 10000, small},
                          variant{"linear", 16, 10000, linear}}) {
    INFO(v.name);
    const vec want_freq = reference_frequencies(v.D, v.base, v.scaling), plain = reference_frequencies(v.D, v.base);
    const auto got_freq = rotary_frequencies({.head_dim = v.D, .base = v.base, .scaling = v.scaling});
    REQUIRE(got_freq.size() == want_freq.size());
    test_support::max_error worst;
    worst.relative(std::span<const double>(got_freq), want_freq, 0);
    CHECK(worst <= 1e-15);
    int kept = 0, divided = 0, blended = 0;  // every regime the rule has is used
    for (std::size_t i = 0; i < plain.size(); ++i) {
      const double ratio = want_freq[i] / plain[i];
      kept += ratio == 1;
      divided += std::abs(ratio - 1 / v.scaling.factor) < 1e-15;
      blended += ratio != 1 && std::abs(ratio - 1 / v.scaling.factor) >= 1e-15;
    }
    INFO("kept " << kept << ", divided " << divided << ", blended " << blended);
    if (v.scaling.type == kind::llama3) CHECK((kept > 0 && divided > 0 && blended > 0));
    else CHECK(divided == int(plain.size()));

    const std::int64_t B = 1, H = 2, L = 9, offset = 5000;  // far positions: where the scaling matters
    const auto x = gradcheck::random_tensor({B, H, L, v.D}, 12);
    Tensor<double> y({B, H, L, v.D});
    std::copy(x.data(), x.data() + x.numel(), y.data());
    rotary_table<double>({.head_dim = v.D, .base = v.base, .scaling = v.scaling}, offset, L)
        .apply(head_view<double>::bhsd(y));
    vec want = values_of(x);
    reference_rope(want, B * H, L, v.D, offset, want_freq);
    test_support::max_error rotated;
    rotated.absolute(y.span(), want);
    CHECK(rotated <= 1e-10);  // angles up to 5008 radians: cos and sin of them agree to ~1e-12
  }
  const auto bad = [](rope_scaling r) { return rotary_table<float>({.head_dim = 8, .scaling = r}, 0, 2); };
  CHECK_THROWS_WITH(bad({.type = kind::linear, .factor = 0}), Catch::Contains("rope_scaling factor must be positive, got 0"));
  CHECK_THROWS_WITH(bad({.type = kind::llama3, .factor = 8, .low_freq_factor = 4, .high_freq_factor = 4}),
                    Catch::Contains("llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor"));
  CHECK_THROWS_WITH(LlamaAttention<float>({.hidden_size = 16, .num_attention_heads = 2,
                                           .rope_scaling = {.type = kind::linear, .factor = -1}}),
                    Catch::Contains("LlamaAttention(hidden_size 16, heads 2, kv_heads 2, head_dim 8): rope_scaling "
                                    "factor must be positive, got -1"));
}

TEST_CASE("GPT2Attention and LlamaAttention model Composite", "[nn][decoder][concepts]") {
  STATIC_REQUIRE(check_layer<GPT2Attention<float>>());
  STATIC_REQUIRE(check_layer<LlamaAttention<float>>());
  STATIC_REQUIRE(Composite<GPT2Attention<double>>);
  STATIC_REQUIRE(Composite<LlamaAttention<double>>);
  STATIC_REQUIRE(Layer<with_masks<LlamaAttention<double>>>);
}

TEST_CASE("GPT2Attention and LlamaAttention carry Hugging Face's names", "[nn][decoder][init]") {
  GPT2Attention<float> gpt2({.n_embd = 8, .n_head = 2});
  Replicated<float, GPT2Attention<float>> o1(gpt2, 1);
  CHECK(names_and_shapes(o1.layout()) == std::vector<std::string>{"c_attn.weight[24, 8]", "c_attn.bias[24]",
                                                                  "c_proj.weight[8, 8]", "c_proj.bias[8]"});
  CHECK(child_names(gpt2) == std::vector<std::string>{"c_attn", "c_proj", "resid_dropout"});
  for (float b : o1.value("c_attn.bias")) CHECK(b == 0);
  double sq = 0;
  for (float w : o1.value("c_attn.weight")) sq += double(w) * w;
  CHECK(std::sqrt(sq / 192) == Approx(0.02).epsilon(0.25));  // N(0, 0.02): 192 draws

  LlamaAttention<float> llama({.hidden_size = 8, .num_attention_heads = 4, .num_key_value_heads = 2});
  Replicated<float, LlamaAttention<float>> o2(llama, 1);
  CHECK(names_and_shapes(o2.layout()) == std::vector<std::string>{"q_proj.weight[8, 8]", "k_proj.weight[4, 8]",
                                                                  "v_proj.weight[4, 8]", "o_proj.weight[8, 8]"});
  CHECK(child_names(llama) == std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"});
  LlamaAttention<float> wide({.hidden_size = 6, .num_attention_heads = 3, .num_key_value_heads = 1, .head_dim = 4,
                              .attention_bias = true});
  Replicated<float, LlamaAttention<float>> o3(wide, 1);
  CHECK(names_and_shapes(o3.layout()) ==
        std::vector<std::string>{"q_proj.weight[12, 6]", "q_proj.bias[12]", "k_proj.weight[4, 6]", "k_proj.bias[4]",
                                 "v_proj.weight[4, 6]", "v_proj.bias[4]", "o_proj.weight[6, 12]", "o_proj.bias[6]"});
}

TEST_CASE("GPT2Attention forward matches naive loops with its masks", "[nn][decoder][gpt2]") {
  const std::int64_t B = 3, L = 5, E = 8, H = 2;
  for (int masks = 0; masks < 3; ++masks) {
    INFO("masks " << masks);  // none; key padding + additive [L, L]; boolean [B, 1, L, L]
    GPT2Attention<double> m({.n_embd = E, .n_head = H});
    Replicated<double, GPT2Attention<double>> owner(m, 3);
    randomise_biases(owner);
    const auto x = gradcheck::random_tensor({B, L, E}, 4);
    context ctx({.training = false});
    sdpa_options o;
    if (masks == 1) {
      o.key_padding_mask = right_padding(B, L, {5, 2, 0});  // the last sample has no key at all
      o.mask.bias = random_bias({L, L}, 7, 6);
      ctx.set_key_padding_mask(o.key_padding_mask);
      ctx.set_attention_mask(o.mask.bias);
    }
    if (masks == 2) {
      o.mask.allowed = random_allowed({B, 1, L, L}, 8);
      ctx.set_attention_mask(o.mask.allowed);
    }
    const auto y = ctx.forward(m, x);
    REQUIRE(y.shape() == x.shape());
    test_support::max_error worst;
    worst.absolute(y.span(), reference_gpt2(owner, x, H, o));
    CHECK(worst <= 1e-12);
  }
}

TEST_CASE("LlamaAttention forward matches naive loops: GQA and RoPE", "[nn][decoder][llama]") {
  const std::int64_t B = 2, L = 6, E = 8;
  for (const std::int64_t kv : {1, 2, 4})
    for (const bool bias : {false, true}) {
      INFO("kv_heads " << kv << ", bias " << bias);
      const llama_attention_options c{.hidden_size = E, .num_attention_heads = 4, .num_key_value_heads = kv,
                                      .head_dim = 4, .rope_theta = 1000, .attention_bias = bias};
      LlamaAttention<double> m(c);
      Replicated<double, LlamaAttention<double>> owner(m, 5);
      randomise_biases(owner);
      const auto x = gradcheck::random_tensor({B, L, E}, 6, 2.0);
      context ctx({.training = false});
      sdpa_options o{.key_padding_mask = right_padding(B, L, {6, 4})};
      ctx.set_key_padding_mask(o.key_padding_mask);
      const auto y = ctx.forward(m, x);
      test_support::max_error worst;
      worst.absolute(y.span(), reference_llama(owner, x, m.config(), o));
      CHECK(worst <= 1e-12);
      // Position ids: row 0 holds two sequences (positions restart at 0), row 1 starts at 5.
      Tensor<std::int64_t> ids({B, L});
      const std::int64_t at[] = {0, 1, 2, 0, 1, 2, 5, 6, 7, 8, 9, 10};
      std::copy(std::begin(at), std::end(at), ids.data());
      ctx.set_position_ids(ids);
      const auto y_at = ctx.forward(m, x);
      test_support::max_error at_ids;
      at_ids.absolute(y_at.span(), reference_llama(owner, x, m.config(), o, ids));
      CHECK(at_ids <= 1e-12);
      test_support::max_error moved;  // and they matter: row 0's restart is no shift
      moved.absolute(y_at.span(), y.span());
      CHECK(moved.value() > 1e-6);
      ctx.set_position_ids({});
    }
}

TEST_CASE("GPT2Attention backward matches finite differences", "[nn][decoder][gpt2][gradcheck]") {
  const std::int64_t B = 2, L = 4, E = 6;
  struct variant {
    const char* name;
    bool masks;
    double attn_pdrop, resid_pdrop;
  };
  for (const variant v : {variant{"plain", false, 0, 0}, variant{"key padding + additive mask", true, 0, 0},
                          variant{"masks, dropout 0.3 and 0.2", true, 0.3, 0.2}}) {
    INFO(v.name);
    with_masks<GPT2Attention<double>> m{
        GPT2Attention<double>({.n_embd = E, .n_head = 3, .attn_pdrop = v.attn_pdrop, .resid_pdrop = v.resid_pdrop}),
        v.masks ? right_padding(B, L, {4, 2}) : Tensor<std::uint8_t>{},
        {.allowed = {}, .bias = v.masks ? random_bias({L, L}, 9, 5) : Tensor<float>{}}};
    const auto r = gradcheck::check(m, gradcheck::random_tensor({B, L, E}, 10));
    INFO("worst: " << r.worst);
    CHECK(r.max_rel_error < 1e-6);  // central differences in double: ~1e-9 (gradcheck.hpp)
    CHECK(r.compared > 100);
  }
}

TEST_CASE("LlamaAttention backward matches finite differences", "[nn][decoder][llama][gradcheck]") {
  const std::int64_t B = 2, L = 4, E = 8;
  for (const std::int64_t kv : {1, 2, 4}) {
    INFO("kv_heads " << kv << (kv == 2 ? ", position ids" : ""));
    with_masks<LlamaAttention<double>> m{
        LlamaAttention<double>({.hidden_size = E, .num_attention_heads = 4, .num_key_value_heads = kv, .head_dim = 4,
                                .attention_bias = kv == 2, .attention_dropout = kv == 1 ? 0.25 : 0.0}),
        right_padding(B, L, {3, 4}),
        {.allowed = random_allowed({B, 4, L, L}, 12), .bias = {}}};
    if (kv == 2) {  // backward rotates back by the forward's position ids
      m.positions = Tensor<std::int64_t>({B, L});
      const std::int64_t at[] = {0, 1, 0, 1, 4, 5, 6, 7};
      std::copy(std::begin(at), std::end(at), m.positions.data());
    }
    const auto r = gradcheck::check(m, gradcheck::random_tensor({B, L, E}, 13));
    INFO("worst: " << r.worst);
    CHECK(r.max_rel_error < 1e-6);
    CHECK(r.compared > 100);
  }
}

TEST_CASE("Attention dropout acts in training only and repeats per step", "[nn][decoder][dropout]") {
  LlamaAttention<double> m({.hidden_size = 8, .num_attention_heads = 2, .attention_dropout = 0.5});
  Replicated<double, LlamaAttention<double>> owner(m, 2);
  const auto x = gradcheck::random_tensor({2, 6, 8}, 3);
  context eval({.training = false}), train({.training = true, .seed = 9});
  const auto y0 = eval.forward(m, x);
  train.set_step(0);
  const auto y1 = train.forward(m, x);
  train.set_step(0);
  const auto y1_again = train.forward(m, x);
  int differs = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    CHECK(y1_again[i] == y1[i]);
    differs += y1[i] != y0[i];
  }
  CHECK(differs > x.numel() / 2);
  test_support::max_error worst;
  worst.absolute(y0.span(), reference_llama(owner, x, m.config(), {}));
  CHECK(worst <= 1e-12);
}

// Prefill `first` positions, then decode in steps of `step`: every step's output
// equals the same rows of one full forward (to rounding: the products are the
// same sums over fewer rows).
template <class L>
void check_kv_cache(L& layer, const Tensor<double>& x, std::int64_t first, std::int64_t step,
                    const Tensor<std::uint8_t>& padding) {
  const std::int64_t B = x.dim(0), S = x.dim(1), E = x.dim(2);
  context ctx({.training = false});
  ctx.set_key_padding_mask(padding);
  layer.disable_kv_cache();
  const auto full = ctx.forward(layer, x);
  layer.enable_kv_cache(S);
  for (int round = 0; round < 2; ++round) {  // the second after reset_kv_cache()
    test_support::max_error worst;
    for (std::int64_t s0 = 0; s0 < S;) {
      const std::int64_t n = std::min(s0 == 0 ? first : step, S - s0);
      Tensor<double> part({B, n, E});
      for (std::int64_t b = 0; b < B; ++b)
        std::copy_n(x.data() + (b * S + s0) * E, n * E, part.data() + b * n * E);
      Tensor<std::uint8_t> seen({B, s0 + n});  // the mask grows with the cache
      for (std::int64_t b = 0; b < B; ++b) std::copy_n(padding.data() + b * S, s0 + n, seen.data() + b * (s0 + n));
      ctx.set_key_padding_mask(seen);
      const auto y = ctx.forward(layer, part);
      REQUIRE(y.shape() == part.shape());
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t i = 0; i < n * E; ++i) worst.absolute(y[b * n * E + i], full[(b * S + s0) * E + i]);
      s0 += n;
      CHECK(layer.kv_cache_length() == s0);
    }
    CHECK(worst <= 1e-13);
    layer.reset_kv_cache();
  }
}

TEST_CASE("KV cache: decoding step by step equals the full forward", "[nn][decoder][kvcache]") {
  const std::int64_t B = 2, S = 7;
  const auto padding = right_padding(B, S, {7, 5});
  SECTION("GPT-2") {
    GPT2Attention<double> m({.n_embd = 6, .n_head = 2});
    Replicated<double, GPT2Attention<double>> owner(m, 1);
    randomise_biases(owner);
    const auto x = gradcheck::random_tensor({B, S, 6}, 2);
    check_kv_cache(m, x, 3, 1, padding);
    check_kv_cache(m, x, 1, 2, padding);
  }
  SECTION("LLaMA, GQA") {
    LlamaAttention<double> m({.hidden_size = 8, .num_attention_heads = 4, .num_key_value_heads = 2});
    Replicated<double, LlamaAttention<double>> owner(m, 1);
    const auto x = gradcheck::random_tensor({B, S, 8}, 3);
    check_kv_cache(m, x, 4, 1, padding);
    check_kv_cache(m, x, 2, 3, padding);
  }
}

TEST_CASE("KV cache: training, backward, overflow and a new batch raise", "[nn][decoder][kvcache][errors]") {
  LlamaAttention<float> m({.hidden_size = 4, .num_attention_heads = 2});
  Replicated<float, LlamaAttention<float>> owner(m, 1);
  m.enable_kv_cache(4);
  context eval({.training = false}), train;
  CHECK_THROWS_WITH(train.forward(m, Tensor<float>::zeros({1, 2, 4})),
                    Catch::Contains("the KV cache is for inference; forward with it on needs ctx.training() false"));
  const auto y = eval.forward(m, Tensor<float>::zeros({1, 3, 4}));
  CHECK_THROWS_WITH(eval.backward(m, y), Catch::Contains("backward with the KV cache on"));
  CHECK_THROWS_WITH(eval.forward(m, Tensor<float>::zeros({1, 2, 4})),
                    Catch::Contains("the KV cache holds 4 positions (max_seq); 3 cached + 2 new exceed it"));
  CHECK_THROWS_WITH(eval.forward(m, Tensor<float>::zeros({2, 1, 4})),
                    Catch::Contains("the KV cache holds a batch of 1"));
  eval.set_key_padding_mask(Tensor<std::uint8_t>::zeros({1, 1}));  // [batch, cached + new] = [1, 4] expected
  CHECK_THROWS_WITH(eval.forward(m, Tensor<float>::zeros({1, 1, 4})),
                    Catch::Contains("key_padding_mask must be [batch, keys] = [1, 4], got [1, 1]"));
  CHECK(m.kv_cache_length() == 3);  // unchanged by the failed step
  eval.set_key_padding_mask({});
  m.reset_kv_cache();
  CHECK(eval.forward(m, Tensor<float>::zeros({2, 4, 4})).shape() == Shape{2, 4, 4});
  LlamaAttention<float> copy = m;  // a copy's cache starts empty and is its own
  CHECK(copy.kv_cache_length() == 0);
  CHECK(eval.forward(copy, Tensor<float>::zeros({2, 2, 4})).shape() == Shape{2, 2, 4});
  CHECK(copy.kv_cache_length() == 2);
  CHECK(m.kv_cache_length() == 4);
  m.disable_kv_cache();
  CHECK_THROWS_WITH(m.reset_kv_cache(), Catch::Contains("reset_kv_cache() needs enable_kv_cache(max_seq) first"));
}

TEST_CASE("Decoder attention names what is wrong with options and shapes", "[nn][decoder][errors]") {
  CHECK_THROWS_AS(LlamaAttention<float>({.hidden_size = 8, .num_attention_heads = 4, .num_key_value_heads = 3}),
                  shape_error);
  CHECK_THROWS_WITH(LlamaAttention<float>({.hidden_size = 8, .num_attention_heads = 4, .num_key_value_heads = 3}),
                    Catch::Contains("the number of heads (4) must be a positive multiple of the key/value heads (3)"));
  CHECK_THROWS_WITH(LlamaAttention<float>({.hidden_size = 8, .num_attention_heads = 2, .head_dim = 3}),
                    Catch::Contains("rotary embeddings need an even head_dim, got 3"));
  CHECK_THROWS_WITH(LlamaAttention<float>({.hidden_size = 9, .num_attention_heads = 2}),
                    Catch::Contains("hidden_size (9) must be a multiple of num_attention_heads (2) unless head_dim is given"));
  CHECK_THROWS_WITH(GPT2Attention<float>({.n_embd = 10, .n_head = 4}),
                    Catch::Contains("n_embd (10) must be a positive multiple of n_head (4)"));
  CHECK_THROWS_WITH(GPT2Attention<float>({.n_embd = 8, .n_head = 2, .attn_pdrop = 1}),
                    Catch::Contains("attention dropout must be in [0, 1), got 1"));

  GPT2Attention<float> m({.n_embd = 8, .n_head = 2});
  CHECK_THROWS_WITH(context{}.forward(m, Tensor<float>::zeros({2, 3, 8})),
                    Catch::Contains("Linear: parameter '?' has no values bound"));
  Replicated<float, GPT2Attention<float>> owner(m, 0);
  context ctx;
  CHECK_THROWS_WITH(ctx.forward(m, Tensor<float>({2, 3, 6})),
                    Catch::Contains("GPT2Attention(n_embd 8, n_head 2): input must be [batch, seq, 8], got shape [2, 3, 6]"));
  ctx.set_attention_mask(Tensor<float>::zeros({3, 4}));
  CHECK_THROWS_WITH(ctx.forward(m, Tensor<float>::zeros({2, 3, 8})),
                    Catch::Contains("GPT2Attention(n_embd 8, n_head 2): the attention mask must broadcast to "
                                    "[batch, heads, queries, keys] = [2, 2, 3, 3] (rank 2 to 4, each dimension equal "
                                    "or 1), got [3, 4]"));
  ctx.set_attention_mask(Tensor<std::uint8_t>::zeros({3, 2, 3, 3}));
  CHECK_THROWS_WITH(ctx.forward(m, Tensor<float>::zeros({2, 3, 8})), Catch::Contains("got [3, 2, 3, 3]"));
  ctx.clear_attention_mask();
  ctx.set_key_padding_mask(Tensor<std::uint8_t>::zeros({3, 2}));
  CHECK_THROWS_WITH(ctx.forward(m, Tensor<float>::zeros({2, 3, 8})),
                    Catch::Contains("key_padding_mask must be [batch, keys] = [2, 3], got [3, 2]"));
  ctx.set_key_padding_mask({});
  CHECK(ctx.forward(m, Tensor<float>::zeros({2, 3, 8})).shape() == Shape{2, 3, 8});
  CHECK_THROWS_WITH(ctx.backward(m, Tensor<float>({2, 4, 8})),
                    Catch::Contains("backward needs the gradient of the last forward's output, got shape [2, 4, 8]"));
}

namespace {

// Each projection its own FullShard unit (wrap_types<Linear>), so the engine
// gathers and frees them around the layer's ctx.forward / ctx.backward calls:
// ten SGD steps equal unsharded training on the global batch (to float32
// rounding of the reduced gradients, ~1e-7; bound 1e-5 relative, 1e-3 floor).
template <class L>
void check_sharded(const typename L::options& o, std::int64_t E) {
  constexpr int steps = 10;
  constexpr std::int64_t global = 4, S = 5;
  const auto data = [&](int s, std::int64_t rows, std::int64_t first, std::uint64_t stream) {
    return fixture::batch(s, rows * S, E, stream, first * S).reshape({rows, S, E});
  };
  std::vector<float> want;
  {
    L layer(o);
    Replicated<float, L> owner(layer, 3);
    fixture::sgd sgd;
    auto st = sgd.make_state(owner.values().size());
    context ctx;
    for (int s = 0; s < steps; ++s) {
      owner.zero_grad();
      auto l = fixture::mse(ctx.forward(layer, data(s, global, 0, 1)), data(s, global, 0, 2));
      ctx.backward(layer, l.grad);
      sgd.step(owner.values(), owner.grads(), st);
    }
    for (const auto& e : owner.layout().entries) {
      const auto v = owner.value(e.name);
      want.insert(want.end(), v.begin(), v.end());
    }
  }
  std::vector<float> got;
  comm::launch(2, [&](comm::ThreadComm& c) {
    L layer(o);
    auto sharded = shard::fully_shard<fixture::sgd>(layer, c, shard::FullShard{},
                                                    {.wrap = shard::wrap_types<Linear<float>>{}, .seed = 3});
    if (sharded.unit_count() < 3) throw error("the projections are not units");
    fixture::sgd sgd;
    const std::int64_t local = global / 2, first = c.rank() * local;
    for (int s = 0; s < steps; ++s)
      sharded.train_step(sgd, data(s, local, first, 1), data(s, local, first, 2), fixture::mse);
    auto sd = sharded.full_state_dict();
    if (c.rank() == 0)
      for (auto& [name, t] : sd) got.insert(got.end(), t.span().begin(), t.span().end());
  });
  REQUIRE(got.size() == want.size());
  test_support::max_error worst;  // NaN and infinities count as +inf
  worst.relative(got, want, 1e-3);
  CHECK(worst <= 1e-5);
}

}  // namespace

TEST_CASE("GPT2Attention and LlamaAttention train sharded (FullShard, W = 2) as unsharded", "[nn][decoder][shard]") {
  SECTION("GPT-2") { check_sharded<GPT2Attention<float>>({.n_embd = 8, .n_head = 2}, 8); }
  SECTION("LLaMA, GQA") {
    check_sharded<LlamaAttention<float>>({.hidden_size = 8, .num_attention_heads = 4, .num_key_value_heads = 2}, 8);
  }
}

TEST_CASE("Decoder attention matches PyTorch's forward and gradients", "[nn][decoder][golden]") {
  // tests/golden/decoder (make_decoder_goldens.py): Hugging Face's names, the
  // files' key padding and additive masks, dL/dy = r; within golden::tolerance
  // (float64 agrees to rounding; float32 to a few roundings of 6e-8 through two
  // projections and a softmax).
  using golden::parity, golden::weighted_sum, golden::decoder_dir;
  parity("gpt2_causal_padding", [](auto t) { return GPT2Attention<decltype(t)>({.n_embd = 16, .n_head = 4}); },
         weighted_sum{}, decoder_dir());
  const llama_attention_options gqa{.hidden_size = 16, .num_attention_heads = 4, .num_key_value_heads = 2};
  parity("llama_gqa_rope", [&](auto t) { return LlamaAttention<decltype(t)>(gqa); }, weighted_sum{}, decoder_dir());
  const llama_attention_options mqa{.hidden_size = 16, .num_attention_heads = 2, .num_key_value_heads = 1,
                                    .head_dim = 8, .rope_theta = 500000, .attention_bias = true};
  parity("llama_mqa_bias", [&](auto t) { return LlamaAttention<decltype(t)>(mqa); }, weighted_sum{}, decoder_dir());
}

}  // namespace test_decoder_attention
