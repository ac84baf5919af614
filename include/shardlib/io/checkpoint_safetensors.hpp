// shardlib/io/checkpoint_safetensors.hpp — converting to and from one safetensors file:
// a model exported (gathered one unit at a time) or loaded by each rank's ranges, and,
// without a model, a checkpoint consolidated into a file or a file made a checkpoint.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/buffer.hpp"              // Buffer
#include "shardlib/core/error.hpp"               // io_error, cat, require
#include "shardlib/core/ledger.hpp"              // category
#include "shardlib/core/shape.hpp"               // Shape
#include "shardlib/io/checkpoint_directory.hpp"  // resolve_checkpoint
#include "shardlib/io/checkpoint_format.hpp"     // checkpoint_metadata, checkpoint_partitions, default_chunk_bytes, ...
#include "shardlib/io/checkpoint_reader.hpp"     // checkpoint_reader
#include "shardlib/io/checkpoint_writer.hpp"     // detail::prepare_save, write_shard_file, commit_checkpoint, prune
#include "shardlib/io/consolidated_file.hpp"     // safetensors_source, detail::consolidated_tensors, ...
#include "shardlib/io/optimizer_record.hpp"      // detail::buffer_names, optimizer_name, check_same_optimizer, ...
#include "shardlib/io/rank_agreement.hpp"        // detail::on_all_ranks
#include "shardlib/io/reshard.hpp"               // request_range, check_parameters, load_from, ...
#include "shardlib/io/safetensors.hpp"           // safetensors_stream_writer, tensor_info
#include "shardlib/io/staging.hpp"               // stager, copy_to_host, copy_from_host, host_collectives_of
#include "shardlib/nn/flat.hpp"                  // nn::flat_entry

#include <nlohmann/json.hpp>  // nlohmann::json

#include <cstddef>       // std::size_t
#include <cstdint>       // std::uint64_t
#include <filesystem>    // std::filesystem
#include <optional>      // std::optional, std::nullopt
#include <span>          // std::span
#include <string>        // std::string
#include <string_view>   // std::string_view
#include <system_error>  // std::error_code
#include <type_traits>   // std::is_same_v, std::type_identity
#include <utility>       // std::move
#include <vector>        // std::vector

namespace shardlib::io {

namespace detail {

// The unit's whole flat vector of one kind when the pieces are shards (partitions() >
// 1), gathered from this rank's piece (memory of S) into holder, in the model's memory
// space, where its communicator works: a piece kept elsewhere (optimizer state
// offloaded to host memory) goes there first.
template <class S, class Engine>
std::span<const float> gather_whole(Engine& model, std::span<const float> piece,
                                    Buffer<float, typename Engine::space>& holder,
                                    stager<typename Engine::space>& staging) {
  using Space = typename Engine::space;
  auto& group = model.shard_group();
  holder.reset();  // first: never two units gathered at once
  holder = Buffer<float, Space>(piece.size() * std::size_t(group.size()), category::gathered_parameters);
  if constexpr (std::is_same_v<S, Space>) {
    group.all_gather(piece, holder.span());
  } else {
    static_assert(can_access<host_space, S>, "io: a piece neither in the model's space nor in host memory");
    Buffer<float, Space> mine(piece.size(), category::comm_scratch);
    copy_from_host<Space>(staging, piece, mine.span());
    group.all_gather(std::span<const float>(mine.span()), holder.span());
  }
  return holder.span();
}

template <class Engine, class O>
void export_impl(const std::filesystem::path& file, Engine& model, O* opt) {
  using Space = typename Engine::space;
  auto comm = host_collectives_of(model);
  const bool root = comm.rank() == 0;
  const std::string what = cat("exporting to ", file.string());
  consolidated_info info{model.steps(), std::nullopt, model.scaler(), nlohmann::json::object()};
  std::vector<std::string> kinds;
  if constexpr (!std::is_same_v<O, no_optimizer>) {
    kinds = buffer_names(*opt);
    info.optimizer = checkpoint_optimizer{optimizer_name<O>(), model.optimizer_state(*opt, 0).step, kinds,
                                          hyperparameters_of(model, *opt)};
    check_same_optimizer(comm, *info.optimizer, what);
  }
  std::vector<std::vector<nn::flat_entry>> layouts;
  for (std::size_t i = 0; i < model.unit_count(); ++i) layouts.push_back(model.unit_layout(i).entries);
  std::optional<safetensors_stream_writer> out;
  on_all_ranks(comm, what, [&] {
    if (root) out.emplace(file, consolidated_tensors(layouts, kinds), consolidated_metadata(info));
  });
  // One unit at a time: no rank ever holds more than one unit gathered, and rank 0 at
  // most one parameter in host memory besides when the values live elsewhere (memory
  // of R), copied out through the stager.
  stager<Space> staging;
  std::vector<float> host;
  auto write_unit = [&]<class R>(std::size_t i, std::string_view kind, std::span<const float> values,
                                 std::type_identity<R>) {
    on_all_ranks(comm, what, [&] {
      if (!root) return;
      for (const auto& e : model.unit_layout(i).entries) {
        std::span<const float> part = values.subspan(e.offset, e.numel());
        if constexpr (!can_access<host_space, R>) {
          host.resize(part.size());
          copy_to_host<R>(staging, part, std::span<float>(host));
          part = host;
        }
        out->write(kind == "master" ? e.name : optimizer_tensor(e.name, kind), std::as_bytes(part));
      }
    });
  };
  auto write_whole = [&]<class S>(std::size_t i, std::string_view kind, std::span<const float> piece,
                                  std::type_identity<S> space) {
    if (model.partitions() == 1) return write_unit(i, kind, piece, space);
    Buffer<float, Space> holder;
    write_unit(i, kind, gather_whole<S>(model, piece, holder, staging), std::type_identity<Space>{});
  };
  for (std::size_t i = 0; i < model.unit_count(); ++i) {
    if (model.unit_layout(i).entries.empty()) continue;  // a unit whose children claimed every parameter
    with_master(model, i, [&](std::span<const float> piece, auto space) { write_whole(i, "master", piece, space); });
    if constexpr (!std::is_same_v<O, no_optimizer>) {
      auto& st = model.optimizer_state(*opt, i);
      for (const auto& k : kinds) {
        const bool found = with_piece_buffer(model, i, st, k, staging, [&](std::span<const float> piece, auto space) {
          write_whole(i, k, piece, space);
        });
        require(found, "rank ", comm.rank(), ": unit ", i, " has no optimizer buffer '", k, "'");
      }
    }
  }
  on_all_ranks(comm, what, [&] {
    if (root) out->finish();
  });
}

template <class Engine, class O>
void load_safetensors_impl(const std::filesystem::path& file, Engine& model, O* opt) {
  const std::string what = cat("loading ", file.string());
  std::optional<safetensors_source> src;
  std::optional<checkpoint_optimizer> saved;
  auto comm = host_collectives_of(model);
  on_all_ranks(comm, what, [&] {
    src.emplace(file);
    const std::string_view source = src_name(*src);
    check_parameters(model, src->parameters(), source);
    if (!opt) return;
    if (!src->info() || !src->info()->optimizer)
      throw io_error(cat(source, ": it holds no optimizer state (export it with export_safetensors(file, model, opt) "
                                 "or shardlib-ckpt to-safetensors --optimizer)"));
    saved = src->info()->optimizer;
    for (std::size_t i = 0; i < model.unit_count(); ++i)
      for (const auto& e : model.unit_layout(i).entries)
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

// --- without a model (the shardlib-ckpt tool) --------------------------------------------------

// Consolidates a checkpoint (or a root's latest) into one safetensors file, one
// parameter at a time, as export_safetensors would have written it. Returns the checkpoint used.
inline std::filesystem::path checkpoint_to_safetensors(const std::filesystem::path& path,
                                                       const std::filesystem::path& file, bool with_optimizer) {
  checkpoint_reader r(resolve_checkpoint(path));
  const auto& m = r.metadata();
  {  // writing into the checkpoint would replace a file of it (a shard, its metadata) with the export
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path dir = fs::weakly_canonical(r.path(), ec), out = ec ? fs::path() : fs::weakly_canonical(file, ec);
    if (ec) detail::fail(file.string(), "cannot resolve the path: ", ec.message());
    const auto [d, o] = std::mismatch(dir.begin(), dir.end(), out.begin(), out.end());
    if (d == dir.end())
      detail::fail(file.string(), "lies inside the checkpoint ", r.path().string(), " it is exported from");
  }
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
  bool replace = false;  // an existing checkpoint root/<tag> is replaced; otherwise that is an error
};

// Makes a sharded checkpoint root/<tag> for `world` ranks and `strategy` from a
// safetensors file (F32, F64, F16 or BF16 tensors; with this library's optimizer
// tensors and metadata, the optimizer state too). Every tensor becomes a parameter of
// one unit: a resharding load maps by name, so any model with these names and shapes
// loads it, whatever its units. Atomic like save_checkpoint; an existing root/<tag>
// is an error unless o.replace. Returns root/<tag>.
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
  if (std::error_code ec; !o.replace && std::filesystem::exists(final_dir, ec))
    detail::fail(final_dir.string(), "exists; a conversion replaces a checkpoint only when asked to (replace, "
                 "shardlib-ckpt --force) or writes under another tag");
  const auto claim = detail::prepare_save(final_dir, temp);
  m.sequence = claim.sequence();
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
