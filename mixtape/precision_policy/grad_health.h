// mixtape/precision_policy/grad_health.h -- mt::gradient_health: how much of each gradient fp16 or
// bf16 would lose to underflow or overflow, and whether it already holds inf/NaN.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mixtape/dsl/module.h"

namespace mixtape {

/// What rounding a gradient's values to one 16-bit type (RNE, dsl/half.h) does to them. Every
/// count is over the finite non-zero values only.
struct HalfLoss {
  int64_t zero = 0;       // non-zero values that round to (signed) zero
  int64_t subnormal = 0;  // values that round to a non-zero subnormal (precision partly lost)
  int64_t overflow = 0;   // finite values that round to inf (f16: |x| >= 65520)
};

/// One gradient tensor.
struct GradientHealthRow {
  std::string name;
  Shape shape;
  DType dtype = f32;  // what the gradient is stored as
  int64_t numel = 0;
  int64_t nonzero = 0;    // finite values other than +-0: the denominator of the fractions
  int64_t nonfinite = 0;  // NaN or +-inf values
  double amax = 0;        // the largest |x| over the finite values (0 when there are none)
  HalfLoss f16, bf16;

  bool found_inf() const { return nonfinite > 0; }
  /// Fractions of `nonzero` (0 when there are no non-zero values).
  double f16_zero_fraction() const { return fraction(f16.zero); }
  double f16_subnormal_fraction() const { return fraction(f16.subnormal); }
  double bf16_zero_fraction() const { return fraction(bf16.zero); }
  double bf16_subnormal_fraction() const { return fraction(bf16.subnormal); }

 private:
  double fraction(int64_t count) const {
    return nonzero > 0 ? static_cast<double>(count) / static_cast<double>(nonzero) : 0.0;
  }
};

struct GradientHealth {
  /// Each value was multiplied by this (in double, then rounded once to the 16-bit type) before
  /// being judged: pass a loss scale to see what scaling would save. amax is unscaled.
  double scale = 1;
  std::vector<GradientHealthRow> rows;  // in the order given
  GradientHealthRow total;              // sums over rows; amax the largest; name "total"

  bool found_inf() const { return total.found_inf(); }
  /// A fixed-width table, one gradient a line, then the totals.
  std::string table() const;
  /// {"scale":..,"tensors":[{"name":..,"shape":[..],"dtype":..,"numel":..,"nonzero":..,
  ///  "nonfinite":..,"found_inf":..,"amax":..,"f16":{"zero":..,"zero_fraction":..,"subnormal":..,
  ///  "subnormal_fraction":..,"overflow":..},"bf16":{...}}],"total":{...}}
  std::string json() const;
};

/// Gradient health of the given (name, gradient) pairs; undefined gradients are skipped. The
/// values as this process holds them: under ZeRO, its shards (see the next overload).
/// Evaluates all gradients together as one program and reads them on the host, so it is a host
/// sync and costs one pass over every gradient: cheap enough every N steps, not free every step.
/// Values are judged as they stand: gradients still loss-scaled (before unscale_) show what
/// storing the scaled values in 16 bits would lose.
GradientHealth gradient_health(const NamedTensors& gradients, double scale = 1);
/// The same for every parameter of `model` that has a gradient, named by module path. Under
/// ZeRO (dist/zero.h), where each process holds its part of a gradient and zeros elsewhere, the
/// processes' counts are combined into the whole gradient's: a collective then, which every
/// process calls at the same point (not inside no_sync, where gradients are each process's own
/// and are counted as they are).
GradientHealth gradient_health(const Module& model, double scale = 1);

}  // namespace mixtape
