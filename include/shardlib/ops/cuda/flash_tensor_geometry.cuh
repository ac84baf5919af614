// shardlib/ops/cuda/flash_tensor_geometry.cuh — the shape of the tensor-core attention's
// blocks (ops/cuda/flash_tensor_kernels.cuh): the tile and pitch constants, the shared
// memory each kernel takes, and the head dims, scales and row layouts the kernels accept.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"        // bfloat16, half
#include "shardlib/ops/cuda/flash_kernels.cuh"  // rows

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>    // std::max
#include <cmath>        // std::isfinite
#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t, std::uintptr_t
#include <limits>       // std::numeric_limits
#include <type_traits>  // std::is_same_v

namespace shardlib::ops::cuda::detail::tensor {
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
// staged tiles of rows, dk/dv's P^T and dS^T (each warp's 16 rows of weights on their way
// from its accumulators to the next product; forward's P and dq's dS stay in registers),
// and dk/dv's two query buffers with their lse and D (and one dO buffer). At the end the
// accumulators go out through the first two staged tiles.
template <int DM>
constexpr std::size_t rows_bytes = std::size_t(tile) * row_pitch<DM> * 2;
constexpr std::size_t weights_bytes = std::size_t(tile) * weight_pitch * 2;
template <int DM>
constexpr std::size_t through_bytes = std::size_t(warps) * edge * acc_pitch<DM> * 4;
template <int DM>
constexpr std::size_t forward_bytes = 3 * rows_bytes<DM>;
template <int DM>
constexpr std::size_t dq_bytes = 4 * rows_bytes<DM>;
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

}  // namespace shardlib::ops::cuda::detail::tensor
