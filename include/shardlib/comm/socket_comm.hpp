// shardlib/comm/socket_comm.hpp — SocketComm: ranks as processes (on one machine or
// several) joined by TCP connections, meeting through a TcpStore. No MPI needed.
#pragma once
#include "shardlib/config.hpp"
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

#include <algorithm>  // std::stable_sort, std::find
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

namespace shardlib::comm {

struct socket_options {
  // How long a collective may go without any byte from a peer it waits for before
  // it raises comm_error naming that peer. Unset: SHARDLIB_COMM_TIMEOUT (seconds)
  // when set, else default_comm_timeout (600 s); zero: no limit.
  std::optional<seconds> timeout = std::nullopt;
};

namespace detail {

inline constexpr std::uint64_t socket_magic = 0x5348'4152'444c'4942;  // "SHARDLIB"

// Sent by every rank to every other at the start of each collective: a rank
// checks that its peers call the same collective, on the same communicator, as
// the same one in sequence, before any payload moves.
struct frame {
  std::uint64_t magic = socket_magic;
  std::uint64_t comm = 0, seq = 0;
  std::uint64_t count = 0;
  std::int32_t kind = 0, type = 0, op = 0, root = 0;
  std::int32_t color = 0, key = 0;  // split
};

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The connections of one process to every other of the job, shared by all
// communicators split from the first. Once a collective fails part-way, the byte
// streams no longer line up: the mesh is broken and refuses later collectives.
struct socket_mesh {
  int rank = 0;
  std::vector<socket_fd> peers;        // by mesh rank; none for this rank
  std::vector<std::string> addresses;  // "ip:port" by mesh rank
  seconds timeout{};
  std::string broken;  // why, once broken

  // Closing over unread bytes resets a connection, and a reset discards the
  // out-of-band notice this rank may have sent just before (socket_group::lost).
  // So the mesh says it sends no more, reads what comes, and, once broken, waits
  // (a second at most) for its peers to hang up too.
  ~socket_mesh() {
    std::vector<pollfd> open;
    for (auto& s : peers)
      if (s) {
        ::shutdown(s.get(), SHUT_WR);
        open.push_back({s.get(), POLLIN, 0});
      }
    const auto deadline = tcp_clock::now() + std::chrono::seconds(broken.empty() ? 0 : 1);
    char scratch[4096];
    do {
      for (auto& p : open) {
        ssize_t k;
        while ((k = ::recv(p.fd, scratch, sizeof scratch, MSG_DONTWAIT)) > 0) {
        }
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) p.fd = -1;  // hung up
      }
      std::erase_if(open, [](const pollfd& p) { return p.fd < 0; });
    } while (!open.empty() && ::poll(open.data(), open.size(), ms_until(deadline)) > 0);
  }
};

// A contiguous piece to send to, or receive from, one peer (a group rank).
struct part {
  int peer;
  const std::byte* out;  // send
  std::byte* in;         // receive
  std::size_t len;
};

// One communicator: the ranks of the mesh it spans, in group-rank order.
struct socket_group {
  std::shared_ptr<socket_mesh> mesh;
  std::vector<int> members;  // group rank -> mesh rank
  int rank = 0;
  std::uint64_t id = 0;
  std::uint64_t seq = 0;  // collectives issued so far

  int size() const { return int(members.size()); }
  int fd(int peer) const { return mesh->peers[members[peer]].get(); }
  const std::string& address(int peer) const { return mesh->addresses[members[peer]]; }

  std::string where(const signature& sig) const {
    return cat("rank ", rank, ": ", describe(sig), ", collective ", seq, " on a communicator of ", size(), " ranks");
  }

  // Moves every part at once, in whatever order the sockets allow (no rank can
  // block another by sending first), until all are done. A peer that closes its
  // connection, or sends nothing for the timeout while this rank waits on it,
  // raises; either leaves the mesh broken.
  void exchange(std::vector<part> sends, std::vector<part> recvs, const signature& sig) {
    std::vector<std::size_t> send_next(size(), 0), recv_next(size(), 0);
    std::vector<std::vector<part*>> to(size()), from(size());
    for (auto& p : sends)
      if (p.len) to[p.peer].push_back(&p);
    for (auto& p : recvs)
      if (p.len) from[p.peer].push_back(&p);
    const bool limited = mesh->timeout.count() > 0;
    const auto limit = std::chrono::duration_cast<tcp_clock::duration>(limited ? mesh->timeout : seconds(1e6));
    auto deadline = tcp_clock::now() + limit;
    std::vector<pollfd> polls;
    std::vector<int> polled;  // group rank of each pollfd
    for (;;) {
      polls.clear();
      polled.clear();
      for (int p = 0; p < size(); ++p) {
        short events = 0;
        if (!to[p].empty()) events |= POLLOUT;
        if (!from[p].empty()) events |= POLLIN;
        if (events) polls.push_back({fd(p), short(events | POLLPRI), 0}), polled.push_back(p);
      }
      if (polls.empty()) return;
      const int n = ::poll(polls.data(), polls.size(), ms_until(deadline));
      if (n < 0 && errno == EINTR) continue;
      if (n == 0 && tcp_clock::now() >= deadline) {
        std::string late;
        for (int p : polled) late += cat(late.empty() ? "" : ", ", p, " (", address(p), ")");
        fail(comm_error(cat(where(sig), ": nothing from or to rank ", late, " for ", mesh->timeout.count(),
                            " s (socket_options::timeout, SHARDLIB_COMM_TIMEOUT): it has stopped, hangs, or waits in "
                            "another collective")));
      }
      for (std::size_t i = 0; i < polls.size(); ++i) {
        const int p = polled[i];
        const short got = polls[i].revents;
        if (!got) continue;
        bool moved = false;
        // As much as the socket takes or holds now: fewer polls for large messages.
        if (!from[p].empty() && (got & (POLLIN | POLLERR | POLLHUP))) {
          while (!from[p].empty()) {
            part& x = *from[p].front();
            const ssize_t k = ::recv(fd(p), x.in + recv_next[p], x.len - recv_next[p], MSG_DONTWAIT);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) lost(p, sig);
            if (k < 0) break;
            moved = true;
            if ((recv_next[p] += std::size_t(k)) == x.len) from[p].erase(from[p].begin()), recv_next[p] = 0;
          }
        } else if (got & (POLLERR | POLLHUP)) {
          lost(p, sig);
        }
        if (!to[p].empty() && (got & POLLOUT)) {
          while (!to[p].empty()) {
            part& x = *to[p].front();
            const ssize_t k = ::send(fd(p), x.out + send_next[p], x.len - send_next[p], MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) lost(p, sig);
            if (k <= 0) break;
            moved = true;
            if ((send_next[p] += std::size_t(k)) == x.len) to[p].erase(to[p].begin()), send_next[p] = 0;
          }
        }
        if (moved) deadline = tcp_clock::now() + limit;
        // p's notice that some rank has gone: p sends nothing after it, so once what
        // it sent before is read and nothing moves, this collective cannot finish.
        if ((got & POLLPRI) && !moved) lost(p, sig);
      }
    }
  }

  // The connection to peer p closed, or p sent a notice (one out-of-band byte,
  // outside the byte stream) that the connection to another rank closed. Names the
  // rank that has gone and passes the notice on, so that every rank names the same
  // one rather than the peers that left after it.
  [[noreturn]] void lost(int p, const signature& sig) {
    const int from_rank = members[p];
    int gone = from_rank;  // mesh ranks
    unsigned char notice = 0;
    if (::recv(fd(p), &notice, 1, MSG_OOB | MSG_DONTWAIT) == 1 && notice != 255 && int(notice) != mesh->rank &&
        int(notice) < int(mesh->peers.size()))
      gone = notice;
    if (mesh->broken.empty()) {
      notice = gone < 255 ? (unsigned char)(gone) : 255;  // 255: "some rank"
      for (int q = 0; q < int(mesh->peers.size()); ++q)
        if (q != gone && mesh->peers[q]) ::send(mesh->peers[q].get(), &notice, 1, MSG_OOB | MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    const auto it = std::find(members.begin(), members.end(), gone);
    const std::string who = it != members.end() ? cat("rank ", it - members.begin()) : cat("process rank ", gone);
    fail(comm_aborted(cat(where(sig), ": the connection to ", who, " (", mesh->addresses[gone], ") closed",
                          gone != from_rank ? cat(" (rank ", p, " reports it)") : std::string(), ": ", who,
                          " exited, failed, or left the communicator")));
  }
  template <class E>
  [[noreturn]] void fail(E e) {
    if (mesh->broken.empty()) mesh->broken = e.what();
    throw e;
  }

  // Every rank sends its frame to every other and checks theirs; returns them by
  // group rank. All ranks see the same frames, so a disagreement raises the same
  // error everywhere, before any payload moves.
  std::vector<frame> begin(const signature& sig, int color = 0, int key = 0) {
    require<comm_error>(mesh->broken.empty(), "rank ", rank, ": ", describe(sig),
                        ": the communicator failed earlier and cannot be used: ", mesh->broken);
    ++seq;
    std::vector<frame> frames(size());
    frame& mine = frames[rank];
    mine.comm = id;
    mine.seq = seq;
    mine.count = sig.count;
    mine.kind = int(sig.kind), mine.type = int(sig.type), mine.op = int(sig.op), mine.root = sig.root;
    mine.color = color, mine.key = key;
    std::vector<part> sends, recvs;
    for (int p = 0; p < size(); ++p)
      if (p != rank) {
        sends.push_back({p, reinterpret_cast<const std::byte*>(&mine), nullptr, sizeof(frame)});
        recvs.push_back({p, nullptr, reinterpret_cast<std::byte*>(&frames[p]), sizeof(frame)});
      }
    exchange(std::move(sends), std::move(recvs), sig);
    for (int p = 0; p < size(); ++p)
      if (frames[p].magic != socket_magic || frames[p].comm != id || frames[p].seq != seq)
        fail(comm_error(cat(where(sig), ": rank ", p, " sent collective ", frames[p].seq, " of another communicator",
                            " where this rank expected collective ", seq, " of this one: the ranks call collectives "
                            "on different communicators in different orders")));
    auto sig_of = [](const frame& f) {
      return signature{op_kind(f.kind), dtype(f.type), std::size_t(f.count), reduce_op(f.op), f.root};
    };
    for (int p = 1; p < size(); ++p)
      if (!(sig_of(frames[p]) == sig_of(frames[0])))  // every rank raises it; the streams still line up
        throw disagreement(rank, sig_of(frames[0]), p, sig_of(frames[p]));
    return frames;
  }
};

}  // namespace detail

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
    mesh->addresses = store.get(keys);
    const auto deadline = detail::tcp_clock::now() +
                          std::chrono::duration_cast<detail::tcp_clock::duration>(store.timeout());
    const std::int64_t hello[2] = {std::int64_t(tag), rank};
    for (int p = 0; p < rank; ++p) {
      const std::string& a = mesh->addresses[p];
      const auto colon = a.rfind(':');
      auto s = detail::connect_to(a.substr(0, colon), std::uint16_t(std::stoi(a.substr(colon + 1))), deadline,
                                  cat("rank ", rank, ": SocketComm, connecting to rank ", p));
      require<comm_error>(detail::send_all(s.get(), hello, sizeof hello, deadline) == detail::io_status::done, "rank ",
                          rank, ": SocketComm: rank ", p, " at ", a, " closed the connection while this rank joined");
      mesh->peers[p] = std::move(s);
    }
    for (int joined = rank + 1; joined < size; ++joined) {
      auto s = detail::accept_until(listener, deadline);
      std::int64_t theirs[2] = {0, -1};
      if (s && detail::recv_all(s.get(), theirs, sizeof theirs, deadline) == detail::io_status::done &&
          theirs[0] == std::int64_t(tag) && theirs[1] > rank && theirs[1] < size && !mesh->peers[theirs[1]]) {
        mesh->peers[theirs[1]] = std::move(s);
        continue;
      }
      if (s) {  // a stray connection, not a rank of this communicator
        --joined;
        continue;
      }
      std::string missing;
      for (int p = rank + 1; p < size; ++p)
        if (!mesh->peers[p]) missing += cat(missing.empty() ? "" : ", ", p, " (", mesh->addresses[p], ")");
      throw comm_error(cat("rank ", rank, ": SocketComm: ranks ", missing, " never connected to this rank at ", me,
                           " within ", store.timeout().count(), " s"));
    }
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
  work all_gather_async(std::span<const T> send, std::span<T> recv) {
    return exec_->submit([g = g_, send, recv] { all_gather_on(*g, send, recv); });
  }

  template <Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    exec_->drain();
    reduce_scatter_on(*g_, send, recv, op);
  }
  template <Element T>
  work reduce_scatter_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
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
  work all_reduce_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    return exec_->submit([g = g_, send, recv, op] { all_reduce_on(*g, send, recv, op); });
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    exec_->drain();
    broadcast_on(*g_, data, root);
  }
  template <Element T>
  work broadcast_async(std::span<T> data, int root) {
    return exec_->submit([g = g_, data, root] { broadcast_on(*g, data, root); });
  }

  // Ranks with the same color form a new communicator over the same connections,
  // ordered by key, then by rank here. Every rank must call it; color must be >= 0.
  SocketComm split(int color, int key) {
    require<comm_error>(color >= 0, "rank ", rank(), ": split color must be >= 0, got ", color);
    exec_->drain();
    const auto frames = g_->begin({detail::op_kind::split}, color, key);
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
    require<shape_error>(recv.size() == n * w, "rank ", me, ": all_gather of ", n, " elements per rank over ", w,
                         " ranks needs a receive buffer of ", n * w, ", got ", recv.size());
    const detail::signature sig{detail::op_kind::all_gather, dtype_of<T>, n};
    g.begin(sig);
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
    require<shape_error>(send.size() == n * w, "rank ", me, ": reduce_scatter to ", n, " elements per rank over ", w,
                         " ranks needs a send buffer of ", n * w, ", got ", send.size());
    check_reducible(op, dtype_of<T>);
    const detail::signature sig{detail::op_kind::reduce_scatter, dtype_of<T>, n, op};
    g.begin(sig);
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
    require<shape_error>(recv.size() == n, "rank ", me, ": all_reduce of ", n,
                         " elements needs a receive buffer of the same size, got ", recv.size());
    check_reducible(op, dtype_of<T>);
    const detail::signature sig{detail::op_kind::all_reduce, dtype_of<T>, n, op};
    g.begin(sig);
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
    require<comm_error>(root >= 0 && root < g.size(), "rank ", g.rank, ": broadcast root ", root, " is not a rank of ",
                        g.size());
    const detail::signature sig{detail::op_kind::broadcast, dtype_of<T>, data.size(), reduce_op::sum, root};
    g.begin(sig);
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
