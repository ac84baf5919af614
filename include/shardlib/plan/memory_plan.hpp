// shardlib/plan/memory_plan.hpp — what one rank holds and sends per training step under
// each sharding strategy, from a model's unit sizes: the formulas the memory ledger is
// tested against (derivation and worked example in docs/planner.md).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"     // dtype, size_of
#include "shardlib/core/error.hpp"       // require
#include "shardlib/core/ledger.hpp"      // category
#include "shardlib/shard/precision.hpp"  // shard::mixed_precision
#include "shardlib/shard/strategy.hpp"   // the strategy tags

#include <algorithm>    // std::max, std::min
#include <cstddef>      // std::size_t
#include <numeric>      // std::accumulate
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <optional>     // std::optional
#include <vector>       // std::vector

namespace shardlib::plan {

// The strategies as values, so one program can plan them all.
enum class strategy { no_shard, shard_optimizer, shard_grad_op, full_shard, hybrid_shard };
inline constexpr strategy all_strategies[] = {strategy::no_shard, strategy::shard_optimizer, strategy::shard_grad_op,
                                              strategy::full_shard, strategy::hybrid_shard};

// The shard:: tag's name.
constexpr std::string_view name(strategy s) {
  switch (s) {
    case strategy::no_shard:
      return "NoShard";
    case strategy::shard_optimizer:
      return "ShardOptimizer";
    case strategy::shard_grad_op:
      return "ShardGradOp";
    case strategy::full_shard:
      return "FullShard";
    case strategy::hybrid_shard:
      return "HybridShard";
  }
  return "?";
}
// What DeepSpeed and PyTorch call it.
constexpr std::string_view alias(strategy s) {
  switch (s) {
    case strategy::no_shard:
      return "DDP";
    case strategy::shard_optimizer:
      return "ZeRO-1";
    case strategy::shard_grad_op:
      return "ZeRO-2";
    case strategy::full_shard:
      return "ZeRO-3/FSDP";
    case strategy::hybrid_shard:
      return "HSDP";
  }
  return "?";
}

// The policy of the library's strategy `s` (HybridShard with groups of `group`).
constexpr shard::policy policy_of(strategy s, int group = 0) {
  switch (s) {
    case strategy::no_shard:
      return shard::NoShard{}.policy();
    case strategy::shard_optimizer:
      return shard::ShardOptimizer{}.policy();
    case strategy::shard_grad_op:
      return shard::ShardGradOp{}.policy();
    case strategy::full_shard:
      return shard::FullShard{}.policy();
    case strategy::hybrid_shard:
      return shard::HybridShard{.group_size = group}.policy();
  }
  return {};
}

// Master parameters, gradient shards and the communication scratch copies are float
// (ShardedModel<Model, Comm, Strategy, float>, the only type mixed precision allows).
inline constexpr std::size_t master_bytes = 4;
// Optimizer state per parameter the optimizer steps: Adam and AdamW keep two fp32
// moments (three with amsgrad); SGD keeps a momentum buffer, or nothing.
inline constexpr std::size_t adam_state_bytes = 8, adam_amsgrad_state_bytes = 12, sgd_momentum_state_bytes = 4,
                             sgd_state_bytes = 0;

// shard::mixed_precision's two dtypes and the layers' own: the same three on every
// memory space (docs/design.md, "Precision").
struct precision {
  dtype param = dtype::f32;    // parameters are gathered in it and rounded to it (FSDP's param_dtype)
  dtype reduce = dtype::f32;   // gradient reduction dtype
  dtype compute = dtype::f32;  // the layers' element type: their values and full (unreduced) gradients

  // Layers of float: whatever the engine communicates in, they compute in fp32.
  static constexpr precision fp32_layers(shard::mixed_precision p) { return {p.param, p.reduce, dtype::f32}; }
  // Layers of the param dtype (a bfloat16 or half model): they compute in it.
  static constexpr precision param_layers(shard::mixed_precision p) { return {p.param, p.reduce, p.param}; }
};

struct setup {
  // A strategy's own policy (any ShardingStrategy: `.policy = MyStrategy{}.policy()`);
  // when set, `strategy` and `group` are not read.
  std::optional<shard::policy> policy{};
  plan::strategy strategy = strategy::full_shard;
  int world = 1;
  int group = 0;     // HybridShard: the ranks one replica is sharded over (divides world)
  int prefetch = 1;  // shard::options::prefetch
  plan::precision precision{};
  std::size_t optimizer_bytes = adam_state_bytes;
  bool offload = false;  // shard::options::offload: see rank_plan::offloaded
  bool global_loss = true;  // shard::step_options::loss is loss_report::global_mean (train_step's default)

  shard::policy resolved() const { return policy ? *policy : policy_of(strategy, group); }
  // Ranks one shard is split over: the world, or the policy's group.
  int shard_group() const { return resolved().group(world); }
};

// A model as the planner sees it. Units are the root's descendants run one after
// another (none nested in another, as a wrap policy over a Stack's layers gives).
struct model_desc {
  // Flat elements of each unit (alignment gaps included, padding to the world not):
  // the root first, then the other units in forward order.
  std::vector<std::size_t> units;
  // Peak activations of one rank's local batch: no strategy changes them. With
  // activation checkpointing, the peak measure_activations(model, checkpoint, run) gives.
  std::size_t activation_bytes = 0;
  double flops = 0;  // forward + backward of one rank's local batch (the chooser's compute time)

  std::size_t parameters() const { return std::accumulate(units.begin(), units.end(), std::size_t(0)); }
};

// Per-rank peak bytes, category by category, as ledger::peak(category) reports them.
struct rank_memory {
  std::size_t parameters = 0, gradients = 0, optimizer_state = 0, gathered_parameters = 0, activations = 0,
              comm_scratch = 0;

  // The sum of the category peaks. Categories peak at different moments (gathered
  // parameters at the end of forward, gradients in backward), so this bounds the
  // ledger's peak() from above rather than equalling it.
  std::size_t total() const {
    return parameters + gradients + optimizer_state + gathered_parameters + activations + comm_scratch;
  }
  std::size_t operator[](category c) const {
    const std::size_t all[] = {parameters, gradients, optimizer_state, gathered_parameters, activations, comm_scratch};
    return all[static_cast<int>(c)];
  }
};

// Bytes one rank sends per step, by collective, under the ring algorithms of
// nccl-tests: with n ranks an all-gather sends (n-1)/n of its output, a
// reduce-scatter (n-1)/n of its input, an all-reduce 2(n-1)/n of its buffer.
struct traffic {
  double all_gather = 0, reduce_scatter = 0, all_reduce = 0;
  double exposed = 0;  // the part no computation hides (already counted above)
  double total() const { return all_gather + reduce_scatter + all_reduce; }
};

struct rank_plan {
  rank_memory memory;  // in the model's memory space (ledger::peak)
  // With setup::offload, in the offload space (ledger::offload().peak): the master
  // pieces, their reduced gradients' copies, the optimizer state and, for 16-bit
  // layers, the pieces rounded to their dtype on the way back. All persistent.
  rank_memory offloaded;
  traffic sent;
};

namespace detail {
inline std::size_t round_up(std::size_t n, std::size_t k) { return (n + k - 1) / k * k; }

// The largest sum of `width` consecutive non-root units (fewer if there are fewer).
inline std::size_t widest(const std::vector<std::size_t>& padded, std::size_t width) {
  const std::size_t n = padded.size() - 1;
  width = std::min(width, n);
  std::size_t best = 0;
  for (std::size_t first = 1; first + width <= n + 1; ++first) {
    std::size_t sum = 0;
    for (std::size_t k = first; k < first + width; ++k) sum += padded[k];
    best = std::max(best, sum);
  }
  return best;
}

// Peak comm_scratch of one step. Unit i's all-gather may send from a scratch copy
// (send[i] bytes, 0 for none), held until the gather is waited for; its reduction
// may need a scratch (reduce[i] bytes), held until the next unit's reduction is
// issued. Both depend on how gathers and reductions interleave, so this replays
// the engine's order (sharded_model.hpp: pre_forward/post_forward/pre_backward/post_backward).
inline std::size_t scratch_peak(const std::vector<std::size_t>& send, const std::vector<std::size_t>& reduce_bytes,
                                int prefetch, bool frees_after_forward) {
  const int n = int(send.size());  // position 0 is the root
  enum class state { sharded, gathering, gathered };
  std::vector<state> st(n, state::sharded);
  std::size_t now = 0, peak = 0, reducing = 0;
  auto add = [&](std::size_t b) { peak = std::max(peak, now += b); };
  auto issue = [&](int i) {
    if (st[i] != state::sharded) return;
    add(send[i]);
    st[i] = state::gathering;
  };
  auto ensure = [&](int i) {
    issue(i);
    if (st[i] == state::gathering) now -= send[i];
    st[i] = state::gathered;
  };
  auto prefetch_from = [&](int i, int dir) {
    for (int k = 1; k <= prefetch && i + dir * k >= 0 && i + dir * k < n; ++k) issue(i + dir * k);
  };
  auto reduce = [&](int i) {  // the previous reduction is finished first
    now -= reducing;
    reducing = reduce_bytes[i];
    add(reducing);
  };
  for (int i = 0; i < n; ++i) {
    ensure(i);
    prefetch_from(i, +1);
    if (frees_after_forward && i > 0) st[i] = state::sharded;
  }
  for (int i = n - 1; i >= 1; --i) {  // the root's backward hook ran first: it stays gathered
    ensure(i);
    prefetch_from(i, -1);
    st[i] = state::sharded;
    reduce(i);
  }
  reduce(0);
  return peak;
}
}  // namespace detail

// Why the engine (ShardedModel's constructor) refuses the setup, or "" when it runs
// it: 16-bit compute keeps fp32 masters beside the 16-bit values, which only a policy
// that shards optimizer state splits, and reduces in fp32 or the compute dtype.
// make_plan still gives such a setup's formula (the ZeRO paper's baseline is one).
inline std::string engine_refusal(const setup& s) {
  const dtype c = s.precision.compute;
  if (c == dtype::f32) return "";
  if (!s.resolved().shard_optimizer)
    return cat(name(c), " compute keeps fp32 masters beside the values, which a policy that does not shard "
               "optimizer state cannot hold (use ShardOptimizer and up)");
  if (s.precision.reduce != dtype::f32 && s.precision.reduce != c)
    return cat("with ", name(c), " compute the reduction is in F32 or ", name(c), ", not ", name(s.precision.reduce));
  return "";
}

// The plan of one rank for one train_step (zero_grad, forward, backward, step; no
// gradient accumulation) after the first, which records the order and runs no
// prefetch (so it never holds more), read off the strategy's policy alone. P_i is
// unit i padded to a multiple of the shard group G (the world W when the policy has
// no groups); ΣP their sum; master and optimizer state are split into N pieces (N = G
// when the policy shards optimizer state, else 1); sizes in bytes: master m = 4,
// compute c, param dtype g, reduce dtype r, optimizer state o per parameter.
//
// 16-bit compute (precision::param_layers) keeps each piece's 16-bit copy beside the
// master and gathers it directly (no send scratch); in fp32 reductions a unit's full
// gradients are widened into an fp32 scratch (4·P_i), in 16-bit reductions they land
// in a 16-bit piece. Replicated fp32 values with fp32 gathers hold the master itself.
inline rank_plan make_plan(const model_desc& d, const setup& s) {
  require(!d.units.empty(), "plan: the model has no units (the root is always one)");
  require(s.world >= 1 && s.prefetch >= 0, "plan: world ", s.world, " and prefetch ", s.prefetch,
          " must be at least 1 and 0");
  const shard::policy pol = s.resolved();
  require(pol.valid(), "plan: the strategy's policy: ", pol.problem() ? pol.problem() : "");
  require(pol.group_size == 0 || s.world % pol.group_size == 0, "plan: HybridShard group size ", pol.group_size,
          " must divide the world size ", s.world);
  const bool sharded = pol.shard_parameters;
  const std::size_t W = std::size_t(s.world), G = std::size_t(pol.group(s.world)),
                    N = pol.shard_optimizer ? G : 1;
  std::vector<std::size_t> padded;
  for (std::size_t n : d.units) padded.push_back(detail::round_up(n, G));
  const std::size_t all = std::accumulate(padded.begin(), padded.end(), std::size_t(0));
  const std::size_t m = master_bytes, c = size_of(s.precision.compute), o = s.optimizer_bytes;
  const double g = double(size_of(s.precision.param)), r = double(size_of(s.precision.reduce));
  const bool narrow_param = s.precision.param != dtype::f32, narrow_reduce = s.precision.reduce != dtype::f32;
  const bool compute16 = s.precision.compute != dtype::f32;
  require(!compute16 || s.precision.compute == s.precision.param, "plan: layers computing in ",
          name(s.precision.compute), " gather in that dtype, not ", name(s.precision.param));
  const bool master_in_values = !sharded && !compute16 && !narrow_param;

  rank_plan p;
  rank_memory& mem = p.memory;
  mem.activations = d.activation_bytes;
  // Persistent: the master pieces (unless the values hold them), their 16-bit
  // copies, the optimizer state of the pieces, the reduced gradients of the pieces.
  // Offloaded, the optimizer's side moves to the offload space; the model's space keeps
  // the parameters layers need: the fp32 piece (fp32 layers) or its 16-bit copy.
  const std::size_t copy16 = compute16 && pol.shard_optimizer ? c * all / N : 0;
  mem.parameters = (master_in_values ? c * all : s.offload && compute16 ? 0 : m * all / N) + copy16;
  mem.optimizer_state = s.offload ? 0 : o * all / N;
  if (s.offload) p.offloaded = {.parameters = m * all / N + copy16, .gradients = m * all / N, .optimizer_state = o * all / N};
  if (sharded) {
    // Gathered: the root all step, plus the unit running and the `prefetch` after
    // it — or every unit, none freed between forward and backward.
    const std::size_t held = pol.free == shard::free_point::after_backward
                                 ? all
                                 : padded[0] + detail::widest(padded, 1 + std::size_t(s.prefetch));
    mem.gathered_parameters = c * held;
  } else {
    mem.gathered_parameters = master_in_values ? 0 : c * all;  // replicated values beside the master
  }
  if (!pol.shard_optimizer) {
    mem.gradients = c * all;  // full gradients, reduced in place
  } else if (!pol.shard_gradients) {
    mem.gradients = c * all + m * all / N;  // full local gradients kept, and the reduced piece
  } else {
    // The root's full gradient lives through the whole backward, and two adjacent
    // units' coexist (one reducing while the next computes) — one when widened.
    const bool widened = compute16 && !narrow_reduce;
    mem.gradients = m * all / N + c * (padded[0] + detail::widest(padded, widened ? 1 : 2));
  }
  std::vector<std::size_t> send(padded.size()), reduce_bytes(padded.size());
  for (std::size_t i = 0; i < padded.size(); ++i) {
    const std::size_t piece = m * padded[i] / N;  // fp32 bytes of this rank's piece
    send[i] = sharded && narrow_param && !compute16 ? piece : 0;
    if (!pol.shard_optimizer) continue;  // all-reduce in place
    if (compute16) reduce_bytes[i] = narrow_reduce ? c * padded[i] / N : m * padded[i];
    else if (narrow_reduce) reduce_bytes[i] = piece;
  }
  mem.comm_scratch = detail::scratch_peak(send, reduce_bytes, s.prefetch, pol.free == shard::free_point::after_forward);
  if (!sharded && N > 1 && narrow_param && !compute16)  // the step's gathers of every piece, narrowed, at once
    mem.comm_scratch = std::max(mem.comm_scratch, m * all / N);

  traffic& t = p.sent;
  const double fG = double(G - 1) / double(G), fW = double(W - 1) / double(W), P = double(all);
  if (sharded)  // every unit gathered in forward and, when freed after it, but the root again in backward
    t.all_gather = fG * g * (pol.free == shard::free_point::after_forward ? 2 * P - double(padded[0]) : P);
  else if (N > 1)  // after the step, every updated piece to every rank
    t.all_gather = t.exposed = fG * (master_in_values ? double(m) : g) * P;
  if (pol.shard_optimizer) t.reduce_scatter = fG * r * P;
  else t.all_reduce = 2 * fW * r * P;
  if (pol.reduce == shard::reduction::hierarchical) {  // the reduced piece averaged across the W/G replicas, in fp32
    const double replicas = double(W / G);
    t.all_reduce = 2 * (replicas - 1) / replicas * double(m) * P / double(G);
    t.exposed += t.all_reduce;
  }
  // train_step's one scalar all-reduce: the global mean loss and fp16 loss scaling's
  // overflow vote, two floats, sent when either is on.
  if (s.global_loss || s.precision.param == dtype::f16 || s.precision.reduce == dtype::f16) {
    t.all_reduce += 2 * fW * 8;
    t.exposed += 2 * fW * 8;
  }
  return p;
}

// The model states as the ZeRO paper counts them (Rajbhandari et al. 2020, sec. 5):
// 16-bit parameters 2Ψ, 16-bit gradients 2Ψ, and K·Ψ of optimizer state (fp32
// master and moments: K = 12 for mixed-precision Adam), each divided by the shard
// group where the policy keeps it sharded at the step's peak. Parameters count as
// sharded only when freed after forward (FullShard); a strategy that holds them
// gathered through backward (ShardGradOp) peaks with all of them, as ZeRO-2 does.
struct model_states {
  double parameters = 0, gradients = 0, optimizer = 0;
  double total() const { return parameters + gradients + optimizer; }
};
inline model_states zero_model_states(const shard::policy& pol, int world, double psi, double k = 12) {
  const double G = double(pol.group(world));
  const bool params_sharded = pol.shard_parameters && pol.free == shard::free_point::after_forward;
  return {2 * psi / (params_sharded ? G : 1), 2 * psi / (pol.shard_gradients ? G : 1),
          k * psi / (pol.shard_optimizer ? G : 1)};
}

// A coarse transformer: `layers` blocks of 12·hidden² parameters each (attention
// 4·hidden², a 4·hidden feed-forward 8·hidden²; biases and norms neglected), each
// block a unit, and the rest of `parameters` (embeddings, head) in the root.
struct transformer_shape {
  double parameters = 0;  // all of them; 0 means the blocks alone
  long layers = 0, hidden = 0, heads = 1, seq = 0;
  long batch = 1;  // per rank
  // The layers' attention is the device's fused one (nn/cuda/attention.cuh): it keeps
  // no [batch, heads, seq, seq] weights for backward, only the output and a float
  // log-sum-exp per (batch, head, query). The host layers keep the weights (false).
  bool fused_attention = false;
};

// Activations are estimated as Korthikanti et al. 2022 ("Reducing Activation
// Recomputation in Large Transformer Models", eq. 1, no parallelism, no recomputation):
// seq·batch·hidden·(34 + 5·heads·seq/hidden) bytes per layer with 16-bit activations,
// scaled by size_of(activations)/2; the 5·heads·seq² term is the stored attention
// weights (softmax 2, dropout mask 1, dropout output 2 bytes each), which a fused
// attention replaces by its 4·heads·seq bytes of log-sum-exp (floats, whatever the
// activations' dtype; the output it keeps is among the 34). FLOPs: 6 per parameter per
// token plus attention's 12·layers·hidden·seq per token (Narayanan et al. 2021, eq. 3
// without recomputation).
inline model_desc transformer(const transformer_shape& t, dtype activations = dtype::bf16) {
  require(t.layers >= 1 && t.hidden >= 1 && t.heads >= 1 && t.seq >= 1 && t.batch >= 1,
          "plan::transformer: layers, hidden, heads, seq and batch must be positive");
  const std::size_t block = std::size_t(12) * std::size_t(t.hidden) * std::size_t(t.hidden);
  const double blocks = double(block) * double(t.layers);
  require(t.parameters == 0 || t.parameters >= blocks, "plan::transformer: ", t.layers, " blocks of hidden size ",
          t.hidden, " alone have ", blocks, " parameters, more than the ", t.parameters, " given");
  model_desc d;
  d.units.push_back(t.parameters == 0 ? 0 : std::size_t(t.parameters - blocks));
  d.units.insert(d.units.end(), std::size_t(t.layers), block);
  const double s = double(t.seq), b = double(t.batch), h = double(t.hidden), a = double(t.heads);
  const double weights = t.fused_attention ? 0 : 5 * a * s / h, lse = t.fused_attention ? 4 * a * s * b : 0;
  d.activation_bytes =
      std::size_t(double(t.layers) * (s * b * h * (34 + weights) * double(size_of(activations)) / 2 + lse));
  d.flops = 6 * double(d.parameters()) * s * b + 12 * double(t.layers) * h * s * s * b;
  return d;
}

}  // namespace shardlib::plan
