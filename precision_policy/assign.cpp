// precision_policy/assign.cpp -- the precision pass: asks each node's policy and records its
// answer.
#include "precision_policy/assign.h"

#include "dsl/error.h"
#include "precision_policy/policy.h"

namespace mixtape {
namespace {

// A scalar constant, possibly broadcast or reshaped: like a Python number in PyTorch, it does
// not widen the type of the op it meets.
bool is_scalar_constant(const Node& node) {
  if (node.op == OpCode::Full) return true;
  if ((node.op == OpCode::BroadcastTo || node.op == OpCode::Reshape) && !node.inputs.empty())
    return is_scalar_constant(*node.inputs[0]);
  return false;
}

void keep_traced(Node& node, const char* rule) {
  node.storage = node.compute = node.dtype;
  node.accum = node.dtype == f64 ? f64 : f32;
  node.precision_rule = rule;
}

}  // namespace

void assign_precision(const std::vector<Node*>& order) {
  for (Node* node : order) {
    if (node->precision_assigned) continue;
    node->precision_assigned = true;
    if (!is_floating(node->dtype)) {
      keep_traced(*node, "not a floating-point value");
    } else if (node->dtype == f64) {
      keep_traced(*node, "f64 is never lowered");
    } else if (!node->policy) {
      keep_traced(*node, "no policy: as traced");
    } else if (node->op == OpCode::Constant) {
      // Data already exists; its storage is what it holds.
      keep_traced(*node, "leaf data keeps its dtype");
      node->storage = node->compute = node->value ? node->value->dtype : node->dtype;
    } else {
      PrecisionQuery query{node->op,
                           op_info(node->op).category,
                           node->dtype,
                           {},
                           {},
                           node->module_path,
                           node->composite,
                           node->backward,
                           node->forward_op};
      for (const NodePtr& input : node->inputs)
        if (is_floating(input->dtype)) {
          query.input_storage.push_back(input->storage);
          query.input_is_scalar.push_back(is_scalar_constant(*input));
        }
      Precision decided = node->policy->decide(query);
      for (DType t : {decided.storage, decided.compute, decided.accum})
        if (!is_floating(t))
          fail("policy '{}' gave the floating-point node {} a non-float precision {}",
               node->policy->name(), op_name(node->op), name(t));
      node->storage = decided.storage;
      node->compute = decided.compute;
      node->accum = decided.accum;
      node->precision_rule = std::move(decided.rule);
    }
  }
}

}  // namespace mixtape
