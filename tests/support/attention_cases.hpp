// tests/support/attention_cases.hpp — the fused attention's test cases, inputs and
// float64 reference, shared by the device test (tests/cuda/test_cuda_attention.cu)
// and the emulated one (tests/emulated/test_emulated_attention.cpp), which run the
// same kernels on a GPU and on the CPU.
#pragma once
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/sdpa.hpp"
#include "shardlib/ops/cuda/flash_kernels.cuh"  // flash_options

#include "support/random_inputs.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace test_support {

struct attention_case {
  std::string name;
  std::int64_t batch, heads, kv_heads, queries, keys, dim;
  bool causal = false;
  std::int64_t offset = 0;
  int padding = 0;        // 0 none, 1 random keys, 2 random keys and sample 0 wholly padded
  double dropout_p = -1;  // < 0: no dropout stream
  bool rows = false;      // [B, L, heads * D] rows (a projection's output) instead of [B, heads, L, D]
  double scale = 0;       // 0: 1 / sqrt(D)
};

// A [batch, heads, seq, dim] view of data in either layout.
template <class U>
shardlib::nn::head_view<U> view_of(U* data, std::int64_t b, std::int64_t h, std::int64_t l, std::int64_t d,
                                   bool rows) {
  if (rows) return {data, b, h, l, d, l * h * d, d, h * d};
  return {data, b, h, l, d, h * l * d, l * d, d};
}

// Every rule at small sizes: masks, offsets, padding, GQA, dropout, layouts, head dims.
inline std::vector<attention_case> small_attention_cases() {
  return {
      {"plain, L 37", 2, 4, 4, 37, 37, 64},
      {"causal, rows layout, L 50", 2, 4, 4, 50, 50, 64, true, 0, 0, -1, true},
      {"causal, Lq 20 < Lk 25, offset 5 (a cache), D 16", 2, 2, 2, 20, 25, 16, true, 5},
      {"one query over 37 keys, offset 36 (a decoding step), GQA 4 over 2, padding, rows layout", 2, 4, 2, 1, 37, 64,
       true, 36, 1, -1, true},
      {"causal, offset -7 (rows without keys), padding, a sample all padding, D 32", 2, 2, 2, 30, 30, 32, true, -7, 2},
      {"causal, offset -70 (whole query tiles without keys), Lq 100, D 64", 1, 2, 1, 100, 100, 64, true, -70},
      {"GQA 8 over 2, D 128, key padding, Lq 70, Lk 45", 2, 8, 2, 70, 45, 128, false, 0, 1},
      {"GQA 4 over 2, causal, padding, dropout 0.2, rows layout", 2, 4, 2, 45, 45, 64, true, 0, 1, 0.2, true},
      {"D 80 (in a 128 tile), Lq 33, Lk 65, dropout 0.5", 1, 3, 1, 33, 65, 80, false, 0, 0, 0.5},
      {"D 256, causal, L 40", 1, 2, 2, 40, 40, 256, true},
      {"dropout 1: every weight dropped", 1, 2, 1, 9, 11, 32, true, 3, 1, 1.0},
      {"scale 0.3 (given, not 1 / sqrt(D)), causal, offset 2", 2, 2, 1, 24, 26, 48, true, 2, 0, -1, false, 0.3},
      // A negative scale: the CUDA cores also for 16-bit types (the tensor-core forward scales a row's largest product).
      {"scale -0.3, causal, padding, GQA 2 over 1", 2, 2, 1, 24, 26, 48, true, 0, 1, -1, false, -0.3},
      // D not a multiple of 8: the CUDA cores also for 16-bit types (tensor-core tiles load 16 bytes).
      {"D 36, causal, rows layout, GQA 4 over 2", 2, 4, 2, 33, 33, 36, true, 0, 0, -1, true},
  };
}

// One case's inputs (rounded to the input type, in storage order), its options
// for nn::sdpa and for the kernels (without a key-padding pointer: the caller's
// memory), and nn::sdpa's forward and backward in float64 from those inputs.
struct attention_data {
  std::vector<float> q, k, v, dout;
  shardlib::nn::sdpa_options options;
  shardlib::ops::cuda::flash_options flash;
  std::vector<double> out, dq, dk, dv;
};

template <class T>
attention_data make_attention_data(const attention_case& c, random_inputs& rnd) {
  namespace sl = shardlib;
  const std::int64_t B = c.batch, H = c.heads, G = c.kv_heads, Lq = c.queries, Lk = c.keys, D = c.dim;
  attention_data a;
  a.q = rounded<T>(rnd.normal(std::size_t(B * H * Lq * D)));
  a.k = rounded<T>(rnd.normal(std::size_t(B * G * Lk * D)));
  a.v = rounded<T>(rnd.normal(std::size_t(B * G * Lk * D)));
  a.dout = rounded<T>(rnd.normal(std::size_t(B * H * Lq * D)));
  sl::nn::sdpa_options& o = a.options;
  o = {.is_causal = c.causal, .query_offset = c.offset, .scale = c.scale};
  a.flash = {.is_causal = c.causal, .query_offset = c.offset, .scale = float(c.scale)};
  if (c.padding) {
    o.key_padding_mask = sl::Tensor<std::uint8_t>::zeros({B, Lk});
    for (std::int64_t i = 0; i < B * Lk; ++i) o.key_padding_mask[i] = std::uint8_t(rnd.integer(0, 3) == 0 ? 3 : 0);
    if (c.padding == 2)
      for (std::int64_t j = 0; j < Lk; ++j) o.key_padding_mask[j] = 1;
  }
  if (c.dropout_p >= 0) {
    o.dropout_p = c.dropout_p;
    o.dropout = sl::counter_rng(std::uint64_t(rnd.integer(0, 1 << 30)), 7);
    a.flash.dropout_p = float(c.dropout_p);
    a.flash.dropout = o.dropout;
  }
  const auto wide = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  std::vector<double> q = wide(a.q), k = wide(a.k), v = wide(a.v), dout = wide(a.dout);
  a.out.resize(q.size());
  a.dq.resize(q.size());
  a.dk.resize(k.size());
  a.dv.resize(v.size());
  std::vector<double> probs(std::size_t(B * H * Lq * Lk));
  const auto view = [&](std::vector<double>& x, std::int64_t heads, std::int64_t l) {
    return view_of(x.data(), B, heads, l, D, c.rows);
  };
  sl::nn::sdpa_forward(view(q, H, Lq), view(k, G, Lk), view(v, G, Lk), view(a.out, H, Lq), probs.data(), o);
  sl::nn::sdpa_backward(view(dout, H, Lq), view(q, H, Lq), view(k, G, Lk), view(v, G, Lk), probs.data(),
                        view(a.dq, H, Lq), view(a.dk, G, Lk), view(a.dv, G, Lk), o);
  return a;
}

// Normwise bound for bf16's dq (the other outputs keep the tests' 1e-2): a query row
// that sees one key (causal row 0) has dq = 0 exactly, but its D = dO . O reads O
// rounded to bf16 while dP reads V, so the kernels leave a residue of 2^-9 |dO| |O| |K|
// scale there; against the largest dq element that reached 1.6e-2 in the emulated runs
// (2 of 72 seeds above 1e-2, the rest below 7.6e-3).
inline constexpr double bf16_dq_tolerance = 3e-2;

// The dropout mask read back exactly: q = 0 makes every weight 1 / L, k = v = the identity
// (keys = dim = L), dO the identity's first Lq rows, so out[i][j] and dv[j][i] are zero
// exactly where weight (i, j) was dropped (dv[j][i] = sum over queries r of P'[r][j] dO[r][i]
// = P'[i][j]), and dv[j][i] = 0 for i >= Lq. forward's mask shows in out, dk/dv's in dv.
inline attention_case mask_probe_case(std::int64_t batch, std::int64_t heads, std::int64_t queries, std::int64_t keys) {
  return {"dropout mask probe", batch, heads, heads, queries, keys, keys};
}
inline attention_data mask_probe_data(const attention_case& c, double p, shardlib::counter_rng stream) {
  const std::int64_t B = c.batch, H = c.heads, Lq = c.queries, L = c.keys;
  attention_data a;
  a.q.assign(std::size_t(B * H * Lq * L), 0.0f);
  a.k.assign(std::size_t(B * H * L * L), 0.0f);
  a.dout.assign(a.q.size(), 0.0f);
  for (std::int64_t m = 0; m < B * H; ++m)
    for (std::int64_t j = 0; j < L; ++j) {
      a.k[std::size_t((m * L + j) * L + j)] = 1.0f;
      if (j < Lq) a.dout[std::size_t((m * Lq + j) * L + j)] = 1.0f;
    }
  a.v = a.k;
  a.options = {.dropout_p = p, .dropout = stream};
  a.flash = {.dropout_p = float(p), .dropout = stream};
  return a;
}
// The elements of out and dv (as [B, H, Lq, L] and [B, H, L, L]) that break that rule, NaN
// included; `dropped` counts the weights nn::sdpa's mask drops.
inline std::int64_t mask_mismatches(const attention_case& c, const attention_data& a, const std::vector<float>& out,
                                    const std::vector<float>& dv, std::int64_t& dropped) {
  const std::int64_t Lq = c.queries, L = c.keys;
  std::vector<double> want(std::size_t(Lq * L));
  std::int64_t bad = 0;
  dropped = 0;
  for (std::int64_t m = 0; m < c.batch * c.heads; ++m) {
    shardlib::nn::detail::sdpa_keep_scales(a.options, m, Lq, L, want.data());
    for (std::int64_t j = 0; j < L; ++j)
      for (std::int64_t i = 0; i < L; ++i) {
        const float g = dv[std::size_t((m * L + j) * L + i)];
        bad += i < Lq ? (g == 0.0f) != (want[std::size_t(i * L + j)] == 0.0f) || std::isnan(g) : !(g == 0.0f);
      }
    for (std::int64_t e = 0; e < Lq * L; ++e) {
      const float g = out[std::size_t(m * Lq * L + e)];
      bad += (g == 0.0f) != (want[std::size_t(e)] == 0.0f) || std::isnan(g);
      dropped += want[std::size_t(e)] == 0.0f;
    }
  }
  return bad;
}

// The rows whose lse breaks the rule: +inf for a query without a visible key (its
// output is zero), finite for every other.
inline std::int64_t wrong_lse_rows(const attention_case& c, const attention_data& a, const std::vector<float>& lse) {
  std::int64_t bad = 0;
  for (std::int64_t n = 0; n < c.batch; ++n)
    for (std::int64_t h = 0; h < c.heads; ++h)
      for (std::int64_t i = 0; i < c.queries; ++i) {
        bool any = false;
        for (std::int64_t j = 0; j < c.keys && !any; ++j)
          any = !(c.causal && j > i + c.offset) && !(c.padding && a.options.key_padding_mask[n * c.keys + j]);
        const float l = lse[std::size_t((n * c.heads + h) * c.queries + i)];
        bad += any ? !std::isfinite(l) : l != INFINITY;
      }
  return bad;
}

}  // namespace test_support
