// shardlib/comm/launch.hpp — launch(W, fn): run fn on W rank threads, like torch.multiprocessing.spawn.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/thread_comm.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/ledger.hpp"

#include <exception>    // std::exception_ptr, std::rethrow_exception
#include <functional>   // std::invoke
#include <memory>       // std::make_shared, std::make_unique, std::unique_ptr
#include <mutex>        // std::mutex
#include <numeric>      // std::iota
#include <string>       // std::string
#include <thread>       // std::thread
#include <type_traits>  // std::is_invocable_v
#include <vector>       // std::vector

namespace shardlib::comm {

// An exception escaped the function of one rank; what() names the rank and
// carries the original message, and nested() gives the original exception.
class rank_failure : public error {
 public:
  rank_failure(int rank, int size, std::exception_ptr original, const std::string& what)
      : error(cat("rank ", rank, " of ", size, " failed: ", what)), rank_(rank), original_(std::move(original)) {}
  int rank() const { return rank_; }
  [[noreturn]] void rethrow_nested() const { std::rethrow_exception(original_); }

 private:
  int rank_;
  std::exception_ptr original_;
};

namespace detail {
// A rank's ledger that still counts bytes after its launch: what the caller kept
// releases into it later, so it stays (reachable, never destroyed) for the process.
inline void keep_for_the_process(std::unique_ptr<ledger> l) {
  static std::mutex m;
  static auto* kept = new std::vector<std::unique_ptr<ledger>>();
  std::lock_guard lock(m);
  kept->push_back(std::move(l));
}
}  // namespace detail

// Runs fn(ThreadComm&) on `world_size` threads, one per rank, each with its own
// memory ledger. Returns when all ranks have returned. If any rank throws, the
// others are woken out of any collective they wait in and refused any later one
// (comm_aborted naming the rank), and the first failure is re-raised here as
// rank_failure naming its rank. A rank's function has unwound (its buffers are
// gone) before others are woken; a collective that completed, even with an
// error, no longer reads this rank's buffers (ThreadComm), so unwinding only
// needs to wait for what it issued.
// fn may also take (ThreadComm&, ledger&) to read its rank's ledger afterwards.
// What a rank allocates is counted in its ledger, which outlives the rank's thread
// (its thread-local objects release into it as the thread ends) and, while it still
// counts bytes when launch returns (a tensor the caller kept), the process.
template <class Fn>
void launch(int world_size, Fn&& fn) {
  require(world_size >= 1, "launch: the world size must be at least 1, got ", world_size);
  auto world = std::make_shared<detail::world_state>(world_size);
  std::vector<int> ranks(world_size);
  std::iota(ranks.begin(), ranks.end(), 0);
  auto top = std::make_shared<detail::group>(world, ranks);
  world->groups.push_back(top);

  std::mutex failure_m;
  int failed_rank = -1;
  std::exception_ptr failure;
  std::string failure_what;
  bool failure_is_consequence = false;

  auto record = [&](int r, std::exception_ptr e, std::string what, bool consequence) {
    {
      std::lock_guard lock(failure_m);
      if (!failure || (failure_is_consequence && !consequence)) {
        failure = std::move(e);
        failed_rank = r;
        failure_what = std::move(what);
        failure_is_consequence = consequence;
      }
    }
    int none = -1;
    world->failed.compare_exchange_strong(none, r);  // the first rank to fail is the one others name
    world->wake_all();
  };

  std::vector<std::unique_ptr<ledger>> ledgers(static_cast<std::size_t>(world_size));
  for (auto& l : ledgers) l = std::make_unique<ledger>();
  auto body = [&](int r) {
    ledger& own = *ledgers[std::size_t(r)];
    ledger_scope scope(own);
    const auto failed = [&] {
      auto e = std::current_exception();
      std::string what = "unknown exception";
      bool consequence = false;  // woken because another rank failed first
      try {
        std::rethrow_exception(e);
      } catch (const comm_aborted& x) {
        what = x.what();
        consequence = true;
      } catch (const std::exception& x) {
        what = x.what();
      } catch (...) {
      }
      record(r, e, std::move(what), consequence);
    };
    try {
      ThreadComm comm(top, r, std::make_shared<executor>());
      try {
        if constexpr (std::is_invocable_v<Fn&, ThreadComm&, ledger&>)
          std::invoke(fn, comm, own);
        else
          std::invoke(fn, comm);
      } catch (...) {
        // Recorded before the communicator's worker ends: what this rank had queued
        // then abandons at once, rather than wait for ranks that know nothing of it.
        failed();
        return;
      }
    } catch (...) {  // the communicator could not be made
      failed();
      return;
    }
    world->exited[r].store(true);  // once the communicator (and its worker) has ended
    world->wake_all();
  };

  // A rank whose thread cannot start (the process is out of threads or memory)
  // fails like one whose function throws: the started ranks are woken out of the
  // collectives that wait for it, and its error is raised here once they end.
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    try {
      threads.emplace_back(body, r);
    } catch (const std::exception& x) {
      record(r, std::current_exception(), cat("its thread could not start: ", x.what()), false);
      break;
    }
  }
  for (auto& t : threads) t.join();
  for (auto& l : ledgers)
    if (l->in_use()) detail::keep_for_the_process(std::move(l));
  if (failure) throw rank_failure(failed_rank, world_size, failure, failure_what);
}

}  // namespace shardlib::comm
