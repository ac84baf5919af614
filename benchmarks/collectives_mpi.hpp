// benchmarks/collectives_mpi.hpp — the MPI communicator against the raw MPI calls
// (MPI_Allgather, MPI_Reduce_scatter_block, MPI_Allreduce) on the same buffers and
// communicator, for bench_collectives started under mpirun.
#pragma once
#include <shardlib/mpi.hpp>

#include <algorithm>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace bench {

namespace mpi_detail {

// Median over iterations of the slowest rank's time for fn, each call started
// together after a barrier; the iteration count follows the slowest warm-up.
template <class Fn>
double timed(MPI_Comm comm, double budget_s, Fn&& fn) {
  double warm = now_s();
  fn();  // first touch; MpiComm creates its shared-memory window here
  warm = now_s() - warm;
  MPI_Allreduce(MPI_IN_PLACE, &warm, 1, MPI_DOUBLE, MPI_MAX, comm);
  std::vector<double> t(std::size_t(iterations_for(warm, budget_s)));
  for (auto& x : t) {
    MPI_Barrier(comm);
    const double t0 = now_s();
    fn();
    x = now_s() - t0;
  }
  MPI_Allreduce(MPI_IN_PLACE, t.data(), int(t.size()), MPI_DOUBLE, MPI_MAX, comm);
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

}  // namespace mpi_detail

// For each size (nccl-tests bytes, float elements): all_gather, reduce_scatter and
// all_reduce, in place and out of place, through MpiComm with its misuse check off
// ("mpi") and through the raw MPI call ("raw-mpi"); at the smallest size also with
// the check on ("mpi+chk"), to show its cost. Rank 0 prints. Initialises MPI if
// the caller has not (and then finalises it before returning).
inline void run_mpi_collectives(const std::vector<std::size_t>& sizes, std::FILE* json) {
  using namespace shardlib;
  comm::mpi_session session;
  auto fast = comm::MpiComm::world({.check = false});
  auto checked = comm::MpiComm::world();
  const MPI_Comm raw = fast.native();
  const int w = fast.size(), me = fast.rank();
  constexpr double budget_s = 0.2;  // per row
  if (me == 0) {
    std::printf("\n# MPI communicator, W = %d processes (reductions through shared memory when all share a node); "
                "reference: the raw MPI call on the same buffers; \"mpi\" rows run with the misuse check off\n",
                w);
    print_header();
  }
  std::string check_costs;
  for (std::size_t size : sizes) {
    const std::size_t n = size / sizeof(float) / std::size_t(w);  // elements per rank's chunk
    const std::size_t total = n * std::size_t(w);
    std::vector<float> big(total, 1.f), small(n, 1.f), out(total);
    const std::span<float> all(big), mine = all.subspan(std::size_t(me) * n, n);
    const int cn = int(n), ct = int(total);
    for (collective op : {collective::all_gather, collective::reduce_scatter, collective::all_reduce}) {
      for (bool in_place : {true, false}) {
        auto through = [&](comm::MpiComm& c) {
          return [&] {
            if (op == collective::all_gather)
              c.all_gather(std::span<const float>(in_place ? mine : std::span(small)), all);
            else if (op == collective::reduce_scatter)
              c.reduce_scatter(std::span<const float>(all), in_place ? mine : std::span(small), comm::reduce_op::sum);
            else if (in_place) c.all_reduce(all, comm::reduce_op::sum);
            else c.all_reduce(std::span<const float>(all), std::span(out), comm::reduce_op::sum);
          };
        };
        // MPI's own in-place forms: its reduce-scatter takes the input from the
        // receive buffer and leaves the result in its first chunk.
        auto direct = [&] {
          auto ok = [&](int rc, const char* call) { comm::detail::mpi_check(rc, call, me, "raw-mpi reference"); };
          if (op == collective::all_gather)
            ok(MPI_Allgather(in_place ? MPI_IN_PLACE : small.data(), cn, MPI_FLOAT, big.data(), cn, MPI_FLOAT, raw),
               "MPI_Allgather");
          else if (op == collective::reduce_scatter)
            ok(MPI_Reduce_scatter_block(in_place ? MPI_IN_PLACE : big.data(), in_place ? big.data() : small.data(), cn,
                                        MPI_FLOAT, MPI_SUM, raw),
               "MPI_Reduce_scatter_block");
          else
            ok(MPI_Allreduce(in_place ? MPI_IN_PLACE : big.data(), in_place ? big.data() : out.data(), ct, MPI_FLOAT,
                             MPI_SUM, raw),
               "MPI_Allreduce");
        };
        const std::size_t bytes = total * sizeof(float);
        const row reference{"raw-mpi", op, in_place, w, bytes, mpi_detail::timed(raw, budget_s, direct)};
        const row ours{"mpi", op, in_place, w, bytes, mpi_detail::timed(raw, budget_s, through(fast))};
        const double ratio = reference.seconds / ours.seconds;
        char versus[64], extra[96];
        if (me == 0) {
          print_row(reference, "reference");
          json_row(json, reference, ",\"check\":false,\"vs_raw_mpi\":1");
          std::snprintf(versus, sizeof versus, "%.2fx raw-mpi", ratio);
          std::snprintf(extra, sizeof extra, ",\"check\":false,\"vs_raw_mpi\":%.4g", ratio);
          print_row(ours, versus);
          json_row(json, ours, extra);
        }
        if (size != sizes.front()) continue;
        const row with_check{"mpi+chk", op, in_place, w, bytes,
                             mpi_detail::timed(raw, budget_s, through(checked))};
        const double cost_us = (with_check.seconds - ours.seconds) * 1e6;
        if (me == 0) {
          std::snprintf(versus, sizeof versus, "%.2fx raw-mpi, check %+.1f us", reference.seconds / with_check.seconds,
                        cost_us);
          std::snprintf(extra, sizeof extra, ",\"check\":true,\"vs_raw_mpi\":%.4g,\"check_cost_us\":%.4g",
                        reference.seconds / with_check.seconds, cost_us);
          print_row(with_check, versus);
          json_row(json, with_check, extra);
          char line[64];
          std::snprintf(line, sizeof line, " %s/%s %+.1f us", name(op), in_place ? "in" : "out", cost_us);
          check_costs += line;
        }
      }
    }
  }
  if (me == 0)
    std::printf("# misuse check (one MPI_Iallreduce of 12 int64 per collective) at %s:%s\n",
                human(sizes.front()).c_str(), check_costs.c_str());
}

}  // namespace bench
