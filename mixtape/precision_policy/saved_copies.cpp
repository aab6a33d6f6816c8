// mixtape/precision_policy/saved_copies.cpp -- precision-aware saving: the rounded copies of
// forward values that a policy keeps for the backward pass in a narrower type.
#include <unordered_map>
#include <unordered_set>

#include "mixtape/autograd/saved_values.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/precision_policy/policy.h"

namespace mixtape {
namespace {

// A view in its source's type stores nothing of its own (one that converts is stored).
bool index_map(const Node& node) {
  return op_info(node.op).kind == OpKind::View &&
         node.precision.storage_type == node.inputs[0]->precision.storage_type;
}

// Whether fused kernels compute the node: pointwise ops, views, reductions and fills.
bool kernel_computed(const Node& node) {
  switch (op_info(node.op).kind) {
    case OpKind::Pointwise:
    case OpKind::View:
    case OpKind::Reduce:
    case OpKind::Leaf:
      return true;
    default:
      return false;
  }
}

// The forward values that are stored whatever the backward pass reads: the results of the ops
// that are no kernels' (products, convolutions, attention, host steps) and the values they read.
// Any other value fused kernels may compute again where the backward pass reads it (a layer
// norm's rows from its input), so a copy of it would add bytes rather than halve them.
std::unordered_set<const Node*> stored_in_any_case(const std::vector<Node*>& graph) {
  std::unordered_set<const Node*> stored;
  for (const Node* node : graph) {
    if (node->backward || kernel_computed(*node)) continue;
    stored.insert(node);
    for (const NodePtr& input : node->inputs) {
      const Node* source = input.get();
      while (index_map(*source)) source = source->inputs[0].get();
      stored.insert(source);
    }
  }
  return stored;
}

class NarrowedCopies : public SavedValues {
 public:
  explicit NarrowedCopies(std::unordered_set<const Node*> stored) : stored_(std::move(stored)) {}

  NodePtr read(const NodePtr& value) override {
    auto [found, added] = copies_.try_emplace(value.get());
    if (added) found->second = index_map(*value) ? view_of_copy(value) : copy_of(value);
    return found->second ? found->second : value;
  }

 private:
  // A view is read as the same view of its source's copy, where the source has one (a copy of
  // the view would store every element the view repeats).
  NodePtr view_of_copy(const NodePtr& view) {
    NodePtr source = read(view->inputs[0]);
    if (source == view->inputs[0]) return nullptr;
    NodeInputs inputs = view->inputs;
    inputs[0] = std::move(source);
    NodePtr copy = make_node(view->op, view->dtype, Shape(view->shape), std::move(inputs),
                             Attrs(view->attrs), view->origin.location);
    copy->requires_grad = false;
    copy->backward = false;
    copy->forward_op = OpCode::Constant;
    copy->origin = view->origin;
    copy->precision = view->precision;
    copy->precision.storage_type = copy->precision.compute =
        copy->inputs[0]->precision.storage_type;
    return copy;
  }

  // The copy the backward pass reads of `value`, or null where it reads the value: a gradient
  // node, a recomputed or already computed value (its bytes exist already), a leaf, a value not
  // stored in any case, or a type not narrower than the value's storage.
  NodePtr copy_of(const NodePtr& value) const {
    const Node& x = *value;
    if (x.backward || x.recomputed || x.evaluated() || !is_floating(x.dtype) || !x.origin.policy ||
        op_info(x.op).kind == OpKind::Leaf || !x.precision.assigned || !stored_.count(&x))
      return nullptr;
    const Policy& policy = *x.origin.policy;
    if (!policy.saves_narrower()) return nullptr;
    std::optional<DType> kept = policy.saved_type(precision_query(x));
    const DType stored = x.precision.storage_type;
    if (!kept || size_of(*kept) >= size_of(stored)) return nullptr;
    // Made while a gradient rule runs, but a forward value that runs right after `value`; typed
    // here, so the pass leaves it.
    NodePtr copy = make_companion(value, OpCode::Cast, x.dtype);
    copy->precision.storage_type = copy->precision.compute = *kept;
    copy->precision.accum = f32;
    copy->precision.assigned = true;
    copy->precision.rule = std::make_shared<const std::string>(
        fmt::format("{}: kept for the backward pass in {}, one rounding of its {} {}",
                    policy.name(), name(*kept), name(stored), op_name(x.op)));
    return copy;
  }

  std::unordered_set<const Node*> stored_;
  std::unordered_map<const Node*, NodePtr> copies_;  // null: the value itself
};

}  // namespace

std::unique_ptr<SavedValues> saved_values_for(const std::vector<NodePtr>& roots,
                                              const std::vector<NodePtr>& tape) {
  const Policy* asked = nullptr;
  bool any = false;
  for (const NodePtr& node : tape) {
    const Policy* policy = node->origin.policy.get();
    if (!policy || policy == asked) continue;
    asked = policy;
    if ((any = policy->saves_narrower())) break;
  }
  if (!any) return nullptr;
  // What is narrower depends on each value's storage, which the pass decides (as evaluation
  // would: a typed node keeps its types).
  std::vector<Node*> graph = nodes_in_tape_order(roots);
  assign_precision(graph);
  return std::make_unique<NarrowedCopies>(stored_in_any_case(graph));
}

}  // namespace mixtape
