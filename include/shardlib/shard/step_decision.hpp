// shardlib/shard/step_decision.hpp — whether a train_step with clipping or fp16 loss
// scaling steps, and by what its gradients are clipped, decided where the step's
// flags are: the host's arithmetic, which the host runs at once and a device runs in
// one thread of its stream, so that a device step does not wait for the host to decide.
#pragma once
#include "shardlib/config.hpp"
#include "shardlib/optim/clip.hpp"       // clip_factor
#include "shardlib/shard/precision.hpp"  // loss_scaler

#include <cmath>  // std::sqrt, std::isfinite

namespace shardlib::shard {

// The loss scaler's changing fields, kept in the model's space between steps (doubles:
// exact for its float scale and its counts), and, once some step was the
// max_skipped_in_row-th skip in a row, the scale and count then (0 before: min_scale > 0),
// which stay so that a result read later still raises.
enum scaler_slot : int {
  scale_slot,
  good_steps_slot,
  skipped_slot,
  skipped_in_row_slot,
  exhausted_scale_slot,
  exhausted_in_row_slot,
  scaler_slots
};
// One step's outcome, in the model's space until it is read; the exhausted pair as the
// scaler's after this step (nonzero: loss_scaler::update would have raised by now).
enum outcome_slot : int { skip_slot, coefficient_slot, norm_slot, exhausted_scale_out, exhausted_in_row_out, outcome_slots };

// What a step decides by (passed by value to a device).
struct step_rule {
  float max_norm = 0;     // > 0: clip the global norm to it
  bool scaling = false;   // fp16 loss scaling: the overflow count and the scaler's slots count
  loss_scaler scaler{};   // its fixed fields (factors, bounds, interval); the changing ones are the slots
};

// The scaler's fields into the slots, the exhausted pair cleared.
SHARDLIB_HD inline void scaler_to_slots(const loss_scaler& s, double* slots) {
  slots[scale_slot] = s.scale;
  slots[good_steps_slot] = s.good_steps;
  slots[skipped_slot] = double(s.skipped);
  slots[skipped_in_row_slot] = s.skipped_in_row;
  slots[exhausted_scale_slot] = 0;
  slots[exhausted_in_row_slot] = 0;
}
SHARDLIB_HD inline loss_scaler scaler_from_slots(loss_scaler fixed, const double* slots) {
  fixed.scale = float(slots[scale_slot]);
  fixed.good_steps = int(slots[good_steps_slot]);
  fixed.skipped = long(slots[skipped_slot]);
  fixed.skipped_in_row = int(slots[skipped_in_row_slot]);
  return fixed;
}

// train_step's decision, as the host path makes it: skipped when any rank's gradients
// overflowed (`overflow` counts them, all-reduced) or, when clipping, when the global
// norm (sqrt of `norm_squared`, already all-reduced) is not finite; otherwise clipped
// by clip_factor. The scaler advances on the overflow alone; when that was the
// max_skipped_in_row-th skip in a row (loss_scaler::update raises there) the scaler's
// exhausted pair records the scale and the count, and every outcome from then on
// carries them.
SHARDLIB_HD inline void decide_step(const step_rule& rule, float overflow, const double* norm_squared,
                                    double* scaler, double* outcome) {
  bool skip = overflow != 0.f;
  double coefficient = 1, norm = 0;
  if (rule.max_norm > 0) {
    norm = std::sqrt(*norm_squared);
    skip = skip || !std::isfinite(norm);
    if (!skip) coefficient = optim::clip_factor(norm, rule.max_norm);
  }
  outcome[skip_slot] = skip ? 1 : 0;
  outcome[coefficient_slot] = coefficient;
  outcome[norm_slot] = norm;
  outcome[exhausted_scale_out] = 0;
  outcome[exhausted_in_row_out] = 0;
  if (rule.scaling) {
    loss_scaler s = scaler_from_slots(rule.scaler, scaler);
    const bool exhausted = !s.advance(overflow != 0.f);
    const double kept_scale = scaler[exhausted_scale_slot], kept_in_row = scaler[exhausted_in_row_slot];
    scaler_to_slots(s, scaler);
    scaler[exhausted_scale_slot] = exhausted && kept_scale == 0 ? s.scale : kept_scale;
    scaler[exhausted_in_row_slot] = exhausted && kept_scale == 0 ? s.skipped_in_row : kept_in_row;
    outcome[exhausted_scale_out] = scaler[exhausted_scale_slot];
    outcome[exhausted_in_row_out] = scaler[exhausted_in_row_slot];
  }
}

}  // namespace shardlib::shard
