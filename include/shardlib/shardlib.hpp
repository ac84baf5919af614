// shardlib/shardlib.hpp — the host umbrella: core types, the thread communicator and
// launch, sharded tensors. MPI, CUDA and NCCL have their own umbrellas
// (shardlib/mpi.hpp, shardlib/cuda.hpp, shardlib/nccl.hpp).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"    // Communicator, reduce_op
#include "shardlib/comm/launch.hpp"          // launch, rank_failure
#include "shardlib/comm/thread_comm.hpp"     // ThreadComm
#include "shardlib/core/buffer.hpp"          // Buffer
#include "shardlib/core/element.hpp"         // bfloat16, half, dtype
#include "shardlib/core/error.hpp"           // error and subclasses
#include "shardlib/core/ledger.hpp"          // ledger, category
#include "shardlib/core/memory_space.hpp"    // host_space, can_access
#include "shardlib/core/shape.hpp"           // Shape
#include "shardlib/core/tensor.hpp"          // Tensor (owning, shared), TensorView
#include "shardlib/shard/sharded_tensor.hpp" // shard_layout, ShardedTensor
