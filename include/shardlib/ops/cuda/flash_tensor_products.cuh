// shardlib/ops/cuda/flash_tensor_products.cuh — the products of the tensor-core attention
// (ldmatrix and mma.sync into wmma accumulators: products, accumulate), which element of
// an accumulator a lane holds and the reductions over a row's lanes, and the kernel that
// checks that layout on each GPU (layout_probe_kernel).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/cuda/flash_tensor_geometry.cuh"  // tile, edge, pitches, wmma_type

#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>      // std::uint32_t
#include <type_traits>  // std::is_same_v

namespace shardlib::ops::cuda::detail::tensor {

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

// Two neighbours of a row (an accumulator's elements e and e + 1: columns c and c + 1) rounded
// to T, as one 4-byte word, the first in its low half.
template <class T>
__device__ std::uint32_t pack_pair(float a, float b) {
  struct alignas(4) {
    T v[2];
  } pair{{T(a), T(b)}};
  return __builtin_bit_cast(std::uint32_t, pair);
}

// A warp's 16 rows of weights (or score gradients) over 16 columns as the A operand of the
// next product, made in registers from the accumulator that holds them, as FlashAttention-2
// keeps P: on the GPU mma.sync's m16n8k16 A fragment a0..a7 holds the elements its
// accumulator c0..c7 does (the PTX ISA's layouts: rows lane / 4 and 8 more, columns
// 2 (lane % 4) + {0, 1} and 8 more), two per register, which layout_probe_kernel checks with
// the products; in tests/emulated every lane holds the whole tile.
#if defined(__CUDA_ARCH__)
template <class T>
using row_operand = operand;
template <class T>
__device__ void set_pair(operand& f, int e, float a, float b) {
  f.r[e / 2] = pack_pair<T>(a, b);
}
#else
template <class T>
using row_operand = a_fragment<T>;
template <class T>
__device__ void set_pair(a_fragment<T>& f, int e, float a, float b) {
  f.x[e] = float(T(a));
  f.x[e + 1] = float(T(b));
}
#endif

// acc[dc] += a . b[k rows] for a the operand of one 16-column chunk of 16 rows and b's
// [tile][DM] (pitch row_pitch) from row k.
template <int DM, class T, class A>
__device__ void accumulate_chunk(accumulator (&acc)[DM / edge], const A& fa, const T* b) {
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc) {
#if defined(__CUDA_ARCH__)
    operand fb;
    load_b(fb, b + dc * edge, row_pitch<DM>);
    mma<T>(acc[dc], fa, fb);
#else
    b_fragment<T, wmma::row_major> fb;
    wmma::load_matrix_sync(fb, as_wmma(b + dc * edge), unsigned(row_pitch<DM>));
    wmma::mma_sync(acc[dc], fa, fb, acc[dc]);
#endif
  }
}

// acc[dc] += w . b for w, a warp's [16][tile] weights (pitch weight_pitch), and b's
// [tile][DM] (pitch row_pitch): P V with dropout, P^T dO, dS^T Q. Each of w's fragments is
// loaded once, for all DM / 16 products.
template <int DM, class T>
__device__ void accumulate(accumulator (&acc)[DM / edge], const T* w, const T* b) {
#pragma unroll
  for (int k = 0; k < tile; k += edge) {
#if defined(__CUDA_ARCH__)
    operand fa;
    load_a(fa, w + k, weight_pitch);
#else
    a_fragment<T> fa;
    wmma::load_matrix_sync(fa, as_wmma(w + k), unsigned(weight_pitch));
#endif
    accumulate_chunk<DM>(acc, fa, b + k * row_pitch<DM>);
  }
}
// The same with w in registers, chunk by chunk (row_operand): P V, dS K.
template <int DM, class T>
__device__ void accumulate(accumulator (&acc)[DM / edge], const row_operand<T> (&w)[chunks], const T* b) {
#pragma unroll
  for (int k = 0; k < chunks; ++k) accumulate_chunk<DM>(acc, w[k], b + k * edge * row_pitch<DM>);
}

// --- which elements of a 16x16 accumulator a lane holds -------------------------------------
// On a GPU (the layout the probe checks): element e of lane `lane` in row mma_row (its slot's)
// and column mma_column; the lane's four columns numbered by mma_column_slot (tests/emulated
// checks the three agree).
__host__ __device__ constexpr int mma_slot(int e) { return (e >> 1) & 1; }
__host__ __device__ constexpr int mma_row_of_slot(int slot, int lane) { return lane / 4 + 8 * slot; }
__host__ __device__ constexpr int mma_row(int e, int lane) { return mma_row_of_slot(mma_slot(e), lane); }
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

__device__ inline int slot_of(int e) { return whole_tiles ? e / edge : mma_slot(e); }
__device__ inline int row_of(int slot, int lane) { return whole_tiles ? slot : mma_row_of_slot(slot, lane); }
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
#endif

// One warp: flags[lane] = 1 when every element the lane holds of a 16x16 accumulator
// loaded from row-major values 16 row + column sits where row_of and column_of say, and
// when the products of the kernels (products: a b^T, accumulate: w b, from shared memory
// and from registers made of the elements the lane holds) give the lane's elements exactly,
// for small integers in T (sums of 64 products below 2^24: exact in fp32).
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
  accumulator f, s[1], acc[DM / edge], held[DM / edge];
  wmma::load_matrix_sync(f, m, unsigned(edge), wmma::mem_row_major);
  products<DM>(s, a, b);  // s = a b[0:16]^T
  row_operand<T> wr[chunks];  // w again, each element set by a lane that holds it in an accumulator
#pragma unroll
  for (int cc = 0; cc < chunks; ++cc)
#pragma unroll
    for (int e = 0; e < accumulator::num_elements; e += 2) {
      const int r = row_of(slot_of(e), lane), c = cc * edge + column_of(e, lane);
      set_pair<T>(wr[cc], e, a_at(r, c), a_at(r, c + 1));
    }
#pragma unroll
  for (int dc = 0; dc < DM / edge; ++dc) {
    wmma::fill_fragment(acc[dc], 0.0f);
    wmma::fill_fragment(held[dc], 0.0f);
  }
  accumulate<DM>(acc, w, b);  // acc = w b
  accumulate<DM>(held, wr, b);
  int ok = 1;
  for (int e = 0; e < accumulator::num_elements; ++e) {
    const int r = row_of(slot_of(e), lane), c = column_of(e, lane);
    ok &= f.x[e] == float(r * edge + c);
    float dot = 0.0f, sum[DM / edge] = {};
    for (int k = 0; k < DM; ++k) dot += a_at(r, k) * b_at(c, k);
    for (int k = 0; k < tile; ++k)
      for (int dc = 0; dc < DM / edge; ++dc) sum[dc] += a_at(r, k) * b_at(k, dc * edge + c);
    ok &= s[0].x[e] == dot;
    for (int dc = 0; dc < DM / edge; ++dc) ok &= acc[dc].x[e] == sum[dc] && held[dc].x[e] == sum[dc];
  }
  flags[lane] = ok;
#else
  flags[threadIdx.x % 32] = 0;  // no wmma below sm_80
#endif
}

}  // namespace shardlib::ops::cuda::detail::tensor
