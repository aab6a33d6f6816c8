// mixtape/dsl/wide_sums.h -- how composites that add many terms of a 16-bit input (pooling,
// interpolation, im2col's gradient, col2im) sum them in f32 and round once, as PyTorch's kernels
// accumulate, also where a policy stores an f32-traced input in a half type.
#pragma once

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// x as an explicit cast to f32 (f64 for f64): a node also where x is traced in f32, because a
/// policy may store x in a half type (a convolution's output under autocast), and an explicit
/// cast keeps its traced type.
Tensor widened(const Tensor& x, const Loc& loc = Loc::current());
/// y, computed from widened(x), in the type x is stored in once the precision pass has run: its
/// traced type, then cast_like a one-element view of x broadcast to y's shape.
Tensor narrowed_like(const Tensor& y, const Tensor& x, const Loc& loc = Loc::current());

}  // namespace mixtape
