// The device tests of the layers (tests/cuda/test_cuda_layers.cu: encoder and
// decoder layers, the reference model, rotary embeddings), compiled by the host
// compiler and run on the CPU by the emulator. Linear's products and epilogues are
// the cuBLAS and cuBLASLt stand-ins' (include/), computed on the CPU.
#include "cuda/test_cuda_layers.cu"
#include "dynamic_shared.hpp"  // the fused attention's shared memory
