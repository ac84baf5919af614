// shardlib/shard/options.hpp — what fully_shard takes (options) and what train_step
// takes and returns (step_options, step_result, on a device pending_step_result).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/memory_space.hpp"  // host_space
#include "shardlib/core/pending.hpp"       // pending
#include "shardlib/nn/context.hpp"         // nn::context::options
#include "shardlib/shard/precision.hpp"    // mixed_precision, loss_scaler
#include "shardlib/shard/wrap.hpp"         // wrap_policy, wrap_none

#include <cstdint>      // std::uint64_t
#include <optional>     // std::optional
#include <type_traits>  // std::conditional_t, std::is_same_v

namespace shardlib::shard {

struct options {
  // Which layers become units; the model is always the root unit.
  wrap_policy wrap = wrap_none{};
  // Which layers are checkpointed (units or not; the same policies as `wrap`, whose
  // count is then every element of the Params the layer lists): their forward keeps
  // only their input, and their backward runs the forward again first.
  wrap_policy checkpoint = wrap_none{};
  // Which units keep their full parameters from their forward to their backward where the
  // strategy frees them after forward (FullShard, HybridShard): FSDP2's
  // reshard_after_forward=False on those modules, as torchtitan sets it on the last block,
  // whose backward comes right after the head's. Asked of each unit but the root (which
  // stays gathered anyway) with its dotted name, layer type and elements (no alignment gaps),
  // as `wrap` is; one that matches no unit keeps none (unit_keeps_gathered(i) says). Each
  // saves its backward's all-gather and holds its full values meanwhile; the planner counts both.
  wrap_policy keep_gathered = wrap_none{};
  std::uint64_t seed = 0;  // initial values: element i of parameter p is drawn from (seed, p, i) on every rank
  int prefetch = 1;        // units whose all-gather is issued ahead of the one running
  mixed_precision precision{};  // gather / reduce dtypes; F16 turns on dynamic loss scaling in train_step
  loss_scaler scaler{};         // its initial scale and growth rule
  nn::context::options context{};  // training flag, dropout seed (rank and step are set by the model)
  // ZeRO-Offload / FSDP's CPUOffload: this rank's fp32 master piece, a copy of its reduced
  // gradients and its optimizer state live in host memory (offload_space_t of the model's
  // space: pinned memory beside a device) and the optimizer steps there, unit by unit; the
  // updated piece (rounded to the layers' dtype when they compute in 16 bits) is copied back
  // to the model's space. Bit for bit the same training as without it.
  bool offload = false;
  // 16-bit layers: whether frozen parameters (requires_grad = false) keep an fp32 master.
  // false: this rank keeps their piece in the compute dtype alone, as DeepSpeed keeps the
  // parameters outside its optimizer, and saves 4 bytes per frozen element of its piece
  // (a LoRA run's base model). Training is the same bit for bit (layers read the rounded
  // values either way); checkpoints and state dicts then hold the frozen values rounded.
  // A unit whose reduction does not pack its trained elements (shard/packing.hpp) keeps
  // its whole master. No effect with fp32 layers, whose values are the master.
  bool frozen_masters = true;
  // Whether backward binds gradient storage for frozen parameters. false: a wholly frozen
  // unit gets none, and a unit whose reduction packs its trained elements (shard/packing.hpp)
  // gets them alone, end to end, so that its full local gradients take 2 or 4 bytes per
  // trained element, not per element (FSDP2 keeps no .grad for a frozen parameter); a
  // frozen parameter's Param::grad is then null, so every layer must skip the gradient of
  // a frozen parameter, as the library's do. Training is the same bit for bit. Sharded
  // optimizer state only (NoShard's layers write into the gradients it reduces).
  bool frozen_grads = true;
};

// train_step's options and what it returns.
enum class loss_report { global_mean, local };
enum class grad_reduction { average, sum };
enum class loss_mean { per_micro_batch, per_item };
struct step_options {
  float max_norm = 0;  // > 0: clip the global gradient norm to it, after fp16 unscaling; 0: no clipping
  // global_mean: the mean of every rank's loss, by one all-reduce of a scalar (carried
  // by fp16's overflow all-reduce when loss scaling is on). With averaged gradients it is
  // the loss whose gradient the step followed, and every rank reports the same number,
  // as torchtitan logs it. local: this rank's own loss, no collective (PyTorch's loss).
  loss_report loss = loss_report::global_mean;
  // average: each rank steps the mean of all ranks' gradients (DDP's and FSDP's rule);
  // sum: their sum, W times the mean (for losses summed, not averaged, over the global batch).
  // Over micro-batches each rank's gradient is the mean over its micro-batches either way;
  // sum with each micro-batch reduced needs a policy that reduce-scatters into its pieces
  // (NoShard's in-place all-reduce and HybridShard's replica all-reduce would sum again what
  // the earlier micro-batches reduced): with those, use no_sync.
  grad_reduction reduction = grad_reduction::average;
  // train_step over micro-batches (gradient accumulation): how those before the last run.
  // no_sync: their gradients stay unreduced and the last micro-batch reduces them all (FSDP2's
  // set_requires_gradient_sync(False), DDP's no_sync): one reduction a step, for every unit's
  // full local gradients held meanwhile; else each reduces its own (FSDP2's and DeepSpeed's
  // default). reshard_after_backward = false: each unit stays gathered from their backwards
  // to the next forward (ShardedModel::set_reshard_after_backward): fewer all-gathers, every
  // unit's full parameters held meanwhile.
  bool no_sync = false;
  bool reshard_after_backward = true;
  // HybridShard: false leaves the reduced pieces' average across the replica groups to the
  // last micro-batch, which averages what they all reduced within the shard group (FSDP2's
  // set_requires_all_reduce(False) before it): one replica all-reduce a step, the gradients
  // still sharded in between (no_sync keeps them whole).
  bool replica_all_reduce = true;
  // What the step's gradient and loss are a mean over. per_micro_batch: each micro-batch's
  // loss as its loss function averages it, the micro-batches weighed alike and the ranks too:
  // the mean over the global batch's items only when every micro-batch of every rank holds as
  // many. per_item: each loss weighed by the items its mean is over (a token loss's targets
  // not ignored), as the loss function counts them (items(target)), out of their total over
  // every rank and micro-batch, one all-reduce of two integers before the first forward
  // (torchtitan's global valid tokens, Hugging Face's num_items_in_batch): the step follows
  // the gradient of the mean over the global batch's items however padding spreads them, and
  // reports that mean (local: this rank's mean over its items). The reduction then changes
  // nothing. A step whose targets hold no item on any rank raises on every rank.
  loss_mean mean = loss_mean::per_micro_batch;
};
// R: float, or double for a float64 model on the host (its loss and norm as computed).
template <class R>
struct basic_step_result {
  R loss = 0;                  // as step_options::loss says
  std::optional<R> grad_norm;  // when clipping: the global gradient norm before clipping
  bool skipped = false;        // fp16 overflow, or a non-finite norm when clipping: nothing was stepped
  operator R() const { return loss; }  // `float loss = model.train_step(...)` as before the options
};
using step_result = basic_step_result<float>;
// What train_step returns on a device: the same, left on the device until one of
// them is read (pending), so that a step whose results nobody reads never waits for
// the device; reading one reads them all (one wait).
struct pending_step_result {
  pending<float> loss;
  std::optional<pending<float>> grad_norm;
  pending<bool> skipped = false;
  operator float() const { return loss; }
};
template <class Space, class R = float>
using step_result_of =
    std::conditional_t<std::is_same_v<Space, host_space>, basic_step_result<R>, pending_step_result>;

}  // namespace shardlib::shard
