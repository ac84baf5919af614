// The device tests of the element-wise, row, reduction, embedding, loss and Adam
// kernels (tests/cuda/test_cuda_ops.cu), compiled by the host compiler and run on
// the CPU by the emulator (cuda_emulator.hpp, cuda_runtime_api.hpp): the library's
// kernels and launches themselves, where no GPU is.
#include "cuda/test_cuda_ops.cu"
