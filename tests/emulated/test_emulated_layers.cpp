// The device tests of the layers (tests/cuda/test_cuda_layers.cu: encoder and
// decoder layers, the reference model, rotary embeddings), compiled by the host
// compiler and run on the CPU by the emulator. cuBLASLt finds no algorithm there
// (include/cublasLt.h), so Linear takes its unfused path: cuBLAS, computed on the
// CPU, and the library's bias and activation kernels.
#include "cuda/test_cuda_layers.cu"
#include "dynamic_shared.hpp"  // the fused attention's shared memory
