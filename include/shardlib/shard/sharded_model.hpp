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

#include <cmath>        // std::sqrt, std::isfinite
#include <concepts>     // std::same_as
#include <cstdint>      // std::uint64_t, std::int64_t
#include <map>          // std::map
#include <memory>       // std::make_shared
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
//   the step's order, offload, clipping, loss scaling, state access
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
  ShardedModel(Model& model, Comm& comm, Strategy strategy, options o)
      : model_(&model),
        comm_(&comm),
        strategy_(strategy),
        policy_(checked_policy(strategy)),
        opts_(std::move(o)),
        gathers_(opts_.precision, opts_.prefetch),
        reducer_(policy_, opts_.precision),
        steps_(comm.rank()),
        copies_(opts_.seed),
        ctx_(this, opts_.context, checkpoints(model, opts_.checkpoint)) {
    check_precision(opts_.precision);
    if constexpr (!std::is_same_v<T, float>)
      with_rank([&] {
        require(opts_.precision.param == dtype::f32 && opts_.precision.reduce == dtype::f32,
                "ShardedModel: float64 masters gather and reduce in float64; precision.param and precision.reduce "
                "must stay F32 (no 16-bit rounding), got ", name(opts_.precision.param), " and ",
                name(opts_.precision.reduce));
      });
    ops::check_stream(comm, comm.rank());
    check_options();
    if (opts_.precision.param == dtype::f16 || opts_.precision.reduce == dtype::f16) {
      with_rank([&] { check_scaler(opts_.scaler); });
      scaler_ = loss_scale_state<space>(opts_.scaler, comm.rank());
    }
    make_groups();
    if (opts_.offload) copies_.set_offload(&offload_.emplace());
    for (auto& spec : discover_units<C>(model, opts_.wrap)) {
      index_[{spec.address, spec.type}] = int(units_.size());
      auto& u = units_.emplace_back();
      u.name = std::move(spec.name);
      u.params = std::move(spec.params);
      u.layout = std::move(spec.layout);
      u.aliases = std::move(spec.aliases);
      std::size_t owned = 0;  // as wrap policies count: no alignment gaps
      for (const auto* p : u.params) owned += p->numel();
      u.keep_gathered = units_.size() > 1 && opts_.keep_gathered(u.name, spec.type, owned);
    }
    for (auto& u : units_)  // names for errors: the layouts no longer move
      for (std::size_t k = 0; k < u.params.size(); ++k) u.params[k]->owner_name = u.layout.entries[k].name;
    check_same_model<ops>(comm, units_, strategy_.name, policy_, opts_.seed, sizeof(T), sizeof(C));
    make_reshard_group();  // after the check: ranks that disagree on it would split differently
    for (auto& u : units_) materialize(u);
    if (!policy_.shard_parameters && !master_in_values()) {
      try {
        refresh_values();
      } catch (...) {
        drain();  // no destructor runs: the gathers still in flight write into units_
        throw;
      }
    }
  }
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
      forwarded_ = !ctx_.in_no_grad();  // a forward inside context().no_grad(f) has no backward
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
            "completed after the previous backward");
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
  void summon_full_params(F&& f, summon_options o = {}) {
    const int r = comm_->rank();
    require(!(o.rank0_only && o.writeback), "rank ", r, ": summon_full_params: rank0_only needs writeback = false");
    if constexpr (!std::is_same_v<space, host_space>)
      require(!o.writeback || (!compute16 && opts_.precision.param == dtype::f32), "rank ", r,
              ": summon_full_params: writing back 16-bit values is a host path; use writeback = false");
    for (auto& u : units_)
      require(!policy_.shard_parameters || u.where == state::sharded, "rank ", r, ": summon_full_params while unit '",
              u.name, "' is gathered: call it between steps (eval() releases a forward without its backward)");
    const bool keep = !o.rank0_only || r == 0;
    if (policy_.shard_parameters)
      for (auto& u : units_) {
        gather(u, true);
        if (keep) u.bind(u.values.data(), nullptr);
        else gathers_.free(u);
      }
    try {
      f();
    } catch (...) {
      release_full_params();
      throw;
    }
    if (o.writeback)
      for (auto& u : units_) write_back(u);
    release_full_params();
  }

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
      if (policy_.shard_gradients) u.full_grad.reset();  // drops gradients accumulated under sync(false)
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
    float coefficient = 1;
    with_rank([&] { coefficient = optim::clip_coefficient(total, max_norm); });
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
  step_result_of<space> train_step(O& opt, const input& x, const Target& y, LossFn&& loss_fn,
                                   const step_options& so = {}) {
    return run_step(opt, std::span<const input>(&x, 1), std::span<const Target>(&y, 1), loss_fn, so, false);
  }
  // The same over micro-batches (gradient accumulation): xs[k] and ys[k] for k < xs.size(),
  // each forward and backward in turn, one optimizer step after the last. Each loss gradient
  // is divided by their number, so that with equal micro-batches the step follows the
  // gradient of their mean loss, which it reports (fp16: the overflow vote covers them all).
  // so.no_sync, reshard_after_backward and replica_all_reduce say how the micro-batches before
  // the last run. Ranks must pass as many micro-batches and the same options: they compare them, and
  // whether each rank can run the step at all, in one all-reduce of ten integers (on a
  // device a host wait), and all raise if one differs or cannot.
  //   std::vector<Tensor<float>> xs = ..., ys = ...;   // four micro-batches
  //   model.train_step(adamw, xs, ys, nn::cross_entropy, {.max_norm = 1, .no_sync = true});
  template <class O, std::ranges::contiguous_range Inputs, std::ranges::contiguous_range Targets, class LossFn>
    requires std::same_as<std::ranges::range_value_t<Inputs>, input>
  step_result_of<space> train_step(O& opt, const Inputs& xs, const Targets& ys, LossFn&& loss_fn,
                                   const step_options& so = {}) {
    using target = std::ranges::range_value_t<Targets>;
    return run_step(opt, std::span<const input>(std::ranges::data(xs), std::ranges::size(xs)),
                    std::span<const target>(std::ranges::data(ys), std::ranges::size(ys)), loss_fn, so, true);
  }

 private:
  template <class O, class Target, class LossFn>
  step_result_of<space> run_step(O& opt, std::span<const input> xs, std::span<const Target> ys, LossFn& loss_fn,
                                 const step_options& so, bool micro_batches) {
    const int rank = comm_->rank();
    std::string problem;  // why this rank cannot run the step ("": it can)
    if (so.max_norm < 0)
      problem = cat("rank ", rank, ": step_options.max_norm must be >= 0 (0: no clipping), got ", so.max_norm);
    else if (!sync_)
      problem = cat("rank ", rank, ": train_step under set_sync(false) (no_sync): its backward would not reduce the "
                    "gradients across ranks, and it runs one whole step; call it with sync on");
    else if (xs.empty() || xs.size() != ys.size())
      problem = cat("rank ", rank, ": train_step over ", xs.size(), " micro-batches of inputs and ", ys.size(),
                    " of targets: it needs one or more of each, as many");
    else if (xs.size() > 1 && !so.no_sync && so.reduction == grad_reduction::sum &&
             (policy_.reduce == reduction::all_reduce || policy_.reduce == reduction::hierarchical))
      problem = cat("rank ", rank, ": train_step over ", xs.size(), " micro-batches each reduced with "
                    "grad_reduction::sum under ", strategy_.name, ": its all-reduce would sum again what the earlier "
                    "micro-batches reduced; use no_sync (one reduction a step) or average");
    if (micro_batches) check_micro_batches(xs.size(), so, problem);
    require(problem.empty(), problem);
    const std::size_t n = xs.size();
    const bool on_space = (scaler_ || so.max_norm > 0) && decides_on_space<O>();
    const double* loss_scale = on_space && scaler_ ? scaler_.in_space().data() + scale_slot : nullptr;
    zero_grad();
    using loss_type = std::remove_cvref_t<decltype(loss_fn(std::declval<output&>(), ys[0]).loss)>;
    std::vector<loss_type> losses;
    const bool reshard_last = reshard_after_backward_;  // as the caller set it
    reducer_.set_op(so.reduction == grad_reduction::sum ? comm::reduce_op::sum : comm::reduce_op::avg);
    try {
      for (std::size_t k = 0; k < n; ++k) {
        const bool last = k + 1 == n;
        sync_ = last || !so.no_sync;
        reshard_after_backward_ = last ? reshard_last : so.reshard_after_backward;
        using replicas = typename decltype(reducer_)::replicas;
        reducer_.set_replicas_mode(so.replica_all_reduce ? replicas::each
                                   : !last                ? replicas::skip
                                   : so.no_sync           ? replicas::each
                                                          : replicas::after_skip);
        auto out = forward(xs[k]);
        auto l = loss_fn(out, ys[k]);
        if (n > 1 || scaler_)  // rounded once, in fp32, when the layers compute in 16 bits
          in_fp32<space>(l.grad.span(), [&](auto g) {
            if (n > 1) ops::scale(g, 1.f / float(n));
            if (scaler_) scaler_.scale(g, loss_scale, false);
          });
        backward(l.grad);
        losses.push_back(std::move(l.loss));
      }
    } catch (...) {
      sync_ = true;
      reshard_after_backward_ = reshard_last;
      reducer_.set_op(comm::reduce_op::avg);  // a later backward of the caller's averages
      reducer_.set_replicas_mode(decltype(reducer_)::replicas::each);
      throw;
    }
    reducer_.set_op(comm::reduce_op::avg);
    reducer_.set_replicas_mode(decltype(reducer_)::replicas::each);
    const auto loss = mean_loss<ops>(std::move(losses));
    // The loss and the units whose gradients overflowed, in the model's space.
    auto shared = ops::template make_scalars<float>(2);
    const bool global = scaler_ || so.loss == loss_report::global_mean;  // every rank decides alike
    if (global) put_loss<ops>(loss, std::span<float>(shared.data(), 1));
    if (scaler_)
      for (auto& u : units_) ops::add_nonfinite(std::span<const float>(u.grad.span()), shared.data() + 1);
    if (global) ops::all_reduce_in_place(*comm_, std::span<float>(shared.data(), 2), comm::reduce_op::sum);
    if (scaler_)  // also after an overflow, so that the norm reported is the unscaled one (inf or NaN)
      for (auto& u : units_) scaler_.scale(u.grad.span(), loss_scale, true);
    std::optional<typename ops::template scalars<double>> norm_squared;
    if (so.max_norm > 0) norm_squared.emplace(grad_norm_squared());
    if constexpr (!std::is_same_v<space, host_space>)
      if (on_space) return step_decided_on_space(opt, loss, std::move(shared), std::move(norm_squared), so);

    const float world = float(comm_->size());
    const bool mean = so.loss == loss_report::global_mean;
    step_result_of<space> r{};
    float seen[2] = {0.f, 0.f};  // shared, on the host once read
    double squared = 0;
    auto issue_reads = [&] {
      ops::issue_to_host(std::span<const float>(shared.data(), 2), std::span<float>(seen));
      if (norm_squared)
        ops::issue_to_host(std::span<const double>(norm_squared->data(), 1), std::span<double>(&squared, 1));
    };
    if (scaler_ || so.max_norm > 0) {  // the host decides: one read of everything, the loss's own read with it
      const float own = read_with<ops>(loss, issue_reads);
      r.loss = mean ? seen[0] / world : own;
    } else if constexpr (std::is_same_v<space, host_space>) {
      issue_reads();
      r.loss = mean ? seen[0] / world : float(loss);
    } else {
      r.loss = mean ? deferred_mean<ops>(loss, std::move(shared), world) : pending<float>(loss);
    }
    const bool overflow = seen[1] != 0.f;
    r.skipped = overflow;
    if (so.max_norm > 0) {
      const double norm = std::sqrt(squared);
      r.grad_norm = float(norm);
      r.skipped = r.skipped || !std::isfinite(norm);
      if (!r.skipped) {
        const float coefficient = optim::clip_coefficient(norm, so.max_norm);
        for (auto& u : units_) ops::scale(u.grad.span(), coefficient);
      }
    }
    if (r.skipped) ++step_;  // parameters and optimizer state stay as they were
    else apply_step(opt);
    if (scaler_) with_rank([&] { scaler_.host().update(overflow); });  // raises on every rank alike: the flag is shared
    return r;
  }
  // Ranks that ran different micro-batches would pair their collectives wrongly (a kept unit's
  // gather with another's of the same size), and a rank that raised alone would leave the
  // others waiting: whether each can run the step (`problem` empty), the count and the three
  // options, compared as maxima of the values and of their negations, and raised on every rank.
  void check_micro_batches(std::size_t inputs, const step_options& so, const std::string& problem) {
    const int rank = comm_->rank();
    constexpr std::size_t n = 5;
    const std::int64_t mine[n] = {problem.empty(), std::int64_t(inputs), so.no_sync, so.reshard_after_backward,
                                  so.replica_all_reduce};
    std::vector<std::int64_t> both(2 * n);
    for (std::size_t i = 0; i < n; ++i) both[i] = mine[i], both[i + n] = -mine[i];
    ops::all_reduce_values(*comm_, std::span<std::int64_t>(both), comm::reduce_op::max);
    require(problem.empty(), problem);
    require(both[n] < 0, "rank ", rank, ": train_step over micro-batches: another rank cannot run it (its error "
            "says why)");
    static constexpr const char* what[n] = {"", "micro-batch counts", "no_sync", "reshard_after_backward",
                                            "replica_all_reduce"};
    for (std::size_t i = 1; i < n; ++i)
      require(both[i] == -both[i + n], "rank ", rank, ": train_step over ", inputs, " micro-batches (no_sync ",
              so.no_sync, ", reshard_after_backward ", so.reshard_after_backward, ", replica_all_reduce ",
              so.replica_all_reduce, "): the ranks passed other ", what[i], " (from ", -both[i + n], " to ", both[i],
              "); every rank must run the same micro-batches");
  }

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
  std::vector<named_tensor> full_state_dict(bool rank0_only = true) {
    const bool keep = !rank0_only || comm_->rank() == 0;
    std::map<std::string, std::size_t> position;  // the model's own order
    model_->parameters([&](std::string_view name, auto&) { position.emplace(std::string(name), position.size()); });
    std::vector<named_tensor> out(keep ? position.size() : 0);
    for (std::size_t i = 0; i < units_.size(); ++i) {
      // An offloaded master is host memory: gathered, it goes to the model's space first
      // (the communicator's memory); alone, the host reads it in place.
      auto collect = [&](std::span<const T> values, bool on_host, bool whole) {
        Buffer<T, space> full, uploaded;
        if (!whole && partitions() > 1) {
          if (on_host) {
            uploaded = Buffer<T, space>(values.size(), category::comm_scratch);
            ops::from_host(values, uploaded.span());
            values = uploaded.span();
          }
          full = Buffer<T, space>(partition(i).padded_size(), category::gathered_parameters);
          shard_comm().all_gather(values, full.span());
          values = full.span();
          on_host = false;
        }
        if (!keep) return;
        for (const auto& e : units_[i].layout.entries) {
          Tensor<T> t(e.shape, category::parameters);
          if (on_host) offload_ops::copy(values.subspan(e.offset, e.numel()), t.span());
          else ops::to_host(values.subspan(e.offset, e.numel()), t.span());
          out[position.at(e.name)] = {e.name, std::move(t)};
        }
      };
      bool whole = false;  // replicated values that hold the master: everything is here
      if constexpr (!compute16)
        if (master_in_values()) {
          collect(std::span<const T>(units_[i].values.span()), false, true);
          whole = true;
        }
      if (!whole)
        with_master_piece(i, [&](std::span<const T> values, auto where) {
          collect(values, !std::is_same_v<typename decltype(where)::type, space>, false);
        });
      if (!keep) continue;
      for (const auto& a : units_[i].aliases)
        out[position.at(a.name)] = {a.name, out[position.at(units_[i].layout.entries[a.entry].name)].value};
    }
    return out;
  }

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
      if (policy_.shard_optimizer) u.full_grad.reset();
    } else if (sync_) {
      reducer_.issue(u, shard_comm(), *comm_);
    }
    if (&u == &units_[0]) finish_backward();
  }

 private:
  // step() without its checks: train_step's own step, after it scaled, reduced and decided.
  template <class O>
  void apply_step(O& opt, optim::skip_flag flag = {}) {
    static_assert(std::is_same_v<std::remove_cvref_t<O>, Optimizer>,
                  "ShardedModel::step: the model keeps optimizer state of the type it was wrapped for; wrap it "
                  "with fully_shard<YourOptimizer>(...) or fully_shard(model, comm, strategy, optimizer, options)");
    // A forward without its backward left units gathered (the root, kept units, ShardGradOp's):
    // their values would be the old ones at the next forward, which finds them gathered.
    release_full_params();
    forwarded_ = false;
    steps_.check(opt, units_, [&](std::size_t i) { return piece(i); });
    if (offload_) {
      require(!flag.skip, "rank ", comm_->rank(), ": a step cancelled on the device cannot be offloaded");
      offloaded_step(opt);
    } else {
      for (std::size_t i = 0; i < units_.size(); ++i) {
        auto& u = units_[i];
        // a compact unit's optimizer steps its trained runs end to end, rounded into place after
        steps_.template step<ops>(opt, u, i, piece(i), master_local(u), std::span<const T>(u.grad.span()),
                                  u.compact() ? std::span<C>{} : u.compute_shard.span(), flag);
        if constexpr (compute16)
          if (u.compact()) copies_.template round_runs<ops>(u, master_local(u), u.compute_shard.span());
      }
    }
    if (!policy_.shard_parameters) refresh_values(false);  // a wholly frozen unit's values did not change
    ++step_;
  }

  // --- construction --------------------------------------------------------------------------
  void check_options() {
    const int r = comm_->rank();
    require(opts_.prefetch >= 0, "rank ", r, ": options.prefetch must be at least 0, got ", opts_.prefetch);
    require(std::is_same_v<T, float> || !mixed(), "rank ", r, ": mixed precision needs float parameters");
    if constexpr (compute16) {
      require(opts_.precision.param == dtype_of<C>, "rank ", r, ": the model computes in ", name(dtype_of<C>),
              ", so mixed_precision.param must be ", name(dtype_of<C>), ", got ", name(opts_.precision.param));
      require(opts_.precision.reduce == dtype::f32 || opts_.precision.reduce == dtype_of<C>, "rank ", r, ": with ",
              name(dtype_of<C>), " compute, mixed_precision.reduce must be F32 or ", name(dtype_of<C>), ", got ",
              name(opts_.precision.reduce));
      require(policy_.shard_optimizer, "rank ", r, ": 16-bit compute (a model of ", name(dtype_of<C>),
              " layers) keeps fp32 masters beside the values, which ", strategy_.name,
              " does not shard: use a strategy that shards at least optimizer state (ShardOptimizer and up)");
    } else if constexpr (!std::is_same_v<space, host_space>) {
      // 16-bit gathers and reductions of fp32 layers change dtype in place, which is a host loop.
      require(!mixed(), "rank ", r, ": on the device, 16-bit precision means 16-bit compute: build the "
              "model's layers in bfloat16 or half");
    }
  }
  void make_groups() {
    if (policy_.group_size == 0) return;
    const int g = policy_.group_size, w = comm_->size(), r = comm_->rank();
    require(w % g == 0, "rank ", r, ": ", strategy_.name, " group_size ", g, " must divide the world size ", w);
    shard_comm_.emplace(comm_->split(r / g, r));    // the ranks that shard one replica
    replica_comm_.emplace(comm_->split(r % g, r));  // the same shard in every replica
    reducer_.set_replicas(&*replica_comm_);
  }
  // policy::reshard_to = R, 1 < R < the shard group: groups of R consecutive ranks (nested
  // in the shard groups, which are consecutive too), within which backward all-gathers.
  void make_reshard_group() {
    const int g = policy_.group(comm_->size()), r = comm_->rank();
    require(policy_.reshard_to == 0 || g % policy_.reshard_to == 0, "rank ", r, ": ", strategy_.name, " reshard_to ",
            policy_.reshard_to, " must divide the shard group's ", g, " ranks");
    if (const int R = policy_.regather(comm_->size()); R > 1 && R < g) reshard_comm_.emplace(comm_->split(r / R, r));
  }
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
  void materialize(unit_type& u) {
    const std::size_t i = std::size_t(index_of(u));
    const shard_layout part = partition(i);
    const int pr = partition_rank();
    // A unit of frozen parameters keeps no reduced gradients (none are ever reduced), unless
    // they are where its layers write (replicated fp32 layers, nothing sharded); one whose
    // reduce-scatter packs its trained elements keeps those alone.
    const bool scattered = policy_.reduce != reduction::all_reduce;  // each rank receives its piece
    u.packing = trained_packing(u.layout, part, scattered);
    const bool no_grads = u.frozen() && (compute16 || policy_.shard_optimizer);
    const bool trained_only = u.packing.packed() && scattered;
    const std::size_t reduced = no_grads ? 0 : trained_only ? u.packing.trained[std::size_t(pr)] : part.shard_size();
    // Full local gradients of the trained elements alone: where the reduction sends them alone.
    if (!opts_.frozen_grads && policy_.shard_optimizer && (u.frozen() || trained_only)) {
      std::size_t frozen_before = 0;
      for (const auto& e : u.layout.entries) {
        u.local_offsets.push_back(e.requires_grad ? e.offset - frozen_before : unit_type::npos);
        if (!e.requires_grad) frozen_before += e.numel();
      }
      u.local_size = u.frozen() ? 0 : part.padded_size() - frozen_before;
    }
    // Frozen elements without masters: only where the step's gradients leave them out too.
    if (compute16 && !opts_.frozen_masters && (no_grads || trained_only)) {
      auto runs = shard::piece_runs(u, piece(i));
      if (optim::trained_size(runs) < part.shard_size()) u.compact_runs = std::move(runs);
    }
    const std::size_t mastered = u.compact() ? optim::trained_size(u.compact_runs) : part.shard_size();
    // Masters are drawn in place as the model's space draws them (16-bit layers: by compute_copies::draw).
    if (offload_) {  // the optimizer's side
      ledger_scope in_offload(current_ledger().offload());
      auto& o = u.offload.emplace();
      o.master = Buffer<T, offload_space>(mastered, category::parameters);
      if constexpr (!compute16) offload_ops::initialize(u.layout, opts_.seed, part.begin(pr), o.master.span());
      o.grad = Buffer<T, offload_space>(reduced, category::gradients);
      if constexpr (compute16) o.compute_copy = Buffer<C, offload_space>(part.shard_size(), category::parameters);
    }
    if (u.compact()) {
      if (!offload_) u.trained_master = Buffer<T, space>(mastered, category::parameters);
    } else if (!master_in_values() && !(compute16 && offload_)) {
      u.master.emplace(part.numel, part.world, pr, category::parameters);
      if constexpr (!compute16) ops::initialize(u.layout, opts_.seed, part.begin(pr), u.master->local());
    }
    if constexpr (compute16) {
      u.compute_shard = Buffer<C, space>(part.shard_size(), category::parameters);
      copies_.draw(u, part.begin(pr));
    }
    u.grad = Buffer<T, space>(reduced, category::gradients);
    ops::fill(u.grad.span(), T(0));
    if (policy_.shard_parameters) return;
    // Replicated values, padded like the partition so that ZeRO-1 all-gathers in place.
    u.values = Buffer<C, space>(part.padded_size(),
                                master_in_values() ? category::parameters : category::gathered_parameters);
    if (master_in_values()) ops::initialize(u.layout, opts_.seed, 0, u.values.span());
    u.where = state::gathered;
    // ZeRO-1: full local gradients always kept, but a wholly frozen unit's (made for its backward only)
    if (policy_.shard_optimizer && !policy_.shard_gradients && !u.frozen()) {
      u.full_grad = Buffer<C, space>(local_grad_size(u), category::gradients);
      ops::fill(u.full_grad.span(), C(0));
    }
    u.bind(u.values.data(), full_grads(u));
  }
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
  void refresh_values(unit_type& u) {
    if (partitions() > 1) {
      gathers_.issue(u, shard_comm(), u.values.span(), master_local(u));
      gathers_.complete(u);
    } else if (!master_in_values()) {
      if constexpr (compute16) {
        ops::copy(std::span<const C>(u.compute_shard.span()), u.values.span());
      } else {
        with_16bit<T>(opts_.precision.param, [&](auto h) {
          ops::template round_to<decltype(h)>(std::span<const T>(u.master->local()), u.values.span());
        });
      }
    }
  }
  // Every unit's, or (after a step) those that own a trained parameter.
  void refresh_values(bool frozen_too = true) {
    auto changed = [&](const unit_type& u) { return frozen_too || !u.frozen(); };
    if (partitions() == 1) {
      for (auto& u : units_)
        if (changed(u)) refresh_values(u);
      return;
    }
    for (auto& u : units_)
      if (changed(u)) gathers_.issue(u, shard_comm(), u.values.span(), master_local(u));
    for (auto& u : units_)
      if (changed(u)) gathers_.complete(u);
  }

  // summon_full_params' writeback: this rank's piece of unit u's full values into
  // its master piece (nothing to do where the values are the master), then the
  // replicated values or the 16-bit compute copy refreshed from the master.
  void write_back(unit_type& u) {
    const auto part = partition(std::size_t(index_of(u)));
    auto master = master_local(u);
    const auto full = std::span<const C>(u.values.span()).subspan(part.begin(partition_rank()), part.shard_size());
    if constexpr (compute16) {
      if constexpr (std::is_same_v<space, host_space>) copies_.write_back(u, full);
    } else if (opts_.precision.param == dtype::f32) {
      if (!master_in_values()) ops::copy(full, master);
    } else if constexpr (std::is_same_v<space, host_space>) {
      with_16bit<T>(opts_.precision.param, [&](auto h) {
        using H = decltype(h);
        for (std::size_t k = 0; k < master.size(); ++k)
          if (full[k] != T(H(master[k]))) master[k] = full[k];
      });
    }
    if (u.offload && !compute16) offload_->wait(offload_->to_offload(std::span<const T>(master), u.offload->master.span()));
    if (!policy_.shard_parameters) refresh_values(u);
  }
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
  void offloaded_step(O& opt) {
    auto& channel = *offload_;
    std::vector<typename space_ops<space>::offload_channel::ticket> sent(units_.size());
    auto send = [&](std::size_t i) {
      sent[i] = channel.to_offload(std::span<const T>(units_[i].grad.span()), units_[i].offload->grad.span());
    };
    if (!units_.empty()) send(0);
    for (std::size_t i = 0; i < units_.size(); ++i) {
      if (i + 1 < units_.size()) send(i + 1);
      channel.wait(sent[i]);
      auto& u = units_[i];
      auto& o = *u.offload;
      steps_.template step<offload_ops>(opt, u, i, piece(i), o.master.span(), std::span<const T>(o.grad.span()),
                                        u.compact() ? std::span<C>{} : o.compute_copy.span());
      if constexpr (compute16) {
        if (u.compact()) copies_.template round_runs<offload_ops>(u, o.master.span(), o.compute_copy.span());
        channel.from_offload(std::span<const C>(o.compute_copy.span()), u.compute_shard.span());
      } else {
        channel.from_offload(std::span<const T>(o.master.span()), master_local(u));
      }
    }
    channel.fence();
  }

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
                                            const step_options& so) {
    auto outcome = std::make_shared<typename ops::template scalars<double>>(
        ops::template make_scalars<double>(outcome_slots));
    const step_rule rule{so.max_norm, bool(scaler_), scaler_ ? scaler_.host() : loss_scaler{}};
    ops::decide_step(rule, shared.data(), norm_squared ? norm_squared->data() : nullptr,
                     scaler_ ? scaler_.in_space().data() : nullptr, outcome->data());
    if (so.max_norm > 0)
      for (auto& u : units_) ops::scale_by(u.grad.span(), outcome->data() + coefficient_slot, false);
    apply_step(opt, optim::skip_flag{outcome->data() + skip_slot});
    return read_step_result<ops>(loss, std::move(shared), std::move(outcome), so, float(comm_->size()), comm_->rank(),
                                 rule.scaler.min_scale);
  }

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
