// tests/emulated/cuda_emulator.hpp — the part of CUDA that the fused attention's
// kernels use, on the CPU, so that host tests run those very kernels (not a model
// of them) where no GPU is: tests/emulated/include holds stand-ins for
// <cuda_runtime.h>, <cuda_bf16.h>, <cuda_fp16.h>, <mma.h> and <cuda_pipeline.h>
// that bring in this.
//
// A launch runs the blocks one after another. A block's threads are fibers
// (fiber_switch.hpp) on the calling thread: each runs until it reaches a barrier
// (__syncthreads, __syncwarp, a shuffle's exchange) or ends, and a barrier opens
// when every live thread of its block (or warp) waits at it, at the same kind. So a
// thread that reads shared memory another thread has not written yet (a missing
// barrier) reads what was there before, and the launch's shared memory is filled
// with 0xFF bytes (NaN in fp32, bf16 and fp16) before every block; threads that
// wait at different barriers (a barrier not every thread reaches) raise an error
// instead of hanging; blocks and threads may run in reverse order, so that two runs
// differ where a result depends on the order. Writes past the launch's declared
// shared memory are found after each block. Asynchronous copies (cp.async) land
// when waited for or, by option, when issued.
//
// Only what the kernels need: blocks of up to three dimensions (warps are 32
// consecutive threads, x fastest), full-warp masks, wmma's 16x16x16 tiles
// (include/mma.h: each thread loads the whole tile and stores its own share of
// it, as the hardware's lanes do). Static __shared__ arrays are the kernel's
// static variables (the library declares them `static __shared__`): shared by a
// block's threads, kept from block to block, not filled. Launches from several
// host threads run one at a time. cuda_runtime_api.hpp holds the host side.
#pragma once
#include "fiber_switch.hpp"

#include <algorithm>   // std::all_of, std::any_of, std::fill
#include <bit>         // std::bit_cast
#include <chrono>      // std::chrono::nanoseconds
#include <cmath>       // std::isfinite, std::isinf, std::isnan
#include <cstddef>     // std::size_t
#include <cstdint>     // std::uint16_t, std::uint64_t, std::uintptr_t
#include <cstring>     // std::memcpy
#include <exception>   // std::exception_ptr
#include <functional>  // std::function
#include <memory>      // std::unique_ptr
#include <mutex>       // std::mutex, std::lock_guard
#include <span>        // std::span
#include <stdexcept>   // std::runtime_error
#include <string>      // std::string, std::to_string
#include <utility>     // std::exchange
#include <vector>      // std::vector

// CUDA's qualifiers mean nothing here.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct __nv_bfloat16 {
  std::uint16_t bits;
};
struct __half {
  std::uint16_t bits;
};

namespace cuda_emulator {

inline constexpr std::size_t stack_bytes = std::size_t(256) << 10;  // per thread: the kernels keep tiles in arrays
inline constexpr int warp_size = 32;
inline constexpr std::size_t shared_capacity = 232448;  // an sm_90 block's shared memory on opt-in

enum class place { running, block_barrier, warp_barrier, done };

// An asynchronous copy (cp.async) issued and not yet waited for.
struct pending_copy {
  void* to;
  const void* from;
  std::size_t bytes, zeros;  // the last `zeros` bytes are zero-filled
};

// What a thread waits for at a warp barrier: a barrier opens only for one kind.
enum class warp_sync { syncwarp, shuffle };

struct fiber {
  context ctx;
  place at = place::running;
  warp_sync kind = warp_sync::syncwarp;  // at a warp barrier
  std::vector<pending_copy> open;                  // issued since the last commit
  std::vector<std::vector<pending_copy>> groups;   // committed, oldest first
};

// The one machine: the launch in progress and its block's threads.
struct machine {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
  context scheduler;
  std::vector<fiber> threads;
  std::vector<std::unique_ptr<char[]>> stacks;  // threads[i] runs on stacks[i]; kept from launch to launch
  std::vector<std::span<unsigned char>> dynamic_shared;  // the `extern __shared__` arrays tests define
  std::vector<std::uint64_t> exchange[2];  // shuffles' values, one per thread, odd and even shuffles
  std::vector<int> shuffles;               // per thread, how many it made
  int current = 0;
  int pass_position = 0;  // of `current` in the pass's order
  bool reversed = false;  // the pass's order: last thread first
  int only_warp = -1;     // the warp a pass runs, or -1 for all (warp-serial schedules)
  bool copies_at_issue = false;
  const std::function<void()>* body = nullptr;
  std::exception_ptr failure;
  std::mutex one_launch;  // launches from several host threads run one at a time
};
inline machine& the_machine() {
  static machine m;
  return m;
}

class emulation_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thread t of the block (x fastest) as threadIdx.
inline uint3 thread_index(const machine& m, int t) {
  const unsigned u = unsigned(t), x = m.block_dim.x, y = m.block_dim.y;
  return {u % x, u / x % y, u / (x * y)};
}

// The calling thread waits at `p` until the scheduler opens it. The next thread of
// the pass that can run runs at once (one switch, not two through the scheduler);
// after the pass's last, the scheduler opens barriers and starts the next pass.
inline void wait_at(place p, warp_sync kind = warp_sync::syncwarp) {
  machine& m = the_machine();
  const int me = m.current, count = int(m.threads.size());
  m.threads[std::size_t(me)].at = p;
  m.threads[std::size_t(me)].kind = kind;
  for (int k = m.pass_position + 1; k < count; ++k) {
    const int t = m.reversed ? count - 1 - k : k;
    if (m.threads[std::size_t(t)].at != place::running || (m.only_warp >= 0 && t / warp_size != m.only_warp)) continue;
    m.pass_position = k;
    m.current = t;
    m.thread = thread_index(m, t);
    switch_context(m.threads[std::size_t(me)].ctx, m.threads[std::size_t(t)].ctx);
    return;
  }
  switch_context(m.threads[std::size_t(me)].ctx, m.scheduler);
}

inline void thread_entry() {
  machine& m = the_machine();
  try {
    (*m.body)();
  } catch (...) {
    if (!m.failure) m.failure = std::current_exception();
  }
  m.threads[std::size_t(m.current)].at = place::done;
  switch_context(m.threads[std::size_t(m.current)].ctx, m.scheduler);  // for good
}

inline std::string block_name(const uint3& b) {
  return "block (" + std::to_string(b.x) + ", " + std::to_string(b.y) + ", " + std::to_string(b.z) + ")";
}

// Opens warp w's barrier when all its threads wait there: false when some still
// run or wait at __syncthreads; raises when it can never open.
inline bool open_warp(machine& m, int w) {
  const int count = int(m.threads.size()), w0 = w * warp_size, end = std::min(count, w0 + warp_size);
  int waiting = 0, done = 0;
  for (int t = w0; t < end; ++t) {
    waiting += m.threads[std::size_t(t)].at == place::warp_barrier;
    done += m.threads[std::size_t(t)].at == place::done;
  }
  if (waiting == 0 || waiting + done < end - w0) return false;
  if (done > 0)
    throw emulation_error(block_name(m.block) + ", warp " + std::to_string(w) +
                          ": a full-warp barrier (__syncwarp or a shuffle) with " + std::to_string(done) +
                          " of its threads exited");
  for (int t = w0 + 1; t < end; ++t)
    if (m.threads[std::size_t(t)].kind != m.threads[std::size_t(w0)].kind)
      throw emulation_error(block_name(m.block) + ", warp " + std::to_string(w) +
                            ": lanes meet at different warp barriers (a __syncwarp and a shuffle)");
  for (int t = w0; t < end; ++t) m.threads[std::size_t(t)].at = place::running;
  return true;
}

// Runs the current block's threads to their end; throws what a thread threw, or
// emulation_error when its threads wait at barriers that cannot open. Lockstep:
// every pass runs each thread that can to its next barrier, so warps advance
// together. Warp-serial: a warp runs through its warp barriers up to a
// __syncthreads (or its end) before the next warp starts, so a warp that writes
// shared memory a later warp has yet to read (a missing __syncthreads beside
// warp-level ones) overwrites it first.
inline void run_block(machine& m, int count, bool reversed, bool warp_serial) {
  m.threads.resize(std::size_t(count));
  while (m.stacks.size() < m.threads.size()) m.stacks.push_back(std::make_unique_for_overwrite<char[]>(stack_bytes));
  for (auto& e : m.exchange) e.assign(std::size_t(count), 0);
  m.shuffles.assign(std::size_t(count), 0);
  for (std::size_t t = 0; t < m.threads.size(); ++t) {
    fiber& f = m.threads[t];
    prepare(f.ctx, m.stacks[t].get(), stack_bytes, thread_entry);
    f.at = place::running;
    f.open.clear();
    f.groups.clear();
  }
  m.reversed = reversed;
  const int warps = (count + warp_size - 1) / warp_size;
  const auto pass = [&](int only_warp) {  // the pass's first thread that can run; wait_at hands on from there
    m.only_warp = only_warp;
    for (int k = 0; k < count; ++k) {
      const int t = reversed ? count - 1 - k : k;
      if (m.threads[std::size_t(t)].at != place::running || (only_warp >= 0 && t / warp_size != only_warp)) continue;
      m.pass_position = k;
      m.current = t;
      m.thread = thread_index(m, t);
      switch_context(m.scheduler, m.threads[std::size_t(t)].ctx);
      if (m.failure) std::rethrow_exception(std::exchange(m.failure, nullptr));
    }
  };
  for (;;) {
    if (warp_serial)
      for (int k = 0; k < warps; ++k) {
        const int w = reversed ? warps - 1 - k : k;
        do pass(w);
        while (open_warp(m, w));
      }
    else
      pass(-1);
    int live = 0, at_block = 0;
    for (const fiber& f : m.threads) {
      live += f.at != place::done;
      at_block += f.at == place::block_barrier;
    }
    if (live == 0) return;
    if (at_block == live) {
      for (fiber& f : m.threads)
        if (f.at == place::block_barrier) f.at = place::running;
      continue;
    }
    bool opened = false;
    for (int w = 0; w < warps; ++w) opened = open_warp(m, w) || opened;
    if (!opened)
      throw emulation_error(block_name(m.block) + ": threads wait at barriers that cannot open: " +
                            std::to_string(at_block) + " at __syncthreads, " + std::to_string(live - at_block) +
                            " at warp barriers, " + std::to_string(count - live) + " exited");
  }
}

// A test's definition of a kernel's `extern __shared__` array (its dynamic shared
// memory), once per array. Launches that ask for dynamic shared memory fill every
// defined array with 0xFF before each block and check that none was written past the
// bytes asked; for a launch that asks for none, the arrays are filled before it and
// checked after it (once, not per block: the maps launch thousands of blocks).
inline void define_dynamic_shared(std::span<unsigned char> array) { the_machine().dynamic_shared.push_back(array); }

struct launch_options {
  bool reversed = false;      // blocks, and threads of a block, run last to first
  bool warp_serial = false;   // each warp runs up to a __syncthreads before the next starts (else lockstep)
  bool copies_at_issue = false;  // asynchronous copies land when issued, not when waited for
};

// kernel<<<grid, block, shared_bytes>>>(args...) on the CPU.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, launch_options o,
            const Args&... args) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || grid.x * grid.y * grid.z == 0)
    throw emulation_error("launch: blocks of 1 to 1024 threads and a grid of at least one block, got " +
                          std::to_string(block.x) + " x " + std::to_string(block.y) + " x " + std::to_string(block.z) +
                          " threads in " + std::to_string(grid.x) + " x " + std::to_string(grid.y) + " x " +
                          std::to_string(grid.z) + " blocks");
  machine& m = the_machine();
  const std::lock_guard<std::mutex> lock(m.one_launch);
  if (shared_bytes > 0 && m.dynamic_shared.empty())
    throw emulation_error("launch: " + std::to_string(shared_bytes) +
                          " bytes of dynamic shared memory asked, and the test defines no extern __shared__ array");
  for (const auto& array : m.dynamic_shared)
    if (shared_bytes > array.size())
      throw emulation_error("launch: " + std::to_string(shared_bytes) + " bytes of dynamic shared memory asked, " +
                            std::to_string(array.size()) + " defined");
  const std::function<void()> body = [&] { kernel(args...); };
  m.body = &body;
  m.copies_at_issue = o.copies_at_issue;
  m.grid_dim = grid;
  m.block_dim = block;
  const auto check_untouched = [&](std::size_t from, const std::string& who) {
    for (const auto& array : m.dynamic_shared)
      if (!std::all_of(array.begin() + std::ptrdiff_t(from), array.end(), [](unsigned char x) { return x == 0xFF; }))
        throw emulation_error(who + " wrote past its " + std::to_string(from) + " bytes of shared memory");
  };
  const auto fill = [&] {
    for (const auto& array : m.dynamic_shared) std::fill(array.begin(), array.end(), std::uint8_t(0xFF));
  };
  if (shared_bytes == 0) fill();
  const unsigned blocks = grid.x * grid.y * grid.z;
  for (unsigned k = 0; k < blocks; ++k) {
    const unsigned b = o.reversed ? blocks - 1 - k : k;
    m.block = {b % grid.x, b / grid.x % grid.y, b / grid.x / grid.y};
    if (shared_bytes > 0) fill();
    run_block(m, int(threads), o.reversed, o.warp_serial);
    if (shared_bytes > 0) check_untouched(shared_bytes, block_name(m.block));
  }
  if (shared_bytes == 0) check_untouched(0, "a launch of " + std::to_string(blocks) + " blocks");
  m.body = nullptr;
}

inline void require_full_warp(unsigned mask, const char* what) {
  if (mask != 0xFFFFFFFFu) throw emulation_error(std::string(what) + ": only full-warp masks are emulated");
}

// Every lane of the warp hands in a value and gets lane source(lane)'s.
template <class V, class Source>
V exchange(V v, Source source) {
  static_assert(sizeof(V) <= sizeof(std::uint64_t));
  // Odd and even shuffles use their own slots: a lane writes the slot of this parity
  // again only after the next shuffle's barrier, which every lane reaches after reading.
  machine& m = the_machine();
  const int me = m.current, lane = me % warp_size;
  std::vector<std::uint64_t>& slots = m.exchange[m.shuffles[std::size_t(me)]++ % 2];
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  slots[std::size_t(me)] = bits;
  wait_at(place::warp_barrier, warp_sync::shuffle);
  V r;
  std::memcpy(&r, &slots[std::size_t(me - lane + source(lane))], sizeof(V));
  return r;
}

// cp.async: a copy lands at one of its two extremes, when its thread waits for its
// group (a thread that reads the destination before that wait, or before the barrier
// after every thread's wait, reads what was there before), or when it is issued (a
// copy into a buffer another thread still reads overwrites it at once).
inline void land(const pending_copy& c) {
  std::memcpy(c.to, c.from, c.bytes - c.zeros);
  std::memset(static_cast<char*>(c.to) + (c.bytes - c.zeros), 0, c.zeros);
}
inline void copy_async(void* to, const void* from, std::size_t bytes, std::size_t zeros) {
  const auto address = [](const void* q) { return reinterpret_cast<std::uintptr_t>(q); };
  if ((bytes != 4 && bytes != 8 && bytes != 16) || zeros > bytes || address(to) % bytes || address(from) % bytes)
    throw emulation_error("__pipeline_memcpy_async: 4, 8 or 16 bytes, aligned to their size, got " +
                          std::to_string(bytes) + " bytes at offsets " + std::to_string(address(to) % 16) + " and " +
                          std::to_string(address(from) % 16) + " of 16");
  machine& m = the_machine();
  const auto in_shared = [&](const void* q) {
    return std::any_of(m.dynamic_shared.begin(), m.dynamic_shared.end(), [&](std::span<unsigned char> a) {
      return address(q) >= address(a.data()) && address(q) < address(a.data() + a.size());
    });
  };
  if (!in_shared(to) || in_shared(from))
    throw emulation_error("__pipeline_memcpy_async: copies from global to shared memory only");
  if (m.copies_at_issue) land({to, from, bytes, zeros});
  else m.threads[std::size_t(m.current)].open.push_back({to, from, bytes, zeros});
}
inline void commit_copies() {
  fiber& f = the_machine().threads[std::size_t(the_machine().current)];
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
inline void wait_copies(std::size_t prior) {
  fiber& f = the_machine().threads[std::size_t(the_machine().current)];
  while (f.groups.size() > prior) {
    for (const pending_copy& c : f.groups.front()) land(c);
    f.groups.erase(f.groups.begin());
  }
}

inline float to_float(float x) { return x; }
inline float to_float(__nv_bfloat16 x) { return std::bit_cast<float>(std::uint32_t(x.bits) << 16); }
inline float to_float(__half x) { return float(std::bit_cast<_Float16>(x.bits)); }

}  // namespace cuda_emulator

inline const uint3& threadIdx = cuda_emulator::the_machine().thread;
inline const uint3& blockIdx = cuda_emulator::the_machine().block;
inline const dim3& blockDim = cuda_emulator::the_machine().block_dim;
inline const dim3& gridDim = cuda_emulator::the_machine().grid_dim;

inline void __syncthreads() { cuda_emulator::wait_at(cuda_emulator::place::block_barrier); }
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  cuda_emulator::require_full_warp(mask, "__syncwarp");
  cuda_emulator::wait_at(cuda_emulator::place::warp_barrier);
}
template <class V>
V __shfl_xor_sync(unsigned mask, V v, int lane_mask) {
  cuda_emulator::require_full_warp(mask, "__shfl_xor_sync");
  return cuda_emulator::exchange(v, [&](int lane) { return lane ^ lane_mask; });
}
template <class V>
V __shfl_sync(unsigned mask, V v, int source) {
  cuda_emulator::require_full_warp(mask, "__shfl_sync");
  return cuda_emulator::exchange(v, [&](int) { return source % cuda_emulator::warp_size; });
}
inline int __any_sync(unsigned mask, int predicate) {  // an OR over the warp, by its shuffles
  cuda_emulator::require_full_warp(mask, "__any_sync");
  int any = predicate != 0;
  for (int x = 1; x < cuda_emulator::warp_size; x *= 2)
    any |= cuda_emulator::exchange(any, [&](int lane) { return lane ^ x; });
  return any;
}
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
// CUDA's math headers declare these in the global namespace.
using std::isfinite;
using std::isinf;
using std::isnan;
// Threads run one at a time: an atomic is a plain read-modify-write.
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  if (v < old) *p = v;
  return old;
}
[[noreturn]] inline void __trap() { throw cuda_emulator::emulation_error("__trap() reached"); }
// Does not sleep: the time is added to how long the launch's stream stays busy after the
// launch returns (cuda_runtime_api.hpp), as a GPU's stream would be (summed over threads).
namespace cuda_emulator {
inline std::chrono::nanoseconds& launch_sleep() {  // of the launch this OS thread is running
  thread_local std::chrono::nanoseconds slept{0};
  return slept;
}
}  // namespace cuda_emulator
inline void __nanosleep(unsigned ns) { cuda_emulator::launch_sleep() += std::chrono::nanoseconds(ns); }
