// examples/common/launched.hpp — how the examples were started: whether their ranks are
// threads of this process (no launcher: --world of them) or one per process (tools/launch,
// torchrun, Slurm, mpirun: the launcher's world, which a --world given must match), and
// which process this is.
#pragma once
#include <shardlib/comm/environment.hpp>
#include <shardlib/core/error.hpp>

#include <CLI/CLI.hpp>

#include "common/flags.hpp"  // max_thread_ranks

namespace example {

// True when no launcher started the process; then --world is at most max_thread_ranks (a
// launcher's world has no such bound). Malformed launcher variables count as a launcher
// here: the run raises on them when it starts.
inline bool ranks_are_threads(const CLI::App& cli, long world) {
  namespace comm = shardlib::comm;
  comm::launch_environment env;
  try {
    env = comm::discover_environment();
  } catch (const shardlib::error&) {
    return false;
  }
  if (env.kind == comm::launcher::none) {
    if (world > max_thread_ranks)
      throw CLI::ValidationError("--world", shardlib::cat(world, " rank threads, where one process takes at most ",
                                                          max_thread_ranks, " (more ranks: one per process under a "
                                                          "launcher)"));
    return true;
  }
  if (cli.count("--world") > 0 && env.size != world)
    throw CLI::ValidationError("--world", shardlib::cat(world, ", but ", comm::name(env.kind), " started this as one of ",
                                                        env.size, " processes, a rank each"));
  return false;
}

// This process's rank under a launcher, else 0 (malformed launcher variables too: the run
// raises on them when it starts): for what one process of a job prints before its ranks start.
inline int process_rank() {
  try {
    return shardlib::comm::discover_environment().rank;
  } catch (const shardlib::error&) {
    return 0;
  }
}

}  // namespace example
