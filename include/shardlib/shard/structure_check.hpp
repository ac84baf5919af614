// shardlib/shard/structure_check.hpp — the check that every rank wraps the same model
// with the same strategy, seed and collective-shaping options, before anything is sharded.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"  // comm::reduce_op
#include "shardlib/core/error.hpp"         // error, cat
#include "shardlib/core/random.hpp"        // fnv1a
#include "shardlib/shard/strategy.hpp"     // policy

#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t, std::uint64_t
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <vector>       // std::vector

namespace shardlib::shard {

namespace detail {
// Entry k of the list check_same_model hashes, for its message: parameters in unit
// order, then ties.
template <class Unit>
std::string describe_entry(const std::vector<Unit>& units, std::size_t k) {
  for (const auto& u : units)
    for (const auto& e : u.layout.entries)
      if (k-- == 0)
        return cat("'", e.name, "' ", e.shape, e.requires_grad ? "" : ", frozen",
                   u.keep_gathered ? ", its unit kept gathered (options.keep_gathered)" : "");
  for (const auto& u : units)
    for (const auto& a : u.aliases)
      if (k-- == 0) return cat("the tie of '", a.name, "' to '", u.layout.entries[a.entry].name, "'");
  return "no such parameter on this rank";
}
}  // namespace detail

// Ranks compare a hash of the strategy's name and policy (group resolved for the
// world), the seed, the options that shape the sequence of collectives (`collectives`:
// prefetch depth, precision, offload, frozen masters and gradients; ranks that prefetch
// differently would pair one's all-gather with another's reduce-scatter, which NCCL does
// not notice), every parameter's unit, name, shape, element sizes, whether it is frozen
// and whether its unit stays gathered after forward (options.keep_gathered: a rank that
// gathers again in backward would wait for the others), and every tie; on a mismatch
// every rank raises, naming the first thing that differs. Ops is the model space's
// space_ops (host-memory collectives on any communicator).
template <class Ops, class Comm, class Unit>
void check_same_model(Comm& comm, const std::vector<Unit>& units, std::string_view strategy, const policy& p,
                      std::uint64_t seed, std::string_view collectives, std::size_t master_bytes,
                      std::size_t compute_bytes) {
  std::vector<std::int64_t> mine;  // hashes (int64: an element type every communicator carries)
  mine.push_back(std::int64_t(fnv1a(cat(strategy, p.shard_parameters, p.shard_gradients, p.shard_optimizer,
                                        p.group(comm.size()), int(p.free), int(p.reduce), p.reshard_to))));
  mine.push_back(std::int64_t(seed));
  mine.push_back(std::int64_t(fnv1a(collectives)));
  constexpr std::size_t first_parameter = 3;
  for (const auto& u : units)
    for (const auto& e : u.layout.entries)
      mine.push_back(
          std::int64_t(fnv1a(cat(u.name, "|", e.name, e.shape, "|", master_bytes, compute_bytes, e.requires_grad,
                                 u.keep_gathered))));
  for (const auto& u : units)  // ties: ranks that tie differently would lay units out differently
    for (const auto& a : u.aliases) mine.push_back(std::int64_t(fnv1a(cat(u.name, "|", a.name, "=", a.entry))));
  std::vector<std::int64_t> most{std::int64_t(mine.size())};
  Ops::all_reduce_values(comm, std::span<std::int64_t>(most), comm::reduce_op::max);
  mine.resize(std::size_t(most[0]), 0);  // absent entries hash to 0
  std::vector<std::int64_t> all(mine.size() * std::size_t(comm.size()));
  Ops::all_gather_values(comm, std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  for (std::size_t i = 0; i < mine.size(); ++i)
    for (int r = 0; r < comm.size(); ++r) {
      if (all[std::size_t(r) * mine.size() + i] == all[i]) continue;
      const std::string what =
          i == 0   ? cat("the strategy or its policy (here: ", strategy,
                         p.reshard_to ? cat(" with reshard_to ", p.reshard_to) : std::string(), ")")
          : i == 1 ? cat("options.seed (here: ", seed, "): ranks would start from different parameters")
          : i == 2 ? cat("the options that shape its collectives (here: ", collectives, ")")
                   : cat("parameter #", i - first_parameter, " (here: ",
                         detail::describe_entry(units, i - first_parameter), ")");
      throw error(cat("rank ", comm.rank(), ": the model differs between ranks 0 and ", r, " at ", what,
                      ": every rank must wrap the same model with the same strategy, seed and options"));
    }
}

}  // namespace shardlib::shard
