// shardlib/nn/embedding.hpp — Embedding: a lookup table of rows (torch.nn.Embedding).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/param.hpp"

#include <algorithm>  // std::copy_n
#include <array>      // std::array
#include <cstdint>    // std::int64_t
#include <span>       // std::span

namespace shardlib::nn {

// weight [num_embeddings, embedding_dim], initialised N(0, 1) as torch's. Ids of
// any shape S give rows of shape S + [embedding_dim]; ids carry no gradient, so
// backward returns an empty id tensor.
template <class T>
class Embedding {
 public:
  using input = Tensor<std::int64_t>;
  using output = Tensor<T>;

  Embedding(std::int64_t num_embeddings, std::int64_t embedding_dim) : num_(num_embeddings), dim_(embedding_dim) {
    weight.shape = Shape{num_, dim_};
    weight.init = init_rule::normal_with(0, 1);
  }

  Param<T> weight;

  std::int64_t num_embeddings() const { return num_; }
  std::int64_t embedding_dim() const { return dim_; }

  template <class V>
  void parameters(V&& v) {
    v("weight", weight);
  }

  template <class Ctx>
  output forward(Ctx&, const input& ids) {
    require<shape_error>(!ids.empty() && ids.rank() < Shape::max_rank, "Embedding(", num_, ", ", dim_,
                         "): needs ids of rank below ", Shape::max_rank, ", got shape ", ids.shape(),
                         ids.empty() ? " (an empty tensor)" : "");
    weight.require_bound("Embedding");
    output y(output_shape(ids.shape()));
    for (std::int64_t i = 0; i < ids.numel(); ++i) {
      const std::int64_t id = ids[i];
      if (id < 0 || id >= num_)
        throw shape_error(cat("Embedding(", num_, ", ", dim_, "): id ", id, " at position ", position(ids.shape(), i),
                              " of the input ", ids.shape(), " is out of range for a table of ", num_, " rows"));
      std::copy_n(weight.value + id * dim_, dim_, y.data() + i * dim_);
    }
    ids_ = ids;
    return y;
  }

  // Rows used several times accumulate every use's gradient.
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    require<shape_error>(!ids_.empty(), "Embedding(", num_, ", ", dim_, "): backward without a forward");
    weight.require_bound("Embedding", true);
    const Shape expected = output_shape(ids_.shape());
    require<shape_error>(dy.shape() == expected, "Embedding(", num_, ", ", dim_,
                         "): backward needs the gradient of the last forward's output (shape ", expected,
                         "), got shape ", dy.shape());
    for (std::int64_t i = 0; i < ids_.numel(); ++i) {
      T* g = weight.grad + ids_[i] * dim_;
      const T* d = dy.data() + i * dim_;
      for (std::int64_t j = 0; j < dim_; ++j) g[j] += d[j];
    }
    ids_ = {};
    return {};
  }

 private:
  Shape output_shape(const Shape& ids) const {
    std::array<std::int64_t, Shape::max_rank> ext{};
    std::copy_n(ids.extents().begin(), ids.rank(), ext.begin());
    ext[ids.rank()] = dim_;
    return Shape(std::span<const std::int64_t>(ext.data(), std::size_t(ids.rank()) + 1));
  }

  // The row-major index of flat element i of `s`, written like a shape: [1, 3].
  static Shape position(const Shape& s, std::int64_t i) {
    std::array<std::int64_t, Shape::max_rank> idx{};
    for (int d = s.rank() - 1; d >= 0; --d) {
      idx[d] = i % s[d];
      i /= s[d];
    }
    return Shape(std::span<const std::int64_t>(idx.data(), std::size_t(s.rank())));
  }

  std::int64_t num_, dim_;
  input ids_;  // cached for backward
};

}  // namespace shardlib::nn
