// mixtape/precision_policy/memory_report.cpp -- sizes a training step's memory from its typed
// graph: a liveness simulation over the nodes in tape order, nothing is executed.
#include "mixtape/precision_policy/memory_report.h"

#include <algorithm>
#include <map>
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
  if (node.precision_assigned) return node.storage;
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

// State the optimizer creates on a parameter's first update, in f32 tensors of its shape.
int estimated_state_tensors(const Optimizer& opt) {
  if (const auto* sgd = dynamic_cast<const SGD*>(&opt)) return sgd->options.momentum != 0 ? 1 : 0;
  if (dynamic_cast<const Adam*>(&opt)) return 2;  // exp_avg, exp_avg_sq (AdamW too)
  return 0;
}

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

}  // namespace

MemoryReport memory_report(const Module& model, const Optimizer* opt, const Tensor& loss) {
  if (!loss.defined()) fail("memory_report: the loss is undefined");

  // The parameters: the model's, then any the optimizer holds besides.
  NamedTensors params = model.named_parameters();
  std::unordered_map<const Node*, size_t> param_index;
  for (size_t i = 0; i < params.size(); ++i) param_index.emplace(params[i].second.node().get(), i);
  if (opt)
    for (size_t i = 0; i < opt->params().size(); ++i) {
      const Tensor& p = opt->params()[i];
      if (param_index.emplace(p.node().get(), params.size()).second)
        params.emplace_back(fmt::format("optimizer.params[{}]", i), p);
    }

  std::vector<NodePtr> roots{loss.node()};
  for (const auto& [name, p] : params)
    if (p.grad().defined()) roots.push_back(p.grad().node());
  std::vector<Node*> nodes = nodes_in_tape_order(roots);
  assign_precision(nodes);
  std::unordered_map<const Node*, int64_t> position;
  for (size_t k = 0; k < nodes.size(); ++k) position.emplace(nodes[k], static_cast<int64_t>(k));
  const int64_t end = static_cast<int64_t>(nodes.size()) - 1;
  std::unordered_set<const Node*> outputs;
  for (const NodePtr& root : roots) outputs.insert(root.get());

  MemoryReport report;
  std::vector<Buffer> buffers;
  std::vector<int64_t> param_buffer(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Node& node = *params[i].second.node();
    MemoryParamRow row;
    row.name = params[i].first;
    row.shape = node.shape;
    row.master = leaf_storage(node);
    row.master_bytes = bytes_of(node.numel(), row.master);
    report.master_weights += row.master_bytes;
    report.parameters.push_back(std::move(row));
    param_buffer[i] = static_cast<int64_t>(buffers.size());
    buffers.push_back({Buffer::Kind::Param, report.parameters[i].master});
    buffers.back().param = i;
  }

  // ---- which buffer each node's value lives in ----
  std::map<std::pair<size_t, DType>, int64_t> half_copy;  // (param, type) -> buffer
  auto half_copy_of = [&](size_t param, DType type, int64_t k) {
    auto [it, added] = half_copy.try_emplace({param, type}, static_cast<int64_t>(buffers.size()));
    if (added) {
      Buffer copy{Buffer::Kind::HalfCopy, type};
      copy.bytes = bytes_of(params[param].second.numel(), type);
      copy.first = copy.last = k;
      copy.param = param;
      buffers.push_back(copy);
    }
    return it->second;
  };
  auto read = [&](int64_t b, int64_t k, bool backward) {
    Buffer& buffer = buffers[b];
    buffer.last = std::max(buffer.last, k);
    (backward ? buffer.read_backward : buffer.read_forward) = true;
  };
  std::vector<int64_t> buffer_of(nodes.size(), -1);  // -1: takes no memory (a fill)
  for (size_t k = 0; k < nodes.size(); ++k) {
    const Node& node = *nodes[k];
    const int64_t pos = static_cast<int64_t>(k);
    if (auto found = param_index.find(&node); found != param_index.end()) {
      buffer_of[k] = param_buffer[found->second];
      continue;
    }
    int64_t b = -1;
    bool own = true;
    if (is_fill(node.op) && !outputs.count(&node)) {
      own = false;
    } else if (is_alias_view(node.op) && node.inputs.size() == 1) {
      int64_t source = buffer_of[position.at(node.inputs[0].get())];
      if (source < 0 && !outputs.count(&node)) {
        own = false;  // a view of a fill is still a fill
      } else if (source >= 0 && buffers[source].dtype == node.storage) {
        b = source;
        own = false;
      } else if (source >= 0 && buffers[source].kind == Buffer::Kind::Param &&
                 is_half(node.storage)) {
        b = half_copy_of(buffers[source].param, node.storage, pos);  // the cast, then a view
        own = false;
      }
    }
    if (own) {
      b = static_cast<int64_t>(buffers.size());
      Buffer value{Buffer::Kind::Value, node.storage};
      value.bytes = bytes_of(node.numel(), node.storage);
      // Leaf data (a batch) counts from when it was made, which is before the nodes reading it.
      value.first = value.last = pos;
      value.owner = &node;
      buffers.push_back(value);
    }
    buffer_of[k] = b;
    if (!own) {
      // A view reads its one input through the buffer it aliases.
      if (b >= 0) read(b, pos, node.backward);
      continue;
    }
    for (const NodePtr& input : node.inputs) {
      int64_t source = buffer_of[position.at(input.get())];
      if (source < 0) continue;
      const Buffer& src = buffers[source];
      // A 16-bit reader of an f32 master reads its half copy, made once per step and type.
      if (src.kind == Buffer::Kind::Param && is_floating(input->dtype) && is_half(node.compute) &&
          node.compute != src.dtype)
        source = half_copy_of(src.param, node.compute, pos);
      read(source, pos, node.backward);
    }
  }
  for (const Node* output : outputs) {
    int64_t b = buffer_of[position.at(output)];
    if (b >= 0 && buffers[b].kind != Buffer::Kind::Param) buffers[b].last = end;
  }

  // ---- the categories ----
  for (const auto& [key, b] : half_copy) {
    report.parameters[key.first].half_copies.push_back(key.second);
    report.parameters[key.first].half_copy_bytes += buffers[b].bytes;
    report.half_copies += buffers[b].bytes;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor grad = params[i].second.grad();
    if (!grad.defined()) continue;
    MemoryParamRow& row = report.parameters[i];
    row.has_grad = true;
    row.grad = grad.node()->storage;
    row.grad_bytes = bytes_of(grad.numel(), row.grad);
    report.gradients += row.grad_bytes;
  }
  if (opt) {
    const int estimate = estimated_state_tensors(*opt);
    for (size_t i = 0; i < opt->params().size(); ++i) {
      const Tensor& p = opt->params()[i];
      MemoryParamRow& row = report.parameters[param_index.at(p.node().get())];
      NamedTensors state = opt->state(i);
      int64_t bytes = 0;
      for (const auto& [name, value] : state)
        if (value.defined()) bytes += bytes_of(value.numel(), leaf_storage(*value.node()));
      if (state.empty() && p.grad().defined() && estimate > 0) {
        bytes = estimate * bytes_of(p.numel(), f32);
        report.optimizer_state_estimated = true;
      }
      row.state_bytes += bytes;
      report.optimizer_state += bytes;
    }
  }
  for (const Buffer& buffer : buffers) {
    // The backward pass's seed and other values only backward reads are not forward activations.
    if (buffer.kind != Buffer::Kind::Value || buffer.owner->backward || !buffer.read_backward ||
        !buffer.read_forward)
      continue;
    const Node& owner = *buffer.owner;
    report.saved.push_back(
        {owner.id, op_name(owner.op), owner.module_path, owner.shape, buffer.dtype, buffer.bytes});
    report.saved_activations += buffer.bytes;
  }
  std::sort(report.saved.begin(), report.saved.end(),
            [](const SavedActivationRow& a, const SavedActivationRow& b) { return a.id < b.id; });

  // ---- the peak: live bytes while each node runs ----
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
      report.peak_backward = nodes[k]->backward;
    }
  }

  report.compiled_peak = planned_peak_bytes(roots);

  std::vector<std::string> policies;
  for (const Node* node : nodes)
    if (!node->backward && node->policy &&
        std::find(policies.begin(), policies.end(), node->policy->name()) == policies.end())
      policies.push_back(node->policy->name());
  report.policy = policies.empty() ? "none" : fmt::format("{}", fmt::join(policies, ", "));
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
  line("saved activations", saved_activations);
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
       {"saved_activations", saved_activations},
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
