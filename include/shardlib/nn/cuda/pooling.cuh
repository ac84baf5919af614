// shardlib/nn/cuda/pooling.cuh — MeanPool on the device: nn::MeanPool<T, cuda_space>.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"       // current_stream
#include "shardlib/cuda/memory_space.hpp"  // cuda_space
#include "shardlib/cuda/copy.hpp"  // to_device
#include "shardlib/nn/cuda/device.cuh"     // device helpers
#include "shardlib/nn/pooling.hpp"         // the host layer and its shape helpers
#include "shardlib/ops/cuda/launch.cuh"    // for_each_index

#include <cstdint>  // std::int64_t

namespace shardlib::nn {

namespace detail {
// The input as [outer, len, inner]; weights [N, len] in float (null: 1 / len
// everywhere), sample b = o when batch-first (dim 1) and i / e when sequence-first.
struct mean_pool_geometry {
  std::int64_t len, inner, e;
  int dim;
  const float* weights;
  __device__ float weight(std::int64_t o, std::int64_t l, std::int64_t i) const {
    if (!weights) return 1.0f / float(len);
    const std::int64_t b = dim == 1 ? o : i / e;
    return weights[b * len + l];
  }
};

// y[o, i] = sum over l of weight * x[o, l, i], in float and in the host's order of l.
template <class T>
struct mean_pool_at {
  mean_pool_geometry g;
  const T* x;
  T* y;
  __device__ void operator()(std::int64_t j) const {
    const std::int64_t o = j / g.inner, i = j % g.inner;
    float s = 0;
    for (std::int64_t l = 0; l < g.len; ++l) s += g.weight(o, l, i) * float(x[(o * g.len + l) * g.inner + i]);
    y[j] = T(s);
  }
};
template <class T>
struct mean_pool_backward_at {
  mean_pool_geometry g;
  const T* dy;
  T* dx;
  __device__ void operator()(std::int64_t j) const {
    const std::int64_t i = j % g.inner, l = j / g.inner % g.len, o = j / g.inner / g.len;
    dx[j] = T(g.weight(o, l, i) * float(dy[o * g.inner + i]));
  }
};
}  // namespace detail

// The host layer's rule and checks (detail::mean_pool_base in nn/pooling.hpp);
// the padding weights are made on the host from the context's mask, in float,
// and copied over.
template <class T>
class MeanPool<T, cuda_space> : public detail::mean_pool_base {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  using mean_pool_base::mean_pool_base;  // MeanPool(dim)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    begin_forward(x.shape());
    const Tensor<float> w = detail::pool_padding_weights<float>(shape_, dim_, ctx.key_padding_mask());
    weights_ = w.empty() ? Tensor<float, cuda_space>{} : cuda::to_device(w);
    output y(pooled_shape());
    ops::cuda::for_each_index(y.numel(), detail::mean_pool_at<T>{geometry(), x.data(), y.data()},
                              cuda::current_stream(), "MeanPool forward");
    if (!grad_enabled(ctx)) {  // nothing kept for a backward, as the host layer
      shape_ = {};
      weights_ = {};
    }
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    check_grad(dy.shape());
    input dx(shape_);
    ops::cuda::for_each_index(dx.numel(), detail::mean_pool_backward_at<T>{geometry(), dy.data(), dx.data()},
                              cuda::current_stream(), "MeanPool backward");
    shape_ = {};
    weights_ = {};
    return dx;
  }

 private:
  detail::mean_pool_geometry geometry() const {
    return {shape_[dim_], inner_size(), shape_.rank() == 3 ? shape_[2] : 1, dim_,
            weights_.empty() ? nullptr : weights_.data()};
  }

  Tensor<float, cuda_space> weights_;  // padding weights [N, L], cached for backward
};

}  // namespace shardlib::nn
