// mixtape/autograd/vjp.h -- vector-Jacobian products of every primitive op, dispatched from
// ops.def.
#pragma once

#include <cstdint>
#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// The gradients of `node`'s inputs given the gradient `g` of its output; one entry per input,
/// undefined where an input gets no gradient (indices, conditions).
std::vector<Tensor> vjp(const NodePtr& node, const Tensor& g);

/// How an op's gradient rule reads forward values: not at all (it moves, indexes or adds up the
/// incoming gradient), as a product's operands (matmul, the convolutions, attention: rounding
/// one changes the gradient as a lower-precision product would), or otherwise (a comparison, a
/// cancellation, a formula: a rounded value could send the gradient elsewhere). From the op
/// table: a pointwise op's rule text, the kind of any other op. Precision-aware saving
/// (precision_policy/saved_copies.cpp) rounds only values that no rule reads otherwise.
enum class ValueReads : uint8_t { None, AsProduct, Other };
struct GradientReads {
  ValueReads inputs;  // of the op's inputs ...
  ValueReads output;  // of the op's own result
  // ... of its first `as_read` inputs; the others are read Other where `inputs` is AsProduct
  // (attention's mask and dropout offset: the recomputed softmax must see the forward's mask).
  size_t as_read = SIZE_MAX;
};
GradientReads gradient_reads(OpCode op);

}  // namespace mixtape
