// shardlib/io/state_dict_writer.hpp — writes host tensors as a state dict: under the
// file's names and layout (state_dict_options: names, transposed, tied, save_dtype), as
// one safetensors file or Hugging Face's sharded layout, replacing what an earlier save
// left there. io/state_dict.hpp gathers a model's tensors and calls it.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"          // dtype, element_cast, half, bfloat16, size_of, name, dtype_of
#include "shardlib/core/shape.hpp"            // Shape
#include "shardlib/io/safetensors.hpp"        // safetensors_writer, atomic_file, as_bytes, fail
#include "shardlib/io/state_dict_files.hpp"   // hf_index_name, hf_single_name
#include "shardlib/io/state_dict_options.hpp" // state_dict_options, detail::ends_with_any, detail::reversed

#include <nlohmann/json.hpp>  // nlohmann::ordered_json

#include <algorithm>     // std::equal
#include <cmath>         // std::isinf, std::isfinite
#include <cstddef>       // std::byte, std::size_t
#include <cstdint>       // std::uint64_t
#include <cstdio>        // std::snprintf, std::sscanf
#include <filesystem>    // std::filesystem
#include <functional>    // std::less
#include <map>           // std::map
#include <ranges>        // std::views::keys
#include <set>           // std::set
#include <span>          // std::span
#include <string>        // std::string
#include <string_view>   // std::string_view
#include <system_error>  // std::error_code
#include <utility>       // std::move
#include <vector>        // std::vector

namespace shardlib::io::detail {

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

// Removes a file if it exists; failing to is an io_error naming it.
inline void remove_file(const std::filesystem::path& file) {
  std::error_code ec;
  std::filesystem::remove(file, ec);
  if (ec) fail(file.string(), "cannot remove: ", ec.message());
}

// The files of an earlier sharded save into `dir` that a new save did not overwrite.
inline void remove_shards_except(const std::filesystem::path& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  for (const std::filesystem::directory_iterator end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (is_shard_file_name(name) && !keep.contains(name)) remove_file(it->path());
  }
  if (ec) fail(dir.string(), "cannot list the directory: ", ec.message());
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
  require_only_matches(o, std::views::keys(by_name), path.string());
  struct converted {
    std::string name;
    Shape shape;
    std::vector<std::byte> bytes;
  };
  std::vector<converted> out;
  for (const auto& t : all) {
    bool skip = !takes(o, t.name);  // options.only leaves it out
    for (const auto& [alias, target] : o.tied) {
      if (t.name != alias || !by_name.contains(target) || !takes(o, target)) continue;
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
      remove_file(dir / hf_index_name);
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
  if (std::error_code ec; !std::filesystem::create_directories(path, ec) && ec)
    fail(path.string(), "cannot create the directory: ", ec.message());
  // No moment at which a load could mix files of two saves: the old index and a
  // model.safetensors (read before any index) go first, the new index comes last,
  // and the files of the old save that the new one did not overwrite go then.
  remove_file(path / hf_index_name);
  remove_file(path / hf_single_name);
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

}  // namespace shardlib::io::detail
