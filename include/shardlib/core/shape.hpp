// shardlib/core/shape.hpp — Shape: up to 8 extents, row-major.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <algorithm>         // std::equal
#include <array>             // std::array
#include <cstdint>           // std::int64_t
#include <initializer_list>  // std::initializer_list
#include <ostream>           // std::ostream
#include <span>              // std::span
#include <string>            // std::string

namespace shardlib {

class Shape {
 public:
  static constexpr int max_rank = 8;
  // Most elements a shape may hold, counting its nonzero extents only (so that no
  // partial product overflows whatever the order): bytes of 8-byte elements fit an int64.
  static constexpr std::int64_t max_numel = std::int64_t(1) << 60;

  constexpr Shape() = default;
  Shape(std::initializer_list<std::int64_t> extents) { assign(extents); }
  explicit Shape(std::span<const std::int64_t> extents) { assign(extents); }

  constexpr int rank() const { return rank_; }
  constexpr std::int64_t operator[](int i) const { return extents_[i]; }
  constexpr std::int64_t& operator[](int i) { return extents_[i]; }
  constexpr std::span<const std::int64_t> extents() const { return {extents_.data(), std::size_t(rank_)}; }

  // Number of elements (1 for a scalar of rank 0).
  constexpr std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= extents_[i];
    return n;
  }

  friend constexpr bool operator==(const Shape& a, const Shape& b) {
    return a.rank_ == b.rank_ && std::equal(a.extents_.begin(), a.extents_.begin() + a.rank_, b.extents_.begin());
  }

  friend std::ostream& operator<<(std::ostream& os, const Shape& s) {
    os << '[';
    for (int i = 0; i < s.rank_; ++i) os << (i ? ", " : "") << s.extents_[i];
    return os << ']';
  }

 private:
  template <class Range>
  void assign(const Range& extents) {
    require<shape_error>(extents.size() <= max_rank, "Shape: rank ", extents.size(), " exceeds the maximum ", max_rank);
    std::int64_t nonzero = 1;
    for (std::int64_t e : extents) {
      require<shape_error>(e >= 0, "Shape: extent ", e, " is negative");
      extents_[rank_++] = e;
      if (e == 0) continue;
      // Checked before it is formed: an int64 product that wrapped would size a small buffer.
      if (e > max_numel / nonzero) {
        std::string all;
        for (std::int64_t x : extents) all += cat(all.empty() ? "" : ", ", x);
        throw shape_error(cat("Shape [", all, "]: more than 2^60 elements (its nonzero extents' product)"));
      }
      nonzero *= e;
    }
  }

  std::array<std::int64_t, max_rank> extents_{};
  int rank_ = 0;
};

}  // namespace shardlib
