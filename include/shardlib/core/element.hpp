// shardlib/core/element.hpp — element types (bfloat16, half), dtype tags and
// the conversions between floating element types.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/error.hpp"

#include <concepts>     // std::integral
#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint16_t ...
#include <limits>       // std::numeric_limits (specialised for the 16-bit types below)
#include <string>
#include <string_view>
#include <type_traits>  // std::is_same_v

#if defined(__CUDACC__)
#include <cuda_bf16.h>  // __float2bfloat16_rn (device conversions)
#include <cuda_fp16.h>  // __float2half_rn, __half2float
#endif

namespace shardlib {

namespace detail {

// __builtin_bit_cast rather than std::bit_cast: both g++ and nvcc accept it in
// constexpr and device code without --expt-relaxed-constexpr.
SHARDLIB_HD constexpr std::uint32_t bits_of(float f) { return __builtin_bit_cast(std::uint32_t, f); }
SHARDLIB_HD constexpr std::uint64_t bits_of(double d) { return __builtin_bit_cast(std::uint64_t, d); }
SHARDLIB_HD constexpr float float_from_bits(std::uint32_t u) { return __builtin_bit_cast(float, u); }

// Every NaN narrows to 0x7FFF (positive, quiet, all-ones payload), for both
// half and bfloat16. That is what CUDA 13's host paths of __float2half,
// __float2bfloat16, __double2half and __double2bfloat16 return for any NaN,
// whatever its sign or payload, and what the device cvt.rn.{f16,bf16}
// instructions return (PTX's canonical NaN), so host and device agree.
inline constexpr std::uint16_t canonical_nan16 = 0x7FFF;

// Rounds the IEEE binary value with bit pattern x (SrcExp exponent bits,
// SrcMan stored mantissa bits: float or double) to the nearest value of a
// 16-bit format with DstExp/DstMan bits, ties to even, in one rounding step.
template <int SrcExp, int SrcMan, int DstExp, int DstMan>
SHARDLIB_HD constexpr std::uint16_t round_to_16(std::uint64_t x) {
  constexpr int src_bias = (1 << (SrcExp - 1)) - 1;
  constexpr int dst_bias = (1 << (DstExp - 1)) - 1;
  constexpr int src_all_ones = (1 << SrcExp) - 1;
  constexpr int dst_all_ones = (1 << DstExp) - 1;
  constexpr std::uint64_t one = 1;

  const auto sign = static_cast<std::uint16_t>((x >> (SrcExp + SrcMan)) << 15);
  const int exp = static_cast<int>((x >> SrcMan) & src_all_ones);
  const std::uint64_t man = x & ((one << SrcMan) - 1);
  const auto inf = static_cast<std::uint16_t>(sign | (dst_all_ones << DstMan));
  if (exp == src_all_ones) return man != 0 ? canonical_nan16 : inf;

  // The value is m * 2^(max(exp,1) - src_bias - SrcMan), implicit bit made
  // explicit; te is its biased exponent in the target format.
  const std::uint64_t m = exp == 0 ? man : (man | (one << SrcMan));
  int te = (exp == 0 ? 1 : exp) - src_bias + dst_bias;
  if (te >= dst_all_ones) return inf;

  // Drop the mantissa bits the target cannot hold; below the target's normal
  // range (te < 1) drop more, which lands on its subnormal grid. Past SrcMan+2
  // bits the value is under half the smallest subnormal: clamp, it rounds to 0.
  int shift = SrcMan - DstMan + (te < 1 ? 1 - te : 0);
  if (shift > SrcMan + 2) shift = SrcMan + 2;
  if (te < 1) te = 1;

  // m >> shift still carries the implicit bit at DstMan, so adding (te-1)
  // gives the encoding; a rounding carry ripples into the exponent, turning
  // the largest subnormal into the smallest normal and the largest finite
  // value into infinity, as it should.
  auto r = static_cast<std::uint32_t>((static_cast<std::uint64_t>(te - 1) << DstMan) + (m >> shift));
  const std::uint64_t rem = m & ((one << shift) - 1);
  const std::uint64_t halfway = one << (shift - 1);
  if (rem > halfway || (rem == halfway && (r & 1U) != 0)) ++r;
  return static_cast<std::uint16_t>(sign | r);
}

// Device code converts float <-> 16 bits with the hardware's single cvt
// instructions (the same bits as round_to_16 on every float, which
// tests/cuda/test_cuda_ops.cu checks over all 2^32 patterns); the host, and
// constant evaluation anywhere, use the portable arithmetic here.
SHARDLIB_HD constexpr bool device_conversions() {
#if defined(__CUDA_ARCH__)
  return !__builtin_is_constant_evaluated();
#else
  return false;
#endif
}

SHARDLIB_HD constexpr std::uint16_t float_to_half_bits(float f) {
#if defined(__CUDA_ARCH__)
  if (device_conversions()) return __half_as_ushort(__float2half_rn(f));
#endif
  return round_to_16<8, 23, 5, 10>(bits_of(f));
}
SHARDLIB_HD constexpr std::uint16_t double_to_half_bits(double d) { return round_to_16<11, 52, 5, 10>(bits_of(d)); }
SHARDLIB_HD constexpr std::uint16_t float_to_bf16_bits(float f) {
#if defined(__CUDA_ARCH__)
  if (device_conversions()) return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#endif
  return round_to_16<8, 23, 8, 7>(bits_of(f));
}
SHARDLIB_HD constexpr std::uint16_t double_to_bf16_bits(double d) { return round_to_16<11, 52, 8, 7>(bits_of(d)); }

// Not __bfloat162float on the device: this shift is exact, keeps NaN payloads
// (as CUDA's host path does) and is one instruction, where sm_90's
// cvt.f32.bf16 gives no more and documents no NaN rule.
SHARDLIB_HD constexpr float bf16_bits_to_float(std::uint16_t b) {
  return float_from_bits(static_cast<std::uint32_t>(b) << 16);
}

// On the device cvt.f32.f16: the same float for every non-NaN; a NaN stays a
// NaN, its payload is the hardware's (tests/cuda/test_cuda_device.cpp prints
// how many differ from the host's canonical one).
SHARDLIB_HD constexpr float half_bits_to_float(std::uint16_t h) {
#if defined(__CUDA_ARCH__)
  if (device_conversions()) return __half2float(__ushort_as_half(h));
#endif
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1FU;
  const std::uint32_t man = h & 0x3FFU;
  // Like CUDA's host __half2float, a NaN widens to the canonical 0x7FFFFFFF.
  if (exp == 0x1F) return float_from_bits(man != 0 ? 0x7FFFFFFFU : (sign | 0x7F800000U));
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float f = static_cast<float>(man) * 0x1p-24f;
    return sign != 0 ? -f : f;
  }
  return float_from_bits(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

// An integer as a double that rounds to every format of at most 51 mantissa
// bits exactly as the integer would: exact below 2^53, else rounded to odd
// (truncate, then set the last bit if anything was dropped), so the later
// rounding to 16 bits is the only one that counts.
template <std::integral I>
SHARDLIB_HD constexpr double integer_to_double(I v) {
  std::uint64_t u = static_cast<std::uint64_t>(v);
  bool neg = false;
  if constexpr (std::is_signed_v<I>) {
    neg = v < 0;
    if (neg) u = 0 - u;  // |v|, also right for the most negative value
  }
  int s = 0;
  while ((u >> s) >= (std::uint64_t{1} << 53)) ++s;
  std::uint64_t kept = u >> s;
  if (s > 0 && (u & ((std::uint64_t{1} << s) - 1)) != 0) kept |= 1;
  const double d = static_cast<double>(kept) * static_cast<double>(std::uint64_t{1} << s);
  return neg ? -d : d;
}

// Arithmetic shared by half and bfloat16: each operation computes in float
// and rounds once. Comparisons go through float, so NaN compares unequal
// and -0 == +0. Mixed operations with float or double (h + 1.0f) use the
// implicit conversion to float and give a float or double.
template <class T>
struct float16_ops {
  SHARDLIB_HD friend constexpr T operator+(T a, T b) { return T(float(a) + float(b)); }
  SHARDLIB_HD friend constexpr T operator-(T a, T b) { return T(float(a) - float(b)); }
  SHARDLIB_HD friend constexpr T operator*(T a, T b) { return T(float(a) * float(b)); }
  SHARDLIB_HD friend constexpr T operator/(T a, T b) { return T(float(a) / float(b)); }
  SHARDLIB_HD friend constexpr T& operator+=(T& a, T b) { return a = a + b; }
  SHARDLIB_HD friend constexpr T& operator-=(T& a, T b) { return a = a - b; }
  SHARDLIB_HD friend constexpr T& operator*=(T& a, T b) { return a = a * b; }
  SHARDLIB_HD friend constexpr T& operator/=(T& a, T b) { return a = a / b; }
  SHARDLIB_HD friend constexpr T operator+(T a) { return a; }
  // Negation flips the sign bit (exact, NaN payload kept), as IEEE negate does.
  SHARDLIB_HD friend constexpr T operator-(T a) { return T::from_bits(static_cast<std::uint16_t>(a.bits ^ 0x8000U)); }
  SHARDLIB_HD friend constexpr bool operator==(T a, T b) { return float(a) == float(b); }
  SHARDLIB_HD friend constexpr bool operator!=(T a, T b) { return float(a) != float(b); }
  SHARDLIB_HD friend constexpr bool operator<(T a, T b) { return float(a) < float(b); }
  SHARDLIB_HD friend constexpr bool operator<=(T a, T b) { return float(a) <= float(b); }
  SHARDLIB_HD friend constexpr bool operator>(T a, T b) { return float(a) > float(b); }
  SHARDLIB_HD friend constexpr bool operator>=(T a, T b) { return float(a) >= float(b); }
};

}  // namespace detail

// Brain float: 1 sign, 8 exponent, 7 mantissa bits (the top half of a float).
// Constructors are explicit and the conversion to float implicit, so mixed
// expressions resolve to float arithmetic instead of being ambiguous.
// The default constructor leaves bits uninitialised, like float; bfloat16{}
// is +0.
struct bfloat16 : detail::float16_ops<bfloat16> {
  std::uint16_t bits;

  bfloat16() = default;
  SHARDLIB_HD explicit constexpr bfloat16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  SHARDLIB_HD explicit constexpr bfloat16(double d) : bits(detail::double_to_bf16_bits(d)) {}
  template <std::integral I>
  SHARDLIB_HD explicit constexpr bfloat16(I v) : bfloat16(detail::integer_to_double(v)) {}

  SHARDLIB_HD static constexpr bfloat16 from_bits(std::uint16_t b) {
    bfloat16 r{};
    r.bits = b;
    return r;
  }
  SHARDLIB_HD constexpr operator float() const { return detail::bf16_bits_to_float(bits); }
};

// IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits; max 65504, smallest
// subnormal 2^-24. Same conventions as bfloat16.
struct half : detail::float16_ops<half> {
  std::uint16_t bits;

  half() = default;
  SHARDLIB_HD explicit constexpr half(float f) : bits(detail::float_to_half_bits(f)) {}
  SHARDLIB_HD explicit constexpr half(double d) : bits(detail::double_to_half_bits(d)) {}
  template <std::integral I>
  SHARDLIB_HD explicit constexpr half(I v) : half(detail::integer_to_double(v)) {}

  SHARDLIB_HD static constexpr half from_bits(std::uint16_t b) {
    half r{};
    r.bits = b;
    return r;
  }
  SHARDLIB_HD constexpr operator float() const { return detail::half_bits_to_float(bits); }
};

namespace detail {
// std::numeric_limits of a 16-bit float, from its significand and exponent widths
// (digits counts the implicit bit) and its bit patterns.
template <class T, int Digits, int MinExp, int MaxExp, std::uint16_t Min, std::uint16_t Max, std::uint16_t Epsilon,
          std::uint16_t Inf, std::uint16_t QuietNaN, std::uint16_t SignalingNaN>
struct float16_limits {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true, has_signaling_NaN = true;
  static constexpr std::float_denorm_style has_denorm = std::denorm_present;
  static constexpr bool has_denorm_loss = false, is_bounded = true, is_modulo = false;
  static constexpr bool is_iec559 = Digits == 11;  // binary16; bfloat16 is not an IEEE format
  static constexpr bool traps = false, tinyness_before = false;
  static constexpr std::float_round_style round_style = std::round_to_nearest;
  static constexpr int radix = 2, digits = Digits, digits10 = Digits == 11 ? 3 : 2, max_digits10 = Digits == 11 ? 5 : 4;
  static constexpr int min_exponent = MinExp, max_exponent = MaxExp;
  static constexpr int min_exponent10 = Digits == 11 ? -4 : -37, max_exponent10 = Digits == 11 ? 4 : 38;
  SHARDLIB_HD static constexpr T min() noexcept { return T::from_bits(Min); }
  SHARDLIB_HD static constexpr T max() noexcept { return T::from_bits(Max); }
  SHARDLIB_HD static constexpr T lowest() noexcept { return T::from_bits(Max | 0x8000); }
  SHARDLIB_HD static constexpr T epsilon() noexcept { return T::from_bits(Epsilon); }
  SHARDLIB_HD static constexpr T round_error() noexcept { return T(0.5f); }
  SHARDLIB_HD static constexpr T infinity() noexcept { return T::from_bits(Inf); }
  SHARDLIB_HD static constexpr T quiet_NaN() noexcept { return T::from_bits(QuietNaN); }
  SHARDLIB_HD static constexpr T signaling_NaN() noexcept { return T::from_bits(SignalingNaN); }
  SHARDLIB_HD static constexpr T denorm_min() noexcept { return T::from_bits(1); }
};
}  // namespace detail

static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2);
static_assert(sizeof(half) == 2 && alignof(half) == 2);
static_assert(std::is_trivially_copyable_v<bfloat16> && std::is_standard_layout_v<bfloat16>);
static_assert(std::is_trivially_copyable_v<half> && std::is_standard_layout_v<half>);

// ---------------------------------------------------------------------------
// Element types and dtype tags

// The order matches the safetensors names in name().
enum class dtype : std::uint8_t { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean };

inline constexpr dtype all_dtypes[] = {dtype::f64, dtype::f32, dtype::f16, dtype::bf16, dtype::i64,
                                       dtype::i32, dtype::i16, dtype::i8,  dtype::u8,   dtype::boolean};

constexpr std::size_t size_of(dtype t) {
  switch (t) {
    case dtype::f64: case dtype::i64: return 8;
    case dtype::f32: case dtype::i32: return 4;
    case dtype::f16: case dtype::bf16: case dtype::i16: return 2;
    case dtype::i8: case dtype::u8: case dtype::boolean: return 1;
  }
  return 0;  // not reached for valid enumerators
}

// The safetensors name of t.
constexpr std::string_view name(dtype t) {
  switch (t) {
    case dtype::f64: return "F64";
    case dtype::f32: return "F32";
    case dtype::f16: return "F16";
    case dtype::bf16: return "BF16";
    case dtype::i64: return "I64";
    case dtype::i32: return "I32";
    case dtype::i16: return "I16";
    case dtype::i8: return "I8";
    case dtype::u8: return "U8";
    case dtype::boolean: return "BOOL";
  }
  return "?";
}

// The dtype with safetensors name s (exact, case-sensitive); throws
// shardlib::error naming s and the known names otherwise.
inline dtype parse_dtype(std::string_view s) {
  std::string known;
  for (dtype t : all_dtypes) {
    if (name(t) == s) return t;
    if (!known.empty()) known += ", ";
    known += name(t);
  }
  throw error(cat("unknown dtype \"", s, "\"; known dtypes: ", known));
}

template <class T>
concept Element = std::is_same_v<T, double> || std::is_same_v<T, float> || std::is_same_v<T, half> ||
                  std::is_same_v<T, bfloat16> || std::is_same_v<T, std::int64_t> ||
                  std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int16_t> ||
                  std::is_same_v<T, std::int8_t> || std::is_same_v<T, std::uint8_t> || std::is_same_v<T, bool>;

template <class T>
concept FloatingElement = std::is_same_v<T, double> || std::is_same_v<T, float> || std::is_same_v<T, half> ||
                          std::is_same_v<T, bfloat16>;

namespace detail {
template <Element T>
consteval dtype dtype_of_impl() {
  if constexpr (std::is_same_v<T, double>) return dtype::f64;
  else if constexpr (std::is_same_v<T, float>) return dtype::f32;
  else if constexpr (std::is_same_v<T, half>) return dtype::f16;
  else if constexpr (std::is_same_v<T, bfloat16>) return dtype::bf16;
  else if constexpr (std::is_same_v<T, std::int64_t>) return dtype::i64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return dtype::i32;
  else if constexpr (std::is_same_v<T, std::int16_t>) return dtype::i16;
  else if constexpr (std::is_same_v<T, std::int8_t>) return dtype::i8;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return dtype::u8;
  else return dtype::boolean;
}
}  // namespace detail

// The dtype tag of element type T: dtype_of<float> == dtype::f32.
template <Element T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<T>();

// Converts between floating element types with a single round-to-nearest-even
// step: 16-bit -> float/double is exact, half <-> bfloat16 goes through float
// (exact for both, so still one rounding), and double -> half/bfloat16 rounds
// directly from double, never through float.
template <FloatingElement To, FloatingElement From>
SHARDLIB_HD constexpr To element_cast(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<From, double>) {
    return static_cast<To>(x);  // float(double) or the 16-bit double constructor
  } else if constexpr (std::is_same_v<To, double>) {
    return static_cast<double>(static_cast<float>(x));
  } else {
    return static_cast<To>(static_cast<float>(x));
  }
}

}  // namespace shardlib

// Generic code (a host layer written for T) reads infinity() and lowest() of the
// 16-bit types as of float and double; unspecialised, they would be 0.
template <>
struct std::numeric_limits<shardlib::bfloat16>
    : public shardlib::detail::float16_limits<shardlib::bfloat16, 8, -125, 128, 0x0080, 0x7f7f, 0x3c00, 0x7f80, 0x7fc0,
                                              0x7fa0> {};
template <>
struct std::numeric_limits<shardlib::half>
    : public shardlib::detail::float16_limits<shardlib::half, 11, -13, 16, 0x0400, 0x7bff, 0x1400, 0x7c00, 0x7e00,
                                              0x7d00> {};
