// shardlib/cuda/blas_lt.hpp — blas_lt: an owned cuBLASLt handle for one device,
// with the algorithms its heuristic chose per problem, and current_blas_lt().
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/cuda/caching_allocator.hpp"  // device_allocator
#include "shardlib/cuda/error.hpp"              // check, current_device
#include "shardlib/cuda/stream.hpp"             // device_guard

#include <cublasLt.h>

#include <array>    // std::array
#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t
#include <map>      // std::map
#include <utility>  // std::exchange

namespace shardlib::cuda {

// What decides cuBLASLt's choice of algorithm for a matmul (ops::cuda::gemm_lt
// fills it): transposes, sizes, leading dimensions, types, epilogue and the
// alignment of every pointer the heuristic looks at.
using lt_problem = std::array<std::int64_t, 16>;

// The heuristic's answer for one problem: an algorithm and the workspace it
// needs, or none (then the caller falls back to cuBLAS plus kernels).
struct lt_choice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
};

// A cuBLASLt handle, like blas: tied to the device current when it was made,
// one per device and thread (the answers it caches are not locked). The
// stream is named per call. Querying the heuristic costs tens of microseconds,
// so each problem asks once.
class blas_lt {
 public:
  // Workspace the heuristic may plan with (NVIDIA suggests 32 MiB on Hopper);
  // a call takes from the caching allocator only what its algorithm needs.
  static constexpr std::size_t max_workspace = std::size_t(32) << 20;

  explicit blas_lt(int device) : device_(device) {
    device_guard g(device);
    check(cublasLtCreate(&h_), "cublasLtCreate");
  }
  blas_lt(blas_lt&& o) noexcept
      : h_(std::exchange(o.h_, nullptr)), device_(o.device_), choices_(std::move(o.choices_)) {}
  blas_lt& operator=(blas_lt&& o) noexcept {
    std::swap(h_, o.h_);
    std::swap(device_, o.device_);
    std::swap(choices_, o.choices_);
    return *this;
  }
  blas_lt(const blas_lt&) = delete;
  blas_lt& operator=(const blas_lt&) = delete;
  ~blas_lt() {
    if (h_) (void)cublasLtDestroy(h_);
  }

  cublasLtHandle_t get() const { return h_; }
  int device() const { return device_; }

  // The cached choice for `p`, computed by ask() the first time.
  template <class Ask>
  const lt_choice& choice(const lt_problem& p, Ask&& ask) const {
    auto it = choices_.find(p);
    if (it == choices_.end()) it = choices_.emplace(p, ask()).first;
    return it->second;
  }
  // `p` has no algorithm after all (cublasLtMatmul refused the heuristic's).
  void refuse(const lt_problem& p) const { choices_[p] = lt_choice{}; }

 private:
  cublasLtHandle_t h_ = nullptr;
  int device_ = 0;
  mutable std::map<lt_problem, lt_choice> choices_;
};

// The thread's cuBLASLt handle for its current device (made on first use), as current_blas().
inline const blas_lt& current_blas_lt() {
  thread_local std::map<int, blas_lt> handles;
  const int d = current_device();
  auto it = handles.find(d);
  if (it == handles.end()) it = handles.emplace(d, blas_lt(d)).first;
  return it->second;
}

// A matmul's workspace from the device's caching allocator, for work on one
// stream, returned (stream-ordered) when it goes out of scope. Not recorded in
// the ledger: like cuBLAS's own workspace it is no part of the model's memory.
class lt_workspace {
 public:
  lt_workspace(std::size_t bytes, cudaStream_t stream)
      : alloc_(&device_allocator(current_device())), p_(alloc_->allocate_unrecorded(bytes, stream)), bytes_(bytes) {}
  lt_workspace(const lt_workspace&) = delete;
  lt_workspace& operator=(const lt_workspace&) = delete;
  ~lt_workspace() { alloc_->deallocate(p_); }

  void* data() const { return p_; }
  std::size_t bytes() const { return bytes_; }

 private:
  caching_allocator* alloc_;
  void* p_;
  std::size_t bytes_;
};

}  // namespace shardlib::cuda
