// shardlib/io/safetensors.hpp — safetensors files: validated reading, atomic and streaming writing.
//
// Layout (https://github.com/huggingface/safetensors#format): an 8-byte little-endian
// header size N, N bytes of UTF-8 JSON mapping tensor names to {dtype, shape,
// data_offsets: [begin, end]} (offsets relative to the data section) plus an optional
// "__metadata__" object of strings, then the data section. The reader treats every file
// as hostile: each number is checked before it is used, and the tensors' byte ranges
// must tile the data section exactly (no overlap, no gap, no trailing bytes), so a
// file cannot hide a second payload and no access can leave the buffer.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/shape.hpp"
#include "shardlib/io/safetensors_format.hpp"  // tensor_info, the header's checks

#include <nlohmann/json.hpp>  // nlohmann::json, nlohmann::ordered_json

#include <algorithm>     // std::sort
#include <array>         // std::array
#include <atomic>        // std::atomic
#include <bit>           // std::endian
#include <cerrno>        // errno, EINTR, EINVAL, EEXIST
#include <cstddef>       // std::byte
#include <cstdint>       // std::uint64_t
#include <cstring>       // std::memcpy
#include <filesystem>    // std::filesystem::path
#include <functional>    // std::less
#include <ios>           // std::hex
#include <limits>        // std::numeric_limits
#include <map>           // std::map
#include <new>           // std::bad_alloc
#include <optional>      // std::optional
#include <set>           // std::set
#include <sstream>       // std::ostringstream
#include <span>          // std::span
#include <string>        // std::string
#include <string_view>   // std::string_view
#include <system_error>  // std::system_category
#include <tuple>         // std::tie
#include <type_traits>   // std::is_same_v
#include <utility>       // std::move, std::exchange, std::pair
#include <vector>        // std::vector

#include <fcntl.h>     // open, fcntl
#include <sys/stat.h>  // stat, fstat
#include <unistd.h>    // pread, write, fsync, close, unlink, sysconf, getpid

namespace shardlib::io {
namespace detail {

// Owns a POSIX file descriptor.
class fd_handle {
 public:
  fd_handle() = default;
  explicit fd_handle(int fd) : fd_(fd) {}
  fd_handle(fd_handle&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  fd_handle& operator=(fd_handle&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~fd_handle() { reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

inline std::string_view file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "of an unknown type";
}

// A regular file opened for reading; every reader of this library opens files through it.
// A FIFO (or a device) in a file's place is refused before it could block: stat first
// (a device is never opened at all), then open with O_NONBLOCK, so that a FIFO swapped in
// after the stat opens at once and fstat refuses it too.
class input_file {
 public:
  explicit input_file(const std::filesystem::path& file) : origin_(file.string()) {
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) fail(origin_, "cannot open for reading: ", os_error(errno));
    require_regular(st);
    fd_ = fd_handle(::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    if (!fd_) fail(origin_, "cannot open for reading: ", os_error(errno));
    if (::fstat(fd_.get(), &st) != 0) fail(origin_, "cannot stat: ", os_error(errno));
    require_regular(st);
    // Blocking reads again: local file systems ignore O_NONBLOCK on regular files, but
    // network and FUSE ones may answer a read with EAGAIN.
    const int flags = ::fcntl(fd_.get(), F_GETFL);
    if (flags < 0 || ::fcntl(fd_.get(), F_SETFL, flags & ~O_NONBLOCK) != 0)
      fail(origin_, "cannot make reads blocking: ", os_error(errno));
    size_ = static_cast<std::uint64_t>(st.st_size);
  }

  const std::string& origin() const { return origin_; }
  std::uint64_t size() const { return size_; }

  void read_at(std::uint64_t offset, std::span<std::byte> out) const {
    while (!out.empty()) {
      const ::ssize_t n = ::pread(fd_.get(), out.data(), out.size(), static_cast<::off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(origin_, "cannot read: ", os_error(errno));
      if (n == 0) fail(origin_, "the file ended at byte ", offset, " while being read (was it truncated?)");
      offset += static_cast<std::uint64_t>(n);
      out = out.subspan(static_cast<std::size_t>(n));
    }
  }

 private:
  void require_regular(const struct stat& st) const {
    if (!S_ISREG(st.st_mode))
      fail(origin_, "not a regular file: it is ", file_type_name(st.st_mode), ", where a file of bytes is expected");
  }

  std::string origin_;
  fd_handle fd_;
  std::uint64_t size_ = 0;
};

// The whole of a small text file (metadata, an index) through input_file, so that a FIFO
// or device is refused rather than waited on; more than max_bytes is refused unread.
inline std::string read_text_file(const std::filesystem::path& file, std::uint64_t max_bytes) {
  const input_file in(file);
  if (in.size() > max_bytes)
    fail(in.origin(), "holds ", in.size(), " bytes, more than the ", max_bytes, " such a file may have");
  std::string text(static_cast<std::size_t>(in.size()), '\0');
  in.read_at(0, std::as_writable_bytes(std::span(text)));
  return text;
}

// Reads and validates the header of an open file: its size field, then the JSON and
// every tensor's byte range against the file's size. Returns N and the contents.
inline std::pair<std::uint64_t, header_contents> read_file_header(const input_file& in) {
  check_file_size(in.size(), in.origin());
  std::array<std::byte, size_field_bytes> field{};
  in.read_at(0, field);
  const std::uint64_t n = load_u64(field.data());
  check_header_size(n, in.size(), in.origin());
  std::string text(static_cast<std::size_t>(n), '\0');
  in.read_at(size_field_bytes, std::as_writable_bytes(std::span(text)));
  return {n, read_header(text, in.size() - size_field_bytes - n, in.origin())};
}

// What safetensors::load may hold in memory by default: the machine's physical memory.
inline std::uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::numeric_limits<std::uint64_t>::max();
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
}

// A file written under a temporary name beside target, "<target>.tmp.<pid>.<n>", and
// renamed onto target by commit(), so the target name never holds a half-written file.
// The temporary is created exclusively (O_EXCL): two writers of one target (every rank
// saving the same path) each write their own file, and the last rename wins whole, where
// a shared temporary let one writer truncate the other's half-written bytes. Until
// committed, an error or the destructor removes the temporary; a process killed while
// writing leaves it behind, under a name no reader takes for the target.
class atomic_file {
 public:
  explicit atomic_file(std::filesystem::path target) : target_(std::move(target)) {
    static std::atomic<std::uint64_t> next{0};
    for (int attempt = 0; !fd_; ++attempt) {  // EEXIST: another host's process of the same pid, on a shared file system
      temp_ = cat(target_.string(), ".tmp.", ::getpid(), ".", next.fetch_add(1));
      fd_ = fd_handle(::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (!fd_ && (errno != EEXIST || attempt == 99))
        fail(target_.string(), "cannot create ", temp_.string(), ": ", os_error(errno));
    }
    owns_temp_ = true;
  }
  atomic_file(atomic_file&& o) noexcept
      : target_(std::move(o.target_)),
        temp_(std::move(o.temp_)),
        fd_(std::move(o.fd_)),
        owns_temp_(std::exchange(o.owns_temp_, false)) {}
  atomic_file& operator=(atomic_file&&) = delete;
  ~atomic_file() { discard(); }

  void write(std::span<const std::byte> data) {
    require_open();
    while (!data.empty()) {
      const ::ssize_t n = ::write(fd_.get(), data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) discard_and_fail("cannot write");
      data = data.subspan(static_cast<std::size_t>(n));
    }
  }

  void commit() {
    require_open();
    if (::fsync(fd_.get()) != 0) discard_and_fail("cannot flush");
    if (::close(fd_.release()) != 0) discard_and_fail("cannot close");
    if (::rename(temp_.c_str(), target_.c_str()) != 0) discard_and_fail("cannot rename into place");
    owns_temp_ = false;
    // The rename survives a crash only once the directory itself is synced. Where the
    // directory cannot be opened or its file system cannot sync it (EINVAL), the rename
    // is all we can do.
    const auto dir = target_.parent_path().empty() ? std::filesystem::path(".") : target_.parent_path();
    const fd_handle d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d && ::fsync(d.get()) != 0 && errno != EINVAL) {
      fail(target_.string(), "written, but cannot sync its directory: ", os_error(errno));
    }
  }

 private:
  void require_open() const {
    if (!fd_) fail(target_.string(), "the file is no longer open: it was finished or an earlier write failed");
  }
  void discard() noexcept {
    fd_.reset();
    if (std::exchange(owns_temp_, false)) ::unlink(temp_.c_str());
  }
  [[noreturn]] void discard_and_fail(const char* what) {
    const int e = errno;
    discard();
    fail(target_.string(), what, " ", temp_.string(), ": ", os_error(e));
  }

  std::filesystem::path target_, temp_;
  fd_handle fd_;
  bool owns_temp_ = false;  // the temporary exists and is ours to remove
};

// The 8-byte size and the JSON header, padded with spaces so that the data section
// starts at a multiple of 8 bytes, as the reference writer does.
inline std::string header_block(const std::map<std::string, std::string>& metadata,
                                const std::vector<tensor_info>& tensors, std::string_view origin) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const tensor_info& t : tensors) {
    header[t.name] = {{"dtype", std::string(name(t.type))},
                      {"shape", std::vector<std::int64_t>(t.shape.extents().begin(), t.shape.extents().end())},
                      {"data_offsets", {t.begin, t.end}}};
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // strings that are not UTF-8
    fail(origin, "a tensor name or metadata string is not valid UTF-8: ", e.what());
  }
  text.append((size_field_bytes - text.size() % size_field_bytes) % size_field_bytes, ' ');
  if (text.size() > max_header_bytes) {
    fail(origin, "the header would take ", text.size(), " bytes, more than the ", max_header_bytes,
         " that readers accept");
  }
  const std::uint64_t n = text.size();
  std::string block(size_field_bytes, '\0');
  std::memcpy(block.data(), &n, sizeof n);
  return block + text;
}

// Appends t to laid_out after the tensors already there, checking that its name is
// usable and new and that its size is representable.
inline void lay_out(std::vector<tensor_info>& laid_out, std::set<std::string, std::less<>>& names, tensor_info t,
                    std::string_view origin) {
  if (t.name == "__metadata__") fail(origin, "\"__metadata__\" is reserved and cannot name a tensor");
  if (names.contains(t.name)) fail(origin, "duplicate tensor name \"", t.name, "\"");
  const std::uint64_t bytes = tensor_bytes(t, origin);
  t.begin = laid_out.empty() ? 0 : laid_out.back().end;
  if (bytes > std::numeric_limits<std::uint64_t>::max() - t.begin) {
    fail(origin, "tensor \"", t.name, "\": the data section would exceed 2^64 bytes");
  }
  t.end = t.begin + bytes;
  names.insert(t.name);
  laid_out.push_back(std::move(t));
}

inline std::span<const std::byte> as_bytes(const std::string& s) { return std::as_bytes(std::span(s)); }

}  // namespace detail

// A whole safetensors file, validated and held in memory.
class safetensors {
 public:
  // Reads and validates file, holding all of it in memory; errors name it. The header
  // is validated against the file's size before anything is allocated, and a file of
  // more than max_bytes (default: the machine's physical memory) is refused: read such
  // a file by range, at the offsets read_safetensors_header gives.
  static safetensors load(const std::filesystem::path& file,
                          std::uint64_t max_bytes = detail::physical_memory_bytes()) {
    const detail::input_file in(file);
    auto [n, contents] = detail::read_file_header(in);
    const auto too_large = [&](std::string_view why) {
      detail::fail(in.origin(), "holds ", in.size(), " bytes, ", why,
                   ": read it by range, at the offsets read_safetensors_header gives");
    };
    if (in.size() > max_bytes) too_large(cat("more than the ", max_bytes, " safetensors::load may hold in memory"));
    std::vector<std::byte> bytes;
    try {
      bytes.resize(static_cast<std::size_t>(in.size()));
    } catch (const std::bad_alloc&) {
      too_large("more than can be allocated now");
    }
    in.read_at(0, bytes);
    return safetensors(std::move(bytes), detail::size_field_bytes + n, in.origin(), std::move(contents));
  }

  // Validates the bytes of a file; origin names their source in errors.
  static safetensors parse(std::vector<std::byte> bytes, std::string origin) {
    detail::check_file_size(bytes.size(), origin);
    const std::uint64_t n = detail::load_u64(bytes.data());
    detail::check_header_size(n, bytes.size(), origin);
    const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + detail::size_field_bytes, n);
    const std::uint64_t data_start = detail::size_field_bytes + n;
    auto contents = detail::read_header(text, bytes.size() - data_start, origin);
    return safetensors(std::move(bytes), data_start, std::move(origin), std::move(contents));
  }

  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const std::vector<tensor_info>& tensors() const { return header_.tensors; }  // in data-offset order
  bool contains(std::string_view name) const { return index_.contains(name); }

  const tensor_info& info(std::string_view name) const {
    const auto it = index_.find(name);
    if (it == index_.end()) detail::fail(origin_, "no tensor \"", name, "\" among its ", index_.size(), " tensors");
    return header_.tensors[it->second];
  }

  std::span<const std::byte> bytes(std::string_view name) const {
    const tensor_info& t = info(name);
    return std::span(bytes_).subspan(static_cast<std::size_t>(data_start_ + t.begin),
                                     static_cast<std::size_t>(t.end - t.begin));
  }

  // The elements of a tensor whose dtype is T's. BOOL bytes must be 0 or 1: anything
  // else is not a bool and reading it as one would be undefined behaviour.
  template <Element T>
  std::vector<T> get(std::string_view name) const {
    const tensor_info& t = info(name);
    if (t.type != dtype_of<T>) {
      detail::fail(origin_, "tensor \"", name, "\" has dtype ", shardlib::name(t.type), ", not the requested ",
                   shardlib::name(dtype_of<T>));
    }
    const auto raw = bytes(name);
    std::vector<T> out(raw.size() / sizeof(T));
    if constexpr (std::is_same_v<T, bool>) {
      for (std::size_t i = 0; i < raw.size(); ++i) {
        const auto b = std::to_integer<unsigned>(raw[i]);
        if (b > 1) detail::fail(origin_, "tensor \"", name, "\": BOOL element ", i, " is byte ", b, ", not 0 or 1");
        out[i] = b == 1;
      }
    } else if (!raw.empty()) {  // memcpy's pointers must not be null, even for 0 bytes
      std::memcpy(out.data(), raw.data(), raw.size());
    }
    return out;
  }

 private:
  safetensors(std::vector<std::byte> bytes, std::uint64_t data_start, std::string origin,
              detail::header_contents header)
      : bytes_(std::move(bytes)), data_start_(data_start), origin_(std::move(origin)), header_(std::move(header)) {
    for (std::size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
  }

  std::vector<std::byte> bytes_;
  std::uint64_t data_start_;
  std::string origin_;
  detail::header_contents header_;
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> position in header_.tensors
};

// The validated header of a file, for tools and for loaders that read byte ranges later.
struct safetensors_header {
  std::uint64_t header_bytes = 0;  // N, the JSON header's size
  std::map<std::string, std::string> metadata;
  std::vector<tensor_info> tensors;  // in data-offset order

  // Where the data section starts in the file: tensor t's bytes are at data_start() + t.begin.
  std::uint64_t data_start() const { return detail::size_field_bytes + header_bytes; }
};

// Reads and validates only the header (the layout is checked against the file's size).
inline safetensors_header read_safetensors_header(const std::filesystem::path& file) {
  auto [n, contents] = detail::read_file_header(detail::input_file(file));
  return {n, std::move(contents.metadata), std::move(contents.tensors)};
}

// Collects tensors (copies), then writes one file, in the order they were added.
class safetensors_writer {
 public:
  void add(std::string name, dtype type, Shape shape, std::span<const std::byte> data) {
    tensor_info t{.name = std::move(name), .type = type, .shape = shape, .begin = 0, .end = 0};
    const std::uint64_t need = detail::tensor_bytes(t, "safetensors_writer");
    if (need != data.size()) {
      detail::fail("safetensors_writer", "tensor \"", t.name, "\": shape ", t.shape, " of ", shardlib::name(type),
                   " needs ", need, " bytes, got ", data.size());
    }
    detail::lay_out(tensors_, names_, std::move(t), "safetensors_writer");
    data_.emplace_back(data.begin(), data.end());
  }

  template <Element T>
  void add(std::string name, Shape shape, std::span<const T> data) {
    add(std::move(name), dtype_of<T>, shape, std::as_bytes(data));
  }

  void set_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }

  // Writes to a temporary beside file (atomic_file), syncs it and renames it onto file.
  void write(const std::filesystem::path& file) const {
    const std::string header = detail::header_block(metadata_, tensors_, file.string());
    detail::atomic_file out(file);
    out.write(detail::as_bytes(header));
    for (const auto& d : data_) out.write(d);
    out.commit();
  }

 private:
  std::vector<tensor_info> tensors_;
  std::set<std::string, std::less<>> names_;
  std::vector<std::vector<std::byte>> data_;
  std::map<std::string, std::string> metadata_;
};

// Writes a file larger than memory: every tensor is declared up front (the header comes
// first in the file, so offsets are computed from the declarations, in declared order),
// then each tensor's data is written in that order. Without finish() the destructor
// removes the temporary file and leaves the target untouched.
class safetensors_stream_writer {
 public:
  safetensors_stream_writer(std::filesystem::path file, std::vector<tensor_info> declared,
                            std::map<std::string, std::string> metadata)
      : origin_(file.string()), tensors_(lay_out(std::move(declared), origin_)) {
    const std::string header = detail::header_block(metadata, tensors_, origin_);  // validated before creating files
    out_.emplace(std::move(file));
    out_->write(detail::as_bytes(header));
  }

  // The data of the next declared tensor, exactly its size.
  void write(std::string_view name, std::span<const std::byte> data) {
    if (next_ == tensors_.size()) {
      detail::fail(origin_, "write(\"", name, "\"): all ", tensors_.size(), " declared tensors are already written");
    }
    const tensor_info& t = tensors_[next_];
    if (name != t.name) detail::fail(origin_, "write(\"", name, "\"): the next declared tensor is \"", t.name, "\"");
    if (data.size() != t.end - t.begin) {
      detail::fail(origin_, "tensor \"", t.name, "\": expected ", t.end - t.begin, " bytes, got ", data.size());
    }
    out_->write(data);
    ++next_;
  }

  // Checks that every declared tensor was written, syncs and renames into place.
  void finish() {
    if (next_ != tensors_.size()) {
      detail::fail(origin_, "finish(): tensor \"", tensors_[next_].name, "\" (", next_ + 1, " of ", tensors_.size(),
                   ") was not written");
    }
    out_->commit();
  }

 private:
  static std::vector<tensor_info> lay_out(std::vector<tensor_info> declared, const std::string& origin) {
    std::vector<tensor_info> laid_out;
    std::set<std::string, std::less<>> names;
    for (auto& t : declared) detail::lay_out(laid_out, names, std::move(t), origin);
    return laid_out;
  }

  std::string origin_;
  std::vector<tensor_info> tensors_;
  std::optional<detail::atomic_file> out_;  // always engaged; optional so that the header is validated first
  std::size_t next_ = 0;
};

}  // namespace shardlib::io
