// shardlib/config.hpp — version and the host/device function marker.
// Every shardlib header includes this first.
#pragma once

#define SHARDLIB_VERSION_MAJOR 0
#define SHARDLIB_VERSION_MINOR 1
#define SHARDLIB_VERSION_PATCH 0

// Functions that run on both host and device (per-element math shared by the
// host ops and the CUDA kernels) carry SHARDLIB_HD. Under nvcc it expands to
// __host__ __device__; under a host compiler to nothing.
#if defined(__CUDACC__)
#define SHARDLIB_HD __host__ __device__
#else
#define SHARDLIB_HD
#endif

namespace shardlib {
inline constexpr int version_major = SHARDLIB_VERSION_MAJOR;
inline constexpr int version_minor = SHARDLIB_VERSION_MINOR;
inline constexpr int version_patch = SHARDLIB_VERSION_PATCH;
}  // namespace shardlib
