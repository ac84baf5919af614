// shardlib/comm/executor.hpp — executor: a rank's communication worker thread.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/ledger.hpp"

#include <condition_variable>  // std::condition_variable
#include <deque>               // std::deque
#include <functional>          // std::function
#include <memory>              // std::shared_ptr
#include <mutex>               // std::mutex
#include <thread>              // std::thread

namespace shardlib::comm {

// Runs a rank's asynchronous collectives on one background thread, in the order
// they were issued. Every rank issues collectives in the same order, so the
// workers of all ranks meet in the same collectives (as a NCCL stream does).
// A blocking collective first drains the queue and then runs on the caller, so
// blocking and asynchronous calls keep one order too. The worker allocates into
// the ledger of the rank that created the executor.
class executor {
 public:
  executor() : ledger_(&current_ledger()) {}
  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;
  ~executor() {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  // Queues fn; the returned work finishes when fn has run (rethrowing its error).
  work submit(std::function<void()> fn) {
    auto state = std::make_shared<work_state>();
    {
      std::lock_guard lock(m_);
      if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
      queue_.push_back({std::move(fn), state});
      ++pending_;
    }
    cv_.notify_all();
    return work(state);
  }

  // Blocks until every queued job has run (their errors stay with their work).
  void drain() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  struct job {
    std::function<void()> fn;
    std::shared_ptr<work_state> state;
  };

  void run() {
    ledger_scope scope(*ledger_);
    for (;;) {
      job j;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and nothing left
        j = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr failure;
      try {
        j.fn();
      } catch (...) {
        failure = std::current_exception();
      }
      j.state->finish(std::move(failure));
      {
        std::lock_guard lock(m_);
        --pending_;
      }
      idle_.notify_all();
    }
  }

  ledger* ledger_;
  std::mutex m_;
  std::condition_variable cv_, idle_;
  std::deque<job> queue_;
  int pending_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace shardlib::comm
