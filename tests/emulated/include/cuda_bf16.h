// tests/emulated/include/cuda_bf16.h — stands in for CUDA's header in the emulated tests.
#pragma once
#include "../cuda_emulator.hpp"
