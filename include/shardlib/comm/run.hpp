// shardlib/comm/run.hpp — run_from_environment(fn): one entry point for every way a
// program is started: ranks as threads, torchrun-style processes, Slurm, or MPI.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/environment.hpp"
#include "shardlib/comm/launch.hpp"
#include "shardlib/comm/rendezvous.hpp"
#include "shardlib/comm/socket_comm.hpp"
#include "shardlib/comm/store.hpp"
#include "shardlib/core/error.hpp"

#include <chrono>    // std::chrono
#include <concepts>  // std::same_as
#include <optional>  // std::optional
#include <utility>   // std::forward

namespace shardlib::comm {

struct run_options {
  // Ranks, as threads of this process, when no launcher started it.
  int threads = 1;
  // What discover_environment() finds, unless given.
  std::optional<launch_environment> environment = std::nullopt;
  // How long processes wait for each other to join (the store and the connections).
  seconds join_timeout{300};
  socket_options socket{};
};

// A backend that run_from_environment may hand a launch to before its own choices
// (comm/mpi_backend.hpp's mpi_backend, for programs linked with MPI): it claims
// the environments it serves and runs fn on its communicator there.
template <class B>
concept LaunchBackend = requires(const launch_environment& env) {
  { B::claims(env) } -> std::same_as<bool>;
};

// Runs fn(comm) on this process's ranks, with the communicator the environment
// calls for:
//   - the first of `backends` that claims the environment (MPI, when passed);
//   - no launcher: `threads` ranks as threads of this process (ThreadComm, launch);
//   - torchrun-style, Slurm, or MPI variables without an MPI backend: one rank per
//     process over SocketComm, meeting through the TcpStore rank 0 serves
//     (store_from_environment: at MASTER_ADDR:MASTER_PORT, or announced there under
//     torchrun).
// fn must accept each communicator it may get: a generic lambda, [&](auto& c).
// Errors: a rank's failure surfaces as launch's rank_failure with threads, and as
// the rank's own exception (or a peer's comm_error naming it) with processes.
template <class Fn, LaunchBackend... Backends>
void run_from_environment(Fn&& fn, const run_options& options = {}, Backends... backends) {
  const launch_environment env = options.environment ? *options.environment : discover_environment();
  bool done = false;
  [[maybe_unused]] auto try_backend = [&](auto b) {
    if (!done && decltype(b)::claims(env)) {
      decltype(b)::run(env, fn);
      done = true;
    }
  };
  (try_backend(backends), ...);
  if (done) return;
  if (env.kind == launcher::none) {
    launch(options.threads, std::forward<Fn>(fn));
    return;
  }
  TcpStore store = store_from_environment(env, options.join_timeout);
  SocketComm comm(store, options.socket);
  fn(comm);
}

}  // namespace shardlib::comm
