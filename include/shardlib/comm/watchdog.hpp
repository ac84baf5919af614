// shardlib/comm/watchdog.hpp — the process's watchdog: a wait on other ranks that
// outlasts its limit becomes a message and the end of the job instead of a hang.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/signature.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>           // std::clamp
#include <atomic>              // std::atomic
#include <chrono>              // std::chrono
#include <condition_variable>  // std::condition_variable_any
#include <cstdint>             // std::uint64_t
#include <cstdio>              // std::fputs, std::fflush
#include <cstdlib>             // std::getenv, std::strtod
#include <mutex>               // std::mutex
#include <optional>            // std::optional
#include <stop_token>          // std::stop_token
#include <string>              // std::string
#include <thread>              // std::jthread

namespace shardlib::comm {

// NCCL's and PyTorch's default for a collective that does not complete.
inline constexpr std::chrono::duration<double> default_comm_timeout{600};

namespace detail {

using seconds = std::chrono::duration<double>;

// The limit a communicator uses: `configured` when given, else the
// SHARDLIB_COMM_TIMEOUT environment variable (seconds), else default_comm_timeout.
// Zero or infinite ("inf") means no limit; NaN is refused.
inline seconds comm_timeout(std::optional<seconds> configured) {
  if (configured) {
    require<comm_error>(configured->count() >= 0, "communicator timeout must be >= 0 s, got ", configured->count());
    return *configured;
  }
  const char* env = std::getenv("SHARDLIB_COMM_TIMEOUT");
  if (!env || !*env) return default_comm_timeout;
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  require<comm_error>(*end == '\0' && s >= 0, "SHARDLIB_COMM_TIMEOUT must be a number of seconds >= 0, got '", env,
                      "'");
  return seconds(s);
}

// What a rank waits in, for the watchdog's message.
enum class waiting_in { creating, collective, leaving, finalizing };

struct watch {
  waiting_in what = waiting_in::collective;
  int rank = 0, size = 0;  // in the communicator
  int world_rank = 0;
  std::uint64_t seq = 0;   // collectives issued on the communicator, this one included
  signature sig;           // this collective, or the last one when leaving
  seconds limit{};
  void (*abort)() = nullptr;  // ends the job once the message is out
};

inline std::string describe(const watch& w) {
  const std::string who =
      w.rank == w.world_rank ? cat("rank ", w.rank) : cat("rank ", w.rank, " (world rank ", w.world_rank, ")");
  const std::string last = w.seq ? cat("collective ", w.seq, ", ", describe(w.sig)) : std::string("no collective");
  switch (w.what) {
    case waiting_in::creating: return cat(who, ": creating a communicator of ", w.size, " ranks");
    case waiting_in::collective:
      return cat(who, ": ", describe(w.sig), ", collective ", w.seq, " on a communicator of ", w.size, " ranks,");
    case waiting_in::leaving: return cat(who, ": leaving a communicator of ", w.size, " ranks after ", last, ",");
    case waiting_in::finalizing: return cat(who, ": MPI_Finalize");
  }
  return who;
}

// One thread per process, started by the first wait with a limit. The process
// makes one MPI call at a time (MpiComm serialises them), so one slot holds the
// current wait: arm() before, disarm() after. Arming takes an uncontended mutex and
// no clock: the thread samples the slot every tenth of the limit (1 s at most) and
// reports a wait it has seen armed, under the same token, for the limit; so it
// fires at most two sample periods late.
class watchdog {
 public:
  static watchdog& process() {
    static watchdog w;
    return w;
  }

  // One thread arms and disarms at a time (MpiComm drains the asynchronous worker
  // before its own calls); the token's increments are atomic all the same.
  void arm(const watch& w) {
    std::lock_guard lock(m_);
    slot_ = w;
    bump();  // odd: armed
  }
  void disarm() { bump(); }

  // Disarms at scope exit; a zero limit arms nothing.
  class scope {
   public:
    explicit scope(const watch& w) : armed_(w.limit.count() > 0) {
      if (armed_) process().arm(w);
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() {
      if (armed_) process().disarm();
    }

   private:
    bool armed_;
  };

 private:
  watchdog()
      : thread_([this](std::stop_token stop) { run(stop); }) {}

  void run(std::stop_token stop) {
    using clock = std::chrono::steady_clock;
    std::uint64_t seen = 0;
    clock::time_point since;
    std::unique_lock lock(m_);
    for (seconds period{1};; ) {
      if (wake_.wait_for(lock, stop, period, [] { return false; }) || stop.stop_requested()) return;
      const std::uint64_t token = token_.load(std::memory_order_acquire);
      if (token % 2 == 0) continue;
      period = std::clamp(slot_.limit / 10, seconds(0.01), seconds(1));
      if (token != seen) {
        seen = token;
        since = clock::now();
      } else if (clock::now() - since >= slot_.limit) {
        std::fputs(cat(describe(slot_), " has not completed within ", slot_.limit.count(),
                       " s (mpi_options::timeout, SHARDLIB_COMM_TIMEOUT): another rank has stopped, hangs or waits in "
                       "a different call; aborting the job\n")
                       .c_str(),
                   stderr);
        std::fflush(stderr);
        slot_.abort();
        return;
      }
    }
  }

  void bump() { token_.fetch_add(1, std::memory_order_release); }

  std::mutex m_;
  std::condition_variable_any wake_;  // only the stop request wakes it early
  std::atomic<std::uint64_t> token_{0};
  watch slot_;
  std::jthread thread_;  // last: it stops and joins before the rest goes
};

}  // namespace detail
}  // namespace shardlib::comm
