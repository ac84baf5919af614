// shardlib/nn/linear.hpp — Linear: y = x W^T + b over the last dimension (torch.nn.Linear).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/lora_adapter.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/saved_input.hpp"
#include "shardlib/ops/gemm.hpp"

#include <algorithm>    // std::copy_n
#include <cstdint>      // std::int64_t
#include <optional>     // std::optional
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

namespace detail {
// g[c] += sum over r of d[r, c] for a [rows, cols] row-major d, adding the rows in
// order; plain pointers, so the inner loop vectorises across c.
template <class T>
void add_column_sums(const T* d, std::int64_t rows, std::int64_t cols, T* g) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* dr = d + r * cols;
    for (std::int64_t c = 0; c < cols; ++c) g[c] += dr[c];
  }
}

// What Linear's two versions share (the host's below, the device's in
// nn/cuda/linear.cuh): the parameters, their shapes and init rules, the
// accessors, parameters(), the LoRA adapter and the shape checks with their messages.
template <class T, class Space>
class linear_base {
 public:
  linear_base(std::int64_t in_features, std::int64_t out_features, bool bias = true)
      : in_(in_features), out_(out_features), has_bias_(bias) {
    weight.shape = Shape{out_features, in_features};
    weight.init = init_rule::linear_default(in_features);
    if (bias) {
      this->bias.shape = Shape{out_features};
      this->bias.init = init_rule::linear_default(in_features);
    }
  }

  Param<T> weight, bias;

  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }

  // LoRA (PEFT's lora.Linear): from now on the output is x W^T + b + s (x A^T) B^T,
  // the adapter's lora_A and lora_B trained, weight and bias frozen (PEFT freezes
  // them; set requires_grad back to train them too). The parameters take PEFT's
  // names: base_layer.weight, base_layer.bias, lora_A.weight, lora_B.weight. Call it
  // before the model is wrapped (fully_shard, nn::Replicated), which lists the
  // parameters; nn::add_lora (nn/lora.hpp) adds adapters across a model by name.
  void add_lora(const lora_options& o = {}) {
    require(!lora_, "Linear(", in_, " -> ", out_, "): add_lora on a layer that has a LoRA adapter already");
    lora_.emplace(in_, out_, o);
    weight.requires_grad = bias.requires_grad = false;
  }
  // The adapter (lora_A, lora_B, options, scaling), or nullptr.
  detail::lora_adapter<T, Space>* lora() { return lora_ ? &*lora_ : nullptr; }
  const detail::lora_adapter<T, Space>* lora() const { return lora_ ? &*lora_ : nullptr; }
  // weight += s B A and B = 0: the fine-tune folded into the weight (a base checkpoint
  // saved now holds it), the output as before up to the weight's rounding. On bound
  // values: an nn::Replicated owner's, or inside a sharded model's summon_full_params
  // with writeback (refused for 16-bit layers), between steps. The optimizer's state for
  // A and B stays.
  void merge_lora() {
    require(lora_.has_value(), "Linear(", in_, " -> ", out_, "): merge_lora on a layer without a LoRA adapter");
    lora_->merge(weight);
  }

  template <class V>
  void parameters(V&& v) {
    const bool a = lora_.has_value();
    v(a ? "base_layer.weight" : "weight", weight);
    if (has_bias_) v(a ? "base_layer.bias" : "bias", bias);
    if (a) lora_->parameters(v);
  }

 protected:
  // forward's check of x; the output's shape: x's with the last dimension out.
  void check_input(const Shape& x) const {
    require<shape_error>(x.rank() >= 1 && x[x.rank() - 1] == in_, "Linear(", in_, " -> ", out_,
                         "): input's last dimension must be ", in_, ", got shape ", x);
    check_bound(false);
  }
  void check_bound(bool with_grad) const {
    weight.require_bound("Linear", with_grad);
    if (has_bias_) bias.require_bound("Linear", with_grad);
  }
  Shape output_shape(const Shape& x) const {
    Shape ys = x;
    ys[ys.rank() - 1] = out_;
    return ys;
  }
  // backward's check of dy against the input forward saved.
  template <class X, class Y>
  void check_grad(const saved_input<X>& x, const Y& dy) const {
    x.require(weight.requires_grad, "Linear(", in_, " -> ", out_, ")");
    require<shape_error>(dy.numel() == x.numel() / in_ * out_, "Linear(", in_, " -> ", out_,
                         "): backward needs the gradient of the last forward's output, got shape ", dy.shape());
    check_bound(true);
  }

  std::int64_t in_, out_;
  bool has_bias_;
  std::optional<detail::lora_adapter<T, Space>> lora_;
};
}  // namespace detail

// weight [out, in], bias [out] (PyTorch's layout and names); x [..., in] -> y [..., out];
// with add_lora, plus its adapter's update (linear_base above).
// Space is where the tensors and parameters live: this is the host's layer, the
// device's (cuda_space) is in nn/cuda/linear.cuh, with the same parameters.
template <class T, class Space = host_space>
class Linear : public detail::linear_base<T, Space> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::Linear: the host layer; for cuda_space include shardlib/nn/cuda/linear.cuh");
  using base = detail::linear_base<T, Space>;
  using base::in_, base::out_, base::has_bias_, base::lora_;

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;
  using base::weight, base::bias;

  using base::base;  // Linear(in_features, out_features, bias = true)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    this->check_input(x.shape());
    x_.save(ctx, x, weight.requires_grad);
    const std::int64_t rows = x.numel() / in_;
    output y(this->output_shape(x.shape()));
    if (has_bias_)  // y starts as the bias, which the product adds to (beta 1)
      for (std::int64_t r = 0; r < rows; ++r) std::copy_n(bias.value, out_, y.data() + r * out_);
    ops::gemm(ops::trans::no, ops::trans::yes, rows, out_, in_, T(1), x.data(), in_, weight.value, in_,
              T(has_bias_ ? 1 : 0), y.data(), out_);
    if (lora_) lora_->forward(ctx, x, y);
    return y;
  }

  // A frozen weight or bias (requires_grad = false) gets no gradient: its product or
  // column sums are skipped, and its gradient buffer is left as it was.
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    this->check_grad(x_, dy);
    const std::int64_t rows = x_.numel() / in_;
    if (weight.requires_grad)
      ops::gemm(ops::trans::yes, ops::trans::no, out_, in_, rows, T(1), dy.data(), out_, x_.values().data(), in_,
                T(1), weight.grad, in_);  // dW += dy^T x
    if (has_bias_ && bias.requires_grad) detail::add_column_sums(dy.data(), rows, out_, bias.grad);
    input dx(x_.shape());
    ops::gemm(ops::trans::no, ops::trans::no, rows, in_, out_, T(1), dy.data(), out_, weight.value, in_, T(0),
              dx.data(), in_);  // dx = dy W
    if (lora_) lora_->backward(ctx, dy, dx);
    x_.clear();
    return dx;
  }

 private:
  saved_input<input> x_;
};

namespace detail {
// A Linear and the activation after it (the encoder's linear1, GPT-2's c_fc), forward
// and backward: here one child after the other; on the device (nn/cuda/linear.cuh)
// one product whose epilogue applies the activation, where cuBLASLt has it.
template <class Space>
struct linear_activation {
  template <class Ctx, class L, class A, class X>
  static X forward(Ctx& ctx, L& linear, A& act, const X& x) {
    return ctx.forward(act, ctx.forward(linear, x));
  }
  template <class Ctx, class L, class A, class X>
  static X backward(Ctx& ctx, L& linear, A& act, const X& dy) {
    return ctx.backward(linear, ctx.backward(act, dy));
  }
};
}  // namespace detail

}  // namespace shardlib::nn
