// shardlib/nn/sdpa.hpp — scaled dot-product attention on the host, forward and
// backward (torch.nn.functional.scaled_dot_product_attention), with causal and
// attention masks, key padding, grouped-query attention and dropout.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/attention_dropout.hpp"
#include "shardlib/ops/gemm.hpp"

#include <algorithm>    // std::fill_n, std::max
#include <array>        // std::array
#include <cmath>        // std::exp, std::sqrt
#include <cstdint>      // std::int64_t, std::uint8_t, std::uint64_t
#include <limits>       // std::numeric_limits
#include <optional>     // std::optional
#include <string_view>  // std::string_view
#include <vector>       // std::vector

namespace shardlib::nn {

// Heads of a [batch, heads, seq, dim] tensor laid out by strides, rows of `dim`
// contiguous. The same kernel then reads torch's [B, H, L, D] layout
// (bhsd), the [B, L, H * D] rows a projection writes (rows, no transpose), and a
// KV cache with room for more positions than it holds (batch_stride larger).
template <class T>
struct head_view {
  T* data = nullptr;
  std::int64_t batch = 0, heads = 0, seq = 0, dim = 0;
  std::int64_t batch_stride = 0, head_stride = 0, row_stride = 0;

  T* at(std::int64_t n, std::int64_t h) const { return data + n * batch_stride + h * head_stride; }
  Shape shape() const { return {batch, heads, seq, dim}; }

  // A contiguous [B, H, L, D] tensor.
  static head_view bhsd(const Tensor<T>& t) {
    require<shape_error>(t.rank() == 4, "head_view: a [batch, heads, seq, dim] tensor has rank 4, got ", t.shape());
    const std::int64_t H = t.dim(1), L = t.dim(2), D = t.dim(3);
    return {t.data(), t.dim(0), H, L, D, H * L * D, L * D, D};
  }
  // Head h of position l of batch element n at data + (n L + l) row_stride + h D:
  // the rows of a [B, L, row_stride] tensor holding H heads of D from column 0.
  static head_view rows(T* data, std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t dim,
                        std::int64_t row_stride) {
    return {data, batch, heads, seq, dim, seq * row_stride, dim, row_stride};
  }
};

// Everything scaled_dot_product_attention takes besides q, k and v.
struct sdpa_options {
  // Causal: query i sees keys j <= i + query_offset. Offset 0 is torch's
  // is_causal (aligned top-left, also when queries and keys differ in number);
  // a KV cache's length of earlier keys aligns the new queries at the end.
  bool is_causal = false;
  std::int64_t query_offset = 0;
  double scale = 0;  // of q.k; 0 = 1 / sqrt(head_dim), torch's default
  // Inverted dropout on the weights with probability dropout_p, drawn from
  // `dropout` as nn::attention_keep says; no stream = no dropout.
  // dropout_p = 1 drops every weight (torch's dropout and nn::Dropout allow it).
  double dropout_p = 0;
  std::optional<counter_rng> dropout{};
  Tensor<std::uint8_t> key_padding_mask{};  // [B, Lk], nonzero = a padding key; empty = none
  attn_mask mask{};                         // broadcast to [B, H, Lq, Lk]; see attn_mask
  std::string_view who = "scaled_dot_product_attention";  // named in errors
};

namespace detail {
// The element strides of a mask of shape m broadcast to `to` (0 along
// broadcast dimensions), checked.
inline std::array<std::int64_t, 4> mask_strides(const Shape& m, const Shape& to, std::string_view who) {
  const auto bad = [&] {
    return cat(who, ": the attention mask must broadcast to [batch, heads, queries, keys] = ", to,
               " (rank 2 to 4, each dimension equal or 1), got ", m);
  };
  require<shape_error>(m.rank() >= 2 && m.rank() <= 4, bad());
  std::array<std::int64_t, 4> s{};
  std::int64_t stride = 1;
  for (int i = 3, j = m.rank() - 1; j >= 0; --i, --j) {
    require<shape_error>(m[j] == to[i] || m[j] == 1, bad());
    s[std::size_t(i)] = m[j] == 1 ? 0 : stride;
    stride *= m[j];
  }
  return s;
}

inline void check_sdpa_shapes(const Shape& q, const Shape& k, const Shape& v, const sdpa_options& o) {
  const std::string_view who = o.who;
  require<shape_error>(k == v, who, ": keys and values must have one shape, got ", k, " and ", v);
  require<shape_error>(q[0] == k[0] && q[3] == k[3] && q[1] > 0 && k[1] > 0 && q[1] % k[1] == 0, who,
                       ": q [batch, heads, queries, dim] = ", q, " and k [batch, kv_heads, keys, dim] = ", k,
                       " need one batch and dim and heads a multiple of kv_heads");
  require<shape_error>(o.key_padding_mask.empty() || o.key_padding_mask.shape() == Shape{q[0], k[2]}, who,
                       ": key_padding_mask must be [batch, keys] = ", Shape{q[0], k[2]}, ", got ",
                       o.key_padding_mask.shape());
  require<shape_error>(o.mask.allowed.empty() || o.mask.bias.empty(), who,
                       ": the attention mask is either boolean or additive, not both");
  if (!o.mask.empty()) mask_strides(o.mask.shape(), Shape{q[0], q[1], q[2], k[2]}, who);
  require(o.dropout_p >= 0 && o.dropout_p <= 1, who, ": dropout_p must be in [0, 1], got ", o.dropout_p);
}

template <class T>
T sdpa_scale(const sdpa_options& o, std::int64_t dim) {
  return T(o.scale != 0 ? o.scale : 1.0 / std::sqrt(double(dim)));
}

// Dropout's scales for the [Lq, Lk] weights of head `head` (n * H + h): 0 or
// 1 / (1 - p) (none is kept when p = 1), a group of 8 (nn::attention_keep) per draw.
template <class T>
void sdpa_keep_scales(const sdpa_options& o, std::int64_t head, std::int64_t Lq, std::int64_t Lk, T* s) {
  const attention_keep keeps(*o.dropout, float(o.dropout_p));
  const T kept = o.dropout_p < 1 ? T(1.0 / (1.0 - o.dropout_p)) : T(0);
  for (std::int64_t i = 0; i < Lq; i += (i & 7) == 7 ? 9 : 1)  // the groups' first rows: bit 3 clear
    for (std::int64_t j = 0; j < Lk; j += (j & 7) == 6 ? 10 : 2) {  // first keys: bits 0 and 3 clear
      const std::uint32_t group = keeps.group(head, Lq, Lk, i, j);
      for (const std::int64_t r : {i, i + 8})
        for (const std::int64_t c : {j, j + 1, j + 8, j + 9})
          if (r < Lq && c < Lk) s[r * Lk + c] = (group >> attention_keep::slot(r, c)) & 1u ? kept : T(0);
    }
}
}  // namespace detail

// out = softmax(scale q k^T + mask) v for every batch element and query head.
// q [B, H, Lq, D]; k and v [B, Hkv, Lk, D] with H a multiple of Hkv: query head
// h reads kv head h / (H / Hkv) (Hugging Face's repeat_kv). A key is masked for a
// query when the causal rule, the key padding mask or a boolean mask forbids it,
// or the additive mask's entry is -inf. The weights before dropout are written to
// probs ([B, H, Lq, Lk], what backward needs); out is overwritten.
//
// A query with no key left gets zero weights, so a zero output and no gradient:
// torch's SDPA returns NaN there. Such rows are ordinary in a batch — with left
// padding and a causal mask every padding query of a shorter sample sees only
// padding keys — and their outputs are never read, so one NaN must not turn the
// step's loss into NaN; nn::MultiheadAttention does the same.
template <class T>
void sdpa_forward(const head_view<T>& q, const head_view<T>& k, const head_view<T>& v, const head_view<T>& out,
                  T* probs, const sdpa_options& o) {
  detail::check_sdpa_shapes(q.shape(), k.shape(), v.shape(), o);
  require<shape_error>(out.shape() == q.shape(), o.who, ": the output must be shaped as q, ", q.shape(), ", got ",
                       out.shape());
  const std::int64_t B = q.batch, H = q.heads, Lq = q.seq, Lk = k.seq, D = q.dim, rep = H / k.heads;
  const T scale = detail::sdpa_scale<T>(o, D);
  const T minus_inf = -std::numeric_limits<T>::infinity();
  std::array<std::int64_t, 4> ms{};
  if (!o.mask.empty()) ms = detail::mask_strides(o.mask.shape(), Shape{B, H, Lq, Lk}, o.who);
  const std::uint8_t* allowed = o.mask.allowed.data();
  const float* bias = o.mask.bias.data();
  std::vector<T> scales(o.dropout ? Lq * Lk : 0), dropped(o.dropout ? Lq * Lk : 0);
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / rep;
      T* p = probs + (n * H + h) * Lq * Lk;
      ops::gemm(ops::trans::no, ops::trans::yes, Lq, Lk, D, scale, q.at(n, h), q.row_stride, k.at(n, g),
                k.row_stride, T(0), p, Lk);
      const std::uint8_t* pad = o.key_padding_mask.empty() ? nullptr : o.key_padding_mask.data() + n * Lk;
      for (std::int64_t i = 0; i < Lq; ++i) {
        T* row = p + i * Lk;
        const std::int64_t m0 = n * ms[0] + h * ms[1] + i * ms[2];
        // Masked scores become -inf; the maximum is over the finite rest.
        T mx = minus_inf;
        for (std::int64_t j = 0; j < Lk; ++j) {
          const bool off = (o.is_causal && j > i + o.query_offset) || (pad && pad[j]) ||
                           (allowed && !allowed[m0 + j * ms[3]]);
          if (bias && !off) row[j] += T(bias[m0 + j * ms[3]]);
          if (off || row[j] == minus_inf) row[j] = minus_inf;
          else mx = std::max(mx, row[j]);
        }
        if (mx == minus_inf) {  // no key left: zero weights (see above)
          std::fill_n(row, Lk, T(0));
          continue;
        }
        T sum = T(0);
        for (std::int64_t j = 0; j < Lk; ++j) sum += row[j] = row[j] == minus_inf ? T(0) : T(std::exp(row[j] - mx));
        for (std::int64_t j = 0; j < Lk; ++j) row[j] /= sum;
      }
      const T* pv = p;
      if (o.dropout) {
        detail::sdpa_keep_scales(o, n * H + h, Lq, Lk, scales.data());
        for (std::int64_t i = 0; i < Lq * Lk; ++i) dropped[std::size_t(i)] = p[i] * scales[std::size_t(i)];
        pv = dropped.data();
      }
      ops::gemm(ops::trans::no, ops::trans::no, Lq, D, Lk, T(1), pv, Lk, v.at(n, g), v.row_stride, T(0), out.at(n, h),
                out.row_stride);
    }
}

// The gradients of sdpa_forward's inputs from dL/d(out), given forward's q, k,
// v, probs and options (the same dropout stream): dq, dk and dv are
// overwritten; a kv head shared by several query heads gets the sum of their
// gradients. Masks are not read again: masked weights are zero in probs.
template <class T>
void sdpa_backward(const head_view<T>& dout, const head_view<T>& q, const head_view<T>& k, const head_view<T>& v,
                   const T* probs, const head_view<T>& dq, const head_view<T>& dk, const head_view<T>& dv,
                   const sdpa_options& o) {
  require<shape_error>(dout.shape() == q.shape() && dq.shape() == q.shape() && dk.shape() == k.shape() &&
                           dv.shape() == v.shape(),
                       o.who, ": backward's gradients must be shaped as q ", q.shape(), " and k, v ", k.shape());
  const std::int64_t B = q.batch, H = q.heads, Lq = q.seq, Lk = k.seq, D = q.dim, rep = H / k.heads;
  const T scale = detail::sdpa_scale<T>(o, D);
  std::vector<T> scales(o.dropout ? Lq * Lk : 0), dropped(o.dropout ? Lq * Lk : 0), dp(std::size_t(Lq * Lk));
  for (std::int64_t n = 0; n < B; ++n)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / rep;
      const T first = h % rep == 0 ? T(0) : T(1);  // the group's first head overwrites dk, dv; the rest add
      const T* p = probs + (n * H + h) * Lq * Lk;
      const T* pv = p;
      if (o.dropout) {
        detail::sdpa_keep_scales(o, n * H + h, Lq, Lk, scales.data());
        for (std::int64_t i = 0; i < Lq * Lk; ++i) dropped[std::size_t(i)] = p[i] * scales[std::size_t(i)];
        pv = dropped.data();
      }
      // dP' = dO V^T, dV += P'^T dO, dP = dP' * scales, dS = P (dP - rowsum(dP P)),
      // dQ = s dS K, dK += s dS^T Q.
      ops::gemm(ops::trans::no, ops::trans::yes, Lq, Lk, D, T(1), dout.at(n, h), dout.row_stride, v.at(n, g),
                v.row_stride, T(0), dp.data(), Lk);
      ops::gemm(ops::trans::yes, ops::trans::no, Lk, D, Lq, T(1), pv, Lk, dout.at(n, h), dout.row_stride, first,
                dv.at(n, g), dv.row_stride);
      if (o.dropout)
        for (std::int64_t i = 0; i < Lq * Lk; ++i) dp[std::size_t(i)] *= scales[std::size_t(i)];
      for (std::int64_t i = 0; i < Lq; ++i) {
        T* d = dp.data() + i * Lk;
        const T* pr = p + i * Lk;
        T dot = T(0);
        for (std::int64_t j = 0; j < Lk; ++j) dot += d[j] * pr[j];
        for (std::int64_t j = 0; j < Lk; ++j) d[j] = pr[j] * (d[j] - dot);
      }
      ops::gemm(ops::trans::no, ops::trans::no, Lq, D, Lk, scale, dp.data(), Lk, k.at(n, g), k.row_stride, T(0),
                dq.at(n, h), dq.row_stride);
      ops::gemm(ops::trans::yes, ops::trans::no, Lk, D, Lq, scale, dp.data(), Lk, q.at(n, h), q.row_stride, first,
                dk.at(n, g), dk.row_stride);
    }
}

}  // namespace shardlib::nn
