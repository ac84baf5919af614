// shardlib/io/safetensors_format.hpp — the safetensors format, checked: a header's size field,
// its JSON, every tensor entry and the tiling of the data section, before any number is used.
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
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/shape.hpp"

#include <nlohmann/json.hpp>  // nlohmann::json, nlohmann::ordered_json

#include <algorithm>     // std::sort
#include <array>         // std::array
#include <bit>           // std::endian
#include <cerrno>        // errno, EINTR, EINVAL
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
#include <unistd.h>    // pread, write, fsync, close, unlink, sysconf


namespace shardlib::io {

static_assert(std::endian::native == std::endian::little,
              "shardlib/io/safetensors.hpp copies tensor bytes as they are and safetensors data is "
              "little-endian: big-endian hosts are not supported");
static_assert(sizeof(bool) == 1, "safetensors BOOL elements are one byte each");

// One tensor's entry in a header. begin and end are byte offsets into the data section.
struct tensor_info {
  std::string name;
  dtype type = dtype::f32;
  Shape shape;
  std::uint64_t begin = 0, end = 0;

  friend bool operator==(const tensor_info&, const tensor_info&) = default;
};

namespace detail {

// The reference implementation's limit: no real model needs more, and it bounds the
// memory a hostile header size can make the reader allocate.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;
inline constexpr std::uint64_t size_field_bytes = 8;

template <class... Args>
[[noreturn]] void fail(std::string_view origin, const Args&... args) {
  throw io_error(cat(origin, ": ", args...));
}

inline std::string os_error(int e) { return std::system_category().message(e); }

inline std::uint64_t load_u64(const std::byte* p) {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);  // little-endian on disk and (static_assert above) in memory
  return v;
}

// a * b into out, or false when the product would exceed limit.
inline bool mul_within(std::uint64_t a, std::uint64_t b, std::uint64_t limit, std::uint64_t& out) {
  if (a != 0 && b > limit / a) return false;
  out = a * b;
  return true;
}

// The data size of a tensor, refusing shapes whose counts overflow. The product of the
// non-zero extents must fit in int64 (not only the total, which a 0 extent makes 0)
// because Shape::numel() multiplies left to right in int64.
inline std::uint64_t tensor_bytes(const tensor_info& t, std::string_view origin) {
  constexpr auto int64_max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t nonzero = 1;
  bool empty = false;
  for (std::int64_t e : t.shape.extents()) {
    if (e == 0) {
      empty = true;
    } else if (!mul_within(nonzero, static_cast<std::uint64_t>(e), int64_max, nonzero)) {
      fail(origin, "tensor \"", t.name, "\": shape ", t.shape, " has more elements than a signed 64-bit count holds");
    }
  }
  std::uint64_t bytes = 0;
  if (!mul_within(empty ? 0 : nonzero, size_of(t.type), std::numeric_limits<std::uint64_t>::max(), bytes)) {
    fail(origin, "tensor \"", t.name, "\": shape ", t.shape, " of ", name(t.type),
         " needs more bytes than a 64-bit size holds");
  }
  return bytes;
}

inline void check_file_size(std::uint64_t file_bytes, std::string_view origin) {
  if (file_bytes < size_field_bytes) {
    fail(origin, "the file holds ", file_bytes,
         " bytes, fewer than the 8-byte header size that starts every safetensors file");
  }
}

inline void check_header_size(std::uint64_t n, std::uint64_t file_bytes, std::string_view origin) {
  if (n > max_header_bytes) fail(origin, "header size ", n, " exceeds the limit of ", max_header_bytes, " bytes");
  if (n > file_bytes - size_field_bytes) {
    fail(origin, "header size ", n, " runs past the end of the file: only ", file_bytes - size_field_bytes,
         " bytes follow the size field");
  }
}

// JSON read from a file nests at most this deep: nlohmann parses without recursion but
// copies a value recursively, so a file of arrays nested a million deep (a few MB) would
// overflow the stack wherever a subtree of it is copied, where it must raise.
inline constexpr int max_json_depth = 512;

// Parses JSON text read from a file; `what` names it in errors ("the metadata"). Refused
// besides what is not JSON:
// - a NUL byte: nlohmann ends its input there, which would let trailing bytes pass unread,
//   and JSON text has none (strings escape it);
// - nesting deeper than max_json_depth;
// - a duplicate key: nlohmann keeps the last silently, where another reader may keep the
//   first, so two readers would see different files. `top_key` names what the keys of
//   the outermost object are ("tensor name" in a safetensors header).
inline nlohmann::json parse_json(std::string_view text, std::string_view origin, std::string_view what,
                                 std::string_view top_key = "key") {
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    fail(origin, what, " is not valid JSON: it holds a NUL byte at offset ", nul);
  std::vector<std::set<std::string, std::less<>>> open_objects;  // keys seen in each object being parsed
  const auto checked = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using event_t = nlohmann::json::parse_event_t;
    if ((event == event_t::object_start || event == event_t::array_start) && depth >= max_json_depth)
      fail(origin, what, " is not valid JSON here: it nests objects and arrays deeper than ", max_json_depth,
           " levels");
    if (event == event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == event_t::object_end) {
      open_objects.pop_back();
    } else if (event == event_t::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(key).second)
        fail(origin, "duplicate ", open_objects.size() == 1 ? top_key : "key", " \"", key, "\" in ", what);
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), checked);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for numbers like 1e400
    fail(origin, what, " is not valid JSON: ", e.what());
  }
}

// Parses the header text: a JSON object, by the rules of parse_json.
inline nlohmann::json parse_header_json(std::string_view text, std::string_view origin) {
  if (text.empty() || text.front() != '{') {
    std::ostringstream found;
    if (text.empty())
      found << "an empty header";
    else
      found << "byte 0x" << std::hex << std::to_integer<unsigned>(std::byte(text.front()));
    fail(origin, "the header must be a JSON object, starting with '{'; found ", found.str());
  }
  return parse_json(text, origin, "the header", "tensor name");
}

// A JSON number that must be an integer in [0, max].
inline std::uint64_t json_count(const nlohmann::json& j, std::uint64_t max, std::string_view origin,
                                std::string_view where, std::string_view what) {
  if (j.is_number_unsigned()) {
    const auto v = j.get<std::uint64_t>();
    if (v > max) fail(origin, where, what, " ", v, " exceeds the maximum ", max);
    return v;
  }
  if (j.is_number_integer()) {  // parsed: negative integers (and -0); built in code: any signed value
    const auto v = j.get<std::int64_t>();
    if (v < 0) fail(origin, where, what, " ", v, " is negative");
    if (std::uint64_t(v) > max) fail(origin, where, what, " ", v, " exceeds the maximum ", max);
    return std::uint64_t(v);
  }
  fail(origin, where, what, " must be a non-negative integer, found ", j.is_number() ? j.dump() : j.type_name());
}

inline tensor_info read_tensor_entry(const std::string& tensor, const nlohmann::json& entry, std::uint64_t data_bytes,
                                     std::string_view origin) {
  const std::string where = cat("tensor \"", tensor, "\": ");
  if (!entry.is_object()) {
    fail(origin, where, "the entry must be an object with dtype, shape and data_offsets, found ", entry.type_name());
  }
  const auto field = [&](const char* key) -> const nlohmann::json& {
    const auto it = entry.find(key);
    if (it == entry.end()) fail(origin, where, "the entry has no \"", key, "\"");
    return *it;
  };

  tensor_info t;
  t.name = tensor;
  const auto& type = field("dtype");
  if (!type.is_string()) fail(origin, where, "\"dtype\" must be a string, found ", type.type_name());
  try {
    t.type = parse_dtype(type.get_ref<const std::string&>());
  } catch (const error& e) {
    fail(origin, where, e.what());
  }

  const auto& shape = field("shape");
  if (!shape.is_array())
    fail(origin, where, "\"shape\" must be an array of non-negative integers, found ", shape.type_name());
  if (shape.size() > Shape::max_rank)
    fail(origin, where, "shape has rank ", shape.size(), ", more than the maximum ", Shape::max_rank);
  std::array<std::int64_t, Shape::max_rank> extents{};
  for (std::size_t i = 0; i < shape.size(); ++i) {
    extents[i] = static_cast<std::int64_t>(
        json_count(shape[i], std::numeric_limits<std::int64_t>::max(), origin, where, cat("shape entry ", i)));
  }
  try {
    t.shape = Shape(std::span<const std::int64_t>(extents.data(), shape.size()));
  } catch (const shape_error& e) {
    fail(origin, where, e.what());
  }

  const auto& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) {
    fail(origin, where, "\"data_offsets\" must be an array [begin, end] of two non-negative integers, found ",
         offsets.is_array() ? cat("an array of ", offsets.size()) : offsets.type_name());
  }
  const auto u64_max = std::numeric_limits<std::uint64_t>::max();
  t.begin = json_count(offsets[0], u64_max, origin, where, "data_offsets begin");
  t.end = json_count(offsets[1], u64_max, origin, where, "data_offsets end");
  if (t.begin > t.end) fail(origin, where, "data_offsets [", t.begin, ", ", t.end, "] begin after they end");

  const std::uint64_t need = tensor_bytes(t, origin);
  if (t.end - t.begin != need) {
    fail(origin, where, "shape ", t.shape, " of ", name(t.type), " needs ", need, " bytes but data_offsets [", t.begin,
         ", ", t.end, "] hold ", t.end - t.begin);
  }
  if (t.end > data_bytes) {
    fail(origin, where, "data_offsets [", t.begin, ", ", t.end,
         "] run past the end of the file: the data section holds ", data_bytes, " bytes");
  }
  return t;
}

inline std::map<std::string, std::string> read_metadata(const nlohmann::json& j, std::string_view origin) {
  if (!j.is_object()) fail(origin, "\"__metadata__\" must be an object of strings, found ", j.type_name());
  std::map<std::string, std::string> metadata;
  for (const auto& item : j.items()) {
    if (!item.value().is_string()) {
      fail(origin, "\"__metadata__\" value of \"", item.key(), "\" must be a string, found ", item.value().type_name());
    }
    metadata.emplace(item.key(), item.value().get<std::string>());
  }
  return metadata;
}

struct header_contents {
  std::map<std::string, std::string> metadata;
  std::vector<tensor_info> tensors;  // in data-offset order
};

// Validates a header against a data section of data_bytes bytes.
inline header_contents read_header(std::string_view text, std::uint64_t data_bytes, std::string_view origin) {
  const nlohmann::json header = parse_header_json(text, origin);
  header_contents out;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__")
      out.metadata = read_metadata(item.value(), origin);
    else
      out.tensors.push_back(read_tensor_entry(item.key(), item.value(), data_bytes, origin));
  }

  // Each range must start where the previous one ended and the last must end at the end
  // of the data; empty tensors sort before a non-empty one at the same offset.
  std::sort(out.tensors.begin(), out.tensors.end(), [](const tensor_info& a, const tensor_info& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < out.tensors.size(); ++i) {
    const tensor_info& t = out.tensors[i];
    if (t.begin < covered) {
      const tensor_info& p = out.tensors[i - 1];  // covered > 0, so there is a previous tensor
      fail(origin, "tensors \"", p.name, "\" [", p.begin, ", ", p.end, ") and \"", t.name, "\" [", t.begin, ", ", t.end,
           ") overlap");
    }
    if (t.begin > covered) {
      fail(origin, "bytes [", covered, ", ", t.begin, ") of the data section, before tensor \"", t.name,
           "\", belong to no tensor");
    }
    covered = t.end;
  }
  if (covered != data_bytes) {
    fail(origin, "the data section holds ", data_bytes, " bytes but the tensors cover ", covered, ": bytes [", covered,
         ", ", data_bytes, ") belong to no tensor");
  }
  return out;
}

}  // namespace detail
}  // namespace shardlib::io
