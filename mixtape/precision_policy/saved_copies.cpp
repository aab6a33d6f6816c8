// mixtape/precision_policy/saved_copies.cpp -- precision-aware saving: the rounded copies of
// forward values that a policy keeps for the backward pass in a narrower type.
#include <unordered_map>

#include "mixtape/autograd/saved_values.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/precision_policy/policy.h"

namespace mixtape {
namespace {

class NarrowedCopies : public SavedValues {
 public:
  NodePtr read(const NodePtr& value) override {
    auto [found, added] = copies_.try_emplace(value.get());
    if (added) found->second = copy_of(value);
    return found->second ? found->second : value;
  }

 private:
  // The copy the backward pass reads of `value`, or null where it reads the value: a gradient
  // node, a recomputed or already computed value (its bytes exist already), a leaf, or a type
  // not narrower than the value's storage.
  static NodePtr copy_of(const NodePtr& value) {
    const Node& x = *value;
    if (x.backward || x.recomputed || x.evaluated() || !is_floating(x.dtype) || !x.origin.policy ||
        op_info(x.op).kind == OpKind::Leaf || !x.precision.assigned)
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
  assign_precision(nodes_in_tape_order(roots));
  return std::make_unique<NarrowedCopies>();
}

}  // namespace mixtape
