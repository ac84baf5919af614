// The device tests of the decoder models (tests/cuda/test_cuda_decoder.cu: GPT-2 and
// LLaMA on the device against the host, FullShard on two device ranks, bf16
// compute), compiled by the host compiler and run on the CPU by the emulator.
#include "cuda/test_cuda_decoder.cu"
#include "dynamic_shared.hpp"  // the fused attention's shared memory
