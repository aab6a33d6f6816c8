// mixtape/runtime/axis_lines.h -- a row-major tensor seen as lines along one axis, for the scans
// and sorts of the reference executor and the CPU back end.
#pragma once

#include <cstdint>

#include "mixtape/dsl/shape.h"

namespace mixtape {

/// The lines along `axis` of a tensor of `shape`: line (o, i), numbered o * inner + i, holds
/// elements (o * dim + k) * inner + i for k in [0, dim).
struct AxisLines {
  int64_t outer = 1, dim = 1, inner = 1;
  AxisLines(const Shape& shape, int64_t axis) : dim(shape[axis]) {
    for (int64_t d = 0; d < axis; ++d) outer *= shape[d];
    for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  }
  int64_t count() const { return outer * inner; }
  /// The flat position of line `line`'s k-th element.
  int64_t at(int64_t line, int64_t k) const {
    return (line / inner * dim + k) * inner + line % inner;
  }
  /// Calls visit(at) for each line in order, `at` the flat position of its k-th element as a
  /// function of k.
  template <typename F>
  void for_each(F visit) const {
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i)
        visit([o, i, this](int64_t k) { return (o * dim + k) * inner + i; });
  }
};

}  // namespace mixtape
