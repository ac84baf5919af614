// shardlib/nn/cuda/dropout.cuh — Dropout on the device: nn::Dropout<T, cuda_space>,
// drawing the host layer's mask bit for bit (ops::cuda::dropout).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/dropout.hpp"            // the host layer
#include "shardlib/ops/cuda/elementwise.cuh"  // dropout

namespace shardlib::nn {

template <class T>
class Dropout<T, cuda_space> {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;

  explicit Dropout(double p = 0.5) : p_(p) {
    require(p >= 0 && p <= 1, "Dropout: probability must be in [0, 1], got ", p);
  }

  double p() const { return p_; }

  template <class V>
  void parameters(V&&) {}

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    shape_ = x.shape();
    pending_ = true;
    masked_ = ctx.training() && p_ > 0;
    if (!masked_) return x;
    stream_ = ctx.random_stream();
    return apply(x);
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    require<shape_error>(pending_ && dy.shape() == shape_, "Dropout(", p_,
                         "): backward needs the gradient of the last forward's output (shape ", shape_, "), got shape ",
                         dy.shape());
    pending_ = false;
    return masked_ ? apply(dy) : dy;
  }

 private:
  // Element i draws at index i, as the host layer: backward regenerates the mask.
  output apply(const input& x) const {
    output y(x.shape());
    ops::cuda::dropout<T>(x.span(), y.span(), stream_, 0, p_, cuda::current_stream());
    return y;
  }

  double p_;
  bool pending_ = false;  // a forward awaits its backward
  bool masked_ = false;   // that forward applied a mask (training and p > 0)
  Shape shape_{};
  counter_rng stream_{0, 0};  // this forward's stream, kept for backward
};

}  // namespace shardlib::nn
