// shardlib/io/rank_agreement.hpp — how checkpoint operations fail together: on_all_ranks
// runs a step on every rank and raises io_error on all of them if any failed.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"  // reduce_op
#include "shardlib/core/error.hpp"         // io_error, cat

#include <cstddef>      // std::size_t
#include <cstdint>      // std::int64_t
#include <cstring>      // std::memcpy
#include <exception>    // std::exception
#include <span>         // std::span
#include <string>       // std::string
#include <string_view>  // std::string_view
#include <vector>       // std::vector

namespace shardlib::io {

namespace detail {

// Comm is io's view of a communicator (host_collectives, io/staging.hpp): integers only,
// so the bytes travel packed eight to a word.
template <class Comm>
std::string broadcast_string(Comm& comm, const std::string& s, int root) {
  std::vector<std::int64_t> n{std::int64_t(s.size())};
  comm.broadcast(std::span<std::int64_t>(n), root);
  std::vector<std::int64_t> words((static_cast<std::size_t>(n[0]) + 7) / 8);
  if (comm.rank() == root && !s.empty()) std::memcpy(words.data(), s.data(), s.size());
  if (!words.empty()) comm.broadcast(std::span<std::int64_t>(words), root);
  return std::string(reinterpret_cast<const char*>(words.data()), static_cast<std::size_t>(n[0]));
}

// Runs f on every rank, then agrees (one all-reduce) on whether all succeeded: if any
// rank failed, every rank raises io_error — the failing ones with their own message,
// the others with the message of the lowest failing rank — so none is left waiting.
template <class Comm, class F>
void on_all_ranks(Comm& comm, std::string_view what, F&& f) {
  std::string message;
  bool failed = false;
  try {
    f();
  } catch (const std::exception& e) {
    failed = true;
    message = e.what();
  } catch (...) {
    failed = true;
    message = "an exception not derived from std::exception";
  }
  std::vector<std::int64_t> flag{failed ? std::int64_t(comm.size() - comm.rank()) : 0};
  comm.all_reduce(std::span<std::int64_t>(flag), shardlib::comm::reduce_op::max);
  if (flag[0] == 0) return;
  const int first = comm.size() - int(flag[0]);
  const std::string first_message = broadcast_string(comm, message, first);
  if (failed) throw io_error(cat("rank ", comm.rank(), ": ", what, ": ", message));
  throw io_error(cat("rank ", comm.rank(), ": ", what, ": stopped because rank ", first, " failed: ", first_message));
}

}  // namespace detail

}  // namespace shardlib::io
