// mixtape/dsl/lr_schedule.cpp -- the schedules' closed forms, on the host and as f64 graph code in
// the same arithmetic order (PyTorch's, in Python doubles), so that both forms give the same rates.
#include "mixtape/dsl/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <type_traits>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/ops.h"

namespace mixtape {
namespace {

Tensor number(double value) { return full({}, value, f64); }

// A rate or factor that a schedule is built from: finite and >= 0.
void check_rate(const char* schedule, const char* what, double value) {
  if (!(value >= 0) || !std::isfinite(value))
    fail("{}: {} must be finite and >= 0, got {}", schedule, what, value);
}

}  // namespace

ConstantLR::ConstantLR(double lr) : base_(lr) { check_rate("ConstantLR", "the learning rate", lr); }

ConstantLR::ConstantLR(double base_lr, double factor, int64_t total_iters)
    : base_(base_lr), factor_(factor), total_(total_iters) {
  check_rate("ConstantLR", "base_lr", base_lr);
  if (!(factor >= 0 && factor <= 1)) fail("ConstantLR: factor must be in [0, 1], got {}", factor);
  // At 0, torch 1.13's scheduler keeps the factor for good where its closed form drops it.
  if (total_iters < 1) fail("ConstantLR: total_iters must be >= 1, got {}", total_iters);
}

double ConstantLR::lr(int64_t step) const { return step < total_ ? base_ * factor_ : base_; }

Tensor ConstantLR::graph_lr(const Tensor& step) const {
  if (total_ == 0) return number(base_);
  return where(step < static_cast<double>(total_), number(base_ * factor_), number(base_));
}

CosineAnnealingLR::CosineAnnealingLR(double base_lr, int64_t T_max, double eta_min)
    : base_(base_lr), min_(eta_min), period_(T_max) {
  check_rate("CosineAnnealingLR", "base_lr", base_lr);
  check_rate("CosineAnnealingLR", "eta_min", eta_min);
  if (T_max <= 0) fail("CosineAnnealingLR: T_max must be > 0, got {}", T_max);
}

double CosineAnnealingLR::lr(int64_t step) const {
  const double phase = std::numbers::pi * static_cast<double>(step) / static_cast<double>(period_);
  return min_ + (base_ - min_) * (1 + std::cos(phase)) / 2;
}

Tensor CosineAnnealingLR::graph_lr(const Tensor& step) const {
  Tensor phase = std::numbers::pi * step / static_cast<double>(period_);
  return min_ + (base_ - min_) * (1.0 + cos(phase)) / 2.0;
}

CosineWithWarmup::CosineWithWarmup(double peak_lr, int64_t warmup_steps, int64_t total_steps,
                                   double min_lr)
    : peak_(peak_lr), min_(min_lr), warmup_(warmup_steps), total_(total_steps) {
  if (warmup_steps < 0 || total_steps <= 0 || warmup_steps > total_steps)
    fail("CosineWithWarmup: need 0 <= warmup_steps ({}) <= total_steps ({}) and total > 0",
         warmup_steps, total_steps);
  check_rate("CosineWithWarmup", "peak_lr", peak_lr);
  check_rate("CosineWithWarmup", "min_lr", min_lr);
}

double CosineWithWarmup::lr(int64_t step) const {
  if (step < warmup_) return peak_ * static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (step >= total_) return min_;
  double progress = static_cast<double>(step - warmup_) / static_cast<double>(total_ - warmup_);
  return min_ + 0.5 * (peak_ - min_) * (1 + std::cos(std::numbers::pi * progress));
}

Tensor CosineWithWarmup::graph_lr(const Tensor& step) const {
  auto warmup = static_cast<double>(warmup_), total = static_cast<double>(total_);
  Tensor progress = (step - warmup) / (total - warmup);
  Tensor rate = min_ + 0.5 * (peak_ - min_) * (1.0 + cos(progress * std::numbers::pi));
  rate = where(step >= total, number(min_), rate);
  if (warmup_ == 0) return rate;
  return where(step < warmup, peak_ * (step + 1.0) / warmup, rate);
}

CosineAnnealingWarmRestarts::CosineAnnealingWarmRestarts(double base_lr, int64_t T_0,
                                                         int64_t T_mult, double eta_min)
    : base_(base_lr), min_(eta_min), first_(T_0), mult_(T_mult) {
  check_rate("CosineAnnealingWarmRestarts", "base_lr", base_lr);
  check_rate("CosineAnnealingWarmRestarts", "eta_min", eta_min);
  if (T_0 <= 0) fail("CosineAnnealingWarmRestarts: T_0 must be > 0, got {}", T_0);
  if (T_mult < 1) fail("CosineAnnealingWarmRestarts: T_mult must be >= 1, got {}", T_mult);
  // The graph form finds the period from powers of T_mult in f64, exact below 2^53.
  if (static_cast<double>(T_0) * static_cast<double>(T_mult) > 0x1p40)
    fail("CosineAnnealingWarmRestarts: T_0 * T_mult = {} * {} is too large", T_0, T_mult);
}

double CosineAnnealingWarmRestarts::lr(int64_t step) const {
  // As PyTorch's step-by-step form counts: the step into the period and the period, in integers.
  int64_t into = step, period = first_;
  if (mult_ == 1) {
    into = step % first_;
  } else {
    while (into >= period) {
      into -= period;
      period *= mult_;
    }
  }
  const double phase = std::numbers::pi * static_cast<double>(into) / static_cast<double>(period);
  return min_ + (base_ - min_) * (1 + std::cos(phase)) / 2;
}

Tensor CosineAnnealingWarmRestarts::graph_lr(const Tensor& step) const {
  const auto first = static_cast<double>(first_), mult = static_cast<double>(mult_);
  Tensor into, period;
  if (mult_ == 1) {
    into = step - first * floor(step / first);
    period = number(first);
  } else {
    // Period n starts at T_0 (T_mult^n - 1) / (T_mult - 1): n from a logarithm, then moved by
    // one where rounding put it on the wrong side of a start (log(8) / log(2) < 3).
    auto start = [&](const Tensor& n) { return first * (pow(number(mult), n) - 1.0) / (mult - 1); };
    Tensor n = floor(log(step / first * (mult - 1) + 1.0) / std::log(mult));
    n = where(step < start(n), n - 1.0, where(step >= start(n + 1.0), n + 1.0, n));
    into = step - start(n);
    period = first * pow(number(mult), n);
  }
  return min_ + (base_ - min_) * (1.0 + cos(std::numbers::pi * into / period)) / 2.0;
}

PolynomialLR::PolynomialLR(double base_lr, int64_t total_iters, double power)
    : base_(base_lr), power_(power), total_(total_iters) {
  check_rate("PolynomialLR", "base_lr", base_lr);
  check_rate("PolynomialLR", "power", power);
  if (total_iters <= 0) fail("PolynomialLR: total_iters must be > 0, got {}", total_iters);
}

double PolynomialLR::lr(int64_t step) const {
  const auto total = static_cast<double>(total_);
  return base_ * std::pow(1.0 - static_cast<double>(std::min(step, total_)) / total, power_);
}

Tensor PolynomialLR::graph_lr(const Tensor& step) const {
  const auto total = static_cast<double>(total_);
  return base_ * pow(1.0 - minimum(step, number(total)) / total, number(power_));
}

StepLR::StepLR(double base_lr, int64_t step_size, double gamma)
    : base_(base_lr), gamma_(gamma), step_size_(step_size) {
  check_rate("StepLR", "base_lr", base_lr);
  check_rate("StepLR", "gamma", gamma);
  if (step_size <= 0) fail("StepLR: step_size must be > 0, got {}", step_size);
}

double StepLR::lr(int64_t step) const {
  return base_ * std::pow(gamma_, static_cast<double>(step / step_size_));
}

Tensor StepLR::graph_lr(const Tensor& step) const {
  return base_ * pow(number(gamma_), floor(step / static_cast<double>(step_size_)));
}

MultiStepLR::MultiStepLR(double base_lr, std::vector<int64_t> milestones, double gamma)
    : base_(base_lr), gamma_(gamma), milestones_(std::move(milestones)) {
  check_rate("MultiStepLR", "base_lr", base_lr);
  check_rate("MultiStepLR", "gamma", gamma);
  for (int64_t m : milestones_)
    if (m < 0) fail("MultiStepLR: milestones must be >= 0, got {}", m);
}

double MultiStepLR::lr(int64_t step) const {
  auto passed =
      std::count_if(milestones_.begin(), milestones_.end(), [&](int64_t m) { return m <= step; });
  return base_ * std::pow(gamma_, static_cast<double>(passed));
}

Tensor MultiStepLR::graph_lr(const Tensor& step) const {
  Tensor passed = number(0);
  for (int64_t m : milestones_) passed = passed + cast(step >= static_cast<double>(m), f64);
  return base_ * pow(number(gamma_), passed);
}

ExponentialLR::ExponentialLR(double base_lr, double gamma) : base_(base_lr), gamma_(gamma) {
  check_rate("ExponentialLR", "base_lr", base_lr);
  check_rate("ExponentialLR", "gamma", gamma);
}

double ExponentialLR::lr(int64_t step) const {
  return base_ * std::pow(gamma_, static_cast<double>(step));
}

Tensor ExponentialLR::graph_lr(const Tensor& step) const {
  return base_ * pow(number(gamma_), step);
}

LambdaLR::LambdaLR(double base_lr, Factor factor) : base_(base_lr), factor_(std::move(factor)) {
  check_rate("LambdaLR", "base_lr", base_lr);
  if (!factor_) fail("LambdaLR: the factor function is empty");
}

Tensor LambdaLR::graph_lr(const Tensor& step) const {
  Tensor factor = factor_(step);
  // As PyTorch's lambdas: any number (a whole one included), multiplied in f64.
  if (!factor.defined() || factor.dim() != 0 || factor.dtype() == boolean)
    fail("LambdaLR: the factor function must return a 0-d number, got {}",
         factor.defined() ? fmt::format("{} {}", to_string(factor.shape()), name(factor.dtype()))
                          : std::string("an undefined tensor"));
  return base_ * cast(factor, f64);
}

double LambdaLR::lr(int64_t step) const {
  NoGradGuard no_grad;
  return graph_lr(number(static_cast<double>(step))).item();
}

LinearLR::LinearLR(double base_lr, double start_factor, double end_factor, int64_t total_iters)
    : base_(base_lr), start_(start_factor), end_(end_factor), total_(total_iters) {
  check_rate("LinearLR", "base_lr", base_lr);
  // PyTorch's bounds: a start of 0 would make its step-by-step form divide by zero.
  if (!(start_factor > 0 && start_factor <= 1) || !(end_factor >= 0 && end_factor <= 1))
    fail("LinearLR: need 0 < start_factor ({}) <= 1 and 0 <= end_factor ({}) <= 1", start_factor,
         end_factor);
  if (total_iters <= 0) fail("LinearLR: total_iters must be > 0, got {}", total_iters);
}

double LinearLR::lr(int64_t step) const {
  auto done = static_cast<double>(std::min(total_, step));
  return base_ * (start_ + (end_ - start_) * done / static_cast<double>(total_));
}

Tensor LinearLR::graph_lr(const Tensor& step) const {
  auto total = static_cast<double>(total_);
  Tensor done = minimum(step, number(total));
  return base_ * (start_ + (end_ - start_) * done / total);
}

OneCycleLR::OneCycleLR(double max_lr, int64_t total_steps, OneCycleOptions options)
    : total_(total_steps),
      cos_(options.cos),
      cycle_(options.cycle_momentum.value_or(true)),
      required_(options.cycle_momentum.value_or(false)) {
  check_rate("OneCycleLR", "max_lr", max_lr);
  if (total_steps <= 0) fail("OneCycleLR: total_steps must be > 0, got {}", total_steps);
  if (!(options.pct_start >= 0 && options.pct_start <= 1))
    fail("OneCycleLR: pct_start must be in [0, 1], got {}", options.pct_start);
  if (!(options.div_factor > 0) || !(options.final_div_factor > 0))
    fail("OneCycleLR: div_factor ({}) and final_div_factor ({}) must be > 0", options.div_factor,
         options.final_div_factor);
  if (cycle_ && !(options.base_momentum >= 0 && options.base_momentum <= options.max_momentum &&
                  options.max_momentum < 1))
    fail("OneCycleLR: needs 0 <= base_momentum <= max_momentum < 1, got {} and {}",
         options.base_momentum, options.max_momentum);
  double initial = max_lr / options.div_factor, min = initial / options.final_div_factor;
  double total = static_cast<double>(total_steps), rise = options.pct_start * total - 1;
  const double low = options.base_momentum, high = options.max_momentum;
  if (options.three_phase)
    phases_ = {{rise, initial, max_lr, high, low},
               {2 * options.pct_start * total - 2, max_lr, initial, low, high},
               {total - 1, initial, min, high, high}};
  else
    phases_ = {{rise, initial, max_lr, high, low}, {total - 1, max_lr, min, low, high}};
  // A phase of length zero that some step reaches divides by zero (PyTorch raises there):
  // the first when pct_start * total_steps is 1, the last when it ends where the one before does.
  if (rise == 0 || phases_.back().end_step == phases_[phases_.size() - 2].end_step)
    fail("OneCycleLR: pct_start {} of total_steps {} leaves a phase of no length",
         options.pct_start, total_steps);
}

// The value `anneal(phase, pct)` of the phase the step is in, for a double step on the host and
// for a graph value (where every phase is computed and the step's is selected).
template <typename Value, typename Anneal>
Value OneCycleLR::at(const Value& step, Anneal anneal) const {
  if constexpr (std::is_same_v<Value, double>) {
    double s = std::min(step, static_cast<double>(total_ - 1)), start = 0;
    for (size_t i = 0; i < phases_.size(); ++i) {
      const Phase& phase = phases_[i];
      if (s <= phase.end_step || i + 1 == phases_.size())
        return anneal(phase, (s - start) / (phase.end_step - start));
      start = phase.end_step;
    }
    return 0;  // not reached: the last phase takes every step
  } else {
    Tensor s = minimum(step, number(static_cast<double>(total_ - 1)));
    std::vector<Tensor> values;
    double start = 0;
    for (const Phase& phase : phases_) {
      values.push_back(anneal(phase, (s - start) / (phase.end_step - start)));
      start = phase.end_step;
    }
    // The first phase whose end the step has not passed (the last takes the rest).
    Tensor value = values.back();
    for (size_t i = phases_.size() - 1; i-- > 0;)
      value = where(s <= phases_[i].end_step, values[i], value);
    return value;
  }
}

namespace {
// PyTorch's _annealing_cos and _annealing_linear, for doubles and graph values alike.
template <typename Value>
Value anneal(bool cos_shape, double from, double to, const Value& pct) {
  using std::cos;
  if (cos_shape) return to + (from - to) / 2.0 * (cos(pct * std::numbers::pi) + 1.0);
  return (to - from) * pct + from;
}
}  // namespace

double OneCycleLR::lr(int64_t step) const {
  return at(static_cast<double>(step),
            [&](const Phase& p, double pct) { return anneal(cos_, p.start_lr, p.end_lr, pct); });
}

Tensor OneCycleLR::graph_lr(const Tensor& step) const {
  return at(step, [&](const Phase& p, const Tensor& pct) {
    return anneal(cos_, p.start_lr, p.end_lr, pct);
  });
}

std::optional<double> OneCycleLR::momentum(int64_t step) const {
  if (!cycle_) return std::nullopt;
  return at(static_cast<double>(step), [&](const Phase& p, double pct) {
    return anneal(cos_, p.start_momentum, p.end_momentum, pct);
  });
}

Tensor OneCycleLR::graph_momentum(const Tensor& step) const {
  if (!cycle_) return Tensor();
  return at(step, [&](const Phase& p, const Tensor& pct) {
    return anneal(cos_, p.start_momentum, p.end_momentum, pct);
  });
}

SequentialLR::SequentialLR(std::vector<std::shared_ptr<const LRSchedule>> schedules,
                           std::vector<int64_t> milestones)
    : schedules_(std::move(schedules)), milestones_(std::move(milestones)) {
  if (schedules_.empty()) fail("SequentialLR: got no schedules");
  for (size_t i = 0; i < schedules_.size(); ++i)
    if (!schedules_[i]) fail("SequentialLR: schedule {} is null", i);
  if (milestones_.size() + 1 != schedules_.size())
    fail("SequentialLR: {} schedules need {} milestones, got {}", schedules_.size(),
         schedules_.size() - 1, milestones_.size());
  for (size_t i = 0; i < milestones_.size(); ++i)
    if (milestones_[i] <= (i == 0 ? 0 : milestones_[i - 1]))
      fail("SequentialLR: milestones must be increasing and > 0, got {} at index {}",
           milestones_[i], i);
  for (const auto& schedule : schedules_) cycles_ |= schedule->momentum(0).has_value();
}

bool SequentialLR::requires_momentum() const {
  for (const auto& schedule : schedules_)
    if (schedule->requires_momentum()) return true;
  return false;
}

double SequentialLR::phase_momentum(size_t phase, int64_t local) const {
  if (std::optional<double> own = schedules_[phase]->momentum(local)) return *own;
  for (size_t before = phase; before-- > 0;) {
    // What the last cycling phase before this one wrote at its last step.
    const int64_t length = milestones_[before] - (before == 0 ? 0 : milestones_[before - 1]);
    if (std::optional<double> left = schedules_[before]->momentum(length - 1)) return *left;
  }
  for (size_t last = schedules_.size(); last-- > 0;)
    if (std::optional<double> first = schedules_[last]->momentum(0)) return *first;
  fail("SequentialLR: no schedule cycles the momentum");
}

std::optional<double> SequentialLR::momentum(int64_t step) const {
  if (!cycles_) return std::nullopt;
  size_t passed = 0;
  while (passed < milestones_.size() && milestones_[passed] <= step) ++passed;
  return phase_momentum(passed, passed == 0 ? step : step - milestones_[passed - 1]);
}

Tensor SequentialLR::graph_momentum(const Tensor& step) const {
  if (!cycles_) return Tensor();
  // As graph_lr; a phase that does not cycle has one value throughout, a host constant.
  auto phase_value = [&](size_t phase, const Tensor& local) {
    Tensor cycled = schedules_[phase]->graph_momentum(local);
    return cycled.defined() ? cycled : number(phase_momentum(phase, 0));
  };
  Tensor value = phase_value(0, step);
  for (size_t i = 1; i < schedules_.size(); ++i) {
    auto milestone = static_cast<double>(milestones_[i - 1]);
    Tensor local = maximum(step - milestone, number(0));
    value = where(step >= milestone, phase_value(i, local), value);
  }
  return value;
}

double SequentialLR::lr(int64_t step) const {
  size_t passed = 0;
  while (passed < milestones_.size() && milestones_[passed] <= step) ++passed;
  return schedules_[passed]->lr(passed == 0 ? step : step - milestones_[passed - 1]);
}

Tensor SequentialLR::graph_lr(const Tensor& step) const {
  Tensor rate = schedules_[0]->graph_lr(step);
  for (size_t i = 1; i < schedules_.size(); ++i) {
    auto milestone = static_cast<double>(milestones_[i - 1]);
    // Before its milestone a schedule is not used; its step is kept at 0 there, where every
    // schedule is defined.
    Tensor local = maximum(step - milestone, number(0));
    rate = where(step >= milestone, schedules_[i]->graph_lr(local), rate);
  }
  return rate;
}

}  // namespace mixtape
