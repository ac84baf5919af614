// tests/emulated/include/cuda_profiler_api.h — stands in for CUDA's header in the emulated
// tests: cudaProfilerStart and cudaProfilerStop bracket what a profiler started with capture
// off records; here the kernel launches between them are counted and, at the stop, reported
// on stdout as a profiler reports (so that a test can see the bracket holds a step).
#pragma once
#include "../cuda_runtime_api.hpp"

#include <cstdio>  // std::printf

inline cudaError_t cudaProfilerStart() {
  cuda_emulator::profiled_launches() = 0;
  return cudaSuccess;
}
inline cudaError_t cudaProfilerStop() {
  const long n = cuda_emulator::profiled_launches().exchange(-1);
  if (n >= 0) std::printf("==emulated profiler== %ld kernel launches between cudaProfilerStart and cudaProfilerStop\n", n);
  return cudaSuccess;
}
