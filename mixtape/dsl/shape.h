// mixtape/dsl/shape.h -- shapes, element counts, axis normalization and numpy broadcasting.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mixtape {

using Shape = std::vector<int64_t>;

/// The element count; mt::Error if it overflows int64 (shapes of nodes are checked when the node
/// is made, so this only fires for shapes that never became one).
int64_t numel(const Shape& shape);
/// The element count, or nullopt for a negative dimension or a count that overflows int64.
std::optional<int64_t> checked_numel(const Shape& shape);
/// The most bytes one tensor may span, 2^60 (an exbibyte): larger counts cannot be real, and
/// keeping byte arithmetic far from int64's limit keeps every offset computation exact.
inline constexpr int64_t max_tensor_bytes = int64_t{1} << 60;
/// Row-major strides in elements.
std::vector<int64_t> strides_of(const Shape& shape);
/// "[2, 3, 4]"
std::string to_string(const Shape& shape);
/// `shape` reduced over `axes` (non-negative): those dims dropped, or kept as 1 with `keepdim`.
Shape reduced_shape(const Shape& shape, const std::vector<int64_t>& axes, bool keepdim);
/// numpy broadcasting of two shapes; nullopt when they are incompatible.
std::optional<Shape> broadcast_shapes(const Shape& a, const Shape& b);

/// A (height, width) pair of a 2-d window (kernel, stride, padding, ...) that also takes one
/// number for both, as PyTorch's `int or tuple`: `.stride = 2`, `.padding = {1, 0}`.
struct Size2 {
  int64_t h = 0, w = 0;
  Size2(int64_t both) : h(both), w(both) {}  // NOLINT: implicit, as PyTorch's int argument
  Size2(int64_t h, int64_t w) : h(h), w(w) {}
  bool operator==(const Size2&) const = default;
};

/// A (depth, height, width) triple of a 3-d window, also one number for all three.
struct Size3 {
  int64_t d = 0, h = 0, w = 0;
  Size3(int64_t all) : d(all), h(all), w(all) {}  // NOLINT: implicit, as PyTorch's int argument
  Size3(int64_t d, int64_t h, int64_t w) : d(d), h(h), w(w) {}
  bool operator==(const Size3&) const = default;
};

}  // namespace mixtape
