// The device checkpoint tests (tests/cuda/test_cuda_checkpoint.cu: a device model's
// sharded checkpoints, resharding loads and safetensors exports, optimizer state
// included, byte for byte the host path's files), compiled by the host compiler and
// run on the CPU by the emulator, NCCL by include/nccl.h.
#include "cuda/test_cuda_checkpoint.cu"
