// mixtape/autograd/recompute.h -- activation checkpointing in the backward pass: clones of the
// checkpointed modules' forward nodes, for the gradient rules to read instead of the originals.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "mixtape/dsl/node.h"

namespace mixtape {

/// A region activation checkpointing recomputes as one: a call of a checkpointed module (at path
/// `module`). `call` is the module's own call where its forward opens one scope around all it
/// does (Module::forward_scope); for a module that opens none, or several (calls_apart false),
/// the call around it, so that its children's calls in it are one region.
struct CheckpointRegion {
  std::string_view module;  // empty: no region
  const ModuleCall* call = nullptr;
  explicit operator bool() const { return !module.empty(); }
  bool operator==(const CheckpointRegion&) const = default;
};

/// One backward pass's recomputation (DESIGN.md decision 14). The gradient rule of a forward
/// node inside a checkpointed module (dsl/activation_checkpointing.h) reads a clone of it, whose
/// inputs are clones too as far as they were made in the same call of the module and are not
/// evaluated; the module's inputs (values made outside it, parameters, evaluated nodes) are read
/// as they are. So only those inputs live from the forward pass to the backward one: the
/// originals inside the module have no backward readers and die after their last forward one.
///
/// A clone is the same op on the same attributes (a draw's seed, and its counter through its
/// cloned or shared offset input), with the original's precision, origin (policy, composite,
/// module path, call site) and requires_grad, so every type the policy pass picks and every bit
/// it computes are the original's. Clones are made when the pass first needs one, just before
/// the gradient nodes that read them: their ids, the order programs run nodes in, put the
/// recomputation of a module right before its backward, after the forward of everything.
class Recomputation {
 public:
  /// For the globs in force (checkpoint_globs(), non-null).
  explicit Recomputation(std::shared_ptr<const std::vector<std::string>> globs);
  Recomputation(const Recomputation&) = delete;
  Recomputation& operator=(const Recomputation&) = delete;

  /// The node whose inputs and output the vjp of `node` reads: its clone when `node` is an
  /// unevaluated node of a checkpointed module, else `node`.
  NodePtr for_vjp(const NodePtr& node);

  /// The call of the outermost checkpointed module `node` was made in (a call of "blocks.3"),
  /// or no region.
  CheckpointRegion region_of(const Node& node);

 private:
  bool clonable(const Node& node, const CheckpointRegion& region);
  NodePtr clone_within(const NodePtr& root, const CheckpointRegion& region);

  std::shared_ptr<const std::vector<std::string>> globs_;
  // Per module path, the length of the outermost checkpointed module's path within it, or -1.
  std::unordered_map<std::string, ptrdiff_t> region_length_by_path_;
  std::unordered_map<std::string, bool> apart_by_module_;  // calls_apart, asked once a pass
  std::unordered_map<const Node*, NodePtr> clones_;
};

}  // namespace mixtape
