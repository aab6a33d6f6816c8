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

/// Whether some process's backward reached parameter p, for each p (this process's: slot[p] !=
/// SIZE_MAX): a byte per parameter from every process, a host exchange, as PyTorch DDP's
/// find_unused_parameters all-reduces its map of locally used parameters. A parameter that no
/// process reached keeps no gradient, as in one process, so that the optimizer leaves it alone
/// (no weight decay, no momentum), and every process leaves it out of the reduction alike.
inline std::vector<bool> reached_by_any_process(const std::vector<size_t>& slot) {
  std::vector<bool> reached(slot.size());
  for (size_t p = 0; p < slot.size(); ++p) reached[p] = slot[p] != SIZE_MAX;
  ProcessGroup* group = process_group();
  if (!group || group->size() == 1 || slot.empty()) return reached;
  const int processes = group->size();
  const auto count = static_cast<int64_t>(slot.size());
  std::vector<uint8_t> mine(slot.size()), all(slot.size() * static_cast<size_t>(processes));
  for (size_t p = 0; p < slot.size(); ++p) mine[p] = reached[p] ? 1 : 0;
  std::vector<int64_t> counts(static_cast<size_t>(processes), count), at(counts.size());
  for (int q = 0; q < processes; ++q) at[static_cast<size_t>(q)] = q * count;
  group->all_gather(reinterpret_cast<const std::byte*>(mine.data()), count,
                    reinterpret_cast<std::byte*>(all.data()), counts, at);
  for (size_t q = 0; q < static_cast<size_t>(processes); ++q)
    for (size_t p = 0; p < slot.size(); ++p) reached[p] = reached[p] || all[q * slot.size() + p];
  return reached;
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
