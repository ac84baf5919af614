// shardlib/ops/cuda/position_embedding.cuh — learned positions on the device
// (nn::PositionEmbedding): a block of table rows added to every leading index of
// the hidden states, and its gradient summed back over them, in nn's order; or,
// with position ids, each token's own row (its gradient is the Embedding's).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/ops/cuda/launch.cuh"  // map_elements, for_each_index

#include <cuda_runtime.h>

#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

namespace detail {
template <class T>
struct add_positions_of {
  const T* w;
  std::int64_t block;
  __device__ T operator()(std::int64_t i, T x) const { return T(float(x) + float(w[i % block])); }
};
template <class T>
struct add_position_rows_of {
  const T* w;
  const std::int64_t* ids;
  std::int64_t dim;
  __device__ T operator()(std::int64_t i, T x) const { return T(float(x) + float(w[ids[i / dim] * dim + i % dim])); }
};
// Column i of the block: the rows of dy in order, added to the gradient in float.
template <class T>
struct position_grad_at {
  const T* dy;
  T* g;
  std::int64_t rows, block;
  __device__ void operator()(std::int64_t i) const {
    float acc = float(g[i]);
    for (std::int64_t r = 0; r < rows; ++r) acc += float(dy[r * block + i]);
    g[i] = T(acc);
  }
};
}  // namespace detail

// y[r, i] = x[r, i] + w[i] for rows r of `block` elements (x, y: rows * block;
// w: block, the table's rows at the forward's positions). y may be x.
template <class T>
void add_positions(const T* x, const T* w, T* y, std::int64_t rows, std::int64_t block, cudaStream_t stream) {
  map_elements(rows * block, detail::add_positions_of<T>{w, block}, stream, "add_positions", y, x);
}

// y[i, d] = x[i, d] + w[ids[i], d] for tokens i < tokens of dim elements (ids
// on the device, checked against the table by the caller). y may be x.
template <class T>
void add_position_rows(const T* x, const T* w, const std::int64_t* ids, T* y, std::int64_t tokens, std::int64_t dim,
                       cudaStream_t stream) {
  map_elements(tokens * dim, detail::add_position_rows_of<T>{w, ids, dim}, stream, "add_position_rows", y, x);
}

// g[i] += sum over rows r of dy[r, i], adding the rows in order (with float T
// bit for bit nn::PositionEmbedding's sum; 16-bit T rounds once).
template <class T>
void add_positions_backward(const T* dy, T* g, std::int64_t rows, std::int64_t block, cudaStream_t stream) {
  for_each_index(block, detail::position_grad_at<T>{dy, g, rows, block}, stream, "add_positions_backward");
}

}  // namespace shardlib::ops::cuda
