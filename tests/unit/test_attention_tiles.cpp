// The fused attention's tile arithmetic (ops/attention_tiles.hpp), run on the host
// with the kernels' loop structure, against nn::sdpa_forward / sdpa_backward (the
// host attention that materialises the weights) and finite differences.
//
// Tolerances, relative to the largest element of the reference tensor: float64
// 1e-12 — both sides sum at most a few hundred products of order-1 terms in a
// different order (online softmax, rescaled accumulators, the tile order), each
// rounding at 1.1e-16; float 1e-5 — the same with float's 6e-8 (the observed
// worst is a few 1e-7), well below what a wrong mask, a missed rescale or a lost
// tile would cost (a weight of order 1 / Lk >= 1e-2).
#include "shardlib/core/element.hpp"  // bfloat16, half
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/sdpa.hpp"
#include "shardlib/ops/attention_tiles.hpp"
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>
#include "support/compare.hpp"
#include "support/random_inputs.hpp"

namespace test_attention_tiles {

namespace {

using namespace shardlib;
namespace flash = shardlib::ops::flash;
using nn::head_view;

struct attention_case {
  std::string name;
  std::int64_t batch, heads, kv_heads, queries, keys, dim;
  bool causal = false;
  std::int64_t offset = 0;
  int padding = 0;  // 0 none, 1 random keys, 2 random keys and sample 0 wholly padded
  double dropout_p = -1;  // < 0: no dropout stream
  std::int64_t block_q = 32, block_k = 32;
};

// Normal values, rounded to Round first (the inputs of 16-bit runs, held exactly in T).
template <class T, class Round = T>
Tensor<T> random_tensor(test_support::random_inputs& rng, Shape s) {
  Tensor<T> t(s);
  const std::vector<float> v = rng.normal(std::size_t(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = T(Round(v[std::size_t(i)]));
  return t;
}
template <class T>
head_view<const T> cview(const Tensor<T>& t) {
  const head_view<T> v = head_view<T>::bhsd(t);
  return {v.data, v.batch, v.heads, v.seq, v.dim, v.batch_stride, v.head_stride, v.row_stride};
}

// The reference and the tiles on one case: forward and backward.
template <class T>
struct run {
  Tensor<T> q, k, v, dout, out_ref, dq_ref, dk_ref, dv_ref, out, dq, dk, dv;
  std::vector<T> lse;
  nn::sdpa_options o;
  flash::tile_problem p;
  T scale;
};

template <class T, class Round = T>
run<T> run_case(const attention_case& c, test_support::random_inputs& rng) {
  const std::int64_t B = c.batch, H = c.heads, G = c.kv_heads, Lq = c.queries, Lk = c.keys, D = c.dim;
  run<T> r;
  r.q = random_tensor<T, Round>(rng, {B, H, Lq, D});
  r.k = random_tensor<T, Round>(rng, {B, G, Lk, D});
  r.v = random_tensor<T, Round>(rng, {B, G, Lk, D});
  r.dout = random_tensor<T, Round>(rng, {B, H, Lq, D});
  r.o = {.is_causal = c.causal, .query_offset = c.offset};
  if (c.padding) {
    r.o.key_padding_mask = Tensor<std::uint8_t>::zeros({B, Lk});
    for (std::int64_t i = 0; i < B * Lk; ++i) r.o.key_padding_mask[i] = std::uint8_t(rng.integer(0, 3) == 0 ? 7 : 0);
    if (c.padding == 2)
      for (std::int64_t j = 0; j < Lk; ++j) r.o.key_padding_mask[j] = 1;
  }
  if (c.dropout_p >= 0) {
    r.o.dropout_p = c.dropout_p;
    r.o.dropout = counter_rng(std::uint64_t(rng.integer(0, 1 << 30)), 42);
  }
  for (auto* t : {&r.out_ref, &r.out, &r.dq_ref, &r.dq}) *t = Tensor<T>({B, H, Lq, D});
  for (auto* t : {&r.dk_ref, &r.dv_ref, &r.dk, &r.dv}) *t = Tensor<T>({B, G, Lk, D});
  Tensor<T> probs({B, H, Lq, Lk});
  const auto view = head_view<T>::bhsd;
  nn::sdpa_forward(view(r.q), view(r.k), view(r.v), view(r.out_ref), probs.data(), r.o);
  nn::sdpa_backward(view(r.dout), view(r.q), view(r.k), view(r.v), probs.data(), view(r.dq_ref), view(r.dk_ref),
                    view(r.dv_ref), r.o);

  r.p = flash::make_problem(B, H, G, Lq, Lk, c.causal, c.offset,
                            c.padding ? r.o.key_padding_mask.data() : nullptr, r.o.dropout, r.o.dropout_p);
  r.scale = T(1.0 / std::sqrt(double(D)));
  r.lse.assign(std::size_t(B * H * Lq), T(0));
  flash::forward_tiles<T>(cview(r.q), cview(r.k), cview(r.v), view(r.out), r.lse.data(), r.p, r.scale, c.block_q,
                          c.block_k);
  flash::backward_tiles<T>(cview(r.q), cview(r.k), cview(r.v), cview(r.out), cview(r.dout), r.lse.data(),
                           view(r.dq), view(r.dk), view(r.dv), r.p, r.scale, c.block_q, c.block_k);
  return r;
}

// Largest |got - want| over the largest |want| (NaN counts as +inf).
template <class T>
test_support::max_error normwise(const Tensor<T>& got, const Tensor<T>& want) {
  return test_support::normwise_error(got.span(), want.span());
}

std::vector<attention_case> cases() {
  return {
      {"plain, tiles dividing nothing", 2, 4, 4, 37, 37, 16, false, 0, 0, -1, 16, 8},
      {"causal, L 50, D 64", 1, 2, 2, 50, 50, 64, true},
      {"causal, Lq 20 < Lk 25, offset 5 (a cache)", 2, 2, 2, 20, 25, 16, true, 5, 0, -1, 8, 16},
      {"one query over 37 keys, offset 36 (a decoding step), GQA 4 over 2, padding", 2, 4, 2, 1, 37, 16, true, 36, 1,
       -1, 16, 16},
      {"causal, offset -7: rows without keys", 1, 3, 3, 30, 30, 16, true, -7, 0, -1, 16, 16},
      {"GQA 6 over 2, Lq 19, Lk 41, D 128, key padding, a sample all padding", 2, 6, 2, 19, 41, 128, false, 0, 2},
      {"GQA 4 over 1, causal, padding, dropout 0.3", 2, 4, 1, 33, 33, 64, true, 0, 1, 0.3, 16, 32},
      {"dropout 0.5, Lq 45 > Lk 13, tiles of one", 1, 2, 2, 45, 13, 16, false, 0, 0, 0.5, 1, 1},
      {"dropout 1: every weight dropped", 1, 2, 1, 9, 11, 16, true, 3, 1, 1.0, 4, 4},
      {"dropout stream with p 0, one tile bigger than L", 1, 1, 1, 7, 9, 16, false, 0, 1, 0.0, 64, 64},
  };
}

}  // namespace

TEMPLATE_TEST_CASE("fused attention tiles equal nn::sdpa forward and backward", "[ops][flash]", double, float) {
  test_support::random_inputs rng;
  const double tol = std::is_same_v<TestType, double> ? 1e-12 : 1e-5;
  for (const attention_case& c : cases()) {
    INFO(c.name << " (seed " << rng.seed << ")");
    const run<TestType> r = run_case<TestType>(c, rng);
    CHECK(normwise(r.out, r.out_ref) <= tol);
    CHECK(normwise(r.dq, r.dq_ref) <= tol);
    CHECK(normwise(r.dk, r.dk_ref) <= tol);
    CHECK(normwise(r.dv, r.dv_ref) <= tol);
  }
}

namespace {

// The tensor-core kernels' arithmetic on r's inputs (16-bit values held in double):
// T16 inputs and outputs, fp32 accumulation, weights and score gradients rounded to
// Operand before their products, tiles of 64 queries and 64 keys.
template <class T16, class Operand>
struct run_16bit {
  Tensor<T16> out, dq, dk, dv;

  run_16bit(const run<double>& r) {
    const auto to16 = [](const Tensor<double>& t) {
      Tensor<T16> x(t.shape());
      for (std::int64_t i = 0; i < t.numel(); ++i) x[i] = T16(t[i]);
      return x;
    };
    const Tensor<T16> q = to16(r.q), k = to16(r.k), v = to16(r.v), dout = to16(r.dout);
    for (auto* t : {&out, &dq}) *t = Tensor<T16>(q.shape());
    for (auto* t : {&dk, &dv}) *t = Tensor<T16>(k.shape());
    std::vector<float> lse(r.lse.size());
    const auto view = head_view<T16>::bhsd;
    const float scale = float(r.scale);
    flash::forward_tiles<float, T16, Operand>(cview(q), cview(k), cview(v), view(out), lse.data(), r.p, scale, 64, 64);
    flash::backward_tiles<float, T16, Operand>(cview(q), cview(k), cview(v), cview(out), cview(dout), lse.data(),
                                               view(dq), view(dk), view(dv), r.p, scale, 64, 64);
  }
};

}  // namespace

// Tolerances as the device test's for 16-bit inputs: outputs rounded to bf16 (2^-9
// relative each) or half (2^-12), and each weight or score gradient rounded alike
// before its product, which moves a sum of products by about as much again; backward
// reads the rounded O. Worst observed over these cases: 1.18e-2 for bf16 (dk of "causal,
// offset -7", whose rows see few keys, so few roundings average out; seed 2700660237),
// 6.3e-4 for half; 1.5e-2 and 2e-3 hold that, below a wrong mask element or a lost
// rescale (a weight of order 1 / L > 2e-2 here).
TEMPLATE_TEST_CASE("fused attention tiles with 16-bit operands (the tensor-core kernels) stay within rounding of "
                   "nn::sdpa",
                   "[ops][flash]", shardlib::bfloat16, shardlib::half) {
  test_support::random_inputs rng;
  const double tol = std::is_same_v<TestType, shardlib::bfloat16> ? 1.5e-2 : 2e-3;
  bool rounding_seen = false;  // the Operand rounding changes a result somewhere
  for (const attention_case& c : cases()) {
    INFO(c.name << " (seed " << rng.seed << ")");
    const run<double> r = run_case<double, TestType>(c, rng);
    const run_16bit<TestType, TestType> tc(r);
    const run_16bit<TestType, float> exact(r);
    CHECK(test_support::normwise_error(tc.out.span(), r.out_ref.span()) <= tol);
    CHECK(test_support::normwise_error(tc.dq.span(), r.dq_ref.span()) <= tol);
    CHECK(test_support::normwise_error(tc.dk.span(), r.dk_ref.span()) <= tol);
    CHECK(test_support::normwise_error(tc.dv.span(), r.dv_ref.span()) <= tol);
    for (auto [a, b] : {std::pair{&tc.out, &exact.out}, std::pair{&tc.dq, &exact.dq}, std::pair{&tc.dk, &exact.dk}})
      for (std::int64_t i = 0; i < a->numel(); ++i) rounding_seen = rounding_seen || (*a)[i] != (*b)[i];
  }
  CHECK(rounding_seen);
}

TEST_CASE("fused attention tiles: lse, and rows without a key", "[ops][flash]") {
  test_support::random_inputs rng;
  INFO("seed " << rng.seed);
  // Causal with offset -3 and sample 0 all padding: rows 0-2 of sample 1 and
  // every row of sample 0 see no key.
  const attention_case c{"", 2, 2, 1, 12, 12, 16, true, -3, 2, -1, 8, 8};
  const run<double> r = run_case<double>(c, rng);
  test_support::max_error lse_error;
  for (std::int64_t n = 0; n < 2; ++n)
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t i = 0; i < 12; ++i) {
        // log sum exp(s) over the visible keys, directly.
        double m = -INFINITY, sum = 0;
        std::vector<double> s;
        for (std::int64_t j = 0; j < 12; ++j) {
          if (!flash::visible(r.p, n, i, j)) continue;
          double dot = 0;
          for (std::int64_t d = 0; d < 16; ++d) dot += r.q[((n * 2 + h) * 12 + i) * 16 + d] * r.k[(n * 12 + j) * 16 + d];
          s.push_back(dot * r.scale);
          m = test_support::max_keeping_nan(m, s.back());
        }
        for (double x : s) sum += std::exp(x - m);
        const double got = r.lse[std::size_t((n * 2 + h) * 12 + i)];
        if (s.empty()) {
          CHECK(got == INFINITY);
          for (std::int64_t d = 0; d < 16; ++d) {
            CHECK(r.out[((n * 2 + h) * 12 + i) * 16 + d] == 0.0);
            CHECK(r.dq[((n * 2 + h) * 12 + i) * 16 + d] == 0.0);
          }
        } else {
          lse_error.relative(got, m + std::log(sum), 1.0);
        }
      }
  CHECK(lse_error.count() > 0);
  CHECK(lse_error <= 1e-13);
}

TEST_CASE("fused attention tiles: dropout draws the host's mask bit for bit", "[ops][flash]") {
  const std::int64_t B = 2, H = 3, Lq = 17, Lk = 23;
  const nn::sdpa_options o{.dropout_p = 0.4, .dropout = counter_rng(1234, 5)};
  const flash::tile_problem p = flash::make_problem(B, H, H, Lq, Lk, false, 0, nullptr, o.dropout, o.dropout_p);
  std::vector<double> want(std::size_t(Lq * Lk));
  std::int64_t mismatches = 0, dropped = 0;
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t h = 0; h < H; ++h) {
      nn::detail::sdpa_keep_scales(o, n * H + h, Lq, Lk, want.data());
      for (std::int64_t i = 0; i < Lq; ++i)
        for (std::int64_t j = 0; j < Lk; ++j) {
          const double got = flash::keep_scale(p, p.kept, n, h, i, j);
          mismatches += got != want[std::size_t(i * Lk + j)];
          dropped += got == 0;
        }
    }
  CHECK(mismatches == 0);
  CHECK(dropped > B * H * Lq * Lk / 4);  // p 0.4: the mask does drop
  CHECK(dropped < B * H * Lq * Lk / 2 + B * H * Lq * Lk / 20);
}

// nn::attention_keep: weight (i, j) of head `head` is kept iff its 16 bits of its group's
// Philox block, read as v / 2^16, are >= p; the group is queries i, i ^ 8 against keys
// j, j ^ 1, j ^ 8, j ^ 9, drawn at the index of its first weight. Written out here from
// that statement, in float, against the class's integer threshold.
static bool kept_as_stated(const counter_rng& stream, float p, std::int64_t head, std::int64_t Lq, std::int64_t Lk,
                    std::int64_t i, std::int64_t j) {
  const std::int64_t i0 = i - (i & 8), j0 = j - (j & 9);  // the group's first weight
  const auto block = stream.bits(std::uint64_t((head * Lq + i0) * Lk + j0));
  const int s = 4 * int((i >> 3) & 1) + 2 * int((j >> 3) & 1) + int(j & 1);
  const std::uint32_t v = (block[std::size_t(s / 2)] >> (16 * (s % 2))) & 0xffffu;
  return float(v) / 65536.0f >= p;
}

TEST_CASE("attention dropout draws a group of 8 weights per Philox block, 16 bits each", "[ops][flash][dropout]") {
  const counter_rng stream(77, 9);
  const std::int64_t Lq = 37, Lk = 45, head = 5;  // neither a multiple of 16: partial groups at the edges
  for (const float p : {0.0f, 0x1p-16f, 0.1f, 0.3f, 0.5f, 0.999f, 1.0f}) {
    INFO("p " << p);
    const nn::attention_keep keeps(stream, p);
    std::int64_t wrong = 0, kept = 0;
    for (std::int64_t i = 0; i < Lq; ++i)
      for (std::int64_t j = 0; j < Lk; ++j) {
        const bool got = keeps(head, Lq, Lk, i, j);
        wrong += got != kept_as_stated(stream, p, head, Lq, Lk, i, j);
        kept += got;
      }
    CHECK(wrong == 0);
    if (p == 0.0f) CHECK(kept == Lq * Lk);
    if (p == 1.0f) CHECK(kept == 0);
  }
  // Groups are disjoint, at most 8 weights each, and their counters stay inside the head's
  // [Lq * Lk) range of indices, so no two weights of a layer's [B, H, Lq, Lk] share a slot.
  std::vector<int> members(std::size_t(Lq * Lk), 0);
  std::vector<std::vector<int>> slots(std::size_t(Lq * Lk));
  for (std::int64_t i = 0; i < Lq; ++i)
    for (std::int64_t j = 0; j < Lk; ++j) {
      const std::uint64_t at = nn::attention_keep::index(head, Lq, Lk, i, j);
      REQUIRE(at >= std::uint64_t(head * Lq * Lk));
      REQUIRE(at < std::uint64_t((head + 1) * Lq * Lk));
      const std::size_t g = std::size_t(at - std::uint64_t(head * Lq * Lk));
      ++members[g];
      slots[g].push_back(nn::attention_keep::slot(i, j));
    }
  std::int64_t groups = 0, crowded = 0;
  for (std::size_t g = 0; g < members.size(); ++g) {
    if (members[g] == 0) continue;
    ++groups;
    std::sort(slots[g].begin(), slots[g].end());
    crowded += members[g] > 8 || std::adjacent_find(slots[g].begin(), slots[g].end()) != slots[g].end();
  }
  CHECK(crowded == 0);
  // first rows (bit 3 clear) below 37: 0-7, 16-23, 32-36; first keys (bits 0, 3 clear) below 45:
  // 0, 2, 4, 6, 16, ..., 22, 32, ..., 38
  CHECK(groups == 21 * 12);
}

TEST_CASE("attention dropout's masks drop a fraction p, the weights of a group independently", "[ops][flash][dropout]") {
  const counter_rng stream(2026, 12);
  const std::int64_t Lq = 256, Lk = 256, heads = 4;
  for (const float p : {0.1f, 0.5f}) {
    INFO("p " << p);
    const nn::attention_keep keeps(stream, p);
    double dropped = 0, both = 0, halves = 0, pairs = 0;
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < Lq; ++i)
        for (std::int64_t j = 0; j < Lk; ++j) {
          const bool gone = !keeps(h, Lq, Lk, i, j);
          dropped += gone;
          if ((j & 1) == 0 && (i & 8) == 0) {  // within a group: (i, j) against (i ^ 8, j ^ 9), another
            both += gone && !keeps(h, Lq, Lk, i ^ 8, j ^ 9);  // word of the block, and (i, j ^ 1), the
            halves += gone && !keeps(h, Lq, Lk, i, j ^ 1);     // other half of the same word
            ++pairs;
          }
        }
    const double n = double(heads * Lq * Lk);
    // 5 standard deviations of a binomial: a bias of one bit, or correlated slots, exceed it.
    CHECK(std::abs(dropped / n - p) <= 5 * std::sqrt(p * (1 - p) / n));
    const double p2 = double(p) * p, sd = std::sqrt(p2 * (1 - p2) / pairs);
    CHECK(std::abs(both / pairs - p2) <= 5 * sd);
    CHECK(std::abs(halves / pairs - p2) <= 5 * sd);
  }
}

TEST_CASE("fused attention tiles: backward equals finite differences (float64)", "[ops][flash]") {
  test_support::random_inputs rng;
  INFO("seed " << rng.seed);
  // Causal with an offset, GQA, key padding and dropout at once.
  const attention_case c{"", 1, 4, 2, 9, 11, 16, true, 2, 1, 0.25, 4, 8};
  run<double> r = run_case<double>(c, rng);
  // loss = sum(out * dout): its gradients are backward's dq, dk, dv.
  const auto loss = [&] {
    Tensor<double> out(r.out.shape());
    std::vector<double> lse(r.lse.size());
    flash::forward_tiles<double>(cview(r.q), cview(r.k), cview(r.v), head_view<double>::bhsd(out), lse.data(), r.p,
                                 r.scale, c.block_q, c.block_k);
    double s = 0;
    for (std::int64_t i = 0; i < out.numel(); ++i) s += out[i] * r.dout[i];
    return s;
  };
  test_support::max_error worst;
  const double h = 1e-6;
  for (auto [x, g] : {std::pair{&r.q, &r.dq}, std::pair{&r.k, &r.dk}, std::pair{&r.v, &r.dv}})
    for (std::int64_t e = 0; e < x->numel(); e += 7) {
      const double keep = (*x)[e];
      (*x)[e] = keep + h;
      const double up = loss();
      (*x)[e] = keep - h;
      const double down = loss();
      (*x)[e] = keep;
      worst.relative((*g)[e], (up - down) / (2 * h), 1.0);
    }
  CHECK(worst.count() > 100);
  CHECK(worst <= 1e-7);  // central differences: h^2 truncation and 1e-16 / h rounding
}

}  // namespace test_attention_tiles
