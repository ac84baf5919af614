// shardlib/comm/mpi_comm.hpp — MpiComm: ranks as MPI processes, on one machine or many.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/mpi_group.hpp"

#include <mpi.h>


#include <algorithm>    // std::min, std::max
#include <array>        // std::array
#include <chrono>       // std::chrono::duration
#include <climits>      // INT_MAX
#include <cstddef>      // std::size_t, std::byte
#include <cstdint>      // std::int64_t
#include <cstdio>       // std::fputs
#include <cstdlib>      // std::abort, std::exit
#include <cstring>      // std::memcpy
#include <exception>    // std::exception_ptr, std::uncaught_exceptions
#include <functional>   // std::function
#include <memory>       // std::shared_ptr, std::unique_ptr
#include <mutex>        // std::mutex
#include <optional>     // std::optional
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <type_traits>  // std::is_same_v
#include <utility>      // std::pair
#include <vector>       // std::vector

namespace shardlib::comm {

// MPI must be running before MpiComm::world(): create one of these first in main.
// It calls MPI_Init_thread asking for MPI_THREAD_SERIALIZED (what asynchronous
// collectives need) and MPI_Finalize at the end of its scope, but only if it was
// the one that initialised MPI; under an existing MPI it just records the level.
class mpi_session {
 public:
  mpi_session() : mpi_session(nullptr, nullptr) {}
  mpi_session(int* argc, char*** argv) : timeout_(detail::comm_timeout(std::nullopt)) {
    int initialised = 0;
    MPI_Initialized(&initialised);
    require<comm_error>(!detail::mpi_finalized(), "mpi_session: MPI has already been finalised and cannot start again");
    if (initialised) {
      MPI_Query_thread(&thread_level_);
      return;
    }
    const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &thread_level_);
    require<comm_error>(rc == MPI_SUCCESS, "mpi_session: MPI_Init_thread failed: ", detail::mpi_error_text(rc));
    owner_ = true;
    detail::job_failure::process().exits = true;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
  // MPI_Finalize waits for every process, so a stopped one ends the job through the
  // watchdog; so do the leaves this process posted while unwinding, finished first.
  // A process whose peers failed exits with status 1 here even when its own main
  // succeeded: every process of a failed job says so.
  ~mpi_session() {
    if (!owner_ || detail::mpi_finalized()) return;
    detail::departures::process().finish();  // each watched on its own
    {
      const detail::watchdog::scope watched(
          {detail::waiting_in::finalizing, rank_, size_, rank_, 0, {}, timeout_, &detail::abort_job});
      MPI_Finalize();
    }
    if (detail::job_failure::process().recorded()) std::exit(1);
  }

  int thread_level() const { return thread_level_; }
  bool owns_mpi() const { return owner_; }  // this session initialised MPI and will finalise it

 private:
  detail::seconds timeout_;
  int thread_level_ = MPI_THREAD_SINGLE;
  bool owner_ = false;
  int rank_ = 0, size_ = 0;  // in MPI_COMM_WORLD
};

// Ranks as MPI processes. Collectives use MPI's own, except reductions among
// ranks of one node, which go through shared memory in rank order (results
// identical to ThreadComm's). Every MPI error and every disagreement between
// ranks (checked before each collective unless options().check is off) raises
// comm_error on the ranks concerned instead of aborting or hanging; so does a
// rank leaving the communicator (dropping its last handle: returning, or
// unwinding an exception) where the others call a collective. A wait longer than
// options().timeout ends the job through the process's watchdog.
// A handle: copies share the communicator, which MPI frees with the last copy
// (a collective step, so ranks must drop their communicators in the same order).
// Asynchronous forms run on one worker thread per process; blocking forms first
// wait for it, so the process never has two MPI calls in flight.
class MpiComm {
 public:
  // The group of all processes (a duplicate of MPI_COMM_WORLD); collective.
  static MpiComm world(const mpi_options& opts = {}) {
    int initialised = 0;
    MPI_Initialized(&initialised);
    require<comm_error>(initialised && !detail::mpi_finalized(),
                        "MpiComm::world(): MPI is not running; create a comm::mpi_session in main first (or call "
                        "MPI_Init_thread with MPI_THREAD_SERIALIZED)");
    return MpiComm(MPI_COMM_WORLD, opts);
  }

  // Works on a duplicate of `comm` (collective over it), so that neither its
  // error handler nor its messages are touched.
  explicit MpiComm(MPI_Comm comm, const mpi_options& opts = {}) {
    // The process's asynchronous collectives finish first: one MPI call at a time
    // (MPI_THREAD_SERIALIZED), and one wait in the watchdog's slot.
    const std::shared_ptr<executor> exec = detail::process_executor();
    exec->drain();
    int rank = -1, size = 0, world_rank = 0;
    detail::mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", rank, "wrapping a communicator");
    detail::mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size", rank, "wrapping a communicator");
    detail::mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank", rank, "wrapping a communicator");
    mpi_options resolved = opts;
    resolved.timeout = detail::comm_timeout(opts.timeout);
    const detail::watchdog::scope watched(
        {detail::waiting_in::creating, rank, size, world_rank, 0, {}, *resolved.timeout, &detail::abort_job});
    MPI_Comm dup;
    MPI_Request request;
    detail::mpi_check(MPI_Comm_idup(comm, &dup, &request), "MPI_Comm_idup", rank, "creating a communicator");
    detail::mpi_check(detail::wait_moving_departures(request), "MPI_Comm_idup", rank, "creating a communicator");
    g_ = std::make_shared<detail::mpi_group>(dup, resolved, exec, rank);
  }

  int rank() const { return g_->rank(); }
  int size() const { return g_->size(); }
  MPI_Comm native() const { return g_->native(); }  // for calls of one's own; its errors return codes
  const mpi_options& options() const { return g_->options(); }

  void barrier() {
    g_->exec().drain();
    g_->barrier();
  }

  template <Element T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    g_->exec().drain();
    g_->all_gather(send, recv);
  }
  template <Element T>
  [[nodiscard]] work all_gather_async(std::span<const T> send, std::span<T> recv) {
    return submit([=, g = g_.get()] { g->all_gather(send, recv); });
  }

  template <Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    g_->exec().drain();
    g_->reduce_scatter(send, recv, op);
  }
  template <Element T>
  [[nodiscard]] work reduce_scatter_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return submit([=, g = g_.get()] { g->reduce_scatter(send, recv, op); });
  }

  template <Element T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
    g_->exec().drain();
    g_->all_reduce(send, recv, op);
  }
  template <Element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <Element T>
  [[nodiscard]] work all_reduce_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return submit([=, g = g_.get()] { g->all_reduce(send, recv, op); });
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    g_->exec().drain();
    g_->broadcast(data, root);
  }
  template <Element T>
  [[nodiscard]] work broadcast_async(std::span<T> data, int root) {
    return submit([=, g = g_.get()] { g->broadcast(data, root); });
  }

  // Ranks with the same color form a new communicator, ordered by key, then by
  // rank here (MPI_Comm_split). Every rank must call it; color must be >= 0.
  // The new communicator keeps these options.
  MpiComm split(int color, int key) {
    g_->exec().drain();
    return MpiComm(g_->split(color, key));
  }

 private:
  explicit MpiComm(std::shared_ptr<detail::mpi_group> g) : g_(std::move(g)) {}

  // Jobs hold a raw pointer: the group outlives them because it drains the worker first.
  work submit(std::function<void()> job) {
    g_->require_async();
    return g_->exec().submit(std::move(job));
  }

  std::shared_ptr<detail::mpi_group> g_;
};

static_assert(check_communicator<MpiComm>());

}  // namespace shardlib::comm
