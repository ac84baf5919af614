// shardlib/ops/cuda/flash_tensor_kernels.cuh — the fused attention's kernels on
// tensor cores: bfloat16 or half inputs, head_dim up to 128, sm_80 and later.
//
// The arithmetic is ops/attention_tiles.hpp's with Operand = the input type: the
// products Q K^T, dO V^T, P V, P^T dO, dS^T Q and dS K run as 16x16x16 wmma tiles
// with 16-bit operands and fp32 accumulation, so the weights P (dropout applied)
// and the score gradients dS are rounded to the input type before they multiply,
// as in FlashAttention-2; the online softmax, masks, dropout and every sum stay in
// fp32. tests/unit/test_attention_tiles.cpp runs that arithmetic on the host
// (forward_tiles / backward_tiles with Operand = bfloat16 or half, these tiles);
// tests/emulated/test_emulated_attention.cpp runs these kernels themselves on the CPU.
//
// A block of 4 warps takes 64 queries (or, for dk and dv, 64 keys), 16 rows per
// warp, one wmma tile high. Tiles are staged in shared memory in the input type,
// rows padded by 8 elements (16 bytes) against bank conflicts; a warp stores its
// 16 x 64 scores in fp32, applies the softmax row by row (lanes along keys,
// shuffles for the row's maximum and sum) and writes its weights in the input
// type for the next product. Forward keeps the output accumulator in shared
// memory (fp32), because the online softmax rescales it by row and a wmma
// accumulator's element layout is unspecified; backward's dq, dk and dv never
// rescale and stay in accumulator fragments until the end.
//
// Tiles come in by cp.async (16 bytes per copy), the next while the warps work on
// the current one: forward and dq keep one K and one V tile and fetch K_{j+1}
// (forward) or V_{j+1} (dq) as soon as every warp is done with this tile's; dk/dv
// double-buffer the query tiles (Q, dO, lse, D), its heaviest loop. Shared memory
// per block at head_dim 128: forward 112,640 bytes, dq 113,664, dk/dv 158,720 (an
// sm_80 or sm_90 GPU holds them; one with less falls back to the CUDA-core kernels).
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

// One block per (query tile, head, batch element).
template <int DM, class T>
__global__ void __launch_bounds__(warps * 32) forward_kernel(forward_args<T> a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int rp = row_pitch<DM>, ap = acc_pitch<DM>;
  const flash::tile_problem& p = a.p;
  const query_block b(p);
  const int lane = b.lane, warp = b.warp;
  const std::int64_t i0 = b.i0, h = b.h, n = b.n, g = b.g, first = b.first;
  const float kept = float(p.kept);
  extern __shared__ __align__(128) unsigned char smem[];
  carve c{smem};
  T* qs = c.take<T>(tile * rp);
  T* ks = c.take<T>(tile * rp);
  T* vs = c.take<T>(tile * rp);
  T* pw = c.take<T>(tile * weight_pitch) + warp * edge * weight_pitch;       // the warp's weights
  float* sw = c.take<float>(tile * score_pitch) + warp * edge * score_pitch;  // and scores
  float* oa = c.take<float>(tile * ap);                                       // the output accumulator
  float* ow = oa + warp * edge * ap;                                          // and the warp's rows

  // K and V go in separate groups, the next tile's as soon as this tile's is read:
  // V_j lands while the warps compute Q K_j^T and the softmax, K_{j+1} during P V_j.
  const std::int64_t i_last = last_row(i0, tile, p.queries), end = flash::key_end(p, i_last);
  if (end > 0) {  // else nothing is read (and no copy is left in flight at the end)
    stage<DM>(qs, a.q, n, h, i0, p.queries, a.dim);
    stage<DM>(ks, a.k, n, g, 0, p.keys, a.dim);
  }
  __pipeline_commit();
  if (end > 0) stage<DM>(vs, a.v, n, g, 0, p.keys, a.dim);
  __pipeline_commit();
  for (int e = int(threadIdx.x); e < tile * ap; e += int(blockDim.x)) oa[e] = 0.0f;
  __syncthreads();  // read below even when no key tile comes
  flash::softmax_row<float> row[edge];
  const bool warp_rows = first < p.queries;  // the warp has rows; then its last is
  const std::int64_t warp_last = warp_rows ? last_row(first, edge, p.queries) : i_last;
  for (std::int64_t j0 = 0; j0 < end; j0 += tile) {
    const bool next = j0 + tile < end;
    const bool seen = warp_rows && j0 < flash::key_end(p, warp_last);  // a row of this warp sees a key of the tile
    landed<1>();  // Q and K_j (V_j may still be on its way)
    if (seen) scores<DM>(sw, qs + warp * edge * rp, ks);
    __syncthreads();  // every warp is done with K_j (and has its scores)
    if (next) stage<DM>(ks, a.k, n, g, j0 + tile, p.keys, a.dim);
    __pipeline_commit();
    if (seen) {
#pragma unroll
      for (int r = 0; r < edge; ++r) {  // lanes along keys: lane and lane + 32
        const std::int64_t i = first + r;
        float s[2];
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const std::int64_t j = j0 + lane + 32 * x;
          const bool vis = i < p.queries && j < p.keys && flash::visible(p, n, i, j);
          s[x] = flash::masked_score(sw[r * score_pitch + lane + 32 * x], a.scale, vis);
        }
        const float alpha = flash::raise_max(row[r], fused::warp_max(fmaxf(s[0], s[1])));
        float sum = 0.0f;
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const std::int64_t j = j0 + lane + 32 * x;
          const float e = flash::unnormalised_weight(s[x], row[r]);
          sum += e;
          pw[r * weight_pitch + lane + 32 * x] = T(e != 0.0f ? e * flash::keep_scale(p, kept, n, h, i, j) : 0.0f);
        }
        row[r].sum += fused::warp_sum(sum);
        for (int d = lane; d < DM; d += 32) ow[r * ap + d] *= alpha;
      }
    }
    landed<1>();  // V_j (K_{j+1} may still be on its way)
    if (seen) {
#pragma unroll
      for (int dc = 0; dc < DM / edge; ++dc) {  // O = alpha O + P V, 16 columns at a time
        accumulator o;
        wmma::load_matrix_sync(o, ow + dc * edge, unsigned(ap), wmma::mem_row_major);
        multiply<tile, false>(o, pw, weight_pitch, vs + dc * edge, rp);
        wmma::store_matrix_sync(ow + dc * edge, o, unsigned(ap), wmma::mem_row_major);
      }
    }
    __syncthreads();  // every warp is done with V_j
    if (next) stage<DM>(vs, a.v, n, g, j0 + tile, p.keys, a.dim);
    __pipeline_commit();
  }
#pragma unroll
  for (int r = 0; r < edge; ++r) {  // unrolled, as every loop over row[]: the array stays in registers
    const std::int64_t i = first + r;
    if (i >= p.queries) continue;
    const float f = flash::output_scale(row[r]);
    for (int d = lane; d < DM; d += 32) ow[r * ap + d] *= f;
    if (lane == 0) a.lse[(n * p.heads + h) * p.queries + i] = flash::log_sum_exp(row[r]);
  }
  __syncwarp();
  store_rows<DM>(a.out, n, h, first, p.queries, ow, 1.0f, a.dim);
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
  const query_block b(p);
  const int lane = b.lane, warp = b.warp;
  const std::int64_t i0 = b.i0, h = b.h, n = b.n, g = b.g, first = b.first;
  const float kept = float(p.kept);
  extern __shared__ __align__(128) unsigned char smem[];
  carve c{smem};
  T* qs = c.take<T>(tile * rp);
  T* dos = c.take<T>(tile * rp);
  T* ks = c.take<T>(tile * rp);
  T* vs = c.take<T>(tile * rp);
  T* dsw = c.take<T>(tile * weight_pitch) + warp * edge * weight_pitch;  // the warp's score gradients,
  float* sc = c.take<float>(tile * score_pitch);                         // scores
  float* sw = sc + warp * edge * score_pitch;
  float* dpw = c.take<float>(tile * score_pitch) + warp * edge * score_pitch;  // and weight gradients

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
  float lse[edge], row_d[edge];
#pragma unroll
  for (int r = 0; r < edge; ++r) {
    const std::int64_t i = first + r, x = (n * p.heads + h) * p.queries + i;
    lse[r] = i < p.queries ? a.lse[x] : INFINITY;
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
    landed<1>();                                                   // Q, dO and V_j (K_j may still be on its way)
    if (seen) scores<DM>(dpw, dos + warp * edge * rp, vs);        // dO V^T
    landed<0>();                                                   // K_j; every warp is done with V_j
    if (next) stage<DM>(vs, a.v, n, g, j0 + tile, p.keys, a.dim);
    __pipeline_commit();
    if (seen) {
      scores<DM>(sw, qs + warp * edge * rp, ks);  // Q K^T
      __syncwarp();
#pragma unroll
      for (int r = 0; r < edge; ++r) {
        const std::int64_t i = first + r;
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int c = lane + 32 * x;
          const std::int64_t j = j0 + c;
          const bool vis = i < p.queries && j < p.keys && flash::visible(p, n, i, j);
          const float w = flash::weight(flash::masked_score(sw[r * score_pitch + c], a.scale, vis), lse[r]);
          const float ds = w != 0.0f ? flash::score_grad(w, dpw[r * score_pitch + c],
                                                         flash::keep_scale(p, kept, n, h, i, j), row_d[r])
                                     : 0.0f;
          dsw[r * weight_pitch + c] = T(ds);
        }
      }
      __syncwarp();
#pragma unroll
      for (int dc = 0; dc < DM / edge; ++dc) multiply<tile, false>(gq[dc], dsw, weight_pitch, ks + dc * edge, rp);
    }
    __syncthreads();  // every warp is done with K_j and, after the last tile, with the scores' memory
    if (next) stage<DM>(ks, a.k, n, g, j0 + tile, p.keys, a.dim);
    __pipeline_commit();
  }
  // The scores' memory takes the accumulators on their way out.
  write_rows<DM>(a.dq, n, h, first, p.queries, sc + warp * edge * acc_pitch<DM>, gq, a.scale, a.dim);
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
  const std::int64_t j0 = std::int64_t(blockIdx.x) * tile, g = blockIdx.y, n = blockIdx.z;
  const std::int64_t rep = p.heads / p.kv_heads, first = j0 + warp * edge;
  const float kept = float(p.kept);
  extern __shared__ __align__(128) unsigned char smem[];
  carve c{smem};
  T* ks = c.take<T>(tile * rp);
  T* vs = c.take<T>(tile * rp);
  constexpr int buffers = query_buffers<DM>;
  T* const qs = c.take<T>(buffers * tile * rp);  // query tiles, buffer b at b * tile * rp
  T* const dos = c.take<T>(buffers * tile * rp);
  T* ptw = c.take<T>(tile * weight_pitch) + warp * edge * weight_pitch;   // the warp's P^T (dropped),
  T* dstw = c.take<T>(tile * weight_pitch) + warp * edge * weight_pitch;  // dS^T,
  float* st = c.take<float>(tile * score_pitch);                          // S^T
  float* stw = st + warp * edge * score_pitch;
  float* dptw = c.take<float>(tile * score_pitch) + warp * edge * score_pitch;  // and dP^T
  float* const lse = c.take<float>(buffers * tile);                             // the query tiles'
  float* const row_d = c.take<float>(buffers * tile);

  // Tiles go head by head over the kv head's query heads, from the first query tile that
  // can see a key of this block. With two buffers, tile t + 1 is copied into the other
  // while the warps work on tile t; with one, each tile is copied when the last is done.
  const std::int64_t start = flash::query_begin(p, j0) / tile * tile;
  const auto stage_queries = [&](int b, std::int64_t h, std::int64_t i0) {
    stage<DM>(qs + b * tile * rp, a.q, n, h, i0, p.queries, a.dim);
    stage<DM>(dos + b * tile * rp, a.dout, n, h, i0, p.queries, a.dim);
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
    if constexpr (buffers == 2) stage_queries(0, g * rep, start);
  }
  __pipeline_commit();
  accumulator gk[DM / edge], gv[DM / edge];
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc) {
    wmma::fill_fragment(gk[dc], 0.0f);
    wmma::fill_fragment(gv[dc], 0.0f);
  }
  int b = 0;
  for (std::int64_t h = g * rep, i0 = start; start < p.queries && h < (g + 1) * rep; b = (b + 1) % buffers) {
    const std::int64_t next_h = i0 + tile < p.queries ? h : h + 1, next_i0 = i0 + tile < p.queries ? i0 + tile : start;
    if constexpr (buffers == 2) {
      if (next_h < (g + 1) * rep) stage_queries(b ^ 1, next_h, next_i0);
    } else {
      stage_queries(0, h, i0);
    }
    __pipeline_commit();
    landed<buffers - 1>();  // K, V and query tile t (with two buffers, t + 1 may still be on its way)
    // The warp's keys start at `first`: past the tile's last query's causal limit, or past the keys, none is seen.
    if (first < flash::key_end(p, last_row(i0, tile, p.queries))) {
      const T* q = qs + b * tile * rp;
      const T* dout = dos + b * tile * rp;
      const float* tile_lse = lse + b * tile;
      const float* tile_d = row_d + b * tile;
      scores<DM>(stw, ks + warp * edge * rp, q);     // K Q^T = S^T
      scores<DM>(dptw, vs + warp * edge * rp, dout);  // V dO^T = dP^T
      __syncwarp();
#pragma unroll
      for (int r = 0; r < edge; ++r) {  // key first + r; lanes along queries
        const std::int64_t j = first + r;
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int c = lane + 32 * x;
          const std::int64_t i = i0 + c;
          const bool vis = i < p.queries && j < p.keys && flash::visible(p, n, i, j);
          const float w = flash::weight(flash::masked_score(stw[r * score_pitch + c], a.scale, vis), tile_lse[c]);
          const float keep = w != 0.0f ? flash::keep_scale(p, kept, n, h, i, j) : 0.0f;
          dstw[r * weight_pitch + c] = T(flash::score_grad(w, dptw[r * score_pitch + c], keep, tile_d[c]));
          ptw[r * weight_pitch + c] = T(w * keep);
        }
      }
      __syncwarp();
#pragma unroll
      for (int dc = 0; dc < DM / edge; ++dc) {
        multiply<tile, false>(gv[dc], ptw, weight_pitch, dout + dc * edge, rp);  // dV += P^T dO
        multiply<tile, false>(gk[dc], dstw, weight_pitch, q + dc * edge, rp);    // dK += dS^T Q
      }
    }
    __syncthreads();  // every warp is done with tile t's buffer, which tile t + buffers takes (and with S^T, dP^T)
    h = next_h;
    i0 = next_i0;
  }
  // The scores' memory takes the accumulators on their way out.
  float* through = st + warp * edge * acc_pitch<DM>;
  write_rows<DM>(a.dk, n, g, first, p.keys, through, gk, a.scale, a.dim);
  __syncwarp();
  write_rows<DM>(a.dv, n, g, first, p.keys, through, gv, 1.0f, a.dim);
#else
  __trap();
#endif
}

}  // namespace shardlib::ops::cuda::detail::tensor
