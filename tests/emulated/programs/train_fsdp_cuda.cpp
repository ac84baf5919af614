// examples/train_fsdp_cuda compiled by the host compiler and run on the CPU by the emulator
// at a small size: the example's flags, loss, metrics and model file tried before a GPU is.
#include "train_fsdp_cuda/train_fsdp_cuda.cu"
#include "../dynamic_shared.hpp"  // the fused attention's shared memory
