// shardlib/nn/attention.hpp — MultiheadAttention: multi-head self-attention
// (torch.nn.MultiheadAttention with query = key = value = x).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/dropout.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/ops/gemm.hpp"

#include <algorithm>    // std::copy_n, std::max
#include <cmath>        // std::exp, std::sqrt
#include <cstdint>      // std::int64_t, std::uint8_t, std::uint64_t
#include <optional>     // std::optional
#include <string>       // std::string
#include <type_traits>  // std::is_same_v
#include <vector>       // std::vector

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
  // forward's checks of x's shape and of the context's key padding mask, which
  // it returns; keeps the sequence length and batch size for backward.
  template <class Ctx>
  const Tensor<std::uint8_t>& begin_forward(Ctx& ctx, const Shape& x) {
    const std::int64_t E = o_.embed_dim;
    require<shape_error>(x.rank() == 3 && x[2] == E, name(), ": input must be ", o_.batch_first ? "[N, L, " : "[L, N, ",
                         E, "] (", o_.batch_first ? "batch" : "sequence", " first), got shape ", x);
    const std::int64_t L = x[o_.batch_first ? 1 : 0], N = x[o_.batch_first ? 0 : 1];
    const Tensor<std::uint8_t>& mask = ctx.key_padding_mask();
    require<shape_error>(mask.empty() || mask.shape() == Shape{N, L}, name(),
                         ": key_padding_mask must be [N, L] = ", Shape{N, L}, " (batch, keys), got ", mask.shape());
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
// slice [h D, (h + 1) D) of each projection, D = E / num_heads. Scores are
// q.k / sqrt(D) (torch scales q before the product: equal up to rounding).
//
// Key padding: ctx.key_padding_mask() ([N, L], nonzero = ignore that key) gives
// those keys zero weight, as torch's -inf before the softmax does. A query whose
// keys are all masked gets zero weights everywhere, so its attention output is
// out_proj.bias alone and no gradient flows through it. torch returns NaN there
// (softmax of all -inf, pytorch/pytorch#40932); we give the finite answer so one
// fully padded sample cannot turn a whole step's loss and gradients into NaN.
// Compare with torch only on samples that keep at least one key.
template <class T, class Space = host_space>
class MultiheadAttention : public detail::attention_base<T, Space> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::MultiheadAttention: the host layer; for cuda_space include shardlib/nn/cuda/attention.cuh");
  using base = detail::attention_base<T, Space>;
  using base::o_, base::head_dim_, base::seq_, base::batch_, base::drop_, base::name, base::check_grad;
  using base::row0, base::ld_qkv, base::ld_x, base::offset;

 public:
  using input = Tensor<T>;
  using output = Tensor<T>;
  using options = attention_options;
  using base::in_proj_weight, base::in_proj_bias, base::out_proj;

  using base::base;  // MultiheadAttention(options)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const std::int64_t E = o_.embed_dim, H = o_.num_heads, D = head_dim_;
    const Tensor<std::uint8_t>& mask = this->begin_forward(ctx, x.shape());
    const std::int64_t L = seq_, N = batch_, R = L * N;

    // qkv = x W_in^T + b_in: all three projections of all rows in one product.
    x_ = x;
    qkv_ = Tensor<T>({R, 3 * E});
    if (o_.bias)
      for (std::int64_t r = 0; r < R; ++r) std::copy_n(in_proj_bias.value, 3 * E, qkv_.data() + r * 3 * E);
    ops::gemm(ops::trans::no, ops::trans::yes, R, 3 * E, E, T(1), x.data(), E, in_proj_weight.value, E,
              T(o_.bias ? 1 : 0), qkv_.data(), 3 * E);

    probs_ = Tensor<T>({N, H, L, L});
    drop_.reset();
    if (ctx.training() && o_.dropout > 0) drop_ = ctx.random_stream();
    std::vector<T> scales(drop_ ? L * L : 0), dropped(drop_ ? L * L : 0);
    Tensor<T> attn(x.shape());  // heads concatenated, rows laid out as x's
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t h = 0; h < H; ++h) {
        T* p = probs(n, h);
        ops::gemm(ops::trans::no, ops::trans::yes, L, L, D, scale(), q(n, h), ld_qkv(), k(n, h), ld_qkv(), T(0), p, L);
        softmax_rows(p, mask.empty() ? nullptr : mask.data() + n * L);
        const T* pv = p;
        if (drop_) {
          keep_scales(n, h, scales.data());
          for (std::int64_t i = 0; i < L * L; ++i) dropped[i] = p[i] * scales[i];
          pv = dropped.data();
        }
        ops::gemm(ops::trans::no, ops::trans::no, L, D, L, T(1), pv, L, v(n, h), ld_qkv(), T(0),
                  attn.data() + row0(n) * E + h * D, ld_x());
      }
    return ctx.forward(out_proj, attn);
  }

  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    check_grad(x_, dy);
    const std::int64_t E = o_.embed_dim, H = o_.num_heads, D = head_dim_, L = seq_, N = batch_, R = L * N;
    const Tensor<T> dattn = ctx.backward(out_proj, dy);

    // Per (batch, head): dP' = dO V^T, dV = P'^T dO, back through dropout and
    // softmax to dS, then dQ = s dS K and dK = s dS^T Q, written into dqkv.
    Tensor<T> dqkv({R, 3 * E});
    std::vector<T> scales(drop_ ? L * L : 0), dropped(drop_ ? L * L : 0), dp(L * L);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t h = 0; h < H; ++h) {
        const T* p = probs(n, h);
        const T* pv = p;
        if (drop_) {
          keep_scales(n, h, scales.data());
          for (std::int64_t i = 0; i < L * L; ++i) dropped[i] = p[i] * scales[i];
          pv = dropped.data();
        }
        const T* dout = dattn.data() + row0(n) * E + h * D;
        ops::gemm(ops::trans::no, ops::trans::yes, L, L, D, T(1), dout, ld_x(), v(n, h), ld_qkv(), T(0), dp.data(), L);
        ops::gemm(ops::trans::yes, ops::trans::no, L, D, L, T(1), pv, L, dout, ld_x(), T(0), dv(dqkv, n, h), ld_qkv());
        if (drop_)
          for (std::int64_t i = 0; i < L * L; ++i) dp[i] *= scales[i];
        softmax_backward_rows(p, dp.data());
        ops::gemm(ops::trans::no, ops::trans::no, L, D, L, scale(), dp.data(), L, k(n, h), ld_qkv(), T(0),
                  dq(dqkv, n, h), ld_qkv());
        ops::gemm(ops::trans::yes, ops::trans::no, L, D, L, scale(), dp.data(), L, q(n, h), ld_qkv(), T(0),
                  dk(dqkv, n, h), ld_qkv());
      }

    // The three projections read the same x, so dx = dqkv W_in sums their contributions.
    ops::gemm(ops::trans::yes, ops::trans::no, 3 * E, E, R, T(1), dqkv.data(), 3 * E, x_.data(), E, T(1),
              in_proj_weight.grad, E);  // dW_in += dqkv^T x
    if (o_.bias) detail::add_column_sums(dqkv.data(), R, 3 * E, in_proj_bias.grad);
    input dx(x_.shape());
    ops::gemm(ops::trans::no, ops::trans::no, R, E, 3 * E, T(1), dqkv.data(), 3 * E, in_proj_weight.value, E, T(0),
              dx.data(), E);
    x_ = {};
    qkv_ = {};
    probs_ = {};
    return dx;
  }

 private:
  T scale() const { return T(1.0 / std::sqrt(double(head_dim_))); }

  const T* q(std::int64_t n, std::int64_t h) const { return qkv_.data() + offset(n, h, 0); }
  const T* k(std::int64_t n, std::int64_t h) const { return qkv_.data() + offset(n, h, 1); }
  const T* v(std::int64_t n, std::int64_t h) const { return qkv_.data() + offset(n, h, 2); }
  T* dq(const Tensor<T>& d, std::int64_t n, std::int64_t h) const { return d.data() + offset(n, h, 0); }
  T* dk(const Tensor<T>& d, std::int64_t n, std::int64_t h) const { return d.data() + offset(n, h, 1); }
  T* dv(const Tensor<T>& d, std::int64_t n, std::int64_t h) const { return d.data() + offset(n, h, 2); }
  T* probs(std::int64_t n, std::int64_t h) const { return probs_.data() + (n * o_.num_heads + h) * seq_ * seq_; }

  // Inverted dropout on head h of sample n's weights: s[i] = 0 or 1/(1-p), with
  // Dropout's keep rule. Drawn by the element's index in probs_, so backward
  // regenerates forward's mask instead of storing it. One loop with the stream and
  // the scale hoisted, so that it vectorises.
  void keep_scales(std::int64_t n, std::int64_t h, T* s) const {
    const counter_rng stream = *drop_;
    const auto first = std::uint64_t((n * o_.num_heads + h) * seq_ * seq_);
    const float p = float(o_.dropout);
    const T kept = T(1.0 / (1.0 - o_.dropout));
    for (std::int64_t i = 0; i < seq_ * seq_; ++i)
      s[i] = dropout_keep(stream, first + std::uint64_t(i), p) ? kept : T(0);
  }

  // Row-wise softmax over keys, subtracting the row's maximum so exp never
  // overflows; masked keys (mask[j] != 0) get weight 0.
  void softmax_rows(T* p, const std::uint8_t* mask) const {
    const std::int64_t L = seq_;
    for (std::int64_t i = 0; i < L; ++i) {
      T* row = p + i * L;
      bool any = false;
      T mx = T(0);
      for (std::int64_t j = 0; j < L; ++j) {
        if (mask && mask[j]) continue;
        mx = any ? std::max(mx, row[j]) : row[j];
        any = true;
      }
      T sum = T(0);
      for (std::int64_t j = 0; j < L; ++j) {
        row[j] = (mask && mask[j]) ? T(0) : T(std::exp(row[j] - mx));
        sum += row[j];
      }
      if (any)
        for (std::int64_t j = 0; j < L; ++j) row[j] /= sum;
    }
  }
  // dS_ij = P_ij (dP_ij - sum_k dP_ik P_ik), in place over dp.
  void softmax_backward_rows(const T* p, T* dp) const {
    const std::int64_t L = seq_;
    for (std::int64_t i = 0; i < L; ++i) {
      T dot = T(0);
      for (std::int64_t j = 0; j < L; ++j) dot += dp[i * L + j] * p[i * L + j];
      for (std::int64_t j = 0; j < L; ++j) dp[i * L + j] = p[i * L + j] * (dp[i * L + j] - dot);
    }
  }

  // Cached by forward for backward (and drop_, seq_, batch_ in the base).
  input x_;
  Tensor<T> qkv_;    // [rows, 3E]: q, k, v of every row
  Tensor<T> probs_;  // [N, H, L, L]: softmax weights before dropout
};

}  // namespace shardlib::nn
