// mixtape/precision_policy/memory_report.cpp -- sizes a training step's memory from its typed
// graph: a liveness simulation over the nodes in tape order, nothing is executed.
#include "mixtape/precision_policy/memory_report.h"

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/json.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/precision_policy/policy.h"

namespace mixtape {
namespace {

int64_t bytes_of(int64_t numel, DType dtype) {
  return numel * static_cast<int64_t>(size_of(dtype));
}

DType leaf_storage(const Node& node) {
  if (node.precision.assigned) return node.precision.storage_type;
  return node.value ? node.value->dtype : node.dtype;
}

// Views that a compiled program expresses as indexing into their input, so they own no memory
// (as long as they do not also change the type).
bool is_alias_view(OpCode op) {
  return op == OpCode::Reshape || op == OpCode::BroadcastTo || op == OpCode::Permute ||
         op == OpCode::Detach;
}

// Fills are generated inside the kernels that read them.
bool is_fill(OpCode op) { return op == OpCode::Full || op == OpCode::Arange; }

struct Buffer {
  enum class Kind { Param, Value, HalfCopy };
  Kind kind;
  DType dtype;
  int64_t bytes = 0;
  int64_t first = 0;  // position of the node that makes it
  int64_t last = 0;   // position of its last reader (or the end, for outputs)
  size_t param = 0;   // Param and HalfCopy: index into the parameter list
  const Node* owner = nullptr;
  bool read_forward = false;
  bool read_backward = false;
};

std::string human(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {} ({} B)", value, units[unit], bytes);
}

std::string dtype_list(const std::vector<DType>& types) {
  if (types.empty()) return "-";
  std::vector<std::string_view> names;
  for (DType t : types) names.push_back(name(t));
  return fmt::format("{}", fmt::join(names, ","));
}

// The parameters a report covers: the model's, then any the optimizer holds besides, with each
// one's node mapped to its index. A tied weight (one tensor under two names) is one row, under
// its first name: counted once per name, its master, gradient and the peak were too high.
struct ParamSet {
  NamedTensors params;
  std::unordered_map<const Node*, size_t> index;
};

ParamSet collect_params(const Module& model, const Optimizer* opt) {
  ParamSet set;
  NamedTensors& params = set.params;
  for (auto& [name, p] : model.named_parameters())
    if (set.index.emplace(p.node().get(), params.size()).second) params.emplace_back(name, p);
  if (opt)
    for (size_t i = 0; i < opt->params().size(); ++i) {
      const Tensor& p = opt->params()[i];
      if (set.index.emplace(p.node().get(), params.size()).second)
        params.emplace_back(fmt::format("optimizer.params[{}]", i), p);
    }
  return set;
}

// The step's typed graph: the loss and the gradients, their nodes in tape order (with the
// precision pass run) and each node's position in that order.
struct StepGraph {
  std::vector<NodePtr> roots;
  std::vector<Node*> nodes;
  std::unordered_map<const Node*, int64_t> position;
  int64_t end = 0;  // the position of the last node
  std::unordered_set<const Node*> outputs;
  std::unordered_set<const Node*> forward;  // what the loss is computed from
  // Fills (and views of them) that a step other than a fused kernel reads: the compiled program
  // stores them (codegen/fusion.cpp folds a fill only into kernels).
  std::unordered_set<const Node*> stored_fills;

  // Whether `node` runs in the backward pass: a gradient node, a checkpointed module's
  // recomputation (autograd/recompute.h), or another node the loss does not need (the sums of a
  // leaf's gradients, made outside any vjp) but for a companion (a copy the forward pass keeps
  // for the backward pass, precision_policy/saved_copies.cpp).
  bool in_backward(const Node& node) const {
    return node.backward || node.recomputed || (!forward.count(&node) && !is_companion(node));
  }
};

StepGraph typed_graph(const Tensor& loss, const NamedTensors& params) {
  StepGraph graph;
  graph.roots.push_back(loss.node());
  for (const auto& [name, p] : params)
    if (p.grad().defined()) graph.roots.push_back(p.grad().node());
  graph.nodes = nodes_in_tape_order(graph.roots);
  assign_precision(graph.nodes);
  for (size_t k = 0; k < graph.nodes.size(); ++k)
    graph.position.emplace(graph.nodes[k], static_cast<int64_t>(k));
  graph.end = static_cast<int64_t>(graph.nodes.size()) - 1;
  for (const NodePtr& root : graph.roots) graph.outputs.insert(root.get());
  for (Node* node : nodes_in_tape_order({loss.node()})) graph.forward.insert(node);
  for (const Node* node : graph.nodes) {
    const OpKind kind = op_info(node->op).kind;
    if (kind == OpKind::Pointwise || kind == OpKind::Reduce || kind == OpKind::View) continue;
    for (const NodePtr& input : node->inputs) {
      // The views it reads a fill through, and the fill.
      std::vector<const Node*> chain{input.get()};
      while (op_info(chain.back()->op).kind == OpKind::View && chain.back()->inputs.size() == 1)
        chain.push_back(chain.back()->inputs[0].get());
      if (is_fill(chain.back()->op)) graph.stored_fills.insert(chain.begin(), chain.end());
    }
  }
  return graph;
}

// The liveness simulation: the buffers of one step and which of them each node's value lives in.
class BufferMap {
 public:
  BufferMap(const ParamSet& params, const StepGraph& graph)
      : params_(params), graph_(graph), buffer_of_(graph.nodes.size(), -1) {}

  // Adds the parameters' rows to the report, each with the buffer its master lives in.
  void add_params(MemoryReport& report) {
    const NamedTensors& params = params_.params;
    param_buffer_.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const Node& node = *params[i].second.node();
      MemoryParamRow row;
      row.name = params[i].first;
      row.shape = node.shape;
      row.master = leaf_storage(node);
      row.master_bytes = bytes_of(node.numel(), row.master);
      report.master_weights += row.master_bytes;
      report.parameters.push_back(std::move(row));
      param_buffer_[i] = static_cast<int64_t>(buffers_.size());
      buffers_.push_back({Buffer::Kind::Param, report.parameters[i].master});
      buffers_.back().param = i;
    }
  }

  // Places every node in tape order, then keeps the step's outputs alive to the end.
  void place_all() {
    for (size_t k = 0; k < graph_.nodes.size(); ++k) place(k);
    for (const Node* output : graph_.outputs) {
      int64_t b = buffer_of_[graph_.position.at(output)];
      if (b >= 0 && buffers_[b].kind != Buffer::Kind::Param) buffers_[b].last = graph_.end;
    }
  }

  const std::vector<Buffer>& buffers() const { return buffers_; }
  // (param, type) -> buffer of its half copy, in key order.
  const std::map<std::pair<size_t, DType>, int64_t>& half_copies() const { return half_copy_; }

 private:
  // The buffer of a parameter's copy in `type`, made at position k on its first use.
  int64_t half_copy_of(size_t param, DType type, int64_t k) {
    auto [it, added] = half_copy_.try_emplace({param, type}, static_cast<int64_t>(buffers_.size()));
    if (added) {
      Buffer copy{Buffer::Kind::HalfCopy, type};
      copy.bytes = bytes_of(params_.params[param].second.numel(), type);
      copy.first = copy.last = k;
      copy.param = param;
      buffers_.push_back(copy);
    }
    return it->second;
  }

  void read(int64_t b, int64_t k, bool backward) {
    Buffer& buffer = buffers_[b];
    buffer.last = std::max(buffer.last, k);
    (backward ? buffer.read_backward : buffer.read_forward) = true;
  }

  // For a node that owns no memory, the buffer it lives in (-1: none, a fill or a view of one);
  // nullopt when it needs a buffer of its own.
  std::optional<int64_t> alias_of(const Node& node, int64_t pos) {
    const bool stored = graph_.outputs.count(&node) || graph_.stored_fills.count(&node);
    if (is_fill(node.op) && !stored) return -1;
    if (!is_alias_view(node.op) || node.inputs.size() != 1) return std::nullopt;
    int64_t source = buffer_of_[graph_.position.at(node.inputs[0].get())];
    if (source < 0 && !stored) return -1;  // a view of a fill is still a fill
    if (source >= 0 && buffers_[source].dtype == node.precision.storage_type) return source;
    if (source >= 0 && buffers_[source].kind == Buffer::Kind::Param &&
        is_half(node.precision.storage_type))
      return half_copy_of(buffers_[source].param, node.precision.storage_type,
                          pos);  // the cast, then a view
    return std::nullopt;
  }

  // Gives node k's value a buffer and records the reads of its inputs.
  void place(size_t k) {
    const Node& node = *graph_.nodes[k];
    const int64_t pos = static_cast<int64_t>(k);
    if (auto found = params_.index.find(&node); found != params_.index.end()) {
      buffer_of_[k] = param_buffer_[found->second];
      return;
    }
    if (std::optional<int64_t> alias = alias_of(node, pos)) {
      buffer_of_[k] = *alias;
      // A view reads its one input through the buffer it aliases.
      if (*alias >= 0) read(*alias, pos, graph_.in_backward(node));
      return;
    }
    buffer_of_[k] = static_cast<int64_t>(buffers_.size());
    Buffer value{Buffer::Kind::Value, node.precision.storage_type};
    value.bytes = bytes_of(node.numel(), node.precision.storage_type);
    // Leaf data (a batch) counts from when it was made, which is before the nodes reading it.
    value.first = value.last = pos;
    value.owner = &node;
    buffers_.push_back(value);
    for (const NodePtr& input : node.inputs) {
      int64_t source = buffer_of_[graph_.position.at(input.get())];
      if (source < 0) continue;
      const Buffer& src = buffers_[source];
      // A 16-bit reader of an f32 master reads its half copy, made once per step and type.
      if (src.kind == Buffer::Kind::Param && is_floating(input->dtype) &&
          is_half(node.precision.compute) && node.precision.compute != src.dtype)
        source = half_copy_of(src.param, node.precision.compute, pos);
      read(source, pos, graph_.in_backward(node));
    }
  }

  const ParamSet& params_;
  const StepGraph& graph_;
  std::vector<Buffer> buffers_;
  std::vector<int64_t> param_buffer_;
  std::map<std::pair<size_t, DType>, int64_t> half_copy_;
  std::vector<int64_t> buffer_of_;  // -1: takes no memory (a fill)
};

// Counts the half copies per parameter and in total.
void count_half_copies(MemoryReport& report, const BufferMap& map) {
  for (const auto& [key, b] : map.half_copies()) {
    report.parameters[key.first].half_copies.push_back(key.second);
    report.parameters[key.first].half_copy_bytes += map.buffers()[b].bytes;
    report.half_copies += map.buffers()[b].bytes;
  }
}

void count_gradients(MemoryReport& report, const NamedTensors& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor grad = params[i].second.grad();
    if (!grad.defined()) continue;
    MemoryParamRow& row = report.parameters[i];
    row.has_grad = true;
    row.grad = grad.node()->precision.storage_type;
    row.grad_bytes = bytes_of(grad.numel(), row.grad);
    report.gradients += row.grad_bytes;
  }
}

// Counts the optimizer's state, estimating what its first step will create where none exists
// (Optimizer::state_bytes).
void count_optimizer_state(MemoryReport& report, const Optimizer& opt, const ParamSet& params) {
  for (size_t i = 0; i < opt.params().size(); ++i) {
    const Tensor& p = opt.params()[i];
    MemoryParamRow& row = report.parameters[params.index.at(p.node().get())];
    NamedTensors state = opt.state(i);
    int64_t bytes = 0;
    for (const auto& [name, value] : state)
      if (value.defined()) bytes += bytes_of(value.numel(), leaf_storage(*value.node()));
    // Of a ZeRO shard (dist/zero.h), or of all of it; none where this process holds none.
    const int64_t estimate = opt.state_bytes(i);
    if (state.empty() && p.grad().defined() && estimate > 0) {
      bytes = estimate;
      report.optimizer_state_estimated = true;
    }
    row.state_bytes += bytes;
    report.optimizer_state += bytes;
  }
}

void list_saved_activations(MemoryReport& report, const std::vector<Buffer>& buffers) {
  for (const Buffer& buffer : buffers) {
    if (buffer.kind != Buffer::Kind::Value) continue;
    // A checkpointed module's recomputed values live only during the backward pass.
    if (buffer.owner->recomputed) {
      report.recomputed_activations += buffer.bytes;
      ++report.recomputed_nodes;
      continue;
    }
    // The backward pass's seed and other values only backward reads are not forward activations,
    // but for the copies a policy keeps of them for it (precision_policy/saved_copies.cpp).
    if (buffer.owner->backward || !buffer.read_backward ||
        !(buffer.read_forward || is_companion(*buffer.owner)))
      continue;
    const Node& owner = *buffer.owner;
    report.saved.push_back({owner.id, op_name(owner.op), owner.origin.module_path, owner.shape,
                            buffer.dtype, buffer.bytes});
    report.saved_activations += buffer.bytes;
  }
  std::sort(report.saved.begin(), report.saved.end(),
            [](const SavedActivationRow& a, const SavedActivationRow& b) { return a.id < b.id; });
}

// The peak: the most live bytes while a node runs, on top of the persistent memory.
void find_peak(MemoryReport& report, const std::vector<Buffer>& buffers, const StepGraph& graph) {
  const std::vector<Node*>& nodes = graph.nodes;
  std::vector<int64_t> delta(nodes.size() + 1, 0);
  for (const Buffer& buffer : buffers) {
    if (buffer.kind == Buffer::Kind::Param) continue;
    delta[buffer.first] += buffer.bytes;
    delta[buffer.last + 1] -= buffer.bytes;
  }
  int64_t live = report.persistent();
  report.peak = -1;
  for (size_t k = 0; k < nodes.size(); ++k) {
    live += delta[k];
    if (live > report.peak) {
      report.peak = live;
      report.peak_node = nodes[k]->id;
      report.peak_op = op_name(nodes[k]->op);
      report.peak_backward = graph.in_backward(*nodes[k]);
    }
  }
}

// The forward nodes' policy names in order of first use, ", "-joined; "none" without any. Leaves
// are not counted: a constant made once and kept (cross_entropy's class indices) carries the
// policy of the step that first made it.
std::string policy_names(const std::vector<Node*>& nodes) {
  std::vector<std::string> policies;
  for (const Node* node : nodes)
    if (!node->backward && !node->inputs.empty() && node->origin.policy &&
        std::find(policies.begin(), policies.end(), node->origin.policy->name()) == policies.end())
      policies.push_back(node->origin.policy->name());
  return policies.empty() ? "none" : fmt::format("{}", fmt::join(policies, ", "));
}

}  // namespace

MemoryReport memory_report(const Module& model, const Optimizer* opt, const Tensor& loss) {
  if (!loss.defined()) fail("memory_report: the loss is undefined");
  const ParamSet params = collect_params(model, opt);
  const StepGraph graph = typed_graph(loss, params.params);

  MemoryReport report;
  BufferMap map(params, graph);
  map.add_params(report);
  map.place_all();

  count_half_copies(report, map);
  count_gradients(report, params.params);
  if (opt) count_optimizer_state(report, *opt, params);
  for (const auto& [name, buffer] : model.named_buffers())
    report.buffers += bytes_of(buffer.numel(), buffer.dtype());
  list_saved_activations(report, map.buffers());
  find_peak(report, map.buffers(), graph);
  report.compiled_peak = planned_peak_bytes(graph.roots);
  report.policy = policy_names(graph.nodes);
  return report;
}

std::string MemoryReport::table() const {
  std::string out = fmt::format("memory of one training step (policy {})\n", policy);
  auto line = [&](const char* what, int64_t bytes, const std::string& note = "") {
    out += fmt::format("  {:<22} {:>28}{}\n", what, human(bytes), note);
  };
  line("master weights", master_weights);
  line("half copies", half_copies);
  line("gradients", gradients);
  line("optimizer state", optimizer_state,
       optimizer_state_estimated ? "  (includes state the first step creates)" : "");
  if (buffers > 0) line("module buffers", buffers);
  line("saved activations", saved_activations);
  if (recomputed_nodes > 0)
    line("recomputed activations", recomputed_activations,
         fmt::format("  ({} nodes of checkpointed modules, during backward)", recomputed_nodes));
  line("peak", peak,
       fmt::format("  at node {} ({}, {})", peak_node, peak_op, peak_backward ? "bwd" : "fwd"));
  line("compiled program peak", compiled_peak, "  (stored values under its memory plan)");
  out +=
      fmt::format("\n  {:<26} {:<14} {:<7} {:>10} {:<10} {:>10} {:<5} {:>10} {:>10}\n", "parameter",
                  "shape", "master", "bytes", "half", "bytes", "grad", "bytes", "state");
  for (const MemoryParamRow& p : parameters)
    out += fmt::format("  {:<26} {:<14} {:<7} {:>10} {:<10} {:>10} {:<5} {:>10} {:>10}\n", p.name,
                       to_string(p.shape), name(p.master), p.master_bytes,
                       dtype_list(p.half_copies), p.half_copy_bytes,
                       p.has_grad ? name(p.grad) : "-", p.grad_bytes, p.state_bytes);
  out += fmt::format("\n  {:<8} {:<14} {:<22} {:<14} {:<7} {:>10}\n", "saved id", "op", "module",
                     "shape", "storage", "bytes");
  for (const SavedActivationRow& s : saved)
    out += fmt::format("  {:<8} {:<14} {:<22} {:<14} {:<7} {:>10}\n", s.id, s.op,
                       s.module_path.empty() ? "-" : s.module_path, to_string(s.shape),
                       name(s.storage), s.bytes);
  return out;
}

std::string MemoryReport::json() const {
  json::Value params = json::Value::array();
  for (const MemoryParamRow& p : parameters) {
    json::Value halves = json::Value::array();
    for (DType t : p.half_copies) halves.push_back(name(t));
    params.push_back({{"name", p.name},
                      {"shape", p.shape},
                      {"master", name(p.master)},
                      {"master_bytes", p.master_bytes},
                      {"half_copies", std::move(halves)},
                      {"half_copy_bytes", p.half_copy_bytes},
                      {"grad", p.has_grad ? json::Value(name(p.grad)) : json::Value(nullptr)},
                      {"grad_bytes", p.grad_bytes},
                      {"state_bytes", p.state_bytes}});
  }
  json::Value saved_rows = json::Value::array();
  for (const SavedActivationRow& s : saved)
    saved_rows.push_back({{"id", s.id},
                          {"op", s.op},
                          {"module", s.module_path},
                          {"shape", s.shape},
                          {"storage", name(s.storage)},
                          {"bytes", s.bytes}});
  return json::dump(
      {{"policy", policy},
       {"master_weights", master_weights},
       {"half_copies", half_copies},
       {"gradients", gradients},
       {"optimizer_state", optimizer_state},
       {"optimizer_state_estimated", optimizer_state_estimated},
       {"buffers", buffers},
       {"saved_activations", saved_activations},
       {"recomputed_activations", recomputed_activations},
       {"recomputed_nodes", recomputed_nodes},
       {"peak", peak},
       {"compiled_peak", compiled_peak},
       {"peak_at",
        {{"id", peak_node}, {"op", peak_op}, {"pass", peak_backward ? "backward" : "forward"}}},
       {"parameters", std::move(params)},
       {"saved", std::move(saved_rows)}});
}

std::string memory_comparison_table(const std::vector<MemoryReport>& reports) {
  std::string out =
      fmt::format("{:<24} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}\n", "policy", "masters",
                  "half copies", "gradients", "opt state", "saved act", "peak");
  for (const MemoryReport& r : reports)
    out += fmt::format("{:<24} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}\n", r.policy,
                       r.master_weights, r.half_copies, r.gradients, r.optimizer_state,
                       r.saved_activations, r.peak);
  return out;
}

}  // namespace mixtape
