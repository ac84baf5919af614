// shardlib/io/reshard.hpp — the resharding load: where each rank's master values and
// optimizer state lie in a unit's flat vector under each strategy, the ranges of saved
// parameters each rank requests by name (from a checkpoint, a safetensors file, or the
// pieces of in-memory state dicts: sharded_state.hpp), the checks that the model and the
// source agree, and loading the result on every rank.
//
// The algorithm: docs/checkpoints.md.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"           // Buffer
#include "shardlib/core/error.hpp"            // io_error, cat
#include "shardlib/core/ledger.hpp"           // category, ledger_scope, current_ledger
#include "shardlib/core/shape.hpp"            // Shape
#include "shardlib/io/checkpoint_format.hpp"  // checkpoint_optimizer
#include "shardlib/io/checkpoint_reader.hpp"  // checkpoint_reader
#include "shardlib/io/consolidated_file.hpp"  // safetensors_source
#include "shardlib/io/optimizer_record.hpp"   // detail::known_optimizer, restore_hyperparameters, check_buffers, ...
#include "shardlib/io/rank_agreement.hpp"     // detail::on_all_ranks
#include "shardlib/io/staging.hpp"            // stager, host_collectives_of, copy_to_host
#include "shardlib/optim/param_groups.hpp"     // optim::segment, trained_size
#include "shardlib/shard/sharded_model.hpp"   // ShardedModel

#include <algorithm>    // std::fill, std::min, std::max, std::copy, std::copy_n
#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint64_t, std::int64_t
#include <functional>   // std::less
#include <map>          // std::map
#include <optional>     // std::optional
#include <set>          // std::set
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v, std::type_identity
#include <utility>      // std::move, std::pair
#include <vector>       // std::vector

namespace shardlib::io {

namespace detail {

// Zeroes out and requests from src, by name, each parameter's piece of elements
// [first, first + out.size()) of a flat vector of `kind` laid out as `entries`: the
// saved layout may differ (another wrap policy, world size or strategy). Gaps and
// padding stay 0. The data arrives at src.finish().
template <class Entries, class Source>
void request_range(const Entries& entries, Source& src, std::string_view kind, std::uint64_t first,
                   std::span<float> out) {
  std::fill(out.begin(), out.end(), 0.0f);
  const std::uint64_t end = first + out.size();
  for (const auto& e : entries) {
    const std::uint64_t offset = e.offset, lo = std::max(first, offset), hi = std::min(end, offset + e.numel());
    if (lo < hi) src.request(e.name, kind, lo - offset, out.subspan(std::size_t(lo - first), std::size_t(hi - lo)));
  }
}

// Throws io_error naming the first parameter that this model and a saved source
// disagree on: missing on either side, or another shape.
template <class Engine>
void check_parameters(const Engine& model, const std::vector<std::pair<std::string, Shape>>& saved,
                      std::string_view source) {
  constexpr std::string_view hint = " (the first difference: was it saved from another model?)";
  std::map<std::string_view, const Shape*> by_name;
  for (const auto& [n, s] : saved) by_name.emplace(n, &s);
  std::set<std::string_view> ours;
  for (std::size_t i = 0; i < model.unit_count(); ++i)
    for (const auto& e : model.unit_layout(i).entries) {
      ours.insert(e.name);
      const auto it = by_name.find(e.name);
      if (it == by_name.end())
        throw io_error(cat(source, ": this model's parameter '", e.name, "' ", e.shape, " is not in it", hint));
      if (*it->second != e.shape)
        throw io_error(cat(source, ": parameter '", e.name, "' has shape ", *it->second, " there but ", e.shape,
                           " in this model", hint));
    }
  for (const auto& [n, s] : saved)
    if (!ours.contains(n))
      throw io_error(cat(source, ": it holds parameter '", n, "' ", s, ", which this model does not have", hint));
}

// Where this rank's piece of unit i's master values and optimizer state starts in
// the unit's flat vector (the engine's partition: docs/design.md, "The engine interface").
template <class Engine>
std::uint64_t piece_begin(const Engine& m, std::size_t i) {
  return m.partition(i).begin(m.partition_rank());
}

// Calls f(values, std::type_identity<S>{}) with the optimizer state's buffer `name` and
// the memory space S it lives in (device memory for optim::cuda::Adam, host memory
// when offloaded); returns false when the state has no such buffer.
template <class State, class F>
bool with_buffer(State& st, std::string_view name, F&& f) {
  bool found = false;
  st.for_each_buffer([&]<class S>(std::string_view n, Buffer<float, S>& b) {
    if (n != name) return;
    found = true;
    f(std::span<const float>(b.span()), std::type_identity<S>{});
  });
  return found;
}

// A state over runs (optim::segment: frozen parameters' elements have none) spread
// over the piece it belongs to, both in host memory: zeros where frozen.
inline void spread(std::span<const optim::segment> runs, std::span<const float> state, std::span<float> piece) {
  std::fill(piece.begin(), piece.end(), 0.0f);
  optim::for_each_trained_run(runs, [&](const optim::segment& r, std::size_t at) {
    std::copy_n(state.begin() + std::ptrdiff_t(at), r.size, piece.begin() + std::ptrdiff_t(r.begin));
  });
}

// with_buffer for unit i's state, its values as the unit's whole piece (what files and
// state dicts hold): a state without the frozen parameters' elements is spread over a
// piece in host memory first, zeros where frozen; a state of no elements, which may omit
// buffers (Adam's max_exp_avg_sq), gives zeros for those.
template <class Engine, class State, class F>
bool with_piece_buffer(Engine& model, std::size_t i, State& st, std::string_view name,
                       stager<typename Engine::space>& staging, F&& f) {
  const auto runs = model.piece_runs(i);
  const std::size_t piece = model.partition(i).shard_size(), kept = optim::trained_size(runs);
  auto whole = [&](auto fill) {
    Buffer<float> values(piece, category::comm_scratch);
    fill(values.span());
    f(std::span<const float>(values.span()), std::type_identity<host_space>{});
  };
  const bool found = with_buffer(st, name, [&]<class S>(std::span<const float> values, std::type_identity<S> space) {
    if (kept == piece) return f(values, space);
    whole([&](std::span<float> out) {
      Buffer<float> state(values.size(), category::comm_scratch);
      copy_to_host<S>(staging, values, state.span());
      spread(runs, state.span(), out);
    });
  });
  if (found || kept > 0) return found;
  whole([](std::span<float> out) { std::fill(out.begin(), out.end(), 0.0f); });
  return true;
}

// New master shards and optimizer states for this rank, their pieces requested from
// src (they arrive at src.finish()); the model is untouched until all ranks have them.
template <class Engine, class Source>
std::vector<Buffer<float>> request_masters(Engine& model, Source& src) {
  std::vector<Buffer<float>> out;
  for (std::size_t i = 0; i < model.unit_count(); ++i) {
    Buffer<float> b(model.partition(i).shard_size(), category::parameters);
    request_range(model.unit_layout(i).entries, src, "master", piece_begin(model, i), b.span());
    out.push_back(std::move(b));
  }
  return out;
}
// An optimizer buffer in memory the host cannot reach (the model's space): its values
// are requested into host memory and copied into place after src.finish().
struct pending_upload {
  Buffer<float> values;     // host memory
  std::span<float> target;  // the new state's buffer
};
template <class Engine, class Source, class O>
std::vector<typename O::state> request_states(Engine& model, Source& src, O& maker, std::int64_t step,
                                             std::vector<pending_upload>& uploads) {
  std::vector<typename O::state> out;
  std::optional<ledger_scope> in_offload;  // charged where the engine's own states are (options.offload)
  if (model.offloaded()) in_offload.emplace(current_ledger().offload());
  for (std::size_t i = 0; i < model.unit_count(); ++i) {
    const auto runs = model.piece_runs(i);
    auto st = maker.make_state(optim::trained_size(runs));
    st.step = step;
    st.for_each_buffer([&]<class S>(std::string_view name, Buffer<float, S>& b) {
      std::span<float> into = b.span();
      if constexpr (!can_access<host_space, S>) {
        static_assert(std::is_same_v<S, typename Engine::space>,
                      "io: optimizer state in a memory space neither the host nor the model's is");
        uploads.push_back({Buffer<float>(b.size(), category::optimizer_state), b.span()});
        into = uploads.back().values.span();
      }
      // Run by run: the state holds the trained runs of the piece end to end.
      optim::for_each_trained_run(runs, [&](const optim::segment& r, std::size_t at) {
        request_range(model.unit_layout(i).entries, src, name, piece_begin(model, i) + r.begin,
                      into.subspan(at, r.size));
      });
    });
    out.push_back(std::move(st));  // device buffers keep their storage as they move: the targets stay valid
  }
  return out;
}

// Loads parameters (and, with an optimizer recorded, its state) from src on every rank.
// Reading and every check happen first; the model and optimizer change only after all
// ranks succeeded, so a failed load loses nothing.
struct no_optimizer {
  struct state {};
};

// `what` already names the source in every message.
inline std::string_view src_name(const checkpoint_reader&) { return "the checkpoint"; }
inline std::string_view src_name(const safetensors_source&) { return "the safetensors file"; }

template <class Engine, class Source, class O>
void load_from(Engine& model, Source& src, O* opt, const std::optional<checkpoint_optimizer>& saved,
               std::string_view what) {
  std::vector<Buffer<float>> masters;
  std::vector<typename O::state> states;
  std::vector<pending_upload> uploads;
  std::optional<O> restored;  // a copy of opt with the source's hyperparameters (known optimizers)
  auto comm = host_collectives_of(model);
  on_all_ranks(comm, what, [&] {
    if constexpr (!std::is_same_v<O, no_optimizer>) {
      if (opt && saved) {
        check_optimizer_type<O>(*saved, src_name(src));
        if constexpr (known_optimizer<O>) {
          restored.emplace(*opt);
          restore_hyperparameters(model, *restored, saved->hyperparameters, src_name(src));
        }
        O& maker = restored ? *restored : *opt;
        check_buffers(maker, *saved, src_name(src));
        states = request_states(model, src, maker, saved->step, uploads);
      }
    }
    masters = request_masters(model, src);
    src.finish();  // the buffers' storage stays put as they move into the vectors
    stager<typename Engine::space> staging;
    for (auto& u : uploads) staging.upload(std::span<const float>(u.values.span()), u.target);
  });
  for (std::size_t i = 0; i < masters.size(); ++i) model.load_master(i, masters[i].span());
  if constexpr (!std::is_same_v<O, no_optimizer>)
    for (std::size_t i = 0; i < states.size(); ++i) model.optimizer_state(*opt, i) = std::move(states[i]);
  if constexpr (known_optimizer<O>)
    if (restored) *opt = *restored;
}

}  // namespace detail

}  // namespace shardlib::io
