// shardlib-ckpt — lists, verifies and converts sharded checkpoints, without the model's code:
//
//   shardlib-ckpt list PATH                 a root: its checkpoints; a checkpoint: what it holds
//   shardlib-ckpt verify PATH               reads every byte against its checksum
//   shardlib-ckpt to-safetensors PATH FILE [--optimizer]
//   shardlib-ckpt from-safetensors FILE ROOT --world W --strategy S [--group-size G] [--tag T]
//                                  [--chunk-bytes B]
//   shardlib-ckpt merge-peft BASE ADAPTER OUT   a Hugging Face GPT-2 or LLaMA with a PEFT LoRA
//                                  adapter merged into it (models::merge_peft)
//   shardlib-ckpt from-llmc FILE OUT     llm.c's GPT-2 checkpoint as a Hugging Face one
//   shardlib-ckpt to-llmc DIR FILE [--bf16]   a Hugging Face GPT-2 as llm.c's checkpoint
//                                  (models/llmc.hpp)
//
// PATH is a checkpoint directory or a root of them (then its latest). from-safetensors
// needs no model: every tensor becomes a parameter of one unit, and a load maps
// parameters by name, so any model with those names and shapes loads the result.
#include <shardlib/io/checkpoint.hpp>
#include <shardlib/models/llmc.hpp>
#include <shardlib/models/peft.hpp>

#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "common/flags.hpp"

namespace {

using namespace shardlib;
namespace fs = std::filesystem;

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

// A command's operands and options, as parsed.
struct operands {
  std::string path, file, out;  // merge-peft: BASE, ADAPTER, OUT
  bool with_optimizer = false;
  bool bf16 = false;  // to-llmc
  io::convert_options convert{.strategy = ""};
};

int run(const std::string& command, const operands& a) {
  if (command == "list") {
    const fs::path path(a.path);
    if (io::resolve_checkpoint(path) == path) list_checkpoint(path);  // a checkpoint, not a root
    else list_root(path, io::list_checkpoints(path));
    return 0;
  }
  if (command == "verify") {
    const auto dir = io::resolve_checkpoint(fs::path(a.path));
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
  if (command == "merge-peft") {
    models::merge_peft(fs::path(a.path), fs::path(a.file), fs::path(a.out));
    std::printf("wrote %s: %s with the adapter %s merged into it\n", a.out.c_str(), a.path.c_str(), a.file.c_str());
    return 0;
  }
  if (command == "from-llmc") {
    const auto h = models::read_llmc_header(fs::path(a.file));
    models::llmc_to_hf(fs::path(a.file), fs::path(a.out));
    std::printf("wrote %s: llm.c's %s GPT-2 (%lld layers, n_embd %lld, vocabulary %lld, its padding to %lld left out) "
                "as a Hugging Face checkpoint\n",
                a.out.c_str(), std::string(name(h.type)).c_str(), static_cast<long long>(h.config.n_layer),
                static_cast<long long>(h.config.n_embd), static_cast<long long>(h.config.vocab_size),
                static_cast<long long>(h.padded_vocab));
    return 0;
  }
  if (command == "to-llmc") {
    models::hf_to_llmc(fs::path(a.path), fs::path(a.file), a.bf16 ? dtype::bf16 : dtype::f32);
    const auto h = models::read_llmc_header(fs::path(a.file));
    std::printf("wrote %s: %s as llm.c's checkpoint, version %d (%s), vocabulary %lld padded to %lld\n",
                a.file.c_str(), a.path.c_str(), a.bf16 ? 5 : 3, std::string(name(h.type)).c_str(),
                static_cast<long long>(h.config.vocab_size), static_cast<long long>(h.padded_vocab));
    return 0;
  }
  if (command == "to-safetensors") {
    const auto used = io::checkpoint_to_safetensors(fs::path(a.path), fs::path(a.file), a.with_optimizer);
    std::printf("wrote %s from %s (%s)\n", a.file.c_str(), used.c_str(),
                a.with_optimizer ? "parameters and optimizer state" : "parameters");
    return 0;
  }
  std::set<fs::path> before;  // what ROOT held: --force may replace one of them
  std::error_code ec;
  for (fs::directory_iterator it(a.path, ec), end; !ec && it != end; it.increment(ec)) before.insert(it->path());
  const auto dir = io::safetensors_to_checkpoint(fs::path(a.file), fs::path(a.path), a.convert);  // from-safetensors
  const auto m = io::read_checkpoint_metadata(dir);
  std::printf("%s %s: %d shard file%s for %d ranks with %s, steps %llu, %s\n",
              before.contains(dir) ? "replaced" : "wrote", dir.c_str(), m.partitions,
              m.partitions == 1 ? "" : "s", m.world_size, describe_strategy(m).c_str(),
              static_cast<unsigned long long>(m.steps), m.optimizer ? "with optimizer state" : "weights only");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  operands a;
  io::convert_options& o = a.convert;
  example::command_line cli("Lists, verifies and converts sharded checkpoints, without the model's code; merges a "
                            "PEFT LoRA adapter into a Hugging Face GPT-2 or LLaMA; converts llm.c's GPT-2 "
                            "checkpoints to and from Hugging Face's.",
                            "shardlib-ckpt");
  cli.footer("PATH: a checkpoint directory, or a root holding several (its latest is used).");
  // At most one command: an unknown word is then named as not expected before the callback asks for one.
  cli.require_subcommand(0, 1);
  cli.callback([&] {
    if (cli.get_subcommands().empty())
      throw CLI::RequiredError(
          "a command (list, verify, to-safetensors, from-safetensors, merge-peft, from-llmc, to-llmc)");
  });
  auto* list = cli.add_subcommand("list", "a root: its checkpoints; a checkpoint: what it holds");
  list->add_option("PATH", a.path)->required();
  auto* verify = cli.add_subcommand("verify", "reads every byte against its checksum");
  verify->add_option("PATH", a.path)->required();
  auto* to = cli.add_subcommand("to-safetensors", "the consolidated parameters as one safetensors FILE");
  to->add_option("PATH", a.path)->required();
  to->add_option("FILE", a.file)->required();
  to->add_flag("--optimizer", a.with_optimizer, "the optimizer state too");
  auto* merge = cli.add_subcommand("merge-peft", "a Hugging Face GPT-2 or LLaMA (BASE) with a PEFT LoRA ADAPTER "
                                   "merged into it, saved to OUT as save_pretrained saves one");
  merge->add_option("BASE", a.path)->required()->check(CLI::ExistingDirectory);
  merge->add_option("ADAPTER", a.file)->required()->check(CLI::ExistingDirectory);
  merge->add_option("OUT", a.out)->required();
  auto* from_llmc = cli.add_subcommand("from-llmc", "llm.c's GPT-2 checkpoint FILE (train_gpt2's .bin) as a Hugging "
                                       "Face checkpoint in OUT");
  from_llmc->add_option("FILE", a.file)->required()->check(CLI::ExistingFile);
  from_llmc->add_option("OUT", a.out)->required();
  auto* to_llmc = cli.add_subcommand("to-llmc", "the Hugging Face GPT-2 in DIR as llm.c's checkpoint FILE");
  to_llmc->add_option("DIR", a.path)->required()->check(CLI::ExistingDirectory);
  to_llmc->add_option("FILE", a.file)->required();
  to_llmc->add_flag("--bf16", a.bf16, "every tensor in bf16 (llm.c's version 5), not fp32 (version 3)");
  auto* from = cli.add_subcommand("from-safetensors", "a checkpoint under ROOT from a safetensors FILE");
  from->add_option("FILE", a.file)->required();
  from->add_option("ROOT", a.path)->required();
  // As many ranks as a checkpoint's metadata may claim (io/checkpoint_format.hpp).
  from->add_option("--world", o.world, "ranks the checkpoint is for")->check(example::whole(1, 1 << 24));
  from->add_option("--strategy", o.strategy, "the sharding strategy it is for")
      ->required()
      ->check(CLI::IsMember({"FullShard", "ShardGradOp", "ShardOptimizer", "NoShard", "HybridShard"}));
  from->add_option("--group-size", o.group_size, "HybridShard: ranks one replica is sharded over (divides --world)")
      ->check(example::whole(1, 1 << 24))
      ->default_str("");
  from->add_option("--tag", o.tag, "the checkpoint's directory name (default: step-<steps>)");
  from->add_flag("--force", o.replace, "replace a checkpoint of the same tag under ROOT");
  from->add_option("--chunk-bytes", o.chunk_bytes, "bytes per checksum")
      ->check(example::whole(io::detail::min_chunk_bytes, io::detail::max_chunk_bytes));
  from->callback([&] {
    if (o.strategy == "HybridShard" && (o.group_size < 1 || o.world % o.group_size != 0))
      throw CLI::ValidationError("--group-size", cat("HybridShard needs one that divides --world ", o.world, ", got ",
                                                     o.group_size));
  });
  cli.parse_or_exit(argc, argv);
  try {
    return run(cli.get_subcommands().front()->get_name(), a);
  } catch (const shardlib::error& e) {
    std::fprintf(stderr, "shardlib-ckpt: %s\n", e.what());
    return 1;
  }
}
