// shardlib/nn/cuda/embedding.cuh — token and position embeddings on the device:
// nn::Embedding<T, cuda_space> (ops::cuda::embedding_forward/backward) and
// nn::PositionEmbedding<T, cuda_space>, on the current stream.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"
#include "shardlib/core/pending.hpp"                 // count_host_sync
#include "shardlib/core/tensor.hpp"
#include "shardlib/cuda/caching_allocator.hpp"       // device_allocator
#include "shardlib/cuda/copy.hpp"                    // copy_async, to_device
#include "shardlib/cuda/current.hpp"                 // current_stream
#include "shardlib/cuda/error.hpp"                   // check, current_device
#include "shardlib/cuda/memory_space.hpp"            // cuda_space
#include "shardlib/nn/embedding.hpp"                 // the host layers
#include "shardlib/nn/grad_mode.hpp"                 // grad_enabled
#include "shardlib/ops/cuda/embedding.cuh"           // embedding_forward, embedding_backward
#include "shardlib/ops/cuda/index_report.hpp"        // index_report, deferred_index_reports
#include "shardlib/ops/cuda/position_embedding.cuh"  // add_positions, add_position_rows, add_positions_backward

#include <cuda_runtime.h>

#include <cstdint>  // std::int64_t
#include <memory>   // std::make_shared
#include <span>     // std::span
#include <utility>  // std::move

namespace shardlib::nn {

// The host layer's parameter, checks and messages (detail::embedding_base in
// nn/embedding.hpp); ids in device memory. Forward checks the ids on the
// device without waiting: it leaves the check in this thread's deferred reports
// (ops/cuda/index_report.hpp), and the next device loss read raises the host's
// error, naming the first bad position (after the loss's own bad target, if any);
// the host raises it in forward. Without a loss read, the 65th forward after an
// unread one checks that one alone (one wait) and raises its error. Until then
// the ids stay alive (the error reads the bad id then); the output rows of bad ids
// are zeros. Backward is
// deterministic (a stable sort of the ids, no atomics) and in float bit for bit
// the host's accumulation.
template <class T>
class Embedding<T, cuda_space> : public detail::embedding_base<T> {
  using base = detail::embedding_base<T>;
  using base::num_, base::dim_;

 public:
  using input = Tensor<std::int64_t, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using base::weight;

  using base::base;  // Embedding(num_embeddings, embedding_dim)

  template <class Ctx>
  output forward(Ctx& ctx, const input& ids) {
    output y(this->check_input(ids));
    const cudaStream_t s = cuda::current_stream();
    auto bad = std::make_shared<ops::cuda::index_report>(s);
    ops::cuda::embedding_forward(weight.value, num_, int(dim_), ids.data(), ids.numel(), y.data(), *bad, s);
    ops::cuda::deferred_index_reports().add(
        ops::cuda::deferred_index_report(std::move(bad), s, [num = num_, dim = dim_, ids](std::int64_t at) {
          std::int64_t id = 0;  // the report's read has waited for the forward, so any stream may copy
          const cudaStream_t r = cuda::current_stream();
          cuda::copy_async(std::span<std::int64_t>(&id, 1), std::span<const std::int64_t>(ids.data() + at, 1), r);
          count_host_sync();
          cuda::check(cudaStreamSynchronize(r), "cudaStreamSynchronize (Embedding's bad id)");
          throw Embedding(num, dim).out_of_range(ids.shape(), at, id);  // a table-less copy for the message
        }));
    ids_ = grad_enabled(ctx) ? ids : input{};
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(ids_, dy);
    if (weight.requires_grad)  // frozen: no gradient, as on the host
      ops::cuda::embedding_backward(ids_.data(), ids_.numel(), dy.data(), weight.grad, num_, int(dim_),
                                    cuda::current_stream(), cuda::device_allocator(cuda::current_device()));
    ids_ = {};
    return {};
  }

 private:
  input ids_;  // cached for backward
};

// The host layer's parameter, offset and checks (detail::position_embedding_base);
// the same sums in the same order (bit for bit in float). With position ids, their
// copy on the device picks each token's row, and backward adds the rows back as
// Embedding's does.
template <class T>
class PositionEmbedding<T, cuda_space> : public detail::position_embedding_base<T> {
  using base = detail::position_embedding_base<T>;
  using base::dim_, base::max_, base::offset_, base::shape_, base::used_offset_, base::pending_;

 public:
  using input = Tensor<T, cuda_space>;
  using output = Tensor<T, cuda_space>;
  using base::weight;

  using base::base;  // PositionEmbedding(max_positions, embedding_dim)

  template <class Ctx>
  output forward(Ctx& ctx, const input& x) {
    const std::int64_t seq = this->check_input(x.shape(), ctx.position_ids(), grad_enabled(ctx));
    const std::int64_t block = seq * dim_;
    const cudaStream_t s = cuda::current_stream();
    output y(x.shape());
    ids_ = {};
    if (const auto& ids = ctx.position_ids(); !ids.empty()) {
      ids_ = cuda::to_device(ids);
      ops::cuda::add_position_rows(x.data(), weight.value, ids_.data(), y.data(), ids.numel(), dim_, s);
      if (!pending_) ids_ = {};
      return y;
    }
    ops::cuda::add_positions(x.data(), weight.value + offset_ * dim_, y.data(), x.numel() / block, block, s);
    return y;
  }

  template <class Ctx>
  input backward(Ctx&, const output& dy) {
    this->check_grad(dy.shape());
    const std::int64_t block = shape_[shape_.rank() - 2] * dim_;
    const cudaStream_t s = cuda::current_stream();
    if (weight.requires_grad && !ids_.empty())
      ops::cuda::embedding_backward(ids_.data(), ids_.numel(), dy.data(), weight.grad, max_, int(dim_), s,
                                    cuda::device_allocator(cuda::current_device()));
    else if (weight.requires_grad)
      ops::cuda::add_positions_backward(dy.data(), weight.grad + used_offset_ * dim_, dy.numel() / block, block, s);
    ids_ = {};
    pending_ = false;
    return dy;
  }

 private:
  Tensor<std::int64_t, cuda_space> ids_;  // the forward's position ids on the device, for backward
};

}  // namespace shardlib::nn
