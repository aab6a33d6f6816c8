// mixtape/precision_policy/report.cpp -- collects the graph's precision decisions as a table and as
// JSON.
#include "mixtape/precision_policy/report.h"

#include <algorithm>
#include <unordered_map>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/json.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/precision_policy/policy.h"

namespace mixtape {

PrecisionReport precision_report(const std::vector<Tensor>& outputs) {
  std::vector<NodePtr> roots;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined()) fail("precision_report: output {} is undefined", i);
    roots.push_back(outputs[i].node());
  }
  std::vector<Node*> nodes = nodes_in_tape_order(roots);
  assign_precision(nodes);
  PrecisionReport report;
  for (Node* n : nodes)
    report.rows.push_back({n->id, op_name(n->op), n->origin.module_path, n->shape, n->dtype,
                           n->precision.storage_type, n->precision.compute, n->precision.accum,
                           // A checkpointed module's recomputation runs in the backward pass.
                           n->backward || n->recomputed,
                           n->precision.rule ? *n->precision.rule : std::string()});
  // Each override policy's rules that have decided nothing yet, once per policy.
  std::vector<const Policy*> seen;
  for (const Node* n : nodes) {
    const Policy* policy = n->origin.policy.get();
    if (!policy || std::find(seen.begin(), seen.end(), policy) != seen.end()) continue;
    seen.push_back(policy);
    if (const auto* overrides = dynamic_cast<const OverridePolicy*>(policy))
      for (const std::string& rule : overrides->unmatched_rules())
        report.unmatched_rules.push_back(fmt::format("{}: {}", policy->name(), rule));
  }
  return report;
}

std::string PrecisionReport::table() const {
  std::string out =
      fmt::format("{:>6}  {:<14} {:<22} {:<16} {:<7} {:<7} {:<7} {:<5}  {}\n", "id", "op", "module",
                  "shape", "storage", "compute", "accum", "pass", "rule");
  for (const PrecisionRow& r : rows)
    out += fmt::format("{:>6}  {:<14} {:<22} {:<16} {:<7} {:<7} {:<7} {:<5}  {}\n", r.id, r.op,
                       r.module_path.empty() ? "-" : r.module_path, to_string(r.shape),
                       name(r.storage), name(r.compute), name(r.accum), r.backward ? "bwd" : "fwd",
                       r.rule);
  for (const std::string& rule : unmatched_rules)
    out += fmt::format("override {} has decided no node\n", rule);
  return out;
}

std::string PrecisionReport::summary() const {
  struct Tally {
    std::string module;
    DType storage, compute;
    int64_t forward = 0, backward = 0;
  };
  std::vector<Tally> all;
  auto count = [](std::vector<Tally>& tallies, const std::string& module, const PrecisionRow& r) {
    auto it = std::find_if(tallies.begin(), tallies.end(), [&](const Tally& t) {
      return t.module == module && t.storage == r.storage && t.compute == r.compute;
    });
    if (it == tallies.end()) it = tallies.insert(tallies.end(), {module, r.storage, r.compute});
    ++(r.backward ? it->backward : it->forward);
  };
  // Grouped by module in order of first appearance, so a module's pairs sit together.
  std::unordered_map<std::string, size_t> module_index;
  std::vector<std::vector<Tally>> by_module;
  for (const PrecisionRow& r : rows) {
    std::string module = r.module_path.empty() ? "-" : r.module_path;
    auto [it, added] = module_index.try_emplace(module, by_module.size());
    if (added) by_module.emplace_back();
    count(by_module[it->second], module, r);
    count(all, "(all)", r);
  }
  std::vector<Tally> per_module;
  for (const std::vector<Tally>& tallies : by_module)
    per_module.insert(per_module.end(), tallies.begin(), tallies.end());
  per_module.insert(per_module.end(), all.begin(), all.end());
  size_t width = 6;
  for (const Tally& t : per_module) width = std::max(width, t.module.size());
  std::string out = fmt::format("{:<{}}  {:<7} {:<7} {:>8} {:>8}\n", "module", width, "storage",
                                "compute", "forward", "backward");
  for (const Tally& t : per_module)
    out += fmt::format("{:<{}}  {:<7} {:<7} {:>8} {:>8}\n", t.module, width, name(t.storage),
                       name(t.compute), t.forward, t.backward);
  for (const std::string& rule : unmatched_rules)
    out += fmt::format("override {} has decided no node\n", rule);
  return out;
}

std::string PrecisionReport::json() const {
  json::Value nodes = json::Value::array();
  for (const PrecisionRow& r : rows)
    nodes.push_back({{"id", r.id},
                     {"op", r.op},
                     {"module", r.module_path},
                     {"shape", r.shape},
                     {"traced", name(r.traced)},
                     {"storage", name(r.storage)},
                     {"compute", name(r.compute)},
                     {"accum", name(r.accum)},
                     {"pass", r.backward ? "backward" : "forward"},
                     {"rule", r.rule}});
  json::Value unmatched = json::Value::array();
  for (const std::string& rule : unmatched_rules) unmatched.push_back(rule);
  return json::dump({{"nodes", std::move(nodes)}, {"unmatched_rules", std::move(unmatched)}});
}

}  // namespace mixtape
