// mixtape/runtime/step_plan.h -- a replay plan: the evaluations of a traced step with how each
// binds its inputs and hands on its outputs; mt::compile makes them, AOT artifacts load them, both
// replay.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/in_place.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/runtime/program.h"

namespace mixtape {

using StoragePtr = std::shared_ptr<Storage>;

/// One evaluation a traced call made, with the identity of every buffer it read and stored.
struct Evaluation {
  std::vector<NodePtr> pending;
  std::vector<Node*> pending_raw;
  ExecutedProgram executed;
  Device device = Device::cpu;
  std::vector<double> fills;       // float fill values: signatures leave them out
  std::vector<StoragePtr> inputs;  // the value of each sig.externals[x]
  // Per external: the parameter whose value it is, where it is one that the parameter held
  // before the call and still held when the evaluation ran; else empty.
  std::vector<std::weak_ptr<TensorImpl>> parameters;
  std::vector<StoragePtr> outputs;  // the value of each sig.stored[j] once it ran
};

/// "add [2, 3] f32": a node as errors name it.
std::string describe(const Node& node);

/// Host work the traced call registered (on_each_call), with the values it is handed.
struct Hook {
  std::shared_ptr<StepHook> hook;
  std::vector<NodePtr> values;
};

/// A leaf holding `value` (a replay's result or gradient), typed like the node that computed it
/// in the trace.
Tensor leaf_like(const Node& like, StoragePtr value);

/// Hands every hook private copies of its values as this call left them.
void run_hooks(const std::vector<Hook>& hooks);

/// Where a replay takes an external input of an evaluation from.
struct Binding {
  int arg = -1;  // >= 0: the call's argument
  // The argument's buffer where both traced calls passed the same one: the plan cannot tell it
  // from a tensor the function captures (one input node for both), so a call passing another
  // buffer there traces again rather than replace the captured tensor by it.
  const Storage* pinned_arg = nullptr;
  StoragePtr object;  // else this buffer, which the step keeps up to date in place
  // Else, >= 0: the gradient of plan.gradients[gradient]'s tensor when the call begins, which
  // the step adds to (accumulation), read through the tensor as tracing reads it; where the
  // tensor has none (zero_grad since), a buffer of -0, for x + -0 == x in IEEE 754: the sum is
  // what a call that makes the gradient afresh computes, bit for bit.
  int gradient = -1;
  StoragePtr no_gradient;  // that buffer of -0, made by the first replay that needs it
  // Else this parameter's value when the call begins: one that something outside the step
  // replaces between calls (an optimizer's step outside it), read through the parameter as
  // tracing reads it.
  std::weak_ptr<TensorImpl> parameter;
  // The dtype of a value read through its tensor (parameter or gradient) in the trace; a
  // replay needs the same.
  DType owner_dtype = DType::f32;
  // Else, >= 0: the call's result `result`, which an earlier evaluation of the call stored (the
  // logits a training step returns beside its loss, which the loss reads): a replay hands the
  // reader the fresh buffer it returns.
  int result = -1;
  bool through_parameter() const { return arg < 0 && !object && gradient < 0 && result < 0; }
  bool through_gradient() const { return gradient >= 0; }
  bool through_result() const { return result >= 0; }
  // The buffer's value when the earlier of the two traces the plan compares read it (the state
  // before that call), which AOT export saves; null for arguments.
  StoragePtr first_value;
  // The evaluation reads the value `object` had when the call began, which an earlier
  // evaluation of the call replaces (a returned loss evaluated after the optimizer's step reads
  // the weights the step updated): the replay keeps what that evaluation replaced.
  bool at_call_start = false;
};

struct PlannedEvaluation {
  Evaluation eval;  // the second trace's, its external inputs replaced by private leaves
  std::vector<NodePtr> leaves;
  std::vector<Binding> inputs;   // per external
  std::vector<int> result_slot;  // per stored node: an index into the results (one, if the
                                 // value is returned more than once), or -1
  // Per stored node: the first stored node of this evaluation whose buffer it shares (it is a
  // view of that one, e.g. a reshape assigned to a buffer), or -1. Its value is updated once.
  std::vector<int> shares_with;
  // The stored values a CPU replay computes straight into their state buffers, sorted by node
  // (replay_cpu's in_place): they depend on the plan alone, so the first replay finds them.
  std::optional<std::vector<std::pair<const Node*, StoragePtr>>> in_place;
};

/// The buffers a plan updates in place, counted for the process (dsl/in_place.h) while
/// the plan holds them.
class InPlaceBuffers {
 public:
  InPlaceBuffers() = default;
  InPlaceBuffers(const InPlaceBuffers&) = delete;
  InPlaceBuffers& operator=(const InPlaceBuffers&) = delete;
  ~InPlaceBuffers() { clear(); }
  void insert(const Storage* buffer) {
    if (buffers_.insert(buffer).second) hold_in_place(buffer);
  }
  bool count(const Storage* buffer) const { return buffers_.count(buffer) > 0; }
  void clear() {
    for (const Storage* buffer : buffers_) release_in_place(buffer);
    buffers_.clear();
  }

 private:
  std::unordered_set<const Storage*> buffers_;
};

/// A gradient the step leaves in a parameter's grad(): a replay leaves it there too.
struct GradientSlot {
  std::weak_ptr<TensorImpl> owner;  // whose gradient it is: a tensor the function reached
  int owner_arg = -1;               // or, >= 0, the call's argument (an input requiring grad)
  // What the step's first change to it did with the gradient it found.
  enum class Start {
    replaced,           // dropped it (zero_grad or set_grad inside the step)
    made_from_nothing,  // found none (zero_grad before the call): a replay needs none either
    added_to,           // added to it (accumulation): state the replay reads
  } start = Start::replaced;
  // The gradient it added to (Start::added_to) and its buffer, for the trace's planner to tell
  // which input reads it; only while the trace that found it lives (null in a plan).
  const Node* found = nullptr;
  const Storage* found_buffer = nullptr;
  // Where the step leaves it: (evaluation, stored index), which may be a result's; or the
  // call's argument `arg` itself (set_grad(argument)); or neither: no gradient.
  std::pair<int, int> at{-1, -1};
  int arg = -1;
  bool operator==(const GradientSlot& other) const;  // the same, but for `found`, `handed`
  // The leaf a replay last left in owner's grad(). While something else holds it, the next
  // replay gives it the value it had instead of overwriting it.
  std::weak_ptr<Node> handed;
};

struct Plan {
  std::vector<PlannedEvaluation> evals;
  std::vector<std::pair<int, int>> results;  // (evaluation, stored index) of each result
  std::vector<Hook> hooks;
  std::vector<GradientSlot> gradients;
  // Buffers the replay reads or updates in place, with their holder counts and moves off
  // (Storage::moves_off) when planned: a lower count or another move means something outside
  // replaced or dropped one (assign, load_state, zero_grad outside the function), which the
  // replay would not follow. The count alone misses a drop when something else (another plan,
  // a detached copy) took a reference since. Gradients the step replaces are not watched: the
  // replay hands them back to their owners (GradientSlot).
  struct Watched {
    StoragePtr object;
    long holders = 0;
    uint32_t moves_off = 0;
  };
  std::vector<Watched> watched;
  InPlaceBuffers kept;  // every buffer a replay updates in place
};

/// Gives back what evaluate() would have dropped at once had no trace or plan kept the graph.
void release_graph(const std::vector<Node*>& pending);
void release(Plan& plan);

/// The tensor whose gradient `slot` is, in a call on `args`; null where it is gone.
std::shared_ptr<TensorImpl> owner_of(const GradientSlot& slot, const std::vector<Tensor>& args);

/// Runs the plan on `args` (bound as its Binding::arg say): updates the buffers it keeps in
/// place, leaves the gradients in their owners' grad(), and returns the results as fresh
/// tensors, then runs its hooks.
std::vector<Tensor> replay(Plan& plan, const std::vector<Tensor>& args);

}  // namespace mixtape
