// shardlib/comm/nccl_state.hpp — what the NcclComm handles of one communicator share: the NCCL
// communicator, its stream and the watchdog that aborts it on a timeout or an asynchronous error;
// and NcclComm's options.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"  // Communicator, reduce_op, check_communicator
#include "shardlib/comm/reduce.hpp"        // check_reducible
#include "shardlib/comm/signature.hpp"     // detail::signature, detail::describe
#include "shardlib/comm/store.hpp"         // TcpStore (from_store)
#include "shardlib/core/buffer.hpp"        // Buffer
#include "shardlib/core/element.hpp"       // Element, dtype_of
#include "shardlib/core/error.hpp"         // comm_error, shape_error, require, cat
#include "shardlib/core/ledger.hpp"        // category
#include "shardlib/cuda/error.hpp"         // check
#include "shardlib/cuda/memory_space.hpp"  // cuda_space
#include "shardlib/cuda/stream.hpp"        // device_guard, stream, event


#include <cuda_runtime.h>
#include <nccl.h>

#include <array>               // std::array
#include <chrono>              // std::chrono
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // std::size_t
#include <cstdint>             // std::int16_t, std::uint8_t
#include <cstdlib>             // std::getenv, std::strtol
#include <cstring>             // std::memcpy
#include <deque>               // std::deque
#include <filesystem>          // std::filesystem
#include <fstream>             // std::ifstream, std::ofstream
#include <memory>              // std::shared_ptr
#include <mutex>               // std::mutex
#include <span>                // std::span
#include <string>              // std::string
#include <thread>              // std::thread, std::this_thread
#include <type_traits>         // std::is_same_v
#include <utility>             // std::move

#include <unistd.h>  // getpid: a per-process name for the id file written before its rename

namespace shardlib::comm {

struct nccl_options {
  // An initialisation, split or collective that has not finished after this
  // long aborts the communicator (ncclCommAbort) and raises comm_error on this
  // rank, instead of hanging: a peer that died or called something else.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Check, before each collective, that the buffers are device memory of the
  // communicator's device (cudaPointerGetAttributes, about a microsecond), so a
  // host pointer raises comm_error instead of faulting inside NCCL.
  bool check_pointers = true;
};

namespace detail {

using nccl_clock = std::chrono::steady_clock;

// NCCL's last error takes a null communicator too: it keeps one per process (so with
// ranks as threads it may be another rank's), and an initialisation that failed before
// making its communicator says why.
inline std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  std::string t = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) t += cat(" (", last, ")");
  return t;
}

// A non-blocking communicator answers ncclInProgress while the work behind a
// call (connecting, splitting) still runs; poll its state until it settles or
// the deadline passes (then `timed_out` is set and ncclInProgress returned).
inline ncclResult_t settle(ncclComm_t comm, ncclResult_t r, nccl_clock::time_point deadline, bool& timed_out) {
  timed_out = false;
  while (r == ncclInProgress) {
    if (nccl_clock::now() > deadline) {
      timed_out = true;
      return r;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    r = q != ncclSuccess ? q : state;
  }
  return r;
}

// Makes `comm` (just created, maybe still connecting) usable or throws,
// aborting it when it does not settle in time.
inline void settle_new(ncclComm_t comm, ncclResult_t r, const nccl_options& o, int rank, const char* doing) {
  bool timed_out = false;
  r = settle(comm, r, nccl_clock::now() + o.timeout, timed_out);
  if (timed_out) {
    (void)ncclCommAbort(comm);
    throw comm_error(cat("rank ", rank, ": ", doing, " timed out after ", o.timeout.count(),
                         " ms (did every rank start it, with the same id?); the communicator was aborted"));
  }
  if (r != ncclSuccess) {
    const std::string text = nccl_text(r, comm);
    (void)ncclCommAbort(comm);
    throw comm_error(cat("rank ", rank, ": ", doing, " failed: ", text));
  }
}

inline ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // calls return at once: initialisation and splits can time out
  return config;
}

// What the NcclComm handles of one communicator share: the NCCL communicator,
// its stream (shared with the communicators split from it, so that all of them
// run in issue order, as ThreadComm's executor does), and a watchdog thread.
//
// The watchdog follows the event recorded after each collective. When the
// oldest unfinished one is older than the timeout, or NCCL reports an
// asynchronous error (ncclCommGetAsyncError), it aborts the communicator: the
// stuck kernels exit, and every later call on this communicator throws the
// reason. The mutex keeps the communicator alive while a call uses it.
class nccl_state {
 public:
  // Made with `device` current (the event and the scratch live there).
  nccl_state(ncclComm_t comm, int device, std::shared_ptr<cuda::stream> s, const nccl_options& o)
      : comm_(comm), device_(device), stream_(std::move(s)), options_(o), scratch_(1, category::comm_scratch) {
    check_nccl(ncclCommUserRank(comm, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm, &size_), "ncclCommCount");
    watchdog_ = std::thread([this] { watch(); });
  }
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;
  ~nccl_state() {
    {
      std::lock_guard lock(watch_m_);
      stopping_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
    std::lock_guard lock(m_);
    if (aborted_) return;
    // Finalize flushes the outstanding work; if that does not settle in time
    // (a peer is gone), abort rather than hang in a destructor.
    bool timed_out = false;
    const ncclResult_t r = settle(comm_, ncclCommFinalize(comm_), nccl_clock::now() + options_.timeout, timed_out);
    if (r == ncclSuccess) (void)ncclCommDestroy(comm_);
    else (void)ncclCommAbort(comm_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  ncclComm_t native() const { return comm_; }
  const nccl_options& options() const { return options_; }
  const std::shared_ptr<cuda::stream>& comm_stream() const { return stream_; }
  float* scratch() { return scratch_.data(); }

  // Enqueues f(comm, comm_stream) after the work issued on `compute` so far;
  // returns the event that completes with it, which the watchdog follows.
  template <class F>
  std::shared_ptr<cuda::event> enqueue(cudaStream_t compute, const signature& sig, F f) {
    cuda::device_guard g(device_);
    auto done = std::make_shared<cuda::event>();
    std::lock_guard lock(m_);
    throw_if_aborted_locked();
    // The comm stream waits on the device for the inputs (the llm.c pattern):
    // the host never blocks to order a collective.
    order_.record(compute);
    order_.make_wait(stream_->get());
    run_locked(f(comm_, stream_->get()), sig);
    done->record(stream_->get());
    {
      std::lock_guard w(watch_m_);
      pending_.push_back({done, sig, nccl_clock::now() + options_.timeout});
    }
    return done;
  }

  // A host-side NCCL call on the communicator (ncclCommSplit).
  template <class F>
  void call(F f, const std::string& what) {
    std::lock_guard lock(m_);
    throw_if_aborted_locked();
    run_locked(f(comm_), what);
  }

  // Blocks the host until `done` has completed, polling NCCL's asynchronous
  // errors; aborts the communicator after the timeout.
  void wait_host(const cuda::event& done, const signature& sig) {
    const auto deadline = nccl_clock::now() + options_.timeout;
    for (int polls = 0;; ++polls) {
      if (done.ready()) return;
      {
        std::lock_guard lock(m_);
        throw_if_aborted_locked();
        poll_async_error_locked();
        if (nccl_clock::now() > deadline)
          abort_locked(cat(describe(sig), " did not finish within ", options_.timeout.count(), " ms"));
        throw_if_aborted_locked();
      }
      if (polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  void throw_if_aborted() {
    std::lock_guard lock(m_);
    throw_if_aborted_locked();
  }

  void abort(const std::string& why) {
    std::lock_guard lock(m_);
    abort_locked(why);
  }

 private:
  struct pending {
    std::shared_ptr<cuda::event> done;
    signature sig;
    nccl_clock::time_point deadline;
  };

  void check_nccl(ncclResult_t r, const char* call) const {
    if (r != ncclSuccess) throw comm_error(cat("rank ", rank_, ": ", call, " failed: ", nccl_text(r, comm_)));
  }

  // what: a signature or a call's name, turned into text only on failure.
  template <class What>
  void run_locked(ncclResult_t r, const What& what) {
    bool timed_out = false;
    r = settle(comm_, r, nccl_clock::now() + options_.timeout, timed_out);
    if (timed_out) abort_locked(cat(text(what), " was not accepted within ", options_.timeout.count(), " ms"));
    throw_if_aborted_locked();
    if (r != ncclSuccess) throw comm_error(cat("rank ", rank_, "/", size_, ": NCCL ", text(what),
                                               " failed on device ", device_, ": ", nccl_text(r, comm_)));
  }
  static std::string text(const signature& s) { return describe(s); }
  static std::string text(const std::string& s) { return s; }

  void poll_async_error_locked() {
    if (aborted_) return;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
    const ncclResult_t r = q != ncclSuccess ? q : state;
    if (r != ncclSuccess && r != ncclInProgress) abort_locked(cat("NCCL reported an error: ", nccl_text(r, comm_)));
  }

  void abort_locked(const std::string& why) {
    if (aborted_) return;
    (void)ncclCommAbort(comm_);
    aborted_ = true;
    why_ = why;
  }

  void throw_if_aborted_locked() const {
    if (aborted_)
      throw comm_error(cat("rank ", rank_, "/", size_, ": the NCCL communicator on device ", device_,
                           " was aborted: ", why_));
  }

  void watch() {
    (void)cudaSetDevice(device_);  // event queries from this thread use the communicator's device
    std::unique_lock lock(watch_m_);
    while (!stopping_) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(20));
      // The comm stream completes its work in order: only the oldest matters.
      while (!pending_.empty() && cudaEventQuery(pending_.front().done->get()) == cudaSuccess) pending_.pop_front();
      if (pending_.empty()) continue;
      const pending oldest = pending_.front();
      lock.unlock();  // m_ before watch_m_, never the other way (enqueue takes them in that order)
      {
        std::lock_guard comm_lock(m_);
        poll_async_error_locked();
        if (nccl_clock::now() > oldest.deadline)
          abort_locked(cat(describe(oldest.sig), " did not finish within ", options_.timeout.count(), " ms"));
      }
      lock.lock();
      if (aborted_) pending_.clear();
    }
  }

  ncclComm_t comm_;
  int rank_ = 0, size_ = 0;
  int device_;
  std::shared_ptr<cuda::stream> stream_;
  nccl_options options_;
  cuda::event order_;                  // compute stream -> comm stream
  Buffer<float, cuda_space> scratch_;  // barrier's all-reduce

  std::mutex m_;  // the communicator: calls, polls, abort
  bool aborted_ = false;
  std::string why_;

  std::mutex watch_m_;  // pending_ and stopping_
  std::condition_variable watch_cv_;
  std::deque<pending> pending_;
  bool stopping_ = false;
  std::thread watchdog_;
};

}  // namespace detail

}  // namespace shardlib::comm
