// shardlib/ops/attention_tiles.hpp — the arithmetic of fused (flash) attention,
// one query row against one tile of keys at a time, for host and device.
//
// Fused attention never holds the [Lq, Lk] weights of a head: it walks tiles of
// keys per tile of queries, keeping per query row the running maximum m and sum
// l of exp(s - m) (the online softmax), rescaling its output accumulator when m
// grows, and writes O and the row's log-sum-exp lse = m + log l. Backward
// recomputes each weight as exp(s - lse) and needs only D_i = dO_i . O_i besides:
// dS = P (dP' - D) with dP' the dropped weights' gradient (D equals rowsum(P dP')
// because O is the dropped weights times V). The functions here are that
// arithmetic, element by element and row by row; the CUDA kernels
// (ops/cuda/flash_attention.cuh) call them from their warps, and
// forward_tiles / backward_tiles below run them over a whole problem on the host
// with the kernels' loop structure, so tests/unit/test_attention_tiles.cpp checks
// the kernels' math against nn::sdpa without a GPU.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/nn/attention_dropout.hpp"  // attention_keep
#include "shardlib/nn/sdpa.hpp"               // head_view

#include <algorithm>  // std::min, std::max
#include <cmath>      // std::exp, std::log, INFINITY
#include <cstdint>    // std::int64_t, std::uint8_t, std::uint64_t
#include <optional>   // std::optional
#include <vector>     // std::vector

namespace shardlib::ops::flash {

// What decides whether weight (n, h, i, j) exists and what dropout does to it:
// query head h of batch element n, query i, key j. Plain data, passed to kernels.
struct tile_problem {
  std::int64_t batch = 0, heads = 0, kv_heads = 0, queries = 0, keys = 0;
  bool is_causal = false;
  std::int64_t query_offset = 0;             // causal: query i sees keys j <= i + query_offset
  const std::uint8_t* key_padding = nullptr;  // [batch, keys], nonzero = padding; null = none
  bool dropout = false;
  nn::attention_keep keeps{counter_rng{0, 0}, 0};  // which weights dropout keeps, when `dropout`
  double kept = 1;        // a kept weight's scale 1 / (1 - p); 0 when p = 1
};

// The problem of q [B, H, Lq, D] and k [B, Hkv, Lk, D] under sdpa's rules.
inline tile_problem make_problem(std::int64_t batch, std::int64_t heads, std::int64_t kv_heads, std::int64_t queries,
                                 std::int64_t keys, bool is_causal, std::int64_t query_offset,
                                 const std::uint8_t* key_padding, const std::optional<counter_rng>& dropout,
                                 double dropout_p) {
  require(dropout_p >= 0 && dropout_p <= 1, "fused attention: dropout_p must be in [0, 1], got ", dropout_p);
  tile_problem p{batch, heads, kv_heads, queries, keys, is_causal, query_offset, key_padding};
  if (dropout) {
    p.dropout = true;
    p.keeps = nn::attention_keep(*dropout, float(dropout_p));
    p.kept = dropout_p < 1 ? 1.0 / (1.0 - dropout_p) : 0.0;
  }
  return p;
}

// Key j is visible to query i of batch element n: not after the causal limit and
// not padding.
SHARDLIB_HD constexpr bool visible(const tile_problem& p, std::int64_t n, std::int64_t i, std::int64_t j) {
  if (p.is_causal && j > i + p.query_offset) return false;
  return !(p.key_padding && p.key_padding[n * p.keys + j]);
}

// The dropout decisions of the group of 8 weights (nn::attention_keep) that holds
// weight (n, h, i, j); bit attention_keep::slot(i, j) is that weight's.
SHARDLIB_HD constexpr std::uint32_t keep_group(const tile_problem& p, std::int64_t n, std::int64_t h, std::int64_t i,
                                               std::int64_t j) {
  return p.keeps.group(n * p.heads + h, p.queries, p.keys, i, j);
}

// Dropout's factor for weight (n, h, i, j), drawn as nn::sdpa draws it: 1
// without dropout, else kept or 0. Kernels whose lanes hold whole groups take
// keep_group once per group instead.
template <class Acc>
SHARDLIB_HD Acc keep_scale(const tile_problem& p, Acc kept, std::int64_t n, std::int64_t h, std::int64_t i,
                           std::int64_t j) {
  if (!p.dropout) return Acc(1);
  return p.keeps(n * p.heads + h, p.queries, p.keys, i, j) ? kept : Acc(0);
}

// Causal tiles: keys [0, key_end(p, i_last)) are all the keys queries up to
// i_last can see; queries [query_begin(p, j0), Lq) are all those that can see
// a key j >= j0. Without the causal rule, everything.
SHARDLIB_HD constexpr std::int64_t key_end(const tile_problem& p, std::int64_t i_last) {
  if (!p.is_causal) return p.keys;
  const std::int64_t e = i_last + p.query_offset + 1;
  return e < 0 ? 0 : e < p.keys ? e : p.keys;
}
SHARDLIB_HD constexpr std::int64_t query_begin(const tile_problem& p, std::int64_t j0) {
  if (!p.is_causal) return 0;
  const std::int64_t b = j0 - p.query_offset;
  return b < 0 ? 0 : b < p.queries ? b : p.queries;
}

// The score of a visible key, -inf for a hidden one.
template <class Acc>
SHARDLIB_HD Acc masked_score(Acc dot, Acc scale, bool is_visible) {
  return is_visible ? scale * dot : Acc(-INFINITY);
}

// A query row's online-softmax state: the largest score so far and the sum of
// exp(score - max) over the keys seen.
template <class Acc>
struct softmax_row {
  Acc max = Acc(-INFINITY);
  Acc sum = Acc(0);
};

// A new tile's largest score arrives: the row's maximum becomes the larger one
// and its sum is rescaled to it; returns the factor exp(old - new) by which the
// row's output accumulator must be rescaled too (0 when nothing was seen yet, 1
// while every score is -inf).
template <class Acc>
SHARDLIB_HD Acc raise_max(softmax_row<Acc>& r, Acc tile_max) {
  const Acc m = tile_max > r.max ? tile_max : r.max;
  if (m == Acc(-INFINITY)) return Acc(1);
  const Acc alpha = std::exp(r.max - m);
  r.max = m;
  r.sum *= alpha;
  return alpha;
}

// exp(s - max) after raise_max; 0 for a hidden key (s = -inf).
template <class Acc>
SHARDLIB_HD Acc unnormalised_weight(Acc s, const softmax_row<Acc>& r) {
  return s == Acc(-INFINITY) ? Acc(0) : Acc(std::exp(s - r.max));
}

// After the last tile: the factor of the output accumulator (1 / sum; 0 for a
// row that saw no key, whose output is zero) and the log-sum-exp backward reads
// (+inf for such a row, so that every recomputed weight exp(s - lse) is 0).
template <class Acc>
SHARDLIB_HD Acc output_scale(const softmax_row<Acc>& r) {
  return r.sum > Acc(0) ? Acc(1) / r.sum : Acc(0);
}
template <class Acc>
SHARDLIB_HD Acc log_sum_exp(const softmax_row<Acc>& r) {
  return r.sum > Acc(0) ? Acc(r.max + std::log(r.sum)) : Acc(INFINITY);
}

// Backward: the weight of score s from its row's log-sum-exp (0 for a hidden key).
template <class Acc>
SHARDLIB_HD Acc weight(Acc s, Acc lse) {
  return s == Acc(-INFINITY) ? Acc(0) : Acc(std::exp(s - lse));
}
// The gradient of score s from its weight p, the gradient dO . v of its dropped
// weight, the weight's dropout factor and the row's D = dO . O.
template <class Acc>
SHARDLIB_HD Acc score_grad(Acc p, Acc dp, Acc keep, Acc row_d) {
  return p * (dp * keep - row_d);
}

// --- the same arithmetic over a whole problem on the host ---------------------------------
// Loops as the kernels run them: forward per tile of block_q queries over tiles
// of block_k keys; backward's D per row, then dk and dv per tile of keys over
// every query head of its kv head and every tile of queries, then dq per tile of
// queries over tiles of keys (no two tiles write one gradient element, so the
// result does not depend on their order). Acc is the accumulation type (float
// for float and 16-bit inputs, as the kernels; double for double). Operand is
// what the weights and score gradients are rounded to before they multiply V,
// dO, Q or K: Acc for the CUDA-core kernels, the 16-bit input type for the
// tensor-core ones (whose matrix products take 16-bit operands). With dropout,
// the tensor-core forward rounds a weight, zeroes it if dropped, and scales the
// output by 1 / (1 - p) at the end; the CUDA-core one multiplies each weight by
// its factor. Backward multiplies before rounding in both.

namespace detail {
template <class Acc, class T>
Acc dot(const T* a, const T* b, std::int64_t n) {
  Acc s = Acc(0);
  for (std::int64_t d = 0; d < n; ++d) s += Acc(a[d]) * Acc(b[d]);
  return s;
}
template <class Operand, class Acc>
Acc rounded(Acc x) {
  return Acc(Operand(x));
}
}  // namespace detail

// out and lse ([B, H, Lq]) are overwritten.
template <class Acc, class T, class Operand = Acc>
void forward_tiles(const nn::head_view<const T>& q, const nn::head_view<const T>& k, const nn::head_view<const T>& v,
                   const nn::head_view<T>& out, Acc* lse, const tile_problem& p, Acc scale, std::int64_t block_q,
                   std::int64_t block_k) {
  const std::int64_t D = q.dim, rep = p.heads / p.kv_heads;
  const Acc kept = Acc(p.kept);
  constexpr bool tensor_cores = !std::is_same_v<Operand, Acc>;  // see above: where dropout's scale goes
  std::vector<Acc> acc(static_cast<std::size_t>(block_q * D)), s(static_cast<std::size_t>(block_k));
  std::vector<softmax_row<Acc>> rows(static_cast<std::size_t>(block_q));
  for (std::int64_t n = 0; n < p.batch; ++n)
    for (std::int64_t h = 0; h < p.heads; ++h)
      for (std::int64_t i0 = 0; i0 < p.queries; i0 += block_q) {
        const std::int64_t bq = std::min(block_q, p.queries - i0), g = h / rep;
        std::fill(acc.begin(), acc.end(), Acc(0));
        std::fill(rows.begin(), rows.end(), softmax_row<Acc>{});
        for (std::int64_t j0 = 0; j0 < key_end(p, i0 + bq - 1); j0 += block_k) {
          const std::int64_t bk = std::min(block_k, p.keys - j0);
          for (std::int64_t r = 0; r < bq; ++r) {
            const std::int64_t i = i0 + r;
            const T* qi = q.at(n, h) + i * q.row_stride;
            Acc tile_max = Acc(-INFINITY);
            for (std::int64_t c = 0; c < bk; ++c) {
              const std::int64_t j = j0 + c;
              s[std::size_t(c)] = masked_score(detail::dot<Acc>(qi, k.at(n, g) + j * k.row_stride, D), scale,
                                               visible(p, n, i, j));
              tile_max = std::max(tile_max, s[std::size_t(c)]);
            }
            softmax_row<Acc>& row = rows[std::size_t(r)];
            const Acc alpha = raise_max(row, tile_max);
            Acc* o = acc.data() + r * D;
            for (std::int64_t d = 0; d < D; ++d) o[d] *= alpha;
            Acc tile_sum = Acc(0);
            for (std::int64_t c = 0; c < bk; ++c) {
              const std::int64_t j = j0 + c;
              const Acc w = unnormalised_weight(s[std::size_t(c)], row);
              tile_sum += w;
              const Acc keep = keep_scale(p, kept, n, h, i, j);
              const Acc wd = tensor_cores ? (keep != Acc(0) ? detail::rounded<Operand>(w) : Acc(0))
                                          : detail::rounded<Operand>(w * keep);
              const T* vj = v.at(n, g) + j * v.row_stride;
              for (std::int64_t d = 0; d < D; ++d) o[d] += wd * Acc(vj[d]);
            }
            row.sum += tile_sum;
          }
        }
        for (std::int64_t r = 0; r < bq; ++r) {
          const softmax_row<Acc>& row = rows[std::size_t(r)];
          const Acc f = output_scale(row) * (tensor_cores && p.dropout ? kept : Acc(1));
          T* o = out.at(n, h) + (i0 + r) * out.row_stride;
          for (std::int64_t d = 0; d < D; ++d) o[d] = T(acc[std::size_t(r * D + d)] * f);
          lse[(n * p.heads + h) * p.queries + i0 + r] = log_sum_exp(row);
        }
      }
}

// dq, dk and dv are overwritten; lse is forward's.
template <class Acc, class T, class Operand = Acc>
void backward_tiles(const nn::head_view<const T>& q, const nn::head_view<const T>& k, const nn::head_view<const T>& v,
                    const nn::head_view<const T>& out, const nn::head_view<const T>& dout, const Acc* lse,
                    const nn::head_view<T>& dq, const nn::head_view<T>& dk, const nn::head_view<T>& dv,
                    const tile_problem& p, Acc scale, std::int64_t block_q, std::int64_t block_k) {
  const std::int64_t D = q.dim, rep = p.heads / p.kv_heads;
  const Acc kept = Acc(p.kept);
  std::vector<Acc> row_d(std::size_t(p.batch * p.heads * p.queries));
  for (std::int64_t n = 0; n < p.batch; ++n)
    for (std::int64_t h = 0; h < p.heads; ++h)
      for (std::int64_t i = 0; i < p.queries; ++i)
        row_d[std::size_t((n * p.heads + h) * p.queries + i)] =
            detail::dot<Acc>(dout.at(n, h) + i * dout.row_stride, out.at(n, h) + i * out.row_stride, D);
  // The recomputed (weight, dropout factor, score gradient) of element (n, h, i, j).
  struct element {
    Acc p, keep, ds;
  };
  const auto recompute = [&](std::int64_t n, std::int64_t h, std::int64_t i, std::int64_t j) {
    const std::int64_t g = h / rep, row = (n * p.heads + h) * p.queries + i;
    const T* qi = q.at(n, h) + i * q.row_stride;
    const Acc s = masked_score(detail::dot<Acc>(qi, k.at(n, g) + j * k.row_stride, D), scale, visible(p, n, i, j));
    const Acc w = weight(s, lse[row]), keep = keep_scale(p, kept, n, h, i, j);
    const Acc dp = detail::dot<Acc>(dout.at(n, h) + i * dout.row_stride, v.at(n, g) + j * v.row_stride, D);
    return element{w, keep, detail::rounded<Operand>(score_grad(w, dp, keep, row_d[std::size_t(row)]))};
  };

  std::vector<Acc> gk(std::size_t(block_k * D)), gv(std::size_t(block_k * D)), gq(std::size_t(block_q * D));
  for (std::int64_t n = 0; n < p.batch; ++n)
    for (std::int64_t g = 0; g < p.kv_heads; ++g)
      for (std::int64_t j0 = 0; j0 < p.keys; j0 += block_k) {
        const std::int64_t bk = std::min(block_k, p.keys - j0);
        std::fill(gk.begin(), gk.end(), Acc(0));
        std::fill(gv.begin(), gv.end(), Acc(0));
        for (std::int64_t h = g * rep; h < (g + 1) * rep; ++h)
          for (std::int64_t i0 = query_begin(p, j0) / block_q * block_q; i0 < p.queries; i0 += block_q)
            for (std::int64_t r = 0; r < std::min(block_q, p.queries - i0); ++r)
              for (std::int64_t c = 0; c < bk; ++c) {
                const std::int64_t i = i0 + r;
                const element e = recompute(n, h, i, j0 + c);
                const T* qi = q.at(n, h) + i * q.row_stride;
                const T* doi = dout.at(n, h) + i * dout.row_stride;
                for (std::int64_t d = 0; d < D; ++d) {
                  gv[std::size_t(c * D + d)] += detail::rounded<Operand>(e.p * e.keep) * Acc(doi[d]);
                  gk[std::size_t(c * D + d)] += e.ds * Acc(qi[d]);
                }
              }
        for (std::int64_t c = 0; c < bk; ++c)
          for (std::int64_t d = 0; d < D; ++d) {
            dk.at(n, g)[(j0 + c) * dk.row_stride + d] = T(scale * gk[std::size_t(c * D + d)]);
            dv.at(n, g)[(j0 + c) * dv.row_stride + d] = T(gv[std::size_t(c * D + d)]);
          }
      }
  for (std::int64_t n = 0; n < p.batch; ++n)
    for (std::int64_t h = 0; h < p.heads; ++h)
      for (std::int64_t i0 = 0; i0 < p.queries; i0 += block_q) {
        const std::int64_t bq = std::min(block_q, p.queries - i0), g = h / rep;
        std::fill(gq.begin(), gq.end(), Acc(0));
        for (std::int64_t j0 = 0; j0 < key_end(p, i0 + bq - 1); j0 += block_k)
          for (std::int64_t r = 0; r < bq; ++r)
            for (std::int64_t c = 0; c < std::min(block_k, p.keys - j0); ++c) {
              const element e = recompute(n, h, i0 + r, j0 + c);
              const T* kj = k.at(n, g) + (j0 + c) * k.row_stride;
              for (std::int64_t d = 0; d < D; ++d) gq[std::size_t(r * D + d)] += e.ds * Acc(kj[d]);
            }
        for (std::int64_t r = 0; r < bq; ++r)
          for (std::int64_t d = 0; d < D; ++d)
            dq.at(n, h)[(i0 + r) * dq.row_stride + d] = T(scale * gq[std::size_t(r * D + d)]);
      }
}

}  // namespace shardlib::ops::flash
