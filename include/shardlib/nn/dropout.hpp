// shardlib/nn/dropout.hpp — Dropout (torch.nn.Dropout) with counter-based, reproducible masks.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"

#include <cstdint>      // std::int64_t, std::uint64_t
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

// Keeps element i iff stream.uniform_float(i) >= p, compared in float so that a
// CUDA kernel on the same stream draws the same mask. SHARDLIB_HD for those kernels.
SHARDLIB_HD constexpr bool dropout_keep(const counter_rng& stream, std::uint64_t i, float p) {
  return stream.uniform_float(i) >= p;
}

namespace detail {
// Dropout's mask for tensors in Space: apply(x, stream, p) is x with element i
// kept (dropout_keep(stream, i, p)) and scaled by 1 / (1 - p), or zeroed. The
// host's here, the device's in nn/cuda/dropout.cuh.
template <class Space>
struct dropout_mask;

template <>
struct dropout_mask<host_space> {
  // The mask is recomputed from the stream rather than stored: 16 bytes per
  // layer instead of one per element.
  template <class T>
  static Tensor<T> apply(const Tensor<T>& x, const counter_rng& rng, double p) {
    const T scale = p < 1 ? T(1 / (1 - p)) : T(0);
    const float threshold = float(p);
    Tensor<T> y(x.shape());
    // Local copies and raw pointers: through members and Tensor::operator[] the
    // compiler reloads the stream per element (167 ms vs 37 ms per reference step).
    const counter_rng stream = rng;
    const T* xp = x.data();
    T* yp = y.data();
    const std::int64_t n = x.numel();
    for (std::int64_t i = 0; i < n; ++i) yp[i] = dropout_keep(stream, std::uint64_t(i), threshold) ? xp[i] * scale : T(0);
    return y;
  }
};

// Dropout in Space (the host's below, the device's in nn/cuda/dropout.cuh), all
// but the mask, which is dropout_mask<Space>'s: p and its check, parameters(),
// forward and backward, and the state a forward leaves for its backward.
template <class T, class Space>
class dropout_base {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;

  explicit dropout_base(double p = 0.5) : p_(p) {
    require(p >= 0 && p <= 1, "Dropout: probability must be in [0, 1], got ", p);
  }

  double p() const { return p_; }

  template <class V>
  void parameters(V&&) {}

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    shape_ = x.shape();
    pending_ = grad_enabled(ctx);  // the stream is all backward needs: no mask is kept
    masked_ = ctx.training() && p_ > 0;
    if (!masked_) return x;
    stream_ = ctx.random_stream();
    return dropout_mask<Space>::apply(x, stream_, p_);
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    require_activations(pending_, "Dropout(", p_, ")");
    require<shape_error>(dy.shape() == shape_, "Dropout(", p_,
                         "): backward needs the gradient of the last forward's output (shape ", shape_, "), got shape ",
                         dy.shape());
    pending_ = false;
    return masked_ ? dropout_mask<Space>::apply(dy, stream_, p_) : dy;
  }

 private:
  double p_;
  bool pending_ = false;  // a forward awaits its backward
  bool masked_ = false;   // that forward applied a mask (training and p > 0)
  Shape shape_{};
  counter_rng stream_{0, 0};  // this forward's stream, kept for backward
};
}  // namespace detail

// In training, each element is kept with probability 1 - p and scaled by
// 1 / (1 - p) (inverted dropout, so evaluation is the identity), the mask drawn
// from ctx.random_stream(): reproducible per (seed, rank, step), different per
// layer. The identity when not training or p == 0; all zeros when p == 1.
template <class T, class Space = host_space>
class Dropout : public detail::dropout_base<T, Space> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::Dropout: the host layer; for cuda_space include shardlib/nn/cuda/dropout.cuh");

 public:
  using detail::dropout_base<T, Space>::dropout_base;
};

}  // namespace shardlib::nn
