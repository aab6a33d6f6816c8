// mixtape/autograd/vjp.h -- vector-Jacobian products of every primitive op, dispatched from
// ops.def.
#pragma once

#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// The gradients of `node`'s inputs given the gradient `g` of its output; one entry per input,
/// undefined where an input gets no gradient (indices, conditions).
std::vector<Tensor> vjp(const NodePtr& node, const Tensor& g);

}  // namespace mixtape
