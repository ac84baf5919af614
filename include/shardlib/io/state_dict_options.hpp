// shardlib/io/state_dict_options.hpp — how a state dict's file differs from the model:
// the name map, tensors stored transposed, tied parameters, strictness and the save's
// dtype and sharding (state_dict_options), and what a load found (load_report). Read by
// the loaders (io/state_dict.hpp) and the writer (io/state_dict_writer.hpp).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"  // dtype
#include "shardlib/core/error.hpp"    // io_error, cat, require
#include "shardlib/core/glob.hpp"     // glob_match
#include "shardlib/core/shape.hpp"    // Shape

#include <algorithm>    // std::reverse, std::any_of
#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint64_t, std::int64_t
#include <functional>   // std::function, std::less
#include <map>          // std::map
#include <memory>       // std::make_shared
#include <optional>     // std::optional, std::nullopt
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
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

  // `file_side`, then `model_side`: a file name becomes file_side's model name, which
  // model_side maps on (saving, the other way round). E.g. Hugging Face's GPT-2 names,
  // then an adapted model's base_layer names (models::load_hf).
  static name_map chain(name_map file_side, name_map model_side) {
    return {[f = file_side, m = model_side](std::string_view n) -> std::optional<std::string> {
              const auto middle = f.to_model(n);
              return middle ? m.to_model(*middle) : std::nullopt;
            },
            [f = file_side, m = model_side](std::string_view n) { return f.to_file(m.to_file(n)); }};
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
  // Where the model itself ties the two (one Param listed under both names: a
  // ShardedModel's aliases, a plain model's repeated Param) and the file holds both, they
  // must hold the same values (bits, once converted), else io_error naming both (the
  // model would keep only one); other such tensors are not read. The model's own ties
  // are added to these.
  // Saving writes the target only (a model holding both as two parameters must hold equal
  // values).
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
  // Globs over the model's parameter names (core/glob.hpp): saving writes, and loading
  // reads and reports, only the parameters one matches; a file's tensor of a parameter
  // they leave out is not read and not reported. Empty: every parameter. PEFT's adapter
  // files: {"*lora_*"}. A glob that matches no parameter is an error naming it.
  std::vector<std::string> only{};
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

// Whether options.only takes the model's parameter `name`.
inline bool takes(const state_dict_options& o, std::string_view name) {
  return o.only.empty() || std::any_of(o.only.begin(), o.only.end(), [&](const std::string& g) {
           return glob_match(g, name);
         });
}
// That every glob of options.only matches one of `names`, else io_error naming it and `origin`.
template <class Names>
void require_only_matches(const state_dict_options& o, const Names& names, std::string_view origin) {
  for (const auto& g : o.only)
    require<io_error>(std::any_of(names.begin(), names.end(), [&](const auto& n) { return glob_match(g, n); }),
                      origin, ": state_dict_options::only: no parameter matches '", g,
                      "' (a glob over the model's dotted names)");
}

inline Shape reversed(const Shape& s) {
  std::vector<std::int64_t> e(s.extents().begin(), s.extents().end());
  std::reverse(e.begin(), e.end());
  return Shape(std::span<const std::int64_t>(e));
}

}  // namespace detail

}  // namespace shardlib::io
