// mixtape/runtime/aot_plan.cpp -- writes a replay plan as JSON and rebuilds it, at any allowed
// batch size.
#include "mixtape/runtime/aot_plan.h"

#include <algorithm>
#include <bit>
#include <unordered_map>

#include "mixtape/codegen/hash.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/json.h"
#include "mixtape/runtime/cpu_executor.h"

namespace mixtape::aot {
namespace {

using json::Value;

// Doubles travel as their bits: fill values may be infinite or NaN, which JSON cannot hold.
Value double_bits(double d) { return std::bit_cast<int64_t>(d); }
double from_bits(const Value& v) { return std::bit_cast<double>(json::as_int(v)); }

const std::unordered_map<std::string, OpCode>& ops_by_name() {
  static const std::unordered_map<std::string, OpCode> ops = [] {
    std::unordered_map<std::string, OpCode> m;
    for (int i = 0; i < op_count(); ++i) m.emplace(op_name(static_cast<OpCode>(i)), OpCode(i));
    return m;
  }();
  return ops;
}

// A dim at the traced batches: an integer when it does not change, else [base, per_batch].
Value dim_value(const std::vector<TracedPlan>& traced, const std::vector<int64_t>& at,
                const Node& node) {
  bool same = std::all_of(at.begin(), at.end(), [&](int64_t d) { return d == at[0]; });
  if (same) return at[0];
  int64_t db = traced[1].batch - traced[0].batch, dd = at[1] - at[0];
  int64_t per_batch = db != 0 ? dd / db : 0;
  int64_t base = at[0] - per_batch * traced[0].batch;
  for (size_t t = 0; t < traced.size(); ++t)
    if (dd % db != 0 || base + per_batch * traced[t].batch != at[t])
      fail(
          "a dynamic batch needs every shape to grow linearly with the batch: {} is {} at batch "
          "{} and {} at batch {}",
          describe(node), to_string(node.shape), traced[0].batch, at[t], traced[t].batch);
  if (base < 0 || per_batch < 0)
    fail("a dynamic batch needs shapes that grow with the batch: {}", describe(node));
  return {base, per_batch};
}

int64_t dim_at(const Value& v, int64_t batch) {
  if (v.is_number()) return json::as_int(v);
  return json::as_int(v.at(0)) + json::as_int(v.at(1)) * batch;
}

// Attribute values in the plan, by their type in dsl/attrs.def. Doubles travel as their bits;
// 64-bit seeds as decimal strings, which every JSON reader keeps exact.
Value attr_value(const Ints& list) { return list; }
Value attr_value(bool b) { return b; }
Value attr_value(int64_t i) { return i; }
Value attr_value(double d) { return double_bits(d); }
Value attr_value(uint64_t u) { return std::to_string(u); }
void read_attr(const Value& v, Ints& list) {
  list.clear();
  for (const Value& e : v.get_ref<const Value::array_t&>()) list.push_back(json::as_int(e));
}
void read_attr(const Value& v, bool& b) { b = v.get<bool>(); }
void read_attr(const Value& v, int64_t& i) { i = json::as_int(v); }
void read_attr(const Value& v, double& d) { d = from_bits(v); }
void read_attr(const Value& v, uint64_t& u) { u = std::stoull(v.get<std::string>()); }

// Every attribute of dsl/attrs.def that differs from its default (launch-time ones included: the
// plan replays them). A custom op's vjp (C++ code, which no file can carry) is left out: a plan
// replays a traced step, whose backward pass the vjp already wrote as nodes, and the custom node
// itself is its forward value.
Value attrs_value(const Node& node) {
  const Attrs& a = node.attrs;
  static const Attrs defaults;
  Value o = Value::object();
#define MT_ATTR(type, name, default_value, hashed, ops) \
  if (!same_attr(a.name, defaults.name)) o[#name] = attr_value(a.name);
#include "mixtape/dsl/attrs.def"
  return o;
}

Attrs attrs_from(const Value& v) {
  Attrs a;
#define MT_ATTR(type, name, default_value, hashed, ops) \
  if (const Value* x = json::find(v, #name)) read_attr(*x, a.name);
#include "mixtape/dsl/attrs.def"
  return a;
}

// The nodes of evaluation `e` in the order the document numbers them: the externals (leaves)
// first, then the pending nodes in tape order.
std::vector<Node*> numbered_nodes(const PlannedEvaluation& planned) {
  std::vector<Node*> nodes(planned.eval.executed.sig.externals);
  nodes.insert(nodes.end(), planned.eval.pending_raw.begin(), planned.eval.pending_raw.end());
  return nodes;
}

}  // namespace

bool serves_smaller_dim0(const kir::Kernel& kernel) {
  return !kernel.multi_tensor && !kernel.dims.empty() && kernel.reduce_from != 0;
}

std::string kernel_key(const kir::Kernel& kernel) {
  if (!serves_smaller_dim0(kernel)) return kernel.name;
  kir::Kernel general = kernel;
  general.name.clear();
  general.dims[0] = 0;
  return "mt_" + hash_string(kir::to_string(general)).hex();
}

struct PlanDocument::Tree {
  Value doc;
};

PlanDocument::PlanDocument(std::unique_ptr<const Tree> tree) : tree_(std::move(tree)) {}
PlanDocument::PlanDocument(PlanDocument&&) noexcept = default;
PlanDocument& PlanDocument::operator=(PlanDocument&&) noexcept = default;
PlanDocument::~PlanDocument() = default;

PlanDocument PlanDocument::parse(std::string_view text, size_t max_values) {
  return PlanDocument(std::make_unique<const Tree>(Tree{json::parse(text, max_values)}));
}

std::string PlanDocument::text() const { return json::dump(tree_->doc); }

PlanDocument plan_to_json(const std::vector<TracedPlan>& traced,
                          std::vector<std::pair<StoragePtr, PlanBuffer>>& buffers) {
  const Plan& plan = *traced[0].plan;
  for (const TracedPlan& t : traced)
    if (t.plan->evals.size() != plan.evals.size() || t.plan->results != plan.results)
      fail("the step makes different evaluations at batch {} and batch {}", traced[0].batch,
           t.batch);
  auto buffer_index = [&](const StoragePtr& storage) -> int64_t {
    for (size_t k = 0; k < buffers.size(); ++k)
      if (buffers[k].first == storage) return static_cast<int64_t>(k);
    buffers.push_back({storage, PlanBuffer{"", storage->dtype, {storage->count}}});
    return static_cast<int64_t>(buffers.size() - 1);
  };
  Value evaluations = Value::array();
  for (size_t e = 0; e < plan.evals.size(); ++e) {
    const PlannedEvaluation& planned = plan.evals[e];
    if (planned.eval.device != Device::cpu) fail("an artifact's plan runs on the cpu device");
    std::vector<std::vector<Node*>> nodes_at;
    for (const TracedPlan& t : traced) {
      nodes_at.push_back(numbered_nodes(t.plan->evals[e]));
      if (nodes_at.back().size() != nodes_at[0].size() ||
          t.plan->evals[e].eval.executed.sig.externals.size() !=
              planned.eval.executed.sig.externals.size())
        fail(
            "evaluation {} has different graphs at batch {} and batch {}: what it computes "
            "depends on the batch size (a mean over the batch?), so it cannot take a dynamic "
            "batch; export it at a fixed batch",
            e, traced[0].batch, t.batch);
    }
    const std::vector<Node*>& nodes = nodes_at[0];
    // Each trace's nodes by number, so that the traces can be compared edge by edge.
    std::vector<std::unordered_map<const Node*, int64_t>> index_at(traced.size());
    for (size_t t = 0; t < traced.size(); ++t)
      for (size_t i = 0; i < nodes_at[t].size(); ++i)
        index_at[t].emplace(nodes_at[t][i], static_cast<int64_t>(i));
    const std::unordered_map<const Node*, int64_t>& index = index_at[0];
    auto same_structure = [&](size_t t, size_t i) {
      const Node &node = *nodes[i], &other = *nodes_at[t][i];
      if (other.op != node.op || other.shape.size() != node.shape.size() ||
          other.precision.storage_type != node.precision.storage_type ||
          other.precision.compute != node.precision.compute ||
          other.precision.accum != node.precision.accum ||
          other.inputs.size() != node.inputs.size() || attrs_value(other) != attrs_value(node))
        return false;
      for (size_t k = 0; k < node.inputs.size(); ++k) {
        auto a = index.find(node.inputs[k].get());
        auto b = index_at[t].find(other.inputs[k].get());
        if (a == index.end() || b == index_at[t].end() || a->second != b->second) return false;
      }
      if (i < planned.inputs.size()) {
        const Binding &x = planned.inputs[i], &y = t == 0 ? x : traced[t].plan->evals[e].inputs[i];
        // State and constants are the same buffers in every trace; a value an earlier
        // evaluation of the same call stored is each trace's own.
        if (x.arg != y.arg || x.result != y.result || x.at_call_start != y.at_call_start ||
            (x.first_value && x.object != y.object))
          return false;
      }
      return true;
    };
    size_t leaves = planned.eval.executed.sig.externals.size();
    Value node_values = Value::array();
    GradientSumCalls sum_calls;  // which gradient sums fusion keeps apart
    for (size_t i = 0; i < nodes.size(); ++i) {
      const Node& node = *nodes[i];
      Value o = {{"op", op_name(node.op)},
                 {"dtype", name(node.dtype)},
                 {"storage", name(node.precision.storage_type)},
                 {"compute", name(node.precision.compute)},
                 {"accum", name(node.precision.accum)}};
      for (size_t t = 1; t < traced.size(); ++t)
        if (!same_structure(t, i))
          fail(
              "{} differs between batch {} and batch {} by more than its shape: what it computes "
              "depends on the batch size (a mean over the batch?), so it cannot take a dynamic "
              "batch; export it at a fixed batch",
              describe(node), traced[0].batch, traced[t].batch);
      Value shape = Value::array();
      for (size_t d = 0; d < node.shape.size(); ++d) {
        std::vector<int64_t> at;
        for (size_t t = 0; t < traced.size(); ++t) at.push_back(nodes_at[t][i]->shape[d]);
        shape.push_back(dim_value(traced, at, node));
      }
      o["shape"] = std::move(shape);
      if (i < leaves) {
        const Binding& binding = planned.inputs[i];
        if (binding.arg >= 0)
          o["arg"] = binding.arg;
        else if (binding.through_result())
          o["result"] = binding.result;
        else
          o["buffer"] = buffer_index(binding.object);
        if (binding.at_call_start) o["at_call_start"] = true;
      } else {
        Value inputs = Value::array();
        for (const NodePtr& input : node.inputs) {
          auto found = index.find(input.get());
          if (found == index.end()) fail("{} reads a value outside its evaluation", describe(node));
          inputs.emplace_back(found->second);
        }
        o["inputs"] = std::move(inputs);
        Value attrs = attrs_value(node);
        if (!attrs.empty()) o["attrs"] = std::move(attrs);
        if (node.requires_grad) o["requires_grad"] = true;
        // Program building keeps a checkpointed recomputation out of multi-tensor kernels: the
        // load must group kernels as the export compiled them.
        if (node.recomputed) o["recomputed"] = true;
      }
      if (!node.origin.module_path.empty()) o["module"] = node.origin.module_path;
      if (const uint64_t call = sum_calls.number(node)) o["call"] = call;
      node_values.push_back(std::move(o));
    }
    Value stored = Value::array();
    const Signature& sig = planned.eval.executed.sig;
    for (size_t j = 0; j < sig.stored.size(); ++j) {
      Value s = {{"node", index.at(sig.stored[j])}};
      if (planned.result_slot[j] >= 0)
        s["result"] = planned.result_slot[j];
      else if (planned.shares_with[j] >= 0)
        s["shares_with"] = planned.shares_with[j];
      else
        s["buffer"] = buffer_index(planned.eval.outputs[j]);
      stored.push_back(std::move(s));
    }
    evaluations.push_back({{"leaves", static_cast<int64_t>(leaves)},
                           {"nodes", std::move(node_values)},
                           {"stored", std::move(stored)}});
  }
  Value results = Value::array();
  for (const auto& [e, j] : plan.results) results.push_back({e, j});
  Value doc = {{"format", kPlanFormat},
               {"multi_tensor", fusion_options(Device::cpu).multi_tensor},
               {"matmul_epilogue", fusion_options(Device::cpu).matmul_epilogue},
               {"results", std::move(results)},
               {"evaluations", std::move(evaluations)}};
  return PlanDocument(
      std::make_unique<const PlanDocument::Tree>(PlanDocument::Tree{std::move(doc)}));
}

// The accessors below throw nlohmann's exceptions for a document of the wrong shape; the
// artifact runtime reports them as a malformed file.
std::unique_ptr<Plan> plan_from_json(const PlanDocument& document, int64_t batch,
                                     const std::vector<StoragePtr>& buffers,
                                     const KernelLoader& load, Device device) {
  const Value& doc = document.tree().doc;
  const auto& format = doc.at("format").get_ref<const std::string&>();
  if (format != kPlanFormat)
    fail("the plan's format is {}, this runtime reads {}", format, kPlanFormat);
  FusionOptions options = fusion_options(Device::cpu);
  options.fuse = true;
  options.multi_tensor = doc.at("multi_tensor").get<bool>();
  // The CPU's gemm runs the epilogue; plans written before it was fused say nothing.
  options.matmul_epilogue = device == Device::cpu && doc.contains("matmul_epilogue") &&
                            doc.at("matmul_epilogue").get<bool>();
  auto plan = std::make_unique<Plan>();
  for (const Value& r : doc.at("results").get_ref<const Value::array_t&>())
    plan->results.emplace_back(static_cast<int>(json::as_int(r.at(0))),
                               static_cast<int>(json::as_int(r.at(1))));
  auto buffer = [&](const Value& v) -> const StoragePtr& {
    int64_t k = json::as_int(v);
    if (k < 0 || k >= static_cast<int64_t>(buffers.size()))
      fail("the plan names buffer {} of {}", k, buffers.size());
    return buffers[k];
  };
  const auto& ops = ops_by_name();
  for (const Value& ev : doc.at("evaluations").get_ref<const Value::array_t&>()) {
    PlannedEvaluation planned;
    Evaluation& e = planned.eval;
    const auto& node_values = ev.at("nodes").get_ref<const Value::array_t&>();
    int64_t leaves = json::as_int(ev.at("leaves"));
    if (leaves < 0 || leaves > static_cast<int64_t>(node_values.size()))
      fail("an evaluation of the plan has {} leaves of {} nodes", leaves, node_values.size());
    std::vector<NodePtr> nodes;
    std::unordered_map<const Node*, Binding> binding_of;
    // The module calls of the gradient sums (GradientSumCalls), by number: fusion keeps sums of
    // different calls apart, as it did when the plan was exported.
    std::vector<std::shared_ptr<const ModuleCall>> sum_calls;
    for (const Value& v : node_values) {
      const auto& op_text = v.at("op").get_ref<const std::string&>();
      auto op = ops.find(op_text);
      if (op == ops.end()) fail("the plan names an unknown op '{}'", op_text);
      Shape shape;
      for (const Value& d : v.at("shape").get_ref<const Value::array_t&>())
        shape.push_back(dim_at(d, batch));
      bool leaf = static_cast<int64_t>(nodes.size()) < leaves;
      std::vector<NodePtr> inputs;
      Attrs attrs;
      if (!leaf) {
        for (const Value& i : v.at("inputs").get_ref<const Value::array_t&>()) {
          int64_t k = json::as_int(i);
          if (k < 0 || k >= static_cast<int64_t>(nodes.size()))
            fail("{} in the plan reads node {}, not one before it", op->first, k);
          inputs.push_back(nodes[k]);
        }
        int arity = op_info(op->second).arity;
        if (arity >= 0 && static_cast<int>(inputs.size()) != arity)
          fail("{} in the plan has {} inputs, not {}", op->first, inputs.size(), arity);
        if (const Value* a = json::find(v, "attrs")) attrs = attrs_from(*a);
      }
      // A leaf keeps its op (it is a value an earlier evaluation or the user made), without
      // the inputs that made it.
      auto dtype = [&](const char* key) { return parse_dtype(v.at(key).get<std::string>()); };
      NodePtr node = make_node(op->second, dtype("dtype"), std::move(shape), std::move(inputs),
                               std::move(attrs), Loc::current());
      node->precision.storage_type = dtype("storage");
      node->precision.compute = dtype("compute");
      node->precision.accum = dtype("accum");
      node->precision.assigned = true;
      node->requires_grad = json::find(v, "requires_grad") != nullptr;
      node->recomputed = json::find(v, "recomputed") != nullptr;
      if (const Value* m = json::find(v, "module"))
        node->origin.module_path = m->get<std::string>();
      if (const Value* c = json::find(v, "call")) {
        const int64_t call = json::as_int(*c);
        if (call < 1 || call > static_cast<int64_t>(node_values.size()))
          fail("{} in the plan is the gradient sum of module call {}, not one of its {} nodes'",
               op->first, call, node_values.size());
        if (sum_calls.size() < static_cast<size_t>(call)) sum_calls.resize(call);
        std::shared_ptr<const ModuleCall>& frame = sum_calls[call - 1];
        if (!frame)
          frame = std::make_shared<const ModuleCall>(ModuleCall{node->origin.module_path, nullptr});
        node->origin.module_call = frame;
        node->backward = true;
      }
      if (leaf) {
        Binding binding;
        if (const Value* arg = json::find(v, "arg")) {
          binding.arg = static_cast<int>(json::as_int(*arg));
          // Signing reads an external's value (its dtype); each replay binds the argument's.
          node->value = std::make_shared<Storage>(node->precision.storage_type, node->numel());
        } else if (const Value* r = json::find(v, "result")) {
          binding.result = static_cast<int>(json::as_int(*r));
          const bool earlier =
              binding.result >= 0 && static_cast<size_t>(binding.result) < plan->results.size() &&
              plan->results[binding.result].first >= 0 &&
              plan->results[binding.result].first < static_cast<int>(plan->evals.size());
          const Node* returned = nullptr;
          if (earlier) {
            const auto [re, rj] = plan->results[binding.result];
            const std::vector<Node*>& stored = plan->evals[re].eval.executed.sig.stored;
            if (rj >= 0 && static_cast<size_t>(rj) < stored.size()) returned = stored[rj];
          }
          if (!returned || returned->precision.storage_type != node->precision.storage_type ||
              returned->numel() != node->numel())
            fail("{} of the plan reads result {}, which no earlier evaluation returns as such",
                 describe(*node), binding.result);
          node->value = std::make_shared<Storage>(node->precision.storage_type, node->numel());
        } else {
          binding.object = buffer(v.at("buffer"));
          if (binding.object->count != node->numel() ||
              binding.object->dtype != node->precision.storage_type)
            fail("buffer {} of the plan holds {} {} values, its node is {}",
                 json::as_int(v.at("buffer")), binding.object->count, name(binding.object->dtype),
                 describe(*node));
          node->value = binding.object;
          binding.at_call_start = json::find(v, "at_call_start") != nullptr;
        }
        binding_of.emplace(node.get(), binding);
      }
      nodes.push_back(std::move(node));
    }
    std::vector<Node*> required;
    std::vector<NodePtr> held;  // the stored nodes, which keep every pending node alive
    const auto& stored = ev.at("stored").get_ref<const Value::array_t&>();
    for (const Value& st : stored) {
      int64_t k = json::as_int(st.at("node"));
      if (k < leaves || k >= static_cast<int64_t>(nodes.size()))
        fail("the plan stores node {}, which its evaluation does not compute", k);
      required.push_back(nodes[k].get());
      held.push_back(nodes[k]);
    }
    // sign() stores the pending nodes that something besides their readers holds: only the
    // stored ones may be held while it looks. A node nothing stored needs is not part of it.
    std::vector<std::weak_ptr<Node>> computed(nodes.begin() + leaves, nodes.end());
    std::vector<NodePtr> leaf_nodes(nodes.begin(), nodes.begin() + leaves);
    nodes.clear();
    for (const std::weak_ptr<Node>& node : computed)
      if (!node.expired()) e.pending_raw.push_back(node.lock().get());
    e.device = device;
    e.executed.sig = sign_cpu(e.pending_raw, required, options);
    for (Node* node : e.pending_raw) e.pending.push_back(node->shared_from_this());
    const Signature& sig = e.executed.sig;
    if (sig.stored != required)
      fail("the plan's stored values do not match its graph ({} stored, {} asked for)",
           sig.stored.size(), required.size());
    e.executed.program = std::make_shared<const Program>(
        build_program(e.pending_raw, options, e.executed.sig, load));
    for (Node* external : sig.externals) {
      auto found = binding_of.find(external);
      if (found == binding_of.end())
        fail("the plan's graph reads {} from outside its evaluation", describe(*external));
      planned.inputs.push_back(found->second);
    }
    if (planned.inputs.size() != binding_of.size())
      fail("the plan's evaluation has {} leaves, its graph reads {}", binding_of.size(),
           planned.inputs.size());
    for (size_t j = 0; j < stored.size(); ++j) {
      const Value& s = stored[j];
      int result = -1, shares = -1;
      StoragePtr output;
      if (const Value* r = json::find(s, "result")) {
        result = static_cast<int>(json::as_int(*r));
      } else if (const Value* w = json::find(s, "shares_with")) {
        shares = static_cast<int>(json::as_int(*w));
        if (shares < 0 || static_cast<size_t>(shares) >= j)
          fail("stored value {} of the plan shares an unknown buffer", j);
        output = e.outputs[shares];
      } else {
        output = buffer(s.at("buffer"));
      }
      planned.result_slot.push_back(result);
      planned.shares_with.push_back(shares);
      e.outputs.push_back(std::move(output));
    }
    planned.leaves = std::move(leaf_nodes);
    plan->evals.push_back(std::move(planned));
  }
  for (const auto& [e, j] : plan->results)
    if (e < 0 || e >= static_cast<int>(plan->evals.size()) || j < 0 ||
        j >= static_cast<int>(plan->evals[e].result_slot.size()))
      fail("the plan returns stored value {} of evaluation {}, which does not exist", j, e);
  return plan;
}

}  // namespace mixtape::aot
