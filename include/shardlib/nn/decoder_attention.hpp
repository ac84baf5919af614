// shardlib/nn/decoder_attention.hpp — what the decoder attention layers
// (nn/gpt2_attention.hpp, nn/llama_attention.hpp) share: the KV cache and the
// causal attention between their projections.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/position_ids.hpp"
#include "shardlib/nn/rotary.hpp"
#include "shardlib/nn/sdpa.hpp"

#include <algorithm>    // std::copy_n, std::min, std::minmax_element
#include <cstdint>      // std::int64_t
#include <limits>       // std::numeric_limits
#include <optional>     // std::optional
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v
#include <utility>      // std::move, std::pair

namespace shardlib::nn {

// How a KV cache in Space copies new rows after the cached ones: `to` is shaped
// as `from`; `who` names the layer in errors. The host's here; cuda_space's in
// nn/cuda/decoder_attention.cuh.
template <class Space>
struct kv_rows;

template <>
struct kv_rows<host_space> {
  template <class T>
  static void copy(const head_view<T>& from, const head_view<T>& to, std::string_view) {
    for (std::int64_t n = 0; n < from.batch; ++n)
      for (std::int64_t h = 0; h < from.heads; ++h)
        for (std::int64_t l = 0; l < from.seq; ++l)
          std::copy_n(from.at(n, h) + l * from.row_stride, from.dim, to.at(n, h) + l * to.row_stride);
  }
};

// The keys and values (after RoPE) of every position a layer has seen since the
// last reset, for generating one step at a time: [batch, capacity, heads * dim]
// each in Space, allocated by the first append after a reset.
template <class T, class Space = host_space>
class kv_cache {
 public:
  explicit kv_cache(std::int64_t capacity) : capacity_(capacity) {
    require(capacity > 0, "kv_cache: capacity (max_seq) must be positive, got ", capacity);
  }
  // A copy starts empty with the same capacity: layers are copyable descriptions
  // (Stack copies a prototype), and copies must not share one cache's storage.
  kv_cache(const kv_cache& other) : capacity_(other.capacity_) {}
  kv_cache& operator=(const kv_cache& other) {
    if (this != &other) *this = kv_cache(other);
    return *this;
  }
  kv_cache(kv_cache&&) = default;
  kv_cache& operator=(kv_cache&&) = default;

  std::int64_t capacity() const { return capacity_; }
  std::int64_t length() const { return length_; }
  void reset() { length_ = 0; }
  // Forgets the positions from `length` on (a forward that failed after appending).
  void truncate(std::int64_t length) { length_ = std::min(length_, length); }

  // Copies the s_new positions of k and v after the cached ones and returns
  // views of all of them.
  std::pair<head_view<T>, head_view<T>> append(const head_view<T>& k, const head_view<T>& v, std::string_view who) {
    const std::int64_t B = k.batch, H = k.heads, D = k.dim, S = k.seq;
    if (length_ == 0 && (k_.empty() || k_.dim(0) != B || k_.dim(2) != H * D)) {
      k_ = Tensor<T, Space>({B, capacity_, H * D});
      v_ = Tensor<T, Space>({B, capacity_, H * D});
    }
    require<shape_error>(k_.dim(0) == B && k_.dim(2) == H * D, who, ": the KV cache holds a batch of ", k_.dim(0),
                         " and ", k_.dim(2), " key columns; this step has ", B, " and ", H * D,
                         " (reset_kv_cache() before a new batch)");
    require<shape_error>(length_ + S <= capacity_, who, ": the KV cache holds ", capacity_, " positions (max_seq); ",
                         length_, " cached + ", S, " new exceed it");
    const auto rows = [&](const Tensor<T, Space>& t, std::int64_t first, std::int64_t count) {
      head_view<T> c = head_view<T>::rows(t.data() + first * H * D, B, count, H, D, H * D);
      c.batch_stride = capacity_ * H * D;
      return c;
    };
    kv_rows<Space>::copy(k, rows(k_, length_, S), who);
    kv_rows<Space>::copy(v, rows(v_, length_, S), who);
    length_ += S;
    return {rows(k_, 0, length_), rows(v_, 0, length_)};
  }

 private:
  std::int64_t capacity_, length_ = 0;
  Tensor<T, Space> k_, v_;
};

namespace detail {
// What the decoder attention's core takes besides its name.
struct decoder_attention_options {
  std::int64_t heads = 1, kv_heads = 1, head_dim = 0;
  double dropout = 0;
  std::optional<rotary_options> rotary{};
};

inline void check_decoder_attention_options(const std::string& name, const decoder_attention_options& o) {
  require<shape_error>(o.heads > 0 && o.kv_heads > 0 && o.heads % o.kv_heads == 0, name,
                       ": the number of heads (", o.heads, ") must be a positive multiple of the key/value heads (",
                       o.kv_heads, ")");
  require<shape_error>(o.head_dim > 0, name, ": head_dim must be positive, got ", o.head_dim);
  require<shape_error>(!o.rotary || o.head_dim % 2 == 0, name, ": rotary embeddings need an even head_dim, got ",
                       o.head_dim);
  if (o.rotary) check_rotary(*o.rotary, name);
  require(o.dropout >= 0 && o.dropout < 1, name, ": attention dropout must be in [0, 1), got ", o.dropout);
}

// What the host and device cores share besides their arithmetic: the layer's name
// and checked options, and the KV cache with its rules (inference only: a forward
// in training or a backward with it on raises; a copied layer starts with an
// empty cache, layers being copied as descriptions).
template <class T, class Space>
class decoder_attention_base {
 public:
  decoder_attention_base(std::string name, const decoder_attention_options& o) : name_(std::move(name)), o_(o) {
    check_decoder_attention_options(name_, o);
  }

  const std::string& name() const { return name_; }

  void enable_kv_cache(std::int64_t max_seq) { cache_.emplace(max_seq); }
  void disable_kv_cache() { cache_.reset(); }
  void reset_kv_cache() {
    require(cache_.has_value(), name_, ": reset_kv_cache() needs enable_kv_cache(max_seq) first");
    cache_->reset();
  }
  // Positions cached so far (0 without a cache).
  std::int64_t kv_cache_length() const { return cache_ ? cache_->length() : 0; }

 protected:
  bool caching() const { return cache_.has_value(); }
  std::int64_t kv_cache_capacity() const { return cache_ ? cache_->capacity() : 0; }
  void forget_cached_from(std::int64_t position) {
    if (cache_) cache_->truncate(position);
  }
  template <class Ctx>
  void check_cache_for_forward(const Ctx& ctx) const {
    require(!(cache_ && ctx.training()), name_,
            ": the KV cache is for inference; forward with it on needs ctx.training() false (disable_kv_cache() to "
            "train)");
  }
  void check_cache_for_backward() const {
    require(!cache_, name_, ": backward with the KV cache on: the cache is for inference (disable_kv_cache() to train)");
  }
  // The context's position ids checked against q [B, ., S, .]: the largest, -1 for none.
  // (Only the model knows its table's bound: LlamaModel checks max_position_embeddings.)
  std::int64_t checked_position_ids(const Tensor<std::int64_t>& ids, std::int64_t B, std::int64_t S) const {
    return ids.empty() ? -1 : check_position_ids(ids, B, S, std::numeric_limits<std::int64_t>::max(), name_);
  }
  // The keys and values to attend over: with the cache on, k and v appended to it
  // and every cached position; without, k and v.
  std::pair<head_view<T>, head_view<T>> keys_and_values(const head_view<T>& k, const head_view<T>& v) {
    return cache_ ? cache_->append(k, v, name_) : std::pair{k, v};
  }

  std::string name_;
  decoder_attention_options o_;

 private:
  std::optional<kv_cache<T, Space>> cache_;
};

// Causal self-attention between a decoder layer's projections and its output
// projection: takes the context's masks, applies RoPE (when configured), runs
// SDPA, keeps what backward needs, and owns the KV cache. The views passed to
// forward must stay valid until backward (the layer keeps their tensors).
// Space is where the views point: this is the host's core; the device's (the
// fused attention) is in nn/cuda/decoder_attention.cuh.
template <class T, class Space = host_space>
class decoder_attention : public decoder_attention_base<T, host_space> {
  static_assert(std::is_same_v<Space, host_space>,
                "nn::detail::decoder_attention: the host core; for cuda_space include "
                "shardlib/nn/cuda/decoder_attention.cuh");
  using base = decoder_attention_base<T, host_space>;
  using base::name_, base::o_;

 public:
  using options = decoder_attention_options;

  decoder_attention(std::string name, const options& o) : base(std::move(name), o) {}

  // out = attention of q over k, v (rows views of this forward's projections,
  // [B, S, heads of head_dim]); q and k are rotated in place. With the cache on,
  // the new positions follow the cached ones: RoPE and the causal rule are offset
  // by the cached length and k, v are appended first. The context's position ids,
  // when set, give RoPE each token's position instead (the causal rule stays by
  // index; a left-padded batch also masks its padding as keys).
  template <class Ctx>
  void forward(Ctx& ctx, const head_view<T>& q, const head_view<T>& k, const head_view<T>& v, const head_view<T>& out) {
    this->check_cache_for_forward(ctx);
    const std::int64_t offset = this->kv_cache_length(), B = q.batch, S = q.seq;
    sdpa_ = {.is_causal = true,
             .query_offset = offset,
             .scale = 0,
             .dropout_p = o_.dropout,
             .dropout = std::nullopt,
             .key_padding_mask = ctx.key_padding_mask(),
             .mask = ctx.attention_mask(),
             .who = name_};
    // The masks and position ids are checked before the cache grows, so bad ones leave it as it was.
    const Shape all_keys{B, k.heads, offset + S, k.dim};
    detail::check_sdpa_shapes(q.shape(), all_keys, all_keys, sdpa_);
    const Tensor<std::int64_t>& ids = ctx.position_ids();
    this->checked_position_ids(ids, B, S);
    positions_ = ids;
    if (ctx.training() && o_.dropout > 0) sdpa_.dropout = ctx.random_stream();
    rotate(q, k, offset, false);
    auto [keys, values] = this->keys_and_values(k, v);
    probs_ = Tensor<T>({B, o_.heads, S, keys.seq});
    sdpa_forward(q, keys, values, out, probs_.data(), sdpa_);
    if (this->caching() || !grad_enabled(ctx)) {  // no backward follows
      probs_ = {};
      positions_ = {};
      sdpa_ = {};  // nor the context's masks
      return;
    }
    q_ = q;
    k_ = k;
    v_ = v;
  }

  // dq, dk, dv (views shaped as forward's q, k, v) from dout, overwritten.
  void backward(const head_view<T>& dout, const head_view<T>& dq, const head_view<T>& dk, const head_view<T>& dv) {
    this->check_cache_for_backward();
    require_activations(!probs_.empty(), name_);
    sdpa_backward(dout, q_, k_, v_, probs_.data(), dq, dk, dv, sdpa_);
    rotate(dq, dk, 0, true);
    probs_ = {};
    positions_ = {};
    sdpa_ = {};
  }

 private:
  // RoPE on q and k in place (when configured): at offset + l, or at positions_.
  void rotate(const head_view<T>& q, const head_view<T>& k, std::int64_t offset, bool inverse) const {
    if (!o_.rotary) return;
    if (positions_.empty()) {
      const rotary_table<T> table(*o_.rotary, offset, q.seq);
      table.apply(q, inverse);
      table.apply(k, inverse);
      return;
    }
    // A table of the positions between the smallest id and the largest: one row when decoding.
    const auto [lo, hi] = std::minmax_element(positions_.data(), positions_.data() + positions_.numel());
    const rotary_table<T> table(*o_.rotary, *lo, *hi - *lo + 1);
    table.apply_at(q, positions_, inverse);
    table.apply_at(k, positions_, inverse);
  }

  // Cached by forward for backward.
  sdpa_options sdpa_;  // the last forward's, the context's masks included, until its backward
  head_view<T> q_, k_, v_;
  Tensor<T> probs_;                  // [B, heads, S, S]: the weights before dropout
  Tensor<std::int64_t> positions_;  // the context's position ids (shared with it), empty for offset + l
};
}  // namespace detail

}  // namespace shardlib::nn
