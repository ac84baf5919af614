// shardlib/io/state_dict.hpp — a model's parameters from and to safetensors files under
// another framework's names and layouts, as PyTorch's load_state_dict and Hugging Face's
// save_pretrained / from_pretrained exchange them:
//   - a name map between the file's names and the model's dotted names (identity by default),
//   - tensors stored transposed (Hugging Face GPT-2's Conv1D keeps [in, out]; Linear [out, in]),
//   - any of F32, F64, F16, BF16 in the file, converted to the model's master dtype,
//   - tied parameters (a name the file leaves out because it shares its partner's values, or
//     holds twice: then both must hold the same values),
//   - strict loading (an error listing every missing, unexpected and misshapen tensor) or a report,
//   - one file, or Hugging Face's sharded layout (model-0000k-of-0000n.safetensors and
//     model.safetensors.index.json).
// Works on a ShardedModel (every rank reads only the ranges its master piece needs; collective)
// and on a plain model whose parameters an nn::Replicated holds.
// The options and the load report: io/state_dict_options.hpp; the files are read by
// io/state_dict_files.hpp and written by io/state_dict_writer.hpp; Hugging Face's GPT-2 and
// LLaMA conventions: io/hf_checkpoint.hpp.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"             // io_error, cat
#include "shardlib/core/shape.hpp"             // Shape
#include "shardlib/io/rank_agreement.hpp"      // detail::on_all_ranks
#include "shardlib/io/staging.hpp"             // stager, detail::copy_to_host, host_collectives_of
#include "shardlib/io/state_dict_files.hpp"    // detail::state_dict_files
#include "shardlib/io/state_dict_options.hpp"  // state_dict_options, name_map, load_report
#include "shardlib/io/state_dict_writer.hpp"   // detail::tensor_to_save, detail::write_state_dict
#include "shardlib/nn/flat.hpp"                // nn::flat_entry, nn::tied_names
#include "shardlib/nn/replicated.hpp"          // nn::Replicated

#include <algorithm>    // std::any_of, std::copy, std::max, std::min
#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint64_t
#include <cstring>      // std::memcmp
#include <filesystem>   // std::filesystem
#include <functional>   // std::less
#include <map>          // std::map, std::multimap
#include <optional>     // std::optional, std::nullopt
#include <set>          // std::set
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::remove_cvref_t
#include <utility>      // std::move, std::pair
#include <vector>       // std::vector

namespace shardlib::io {

namespace detail {

// A parameter of the model and where its values come from in the file. A file may hold a
// parameter the model ties under another of its names too (PyTorch's state_dict lists a
// tied weight under each): those are `copies`, read beside the source and required to
// hold the same values.
struct load_plan {
  struct copy {
    const state_dict_files::stored* tensor;
    bool transposed;  // stored transposed (by the alias's name)
  };
  std::map<std::string, const state_dict_files::stored*, std::less<>> source;  // model name -> tensor
  std::map<std::string, std::vector<copy>, std::less<>> copies;                // model name -> its aliases' tensors
  std::set<std::string, std::less<>> transposed;                              // model names
  load_report report;
};

// Matches the model's parameters (name, shape) with the file's tensors.
inline load_plan plan_load(const std::vector<std::pair<std::string, Shape>>& params, const state_dict_files& files,
                           const state_dict_options& o, const std::set<std::string, std::less<>>& aliases = {}) {
  load_plan plan;
  std::map<std::string, const state_dict_files::stored*, std::less<>> by_model;  // mapped file tensors
  std::map<std::string, std::string, std::less<>> file_name_of;
  for (const auto& [fname, t] : files.tensors()) {
    const auto m = o.names.to_model(fname);
    if (!m) continue;
    if (const auto [it, fresh] = file_name_of.emplace(*m, fname); !fresh)
      fail(files.origin(), "tensors \"", it->second, "\" and \"", fname, "\" both map to the model's '", *m, "'");
    by_model.emplace(*m, &t);
  }
  std::set<std::string, std::less<>> ours;
  for (const auto& [n, s] : params) ours.insert(n);
  require_only_matches(o, ours, files.origin());
  std::multimap<std::string, std::string, std::less<>> partners;  // both ways round
  for (const auto& [alias, target] : o.tied) {
    partners.emplace(alias, target);
    partners.emplace(target, alias);
  }
  const auto partner_where = [&](std::string_view n, const auto& has) -> std::optional<std::string> {
    for (auto [it, end] = partners.equal_range(n); it != end; ++it)
      if (has(it->second)) return it->second;
    return std::nullopt;
  };

  // Whether tensor t, read as model name m, is stored transposed and has the shape of a
  // parameter of shape `shape` (reversed if so); a mismatch is reported under m.
  const auto transposed = [&](const std::string& m, const Shape& shape) {
    return shape.rank() == 2 && ends_with_any(m, o.transposed);
  };
  const auto fits = [&](const std::string& m, const state_dict_files::stored& t, const Shape& shape) {
    const bool transpose = transposed(m, shape);
    if (t.info.shape == (transpose ? reversed(shape) : shape)) return true;
    plan.report.mismatched.push_back({m, t.info.shape, shape, transpose});
    return false;
  };
  for (const auto& [n, shape] : params) {
    if (!takes(o, n)) continue;  // options.only leaves it out: neither read nor missing
    auto it = by_model.find(n);
    if (it == by_model.end())
      if (const auto p = partner_where(n, [&](const std::string& q) { return by_model.contains(q); })) {
        it = by_model.find(*p);
        plan.report.from_tied.push_back(n);
      }
    if (it == by_model.end()) {
      plan.report.missing.push_back(n);
      continue;
    }
    if (!fits(n, *it->second, shape)) continue;
    if (transposed(n, shape)) plan.transposed.insert(n);
    plan.source.emplace(n, it->second);
    // The model's own aliases of n the file holds too (a tie the options declare for a
    // name the model lacks, say a head-less body under Hugging Face's GPT-2 names,
    // leaves the file's tensor unread, as before).
    for (const auto& a : aliases) {
      const auto c = by_model.find(a);
      if (c == by_model.end() || c == it) continue;
      const bool of_n = std::any_of(partners.lower_bound(a), partners.upper_bound(a),
                                    [&](const auto& p) { return p.second == n; });
      if (of_n && fits(a, *c->second, shape)) plan.copies[n].push_back({c->second, transposed(a, shape)});
    }
  }
  for (const auto& [m, fname] : file_name_of)
    if (!ours.contains(m) && !partner_where(m, [&](const std::string& q) { return ours.contains(q); }))
      plan.report.unexpected.push_back(fname);
  return plan;
}

// Elements [first, first + out.size()) of a parameter of shape `shape` from tensor t, stored
// transposed or not.
template <class T>
void read_elements(const state_dict_files& files, const state_dict_files::stored& t, bool transposed,
                   const Shape& shape, std::uint64_t first, std::span<T> out) {
  if (!transposed) {
    files.read(t, first, out);
    return;
  }
  // Model element (r, c) of [rows, cols] is file element (c, r) of [cols, rows]: the range
  // is strided in the file, so the whole tensor is read (one parameter at a time).
  const auto rows = std::uint64_t(shape[0]), cols = std::uint64_t(shape[1]);
  std::vector<T> whole(rows * cols);
  files.read(t, 0, std::span<T>(whole));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::uint64_t e = first + i, r = e / cols, c = e % cols;
    out[i] = whole[c * rows + r];
  }
}

// Elements [first, first + out.size()) of parameter n (shape `shape`) from its tensor; the
// same range of each copy of it in the file must hold the same bits, else io_error (the
// model would keep one of two different tensors).
template <class T>
void read_parameter(const state_dict_files& files, const load_plan& plan, const std::string& n, const Shape& shape,
                    std::uint64_t first, std::span<T> out) {
  const auto& source = *plan.source.at(n);
  read_elements(files, source, plan.transposed.contains(n), shape, first, out);
  const auto copies = plan.copies.find(n);
  if (copies == plan.copies.end()) return;
  std::vector<T> other(out.size());
  for (const auto& c : copies->second) {
    read_elements(files, *c.tensor, c.transposed, shape, first, std::span<T>(other));
    for (std::size_t i = 0; i < out.size(); ++i)
      if (std::memcmp(&other[i], &out[i], sizeof(T)) != 0)
        fail(files.origin(), "tensors \"", c.tensor->info.name, "\" and \"", source.info.name,
             "\" are one tied parameter of the model ('", n, "') but hold different values (element ", first + i, ": ",
             double(other[i]), " against ", double(out[i]), "); load the file into a model that keeps them apart",
             " (an untied head: tie_word_embeddings false), or drop one of them");
  }
}

// Reads into `out` (elements [begin, begin + out.size()) of a flat vector laid out as
// `entries`) every overlapping parameter the plan has a source for; the rest is untouched.
template <class T, class Entries>
void read_range(const state_dict_files& files, const load_plan& plan, const Entries& entries, std::uint64_t begin,
                std::span<T> out) {
  const std::uint64_t end = begin + out.size();
  for (const nn::flat_entry& e : entries) {
    const std::uint64_t lo = std::max<std::uint64_t>(begin, e.offset), hi = std::min<std::uint64_t>(end, e.offset + e.numel());
    if (lo >= hi || !plan.source.contains(e.name)) continue;
    read_parameter(files, plan, e.name, e.shape, lo - e.offset,
                   out.subspan(std::size_t(lo - begin), std::size_t(hi - lo)));
  }
}

inline void check_plan(const load_plan& plan, const state_dict_files& files, const state_dict_options& o) {
  if (o.strict && !plan.report.ok())
    throw io_error(cat(files.origin(), ": does not match the model (strict load): ", plan.report.describe()));
}

// The ties the engine found, {alias, target} (shard/discover.hpp: a Param listed under
// several names is laid out under the first, the others are aliases).
template <class Engine>
std::vector<std::pair<std::string, std::string>> engine_ties(const Engine& model) {
  std::vector<std::pair<std::string, std::string>> ties;
  if constexpr (requires { model.units().front().aliases; })
    for (const auto& u : model.units())
      for (const auto& a : u.aliases) ties.emplace_back(a.name, u.layout.entries.at(a.entry).name);
  return ties;
}

// The options plus the model's ties.
inline state_dict_options with_ties(const state_dict_options& options,
                                    const std::vector<std::pair<std::string, std::string>>& ties) {
  state_dict_options o = options;
  o.tied.insert(o.tied.end(), ties.begin(), ties.end());
  return o;
}

// The names the model's ties add: its aliases, whose tensors in a file must equal their targets'.
inline std::set<std::string, std::less<>> alias_names(const std::vector<std::pair<std::string, std::string>>& ties) {
  std::set<std::string, std::less<>> names;
  for (const auto& [alias, target] : ties) names.insert(alias);
  return names;
}
}  // namespace detail

// A sharded model's engine (shard::ShardedModel), as the loaders read it.
template <class E>
concept StateDictEngine = requires(E& e, std::size_t i) {
  e.comm();
  e.unit_count();
  e.unit_layout(i).entries;
  e.partition(i).shard_size();
  e.partition_rank();
  e.master_piece(i);
  e.full_state_dict();
};

// Loads the parameters of a sharded model from `path` (a .safetensors file, a
// model.safetensors.index.json, or a directory holding either). Collective: every rank
// reads only what its master piece needs and the model changes only when every rank
// succeeded; any failure raises io_error on every rank. Strict (the default) raises
// naming every missing, unexpected and misshapen tensor; otherwise those are reported
// and their parameters keep their values.
template <StateDictEngine Engine>
load_report load_state_dict(const std::filesystem::path& path, Engine& model, const state_dict_options& options = {}) {
  using T = typename std::remove_cvref_t<decltype(model.master_piece(0))>::value_type;
  stager<typename Engine::space> staging;
  const auto ties = detail::engine_ties(model);
  const state_dict_options o = detail::with_ties(options, ties);
  const auto aliases = detail::alias_names(ties);
  std::vector<std::vector<T>> pieces(model.unit_count());
  load_report report;
  auto comm = detail::host_collectives_of(model);
  detail::on_all_ranks(comm, cat("loading ", path.string()), [&] {
    const detail::state_dict_files files(path);
    std::vector<std::pair<std::string, Shape>> params;
    for (std::size_t i = 0; i < model.unit_count(); ++i)
      for (const auto& e : model.unit_layout(i).entries) params.emplace_back(e.name, e.shape);
    auto plan = detail::plan_load(params, files, o, aliases);
    detail::check_plan(plan, files, o);
    for (std::size_t i = 0; i < model.unit_count(); ++i) {
      // what nothing loads keeps its value
      detail::with_master(model, i, [&](std::span<const T> piece, auto space) {
        pieces[i].resize(piece.size());
        detail::copy_to_host<typename decltype(space)::type>(staging, piece, std::span<T>(pieces[i]));
      });
      const std::uint64_t begin = model.partition(i).begin(model.partition_rank());
      detail::read_range(files, plan, model.unit_layout(i).entries, begin, std::span<T>(pieces[i]));
    }
    report = std::move(plan.report);
  });
  for (std::size_t i = 0; i < pieces.size(); ++i) model.load_master(i, std::span<const T>(pieces[i]));
  return report;
}

// The same for a plain model whose parameters `owner` holds (nothing changes on failure;
// errors name the file).
template <class T, nn::Layer L>
load_report load_state_dict(const std::filesystem::path& path, nn::Replicated<T, L>& owner,
                            const state_dict_options& options = {}) {
  const auto ties = nn::tied_names(owner.layer());  // {alias, target}, as the engine's
  const state_dict_options o = detail::with_ties(options, ties);
  const detail::state_dict_files files(path);
  std::vector<std::pair<std::string, Shape>> params;
  for (const auto& e : owner.layout().entries) params.emplace_back(e.name, e.shape);
  auto plan = detail::plan_load(params, files, o, detail::alias_names(ties));
  detail::check_plan(plan, files, o);
  std::vector<T> values(owner.values().begin(), owner.values().end());
  detail::read_range(files, plan, owner.layout().entries, 0, std::span<T>(values));
  std::copy(values.begin(), values.end(), owner.values().begin());
  return std::move(plan.report);
}

// Writes a sharded model's parameters under the file's names and layout (options.names,
// transposed, tied, save_dtype, max_shard_bytes), with metadata {"format": "pt"}, as
// save_pretrained does; a parameter the model ties is written once, under its first name
// (safetensors holds no shared tensors). Collective: the full parameters are gathered to
// rank 0 (one unit at a time, model.full_state_dict()), which writes; a failure raises on
// every rank.
template <StateDictEngine Engine>
void save_state_dict(const std::filesystem::path& path, Engine& model, const state_dict_options& options = {}) {
  const state_dict_options o = detail::with_ties(options, detail::engine_ties(model));
  auto full = model.full_state_dict();
  auto comm = detail::host_collectives_of(model);
  detail::on_all_ranks(comm, cat("saving ", path.string()), [&] {
    if (model.comm().rank() != 0) return;
    using T = typename std::remove_cvref_t<decltype(model.master_piece(0))>::value_type;
    std::vector<detail::tensor_to_save<T>> all;
    for (const auto& t : full) all.push_back({t.name, t.value.shape(), t.value.span()});
    detail::write_state_dict(path, all, o);
  });
}

// The same for a plain model whose parameters `owner` holds.
template <class T, nn::Layer L>
void save_state_dict(const std::filesystem::path& path, nn::Replicated<T, L>& owner,
                     const state_dict_options& o = {}) {
  std::vector<detail::tensor_to_save<T>> all;
  for (const auto& e : owner.layout().entries)
    all.push_back({e.name, e.shape, std::span<const T>(owner.values().subspan(e.offset, e.numel()))});
  detail::write_state_dict(path, all, o);
}

}  // namespace shardlib::io
