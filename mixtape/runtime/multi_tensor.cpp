// mixtape/runtime/multi_tensor.cpp -- groups kernels of one multi-tensor form that do not depend on
// one another, orders the contracted step graph, and builds the merged steps.
#include "mixtape/runtime/multi_tensor.h"

#include <functional>
#include <queue>
#include <set>
#include <unordered_map>

#include "mixtape/codegen/hash.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/log.h"

namespace mixtape {

void step_io(const Step& step, const std::vector<Node*>& pending, const Signature& sig,
             std::vector<NodeRef>& reads, std::vector<NodeRef>& writes) {
  reads.clear();
  writes.clear();
  if (step.kind == FusionGroup::Kind::Kernel) {
    for (size_t p = 0; p < step.params.size(); ++p)
      (step.param_is_output(p) ? writes : reads).push_back(step.params[p]);
  } else {
    // An Alias step shares its input 0's buffer and reads nothing else (a custom op's other
    // inputs are its gradient's, fusion.h kernel_reads).
    const Node& node = *sig.resolve(step.node, pending);
    const size_t read = step.kind == FusionGroup::Kind::Alias ? 1 : node.inputs.size();
    for (size_t k = 0; k < read; ++k) reads.push_back(sig.ref(node.inputs[k].get(), pending));
    if (step.has_bias) reads.push_back(step.bias);
    writes.push_back(step.output);
  }
}

// The steps' order with multi-tensor sets: each entry lists the original steps it runs (one, or
// a set of 2 or more kernels of one multi-tensor form, in step order). Steps are the nodes of a
// DAG (an edge from the step that stores a value to each step that reads it); a kernel joins a
// set of its form when neither reaches the other in the graph with the sets so far contracted,
// which is exactly when contracting them keeps it acyclic: so no member depends on another,
// directly or through other steps. The contracted DAG is then ordered topologically, each node
// where its last member was as far as its edges allow.
std::vector<std::vector<size_t>> multi_tensor_order(const std::vector<Step>& steps,
                                                    const std::vector<PendingKernel*>& kernels,
                                                    const std::vector<Node*>& pending,
                                                    const Signature& sig) {
  size_t n = steps.size();
  std::unordered_map<NodeRef, size_t> writer;
  std::vector<NodeRef> reads, writes;
  for (size_t i = 0; i < n; ++i) {
    step_io(steps[i], pending, sig, reads, writes);
    for (NodeRef ref : writes) writer.emplace(ref, i);
  }
  // The contracted graph, on each set's representative (its first member).
  std::vector<std::set<size_t>> succ(n), pred(n);
  for (size_t i = 0; i < n; ++i) {
    step_io(steps[i], pending, sig, reads, writes);
    for (NodeRef ref : reads) {
      auto found = writer.find(ref);
      if (found == writer.end() || found->second == i) continue;
      succ[found->second].insert(i);
      pred[i].insert(found->second);
    }
  }
  std::vector<size_t> seen_mark(n, 0);
  size_t mark = 0;
  std::vector<size_t> stack;
  auto reaches = [&](size_t from, size_t to) {
    ++mark;
    stack.assign(1, from);
    seen_mark[from] = mark;
    while (!stack.empty()) {
      size_t at = stack.back();
      stack.pop_back();
      for (size_t next : succ[at]) {
        if (next == to) return true;
        if (seen_mark[next] != mark) {
          seen_mark[next] = mark;
          stack.push_back(next);
        }
      }
    }
    return false;
  };
  auto contract = [&](size_t into, size_t from) {
    for (size_t next : succ[from]) {
      pred[next].erase(from);
      pred[next].insert(into);
      succ[into].insert(next);
    }
    for (size_t prev : pred[from]) {
      succ[prev].erase(from);
      succ[prev].insert(into);
      pred[into].insert(prev);
    }
    succ[from].clear();
    pred[from].clear();
  };
  std::vector<std::vector<size_t>> members(n);
  for (size_t i = 0; i < n; ++i) members[i] = {i};
  std::unordered_map<std::string, std::vector<size_t>> sets_of_form;  // representatives
  std::vector<bool> live(n, true);
  for (size_t i = 0; i < n; ++i) {
    if (!kernels[i] || !kernels[i]->flat) continue;
    std::vector<size_t>& sets = sets_of_form[kernels[i]->key];
    bool joined = false;
    for (size_t rep : sets) {
      if (reaches(rep, i) || reaches(i, rep)) continue;
      contract(rep, i);
      members[rep].push_back(i);
      live[i] = false;
      joined = true;
      break;
    }
    if (!joined) {
      if (!sets.empty() && log_enabled("fusion"))
        log_line("fusion", "multi-tensor: step {} depends on (or feeds) every set of its form", i);
      sets.push_back(i);
    }
  }
  // Kahn's algorithm, the ready node whose last member came first going first.
  std::vector<size_t> waiting(n, 0);
  using Ready = std::pair<size_t, size_t>;  // (last member, representative)
  std::priority_queue<Ready, std::vector<Ready>, std::greater<Ready>> ready;
  for (size_t i = 0; i < n; ++i) {
    if (!live[i]) continue;
    waiting[i] = pred[i].size();
    if (waiting[i] == 0) ready.push({members[i].back(), i});
  }
  std::vector<std::vector<size_t>> order;
  while (!ready.empty()) {
    size_t rep = ready.top().second;
    ready.pop();
    order.push_back(members[rep]);
    for (size_t next : succ[rep])
      if (--waiting[next] == 0) ready.push({members[next].back(), next});
  }
  size_t placed = 0;
  for (const std::vector<size_t>& entry : order) placed += entry.size();
  if (placed != n) fail("multi-tensor steps: the contracted step graph has a cycle");
  return order;
}

Step multi_tensor_step(const std::vector<size_t>& set, std::vector<PendingKernel*>& kernels,
                       const std::vector<Node*>& pending, const Signature& sig,
                       const KernelLoader& load) {
  kir::Kernel flat = *kernels[set[0]]->flat;
  flat.name = "mt_" + hash_string(kernels[set[0]]->key).hex();
  Step step;
  step.kind = FusionGroup::Kind::Kernel;
  KernelRef ref = load(flat);
  step.compiled = ref.address;
  step.code = std::move(ref.owner);
  step.segment_table = {static_cast<int64_t>(set.size()), 0};
  int64_t total = 0;
  for (size_t i : set) {
    const LoweredKernel& lowered = kernels[i]->lowered;
    int64_t extent = 1;
    for (int64_t d : lowered.kernel.dims) extent *= d;
    total += extent;
    step.segment_table.push_back(total);
    for (Node* node : lowered.nodes) step.params.push_back(sig.ref(node, pending));
    for (Node* node : lowered.scalar_nodes) step.scalar_nodes.push_back(sig.ref(node, pending));
    step.members += kernels[i]->members;
  }
  // Threads split a pointwise kernel's elements, a reduction's segments (each swept whole).
  step.parallel_extent = flat.is_reduction() ? static_cast<int64_t>(set.size()) : total;
  step.points = total;
  if (log_enabled("fusion"))
    log_line("fusion", "multi-tensor step {}: {} kernels, {} elements", flat.name, set.size(),
             total);
  step.kernel = std::make_shared<const kir::Kernel>(std::move(flat));
  return step;
}

}  // namespace mixtape
