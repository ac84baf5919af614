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
#include "shardlib/nn/sdpa.hpp"                 // head_view
#include "shardlib/ops/cuda/flash_kernels.cuh"
#include "shardlib/ops/cuda/flash_tensor_kernels.cuh"

#include <cuda_runtime.h>

#include <cstdint>  // std::int64_t

namespace shardlib::ops::cuda {

// Whether flash_attention_forward and _backward take the tensor-core kernels for T
// and head_dim on the current GPU (bfloat16 or half, head_dim a multiple of 8 up to
// 128, sm_80 or later with the shared memory they need, a build for sm_80 or later,
// o.tensor_cores), given views whose rows start 16-byte aligned, as a contiguous
// tensor's do (they load tiles 16 bytes at a time; other views take the CUDA cores).
template <class T>
bool flash_uses_tensor_cores(std::int64_t head_dim, const flash_options& o) {
  namespace ft = detail::tensor;
  if constexpr (!ft::takes<T>) {
    return false;
  } else {
    if (!o.tensor_cores || head_dim < 1 || head_dim > ft::max_dim || head_dim % 8 != 0) return false;
    bool usable = false;
    ft::dispatch_dim(head_dim,
                     [&]<int DM>() { usable = ft::usable(ft::forward_kernel<DM, T>, ft::largest_bytes<DM>); });
    return usable;
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
                                 fd::scale_of(o, q.dim), int(q.dim)};
  if constexpr (ft::takes<T>)
    if (flash_uses_tensor_cores<T>(q.dim, o) && ft::whole_vectors(args.q) && ft::whole_vectors(args.k) &&
        ft::whole_vectors(args.v)) {
      ft::dispatch_dim(q.dim, [&]<int DM>() {
        const dim3 grid(unsigned((p.queries + ft::tile - 1) / ft::tile), unsigned(p.heads), unsigned(p.batch));
        fd::launch(ft::forward_kernel<DM, T>, grid, ft::forward_bytes<DM>, stream, who, args);
      });
      return;
    }
  const dim3 grid(unsigned((p.queries + fd::tile - 1) / fd::tile), unsigned(p.heads), unsigned(p.batch));
  fd::dispatch_dim(q.dim, who, [&]<int DM>() {
    fd::launch(fd::forward_kernel<DM, T>, grid, sizeof(float) * (fd::tile * DM + 2 * DM * fd::pitch), stream, who,
               args);
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
                                  int(q.dim)};
  if (rows > 0) {
    fd::row_d_kernel<T><<<unsigned((rows + fd::warps - 1) / fd::warps), fd::tile * fd::warps, 0, stream>>>(args);
    shardlib::cuda::check_launch("flash_attention_backward (D = dO . O)");
  }
  if constexpr (ft::takes<T>)
    if (flash_uses_tensor_cores<T>(q.dim, o) && ft::whole_vectors(args.q) && ft::whole_vectors(args.k) &&
        ft::whole_vectors(args.v) && ft::whole_vectors(args.dout)) {
      ft::dispatch_dim(q.dim, [&]<int DM>() {
        if (rows > 0) {
          const dim3 grid(unsigned((p.queries + ft::tile - 1) / ft::tile), unsigned(p.heads), unsigned(p.batch));
          fd::launch(ft::dq_kernel<DM, T>, grid, ft::dq_bytes<DM>, stream, "flash_attention_backward (dq)", args);
        }
        if (p.keys > 0) {
          const dim3 grid(unsigned((p.keys + ft::tile - 1) / ft::tile), unsigned(p.kv_heads), unsigned(p.batch));
          fd::launch(ft::dkdv_kernel<DM, T>, grid, ft::dkdv_bytes<DM>, stream, "flash_attention_backward (dk, dv)",
                     args);
        }
      });
      return;
    }
  fd::dispatch_dim(q.dim, who, [&]<int DM>() {
    const std::size_t tiles_bytes = sizeof(float) * (2 * fd::tile * DM + 2 * DM * fd::pitch);
    if (rows > 0) {
      const dim3 grid(unsigned((p.queries + fd::tile - 1) / fd::tile), unsigned(p.heads), unsigned(p.batch));
      fd::launch(fd::dq_kernel<DM, T>, grid, tiles_bytes, stream, "flash_attention_backward (dq)", args);
    }
    if (p.keys > 0) {
      const dim3 grid(unsigned((p.keys + fd::tile - 1) / fd::tile), unsigned(p.kv_heads), unsigned(p.batch));
      fd::launch(fd::dkdv_kernel<DM, T>, grid, tiles_bytes + sizeof(float) * 2 * fd::tile, stream,
                 "flash_attention_backward (dk, dv)", args);
    }
  });
}

}  // namespace shardlib::ops::cuda
