// shardlib/nn/rotary.hpp — rotary position embeddings (RoPE) as LLaMA and Hugging
// Face apply them, forward and backward.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/sdpa.hpp"

#include <cmath>        // std::cos, std::pow, std::sin
#include <cstdint>      // std::int64_t
#include <numbers>      // std::numbers::pi
#include <span>         // std::span
#include <string_view>  // std::string_view
#include <vector>       // std::vector

namespace shardlib::nn {

// Dimension i < dim/2 of a head pairs with i + dim/2 (Hugging Face's rotate_half
// layout, not the original paper's interleaved pairs): at position p the pair
// turns by the angle p * base^(-2i / dim),
//   y_i = x_i cos - x_{i+dim/2} sin,   y_{i+dim/2} = x_{i+dim/2} cos + x_i sin,
// which is x * cos + rotate_half(x) * sin. Angles are computed in double and the
// sines and cosines rounded to T once (Hugging Face computes the angles in float32,
// which differs by ~1e-7 * position relative).
//
// rope_scaling stretches the frequencies for a context longer than the model was
// trained on, as Hugging Face's rope_scaling does (its attention factor is 1 for
// both kinds here):
//   linear  every frequency divided by factor;
//   llama3  (Llama 3.1) a frequency whose wavelength 2 pi / f exceeds
//           original_max_position_embeddings / low_freq_factor divided by factor,
//           one whose wavelength is below original / high_freq_factor kept, and
//           those between blended: (1 - s) f / factor + s f with
//           s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
struct rope_scaling {
  enum class kind { none, linear, llama3 };
  kind type = kind::none;
  double factor = 1;
  double low_freq_factor = 1, high_freq_factor = 4;      // llama3
  std::int64_t original_max_position_embeddings = 8192;  // llama3
};

struct rotary_options {
  std::int64_t head_dim = 0;  // even
  double base = 10000;        // rope_theta
  rope_scaling scaling{};
};

// The checks of rotary_options, naming `who`.
inline void check_rotary(const rotary_options& o, std::string_view who) {
  require<shape_error>(o.head_dim > 0 && o.head_dim % 2 == 0, who, ": head_dim must be even and positive, got ",
                       o.head_dim);
  require(o.base > 0, who, ": base (rope_theta) must be positive, got ", o.base);
  const rope_scaling& r = o.scaling;
  if (r.type == rope_scaling::kind::none) return;
  require(r.factor > 0, who, ": rope_scaling factor must be positive, got ", r.factor);
  if (r.type == rope_scaling::kind::llama3)
    require(r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor && r.original_max_position_embeddings > 0,
            who, ": llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor and "
            "original_max_position_embeddings > 0, got low_freq_factor ", r.low_freq_factor, ", high_freq_factor ",
            r.high_freq_factor, ", original_max_position_embeddings ", r.original_max_position_embeddings);
}

// The frequencies (radians per position) of dimensions i < head_dim / 2, scaled, in double.
inline std::vector<double> rotary_frequencies(const rotary_options& o) {
  check_rotary(o, "rotary embedding");
  const rope_scaling& r = o.scaling;
  std::vector<double> f(std::size_t(o.head_dim / 2));
  for (std::size_t i = 0; i < f.size(); ++i) {
    const double base = std::pow(o.base, -2.0 * double(i) / double(o.head_dim));
    f[i] = base;
    if (r.type == rope_scaling::kind::linear) {
      f[i] = base / r.factor;
    } else if (r.type == rope_scaling::kind::llama3) {
      const double original = double(r.original_max_position_embeddings), wavelength = 2 * std::numbers::pi / base;
      if (wavelength > original / r.low_freq_factor) {
        f[i] = base / r.factor;
      } else if (wavelength >= original / r.high_freq_factor) {
        const double s = (original / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        f[i] = (1 - s) * base / r.factor + s * base;
      }
    }
  }
  return f;
}

// The cosines and sines of positions [offset, offset + seq), [seq, dim/2] each.
template <class T>
class rotary_table {
 public:
  rotary_table(const rotary_options& o, std::int64_t offset, std::int64_t seq)
      : half_(o.head_dim / 2), first_(offset), seq_(seq) {
    const std::vector<double> frequency = rotary_frequencies(o);
    cos_.resize(std::size_t(seq * half_));
    sin_.resize(cos_.size());
    for (std::int64_t i = 0; i < half_; ++i) {
      const double inv_freq = frequency[std::size_t(i)];
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
    rotate(x, inverse, [](std::int64_t, std::int64_t l) { return l; });
  }
  // The same with token (n, l) at position ids[n * x.seq + l] (the context's
  // position ids, [x.batch, x.seq], each among the table's positions).
  void apply_at(const head_view<T>& x, const Tensor<std::int64_t>& ids, bool inverse = false) const {
    require<shape_error>(x.dim == 2 * half_ && ids.shape() == Shape{x.batch, x.seq}, "rotary embedding: heads of ",
                         "shape ", x.shape(), " need position ids [", x.batch, ", ", x.seq, "] and head_dim ",
                         2 * half_, ", got ids ", ids.shape());
    for (std::int64_t i = 0; i < ids.numel(); ++i)
      require<shape_error>(ids[i] >= first_ && ids[i] < first_ + seq_, "rotary embedding: position id ", ids[i],
                           " is outside the table's positions ", first_, "..", first_ + seq_ - 1);
    rotate(x, inverse, [&](std::int64_t n, std::int64_t l) { return ids[n * x.seq + l] - first_; });
  }

 private:
  template <class Row>
  void rotate(const head_view<T>& x, bool inverse, Row row) const {
    const T sign = inverse ? T(-1) : T(1);
    for (std::int64_t n = 0; n < x.batch; ++n)
      for (std::int64_t h = 0; h < x.heads; ++h)
        for (std::int64_t l = 0; l < x.seq; ++l) {
          T* a = x.at(n, h) + l * x.row_stride;
          T* b = a + half_;
          const T* c = cos_.data() + row(n, l) * half_;
          const T* s = sin_.data() + row(n, l) * half_;
          for (std::int64_t i = 0; i < half_; ++i) {
            const T a0 = a[i], b0 = b[i], si = sign * s[i];
            a[i] = a0 * c[i] - b0 * si;
            b[i] = b0 * c[i] + a0 * si;
          }
        }
  }

  std::int64_t half_, first_, seq_;
  std::vector<T> cos_, sin_;
};

}  // namespace shardlib::nn
