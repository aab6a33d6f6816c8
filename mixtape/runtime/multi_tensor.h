// mixtape/runtime/multi_tensor.h -- multi-tensor steps: independent kernels of one flattened form
// (per-parameter optimizer updates) run as one launch of one compiled kernel.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mixtape/codegen/lower.h"
#include "mixtape/runtime/program.h"

namespace mixtape {

// A step's kernel before loading: the lowered kernel and, when it has one, its multi-tensor
// form's listing (the key under which structurally identical kernels meet).
struct PendingKernel {
  LoweredKernel lowered;
  std::optional<kir::Kernel> flat;
  std::string key;
  int64_t members = 0;
};

/// What `step` reads and stores, by reference (every segment's, for a multi-tensor step).
void step_io(const Step& step, const std::vector<Node*>& pending, const Signature& sig,
             std::vector<NodeRef>& reads, std::vector<NodeRef>& writes);

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
                                                    const Signature& sig);

/// One step running the kernels `set` (indices into `kernels`) as segments of their shared
/// multi-tensor form, loaded with `load`.
Step multi_tensor_step(const std::vector<size_t>& set, std::vector<PendingKernel*>& kernels,
                       const std::vector<Node*>& pending, const Signature& sig,
                       const KernelLoader& load);

}  // namespace mixtape
