// mixtape/runtime/all_reduce.h -- the collective ops' steps (all_reduce, reduce_scatter,
// all_gather): deterministic sums over the processes of the run, the same on every back end.
#pragma once

#include <cstdint>
#include <memory>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// The collective steps this process ran since reset_execution_stats() (which clears these too):
/// how many, the bytes of their inputs, and their wall time, waiting for the other processes
/// included. What a data-parallel step spends in communication against its compute.
struct CollectiveStats {
  int64_t calls = 0;
  int64_t bytes = 0;
  double seconds = 0;
};
CollectiveStats collective_stats();
void reset_collective_stats();

/// The value of an all_reduce node (input 0 evaluated): each process sums one contiguous chunk
/// of the elements over every process in rank order (accumulated in f32, f64 for f64, i64 for
/// integers; rounded once to the node's storage type), then every process gathers every chunk.
/// So the bits are the same on every process and in every run of the same world size.
std::shared_ptr<Storage> all_reduce_value(const Node& node);
/// The value of a reduce_scatter node: this process's equal share of the sum, added as
/// all_reduce adds (ZeRO-1's gradient reduction).
std::shared_ptr<Storage> reduce_scatter_value(const Node& node);
/// The value of an all_gather node: every process's input in rank order (bytes only).
std::shared_ptr<Storage> all_gather_value(const Node& node);

}  // namespace mixtape
