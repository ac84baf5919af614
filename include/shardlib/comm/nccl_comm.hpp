// shardlib/comm/nccl_comm.hpp — NcclComm: collectives over device buffers with
// NCCL, one rank per GPU (one process per GPU under mpirun or torchrun, or one
// thread per GPU in one process).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/nccl_state.hpp"    // nccl_options, detail::nccl_state
#include "shardlib/comm/communicator.hpp"  // Communicator, reduce_op, check_communicator
#include "shardlib/comm/reduce.hpp"        // check_reducible
#include "shardlib/comm/signature.hpp"     // detail::signature, describe, invalid_call, invalid_elsewhere
#include "shardlib/comm/store.hpp"         // TcpStore (from_store)
#include "shardlib/core/buffer.hpp"        // Buffer
#include "shardlib/core/element.hpp"       // Element, dtype_of
#include "shardlib/core/error.hpp"         // comm_error, shape_error, require, cat
#include "shardlib/core/ledger.hpp"        // category
#include "shardlib/cuda/error.hpp"         // check
#include "shardlib/cuda/memory_space.hpp"  // cuda_space
#include "shardlib/cuda/stream.hpp"        // device_guard, stream, event


#include <cuda_runtime.h>
#include <nccl.h>

#include <array>               // std::array
#include <chrono>              // std::chrono
#include <condition_variable>  // std::condition_variable
#include <cstddef>             // std::size_t
#include <cstdint>             // std::int16_t, std::uint8_t
#include <cstdlib>             // std::getenv, std::strtol
#include <cstring>             // std::memcpy
#include <deque>               // std::deque
#include <exception>           // std::exception_ptr
#include <filesystem>          // std::filesystem
#include <fstream>             // std::ifstream, std::ofstream
#include <memory>              // std::shared_ptr
#include <mutex>               // std::mutex
#include <span>                // std::span
#include <string>              // std::string
#include <thread>              // std::thread, std::this_thread
#include <type_traits>         // std::is_same_v
#include <utility>             // std::move

#include <unistd.h>  // getpid: a per-process name for the id file written before its rename

namespace shardlib::comm {

// The handle an asynchronous NcclComm collective returns. wait() orders the
// communicator's compute stream after the collective (cudaStreamWaitEvent: the
// host goes on); wait(s) orders another stream; wait_host() blocks the host
// until it has finished. Each rethrows the communicator's failure, if any.
class nccl_work {
 public:
  nccl_work() = default;  // already complete
  nccl_work(std::shared_ptr<detail::nccl_state> st, std::shared_ptr<cuda::event> done, cudaStream_t compute,
            detail::signature sig)
      : state_(std::move(st)), done_(std::move(done)), compute_(compute), sig_(sig) {}

  void wait() { wait(compute_); }
  void wait(cudaStream_t s) {
    if (!done_) return;
    state_->throw_if_aborted();
    done_->make_wait(s);
  }
  void wait_host() {
    if (done_) state_->wait_host(*done_, sig_);
  }
  // Whether the collective has finished (cudaEventQuery), without blocking.
  bool test() {
    if (!done_) return true;
    state_->throw_if_aborted();
    return done_->ready();
  }

 private:
  std::shared_ptr<detail::nccl_state> state_;
  std::shared_ptr<cuda::event> done_;
  cudaStream_t compute_ = nullptr;
  detail::signature sig_;
};

// Collectives over device buffers (spans of device memory) with NCCL.
//
// Streams: every collective runs on the communicator's own stream, after the
// work issued so far on its compute stream (the stream the caller produces and
// consumes buffers on; the legacy default stream unless set with `on`). The
// asynchronous forms return an nccl_work; the blocking forms are blocking in
// stream order — the compute stream waits for the result, the host does not —
// so kernels issued next on the compute stream see it, and the host sees it
// after synchronising that stream. barrier() blocks the host.
//
// Reductions: sum, avg (ncclAvg) and max on double, float, half, bfloat16 and
// 8/32/64-bit integers. NCCL reduces bf16 and fp16 natively: it adds them in
// float but rounds to 16 bits at each hop of its ring or tree, so a W-rank sum
// may carry up to W - 1 roundings where ThreadComm and MpiComm carry one. Where
// that matters, reduce in fp32 (the mixed-precision policy's reduce dtype), as
// the library does by default. NCCL has no 16-bit integer type: I16
// reductions raise comm_error (gathers and broadcasts move any type as bytes).
// A collective of zero elements enqueues nothing and returns a complete work.
class NcclComm {
 public:
  // Rank `rank` of `size`, on `device`, from an id that rank 0 made with
  // ncclGetUniqueId and gave to every rank. Every rank must call it.
  NcclComm(const ncclUniqueId& id, int rank, int size, int device, const nccl_options& options = {}) {
    detail::check_timeout(options.timeout);
    cuda::device_guard g(device);
    int least = 0, greatest = 0;
    cuda::check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    // The highest priority: communication kernels start as soon as they may,
    // ahead of compute kernels queued meanwhile (overlap).
    auto s = std::make_shared<cuda::stream>(device, greatest);
    ncclConfig_t config = detail::nonblocking_config();
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    detail::settle_new(comm, r, options, rank, cat("NCCL initialisation (rank ", rank, " of ", size, ")").c_str());
    state_ = detail::nccl_state::adopt(comm, device, std::move(s), options);
  }

  // Every rank of `host` (a ThreadComm, an MpiComm: any Communicator) calls
  // it; rank 0 makes the NCCL id and broadcasts it over `host`. Ranks keep
  // their host rank. One rank per device: under mpirun, device = the rank on
  // its node; with ranks as threads, device = the rank.
  template <Communicator Host>
  static NcclComm bootstrap(Host& host, int device, const nccl_options& options = {}) {
    detail::check_timeout(options.timeout);  // on every rank, before rank 0 makes an id
    // Byte 0 says whether rank 0 made an id, so that a failure there raises on
    // every rank instead of leaving them waiting in the initialisation.
    std::array<std::uint8_t, 1 + sizeof(ncclUniqueId)> message{};
    std::string failure;
    if (host.rank() == 0) {
      ncclUniqueId id{};
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r == ncclSuccess) {
        message[0] = 1;
        std::memcpy(message.data() + 1, &id, sizeof id);
      } else {
        failure = detail::nccl_text(r, nullptr);
      }
    }
    host.broadcast(std::span<std::uint8_t>(message), 0);
    require<comm_error>(message[0] == 1, "rank ", host.rank(), ": rank 0 could not make an NCCL id",
                        failure.empty() ? std::string() : cat(": ncclGetUniqueId failed: ", failure));
    ncclUniqueId id;
    std::memcpy(&id, message.data() + 1, sizeof id);
    return NcclComm(id, host.rank(), host.size(), device, options);
  }

  // Every rank of the store's job calls it (processes started without MPI: the store
  // from comm::store_from_environment, also under torchrun); rank 0 makes the NCCL id and sets it in the store, the others
  // wait for it there, within the store's timeout. Rank 0 publishes a failure too,
  // so that no rank waits for an id that never comes. Ranks keep their store rank;
  // one rank per device, device = the launcher's LOCAL_RANK.
  static NcclComm from_store(TcpStore& store, int device, const nccl_options& options = {}) {
    detail::check_timeout(options.timeout);
    const std::string key = store.fresh_prefix("nccl") + "id";
    if (store.rank() == 0) {
      ncclUniqueId id{};
      const ncclResult_t r = ncclGetUniqueId(&id);
      store.set(key, r == ncclSuccess ? '\1' + std::string(reinterpret_cast<const char*>(&id), sizeof id)
                                      : '\0' + cat("ncclGetUniqueId failed: ", detail::nccl_text(r, nullptr)));
    }
    const std::string message = store.get(key);  // byte 0: whether rank 0 made an id
    require<comm_error>(message.size() == 1 + sizeof(ncclUniqueId) && message[0] == '\1', "rank ", store.rank(),
                        ": rank 0 could not make an NCCL id: ", message.substr(1));
    ncclUniqueId id;
    std::memcpy(&id, message.data() + 1, sizeof id);
    return NcclComm(id, store.rank(), store.size(), device, options);
  }

  // torchrun-style: RANK, WORLD_SIZE and LOCAL_RANK from the environment
  // (device = LOCAL_RANK); rank 0 writes the id to `id_file` (atomically: a
  // temporary file, then a rename) and removes it once every rank has joined,
  // the others wait for it to appear. The path must be on a file system all
  // ranks see and must not exist yet: a file left by an earlier run would hand
  // stale ids to the other ranks, so rank 0 refuses to start.
  static NcclComm from_env(const std::filesystem::path& id_file, const nccl_options& options = {}) {
    detail::check_timeout(options.timeout);
    const int rank = env_int("RANK"), size = env_int("WORLD_SIZE"), local = env_int("LOCAL_RANK");
    require<comm_error>(rank >= 0 && rank < size, "NcclComm::from_env: RANK ", rank, " is not in [0, WORLD_SIZE ",
                        size, ")");
    const ncclUniqueId id = rank == 0 ? publish_id(id_file) : read_id(id_file, rank, options.timeout);
    // Rank 0 removes the file once every rank has joined (initialisation needed them all)
    // or once initialisation failed: a file left behind would make the next run refuse.
    struct removal {
      const std::filesystem::path* file;
      ~removal() {
        std::error_code ignored;
        if (file) std::filesystem::remove(*file, ignored);
      }
    } remove_id{rank == 0 ? &id_file : nullptr};
    return NcclComm(id, rank, size, local, options);
  }

  int rank() const { return state_->rank(); }
  int size() const { return state_->size(); }
  int device() const { return state_->device(); }
  ncclComm_t native() const { return state_->native(); }
  cudaStream_t comm_stream() const { return state_->comm_stream()->get(); }
  cudaStream_t compute_stream() const { return compute_; }

  // The same communicator, ordered against another compute stream.
  NcclComm on(cudaStream_t compute) const {
    NcclComm c = *this;
    c.compute_ = compute;
    return c;
  }

  // Aborts the communicator now: its kernels exit, later calls throw.
  void abort() { state_->abort("NcclComm::abort was called"); }

  // Blocks the host until every rank has reached it (a one-element all-reduce).
  void barrier() {
    const detail::signature sig{detail::op_kind::barrier};
    agree(sig, [] {});
    float* x = state_->scratch();
    auto done = state_->enqueue(compute_, sig, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, c, s);
    });
    state_->wait_host(*done, sig);
  }

  template <Element T>
  void all_gather(std::span<const T> send, std::span<T> recv) {
    all_gather_async(send, recv).wait();
  }
  template <Element T>
  [[nodiscard]] nccl_work all_gather_async(std::span<const T> send, std::span<T> recv) {
    const std::size_t n = send.size();
    const detail::signature sig{detail::op_kind::all_gather, dtype_of<T>, n};
    agree(sig, [&] {
      require<shape_error>(recv.size() == n * size(), "rank ", rank(), ": all_gather of ", n,
                           " elements per rank over ", size(), " ranks needs a receive buffer of ", n * size(),
                           ", got ", recv.size());
      check_buffers(sig, send, recv, recv.data() + rank() * n);
    });
    if (n == 0) return {};
    return enqueue(sig, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(send.data(), recv.data(), n * sizeof(T), ncclUint8, c, s);
    });
  }

  template <Element T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op) {
    reduce_scatter_async(send, recv, op).wait();
  }
  template <Element T>
  [[nodiscard]] nccl_work reduce_scatter_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = recv.size();
    const detail::signature sig{detail::op_kind::reduce_scatter, dtype_of<T>, n, op};
    ncclDataType_t type{};
    agree(sig, [&] {
      require<shape_error>(send.size() == n * size(), "rank ", rank(), ": reduce_scatter to ", n,
                           " elements per rank over ", size(), " ranks needs a send buffer of ", n * size(), ", got ",
                           send.size());
      type = reduction_type<T>(op);
      check_buffers(sig, recv, send, send.data() + rank() * n);
    });
    if (n == 0) return {};
    return enqueue(sig, [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(send.data(), recv.data(), n, type, nccl_op(op), c, s);
    });
  }

  template <Element T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op) {
    all_reduce_async(send, recv, op).wait();
  }
  template <Element T>
  void all_reduce(std::span<T> data, reduce_op op) {
    all_reduce(std::span<const T>(data), data, op);
  }
  template <Element T>
  [[nodiscard]] nccl_work all_reduce_async(std::span<const T> send, std::span<T> recv, reduce_op op) {
    const std::size_t n = send.size();
    const detail::signature sig{detail::op_kind::all_reduce, dtype_of<T>, n, op};
    ncclDataType_t type{};
    agree(sig, [&] {
      require<shape_error>(recv.size() == n, "rank ", rank(), ": all_reduce of ", n,
                           " elements needs a receive buffer of the same size, got ", recv.size());
      type = reduction_type<T>(op);
      check_buffers(sig, send, recv, recv.data());
    });
    if (n == 0) return {};
    return enqueue(sig, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(send.data(), recv.data(), n, type, nccl_op(op), c, s);
    });
  }

  template <Element T>
  void broadcast(std::span<T> data, int root) {
    broadcast_async(data, root).wait();
  }
  template <Element T>
  [[nodiscard]] nccl_work broadcast_async(std::span<T> data, int root) {
    const detail::signature sig{detail::op_kind::broadcast, dtype_of<T>, data.size(), reduce_op::sum, root};
    agree(sig, [&] {
      require<comm_error>(root >= 0 && root < size(), "rank ", rank(), ": broadcast root ", root,
                          " is not a rank of ", size());
      check_pointer(sig, data.data(), data.size_bytes(), "data");
    });
    if (data.empty()) return {};
    return enqueue(sig, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(data.data(), data.data(), data.size_bytes(), ncclUint8, root, c, s);
    });
  }

  // Ranks with the same color form a new communicator, ordered by key, then by
  // rank here (ncclCommSplit). Every rank must call it; color must be >= 0. The
  // new communicator shares this one's stream and compute stream.
  NcclComm split(int color, int key) {
    agree(detail::signature{detail::op_kind::split},
          [&] { require<comm_error>(color >= 0, "rank ", rank(), ": split color must be >= 0, got ", color); });
    cuda::device_guard g(device());
    ncclConfig_t config = detail::nonblocking_config();
    ncclComm_t child = nullptr;
    try {
      // On a non-blocking communicator NCCL (2.28) answers ncclSuccess while the split still
      // runs, and writes `child` when it ends, which the parent's state tells: poll it always.
      state_->call(
          [&](ncclComm_t c) {
            const ncclResult_t r = ncclCommSplit(c, color, key, &child, &config);
            return r == ncclSuccess ? ncclInProgress : r;
          },
          "ncclCommSplit");
    } catch (...) {
      if (child) (void)ncclCommAbort(child);
      throw;
    }
    require<comm_error>(child != nullptr, "rank ", rank(), ": ncclCommSplit (color ", color,
                        ") settled without giving a communicator");
    detail::settle_new(child, ncclInProgress, state_->options(), rank(), "ncclCommSplit (the new communicator)");
    NcclComm c;
    c.state_ = detail::nccl_state::adopt(child, device(), state_->comm_stream(), state_->options());
    c.compute_ = compute_;
    return c;
  }

 private:
  NcclComm() = default;

  // The arguments' own checks (validate throws on this rank's mistakes); with
  // nccl_options::check, then every rank's call compared before any data moves, so
  // that every rank raises, naming the calls: a rank whose arguments were wrong
  // rethrows its own error, the others raise comm_aborted naming it.
  template <class Validate>
  void agree(const detail::signature& sig, Validate&& validate) {
    if (!state_->checks()) return validate();
    const std::exception_ptr invalid = detail::invalid_call(validate);
    const auto all = state_->gather_calls(compute_, sig, !invalid);
    if (invalid) std::rethrow_exception(invalid);
    for (int r = 0; r < size(); ++r)
      if (!all[std::size_t(r)].valid) throw detail::invalid_elsewhere(rank(), sig, r, all[std::size_t(r)].sig);
    for (int r = 1; r < size(); ++r)
      if (!(all[std::size_t(r)].sig == all[0].sig))
        throw detail::disagreement(rank(), all[0].sig, r, all[std::size_t(r)].sig);
  }

  template <class F>
  nccl_work enqueue(const detail::signature& sig, F f) {
    return nccl_work(state_, state_->enqueue(compute_, sig, f), compute_, sig);
  }

  static ncclRedOp_t nccl_op(reduce_op op) {
    return op == reduce_op::sum ? ncclSum : op == reduce_op::avg ? ncclAvg : ncclMax;
  }

  template <Element T>
  ncclDataType_t reduction_type(reduce_op op) const {
    check_reducible(op, dtype_of<T>);
    if constexpr (std::is_same_v<T, double>) return ncclFloat64;
    else if constexpr (std::is_same_v<T, float>) return ncclFloat32;
    else if constexpr (std::is_same_v<T, half>) return ncclFloat16;
    else if constexpr (std::is_same_v<T, bfloat16>) return ncclBfloat16;
    else if constexpr (std::is_same_v<T, std::int64_t>) return ncclInt64;
    else if constexpr (std::is_same_v<T, std::int32_t>) return ncclInt32;
    else if constexpr (std::is_same_v<T, std::int8_t>) return ncclInt8;
    else if constexpr (std::is_same_v<T, std::uint8_t>) return ncclUint8;
    else
      throw comm_error(cat("rank ", rank(), ": NCCL cannot reduce ", name(dtype_of<T>),
                           " (it has no 16-bit integer type); reduce a wider type"));
  }

  // The pointers, and in-place use: `small` may only overlap `large` at
  // exactly `in_place` (the rank's own slice, as NCCL defines in place).
  template <class T, class U>
  void check_buffers(const detail::signature& sig, std::span<T> small, std::span<U> large, const void* in_place) const {
    check_pointer(sig, small.data(), small.size_bytes(), "one buffer");
    check_pointer(sig, large.data(), large.size_bytes(), "the other buffer");
    const auto* s = reinterpret_cast<const std::byte*>(small.data());
    const auto* l = reinterpret_cast<const std::byte*>(large.data());
    const bool overlap = !small.empty() && !large.empty() && s < l + large.size_bytes() && l < s + small.size_bytes();
    require<comm_error>(!overlap || static_cast<const void*>(s) == in_place, "rank ", rank(), ": ",
                        detail::describe(sig), ": the buffers overlap without being in place (in place, the smaller ",
                        "buffer is the rank's own slice of the larger)");
  }

  void check_pointer(const detail::signature& sig, const void* p, std::size_t bytes, const char* which) const {
    if (!state_->options().check_pointers || bytes == 0) return;
    cudaPointerAttributes a{};
    cuda::check(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
    const bool device_memory = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
    require<comm_error>(device_memory && a.device == device(), "rank ", rank(), ": ", detail::describe(sig), ": ",
                        which, " is ", device_memory ? cat("memory of device ", a.device) : std::string("host memory"),
                        ", but NCCL needs memory of this communicator's device ", device());
  }

  static int env_int(const char* name) {
    const char* v = std::getenv(name);
    require<comm_error>(v && *v, "NcclComm::from_env: the environment variable ", name,
                        " is not set (torchrun sets RANK, WORLD_SIZE and LOCAL_RANK)");
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    require<comm_error>(*end == '\0' && x >= 0, "NcclComm::from_env: ", name, "=\"", v,
                        "\" is not a non-negative integer");
    return int(x);
  }

  static ncclUniqueId publish_id(const std::filesystem::path& path) {
    require<comm_error>(!std::filesystem::exists(path), "rank 0: the NCCL id file ", path,
                        " already exists (left by an earlier run?): remove it, or give each job its own path");
    ncclUniqueId id{};
    const ncclResult_t r = ncclGetUniqueId(&id);
    require<comm_error>(r == ncclSuccess, "rank 0: ncclGetUniqueId failed: ", detail::nccl_text(r, nullptr));
    const std::filesystem::path tmp = cat(path.string(), ".tmp.", getpid());
    {
      std::ofstream out(tmp, std::ios::binary);
      out.write(reinterpret_cast<const char*>(&id), sizeof id);
      require<comm_error>(bool(out.flush()), "rank 0: cannot write the NCCL id to ", tmp);
    }
    std::filesystem::rename(tmp, path);  // the others never see a partial file
    return id;
  }

  static ncclUniqueId read_id(const std::filesystem::path& path, int rank, std::chrono::milliseconds timeout) {
    const auto deadline = detail::nccl_deadline(timeout);
    std::error_code ec;
    while (std::filesystem::file_size(path, ec) != sizeof(ncclUniqueId) || ec) {
      require<comm_error>(detail::nccl_clock::now() < deadline, "rank ", rank, ": no NCCL id appeared at ", path,
                          " within ", timeout.count(), " ms (is rank 0 running, with the same path?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ncclUniqueId id{};
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(&id), sizeof id);
    require<comm_error>(bool(in), "rank ", rank, ": cannot read the NCCL id from ", path);
    return id;
  }

  std::shared_ptr<detail::nccl_state> state_;
  cudaStream_t compute_ = nullptr;  // the legacy default stream
};

static_assert(check_communicator<NcclComm>());

}  // namespace shardlib::comm
