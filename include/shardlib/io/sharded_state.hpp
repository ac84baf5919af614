// shardlib/io/sharded_state.hpp — state dicts in memory, as PyTorch's
// get_model_state_dict / get_optimizer_state_dict: each rank's pieces of every parameter
// and optimizer buffer with their global offsets (DCP's sharded state dict), or every
// tensor whole (full_state_dict), and loading either into a model of any world size,
// strategy or wrap policy. Loading is the checkpoint's resharding loader (reshard.hpp)
// with the offered pieces as its source; save_checkpoint writes these pieces.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"              // Buffer
#include "shardlib/core/error.hpp"               // io_error, cat
#include "shardlib/core/ledger.hpp"              // category
#include "shardlib/core/shape.hpp"               // Shape
#include "shardlib/core/tensor.hpp"              // Tensor
#include "shardlib/io/checkpoint_format.hpp"     // checkpoint_optimizer, detail::optimizer_to_json
#include "shardlib/io/checkpoint_safetensors.hpp"  // detail::gather_whole
#include "shardlib/io/optimizer_record.hpp"      // detail::optimizer_name, buffer_names, hyperparameters_of
#include "shardlib/io/rank_agreement.hpp"        // detail::on_all_ranks
#include "shardlib/io/reshard.hpp"               // detail::load_from, check_parameters, piece_begin, with_buffer
#include "shardlib/io/staging.hpp"               // stager, copy_to_host, host_collectives_of
#include "shardlib/shard/precision.hpp"          // loss_scaler
#include "shardlib/shard/sharded_model.hpp"      // ShardedModel

#include <algorithm>    // std::copy_n, std::max, std::min, std::sort
#include <cstddef>      // std::size_t, std::ptrdiff_t
#include <cstdint>      // std::uint64_t, std::int64_t
#include <functional>   // std::less
#include <map>          // std::map
#include <optional>     // std::optional
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <utility>      // std::pair, std::move
#include <vector>       // std::vector

namespace shardlib::io {

// Elements [offset, offset + values.numel()) of a tensor flattened in row-major order.
// The engine shards a unit's flat vector, which cuts through parameters, so a piece is a
// range of the flattened parameter, not a block of rows as a DTensor's Shard(0) would be.
struct tensor_piece {
  std::uint64_t offset = 0;
  Tensor<float> values;  // 1-D, host memory
};
// A tensor's whole shape and the pieces of it held here (DCP's ShardedTensor): none
// when this rank holds no element of it, one at offset 0 holding everything when full.
struct sharded_tensor {
  Shape shape;
  std::vector<tensor_piece> pieces;
};
using sharded_tensors = std::map<std::string, sharded_tensor, std::less<>>;

// The model's fp32 master values by parameter name (a tied parameter once, under its
// first name), with the step count and the fp16 loss scaler.
struct model_state_dict {
  sharded_tensors params;
  std::uint64_t steps = 0;
  std::optional<shard::loss_scaler> scaler;
};
// The optimizer's state: what a checkpoint records of it (type, step, buffer names,
// hyperparameters; for parameter groups each group's options and member names) and each
// buffer's tensors by parameter: buffers["exp_avg"]["0.weight"].
struct optim_state_dict {
  checkpoint_optimizer record;
  std::map<std::string, sharded_tensors, std::less<>> buffers;
};

struct state_options {
  // false: this rank's pieces, copied without communication. true: every tensor whole,
  // gathered one unit at a time (collective).
  bool full = false;
  bool rank0_only = false;  // with full: only rank 0 keeps the tensors (the others get shapes and no pieces)
};

namespace detail {

// Copies each parameter's overlap with flat elements [first, first + values.size()) of a
// unit laid out as `entries` into `out` as a piece, from values in memory of S (through
// the stager when the host cannot reach it); every parameter is listed, held or not.
template <class S, class Entries, class Space>
void cut_pieces(const Entries& entries, std::uint64_t first, std::span<const float> values, bool keep,
                sharded_tensors& out, stager<Space>& staging) {
  const std::uint64_t end = first + values.size();
  for (const auto& e : entries) {
    auto& t = out[e.name];
    t.shape = e.shape;
    const std::uint64_t lo = std::max<std::uint64_t>(first, e.offset), hi = std::min<std::uint64_t>(end, e.offset + e.numel());
    if (!keep || lo >= hi) continue;
    Tensor<float> v(Shape{std::int64_t(hi - lo)}, category::parameters);
    copy_to_host<S>(staging, values.subspan(std::size_t(lo - first), std::size_t(hi - lo)), v.span());
    t.pieces.push_back({lo - e.offset, std::move(v)});
  }
}

// Unit i's piece of one kind (memory of S) into `out`: this rank's piece, or the whole
// unit gathered (in the model's space).
template <class S, class Engine>
void add_unit(Engine& model, std::size_t i, std::span<const float> piece, const state_options& o,
              sharded_tensors& out, stager<typename Engine::space>& staging) {
  const bool keep = !o.full || !o.rank0_only || model.comm().rank() == 0;
  const auto& entries = model.unit_layout(i).entries;
  if (o.full && model.partitions() > 1) {
    Buffer<float, typename Engine::space> holder;
    const auto values = gather_whole<S>(model, piece, holder, staging);
    cut_pieces<typename Engine::space>(entries, 0, values, keep, out, staging);
  } else {
    cut_pieces<S>(entries, o.full ? 0 : piece_begin(model, i), piece, keep, out, staging);
  }
}

// The pieces offered to a load, from any number of dicts (every rank's, or one full
// one), as the resharding loader's source: request(name, kind, first, out) copies
// elements [first, first + out.size()) of parameter `name`'s `kind` ("master" or an
// optimizer buffer) from the pieces that cover them, and raises if some are in none.
class offered_pieces {
 public:
  offered_pieces(std::span<const model_state_dict> models, std::span<const optim_state_dict> optims) {
    for (const auto& m : models) add("master", m.params);
    for (const auto& o : optims)
      for (const auto& [buffer, tensors] : o.buffers) add(buffer, tensors);
    for (auto& [kind, tensors] : kinds_)
      for (auto& [name, t] : tensors)
        std::sort(t.pieces.begin(), t.pieces.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  }

  // Every parameter's name and shape.
  std::vector<std::pair<std::string, Shape>> parameters() const {
    std::vector<std::pair<std::string, Shape>> out;
    if (const auto m = kinds_.find("master"); m != kinds_.end())
      for (const auto& [name, t] : m->second) out.emplace_back(name, t.shape);
    return out;
  }

  void request(std::string_view name, std::string_view kind, std::uint64_t first, std::span<float> out) const {
    const auto k = kinds_.find(kind);
    if (k == kinds_.end()) throw io_error(cat("the state dict holds no optimizer state '", kind, "'"));
    const auto t = k->second.find(name);
    if (t == k->second.end())
      throw io_error(cat("the state dict holds no ", kind, " of parameter '", name, "'"));
    const std::uint64_t end = first + out.size();
    std::uint64_t at = first;
    for (const auto& [offset, values] : t->second.pieces) {  // by offset: a gap shows before a piece
      if (at == end || offset > at) break;
      const std::uint64_t piece_end = offset + values.size();
      if (piece_end <= at) continue;
      const std::uint64_t n = std::min(piece_end, end) - at;
      std::copy_n(values.begin() + std::ptrdiff_t(at - offset), n, out.begin() + std::ptrdiff_t(at - first));
      at += n;
    }
    if (at < end)
      throw io_error(cat("the state dict: elements [", at, ", ", end, ") of parameter '", name, "' (", kind,
                         ") are in no piece offered; offer the dicts of every rank"));
  }
  void finish() const {}  // request copies at once

 private:
  struct entry {
    Shape shape;
    std::vector<std::pair<std::uint64_t, std::span<const float>>> pieces;
  };

  void add(std::string_view kind, const sharded_tensors& tensors) {
    auto& mine = kinds_[std::string(kind)];
    for (const auto& [name, t] : tensors) {
      const auto [it, fresh] = mine.try_emplace(name, entry{t.shape, {}});
      if (!fresh && it->second.shape != t.shape)
        throw io_error(cat("the state dict: parameter '", name, "' (", kind, ") is ", it->second.shape,
                           " in one dict offered and ", t.shape, " in another"));
      const std::uint64_t numel = std::uint64_t(t.shape.numel());
      for (const auto& p : t.pieces) {
        const std::uint64_t n = std::uint64_t(p.values.numel());
        if (p.offset > numel || n > numel - p.offset)
          throw io_error(cat("the state dict: a piece of parameter '", name, "' (", kind, ") holds elements [",
                             p.offset, ", ", p.offset + n, "), which do not fit its shape ", t.shape, " (", numel,
                             " elements)"));
        it->second.pieces.emplace_back(p.offset, std::span<const float>(p.values.span()));
      }
    }
  }

  std::map<std::string, std::map<std::string, entry, std::less<>>, std::less<>> kinds_;
};
inline std::string_view src_name(const offered_pieces&) { return "the state dict"; }

// Loads what `models` and `optims` offer into model (and opt) on every rank: the
// checkpoint's resharding load, the pieces its source. Nothing changes unless every
// rank succeeds.
template <class Engine, class O>
void load_offered(Engine& model, O* opt, std::span<const model_state_dict> models,
                  std::span<const optim_state_dict> optims) {
  const std::string what = "loading a state dict";
  std::optional<offered_pieces> src;
  std::optional<checkpoint_optimizer> record;
  auto comm = host_collectives_of(model);
  on_all_ranks(comm, what, [&] {
    if (models.empty()) throw io_error("the state dict: no model state offered");
    src.emplace(models, optims);
    check_parameters(model, src->parameters(), src_name(*src));
    if (!opt) return;
    if (optims.empty()) throw io_error("the state dict: no optimizer state offered");
    const auto first = optimizer_to_json(optims[0].record);
    for (std::size_t d = 1; d < optims.size(); ++d)
      if (optimizer_to_json(optims[d].record) != first)
        throw io_error(cat("the state dict: the optimizer records offered differ: ", first.dump(), " in dict 0, ",
                           optimizer_to_json(optims[d].record).dump(), " in dict ", d));
    record = optims[0].record;
  });
  load_from(model, *src, opt, record, what);
  model.set_steps(models[0].steps);
  if (models[0].scaler && model.scaler()) model.set_scaler(*models[0].scaler);
}

}  // namespace detail

// This rank's pieces of the model's fp32 masters (or, with o.full, every parameter whole:
// collective). Host memory, a copy: training on does not change it. From a model in
// device memory the values come through a pinned staging buffer (io/staging.hpp).
template <class M, class C, class S, class O>
model_state_dict get_model_state(shard::ShardedModel<M, C, S, float, O>& model, const state_options& o = {}) {
  using Space = typename shard::ShardedModel<M, C, S, float, O>::space;
  model_state_dict out{{}, model.steps(), model.scaler()};
  stager<Space> staging;
  for (std::size_t i = 0; i < model.unit_count(); ++i)
    detail::with_master(model, i, [&](std::span<const float> piece, auto space) {
      detail::add_unit<typename decltype(space)::type>(model, i, piece, o, out.params, staging);
    });
  return out;
}

// This rank's pieces of the optimizer's buffers (or, with o.full, every buffer whole:
// collective), with its step and hyperparameters.
template <class M, class C, class S, SavableOptimizer O>
optim_state_dict get_optimizer_state(shard::ShardedModel<M, C, S, float, O>& model, O& opt,
                                     const state_options& o = {}) {
  optim_state_dict out{{detail::optimizer_name<O>(), model.optimizer_state(opt, 0).step, detail::buffer_names(opt),
                        detail::hyperparameters_of(model, opt)},
                       {}};
  using Space = typename shard::ShardedModel<M, C, S, float, O>::space;
  stager<Space> staging;
  for (std::size_t i = 0; i < model.unit_count(); ++i) {
    auto& st = model.optimizer_state(opt, i);
    for (const auto& name : out.record.state) {  // in the record's order on every rank: the gathers match
      const bool found = detail::with_piece_buffer(model, i, st, name, staging, [&](std::span<const float> piece,
                                                                                     auto space) {
        detail::add_unit<typename decltype(space)::type>(model, i, piece, o, out.buffers[name], staging);
      });
      require(found, "rank ", model.comm().rank(), ": unit '", model.unit_name(i), "' has no optimizer buffer '", name,
              "'");
    }
  }
  return out;
}

// Loads model state offered as sharded dicts (every rank's: after an exchange, or in a
// process whose ranks are threads) or as one full dict, into a model of any world size,
// strategy or wrap policy. Every element of every parameter must be in some piece; the
// step count and loss scaler come from the first dict. Collective; on error every rank
// raises io_error and nothing changes.
template <class M, class C, class S, class O>
void set_model_state(shard::ShardedModel<M, C, S, float, O>& model, std::span<const model_state_dict> offered) {
  detail::load_offered<shard::ShardedModel<M, C, S, float, O>, detail::no_optimizer>(model, nullptr, offered, {});
}
// The same with the optimizer: its state resharded like the parameters, its step and
// hyperparameters restored (parameter groups must match by name, members and options).
template <class M, class C, class S, SavableOptimizer O>
void set_state(shard::ShardedModel<M, C, S, float, O>& model, O& opt, std::span<const model_state_dict> models,
               std::span<const optim_state_dict> optims) {
  detail::load_offered(model, &opt, models, optims);
}

}  // namespace shardlib::io
