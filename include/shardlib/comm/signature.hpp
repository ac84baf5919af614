// shardlib/comm/signature.hpp — what a rank says it is calling, so that ranks can
// check they agree about a collective before running it (shared by every backend).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"

#include <cstddef>      // std::size_t
#include <exception>    // std::exception_ptr
#include <string>       // std::string
#include <string_view>  // std::string_view

namespace shardlib::comm::detail {

enum class op_kind : int { barrier, all_gather, reduce_scatter, all_reduce, broadcast, split };

inline std::string_view name(op_kind k) {
  constexpr std::string_view names[] = {"barrier", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "split"};
  return names[int(k)];
}

// All ranks must post the same signature for the same collective.
struct signature {
  op_kind kind = op_kind::barrier;
  dtype type = dtype::u8;
  std::size_t count = 0;  // elements per rank (send count of all_gather, recv count of reduce_scatter)
  reduce_op op = reduce_op::sum;
  int root = 0;
  bool operator==(const signature&) const = default;
};

inline std::string describe(const signature& s) {
  std::string d = cat(name(s.kind));
  if (s.kind == op_kind::barrier || s.kind == op_kind::split) return d;
  d += cat("(", s.count, " x ", name(s.type));
  if (s.kind == op_kind::reduce_scatter || s.kind == op_kind::all_reduce) d += cat(", ", name(s.op));
  if (s.kind == op_kind::broadcast) d += cat(", root ", s.root);
  return d + ")";
}

// "rank r": how the messages below name a rank, unless the backend names processes
// otherwise (MpiComm adds the rank in MPI_COMM_WORLD).
inline std::string plain_rank(int r) { return cat("rank ", r); }

// The error every rank raises when rank `other` posted `theirs` where rank 0 posted `first`.
template <class Name = std::string (*)(int)>
comm_error disagreement(int rank, const signature& first, int other, const signature& theirs,
                        Name name = plain_rank) {
  return comm_error(cat(name(rank), ": ranks disagree about a collective: ", name(0), " called ", describe(first), ", ",
                        name(other), " called ", describe(theirs)));
}

// What a rank's checks of its own arguments threw, or null. A rank whose call is
// invalid still posts it (marked invalid) to the agreement, so that every rank
// raises at once and the ranks' next calls pair up as before.
template <class Validate>
std::exception_ptr invalid_call(Validate&& validate) {
  try {
    validate();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

inline std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// The error every other rank raises when rank `other` posted `theirs` marked invalid;
// `why` is its error, where the backend carries it.
template <class Name = std::string (*)(int)>
comm_aborted invalid_elsewhere(int rank, const signature& mine, int other, const signature& theirs,
                               std::string_view why = {}, Name name = plain_rank) {
  return comm_aborted(cat(name(rank), ": ", describe(mine), " abandoned: ", name(other), " passed invalid arguments to ",
                          describe(theirs), why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
}

}  // namespace shardlib::comm::detail
