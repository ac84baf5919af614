// shardlib/ops/cuda/flash_tensor_kernels.cuh — the fused attention's kernels on
// tensor cores: bfloat16 or half inputs, head_dim up to 128, sm_80 and later.
//
// The arithmetic is ops/attention_tiles.hpp's with Operand = the input type: the
// products Q K^T, dO V^T, P V, P^T dO, dS^T Q and dS K run as 16x16x16 tiles on the
// tensor cores (flash_tensor_products.cuh: products, accumulate) with 16-bit operands
// and fp32 accumulation, so the weights P and the score gradients dS are rounded to
// the input type before they multiply, as in FlashAttention-2 (forward rounds a
// weight before dropout, whose 1 / (1 - p) then scales its output in fp32; backward
// after); the online softmax, masks, dropout and every sum stay in fp32, exp on the
// special-function unit. tests/unit/test_attention_tiles.cpp runs that arithmetic on
// the host (forward_tiles / backward_tiles with Operand = bfloat16 or half, these
// tiles); tests/emulated/test_emulated_attention.cpp runs these kernels themselves on
// the CPU.
//
// A block of 4 warps takes 64 queries (or, for dk and dv, 64 keys), 16 rows per
// warp, one wmma tile high. K, V and query tiles are staged in shared memory in the
// input type, rows padded by 8 elements (16 bytes) against bank conflicts. What a
// warp computes stays in its registers: the scores and their gradients are
// accumulators the softmax reads and rewrites element by element (a lane knows each
// element's row and column: flash_tensor_products.cuh), rows reduced across the 4 lanes
// that share them, masks decided per tile (most tiles need no test per element); the
// output, dq, dk and dv accumulate in fragments, forward's rescaled there by the online
// softmax. Forward's weights P and dq's score gradients dS become the next product's
// operand in registers (row_operand; forward multiplies each 16-key chunk by its rows of V
// as soon as it is made, its dropped weights zeroed there); dk/dv's P^T and dS^T pass
// through shared memory (16 rows x 64 in T per warp), which keeps both until their products
// after the halves; the finished rows go out through the staged tiles' memory, 16 bytes per
// store.
//
// Tiles come in by cp.async (16 bytes per copy), the next while the warps work on
// the current one: forward and dq keep one K and one V tile and fetch K_{j+1}
// (forward) or V_{j+1} (dq) as soon as every warp is done with this tile's; dk/dv
// double-buffers Q (with lse and D) and fetches dO_{t+1} once every warp is done with
// dO_t. Shared memory per block at head_dim 128: forward 52,224 bytes, dq 69,632,
// dk/dv 106,496 (each two blocks per SM on an H100 or H200 at least).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/attention_tiles.hpp"
#include "shardlib/ops/cuda/flash_kernels.cuh"  // forward_args, backward_args, warp_max, warp_sum, last_row
#include "shardlib/ops/cuda/flash_tensor_tiles.cuh"

#include <cuda_pipeline.h>  // __pipeline_commit, __pipeline_wait_prior
#include <cuda_runtime.h>

#include <cmath>    // INFINITY
#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda::detail::tensor {
using fused::backward_args;
using fused::forward_args;
using fused::last_row;

// One block per (query tile, head, batch element), the longest first (block_place); one
// kernel with dropout and one without (p.dropout picks), so that the generator's registers
// do not count against the kernel that runs without it.
template <int DM, class T, bool Dropout = false>
__global__ void __launch_bounds__(warps * 32) forward_kernel(forward_args<T> a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int rp = row_pitch<DM>;
  const flash::tile_problem& p = a.p;
  const query_block b(p, a.longest_first);
  const int lane = b.lane, warp = b.warp;
  const std::int64_t i0 = b.i0, h = b.h, n = b.n, g = b.g, first = b.first;
  const float kept = float(p.kept), scale2 = a.scale * log2e;  // exp_less's k: the scale in base 2
  extern __shared__ __align__(128) unsigned char smem[];
  carve c{smem};
  T* qs = c.take<T>(tile * rp);
  T* ks = c.take<T>(tile * rp);
  T* vs = c.take<T>(tile * rp);

  // K and V go in separate groups, the next tile's as soon as this tile's is read:
  // V_j lands while the warps compute Q K_j^T, K_{j+1} during the softmax and P V_j.
  const std::int64_t i_last = last_row(i0, tile, p.queries), end = flash::key_end(p, i_last);
  if (end > 0) {  // else nothing is read (and no copy is left in flight at the end)
    stage<DM>(qs, a.q, n, h, i0, p.queries, a.dim);
    stage<DM>(ks, a.k, n, g, 0, p.keys, a.dim);
  }
  __pipeline_commit();
  if (end > 0) stage<DM>(vs, a.v, n, g, 0, p.keys, a.dim);
  __pipeline_commit();
  accumulator o[DM / edge];
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc) wmma::fill_fragment(o[dc], 0.0f);
  flash::softmax_row<float> row[slots];
  const bool warp_rows = first < p.queries;  // the warp has rows; then its last is
  const std::int64_t warp_last = warp_rows ? last_row(first, edge, p.queries) : i_last;
  for (std::int64_t j0 = 0; j0 < end; j0 += tile) {
    const bool next = j0 + tile < end;
    const bool seen = warp_rows && j0 < flash::key_end(p, warp_last);  // a row of this warp sees a key of the tile
    landed<1>();  // Q and K_j (V_j may still be on its way)
    accumulator s[chunks];
    if (seen) products<DM>(s, qs + warp * edge * rp, ks);
    __syncthreads();  // every warp is done with K_j
    if (next) stage<DM>(ks, a.k, n, g, j0 + tile, p.keys, a.dim);
    __pipeline_commit();
    // P V runs chunk by chunk inside the softmax: V_j first (FlashAttention-2's order)
    landed<1>();  // V_j (K_{j+1} may still be on its way)
    if (seen) {
      const tile_view v = query_rows(p, n, first, j0);
      float top[slots], alpha[slots], sum[slots], max2[slots];
#pragma unroll
      for (int r = 0; r < slots; ++r) top[r] = -INFINITY;
      with_flags(v.all, [&](auto all) {
#pragma unroll
        for (int cc = 0; cc < chunks; ++cc)
#pragma unroll
          for (int e = 0; e < accumulator::num_elements; ++e) {
            const bool vis = all.value || v.sees(row_of(slot_of(e), lane), cc * edge + column_of(e, lane));
            s[cc].x[e] = vis ? s[cc].x[e] : -INFINITY;  // the product q.k, unscaled
            top[slot_of(e)] = fmaxf(top[slot_of(e)], s[cc].x[e]);
          }
      });
      bool raised = false;  // a row's max moved: alpha != 1 (or NaN)
#pragma unroll
      for (int r = 0; r < slots; ++r) {
        alpha[r] = flash::raise_max(row[r], row_max(top[r]) * a.scale);  // max(scale x) = scale max(x): scale > 0
        sum[r] = 0.0f;
        max2[r] = log2_scaled(row[r].max);
        raised = raised || !(alpha[r] == 1.0f);
      }
      if (__any_sync(0xffffffffu, raised))  // O = alpha O; else O = 1 O: skipped, exactly
#pragma unroll
        for (int dc = 0; dc < DM / edge; ++dc)
#pragma unroll
          for (int e = 0; e < accumulator::num_elements; ++e) o[dc].x[e] *= alpha[slot_of(e)];
      // Each 16-key chunk of weights becomes the operand of its part of P V in registers
      // (row_operand) and is multiplied at once, as FlashAttention-2 does; with dropout the
      // lane draws its chunk's group (lane_group) and zeroes the dropped weights there, after
      // the row's sum has taken them.
#pragma unroll
      for (int cc = 0; cc < chunks; ++cc) {
        row_operand<T> pc;
        std::uint32_t group = 0;
        if constexpr (Dropout)
          group = lane_group(p, n, h, first + row_of(slot_of(0), lane), j0 + cc * edge + column_of(0, lane));
#pragma unroll
        for (int e = 0; e < accumulator::num_elements; e += 2) {  // two neighbours in a row
          const int r = slot_of(e), rr = row_of(r, lane), col = cc * edge + column_of(e, lane);
          float w[2];
#pragma unroll
          for (int x = 0; x < 2; ++x) {  // flash::unnormalised_weight by exp_less, the scale folded in
            w[x] = exp_less(s[cc].x[e + x], scale2, max2[r]);
            sum[r] += w[x];
            if constexpr (Dropout) w[x] = lane_keep(p, group, 1.0f, n, h, first + rr, j0 + col + x) != 0.0f ? w[x] : 0.0f;
          }
          set_pair<T>(pc, e, w[0], w[1]);
        }
        accumulate_chunk<DM>(o, pc, vs + cc * edge * rp);  // O += P_cc V_cc
      }
#pragma unroll
      for (int r = 0; r < slots; ++r) row[r].sum += row_sum(sum[r]);
    }
    __syncthreads();  // every warp is done with V_j
    if (next) stage<DM>(vs, a.v, n, g, j0 + tile, p.keys, a.dim);
    __pipeline_commit();
  }
  float f[slots];
#pragma unroll
  for (int r = 0; r < slots; ++r) {  // unrolled, as every loop over row[]: the array stays in registers
    const std::int64_t i = first + row_of(r, lane);
    f[r] = flash::output_scale(row[r]) * (Dropout ? kept : 1.0f);  // dropout's 1 / (1 - p), in fp32
    if (writes_row(lane) && i < p.queries) a.lse[(n * p.heads + h) * p.queries + i] = flash::log_sum_exp(row[r]);
  }
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc)
#pragma unroll
    for (int e = 0; e < accumulator::num_elements; ++e) o[dc].x[e] *= f[slot_of(e)];
  // Every warp is past the loop's last barrier: the staged tiles' memory takes the rows out.
  write_rows<DM>(a.out, n, h, first, p.queries, reinterpret_cast<float*>(ks) + warp * edge * acc_pitch<DM>, o, 1.0f,
                 a.dim);
#else
  __trap();  // never launched: tensor_kernel_usable() requires code built for sm_80 or later
#endif
}

// dq: one block per (query tile, head, batch element), laid out as forward.
template <int DM, class T>
__global__ void __launch_bounds__(warps * 32) dq_kernel(backward_args<T> a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int rp = row_pitch<DM>;
  const flash::tile_problem& p = a.p;
  const query_block b(p, a.longest_first);
  const int lane = b.lane, warp = b.warp;
  const std::int64_t i0 = b.i0, h = b.h, n = b.n, g = b.g, first = b.first;
  const float kept = float(p.kept), scale2 = a.scale * log2e;  // exp_less's k: the scale in base 2
  extern __shared__ __align__(128) unsigned char smem[];
  carve c{smem};
  T* qs = c.take<T>(tile * rp);
  T* dos = c.take<T>(tile * rp);
  T* ks = c.take<T>(tile * rp);
  T* vs = c.take<T>(tile * rp);

  // V before K, in separate groups, the next tile's as soon as this tile's is read:
  // V_{j+1} lands while the warps compute Q K_j^T, dS and dS K_j, K_{j+1} during dO V_{j+1}^T.
  const std::int64_t i_last = last_row(i0, tile, p.queries), end = flash::key_end(p, i_last);
  if (end > 0) {  // else nothing is read (and no copy is left in flight at the end)
    stage<DM>(qs, a.q, n, h, i0, p.queries, a.dim);
    stage<DM>(dos, a.dout, n, h, i0, p.queries, a.dim);
    stage<DM>(vs, a.v, n, g, 0, p.keys, a.dim);
  }
  __pipeline_commit();
  if (end > 0) stage<DM>(ks, a.k, n, g, 0, p.keys, a.dim);
  __pipeline_commit();
  float lse2[slots], row_d[slots];  // log2_scaled(lse)
#pragma unroll
  for (int r = 0; r < slots; ++r) {
    const std::int64_t i = first + row_of(r, lane), x = (n * p.heads + h) * p.queries + i;
    lse2[r] = log2_scaled(i < p.queries ? a.lse[x] : INFINITY);
    row_d[r] = i < p.queries ? a.row_d[x] : 0.0f;
  }
  accumulator gq[DM / edge];
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc) wmma::fill_fragment(gq[dc], 0.0f);
  const bool warp_rows = first < p.queries;
  const std::int64_t warp_last = warp_rows ? last_row(first, edge, p.queries) : i_last;
  for (std::int64_t j0 = 0; j0 < end; j0 += tile) {
    const bool next = j0 + tile < end;
    const bool seen = warp_rows && j0 < flash::key_end(p, warp_last);
    landed<1>();  // Q, dO and V_j (K_j may still be on its way)
    accumulator dp[chunks], s[chunks];
    row_operand<T> dsr[chunks];  // the warp's score gradients
    if (seen) products<DM>(dp, dos + warp * edge * rp, vs);  // dO V^T
    landed<0>();                                             // K_j; every warp is done with V_j
    if (next) stage<DM>(vs, a.v, n, g, j0 + tile, p.keys, a.dim);
    __pipeline_commit();
    if (seen) {
      products<DM>(s, qs + warp * edge * rp, ks);  // Q K^T
      const tile_view v = query_rows(p, n, first, j0);
      with_flags(v.all, [&](auto all) {
#pragma unroll
        for (int cc = 0; cc < chunks; ++cc) {
          const std::uint32_t group =
              p.dropout ? lane_group(p, n, h, first + row_of(slot_of(0), lane), j0 + cc * edge + column_of(0, lane)) : 0;
#pragma unroll
          for (int e = 0; e < accumulator::num_elements; e += 2) {  // two neighbours in a row
            const int r = slot_of(e), rr = row_of(r, lane), col = cc * edge + column_of(e, lane);
            float ds[2];
#pragma unroll
            for (int x = 0; x < 2; ++x) {  // flash::weight by exp_less, then the score's gradient
              const float w = all.value || v.sees(rr, col + x) ? exp_less(s[cc].x[e + x], scale2, lse2[r]) : 0.0f;
              const float keep = p.dropout ? lane_keep(p, group, kept, n, h, first + rr, j0 + col + x) : 1.0f;
              // a hidden key's gradient is 0 even where dO . v is not finite (an inf in a value
              // row this query does not see); a wholly visible tile has none to test
              ds[x] = all.value || w != 0.0f ? flash::score_grad(w, dp[cc].x[e + x], keep, row_d[r]) : 0.0f;
            }
            set_pair<T>(dsr[cc], e, ds[0], ds[1]);  // the next product's operand, in registers
          }
        }
      });
      accumulate<DM>(gq, dsr, ks);  // dQ += dS K
    }
    __syncthreads();  // every warp is done with K_j
    if (next) stage<DM>(ks, a.k, n, g, j0 + tile, p.keys, a.dim);
    __pipeline_commit();
  }
  // Every warp is past the loop's last barrier: the staged tiles' memory takes the rows out.
  write_rows<DM>(a.dq, n, h, first, p.queries, reinterpret_cast<float*>(ks) + warp * edge * acc_pitch<DM>, gq,
                 a.scale, a.dim);
#else
  __trap();
#endif
}

// dk and dv: one block per (key tile, kv head, batch element), 16 keys per warp,
// over every query tile of every query head of the kv head.
template <int DM, class T>
__global__ void __launch_bounds__(warps * 32) dkdv_kernel(backward_args<T> a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int rp = row_pitch<DM>;
  const flash::tile_problem& p = a.p;
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const fused::block_place at = fused::key_block_place(a.longest_first);
  const std::int64_t j0 = at.tile * tile, g = at.head, n = at.batch;
  const std::int64_t rep = p.heads / p.kv_heads, first = j0 + warp * edge;
  const float kept = float(p.kept), scale2 = a.scale * log2e;  // exp_less's k: the scale in base 2
  extern __shared__ __align__(128) unsigned char smem[];
  carve c{smem};
  T* ks = c.take<T>(tile * rp);
  T* vs = c.take<T>(tile * rp);
  T* const qs = c.take<T>(2 * tile * rp);  // query tiles, buffer b at b * tile * rp
  T* const dos = c.take<T>(tile * rp);     // one dO tile
  T* ptw = c.take<T>(tile * weight_pitch) + warp * edge * weight_pitch;   // the warp's P^T (dropped)
  T* dstw = c.take<T>(tile * weight_pitch) + warp * edge * weight_pitch;  // and dS^T
  float* const lse = c.take<float>(2 * tile);                            // the query tiles'
  float* const row_d = c.take<float>(2 * tile);

  // Tiles go head by head over the kv head's query heads, from the first query tile that
  // can see a key of this block. Q_{t+1} (with its lse and D) is copied into the other
  // buffer while the warps work on tile t, dO_{t+1} into dO's once every warp is past
  // dV += P^T dO_t: one dO buffer keeps the block within half an SM's shared memory at
  // head_dim 128 (two blocks, 8 warps, per SM on an H100 or H200), and dO_{t+1} still
  // lands while the warps do dK += dS^T Q_t.
  const std::int64_t start = flash::query_begin(p, j0) / tile * tile;
  const auto stage_queries = [&](int b, std::int64_t h, std::int64_t i0) {
    stage<DM>(qs + b * tile * rp, a.q, n, h, i0, p.queries, a.dim);
    if (threadIdx.x < tile) {
      const std::int64_t i = i0 + threadIdx.x, x = (n * p.heads + h) * p.queries + i;
      const int at = b * tile + int(threadIdx.x);
      if (i < p.queries) {
        __pipeline_memcpy_async(lse + at, a.lse + x, 4);
        __pipeline_memcpy_async(row_d + at, a.row_d + x, 4);
      } else {
        lse[at] = INFINITY;
        row_d[at] = 0.0f;
      }
    }
  };
  if (start < p.queries) {  // else nothing is read (and no copy is left in flight at the end)
    stage<DM>(ks, a.k, n, g, j0, p.keys, a.dim);
    stage<DM>(vs, a.v, n, g, j0, p.keys, a.dim);
    stage_queries(0, g * rep, start);
    stage<DM>(dos, a.dout, n, g * rep, start, p.queries, a.dim);
  }
  __pipeline_commit();
  accumulator gk[DM / edge], gv[DM / edge];
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc) {
    wmma::fill_fragment(gk[dc], 0.0f);
    wmma::fill_fragment(gv[dc], 0.0f);
  }
  int b = 0;
  for (std::int64_t h = g * rep, i0 = start; start < p.queries && h < (g + 1) * rep; b ^= 1) {
    const std::int64_t next_h = i0 + tile < p.queries ? h : h + 1, next_i0 = i0 + tile < p.queries ? i0 + tile : start;
    const bool more = next_h < (g + 1) * rep;
    if (more) stage_queries(b ^ 1, next_h, next_i0);
    __pipeline_commit();
    landed<1>();  // K, V, Q_t and dO_t (Q_{t+1} may still be on its way)
    // The warp's keys start at `first`: past the tile's last query's causal limit, or past the keys, none is seen.
    const bool sees = first < flash::key_end(p, last_row(i0, tile, p.queries));
    const T* q = qs + b * tile * rp;
    if (sees) {
      const float* tile_lse = lse + b * tile;
      const float* tile_d = row_d + b * tile;
      const tile_view v = key_rows(p, n, first, i0);
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // 32 queries at a time: fewer registers
        // Dropout's decisions for the half's weights, 8 bits per group: two groups per chunk
        // (lane_group), drawn before the products' accumulators take their registers.
        static_assert(chunks == 4, "4 groups of 8 bits in 32");
        std::uint32_t groups = 0;
        if (p.dropout)
#pragma unroll
          for (int k = 0; k < chunks; ++k)  // chunk k / 2, query column k % 2 of the lane's pairs
            groups |= lane_group(p, n, h, i0 + half * (tile / 2) + (k >> 1) * edge + column_of(k & 1, lane),
                                 first + row_of(slot_of(0), lane))
                      << (8 * k);
        accumulator st[chunks / 2], dpt[chunks / 2];
        products<DM>(st, ks + warp * edge * rp, q + half * (tile / 2) * rp);      // K Q^T = S^T
        products<DM>(dpt, vs + warp * edge * rp, dos + half * (tile / 2) * rp);  // V dO^T = dP^T
        with_flags(v.all, p.dropout, [&](auto all, auto dropout) {
#pragma unroll
          for (int cc = 0; cc < chunks / 2; ++cc) {
            float lse2[column_slots], d[column_slots];  // the lane's queries' lse (base 2; never -inf) and D
#pragma unroll
            for (int j = 0; j < column_slots; ++j) {
              const int c = half * (tile / 2) + cc * edge + column_of_slot(j, lane);
              lse2[j] = tile_lse[c] * log2e;
              d[j] = tile_d[c];
            }
#pragma unroll
            for (int e = 0; e < accumulator::num_elements; e += 2) {  // key first + rr, queries i0 + col, col + 1
              const int rr = row_of(slot_of(e), lane), col = half * (tile / 2) + cc * edge + column_of(e, lane);
              float ds[2], pt[2];
#pragma unroll
              for (int x = 0; x < 2; ++x) {  // flash::weight by exp_less, its dropout and the score's gradient
                const int c = col + x, j = column_slot_of(e + x);
                const float w = all.value || v.sees(rr, c) ? exp_less(st[cc].x[e + x], scale2, lse2[j]) : 0.0f;
                // with dropout a hidden key's keep is 0 without the generator (without, keep 1 changes nothing)
                const float keep =
                    !dropout.value ? 1.0f : w == 0.0f ? 0.0f : lane_keep(p, groups >> (8 * (2 * cc + x)), kept, n, h, i0 + c, first + rr);
                ds[x] = flash::score_grad(w, dpt[cc].x[e + x], keep, d[j]);
                pt[x] = w * keep;
              }
              store_pair(dstw + rr * weight_pitch + col, ds[0], ds[1]);
              store_pair(ptw + rr * weight_pitch + col, pt[0], pt[1]);
            }
          }
        });
      }
      __syncwarp();
      accumulate<DM>(gv, ptw, dos);  // dV += P^T dO
    }
    __syncthreads();  // every warp is done with dO_t
    if (more) stage<DM>(dos, a.dout, n, next_h, next_i0, p.queries, a.dim);
    __pipeline_commit();
    if (sees) accumulate<DM>(gk, dstw, q);  // dK += dS^T Q
    __syncthreads();  // every warp is done with Q_t's buffer, which Q_{t+2} takes
    h = next_h;
    i0 = next_i0;
  }
  // Every warp is past the loop's last barrier: the staged tiles' memory takes the rows out.
  float* through = reinterpret_cast<float*>(ks) + warp * edge * acc_pitch<DM>;
  write_rows<DM>(a.dk, n, g, first, p.keys, through, gk, a.scale, a.dim);
  __syncwarp();
  write_rows<DM>(a.dv, n, g, first, p.keys, through, gv, 1.0f, a.dim);
#else
  __trap();
#endif
}

}  // namespace shardlib::ops::cuda::detail::tensor
