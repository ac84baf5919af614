// shardlib/comm/socket_comm.hpp — SocketComm: ranks as processes (on one machine or
// several) joined by TCP connections, meeting through a TcpStore. No MPI needed.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/socket_group.hpp"  // socket_options, detail::socket_group
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/executor.hpp"
#include "shardlib/comm/reduce.hpp"
#include "shardlib/comm/signature.hpp"
#include "shardlib/comm/store.hpp"
#include "shardlib/comm/tcp.hpp"
#include "shardlib/comm/watchdog.hpp"
#include "shardlib/comm/work.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>  // std::stable_sort, std::find, std::min
#include <cerrno>     // errno
#include <chrono>     // std::chrono
#include <cstddef>    // std::size_t, std::byte
#include <cstdint>    // std::uint64_t, std::int32_t
#include <cstring>    // std::memcpy
#include <functional> // std::hash
#include <memory>     // std::shared_ptr
#include <optional>   // std::optional
#include <span>       // std::span
#include <string>     // std::string
#include <vector>     // std::vector

#include <poll.h>  // pollfd, poll

namespace shardlib::comm {

// Ranks as processes, one rank each, over a full mesh of TCP connections (one per
// pair of processes, made when the first communicator is created; communicators
// split from it share them). Each collective starts with every rank telling
// every other what it calls (so misuse raises the same comm_error everywhere),
// then moves data by direct exchange: each rank sends each peer exactly the part
// that peer needs, all transfers progressing together through poll():
//   all_gather      my block to every peer, every peer's block from it
//   reduce_scatter  block p of my input to peer p; my block from every peer, reduced here
//   all_reduce      reduce_scatter over W ranges, then all_gather of the reduced ranges
//   broadcast       the root to every peer
// Reductions combine ranks in rank order (reduce_into), so results equal
// ThreadComm's bit for bit. A peer whose connection closes (its process died or
// left) makes the waiting ranks raise comm_aborted naming it; one that stays
// silent for options.timeout makes them raise comm_error naming it. After either,
// the communicator and those split from it refuse further collectives.
// A handle: copies share the communicator. Asynchronous forms run on one worker
// thread per process, in issue order; blocking forms first wait for it.
class SocketComm {
 public:
  // Collective over the store's ranks: each listens on a free port, publishes
  // host:port in the store, connects to every lower rank and accepts every higher
  // one. Errors name the ranks that never published or never connected.
  explicit SocketComm(TcpStore& store, const socket_options& options = {}) : exec_(std::make_shared<executor>()) {
    auto mesh = std::make_shared<detail::socket_mesh>();
    const int rank = store.rank(), size = store.size();
    mesh->rank = rank;
    mesh->timeout = detail::comm_timeout(options.timeout);
    mesh->peers.resize(size);
    const std::string prefix = store.fresh_prefix("socket_comm");
    const std::uint64_t tag = detail::mix(std::hash<std::string>{}(prefix) ^ std::uint64_t(size));
    detail::socket_fd listener = detail::listen_on(0, cat("rank ", rank, ": SocketComm"));
    const std::string me = cat(store.local_address(), ":", detail::bound_port(listener));
    store.set(prefix + std::to_string(rank), me);
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
    const std::vector<std::string> published = store.get(keys);
    const std::string store_host = store.store_host_address();
    for (const auto& a : published) mesh->addresses.push_back(detail::reachable(a, me, store_host));
    const auto deadline = detail::deadline_after(store.timeout());
    const std::int64_t hello[2] = {std::int64_t(tag), rank};
    for (int p = 0; p < rank; ++p) {
      const std::string& a = mesh->addresses[p];
      const auto colon = a.rfind(':');
      auto s = detail::connect_to(a.substr(0, colon), std::uint16_t(std::stoi(a.substr(colon + 1))), deadline,
                                  cat("rank ", rank, ": SocketComm, connecting to rank ", p,
                                      a == published[p] ? "" : cat(" (it published ", published[p],
                                                                   ", a loopback address: its host is the store's)")));
      require<comm_error>(detail::send_all(s.get(), hello, sizeof hello, deadline) == detail::io_status::done, "rank ",
                          rank, ": SocketComm: rank ", p, " at ", a, " closed the connection while this rank joined");
      mesh->peers[p] = std::move(s);
    }
    // The higher ranks' handshakes are read as they arrive, from every accepted
    // connection at once: a stray that connects and says nothing (a port scan) holds
    // up no rank. A hello is 16 bytes sent at once, so one begun ends within a second.
    const auto missing = [&] {
      std::string m;
      for (int p = rank + 1; p < size; ++p)
        if (!mesh->peers[p]) m += cat(m.empty() ? "" : ", ", p, " (", mesh->addresses[p], ")");
      return m;
    };
    std::vector<detail::socket_fd> pending;
    while (!missing().empty()) {
      std::vector<pollfd> ready{{listener.get(), POLLIN, 0}};
      for (const auto& c : pending) ready.push_back({c.get(), POLLIN, 0});
      const int n = ::poll(ready.data(), ready.size(), detail::ms_until(deadline));
      if ((n < 0 && errno == EINTR) || (n == 0 && !detail::expired(deadline))) continue;
      if (n <= 0) break;
      for (std::size_t i = ready.size() - 1; i >= 1; --i) {  // from the back: erasing keeps earlier indices
        if (!ready[i].revents) continue;
        detail::socket_fd c = std::move(pending[i - 1]);
        pending.erase(pending.begin() + std::ptrdiff_t(i - 1));
        std::int64_t theirs[2] = {0, -1};
        if (detail::recv_all(c.get(), theirs, sizeof theirs, std::min(deadline, detail::deadline_after(seconds(1)))) ==
                detail::io_status::done &&
            theirs[0] == std::int64_t(tag) && theirs[1] > rank && theirs[1] < size && !mesh->peers[theirs[1]])
          mesh->peers[theirs[1]] = std::move(c);  // anything else was a stray: closed here
      }
      if (ready[0].revents)
        if (auto c = detail::accept_until(listener, detail::tcp_clock::now())) pending.push_back(std::move(c));
    }
    if (const std::string m = missing(); !m.empty())
      throw comm_error(cat("rank ", rank, ": SocketComm: ranks ", m, " never connected to this rank at ", me,
                           " within ", store.timeout().count(), " s"));
    for (auto& s : mesh->peers)
      if (s) detail::set_nonblocking(s.get());
    std::vector<int> members(size);
    for (int r = 0; r < size; ++r) members[r] = r;
    g_ = std::make_shared<detail::socket_group>(detail::socket_group{std::move(mesh), std::move(members), rank, tag, 0});
  }

  int rank() const { return g_->rank; }
  int size() const { return g_->size(); }
  // The timeout in use (after SHARDLIB_COMM_TIMEOUT and the default).
  seconds timeout() const { return g_->mesh->timeout; }

  void barrier() {
    exec_->drain();
    g_->begin({detail::op_kind::barrier});
  }

  template <Element T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    exec_->drain();
    all_gather_on(*g_, send, recv);
  }
  template <Element T>
  [[nodiscard]] work all_gather_async(std::span<const T> send, std::span<T> recv) {
    return exec_->submit([g = g_, send, recv] { all_gather_on(*g, send, recv); });
  }

  template <Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    exec_->drain();
    reduce_scatter_on(*g_, send, recv, op);
  }
  template <Element T>
  [[nodiscard]] work reduce_scatter_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return exec_->submit([g = g_, send, recv, op] { reduce_scatter_on(*g, send, recv, op); });
  }

  template <Element T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
    exec_->drain();
    all_reduce_on(*g_, send, recv, op);
  }
  template <Element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <Element T>
  [[nodiscard]] work all_reduce_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return exec_->submit([g = g_, send, recv, op] { all_reduce_on(*g, send, recv, op); });
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    exec_->drain();
    broadcast_on(*g_, data, root);
  }
  template <Element T>
  [[nodiscard]] work broadcast_async(std::span<T> data, int root) {
    return exec_->submit([g = g_, data, root] { broadcast_on(*g, data, root); });
  }

  // Ranks with the same color form a new communicator over the same connections,
  // ordered by key, then by rank here. Every rank must call it; color must be >= 0.
  SocketComm split(int color, int key) {
    exec_->drain();
    const auto invalid = detail::invalid_call(
        [&] { require<comm_error>(color >= 0, "rank ", rank(), ": split color must be >= 0, got ", color); });
    const auto frames = g_->begin({detail::op_kind::split}, invalid, color, key);
    std::vector<int> chosen;  // group ranks of this color, in new-rank order
    for (int r = 0; r < size(); ++r)
      if (frames[r].color == color) chosen.push_back(r);
    std::stable_sort(chosen.begin(), chosen.end(), [&](int a, int b) { return frames[a].key < frames[b].key; });
    auto sub = std::make_shared<detail::socket_group>();
    sub->mesh = g_->mesh;
    for (int r : chosen) sub->members.push_back(g_->members[r]);
    sub->rank = int(std::find(chosen.begin(), chosen.end(), rank()) - chosen.begin());
    sub->id = detail::mix(g_->id ^ detail::mix(g_->seq ^ detail::mix(std::uint64_t(color))));
    return SocketComm(std::move(sub), exec_);
  }

 private:
  SocketComm(std::shared_ptr<detail::socket_group> g, std::shared_ptr<executor> exec)
      : g_(std::move(g)), exec_(std::move(exec)) {}

  template <class T>
  static const std::byte* bytes(const T* p) {
    return reinterpret_cast<const std::byte*>(p);
  }
  template <class T>
  static std::byte* bytes(T* p) {
    return reinterpret_cast<std::byte*>(p);
  }

  template <class T>
  static void all_gather_on(detail::socket_group& g, std::span<const T> send, std::span<T> recv) {
    const std::size_t n = send.size();
    const int w = g.size(), me = g.rank;
    const detail::signature sig{detail::op_kind::all_gather, dtype_of<T>, n};
    g.begin(sig, detail::invalid_call([&] {
      require<shape_error>(recv.size() == n * w, "rank ", me, ": all_gather of ", n, " elements per rank over ", w,
                           " ranks needs a receive buffer of ", n * w, ", got ", recv.size());
    }));
    std::vector<detail::part> sends, recvs;
    for (int p = 0; p < w; ++p)
      if (p != me) {
        sends.push_back({p, bytes(send.data()), nullptr, n * sizeof(T)});
        recvs.push_back({p, nullptr, bytes(recv.data() + p * n), n * sizeof(T)});
      }
    if (T* mine = recv.data() + me * n; mine != send.data() && n) std::memcpy(mine, send.data(), n * sizeof(T));
    g.exchange(std::move(sends), std::move(recvs), sig);
  }

  template <class T>
  static void reduce_scatter_on(detail::socket_group& g, std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = recv.size();
    const int w = g.size(), me = g.rank;
    const detail::signature sig{detail::op_kind::reduce_scatter, dtype_of<T>, n, op};
    g.begin(sig, detail::invalid_call([&] {
      require<shape_error>(send.size() == n * w, "rank ", me, ": reduce_scatter to ", n, " elements per rank over ", w,
                           " ranks needs a send buffer of ", n * w, ", got ", send.size());
      check_reducible(op, dtype_of<T>, me, "reduce_scatter");
    }));
    reduce_ranges(g, send.data(), recv.data(), [n](int r) { return std::pair{n * r, n * (r + 1)}; }, op, sig);
  }

  // Rank r receives range r of every rank's input and reduces it into out, in rank
  // order (out may be the send buffer's own range r).
  template <class T, class Range>
  static void reduce_ranges(detail::socket_group& g, const T* in, T* out, Range range, reduce_op op,
                            const detail::signature& sig) {
    const int w = g.size(), me = g.rank;
    const auto [lo, hi] = range(me);
    const std::size_t len = hi - lo;
    std::unique_ptr<T[]> staged(new T[len * std::size_t(w - 1) + 1]);
    std::vector<const T*> srcs(w);
    std::vector<detail::part> sends, recvs;
    for (int p = 0, slot = 0; p < w; ++p) {
      if (p == me) {
        srcs[p] = in + lo;
        continue;
      }
      const auto [a, b] = range(p);
      sends.push_back({p, bytes(in + a), nullptr, (b - a) * sizeof(T)});
      srcs[p] = staged.get() + len * slot;
      recvs.push_back({p, nullptr, bytes(staged.get() + len * slot++), len * sizeof(T)});
    }
    g.exchange(std::move(sends), std::move(recvs), sig);
    reduce_into(out, std::span<const T* const>(srcs), len, op);
  }

  template <class T>
  static void all_reduce_on(detail::socket_group& g, std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = send.size();
    const int w = g.size(), me = g.rank;
    const detail::signature sig{detail::op_kind::all_reduce, dtype_of<T>, n, op};
    g.begin(sig, detail::invalid_call([&] {
      require<shape_error>(recv.size() == n, "rank ", me, ": all_reduce of ", n,
                           " elements needs a receive buffer of the same size, got ", recv.size());
      check_reducible(op, dtype_of<T>, me, "all_reduce");
    }));
    auto range = [n, w](int r) { return std::pair{n * r / w, n * (r + 1) / w}; };
    const auto [lo, hi] = range(me);
    reduce_ranges(g, send.data(), recv.data() + lo, range, op, sig);
    std::vector<detail::part> sends, recvs;
    for (int p = 0; p < w; ++p)
      if (p != me) {
        const auto [a, b] = range(p);
        sends.push_back({p, bytes(recv.data() + lo), nullptr, (hi - lo) * sizeof(T)});
        recvs.push_back({p, nullptr, bytes(recv.data() + a), (b - a) * sizeof(T)});
      }
    g.exchange(std::move(sends), std::move(recvs), sig);
  }

  template <class T>
  static void broadcast_on(detail::socket_group& g, std::span<T> data, int root) {
    const detail::signature sig{detail::op_kind::broadcast, dtype_of<T>, data.size(), reduce_op::sum, root};
    g.begin(sig, detail::invalid_call([&] {
      require<comm_error>(root >= 0 && root < g.size(), "rank ", g.rank, ": broadcast root ", root,
                          " is not a rank of ", g.size());
    }));
    std::vector<detail::part> sends, recvs;
    if (g.rank == root) {
      for (int p = 0; p < g.size(); ++p)
        if (p != root) sends.push_back({p, bytes(data.data()), nullptr, data.size_bytes()});
    } else {
      recvs.push_back({root, nullptr, bytes(data.data()), data.size_bytes()});
    }
    g.exchange(std::move(sends), std::move(recvs), sig);
  }

  std::shared_ptr<detail::socket_group> g_;
  std::shared_ptr<executor> exec_;
};

static_assert(check_communicator<SocketComm>());

}  // namespace shardlib::comm
