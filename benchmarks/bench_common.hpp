// benchmarks/bench_common.hpp — timing, nccl-tests bandwidth definitions, the memcpy
// reference, and output as a table and as JSON lines.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace bench {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Iterations so that one size takes about `budget_s`, between 2 and 200.
inline int iterations_for(double one_s, double budget_s) {
  return std::clamp(int(budget_s / std::max(one_s, 1e-7)), 2, 200);
}

// nccl-tests definitions (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
// size is the total buffer (all_gather: the receive buffer, reduce_scatter: the send
// buffer, all_reduce: the buffer); algbw = size / time; busbw = algbw * factor.
enum class collective { all_gather, reduce_scatter, all_reduce };
inline const char* name(collective c) {
  return c == collective::all_gather ? "all_gather" : c == collective::reduce_scatter ? "reduce_scatter" : "all_reduce";
}
inline double bus_factor(collective c, int w) {
  return c == collective::all_reduce ? 2.0 * (w - 1) / w : double(w - 1) / w;
}

// One measured row.
struct row {
  std::string comm;  // "thread", "mpi", "raw-mpi"
  collective op;
  bool in_place;
  int world;
  std::size_t bytes;  // the nccl-tests size
  double seconds;     // per call, median over iterations
  double algbw() const { return bytes / seconds / 1e9; }
  double busbw() const { return algbw() * bus_factor(op, world); }
};

// Median of per-call times of fn() over `iters` calls (fn is one collective).
template <class Fn>
double median_seconds(int iters, Fn&& fn) {
  std::vector<double> t(iters);
  for (auto& x : t) {
    double t0 = now_s();
    fn();
    x = now_s() - t0;
  }
  std::nth_element(t.begin(), t.begin() + iters / 2, t.end());
  return t[iters / 2];
}

inline std::string human(std::size_t bytes) {
  char b[32];
  if (bytes >= (1u << 20)) std::snprintf(b, sizeof b, "%zu MiB", bytes >> 20);
  else std::snprintf(b, sizeof b, "%zu KiB", bytes >> 10);
  return b;
}

inline void print_header() {
  std::printf("%-8s %-15s %-5s %3s %10s %12s %10s %10s  %s\n", "comm", "collective", "place", "W", "size", "time_us",
              "algbw", "busbw", "vs reference");
}

// ref_label/ratio: what the row is measured against (e.g. "0.91x memcpy/thread").
inline void print_row(const row& r, const std::string& versus) {
  std::printf("%-8s %-15s %-5s %3d %10s %12.1f %10.2f %10.2f  %s\n", r.comm.c_str(), name(r.op),
              r.in_place ? "in" : "out", r.world, human(r.bytes).c_str(), r.seconds * 1e6, r.algbw(), r.busbw(),
              versus.c_str());
}

inline void json_row(std::FILE* f, const row& r, const std::string& extra) {
  if (!f) return;
  std::fprintf(f,
               "{\"bench\":\"collectives\",\"comm\":\"%s\",\"op\":\"%s\",\"in_place\":%s,\"world\":%d,\"bytes\":%zu,"
               "\"seconds\":%.9g,\"algbw_GBps\":%.6g,\"busbw_GBps\":%.6g%s}\n",
               r.comm.c_str(), name(r.op), r.in_place ? "true" : "false", r.world, r.bytes, r.seconds, r.algbw(),
               r.busbw(), extra.c_str());
  std::fflush(f);
}

}  // namespace bench
