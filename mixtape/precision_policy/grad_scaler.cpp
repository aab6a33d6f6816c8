// mixtape/precision_policy/grad_scaler.cpp -- loss scaling: unscale, non-finite check and the scale
// update built as graph code, so a training step never reads the scale or the flags on the host.
#include "mixtape/precision_policy/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape {
namespace {

// The scale is kept in f32 and unscaling multiplies by its reciprocal in f32, so both must be
// finite and non-zero: the scale stays within the normal f32 range, [2^-126, FLT_MAX]. Below it,
// 1/scale overflows to inf (2^-128 after 144 halvings from 2^16) and would poison every update.
constexpr double kSafeMinScale = std::numeric_limits<float>::min();
constexpr double kSafeMaxScale = std::numeric_limits<float>::max();

// A value the f32 scale can hold safely: rounded to f32 it stays a normal number.
bool fits_f32_scale(double value) {
  if (!(value > 0) || !std::isfinite(value)) return false;
  float rounded = static_cast<float>(value);
  return std::isfinite(rounded) && rounded >= static_cast<float>(kSafeMinScale);
}

// Whether `scale` lies outside [min_scale, max_scale] as the scaler keeps them, in f32: a scale
// clamped to a bound f32 cannot hold exactly (1e-5, 0.3) is that bound rounded, which compared
// as a double lay outside it, and a checkpoint saved there did not load.
bool outside_bounds(double scale, const GradScalerOptions& o) {
  const float kept = static_cast<float>(scale);
  return (o.min_scale && kept < static_cast<float>(*o.min_scale)) ||
         (o.max_scale && kept > static_cast<float>(*o.max_scale));
}

void check_options(const GradScalerOptions& o, const char* who, bool check_init) {
  if (check_init && !fits_f32_scale(o.init_scale))
    fail("{}: init_scale must be a normal f32 value in [2^-126, 3.4e38], got {}", who,
         o.init_scale);
  if (!(o.growth_factor > 1) || !std::isfinite(o.growth_factor))
    fail("{}: growth_factor must be finite and > 1, got {}", who, o.growth_factor);
  if (!(o.backoff_factor > 0 && o.backoff_factor < 1))
    fail("{}: backoff_factor must be in (0, 1), got {}", who, o.backoff_factor);
  if (o.growth_interval <= 0 || o.growth_interval > std::numeric_limits<int32_t>::max())
    fail("{}: growth_interval must be in [1, 2^31 - 1] (the tracker is i32), got {}", who,
         o.growth_interval);
  if (o.min_scale && !fits_f32_scale(*o.min_scale))
    fail("{}: min_scale must be a normal f32 value in [2^-126, 3.4e38], got {}", who, *o.min_scale);
  if (o.max_scale && !fits_f32_scale(*o.max_scale))
    fail("{}: max_scale must be a normal f32 value in [2^-126, 3.4e38], got {}", who, *o.max_scale);
  if (o.min_scale && o.max_scale && *o.min_scale > *o.max_scale)
    fail("{}: min_scale ({}) must not exceed max_scale ({})", who, *o.min_scale, *o.max_scale);
  if (check_init && outside_bounds(o.init_scale, o))
    fail("{}: init_scale {} lies outside [min_scale, max_scale] = [{}, {}]", who, o.init_scale,
         o.min_scale ? fmt::format("{}", *o.min_scale) : "none",
         o.max_scale ? fmt::format("{}", *o.max_scale) : "none");
}

// A node whose value is computed (or a constant) no longer needs what made it.
constexpr size_t kMaxPendingRecords = 1024;

// A leaf holding a copy of `t`'s value now. A step compiled with the scaler inside updates the
// scale's buffer in place on every replay, which a copy of the scaler or its state_dict must not
// follow.
Tensor value_now(const Tensor& t) {
  eval({t});
  return from_storage(host_copy(*t.node()->value), t.shape());
}

}  // namespace

GradScaler::SharedStatistics::SharedStatistics() : data(std::make_shared<Statistics>()) {}
GradScaler::SharedStatistics::SharedStatistics(const SharedStatistics& other)
    : data(std::make_shared<Statistics>(*other.data)) {}
GradScaler::SharedStatistics& GradScaler::SharedStatistics::operator=(
    const SharedStatistics& other) {
  data = std::make_shared<Statistics>(*other.data);
  return *this;
}

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  check_options(options_, "GradScaler", true);
  scale_ = full({}, options_.init_scale, f32);
  tracker_ = full({}, 0, i32);
}

GradScaler::GradScaler(const GradScaler& other)
    : options_(other.options_),
      scale_(value_now(other.scale_)),
      tracker_(value_now(other.tracker_)),
      per_optimizer_(other.per_optimizer_),
      stats_(other.stats_) {}

// Into this scaler's own tensors and statistics, as load_state_dict writes them: a step compiled
// with this scaler reads the scale through its tensors and records into its statistics, and
// traces again (state_version) with the new scale and settings.
GradScaler& GradScaler::operator=(const GradScaler& other) {
  if (this == &other) return *this;
  options_ = other.options_;
  {
    NoGradGuard no_grad;
    scale_.assign(value_now(other.scale_));
    tracker_.assign(value_now(other.tracker_));
  }
  per_optimizer_ = other.per_optimizer_;
  const int64_t version = stats_.data->state_version;
  *stats_.data = *other.stats_.data;
  stats_.data->state_version = version + 1;
  return *this;
}

GradScaler::PerOptimizer& GradScaler::state_of(const Optimizer& optimizer) {
  for (auto& [key, state] : per_optimizer_)
    if (key == &optimizer) return state;
  return per_optimizer_.emplace_back(&optimizer, PerOptimizer{}).second;
}

Tensor GradScaler::combined_found_inf() const {
  Tensor combined;
  for (const auto& [optimizer, state] : per_optimizer_)
    if (state.found_inf.defined())
      combined = combined.defined() ? combined + state.found_inf : state.found_inf;
  return combined;
}

Tensor GradScaler::found_inf() const {
  Tensor combined = combined_found_inf();
  NoGradGuard no_grad;
  return combined.defined() ? cast(ne(combined, zeros({}, f32)), f32) : zeros({}, f32);
}

Tensor GradScaler::scale(const Tensor& loss) {
  NoPolicyScope no_policy;  // loss-scale arithmetic keeps its traced types under any autocast
  if (!loss.defined()) fail("GradScaler.scale: the loss is an undefined tensor");
  if (!options_.enabled) {
    watch_state();
    return loss;
  }
  if (!is_floating(loss.dtype()))
    fail("GradScaler.scale: the loss must be floating-point, got {}", name(loss.dtype()));
  // A half loss is scaled in f32, so a large scale cannot overflow it before backward.
  DType t = loss.dtype() == f64 ? f64 : f32;
  return cast(loss, t) * cast(scale_, t);
}

void GradScaler::unscale_(Optimizer& optimizer) {
  NoPolicyScope no_policy;
  if (!options_.enabled) return;
  PerOptimizer& state = state_of(optimizer);
  if (state.stage == Stage::Unscaled)
    fail("GradScaler.unscale_: already called for this {} optimizer since the last update()",
         optimizer.kind());
  if (state.stage == Stage::Stepped)
    fail("GradScaler.unscale_: called after step() for this {} optimizer; call update() first",
         optimizer.kind());
  NoGradGuard no_grad;
  auto inverse = [&] { return cast(reciprocal(cast(scale_, f64)), f32); };
  Tensor inv_scale = inverse();
  // As PyTorch's kernel: half gradients are unscaled in f32 and rounded back.
  auto unscale = [](const Tensor& g, const Tensor& inv) {
    return is_half(g.dtype()) ? cast(cast(g, f32) * inv, g.dtype()) : g * cast(inv, g.dtype());
  };
  Tensor nan_if_bad;
  for (const Tensor& p : optimizer.params()) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    // The check runs on what the optimizer will apply, the unscaled gradients, as PyTorch's
    // _amp_foreach_non_finite_check_and_unscale_ does: a finite scaled gradient can still
    // overflow when unscaled, and no update with a non-finite value may reach the weights.
    // u - u is exactly 0 for every finite value and NaN for inf and NaN, so one sum per gradient
    // carries the flag, and the partial sums combine by addition. Each check unscales with
    // nodes of its own, down to the 0-d reciprocal, so that every check kernel reads only g and
    // the scale (the same kernel form for all, one multi-tensor launch) and the update's kernel
    // recomputes the product instead of reading a stored copy.
    Tensor checked = unscale(g, inverse());
    Tensor partial = cast(sum(checked - checked), f32);
    nan_if_bad = nan_if_bad.defined() ? nan_if_bad + partial : partial;
    Tensor unscaled = unscale(g, inv_scale);
    Tensor handle = p;
    handle.set_grad(unscaled);
  }
  // Over several processes the flag is reduced in the graph, so that every process skips the
  // same steps and keeps the same scale, even where only one saw a non-finite gradient: a NaN
  // on any process makes the sum NaN on all (an OR, as PyTorch's max-reduce of found_inf).
  if (nan_if_bad.defined() && process_count() > 1) nan_if_bad = all_reduce(nan_if_bad);
  state.found_inf = nan_if_bad.defined() ? cast(ne(nan_if_bad, nan_if_bad), f32) : Tensor();
  state.stage = Stage::Unscaled;
}

void GradScaler::step(Optimizer& optimizer) {
  NoPolicyScope no_policy;
  if (!options_.enabled) {
    optimizer.step();
    return;
  }
  if (state_of(optimizer).stage == Stage::Stepped)
    fail("GradScaler.step: already called for this {} optimizer since the last update()",
         optimizer.kind());
  if (state_of(optimizer).stage == Stage::Ready) unscale_(optimizer);
  PerOptimizer& state = state_of(optimizer);
  if (!state.found_inf.defined())
    fail(
        "GradScaler.step: none of the {} parameters of this {} optimizer has a gradient, so there "
        "is nothing to check or update (call backward() on scaler.scale(loss) first)",
        optimizer.params().size(), optimizer.kind());
  // The pending scale update of the previous step joins this step's program.
  try {
    optimizer.step_unless(state.found_inf, {scale_, tracker_});
  } catch (...) {
    // The step's graph failed to evaluate (a target out of range): its unscaled gradients and
    // inf flag are of that graph, which every later step() would evaluate again and update()
    // would fold into the scale. The optimizer starts over, as after update().
    state_of(optimizer) = PerOptimizer{};
    throw;
  }
  state.stage = Stage::Stepped;
}

void GradScaler::update() {
  NoPolicyScope no_policy;
  if (!options_.enabled) {
    watch_state();
    return;
  }
  Tensor combined = combined_found_inf();
  if (!combined.defined())
    fail(
        "GradScaler.update: no inf checks were recorded since the last update() (call step() or "
        "unscale_() with gradients first)");
  // step() evaluates the previous update with its program; without a step in between, do it
  // here so that update chains cannot grow.
  if (!scale_.node()->evaluated() || !tracker_.node()->evaluated()) eval({scale_, tracker_});
  NoGradGuard no_grad;
  Tensor found = ne(combined, zeros({}, f32));
  if (options_.dynamic) {
    // PyTorch's _amp_update_scale_: the f32 scale times a double factor, rounded to f32.
    Tensor scale64 = cast(scale_, f64);
    Tensor backed_off = cast(scale64 * options_.backoff_factor, f32);
    Tensor grown = cast(scale64 * options_.growth_factor, f32);
    Tensor grown_is_finite = eq(grown - grown, zeros({}, f32));
    Tensor successful = tracker_ + 1;
    Tensor grow = eq(successful, full({}, static_cast<double>(options_.growth_interval), i32));
    Tensor zero = zeros({}, i32);
    Tensor scale =
        where(found, backed_off, where(grow, where(grown_is_finite, grown, scale_), scale_));
    // The user's bounds, else the safe range: the scale never backs off into the subnormals,
    // where its reciprocal overflows.
    scale = maximum(scale, full({}, options_.min_scale.value_or(kSafeMinScale), f32));
    if (options_.max_scale) scale = minimum(scale, full({}, *options_.max_scale, f32));
    tracker_.assign_later(where(found, zero, where(grow, zero, successful)));
    scale_.assign_later(scale);
  }
  record(found);
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  NoPolicyScope no_policy;
  if (!options_.enabled) return;
  if (!fits_f32_scale(new_scale))
    fail("GradScaler.update: the new scale must be a normal f32 value in [2^-126, 3.4e38], got {}",
         new_scale);
  if (outside_bounds(new_scale, options_))
    fail("GradScaler.update: the new scale {} lies outside [min_scale, max_scale]", new_scale);
  Tensor combined = combined_found_inf();
  NoGradGuard no_grad;
  scale_.assign(full({}, new_scale, f32));
  ++stats_.data->state_version;
  record(combined.defined() ? ne(combined, zeros({}, f32)) : zeros({}, boolean));
  per_optimizer_.clear();
}

namespace {

// What record() leaves a compiled step to do after each replay: the replay recomputed this
// update's flag and scale in place, so the record takes copies of them.
// A disabled scaler's hook has no `add`: only the watch for its state being replaced (an
// enabled scaler assigned to it), after which the step traces again.
class RecordEachCall final : public StepHook {
 public:
  RecordEachCall(std::function<void(Tensor, Tensor)> add, std::function<bool()> replaced)
      : add_(std::move(add)), replaced_(std::move(replaced)) {}
  const char* stale() const override {
    return replaced_() ? "the loss scaler's state was loaded, set or assigned (load_state_dict, "
                         "update(s), =) since the step was traced"
                       : nullptr;
  }
  void ran(const std::vector<std::shared_ptr<Storage>>& values) override {
    if (add_) add_(from_storage(values.at(0), {}), from_storage(values.at(1), {}));
  }

 private:
  std::function<void(Tensor, Tensor)> add_;
  std::function<bool()> replaced_;
};

}  // namespace

std::function<bool()> GradScaler::replaced_since_now() const {
  std::weak_ptr<Statistics> stats = stats_.data;
  return [stats, version = stats_.data->state_version] {
    std::shared_ptr<Statistics> alive = stats.lock();
    return alive && alive->state_version != version;
  };
}

void GradScaler::watch_state() const {
  on_each_call(std::make_shared<RecordEachCall>(nullptr, replaced_since_now()));
}

namespace {
bool& statistics_paused() {
  thread_local bool paused = false;
  return paused;
}
}  // namespace

ScalerStatisticsPause::ScalerStatisticsPause() : was_paused_(statistics_paused()) {
  statistics_paused() = true;
}
ScalerStatisticsPause::~ScalerStatisticsPause() { statistics_paused() = was_paused_; }

void GradScaler::record(const Tensor& found) {
  if (statistics_paused()) return;
  // A step compiled by mt::compile runs this code only when it traces, so the record is made
  // on every call by host work the replays repeat (with no host read).
  std::weak_ptr<Statistics> stats = stats_.data;
  auto add = [stats](Tensor found_copy, Tensor scale_copy) {
    if (std::shared_ptr<Statistics> alive = stats.lock())
      alive->add({std::move(found_copy), std::move(scale_copy)});
  };
  if (on_each_call(std::make_shared<RecordEachCall>(std::move(add), replaced_since_now()),
                   {found.node(), scale_.node()}))
    return;
  stats_.data->add({found, Tensor(scale_.node())});  // this update's value, not later ones'
}

void GradScaler::Statistics::add(Record record) {
  pending.push_back(std::move(record));
  // The flags wait as graph values; resolving them now and then keeps the buffer small.
  if (pending.size() >= kMaxPendingRecords) resolve();
}

void GradScaler::Statistics::resolve() {
  if (pending.empty()) return;
  std::vector<Tensor> values;
  for (const Record& r : pending) {
    values.push_back(r.found);
    values.push_back(r.scale);
  }
  eval(values);
  for (const Record& r : pending) {
    bool skip = r.found.item() != 0;
    skip_history.push_back(skip);
    skipped += skip;
    scale_history.push_back(r.scale.item());
  }
  pending.clear();
}

double GradScaler::get_scale() const { return options_.enabled ? scale_.item() : 1.0; }

int64_t GradScaler::get_growth_tracker() const {
  return options_.enabled ? static_cast<int64_t>(tracker_.item()) : 0;
}

int64_t GradScaler::skipped_steps() const {
  stats_.data->resolve();
  return stats_.data->skipped;
}

std::vector<double> GradScaler::scale_history() const {
  stats_.data->resolve();
  return stats_.data->scale_history;
}

std::vector<bool> GradScaler::skip_history() const {
  stats_.data->resolve();
  return stats_.data->skip_history;
}

NamedTensors GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  auto number = [](double value) { return full({}, value, f64); };
  NamedTensors state = {
      // Copies of the values now, as PyTorch's state_dict() holds numbers: a state kept to
      // restore later (or written later) must not follow the replays of a compiled step, which
      // update the buffers in place. (An AOT export names the buffers themselves.)
      {"scale", value_now(scale_)},
      {"growth_tracker", value_now(tracker_)},
      {"growth_factor", number(options_.growth_factor)},
      {"backoff_factor", number(options_.backoff_factor)},
      {"growth_interval", number(static_cast<double>(options_.growth_interval))},
      {"dynamic", number(options_.dynamic ? 1 : 0)},
  };
  if (options_.min_scale) state.emplace_back("min_scale", number(*options_.min_scale));
  if (options_.max_scale) state.emplace_back("max_scale", number(*options_.max_scale));
  return state;
}

void GradScaler::load_state_dict(const NamedTensors& state) {
  const char* who = "GradScaler.load_state_dict";
  if (!options_.enabled) return;
  if (state.empty())
    fail("{}: the state is empty, possibly because it was saved from a disabled GradScaler", who);
  std::vector<std::pair<std::string, double>> values;
  std::vector<std::string> unknown;
  const std::vector<std::string> known = {"scale",          "growth_tracker",  "growth_factor",
                                          "backoff_factor", "growth_interval", "dynamic",
                                          "min_scale",      "max_scale"};
  // torch.cuda.amp.GradScaler.state_dict() names the tracker "_growth_tracker": its keys are
  // read as ours.
  auto has = [&](const char* key) {
    return std::any_of(state.begin(), state.end(), [&](const auto& e) { return e.first == key; });
  };
  if (has("_growth_tracker") && has("growth_tracker"))
    fail("{}: the state has both 'growth_tracker' and PyTorch's '_growth_tracker'", who);
  for (const auto& [named, tensor] : state) {
    const std::string& key = named == "_growth_tracker" ? known[1] : named;
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      unknown.push_back(key);
      continue;
    }
    if (!tensor.defined() || tensor.numel() != 1)
      fail("{}: '{}' must be a single value, got {}", who, key,
           tensor.defined() ? to_string(tensor.shape()) : "an undefined tensor");
    values.emplace_back(key, tensor.item());
  }
  if (!unknown.empty()) fail("{}: unknown entries {}", who, fmt::join(unknown, ", "));
  auto get = [&](const std::string& key) -> std::optional<double> {
    for (const auto& [k, v] : values)
      if (k == key) return v;
    return std::nullopt;
  };
  for (const char* required :
       {"scale", "growth_tracker", "growth_factor", "backoff_factor", "growth_interval"})
    if (!get(required)) fail("{}: the state has no '{}'", who, required);
  GradScalerOptions next = options_;
  next.growth_factor = *get("growth_factor");
  next.backoff_factor = *get("backoff_factor");
  double interval = *get("growth_interval");
  if (interval != std::floor(interval) || !(std::abs(interval) < 1e15))
    fail("{}: growth_interval must be an integer, got {}", who, interval);
  next.growth_interval = static_cast<int64_t>(interval);
  std::optional<double> dynamic = get("dynamic");
  if (dynamic && *dynamic != 0 && *dynamic != 1)
    fail("{}: dynamic must be 0 or 1, got {}", who, *dynamic);
  next.dynamic = dynamic.value_or(1) != 0;
  next.min_scale = get("min_scale");
  next.max_scale = get("max_scale");
  check_options(next, who, false);
  double scale = *get("scale"), tracker = *get("growth_tracker");
  // PyTorch would save a scale that backed off to zero, but resuming from it applies
  // 1/0 = inf to every gradient: a zero or subnormal scale cannot be right.
  if (!fits_f32_scale(scale))
    fail(
        "{}: the scale must be a normal f32 value in [2^-126, 3.4e38] (not zero, subnormal, "
        "negative or non-finite), got {}",
        who, scale);
  if (outside_bounds(scale, next))
    fail("{}: the scale {} lies outside [min_scale, max_scale]", who, scale);
  if (tracker != std::floor(tracker) || tracker < 0 ||
      tracker >= static_cast<double>(next.growth_interval))
    fail("{}: growth_tracker must be an integer in [0, growth_interval = {}), got {}", who,
         next.growth_interval, tracker);
  options_ = next;
  scale_.assign(full({}, scale, f32));
  tracker_.assign(full({}, tracker, i32));
  ++stats_.data->state_version;
}

}  // namespace mixtape
