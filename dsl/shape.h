// dsl/shape.h -- shapes, element counts, axis normalization and numpy broadcasting.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mixtape {

using Shape = std::vector<int64_t>;

int64_t numel(const Shape& shape);
/// Row-major strides in elements.
std::vector<int64_t> strides_of(const Shape& shape);
/// "[2, 3, 4]"
std::string to_string(const Shape& shape);
/// Maps a possibly negative axis into [0, rank); throws mt::Error naming `op` when out of range.
int64_t normalize_axis(int64_t axis, size_t rank, const char* op);
/// Normalizes, sorts and deduplicates axes; an empty list means every axis.
std::vector<int64_t> normalize_axes(const std::vector<int64_t>& axes, size_t rank, const char* op);
/// numpy broadcasting of two shapes; throws mt::Error naming `op` when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace mixtape
