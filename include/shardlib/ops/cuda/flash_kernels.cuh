// shardlib/ops/cuda/flash_kernels.cuh — the fused attention's kernels on CUDA cores
// (any input type, head_dim up to 256) and what every fused-attention kernel shares:
// the options, row views, warp reductions, argument structs and the launch.
// ops/cuda/flash_attention.cuh chooses between these and the tensor-core kernels
// (ops/cuda/flash_tensor_kernels.cuh).
//
// The arithmetic is ops/attention_tiles.hpp's (tested on the host against
// nn::sdpa). A block of 4 warps takes 32 query rows (8 per
// warp) against tiles of 32 keys, one key per lane: a lane's score is a dot
// product over shared memory, the row's maximum and sum are warp shuffles, and
// each lane accumulates D / 32 columns of its warp's 8 output rows in registers
// (fp32). Tiles are staged in shared memory as fp32, K and V transposed with a
// padded row (33) so that both the score loop (lanes along keys) and the
// accumulation loop (lanes along columns) read without bank conflicts. Inputs
// may be float, bfloat16 or half (read and written as T, computed in fp32).
//
// Backward is deterministic, without atomics: a small kernel computes
// D_i = dO_i . O_i; one kernel per tile of 32 keys of a kv head walks every
// query tile of every query head sharing that kv head and writes dk, dv (the sum
// over the group is a loop inside one block); another per tile of 32 queries
// walks the key tiles and writes dq. Both recompute the weights from lse.
//
// The kernels' headers hold no launch (flash_attention.cuh launches them), so that
// tests/emulated runs these very kernels on the CPU.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"             // counter_rng
#include "shardlib/nn/sdpa.hpp"                 // head_view
#include "shardlib/ops/attention_tiles.hpp"

#include <cuda_runtime.h>

#include <cmath>     // std::sqrt, INFINITY
#include <cstddef>   // std::size_t
#include <cstdint>   // std::int64_t, std::uint8_t
#include <optional>  // std::optional

namespace shardlib::ops::cuda {

// What nn::sdpa_options carries, in device terms.
struct flash_options {
  bool is_causal = false;
  std::int64_t query_offset = 0;  // causal: query i sees keys j <= i + query_offset
  float scale = 0;                // 0 = 1/sqrt(head_dim)
  float dropout_p = 0;            // with `dropout` set
  std::optional<counter_rng> dropout{};
  const std::uint8_t* key_padding = nullptr;  // device [B, Lk], nonzero = padding; nullptr = none
  bool tensor_cores = true;  // bfloat16/half, head_dim <= 128, sm_80+: the tensor-core kernels; false: CUDA cores
  // Blocks start with the most causal work (detail::fused::block_place); false: each head's tiles
  // in turn, shortest first under a causal mask. The same results either way; bench_cuda times both.
  bool longest_first = true;
};

// The same view with read-only elements.
template <class T>
nn::head_view<const T> as_const(const nn::head_view<T>& v) {
  return {v.data, v.batch, v.heads, v.seq, v.dim, v.batch_stride, v.head_stride, v.row_stride};
}

namespace detail::fused {
namespace flash = shardlib::ops::flash;

inline constexpr int tile = 32;        // queries per block and keys per tile: one per lane
inline constexpr int warps = 4;        // per block; each takes tile / warps rows (or keys)
inline constexpr int per_warp = tile / warps;
inline constexpr int pitch = tile + 1;  // of a transposed tile: conflict-free both ways
inline constexpr int max_dim = 256;
inline constexpr int threads = tile * warps;  // per block, in both kernel sets

// A head_view's pointer and strides, for kernels.
template <class T>
struct rows {
  T* data;
  std::int64_t batch_stride, head_stride, row_stride;
  __device__ T* row(std::int64_t n, std::int64_t h, std::int64_t i) const {
    return data + n * batch_stride + h * head_stride + i * row_stride;
  }
};
template <class T>
rows<T> rows_of(const nn::head_view<T>& v) {
  return {v.data, v.batch_stride, v.head_stride, v.row_stride};
}

__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}
__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

// Rows [first, first + 32) of a head into shared memory as fp32, zero past
// `count` rows and past dim: row-major [32][DM] or transposed [DM][pitch].
template <int DM, bool Transposed, class T>
__device__ void stage(float* dst, const rows<const T>& src, std::int64_t n, std::int64_t h, std::int64_t first,
                      std::int64_t count, int dim) {
  for (int e = int(threadIdx.x); e < tile * DM; e += int(blockDim.x)) {
    const int r = e / DM, d = e % DM;
    const float x = r < count - first && d < dim ? float(src.row(n, h, first + r)[d]) : 0.0f;
    if constexpr (Transposed) dst[d * pitch + r] = x;
    else dst[e] = x;
  }
}

// Which tile of queries (or keys), head (or kv head) and batch element a block takes.
// The grids are (heads, batch, tiles) (query_grid, key_grid), the tile slowest, and a
// GPU starts blocks in index order, x fastest (in practice; CUDA does not promise it):
// so the tiles with the most work come first. Under a causal mask query tile i sees the
// keys up to it and key tile j the queries from it, so queries go last tile first and
// keys first tile first; the shortest blocks then start last and fill the gaps the
// longest leave (longest-first list scheduling), where a tile-fastest order starts the
// longest block of the last head last. Without a causal mask every tile has the same
// work and the order changes nothing. flash_options::longest_first = false gives the
// tile-fastest grid, (tiles, heads, batch), for comparison. (Read from blockIdx, whose
// parts the compiler reloads where it needs them: a one-dimensional grid decoded by
// division kept the quotients in registers.)
struct block_place {
  std::int64_t tile, head, batch;
};
// Block (x, y, z) of a grid `depth` blocks deep in z.
__host__ __device__ inline block_place query_place(unsigned x, unsigned y, unsigned z, unsigned depth,
                                                   bool longest_first) {
  if (!longest_first) return {x, y, z};
  return {std::int64_t(depth) - 1 - z, x, y};
}
__host__ __device__ inline block_place key_place(unsigned x, unsigned y, unsigned z, bool longest_first) {
  if (!longest_first) return {x, y, z};
  return {z, x, y};
}
__device__ inline block_place query_block_place(bool longest_first) {
  return query_place(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.z, longest_first);
}
__device__ inline block_place key_block_place(bool longest_first) {
  return key_place(blockIdx.x, blockIdx.y, blockIdx.z, longest_first);
}

// The last of the `count` rows from `first` that exist, first < rows.
__device__ inline std::int64_t last_row(std::int64_t first, std::int64_t count, std::int64_t rows) {
  return (first + count < rows ? first + count : rows) - 1;
}

// acc[x][col] += sum over the 32 lanes c of w[x] (lane c's) * src[(lane + 32 col) pitch + c]:
// a warp's 8 rows (or keys) of weights, one column per lane, times a transposed
// tile, accumulated into the lane's columns lane + 32 col.
template <int Cols>
__device__ void accumulate(float (&acc)[per_warp][Cols], const float (&w)[per_warp], const float* src, int lane) {
  for (int c = 0; c < tile; ++c) {
    float wc[per_warp];
#pragma unroll
    for (int x = 0; x < per_warp; ++x) wc[x] = __shfl_sync(0xFFFFFFFFu, w[x], c);
#pragma unroll
    for (int col = 0; col < Cols; ++col) {
      const float y = src[(lane + 32 * col) * pitch + c];
#pragma unroll
      for (int x = 0; x < per_warp; ++x) acc[x][col] += wc[x] * y;
    }
  }
}

template <class T>
struct forward_args {
  rows<const T> q, k, v;
  rows<T> out;
  float* lse;
  flash::tile_problem p;
  float scale;
  int dim;
  bool longest_first = true;  // flash_options::longest_first
};

// One block per (query tile, head, batch element), the longest first (block_place).
template <int DM, class T>
__global__ void __launch_bounds__(tile * warps) forward_kernel(forward_args<T> a) {
  constexpr int cols = DM / 32;  // output columns per lane
  extern __shared__ float smem[];
  float* qs = smem;              // [tile][DM]
  float* kt = qs + tile * DM;    // [DM][pitch]
  float* vt = kt + DM * pitch;   // [DM][pitch]
  const flash::tile_problem& p = a.p;
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const block_place at = query_block_place(a.longest_first);
  const std::int64_t i0 = at.tile * tile, h = at.head, n = at.batch;
  const std::int64_t g = h / (p.heads / p.kv_heads);
  const float kept = float(p.kept);

  stage<DM, false>(qs, a.q, n, h, i0, p.queries, a.dim);
  float acc[per_warp][cols] = {};
  flash::softmax_row<float> row[per_warp];
  const std::int64_t i_last = last_row(i0, tile, p.queries);
  const bool warp_rows = i0 + warp * per_warp < p.queries;  // the warp has rows; then its last is
  const std::int64_t warp_last = warp_rows ? last_row(i0 + warp * per_warp, per_warp, p.queries) : i_last;
  for (std::int64_t j0 = 0; j0 < flash::key_end(p, i_last); j0 += tile) {
    __syncthreads();  // the previous tile is no longer read
    stage<DM, true>(kt, a.k, n, g, j0, p.keys, a.dim);
    stage<DM, true>(vt, a.v, n, g, j0, p.keys, a.dim);
    __syncthreads();
    if (!warp_rows || j0 >= flash::key_end(p, warp_last)) continue;  // no row of this warp sees a key of the tile
    const std::int64_t j = j0 + lane;
    float w[per_warp] = {};  // q.k of this lane's key per row, then its dropped weight
    for (int d = 0; d < a.dim; ++d) {
      const float kd = kt[d * pitch + lane];
#pragma unroll
      for (int rr = 0; rr < per_warp; ++rr) w[rr] += qs[(warp * per_warp + rr) * DM + d] * kd;
    }
#pragma unroll
    for (int rr = 0; rr < per_warp; ++rr) {
      const std::int64_t i = i0 + warp * per_warp + rr;
      const bool vis = i < p.queries && j < p.keys && flash::visible(p, n, i, j);
      const float s = flash::masked_score(w[rr], a.scale, vis);
      const float alpha = flash::raise_max(row[rr], warp_max(s));
#pragma unroll
      for (int col = 0; col < cols; ++col) acc[rr][col] *= alpha;
      const float e = flash::unnormalised_weight(s, row[rr]);
      row[rr].sum += warp_sum(e);
      w[rr] = e != 0.0f ? e * flash::keep_scale(p, kept, n, h, i, j) : 0.0f;
    }
    accumulate<cols>(acc, w, vt, lane);
  }
  for (int rr = 0; rr < per_warp; ++rr) {
    const std::int64_t i = i0 + warp * per_warp + rr;
    if (i >= p.queries) break;
    const float f = flash::output_scale(row[rr]);
    T* o = a.out.row(n, h, i);
    for (int col = 0; col < cols; ++col)
      if (lane + 32 * col < a.dim) o[lane + 32 * col] = T(acc[rr][col] * f);
    if (lane == 0) a.lse[(n * p.heads + h) * p.queries + i] = flash::log_sum_exp(row[rr]);
  }
}

template <class T>
struct backward_args {
  rows<const T> q, k, v, out, dout;
  const float* lse;
  float* row_d;  // [B, H, Lq]: dO . O
  rows<T> dq, dk, dv;
  flash::tile_problem p;
  float scale;
  int dim;
  bool longest_first = true;  // flash_options::longest_first
};

// D = dO . O per query row: one warp per row.
template <class T>
__global__ void row_d_kernel(backward_args<T> a) {
  const std::int64_t r = std::int64_t(blockIdx.x) * warps + threadIdx.x / 32;
  const flash::tile_problem& p = a.p;
  if (r >= p.batch * p.heads * p.queries) return;
  const std::int64_t i = r % p.queries, h = r / p.queries % p.heads, n = r / p.queries / p.heads;
  const T* o = a.out.row(n, h, i);
  const T* d = a.dout.row(n, h, i);
  float s = 0;
  for (int c = int(threadIdx.x % 32); c < a.dim; c += 32) s += float(o[c]) * float(d[c]);
  s = warp_sum(s);
  if (threadIdx.x % 32 == 0) a.row_d[r] = s;
}

// dq: one block per (query tile, head, batch element), laid out as forward.
template <int DM, class T>
__global__ void __launch_bounds__(tile * warps) dq_kernel(backward_args<T> a) {
  constexpr int cols = DM / 32;
  extern __shared__ float smem[];
  float* qs = smem;               // [tile][DM]
  float* dos = qs + tile * DM;    // [tile][DM]
  float* kt = dos + tile * DM;    // [DM][pitch]
  float* vt = kt + DM * pitch;    // [DM][pitch]
  const flash::tile_problem& p = a.p;
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const block_place at = query_block_place(a.longest_first);
  const std::int64_t i0 = at.tile * tile, h = at.head, n = at.batch;
  const std::int64_t g = h / (p.heads / p.kv_heads);
  const float kept = float(p.kept);

  stage<DM, false>(qs, a.q, n, h, i0, p.queries, a.dim);
  stage<DM, false>(dos, a.dout, n, h, i0, p.queries, a.dim);
  float lse[per_warp], row_d[per_warp], acc[per_warp][cols] = {};
  for (int rr = 0; rr < per_warp; ++rr) {
    const std::int64_t i = i0 + warp * per_warp + rr, r = (n * p.heads + h) * p.queries + i;
    lse[rr] = i < p.queries ? a.lse[r] : INFINITY;
    row_d[rr] = i < p.queries ? a.row_d[r] : 0.0f;
  }
  const std::int64_t i_last = last_row(i0, tile, p.queries);
  const bool warp_rows = i0 + warp * per_warp < p.queries;  // the warp has rows; then its last is
  const std::int64_t warp_last = warp_rows ? last_row(i0 + warp * per_warp, per_warp, p.queries) : i_last;
  for (std::int64_t j0 = 0; j0 < flash::key_end(p, i_last); j0 += tile) {
    __syncthreads();
    stage<DM, true>(kt, a.k, n, g, j0, p.keys, a.dim);
    stage<DM, true>(vt, a.v, n, g, j0, p.keys, a.dim);
    __syncthreads();
    if (!warp_rows || j0 >= flash::key_end(p, warp_last)) continue;  // no row of this warp sees a key of the tile
    const std::int64_t j = j0 + lane;
    float qk[per_warp] = {}, dp[per_warp] = {};  // this lane's key against each row
    for (int d = 0; d < a.dim; ++d) {
      const float kd = kt[d * pitch + lane], vd = vt[d * pitch + lane];
#pragma unroll
      for (int rr = 0; rr < per_warp; ++rr) {
        qk[rr] += qs[(warp * per_warp + rr) * DM + d] * kd;
        dp[rr] += dos[(warp * per_warp + rr) * DM + d] * vd;
      }
    }
#pragma unroll
    for (int rr = 0; rr < per_warp; ++rr) {  // qk becomes dS
      const std::int64_t i = i0 + warp * per_warp + rr;
      const bool vis = i < p.queries && j < p.keys && flash::visible(p, n, i, j);
      const float w = flash::weight(flash::masked_score(qk[rr], a.scale, vis), lse[rr]);
      qk[rr] = w != 0.0f ? flash::score_grad(w, dp[rr], flash::keep_scale(p, kept, n, h, i, j), row_d[rr]) : 0.0f;
    }
    accumulate<cols>(acc, qk, kt, lane);
  }
  for (int rr = 0; rr < per_warp; ++rr) {
    const std::int64_t i = i0 + warp * per_warp + rr;
    if (i >= p.queries) break;
    T* o = a.dq.row(n, h, i);
    for (int col = 0; col < cols; ++col)
      if (lane + 32 * col < a.dim) o[lane + 32 * col] = T(a.scale * acc[rr][col]);
  }
}

// dk and dv: one block per (key tile, kv head, batch element); each warp owns 8
// keys, a lane one query of the query tile in flight.
template <int DM, class T>
__global__ void __launch_bounds__(tile * warps) dkdv_kernel(backward_args<T> a) {
  constexpr int cols = DM / 32;
  extern __shared__ float smem[];
  float* ks = smem;               // [tile][DM]
  float* vs = ks + tile * DM;     // [tile][DM]
  float* qt = vs + tile * DM;     // [DM][pitch]
  float* dot_t = qt + DM * pitch; // [DM][pitch]
  float* lse = dot_t + DM * pitch;  // [tile]
  float* row_d = lse + tile;        // [tile]
  const flash::tile_problem& p = a.p;
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const block_place at = key_block_place(a.longest_first);
  const std::int64_t j0 = at.tile * tile, g = at.head, n = at.batch;
  const std::int64_t rep = p.heads / p.kv_heads;
  const float kept = float(p.kept);

  stage<DM, false>(ks, a.k, n, g, j0, p.keys, a.dim);
  stage<DM, false>(vs, a.v, n, g, j0, p.keys, a.dim);
  float gk[per_warp][cols] = {}, gv[per_warp][cols] = {};
  for (std::int64_t h = g * rep; h < (g + 1) * rep; ++h)
    for (std::int64_t i0 = flash::query_begin(p, j0) / tile * tile; i0 < p.queries; i0 += tile) {
      __syncthreads();
      stage<DM, true>(qt, a.q, n, h, i0, p.queries, a.dim);
      stage<DM, true>(dot_t, a.dout, n, h, i0, p.queries, a.dim);
      if (threadIdx.x < tile) {
        const std::int64_t i = i0 + threadIdx.x, r = (n * p.heads + h) * p.queries + i;
        lse[threadIdx.x] = i < p.queries ? a.lse[r] : INFINITY;
        row_d[threadIdx.x] = i < p.queries ? a.row_d[r] : 0.0f;
      }
      __syncthreads();
      // The warp's keys start at j0 + 8 warp: past the tile's last row's causal limit, or past the keys, none is seen.
      if (j0 + warp * per_warp >= flash::key_end(p, last_row(i0, tile, p.queries))) continue;
      const std::int64_t i = i0 + lane;
      // q.k and dO.v of (this lane's query, each key), then its dropped weight and dS.
      float pk[per_warp] = {}, ds[per_warp] = {};
      for (int d = 0; d < a.dim; ++d) {
        const float qd = qt[d * pitch + lane], dod = dot_t[d * pitch + lane];
#pragma unroll
        for (int cc = 0; cc < per_warp; ++cc) {
          pk[cc] += qd * ks[(warp * per_warp + cc) * DM + d];
          ds[cc] += dod * vs[(warp * per_warp + cc) * DM + d];
        }
      }
#pragma unroll
      for (int cc = 0; cc < per_warp; ++cc) {
        const std::int64_t j = j0 + warp * per_warp + cc;
        const bool vis = i < p.queries && j < p.keys && flash::visible(p, n, i, j);
        const float w = flash::weight(flash::masked_score(pk[cc], a.scale, vis), lse[lane]);
        const float keep = w != 0.0f ? flash::keep_scale(p, kept, n, h, i, j) : 0.0f;
        ds[cc] = flash::score_grad(w, ds[cc], keep, row_d[lane]);
        pk[cc] = w * keep;
      }
      accumulate<cols>(gv, pk, dot_t, lane);
      accumulate<cols>(gk, ds, qt, lane);
    }
  for (int cc = 0; cc < per_warp; ++cc) {
    const std::int64_t j = j0 + warp * per_warp + cc;
    if (j >= p.keys) break;
    T* ok = a.dk.row(n, g, j);
    T* ov = a.dv.row(n, g, j);
    for (int col = 0; col < cols; ++col)
      if (lane + 32 * col < a.dim) {
        ok[lane + 32 * col] = T(a.scale * gk[cc][col]);
        ov[lane + 32 * col] = T(gv[cc][col]);
      }
  }
}

// Calls f.template operator()<DM>() for the smallest DM in {32, 64, 128, 256}
// holding dim: the kernels' register tiles are sized at compile time.
template <class F>
void dispatch_dim(std::int64_t dim, const char* who, F&& f) {
  require<shape_error>(dim >= 1 && dim <= max_dim, who, ": head_dim must be in [1, ", max_dim, "], got ", dim);
  if (dim <= 32) f.template operator()<32>();
  else if (dim <= 64) f.template operator()<64>();
  else if (dim <= 128) f.template operator()<128>();
  else f.template operator()<256>();
}

// The kernels' grids: a block per tile of `rows` queries (or keys) of each head (or kv
// head) and batch element, in the order of block_place (check_grid keeps y and z <= 65535).
inline dim3 tile_grid(std::int64_t tiles, std::int64_t heads, std::int64_t batch, bool longest_first) {
  return longest_first ? dim3(unsigned(heads), unsigned(batch), unsigned(tiles))
                       : dim3(unsigned(tiles), unsigned(heads), unsigned(batch));
}
inline dim3 query_grid(const flash::tile_problem& p, int rows, bool longest_first) {
  return tile_grid((p.queries + rows - 1) / rows, p.heads, p.batch, longest_first);
}
inline dim3 key_grid(const flash::tile_problem& p, int rows, bool longest_first) {
  return tile_grid((p.keys + rows - 1) / rows, p.kv_heads, p.batch, longest_first);
}
// The CUDA-core kernels' dynamic shared memory: fp32 tiles, rows and transposed.
template <int DM>
inline constexpr std::size_t forward_bytes = sizeof(float) * (tile * DM + 2 * DM * pitch);
template <int DM>
inline constexpr std::size_t dq_bytes = sizeof(float) * (2 * tile * DM + 2 * DM * pitch);
template <int DM>
inline constexpr std::size_t dkdv_bytes = dq_bytes<DM> + sizeof(float) * 2 * tile;  // and lse, D of a query tile

// A grid's y and z hold 65535: batch and tiles (of `tile` rows, the smaller kernel set's:
// any shape taken here runs on either), or heads and batch in the tile-fastest order;
// checked before anything is launched.
inline constexpr std::int64_t max_sequence = 65535 * std::int64_t(tile);
inline void check_grid(const flash::tile_problem& p, bool longest_first, const char* who) {
  require<shape_error>(p.batch <= 65535, who, ": batch must be at most 65535 (a grid's y or z), got ", p.batch);
  if (longest_first)
    require<shape_error>(p.queries <= max_sequence && p.keys <= max_sequence, who,
                         ": queries and keys must be at most ", max_sequence, " (65535 tiles of ", tile,
                         ", the grid's z), got ", p.queries, " and ", p.keys);
  else
    require<shape_error>(p.heads <= 65535, who, ": heads must be at most 65535 (the grid's y), got ", p.heads);
}

template <class Q, class K, class V>
flash::tile_problem problem(const Q& q, const K& k, const V& v, const flash_options& o, const char* who) {
  require<shape_error>(k.shape() == v.shape(), who, ": keys and values must have one shape, got ", k.shape(), " and ",
                       v.shape());
  require<shape_error>(q.batch == k.batch && q.dim == k.dim && q.heads > 0 && k.heads > 0 && q.heads % k.heads == 0,
                       who, ": q [batch, heads, queries, dim] = ", q.shape(), " and k [batch, kv_heads, keys, dim] = ",
                       k.shape(), " need one batch and dim and heads a multiple of kv_heads");
  flash::tile_problem p = flash::make_problem(q.batch, q.heads, k.heads, q.seq, k.seq, o.is_causal, o.query_offset,
                                              o.key_padding, o.dropout, o.dropout_p);
  check_grid(p, o.longest_first, who);
  return p;
}
inline float scale_of(const flash_options& o, std::int64_t dim) {
  return o.scale != 0 ? o.scale : float(1.0 / std::sqrt(double(dim)));
}

}  // namespace detail::fused

}  // namespace shardlib::ops::cuda
