// shardlib/io/checkpoint_writer.hpp — writing a checkpoint: shard files written in
// hashed chunks through the write hook, metadata.json last, the atomic rename of the
// temporary directory into place, and pruning to the newest keep_last checkpoints.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"             // dtype
#include "shardlib/core/error.hpp"               // cat
#include "shardlib/core/shape.hpp"               // Shape
#include "shardlib/io/checkpoint_directory.hpp"  // detail::scan_checkpoints
#include "shardlib/io/checkpoint_format.hpp"     // checkpoint_metadata, checkpoint_file, detail::metadata_text, ...
#include "shardlib/io/safetensors.hpp"           // tensor_info, detail::fd_handle, lay_out, header_block, os_error

#include <algorithm>           // std::min, std::max
#include <cerrno>              // errno, EINTR, EINVAL
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // std::byte, std::size_t, std::ptrdiff_t
#include <cstdint>             // std::uint64_t, std::int64_t
#include <cstdio>              // rename, renameat2, RENAME_EXCHANGE
#include <deque>               // std::deque
#include <filesystem>          // std::filesystem
#include <functional>          // std::function, std::less
#include <map>                 // std::map
#include <mutex>               // std::mutex, std::lock_guard, std::unique_lock
#include <set>                 // std::set
#include <span>                // std::span
#include <string>              // std::string
#include <string_view>         // std::string_view
#include <system_error>        // std::error_code
#include <thread>              // std::thread
#include <utility>             // std::exchange, std::move
#include <vector>              // std::vector

#include <fcntl.h>   // open, AT_FDCWD
#include <unistd.h>  // write, fsync, close, ssize_t

namespace shardlib::io {

// A write about to happen while saving; see save_options::write_hook.
struct write_event {
  int rank;
  std::filesystem::path file;
  std::uint64_t offset;  // in the file
  std::uint64_t bytes;
};
using write_callback = std::function<int(const write_event&)>;

namespace detail {

// Writes a new file in chunk_bytes pieces, hashing each, through the write hook.
// No rename of its own: it lives in the save's temporary directory.
class chunked_writer {
 public:
  chunked_writer(std::filesystem::path file, std::uint64_t chunk_bytes, int rank, const write_callback& hook)
      : file_(std::move(file)), chunk_(std::size_t(chunk_bytes)), rank_(rank), hook_(hook) {
    fd_ = fd_handle(::open(file_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (!fd_) fail(file_.string(), "cannot create: ", os_error(errno));
  }

  void write(std::span<const std::byte> data) {
    while (!data.empty()) {
      const std::size_t n = std::min(data.size(), chunk_ - buffer_.size());
      buffer_.insert(buffer_.end(), data.begin(), data.begin() + std::ptrdiff_t(n));
      data = data.subspan(n);
      if (buffer_.size() == chunk_) flush();
    }
  }

  // Writes what is buffered and syncs the file to disk.
  checkpoint_file finish() {
    if (!buffer_.empty()) flush();
    if (::fsync(fd_.get()) != 0) fail(file_.string(), "cannot flush to disk: ", os_error(errno));
    if (::close(fd_.release()) != 0) fail(file_.string(), "cannot close: ", os_error(errno));
    return {file_.filename().string(), written_, std::move(hashes_)};
  }

 private:
  void flush() {
    hashes_.push_back(xxh3(buffer_));
    std::span<const std::byte> rest(buffer_);
    while (!rest.empty()) {
      const int injected = hook_ ? hook_(write_event{rank_, file_, written_, rest.size()}) : 0;
      const ::ssize_t n = injected != 0 ? -1 : ::write(fd_.get(), rest.data(), rest.size());
      const int e = injected != 0 ? injected : errno;
      if (n < 0 && e == EINTR) continue;
      if (n < 0)
        fail(file_.string(), "cannot write bytes [", written_, ", ", written_ + rest.size(), "): ", os_error(e));
      written_ += std::uint64_t(n);
      rest = rest.subspan(std::size_t(n));
    }
    buffer_.clear();
  }

  std::filesystem::path file_;
  std::size_t chunk_;
  int rank_;
  const write_callback& hook_;
  fd_handle fd_;
  std::vector<std::byte> buffer_;
  std::uint64_t written_ = 0;
  std::vector<std::uint64_t> hashes_;
};

// Writes partition `part`: for every unit and kind, tensor "unit.<u>.<kind>" holding the
// unit's elements [part * S, (part + 1) * S), which fill(u, kind, first, out) provides.
template <class Fill>
checkpoint_file write_shard_file(const std::filesystem::path& dir, int part, const checkpoint_metadata& m, int rank,
                                 const write_callback& hook, Fill&& fill) {
  const auto file = dir / shard_file_name(part, m.partitions);
  const auto kinds = m.kinds();
  std::vector<tensor_info> tensors;
  std::set<std::string, std::less<>> names;
  for (std::size_t u = 0; u < m.units.size(); ++u)
    for (const auto& k : kinds)
      lay_out(tensors, names, {tensor_name(u, k), dtype::f32, Shape{std::int64_t(m.shard_numel(m.units[u]))}, 0, 0},
              file.string());
  chunked_writer out(file, m.chunk_bytes, rank, hook);
  out.write(as_bytes(header_block({{"format", std::string(checkpoint_format)}}, tensors, file.string())));
  std::vector<float> block;
  for (std::size_t u = 0; u < m.units.size(); ++u) {
    const std::uint64_t s = m.shard_numel(m.units[u]);
    for (const auto& k : kinds)
      for (std::uint64_t b = 0; b < s; b += fill_block) {
        block.resize(std::size_t(std::min<std::uint64_t>(fill_block, s - b)));
        fill(u, std::string_view(k), std::uint64_t(part) * s + b, std::span<float>(block));
        out.write(std::as_bytes(std::span<const float>(block)));
      }
  }
  return out.finish();
}

// The rename below survives a crash only once the directory holding it is synced;
// file systems that cannot sync a directory (EINVAL) get the rename alone.
inline void sync_directory(const std::filesystem::path& dir) {
  const fd_handle d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!d) fail(dir.string(), "cannot open the directory to sync it: ", os_error(errno));
  if (::fsync(d.get()) != 0 && errno != EINVAL) fail(dir.string(), "cannot sync the directory: ", os_error(errno));
}

inline void remove_quietly(const std::filesystem::path& p) {
  std::error_code ignored;
  std::filesystem::remove_all(p, ignored);
}

// A tag's directory is replaced only when it holds a checkpoint (metadata.json),
// never data of the user's that happens to have the tag's name.
inline void require_replaceable(const std::filesystem::path& final_dir) {
  std::error_code ec;
  if (!std::filesystem::exists(final_dir, ec) || std::filesystem::is_regular_file(final_dir / metadata_name, ec)) return;
  fail(final_dir.string(), "exists and is not a checkpoint (it has no ", metadata_name,
       "), so a save under this tag does not replace it; remove it or choose another tag");
}

// The one spelling of a path the claims below compare: absolute, symbolic links and dot
// segments resolved as far as the path exists ("ckpt", "./ckpt" and a link to it match).
inline std::string path_key(const std::filesystem::path& p) {
  std::error_code ec;
  const auto canonical = std::filesystem::weakly_canonical(p, ec);
  return (ec ? std::filesystem::absolute(p).lexically_normal() : canonical).string();
}

// The temporary directories of this process's saves from their start to their end (an
// asynchronous save's until its wait), each with the sequence number its save took at its
// start: one past every complete checkpoint under its root and every save in flight
// there, so that saves number in the order they begin (and a resume from the root takes
// the one begun last) even when an earlier one completes later. A second save into a
// claimed directory is refused, and prune leaves claimed ones. Held by the rank that
// prepares the save.
class temp_claim {
 public:
  temp_claim() = default;
  explicit temp_claim(const std::filesystem::path& temp) {
    const std::string key = path_key(temp), root = path_key(temp.parent_path());
    std::lock_guard lock(registry().m);
    if (registry().dirs.contains(key))
      fail(temp.string(), "a save under this tag is still in flight (an async_save_checkpoint not yet waited for); "
                          "wait() for it first or save under another tag");
    std::uint64_t last = 0;
    for (const auto& e : scan_checkpoints(temp.parent_path()))
      if (e.metadata) last = std::max(last, e.metadata->sequence);
    for (const auto& [dir, flight] : registry().dirs)
      if (flight.root == root) last = std::max(last, flight.sequence);
    sequence_ = last + 1;
    registry().dirs.emplace(key, in_flight{root, sequence_});
    key_ = key;
  }
  temp_claim(temp_claim&& o) noexcept : key_(std::exchange(o.key_, {})), sequence_(o.sequence_) {}
  temp_claim& operator=(temp_claim&& o) noexcept {
    release();
    key_ = std::exchange(o.key_, {});
    sequence_ = o.sequence_;
    return *this;
  }
  ~temp_claim() { release(); }

  bool held() const { return !key_.empty(); }
  std::uint64_t sequence() const { return sequence_; }
  void release() {
    if (!held()) return;
    std::lock_guard lock(registry().m);
    registry().dirs.erase(std::exchange(key_, {}));
  }
  static bool claimed(const std::filesystem::path& temp) {
    const std::string key = path_key(temp);
    std::lock_guard lock(registry().m);
    return registry().dirs.contains(key);
  }

 private:
  struct in_flight {
    std::string root;
    std::uint64_t sequence;
  };
  struct claims {
    std::mutex m;
    std::map<std::string, in_flight, std::less<>> dirs;  // by path_key of the temporary directory
  };
  static claims& registry() {
    static claims c;
    return c;
  }
  std::string key_;
  std::uint64_t sequence_ = 0;
};

// Claims the temporary directory (and the save's sequence number), creates the root
// (final_dir's parent) and the directory afresh.
inline temp_claim prepare_save(const std::filesystem::path& final_dir, const std::filesystem::path& temp) {
  require_replaceable(final_dir);
  const std::filesystem::path root = final_dir.parent_path();
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  if (ec) fail(root.string(), "cannot create the checkpoint root: ", ec.message());
  temp_claim claim(temp);  // with the root in place: its key is the resolved path
  std::filesystem::remove_all(temp, ec);  // left by a save that was killed
  if (ec) fail(temp.string(), "cannot remove a stale temporary directory: ", ec.message());
  if (!std::filesystem::create_directory(temp, ec) || ec)
    fail(temp.string(), "cannot create the temporary directory: ", ec ? ec.message() : "it exists");
  return claim;
}

// Writes metadata.json last, syncs, and renames the temporary directory into place; an
// existing checkpoint of the same tag is swapped out in the same atomic step, then removed.
inline void commit_checkpoint(const std::filesystem::path& temp, const std::filesystem::path& final_dir,
                              const checkpoint_metadata& m, const write_callback& hook) {
  const std::string text = metadata_text(m);
  // What readers would refuse (an empty parameter name a safetensors file may carry, say)
  // is refused before anything is renamed into place: under its root, an unreadable
  // checkpoint would also hide the older ones from resolve_checkpoint.
  parse_metadata_text(text, (final_dir / metadata_name).string());
  chunked_writer out(temp / metadata_name, m.chunk_bytes, 0, hook);
  out.write(as_bytes(text));
  out.finish();
  sync_directory(temp);
  require_replaceable(final_dir);
  std::error_code ec;
  if (std::filesystem::exists(final_dir, ec)) {
    if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
      fail(final_dir.string(), "exists and cannot be replaced atomically (renameat2 RENAME_EXCHANGE: ",
           os_error(errno), "); remove it or save under another tag");
    remove_quietly(temp);  // now the replaced checkpoint
  } else if (::rename(temp.c_str(), final_dir.c_str()) != 0) {
    fail(final_dir.string(), "cannot rename ", temp.string(), " into place: ", os_error(errno));
  }
  sync_directory(final_dir.parent_path());
}

// Directories deleted by one thread of the process in the background, in order; the
// thread starts with the first and, at a normal exit, finishes the queue before the
// process ends. Errors are ignored: what is left keeps its ".tmp-" name, which readers
// skip and the next prune deletes.
class background_deleter {
 public:
  static background_deleter& instance() {
    static background_deleter d;
    return d;
  }
  void add(std::filesystem::path dir) {
    {
      std::lock_guard lock(m_);
      queue_.push_back(std::move(dir));
      if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
    }
    work_.notify_all();
  }
  // Holds the deletions not yet started (tests: to see what waits for the thread).
  void pause(bool paused) {
    {
      std::lock_guard lock(m_);
      paused_ = paused;
    }
    work_.notify_all();
  }
  // Waits until everything added so far is deleted (not while paused).
  void drain() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }
  ~background_deleter() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    work_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

 private:
  background_deleter() = default;
  void run() {
    std::unique_lock lock(m_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || (!paused_ && !queue_.empty()); });
      if (queue_.empty()) return;  // stopping, and nothing left
      const auto dir = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      remove_quietly(dir);
      lock.lock();
      busy_ = false;
      idle_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable work_, idle_;
  std::deque<std::filesystem::path> queue_;
  bool stop_ = false, busy_ = false, paused_ = false;
  std::thread worker_;
};

// The name an old checkpoint takes while it waits for the background deleter: a ".tmp-"
// name no save's temporary directory can have ('#' is not a tag character).
inline constexpr std::string_view purge_prefix = ".tmp-#purge-";

// After a save completed: deletes all but the newest keep_last checkpoints (0 keeps
// all), and the temporary directories of saves that were killed (not those in flight).
// In the background (an asynchronous save's wait()), an old checkpoint is renamed out of
// sight at once (inline where a leftover holds its new name) and deleted, with any such
// leftover, by background_deleter.
inline void prune(const std::filesystem::path& root, int keep_last, bool in_background = false) {
  std::vector<std::filesystem::path> complete;  // newest first
  const auto entries = scan_checkpoints(root);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it)
    if (it->metadata) complete.push_back(it->path);
  for (std::size_t i = std::size_t(keep_last); keep_last > 0 && i < complete.size(); ++i) {
    if (in_background &&
        ::rename(complete[i].c_str(), (root / cat(purge_prefix, complete[i].filename().string())).c_str()) == 0)
      continue;  // queued below
    std::error_code ec;
    std::filesystem::remove_all(complete[i], ec);
    if (ec) fail(complete[i].string(), "cannot delete this old checkpoint: ", ec.message());
  }
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(temp_prefix) || temp_claim::claimed(it->path())) continue;
    if (in_background && name.starts_with(purge_prefix)) background_deleter::instance().add(it->path());
    else remove_quietly(it->path());
  }
}

}  // namespace detail

}  // namespace shardlib::io
