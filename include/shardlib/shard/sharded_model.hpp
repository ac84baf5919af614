// shardlib/shard/sharded_model.hpp — ShardedModel: a model's parameters, gradients and
// optimizer state sharded across the ranks of a communicator, and fully_shard to make one.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/random.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/flat.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/optim/clip.hpp"
#include "shardlib/shard/precision.hpp"
#include "shardlib/shard/space_ops.hpp"
#include "shardlib/shard/strategy.hpp"
#include "shardlib/shard/unit.hpp"
#include "shardlib/shard/wrap.hpp"

#include <algorithm>      // std::fill_n, std::find
#include <cmath>          // std::sqrt
#include <cstdint>        // std::uint64_t
#include <functional>     // std::function
#include <memory>         // std::shared_ptr
#include <optional>       // std::optional
#include <string>         // std::string
#include <type_traits>    // std::is_same_v
#include <typeindex>      // std::type_index
#include <map>            // std::map
#include <unordered_set>  // std::unordered_set
#include <utility>        // std::declval, std::pair
#include <vector>         // std::vector

namespace shardlib::shard {

struct options {
  // Which layers become units; the model is always the root unit. A function of
  // the layer's dotted name and type: wrap_types<...>{}, wrap_names{...}, wrap_none{}.
  std::function<bool(std::string_view, std::type_index)> wrap = wrap_none{};
  std::uint64_t seed = 0;  // initial values: element i of parameter p is drawn from (seed, p, i)
  int prefetch = 1;        // units whose all-gather is issued ahead of the one running
  mixed_precision precision{};  // gather / reduce dtypes; F16 turns on dynamic loss scaling in train_step
  loss_scaler scaler{};         // its initial scale and growth rule
  nn::context::options context{};  // training flag, dropout seed (rank and step are set by the model)
};

template <class Engine>
class sharded_context;

// The model, wrapped: forward, backward and step run the sharding strategy's
// communication around each unit (see ../../docs/design.md, "Sharding engine").
//
// T is the master dtype. The model's output tensor type says the rest: its
// memory space is where every shard and gathered buffer lives (host_space, or
// cuda_space with shard/cuda/space_ops.cuh), and its element type C is the dtype
// layers compute in — T, or a 16-bit type (16-bit compute: fp32 master and
// optimizer state, C-typed gathers and layer gradients; precision.param must
// then name C, and precision.reduce C or F32).
template <nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy, class T = float>
class ShardedModel {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "ShardedModel: master parameters are float or double");

 public:
  using input = typename Model::input;
  using output = typename Model::output;
  using space = typename output::space;
  using compute_type = typename output::value_type;
  // What the communicator's asynchronous collectives return (comm::work, NcclComm's nccl_work, ...).
  using work_type = decltype(std::declval<Comm&>().all_gather_async(std::span<const T>{}, std::span<T>{}));
  using unit_type = unit<T, compute_type, space, work_type>;
  using state = typename unit_type::state;

 private:
  using C = compute_type;
  using ops = space_ops<space>;
  static constexpr bool compute16 = !std::is_same_v<C, T>;
  static constexpr bool on_host = std::is_same_v<space, host_space>;
  static_assert(EngineSpace<space>, "ShardedModel: no space_ops for the model's memory space (for cuda_space, "
                                    "include shardlib/shard/cuda/space_ops.cuh)");
  static_assert(!compute16 || (std::is_same_v<T, float> && (std::is_same_v<C, bfloat16> || std::is_same_v<C, half>)),
                "ShardedModel: layers compute in the master dtype or, with float masters, in bfloat16 or half");
  static_assert(!compute16 || Strategy::shards_parameters,
                "ShardedModel: 16-bit compute (a model of bfloat16 or half layers) is implemented for the strategies "
                "that shard parameters (FullShard, ShardGradOp, HybridShard)");

 public:

  ShardedModel(Model& model, Comm& comm, Strategy strategy, options o)
      : model_(&model), comm_(&comm), strategy_(strategy), opts_(std::move(o)), ctx_(this, opts_.context) {
    check_precision(opts_.precision);
    ops::check_stream(comm, comm.rank());
    require(std::is_same_v<T, float> || !mixed(), "ShardedModel: mixed precision needs float parameters");
    if constexpr (compute16) {
      require(opts_.precision.param == dtype_of<C>, "rank ", comm.rank(), ": the model computes in ", name(dtype_of<C>),
              ", so mixed_precision.param must be ", name(dtype_of<C>), ", got ", name(opts_.precision.param));
      require(opts_.precision.reduce == dtype::f32 || opts_.precision.reduce == dtype_of<C>, "rank ", comm.rank(),
              ": with ", name(dtype_of<C>), " compute, mixed_precision.reduce must be F32 or ", name(dtype_of<C>),
              ", got ", name(opts_.precision.reduce));
    } else if constexpr (!on_host) {
      // 16-bit gathers and reductions of fp32 layers change dtype in place, which is a host loop.
      require(!mixed(), "rank ", comm.rank(), ": on the device, 16-bit precision means 16-bit compute: build the "
              "model's layers in bfloat16 or half");
    }
    if (opts_.precision.param == dtype::f16 || opts_.precision.reduce == dtype::f16) scaler_ = opts_.scaler;
    make_groups();
    discover(model, std::string(), true);
    check_structure();
    for (auto& u : units_) materialize(u);
    if constexpr (!Strategy::shards_parameters)
      for (auto& u : units_) {
        T* grads = std::is_same_v<Strategy, ShardOptimizer> ? u.full_grad.data() : u.grad->local().data();
        if (opts_.precision.param != dtype::f32) {  // layers read a copy rounded to the param dtype
          u.gathered = Buffer<T, space>(u.master->local().size(), category::gathered_parameters);
          refresh_compute_copy(u);
          u.bind(u.gathered.data(), grads);
        } else {
          u.bind(u.master->local().data(), grads);
        }
      }
  }
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  Model& model() { return *model_; }
  Comm& comm() { return *comm_; }
  sharded_context<ShardedModel>& context() { return ctx_; }
  const std::vector<unit_type>& units() const { return units_; }
  std::uint64_t steps() const { return step_; }

  output forward(const input& x) {
    ops::check_stream(*comm_, comm_->rank());
    ctx_.set_step(step_);
    return ctx_.forward(*model_, x);
  }
  input backward(const output& dy) { return ctx_.backward(*model_, dy); }

  // Micro-batches run with sync(false) only accumulate gradients locally (in the
  // unsharded gradient buffers, as PyTorch's no_sync); the next backward with
  // sync(true) reduces everything accumulated.
  void set_sync(bool on) { sync_ = on; }

  void zero_grad() {
    for (auto& u : units_) {
      require(!u.reducing, "zero_grad: a gradient reduction of unit '", u.name, "' is still pending");
      ops::fill(u.grad->local(), T(0));
      if constexpr (std::is_same_v<Strategy, ShardOptimizer>) ops::fill(u.full_grad.span(), T(0));
      else u.full_grad.reset();  // drops gradients accumulated under sync(false)
      u.grad_clean = true;
    }
  }

  // Scales all gradients so their global 2-norm is at most max_norm (PyTorch's
  // clip_grad_norm_) and returns the norm before clipping. Each rank sums the
  // squares of the gradients it owns, and the sum runs over the ranks that hold
  // different shards only: replicas (NoShard, HybridShard's other groups) hold
  // the same values and must not be counted twice. Call after backward.
  float clip_grad_norm(float max_norm) {
    double local = 0;
    for (auto& u : units_) local += ops::sum_squares(std::span<const T>(u.grad->local()));
    std::vector<double> sum{local};
    if constexpr (std::is_same_v<Strategy, ShardOptimizer>) ops::all_reduce_values(*comm_, std::span<double>(sum), comm::reduce_op::sum);
    else if constexpr (Strategy::shards_parameters) ops::all_reduce_values(shard_comm(), std::span<double>(sum), comm::reduce_op::sum);
    const double total = std::sqrt(sum[0]);
    const float coefficient = optim::clip_coefficient(total, max_norm);
    for (auto& u : units_) ops::scale(u.grad->local(), coefficient);
    return float(total);
  }

  // Every rank steps its own shard with its own optimizer state.
  template <class Optimizer>
  void step(Optimizer& opt) {
    for (auto& u : units_) {
      auto& state = state_for(opt, u);
      auto [values, grads] = optimizer_span(u);
      if constexpr (compute16) {  // the compute copy for the next gather, in the same pass where the optimizer can
        if constexpr (requires { opt.step(values, std::span<const T>(grads), state, u.compute_shard.span()); })
          opt.step(values, std::span<const T>(grads), state, u.compute_shard.span());
        else {
          opt.step(values, std::span<const T>(grads), state);
          ops::narrow(std::span<const T>(values), u.compute_shard.span());
        }
      } else {
        opt.step(values, std::span<const T>(grads), state);
      }
    }
    if constexpr (std::is_same_v<Strategy, ShardOptimizer>) {
      for (auto& u : units_) {  // everyone's updated slice back to everyone (fp32: it is the master)
        auto full = u.master->local();
        const auto& l = optimizer_layout(u);
        pending_.push_back(comm_->all_gather_async(std::span<const T>(full.subspan(l.begin(comm_->rank()), l.shard_size())), full));
      }
      wait_pending();
    }
    if constexpr (!Strategy::shards_parameters)
      if (opts_.precision.param != dtype::f32)
        for (auto& u : units_) refresh_compute_copy(u);
    ++step_;
  }

  // One optimisation step on this rank's batch: zero, forward, loss, backward,
  // step. Returns this rank's loss (averaged over its own batch).
  // With fp16, the loss gradient is multiplied by the loss scale; a step whose
  // gradients overflowed on any rank is skipped on every rank (see loss_scaler).
  template <class Optimizer, class Target, class LossFn>
  auto train_step(Optimizer& opt, const input& x, const Target& y, LossFn&& loss_fn) {
    zero_grad();
    auto out = forward(x);
    auto l = loss_fn(out, y);
    if (scaler_) scale_loss_gradient(l.grad.span(), scaler_->scale);
    backward(l.grad);
    if (!scaler_) {
      step(opt);
      return l.loss;
    }
    std::vector<float> overflow{0.f};
    for (auto& u : units_) overflow[0] = std::max(overflow[0], ops::all_finite(u.grad->local()) ? 0.f : 1.f);
    ops::all_reduce_values(*comm_, std::span<float>(overflow), comm::reduce_op::max);  // every rank decides alike
    if (overflow[0] == 0.f) {
      for (auto& u : units_) ops::scale(u.grad->local(), 1.f / scaler_->scale);
      step(opt);
    } else {
      ++step_;  // skipped: parameters and optimizer state stay as they were
    }
    scaler_->update(overflow[0] != 0.f);
    return l.loss;
  }
  const std::optional<loss_scaler>& scaler() const { return scaler_; }

  // The full parameters under their unsharded names, in the model's parameter
  // order — on rank 0 only (others return an empty list) or on every rank.
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
    for (auto& u : units_) {
      Buffer<T, space> full;
      std::span<const T> values = u.master->local();
      if constexpr (Strategy::shards_parameters) {
        full = Buffer<T, space>(u.master->layout().padded_size(), category::gathered_parameters);
        u.master->gather(shard_comm(), full.span());
        values = full.span();
      }
      if (!keep) continue;
      for (const auto& e : u.layout.entries) {
        Tensor<T> t(e.shape, category::parameters);
        ops::to_host(values.subspan(e.offset, e.numel()), t.span());
        out[position.at(e.name)] = {e.name, std::move(t)};
      }
    }
    return out;
  }

  // --- checkpoint access (io/checkpoint.hpp saves, loads and reshards through these) ----------
  const Strategy& strategy() const { return strategy_; }
  const mixed_precision& precision() const { return opts_.precision; }
  // The ranks parameters are sharded over: the world, or HybridShard's group.
  Comm& shard_group() { return shard_comm(); }
  // Unit i's optimizer state, made (zeroed) on first use exactly as step() makes it.
  template <class Optimizer>
  typename Optimizer::state& optimizer_state(Optimizer& opt, std::size_t i) {
    return state_for(opt, units_.at(i));
  }
  // Replaces this rank's master values of unit i (its whole local buffer, padding
  // included; host memory). Between steps only: a gathered copy would go stale.
  void load_master(std::size_t i, std::span<const T> values) {
    auto& u = units_.at(i);
    auto local = u.master->local();
    require<shape_error>(values.size() == local.size(), "rank ", comm_->rank(), ": load_master of unit '", u.name,
                         "' needs ", local.size(), " values, got ", values.size());
    require(u.values == state::sharded, "rank ", comm_->rank(), ": load_master of unit '", u.name,
            "' while it is gathered (load between steps)");
    ops::from_host(values, local);
    if constexpr (compute16) ops::narrow(std::span<const T>(local), u.compute_shard.span());
    if constexpr (!Strategy::shards_parameters)
      if (opts_.precision.param != dtype::f32) refresh_compute_copy(u);
  }
  // Resuming: the step counter (dropout streams depend on it) and the fp16 loss scaler.
  void set_steps(std::uint64_t steps) { step_ = steps; }
  void set_scaler(const loss_scaler& s) {
    require(scaler_.has_value(), "rank ", comm_->rank(), ": set_scaler on a model without fp16 loss scaling");
    *scaler_ = s;
  }

  // --- introspection (tests and tracing); these poll and never block --------------------------
  // The unit run after (dir = +1) or before (dir = -1) unit i in the recorded
  // forward order, or -1.
  int neighbor(int i, int dir) const {
    auto pos = std::find(order_.begin(), order_.end(), i);
    if (pos == order_.end()) return -1;
    long q = long(pos - order_.begin()) + dir;
    return q < 0 || q >= long(order_.size()) ? -1 : order_[q];
  }
  // Unit i's parameters have arrived (an issued all-gather has completed).
  bool gather_finished(int i) {
    auto& u = units_[i];
    if (u.values == state::gathering && u.gather_work.test()) complete_gather(u);
    return u.values == state::gathered;
  }
  // Unit i's gradient reduction was issued and has completed, not yet been waited for.
  bool reduction_finished(int i) { return units_[i].reducing && units_[i].reduce_work.test(); }

  // --- hooks the sharded context runs around each unit ----------------------------------------
  // A layer is identified by address and type: a composite and its first (or,
  // in std::tuple, last) child can share an address.
  template <class L>
  unit_type* find(const L& layer) {
    auto it = index_.find({static_cast<const void*>(&layer), std::type_index(typeid(L))});
    return it == index_.end() ? nullptr : &units_[it->second];
  }

  void pre_forward(unit_type& u) {
    const int i = int(&u - units_.data());
    if (recording_ && std::find(order_.begin(), order_.end(), i) == order_.end()) order_.push_back(i);
    if constexpr (Strategy::shards_parameters) {
      ensure_gathered(u);
      u.bind(u.gathered.data(), nullptr);
      prefetch(i, +1);
    }
  }
  void post_forward(unit_type& u) {
    if (&u == &units_[0]) recording_ = false;  // the root finishes last: the order is complete
    if constexpr (Strategy::frees_after_forward)
      if (&u != &units_[0]) free_gathered(u);
  }
  void pre_backward(unit_type& u) {
    if constexpr (Strategy::shards_parameters) {
      ensure_gathered(u);
      if (u.full_grad.empty()) {  // kept from earlier micro-batches under sync(false)
        u.full_grad = Buffer<C, space>(u.gathered.size(), category::gradients);
        ops::fill(u.full_grad.span(), C(0));
      }
      u.bind(u.gathered.data(), u.full_grad.data());
      prefetch(int(&u - units_.data()), -1);
    }
  }
  void post_backward(unit_type& u) {
    if constexpr (Strategy::shards_parameters) {
      free_gathered(u);
      if (sync_) reduce_gradients(u);
    } else if (sync_) {
      reduce_gradients(u);
    }
    if (&u == &units_[0]) finish_backward();
  }

 private:
  // --- construction --------------------------------------------------------------------------
  void make_groups() {
    if constexpr (std::is_same_v<Strategy, HybridShard>) {
      const int g = strategy_.group_size, w = comm_->size(), r = comm_->rank();
      require(g >= 1 && w % g == 0, "rank ", r, ": HybridShard group_size ", g, " must divide the world size ", w);
      shard_comm_.emplace(comm_->split(r / g, r));    // the ranks that shard one replica
      replica_comm_.emplace(comm_->split(r % g, r));  // the same shard in every replica
    }
  }
  Comm& shard_comm() { return shard_comm_ ? *shard_comm_ : *comm_; }

  // Walks the model; every layer the policy picks (and the model itself) becomes a
  // unit, and each unit claims the parameters no unit inside it has claimed.
  template <class L>
  void discover(L& layer, const std::string& name, bool root) {
    int idx = -1;
    if (root || opts_.wrap(name, std::type_index(typeid(L)))) {
      idx = int(units_.size());
      units_.emplace_back();
      units_.back().name = name;
      index_[{static_cast<const void*>(&layer), std::type_index(typeid(L))}] = idx;
    }
    if constexpr (nn::Composite<L>)
      layer.children([&](std::string_view child, auto& c) { discover(c, nn::join_name(name, child), false); });
    if (idx < 0) return;
    auto& u = units_[idx];
    layer.parameters([&](std::string_view pname, auto& p) {
      static_assert(std::is_same_v<std::remove_reference_t<decltype(p)>, nn::Param<C>>,
                    "ShardedModel: every parameter must be a Param<C> of the model output's element type");
      if (!claimed_.insert(&p).second) return;
      u.layout.numel = (u.layout.numel + 15) / 16 * 16;  // the alignment nn::flatten uses
      u.layout.entries.push_back({nn::join_name(name, pname), p.shape, p.init, u.layout.numel});
      u.layout.numel += p.numel();
      u.params.push_back(&p);
    });
  }

  // The sharded storage of one unit, initialised in place: each rank draws only
  // its own shard's values, which equal the unsharded initialisation there.
  void materialize(unit_type& u) {
    const std::size_t n = u.numel();
    if constexpr (Strategy::shards_parameters) {
      Comm& c = shard_comm();
      u.master.emplace(n, c, category::parameters);
      u.grad.emplace(n, c, category::gradients);
      ops::initialize(u.layout, opts_.seed, u.master->layout().begin(c.rank()), u.master->local());
      if constexpr (compute16) {
        u.compute_shard = Buffer<C, space>(u.master->local().size(), category::parameters);
        ops::narrow(std::span<const T>(u.master->local()), u.compute_shard.span());
      }
    } else {
      // Replicated values, padded to a multiple of the world so ShardOptimizer can
      // all-gather them in place after each rank updated its slice.
      const std::size_t padded = shard_layout{n, comm_->size()}.padded_size();
      u.master.emplace(padded, 1, 0, category::parameters);
      ops::initialize(u.layout, opts_.seed, 0, u.master->local());
      if constexpr (std::is_same_v<Strategy, ShardOptimizer>) {
        // ZeRO-1: every rank keeps full local gradients; the reduced gradients
        // and the optimizer state exist only for its own slice.
        u.full_grad = Buffer<C, space>(padded, category::gradients);
        ops::fill(u.full_grad.span(), C(0));
        u.grad.emplace(padded, comm_->size(), comm_->rank(), category::gradients);
      } else {
        u.grad.emplace(padded, 1, 0, category::gradients);
      }
    }
  }

  // Ranks compare a hash of every parameter's name and shape and of the strategy;
  // on a mismatch every rank raises, naming the first parameter that differs.
  void check_structure() {
    std::vector<std::int64_t> mine;  // hashes (int64: an element type every communicator carries)
    mine.push_back(std::int64_t(fnv1a(Strategy::name) ^ std::uint64_t(shard_comm().size())));
    for (const auto& u : units_)
      for (const auto& e : u.layout.entries) mine.push_back(std::int64_t(fnv1a(cat(u.name, "|", e.name, e.shape, "|", sizeof(T), sizeof(C)))));
    std::vector<std::int64_t> most{std::int64_t(mine.size())};
    ops::all_reduce_values(*comm_, std::span<std::int64_t>(most), comm::reduce_op::max);
    mine.resize(std::size_t(most[0]), 0);  // absent entries hash to 0
    std::vector<std::int64_t> all(mine.size() * comm_->size());
    ops::all_gather_values(*comm_, std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    for (std::size_t i = 0; i < mine.size(); ++i)
      for (int r = 0; r < comm_->size(); ++r) {
        if (all[r * mine.size() + i] == all[i]) continue;
        const std::string what = i == 0 ? cat("the strategy or shard group (", Strategy::name, ")")
                                        : cat("parameter #", i - 1, " (here: ", describe_entry(i - 1), ")");
        throw error(cat("rank ", comm_->rank(), ": the model differs between ranks 0 and ", r, " at ", what,
                        ": every rank must wrap the same model with the same strategy"));
      }
  }
  std::string describe_entry(std::size_t k) const {
    for (const auto& u : units_)
      for (const auto& e : u.layout.entries)
        if (k-- == 0) return cat("'", e.name, "' ", e.shape);
    return "no such parameter on this rank";
  }

  // --- gathering -----------------------------------------------------------------------------
  bool mixed() const { return opts_.precision.param != dtype::f32 || opts_.precision.reduce != dtype::f32; }

  // 16-bit compute gathers the compute copy of the shard. Otherwise, in a 16-bit
  // param dtype (host), the shard is narrowed into a scratch copy and gathered
  // into the first half of the float buffer, which is widened in place on arrival.
  void issue_gather(unit_type& u) {
    if (u.values != state::sharded) return;
    u.gathered = Buffer<C, space>(u.master->layout().padded_size(), category::gathered_parameters);
    if constexpr (compute16) {
      u.gather_work = shard_comm().all_gather_async(std::span<const C>(u.compute_shard.span()), u.gathered.span());
    } else if (opts_.precision.param == dtype::f32) {
      u.gather_work = u.master->gather_async(shard_comm(), u.gathered.span());
    } else if constexpr (on_host) {
      with_16bit(opts_.precision.param, [&](auto h) {
        using H = decltype(h);
        u.send_scratch = Buffer<T>(u.master->local().size(), category::comm_scratch);
        std::copy_n(u.master->local().data(), u.send_scratch.size(), u.send_scratch.data());
        auto send = narrow_in_place<H>(u.send_scratch.span());
        std::span<H> recv(reinterpret_cast<H*>(u.gathered.data()), u.gathered.size());
        u.gather_work = shard_comm().all_gather_async(std::span<const H>(send), recv);
      });
    }
    u.values = state::gathering;
  }
  void complete_gather(unit_type& u) {
    u.gather_work.wait();
    if constexpr (on_host && !compute16)
      if (opts_.precision.param != dtype::f32) {
        with_16bit(opts_.precision.param, [&](auto h) { widen_in_place<decltype(h)>(u.gathered.span()); });
        u.send_scratch.reset();
      }
    u.values = state::gathered;
  }
  void ensure_gathered(unit_type& u) {
    issue_gather(u);
    if (u.values == state::gathering) complete_gather(u);
  }
  // Replicated strategies in a 16-bit param dtype compute on a rounded copy.
  void refresh_compute_copy(unit_type& u) {
    with_16bit(opts_.precision.param, [&](auto h) {
      ops::template round_to<decltype(h)>(std::span<const T>(u.master->local()), u.gathered.span());
    });
  }
  void free_gathered(unit_type& u) {
    require(u.values != state::gathering, "internal: freeing unit '", u.name, "' while its gather is in flight");
    u.unbind();
    u.gathered.reset();
    u.values = state::sharded;
  }
  // Issues the gathers of the next `prefetch` units in forward order (dir = +1)
  // or backward order (dir = -1), as recorded during the first forward.
  void prefetch(int current, int dir) {
    if (recording_ || opts_.prefetch <= 0) return;
    auto pos = std::find(order_.begin(), order_.end(), current);
    if (pos == order_.end()) return;
    long p = long(pos - order_.begin());
    for (int k = 1; k <= opts_.prefetch; ++k) {
      long q = p + dir * k;
      if (q < 0 || q >= long(order_.size())) break;
      issue_gather(units_[order_[q]]);
    }
  }

  // --- gradient reduction --------------------------------------------------------------------
  void reduce_gradients(unit_type& u) {
    finish_reduction_except(&u);  // at most one reduction in flight besides this one
    const dtype rd = opts_.precision.reduce;
    if constexpr (compute16) {
      Comm& c = shard_comm();
      if (rd == dtype::f32) {  // widen the full gradients, then as fp32 compute does
        u.wide_grad = Buffer<T, space>(u.full_grad.size(), category::comm_scratch);
        ops::widen_add(std::span<const C>(u.full_grad.span()), u.wide_grad.span(), true);
        u.full_grad.reset();
        auto into = u.grad->local();
        if (!u.grad_clean) {
          u.reduce_scratch = Buffer<T, space>(into.size(), category::comm_scratch);
          into = u.reduce_scratch.span();
        }
        u.reduce_work = c.reduce_scatter_async(std::span<const T>(u.wide_grad.span()), into, comm::reduce_op::avg);
      } else {  // in C, into a C scratch that is widened into the shard after
        u.narrow_scratch = Buffer<C, space>(u.grad->local().size(), category::comm_scratch);
        u.reduce_work = c.reduce_scatter_async(std::span<const C>(u.full_grad.span()), u.narrow_scratch.span(),
                                               comm::reduce_op::avg);
      }
    } else if constexpr (!std::is_same_v<Strategy, NoShard>) {
      auto into = u.grad->local();
      if (!u.grad_clean || rd != dtype::f32) {  // reduce into scratch; add (or widen) after
        u.reduce_scratch = Buffer<T, space>(into.size(), category::comm_scratch);
        into = u.reduce_scratch.span();
      }
      Comm& c = std::is_same_v<Strategy, ShardOptimizer> ? *comm_ : shard_comm();
      if (rd == dtype::f32) {
        u.reduce_work = c.reduce_scatter_async(std::span<const T>(u.full_grad.span()), into, comm::reduce_op::avg);
      } else if constexpr (on_host) {  // in the reduce dtype: narrow in place, reduce into the scratch's first half
        with_16bit(rd, [&](auto h) {
          using H = decltype(h);
          auto send = narrow_in_place<H>(u.full_grad.span());
          std::span<H> recv(reinterpret_cast<H*>(into.data()), into.size());
          u.reduce_work = c.reduce_scatter_async(std::span<const H>(send), recv, comm::reduce_op::avg);
        });
      }
    } else {  // DDP: average the full gradients in place
      auto full = u.grad->local();
      if (rd == dtype::f32) {
        u.reduce_work = comm_->all_reduce_async(std::span<const T>(full), full, comm::reduce_op::avg);
      } else if constexpr (on_host) {
        with_16bit(rd, [&](auto h) {
          using H = decltype(h);
          auto g = narrow_in_place<H>(full);
          u.reduce_work = comm_->all_reduce_async(std::span<const H>(g), g, comm::reduce_op::avg);
        });
      }
    }
    u.reducing = true;
    reducing_.push_back(int(&u - units_.data()));
  }

  void finish_reduction(unit_type& u) {
    if (!u.reducing) return;
    u.reduce_work.wait();
    u.reducing = false;
    const dtype rd = opts_.precision.reduce;
    if constexpr (!std::is_same_v<Strategy, NoShard>) {
      if constexpr (compute16) {
        u.wide_grad.reset();
        if (!u.narrow_scratch.empty()) {
          ops::widen_add(std::span<const C>(u.narrow_scratch.span()), u.grad->local(), u.grad_clean);
          u.narrow_scratch.reset();
        }
      }
      if (!u.reduce_scratch.empty()) {
        if constexpr (on_host && !compute16)
          if (rd != dtype::f32) with_16bit(rd, [&](auto h) { widen_in_place<decltype(h)>(u.reduce_scratch.span()); });
        ops::add(std::span<const T>(u.reduce_scratch.span()), u.grad->local(), u.grad_clean);
        u.reduce_scratch.reset();
      }
      if constexpr (std::is_same_v<Strategy, ShardOptimizer>) ops::fill(u.full_grad.span(), C(0));
      else u.full_grad.reset();
      if constexpr (std::is_same_v<Strategy, HybridShard>) {  // then average the shard across replicas
        auto g = u.grad->local();
        replica_comm_->all_reduce(g, comm::reduce_op::avg);
      }
    } else if constexpr (on_host) {
      if (rd != dtype::f32) with_16bit(rd, [&](auto h) { widen_in_place<decltype(h)>(u.grad->local()); });
    }
    u.grad_clean = false;
  }
  void finish_reduction_except(const unit_type* keep) {
    for (int i : reducing_)
      if (&units_[i] != keep) finish_reduction(units_[i]);
    reducing_.erase(std::remove_if(reducing_.begin(), reducing_.end(), [&](int i) { return !units_[i].reducing; }),
                    reducing_.end());
  }
  void finish_backward() {
    finish_reduction_except(nullptr);
    if constexpr (Strategy::shards_parameters) {
      for (auto& u : units_) require(u.values == state::sharded, "internal: unit '", u.name, "' still gathered");
    }
  }
  void wait_pending() {
    for (auto& w : pending_) w.wait();
    pending_.clear();
  }

  // --- optimizer -----------------------------------------------------------------------------
  // The partition an optimizer steps on this rank: its shard when sharded; its
  // slice of the full buffer under ShardOptimizer; everything under NoShard.
  shard_layout optimizer_layout(const unit_type& u) const { return {u.master->local().size(), comm_->size()}; }
  std::pair<std::span<T>, std::span<T>> optimizer_span(unit_type& u) {
    if constexpr (std::is_same_v<Strategy, ShardOptimizer>) {
      const auto l = optimizer_layout(u);
      return {u.master->local().subspan(l.begin(comm_->rank()), l.shard_size()), u.grad->local()};
    } else {
      return {u.master->local(), u.grad->local()};
    }
  }
  template <class Optimizer>
  typename Optimizer::state& state_for(Optimizer& opt, unit_type& u) {
    static const char type_tag = 0;
    if (!u.optimizer_state) {
      auto n = optimizer_span(u).first.size();
      u.optimizer_state = std::make_shared<typename Optimizer::state>(opt.make_state(n));
      u.optimizer_type = &type_tag;
    }
    require(u.optimizer_type == &type_tag, "rank ", comm_->rank(), ": unit '", u.name,
            "' has optimizer state of another optimizer type");
    return *static_cast<typename Optimizer::state*>(u.optimizer_state.get());
  }

  // The loss gradient times the fp16 loss scale (in fp32 when the layers compute in 16 bits).
  void scale_loss_gradient(std::span<C> g, float factor) {
    if constexpr (compute16) {
      Buffer<float, space> wide(g.size(), category::activations);
      ops::widen_add(std::span<const C>(g), wide.span(), true);
      ops::scale(wide.span(), factor);
      ops::narrow(std::span<const float>(wide.span()), g);
    } else {
      ops::scale(g, factor);
    }
  }

  Model* model_;
  Comm* comm_;
  Strategy strategy_;
  options opts_;
  std::optional<Comm> shard_comm_, replica_comm_;
  std::vector<unit_type> units_;  // units_[0] is the root
  std::map<std::pair<const void*, std::type_index>, int> index_;
  std::unordered_set<const void*> claimed_;
  std::vector<int> order_;  // unit indices in the order of the first forward
  bool recording_ = true;
  bool sync_ = true;
  std::vector<int> reducing_;
  std::vector<work_type> pending_;
  std::optional<loss_scaler> scaler_;
  std::uint64_t step_ = 0;
  sharded_context<ShardedModel> ctx_;
};

// The context layers see inside a ShardedModel: running a child that is a unit
// runs the unit's hooks around it; anything else runs as in the plain context.
template <class Engine>
class sharded_context : public nn::context {
 public:
  sharded_context(Engine* e, nn::context::options o) : nn::context(o), e_(e) {}

  template <class L, class X>
  auto forward(L& layer, const X& x) {
    auto* u = e_->find(layer);
    if (!u) return layer.forward(*this, x);
    e_->pre_forward(*u);
    auto y = layer.forward(*this, x);
    e_->post_forward(*u);
    return y;
  }
  template <class L, class DY>
  auto backward(L& layer, const DY& dy) {
    auto* u = e_->find(layer);
    if (!u) return layer.backward(*this, dy);
    e_->pre_backward(*u);
    auto dx = layer.backward(*this, dy);
    e_->post_backward(*u);
    return dx;
  }

 private:
  Engine* e_;
};

// Wraps `model` for training on the ranks of `comm` with a sharding strategy:
//   auto sharded = shard::fully_shard(model, comm, shard::FullShard{}, {.wrap = shard::wrap_types<Encoder>{}});
template <class T = float, nn::Layer Model, comm::Communicator Comm, ShardingStrategy Strategy>
ShardedModel<Model, Comm, Strategy, T> fully_shard(Model& model, Comm& comm, Strategy strategy, options o = {}) {
  o.context.rank = comm.rank();
  return ShardedModel<Model, Comm, Strategy, T>(model, comm, strategy, std::move(o));
}

}  // namespace shardlib::shard
