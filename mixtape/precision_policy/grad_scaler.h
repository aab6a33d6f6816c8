// mixtape/precision_policy/grad_scaler.h -- mt::GradScaler: static and dynamic loss scaling as
// graph code, with the scale, growth tracker and found-inf flags kept as graph values.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "mixtape/dsl/module.h"
#include "mixtape/dsl/optim.h"

namespace mixtape {

struct GradScalerOptions {
  double init_scale = 65536.0;  // rounded to f32, the type the scale is kept in
  double growth_factor = 2.0;   // > 1
  double backoff_factor = 0.5;  // in (0, 1)
  int64_t growth_interval = 2000;
  /// false: every call is a pass-through (scale 1, plain optimizer steps), as PyTorch's flag.
  bool enabled = true;
  /// Bounds for the scale after each update (our extension; PyTorch has none). init_scale must
  /// lie within them. Unset, the scale is still kept a normal f32 value (>= 2^-126), so that its
  /// reciprocal stays finite: every scale (init, bounds, update(new_scale), a loaded one) must be
  /// a normal f32 value in [2^-126, 3.4e38].
  std::optional<double> min_scale = std::nullopt;
  std::optional<double> max_scale = std::nullopt;
  /// false: a static scale that never changes; non-finite steps are still skipped.
  bool dynamic = true;
};

/// Loss scaling as torch.cuda.amp.GradScaler, but without host syncs: the scale (0-d f32), the
/// growth tracker (0-d i32) and the found-inf flags (0-d f32) are graph values. unscale_ and the
/// non-finite check are graph code evaluated with the optimizer's update, which is predicated on
/// the flag (Optimizer::step_unless); the scale update is graph code that is evaluated with the
/// next step's program. Use:
///
///   scaler.scale(loss).backward();  // as often as there are losses and micro-batches
///   scaler.unscale_(opt);           // optional, e.g. before clip_grad_norm
///   scaler.step(opt);               // for each optimizer
///   scaler.update();
///
/// Calls that return host values (get_scale, get_growth_tracker, skipped_steps, scale_history,
/// skip_history) evaluate and read graph values: they sync, so call them for logging, not in
/// every step of a hot loop.
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  /// A copy with a scale and tracker of its own: updates of one do not reach the other.
  GradScaler(const GradScaler& other);
  GradScaler& operator=(const GradScaler& other);

  /// loss * scale, in f32 (or f64 for an f64 loss). A disabled scaler returns `loss` itself.
  Tensor scale(const Tensor& loss);
  /// Divides the gradients of every parameter of `optimizer` by the scale (the inverse is
  /// computed in f64 and rounded to f32, as PyTorch does) and records whether any of the
  /// unscaled gradients holds an inf or NaN (PyTorch checks the scaled ones; after unscaling,
  /// a value that overflows only when unscaled, under a scale below 1, is caught too). Clipping
  /// after it sees true gradients. At most once per optimizer between update() calls, and not
  /// after step().
  void unscale_(Optimizer& optimizer);
  /// unscale_ (unless done), then optimizer.step_unless(found inf). At most once per optimizer
  /// between update() calls; the optimizer must have gradients.
  void step(Optimizer& optimizer);
  /// The next scale and growth tracker from the found-inf flags of every optimizer stepped since
  /// the last update (OR-ed, as PyTorch sums them), following PyTorch's _amp_update_scale_: on
  /// inf/NaN the scale is multiplied by backoff_factor and the tracker reset; otherwise the
  /// tracker counts up and at growth_interval the scale is multiplied by growth_factor (unless
  /// that overflows f32) and the tracker reset. Then the scale is clamped into
  /// [min_scale, max_scale] when those are set (our extension), and never below 2^-126 when
  /// min_scale is not. A static scaler keeps both.
  void update();
  /// Sets the scale to `new_scale` (as PyTorch's update(new_scale)); the tracker is kept.
  void update(double new_scale);

  /// The current scale (1 when disabled). Syncs.
  double get_scale() const;
  /// The current growth tracker (0 when disabled). Syncs.
  int64_t get_growth_tracker() const;
  /// Updates whose steps were skipped for inf/NaN gradients. Syncs once for the updates since
  /// the last such call; per-step flags wait as graph values until then.
  int64_t skipped_steps() const;
  /// The scale after each update() (or update(new_scale)), oldest first. Syncs like
  /// skipped_steps().
  std::vector<double> scale_history() const;
  /// Whether each update() saw inf/NaN gradients (its steps were skipped), oldest first.
  std::vector<bool> skip_history() const;

  /// 1 if a gradient of an optimizer stepped since the last update() held inf/NaN (its step is
  /// skipped), else 0: a 0-d f32 graph value, for logging without a sync (SummaryWriter). 0
  /// when nothing was stepped (or the scaler is disabled).
  Tensor found_inf() const;
  /// The scale and growth tracker as graph values (0-d f32, 0-d i32).
  const Tensor& scale_tensor() const { return scale_; }
  const Tensor& growth_tracker_tensor() const { return tracker_; }
  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }

  /// "scale" (0-d f32), "growth_tracker" (0-d i32) and the hyperparameters as 0-d f64 tensors
  /// ("growth_factor", "backoff_factor", "growth_interval", "dynamic", and "min_scale",
  /// "max_scale" when set), copies of the values now (a host sync), as PyTorch's numbers: they
  /// do not follow later steps, compiled or not. Empty for a disabled scaler, as in PyTorch.
  NamedTensors state_dict() const;
  /// Restores state_dict(): the scale, the tracker and the hyperparameters (absent bounds are
  /// unset). Everything is validated before anything changes. A no-op for a disabled scaler.
  void load_state_dict(const NamedTensors& state);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    Tensor found_inf;  // 0-d f32: 1 if a gradient held inf/NaN
  };
  struct Record {
    Tensor found;  // 0-d bool
    Tensor scale;  // 0-d f32, after the update
  };
  // The statistics: per-update records waiting as graph values, and what resolving them read.
  struct Statistics {
    std::vector<Record> pending;
    std::vector<double> scale_history;
    std::vector<bool> skip_history;
    int64_t skipped = 0;
    // Bumped when the state is replaced from outside a step (load_state_dict, update(s)): a
    // compiled step traced before it would replay the old scale and settings, so it traces again.
    int64_t state_version = 0;
    void add(Record record);
    void resolve();
  };
  // Shared with the host work that a step compiled by mt::compile runs after each replay (see
  // record()), which holds it weakly: records of a scaler that is gone are dropped. A copy of
  // the scaler gets statistics of its own.
  // Out of line, as is all that makes Statistics: a user's file that includes this header then
  // instantiates none of its containers.
  struct SharedStatistics {
    std::shared_ptr<Statistics> data;
    SharedStatistics();
    SharedStatistics(const SharedStatistics& other);
    SharedStatistics& operator=(const SharedStatistics& other);
  };

  PerOptimizer& state_of(const Optimizer& optimizer);
  // The OR of the recorded found-inf flags, as their f32 sum; undefined when none was recorded.
  Tensor combined_found_inf() const;
  void record(const Tensor& found);
  // Whether the state is replaced (state_version) after now: what a compiled step's hooks check.
  std::function<bool()> replaced_since_now() const;
  // A disabled scaler's part of a traced step: it traces again once the state is replaced.
  void watch_state() const;

  GradScalerOptions options_;
  // Each keeps its tensor for good, a new value assigned to it (as PyTorch updates its scale in
  // place): a step compiled without the scaler (mt::compile on the model alone) reads them
  // through the tensors and replays.
  Tensor scale_, tracker_;
  // In first-use order, so that the graph an update builds does not depend on addresses.
  std::vector<std::pair<const Optimizer*, PerOptimizer>> per_optimizer_;
  SharedStatistics stats_;
};

/// While one lives on this thread, update() records nothing in any scaler's statistics
/// (skipped_steps, scale_history, skip_history): aot::export_step traces the step on zeros, and
/// those updates are not the run's.
class ScalerStatisticsPause {
 public:
  ScalerStatisticsPause();
  ~ScalerStatisticsPause();
  ScalerStatisticsPause(const ScalerStatisticsPause&) = delete;
  ScalerStatisticsPause& operator=(const ScalerStatisticsPause&) = delete;

 private:
  bool was_paused_;
};

}  // namespace mixtape
