// shardlib/nn/saved_input.hpp — saved_input: what a product's forward keeps of its
// input x for backward.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/shape.hpp"
#include "shardlib/nn/grad_mode.hpp"

#include <cstdint>  // std::int64_t

namespace shardlib::nn {

// y = x W^T needs x for dW only: dx = dy W reads the weight. So a layer whose weight
// is frozen (requires_grad = false) keeps x's shape and not its values, as PyTorch's
// autograd saves a product's input only when the other operand requires a gradient.
template <class X>
class saved_input {
 public:
  // Forward: nothing when no backward follows (nn::grad_enabled), else x's shape, and
  // its values when `values` (the weight is trained).
  template <class Ctx>
  void save(const Ctx& ctx, const X& x, bool values) {
    if (!grad_enabled(ctx)) return clear();
    shape_ = x.shape();
    kept_ = true;
    with_values_ = values;
    x_ = values ? x : X{};
  }
  void clear() { *this = {}; }

  // Backward's check: forward kept x, with its values where `values` are needed now (a
  // weight unfrozen between forward and backward has nothing to make dW from).
  template <class... Layer>
  void require(bool values, const Layer&... layer) const {
    require_activations(kept_, layer...);
    shardlib::require<shape_error>(with_values_ || !values, layer..., ": its weight was frozen at forward, which ",
                                   "kept no input for a weight gradient; set requires_grad before the forward");
  }

  const Shape& shape() const { return shape_; }
  std::int64_t numel() const { return shape_.numel(); }
  // The values (saved with values = true), else empty.
  const X& values() const { return x_; }

 private:
  X x_{};
  Shape shape_{};
  bool kept_ = false, with_values_ = false;
};

}  // namespace shardlib::nn
