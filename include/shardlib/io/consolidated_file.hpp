// shardlib/io/consolidated_file.hpp — one safetensors file holding a whole model: its
// "shardlib" metadata entry (steps, optimizer, loss scaler, user fields), its tensors'
// names and order, and safetensors_source, which reads one by parameter and element range.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"          // dtype, size_of, name, element_cast, half, bfloat16
#include "shardlib/core/error.hpp"            // io_error, cat
#include "shardlib/core/shape.hpp"            // Shape
#include "shardlib/io/checkpoint_format.hpp"  // checkpoint_optimizer, detail::optimizer_to_json, ...
#include "shardlib/io/safetensors.hpp"        // tensor_info, detail::input_file, read_header, ...
#include "shardlib/shard/precision.hpp"       // loss_scaler

#include <nlohmann/json.hpp>  // nlohmann::json

#include <algorithm>    // std::sort
#include <cmath>        // std::isinf, std::isfinite
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // std::uint64_t
#include <cstring>      // std::memcpy
#include <filesystem>   // std::filesystem
#include <functional>   // std::less
#include <limits>       // std::numeric_limits
#include <map>          // std::map
#include <optional>     // std::optional
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <utility>      // std::move, std::pair
#include <vector>       // std::vector

namespace shardlib::io {

// What a consolidated file records besides tensors, in its "shardlib" metadata entry.
struct consolidated_info {
  std::uint64_t steps = 0;
  std::optional<checkpoint_optimizer> optimizer;  // with optimizer.<param>.<buffer> tensors
  std::optional<shard::loss_scaler> scaler;
  nlohmann::json user = nlohmann::json::object();
};

namespace detail {

inline std::map<std::string, std::string> consolidated_metadata(const consolidated_info& c) {
  const nlohmann::json j{{"version", checkpoint_version},
                         {"steps", c.steps},
                         {"optimizer", c.optimizer ? optimizer_to_json(*c.optimizer) : nlohmann::json(nullptr)},
                         {"loss_scaler", c.scaler ? scaler_to_json(*c.scaler) : nlohmann::json(nullptr)},
                         {"user", c.user}};
  try {
    return {{"format", "pt"}, {"shardlib", j.dump()}};
  } catch (const nlohmann::json::exception& e) {
    throw io_error(cat("consolidated metadata: a user field is not valid UTF-8: ", e.what()));
  }
}

inline std::string optimizer_tensor(std::string_view param, std::string_view kind) {
  return cat("optimizer.", param, ".", kind);
}

// The tensors of a consolidated file in the order they are written: per unit, its
// parameters, then each optimizer buffer of each of its parameters.
template <class Units>
std::vector<tensor_info> consolidated_tensors(const Units& units, const std::vector<std::string>& kinds) {
  std::vector<tensor_info> out;
  for (const auto& u : units) {
    for (const auto& e : u) out.push_back({e.name, dtype::f32, e.shape, 0, 0});
    for (const auto& k : kinds)
      for (const auto& e : u) out.push_back({optimizer_tensor(e.name, k), dtype::f32, e.shape, 0, 0});
  }
  return out;
}

}  // namespace detail

// A safetensors file read by parameter and element range (pread, no whole-file read),
// converting F64, F16 and BF16 to float.
class safetensors_source {
 public:
  explicit safetensors_source(const std::filesystem::path& file) : origin_(file.string()), in_(file) {
    auto [n, header] = detail::read_file_header(in_);
    data_start_ = detail::size_field_bytes + n;
    tensors_ = std::move(header.tensors);
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      if (t.type != dtype::f32 && t.type != dtype::f64 && t.type != dtype::f16 && t.type != dtype::bf16)
        detail::fail(origin_, "tensor \"", t.name, "\" has dtype ", name(t.type),
                     "; parameters and optimizer state must be F32, F64, F16 or BF16");
      index_.emplace(t.name, i);
    }
    if (const auto it = header.metadata.find("shardlib"); it != header.metadata.end()) info_ = parse_info(it->second);
  }

  const std::string& origin() const { return origin_; }
  // The "shardlib" metadata of a file this library consolidated; absent in others (PyTorch's).
  const std::optional<consolidated_info>& info() const { return info_; }
  const tensor_info* find(std::string_view name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }
  // The model's parameters: every tensor but optimizer.*, in file order.
  std::vector<std::pair<std::string, Shape>> parameters() const {
    std::vector<std::pair<std::string, Shape>> out;
    for (const auto& t : tensors_)
      if (!t.name.starts_with("optimizer.")) out.emplace_back(t.name, t.shape);
    return out;
  }

  // Asks for elements [first, first + out.size()) of parameter `name` ("master") or of
  // its optimizer buffer `kind`, to arrive in out at finish().
  void request(std::string_view name, std::string_view kind, std::uint64_t first, std::span<float> out) {
    const std::string tensor = kind == "master" ? std::string(name) : detail::optimizer_tensor(name, kind);
    const tensor_info* t = find(tensor);
    if (!t) detail::fail(origin_, "has no tensor \"", tensor, "\"");
    const std::uint64_t numel = std::uint64_t(t->shape.numel());
    if (first > numel || out.size() > numel - first)
      detail::fail(origin_, "tensor \"", tensor, "\" has ", numel, " elements, not [", first, ", ", first + out.size(),
                   ")");
    pending_.push_back({t, first, out});
  }
  // Reads the requested pieces in file order (pread: no whole-file read), converting to
  // float. An F64 value beyond float's range is an error, not an inf.
  void finish() {
    const auto offset = [&](const piece& p) { return p.tensor->begin + p.first * size_of(p.tensor->type); };
    std::sort(pending_.begin(), pending_.end(), [&](const piece& a, const piece& b) { return offset(a) < offset(b); });
    for (const auto& p : pending_) {
      const std::uint64_t at = data_start_ + offset(p);
      if (p.tensor->type == dtype::f32) {
        in_.read_at(at, std::as_writable_bytes(p.out));
        continue;
      }
      const std::size_t es = size_of(p.tensor->type);
      raw_.resize(p.out.size() * es);
      in_.read_at(at, raw_);
      for (std::size_t i = 0; i < p.out.size(); ++i) p.out[i] = to_float(*p.tensor, p.first + i, raw_.data() + i * es);
    }
    pending_.clear();
  }

 private:
  float to_float(const tensor_info& t, std::uint64_t element, const std::byte* p) const {
    if (t.type == dtype::f16) return element_cast<float>(load<half>(p));
    if (t.type == dtype::bf16) return element_cast<float>(load<bfloat16>(p));
    const double v = load<double>(p);
    const float f = element_cast<float>(v);
    if (std::isinf(f) && std::isfinite(v))
      detail::fail(origin_, "tensor \"", t.name, "\" element ", element, " is ", v, ", beyond float's range (largest ",
                   std::numeric_limits<float>::max(), "): it would load as inf");
    return f;
  }
  template <class E>
  static E load(const std::byte* p) {
    E e;
    std::memcpy(&e, p, sizeof e);
    return e;
  }
  consolidated_info parse_info(const std::string& text) const {
    const std::string origin = cat(origin_, ": \"shardlib\" metadata");
    const nlohmann::json j = detail::parse_json(text, origin, "the entry");
    const auto version = detail::count_field(j, "version", std::numeric_limits<std::uint64_t>::max(), origin, "");
    if (version != std::uint64_t(checkpoint_version))
      detail::fail(origin, "unknown format version ", version, " (this build reads version ", checkpoint_version, ")");
    consolidated_info c;
    c.steps = detail::count_field(j, "steps", std::numeric_limits<std::uint64_t>::max(), origin, "");
    if (const auto& o = detail::field(j, "optimizer", origin, ""); !o.is_null())
      c.optimizer = detail::optimizer_from_json(o, origin);
    if (const auto& s = detail::field(j, "loss_scaler", origin, ""); !s.is_null())
      c.scaler = detail::scaler_from_json(s, origin);
    c.user = detail::field(j, "user", origin, "");
    return c;
  }

  std::string origin_;
  detail::input_file in_;
  std::uint64_t data_start_ = 0;
  std::vector<tensor_info> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::optional<consolidated_info> info_;
  struct piece {
    const tensor_info* tensor;
    std::uint64_t first;  // element
    std::span<float> out;
  };
  std::vector<piece> pending_;
  std::vector<std::byte> raw_;
};

}  // namespace shardlib::io
