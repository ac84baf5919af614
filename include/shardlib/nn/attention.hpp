// shardlib/nn/attention.hpp — MultiheadAttention: multi-head self-attention
// (torch.nn.MultiheadAttention with query = key = value = x).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/sdpa.hpp"  // sdpa_forward, sdpa_backward, head_view
#include "shardlib/ops/gemm.hpp"

#include <algorithm>    // std::copy_n
#include <cstdint>      // std::int64_t, std::uint8_t
#include <optional>     // std::optional
#include <string>       // std::string
#include <type_traits>  // std::is_same_v

namespace shardlib::nn {

// torch.nn.MultiheadAttention's constructor arguments that self-attention uses.
struct attention_options {
  std::int64_t embed_dim = 0;
  std::int64_t num_heads = 1;
  double dropout = 0.0;      // on the attention weights, in training only
  bool bias = true;          // in_proj_bias and out_proj.bias
  bool batch_first = false;  // input [N, L, E] instead of [L, N, E]
};

namespace detail {
// What MultiheadAttention's two versions share (the host's below, the device's
// in nn/cuda/attention.cuh): the options and their checks, the parameters with
// their shapes and init rules, out_proj, children() and parameters(), the shape
// checks with their messages, the row layout, and the state a forward leaves for
// its backward apart from the tensors. Space is out_proj's.
template <class T, class Space>
class attention_base {
 public:
  using options = attention_options;

  explicit attention_base(const options& o)
      : out_proj(validated(o).embed_dim, o.embed_dim, o.bias), o_(o), head_dim_(o.embed_dim / o.num_heads) {
    in_proj_weight.shape = Shape{3 * o.embed_dim, o.embed_dim};
    in_proj_weight.init = init_rule::xavier_uniform(o.embed_dim, 3 * o.embed_dim);
    if (o.bias) {
      in_proj_bias.shape = Shape{3 * o.embed_dim};
      in_proj_bias.init = init_rule::constant_zero();
      out_proj.bias.init = init_rule::constant_zero();  // torch's _reset_parameters; out_proj.weight keeps Linear's
    }
  }

  Param<T> in_proj_weight, in_proj_bias;
  Linear<T, Space> out_proj;

  template <class V>
  void children(V&& v) {
    v("out_proj", out_proj);
  }
  template <class V>
  void parameters(V&& v) {
    v("in_proj_weight", in_proj_weight);
    if (o_.bias) v("in_proj_bias", in_proj_bias);
    visit_parameters("out_proj", out_proj, v);
  }

 protected:
  // forward's checks of x's shape and of the context's masks (before anything
  // changes: a bad one leaves the last forward's state for its backward); returns
  // the key padding mask and keeps the sequence length and batch size for backward.
  template <class Ctx>
  const Tensor<std::uint8_t>& begin_forward(Ctx& ctx, const Shape& x) {
    const std::int64_t E = o_.embed_dim;
    require<shape_error>(x.rank() == 3 && x[2] == E, name(), ": input must be ", o_.batch_first ? "[N, L, " : "[L, N, ",
                         E, "] (", o_.batch_first ? "batch" : "sequence", " first), got shape ", x);
    const std::int64_t L = x[o_.batch_first ? 1 : 0], N = x[o_.batch_first ? 0 : 1];
    const Tensor<std::uint8_t>& mask = ctx.key_padding_mask();
    require<shape_error>(mask.empty() || mask.shape() == Shape{N, L}, name(),
                         ": key_padding_mask must be [N, L] = ", Shape{N, L}, " (batch, keys), got ", mask.shape());
    const attn_mask& allowed = ctx.attention_mask();
    require<shape_error>(allowed.allowed.empty() || allowed.bias.empty(), name(),
                         ": the attention mask is either boolean or additive, not both");
    if (!allowed.empty()) mask_strides(allowed.shape(), Shape{N, o_.num_heads, L, L}, name());
    check_bound(false);
    seq_ = L;
    batch_ = N;
    return mask;
  }
  void check_bound(bool with_grad) const {
    in_proj_weight.require_bound(name(), with_grad);
    if (o_.bias) in_proj_bias.require_bound(name(), with_grad);
  }
  // backward's check of dy against the input x cached by forward.
  template <class X, class Y>
  void check_grad(const X& x, const Y& dy) const {
    require<shape_error>(!x.empty() && dy.shape() == x.shape(), name(),
                         ": backward needs the gradient of the last forward's output (shape ", x.shape(), "), got ",
                         dy.shape());
    check_bound(true);
  }

  // Checked before out_proj is built from it, so a bad size gets this message.
  static const options& validated(const options& o) {
    require<shape_error>(o.embed_dim > 0 && o.num_heads > 0 && o.embed_dim % o.num_heads == 0,
                         "MultiheadAttention: embed_dim (", o.embed_dim, ") must be a positive multiple of num_heads (",
                         o.num_heads, ")");
    require(o.dropout >= 0 && o.dropout <= 1, "MultiheadAttention: dropout must be in [0, 1], got ", o.dropout);
    return o;
  }
  std::string name() const { return cat("MultiheadAttention(embed_dim ", o_.embed_dim, ", num_heads ", o_.num_heads, ")"); }

  // Rows of x (and of qkv and the attention output) for batch element n start at
  // row0(n) and advance by `step` rows per position: N rows sequence first, 1 batch first.
  std::int64_t row0(std::int64_t n) const { return o_.batch_first ? n * seq_ : n; }
  std::int64_t step() const { return o_.batch_first ? 1 : batch_; }
  std::int64_t ld_qkv() const { return step() * 3 * o_.embed_dim; }
  std::int64_t ld_x() const { return step() * o_.embed_dim; }
  // Head h of q (which 0), k (1) or v (2) for batch element n: D columns at h D
  // of that third of its row of qkv.
  std::int64_t offset(std::int64_t n, std::int64_t h, int which) const {
    return row0(n) * 3 * o_.embed_dim + which * o_.embed_dim + h * head_dim_;
  }

  options o_;
  std::int64_t head_dim_;
  std::int64_t seq_ = 0, batch_ = 0;
  std::optional<counter_rng> drop_;  // the weights' dropout stream of the last forward, if it dropped
};
}  // namespace detail

// Parameters as torch names and packs them, so a state dict moves unchanged:
// in_proj_weight [3E, E] stacks W_q, W_k, W_v (in that order), in_proj_bias [3E]
// likewise, and out_proj is a child Linear(E, E). Head h uses the contiguous
// slice [h D, (h + 1) D) of each projection, D = E / num_heads. Between the
// projections the attention itself is sdpa_forward / sdpa_backward (nn/sdpa.hpp)
// on strided views of the projected rows: scores q.k / sqrt(D) (torch scales q
// before the product: equal up to rounding), dropout on the weights drawn in
// nn::attention_keep's groups of [N, H, L, L] from one ctx.random_stream() per forward.
//
// Key padding: ctx.key_padding_mask() ([N, L], nonzero = ignore that key) gives
// those keys zero weight, as torch's -inf before the softmax does. A query whose
// keys are all masked gets zero weights everywhere, so its attention output is
// out_proj.bias alone and no gradient flows through it. torch returns NaN there
// (softmax of all -inf, pytorch/pytorch#40932); we give the finite answer so one
// fully padded sample cannot turn a whole step's loss and gradients into NaN.
// Compare with torch only on samples that keep at least one key.
//
// The context's attention mask (ctx.attention_mask(), broadcast to [N, H, L, L])
// applies as torch's attn_mask does, with the context's meaning: a boolean mask's
// nonzero entries are the pairs that may attend (scaled_dot_product_attention's
// convention; nn.MultiheadAttention's boolean attn_mask means the opposite), an
// additive one is added to the scaled scores. A query it leaves no key gets zero
// weights, as with padding.
template <class T, class Space = host_space>
class MultiheadAttention : public detail::attention_base<T, Space> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::MultiheadAttention: the host layer; for cuda_space include shardlib/nn/cuda/attention.cuh");
  using base = detail::attention_base<T, Space>;
  using base::o_, base::head_dim_, base::seq_, base::batch_, base::drop_, base::check_grad, base::row0, base::step;

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;
  using options = attention_options;
  using base::in_proj_weight, base::in_proj_bias, base::out_proj;

  using base::base;  // MultiheadAttention(options)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const std::int64_t E = o_.embed_dim;
    const Tensor<std::uint8_t>& mask = this->begin_forward(ctx, x.shape());
    const std::int64_t R = seq_ * batch_;

    // qkv = x W_in^T + b_in: all three projections of all rows in one product.
    x_ = x;
    qkv_ = Tensor<T>({R, 3 * E});
    if (o_.bias)
      for (std::int64_t r = 0; r < R; ++r) std::copy_n(in_proj_bias.value, 3 * E, qkv_.data() + r * 3 * E);
    ops::gemm(ops::trans::no, ops::trans::yes, R, 3 * E, E, T(1), x.data(), E, in_proj_weight.value, E,
              T(o_.bias ? 1 : 0), qkv_.data(), 3 * E);

    drop_.reset();
    if (ctx.training() && o_.dropout > 0) drop_ = ctx.random_stream();
    probs_ = Tensor<T>({batch_, o_.num_heads, seq_, seq_});
    Tensor<T> attn(x.shape());  // heads concatenated, rows laid out as x's
    sdpa_forward(heads(qkv_, 0), heads(qkv_, 1), heads(qkv_, 2), heads(attn, 0), probs_.data(), sdpa(mask, ctx.attention_mask()));
    if (!grad_enabled(ctx)) x_ = qkv_ = probs_ = {};  // kept only for backward
    return ctx.forward(out_proj, attn);
  }

  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    check_grad(x_, dy);
    const std::int64_t E = o_.embed_dim, R = seq_ * batch_;
    const Tensor<T> dattn = ctx.backward(out_proj, dy);

    // dq, dk, dv written into their thirds of dqkv; the masks are not needed
    // again (masked weights are zero in probs_).
    Tensor<T> dqkv({R, 3 * E});
    sdpa_backward(heads(dattn, 0), heads(qkv_, 0), heads(qkv_, 1), heads(qkv_, 2), probs_.data(), heads(dqkv, 0),
                  heads(dqkv, 1), heads(dqkv, 2), sdpa({}, {}));

    // The three projections read the same x, so dx = dqkv W_in sums their contributions.
    if (in_proj_weight.requires_grad)  // frozen: no gradient (nn::Linear's rule)
      ops::gemm(ops::trans::yes, ops::trans::no, 3 * E, E, R, T(1), dqkv.data(), 3 * E, x_.data(), E, T(1),
                in_proj_weight.grad, E);  // dW_in += dqkv^T x
    if (o_.bias && in_proj_bias.requires_grad) detail::add_column_sums(dqkv.data(), R, 3 * E, in_proj_bias.grad);
    input dx(x_.shape());
    ops::gemm(ops::trans::no, ops::trans::no, R, E, 3 * E, T(1), dqkv.data(), 3 * E, in_proj_weight.value, E, T(0),
              dx.data(), E);
    x_ = {};
    qkv_ = {};
    probs_ = {};
    return dx;
  }

 private:
  // The heads of q (third 0 of qkv's columns), k (1) or v (2), or of the
  // attention output or its gradient (a tensor shaped as x, third 0): rows laid
  // out as x's (attention_base::row0, step), head h at column h D of the third.
  head_view<T> heads(const Tensor<T>& t, std::int64_t third) const {
    const std::int64_t width = t.numel() / (seq_ * batch_);  // 3E for qkv, E for the output
    return {t.data() + third * o_.embed_dim, batch_, o_.num_heads, seq_, head_dim_, row0(1) * width, head_dim_,
            step() * width};
  }
  // The default scale 1 / sqrt(D); the dropout stream of this forward, if it drops.
  sdpa_options sdpa(const Tensor<std::uint8_t>& key_padding, const attn_mask& mask) const {
    return {.dropout_p = o_.dropout,
            .dropout = drop_,
            .key_padding_mask = key_padding,
            .mask = mask,
            .who = "MultiheadAttention"};
  }

  // Cached by forward for backward (and drop_, seq_, batch_ in the base).
  input x_;
  Tensor<T> qkv_;    // [rows, 3E]: q, k, v of every row
  Tensor<T> probs_;  // [N, H, L, L]: softmax weights before dropout
};

}  // namespace shardlib::nn
