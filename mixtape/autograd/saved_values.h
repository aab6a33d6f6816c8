// mixtape/autograd/saved_values.h -- what the gradient rules read of the forward pass: each
// value, or the narrower copy its policy keeps of it for the backward pass.
#pragma once

#include <memory>
#include <vector>

#include "mixtape/autograd/recompute.h"
#include "mixtape/dsl/node.h"

namespace mixtape {

/// The forward values one backward walk's gradient rules read, each decided once: the value
/// itself, or a copy rounded to the narrower type its policy keeps it in for the backward pass
/// (Policy::saved_type, precision-aware saving). Made by the precision pass
/// (precision_policy/saved_copies.cpp), which types the forward graph first to know what is
/// narrower.
class SavedValues {
 public:
  virtual ~SavedValues() = default;
  virtual NodePtr read(const NodePtr& value) = 0;
};

/// For a backward walk from `roots` over `tape` (the nodes it differentiates), whose checkpointed
/// modules `recompute` says (null: none): null where no policy of the tape keeps narrower copies
/// and where the walk builds a graph of its own to differentiate again (`create_graph`: a copy
/// takes no gradient); then nothing is asked of any policy.
std::unique_ptr<SavedValues> saved_values_for(const std::vector<NodePtr>& roots,
                                              const std::vector<NodePtr>& tape, bool create_graph,
                                              Recomputation* recompute);

/// While it lives, the gradient rules on this thread read the forward values through `saved`
/// (null: the values themselves).
class SavedValuesScope {
 public:
  explicit SavedValuesScope(SavedValues* saved);
  ~SavedValuesScope();
  SavedValuesScope(const SavedValuesScope&) = delete;
  SavedValuesScope& operator=(const SavedValuesScope&) = delete;

 private:
  SavedValues* previous_;
};

/// What a gradient rule reads for the forward value `value`.
NodePtr saved_value(const NodePtr& value);

}  // namespace mixtape
