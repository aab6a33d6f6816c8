// mixtape/codegen/lower.h -- turns one fusion group into a kernel of the backend-neutral kernel IR.
#pragma once

#include <vector>

#include "mixtape/codegen/fusion.h"
#include "mixtape/codegen/kernel_ir.h"

namespace mixtape {

/// A kernel and the node behind each of its parameters (kernel.params[i] is nodes[i]: a value
/// read, or one the kernel stores when kernel.params[i].output).
struct LoweredKernel {
  kir::Kernel kernel;
  std::vector<Node*> nodes;
  std::vector<double> scalars;      // this launch's value of each scalar slot
  std::vector<Node*> scalar_nodes;  // the fill (or view of one) behind each slot
};

/// Lowers a Kernel-kind group. Values are computed exactly as the reference executor does
/// (same compute types, same rounding points); the name is a hash of the kernel's structure.
LoweredKernel lower(const FusionGroup& group);

/// The value a fill, or a view of one, holds: Full's value rounded through each storage type.
double fill_value(const Node& node);

}  // namespace mixtape
