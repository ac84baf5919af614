// shardlib/cuda/kernel_facts.hpp — what a launch asks of the GPU and of a kernel
// (compute capability, opt-in shared memory, the architecture a kernel's code was
// built for), asked of the runtime once per thread and device and kept: the fused
// attention launches three kernels per layer and step, and each answer is a driver call.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"  // require
#include "shardlib/cuda/error.hpp"  // check, current_device

#include <cuda_runtime.h>

#include <cstddef>  // std::size_t
#include <map>      // std::map
#include <utility>  // std::pair

namespace shardlib::cuda {

struct device_facts {
  int device = 0;
  int major = 0;         // compute capability
  int shared_optin = 0;  // bytes of dynamic shared memory per block a kernel may opt in to
};

// The current device's facts.
inline const device_facts& current_device_facts() {
  thread_local std::map<int, device_facts> known;
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  auto it = known.find(device);
  if (it == known.end()) {
    device_facts f{device, 0, 0};
    check(cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device),
          "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
    check(cudaDeviceGetAttribute(&f.shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
    it = known.emplace(device, f).first;
  }
  return it->second;
}

namespace detail {
struct kernel_state {
  int ptx_version = -1;           // -1: not asked yet
  std::size_t shared_allowed = 0;  // the dynamic shared memory opted in to so far
};
inline kernel_state& kernel_state_of(const void* kernel, int device) {
  thread_local std::map<std::pair<const void*, int>, kernel_state> known;
  return known[{kernel, device}];
}
}  // namespace detail

// The virtual architecture (major * 10 + minor) of the code the current device runs
// for `kernel`: a build for older architectures gives a newer GPU their PTX to JIT.
inline int kernel_ptx_version(const void* kernel) {
  detail::kernel_state& k = detail::kernel_state_of(kernel, current_device_facts().device);
  if (k.ptx_version < 0) {
    cudaFuncAttributes built{};
    check(cudaFuncGetAttributes(&built, kernel), "cudaFuncGetAttributes");
    k.ptx_version = built.ptxVersion;
  }
  return k.ptx_version;
}

// Lets `kernel` (named `name` in messages) take `bytes` of dynamic shared memory per
// block on the current device; a device with less opt-in memory gets an error naming both.
inline void allow_shared_memory(const void* kernel, std::size_t bytes, const char* name) {
  const device_facts& d = current_device_facts();
  require(bytes <= std::size_t(d.shared_optin), name, ": needs ", bytes, " bytes of shared memory per block, GPU ",
          d.device, " has ", d.shared_optin);
  detail::kernel_state& k = detail::kernel_state_of(kernel, d.device);
  if (bytes <= k.shared_allowed || bytes <= 48 * 1024) return;  // 48 KiB need no opt-in
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
        "cudaFuncSetAttribute(MaxDynamicSharedMemorySize) for ", name);
  k.shared_allowed = bytes;
}

}  // namespace shardlib::cuda
