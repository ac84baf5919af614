// bench_optim — the fused host optimizer step on large spans, single-threaded, against
// memcpy measured in the same run. The step is memory-bound, so its limit is the
// memory traffic rate: bytes read plus written per parameter (Adam in fp32: read
// p, g, m, v = 16, write p, m, v = 12, so 28) over the time, against memcpy's
// (2 x bytes copied, on buffers that move the same traffic). An in-place step can
// beat memcpy's figure: memcpy's stores also read their destination lines first,
// traffic the definition does not count, while the step's stores hit lines it has
// just read. Built without -fno-math-errno, Adam's square root is the exact
// emulation of optim::detail::sqrt_rn, whose arithmetic can make Adam compute-bound.
//
//   bench_optim [--sizes 16,64] (millions of parameters, 2^20) [--json FILE] [--quick]
#include <shardlib/optim/adam.hpp>
#include <shardlib/optim/sgd.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "common/flags.hpp"

using namespace shardlib;

namespace {

struct options {
  std::vector<std::size_t> sizes{16, 64};  // in 2^20 parameters
  double budget_s = 2.0;                   // per measured row
  std::FILE* json = nullptr;
};

// Median seconds per call of step and of a memcpy moving the same traffic, calls
// alternating so that both see the same machine (other processes, frequency).
struct timing {
  double step_s, memcpy_s;
};
template <class Step>
timing timed(std::size_t traffic, double budget_s, Step&& step) {
  std::vector<char> src(traffic / 2, 1), dst(traffic / 2, 0);
  auto copy = [&] { std::memcpy(dst.data(), src.data(), src.size()); };
  step();  // warm-up: faults the pages in
  copy();
  const int iters = bench::iterations_for(2.0 * double(traffic) / 10e9, budget_s);
  std::vector<double> a(iters), b(iters);
  for (int i = 0; i < iters; ++i) {
    a[i] = bench::median_seconds(1, step);
    b[i] = bench::median_seconds(1, copy);
  }
  std::nth_element(a.begin(), a.begin() + iters / 2, a.end());
  std::nth_element(b.begin(), b.begin() + iters / 2, b.end());
  return {a[iters / 2], b[iters / 2]};
}

struct row {
  std::string optimizer, grad_dtype;
  std::size_t params;
  double bytes_per_param;  // traffic per parameter
  timing t;
  double traffic() const { return bytes_per_param * double(params); }
  double bps() const { return traffic() / t.step_s; }
  double memcpy_bps() const { return traffic() / t.memcpy_s; }
};

void report(const row& r, std::FILE* json) {
  std::printf("%-14s %-5s %6zuM %10.2f %12.1f %10.2f %10.2f %8.2fx\n", r.optimizer.c_str(), r.grad_dtype.c_str(),
              r.params >> 20, r.t.step_s * 1e3, double(r.params) / r.t.step_s / 1e6, r.bps() / 1e9,
              r.memcpy_bps() / 1e9, r.bps() / r.memcpy_bps());
  if (!json) return;
  std::fprintf(json,
               "{\"bench\":\"optim\",\"optimizer\":\"%s\",\"grad_dtype\":\"%s\",\"params\":%zu,\"bytes_per_param\":%g,"
               "\"seconds\":%.9g,\"params_per_s\":%.6g,\"GBps\":%.6g,\"memcpy_GBps\":%.6g,\"vs_memcpy\":%.4g}\n",
               r.optimizer.c_str(), r.grad_dtype.c_str(), r.params, r.bytes_per_param, r.t.step_s,
               double(r.params) / r.t.step_s, r.bps() / 1e9, r.memcpy_bps() / 1e9, r.bps() / r.memcpy_bps());
  std::fflush(json);
}

// One optimizer on n parameters with gradients of type G; bytes_per_param is its traffic.
template <class O, class G>
row measure(const char* label, O opt, std::size_t n, double bytes_per_param, double budget_s) {
  std::vector<float> p(n, 0.5f);
  std::vector<G> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = G(float(int(i % 2001) - 1000) * 1e-3f);
  auto s = opt.make_state(n);
  const auto t = timed(std::size_t(bytes_per_param) * n, budget_s, [&] { opt.step(p, std::span<const G>(g), s); });
  return {label, std::string(name(dtype_of<G>)), n, bytes_per_param, t};
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  std::string json;
  bool quick = false;
  example::command_line cli("The fused host optimizer step on large spans, one thread, against memcpy.",
                            "bench_optim");
  // Up to 2^30 parameters: Adam's buffers of them take 16 GiB, the memcpy reference's 28-36 GiB more.
  cli.add_option("--sizes", o.sizes, "parameters, in 2^20, comma-separated")
      ->delimiter(',')
      ->check(example::whole(1, 1024));
  cli.add_option("--json", json, "appends one JSON line per measured row");
  cli.add_flag("--quick", quick, "shorter measurements");
  cli.parse_or_exit(argc, argv);
  if (quick) o.budget_s = 0.4;
  if (!json.empty()) o.json = std::fopen(json.c_str(), "a");
  std::printf("fused host optimizer step, one thread; traffic = bytes read + written; memcpy moves the same "
              "traffic per call\n");
  std::printf("%-14s %-5s %7s %10s %12s %10s %10s %9s\n", "optimizer", "grad", "params", "step_ms", "Mparams/s",
              "GB/s", "memcpy", "vs memcpy");
  for (std::size_t m : o.sizes) {
    const std::size_t n = m << 20;
    // Adam: read p, g, m, v (16 B), write p, m, v (12 B); amsgrad adds vmax (4 + 4);
    // bfloat16 gradients read 2 B instead of 4; SGD with momentum: read p, g, buf, write p, buf.
    report(measure<optim::Adam, float>("Adam", {}, n, 28, o.budget_s), o.json);
    report(measure<optim::AdamW, float>("AdamW", {}, n, 28, o.budget_s), o.json);
    report(measure<optim::Adam, bfloat16>("Adam", {}, n, 26, o.budget_s), o.json);
    report(measure<optim::Adam, float>("Adam amsgrad", {{.amsgrad = true}}, n, 36, o.budget_s), o.json);
    report(measure<optim::SGD, float>("SGD momentum", {{.momentum = 0.9}}, n, 20, o.budget_s), o.json);
  }
  if (o.json) std::fclose(o.json);
  return 0;
}
