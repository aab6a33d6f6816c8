// runtime/cuda_movement.h -- concat, unslice, index_select and index_add on the GPU, so that a
// model's embedding and its gradient, and joined slices, stay in device memory.
#pragma once

#include <string>

#include "dsl/node.h"

namespace mixtape {

/// The CUDA C++ of the movement kernels (the emitted kernels' prelude first): box copies for
/// 1/2/4/8-byte elements, row gathers, and row sums in the reference's order and rounding.
std::string cuda_movement_source();

/// Runs `node` (Concat, Unslice, IndexSelect or IndexAdd) on the GPU, its inputs' values there
/// or uploaded. False, with nothing done, for other ops and for dtypes the kernels do not cover
/// (the executor then runs it on the host). Indices are checked on the host first, as the
/// reference checks them: an index computed on the device is downloaded for that.
bool run_movement_on_device(Node& node);

}  // namespace mixtape
