// mixtape/dsl/optim.h -- optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, Lion, Adafactor) as DSL
// code over persistent fp32 state, and gradient clipping. Schedules: dsl/lr_schedule.h.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "mixtape/dsl/lr_schedule.h"
#include "mixtape/dsl/module.h"

namespace mixtape {

/// The state entry of a half parameter's f32 master copy under ZeRO (dist::Zero). A plain rule
/// holding ZeRO's gathered state carries it for the ZeRO run that takes the state back.
inline constexpr const char* kMasterWeightEntry = "master";

/// A parameter group, as torch.optim's param_groups: parameters updated with options of their
/// own (weight decay on the weight matrices only, a smaller rate for pretrained layers). Each
/// group carries its whole options; copy a base and change what differs:
///   mt::AdamOptions decay{.lr = 6e-4, .weight_decay = 0.1}, no_decay = decay;
///   no_decay.weight_decay = 0;
///   mt::AdamW opt({{matrices, decay}, {biases_and_norms, no_decay}});
template <class Options>
struct ParamGroup {
  std::vector<Tensor> params;
  Options options;
};

/// Base of all optimizers: holds the parameters, in one or more groups, and their per-parameter
/// state tensors. Each tensor may be listed once, in one group (mt::Error otherwise);
/// Module::parameters() lists a tied weight once. params() lists the groups' parameters in
/// order, group after group; parameter indices are places in that list. step() builds every
/// update as graph code and evaluates them together as one program.
/// One option of a parameter group by name (a checkpoint's "optimizer.options", as torch's
/// param_groups hold every hyperparameter): a number, an optional number, or a flag.
using OptionValue = std::variant<double, std::optional<double>, bool>;
using NamedOptions = std::vector<std::pair<std::string, OptionValue>>;
/// Where each option of an Options struct but the rate lives, by name, in declaration order
/// (optim.cpp has one list per rule; a rule of one's own whose options have none saves none).
using OptionField = std::variant<double*, std::optional<double>*, bool*>;
using OptionFields = std::vector<std::pair<const char*, OptionField>>;

class Optimizer {
 public:
  /// The parameters of each group (at least one parameter in all, a group may be empty).
  Optimizer(std::vector<std::vector<Tensor>> groups, const char* kind);
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// Updates every parameter that has a gradient.
  void step();
  /// step() predicated on a graph value: `skip` is a single-element bool (or numeric, non-zero
  /// meaning skip) tensor that is evaluated in the same program as the update, never read on the
  /// host. Every new parameter, state tensor and the step count is where(skip, old, new), so a
  /// skipped step leaves all of them bit-identical. (State a parameter has not had yet is created
  /// as zeros by a skipped step; the next real step still acts as a first step.) GradScaler uses
  /// this to skip non-finite steps.
  void step_unless(const Tensor& skip);
  /// The same, also evaluating `also` in that program (GradScaler's pending scale update).
  void step_unless(const Tensor& skip, const std::vector<Tensor>& also);
  void zero_grad();
  /// The number of parameter groups (1 for an optimizer made from one parameter list).
  size_t group_count() const { return groups_.size(); }
  /// The group parameter `param_index` belongs to.
  size_t group_of(size_t param_index) const;
  /// The rate set_lr() set last for `group` (with a schedule attached, current_lr() is the one
  /// in use).
  double lr(size_t group = 0) const { return checked_group(group).lr; }
  /// The leaves holding the rate set_lr() set for `group`, as f64 and rounded to f32, which a
  /// step without a schedule reads (an exported step keeps them as state that NAME_load sets);
  /// undefined where the rule computes its own rate.
  std::pair<Tensor, Tensor> rate_leaves(size_t group) const {
    const Group& own = checked_group(group);
    return {own.lr_value, own.lr_f32};
  }
  /// Whether the rule computes its own rate (Adafactor's relative_step): no set_lr() then.
  bool computes_own_rate() const { return own_rate_ != nullptr; }
  /// Sets every group's rate; takes effect at the next step. The rate is a graph input
  /// (lr_value()), written in place, so a step compiled by mt::compile follows a schedule set
  /// outside it (set_lr(s.lr(step)) between calls). Called inside a compiled function, it keeps
  /// that function traced on every call. An mt::Error while a schedule is attached: the schedule
  /// would override it.
  void set_lr(double lr);
  /// The same for one group, as torch's `optimizer.param_groups[group]["lr"] = lr`.
  void set_lr(size_t group, double lr);
  /// Attaches a schedule to every group, computed inside every step's graph: update number t
  /// (0-based, the step count before it) uses schedule->graph_lr(t), a graph value that follows
  /// the optimizer's step count, so mt::compile replays advance it, and a checkpoint, which
  /// restores the count, resumes it. A skipped step (step_unless) does not advance it. nullptr
  /// detaches it; the rate is then set_lr()'s again. Call it outside a compiled function: a
  /// compiled one traces again.
  void set_schedule(std::shared_ptr<const LRSchedule> schedule);
  /// The same for one group. A schedule gives rates, not factors: groups that run at different
  /// rates under one shape of schedule each get a schedule of their own (torch's schedulers
  /// scale each group's initial rate instead).
  void set_schedule(size_t group, std::shared_ptr<const LRSchedule> schedule);
  const std::shared_ptr<const LRSchedule>& schedule(size_t group = 0) const {
    return checked_group(group).schedule;
  }
  /// The rate the next step uses for `group`, a 0-d f64 graph value (item() reads it: a host
  /// sync).
  Tensor current_lr(size_t group = 0) const;
  /// The momentum (SGD, RMSprop) or beta1 (the Adam family, Lion) the next step uses for `group`
  /// when its schedule cycles it (OneCycleLR's cycle_momentum), a 0-d f64 graph value; undefined
  /// when the optimizer's own option is in use.
  Tensor current_momentum(size_t group = 0) const;
  /// Whether the rule has a momentum or beta1 that a schedule may cycle.
  virtual bool has_momentum() const { return false; }
  /// Updates taken so far, skipped ones not counted: the steps that updated any parameter. The
  /// count lives in the graph (so that a predicated step can follow it without a host read):
  /// this call evaluates and reads it, a host sync. Schedules follow it.
  int64_t steps_taken() const;
  /// The same count as a 0-d f64 graph value, persistent between steps.
  const Tensor& step_count() const { return step_; }
  /// The updates parameter `param_index` took: steps_taken() less the steps in which it had no
  /// gradient, as torch's optimizers count each parameter's "step" (a parameter frozen for a
  /// while, or not reached by some steps' losses). Adam's bias corrections, Adagrad's lr_decay
  /// and Adafactor's decay follow it. A host sync.
  int64_t steps_taken(size_t param_index) const;
  /// The same count as a 0-d f64 graph value: step_count() itself while the parameter took every
  /// update.
  const Tensor& step_count(size_t param_index) const { return counts_.at(param_index); }
  /// "SGD", "Adam", "AdamW", ...: checkpoints record it so state is not loaded into another kind.
  const char* kind() const { return kind_; }
  const std::vector<Tensor>& params() const { return params_; }

  /// Per-parameter state ("exp_avg", "exp_avg_sq", "momentum_buffer"), for checkpoints. Empty
  /// for a parameter never stepped (SGD's also where skipped steps made its zero buffer); other
  /// rules hand out the initial state skipped steps made, which load_checkpoint leaves aside
  /// beside a step count of 0.
  NamedTensors state(size_t param_index) const;
  /// mt::Error, changing nothing, unless `state` could be this optimizer's state for parameter
  /// `param_index`: every entry defined, floating point and of the parameter's shape, with values
  /// the update rule can produce (Adam's exp_avg_sq is a mean of squares, so no element is below
  /// zero), and, unless allow_nonfinite, no NaN or infinity. Messages name an entry as
  /// `prefix + name` (a checkpoint passes "optimizer.<parameter path>.").
  void check_state(size_t param_index, const NamedTensors& state, bool allow_nonfinite = false,
                   const std::string& prefix = "") const;
  /// The shape state entry `name` has for a parameter of shape `param`: the parameter's, except
  /// for factored state (Adafactor's row and column statistics).
  virtual Shape state_shape(const std::string& name, const Shape& param) const;
  /// The shape of the part of parameter `param_index` that this optimizer updates and keeps
  /// state for: the parameter's own, except under ZeRO (dist::Zero), where it is this process's
  /// shard of it, flattened ({0} where it holds none).
  virtual Shape local_shape(size_t param_index) const;
  /// The names of the state entries the rule keeps for parameter `param_index` once it has
  /// stepped it (those starting with '~' excepted): a state to load holds all of them or none
  /// (a parameter never stepped), and no others; an empty list for a rule that keeps none (SGD
  /// without momentum), so that any entry is refused. nullopt for a rule that does not say.
  virtual std::optional<std::vector<std::string>> state_names(size_t param_index) const;
  /// The entries a rule keeps only under some options (SGD's and RMSprop's momentum_buffer,
  /// RMSprop's grad_avg, Adafactor's exp_avg): state made before set_options() turned one on
  /// may lack it (a parameter not stepped since), which then starts as the rule starts it.
  /// (set_options() drops the entries the new options do not keep.)
  virtual std::vector<std::string> optional_state_names() const { return {}; }
  /// The bytes of that state (of its local_shape() part, each entry in entry_dtype()): what
  /// memory_report counts before the first step makes them.
  int64_t state_bytes(size_t param_index) const;
  /// The type of that state as the first step makes it: the parameter's (the rules compute in
  /// their parameter's type, as torch's), f32 where a rule computes in f32 (Adafactor, ZeRO's
  /// master shards). load_state() keeps loaded state in it, or in the state's own type where
  /// that is wider.
  virtual DType state_dtype(size_t param_index) const;
  /// The type the first step makes entry `name` of that state in: state_dtype(), but for an
  /// entry a rule keeps in another (NAdam's mu_product, in f32 at least).
  virtual DType entry_dtype(size_t param_index, const std::string& /*name*/) const {
    return state_dtype(param_index);
  }
  /// The type load_state() keeps state of type `given` in.
  DType loaded_dtype(size_t param_index, DType given) const;
  /// Restores state saved by state(), after check_state().
  void load_state(size_t param_index, const NamedTensors& state, bool allow_nonfinite = false);
  /// Sets the optimizer's step count and every parameter's.
  void set_steps_taken(int64_t steps);
  /// Sets parameter `param_index`'s count, at most steps_taken() (call set_steps_taken(steps)
  /// first).
  void set_steps_taken(size_t param_index, int64_t steps);

  /// Group `group`'s options by name but the rate (which lr() and set_lr() carry): what a
  /// checkpoint saves so that a resume restores every hyperparameter, as torch's
  /// load_state_dict does. Empty for a rule whose options list no fields.
  virtual NamedOptions named_options(size_t /*group*/) const { return {}; }
  /// Runs `check` with each group's options replaced by `groups` (named_options() of every
  /// group, over the options each has), then puts the old ones back: a file's state is checked
  /// under the options it will restore before anything changes. mt::Error, changing nothing,
  /// for a list of another length, a name the rule does not know, a value of another kind, or
  /// options the rule refuses.
  virtual void with_named_options(const std::vector<NamedOptions>& groups,
                                  const std::function<void()>& check);
  /// Sets each group's options from `groups` as set_options() does (with_named_options()
  /// checks them).
  virtual void set_named_options(const std::vector<NamedOptions>& groups);

 protected:
  /// Adds a group of parameters after the others, without state and with no updates taken (the
  /// optimizer's count while it has taken none either); returns its index. The body of the rules'
  /// add_param_group(), which then adds the group's options and rate.
  size_t add_group(std::vector<Tensor> params);
  /// Why groups cannot be added after construction, or nullptr where they can.
  virtual const char* fixed_groups() const { return nullptr; }
  /// mt::Error unless `lr` is a learning rate (finite, >= 0), as set_lr() checks it.
  void check_lr(double lr) const;
  /// For OptimizerWith's named options: mt::Error unless `count` is group_count(); mt::Error for
  /// option `name` of `group`, which the rule has (of another kind) or not (`known`).
  void check_options_count(size_t count) const;
  [[noreturn]] void refuse_option(size_t group, const std::string& name, bool known) const;
  /// After options a step reads as C++ values changed: a compiled step traces again.
  void options_changed();
  /// Drops the state entries of `group`'s parameters that state_names() no longer lists (after
  /// set_options() turned momentum off, say), so that the state is one its options keep.
  void drop_unused_state(size_t group);
  /// mt::Error for a group index out of range.
  void check_group(size_t group) const;
  /// Called once per step before the update() calls, when step_number() and group_in_use() are
  /// set.
  virtual void begin_step() {}
  /// Called before each update() with the parameter's persistent state and the gradient
  /// update() will get: adds, with add_zero_state(), the entries that start at zero (torch
  /// creates them as zeros at the first step) where they are missing. The first step then
  /// builds the graph of every later one, so it runs the same kernels (none compiled for it
  /// alone), and writes its new state into those buffers in place.
  virtual void start_state(NamedTensors& state, const Tensor& grad) const;
  /// Adds entry `name` to `state` as zeros of `like`'s shape and dtype (stored values, not a
  /// fill the kernels would fold in), unless it is there.
  static void add_zero_state(NamedTensors& state, std::string_view name, const Tensor& like);
  /// The updated parameter for `param` with gradient `grad`; writes new state into `state`.
  /// State entries whose names start with '~' are private to the optimizer: state() leaves
  /// them out and load_state() drops them.
  virtual Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) = 0;
  /// The part of `whole` (parameter `param_index` or its gradient) that update() sees: all of
  /// it, except under ZeRO (dist::Zero), where it is this process's shard, flattened, or an
  /// undefined Tensor where the process holds none of the parameter.
  virtual Tensor local_part(size_t param_index, const Tensor& whole) const;
  /// Makes the updated parameters' new values (new_params[k] for params()[updated[k]]) from
  /// what update() returned for their local parts: nothing to do, except under ZeRO, where the
  /// processes' shards are gathered (and entries left undefined, a parameter this process holds
  /// none of, are filled in).
  virtual void assemble(const std::vector<size_t>& updated, std::vector<Tensor>& new_params);
  /// Why `values` (host values of a state entry `name`, as check_state() found them) cannot be
  /// state this rule produced, or "" when they can. Non-finite values are checked before. By
  /// default: an element outside the range state_range() gives the entry.
  virtual std::string impossible_state(const std::string& name, const Storage& values) const;
  /// Whether `state` (a parameter's, '~' entries included) has been stepped: false where only
  /// skipped steps made it, and a rule's first real step would not treat it as it treats state
  /// it already stepped (SGD's dampened first momentum). state() then hands out none.
  virtual bool state_started(const NamedTensors&) const { return true; }
  /// Inside begin_step()/update(): the 1-based number of the update being built for the
  /// parameters being updated, a 0-d f64 graph value (their persistent count plus one).
  /// begin_step() is called once for each set of parameters that share a count (usually all)
  /// and a group, before their update() calls.
  const Tensor& step_number() const { return next_step_; }
  /// Inside begin_step()/update()/start_state(): the group of the parameters being updated.
  size_t group_in_use() const { return group_in_use_; }
  /// Inside update(): the bool skip flag of a predicated step; undefined for a plain step().
  const Tensor& skip_flag() const { return skip_; }
  /// The learning rate of group_in_use() as a 0-d f64 value, for begin_step() and update(): a
  /// leaf whose storage holds lr(), or, with a schedule attached, the schedule's graph value for
  /// this step.
  const Tensor& lr_value() const {
    const Group& group = groups_[group_in_use_];
    return group.scheduled_lr.defined() ? group.scheduled_lr : group.lr_value;
  }
  /// For begin_step() and update() of a rule with has_momentum(): the schedule's momentum for
  /// this step in group_in_use(), a 0-d f64 value, or undefined when the rule's own option holds.
  const Tensor& momentum_value() const { return groups_[group_in_use_].scheduled_momentum; }
  /// Whether the schedule of `group` gives a rule with has_momentum() its momentum (whose buffer
  /// it then keeps even for a momentum option of 0): what momentum_value() is defined by, outside
  /// a step.
  bool momentum_scheduled(size_t group) const;
  /// Set by an optimizer that computes its own rate (Adafactor's relative_step): set_lr(),
  /// set_schedule() and current_lr() are then an mt::Error saying this.
  const char* own_rate_ = nullptr;
  /// Inside update(): `value` as a 0-d fill of `like`'s dtype (what `like * value` would make of
  /// the number), one node per step for all parameters of that dtype. The fused update ops
  /// (mt::lincomb, mt::adam_step, ...) read a 0-d operand at every element without a broadcast
  /// node: the traced loop builds every step's update anew, and a node per parameter and
  /// constant was most of its graph.
  Tensor step_constant(double value, const Tensor& like, const Loc& loc = Loc::current());
  /// Inside update(): a 0-d value (the learning rate, or one begin_step() made) cast to `dtype`,
  /// 0-d as step_constant()'s; the cast of a value begin_step() made is shared by all parameters
  /// of that dtype.
  Tensor step_scalar(const Tensor& scalar, DType dtype, const Loc& loc = Loc::current());
  /// Inside update(): a factor a schedule may cycle (a momentum, a beta1, or 1 - beta1):
  /// step_scalar(cycled, like's dtype) where begin_step() made `cycled`, else
  /// step_constant(fixed, like).
  Tensor step_factor(const Tensor& cycled, double fixed, const Tensor& like,
                     const Loc& loc = Loc::current());
  /// Inside update(): grad + param * weight_decay (an L2 penalty, as torch's optimizers add it
  /// without decoupling), one fused node.
  Tensor with_l2_penalty(const Tensor& grad, const Tensor& param, double weight_decay);
  /// Inside update(): the gradient a rule steps along, as torch's rules make it: negated for
  /// `maximize` (ascent), then with_l2_penalty() where weight_decay is not 0.
  Tensor rule_gradient(const Tensor& grad, const Tensor& param, bool maximize, double weight_decay);

 private:
  // The nodes step_constant() and step_scalar() share within a step, by what they hold (a
  // number's bits or a scalar's node) and dtype; dropped when the step ends. Kept from step to
  // step, so that a step allocates nothing for it once the first one has run.
  struct Shared {
    uint64_t what = 0;
    bool number = false;
    DType dtype = f32;
    Tensor value;
  };
  template <typename Make>
  Tensor shared(uint64_t what, bool number, DType dtype, Make make);
  void drop_shared();
  std::vector<Shared> shared_;  // this step's entries first, then spares from earlier steps
  size_t shared_count_ = 0;
  // What a parameter group has of its own besides the rule's options.
  struct Group {
    double lr = 0;
    Tensor lr_value;
    // The rate already in f32, a leaf set_lr() writes beside lr_value: step_scalar() returns it
    // instead of casting the f64 rate for each parameter every step (a node per parameter less;
    // the cast rounds to nearest even, as static_cast<float> does, so the values are the same).
    Tensor lr_f32;
    std::shared_ptr<const LRSchedule> schedule;
    Tensor scheduled_lr;        // inside a step with a schedule: its rate
    Tensor scheduled_momentum;  // and its momentum, when it cycles one
  };
  const Group& checked_group(size_t group) const;
  std::vector<Group> groups_;
  std::vector<size_t> group_of_;  // each parameter's group
  size_t group_in_use_ = 0;
  std::vector<Tensor> params_;
  std::vector<NamedTensors> state_;
  // A new stored count of `steps`, refused beyond what the f64 count holds exactly.
  Tensor stored_count(int64_t steps) const;
  // step_ as a new buffer holding `steps` (so that a compiled step traces again); the parameters
  // that shared the old count share the new one.
  void renew_step_count(int64_t steps);
  // The parameters updated in a step that share a count (a 0-d node), and their new count.
  struct CountGroup {
    Tensor count;
    std::vector<size_t> members;  // places in the step's list of updated parameters
    Tensor next;
  };
  Tensor step_;  // 0-d f64: updates taken, skipped ones not counted
  // Each parameter's updates taken, 0-d f64: step_ itself while it took every update, else a
  // count shared by the parameters that took the same updates.
  std::vector<Tensor> counts_;
  Tensor next_step_, skip_;
  const char* kind_;
  // Tells this optimizer's state from another's over the same parameters, in the names a
  // compiled step's plans take it up by (note_kept_state).
  uint64_t id_;
};

/// The base of a rule with options of type Options: each parameter group's options.
template <class Options>
class OptimizerWith : public Optimizer {
 public:
  /// The options of `group` (the rule's defaults resolved, as Adam's weight_decay), with the rate
  /// set_lr() set last as lr, as torch's param_groups[group] holds them: change a field and hand
  /// them to set_options().
  Options options(size_t group = 0) const {
    check_group(group);
    Options out = options_[group];
    if (!computes_own_rate()) out.lr = lr(group);
    return out;
  }
  /// Replaces the options of `group` (checked as the constructor checks them), and its rate with
  /// options.lr unless a schedule sets it, as torch's `param_groups[group][key] = value`; state
  /// the new options do not keep (a momentum buffer, with momentum turned off) is dropped, where
  /// torch keeps it unused. The options are C++ values a compiled step holds: it traces again.
  void set_options(size_t group, Options options) {
    check_group(group);
    resolve_options(options);
    const bool rate = !computes_own_rate() && !schedule(group);
    if (rate) check_lr(rate_of(options));
    options_[group] = options;
    if (rate) set_lr(group, rate_of(options));
    drop_unused_state(group);
    options_changed();
  }
  /// Adds a parameter group, as torch's add_param_group (unfreezing layers as training goes
  /// on): its parameters start without state and count their own updates from their first, with
  /// the group's options and rate (whole options: start from options(0) to keep the others'); a
  /// compiled step traces again. A schedule attached to it follows the optimizer's step count, as
  /// every group's does. mt::Error, changing nothing, for options the rule refuses, a parameter
  /// the optimizer already updates, and under ZeRO.
  void add_param_group(ParamGroup<Options> group) {
    resolve_options(group.options);
    if (!computes_own_rate()) check_lr(rate_of(group.options));
    const size_t index = add_group(std::move(group.params));
    options_.push_back(group.options);
    if (!computes_own_rate()) set_lr(index, rate_of(group.options));
  }
  /// The groups with their parameters and options, each with the rate set_lr() set last.
  std::vector<ParamGroup<Options>> param_groups() const {
    std::vector<ParamGroup<Options>> out;
    for (size_t g = 0; g < options_.size(); ++g) out.push_back({{}, options(g)});
    for (size_t i = 0; i < params().size(); ++i) out[group_of(i)].params.push_back(params()[i]);
    return out;
  }

  NamedOptions named_options(size_t group) const override {
    NamedOptions out;
    if constexpr (requires(Options & o) { option_fields(o); }) {
      Options copy = options(group);
      for (const auto& [name, field] : option_fields(copy))
        out.emplace_back(name, std::visit([](auto* value) { return OptionValue(*value); }, field));
    }
    return out;
  }
  void with_named_options(const std::vector<NamedOptions>& groups,
                          const std::function<void()>& check) override {
    std::vector<Options> trial = options_from(groups);
    std::swap(trial, options_);
    try {
      check();
    } catch (...) {
      std::swap(trial, options_);
      throw;
    }
    std::swap(trial, options_);
  }
  void set_named_options(const std::vector<NamedOptions>& groups) override {
    std::vector<Options> next = options_from(groups);
    for (size_t g = 0; g < next.size(); ++g) set_options(g, next[g]);
  }

 protected:
  OptimizerWith(std::vector<ParamGroup<Options>> groups, const char* kind)
      : Optimizer(parameters_of(groups), kind) {
    for (ParamGroup<Options>& group : groups) options_.push_back(group.options);
  }
  /// The options of the group being updated (group_in_use()).
  const Options& group_options() const { return options_[group_in_use()]; }
  /// mt::Error for options the rule refuses; sets the rule's defaults where they are unset.
  virtual void resolve_options(Options& options) const = 0;
  /// For the rules' constructors: resolves each group's options and sets its rate.
  void start_groups() {
    for (Options& options : options_) resolve_options(options);
    for (size_t g = 0; g < options_.size() && !computes_own_rate(); ++g)
      set_lr(g, rate_of(options_[g]));
  }

 private:
  // options.lr, an optional one (Adafactor's) where the rule takes a rate.
  static double rate_of(const Options& options) {
    if constexpr (requires { *options.lr; })
      return *options.lr;
    else
      return options.lr;
  }
  // Each group's options with `groups`' values over them, resolved and checked.
  std::vector<Options> options_from(const std::vector<NamedOptions>& groups) const {
    check_options_count(groups.size());
    std::vector<Options> out;
    for (size_t g = 0; g < groups.size(); ++g) {
      Options next = options(g);
      for (const auto& [name, value] : groups[g]) set_named_option(next, name, value, g);
      resolve_options(next);
      if (!computes_own_rate()) check_lr(rate_of(next));
      out.push_back(next);
    }
    return out;
  }
  void set_named_option(Options& options, const std::string& name, const OptionValue& value,
                        size_t group) const {
    if constexpr (requires(Options & o) { option_fields(o); }) {
      for (const auto& [field_name, field] : option_fields(options))
        if (name == field_name) {
          const bool set = std::visit(
              [&](auto* target) {
                using T = std::remove_pointer_t<decltype(target)>;
                if (const T* given = std::get_if<T>(&value)) return *target = *given, true;
                if constexpr (std::is_same_v<T,
                                             std::optional<double>>)  // a number where one may be
                  if (const double* given = std::get_if<double>(&value))
                    return *target = *given, true;
                return false;
              },
              field);
          if (!set) refuse_option(group, name, true);
          return;
        }
    }
    refuse_option(group, name, false);
  }
  static std::vector<std::vector<Tensor>> parameters_of(std::vector<ParamGroup<Options>>& groups) {
    std::vector<std::vector<Tensor>> out;
    for (ParamGroup<Options>& group : groups) out.push_back(std::move(group.params));
    return out;
  }
  std::vector<Options> options_;
};

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  bool maximize = false;  // ascend: the gradient negated first, as torch's maximize
};
OptionFields option_fields(SGDOptions& options);

/// Stochastic gradient descent with PyTorch's momentum, Nesterov and L2 weight-decay rules.
class SGD : public OptimizerWith<SGDOptions> {
 public:
  explicit SGD(std::vector<ParamGroup<SGDOptions>> groups);
  SGD(std::vector<Tensor> params, SGDOptions options);
  bool has_momentum() const override { return true; }
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;
  std::vector<std::string> optional_state_names() const override;

 protected:
  void resolve_options(SGDOptions& options) const override;
  bool state_started(const NamedTensors& state) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  /// Unset: the rule's default, as torch's: 0 for Adam, 0.01 for AdamW (so AdamW's
  /// {.lr = 1e-3} decays as torch.optim.AdamW(lr=1e-3) does). Set after construction.
  std::optional<double> weight_decay = std::nullopt;
  /// AMSGrad (Reddi et al. 2018): divide by the running maximum of exp_avg_sq (state
  /// "max_exp_avg_sq"), as torch's amsgrad.
  bool amsgrad = false;
  bool maximize = false;  // ascend: the gradient negated first, as torch's maximize
};
OptionFields option_fields(AdamOptions& options);

/// Adam (L2 weight decay added to the gradient), as torch.optim.Adam.
class Adam : public OptimizerWith<AdamOptions> {
 public:
  Adam(std::vector<Tensor> params, AdamOptions options);
  explicit Adam(std::vector<ParamGroup<AdamOptions>> groups);
  bool has_momentum() const override { return true; }
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;
  std::vector<std::string> optional_state_names() const override { return {"max_exp_avg_sq"}; }

 protected:
  void resolve_options(AdamOptions& options) const override;
  Adam(std::vector<ParamGroup<AdamOptions>> groups, const char* kind, bool decoupled);
  void begin_step() override;
  void start_state(NamedTensors& state, const Tensor& grad) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;

 private:
  bool decoupled_;
  Tensor inv_sqrt_bias2_, step_size_;  // this step's bias corrections, 0-d f64 graph values
  Tensor beta1_, rest1_;               // a cycled beta1 and 1 - beta1, 0-d f64
  Tensor decay_;                       // AdamW's 1 - lr * weight_decay, 0-d f64
};

/// AdamW (decoupled weight decay, default 0.01), as torch.optim.AdamW.
class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> params, AdamOptions options = {});
  explicit AdamW(std::vector<ParamGroup<AdamOptions>> groups);
};

struct RMSpropOptions {
  double lr = 0.01;
  double alpha = 0.99;  // the running mean of squared gradients' decay
  double eps = 1e-8;
  double weight_decay = 0;
  double momentum = 0;
  bool centered = false;  // divide by the gradients' running variance, not their mean square
  bool maximize = false;  // ascend: the gradient negated first, as torch's maximize
};
OptionFields option_fields(RMSpropOptions& options);

/// RMSprop, as torch.optim.RMSprop (eps added after the square root; L2 weight decay).
class RMSprop : public OptimizerWith<RMSpropOptions> {
 public:
  explicit RMSprop(std::vector<ParamGroup<RMSpropOptions>> groups);
  RMSprop(std::vector<Tensor> params, RMSpropOptions options = {});
  bool has_momentum() const override { return true; }
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;
  std::vector<std::string> optional_state_names() const override;

 protected:
  void resolve_options(RMSpropOptions& options) const override;
  void start_state(NamedTensors& state, const Tensor& grad) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;

 private:
  bool keeps_momentum() const;  // a momentum buffer: an option or a cycled momentum
};

struct AdagradOptions {
  double lr = 0.01;
  double lr_decay = 0;
  double weight_decay = 0;
  double initial_accumulator_value = 0;
  double eps = 1e-10;
  bool maximize = false;  // ascend: the gradient negated first, as torch's maximize
};
OptionFields option_fields(AdagradOptions& options);

/// Adagrad, as torch.optim.Adagrad: the learning rate divided by 1 + (step - 1) lr_decay and
/// by the square root of each element's running sum of squared gradients.
class Adagrad : public OptimizerWith<AdagradOptions> {
 public:
  explicit Adagrad(std::vector<ParamGroup<AdagradOptions>> groups);
  Adagrad(std::vector<Tensor> params, AdagradOptions options = {});
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;

 protected:
  void resolve_options(AdagradOptions& options) const override;
  void begin_step() override;
  void start_state(NamedTensors& state, const Tensor& grad) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;

 private:
  Tensor step_lr_;  // this step's decayed learning rate, a 0-d f64 graph value
};

struct LionOptions {
  double lr = 1e-4;
  double beta1 = 0.9;   // mixes the gradient into the update's sign
  double beta2 = 0.99;  // the momentum's decay
  double weight_decay = 0;
};
OptionFields option_fields(LionOptions& options);

/// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as lucidrains'
/// lion-pytorch: p *= 1 - lr * weight_decay (decoupled); p -= lr * sign(beta1 m + (1 - beta1) g);
/// m = beta2 m + (1 - beta2) g. State "exp_avg" (m).
class Lion : public OptimizerWith<LionOptions> {
 public:
  explicit Lion(std::vector<ParamGroup<LionOptions>> groups);
  Lion(std::vector<Tensor> params, LionOptions options = {});
  bool has_momentum() const override { return true; }
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;

 protected:
  void resolve_options(LionOptions& options) const override;
  void begin_step() override;
  void start_state(NamedTensors& state, const Tensor& grad) const override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;

 private:
  Tensor decay_;          // 1 - lr * weight_decay, a 0-d f64 graph value
  Tensor beta1_, rest1_;  // a cycled beta1 and 1 - beta1, 0-d f64
};

/// Hugging Face transformers' Adafactor defaults (transformers.optimization.Adafactor): no lr,
/// the relative step min(1e-2, 1/sqrt(t)) scaled by the parameter's RMS instead.
struct AdafactorOptions {
  std::optional<double> lr = std::nullopt;     // required (and only allowed) without relative_step
  double eps1 = 1e-30;                         // added to the squared gradient
  double eps2 = 1e-3;                          // the least parameter scale
  double clip_threshold = 1.0;                 // the update's RMS is clipped to it
  double decay_rate = -0.8;                    // the second moment's decay is 1 - t^decay_rate
  std::optional<double> beta1 = std::nullopt;  // a first moment, when given
  double weight_decay = 0;
  bool scale_parameter = true;  // the rate times max(eps2, RMS(parameter))
  bool relative_step = true;    // the rate min(1e-2, 1/sqrt(t)) (warmup_init: min(1e-6 t, ...))
  bool warmup_init = false;
};
OptionFields option_fields(AdafactorOptions& options);

/// Adafactor (Shazeer and Stern 2018), as transformers.optimization.Adafactor: parameters of
/// two or more dimensions keep the second moment factored, as the running means of the squared
/// gradient over their last axis ("exp_avg_sq_row", shape [..., rows]) and over the one before
/// it ("exp_avg_sq_col", [..., cols]); others keep it whole ("exp_avg_sq"); "exp_avg" with
/// beta1. Computed in f32 for any parameter dtype. (torch.optim.Adafactor of PyTorch 2.5 is a
/// variant with other defaults and no relative step; this follows transformers.)
class Adafactor : public OptimizerWith<AdafactorOptions> {
 public:
  explicit Adafactor(std::vector<ParamGroup<AdafactorOptions>> groups);
  Adafactor(std::vector<Tensor> params, AdafactorOptions options = {});
  Shape state_shape(const std::string& name, const Shape& param) const override;
  std::optional<std::vector<std::string>> state_names(size_t param_index) const override;
  std::vector<std::string> optional_state_names() const override;
  DType state_dtype(size_t) const override { return f32; }

 protected:
  void resolve_options(AdafactorOptions& options) const override;
  void begin_step() override;
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override;

 private:
  Tensor beta2t_, rest_, rate_;  // this step's decay, 1 - decay and relative rate (0-d f64)
};

/// The global norm of the gradients of `params`, as torch.nn.utils.clip_grad_norm_ computes it:
/// L2 by default (each squared in f32 and summed; in f64 where one of them is f64), any p > 0
/// (the p-th root of the sum of |g|^p), or the largest |g| for norm_type = infinity. A 0-d f32
/// (f64) graph value: what clip_grad_norm clips by. 0 when none has a gradient.
Tensor grad_norm(const std::vector<Tensor>& params, double norm_type = 2.0);

/// Scales all gradients so that their global norm (grad_norm's) is at most max_norm; returns the
/// norm before clipping (a graph value: reading it is the only host sync).
Tensor clip_grad_norm(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);

/// Clamps every gradient of `params` into [-clip_value, clip_value], as
/// torch.nn.utils.clip_grad_value_.
void clip_grad_value(const std::vector<Tensor>& params, double clip_value);

}  // namespace mixtape
