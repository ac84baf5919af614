// shardlib/models/causal_lm.hpp — what the decoder language models (models/gpt2.hpp,
// models/llama.hpp) share: the LM head (owned or tied to the token embedding), the
// shifted next-token targets Hugging Face's loss uses, and generation (greedy, top-k
// or top-p, of left-padded batches too) with the attention layers' KV cache, on the
// host or on a device (the ids go to the model's memory space, the last position's
// logits come back).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/grad_mode.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/param.hpp"
#include "shardlib/nn/tied_linear.hpp"

#include <algorithm>    // std::copy_n, std::find, std::partial_sort, std::rotate
#include <cmath>        // std::exp, std::isnan, INFINITY
#include <concepts>     // std::convertible_to, std::invocable, std::same_as
#include <cstdint>      // std::int64_t, std::uint64_t, std::uint8_t
#include <functional>   // std::function
#include <initializer_list>  // std::initializer_list
#include <numeric>      // std::iota
#include <optional>     // std::optional, std::nullopt_t
#include <span>         // std::span
#include <type_traits>  // std::conditional_t, std::is_floating_point_v, std::remove_cvref_t
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::models {

namespace detail {
// How generate moves host ids to a model in Space and brings the logits it picks
// from back, and how the head takes the last positions of hidden states: on the
// host nothing moves; cuda_space's is in models/cuda.cuh.
template <class Space>
struct generate_io;
}  // namespace detail

// `lm_head`: logits = h W^T, no bias, W [vocab, hidden] — the model's own
// parameter, or the token embedding's (tied: Hugging Face's tie_word_embeddings,
// GPT-2's default), listed as "weight" either way so the state dict names both.
// A leaf layer: it runs its Linear or TiedLinear itself. With cuda_space both
// are the device's (nn/cuda/linear.cuh, nn/cuda/tied_linear.cuh): the tied head's
// product reads the embedding's device weight and adds into its gradient. With the
// context's logits_to_keep k > 0 (inference only), h [batch, seq, hidden] gives the
// logits of its last k positions, [batch, k, vocab].
template <class T, class Space = host_space>
class LMHead {
 public:
  using input = Tensor<T, Space>;
  using output = Tensor<T, Space>;

  LMHead(std::int64_t hidden, std::int64_t vocab, bool tied) : own_(hidden, vocab, false), tied_(hidden, vocab), is_tied_(tied) {}

  bool tied() const { return is_tied_; }
  // Points a tied head at the embedding's weight (again after every copy or move
  // of the model: TiedLinear drops its tie when copied).
  void tie(nn::Param<T>& embedding) {
    require(is_tied_, "lm_head: tie() on a head that owns its weight (tie_word_embeddings is false)");
    tied_.tie(embedding);
  }
  // The owned weight (untied heads only), for its init rule.
  nn::Param<T>& own_weight() { return own_.weight; }

  template <class V>
  void parameters(V&& v) {
    if (is_tied_) tied_.parameters(v);
    else own_.parameters(v);
  }
  template <class V>
  void borrowed_parameters(V&& v) {
    if (is_tied_) tied_.borrowed_parameters(v);
  }

  template <class Ctx>
  output forward(Ctx& ctx, const input& h) {
    const std::int64_t keep = ctx.logits_to_keep();
    require(keep >= 0, "lm_head: logits_to_keep must be >= 0, got ", keep);
    if (keep == 0 || h.rank() != 3 || keep >= h.dim(1)) return is_tied_ ? tied_.forward(ctx, h) : own_.forward(ctx, h);
    // Refused in training too: a checkpointed head's first forward runs without gradients
    // and its recompute with them.
    require(!ctx.training() && !nn::grad_enabled(ctx), "lm_head: logits_to_keep (", keep,
            ") is for inference: a backward would need every position's logits (run the forward in eval, under "
            "no_grad)");
    const input last = detail::generate_io<Space>::last_positions(h, keep);
    return is_tied_ ? tied_.forward(ctx, last) : own_.forward(ctx, last);
  }
  template <class Ctx>
  input backward(Ctx& ctx, const output& dy) {
    return is_tied_ ? tied_.backward(ctx, dy) : own_.backward(ctx, dy);
  }

 private:
  nn::Linear<T, Space> own_;
  nn::TiedLinear<T, Space> tied_;
  bool is_tied_;
};

// Hugging Face's causal-LM loss compares logits[:, t] with labels[:, t + 1]
// (the model shifts inside): the targets for nn::cross_entropy over logits
// [batch, seq, vocab] are labels shifted left by one, the last position ignored.
inline Tensor<std::int64_t> causal_lm_targets(const Tensor<std::int64_t>& labels, std::int64_t ignore_index = -100) {
  require<shape_error>(labels.rank() == 2, "causal_lm_targets: labels must be [batch, seq], got ", labels.shape());
  const std::int64_t B = labels.dim(0), S = labels.dim(1);
  Tensor<std::int64_t> t(labels.shape());
  for (std::int64_t n = 0; n < B; ++n) {
    for (std::int64_t s = 0; s + 1 < S; ++s) t[n * S + s] = labels[n * S + s + 1];
    if (S > 0) t[n * S + S - 1] = ignore_index;
  }
  return t;
}

// A decoder language model generate() can drive: token ids [batch, seq] in,
// logits [batch, seq, vocab] out (in the model's memory space), and a KV cache in
// every attention layer.
template <class M>
concept CausalLM = nn::Layer<M> &&
                   std::same_as<typename M::input, Tensor<std::int64_t, typename M::output::space>> &&
                   requires(M& m, const M& cm, std::int64_t n) {
                     m.enable_kv_cache(n);
                     m.disable_kv_cache();
                     { cm.max_positions() } -> std::convertible_to<std::int64_t>;
                   };

// The tokens that end a row, as transformers' eos_token_id: none, one id, or several
// (Llama 3.1's instruct models end at any of three; a config's token_ids::eos).
struct end_tokens {
  std::vector<std::int64_t> ids{};

  end_tokens() = default;
  end_tokens(std::nullopt_t) {}             // none, as the std::optional this option once was
  end_tokens(std::int64_t id) : ids{id} {}  // implicit: .eos_token_id = 2
  end_tokens(std::vector<std::int64_t> several) : ids(std::move(several)) {}
  end_tokens(std::initializer_list<std::int64_t> several) : ids(several) {}

  bool empty() const { return ids.empty(); }
  bool contains(std::int64_t token) const { return std::find(ids.begin(), ids.end(), token) != ids.end(); }
};

struct generate_options {
  std::int64_t max_new_tokens = 32;
  std::int64_t top_k = 0;    // k: sample among the k most likely (0: no such limit)
  double temperature = 1.0;  // sampling divides the logits by it before the softmax
  // Sample among the most likely tokens whose probabilities (after top-k) reach top_p, as
  // transformers' top_p. With top_k 0 and top_p 1 generation is greedy (the most likely
  // token); transformers' do_sample=True samples with top_k 50 unless told otherwise, and
  // the whole softmax is top_k = the vocabulary's size here.
  double top_p = 1.0;
  // Then drop the tokens less likely than min_p times the most likely one, as transformers'
  // min_p (0: off). With top_k 0, top_p 1 and min_p 0 generation is greedy.
  double min_p = 0.0;
  // Before all of that, and in greedy generation too: the logit z of every token already in
  // the row (its prompt from its first token on, and what it generated) becomes z / penalty,
  // or z * penalty where negative, in float32 at least, as transformers' repetition_penalty
  // (1: off).
  double repetition_penalty = 1.0;
  std::uint64_t seed = 0;    // sampling's draws: (seed, row, position), the same on every rank and for any max_new_tokens
  bool use_cache = true;     // false: every token by a forward over the whole sequence so far
  // A row that picks one of these tokens has ended: its later tokens are pad_token_id (without
  // one, the first of these), and generation stops once every row has ended (the result then
  // has fewer than max_new_tokens new tokens), as transformers' eos_token_id and pad_token_id.
  end_tokens eos_token_id{};
  std::optional<std::int64_t> pad_token_id = std::nullopt;
  // A padded prompt's mask, as transformers' attention_mask: [batch, prompt_len], 1 = a
  // token, 0 = padding. Rows are padded on the left (each row's last position is a token:
  // generation continues from it). Padding is masked as a key and counts for no position,
  // so a row's greedy tokens are those it gets alone; sampling's draws are keyed by the
  // row's index and its own positions. Empty: every prompt position is a token.
  Tensor<std::int64_t> attention_mask{};
  // Called after each step with the batch's new tokens (an ended row's filler) and their
  // position in the rows, as transformers' streamer: print tokens as they come, or stop
  // by throwing. On a sharded model every rank calls it.
  std::function<void(std::span<const std::int64_t> tokens, std::int64_t position)> on_tokens{};
};

// What one forward of generate() takes besides the ids, for its context (nn::context's
// position_ids, key_padding_mask and logits_to_keep): when the prompt has padding
// (generate_options::attention_mask), the ids' positions [batch, ids] and which keys,
// cached ones first, are padding [batch, keys] (both empty without padding); and that
// only the last position's logits are read (the prompt's forward computes no others).
struct generate_inputs {
  Tensor<std::int64_t> position_ids;
  Tensor<std::uint8_t> key_padding_mask;
  std::int64_t logits_to_keep = 1;
};

namespace detail {
template <>
struct generate_io<host_space> {
  static Tensor<std::int64_t> ids(const Tensor<std::int64_t>& ids) { return ids; }
  template <class T>
  static Tensor<T> logits(const Tensor<T>& logits) {
    return logits;
  }
  // h [batch, seq, hidden]'s last `keep` positions, [batch, keep, hidden].
  template <class T>
  static Tensor<T> last_positions(const Tensor<T>& h, std::int64_t keep) {
    const std::int64_t B = h.dim(0), S = h.dim(1), D = h.dim(2);
    Tensor<T> last({B, keep, D});
    for (std::int64_t n = 0; n < B; ++n)
      std::copy_n(h.data() + (n * S + S - keep) * D, keep * D, last.data() + n * keep * D);
    return last;
  }
};

// The token chosen from one row of logits: the first maximum (greedy), or a draw
// u in [0, 1) against the softmax of the k largest and every token tied with the
// k-th, as transformers' top-k keeps them (in order of logit, then id), then of the
// nucleus of those: top-p drops, from the least likely up (of tied ones, the lowest
// id first), the tokens whose probabilities sum to at most 1 - top_p, as transformers'
// TopPLogitsWarper (which sums in float32, this in double: an exact boundary may fall
// the other way), then min-p drops those less likely than min_p times the first. A NaN
// logit has no order and a row whose largest logit is -inf no softmax: both raise,
// naming the row and position; a +inf logit has all the probability (the first, if several).
template <class T>
std::int64_t pick_token(const T* z, std::int64_t vocab, const generate_options& o, double u, std::int64_t row = 0,
                        std::int64_t position = 0) {
  for (std::int64_t i = 0; i < vocab; ++i)
    require(!std::isnan(double(z[i])), "generate: the logit of token ", i, " is NaN (row ", row, ", position ",
            position, ")");
  const std::int64_t best = std::int64_t(std::max_element(z, z + vocab) - z);
  require(double(z[best]) > -INFINITY, "generate: every logit is -inf (row ", row, ", position ", position,
          "): no token can follow");
  if ((o.top_k == 0 && o.top_p >= 1 && o.min_p <= 0) || double(z[best]) == INFINITY) return best;
  const double top = double(z[best]);
  const auto weight = [&](std::int64_t i) { return std::exp((double(z[i]) - top) / o.temperature); };
  const auto before = [&](std::int64_t a, std::int64_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); };
  std::vector<std::int64_t> ids;
  double tail = 0;  // the weight top-p drops from the least likely up (of tokens left out of ids)
  if (o.top_k == 0 || o.top_k >= vocab) {
    // The whole vocabulary. The tokens whose weight is below (1 - top_p) / 2 of the mean
    // sum to less than half of what top-p drops, and they are the least likely: top-p
    // drops them all, so only the rest is sorted (a trained model's nucleus is a few
    // hundred tokens of 128k). The halving keeps the rounding of the sums off the cut.
    // Min-p drops those below min_p (weights are relative to the largest), whatever top-p
    // keeps; their weight still counts in top-p's sums.
    std::vector<double> all_w(static_cast<std::size_t>(vocab));
    double all = 0;
    for (std::int64_t i = 0; i < vocab; ++i) all += all_w[std::size_t(i)] = weight(i);
    const double floor = std::max(o.top_p < 1 ? (1 - o.top_p) * all / double(2 * vocab) : 0.0, o.min_p);
    for (std::int64_t i = 0; i < vocab; ++i)
      if (const double w = all_w[std::size_t(i)]; w >= floor)
        ids.push_back(i);
      else
        tail += w;
    std::sort(ids.begin(), ids.end(), before);
  } else {
    // The k largest and every token tied with the k-th.
    ids.resize(static_cast<std::size_t>(vocab));
    std::iota(ids.begin(), ids.end(), std::int64_t(0));
    std::partial_sort(ids.begin(), ids.begin() + o.top_k, ids.end(), before);
    const T kth = z[ids[std::size_t(o.top_k - 1)]];
    const auto tied_end = std::partition(ids.begin() + o.top_k, ids.end(), [&](std::int64_t i) { return z[i] == kth; });
    std::sort(ids.begin() + o.top_k, tied_end);
    ids.erase(tied_end, ids.end());
  }
  std::int64_t kept = std::int64_t(ids.size());
  std::vector<double> w(ids.size());
  double sum = tail;
  for (std::int64_t i = 0; i < kept; ++i) sum += w[std::size_t(i)] = weight(ids[std::size_t(i)]);
  if (o.top_p < 1) {
    const std::int64_t all = kept;
    for (std::int64_t i = kept - 1; i > 0 && (tail += w[std::size_t(i)]) <= (1 - o.top_p) * sum; --i) kept = i;
    // A cut through tied logits keeps the tied tokens of highest id, as transformers' ascending
    // sort drops the lowest first; they take the run's first places, in order of id.
    std::int64_t first = kept - 1, last = kept;
    while (first > 0 && z[ids[std::size_t(first - 1)]] == z[ids[std::size_t(kept - 1)]]) --first;
    while (last < all && z[ids[std::size_t(last)]] == z[ids[std::size_t(kept - 1)]]) ++last;
    std::rotate(ids.begin() + first, ids.begin() + last - (kept - first), ids.begin() + last);
  }
  // Min-p: the weights are the probabilities over the largest's, in decreasing order.
  while (kept > 1 && w[std::size_t(kept - 1)] < o.min_p) --kept;
  sum = 0;
  for (std::int64_t i = 0; i < kept; ++i) sum += w[std::size_t(i)];
  double acc = 0;
  for (std::int64_t i = 0; i < kept; ++i)
    if (u * sum < (acc += w[std::size_t(i)])) return ids[std::size_t(i)];
  return ids[std::size_t(kept - 1)];  // u * sum rounded up to the total
}

// The positions and padding of a prompt with generate_options::attention_mask, and of
// the tokens generated after it, over all `total` positions of every row.
class padded_positions {
 public:
  padded_positions(const Tensor<std::int64_t>& mask, std::int64_t batch, std::int64_t prompt, std::int64_t total)
      : total_(total) {
    if (mask.empty()) return;
    require<shape_error>(mask.shape() == Shape{batch, prompt},
                         "generate: attention_mask must be shaped as the prompt, ", Shape{batch, prompt}, ", got ",
                         mask.shape());
    positions_ = Tensor<std::int64_t>({batch, total});
    padding_ = Tensor<std::uint8_t>::zeros({batch, total});
    first_.assign(static_cast<std::size_t>(batch), 0);
    for (std::int64_t n = 0; n < batch; ++n) {
      std::int64_t tokens = 0;  // before position j
      for (std::int64_t j = 0; j < total; ++j) {
        const std::int64_t m = j < prompt ? mask[n * prompt + j] : 1;
        require(m == 0 || m == 1, "generate: attention_mask holds ", m, " at row ", n, ", position ", j,
                "; it must be 1 (a token) or 0 (padding)");
        require(j + 1 != prompt || m == 1, "generate: row ", n, " of the prompt ends in padding (attention_mask 0 at ",
                "its last position); generation continues from each row's last position, so pad on the left");
        positions_[n * total + j] = m ? tokens : 0;  // padding's position is never used: 0 keeps it in range
        padding_[n * total + j] = std::uint8_t(1 - m);
        if (m == 1 && tokens == 0) first_[std::size_t(n)] = j;
        tokens += m;
      }
    }
  }

  // Row n's first token after its left padding (0 without a mask).
  std::int64_t first_token(std::int64_t n) const { return first_.empty() ? 0 : first_[std::size_t(n)]; }

  // Row n's position of token t: t without a mask, else the tokens before it.
  std::int64_t at(std::int64_t n, std::int64_t t) const { return positions_.empty() ? t : positions_[n * total_ + t]; }

  // A forward's inputs for the ids at positions [first, first + len) with `keys` keys.
  generate_inputs inputs(std::int64_t first, std::int64_t len, std::int64_t keys) const {
    if (positions_.empty()) return {};
    const std::int64_t B = positions_.dim(0);
    generate_inputs in{Tensor<std::int64_t>({B, len}), Tensor<std::uint8_t>({B, keys})};
    for (std::int64_t n = 0; n < B; ++n) {
      std::copy_n(positions_.data() + n * total_ + first, len, in.position_ids.data() + n * len);
      std::copy_n(padding_.data() + n * total_, keys, in.key_padding_mask.data() + n * keys);
    }
    return in;
  }

 private:
  std::int64_t total_;
  Tensor<std::int64_t> positions_;  // [batch, total], empty without a mask
  Tensor<std::uint8_t> padding_;    // [batch, total]: 1 = padding
  std::vector<std::int64_t> first_;  // [batch], empty without a mask
};

// generate()'s loop. `pick(pick_row, tokens, t)` runs pick_row(), which fills tokens
// (one per row, position t); the sharded overload wraps it to check that the ranks agree.
template <CausalLM M, class Forward, class Pick>
Tensor<std::int64_t> generate(M& model, Forward& forward, const Tensor<std::int64_t>& prompt,
                              const generate_options& o, Pick&& pick) {
  require<shape_error>(prompt.rank() == 2 && prompt.dim(0) > 0 && prompt.dim(1) > 0,
                       "generate: the prompt must be [batch, seq] token ids with both positive, got ", prompt.shape());
  require(o.max_new_tokens >= 0 && o.top_k >= 0 && o.temperature > 0 && o.top_p > 0 && o.top_p <= 1 &&
              o.min_p >= 0 && o.min_p <= 1 && o.repetition_penalty > 0,
          "generate: needs max_new_tokens >= 0, top_k >= 0, temperature > 0, top_p in (0, 1], min_p in [0, 1] and "
          "repetition_penalty > 0, got ",
          o.max_new_tokens, ", ", o.top_k, ", ", o.temperature, ", ", o.top_p, ", ", o.min_p, " and ",
          o.repetition_penalty);
  const std::int64_t B = prompt.dim(0), P = prompt.dim(1), total = P + o.max_new_tokens;
  require<shape_error>(total <= model.max_positions(), "generate: prompt (", P, ") + max_new_tokens (",
                       o.max_new_tokens, ") = ", total, " positions exceed the model's ", model.max_positions());
  Tensor<std::int64_t> out({B, total});
  for (std::int64_t n = 0; n < B; ++n) std::copy_n(prompt.data() + n * P, P, out.data() + n * total);
  const padded_positions padded(o.attention_mask, B, P, total);
  if (o.max_new_tokens == 0) return out;

  struct cache_scope {  // the cache is off again however this returns
    explicit cache_scope(M& m, std::int64_t capacity) : m_(&m) { m.enable_kv_cache(capacity); }
    cache_scope(const cache_scope&) = delete;
    cache_scope& operator=(const cache_scope&) = delete;
    ~cache_scope() { m_->disable_kv_cache(); }
    M* m_;
  };
  std::optional<cache_scope> scope;
  if (o.use_cache) scope.emplace(model, total);
  const counter_rng draws(o.seed, fnv1a("generate"));
  std::vector<bool> ended(static_cast<std::size_t>(B), false);
  // An ended row's later tokens.
  const std::int64_t filler = o.pad_token_id ? *o.pad_token_id : o.eos_token_id.empty() ? 0 : o.eos_token_id.ids[0];
  std::vector<std::int64_t> next(static_cast<std::size_t>(B));
  // A forward's logits, checked, where the picking reads them.
  const auto read = [&](const auto& logits) {
    require<shape_error>(logits.rank() == 3 && logits.dim(0) == B && logits.dim(1) > 0,
                         "generate: the model returned logits ", logits.shape(), " for ", B, " sequences");
    return generate_io<typename M::output::space>::logits(logits);
  };
  auto logits = read(forward(prompt, padded.inputs(0, P, P)));
  // Repetition penalty: on each row's tokens from its first real one (transformers'
  // prompt_ignore_length: its left padding is not penalised), the penalised logits in
  // float32 at least, as transformers' processors see them.
  using logit = std::remove_cvref_t<decltype(*logits.data())>;
  using math = std::conditional_t<std::is_floating_point_v<logit>, logit, float>;
  std::vector<math> penalised;
  std::vector<bool> seen;
  // The token row n picks at position t.
  const auto pick_row = [&](std::int64_t n, std::int64_t t) {
    const std::int64_t seq = logits.dim(1), vocab = logits.dim(2);
    const logit* z = logits.data() + (n * seq + seq - 1) * vocab;
    const double u = draws.uniform_double(std::uint64_t(n * model.max_positions() + padded.at(n, t)));
    if (o.repetition_penalty == 1) return pick_token(z, vocab, o, u, n, t);
    const math penalty = math(o.repetition_penalty);
    penalised.resize(static_cast<std::size_t>(vocab));
    for (std::int64_t i = 0; i < vocab; ++i) penalised[std::size_t(i)] = math(z[i]);
    seen.assign(static_cast<std::size_t>(vocab), false);
    for (std::int64_t j = padded.first_token(n); j < t; ++j) {
      const std::int64_t id = out[n * total + j];
      if (id < 0 || id >= vocab || seen[std::size_t(id)]) continue;  // transformers skips ids outside too
      seen[std::size_t(id)] = true;
      const math x = penalised[std::size_t(id)];
      penalised[std::size_t(id)] = x < 0 ? x * penalty : x / penalty;
    }
    return pick_token(penalised.data(), vocab, o, u, n, t);
  };
  for (std::int64_t t = P;; ++t) {
    const std::int64_t vocab = logits.dim(2);
    for (const std::int64_t id : o.eos_token_id.ids)
      require(id >= 0 && id < vocab, "generate: eos_token_id ", id, " is not a token of the model's ", vocab);
    require(!o.pad_token_id || (*o.pad_token_id >= 0 && *o.pad_token_id < vocab), "generate: pad_token_id ",
            o.pad_token_id.value_or(0), " is not a token of the model's ", vocab);
    pick(
        [&] {
          for (std::int64_t n = 0; n < B; ++n) next[std::size_t(n)] = ended[std::size_t(n)] ? filler : pick_row(n, t);
          // Here, where the sharded overload's check sees it: a callback that throws on
          // one rank makes every rank raise instead of leaving the others in a collective.
          if (o.on_tokens) o.on_tokens(std::span<const std::int64_t>(next), t);
        },
        std::span<std::int64_t>(next), t);
    bool all_ended = !o.eos_token_id.empty();
    for (std::int64_t n = 0; n < B; ++n) {
      const auto row = static_cast<std::size_t>(n);
      out[n * total + t] = next[row];
      ended[row] = ended[row] || o.eos_token_id.contains(next[row]);
      all_ended = all_ended && ended[row];
    }
    if (all_ended && t + 1 < total) {  // every row has ended: the tokens so far
      Tensor<std::int64_t> done({B, t + 1});
      for (std::int64_t n = 0; n < B; ++n) std::copy_n(out.data() + n * total, t + 1, done.data() + n * (t + 1));
      return done;
    }
    if (t + 1 == total) return out;
    const std::int64_t len = o.use_cache ? 1 : t + 1, first = o.use_cache ? t : 0;
    Tensor<std::int64_t> ids({B, len});
    for (std::int64_t n = 0; n < B; ++n) std::copy_n(out.data() + n * total + first, len, ids.data() + n * len);
    logits = read(forward(ids, padded.inputs(first, len, t + 1)));
  }
}
}  // namespace detail

// Continues every prompt row [batch, prompt_len] by max_new_tokens tokens and
// returns prompt and continuation [batch, prompt_len + max_new_tokens] (fewer new
// tokens when every row has reached one of eos_token_id; it and pad_token_id are checked
// against the vocabulary of the logits). `forward` maps host ids to logits (on the host
// or in the model's space) in inference mode: ctx.training() false (a plain
// context, or a sharded model's forward in eval), so dropout is off and the KV
// cache may be used. With the cache, the prompt runs once and each new token alone (its
// position after the cached ones); the cache is disabled again on return, also
// when forward throws. On a sharded model every rank must call this alike (same
// prompt and options), each forward gathering units collectively; the overload for
// sharded models (models/sharded_generate.hpp) checks that they do and that they pick
// the same tokens, so that they stop together.
template <CausalLM M, class Forward>
  requires std::invocable<Forward&, const Tensor<std::int64_t>&> ||
           std::invocable<Forward&, const Tensor<std::int64_t>&, const generate_inputs&>
Tensor<std::int64_t> generate(M& model, Forward&& forward, const Tensor<std::int64_t>& prompt,
                              const generate_options& o = {}) {
  const auto unchecked = [](auto&& pick, std::span<std::int64_t>, std::int64_t) { pick(); };
  if constexpr (std::invocable<Forward&, const Tensor<std::int64_t>&, const generate_inputs&>) {
    return detail::generate(model, forward, prompt, o, unchecked);
  } else {
    require(o.attention_mask.empty(), "generate: a prompt with an attention_mask needs a forward that takes ",
            "(ids, const generate_inputs&) and sets its context's position ids and key padding mask from them");
    auto ids_only = [&](const Tensor<std::int64_t>& ids, const generate_inputs&) { return forward(ids); };
    return detail::generate(model, ids_only, prompt, o, unchecked);
  }
}

// generate() on an unsharded model: forwards in a plain context, not training and
// without gradients (layers keep no activations, as under torch.no_grad()). A
// device model (include shardlib/models/cuda.cuh) takes the ids in device memory,
// and each step copies the last position's logits back, on the current stream,
// raising the Embedding's error for a bad id there.
template <CausalLM M>
Tensor<std::int64_t> generate(M& model, const Tensor<std::int64_t>& prompt, const generate_options& o = {}) {
  nn::context ctx({.training = false});
  return generate(
      model,
      [&](const Tensor<std::int64_t>& ids, const generate_inputs& padding) {
        ctx.set_position_ids(padding.position_ids);
        ctx.set_key_padding_mask(padding.key_padding_mask);
        ctx.set_logits_to_keep(padding.logits_to_keep);
        const auto in = detail::generate_io<typename M::output::space>::ids(ids);
        return ctx.no_grad([&] { return ctx.forward(model, in); });
      },
      prompt, o);
}

}  // namespace shardlib::models
