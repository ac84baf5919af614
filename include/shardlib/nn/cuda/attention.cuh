// shardlib/nn/cuda/attention.cuh — MultiheadAttention on the device:
// nn::MultiheadAttention<T, cuda_space>.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/current.hpp"          // current_stream
#include "shardlib/cuda/memory_space.hpp"     // cuda_space
#include "shardlib/nn/attention.hpp"          // the host layer, attention_options
#include "shardlib/cuda/copy.hpp"  // to_device
#include "shardlib/nn/cuda/device.cuh"        // device_gemm, device_gemm_batched, add_column_sums_device
#include "shardlib/nn/cuda/linear.cuh"        // out_proj
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/ops/cuda/elementwise.cuh"  // dropout, repeat_rows
#include "shardlib/ops/cuda/softmax.cuh"      // masked_softmax, softmax_backward

#include <cmath>     // std::sqrt
#include <cstdint>   // std::int64_t, std::uint8_t
#include <optional>  // std::optional
#include <span>      // std::span
#include <string>    // std::string

namespace shardlib::nn {

// The host layer's parameters (torch's names and packing), checks and
// arithmetic (see nn/attention.hpp), on the current stream: one product for
// the q, k, v projections of all rows, then per sample one batched product
// over the heads for each of q k^T, P V and their gradients. The weights'
// dropout draws element i of the [N, H, L, L] weights at index i, as the host
// does, so the masks are the host's bit for bit; backward regenerates them.
template <class T>
class MultiheadAttention<T, cuda_space> {
 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using options = attention_options;

  explicit MultiheadAttention(const options& o)
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
  Linear<T, cuda_space> out_proj;

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

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const std::int64_t E = o_.embed_dim, H = o_.num_heads, D = head_dim_;
    require<shape_error>(x.rank() == 3 && x.dim(2) == E, name(), ": input must be ",
                         o_.batch_first ? "[N, L, " : "[L, N, ", E, "] (", o_.batch_first ? "batch" : "sequence",
                         " first), got shape ", x.shape());
    const std::int64_t L = x.dim(o_.batch_first ? 1 : 0), N = x.dim(o_.batch_first ? 0 : 1), R = L * N;
    const Tensor<std::uint8_t>& mask = ctx.key_padding_mask();
    require<shape_error>(mask.empty() || mask.shape() == Shape{N, L}, name(),
                         ": key_padding_mask must be [N, L] = ", Shape{N, L}, " (batch, keys), got ", mask.shape());
    seq_ = L;
    batch_ = N;
    const cudaStream_t s = cuda::current_stream();

    // qkv = x W_in^T + b_in: all three projections of all rows in one product.
    x_ = x;
    qkv_ = Tensor<T, cuda_space>({R, 3 * E});
    if (o_.bias) ops::cuda::repeat_rows(std::span<const T>(in_proj_bias.value, std::size_t(3 * E)), qkv_.span(), s);
    detail::device_gemm(ops::trans::no, ops::trans::yes, R, 3 * E, E, 1.0f, x.data(), E, in_proj_weight.value, E,
                        o_.bias ? 1.0f : 0.0f, qkv_.data(), 3 * E);

    // Scores of every (sample, head), then the softmax over keys in place.
    probs_ = Tensor<T, cuda_space>({N, H, L, L});
    for (std::int64_t n = 0; n < N; ++n)
      detail::device_gemm_batched(ops::trans::no, ops::trans::yes, L, L, D, scale(), q(n), ld_qkv(), D, k(n), ld_qkv(),
                                  D, 0.0f, probs(n), L, L * L, H);
    const Tensor<std::uint8_t, cuda_space> dmask = mask.empty() ? Tensor<std::uint8_t, cuda_space>{}
                                                                : cuda::to_device(mask);
    ops::cuda::masked_softmax(probs_.data(), dmask.data(), N * H * L, int(L), H * L, s);

    drop_.reset();
    if (ctx.training() && o_.dropout > 0) drop_ = ctx.random_stream();
    const Tensor<T, cuda_space> pv = dropped(probs_);
    Tensor<T, cuda_space> attn(x.shape());  // heads concatenated, rows laid out as x's
    for (std::int64_t n = 0; n < N; ++n)
      detail::device_gemm_batched(ops::trans::no, ops::trans::no, L, D, L, 1.0f, pv.data() + n * H * L * L, L, L * L,
                                  v(n), ld_qkv(), D, 0.0f, attn.data() + row0(n) * E, ld_x(), D, H);
    return ctx.forward(out_proj, attn);
  }

  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    require<shape_error>(!x_.empty() && dy.shape() == x_.shape(), name(),
                         ": backward needs the gradient of the last forward's output (shape ", x_.shape(), "), got ",
                         dy.shape());
    const std::int64_t E = o_.embed_dim, H = o_.num_heads, D = head_dim_, L = seq_, N = batch_, R = L * N;
    const Tensor<T, cuda_space> dattn = ctx.backward(out_proj, dy);

    // Per sample over heads: dP' = dO V^T, dV = P'^T dO, back through dropout
    // and softmax to dS, then dQ = s dS K and dK = s dS^T Q, written into dqkv.
    Tensor<T, cuda_space> dqkv({R, 3 * E});
    Tensor<T, cuda_space> dp({N, H, L, L});
    const Tensor<T, cuda_space> pv = dropped(probs_);
    for (std::int64_t n = 0; n < N; ++n) {
      const T* dout = dattn.data() + row0(n) * E;
      T* dpn = dp.data() + n * H * L * L;
      detail::device_gemm_batched(ops::trans::no, ops::trans::yes, L, L, D, 1.0f, dout, ld_x(), D, v(n), ld_qkv(), D,
                                  0.0f, dpn, L, L * L, H);
      detail::device_gemm_batched(ops::trans::yes, ops::trans::no, L, D, L, 1.0f, pv.data() + n * H * L * L, L, L * L,
                                  dout, ld_x(), D, 0.0f, at(dqkv, n, 2), ld_qkv(), D, H);
    }
    if (drop_) apply_dropout(dp, dp);
    ops::cuda::softmax_backward(probs_.data(), dp.data(), N * H * L, int(L), cuda::current_stream());
    for (std::int64_t n = 0; n < N; ++n) {
      const T* dpn = dp.data() + n * H * L * L;
      detail::device_gemm_batched(ops::trans::no, ops::trans::no, L, D, L, scale(), dpn, L, L * L, k(n), ld_qkv(), D,
                                  0.0f, at(dqkv, n, 0), ld_qkv(), D, H);
      detail::device_gemm_batched(ops::trans::yes, ops::trans::no, L, D, L, scale(), dpn, L, L * L, q(n), ld_qkv(), D,
                                  0.0f, at(dqkv, n, 1), ld_qkv(), D, H);
    }

    // The three projections read the same x, so dx = dqkv W_in sums their contributions.
    detail::device_gemm(ops::trans::yes, ops::trans::no, 3 * E, E, R, 1.0f, dqkv.data(), 3 * E, x_.data(), E, 1.0f,
                        in_proj_weight.grad, E);  // dW_in += dqkv^T x
    if (o_.bias) detail::add_column_sums_device(dqkv.data(), R, 3 * E, in_proj_bias.grad);
    input dx(x_.shape());
    detail::device_gemm(ops::trans::no, ops::trans::no, R, E, 3 * E, 1.0f, dqkv.data(), 3 * E, in_proj_weight.value, E,
                        0.0f, dx.data(), E);
    x_ = {};
    qkv_ = {};
    probs_ = {};
    return dx;
  }

 private:
  static const options& validated(const options& o) {
    require<shape_error>(o.embed_dim > 0 && o.num_heads > 0 && o.embed_dim % o.num_heads == 0,
                         "MultiheadAttention: embed_dim (", o.embed_dim, ") must be a positive multiple of num_heads (",
                         o.num_heads, ")");
    require(o.dropout >= 0 && o.dropout <= 1, "MultiheadAttention: dropout must be in [0, 1], got ", o.dropout);
    return o;
  }
  std::string name() const { return cat("MultiheadAttention(embed_dim ", o_.embed_dim, ", num_heads ", o_.num_heads, ")"); }
  float scale() const { return float(1.0 / std::sqrt(double(head_dim_))); }

  // Row layout as the host's: sample n's rows start at row0(n), `step` rows apart;
  // head h of q, k, v is D columns at h D of its third of qkv (heads D apart).
  std::int64_t row0(std::int64_t n) const { return o_.batch_first ? n * seq_ : n; }
  std::int64_t step() const { return o_.batch_first ? 1 : batch_; }
  std::int64_t ld_qkv() const { return step() * 3 * o_.embed_dim; }
  std::int64_t ld_x() const { return step() * o_.embed_dim; }
  T* at(const Tensor<T, cuda_space>& t, std::int64_t n, int which) const {
    return t.data() + row0(n) * 3 * o_.embed_dim + which * o_.embed_dim;
  }
  const T* q(std::int64_t n) const { return at(qkv_, n, 0); }
  const T* k(std::int64_t n) const { return at(qkv_, n, 1); }
  const T* v(std::int64_t n) const { return at(qkv_, n, 2); }
  T* probs(std::int64_t n) const { return probs_.data() + n * o_.num_heads * seq_ * seq_; }

  // out = inverted dropout of in ([N, H, L, L]) with this forward's stream; out may be in.
  void apply_dropout(const Tensor<T, cuda_space>& in, const Tensor<T, cuda_space>& out) const {
    ops::cuda::dropout<T>(in.span(), out.span(), *drop_, 0, o_.dropout, cuda::current_stream());
  }
  // The weights P V uses: p itself without dropout, else a dropped copy.
  Tensor<T, cuda_space> dropped(const Tensor<T, cuda_space>& p) const {
    if (!drop_) return p;
    Tensor<T, cuda_space> out(p.shape());
    apply_dropout(p, out);
    return out;
  }

  options o_;
  std::int64_t head_dim_;
  std::int64_t seq_ = 0, batch_ = 0;
  // Cached by forward for backward.
  input x_;
  Tensor<T, cuda_space> qkv_;    // [rows, 3E]: q, k, v of every row
  Tensor<T, cuda_space> probs_;  // [N, H, L, L]: softmax weights before dropout
  std::optional<counter_rng> drop_;
};

}  // namespace shardlib::nn
