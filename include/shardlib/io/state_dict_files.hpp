// shardlib/io/state_dict_files.hpp — the tensors a state dict is loaded from: one safetensors
// file, or Hugging Face's sharded layout (model-0000k-of-0000n.safetensors beside
// model.safetensors.index.json, whose "weight_map" names each tensor's file), read by element
// range and converted to the model's dtype. io/state_dict.hpp plans and performs the load.
#pragma once
#include "shardlib/core/element.hpp"  // dtype, element_cast, half, bfloat16, size_of, name, dtype_of
#include "shardlib/io/safetensors.hpp"  // tensor_info, detail::input_file, read_file_header, read_text_file, fail

#include <nlohmann/json.hpp>  // nlohmann::json

#include <cmath>         // std::isinf, std::isfinite
#include <cstddef>       // std::byte, std::size_t
#include <cstdint>       // std::uint64_t
#include <cstring>       // std::memcpy
#include <filesystem>    // std::filesystem
#include <functional>    // std::less
#include <map>           // std::map
#include <set>           // std::set
#include <span>          // std::span
#include <string>        // std::string
#include <string_view>   // std::string_view
#include <system_error>  // std::error_code
#include <utility>       // std::move
#include <vector>        // std::vector

namespace shardlib::io::detail {

inline constexpr std::string_view hf_index_name = "model.safetensors.index.json";
inline constexpr std::string_view hf_single_name = "model.safetensors";

// The tensors of one safetensors file, or of Hugging Face's sharded layout through its
// index, read by element range with conversion to the model's dtype.
class state_dict_files {
 public:
  struct stored {
    std::size_t file;
    tensor_info info;
  };

  // path: a .safetensors file, an index .json, or a directory holding model.safetensors
  // or model.safetensors.index.json.
  explicit state_dict_files(const std::filesystem::path& path) {
    namespace fs = std::filesystem;
    fs::path p = path;
    std::error_code ec;  // an inaccessible path is for the reads below to name
    if (fs::is_directory(p, ec)) {
      if (fs::exists(p / hf_single_name, ec)) p /= hf_single_name;
      else if (fs::exists(p / hf_index_name, ec)) p /= hf_index_name;
      else fail(path.string(), "the directory holds neither ", hf_single_name, " nor ", hf_index_name);
    }
    origin_ = p.string();
    if (p.extension() == ".json") open_index(p);
    else open_file(p, nullptr);
  }

  const std::string& origin() const { return origin_; }
  const std::map<std::string, stored, std::less<>>& tensors() const { return tensors_; }

  // Elements [first, first + out.size()) of t in its row-major order, converted to T.
  template <class T>
  void read(const stored& t, std::uint64_t first, std::span<T> out) const {
    const auto& f = files_[t.file];
    const std::size_t es = size_of(t.info.type);
    raw_.resize(out.size() * es);
    f.in.read_at(f.data_start + t.info.begin + first * es, raw_);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = convert<T>(t, first + i, raw_.data() + i * es);
  }

 private:
  struct file {
    input_file in;
    std::uint64_t data_start;
  };

  // Adds the tensors of one file: all of them, or (from an index) those it maps to this file.
  void open_file(const std::filesystem::path& p, const std::set<std::string, std::less<>>* wanted) {
    input_file in(p);
    auto [n, header] = read_file_header(in);
    const std::size_t k = files_.size();
    files_.push_back({std::move(in), size_field_bytes + n});
    std::size_t found = 0;
    for (auto& t : header.tensors) {
      if (wanted && !wanted->contains(t.name)) continue;
      ++found;
      if (!tensors_.emplace(t.name, stored{k, t}).second)
        fail(origin_, "tensor \"", t.name, "\" is in more than one file");
    }
    if (wanted && found != wanted->size())
      for (const auto& w : *wanted)
        if (!tensors_.contains(w) || tensors_.find(w)->second.file != k)
          fail(origin_, "the index maps tensor \"", w, "\" to ", p.filename().string(), ", which does not hold it");
  }

  void open_index(const std::filesystem::path& p) {
    nlohmann::json j = parse_json(read_text_file(p, max_header_bytes), origin_, "the index");
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail(origin_, "a safetensors index needs an object \"weight_map\" {tensor name: file name}");
    std::map<std::string, std::set<std::string, std::less<>>> by_file;
    for (const auto& [name, f] : j["weight_map"].items()) {
      if (!f.is_string()) fail(origin_, "\"weight_map\" entry \"", name, "\" must name a file, found ", f.type_name());
      const auto& fn = f.get_ref<const std::string&>();
      // A shard lies beside its index: no directories, so an index cannot reach elsewhere.
      if (fn.empty() || fn.find('/') != std::string::npos || fn == "." || fn == "..")
        fail(origin_, "\"weight_map\" entry \"", name, "\": \"", fn, "\" is not a file name beside the index");
      by_file[fn].insert(name);
    }
    for (const auto& [fn, names] : by_file) open_file(p.parent_path() / fn, &names);
  }

  // A finite value beyond T's range (F64 into float, F32 into half) is an error,
  // not an inf in the model.
  template <class T>
  T convert(const stored& t, std::uint64_t element, const std::byte* p) const {
    const auto checked = [&](auto v) {
      const T x = element_cast<T>(v);
      if (std::isinf(double(x)) && std::isfinite(double(v)))
        fail(origin_, "tensor \"", t.info.name, "\" element ", element, " is ", double(v), ", beyond ",
             shardlib::name(dtype_of<T>), "'s range: it would load as inf");
      return x;
    };
    switch (t.info.type) {
      case dtype::f32: return checked(load<float>(p));
      case dtype::f16: return checked(load<half>(p));
      case dtype::bf16: return checked(load<bfloat16>(p));
      case dtype::f64: return checked(load<double>(p));
      default:
        fail(origin_, "tensor \"", t.info.name, "\" has dtype ", shardlib::name(t.info.type),
             "; parameters load from F32, F64, F16 or BF16");
    }
  }
  template <class E>
  static E load(const std::byte* p) {
    E e;
    std::memcpy(&e, p, sizeof e);
    return e;
  }

  std::string origin_;
  std::vector<file> files_;
  std::map<std::string, stored, std::less<>> tensors_;
  mutable std::vector<std::byte> raw_;
};

}  // namespace shardlib::io::detail
