// mixtape/dsl/optim.cpp -- optimizer updates written as graph code; one evaluation per step.
#include "mixtape/dsl/optim.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <numbers>
#include <string_view>
#include <unordered_map>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/optimizer_entries.h"
#include "mixtape/dsl/optimizer_state.h"
#include "mixtape/dsl/orphan_parameters.h"
#include "mixtape/dsl/process_group.h"
#include "mixtape/dsl/reusable_buffers.h"

namespace mixtape {
namespace {

constexpr const char* kMomentumStarted = "~momentum_started";  // SGD: a real step happened

using optimizer_state::bias_correction;
using optimizer_state::find_state;
using optimizer_state::finite_non_negative;
using optimizer_state::set_state;
using optimizer_state::started_state;

}  // namespace

void Optimizer::start_state(NamedTensors&, const Tensor&) const {}

void Optimizer::add_zero_state(NamedTensors& state, std::string_view name, const Tensor& like) {
  if (find_state(state, name)) return;
  state.emplace_back(
      std::string(name),
      from_storage(std::make_shared<Storage>(like.dtype(), like.numel()), like.shape()));
}

namespace {
// mt::Error unless each of `params` (in groups `group_of`) is a defined leaf listed once. One
// that does not require grad (a frozen backbone) is taken, as torch's optimizers take it: a step
// leaves a parameter without a gradient alone.
void check_parameters(const char* kind, const std::vector<Tensor>& params,
                      const std::vector<size_t>& group_of) {
  if (params.empty()) fail("{}: got an empty parameter list", kind);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined()) fail("{}: parameter {} is undefined", kind, i);
    // A computed tensor (w * 2) gets no gradient of its own: it would never be updated.
    if (!params[i].is_leaf())
      fail(
          "{}: parameter {} is the result of '{}', not a leaf tensor: an optimizer updates leaves "
          "(as torch's, which cannot optimize a non-leaf tensor)",
          kind, i, op_name(params[i].node()->op));
  }
  // Updated twice from the same value, the second assign would win and the step be taken once,
  // but the tensor would have two sets of state, saved under one checkpoint name. (PyTorch warns
  // of duplicates in a group and refuses a tensor in two groups.) By node: a model has thousands
  // of parameters.
  std::unordered_map<const Node*, size_t> first_place;
  for (size_t i = 0; i < params.size(); ++i) {
    auto [place, added] = first_place.emplace(params[i].node().get(), i);
    if (added) continue;
    const size_t j = place->second;
    if (group_of[i] != group_of[j])
      fail(
          "{}: parameter {} of group {} is parameter {} of group {} again; a tensor belongs to "
          "one group",
          kind, i, group_of[i], j, group_of[j]);
    fail(
        "{}: parameter {} is parameter {} again (a weight tied under two names?); list each "
        "tensor once, as Module::parameters() does",
        kind, i, j);
  }
}
}  // namespace

Optimizer::Optimizer(std::vector<std::vector<Tensor>> groups, const char* kind)
    : groups_(groups.size()), kind_(kind) {
  static std::atomic<uint64_t> optimizers{0};
  id_ = ++optimizers;
  for (size_t g = 0; g < groups.size(); ++g)
    for (Tensor& p : groups[g]) {
      params_.push_back(std::move(p));
      group_of_.push_back(g);
    }
  check_parameters(kind_, params_, group_of_);
  state_.resize(params_.size());
  counts_.resize(params_.size());
  set_steps_taken(0);
  note_optimizer_parameters(params_, true);
}

size_t Optimizer::add_group(std::vector<Tensor> params) {
  if (const char* why = fixed_groups()) fail("{}: add_param_group: {}", kind_, why);
  std::vector<Tensor> all = params_;
  std::vector<size_t> group_of = group_of_;
  const size_t group = groups_.size();
  all.insert(all.end(), params.begin(), params.end());
  group_of.resize(all.size(), group);
  check_parameters(kind_, all, group_of);
  // Its parameters have taken no update: the optimizer's count while it has taken none either,
  // else a count of their own, as torch starts their "step" at their first update.
  const int64_t taken = steps_taken();
  Tensor count = taken == 0 ? step_ : stored_count(0);
  params_ = std::move(all);
  group_of_ = std::move(group_of);
  groups_.emplace_back();
  state_.resize(params_.size());
  counts_.resize(params_.size(), count);
  note_optimizer_parameters(params, true);
  // A compiled step updates the parameters it traced: a new step-count buffer makes it trace
  // again.
  renew_step_count(taken);
  return group;
}

Optimizer::~Optimizer() {
  note_optimizer_parameters(params_, false);
  // The state goes with the optimizer: a compiled step's plan that updates it traces again,
  // whoever else holds the buffers (another plan, a trace), as after load_state.
  for (const NamedTensors& state : state_)
    for (const auto& [name, value] : state)
      if (value.defined()) moved_off(value.node().get(), nullptr);
  for (const Tensor& count : counts_)
    if (count.defined()) moved_off(count.node().get(), nullptr);
  if (step_.defined()) moved_off(step_.node().get(), nullptr);
}

const Optimizer::Group& Optimizer::checked_group(size_t group) const {
  if (group >= groups_.size())
    fail("{}: parameter group {} out of range ({} groups)", kind_, group, groups_.size());
  return groups_[group];
}

void Optimizer::check_group(size_t group) const { checked_group(group); }

size_t Optimizer::group_of(size_t param_index) const {
  if (param_index >= params_.size())
    fail("{}: parameter index {} out of range ({} parameters)", kind_, param_index, params_.size());
  return group_of_[param_index];
}

void Optimizer::check_lr(double lr) const {
  if (!(lr >= 0) || !std::isfinite(lr))
    fail("{}: learning rate must be finite and >= 0, got {}", kind_, lr);
}

void Optimizer::drop_unused_state(size_t group) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (group_of_[i] != group) continue;
    std::optional<std::vector<std::string>> known = state_names(i);
    if (!known) continue;
    std::erase_if(state_[i], [&](const auto& entry) {
      const std::string& name = entry.first;
      const bool kept =
          name.starts_with('~') || std::find(known->begin(), known->end(), name) != known->end();
      if (!kept && entry.second.defined()) moved_off(entry.second.node().get(), nullptr);
      return !kept;
    });
  }
}

void Optimizer::options_changed() {
  note_side_effect(
      "changes an optimizer's options (call set_options outside the compiled function)");
  renew_step_count(steps_taken());
}

void Optimizer::set_lr(double lr) {
  // Every group or none: a group whose schedule sets its rate refuses before any changes.
  for (size_t g = 0; g < groups_.size(); ++g)
    if (groups_[g].schedule) set_lr(g, lr);
  for (size_t g = 0; g < groups_.size(); ++g) set_lr(g, lr);
}

void Optimizer::set_lr(size_t group, double lr) {
  checked_group(group);
  if (own_rate_) fail("{}: set_lr: {}", kind_, own_rate_);
  Group& own = groups_[group];
  if (own.schedule)
    fail(
        "{}: set_lr({}) while a schedule is attached{}, which sets every step's rate; detach it "
        "first (set_schedule(nullptr))",
        kind_, lr, groups_.size() > 1 ? fmt::format(" to group {}", group) : "");
  check_lr(lr);
  note_side_effect("sets the learning rate (call set_lr outside the compiled function)");
  own.lr = lr;
  if (!own.lr_value.defined()) {
    own.lr_value = from_storage(std::make_shared<Storage>(f64, 1), {});
    own.lr_f32 = from_storage(std::make_shared<Storage>(f32, 1), {});
  }
  Storage& rate = *own.lr_value.node()->value;
  rate.as<double>()[0] = lr;
  rate.host_written();
  Storage& rate_f32 = *own.lr_f32.node()->value;
  rate_f32.as<float>()[0] = static_cast<float>(lr);
  rate_f32.host_written();
}

void Optimizer::set_schedule(std::shared_ptr<const LRSchedule> schedule) {
  if (own_rate_) fail("{}: set_schedule: {}", kind_, own_rate_);
  for (size_t g = 0; g < groups_.size(); ++g) set_schedule(g, schedule);
}

void Optimizer::set_schedule(size_t group, std::shared_ptr<const LRSchedule> schedule) {
  checked_group(group);
  if (own_rate_) fail("{}: set_schedule: {}", kind_, own_rate_);
  note_side_effect(
      "sets a learning-rate schedule (call set_schedule outside the compiled function)");
  if (schedule && schedule->requires_momentum() && !has_momentum())
    fail("{}: the schedule cycles the momentum (cycle_momentum), and {} has no momentum or beta1",
         kind_, kind_);
  groups_[group].schedule = std::move(schedule);
  // A cycled momentum keeps a buffer the option alone may not (SGD's, RMSprop's with a momentum
  // of 0): without it the buffer goes, as set_options() drops what its options do not keep, or
  // the next checkpoint would hold an entry no optimizer of these options loads.
  drop_unused_state(group);
  // A compiled step holds the old schedule's code: a new step-count buffer makes it trace again.
  renew_step_count(steps_taken());
}

Tensor Optimizer::current_lr(size_t group) const {
  const Group& own = checked_group(group);
  if (own_rate_) fail("{}: current_lr: {}", kind_, own_rate_);
  NoGradGuard no_grad;
  return own.schedule ? own.schedule->graph_lr(step_) : own.lr_value;
}

Tensor Optimizer::current_momentum(size_t group) const {
  const Group& own = checked_group(group);
  NoGradGuard no_grad;
  return own.schedule && has_momentum() ? own.schedule->graph_momentum(step_) : Tensor();
}

template <typename Make>
Tensor Optimizer::shared(uint64_t what, bool number, DType dtype, Make make) {
  // A handful a step, however many parameters (the rule's constants and begin_step()'s
  // scalars, per dtype): a scan finds them.
  for (size_t i = 0; i < shared_count_; ++i) {
    const Shared& e = shared_[i];
    if (e.what == what && e.number == number && e.dtype == dtype) return e.value;
  }
  Tensor value = make();
  if (shared_count_ == shared_.size()) shared_.emplace_back();
  shared_[shared_count_] = {what, number, dtype, std::move(value)};
  return shared_[shared_count_++].value;
}

void Optimizer::drop_shared() {
  for (size_t i = 0; i < shared_count_; ++i) shared_[i].value = Tensor();
  shared_count_ = 0;
}

Tensor Optimizer::step_constant(double value, const Tensor& like, const Loc& loc) {
  // The dtype a number takes beside `like` in an operator (dsl/ops.cpp, scalar_like).
  DType dtype = like.dtype();
  if (!is_floating(dtype)) dtype = f32;
  return shared(std::bit_cast<uint64_t>(value), true, dtype,
                [&] { return full({}, value, dtype, loc); });
}

Tensor Optimizer::step_scalar(const Tensor& scalar, DType dtype, const Loc& loc) {
  // The cast of a value this step computes is shared (it joins the kernel that computes the
  // value); that of a stored value (the learning rate) would be a kernel of its own, so each
  // parameter makes its own, which joins its update's kernel.
  const Group& group = groups_[group_in_use_];
  if (dtype == f32 && group.lr_f32.defined() && scalar.node() == group.lr_value.node())
    return group.lr_f32;
  if (scalar.node()->evaluated()) return cast(scalar, dtype, loc);
  uint64_t what = reinterpret_cast<uintptr_t>(scalar.node().get());
  return shared(what, false, dtype, [&] { return cast(scalar, dtype, loc); });
}

Tensor Optimizer::with_l2_penalty(const Tensor& grad, const Tensor& param, double weight_decay) {
  // param * weight_decay + grad: the same sum as grad + param * weight_decay, bit for bit.
  return mul_add({param, step_constant(weight_decay, param), grad});
}

Tensor Optimizer::step_factor(const Tensor& cycled, double fixed, const Tensor& like,
                              const Loc& loc) {
  return cycled.defined() ? step_scalar(cycled, like.dtype(), loc)
                          : step_constant(fixed, like, loc);
}

Tensor Optimizer::rule_gradient(const Tensor& grad, const Tensor& param, bool maximize,
                                double weight_decay) {
  Tensor g = maximize ? -grad : grad;
  return weight_decay != 0 ? with_l2_penalty(g, param, weight_decay) : g;
}

void Optimizer::step() { step_unless(Tensor(), {}); }

void Optimizer::step_unless(const Tensor& skip) {
  if (!skip.defined()) fail("{}: step_unless got an undefined skip flag", kind_);
  step_unless(skip, {});
}

void Optimizer::step_unless(const Tensor& skip, const std::vector<Tensor>& also) {
  NoPolicyScope no_policy;  // the update keeps its traced types under the caller's autocast
  warn_about_orphan_parameters();
  for (size_t i = 0; i < also.size(); ++i)
    if (!also[i].defined()) fail("{}: step_unless: extra output {} is undefined", kind_, i);
  // Sized once: the traced loop runs this every step.
  std::vector<size_t> updated;
  std::vector<Tensor> new_params;
  std::vector<NamedTensors> new_state;
  updated.reserve(params_.size());
  Tensor new_step;
  // Each parameter counts its own updates, as torch's optimizers do (a parameter that got no
  // gradient in a step is not updated and its count stays): parameters that took the same
  // updates share one count node, step_'s while they took every one, so a step builds each
  // count and the scalars begin_step() makes from it once per group, usually one.
  std::vector<CountGroup> groups;
  {
    NoGradGuard no_grad;
    // The shared nodes live for this build only, also when it throws: an entry is keyed by its
    // scalar's address, which a later step's scalar may reuse.
    struct DropShared {
      Optimizer& optimizer;
      ~DropShared() {
        optimizer.drop_shared();
        for (Group& group : optimizer.groups_)
          group.scheduled_lr = group.scheduled_momentum = Tensor();
        optimizer.next_step_ = optimizer.skip_ = Tensor();
        optimizer.group_in_use_ = 0;
      }
    } drop_shared{*this};
    skip_ = Tensor();
    if (skip.defined()) {
      if (skip.numel() != 1)
        fail("{}: the skip flag must have one element, got shape {}", kind_,
             to_string(skip.shape()));
      Tensor flag = reshape(skip, {});
      skip_ = flag.dtype() == boolean ? flag : ne(flag, zeros({}, flag.dtype()));
    }
    // One schedule attached to several groups builds its graph once.
    for (size_t g = 0; g < groups_.size(); ++g) {
      Group& group = groups_[g];
      if (!group.schedule) continue;
      auto same = std::find_if(groups_.begin(), groups_.begin() + static_cast<ptrdiff_t>(g),
                               [&](const Group& e) { return e.schedule == group.schedule; });
      if (same != groups_.begin() + static_cast<ptrdiff_t>(g)) {
        group.scheduled_lr = same->scheduled_lr;
        group.scheduled_momentum = same->scheduled_momentum;
        continue;
      }
      group.scheduled_lr = group.schedule->graph_lr(step_);
      if (has_momentum()) group.scheduled_momentum = group.schedule->graph_momentum(step_);
    }
    // The updated parameters in their order (as assemble() gathers them), each group's members
    // as places in that order.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].grad().defined()) continue;
      auto same = [&](const CountGroup& g) { return g.count.same(counts_[i]); };
      auto group = std::find_if(groups.begin(), groups.end(), same);
      if (group == groups.end()) group = groups.insert(groups.end(), {counts_[i], {}, {}});
      group->members.push_back(updated.size());
      updated.push_back(i);
    }
    new_params.resize(updated.size());
    new_state.resize(updated.size());
    for (CountGroup& group : groups) {
      next_step_ = group.count + 1.0;
      group.next = skip_.defined() ? where(skip_, group.count, next_step_) : next_step_;
      // Then the members of each parameter group in turn, begin_step() first with its options:
      // sorted by group (no allocation, as the traced loop runs this every step).
      if (groups_.size() > 1)
        std::sort(group.members.begin(), group.members.end(), [&](size_t a, size_t b) {
          return std::pair(group_of_[updated[a]], a) < std::pair(group_of_[updated[b]], b);
        });
      for (size_t m = 0; m < group.members.size(); ++m) {
        const size_t k = group.members[m];
        const size_t i = updated[k];
        if (m == 0 || group_of_[i] != group_in_use_) {
          group_in_use_ = group_of_[i];
          begin_step();
        }
        Tensor g = params_[i].grad();
        Tensor p = local_part(i, Tensor(params_[i].node()));
        if (!p.defined()) {  // a ZeRO shard of another process: assemble() gives its new value
          new_state[k] = state_[i];
          continue;
        }
        Tensor local_grad = local_part(i, g.dtype() == p.dtype() ? g : cast(g, p.dtype()));
        start_state(state_[i], local_grad);
        NamedTensors state = state_[i];
        Tensor next = update(p, local_grad, state);
        // In the parameter's type, also from state in a wider one (load_state's f32).
        if (next.dtype() != p.dtype()) next = cast(next, p.dtype());
        if (skip_.defined()) {
          // State that did not exist yet is kept at zero by a skipped step: for every built-in
          // rule zero state updates exactly like absent state, or the rule keeps a '~' flag.
          next = where(skip_, p, next);
          for (auto& [name, value] : state) {
            Tensor* old = find_state(state_[i], name);
            value = where(skip_, old ? *old : zeros_like(value), value);
          }
        }
        new_params[k] = std::move(next);
        new_state[k] = std::move(state);
      }
    }
    if (!updated.empty()) {
      assemble(updated, new_params);
      // The optimizer's own count (schedules follow it): the group that took every update
      // computed it already.
      auto every = std::find_if(groups.begin(), groups.end(),
                                [&](const CountGroup& g) { return g.count.same(step_); });
      new_step = every != groups.end() ? every->next
                 : skip_.defined()     ? where(skip_, step_, step_ + 1.0)
                                       : step_ + 1.0;
    }
  }
  if (updated.empty()) {
    if (!also.empty()) eval(also);
    return;
  }
  std::vector<Tensor> outputs;
  size_t output_count = new_params.size() + 1 + groups.size() + also.size();
  for (const NamedTensors& state : new_state) output_count += state.size();
  outputs.reserve(output_count);
  outputs.insert(outputs.end(), new_params.begin(), new_params.end());
  for (const NamedTensors& state : new_state)
    for (const auto& [name, value] : state) outputs.push_back(value);
  outputs.push_back(new_step);
  for (const CountGroup& group : groups)
    if (!group.next.same(new_step)) outputs.push_back(group.next);
  outputs.insert(outputs.end(), also.begin(), also.end());
  {
    // The update may compute into the buffers of the values it replaces, as PyTorch's optimizers
    // update in place, halving the bytes it touches and holds (dsl/reusable_buffers.h): each old
    // parameter's node is held by its tensor, which assign() moves to the new value, and each
    // old state entry's by the tensor in state_, which is replaced, unless a copy of it was
    // handed out. Anything else holding one of them keeps its buffer out of reach.
    std::vector<std::pair<const Node*, long>> replaced;
    for (size_t k = 0; k < updated.size(); ++k) {
      if (!new_params[k].defined()) continue;
      const size_t i = updated[k];
      replaced.emplace_back(params_[i].node().get(), 1);
      for (const auto& [name, old] : state_[i])
        if (old.use_count() == 1 && find_state(new_state[k], name))
          replaced.emplace_back(old.node().get(), 1);
    }
    ReusableBuffers reusable(std::move(replaced));
    // The whole update as one program, queued where the CPU back end runs asynchronously.
    std::vector<NodePtr> nodes;
    nodes.reserve(outputs.size());
    for (const Tensor& t : outputs) nodes.push_back(t.node());
    evaluate_queued(nodes);
  }
  for (size_t k = 0; k < updated.size(); ++k) {
    size_t i = updated[k];
    params_[i].assign(new_params[k]);
    NamedTensors persistent;
    persistent.reserve(new_state[k].size());
    for (auto& [name, value] : new_state[k])
      persistent.emplace_back(name, from_storage(value.node()->value, value.shape()));
    state_[i] = std::move(persistent);
  }
  step_ = from_storage(new_step.node()->value, {});
  for (const CountGroup& group : groups) {
    Tensor count = group.next.same(new_step) ? step_ : from_storage(group.next.node()->value, {});
    for (size_t k : group.members) counts_[updated[k]] = count;
  }
  if (trace_observer()) {
    // The handles above replace the old state: named by parameter and optimizer for a compiled
    // step's plans of other batch shapes, which take it up by those names (runtime/compile.cpp).
    auto keep = [&](size_t param, std::string_view name, const Tensor& value) {
      note_kept_state(params_[param].impl(), fmt::format("{}/{}", id_, name), value.node());
    };
    for (size_t k = 0; k < updated.size(); ++k)
      for (const auto& [name, value] : new_state[k]) keep(updated[k], name, value);
    // Every updated parameter's count, also where it is the step count: a parameter another
    // shape's step does not update keeps its count apart from the one that shape leaves.
    keep(0, "~step", new_step);
    for (const CountGroup& group : groups)
      for (size_t k : group.members) keep(updated[k], "~count", group.next);
  }
}

int64_t Optimizer::steps_taken() const { return static_cast<int64_t>(step_.item()); }

void Optimizer::zero_grad() {
  for (Tensor& p : params_) p.zero_grad();
}

NamedTensors Optimizer::state(size_t param_index) const {
  if (param_index >= params_.size())
    fail("{}: parameter index {} out of range ({} parameters)", kind_, param_index, params_.size());
  NamedTensors visible;
  if (!state_started(state_[param_index])) return visible;
  for (const auto& entry : state_[param_index])
    if (entry.first.empty() || entry.first[0] != '~') visible.push_back(entry);
  return visible;
}

void Optimizer::check_state(size_t param_index, const NamedTensors& state, bool allow_nonfinite,
                            const std::string& prefix) const {
  if (param_index >= params_.size())
    fail("{}: parameter index {} out of range ({} parameters)", kind_, param_index, params_.size());
  for (const auto& [name, value] : state) {
    Shape expected = state_shape(name, local_shape(param_index));
    if (!value.defined() || value.shape() != expected)
      fail("{}: state '{}{}' for parameter {} has shape {}, expected {}", kind_, prefix, name,
           param_index, value.defined() ? to_string(value.shape()) : "undefined",
           to_string(expected));
    if (!is_floating(value.dtype()))
      fail("{}: state '{}{}' for parameter {} is {}, not a floating-point tensor", kind_, prefix,
           name, param_index, mixtape::name(value.dtype()));
  }
  // Every entry the rule keeps, or none (a parameter never stepped), and no others: a state
  // missing an entry would restart it from zeros under a restored step count, and an entry the
  // rule does not know is nobody's.
  if (std::optional<std::vector<std::string>> known = state_names(param_index);
      known && !state.empty()) {
    const std::vector<std::string>& names = *known;
    const std::vector<std::string> optional = optional_state_names();
    auto listed = [](const std::vector<std::string>& list, const std::string& name) {
      return std::find(list.begin(), list.end(), name) != list.end();
    };
    for (const auto& [name, value] : state)
      if (!listed(names, name) &&
          !(name == kMasterWeightEntry && is_half(params_[param_index].dtype())))
        fail("{}: state '{}{}' for parameter {} is not one of this rule's ({})", kind_, prefix,
             name, param_index,
             names.empty() ? "it keeps none" : fmt::format("{}", fmt::join(names, ", ")));
    for (const std::string& name : names)
      if (!listed(optional, name) &&
          std::none_of(state.begin(), state.end(), [&](const auto& e) { return e.first == name; }))
        fail(
            "{}: the state for parameter {} has no '{}{}' (it holds {} of this rule's {} "
            "entries)",
            kind_, param_index, prefix, name, state.size(), names.size());
  }
  for (const auto& [name, value] : state) {
    eval({value});
    // As load_state keeps it.
    std::shared_ptr<Storage> kept = value.node()->value;
    if (DType type = loaded_dtype(param_index, kept->dtype); type != kept->dtype)
      kept = converted(*kept, type);
    const Storage& values = *kept;
    int64_t bad = allow_nonfinite ? -1 : first_nonfinite(values);
    if (bad >= 0)
      fail(
          "{}: state '{}{}' for parameter {} holds {} at element {} as {} (pass allow_nonfinite "
          "to load non-finite values)",
          kind_, prefix, name, param_index, load_element<double>(*value.node()->value, bad), bad,
          mixtape::name(values.dtype));
    std::string problem = impossible_state(name, values);
    if (!problem.empty())
      fail("{}: state '{}{}' for parameter {} {}", kind_, prefix, name, param_index, problem);
  }
}

std::string Optimizer::impossible_state(const std::string& name, const Storage& values) const {
  // -0.0 compares equal to zero and NaN compares false: only real values outside are caught.
  const StateRange range = state_range(kind_, name);
  if (!range.what) return "";
  for (int64_t i = 0; i < values.count; ++i)
    if (double v = load_element<double>(values, i); !range.holds(v))
      return fmt::format("holds {} at element {}: it is {}, {}", v, i, range.what, range.range);
  return "";
}

Shape Optimizer::state_shape(const std::string&, const Shape& param) const { return param; }

Shape Optimizer::local_shape(size_t param_index) const { return params_.at(param_index).shape(); }

std::optional<std::vector<std::string>> Optimizer::state_names(size_t) const {
  return std::nullopt;
}

int64_t Optimizer::state_bytes(size_t param_index) const {
  int64_t bytes = 0;
  for (const std::string& name : state_names(param_index).value_or(std::vector<std::string>{}))
    bytes += numel(state_shape(name, local_shape(param_index))) *
             static_cast<int64_t>(size_of(entry_dtype(param_index, name)));
  return bytes;
}

DType Optimizer::state_dtype(size_t param_index) const { return params_.at(param_index).dtype(); }

bool Optimizer::momentum_scheduled(size_t group) const {
  const Group& own = checked_group(group);
  return own.schedule && has_momentum() && own.schedule->momentum(0).has_value();
}

Tensor Optimizer::local_part(size_t, const Tensor& whole) const { return whole; }

void Optimizer::assemble(const std::vector<size_t>&, std::vector<Tensor>&) {}

// The type a fresh optimizer keeps the state in (its parameter's, or f32 where the rule says
// so), or the state's own where that is wider, so that a resumed run steps as the one that saved
// it: bf16 state of a bf16 model stays bf16, f64 stays f64, and f32 state of a half parameter
// (ZeRO's masters and state, gathered into the plain rule for its checkpoint) stays f32.
DType Optimizer::loaded_dtype(size_t param_index, DType given) const {
  DType own = state_dtype(param_index);
  return is_floating(given) && size_of(given) > size_of(own) ? given : own;
}

void Optimizer::load_state(size_t param_index, const NamedTensors& state, bool allow_nonfinite) {
  check_state(param_index, state, allow_nonfinite);
  NamedTensors converted;
  for (const auto& [name, value] : state)
    converted.emplace_back(name, cast(value, loaded_dtype(param_index, value.dtype())).detach());
  // The state handed out earlier (state(i)) keeps the old buffers: count the move off them, so
  // that a replay plan carrying them sees it (Storage::moves_off).
  for (const auto& [name, old] : state_[param_index])
    if (old.defined()) moved_off(old.node().get(), nullptr);
  state_[param_index] = converted;
}

Tensor Optimizer::stored_count(int64_t steps) const {
  if (steps < 0) fail("{}: step count must be non-negative, got {}", kind_, steps);
  if (steps > (int64_t{1} << 53))
    fail("{}: step count {} is above 2^53, which the f64 count cannot hold exactly", kind_, steps);
  // Stored, not a fill: the first step then reads the count as every later one does, so that it
  // runs the same kernels.
  auto count = std::make_shared<Storage>(f64, 1);
  count->as<double>()[0] = static_cast<double>(steps);
  return from_storage(std::move(count), {});
}

void Optimizer::renew_step_count(int64_t steps) {
  Tensor next = stored_count(steps);
  if (step_.defined()) moved_off(step_.node().get(), next.node().get());
  for (Tensor& count : counts_)
    if (count.same(step_)) count = next;
  step_ = std::move(next);
}

void Optimizer::set_steps_taken(int64_t steps) {
  renew_step_count(steps);
  for (Tensor& count : counts_) {
    if (!count.same(step_)) moved_off(count.node().get(), step_.node().get());
    count = step_;
  }
}

int64_t Optimizer::steps_taken(size_t param_index) const {
  if (param_index >= params_.size())
    fail("{}: parameter index {} out of range ({} parameters)", kind_, param_index, params_.size());
  return static_cast<int64_t>(counts_[param_index].item());
}

void Optimizer::with_named_options(const std::vector<NamedOptions>& groups,
                                   const std::function<void()>& check) {
  Optimizer::set_named_options(groups);  // refuses any option: this rule has none to set
  check();
}

void Optimizer::set_named_options(const std::vector<NamedOptions>& groups) {
  check_options_count(groups.size());
  for (size_t g = 0; g < groups.size(); ++g)
    if (!groups[g].empty()) refuse_option(g, groups[g][0].first, false);
}

void Optimizer::check_options_count(size_t count) const {
  if (count != group_count())
    fail("{}: options for {} parameter groups, the optimizer has {}", kind_, count, group_count());
}

void Optimizer::refuse_option(size_t group, const std::string& name, bool known) const {
  if (known)
    fail("{}: group {}'s option '{}' is given a value of another kind", kind_, group, name);
  fail("{}: group {} has no option '{}'", kind_, group, name);
}

// Each rule's options by name, as torch's param_groups name them, but the rate: lr() and set_lr()
// carry it (the checkpoint's "lr" or "optimizer.param_groups").
OptionFields option_fields(SGDOptions& o) {
  return {{"momentum", &o.momentum},
          {"dampening", &o.dampening},
          {"weight_decay", &o.weight_decay},
          {"nesterov", &o.nesterov},
          {"maximize", &o.maximize}};
}
OptionFields option_fields(AdamOptions& o) {
  return {{"beta1", &o.beta1},     {"beta2", &o.beta2},
          {"eps", &o.eps},         {"weight_decay", &o.weight_decay},
          {"amsgrad", &o.amsgrad}, {"maximize", &o.maximize}};
}
OptionFields option_fields(RMSpropOptions& o) {
  return {{"alpha", &o.alpha},       {"eps", &o.eps},           {"weight_decay", &o.weight_decay},
          {"momentum", &o.momentum}, {"centered", &o.centered}, {"maximize", &o.maximize}};
}
OptionFields option_fields(AdagradOptions& o) {
  return {{"lr_decay", &o.lr_decay},
          {"weight_decay", &o.weight_decay},
          {"initial_accumulator_value", &o.initial_accumulator_value},
          {"eps", &o.eps},
          {"maximize", &o.maximize}};
}
OptionFields option_fields(LionOptions& o) {
  return {{"beta1", &o.beta1}, {"beta2", &o.beta2}, {"weight_decay", &o.weight_decay}};
}
OptionFields option_fields(AdafactorOptions& o) {
  return {{"eps1", &o.eps1},
          {"eps2", &o.eps2},
          {"clip_threshold", &o.clip_threshold},
          {"decay_rate", &o.decay_rate},
          {"beta1", &o.beta1},
          {"weight_decay", &o.weight_decay},
          {"scale_parameter", &o.scale_parameter},
          {"relative_step", &o.relative_step},
          {"warmup_init", &o.warmup_init}};
}

void Optimizer::set_steps_taken(size_t param_index, int64_t steps) {
  if (param_index >= params_.size())
    fail("{}: parameter index {} out of range ({} parameters)", kind_, param_index, params_.size());
  const int64_t taken = steps_taken();
  if (steps > taken)
    fail("{}: parameter {} cannot have taken {} steps, more than the optimizer's {}", kind_,
         param_index, steps, taken);
  Tensor& count = counts_[param_index];
  if (steps == taken) {
    if (!count.same(step_)) moved_off(count.node().get(), step_.node().get());
    count = step_;
    return;
  }
  Tensor next = stored_count(steps);
  // Parameters sharing the old count keep it; a replay plan that carried it for this one sees
  // the move off it.
  moved_off(count.node().get(), next.node().get());
  count = std::move(next);
}

SGD::SGD(std::vector<Tensor> params, SGDOptions options)
    : SGD(std::vector<ParamGroup<SGDOptions>>{{std::move(params), options}}) {}

SGD::SGD(std::vector<ParamGroup<SGDOptions>> groups) : OptimizerWith(std::move(groups), "SGD") {
  start_groups();
}

void SGD::resolve_options(SGDOptions& options) const {
  if (!finite_non_negative(options.momentum) || !finite_non_negative(options.weight_decay) ||
      !finite_non_negative(options.dampening))
    fail("SGD: momentum, dampening and weight_decay must be finite and >= 0");
  if (options.nesterov && (options.momentum <= 0 || options.dampening != 0))
    fail("SGD: Nesterov momentum requires a momentum > 0 and zero dampening");
}

std::vector<std::string> SGD::optional_state_names() const { return {"momentum_buffer"}; }

bool SGD::state_started(const NamedTensors& state) const {
  // A checkpoint of a zero buffer no real step made loads as no state, and starts as torch's.
  auto flag = std::find_if(state.begin(), state.end(),
                           [](const auto& entry) { return entry.first == kMomentumStarted; });
  return flag == state.end() || flag->second.item() != 0;
}

std::optional<std::vector<std::string>> SGD::state_names(size_t param_index) const {
  const size_t group = group_of(param_index);
  if (options(group).momentum != 0 || momentum_scheduled(group))
    return std::vector<std::string>{"momentum_buffer"};
  return std::vector<std::string>{};  // keeps none: any entry is refused
}

Tensor SGD::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const SGDOptions& options = group_options();
  Tensor g = rule_gradient(grad, param, options.maximize, options.weight_decay);
  // A cycled momentum (a schedule's graph value) replaces the option, as PyTorch's OneCycleLR
  // writes the group's momentum: then the buffer is kept even for a momentum option of 0.
  const Tensor& cycled = momentum_value();
  if (options.momentum != 0 || cycled.defined()) {
    auto momentum = [&](const Tensor& x) { return step_factor(cycled, options.momentum, x); };
    Tensor* previous = find_state(state, "momentum_buffer");
    // Without dampening the gradient's factor is 1, which mul_add leaves out (g * 1 is g, bit for
    // bit). The first buffer is a copy of the gradient, as torch.optim.SGD's clone: a compiled
    // step that hands the gradient back in place must not write the state too.
    Tensor buffer = !previous                ? g * step_constant(1, g)
                    : options.dampening == 0 ? mul_add({*previous, momentum(*previous), g})
                                             : lincomb({*previous, momentum(*previous), g,
                                                        step_constant(1.0 - options.dampening, g)});
    // The first update copies the gradient. A skipped first step leaves a zero buffer, which
    // with dampening would not update like that, so a flag records whether one really happened.
    const char* started = kMomentumStarted;
    Tensor* flag = find_state(state, started);
    if (flag) buffer = where(*flag, buffer, g);
    if (skip_flag().defined() && (flag || (!previous && options.dampening != 0)))
      set_state(state, started, ones({}, boolean));  // stays false while steps are skipped
    else if (flag)
      std::erase_if(state, [&](const auto& entry) { return entry.first == started; });
    set_state(state, "momentum_buffer", buffer);
    g = options.nesterov ? mul_add({buffer, momentum(buffer), g}) : buffer;
  }
  return sub_mul({param, g, step_scalar(lr_value(), g.dtype())});
}

Adam::Adam(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::vector<ParamGroup<AdamOptions>>{{std::move(params), options}}) {}

Adam::Adam(std::vector<ParamGroup<AdamOptions>> groups) : Adam(std::move(groups), "Adam", false) {}

Adam::Adam(std::vector<ParamGroup<AdamOptions>> groups, const char* kind, bool decoupled)
    : OptimizerWith(std::move(groups), kind), decoupled_(decoupled) {
  start_groups();
}

void Adam::resolve_options(AdamOptions& options) const {
  if (!(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1))
    fail("{}: betas must be in [0, 1), got ({}, {})", kind(), options.beta1, options.beta2);
  if (!(options.eps > 0) || !finite_non_negative(options.weight_decay.value_or(0)))
    fail("{}: eps must be > 0 and weight_decay >= 0", kind());
  if (!options.weight_decay) options.weight_decay = decoupled_ ? 0.01 : 0.0;
}

void Adam::begin_step() {
  const AdamOptions& options = group_options();
  // The bias corrections follow the step count in the graph (a skipped step does not advance
  // it), in f64 and in the same arrangement as torch.optim.Adam, rounded to the state's dtype
  // where they meet it, so results agree closely.
  const Tensor& t = step_number();
  // A cycled beta1 enters the bias correction as this step's beta1, as in torch.optim.Adam.
  beta1_ = momentum_value();
  rest1_ = beta1_.defined() ? 1.0 - beta1_ : Tensor();
  Tensor bias1 = bias_correction(beta1_, options.beta1, t);
  Tensor bias2 = bias_correction(Tensor(), options.beta2, t);
  inv_sqrt_bias2_ = 1.0 / sqrt(bias2);
  step_size_ = lr_value() / bias1;
  if (decoupled_ && *options.weight_decay != 0) decay_ = 1.0 - lr_value() * *options.weight_decay;
}

std::optional<std::vector<std::string>> Adam::state_names(size_t param_index) const {
  std::vector<std::string> names{"exp_avg", "exp_avg_sq"};
  if (options(group_of(param_index)).amsgrad) names.push_back("max_exp_avg_sq");
  return names;
}

void Adam::start_state(NamedTensors& state, const Tensor& grad) const {
  add_zero_state(state, "exp_avg", grad);
  add_zero_state(state, "exp_avg_sq", grad);
  if (group_options().amsgrad) add_zero_state(state, "max_exp_avg_sq", grad);
}

Tensor Adam::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const AdamOptions& options = group_options();
  // Fused arithmetic (dsl/ops.def): three nodes where single ops took fourteen, the same f32
  // operations in the same order. The running averages start at zero (start_state).
  Tensor g = rule_gradient(grad, param, options.maximize, decoupled_ ? 0 : *options.weight_decay);
  const Tensor& m_prev = started_state(state, "exp_avg");
  const Tensor& v_prev = started_state(state, "exp_avg_sq");
  Tensor rest1 = step_factor(rest1_, 1 - options.beta1, g);
  Tensor m = lincomb({m_prev, step_factor(beta1_, options.beta1, m_prev), g, rest1});
  Tensor rest2 = step_constant(1 - options.beta2, g);
  Tensor v = lincomb_square({v_prev, step_constant(options.beta2, v_prev), g, rest2});
  set_state(state, "exp_avg", m);
  set_state(state, "exp_avg_sq", v);
  Tensor denominator = v;  // AMSGrad divides by the largest exp_avg_sq so far
  if (options.amsgrad) {
    denominator = maximum(started_state(state, "max_exp_avg_sq"), v);
    set_state(state, "max_exp_avg_sq", denominator);
  }
  bool decays = decoupled_ && *options.weight_decay != 0;
  return adam_step({param, decays ? step_scalar(decay_, param.dtype()) : step_constant(1, param), m,
                    denominator, step_scalar(inv_sqrt_bias2_, v.dtype()),
                    step_constant(options.eps, v), step_scalar(step_size_, m.dtype())});
}

AdamW::AdamW(std::vector<Tensor> params, AdamOptions options)
    : AdamW(std::vector<ParamGroup<AdamOptions>>{{std::move(params), options}}) {}

AdamW::AdamW(std::vector<ParamGroup<AdamOptions>> groups)
    : Adam(std::move(groups), "AdamW", true) {}

RMSprop::RMSprop(std::vector<Tensor> params, RMSpropOptions options)
    : RMSprop(std::vector<ParamGroup<RMSpropOptions>>{{std::move(params), options}}) {}

RMSprop::RMSprop(std::vector<ParamGroup<RMSpropOptions>> groups)
    : OptimizerWith(std::move(groups), "RMSprop") {
  start_groups();
}

void RMSprop::resolve_options(RMSpropOptions& options) const {
  if (!(options.alpha >= 0 && options.alpha < 1))
    fail("RMSprop: alpha must be in [0, 1), got {}", options.alpha);
  if (!(options.eps > 0) || !finite_non_negative(options.weight_decay) ||
      !finite_non_negative(options.momentum))
    fail("RMSprop: eps must be > 0, weight_decay and momentum finite and >= 0");
}

bool RMSprop::keeps_momentum() const {
  return group_options().momentum > 0 || momentum_value().defined();
}

std::optional<std::vector<std::string>> RMSprop::state_names(size_t param_index) const {
  const size_t group = group_of(param_index);
  std::vector<std::string> names = {"square_avg"};
  if (options(group).centered) names.push_back("grad_avg");
  if (options(group).momentum > 0 || momentum_scheduled(group)) names.push_back("momentum_buffer");
  return names;
}

std::vector<std::string> RMSprop::optional_state_names() const {
  return {"grad_avg", "momentum_buffer"};
}

void RMSprop::start_state(NamedTensors& state, const Tensor& grad) const {
  const RMSpropOptions& options = group_options();
  // The running means and the momentum buffer start at zero, as torch's.
  add_zero_state(state, "square_avg", grad);
  if (options.centered) add_zero_state(state, "grad_avg", grad);
  if (keeps_momentum()) add_zero_state(state, "momentum_buffer", grad);
}

Tensor RMSprop::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const RMSpropOptions& options = group_options();
  Tensor g = rule_gradient(grad, param, options.maximize, options.weight_decay);
  auto running = [&](const char* name, bool squared) {
    const Tensor& previous = started_state(state, name);
    Tensor rest = step_constant(1 - options.alpha, g);
    Tensor mean = squared
                      ? lincomb_square({previous, step_constant(options.alpha, previous), g, rest})
                      : lincomb({previous, step_constant(options.alpha, previous), g, rest});
    set_state(state, name, mean);
    return mean;
  };
  Tensor square_avg = running("square_avg", true);
  Tensor root =
      options.centered ? sqrt(square_avg - square(running("grad_avg", false))) : sqrt(square_avg);
  Tensor avg = root + step_constant(options.eps, root);
  Tensor step = g / avg;
  if (keeps_momentum()) {
    const Tensor& previous = started_state(state, "momentum_buffer");
    Tensor momentum = step_factor(momentum_value(), options.momentum, previous);
    step = mul_add({previous, momentum, step});
    set_state(state, "momentum_buffer", step);
  }
  return sub_mul({param, step, step_scalar(lr_value(), step.dtype())});
}

Adagrad::Adagrad(std::vector<Tensor> params, AdagradOptions options)
    : Adagrad(std::vector<ParamGroup<AdagradOptions>>{{std::move(params), options}}) {}

Adagrad::Adagrad(std::vector<ParamGroup<AdagradOptions>> groups)
    : OptimizerWith(std::move(groups), "Adagrad") {
  start_groups();
}

void Adagrad::resolve_options(AdagradOptions& options) const {
  if (!(options.eps > 0) || !finite_non_negative(options.weight_decay) ||
      !finite_non_negative(options.lr_decay) ||
      !finite_non_negative(options.initial_accumulator_value))
    fail(
        "Adagrad: eps must be > 0, and lr_decay, weight_decay and initial_accumulator_value "
        "finite and >= 0");
}

std::optional<std::vector<std::string>> Adagrad::state_names(size_t) const {
  return std::vector<std::string>{"sum"};
}

Tensor Adagrad::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const AdagradOptions& options = group_options();
  Tensor g = rule_gradient(grad, param, options.maximize, options.weight_decay);
  Tensor sum = *find_state(state, "sum") + square(g);
  set_state(state, "sum", sum);
  Tensor root = sqrt(sum);
  Tensor ratio = g / (root + step_constant(options.eps, root));
  return sub_mul({param, ratio, step_scalar(step_lr_, g.dtype())});
}

void Adagrad::start_state(NamedTensors& state, const Tensor& grad) const {
  // Made before the first update, as torch's at construction: a skipped first step keeps the
  // initial value (a zero sum, made by the update, lost it).
  if (find_state(state, "sum")) return;
  Tensor initial = full(grad.shape(), group_options().initial_accumulator_value, grad.dtype());
  eval({initial});
  state.emplace_back("sum", from_storage(initial.node()->value, grad.shape()));
}

void Adagrad::begin_step() {
  // Once per step for all parameters: the learning rate follows the step count in the graph, in
  // f64 as torch's.
  step_lr_ = lr_value() / ((step_number() - 1.0) * group_options().lr_decay + 1.0);
}

Lion::Lion(std::vector<Tensor> params, LionOptions options)
    : Lion(std::vector<ParamGroup<LionOptions>>{{std::move(params), options}}) {}

Lion::Lion(std::vector<ParamGroup<LionOptions>> groups) : OptimizerWith(std::move(groups), "Lion") {
  start_groups();
}

void Lion::resolve_options(LionOptions& options) const {
  if (!(options.beta1 >= 0 && options.beta1 <= 1 && options.beta2 >= 0 && options.beta2 <= 1))
    fail("Lion: betas must be in [0, 1], got ({}, {})", options.beta1, options.beta2);
  if (!finite_non_negative(options.weight_decay))
    fail("Lion: weight_decay must be finite and >= 0");
}

void Lion::begin_step() {
  const double weight_decay = group_options().weight_decay;
  if (weight_decay != 0) decay_ = 1.0 - lr_value() * weight_decay;
  beta1_ = momentum_value();  // a cycled beta1, as lion-pytorch reads the group's betas
  rest1_ = beta1_.defined() ? 1.0 - beta1_ : Tensor();
}

std::optional<std::vector<std::string>> Lion::state_names(size_t) const {
  return std::vector<std::string>{"exp_avg"};
}

void Lion::start_state(NamedTensors& state, const Tensor& grad) const {
  add_zero_state(state, "exp_avg", grad);  // lion-pytorch starts the momentum at zeros
}

Tensor Lion::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const LionOptions& options = group_options();
  Tensor p = param;
  if (options.weight_decay != 0) p = p * step_scalar(decay_, p.dtype());
  const Tensor& m_prev = started_state(state, "exp_avg");
  auto mix = [&](const Tensor& beta, const Tensor& rest) {
    return lincomb({m_prev, beta, grad, rest});
  };
  auto fixed_mix = [&](double beta) {
    return mix(step_constant(beta, m_prev), step_constant(1 - beta, grad));
  };
  Tensor direction = sign(
      beta1_.defined() ? mix(step_scalar(beta1_, grad.dtype()), step_scalar(rest1_, grad.dtype()))
                       : fixed_mix(options.beta1));
  set_state(state, "exp_avg", fixed_mix(options.beta2));
  return sub_mul({p, direction, step_scalar(lr_value(), direction.dtype())});
}

Adafactor::Adafactor(std::vector<Tensor> params, AdafactorOptions options)
    : Adafactor(std::vector<ParamGroup<AdafactorOptions>>{{std::move(params), options}}) {}

Adafactor::Adafactor(std::vector<ParamGroup<AdafactorOptions>> groups)
    : OptimizerWith(std::move(groups), "Adafactor") {
  if (options(0).relative_step)
    own_rate_ =
        "relative_step computes the rate from the step count (construct Adafactor with "
        "relative_step = false and an lr to set one)";
  start_groups();
}

void Adafactor::resolve_options(AdafactorOptions& options) const {
  // The rate is the optimizer's or the rule's: one relative_step for all groups.
  if (options.relative_step != computes_own_rate())
    fail(
        "Adafactor: a group has relative_step = {} and group 0 {}; the groups either all compute "
        "their rate or all take an lr",
        options.relative_step, computes_own_rate());
  if (options.relative_step && options.lr)
    fail("Adafactor: lr = {} with relative_step, which computes the rate: pass one or the other",
         *options.lr);
  if (options.warmup_init && !options.relative_step)
    fail("Adafactor: warmup_init requires relative_step");
  if (!options.relative_step && !options.lr)
    fail("Adafactor: without relative_step an lr is required");
  if (!(options.eps1 >= 0) || !(options.eps2 >= 0) || !(options.clip_threshold > 0) ||
      !(options.weight_decay >= 0))
    fail("Adafactor: eps ({}, {}) and weight_decay must be >= 0, clip_threshold > 0", options.eps1,
         options.eps2);
  if (!(options.decay_rate <= 0))
    fail("Adafactor: decay_rate must be <= 0, got {}", options.decay_rate);
  if (options.beta1 && !(*options.beta1 >= 0 && *options.beta1 < 1))
    fail("Adafactor: beta1 must be in [0, 1), got {}", *options.beta1);
}

namespace {
// Adafactor's factored statistics: the squared gradient's mean over the last axis and over the
// one before it.
bool factored(const Shape& shape) { return shape.size() >= 2; }
Shape row_shape(const Shape& shape) { return Shape(shape.begin(), shape.end() - 1); }
Shape col_shape(const Shape& shape) {
  Shape out(shape.begin(), shape.end() - 2);
  out.push_back(shape.back());
  return out;
}
// Root mean square of all elements, as transformers' _rms: norm / sqrt(numel).
Tensor rms(const Tensor& x) {
  return sqrt(sum(square(x))) / std::sqrt(static_cast<double>(x.numel()));
}
}  // namespace

Shape Adafactor::state_shape(const std::string& name, const Shape& param) const {
  if (factored(param) && name == "exp_avg_sq_row") return row_shape(param);
  if (factored(param) && name == "exp_avg_sq_col") return col_shape(param);
  return param;
}

std::optional<std::vector<std::string>> Adafactor::state_names(size_t param_index) const {
  std::vector<std::string> names;
  if (factored(local_shape(param_index)))
    names = {"exp_avg_sq_row", "exp_avg_sq_col"};
  else
    names = {"exp_avg_sq"};
  if (options(group_of(param_index)).beta1) names.push_back("exp_avg");
  return names;
}

std::vector<std::string> Adafactor::optional_state_names() const { return {"exp_avg"}; }

void Adafactor::begin_step() {
  const AdafactorOptions& options = group_options();
  // transformers computes these in Python doubles from the step count.
  const Tensor& t = step_number();
  beta2t_ = 1.0 - pow(t, options.decay_rate);
  rest_ = 1.0 - beta2t_;
  if (options.relative_step) {
    Tensor least = options.warmup_init ? t * 1e-6 : full({}, 1e-2, f64);
    rate_ = minimum(least, 1.0 / sqrt(t));
  } else {
    rate_ = lr_value();
  }
}

Tensor Adafactor::update(const Tensor& param, const Tensor& grad, NamedTensors& state) {
  const AdafactorOptions& options = group_options();
  Tensor p = param.dtype() == f32 ? param : cast(param, f32);
  Tensor g = grad.dtype() == f32 ? grad : cast(grad, f32);
  // The rate is a 0-d f32 value per parameter: transformers multiplies the parameter's RMS (an
  // f32 tensor) by the relative step.
  Tensor lr = step_scalar(rate_, f32);
  if (options.scale_parameter) lr = maximum(rms(p), full({}, options.eps2, f32)) * lr;
  auto running = [&](const char* name, const Tensor& x) {
    Tensor* previous = find_state(state, name);
    Tensor part = x * step_scalar(rest_, f32);
    Tensor mean = previous ? *previous * step_scalar(beta2t_, f32) + part : part;
    set_state(state, name, mean);
    return mean;
  };
  Tensor squared = square(g) + step_constant(options.eps1, g);
  Tensor u;
  if (factored(p.shape())) {
    Tensor row = running("exp_avg_sq_row", mean(squared, {-1}));
    Tensor col = running("exp_avg_sq_col", mean(squared, {-2}));
    Tensor row_factor = unsqueeze(rsqrt(row / mean(row, {-1}, true)), -1);
    Tensor col_factor = unsqueeze(rsqrt(col), -2);
    u = row_factor * col_factor * g;
  } else {
    u = rsqrt(running("exp_avg_sq", squared)) * g;
  }
  u = u / maximum(rms(u) / options.clip_threshold, full({}, 1.0, f32));
  u = u * lr;
  if (options.beta1) {
    double beta1 = *options.beta1;
    Tensor* previous = find_state(state, "exp_avg");
    Tensor part = u * step_constant(1 - beta1, u);
    u = previous ? *previous * step_constant(beta1, *previous) + part : part;
    set_state(state, "exp_avg", u);
  }
  if (options.weight_decay != 0) p = p + p * (lr * -options.weight_decay);
  Tensor next = p - u;
  return next.dtype() == param.dtype() ? next : cast(next, param.dtype());
}

namespace {
void check_norm_type(const char* what, double norm_type) {
  if (!(norm_type > 0)) fail("{}: norm_type must be > 0 (or infinity), got {}", what, norm_type);
}
}  // namespace

Tensor grad_norm(const std::vector<Tensor>& params, double norm_type) {
  check_norm_type("grad_norm", norm_type);
  NoGradGuard no_grad;
  NoPolicyScope no_policy;  // squares in f32 under a pure-f16 scope too
  // Under ZeRO each process holds its shard of a gradient and zeros elsewhere: the squares of
  // those are summed over the processes (one all_reduce), the others' are the same everywhere.
  // Squares in f32, or in f64 where a gradient is f64 (f32 squares of its 1e20 were inf, and
  // clipping zeroed it).
  DType type = f32;
  for (const Tensor& p : params)
    if (p.grad().defined() && p.grad().dtype() == f64) type = f64;
  const bool largest = std::isinf(norm_type);
  // Each gradient's part: the sum of its |g|^p (squares for L2), or its largest |g|.
  auto part = [&](const Tensor& g) {
    Tensor x = cast(g, type);
    if (largest) return max(abs(x));
    if (norm_type == 2) return sum(square(x));
    if (norm_type == 1) return sum(abs(x));
    return sum(pow(abs(x), norm_type));
  };
  auto combine = [&](const Tensor& a, const Tensor& b) { return largest ? maximum(a, b) : a + b; };
  Tensor total, sharded;
  const bool processes = process_count() > 1;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    Tensor here = part(g);
    Tensor& into =
        processes && gradient_held_as_shards(p.node()->grad_owner.lock().get()) ? sharded : total;
    into = into.defined() ? combine(into, here) : here;
  }
  if (sharded.defined()) {
    // The largest over the processes: each process's, gathered; else their sum.
    sharded = largest ? max(all_gather(reshape(sharded, {1}))) : all_reduce(sharded);
    total = total.defined() ? combine(total, sharded) : sharded;
  }
  if (!total.defined()) return scalar(0.0);
  if (largest || norm_type == 1) return total;
  return norm_type == 2 ? sqrt(total) : pow(total, 1.0 / norm_type);
}

Tensor clip_grad_norm(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  if (!(max_norm > 0)) fail("clip_grad_norm: max_norm must be > 0, got {}", max_norm);
  check_norm_type("clip_grad_norm", norm_type);
  NoGradGuard no_grad;
  NoPolicyScope no_policy;
  bool any_grad = false;
  for (const Tensor& p : params) any_grad = any_grad || p.grad().defined();
  if (!any_grad) return scalar(0.0);
  Tensor norm = grad_norm(params, norm_type);
  Tensor coefficient = minimum(max_norm / (norm + 1e-6), scalar(1.0));
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    Tensor handle = p;
    handle.set_grad(g * cast(coefficient, g.dtype()));
  }
  return norm;
}

void clip_grad_value(const std::vector<Tensor>& params, double clip_value) {
  if (!(clip_value >= 0) || std::isinf(clip_value))
    fail("clip_grad_value: clip_value must be finite and >= 0, got {}", clip_value);
  NoGradGuard no_grad;
  NoPolicyScope no_policy;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    Tensor handle = p;
    handle.set_grad(clamp(g, -clip_value, clip_value));
  }
}

}  // namespace mixtape
