// The device tests of the runtime layer (tests/cuda/test_cuda_runtime.cu), compiled by
// the host compiler and run on the CPU: the caching allocator over the stand-in's
// cudaMalloc (80 GiB per device), its device guard across the four emulated devices,
// the ledger, running out of memory, errors that name the call, kernel facts and the
// 48 KiB limit without the shared-memory opt-in, copies between the three spaces.
#include "cuda/test_cuda_runtime.cu"

#include <cstddef>

#include "cuda_emulator.hpp"

namespace test_cuda_runtime {  // the device test's, whose helpers these cases use

namespace {
// shared_kernel's `extern __shared__` array: as much as an sm_90 block may have.
alignas(16) int shared_ints[cuda_emulator::shared_capacity / sizeof(int)];
[[maybe_unused]] const bool shared_ints_defined = [] {
  cuda_emulator::define_dynamic_shared({reinterpret_cast<unsigned char*>(shared_ints), sizeof shared_ints});
  return true;
}();
}  // namespace

}  // namespace test_cuda_runtime
