// shardlib/nn/cuda/attention.cuh — MultiheadAttention on the device:
// nn::MultiheadAttention<T, cuda_space>.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/copy.hpp"                 // to_device
#include "shardlib/cuda/current.hpp"              // current_stream
#include "shardlib/cuda/memory_space.hpp"         // cuda_space
#include "shardlib/nn/attention.hpp"              // the host layer, attention_options
#include "shardlib/nn/cuda/device.cuh"            // device_gemm, add_column_sums_device
#include "shardlib/nn/cuda/linear.cuh"            // out_proj
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/sdpa.hpp"                   // head_view
#include "shardlib/ops/cuda/elementwise.cuh"      // repeat_rows
#include "shardlib/ops/cuda/flash_attention.cuh"  // flash_attention_forward, flash_attention_backward

#include <cstdint>   // std::int64_t, std::uint8_t
#include <span>      // std::span

namespace shardlib::nn {

// The host layer's parameters (torch's names and packing), checks and
// arithmetic (detail::attention_base and the host layer in nn/attention.hpp),
// on the current stream: one product for the q, k, v projections of all rows,
// then the fused attention (ops/cuda/flash_attention.cuh) on strided views of
// the projected rows, as the host runs sdpa on them: the [N, H, L, L] weights
// are never stored, forward keeps only the attention output and each query's
// log-sum-exp ([N, H, L] floats) for backward, which recomputes the weights.
// The key padding mask and the weights' dropout (nn::attention_keep's groups of
// [N, H, L, L], from one ctx.random_stream() per forward) are the host's, so the
// masks are the host's bit for bit. An attention mask (ctx.attention_mask()) is
// refused with an error naming the layer: the fused kernel reads none.
template <class T>
class MultiheadAttention<T, cuda_space> : public detail::attention_base<T, cuda_space> {
  using base = detail::attention_base<T, cuda_space>;
  using base::o_, base::head_dim_, base::seq_, base::batch_, base::drop_, base::check_grad, base::row0, base::step;

 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using options = attention_options;
  using base::in_proj_weight, base::in_proj_bias, base::out_proj;

  using base::base;  // MultiheadAttention(options)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const std::int64_t E = o_.embed_dim;
    const attn_mask& allowed = ctx.attention_mask();
    require(allowed.empty(), this->name(), ": on the device only a key padding mask is supported, not an attention "
            "mask (got one of shape ", allowed.shape(), "); run the host layer for arbitrary masks");
    const Tensor<std::uint8_t>& mask = this->begin_forward(ctx, x.shape());
    const std::int64_t R = seq_ * batch_;
    const cudaStream_t s = cuda::current_stream();

    // qkv = x W_in^T + b_in: all three projections of all rows in one product.
    x_ = x;
    qkv_ = Tensor<T, cuda_space>({R, 3 * E});
    if (o_.bias) ops::cuda::repeat_rows(std::span<const T>(in_proj_bias.value, std::size_t(3 * E)), qkv_.span(), s);
    detail::device_gemm(ops::trans::no, ops::trans::yes, R, 3 * E, E, 1.0f, x.data(), E, in_proj_weight.value, E,
                        o_.bias ? 1.0f : 0.0f, qkv_.data(), 3 * E);

    key_padding_ = mask.empty() ? Tensor<std::uint8_t, cuda_space>{} : cuda::to_device(mask);
    drop_.reset();
    if (ctx.training() && o_.dropout > 0) drop_ = ctx.random_stream();
    attn_ = Tensor<T, cuda_space>(x.shape());  // heads concatenated, rows laid out as x's
    lse_ = Tensor<float, cuda_space>({batch_, o_.num_heads, seq_});
    ops::cuda::flash_attention_forward<T>(read(qkv_, 0), read(qkv_, 1), read(qkv_, 2), heads(attn_, 0), lse_.data(),
                                          fused(), s);
    output y = ctx.forward(out_proj, attn_);
    if (!grad_enabled(ctx)) {  // no backward follows: keep nothing (as the host layers)
      x_ = {};
      qkv_ = {};
      attn_ = {};
      lse_ = {};
      key_padding_ = {};
    }
    return y;
  }

  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    check_grad(x_, dy);
    const std::int64_t E = o_.embed_dim, R = seq_ * batch_;
    const Tensor<T, cuda_space> dattn = ctx.backward(out_proj, dy);

    // dq, dk, dv written into their thirds of dqkv, the weights recomputed from
    // q, k and forward's log-sum-exp.
    Tensor<T, cuda_space> dqkv({R, 3 * E});
    ops::cuda::flash_attention_backward<T>(read(qkv_, 0), read(qkv_, 1), read(qkv_, 2), read(attn_, 0),
                                           read(dattn, 0), lse_.data(), heads(dqkv, 0), heads(dqkv, 1),
                                           heads(dqkv, 2), fused(), cuda::current_stream());

    // The three projections read the same x, so dx = dqkv W_in sums their contributions.
    if (in_proj_weight.requires_grad)  // frozen: no gradient (nn::Linear's rule)
      detail::device_gemm(ops::trans::yes, ops::trans::no, 3 * E, E, R, 1.0f, dqkv.data(), 3 * E, x_.data(), E, 1.0f,
                          in_proj_weight.grad, E);  // dW_in += dqkv^T x
    if (o_.bias && in_proj_bias.requires_grad)
      detail::add_column_sums_device(dqkv.data(), R, 3 * E, in_proj_bias.grad);
    input dx(x_.shape());
    detail::device_gemm(ops::trans::no, ops::trans::no, R, E, 3 * E, 1.0f, dqkv.data(), 3 * E, in_proj_weight.value, E,
                        0.0f, dx.data(), E);
    x_ = {};
    qkv_ = {};
    attn_ = {};
    lse_ = {};
    key_padding_ = {};
    return dx;
  }

 private:
  // The heads of q (third 0 of qkv's columns), k (1) or v (2), or of the
  // attention output or its gradient (a tensor shaped as x, third 0), as the
  // host layer views them: rows laid out as x's, head h at column h D of the third.
  head_view<T> heads(const Tensor<T, cuda_space>& t, std::int64_t third) const {
    const std::int64_t width = t.numel() / (seq_ * batch_);  // 3E for qkv, E for the output
    return {t.data() + third * o_.embed_dim, batch_, o_.num_heads, seq_, head_dim_, row0(1) * width, head_dim_,
            step() * width};
  }
  head_view<const T> read(const Tensor<T, cuda_space>& t, std::int64_t third) const {
    return ops::cuda::as_const(heads(t, third));
  }
  // The default scale 1 / sqrt(D); this forward's key padding and dropout stream.
  ops::cuda::flash_options fused() const {
    return {.dropout_p = float(o_.dropout), .dropout = drop_, .key_padding = key_padding_.data()};
  }

  // Cached by forward for backward (and drop_, seq_, batch_ in the base).
  input x_;
  Tensor<T, cuda_space> qkv_;                   // [rows, 3E]: q, k, v of every row
  Tensor<T, cuda_space> attn_;                  // [rows, E]: the attention output (out_proj's input)
  Tensor<float, cuda_space> lse_;               // [N, H, L]: each query's log-sum-exp
  Tensor<std::uint8_t, cuda_space> key_padding_;  // [N, L] on the device, empty without a mask
};

}  // namespace shardlib::nn
