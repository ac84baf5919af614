// shardlib/io/checkpoint.hpp — sharded checkpoints: an atomic save from every rank, a load
// at any world size and strategy that reads only the byte ranges each rank needs,
// consolidation to one safetensors file and back, and checksum verification.
//
// The format, the guarantees and the resharding algorithm: docs/checkpoints.md.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"    // reduce_op
#include "shardlib/core/buffer.hpp"          // Buffer
#include "shardlib/core/element.hpp"         // dtype, half, bfloat16, element_cast
#include "shardlib/core/error.hpp"           // io_error, cat
#include "shardlib/core/ledger.hpp"          // category
#include "shardlib/core/shape.hpp"           // Shape
#include "shardlib/io/safetensors.hpp"       // header validation, input_file, safetensors_stream_writer
#include "shardlib/optim/adam.hpp"           // BasicAdam: its hyperparameters are saved and restored
#include "shardlib/optim/optimizer.hpp"      // Optimizer
#include "shardlib/optim/sgd.hpp"            // SGD: its hyperparameters are saved and restored
#include "shardlib/shard/precision.hpp"      // loss_scaler
#include "shardlib/shard/sharded_model.hpp"  // ShardedModel
#include "shardlib/shard/strategy.hpp"       // FullShard, ..., HybridShard

#include <nlohmann/json.hpp>  // nlohmann::json
#include <xxhash.h>           // XXH3_64bits

#include <algorithm>     // std::min, std::max, std::sort, std::fill
#include <array>         // std::array
#include <cerrno>        // errno
#include <climits>       // INT_MAX
#include <cmath>         // std::isfinite
#include <cstddef>       // std::byte, std::size_t
#include <cstdint>       // std::uint64_t, std::int64_t
#include <cstdio>        // std::snprintf, renameat2, RENAME_EXCHANGE
#include <cstring>       // std::memcpy
#include <filesystem>    // std::filesystem
#include <functional>    // std::function
#include <limits>        // std::numeric_limits
#include <map>           // std::map
#include <optional>      // std::optional
#include <set>           // std::set
#include <span>          // std::span
#include <string>        // std::string
#include <string_view>   // std::string_view
#include <system_error>  // std::error_code
#include <tuple>         // std::tie
#include <type_traits>   // std::is_same_v
#include <utility>       // std::move, std::pair
#include <vector>        // std::vector

#include <fcntl.h>   // open, AT_FDCWD
#include <unistd.h>  // write, fsync, close

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

// A write about to happen while saving; see save_options::write_hook.
struct write_event {
  int rank;
  std::filesystem::path file;
  std::uint64_t offset;  // in the file
  std::uint64_t bytes;
};
using write_callback = std::function<int(const write_event&)>;

struct save_options {
  int keep_last = 0;  // after this save completes, delete all but the newest K checkpoints under root (0: keep all)
  nlohmann::json user = nlohmann::json::object();  // recorded as given: step, epoch, RNG state, ...
  std::string tag{};  // the checkpoint's directory name under root; "step-<steps, 8 digits>" when empty
  std::uint64_t chunk_bytes = default_chunk_bytes;  // each checksum covers this many bytes; 64 B to 1 GiB
  // Fault injection for tests: called before every write(2) of the save on the rank
  // doing it; a non-zero return fails that write with that errno (ENOSPC is a full
  // disk), and it may throw. Empty in production.
  write_callback write_hook{};
};

struct load_result {
  std::filesystem::path path;    // the checkpoint loaded (the latest when given a root)
  checkpoint_metadata metadata;  // user fields included
  std::uint64_t bytes_read = 0;  // by this rank, from shard files
  std::vector<int> files_read;   // the shard files this rank opened
};

// A checkpoint directory under a root, as list_checkpoints finds it.
struct checkpoint_entry {
  std::filesystem::path path;
  std::optional<checkpoint_metadata> metadata;  // absent when its metadata is unreadable:
  std::string error;                            // then this says why
};

// The ranks a strategy writes shard files from: one file per distinct shard.
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

// --- optimizers: name and hyperparameters ------------------------------------------------------
template <class O>
inline constexpr bool is_adam = false;
template <optim::decay_style S>
inline constexpr bool is_adam<optim::BasicAdam<S>> = true;
// The library's optimizers, whose options a checkpoint records and restores (as
// PyTorch's optimizer state_dict does with param_groups).
template <class O>
inline constexpr bool known_optimizer = is_adam<O> || std::is_same_v<O, optim::SGD>;

// f(name, field) for every hyperparameter of a known optimizer.
template <class O, class F>
void each_hyperparameter(O& opt, F&& f) {
  auto& o = opt.options;
  if constexpr (is_adam<std::remove_const_t<O>>) {
    f("lr", o.lr);
    f("beta1", o.beta1);
    f("beta2", o.beta2);
    f("eps", o.eps);
    f("weight_decay", o.weight_decay);
    f("amsgrad", o.amsgrad);
  } else if constexpr (std::is_same_v<std::remove_const_t<O>, optim::SGD>) {
    f("lr", o.lr);
    f("momentum", o.momentum);
    f("dampening", o.dampening);
    f("weight_decay", o.weight_decay);
    f("nesterov", o.nesterov);
  }
}
template <class O>
nlohmann::json hyperparameters_of(const O& opt) {
  auto j = nlohmann::json::object();
  each_hyperparameter(opt, [&](const char* k, const auto& v) { j[k] = v; });
  return j;
}
template <class O>
void restore_hyperparameters(O& opt, const nlohmann::json& j, std::string_view origin) {
  each_hyperparameter(opt, [&](const char* k, auto& v) {
    const auto it = j.find(k);
    if (it == j.end()) fail(origin, "the optimizer's hyperparameters lack \"", k, "\"");
    if constexpr (std::is_same_v<std::remove_reference_t<decltype(v)>, bool>) {
      if (!it->is_boolean()) fail(origin, "hyperparameter \"", k, "\" must be true or false, found ", it->dump());
      v = it->template get<bool>();
    } else {
      if (!it->is_number() || !std::isfinite(it->template get<double>()))
        fail(origin, "hyperparameter \"", k, "\" must be a finite number, found ", it->dump());
      v = it->template get<double>();
    }
  });
}
template <class O>
std::string optimizer_name() {
  if constexpr (requires { O::name; }) return std::string(O::name);
  else return {};
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
  return Shape(std::span<const std::int64_t>(e.data(), j.size()));
}
inline nlohmann::json shape_to_json(const Shape& s) {
  return std::vector<std::int64_t>(s.extents().begin(), s.extents().end());
}

inline nlohmann::json scaler_to_json(const shard::loss_scaler& s) {
  return {{"scale", s.scale},           {"growth_factor", s.growth_factor}, {"backoff_factor", s.backoff_factor},
          {"growth_interval", s.growth_interval}, {"good_steps", s.good_steps}, {"skipped", s.skipped}};
}
inline shard::loss_scaler scaler_from_json(const nlohmann::json& j, std::string_view origin) {
  constexpr std::string_view where = "loss_scaler: ";
  shard::loss_scaler s;
  s.scale = float(positive_field(j, "scale", origin, where));
  s.growth_factor = float(positive_field(j, "growth_factor", origin, where));
  s.backoff_factor = float(positive_field(j, "backoff_factor", origin, where));
  s.growth_interval = int(count_field(j, "growth_interval", INT_MAX, origin, where));
  s.good_steps = int(count_field(j, "good_steps", INT_MAX, origin, where));
  s.skipped = long(count_field(j, "skipped", std::uint64_t(std::numeric_limits<long>::max()), origin, where));
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
  if (m.strategy != "HybridShard" && m.group_size != 0)
    fail(origin, "strategy: ", m.strategy, " has no group size, found ", m.group_size);
  m.partitions = int(count_field(j, "partitions", 1 << 24, origin, ""));
  int expected = 0;
  try {
    expected = checkpoint_partitions(m.strategy, m.world_size, m.group_size);
  } catch (const io_error& e) {
    fail(origin, "strategy: ", e.what());
  }
  if (m.partitions != expected)
    fail(origin, "partitions ", m.partitions, " do not fit ", m.strategy, " on ", m.world_size, " ranks (", expected,
         ")");
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
  // nlohmann stops at a NUL byte, which would let trailing bytes pass unread.
  if (body.find('\0') != std::string_view::npos) fail(origin, "the metadata holds a NUL byte");
  try {
    return metadata_from_json(nlohmann::json::parse(body.begin(), body.end()), origin);
  } catch (const nlohmann::json::exception& e) {
    fail(origin, "the metadata is not valid JSON: ", e.what());
  }
}

// --- writing -----------------------------------------------------------------------------------
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

inline std::vector<checkpoint_entry> scan_checkpoints(const std::filesystem::path& root);

// Creates root and a fresh temporary directory; returns the next save's sequence number.
inline std::uint64_t prepare_save(const std::filesystem::path& root, const std::filesystem::path& temp) {
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  if (ec) fail(root.string(), "cannot create the checkpoint root: ", ec.message());
  std::filesystem::remove_all(temp, ec);  // left by a save that was killed
  if (ec) fail(temp.string(), "cannot remove a stale temporary directory: ", ec.message());
  if (!std::filesystem::create_directory(temp, ec) || ec)
    fail(temp.string(), "cannot create the temporary directory: ", ec ? ec.message() : "it exists");
  std::uint64_t last = 0;
  for (const auto& e : scan_checkpoints(root))
    if (e.metadata) last = std::max(last, e.metadata->sequence);
  return last + 1;
}

// Writes metadata.json last, syncs, and renames the temporary directory into place; an
// existing checkpoint of the same tag is swapped out in the same atomic step, then removed.
inline void commit_checkpoint(const std::filesystem::path& temp, const std::filesystem::path& final_dir,
                              const checkpoint_metadata& m, const write_callback& hook) {
  const std::string text = metadata_text(m);
  chunked_writer out(temp / metadata_name, m.chunk_bytes, 0, hook);
  out.write(as_bytes(text));
  out.finish();
  sync_directory(temp);
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

// After a save completed: deletes all but the newest keep_last checkpoints (0 keeps
// all), and the temporary directories of saves that were killed.
inline void prune(const std::filesystem::path& root, int keep_last) {
  std::vector<std::filesystem::path> complete;  // newest first
  const auto entries = scan_checkpoints(root);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it)
    if (it->metadata) complete.push_back(it->path);
  for (std::size_t i = std::size_t(keep_last); keep_last > 0 && i < complete.size(); ++i) {
    std::error_code ec;
    std::filesystem::remove_all(complete[i], ec);
    if (ec) fail(complete[i].string(), "cannot delete this old checkpoint: ", ec.message());
  }
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename().string().starts_with(temp_prefix)) remove_quietly(it->path());
}

// --- reading -----------------------------------------------------------------------------------
// Zeroes out and requests from src, by name, each parameter's piece of elements
// [first, first + out.size()) of a flat vector of `kind` laid out as `entries`: the
// saved layout may differ (another wrap policy, world size or strategy). Gaps and
// padding stay 0. The data arrives at src.finish().
template <class Entries, class Source>
void request_range(const Entries& entries, Source& src, std::string_view kind, std::uint64_t first,
                   std::span<float> out) {
  std::fill(out.begin(), out.end(), 0.0f);
  const std::uint64_t end = first + out.size();
  for (const auto& e : entries) {
    const std::uint64_t offset = e.offset, lo = std::max(first, offset), hi = std::min(end, offset + e.numel());
    if (lo < hi) src.request(e.name, kind, lo - offset, out.subspan(std::size_t(lo - first), std::size_t(hi - lo)));
  }
}

// Throws io_error naming the first parameter that this model and a saved source
// disagree on: missing on either side, or another shape.
template <class Units>
void check_parameters(const Units& units, const std::vector<std::pair<std::string, Shape>>& saved,
                      std::string_view source) {
  constexpr std::string_view hint = " (the first difference: was it saved from another model?)";
  std::map<std::string_view, const Shape*> by_name;
  for (const auto& [n, s] : saved) by_name.emplace(n, &s);
  std::set<std::string_view> ours;
  for (const auto& u : units)
    for (const auto& e : u.layout.entries) {
      ours.insert(e.name);
      const auto it = by_name.find(e.name);
      if (it == by_name.end())
        throw io_error(cat(source, ": this model's parameter '", e.name, "' ", e.shape, " is not in it", hint));
      if (*it->second != e.shape)
        throw io_error(cat(source, ": parameter '", e.name, "' has shape ", *it->second, " there but ", e.shape,
                           " in this model", hint));
    }
  for (const auto& [n, s] : saved)
    if (!ours.contains(n))
      throw io_error(cat(source, ": it holds parameter '", n, "' ", s, ", which this model does not have", hint));
}

}  // namespace detail

// --- checkpoint directories --------------------------------------------------------------------

// Reads and validates dir/metadata.json (checksum, version and every field).
inline checkpoint_metadata read_checkpoint_metadata(const std::filesystem::path& dir) {
  const auto file = dir / detail::metadata_name;
  const detail::input_file in(file);
  if (in.size() > detail::max_metadata_bytes)
    detail::fail(file.string(), "holds ", in.size(), " bytes, more than the ", detail::max_metadata_bytes,
                 " a metadata file may have");
  std::string text(std::size_t(in.size()), '\0');
  in.read_at(0, std::as_writable_bytes(std::span(text)));
  return detail::parse_metadata_text(text, file.string());
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
    return a.metadata ? a.metadata->sequence < b.metadata->sequence : a.path < b.path;
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

// --- consolidated safetensors files ------------------------------------------------------------

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
    detail::check_file_size(in_.size(), origin_);
    std::array<std::byte, detail::size_field_bytes> field{};
    in_.read_at(0, field);
    const std::uint64_t n = detail::load_u64(field.data());
    detail::check_header_size(n, in_.size(), origin_);
    std::string text(std::size_t(n), '\0');
    in_.read_at(detail::size_field_bytes, std::as_writable_bytes(std::span(text)));
    auto header = detail::read_header(text, in_.size() - detail::size_field_bytes - n, origin_);
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
    const std::uint64_t numel = std::uint64_t(t->shape.numel()), es = size_of(t->type);
    if (first > numel || out.size() > numel - first)
      detail::fail(origin_, "tensor \"", tensor, "\" has ", numel, " elements, not [", first, ", ", first + out.size(),
                   ")");
    pending_.push_back({data_start_ + t->begin + first * es, t->type, out});
  }
  // Reads the requested pieces in file order (pread: no whole-file read), converting to float.
  void finish() {
    std::sort(pending_.begin(), pending_.end(), [](const piece& a, const piece& b) { return a.offset < b.offset; });
    for (const auto& p : pending_) {
      if (p.type == dtype::f32) {
        in_.read_at(p.offset, std::as_writable_bytes(p.out));
      } else {
        const std::size_t es = size_of(p.type);
        raw_.resize(p.out.size() * es);
        in_.read_at(p.offset, raw_);
        for (std::size_t i = 0; i < p.out.size(); ++i) p.out[i] = to_float(p.type, raw_.data() + i * es);
      }
    }
    pending_.clear();
  }

 private:
  static float to_float(dtype type, const std::byte* p) {
    if (type == dtype::f64) return element_cast<float>(load<double>(p));
    if (type == dtype::f16) return element_cast<float>(load<half>(p));
    return element_cast<float>(load<bfloat16>(p));
  }
  template <class E>
  static E load(const std::byte* p) {
    E e;
    std::memcpy(&e, p, sizeof e);
    return e;
  }
  consolidated_info parse_info(const std::string& text) const {
    const std::string origin = cat(origin_, ": \"shardlib\" metadata");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      detail::fail(origin, "not valid JSON: ", e.what());
    }
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
    std::uint64_t offset;  // in the file
    dtype type;
    std::span<float> out;
  };
  std::vector<piece> pending_;
  std::vector<std::byte> raw_;
};

// --- with a model: where each rank's state lies, and agreement between ranks --------------------
namespace detail {

template <class M, class C, class S>
using model_t = shard::ShardedModel<M, C, S, float>;

// Shard files: one per distinct shard the strategy holds.
template <class M, class C, class S>
int partitions_of(model_t<M, C, S>& m) {
  if constexpr (S::shards_parameters) return m.shard_group().size();
  else if constexpr (std::is_same_v<S, shard::ShardOptimizer>) return m.comm().size();
  else return 1;
}
// The partition this rank writes, or -1: HybridShard's replicas after the first and
// NoShard's ranks after 0 hold copies of what others write.
template <class M, class C, class S>
int written_partition(model_t<M, C, S>& m) {
  if constexpr (S::shards_parameters) return m.comm().rank() < m.shard_group().size() ? m.shard_group().rank() : -1;
  else if constexpr (std::is_same_v<S, shard::ShardOptimizer>) return m.comm().rank();
  else return m.comm().rank() == 0 ? 0 : -1;
}
// Where this rank's master values and optimizer state of unit i start in its flat vector.
template <class M, class C, class S>
std::uint64_t master_begin(model_t<M, C, S>& m, std::size_t i) {
  if constexpr (S::shards_parameters) return std::uint64_t(m.shard_group().rank()) * m.units()[i].master->local().size();
  else return 0;
}
template <class M, class C, class S>
std::uint64_t state_size(model_t<M, C, S>& m, std::size_t i) {
  const std::uint64_t n = m.units()[i].master->local().size();
  if constexpr (std::is_same_v<S, shard::ShardOptimizer>) return n / std::uint64_t(m.comm().size());
  else return n;
}
template <class M, class C, class S>
std::uint64_t state_begin(model_t<M, C, S>& m, std::size_t i) {
  if constexpr (std::is_same_v<S, shard::ShardOptimizer>) return std::uint64_t(m.comm().rank()) * state_size(m, i);
  else return master_begin(m, i);
}

template <class Comm>
std::string broadcast_string(Comm& comm, const std::string& s, int root) {
  std::vector<std::int64_t> n{std::int64_t(s.size())};
  comm.broadcast(std::span<std::int64_t>(n), root);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(n[0]));
  if (comm.rank() == root && !s.empty()) std::memcpy(bytes.data(), s.data(), s.size());
  if (!bytes.empty()) comm.broadcast(std::span<std::uint8_t>(bytes), root);
  return std::string(bytes.begin(), bytes.end());
}

// Runs f on every rank, then agrees (one all-reduce) on whether all succeeded: if any
// rank failed, every rank raises io_error — the failing ones with their own message,
// the others with the message of the lowest failing rank — so none is left waiting.
template <class Comm, class F>
void on_all_ranks(Comm& comm, std::string_view what, F&& f) {
  std::string message;
  bool failed = false;
  try {
    f();
  } catch (const std::exception& e) {
    failed = true;
    message = e.what();
  } catch (...) {
    failed = true;
    message = "an exception not derived from std::exception";
  }
  std::vector<std::int64_t> flag{failed ? std::int64_t(comm.size() - comm.rank()) : 0};
  comm.all_reduce(std::span<std::int64_t>(flag), shardlib::comm::reduce_op::max);
  if (flag[0] == 0) return;
  const int first = comm.size() - int(flag[0]);
  const std::string first_message = broadcast_string(comm, message, first);
  if (failed) throw io_error(cat("rank ", comm.rank(), ": ", what, ": ", message));
  throw io_error(cat("rank ", comm.rank(), ": ", what, ": stopped because rank ", first, " failed: ", first_message));
}

// The names of an optimizer's per-parameter buffers.
template <class O>
std::vector<std::string> buffer_names(O& opt) {
  std::vector<std::string> names;
  auto probe = opt.make_state(1);
  probe.for_each_buffer([&](std::string_view n, Buffer<float>&) { names.emplace_back(n); });
  return names;
}

// The optimizer the source records must be the one loading: the same type...
template <class O>
void check_optimizer_type(const checkpoint_optimizer& saved, std::string_view source) {
  if (const std::string mine = optimizer_name<O>(); !saved.type.empty() && !mine.empty() && mine != saved.type)
    throw io_error(cat(source, ": it holds ", saved.type, " optimizer state; this optimizer is ", mine));
}
// ... keeping the same buffers (with the source's hyperparameters: amsgrad adds one).
template <class O>
void check_buffers(O& opt, const checkpoint_optimizer& saved, std::string_view source) {
  const auto names = buffer_names(opt);
  std::string held;
  for (const auto& n : saved.state) held += cat(held.empty() ? "" : ", ", n);
  for (const auto& n : names)
    if (std::find(saved.state.begin(), saved.state.end(), n) == saved.state.end())
      throw io_error(cat(source, ": this optimizer keeps '", n, "', which it lacks (it holds ",
                         held.empty() ? "no buffers" : held, ")"));
  for (const auto& n : saved.state)
    if (std::find(names.begin(), names.end(), n) == names.end())
      throw io_error(cat(source, ": it holds optimizer state '", n, "', which this optimizer does not keep"));
}

// New master shards and optimizer states for this rank, their pieces requested from
// src (they arrive at src.finish()); the model is untouched until all ranks have them.
template <class M, class C, class S, class Source>
std::vector<Buffer<float>> request_masters(model_t<M, C, S>& model, Source& src) {
  std::vector<Buffer<float>> out;
  for (std::size_t i = 0; i < model.units().size(); ++i) {
    const auto& u = model.units()[i];
    Buffer<float> b(u.master->local().size(), category::parameters);
    request_range(u.layout.entries, src, "master", master_begin(model, i), b.span());
    out.push_back(std::move(b));
  }
  return out;
}
template <class M, class C, class S, class Source, class O>
std::vector<typename O::state> request_states(model_t<M, C, S>& model, Source& src, O& maker, std::int64_t step) {
  std::vector<typename O::state> out;
  for (std::size_t i = 0; i < model.units().size(); ++i) {
    auto st = maker.make_state(std::size_t(state_size(model, i)));
    st.step = step;
    st.for_each_buffer([&](std::string_view name, Buffer<float>& b) {
      request_range(model.units()[i].layout.entries, src, name, state_begin(model, i), b.span());
    });
    out.push_back(std::move(st));
  }
  return out;
}

// Loads parameters (and, with an optimizer recorded, its state) from src on every rank.
// Reading and every check happen first; the model and optimizer change only after all
// ranks succeeded, so a failed load loses nothing.
struct no_optimizer {
  struct state {};
};

// `what` already names the source in every message.
inline std::string_view src_name(const checkpoint_reader&) { return "the checkpoint"; }
inline std::string_view src_name(const safetensors_source&) { return "the safetensors file"; }

template <class M, class C, class S, class Source, class O>
void load_from(model_t<M, C, S>& model, Source& src, O* opt, const std::optional<checkpoint_optimizer>& saved,
               std::string_view what) {
  std::vector<Buffer<float>> masters;
  std::vector<typename O::state> states;
  std::optional<O> restored;  // a copy of opt with the source's hyperparameters (known optimizers)
  on_all_ranks(model.comm(), what, [&] {
    if constexpr (!std::is_same_v<O, no_optimizer>) {
      if (opt && saved) {
        check_optimizer_type<O>(*saved, src_name(src));
        if constexpr (known_optimizer<O>) {
          restored.emplace(*opt);
          restore_hyperparameters(*restored, saved->hyperparameters, src_name(src));
        }
        O& maker = restored ? *restored : *opt;
        check_buffers(maker, *saved, src_name(src));
        states = request_states(model, src, maker, saved->step);
      }
    }
    masters = request_masters(model, src);
    src.finish();  // the buffers' storage stays put as they move into the vectors
  });
  for (std::size_t i = 0; i < masters.size(); ++i) model.load_master(i, masters[i].span());
  if constexpr (!std::is_same_v<O, no_optimizer>)
    for (std::size_t i = 0; i < states.size(); ++i) model.optimizer_state(*opt, i) = std::move(states[i]);
  if constexpr (known_optimizer<O>)
    if (restored) *opt = *restored;
}

// The unit's whole flat vector of one kind, from this rank's piece of it: gathered
// (into holder) when the piece is a shard, else the piece itself.
template <class Comm>
std::span<const float> gather_into(Comm& group, std::span<const float> piece, Buffer<float>& holder) {
  holder.reset();  // first: never two units gathered at once
  holder = Buffer<float>(piece.size() * std::size_t(group.size()), category::gathered_parameters);
  group.all_gather(piece, holder.span());
  return holder.span();
}
template <class M, class C, class S>
std::span<const float> whole(model_t<M, C, S>& model, [[maybe_unused]] bool is_state, std::span<const float> piece,
                             [[maybe_unused]] Buffer<float>& holder) {
  if constexpr (S::shards_parameters) return gather_into(model.shard_group(), piece, holder);
  else if constexpr (std::is_same_v<S, shard::ShardOptimizer>)
    return is_state ? gather_into(model.comm(), piece, holder) : piece;
  else return piece;
}

// This rank's buffers of unit i's optimizer state, by name.
template <class State>
std::map<std::string, std::span<const float>, std::less<>> buffers_of(State& st) {
  std::map<std::string, std::span<const float>, std::less<>> out;
  st.for_each_buffer([&](std::string_view n, Buffer<float>& b) { out.emplace(n, b.span()); });
  return out;
}

template <class M, class C, class S, class O>
void export_impl(const std::filesystem::path& file, model_t<M, C, S>& model, O* opt) {
  auto& comm = model.comm();
  const bool root = comm.rank() == 0;
  const std::string what = cat("exporting to ", file.string());
  consolidated_info info{model.steps(), std::nullopt, model.scaler(), nlohmann::json::object()};
  std::vector<std::string> kinds;
  if constexpr (!std::is_same_v<O, no_optimizer>) {
    kinds = buffer_names(*opt);
    info.optimizer = checkpoint_optimizer{optimizer_name<O>(), model.optimizer_state(*opt, 0).step, kinds,
                                          hyperparameters_of(*opt)};
  }
  std::vector<std::vector<nn::flat_entry>> layouts;
  for (const auto& u : model.units()) layouts.push_back(u.layout.entries);
  std::optional<safetensors_stream_writer> out;
  on_all_ranks(comm, what, [&] {
    if (root) out.emplace(file, consolidated_tensors(layouts, kinds), consolidated_metadata(info));
  });
  // One unit at a time: no rank ever holds more than one unit gathered.
  auto write_unit = [&](std::size_t i, std::string_view kind, std::span<const float> values) {
    on_all_ranks(comm, what, [&] {
      if (!root) return;
      for (const auto& e : model.units()[i].layout.entries)
        out->write(kind == "master" ? e.name : optimizer_tensor(e.name, kind),
                   std::as_bytes(values.subspan(e.offset, e.numel())));
    });
  };
  for (std::size_t i = 0; i < model.units().size(); ++i) {
    if (model.units()[i].layout.entries.empty()) continue;  // a unit whose children claimed every parameter
    Buffer<float> holder;
    write_unit(i, "master", whole(model, false, model.units()[i].master->local(), holder));
    if constexpr (!std::is_same_v<O, no_optimizer>) {
      const auto buffers = buffers_of(model.optimizer_state(*opt, i));
      for (const auto& k : kinds) {
        const auto b = buffers.find(k);
        require(b != buffers.end(), "rank ", comm.rank(), ": unit ", i, " has no optimizer buffer '", k, "'");
        write_unit(i, k, whole(model, true, b->second, holder));
      }
    }
  }
  on_all_ranks(comm, what, [&] {
    if (root) out->finish();
  });
}

template <class M, class C, class S, class O>
void load_safetensors_impl(const std::filesystem::path& file, model_t<M, C, S>& model, O* opt) {
  const std::string what = cat("loading ", file.string());
  std::optional<safetensors_source> src;
  std::optional<checkpoint_optimizer> saved;
  on_all_ranks(model.comm(), what, [&] {
    src.emplace(file);
    const std::string_view source = src_name(*src);
    check_parameters(model.units(), src->parameters(), source);
    if (!opt) return;
    if (!src->info() || !src->info()->optimizer)
      throw io_error(cat(source, ": it holds no optimizer state (export it with export_safetensors(file, model, opt) "
                                 "or shardlib-ckpt to-safetensors --optimizer)"));
    saved = src->info()->optimizer;
    for (const auto& u : model.units())
      for (const auto& e : u.layout.entries)
        for (const auto& k : saved->state) {
          const tensor_info* t = src->find(optimizer_tensor(e.name, k));
          if (!t || t->shape != e.shape)
            throw io_error(cat(source, ": optimizer state \"", optimizer_tensor(e.name, k), "\" is ",
                               t ? "of another shape" : "missing"));
        }
  });
  load_from(model, *src, opt, saved, what);
  if (opt) {
    model.set_steps(src->info()->steps);
    if (src->info()->scaler && model.scaler()) model.set_scaler(*src->info()->scaler);
  }
}

}  // namespace detail

// Saves model and optimizer as a sharded checkpoint root/<tag> from every rank: each
// rank that holds a distinct shard writes one file; rank 0 writes metadata.json last.
// All of it goes into root/.tmp-<tag>, and only once every rank has written and synced
// its file does rank 0 rename it into place: a failure on any rank raises io_error on
// every rank and leaves earlier checkpoints as they were. Collective; returns root/<tag>.
template <class M, class C, class S, optim::Optimizer O>
std::filesystem::path save_checkpoint(const std::filesystem::path& root, shard::ShardedModel<M, C, S, float>& model,
                                      O& opt, const save_options& o = {}) {
  auto& comm = model.comm();
  const int rank = comm.rank();
  const std::string tag = o.tag.empty() ? detail::default_tag(model.steps()) : o.tag;
  const auto final_dir = root / tag, temp = root / cat(detail::temp_prefix, tag);
  const std::string what = cat("saving checkpoint ", final_dir.string());

  checkpoint_metadata m;
  detail::on_all_ranks(comm, what, [&] {  // before any path built from the tag is touched
    if (!detail::valid_tag(tag))
      throw io_error(cat("checkpoint tag \"", tag, "\" must be 1-200 letters, digits or -_.+= not starting with '.'"));
    if (o.chunk_bytes < detail::min_chunk_bytes || o.chunk_bytes > detail::max_chunk_bytes)
      throw io_error(cat("chunk_bytes ", o.chunk_bytes, " is outside [", detail::min_chunk_bytes, ", ",
                         detail::max_chunk_bytes, "]"));
    if (o.keep_last < 0) throw io_error(cat("keep_last ", o.keep_last, " is negative (0 keeps every checkpoint)"));
  });
  try {
    detail::on_all_ranks(comm, what, [&] {
      if (rank == 0) m.sequence = detail::prepare_save(root, temp);
    });
    m.tag = tag;
    m.world_size = comm.size();
    m.strategy = std::string(S::name);
    if constexpr (std::is_same_v<S, shard::HybridShard>) m.group_size = model.strategy().group_size;
    m.partitions = detail::partitions_of(model);
    m.param_dtype = std::string(name(model.precision().param));
    m.reduce_dtype = std::string(name(model.precision().reduce));
    m.steps = model.steps();
    m.optimizer = checkpoint_optimizer{detail::optimizer_name<O>(), model.optimizer_state(opt, 0).step,
                                       detail::buffer_names(opt), detail::hyperparameters_of(opt)};
    m.scaler = model.scaler();
    m.user = o.user;
    m.chunk_bytes = o.chunk_bytes;
    for (const auto& u : model.units()) {
      checkpoint_unit cu{u.name, u.numel(), {}};
      for (const auto& e : u.layout.entries) cu.params.push_back({e.name, e.shape, e.offset});
      m.units.push_back(std::move(cu));
    }

    // This rank's shard file: every element it writes lies in its local buffers.
    const int part = detail::written_partition(model);
    checkpoint_file mine;
    detail::on_all_ranks(comm, what, [&] {
      if (part < 0) return;
      std::vector<std::map<std::string, std::span<const float>, std::less<>>> buffers;
      for (std::size_t i = 0; i < model.units().size(); ++i)
        buffers.push_back(detail::buffers_of(model.optimizer_state(opt, i)));
      mine = detail::write_shard_file(
          temp, part, m, rank, o.write_hook,
          [&](std::size_t u, std::string_view kind, std::uint64_t first, std::span<float> out) {
            const bool master = kind == "master";
            const auto local = master ? model.units()[u].master->local() : buffers[u].find(kind)->second;
            const std::uint64_t begin = master ? detail::master_begin(model, u) : detail::state_begin(model, u);
            std::copy_n(local.begin() + std::ptrdiff_t(first - begin), out.size(), out.begin());
          });
    });

    // Rank 0 learns every file's size and checksums: [partition, bytes, chunk count, hashes...].
    std::vector<std::int64_t> mine_enc{part};
    if (part >= 0) {
      mine_enc.push_back(std::int64_t(mine.bytes));
      mine_enc.push_back(std::int64_t(mine.chunks.size()));
      for (auto h : mine.chunks) mine_enc.push_back(std::int64_t(h));
    }
    std::vector<std::int64_t> longest{std::int64_t(mine_enc.size())};
    comm.all_reduce(std::span<std::int64_t>(longest), shardlib::comm::reduce_op::max);
    mine_enc.resize(std::size_t(longest[0]), 0);
    std::vector<std::int64_t> all(mine_enc.size() * std::size_t(comm.size()));
    comm.all_gather(std::span<const std::int64_t>(mine_enc), std::span<std::int64_t>(all));

    detail::on_all_ranks(comm, what, [&] {
      if (rank != 0) return;
      m.files.resize(std::size_t(m.partitions));
      for (int r = 0; r < comm.size(); ++r) {
        const std::int64_t* e = all.data() + std::size_t(r) * mine_enc.size();
        if (e[0] < 0) continue;
        auto& f = m.files[std::size_t(e[0])];
        f = {detail::shard_file_name(int(e[0]), m.partitions), std::uint64_t(e[1]), {}};
        for (std::int64_t c = 0; c < e[2]; ++c) f.chunks.push_back(std::uint64_t(e[3 + c]));
      }
      detail::commit_checkpoint(temp, final_dir, m, o.write_hook);
    });
  } catch (...) {
    if (rank == 0) detail::remove_quietly(temp);
    throw;
  }
  detail::on_all_ranks(comm, cat(what, " (it is complete; removing old ones)"), [&] {
    if (rank == 0) detail::prune(root, o.keep_last);
  });
  return final_dir;
}

// Loads a checkpoint into model and optimizer on every rank, whatever world size,
// strategy or wrap policy saved it: each rank reads, by parameter name, only the byte
// ranges of its own shards. `path` is a checkpoint or a root (then its latest). The
// optimizer takes the saved state, step and hyperparameters; the model its parameters,
// step count and loss scaler. On any error every rank raises io_error and nothing
// changes. A weights-only checkpoint (from a safetensors file without optimizer state)
// leaves the optimizer state as it is. Collective.
template <class M, class C, class S, optim::Optimizer O>
load_result load_checkpoint(const std::filesystem::path& path, shard::ShardedModel<M, C, S, float>& model, O& opt) {
  auto& comm = model.comm();
  std::string resolved;
  detail::on_all_ranks(comm, cat("loading checkpoint ", path.string()), [&] {
    if (comm.rank() == 0) resolved = resolve_checkpoint(path).string();
  });
  resolved = detail::broadcast_string(comm, resolved, 0);  // every rank loads the same one
  const std::string what = cat("loading checkpoint ", resolved);
  std::optional<checkpoint_reader> reader;
  detail::on_all_ranks(comm, what, [&] {
    reader.emplace(resolved);
    detail::check_parameters(model.units(), reader->parameters(), detail::src_name(*reader));
  });
  const auto& m = reader->metadata();
  detail::load_from(model, *reader, &opt, m.optimizer, what);
  model.set_steps(m.steps);
  if (m.scaler && model.scaler()) model.set_scaler(*m.scaler);
  return {resolved, m, reader->bytes_read(), reader->files_opened()};
}

// Writes the full model under its PyTorch names to one safetensors file (rank 0 writes),
// gathering one unit at a time so that no rank holds the whole model. With an
// optimizer, also its state as optimizer.<param>.<buffer> and its step and
// hyperparameters in the metadata. Collective.
template <class M, class C, class S>
void export_safetensors(const std::filesystem::path& file, shard::ShardedModel<M, C, S, float>& model) {
  detail::export_impl<M, C, S, detail::no_optimizer>(file, model, nullptr);
}
template <class M, class C, class S, optim::Optimizer O>
void export_safetensors(const std::filesystem::path& file, shard::ShardedModel<M, C, S, float>& model, O& opt) {
  detail::export_impl(file, model, &opt);
}

// Initialises a sharded model from a safetensors file with its parameter names (one
// exported above, or by PyTorch; F32, F64, F16 or BF16): each rank reads only its
// shards' byte ranges. Tensors named optimizer.* are ignored; any other tensor the
// model lacks, or a parameter missing or shaped differently, is an error. With an
// optimizer, its state, step and hyperparameters and the model's step count and loss
// scaler come from the file too. Collective; on error nothing changes.
template <class M, class C, class S>
void load_safetensors(const std::filesystem::path& file, shard::ShardedModel<M, C, S, float>& model) {
  detail::load_safetensors_impl<M, C, S, detail::no_optimizer>(file, model, nullptr);
}
template <class M, class C, class S, optim::Optimizer O>
void load_safetensors(const std::filesystem::path& file, shard::ShardedModel<M, C, S, float>& model, O& opt) {
  detail::load_safetensors_impl(file, model, &opt);
}

// --- without a model (the shardlib-ckpt tool) --------------------------------------------------

// Consolidates a checkpoint (or a root's latest) into one safetensors file, one
// parameter at a time, as export_safetensors would have written it. Returns the checkpoint used.
inline std::filesystem::path checkpoint_to_safetensors(const std::filesystem::path& path,
                                                       const std::filesystem::path& file, bool with_optimizer) {
  checkpoint_reader r(resolve_checkpoint(path));
  const auto& m = r.metadata();
  if (with_optimizer && !m.optimizer)
    detail::fail(r.path().string(), "holds no optimizer state to export (it was made from weights only)");
  r.open_all();
  const std::vector<std::string> kinds = with_optimizer ? m.optimizer->state : std::vector<std::string>{};
  std::vector<std::vector<checkpoint_param>> layouts;
  for (const auto& u : m.units) layouts.push_back(u.params);
  safetensors_stream_writer out(file, detail::consolidated_tensors(layouts, kinds),
                                detail::consolidated_metadata({m.steps, with_optimizer ? m.optimizer : std::nullopt,
                                                               m.scaler, m.user}));
  std::vector<float> values;
  for (const auto& u : m.units) {
    std::vector<std::string> all{"master"};
    all.insert(all.end(), kinds.begin(), kinds.end());
    for (const auto& k : all)
      for (const auto& p : u.params) {
        values.resize(std::size_t(p.numel()));
        r.read(p.name, k, 0, values);
        out.write(k == "master" ? p.name : detail::optimizer_tensor(p.name, k),
                  std::as_bytes(std::span<const float>(values)));
      }
  }
  out.finish();
  return r.path();
}

struct convert_options {
  int world = 1;
  std::string strategy = "FullShard";
  int group_size = 0;  // HybridShard only
  std::string tag{};   // "step-<steps>" when empty
  std::uint64_t chunk_bytes = default_chunk_bytes;
};

// Makes a sharded checkpoint root/<tag> for `world` ranks and `strategy` from a
// safetensors file (F32, F64, F16 or BF16 tensors; with this library's optimizer
// tensors and metadata, the optimizer state too). Every tensor becomes a parameter of
// one unit: a resharding load maps by name, so any model with these names and shapes
// loads it, whatever its units. Atomic like save_checkpoint. Returns root/<tag>.
inline std::filesystem::path safetensors_to_checkpoint(const std::filesystem::path& file,
                                                       const std::filesystem::path& root,
                                                       const convert_options& o) {
  safetensors_source src(file);
  checkpoint_metadata m;
  m.world_size = o.world;
  m.strategy = o.strategy;
  m.group_size = o.strategy == "HybridShard" ? o.group_size : 0;
  m.partitions = checkpoint_partitions(o.strategy, o.world, m.group_size);
  if (o.chunk_bytes < detail::min_chunk_bytes || o.chunk_bytes > detail::max_chunk_bytes)
    throw io_error(cat("chunk_bytes ", o.chunk_bytes, " is outside [", detail::min_chunk_bytes, ", ",
                       detail::max_chunk_bytes, "]"));
  m.chunk_bytes = o.chunk_bytes;
  checkpoint_unit unit{"", 0, {}};
  for (auto& [name, shape] : src.parameters()) {
    unit.numel = (unit.numel + detail::align - 1) / detail::align * detail::align;
    unit.params.push_back({name, shape, unit.numel});
    unit.numel += std::uint64_t(shape.numel());
    if (unit.numel > detail::max_numel) detail::fail(src.origin(), "holds more than ", detail::max_numel, " elements");
  }
  m.units.push_back(std::move(unit));
  if (const auto& info = src.info()) {
    m.steps = info->steps;
    m.optimizer = info->optimizer;
    m.scaler = info->scaler;
    m.user = info->user;
  }
  if (m.optimizer)
    for (const auto& p : m.units[0].params)
      for (const auto& k : m.optimizer->state)
        if (const tensor_info* t = src.find(detail::optimizer_tensor(p.name, k)); !t || t->shape != p.shape)
          detail::fail(src.origin(), "optimizer state \"", detail::optimizer_tensor(p.name, k), "\" is ",
                       t ? "of another shape than its parameter" : "missing");
  m.tag = o.tag.empty() ? detail::default_tag(m.steps) : o.tag;
  if (!detail::valid_tag(m.tag))
    throw io_error(cat("checkpoint tag \"", m.tag, "\" must be 1-200 letters, digits or -_.+= not starting with '.'"));
  const auto final_dir = root / m.tag, temp = root / cat(detail::temp_prefix, m.tag);
  m.sequence = detail::prepare_save(root, temp);
  try {
    for (int p = 0; p < m.partitions; ++p)
      m.files.push_back(detail::write_shard_file(
          temp, p, m, 0, {}, [&](std::size_t u, std::string_view kind, std::uint64_t first, std::span<float> out) {
            detail::request_range(m.units[u].params, src, kind, first, out);
            src.finish();
          }));
    detail::commit_checkpoint(temp, final_dir, m, {});
  } catch (...) {
    detail::remove_quietly(temp);
    throw;
  }
  detail::prune(root, 0);
  return final_dir;
}

}  // namespace shardlib::io
