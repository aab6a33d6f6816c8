// dsl/shape.cpp -- shape arithmetic shared by the op builders and the executors.
#include "dsl/shape.h"

#include <algorithm>

#include "dsl/error.h"

namespace mixtape {

int64_t numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> strides_of(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

std::string to_string(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

int64_t normalize_axis(int64_t axis, size_t rank, const char* op) {
  int64_t r = static_cast<int64_t>(rank);
  if (axis < -r || axis >= r) fail("{}: axis {} is out of range for rank {}", op, axis, rank);
  return axis < 0 ? axis + r : axis;
}

std::vector<int64_t> normalize_axes(const std::vector<int64_t>& axes, size_t rank, const char* op) {
  std::vector<int64_t> out;
  if (axes.empty()) {
    for (size_t i = 0; i < rank; ++i) out.push_back(static_cast<int64_t>(i));
    return out;
  }
  for (int64_t a : axes) out.push_back(normalize_axis(a, rank, op));
  std::sort(out.begin(), out.end());
  if (std::adjacent_find(out.begin(), out.end()) != out.end())
    fail("{}: axis list [{}] repeats an axis", op, fmt::join(axes, ", "));
  return out;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    if (da != db && da != 1 && db != 1)
      fail("{}: shapes {} and {} cannot be broadcast together", op, to_string(a), to_string(b));
    out[i] = da == 1 ? db : da;
  }
  return out;
}

}  // namespace mixtape
