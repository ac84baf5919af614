// shardlib/ops/cuda/flash_tensor_tiles.cuh — the tiles of the tensor-core attention
// (ops/cuda/flash_tensor_kernels.cuh, whose opening comment gives the block's layout):
// the tile and pitch constants, the shared memory each kernel takes, the head dims
// and row layouts the kernels accept, and the pieces every kernel is made of — the
// products (ldmatrix and mma.sync into wmma accumulators), which element of an
// accumulator a lane holds, a tile staged into shared memory by cp.async, a warp's rows
// written out.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"  // bfloat16, half
#include "shardlib/ops/attention_tiles.hpp"  // flash::tile_problem
#include "shardlib/ops/cuda/flash_kernels.cuh"  // rows

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>  // __pipeline_memcpy_async (cp.async)
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>    // std::clamp, std::max
#include <cmath>        // std::exp2 (tests/emulated), std::isfinite
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t, std::uintptr_t
#include <limits>       // std::numeric_limits
#include <type_traits>  // std::is_same_v

namespace shardlib::ops::cuda::detail::tensor {
namespace flash = shardlib::ops::flash;
using fused::rows;

inline constexpr int tile = 64;         // queries per block; keys per tile (dk, dv: keys per block)
inline constexpr int warps = 4;         // each takes 16 rows: one wmma tile high
inline constexpr int edge = 16;         // a wmma tile's m, n and k
inline constexpr int max_dim = 128;
static_assert(warps * 32 == fused::threads, "launched with the CUDA-core kernels' block size");
inline constexpr int chunks = tile / edge;     // a tile's wmma tiles across
inline constexpr int weight_pitch = tile + 8;  // 16-bit [tile][tile + 8]
template <int DM>
inline constexpr int row_pitch = DM + 8;  // 16-bit [tile][DM + 8]
template <int DM>
inline constexpr int acc_pitch = DM + 4;  // fp32 [tile][DM + 4]

template <class T>
inline constexpr bool takes = std::is_same_v<T, bfloat16> || std::is_same_v<T, shardlib::half>;

// The CUDA type whose bits T holds, as wmma takes it.
template <class T>
struct wmma_type;
template <>
struct wmma_type<bfloat16> {
  using type = __nv_bfloat16;
};
template <>
struct wmma_type<shardlib::half> {
  using type = __half;
};

// Shared memory per block (every region starts 32-byte aligned, as wmma's loads need):
// staged tiles of rows, each warp's 16 rows of weights (P, dS, ...) on their way from
// its accumulators to the next product, and dk/dv's two query buffers with their lse
// and D (and one dO buffer). At the end the accumulators go out through the first two
// staged tiles.
template <int DM>
constexpr std::size_t rows_bytes = std::size_t(tile) * row_pitch<DM> * 2;
constexpr std::size_t weights_bytes = std::size_t(tile) * weight_pitch * 2;
template <int DM>
constexpr std::size_t through_bytes = std::size_t(warps) * edge * acc_pitch<DM> * 4;
template <int DM>
constexpr std::size_t forward_bytes = 3 * rows_bytes<DM> + weights_bytes;
template <int DM>
constexpr std::size_t dq_bytes = 4 * rows_bytes<DM> + weights_bytes;
template <int DM>
constexpr std::size_t dkdv_bytes = 5 * rows_bytes<DM> + 2 * weights_bytes + 2 * 2 * tile * 4;
template <int DM>
constexpr std::size_t largest_bytes = std::max({forward_bytes<DM>, dq_bytes<DM>, dkdv_bytes<DM>});
// Two blocks of each kernel per SM on sm_90 (228 KiB of shared memory per SM, 1 KiB of it
// reserved per block), at the largest head_dim: 8 warps to hide each other's latency.
static_assert(2 * (largest_bytes<128> + 1024) <= 228 * 1024, "two blocks per SM on sm_90 at head_dim 128");
// Every region, and every warp's part of one, starts 32-byte aligned; every staged row
// 16-byte aligned (stage's vector stores).
template <int DM>
constexpr bool aligned = rows_bytes<DM> % 32 == 0 && edge * row_pitch<DM> * 2 % 32 == 0 &&
                         edge * acc_pitch<DM> * 4 % 32 == 0 && row_pitch<DM> * 2 % 16 == 0 &&
                         through_bytes<DM> <= 2 * rows_bytes<DM>;
static_assert(aligned<64> && aligned<128> && weights_bytes % 32 == 0 && edge * weight_pitch * 2 % 32 == 0);

// Head dims these kernels take: up to 128, a multiple of 8 (stage's 16-byte loads).
inline bool takes_dim(std::int64_t dim) { return dim >= 1 && dim <= max_dim && dim % 8 == 0; }
// Scales they take: positive (forward scales a row's largest product: exp_less), normal (not
// flushed to 0 where code is built with -ftz) and with scale log2(e) finite.
inline constexpr float log2e = 1.4426950408889634f;
inline bool takes_scale(float scale) {
  return scale >= std::numeric_limits<float>::min() && std::isfinite(scale * log2e);
}

// Whether stage can load (and store_rows store) v's rows 16 bytes at a time: every row starts 16-byte aligned
// (so does each 8-element piece of it when dim is a multiple of 8: the caller checks dim).
template <class T>
bool whole_vectors(const rows<T>& v) {
  constexpr std::int64_t per = 16 / sizeof(T);
  return reinterpret_cast<std::uintptr_t>(v.data) % 16 == 0 && v.batch_stride % per == 0 &&
         v.head_stride % per == 0 && v.row_stride % per == 0;
}

// Calls f.template operator()<DM>() for DM = 64 or 128, the smaller holding dim
// (dim <= max_dim: the caller checks). A smaller head is padded with zeros to 64:
// two instantiations per kernel keep nvcc's time down.
template <class F>
void dispatch_dim(std::int64_t dim, F&& f) {
  if (dim <= 64) f.template operator()<64>();
  else f.template operator()<128>();
}

// bf16 wmma exists from sm_80: below it (and only there) the kernels' bodies are left out.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
namespace wmma = nvcuda::wmma;

template <class T>
using a_fragment = wmma::fragment<wmma::matrix_a, edge, edge, edge, typename wmma_type<T>::type, wmma::row_major>;
template <class T, class Layout>
using b_fragment = wmma::fragment<wmma::matrix_b, edge, edge, edge, typename wmma_type<T>::type, Layout>;
using accumulator = wmma::fragment<wmma::accumulator, edge, edge, edge, float>;

template <class T>
__device__ const typename wmma_type<T>::type* as_wmma(const T* p) {
  return reinterpret_cast<const typename wmma_type<T>::type*>(p);
}

// Which row piece of a 16x16 16-bit tile a lane addresses for ldmatrix.x4 (8 elements from
// (row, col)): lanes 0-7, 8-15, 16-23 and 24-31 give the rows of its four 8x8 matrices.
struct piece {
  int row, col;
};
// A from [16 rows][16 k]: matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15),
// mma's a0a1, a2a3, a4a5, a6a7.
__host__ __device__ constexpr piece a_piece(int lane) { return {lane % 16, 8 * (lane / 16)}; }
// B = m^T from m [16 n][16 k]: (n 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15): b0b1,
// b2b3 of columns 0-7, then of columns 8-15.
__host__ __device__ constexpr piece b_transposed_piece(int lane) {
  return {lane % 8 + 8 * (lane / 16), 8 * ((lane / 8) % 2)};
}
// B from [16 k][16 n], each matrix transposed: (k 0-7, n 0-7), (8-15, 0-7), (0-7, 8-15),
// (8-15, 8-15), the same registers.
__host__ __device__ constexpr piece b_piece(int lane) { return {lane % 8 + 8 * ((lane / 8) % 2), 8 * (lane / 16)}; }

#if defined(__CUDA_ARCH__)
// On the GPU the operands come in by ldmatrix and multiply by mma.sync (m16n8k16, fp32
// accumulation): wmma's loads take generic addresses, four loads per fragment and a
// movmatrix for each transposed 8x8, where one ldmatrix reads four 8x8 matrices from
// shared memory, transposed if asked. Registers and lanes are as the PTX ISA lays them
// out for m16n8k16; the accumulators stay wmma's, whose element order matches it
// (row_of, column_of below), and layout_probe_kernel checks these products on each GPU.
// tests/emulated runs the wmma products in the #else branch.
struct operand {  // 16x16 16-bit values: A's a0..a7, or B's b0..b3 for columns 0-7 then 8-15
  std::uint32_t r[4];
};
// The four 8x8 matrices whose rows lanes 0-7, 8-15, 16-23 and 24-31 address (16-byte aligned
// rows in shared memory), in r[0..3]; Trans: each transposed.
template <bool Trans, class T>
__device__ void load_matrices(operand& f, const T* row) {
  const auto at = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
                 : "r"(at)
                 : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
                 : "r"(at)
                 : "memory");
}
// The operands of one mma from a tile at `at` (rows `pitch` apart): A (rows of Q, dO, K,
// V or weights), B = m^T for m the rows of K, V, Q or dO, B from rows of V, K, dO or Q.
template <class T>
__device__ void load_a(operand& f, const T* at, int pitch) {
  const piece p = a_piece(int(threadIdx.x) % 32);
  load_matrices<false>(f, at + p.row * pitch + p.col);
}
template <class T>
__device__ void load_b_transposed(operand& f, const T* at, int pitch) {
  const piece p = b_transposed_piece(int(threadIdx.x) % 32);
  load_matrices<false>(f, at + p.row * pitch + p.col);
}
template <class T>
__device__ void load_b(operand& f, const T* at, int pitch) {
  const piece p = b_piece(int(threadIdx.x) % 32);
  load_matrices<true>(f, at + p.row * pitch + p.col);
}
// c += a b: columns 0-7 into c.x[0..3], 8-15 into c.x[4..7].
template <class T>
__device__ void mma(accumulator& c, const operand& a, const operand& b) {
  static_assert(takes<T>);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* d = c.x + 4 * h;
    if constexpr (std::is_same_v<T, bfloat16>)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                   "{%0, %1, %2, %3};\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                   : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * h]), "r"(b.r[2 * h + 1]));
    else
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                   "{%0, %1, %2, %3};\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                   : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * h]), "r"(b.r[2 * h + 1]));
  }
}
#endif

// s[c] = a . b^T for a's 16 rows ([16][DM] at a) and b's rows 16c to 16c + 15 ([16 N][DM]
// at b), both pitch row_pitch: Q K^T, dO V^T, K Q^T, V dO^T. Each of a's fragments is
// loaded once, for all N products.
template <int DM, int N, class T>
__device__ void products(accumulator (&s)[N], const T* a, const T* b) {
#pragma unroll
  for (int c = 0; c < N; ++c) wmma::fill_fragment(s[c], 0.0f);
#pragma unroll
  for (int k = 0; k < DM; k += edge) {
#if defined(__CUDA_ARCH__)
    operand fa;
    load_a(fa, a + k, row_pitch<DM>);
#pragma unroll
    for (int c = 0; c < N; ++c) {
      operand fb;
      load_b_transposed(fb, b + c * edge * row_pitch<DM> + k, row_pitch<DM>);
      mma<T>(s[c], fa, fb);
    }
#else
    a_fragment<T> fa;
    wmma::load_matrix_sync(fa, as_wmma(a + k), unsigned(row_pitch<DM>));
#pragma unroll
    for (int c = 0; c < N; ++c) {
      b_fragment<T, wmma::col_major> fb;
      wmma::load_matrix_sync(fb, as_wmma(b + c * edge * row_pitch<DM> + k), unsigned(row_pitch<DM>));
      wmma::mma_sync(s[c], fa, fb, s[c]);
    }
#endif
  }
}

// acc[dc] += w . b for w, a warp's [16][tile] weights (pitch weight_pitch), and b's
// [tile][DM] (pitch row_pitch): P V, dS K, P^T dO, dS^T Q. Each of w's fragments is
// loaded once, for all DM / 16 products.
template <int DM, class T>
__device__ void accumulate(accumulator (&acc)[DM / edge], const T* w, const T* b) {
#pragma unroll
  for (int k = 0; k < tile; k += edge) {
#if defined(__CUDA_ARCH__)
    operand fa;
    load_a(fa, w + k, weight_pitch);
#pragma unroll
    for (int dc = 0; dc < DM / edge; ++dc) {
      operand fb;
      load_b(fb, b + k * row_pitch<DM> + dc * edge, row_pitch<DM>);
      mma<T>(acc[dc], fa, fb);
    }
#else
    a_fragment<T> fa;
    wmma::load_matrix_sync(fa, as_wmma(w + k), unsigned(weight_pitch));
#pragma unroll
    for (int dc = 0; dc < DM / edge; ++dc) {
      b_fragment<T, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, as_wmma(b + k * row_pitch<DM> + dc * edge), unsigned(row_pitch<DM>));
      wmma::mma_sync(acc[dc], fa, fb, acc[dc]);
    }
#endif
  }
}

// --- which elements of a 16x16 accumulator a lane holds -------------------------------------
// On a GPU (the layout the probe checks): element e of lane `lane` at column mma_column; the
// lane's four columns numbered by mma_column_slot (tests/emulated checks the three agree).
__host__ __device__ constexpr int mma_column(int e, int lane) { return 2 * (lane & 3) + (e & 1) + 8 * (e >> 2); }
__host__ __device__ constexpr int mma_column_slot(int e) { return (e & 1) + 2 * (e >> 2); }
__host__ __device__ constexpr int mma_column_of_slot(int j, int lane) { return 2 * (lane & 3) + (j & 1) + 8 * (j >> 1); }
// The softmax and the score gradients work on the accumulators of the products in
// registers, and the output and gradient accumulators are rescaled there. On the GPU a
// lane's element e sits where mma.sync's m16n8k16 tiles put it, as wmma's 16x16x16 fp32
// accumulators do on sm_80 and sm_90: row lane / 4 + 8 ((e / 2) % 2), column
// 2 (lane % 4) + e % 2 + 8 (e / 4). CUDA does not document it, so flash_uses_tensor_cores
// checks it once per device and input type, with the products above (layout_probe_kernel),
// and test_cuda_attention asserts that it holds. A lane so holds elements of two rows (its
// slots), each row shared by 4 lanes.
// tests/emulated's fragments hold the whole tile in every lane: slot = row, nothing shared.
template <class F>
inline constexpr bool holds_whole_tile = requires { F::whole_tile; };
inline constexpr bool whole_tiles = holds_whole_tile<accumulator>;
inline constexpr int slots = whole_tiles ? edge : 2;  // the rows a lane holds elements of

__device__ inline int slot_of(int e) { return whole_tiles ? e / edge : (e >> 1) & 1; }
__device__ inline int row_of(int slot, int lane) { return whole_tiles ? slot : lane / 4 + 8 * slot; }
__device__ inline int column_of(int e, int lane) { return whole_tiles ? e % edge : mma_column(e, lane); }
// The columns a lane holds elements of (4 on a GPU: two pairs 8 apart), which of them
// element e is in, and column slot j's column.
inline constexpr int column_slots = whole_tiles ? edge : 4;
__device__ inline int column_slot_of(int e) { return whole_tiles ? e % edge : mma_column_slot(e); }
__device__ inline int column_of_slot(int j, int lane) { return whole_tiles ? j : mma_column_of_slot(j, lane); }
// The lane that writes a row's own results (lse): one of the row's lanes.
__device__ inline bool writes_row(int lane) { return whole_tiles ? lane == 0 : (lane & 3) == 0; }
// The largest and the sum of v over the lanes sharing a row.
__device__ inline float row_max(float v) {
  if constexpr (!whole_tiles)
    for (int x = 1; x < 4; x *= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, x));
  return v;
}
__device__ inline float row_sum(float v) {
  if constexpr (!whole_tiles)
    for (int x = 1; x < 4; x *= 2) v += __shfl_xor_sync(0xffffffffu, v, x);
  return v;
}


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

// One warp: flags[lane] = 1 when every element the lane holds of a 16x16 accumulator
// loaded from row-major values 16 row + column sits where row_of and column_of say, and
// when the products of the kernels (products: a b^T, accumulate: w b) give the lane's
// elements exactly, for small integers in T (sums of 64 products below 2^24: exact in fp32).
// (A template, as every kernel of these headers: defined in each program that uses it.)
template <class T>
__global__ void layout_probe_kernel(int* flags) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int DM = 64;
  static __shared__ __align__(32) float m[edge * edge];
  static __shared__ __align__(32) T a[edge * row_pitch<DM>], w[edge * weight_pitch], b[tile * row_pitch<DM>];
  const int lane = int(threadIdx.x) % 32;
  const auto a_at = [](int r, int k) { return float((r + 2 * k) % 5 - 2); };
  const auto b_at = [](int r, int k) { return float((3 * r + k) % 7 - 3); };
  for (int e = lane; e < edge * edge; e += 32) m[e] = float(e);
  for (int e = lane; e < edge * DM; e += 32) a[e / DM * row_pitch<DM> + e % DM] = T(a_at(e / DM, e % DM));
  for (int e = lane; e < edge * tile; e += 32) w[e / tile * weight_pitch + e % tile] = T(a_at(e / tile, e % tile));
  for (int e = lane; e < tile * DM; e += 32) b[e / DM * row_pitch<DM> + e % DM] = T(b_at(e / DM, e % DM));
  __syncwarp();
  accumulator f, s[1], acc[DM / edge];
  wmma::load_matrix_sync(f, m, unsigned(edge), wmma::mem_row_major);
  products<DM>(s, a, b);  // s = a b[0:16]^T
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc) wmma::fill_fragment(acc[dc], 0.0f);
  accumulate<DM>(acc, w, b);  // acc = w b
  int ok = 1;
  for (int e = 0; e < accumulator::num_elements; ++e) {
    const int r = row_of(slot_of(e), lane), c = column_of(e, lane);
    ok &= f.x[e] == float(r * edge + c);
    float dot = 0.0f, sum[DM / edge] = {};
    for (int k = 0; k < DM; ++k) dot += a_at(r, k) * b_at(c, k);
    for (int k = 0; k < tile; ++k)
      for (int dc = 0; dc < DM / edge; ++dc) sum[dc] += a_at(r, k) * b_at(k, dc * edge + c);
    ok &= s[0].x[e] == dot;
    for (int dc = 0; dc < DM / edge; ++dc) ok &= acc[dc].x[e] == sum[dc];
  }
  flags[lane] = ok;
#else
  flags[threadIdx.x % 32] = 0;  // no wmma below sm_80
#endif
}

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
  struct alignas(4) {
    T v[2];
  } pair{{T(a), T(b)}};
  *reinterpret_cast<std::uint32_t*>(at) = __builtin_bit_cast(std::uint32_t, pair);
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
