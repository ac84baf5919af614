// shardlib/ops/cuda/index_report.hpp — index_report: where kernels report the
// first bad input they meet, since a kernel cannot throw.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"               // category
#include "shardlib/core/pending.hpp"              // count_host_sync
#include "shardlib/cuda/caching_allocator.hpp"    // device_buffer
#include "shardlib/cuda/copy.hpp"                 // copy_async, fill_bytes_async
#include "shardlib/cuda/error.hpp"                // check

#include <cuda_runtime.h>

#include <cstdint>     // std::int64_t
#include <functional>  // std::function
#include <optional>    // std::optional
#include <span>      // std::span

namespace shardlib::ops::cuda {

// One device word that ops which validate their input on the device (targets
// of cross_entropy, ids of embedding_forward) lower to the smallest bad index
// with atomicMin. Reading it waits for the stream, so a layer reads it where it
// synchronises anyway (cross-entropy: when its loss is read) and throws its own message.
class index_report {
 public:
  explicit index_report(cudaStream_t stream)
      : slot_(1, category::activations, stream) {
    reset(stream);
  }

  unsigned long long* slot() const { return slot_.data(); }

  void reset(cudaStream_t stream) { shardlib::cuda::fill_bytes_async(slot_.span(), 0xFF, stream); }

  // The smallest index reported since the last reset, once the work on
  // `stream` so far has finished; nullopt when there was none. before_wait runs
  // after the report's copy is issued and before the one wait, so that a caller's
  // own copies on `stream` complete in the same wait.
  std::optional<std::int64_t> read(cudaStream_t stream, const std::function<void()>& before_wait = {}) {
    // Into pageable memory: the read waits for the stream anyway, and pinned memory
    // (cudaMallocHost/cudaFreeHost per report) would synchronise the whole device.
    unsigned long long host = 0;
    shardlib::cuda::copy_async(std::span<unsigned long long>(&host, 1), std::span<const unsigned long long>(slot_.span()),
                               stream);
    if (before_wait) before_wait();
    count_host_sync();
    shardlib::cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (reading an index_report)");
    if (host == ~0ULL) return std::nullopt;
    return static_cast<std::int64_t>(host);
  }

 private:
  shardlib::cuda::device_buffer<unsigned long long> slot_;
};

}  // namespace shardlib::ops::cuda
