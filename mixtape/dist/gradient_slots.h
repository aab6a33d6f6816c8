// mixtape/dist/gradient_slots.h -- which of a backward's leaf gradients belongs to which
// parameter, and no_sync's local gradients: shared by dist::DataParallel and dist::Zero, whose
// reductions walk the parameters.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "mixtape/autograd/grad.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape::dist {

/// slot[p] is the index in `gradients` of parameter p's gradient (`param_of` maps a parameter to
/// its p), SIZE_MAX where the backward did not reach p. Empty where it reached none of them:
/// such a backward reduces nothing.
inline std::vector<size_t> gradient_slots(
    const LeafGradients& gradients, const std::unordered_map<const TensorImpl*, size_t>& param_of,
    size_t parameter_count) {
  std::vector<size_t> slot(parameter_count, SIZE_MAX);
  bool any = false;
  for (size_t i = 0; i < gradients.size(); ++i)
    if (auto found = param_of.find(gradients[i].first.get()); found != param_of.end()) {
      slot[found->second] = i;
      any = true;
    }
  if (!any) slot.clear();
  return slot;
}

/// no_sync's side of one reducer (dist::DataParallel, dist::ZeroShards): which backward()s leave
/// the gradients local, and folding those into the next reduction.
class LocalGradients {
 public:
  LocalGradients() = default;
  ~LocalGradients() {
    pending_->set(false);
    pending_->alive = false;  // a compiled step that outlives the reducer changes nothing
  }
  LocalGradients(const LocalGradients&) = delete;
  LocalGradients& operator=(const LocalGradients&) = delete;

  /// Whether this backward leaves the gradients local (a no_sync hold is taken). If it reached
  /// any of the reducer's parameters (`reached`), their .grad now hold local sums that the next
  /// reducing backward must fold in.
  bool skip(bool reached) {
    if (!gradient_sync_held()) return false;
    if (reached) pending_->set(true);
    watch(reached ? std::optional<bool>(true) : std::nullopt);
    return true;
  }

  /// Before a reducing backward's reduction: each parameter's local sum (its .grad, which the
  /// backward()s under no_sync accumulated) joins this backward's gradient and leaves .grad, so
  /// that the reduced sum replaces it. The reduction covers every micro-step's gradients, as
  /// PyTorch DDP's reduces the accumulated .grad. `owners_of()` gives the parameters' gradient
  /// owners, asked for only when there is something to fold. True when it folded.
  template <typename Owners>
  bool fold(LeafGradients& gradients, Owners owners_of) {
    const bool folding = pending_->pending;
    if (folding) {
      pending_->set(false);
      ++pending_->folds;
    }
    watch(folding ? std::optional<bool>(false) : std::nullopt);
    if (!folding) return false;
    NoGradGuard no_grad;
    for (const std::shared_ptr<TensorImpl>& owner : owners_of()) {
      if (!owner || !owner->grad) continue;
      note_gradient_change(owner, true);
      Tensor local(owner->grad);
      owner->grad.reset();
      auto found = std::find_if(gradients.begin(), gradients.end(),
                                [&](const auto& entry) { return entry.first == owner; });
      if (found != gradients.end())
        found->second = local + found->second;
      else
        gradients.emplace_back(owner, local);
    }
    return true;
  }

 private:
  // Whether local gradients wait, counted in add_pending_local_gradients (mt::compile's key),
  // and how many reductions folded them in.
  struct Pending {
    bool pending = false;
    bool alive = true;
    int64_t folds = 0;
    void set(bool value) {
      if (!alive || pending == value) return;
      pending = value;
      add_pending_local_gradients(value ? 1 : -1);
    }
  };
  // A compiled step's part in this: a replay runs no gradient hook, so it makes the change the
  // traced call made (a replayed no_sync micro-step still leaves the next call the one that
  // folds); and a reduction that folded local gradients outside the step since its last call
  // replaced the .grad it reads, which the step's plan cannot see: it traces again.
  class Replayed final : public StepHook {
   public:
    Replayed(std::shared_ptr<Pending> pending, std::optional<bool> value)
        : pending_(std::move(pending)), value_(value), seen_(pending_->folds) {}
    const char* stale() const override {
      return pending_->folds != seen_
                 ? "no_sync's local gradients were folded into a reduction outside the step since "
                   "its last call"
                 : nullptr;
    }
    void ran(const std::vector<std::shared_ptr<Storage>>&) override {
      if (value_) pending_->set(*value_);
      seen_ = pending_->folds;
    }

   private:
    std::shared_ptr<Pending> pending_;
    std::optional<bool> value_;
    int64_t seen_;
  };
  // Only while a step is traced: every reducing backward passes here.
  void watch(std::optional<bool> value) {
    if (trace_observer()) on_each_call(std::make_shared<Replayed>(pending_, value));
  }

  std::shared_ptr<Pending> pending_ = std::make_shared<Pending>();
};

}  // namespace mixtape::dist
