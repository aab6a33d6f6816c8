// mixtape/dist/zero.h -- ZeRO stage 1: optimizers whose state each process keeps (and updates)
// for its 1/N shard of the parameters, gradients reduce-scattered and parameters all-gathered
// in the step's graph.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "mixtape/autograd/grad.h"
#include "mixtape/dsl/adaptive_optim.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/optim.h"
#include "mixtape/dsl/shape.h"

namespace mixtape::dist {

class LocalGradients;

/// How ZeRO-1 cuts an optimizer's parameters into shards, as DeepSpeed's stage 1 does: the
/// parameters of one dtype, in the optimizer's order, flattened into one buffer, padded at its
/// end with zeros to a multiple of the process count N (DeepSpeed's
/// flatten_dense_tensors_aligned pads its flat groups so), and cut into N equal shards; process
/// r holds shard r, which may begin and end inside a parameter. With more than one process it
/// also replaces every backward()'s gradients of these parameters (an autograd gradient hook):
/// the flat gradients are reduce-scattered (summed in rank order, divided by N), and each
/// parameter's gradient becomes its elements of this process's shard, zeros elsewhere (DeepSpeed
/// frees the rest). Parameters are marked set_gradient_sharded, so grad_norm (clip_grad_norm)
/// sums the processes' squares and dist::DataParallel leaves them to this reduction.
/// With one process it changes nothing: the optimizer is the plain one (but for the f32 master
/// weights of half parameters, master_weights).
///
/// For a rule that needs whole parameters (Adafactor's factored statistics of a matrix), the
/// shards are of whole parameters instead, as PyTorch's ZeroRedundancyOptimizer partitions them:
/// each dtype's parameters, the largest first, go to the process holding the fewest elements so
/// far, each process's run (in the optimizer's order) padded at its end to the longest run; the
/// buffer, reductions and gathers are the same.
class ZeroShards {
 public:
  /// Every process must pass the same parameters (dtypes and sizes; an mt::Error on every
  /// process otherwise), after dist::init().
  explicit ZeroShards(const std::vector<Tensor>& params, bool whole_tensors = false);
  ~ZeroShards();
  ZeroShards(const ZeroShards&) = delete;
  ZeroShards& operator=(const ZeroShards&) = delete;

  /// The parameters of one dtype, flattened: `members` are indices into the parameter list, in
  /// the order of their places in the buffer (the optimizer's order in the flat layout).
  struct Group {
    DType dtype = f32;
    std::vector<size_t> members;
    int64_t total = 0;   // their elements
    int64_t padded = 0;  // total rounded up to a multiple of N
    int64_t shard = 0;   // padded / N, the elements each process holds
  };
  int processes() const { return processes_; }
  bool whole_tensors() const { return whole_tensors_; }
  const std::vector<Group>& groups() const { return groups_; }
  /// The elements [first, second) of parameter i (in its flat order) that this process holds;
  /// first == second where it holds none of them. All of them with one process.
  std::pair<int64_t, int64_t> held(size_t i) const;
  /// The elements [first, second) of a state entry of parameter i with `entry_elements`
  /// elements, flattened, that this process keeps: held(i) for the flat shards (entries shaped as
  /// their parameter), all of it or none for whole tensors (entries of any shape).
  std::pair<int64_t, int64_t> held_state(size_t i, int64_t entry_elements) const;

  /// Optimizer::local_part, local_shape and assemble for a ZeRO optimizer.
  Tensor local_part(size_t i, const Tensor& whole) const;
  Shape local_shape(size_t i) const;
  void assemble(const std::vector<size_t>& updated, std::vector<Tensor>& new_params) const;
  /// Into `whole`, a plain optimizer over the same parameters: every process's state shards,
  /// gathered, and `zero`'s step count. Every process calls it (collectives).
  void gather_state(const Optimizer& zero, Optimizer& whole) const;
  /// Into `zero`: this process's shards of `whole`'s state, its step counts, and its groups' rates
  /// where `zero` has no schedule.
  void take_state(const Optimizer& whole, Optimizer& zero) const;

 private:
  struct Place {
    size_t group = 0;
    int64_t begin = 0, end = 0;  // in the group's flat buffer
  };
  // This process's shard of `group`'s flat buffer in `dtype` from each member's part (part(i):
  // the held elements of parameter i, 1-D) and zeros for the padding it holds.
  template <typename Part>
  Tensor shard_of(const Group& group, DType dtype, Part part) const;
  // Every process's shard gathered, cut into the members' tensors (of their shapes).
  std::vector<Tensor> unshard(const Group& group, const Tensor& shard) const;
  void place_whole_tensors(Group& group);
  void check_same_layout() const;
  void reduce(LeafGradients& gradients) const;
  // gather_state for whole tensors: each parameter's state entries sent by the process that
  // holds it.
  void gather_whole_state(const Optimizer& zero, Optimizer& whole) const;

  std::vector<Tensor> params_;
  std::vector<const TensorImpl*> owners_;
  std::vector<Place> places_;
  std::vector<Group> groups_;
  int processes_ = 1, rank_ = 0;
  bool whole_tensors_ = false;
  int64_t hook_ = -1;
  std::unique_ptr<LocalGradients> local_;  // no_sync's pending local gradients
};

/// The f32 master weights ZeRO keeps for the shard of a half-typed (bf16, f16) parameter, as
/// DeepSpeed's bf16 and fp16 optimizers do: state entry "master" of the shard, updated by the
/// rule in f32 (with the rule's state in f32), the parameter its rounding. A parameter changed
/// outside the optimizer (a checkpoint loaded into the model, an assign) is taken as it is where
/// it differs from its master's rounding, element by element, so a master never undoes the
/// change; it starts as zeros, which the parameter's first step replaces so.
namespace master_weights {
inline constexpr const char* kEntry = kMasterWeightEntry;
/// The shard's master in its state, or null before its first update.
const Tensor* find(const NamedTensors& state);
/// The shard's master weights for the update: the kept master where it rounds to `param`, the
/// parameter's value elsewhere.
Tensor current(const NamedTensors& state, const Tensor& param);
/// Keeps `next` as the shard's master.
void keep(NamedTensors& state, const Tensor& next);
}  // namespace master_weights

/// What dist::save_checkpoint and dist::load_checkpoint need of a ZeRO optimizer, whatever its
/// rule.
class ZeroOptimizer {
 public:
  virtual ~ZeroOptimizer() = default;
  /// A plain optimizer of the same rule, groups and options over the same parameters, with each
  /// group's rate set_lr() set last, without state (nor schedules).
  virtual std::unique_ptr<Optimizer> plain() const = 0;
  /// plain() with every process's state gathered: what a checkpoint holds. Every process calls
  /// it.
  virtual std::unique_ptr<Optimizer> gathered() const = 0;
  /// Takes this process's shards of `whole`'s state (any world size's: see gathered()).
  virtual void take_shards(const Optimizer& whole) = 0;
  virtual const ZeroShards& shards() const = 0;
};

/// ZeRO stage 1 of the optimizer `Rule` (SGD, Adam, AdamW, RMSprop, Adagrad, Lion, Adamax,
/// RAdam, Adadelta on flat shards; Adafactor and NAdam on shards of whole parameters), with Rule's
/// constructors and options: each process keeps the rule's f32 state for its 1/N shard only
/// (ZeroShards) and updates only that shard of the parameters (f32 parameters are their own master
/// weights: the shard is updated in place of a separate master copy; half ones get f32 master
/// shards, master_weights); the updated shards are all-gathered into the parameters in the step's
/// program. GradScaler, clip_grad_norm, schedules and mt::compile work as with the plain rule,
/// whose kind() it keeps, so its checkpoints (dist::save_checkpoint, which gathers the shards) are
/// the plain rule's.
template <class Rule>
class Zero : public Rule, public ZeroOptimizer {
 public:
  using Rule::Rule;

  Shape local_shape(size_t i) const override { return shards_.local_shape(i); }
  std::optional<std::vector<std::string>> state_names(size_t i) const override {
    std::optional<std::vector<std::string>> names = Rule::state_names(i);
    if (names && is_half(this->params()[i].dtype())) names->emplace_back(master_weights::kEntry);
    return names;
  }
  DType state_dtype(size_t i) const override {
    return is_half(this->params()[i].dtype()) ? f32 : Rule::state_dtype(i);
  }
  std::unique_ptr<Optimizer> plain() const override {
    auto whole = std::make_unique<Rule>(this->param_groups());
    // The schedules too: a cycled momentum keeps state (SGD's buffer) the options alone do not.
    for (size_t g = 0; g < this->group_count(); ++g)
      if (this->schedule(g)) whole->set_schedule(g, this->schedule(g));
    return whole;
  }
  std::unique_ptr<Optimizer> gathered() const override {
    std::unique_ptr<Optimizer> whole = plain();
    shards_.gather_state(*this, *whole);
    return whole;
  }
  void take_shards(const Optimizer& whole) override { shards_.take_state(whole, *this); }
  const ZeroShards& shards() const override { return shards_; }
  const char* fixed_groups() const override {
    return "ZeRO cuts its shards of the parameters at construction: construct it with every "
           "group";
  }

 protected:
  Tensor local_part(size_t i, const Tensor& whole) const override {
    return shards_.local_part(i, whole);
  }
  // A half parameter's shard: its state and its master in f32.
  void start_state(NamedTensors& state, const Tensor& grad) const override {
    if (!is_half(grad.dtype())) return Rule::start_state(state, grad);
    // Every step, as for the plain rule: entries set_options() turned on start then. Only missing
    // entries are added, shaped and typed like the master (f32, the shard's), once it exists (a
    // handle of its own: adding entries moves the state's).
    const Tensor* master = master_weights::find(state);
    const bool started = master != nullptr;
    Tensor like = started ? *master : zeros(grad.shape(), f32);
    Rule::start_state(state, like);
    if (!started) this->add_zero_state(state, master_weights::kEntry, like);
  }
  Tensor update(const Tensor& param, const Tensor& grad, NamedTensors& state) override {
    if (!is_half(param.dtype())) return Rule::update(param, grad, state);
    Tensor next = Rule::update(master_weights::current(state, param), cast(grad, f32), state);
    master_weights::keep(state, next);
    return cast(next, param.dtype());
  }
  void assemble(const std::vector<size_t>& updated, std::vector<Tensor>& new_params) override {
    shards_.assemble(updated, new_params);
  }

 private:
  // Adafactor's factored statistics and its RMS scaling need whole parameters, not slices, as
  // does NAdam's one mu_product per parameter.
  ZeroShards shards_{this->params(),
                     std::is_base_of_v<Adafactor, Rule> || std::is_base_of_v<NAdam, Rule>};
};

using ZeroAdamW = Zero<AdamW>;
using ZeroAdam = Zero<Adam>;
using ZeroSGD = Zero<SGD>;
using ZeroRMSprop = Zero<RMSprop>;
using ZeroAdagrad = Zero<Adagrad>;
using ZeroLion = Zero<Lion>;
using ZeroAdafactor = Zero<Adafactor>;
using ZeroAdamax = Zero<Adamax>;
using ZeroNAdam = Zero<NAdam>;
using ZeroRAdam = Zero<RAdam>;
using ZeroAdadelta = Zero<Adadelta>;

}  // namespace mixtape::dist
