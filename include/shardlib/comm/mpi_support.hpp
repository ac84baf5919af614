// shardlib/comm/mpi_support.hpp — what MpiComm is built from: its options, MPI errors and
// types, the process's MPI worker, the record of a failed job, and owned MPI objects.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/executor.hpp"
#include "shardlib/comm/reduce.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/ledger.hpp"

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


struct mpi_options {
  // Before each collective, one small MPI_Iallreduce checks that every rank calls
  // the same one with the same count, type, operation and root, so misuse raises
  // instead of hanging or corrupting data. Off only for measured hot loops.
  bool check = true;
  // Reduce through an MPI-3 shared-memory window when all ranks share a node;
  // off, reductions use MPI's own collectives (as across nodes).
  bool shared_memory = true;
  // How long a collective may wait for the other ranks before the process's
  // watchdog prints what this rank waits in and ends the job with MPI_Abort.
  // Unset: SHARDLIB_COMM_TIMEOUT (seconds) when set, else default_comm_timeout
  // (600 s, as NCCL's); zero: no limit. options() reports the value in use.
  std::optional<std::chrono::duration<double>> timeout = std::nullopt;
};

namespace detail {

inline bool mpi_finalized() {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

inline std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return cat("MPI error code ", rc);
  return std::string(text, std::size_t(len));
}

// Every MPI call's return code goes through here (the library's communicators
// and windows use MPI_ERRORS_RETURN): a failure becomes a comm_error naming the
// rank, what it was doing, the call and MPI's own text.
inline void mpi_check(int rc, std::string_view call, int rank, std::string_view doing) {
  if (rc != MPI_SUCCESS) throw comm_error(cat("rank ", rank, ": ", doing, ": ", call, " failed: ", mpi_error_text(rc)));
}

inline std::string_view thread_level_name(int level) {
  if (level == MPI_THREAD_SINGLE) return "MPI_THREAD_SINGLE";
  if (level == MPI_THREAD_FUNNELED) return "MPI_THREAD_FUNNELED";
  if (level == MPI_THREAD_SERIALIZED) return "MPI_THREAD_SERIALIZED";
  return "MPI_THREAD_MULTIPLE";
}

// 16-bit floats travel as their bits; MPI never reduces them with a built-in
// operation (that would add bit patterns), only through mpi_reduce_fn.
template <Element T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) return MPI_UINT16_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int16_t>) return MPI_INT16_T;
  else if constexpr (std::is_same_v<T, std::int8_t>) return MPI_INT8_T;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return MPI_UINT8_T;
  else return MPI_C_BOOL;
}

// A user-defined MPI operation, inout[i] = op(in[i], inout[i]), through reduce_into:
// 16-bit floats add in float (one rounding per pairwise step of MPI's tree) and
// max propagates NaN, which MPI_MAX does not promise.
template <Element T, reduce_op Op>
void mpi_reduce_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* srcs[] = {static_cast<const T*>(in), static_cast<const T*>(inout)};
  reduce_into(static_cast<T*>(inout), std::span<const T* const>(srcs), std::size_t(*len), Op);
}

// MPI_Finalize starts by deleting MPI_COMM_SELF's attributes, while MPI still
// works: an attribute whose delete callback frees the operation ends its life there.
inline int free_op_attribute(MPI_Comm, int, void* op, void*) {
  auto* h = static_cast<MPI_Op*>(op);
  const int rc = MPI_Op_free(h);
  delete h;
  return rc;
}

inline void free_at_finalize(MPI_Op op, int rank) {
  int key = MPI_KEYVAL_INVALID;
  mpi_check(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &free_op_attribute, &key, nullptr), "MPI_Comm_create_keyval",
            rank, "registering a reduction");
  mpi_check(MPI_Comm_set_attr(MPI_COMM_SELF, key, new MPI_Op(op)), "MPI_Comm_set_attr", rank,
            "registering a reduction");
  mpi_check(MPI_Comm_free_keyval(&key), "MPI_Comm_free_keyval", rank, "registering a reduction");  // kept while used
}

template <Element T, reduce_op Op>
MPI_Op user_op(int rank) {
  static const MPI_Op handle = [&] {  // created once per process, freed at MPI_Finalize
    MPI_Op h;
    mpi_check(MPI_Op_create(&mpi_reduce_fn<T, Op>, 1, &h), "MPI_Op_create", rank,
              cat("making the ", name(Op), " of ", name(dtype_of<T>)));
    free_at_finalize(h, rank);
    return h;
  }();
  return handle;
}

// The operation MPI's own collectives use for op; avg is a sum divided afterwards.
template <Element T>
MPI_Op mpi_op(reduce_op op, int rank) {
  if (op == reduce_op::max) {
    if constexpr (FloatingElement<T>) return user_op<T, reduce_op::max>(rank);
    return MPI_MAX;
  }
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) return user_op<T, reduce_op::sum>(rank);
  return MPI_SUM;
}

// One worker for every MpiComm of the process: the MPI calls of all of them run
// on it or on the user's thread after draining it, never two at once, which is
// all that MPI_THREAD_SERIALIZED allows.
inline std::shared_ptr<executor> process_executor() {
  static std::mutex m;
  static std::weak_ptr<executor> shared;
  std::lock_guard lock(m);
  auto e = shared.lock();
  if (!e) shared = e = std::make_shared<executor>();
  return e;
}

// The watchdog's last act: MPI_Abort ends every process of the job, and mpirun
// says which one called it.
[[noreturn]] inline void abort_job() {
  int running = 0;
  MPI_Initialized(&running);
  if (running && !mpi_finalized()) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

// Why the job failed, as seen by a process that left a communicator cleanly while
// a peer did not; an mpi_session that owns MPI then ends the process with status 1.
struct job_failure {
  std::mutex m;
  std::string why;      // the first reason only
  bool exits = false;   // an mpi_session will end the process

  static job_failure& process() {
    static job_failure f;
    return f;
  }
  void record(const std::string& reason) {
    std::lock_guard lock(m);
    if (!why.empty()) return;
    why = reason;
    std::fputs((reason + (exits ? "; this process will exit with status 1\n" : "\n")).c_str(), stderr);
  }
  bool recorded() {
    std::lock_guard lock(m);
    return !why.empty();
  }
};

// Bytes of one piece of a shared-memory reduction. Each rank's window segment
// holds two pieces, used alternately (see mpi_group::shm_barrier). 4 MiB: at 64 MiB
// messages, 1 MiB pieces lost to MPI_Allreduce on a busy 2-core machine (each piece
// pays a barrier); 4 MiB pieces reach 2-3x MPI_Allreduce and 8-9x
// MPI_Reduce_scatter_block there (docs/benchmarks.md).
inline constexpr std::size_t shm_piece_bytes = std::size_t{4} << 20;

// Owns a communicator the library created; frees it unless MPI is already gone.
struct owned_comm {
  MPI_Comm c = MPI_COMM_NULL;
  explicit owned_comm(MPI_Comm comm) : c(comm) {}
  owned_comm(const owned_comm&) = delete;
  owned_comm& operator=(const owned_comm&) = delete;
  ~owned_comm() {
    if (c != MPI_COMM_NULL && !mpi_finalized()) MPI_Comm_free(&c);
  }
};

// A shared-memory window with one segment per rank, every rank's segment
// mapped into every process; charged to the creating rank's ledger.
struct shm_window {
  MPI_Win win = MPI_WIN_NULL;
  bool locked = false;
  std::vector<std::byte*> segment;  // by rank
  ledger* charged = nullptr;
  std::size_t bytes = 0;
  shm_window() = default;
  shm_window(const shm_window&) = delete;
  shm_window& operator=(const shm_window&) = delete;
  // When a rank has left the group early, the others would wait in MPI_Win_free
  // for it: every member leaves the window to MPI_Finalize instead.
  void abandon() { win = MPI_WIN_NULL; }
  ~shm_window() {
    if (win != MPI_WIN_NULL && !mpi_finalized()) {
      if (locked) MPI_Win_unlock_all(win);
      MPI_Win_free(&win);
    }
    if (charged) charged->release(category::comm_scratch, bytes);
  }
};

// What a rank brings to a collective's agreement besides its signature.
enum class arrival : std::int64_t { ready, invalid, leaving, leaving_unwinding };

}  // namespace detail
}  // namespace shardlib::comm
