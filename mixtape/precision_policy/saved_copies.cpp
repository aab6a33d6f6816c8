// mixtape/precision_policy/saved_copies.cpp -- precision-aware saving: the rounded copies of
// forward values that a policy keeps for the backward pass in a narrower type.
#include <unordered_map>
#include <unordered_set>

#include "mixtape/autograd/saved_values.h"
#include "mixtape/autograd/vjp.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/precision_policy/policy.h"

namespace mixtape {
namespace {

// A view in its source's type stores nothing of its own (one that converts is stored). An
// evaluated node may have let its inputs go: it is its own value.
bool index_map(const Node& node) {
  return !node.evaluated() && op_info(node.op).kind == OpKind::View && !node.inputs.empty() &&
         node.precision.storage_type == node.inputs[0]->precision.storage_type;
}

const Node* source_of(const Node* node) {
  while (index_map(*node)) node = node->inputs[0].get();
  return node;
}

// The forward values of `graph` a gradient rule may read as rounded copies:
// - stored in any case: the results of ops that are no kernels' (products, convolutions,
//   attention, host steps) and the values they read as they are (not through a view). Fused
//   kernels may compute any other value again where the backward pass reads it (a layer norm's
//   rows from its input, a GELU's output where a reshape lays it out for a product), and a copy
//   of it would add bytes rather than halve them (measured: +13% on a two-block MLP);
// - read by no rule otherwise than as a product's operand (gradient_reads): a max's rule
//   compares its input with its result, and a rounded copy of one would send the gradient
//   nowhere;
// - no input of a checkpointed module, which its recomputation reads as it is anyway.
std::unordered_set<const Node*> copyable(const std::vector<Node*>& graph,
                                         Recomputation* recompute) {
  std::unordered_set<const Node*> stored, excluded;
  for (const Node* node : graph) {
    if (node->backward || node->evaluated()) continue;
    const GradientReads reads = gradient_reads(node->op);
    const bool product_or_step = !kernel_op(*node);
    if (product_or_step) stored.insert(node);
    if (reads.output == ValueReads::Other) excluded.insert(node);
    const CheckpointRegion region = recompute ? recompute->region_of(*node) : CheckpointRegion();
    for (size_t i = 0; i < node->inputs.size(); ++i) {
      const Node* source = source_of(node->inputs[i].get());
      // Read through a view, a kernel's value is computed again where the view is laid out
      // for the product (the backward pass's too): only one read as it is stays stored.
      if (product_or_step && source == node->inputs[i].get()) stored.insert(source);
      if (reads.inputs == ValueReads::Other || i >= reads.as_read) excluded.insert(source);
      if (region && !(recompute->region_of(*source) == region)) excluded.insert(source);
    }
  }
  for (const Node* node : excluded) stored.erase(node);
  return stored;
}

class NarrowedCopies : public SavedValues {
 public:
  explicit NarrowedCopies(std::unordered_set<const Node*> copyable)
      : copyable_(std::move(copyable)) {}

  NodePtr read(const NodePtr& value) override {
    if (value->evaluated()) return value;  // its bytes exist
    auto found = copies_.find(value.get());
    if (found == copies_.end()) {
      // view_of_copy reads the view's source first, which may add to the map.
      NodePtr copy = index_map(*value) ? view_of_copy(value) : copy_of(value);
      found = copies_.emplace(value.get(), std::move(copy)).first;
    }
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
    make_forward(*copy, view->origin);
    copy->precision = view->precision;
    copy->precision.storage_type = copy->precision.compute =
        copy->inputs[0]->precision.storage_type;
    return copy;
  }

  // The copy the backward pass reads of `value`, or null where it reads the value: a gradient
  // node, a recomputed value, a leaf, a value not copyable, or a type not narrower than the
  // value's storage.
  NodePtr copy_of(const NodePtr& value) const {
    const Node& x = *value;
    if (x.backward || x.recomputed || !is_floating(x.dtype) || !x.origin.policy ||
        op_info(x.op).kind == OpKind::Leaf || !x.precision.assigned || !copyable_.count(&x))
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

  std::unordered_set<const Node*> copyable_;
  std::unordered_map<const Node*, NodePtr> copies_;  // null: the value itself
};

}  // namespace

std::unique_ptr<SavedValues> saved_values_for(const std::vector<NodePtr>& roots,
                                              const std::vector<NodePtr>& tape, bool create_graph,
                                              Recomputation* recompute) {
  if (create_graph) return nullptr;
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
  return std::make_unique<NarrowedCopies>(copyable(graph, recompute));
}

}  // namespace mixtape
