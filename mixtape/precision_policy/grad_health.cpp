// mixtape/precision_policy/grad_health.cpp -- counts, per gradient, the values that 16-bit storage
// would flush to zero, make subnormal or overflow, using the exact conversions of dsl/half.h.
#include "mixtape/precision_policy/grad_health.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/half.h"
#include "mixtape/dsl/json.h"
#include "mixtape/dsl/process_group.h"

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

void add(HalfLoss& sum, const HalfLoss& part) {
  sum.zero += part.zero;
  sum.subnormal += part.subnormal;
  sum.overflow += part.overflow;
}

void accumulate(GradientHealthRow& total, const GradientHealthRow& row) {
  total.numel += row.numel;
  total.nonzero += row.nonzero;
  total.nonfinite += row.nonfinite;
  total.amax = std::max(total.amax, row.amax);
  add(total.f16, row.f16);
  add(total.bf16, row.bf16);
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

// A process's figures of one sharded gradient, as they travel.
struct RowFigures {
  int64_t nonzero = 0, nonfinite = 0;
  HalfLoss f16, bf16;
  double amax = 0;
};

// Under ZeRO a process holds its own elements of a sharded gradient and zeros elsewhere. A zero
// counts for nothing but numel, so the whole gradient's counts are the sums of the processes'
// and its amax their maximum: one all_gather of the figures of every sharded gradient, one
// record each whether this process has the gradient or not (null: zeros), so that every process
// sends as many.
void combine_over_processes(const std::vector<GradientHealthRow*>& rows) {
  ProcessGroup* group = process_group();
  if (!group || group->size() == 1 || rows.empty()) return;
  std::vector<RowFigures> mine;
  for (const GradientHealthRow* row : rows)
    mine.push_back(row ? RowFigures{row->nonzero, row->nonfinite, row->f16, row->bf16, row->amax}
                       : RowFigures{});
  const int processes = group->size();
  const auto bytes = static_cast<int64_t>(mine.size() * sizeof(RowFigures));
  std::vector<RowFigures> all(mine.size() * static_cast<size_t>(processes));
  std::vector<int64_t> counts(static_cast<size_t>(processes), bytes), at;
  for (int r = 0; r < processes; ++r) at.push_back(r * bytes);
  group->all_gather(reinterpret_cast<const std::byte*>(mine.data()), bytes,
                    reinterpret_cast<std::byte*>(all.data()), counts, at);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i]) continue;
    GradientHealthRow& row = *rows[i];
    row.nonzero = row.nonfinite = 0;
    row.f16 = row.bf16 = HalfLoss{};
    row.amax = 0;
    for (int r = 0; r < processes; ++r) {
      const RowFigures& part = all[static_cast<size_t>(r) * rows.size() + i];
      row.nonzero += part.nonzero;
      row.nonfinite += part.nonfinite;
      add(row.f16, part.f16);
      add(row.bf16, part.bf16);
      row.amax = std::max(row.amax, part.amax);
    }
  }
}

// gradient_health of the gradients, the ones `sharded` marks combined over the processes.
GradientHealth health_of(const NamedTensors& gradients, const std::vector<bool>& sharded,
                         double scale) {
  if (!(scale > 0) || !std::isfinite(scale))
    fail("gradient_health: the scale must be finite and > 0, got {}", scale);
  std::vector<Tensor> defined;
  for (const auto& [name, grad] : gradients)
    if (grad.defined()) defined.push_back(grad);
  eval(defined);  // one program for all of them: the only host sync
  GradientHealth health;
  health.scale = scale;
  health.total.name = "total";
  std::vector<std::optional<size_t>> sharded_rows;  // a row index, or none where undefined
  for (size_t i = 0; i < gradients.size(); ++i) {
    const auto& [name, grad] = gradients[i];
    const bool defined = grad.defined();
    if (i < sharded.size() && sharded[i])
      sharded_rows.push_back(defined ? std::optional(health.rows.size()) : std::nullopt);
    if (defined) health.rows.push_back(measure(name, grad, scale));
  }
  std::vector<GradientHealthRow*> rows;
  for (const std::optional<size_t>& i : sharded_rows)
    rows.push_back(i ? &health.rows[*i] : nullptr);
  combine_over_processes(rows);
  for (const GradientHealthRow& row : health.rows) accumulate(health.total, row);
  return health;
}

}  // namespace

GradientHealth gradient_health(const NamedTensors& gradients, double scale) {
  return health_of(gradients, {}, scale);
}

GradientHealth gradient_health(const Module& model, double scale) {
  NamedTensors gradients;
  std::vector<bool> sharded;
  for (const auto& [name, param] : model.named_parameters()) {
    gradients.emplace_back(name, param.grad());
    sharded.push_back(gradient_held_as_shards(param.node()->grad_owner.lock().get()));
  }
  return health_of(gradients, sharded, scale);
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
