// shardlib/comm/mpi_comm.hpp — MpiComm: ranks as MPI processes, on one machine or many.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/executor.hpp"
#include "shardlib/comm/reduce.hpp"
#include "shardlib/comm/signature.hpp"
#include "shardlib/comm/watchdog.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/buffer.hpp"
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
  // Before each collective, one small MPI_Allreduce checks that every rank calls
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

// The ranks of one MpiComm and everything the collectives need. MpiComm handles
// share it; async jobs point at it, so it drains the worker before it goes.
// opts.timeout must be resolved (MpiComm's constructor does it).
class mpi_group {
 public:
  mpi_group(MPI_Comm comm, const mpi_options& opts, std::shared_ptr<executor> exec, int parent_rank)
      : comm_(comm), opts_(opts), exec_(std::move(exec)), rank_(parent_rank) {
    mpi_check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank_,
              "creating a communicator");
    mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank", rank_, "creating a communicator");
    mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size", rank_, "creating a communicator");
    mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_), "MPI_Comm_rank", rank_, "creating a communicator");
    mpi_check(MPI_Query_thread(&thread_level_), "MPI_Query_thread", rank_, "creating a communicator");
    if (opts_.shared_memory && size_ > 1) {
      MPI_Comm node;
      mpi_check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type",
                rank_, "creating a communicator");
      owned_comm owned(node);
      int node_size = 0;
      mpi_check(MPI_Comm_size(node, &node_size), "MPI_Comm_size", rank_, "creating a communicator");
      one_node_ = node_size == size_;
    }
  }
  mpi_group(const mpi_group&) = delete;
  mpi_group& operator=(const mpi_group&) = delete;
  ~mpi_group() {
    exec_->drain();
    if (!mpi_finalized()) leave();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm native() const { return comm_.c; }
  const mpi_options& options() const { return opts_; }
  executor& exec() { return *exec_; }

  void require_async() const {
    require<comm_error>(thread_level_ >= MPI_THREAD_SERIALIZED, "rank ", rank_,
                        ": asynchronous collectives run on a worker thread and need MPI_THREAD_SERIALIZED or higher, "
                        "but MPI was initialised with ", thread_level_name(thread_level_),
                        " (initialise it through comm::mpi_session, or MPI_Init_thread with MPI_THREAD_SERIALIZED)");
  }

  void barrier() {
    const signature sig{op_kind::barrier};
    const auto watched = begin(sig);
    agree(sig, [] {});
    if (!opts_.check) check(MPI_Barrier(comm_.c), "MPI_Barrier", sig);  // agree()'s all-reduce already synchronised
  }

  std::shared_ptr<mpi_group> split(int color, int key) {
    const signature sig{op_kind::split};
    const auto watched = begin(sig);
    agree(sig, [&] { require<comm_error>(color >= 0, "rank ", rank_, ": split color must be >= 0, got ", color); });
    MPI_Comm out;
    check(MPI_Comm_split(comm_.c, color, key, &out), "MPI_Comm_split", sig);
    return std::make_shared<mpi_group>(out, opts_, exec_, rank_);
  }

  template <Element T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    const std::size_t n = send.size();
    const signature sig{op_kind::all_gather, dtype_of<T>, n};
    const auto watched = begin(sig);
    agree(sig, [&] {
      require<shape_error>(recv.size() == n * size_, "rank ", rank_, ": all_gather of ", n, " elements per rank over ",
                           size_, " ranks needs a receive buffer of ", n * size_, ", got ", recv.size());
    });
    const int count = mpi_count(n, sig);
    const void* src = send.data() == recv.data() + rank_ * n ? MPI_IN_PLACE : send.data();
    check(MPI_Allgather(src, count, mpi_type<T>(), recv.data(), count, mpi_type<T>(), comm_.c), "MPI_Allgather", sig);
  }

  template <Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = recv.size();
    const signature sig{op_kind::reduce_scatter, dtype_of<T>, n, op};
    const auto watched = begin(sig);
    agree(sig, [&] {
      require<shape_error>(send.size() == n * size_, "rank ", rank_, ": reduce_scatter to ", n,
                           " elements per rank over ", size_, " ranks needs a send buffer of ", n * size_, ", got ",
                           send.size());
    });
    check_reducible(op, dtype_of<T>);
    if (use_shm()) return shm_reduce_scatter(send.data(), recv.data(), n, op, sig);
    // MPI may not alias its buffers: an in-place call (recv is send's own slice) goes through scratch.
    const bool in_place = n > 0 && recv.data() == send.data() + rank_ * n;
    Buffer<T> scratch = in_place ? Buffer<T>(n, category::comm_scratch) : Buffer<T>();
    T* out = in_place ? scratch.data() : recv.data();
    check(MPI_Reduce_scatter_block(send.data(), out, mpi_count(n, sig), mpi_type<T>(), mpi_op<T>(op, rank_), comm_.c),
          "MPI_Reduce_scatter_block", sig);
    if (in_place) std::memcpy(recv.data(), out, n * sizeof(T));
    if (op == reduce_op::avg) divide_by_size(recv);
  }

  template <Element T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = send.size();
    const signature sig{op_kind::all_reduce, dtype_of<T>, n, op};
    const auto watched = begin(sig);
    agree(sig, [&] {
      require<shape_error>(recv.size() == n, "rank ", rank_, ": all_reduce of ", n,
                           " elements needs a receive buffer of the same size, got ", recv.size());
    });
    check_reducible(op, dtype_of<T>);
    if (use_shm()) return shm_all_reduce(send.data(), recv.data(), n, op, sig);
    const void* src = send.data() == recv.data() ? MPI_IN_PLACE : send.data();
    check(MPI_Allreduce(src, recv.data(), mpi_count(n, sig), mpi_type<T>(), mpi_op<T>(op, rank_), comm_.c),
          "MPI_Allreduce", sig);
    if (op == reduce_op::avg) divide_by_size(recv);
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    // MPI itself rejects a root outside the group (MPI_ERR_ROOT), on every rank since all pass the same.
    const signature sig{op_kind::broadcast, dtype_of<T>, data.size(), reduce_op::sum, root};
    const auto watched = begin(sig);
    agree(sig, [] {});
    check(MPI_Bcast(data.data(), mpi_count(data.size(), sig), mpi_type<T>(), root, comm_.c), "MPI_Bcast", sig);
  }

 private:
  // describe() only on failure: formatting costs more than a small collective.
  void check(int rc, std::string_view call, const signature& sig) const {
    if (rc != MPI_SUCCESS) mpi_check(rc, call, rank_, describe(sig));
  }

  int mpi_count(std::size_t n, const signature& sig) const {
    if (n > std::size_t(INT_MAX))
      throw comm_error(cat("rank ", rank_, ": ", describe(sig), ": MPI counts are int and ", n, " elements exceed ",
                           INT_MAX, "; split the call"));
    return int(n);
  }

  // Every collective starts here: it is counted, refused at once on a group that a
  // rank has left, and watched until the returned scope ends.
  [[nodiscard]] watchdog::scope begin(const signature& sig) {
    ++calls_;
    if (!departure_.empty()) abandon(sig);
    last_ = sig;
    return watchdog::scope(watching(waiting_in::collective));
  }

  watch watching(waiting_in what) const {
    return {what, rank_, size_, world_rank_, calls_, last_, *opts_.timeout, &abort_job};
  }

  // What each rank posts to the agreement: its signature and its arrival.
  static constexpr int fields = 6;
  using posting = std::array<std::int64_t, fields>;

  static posting post(const signature& s, arrival a) {
    return {std::int64_t(s.kind), std::int64_t(s.type), std::int64_t(s.count),
            std::int64_t(s.op),   std::int64_t(s.root), std::int64_t(a)};
  }
  static signature signature_of(const posting& p) {
    return {op_kind(p[0]), dtype(p[1]), std::size_t(p[2]), reduce_op(p[3]), int(p[4])};
  }
  static arrival arrival_of(const posting& p) { return arrival(p[5]); }

  // Every rank's posting, or none when all ranks posted the same. The cheap path is
  // one MPI_Allreduce(MAX) of the fields and their negations, which yields every
  // field's maximum and minimum over ranks; only on a mismatch do the ranks gather
  // all postings to say who called what.
  std::vector<posting> exchange(const posting& mine, const signature& sig) {
    std::array<std::int64_t, 2 * fields> bounds;
    for (int i = 0; i < fields; ++i) bounds[i] = mine[i], bounds[fields + i] = -mine[i];
    check(MPI_Allreduce(MPI_IN_PLACE, bounds.data(), 2 * fields, MPI_INT64_T, MPI_MAX, comm_.c), "MPI_Allreduce", sig);
    bool uniform = true;
    for (int i = 0; i < fields; ++i) uniform = uniform && bounds[i] == -bounds[fields + i];
    if (uniform) return {};
    std::vector<posting> all(static_cast<std::size_t>(size_));
    check(MPI_Allgather(mine.data(), fields, MPI_INT64_T, all.data(), fields, MPI_INT64_T, comm_.c), "MPI_Allgather",
          sig);
    return all;
  }

  // Raises on every rank, before any data moves, when the ranks post different
  // signatures, when a rank's validate() throws (its own buffers are wrong: that
  // rank rethrows its error and the others raise comm_aborted), or when a rank has
  // left the group instead (see leave()).
  template <class Validate>
  void agree(const signature& sig, Validate&& validate) {
    std::exception_ptr invalid;
    try {
      validate();
    } catch (...) {
      invalid = std::current_exception();
    }
    if (!opts_.check) {
      if (invalid) std::rethrow_exception(invalid);
      return;
    }
    const auto all = exchange(post(sig, invalid ? arrival::invalid : arrival::ready), sig);
    for (int r = 0; r < int(all.size()) && departure_.empty(); ++r)
      if (arrival_of(all[r]) >= arrival::leaving) depart(r, all[r]);
    if (invalid) std::rethrow_exception(invalid);  // its own error first, whatever the others did
    if (all.empty()) return;
    if (!departure_.empty()) abandon(sig);
    for (int r = 0; r < size_; ++r)
      if (arrival_of(all[r]) == arrival::invalid)
        throw comm_aborted(cat("rank ", rank_, ": ", describe(sig), " abandoned: rank ", r,
                               " passed invalid arguments to ", describe(signature_of(all[r]))));
    for (int r = 1; r < size_; ++r)
      if (!(signature_of(all[r]) == signature_of(all[0])))
        throw disagreement(rank_, signature_of(all[0]), r, signature_of(all[r]));
  }

  // "rank r", and its rank in MPI_COMM_WORLD where that differs: a process takes
  // part in several communicators, and these messages name processes.
  std::string name_of(int r) const {
    MPI_Group group, world;
    int w = r;
    MPI_Comm_group(comm_.c, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_translate_ranks(group, 1, &r, world, &w);
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    return w == r ? cat("rank ", r) : cat("rank ", r, " (world rank ", w, ")");
  }

  // Rank r left the group where this rank called collective calls_: this call and
  // every later one raises, naming it.
  void depart(int r, const posting& left) {
    const std::string after =
        calls_ > 1 ? cat("after collective ", calls_ - 1, ", ", describe(signature_of(left))) : "before any collective";
    departure_aborts_ = arrival_of(left) == arrival::leaving_unwinding;
    departure_ = departure_aborts_
                     ? cat("abandoned: ", name_of(r), " left the communicator while unwinding an exception, ", after)
                     : cat("waits for ", name_of(r), ", which has left the communicator (its last handle is gone) ",
                           after, ": the ranks issued different sequences of collectives");
  }

  [[noreturn]] void abandon(const signature& sig) const {
    const std::string what =
        cat(name_of(rank_), ": ", describe(sig), ", collective ", calls_, " on this communicator, ", departure_);
    if (departure_aborts_) throw comm_aborted(what);
    throw comm_error(what);
  }

  // The group's end is a collective too (MPI frees communicators and windows
  // collectively): the leaving rank joins its peers' next agreement, so a peer that
  // calls another collective there raises, naming it, instead of waiting forever.
  // A rank that leaves cleanly while a peer did not (it called a collective, or
  // left unwinding an exception) records the job as failed. When a rank stays,
  // every member leaves the window to MPI_Finalize rather than wait in
  // MPI_Win_free. Without the check there is no agreement to join, and a peer left
  // waiting is ended by the watchdog.
  void leave() noexcept {
    const watchdog::scope watched(watching(waiting_in::leaving));
    bool stays = !departure_.empty();
    if (opts_.check && !stays) {
      try {
        const bool unwinding = std::uncaught_exceptions() > uncaught_at_creation_;
        const auto all = exchange(post(last_, unwinding ? arrival::leaving_unwinding : arrival::leaving), last_);
        std::string failure;
        for (int r = 0; r < int(all.size()); ++r) {
          const arrival a = arrival_of(all[r]);
          stays = stays || a < arrival::leaving;
          if (unwinding || a == arrival::leaving || !failure.empty()) continue;
          failure = a == arrival::leaving_unwinding
                        ? cat(name_of(rank_), ": ", name_of(r), " left a communicator of ", size_,
                              " ranks while unwinding an exception, after collective ", calls_)
                        : cat(name_of(rank_), ": left a communicator of ", size_, " ranks after collective ", calls_,
                              ", where ", name_of(r), " called ", describe(signature_of(all[r])), " as collective ",
                              calls_ + 1, ": the ranks issued different sequences of collectives");
        }
        if (!failure.empty()) job_failure::process().record(failure);
      } catch (...) {
        stays = true;  // an MPI error: do not wait for the others in MPI_Win_free
      }
    }
    if (stays && shm_) shm_->abandon();
    shm_.reset();  // MPI_Win_free, still watched
  }

  template <Element T>
  void divide_by_size(std::span<T> x) const {
    if constexpr (FloatingElement<T>) {  // integers never get here: check_reducible refuses their avg
      using A = accumulator_t<T>;
      for (T& v : x) v = T(A(v) / A(size_));
    }
  }

  // --- shared memory: reductions for groups whose ranks all share one node ---
  // MPI_Reduce_scatter_block over shared memory is several times slower than
  // MPI_Allgather, so reductions read peers' data through an MPI-3 window
  // instead, combining ranks in rank order with reduce_into: the same bits as
  // ThreadComm, one rounding for 16-bit floats, and every rank agrees.

  bool use_shm() const { return opts_.shared_memory && one_node_; }

  // The window is created by the first shared-memory collective (all ranks reach it
  // together, having agreed on the call), so groups that never reduce cost nothing.
  shm_window& shm(const signature& sig) {
    if (shm_) return *shm_;
    auto w = std::make_unique<shm_window>();
    MPI_Info info;
    check(MPI_Info_create(&info), "MPI_Info_create", sig);
    // Let each segment live in its owner's NUMA node; every rank queries all addresses anyway.
    const int set = MPI_Info_set(info, "alloc_shared_noncontig", "true");
    void* base = nullptr;
    const int made = set == MPI_SUCCESS ? MPI_Win_allocate_shared(MPI_Aint(2 * shm_piece_bytes), 1, info, comm_.c,
                                                                  &base, &w->win)
                                        : MPI_SUCCESS;
    MPI_Info_free(&info);
    check(set, "MPI_Info_set", sig);
    check(made, "MPI_Win_allocate_shared", sig);
    check(MPI_Win_set_errhandler(w->win, MPI_ERRORS_RETURN), "MPI_Win_set_errhandler", sig);
    check(MPI_Win_lock_all(MPI_MODE_NOCHECK, w->win), "MPI_Win_lock_all", sig);  // loads and stores need an epoch
    w->locked = true;
    w->segment.resize(std::size_t(size_));
    for (int r = 0; r < size_; ++r) {
      MPI_Aint bytes = 0;
      int unit = 0;
      check(MPI_Win_shared_query(w->win, r, &bytes, &unit, &w->segment[r]), "MPI_Win_shared_query", sig);
    }
    w->charged = &current_ledger();
    w->bytes = 2 * shm_piece_bytes;
    w->charged->allocate(category::comm_scratch, w->bytes);
    shm_ = std::move(w);
    return *shm_;
  }

  // Piece number `phase` of rank r lives in half phase % 2 of r's segment.
  template <class T>
  T* piece(int r, std::uint64_t phase) {
    return reinterpret_cast<T*>(shm_->segment[r] + (phase % 2) * shm_piece_bytes);
  }

  // Makes every rank's stores visible to all (the MPI-3 unified-model pattern).
  // One barrier after writing a piece is enough: a rank writes into a half again
  // only two pieces later, after a barrier that every rank reached only when done
  // reading that half (phases count across calls, so this holds between them too).
  void shm_barrier(const signature& sig) {
    check(MPI_Win_sync(shm_->win), "MPI_Win_sync", sig);
    check(MPI_Barrier(comm_.c), "MPI_Barrier", sig);
    check(MPI_Win_sync(shm_->win), "MPI_Win_sync", sig);
  }

  // Each piece: copy the part of every other rank's chunk into my segment, barrier,
  // reduce my chunk from all segments (my own part straight from send).
  template <class T>
  void shm_reduce_scatter(const T* send, T* recv, std::size_t n, reduce_op op, const signature& sig) {
    shm(sig);
    const std::size_t step = std::max<std::size_t>(1, shm_piece_bytes / (sizeof(T) * size_));  // per rank
    std::vector<const T*> srcs(static_cast<std::size_t>(size_));
    for (std::size_t lo = 0; lo < n; lo += step, ++phase_) {
      const std::size_t len = std::min(step, n - lo);
      T* mine = piece<T>(rank_, phase_);
      for (int r = 0; r < size_; ++r)
        if (r != rank_) std::memcpy(mine + r * step, send + r * n + lo, len * sizeof(T));
      shm_barrier(sig);
      for (int r = 0; r < size_; ++r) srcs[r] = r == rank_ ? send + r * n + lo : piece<T>(r, phase_) + rank_ * step;
      reduce_into(recv + lo, std::span<const T* const>(srcs), len, op);
    }
  }

  // Reduce-scatter then all-gather within each piece: rank r reduces range r of
  // the piece into range r of its own segment, then everyone copies all ranges.
  template <class T>
  void shm_all_reduce(const T* send, T* recv, std::size_t n, reduce_op op, const signature& sig) {
    shm(sig);
    const std::size_t step = shm_piece_bytes / sizeof(T);
    std::vector<const T*> srcs(static_cast<std::size_t>(size_));
    for (std::size_t lo = 0; lo < n; lo += step, ++phase_) {
      const std::size_t len = std::min(step, n - lo);
      auto range = [&](int r) { return std::pair{len * r / size_, len * (r + 1) / size_}; };
      const auto [a, b] = range(rank_);
      T* mine = piece<T>(rank_, phase_);
      std::memcpy(mine, send + lo, a * sizeof(T));
      std::memcpy(mine + b, send + lo + b, (len - b) * sizeof(T));
      shm_barrier(sig);
      for (int r = 0; r < size_; ++r) srcs[r] = r == rank_ ? send + lo + a : piece<T>(r, phase_) + a;
      reduce_into(mine + a, std::span<const T* const>(srcs), b - a, op);
      shm_barrier(sig);
      for (int r = 0; r < size_; ++r) {
        const auto [ra, rb] = range(r);
        std::memcpy(recv + lo + ra, piece<T>(r, phase_) + ra, (rb - ra) * sizeof(T));
      }
    }
  }

  owned_comm comm_;
  mpi_options opts_;
  std::shared_ptr<executor> exec_;
  int rank_;
  int size_ = 0;
  int thread_level_ = MPI_THREAD_SINGLE;
  bool one_node_ = false;
  std::unique_ptr<shm_window> shm_;  // declared after comm_: freed before it
  std::uint64_t phase_ = 0;          // shared-memory pieces done so far
  int world_rank_ = 0;
  std::uint64_t calls_ = 0;  // collectives issued, the current one included
  signature last_;           // the last one issued
  std::string departure_;    // set once a rank has left while this one called a collective
  bool departure_aborts_ = false;  // it left unwinding an exception
  int uncaught_at_creation_ = std::uncaught_exceptions();
};

}  // namespace detail

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
  // watchdog. A process whose peers failed exits with status 1 here even when its
  // own main succeeded: every process of a failed job says so.
  ~mpi_session() {
    if (!owner_ || detail::mpi_finalized()) return;
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
    int rank = -1, size = 0, world_rank = 0;
    detail::mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", rank, "wrapping a communicator");
    detail::mpi_check(MPI_Comm_size(comm, &size), "MPI_Comm_size", rank, "wrapping a communicator");
    detail::mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank", rank, "wrapping a communicator");
    mpi_options resolved = opts;
    resolved.timeout = detail::comm_timeout(opts.timeout);
    const detail::watchdog::scope watched(
        {detail::waiting_in::creating, rank, size, world_rank, 0, {}, *resolved.timeout, &detail::abort_job});
    MPI_Comm dup;
    detail::mpi_check(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup", rank, "creating a communicator");
    g_ = std::make_shared<detail::mpi_group>(dup, resolved, detail::process_executor(), rank);
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
  work all_gather_async(std::span<const T> send, std::span<T> recv) {
    return submit([=, g = g_.get()] { g->all_gather(send, recv); });
  }

  template <Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    g_->exec().drain();
    g_->reduce_scatter(send, recv, op);
  }
  template <Element T>
  work reduce_scatter_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
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
  work all_reduce_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return submit([=, g = g_.get()] { g->all_reduce(send, recv, op); });
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    g_->exec().drain();
    g_->broadcast(data, root);
  }
  template <Element T>
  work broadcast_async(std::span<T> data, int root) {
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
