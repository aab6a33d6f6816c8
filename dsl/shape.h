// dsl/shape.h -- shapes, element counts, axis normalization and numpy broadcasting.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mixtape {

using Shape = std::vector<int64_t>;

int64_t numel(const Shape& shape);
/// Row-major strides in elements.
std::vector<int64_t> strides_of(const Shape& shape);
/// "[2, 3, 4]"
std::string to_string(const Shape& shape);
/// numpy broadcasting of two shapes; nullopt when they are incompatible.
std::optional<Shape> broadcast_shapes(const Shape& a, const Shape& b);

}  // namespace mixtape
