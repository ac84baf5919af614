// benchmarks/bench_cuda.cu compiled by the host compiler and run on the CPU by the emulator
// (with --quick): the GPU benchmark's flags, tables and JSON lines tried before a GPU is.
#include "bench_cuda.cu"
#include "../dynamic_shared.hpp"  // the fused attention's shared memory
