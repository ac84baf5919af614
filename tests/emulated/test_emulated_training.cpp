// The device tests of whole training runs (tests/cuda/test_cuda_training.cu: every
// strategy and hybrid sharding on device ranks against the host, bf16 over fp32
// masters, FullShard over NCCL against the thread communicator), compiled by the host
// compiler and run on the CPU by the emulator, NCCL by include/nccl.h.
#include "cuda/test_cuda_training.cu"
#include "dynamic_shared.hpp"  // the fused attention's shared memory
