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

#include <atomic>       // std::atomic
#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint64_t, std::int64_t
#include <exception>    // std::exception_ptr, std::current_exception, std::rethrow_exception
#include <filesystem>   // std::filesystem
#include <functional>   // std::ref
#include <memory>       // std::unique_ptr, std::make_unique
#include <optional>     // std::optional
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <thread>       // std::thread
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
// Compared as compared_text.
template <class Comm>
void check_same_save_options(Comm& comm, const std::string& tag, std::uint64_t chunk_bytes, int keep_last,
                             const nlohmann::json& user, std::string_view what) {
  const nlohmann::json ours{{"tag", tag}, {"chunk_bytes", chunk_bytes}, {"keep_last", keep_last}, {"user", user}};
  const nlohmann::json first = nlohmann::json::parse(broadcast_string(comm, compared_text(ours), 0));
  on_all_ranks(comm, what, [&] {
    for (const char* key : {"tag", "chunk_bytes", "keep_last", "user"})
      if (compared_text(ours[key]) != compared_text(first[key]))
        throw io_error(cat("ranks 0 and ", comm.rank(), " pass different save options, which one checkpoint cannot ",
                           "follow: ", key, " ", compared_text(first[key]), " on rank 0, ", compared_text(ours[key]), " on rank ",
                           comm.rank()));
  });
}
}  // namespace detail

namespace detail {

// One save from its snapshot to its commit. begin_save takes the snapshot (collective);
// write_own_file writes this rank's shard file from it and touches nothing else (no
// communication, not the model: it may run on another thread while training goes on);
// finish_save agrees and commits (collective).
struct save_state {
  std::filesystem::path root, final_dir, temp;
  std::string what;
  save_options options;
  int rank = 0;
  int part = -1;          // the partition this rank writes; -1: none (another rank holds the same shard)
  bool in_background = false;  // an async save: keep_last's deletions too (detail::prune)
  temp_claim claim;       // rank 0's, from prepare_save to the end
  checkpoint_metadata m;  // rank 0's: its files are filled at the commit
  model_state_dict params;
  optim_state_dict state;
  checkpoint_file mine;
  // The file's outcome: the error (none: written) is set before the flag.
  std::exception_ptr write_error;
  std::atomic<bool> written{false};
};

template <class Comm, class Engine, class O>
std::unique_ptr<save_state> begin_save(Comm& comm, const std::filesystem::path& root, Engine& model, O& opt,
                                       const save_options& o) {
  auto s = std::make_unique<save_state>();
  s->options = o;
  s->rank = comm.rank();
  const std::string tag = o.tag.empty() ? default_tag(model.steps()) : o.tag;
  s->root = root;
  s->final_dir = root / tag;
  s->temp = root / cat(temp_prefix, tag);
  s->what = cat("saving checkpoint ", s->final_dir.string());
  const std::string& what = s->what;

  on_all_ranks(comm, what, [&] {  // before any path built from the tag is touched
    if (!valid_tag(tag))
      throw io_error(cat("checkpoint tag \"", tag, "\" must be 1-200 letters, digits or -_.+= not starting with '.'"));
    if (o.chunk_bytes < min_chunk_bytes || o.chunk_bytes > max_chunk_bytes)
      throw io_error(cat("chunk_bytes ", o.chunk_bytes, " is outside [", min_chunk_bytes, ", ", max_chunk_bytes, "]"));
    if (o.keep_last < 0) throw io_error(cat("keep_last ", o.keep_last, " is negative (0 keeps every checkpoint)"));
  });
  check_same_save_options(comm, tag, o.chunk_bytes, o.keep_last, o.user, what);
  try {
    on_all_ranks(comm, what, [&] {
      if (s->rank != 0) return;
      s->claim = prepare_save(s->final_dir, s->temp);
      s->m.sequence = s->claim.sequence();
    });
    auto& m = s->m;
    m.tag = tag;
    m.world_size = comm.size();
    m.strategy = std::string(model.strategy().name);
    m.group_size = model.policy().group_size;
    m.partitions = model.partitions();
    m.param_dtype = std::string(name(model.precision().param));
    m.reduce_dtype = std::string(name(model.precision().reduce));
    m.steps = model.steps();
    // What this rank holds, as the in-memory sharded state dict: its file holds these pieces.
    on_all_ranks(comm, what, [&] {
      s->params = get_model_state(model);
      s->state = get_optimizer_state(model, opt);
    });
    m.optimizer = s->state.record;
    check_same_optimizer(comm, *m.optimizer, what);
    m.scaler = model.scaler();
    m.user = o.user;
    m.chunk_bytes = o.chunk_bytes;
    for (std::size_t i = 0; i < model.unit_count(); ++i) {
      const auto& l = model.unit_layout(i);
      checkpoint_unit cu{model.unit_name(i), l.numel, {}};
      for (const auto& e : l.entries) cu.params.push_back({e.name, e.shape, e.offset});
      m.units.push_back(std::move(cu));
    }
    s->part = model.written_partition();
  } catch (...) {
    if (s->claim.held()) remove_quietly(s->temp);  // only this save's own directory
    throw;
  }
  return s;
}

// This rank's shard file: its partition is exactly the pieces it holds. An error is kept
// for finish_save to raise on every rank; the snapshot is dropped either way.
inline void write_own_file(save_state& s) noexcept {
  try {
    if (s.part >= 0) {
      const offered_pieces src(std::span(&s.params, 1), std::span(&s.state, 1));
      s.mine = write_shard_file(s.temp, s.part, s.m, s.rank, s.options.write_hook,
                                [&](std::size_t u, std::string_view kind, std::uint64_t first, std::span<float> out) {
                                  request_range(s.m.units[u].params, src, kind, first, out);
                                });
    }
  } catch (...) {
    s.write_error = std::current_exception();
  }
  s.params = {};
  s.state = {};
  s.written.store(true, std::memory_order_release);
}

// Every rank learns whether every file was written, rank 0 every file's size and
// checksums, and commits; then keep_last.
template <class Comm>
std::filesystem::path finish_save(Comm& comm, save_state& s) {
  auto& m = s.m;
  try {
    on_all_ranks(comm, s.what, [&] {
      if (s.write_error) std::rethrow_exception(s.write_error);
    });
    // [partition, bytes, chunk count, hashes...] of every rank.
    std::vector<std::int64_t> mine_enc{s.part};
    if (s.part >= 0) {
      mine_enc.push_back(std::int64_t(s.mine.bytes));
      mine_enc.push_back(std::int64_t(s.mine.chunks.size()));
      for (auto h : s.mine.chunks) mine_enc.push_back(std::int64_t(h));
    }
    std::vector<std::int64_t> longest{std::int64_t(mine_enc.size())};
    comm.all_reduce(std::span<std::int64_t>(longest), shardlib::comm::reduce_op::max);
    mine_enc.resize(std::size_t(longest[0]), 0);
    std::vector<std::int64_t> all(mine_enc.size() * std::size_t(comm.size()));
    comm.all_gather(std::span<const std::int64_t>(mine_enc), std::span<std::int64_t>(all));

    on_all_ranks(comm, s.what, [&] {
      if (s.rank != 0) return;
      m.files.resize(std::size_t(m.partitions));
      for (int r = 0; r < comm.size(); ++r) {
        const std::int64_t* e = all.data() + std::size_t(r) * mine_enc.size();
        if (e[0] < 0) continue;
        auto& f = m.files[std::size_t(e[0])];
        f = {shard_file_name(int(e[0]), m.partitions), std::uint64_t(e[1]), {}};
        for (std::int64_t c = 0; c < e[2]; ++c) f.chunks.push_back(std::uint64_t(e[3 + c]));
      }
      commit_checkpoint(s.temp, s.final_dir, m, s.options.write_hook);
    });
  } catch (...) {
    if (s.claim.held()) remove_quietly(s.temp);
    throw;
  }
  on_all_ranks(comm, cat(s.what, " (it is complete; removing old ones)"), [&] {
    if (s.rank == 0) prune(s.root, s.options.keep_last, s.in_background);
  });
  return s.final_dir;
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
  const auto s = detail::begin_save(comm, root, model, opt, o);
  detail::write_own_file(*s);
  return detail::finish_save(comm, *s);
}

// A checkpoint being written in the background (async_save_checkpoint). wait() is
// collective: every rank calls it, and it returns the checkpoint's path once every rank's
// file is written and rank 0 has committed, or raises io_error on every rank as
// save_checkpoint does. Destroyed without wait(), it waits for this rank's writing to end
// and commits nothing: no checkpoint appears, and the next complete save removes the
// temporary directory. It refers to the model's communicator: the model outlives it.
template <class Comm>
class pending_checkpoint {
 public:
  // Never throws past the save's collective start: were this rank alone to raise here,
  // the others would wait for it in wait(). A thread that cannot start writes inline.
  pending_checkpoint(Comm comm, std::unique_ptr<detail::save_state> s) noexcept
      : comm_(std::move(comm)), s_(std::move(s)) {
    try {
      writer_ = std::thread(detail::write_own_file, std::ref(*s_));
    } catch (...) {  // std::system_error: no thread to be had
      detail::write_own_file(*s_);
    }
  }
  pending_checkpoint(pending_checkpoint&&) noexcept = default;
  pending_checkpoint& operator=(pending_checkpoint&&) = delete;  // would abandon a save unsaid: use std::optional
  ~pending_checkpoint() {
    if (writer_.joinable()) writer_.join();
  }

  // Whether this rank's file is written (or its writing failed): wait() then blocks only
  // for the other ranks and the commit. Never blocks.
  bool written() const { return !s_ || s_->written.load(std::memory_order_acquire); }

  std::filesystem::path wait() {
    if (!s_) throw io_error("pending_checkpoint::wait: this save has been waited for already");
    if (writer_.joinable()) writer_.join();
    const auto s = std::move(s_);
    return detail::finish_save(comm_, *s);
  }

 private:
  Comm comm_;
  std::unique_ptr<detail::save_state> s_;
  std::thread writer_;
};

// Waits until the old checkpoints that asynchronous saves' keep_last took out of sight are
// deleted from the disk (a thread of the process deletes them after wait() returns; at a
// normal exit it finishes first). For a caller about to remove or move the root itself.
inline void finish_background_deletions() { detail::background_deleter::instance().drain(); }

// save_checkpoint with the writing in the background: the collective part that copies
// this rank's shards and optimizer state to host memory runs now (so the checkpoint holds
// the values of this call, whatever training does next), each rank's file is written by a
// thread of its own, and the returned pending_checkpoint's wait() (collective) agrees and
// commits. Training may go on meanwhile; the copy costs host memory of this rank's
// shards and state until its file is written. write_hook runs on the writing thread. A
// second save under the same tag is refused until the first is waited for. keep_last
// renames the old checkpoints out of sight in wait() and deletes them in the background.
template <class M, class C, class S, SavableOptimizer O>
auto async_save_checkpoint(const std::filesystem::path& root, shard::ShardedModel<M, C, S, float, O>& model, O& opt,
                           const save_options& o = {}) {
  auto comm = detail::host_collectives_of(model);
  auto s = detail::begin_save(comm, root, model, opt, o);
  s->in_background = true;
  return pending_checkpoint<decltype(comm)>(std::move(comm), std::move(s));
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
