// examples/train_gpt_cuda compiled by the host compiler and run on the CPU by the emulator
// at a small size: the example's flags, data, loss, evaluation and checkpoint tried before a
// GPU is.
#include "train_gpt_cuda/train_gpt_cuda.cu"
#include "../dynamic_shared.hpp"  // the fused attention's shared memory
