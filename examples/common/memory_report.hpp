// examples/common/memory_report.hpp — a rank's peak memory by category, as the ledger
// books it (the planner's categories: shardlib-plan predicts each of them).
#pragma once
#include <shardlib/core/ledger.hpp>

#include <cstdio>
#include <string>

namespace example {

// One line: "PROGRAM: rank R's peak memory (MiB, ...): parameters 1.234, ...; all at once 4.567".
inline void print_peaks(const char* program, int rank, const shardlib::ledger& l) {
  constexpr double mib = 1024.0 * 1024.0;
  std::string by;
  for (int k = 0; k < shardlib::category_count; ++k) {
    char figure[32];
    std::snprintf(figure, sizeof figure, " %.4g", double(l.peak(shardlib::category(k))) / mib);
    by += (k ? ", " : "") + std::string(shardlib::name(shardlib::category(k))) + figure;
  }
  std::printf("%s: rank %d's peak memory (MiB, each category's own peak): %s; all at once %.4g\n", program, rank,
              by.c_str(), double(l.peak()) / mib);
}

}  // namespace example
