// precision_policy/assign.cpp -- the precision pass: asks each node's policy and records its
// answer.
#include "precision_policy/assign.h"

#include <string_view>
#include <unordered_map>

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

using Rule = std::shared_ptr<const std::string>;

void keep_traced(Node& node, const Rule& rule) {
  node.storage = node.compute = node.dtype;
  node.accum = node.dtype == f64 ? f64 : f32;
  node.precision_rule = rule;
}

Rule shared_rule(const char* text) { return std::make_shared<const std::string>(text); }

struct Decision {
  DType storage, compute, accum;
  Rule rule;
};

// Answers of pure policies by their query's bytes (policy id, op, types, inputs, module path,
// composite, pass): a traced step asks the same few hundred questions every step. Per thread,
// so no lock; dropped whole when it grows past any real model's count of distinct queries.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
thread_local std::unordered_map<std::string, Decision, StringHash, std::equal_to<>> answers;
constexpr size_t kMaxAnswers = 1 << 14;

template <typename T>
void append(std::string& key, const T& value) {
  key.append(reinterpret_cast<const char*>(&value), sizeof value);
}

// What the policy is asked about `node`: its op, types, floating inputs and where it was made.
PrecisionQuery query_of(const Node& node) {
  PrecisionQuery query{node.op,
                       op_info(node.op).category,
                       node.dtype,
                       {},
                       {},
                       node.module_path,
                       node.composite,
                       node.backward,
                       node.forward_op};
  for (const NodePtr& input : node.inputs)
    if (is_floating(input->dtype)) {
      query.input_storage.push_back(input->storage);
      query.input_is_scalar.push_back(is_scalar_constant(*input));
    }
  return query;
}

// query_of(node)'s contents as bytes, with the policy's id, made without building the query: a
// cached answer needs no query.
void query_key(std::string& key, const Policy& policy, const Node& node) {
  key.clear();
  append(key, policy.id());
  append(key, node.op);
  append(key, node.dtype);
  append(key, node.backward);
  append(key, node.forward_op);
  append(key, node.composite);  // string literals of dsl/functional.cpp: one address per name
  size_t floating = 0;
  for (const NodePtr& input : node.inputs) floating += is_floating(input->dtype);
  append(key, floating);
  for (const NodePtr& input : node.inputs)
    if (is_floating(input->dtype)) {
      append(key, input->storage);
      append(key, is_scalar_constant(*input));
    }
  key.append(node.module_path);
}

Decision decide(const Policy& policy, const PrecisionQuery& query) {
  Precision decided = policy.decide(query);
  for (DType t : {decided.storage, decided.compute, decided.accum})
    if (!is_floating(t))
      fail("policy '{}' gave the floating-point node {} a non-float precision {}", policy.name(),
           op_name(query.op), name(t));
  return {decided.storage, decided.compute, decided.accum,
          std::make_shared<const std::string>(std::move(decided.rule))};
}

}  // namespace

void assign_precision(const std::vector<Node*>& order) {
  for (Node* node : order) {
    if (node->precision_assigned) continue;
    node->precision_assigned = true;
    static const Rule not_float = shared_rule("not a floating-point value"),
                      f64_kept = shared_rule("f64 is never lowered"),
                      no_policy = shared_rule("no policy: as traced"),
                      leaf_data = shared_rule("leaf data keeps its dtype");
    if (!is_floating(node->dtype)) {
      keep_traced(*node, not_float);
    } else if (node->dtype == f64) {
      keep_traced(*node, f64_kept);
    } else if (!node->policy) {
      keep_traced(*node, no_policy);
    } else if (node->op == OpCode::Constant) {
      // Data already exists; its storage is what it holds.
      keep_traced(*node, leaf_data);
      node->storage = node->compute = node->value ? node->value->dtype : node->dtype;
    } else {
      const Policy& policy = *node->policy;
      Decision decided;
      if (policy.pure()) {
        thread_local std::string key;
        query_key(key, policy, *node);
        auto found = answers.find(std::string_view(key));
        if (found == answers.end()) {
          if (answers.size() >= kMaxAnswers) answers.clear();
          found = answers.emplace(key, decide(policy, query_of(*node))).first;
        }
        decided = found->second;
      } else {
        decided = decide(policy, query_of(*node));
      }
      node->storage = decided.storage;
      node->compute = decided.compute;
      node->accum = decided.accum;
      node->precision_rule = std::move(decided.rule);
    }
  }
}

}  // namespace mixtape
