// tests/emulated/include/nccl.h — stands in for NCCL's header in the emulated tests:
// communicators whose ranks are threads of this process, over the emulated device's
// memory (host memory), with the calls the library makes (comm/nccl_state.hpp,
// comm/nccl_comm.hpp).
//
// Initialisation: ranks meet by id; a non-blocking communicator answers ncclInProgress
// (here and from ncclCommGetAsyncError) until every rank of the id has joined, so an
// initialisation a rank never joins stays in progress, as NCCL's does. A collective
// returns once every rank of the communicator has made it (the emulated streams run
// everything at issue); on a non-blocking communicator, a rank that is not the last to
// arrive gets ncclInProgress, and ncclCommGetAsyncError says ncclInProgress until the
// last has come (NCCL answers so while it connects: the caller must poll before its
// next call). A non-blocking ncclCommSplit answers ncclSuccess at once with the new
// communicator still null, and completes (writing it) at a later ncclCommGetAsyncError
// once every rank has made it, as NCCL 2.28 does (its split runs in a job of its own). The last rank to arrive computes it for all, reductions in rank
// order (16-bit floats rounded after each step, as a ring's partial sums are; integers
// exact and wrapping). Ranks whose calls disagree (kind, count, type, operation, root)
// all get ncclInvalidUsage, named by ncclGetLastError, where NCCL would hang or corrupt.
// A rank that aborts wakes its peers with ncclRemoteError; a peer that never comes makes
// the others give up after two minutes (ncclSystemError, and the communicator is aborted)
// rather than hang the test run, in a collective or a blocking initialisation.
// Communicators and streams belong to devices: two ranks of one communicator on one
// device are refused once every rank has joined (NCCL's "Duplicate GPU detected":
// ncclInvalidUsage on every rank), and a collective on a
// stream of another device than its communicator's, or on another device's memory, fails.
//
// With SHARDLIB_EMULATED_NCCL_DIR set, the communicators a process initialises meet
// through files in that folder instead (../nccl_files.hpp), so that their ranks may be
// processes: the same calls, checks and results.
#pragma once
#include <unistd.h>  // getpid

#include "cuda_runtime.h"

#include <shardlib/core/element.hpp>  // the 16-bit conversions

#include <algorithm>           // std::sort
#include <chrono>              // std::chrono
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // std::size_t
#include <cstdint>             // std::int8_t ... std::uint64_t
#include <cstring>             // std::memcpy, std::memcmp
#include <map>                 // std::map
#include <memory>              // std::shared_ptr, std::make_shared
#include <mutex>               // std::mutex, std::unique_lock
#include <optional>            // std::optional
#include <string>              // std::string
#include <tuple>               // std::tuple
#include <type_traits>         // std::is_integral_v, std::make_unsigned_t
#include <utility>             // std::move
#include <vector>              // std::vector

enum ncclResult_t {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};
enum ncclDataType_t {
  ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
  ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9,
  ncclChar = ncclInt8, ncclInt = ncclInt32, ncclHalf = ncclFloat16, ncclFloat = ncclFloat32, ncclDouble = ncclFloat64,
};
enum ncclRedOp_t { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };

struct ncclUniqueId {
  char internal[128];
};
struct ncclConfig_t {
  int blocking;
};
// A macro in NCCL's header too.
#define NCCL_CONFIG_INITIALIZER {1}
#define NCCL_SPLIT_NOCOLOR (-1)

struct ncclComm;
using ncclComm_t = ncclComm*;

namespace nccl_emulator {

enum class kind { all_reduce, reduce_scatter, all_gather, broadcast, split };

// One rank's call of the collective in progress.
struct call {
  kind what{};
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  ncclDataType_t type{};
  ncclRedOp_t op{};
  int root = 0, color = 0, key = 0;
  ncclComm_t* child = nullptr;  // split
  int device = 0;               // split: the calling rank's communicator's device, its child's
  bool blocking = true;         // split: the calling rank's communicator's, its child's
  bool operator==(const call& o) const {
    return std::tuple(what, count, type, op, root) == std::tuple(o.what, o.count, o.type, o.op, o.root);
  }
};

// What the ranks of one communicator share.
struct group {
  explicit group(int n) : size(n), calls(std::size_t(n)) {}
  const int size;
  std::mutex m;
  std::condition_variable cv;
  int joined = 0;
  std::vector<bool> taken = std::vector<bool>(std::size_t(size));
  std::vector<int> devices = std::vector<int>(std::size_t(size), -1);  // each joined rank's
  std::vector<call> calls;
  int arrived = 0;
  std::uint64_t generation = 0;  // collectives completed
  ncclResult_t outcome = ncclSuccess;  // of the last one
  std::string why;
  bool aborted = false;
  std::string duplicate;  // set when every rank has joined and two share a device
  bool deferred = false;  // a non-blocking split every rank has made, completed at the next poll
};

inline constexpr auto peer_patience = std::chrono::minutes(2);

inline std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
inline std::map<std::string, std::shared_ptr<group>>& registry() {
  static std::map<std::string, std::shared_ptr<group>> r;
  return r;
}
inline std::string& last_error_without_comm() {
  thread_local std::string s;
  return s;
}
// For tests: the next this many ncclGetUniqueId calls fail, as NCCL's does on a node
// where it finds no network interface to bootstrap over.
inline int& unique_id_failures() {
  static int n = 0;
  return n;
}

inline std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  }
  return 0;
}

// The 16-bit floats, reduced in float and rounded back after every step, as a ring's
// partial sums are (the library's conversions: to nearest even, NaN as CUDA's).
struct bf16_bits {
  std::uint16_t bits;
  static float wide(bf16_bits x) { return shardlib::detail::bf16_bits_to_float(x.bits); }
  static bf16_bits narrow(float f) { return {shardlib::detail::float_to_bf16_bits(f)}; }
};
struct f16_bits {
  std::uint16_t bits;
  static float wide(f16_bits x) { return shardlib::detail::half_bits_to_float(x.bits); }
  static f16_bits narrow(float f) { return {shardlib::detail::float_to_half_bits(f)}; }
};
template <class T>
T combine(T a, T b, ncclRedOp_t op) {
  if constexpr (requires { T::wide(a); }) {
    return T::narrow(float(combine(T::wide(a), T::wide(b), op)));
  } else if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;  // sums and products wrap, as NCCL's do
    switch (op) {
      case ncclSum: case ncclAvg: return T(U(a) + U(b));
      case ncclProd: return T(U(a) * U(b));
      case ncclMax: return b > a ? b : a;
      case ncclMin: return b < a ? b : a;
    }
  } else {
    switch (op) {
      case ncclSum: case ncclAvg: return a + b;
      case ncclProd: return a * b;
      case ncclMax: return b > a || b != b ? b : a;
      case ncclMin: return b < a || b != b ? b : a;
    }
  }
  return a;
}
template <class T>
T divided(T x, int n) {
  if constexpr (requires { T::wide(x); }) return T::narrow(T::wide(x) / float(n));
  else return T(x / T(n));
}

// Elements [0, n) of every rank's send buffer reduced in rank order into `out`.
template <class T>
void reduce(const std::vector<call>& calls, std::size_t n, unsigned char* out) {
  const ncclRedOp_t op = calls[0].op;
  for (std::size_t i = 0; i < n; ++i) {
    T acc;
    std::memcpy(&acc, static_cast<const unsigned char*>(calls[0].send) + i * sizeof(T), sizeof(T));
    for (std::size_t r = 1; r < calls.size(); ++r) {
      T x;
      std::memcpy(&x, static_cast<const unsigned char*>(calls[r].send) + i * sizeof(T), sizeof(T));
      acc = combine(acc, x, op);
    }
    if (op == ncclAvg) acc = divided(acc, int(calls.size()));
    std::memcpy(out + i * sizeof(T), &acc, sizeof(T));
  }
}
inline void reduce(const std::vector<call>& calls, std::size_t n, unsigned char* out) {
  switch (calls[0].type) {
    case ncclInt8: return reduce<std::int8_t>(calls, n, out);
    case ncclUint8: return reduce<std::uint8_t>(calls, n, out);
    case ncclInt32: return reduce<std::int32_t>(calls, n, out);
    case ncclUint32: return reduce<std::uint32_t>(calls, n, out);
    case ncclInt64: return reduce<std::int64_t>(calls, n, out);
    case ncclUint64: return reduce<std::uint64_t>(calls, n, out);
    case ncclFloat16: return reduce<f16_bits>(calls, n, out);
    case ncclBfloat16: return reduce<bf16_bits>(calls, n, out);
    case ncclFloat32: return reduce<float>(calls, n, out);
    case ncclFloat64: return reduce<double>(calls, n, out);
  }
}

inline std::string describe(kind k) {
  switch (k) {
    case kind::all_reduce: return "ncclAllReduce";
    case kind::reduce_scatter: return "ncclReduceScatter";
    case kind::all_gather: return "ncclAllGather";
    case kind::broadcast: return "ncclBroadcast";
    case kind::split: return "ncclCommSplit";
  }
  return "?";
}
// "ncclReduceScatter(count 4 of type 7, op 4, root 0)"; count as the caller passed it.
inline std::string describe(const call& c, int ranks) {
  const std::size_t count = c.what == kind::reduce_scatter ? c.count / std::size_t(ranks) : c.count;
  return describe(c.what) + "(count " + std::to_string(count) + " of type " + std::to_string(int(c.type)) + ", op " +
         std::to_string(int(c.op)) + ", root " + std::to_string(c.root) + ")";
}

}  // namespace nccl_emulator

namespace nccl_emulator {
struct file_exchange;  // nccl_files.hpp
}

struct ncclComm {
  ncclComm(std::shared_ptr<nccl_emulator::group> group, int r, int n, int d, bool b)
      : g(std::move(group)), rank(r), size(n), device(d), blocking(b) {}
  std::shared_ptr<nccl_emulator::group> g;              // ranks that are threads of this process
  std::shared_ptr<nccl_emulator::file_exchange> files;  // or ranks that meet through files
  int rank = 0, size = 0;
  int device = 0;    // the device current at initialisation: its collectives run there
  std::string last;  // ncclGetLastError
  bool blocking = true;
  // A collective this rank has made and the others have not all made yet (non-blocking).
  std::optional<std::uint64_t> waiting_for;
  std::chrono::steady_clock::time_point waiting_since{};
};

namespace nccl_emulator {

inline ncclResult_t fail(ncclComm_t c, ncclResult_t r, std::string why) {
  (c ? c->last : last_error_without_comm()) = std::move(why);
  return r;
}

// The outputs of one collective (not a split) from every rank's call, made and written for
// the calls that have a receive buffer (a rank that meets the others through files has
// only its own). Outputs are computed whole before any is written: in-place calls read
// what others write.
inline void compute(const std::vector<call>& c) {
  const call& first = c[0];
  const std::size_t n = first.count, ranks = c.size(), bytes = n * type_size(first.type);
  std::vector<std::vector<unsigned char>> out(ranks);
  switch (first.what) {
    case kind::all_reduce:
    case kind::reduce_scatter: {
      const std::size_t chunk = first.what == kind::all_reduce ? n : n / ranks;  // count: the send size
      std::vector<unsigned char> whole(bytes);
      reduce(c, n, whole.data());
      for (std::size_t r = 0; r < ranks; ++r) {
        if (!c[r].recv) continue;
        const std::size_t from = first.what == kind::all_reduce ? 0 : r * chunk;
        out[r].assign(whole.begin() + std::ptrdiff_t(from * type_size(first.type)),
                      whole.begin() + std::ptrdiff_t((from + chunk) * type_size(first.type)));
      }
      break;
    }
    case kind::all_gather:
      for (std::size_t r = 0; r < ranks; ++r)
        for (std::size_t k = 0; k < ranks && c[r].recv; ++k) {
          const auto* s = static_cast<const unsigned char*>(c[k].send);
          out[r].insert(out[r].end(), s, s + bytes);
        }
      break;
    case kind::broadcast: {
      const auto* s = static_cast<const unsigned char*>(c[std::size_t(first.root)].send);
      for (std::size_t r = 0; r < ranks; ++r)
        if (c[r].recv) out[r].assign(s, s + bytes);
      break;
    }
    case kind::split:
      break;
  }
  for (std::size_t r = 0; r < ranks; ++r)
    if (!out[r].empty()) std::memcpy(c[r].recv, out[r].data(), out[r].size());
}

// Every rank's call of one collective, computed by the last to arrive.
inline void perform(group& g) {
  const std::vector<call>& c = g.calls;
  const std::size_t ranks = std::size_t(g.size);
  switch (c[0].what) {
    case kind::split: {
      std::map<int, std::vector<std::pair<int, int>>> colors;  // color -> (key, rank)
      for (std::size_t r = 0; r < ranks; ++r)
        if (c[r].color != NCCL_SPLIT_NOCOLOR) colors[c[r].color].push_back({c[r].key, int(r)});
        else *c[r].child = nullptr;
      for (auto& [color, members] : colors) {
        std::sort(members.begin(), members.end());
        auto child = std::make_shared<group>(int(members.size()));
        child->joined = child->size;
        for (std::size_t i = 0; i < members.size(); ++i) {
          const call& parent = c[std::size_t(members[i].second)];
          *parent.child = new ncclComm(child, int(i), child->size, parent.device, parent.blocking);
        }
      }
      return;
    }
    default:
      compute(c);
  }
}

// The collective every rank has made: checks that the calls agree, computes it, wakes the ranks.
inline void complete(group& g) {
  g.outcome = ncclSuccess;
  for (int r = 1; r < g.size; ++r)
    if (!(g.calls[std::size_t(r)] == g.calls[0])) {
      g.outcome = ncclInvalidUsage;
      g.why = "rank " + std::to_string(r) + " called " + describe(g.calls[std::size_t(r)], g.size) +
              " while rank 0 called " + describe(g.calls[0], g.size);
    }
  if (g.outcome == ncclSuccess) perform(g);
  g.arrived = 0;
  ++g.generation;
  g.cv.notify_all();
}

inline ncclResult_t collective_files(ncclComm_t comm, call mine);  // nccl_files.hpp

// Rank c->rank's part in a collective: waits for the others; the last computes it.
inline ncclResult_t collective(ncclComm_t comm, call mine) {
  if (!comm) return fail(comm, ncclInvalidArgument, "a null communicator");
  if (comm->files) return collective_files(comm, mine);
  group& g = *comm->g;
  std::unique_lock lock(g.m);
  if (g.aborted) return fail(comm, ncclRemoteError, "a rank of this communicator aborted it: " + g.why);
  const bool job = mine.what == kind::split && !comm->blocking;  // completed by a later poll
  if (job) *mine.child = nullptr;
  g.calls[std::size_t(comm->rank)] = mine;
  const std::uint64_t generation = g.generation;
  const bool last = ++g.arrived == g.size;
  if (last && !job) {
    complete(g);
  } else if (!comm->blocking) {
    comm->waiting_for = generation;
    comm->waiting_since = std::chrono::steady_clock::now();
    if (last) g.deferred = true;
    return job ? ncclSuccess : ncclInProgress;
  } else if (!g.cv.wait_for(lock, peer_patience, [&] { return g.generation != generation || g.aborted; })) {
    // The call stays counted with this rank's buffers: the group is unusable from here.
    g.aborted = true;
    g.why = "rank " + std::to_string(comm->rank) + " gave up waiting in " + describe(mine.what);
    g.cv.notify_all();
    return fail(comm, ncclSystemError, describe(mine.what) + ": not every rank made the call within two minutes");
  }
  if (g.generation == generation) return fail(comm, ncclRemoteError, "a rank aborted the communicator: " + g.why);
  return g.outcome == ncclSuccess ? ncclSuccess : fail(comm, g.outcome, g.why);
}

inline bool valid(ncclDataType_t t) { return type_size(t) != 0; }

}  // namespace nccl_emulator

#include "../nccl_files.hpp"

inline const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}
inline const char* ncclGetLastError(ncclComm_t comm) {
  return (comm ? comm->last : nccl_emulator::last_error_without_comm()).c_str();
}

inline ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static std::mutex m;
  static std::uint64_t next = 0;
  const std::lock_guard lock(m);
  *id = {};
  if (int& failures = nccl_emulator::unique_id_failures(); failures > 0) {
    --failures;
    return nccl_emulator::fail(nullptr, ncclSystemError, "Bootstrap : no socket interface found");
  }
  const std::string name = "emulated-nccl-" + std::to_string(getpid()) + "-" + std::to_string(next++);
  std::memcpy(id->internal, name.data(), name.size());
  return ncclSuccess;
}

inline ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                           ncclConfig_t* config) {
  using namespace nccl_emulator;
  *comm = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(nullptr, ncclInvalidArgument, "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  const int device = cuda_emulator::current_device();
  const bool blocking = !config || config->blocking != 0;
  if (!files_root().empty()) return init_files(comm, nranks, id.internal, rank, device, blocking);
  std::shared_ptr<group> g;
  {
    const std::lock_guard lock(registry_mutex());
    auto& slot = registry()[std::string(id.internal, sizeof id.internal)];
    if (!slot) slot = std::make_shared<group>(nranks);
    g = slot;
  }
  std::unique_lock lock(g->m);
  if (g->size != nranks || g->taken[std::size_t(rank)])
    return fail(nullptr, ncclInvalidUsage, "rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                                               " joins an id already used by another communicator or rank");
  g->taken[std::size_t(rank)] = true;
  g->devices[std::size_t(rank)] = device;
  ++g->joined;
  if (g->joined == g->size)  // NCCL compares the ranks' devices once it knows them all
    for (int a = 0; a < nranks && g->duplicate.empty(); ++a)
      for (int b = a + 1; b < nranks && g->duplicate.empty(); ++b)
        if (g->devices[std::size_t(a)] == g->devices[std::size_t(b)])
          g->duplicate = "Duplicate GPU detected: ranks " + std::to_string(a) + " and " + std::to_string(b) +
                         " both on device " + std::to_string(g->devices[std::size_t(a)]);
  g->cv.notify_all();
  *comm = new ncclComm(g, rank, nranks, device, blocking);
  if (!blocking) return ncclInProgress;  // ncclCommGetAsyncError says how it ends
  if (!g->cv.wait_for(lock, peer_patience, [&] { return g->joined == g->size || g->aborted; }) || g->aborted)
    return fail(*comm, ncclSystemError, "not every rank joined within two minutes, or one aborted");
  if (!g->duplicate.empty()) return fail(*comm, ncclInvalidUsage, g->duplicate);
  return ncclSuccess;
}
// An initialisation in progress until every rank has joined; then, as NCCL's, it fails on
// every rank when two share a device. A collective in progress until every rank has made
// it, then its outcome; a peer that never comes makes it give up after two minutes.
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  if (!comm) return ncclInvalidArgument;
  if (comm->files) {
    *state = nccl_emulator::state_files(comm);
    return ncclSuccess;
  }
  const std::lock_guard lock(comm->g->m);
  nccl_emulator::group& g = *comm->g;
  if (g.deferred && !g.aborted) {
    g.deferred = false;
    nccl_emulator::complete(g);
  }
  if (g.aborted) *state = ncclRemoteError;
  else if (g.joined < g.size) *state = ncclInProgress;
  else if (!g.duplicate.empty()) *state = nccl_emulator::fail(comm, ncclInvalidUsage, g.duplicate);
  else if (!comm->waiting_for) *state = ncclSuccess;
  else if (g.generation != *comm->waiting_for) {  // the last rank came: this rank's outcome is the group's
    comm->waiting_for.reset();
    *state = g.outcome == ncclSuccess ? ncclSuccess : nccl_emulator::fail(comm, g.outcome, g.why);
  } else if (std::chrono::steady_clock::now() - comm->waiting_since > nccl_emulator::peer_patience) {
    g.aborted = true;
    g.why = "rank " + std::to_string(comm->rank) + " gave up waiting in a collective";
    g.cv.notify_all();
    *state = nccl_emulator::fail(comm, ncclSystemError, "not every rank made the collective within two minutes");
  } else {
    *state = ncclInProgress;
  }
  return ncclSuccess;
}
inline ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
  if (!comm) return ncclInvalidArgument;
  *count = comm->size;
  return ncclSuccess;
}
inline ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
  if (!comm) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}
inline ncclResult_t ncclCommFinalize(ncclComm_t comm) { return comm ? ncclSuccess : ncclInvalidArgument; }
inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}
inline ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (comm->files) {
    nccl_emulator::abort_files(*comm->files, "rank " + std::to_string(comm->rank) + " called ncclCommAbort");
  } else {
    const std::lock_guard lock(comm->g->m);
    comm->g->aborted = true;
    comm->g->why = "rank " + std::to_string(comm->rank) + " called ncclCommAbort";
    comm->g->cv.notify_all();
  }
  delete comm;
  return ncclSuccess;
}
inline ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t*) {
  if (!comm) return nccl_emulator::fail(comm, ncclInvalidArgument, "a null communicator");
  return nccl_emulator::collective(comm, {.what = nccl_emulator::kind::split, .color = color, .key = key,
                                          .child = newcomm, .device = comm->device, .blocking = comm->blocking});
}

namespace nccl_emulator {
// NCCL launches its kernels on the communicator's device, into the caller's stream: a
// stream of another device fails that launch (CUDA's invalid resource handle), and a
// buffer in another device's memory faults.
inline ncclResult_t wrong_device(ncclComm_t comm, cudaStream_t stream, const void* send, const void* recv) {
  if (!comm) return ncclSuccess;
  const auto other = [&](int device, const char* what) {
    return fail(comm, ncclUnhandledCudaError, std::string(what) + " of device " + std::to_string(device) +
                                                  " for a communicator of device " + std::to_string(comm->device));
  };
  if (cuda_emulator::device_of(stream) != comm->device) return other(cuda_emulator::device_of(stream), "a stream");
  for (const void* p : {send, recv})
    if (const int d = p ? cuda_emulator::memory_device(p) : -1; d >= 0 && d != comm->device) return other(d, "a buffer");
  return ncclSuccess;
}
}  // namespace nccl_emulator

inline ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (const ncclResult_t r = nccl_emulator::wrong_device(comm, stream, send, recv)) return r;
  if (!nccl_emulator::valid(type)) return nccl_emulator::fail(comm, ncclInvalidArgument, "an unknown data type");
  return nccl_emulator::collective(comm, {.what = nccl_emulator::kind::all_reduce, .send = send, .recv = recv,
                                          .count = count, .type = type, .op = op});
}
// count: elements each rank receives; the reduction runs over the send buffers' count * ranks.
inline ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t count, ncclDataType_t type,
                                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (const ncclResult_t r = nccl_emulator::wrong_device(comm, stream, send, recv)) return r;
  if (!nccl_emulator::valid(type) || !comm)
    return nccl_emulator::fail(comm, ncclInvalidArgument, "an unknown data type or a null communicator");
  return nccl_emulator::collective(comm, {.what = nccl_emulator::kind::reduce_scatter, .send = send, .recv = recv,
                                          .count = count * std::size_t(comm->size), .type = type, .op = op});
}
inline ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t count, ncclDataType_t type,
                                  ncclComm_t comm, cudaStream_t stream) {
  if (const ncclResult_t r = nccl_emulator::wrong_device(comm, stream, send, recv)) return r;
  if (!nccl_emulator::valid(type)) return nccl_emulator::fail(comm, ncclInvalidArgument, "an unknown data type");
  return nccl_emulator::collective(comm, {.what = nccl_emulator::kind::all_gather, .send = send, .recv = recv,
                                          .count = count, .type = type});
}
inline ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type, int root,
                                  ncclComm_t comm, cudaStream_t stream) {
  if (const ncclResult_t r = nccl_emulator::wrong_device(comm, stream, send, recv)) return r;
  if (!nccl_emulator::valid(type) || !comm || root < 0 || root >= comm->size)
    return nccl_emulator::fail(comm, ncclInvalidArgument, "an unknown data type, a null communicator or a bad root");
  return nccl_emulator::collective(comm, {.what = nccl_emulator::kind::broadcast, .send = send, .recv = recv,
                                          .count = count, .type = type, .root = root});
}
