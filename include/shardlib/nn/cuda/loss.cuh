// shardlib/nn/cuda/loss.cuh — cross-entropy on the device:
// nn::cross_entropy_loss over Tensor<T, cuda_space> logits and targets.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/core/pending.hpp"            // pending, count_host_sync
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/caching_allocator.hpp"  // device_allocator, device_buffer
#include "shardlib/cuda/copy.hpp"               // copy_async
#include "shardlib/cuda/current.hpp"            // current_stream
#include "shardlib/cuda/error.hpp"              // current_device
#include "shardlib/cuda/memory_space.hpp"       // cuda_space
#include "shardlib/nn/loss.hpp"                 // cross_entropy_loss, loss_result
#include "shardlib/ops/cuda/cross_entropy.cuh"  // cross_entropy, count_rows
#include "shardlib/ops/cuda/index_report.hpp"   // index_report, deferred_index_reports

#include <cstdint>     // std::int64_t
#include <functional>  // std::function
#include <memory>      // std::shared_ptr, std::make_shared
#include <span>        // std::span
#include <vector>      // std::vector

namespace shardlib::nn::detail {

// ops::cuda::cross_entropy on the current stream; nothing waits for it. The loss
// stays in device memory, a pending<float> whose read (one wait for that stream)
// also reads the bad-target report and throws the host's shape_error naming the
// first bad row, so the error comes when the loss is read, not at the call (the
// host throws at the call). The loss takes this thread's deferred reports (the
// device Embeddings' bad ids of the forwards before it) when it is made and reads
// them in the same wait; after its own bad target, the first of them with a bad
// index throws its layer's error. A loss never read drops them unread. The stream
// must outlive the loss or its read.
template <>
struct cross_entropy_rows<cuda_space> {
  template <class T>
  static loss_result<T, cuda_space> compute(const cross_entropy_options& o, const Tensor<T, cuda_space>& logits,
                                            const Tensor<std::int64_t, cuda_space>& targets, std::int64_t rows,
                                            std::int64_t classes) {
    const cudaStream_t s = cuda::current_stream();
    Tensor<T, cuda_space> grad(logits.shape());
    Tensor<float, cuda_space> loss(Shape{1});
    auto bad = std::make_shared<ops::cuda::index_report>(s);
    ops::cuda::cross_entropy(logits.data(), targets.data(), rows, int(classes), o, grad.data(), loss.data(), *bad, s,
                             cuda::device_allocator(cuda::current_device()));
    auto earlier = std::make_shared<std::vector<ops::cuda::deferred_index_report>>(
        ops::cuda::deferred_index_reports().take());
    auto read = [=](const std::function<void()>& before_wait) {
      float value = 0;
      cuda::copy_async(std::span<float>(&value, 1), std::span<const float>(loss.data(), 1), s);
      const auto r = bad->read(s, [&] {  // the one wait
        for (auto& e : *earlier) e.copy_to_host(s);
        if (before_wait) before_wait();
      });
      if (r)
        throw shape_error(cat("cross_entropy: target ", read_one(targets.data() + *r, s, "its bad target"), " in row ",
                              *r, " is out of range for ", classes, " classes (ignore_index is ", o.ignore_index, ")"));
      for (const auto& e : *earlier) e.raise_if_bad();
      return value;
    };
    return {pending<float>(read, loss.data()), grad};
  }
  // The rows not ignored, counted on the current stream and read (one wait). A template, as
  // compute: a member of this full specialisation that were not would compile CUB's counting
  // kernels into every translation unit including this header.
  template <class Index>
  static std::int64_t items(const cross_entropy_options& o, const Tensor<Index, cuda_space>& targets) {
    const cudaStream_t s = cuda::current_stream();
    auto& alloc = cuda::device_allocator(cuda::current_device());
    cuda::device_buffer<int> counted(1, category::activations, s, alloc);
    ops::cuda::count_rows(targets.data(), targets.numel(), o.ignore_index, counted.data(), s, alloc);
    return read_one(counted.data(), s, "cross_entropy's count of rows");
  }

 private:
  template <class U>
  static U read_one(const U* p, cudaStream_t s, const char* what) {
    U v{};
    cuda::copy_async(std::span<U>(&v, 1), std::span<const U>(p, 1), s);
    count_host_sync();
    cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize (reading ", what, ")");
    return v;
  }
};

}  // namespace shardlib::nn::detail
