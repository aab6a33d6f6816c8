// mixtape/dsl/optimizer_entries.h -- facts about the built-in optimizers' state entries that both
// load_checkpoint (dsl/optim.cpp) and an exported artifact's NAME_load (runtime/aot_runtime.cpp)
// check; a header, so that artifacts link nothing more for it.
#pragma once

#include <string_view>

namespace mixtape {

/// What state entry `entry` of the built-in rule `kind` ("Adam", "RMSprop", ...) is where it is
/// a running sum or mean of squared gradients, never below zero (a negative element is a corrupt
/// state, and the next step's square root NaN); null otherwise.
constexpr const char* never_negative_state(std::string_view kind, std::string_view entry) {
  struct Row {
    std::string_view kind, entry;
    const char* what;
  };
  constexpr const char* mean = "a running mean of squared gradients";
  constexpr Row table[] = {
      {"Adam", "exp_avg_sq", mean},
      {"AdamW", "exp_avg_sq", mean},
      {"Adam", "max_exp_avg_sq", "a running maximum of squared-gradient means"},
      {"AdamW", "max_exp_avg_sq", "a running maximum of squared-gradient means"},
      {"NAdam", "exp_avg_sq", mean},
      {"RAdam", "exp_avg_sq", mean},
      {"Adamax", "exp_inf", "a running maximum of absolute gradients"},
      {"Adadelta", "square_avg", mean},
      {"Adadelta", "acc_delta", "a running mean of squared steps"},
      {"RMSprop", "square_avg", mean},
      {"Adagrad", "sum", "a running sum of squared gradients"},
      {"Adafactor", "exp_avg_sq", mean},
      {"Adafactor", "exp_avg_sq_row", mean},
      {"Adafactor", "exp_avg_sq_col", mean},
  };
  for (const Row& row : table)
    if (row.kind == kind && row.entry == entry) return row.what;
  return nullptr;
}

}  // namespace mixtape
