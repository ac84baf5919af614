// shardlib/comm/work.hpp — work: the handle an asynchronous collective returns.
#pragma once
#include "shardlib/config.hpp"

#include <atomic>              // std::atomic
#include <condition_variable>  // std::condition_variable
#include <exception>           // std::exception_ptr
#include <memory>              // std::shared_ptr
#include <mutex>               // std::mutex
#include <utility>             // std::move

namespace shardlib::comm {

// Completion state shared between the issuing rank and the worker that runs the
// collective. Finished exactly once, with or without an exception.
struct work_state {
  std::atomic<bool> done{false};
  std::exception_ptr failure;  // written before `done` is set
  std::mutex m;
  std::condition_variable cv;

  // Takes the worker's only reference to the error, so that the state, released
  // through shared_ptr's counted (and ThreadSanitizer-visible) references, releases
  // it last: ThreadSanitizer cannot see exception_ptr's own reference count, so a
  // release on the worker after a catch on the issuing rank would read as a race.
  void finish(std::exception_ptr e = nullptr) {
    {
      std::lock_guard lock(m);
      failure = std::move(e);
      done.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }
};

// wait() blocks until the collective has finished and rethrows its error, each time
// it is called, as NcclComm's handle does; test() says whether it has finished
// without blocking (and rethrows too).
// A default-constructed work is already complete. Destroying a work does not wait:
// the collective still reads and writes its buffers, which must outlive it (wait()
// first, also on the way out of an exception). The communicators' _async methods are
// [[nodiscard]]; the class is not, as nvcc would then warn on every assignment of one
// (operator= returns a reference to it).
class work {
 public:
  work() = default;
  explicit work(std::shared_ptr<work_state> s) : s_(std::move(s)) {}

  void wait() {
    if (!s_) return;
    if (!s_->done.load(std::memory_order_acquire)) {
      std::unique_lock lock(s_->m);
      s_->cv.wait(lock, [&] { return s_->done.load(std::memory_order_acquire); });
    }
    rethrow();
  }

  bool test() {
    if (!s_) return true;
    if (!s_->done.load(std::memory_order_acquire)) return false;
    rethrow();
    return true;
  }

 private:
  void rethrow() {
    if (s_->failure) std::rethrow_exception(s_->failure);
  }
  std::shared_ptr<work_state> s_;
};

}  // namespace shardlib::comm
