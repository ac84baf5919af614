// shardlib/comm/store.hpp — TcpStore: a key-value store over TCP through which the
// processes of a job meet (PyTorch's TCPStore): set, get, add, wait and a barrier.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/tcp.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>           // std::all_of
#include <charconv>            // std::from_chars
#include <chrono>              // std::chrono
#include <condition_variable>  // std::condition_variable
#include <cstdint>             // std::int64_t, std::uint8_t, std::uint32_t
#include <cstdio>              // std::fputs
#include <cstring>             // std::memcpy
#include <list>                // std::list
#include <map>                 // std::map
#include <memory>              // std::unique_ptr
#include <mutex>               // std::mutex
#include <string>              // std::string
#include <string_view>         // std::string_view
#include <thread>              // std::thread
#include <type_traits>         // std::invoke_result_t
#include <vector>              // std::vector

namespace shardlib::comm {

using seconds = std::chrono::duration<double>;

namespace detail {

enum class store_op : std::uint8_t { hello, set, get, add, check };

// The most a request may carry: the server drops a client that sends more rather
// than allocate what a malformed length says.
inline constexpr std::int64_t longest_store_string = std::int64_t(1) << 26;  // bytes of a key or value
inline constexpr std::int64_t most_store_keys = std::int64_t(1) << 20;

// Requests and replies: numbers as 8 raw bytes, strings and lists with a count first.
struct wire {
  std::string bytes;
  wire& num(std::int64_t x) {
    bytes.append(reinterpret_cast<const char*>(&x), sizeof x);
    return *this;
  }
  wire& str(std::string_view s) {
    num(std::int64_t(s.size()));
    bytes.append(s);
    return *this;
  }
  wire& strs(const std::vector<std::string>& v) {
    num(std::int64_t(v.size()));
    for (auto& s : v) str(s);
    return *this;
  }
};

// Reads the pieces of one message from a socket; false once the peer is gone or too slow.
struct reader {
  int fd;
  tcp_clock::time_point deadline;
  bool ok = true;
  std::int64_t num() {
    std::int64_t x = 0;
    ok = ok && recv_all(fd, &x, sizeof x, deadline) == io_status::done;
    return x;
  }
  std::string str() {
    const std::int64_t n = num();
    if (!ok || n < 0 || n > longest_store_string) return ok = false, std::string();
    std::string s(std::size_t(n), '\0');
    ok = recv_all(fd, s.data(), s.size(), deadline) == io_status::done;
    return s;
  }
  std::vector<std::string> strs() {
    const std::int64_t n = num();
    std::vector<std::string> v;
    if (n < 0 || n > most_store_keys) ok = false;
    for (std::int64_t i = 0; ok && i < n; ++i) v.push_back(str());
    return v;
  }
};

}  // namespace detail

// The server half: rank 0 of a job runs it (TcpStore does, when it is rank 0).
// One thread accepts, one thread per client answers; get waits in the server
// until its keys exist or the client's timeout passes. A client that hangs up is
// reaped (its thread joined, its descriptor closed), so connections that come and
// go (health checks, port scans) cost nothing for long. The destructor stops
// accepting and waits (at most `linger`) for the ranks still connected to hang up,
// so a rank that finishes first does not pull the store from under the others; a
// connection that never said which rank it is does not hold it.
class store_server {
 public:
  // Listens on all interfaces at `port` (0: a free port, see port()); `who` begins
  // the errors of listening. A client has `io_limit` to send a request whole, and to take
  // in a reply (a get's own wait for its keys is not counted).
  explicit store_server(std::uint16_t port, int world_size, seconds linger = seconds(30),
                        std::string_view who = "the store", seconds io_limit = seconds(60))
      : listener_(detail::listen_on(port, who)),
        world_(world_size),
        linger_(linger),
        io_limit_(io_limit),
        connected_(world_size) {
    port_ = detail::bound_port(listener_);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  store_server(const store_server&) = delete;
  store_server& operator=(const store_server&) = delete;
  ~store_server() {
    std::unique_lock lock(m_);
    stopping_ = true;
    cv_.wait_until(lock, detail::deadline_after(linger_), [&] { return active_ == 0; });
    closing_ = true;  // ends the gets still waiting
    cv_.notify_all();
    for (auto& c : clients_) c.fd.shutdown();
    lock.unlock();
    acceptor_.join();
    for (auto& c : clients_) c.thread.join();
  }
  std::uint16_t port() const { return port_; }

 private:
  struct client {
    detail::socket_fd fd;
    std::thread thread;
    bool done = false;  // serve() has returned but for its last lines
  };

  void accept_loop() {
    for (;;) {
      auto s = detail::accept_until(listener_, detail::tcp_clock::now() + std::chrono::milliseconds(100));
      std::lock_guard lock(m_);
      if (stopping_) return;
      reap();
      if (!s) continue;
      try {
        auto& c = clients_.emplace_back(client{std::move(s), {}});
        c.thread = std::thread([this, &c] { serve(c); });
      } catch (const std::exception& e) {  // this client is refused; the others are still served
        if (!clients_.empty() && !clients_.back().thread.joinable()) clients_.pop_back();
        dropped(e);
      }
    }
  }

  // Under m_: the clients that hung up. Their done is set under m_ too, so their
  // threads have only to return.
  void reap() {
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (!it->done) {
        ++it;
        continue;
      }
      it->thread.join();
      it = clients_.erase(it);
    }
  }

  static void dropped(const std::exception& e) {
    std::fputs(cat("store: dropped a client: ", e.what(), "\n").c_str(), stderr);
  }

  // Until the client hangs up or sends a malformed request (then it is hung up on),
  // or the destructor shuts its socket (which wakes the poll).
  void serve(client& c) {
    const int fd = c.fd.get();
    int rank = -1;
    try {
      for (;;) {
        if (!detail::wait_for(fd, POLLIN, detail::tcp_clock::now() + std::chrono::seconds(1))) continue;
        if (!answer(fd, rank)) break;
      }
    } catch (const std::exception& e) {
      dropped(e);
    }
    ::shutdown(fd, SHUT_RDWR);
    std::lock_guard lock(m_);
    if (rank >= 0) --active_;
    c.done = true;
    cv_.notify_all();
  }

  // Reads one request and replies; false when the client has gone.
  bool answer(int fd, int& rank) {
    const auto deadline = detail::deadline_after(io_limit_);  // for reading the request
    std::uint8_t op = 0;
    if (detail::recv_all(fd, &op, 1, deadline) != detail::io_status::done) return false;
    detail::reader in{fd, deadline};
    detail::wire out;
    switch (detail::store_op(op)) {
      case detail::store_op::hello: {
        const auto said = in.num();
        if (!in.ok) return false;
        std::lock_guard lock(m_);
        if (rank < 0 && said >= 0 && said < world_) {  // a rank: the destructor lingers for it
          rank = int(said);
          connected_[std::size_t(rank)] = true;
          ++active_;
        }
        out.num(world_);
        break;
      }
      case detail::store_op::set: {
        std::string key = in.str(), value = in.str();
        if (!in.ok) return false;
        std::lock_guard lock(m_);
        data_[std::move(key)] = std::move(value);
        cv_.notify_all();
        out.num(0);
        break;
      }
      case detail::store_op::add: {
        std::string key = in.str();
        const std::int64_t delta = in.num();
        if (!in.ok) return false;
        std::lock_guard lock(m_);
        auto& v = data_[key];
        std::int64_t now = 0;  // a value that is not a number counts as 0
        std::from_chars(v.data(), v.data() + v.size(), now);
        now = std::int64_t(std::uint64_t(now) + std::uint64_t(delta));  // wraps, as in two's complement
        v = std::to_string(now);
        cv_.notify_all();
        out.num(now);
        break;
      }
      case detail::store_op::check:
      case detail::store_op::get: {
        const auto keys = in.strs();
        const std::int64_t wait_ms = detail::store_op(op) == detail::store_op::get ? in.num() : 0;
        if (!in.ok) return false;
        std::unique_lock lock(m_);
        auto present = [&] {
          return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
        };
        cv_.wait_until(lock, detail::deadline_after(std::chrono::milliseconds(wait_ms)),
                       [&] { return present() || closing_; });
        if (detail::store_op(op) == detail::store_op::check) {
          out.num(present() ? 1 : 0);
        } else if (present()) {
          out.num(1);
          for (auto& k : keys) out.str(data_[k]);
        } else {
          out.num(0);
          std::vector<std::string> missing, absent;
          for (auto& k : keys)
            if (!data_.count(k)) missing.push_back(k);
          for (int r = 0; r < world_; ++r)
            if (!connected_[r]) absent.push_back(std::to_string(r));
          out.strs(missing).strs(absent);
        }
        break;
      }
      default: return false;
    }
    // The reply gets a limit of its own: a get may have waited longer than io_limit for its keys.
    return detail::send_all(fd, out.bytes.data(), out.bytes.size(), detail::deadline_after(io_limit_)) ==
           detail::io_status::done;
  }

  detail::socket_fd listener_;
  std::uint16_t port_ = 0;
  int world_;
  seconds linger_, io_limit_;
  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
  std::vector<bool> connected_;  // ranks that have said hello
  std::list<client> clients_;    // stable addresses for the threads
  int active_ = 0;  // connected clients that said hello as a rank
  bool stopping_ = false;  // no more clients
  bool closing_ = false;   // the server ends
  std::thread acceptor_;
};

// A client of the store at host:port, as rank `rank` of `world_size`. Rank 0 may
// host the store itself (host = true, port 0 for a free one), which it then serves
// for as long as it lives. Connecting retries until `timeout`; every later wait is
// bounded by it too (an infinite one: no bound), and a timeout names the key and
// the ranks that never connected. Keys and values are byte strings. One thread uses a client at a time.
class TcpStore {
 public:
  TcpStore(std::string host, std::uint16_t port, int rank, int world_size, bool hosts, seconds timeout)
      : host_(std::move(host)), rank_(rank), size_(world_size), timeout_(timeout) {
    require<comm_error>(world_size >= 1 && rank >= 0 && rank < world_size, "TcpStore: rank ", rank,
                        " is not a rank of a world of ", world_size);
    require<comm_error>(timeout.count() > 0, "TcpStore: the timeout must be positive, got ", timeout.count(), " s");
    if (hosts) {
      server_ = std::make_unique<store_server>(port, world_size, seconds(30), cat("rank ", rank, ": serving the store"));
      port = server_->port();
    }
    port_ = port;
    conn_ = detail::connect_to(host_, port_, deadline(), cat("rank ", rank, ": the store"));
    detail::wire hello;
    hello.num(rank);
    const std::int64_t world = call(detail::store_op::hello, hello, "joining");
    require<comm_error>(world == world_size, "rank ", rank, ": the store at ", address(), " serves a world of ", world,
                        " ranks, this rank was told ", world_size);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::uint16_t port() const { return port_; }
  std::string address() const { return cat(host_, ":", port_); }
  seconds timeout() const { return timeout_; }
  // This host's address on the way to the store (where peers on other hosts can
  // reach it, unless it is a loopback address), and the store's host as this rank
  // reaches it.
  std::string local_address() const { return detail::address_of(conn_, ::getsockname); }
  std::string store_host_address() const { return detail::address_of(conn_, ::getpeername); }

  void set(const std::string& key, std::string_view value) {
    require<comm_error>(std::int64_t(std::max(key.size(), value.size())) <= detail::longest_store_string, "rank ",
                        rank_, ": setting '", key.substr(0, 100), "' in the store: keys and values may have up to ",
                        detail::longest_store_string, " bytes, got ", std::max(key.size(), value.size()));
    detail::wire w;
    w.str(key).str(value);
    call(detail::store_op::set, w, cat("setting '", key, "'"));
  }

  // Waits until the key exists, at most the store's timeout.
  std::string get(const std::string& key) { return get(std::vector<std::string>{key})[0]; }
  std::vector<std::string> get(const std::vector<std::string>& keys) {
    detail::wire w;
    w.strs(keys).num(std::chrono::duration_cast<std::chrono::milliseconds>(detail::wait_of(timeout_)).count());
    struct reply {
      bool found;
      std::vector<std::string> values, missing, absent;
    };
    const auto r = call(detail::store_op::get, w, cat("waiting for ", describe(keys)), [&](detail::reader& in) {
      reply r{in.num() == 1, {}, {}, {}};
      if (r.found)
        for (std::size_t i = 0; i < keys.size(); ++i) r.values.push_back(in.str());
      else
        r.missing = in.strs(), r.absent = in.strs();
      return r;
    });
    if (r.found) return r.values;
    throw comm_error(cat("rank ", rank_, ": the store at ", address(), " has no ", describe(r.missing), " after ",
                         timeout_.count(), " s",
                         r.absent.empty() ? std::string(" (every rank has connected)")
                                          : cat(" (ranks that never connected: ", join(r.absent), ")")));
  }
  void wait(const std::vector<std::string>& keys) { get(keys); }

  // Whether every key exists now.
  bool check(const std::vector<std::string>& keys) {
    detail::wire w;
    w.strs(keys);
    return call(detail::store_op::check, w, "checking keys") == 1;
  }

  // Adds delta to the counter at key (0 when it does not exist) and returns the sum.
  std::int64_t add(const std::string& key, std::int64_t delta) {
    detail::wire w;
    w.str(key).num(delta);
    return call(detail::store_op::add, w, cat("adding to '", key, "'"));
  }

  // Every rank waits until every rank has arrived; the error names those that did not.
  void barrier() {
    const std::string prefix = cat("barrier/", barriers_++, "/");
    set(prefix + std::to_string(rank_), "");
    std::vector<std::string> keys;
    for (int r = 0; r < size_; ++r) keys.push_back(prefix + std::to_string(r));
    try {
      wait(keys);
    } catch (const comm_error& e) {
      std::vector<std::string> late;
      for (int r = 0; r < size_; ++r)
        if (!check({keys[r]})) late.push_back(std::to_string(r));
      throw comm_error(cat("rank ", rank_, ": store barrier ", barriers_ - 1, " at ", address(),
                           ": ranks that never arrived within ", timeout_.count(), " s: ", join(late), " (", e.what(),
                           ")"));
    }
  }

  // A key prefix no earlier call on this client returned: ranks that ask in the
  // same order get the same prefixes, so each meeting has its own keys.
  std::string fresh_prefix(std::string_view what) { return cat(what, "/", prefixes_++, "/"); }

 private:
  detail::tcp_clock::time_point deadline() const {
    return detail::deadline_after(timeout_);
  }

  static std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  }
  static std::string describe(const std::vector<std::string>& keys) {
    if (keys.size() == 1) return cat("key '", keys[0], "'");
    std::string s;
    for (auto& k : keys) s += (s.empty() ? "'" : ", '") + k + "'";
    return cat("keys ", s);
  }

  // Sends one request and parses the reply with parse(reader&); the server's own
  // wait fits inside this deadline. A lost store is an error naming its address, and
  // the connection is closed: a reply arriving after the deadline would otherwise be
  // read as the next call's.
  template <class Parse>
  std::invoke_result_t<Parse, detail::reader&> call(detail::store_op op, const detail::wire& body,
                                                    std::string_view doing, Parse parse) {
    require<comm_error>(bool(conn_), "rank ", rank_, ": ", doing, ": the connection to the store at ", address(),
                        " was lost in an earlier call");
    const auto limit = deadline() + std::chrono::seconds(10);
    std::string message(1, char(op));
    message += body.bytes;
    detail::reader in{conn_.get(), limit};
    in.ok = detail::send_all(conn_.get(), message.data(), message.size(), limit) == detail::io_status::done;
    auto result = parse(in);
    if (!in.ok) {
      conn_.reset();
      throw comm_error(cat("rank ", rank_, ": ", doing, ": the store at ", address(),
                           " does not answer (rank 0, which serves it, exited or failed)"));
    }
    return result;
  }
  std::int64_t call(detail::store_op op, const detail::wire& body, std::string_view doing) {
    return call(op, body, doing, [](detail::reader& in) { return in.num(); });
  }

  std::string host_;
  std::uint16_t port_ = 0;
  int rank_, size_;
  seconds timeout_;
  std::unique_ptr<store_server> server_;  // rank 0 only; outlives conn_ (members end in reverse order)
  detail::socket_fd conn_;
  std::uint64_t barriers_ = 0, prefixes_ = 0;
};

}  // namespace shardlib::comm
