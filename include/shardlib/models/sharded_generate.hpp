// shardlib/models/sharded_generate.hpp — generate() on a sharded model: every rank
// calls it alike, its forwards run in eval (whatever mode the model was in, which it
// has again on return), and the ranks check that they agree: on the prompt and
// options before the first forward, on each position's tokens after it is picked.
// Ranks that disagree (another prompt or mask, another seed, other parameters) raise
// together, where they would otherwise generate apart and stop at different steps.
// A device model (shardlib/models/cuda.cuh) generates on the device: the prompt and
// the picked tokens go to it, the last position's logits come back each step.
//
//   auto sharded = shard::fully_shard(model, comm, shard::FullShard{}, {...});
//   auto out = models::generate(sharded, prompt, {.max_new_tokens = 64, .top_k = 40});
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/signature.hpp"       // invalid_call, what_of
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"          // fnv1a
#include "shardlib/io/rank_agreement.hpp"    // broadcast_string
#include "shardlib/io/staging.hpp"           // host_collectives_of
#include "shardlib/models/causal_lm.hpp"

#include <bit>          // std::bit_cast
#include <concepts>     // std::convertible_to
#include <cstdint>      // std::int64_t, std::uint64_t, std::uint8_t
#include <exception>    // std::exception_ptr
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::remove_cvref_t, std::remove_reference_t
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::models {

// A sharded engine (shard::ShardedModel) over a CausalLM.
template <class S>
concept ShardedCausalLM = requires(S& s, const S& cs, const Tensor<std::int64_t, typename S::space>& ids) {
  s.forward(ids);
  s.context().set_position_ids(Tensor<std::int64_t>{});
  s.context().set_key_padding_mask(Tensor<std::uint8_t>{});
  s.context().set_logits_to_keep(std::int64_t{1});
  { s.context().logits_to_keep() } -> std::convertible_to<std::int64_t>;
  s.comm();
  s.eval();
  s.train();
  { cs.training() } -> std::convertible_to<bool>;
  requires CausalLM<std::remove_cvref_t<decltype(s.model())>>;
};

namespace detail {

// A hash that any rank computes alike, kept non-negative so that its negation fits.
inline std::int64_t agreement_hash(std::string_view bytes) { return std::int64_t(fnv1a(bytes) >> 1); }

// The prompt and its attention mask.
inline std::int64_t prompt_hash(const Tensor<std::int64_t>& prompt, const Tensor<std::int64_t>& mask) {
  std::string bytes = cat(prompt.shape(), ":", mask.shape(), ":");
  for (const Tensor<std::int64_t>* t : {&prompt, &mask})
    bytes.append(reinterpret_cast<const char*>(t->data()), t->numel() * sizeof(std::int64_t));
  return agreement_hash(bytes);
}

inline std::int64_t options_hash(const generate_options& o) {
  std::string ends;
  for (const std::int64_t id : o.eos_token_id.ids) ends += cat(id, " ");
  return agreement_hash(cat(o.max_new_tokens, ",", o.top_k, ",", std::bit_cast<std::uint64_t>(o.temperature), ",",
                            std::bit_cast<std::uint64_t>(o.top_p), ",", std::bit_cast<std::uint64_t>(o.min_p), ",",
                            std::bit_cast<std::uint64_t>(o.repetition_penalty), ",", o.seed, ",", o.use_cache, ",",
                            ends, ",", o.pad_token_id ? cat(*o.pad_token_id) : "none"));
}

// Runs f(), then one all-reduce (max) of each value of `mine` (which f may fill), its
// negation, and a failure flag: every rank learns whether all hold the same values and
// none failed, and raises alike if not. The rank whose f threw raises its own message,
// the others the lowest failing rank's. `differ(i, lowest, highest)` is the message when
// value i differs between ranks. Values must be >= 0 (token ids, agreement_hash).
template <class Comm, class F, class Differ>
void require_same_on_ranks(Comm& comm, F&& f, std::span<const std::int64_t> mine, Differ&& differ) {
  const std::exception_ptr thrown = comm::detail::invalid_call(f);
  const bool failed = bool(thrown);
  const std::string failure = failed ? comm::detail::what_of(thrown) : "";
  const std::size_t n = mine.size();
  std::vector<std::int64_t> v(2 * n + 1);
  for (std::size_t i = 0; i < n && !failed; ++i) {
    v[i] = mine[i];
    v[n + i] = -mine[i];
  }
  v[2 * n] = failed ? std::int64_t(comm.size() - comm.rank()) : 0;
  comm.all_reduce(std::span<std::int64_t>(v), comm::reduce_op::max);
  const int r = comm.rank();
  if (v[2 * n] != 0) {
    const int first = comm.size() - int(v[2 * n]);
    const std::string message = io::detail::broadcast_string(comm, failure, first);
    if (failed) throw error(cat("rank ", r, ": ", failure));
    throw error(cat("rank ", r, ": generate stopped because rank ", first, " failed: ", message));
  }
  for (std::size_t i = 0; i < n; ++i)
    if (v[i] != -v[n + i]) throw error(cat("rank ", r, ": ", differ(i, -v[n + i], v[i])));
}

}  // namespace detail

// generate() (models/causal_lm.hpp) on a sharded model, collective: see the header. In
// training mode it calls eval() first, which forgets a forward still waiting for its
// backward (that backward then raises), and train() on return.
template <ShardedCausalLM S>
Tensor<std::int64_t> generate(S& sharded, const Tensor<std::int64_t>& prompt, const generate_options& o = {}) {
  auto comm = io::detail::host_collectives_of(sharded);
  // What generate checks before its first forward depends on these alone.
  const std::int64_t facts[] = {detail::prompt_hash(prompt, o.attention_mask), detail::options_hash(o),
                                std::int64_t(sharded.model().max_positions())};
  detail::require_same_on_ranks(
      comm, [] {}, facts, [](std::size_t i, std::int64_t lo, std::int64_t hi) {
        constexpr const char* what[] = {"prompts (or attention masks)", "options", "models (max_positions)"};
        return cat("generate: the ranks passed different ", what[i], i == 2 ? cat(", ", lo, " to ", hi) : "",
                   "; every rank of a sharded model must call it alike");
      });

  struct mode_scope {  // training mode again however this returns
    explicit mode_scope(S& s) : s_(&s), training_(s.training()) {
      if (training_) s.eval();
    }
    mode_scope(const mode_scope&) = delete;
    mode_scope& operator=(const mode_scope&) = delete;
    ~mode_scope() {
      if (training_) s_->train();
    }
    S* s_;
    bool training_;
  } mode(sharded);

  const auto agree = [&](auto&& pick_rows, std::span<std::int64_t> tokens, std::int64_t t) {
    detail::require_same_on_ranks(comm, pick_rows, tokens, [&](std::size_t row, std::int64_t lo, std::int64_t hi) {
      return cat("generate: the ranks picked different tokens for row ", row, " at position ", t, " (ids ", lo,
                 " to ", hi, "): their logits differ; every rank needs the same parameters");
    });
  };
  // The padding and logits_to_keep go to the engine's context for each forward; its own are
  // back on return.
  using context = std::remove_reference_t<decltype(sharded.context())>;
  context& ctx = sharded.context();
  struct padding_scope {
    explicit padding_scope(context& c)
        : c_(&c), positions_(c.position_ids()), keys_(c.key_padding_mask()), keep_(c.logits_to_keep()) {}
    padding_scope(const padding_scope&) = delete;
    padding_scope& operator=(const padding_scope&) = delete;
    ~padding_scope() {
      c_->set_position_ids(std::move(positions_));
      c_->set_key_padding_mask(std::move(keys_));
      c_->set_logits_to_keep(keep_);
    }
    context* c_;
    Tensor<std::int64_t> positions_;
    Tensor<std::uint8_t> keys_;
    std::int64_t keep_;
  } padding(ctx);
  auto forward = [&](const Tensor<std::int64_t>& ids, const generate_inputs& in) {
    ctx.set_position_ids(in.position_ids);
    ctx.set_key_padding_mask(in.key_padding_mask);
    ctx.set_logits_to_keep(in.logits_to_keep);
    return sharded.forward(detail::generate_io<typename S::space>::ids(ids));
  };
  return detail::generate(sharded.model(), forward, prompt, o, agree);
}

}  // namespace shardlib::models
