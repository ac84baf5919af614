// shardlib/comm/socket_group.hpp — SocketComm's insides: the TCP mesh between processes, the
// framing of what ranks send, and the group that runs a collective by direct exchange; its options.
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

#include <algorithm>  // std::any_of, std::min, std::stable_sort, std::find
#include <chrono>     // std::chrono
#include <cstddef>    // std::size_t, std::byte
#include <cstdint>    // std::uint64_t, std::int32_t
#include <cstring>    // std::memcpy
#include <exception>  // std::exception_ptr, std::rethrow_exception
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
  // when set, else default_comm_timeout (600 s); zero or infinite: no limit.
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
  std::uint32_t invalid = 0;        // bytes of why this rank's arguments are wrong, sent after the frames; 0: right
};

inline constexpr std::size_t longest_invalid_reason = 4096;

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
    for (int n = 1; n > 0 || (n < 0 && errno == EINTR);) {  // a signal does not end the drain early
      for (auto& p : open) {
        ssize_t k;
        while ((k = ::recv(p.fd, scratch, sizeof scratch, MSG_DONTWAIT)) > 0) {
        }
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) p.fd = -1;  // hung up
      }
      std::erase_if(open, [](const pollfd& p) { return p.fd < 0; });
      if (open.empty()) break;
      n = ::poll(open.data(), open.size(), ms_until(deadline));
    }
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
    const auto limit = wait_of(mesh->timeout.count() > 0 ? mesh->timeout : seconds::max());
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
      if (n < 0)  // ENOMEM: no pollfd was filled in, and a retry would spin
        fail(comm_error(cat(where(sig), ": poll failed: ", std::strerror(errno))));
      if (n == 0 && expired(deadline)) {
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
  // A notice of 255 is "some rank": one numbered 255 or more, which a byte cannot name.
  [[noreturn]] void lost(int p, const signature& sig) {
    const int from_rank = members[p];
    int gone = from_rank;  // mesh ranks
    bool unnamed = false;  // p reports a rank the notice cannot name
    unsigned char notice = 0;
    if (::recv(fd(p), &notice, 1, MSG_OOB | MSG_DONTWAIT) == 1) {
      if (notice == 255) unnamed = true;
      else if (int(notice) != mesh->rank && int(notice) < int(mesh->peers.size())) gone = notice;
    }
    if (mesh->broken.empty()) {
      notice = unnamed || gone >= 255 ? 255 : (unsigned char)(gone);
      for (int q = 0; q < int(mesh->peers.size()); ++q)
        if ((unnamed || q != gone) && mesh->peers[q])
          ::send(mesh->peers[q].get(), &notice, 1, MSG_OOB | MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    if (unnamed)
      fail(comm_aborted(cat(where(sig), ": rank ", p, " (", mesh->addresses[from_rank], ") reports that a process of "
                            "the job numbered 255 or more has gone (exited, failed, or left)")));
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
  // group rank. All ranks see the same frames, so a disagreement, or a rank's
  // `invalid` arguments (their error follows the frames), raises everywhere, before
  // any payload moves.
  std::vector<frame> begin(const signature& sig, const std::exception_ptr& invalid = nullptr, int color = 0,
                           int key = 0) {
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
    std::string why = invalid ? what_of(invalid).substr(0, longest_invalid_reason) : std::string();
    if (invalid && why.empty()) why = "no reason given";
    mine.invalid = std::uint32_t(why.size());
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
    if (std::any_of(frames.begin(), frames.end(), [](const frame& f) { return f.invalid > 0; })) {
      std::vector<std::string> reasons(size());
      sends.clear(), recvs.clear();
      for (int p = 0; p < size(); ++p) {
        if (p == rank) continue;
        if (mine.invalid) sends.push_back({p, reinterpret_cast<const std::byte*>(why.data()), nullptr, mine.invalid});
        reasons[p].resize(std::min<std::size_t>(frames[p].invalid, longest_invalid_reason));
        recvs.push_back({p, nullptr, reinterpret_cast<std::byte*>(reasons[p].data()), reasons[p].size()});
      }
      exchange(std::move(sends), std::move(recvs), sig);
      if (invalid) std::rethrow_exception(invalid);
      for (int p = 0; p < size(); ++p)
        if (frames[p].invalid) throw invalid_elsewhere(rank, sig, p, sig_of(frames[p]), reasons[p]);
    }
    for (int p = 1; p < size(); ++p)
      if (!(sig_of(frames[p]) == sig_of(frames[0])))  // every rank raises it; the streams still line up
        throw disagreement(rank, sig_of(frames[0]), p, sig_of(frames[p]));
    return frames;
  }
};

}  // namespace detail

}  // namespace shardlib::comm
