// mixtape/runtime/step_plan.cpp -- replays a plan of evaluations, binding its inputs and updating
// the buffers it keeps in place.
#include "mixtape/runtime/step_plan.h"

#include <algorithm>

#include "mixtape/dsl/error.h"
#include "mixtape/runtime/cpu_executor.h"
#include "mixtape/runtime/cuda_executor.h"
#include "mixtape/runtime/cuda_values.h"

namespace mixtape {

std::string describe(const Node& node) {
  return fmt::format("{} {} {}", op_name(node.op), to_string(node.shape), name(node.dtype));
}

namespace {
// A buffer of its own holding `value`'s current contents, where the value lives: a device value
// is copied on the device, queued behind what computes it, so the host does not wait.
StoragePtr private_copy(Storage& value) {
  if (value.device && value.host_stale.load(std::memory_order_acquire))
    return copy_on_device(value);
  return host_copy(value);
}

// Makes `value` (null: none) `owner`'s gradient, as the traced step left it; the buffer the
// old one held, where it moves off it, goes into `moved`.
void set_gradient(TensorImpl* owner, NodePtr value, std::vector<const Storage*>& moved) {
  if (!owner || owner->grad == value) return;
  if (owner->grad && owner->grad->value && (!value || owner->grad->value != value->value))
    moved.push_back(owner->grad->value.get());
  moved_off(owner->grad.get(), value.get());
  owner->grad = std::move(value);
}

// Leaves gradient `slot`, stored as `node` in `buffer`, in `owner`'s grad() after a replay
// wrote `buffer`; `before` holds what `buffer` held until then. A leaf the last replay left
// there that something else still holds keeps that value rather than seeing the new one.
void hand_back(GradientSlot& slot, TensorImpl* owner, const Node& node, const StoragePtr& buffer,
               const StoragePtr& before, std::vector<const Storage*>& moved) {
  if (NodePtr last = slot.handed.lock()) {
    const long by_owner = owner && owner->grad == last ? 1 : 0;
    if (last.use_count() - 1 - by_owner > 0) {
      last->value = before;
      slot.handed.reset();  // its own value from now on
    }
  }
  if (!owner || (owner->grad && owner->grad->value == buffer)) return;
  NodePtr leaf = leaf_like(node, buffer).node();
  slot.handed = leaf;
  set_gradient(owner, std::move(leaf), moved);
}

// The stored values of evaluation `index` that its kernels may compute straight into the state
// buffer the replay would swap them into (replay_cpu's in_place), sorted by node: not a result,
// sharing no buffer, not a gradient handed back, and not a buffer a later evaluation reads as it
// was when the call began (the old value stays in the fresh buffer for those).
const std::vector<std::pair<const Node*, StoragePtr>>& in_place_of(
    Plan& plan, size_t index, const std::vector<std::pair<const Storage*, StoragePtr>>& replaced) {
  PlannedEvaluation& planned = plan.evals[index];
  if (planned.in_place) return *planned.in_place;
  const Evaluation& e = planned.eval;
  std::vector<bool> shared(planned.shares_with.size(), false);
  for (size_t j = 0; j < shared.size(); ++j)
    if (const int first = planned.shares_with[j]; first >= 0) shared[j] = shared[first] = true;
  std::vector<std::pair<const Node*, StoragePtr>> list;
  for (size_t j = 0; j < e.executed.sig.stored.size(); ++j) {
    const auto at = std::pair(static_cast<int>(index), static_cast<int>(j));
    const bool handed = std::any_of(plan.gradients.begin(), plan.gradients.end(),
                                    [&](const GradientSlot& slot) { return slot.at == at; });
    const bool read_as_before =
        std::any_of(replaced.begin(), replaced.end(),
                    [&](const auto& entry) { return entry.first == e.outputs[j].get(); });
    if (planned.result_slot[j] < 0 && !shared[j] && !handed && !read_as_before)
      list.emplace_back(e.executed.sig.stored[j], e.outputs[j]);
  }
  std::sort(list.begin(), list.end());
  return *(planned.in_place = std::move(list));
}

// The gradient `binding` adds to, as the call begins: its tensor's, or where it has none, the
// binding's buffer of -0 shaped and typed like the trace's (`leaf`).
StoragePtr gradient_at_call_start(const Plan& plan, Binding& binding, const Node& leaf,
                                  const std::vector<Tensor>& args) {
  const GradientSlot& slot = plan.gradients[static_cast<size_t>(binding.gradient)];
  if (std::shared_ptr<TensorImpl> owner = owner_of(slot, args); owner && owner->grad)
    return owner->grad->value;
  if (!binding.no_gradient) {
    NoPolicyScope as_asked;  // the trace's dtype, whatever the policy around the call
    Tensor zeros = full(leaf.shape, -0.0, binding.owner_dtype);
    eval({zeros});
    binding.no_gradient = zeros.node()->value;
  }
  return binding.no_gradient;
}

}  // namespace

bool GradientSlot::operator==(const GradientSlot& other) const {
  const bool same_owner =
      owner_arg >= 0 ? owner_arg == other.owner_arg
                     : !owner.owner_before(other.owner) && !other.owner.owner_before(owner);
  return same_owner && start == other.start && at == other.at && arg == other.arg;
}

std::shared_ptr<TensorImpl> owner_of(const GradientSlot& slot, const std::vector<Tensor>& args) {
  if (slot.owner_arg < 0) return slot.owner.lock();
  const Tensor& arg = args[static_cast<size_t>(slot.owner_arg)];
  return arg.defined() ? arg.node()->grad_owner.lock() : nullptr;
}

Tensor leaf_like(const Node& like, StoragePtr value) {
  auto node = make_node(OpCode::Constant, like.dtype, like.shape, {}, {}, Loc::current());
  node->precision.storage_type = node->precision.compute = value->dtype;
  node->precision.assigned = true;
  node->value = std::move(value);
  return Tensor(std::move(node));
}

void run_hooks(const std::vector<Hook>& hooks) {
  for (const Hook& h : hooks) {
    std::vector<StoragePtr> copies;
    for (const NodePtr& node : h.values) {
      if (!node->value)
        fail("compile: a value handed to host work ({}) has no value", describe(*node));
      copies.push_back(private_copy(*node->value));
    }
    h.hook->ran(copies);
  }
}

void release_graph(const std::vector<Node*>& pending) {
  for (Node* node : pending)
    if (!node->requires_grad && node->evaluated()) node->inputs.clear();
}

void release(Plan& plan) {
  for (PlannedEvaluation& planned : plan.evals) release_graph(planned.eval.pending_raw);
}

std::vector<Tensor> replay(Plan& plan, const std::vector<Tensor>& args) {
  std::vector<Tensor> results(plan.results.size());
  // The buffers a later evaluation reads as they were when the call began, and (once an
  // evaluation replaced it) that value: swap_value leaves it in the fresh storage.
  std::vector<std::pair<const Storage*, StoragePtr>> replaced;
  // The gradients the step adds to, per evaluation and input, as the call begins: found before
  // any evaluation writes one. One the step leaves in the buffer it found (the last replay's),
  // read after the evaluation that writes it, is read as it was.
  std::vector<std::vector<StoragePtr>> gradient_inputs(plan.evals.size());
  for (size_t index = 0; index < plan.evals.size(); ++index) {
    PlannedEvaluation& planned = plan.evals[index];
    for (size_t x = 0; x < planned.inputs.size(); ++x) {
      Binding& binding = planned.inputs[x];
      if (binding.at_call_start) replaced.emplace_back(binding.object.get(), nullptr);
      if (!binding.through_gradient()) continue;
      gradient_inputs[index].resize(planned.inputs.size());  // only evaluations that add to one
      StoragePtr value = gradient_at_call_start(plan, binding, *planned.leaves[x], args);
      const GradientSlot& slot = plan.gradients[static_cast<size_t>(binding.gradient)];
      if (slot.at.first >= 0 && slot.at.first < static_cast<int>(index) &&
          plan.evals[slot.at.first].eval.outputs[slot.at.second] == value)
        replaced.emplace_back(value.get(), nullptr);
      gradient_inputs[index][x] = std::move(value);
    }
  }
  auto call_start_value = [&](const StoragePtr& object) {
    for (const auto& [buffer, value] : replaced)
      if (buffer == object.get() && value) return value;
    return object;
  };
  std::vector<const Storage*> moved;  // buffers gradients moved off (set_gradient)
  for (size_t index = 0; index < plan.evals.size(); ++index) {
    PlannedEvaluation& planned = plan.evals[index];
    Evaluation& e = planned.eval;
    const Signature& sig = e.executed.sig;
    for (size_t x = 0; x < planned.inputs.size(); ++x)
      if (planned.inputs[x].arg >= 0)
        sig.externals[x]->value = args[planned.inputs[x].arg].node()->value;
      else if (planned.inputs[x].through_parameter())  // replaced_state checked it
        sig.externals[x]->value = planned.inputs[x].parameter.lock()->node->value;
      else if (planned.inputs[x].through_gradient())  // replaced_state checked it too
        sig.externals[x]->value = call_start_value(gradient_inputs[index][x]);
      else if (planned.inputs[x].through_result())
        sig.externals[x]->value =
            results[static_cast<size_t>(planned.inputs[x].result)].node()->value;
      else if (planned.inputs[x].at_call_start)
        sig.externals[x]->value = call_start_value(planned.inputs[x].object);
    for (Node* node : e.pending_raw) node->value.reset();
    if (e.device == Device::cuda)
      replay_cuda(e.executed, e.pending_raw);
    else
      replay_cpu(e.executed, e.pending_raw, in_place_of(plan, index, replaced));
    std::vector<StoragePtr> fresh_of(sig.stored.size());
    for (size_t j = 0; j < sig.stored.size(); ++j) {
      Node* node = sig.stored[j];
      StoragePtr fresh = std::move(node->value);
      node->value = e.outputs[j];
      if (!fresh) fail("compile: replay of evaluation left {} without a value", describe(*node));
      if (int first = planned.shares_with[j]; first >= 0 && fresh != fresh_of[first])
        fail("compile: replay gave {} a buffer of its own, where the trace had it share one",
             describe(*node));
      if (planned.result_slot[j] < 0 && planned.shares_with[j] < 0 && fresh != e.outputs[j]) {
        e.outputs[j]->swap_value(*fresh);
        for (auto& [buffer, value] : replaced)
          if (buffer == e.outputs[j].get() && !value) value = fresh;  // now the old value
      }
      fresh_of[j] = std::move(fresh);
    }
    // Every result from here, a value returned twice included.
    for (size_t r = 0; r < plan.results.size(); ++r)
      if (plan.results[r].first == static_cast<int>(index)) {
        size_t j = static_cast<size_t>(plan.results[r].second);
        results[r] = leaf_like(*sig.stored[j], fresh_of[j]);
      }
    for (GradientSlot& slot : plan.gradients)
      if (slot.at.first == static_cast<int>(index)) {
        const size_t j = static_cast<size_t>(slot.at.second);
        const int first = planned.shares_with[j];
        std::shared_ptr<TensorImpl> owner = owner_of(slot, args);
        if (const int r = planned.result_slot[j]; r >= 0)  // as tracing: the returned tensor
          set_gradient(owner.get(), results[static_cast<size_t>(r)].node(), moved);
        else
          hand_back(slot, owner.get(), *sig.stored[j], e.outputs[j],
                    fresh_of[first >= 0 ? first : j], moved);
      }
    for (size_t x = 0; x < planned.inputs.size(); ++x)
      if (planned.inputs[x].arg >= 0 || planned.inputs[x].through_parameter() ||
          planned.inputs[x].through_gradient() || planned.inputs[x].through_result())
        sig.externals[x]->value.reset();
      else if (planned.inputs[x].at_call_start)
        sig.externals[x]->value = planned.inputs[x].object;
  }
  for (GradientSlot& slot : plan.gradients)
    if (slot.at.first < 0)
      set_gradient(owner_of(slot, args).get(),
                   slot.arg >= 0 ? args[static_cast<size_t>(slot.arg)].node() : nullptr, moved);
  // The moves off the replay made are the trace's own, which its plan was made after.
  for (Plan::Watched& w : plan.watched)
    if (!moved.empty() && std::find(moved.begin(), moved.end(), w.object.get()) != moved.end())
      w.moves_off = w.object->moves_off.load(std::memory_order_relaxed);
  run_hooks(plan.hooks);
  return results;
}

}  // namespace mixtape
