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
// arithmetic (detail::attention_base and the host layer in nn/attention.hpp),
// on the current stream: one product for the q, k, v projections of all rows,
// then per sample one batched product over the heads for each of q k^T, P V
// and their gradients. The weights' dropout draws element i of the [N, H, L, L]
// weights at index i, as the host does, so the masks are the host's bit for bit;
// backward regenerates them.
template <class T>
class MultiheadAttention<T, cuda_space> : public detail::attention_base<T, cuda_space> {
  using base = detail::attention_base<T, cuda_space>;
  using base::o_, base::head_dim_, base::seq_, base::batch_, base::drop_, base::name, base::check_grad;
  using base::row0, base::ld_qkv, base::ld_x, base::offset;

 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using options = attention_options;
  using base::in_proj_weight, base::in_proj_bias, base::out_proj;

  using base::base;  // MultiheadAttention(options)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const std::int64_t E = o_.embed_dim, H = o_.num_heads, D = head_dim_;
    const Tensor<std::uint8_t>& mask = this->begin_forward(ctx, x.shape());
    const std::int64_t L = seq_, N = batch_, R = L * N;
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
    check_grad(x_, dy);
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
  float scale() const { return float(1.0 / std::sqrt(double(head_dim_))); }

  // Row layout as the host's (attention_base): q, k or v of sample n, heads D apart.
  T* at(const Tensor<T, cuda_space>& t, std::int64_t n, int which) const { return t.data() + offset(n, 0, which); }
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

  // Cached by forward for backward (and drop_, seq_, batch_ in the base).
  input x_;
  Tensor<T, cuda_space> qkv_;    // [rows, 3E]: q, k, v of every row
  Tensor<T, cuda_space> probs_;  // [N, H, L, L]: softmax weights before dropout
};

}  // namespace shardlib::nn
