// mixtape/dsl/wide_sums.cpp -- sums of a 16-bit input in f32, rounded once.
#include "mixtape/dsl/wide_sums.h"

#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"

namespace mixtape {

Tensor widened(const Tensor& x, const Loc& loc) {
  const DType t = composite::statistics_type(x.dtype());
  return Tensor(make_node(OpCode::Cast, t, x.shape(), {x.node()}, {}, loc));
}

Tensor narrowed_like(const Tensor& y, const Tensor& x, const Loc& loc) {
  const Tensor narrow = cast(y, x.dtype(), loc);
  if (x.numel() == 0 || x.dim() == 0) return narrow;
  const auto rank = static_cast<size_t>(x.dim());
  const Tensor corner =
      slice(x, std::vector<int64_t>(rank, 0), std::vector<int64_t>(rank, 1), Shape(rank, 1), loc);
  const Tensor like =
      broadcast_to(reshape(corner, Shape(static_cast<size_t>(y.dim()), 1), loc), y.shape(), loc);
  return cast_like(narrow, like, loc);
}

}  // namespace mixtape
