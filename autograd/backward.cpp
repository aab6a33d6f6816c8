// autograd/backward.cpp -- the tape walk: backward() and grad() emit gradient nodes into the graph.
#include <algorithm>
#include <unordered_map>

#include "autograd/grad.h"
#include "autograd/vjp.h"
#include "dsl/ops.h"

namespace mixtape {
namespace {

// Every node that requires grad and leads to a root, latest first (reverse tape order).
std::vector<NodePtr> tape_in_reverse(const std::vector<NodePtr>& roots) {
  std::vector<NodePtr> order;
  std::unordered_map<const Node*, bool> seen;
  std::vector<NodePtr> stack;
  for (const NodePtr& root : roots)
    if (root->requires_grad) stack.push_back(root);
  while (!stack.empty()) {
    NodePtr node = std::move(stack.back());
    stack.pop_back();
    if (seen[node.get()]) continue;
    seen[node.get()] = true;
    for (const NodePtr& input : node->inputs)
      if (input->requires_grad && !seen[input.get()]) stack.push_back(input);
    order.push_back(std::move(node));
  }
  std::sort(order.begin(), order.end(),
            [](const NodePtr& a, const NodePtr& b) { return a->id > b->id; });
  return order;
}

void accumulate(std::unordered_map<const Node*, Tensor>& grads, const NodePtr& node, Tensor g) {
  if (g.dtype() != node->dtype) g = cast(g, node->dtype);
  Tensor& slot = grads[node.get()];
  slot = slot.defined() ? slot + g : g;
}

}  // namespace

std::unordered_map<const Node*, Tensor> backpropagate(const std::vector<NodePtr>& roots,
                                                      const std::vector<Tensor>& seeds,
                                                      bool create_graph) {
  if (seeds.size() != roots.size())
    fail("backpropagate: {} seeds for {} roots", seeds.size(), roots.size());
  for (size_t i = 0; i < roots.size(); ++i)
    if (!seeds[i].defined() || seeds[i].shape() != roots[i]->shape)
      fail("backpropagate: seed {} has shape {}, its root has {}", i,
           seeds[i].defined() ? to_string(seeds[i].shape()) : "undefined",
           to_string(roots[i]->shape));
  NoGradGuard mode(create_graph);
  std::unordered_map<const Node*, Tensor> grads;
  for (size_t i = 0; i < roots.size(); ++i)
    if (roots[i]->requires_grad) accumulate(grads, roots[i], seeds[i]);
  for (const NodePtr& node : tape_in_reverse(roots)) {
    if (op_info(node->op).kind == OpKind::Leaf) continue;
    auto found = grads.find(node.get());
    if (found == grads.end()) continue;
    BackwardScope scope(*node);
    std::vector<Tensor> input_grads = vjp(node, found->second);
    for (size_t i = 0; i < input_grads.size() && i < node->inputs.size(); ++i)
      if (input_grads[i].defined() && node->inputs[i]->requires_grad)
        accumulate(grads, node->inputs[i], input_grads[i]);
  }
  return grads;
}

namespace {

Tensor seed_for(const Tensor& output, const Tensor& grad, const char* op, const Loc& loc) {
  if (!grad.defined()) {
    if (output.numel() != 1)
      op_fail(op, loc,
              "an implicit gradient needs a single-element output, got shape {}; pass a "
              "gradient of the output's shape",
              to_string(output.shape()));
    return ones_like(output);
  }
  if (grad.shape() != output.shape())
    op_fail(op, loc, "gradient shape {} does not match output shape {}", to_string(grad.shape()),
            to_string(output.shape()));
  return grad;
}

}  // namespace

void Tensor::backward(const Tensor& grad, const Loc& loc) const {
  if (!defined()) op_fail("backward", loc, "called on an undefined tensor");
  if (!requires_grad())
    op_fail("backward", loc,
            "the tensor does not require grad: no input of the computation was "
            "marked with requires_grad_() (or it was built under no_grad)");
  Tensor seed = seed_for(*this, grad, "backward", loc);
  auto grads = backpropagate({node()}, {seed}, false);
  for (auto& [node, g] : grads) {
    if (op_info(node->op).kind != OpKind::Leaf) continue;
    std::shared_ptr<TensorImpl> owner = node->grad_owner.lock();
    if (!owner || owner->node.get() != node) continue;
    owner->grad = owner->grad ? (Tensor(owner->grad) + g).node() : g.node();
  }
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs, bool create_graph,
                         bool allow_unused, const Loc& loc) {
  if (outputs.empty()) op_fail("grad", loc, "needs at least one output");
  if (!grad_outputs.empty() && grad_outputs.size() != outputs.size())
    op_fail("grad", loc, "{} gradients given for {} outputs", grad_outputs.size(), outputs.size());
  std::vector<NodePtr> roots;
  std::vector<Tensor> seeds;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined()) op_fail("grad", loc, "output {} is undefined", i);
    roots.push_back(outputs[i].node());
    seeds.push_back(
        seed_for(outputs[i], grad_outputs.empty() ? Tensor() : grad_outputs[i], "grad", loc));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) op_fail("grad", loc, "input {} is undefined", i);
    if (!inputs[i].requires_grad()) op_fail("grad", loc, "input {} does not require grad", i);
  }
  auto grads = backpropagate(roots, seeds, create_graph);
  std::vector<Tensor> result;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto found = grads.find(inputs[i].node().get());
    if (found != grads.end()) {
      result.push_back(found->second);
    } else if (allow_unused) {
      result.push_back(Tensor());
    } else {
      op_fail("grad", loc, "input {} is not used to compute the outputs (pass allow_unused)", i);
    }
  }
  return result;
}

}  // namespace mixtape
