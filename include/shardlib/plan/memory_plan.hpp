// shardlib/plan/memory_plan.hpp — what one rank holds and sends per training step under
// each sharding strategy, from a model's unit sizes: the formulas the memory ledger is
// tested against (derivation and worked example in docs/planner.md).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"     // dtype, size_of
#include "shardlib/core/error.hpp"       // require
#include "shardlib/core/ledger.hpp"      // category
#include "shardlib/plan/step_replay.hpp"  // detail::replay, accumulation
#include "shardlib/plan/strategies.hpp"   // strategy, policy_of
#include "shardlib/shard/precision.hpp"  // shard::mixed_precision
#include "shardlib/shard/strategy.hpp"   // shard::policy

#include <algorithm>    // std::max, std::min
#include <cstddef>      // std::size_t
#include <numeric>      // std::accumulate
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <optional>     // std::optional
#include <utility>      // std::pair
#include <vector>       // std::vector

namespace shardlib::plan {

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
  // shard::policy::reshard_to for `strategy` where it frees after forward (FullShard,
  // HybridShard); not read with `policy`, which states its own
  int reshard_to = 0;
  // Ranks per node, consecutive (0: not known): traffic::within_node then counts what the
  // collectives whose groups lie within one node send. Divides the world, or holds all of it.
  int node_size = 0;
  plan::precision precision{};
  std::size_t optimizer_bytes = adam_state_bytes;
  bool offload = false;  // shard::options::offload: see rank_plan::offloaded
  // shard::options::frozen_masters: false, with 16-bit layers, keeps no fp32 master for the
  // frozen elements of wholly frozen and packed units
  bool frozen_masters = true;
  // shard::options::frozen_grads: false keeps no full local gradients for a wholly frozen
  // unit's elements, nor for a packed unit's frozen ones
  bool frozen_grads = true;
  bool global_loss = true;  // shard::step_options::loss is loss_report::global_mean (train_step's default)
  bool per_item_mean = false;  // shard::step_options::mean is loss_mean::per_item
  // Gradient accumulation (plan/step_replay.hpp): train_step over micro-batches;
  // model_desc's activations and flops are then one micro-batch's.
  plan::accumulation accumulation{};
  // The rank planned (its place in the shard group decides which elements its optimizer
  // state holds, when some parameters are frozen); unset: for each category the
  // largest over the ranks. Without frozen parameters every rank holds the same.
  std::optional<int> rank{};

  shard::policy resolved() const {
    if (policy) return *policy;
    shard::policy p = policy_of(strategy, group);
    if (p.free == shard::free_point::after_forward) p.reshard_to = reshard_to;
    return p;
  }
  // Ranks one shard is split over: the world, or the policy's group.
  int shard_group() const { return resolved().group(world); }
};

// A unit's frozen parameters (requires_grad = false), as the engine treats them: no
// optimizer state for their elements; a unit whose parameters are all frozen reduces
// nothing and keeps no reduced gradients; a unit run in a frozen prefix (nn::frozen_prefix:
// a decoder's frozen embeddings and lower blocks) is freed after forward and runs no backward.
struct unit_freezing {
  // [begin, end) of each frozen parameter in the flat unit, in order and apart
  std::vector<std::pair<std::size_t, std::size_t>> ranges{};
  bool all = false;          // every parameter frozen, and it has some (nn::flat_layout::all_frozen)
  bool no_backward = false;  // a frozen prefix's unit (never the root)
};

// A model as the planner sees it. Units are the root's descendants run one after
// another (none nested in another, as a wrap policy over a Stack's layers gives).
struct model_desc {
  // Flat elements of each unit (alignment gaps included, padding to the world not):
  // the root first, then the other units in forward order.
  std::vector<std::size_t> units;
  // Empty when nothing is frozen, else one per unit, in the order of `units`.
  std::vector<unit_freezing> frozen{};
  // Empty when none, else one per unit: it stays gathered from its forward to its backward
  // where the strategy frees after forward (shard::options::keep_gathered; never the root).
  std::vector<bool> kept_gathered{};
  // Peak activations of one rank's local batch: no strategy changes them. With
  // activation checkpointing, the peak measure_activations(model, checkpoint, run) gives.
  std::size_t activation_bytes = 0;
  double flops = 0;  // forward + backward of one rank's local batch (the chooser's compute time)

  std::size_t parameters() const { return std::accumulate(units.begin(), units.end(), std::size_t(0)); }
  bool all_frozen(std::size_t i) const { return !frozen.empty() && frozen.at(i).all; }
  bool runs_backward(std::size_t i) const { return frozen.empty() || !frozen.at(i).no_backward; }
  bool keeps_gathered(std::size_t i) const { return !kept_gathered.empty() && kept_gathered.at(i); }
  // Elements of [begin, begin + n) of unit i that the optimizer state holds: all but the
  // frozen parameters' (alignment gaps and padding included), none of a wholly frozen unit.
  std::size_t trained(std::size_t i, std::size_t begin, std::size_t n) const {
    if (frozen.empty()) return n;
    if (frozen.at(i).all) return 0;
    std::size_t held = n;
    for (const auto& [lo, hi] : frozen[i].ranges)
      held -= std::min(hi, begin + n) - std::min(std::max(lo, begin), std::min(hi, begin + n));
    return held;
  }
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
  // The part of all_gather sent within groups of policy::reshard_to ranks (already counted
  // above): one node's links when the groups are its ranks.
  double within_reshard_groups = 0;
  // With setup::node_size: the part of the total, and of `exposed`, that collectives whose
  // groups lie within one node send (already counted above); the rest crosses nodes.
  double within_node = 0, exposed_within_node = 0;
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

// The plan of one rank for one train_step (zero_grad, forward, backward, step; or
// train_step over setup::accumulation.micro_batches) after the first, which
// records the order and runs no prefetch (so it never holds more), read off the
// strategy's policy alone. P_i is
// unit i padded to a multiple of the shard group G (the world W when the policy has
// no groups); ΣP their sum; master and optimizer state are split into N pieces (N = G
// when the policy shards optimizer state, else 1); sizes in bytes: master m = 4,
// compute c, param dtype g, reduce dtype r, optimizer state o per parameter.
//
// 16-bit compute (precision::param_layers) keeps each piece's 16-bit copy beside the
// master and gathers it directly (no send scratch); in fp32 reductions a unit's full
// gradients are widened into an fp32 scratch (4·P_i), in 16-bit reductions they land
// in a 16-bit piece. Replicated fp32 values with fp32 gathers hold the master itself.
//
// Frozen parameters (model_desc::frozen) take out what the engine leaves out: their
// elements' optimizer state, a wholly frozen unit's reduced gradients and reduction, a
// packed unit's frozen elements from its reduction and its reduced gradients
// (shard/packing.hpp), a frozen prefix's backward (its gathers, its full gradients).
// With them the optimizer state and reduced gradients differ from rank to rank:
// setup::rank picks one (without it, the largest).
inline rank_plan make_plan(const model_desc& d, const setup& s) {
  require(!d.units.empty(), "plan: the model has no units (the root is always one)");
  require(s.world >= 1 && s.prefetch >= 0, "plan: world ", s.world, " and prefetch ", s.prefetch,
          " must be at least 1 and 0");
  const accumulation& acc = s.accumulation;
  require(acc.micro_batches >= 1, "plan: accumulation.micro_batches ", acc.micro_batches, " must be at least 1");
  const shard::policy pol = s.resolved();
  require(pol.valid(), "plan: the strategy's policy: ", pol.problem() ? pol.problem() : "");
  require(pol.group_size == 0 || s.world % pol.group_size == 0, "plan: HybridShard group size ", pol.group_size,
          " must divide the world size ", s.world);
  require(pol.reshard_to == 0 || pol.group(s.world) % pol.reshard_to == 0, "plan: reshard_to ", pol.reshard_to,
          " must divide the shard group's ", pol.group(s.world), " ranks");
  require(s.node_size >= 0 && (s.node_size == 0 || s.world <= s.node_size || s.world % s.node_size == 0),
          "plan: node_size ", s.node_size, " must be 0 (not known), hold the ", s.world,
          " ranks or divide their number");
  require(!s.rank || (*s.rank >= 0 && *s.rank < s.world), "plan: rank ", s.rank.value_or(0), " is not one of the ",
          s.world, " ranks");
  require(d.frozen.empty() || d.frozen.size() == d.units.size(), "plan: model_desc::frozen describes ",
          d.frozen.size(), " units of the model's ", d.units.size(), " (one per unit, or none)");
  require(d.kept_gathered.empty() || d.kept_gathered.size() == d.units.size(), "plan: model_desc::kept_gathered ",
          "describes ", d.kept_gathered.size(), " units of the model's ", d.units.size(), " (one per unit, or none)");
  for (std::size_t i = 0; i < d.frozen.size(); ++i) {
    require(i > 0 || !d.frozen[i].no_backward, "plan: the root (unit 0) always runs backward");
    std::size_t end = 0;  // of the range before: ranges come in order, apart (a flat layout's entries)
    for (const auto& [lo, hi] : d.frozen[i].ranges) {
      require(end <= lo && lo <= hi && hi <= d.units[i], "plan: unit ", i, "'s frozen range [", lo, ", ", hi,
              ") is not within its ", d.units[i], " elements after the range before it (ending at ", end, ")");
      end = hi;
    }
  }
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

  // Frozen parameters: the elements whose optimizer state this rank holds (its piece of
  // each unit), and the units that keep reduced gradients and reduce.
  const int ranks = int(N);
  std::vector<std::size_t> trained(std::size_t(ranks), 0);
  for (int q = 0; q < ranks; ++q)
    for (std::size_t i = 0; i < padded.size(); ++i)
      trained[std::size_t(q)] += d.trained(i, std::size_t(q) * padded[i] / N, padded[i] / N);
  const int my_piece = N > 1 ? s.rank.value_or(0) % int(G) : 0;
  const std::size_t state = s.rank ? trained[std::size_t(my_piece)] : *std::max_element(trained.begin(), trained.end());
  // A unit that has frozen and trained parameters reduces its trained elements alone when the
  // largest piece's (its slot, width[i]) is fewer than a piece's (shard/packing.hpp).
  std::vector<std::size_t> width(padded.size(), 0);
  std::vector<std::vector<std::size_t>> piece_trained(padded.size());
  for (std::size_t i = 0; i < padded.size(); ++i) {
    const std::size_t n = padded[i] / N;
    for (std::size_t q = 0; q < N && !d.all_frozen(i); ++q) {
      piece_trained[i].push_back(d.trained(i, q * n, n));
      width[i] = std::max(width[i], piece_trained[i].back());
    }
    // packed only if it sends less and its slots (sent, and received by a reduce-scatter) fit in P_i
    if (width[i] >= n || (N + (pol.shard_optimizer ? 1 : 0)) * width[i] > padded[i]) piece_trained[i].clear();
  }
  auto packed = [&](std::size_t i) { return !piece_trained[i].empty(); };
  // Elements each reduction sends (units that run a backward and are not wholly frozen), and
  // each piece's averaged across HybridShard's replicas; with replicated values and sharded
  // optimizer state, elements refreshed after the step (not wholly frozen).
  double reduced = 0;
  std::vector<double> across(N, 0);
  // Each piece's reduced gradients kept: a reduce-scatter that packs keeps the piece's
  // trained elements alone; a wholly frozen unit none, unless its layers write there.
  std::vector<std::size_t> kept(N, 0);
  std::size_t refreshed = 0;  // elements refreshed
  for (std::size_t i = 0; i < padded.size(); ++i) {
    if (!d.all_frozen(i) && d.runs_backward(i)) {
      reduced += double(packed(i) ? N * width[i] : padded[i]);
      for (std::size_t q = 0; q < N; ++q) across[q] += double(packed(i) ? piece_trained[i][q] : padded[i] / N);
    }
    if (!d.all_frozen(i)) refreshed += padded[i];
    if (!d.all_frozen(i) || !(compute16 || pol.shard_optimizer))
      for (std::size_t q = 0; q < N; ++q)
        kept[q] += packed(i) && pol.shard_optimizer ? piece_trained[i][q] : padded[i] / N;
  }
  const std::size_t grads = s.rank ? kept[std::size_t(my_piece)] : *std::max_element(kept.begin(), kept.end());
  // Each piece's fp32 master elements: its trained elements alone in a unit whose frozen
  // elements keep none (options.frozen_masters = false: wholly frozen and packed units).
  std::vector<std::size_t> mastered(N, 0);
  for (std::size_t i = 0; i < padded.size(); ++i) {
    const bool compact = compute16 && !s.frozen_masters && (d.all_frozen(i) || packed(i));
    for (std::size_t q = 0; q < N; ++q)
      mastered[q] += !compact ? padded[i] / N : d.all_frozen(i) ? 0 : piece_trained[i][q];
  }
  const std::size_t masters =
      s.rank ? mastered[std::size_t(my_piece)] : *std::max_element(mastered.begin(), mastered.end());

  rank_plan p;
  rank_memory& mem = p.memory;
  mem.activations = d.activation_bytes;
  // Persistent: the master pieces (unless the values hold them), their 16-bit
  // copies, the optimizer state of the pieces, the reduced gradients of the pieces.
  // Offloaded, the optimizer's side moves to the offload space; the model's space keeps
  // the parameters layers need: the fp32 piece (fp32 layers) or its 16-bit copy.
  const std::size_t copy16 = compute16 && pol.shard_optimizer ? c * all / N : 0;
  mem.parameters = (master_in_values ? c * all : s.offload && compute16 ? 0 : m * masters) + copy16;
  mem.optimizer_state = s.offload ? 0 : o * state;
  if (s.offload) p.offloaded = {.parameters = m * masters + copy16, .gradients = m * grads, .optimizer_state = o * state};

  // Gathers, full gradients and scratch as the step interleaves them (detail::replay).
  // reshard_to = R: a unit freed after forward keeps P_i / R (1 < R < G), or all of it (R = 1).
  const std::size_t R = std::size_t(pol.regather(s.world));
  detail::step_units units;
  for (std::size_t i = 0; i < padded.size(); ++i) {
    const std::size_t piece = m * padded[i] / N;  // fp32 bytes of this rank's piece
    units.gathered.push_back(sharded ? padded[i] : 0);
    units.send.push_back(sharded && narrow_param && !compute16 ? piece : 0);
    units.part.push_back(sharded && R > 1 && R < G ? padded[i] / R : 0);
    units.part_send.push_back(narrow_param && !compute16 ? m * units.part.back() : 0);
    const std::size_t trained_i = std::accumulate(piece_trained[i].begin(), piece_trained[i].end(), std::size_t(0));
    units.full.push_back(!pol.shard_optimizer                  ? 0
                         : s.frozen_grads                       ? padded[i]
                         : d.all_frozen(i)                      ? 0
                         : packed(i)                            ? trained_i
                                                                : padded[i]);
    // packed: the slots sent and this rank's received, in the compute dtype when 16-bit both,
    // where HybridShard widens the received one to average it across the replicas in fp32
    const std::size_t slots = (N + (pol.shard_optimizer ? 1 : 0)) * width[i];
    const std::size_t packed16 =
        pol.reduce == shard::reduction::hierarchical ? std::max(c * slots, (c + m) * width[i]) : c * slots;
    units.reduce.push_back(packed(i)             ? (compute16 && narrow_reduce ? packed16 : m * slots)
                           : !pol.shard_optimizer ? 0
                           : compute16            ? (narrow_reduce ? c * padded[i] / N : m * padded[i])
                           : narrow_reduce        ? piece
                                                  : 0);
    // received apart from what a reduced piece holds already (a later micro-batch), where it was received in it
    units.reduce_again.push_back(units.reduce.back() +
                                 (!packed(i) && pol.shard_optimizer && !narrow_reduce ? m * padded[i] / N : 0));
    units.released.push_back(packed(i) || (compute16 && !narrow_reduce));
    units.frozen.push_back(d.all_frozen(i));
    units.backward.push_back(d.runs_backward(i));
    units.kept.push_back(d.keeps_gathered(i) || pol.keeps_whole(s.world));
  }
  const detail::step_replay step =
      detail::replay(units, std::size_t(s.prefetch), pol.free == shard::free_point::after_forward,
                     !pol.shard_gradients, s.accumulation);
  const double reductions = acc.no_sync ? 1 : acc.micro_batches;  // per step
  // Sharded: the root all step, the unit running and those prefetched, and under
  // after_backward every unit that runs a backward (after_forward: those kept gathered),
  // from its forward to its backward; with keep_after_backward, every unit from its backward on
  // (the next micro-batch's forward gathers none of them).
  // Replicated: the values beside the master, unless they are the master.
  mem.gathered_parameters = sharded ? c * step.gathered_peak : master_in_values ? 0 : c * all;
  // Replicated optimizer state: full gradients reduced in place. Else the reduced
  // pieces, and the full local gradients: kept (ZeRO-1: every unit's but the wholly frozen,
  // and one of those during its backward), or the root's through the whole backward and
  // two units' (the one computing and the last one reducing; one when widened); with no_sync,
  // each unit's from its first backward until the last micro-batch reduces them.
  mem.gradients = !pol.shard_optimizer ? c * all : m * grads + c * step.full_grad_peak;
  mem.comm_scratch = step.scratch_peak;
  if (!sharded && N > 1 && narrow_param && !compute16)  // construction's gathers of every piece, narrowed, at once
    mem.comm_scratch = std::max(mem.comm_scratch, m * all / N);

  traffic& t = p.sent;
  const double fG = double(G - 1) / double(G), fW = double(W - 1) / double(W), fR = double(R - 1) / double(R);
  // A collective over groups of k consecutive ranks (the world's, the shard group's, the reshard
  // group's; HybridShard's replicas, every G-th rank, span the world) runs within one node of
  // setup::node_size ranks when each group lies in one.
  const std::size_t node = std::size_t(s.node_size);
  const auto in_node = [&](std::size_t k) { return node > 0 && k <= node && (node % k == 0 || k == W); };
  const auto send = [&](double& by, double bytes, std::size_t k, bool exposed) {
    by += bytes;
    if (exposed) t.exposed += bytes;
    if (in_node(k)) t.within_node += bytes;
    if (in_node(k) && exposed) t.exposed_within_node += bytes;
  };
  if (sharded) {  // every unit gathered in forward and, when freed after it, but the root and a frozen prefix again
                  // in backward: over the shard group, or from the part kept over groups of R
    send(t.all_gather, fG * g * step.gathered_sent, G, false);
    t.within_reshard_groups = fR * g * step.regathered_sent;
    send(t.all_gather, t.within_reshard_groups, R, false);
  } else if (N > 1) {  // after the step, every updated piece to every rank
    send(t.all_gather, fG * (master_in_values ? double(m) : g) * double(refreshed), G, true);
  }
  if (pol.shard_optimizer) send(t.reduce_scatter, reductions * fG * r * reduced, G, false);
  else send(t.all_reduce, reductions * 2 * fW * r * reduced, W, false);
  if (pol.reduce == shard::reduction::hierarchical) {  // the reduced piece averaged across the W/G replicas, in fp32
    const double replicas = double(W / G);
    send(t.all_reduce,
         (acc.replica_all_reduce ? reductions : 1) * 2 * (replicas - 1) / replicas * double(m) *
             (s.rank ? across[std::size_t(my_piece)] : *std::max_element(across.begin(), across.end())),
         W, true);
  }
  // train_step over micro-batches: the ranks compare their count and options (twelve 8-byte integers)
  if (acc.micro_batches > 1) send(t.all_reduce, 2 * fW * 96, W, true);
  // loss_mean::per_item: the ranks sum their items and whether each can run the step (two integers)
  if (s.per_item_mean) send(t.all_reduce, 2 * fW * 16, W, true);
  // train_step's one scalar all-reduce: the global mean loss and fp16 loss scaling's
  // overflow vote, two floats, sent when either is on.
  if (s.global_loss || s.precision.param == dtype::f16 || s.precision.reduce == dtype::f16)
    send(t.all_reduce, 2 * fW * 8, W, true);
  return p;
}

}  // namespace shardlib::plan
