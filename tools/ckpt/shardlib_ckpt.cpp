// shardlib-ckpt — lists, verifies and converts sharded checkpoints, without the model's code:
//
//   shardlib-ckpt list PATH                 a root: its checkpoints; a checkpoint: what it holds
//   shardlib-ckpt verify PATH               reads every byte against its checksum
//   shardlib-ckpt to-safetensors PATH FILE [--optimizer]
//   shardlib-ckpt from-safetensors FILE ROOT --world W --strategy S [--group-size G] [--tag T]
//                                  [--chunk-bytes B]
//
// PATH is a checkpoint directory or a root of them (then its latest). from-safetensors
// needs no model: every tensor becomes a parameter of one unit, and a load maps
// parameters by name, so any model with those names and shapes loads the result.
#include <shardlib/io/checkpoint.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace shardlib;
namespace fs = std::filesystem;

constexpr const char* usage =
    "usage: shardlib-ckpt list PATH\n"
    "       shardlib-ckpt verify PATH\n"
    "       shardlib-ckpt to-safetensors PATH FILE [--optimizer]\n"
    "       shardlib-ckpt from-safetensors FILE ROOT --world W --strategy S [--group-size G] [--tag T]\n"
    "                                      [--chunk-bytes B]\n"
    "PATH: a checkpoint directory, or a root holding several (its latest is used).\n"
    "S: FullShard, ShardGradOp, ShardOptimizer, NoShard or HybridShard (with --group-size).\n";

[[noreturn]] void bad_usage(const std::string& why) {
  std::fprintf(stderr, "shardlib-ckpt: %s\n%s", why.c_str(), usage);
  std::exit(2);
}

std::string describe_strategy(const io::checkpoint_metadata& m) {
  return m.strategy == "HybridShard" ? cat(m.strategy, " (groups of ", m.group_size, ")") : m.strategy;
}

void list_root(const fs::path& root, const std::vector<io::checkpoint_entry>& entries) {
  std::printf("root %s: %zu checkpoint%s, oldest first\n", root.c_str(), entries.size(), entries.size() == 1 ? "" : "s");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    if (!e.metadata) {
      std::printf("  %s  UNREADABLE: %s\n", e.path.filename().c_str(), e.error.c_str());
      continue;
    }
    const auto& m = *e.metadata;
    std::printf("  %-20s save #%llu  steps %llu  %d ranks %s%s\n", e.path.filename().c_str(),
                static_cast<unsigned long long>(m.sequence), static_cast<unsigned long long>(m.steps), m.world_size,
                describe_strategy(m).c_str(), i + 1 == entries.size() ? "  (latest)" : "");
  }
}

void list_checkpoint(const fs::path& dir) {
  const auto m = io::read_checkpoint_metadata(dir);
  std::uint64_t bytes = 0;
  for (const auto& f : m.files) bytes += f.bytes;
  std::printf("checkpoint %s (format version %d, save #%llu)\n", dir.c_str(), m.version,
              static_cast<unsigned long long>(m.sequence));
  std::printf("  saved by %d ranks with %s: %d shard file%s, %llu bytes, a checksum per %llu bytes\n", m.world_size,
              describe_strategy(m).c_str(), m.partitions, m.partitions == 1 ? "" : "s",
              static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(m.chunk_bytes));
  std::printf("  precision: param %s, reduce %s, master F32; steps %llu\n", m.param_dtype.c_str(),
              m.reduce_dtype.c_str(), static_cast<unsigned long long>(m.steps));
  if (m.optimizer) {
    std::string state;
    for (const auto& s : m.optimizer->state) state += cat(state.empty() ? "" : ", ", s);
    std::printf("  optimizer %s at step %lld: state %s; %s\n",
                m.optimizer->type.empty() ? "(unnamed)" : m.optimizer->type.c_str(),
                static_cast<long long>(m.optimizer->step), state.empty() ? "none" : state.c_str(),
                m.optimizer->hyperparameters.dump().c_str());
  } else {
    std::printf("  no optimizer state (weights only)\n");
  }
  if (m.scaler)
    std::printf("  loss scaler: scale %g, %d good steps, %ld skipped\n", double(m.scaler->scale), m.scaler->good_steps,
                m.scaler->skipped);
  std::printf("  user: %s\n", m.user.dump().c_str());
  std::printf("  %zu units:\n", m.units.size());
  for (std::size_t u = 0; u < m.units.size(); ++u) {
    const auto& unit = m.units[u];
    std::printf("    unit %zu '%s': %zu parameters, %llu elements, %llu per shard file\n", u, unit.name.c_str(),
                unit.params.size(), static_cast<unsigned long long>(unit.numel),
                static_cast<unsigned long long>(m.shard_numel(unit)));
    for (const auto& p : unit.params)
      std::printf("      %-28s %-14s offset %llu\n", p.name.c_str(), cat(p.shape).c_str(),
                  static_cast<unsigned long long>(p.offset));
  }
  std::printf("  files:\n");
  for (const auto& f : m.files)
    std::printf("    %s  %llu bytes, %zu checksum%s\n", f.name.c_str(), static_cast<unsigned long long>(f.bytes),
                f.chunks.size(), f.chunks.size() == 1 ? "" : "s");
}

int run(const std::vector<std::string_view>& args) {
  if (args.empty()) bad_usage("no command");
  const auto command = args[0];
  if (command == "list" && args.size() == 2) {
    const fs::path path(args[1]);
    if (io::resolve_checkpoint(path) == path) list_checkpoint(path);  // a checkpoint, not a root
    else list_root(path, io::list_checkpoints(path));
    return 0;
  }
  if (command == "verify" && args.size() == 2) {
    const auto dir = io::resolve_checkpoint(fs::path(args[1]));
    const auto problems = io::verify_checkpoint(dir);
    for (const auto& p : problems) std::printf("CORRUPT %s\n", p.c_str());
    if (!problems.empty()) return 1;
    const auto m = io::read_checkpoint_metadata(dir);
    std::uint64_t bytes = 0, chunks = 0;
    for (const auto& f : m.files) {
      bytes += f.bytes;
      chunks += f.chunks.size();
    }
    std::printf("OK %s: metadata and %zu shard files, %llu bytes in %llu checksummed chunks\n", dir.c_str(),
                m.files.size(), static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(chunks));
    return 0;
  }
  if (command == "to-safetensors" && (args.size() == 3 || (args.size() == 4 && args[3] == "--optimizer"))) {
    const bool with_optimizer = args.size() == 4;
    const auto used = io::checkpoint_to_safetensors(fs::path(args[1]), fs::path(args[2]), with_optimizer);
    std::printf("wrote %s from %s (%s)\n", std::string(args[2]).c_str(), used.c_str(),
                with_optimizer ? "parameters and optimizer state" : "parameters");
    return 0;
  }
  if (command == "from-safetensors" && args.size() >= 3) {
    io::convert_options o{.strategy = ""};
    for (std::size_t i = 3; i < args.size(); i += 2) {
      if (i + 1 >= args.size()) bad_usage(cat("missing value after ", args[i]));
      const std::string value(args[i + 1]);
      if (args[i] == "--world") o.world = std::atoi(value.c_str());
      else if (args[i] == "--strategy") o.strategy = value;
      else if (args[i] == "--group-size") o.group_size = std::atoi(value.c_str());
      else if (args[i] == "--tag") o.tag = value;
      else if (args[i] == "--chunk-bytes") o.chunk_bytes = std::strtoull(value.c_str(), nullptr, 10);
      else bad_usage(cat("unknown option ", args[i]));
    }
    if (o.strategy.empty()) bad_usage("from-safetensors needs --strategy");
    const auto dir = io::safetensors_to_checkpoint(fs::path(args[1]), fs::path(args[2]), o);
    const auto m = io::read_checkpoint_metadata(dir);
    std::printf("wrote %s: %d shard file%s for %d ranks with %s, steps %llu, %s\n", dir.c_str(), m.partitions,
                m.partitions == 1 ? "" : "s", m.world_size, describe_strategy(m).c_str(),
                static_cast<unsigned long long>(m.steps), m.optimizer ? "with optimizer state" : "weights only");
    return 0;
  }
  bad_usage(cat("cannot parse the arguments of '", command, "'"));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (!args.empty() && (args[0] == "-h" || args[0] == "--help")) {
    std::fputs(usage, stdout);
    return 0;
  }
  try {
    return run(args);
  } catch (const shardlib::error& e) {
    std::fprintf(stderr, "shardlib-ckpt: %s\n", e.what());
    return 1;
  }
}
