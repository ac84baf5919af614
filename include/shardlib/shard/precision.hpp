// shardlib/shard/precision.hpp — the mixed-precision policy and in-place dtype changes.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/core/element.hpp"
#include "shardlib/core/error.hpp"

#include <cmath>    // std::isfinite
#include <cstddef>  // std::size_t
#include <cstring>  // std::memcpy
#include <span>     // std::span

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
// on every rank and halves the scale; `growth_interval` good steps in a row double it.
struct loss_scaler {
  float scale = 65536.f;
  float growth_factor = 2.f, backoff_factor = 0.5f;
  int growth_interval = 2000;
  int good_steps = 0;
  long skipped = 0;

  void update(bool found_inf) {
    if (found_inf) {
      scale *= backoff_factor;
      good_steps = 0;
      ++skipped;
    } else if (++good_steps == growth_interval) {
      scale *= growth_factor;
      good_steps = 0;
    }
  }
};

inline void check_precision(const mixed_precision& p) {
  auto ok = [](dtype t) { return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16; };
  require(ok(p.param) && ok(p.reduce), "mixed_precision: param and reduce dtypes must be F32, BF16 or F16, got ",
          name(p.param), " and ", name(p.reduce));
}

// Calls f with a value of the 16-bit element type t names (bfloat16 or half).
template <class F>
void with_16bit(dtype t, F&& f) {
  require(t == dtype::bf16 || t == dtype::f16, "mixed_precision: expected BF16 or F16, got ", name(t));
  if (t == dtype::bf16) f(bfloat16{});
  else f(half{});
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

inline bool all_finite(std::span<const float> x) {
  bool ok = true;
  for (float v : x) ok &= std::isfinite(v);
  return ok;
}

}  // namespace shardlib::shard
