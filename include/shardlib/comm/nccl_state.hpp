// shardlib/comm/nccl_state.hpp — what the NcclComm handles of one communicator share: the NCCL
// communicator, its stream and the watchdog that aborts it on a timeout or an asynchronous error;
// and NcclComm's options.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"  // Communicator, reduce_op, check_communicator
#include "shardlib/comm/reduce.hpp"        // check_reducible
#include "shardlib/comm/signature.hpp"     // detail::signature, detail::describe
#include "shardlib/comm/store.hpp"         // TcpStore (from_store)
#include "shardlib/comm/watchdog.hpp"      // detail::comm_timeout (SHARDLIB_COMM_TIMEOUT)
#include "shardlib/core/buffer.hpp"        // Buffer
#include "shardlib/core/element.hpp"       // Element, dtype_of
#include "shardlib/core/error.hpp"         // comm_error, shape_error, require, cat
#include "shardlib/core/ledger.hpp"        // category
#include "shardlib/cuda/error.hpp"         // check
#include "shardlib/cuda/memory_space.hpp"  // cuda_space, pinned_space
#include "shardlib/cuda/stream.hpp"        // device_guard, stream, event


#include <cuda_runtime.h>
#include <nccl.h>

#include <array>               // std::array
#include <chrono>              // std::chrono
#include <cmath>               // std::isfinite, std::ceil
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // std::size_t
#include <cstdint>             // std::int16_t, std::uint8_t
#include <cstdlib>             // std::getenv, std::strtol
#include <cstring>             // std::memcpy
#include <deque>               // std::deque
#include <filesystem>          // std::filesystem
#include <fstream>             // std::ifstream, std::ofstream
#include <memory>              // std::shared_ptr
#include <mutex>               // std::mutex, std::unique_lock
#include <optional>            // std::optional
#include <span>                // std::span
#include <string>              // std::string
#include <string_view>         // std::string_view
#include <thread>              // std::thread, std::this_thread
#include <type_traits>         // std::is_same_v
#include <utility>             // std::move
#include <vector>              // std::vector

#include <unistd.h>  // getpid: a per-process name for the id file written before its rename

namespace shardlib::comm {

namespace detail {
// A limit past this is none (the clock's nanoseconds would overflow some 292 years on).
inline constexpr std::chrono::hours nccl_no_limit_past{24 * 365 * 30};

// nccl_options::timeout's default, as the other communicators': SHARDLIB_COMM_TIMEOUT
// (seconds; 0 or inf: no limit) when set, else default_comm_timeout (10 minutes).
inline std::chrono::milliseconds default_nccl_timeout() {
  const double s = comm_timeout(std::nullopt).count();
  if (!std::isfinite(s) || s > std::chrono::duration<double>(nccl_no_limit_past).count())
    return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(s * 1e3)));
}
}  // namespace detail

struct nccl_options {
  // An initialisation, split or collective that has not finished after this
  // long aborts the communicator (ncclCommAbort) and raises comm_error on this
  // rank, instead of hanging: a peer that died or called something else. 0: no limit (a
  // communicator whose peer died then waits in its destructor's finalize for ever).
  std::chrono::milliseconds timeout = detail::default_nccl_timeout();
  // Check, before each collective, that the buffers are device memory of the
  // communicator's device (cudaPointerGetAttributes, about a microsecond), so a
  // host pointer raises comm_error instead of faulting inside NCCL.
  bool check_pointers = true;
  // Before each collective, gather every rank's call (kind, count, type, operation, root)
  // and compare them, so that ranks calling different collectives or sizes raise
  // comm_error on every rank, naming both calls, instead of hanging until the timeout or
  // corrupting memory (NCCL itself checks nothing of the kind). The comparison is on the
  // host, so each collective then waits for the ranks to meet: a debugging mode, as
  // PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL. Unset: on where SHARDLIB_NCCL_CHECK=1.
  std::optional<bool> check = std::nullopt;
};

// The value nccl_options::check stands for.
inline bool checks_calls(const nccl_options& o) {
  if (o.check) return *o.check;
  const char* env = std::getenv("SHARDLIB_NCCL_CHECK");
  return env && std::string_view(env) == "1";
}

namespace detail {

using nccl_clock = std::chrono::steady_clock;

// A negative nccl_options::timeout is refused (it would time out every call at once): by
// NcclComm's constructors before anything is made or published, and by nccl_deadline.
inline void check_timeout(std::chrono::milliseconds t) {
  require<comm_error>(t.count() >= 0, "nccl_options::timeout must be >= 0 ms (0: no limit), got ", t.count());
}

// When a wait that began now passes nccl_options::timeout `t` (0, or 30 years and more: never).
inline nccl_clock::time_point nccl_deadline(std::chrono::milliseconds t) {
  check_timeout(t);
  return t.count() > 0 && t < nccl_no_limit_past ? nccl_clock::now() + t : nccl_clock::time_point::max();
}

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
// pause() runs between polls (by default a sleep); false stops polling at once
// (the communicator went away meanwhile: ncclInProgress returned).
inline bool short_pause() {
  std::this_thread::sleep_for(std::chrono::microseconds(100));
  return true;
}
template <class Pause = bool (*)()>
ncclResult_t settle(ncclComm_t comm, ncclResult_t r, nccl_clock::time_point deadline, bool& timed_out,
                    Pause&& pause = short_pause) {
  timed_out = false;
  while (r == ncclInProgress) {
    if (nccl_clock::now() > deadline) {
      timed_out = true;
      return r;
    }
    if (!pause()) return r;
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
  r = settle(comm, r, nccl_deadline(o.timeout), timed_out);
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
// reason. The mutex keeps the communicator alive while a call uses it; a call
// that NCCL has not accepted yet (ncclInProgress) releases it between polls, so
// that abort() and the watchdog reach the communicator meanwhile, and the other
// calls wait for it to settle (NCCL takes no new call on a communicator then).
class nccl_state {
 public:
  // Made with `device` current (the event and the scratch live there).
  nccl_state(ncclComm_t comm, int device, std::shared_ptr<cuda::stream> s, const nccl_options& o)
      : comm_(comm), device_(device), stream_(std::move(s)), options_(o), scratch_(1, category::comm_scratch) {
    check_nccl(ncclCommUserRank(comm, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm, &size_), "ncclCommCount");
    if (checks_calls(options_)) {
      calls_device_ = Buffer<std::int64_t, cuda_space>(std::size_t(size_) * call_fields, category::comm_scratch);
      calls_host_ = Buffer<std::int64_t, pinned_space>(std::size_t(size_ + 1) * call_fields, category::comm_scratch);
    }
    watchdog_ = std::thread([this] { watch(); });
  }
  // The state of `comm`, just settled; a construction that fails aborts it rather
  // than leaving it behind.
  static std::shared_ptr<nccl_state> adopt(ncclComm_t comm, int device, std::shared_ptr<cuda::stream> s,
                                           const nccl_options& o) {
    try {
      return std::make_shared<nccl_state>(comm, device, std::move(s), o);
    } catch (...) {
      (void)ncclCommAbort(comm);
      throw;
    }
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
    const ncclResult_t r = settle(comm_, ncclCommFinalize(comm_), nccl_deadline(options_.timeout), timed_out);
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
  bool checks() const { return !calls_device_.empty(); }

  // What each rank calls (nccl_options::check): this rank's `sig`, and whether its
  // arguments passed its own checks, gathered from every rank before the collective
  // is enqueued (an all-gather on the comm stream into pinned memory, then a wait).
  struct posted_call {
    signature sig;
    bool valid;
  };
  std::vector<posted_call> gather_calls(cudaStream_t compute, const signature& sig, bool valid) {
    std::int64_t* mine = calls_host_.data();  // then every rank's, from calls_host_[call_fields]
    const std::int64_t fields[call_fields] = {std::int64_t(sig.kind), std::int64_t(sig.type), std::int64_t(sig.count),
                                              std::int64_t(sig.op),   sig.root,               valid};
    std::memcpy(mine, fields, sizeof fields);
    const signature gather{op_kind::all_gather, dtype::i64, call_fields};
    std::int64_t* slot = calls_device_.data() + std::size_t(rank_) * call_fields;
    const std::size_t bytes = calls_device_.size() * sizeof(std::int64_t);
    (void)enqueue(compute, gather, [&](ncclComm_t c, cudaStream_t s) {
      cuda::check(cudaMemcpyAsync(slot, mine, sizeof fields, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync (a call)");
      return ncclAllGather(slot, calls_device_.data(), call_fields, ncclInt64, c, s);
    });
    // Issued once NCCL has accepted the gather (before, it may not be on the stream yet).
    cuda::device_guard g(device_);
    cuda::check(cudaMemcpyAsync(mine + call_fields, calls_device_.data(), bytes, cudaMemcpyDeviceToHost,
                                stream_->get()),
                "cudaMemcpyAsync (the ranks' calls)");
    cuda::event read;
    read.record(stream_->get());
    wait_host(read, gather);
    std::vector<posted_call> all(static_cast<std::size_t>(size_));
    for (std::size_t r = 0; r < all.size(); ++r) {
      const std::int64_t* v = mine + (r + 1) * call_fields;
      all[r] = {{op_kind(v[0]), dtype(v[1]), std::size_t(v[2]), reduce_op(v[3]), int(v[4])}, v[5] != 0};
    }
    return all;
  }

  // Enqueues f(comm, comm_stream) after the work issued on `compute` so far;
  // returns the event that completes with it, which the watchdog follows.
  template <class F>
  std::shared_ptr<cuda::event> enqueue(cudaStream_t compute, const signature& sig, F f) {
    cuda::device_guard g(device_);
    auto done = std::make_shared<cuda::event>();
    std::unique_lock lock(m_);
    wait_until_settled(lock);
    // The comm stream waits on the device for the inputs (the llm.c pattern):
    // the host never blocks to order a collective.
    order_.record(compute);
    order_.make_wait(stream_->get());
    run(lock, f(comm_, stream_->get()), sig);
    done->record(stream_->get());
    {
      std::lock_guard w(watch_m_);
      pending_.push_back({done, sig, nccl_deadline(options_.timeout)});
    }
    return done;
  }

  // A host-side NCCL call on the communicator (ncclCommSplit).
  template <class F>
  void call(F f, const std::string& what) {
    std::unique_lock lock(m_);
    wait_until_settled(lock);
    run(lock, f(comm_), what);
  }

  // Blocks the host until `done` has completed, polling NCCL's asynchronous
  // errors; aborts the communicator after the timeout.
  void wait_host(const cuda::event& done, const signature& sig) {
    const auto deadline = nccl_deadline(options_.timeout);
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

  static constexpr std::size_t call_fields = 6;  // gather_calls: kind, type, count, op, root, valid

  void check_nccl(ncclResult_t r, const char* call) const {
    if (r != ncclSuccess)  // rank_ is not known before ncclCommUserRank
      throw comm_error(cat(rank_ < 0 ? std::string("a rank") : cat("rank ", rank_), " on device ", device_, ": ",
                           call, " failed: ", nccl_text(r, comm_)));
  }

  // Until no call of another thread is waiting for NCCL to accept it; throws once aborted.
  void wait_until_settled(std::unique_lock<std::mutex>& lock) {
    settled_cv_.wait(lock, [&] { return !settling_ || aborted_; });
    throw_if_aborted_locked();
  }

  // Waits, lock released between polls, until NCCL has accepted the call that answered
  // `r`; aborts at the timeout. what: a signature or a call's name, text only on failure.
  template <class What>
  void run(std::unique_lock<std::mutex>& lock, ncclResult_t r, const What& what) {
    settling_ = true;
    bool timed_out = false;
    r = settle(comm_, r, nccl_deadline(options_.timeout), timed_out, [&] {
      lock.unlock();
      short_pause();
      lock.lock();
      return !aborted_;  // abort() freed the communicator meanwhile
    });
    if (timed_out) abort_locked(cat(text(what), " was not accepted within ", options_.timeout.count(), " ms"));
    settling_ = false;
    settled_cv_.notify_all();
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
    settled_cv_.notify_all();
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
      bool aborted = false;
      {
        std::lock_guard comm_lock(m_);
        poll_async_error_locked();
        if (nccl_clock::now() > oldest.deadline)
          abort_locked(cat(describe(oldest.sig), " did not finish within ", options_.timeout.count(), " ms"));
        aborted = aborted_;
      }
      lock.lock();
      if (aborted) pending_.clear();
    }
  }

  ncclComm_t comm_;
  int rank_ = -1, size_ = 0;
  int device_;
  std::shared_ptr<cuda::stream> stream_;
  nccl_options options_;
  cuda::event order_;                  // compute stream -> comm stream
  Buffer<float, cuda_space> scratch_;  // barrier's all-reduce
  Buffer<std::int64_t, cuda_space> calls_device_;   // gather_calls, with nccl_options::check: every rank's call
  Buffer<std::int64_t, pinned_space> calls_host_;   // this rank's call, then every rank's

  std::mutex m_;  // the communicator: calls, polls, abort
  bool aborted_ = false;
  bool settling_ = false;  // a call waits for NCCL to accept it (run)
  std::condition_variable settled_cv_;
  std::string why_;

  std::mutex watch_m_;  // pending_ and stopping_
  std::condition_variable watch_cv_;
  std::deque<pending> pending_;
  bool stopping_ = false;
  std::thread watchdog_;
};

}  // namespace detail

}  // namespace shardlib::comm
