// shardlib/ops/cuda/rotary.hpp — the per-pair arithmetic of rotary position
// embeddings on a strided view of heads (nn::rotary_table's rotation), shared by
// the kernel (ops/cuda/rotary.cuh) and the host, where it can be run index by
// index against nn::rotary_table::apply.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/nn/sdpa.hpp"  // head_view

#include <cstdint>  // std::int64_t, std::uint32_t, UINT32_MAX

namespace shardlib::ops::cuda {

// Index idx in [0, batch * heads * seq * dim/2) is one pair (i, i + dim/2) of
// one head row, in float:
//   y_i = x_i cos - x_{i+half} sin,  y_{i+half} = x_{i+half} cos + x_i sin,
// with sin negated for the inverse rotation and cos, sin read at table row
// offset + l, or at positions[n * seq + l] when positions (device memory,
// [batch, seq]) is given. Each pair is read before it is written by the same index, so x
// and y may be the same view.
template <class T>
struct rotary_pair {
  const T* x;
  T* y;
  std::int64_t heads, seq, half;
  std::int64_t x_batch, x_head, x_row, y_batch, y_head, y_row;  // strides
  const float *cos, *sin;
  std::int64_t offset;
  const std::int64_t* positions;
  float sign;
  bool narrow;  // every index fits 32 bits: the index arithmetic in 32 bits (64-bit division is ~4x the work)

  rotary_pair(const nn::head_view<T>& xv, const nn::head_view<T>& yv, const float* c, const float* s,
              std::int64_t off, bool inverse, const std::int64_t* at = nullptr)
      : x(xv.data), y(yv.data), heads(xv.heads), seq(xv.seq), half(xv.dim / 2),
        x_batch(xv.batch_stride), x_head(xv.head_stride), x_row(xv.row_stride),
        y_batch(yv.batch_stride), y_head(yv.head_stride), y_row(yv.row_stride),
        cos(c), sin(s), offset(off), positions(at), sign(inverse ? -1.0f : 1.0f),
        narrow(xv.batch * xv.heads * xv.seq * (xv.dim / 2) <= std::int64_t(UINT32_MAX)) {}

  SHARDLIB_HD void operator()(std::int64_t idx) const {
    if (narrow) rotate(std::uint32_t(idx));
    else rotate(idx);
  }

 private:
  template <class I>
  SHARDLIB_HD void rotate(I idx) const {
    const I i = idx % I(half), row = idx / I(half);  // row = (n H + h) L + l
    const I l = row % I(seq), nh = row / I(seq), h = nh % I(heads), n = nh / I(heads);
    const T* a = x + std::int64_t(n) * x_batch + std::int64_t(h) * x_head + std::int64_t(l) * x_row;
    T* b = y + std::int64_t(n) * y_batch + std::int64_t(h) * y_head + std::int64_t(l) * y_row;
    const std::int64_t p = positions ? positions[std::int64_t(n) * seq + std::int64_t(l)] : offset + std::int64_t(l);
    const std::int64_t t = p * half + std::int64_t(i);
    const float c = cos[t], s = sign * sin[t];
    const float a0 = float(a[i]), a1 = float(a[i + I(half)]);
    b[i] = T(a0 * c - a1 * s);
    b[i + I(half)] = T(a1 * c + a0 * s);
  }
};

// How many pairs rotary_pair runs over for the view x.
template <class T>
std::int64_t rotary_pairs(const nn::head_view<T>& x) {
  return x.batch * x.heads * x.seq * (x.dim / 2);
}

}  // namespace shardlib::ops::cuda
