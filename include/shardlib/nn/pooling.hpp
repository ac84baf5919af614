// shardlib/nn/pooling.hpp — MeanPool: the mean over one dimension, padding-aware
// (x.mean(dim) in torch; the masked mean of a padded batch).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"

#include <array>        // std::array
#include <cstdint>      // std::int64_t, std::uint8_t
#include <span>         // std::span
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

namespace detail {
// The input of MeanPool(dim) seen as [outer, len, inner] around the pooled dimension.
inline std::int64_t pool_outer_size(const Shape& s, int dim) {
  std::int64_t n = 1;
  for (int d = 0; d < dim; ++d) n *= s[d];
  return n;
}
inline std::int64_t pool_inner_size(const Shape& s, int dim) {
  std::int64_t n = 1;
  for (int d = dim + 1; d < s.rank(); ++d) n *= s[d];
  return n;
}
inline Shape pooled_shape(const Shape& s, int dim) {
  std::array<std::int64_t, Shape::max_rank> ext{};
  int r = 0;
  for (int d = 0; d < s.rank(); ++d)
    if (d != dim) ext[r++] = s[d];
  return Shape(std::span<const std::int64_t>(ext.data(), std::size_t(r)));
}

// MeanPool(dim)'s padding weights for an input of shape s: per (sequence,
// position), 1 / (its non-padded count), or 0 at padding; empty when the mask
// does not apply (every weight is then 1 / len). W is the weights' type.
template <class W>
Tensor<W> pool_padding_weights(const Shape& s, int dim, const Tensor<std::uint8_t>& mask) {
  if (mask.empty() || s.rank() != 3 || dim > 1) return {};
  const std::int64_t batch = s[1 - dim], len = s[dim];
  const Shape expected{batch, len};
  require<shape_error>(mask.shape() == expected, "MeanPool(", dim, "): the key padding mask must be [batch, sequence] = ",
                       expected, " for the input ", s, " (", dim == 1 ? "batch-first [N, L, E]" : "sequence-first [L, N, E]",
                       "), got ", mask.shape());
  Tensor<W> w(Shape{batch, len});
  for (std::int64_t b = 0; b < batch; ++b) {
    std::int64_t kept = 0;
    for (std::int64_t l = 0; l < len; ++l) kept += mask[b * len + l] == 0;
    require(kept > 0, "MeanPool(", dim, "): sequence ", b, " of the batch is all padding; its mean is undefined");
    for (std::int64_t l = 0; l < len; ++l) w[b * len + l] = mask[b * len + l] == 0 ? W(1) / W(kept) : W(0);
  }
  return w;
}

// What MeanPool's two versions share (the host's below, the device's in
// nn/cuda/pooling.cuh): dim, parameters(), the input's shape cached by forward
// for backward, the shape checks with their messages and the geometry.
class mean_pool_base {
 public:
  explicit mean_pool_base(int dim) : dim_(dim) {}

  int dim() const { return dim_; }

  template <class V>
  void parameters(V&&) {}

 protected:
  // forward's check of x's shape, which it keeps for backward.
  void begin_forward(const Shape& x) {
    require<shape_error>(dim_ >= 0 && dim_ < x.rank(), "MeanPool(", dim_, "): the input has no dimension ", dim_,
                         ", got shape ", x);
    shape_ = x;
  }
  // backward's check of dy's shape.
  void check_grad(const Shape& dy) const {
    require_activations(shape_.rank() > 0, "MeanPool(", dim_, ")");
    require<shape_error>(dy == pooled_shape(), "MeanPool(", dim_,
                         "): backward needs the gradient of the last forward's output, got shape ", dy);
  }

  std::int64_t outer_size() const { return pool_outer_size(shape_, dim_); }
  std::int64_t inner_size() const { return pool_inner_size(shape_, dim_); }
  Shape pooled_shape() const { return detail::pooled_shape(shape_, dim_); }

  int dim_;
  Shape shape_{};  // the input's, cached for backward
};
}  // namespace detail

// Averages over dimension `dim` and removes it: [N, L, E] pooled over dim 1, or
// [L, N, E] over dim 0, gives [N, E]. There is no default dim, because a wrong
// one silently averages over the batch.
//
// Padding: when the input has rank 3, dim is 0 or 1 (the sequence dimension of
// the two layouts above: batch-first [N, L, E] pooling dim 1, sequence-first
// [L, N, E] pooling dim 0) and ctx.key_padding_mask() is not empty, the mask
// ([N, L], nonzero = padding, as torch's src_key_padding_mask in both layouts)
// must have the shape [N, L] of that layout, and each sequence averages only its
// non-padded positions. A mask of another shape, or a sequence made only of
// padding, raises an error instead of giving a silently wrong mean. Other ranks
// and dims ignore the mask.
template <class T, class Space = host_space>
class MeanPool : public detail::mean_pool_base {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::MeanPool: the host layer; for cuda_space include shardlib/nn/cuda/pooling.cuh");

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;

  using mean_pool_base::mean_pool_base;  // MeanPool(dim)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    begin_forward(x.shape());
    weights_ = detail::pool_padding_weights<T>(shape_, dim_, ctx.key_padding_mask());
    const std::int64_t outer = outer_size(), len = shape_[dim_], inner = inner_size();
    output y(pooled_shape());
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t i = 0; i < inner; ++i) {
        T s = 0;
        for (std::int64_t l = 0; l < len; ++l) s += weight(o, l, i) * x[(o * len + l) * inner + i];
        y[o * inner + i] = s;
      }
    if (!grad_enabled(ctx)) {  // nothing kept for a backward
      shape_ = {};
      weights_ = {};
    }
    return y;
  }

  // dx[.., l, ..] = weight(l) * dy: each position gets its share of the mean.
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    check_grad(dy.shape());
    const std::int64_t outer = outer_size(), len = shape_[dim_], inner = inner_size();
    input dx(shape_);
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t l = 0; l < len; ++l)
        for (std::int64_t i = 0; i < inner; ++i) dx[(o * len + l) * inner + i] = weight(o, l, i) * dy[o * inner + i];
    shape_ = {};
    weights_ = {};
    return dx;
  }

 private:
  // The weight of x[o, l, i] in the mean: batch index b is o when batch-first
  // (dim 1, inner = E) and i / E when sequence-first (dim 0, outer = 1).
  T weight(std::int64_t o, std::int64_t l, std::int64_t i) const {
    const std::int64_t len = shape_[dim_];
    if (weights_.empty()) return T(1) / T(len);
    const std::int64_t b = dim_ == 1 ? o : i / shape_[2];
    return weights_[b * len + l];
  }

  Tensor<T> weights_;  // padding weights [N, L], cached for backward
};

}  // namespace shardlib::nn
