// tests/emulated/include/mma.h — stands in for CUDA's <mma.h> in the emulated tests:
// wmma's 16x16x16 tiles with 16-bit inputs and fp32 accumulators. Each thread loads
// and computes the whole tile, and stores only its share (lane l the elements
// r * 16 + c = l mod 32), as the hardware's lanes each store their part: a thread
// that reads a stored tile before the __syncwarp that orders it finds the shares of
// lanes that have not run yet still unwritten. Pointers must be 32-byte aligned and
// leading dimensions a multiple of 16 bytes, as wmma requires. A fragment's elements
// x[16 r + c] are the whole tile in every lane, which `whole_tile` tells the kernels
// (ops/cuda/flash_tensor_products.cuh) that read and write them one by one.
#pragma once
#include "../cuda_emulator.hpp"

#include <cstddef>      // std::size_t
#include <cstdint>      // std::uintptr_t
#include <string>       // std::to_string
#include <type_traits>  // std::is_same_v

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation has 16x16x16 tiles only");
  static constexpr bool whole_tile = true;
  static constexpr int num_elements = 256;
  float x[256];  // [16 row + column] of the tile the fragment holds
};

namespace detail {
template <class T>
void check(const T* p, unsigned ld, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0 || ld * sizeof(T) % 16 != 0)
    throw cuda_emulator::emulation_error(std::string(what) + ": the pointer must be 32-byte aligned and the leading " +
                                         "dimension a multiple of 16 bytes, got offset " +
                                         std::to_string(reinterpret_cast<std::uintptr_t>(p) % 32) + " and " +
                                         std::to_string(ld) + " elements");
}
inline std::size_t at(int r, int c, unsigned ld, bool column_major) {
  return column_major ? std::size_t(c) * ld + std::size_t(r) : std::size_t(r) * ld + std::size_t(c);
}
template <class Frag, class T>
void load(Frag& f, const T* p, unsigned ld, bool column_major) {
  check(p, ld, "load_matrix_sync");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = cuda_emulator::to_float(p[at(r, c, ld, column_major)]);
}
}  // namespace detail

template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ld) {
  detail::load(f, p, ld, std::is_same_v<Layout, col_major>);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ld, layout_t l) {
  detail::load(f, p, ld, l == mem_col_major);
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ld, layout_t l) {
  detail::check(p, ld, "store_matrix_sync");
  const int lane = int(threadIdx.x) % cuda_emulator::warp_size;
  for (int e = lane; e < 256; e += cuda_emulator::warp_size)
    p[detail::at(e / 16, e % 16, ld, l == mem_col_major)] = f.x[e];
}
template <class Use, class T, class Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float v) {
  for (float& x : f.x) x = v;
}
// d = a b + c, summed in fp32 (d may be c).
template <class T, class LayoutA, class LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  fragment<accumulator, 16, 16, 16, float> t;
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float s = c.x[m * 16 + n];
      for (int k = 0; k < 16; ++k) s += a.x[m * 16 + k] * b.x[k * 16 + n];
      t.x[m * 16 + n] = s;
    }
  d = t;
}

}  // namespace nvcuda::wmma
