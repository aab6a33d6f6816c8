// mixtape/dsl/lr_schedule.h -- learning-rate schedules, each both a host closed form and graph
// code, so that a schedule attached to an optimizer (Optimizer::set_schedule) is replayed by
// mt::compile.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// A learning rate as a function of the update's 0-based index. Two forms of one rule:
/// - lr(step) on the host, for set_lr() called outside the step (each call writes the rate, a
///   graph input, in place);
/// - graph_lr(step) as graph code over a 0-d f64 step value; Optimizer::set_schedule() builds it
///   inside every step from the optimizer's step count, so mt::compile replays advance it.
/// The PyTorch-named schedules give, at index t, the rate torch.optim.lr_scheduler's scheduler
/// gives after t calls of scheduler.step() (its closed forms, in f64).
class LRSchedule {
 public:
  virtual ~LRSchedule() = default;
  virtual double lr(int64_t step) const = 0;
  /// `step`: a 0-d f64 graph value holding a whole number >= 0. Returns a 0-d f64 graph value.
  virtual Tensor graph_lr(const Tensor& step) const = 0;
  /// A schedule that also cycles the momentum (OneCycleLR's cycle_momentum) gives it here, in
  /// the same two forms: SGD's and RMSprop's momentum, the beta1 of Adam, AdamW, Lion, Adamax,
  /// NAdam and RAdam. Others give nothing (an undefined tensor), and the optimizer keeps its own.
  virtual std::optional<double> momentum(int64_t /*step*/) const { return std::nullopt; }
  virtual Tensor graph_momentum(const Tensor& /*step*/) const { return Tensor(); }
  /// Whether an optimizer without a momentum or beta1 (Adagrad, Adadelta, Adafactor) must refuse
  /// this schedule, as PyTorch's OneCycleLR refuses one when cycle_momentum is asked for.
  virtual bool requires_momentum() const { return false; }
};

/// ConstantLR(lr): the same rate at every step. ConstantLR(base_lr, factor, total_iters) is
/// torch.optim.lr_scheduler.ConstantLR: base_lr * factor for the first total_iters steps, then
/// base_lr (PyTorch's defaults 1/3 and 5).
class ConstantLR : public LRSchedule {
 public:
  explicit ConstantLR(double lr);
  ConstantLR(double base_lr, double factor, int64_t total_iters = 5);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_, factor_ = 1;
  int64_t total_ = 0;
};

/// torch.optim.lr_scheduler.CosineAnnealingLR (its closed form, which its step-by-step one
/// follows): eta_min + (base_lr - eta_min) (1 + cos(pi step / T_max)) / 2, rising again after
/// T_max as PyTorch's does (no restarts).
class CosineAnnealingLR : public LRSchedule {
 public:
  CosineAnnealingLR(double base_lr, int64_t T_max, double eta_min = 0);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_, min_;
  int64_t period_;
};

/// Linear warmup to peak over warmup_steps (step t < warmup_steps: peak (t + 1) / warmup_steps,
/// so the first step takes a share of the peak, not 0), then cosine decay to min_lr at
/// total_steps.
class CosineWithWarmup : public LRSchedule {
 public:
  CosineWithWarmup(double peak_lr, int64_t warmup_steps, int64_t total_steps, double min_lr = 0);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double peak_, min_;
  int64_t warmup_, total_;
};

/// torch.optim.lr_scheduler.CosineAnnealingWarmRestarts (SGDR, Loshchilov and Hutter 2017):
/// cosine annealing from base_lr to eta_min over a period of T_0 steps, restarted at base_lr at
/// the end of each period, each period T_mult times the last (an integer >= 1).
class CosineAnnealingWarmRestarts : public LRSchedule {
 public:
  CosineAnnealingWarmRestarts(double base_lr, int64_t T_0, int64_t T_mult = 1, double eta_min = 0);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_, min_;
  int64_t first_, mult_;
};

/// torch.optim.lr_scheduler.PolynomialLR: base_lr * (1 - min(step, total_iters) / total_iters)
/// ^ power, so 0 from total_iters on (PyTorch's defaults: 5 steps, power 1).
class PolynomialLR : public LRSchedule {
 public:
  explicit PolynomialLR(double base_lr, int64_t total_iters = 5, double power = 1);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_, power_;
  int64_t total_;
};

/// torch.optim.lr_scheduler.StepLR: base_lr * gamma^floor(step / step_size).
class StepLR : public LRSchedule {
 public:
  StepLR(double base_lr, int64_t step_size, double gamma = 0.1);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_, gamma_;
  int64_t step_size_;
};

/// MultiStepLR: base_lr * gamma^(the number of milestones <= step); a repeated milestone counts
/// as often as it is listed, in any order, as PyTorch's Counter does.
class MultiStepLR : public LRSchedule {
 public:
  MultiStepLR(double base_lr, std::vector<int64_t> milestones, double gamma = 0.1);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_, gamma_;
  std::vector<int64_t> milestones_;
};

/// ExponentialLR: base_lr * gamma^step.
class ExponentialLR : public LRSchedule {
 public:
  ExponentialLR(double base_lr, double gamma);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_, gamma_;
};

/// LinearLR (warmup or decay): base_lr times a factor going linearly from start_factor to
/// end_factor over total_iters steps, then end_factor. PyTorch's defaults.
class LinearLR : public LRSchedule {
 public:
  LinearLR(double base_lr, double start_factor = 1.0 / 3, double end_factor = 1.0,
           int64_t total_iters = 5);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_, start_, end_;
  int64_t total_;
};

struct OneCycleOptions {
  double pct_start = 0.3;         // the share of the steps spent rising
  bool cos = true;                // anneal_strategy 'cos'; false: 'linear'
  double div_factor = 25;         // initial_lr = max_lr / div_factor
  double final_div_factor = 1e4;  // min_lr = initial_lr / final_div_factor
  bool three_phase = false;
  /// PyTorch's cycle_momentum: the momentum (beta1) moves against the rate, from max_momentum
  /// down to base_momentum while the rate rises and back while it falls (three_phase: it stays
  /// at max_momentum in the last phase). Unset is PyTorch's default, true, except that an
  /// optimizer without a momentum (Adagrad, Adadelta, Adafactor) keeps the schedule for its rate
  /// alone where PyTorch raises; true asks for it and such an optimizer refuses the schedule.
  std::optional<bool> cycle_momentum = std::nullopt;
  double base_momentum = 0.85;
  double max_momentum = 0.95;
};

/// OneCycleLR's learning rate, PyTorch's defaults: from max_lr / div_factor up to max_lr over
/// pct_start of total_steps, then down to the minimum (three_phase: back to the initial rate
/// first). From total_steps on the rate (and momentum) stay those of the last step, total_steps
/// - 1, the minimum (PyTorch raises past total_steps; the formula there overshoots, below zero
/// for linear annealing).
/// With cycle_momentum (the default) the optimizer's momentum or beta1 follows the schedule too.
class OneCycleLR : public LRSchedule {
 public:
  OneCycleLR(double max_lr, int64_t total_steps, OneCycleOptions options = {});
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;
  std::optional<double> momentum(int64_t step) const override;
  Tensor graph_momentum(const Tensor& step) const override;
  bool requires_momentum() const override { return required_; }

 private:
  struct Phase {
    double end_step, start_lr, end_lr, start_momentum, end_momentum;
  };
  template <typename Value, typename Anneal>
  Value at(const Value& step, Anneal anneal) const;
  std::vector<Phase> phases_;
  int64_t total_;
  bool cos_, cycle_, required_;
};

/// torch.optim.lr_scheduler.LambdaLR: base_lr * factor(t) at step t, where `factor` is graph code
/// over a 0-d f64 step (mixtape ops: where, clamp, pow, ...) returning a 0-d number, so that a
/// compiled step's replays advance it as they do the built-in schedules; lr(t) runs the same
/// code on the host. Transformers' linear warmup and decay, with w warmup and n total steps:
///   mt::LambdaLR(3e-4, [](const mt::Tensor& t) {
///     return mt::where(t < w, t / w, mt::clamp((n - t) / (n - w), 0.0, std::nullopt)); })
class LambdaLR : public LRSchedule {
 public:
  using Factor = std::function<Tensor(const Tensor& step)>;
  LambdaLR(double base_lr, Factor factor);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;

 private:
  double base_;
  Factor factor_;
};

/// SequentialLR: schedules[0] until milestones[0], then schedules[1] counted from 0 at that
/// milestone, and so on (PyTorch's SequentialLR, where each later schedule starts at its closed
/// form's step 0). Milestones must be increasing and > 0, one fewer than the schedules.
/// Where some schedules cycle the momentum (OneCycleLR), it is PyTorch's momentum, which a
/// schedule writes into the optimizer only while it runs: a phase whose schedule cycles gives
/// it; a later phase that does not keeps the value the cycling one left at its last step; a
/// phase before the first cycling one has what constructing the schedules in list order leaves,
/// the last cycling schedule's momentum at its step 0.
class SequentialLR : public LRSchedule {
 public:
  SequentialLR(std::vector<std::shared_ptr<const LRSchedule>> schedules,
               std::vector<int64_t> milestones);
  double lr(int64_t step) const override;
  Tensor graph_lr(const Tensor& step) const override;
  std::optional<double> momentum(int64_t step) const override;
  Tensor graph_momentum(const Tensor& step) const override;
  bool requires_momentum() const override;

 private:
  // The momentum in phase `phase` (at its own step `local` where its schedule cycles), for a
  // sequence in which some schedule cycles.
  double phase_momentum(size_t phase, int64_t local) const;
  std::vector<std::shared_ptr<const LRSchedule>> schedules_;
  std::vector<int64_t> milestones_;
  bool cycles_ = false;  // some schedule cycles the momentum
};

}  // namespace mixtape
