// NcclComm's device tests (tests/cuda/test_nccl.cpp: the Communicator conformance suite
// at world size 1 and over the emulated machine's four devices, one thread each,
// errors instead of hangs, torchrun's bootstrap), compiled by the host compiler and run
// on the CPU against include/nccl.h's thread-rank communicators.
#include "cuda/test_nccl.cpp"
