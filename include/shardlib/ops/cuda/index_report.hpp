// shardlib/ops/cuda/index_report.hpp — index_report: where kernels report the
// first bad input they meet, since a kernel cannot throw; deferred_index_report
// and this thread's list of them, read with the next device loss.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/ledger.hpp"               // category
#include "shardlib/core/pending.hpp"              // count_host_sync
#include "shardlib/cuda/caching_allocator.hpp"    // device_buffer
#include "shardlib/cuda/copy.hpp"                 // copy_async, fill_bytes_async
#include "shardlib/cuda/current.hpp"              // current_stream
#include "shardlib/cuda/error.hpp"                // check
#include "shardlib/cuda/stream.hpp"               // event
#include "shardlib/ops/cuda/deferred_reports.hpp"  // deferred_reports

#include <cuda_runtime.h>

#include <cstdint>     // std::int64_t
#include <functional>  // std::function
#include <memory>      // std::shared_ptr, std::make_shared
#include <optional>    // std::optional
#include <span>        // std::span
#include <utility>     // std::move

namespace shardlib::ops::cuda {

// One device word that ops which validate their input on the device (targets
// of cross_entropy, ids of embedding_forward) lower to the smallest bad index
// with atomicMin. Reading it waits for the stream, so a layer reads it where it
// synchronises anyway and throws its own message: cross-entropy when its loss is
// read, the Embedding through deferred_index_report with the next loss read.
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
    copy_to_host(stream);
    if (before_wait) before_wait();
    count_host_sync();
    shardlib::cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (reading an index_report)");
    return found();
  }

  // read() in two halves around a wait the caller does: the copy to the host on
  // `stream` (ordered after the kernels that report), then, once `stream` has been
  // waited for, the index found.
  void copy_to_host(cudaStream_t stream) {
    // Into pageable memory: the read waits for the stream anyway, and pinned memory
    // (cudaMallocHost/cudaFreeHost per report) would synchronise the whole device.
    host_ = ~0ULL;
    shardlib::cuda::copy_async(std::span<unsigned long long>(&host_, 1),
                               std::span<const unsigned long long>(slot_.span()), stream);
  }
  std::optional<std::int64_t> found() const {
    if (host_ == ~0ULL) return std::nullopt;
    return static_cast<std::int64_t>(host_);
  }

  // `stream` reads the slot too: its memory is not reused before that stream's read.
  void record_stream(cudaStream_t stream) { slot_.record_stream(stream); }

 private:
  shardlib::cuda::device_buffer<unsigned long long> slot_;
  unsigned long long host_ = ~0ULL;  // where copy_to_host puts the slot
};

// An index_report a layer does not wait for: an event after its kernels (so that
// any stream can read it later, even once the layer's stream is gone) and the
// layer's error for a bad index (raise: throws it, given the flat position; it may
// read the layer's input again, a second wait on the error path only).
class deferred_index_report {
 public:
  using raiser = std::function<void(std::int64_t position)>;

  deferred_index_report(std::shared_ptr<index_report> report, cudaStream_t made_on, raiser raise)
      : report_(std::move(report)), done_(std::make_shared<shardlib::cuda::event>()), raise_(std::move(raise)) {
    done_->record(made_on);
  }

  // The copy to the host on `reader`, after the layer's kernels; raise_if_bad() once
  // `reader` has been waited for.
  void copy_to_host(cudaStream_t reader) {
    done_->make_wait(reader);
    report_->record_stream(reader);
    report_->copy_to_host(reader);
  }
  void raise_if_bad() const {
    if (const auto at = report_->found()) raise_(*at);
  }
  // Alone: one wait for the current stream (deferred_reports' bound).
  void check() {
    const cudaStream_t s = shardlib::cuda::current_stream();
    copy_to_host(s);
    count_host_sync();
    shardlib::cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize (reading a deferred index_report)");
    raise_if_bad();
  }

 private:
  std::shared_ptr<index_report> report_;
  std::shared_ptr<shardlib::cuda::event> done_;
  raiser raise_;
};

// This thread's deferred reports (ranks are threads, each with its current stream):
// layers add, a device loss takes them all when it is made and reads them with its
// own (nn/cuda/loss.cuh).
inline deferred_reports<deferred_index_report>& deferred_index_reports() {
  thread_local deferred_reports<deferred_index_report> list;
  return list;
}

}  // namespace shardlib::ops::cuda
