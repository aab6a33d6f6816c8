// mixtape/runtime/eval.cpp -- mt::evaluate: runs every unevaluated node an output needs, in tape
// order.
#include <algorithm>

#include "mixtape/dsl/graph.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/runtime/compile.h"
#include "mixtape/runtime/cpu_executor.h"
#include "mixtape/runtime/cuda_executor.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/program.h"
#include "mixtape/runtime/reference_executor.h"

namespace mixtape {

namespace {
void run(const std::vector<NodePtr>& outputs);
}  // namespace

namespace {
thread_local bool may_queue = false;
}  // namespace

bool evaluation_may_queue() { return may_queue; }

void evaluate_queued(const std::vector<NodePtr>& outputs) {
  struct Restore {
    bool previous = may_queue;
    ~Restore() { may_queue = previous; }
  } restore;
  may_queue = true;
  evaluate(outputs);
}

void evaluate(const std::vector<NodePtr>& requested) {
  std::vector<NodePtr> deferred = deferred_assignment_values();
  if (deferred.empty()) return run(requested);
  std::vector<NodePtr> outputs = requested;
  for (const NodePtr& value : deferred)  // once each: a value asked for twice is stored once
    if (std::find(outputs.begin(), outputs.end(), value) == outputs.end()) outputs.push_back(value);
  try {
    run(outputs);
  } catch (...) {
    // A value that cannot be computed must not fail every later evaluation, nor make its
    // tensor fail every read. What was asked for may fail where the pending assignments do not
    // (a loss whose labels are out of range, after batch norm's update): each is computed
    // alone and settles; one that fails too (it reads the failing value: an embedding's index
    // out of range before batch norm) leaves its tensor as it was before, as if the forward
    // pass that made it had not run. (A compiled step that fails changes no state at all.)
    recover_deferred_assignments([](const NodePtr& value) { run({value}); });
    throw;
  }
  settle_deferred_assignments();
}

namespace {

void run(const std::vector<NodePtr>& outputs) {
  PhaseClock clock;
  for (const NodePtr& output : outputs)
    if (output->overwritten) [[unlikely]]
      fail_overwritten(*output, nullptr);
  std::vector<Node*> pending = pending_nodes(outputs);
  if (pending.empty()) return;
  execution_counters().pending_seconds += clock.lap();
  assign_precision(pending);
  execution_counters().precision_seconds += clock.lap();
  struct CountRun {  // the rest, also when a step throws
    PhaseClock& clock;
    ~CountRun() { execution_counters().run_seconds += clock.lap(); }
  } count_run{clock};
  Device device = current_device();
  if (device == Device::reference) {
    if (tracing_step())
      note_side_effect("runs on the reference executor, which has no programs to replay");
    for (Node* node : pending) node->value = reference_compute(*node);
  } else {
    std::vector<Node*> required;
    for (const NodePtr& output : outputs)
      if (output && !output->evaluated() &&
          std::find(required.begin(), required.end(), output.get()) == required.end())
        required.push_back(output.get());
    ExecutedProgram executed =
        device == Device::cuda ? execute_cuda(pending, required) : execute_cpu(pending, required);
    // A traced step keeps its graph whole until the trace is done with it.
    if (record_evaluation(pending, std::move(executed), device)) return;
  }
  // No gradient will ever flow through these, so their producers are no longer needed: this is
  // what keeps step-to-step chains (optimizer updates) from growing. Nodes a fused kernel
  // computed only in registers keep their inputs, to be recomputed if something asks later.
  for (Node* node : pending)
    if (!node->requires_grad && node->evaluated()) node->inputs.clear();
}

}  // namespace

}  // namespace mixtape
