// Device side of the CUDA tests: conversions and shard arithmetic run in kernels,
// compiled by nvcc from the same headers the host uses.
#include "element_kernels.hpp"

#include <shardlib/core/element.hpp>
#include <shardlib/cuda/error.hpp>
#include <shardlib/cuda/stream.hpp>
#include <shardlib/ops/cuda/launch.cuh>
#include <shardlib/shard/sharded_tensor.hpp>
#include <shardlib/shardlib.hpp>  // the whole host umbrella must compile under nvcc

#include <cuda_runtime.h>

#include <string>

namespace {
__global__ void round_trip_kernel(const std::uint16_t* bits, float* as_float_bf16, float* as_float_half,
                                  std::uint16_t* back_bf16, std::uint16_t* back_half, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float b = float(shardlib::bfloat16::from_bits(bits[i]));
  float h = float(shardlib::half::from_bits(bits[i]));
  as_float_bf16[i] = b;
  as_float_half[i] = h;
  back_bf16[i] = shardlib::bfloat16(b).bits;
  back_half[i] = shardlib::half(h).bits;
}

__global__ void locate_kernel(shardlib::shard::shard_layout l, int* ranks, int n) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g < n) ranks[g] = l.locate(std::size_t(g)).rank;
}

using shardlib::cuda::check;
}  // namespace

std::string cuda_device_problem() { return shardlib::cuda::device_problem(); }

device_round_trip run_device_round_trip() {
  constexpr int n = 65536;
  device_round_trip r;
  r.bits.resize(n);
  for (int i = 0; i < n; ++i) r.bits[i] = std::uint16_t(i);
  r.bf16_to_float.resize(n);
  r.half_to_float.resize(n);
  r.bf16_back.resize(n);
  r.half_back.resize(n);
  std::uint16_t *bits, *bb, *hb;
  float *bf, *hf;
  check(cudaMalloc(&bits, n * 2), "cudaMalloc");
  check(cudaMalloc(&bb, n * 2), "cudaMalloc");
  check(cudaMalloc(&hb, n * 2), "cudaMalloc");
  check(cudaMalloc(&bf, n * 4), "cudaMalloc");
  check(cudaMalloc(&hf, n * 4), "cudaMalloc");
  check(cudaMemcpy(bits, r.bits.data(), n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  shardlib::ops::cuda::launch_kernel("round_trip_kernel", round_trip_kernel, n / 256, 256, 0, nullptr, bits, bf, hf, bb,
                                     hb, n);
  check(cudaMemcpy(r.bf16_to_float.data(), bf, n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(r.half_to_float.data(), hf, n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(r.bf16_back.data(), bb, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(r.half_back.data(), hb, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
  for (void* p : {(void*)bits, (void*)bb, (void*)hb, (void*)bf, (void*)hf}) cudaFree(p);
  return r;
}

std::vector<int> run_device_locate(std::size_t numel, int world) {
  shardlib::shard::shard_layout l{numel, world};
  int n = int(l.padded_size());
  std::vector<int> out(n);
  int* d;
  check(cudaMalloc(&d, n * sizeof(int) + 1), "cudaMalloc");
  shardlib::ops::cuda::launch_kernel("locate_kernel", locate_kernel, (n + 255) / 256, 256, 0, nullptr, l, d, n);
  check(cudaMemcpy(out.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(d);
  return out;
}
