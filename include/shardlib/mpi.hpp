// shardlib/mpi.hpp — the MPI backend: MpiComm and mpi_session (link shardlib::mpi).
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/mpi_comm.hpp"
#include "shardlib/comm/reduce.hpp"
#include "shardlib/comm/work.hpp"
