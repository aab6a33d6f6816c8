// mixtape/dsl/composites.h -- the composites' names and autocast categories, from
// dsl/composites.def.
#pragma once

#include "mixtape/dsl/node.h"

namespace mixtape::composite {

// One object per name: every node a composite makes points to the same characters.
#define MT_COMPOSITE(name, category) inline constexpr char name[] = #name;
#include "mixtape/dsl/composites.def"

/// The category autocast gives the composite named `name` as a whole: Follow for a composite
/// that leaves each node to its op's category, and for null or a name not in the table.
Category category(const char* name);

/// The type the f32 composites (softmax, the norms, the losses) compute in whatever their input's
/// type: f32, or f64 for an f64 input. PyTorch's kernels compute them in float for 16-bit inputs
/// and round the result once; rounding each node to 16 bits instead loses the small differences
/// they are made of (a confident row's loss, log(1 + 3e-4), is 0 in bf16). Under autocast and
/// pure policies the nodes inside are f32 already; this makes a half-typed trace without a policy
/// agree with PyTorch's eager 16-bit model.
DType statistics_type(DType input);

/// Every composite's name, in table order.
const std::vector<const char*>& names();

}  // namespace mixtape::composite
