// shardlib/core/pending.hpp — pending<T>: a value a device computes, read by the
// host only when the caller asks; and the count of the host's waits for a device.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // require

#include <cstdint>     // std::uint64_t
#include <exception>   // std::exception_ptr, std::current_exception, std::rethrow_exception
#include <functional>  // std::function
#include <memory>      // std::shared_ptr, std::make_shared
#include <optional>    // std::optional
#include <utility>     // std::move

namespace shardlib {

// How many times this thread's host has waited for a device stream (a device-to-host
// read or a stream synchronisation) in the library's device paths that count them:
// the sharding engine's space_ops, cross-entropy's loss and bad-target report, and
// pending reads. Per thread, since ranks are threads. Tests read the difference over
// a region: a device train_step whose results nobody reads adds 0.
inline std::uint64_t& host_sync_counter() {
  thread_local std::uint64_t count = 0;
  return count;
}
inline std::uint64_t host_syncs() { return host_sync_counter(); }
inline void count_host_sync() { ++host_sync_counter(); }

// A value that may still be on its way from a device. Host values are resolved at
// once (and reading them costs nothing); a device value holds a reader, run once on
// first access (one copy and one synchronisation of the stream that computes it),
// and, while unread, the device address where it will be, so that device work can
// consume it without the host reading it. Copies share the value: whichever copy is
// read first reads it for all. operator T keeps `float loss = ...` compiling.
//
// A reader receives a callback to run after it issued its own copies and before it
// waits: get_with(more) lets a caller add copies of its own on the same stream and
// have them complete in the same single wait.
template <class T>
class pending {
 public:
  using reader = std::function<T(const std::function<void()>& before_wait)>;

  pending(T value = T{}) : s_(std::make_shared<state>()) { s_->value = value; }  // NOLINT: implicit on purpose
  pending(reader read, const T* device) : s_(std::make_shared<state>()) {
    require(bool(read), "pending: a deferred value needs a reader");
    s_->read = std::move(read);
    s_->device = device;
  }

  // The value; the first access of a deferred one waits for its device.
  T get() const { return get_with({}); }
  operator T() const { return get(); }  // NOLINT: implicit on purpose
  // The same, with `before_wait` run after the reader issued its copies and before it waits.
  // A reader that throws (a deferred error) throws the same error at every later access.
  T get_with(const std::function<void()>& before_wait) const {
    if (s_->failed) std::rethrow_exception(s_->failed);
    if (!s_->value) {
      auto read = std::move(s_->read);  // read once: its copies and its wait happen once
      s_->read = nullptr;
      s_->device = nullptr;
      try {
        s_->value = read(before_wait ? before_wait : [] {});
      } catch (...) {
        s_->failed = std::current_exception();
        throw;
      }
    } else if (before_wait) {
      before_wait();
    }
    return *s_->value;
  }
  // Resolved: reading costs nothing.
  bool ready() const { return s_->value.has_value(); }
  // Where the unread value lives on its device (valid on the stream that computes it,
  // for as long as this object or a copy lives); null once read, for host values, and
  // for values a reader computes from others.
  const T* device() const { return s_->device; }

 private:
  struct state {
    std::optional<T> value;
    reader read;
    const T* device = nullptr;
    std::exception_ptr failed;
  };
  std::shared_ptr<state> s_;
};

}  // namespace shardlib
