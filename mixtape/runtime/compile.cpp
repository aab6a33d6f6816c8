// mixtape/runtime/compile.cpp -- mt::compile: records the evaluations of a traced step, plans how a
// replay binds their inputs and outputs, and replays them.
#include "mixtape/runtime/compile.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "mixtape/dsl/activation_checkpointing.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/log.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/precision_policy/policy.h"
#include "mixtape/runtime/cpu_executor.h"
#include "mixtape/runtime/cuda_executor.h"
#include "mixtape/runtime/cuda_values.h"
#include "mixtape/runtime/step_plan.h"

namespace mixtape {
namespace {

constexpr std::pair<int, int> kUndefined{-1, -1};

// State a call leaves, named by whose it is: a tensor assign() gave it (the tensor, `role`
// empty), or a handle kept for `anchor` in `role` (note_kept_state: an optimizer's moment of a
// parameter, a generator's offset).
struct KeptState {
  std::weak_ptr<const void> anchor;
  std::string role;
  std::pair<int, int> at;  // where the call stored it
  // Its name, while the anchor lives: an address is one object's while it lives.
  using Key = std::pair<const void*, std::string>;
  Key key() const { return {anchor.lock().get(), role}; }
};

struct Trace {
  std::vector<StoragePtr> args;
  std::vector<Evaluation> evals;
  std::vector<std::pair<int, int>> results;  // (evaluation, stored index) of each result
  std::vector<Hook> hooks;
  std::vector<GradientSlot> gradients;         // each gradient the call changed, in order of change
  std::vector<const TensorImpl*> assigned_to;  // each tensor assign gave a value, in order
  std::vector<KeptState> kept;                 // the state it left, by whose it is
  std::string unfit;                           // why no trace of this call can be replayed
};

// Gives back what evaluate() would have dropped at once had no trace kept the graph.
void release(Trace& trace) {
  for (Evaluation& e : trace.evals) release_graph(e.pending_raw);
}

class Recorder final : public TraceObserver {
 public:
  void node_made(const NodePtr& node) override {
    made.push_back(node);
    made_here.insert(node.get());
  }
  void side_effect(const char* what) override {
    if (trace.unfit.empty()) trace.unfit = what;
  }
  void each_call(std::shared_ptr<StepHook> hook, std::vector<NodePtr> values) override {
    if (!hook) fail("compile: on_each_call got no hook");
    for (const NodePtr& node : values)
      if (!node) fail("compile: on_each_call got an undefined value");
    trace.hooks.push_back({std::move(hook), std::move(values)});
  }
  void gradient_changing(const std::shared_ptr<TensorImpl>& owner, bool reads_current) override {
    for (const GradientSlot& slot : trace.gradients)
      if (!slot.owner.owner_before(owner) && !owner.owner_before(slot.owner))
        return;  // only the first change tells what the call needs of the gradient it found
    using Start = GradientSlot::Start;
    GradientSlot& slot = trace.gradients.emplace_back();
    slot.owner = owner;
    slot.start = !reads_current ? Start::replaced
                 : owner->grad  ? Start::added_to
                                : Start::made_from_nothing;
    if (slot.start == Start::added_to && owner->grad->evaluated()) {
      slot.found = owner->grad.get();
      slot.found_buffer = owner->grad->value.get();
    }
  }
  void assigning(const std::shared_ptr<TensorImpl>& target, const NodePtr& value) override {
    assigned.push_back(value);
    trace.assigned_to.push_back(target.get());
    keep({target, "", kUndefined}, value);
  }
  void keeping(const std::shared_ptr<const void>& anchor, const std::string& role,
               const NodePtr& value) override {
    keep({anchor, role, kUndefined}, value);
  }
  // The last value kept under a name is the state the call leaves there.
  void keep(KeptState&& state, const NodePtr& value) {
    auto [at, added] = kept_index.try_emplace(state.key(), trace.kept.size());
    if (!added) {
      kept_values[at->second] = value;
      return;
    }
    trace.kept.push_back(std::move(state));
    kept_values.push_back(value);
  }
  std::vector<std::weak_ptr<Node>> made;
  std::vector<NodePtr> assigned;                // each value a tensor took with assign, in order
  std::vector<NodePtr> kept_values;             // each value of trace.kept
  std::map<KeptState::Key, size_t> kept_index;  // where trace.kept has each name
  std::unordered_set<const Node*> made_here;    // made's nodes: an address alive before the call
                                                // is none of them
  Trace trace;
};

thread_local Recorder* recorder = nullptr;

// Nodes the function made that are still pending and that something outside the trace holds
// (its results, a loss scaler's next scale): evaluated at the end of the trace, so that
// everything a call hands to the next one or to the user is a stored buffer.
std::vector<Tensor> leftovers(const Recorder& rec) {
  std::vector<NodePtr> alive;
  for (const std::weak_ptr<Node>& weak : rec.made)
    if (NodePtr node = weak.lock()) alive.push_back(std::move(node));
  std::unordered_map<const Node*, long> readers;
  for (const NodePtr& node : alive)
    for (const NodePtr& input : node->inputs) ++readers[input.get()];
  std::unordered_set<const Node*> ran;
  for (const Evaluation& e : rec.trace.evals)
    ran.insert(e.pending_raw.begin(), e.pending_raw.end());
  std::vector<Tensor> out;
  for (const NodePtr& node : alive) {
    auto found = readers.find(node.get());
    long inside = found == readers.end() ? 0 : found->second;
    if (!node->evaluated() && !ran.count(node.get()) && node.use_count() - 1 > inside)
      out.emplace_back(node);
  }
  // What host work is handed must be stored, even a value an evaluation kept in registers.
  std::unordered_set<const Node*> taken;
  for (const Tensor& t : out) taken.insert(t.node().get());
  for (const Hook& h : rec.trace.hooks)
    for (const NodePtr& node : h.values)
      if (!node->evaluated() && taken.insert(node.get()).second) out.emplace_back(node);
  return out;
}

// (evaluation, stored index) of the first evaluation of the trace that stored `node`, else
// kUndefined.
std::pair<int, int> stored_place(const Trace& trace, const Node* node) {
  for (size_t e = 0; e < trace.evals.size(); ++e) {
    const std::vector<Node*>& stored = trace.evals[e].executed.sig.stored;
    for (size_t j = 0; j < stored.size(); ++j)
      if (stored[j] == node) return {static_cast<int>(e), static_cast<int>(j)};
  }
  return kUndefined;
}

StoragePtr value_of(const Tensor& t) { return t.defined() ? t.node()->value : nullptr; }

Trace trace_call(const std::vector<Tensor>& args, const StepReplayer::Function& fn,
                 std::vector<Tensor>& results) {
  Recorder rec;
  for (const Tensor& a : args) rec.trace.args.push_back(value_of(a));
  struct Install {
    explicit Install(Recorder* r) : previous(exchange_trace_observer(r)) { recorder = r; }
    ~Install() {
      exchange_trace_observer(previous);
      recorder = nullptr;
    }
    TraceObserver* previous;
  };
  {
    Install install(&rec);
    try {
      results = fn(args);
      eval(leftovers(rec));  // the results among them, in one evaluation
    } catch (...) {
      release(rec.trace);
      throw;
    }
  }
  Trace& trace = rec.trace;
  try {
    run_hooks(trace.hooks);
  } catch (...) {
    release(trace);
    throw;
  }
  for (size_t i = 0; i < results.size(); ++i) {
    std::pair<int, int> at = kUndefined;
    if (results[i].defined()) {
      at = stored_place(trace, results[i].node().get());
      if (at == kUndefined && trace.unfit.empty())
        trace.unfit = "returns a value it did not compute (an argument, or a value made before it)";
      // A replay's results are values without a graph: a forward compiled alone, whose result
      // a backward outside differentiates, would lose its gradients from the first replay on.
      if (results[i].requires_grad() && trace.gradients.empty() && trace.unfit.empty())
        trace.unfit =
            "returns a value that requires grad and runs no backward (a replay's results have no "
            "graph for a backward outside it; compile the whole step)";
    }
    trace.results.push_back(at);
  }
  // A replay hands a tensor its new value by writing that value's buffer again: a value that no
  // evaluation of the call stored (the weights before the optimizer's update, an argument) would
  // keep the trace's, and so would a returned one (a replay returns each result in a fresh
  // buffer).
  // ... and into the tensor the trace assigned, which an argument is not from call to call.
  for (const TensorImpl* target : trace.assigned_to)
    for (const Tensor& a : args)
      if (trace.unfit.empty() && a.defined() && a.node()->grad_owner.lock().get() == target)
        trace.unfit =
            "assigns to a tensor passed as an argument (a replay would write the tensor the "
            "trace assigned; capture the tensor instead)";
  for (size_t k = 0; k < trace.kept.size(); ++k)
    trace.kept[k].at = stored_place(trace, rec.kept_values[k].get());
  for (const NodePtr& value : rec.assigned) {
    if (!trace.unfit.empty()) break;
    const std::pair<int, int> at = stored_place(trace, value.get());
    if (at == kUndefined)
      trace.unfit =
          "assigns a tensor a value it did not compute (a weight or an argument; assign a copy, "
          "such as w * 1.0, to have replays repeat it)";
    else if (std::find(trace.results.begin(), trace.results.end(), at) != trace.results.end())
      trace.unfit =
          "assigns a tensor a value it also returns (assign or return a copy, such as loss * 1.0, "
          "to have replays repeat it)";
  }
  // Where each gradient whose tensor is still alive was left.
  std::erase_if(trace.gradients, [](const GradientSlot& slot) { return slot.owner.expired(); });
  for (GradientSlot& slot : trace.gradients) {
    std::shared_ptr<TensorImpl> owner = slot.owner.lock();
    for (size_t i = 0; i < args.size() && slot.owner_arg < 0; ++i)
      if (args[i].defined() && args[i].node()->grad_owner.lock() == owner)
        slot.owner_arg = static_cast<int>(i);
    const NodePtr& left = owner->grad;
    if (!left) continue;
    slot.at = stored_place(trace, left.get());
    for (size_t i = 0; i < args.size() && slot.at == kUndefined && slot.arg < 0; ++i)
      if (args[i].defined() && args[i].node() == left) slot.arg = static_cast<int>(i);
    if (slot.at == kUndefined && slot.arg < 0 && trace.unfit.empty())
      trace.unfit =
          "leaves a gradient it did not compute (set_grad with a value made before the call, or "
          "from host data)";
  }
  return std::move(rec.trace);
}

// Whether two consecutive traces made the same evaluations of the same graphs with the same
// constants, returned from the same places and registered as much host work; else why not.
bool same_shape(const Trace& a, const Trace& b, std::string& why) {
  if (a.evals.size() != b.evals.size()) {
    why =
        fmt::format("consecutive calls made {} and {} evaluations", a.evals.size(), b.evals.size());
    return false;
  }
  if (a.results != b.results) {
    why = "consecutive calls returned values from different places";
    return false;
  }
  if (a.gradients != b.gradients) {
    why = "consecutive calls left gradients in different places or of different tensors";
    return false;
  }
  if (a.assigned_to != b.assigned_to) {
    why = "consecutive calls assigned values to different tensors";
    return false;
  }
  if (a.hooks.size() != b.hooks.size()) {
    why = fmt::format("consecutive calls registered {} and {} pieces of host work", a.hooks.size(),
                      b.hooks.size());
    return false;
  }
  for (size_t e = 0; e < b.evals.size(); ++e) {
    if (!(a.evals[e].executed.sig.hash == b.evals[e].executed.sig.hash) ||
        a.evals[e].device != b.evals[e].device) {
      why = fmt::format("evaluation {} had a different graph in consecutive calls", e);
      return false;
    }
    if (a.evals[e].fills != b.evals[e].fills) {
      why = fmt::format(
          "evaluation {} used different constants in consecutive calls (a C++ value that "
          "changes between calls, such as a learning rate computed inside the function)",
          e);
      return false;
    }
  }
  return true;
}

using Place = std::pair<int, int>;

// Maps each buffer a trace stores to where it is first stored. A buffer stored twice by one
// evaluation is a value and its view; by two, it cannot be (false).
bool index_outputs(const Trace& t, std::unordered_map<const Storage*, Place>& at) {
  for (size_t e = 0; e < t.evals.size(); ++e)
    for (size_t j = 0; j < t.evals[e].outputs.size(); ++j) {
      auto [it, added] = at.emplace(t.evals[e].outputs[j].get(), Place(e, j));
      if (!added && it->second.first != static_cast<int>(e)) return false;
    }
  return true;
}

// Plans the evaluations of calls like `b` (previous call `a`): where each reads its inputs from
// and which stored values share a buffer. Every method returns false with the reason in `why`
// when the traces do not show it.
class EvaluationPlanner {
 public:
  // `by_owner`: read the parameters and the gradients the step adds to through their tensors
  // (mt::compile's replays follow what happens to them outside the step); else a parameter
  // that is the same buffer in both traces is a constant, and a gradient is state the step
  // carries (an AOT artifact has no tensors to read through).
  EvaluationPlanner(const Trace& a, const Trace& b, bool by_owner, std::string& why)
      : a_(a), b_(b), by_owner_(by_owner), why_(why) {}

  // Indexes the two traces' buffers; false when one buffer holds two values.
  bool index() {
    if (!index_outputs(a_, out_a_) || !index_outputs(b_, out_b_)) {
      why_ = "two values the step stores share one buffer";
      return false;
    }
    for (size_t i = 0; i < b_.args.size(); ++i)
      if (b_.args[i]) arg_of_.emplace(b_.args[i].get(), static_cast<int>(i));
    results_.insert(b_.results.begin(), b_.results.end());
    return true;
  }

  // Evaluation e's input bindings and buffer sharing (its graph is adopted later).
  bool plan(size_t e, PlannedEvaluation& planned) {
    const Evaluation& eb = b_.evals[e];
    for (size_t x = 0; x < eb.inputs.size(); ++x) {
      Binding binding;
      if (!bind(e, x, binding)) return false;
      planned.inputs.push_back(std::move(binding));
    }
    for (const StoragePtr& output : eb.outputs)
      if (std::find(eb.inputs.begin(), eb.inputs.end(), output) != eb.inputs.end()) {
        why_ = "a stored value shares its buffer with an input of its evaluation";
        return false;
      }
    return share(e, planned.shares_with);
  }

 private:
  // Where input x of evaluation e comes from: an argument, a value stored earlier in the call or
  // by the previous one, or a constant.
  bool bind(size_t e, size_t x, Binding& binding) {
    const Evaluation& eb = b_.evals[e];
    const Evaluation& ea = a_.evals[e];
    const Storage* now = eb.inputs[x].get();
    const Storage* before = ea.inputs[x].get();
    const Node& external = *eb.executed.sig.externals[x];
    Place source{-1, -1};
    bool same_call = false;
    const int gradient = by_owner_ ? gradient_read(e, x) : -1;
    if (gradient == kOtherRole) {
      why_ = fmt::format(
          "evaluation {} reads a gradient it adds to as something else too (another tensor's "
          "gradient, a parameter, an argument: set or pass a copy)",
          e);
      return false;
    }
    if (gradient >= 0) {
      binding.gradient = gradient;
      binding.owner_dtype = eb.inputs[x]->dtype;
    } else if (auto arg = arg_of_.find(now); arg != arg_of_.end()) {
      if (before != a_.args[arg->second].get()) {
        why_ = fmt::format("evaluation {} reads argument {} in one call but not the other", e,
                           arg->second);
        return false;
      }
      binding.arg = arg->second;
      if (now == before) binding.pinned_arg = now;
    } else if (auto own = out_b_.find(now); own != out_b_.end()) {
      // Stored earlier in the same call.
      same_call = true;
      source = own->second;
      if (source.first >= static_cast<int>(e) ||
          a_.evals[source.first].outputs[source.second].get() != before) {
        why_ = fmt::format("evaluation {} reads {} from different places in consecutive calls", e,
                           describe(external));
        return false;
      }
    } else if (auto carried = out_a_.find(now); carried != out_a_.end()) {
      // Stored by the previous call. When an earlier evaluation of this call replaces it
      // first, the replay hands this one the value it replaced.
      source = carried->second;
      binding.at_call_start = source.first < static_cast<int>(e);
    } else if (std::shared_ptr<TensorImpl> owner = eb.parameters[x].lock();
               owner && owner == ea.parameters[x].lock() && (by_owner_ || now != before)) {
      // The same buffer in both calls may still be replaced outside before the next (the
      // optimizer's step after the last of several accumulating calls).
      binding.parameter = owner;
      binding.owner_dtype = eb.inputs[x]->dtype;
    } else if (now == before) {
      binding.object = eb.inputs[x];  // the same buffer in both calls: a constant
    } else {
      why_ = fmt::format(
          "evaluation {} reads a new {} on every call that is not an argument (a tensor made "
          "from host data inside the function?)",
          e, describe(external));
      return false;
    }
    if (source.first >= 0 && results_.count(source)) {
      if (!same_call) {
        why_ = "a value the function returns is also state the next call reads (return a copy)";
        return false;
      }
      // Returned, and read by a later evaluation of the call (the loss of logits the step
      // returns too): the replay hands it the call's own result.
      binding.result = static_cast<int>(std::find(b_.results.begin(), b_.results.end(), source) -
                                        b_.results.begin());
      return true;
    }
    if (source.first >= 0) binding.object = b_.evals[source.first].outputs[source.second];
    // State the previous call left (or a constant): what the earlier call read is the value
    // before it. A value stored earlier in the same call is no state.
    if (binding.object && !same_call) binding.first_value = ea.inputs[x];
    return true;
  }

  // Per stored value of evaluation e, the first one whose buffer it shares, or -1.
  bool share(size_t e, std::vector<int>& shares_with) {
    const Evaluation& eb = b_.evals[e];
    shares_with.assign(eb.outputs.size(), -1);
    for (size_t j = 0; j < eb.outputs.size(); ++j) {
      int first = out_b_.at(eb.outputs[j].get()).second;
      if (first == static_cast<int>(j)) continue;
      // A returned value must be a buffer of its own (a replay hands out fresh ones), and so
      // must the view: then both are the same fresh buffer, as in the trace.
      if (results_.count(Place(e, j)) != results_.count(Place(e, first))) {
        why_ =
            "a value the function returns shares its buffer with state the step keeps (return "
            "a copy)";
        return false;
      }
      shares_with[j] = first;
    }
    return true;
  }

  // The index of the gradient slot whose gradient input x of evaluation e is in both traces:
  // one the step found and added to. kOtherRole where its buffer is such a gradient read in
  // another role as well (a second slot's gradient, another node on the buffer, a parameter or
  // an argument), which a replay reading each role through its own owner would tell apart
  // only in the calls where they differ; else -1.
  static constexpr int kOtherRole = -2;
  int gradient_read(size_t e, size_t x) const {
    const Evaluation& eb = b_.evals[e];
    const Storage* now = eb.inputs[x].get();
    int slot = -1, slots = 0;
    for (size_t g = 0; g < b_.gradients.size(); ++g)
      if (b_.gradients[g].found_buffer == now) {
        slot = static_cast<int>(g);
        ++slots;
      }
    if (slots == 0) return -1;
    const Node* external = eb.executed.sig.externals[x];
    const Evaluation& ea = a_.evals[e];
    if (slots > 1 || b_.gradients[slot].found != external ||
        a_.gradients[slot].found != ea.executed.sig.externals[x] || arg_of_.count(now) ||
        !eb.parameters[x].expired())
      return kOtherRole;
    return slot;
  }

  const Trace& a_;
  const Trace& b_;
  const bool by_owner_;
  std::string& why_;
  std::unordered_map<const Storage*, Place> out_a_, out_b_;
  std::unordered_map<const Storage*, int> arg_of_;
  std::set<Place> results_;
};

// Host work reads its values from the stored buffers that replays update in place; a returned
// value is a fresh buffer on each replay instead, so no hook may read one.
bool hooks_read_no_result(const Trace& b, std::string& why) {
  std::unordered_set<const Node*> returned;
  for (const Place& r : b.results)
    if (r != kUndefined) returned.insert(b.evals[r.first].executed.sig.stored[r.second]);
  for (const Hook& h : b.hooks)
    for (const NodePtr& node : h.values)
      if (returned.count(node.get())) {
        why = "a value the function returns is also handed to host work that runs every call";
        return false;
      }
  return true;
}

// Whether every node that two evaluations of the call compute (a fill inlined in both, or a
// value one evaluated before another needed it unstored: a loss read before backward(), whose
// pass computes the forward values again) reads only nodes both compute: a plan points an
// evaluation's external inputs at private leaves, and one node cannot read two evaluations'
// leaves at once.
bool each_node_in_one_evaluation(const Trace& b, std::string& why) {
  std::vector<std::unordered_set<const Node*>> computed(b.evals.size());
  std::unordered_map<const Node*, std::vector<size_t>> evaluations_of;
  for (size_t e = 0; e < b.evals.size(); ++e)
    for (const Node* node : b.evals[e].pending_raw) {
      computed[e].insert(node);
      evaluations_of[node].push_back(e);
    }
  for (const auto& [node, evaluations] : evaluations_of) {
    if (evaluations.size() < 2) continue;
    for (const NodePtr& input : node->inputs)
      for (size_t e : evaluations)
        if (!computed[e].count(input.get())) {
          why = fmt::format(
              "two evaluations of the call compute {} from values only one of them has (a value "
              "evaluated before backward() or the optimizer's step, which computes it again: "
              "read it after them)",
              describe(*node));
          return false;
        }
  }
  return true;
}

// Gives evaluation e of the plan the second trace's graph. Its external inputs become private
// leaves, so that binding a replay's inputs never touches a node the user may still hold.
void adopt_graph(Plan& plan, size_t e, Evaluation&& eval) {
  PlannedEvaluation& planned = plan.evals[e];
  planned.eval = std::move(eval);
  Signature& sig = planned.eval.executed.sig;
  std::unordered_map<const Node*, NodePtr> private_leaf;
  for (size_t x = 0; x < sig.externals.size(); ++x) {
    Node* external = sig.externals[x];
    auto leaf = std::make_shared<Node>(*external);
    leaf->inputs.clear();
    leaf->value = planned.inputs[x].object;
    // A parameter's, gradient's or result's value is read afresh each call: the plan keeps no old
    // weights, gradients or results alive.
    if (planned.inputs[x].through_parameter() || planned.inputs[x].through_gradient() ||
        planned.inputs[x].through_result())
      planned.eval.inputs[x].reset();
    private_leaf.emplace(external, leaf);
    sig.externals[x] = leaf.get();  // Signature::ref() maps the leaf from here on
    planned.leaves.push_back(std::move(leaf));
  }
  for (Node* node : planned.eval.pending_raw)
    for (NodePtr& input : node->inputs)
      if (auto found = private_leaf.find(input.get()); found != private_leaf.end())
        input = found->second;
  planned.result_slot.assign(sig.stored.size(), -1);
  for (size_t r = 0; r < plan.results.size(); ++r)
    if (plan.results[r].first == static_cast<int>(e))
      planned.result_slot[plan.results[r].second] = static_cast<int>(r);
}

// The replay plan for calls like `b`, whose previous call was `a`; empty with the reason when
// the two do not show how to bind every input.
// `unpinned_arg` >= 0: no plan where that argument would be pinned (after such a plan was
// dropped for another buffer there, a loop passing each batch to several calls made and dropped
// one per batch; waiting for a pair of calls with two buffers makes one that binds it for good).
std::unique_ptr<Plan> make_plan(Trace& a, Trace& b, bool by_owner, std::string& why,
                                int unpinned_arg = -1) {
  if (!same_shape(a, b, why)) return nullptr;
  EvaluationPlanner planner(a, b, by_owner, why);
  if (!planner.index()) return nullptr;
  auto plan = std::make_unique<Plan>();
  plan->results = b.results;
  for (size_t e = 0; e < b.evals.size(); ++e) {
    PlannedEvaluation planned;
    if (!planner.plan(e, planned)) return nullptr;
    if (std::any_of(planned.inputs.begin(), planned.inputs.end(),
                    [&](const Binding& in) { return in.pinned_arg && in.arg == unpinned_arg; })) {
      why = "waiting for a call with another argument tensor than the last two passed";
      return nullptr;
    }
    plan->evals.push_back(std::move(planned));
  }
  if (!hooks_read_no_result(b, why) || !each_node_in_one_evaluation(b, why)) return nullptr;
  for (size_t e = 0; e < b.evals.size(); ++e) adopt_graph(*plan, e, std::move(b.evals[e]));
  b.evals.clear();
  plan->hooks = std::move(b.hooks);
  plan->gradients = std::move(b.gradients);
  for (GradientSlot& slot : plan->gradients) {
    slot.found = nullptr;
    slot.found_buffer = nullptr;
  }
  return plan;
}

// The trace left each gradient in a node of the plan's graph, which replays give new values: its
// owner gets a leaf of its own on the same buffer, which hand_back can tell apart. (A returned
// gradient is a fresh value on every replay: it stays the returned tensor.)
void hand_over_gradients(Plan& plan) {
  for (GradientSlot& slot : plan.gradients) {
    std::shared_ptr<TensorImpl> owner = slot.owner.lock();
    if (!owner || slot.at == kUndefined ||
        plan.evals[slot.at.first].result_slot[slot.at.second] >= 0)
      continue;
    const Node* stored = plan.evals[slot.at.first].eval.executed.sig.stored[slot.at.second];
    if (owner->grad.get() != stored) continue;
    owner->grad = leaf_like(*stored, stored->value).node();
    slot.handed = owner->grad;
  }
}

// Called once the previous trace is gone, so that the counts are those of the steady state.
// The gradients the step leaves are left out: the replay hands each back to its owner, so a
// move off one (zero_grad) loses nothing; where the next call reads one (accumulation), it
// reads it through its tensor (Binding::gradient), or in an AOT plan its binding watches it.
void watch(Plan& plan) {
  std::unordered_set<const Storage*> handed_back;
  for (const GradientSlot& slot : plan.gradients)
    if (slot.at != kUndefined)
      handed_back.insert(plan.evals[slot.at.first].eval.outputs[slot.at.second].get());
  std::unordered_set<const Storage*> seen;
  auto add = [&](const StoragePtr& object) {
    if (object && seen.insert(object.get()).second) plan.watched.push_back({object});
  };
  for (const PlannedEvaluation& planned : plan.evals) {
    for (const Binding& binding : planned.inputs)
      if (binding.first_value || !handed_back.count(binding.object.get())) add(binding.object);
    for (size_t j = 0; j < planned.eval.outputs.size(); ++j) {
      if (planned.result_slot[j] >= 0) continue;
      // Only what a replay writes (carried state is among it): a constant it reads stays shared.
      plan.kept.insert(planned.eval.outputs[j].get());
      if (!handed_back.count(planned.eval.outputs[j].get())) add(planned.eval.outputs[j]);
    }
  }
  for (Plan::Watched& w : plan.watched) {
    w.holders = w.object.use_count();
    w.moves_off = w.object->moves_off.load(std::memory_order_relaxed);
  }
}

// Why a replay cannot read the gradient `binding` adds to through its tensor, or null.
const char* replaced_gradient(const Plan& plan, const Binding& binding, const Node& leaf,
                              const std::vector<Tensor>& args) {
  const GradientSlot& slot = plan.gradients[static_cast<size_t>(binding.gradient)];
  std::shared_ptr<TensorImpl> owner = owner_of(slot, args);
  if (!owner) return "a tensor whose gradient the step adds to is gone";
  const Node* grad = owner->grad.get();
  if (!grad) return nullptr;  // the replay adds to -0
  if (!grad->evaluated() || grad->shape != leaf.shape || grad->value->dtype != binding.owner_dtype)
    return "a gradient the step adds to was given another shape or dtype, or a value not yet "
           "computed, outside it since the last call";
  // The buffer the step leaves this gradient in is read before the replay writes it again; any
  // other buffer it updates may be written in place first.
  const bool own = slot.at != kUndefined &&
                   plan.evals[slot.at.first].eval.outputs[slot.at.second] == grad->value;
  if (!own && plan.kept.count(grad->value.get()))
    return "a gradient the step adds to shares a buffer with state the step updates in place";
  return nullptr;
}

// Whether `b` binds a pinned argument that this call passes another buffer for.
bool changed_pinned_arg(const Binding& b, const std::vector<Tensor>& args) {
  return b.pinned_arg && args[static_cast<size_t>(b.arg)].node()->value.get() != b.pinned_arg;
}

// The argument a plan pinned that this call passes another buffer for, or -1.
int changed_pinned_arg(const Plan& plan, const std::vector<Tensor>& args) {
  for (const PlannedEvaluation& planned : plan.evals)
    for (const Binding& b : planned.inputs)
      if (changed_pinned_arg(b, args)) return b.arg;
  return -1;
}

// Why a plan is dropped when a call passes another buffer for a pinned argument.
constexpr const char* kPinnedArgumentChanged =
    "an argument both traced calls passed as one tensor (which the function may also read "
    "captured) is another tensor now";

// Why a plan is dropped when a buffer it watches was replaced or dropped.
constexpr const char* kWatchedBufferReplaced =
    "a buffer the step reads or updates was replaced or dropped outside it since the last call "
    "(assign, load_state, zero_grad outside the function, a generator reseeded or drawn from)";

// Why a plan was dropped, for a buffer it watches replaced, where calls of other argument
// signatures traced in between: their traces replace the state buffers (plans update them in
// place), which kWatchedBufferReplaced would blame on the caller.
constexpr const char* kOtherSignatureTraced =
    "a trace of the step with other argument shapes or dtypes (a short last batch?) replaced the "
    "state buffers it updates, and not every one could be taken up from that trace (state "
    "without a name, or changed outside the step since)";

// Whether something outside replaced or dropped a buffer the plan watches.
bool replaced(const Plan::Watched& w) {
  return w.object.use_count() < w.holders ||
         w.object->moves_off.load(std::memory_order_relaxed) != w.moves_off;
}

// Whether the state the plan updates is as its last call left it: no buffer it watches replaced,
// no host work guarding state stale.
bool state_unchanged(const Plan& plan) {
  return std::none_of(plan.watched.begin(), plan.watched.end(), replaced) &&
         std::none_of(plan.hooks.begin(), plan.hooks.end(),
                      [](const Hook& h) { return h.hook->stale() != nullptr; });
}

const char* replaced_state(const Plan& plan, const std::vector<Tensor>& args) {
  if (std::any_of(plan.watched.begin(), plan.watched.end(), replaced))
    return kWatchedBufferReplaced;
  for (const PlannedEvaluation& planned : plan.evals)
    for (size_t x = 0; x < planned.inputs.size(); ++x) {
      if (changed_pinned_arg(planned.inputs[x], args)) return kPinnedArgumentChanged;
      if (planned.inputs[x].through_gradient())
        if (const char* why = replaced_gradient(plan, planned.inputs[x], *planned.leaves[x], args))
          return why;
      if (!planned.inputs[x].through_parameter()) continue;
      std::shared_ptr<TensorImpl> owner = planned.inputs[x].parameter.lock();
      const Node* value = owner ? owner->node.get() : nullptr;
      const Node& leaf = *planned.leaves[x];
      if (!value || !value->evaluated() || value->shape != leaf.shape ||
          value->value->dtype != planned.inputs[x].owner_dtype ||
          value->requires_grad != leaf.requires_grad)
        return "a parameter the step reads was dropped, frozen or unfrozen, or given another "
               "shape or dtype, or a value not yet computed, outside it since the last call";
      if (plan.kept.count(value->value.get()))
        return "a parameter the step reads shares a buffer with state the step updates in place "
               "(assigned from it outside the step)";
    }
  for (const GradientSlot& slot : plan.gradients)
    if (std::shared_ptr<TensorImpl> owner = owner_of(slot, args);
        owner && owner->grad && slot.start == GradientSlot::Start::made_from_nothing)
      return "a gradient the step makes afresh was left from the last call, for the step to add "
             "to (gradient accumulation)";
  for (const Hook& h : plan.hooks)
    if (const char* why = h.hook->stale()) return why;
  return nullptr;
}

struct Entry {
  std::unique_ptr<Trace> previous;
  std::unique_ptr<Plan> plan;
  uint64_t setting_edits =
      0;                    // its key's graph_setting_edits(): once they change, never asked again
  bool collective = false;  // its last trace made collectives (a data-parallel step)
  int unpinned_arg = -1;    // its plan was dropped for another buffer of this pinned argument
  int64_t last_call = 0;    // the number of its latest call (CompileStats::calls)
  std::vector<KeptState> kept;  // the state its plan's second trace left (Trace::kept)
  // The call whose trace (of another signature) began with this plan's state as its last call
  // left it: only what that trace leaves may the plan take up, as the changes it replaces are
  // that trace's own.
  int64_t clean_at = -1;
};

// What the latest trace left: the buffer of each state it left under a name, with its holders
// and moves off once the call ended. A plan of other argument shapes whose state that trace
// replaced takes it up from here (take_up_state_left) rather than be made again from two more
// traces.
struct StateLeft {
  struct Stored {
    std::weak_ptr<Storage> buffer;
    long holders = 0;
    uint32_t moves_off = 0;
    // The buffer, where nothing let go of it or moved off it since the call ended (an assign or
    // load_state outside); else null.
    StoragePtr current() const {
      StoragePtr now = buffer.lock();
      if (!now || now.use_count() - 1 < holders ||
          now->moves_off.load(std::memory_order_relaxed) != moves_off)
        return nullptr;
      return now;
    }
  };
  std::map<KeptState::Key, Stored> kept;  // the buffer it left under each name

  explicit StateLeft(const Trace& trace) {
    for (const KeptState& state : trace.kept)
      kept.emplace(state.key(), Stored{state.at == kUndefined
                                           ? nullptr
                                           : trace.evals[state.at.first].outputs[state.at.second]});
  }
  // Counts the holders and moves off of those buffers as the call ends.
  void settle() {
    for (auto& [name, stored] : kept)
      if (StoragePtr buffer = stored.buffer.lock()) {
        stored.holders = buffer.use_count() - 1;
        stored.moves_off = buffer->moves_off.load(std::memory_order_relaxed);
      }
  }
  // Whether nothing outside let go of or moved off any state it left under a name since.
  bool all_current() const {
    return std::all_of(kept.begin(), kept.end(),
                       [](const auto& name) { return name.second.current() != nullptr; });
  }
};

// The buffer `left` holds under the name of the plan's state `mine` (null where something
// outside let go of it or moved off it since: an assign, a load_state); nullopt where `left` kept
// nothing under that name.
std::optional<StoragePtr> successor(const KeptState& mine, const StateLeft& left) {
  // The anchor lived through both traces (it lives now and did at the plan's trace), so the same
  // address in the other's name is the same anchor.
  const KeptState::Key key = mine.key();
  auto theirs = left.kept.find(key);
  if (!key.first || theirs == left.kept.end()) return std::nullopt;
  return theirs->second.current();
}

// Gives the plan the buffers `left` holds in the roles of the state buffers it watches that a
// trace of other argument shapes replaced, so that it updates those in place from now on. False,
// changing nothing, where the successor of one cannot be told.
bool take_up_state_left(Entry& entry, const StateLeft& left) {
  Plan& plan = *entry.plan;
  // Every buffer holding state the plan's trace left under a name that the other trace left too,
  // whether or not it looks replaced (a handle the other trace replaced may have lost its holder
  // while that trace took one: it read the buffer). A buffer under several names (the counts
  // that parameters share) needs one successor for all of them, or none.
  std::unordered_map<const Storage*, std::pair<StoragePtr, std::optional<StoragePtr>>> verdict;
  for (const KeptState& mine : entry.kept) {
    if (mine.at == kUndefined) continue;
    const StoragePtr& old = plan.evals[mine.at.first].eval.outputs[mine.at.second];
    std::optional<StoragePtr> next = successor(mine, left);
    if (next && !*next) return false;  // changed outside since that trace
    auto [at, first] = verdict.try_emplace(old.get(), old, next);
    if (!first && at->second.second != next) return false;
  }
  std::unordered_map<const Storage*, StoragePtr> next_of;
  std::unordered_set<const Storage*> taken;
  for (auto& [buffer, entry_verdict] : verdict) {
    auto& [old, next] = entry_verdict;
    if (!next || *next == old) continue;
    if ((*next)->dtype != old->dtype || (*next)->count != old->count ||
        !taken.insert(next->get()).second)
      return false;
    next_of.emplace(buffer, std::move(*next));
  }
  verdict.clear();  // its buffers would count as holders in watch() below
  if (next_of.empty()) return false;
  // What else looks replaced has no name to take it up by (a constant the step reads, replaced
  // outside).
  for (const Plan::Watched& w : plan.watched)
    if (replaced(w) && !next_of.count(w.object.get())) return false;
  // A successor may not be a buffer the plan holds in another role.
  auto other_role = [&](const StoragePtr& buffer) {
    return buffer && taken.count(buffer.get()) && !next_of.count(buffer.get());
  };
  for (const PlannedEvaluation& planned : plan.evals) {
    if (std::any_of(planned.eval.inputs.begin(), planned.eval.inputs.end(), other_role) ||
        std::any_of(planned.eval.outputs.begin(), planned.eval.outputs.end(), other_role))
      return false;
    for (const Binding& binding : planned.inputs)
      if (other_role(binding.object)) return false;
  }
  auto take = [&](StoragePtr& buffer) {
    if (!buffer) return;
    if (auto found = next_of.find(buffer.get()); found != next_of.end()) buffer = found->second;
  };
  for (PlannedEvaluation& planned : plan.evals) {
    for (StoragePtr& input : planned.eval.inputs) take(input);
    for (StoragePtr& output : planned.eval.outputs) take(output);
    for (Binding& binding : planned.inputs) take(binding.object);
    for (const NodePtr& leaf : planned.leaves) take(leaf->value);
    for (Node* node : planned.eval.pending_raw) take(node->value);
    planned.in_place.reset();
  }
  next_of.clear();  // counted by watch() as holders otherwise
  std::unordered_map<const Storage*, long> holders_before;
  for (const Plan::Watched& w : plan.watched) holders_before.emplace(w.object.get(), w.holders);
  const std::vector<Plan::Watched> before = std::move(plan.watched);  // alive for the keys above
  plan.watched.clear();
  plan.kept.clear();
  watch(plan);
  // A buffer it kept keeps the holders counted when the plan was made: a handle taken since
  // may still let go of it.
  for (Plan::Watched& w : plan.watched)
    if (auto found = holders_before.find(w.object.get()); found != holders_before.end())
      w.holders = std::min(w.holders, found->second);
  // Host work guarding state that trace changed (a generator it drew from) follows it; a hook
  // that cannot stays stale, and the plan is dropped.
  for (const Hook& h : plan.hooks)
    if (h.hook->stale()) h.hook->take_up();
  return true;
}

// Whether a call's evaluations made collectives (a data-parallel step's gradient reduction).
bool makes_collectives(const Trace& trace) {
  for (const Evaluation& e : trace.evals)
    for (const Node* node : e.pending_raw)
      if (op_info(node->op).kind == OpKind::Collective) return true;
  return false;
}

// Whether every process replays this call, asked of them all (a collective itself): a traced
// step makes host exchanges that a replay does not (the data-parallel reducer's map of the
// parameters each process reached), so a process tracing (a loss.item() on rank 0 only) beside
// others replaying paired different collectives, and the run failed or waited out its timeout.
bool every_process_replays(bool replay) {
  ProcessGroup* group = process_group();
  if (!group || group->size() == 1) return replay;
  const auto processes = static_cast<size_t>(group->size());
  std::vector<std::byte> all(processes);
  std::vector<int64_t> counts(processes, 1), at(processes);
  for (size_t q = 0; q < processes; ++q) at[q] = static_cast<int64_t>(q);
  const std::byte mine{static_cast<unsigned char>(replay ? 1 : 0)};
  group->all_gather(&mine, 1, all.data(), counts, at);
  return std::all_of(all.begin(), all.end(), [](std::byte b) { return b == std::byte{1}; });
}

// Edits to what makes a step's graph outside its arguments: the policies in use and the modules
// checkpointed. Plans keyed before an edit are never asked for again.
uint64_t graph_setting_edits() { return policy_edits() + checkpoint_edits(); }

std::string signature_key(const std::vector<Tensor>& args) {
  // A data-parallel backward makes another graph under no_sync, and another again when it
  // folds no_sync's local gradients into its reduction: each variant has traces of its own.
  // So does a policy or grad mode the caller sets around the call: a policy is known by its id
  // (mt::autocast(mt::bf16) gives the same object each time) and by the count of edits to
  // policies, as an OverridePolicy given a rule after a trace decides anew, and of checkpointed
  // modules.
  const char* sync = gradient_sync_variant();
  const std::shared_ptr<const Policy>& policy = current_policy();
  std::string key =
      fmt::format("{}{}{}{}/{}.{}{}", device_name(current_device()), eager_mode() ? "/eager" : "",
                  *sync ? "/" : "", sync, policy ? policy->id() : 0, graph_setting_edits(),
                  grad_enabled() ? "" : "/no_grad");
  for (size_t i = 0; i < args.size(); ++i) {
    const Tensor& a = args[i];
    if (!a.defined()) {
      key += "|-";
      continue;
    }
    // An argument that requires grad gets a gradient, which makes another graph.
    key += fmt::format("|{}{}{}", name(a.node()->value->dtype), to_string(a.shape()),
                       a.requires_grad() ? "g" : "");
    // One tensor passed as two arguments is one input of the trace's programs: a call with two
    // must not replay it.
    for (size_t j = 0; j < i; ++j)
      if (args[j].defined() && args[j].node()->value == a.node()->value) {
        key += fmt::format("={}", j);
        break;
      }
  }
  return key;
}

}  // namespace

struct StepReplayer::State {
  std::map<std::string, Entry> entries;
  CompileStats stats;
  uint64_t setting_edits = 0;     // at the last call
  const Entry* traced = nullptr;  // the entry of the latest trace, at call number traced_at
  int64_t traced_at = 0;
  std::optional<StateLeft> left;  // what the latest trace left, if it was fit to replay
};

StepReplayer::StepReplayer() : state_(std::make_unique<State>()) {}
StepReplayer::~StepReplayer() {
  if (state_) reset();
}
StepReplayer::StepReplayer(StepReplayer&&) noexcept = default;
StepReplayer& StepReplayer::operator=(StepReplayer&&) noexcept = default;

const CompileStats& StepReplayer::stats() const { return state_->stats; }

void StepReplayer::reset() {
  for (auto& [key, entry] : state_->entries) {
    if (entry.previous) release(*entry.previous);
    if (entry.plan) release(*entry.plan);
  }
  state_->entries.clear();
  state_->left.reset();
}

std::vector<Tensor> StepReplayer::call(const std::vector<Tensor>& args, const Function& fn) {
  // Inside another compiled function's trace, this one is simply part of that trace.
  if (trace_observer()) return fn(args);
  // Queued steps first (runtime/cpu_stream.h): they hold buffers the plan watches by their
  // holders, and write state it reads.
  finish_cpu_stream();
  CompileStats& stats = state_->stats;
  ++stats.calls;
  std::vector<Tensor> defined;
  for (const Tensor& a : args)
    if (a.defined()) defined.push_back(a);
  eval(defined);
  // Entries keyed before an edit to a policy in use or the checkpointed modules are never asked
  // for again: freed, so that a loop that edits them between steps holds one entry, not one per
  // edit.
  if (const uint64_t edits = graph_setting_edits(); edits != state_->setting_edits) {
    for (auto it = state_->entries.begin(); it != state_->entries.end();) {
      Entry& stale = it->second;
      if (stale.setting_edits == edits) {
        ++it;
        continue;
      }
      if (stale.previous) release(*stale.previous);
      if (stale.plan) release(*stale.plan);
      it = state_->entries.erase(it);
    }
    state_->setting_edits = edits;
  }
  Entry& entry = state_->entries[signature_key(args)];
  entry.setting_edits = state_->setting_edits;
  const bool others_traced = state_->traced && state_->traced != &entry &&
                             state_->traced_at > entry.last_call && entry.last_call > 0;
  const bool others_called = entry.last_call > 0 && entry.last_call + 1 < stats.calls;
  entry.last_call = stats.calls;
  const bool log = log_enabled("compile");
  const char* dropped = nullptr;  // why this call's plan was dropped, which stats.reason keeps
  if (entry.plan) dropped = replaced_state(*entry.plan, args);
  if (dropped == kWatchedBufferReplaced && others_traced) {
    dropped = kOtherSignatureTraced;
    if (state_->left && entry.clean_at == state_->traced_at &&
        take_up_state_left(entry, *state_->left)) {
      ++stats.rebinds;
      if (log) log_line("compile", "took up the state a trace of other argument shapes left");
      dropped = replaced_state(*entry.plan, args);
    }
  }
  const bool replays_here = entry.plan && !dropped;
  if (entry.collective && !every_process_replays(replays_here) && replays_here)
    dropped =
        "another process traces this call (a value read on the host there, or state changed), "
        "and every process must make the same collectives";
  if (entry.plan) {
    if (const char* replaced = dropped) {
      if (log) log_line("compile", "dropping the replay plan: {}", replaced);
      entry.unpinned_arg =
          replaced == kPinnedArgumentChanged ? changed_pinned_arg(*entry.plan, args) : -1;
      release(*entry.plan);
      entry.plan.reset();
    } else {
      std::vector<Tensor> results;
      try {
        results = replay(*entry.plan, args);
      } catch (...) {
        entry.plan.reset();  // its state may be half updated; the caller sees the error
        throw;
      }
      ++stats.replays;
      stats.reason.clear();
      return results;
    }
  }

  // Which other plans may take up what this trace leaves: those whose state is as their last
  // call left it now, before the trace replaces it, or as the latest trace left it where they
  // could take that up (short batches of several shapes in a row).
  const bool left_current = state_->left && state_->left->all_current();
  for (auto& [key, other] : state_->entries)
    if (&other != &entry && other.plan)
      other.clean_at =
          state_unchanged(*other.plan) || (left_current && other.clean_at == state_->traced_at)
              ? stats.calls
              : -1;
  std::vector<Tensor> results;
  auto trace = std::make_unique<Trace>(trace_call(args, fn, results));
  if (trace->unfit.empty())
    state_->left.emplace(*trace);
  else
    state_->left.reset();
  entry.collective = makes_collectives(*trace);
  ++stats.traces;
  state_->traced = &entry;
  state_->traced_at = stats.calls;
  std::string why;
  if (!trace->unfit.empty()) {
    why = fmt::format("the function {}; it is traced on every call", trace->unfit);
  } else if (entry.previous && entry.previous->unfit.empty()) {
    entry.plan = make_plan(*entry.previous, *trace, true, why, entry.unpinned_arg);
    entry.unpinned_arg = -1;
    // The traces compared are not of consecutive calls: what changed between is the calls'
    // of other shapes, not necessarily the function's doing.
    if (!entry.plan && others_called)
      why +=
          "; the trace compared with was not the previous call's (calls with other argument "
          "shapes between: a short last batch?)";
  } else {
    why = "waiting for a second trace to compare with";
  }
  if (entry.previous) release(*entry.previous);
  entry.previous.reset();
  if (entry.plan) {
    entry.kept = trace->kept;
    hand_over_gradients(*entry.plan);
    watch(*entry.plan);
    ++stats.plans;
    stats.reason.clear();
    if (log)
      log_line("compile", "replaying from now on ({} evaluations per call)",
               entry.plan->evals.size());
  } else {
    stats.reason = dropped ? fmt::format("the replay plan was dropped: {}; {}", dropped, why) : why;
    // Before the first plan, calls that differ are the normal warm-up (optimizer state, the
    // loss scaler and caches are made on the first steps), not a failure to replay.
    if (log)
      log_line("compile", "{}: {}",
               stats.plans == 0 && stats.traces <= 3 ? "warming up, traced" : "traced", why);
    entry.previous = std::move(trace);
  }
  trace.reset();
  if (state_->left) state_->left->settle();
  return results;
}

// Whether a replay reads a parameter through its tensor, which an artifact saved from the plan
// would have no tensor for.
static bool reads_replaced_parameters(const Plan& plan) {
  for (const PlannedEvaluation& planned : plan.evals)
    for (const Binding& binding : planned.inputs)
      if (binding.through_parameter()) return true;
  return false;
}

// The arguments as new buffers of the same values. plan_step's later traces read these: a
// function that also reads an argument's tensor captured (one input node for both) then makes
// another graph than with the tensor itself, so no plan binds the captured tensor to an input.
static std::vector<Tensor> copies_of(const std::vector<Tensor>& args) {
  std::vector<Tensor> out;
  for (const Tensor& a : args) {
    if (!a.defined()) {
      out.emplace_back();
      continue;
    }
    Tensor t = from_storage(host_copy(*a.node()->value), a.shape());
    if (a.requires_grad()) t.requires_grad_(true);
    out.push_back(std::move(t));
  }
  return out;
}

std::unique_ptr<Plan> plan_step(const std::vector<Tensor>& args, const StepReplayer::Function& fn) {
  if (trace_observer()) fail("a step cannot be planned inside another traced function");
  finish_cpu_stream();
  std::vector<Tensor> defined;
  for (const Tensor& a : args)
    if (a.defined()) defined.push_back(a);
  eval(defined);
  std::vector<Tensor> results;
  // As in StepReplayer::call: a first call that differs from the next (an optimizer creating
  // its state) is followed by one more.
  Trace previous = trace_call(args, fn, results);
  std::string why;
  for (int call = 2; call <= 3; ++call) {
    if (!previous.unfit.empty()) {
      release(previous);
      fail("the function {}, so it cannot be replayed", previous.unfit);
    }
    std::vector<Tensor> copies = copies_of(args);
    Trace next = trace_call(copies, fn, results);
    std::unique_ptr<Plan> plan;
    if (next.unfit.empty()) plan = make_plan(previous, next, false, why);
    release(previous);
    if (plan && reads_replaced_parameters(*plan)) {
      release(*plan);
      release(next);
      fail(
          "the function reads parameters that change between its calls other than through "
          "what it computes, so it cannot be replayed from a file");
    }
    if (plan) return plan;
    previous = std::move(next);
  }
  release(previous);
  fail("the function cannot be replayed: {}", why);
}

bool tracing_step() { return recorder != nullptr; }

bool record_evaluation(const std::vector<Node*>& pending, ExecutedProgram&& executed,
                       Device device) {
  if (!recorder) return false;
  Evaluation e;
  e.pending_raw = pending;
  e.pending.reserve(pending.size());
  for (Node* node : pending) {
    e.pending.push_back(node->shared_from_this());
    if (node->op == OpCode::Full && is_floating(node->precision.storage_type))
      e.fills.push_back(node->attrs.value);
  }
  for (Node* external : executed.sig.externals) {
    e.inputs.push_back(external->value);
    std::shared_ptr<TensorImpl> owner = external->grad_owner.lock();
    const bool before_the_call = !recorder->made_here.count(external);
    e.parameters.push_back(owner && owner->node.get() == external && before_the_call
                               ? owner
                               : std::shared_ptr<TensorImpl>());
  }
  for (Node* stored : executed.sig.stored) e.outputs.push_back(stored->value);
  e.executed = std::move(executed);
  e.device = device;
  recorder->trace.evals.push_back(std::move(e));
  return true;
}

}  // namespace mixtape
