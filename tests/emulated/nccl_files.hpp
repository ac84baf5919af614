// tests/emulated/nccl_files.hpp — the emulated NCCL's communicators whose ranks meet
// through files, so that they may be processes (tools/launch, mpirun): chosen for every
// communicator a process initialises while SHARDLIB_EMULATED_NCCL_DIR names a folder.
//
// A communicator is the folder DIR/<id> (ids name their process: the folder must be fresh
// for each run, or a reused pid meets its old files). Each rank joins by writing
// join.<rank> (its host, device and the communicator's size); a size other than its own
// is refused at once, and once every rank's is there the ranks compare them as NCCL does
// (two ranks on one device of one host). Collective k
// of rank r is the file <k>.<r>: the call (kind, count, type, operation, root, split
// color and key) and the send buffer. Once every rank's file of k is there, each rank
// reads them all, checks that the calls agree, and computes its own output from them in
// rank order, so the ranks' results are those of the thread ranks, bit for bit. A rank
// that finds every file of k deletes its own of k - 1 (every rank has read it by then:
// each wrote its file of k after finishing k - 1). A split's children are the sibling
// folders DIR/<id>.split<k>.color<c>, their ranks ordered by key, then by parent rank.
// An abort writes the file `abort` with its reason (of ranks aborting together, one's),
// which every later call and poll of every rank reports. Files are written whole under a name of
// the writer's own and renamed, so a rank never reads a part of one.
#pragma once
#include <unistd.h>  // gethostname

#include <algorithm>     // std::sort, std::find, std::min, std::max
#include <array>         // std::array
#include <chrono>        // std::chrono
#include <cstdint>       // std::int64_t, std::uint64_t
#include <cstdlib>       // std::getenv
#include <cstring>       // std::memcpy
#include <filesystem>    // std::filesystem
#include <fstream>       // std::ifstream, std::ofstream
#include <functional>    // std::hash
#include <memory>        // std::shared_ptr, std::make_shared
#include <optional>      // std::optional
#include <sstream>       // std::istringstream
#include <string>        // std::string
#include <system_error>  // std::error_code
#include <thread>        // std::this_thread
#include <utility>       // std::pair, std::move
#include <vector>        // std::vector

namespace nccl_emulator {

// SHARDLIB_EMULATED_NCCL_DIR, or empty: the ranks are threads of this process.
inline std::string files_root() {
  const char* d = std::getenv("SHARDLIB_EMULATED_NCCL_DIR");
  return d ? d : "";
}

// One rank's side of a communicator that meets through files.
struct file_exchange {
  std::filesystem::path dir;
  int size = 0, rank = 0;
  bool joined = false;     // every rank's join file read
  std::string refused;     // why the joined ranks cannot form the communicator, if they cannot
  std::uint64_t next = 0;  // collectives begun
  struct pending {
    std::uint64_t k;
    call mine;
    std::chrono::steady_clock::time_point since;
  };
  std::optional<pending> waiting;  // the collective made and not yet completed

  std::filesystem::path file(std::uint64_t k, int r) const {
    return dir / (std::to_string(k) + "." + std::to_string(r));
  }
};

// `bytes` as the file `path`, written under a name of this process and thread and renamed
// (the last writer's, where several write one path); false where the file system refused.
inline bool write_whole(const std::filesystem::path& path, const std::string& bytes) {
  const std::filesystem::path part = path.string() + ".part." + std::to_string(getpid()) + "." +
                                     std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
  {
    std::ofstream out(part, std::ios::binary);
    out.write(bytes.data(), std::streamsize(bytes.size()));
    if (!out.flush()) return false;
  }
  std::error_code ec;
  std::filesystem::rename(part, path, ec);
  return !ec;
}
inline std::string read_whole(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::string bytes(in ? std::size_t(in.tellg()) : 0, '\0');
  in.seekg(0);
  in.read(bytes.data(), std::streamsize(bytes.size()));
  return bytes;
}
// The reason a rank aborted the communicator, or nothing.
inline std::optional<std::string> abort_reason(const file_exchange& x) {
  if (!std::filesystem::exists(x.dir / "abort")) return std::nullopt;
  return read_whole(x.dir / "abort");
}
// Ranks that abort together each write their reason; one stays. Never throws (it runs in
// ncclCommAbort, which the library calls from destructors and its watchdog).
inline void abort_files(const file_exchange& x, const std::string& why) noexcept {
  try {
    if (!std::filesystem::exists(x.dir / "abort")) (void)write_whole(x.dir / "abort", why);
  } catch (...) {  // what the abort could not write, a peer learns from its timeout
  }
}
// A poll's pause: 50 us at first, growing to 1 ms for a wait that goes on.
inline void pause_after(std::chrono::steady_clock::time_point since) {
  using duration = std::chrono::steady_clock::duration;
  const duration waited = std::chrono::steady_clock::now() - since;
  std::this_thread::sleep_for(
      std::min<duration>(std::max<duration>(waited / 16, std::chrono::microseconds(50)), std::chrono::milliseconds(1)));
}
inline std::string host_name() {
  std::array<char, 256> name{};
  gethostname(name.data(), name.size() - 1);
  return name.data();
}

// The bytes of the send buffer every rank's file carries: none for a split, the root's
// alone for a broadcast.
inline std::size_t payload_bytes(const call& c, int rank) {
  if (c.what == kind::split || (c.what == kind::broadcast && rank != c.root)) return 0;
  return c.count * type_size(c.type);
}
inline constexpr std::size_t header_fields = 7;
inline std::string encode(const call& c, int rank) {
  const std::array<std::int64_t, header_fields> h{int(c.what), std::int64_t(c.count), int(c.type), int(c.op),
                                                  c.root,      c.color,             c.key};
  std::string bytes(reinterpret_cast<const char*>(h.data()), sizeof h);
  bytes.append(static_cast<const char*>(c.send), payload_bytes(c, rank));
  return bytes;
}
inline call decode(const std::string& bytes) {
  std::array<std::int64_t, header_fields> h{};
  std::memcpy(h.data(), bytes.data(), sizeof h);
  return {.what = kind(h[0]), .send = bytes.data() + sizeof h, .count = std::size_t(h[1]),
          .type = ncclDataType_t(h[2]), .op = ncclRedOp_t(h[3]), .root = int(h[4]), .color = int(h[5]),
          .key = int(h[6])};
}

// What a rank's join file says.
struct joined_rank {
  std::string host;
  int device = -1, size = 0;
};

// InProgress until every rank has joined; then whether they can form the communicator. A
// rank that joined with another size is refused at once, as the thread ranks are (read
// before an abort, which a refused peer makes next).
inline ncclResult_t join_state(ncclComm_t comm) {
  file_exchange& x = *comm->files;
  if (!x.joined && x.refused.empty()) {
    std::vector<std::optional<joined_rank>> seen(std::size_t(x.size));
    bool all = true;
    for (int r = 0; r < x.size && x.refused.empty(); ++r) {
      const auto path = x.dir / ("join." + std::to_string(r));
      if (!std::filesystem::exists(path)) {
        all = false;
        continue;
      }
      std::istringstream in(read_whole(path));
      joined_rank& j = seen[std::size_t(r)].emplace();
      in >> j.host >> j.device >> j.size;
      if (j.size != x.size)
        x.refused = "rank " + std::to_string(r) + " joined a communicator of " + std::to_string(j.size) +
                    " ranks, rank " + std::to_string(x.rank) + " one of " + std::to_string(x.size);
    }
    if (!all && x.refused.empty()) {
      if (const auto why = abort_reason(x))
        return fail(comm, ncclRemoteError, "a rank aborted the communicator: " + *why);
      return ncclInProgress;
    }
    for (int a = 0; a < x.size && x.refused.empty(); ++a)
      for (int b = a + 1; b < x.size && x.refused.empty(); ++b)
        if (seen[std::size_t(a)]->host == seen[std::size_t(b)]->host &&
            seen[std::size_t(a)]->device == seen[std::size_t(b)]->device)
          x.refused = "Duplicate GPU detected: ranks " + std::to_string(a) + " and " + std::to_string(b) +
                      " both on device " + std::to_string(seen[std::size_t(a)]->device);
    x.joined = x.refused.empty();  // a refusal stays: every later poll reports it
  }
  if (!x.refused.empty()) return fail(comm, ncclInvalidUsage, x.refused);
  if (const auto why = abort_reason(x)) return fail(comm, ncclRemoteError, "a rank aborted the communicator: " + *why);
  return ncclSuccess;
}

inline ncclResult_t init_files(ncclComm_t* comm, int nranks, const std::string& id, int rank, int device,
                               bool blocking) {
  auto x = std::make_shared<file_exchange>();
  x->dir = std::filesystem::path(files_root()) / id;
  x->size = nranks;
  x->rank = rank;
  std::filesystem::create_directories(x->dir);
  const auto join = x->dir / ("join." + std::to_string(rank));
  if (std::filesystem::exists(join))
    return fail(nullptr, ncclInvalidUsage, "rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                                               " joins an id already used by another communicator or rank");
  if (!write_whole(join, host_name() + " " + std::to_string(device) + " " + std::to_string(nranks)))
    return fail(nullptr, ncclSystemError, "cannot write " + join.string());
  *comm = new ncclComm(nullptr, rank, nranks, device, blocking);
  (*comm)->files = std::move(x);
  if (!blocking) return ncclInProgress;  // ncclCommGetAsyncError says how it ends
  const auto since = std::chrono::steady_clock::now();
  ncclResult_t r;
  while ((r = join_state(*comm)) == ncclInProgress) {
    if (std::chrono::steady_clock::now() - since > peer_patience)
      return fail(*comm, ncclSystemError, "not every rank joined within two minutes, or one aborted");
    pause_after(since);
  }
  return r;
}

// The collective this rank waits in: InProgress until every rank's file is there; then
// this rank's part of it, computed from them.
inline ncclResult_t finish_files(ncclComm_t comm) {
  file_exchange& x = *comm->files;
  if (const auto why = abort_reason(x)) {
    x.waiting.reset();
    return fail(comm, ncclRemoteError, "a rank of this communicator aborted it: " + *why);
  }
  const file_exchange::pending done = *x.waiting;
  for (int r = 0; r < x.size; ++r)
    if (!std::filesystem::exists(x.file(done.k, r))) {
      if (std::chrono::steady_clock::now() - done.since <= peer_patience) return ncclInProgress;
      abort_files(x, "rank " + std::to_string(x.rank) + " gave up waiting in " + describe(done.mine.what));
      x.waiting.reset();
      return fail(comm, ncclSystemError, describe(done.mine.what) + ": not every rank made the call within two minutes");
    }
  x.waiting.reset();
  std::vector<std::string> bytes;  // reserved: the calls point into them
  bytes.reserve(std::size_t(x.size));
  std::vector<call> calls;
  for (int r = 0; r < x.size; ++r) {
    bytes.push_back(read_whole(x.file(done.k, r)));
    calls.push_back(decode(bytes.back()));
  }
  if (done.k > 0) {
    std::error_code ec;  // a file left behind costs nothing
    std::filesystem::remove(x.file(done.k - 1, x.rank), ec);
  }
  for (int r = 1; r < x.size; ++r)
    if (!(calls[std::size_t(r)] == calls[0]))
      return fail(comm, ncclInvalidUsage, "rank " + std::to_string(r) + " called " + describe(calls[std::size_t(r)], x.size) +
                                              " while rank 0 called " + describe(calls[0], x.size));
  if (done.mine.what != kind::split) {
    calls[std::size_t(x.rank)].recv = done.mine.recv;
    compute(calls);
    return ncclSuccess;
  }
  // This rank's child: the ranks of its color ordered by key, then by rank.
  *done.mine.child = nullptr;
  if (done.mine.color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  std::vector<std::pair<int, int>> members;  // (key, rank)
  for (int r = 0; r < x.size; ++r)
    if (calls[std::size_t(r)].color == done.mine.color) members.push_back({calls[std::size_t(r)].key, r});
  std::sort(members.begin(), members.end());
  const int position = int(std::find(members.begin(), members.end(), std::pair(done.mine.key, x.rank)) - members.begin());
  auto child = std::make_shared<file_exchange>();
  child->dir = x.dir.string() + ".split" + std::to_string(done.k) + ".color" + std::to_string(done.mine.color);
  child->size = int(members.size());
  child->rank = position;
  child->joined = true;
  std::filesystem::create_directories(child->dir);
  *done.mine.child = new ncclComm(nullptr, position, child->size, done.mine.device, done.mine.blocking);
  (*done.mine.child)->files = std::move(child);
  return ncclSuccess;
}

// Rank comm->rank's part in a collective through files: its call written, then, when
// blocking, waits for the others; non-blocking, answers InProgress until they have come
// (a split Success at once, its child written at a later poll, as the thread ranks do).
inline ncclResult_t collective_files(ncclComm_t comm, call mine) {
  file_exchange& x = *comm->files;
  if (const auto why = abort_reason(x))
    return fail(comm, ncclRemoteError, "a rank of this communicator aborted it: " + *why);
  const std::uint64_t k = x.next++;
  if (!write_whole(x.file(k, x.rank), encode(mine, x.rank)))
    return fail(comm, ncclSystemError, "cannot write " + x.file(k, x.rank).string());
  x.waiting = file_exchange::pending{k, mine, std::chrono::steady_clock::now()};
  if (!comm->blocking) {
    if (mine.what == kind::split) {
      *mine.child = nullptr;
      return ncclSuccess;
    }
    return finish_files(comm);
  }
  ncclResult_t r;
  const auto since = x.waiting->since;
  while ((r = finish_files(comm)) == ncclInProgress) pause_after(since);
  return r;
}

// ncclCommGetAsyncError of a communicator that meets through files.
inline ncclResult_t state_files(ncclComm_t comm) {
  file_exchange& x = *comm->files;
  if (!x.joined) return join_state(comm);  // a refusal first, then an abort
  if (const auto why = abort_reason(x)) return fail(comm, ncclRemoteError, "a rank aborted the communicator: " + *why);
  return x.waiting ? finish_files(comm) : ncclSuccess;
}

}  // namespace nccl_emulator
