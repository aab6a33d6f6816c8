// mixtape/runtime/cpu_sort.h -- CPU loops for the Argsort primitive: the reference executor's
// stable order (NaN above +inf, -0 equal to +0), threaded over the lines.
#pragma once

#include "mixtape/dsl/node.h"

namespace mixtape {

/// True when argsort_cpu computes `node` (lines shorter than 2^32); otherwise the reference
/// loops do.
bool argsort_cpu_supported(const Node& node);

/// Whether argsort_cpu splits `node`'s lines over the OpenMP team (a large one).
bool argsort_cpu_splits(const Node& node);

/// Computes an Argsort node from its input's value into `out` (i64, the node's size): the
/// positions of a stable sort of each line, as the reference's.
void argsort_cpu(const Node& node, Storage& out);

}  // namespace mixtape
