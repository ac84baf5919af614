// shardlib/cuda.hpp — the CUDA umbrella: memory spaces, streams, the caching
// allocator, copies, cuBLAS products and the kernels (link shardlib::cuda).
// It holds kernels, so only nvcc compiles it; host code that only needs the
// runtime parts includes shardlib/cuda/*.hpp and shardlib/ops/cuda/gemm.hpp.
// (The project's tests build CUDA programs with g++ against an emulator of the
// runtime, tests/emulated, and define SHARDLIB_CUDA_EMULATED there.)
#pragma once
#if !defined(__CUDACC__) && !defined(SHARDLIB_CUDA_EMULATED)
#error "shardlib/cuda.hpp contains CUDA kernels: include it from a .cu file compiled by nvcc (host-only parts: shardlib/cuda/*.hpp, shardlib/ops/cuda/gemm.hpp)"
#endif
#include "shardlib/config.hpp"
#include "shardlib/cuda/blas.hpp"                // blas
#include "shardlib/cuda/blas_lt.hpp"             // blas_lt
#include "shardlib/cuda/caching_allocator.hpp"   // caching_allocator, device_buffer, device_allocator
#include "shardlib/cuda/copy.hpp"                // copy_async, fill_bytes_async
#include "shardlib/cuda/error.hpp"               // cuda_error, check
#include "shardlib/cuda/kernel_facts.hpp"        // current_device_facts, allow_shared_memory
#include "shardlib/cuda/memory_space.hpp"        // cuda_space, pinned_space
#include "shardlib/cuda/stream.hpp"              // stream, event, device_guard, device_problem
#include "shardlib/ops/cuda/adam.cuh"            // fused_adam_step, make_adam_state
#include "shardlib/ops/cuda/cross_entropy.cuh"   // cross_entropy
#include "shardlib/ops/cuda/elementwise.cuh"     // relu, gelu, cast, dropout
#include "shardlib/ops/cuda/embedding.cuh"       // embedding_forward, embedding_backward
#include "shardlib/ops/cuda/flash_attention.cuh" // flash_attention_forward, flash_attention_backward
#include "shardlib/ops/cuda/gemm.hpp"            // gemm, gemm_strided_batched
#include "shardlib/ops/cuda/gemm_lt.hpp"         // gemm_lt (fused epilogues)
#include "shardlib/ops/cuda/index_report.hpp"    // index_report
#include "shardlib/ops/cuda/layer_norm.cuh"      // layer_norm_forward, layer_norm_backward
#include "shardlib/ops/cuda/position_embedding.cuh"  // add_positions
#include "shardlib/ops/cuda/reduce.cuh"          // add_column_sums, sums of squares, non-finite counts
#include "shardlib/ops/cuda/rms_norm.cuh"        // rms_norm_forward, rms_norm_backward
#include "shardlib/ops/cuda/rotary.cuh"          // apply_rotary, rotary_device_table
#include "shardlib/ops/cuda/sgd.cuh"             // sgd_update, begin_sgd_step
#include "shardlib/ops/cuda/softmax.cuh"         // masked_softmax, softmax_backward
#include "shardlib/ops/cuda/step_gate.cuh"       // step_gate, gate_state
#include "shardlib/ops/cuda/swiglu.cuh"          // silu, swiglu and their backward
