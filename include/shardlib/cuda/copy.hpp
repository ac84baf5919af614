// shardlib/cuda/copy.hpp — asynchronous copies and fills between memory spaces, and host tensors to the device.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // require, shape_error
#include "shardlib/core/tensor.hpp"  // Tensor
#include "shardlib/cuda/current.hpp"  // current_stream
#include "shardlib/cuda/error.hpp"  // check
#include "shardlib/cuda/memory_space.hpp"  // cuda_space

#include <cuda_runtime.h>

#include <cstddef>      // std::size_t
#include <span>         // std::span
#include <type_traits>  // std::type_identity_t

namespace shardlib::cuda {

// dst = src, ordered on `stream`, between any two of device, pinned and host
// memory (unified addressing tells the direction). Asynchronous for device and
// pinned memory; a pageable host buffer makes CUDA stage the copy, which
// returns only once the source has been read: from the device into pageable
// memory, once the stream has reached the copy and it is done (a wait).
template <class T>
void copy_async(std::span<T> dst, std::span<const std::type_identity_t<T>> src, cudaStream_t stream) {
  require<shape_error>(dst.size() == src.size(), "cuda::copy_async: destination has ", dst.size(),
                       " elements, source ", src.size());
  if (dst.empty()) return;
  check(cudaMemcpyAsync(dst.data(), src.data(), dst.size_bytes(), cudaMemcpyDefault, stream), "cudaMemcpyAsync(",
        dst.size_bytes(), " bytes)");
}

// Every byte of dst set to `byte`, ordered on `stream` (0 gives zeros for
// every element type; 0xFF gives NaN for floating types, to poison buffers).
template <class T>
void fill_bytes_async(std::span<T> dst, unsigned char byte, cudaStream_t stream) {
  if (dst.empty()) return;
  check(cudaMemsetAsync(dst.data(), byte, dst.size_bytes(), stream), "cudaMemsetAsync(", dst.size_bytes(), " bytes)");
}

// A host tensor's copy in device memory, ordered on the current stream (the
// host tensor may go once this returns: a pageable source is staged).
template <class T>
Tensor<T, cuda_space> to_device(const Tensor<T>& host) {
  Tensor<T, cuda_space> d(host.shape());
  copy_async(d.span(), std::span<const T>(host.span()), current_stream());
  return d;
}

}  // namespace shardlib::cuda
