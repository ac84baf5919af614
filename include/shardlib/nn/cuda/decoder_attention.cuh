// shardlib/nn/cuda/decoder_attention.cuh — the decoder attention's core on the
// device: nn::detail::decoder_attention<T, cuda_space>, which makes
// GPT2Attention<T, cuda_space> and LlamaAttention<T, cuda_space> (their
// projections are device Linears), and the KV cache's copies in device memory.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/copy.hpp"               // to_device
#include "shardlib/cuda/error.hpp"              // check
#include "shardlib/cuda/current.hpp"            // current_stream
#include "shardlib/cuda/memory_space.hpp"       // cuda_space
#include "shardlib/nn/cuda/dropout.cuh"         // Dropout (GPT-2's resid_dropout)
#include "shardlib/nn/cuda/linear.cuh"          // Linear: the projections
#include "shardlib/nn/cuda/transformer.cuh"     // residual: LLaMA's sum of the projections' dx
#include "shardlib/nn/decoder_attention.hpp"    // the host core, decoder_attention_options
#include "shardlib/nn/gpt2_attention.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/llama_attention.hpp"
#include "shardlib/nn/sdpa.hpp"                 // head_view
#include "shardlib/ops/cuda/flash_attention.cuh"  // flash_attention_forward, _backward
#include "shardlib/ops/cuda/rotary.cuh"           // rotary_device_table, apply_rotary, apply_rotary_at

#include <algorithm>    // std::max
#include <cstdint>      // std::int64_t, std::uint8_t
#include <optional>     // std::optional, std::nullopt
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <utility>      // std::move

namespace shardlib::nn {

// A device KV cache's new rows: one strided copy per sequence of the batch, on the
// current stream (the projections' rows hold their heads side by side).
template <>
struct kv_rows<cuda_space> {
  template <class T>
  static void copy(const head_view<T>& from, const head_view<T>& to, std::string_view who) {
    require<shape_error>(from.head_stride == from.dim && to.head_stride == to.dim, who,
                         ": the device KV cache copies rows whose heads lie side by side (head_stride == head_dim), "
                         "got head strides ", from.head_stride, " and ", to.head_stride, " for head_dim ", from.dim);
    const std::size_t e = sizeof(T);
    for (std::int64_t n = 0; n < from.batch; ++n)
      cuda::check(cudaMemcpy2DAsync(to.at(n, 0), std::size_t(to.row_stride) * e, from.at(n, 0),
                                    std::size_t(from.row_stride) * e, std::size_t(from.heads * from.dim) * e,
                                    std::size_t(from.seq), cudaMemcpyDeviceToDevice, cuda::current_stream()),
                  "cudaMemcpy2DAsync (", who, "'s KV cache: ", from.seq, " rows of sequence ", n, ")");
  }
};

}  // namespace shardlib::nn

namespace shardlib::nn::detail {

// The host core's contract (the views passed to forward stay valid until
// backward: the layer keeps their tensors, the output's included) over device
// memory: RoPE by ops::cuda::apply_rotary with a float table of the positions
// seen so far (uploaded when a longer sequence comes; with the KV cache on, once
// for its capacity), then the fused attention
// (ops/cuda/flash_attention.cuh: causal, the context's key padding, dropout drawn
// as nn::sdpa draws it, nn::attention_keep's groups of [B, H, Lq, Lk] from the
// context's stream), which keeps only the row log-sum-exps [B, H, S] for
// backward, never the [S, S] weights. Backward runs the fused backward, then the
// inverse rotation of dq and dk. The KV cache (inference) is the host's, in device
// memory: the new queries are rotated and masked at their positions after the
// cached ones, and attend over every cached key (a key padding mask then covers
// them all, [B, cached + S]); a forward that fails after appending forgets what it
// appended, as the host's fails before appending. The context's position ids, when
// set, are copied to the device and give RoPE each token's position, as on the host.
//
// Not on the device, refused with an error naming the layer: attention masks
// other than causal and key padding (ctx.attention_mask()).
template <class T>
class decoder_attention<T, cuda_space> : public decoder_attention_base<T, cuda_space> {
  using base = decoder_attention_base<T, cuda_space>;
  using base::name_, base::o_;

 public:
  using options = decoder_attention_options;

  decoder_attention(std::string name, const options& o) : base(std::move(name), o) {}
  // Copies share no device state (layers are copyable descriptions; Stack and
  // the models copy a prototype block).
  decoder_attention(const decoder_attention& other) : base(other) {}
  decoder_attention& operator=(const decoder_attention& other) {
    if (this != &other) *this = decoder_attention(other);
    return *this;
  }
  decoder_attention(decoder_attention&&) = default;
  decoder_attention& operator=(decoder_attention&&) = default;

  template <class Ctx>
  void forward(Ctx& ctx, const head_view<T>& q, const head_view<T>& k, const head_view<T>& v, const head_view<T>& out) {
    this->check_cache_for_forward(ctx);
    const attn_mask& mask = ctx.attention_mask();
    require(mask.empty(), name_, ": on the device only the causal rule and a key padding mask are supported, not an ",
            "attention mask (got one of shape ", mask.shape(), "); run the host layer for arbitrary masks");
    const std::int64_t offset = this->kv_cache_length(), B = q.batch, S = q.seq;
    const cudaStream_t s = cuda::current_stream();
    const Tensor<std::uint8_t>& padding = ctx.key_padding_mask();
    // Checked before the cache grows, so a bad mask leaves it as it was.
    require<shape_error>(padding.empty() || padding.shape() == Shape{B, offset + S}, name_,
                         ": key_padding_mask must be [batch, keys] = ", Shape{B, offset + S}, ", got ",
                         padding.shape());
    const Tensor<std::int64_t>& ids = ctx.position_ids();
    const std::int64_t largest = this->checked_position_ids(ids, B, S);
    flash_ = {.is_causal = true,
              .query_offset = offset,
              .scale = 0,
              .dropout_p = float(o_.dropout),
              .dropout = std::nullopt,
              .key_padding = nullptr};
    padding_ = padding.empty() ? Tensor<std::uint8_t, cuda_space>{} : cuda::to_device(padding);
    flash_.key_padding = padding_.data();
    if (ctx.training() && o_.dropout > 0) flash_.dropout = ctx.random_stream();
    positions_ = ids.empty() || !o_.rotary ? Tensor<std::int64_t, cuda_space>{} : cuda::to_device(ids);
    if (o_.rotary) {
      const std::int64_t needed = std::max(offset + S, largest + 1);
      if (!table_ || table_->positions() < needed)
        table_.emplace(*o_.rotary, std::max(needed, this->kv_cache_capacity()), s);
      rotate(q, k, offset, false, s);
    }
    const auto [keys, values] = this->keys_and_values(k, v);
    try {
      lse_ = Tensor<float, cuda_space>({B, o_.heads, S});
      ops::cuda::flash_attention_forward<T>(ops::cuda::as_const(q), ops::cuda::as_const(keys),
                                            ops::cuda::as_const(values), out, lse_.data(), flash_, s);
    } catch (...) {
      this->forget_cached_from(offset);
      throw;
    }
    if (this->caching() || !grad_enabled(ctx)) {  // no backward follows
      lse_ = {};
      padding_ = {};
      positions_ = {};
      return;
    }
    q_ = q;
    k_ = k;
    v_ = v;
    out_ = out;
  }

  // dq, dk, dv (views shaped as forward's q, k, v) from dout, overwritten.
  void backward(const head_view<T>& dout, const head_view<T>& dq, const head_view<T>& dk, const head_view<T>& dv) {
    this->check_cache_for_backward();
    require_activations(!lse_.empty(), name_);
    const cudaStream_t s = cuda::current_stream();
    ops::cuda::flash_attention_backward<T>(ops::cuda::as_const(q_), ops::cuda::as_const(k_), ops::cuda::as_const(v_),
                                           ops::cuda::as_const(out_), ops::cuda::as_const(dout), lse_.data(), dq, dk,
                                           dv, flash_, s);
    if (o_.rotary) rotate(dq, dk, 0, true, s);
    lse_ = {};
    padding_ = {};
    positions_ = {};
  }

 private:
  // RoPE on q and k in place, by table_: at offset + l, or at positions_.
  void rotate(const head_view<T>& q, const head_view<T>& k, std::int64_t offset, bool inverse, cudaStream_t s) const {
    if (positions_.empty()) {
      ops::cuda::apply_rotary(q, q, *table_, offset, inverse, s);
      ops::cuda::apply_rotary(k, k, *table_, offset, inverse, s);
    } else {
      ops::cuda::apply_rotary_at(q, q, *table_, positions_.data(), inverse, s);
      ops::cuda::apply_rotary_at(k, k, *table_, positions_.data(), inverse, s);
    }
  }

  // cos, sin of positions [0, the furthest so far or, with the KV cache, its capacity)
  std::optional<ops::cuda::rotary_device_table> table_;
  // Cached by forward for backward.
  ops::cuda::flash_options flash_;
  head_view<T> q_, k_, v_, out_;
  Tensor<float, cuda_space> lse_;               // [B, heads, S]: each query row's log-sum-exp of scores
  Tensor<std::uint8_t, cuda_space> padding_;     // the key padding mask flash_ points at
  Tensor<std::int64_t, cuda_space> positions_;  // the context's position ids for RoPE, empty for offset + l
};

}  // namespace shardlib::nn::detail
