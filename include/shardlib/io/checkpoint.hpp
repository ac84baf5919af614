// shardlib/io/checkpoint.hpp — sharded checkpoints: an atomic save from every rank, a load
// at any world size and strategy that reads only the byte ranges each rank needs,
// consolidation to one safetensors file and back, and checksum verification.
//
// This header holds the entry points that take a model (save_checkpoint, load_checkpoint,
// export_safetensors, load_safetensors) and includes the parts:
//   checkpoint_format.hpp       metadata.json: its records, text, checksum and checked parsing
//   checkpoint_directory.hpp    a checkpoint's metadata, the checkpoints under a root, the latest
//   checkpoint_writer.hpp       shard files in hashed chunks, the atomic rename, keep_last
//   checkpoint_reader.hpp       checksum-verified reading by range, verify_checkpoint
//   consolidated_file.hpp       one safetensors file holding a model: its metadata, safetensors_source
//   optimizer_record.hpp        an optimizer's name, hyperparameters and buffers; ranks save the same one
//   rank_agreement.hpp          on_all_ranks: every rank fails together
//   reshard.hpp                 which ranks read which ranges, and the load on every rank
//   checkpoint_safetensors.hpp  export and import of one safetensors file, with a model or without
//   sharded_state.hpp           state dicts in memory (sharded or full); a save writes their pieces
//   staging.hpp                 values in device memory to and from the host through pinned
//                               staging buffers; io's own collectives over any communicator
//
// The format, the guarantees and the resharding algorithm: docs/checkpoints.md.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"          // reduce_op
#include "shardlib/core/element.hpp"               // name
#include "shardlib/core/error.hpp"                 // io_error, cat
#include "shardlib/io/checkpoint_directory.hpp"    // list_checkpoints, resolve_checkpoint
#include "shardlib/io/checkpoint_format.hpp"       // checkpoint_metadata, default_chunk_bytes, detail::valid_tag, ...
#include "shardlib/io/checkpoint_reader.hpp"       // checkpoint_reader, verify_checkpoint
#include "shardlib/io/checkpoint_safetensors.hpp"  // detail::export_impl, load_safetensors_impl, ...
#include "shardlib/io/checkpoint_writer.hpp"       // write_callback, detail::prepare_save, write_shard_file, ...
#include "shardlib/io/consolidated_file.hpp"       // consolidated_info, safetensors_source
#include "shardlib/io/optimizer_record.hpp"        // detail::optimizer_name, buffer_names, check_same_optimizer, ...
#include "shardlib/io/rank_agreement.hpp"          // detail::on_all_ranks, broadcast_string
#include "shardlib/io/reshard.hpp"                 // detail::load_from, request_range, check_parameters, ...
#include "shardlib/io/sharded_state.hpp"           // get_model_state, get_optimizer_state, detail::offered_pieces
#include "shardlib/io/staging.hpp"                 // host_collectives_of
#include "shardlib/shard/sharded_model.hpp"        // ShardedModel
#include "shardlib/shard/strategy.hpp"             // HybridShard

#include <nlohmann/json.hpp>  // nlohmann::json

#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint64_t, std::int64_t
#include <filesystem>   // std::filesystem
#include <optional>     // std::optional
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v
#include <utility>      // std::move
#include <vector>       // std::vector

namespace shardlib::io {

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

namespace detail {
// What every rank must pass alike to one save: rank 0 writes the metadata with its own
// chunk size, user fields, tag and keep_last, so another rank's would leave files the
// metadata does not describe (checksums per chunk), or be dropped unsaid.
// Compared as the text the metadata would hold (infinities and NaN as null, bytes that
// are not UTF-8 replaced), which no rank fails to make: a rank raising here alone would
// leave the others in the broadcast.
template <class Comm>
void check_same_save_options(Comm& comm, const std::string& tag, std::uint64_t chunk_bytes, int keep_last,
                             const nlohmann::json& user, std::string_view what) {
  const auto text = [](const nlohmann::json& j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  const nlohmann::json ours{{"tag", tag}, {"chunk_bytes", chunk_bytes}, {"keep_last", keep_last}, {"user", user}};
  const nlohmann::json first = nlohmann::json::parse(broadcast_string(comm, text(ours), 0));
  on_all_ranks(comm, what, [&] {
    for (const char* key : {"tag", "chunk_bytes", "keep_last", "user"})
      if (text(ours[key]) != text(first[key]))
        throw io_error(cat("ranks 0 and ", comm.rank(), " pass different save options, which one checkpoint cannot ",
                           "follow: ", key, " ", text(first[key]), " on rank 0, ", text(ours[key]), " on rank ",
                           comm.rank()));
  });
}
}  // namespace detail

// Saves model and optimizer as a sharded checkpoint root/<tag> from every rank: each
// rank that holds a distinct shard writes one file; rank 0 writes metadata.json last.
// All of it goes into root/.tmp-<tag>, and only once every rank has written and synced
// its file does rank 0 rename it into place: a failure on any rank raises io_error on
// every rank and leaves earlier checkpoints as they were. Collective; returns root/<tag>.
template <class M, class C, class S, SavableOptimizer O>
std::filesystem::path save_checkpoint(const std::filesystem::path& root, shard::ShardedModel<M, C, S, float, O>& model,
                                      O& opt, const save_options& o = {}) {
  auto comm = detail::host_collectives_of(model);  // io's own collectives, staged where the model's need it
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
  detail::check_same_save_options(comm, tag, o.chunk_bytes, o.keep_last, o.user, what);
  try {
    detail::on_all_ranks(comm, what, [&] {
      if (rank == 0) m.sequence = detail::prepare_save(final_dir, temp);
    });
    m.tag = tag;
    m.world_size = comm.size();
    m.strategy = std::string(model.strategy().name);
    m.group_size = model.policy().group_size;
    m.partitions = model.partitions();
    m.param_dtype = std::string(name(model.precision().param));
    m.reduce_dtype = std::string(name(model.precision().reduce));
    m.steps = model.steps();
    // What this rank holds, as the in-memory sharded state dict: its file holds these pieces.
    model_state_dict params;
    optim_state_dict state;
    detail::on_all_ranks(comm, what, [&] {
      params = get_model_state(model);
      state = get_optimizer_state(model, opt);
    });
    m.optimizer = state.record;
    detail::check_same_optimizer(comm, *m.optimizer, what);
    m.scaler = model.scaler();
    m.user = o.user;
    m.chunk_bytes = o.chunk_bytes;
    for (std::size_t i = 0; i < model.unit_count(); ++i) {
      const auto& l = model.unit_layout(i);
      checkpoint_unit cu{model.unit_name(i), l.numel, {}};
      for (const auto& e : l.entries) cu.params.push_back({e.name, e.shape, e.offset});
      m.units.push_back(std::move(cu));
    }

    // This rank's shard file: its partition is exactly the pieces it holds.
    const int part = model.written_partition();
    checkpoint_file mine;
    detail::on_all_ranks(comm, what, [&] {
      if (part < 0) return;
      const detail::offered_pieces src(std::span(&params, 1), std::span(&state, 1));
      mine = detail::write_shard_file(
          temp, part, m, rank, o.write_hook,
          [&](std::size_t u, std::string_view kind, std::uint64_t first, std::span<float> out) {
            detail::request_range(m.units[u].params, src, kind, first, out);
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
template <class M, class C, class S, SavableOptimizer O>
load_result load_checkpoint(const std::filesystem::path& path, shard::ShardedModel<M, C, S, float, O>& model, O& opt) {
  auto comm = detail::host_collectives_of(model);
  std::string resolved;
  detail::on_all_ranks(comm, cat("loading checkpoint ", path.string()), [&] {
    if (comm.rank() == 0) resolved = resolve_checkpoint(path).string();
  });
  resolved = detail::broadcast_string(comm, resolved, 0);  // every rank loads the same one
  const std::string what = cat("loading checkpoint ", resolved);
  std::optional<checkpoint_reader> reader;
  detail::on_all_ranks(comm, what, [&] {
    reader.emplace(resolved);
    detail::check_parameters(model, reader->parameters(), detail::src_name(*reader));
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
template <class M, class C, class S, class O>
void export_safetensors(const std::filesystem::path& file, shard::ShardedModel<M, C, S, float, O>& model) {
  detail::export_impl<shard::ShardedModel<M, C, S, float, O>, detail::no_optimizer>(file, model, nullptr);
}
template <class M, class C, class S, SavableOptimizer O>
void export_safetensors(const std::filesystem::path& file, shard::ShardedModel<M, C, S, float, O>& model, O& opt) {
  detail::export_impl(file, model, &opt);
}

// Initialises a sharded model from a safetensors file with its parameter names (one
// exported above, or by PyTorch; F32, F64, F16 or BF16): each rank reads only its
// shards' byte ranges. Tensors named optimizer.* are ignored; any other tensor the
// model lacks, or a parameter missing or shaped differently, is an error. With an
// optimizer, its state, step and hyperparameters and the model's step count and loss
// scaler come from the file too. Collective; on error nothing changes.
template <class M, class C, class S, class O>
void load_safetensors(const std::filesystem::path& file, shard::ShardedModel<M, C, S, float, O>& model) {
  detail::load_safetensors_impl<shard::ShardedModel<M, C, S, float, O>, detail::no_optimizer>(file, model, nullptr);
}
template <class M, class C, class S, SavableOptimizer O>
void load_safetensors(const std::filesystem::path& file, shard::ShardedModel<M, C, S, float, O>& model, O& opt) {
  detail::load_safetensors_impl(file, model, &opt);
}

}  // namespace shardlib::io
