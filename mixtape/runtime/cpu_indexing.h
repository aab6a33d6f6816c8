// mixtape/runtime/cpu_indexing.h -- CPU loops for the indexing primitives (IndexSelect, IndexAdd,
// Gather, ScatterAdd, Scatter): the reference executor's bits and errors, threaded over positions
// that no two index elements share.
#pragma once

#include "mixtape/dsl/node.h"

namespace mixtape {

/// True when indexing_cpu computes `node`: one of the five ops, whose sums (IndexAdd,
/// ScatterAdd) are of floats in an f32 or f64 accumulator; otherwise the reference loops do.
bool indexing_cpu_supported(const Node& node);

/// Whether indexing_cpu splits `node`'s work over the OpenMP team (a large one).
bool indexing_cpu_splits(const Node& node);

/// Computes an indexing node from its inputs' values into `out` (the node's storage type and
/// size): the reference's bits (sums in f64, each position's terms in index order, rounded once)
/// and, for an index out of range, its mt::Error naming the first such index.
void indexing_cpu(const Node& node, Storage& out);

}  // namespace mixtape
