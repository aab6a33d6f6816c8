// mixtape/dsl/optimizer_entries.h -- facts about the built-in optimizers' state entries that both
// load_checkpoint (dsl/optim.cpp) and an exported artifact's NAME_load (runtime/aot_runtime.cpp)
// check; a header, so that artifacts link nothing more for it.
#pragma once

#include <limits>
#include <string_view>

namespace mixtape {

/// The values state entry `entry` of the built-in rule `kind` ("Adam", "NAdam", ...) can hold:
/// [low, high], what the entry is, and the range in words. An element outside is a corrupt state
/// (a negative running mean of squares makes the next step's square root NaN). `what` is null
/// for an entry without a range.
struct StateRange {
  double low = -std::numeric_limits<double>::infinity();
  double high = std::numeric_limits<double>::infinity();
  const char* what = nullptr;
  const char* range = nullptr;  // "never below zero", "in [0, 1]"
  constexpr bool holds(double v) const { return !(v < low || v > high); }  // NaN: checked apart
};

constexpr StateRange state_range(std::string_view kind, std::string_view entry) {
  struct Row {
    std::string_view kind, entry;
    StateRange range;
  };
  constexpr double inf = std::numeric_limits<double>::infinity();
  constexpr const char* never_negative = "never below zero";
  constexpr StateRange mean{0, inf, "a running mean of squared gradients", never_negative};
  constexpr StateRange largest{0, inf, "a running maximum of squared-gradient means",
                               never_negative};
  constexpr Row table[] = {
      {"Adam", "exp_avg_sq", mean},
      {"AdamW", "exp_avg_sq", mean},
      {"Adam", "max_exp_avg_sq", largest},
      {"AdamW", "max_exp_avg_sq", largest},
      {"NAdam", "exp_avg_sq", mean},
      {"NAdam", "mu_product", {0, 1, "a product of momentum factors", "in [0, 1]"}},
      {"RAdam", "exp_avg_sq", mean},
      {"Adamax", "exp_inf", {0, inf, "a running maximum of absolute gradients", never_negative}},
      {"Adadelta", "square_avg", mean},
      {"Adadelta", "acc_delta", {0, inf, "a running mean of squared steps", never_negative}},
      {"RMSprop", "square_avg", mean},
      {"Adagrad", "sum", {0, inf, "a running sum of squared gradients", never_negative}},
      {"Adafactor", "exp_avg_sq", mean},
      {"Adafactor", "exp_avg_sq_row", mean},
      {"Adafactor", "exp_avg_sq_col", mean},
  };
  for (const Row& row : table)
    if (row.kind == kind && row.entry == entry) return row.range;
  return {};
}

}  // namespace mixtape
