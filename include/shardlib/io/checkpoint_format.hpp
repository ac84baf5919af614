// shardlib/io/checkpoint_format.hpp — a checkpoint's metadata.json: what it records
// (units, parameters, shard files and their chunk checksums, optimizer, loss scaler,
// user fields), its text with the checksum around it, and parsing that checks every
// field as hostile input. Also the names a checkpoint uses for its files and tensors.
//
// The format: docs/checkpoints.md.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"       // io_error, cat
#include "shardlib/core/shape.hpp"       // Shape
#include "shardlib/io/safetensors.hpp"   // detail::fail, json_count, mul_within, size_field_bytes
#include "shardlib/shard/precision.hpp"  // loss_scaler

#include <nlohmann/json.hpp>  // nlohmann::json
// xxHash is used header-only (XXH_INLINE_ALL). Inlined, its AVX-512 path trips a
// false -Wuninitialized in GCC 12 (avx512fintrin.h) under -march=native; its AVX2
// path gives the same hashes, so AVX-512 machines use that one.
#if defined(__AVX512F__) && !defined(XXH_VECTOR)
#define XXH_VECTOR 2  // XXH_AVX2
#endif
#include <xxhash.h>  // XXH3_64bits

#include <algorithm>    // std::find
#include <array>        // std::array
#include <climits>      // INT_MAX
#include <cmath>        // std::isfinite
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // std::uint64_t, std::int64_t
#include <cstdio>       // std::snprintf
#include <functional>   // std::less
#include <limits>       // std::numeric_limits
#include <optional>     // std::optional
#include <set>          // std::set
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::io {

inline constexpr int checkpoint_version = 1;
inline constexpr std::uint64_t default_chunk_bytes = std::uint64_t(4) << 20;

// One parameter of a saved unit: its place in the unit's flat vector.
struct checkpoint_param {
  std::string name;  // dotted, PyTorch-style
  Shape shape;
  std::uint64_t offset = 0;  // first element within the unit's flat vector
  std::uint64_t numel() const { return std::uint64_t(shape.numel()); }
};

// A unit as saved: its flat vector (alignment gaps included, padding not) is split
// evenly over the checkpoint's partitions, like ShardedTensor over ranks.
struct checkpoint_unit {
  std::string name;  // the layer's dotted name; "" for the root
  std::uint64_t numel = 0;
  std::vector<checkpoint_param> params;  // by offset
};

// One shard file: its size and the XXH3-64 of every chunk_bytes piece (the last shorter).
struct checkpoint_file {
  std::string name;
  std::uint64_t bytes = 0;
  std::vector<std::uint64_t> chunks;
};

struct checkpoint_optimizer {
  std::string type;  // O::name ("Adam", "AdamW", "SGD"); "" for a user type without one
  std::int64_t step = 0;
  std::vector<std::string> state;  // per-parameter buffers, as PyTorch names them (exp_avg, ...)
  nlohmann::json hyperparameters = nlohmann::json::object();  // Adam's and SGD's options
};

// Everything metadata.json records.
struct checkpoint_metadata {
  int version = checkpoint_version;
  std::string tag;             // the directory's name when saved
  std::uint64_t sequence = 0;  // saves under one root count up: the highest is the latest
  int world_size = 1;
  std::string strategy;  // FullShard, ShardGradOp, ShardOptimizer, NoShard or HybridShard
  int group_size = 0;    // HybridShard's shard group; 0 for the others
  int partitions = 1;    // shard files: the distinct shards the strategy holds
  std::string param_dtype = "F32", reduce_dtype = "F32";  // the precision policy; master values are F32
  std::uint64_t steps = 0;                                // ShardedModel::steps()
  std::optional<checkpoint_optimizer> optimizer;          // absent: weights only
  std::optional<shard::loss_scaler> scaler;               // fp16 training
  nlohmann::json user = nlohmann::json::object();         // the caller's fields (epoch, RNG state, ...)
  std::uint64_t chunk_bytes = default_chunk_bytes;        // checksum granularity
  std::vector<checkpoint_file> files;                     // one per partition
  std::vector<checkpoint_unit> units;

  std::uint64_t shard_numel(const checkpoint_unit& u) const {
    return (u.numel + std::uint64_t(partitions) - 1) / std::uint64_t(partitions);
  }
  // The tensors each shard file holds per unit: "master" and the optimizer's buffers.
  std::vector<std::string> kinds() const {
    std::vector<std::string> k{"master"};
    if (optimizer) k.insert(k.end(), optimizer->state.begin(), optimizer->state.end());
    return k;
  }
};

// The shard files of one of the library's strategies on `world` ranks: one per
// distinct piece of master values (the engine's partitions()). Files written by
// a user's strategy record their own count; this names the shipped ones for tools
// that make a checkpoint without a model.
inline int checkpoint_partitions(std::string_view strategy, int world, int group_size) {
  if (world < 1) throw io_error(cat("a world of ", world, " ranks: it needs at least one"));
  if (strategy == "FullShard" || strategy == "ShardGradOp" || strategy == "ShardOptimizer") return world;
  if (strategy == "NoShard") return 1;
  if (strategy == "HybridShard") {
    if (group_size < 1 || world % group_size != 0)
      throw io_error(cat("HybridShard group size ", group_size, " must divide the world size ", world));
    return group_size;
  }
  throw io_error(cat("unknown strategy \"", strategy,
                     "\" (FullShard, ShardGradOp, ShardOptimizer, NoShard or HybridShard)"));
}

// Whatever the strategy: pieces split the world or a group of it evenly.
inline void check_partitions(int partitions, int world, int group_size) {
  if (world < 1) throw io_error(cat("a world of ", world, " ranks: it needs at least one"));
  if (group_size != 0 && (group_size < 1 || world % group_size != 0))
    throw io_error(cat("group size ", group_size, " must divide the world size ", world));
  const int most = group_size != 0 ? group_size : world;
  if (partitions < 1 || (partitions != 1 && partitions != most))
    throw io_error(cat("partitions ", partitions, " must be 1 or ", most, " (the ",
                       group_size != 0 ? "group" : "world", " size)"));
}

namespace detail {

inline constexpr std::string_view checkpoint_format = "shardlib-checkpoint";
inline constexpr std::string_view metadata_name = "metadata.json";
inline constexpr std::string_view temp_prefix = ".tmp-";
inline constexpr std::uint64_t max_metadata_bytes = std::uint64_t(1) << 28;
// Bounds on what metadata may claim, so that no size computed from it overflows.
inline constexpr std::uint64_t max_numel = std::uint64_t(1) << 48;
inline constexpr std::uint64_t max_units = std::uint64_t(1) << 20;
inline constexpr std::size_t max_state_buffers = 8;
inline constexpr std::uint64_t min_chunk_bytes = 64, max_chunk_bytes = std::uint64_t(1) << 30;
inline constexpr std::size_t fill_block = std::size_t(1) << 18;  // floats per write when building a shard file
inline constexpr std::uint64_t align = 16;  // parameter alignment in a flat vector, as the engine lays units out

inline std::uint64_t xxh3(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }
inline std::uint64_t xxh3(std::string_view s) { return XXH3_64bits(s.data(), s.size()); }

inline std::string hex(std::uint64_t v) {
  std::array<char, 17> s{};
  std::snprintf(s.data(), s.size(), "%016llx", static_cast<unsigned long long>(v));
  return s.data();
}
inline std::optional<std::uint64_t> parse_hex(std::string_view s) {
  if (s.size() != 16) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return std::nullopt;
    v = v * 16 + std::uint64_t(d);
  }
  return v;
}

inline std::string shard_file_name(int part, int partitions) {
  std::array<char, 64> s{};
  std::snprintf(s.data(), s.size(), "shard-%05d-of-%05d.safetensors", part, partitions);
  return s.data();
}
inline std::string tensor_name(std::size_t unit, std::string_view kind) { return cat("unit.", unit, ".", kind); }
inline std::string default_tag(std::uint64_t steps) {
  std::array<char, 32> s{};
  std::snprintf(s.data(), s.size(), "step-%08llu", static_cast<unsigned long long>(steps));
  return s.data();
}
// A tag names a directory next to others: no separators, no hidden or temporary names.
inline bool valid_tag(std::string_view tag) {
  if (tag.empty() || tag.size() > 200 || tag.front() == '.') return false;
  for (char c : tag) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    std::string_view("-_.+=").find(c) != std::string_view::npos;
    if (!ok) return false;
  }
  return true;
}
inline bool valid_buffer_name(std::string_view n) {
  if (n.empty() || n.size() > 64 || n == "master") return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

// --- JSON fields, checked ----------------------------------------------------------------------
inline const nlohmann::json& field(const nlohmann::json& obj, const char* key, std::string_view origin,
                                   std::string_view where) {
  if (!obj.is_object()) fail(origin, where, "must be a JSON object, found ", obj.type_name());
  const auto it = obj.find(key);
  if (it == obj.end()) fail(origin, where, "has no \"", key, "\"");
  return *it;
}
inline std::uint64_t count_field(const nlohmann::json& obj, const char* key, std::uint64_t max,
                                 std::string_view origin, std::string_view where) {
  return json_count(field(obj, key, origin, where), max, origin, where, key);
}
inline const std::string& string_field(const nlohmann::json& obj, const char* key, std::string_view origin,
                                       std::string_view where) {
  const auto& j = field(obj, key, origin, where);
  if (!j.is_string()) fail(origin, where, "\"", key, "\" must be a string, found ", j.type_name());
  return j.get_ref<const std::string&>();
}
inline double positive_field(const nlohmann::json& obj, const char* key, std::string_view origin,
                             std::string_view where) {
  const auto& j = field(obj, key, origin, where);
  if (!j.is_number() || !(j.get<double>() > 0) || !std::isfinite(j.get<double>()))
    fail(origin, where, "\"", key, "\" must be a positive finite number, found ", j.dump());
  return j.get<double>();
}
inline const nlohmann::json& array_field(const nlohmann::json& obj, const char* key, std::string_view origin,
                                         std::string_view where) {
  const auto& j = field(obj, key, origin, where);
  if (!j.is_array()) fail(origin, where, "\"", key, "\" must be an array, found ", j.type_name());
  return j;
}

inline Shape shape_from_json(const nlohmann::json& j, std::string_view origin, std::string_view where) {
  if (!j.is_array() || j.size() > std::size_t(Shape::max_rank))
    fail(origin, where, "\"shape\" must be an array of at most ", Shape::max_rank, " extents, found ", j.dump());
  std::array<std::int64_t, Shape::max_rank> e{};
  std::uint64_t numel = 1;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const std::uint64_t x = json_count(j[i], max_numel, origin, where, cat("shape extent ", i));
    if (!mul_within(numel, x, max_numel, numel)) fail(origin, where, "shape ", j.dump(), " has too many elements");
    e[i] = std::int64_t(x);
  }
  try {  // an empty shape whose other extents multiply past what Shape holds
    return Shape(std::span<const std::int64_t>(e.data(), j.size()));
  } catch (const shape_error& x) {
    fail(origin, where, x.what());
  }
}
inline nlohmann::json shape_to_json(const Shape& s) {
  return std::vector<std::int64_t>(s.extents().begin(), s.extents().end());
}

inline nlohmann::json scaler_to_json(const shard::loss_scaler& s) {
  return {{"scale", s.scale},
          {"growth_factor", s.growth_factor},
          {"backoff_factor", s.backoff_factor},
          {"growth_interval", s.growth_interval},
          {"min_scale", s.min_scale},
          {"max_scale", s.max_scale},
          {"max_skipped_in_row", s.max_skipped_in_row},
          {"good_steps", s.good_steps},
          {"skipped", s.skipped},
          {"skipped_in_row", s.skipped_in_row}};
}
// The bounds and the count of steps skipped in a row came after the first files of
// version 1: where they are absent, a scaler takes its defaults.
inline shard::loss_scaler scaler_from_json(const nlohmann::json& j, std::string_view origin) {
  constexpr std::string_view where = "loss_scaler: ";
  shard::loss_scaler s;
  s.scale = float(positive_field(j, "scale", origin, where));
  s.growth_factor = float(positive_field(j, "growth_factor", origin, where));
  s.backoff_factor = float(positive_field(j, "backoff_factor", origin, where));
  s.growth_interval = int(count_field(j, "growth_interval", INT_MAX, origin, where));
  if (j.contains("min_scale")) s.min_scale = float(positive_field(j, "min_scale", origin, where));
  if (j.contains("max_scale")) s.max_scale = float(positive_field(j, "max_scale", origin, where));
  if (j.contains("max_skipped_in_row"))
    s.max_skipped_in_row = int(count_field(j, "max_skipped_in_row", INT_MAX, origin, where));
  s.good_steps = int(count_field(j, "good_steps", INT_MAX, origin, where));
  s.skipped = long(count_field(j, "skipped", std::uint64_t(std::numeric_limits<long>::max()), origin, where));
  if (j.contains("skipped_in_row")) s.skipped_in_row = int(count_field(j, "skipped_in_row", INT_MAX, origin, where));
  try {
    shard::check_scaler(s);
  } catch (const error& e) {
    fail(origin, e.what());
  }
  return s;
}

inline nlohmann::json optimizer_to_json(const checkpoint_optimizer& o) {
  return {{"type", o.type}, {"step", o.step}, {"state", o.state}, {"hyperparameters", o.hyperparameters}};
}
inline checkpoint_optimizer optimizer_from_json(const nlohmann::json& j, std::string_view origin) {
  constexpr std::string_view where = "optimizer: ";
  checkpoint_optimizer o;
  o.type = string_field(j, "type", origin, where);
  o.step = std::int64_t(count_field(j, "step", std::uint64_t(std::numeric_limits<std::int64_t>::max()), origin, where));
  const auto& state = array_field(j, "state", origin, where);
  if (state.size() > max_state_buffers)
    fail(origin, where, state.size(), " state buffers, more than the ", max_state_buffers, " a checkpoint may hold");
  for (const auto& s : state) {
    if (!s.is_string() || !valid_buffer_name(s.get_ref<const std::string&>()))
      fail(origin, where, "state buffer name ", s.dump(), " must be 1-64 letters, digits or _, and not \"master\"");
    if (std::find(o.state.begin(), o.state.end(), s.get<std::string>()) != o.state.end())
      fail(origin, where, "state buffer ", s.dump(), " is listed twice");
    o.state.push_back(s.get<std::string>());
  }
  o.hyperparameters = field(j, "hyperparameters", origin, where);
  if (!o.hyperparameters.is_object())
    fail(origin, where, "\"hyperparameters\" must be an object, found ", o.hyperparameters.type_name());
  return o;
}

inline bool valid_precision(std::string_view d) { return d == "F32" || d == "BF16" || d == "F16"; }

// --- metadata.json -----------------------------------------------------------------------------
inline nlohmann::json metadata_to_json(const checkpoint_metadata& m) {
  using json = nlohmann::json;
  json files = json::array(), units = json::array();
  for (const auto& f : m.files) {
    json chunks = json::array();
    for (auto h : f.chunks) chunks.push_back(hex(h));
    files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"xxh3_64", std::move(chunks)}});
  }
  for (const auto& u : m.units) {
    json params = json::array();
    for (const auto& p : u.params)
      params.push_back({{"name", p.name}, {"shape", shape_to_json(p.shape)}, {"dtype", "F32"}, {"offset", p.offset}});
    units.push_back({{"name", u.name}, {"numel", u.numel}, {"params", std::move(params)}});
  }
  return {{"format", checkpoint_format},
          {"version", m.version},
          {"tag", m.tag},
          {"sequence", m.sequence},
          {"world_size", m.world_size},
          {"strategy", {{"name", m.strategy}, {"group_size", m.group_size}}},
          {"partitions", m.partitions},
          {"precision", {{"param", m.param_dtype}, {"reduce", m.reduce_dtype}, {"master", "F32"}}},
          {"steps", m.steps},
          {"optimizer", m.optimizer ? optimizer_to_json(*m.optimizer) : json(nullptr)},
          {"loss_scaler", m.scaler ? scaler_to_json(*m.scaler) : json(nullptr)},
          {"user", m.user},
          {"checksum", {{"algorithm", "xxh3_64"}, {"chunk_bytes", m.chunk_bytes}}},
          {"files", std::move(files)},
          {"units", std::move(units)}};
}

// Reads metadata as hostile input: every field is checked before it is used, and the
// sizes it implies are bounded by the shard files it records.
inline checkpoint_metadata metadata_from_json(const nlohmann::json& j, std::string_view origin) {
  checkpoint_metadata m;
  if (!j.is_object()) fail(origin, "the metadata must be a JSON object, found ", j.type_name());
  const std::string& format = string_field(j, "format", origin, "");
  if (format != checkpoint_format) fail(origin, "not a shardlib checkpoint: its format is \"", format, "\"");
  const std::uint64_t version = count_field(j, "version", std::numeric_limits<std::uint64_t>::max(), origin, "");
  if (version != std::uint64_t(checkpoint_version))
    fail(origin, "unknown format version ", version, " (this build reads version ", checkpoint_version, ")");
  m.tag = string_field(j, "tag", origin, "");
  if (!valid_tag(m.tag)) fail(origin, "tag \"", m.tag, "\" is not a valid checkpoint name");
  m.sequence = count_field(j, "sequence", std::numeric_limits<std::uint64_t>::max(), origin, "");
  m.world_size = int(count_field(j, "world_size", 1 << 24, origin, ""));
  const auto& strategy = field(j, "strategy", origin, "");
  m.strategy = string_field(strategy, "name", origin, "strategy: ");
  m.group_size = int(count_field(strategy, "group_size", 1 << 24, origin, "strategy: "));
  m.partitions = int(count_field(j, "partitions", 1 << 24, origin, ""));
  try {
    check_partitions(m.partitions, m.world_size, m.group_size);
  } catch (const io_error& e) {
    fail(origin, "strategy ", m.strategy, ": ", e.what());
  }
  const auto& precision = field(j, "precision", origin, "");
  m.param_dtype = string_field(precision, "param", origin, "precision: ");
  m.reduce_dtype = string_field(precision, "reduce", origin, "precision: ");
  if (!valid_precision(m.param_dtype) || !valid_precision(m.reduce_dtype) ||
      string_field(precision, "master", origin, "precision: ") != "F32")
    fail(origin, "precision: ", precision.dump(), " is not F32, BF16 or F16 with F32 master values");
  m.steps = count_field(j, "steps", std::numeric_limits<std::uint64_t>::max(), origin, "");
  if (const auto& o = field(j, "optimizer", origin, ""); !o.is_null()) m.optimizer = optimizer_from_json(o, origin);
  if (const auto& s = field(j, "loss_scaler", origin, ""); !s.is_null()) m.scaler = scaler_from_json(s, origin);
  m.user = field(j, "user", origin, "");

  const auto& checksum = field(j, "checksum", origin, "");
  if (string_field(checksum, "algorithm", origin, "checksum: ") != "xxh3_64")
    fail(origin, "checksum: unknown algorithm ", checksum["algorithm"].dump(), " (this build checks xxh3_64)");
  m.chunk_bytes = count_field(checksum, "chunk_bytes", max_chunk_bytes, origin, "checksum: ");
  if (m.chunk_bytes < min_chunk_bytes) fail(origin, "checksum: chunk_bytes ", m.chunk_bytes, " is below ", min_chunk_bytes);

  const auto& files = array_field(j, "files", origin, "");
  if (files.size() != std::size_t(m.partitions))
    fail(origin, "lists ", files.size(), " shard files for ", m.partitions, " partitions");
  for (std::size_t p = 0; p < files.size(); ++p) {
    const std::string where = cat("files[", p, "]: ");
    checkpoint_file f;
    f.name = string_field(files[p], "name", origin, where);
    if (f.name != shard_file_name(int(p), m.partitions))
      fail(origin, where, "name \"", f.name, "\", expected \"", shard_file_name(int(p), m.partitions), "\"");
    f.bytes = count_field(files[p], "bytes", std::uint64_t(1) << 56, origin, where);
    const auto& chunks = array_field(files[p], "xxh3_64", origin, where);
    const std::uint64_t want = (f.bytes + m.chunk_bytes - 1) / m.chunk_bytes;
    if (chunks.size() != want)
      fail(origin, where, chunks.size(), " checksums for ", f.bytes, " bytes in chunks of ", m.chunk_bytes, " (", want,
           " expected)");
    for (const auto& c : chunks) {
      const auto h = c.is_string() ? parse_hex(c.get_ref<const std::string&>()) : std::nullopt;
      if (!h) fail(origin, where, "checksum ", c.dump(), " is not 16 lowercase hex digits");
      f.chunks.push_back(*h);
    }
    m.files.push_back(std::move(f));
  }

  const auto& units = array_field(j, "units", origin, "");
  if (units.size() > max_units) fail(origin, units.size(), " units, more than the ", max_units, " supported");
  std::set<std::string, std::less<>> names;
  for (std::size_t i = 0; i < units.size(); ++i) {
    const std::string where = cat("units[", i, "]: ");
    checkpoint_unit u;
    u.name = string_field(units[i], "name", origin, where);
    u.numel = count_field(units[i], "numel", max_numel, origin, where);
    std::uint64_t end = 0;
    for (const auto& pj : array_field(units[i], "params", origin, where)) {
      checkpoint_param p;
      p.name = string_field(pj, "name", origin, where);
      const std::string pwhere = cat(where, "parameter \"", p.name, "\": ");
      if (p.name.empty() || !names.insert(p.name).second)
        fail(origin, pwhere, "parameter names must be non-empty and unique");
      p.shape = shape_from_json(field(pj, "shape", origin, pwhere), origin, pwhere);
      if (string_field(pj, "dtype", origin, pwhere) != "F32") fail(origin, pwhere, "master values must be F32");
      // Offsets are not free: parameters are packed in order at 16-element
      // boundaries, as the engine lays a unit out, so no edit can shift one silently.
      p.offset = count_field(pj, "offset", max_numel, origin, pwhere);
      if (const std::uint64_t packed = (end + align - 1) / align * align; p.offset != packed)
        fail(origin, pwhere, "offset ", p.offset, ", but packed after the previous parameter it is ", packed);
      end = p.offset + p.numel();
      u.params.push_back(std::move(p));
    }
    if (u.numel != end) fail(origin, where, "numel ", u.numel, ", but its parameters end at ", end);
    m.units.push_back(std::move(u));
  }

  // Every shard file holds each unit's shard of every kind: bound the units by the files.
  std::uint64_t need = size_field_bytes;
  const std::uint64_t kinds = m.kinds().size();
  for (const auto& u : m.units) {
    need += m.shard_numel(u) * kinds * sizeof(float);  // each term < 2^55: checked before it could overflow
    if (need > std::uint64_t(1) << 62) fail(origin, "the units hold more data than a checkpoint may");
  }
  for (const auto& f : m.files)
    if (f.bytes < need)
      fail(origin, f.name, " is recorded as ", f.bytes, " bytes, fewer than the ", need, " its tensors need");
  return m;
}

// metadata.json is {"xxh3_64":"<hash of the body>","metadata":<body>}: the checksum
// sits outside the bytes it covers, and the body is plain JSON for people and jq.
inline constexpr std::string_view metadata_head = "{\"xxh3_64\":\"", metadata_mid = "\",\"metadata\":",
                                  metadata_tail = "}\n";

inline std::string metadata_text(const checkpoint_metadata& m) {
  std::string body;
  try {
    body = metadata_to_json(m).dump(1);
  } catch (const nlohmann::json::exception& e) {  // strings that are not UTF-8
    throw io_error(cat("checkpoint metadata: a name or user field is not valid UTF-8: ", e.what()));
  }
  return cat(metadata_head, hex(xxh3(body)), metadata_mid, body, metadata_tail);
}

// A value as ranks compare it before a collective save: as the metadata would hold it
// (infinities and NaN as null, bytes that are not UTF-8 replaced), which no rank fails to
// make, where a rank raising alone would leave the others waiting in the broadcast.
inline std::string compared_text(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

inline checkpoint_metadata parse_metadata_text(std::string_view text, std::string_view origin) {
  const std::size_t body_at = metadata_head.size() + 16 + metadata_mid.size();
  if (text.size() < body_at + metadata_tail.size() || !text.starts_with(metadata_head) ||
      text.substr(metadata_head.size() + 16, metadata_mid.size()) != metadata_mid || !text.ends_with(metadata_tail))
    fail(origin, "not a checkpoint metadata file: it must read {\"xxh3_64\":\"<16 hex digits>\",\"metadata\":{...}}");
  const auto recorded = parse_hex(text.substr(metadata_head.size(), 16));
  if (!recorded) fail(origin, "the metadata checksum \"", text.substr(metadata_head.size(), 16), "\" is not hex");
  const std::string_view body = text.substr(body_at, text.size() - body_at - metadata_tail.size());
  if (const std::uint64_t computed = xxh3(body); computed != *recorded)
    fail(origin, "the metadata does not match its checksum (xxh3_64 recorded ", hex(*recorded), ", computed ",
         hex(computed), "): the file is corrupt");
  const nlohmann::json j = parse_json(body, origin, "the metadata");
  try {
    return metadata_from_json(j, origin);
  } catch (const nlohmann::json::exception& e) {  // a field of an unexpected type the checks missed
    fail(origin, "the metadata: ", e.what());
  }
}

}  // namespace detail

}  // namespace shardlib::io
