// shardlib/shard/sharded_model.hpp — ShardedModel: a model's parameters, gradients and
// optimizer state sharded across the ranks of a communicator as a strategy's policy
// says, and fully_shard to make one.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/pending.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/optim/clip.hpp"
#include "shardlib/optim/param_groups.hpp"
#include "shardlib/shard/checkpointing.hpp"
#include "shardlib/shard/compute_copy.hpp"
#include "shardlib/shard/discover.hpp"
#include "shardlib/shard/gather.hpp"
#include "shardlib/shard/loss_scale_state.hpp"
#include "shardlib/shard/options.hpp"
#include "shardlib/shard/precision.hpp"
#include "shardlib/shard/reduce.hpp"
#include "shardlib/shard/space_ops.hpp"
#include "shardlib/shard/step_decision.hpp"
#include "shardlib/shard/step_readout.hpp"
#include "shardlib/shard/strategy.hpp"
#include "shardlib/shard/structure_check.hpp"
#include "shardlib/shard/unit.hpp"
#include "shardlib/shard/unit_optimizer.hpp"
#include "shardlib/shard/wrap.hpp"

#include <cmath>        // std::sqrt
#include <concepts>     // std::same_as
#include <cstdint>      // std::uint64_t, std::int64_t
#include <map>          // std::map
#include <optional>     // std::optional
#include <ranges>       // std::ranges::contiguous_range, data, size
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v, std::remove_cvref_t
#include <typeindex>    // std::type_index
#include <utility>      // std::declval, std::move
#include <vector>       // std::vector

namespace shardlib::shard {

// The model, wrapped: forward, backward and step run the strategy's policy around
// each unit (docs/design.md, "Sharding engine"). The concerns live in one place each:
//   which layers are units          shard/discover.hpp
//   gather, free, prefetch          shard/gather.hpp (gather_schedule)
//   gradient reduction              shard/reduce.hpp (gradient_reducer)
//   a step's loss and outcome read  shard/step_readout.hpp
//   fp16 loss scaling's state       shard/loss_scale_state.hpp
//   optimizer state, groups, checks shard/unit_optimizer.hpp
//   16-bit compute copies, masters  shard/compute_copy.hpp (compute_copies)
//   model agreement across ranks    shard/structure_check.hpp
//   construction: groups, units, storage
//                                   shard/sharded_model_construction.hpp
//   train_step, the optimizer's step (in place or offloaded), clipping, loss scaling
//                                   shard/sharded_model_step.hpp
//   full parameters outside a step  shard/sharded_model_parameters.hpp
//   the hooks around each unit, the engine interface io/ and plan/ use
//                                   here
//
// T is the master dtype. The model's output tensor type says the rest: its
// memory space is where every shard and gathered buffer lives (host_space, or
// cuda_space with shard/cuda/space_ops.cuh), and its element type C is the dtype
// layers compute in — T, or a 16-bit type (fp32 master and optimizer state,
// C-typed values, gathers and layer gradients; precision.param must then name C).
// Optimizer is the optimizer whose state each unit holds (typed, made on the
// first step).
template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T = float,
          class Optimizer = optim::Adam>
class ShardedModel {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "ShardedModel: master parameters are float or double");

 public:
  using input = typename Model::input;
  using output = typename Model::output;
  using space = typename output::space;
  using compute_type = typename output::value_type;
  using optimizer_type = Optimizer;
  // What the communicator's asynchronous collectives return (comm::work, NcclComm's nccl_work, ...).
  using work_type = decltype(std::declval<Comm&>().all_gather_async(std::span<const T>{}, std::span<T>{}));
  using unit_type = unit<T, compute_type, space, work_type, typename Optimizer::state>;
  using state = typename unit_type::state;
  using offload_space = typename unit_type::offload_space;

 private:
  using C = compute_type;
  using ops = space_ops<space>;
  static constexpr bool compute16 = !std::is_same_v<C, T>;
  static_assert(EngineSpace<space>, "ShardedModel: no space_ops for the model's memory space (for cuda_space, "
                                    "include shardlib/shard/cuda/space_ops.cuh)");
  static_assert(!compute16 || (std::is_same_v<T, float> && (std::is_same_v<C, bfloat16> || std::is_same_v<C, half>)),
                "ShardedModel: layers compute in the master dtype or, with float masters, in bfloat16 or half");
  static_assert(OffloadSpace<space>, "ShardedModel: the model's memory space has no offload space and channel "
                                     "(offload_space_t, space_ops<Space>::offload_channel)");
  using offload_ops = space_ops<host_space>;  // the offload space is host memory: the optimizer's side runs there

 public:
  ShardedModel(Model& model, Comm& comm, Strategy strategy, options o);
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;
  // No buffer goes while a collective may still read or write it: a rank that
  // leaves mid-step (an exception) waits for what it issued first.
  ~ShardedModel() { drain(); }

  Model& model() { return *model_; }
  Comm& comm() { return *comm_; }
  sharded_context<ShardedModel>& context() { return ctx_; }
  const std::vector<unit_type>& units() const { return units_; }
  std::uint64_t steps() const { return step_; }

  output forward(const input& x) {
    ops::check_stream(*comm_, comm_->rank());
    if (stepped_ != step_) {  // micro-batches of one step draw on (other dropout masks), not again
      ctx_.set_step(step_);
      stepped_ = step_;
    }
    ctx_.forget_kept();  // a forward without its backward leaves checkpointed inputs
    forwarded_ = false;
    forward_draws_ = ctx_.draws();
    try {
      auto y = ctx_.forward(*model_, x);
      forwarded_ = !ctx_.in_no_grad() && !ctx_.evaluating();  // no_grad(f) and eval(): no backward follows
      return y;
    } catch (...) {
      drain();  // nothing left gathered or in flight: the next forward gathers afresh
      ctx_.rewind_draws(forward_draws_);
      throw;
    }
  }
  // Refused before anything is gathered unless a forward completed since the last
  // backward: the layers' cached activations are gone.
  input backward(const output& dy) {
    require(ctx_.grad_enabled(), "rank ", comm_->rank(), ": backward in eval mode: its forwards keep no "
            "activations and free every unit; call train() and run the forward again");
    require(forwarded_, "rank ", comm_->rank(), ": backward without a forward: each backward needs a forward "
            "completed after the previous backward, in train mode and outside no_grad");
    forwarded_ = false;
    try {
      auto dx = ctx_.backward(*model_, dy);
      unreduced_ = !sync_;  // a backward with sync reduces what earlier ones accumulated too
      return dx;
    } catch (...) {
      // Its reductions still in flight are waited for and dropped, so the gradients are
      // partial until zero_grad(), which step() requires; the model itself goes on.
      drain();
      ctx_.rewind_draws(forward_draws_);  // the next forward draws the masks this pass's drew
      incomplete_ = true;
      throw;
    }
  }

  // Evaluation (PyTorch's model.eval() and torch.no_grad() at once): every forward
  // frees each gathered unit, the root included, as soon as it has run; the context
  // answers training() == false (dropout off) and grad_enabled() == false, which
  // layers read to keep no activations (nn::grad_enabled; the library's host layers do);
  // backward raises. eval() also frees what a forward without backward left gathered
  // (ShardGradOp and options.keep_gathered keep units until their backward, policy::reshard_to
  // a part of them) and forgets that forward.
  void eval() {
    release_full_params();
    forwarded_ = false;
    ctx_.set_training(false);
    ctx_.set_grad_enabled(false);
  }
  // Back to training: the context's training flag as options.context set it.
  void train() {
    ctx_.set_training(opts_.context.training);
    ctx_.set_grad_enabled(true);
  }
  bool training() const { return ctx_.grad_enabled(); }

  // FSDP's summon_full_params: runs f() with every unit's full parameters readable
  // and writable through the model's Params, on every rank or, with rank0_only, on
  // rank 0 alone (the others' Params stay unbound). With writeback (the default)
  // what f() leaves in them goes back to the masters on return; without, the
  // masters are untouched. The full values are what layers read: with 16-bit
  // gathers or 16-bit compute they are the masters rounded, and writeback changes
  // only the master elements whose rounded value f() replaced, so the elements it
  // left alone keep their fp32 bits. Collective; between steps. If f() throws, the
  // units are released and nothing is written back.
  struct summon_options {
    bool writeback = true;
    bool rank0_only = false;  // refused with writeback, as FSDP: the other ranks would lose rank 0's writes
  };
  template <class F>
  void summon_full_params(F&& f, summon_options o = {});

  // Micro-batches run with sync(false) only accumulate gradients locally (in the
  // unsharded gradient buffers, as PyTorch's no_sync); the next backward with
  // sync(true) reduces everything accumulated. step() refuses gradients that a
  // backward left unreduced, and train_step (one whole step) refuses sync(false).
  void set_sync(bool on) { sync_ = on; }
  // FSDP's no_sync() context: sync off until the guard ends.
  //   { auto guard = model.no_sync(); model.backward(...); }  model.backward(...);  // reduces both
  class sync_off {
   public:
    explicit sync_off(ShardedModel& m) : m_(&m), was_(m.sync_) { m.sync_ = false; }
    ~sync_off() { m_->sync_ = was_; }
    sync_off(const sync_off&) = delete;
    sync_off& operator=(const sync_off&) = delete;

   private:
    ShardedModel* m_;
    bool was_;
  };
  [[nodiscard]] sync_off no_sync() { return sync_off(*this); }
  // FSDP2's set_reshard_after_backward. false: each unit stays gathered after its backward
  // (also at the end of backward) until the step, eval() or a forward that frees it, so that
  // the next micro-batch's forward finds it there: one all-gather fewer per unit and
  // micro-batch under FullShard, none at all under ShardGradOp, for the full parameters held
  // meanwhile. For gradient accumulation: off for the micro-batches under no_sync, on for the
  // last. Collective (a rank that keeps units where another frees them would pair its next
  // gathers with the other's wrongly): one all-reduce of two integers (on a device, a host
  // wait), and ranks that disagree raise, naming both values.
  void set_reshard_after_backward(bool on) {
    std::vector<std::int64_t> any{on, !on};  // over the ranks' maximum: some set true, some false
    ops::all_reduce_values(*comm_, std::span<std::int64_t>(any), comm::reduce_op::max);
    require(!(any[0] && any[1]), "rank ", comm_->rank(), ": set_reshard_after_backward(",
            on ? "true" : "false", "): other ranks set ", on ? "false" : "true",
            "; every rank must set the same (units kept gathered on some ranks only would pair gathers wrongly)");
    reshard_after_backward_ = on;
  }

  void zero_grad() {
    for (auto& u : units_) {
      require(!u.reducing, "rank ", comm_->rank(), ": zero_grad: a gradient reduction of unit '", u.name,
              "' is still pending");
      ops::fill(u.grad.span(), T(0));
      if (policy_.shard_gradients) u.release_full_grad();  // drops gradients accumulated under sync(false)
      else if (policy_.shard_optimizer) ops::fill(u.full_grad.span(), C(0));
      u.grad_clean = true;
    }
    unreduced_ = false;
    incomplete_ = false;
  }

  // The global 2-norm of the gradients the optimizer steps. Each rank sums the
  // squares of the gradients it owns, over the ranks that hold different shards
  // only: replicas hold the same values and must not be counted twice. Collective;
  // call after backward.
  // On a device the squares are summed and reduced there, and read once.
  double grad_norm() {
    require_complete("grad_norm");
    auto sum = grad_norm_squared();
    double total = 0;
    ops::issue_to_host(std::span<const double>(sum.data(), 1), std::span<double>(&total, 1));
    ops::wait_for_reads();
    return std::sqrt(total);
  }
  // Scales all gradients so their global 2-norm is at most max_norm (PyTorch's
  // clip_grad_norm_) and returns the norm before clipping.
  float clip_grad_norm(float max_norm) {
    const double total = grad_norm();
    T coefficient = 1;  // a float64 model's in float64
    with_rank([&] { coefficient = optim::clip_coefficient<T>(total, max_norm); });
    for (auto& u : units_) ops::scale(u.grad.span(), coefficient);
    return float(total);
  }

  // Every rank steps its own partition with its own optimizer state; replicated
  // full values then take the update (ZeRO-1: every rank's slice to every rank).
  // Parameter groups step each unit's piece as runs of one group each.
  template <class O>
  void step(O& opt) {
    step(opt, optim::skip_flag{});
  }
  // The same, cancelled where the values are when *flag.skip != 0 (an optimizer that
  // takes an optim::skip_flag; not with options.offload).
  template <class O>
  void step(O& opt, optim::skip_flag flag) {
    const int r = comm_->rank();
    require(!unreduced_, "rank ", r, ": step after a backward under set_sync(false) (no_sync): its gradients were "
            "never reduced across ranks; run the last micro-batch's backward with sync on");
    require_complete("step");
    require(!scaler_, "rank ", r, ": step with fp16 (loss scaling): the gradients of a manual backward are neither "
            "scaled nor checked for overflow; use train_step, which scales the loss, unscales and skips "
            "overflowed steps (or bf16, which needs no scaling)");
    apply_step(opt, flag);
  }

  // One optimisation step on this rank's batch: zero, forward, loss, backward, step
  // (step_options: clipping, the loss reported, the reduction). Gradients are averaged
  // across ranks by default, so with each rank's loss a mean over equal batches the
  // step follows the gradient of the global mean loss. With fp16, the loss gradient is
  // multiplied by the loss scale and the gradients are unscaled before clipping; a step
  // whose gradients overflowed on any rank is skipped on every rank (see loss_scaler),
  // as is one whose clipped norm is not finite, and the result says so.
  //
  // On a device nothing here waits for it: the loss, the overflow vote and the norm
  // are reduced in device memory, and with clipping or fp16 loss scaling one device
  // thread makes the host's decision (shard/step_decision.hpp) and the optimizer's
  // step is cancelled there when it says skip (an optimizer that takes an
  // optim::skip_flag; the loss scaler then lives on the device too, read by scaler()).
  // The result's loss, skipped and grad_norm are read when the caller reads one of
  // them (one wait), which also raises loss_scaler's error for too many skips in a
  // row. With an optimizer without a skip_flag step, or options.offload (the host
  // steps), the host reads the flags once, before the optimizer steps.
  template <class O, class Target, class LossFn>
  step_result_of<space, T> train_step(O& opt, const input& x, const Target& y, LossFn&& loss_fn,
                                   const step_options& so = {}) {
    return run_step(opt, std::span<const input>(&x, 1), std::span<const Target>(&y, 1), loss_fn, so, false);
  }
  // The same over micro-batches (gradient accumulation): xs[k] and ys[k] for k < xs.size(),
  // each forward and backward in turn, one optimizer step after the last. Each loss gradient
  // is divided by their number, so that with equal micro-batches the step follows the
  // gradient of their mean loss, which it reports (fp16: the overflow vote covers them all);
  // so.mean = loss_mean::per_item weighs each by its items instead (padded or unequal ones).
  // so.no_sync, reshard_after_backward and replica_all_reduce say how the micro-batches before
  // the last run. Ranks must pass as many micro-batches and the same options: they compare them, and
  // whether each rank can run the step at all, in one all-reduce of twelve integers (on a
  // device a host wait), and all raise if one differs or cannot.
  //   std::vector<Tensor<float>> xs = ..., ys = ...;   // four micro-batches
  //   model.train_step(adamw, xs, ys, nn::cross_entropy, {.max_norm = 1, .no_sync = true});
  template <class O, std::ranges::contiguous_range Inputs, std::ranges::contiguous_range Targets, class LossFn>
    requires std::same_as<std::ranges::range_value_t<Inputs>, input>
  step_result_of<space, T> train_step(O& opt, const Inputs& xs, const Targets& ys, LossFn&& loss_fn,
                                   const step_options& so = {}) {
    using target = std::ranges::range_value_t<Targets>;
    return run_step(opt, std::span<const input>(std::ranges::data(xs), std::ranges::size(xs)),
                    std::span<const target>(std::ranges::data(ys), std::ranges::size(ys)), loss_fn, so, true);
  }

 private:
  template <class O, class Target, class LossFn>
  step_result_of<space, T> run_step(O& opt, std::span<const input> xs, std::span<const Target> ys, LossFn& loss_fn,
                                 const step_options& so, bool micro_batches);
  // Ranks that ran different micro-batches would pair their collectives wrongly (a kept unit's
  // gather with another's of the same size), and a rank that raised alone would leave the
  // others waiting: whether each can run the step (`problem` empty), the count and the four
  // options, compared as maxima of the values and of their negations, and raised on every rank.
  void check_micro_batches(std::size_t inputs, const step_options& so, const std::string& problem);

 public:
  // The fp16 loss scaler (empty without fp16), as of the steps issued so far: a copy, which
  // later steps do not change. When train_step decides on a device, its changing fields
  // live there and reading them waits for those steps (on their stream).
  std::optional<loss_scaler> scaler() const { return scaler_.read(); }

  // The full parameters under their unsharded names, in the model's parameter
  // order — on rank 0 only (others return an empty list) or on every rank. A
  // tied parameter appears under each of its names, the entries sharing one
  // tensor (as PyTorch's state_dict()).
  // Units are gathered one at a time, so a rank holds at most one extra full unit
  // beyond what it returns.
  struct named_tensor {
    std::string name;
    Tensor<T> value;
  };
  std::vector<named_tensor> full_state_dict(bool rank0_only = true);

  // --- the engine interface io/ and plan/ use --------------------------------------------------
  // A unit's fp32 master values and optimizer state are split into `partitions()`
  // equal pieces of shard_layout partition(i) (padding at the end): piece p lives
  // on the ranks whose shard-group rank is p. `written_partition()` is the piece
  // this rank saves, or -1 when another rank saves the same values (replicas).
  const Strategy& strategy() const { return strategy_; }
  const shard::policy& policy() const { return policy_; }
  const mixed_precision& precision() const { return opts_.precision; }
  Comm& shard_group() { return shard_comm(); }
  std::size_t unit_count() const { return units_.size(); }
  const std::string& unit_name(std::size_t i) const { return units_.at(i).name; }
  const nn::flat_layout& unit_layout(std::size_t i) const { return units_.at(i).layout; }
  // Unit i's last forward ran inside the context's no_grad (a frozen prefix's unit): it runs no backward.
  bool unit_skips_backward(std::size_t i) const { return units_.at(i).no_backward; }
  // Unit i stays gathered from its forward to its backward (options.keep_gathered).
  bool unit_keeps_gathered(std::size_t i) const { return units_.at(i).keep_gathered; }
  int partitions() const { return policy_.shard_optimizer ? policy_.group(comm_->size()) : 1; }
  int partition_rank() const { return policy_.shard_optimizer ? shard_rank() : 0; }
  int written_partition() const {
    if (comm_->rank() >= policy_.group(comm_->size())) return -1;  // HybridShard's replicas after the first
    return partitions() > 1 ? partition_rank() : (comm_->rank() == 0 ? 0 : -1);
  }
  // Replicated pieces span the unit padded to the world (as ZeRO-1's slices do).
  shard_layout partition(std::size_t i) const {
    const std::size_t n = units_.at(i).numel();
    if (partitions() > 1) return {n, partitions()};
    return {shard_layout{n, policy_.group(comm_->size())}.padded_size(), 1};
  }
  // f(values, std::type_identity<S>{}): this rank's piece of unit i's master values in
  // memory of space S, the model's or (16-bit layers with options.offload keep their master
  // only there) its offload space. A unit without frozen masters (options.frozen_masters)
  // lends a copy: its compute copy widened, its trained masters over it.
  template <class F>
  decltype(auto) with_master_piece(std::size_t i, F&& f) {
    if constexpr (compute16) return copies_.with_piece(units_.at(i), f);
    else return f(std::span<const T>(master_local(units_.at(i))), std::type_identity<space>{});
  }
  // This rank's piece of unit i's master values: memory of the model's space, or of its
  // offload space (host memory) when master_piece_offloaded(i). Not for a unit without
  // frozen masters, whose piece with_master_piece lends.
  std::span<const T> master_piece(std::size_t i) {
    auto& u = units_.at(i);
    require(!u.compact(), "rank ", comm_->rank(), ": unit '", u.name, "' keeps no master for its frozen elements ",
            "(options.frozen_masters = false): read its piece with with_master_piece");
    return master_local(u);
  }
  // With 16-bit layers and options.offload the master lives only in the offload space.
  bool master_piece_offloaded(std::size_t i) const { return compute16 && units_.at(i).offload.has_value(); }
  // This rank's piece of unit i as runs (shard/unit_optimizer.hpp): the frozen ones
  // (optim::segment::frozen) have no optimizer state, the others' lies end to end in
  // each buffer of optimizer_state(opt, i). Without frozen parameters: one run.
  std::vector<optim::segment> piece_runs(std::size_t i) const { return shard::piece_runs(units_.at(i), piece(i)); }
  // Unit i's optimizer state, made (zeroed) on first use exactly as step() makes it.
  // After steps cancelled on the device its step count is settled first (one read).
  template <class O>
  typename Optimizer::state& optimizer_state(O& opt, std::size_t i) {
    auto& st = steps_.state_of(opt, units_.at(i), piece(i));
    if constexpr (requires { st.settle(); }) st.settle();
    return st;
  }
  // Replaces this rank's piece of unit i's master values (host memory, piece(i).size
  // values; frozen elements without masters are rounded into the compute copy). Between
  // steps only. Collective when parameters are replicated from sharded masters (ZeRO-1 in
  // 16 bits): every rank loads every unit.
  void load_master(std::size_t i, std::span<const T> values) {
    auto& u = units_.at(i);
    require<shape_error>(values.size() == piece(i).size, "rank ", comm_->rank(), ": load_master of unit '", u.name,
                         "' needs ", piece(i).size, " values, got ", values.size());
    require(!policy_.shard_parameters || u.where == state::sharded, "rank ", comm_->rank(), ": load_master of unit '",
            u.name, "' while it is gathered (load between steps)");
    u.resharded.reset();  // kept by a forward without its backward: those values are gone
    if constexpr (compute16) {
      copies_.load(u, values);
    } else {
      ops::from_host(values, master_local(u));
      if (u.offload) offload_ops::copy(values, u.offload->master.span());
    }
    if (!policy_.shard_parameters) refresh_values(u);
  }
  bool offloaded() const { return offload_.has_value(); }
  // Resuming: the step counter (dropout streams depend on it) and the fp16 loss scaler.
  void set_steps(std::uint64_t steps) { step_ = steps; }
  void set_scaler(const loss_scaler& s) {
    require(bool(scaler_), "rank ", comm_->rank(), ": set_scaler on a model without fp16 loss scaling");
    with_rank([&] { check_scaler(s); });
    scaler_.set(s);
  }

  // --- introspection (tests and tracing); these poll and never block --------------------------
  // The unit run after (dir = +1) or before (dir = -1) unit i in the recorded forward order, or -1.
  int neighbor(int i, int dir) const { return gathers_.neighbor(i, dir); }
  // Unit i's parameters have arrived (an issued all-gather has completed).
  bool gather_finished(int i) {
    auto& u = units_[std::size_t(i)];
    if (u.where == state::gathering && u.gather_work.test()) gathers_.complete(u);
    return u.where == state::gathered;
  }
  // Unit i's gradient reduction was issued and has completed, not yet been waited for.
  bool reduction_finished(int i) { return units_[std::size_t(i)].reducing && units_[std::size_t(i)].reduce_work.test(); }

  // --- hooks the sharded context runs around each unit ----------------------------------------
  template <class L>
  unit_type* find(const L& layer) {
    auto it = index_.find({static_cast<const void*>(&layer), std::type_index(typeid(L))});
    return it == index_.end() ? nullptr : &units_[std::size_t(it->second)];
  }

  void pre_forward(unit_type& u) {
    const int i = index_of(u);
    check_flags(u);
    u.no_backward = ctx_.in_no_grad();
    gathers_.record(i);
    if (policy_.shard_parameters) {
      gather(u, true);
      // a recompute runs inside backward: the units after this one have run theirs already
      if (!ctx_.recomputing())
        gathers_.for_each_ahead(i, +1, [&](int k) { gather(units_[std::size_t(k)], false); });
    }
    u.bind(u.values.data(), nullptr);
  }
  void post_forward(unit_type& u) {
    const bool root = &u == &units_[0];
    if (root) gathers_.stop_recording();  // the root finishes last: the order is complete
    // a unit run inside no_grad(f) gets no backward (nn::frozen_prefix): free it now
    if (policy_.shard_parameters) {
      if (ctx_.evaluating() || u.no_backward) {
        gathers_.free(u);
      } else if (!root && !u.keep_gathered && policy_.free == free_point::after_forward) {
        if (reshard_comm_) gathers_.reshard(u, reshard_comm_->rank(), reshard_comm_->size());
        else if (!policy_.keeps_whole(comm_->size())) gathers_.free(u);
      }
    }
    if (root && ctx_.evaluating()) release_full_params();  // a prefetched unit that did not run
  }
  void pre_backward(unit_type& u) {
    check_flags(u);
    if (policy_.shard_parameters) {
      gather(u, true);
      gathers_.for_each_ahead(index_of(u), -1, [&](int k) {
        if (!units_[std::size_t(k)].no_backward) gather(units_[std::size_t(k)], false);
      });
    }
    if (policy_.shard_optimizer && u.full_grad.empty()) {  // or kept from earlier micro-batches under sync(false)
      u.full_grad = Buffer<C, space>(local_grad_size(u), category::gradients);
      ops::fill(u.full_grad.span(), C(0));
    }
    u.bind(u.values.data(), full_grads(u));
  }
  void post_backward(unit_type& u) {
    zero_frozen_grads(u);
    const bool kept = policy_.shard_parameters && !reshard_after_backward_;
    if (policy_.shard_parameters && !kept) gathers_.free(u);
    if (kept) u.bind(u.values.data(), nullptr);  // its full gradients may go with the reduction
    if (u.frozen()) {  // every gradient is zero: nothing to send (FSDP2 reduces only what has gradients)
      if (policy_.shard_optimizer) u.release_full_grad();
    } else if (sync_) {
      reducer_.issue(u, shard_comm(), *comm_);
    }
    if (&u == &units_[0]) finish_backward();
  }

 private:
  // step() without its checks: train_step's own step, after it scaled, reduced and decided.
  template <class O>
  void apply_step(O& opt, optim::skip_flag flag = {});

  // --- construction --------------------------------------------------------------------------
  void check_options();
  void make_groups();
  // policy::reshard_to = R, 1 < R < the shard group: groups of R consecutive ranks (nested
  // in the shard groups, which are consecutive too), within which backward all-gathers.
  void make_reshard_group();
  Comm& shard_comm() { return shard_comm_ ? *shard_comm_ : *comm_; }
  int shard_rank() const { return shard_comm_ ? shard_comm_->rank() : comm_->rank(); }
  int index_of(const unit_type& u) const { return int(&u - units_.data()); }
  // This rank's piece of unit i's masters and optimizer state (partition(i)'s).
  unit_piece piece(std::size_t i) const {
    const shard_layout l = partition(i);
    return {l.begin(partition_rank()), l.shard_size()};
  }

  // Replicated values kept in the master dtype hold the master themselves.
  bool master_in_values() const {
    return !policy_.shard_parameters && !compute16 && opts_.precision.param == dtype::f32;
  }
  // The master this rank steps: its piece (16-bit layers: compute_copies'), or the values' slice.
  std::span<T> master_local(unit_type& u) {
    if constexpr (compute16) {
      return copies_.master(u);
    } else {
      if (master_in_values()) {
        const auto l = partition(std::size_t(index_of(u)));
        return u.values.span().subspan(l.begin(partition_rank()), l.shard_size());
      }
      return u.master->local();
    }
  }

  // A unit's storage, initialised in place: each rank draws only what it holds,
  // which equals the unsharded initialisation there.
  void materialize(unit_type& u);
  // Elements of a unit's full local gradients: the unit's, or its trained ones alone.
  std::size_t local_grad_size(const unit_type& u) const {
    return u.local_trained_only() ? u.local_size : partition(std::size_t(index_of(u))).padded_size();
  }
  // Where layers write gradients: the full local gradients, or, when nothing is
  // sharded (fp32 layers only), the gradients the optimizer steps, reduced in place.
  C* full_grads(unit_type& u) {
    if constexpr (!compute16)
      if (!policy_.shard_optimizer) return u.grad.span().data();
    return u.full_grad.data();
  }

  bool mixed() const { return opts_.precision.param != dtype::f32 || opts_.precision.reduce != dtype::f32; }
  // Runs f; an error it raises comes back naming this rank.
  template <class F>
  void with_rank(F&& f) const {
    try {
      f();
    } catch (const error& e) {
      throw error(cat("rank ", comm_->rank(), ": ", e.what()));
    }
  }

  // --- parameters ------------------------------------------------------------------------------
  // Sharded parameters: issue u's all-gather (and, when `wait`, complete it).
  void gather(unit_type& u, bool wait) {
    const std::size_t i = std::size_t(index_of(u));
    Comm* regroup = reshard_comm_ ? &*reshard_comm_ : nullptr;
    if (wait) gathers_.ensure(u, shard_comm(), regroup, partition(i).padded_size(), master_local(u));
    else gathers_.gather(u, shard_comm(), regroup, partition(i).padded_size(), master_local(u));
  }
  // Replicated parameters after their masters changed: every rank's piece to
  // every rank (ZeRO-1; all units' gathers in flight at once), or the values
  // rounded to the param dtype (NoShard's copy layers read). Values that hold the
  // master themselves are current already, but for ZeRO-1's other slices.
  void refresh_values(unit_type& u);
  // Every unit's, or (after a step) those that own a trained parameter.
  void refresh_values(bool frozen_too = true);

  // summon_full_params' writeback: this rank's piece of unit u's full values into
  // its master piece (nothing to do where the values are the master), then the
  // replicated values or the 16-bit compute copy refreshed from the master.
  void write_back(unit_type& u);
  // Frees every gathered unit (waiting for gathers in flight first) and the parts kept after forward.
  void release_full_params() {
    if (policy_.shard_parameters)
      for (auto& u : units_) {
        if (u.where == state::gathering) gathers_.complete(u);
        if (u.where == state::gathered) gathers_.free(u);
        u.resharded.reset();
      }
  }

  // Layers read requires_grad as they run, the engine the flags it was wrapped with
  // (its layouts): a flag changed since would have them disagree on that parameter.
  void check_flags(const unit_type& u) const {
    const int k = u.changed_flag();
    if (k < 0) return;
    const auto& e = u.layout.entries[std::size_t(k)];
    throw error(cat("rank ", comm_->rank(), ": parameter '", e.name, "' has requires_grad ",
                    e.requires_grad ? "false" : "true", " but was wrapped with ", e.requires_grad ? "true" : "false",
                    ": set requires_grad (nn::freeze) before fully_shard"));
  }

  // --- gradients -------------------------------------------------------------------------------
  // Frozen parameters (requires_grad = false): what layers wrote as their gradients is
  // zeroed before anything reads it, so that a reduction that sends them (a unit not packed:
  // shard/packing.hpp), the norm and the step see zeros
  // (and the optimizer leaves their elements out: unit_optimizer's runs).
  void zero_frozen_grads(unit_type& u) {
    if (u.local_trained_only()) return;  // their grads were null
    for (const auto& e : u.layout.entries)
      if (!e.requires_grad) ops::fill(std::span<C>(full_grads(u) + e.offset, e.numel()), C(0));
  }
  // A unit whose layer did not run this pass (LayerDrop, a branch) may have been
  // prefetched along the recorded order: it is freed here, as FSDP2 reshards
  // everything at the end of backward.
  void finish_backward() {
    reducer_.finish_all_except(nullptr);
    if (reshard_after_backward_) release_full_params();
  }
  // Waits for every collective this rank issued, frees what is gathered and drops
  // the reductions' results; errors are dropped (the rank is already failing, or the
  // destructor runs).
  void drain() noexcept {
    for (auto& u : units_) {
      if (u.where == state::gathering) {
        try {
          u.gather_work.wait();
        } catch (...) {
        }
        u.scratch.send.reset();
        u.where = state::gathered;
      }
      if (policy_.shard_parameters && u.where == state::gathered) gathers_.free(u);
      u.resharded.reset();
    }
    reducer_.drain();
  }

  // --- optimizer -------------------------------------------------------------------------------
  void require_complete(std::string_view what) const {
    require(!incomplete_, "rank ", comm_->rank(), ": ", what, " after a backward that raised: the gradients are "
            "partial; call zero_grad() and run the step's micro-batches again");
  }
  // options.offload's step, pipelined per unit: unit i+1's reduced gradients travel to
  // the offload space while unit i steps there, and unit i's updated piece travels back
  // while unit i+1 steps (on the device, on the channel's side stream; the host copies
  // in the same order, one at a time). The next forward's gathers run after fence().
  template <class O>
  void offloaded_step(O& opt);

  // The sum of squares of the gradients the optimizer steps, over the ranks that hold
  // different shards (replicas hold the same values), left in the model's space.
  auto grad_norm_squared() {
    auto sum = ops::template make_scalars<double>(1);
    for (auto& u : units_) ops::add_sum_squares(std::span<const T>(u.grad.span()), sum.data());
    if (policy_.shard_optimizer)
      ops::all_reduce_in_place(shard_comm(), std::span<double>(sum.data(), 1), comm::reduce_op::sum);
    return sum;
  }

  // Whether train_step's skip decision is made where the model's values are: a device
  // model, an optimizer whose step a flag there can cancel, and no offload (whose
  // optimizer steps on the host).
  template <class O>
  bool decides_on_space() const {
    if constexpr (std::is_same_v<space, host_space> || !skips_on_space<O, T, C, typename Optimizer::state>)
      return false;
    else return !offload_;
  }
  // What the rest of train_step does when the space decides (train_step's comment):
  // the decision, clipping by its coefficient, the optimizer's step cancelled by its
  // flag, and a result read when the caller reads it.
  template <class O, class L, class Scalars, class Norm>
  pending_step_result step_decided_on_space(O& opt, const L& loss, Scalars shared, Norm norm_squared,
                                            const step_options& so);

  Model* model_;
  Comm* comm_;
  Strategy strategy_;
  shard::policy policy_;
  options opts_;
  std::optional<Comm> shard_comm_, replica_comm_, reshard_comm_;
  std::vector<unit_type> units_;  // units_[0] is the root
  std::map<std::pair<const void*, std::type_index>, int> index_;
  gather_schedule<unit_type, T, C, space, Comm> gathers_;
  gradient_reducer<unit_type, T, C, space, Comm> reducer_;
  bool sync_ = true;
  bool reshard_after_backward_ = true;  // set_reshard_after_backward
  bool unreduced_ = false;  // the last backward ran under sync(false)
  bool incomplete_ = false;  // a backward raised since the last zero_grad
  std::uint64_t forward_draws_ = 0;  // random streams drawn before the last forward: a pass that raises rewinds
  std::optional<std::uint64_t> stepped_;  // the step the context's random streams count from
  bool forwarded_ = false;  // a forward completed since the last backward
  loss_scale_state<space> scaler_{std::nullopt, 0};  // fp16 loss scaling (empty without)
  unit_optimizer<unit_type, Optimizer, T, C> steps_;
  compute_copies<unit_type, T, C, space> copies_;  // 16-bit layers only
  std::optional<typename space_ops<space>::offload_channel> offload_;  // options.offload
  std::uint64_t step_ = 0;
  sharded_context<ShardedModel> ctx_;
};

// Wraps `model` for training on the ranks of `comm` with a sharding strategy and
// the optimizer whose state the units keep (Adam unless named):
//   auto sharded = shard::fully_shard(model, comm, shard::FullShard{}, {.wrap = shard::wrap_types<Encoder>{}});
//   auto sharded = shard::fully_shard<optim::SGD>(model, comm, shard::NoShard{});
//   auto sharded = shard::fully_shard(model, comm, shard::NoShard{}, sgd, {...});
template <class Optimizer = optim::Adam, class T = float, nn::Layer Model, comm::Communicator Comm,
          ShardingStrategy Strategy>
ShardedModel<Model, Comm, Strategy, T, Optimizer> fully_shard(Model& model, Comm& comm, Strategy strategy,
                                                              options o = {}) {
  o.context.rank = comm.rank();
  return ShardedModel<Model, Comm, Strategy, T, Optimizer>(model, comm, strategy, std::move(o));
}
template <class T = float, nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class Optimizer>
  requires requires(const Optimizer& opt) { opt.make_state(std::size_t(1)); }
ShardedModel<Model, Comm, Strategy, T, Optimizer> fully_shard(Model& model, Comm& comm, Strategy strategy,
                                                              const Optimizer&, options o = {}) {
  return fully_shard<Optimizer, T>(model, comm, strategy, std::move(o));
}

}  // namespace shardlib::shard

// The members defined outside the class, by concern.
#include "shardlib/shard/sharded_model_construction.hpp"
#include "shardlib/shard/sharded_model_parameters.hpp"
#include "shardlib/shard/sharded_model_step.hpp"
