// mixtape/dsl/reusable_buffers.h -- values whose holders all let go of them once the next
// evaluation ends (an optimizer's old parameters and state), whose buffers it may compute into.
#pragma once

#include <utility>
#include <vector>

namespace mixtape {

struct Node;

/// While one lives, the evaluations on its thread may compute a new value into the buffer of a
/// listed node instead of a fresh one, as PyTorch's optimizers update in place: a pointwise
/// kernel that reads the node's value element by element, is its last reader in the program, and
/// writes a value of the same type and size (runtime/program.h, Step::in_place). Only where
/// nothing else could see the old value: the buffer has no holder but the node, and the node none
/// but the graph edges of the evaluation's own nodes and the `holders` references its entry names,
/// which the caller drops or moves off once the evaluation ends. The node is then `overwritten`,
/// and an evaluation that reads it later (a graph kept from before the step, evaluated after it)
/// fails with an mt::Error instead of computing with the new value.
class ReusableBuffers {
 public:
  /// Each entry: a node and the references to it besides graph edges (the tensors that drop it).
  explicit ReusableBuffers(std::vector<std::pair<const Node*, long>> nodes);
  ~ReusableBuffers();
  ReusableBuffers(const ReusableBuffers&) = delete;
  ReusableBuffers& operator=(const ReusableBuffers&) = delete;

 private:
  std::vector<std::pair<const Node*, long>> nodes_;  // sorted by node
  const ReusableBuffers* outer_;
  friend long reusable_holders(const Node* node);
};

/// The references besides graph edges that the innermost ReusableBuffers of this thread lists for
/// `node`, or -1 when it does not list it (or there is none).
long reusable_holders(const Node* node);

}  // namespace mixtape
