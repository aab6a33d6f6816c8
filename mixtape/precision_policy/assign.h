// mixtape/precision_policy/assign.h -- the pass that gives every node its storage, compute and
// accum dtypes.
#pragma once

#include <vector>

#include "mixtape/dsl/node.h"
#include "mixtape/precision_policy/policy.h"

namespace mixtape {

/// Decides the precision of each not yet decided node, in the given (topological) order, with
/// the policy recorded on the node. Nodes without a policy, non-float nodes and f64 nodes keep
/// their traced dtype.
void assign_precision(const std::vector<Node*>& topological_order);

/// What a policy is asked about `node`: its op, types, floating inputs (already typed) and
/// where it was made.
PrecisionQuery precision_query(const Node& node);

}  // namespace mixtape
