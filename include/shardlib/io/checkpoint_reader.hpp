// shardlib/io/checkpoint_reader.hpp — reading a checkpoint's data by parameter and
// element range, each byte checked against its chunk's checksum, and verifying a whole
// checkpoint.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"             // dtype, name
#include "shardlib/core/error.hpp"               // io_error
#include "shardlib/core/shape.hpp"               // Shape
#include "shardlib/io/checkpoint_directory.hpp"  // read_checkpoint_metadata, resolve_checkpoint
#include "shardlib/io/checkpoint_format.hpp"     // checkpoint_metadata, detail::tensor_name, xxh3, hex
#include "shardlib/io/safetensors.hpp"           // detail::input_file, read_header, check_header_size, ...

#include <algorithm>    // std::sort, std::min
#include <array>        // std::array
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // std::uint64_t, std::int64_t
#include <cstring>      // std::memcpy
#include <filesystem>   // std::filesystem
#include <functional>   // std::less
#include <limits>       // std::numeric_limits
#include <map>          // std::map
#include <optional>     // std::optional
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <tuple>        // std::tie
#include <utility>      // std::move, std::pair
#include <vector>       // std::vector

namespace shardlib::io {

// The data of one checkpoint, read in checksum-verified ranges: each shard file is
// opened when first needed and only the chunks covering a request are read.
class checkpoint_reader {
 public:
  explicit checkpoint_reader(std::filesystem::path dir)
      : dir_(std::move(dir)), meta_(read_checkpoint_metadata(dir_)), files_(meta_.files.size()) {
    const auto kinds = meta_.kinds();
    for (std::size_t k = 0; k < kinds.size(); ++k) kinds_.emplace(kinds[k], k);
    for (std::size_t u = 0; u < meta_.units.size(); ++u)
      for (const auto& p : meta_.units[u].params) params_.emplace(p.name, located{u, p.offset, p.numel()});
  }

  const std::filesystem::path& path() const { return dir_; }
  const checkpoint_metadata& metadata() const { return meta_; }

  // Every saved parameter's name and shape, in the checkpoint's order.
  std::vector<std::pair<std::string, Shape>> parameters() const {
    std::vector<std::pair<std::string, Shape>> out;
    for (const auto& u : meta_.units)
      for (const auto& p : u.params) out.emplace_back(p.name, p.shape);
    return out;
  }

  // Asks for elements [first, first + out.size()) of parameter `name`'s `kind` ("master"
  // or an optimizer buffer), to arrive in out at finish(): a piece from each shard file
  // they lie in. Opens those files (and checks their headers) now.
  void request(std::string_view name, std::string_view kind, std::uint64_t first, std::span<float> out) {
    const auto p = params_.find(name);
    if (p == params_.end()) detail::fail(dir_.string(), "holds no parameter '", name, "'");
    const auto k = kinds_.find(kind);
    if (k == kinds_.end()) detail::fail(dir_.string(), "holds no optimizer state '", kind, "'");
    if (first > p->second.numel || out.size() > p->second.numel - first)
      detail::fail(dir_.string(), "parameter '", name, "' has ", p->second.numel, " elements, not [", first, ", ",
                   first + out.size(), ")");
    const std::uint64_t s = meta_.shard_numel(meta_.units[p->second.unit]);
    std::uint64_t g = p->second.offset + first;  // in the saved unit's flat vector
    auto bytes = std::as_writable_bytes(out);
    while (!bytes.empty()) {
      const int part = int(g / s);
      const std::uint64_t within = g - std::uint64_t(part) * s;
      const std::size_t n = std::size_t(std::min<std::uint64_t>(bytes.size() / sizeof(float), s - within));
      const auto& f = open(part);
      pending_.push_back({part, f.starts[p->second.unit * kinds_.size() + k->second] + within * sizeof(float),
                          bytes.first(n * sizeof(float))});
      bytes = bytes.subspan(n * sizeof(float));
      g += n;
    }
  }
  // Reads every requested piece in file and offset order, so that each chunk is read
  // and verified once however the pieces interleave.
  void finish() {
    std::sort(pending_.begin(), pending_.end(), [](const piece& a, const piece& b) {
      return std::tie(a.part, a.offset) < std::tie(b.part, b.offset);
    });
    for (const auto& p : pending_) read_verified(p.part, p.offset, p.out);
    pending_.clear();
  }
  void read(std::string_view name, std::string_view kind, std::uint64_t first, std::span<float> out) {
    request(name, kind, first, out);
    finish();
  }

  // Opens every shard file: each must exist with its recorded size and a valid header.
  void open_all() {
    for (int p = 0; p < int(files_.size()); ++p) open(p);
  }

  // Reads every byte of every shard file against its checksum; one line per problem.
  std::vector<std::string> verify() {
    std::vector<std::string> problems;
    for (int p = 0; p < int(files_.size()); ++p) {
      try {
        open(p);
        std::byte one;
        for (std::uint64_t c = 0; c < meta_.files[std::size_t(p)].chunks.size(); ++c)
          read_verified(p, c * meta_.chunk_bytes, std::span(&one, 1));  // reads and checks the whole chunk
      } catch (const io_error& e) {
        problems.push_back(e.what());
      }
    }
    return problems;
  }

  std::uint64_t bytes_read() const { return bytes_read_; }
  std::vector<int> files_opened() const {
    std::vector<int> out;
    for (std::size_t p = 0; p < files_.size(); ++p)
      if (files_[p]) out.push_back(int(p));
    return out;
  }

 private:
  struct located {
    std::size_t unit;
    std::uint64_t offset, numel;
  };
  struct piece {
    int part;
    std::uint64_t offset;  // in the file
    std::span<std::byte> out;
  };
  struct shard_file {
    detail::input_file in;
    std::vector<std::uint64_t> starts;  // [unit * kinds + kind]: where tensor unit.<u>.<kind> begins in the file
  };

  shard_file& open(int part) {
    auto& slot = files_[std::size_t(part)];
    if (slot) return *slot;
    const auto& rec = meta_.files[std::size_t(part)];
    const auto file = dir_ / rec.name;
    const std::string origin = file.string();
    detail::input_file in(file);
    if (in.size() != rec.bytes)
      detail::fail(origin, "holds ", in.size(), " bytes but the checkpoint's metadata records ", rec.bytes,
                   in.size() < rec.bytes ? " (truncated?)" : " (bytes appended?)");
    slot.emplace(shard_file{std::move(in), {}});
    try {
      read_header(part, origin);
    } catch (...) {
      slot.reset();
      throw;
    }
    return *slot;
  }

  // The header, chunk-verified like the data, must declare exactly the tensors the
  // metadata implies: unit.<u>.<kind>, F32, [shard_numel].
  void read_header(int part, const std::string& origin) {
    const std::uint64_t size = meta_.files[std::size_t(part)].bytes;
    detail::check_file_size(size, origin);
    std::array<std::byte, detail::size_field_bytes> field{};
    read_verified(part, 0, field);
    const std::uint64_t n = detail::load_u64(field.data());
    detail::check_header_size(n, size, origin);
    std::string text(std::size_t(n), '\0');
    read_verified(part, detail::size_field_bytes, std::as_writable_bytes(std::span(text)));
    const auto header = detail::read_header(text, size - detail::size_field_bytes - n, origin);
    const std::size_t kinds = kinds_.size();
    if (header.tensors.size() != meta_.units.size() * kinds)
      detail::fail(origin, "holds ", header.tensors.size(), " tensors; the metadata implies ",
                   meta_.units.size() * kinds);
    auto& starts = files_[std::size_t(part)]->starts;
    starts.assign(meta_.units.size() * kinds, std::numeric_limits<std::uint64_t>::max());
    for (const auto& t : header.tensors) {
      const std::size_t u = parse_unit(t.name), dot = t.name.find('.', 5);
      const auto k = u < meta_.units.size() ? kinds_.find(std::string_view(t.name).substr(dot + 1)) : kinds_.end();
      if (k == kinds_.end() || t.name != detail::tensor_name(u, k->first) ||
          starts[u * kinds + k->second] != std::numeric_limits<std::uint64_t>::max())
        detail::fail(origin, "tensor \"", t.name, "\" is not one the metadata implies");
      const Shape want{std::int64_t(meta_.shard_numel(meta_.units[u]))};
      if (t.type != dtype::f32 || t.shape != want)
        detail::fail(origin, "tensor \"", t.name, "\" is ", name(t.type), " ", t.shape, ", expected F32 ", want);
      starts[u * kinds + k->second] = detail::size_field_bytes + n + t.begin;
    }
  }
  // u in "unit.<u>.<kind>", or the unit count (no such unit) when malformed.
  std::size_t parse_unit(std::string_view name) const {
    if (!name.starts_with("unit.")) return meta_.units.size();
    std::size_t u = 0, i = 5;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && u <= meta_.units.size(); ++i)
      u = u * 10 + std::size_t(name[i] - '0');
    return i > 5 && i < name.size() && name[i] == '.' ? u : meta_.units.size();
  }

  // Reads bytes [offset, offset + out.size()) of a shard file by whole chunks, each
  // checked against its recorded hash; the last chunk read is kept for the next request.
  void read_verified(int part, std::uint64_t offset, std::span<std::byte> out) {
    const auto& rec = meta_.files[std::size_t(part)];
    const std::uint64_t c_bytes = meta_.chunk_bytes;
    while (!out.empty()) {
      const std::uint64_t c = offset / c_bytes, within = offset - c * c_bytes;
      if (cache_file_ != part || cache_chunk_ != c) {
        if (c >= rec.chunks.size()) detail::fail((dir_ / rec.name).string(), "read past the end at byte ", offset);
        cache_file_ = -1;
        cache_.resize(std::size_t(std::min(c_bytes, rec.bytes - c * c_bytes)));
        files_[std::size_t(part)]->in.read_at(c * c_bytes, cache_);
        bytes_read_ += cache_.size();
        if (const std::uint64_t h = detail::xxh3(cache_); h != rec.chunks[c])
          detail::fail((dir_ / rec.name).string(), "bytes [", c * c_bytes, ", ", c * c_bytes + cache_.size(),
                       ") do not match their checksum (xxh3_64 recorded ", detail::hex(rec.chunks[c]), ", computed ",
                       detail::hex(h), "): the file is corrupt");
        cache_file_ = part;
        cache_chunk_ = c;
      }
      if (within >= cache_.size()) detail::fail((dir_ / rec.name).string(), "read past the end at byte ", offset);
      const std::size_t n = std::min(out.size(), std::size_t(cache_.size() - within));
      std::memcpy(out.data(), cache_.data() + within, n);
      out = out.subspan(n);
      offset += n;
    }
  }

  std::filesystem::path dir_;
  checkpoint_metadata meta_;
  std::vector<std::optional<shard_file>> files_;
  std::map<std::string, std::size_t, std::less<>> kinds_;  // "master" is 0
  std::map<std::string, located, std::less<>> params_;
  std::vector<piece> pending_;
  int cache_file_ = -1;
  std::uint64_t cache_chunk_ = 0;
  std::vector<std::byte> cache_;
  std::uint64_t bytes_read_ = 0;
};

// Every problem found by reading every byte of a checkpoint (its metadata, each shard
// file's size, header and checksums); empty when it is intact.
inline std::vector<std::string> verify_checkpoint(const std::filesystem::path& path) {
  try {
    checkpoint_reader r(resolve_checkpoint(path));
    return r.verify();
  } catch (const io_error& e) {
    return {e.what()};
  }
}

}  // namespace shardlib::io
