// shardlib/nn/context.hpp — the plain context (unsharded training) and the
// archetype that states what a layer may ask of any context.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"

#include <cstdint>  // std::int64_t, std::uint64_t, std::uint8_t
#include <utility>  // std::move

namespace shardlib::nn {

namespace detail {
// Adds one to a counter for a scope's lifetime (nested scopes of one kind).
struct scoped_depth {
  int& n;
  explicit scoped_depth(int& d) : n(d) { ++n; }
  ~scoped_depth() { --n; }
  scoped_depth(const scoped_depth&) = delete;
  scoped_depth& operator=(const scoped_depth&) = delete;
};
}  // namespace detail

// The batch's attention mask, with the meaning of torch's
// scaled_dot_product_attention(attn_mask=...): a shape that broadcasts to
// [batch, heads, queries, keys] (rank 2 to 4, aligned on the right, each
// dimension equal or 1), either boolean (`allowed`: nonzero = the query may
// attend to the key) or additive (`bias`: added to the scaled scores; -inf
// forbids the pair). At most one of the two is set; both empty = no mask. The
// additive mask is float whatever the layers' type (as the masks Hugging Face
// builds; a double layer widens it exactly).
struct attn_mask {
  Tensor<std::uint8_t> allowed{};
  Tensor<float> bias{};

  bool empty() const { return allowed.empty() && bias.empty(); }
  const Shape& shape() const { return allowed.empty() ? bias.shape() : allowed.shape(); }
};

// Composite layers call their children through the context, never directly:
// ctx.forward(child, x) and ctx.backward(child, dy). The plain context just
// calls the child; the sharded context (shard/) runs a unit's gather, bind,
// prefetch and reduce-scatter around the call when the child is a unit.
// Layers also ask the context whether they are training, for random numbers, and
// for the batch's key-padding mask (side data of the batch, like torch's
// src_key_padding_mask: [batch, sequence], nonzero = a padding position that
// attention ignores as a key; empty = no padding), attention mask (attn_mask
// above; the host's attention layers apply both, the device's key padding only)
// and position ids (Hugging Face's position_ids: [batch, sequence], each token's
// position for learned and rotary position embeddings; empty = 0, 1, ... after
// any cached tokens; a left-padded batch sets them so that each row starts at 0),
// and how many last positions a language model's head computes logits for
// (logits_to_keep, 0 = all; generation asks for one).
class context {
 public:
  struct options {
    bool training = true;
    std::uint64_t seed = 0;  // dropout masks are drawn from (seed, rank, step, draw)
    int rank = 0;
    std::uint64_t step = 0;
  };
  context() = default;
  explicit context(options o) : o_(o) {}

  template <class L, class X>
  auto forward(L& layer, const X& x) {
    return layer.forward(*this, x);
  }
  template <class L, class DY>
  auto backward(L& layer, const DY& dy) {
    return layer.backward(*this, dy);
  }

  bool training() const { return o_.training; }
  void set_training(bool on) { o_.training = on; }
  // Runs f(): forwards no backward follows (torch.no_grad()), in which layers keep no
  // activations (grad_enabled() false; nn::grad_enabled). nn::without_grad calls it.
  template <class F>
  decltype(auto) no_grad(F&& f) {
    detail::scoped_depth off(no_grad_);
    return f();
  }
  bool grad_enabled() const { return no_grad_ == 0; }
  // Inside no_grad(f): a sharding engine frees a unit gathered there after its forward.
  bool in_no_grad() const { return no_grad_ > 0; }
  const Tensor<std::uint8_t>& key_padding_mask() const { return mask_; }
  void set_key_padding_mask(Tensor<std::uint8_t> mask) { mask_ = std::move(mask); }
  const attn_mask& attention_mask() const { return attn_; }
  // A boolean mask (nonzero = may attend) or an additive one; each replaces the other.
  void set_attention_mask(Tensor<std::uint8_t> allowed) { attn_ = {std::move(allowed), {}}; }
  void set_attention_mask(Tensor<float> bias) { attn_ = {{}, std::move(bias)}; }
  void clear_attention_mask() { attn_ = {}; }
  const Tensor<std::int64_t>& position_ids() const { return positions_; }
  void set_position_ids(Tensor<std::int64_t> ids) { positions_ = std::move(ids); }
  // Hugging Face's logits_to_keep: a language model's head computes the logits of the last
  // this many positions only (0: all), as generation needs the last one alone.
  std::int64_t logits_to_keep() const { return logits_to_keep_; }
  void set_logits_to_keep(std::int64_t n) { logits_to_keep_ = n; }
  void set_step(std::uint64_t step) {
    o_.step = step;
    draws_ = 0;
  }

  // A fresh stream for each call within a step, in call order: forward runs the
  // same layers in the same order on every step, so masks are reproducible per
  // (seed, rank, step) and differ between ranks and between layers.
  counter_rng random_stream() {
    return counter_rng(o_.seed ^ (std::uint64_t(o_.rank) << 48), (o_.step << 20) + draws_++);
  }
  // How many streams this step has drawn; rewinding replays the same streams
  // (a checkpointed layer's recompute draws its dropout masks again).
  std::uint64_t draws() const { return draws_; }
  void rewind_draws(std::uint64_t n) { draws_ = n; }

 private:
  options o_{};
  std::uint64_t draws_ = 0;
  int no_grad_ = 0;
  Tensor<std::uint8_t> mask_;
  attn_mask attn_;
  Tensor<std::int64_t> positions_;
  std::int64_t logits_to_keep_ = 0;
};

// Exactly what a layer may use of its context; the Layer concept checks layers
// against it, so a layer that needs more than this does not model Layer.
struct context_archetype {
  template <class L, class X>
  auto forward(L& layer, const X& x) -> decltype(layer.forward(*this, x));
  template <class L, class DY>
  auto backward(L& layer, const DY& dy) -> decltype(layer.backward(*this, dy));
  bool training() const;
  counter_rng random_stream();
  const Tensor<std::uint8_t>& key_padding_mask() const;
  const attn_mask& attention_mask() const;
  const Tensor<std::int64_t>& position_ids() const;
  std::int64_t logits_to_keep() const;
};

}  // namespace shardlib::nn
