// shardlib/ops/cuda/rotary.cuh — rotary position embeddings (RoPE) on the device:
// nn::rotary_table's rotation (Hugging Face's rotate_half layout) applied to a
// strided view of heads, forward or inverse (backward), in place or out of place.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"              // require, shape_error
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/caching_allocator.hpp"  // device_buffer
#include "shardlib/cuda/copy.hpp"               // copy_async
#include "shardlib/nn/rotary.hpp"               // rotary_options, rotary_table
#include "shardlib/nn/sdpa.hpp"                 // head_view
#include "shardlib/ops/cuda/launch.cuh"         // for_each_index

#include <cuda_runtime.h>

#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

// The cosines and sines of positions [0, positions) in device memory, float,
// [positions, head_dim / 2] each: nn::rotary_table<float>'s values (angles in
// double, rounded once), uploaded once and indexed by position afterwards, so a
// KV cache's offset needs no new table.
class rotary_device_table {
 public:
  rotary_device_table(const nn::rotary_options& o, std::int64_t positions, cudaStream_t stream)
      : rotary_device_table(nn::rotary_table<float>(o, 0, positions), stream) {}
  rotary_device_table(const nn::rotary_table<float>& host, cudaStream_t stream)
      : head_dim_(host.head_dim()),
        positions_(host.positions()),
        cos_(host.cosines().size(), category::activations, stream),
        sin_(host.sines().size(), category::activations, stream) {
    shardlib::cuda::copy_async(cos_.span(), host.cosines(), stream);
    shardlib::cuda::copy_async(sin_.span(), host.sines(), stream);
  }

  std::int64_t head_dim() const { return head_dim_; }
  std::int64_t positions() const { return positions_; }
  const float* cos() const { return cos_.data(); }
  const float* sin() const { return sin_.data(); }

 private:
  std::int64_t head_dim_, positions_;
  shardlib::cuda::device_buffer<float> cos_, sin_;
};

namespace detail {
// One pair (i, i + dim/2) of one head row per index, in float:
//   y_i = x_i cos - x_{i+half} sin,  y_{i+half} = x_{i+half} cos + x_i sin,
// with sin negated for the inverse rotation. Each pair is read before it is
// written by the same thread, so x and y may be the same view.
template <class T>
struct rotary_at {
  const T* x;
  T* y;
  std::int64_t heads, seq, half;
  std::int64_t x_batch, x_head, x_row, y_batch, y_head, y_row;  // strides
  const float *cos, *sin;
  std::int64_t offset;
  float sign;
  __device__ void operator()(std::int64_t idx) const {
    const std::int64_t i = idx % half, row = idx / half;  // row = (n H + h) L + l
    const std::int64_t l = row % seq, nh = row / seq, h = nh % heads, n = nh / heads;
    const T* a = x + n * x_batch + h * x_head + l * x_row;
    T* b = y + n * y_batch + h * y_head + l * y_row;
    const std::int64_t t = (offset + l) * half + i;
    const float c = cos[t], s = sign * sin[t];
    const float a0 = float(a[i]), a1 = float(a[i + half]);
    b[i] = T(a0 * c - a1 * s);
    b[i + half] = T(a1 * c + a0 * s);
  }
};
}  // namespace detail

// y = the rotation of x by the angles of positions offset .. offset + x.seq - 1
// (inverse = true: by their negatives, the backward of the rotation, since
// dL/dx = R^T dL/dy = R^-1 dL/dy). cos and sin are device arrays [positions,
// x.dim / 2] (rotary_device_table's; positions >= offset + x.seq, which this
// function cannot check: the overload below does). y has x's shape and may be
// x itself (in place); other overlaps are not allowed. Strides are in elements,
// as head_view's: [B, L, H*D] projections and [B, H, L, D] tensors alike.
template <class T>
void apply_rotary(const nn::head_view<T>& x, const nn::head_view<T>& y, const float* cos, const float* sin,
                  std::int64_t offset, bool inverse, cudaStream_t stream) {
  require<shape_error>(x.dim > 0 && x.dim % 2 == 0, "ops::cuda::apply_rotary: head_dim must be even and positive, got ",
                       x.dim);
  require<shape_error>(y.shape() == x.shape(), "ops::cuda::apply_rotary: the output must be shaped as the input, ",
                       x.shape(), ", got ", y.shape());
  require<shape_error>(offset >= 0, "ops::cuda::apply_rotary: offset must not be negative, got ", offset);
  const std::int64_t half = x.dim / 2;
  const detail::rotary_at<T> f{x.data,         y.data,        x.heads,      x.seq,        half,
                               x.batch_stride, x.head_stride, x.row_stride, y.batch_stride, y.head_stride,
                               y.row_stride,   cos,           sin,          offset,       inverse ? -1.0f : 1.0f};
  for_each_index(x.batch * x.heads * x.seq * half, f, stream, "apply_rotary");
}

// In place.
template <class T>
void apply_rotary(const nn::head_view<T>& x, const float* cos, const float* sin, std::int64_t offset, bool inverse,
                  cudaStream_t stream) {
  apply_rotary(x, x, cos, sin, offset, inverse, stream);
}

// With a table, whose head_dim and positions are checked.
template <class T>
void apply_rotary(const nn::head_view<T>& x, const nn::head_view<T>& y, const rotary_device_table& table,
                  std::int64_t offset, bool inverse, cudaStream_t stream) {
  require<shape_error>(x.dim == table.head_dim() && offset >= 0 && offset + x.seq <= table.positions(),
                       "ops::cuda::apply_rotary: a table of ", table.positions(), " positions of head_dim ",
                       table.head_dim(), " cannot rotate heads of shape ", x.shape(), " at positions ", offset, "..",
                       offset + x.seq - 1);
  apply_rotary(x, y, table.cos(), table.sin(), offset, inverse, stream);
}

}  // namespace shardlib::ops::cuda
