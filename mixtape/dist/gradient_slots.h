// mixtape/dist/gradient_slots.h -- which of a backward's leaf gradients belongs to which
// parameter: shared by dist::DataParallel and dist::Zero, whose reductions walk the parameters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "mixtape/autograd/grad.h"

namespace mixtape::dist {

/// slot[p] is the index in `gradients` of parameter p's gradient (`param_of` maps a parameter to
/// its p), SIZE_MAX where the backward did not reach p. Empty where it reached none of them:
/// such a backward reduces nothing.
inline std::vector<size_t> gradient_slots(
    const LeafGradients& gradients, const std::unordered_map<const TensorImpl*, size_t>& param_of,
    size_t parameter_count) {
  std::vector<size_t> slot(parameter_count, SIZE_MAX);
  bool any = false;
  for (size_t i = 0; i < gradients.size(); ++i)
    if (auto found = param_of.find(gradients[i].first.get()); found != param_of.end()) {
      slot[found->second] = i;
      any = true;
    }
  if (!any) slot.clear();
  return slot;
}

}  // namespace mixtape::dist
