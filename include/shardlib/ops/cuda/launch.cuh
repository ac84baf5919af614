// shardlib/ops/cuda/launch.cuh — what every shardlib kernel shares: block_team
// (a Team of one CUDA block), launch_kernel, launch shapes, and the element-wise
// loops (map_elements with 16-byte vectors, for_each_index for the rest).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"              // require, shape_error
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/caching_allocator.hpp"  // caching_allocator, device_buffer
#include "shardlib/cuda/error.hpp"              // check
#include "shardlib/ops/cuda/team.hpp"           // Team

#include <cuda_runtime.h>

#include <algorithm>  // std::clamp, std::max
#include <cmath>      // INFINITY
#include <cstddef>    // std::size_t, std::byte
#include <cstdint>    // std::int64_t, std::uintptr_t
#include <utility>    // std::forward

namespace shardlib::ops::cuda {

// The threads of one block as a Team, one row per block. blockDim.x must be a
// multiple of 32 (row_threads gives one). sum and max reduce within each warp
// by shuffles, then across warps through shared memory; every warp reduces the
// per-warp partials itself, so all threads get the result after two barriers.
struct block_team {
  __device__ int rank() const { return int(threadIdx.x); }
  __device__ int size() const { return int(blockDim.x); }
  __device__ float sum(float x) const { return reduce(x, 0.0f, [](float a, float b) { return a + b; }); }
  __device__ float max(float x) const { return reduce(x, -INFINITY, [](float a, float b) { return fmaxf(a, b); }); }

 private:
  template <class Op>
  __device__ static float reduce(float x, float identity, Op op) {
    static __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xFFFFFFFFu, x, offset));
    const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, warps = int(blockDim.x) / 32;
    __syncthreads();  // the previous reduction has finished reading `partial`
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    x = lane < warps ? partial[lane] : identity;
    for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xFFFFFFFFu, x, offset));
    return x;
  }
};

// kernel<<<grid, block, shared_bytes, stream>>>(args...), checked: a launch
// that fails (a bad configuration) raises here, naming the kernel. Spelled as
// the runtime's typed cudaLaunchKernelEx (the chevrons call the runtime's
// cudaLaunchKernel; the arguments convert as they would), so that a plain C++
// compiler reads every launch: tests/emulated runs the kernels on the CPU
// through it.
template <class... Params, class... Args>
void launch_kernel(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  shardlib::cuda::check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), "launch of kernel ", name);
}

// Threads for a block that handles one row of n elements: n rounded up to
// whole warps, at most 512 (then each thread takes several elements).
inline int row_threads(std::int64_t n) { return int(std::clamp<std::int64_t>((n + 31) / 32 * 32, 32, 512)); }

// Blocks for a kernel of one block per row: a grid's x holds 2^31 - 1, and a row count
// beyond it would launch rows mod 2^32 blocks (or fail) rather than raise.
inline unsigned row_blocks(std::int64_t rows, const char* name) {
  require<shape_error>(rows <= std::int64_t(0x7fffffff), name, ": ", rows,
                       " rows of one block each are more than a grid holds (2^31 - 1)");
  return unsigned(rows);
}

// Blocks for a grid-stride loop over n items: enough to fill the largest
// current GPU several times over (an H200 keeps 132 x 8 blocks of 256 threads
// resident), no more: past that each thread loops, which costs nothing for
// memory-bound kernels and keeps launches small on huge inputs.
inline unsigned grid_blocks(std::int64_t n, int threads) {
  return unsigned(std::clamp<std::int64_t>((n + threads - 1) / threads, 1, 4096));
}

// f(i) for every i in [0, n): for kernels whose elements are not a plain map
// of equal-length arrays (gathers, strided layouts); map_elements is faster.
template <class F>
__global__ void for_each_index_kernel(std::int64_t n, F f) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

template <class F>
void for_each_index(std::int64_t n, F f, cudaStream_t stream, const char* name) {
  if (n <= 0) return;
  constexpr int threads = 256;
  launch_kernel(name, for_each_index_kernel<F>, grid_blocks(n, threads), threads, 0, stream, n, f);
}

namespace detail {
// N consecutive elements of T as one aligned access: 16 bytes (one 128-bit
// load or store) for the widest type of a map, narrower for the others.
template <class T, int N>
struct alignas(sizeof(T) * N) vec {
  T v[N];
};

template <class... T>
inline constexpr int vector_width = int(16 / std::max({sizeof(T)...}));

// The accesses go through plain integer types of the vector's size: copied as
// a struct of 16-bit elements, nvcc would load element by element.
template <std::size_t Bytes>
struct raw_bits;
template <> struct raw_bits<16> { using type = uint4; };
template <> struct raw_bits<8> { using type = uint2; };
template <> struct raw_bits<4> { using type = unsigned; };
template <> struct raw_bits<2> { using type = unsigned short; };
template <> struct raw_bits<1> { using type = unsigned char; };
template <class T, int N>
using raw_vec = typename raw_bits<sizeof(vec<T, N>)>::type;

template <int N, class T>
__device__ __forceinline__ vec<T, N> load_vector(const T* p) {
  return __builtin_bit_cast(vec<T, N>, *reinterpret_cast<const raw_vec<T, N>*>(p));
}

template <int N, class T>
__device__ __forceinline__ void store_vector(const vec<T, N>& x, T* p) {
  *reinterpret_cast<raw_vec<T, N>*>(p) = __builtin_bit_cast(raw_vec<T, N>, x);
}

// Four consecutive elements into registers and back, as one aligned access each (the
// optimizers' fused kernels, whose arrays differ in element size; doubles as two).
template <class T>
__device__ __forceinline__ void load4(const T* src, T* dst) {
  constexpr int N = sizeof(T) * 4 > 16 ? 2 : 4;
#pragma unroll
  for (int h = 0; h < 4; h += N) {
    const vec<T, N> x = load_vector<N>(src + h);
#pragma unroll
    for (int l = 0; l < N; ++l) dst[h + l] = x.v[l];
  }
}
template <class T>
__device__ __forceinline__ void store4(const T* src, T* dst) {
  constexpr int N = sizeof(T) * 4 > 16 ? 2 : 4;
#pragma unroll
  for (int h = 0; h < 4; h += N) {
    vec<T, N> x;
#pragma unroll
    for (int l = 0; l < N; ++l) x.v[l] = src[h + l];
    store_vector(x, dst + h);
  }
}

template <int N, class Out, class Op, class... In>
__device__ __forceinline__ void map_vector(std::int64_t i, const Op& op, Out* out, const vec<In, N>&... x) {
  vec<Out, N> y;
#pragma unroll
  for (int j = 0; j < N; ++j) y.v[j] = op(i + j, x.v[j]...);
  store_vector(y, out + i);
}

// Elements [head, head + vectors * N) in vectors of N, the rest ("edges": the
// head before the first aligned element and the tail after the last whole
// vector) one by one; both grid-stride with 64-bit indices.
template <int N, class Out, class Op, class... In>
__global__ void map_kernel(std::int64_t n, std::int64_t head, std::int64_t vectors, Op op, Out* out,
                           const In*... in) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  const std::int64_t first = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t v = first; v < vectors; v += stride) {
    const std::int64_t i = head + v * N;
    map_vector<N>(i, op, out, load_vector<N>(in + i)...);
  }
  const std::int64_t tail = head + vectors * N, edges = head + (n - tail);
  for (std::int64_t e = first; e < edges; e += stride) {
    const std::int64_t i = e < head ? e : tail + (e - head);
    out[i] = op(i, in[i]...);
  }
}

inline bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// Whether p + i starts an aligned vector of N elements of T.
template <class T>
bool vector_aligned(const T* p, std::int64_t i, int n) {
  return (reinterpret_cast<std::uintptr_t>(p + i) % (sizeof(T) * std::size_t(n))) == 0;
}
}  // namespace detail

// out[i] = op(i, in[i]...) for every i in [0, n): the loop of every
// element-wise kernel. The body moves N = 16 / (largest element size)
// elements per access (8 bf16 or 4 floats in 16 bytes) once out is aligned,
// when every input is aligned at the same element; pointers that are not
// (a view one element in) start with up to N - 1 single elements, and the
// remainder of n ends with them. op computes each element alone, so results
// are the same bits whichever path an element takes.
template <class Out, class Op, class... In>
void map_elements(std::int64_t n, Op op, cudaStream_t stream, const char* name, Out* out, const In*... in) {
  if (n <= 0) return;
  constexpr int N = detail::vector_width<Out, In...>;
  const auto out_at = reinterpret_cast<std::uintptr_t>(out);
  std::int64_t head = out_at % sizeof(Out) != 0
                          ? n
                          : std::int64_t((N - out_at / sizeof(Out) % N) % N);  // elements before out is aligned
  if (head >= n || !(detail::vector_aligned(in, head, N) && ...)) head = n;      // all one by one
  const std::int64_t vectors = (n - head) / N, edges = n - vectors * N;
  constexpr int threads = 256;
  launch_kernel(name, detail::map_kernel<N, Out, Op, In...>, grid_blocks(std::max(vectors, edges), threads), threads, 0,
                stream, n, head, vectors, op, out, in...);
}

// A kernel's report of a bad input (a target or id out of range) into an
// index_report slot: the smallest index wins, so the report is deterministic.
__device__ inline void report_index(unsigned long long* slot, std::int64_t index) {
  if (slot) atomicMin(slot, static_cast<unsigned long long>(index));
}

namespace detail {
// CUB's two-pass protocol: ask for the scratch size, then run with scratch
// from the caching allocator on the same stream.
template <class Run>
void with_cub_scratch(Run run, cudaStream_t stream, shardlib::cuda::caching_allocator& alloc, const char* what) {
  std::size_t bytes = 0;
  shardlib::cuda::check(run(nullptr, bytes), what, " (scratch size)");
  shardlib::cuda::device_buffer<std::byte> scratch(bytes, category::activations, stream, alloc);
  shardlib::cuda::check(run(scratch.data(), bytes), what);
}
}  // namespace detail

}  // namespace shardlib::ops::cuda
