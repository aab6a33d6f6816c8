// mixtape/dist/zero.cpp -- ZeroShards: ZeRO-1's flat, padded shards of the parameters, the
// gradient reduce-scatter (a gradient hook), the parameter all-gather and the state gathering.
#include "mixtape/dist/zero.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "mixtape/dist/exchange.h"
#include "mixtape/dist/gradient_slots.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape::dist {
namespace {

// FNV-1a over 64-bit words: what every process must agree on, in 8 bytes.
uint64_t mix(uint64_t h, uint64_t word) {
  for (int b = 0; b < 8; ++b) h = (h ^ ((word >> (8 * b)) & 0xff)) * 1099511628211ull;
  return h;
}

template <class State>  // NamedTensors, const or not
auto find_entry(State& state, std::string_view name) -> decltype(&state.front().second) {
  for (auto& [key, value] : state)
    if (key == name) return &value;
  return nullptr;
}

// The names of process `from`'s state entries `state` (the others pass any), on every process.
std::vector<std::string> entry_names(const NamedTensors& state, int from) {
  std::string names;
  if (process_group()->rank() == from)
    for (const auto& entry : state) names += entry.first + "\n";
  int64_t length = static_cast<int64_t>(names.size());
  process_group()->broadcast(reinterpret_cast<std::byte*>(&length), sizeof(length), from);
  names.resize(static_cast<size_t>(length));
  process_group()->broadcast(reinterpret_cast<std::byte*>(names.data()), length, from);
  std::vector<std::string> out;
  for (size_t at = 0; at < names.size();) {
    const size_t end = names.find('\n', at);
    out.push_back(names.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

// Each parameter's state entry names, on every process: those of the processes holding part of
// it (they step it alike; one holding none of it has no state for it), none for a parameter
// never stepped or empty. One exchange of text.
std::vector<std::vector<std::string>> state_names_everywhere(const Optimizer& zero,
                                                             size_t parameter_count) {
  std::string mine;
  for (size_t i = 0; i < parameter_count; ++i) {
    const NamedTensors state = zero.state(i);
    if (state.empty()) continue;
    mine += std::to_string(i);
    for (const auto& entry : state) mine += " " + entry.first;
    mine += "\n";
  }
  std::vector<std::vector<std::string>> names(parameter_count);
  for (const std::string& text : gather_text(*process_group(), mine)) {
    for (size_t at = 0; at < text.size();) {
      const size_t end = text.find('\n', at);
      std::vector<std::string> words;
      for (size_t word = at; word < end;) {
        const size_t space = std::min(text.find(' ', word), end);
        words.push_back(text.substr(word, space - word));
        word = space + 1;
      }
      std::vector<std::string>& known = names[std::stoul(words[0])];
      for (size_t w = 1; w < words.size(); ++w)
        if (std::find(known.begin(), known.end(), words[w]) == known.end())
          known.push_back(words[w]);
      at = end + 1;
    }
  }
  return names;
}

}  // namespace

namespace master_weights {

const Tensor* find(const NamedTensors& state) { return find_entry(state, kEntry); }

Tensor current(const NamedTensors& state, const Tensor& param) {
  const Tensor* kept = find_entry(state, kEntry);
  if (!kept)
    fail("dist::Zero: the master weights of a half parameter were not started before its update");
  return where(eq(cast(*kept, param.dtype()), param), *kept, cast(param, f32));
}

void keep(NamedTensors& state, const Tensor& next) {
  if (Tensor* kept = find_entry(state, kEntry)) *kept = next;
}

}  // namespace master_weights

ZeroShards::ZeroShards(const std::vector<Tensor>& params, bool whole_tensors)
    : params_(params), whole_tensors_(whole_tensors), local_(std::make_unique<LocalGradients>()) {
  if (ProcessGroup* group = process_group()) {
    processes_ = group->size();
    rank_ = group->rank();
  }
  places_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const DType dtype = params_[i].dtype();
    auto found = std::find_if(groups_.begin(), groups_.end(),
                              [&](const Group& g) { return g.dtype == dtype; });
    if (found == groups_.end()) {
      groups_.push_back({dtype, {}, 0, 0, 0});
      found = groups_.end() - 1;
    }
    places_[i] = {static_cast<size_t>(found - groups_.begin()), found->total,
                  found->total + params_[i].numel()};
    found->members.push_back(i);
    found->total += params_[i].numel();
  }
  for (Group& g : groups_) {
    g.padded = (g.total + processes_ - 1) / processes_ * processes_;
    g.shard = g.padded / processes_;
    if (whole_tensors_ && processes_ > 1 && g.total > 0) place_whole_tensors(g);
  }
  owners_.resize(params_.size());
  if (processes_ == 1) return;
  check_same_layout();
  for (size_t i = 0; i < params_.size(); ++i) {
    owners_[i] = params_[i].impl().get();  // frozen now or not: unfrozen later, it is reduced
    set_gradient_sharded(owners_[i], true);
  }
  hook_ = add_gradient_hook([this](LeafGradients& gradients) { reduce(gradients); });
}

ZeroShards::~ZeroShards() {
  if (hook_ >= 0) remove_gradient_hook(hook_);
  for (const TensorImpl* owner : owners_)
    if (owner) set_gradient_sharded(owner, false);
}

// The shards pair elements by position, so every process must lay out the same parameters: the
// same error on every process otherwise (each compares all processes' digests).
void ZeroShards::check_same_layout() const {
  uint64_t digest = 1469598103934665603ull;
  for (const Tensor& p : params_) {
    digest = mix(digest, static_cast<uint64_t>(p.dtype()));
    digest = mix(digest, static_cast<uint64_t>(p.numel()));
  }
  ProcessGroup& group = *process_group();
  std::vector<uint64_t> all(processes_);
  std::vector<int64_t> counts(processes_, sizeof(uint64_t)), at(processes_);
  for (int q = 0; q < processes_; ++q) at[q] = q * static_cast<int64_t>(sizeof(uint64_t));
  group.all_gather(reinterpret_cast<const std::byte*>(&digest), sizeof(uint64_t),
                   reinterpret_cast<std::byte*>(all.data()), counts, at);
  for (int q = 1; q < processes_; ++q)
    if (all[q] != all[0])
      fail(
          "dist::Zero: process {} passes other parameters (dtypes or sizes) than process 0, so "
          "their shards would not line up; give every process the same model",
          q);
}

void ZeroShards::place_whole_tensors(Group& g) {
  // Each parameter, the largest first, to the process holding the fewest elements so far (the
  // lower process on a tie; equal sizes in the optimizer's order), as PyTorch's
  // ZeroRedundancyOptimizer partitions its parameters, so that the runs come out as even as whole
  // tensors allow. Then the runs are laid out one per shard, each in the optimizer's order and
  // each shard as long as the longest run. Every process computes the same placement.
  std::vector<size_t> by_size(g.members.size());
  std::iota(by_size.begin(), by_size.end(), size_t{0});
  std::stable_sort(by_size.begin(), by_size.end(), [&](size_t x, size_t y) {
    return params_[g.members[x]].numel() > params_[g.members[y]].numel();
  });
  std::vector<int> owner(g.members.size());
  std::vector<int64_t> run(static_cast<size_t>(processes_), 0);
  for (size_t m : by_size) {
    const auto fewest = std::min_element(run.begin(), run.end());
    owner[m] = static_cast<int>(fewest - run.begin());
    *fewest += params_[g.members[m]].numel();
  }
  g.shard = *std::max_element(run.begin(), run.end());
  g.padded = g.shard * processes_;
  std::vector<int64_t> next(static_cast<size_t>(processes_));
  for (int r = 0; r < processes_; ++r) next[static_cast<size_t>(r)] = r * g.shard;
  for (size_t m = 0; m < g.members.size(); ++m) {
    Place& place = places_[g.members[m]];
    int64_t& at = next[static_cast<size_t>(owner[m])];
    place.end = at + (place.end - place.begin);
    place.begin = at;
    at = place.end;
  }
  // The members in the buffer's order, as the flat layout has them.
  std::stable_sort(g.members.begin(), g.members.end(),
                   [&](size_t x, size_t y) { return places_[x].begin < places_[y].begin; });
}

std::pair<int64_t, int64_t> ZeroShards::held(size_t i) const {
  const Place& place = places_.at(i);
  if (processes_ == 1) return {0, place.end - place.begin};
  const int64_t shard = groups_[place.group].shard;
  const int64_t first = std::max(place.begin, rank_ * shard);
  const int64_t last = std::min(place.end, (rank_ + 1) * shard);
  if (first >= last) return {0, 0};
  return {first - place.begin, last - place.begin};
}

std::pair<int64_t, int64_t> ZeroShards::held_state(size_t i, int64_t entry_elements) const {
  if (!whole_tensors_) return held(i);
  auto [first, last] = held(i);
  return {0, first == last ? 0 : entry_elements};
}

Tensor ZeroShards::local_part(size_t i, const Tensor& whole) const {
  if (processes_ == 1) return whole;
  auto [first, last] = held(i);
  if (first == last) return Tensor();
  return whole_tensors_ ? whole : slice(reshape(whole, {-1}), 0, first, last);
}

Shape ZeroShards::local_shape(size_t i) const {
  if (processes_ == 1) return params_.at(i).shape();
  auto [first, last] = held(i);
  if (whole_tensors_) return first == last ? Shape{0} : params_.at(i).shape();
  return {last - first};
}

template <typename Part>
Tensor ZeroShards::shard_of(const Group& group, DType dtype, Part part) const {
  std::vector<Tensor> pieces;
  int64_t padding = group.shard;  // what the held elements leave of it
  for (size_t i : group.members)
    if (auto [first, last] = held(i); first != last) {
      pieces.push_back(reshape(part(i), {-1}));  // a whole tensor's part keeps its shape
      padding -= last - first;
    }
  // A group of empty parameters has empty shards.
  if (padding > 0 || pieces.empty()) pieces.push_back(zeros({padding}, dtype));
  return pieces.size() == 1 ? pieces[0] : concat(pieces);
}

std::vector<Tensor> ZeroShards::unshard(const Group& group, const Tensor& shard) const {
  Tensor all = all_gather(shard);
  std::vector<Tensor> out;
  for (size_t i : group.members) {
    const Place& place = places_[i];
    out.push_back(reshape(slice(all, 0, place.begin, place.end), params_[i].shape()));
  }
  return out;
}

void ZeroShards::assemble(const std::vector<size_t>& updated,
                          std::vector<Tensor>& new_params) const {
  if (processes_ == 1) return;
  std::vector<int64_t> slot(params_.size(), -1);
  for (size_t k = 0; k < updated.size(); ++k) slot[updated[k]] = static_cast<int64_t>(k);
  for (const Group& group : groups_) {
    // A parameter without a gradient keeps its values (every process leaves it alike: the
    // gradient hook gives every parameter one whenever any process's backward reached any).
    Tensor shard = shard_of(group, group.dtype, [&](size_t i) {
      return slot[i] >= 0 ? new_params[slot[i]] : local_part(i, params_[i]);
    });
    std::vector<Tensor> values = unshard(group, shard);
    for (size_t m = 0; m < group.members.size(); ++m)
      if (int64_t k = slot[group.members[m]]; k >= 0) new_params[k] = values[m];
  }
}

void ZeroShards::reduce(LeafGradients& gradients) const {
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < owners_.size(); ++i) index.emplace(owners_[i], i);
  std::vector<size_t> slot = gradient_slots(gradients, index, params_.size());
  if (local_->skip(!slot.empty())) return;
  auto owners_of = [&] {
    std::vector<std::shared_ptr<TensorImpl>> owners;
    for (const Tensor& p : params_) owners.push_back(p.impl());
    return owners;
  };
  if (local_->fold(gradients, owners_of)) slot = gradient_slots(gradients, index, params_.size());
  // As dist::DataParallel: a backward that reached none of them reduces nothing; one that
  // reached some gives the others zeros, so every process's flat buffers hold the same layout.
  // A parameter that no process reached takes zeros in the buffers and keeps no gradient.
  if (slot.empty()) return;
  const std::vector<bool> reached = reached_by_any_process(slot);
  NoGradGuard no_grad;
  std::vector<DType> grad_types(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (slot[i] == SIZE_MAX) {
      gradients.emplace_back(params_[i].impl(), zeros(params_[i].shape(), params_[i].dtype()));
      slot[i] = gradients.size() - 1;
    }
    grad_types[i] = gradients[slot[i]].second.dtype();
  }
  std::vector<Tensor> means;
  for (const Group& group : groups_) {
    // In the buffer's layout: the padding at the end, or at the end of each shard (whole
    // tensors).
    std::vector<Tensor> flat;
    int64_t at = 0;
    for (size_t i : group.members) {
      const Tensor& g = gradients[slot[i]].second;
      if (places_[i].begin > at) flat.push_back(zeros({places_[i].begin - at}, group.dtype));
      flat.push_back(reshape(g.dtype() == group.dtype ? g : cast(g, group.dtype), {-1}));
      at = places_[i].end;
    }
    if (group.padded > at) flat.push_back(zeros({group.padded - at}, group.dtype));
    means.push_back(reduce_scatter(concat(flat)) / static_cast<double>(processes_));
  }
  // Now, together, in this order: left lazy, they would run when first read, in whatever order
  // each process reads its gradients (see DataParallel).
  eval(means);
  for (size_t k = 0; k < groups_.size(); ++k) {
    const Group& group = groups_[k];
    const int64_t shard_begin = rank_ * group.shard;
    for (size_t i : group.members) {
      auto [first, last] = held(i);
      const Place& place = places_[i];
      Tensor mine;
      if (first == last) {
        mine = zeros(params_[i].shape(), group.dtype);
      } else {
        std::vector<Tensor> pieces;
        if (first > 0) pieces.push_back(zeros({first}, group.dtype));
        const int64_t at = place.begin + first - shard_begin;
        pieces.push_back(slice(means[k], 0, at, at + last - first));
        if (last < params_[i].numel())
          pieces.push_back(zeros({params_[i].numel() - last}, group.dtype));
        mine = reshape(pieces.size() == 1 ? pieces[0] : concat(pieces), params_[i].shape());
      }
      gradients[slot[i]].second = mine.dtype() == grad_types[i] ? mine : cast(mine, grad_types[i]);
    }
  }
  // The zeros that stood in for a parameter no process reached leave the list: no gradient.
  std::vector<bool> unreached_slot(gradients.size());
  for (size_t i = 0; i < params_.size(); ++i) unreached_slot[slot[i]] = !reached[i];
  size_t kept = 0;
  for (size_t k = 0; k < gradients.size(); ++k)
    if (!unreached_slot[k]) gradients[kept++] = std::move(gradients[k]);
  gradients.resize(kept);
}

namespace {
// The optimizer's step count and each parameter's where it differs.
void copy_step_counts(const Optimizer& from, Optimizer& to) {
  to.set_steps_taken(from.steps_taken());
  for (size_t i = 0; i < from.params().size(); ++i)
    if (!from.step_count(i).same(from.step_count())) to.set_steps_taken(i, from.steps_taken(i));
}
}  // namespace

void ZeroShards::gather_state(const Optimizer& zero, Optimizer& whole) const {
  copy_step_counts(zero, whole);
  if (processes_ == 1) {
    for (size_t i = 0; i < params_.size(); ++i) whole.load_state(i, zero.state(i), true);
    return;
  }
  if (whole_tensors_) return gather_whole_state(zero, whole);
  std::vector<NamedTensors> full(params_.size());
  std::vector<Tensor> pending;
  const std::vector<std::vector<std::string>> names = state_names_everywhere(zero, params_.size());
  for (const Group& group : groups_) {
    // Every entry name of the group's members, each gathered once for the whole group; a member
    // without that entry (never stepped, or empty) contributes zeros and takes none.
    std::vector<std::string> group_names;
    for (size_t i : group.members)
      for (const std::string& name : names[i])
        if (std::find(group_names.begin(), group_names.end(), name) == group_names.end())
          group_names.push_back(name);
    for (const std::string& name : group_names) {
      Tensor shard = shard_of(group, f32, [&](size_t i) {
        NamedTensors state = zero.state(i);
        Tensor* value = find_entry(state, name);
        return value ? cast(*value, f32) : zeros(local_shape(i), f32);
      });
      std::vector<Tensor> values = unshard(group, shard);
      for (size_t m = 0; m < group.members.size(); ++m) {
        const std::vector<std::string>& own = names[group.members[m]];
        if (std::find(own.begin(), own.end(), name) == own.end()) continue;
        full[group.members[m]].emplace_back(name, values[m]);
        pending.push_back(values[m]);
      }
    }
  }
  eval(pending);
  for (size_t i = 0; i < params_.size(); ++i) whole.load_state(i, full[i], true);
}

void ZeroShards::gather_whole_state(const Optimizer& zero, Optimizer& whole) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].numel() == 0) continue;  // held by none, without state
    const Group& g = groups_[places_[i].group];
    const int holder = static_cast<int>(places_[i].begin / g.shard);
    // The holder's entry names (a factored rule's differ from parameter to parameter), then
    // each entry in f32, of the shape the rule gives it.
    const NamedTensors held = holder == rank_ ? zero.state(i) : NamedTensors();
    NamedTensors full;
    for (const std::string& name : entry_names(held, holder)) {
      const Shape shape = whole.state_shape(name, params_[i].shape());
      std::vector<float> values(static_cast<size_t>(numel(shape)));
      if (holder == rank_) values = cast(*find_entry(held, name), f32).to_vector<float>();
      process_group()->broadcast(reinterpret_cast<std::byte*>(values.data()),
                                 static_cast<int64_t>(values.size() * sizeof(float)), holder);
      full.emplace_back(name, tensor(values, shape));
    }
    whole.load_state(i, full, true);
  }
}

void ZeroShards::take_state(const Optimizer& whole, Optimizer& zero) const {
  if (whole.group_count() != zero.group_count())
    fail("ZeRO: the state is of {} parameter groups, the optimizer has {}", whole.group_count(),
         zero.group_count());
  // The options the whole one holds (a checkpoint's), before the state they decide is taken.
  std::vector<NamedOptions> options;
  for (size_t g = 0; g < whole.group_count(); ++g) options.push_back(whole.named_options(g));
  zero.set_named_options(options);
  for (size_t i = 0; i < params_.size(); ++i) {
    NamedTensors mine;
    for (const auto& [name, value] : whole.state(i)) {
      Tensor part = local_part(i, value);
      if (part.defined()) mine.emplace_back(name, part);
    }
    zero.load_state(i, mine, true);
  }
  copy_step_counts(whole, zero);
  // The rates the whole optimizer loaded, where no schedule of the ZeRO one sets them.
  for (size_t g = 0; g < zero.group_count() && !zero.computes_own_rate(); ++g)
    if (!zero.schedule(g)) zero.set_lr(g, whole.lr(g));
}

}  // namespace mixtape::dist
