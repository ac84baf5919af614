// shardlib/ops/cuda/flash_tensor_tiles.cuh — the tiles of the tensor-core attention
// (ops/cuda/flash_tensor_kernels.cuh, whose opening comment gives the block's layout),
// the pieces every kernel is made of besides its products (flash_tensor_products.cuh) and
// its geometry (flash_tensor_geometry.cuh): a warp's rows written out, which elements of a
// tile are visible, the weights' exponential, a tile staged into shared memory by
// cp.async, the block's shared memory and place.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/attention_tiles.hpp"               // flash::tile_problem
#include "shardlib/ops/cuda/flash_tensor_products.cuh"  // accumulator, row_of, column_of, ...

#include <cuda_pipeline.h>  // __pipeline_memcpy_async (cp.async)
#include <cuda_runtime.h>

#include <algorithm>    // std::clamp
#include <cmath>        // std::exp2 (tests/emulated)
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t, std::uint32_t, std::uint8_t
#include <type_traits>  // std::bool_constant, std::true_type, std::false_type

namespace shardlib::ops::cuda::detail::tensor {
namespace flash = shardlib::ops::flash;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// A warp's 16 rows of fp32 in shared memory (`from`, [16][acc_pitch]) out to rows
// row0 + r < limit of dst, times factor, in T, the columns below dim: 8 elements (16
// bytes) per store (dim a multiple of 8, dst's rows 16-byte aligned: whole_vectors).
template <int DM, class T>
__device__ void store_rows(const rows<T>& dst, std::int64_t n, std::int64_t h, std::int64_t row0, std::int64_t limit,
                           const float* from, float factor, int dim) {
  constexpr int per = 16 / sizeof(T);
  for (int e = int(threadIdx.x) % 32; e < edge * DM / per; e += 32) {
    const int r = e / (DM / per), d = e % (DM / per) * per;
    if (row0 + r >= limit || d >= dim) continue;
    struct alignas(16) {
      T v[per];
    } pack;
#pragma unroll
    for (int x = 0; x < per; ++x) pack.v[x] = T(factor * from[r * acc_pitch<DM> + d + x]);
    *reinterpret_cast<uint4*>(dst.row(n, h, row0 + r) + d) = __builtin_bit_cast(uint4, pack);
  }
}

// A warp's accumulators (one per 16 columns of its 16 rows) out through shared memory
// `through` (fp32 [16][acc_pitch]) by store_rows.
template <int DM, class T>
__device__ void write_rows(const rows<T>& dst, std::int64_t n, std::int64_t h, std::int64_t row0, std::int64_t limit,
                           float* through, const accumulator (&acc)[DM / edge], float factor, int dim) {
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc)
    wmma::store_matrix_sync(through + dc * edge, acc[dc], unsigned(acc_pitch<DM>), wmma::mem_row_major);
  __syncwarp();
  store_rows<DM>(dst, n, h, row0, limit, through, factor, dim);
}
#endif

// --- the element-wise work, decided once per tile -------------------------------------------
// Which elements of a warp's 16 x 64 scores exist and are visible: rows and columns
// counted from the warp's first row and the tile's first column. The causal rule is a
// band of column - row, padding flags index the rows (dk/dv: rows are keys) or the
// columns (forward, dq); `all` says that every element is visible, so the kernels
// test nothing more per element (the tiles below the causal diagonal, without padding).
struct tile_view {
  int rows, cols, lo, hi;
  const std::uint8_t* pad_rows;
  const std::uint8_t* pad_cols;
  bool all;
  __device__ bool sees(int r, int c) const {
    return r < rows && c < cols && c - r >= lo && c - r <= hi && !(pad_rows && pad_rows[r]) &&
           !(pad_cols && pad_cols[c]);
  }
};
__device__ inline int clamped(std::int64_t x) {  // |column - row| < tile: the band's ends need no more
  return int(x < -2 * tile ? -2 * tile : x > 2 * tile ? 2 * tile : x);
}
// Rows are queries first.., columns keys j0..: key j is visible to query i when j <= i + offset.
__device__ inline tile_view query_rows(const flash::tile_problem& p, std::int64_t n, std::int64_t first, std::int64_t j0) {
  tile_view v{clamped(p.queries - first), clamped(p.keys - j0), -2 * tile,
              p.is_causal ? clamped(first + p.query_offset - j0) : 2 * tile, nullptr,
              p.key_padding ? p.key_padding + n * p.keys + j0 : nullptr, false};
  v.all = v.rows >= edge && v.cols >= tile && v.hi >= tile - 1 && !p.key_padding;
  return v;
}
// Rows are keys first.., columns queries i0..: the same rule, seen from the keys.
__device__ inline tile_view key_rows(const flash::tile_problem& p, std::int64_t n, std::int64_t first, std::int64_t i0) {
  tile_view v{clamped(p.keys - first), clamped(p.queries - i0),
              p.is_causal ? clamped(first - i0 - p.query_offset) : -2 * tile, 2 * tile,
              p.key_padding ? p.key_padding + n * p.keys + first : nullptr, nullptr, false};
  v.all = v.rows >= edge && v.cols >= tile && v.lo <= 1 - edge && !p.key_padding;
  return v;
}
// f(x) or f(x, y) with runtime flags as std::bool_constant: the element loops test a flag
// (a tile wholly visible, dropout) once per tile, where `all || v.sees(r, c)` per element
// cost a branch and its reconvergence for every element.
template <class F>
__device__ void with_flags(bool a, F&& f) {
  if (a) f(std::true_type{});
  else f(std::false_type{});
}
template <class F>
__device__ void with_flags(bool a, bool b, F&& f) {
  with_flags(a, [&](auto x) { with_flags(b, [&](auto y) { f(x, y); }); });
}
// Dropout decides 8 weights per draw (nn::attention_keep's groups: queries i, i ^ 8 against
// keys j, j ^ 1, j ^ 8, j ^ 9). On a GPU a lane's 8 elements of a 16x16 accumulator of weights
// whose first row and column are multiples of 16 are one group where rows are queries
// (forward, dq: element 0 heads it) and two where rows are keys (dk/dv: elements 0 and 1 head
// them; tests/emulated checks both with mma_row and mma_column). So a lane draws a group once
// (lane_group) and reads each weight's bit from it (lane_keep, with dropout only); where every
// lane holds the whole tile (tests/emulated) each weight draws its own.
__device__ inline std::uint32_t lane_group(const flash::tile_problem& p, std::int64_t n, std::int64_t h,
                                           std::int64_t i, std::int64_t j) {
  if constexpr (whole_tiles) return 0;
  else return flash::keep_group(p, n, h, i, j);
}
__device__ inline float lane_keep(const flash::tile_problem& p, std::uint32_t group, float kept, std::int64_t n,
                                  std::int64_t h, std::int64_t i, std::int64_t j) {
  if constexpr (whole_tiles) return flash::keep_scale(p, kept, n, h, i, j);
  else return (group >> nn::attention_keep::slot(i, j)) & 1u ? kept : 0.0f;
}
// exp(k' x - m) as 2^(k x - m2), k = k' log2(e), m2 = log2_scaled(m): one FFMA and one ex2
// on the special-function unit, k' the scale and x the product q.k (forward takes a row's
// max over the products and then scales it: this holds for a positive scale only, and the
// tensor-core kernels are chosen for no other). Its error (a few ulp, and the FFMA's
// rounding of the exponent: about 1e-5 of the weight when the score and m are near 100)
// is far below the 16-bit rounding of the weights it makes, and the same in forward and
// backward. ex2.approx.ftz flushes a subnormal result to 0 (a weight below 2^-126 of its
// row's largest) and gives 0 for x = -inf (a hidden key) with no test; m = +inf
// (backward's lse of a row that saw no key) gives 0 too, and m = -inf (a forward row that
// has seen only hidden keys) takes m2 = 0 so that its -inf scores give 0, not NaN. exp2f
// would add subnormal handling, 8 instructions per weight.
__device__ inline float log2_scaled(float m) { return m == -INFINITY ? 0.0f : m * log2e; }
__device__ inline float exp_less(float x, float k, float m2) {
  const float y = fmaf(x, k, -m2);
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(y));
  return r;
#else
  return std::exp2(y);
#endif
}
// Two neighbouring elements (an accumulator's e and e + 1: columns c and c + 1) stored as one
// 4-byte word (c even, the rows' pitch even).
template <class T>
__device__ void store_pair(T* at, float a, float b) {
  *reinterpret_cast<std::uint32_t*>(at) = pack_pair<T>(a, b);
}

// 16 bytes from global memory into shared memory by cp.async, or 16 zeros where !whole (and
// `from` is not read): cp.async's source size, so no branch and no store of its own.
template <class T>
__device__ void copy_or_zero(T* to, const T* from, bool whole) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(to))),
               "l"(from), "r"(whole ? 16 : 0)
               : "memory");
#else
  __pipeline_memcpy_async(to, from, 16, whole ? 0 : 16);
#endif
}

// Rows [first, first + tile) of a head into shared memory in T, zero past `count`
// rows and past dim: [tile][row_pitch], 16 bytes (8 elements) per copy: dim is a
// multiple of 8 and every row of src starts 16-byte aligned (whole_vectors, checked
// before these kernels are chosen). The copies are asynchronous (cp.async, into the
// thread's open group, zeros included): the caller commits the group, waits for it
// (__pipeline_wait_prior) and synchronises the block before reading.
// A thread copies one column piece of every step-th row, its source advanced by a step
// and its tests on 32-bit values (a 64-bit index per copy cost about 30 instructions).
template <int DM, class T>
__device__ void stage(T* dst, const rows<const T>& src, std::int64_t n, std::int64_t h, std::int64_t first,
                      std::int64_t count, int dim) {
  constexpr int per = 16 / sizeof(T), across = DM / per, step = warps * 32 / across;
  static_assert(warps * 32 % across == 0 && tile % step == 0);
  const int r0 = int(threadIdx.x) / across, d = int(threadIdx.x) % across * per;
  const int left = int(std::clamp<std::int64_t>(count - first, 0, tile));  // rows of src from `first`
  const T* from = src.data + (n * src.batch_stride + h * src.head_stride + (first + r0) * src.row_stride + d);
  const std::int64_t next = step * src.row_stride;
  T* to = dst + r0 * row_pitch<DM> + d;
#pragma unroll
  for (int i = 0; i < tile / step; ++i, from += next)
    copy_or_zero(to + i * step * row_pitch<DM>, from, r0 + i * step < left && d < dim);
}

// What this thread copied has landed, but for the newest `pending` groups, and every
// thread of the block is past the same point: the tiles are there to read.
template <int Pending>
__device__ void landed() {
  __pipeline_wait_prior(Pending);
  __syncthreads();
}

// Shared memory handed out region by region, in order.
struct carve {
  unsigned char* at;
  template <class U>
  __device__ U* take(std::size_t count) {
    U* p = reinterpret_cast<U*>(at);
    at += count * sizeof(U);
    return p;
  }
};

// A query-tile block's place (forward and dq): batch element n, head h and its kv head g,
// the tile's first query i0, and this thread's warp, lane and the warp's first query.
struct query_block {
  int lane, warp;
  std::int64_t i0, h, n, g, first;
  __device__ query_block(const flash::tile_problem& p, bool longest_first)
      : query_block(p, fused::query_block_place(longest_first)) {}  // the grid's order
  __device__ query_block(const flash::tile_problem& p, const fused::block_place& at)
      : lane(int(threadIdx.x) % 32),
        warp(int(threadIdx.x) / 32),
        i0(at.tile * tile),
        h(at.head),
        n(at.batch),
        g(h / (p.heads / p.kv_heads)),
        first(i0 + warp * edge) {}
};

}  // namespace shardlib::ops::cuda::detail::tensor
