// shardlib/nn/embedding.hpp — Embedding: a lookup table of rows (torch.nn.Embedding);
// PositionEmbedding: learned positions added to hidden states (GPT-2's wpe).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/position_ids.hpp"

#include <algorithm>    // std::copy_n
#include <array>        // std::array
#include <cstdint>      // std::int64_t
#include <span>         // std::span
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

namespace detail {
// What Embedding's two versions share (the host's below, the device's in
// nn/cuda/embedding.cuh): the weight, its init rule, the accessors,
// parameters(), the checks and the out-of-range message.
template <class T>
class embedding_base {
 public:
  embedding_base(std::int64_t num_embeddings, std::int64_t embedding_dim) : num_(num_embeddings), dim_(embedding_dim) {
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

 protected:
  // forward's check of the ids; the output's shape.
  template <class Ids>
  Shape check_input(const Ids& ids) const {
    require<shape_error>(!ids.empty() && ids.rank() < Shape::max_rank, "Embedding(", num_, ", ", dim_,
                         "): needs ids of rank below ", Shape::max_rank, ", got shape ", ids.shape(),
                         ids.empty() ? " (an empty tensor)" : "");
    weight.require_bound("Embedding");
    return output_shape(ids.shape());
  }
  // backward's check of dy against the ids cached by forward.
  template <class Ids, class Y>
  void check_grad(const Ids& ids, const Y& dy) const {
    require_activations(!ids.empty(), "Embedding(", num_, ", ", dim_, ")");
    weight.require_bound("Embedding", true);
    const Shape expected = output_shape(ids.shape());
    require<shape_error>(dy.shape() == expected, "Embedding(", num_, ", ", dim_,
                         "): backward needs the gradient of the last forward's output (shape ", expected,
                         "), got shape ", dy.shape());
  }
  // The error for id `id` at flat position i of ids of shape `s`.
  shape_error out_of_range(const Shape& s, std::int64_t i, std::int64_t id) const {
    return shape_error(cat("Embedding(", num_, ", ", dim_, "): id ", id, " at position ", position(s, i),
                           " of the input ", s, " is out of range for a table of ", num_, " rows"));
  }

  std::int64_t num_, dim_;

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
};
}  // namespace detail

// weight [num_embeddings, embedding_dim], initialised N(0, 1) as torch's. Ids of
// any shape S give rows of shape S + [embedding_dim]; ids carry no gradient, so
// backward returns an empty id tensor. Space is where ids, rows and the weight
// live: the device's layer (cuda_space) is in nn/cuda/embedding.cuh.
template <class T, class Space = host_space>
class Embedding : public detail::embedding_base<T> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::Embedding: the host layer; for cuda_space include shardlib/nn/cuda/embedding.cuh");
  using base = detail::embedding_base<T>;
  using base::num_, base::dim_;

 public:
  using input = Tensor<std::int64_t>;
  using output = Tensor<T>;
  using base::weight;

  using base::base;  // Embedding(num_embeddings, embedding_dim)

  template <class Ctx>
  output forward(Ctx& ctx, const input& ids) {
    output y(this->check_input(ids));
    for (std::int64_t i = 0; i < ids.numel(); ++i) {
      const std::int64_t id = ids[i];
      if (id < 0 || id >= num_) throw this->out_of_range(ids.shape(), i, id);
      std::copy_n(weight.value + id * dim_, dim_, y.data() + i * dim_);
    }
    ids_ = grad_enabled(ctx) ? ids : input{};
    return y;
  }

  // Rows used several times accumulate every use's gradient.
  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(ids_, dy);
    for (std::int64_t i = 0; weight.requires_grad && i < ids_.numel(); ++i) {  // frozen: no gradient
      T* g = weight.grad + ids_[i] * dim_;
      const T* d = dy.data() + i * dim_;
      for (std::int64_t j = 0; j < dim_; ++j) g[j] += d[j];
    }
    ids_ = {};
    return {};
  }

 private:
  input ids_;  // cached for backward
};

namespace detail {
// What PositionEmbedding's two versions share (the host's below, the device's
// in nn/cuda/embedding.cuh): the weight, its init rule, the offset, the checks
// and what the last forward saw, for its backward (no tensor is kept).
template <class T>
class position_embedding_base {
 public:
  position_embedding_base(std::int64_t max_positions, std::int64_t embedding_dim)
      : max_(max_positions), dim_(embedding_dim) {
    require<shape_error>(max_ > 0 && dim_ > 0, "PositionEmbedding: max_positions and embedding_dim must be positive, got ",
                         max_, " and ", dim_);
    weight.shape = Shape{max_, dim_};
    weight.init = init_rule::normal_with(0, 1);
  }

  Param<T> weight;

  std::int64_t max_positions() const { return max_; }
  std::int64_t embedding_dim() const { return dim_; }
  std::int64_t offset() const { return offset_; }
  // The position of the next forward's first token (checked against max_positions there).
  void set_offset(std::int64_t offset) {
    require<shape_error>(offset >= 0, "PositionEmbedding(", max_, ", ", dim_, "): offset must not be negative, got ",
                         offset);
    offset_ = offset;
  }

  template <class V>
  void parameters(V&& v) {
    v("weight", weight);
  }

 protected:
  // forward's check of x [..., seq, D] and of the context's position ids (empty, or
  // [batch, seq] for x [batch, seq, D]); records what backward needs and returns seq.
  std::int64_t check_input(const Shape& x, const Tensor<std::int64_t>& ids, bool grad) {
    require<shape_error>(x.rank() >= 2 && x[x.rank() - 1] == dim_, "PositionEmbedding(", max_, ", ", dim_,
                         "): input must be [..., sequence, ", dim_, "], got shape ", x);
    const std::int64_t seq = x[x.rank() - 2];
    require<shape_error>(seq > 0, "PositionEmbedding(", max_, ", ", dim_, "): the input ", x, " has no positions");
    if (ids.empty()) {
      require<shape_error>(offset_ + seq <= max_, "PositionEmbedding(", max_, ", ", dim_, "): positions ", offset_,
                           "..", offset_ + seq - 1, " (offset ", offset_, ", sequence ", seq,
                           ") exceed the table's max_positions ", max_);
    } else {
      require<shape_error>(x.rank() == 3, "PositionEmbedding(", max_, ", ", dim_,
                           "): with position_ids the input must be [batch, sequence, ", dim_, "], got shape ", x);
      check_position_ids(ids, x[0], seq, max_, cat("PositionEmbedding(", max_, ", ", dim_, ")"));
    }
    weight.require_bound("PositionEmbedding");
    shape_ = x;
    used_offset_ = offset_;
    pending_ = grad;
    return seq;
  }
  // backward's check of dy against the last forward's output.
  void check_grad(const Shape& dy) const {
    require_activations(pending_, "PositionEmbedding(", max_, ", ", dim_, ")");
    require<shape_error>(dy == shape_, "PositionEmbedding(", max_, ", ", dim_,
                         "): backward needs the gradient of the last forward's output (shape ", shape_,
                         "), got shape ", dy);
    weight.require_bound("PositionEmbedding", true);
  }

  std::int64_t max_, dim_;
  std::int64_t offset_ = 0;
  // What the last forward saw, for its backward.
  Shape shape_{};
  std::int64_t used_offset_ = 0;
  bool pending_ = false;
};
}  // namespace detail

// GPT-2's learned positions, h = wte(ids) + wpe(positions), as a layer on the
// hidden states: x [..., seq, D] -> x + weight[offset + s] at sequence position s,
// with weight [max_positions, D] initialised N(0, 1) as torch.nn.Embedding's.
// The offset (0 by default) is where the sequence starts: decoding with a KV
// cache sets it to the number of cached tokens. The context's position ids,
// when set, give each token its row instead (x [batch, seq, D]: x[n, s] +
// weight[ids[n, s]]; a left-padded batch). Backward adds dy, summed over the
// leading dimensions, into the rows the last forward used, and passes dy on.
// The device's layer (cuda_space) is in nn/cuda/embedding.cuh.
template <class T, class Space = host_space>
class PositionEmbedding : public detail::position_embedding_base<T> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::PositionEmbedding: the host layer; for cuda_space include shardlib/nn/cuda/embedding.cuh");
  using base = detail::position_embedding_base<T>;
  using base::dim_, base::offset_, base::shape_, base::used_offset_, base::pending_;

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;
  using base::weight;

  using base::base;  // PositionEmbedding(max_positions, embedding_dim)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const std::int64_t seq = this->check_input(x.shape(), ctx.position_ids(), grad_enabled(ctx));
    used_ids_ = pending_ ? ctx.position_ids() : Tensor<std::int64_t>{};  // shared with the context, not copied
    const std::int64_t rows = x.numel() / (seq * dim_), block = seq * dim_;
    const T* w = weight.value + offset_ * dim_;
    output y(x.shape());
    if (const auto& ids = ctx.position_ids(); !ids.empty()) {  // token i (of rows * seq) at its own position
      for (std::int64_t i = 0; i < rows * seq; ++i)
        for (std::int64_t d = 0; d < dim_; ++d) y[i * dim_ + d] = x[i * dim_ + d] + weight.value[ids[i] * dim_ + d];
      return y;
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x.data() + r * block;
      T* yr = y.data() + r * block;
      for (std::int64_t i = 0; i < block; ++i) yr[i] = xr[i] + w[i];
    }
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(dy.shape());
    const std::int64_t block = shape_[shape_.rank() - 2] * dim_, rows = dy.numel() / block;
    if (!used_ids_.empty()) {
      for (std::int64_t i = 0; weight.requires_grad && i < used_ids_.numel(); ++i)
        for (std::int64_t d = 0; d < dim_; ++d) weight.grad[used_ids_[i] * dim_ + d] += dy[i * dim_ + d];
      used_ids_ = {};
      pending_ = false;
      return dy;
    }
    for (std::int64_t r = 0; weight.requires_grad && r < rows; ++r) {  // frozen: no gradient (grad may be null)
      const T* d = dy.data() + r * block;
      T* g = weight.grad + used_offset_ * dim_;
      for (std::int64_t i = 0; i < block; ++i) g[i] += d[i];
    }
    pending_ = false;
    return dy;
  }

 private:
  Tensor<std::int64_t> used_ids_;  // the last forward's position ids, empty for offset + s
};

}  // namespace shardlib::nn
