// mixtape/dsl/module.cpp -- module registration, recursive parameter listing and state dicts.
#include "mixtape/dsl/module.h"

#include <algorithm>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "mixtape/dsl/activation_checkpointing.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/exception.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/orphan_parameters.h"

namespace mixtape {

Module::~Module() {
  members_->alive = false;
  // A child may outlive its parent (an encoder handed to a wrapper that goes first), and a
  // parent its child: neither keeps a pointer to the other.
  for (auto& [name, child] : children_)
    if (child->parent_ == this) child->parent_ = nullptr;
  if (parent_) {
    auto& siblings = parent_->children_;
    siblings.erase(std::remove_if(siblings.begin(), siblings.end(),
                                  [&](const auto& entry) { return entry.second == this; }),
                   siblings.end());
  }
}

void Module::checkpoint(bool enabled) const {
  const std::string glob = path();
  if (glob.empty())
    fail("Module::checkpoint: a root module has no path; checkpoint its children instead");
  if (enabled)
    mixtape::checkpoint(glob);
  else
    remove_checkpoint(glob);
}

void Module::check_new_name(const std::string& name) const {
  if (name.empty() || name.find('.') != std::string::npos)
    fail("Module: invalid name '{}' (must be non-empty and contain no '.')", name);
  auto taken = [&](const std::vector<Registered>& list) {
    return std::any_of(list.begin(), list.end(),
                       [&](const Registered& r) { return r.name == name; });
  };
  const bool child = std::any_of(children_.begin(), children_.end(),
                                 [&](const auto& entry) { return entry.first == name; });
  if (child || taken(parameters_) || taken(buffers_))
    fail("Module '{}': the name '{}' is already registered", path(), name);
}

void Module::add_child(const std::string& name, Module& child) {
  check_new_name(name);
  if (&child == this) fail("Module '{}': cannot register a module as its own child", path());
  for (const Module* above = parent_; above; above = above->parent_)
    if (above == &child)
      fail("Module '{}': cannot register '{}', which contains it, as its child", path(), name);
  if (child.parent_) fail("Module: '{}' is already registered as '{}'", name, child.path());
  child.parent_ = this;
  child.name_ = name;
  children_.emplace_back(name, &child);
}

namespace {
// A registered tensor as the module keeps it: a leaf (an initializer's randn * std keeps its
// values, not its graph), requiring grad where asked.
Tensor registered_leaf(const Module& module, const char* what, const std::string& name,
                       Tensor value, bool requires_grad) {
  if (!value.defined()) fail("Module '{}': {} '{}' is undefined", module.path(), what, name);
  if (requires_grad && !is_floating(value.dtype()))
    fail("Module '{}': {} '{}' is {}, but only floating-point tensors can require grad",
         module.path(), what, name, mixtape::name(value.dtype()));
  // A leaf of the module's own on the value's buffer where the value is no leaf (made where
  // the value was, which the orphan warning names), or where it trains and should not (a
  // frozen parameter on a trainable tensor's values: the tensor itself keeps training).
  if (!value.is_leaf() || (!requires_grad && value.requires_grad())) {
    mixtape::eval({value});
    value = from_storage(value.node()->value, value.shape(), value.node()->origin.location);
  }
  if (requires_grad) value.requires_grad_(true);
  return value;
}
}  // namespace

Tensor Module::register_parameter(const std::string& name, Tensor value, bool requires_grad) {
  check_new_name(name);
  owned_.push_back(registered_leaf(*this, "parameter", name, std::move(value), requires_grad));
  // Frozen ones too: a tensor tied to one (adopt) keeps its flag, as torch's Parameter does.
  note_module_parameter(owned_.back(), name);
  parameters_.push_back({.name = name, .tensor = &owned_.back()});
  return owned_.back();
}

Tensor Module::register_buffer(const std::string& name, Tensor value, bool persistent) {
  check_new_name(name);
  owned_.push_back(registered_leaf(*this, "buffer", name, std::move(value), false));
  buffers_.push_back({.name = name, .tensor = &owned_.back(), .persistent = persistent});
  return owned_.back();
}

void Module::register_parameter(const std::string& name, Tensor* member, bool requires_grad) {
  check_new_name(name);
  *member = registered_leaf(*this, "parameter", name, *member, requires_grad);
  note_module_parameter(*member, name);  // frozen ones too, as above
  parameters_.push_back(
      {.name = name, .tensor = member, .trains = requires_grad, .listed = member->impl()});
  members_->slots.push_back(member);
}

void Module::register_buffer(const std::string& name, Tensor* member, bool persistent) {
  check_new_name(name);
  *member = registered_leaf(*this, "buffer", name, *member, false);
  buffers_.push_back({.name = name, .tensor = member, .persistent = persistent});
  members_->slots.push_back(member);
}

namespace {
// A step that read a module's members replays while each still holds the tensor the trace read.
class MembersHook final : public StepHook {
 public:
  MembersHook(std::shared_ptr<const void> owner, const std::vector<const Tensor*>& slots,
              const bool& alive)
      : owner_(std::move(owner)), slots_(slots), alive_(alive) {
    for (const Tensor* slot : slots_) read_.push_back(slot->identity());
  }
  const char* stale() const override {
    if (!alive_) return "a module it read was destroyed";
    for (size_t i = 0; i < read_.size(); ++i)  // members registered since are not the trace's
      if (slots_[i]->identity() != read_[i])
        return "a module's parameter or buffer was assigned another tensor since the trace";
    return nullptr;
  }
  void ran(const std::vector<std::shared_ptr<Storage>>&) override {}

 private:
  std::shared_ptr<const void> owner_;  // keeps slots_ and alive_ readable after the module goes
  const std::vector<const Tensor*>& slots_;
  const bool& alive_;
  std::vector<const void*> read_;
};
}  // namespace

ModulePathScope Module::forward_scope() const {
  if (trace_observer() && !members_->slots.empty() && members_->made_in_trace != trace_observer())
    on_each_call(std::make_shared<MembersHook>(members_, members_->slots, members_->alive));
  return ModulePathScope(path());
}

void Module::zero_when_missing(const std::string& name) {
  auto found = std::find_if(buffers_.begin(), buffers_.end(),
                            [&](const Registered& r) { return r.name == name; });
  if (found == buffers_.end()) fail("Module '{}': no buffer '{}' is registered", path(), name);
  found->zero_when_missing = true;
}

void Module::collect(const std::string& prefix, Listing listing, NamedTensors& out) const {
  const bool buffers = listing != Listing::parameters;
  for (const Registered& r : buffers ? buffers_ : parameters_) {
    if (listing == Listing::persistent_buffers && !r.persistent) continue;
    if (listing == Listing::zero_when_missing && !(r.persistent && r.zero_when_missing)) continue;
    // A member assigned an undefined tensor after registration.
    if (!r.tensor->defined())
      fail("Module '{}': {} '{}' is undefined", path(), buffers ? "buffer" : "parameter", r.name);
    if (r.trains && r.listed.lock() != r.tensor->impl()) adopt(r);
    out.emplace_back(prefix + r.name, *r.tensor);
  }
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", listing, out);
}

// A tensor assigned to a trainable parameter member since it was last listed is the parameter
// (module.h), as torch's attribute assignment of an nn.Parameter: a plain leaf that requires no
// grad (one loaded from a file) is made to require it, or it would silently never train. A
// parameter keeps its flag: one the user froze in place, or another module's frozen one tied to
// this member, stays frozen.
void Module::adopt(const Registered& r) const {
  Tensor& value = *r.tensor;
  // A computed value (w.detach(), w * 2) has no gradient of its own: assigned to a parameter it
  // never trained, silently. Refused, as torch refuses to assign a plain tensor to a parameter.
  if (!value.is_leaf())
    fail(
        "Module '{}': parameter '{}' was assigned a computed tensor ({} built at {}), which "
        "would never train; assign a leaf (a loaded or created tensor, another parameter), or "
        "give the parameter new values with {}.assign(value)",
        path(), r.name, op_name(value.node()->op), short_location(value.node()->origin.location),
        r.name);
  if (value.is_leaf() && is_floating(value.dtype()) && !value.requires_grad() &&
      !is_module_parameter(value)) {
    value.requires_grad_(true);
    note_module_parameter(value, r.name);
  }
  r.listed = value.impl();
}

size_t checked_index(size_t index, size_t size) {
  if (index >= size) fail("ModuleList: index {} is out of range for {} modules", index, size);
  return index;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  std::unordered_set<const void*> listed;
  for (auto& [name, tensor] : named_parameters())
    if (listed.insert(tensor.identity()).second) out.push_back(tensor);
  return out;
}

NamedTensors Module::named_parameters() const {
  NamedTensors out;
  collect("", Listing::parameters, out);
  return out;
}

NamedTensors Module::named_buffers() const {
  NamedTensors out;
  collect("", Listing::buffers, out);
  return out;
}

NamedTensors Module::state_dict() const {
  NamedTensors out = named_parameters();
  collect("", Listing::persistent_buffers, out);
  return out;
}

void Module::load_state_dict(const NamedTensors& state, bool strict) {
  NamedTensors own = state_dict();
  std::vector<std::pair<Tensor, Tensor>> assignments;
  std::vector<std::string> missing, unexpected, mismatched;
  // By name, so that matching is linear in the entries (a scan for each was quadratic: seconds
  // for 64k entries).
  std::unordered_map<std::string_view, const Tensor*> given;
  for (const auto& [name, value] : state)
    if (!given.emplace(name, &value).second)
      fail("load_state_dict: the entry '{}' is given twice", name);
  NamedTensors optional;
  collect("", Listing::zero_when_missing, optional);
  std::unordered_set<std::string_view> own_names, zero_names;
  for (const auto& [name, target] : optional) zero_names.insert(name);
  for (const auto& [name, target] : own) {
    own_names.insert(name);
    auto found = given.find(name);
    if (found == given.end()) {
      if (zero_names.count(name))
        assignments.emplace_back(target, zeros(target.shape(), target.dtype()));
      else
        missing.push_back(name);
      continue;
    }
    const Tensor& value = *found->second;
    // Floats convert to floats and integers to integers (an i32 count into an i64 buffer), as
    // torch's copy_ takes them.
    auto integer = [](DType t) { return !is_floating(t) && t != boolean; };
    bool convertible =
        value.defined() && (value.dtype() == target.dtype() ||
                            (is_floating(value.dtype()) && is_floating(target.dtype())) ||
                            (integer(value.dtype()) && integer(target.dtype())));
    if (!convertible || value.shape() != target.shape()) {
      mismatched.push_back(fmt::format("{} (expected {} {}, got {} {})", name,
                                       to_string(target.shape()), mixtape::name(target.dtype()),
                                       value.defined() ? to_string(value.shape()) : "undefined",
                                       value.defined() ? mixtape::name(value.dtype()) : ""));
      continue;
    }
    assignments.emplace_back(target, value);
  }
  for (const auto& [name, value] : state)
    if (!own_names.count(name)) unexpected.push_back(name);
  if (!mismatched.empty())
    fail("load_state_dict: shape or dtype mismatch for {}", fmt::join(mismatched, "; "));
  if (strict && (!missing.empty() || !unexpected.empty()))
    fail("load_state_dict: missing keys [{}], unexpected keys [{}]", fmt::join(missing, ", "),
         fmt::join(unexpected, ", "));
  // Every value is computed before any is assigned: one that fails to evaluate changes nothing.
  std::vector<Tensor> values;
  for (auto& [target, value] : assignments) values.push_back(cast(value, target.dtype()));
  mixtape::eval(values);
  for (size_t i = 0; i < assignments.size(); ++i) Tensor(assignments[i].first).assign(values[i]);
}

Module& Module::to(DType dtype) {
  if (!is_floating(dtype))
    fail("Module::to: converts to a floating-point type, not {}", name(dtype));
  // Checked before any is converted, so that a failure leaves no mixed module. An evaluation
  // settles the values assigned later (batch norm's running statistics after a forward).
  NamedTensors all = named_parameters();
  collect("", Listing::buffers, all);  // non-persistent buffers too, as PyTorch's to()
  std::vector<Tensor> pending;
  for (const auto& [path, value] : all)
    if (!value.is_leaf()) pending.push_back(value);
  if (!pending.empty()) mixtape::eval(pending);
  for (const auto& [path, value] : all)
    if (is_floating(value.dtype()) && !value.is_leaf())
      fail("Module::to: '{}' is the result of '{}', not a leaf (assign it its value first)", path,
           op_name(value.node()->op));
  for (const auto& [path, value] : all)
    if (is_floating(value.dtype())) Tensor(value).convert(dtype);
  return *this;
}

void Module::train(bool training) {
  *training_ = training;
  for (auto& [name, child] : children_) child->train(training);
}

void Module::zero_grad() {
  for (Tensor& p : parameters()) p.zero_grad();
}

std::string Module::path() const {
  if (!parent_) return "";
  std::string parent_path = parent_->path();
  return parent_path.empty() ? name_ : parent_path + "." + name_;
}

std::string Module::child_path(const std::string& name) const {
  std::string own = path();
  return own.empty() ? name : own + "." + name;
}

}  // namespace mixtape
