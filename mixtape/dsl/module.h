// mixtape/dsl/module.h -- mt::Module: named parameters, buffers and submodules, train/eval mode.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/tensor.h"

namespace mixtape {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

/// Base class of models. Modules are registered by reference and must stay where they are, so
/// they can be neither copied nor moved; use ModuleList for a variable number of children.
class Module {
 public:
  Module() = default;
  virtual ~Module();  // out of line: one vtable, in module.cpp
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// Every parameter of this module and its descendants, in registration order. A tensor
  /// registered under several names (a tied weight) is listed once, at its first name, as in
  /// PyTorch's Module.parameters(): an optimizer refuses a tensor listed twice, and
  /// clip_grad_norm would count its gradient twice.
  std::vector<Tensor> parameters() const;
  /// ("fc1.weight", tensor) pairs, names relative to this module; a tied weight under each of
  /// its names (a checkpoint stores every name).
  NamedTensors named_parameters() const;
  /// Every buffer, persistent or not (as PyTorch's named_buffers()).
  NamedTensors named_buffers() const;
  /// Parameters then the persistent buffers, by name: what checkpoints save and
  /// load_state_dict() takes.
  NamedTensors state_dict() const;
  /// Assigns each entry to the parameter or buffer of that name (shape and dtype must match;
  /// values are converted from other float dtypes). With strict, missing or unexpected names
  /// are an mt::Error that lists them; nothing is changed unless everything fits.
  void load_state_dict(const NamedTensors& state, bool strict = true);

  /// Converts every floating-point parameter and buffer to `dtype` in place (Tensor::convert),
  /// as PyTorch's module.to(dtype) (integer buffers are left): `net.to(mt::bf16)` makes a bf16
  /// model, whose parameters are then stored (and updated: dist::Zero keeps f32 master shards of
  /// them) in bf16. Their gradients are dropped. Convert before making the optimizer,
  /// dist::DataParallel or dist::Zero, which read the parameters' types when made.
  Module& to(DType dtype);

  void train(bool training = true);
  void eval() { train(false); }
  /// Read inside a step mt::compile traces, a later switch makes its next call trace again.
  bool is_training() const {
    note_training_read(training_);
    return *training_;
  }
  void zero_grad();

  /// Activation checkpointing of this module and everything inside it (mt::checkpoint of its
  /// path, dsl/activation_checkpointing.h): backward() recomputes its forward values from its
  /// inputs instead of keeping them. The path is taken now, so register the module first; the
  /// root module has none (checkpoint its children).
  void checkpoint(bool enabled = true) const;

  /// The dotted path from the root module ("blocks.0.attn"); "" for a root.
  std::string path() const;
  /// The path of a child or parameter name under this module.
  std::string child_path(const std::string& name) const;

 protected:
  /// Registers `child` under `name`; returns it.
  template <typename M>
  M& register_module(const std::string& name, M& child) {
    add_child(name, child);
    return child;
  }
  /// Registers a parameter (requires grad) and returns the handle to keep as a member.
  Tensor register_parameter(const std::string& name, Tensor value, bool requires_grad = true);
  /// A buffer: module state that is not a parameter (running statistics). A non-persistent one
  /// (persistent = false: a rotary table, a causal mask) is left out of state_dict(), so that
  /// checkpoints neither save nor expect it, as PyTorch's register_buffer(persistent=False).
  Tensor register_buffer(const std::string& name, Tensor value, bool persistent = true);
  /// Registers the member `*member` (which holds the initial value) under `name`: the module
  /// lists whatever the member holds when asked, so a tensor assigned to it later is the
  /// parameter, saved and optimized under that name, as PyTorch's attribute assignment (a tied
  /// weight: `lm_head.weight = wte.weight`; a loaded tensor put in place). The built-in layers
  /// register their weights so. `*member` must outlive the module's use (a field of it).
  void register_parameter(const std::string& name, Tensor* member, bool requires_grad = true);
  void register_buffer(const std::string& name, Tensor* member, bool persistent = true);
  /// Makes buffer `name` (registered) start at zeros where a state dict to load lacks it, as
  /// PyTorch's BatchNorm takes files from before its num_batches_tracked existed.
  void zero_when_missing(const std::string& name);
  /// Opens the module's forward (`auto scope = forward_scope();`): its path, for error messages
  /// and precision rules (ModulePathScope), and, while mt::compile traces, a check before each
  /// replay that every member registered by pointer still holds the tensor the trace read (a
  /// member assigned another tensor between calls makes the step trace again). The built-in
  /// layers open it; a module of your own that registers members by pointer should too. Open
  /// it once, around everything the forward does: activation checkpointing then recomputes each
  /// call of the module on its own (one that opens none, or several, is recomputed with the
  /// other calls in the call around it).
  ModulePathScope forward_scope() const;

 private:
  void add_child(const std::string& name, Module& child);
  void check_new_name(const std::string& name) const;
  enum class Listing { parameters, buffers, persistent_buffers, zero_when_missing };
  void collect(const std::string& prefix, Listing listing, NamedTensors& out) const;
  struct Registered;
  void adopt(const Registered& r) const;

  Module* parent_ = nullptr;
  std::string name_;
  std::vector<std::pair<std::string, Module*>> children_;
  // The registered tensors: members of the module (register_parameter(name, &member)), or the
  // handles the value forms registered, kept in owned_.
  struct Registered {
    std::string name;
    Tensor* tensor;
    bool persistent = true;          // buffers: saved by state_dict()
    bool zero_when_missing = false;  // buffers: zeros where a state dict lacks it
    // Parameters registered by pointer to train: the tensor the member held when last listed,
    // so that a tensor assigned to it since (a loaded one) becomes the parameter.
    bool trains = false;
    mutable std::weak_ptr<TensorImpl> listed{};
  };
  std::vector<Registered> parameters_, buffers_;
  // The members registered by pointer, shared with the replay checks of the steps mt::compile
  // traced reading them (forward_scope()); `alive` turns false when the module goes.
  struct Members {
    std::vector<const Tensor*> slots;
    bool alive = true;
    // The trace running when the module was made: a module the step makes itself (a layer
    // built inside the compiled function) lives only while that trace runs, and its values are
    // the trace's own, so there is nothing of it for a replay to check.
    const void* made_in_trace = trace_observer();
  };
  std::shared_ptr<Members> members_ = std::make_shared<Members>();
  std::deque<Tensor> owned_;
  // Shared with the steps mt::compile traced reading it (note_training_read).
  std::shared_ptr<bool> training_ = std::make_shared<bool>(true);
};

/// `index`, or an mt::Error naming it where it is not below `size` (ModuleList's operator[]).
size_t checked_index(size_t index, size_t size);

/// An indexable list of owned submodules, registered as "0", "1", ...
template <typename M>
class ModuleList : public Module {
 public:
  template <typename... Args>
  M& emplace_back(Args&&... args) {
    items_.push_back(std::make_unique<M>(std::forward<Args>(args)...));
    return register_module(std::to_string(items_.size() - 1), *items_.back());
  }
  size_t size() const { return items_.size(); }
  /// mt::Error for an index past the end, as torch's IndexError.
  M& operator[](size_t i) { return *items_[checked_index(i, items_.size())]; }
  const M& operator[](size_t i) const { return *items_[checked_index(i, items_.size())]; }
  auto begin() { return items_.begin(); }
  auto end() { return items_.end(); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::vector<std::unique_ptr<M>> items_;
};

}  // namespace mixtape
