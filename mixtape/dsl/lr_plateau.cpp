// mixtape/dsl/lr_plateau.cpp -- ReduceLROnPlateau, in PyTorch's order of checks, so that the same
// metrics reduce the rates at the same epochs.
#include "mixtape/dsl/lr_plateau.h"

#include <charconv>
#include <cmath>
#include <limits>

#include "mixtape/dsl/error.h"

namespace mixtape {

ReduceLROnPlateau::ReduceLROnPlateau(Optimizer& optimizer, ReduceLROnPlateauOptions options)
    : optimizer_(optimizer), options_(std::move(options)) {
  if (!(options_.factor >= 0 && options_.factor < 1))
    fail("ReduceLROnPlateau: factor must be in [0, 1), got {}", options_.factor);
  if (options_.patience < 0 || options_.cooldown < 0)
    fail("ReduceLROnPlateau: patience ({}) and cooldown ({}) must be >= 0", options_.patience,
         options_.cooldown);
  if (!(options_.threshold >= 0) || !std::isfinite(options_.threshold) || !(options_.eps >= 0))
    fail("ReduceLROnPlateau: threshold and eps must be finite and >= 0");
  if (optimizer.computes_own_rate())
    fail("ReduceLROnPlateau: {} computes its own rate (relative_step)", optimizer.kind());
  const size_t groups = optimizer.group_count();
  if (options_.min_lr.size() != 1 && options_.min_lr.size() != groups)
    fail("ReduceLROnPlateau: {} min_lr values for an optimizer of {} parameter groups",
         options_.min_lr.size(), groups);
  for (double least : options_.min_lr)
    if (!(least >= 0) || !std::isfinite(least))
      fail("ReduceLROnPlateau: min_lr must be finite and >= 0, got {}", least);
  best_ = options_.maximize ? -std::numeric_limits<double>::infinity()
                            : std::numeric_limits<double>::infinity();
}

bool ReduceLROnPlateau::better(double metric) const {
  const double t = options_.threshold;
  if (options_.maximize)
    return options_.relative_threshold ? metric > best_ * (t + 1) : metric > best_ + t;
  return options_.relative_threshold ? metric < best_ * (1 - t) : metric < best_ - t;
}

double ReduceLROnPlateau::min_lr(size_t group) const {
  return options_.min_lr.size() == 1 ? options_.min_lr[0] : options_.min_lr[group];
}

bool ReduceLROnPlateau::step(double metric) {
  // Before anything changes: a group whose schedule sets its rate cannot be reduced, nor one
  // added (add_param_group) without a min_lr of its own.
  for (size_t g = 0; g < optimizer_.group_count(); ++g)
    if (optimizer_.schedule(g))
      fail("ReduceLROnPlateau: group {} of the {} has a schedule attached, which sets its rate", g,
           optimizer_.kind());
  if (options_.min_lr.size() != 1 && options_.min_lr.size() != optimizer_.group_count())
    fail(
        "ReduceLROnPlateau: {} min_lr values for an optimizer now of {} parameter groups (one was "
        "added since; give one min_lr for all)",
        options_.min_lr.size(), optimizer_.group_count());
  ++last_epoch_;
  if (better(metric)) {
    best_ = metric;
    bad_epochs_ = 0;
  } else {
    ++bad_epochs_;
  }
  if (cooldown_counter_ > 0) {  // epochs in cooldown count as none
    --cooldown_counter_;
    bad_epochs_ = 0;
  }
  if (bad_epochs_ <= options_.patience) return false;
  bool reduced = false;
  for (size_t g = 0; g < optimizer_.group_count(); ++g) {
    const double old_lr = optimizer_.lr(g);
    const double new_lr = std::max(old_lr * options_.factor, min_lr(g));
    if (old_lr - new_lr > options_.eps) {
      optimizer_.set_lr(g, new_lr);
      reduced = true;
    }
  }
  cooldown_counter_ = options_.cooldown;
  bad_epochs_ = 0;
  return reduced;
}

std::vector<std::pair<std::string, std::string>> ReduceLROnPlateau::state_dict(
    const std::string& prefix) const {
  return {{prefix + "best", fmt::format("{}", best_)},
          {prefix + "bad_epochs", std::to_string(bad_epochs_)},
          {prefix + "cooldown_counter", std::to_string(cooldown_counter_)},
          {prefix + "last_epoch", std::to_string(last_epoch_)}};
}

void ReduceLROnPlateau::load_state_dict(
    const std::vector<std::pair<std::string, std::string>>& entries, const std::string& prefix) {
  auto text = [&](const char* name) -> const std::string& {
    for (const auto& [key, value] : entries)
      if (key == prefix + name) return value;
    fail("ReduceLROnPlateau: the state has no '{}{}'", prefix, name);
  };
  auto count = [&](const char* name) {
    const std::string& value = text(name);
    int64_t n = -1;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
    if (value.empty() || ec != std::errc() || end != value.data() + value.size() || n < 0)
      fail("ReduceLROnPlateau: '{}{}' = '{}' is not a count", prefix, name, value);
    return n;
  };
  const std::string& best_text = text("best");
  double best = 0;
  auto [end, ec] = std::from_chars(best_text.data(), best_text.data() + best_text.size(), best);
  if (best_text.empty() || ec != std::errc() || end != best_text.data() + best_text.size() ||
      std::isnan(best))
    fail("ReduceLROnPlateau: '{}best' = '{}' is not a metric", prefix, best_text);
  const int64_t bad = count("bad_epochs"), cooldown = count("cooldown_counter"),
                last = count("last_epoch");
  if (bad > options_.patience || cooldown > options_.cooldown)
    fail(
        "ReduceLROnPlateau: {} bad epochs and a cooldown of {} cannot be the state of patience {} "
        "and cooldown {}",
        bad, cooldown, options_.patience, options_.cooldown);
  best_ = best;
  bad_epochs_ = bad;
  cooldown_counter_ = cooldown;
  last_epoch_ = last;
}

}  // namespace mixtape
