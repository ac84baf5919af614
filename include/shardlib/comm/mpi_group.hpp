// shardlib/comm/mpi_group.hpp — the ranks of one MpiComm and its collectives: the agreement
// check before each, the shared-memory reductions, and the protocol by which a leaving rank is seen.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/mpi_departures.hpp"
#include "shardlib/comm/mpi_support.hpp"
#include "shardlib/comm/signature.hpp"
#include "shardlib/comm/watchdog.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/buffer.hpp"

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

namespace shardlib::comm::detail {

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
    check_reducible(op, dtype_of<T>, rank_, "reduce_scatter");
    if (use_shm()) return shm_reduce_scatter(send.data(), recv.data(), n, op, sig);
    if constexpr (std::is_same_v<T, half>)
      if (op == reduce_op::avg) return half_mean(send, recv, sig);
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
    check_reducible(op, dtype_of<T>, rank_, "all_reduce");
    if (use_shm()) return shm_all_reduce(send.data(), recv.data(), n, op, sig);
    if constexpr (std::is_same_v<T, half>)
      if (op == reduce_op::avg) return half_mean(send, recv, sig);
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
    // Without the check the collective blocks at once: the process's departures end
    // first, as the leaves they stand for did when they waited.
    if (!opts_.check) departures::process().finish();
    last_ = sig;
    return watchdog::scope(watching(waiting_in::collective));
  }

  watch watching(waiting_in what) const {
    return {what, rank_, size_, world_rank_, calls_, last_, *opts_.timeout, &abort_job};
  }

  // What each rank posts to the agreement: its signature and its arrival.
  static posting post(const signature& s, arrival a) {
    return {std::int64_t(s.kind), std::int64_t(s.type), std::int64_t(s.count),
            std::int64_t(s.op),   std::int64_t(s.root), std::int64_t(a)};
  }
  static signature signature_of(const posting& p) {
    return {op_kind(p[0]), dtype(p[1]), std::size_t(p[2]), reduce_op(p[3]), int(p[4])};
  }
  static arrival arrival_of(const posting& p) { return arrival(p[5]); }

  // Every rank's posting, or none when all ranks posted the same (mpi_departures.hpp:
  // posting_bounds yields every field's maximum and minimum over ranks; only on a
  // mismatch do the ranks gather all postings to say who called what).
  std::vector<posting> exchange(const posting& mine, const signature& sig) {
    posting_bounds bounds = bounds_of(mine);
    MPI_Request request;
    check(MPI_Iallreduce(MPI_IN_PLACE, bounds.data(), 2 * posting_fields, MPI_INT64_T, MPI_MAX, comm_.c, &request),
          "MPI_Iallreduce", sig);
    wait(request, "MPI_Iallreduce", sig);
    if (uniform(bounds)) return {};
    std::vector<posting> all(static_cast<std::size_t>(size_));
    check(MPI_Iallgather(mine.data(), posting_fields, MPI_INT64_T, all.data(), posting_fields, MPI_INT64_T, comm_.c,
                         &request),
          "MPI_Iallgather", sig);
    wait(request, "MPI_Iallgather", sig);
    return all;
  }

  void wait(MPI_Request& request, std::string_view call, const signature& sig) const {
    check(wait_moving_departures(request), call, sig);
  }

  // Raises on every rank, before any data moves, when the ranks post different
  // signatures, when a rank's validate() throws (its own buffers are wrong: that
  // rank rethrows its error and the others raise comm_aborted), or when a rank has
  // left the group instead (see leave()).
  template <class Validate>
  void agree(const signature& sig, Validate&& validate) {
    const std::exception_ptr invalid = invalid_call(validate);
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
    const auto name = [&](int r) { return name_of(r); };
    for (int r = 0; r < size_; ++r)
      if (arrival_of(all[r]) == arrival::invalid)
        throw invalid_elsewhere(rank_, sig, r, signature_of(all[r]), {}, name);
    for (int r = 1; r < size_; ++r)
      if (!(signature_of(all[r]) == signature_of(all[0])))
        throw disagreement(rank_, signature_of(all[0]), r, signature_of(all[r]), name);
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
  // MPI_Win_free. A rank unwinding an exception posts its side and waits for it only
  // a grace (the process finishes it later: mpi_departures.hpp), the communicator
  // going with it, and leaves the window to MPI_Finalize too. Without the check there is no
  // agreement to join, and a peer left waiting is ended by the watchdog.
  void leave() noexcept {
    const watchdog::scope watched(watching(waiting_in::leaving));
    bool stays = !departure_.empty();
    const bool unwinding = std::uncaught_exceptions() > uncaught_at_creation_;
    if (opts_.check && !stays && unwinding) {
      try {  // the departure owns the communicator from here, and frees it even if posting fails
        const seconds grace = std::min(seconds(1), *opts_.timeout / 10);
        departures::process().post(std::exchange(comm_.c, MPI_COMM_NULL), post(last_, arrival::leaving_unwinding),
                                   watching(waiting_in::leaving), opts_.timeout->count() > 0 ? grace : seconds(1));
      } catch (...) {
      }
      stays = true;
    } else if (opts_.check && !stays) {
      try {
        const auto all = exchange(post(last_, arrival::leaving), last_);
        std::string failure;
        for (int r = 0; r < int(all.size()); ++r) {
          const arrival a = arrival_of(all[r]);
          stays = stays || a != arrival::leaving;  // a peer unwinding left the window to MPI_Finalize
          if (a == arrival::leaving || !failure.empty()) continue;
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
    if (!opts_.check && shm_) {  // MPI_Win_free blocks: meet the others first, moving departures on
      MPI_Request request;
      if (MPI_Ibarrier(comm_.c, &request) == MPI_SUCCESS) (void)wait_moving_departures(request);
    }
    shm_.reset();  // MPI_Win_free, still watched
  }

  // MPI's own half sums round at every step, so a sum divided afterwards overflows
  // where the mean would not (ranks' 60000 each): half means are summed in float and
  // rounded once, as the shared-memory path and ThreadComm do, at twice the bytes.
  // (bfloat16 has float's range: its sums take the usual path.)
  void half_mean(std::span<const half> send, std::span<half> recv, const signature& sig) {
    const std::size_t n = recv.size();
    Buffer<float> wide(send.size(), category::comm_scratch), sum(n, category::comm_scratch);
    for (std::size_t i = 0; i < send.size(); ++i) wide.data()[i] = float(send[i]);
    if (sig.kind == op_kind::all_reduce)
      check(MPI_Allreduce(wide.data(), sum.data(), mpi_count(n, sig), MPI_FLOAT, MPI_SUM, comm_.c), "MPI_Allreduce",
            sig);
    else
      check(MPI_Reduce_scatter_block(wide.data(), sum.data(), mpi_count(n, sig), MPI_FLOAT, MPI_SUM, comm_.c),
            "MPI_Reduce_scatter_block", sig);
    for (std::size_t i = 0; i < n; ++i) recv[i] = half(sum.data()[i] / float(size_));
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


}  // namespace shardlib::comm::detail
