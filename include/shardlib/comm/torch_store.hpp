// shardlib/comm/torch_store.hpp — torch_store: a client of PyTorch's TCPStore, as far
// as the library needs one. torchrun's agent serves such a store at MASTER_ADDR:MASTER_PORT
// for its workers (it sets TORCHELASTIC_USE_AGENT_STORE=True), so the library's own
// store cannot listen there; rank 0 announces where it does through this client.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/tcp.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>    // std::max, std::min
#include <chrono>       // std::chrono::duration
#include <cstdint>      // std::uint8_t, std::uint32_t, std::uint64_t
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <utility>      // std::move

namespace shardlib::comm {

// c10d's wire format (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, the same for its
// libuv server): a request is one byte of query type and its arguments, a string or a
// byte vector a uint64 length and the bytes, numbers in the host's byte order (both
// ends are one machine's kind). A new connection's first request must be a validation,
// with a 32-bit magic number; it has no reply. set has no reply either; wait replies one
// byte once every key exists; get replies a byte vector (empty for a missing key). Keys
// go as given: PyTorch's Python client puts a '/' before each.
class torch_store {
 public:
  // Connects (retrying until `timeout`, like the agent's own workers) and validates.
  // `who` opens every error message ("rank 3"). Every operation ends within `timeout`;
  // connecting and waiting for a key end by `by` too (a join that waits more than once
  // under one deadline passes it; a read the store answers at once is no wait).
  torch_store(std::string host, std::uint16_t port, std::chrono::duration<double> timeout, std::string who,
              detail::tcp_clock::time_point by = detail::tcp_clock::time_point::max())
      : host_(std::move(host)), port_(port), timeout_(timeout), by_(by), who_(std::move(who)) {
    conn_ = detail::connect_to(host_, port_, deadline(), cat(who_, ": torchrun's store"));
    std::string request(1, char(query::validate));
    append(request, validation_magic);
    send(request, "validating the connection");
  }

  void set(std::string_view key, std::string_view value) {
    std::string request(1, char(query::set));
    append_string(request, key);
    append_string(request, value);
    send(request, cat("setting '", key, "'"));
  }

  // Waits until the key exists, at most the timeout, then reads it. A wait that times
  // out leaves the server waiting for this connection: it is closed.
  std::string get(std::string_view key) {
    wait(key);
    return read(key);
  }

  // The key's value now (empty where it does not exist).
  std::string read(std::string_view key) {
    std::string request(1, char(query::get));
    append_string(request, key);
    send(request, cat("reading '", key, "'"));
    std::uint64_t size = 0;
    const auto until = detail::deadline_after(timeout_);
    check_read(detail::recv_all(conn_.get(), &size, sizeof size, until), size <= longest_value,
               cat("reading '", key, "'"));
    std::string value(size, '\0');
    check_read(detail::recv_all(conn_.get(), value.data(), size, until), true, cat("reading '", key, "'"));
    return value;
  }

  std::string address() const { return cat(host_, ":", port_); }
  // This host's address on the way to the store, and the store's as this process reaches it.
  std::string local_address() const { return detail::address_of(conn_, ::getsockname); }
  std::string store_host_address() const { return detail::address_of(conn_, ::getpeername); }

 private:
  void wait(std::string_view key) {
    std::string request(1, char(query::wait));
    append(request, std::uint64_t(1));
    append_string(request, key);
    send(request, cat("waiting for '", key, "'"));
    std::uint8_t stop = 0xff;
    // At least a round trip's time, however little of `by` is left: the key may be there.
    const auto waited = detail::recv_all(
        conn_.get(), &stop, 1,
        std::max(deadline(), detail::deadline_after(std::min(timeout_, std::chrono::duration<double>(0.1)))));
    if (waited == detail::io_status::timed_out) {
      conn_.reset();
      throw comm_error(cat(who_, ": torchrun's store at ", address(), " has no '", key, "' within ", timeout_.count(),
                           " s"));
    }
    check_read(waited, stop == 0, cat("waiting for '", key, "'"));
  }

  enum class query : std::uint8_t { validate = 0, set = 1, get = 3, wait = 6 };
  static constexpr std::uint32_t validation_magic = 0x3C85F7CE;
  static constexpr std::uint64_t longest_value = std::uint64_t(1) << 26;  // the library's values are addresses

  template <class Number>
  static void append(std::string& to, Number n) {
    to.append(reinterpret_cast<const char*>(&n), sizeof n);
  }
  static void append_string(std::string& to, std::string_view s) {
    append(to, std::uint64_t(s.size()));
    to.append(s);
  }

  void send(const std::string& request, std::string_view doing) {
    require<comm_error>(bool(conn_), who_, ": ", doing, ": the connection to torchrun's store at ", address(),
                        " was closed after an earlier wait timed out");
    check_read(detail::send_all(conn_.get(), request.data(), request.size(), detail::deadline_after(timeout_)), true,
               doing);
  }
  // Where connecting or a wait for a key gives up.
  detail::tcp_clock::time_point deadline() const { return std::min(detail::deadline_after(timeout_), by_); }
  // A lost connection, or a reply that is not what the protocol says.
  void check_read(detail::io_status status, bool expected, std::string_view doing) {
    if (status == detail::io_status::done && expected) return;
    conn_.reset();
    throw comm_error(cat(who_, ": ", doing, ": torchrun's store at ", address(),
                         status != detail::io_status::done ? " does not answer (has torchrun's agent exited?)"
                                                          : " replied what a PyTorch TCPStore does not"));
  }

  std::string host_;
  std::uint16_t port_;
  std::chrono::duration<double> timeout_;
  detail::tcp_clock::time_point by_;
  std::string who_;
  detail::socket_fd conn_;
};

}  // namespace shardlib::comm
