// mixtape/dsl/ema.h -- averaged weights (EMA and SWA) of a module, as torch.optim.swa_utils's
// AveragedModel: the weights diffusion and vision models are evaluated and shipped with.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mixtape/dsl/module.h"

namespace mixtape {

struct AveragedModelOptions {
  /// An exponential moving average with this decay (EMA): average = decay * average + (1 -
  /// decay) * weight. Unset: the equal-weight running mean of every update (SWA).
  std::optional<double> decay = 0.999;
  /// Average the floating-point buffers too (torch's use_buffers: batch norm's running
  /// statistics); integer buffers (num_batches_tracked) are copied. Unset, the buffers are
  /// copied at each update.
  bool average_buffers = false;
};

/// Averages of a module's parameters, as torch.optim.swa_utils.AveragedModel with avg_fn (an
/// EMA) or without (SWA's mean): the first update() copies the weights, each later one folds
/// them into the averages. Averages of f16 and bf16 weights are kept in f32, where an update
/// smaller than half's resolution is not lost. update() is graph code over a stored update
/// count, evaluated as one program; called inside a step that mt::compile replays, it is
/// replayed. The module must outlive it.
///
///   mt::AveragedModel ema(net, {.decay = 0.999});
///   for (...) { train_step(x, y); ema.update(); }
///   mt::NamedTensors training = ema.copy_to(net);  // evaluate or export the averaged weights
///   net.load_state_dict(training);                 // and go on training
class AveragedModel {
 public:
  explicit AveragedModel(const Module& module, AveragedModelOptions options = {});
  AveragedModel(const AveragedModel&) = delete;
  AveragedModel& operator=(const AveragedModel&) = delete;

  /// Folds the module's current weights into the averages.
  void update();
  /// Updates taken, torch's n_averaged (a host sync).
  int64_t updates() const;
  /// The averages (and buffers), by the module's state_dict names.
  const NamedTensors& averages() const { return averages_; }
  /// Writes the averages into the module (in its dtypes, through load_state_dict); returns the
  /// values they replaced, for module.load_state_dict() to put back.
  NamedTensors copy_to(Module& module) const;
  /// torch's AveragedModel.state_dict(): "n_averaged" (0-d i64) and each average as
  /// "module.<name>", which torch's AveragedModel.load_state_dict() takes. Values of the moment
  /// it is called (an update after it leaves them): take it when saving.
  NamedTensors state_dict() const;
  /// Restores what state_dict() wrote; mt::Error, changing nothing, for a missing or unexpected
  /// name, a shape that differs, a non-finite average, or a negative n_averaged.
  void load_state_dict(const NamedTensors& state);

 private:
  const Module& module_;
  AveragedModelOptions options_;
  NamedTensors averages_;     // by the module's state_dict() names
  std::vector<bool> folded_;  // per average: folded in (else the weight is copied)
  Tensor count_;              // 0-d f64, stored: updates taken
};

}  // namespace mixtape
