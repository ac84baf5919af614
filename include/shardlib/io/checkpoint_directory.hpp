// shardlib/io/checkpoint_directory.hpp — checkpoint directories: reading one's
// metadata.json, listing the checkpoints under a root, and resolving a root to its
// latest complete checkpoint.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"            // io_error, cat
#include "shardlib/io/checkpoint_format.hpp"  // checkpoint_metadata, detail::metadata_name, parse_metadata_text
#include "shardlib/io/safetensors.hpp"        // detail::read_text_file, fail

#include <algorithm>     // std::sort
#include <cstddef>       // std::size_t
#include <filesystem>    // std::filesystem
#include <optional>      // std::optional, std::nullopt
#include <string>        // std::string
#include <system_error>  // std::error_code
#include <utility>       // std::move
#include <vector>        // std::vector

namespace shardlib::io {

// A checkpoint directory under a root, as list_checkpoints finds it.
struct checkpoint_entry {
  std::filesystem::path path;
  std::optional<checkpoint_metadata> metadata;  // absent when its metadata is unreadable:
  std::string error;                            // then this says why
};

// Reads and validates dir/metadata.json (checksum, version and every field).
inline checkpoint_metadata read_checkpoint_metadata(const std::filesystem::path& dir) {
  const auto file = dir / detail::metadata_name;
  return detail::parse_metadata_text(detail::read_text_file(file, detail::max_metadata_bytes), file.string());
}

namespace detail {
inline std::vector<checkpoint_entry> scan_checkpoints(const std::filesystem::path& root) {
  std::vector<checkpoint_entry> out;
  std::error_code ec;
  std::filesystem::directory_iterator it(root, ec);
  for (const std::filesystem::directory_iterator end; !ec && it != end; it.increment(ec)) {
    const auto& p = it->path();
    std::error_code entry_ec;
    if (p.filename().string().starts_with('.') || !it->is_directory(entry_ec)) continue;
    const auto meta = std::filesystem::status(p / metadata_name, entry_ec);
    if (meta.type() == std::filesystem::file_type::not_found) continue;  // not a checkpoint
    checkpoint_entry e{p, std::nullopt, {}};
    if (entry_ec) {
      e.error = cat(p.string(), ": cannot read: ", entry_ec.message());
      out.push_back(std::move(e));
      continue;
    }
    try {
      e.metadata = read_checkpoint_metadata(p);
    } catch (const io_error& x) {
      e.error = x.what();
    }
    out.push_back(std::move(e));
  }
  if (ec) fail(root.string(), "cannot list the directory: ", ec.message());
  std::sort(out.begin(), out.end(), [](const checkpoint_entry& a, const checkpoint_entry& b) {
    if (a.metadata.has_value() != b.metadata.has_value()) return a.metadata.has_value();
    // Equal sequences (a checkpoint copied under another name) order by name, so that
    // "latest" and pruning do not depend on the order the directory lists them in.
    if (a.metadata && a.metadata->sequence != b.metadata->sequence) return a.metadata->sequence < b.metadata->sequence;
    return a.path < b.path;
  });
  return out;
}
}  // namespace detail

// The checkpoints under root, oldest first (those with unreadable metadata last).
// Hidden directories (.tmp-*: saves that did not complete) are never listed.
inline std::vector<checkpoint_entry> list_checkpoints(const std::filesystem::path& root) {
  return detail::scan_checkpoints(root);
}

// A checkpoint directory as given, or the latest complete checkpoint under a root.
inline std::filesystem::path resolve_checkpoint(const std::filesystem::path& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (st.type() == std::filesystem::file_type::not_found) detail::fail(path.string(), "no such checkpoint or directory");
  if (ec) detail::fail(path.string(), "cannot access: ", ec.message());
  if (!std::filesystem::is_directory(st))
    detail::fail(path.string(), "not a directory: a checkpoint is a directory of metadata.json and shard files");
  const auto meta = std::filesystem::status(path / detail::metadata_name, ec);
  if (meta.type() != std::filesystem::file_type::not_found && ec)
    detail::fail(path.string(), "cannot read the directory: ", ec.message());
  if (std::filesystem::exists(meta)) return path;
  const auto entries = detail::scan_checkpoints(path);
  if (!entries.empty() && !entries.back().metadata)
    detail::fail(path.string(), "cannot tell which checkpoint is the latest: ", entries.back().error);
  if (entries.empty())
    detail::fail(path.string(), "holds no checkpoint (no directory with a metadata.json; a save that did not "
                                "complete leaves only a .tmp-* directory, which is never loaded)");
  return entries.back().path;
}

}  // namespace shardlib::io
