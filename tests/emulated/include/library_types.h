// tests/emulated/include/library_types.h — stands in for CUDA's header in the emulated tests.
#pragma once

enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
