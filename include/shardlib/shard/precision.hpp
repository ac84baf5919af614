// shardlib/shard/precision.hpp — the mixed-precision policy and in-place dtype changes.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"

#include <cmath>      // std::isfinite
#include <cstddef>    // std::size_t
#include <cstring>    // std::memcpy
#include <span>       // std::span
#include <string>     // std::string
#include <type_traits>  // std::is_same_v

namespace shardlib::shard {

// Which dtype parameters are gathered in and gradients are reduced in; master
// weights and optimizer state stay fp32 (FSDP's MixedPrecision(param_dtype,
// reduce_dtype)). On the host, layers compute in fp32 on the gathered values
// (which carry the param dtype's rounding); the GPU backend computes in the
// param dtype itself.
struct mixed_precision {
  dtype param = dtype::f32;   // f32, bf16 or f16
  dtype reduce = dtype::f32;  // f32, bf16 or f16
};

// Dynamic loss scaling for fp16 (torch.cuda.amp.GradScaler's rule): gradients
// of loss * scale; a step whose gradients hold inf or NaN on any rank is skipped
// on every rank and multiplies the scale by backoff_factor; `growth_interval` good
// steps in a row multiply it by growth_factor. Unlike GradScaler, the scale stays
// within [min_scale, max_scale] (1: DeepSpeed's min_loss_scale; 2^24: apex's
// max_loss_scale): at 0 every gradient would be 0/0 = NaN, at inf every step skipped.
// More steps skipped in a row than backing off to min_scale takes (16 from the
// default scale) mean inf/NaN that no scale avoids: the max_skipped_in_row-th raises
// shardlib::error from update(). check_scaler refuses values that could not work.
struct loss_scaler {
  float scale = 65536.f;
  float growth_factor = 2.f, backoff_factor = 0.5f;
  int growth_interval = 2000;
  float min_scale = 1.f, max_scale = 16777216.f;
  int max_skipped_in_row = 50;
  int good_steps = 0;      // since the last skipped step or growth
  long skipped = 0;        // in all
  int skipped_in_row = 0;  // since the last good step

  void update(bool found_inf) {
    if (!advance(found_inf)) throw error(exhausted_message());
  }
  // The rule alone (host and device code): false when this step was the
  // max_skipped_in_row-th skipped in a row.
  SHARDLIB_HD bool advance(bool found_inf) {
    if (!found_inf) {
      skipped_in_row = 0;
      if (++good_steps == growth_interval) {
        const float grown = scale * growth_factor;
        scale = grown < max_scale ? grown : max_scale;
        good_steps = 0;
      }
      return true;
    }
    const float backed_off = scale * backoff_factor;
    scale = backed_off > min_scale ? backed_off : min_scale;
    good_steps = 0;
    ++skipped;
    ++skipped_in_row;
    return skipped_in_row < max_skipped_in_row;
  }
  std::string exhausted_message() const {
    return cat("loss scaling: ", skipped_in_row,
               " steps in a row were skipped because their gradients held inf or NaN, and the loss scale fell to ",
               scale, " (min_scale ", min_scale, "): the model or the data produce inf/NaN, which no loss scale avoids");
  }
};

// Refuses a scaler that could not work, naming the field: bounds that are not finite
// and positive, a scale outside them, factors that do not grow or back off, counts
// out of range.
inline void check_scaler(const loss_scaler& s) {
  const auto finite = [](float x) { return std::isfinite(x); };
  require(finite(s.min_scale) && s.min_scale > 0, "loss_scaler.min_scale must be a positive finite number, got ",
          s.min_scale);
  require(finite(s.max_scale) && s.max_scale >= s.min_scale,
          "loss_scaler.max_scale must be finite and at least min_scale (", s.min_scale, "), got ", s.max_scale);
  require(s.scale >= s.min_scale && s.scale <= s.max_scale,
          "loss_scaler.scale must lie in [min_scale, max_scale] = [", s.min_scale, ", ", s.max_scale, "], got ",
          s.scale);
  require(finite(s.growth_factor) && s.growth_factor > 1,
          "loss_scaler.growth_factor must be a finite number above 1, got ", s.growth_factor);
  require(s.backoff_factor > 0 && s.backoff_factor < 1, "loss_scaler.backoff_factor must lie in (0, 1), got ",
          s.backoff_factor);
  require(s.growth_interval >= 1, "loss_scaler.growth_interval must be at least 1, got ", s.growth_interval);
  require(s.max_skipped_in_row >= 1, "loss_scaler.max_skipped_in_row must be at least 1, got ", s.max_skipped_in_row);
  require(s.good_steps >= 0 && s.good_steps < s.growth_interval,
          "loss_scaler.good_steps must lie in [0, growth_interval = ", s.growth_interval, "), got ", s.good_steps);
  require(s.skipped >= 0, "loss_scaler.skipped must not be negative, got ", s.skipped);
  require(s.skipped_in_row >= 0 && s.skipped_in_row <= s.max_skipped_in_row,
          "loss_scaler.skipped_in_row must lie in [0, max_skipped_in_row = ", s.max_skipped_in_row, "], got ",
          s.skipped_in_row);
}

inline void check_precision(const mixed_precision& p) {
  auto ok = [](dtype t) { return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16; };
  require(ok(p.param) && ok(p.reduce), "mixed_precision: param and reduce dtypes must be F32, BF16 or F16, got ",
          name(p.param), " and ", name(p.reduce));
}

// Calls f with a value of the 16-bit element type t names (bfloat16 or half).
// 16-bit gathers and reductions round float masters; float64 masters (the host's
// reference precision) have none, and f is not instantiated for them.
template <class Master, class F>
void with_16bit(dtype t, F&& f) {
  require(t == dtype::bf16 || t == dtype::f16, "mixed_precision: expected BF16 or F16, got ", name(t));
  if constexpr (std::is_same_v<Master, float>) {
    if (t == dtype::bf16) f(bfloat16{});
    else f(half{});
  } else {
    throw error(cat("mixed_precision: ", name(t), " gathers and reductions need float masters; this model's are F64"));
  }
}

// The first n elements of a float buffer rewritten as n 16-bit values in its
// first 2n bytes (forward order: element i's 2 bytes never overlap a float not
// yet read), and back (backward order). No second buffer: the gathered and
// gradient buffers change dtype in place for communication.
template <class H>
std::span<H> narrow_in_place(std::span<float> x) {
  static_assert(sizeof(H) == 2);
  auto* bytes = reinterpret_cast<unsigned char*>(x.data());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const H h(x[i]);
    std::memcpy(bytes + 2 * i, &h, 2);
  }
  return {reinterpret_cast<H*>(bytes), x.size()};
}
template <class H>
void widen_in_place(std::span<float> x) {
  static_assert(sizeof(H) == 2);
  const auto* bytes = reinterpret_cast<const unsigned char*>(x.data());
  for (std::size_t i = x.size(); i-- > 0;) {
    H h;
    std::memcpy(&h, bytes + 2 * i, 2);
    x[i] = float(h);
  }
}

template <class T>
bool all_finite(std::span<const T> x) {
  bool ok = true;
  for (T v : x) ok &= std::isfinite(v);
  return ok;
}

}  // namespace shardlib::shard
