// mixtape/dsl/graph.h -- making nodes: ids, grad mode, module-path and call-site scopes, the eval
// hook.
#pragma once

#include <cstdint>
#include <functional>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/dsl/exception.h"
#include "mixtape/dsl/node.h"

namespace mixtape {

using Loc = std::source_location;

/// Creates a node; fills id, requires_grad, module path and call site. Shapes and dtypes must
/// already be checked by the caller (the op builders); this checks only that the element count
/// and byte size are representable (mt::Error naming the op and the shape).
NodePtr make_node(OpCode op, DType dtype, Shape shape, NodeInputs inputs, Attrs attrs,
                  const Loc& loc);

/// mt::Error "op: ..." unless every dimension of `shape` is >= 0 and its element count and byte
/// size in `dtype` are representable (at most 2^60 bytes): make_node checks every node so, and
/// builders that take a shape from the user call it first to report the user's op.
void check_shape_size(const char* op, const Shape& shape, DType dtype, const Loc& loc);

/// Whether a node can run inside a generated kernel (pointwise ops, views, Sum/Max, Full): what
/// fusion groups, and what the backward pass may compute again rather than read from memory.
bool kernel_op(const Node& node);

/// `of`'s companion: a node of `op` over `of` alone, of its shape and origin, whose id is the one
/// after `of`'s, so that it runs right after `of` whenever it was made (precision-aware saving's
/// rounded copy, made during the backward pass, runs in the forward pass, and the value can die
/// with its last forward reader). One per node: a second call gives the first's while it lives.
NodePtr make_companion(const NodePtr& of, OpCode op, DType dtype, Attrs attrs = {});
/// Makes `node`, made while a gradient rule ran, a forward value made at `origin`, which takes
/// no gradient (a companion; a view of one).
void make_forward(Node& node, const NodeOrigin& origin);
/// Whether `node` is the companion of its one input.
bool is_companion(const Node& node);

/// A host buffer of `count` elements of `dtype` for the value of `node` (zeros, or uninitialized
/// for a value about to be written whole). A failed allocation, or one past the memory limit,
/// is an mt::Error naming the node's op, shape and call site and the bytes asked for.
std::shared_ptr<Storage> allocate_value(const Node& node, DType dtype, int64_t count,
                                        bool uninitialized);

bool grad_enabled();

/// Disables gradient recording for nodes made while it lives (like torch.no_grad()).
class NoGradGuard {
 public:
  NoGradGuard();
  explicit NoGradGuard(bool enabled);  // sets grad mode to `enabled`
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

/// Whether the calls of the module at `path` can be told apart: false once one of its children
/// was called outside a scope of the module's own (a module whose forward opens no
/// forward_scope(), or several, one per piece), whose nodes then belong to no one call of it.
bool calls_apart(const std::string& path);

/// Module path recorded on the nodes made while it lives ("blocks.0.attn"), with the call of
/// the module it is (NodeOrigin::module_call).
class ModulePathScope {
 public:
  /// A call of the module at `path`, inside the calls in progress.
  explicit ModulePathScope(const std::string& path);
  /// The path and call `origin` was made in (a gradient node is its forward node's).
  explicit ModulePathScope(const NodeOrigin& origin);
  ~ModulePathScope();
  ModulePathScope(const ModulePathScope&) = delete;
  ModulePathScope& operator=(const ModulePathScope&) = delete;

 private:
  std::string previous_;
  std::shared_ptr<const ModuleCall> previous_call_;
};

/// Makes nodes built inside library code (composites, modules) report the user's call site:
/// the outermost scope wins.
/// A composite op (softmax, cross_entropy, ...) also names itself, so that precision policies
/// can treat every node it makes as part of it.
class CallSiteScope {
 public:
  explicit CallSiteScope(const Loc& loc, const char* composite = nullptr);
  ~CallSiteScope();
  CallSiteScope(const CallSiteScope&) = delete;
  CallSiteScope& operator=(const CallSiteScope&) = delete;

 private:
  bool owns_site_;
  bool owns_composite_;
};
/// The call site to report for an op invoked at `loc`.
const Loc& user_call_site(const Loc& loc);

/// The precision policy recorded on nodes made now (null: none, nodes keep their traced dtypes).
const std::shared_ptr<const Policy>& current_policy();
/// Sets it, returning the previous one; mt::autocast is the scoped way to use this.
std::shared_ptr<const Policy> exchange_current_policy(std::shared_ptr<const Policy> policy);

/// Nodes made while it lives take no policy (they keep their traced types), whatever policy the
/// caller has in effect: the library's own arithmetic that autocast must not reach, as PyTorch's
/// autocast does not reach it (optimizer updates, gradient norms, loss-scale bookkeeping, sums
/// into a leaf's gradient, data parallel's reductions).
class NoPolicyScope {
 public:
  NoPolicyScope() : previous_(exchange_current_policy(nullptr)) {}
  ~NoPolicyScope() { exchange_current_policy(std::move(previous_)); }
  NoPolicyScope(const NoPolicyScope&) = delete;
  NoPolicyScope& operator=(const NoPolicyScope&) = delete;

 private:
  std::shared_ptr<const Policy> previous_;
};

/// Nodes made while it lives differentiate `forward`: they take its policy, composite and
/// module path, so backward runs at the precision of the forward node (DESIGN.md decision 4).
class BackwardScope {
 public:
  explicit BackwardScope(const Node& forward);
  ~BackwardScope();
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

 private:
  const Node* previous_;
  ModulePathScope path_;
  CallSiteScope site_;
};

/// Every node the roots depend on (as far as the graph is still recorded), in tape order:
/// inputs are made before their readers, so creation order is a topological order.
std::vector<Node*> nodes_in_tape_order(const std::vector<NodePtr>& roots);

/// Host work that a replay of a compiled step would skip but that every call of the step needs:
/// a loss scaler's statistics, a generator's check that nobody reseeded it. Registered while the
/// step is traced (on_each_call); mt::compile runs it after that trace and around every replay.
class StepHook {
 public:
  virtual ~StepHook() = default;
  /// Before each replay: why replaying would no longer do what tracing the step would (state
  /// the trace read was changed outside it), or null. A reason makes the next call trace again.
  virtual const char* stale() const { return nullptr; }
  /// A trace of the step with other argument shapes changed what this hook guards, and the plan
  /// of this hook's trace took up the state that trace left (mt::compile): true where the change
  /// was that trace's own, so that stale() no longer reports it.
  virtual bool take_up() { return false; }
  /// After the trace and after each replay, with copies of the values passed to on_each_call as
  /// that call computed them: buffers of their own, which later replays do not overwrite.
  virtual void ran(const std::vector<std::shared_ptr<Storage>>& values) = 0;
};

/// What mt::compile (runtime/compile.h) is told while it traces a function: every node made,
/// every effect that a replay of the recorded programs would not repeat (a value read on the
/// host, a changed setting), which makes the trace unfit to replay, and the host work a replay
/// must still do. One per thread; null when nothing is being traced.
class TraceObserver {
 public:
  virtual ~TraceObserver() = default;
  virtual void node_made(const NodePtr& node) = 0;
  virtual void side_effect(const char* what) = 0;
  virtual void each_call(std::shared_ptr<StepHook> hook, std::vector<NodePtr> values) = 0;
  /// `owner`'s gradient is about to change: made from (`reads_current`) or without its value.
  virtual void gradient_changing(const std::shared_ptr<TensorImpl>& owner, bool reads_current) = 0;
  /// `target` is about to hold `value` (evaluated) as its own (assign).
  virtual void assigning(const std::shared_ptr<TensorImpl>& target, const NodePtr& value) = 0;
  /// The call leaves `value` (evaluated) as state a handle holds for `anchor` in `role` (an
  /// optimizer's moment of a parameter), in place of what was kept there before.
  virtual void keeping(const std::shared_ptr<const void>& anchor, const std::string& role,
                       const NodePtr& value) = 0;
};
TraceObserver* trace_observer();
/// Installs `observer` for this thread, returning the previous one.
TraceObserver* exchange_trace_observer(TraceObserver* observer);
/// Tells the observer, if any, about an effect a replay would skip.
void note_side_effect(const char* what);
/// Hands `hook` to the step being traced, to run on every call of it (StepHook), with `values`
/// (evaluated by the end of the trace). False, doing nothing, when nothing is being traced: the
/// caller then does the work itself.
bool on_each_call(std::shared_ptr<StepHook> hook, std::vector<NodePtr> values = {});
/// Tells the observer, if any, that `owner`'s gradient is about to change (zero_grad, set_grad,
/// backward's accumulation): a replay leaves each gradient where the trace left it.
void note_gradient_change(const std::shared_ptr<TensorImpl>& owner, bool reads_current);
/// Tells the observer, if any, that `target` is about to hold `value` (assign): a replay repeats
/// that only for a value the call computes, into the tensor the trace assigned.
void note_assignment(const std::shared_ptr<TensorImpl>& target, const NodePtr& value);
/// Tells the observer, if any, that `value` is now the state kept for `anchor` in `role`, held by
/// a handle that replaces the old one rather than assign() it (an optimizer's moment of a
/// parameter, a generator's offset): mt::compile hands such state from a plan of one argument
/// shape to another's by that name. The last value a call keeps under a name is its state.
void note_kept_state(const std::shared_ptr<const void>& anchor, const std::string& role,
                     const NodePtr& value);

/// Tells the observer, if any, that the step read a module's train()/eval() setting: a replay
/// repeats what the trace did under it, so a call that finds it otherwise traces again.
/// Module::is_training calls it.
void note_training_read(const std::shared_ptr<const bool>& setting);

/// The most bytes of stored values that the compiled program evaluating `outputs` would keep
/// alive at once under its memory plan (the peak_bytes execution_stats() reports once it runs;
/// inputs and persistent values not included). Plans without running or compiling anything;
/// 0 when nothing is pending. Provided by the runtime layer, like evaluate().
int64_t planned_peak_bytes(const std::vector<NodePtr>& outputs);

/// Computes `value` for every node in `outputs` (and what they need), and the values of the
/// assignments Tensor::assign_later left pending. Provided by the runtime layer, which owns the
/// executors; the DSL only asks.
void evaluate(const std::vector<NodePtr>& outputs);
/// evaluate() for a training step's update, whose values nothing reads at once
/// (Optimizer::step): with async_evaluation() on (runtime/device.h), the CPU back end may queue
/// its arithmetic and return. Elsewhere the same as evaluate(): an evaluation read at once
/// (item(), to_vector(), mt::compile's arguments) would only wait for the stream.
void evaluate_queued(const std::vector<NodePtr>& outputs);

/// The values of the pending Tensor::assign_later calls of this thread, which every evaluation
/// computes too; settle_deferred_assignments() then makes each assigned tensor a leaf holding
/// its value (as assign() does) and drops the settled ones from the list.
std::vector<NodePtr> deferred_assignment_values();
void settle_deferred_assignments();
/// After an evaluation that included them failed: each pending assignment whose value
/// `compute` (an evaluation of it alone) computes settles, as settle_deferred_assignments()
/// would; the others are undone, each tensor keeping the value it had before assign_later. The
/// list is empty afterwards.
void recover_deferred_assignments(const std::function<void(const NodePtr&)>& compute);

}  // namespace mixtape
