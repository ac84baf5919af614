// The device tests of the engine's operations (tests/cuda/test_cuda_engine.cu: space
// operations, device Adam, steps that never wait for the host, fp16 loss scaling on
// the device, NcclComm at world size 1), compiled by the host compiler and run on the
// CPU by the emulator, NCCL by include/nccl.h.
#include "cuda/test_cuda_engine.cu"
