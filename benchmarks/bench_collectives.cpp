// bench_collectives — bandwidth of all_gather, reduce_scatter and all_reduce (nccl-tests
// definitions) for the thread communicator, against W threads running memcpy at once
// measured in the same run. Started under mpirun (and built with MPI), it measures
// the MPI communicator against raw MPI calls instead.
//
//   bench_collectives [--world 2,4] [--min 4096] [--max 268435456] [--json FILE] [--quick]
#include <shardlib/comm/environment.hpp>
#include <shardlib/shardlib.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "common/flags.hpp"
#if SHARDLIB_BENCH_WITH_MPI
#include "collectives_mpi.hpp"
#endif

using namespace shardlib;
using bench::collective;

namespace {

struct options {
  std::vector<int> worlds{2};
  std::size_t min_bytes = 4096, max_bytes = std::size_t(256) << 20;
  double budget_s = 0.25;  // per measured row
  std::FILE* json = nullptr;
};

// Bytes a rank must read plus write, per the shared-memory algorithm of each
// collective (the least any single-copy implementation moves).
double traffic_bytes(collective op, bool in_place, int w, double size) {
  switch (op) {
    case collective::all_gather: return 2 * size * (in_place ? w - 1.0 : w) / w;           // copy the chunks
    case collective::reduce_scatter: return size + size / w;                                  // read all, write one
    case collective::all_reduce: return size + size / w + 2 * size * (w - 1.0) / w;           // both of the above
  }
  return 0;
}

// Median over iterations of the slowest rank's time for fn (after one warm-up call).
template <class Fn>
double timed(comm::ThreadComm& c, std::size_t bytes, double budget_s, Fn&& fn) {
  fn();
  int iters = bench::iterations_for(double(bytes) / 5e9, budget_s);
  std::vector<double> t(iters);
  for (auto& x : t) {
    c.barrier();
    double t0 = bench::now_s();
    fn();
    x = bench::now_s() - t0;
  }
  c.all_reduce(std::span<double>(t), comm::reduce_op::max);  // a collective ends when its slowest rank does
  std::nth_element(t.begin(), t.begin() + iters / 2, t.end());
  return t[iters / 2];
}

// Per-thread memcpy rate (bytes copied per second) with all W threads copying
// `bytes` at once: the physical limit the thread communicator is measured against.
double memcpy_rate(int w, std::size_t bytes, double budget_s) {
  double seconds = 0;
  comm::launch(w, [&](comm::ThreadComm& c) {
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    auto t = timed(c, bytes, budget_s, [&] { std::memcpy(dst.data(), src.data(), bytes); });
    if (c.rank() == 0) seconds = t;
  });
  return double(bytes) / seconds;
}

void run_threads(const options& o) {
  // memcpy rates here are bytes copied per second; STREAM's copy counts each byte read and written (2x).
  std::printf("# single thread memcpy alone, 64 MiB: %.2f GB/s copied\n",
              memcpy_rate(1, std::size_t(64) << 20, 0.3) / 1e9);
  for (int w : o.worlds) {
    std::printf("\n# thread communicator, W = %d ranks (threads); reference: per-thread memcpy rate with %d threads "
                "copying at once\n",
                w, w);
    bench::print_header();
    for (std::size_t size = o.min_bytes; size <= o.max_bytes; size *= 4) {
      const std::size_t n = size / sizeof(float) / w;  // elements per rank chunk
      const std::size_t total = n * w;
      for (collective op : {collective::all_gather, collective::reduce_scatter, collective::all_reduce}) {
        for (bool in_place : {true, false}) {
          const double traffic = traffic_bytes(op, in_place, w, double(total * sizeof(float)));
          const std::size_t copy_bytes = std::size_t(traffic / 2);
          double seconds = 0, copy_seconds = 0;
          comm::launch(w, [&](comm::ThreadComm& c) {
            std::vector<float> big(total, 1.f), small(n, 1.f);
            // The reference: all ranks memcpy what this collective must move, at once,
            // in the same threads and the same run.
            std::vector<char> from(copy_bytes, 1), to(copy_bytes, 0);
            double m = timed(c, copy_bytes, o.budget_s / 2, [&] { std::memcpy(to.data(), from.data(), copy_bytes); });
            std::span<float> all(big);
            std::span<float> mine = all.subspan(c.rank() * n, n);
            double s = 0;
            if (op == collective::all_gather)
              s = timed(c, size, o.budget_s, [&] {
                c.all_gather(std::span<const float>(in_place ? mine : std::span<float>(small)), all);
              });
            else if (op == collective::reduce_scatter)
              s = timed(c, size, o.budget_s, [&] {
                c.reduce_scatter(std::span<const float>(all), in_place ? mine : std::span<float>(small),
                                 comm::reduce_op::sum);
              });
            else {
              std::vector<float> out(total);
              s = timed(c, size, o.budget_s, [&] {
                if (in_place) c.all_reduce(all, comm::reduce_op::sum);
                else c.all_reduce(std::span<const float>(all), std::span<float>(out), comm::reduce_op::sum);
              });
            }
            if (c.rank() == 0) seconds = s, copy_seconds = m;
          });
          bench::row r{"thread", op, in_place, w, total * sizeof(float), seconds};
          const double rate = copy_bytes / copy_seconds;
          const double floor_s = copy_seconds;  // the same bytes through memcpy
          char versus[96];
          std::snprintf(versus, sizeof versus, "%.2fx of memcpy floor (memcpy %.2f GB/s copied/thread)", floor_s / seconds,
                        rate / 1e9);
          bench::print_row(r, versus);
          char extra[128];
          std::snprintf(extra, sizeof extra, ",\"memcpy_GBps\":%.6g,\"floor_ratio\":%.4g", rate / 1e9,
                        floor_s / seconds);
          bench::json_row(o.json, r, extra);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  std::string json;
  bool quick = false;
  example::command_line cli("Bus bandwidth of all_gather, reduce_scatter and all_reduce against memcpy by the same "
                            "threads; under mpirun, MpiComm against raw MPI.",
                            "bench_collectives");
  cli.add_option("--world", o.worlds, "world sizes of rank threads, comma-separated")
      ->delimiter(',')
      ->check(example::whole(2, example::max_thread_ranks));  // one rank moves nothing: no bus bandwidth
  // From 4 KiB, a float per rank at the most ranks, to 4 GiB.
  const CLI::Validator bytes = example::whole(4096, 1LL << 32);
  auto* min = cli.add_option("--min", o.min_bytes, "smallest message, bytes")->check(bytes);
  auto* max = cli.add_option("--max", o.max_bytes, "largest message, bytes (64 MiB with --quick)")->check(bytes);
  cli.add_option("--json", json, "writes one JSON line per measured row");
  cli.add_flag("--quick", quick, "shorter measurements");
  cli.callback([&] {
    if (quick && max->count() == 0) o.max_bytes = std::size_t(64) << 20;
    if (o.min_bytes > o.max_bytes)
      throw CLI::ValidationError(min->get_name(), std::to_string(o.min_bytes) + " is above --max " +
                                                     std::to_string(o.max_bytes));
  });
  cli.parse_or_exit(argc, argv);
  if (quick) o.budget_s = 0.05;
  if (!json.empty()) o.json = std::fopen(json.c_str(), "w");
  try {
#if SHARDLIB_BENCH_WITH_MPI
    if (comm::discover_environment().is_mpi()) {  // OpenMPI's or MPICH's variables
      std::vector<std::size_t> sizes;
      for (std::size_t s = o.min_bytes; s <= o.max_bytes; s *= 4) sizes.push_back(s);
      bench::run_mpi_collectives(sizes, o.json);
      return 0;
    }
#endif
    run_threads(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: %s\n", e.what());
    return 1;
  }
  return 0;
}
