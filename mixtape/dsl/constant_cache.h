// mixtape/dsl/constant_cache.h -- tables that composites make on the host, kept by value.
#pragma once

#include <cstdint>
#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// `values` as a constant of `shape` and `dtype`, the same tensor for the same values: a
/// composite's host-made table (one-hot class indices, pooling divisors, interpolation indices
/// and weights) is then one buffer that every step reads, which a compiled step's replay binds
/// (a new constant on each trace stops replay), not recomputed nor copied to a device again.
/// Kept for the process, up to a bound past which the oldest are let go (a step reading one then
/// traces again); a table over 4 MiB is made afresh each time.
Tensor cached_constant(const std::vector<double>& values, const Shape& shape, DType dtype);
Tensor cached_constant(const std::vector<int64_t>& values, const Shape& shape, DType dtype);

}  // namespace mixtape
