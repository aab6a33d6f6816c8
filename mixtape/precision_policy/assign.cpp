// mixtape/precision_policy/assign.cpp -- the precision pass: asks each node's policy and records
// its answer.
#include "mixtape/precision_policy/assign.h"

#include <algorithm>
#include <array>
#include <optional>
#include <string_view>
#include <unordered_map>

#include "mixtape/dsl/error.h"
#include "mixtape/precision_policy/policy.h"

namespace mixtape {
namespace {

// A scalar constant, possibly broadcast or reshaped: like a Python number in PyTorch, it does
// not widen the type of the op it meets. Nor does an integer or boolean operand that promotion
// made a float of (a mask, a count): PyTorch keeps a bf16 tensor times an integer one bf16.
bool is_scalar_constant(const Node& node) {
  // A parameter made by full() or zeros() is a tensor like any other (after its first update it
  // is stored data): its type counts from the first step on.
  if (node.op == OpCode::Full) return !node.requires_grad;
  if (node.weak_promotion) return true;
  if ((node.op == OpCode::BroadcastTo || node.op == OpCode::Reshape) && !node.inputs.empty())
    return is_scalar_constant(*node.inputs[0]);
  return false;
}

// Whether `input` of `node` does not widen it: a scalar constant, a 0-d operand promotion
// broadcast (conform marks it weak), or a 0-d value read at every element of a node with
// dimensions (a fused op's), as torch.result_type ranks a 0-d tensor of the same category
// below dimensioned ones (a bf16 activation times a learned 0-d f32 scale stays bf16; one the
// user reshaped to [1] is a tensor like any other).
bool is_weak_input(const Node& node, const Node& input) {
  return is_scalar_constant(input) || (input.shape.empty() && !node.shape.empty());
}

using Rule = std::shared_ptr<const std::string>;

// What a comparison of floats (a bool pointwise node) compares in: the stored types of its
// operands promoted, numbers weak, as PyTorch's promotion gives them: a bf16 value against 0.1
// meets bf16(0.1). Its traced type where no operand is a float.
DType compared_type(const Node& node) {
  std::optional<DType> strong, any;
  for (const NodePtr& input : node.inputs) {
    if (!is_floating(input->dtype)) continue;
    const DType stored = input->value ? input->value->dtype : input->precision.storage_type;
    any = any ? promote(*any, stored) : stored;
    if (!is_weak_input(node, *input)) strong = strong ? promote(*strong, stored) : stored;
  }
  return strong.value_or(any.value_or(node.precision.compute));
}

void keep_traced(Node& node, const Rule& rule) {
  node.precision = NodePrecision::traced(node.dtype);
  node.precision.assigned = true;
  node.precision.rule = rule;
}

Rule shared_rule(const char* text) { return std::make_shared<const std::string>(text); }

struct Decision {
  DType storage, compute, accum;
  Rule rule;
};

// Answers of pure policies by their query (policy id, op, types, inputs, module path,
// composite, pass): a traced step asks the same few hundred questions every step. The fixed
// part of a query packs into a few words; a node with more floating inputs than they hold is
// asked directly. Per thread, so no lock; dropped whole when it grows past any real model's
// count of distinct queries.
struct QueryWords {
  uint64_t policy = 0;
  const char* composite = nullptr;  // string literals of dsl/functional.cpp: one address per name
  uint64_t inputs = 0;  // per floating input, 4 bits: its storage and whether it is a scalar
  uint64_t node = 0;    // op, forward op, dtype, pass and the count of floating inputs
  bool operator==(const QueryWords&) const = default;
};
struct QueryView {
  QueryWords words;
  std::string_view module_path;
};
struct QueryKey {
  QueryWords words;
  std::string module_path;
};
struct QueryHash {
  using is_transparent = void;
  size_t operator()(const QueryView& q) const {
    uint64_t h = std::hash<std::string_view>{}(q.module_path);
    for (uint64_t w : {q.words.policy, reinterpret_cast<uint64_t>(q.words.composite),
                       q.words.inputs, q.words.node})
      h = (h ^ w) * 0x9E3779B97F4A7C15ull ^ (h >> 29);
    return static_cast<size_t>(h);
  }
  size_t operator()(const QueryKey& q) const { return (*this)(QueryView{q.words, q.module_path}); }
};
struct QueryEqual {
  using is_transparent = void;
  static QueryView view(const QueryKey& q) { return {q.words, q.module_path}; }
  static const QueryView& view(const QueryView& q) { return q; }
  template <typename A, typename B>
  bool operator()(const A& a, const B& b) const {
    const QueryView &x = view(a), &y = view(b);
    return x.words == y.words && x.module_path == y.module_path;
  }
};
thread_local std::unordered_map<QueryKey, Decision, QueryHash, QueryEqual> answers;
constexpr size_t kMaxAnswers = 1 << 14;
constexpr size_t kMaxKeyedInputs = 16;

// The precision_query(node) a pure policy's answer is cached under, made without building the
// query (a cached answer needs none); nullopt for a node with too many floating inputs to pack.
std::optional<QueryView> query_key(const Policy& policy, const Node& node) {
  QueryView key{{policy.id(), node.origin.composite, 0, 0}, node.origin.module_path};
  uint64_t floating = 0;
  for (const NodePtr& input : node.inputs) {
    if (!is_floating(input->dtype)) continue;
    if (floating == kMaxKeyedInputs) return std::nullopt;
    uint64_t bits =
        static_cast<uint64_t>(input->precision.storage_type) << 1 | is_weak_input(node, *input);
    key.words.inputs |= bits << (4 * floating++);
  }
  key.words.node = static_cast<uint64_t>(node.op) | static_cast<uint64_t>(node.forward_op) << 16 |
                   uint64_t{static_cast<uint8_t>(node.dtype)} << 32 |
                   uint64_t{node.backward} << 40 | uint64_t{node.promotion} << 41 | floating << 48;
  return key;
}

}  // namespace

PrecisionQuery precision_query(const Node& node) {
  PrecisionQuery query{node.op,
                       op_info(node.op).category,
                       node.dtype,
                       {},
                       {},
                       node.origin.module_path,
                       node.origin.composite,
                       node.backward,
                       node.forward_op,
                       node.op == OpCode::Cast && node.promotion};
  for (const NodePtr& input : node.inputs)
    if (is_floating(input->dtype)) {
      query.input_storage.push_back(input->precision.storage_type);
      query.input_is_scalar.push_back(is_weak_input(node, *input));
    }
  return query;
}

namespace {

Decision decide(const Policy& policy, const PrecisionQuery& query) {
  Precision decided = policy.decide(query);
  for (DType t : {decided.storage, decided.compute, decided.accum})
    if (!is_floating(t))
      fail("policy '{}' gave the floating-point node {} a non-float precision {}", policy.name(),
           op_name(query.op), name(t));
  // Fused attention's online softmax sums in f32 (f64 for f64) on every back end: a 16-bit
  // accumulator would be reported and not used.
  if (op_info(query.op).kind == OpKind::Attention && is_half(decided.accum))
    fail(
        "policy '{}' gave {} a {} accumulator, which fused attention does not have (its softmax "
        "and products sum in f32): give it f32",
        policy.name(), op_name(query.op), name(decided.accum));
  return {decided.storage, decided.compute, decided.accum,
          std::make_shared<const std::string>(std::move(decided.rule))};
}

// The answers the last pass over a graph of each size took, in the order it asked: the traced
// loop passes over the same graph every step, so the answer at the same position is almost
// always the one wanted, and comparing its key costs less than hashing the query and walking a
// bucket. A few sizes are kept (a training step evaluates a graph or two); a miss asks the map.
using Answer = std::pair<const QueryKey, Decision>;
struct Trail {
  size_t graph_size = 0;
  std::vector<const Answer*> answers;  // by position among the keyed questions; null: none
};
thread_local std::array<Trail, 4> trails;
thread_local size_t next_trail = 0;

Trail& trail_for(size_t graph_size) {
  for (Trail& trail : trails)
    if (trail.graph_size == graph_size) return trail;
  Trail& trail = trails[next_trail++ % trails.size()];
  trail.graph_size = graph_size;
  trail.answers.clear();
  return trail;
}

void forget_answers() {
  answers.clear();
  for (Trail& t : trails) std::fill(t.answers.begin(), t.answers.end(), nullptr);
}

// The cached answer to `key`, asked as the `position`-th keyed question of a pass over `trail`.
const Answer& answer(Trail& trail, size_t position, const QueryView& key, const Policy& policy,
                     const Node& node) {
  if (position < trail.answers.size()) {
    const Answer* expected = trail.answers[position];
    if (expected && QueryEqual{}(expected->first, key)) return *expected;
  }
  auto found = answers.find(key);
  if (found == answers.end()) {
    if (answers.size() >= kMaxAnswers) forget_answers();
    found = answers
                .emplace(QueryKey{key.words, std::string(key.module_path)},
                         decide(policy, precision_query(node)))
                .first;
  }
  if (position >= trail.answers.size()) trail.answers.resize(position + 1, nullptr);
  trail.answers[position] = &*found;
  return *found;
}
}  // namespace

void assign_precision(const std::vector<Node*>& order) {
  static const Rule not_float = shared_rule("not a floating-point value"),
                    f64_kept = shared_rule("f64 is never lowered"),
                    no_policy = shared_rule("no policy: as traced"),
                    leaf_data = shared_rule("leaf data keeps its dtype");
  // Answers are kept by policy id; a policy changed since they were given answers anew.
  thread_local uint64_t edits_seen = 0;
  if (uint64_t edits = policy_edits(); edits != edits_seen) {
    forget_answers();
    edits_seen = edits;
  }
  Trail& trail = trail_for(order.size());
  size_t position = 0;
  // Whether a node's policy is pure, asked once per run of nodes of one policy (an
  // OverridePolicy asks its base and every delegate), not once per node.
  const Policy* asked = nullptr;
  bool asked_is_pure = false;
  for (Node* node : order) {
    if (node->precision.assigned) {
      // A leaf set from outside (an optimizer's update, a compiled step's output) came decided,
      // without a reason: the one the pass gives leaves.
      if (!node->precision.rule && node->inputs.empty()) node->precision.rule = leaf_data;
      continue;
    }
    if (!is_floating(node->dtype)) {
      keep_traced(*node, not_float);
      if (node->dtype == boolean && op_info(node->op).kind == OpKind::Pointwise)
        node->precision.compute = compared_type(*node);
    } else if (node->dtype == f64) {
      keep_traced(*node, f64_kept);
    } else if (!node->origin.policy) {
      keep_traced(*node, no_policy);
    } else if (node->op == OpCode::Constant) {
      // Data already exists; its storage is what it holds.
      keep_traced(*node, leaf_data);
      node->precision.storage_type = node->precision.compute =
          node->value ? node->value->dtype : node->dtype;
    } else {
      const Policy& policy = *node->origin.policy;
      std::optional<QueryView> key;
      if (&policy != asked) {
        asked = &policy;
        asked_is_pure = policy.pure();
      }
      if (asked_is_pure) key = query_key(policy, *node);
      if (key) {
        const Decision& decided = answer(trail, position++, *key, policy, *node).second;
        node->precision.storage_type = decided.storage;
        node->precision.compute = decided.compute;
        node->precision.accum = decided.accum;
        node->precision.rule = decided.rule;
      } else {
        Decision decided = decide(policy, precision_query(*node));
        node->precision.storage_type = decided.storage;
        node->precision.compute = decided.compute;
        node->precision.accum = decided.accum;
        node->precision.rule = std::move(decided.rule);
      }
    }
    // Only once decided: a policy that threw (or gave a non-float type) is asked again by the
    // next evaluation, which fails the same way, rather than the node running as traced.
    node->precision.assigned = true;
  }
}

}  // namespace mixtape
