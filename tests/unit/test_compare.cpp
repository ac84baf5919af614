// The tests' numeric comparison (tests/support/compare.hpp): a NaN or an infinity
// anywhere fails every bound, where `std::max(worst, err)` let an all-NaN result pass.
#include "support/compare.hpp"
#include "support/gradcheck.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

namespace test_compare {

using test_support::max_error;

namespace {
constexpr double qnan = std::numeric_limits<double>::quiet_NaN();
constexpr double inf = std::numeric_limits<double>::infinity();

std::string text(const max_error& e) {
  std::ostringstream os;
  os << e;
  return os.str();
}
}  // namespace

TEST_CASE("std::max drops a NaN error, which is why the tests do not use it", "[compare]") {
  double worst = 0;
  for (double err : {qnan, qnan, qnan}) worst = std::max(worst, err);
  CHECK(worst == 0);  // an all-NaN result would have passed `worst <= 1e-5`
}

TEST_CASE("gradcheck's norm-wise error is NaN, never 0, when either side holds a NaN", "[compare]") {
  CHECK(gradcheck::rel_error({0.0, 0.0}, {0.0, 0.0}) == 0);
  CHECK(gradcheck::rel_error({3.0, 4.0}, {3.0, 4.0}) == 0);
  CHECK(std::isnan(gradcheck::rel_error({0.0, 0.0}, {qnan, 0.0})));  // the analytic side all zeros
  CHECK(std::isnan(gradcheck::rel_error({qnan, 0.0}, {0.0, 0.0})));
  CHECK(std::isnan(gradcheck::rel_error({1.0, 2.0}, {1.0, qnan})));
  CHECK_FALSE(gradcheck::rel_error({0.0}, {qnan}) < 1e-6);
}

TEST_CASE("max_error fails every bound once a NaN error is added", "[compare]") {
  for (int at : {0, 1, 3}) {
    INFO("NaN at " << at);
    max_error worst;
    for (int i = 0; i < 4; ++i) worst.add(i == at ? qnan : 1e-7);
    CHECK(worst.value() == inf);
    CHECK_FALSE(worst <= 1e-5);
    CHECK_FALSE(worst < 1e300);
    CHECK_FALSE(worst == 0);
    CHECK(worst.nonfinite() == 1);
    CHECK(worst.first_nonfinite() == std::size_t(at));
    CHECK(worst.count() == 4);
    CHECK(text(worst) == "inf (1 not finite, first at " + std::to_string(at) + ")");
  }
}

TEST_CASE("max_error fails every bound on an infinite error", "[compare]") {
  max_error worst;
  worst.add(0.5);
  worst.add(inf);
  worst.add(-inf);  // not an error anyone computes, but not a pass either
  CHECK(worst.value() == inf);
  CHECK_FALSE(worst <= 1e300);
  CHECK(worst.nonfinite() == 2);
  CHECK(worst.first_nonfinite() == 1);
}

TEST_CASE("NaN or infinite values compared fail, on either side", "[compare]") {
  const std::vector<float> want{1.0f, -2.0f, 0.0f, 3.5f};
  const float fnan = std::numeric_limits<float>::quiet_NaN(), finf = std::numeric_limits<float>::infinity();
  SECTION("an all-NaN result") {
    const std::vector<float> got(want.size(), fnan);
    max_error rel, abs;
    rel.relative(got, want, 1e-3);
    abs.absolute(got, want);
    CHECK_FALSE(rel <= 1e-5);
    CHECK_FALSE(abs <= 1e-5);
    CHECK(rel.nonfinite() == want.size());
    CHECK(abs.nonfinite() == want.size());
  }
  SECTION("one NaN or infinity in the result") {
    for (float bad : {fnan, finf, -finf}) {
      std::vector<float> got = want;
      got[2] = bad;
      max_error worst;
      worst.relative(got, want, 1e-3);
      INFO(bad);
      CHECK_FALSE(worst <= 1e-5);
      CHECK(worst.first_nonfinite() == 2);
    }
  }
  SECTION("NaN or infinity in the reference") {
    for (double bad : {qnan, inf}) {
      CHECK(test_support::relative_error(1.0, bad, 1e-6) == inf);
      CHECK(test_support::relative_error(bad, bad, 1e-6) == inf);  // equal infinities are not a match either
      CHECK(test_support::absolute_error(1.0, bad) == inf);
    }
  }
  SECTION("different sizes") {
    max_error worst;
    worst.relative(std::vector<float>{1.0f}, want, 1e-3);
    CHECK_FALSE(worst <= 1e-5);
  }
}

TEST_CASE("finite comparisons are the usual ones", "[compare]") {
  CHECK(test_support::relative_error(1.1, 1.0, 1e-6) == Approx(0.1));
  CHECK(test_support::relative_error(2e-4, 1e-4, 1e-3) == Approx(0.1));  // below the floor: absolute / floor
  CHECK(test_support::relative_error(0.0, 0.0, 0.0) == 0);               // equal, even with no floor
  CHECK(test_support::absolute_error(-1.0, 2.0) == 3);

  max_error worst;
  CHECK(worst.value() == 0);  // nothing compared
  worst.relative(std::vector<double>{1.0, 2.2, 3.0}, std::vector<double>{1.0, 2.0, 3.0}, 1e-6);
  CHECK(worst.value() == Approx(0.1));
  CHECK(worst.worst_at() == 1);
  CHECK(worst.nonfinite() == 0);
  CHECK(worst <= 0.11);
  CHECK_FALSE(worst <= 0.09);
  CHECK(text(worst) == "0.1 (at 1 of 3: got 2.2, want 2)");

  max_error other;  // merged: positions continue after this one's
  other.add(0.01);
  other.add(qnan);
  worst.add(other);
  CHECK(worst.count() == 5);
  CHECK(worst.value() == inf);
  CHECK(worst.first_nonfinite() == 4);
}

TEST_CASE("relative_norm_error is the difference's 2-norm over want's, and no NaN passes it", "[compare]") {
  using test_support::relative_norm_error;
  const std::vector<double> want{3.0, 4.0};  // norm 5
  CHECK(relative_norm_error(std::vector<double>{3.0, 4.5}, want) == Approx(0.1));
  CHECK(relative_norm_error(want, want) == 0);
  CHECK(relative_norm_error(std::vector<double>{0.0}, std::vector<double>{0.0}) == 0);  // equal zeros
  CHECK(relative_norm_error(std::vector<double>{1e-9}, std::vector<double>{0.0}) == inf);
  CHECK(relative_norm_error(std::vector<double>{3.0, qnan}, want) == inf);
  CHECK(relative_norm_error(want, std::vector<double>{3.0, qnan}) == inf);
  CHECK(relative_norm_error(std::vector<double>{3.0, inf}, want) == inf);
  CHECK(relative_norm_error(std::vector<double>{3.0}, want) == inf);  // sizes differ
}

}  // namespace test_compare
