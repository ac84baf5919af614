// shardlib/comm/thread_group.hpp — the ranks of one ThreadComm communicator meeting at barriers:
// posting slots, the launch's failure flags, and the detection of waits that can never end.
#pragma once
#include "shardlib/comm/signature.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>           // std::all_of, std::find_if, std::max
#include <atomic>              // std::atomic
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // std::size_t
#include <cstdint>             // std::uint64_t
#include <memory>              // std::shared_ptr, std::weak_ptr
#include <mutex>               // std::mutex
#include <string>              // std::string
#include <thread>              // std::thread::hardware_concurrency
#include <utility>             // std::exchange
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

}  // namespace shardlib::comm
