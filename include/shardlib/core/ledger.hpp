// shardlib/core/ledger.hpp — the per-rank memory ledger (current and peak bytes by category).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <array>        // std::array
#include <atomic>       // std::atomic
#include <cstddef>      // std::size_t
#include <memory>       // std::unique_ptr
#include <mutex>        // std::once_flag, std::call_once
#include <string_view>  // std::string_view

namespace shardlib {

// What an allocation holds. Tests compare the peaks per category against the
// memory formula of each sharding strategy, so every library allocation names one.
enum class category : int {
  parameters,           // master parameter shards (and replicated parameters)
  gradients,            // gradient shards (and replicated gradients)
  optimizer_state,      // Adam moments, momentum buffers
  gathered_parameters,  // full parameters of a unit while it is gathered
  activations,          // what layers cache for backward, and their outputs
  comm_scratch,         // temporary buffers of collectives
};
inline constexpr int category_count = 6;

constexpr std::string_view name(category c) {
  constexpr std::array<std::string_view, category_count> names{
      "parameters", "gradients", "optimizer_state", "gathered_parameters", "activations", "comm_scratch"};
  return names[static_cast<int>(c)];
}

// Bytes currently allocated and the high-water mark, per category and in total.
// One ledger per rank. A rank's communication worker allocates scratch while the
// rank computes, so the counters are atomic; allocations are not a hot path.
class ledger {
 public:
  ledger() = default;
  ledger(const ledger&) = delete;
  ledger& operator=(const ledger&) = delete;

  void allocate(category c, std::size_t bytes) {
    add(entries_[static_cast<int>(c)], bytes);
    add(total_, bytes);
  }

  void release(category c, std::size_t bytes) {
    auto& e = entries_[static_cast<int>(c)];
    std::size_t was = e.current.load(std::memory_order_relaxed);
    do {
      require(was >= bytes, "ledger: releasing ", bytes, " bytes of ", name(c), " but only ", was, " are recorded");
    } while (!e.current.compare_exchange_weak(was, was - bytes, std::memory_order_relaxed));
    total_.current.fetch_sub(bytes, std::memory_order_relaxed);
  }

  std::size_t current(category c) const { return entries_[static_cast<int>(c)].current.load(); }
  std::size_t peak(category c) const { return entries_[static_cast<int>(c)].peak.load(); }
  std::size_t current() const { return total_.current.load(); }  // all categories
  // Whether anything is still counted, here or in the offload ledger.
  bool in_use() const { return current() != 0 || (offload_ && offload_->in_use()); }
  std::size_t peak() const { return total_.peak.load(); }        // peak of the sum, not the sum of peaks

  // Restarts the high-water marks from what is allocated now (e.g. after setup);
  // the offload ledger's too.
  void reset_peaks() {
    for (auto& e : entries_) e.peak.store(e.current.load());
    total_.peak.store(total_.current.load());
    if (offload_) offload_->reset_peaks();
  }

  // The same categories for the rank's second memory space: where shard::options::offload
  // keeps fp32 masters, reduced gradients and optimizer state (pinned host memory beside
  // a device, host_offload_space in host tests). Allocations are recorded here while a
  // ledger_scope points the thread at it; this ledger's totals never include it.
  ledger& offload() {
    std::call_once(offload_made_, [&] { offload_ = std::make_unique<ledger>(); });
    return *offload_;
  }

 private:
  struct entry {
    std::atomic<std::size_t> current{0};
    std::atomic<std::size_t> peak{0};
  };
  static void add(entry& e, std::size_t bytes) {
    std::size_t now = e.current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::size_t peak = e.peak.load(std::memory_order_relaxed);
    while (now > peak && !e.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  std::array<entry, category_count> entries_{};
  entry total_{};
  std::once_flag offload_made_;
  std::unique_ptr<ledger> offload_;
};

namespace detail {
inline ledger*& current_ledger_slot() {
  thread_local ledger* slot = nullptr;
  return slot;
}
}  // namespace detail

// The ledger of the rank running on this thread. Each thread starts with its own;
// comm::launch gives every rank thread a fresh one, and a rank's helper threads
// (its communication worker) are pointed at their rank's ledger.
inline ledger& current_ledger() {
  thread_local ledger own;
  auto* l = detail::current_ledger_slot();
  return l ? *l : own;
}

// Points this thread at another ledger for the scope's lifetime.
class ledger_scope {
 public:
  explicit ledger_scope(ledger& l) : previous_(detail::current_ledger_slot()) { detail::current_ledger_slot() = &l; }
  ~ledger_scope() { detail::current_ledger_slot() = previous_; }
  ledger_scope(const ledger_scope&) = delete;
  ledger_scope& operator=(const ledger_scope&) = delete;

 private:
  ledger* previous_;
};

}  // namespace shardlib
