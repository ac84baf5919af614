// tests/emulated/cuda_runtime_api.hpp — the host side of CUDA's runtime that the
// library's device code calls, for the emulated tests: four devices whose memory
// is host memory, kernel launches through the typed cudaLaunchKernelEx
// (ops::cuda::launch_kernel), each running to its end before it returns
// (cuda_emulator.hpp), so streams and events order nothing. They only time: a kernel's
// __nanosleep calls keep its stream busy for that long after the launch returns (its
// effects are all there at once), and events recorded behind it are not ready until then,
// so code that asks whether another stream's work is done (the caching allocator's
// record_stream) meets "not yet"; synchronising waits it out.
//
// Device memory comes 256-byte aligned (as cudaMalloc's) and filled with 0xFF
// bytes (NaN), so a kernel that reads what nobody wrote shows; the runtime keeps
// its allocations, so cudaPointerGetAttributes tells device memory (and whose) from
// pinned and from other host memory, and cudaFree of what it did not allocate fails.
// Each device has 80 GiB: cudaMalloc beyond what is left fails, as cudaMemGetInfo says.
// Errors are returned and kept for cudaGetLastError as the runtime does. The devices are
// sm_90 ones: a launch may take 48 KiB of dynamic shared memory, and up to 227 KiB for a
// kernel opted in on that device (cudaFuncSetAttribute); dynamic shared memory is the
// `extern __shared__` arrays a test defines (cuda_emulator::define_dynamic_shared).
#pragma once
#include "cuda_emulator.hpp"

#include <algorithm>    // std::max
#include <atomic>       // std::atomic
#include <chrono>       // std::chrono::steady_clock
#include <cstddef>      // std::size_t
#include <cstdlib>      // std::aligned_alloc, std::free
#include <cstring>      // std::memcpy, std::memset
#include <map>          // std::map
#include <mutex>        // std::mutex, std::lock_guard
#include <string>       // std::to_string
#include <thread>       // std::this_thread::sleep_until
#include <type_traits>  // std::is_pointer_v
#include <utility>      // std::forward

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidPitchValue = 12,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
inline constexpr unsigned cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2, cudaHostAllocDefault = 0;

// Streams and events belong to the device current when they were made: CUDA refuses to
// record an event, or launch a kernel, into a stream of another device than the event's
// or the current one (a thread's current device starts at 0, whatever a rank's is).
struct CUstream_st {
  std::chrono::steady_clock::time_point busy_until{};  // the end of its kernels' __nanosleep time
  int device = 0;
};
struct CUevent_st {
  std::chrono::steady_clock::time_point ready_at{};  // when the work recorded before it ends
  bool timing = true, recorded = false;               // what cudaEventElapsedTime requires
  int device = 0;
};
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;

struct cudaLaunchAttribute {};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  std::size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
  cudaLaunchAttribute* attrs = nullptr;
  unsigned numAttrs = 0;
};

namespace cuda_emulator {
inline cudaError_t& last_error() {
  thread_local cudaError_t e = cudaSuccess;
  return e;
}
inline cudaError_t fail(cudaError_t e) { return last_error() = e; }
inline constexpr int device_count = 4;  // a node's worth, so that one rank per device runs too
inline constexpr std::size_t device_memory = std::size_t(80) << 30;
inline int& current_device() {
  thread_local int d = 0;
  return d;
}
// What an allocation of `bytes` takes: whole 256-byte units, at least one.
inline std::size_t footprint(std::size_t bytes) { return (bytes == 0 ? 256 : (bytes + 255) / 256 * 256); }
}  // namespace cuda_emulator

inline cudaError_t cudaGetLastError() { return std::exchange(cuda_emulator::last_error(), cudaSuccess); }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidPitchValue: return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
  }
  return "an unknown cudaError_t";
}
inline const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = cuda_emulator::device_count;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = cuda_emulator::current_device();
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= cuda_emulator::device_count) return cuda_emulator::fail(cudaErrorInvalidDevice);
  cuda_emulator::current_device() = device;
  return cudaSuccess;
}
namespace cuda_emulator {
using time_point = std::chrono::steady_clock::time_point;
inline std::mutex& time_mutex() {  // guards the streams' and events' times
  static auto* m = new std::mutex;
  return *m;
}
inline CUstream_st& stream_of(cudaStream_t s) {  // nullptr: the default stream
  static auto* default_stream = new CUstream_st;
  return s ? *s : *default_stream;
}
// The device whose stream s is (the default stream: the current device's).
inline int device_of(cudaStream_t s) { return s ? s->device : current_device(); }
inline time_point& all_streams_done() {
  static time_point t{};
  return t;
}
// Waits until the time `t` holds (read under time_mutex).
inline void wait_until(const time_point& t) {
  time_point until;
  {
    const std::lock_guard<std::mutex> lock(time_mutex());
    until = t;
  }
  std::this_thread::sleep_until(until);
}
}  // namespace cuda_emulator

inline cudaError_t cudaDeviceSynchronize() {
  cuda_emulator::wait_until(cuda_emulator::all_streams_done());
  return cudaSuccess;
}

enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3,
};
struct cudaPointerAttributes {
  cudaMemoryType type = cudaMemoryTypeUnregistered;
  int device = -2;
  void* devicePointer = nullptr;
  void* hostPointer = nullptr;
};

namespace cuda_emulator {
// What the runtime allocated, so that cudaPointerGetAttributes tells device memory
// from pinned and from any other host memory.
struct allocation {
  std::size_t bytes;
  cudaMemoryType type;
  int device;
};
// Never destroyed: caching allocators free their blocks in static destructors.
inline std::mutex& allocations_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
inline std::map<const char*, allocation>& allocations() {
  static auto* a = new std::map<const char*, allocation>;
  return *a;
}
inline std::size_t (&device_bytes_used())[device_count] {  // under allocations_mutex
  static std::size_t used[device_count] = {};
  return used;
}
inline cudaError_t allocate(void** p, std::size_t bytes, cudaMemoryType type) {
  const std::size_t n = footprint(bytes);
  const int device = current_device();
  const std::size_t charged = type == cudaMemoryTypeDevice ? n : 0;
  {  // charged before the allocation, so that two threads cannot both take the last bytes
    const std::lock_guard<std::mutex> lock(allocations_mutex());
    if (charged > device_memory - device_bytes_used()[device]) return fail(cudaErrorMemoryAllocation);
    device_bytes_used()[device] += charged;
  }
  *p = std::aligned_alloc(256, n);
  const std::lock_guard<std::mutex> lock(allocations_mutex());
  if (!*p) {
    device_bytes_used()[device] -= charged;
    return fail(cudaErrorMemoryAllocation);
  }
  std::memset(*p, 0xFF, n);
  allocations()[static_cast<const char*>(*p)] = {bytes, type, device};
  return cudaSuccess;
}
inline cudaError_t release(void* p, cudaMemoryType type) {
  if (!p) return cudaSuccess;
  {
    const std::lock_guard<std::mutex> lock(allocations_mutex());
    const auto it = allocations().find(static_cast<const char*>(p));
    if (it == allocations().end() || it->second.type != type) return fail(cudaErrorInvalidValue);
    if (type == cudaMemoryTypeDevice)
      device_bytes_used()[it->second.device] -= footprint(it->second.bytes);
    allocations().erase(it);
  }
  std::free(p);
  return cudaSuccess;
}

// The allocation p points into (an empty one: its address), or null; under allocations_mutex.
inline const allocation* allocation_of(const void* p) {
  const auto* c = static_cast<const char*>(p);
  auto it = allocations().upper_bound(c);
  if (it == allocations().begin()) return nullptr;
  --it;
  const bool inside = c < it->first + it->second.bytes || (it->second.bytes == 0 && c == it->first);
  return inside ? &it->second : nullptr;
}
// The device whose memory p points into, or -1 (pinned or other host memory, or a pointer
// past its allocation's end).
inline int memory_device(const void* p) {
  const std::lock_guard<std::mutex> lock(allocations_mutex());
  const allocation* a = allocation_of(p);
  return a && a->type == cudaMemoryTypeDevice ? a->device : -1;
}
// A kernel launched on `device` reading or writing another device's memory faults on a GPU
// (without peer access, which the library never enables): checked for the pointer and span
// parameters (pointers inside structures are not seen).
template <class P>
void check_argument_device(const P& arg, int device, int index) {
  const void* p = nullptr;
  if constexpr (std::is_pointer_v<P>) p = const_cast<const void*>(static_cast<const volatile void*>(arg));
  else if constexpr (requires { arg.data(); arg.size(); }) p = arg.size() ? arg.data() : nullptr;
  if (!p) return;
  if (const int owner = memory_device(p); owner >= 0 && owner != device)
    throw emulation_error("a kernel launched on device " + std::to_string(device) + " was given device " +
                          std::to_string(owner) + "'s memory (parameter " + std::to_string(index) + ")");
}
}  // namespace cuda_emulator

inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  return cuda_emulator::allocate(p, bytes, cudaMemoryTypeDevice);
}
template <class T>
cudaError_t cudaMalloc(T** p, std::size_t bytes) {
  void* v = nullptr;
  const cudaError_t e = cudaMalloc(&v, bytes);
  *p = static_cast<T*>(v);
  return e;
}
inline cudaError_t cudaFree(void* p) { return cuda_emulator::release(p, cudaMemoryTypeDevice); }
inline cudaError_t cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  const std::lock_guard<std::mutex> lock(cuda_emulator::allocations_mutex());
  *total_bytes = cuda_emulator::device_memory;
  *free_bytes = cuda_emulator::device_memory - cuda_emulator::device_bytes_used()[cuda_emulator::current_device()];
  return cudaSuccess;
}
inline cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
  return cuda_emulator::allocate(p, bytes, cudaMemoryTypeHost);
}
// Mapped pinned memory: the device reaches it at the same address (unified addressing).
inline constexpr unsigned cudaHostAllocMapped = 2;
inline cudaError_t cudaHostAlloc(void** p, std::size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
template <class T>
cudaError_t cudaHostAlloc(T** p, std::size_t bytes, unsigned flags) {
  void* v = nullptr;
  const cudaError_t e = cudaHostAlloc(&v, bytes, flags);
  *p = static_cast<T*>(v);
  return e;
}
inline cudaError_t cudaFreeHost(void* p) { return cuda_emulator::release(p, cudaMemoryTypeHost); }
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  *a = {};
  const std::lock_guard<std::mutex> lock(cuda_emulator::allocations_mutex());
  const cuda_emulator::allocation* found = cuda_emulator::allocation_of(p);
  if (!found) return cudaSuccess;
  a->type = found->type;
  a->device = found->device;
  a->devicePointer = a->hostPointer = const_cast<void*>(p);
  return cudaSuccess;
}

inline cudaError_t cudaMemcpy(void* to, const void* from, std::size_t bytes, cudaMemcpyKind) {
  if (bytes) std::memcpy(to, from, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* to, const void* from, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  return cudaMemcpy(to, from, bytes, kind);
}
// As CUDA's: `height` rows of `width` bytes, rows `spitch` and `dpitch` bytes apart
// (each at least `width`, else cudaErrorInvalidPitchValue); counted in copies_2d.
namespace cuda_emulator {
inline std::atomic<long> copies_2d = 0;
}  // namespace cuda_emulator
inline cudaError_t cudaMemcpy2DAsync(void* to, std::size_t dpitch, const void* from, std::size_t spitch,
                                     std::size_t width, std::size_t height, cudaMemcpyKind, cudaStream_t) {
  if (width > dpitch || width > spitch) return cuda_emulator::fail(cudaErrorInvalidPitchValue);
  ++cuda_emulator::copies_2d;
  for (std::size_t r = 0; r < height && width; ++r)
    std::memcpy(static_cast<char*>(to) + r * dpitch, static_cast<const char*>(from) + r * spitch, width);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int byte, std::size_t bytes, cudaStream_t) {
  if (bytes) std::memset(p, byte, bytes);
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned, int) {
  *s = new CUstream_st{.device = cuda_emulator::current_device()};
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  cuda_emulator::wait_until(cuda_emulator::stream_of(s).busy_until);
  return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  const std::lock_guard<std::mutex> lock(cuda_emulator::time_mutex());
  auto& busy = cuda_emulator::stream_of(s).busy_until;
  busy = std::max(busy, e->ready_at);
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  *e = new CUevent_st{.device = cuda_emulator::current_device()};
  (*e)->timing = !(flags & cudaEventDisableTiming);
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (e->device != cuda_emulator::device_of(s)) return cuda_emulator::fail(cudaErrorInvalidResourceHandle);
  const std::lock_guard<std::mutex> lock(cuda_emulator::time_mutex());
  // The work before it has run (launches return when their kernels have) but for its sleeps.
  e->ready_at = std::max(std::chrono::steady_clock::now(), cuda_emulator::stream_of(s).busy_until);
  e->recorded = true;
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) {  // not ready is no error: nothing kept for cudaGetLastError
  const std::lock_guard<std::mutex> lock(cuda_emulator::time_mutex());
  return std::chrono::steady_clock::now() >= e->ready_at ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  cuda_emulator::wait_until(e->ready_at);
  return cudaSuccess;
}
// The host's time between the two records: kernels run on the CPU when launched. Not
// ready (either event) is no error, as for cudaEventQuery.
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!start->timing || !end->timing || !start->recorded || !end->recorded)
    return cuda_emulator::fail(cudaErrorInvalidResourceHandle);
  const std::lock_guard<std::mutex> lock(cuda_emulator::time_mutex());
  if (std::chrono::steady_clock::now() < std::max(start->ready_at, end->ready_at)) return cudaErrorNotReady;
  *ms = std::chrono::duration<float, std::milli>(end->ready_at - start->ready_at).count();
  return cudaSuccess;
}

namespace cuda_emulator {
inline constexpr std::size_t default_dynamic_shared = 48 * 1024;  // without the opt-in
// The dynamic shared memory a kernel may take on a device (cudaFuncSetAttribute); never
// destroyed, as the allocations: static destructors may still launch.
inline std::size_t& dynamic_shared_allowed(const void* kernel, int device) {
  static auto* allowed = new std::map<std::pair<const void*, int>, std::size_t>;  // under dynamic_shared_mutex
  return allowed->try_emplace({kernel, device}, default_dynamic_shared).first->second;
}
inline std::mutex& dynamic_shared_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
// The kernel launches between cudaProfilerStart and cudaProfilerStop (include/cuda_profiler_api.h),
// as a profiler started with capture off would record them; -1 while not recording.
inline std::atomic<long>& profiled_launches() {
  static std::atomic<long> n{-1};
  return n;
}
}  // namespace cuda_emulator

// The launch runs the whole grid before it returns; what a kernel throws (an
// emulation_error, __trap) comes out of here. Each kernel's launches alternate
// between two schedules: blocks and threads first to last in lockstep, and last
// to first warp by warp (cuda_emulator::run_block), so that a result that depends
// on their order (a missing barrier) is wrong in one of them. The arguments
// convert to the kernel's parameters as CUDA's typed launch converts them.
template <class... Params, class... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...), Args&&... args) {
  const dim3 g = config->gridDim, b = config->blockDim;
  if (b.x * b.y * b.z == 0 || b.x * b.y * b.z > 1024 || g.x * g.y * g.z == 0 || g.y > 65535 || g.z > 65535)
    return cuda_emulator::fail(cudaErrorInvalidConfiguration);
  if (cuda_emulator::device_of(config->stream) != cuda_emulator::current_device())
    return cuda_emulator::fail(cudaErrorInvalidResourceHandle);
  {
    const std::lock_guard<std::mutex> lock(cuda_emulator::dynamic_shared_mutex());
    if (config->dynamicSmemBytes > cuda_emulator::dynamic_shared_allowed(reinterpret_cast<const void*>(kernel),
                                                                         cuda_emulator::current_device()))
      return cuda_emulator::fail(cudaErrorInvalidValue);
  }
  static std::mutex guard;  // ranks are threads
  static std::map<void (*)(Params...), bool> next_reversed;
  cuda_emulator::launch_options o;
  {
    const std::lock_guard<std::mutex> lock(guard);
    bool& reversed = next_reversed[kernel];
    o = {.reversed = reversed, .warp_serial = reversed};
    reversed = !reversed;
  }
  cuda_emulator::launch_sleep() = {};
  for (long n = cuda_emulator::profiled_launches(); n >= 0;)  // counted only while recording
    if (cuda_emulator::profiled_launches().compare_exchange_weak(n, n + 1)) break;
  [&](Params... converted) {
    int index = 0;
    (cuda_emulator::check_argument_device(converted, cuda_emulator::current_device(), index++), ...);
    cuda_emulator::launch(kernel, g, b, config->dynamicSmemBytes, o, converted...);
  }(std::forward<Args>(args)...);
  if (const auto slept = std::exchange(cuda_emulator::launch_sleep(), {}); slept.count() > 0) {
    const std::lock_guard<std::mutex> lock(cuda_emulator::time_mutex());
    auto& busy = cuda_emulator::stream_of(config->stream).busy_until;
    busy = std::max(busy, std::chrono::steady_clock::now()) +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(slept);
    cuda_emulator::all_streams_done() = std::max(cuda_emulator::all_streams_done(), busy);
  }
  return cudaSuccess;
}

// The device's and kernels' facts (shardlib/cuda/kernel_facts.hpp): an sm_90 GPU, kernels
// built for compute_90, dynamic shared memory beyond 48 KiB for a kernel opted in.
enum cudaDeviceAttr { cudaDevAttrComputeCapabilityMajor = 75, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaFuncAttributes {
  int maxDynamicSharedSizeBytes = 0;
  int ptxVersion = 0;
};
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device < 0 || device >= cuda_emulator::device_count) return cuda_emulator::fail(cudaErrorInvalidDevice);
  *value = attribute == cudaDevAttrComputeCapabilityMajor ? 9 : int(cuda_emulator::shared_capacity);
  return cudaSuccess;
}
struct cudaDeviceProp {
  char name[256];
  std::size_t totalGlobalMem;
  std::size_t sharedMemPerBlockOptin;
  int major, minor, multiProcessorCount;
};
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (device < 0 || device >= cuda_emulator::device_count) return cuda_emulator::fail(cudaErrorInvalidDevice);
  *p = {.name = "emulated sm_90",
        .totalGlobalMem = cuda_emulator::device_memory,
        .sharedMemPerBlockOptin = cuda_emulator::shared_capacity,
        .major = 9,
        .minor = 0,
        .multiProcessorCount = 132};
  return cudaSuccess;
}
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, const void* kernel) {
  const std::lock_guard<std::mutex> lock(cuda_emulator::dynamic_shared_mutex());
  *a = {.maxDynamicSharedSizeBytes =
            int(cuda_emulator::dynamic_shared_allowed(kernel, cuda_emulator::current_device())),
        .ptxVersion = 90};
  return cudaSuccess;
}
inline cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      std::size_t(value) > cuda_emulator::shared_capacity)
    return cuda_emulator::fail(cudaErrorInvalidValue);
  const std::lock_guard<std::mutex> lock(cuda_emulator::dynamic_shared_mutex());
  cuda_emulator::dynamic_shared_allowed(kernel, cuda_emulator::current_device()) = std::size_t(value);
  return cudaSuccess;
}
