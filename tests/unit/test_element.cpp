// Tests for shardlib/core/element.hpp: bfloat16/half conversions, dtype tags,
// element_cast.
//
// The expected bit patterns follow CUDA 13's cuda_fp16.hpp / cuda_bf16.hpp.
// Cross-checked outside this suite (a throwaway host-only program built with
// g++ -I/usr/local/cuda/include, calling the host code paths of CUDA's
// __float2half, __float2bfloat16, __double2half, __double2bfloat16,
// __half2float and __bfloat162float): all 2^32 float bit patterns and all
// 65536 16-bit patterns matched bit for bit, as did 10^8 doubles (random bit
// patterns, random exponents near the 16-bit ranges, patterns next to ties).
// Not a unit test because it needs the CUDA headers and takes ~25 s.
#include <catch2/catch.hpp>

#include "shardlib/core/element.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>

namespace test_element {

using shardlib::bfloat16;
using shardlib::dtype;
using shardlib::element_cast;
using shardlib::half;

namespace {

float f_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint32_t bits_f(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
double d_bits(std::uint64_t u) {
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
}

// A 16-bit IEEE-style format, described for the independent reference below.
struct format {
  int exp_bits, man_bits;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  int emin() const { return 1 - bias(); }
  double max_finite() const { return std::ldexp(2.0 - std::ldexp(1.0, -man_bits), bias()); }
};
constexpr format half_fmt{5, 10};
constexpr format bf16_fmt{8, 7};

// Slow reference rounding, written without looking at the bits: scale x so
// the target's quantum at x's binade is 1, round with std::nearbyint (the
// default mode is to-nearest-even), scale back. All steps are exact in double
// for float inputs, and for double inputs in or near the 16-bit ranges.
double ref_round(double x, format f) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const int E = std::max(e - 1, f.emin());
  const double q = std::ldexp(1.0, E - f.man_bits);
  const double r = std::nearbyint(x / q) * q;
  if (std::fabs(r) > f.max_finite()) return std::copysign(HUGE_VAL, x);
  return std::copysign(r, x);  // keeps the sign of values that round to 0
}

// Reference decoding of a 16-bit pattern to double.
double ref_decode(std::uint16_t b, format f) {
  const int e = (b >> f.man_bits) & ((1 << f.exp_bits) - 1);
  const int m = b & ((1 << f.man_bits) - 1);
  const double s = (b & 0x8000) != 0 ? -1.0 : 1.0;
  if (e == (1 << f.exp_bits) - 1) return m != 0 ? std::numeric_limits<double>::quiet_NaN() : s * HUGE_VAL;
  if (e == 0) return s * std::ldexp(m, f.emin() - f.man_bits);
  return s * std::ldexp(m + (1 << f.man_bits), e - f.bias() - f.man_bits);
}

// Compares one conversion result against the reference; records the first
// mismatch in `first` and counts them.
template <class T>
void compare(double x, std::uint16_t got, format f, long& bad, std::string& first) {
  bool ok;
  if (std::isnan(x)) {
    ok = got == 0x7FFF;
  } else {
    const double want = ref_round(x, f), have = ref_decode(got, f);
    ok = !std::isnan(have) && want == have && std::signbit(want) == std::signbit(have);
  }
  if (!ok && bad++ == 0) {
    std::ostringstream os;
    os.precision(17);
    os << (std::is_same_v<T, half> ? "half" : "bf16") << " of " << x << " gave 0x" << std::hex << got;
    first = os.str();
  }
}

}  // namespace

// ---------------------------------------------------------------------------

static_assert(sizeof(half) == 2 && alignof(half) == 2 && sizeof(bfloat16) == 2 && alignof(bfloat16) == 2);
static_assert(std::is_trivially_copyable_v<half> && std::is_standard_layout_v<half>);
static_assert(std::is_trivially_copyable_v<bfloat16> && std::is_standard_layout_v<bfloat16>);
static_assert(std::is_trivially_default_constructible_v<half>);
// The conversions are usable in constant expressions.
static_assert(half(1.0f).bits == 0x3C00 && bfloat16(1.0f).bits == 0x3F80);
static_assert(half(0.1).bits == 0x2E66 && bfloat16(0.1).bits == 0x3DCD);
static_assert(float(half::from_bits(0x0001)) == 0x1p-24f);
static_assert(element_cast<double>(bfloat16(-2.5f)) == -2.5);
// Mixed arithmetic resolves to float; same-type arithmetic stays 16-bit.
static_assert(std::is_same_v<decltype(half{} + 1.0f), float>);
static_assert(std::is_same_v<decltype(half{} + half{}), half>);
static_assert(std::is_same_v<decltype(bfloat16{} * bfloat16{}), bfloat16>);
static_assert(!std::is_convertible_v<float, half>);  // constructors are explicit
static_assert(std::is_convertible_v<half, float>);

TEST_CASE("known bit patterns", "[element]") {
  CHECK(half(1.0f).bits == 0x3C00);
  CHECK(bfloat16(1.0f).bits == 0x3F80);
  CHECK(half(-2.0f).bits == 0xC000);
  CHECK(bfloat16(-2.0f).bits == 0xC000);
  CHECK(half(0.5f).bits == 0x3800);
  CHECK(half(0.1f).bits == 0x2E66);
  CHECK(bfloat16(0.1f).bits == 0x3DCD);
  CHECK(bfloat16(3.140625f).bits == 0x4049);
  CHECK(half(65504.0f).bits == 0x7BFF);               // half max
  CHECK(half(std::ldexp(1.0f, -14)).bits == 0x0400);  // smallest normal
  CHECK(float(half::from_bits(0x3C00)) == 1.0f);
  CHECK(float(half::from_bits(0x7BFF)) == 65504.0f);
  CHECK(float(half::from_bits(0x3555)) == 0x1.554p-2f);
  CHECK(float(bfloat16::from_bits(0x4049)) == 3.140625f);
  CHECK(float(bfloat16::from_bits(0x7F7F)) == 0x1.FEp127f);  // bf16 max
}

TEST_CASE("ties round to even", "[element]") {
  // bf16 keeps the top 16 bits of a float; the low 16 decide the rounding.
  CHECK(bfloat16(f_bits(0x3F808000)).bits == 0x3F80);  // tie, even stays
  CHECK(bfloat16(f_bits(0x3F818000)).bits == 0x3F82);  // tie, odd goes up
  CHECK(bfloat16(f_bits(0x3F808001)).bits == 0x3F81);  // above the tie
  CHECK(bfloat16(f_bits(0x3F807FFF)).bits == 0x3F80);  // below the tie
  CHECK(bfloat16(f_bits(0xBF818000)).bits == 0xBF82);  // negative, symmetric
  CHECK(bfloat16(f_bits(0x3FFF8000)).bits == 0x4000);  // carry into the exponent
  // half: the ulp at 1 is 2^-10.
  CHECK(half(1.0f + 0x1p-11f).bits == 0x3C00);
  CHECK(half(1.0f + 3 * 0x1p-11f).bits == 0x3C02);
  CHECK(half(1.0f + 0x1p-11f + 0x1p-23f).bits == 0x3C01);
  CHECK(half(2048.0f + 1.0f).bits == 0x6800);  // 2049: tie at ulp 2 -> 2048
  CHECK(half(2048.0f + 3.0f).bits == 0x6802);  // 2051: tie -> 2052
}

TEST_CASE("overflow and infinities", "[element]") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(half(inf).bits == 0x7C00);
  CHECK(half(-inf).bits == 0xFC00);
  CHECK(bfloat16(inf).bits == 0x7F80);
  CHECK(bfloat16(-inf).bits == 0xFF80);
  CHECK(half(double(inf)).bits == 0x7C00);
  CHECK(bfloat16(-double(inf)).bits == 0xFF80);
  // half: 65504 + half an ulp (16) = 65520 is a tie with an odd max: infinity.
  CHECK(half(65519.0f).bits == 0x7BFF);
  CHECK(half(f_bits(0x477FEFFF)).bits == 0x7BFF);  // largest float below 65520
  CHECK(half(65520.0f).bits == 0x7C00);
  CHECK(half(-65520.0f).bits == 0xFC00);
  CHECK(half(1e10f).bits == 0x7C00);
  CHECK(half(std::numeric_limits<float>::max()).bits == 0x7C00);
  CHECK(half(65519.99999).bits == 0x7BFF);
  CHECK(half(65520.0).bits == 0x7C00);
  CHECK(half(1e300).bits == 0x7C00);
  CHECK(half(-1e300).bits == 0xFC00);
  // bf16: max 0x7F7F; FLT_MAX is past its tie.
  CHECK(bfloat16(f_bits(0x7F7F7FFF)).bits == 0x7F7F);
  CHECK(bfloat16(f_bits(0x7F7F8000)).bits == 0x7F80);
  CHECK(bfloat16(std::numeric_limits<float>::max()).bits == 0x7F80);
  CHECK(bfloat16(1e300).bits == 0x7F80);
  CHECK(bfloat16(-1e300).bits == 0xFF80);
  CHECK(bfloat16(double(std::numeric_limits<float>::max())).bits == 0x7F80);
  CHECK(std::isinf(float(half::from_bits(0x7C00))));
  CHECK(float(half::from_bits(0xFC00)) == -inf);
  CHECK(float(bfloat16::from_bits(0xFF80)) == -inf);
}

TEST_CASE("NaN narrows to the canonical 0x7FFF", "[element]") {
  // CUDA's __float2half / __float2bfloat16 / __double2half / __double2bfloat16
  // return 0x7FFF for every NaN (sign and payload dropped).
  for (std::uint32_t u : {0x7FC00000U, 0xFFC00000U, 0x7F800001U, 0xFF800001U, 0x7FA00000U, 0x7FFFFFFFU,
                          0xFFFFFFFFU, 0x7F80FFFFU}) {
    CAPTURE(u);
    CHECK(half(f_bits(u)).bits == 0x7FFF);
    CHECK(bfloat16(f_bits(u)).bits == 0x7FFF);  // 0x7F800001 must not truncate to inf
  }
  for (std::uint64_t u : {0x7FF8000000000000ULL, 0xFFF8000000000000ULL, 0x7FF0000000000001ULL,
                          0xFFF0000000000001ULL, 0x7FFFFFFFFFFFFFFFULL}) {
    CAPTURE(u);
    CHECK(half(d_bits(u)).bits == 0x7FFF);
    CHECK(bfloat16(d_bits(u)).bits == 0x7FFF);
  }
  // Widening: bf16 keeps the payload (bits << 16); half NaNs widen to
  // 0x7FFFFFFF, as CUDA's host __half2float does.
  CHECK(bits_f(float(bfloat16::from_bits(0xFF81))) == 0xFF810000U);
  CHECK(bits_f(float(half::from_bits(0x7C01))) == 0x7FFFFFFFU);
  CHECK(bits_f(float(half::from_bits(0xFE00))) == 0x7FFFFFFFU);
  // NaN compares unequal, through float.
  const half hn = half::from_bits(0x7FFF);
  CHECK_FALSE(hn == hn);
  CHECK(hn != hn);
  CHECK_FALSE(hn < half(1.0f));
  CHECK_FALSE(bfloat16::from_bits(0x7FC0) >= bfloat16(0.0f));
  CHECK((hn + half(1.0f)).bits == 0x7FFF);
}

TEST_CASE("signed zero", "[element]") {
  CHECK(half(-0.0f).bits == 0x8000);
  CHECK(bfloat16(-0.0f).bits == 0x8000);
  CHECK(half(-0.0).bits == 0x8000);
  CHECK(bfloat16(-0.0).bits == 0x8000);
  CHECK(half(0.0f).bits == 0x0000);
  CHECK(std::signbit(float(half::from_bits(0x8000))));
  CHECK(std::signbit(float(bfloat16::from_bits(0x8000))));
  CHECK(half::from_bits(0x8000) == half::from_bits(0x0000));
  CHECK((-half(0.0f)).bits == 0x8000);
  CHECK(half(-1e-30f).bits == 0x8000);  // negative values that round to zero keep the sign
  CHECK(bfloat16(-1e-300).bits == 0x8000);
}

TEST_CASE("subnormals", "[element]") {
  // half subnormals are multiples of 2^-24.
  CHECK(half(0x1p-24f).bits == 0x0001);
  CHECK(half(-0x1p-24f).bits == 0x8001);
  CHECK(half(0x1p-25f).bits == 0x0000);                  // tie with 0: even
  CHECK(half(-0x1p-25f).bits == 0x8000);
  CHECK(half(f_bits(0x33000001)).bits == 0x0001);        // just above 2^-25
  CHECK(half(3 * 0x1p-26f).bits == 0x0001);               // 0.75 ulp
  CHECK(half(3 * 0x1p-25f).bits == 0x0002);               // 1.5 ulp: tie -> 2
  CHECK(half(5 * 0x1p-25f).bits == 0x0002);               // 2.5 ulp: tie -> 2
  CHECK(half(1e-30f).bits == 0x0000);
  CHECK(half(1023 * 0x1p-24f).bits == 0x03FF);            // largest subnormal
  CHECK(half(1023.5f * 0x1p-24f).bits == 0x0400);         // tie carries into the normals
  CHECK(half(1022.5f * 0x1p-24f).bits == 0x03FE);
  CHECK(float(half::from_bits(0x0001)) == 0x1p-24f);
  CHECK(float(half::from_bits(0x8003)) == -3 * 0x1p-24f);
  CHECK(float(half::from_bits(0x03FF)) == 1023 * 0x1p-24f);
  // bf16 subnormals coincide with the top of float's: multiples of 2^-133.
  CHECK(bfloat16(f_bits(0x00010000)).bits == 0x0001);
  CHECK(bfloat16(f_bits(0x00008000)).bits == 0x0000);     // tie -> 0
  CHECK(bfloat16(f_bits(0x00008001)).bits == 0x0001);
  CHECK(bfloat16(f_bits(0x00018000)).bits == 0x0002);     // tie -> 2
  CHECK(bfloat16(f_bits(0x80000001)).bits == 0x8000);
  CHECK(bfloat16(f_bits(0x007F8000)).bits == 0x0080);     // carries into the normals
  CHECK(bfloat16(0x1p-133).bits == 0x0001);
  CHECK(bfloat16(0x1p-134).bits == 0x0000);
  CHECK(bfloat16(0x1p-200).bits == 0x0000);
  CHECK(bits_f(float(bfloat16::from_bits(0x0001))) == 0x00010000U);
}

TEST_CASE("double converts with a single rounding", "[element]") {
  // Each value sits a hair off a 16-bit tie. Rounding to float first lands it
  // exactly on the tie, and ties-to-even then picks the wrong neighbour.
  const double above_half_tie = 1.0 + 0x1p-11 + 0x1p-40;      // float(x) == 1 + 2^-11
  REQUIRE(static_cast<float>(above_half_tie) == 1.0f + 0x1p-11f);
  CHECK(half(static_cast<float>(above_half_tie)).bits == 0x3C00);  // what double rounding gives
  CHECK(half(above_half_tie).bits == 0x3C01);
  CHECK(element_cast<half>(above_half_tie).bits == 0x3C01);

  const double below_half_tie = 1.0 + 3 * 0x1p-11 - 0x1p-40;  // float(x) == 1 + 3*2^-11
  REQUIRE(static_cast<float>(below_half_tie) == 1.0f + 3 * 0x1p-11f);
  CHECK(half(static_cast<float>(below_half_tie)).bits == 0x3C02);
  CHECK(half(below_half_tie).bits == 0x3C01);
  CHECK(half(-below_half_tie).bits == 0xBC01);

  const double above_bf16_tie = 1.0 + 0x1p-8 + 0x1p-40;
  CHECK(bfloat16(static_cast<float>(above_bf16_tie)).bits == 0x3F80);
  CHECK(bfloat16(above_bf16_tie).bits == 0x3F81);
  CHECK(element_cast<bfloat16>(above_bf16_tie).bits == 0x3F81);
  const double below_bf16_tie = 1.0 + 3 * 0x1p-8 - 0x1p-40;
  CHECK(bfloat16(static_cast<float>(below_bf16_tie)).bits == 0x3F82);
  CHECK(bfloat16(below_bf16_tie).bits == 0x3F81);

  // Around the subnormal boundary and the overflow threshold too.
  const double above_zero_tie = 0x1p-25 + 0x1p-60;  // float(x) == 2^-25, which rounds to 0
  CHECK(half(static_cast<float>(above_zero_tie)).bits == 0x0000);
  CHECK(half(above_zero_tie).bits == 0x0001);
  const double below_inf = 65520.0 - 0x1p-20;  // float(x) == 65520, which rounds to inf
  CHECK(half(static_cast<float>(below_inf)).bits == 0x7C00);
  CHECK(half(below_inf).bits == 0x7BFF);
  const double bf16_below_inf = 0x1.FFp127 - 0x1p80;  // just under bf16's overflow tie
  CHECK(bfloat16(static_cast<float>(bf16_below_inf)).bits == 0x7F80);
  CHECK(bfloat16(bf16_below_inf).bits == 0x7F7F);
}

TEST_CASE("integer constructors round once", "[element]") {
  CHECK(half(0).bits == 0x0000);
  CHECK(half(-3).bits == 0xC200);
  CHECK(half(2049).bits == 0x6800);
  CHECK(half(70000).bits == 0x7C00);
  CHECK(half(std::uint8_t{255}).bits == 0x5BF8);
  CHECK(bfloat16(true).bits == 0x3F80);
  CHECK(bfloat16(257).bits == 0x4380);  // tie -> 256
  // 2^62 + 2^54 + 1 is just above a bf16 tie; through a plain double it would
  // become the tie itself and round down.
  const std::int64_t big = (std::int64_t{1} << 62) + (std::int64_t{1} << 54);
  CHECK(bfloat16(big).bits == 0x5E80);
  CHECK(bfloat16(big + 1).bits == 0x5E81);
  CHECK(bfloat16(-(big + 1)).bits == 0xDE81);
  CHECK(bfloat16(std::numeric_limits<std::int64_t>::min()).bits == 0xDF00);
  CHECK(bfloat16(std::numeric_limits<std::uint64_t>::max()).bits == 0x5F80);
}

TEST_CASE("arithmetic goes through float and rounds once", "[element]") {
  CHECK(half(1) + half(2) == half(3));
  CHECK((half(1.5f) * half(-2)).bits == 0xC200);
  CHECK((bfloat16(1) - bfloat16(3)).bits == 0xC000);
  CHECK((half(1) / half(3)).bits == 0x3555);
  // 1 + 2^-8 is a bf16 tie: rounds to 1. 1 + 3*2^-8 rounds up to 1 + 2^-6.
  CHECK((bfloat16(1) + bfloat16(0x1p-8f)).bits == 0x3F80);
  CHECK((bfloat16(1) + bfloat16(3 * 0x1p-8f)).bits == 0x3F82);
  CHECK((half(60000) + half(10000)).bits == 0x7C00);
  half h(2);
  h += half(1);
  CHECK(h.bits == 0x4200);
  h -= half(0.5f);
  CHECK(h.bits == 0x4100);
  h *= half(2);
  CHECK(h.bits == 0x4500);
  h /= half(-5);
  CHECK(h.bits == 0xBC00);
  CHECK((-h).bits == 0x3C00);
  CHECK((+h).bits == 0xBC00);
  CHECK((-bfloat16::from_bits(0x7FC1)).bits == 0xFFC1);  // negate flips the sign bit only
  CHECK(half(1) < half(2));
  CHECK(half(2) <= half(2));
  CHECK(bfloat16(3) > bfloat16(-3));
  CHECK(bfloat16(3) >= bfloat16(3));
  CHECK(half(1) != half(2));
  CHECK(half(0.5f) < 1.0f);  // mixed comparisons go through float
  const float f = half(1.5f) + 1.0f;
  CHECK(f == 2.5f);
}

TEST_CASE("every 16-bit pattern round-trips through float", "[element]") {
  long bad_half = 0, bad_bf16 = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto b = static_cast<std::uint16_t>(i);
    const float hf = half::from_bits(b), bf = bfloat16::from_bits(b);
    const double hr = ref_decode(b, half_fmt), br = ref_decode(b, bf16_fmt);
    if (std::isnan(hr)) {
      bad_half += !(std::isnan(hf) && half(hf).bits == 0x7FFF);
    } else {
      // Widening is exact (checked against the reference decoding, sign of
      // zero included), and narrowing it back, from float or double, is the
      // identity.
      bad_half += !(hf == hr && std::signbit(hf) == std::signbit(hr) && half(hf).bits == b &&
                    half(double(hf)).bits == b && element_cast<half>(element_cast<double>(half::from_bits(b))).bits == b);
    }
    if (std::isnan(br)) {
      bad_bf16 += !(std::isnan(bf) && bfloat16(bf).bits == 0x7FFF && bits_f(bf) == std::uint32_t{b} << 16);
    } else {
      bad_bf16 += !(bf == br && std::signbit(bf) == std::signbit(br) && bfloat16(bf).bits == b &&
                    bfloat16(double(bf)).bits == b);
    }
  }
  CHECK(bad_half == 0);
  CHECK(bad_bf16 == 0);
}

TEST_CASE("float -> half/bf16 matches a slow reference on random inputs", "[element]") {
  std::mt19937 gen(20240601);
  long bad = 0;
  std::string first;
  auto check = [&](float x) {
    compare<half>(x, half(x).bits, half_fmt, bad, first);
    compare<bfloat16>(x, bfloat16(x).bits, bf16_fmt, bad, first);
  };
  // Uniform bit patterns: every exponent, NaNs and infinities included.
  for (int i = 0; i < 3'000'000; ++i) check(f_bits(static_cast<std::uint32_t>(gen())));
  // Exponents within half's range, and mantissas at or next to the 16-bit
  // tie points (bit 12 is half's rounding bit, bit 15 bf16's).
  for (int i = 0; i < 1'000'000; ++i) {
    const auto r = static_cast<std::uint32_t>(gen());
    const auto exp = static_cast<std::uint32_t>(127 - 27 + gen() % 45);
    const std::uint32_t base = (r & 0x807FFFFFU) | (exp << 23);
    check(f_bits(base));
    for (int tie_bit : {12, 15}) {
      std::uint32_t u = (base >> (tie_bit + 1) << (tie_bit + 1)) | (1U << tie_bit);
      check(f_bits(u));
      check(f_bits(u + 1));
      check(f_bits(u - 1));
    }
  }
  INFO("first mismatch: " << first);
  CHECK(bad == 0);
}

TEST_CASE("double -> half/bf16 matches a slow reference on random inputs", "[element]") {
  std::mt19937_64 gen(77);
  long bad = 0;
  std::string first;
  auto check = [&](double x) {
    compare<half>(x, half(x).bits, half_fmt, bad, first);
    compare<bfloat16>(x, bfloat16(x).bits, bf16_fmt, bad, first);
  };
  for (int i = 0; i < 1'000'000; ++i) {
    const std::uint64_t r = gen();
    check(d_bits(r));
    // Exponents spanning both 16-bit ranges, and mantissas at, or a few units
    // of 2^-52 off, the half (bit 41) and bf16 (bit 44) ties.
    const std::uint64_t exp = 1023 - 140 + (gen() % 270);
    const std::uint64_t base = (r & 0x800FFFFFFFFFFFFFULL) | (exp << 52);
    check(d_bits(base));
    for (int tie_bit : {41, 44}) {
      const std::uint64_t u = (base >> (tie_bit + 1) << (tie_bit + 1)) | (std::uint64_t{1} << tie_bit);
      check(d_bits(u));
      check(d_bits(u + 1 + (gen() & 0xFF)));
      check(d_bits(u - 1 - (gen() & 0xFF)));
    }
  }
  INFO("first mismatch: " << first);
  CHECK(bad == 0);
}

TEST_CASE("element_cast between floating element types", "[element]") {
  CHECK(element_cast<float>(half::from_bits(0x3C01)) == 1.0f + 0x1p-10f);
  CHECK(element_cast<double>(bfloat16::from_bits(0xC049)) == -3.140625);
  CHECK(element_cast<float>(0.1) == 0.1f);
  CHECK(element_cast<double>(0.1f) == double(0.1f));
  CHECK(element_cast<half>(0.1f).bits == 0x2E66);
  CHECK(element_cast<bfloat16>(0.1f).bits == 0x3DCD);
  CHECK(element_cast<half>(half::from_bits(0x7C01)).bits == 0x7C01);  // same type: untouched
  // half <-> bf16 goes through float, which holds both exactly.
  CHECK(element_cast<bfloat16>(half::from_bits(0x3C01)).bits == 0x3F80);  // 1 + 2^-10 -> 1
  CHECK(element_cast<bfloat16>(half::from_bits(0x3C03)).bits == 0x3F80);  // 1 + 3*2^-10 -> 1
  CHECK(element_cast<bfloat16>(half::from_bits(0x3C08)).bits == 0x3F81);  // 1 + 2^-7: exact
  CHECK(element_cast<bfloat16>(half::from_bits(0x3C0C)).bits == 0x3F82);  // 1 + 3*2^-8: tie -> even
  CHECK(element_cast<bfloat16>(half::from_bits(0x0001)).bits == 0x3380);  // 2^-24
  CHECK(element_cast<half>(bfloat16(1e5f)).bits == 0x7C00);
  CHECK(element_cast<half>(bfloat16(0x1p-30f)).bits == 0x0000);
  CHECK(element_cast<half>(bfloat16::from_bits(0xFFC1)).bits == 0x7FFF);
}

TEST_CASE("numeric_limits of the 16-bit types hold their formats' values", "[element]") {
  using bl = std::numeric_limits<bfloat16>;
  using hl = std::numeric_limits<half>;
  STATIC_REQUIRE(bl::is_specialized);
  STATIC_REQUIRE(hl::is_specialized);
  CHECK(float(bl::max()) == std::ldexp(255.0f, 120));  // (2 - 2^-7) 2^127
  CHECK(float(hl::max()) == 65504.0f);
  CHECK(float(bl::lowest()) == -float(bl::max()));
  CHECK(float(hl::lowest()) == -65504.0f);
  CHECK(float(bl::min()) == std::ldexp(1.0f, -126));
  CHECK(float(hl::min()) == std::ldexp(1.0f, -14));
  CHECK(float(bl::denorm_min()) == std::ldexp(1.0f, -133));
  CHECK(float(hl::denorm_min()) == std::ldexp(1.0f, -24));
  CHECK(float(bl::epsilon()) == std::ldexp(1.0f, -7));  // the gap after 1
  CHECK(float(hl::epsilon()) == std::ldexp(1.0f, -10));
  CHECK(float(bfloat16(1.0f + float(bl::epsilon()))) > 1.0f);
  CHECK(float(bl::infinity()) == std::numeric_limits<float>::infinity());
  CHECK(float(-hl::infinity()) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(float(bl::quiet_NaN())));
  CHECK(std::isnan(float(hl::signaling_NaN())));
  CHECK(bl::digits == 8);
  CHECK(hl::digits == 11);
}

TEST_CASE("dtype tags", "[element]") {
  using shardlib::dtype_of;
  using shardlib::name;
  using shardlib::parse_dtype;
  using shardlib::size_of;
  static_assert(dtype_of<double> == dtype::f64 && dtype_of<float> == dtype::f32);
  static_assert(dtype_of<half> == dtype::f16 && dtype_of<bfloat16> == dtype::bf16);
  static_assert(dtype_of<std::int64_t> == dtype::i64 && dtype_of<std::int32_t> == dtype::i32);
  static_assert(dtype_of<std::int16_t> == dtype::i16 && dtype_of<std::int8_t> == dtype::i8);
  static_assert(dtype_of<std::uint8_t> == dtype::u8 && dtype_of<bool> == dtype::boolean);
  static_assert(shardlib::Element<half> && shardlib::Element<bool> && shardlib::Element<std::uint8_t>);
  static_assert(!shardlib::Element<std::uint32_t> && !shardlib::Element<char> && !shardlib::Element<const float>);
  static_assert(shardlib::FloatingElement<bfloat16> && shardlib::FloatingElement<double>);
  static_assert(!shardlib::FloatingElement<std::int32_t> && !shardlib::FloatingElement<bool>);
  static_assert(size_of(dtype::bf16) == 2 && name(dtype::boolean) == "BOOL");

  struct row {
    dtype t;
    const char* n;
    std::size_t size;
  };
  const row rows[] = {{dtype::f64, "F64", 8}, {dtype::f32, "F32", 4}, {dtype::f16, "F16", 2},
                      {dtype::bf16, "BF16", 2}, {dtype::i64, "I64", 8}, {dtype::i32, "I32", 4},
                      {dtype::i16, "I16", 2}, {dtype::i8, "I8", 1}, {dtype::u8, "U8", 1},
                      {dtype::boolean, "BOOL", 1}};
  for (const row& r : rows) {
    CAPTURE(r.n);
    CHECK(name(r.t) == r.n);
    CHECK(size_of(r.t) == r.size);
    CHECK(parse_dtype(r.n) == r.t);
  }
  CHECK(size_of(dtype_of<half>) == sizeof(half));
  CHECK(size_of(dtype_of<bool>) == sizeof(bool));
  CHECK(size_of(dtype_of<std::int64_t>) == sizeof(std::int64_t));

  CHECK_THROWS_AS(parse_dtype("bf16"), shardlib::error);  // names are case-sensitive
  CHECK_THROWS_AS(parse_dtype(""), shardlib::error);
  try {
    parse_dtype("F8_E4M3");
    FAIL("parse_dtype accepted an unknown name");
  } catch (const shardlib::error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("F8_E4M3") != std::string::npos);
    CHECK(msg.find("BF16") != std::string::npos);
    CHECK(msg.find("BOOL") != std::string::npos);
  }
}

}  // namespace test_element
