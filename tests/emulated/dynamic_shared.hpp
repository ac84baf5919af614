// tests/emulated/dynamic_shared.hpp — the fused attention kernels' `extern __shared__`
// arrays, defined for the emulated programs that run them (one translation unit each)
// and handed to the emulator: as much as an sm_90 block may have.
#pragma once
#include "cuda_emulator.hpp"

namespace shardlib::ops::cuda::detail::fused {
alignas(128) float smem[cuda_emulator::shared_capacity / sizeof(float)];
}
namespace shardlib::ops::cuda::detail::tensor {
alignas(128) unsigned char smem[cuda_emulator::shared_capacity];
}
namespace cuda_emulator {
[[maybe_unused]] inline const bool attention_shared_defined = [] {
  define_dynamic_shared({reinterpret_cast<unsigned char*>(shardlib::ops::cuda::detail::fused::smem), shared_capacity});
  define_dynamic_shared({shardlib::ops::cuda::detail::tensor::smem, shared_capacity});
  return true;
}();
}  // namespace cuda_emulator
