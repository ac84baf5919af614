// shardlib/io/state_dict.hpp — a model's parameters from and to safetensors files under
// another framework's names and layouts, as PyTorch's load_state_dict and Hugging Face's
// save_pretrained / from_pretrained exchange them:
//   - a name map between the file's names and the model's dotted names (identity by default),
//   - tensors stored transposed (Hugging Face GPT-2's Conv1D keeps [in, out]; Linear [out, in]),
//   - any of F32, F64, F16, BF16 in the file, converted to the model's master dtype,
//   - tied parameters (a name the file leaves out because it shares its partner's values),
//   - strict loading (an error listing every missing, unexpected and misshapen tensor) or a report,
//   - one file, or Hugging Face's sharded layout (model-0000k-of-0000n.safetensors and
//     model.safetensors.index.json).
// Works on a ShardedModel (every rank reads only the ranges its master piece needs; collective)
// and on a plain model whose parameters an nn::Replicated holds.
// The files are read by io/state_dict_files.hpp; Hugging Face's GPT-2 and LLaMA conventions:
// io/hf_checkpoint.hpp.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"          // dtype, element_cast, half, bfloat16, size_of, name
#include "shardlib/core/error.hpp"            // io_error, cat
#include "shardlib/core/shape.hpp"            // Shape
#include "shardlib/io/rank_agreement.hpp"     // detail::on_all_ranks
#include "shardlib/io/safetensors.hpp"        // tensor_info, safetensors_writer, detail::input_file, ...
#include "shardlib/io/staging.hpp"            // stager, detail::copy_to_host, host_collectives_of
#include "shardlib/io/state_dict_files.hpp"   // detail::state_dict_files
#include "shardlib/nn/flat.hpp"               // nn::flat_entry
#include "shardlib/nn/replicated.hpp"         // nn::Replicated

#include <nlohmann/json.hpp>  // nlohmann::json, nlohmann::ordered_json

#include <algorithm>    // std::copy, std::reverse
#include <cmath>        // std::isinf, std::isfinite
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // std::uint64_t, std::int64_t
#include <cstdio>       // std::snprintf, std::sscanf
#include <filesystem>   // std::filesystem
#include <functional>   // std::function, std::less
#include <map>          // std::map
#include <memory>       // std::make_shared
#include <optional>     // std::optional, std::nullopt
#include <set>          // std::set
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::remove_cvref_t
#include <utility>      // std::move, std::pair
#include <vector>       // std::vector

namespace shardlib::io {

// Between the file's tensor names and the model's parameter names. to_model returning
// nullopt ignores a tensor on purpose (a buffer the model does not keep): it is then
// neither loaded nor reported. Saving writes each parameter under to_file(name).
class name_map {
 public:
  using to_model_fn = std::function<std::optional<std::string>(std::string_view file_name)>;
  using to_file_fn = std::function<std::string(std::string_view model_name)>;

  name_map() = default;  // the same names on both sides
  name_map(to_model_fn to_model, to_file_fn to_file) : to_model_(std::move(to_model)), to_file_(std::move(to_file)) {}

  // Exact pairs {file name, model name}; names not listed are the same on both sides.
  static name_map table(std::vector<std::pair<std::string, std::string>> pairs) {
    auto to_model = std::make_shared<std::map<std::string, std::string, std::less<>>>();
    auto to_file = std::make_shared<std::map<std::string, std::string, std::less<>>>();
    for (auto& [f, m] : pairs) {
      require<io_error>(to_model->emplace(f, m).second && to_file->emplace(m, f).second,
                        "name_map::table: '", f, "' <-> '", m, "' repeats a name (the map must be one-to-one)");
    }
    return {[to_model](std::string_view n) -> std::optional<std::string> {
              const auto it = to_model->find(n);
              return it == to_model->end() ? std::string(n) : it->second;
            },
            [to_file](std::string_view n) {
              const auto it = to_file->find(n);
              return it == to_file->end() ? std::string(n) : it->second;
            }};
  }
  // Prefix rules {file prefix, model prefix}, the first that matches applying (loading
  // reads the file side, saving the model side); names no rule matches stay as they are.
  static name_map prefixes(std::vector<std::pair<std::string, std::string>> rules) {
    auto r = std::make_shared<const std::vector<std::pair<std::string, std::string>>>(std::move(rules));
    const auto swap = [](std::string_view n, const std::string& from, const std::string& to) {
      return to + std::string(n.substr(from.size()));
    };
    return {[r, swap](std::string_view n) -> std::optional<std::string> {
              for (const auto& [f, m] : *r)
                if (n.starts_with(f)) return swap(n, f, m);
              return std::string(n);
            },
            [r, swap](std::string_view n) {
              for (const auto& [f, m] : *r)
                if (n.starts_with(m)) return swap(n, m, f);
              return std::string(n);
            }};
  }

  std::optional<std::string> to_model(std::string_view file_name) const {
    return to_model_ ? to_model_(file_name) : std::optional<std::string>(std::string(file_name));
  }
  std::string to_file(std::string_view model_name) const {
    return to_file_ ? to_file_(model_name) : std::string(model_name);
  }

 private:
  to_model_fn to_model_;
  to_file_fn to_file_;
};

struct state_dict_options {
  name_map names{};
  // The model's 2-D parameters whose name ends with one of these are stored transposed
  // in the file ([in, out] for a model's [out, in]): read and written transposed.
  std::vector<std::string> transposed{};
  // Tied parameters {alias, target}, both the model's names: the file may hold only one
  // of them (Hugging Face keeps the target: GPT-2's lm_head.weight is transformer.wte.weight).
  // Loading, a parameter the file lacks takes its partner's tensor (either way round) and is
  // not missing, and a tensor of a name whose partner the model has is not unexpected.
  // Saving writes the target only (a model holding both as two parameters must hold equal
  // values). A ShardedModel's own ties (shard/discover.hpp's aliases) are added to these.
  std::vector<std::pair<std::string, std::string>> tied{};
  // Loading: any missing, unexpected or misshapen tensor is an io_error naming them all
  // (PyTorch's strict=True); otherwise they are returned in the report and the model
  // keeps its values where nothing was loaded.
  bool strict = true;
  // Saving: the file's dtype (F32, F64, F16 or BF16); the master dtype when unset.
  std::optional<dtype> save_dtype{};
  // Saving: 0 writes one file at the path given; otherwise the path is a directory that
  // gets Hugging Face's sharded layout, each file at most this many bytes of tensor data
  // (a larger tensor gets a file of its own).
  std::uint64_t max_shard_bytes = 0;
};

struct shape_mismatch {
  std::string name;  // the model's
  Shape in_file, in_model;
  bool transposed = false;  // stored transposed: in_file should have been in_model reversed
  friend bool operator==(const shape_mismatch&, const shape_mismatch&) = default;
};

// What a load found, as PyTorch's load_state_dict returns it (names sorted).
struct load_report {
  std::vector<std::string> missing;     // the model's parameters nothing in the file provides
  std::vector<std::string> unexpected;  // the file's tensors (file names) no parameter takes
  std::vector<shape_mismatch> mismatched;
  std::vector<std::string> from_tied;  // the model's parameters loaded from their tie partner's tensor

  bool ok() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // "missing: a, b; unexpected: c; shape mismatch: d is [3, 2] in the file, [2, 3] in the model"
  std::string describe() const {
    std::string s;
    const auto list = [&](std::string_view what, const std::vector<std::string>& names) {
      if (names.empty()) return;
      s += cat(s.empty() ? "" : "; ", what, " (", names.size(), "): ");
      for (std::size_t i = 0; i < names.size(); ++i) s += cat(i ? ", " : "", names[i]);
    };
    list("missing", missing);
    list("unexpected", unexpected);
    if (!mismatched.empty()) s += cat(s.empty() ? "" : "; ", "shape mismatch (", mismatched.size(), "): ");
    for (std::size_t i = 0; i < mismatched.size(); ++i) {
      const auto& m = mismatched[i];
      s += cat(i ? ", " : "", m.name, " is ", m.in_file, " in the file but ", m.in_model, " in the model",
               m.transposed ? " (stored transposed)" : "");
    }
    return s;
  }
};

namespace detail {

inline bool ends_with_any(std::string_view name, const std::vector<std::string>& suffixes) {
  for (const auto& s : suffixes)
    if (name.ends_with(s)) return true;
  return false;
}

inline Shape reversed(const Shape& s) {
  std::vector<std::int64_t> e(s.extents().begin(), s.extents().end());
  std::reverse(e.begin(), e.end());
  return Shape(std::span<const std::int64_t>(e));
}

// A parameter of the model and where its values come from in the file.
struct load_plan {
  std::map<std::string, const state_dict_files::stored*, std::less<>> source;  // model name -> tensor
  std::set<std::string, std::less<>> transposed;                              // model names
  load_report report;
};

// Matches the model's parameters (name, shape) with the file's tensors.
inline load_plan plan_load(const std::vector<std::pair<std::string, Shape>>& params, const state_dict_files& files,
                           const state_dict_options& o) {
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

  for (const auto& [n, shape] : params) {
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
    const Shape& stored = it->second->info.shape;
    const bool transpose = shape.rank() == 2 && ends_with_any(n, o.transposed);
    if (stored != (transpose ? reversed(shape) : shape)) {
      plan.report.mismatched.push_back({n, stored, shape, transpose});
      continue;
    }
    if (transpose) plan.transposed.insert(n);
    plan.source.emplace(n, it->second);
  }
  for (const auto& [m, fname] : file_name_of)
    if (!ours.contains(m) && !partner_where(m, [&](const std::string& q) { return ours.contains(q); }))
      plan.report.unexpected.push_back(fname);
  return plan;
}

// Elements [first, first + out.size()) of parameter n (shape `shape`) from its tensor.
template <class T>
void read_parameter(const state_dict_files& files, const load_plan& plan, const std::string& n, const Shape& shape,
                    std::uint64_t first, std::span<T> out) {
  const auto& t = *plan.source.at(n);
  if (!plan.transposed.contains(n)) {
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

// A tensor to write: the model's name and shape, and its values (row-major, host memory).
template <class T>
struct tensor_to_save {
  std::string name;
  Shape shape;
  std::span<const T> values;
};

// Appends v in `type`; false when a finite v is beyond its range (it would be inf).
template <class T>
bool append_converted(std::vector<std::byte>& out, dtype type, T v) {
  const auto put = [&](auto x) {
    const auto* b = reinterpret_cast<const std::byte*>(&x);
    out.insert(out.end(), b, b + sizeof x);
    return !std::isinf(double(x)) || !std::isfinite(double(v));
  };
  switch (type) {
    case dtype::f32: return put(element_cast<float>(v));
    case dtype::f64: return put(element_cast<double>(v));
    case dtype::f16: return put(element_cast<half>(v));
    case dtype::bf16: return put(element_cast<bfloat16>(v));
    default: return true;
  }
}

inline std::string shard_file_name(std::size_t k, std::size_t n) {
  char b[64];
  std::snprintf(b, sizeof b, "model-%05zu-of-%05zu.safetensors", k, n);
  return b;
}
inline bool is_shard_file_name(const std::string& name) {
  std::size_t k = 0, n = 0;
  return std::sscanf(name.c_str(), "model-%zu-of-%zu.safetensors", &k, &n) == 2 && shard_file_name(k, n) == name;
}

// The files of an earlier sharded save into `dir` that a new save did not overwrite.
inline void remove_shards_except(const std::filesystem::path& dir, const std::set<std::string>& keep) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (is_shard_file_name(name) && !keep.contains(name)) std::filesystem::remove(e.path());
  }
}

// Writes tensors under the file's names and layout (one file, or the sharded layout).
template <class T>
void write_state_dict(const std::filesystem::path& path, const std::vector<tensor_to_save<T>>& all,
                      const state_dict_options& o) {
  const dtype type = o.save_dtype.value_or(dtype_of<T>);
  if (type != dtype::f32 && type != dtype::f64 && type != dtype::f16 && type != dtype::bf16)
    fail(path.string(), "save_dtype ", shardlib::name(type), ": parameters are saved as F32, F64, F16 or BF16");
  std::map<std::string_view, const tensor_to_save<T>*, std::less<>> by_name;
  for (const auto& t : all) by_name.emplace(t.name, &t);
  struct converted {
    std::string name;
    Shape shape;
    std::vector<std::byte> bytes;
  };
  std::vector<converted> out;
  for (const auto& t : all) {
    bool skip = false;
    for (const auto& [alias, target] : o.tied) {
      if (t.name != alias || !by_name.contains(target)) continue;
      const auto& other = *by_name.at(target);
      if (other.shape != t.shape || !std::equal(t.values.begin(), t.values.end(), other.values.begin()))
        fail(path.string(), "tied parameters '", alias, "' and '", target,
             "' hold different values: only the target is written, so the alias would be lost");
      skip = true;
    }
    if (skip) continue;
    const bool transpose = t.shape.rank() == 2 && ends_with_any(t.name, o.transposed);
    converted c{o.names.to_file(t.name), transpose ? reversed(t.shape) : t.shape, {}};
    c.bytes.reserve(t.values.size() * size_of(type));
    const auto rows = std::size_t(transpose ? t.shape[0] : 0), cols = std::size_t(transpose ? t.shape[1] : 0);
    for (std::size_t i = 0; i < t.values.size(); ++i) {  // file element i is model element (i % rows, i / rows)
      const T v = transpose ? t.values[(i % rows) * cols + i / rows] : t.values[i];
      if (!append_converted(c.bytes, type, v))
        fail(path.string(), "parameter '", t.name, "' holds ", double(v), ", beyond ", shardlib::name(type),
             "'s range: it would be saved as inf");
    }
    out.push_back(std::move(c));
  }
  const auto write_file = [&](const std::filesystem::path& file, std::size_t from, std::size_t to) {
    safetensors_writer w;
    w.set_metadata("format", "pt");
    for (std::size_t i = from; i < to; ++i) w.add(out[i].name, type, out[i].shape, out[i].bytes);
    w.write(file);
  };
  if (o.max_shard_bytes == 0) {
    write_file(path, 0, out.size());
    // Over an earlier sharded save in Hugging Face's layout: its files go (loads read
    // model.safetensors first anyway).
    if (path.filename() == hf_single_name) {
      const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
      std::filesystem::remove(dir / hf_index_name);
      remove_shards_except(dir, {});
    }
    return;
  }
  std::set<std::string_view> names;  // the files' tensors are found by name through one index
  for (const auto& c : out)
    if (!names.insert(c.name).second) fail(path.string(), "two parameters are written under the name '", c.name, "'");
  std::vector<std::size_t> starts{0};  // files hold out[starts[k], starts[k + 1])
  std::uint64_t in_file = 0, total = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::uint64_t b = out[i].bytes.size();
    if (in_file > 0 && in_file + b > o.max_shard_bytes) {
      starts.push_back(i);
      in_file = 0;
    }
    in_file += b;
    total += b;
  }
  starts.push_back(out.size());
  std::filesystem::create_directories(path);
  // No moment at which a load could mix files of two saves: the old index and a
  // model.safetensors (read before any index) go first, the new index comes last,
  // and the files of the old save that the new one did not overwrite go then.
  std::filesystem::remove(path / hf_index_name);
  std::filesystem::remove(path / hf_single_name);
  const std::size_t n = starts.size() - 1;
  nlohmann::ordered_json index{{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::ordered_json::object()}};
  std::set<std::string> written;
  for (std::size_t k = 0; k < n; ++k) {
    const std::string fn = shard_file_name(k + 1, n);
    write_file(path / fn, starts[k], starts[k + 1]);
    written.insert(fn);
    for (std::size_t i = starts[k]; i < starts[k + 1]; ++i) index["weight_map"][out[i].name] = fn;
  }
  atomic_file f(path / hf_index_name);
  f.write(as_bytes(index.dump(2) + "\n"));
  f.commit();
  remove_shards_except(path, written);
}

}  // namespace detail

namespace detail {
// The options plus the ties the engine found (shard/discover.hpp: a Param listed under
// several names is laid out under the first, the others are aliases).
template <class Engine>
state_dict_options with_engine_ties(const Engine& model, const state_dict_options& options) {
  state_dict_options o = options;
  if constexpr (requires { model.units().front().aliases; })
    for (const auto& u : model.units())
      for (const auto& a : u.aliases) o.tied.emplace_back(a.name, u.layout.entries.at(a.entry).name);
  return o;
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
  const state_dict_options o = detail::with_engine_ties(model, options);
  std::vector<std::vector<T>> pieces(model.unit_count());
  load_report report;
  auto comm = detail::host_collectives_of(model);
  detail::on_all_ranks(comm, cat("loading ", path.string()), [&] {
    const detail::state_dict_files files(path);
    std::vector<std::pair<std::string, Shape>> params;
    for (std::size_t i = 0; i < model.unit_count(); ++i)
      for (const auto& e : model.unit_layout(i).entries) params.emplace_back(e.name, e.shape);
    auto plan = detail::plan_load(params, files, o);
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
                            const state_dict_options& o = {}) {
  const detail::state_dict_files files(path);
  std::vector<std::pair<std::string, Shape>> params;
  for (const auto& e : owner.layout().entries) params.emplace_back(e.name, e.shape);
  auto plan = detail::plan_load(params, files, o);
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
  const state_dict_options o = detail::with_engine_ties(model, options);
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
