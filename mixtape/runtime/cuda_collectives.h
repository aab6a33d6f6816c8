// mixtape/runtime/cuda_collectives.h -- the collective steps on the GPU: device memory moved by
// NCCL and summed in rank order by a fixed kernel, with the host path's bits.
#pragma once

#include "mixtape/dsl/node.h"

namespace mixtape {

/// Runs a collective node (all_reduce, reduce_scatter, all_gather) in device memory through NCCL
/// when this process has a communicator over the run's processes (dist::init makes one where
/// every process can use NCCL) and the node's input converts on the GPU; the value has the bits
/// of runtime/all_reduce.h's host path. False, with nothing done, otherwise (the executor then
/// runs it on the host through MPI). Every process decides alike: the communicator is the
/// run's, and the graphs, hence the dtypes, are the same on each.
bool run_collective_on_device(Node& node);

}  // namespace mixtape
