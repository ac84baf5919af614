// shardlib/comm/mpi_departures.hpp — the leaves a process posts while unwinding an
// exception, finished later: a rank that fails while it holds several communicators
// must not wait in one of them for a peer that waits for it in another.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/mpi_support.hpp"
#include "shardlib/comm/watchdog.hpp"

#include <mpi.h>

#include <algorithm>  // std::any_of
#include <array>      // std::array
#include <atomic>     // std::atomic
#include <chrono>     // std::chrono::steady_clock, std::chrono::microseconds
#include <cstddef>    // std::size_t
#include <cstdint>    // std::int64_t
#include <memory>     // std::unique_ptr
#include <mutex>      // std::mutex, std::lock_guard
#include <thread>     // std::this_thread::sleep_for, std::this_thread::yield
#include <utility>    // std::move
#include <vector>     // std::vector, std::erase_if

namespace shardlib::comm::detail {

// What each rank posts to a communicator's agreement (mpi_group::exchange): its
// signature and arrival as `posting_fields` integers. The exchange is one
// MPI_Iallreduce(MAX) of the fields and their negations (`bounds`), then, only
// where they differ between ranks, an MPI_Iallgather of every posting. Both are
// nonblocking collectives because a departure (below) posts them without waiting,
// and MPI matches nonblocking collectives only with nonblocking ones.
inline constexpr int posting_fields = 6;
using posting = std::array<std::int64_t, posting_fields>;
using posting_bounds = std::array<std::int64_t, 2 * posting_fields>;

inline posting_bounds bounds_of(const posting& p) {
  posting_bounds b;
  for (int i = 0; i < posting_fields; ++i) b[i] = p[i], b[posting_fields + i] = -p[i];
  return b;
}
inline bool uniform(const posting_bounds& b) {
  for (int i = 0; i < posting_fields; ++i)
    if (b[i] != -b[posting_fields + i]) return false;
  return true;
}

// A rank unwinding an exception leaves each communicator it drops by posting its
// exchange and moving it on for a grace; what is left then, the process moves on
// while it waits in any other exchange, a communicator's creation or the meeting
// before an unchecked communicator frees its window, and finishes before an
// unchecked collective and before MPI_Finalize. (Waiting without bound
// could deadlock: its peer in this communicator may be waiting for it in another
// one, which this rank leaves next.) Each departure owns its communicator until done.
class departures {
 public:
  static departures& process() {
    static departures d;
    return d;
  }

  // Posts `mine` (a leaving_unwinding posting) on comm, which it takes over, and moves
  // it on for up to `grace`: where the peers already wait in this communicator (most
  // failures), the leave ends here, as a blocking one would, and nothing is left to
  // finish while the process goes on.
  void post(MPI_Comm comm, const posting& mine, const watch& w, seconds grace) {
    auto d = std::make_unique<departure>(comm, mine, w);
    {
      std::lock_guard lock(m_);
      if (!hooked_) finish_at_finalize(w.rank);
    }
    mpi_check(MPI_Iallreduce(MPI_IN_PLACE, d->bounds.data(), 2 * posting_fields, MPI_INT64_T, MPI_MAX, comm,
                             &d->request),
              "MPI_Iallreduce", w.rank, "leaving a communicator");
    const departure* posted = d.get();
    {
      std::lock_guard lock(m_);
      pending_.push_back(std::move(d));
      count_ = pending_.size();
    }
    const auto until = std::chrono::steady_clock::now() + grace;
    while (holds(posted) && std::chrono::steady_clock::now() < until) {
      progress();
      pause();
    }
  }

  bool empty() const { return count_ == 0; }  // no lock: checked before every unchecked collective

  // Moves every pending departure on as far as it goes without waiting.
  void progress() {
    std::lock_guard lock(m_);
    std::erase_if(pending_, [](const std::unique_ptr<departure>& d) { return d->advance(); });
    count_ = pending_.size();
  }

  // Waits until every departure is done, each watched (the watchdog ends the job
  // where a peer never posts its side).
  void finish() {
    for (;;) {
      const departure* first = nullptr;
      watch w;
      {
        std::lock_guard lock(m_);
        if (pending_.empty()) return;
        first = pending_.front().get();
        w = first->watched;
      }
      const watchdog::scope watched(w);
      while (front() == first) {
        progress();
        pause();
      }
    }
  }

  // Between two looks at the departures: the awaited peer may need this core.
  static void pause() { std::this_thread::sleep_for(std::chrono::microseconds(50)); }

 private:
  struct departure {
    owned_comm comm;
    posting mine;
    posting_bounds bounds;
    std::vector<posting> all;  // the gather, when the bounds differ
    MPI_Request request = MPI_REQUEST_NULL;
    watch watched;

    departure(MPI_Comm c, const posting& p, const watch& w) : comm(c), mine(p), bounds(bounds_of(p)), watched(w) {}

    // Tests the exchange; true once it is over. An MPI error ends it too: the process
    // is failing already, and its peers' own exchanges report what they see.
    bool advance() {
      int done = 0;
      if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return true;
      if (!done) return false;
      if (!all.empty() || uniform(bounds)) return true;
      int size = 0;
      MPI_Comm_size(comm.c, &size);
      all.resize(std::size_t(size));
      return MPI_Iallgather(mine.data(), posting_fields, MPI_INT64_T, all.data(), posting_fields, MPI_INT64_T,
                            comm.c, &request) != MPI_SUCCESS;
    }
  };

  const departure* front() {
    if (empty()) return nullptr;
    std::lock_guard lock(m_);
    return pending_.empty() ? nullptr : pending_.front().get();
  }
  bool holds(const departure* d) {
    std::lock_guard lock(m_);
    return std::any_of(pending_.begin(), pending_.end(), [&](const auto& p) { return p.get() == d; });
  }

  // Under an MPI that no mpi_session finalises, MPI_Finalize's first act (deleting
  // MPI_COMM_SELF's attributes) finishes the departures.
  void finish_at_finalize(int rank) {
    int key = MPI_KEYVAL_INVALID;
    const auto at_finalize = [](MPI_Comm, int, void*, void*) {
      departures::process().finish();
      return MPI_SUCCESS;
    };
    mpi_check(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, at_finalize, &key, nullptr), "MPI_Comm_create_keyval",
              rank, "leaving a communicator");
    mpi_check(MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr), "MPI_Comm_set_attr", rank, "leaving a communicator");
    mpi_check(MPI_Comm_free_keyval(&key), "MPI_Comm_free_keyval", rank, "leaving a communicator");
    hooked_ = true;
  }

  std::mutex m_;
  std::vector<std::unique_ptr<departure>> pending_;
  std::atomic<std::size_t> count_ = 0;  // pending_.size()
  bool hooked_ = false;
};

// Waits for a request of the process's own (an exchange, a communicator's creation),
// moving its departures on meanwhile: a peer may wait for this rank's side of one
// before it posts its side of this. Returns MPI's code.
// (It yields between looks, where a departure's own waits sleep: an exchange is on the
// way of every collective.)
inline int wait_moving_departures(MPI_Request& request) {
  departures& d = departures::process();
  if (d.empty()) return MPI_Wait(&request, MPI_STATUS_IGNORE);
  for (int done = 0; !done; d.progress()) {
    if (const int rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) return rc;
    std::this_thread::yield();
  }
  return MPI_SUCCESS;
}

}  // namespace shardlib::comm::detail
