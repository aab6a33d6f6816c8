// mixtape/dsl/optimizer_state.h -- what the built-in rules' updates share (dsl/optim.cpp,
// dsl/adaptive_optim.cpp): a parameter's state entries by name, and the options' checks.
#pragma once

#include <cmath>
#include <string_view>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/module.h"
#include "mixtape/dsl/ops.h"

namespace mixtape::optimizer_state {

/// An option that scales or decays: a NaN passed `x < 0` and made every parameter NaN.
inline bool finite_non_negative(double x) { return std::isfinite(x) && x >= 0; }

/// The entry `name`, or nullptr. By a view, not a std::string: names longer than the
/// small-string buffer would allocate on each of the traced loop's lookups.
inline Tensor* find_state(NamedTensors& state, std::string_view name) {
  for (auto& [key, value] : state)
    if (key == name) return &value;
  return nullptr;
}

/// An entry start_state() added: there from the first update on.
inline const Tensor& started_state(NamedTensors& state, std::string_view name) {
  Tensor* entry = find_state(state, name);
  if (!entry) fail("optimizer state '{}' was not started before the update", name);
  return *entry;
}

/// Sets entry `name` to `value`, adding it where missing.
inline void set_state(NamedTensors& state, std::string_view name, Tensor value) {
  if (Tensor* slot = find_state(state, name))
    *slot = std::move(value);
  else
    state.emplace_back(std::string(name), std::move(value));
}

/// 1 - beta^t, a bias correction in f64 as torch's Python floats: of the cycled beta (a 0-d f64
/// graph value) where there is one, else of the option's.
inline Tensor bias_correction(const Tensor& cycled, double beta, const Tensor& t) {
  return 1.0 - pow(cycled.defined() ? cycled : full({}, beta, f64), t);
}

}  // namespace mixtape::optimizer_state
