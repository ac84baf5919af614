// shardlib/ops/cuda/rotary.cuh — rotary position embeddings (RoPE) on the device:
// nn::rotary_table's rotation (Hugging Face's rotate_half layout) applied to a
// strided view of heads, forward or inverse (backward), in place or out of place;
// the per-pair arithmetic is ops/cuda/rotary.hpp's.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"              // require, shape_error
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/caching_allocator.hpp"  // device_buffer
#include "shardlib/cuda/copy.hpp"               // copy_async
#include "shardlib/nn/rotary.hpp"               // rotary_options, rotary_table
#include "shardlib/nn/sdpa.hpp"                 // head_view
#include "shardlib/ops/cuda/launch.cuh"         // for_each_index
#include "shardlib/ops/cuda/rotary.hpp"         // rotary_pair, rotary_pairs

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
  for_each_index(rotary_pairs(x), rotary_pair<T>(x, y, cos, sin, offset, inverse), stream, "apply_rotary");
}

// In place.
template <class T>
void apply_rotary(const nn::head_view<T>& x, const float* cos, const float* sin, std::int64_t offset, bool inverse,
                  cudaStream_t stream) {
  apply_rotary(x, x, cos, sin, offset, inverse, stream);
}

// The same with token (n, l) at table row positions[n * x.seq + l] (device
// memory, [x.batch, x.seq]; the caller checks them against the table).
template <class T>
void apply_rotary_at(const nn::head_view<T>& x, const nn::head_view<T>& y, const rotary_device_table& table,
                     const std::int64_t* positions, bool inverse, cudaStream_t stream) {
  require<shape_error>(x.dim == table.head_dim() && y.shape() == x.shape(), "ops::cuda::apply_rotary_at: a table of ",
                       "head_dim ", table.head_dim(), " cannot rotate heads of shape ", x.shape(), " into ", y.shape());
  for_each_index(rotary_pairs(x), rotary_pair<T>(x, y, table.cos(), table.sin(), 0, inverse, positions), stream,
                 "apply_rotary_at");
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
