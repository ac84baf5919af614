// shardlib/ops/cuda/flash_attention.cuh — fused scaled dot-product attention on
// the device, forward and backward, never holding the [Lq, Lk] weights.
//
// Two sets of kernels share the arithmetic of ops/attention_tiles.hpp (tested on
// the host against nn::sdpa): on tensor cores for bfloat16 and half inputs with
// head_dim up to 128 on sm_80 and later, where their shared memory fits
// (ops/cuda/flash_tensor_kernels.cuh), and on CUDA cores for everything else
// (ops/cuda/flash_kernels.cuh). flash_options::tensor_cores = false forces the
// latter. Backward is deterministic, without atomics, in both.
#pragma once
#include "shardlib/core/error.hpp"
#include "shardlib/core/ledger.hpp"             // category
#include "shardlib/cuda/caching_allocator.hpp"  // device_buffer
#include "shardlib/cuda/copy.hpp"               // copy_async
#include "shardlib/cuda/stream.hpp"             // stream
#include "shardlib/cuda/kernel_facts.hpp"       // allow_shared_memory, current_device_facts, kernel_ptx_version
#include "shardlib/nn/sdpa.hpp"                 // head_view
#include "shardlib/ops/cuda/launch.cuh"         // launch_kernel
#include "shardlib/ops/cuda/flash_kernels.cuh"
#include "shardlib/ops/cuda/flash_tensor_kernels.cuh"

#include <cuda_runtime.h>

#include <algorithm>  // std::all_of
#include <array>      // std::array
#include <cstddef>    // std::size_t
#include <cstdint>    // std::int64_t
#include <map>        // std::map
#include <memory>     // std::unique_ptr
#include <span>       // std::span

namespace shardlib::ops::cuda {

namespace detail {
// Dynamic shared memory above 48 KiB needs the kernel's opt-in, up to the device's
// limit (227 KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86/sm_89: head_dim 256's
// backward on CUDA cores needs 130 KiB, the tensor-core kernels at head_dim 128 up
// to 106,496 bytes), checked first so that a small GPU gets a message.
template <class K, class Args>
void launch_flash(K kernel, dim3 grid, std::size_t shared_bytes, cudaStream_t stream, const char* name,
                  const Args& args) {
  shardlib::cuda::allow_shared_memory(reinterpret_cast<const void*>(kernel), shared_bytes, name);
  launch_kernel(name, kernel, grid, fused::threads, shared_bytes, stream, args);
}

// The current GPU runs `kernel` (a tensor-core one) with `shared_bytes` per block: an sm_80 or
// later GPU, that much shared memory on opt-in, and the kernel's code built for sm_80 or later
// (a build for older architectures holds only the trapping body, which a newer GPU would JIT).
template <class Kernel>
bool tensor_kernel_usable(Kernel kernel, std::size_t shared_bytes) {
  const shardlib::cuda::device_facts& d = shardlib::cuda::current_device_facts();
  return d.major >= 8 && shared_bytes <= std::size_t(d.shared_optin) &&
         shardlib::cuda::kernel_ptx_version(reinterpret_cast<const void*>(kernel)) >= 80;
}

// Whether the current GPU's wmma accumulators hold their elements where the tensor-core
// kernels read them one by one, and the kernels' products in T are exact where they
// should be (flash_tensor_products.cuh): asked of the GPU once per thread, device and T, by
// one warp of layout_probe_kernel on a stream of its own (no other work waits for it).
// Call it where tensor_kernel_usable holds: on older GPUs it fails.
template <class T>
bool tensor_tiles_hold() {
  namespace ft = detail::tensor;
  thread_local std::map<int, bool> known;
  const int device = shardlib::cuda::current_device_facts().device;
  if (const auto it = known.find(device); it != known.end()) return it->second;
  const shardlib::cuda::stream own(device);
  int* flags = nullptr;  // 128 bytes once: not worth the caching allocator's books for a stream that ends here
  shardlib::cuda::check(cudaMalloc(&flags, 32 * sizeof(int)), "cudaMalloc (the layout probe)");
  const std::unique_ptr<int, cudaError_t (*)(void*)> owned(flags, &cudaFree);
  launch_kernel("the tensor-core attention's layout probe", ft::layout_probe_kernel<T>, 1, 32, 0, own.get(),
                flags);
  std::array<int, 32> got{};
  shardlib::cuda::copy_async(std::span<int>(got), std::span<const int>(flags, 32), own.get());
  shardlib::cuda::check(cudaStreamSynchronize(own.get()), "cudaStreamSynchronize (the layout probe)");
  const bool holds = std::all_of(got.begin(), got.end(), [](int f) { return f == 1; });
  known.emplace(device, holds);
  return holds;
}
}  // namespace detail

// Whether flash_attention_forward and _backward take the tensor-core kernels for T
// and head_dim on the current GPU (bfloat16 or half, head_dim a multiple of 8 up to
// 128, sm_80 or later with the shared memory they need, a build for sm_80 or later,
// accumulators laid out as they read them, o.tensor_cores, a normal positive scale:
// takes_scale), given views (inputs and outputs) whose rows start 16-byte aligned, as a
// contiguous tensor's do (they load and store 16 bytes at a time; other views take the
// CUDA cores).
template <class T>
bool flash_uses_tensor_cores(std::int64_t head_dim, const flash_options& o) {
  namespace ft = detail::tensor;
  if constexpr (!ft::takes<T>) {
    return false;
  } else {
    if (!o.tensor_cores || !ft::takes_dim(head_dim) || !ft::takes_scale(detail::fused::scale_of(o, head_dim)))
      return false;
    bool usable = false;
    ft::dispatch_dim(head_dim,
                     [&]<int DM>() { usable = detail::tensor_kernel_usable(ft::forward_kernel<DM, T, false>, ft::largest_bytes<DM>); });
    return usable && detail::tensor_tiles_hold<T>();
  }
}

// q: [B, H, Lq, D], k/v: [B, Hkv, Lk, D] (device pointers, rows contiguous);
// out: [B, H, Lq, D]; lse: device float [B, H, Lq] (written; backward reads it;
// +inf for a query that sees no key, whose output is zero).
template <class T>
void flash_attention_forward(nn::head_view<const T> q, nn::head_view<const T> k, nn::head_view<const T> v,
                             nn::head_view<T> out, float* lse, const flash_options& o, cudaStream_t stream) {
  namespace fd = detail::fused;
  namespace ft = detail::tensor;
  constexpr const char* who = "flash_attention_forward";
  const flash::tile_problem p = fd::problem(q, k, v, o, who);
  require<shape_error>(out.shape() == q.shape(), who, ": the output must be shaped as q, ", q.shape(), ", got ",
                       out.shape());
  if (p.batch * p.heads * p.queries == 0) return;
  const fd::forward_args<T> args{fd::rows_of(q), fd::rows_of(k), fd::rows_of(v), fd::rows_of(out), lse, p,
                                 fd::scale_of(o, q.dim), int(q.dim), o.longest_first};
  if constexpr (ft::takes<T>)
    if (flash_uses_tensor_cores<T>(q.dim, o) && ft::whole_vectors(args.q) && ft::whole_vectors(args.k) &&
        ft::whole_vectors(args.v) && ft::whole_vectors(args.out)) {
      ft::dispatch_dim(q.dim, [&]<int DM>() {
        detail::launch_flash(p.dropout ? ft::forward_kernel<DM, T, true> : ft::forward_kernel<DM, T, false>,
                             fd::query_grid(p, ft::tile, o.longest_first), ft::forward_bytes<DM>, stream, who, args);
      });
      return;
    }
  fd::dispatch_dim(q.dim, who, [&]<int DM>() {
    detail::launch_flash(fd::forward_kernel<DM, T>, fd::query_grid(p, fd::tile, o.longest_first),
                         fd::forward_bytes<DM>, stream, who, args);
  });
}

// The gradients of flash_attention_forward's q, k and v from dout, given its
// q, k, v, out, lse and options: dq, dk and dv are overwritten (a kv head shared
// by several query heads gets the sum of their gradients). Deterministic.
template <class T>
void flash_attention_backward(nn::head_view<const T> q, nn::head_view<const T> k, nn::head_view<const T> v,
                              nn::head_view<const T> out, nn::head_view<const T> dout, const float* lse,
                              nn::head_view<T> dq, nn::head_view<T> dk, nn::head_view<T> dv, const flash_options& o,
                              cudaStream_t stream) {
  namespace fd = detail::fused;
  namespace ft = detail::tensor;
  constexpr const char* who = "flash_attention_backward";
  const flash::tile_problem p = fd::problem(q, k, v, o, who);
  require<shape_error>(out.shape() == q.shape() && dout.shape() == q.shape() && dq.shape() == q.shape() &&
                           dk.shape() == k.shape() && dv.shape() == k.shape(),
                       who, ": out, dout and dq must be shaped as q ", q.shape(), ", dk and dv as k ", k.shape());
  if (p.batch * p.kv_heads * p.keys == 0 && p.batch * p.heads * p.queries == 0) return;
  const std::int64_t rows = p.batch * p.heads * p.queries;
  shardlib::cuda::device_buffer<float> row_d(std::size_t(rows > 0 ? rows : 1), category::activations, stream);
  const fd::backward_args<T> args{fd::rows_of(q),  fd::rows_of(k),  fd::rows_of(v),  fd::rows_of(out),
                                  fd::rows_of(dout), lse,           row_d.data(),    fd::rows_of(dq),
                                  fd::rows_of(dk), fd::rows_of(dv), p,               fd::scale_of(o, q.dim),
                                  int(q.dim),      o.longest_first};
  if (rows > 0) {
    launch_kernel("flash_attention_backward (D = dO . O)", fd::row_d_kernel<T>,
                  unsigned((rows + fd::warps - 1) / fd::warps), fd::threads, 0, stream, args);
  }
  if constexpr (ft::takes<T>)
    if (flash_uses_tensor_cores<T>(q.dim, o) && ft::whole_vectors(args.q) && ft::whole_vectors(args.k) &&
        ft::whole_vectors(args.v) && ft::whole_vectors(args.dout) && ft::whole_vectors(args.dq) &&
        ft::whole_vectors(args.dk) && ft::whole_vectors(args.dv)) {
      ft::dispatch_dim(q.dim, [&]<int DM>() {
        if (rows > 0)
          detail::launch_flash(ft::dq_kernel<DM, T>, fd::query_grid(p, ft::tile, o.longest_first), ft::dq_bytes<DM>,
                               stream, "flash_attention_backward (dq)", args);
        if (p.keys > 0)
          detail::launch_flash(ft::dkdv_kernel<DM, T>, fd::key_grid(p, ft::tile, o.longest_first),
                               ft::dkdv_bytes<DM>, stream, "flash_attention_backward (dk, dv)", args);
      });
      return;
    }
  fd::dispatch_dim(q.dim, who, [&]<int DM>() {
    if (rows > 0)
      detail::launch_flash(fd::dq_kernel<DM, T>, fd::query_grid(p, fd::tile, o.longest_first), fd::dq_bytes<DM>,
                           stream, "flash_attention_backward (dq)", args);
    if (p.keys > 0)
      detail::launch_flash(fd::dkdv_kernel<DM, T>, fd::key_grid(p, fd::tile, o.longest_first), fd::dkdv_bytes<DM>,
                           stream, "flash_attention_backward (dk, dv)", args);
  });
}

}  // namespace shardlib::ops::cuda
