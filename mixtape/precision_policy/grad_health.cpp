// mixtape/precision_policy/grad_health.cpp -- counts, per gradient, the values that 16-bit storage
// would flush to zero, make subnormal or overflow, using the exact conversions of dsl/half.h.
#include "mixtape/precision_policy/grad_health.h"

#include <algorithm>
#include <cmath>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/half.h"
#include "mixtape/dsl/json.h"

namespace mixtape {
namespace {

// The encodings decide, not thresholds: whatever RNE does at the boundaries (ties at half the
// smallest subnormal, 65520) is what gets counted.
void judge(float value, HalfLoss& f16_loss, HalfLoss& bf16_loss) {
  const uint32_t h = f32_to_f16_bits(value) & 0x7FFFu;
  if (h == 0)
    ++f16_loss.zero;
  else if (h < 0x0400u)
    ++f16_loss.subnormal;
  else if (h == 0x7C00u)
    ++f16_loss.overflow;
  const uint32_t b = f32_to_bf16_bits(value) & 0x7FFFu;
  if (b == 0)
    ++bf16_loss.zero;
  else if (b < 0x0080u)
    ++bf16_loss.subnormal;
  else if (b == 0x7F80u)
    ++bf16_loss.overflow;
}

void add_value(double x, double scale, GradientHealthRow& row) {
  if (!std::isfinite(x)) {
    ++row.nonfinite;
    return;
  }
  if (x == 0) return;
  ++row.nonzero;
  row.amax = std::max(row.amax, std::fabs(x));
  // Rounded to odd on the way to f32 so that the 16-bit rounding below is the only one that
  // counts (exact anyway for f32 values and power-of-two scales).
  judge(round_to_odd_f32(x * scale), row.f16, row.bf16);
}

GradientHealthRow measure(const std::string& name, const Tensor& grad, double scale) {
  const Storage& values = *grad.node()->value;
  GradientHealthRow row;
  row.name = name;
  row.shape = grad.shape();
  row.dtype = values.dtype;
  row.numel = values.count;
  if (!is_floating(values.dtype)) return row;  // integer "gradients" cannot underflow
  if (values.dtype == f32 && scale == 1) {
    // The common case, without conversions: f32 values are judged as they are.
    const float* data = values.as<float>();
    for (int64_t i = 0; i < values.count; ++i) {
      const float x = data[i];
      if (!std::isfinite(x)) {
        ++row.nonfinite;
      } else if (x != 0) {
        ++row.nonzero;
        row.amax = std::max(row.amax, static_cast<double>(std::fabs(x)));
        judge(x, row.f16, row.bf16);
      }
    }
    return row;
  }
  for (int64_t i = 0; i < values.count; ++i) add_value(load_element<double>(values, i), scale, row);
  return row;
}

void accumulate(GradientHealthRow& total, const GradientHealthRow& row) {
  total.numel += row.numel;
  total.nonzero += row.nonzero;
  total.nonfinite += row.nonfinite;
  total.amax = std::max(total.amax, row.amax);
  for (auto [sum, part] : {std::pair{&total.f16, &row.f16}, std::pair{&total.bf16, &row.bf16}}) {
    sum->zero += part->zero;
    sum->subnormal += part->subnormal;
    sum->overflow += part->overflow;
  }
}

json::Value loss_json(const HalfLoss& loss, const GradientHealthRow& row, bool f16_type) {
  return {{"zero", loss.zero},
          {"zero_fraction", f16_type ? row.f16_zero_fraction() : row.bf16_zero_fraction()},
          {"subnormal", loss.subnormal},
          {"subnormal_fraction",
           f16_type ? row.f16_subnormal_fraction() : row.bf16_subnormal_fraction()},
          {"overflow", loss.overflow}};
}

json::Value row_json(const GradientHealthRow& row, bool with_shape) {
  json::Value out = {{"name", row.name}};
  if (with_shape) {
    out["shape"] = row.shape;
    out["dtype"] = name(row.dtype);
  }
  out["numel"] = row.numel;
  out["nonzero"] = row.nonzero;
  out["nonfinite"] = row.nonfinite;
  out["found_inf"] = row.found_inf();
  out["amax"] = row.amax;
  out["f16"] = loss_json(row.f16, row, true);
  out["bf16"] = loss_json(row.bf16, row, false);
  return out;
}

std::string percent(int64_t count, double fraction) {
  return fmt::format("{} ({:.1f}%)", count, 100.0 * fraction);
}

std::string table_line(const GradientHealthRow& row, const std::string& shape,
                       const std::string& dtype) {
  return fmt::format(
      "{:<24} {:<12} {:<5} {:>9} {:>10.3e} {:>16} {:>16} {:>6} {:>16} {:>16} {:>6}\n", row.name,
      shape, dtype, row.nonzero, row.amax, percent(row.f16.zero, row.f16_zero_fraction()),
      percent(row.f16.subnormal, row.f16_subnormal_fraction()), row.f16.overflow,
      percent(row.bf16.zero, row.bf16_zero_fraction()),
      percent(row.bf16.subnormal, row.bf16_subnormal_fraction()), row.nonfinite);
}

}  // namespace

GradientHealth gradient_health(const NamedTensors& gradients, double scale) {
  if (!(scale > 0) || !std::isfinite(scale))
    fail("gradient_health: the scale must be finite and > 0, got {}", scale);
  std::vector<Tensor> defined;
  for (const auto& [name, grad] : gradients)
    if (grad.defined()) defined.push_back(grad);
  eval(defined);  // one program for all of them: the only host sync
  GradientHealth health;
  health.scale = scale;
  health.total.name = "total";
  for (const auto& [name, grad] : gradients) {
    if (!grad.defined()) continue;
    health.rows.push_back(measure(name, grad, scale));
    accumulate(health.total, health.rows.back());
  }
  return health;
}

GradientHealth gradient_health(const Module& model, double scale) {
  NamedTensors gradients;
  for (const auto& [name, param] : model.named_parameters())
    gradients.emplace_back(name, param.grad());
  return gradient_health(gradients, scale);
}

std::string GradientHealth::table() const {
  std::string out =
      fmt::format("{:<24} {:<12} {:<5} {:>9} {:>10} {:>16} {:>16} {:>6} {:>16} {:>16} {:>6}\n",
                  "gradient", "shape", "dtype", "nonzero", "amax", "f16 zero", "f16 subnormal",
                  "f16 inf", "bf16 zero", "bf16 subnormal", "nonfin");
  for (const GradientHealthRow& row : rows)
    out += table_line(row, to_string(row.shape), std::string(name(row.dtype)));
  out += table_line(total, "", "");
  if (scale != 1) out += fmt::format("(values judged after multiplying by {})\n", scale);
  if (found_inf()) out += "found inf/NaN in the gradients\n";
  return out;
}

std::string GradientHealth::json() const {
  json::Value tensors = json::Value::array();
  for (const GradientHealthRow& row : rows) tensors.push_back(row_json(row, true));
  return json::dump(
      {{"scale", scale}, {"tensors", std::move(tensors)}, {"total", row_json(total, false)}});
}

}  // namespace mixtape
