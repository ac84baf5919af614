// shardlib/models/cuda.cuh — the decoder language models on the device (nvcc
// only): models::GPT2LMHeadModel<T, cuda_space> and LlamaForCausalLM<T,
// cuda_space> are the host templates over the device layers this header brings.
// Ids [batch, seq] and logits [batch, seq, vocab] are device tensors; the token
// cross-entropy of nn/cuda/loss.cuh takes the logits and device targets. The KV
// cache lives in device memory, and models::generate (plain or sharded) runs there.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/pending.hpp"                // count_host_sync
#include "shardlib/cuda/copy.hpp"                  // copy_async, to_device
#include "shardlib/cuda/error.hpp"                 // check
#include "shardlib/models/gpt2.hpp"
#include "shardlib/models/llama.hpp"
#include "shardlib/nn/cuda.cuh"                    // Linear, LayerNorm, Dropout, GELU, residual, cross-entropy
#include "shardlib/nn/cuda/decoder_attention.cuh"  // GPT2Attention, LlamaAttention
#include "shardlib/nn/cuda/embedding.cuh"          // Embedding, PositionEmbedding
#include "shardlib/nn/cuda/feed_forward.cuh"       // GPT2MLP, LlamaMLP
#include "shardlib/nn/cuda/rms_norm.cuh"           // RMSNorm
#include "shardlib/nn/cuda/tied_linear.cuh"        // the tied lm_head
#include "shardlib/ops/cuda/index_report.hpp"      // deferred_index_reports

#include <cuda_runtime.h>

#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t
#include <span>     // std::span

namespace shardlib::models::detail {

// generate on the device: the ids are copied in, and each step's last position of
// every row comes back, a copy per row (one strided copy's pitch, a row of the
// whole sequence's logits, passes the 2^31-byte limit for long sequences of large
// vocabularies). The Embeddings' deferred checks of the forwards so far are read
// in the same wait (as a device loss reads them), so a bad id raises its layer's
// error at the step that used it, and an inference thread keeps none of them.
template <>
struct generate_io<cuda_space> {
  static Tensor<std::int64_t, cuda_space> ids(const Tensor<std::int64_t>& ids) { return cuda::to_device(ids); }

  // Logits [batch, seq > 0, vocab] (generate checks them first).
  template <class T>
  static Tensor<T> logits(const Tensor<T, cuda_space>& logits) {
    const std::int64_t B = logits.dim(0), S = logits.dim(1), V = logits.dim(2);
    const cudaStream_t s = cuda::current_stream();
    auto reports = ops::cuda::deferred_index_reports().take();
    for (auto& r : reports) r.copy_to_host(s);
    Tensor<T> last({B, 1, V});
    for (std::int64_t n = 0; n < B; ++n)
      cuda::copy_async(std::span<T>(last.data() + n * V, std::size_t(V)),
                       std::span<const T>(logits.data() + (n * S + S - 1) * V, std::size_t(V)), s);
    count_host_sync();
    cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize (generate: reading the logits)");
    for (const auto& r : reports) r.raise_if_bad();
    return last;
  }

  // h [batch, seq, hidden]'s last `keep` positions, [batch, keep, hidden], on the current stream.
  template <class T>
  static Tensor<T, cuda_space> last_positions(const Tensor<T, cuda_space>& h, std::int64_t keep) {
    const std::int64_t B = h.dim(0), S = h.dim(1), D = h.dim(2);
    Tensor<T, cuda_space> last({B, keep, D});
    for (std::int64_t n = 0; n < B; ++n)
      cuda::copy_async(std::span<T>(last.data() + n * keep * D, std::size_t(keep * D)),
                       std::span<const T>(h.data() + (n * S + S - keep) * D, std::size_t(keep * D)),
                       cuda::current_stream());
    return last;
  }
};

}  // namespace shardlib::models::detail
