// mixtape/autograd/grad.h -- functional gradients (mt::grad) and the tape walk behind backward().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
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

/// The gradients one backward() is about to accumulate into leaves, with each leaf's shared
/// state, in the order its walk reached them (the same order for the same graph).
using LeafGradients = std::vector<std::pair<std::shared_ptr<TensorImpl>, Tensor>>;
/// Sees, and may replace, the gradients of every backward() before they are accumulated
/// (dist::DataParallel averages them over the processes of the run). Hooks run in the order
/// they were added; add returns the id that removes one.
using GradientHook = std::function<void(LeafGradients& gradients)>;
int64_t add_gradient_hook(GradientHook hook);
void remove_gradient_hook(int64_t id);

}  // namespace mixtape
