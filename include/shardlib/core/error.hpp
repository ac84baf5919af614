// shardlib/core/error.hpp — the error hierarchy (shardlib::error and subclasses).
#pragma once
#include "shardlib/config.hpp"

#include <sstream>    // std::ostringstream
#include <stdexcept>  // std::runtime_error
#include <string>
#include <utility>

namespace shardlib {

// Root of every exception the library throws. Messages say what was expected
// and what was found, and name the rank, parameter or file where there is one.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A shape, size or count that does not match what the call needs.
class shape_error : public error {
 public:
  using error::error;
};

// A collective failed or ranks disagreed about one (different counts, types,
// operations or roots); raised on every rank of the group.
class comm_error : public error {
 public:
  using error::error;
};

// A rank stopped waiting because another rank of its group failed.
class comm_aborted : public comm_error {
 public:
  using comm_error::comm_error;
};

// Reading or writing a file (checkpoints, safetensors) failed or found bad data.
class io_error : public error {
 public:
  using error::error;
};

// Builds a message from any streamable pieces: cat("rank ", r, ": expected ", n).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// Throws E with the concatenated message when cond is false.
template <class E = error, class... Args>
void require(bool cond, const Args&... args) {
  if (!cond) throw E(cat(args...));
}

}  // namespace shardlib
