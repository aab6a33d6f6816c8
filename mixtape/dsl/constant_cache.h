// mixtape/dsl/constant_cache.h -- tables that composites make on the host, kept by what makes them.
#pragma once

#include <functional>
#include <string>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// The constant `make()` gives, made at the first call with `key` and kept: a composite's
/// host-made table (one-hot class indices, pooling divisors, interpolation indices and weights)
/// is then one buffer that every step reads, which a compiled step's replay binds (a new
/// constant on each trace stops replay), neither made again nor copied to a device again. `key`
/// names everything the table depends on (the op, its sizes and factors, the dtype). Kept for
/// the process up to 64 MiB of tables, past which the oldest are let go (a step reading one then
/// traces again); a table over 4 MiB is made afresh at each call.
Tensor cached_constant(const std::string& key, const std::function<Tensor()>& make);

}  // namespace mixtape
