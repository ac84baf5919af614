// shardlib/cuda/current.hpp — the calling thread's current stream and cuBLAS
// handle: where layers run their work, since the Layer concept passes no stream.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/cuda/blas.hpp"    // blas
#include "shardlib/cuda/error.hpp"   // current_device
#include "shardlib/cuda/stream.hpp"  // device_guard

#include <cuda_runtime.h>

#include <map>      // std::map
#include <utility>  // std::exchange

namespace shardlib::cuda {

namespace detail {
inline cudaStream_t& current_stream_slot() {
  thread_local cudaStream_t s = nullptr;  // the legacy default stream until a scope sets one
  return s;
}
}  // namespace detail

// As PyTorch's current stream: device tensors (Tensor<T, cuda_space>) are
// allocated for it, and device layers launch on it. Per thread.
inline cudaStream_t current_stream() { return detail::current_stream_slot(); }

// Makes `s` the thread's current stream for the scope, then restores the previous one.
class stream_scope {
 public:
  explicit stream_scope(cudaStream_t s) : previous_(std::exchange(detail::current_stream_slot(), s)) {}
  ~stream_scope() { detail::current_stream_slot() = previous_; }
  stream_scope(const stream_scope&) = delete;
  stream_scope& operator=(const stream_scope&) = delete;

 private:
  cudaStream_t previous_;
};

// The thread's cuBLAS handle for its current device (made on first use; a
// handle is not to be shared between threads). ops::cuda::gemm takes it with a stream.
inline const blas& current_blas() {
  thread_local std::map<int, blas> handles;
  const int d = current_device();
  auto it = handles.find(d);
  if (it == handles.end()) it = handles.emplace(d, blas(d)).first;
  return it->second;
}

}  // namespace shardlib::cuda
