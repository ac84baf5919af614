// shardlib/comm/tcp.hpp — the few POSIX socket calls the store and SocketComm need:
// an owned descriptor, listen, connect with retry, and sends and receives bounded
// by a deadline. Every failure is a comm_error naming the address and what it did.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <chrono>       // std::chrono::steady_clock
#include <cstddef>      // std::size_t, std::byte
#include <cstdint>      // std::uint16_t
#include <cstring>      // std::strerror, std::memset
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <thread>       // std::this_thread::sleep_for
#include <utility>      // std::exchange

#include <arpa/inet.h>    // inet_ntop
#include <cerrno>         // errno
#include <fcntl.h>        // fcntl, O_NONBLOCK
#include <netdb.h>        // getaddrinfo
#include <netinet/in.h>   // sockaddr_in
#include <netinet/tcp.h>  // TCP_NODELAY
#include <poll.h>         // poll
#include <sys/socket.h>   // socket, bind, listen, accept, connect, send, recv, getsockname, getpeername
#include <unistd.h>       // close

namespace shardlib::comm::detail {

using tcp_clock = std::chrono::steady_clock;

inline std::string errno_text(int e) { return std::strerror(e); }

// `limit` as the clock counts it. Longer than it can count (infinite, 1e300 s) is
// ~30 years, as good as no limit; so is NaN.
inline tcp_clock::duration wait_of(std::chrono::duration<double> limit) {
  constexpr std::chrono::duration<double> longest = std::chrono::hours(24 * 365 * 30);
  return std::chrono::duration_cast<tcp_clock::duration>(limit < longest ? limit : longest);
}
inline tcp_clock::time_point deadline_after(std::chrono::duration<double> limit) {
  return tcp_clock::now() + wait_of(limit);
}

// Milliseconds left until `deadline`, for poll (never negative; at most 1e9, about 11.6
// days, so a poll that returns 0 has timed out only if `expired(deadline)` says so).
inline int ms_until(tcp_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - tcp_clock::now()).count();
  return left <= 0 ? 0 : left > 1'000'000'000 ? 1'000'000'000 : int(left);
}
inline bool expired(tcp_clock::time_point deadline) { return tcp_clock::now() >= deadline; }

// An owned socket descriptor.
class socket_fd {
 public:
  socket_fd() = default;
  explicit socket_fd(int fd) : fd_(fd) {}
  socket_fd(socket_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  socket_fd& operator=(socket_fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~socket_fd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }
  // Wakes a thread blocked on this socket (accept, recv) without closing it.
  void shutdown() const {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  int fd_ = -1;
};

inline void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

inline void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// A listening socket on all IPv4 interfaces; port 0 picks a free one (see bound_port).
inline socket_fd listen_on(std::uint16_t port, std::string_view who) {
  socket_fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  require<comm_error>(bool(s), who, ": socket() failed: ", errno_text(errno));
  int one = 1;
  ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(port);
  const int bound = ::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
  require<comm_error>(bound == 0, who, ": cannot listen on port ", port, ": bind failed: ", errno_text(bound),
                      bound == EADDRINUSE ? " (another process listens there: choose a free port)" : "");
  require<comm_error>(::listen(s.get(), 1024) == 0, who, ": listen on port ", port, " failed: ", errno_text(errno));
  return s;
}

inline std::uint16_t bound_port(const socket_fd& s) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len);
  return ntohs(a.sin_port);
}

// The IPv4 address of one end of a connected socket: ::getsockname gives this
// process's (the interface through which it reached the peer), ::getpeername the
// peer's (as this process reaches it).
inline std::string address_of(const socket_fd& s, int (*end)(int, sockaddr*, socklen_t*)) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  end(s.get(), reinterpret_cast<sockaddr*>(&a), &len);
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof text);
  return text;
}

// Whether "a.b.c.d" or "a.b.c.d:port" lies in 127.0.0.0/8, the loopback block.
inline bool is_loopback(std::string_view address) { return address.starts_with("127."); }

// Where this rank (published as `mine`) reaches a peer that published `theirs`,
// both "ip:port" on the interface that leads to the store. A peer that reached the
// store through a loopback address runs on the store's host (MASTER_ADDR a name
// that the host's /etc/hosts maps to 127.0.1.1, as Debian's does, looks like
// that); ranks on other hosts reach it at the store's address as they see it.
inline std::string reachable(const std::string& theirs, const std::string& mine, const std::string& store_host) {
  if (!is_loopback(theirs) || is_loopback(mine)) return theirs;
  return store_host + theirs.substr(theirs.rfind(':'));
}

// Waits for `events` on fd until the deadline; false on timeout.
inline bool wait_for(int fd, short events, tcp_clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, ms_until(deadline));
    if (n > 0) return true;
    if (n == 0 && expired(deadline)) return false;
    if (n < 0 && errno != EINTR) return false;
  }
}

// One attempt to connect to `to`, waiting at most until `deadline` (a blocking
// connect would wait out the kernel's SYN retries, minutes); empty, with `last`
// saying why, on failure. The socket is non-blocking: its users poll.
inline socket_fd try_connect(const addrinfo& to, tcp_clock::time_point deadline, std::string& last) {
  socket_fd s(::socket(to.ai_family, to.ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, to.ai_protocol));
  if (!s) return last = errno_text(errno), socket_fd();
  if (::connect(s.get(), to.ai_addr, to.ai_addrlen) != 0) {
    if (errno != EINPROGRESS && errno != EINTR) return last = errno_text(errno), socket_fd();
    if (!wait_for(s.get(), POLLOUT, deadline)) return last = "timed out", socket_fd();
    int e = 0;
    socklen_t len = sizeof e;
    if (::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
    if (e != 0) return last = errno_text(e), socket_fd();
  }
  set_nodelay(s.get());
  return s;
}

// Connects to host:port, retrying while nobody listens there yet (the listener may
// start later), until `deadline` (resolving a name is bounded by the resolver's own
// timeout). `who` opens the error message.
inline socket_fd connect_to(const std::string& host, std::uint16_t port, tcp_clock::time_point deadline,
                            std::string_view who) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  std::string last = "nothing tried";
  auto pause = std::chrono::milliseconds(5);
  for (;;) {
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (rc != 0) {
      last = cat("cannot resolve ", host, ": ", ::gai_strerror(rc));
    } else {
      socket_fd s = try_connect(*found, deadline, last);
      ::freeaddrinfo(found);
      if (s) return s;
    }
    require<comm_error>(tcp_clock::now() + pause < deadline, who, ": cannot connect to ", host, ":", port,
                        " (last error: ", last, ")");
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::milliseconds(200)) pause *= 2;
  }
}

// Accepts one connection until the deadline; an empty socket_fd on timeout or when
// the listener fails. A failure that passes (a signal, a connection reset before it
// was accepted, no file descriptor free for now) is retried until the deadline.
inline socket_fd accept_until(const socket_fd& listener, tcp_clock::time_point deadline) {
  while (wait_for(listener.get(), POLLIN, deadline)) {
    socket_fd s(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (s) {
      set_nodelay(s.get());
      return s;
    }
    switch (errno) {
      case EMFILE: case ENFILE: case ENOBUFS: case ENOMEM:  // the connection still waits: poll would not
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        break;
      case EINTR: case ECONNABORTED: case EAGAIN: case EPROTO: case EPERM: break;
      default: return {};
    }
  }
  return {};
}

// The outcome of moving bytes through a blocking socket with a deadline.
enum class io_status { done, closed, timed_out };

// Sends all of data; never raises SIGPIPE.
inline io_status send_all(int fd, const void* data, std::size_t n, tcp_clock::time_point deadline) {
  auto* p = static_cast<const std::byte*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= std::size_t(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_for(fd, POLLOUT, deadline)) return io_status::timed_out;
    } else {
      return io_status::closed;
    }
  }
  return io_status::done;
}

// Receives exactly n bytes.
inline io_status recv_all(int fd, void* data, std::size_t n, tcp_clock::time_point deadline) {
  auto* p = static_cast<std::byte*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= std::size_t(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_for(fd, POLLIN, deadline)) return io_status::timed_out;
    } else {
      return io_status::closed;  // 0: the peer closed; < 0: reset
    }
  }
  return io_status::done;
}

}  // namespace shardlib::comm::detail
