// runtime/cpu_executor.h -- the compiled CPU back end's entry point.
#pragma once

#include <vector>

#include "dsl/node.h"
#include "runtime/device.h"

namespace mixtape {

/// Computes `pending` (unevaluated nodes in tape order, precision already assigned): fuses them
/// (or not, in eager mode), runs each kernel, matmul and host op, and stores the values of every
/// node in `required` and of every node another group reads. Nodes fused away stay unevaluated;
/// a later evaluation that needs them recomputes them from their inputs.
void execute_cpu(const std::vector<Node*>& pending, const std::vector<Node*>& required);

}  // namespace mixtape
