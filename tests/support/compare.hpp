// tests/support/compare.hpp — numeric comparisons that a NaN or an infinity cannot pass.
//
// `worst = std::max(worst, err)` drops a NaN error: every comparison with NaN is false,
// so std::max(0.0, NaN) is 0.0, and a result that is NaN everywhere passes any tolerance.
// Here an error that is NaN, or computed from a value that is not finite, counts as +inf,
// which no finite bound admits, and is counted and located for the failure message:
//
//   test_support::max_error worst;
//   for (std::size_t i = 0; i < want.size(); ++i) worst.relative(got[i], want[i], 1e-3);
//   CHECK(worst <= 1e-5);  // on failure Catch prints "inf (2 not finite, first at 7) <= 1e-05"
//
// Comparisons of finite values are unchanged. Host code only (nvcc compiles it too).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <ostream>
#include <ranges>

namespace test_support {

inline constexpr double infinity = std::numeric_limits<double>::infinity();

// The larger of two values, NaN when either is NaN (std::max(0.0, NaN) is 0: folding
// a scale or a reference's row maximum with it would drop a NaN).
inline double max_keeping_nan(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

// |got - want|; +inf when either is NaN or infinite.
inline double absolute_error(double got, double want) {
  if (!std::isfinite(got) || !std::isfinite(want)) return infinity;
  return std::abs(got - want);
}

// |got - want| / max(|want|, floor): relative above `floor`, absolute (scaled by
// 1 / floor) below it; +inf when either value is NaN or infinite.
inline double relative_error(double got, double want, double floor) {
  if (!std::isfinite(got) || !std::isfinite(want)) return infinity;
  if (got == want) return 0;
  const double e = std::abs(got - want) / std::max(floor, std::abs(want));
  return std::isnan(e) ? infinity : e;  // floor 0 with want 0: not a relative error
}

// The largest of many errors, a NaN error counted as +inf. Remembers which one (its
// position in the order added, from 0) was the largest and which was the first that
// was not finite, for the failure message.
class max_error {
 public:
  static constexpr std::size_t none = std::size_t(-1);

  // Adds one error (NaN and +inf alike count as +inf).
  void add(double err) { add(err, nan, nan); }
  void absolute(double got, double want) { add(absolute_error(got, want), got, want); }
  void relative(double got, double want, double floor) { add(relative_error(got, want, floor), got, want); }
  // Element by element; different sizes count as one +inf error.
  template <std::ranges::sized_range Got, std::ranges::sized_range Want>
  void absolute(const Got& got, const Want& want) {
    if (std::ranges::size(got) != std::ranges::size(want)) return add(infinity);
    auto g = std::ranges::begin(got);
    for (const auto& w : want) absolute(double(*g++), double(w));
  }
  template <std::ranges::sized_range Got, std::ranges::sized_range Want>
  void relative(const Got& got, const Want& want, double floor) {
    if (std::ranges::size(got) != std::ranges::size(want)) return add(infinity);
    auto g = std::ranges::begin(got);
    for (const auto& w : want) relative(double(*g++), double(w), floor);
  }
  // Merges another accumulator's errors in as if added after this one's.
  void add(const max_error& other) {
    if (other.nonfinite_ && !nonfinite_) first_nonfinite_ = count_ + other.first_nonfinite_;
    if (other.worst_at_ != none && (worst_at_ == none || other.worst_ > worst_)) {
      worst_ = other.worst_;
      worst_at_ = count_ + other.worst_at_;
      got_ = other.got_;
      want_ = other.want_;
    }
    nonfinite_ += other.nonfinite_;
    count_ += other.count_;
  }

  double value() const { return worst_; }  // 0 when nothing was added
  std::size_t count() const { return count_; }
  std::size_t nonfinite() const { return nonfinite_; }
  std::size_t worst_at() const { return worst_at_; }
  std::size_t first_nonfinite() const { return first_nonfinite_; }

  // CHECK(worst <= tol): false for any NaN or infinity added.
  friend bool operator<=(const max_error& e, double bound) { return e.worst_ <= bound; }
  friend bool operator<(const max_error& e, double bound) { return e.worst_ < bound; }
  friend bool operator==(const max_error& e, double v) { return e.worst_ == v; }
  // "1.2e-06 (at 7 of 40: got 0.5000006, want 0.5)"; "inf (2 not finite, first at 3)".
  friend std::ostream& operator<<(std::ostream& os, const max_error& e) {
    os << e.worst_;
    if (e.nonfinite_) os << " (" << e.nonfinite_ << " not finite, first at " << e.first_nonfinite_ << ")";
    else if (e.worst_at_ != none) {
      os << " (at " << e.worst_at_ << " of " << e.count_;
      if (!std::isnan(e.want_)) {
        const auto digits = os.precision(9);  // a float's round trip
        os << ": got " << e.got_ << ", want " << e.want_;
        os.precision(digits);
      }
      os << ")";
    }
    return os;
  }

 private:
  static constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  void add(double err, double got, double want) {
    const std::size_t at = count_++;
    if (!std::isfinite(err)) {
      err = infinity;
      if (nonfinite_++ == 0) first_nonfinite_ = at;
    }
    if (worst_at_ == none || err > worst_) {
      worst_ = err;
      worst_at_ = at;
      got_ = got;
      want_ = want;
    }
  }

  double worst_ = 0, got_ = nan, want_ = nan;
  std::size_t count_ = 0, nonfinite_ = 0, worst_at_ = none, first_nonfinite_ = none;
};

// Normwise error: the largest |got - want| over the largest |want| (1 when want is all
// zero). A reference that is not finite fails too: its scale could not be trusted.
template <std::ranges::sized_range Got, std::ranges::sized_range Want>
max_error normwise_error(const Got& got, const Want& want) {
  double scale = 0;
  bool finite = true;
  for (const auto& w : want) {
    const double a = std::abs(double(w));
    finite = finite && std::isfinite(a);
    scale = max_keeping_nan(scale, a);
  }
  max_error e;
  if (!finite) e.add(infinity);
  else e.relative(got, want, scale > 0 ? scale : 1.0);
  return e;
}

// The difference's 2-norm relative to want's: ||got - want|| / ||want||; +inf when the
// sizes differ or any value is NaN or infinite.
template <std::ranges::sized_range Got, std::ranges::sized_range Want>
double relative_norm_error(const Got& got, const Want& want) {
  if (std::ranges::size(got) != std::ranges::size(want)) return infinity;
  double diff = 0, norm = 0;
  auto g = std::ranges::begin(got);
  for (const auto& w : want) {
    const double d = double(*g++) - double(w);
    diff += d * d;
    norm += double(w) * double(w);
  }
  const double e = std::sqrt(diff / norm);
  return std::isfinite(e) ? e : (diff == 0 && std::isfinite(norm) ? 0.0 : infinity);
}

}  // namespace test_support
