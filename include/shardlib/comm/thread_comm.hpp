// shardlib/comm/thread_comm.hpp — ThreadComm: W ranks as threads of one process (the embedded default).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/executor.hpp"
#include "shardlib/comm/reduce.hpp"
#include "shardlib/comm/signature.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>           // std::sort, std::min
#include <atomic>              // std::atomic
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // std::size_t
#include <cstdint>             // std::uint64_t
#include <cstring>             // std::memcpy
#include <memory>              // std::shared_ptr
#include <mutex>               // std::mutex
#include <span>                // std::span
#include <string>              // std::string
#include <thread>              // std::thread::hardware_concurrency
#include <vector>              // std::vector

namespace shardlib::comm {

namespace detail {

struct group;

struct slot {
  signature sig;
  const void* send = nullptr;
  void* recv = nullptr;
  int color = 0, key = 0;  // split
  std::shared_ptr<group> made;  // split: the group this rank created for its color
};

// State shared by all ranks of one launch: failure and exit flags every wait checks.
struct world_state {
  explicit world_state(int n) : exited(n) {
    for (auto& e : exited) e.store(false);
  }
  std::atomic<bool> aborted{false};
  std::vector<std::atomic<bool>> exited;  // rank has returned from the launched function
  std::mutex m;
  std::vector<std::weak_ptr<group>> groups;  // to wake their waiters
  void wake_all();
};

// The ranks of one communicator: posting slots and a barrier that can be broken.
struct group {
  group(std::shared_ptr<world_state> w, std::vector<int> members)
      : world(std::move(w)), world_ranks(std::move(members)), posted(world_ranks.size(), 0) {
    for (auto& s : slots) s.resize(world_ranks.size());
    spin = world_ranks.size() <= std::max(1u, std::thread::hardware_concurrency()) ? 4000 : 0;
  }

  std::shared_ptr<world_state> world;
  std::vector<int> world_ranks;  // group rank -> rank of the launch
  // Two sets of slots, used alternately: a rank can post collective k + 1 while a
  // slower rank still reads the slots of k, but it cannot post k + 2 before every
  // rank has arrived at k + 1 and so finished reading k.
  std::vector<slot> slots[2];
  std::vector<std::uint64_t> posted;  // per rank: collectives posted so far
  std::atomic<int> arrived{0};
  std::atomic<unsigned> generation{0};
  std::mutex m;
  std::condition_variable cv;
  int spin = 0;  // spin before sleeping only when every rank has a core

  int size() const { return int(world_ranks.size()); }

  // Sense-counting barrier. It throws comm_aborted once any rank of the launch has
  // failed, and comm_error when a member returned from its function while the
  // others still wait (ranks issued different sequences of collectives).
  void arrive_and_wait(int rank, const signature& what) {
    const unsigned gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == size()) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
      { std::lock_guard lock(m); }  // a sleeper between its check and its wait sees the change
      cv.notify_all();
      return;
    }
    for (int i = 0; i < spin; ++i) {
      if (generation.load(std::memory_order_acquire) != gen) return;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    std::unique_lock lock(m);
    auto broken = [&] { return world->aborted.load() || first_exited() >= 0; };
    cv.wait(lock, [&] { return generation.load(std::memory_order_acquire) != gen || broken(); });
    if (generation.load(std::memory_order_acquire) != gen) return;
    if (world->aborted.load()) throw comm_aborted(cat("rank ", rank, ": ", describe(what), " abandoned: another rank failed"));
    throw comm_error(cat("rank ", rank, ": ", describe(what), " waits for rank ", first_exited(),
                         ", which has already returned: the ranks issued different sequences of collectives"));
  }

  int first_exited() const {
    for (int r = 0; r < size(); ++r)
      if (world->exited[world_ranks[r]].load()) return r;
    return -1;
  }
};

inline void world_state::wake_all() {
  std::lock_guard lock(m);
  for (auto& wg : groups)
    if (auto g = wg.lock()) {
      { std::lock_guard glock(g->m); }
      g->cv.notify_all();
    }
}

}  // namespace detail

// Ranks as threads, collectives through shared memory: every rank posts its
// buffer pointers, meets the others at a barrier, and then reads its peers'
// buffers directly (one copy, no staging). Reductions combine ranks in rank
// order, so results are identical on every rank and in every run.
// Created by comm::launch; ranks call collectives from their own thread, and
// asynchronous forms run on the rank's communication worker.
class ThreadComm {
 public:
  ThreadComm(std::shared_ptr<detail::group> g, int rank, std::shared_ptr<executor> exec)
      : g_(std::move(g)), rank_(rank), exec_(std::move(exec)) {}

  int rank() const { return rank_; }
  int size() const { return g_->size(); }

  void barrier() {
    exec_->drain();
    post_and_meet({detail::op_kind::barrier});
  }

  template <Element T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    exec_->drain();
    do_all_gather(send, recv);
  }
  template <Element T>
  work all_gather_async(std::span<const T> send, std::span<T> recv) {
    return exec_->submit([=, this] { do_all_gather(send, recv); });
  }

  template <Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    exec_->drain();
    do_reduce_scatter(send, recv, op);
  }
  template <Element T>
  work reduce_scatter_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return exec_->submit([=, this] { do_reduce_scatter(send, recv, op); });
  }

  template <Element T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
    exec_->drain();
    do_all_reduce(send, recv, op);
  }
  template <Element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <Element T>
  work all_reduce_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return exec_->submit([=, this] { do_all_reduce(send, recv, op); });
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    exec_->drain();
    do_broadcast(data, root);
  }
  template <Element T>
  work broadcast_async(std::span<T> data, int root) {
    return exec_->submit([=, this] { do_broadcast(data, root); });
  }

  // Ranks with the same color form a new communicator, ordered by key, then by
  // rank here. Every rank must call it; color must be >= 0.
  ThreadComm split(int color, int key) {
    require<comm_error>(color >= 0, "rank ", rank_, ": split color must be >= 0, got ", color);
    exec_->drain();
    auto& slots = next_slots();
    slots[rank_].color = color;
    slots[rank_].key = key;
    slots[rank_].made = nullptr;
    post_and_meet({detail::op_kind::split});
    std::vector<int> members;  // group ranks of this color, in new-rank order
    for (int r = 0; r < size(); ++r)
      if (slots[r].color == color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return slots[a].key < slots[b].key; });
    const int new_rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
    if (new_rank == 0) {  // the first member builds the group the others pick up
      std::vector<int> world_ranks;
      for (int r : members) world_ranks.push_back(g_->world_ranks[r]);
      slots[rank_].made = std::make_shared<detail::group>(g_->world, std::move(world_ranks));
      std::lock_guard lock(g_->world->m);
      g_->world->groups.push_back(slots[rank_].made);
    }
    meet({detail::op_kind::split});
    return ThreadComm(slots[members[0]].made, new_rank, exec_);
  }

 private:
  void meet(const detail::signature& sig) { g_->arrive_and_wait(rank_, sig); }

  std::vector<detail::slot>& next_slots() { return g_->slots[g_->posted[rank_] % 2]; }
  const std::vector<detail::slot>& peers() const { return g_->slots[(g_->posted[rank_] - 1) % 2]; }

  // Posts this rank's signature, waits for all, and checks that all agree; on a
  // mismatch every rank sees the same slots and raises the same error.
  void post_and_meet(const detail::signature& sig, const void* send = nullptr, void* recv = nullptr) {
    auto& mine = next_slots()[rank_];
    mine.sig = sig;
    mine.send = send;
    mine.recv = recv;
    ++g_->posted[rank_];
    meet(sig);
    const auto& slots = peers();
    for (int r = 1; r < size(); ++r)
      if (!(slots[r].sig == slots[0].sig)) throw detail::disagreement(rank_, slots[0].sig, r, slots[r].sig);
  }

  template <class T>
  void do_all_gather(std::span<const T> send, std::span<T> recv) {
    const std::size_t n = send.size();
    require<shape_error>(recv.size() == n * size(), "rank ", rank_, ": all_gather of ", n, " elements per rank over ",
                         size(), " ranks needs a receive buffer of ", n * size(), ", got ", recv.size());
    post_and_meet({detail::op_kind::all_gather, dtype_of<T>, n}, send.data(), recv.data());
    for (int i = 0; i < size(); ++i) {
      const int r = (rank_ + i) % size();  // start at a different peer on each rank
      T* dst = recv.data() + r * n;
      const T* src = static_cast<const T*>(peers()[r].send);
      if (dst != src && n) std::memcpy(dst, src, n * sizeof(T));
    }
    meet({detail::op_kind::all_gather});
  }

  template <class T>
  void do_reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = recv.size();
    require<shape_error>(send.size() == n * size(), "rank ", rank_, ": reduce_scatter to ", n,
                         " elements per rank over ", size(), " ranks needs a send buffer of ", n * size(), ", got ",
                         send.size());
    post_and_meet({detail::op_kind::reduce_scatter, dtype_of<T>, n, op}, send.data(), recv.data());
    std::vector<const T*> srcs(size());
    for (int r = 0; r < size(); ++r) srcs[r] = static_cast<const T*>(peers()[r].send) + rank_ * n;
    reduce_into(recv.data(), std::span<const T* const>(srcs), n, op);
    meet({detail::op_kind::reduce_scatter});
  }

  // Reduce-scatter then all-gather over shared memory: rank r reduces range r of
  // every rank's input into its own output, then everyone copies the finished ranges.
  template <class T>
  void do_all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = send.size();
    require<shape_error>(recv.size() == n, "rank ", rank_, ": all_reduce of ", n,
                         " elements needs a receive buffer of the same size, got ", recv.size());
    post_and_meet({detail::op_kind::all_reduce, dtype_of<T>, n, op}, send.data(), recv.data());
    auto range = [&](int r) { return std::pair{n * r / size(), n * (r + 1) / size()}; };
    auto [lo, hi] = range(rank_);
    std::vector<const T*> srcs(size());
    for (int r = 0; r < size(); ++r) srcs[r] = static_cast<const T*>(peers()[r].send) + lo;
    reduce_into(recv.data() + lo, std::span<const T* const>(srcs), hi - lo, op);
    meet({detail::op_kind::all_reduce});
    for (int i = 1; i < size(); ++i) {
      const int r = (rank_ + i) % size();
      auto [a, b] = range(r);
      if (b > a) std::memcpy(recv.data() + a, static_cast<const T*>(peers()[r].recv) + a, (b - a) * sizeof(T));
    }
    meet({detail::op_kind::all_reduce});
  }

  template <class T>
  void do_broadcast(std::span<T> data, int root) {
    require<comm_error>(root >= 0 && root < size(), "rank ", rank_, ": broadcast root ", root, " is not a rank of ",
                        size());
    post_and_meet({detail::op_kind::broadcast, dtype_of<T>, data.size(), reduce_op::sum, root}, data.data(),
                  data.data());
    if (rank_ != root && !data.empty())
      std::memcpy(data.data(), peers()[root].send, data.size() * sizeof(T));
    meet({detail::op_kind::broadcast});
  }

  std::shared_ptr<detail::group> g_;
  int rank_;
  std::shared_ptr<executor> exec_;
};

static_assert(check_communicator<ThreadComm>());

}  // namespace shardlib::comm
