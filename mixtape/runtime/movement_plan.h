// mixtape/runtime/movement_plan.h -- concat, unslice and index_add as device-independent copy plans
// that a GPU runs as kernels (runtime/cuda_fixed_kernels.cpp) and tests check on the host.
#pragma once

#include <cstdint>
#include <vector>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// A copy of a box of elements between two buffers of one element type: for every coordinate c
/// of `shape`, dst[dst_base + sum_k c_k * dst_stride[k]] = src[src_base + sum_k c_k *
/// src_stride[k]].
struct CopyBox {
  std::vector<int64_t> shape, src_stride, dst_stride;
  int64_t src_base = 0, dst_base = 0;
  int64_t count() const;
};

/// The same copy over fewer dims: extents of 1 dropped, and neighbours that are contiguous in
/// both buffers merged (a concat along an axis is at most rank 2 this way).
CopyBox merged(const CopyBox& box);

/// Where each input of a Concat lands in its output, merged.
std::vector<CopyBox> concat_boxes(const Node& node);
/// Where an Unslice's input lands in its (otherwise zero) output, merged.
CopyBox unslice_box(const Node& node);

/// IndexAdd's sources by the row they add into, in the order the reference adds them (j
/// ascending): row r of the indexed axis takes sources order[offsets[r] .. offsets[r + 1]).
/// `index` must be in range (checked_indices).
struct IndexAddPlan {
  std::vector<int64_t> offsets, order;
};
IndexAddPlan index_add_plan(const std::vector<int64_t>& index, int64_t dim);

}  // namespace mixtape
