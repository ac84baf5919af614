// shardlib/comm/thread_comm.hpp — ThreadComm: W ranks as threads of one process (the embedded default).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/executor.hpp"
#include "shardlib/comm/reduce.hpp"
#include "shardlib/comm/signature.hpp"
#include "shardlib/comm/thread_group.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>  // std::stable_sort, std::find
#include <cstddef>    // std::size_t
#include <cstring>    // std::memcpy
#include <exception>  // std::exception_ptr, std::rethrow_exception
#include <memory>     // std::shared_ptr, std::make_shared
#include <span>       // std::span
#include <string>     // std::string
#include <utility>    // std::pair
#include <vector>     // std::vector

namespace shardlib::comm {

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
