// tests/emulated/include/cuda_pipeline.h — stands in for CUDA's header in the emulated
// tests: the cp.async primitives, each copy landing when its thread waits for it.
#pragma once
#include "../cuda_emulator.hpp"

#include <cstddef>  // std::size_t

inline void __pipeline_memcpy_async(void* dst_shared, const void* src_global, std::size_t size_and_align,
                                    std::size_t zfill = 0) {
  cuda_emulator::copy_async(dst_shared, src_global, size_and_align, zfill);
}
inline void __pipeline_commit() { cuda_emulator::commit_copies(); }
inline void __pipeline_wait_prior(std::size_t prior) { cuda_emulator::wait_copies(prior); }
