// mixtape/dsl/lr_plateau.h -- ReduceLROnPlateau: lowers an optimizer's rates when a metric the
// caller measures (a validation loss) stops improving. Host logic between epochs, not a schedule.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/dsl/optim.h"

namespace mixtape {

/// torch.optim.lr_scheduler.ReduceLROnPlateau's options, with its defaults.
struct ReduceLROnPlateauOptions {
  bool maximize = false;  // mode "max": a larger metric is better (an accuracy)
  double factor = 0.1;    // each reduction multiplies the rate by it (< 1)
  int64_t patience = 10;  // epochs without improvement tolerated before a reduction
  double threshold = 1e-4;
  bool relative_threshold = true;  // threshold_mode "rel" (else "abs")
  int64_t cooldown = 0;            // epochs after a reduction in which none is counted
  // The least rate: one for every group (also groups added later), or one per group.
  std::vector<double> min_lr{0.0};
  double eps = 1e-8;  // a reduction smaller than it is not made
};

/// ReduceLROnPlateau, as torch.optim.lr_scheduler.ReduceLROnPlateau: step(metric) once an epoch;
/// after more than `patience` epochs in which the metric did not improve on the best by the
/// threshold, every parameter group's rate is multiplied by `factor` (not below its min_lr), and
/// no epoch counts for `cooldown` epochs. It sets the rates with Optimizer::set_lr, graph inputs
/// written in place, so a compiled step follows. An optimizer whose groups have a schedule
/// attached, or that computes its own rate (Adafactor's relative_step), is refused. The
/// optimizer must outlive it.
class ReduceLROnPlateau {
 public:
  explicit ReduceLROnPlateau(Optimizer& optimizer, ReduceLROnPlateauOptions options = {});
  /// Takes the epoch's metric; returns whether the rates were reduced. A NaN metric is no
  /// improvement, as in torch.
  bool step(double metric);
  /// The best metric so far (+inf when minimizing, -inf when maximizing, before the first).
  double best() const { return best_; }
  int64_t bad_epochs() const { return bad_epochs_; }
  /// Its state, for a checkpoint's metadata (save_checkpoint's `metadata`), under `prefix`:
  /// "<prefix>best", "<prefix>bad_epochs", "<prefix>cooldown_counter", "<prefix>last_epoch".
  std::vector<std::pair<std::string, std::string>> state_dict(
      const std::string& prefix = "plateau.") const;
  /// Restores what state_dict() wrote (other entries are ignored); mt::Error, changing nothing,
  /// where an entry is missing or not a value it can hold.
  void load_state_dict(const std::vector<std::pair<std::string, std::string>>& entries,
                       const std::string& prefix = "plateau.");
  const ReduceLROnPlateauOptions& options() const { return options_; }

 private:
  bool better(double metric) const;
  double min_lr(size_t group) const;
  Optimizer& optimizer_;
  ReduceLROnPlateauOptions options_;
  double best_;
  int64_t bad_epochs_ = 0, cooldown_counter_ = 0, last_epoch_ = 0;
};

}  // namespace mixtape
