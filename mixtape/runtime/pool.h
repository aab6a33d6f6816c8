// mixtape/runtime/pool.h -- CPU max pooling (the MaxPool2d and MaxPool2dGrad primitives) over NCHW
// planes: loops over a plane padded with -inf whose inner loops run along an output row (they
// vectorize), threaded over the N * C planes.
#pragma once

#include "mixtape/dsl/node.h"

namespace mixtape {

/// True when max_pool_cpu computes `node` (f32, bf16 or f16 inputs and result); otherwise the
/// reference loops do.
bool max_pool_cpu_supported(const Node& node);

/// Computes a MaxPool2d or MaxPool2dGrad node from its inputs' values into `out` (the node's
/// storage type and size): the reference executor's bits, the gradient's sums in its order.
void max_pool_cpu(const Node& node, Storage& out);

}  // namespace mixtape
