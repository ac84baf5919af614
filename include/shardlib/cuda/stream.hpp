// shardlib/cuda/stream.hpp — devices, streams and events as owning types.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // cat
#include "shardlib/cuda/error.hpp"  // check, cuda_error

#include <cuda_runtime.h>

#include <string>   // std::string
#include <utility>  // std::exchange

namespace shardlib::cuda {

// Empty when a CUDA device can be used; otherwise why not (for skip messages).
// Without a GPU or driver, cudaGetDeviceCount fails (error 35 on a machine
// with the toolkit but no driver) rather than reporting zero devices.
inline std::string device_problem() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return cat("cudaGetDeviceCount failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  }
  if (count == 0) return "cudaGetDeviceCount found 0 devices";
  return {};
}

inline int device_count() {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  return count;
}

// Makes `device` current for the scope and restores the previous one: the
// current device is per thread, and library calls must not change the caller's.
class device_guard {
 public:
  explicit device_guard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) check(cudaSetDevice(device), "cudaSetDevice(", device, ")");
  }
  ~device_guard() { (void)cudaSetDevice(previous_); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = 0;
};

// An owned stream on one device. Non-blocking: it does not synchronise with the
// legacy default stream, so library work never waits for unrelated user work
// (and the other way round) unless an event says so.
class stream {
 public:
  explicit stream(int device, int priority = 0) : device_(device) {
    device_guard g(device);
    check(cudaStreamCreateWithPriority(&s_, cudaStreamNonBlocking, priority), "cudaStreamCreateWithPriority");
  }
  stream(stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)), device_(o.device_) {}
  stream& operator=(stream&& o) noexcept {
    std::swap(s_, o.s_);
    std::swap(device_, o.device_);
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  // Waits for the stream's work first: a new stream may get the same handle, and
  // the caching allocator would take the old work for the new stream's own.
  ~stream() {
    if (!s_) return;
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
  }

  cudaStream_t get() const { return s_; }
  operator cudaStream_t() const { return s_; }
  int device() const { return device_; }
  void synchronize() const { check(cudaStreamSynchronize(s_), "cudaStreamSynchronize on device ", device_); }

 private:
  cudaStream_t s_ = nullptr;
  int device_ = 0;
};

// An owned event without timing (cheaper to record and query), for ordering
// streams and for asking whether work has finished.
class event {
 public:
  event() { check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreateWithFlags"); }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() {
    if (e_) (void)cudaEventDestroy(e_);
  }

  cudaEvent_t get() const { return e_; }
  void record(cudaStream_t s) { check(cudaEventRecord(e_, s), "cudaEventRecord"); }
  // s waits, on the device, for the work this event captured; the host goes on.
  void make_wait(cudaStream_t s) const { check(cudaStreamWaitEvent(s, e_, 0), "cudaStreamWaitEvent"); }
  // Whether the captured work has finished; errors of that work are thrown.
  bool ready() const {
    const cudaError_t e = cudaEventQuery(e_);
    if (e == cudaErrorNotReady) return false;
    check(e, "cudaEventQuery");
    return true;
  }
  void synchronize() const { check(cudaEventSynchronize(e_), "cudaEventSynchronize"); }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace shardlib::cuda
