// mixtape/runtime/all_reduce.h -- the all_reduce op's step: a deterministic sum over the
// processes of the run, the same on every back end (a host step).
#pragma once

#include <memory>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// The value of an all_reduce node (input 0 evaluated): each process sums one contiguous chunk
/// of the elements over every process in rank order (accumulated in f32, f64 for f64, i64 for
/// integers; rounded once to the node's storage type), then every process gathers every chunk.
/// So the bits are the same on every process and in every run of the same world size.
std::shared_ptr<Storage> all_reduce_value(const Node& node);

}  // namespace mixtape
