// Host interface of the device-side test kernels (element_kernels.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// Empty when a CUDA device is usable; otherwise why not.
std::string cuda_device_problem();

struct device_round_trip {
  std::vector<std::uint16_t> bits;  // every 16-bit pattern
  std::vector<float> bf16_to_float, half_to_float;
  std::vector<std::uint16_t> bf16_back, half_back;  // float -> 16-bit on the device
};
device_round_trip run_device_round_trip();
std::vector<int> run_device_locate(std::size_t numel, int world);
