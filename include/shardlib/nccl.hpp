// shardlib/nccl.hpp — the NCCL umbrella: NcclComm, collectives over device
// buffers (link shardlib::nccl). Host-only: compiles with any C++20 compiler.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/nccl_comm.hpp"      // NcclComm, nccl_work, nccl_options
#include "shardlib/cuda/caching_allocator.hpp"  // caching_allocator, device_buffer
#include "shardlib/cuda/copy.hpp"           // copy_async
#include "shardlib/cuda/memory_space.hpp"   // cuda_space, pinned_space
#include "shardlib/cuda/stream.hpp"         // stream, event, device_guard
