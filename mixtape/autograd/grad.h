// mixtape/autograd/grad.h -- functional gradients (mt::grad) and the tape walk behind backward().
#pragma once

#include <utility>
#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// d(sum of outputs[i] * grad_outputs[i]) / d(inputs[j]) for each input, as new graph nodes.
/// grad_outputs may be empty when every output has one element. With create_graph the
/// gradients are themselves differentiable (higher-order derivatives).
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs = {}, bool create_graph = false,
                         bool allow_unused = false, const Loc& loc = Loc::current());

/// Walks the tape from `roots` (seeded with `seeds`) and returns the gradient of every node
/// that requires grad on the way, in the order the walk reached them: a fixed order for a given
/// graph (never one that follows node addresses), so that what callers build from the list is
/// the same graph every time.
std::vector<std::pair<const Node*, Tensor>> backpropagate(const std::vector<NodePtr>& roots,
                                                          const std::vector<Tensor>& seeds,
                                                          bool create_graph);

}  // namespace mixtape
