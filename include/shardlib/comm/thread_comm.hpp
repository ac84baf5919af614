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
#include <exception>           // std::exception_ptr, std::rethrow_exception
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
  bool invalid = false;  // this rank's own arguments are wrong, for the reason in `why`
  std::string why;
  const void* send = nullptr;
  void* recv = nullptr;
  int color = 0, key = 0;  // split
  std::shared_ptr<group> made;  // split: the group this rank created for its color
  bool split_failed = false;     // split: this rank raised between entering and leaving
};

// State shared by all ranks of one launch: failure and exit flags every wait checks.
struct world_state {
  explicit world_state(int n) : exited(n), stuck(n), waits(n), why_stuck(n) {
    for (auto& e : exited) e.store(false);
    for (auto& e : stuck) e.store(false);
  }
  std::atomic<int> failed{-1};            // the first rank whose function threw, once one has
  std::vector<std::atomic<bool>> exited;  // rank has returned from the launched function
  std::vector<std::atomic<bool>> stuck;   // rank's wait to enter can never end (why_stuck says why)
  std::atomic<int> communicators{1};      // groups alive at the last split: with one, no wait can be stuck
  std::mutex m;
  std::vector<std::weak_ptr<group>> groups;  // to wake their waiters; each split drops those gone
  // Under m, once the launch has several communicators: where each rank arrived to
  // enter a collective, at which generation of that group's barrier. Once the
  // generation has moved on the rank has passed (it departs soon after); a null group:
  // it runs, or waits at a leave, which always ends.
  struct wait_record {
    group* in = nullptr;
    std::uint64_t generation = 0;
    signature what;
  };
  std::vector<wait_record> waits;
  std::vector<std::string> why_stuck;

  // A rank waits in a group through a handle that keeps it alive, so a group gone
  // has no waiter to wake, and a count of those alive bounds the groups waited in.
  void add(const std::shared_ptr<group>& g) {
    std::lock_guard lock(m);
    std::erase_if(groups, [](const std::weak_ptr<group>& w) { return w.expired(); });
    groups.push_back(g);
    communicators.store(int(groups.size()));
  }
  void wake_all();
  // Rank `me` has arrived at generation `gen` of `g`'s barrier to enter collective
  // `what`: recorded, and if the waits now form a cycle across communicators (rank 0
  // waits in A for rank 1, which waits in B for rank 0), every rank in it is marked
  // stuck and woken. Returns whether it recorded anything (depart must follow).
  bool arrive(int me, group& g, std::uint64_t gen, const signature& what);
  // Rank `me` no longer waits where it arrived; returns why it was stuck, if it was.
  std::string depart(int me) {
    std::lock_guard lock(m);
    waits[std::size_t(me)].in = nullptr;
    return stuck[std::size_t(me)].exchange(false) ? std::move(why_stuck[std::size_t(me)]) : std::string();
  }

 private:
  group* waiting_in(std::size_t r) const;
  void find_stuck();
};

// The ranks of one communicator: posting slots and barriers. A collective enters
// (every rank has posted its buffers), reads its peers' buffers, and leaves (no
// peer reads this rank's buffers any more). Only entering can be abandoned: a rank
// withdraws from an entry that has not completed, so that either every rank
// passes it or none does, and whoever passes reaches the exits, which wait for
// everyone whatever happens meanwhile (reading takes a bounded time). So a
// collective that completes, normally or with an error, never leaves a peer
// reading this rank's buffers, and its caller may free them.
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
  // Barrier: generation << 32 | ranks arrived, in one word, so that an arrival is
  // withdrawn only while its barrier has not completed.
  std::atomic<std::uint64_t> barrier{0};
  std::mutex m;
  std::condition_variable cv;
  int spin = 0;  // spin before sleeping only when every rank has a core

  int size() const { return int(world_ranks.size()); }

  // Entry to a collective. Throws comm_aborted once a rank of the launch has
  // failed, and comm_error once a member has returned from its function while the
  // others still wait (the ranks issued different sequences of collectives), or waits
  // in another communicator's collective for a rank that waits here (they issued
  // collectives on their communicators in different orders).
  void enter(int rank, const signature& what) {
    if (broken()) abandon(rank, what, {});  // so a rank that withdrew never arrives again at the same barrier
    const int me = world_ranks[std::size_t(rank)];
    const std::uint64_t arrival = barrier.fetch_add(1, std::memory_order_acq_rel) + 1;
    struct record {
      world_state* w;
      int me;
      bool on = false;
      std::string leave() { return std::exchange(on, false) ? w->depart(me) : std::string(); }
      ~record() { leave(); }
    } waiting{world.get(), me};
    // Recorded only before sleeping: a wait that ends while spinning is no cycle.
    if (await(arrival, true, me, [&] { waiting.on = world->arrive(me, *this, generation(arrival), what); })) return;
    // Departed before withdrawing: a rank that withdrew must not look as if it still
    // waited here. A rank found stuck was withdrawn by whoever found it.
    if (std::string stuck = waiting.leave(); !stuck.empty()) abandon(rank, what, stuck);
    if (withdraw(generation(arrival))) abandon(rank, what, {});
    // the barrier completed before the withdrawal: every rank is in
  }
  // Exit from a collective's reading phase.
  void leave() { await(barrier.fetch_add(1, std::memory_order_acq_rel) + 1, false, -1, [] {}); }
  static std::uint64_t generation(std::uint64_t b) { return b >> 32; }
  // Takes back one arrival at generation gen of the barrier, unless it has completed.
  bool withdraw(std::uint64_t gen) {
    for (std::uint64_t now = barrier.load(std::memory_order_acquire); generation(now) == gen;)
      if (barrier.compare_exchange_weak(now, now - 1, std::memory_order_acq_rel, std::memory_order_acquire))
        return true;
    return false;
  }

 private:
  int first_exited() const {
    for (int r = 0; r < size(); ++r)
      if (world->exited[world_ranks[r]].load()) return r;
    return -1;
  }
  bool broken() const { return world->failed.load() >= 0 || first_exited() >= 0; }

  // stuck: why this rank's wait could never end, if it was found stuck.
  [[noreturn]] void abandon(int rank, const signature& what, const std::string& stuck) const {
    if (const int f = world->failed.load(); f >= 0)
      throw comm_aborted(cat("rank ", rank, ": ", describe(what), " abandoned: rank ", f, " failed"));
    if (!stuck.empty()) throw comm_error(cat("rank ", rank, ": ", stuck));
    throw comm_error(cat("rank ", rank, ": ", describe(what), " waits for rank ", first_exited(),
                         ", which has already returned: the ranks issued different sequences of collectives"));
  }

  // Waits until the barrier of `arrival` (the value this rank's arrival made)
  // completes, or, when abortable, the launch breaks or rank `me` of the launch is
  // found stuck; returns whether it completed. The last arrival completes it, unless a
  // withdrawal came first. before_sleep() runs once if it comes to sleeping.
  template <class F>
  bool await(std::uint64_t arrival, bool abortable, int me, F&& before_sleep) {
    const std::uint64_t gen = generation(arrival);
    if ((arrival & 0xffffffffu) == std::uint64_t(size()) &&
        barrier.compare_exchange_strong(arrival, (gen + 1) << 32, std::memory_order_acq_rel)) {
      { std::lock_guard lock(m); }  // a sleeper between its check and its wait sees the change
      cv.notify_all();
      return true;
    }
    auto passed = [&] { return generation(barrier.load(std::memory_order_acquire)) != gen; };
    for (int i = 0; i < spin; ++i) {
      if (passed()) return true;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    before_sleep();
    std::unique_lock lock(m);
    const auto stuck = [&] { return world->stuck[std::size_t(me)].load(); };
    cv.wait(lock, [&] { return passed() || (abortable && (broken() || stuck())); });
    return passed();
  }
};

inline bool world_state::arrive(int me, group& g, std::uint64_t gen, const signature& what) {
  if (communicators.load() == 1) return false;  // one communicator: every wait is for the same collective
  std::lock_guard lock(m);
  waits[std::size_t(me)] = {&g, gen, what};
  for (int r : g.world_ranks)
    if (const group* w = waiting_in(std::size_t(r)); w && w != &g) {  // a member waits elsewhere
      find_stuck();
      break;
    }
  return true;
}

// Under m: the group whose collective rank r waits to enter, or null.
inline group* world_state::waiting_in(std::size_t r) const {
  group* g = waits[r].in;
  return g && group::generation(g->barrier.load(std::memory_order_acquire)) == waits[r].generation ? g : nullptr;
}

// Under m. A rank can move on unless it waits to enter a collective that can never
// complete: one with a member that cannot move on and waits elsewhere. Ranks that run,
// have exited or failed (their own checks raise), or were found stuck before (they
// withdraw) can; so can every rank waiting in a collective all of whose members can move
// on or wait in it. What is left is stuck.
inline void world_state::find_stuck() {
  const std::size_t n = waits.size();
  std::vector<group*> in(n);
  std::vector<char> moves(n);
  for (std::size_t r = 0; r < n; ++r) moves[r] = !(in[r] = waiting_in(r)) || stuck[r].load();  // stuck: withdraws
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t r = 0; r < n; ++r) {
      if (moves[r]) continue;
      const group& g = *in[r];
      if (std::all_of(g.world_ranks.begin(), g.world_ranks.end(),
                      [&](int p) { return moves[std::size_t(p)] || in[std::size_t(p)] == &g; }))
        moves[r] = changed = true;
    }
  }
  const auto ranks_of = [](const group& g) {
    std::string s;
    for (int r : g.world_ranks) s += cat(s.empty() ? "" : ", ", r);
    return cat("the communicator of ranks [", s, "]");
  };
  for (std::size_t r = 0; r < n; ++r) {
    if (moves[r]) continue;
    group& g = *in[r];
    const auto away = std::find_if(g.world_ranks.begin(), g.world_ranks.end(),
                                   [&](int p) { return !moves[std::size_t(p)] && in[std::size_t(p)] != &g; });
    // Withdrawn here, under m, so that no later arrival completes the barrier with it
    // (a peer of the cycle that raised first and arrives again): every rank in the cycle raises.
    if (!g.withdraw(waits[r].generation)) continue;
    const auto p = std::size_t(*away);
    why_stuck[r] = cat(describe(waits[r].what), " on ", ranks_of(g), " can never complete: rank ", p,
                       " of the launch waits in ", describe(waits[p].what), " on ", ranks_of(*in[p]),
                       ", for a rank that waits here: the ranks issued collectives on their communicators in "
                       "different orders");
    stuck[r].store(true);
    { std::lock_guard glock(g.m); }
    g.cv.notify_all();
  }
}

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
    post_and_enter({detail::op_kind::barrier});
  }

  template <Element T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    exec_->drain();
    do_all_gather(send, recv);
  }
  template <Element T>
  [[nodiscard]] work all_gather_async(std::span<const T> send, std::span<T> recv) {
    return exec_->submit([c = for_job(), send, recv]() mutable { c.do_all_gather(send, recv); });
  }

  template <Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    exec_->drain();
    do_reduce_scatter(send, recv, op);
  }
  template <Element T>
  [[nodiscard]] work reduce_scatter_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return exec_->submit([c = for_job(), send, recv, op]() mutable { c.do_reduce_scatter(send, recv, op); });
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
  [[nodiscard]] work all_reduce_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return exec_->submit([c = for_job(), send, recv, op]() mutable { c.do_all_reduce(send, recv, op); });
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    exec_->drain();
    do_broadcast(data, root);
  }
  template <Element T>
  [[nodiscard]] work broadcast_async(std::span<T> data, int root) {
    return exec_->submit([c = for_job(), data, root]() mutable { c.do_broadcast(data, root); });
  }

  // Ranks with the same color form a new communicator, ordered by key, then by
  // rank here. Every rank must call it; color must be >= 0.
  ThreadComm split(int color, int key) {
    exec_->drain();
    auto& slots = next_slots();
    slots[rank_].color = color;
    slots[rank_].key = key;
    slots[rank_].made = nullptr;
    slots[rank_].split_failed = false;
    post_and_enter({detail::op_kind::split}, nullptr, nullptr, detail::invalid_call([&] {
                     require<comm_error>(color >= 0, "rank ", rank_, ": split color must be >= 0, got ", color);
                   }));
    // Between entering and leaving nothing may escape: the peers wait at leave() for
    // this rank. A failure (bad_alloc) is marked in the slot and raised after leaving;
    // every other member of this rank's color then raises too.
    std::vector<int> members;  // group ranks of this color, in new-rank order
    int new_rank = -1;
    std::exception_ptr failed;
    try {
      for (int r = 0; r < size(); ++r)
        if (slots[r].color == color) members.push_back(r);
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return slots[a].key < slots[b].key; });
      new_rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
      if (new_rank == 0) {  // the first member builds the group the others pick up
        std::vector<int> world_ranks;
        for (int r : members) world_ranks.push_back(g_->world_ranks[r]);
        auto made = std::make_shared<detail::group>(g_->world, std::move(world_ranks));
        g_->world->add(made);
        slots[rank_].made = std::move(made);
      }
    } catch (...) {
      failed = std::current_exception();
      slots[rank_].split_failed = true;
    }
    g_->leave();
    if (failed) std::rethrow_exception(failed);
    for (int r : members)
      if (slots[r].split_failed)
        throw comm_error(cat("rank ", rank_, ": split to color ", color, ": rank ", r,
                             " of that color failed in split (its own error says why)"));
    return ThreadComm(slots[members[0]].made, new_rank, exec_);
  }

 private:
  // What an asynchronous job runs on: a handle of its own, since the job may outlive
  // this one (a temporary, or a handle moved or destroyed before wait()), but without
  // the executor, whose last owner must not be a job running on it.
  ThreadComm for_job() const { return ThreadComm(g_, rank_, nullptr); }

  std::vector<detail::slot>& next_slots() { return g_->slots[g_->posted[rank_] % 2]; }
  const std::vector<detail::slot>& peers() const { return g_->slots[(g_->posted[rank_] - 1) % 2]; }

  // Posts this rank's signature, enters with all, and checks that all agree; on a
  // mismatch, or a rank's `invalid` arguments, every rank sees the same slots and
  // raises, before anyone reads. From here to the collective's last leave() nothing
  // may throw: every peer waits there for this rank.
  void post_and_enter(const detail::signature& sig, const void* send = nullptr, void* recv = nullptr,
                      const std::exception_ptr& invalid = nullptr) {
    auto& mine = next_slots()[rank_];
    mine.sig = sig;
    mine.invalid = bool(invalid);
    mine.why = invalid ? detail::what_of(invalid) : std::string();
    mine.send = send;
    mine.recv = recv;
    ++g_->posted[rank_];
    // A collective abandoned on entry never happened: no peer read these slots, and
    // its slot set is this rank's next again, so ranks raised out of a cycle across
    // communicators go on in step.
    const auto enter = [&] {
      try {
        g_->enter(rank_, sig);
      } catch (...) {
        --g_->posted[rank_];
        throw;
      }
    };
    if (invalid) {
      try {
        enter();
      } catch (const comm_error&) {  // its own error first, whatever the others did
      }
      std::rethrow_exception(invalid);
    }
    enter();
    const auto& slots = peers();
    for (int r = 0; r < size(); ++r)
      if (slots[r].invalid) throw detail::invalid_elsewhere(rank_, sig, r, slots[r].sig, slots[r].why);
    for (int r = 1; r < size(); ++r)
      if (!(slots[r].sig == slots[0].sig)) throw detail::disagreement(rank_, slots[0].sig, r, slots[r].sig);
  }

  template <class T>
  void do_all_gather(std::span<const T> send, std::span<T> recv) {
    const std::size_t n = send.size();
    post_and_enter({detail::op_kind::all_gather, dtype_of<T>, n}, send.data(), recv.data(), detail::invalid_call([&] {
                     require<shape_error>(recv.size() == n * size(), "rank ", rank_, ": all_gather of ", n,
                                          " elements per rank over ", size(), " ranks needs a receive buffer of ",
                                          n * size(), ", got ", recv.size());
                   }));
    for (int i = 0; i < size(); ++i) {
      const int r = (rank_ + i) % size();  // start at a different peer on each rank
      T* dst = recv.data() + r * n;
      const T* src = static_cast<const T*>(peers()[r].send);
      if (dst != src && n) std::memcpy(dst, src, n * sizeof(T));
    }
    g_->leave();
  }

  template <class T>
  void do_reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = recv.size();
    std::vector<const T*> srcs(size());
    post_and_enter({detail::op_kind::reduce_scatter, dtype_of<T>, n, op}, send.data(), recv.data(),
                   detail::invalid_call([&] {
                     require<shape_error>(send.size() == n * size(), "rank ", rank_, ": reduce_scatter to ", n,
                                          " elements per rank over ", size(), " ranks needs a send buffer of ",
                                          n * size(), ", got ", send.size());
                     check_reducible(op, dtype_of<T>, rank_, "reduce_scatter");
                   }));
    for (int r = 0; r < size(); ++r) srcs[r] = static_cast<const T*>(peers()[r].send) + rank_ * n;
    reduce_into(recv.data(), std::span<const T* const>(srcs), n, op);
    g_->leave();
  }

  // Reduce-scatter then all-gather over shared memory: rank r reduces range r of
  // every rank's input into its own output, then everyone copies the finished ranges.
  template <class T>
  void do_all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = send.size();
    std::vector<const T*> srcs(size());
    post_and_enter({detail::op_kind::all_reduce, dtype_of<T>, n, op}, send.data(), recv.data(),
                   detail::invalid_call([&] {
                     require<shape_error>(recv.size() == n, "rank ", rank_, ": all_reduce of ", n,
                                          " elements needs a receive buffer of the same size, got ", recv.size());
                     check_reducible(op, dtype_of<T>, rank_, "all_reduce");
                   }));
    auto range = [&](int r) { return std::pair{n * r / size(), n * (r + 1) / size()}; };
    auto [lo, hi] = range(rank_);
    for (int r = 0; r < size(); ++r) srcs[r] = static_cast<const T*>(peers()[r].send) + lo;
    reduce_into(recv.data() + lo, std::span<const T* const>(srcs), hi - lo, op);
    g_->leave();
    for (int i = 1; i < size(); ++i) {
      const int r = (rank_ + i) % size();
      auto [a, b] = range(r);
      if (b > a) std::memcpy(recv.data() + a, static_cast<const T*>(peers()[r].recv) + a, (b - a) * sizeof(T));
    }
    g_->leave();
  }

  template <class T>
  void do_broadcast(std::span<T> data, int root) {
    post_and_enter({detail::op_kind::broadcast, dtype_of<T>, data.size(), reduce_op::sum, root}, data.data(),
                   data.data(), detail::invalid_call([&] {
                     require<comm_error>(root >= 0 && root < size(), "rank ", rank_, ": broadcast root ", root,
                                         " is not a rank of ", size());
                   }));
    if (rank_ != root && !data.empty())
      std::memcpy(data.data(), peers()[root].send, data.size() * sizeof(T));
    g_->leave();
  }

  std::shared_ptr<detail::group> g_;
  int rank_;
  std::shared_ptr<executor> exec_;
};

static_assert(check_communicator<ThreadComm>());

}  // namespace shardlib::comm
