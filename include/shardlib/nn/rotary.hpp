// shardlib/nn/rotary.hpp — rotary position embeddings (RoPE) as LLaMA and Hugging
// Face apply them, forward and backward.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/nn/sdpa.hpp"

#include <cmath>    // std::cos, std::pow, std::sin
#include <cstdint>  // std::int64_t
#include <span>     // std::span
#include <vector>   // std::vector

namespace shardlib::nn {

// Dimension i < dim/2 of a head pairs with i + dim/2 (Hugging Face's rotate_half
// layout, not the original paper's interleaved pairs): at position p the pair
// turns by the angle p * base^(-2i / dim),
//   y_i = x_i cos - x_{i+dim/2} sin,   y_{i+dim/2} = x_{i+dim/2} cos + x_i sin,
// which is x * cos + rotate_half(x) * sin. Angles are computed in double and the
// sines and cosines rounded to T once (Hugging Face computes the angles in float32,
// which differs by ~1e-7 * position relative).
struct rotary_options {
  std::int64_t head_dim = 0;  // even
  double base = 10000;        // rope_theta
};

// The cosines and sines of positions [offset, offset + seq), [seq, dim/2] each.
template <class T>
class rotary_table {
 public:
  rotary_table(const rotary_options& o, std::int64_t offset, std::int64_t seq) : half_(o.head_dim / 2), seq_(seq) {
    require<shape_error>(o.head_dim > 0 && o.head_dim % 2 == 0, "rotary embedding: head_dim must be even and positive, got ",
                         o.head_dim);
    require(o.base > 0, "rotary embedding: base must be positive, got ", o.base);
    cos_.resize(std::size_t(seq * half_));
    sin_.resize(cos_.size());
    for (std::int64_t i = 0; i < half_; ++i) {
      const double inv_freq = std::pow(o.base, -2.0 * double(i) / double(o.head_dim));
      for (std::int64_t l = 0; l < seq; ++l) {
        const double angle = double(offset + l) * inv_freq;
        cos_[std::size_t(l * half_ + i)] = T(std::cos(angle));
        sin_[std::size_t(l * half_ + i)] = T(std::sin(angle));
      }
    }
  }

  std::int64_t head_dim() const { return 2 * half_; }
  std::int64_t positions() const { return seq_; }
  // [positions, head_dim / 2] row-major: what the device's copy of a table holds
  // (ops/cuda/rotary.cuh).
  std::span<const T> cosines() const { return cos_; }
  std::span<const T> sines() const { return sin_; }

  // Rotates every head of x in place by its position's angles (forward), or
  // by their negatives (inverse = true: backward, since a rotation's transpose
  // is its inverse, dL/dx = R^T dL/dy).
  void apply(const head_view<T>& x, bool inverse = false) const {
    require<shape_error>(x.dim == 2 * half_ && x.seq == seq_, "rotary embedding: a table for ", seq_,
                         " positions of head_dim ", 2 * half_, " cannot rotate heads of shape ", x.shape());
    const T sign = inverse ? T(-1) : T(1);
    for (std::int64_t n = 0; n < x.batch; ++n)
      for (std::int64_t h = 0; h < x.heads; ++h)
        for (std::int64_t l = 0; l < x.seq; ++l) {
          T* a = x.at(n, h) + l * x.row_stride;
          T* b = a + half_;
          const T* c = cos_.data() + l * half_;
          const T* s = sin_.data() + l * half_;
          for (std::int64_t i = 0; i < half_; ++i) {
            const T a0 = a[i], b0 = b[i], si = sign * s[i];
            a[i] = a0 * c[i] - b0 * si;
            b[i] = b0 * c[i] + a0 * si;
          }
        }
  }

 private:
  std::int64_t half_, seq_;
  std::vector<T> cos_, sin_;
};

}  // namespace shardlib::nn
