// mixtape/runtime/reference_executor.h -- the oracle: one plain loop per primitive op.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// Computes one node from its inputs' values (which must all be evaluated). Pointwise math runs
/// in the compute type of the dtype (f32 for f32/f16/bf16, f64 for f64, int64 for integers);
/// reductions and matmul accumulate in f64; results are rounded to the node's dtype.
std::shared_ptr<Storage> reference_compute(const Node& node);

/// Input i of `node` in the node's storage type, for ops that move elements as bytes: the
/// precision pass may store an input otherwise (an f32 parameter viewed inside an f16 region),
/// which is then converted.
std::shared_ptr<Storage> input_as_storage(const Node& node, size_t i);

/// An indexing node's indices (input 1: IndexSelect, IndexAdd, Gather, ScatterAdd, Scatter) read
/// on the host, each checked against the size of the indexed axis: mixtape::Error naming the node
/// for the first out of range.
std::vector<int64_t> checked_indices(const Node& node);

}  // namespace mixtape
