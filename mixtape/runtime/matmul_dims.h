// mixtape/runtime/matmul_dims.h -- a MatMul node's problem size, as every executor reads it (and
// puts it in its back end's descriptor).
#pragma once

#include <cstdint>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// [batch] x [m, k] x [k, n]: the output's last two dimensions, the inner size from the first
/// operand (its second-to-last dimension when transposed), and the batch the broadcast output's
/// leading dimensions make (0 for an empty output).
struct MatmulDims {
  int64_t m, n, k, batch;
};

inline MatmulDims matmul_dims(const Node& node) {
  const Shape& a = node.inputs[0]->shape;
  const size_t rank = node.shape.size();
  MatmulDims d{};
  d.m = node.shape[rank - 2];
  d.n = node.shape[rank - 1];
  d.k = node.attrs.transpose_a ? a[rank - 2] : a[rank - 1];
  d.batch = d.m * d.n == 0 ? 0 : node.numel() / (d.m * d.n);
  return d;
}

/// A back end's matmul descriptor (GemmDesc, cuda::MatmulDesc: both name these fields alike) with
/// the node's dims and transposes, and its other fields at their defaults.
template <typename Desc>
Desc matmul_desc(const Node& node) {
  const MatmulDims d = matmul_dims(node);
  Desc desc{};
  desc.batch = d.batch, desc.m = d.m, desc.n = d.n, desc.k = d.k;
  desc.transpose_a = node.attrs.transpose_a, desc.transpose_b = node.attrs.transpose_b;
  return desc;
}

}  // namespace mixtape
