// tests/emulated/include/cuda_runtime.h — stands in for CUDA's header in the emulated tests.
#pragma once
#include "../cuda_emulator.hpp"
#include "../cuda_runtime_api.hpp"
