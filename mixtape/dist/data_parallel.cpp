// mixtape/dist/data_parallel.cpp -- dist::DataParallel: one model on every process (checked and
// broadcast from rank 0), gradients averaged in the step's graph by bucketed all_reduce nodes.
#include <algorithm>
#include <cstring>
#include <sstream>
#include <unordered_map>

#include "mixtape/dist/dist.h"
#include "mixtape/dist/exchange.h"
#include "mixtape/dist/gradient_slots.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape::dist {
namespace {

std::string join(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  return text;
}

std::vector<std::string> split(std::string_view text) {
  std::vector<std::string> lines;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    lines.emplace_back(text.substr(at, end - at));
    at = end + 1;
  }
  return lines;
}

// The same error on every process, naming the first process and entry that differ from rank 0.
// Which parameters take gradients counts too: the buckets hold theirs.
void check_same_model(ProcessGroup& group, const NamedTensors& state) {
  std::vector<std::string> lines = describe_entries(state);
  for (size_t i = 0; i < state.size(); ++i)
    lines[i] += state[i].second.requires_grad() ? " requires_grad" : " no_grad";
  std::vector<std::string> texts = gather_text(group, join(lines));
  const std::vector<std::string> first = split(texts[0]);
  for (size_t q = 1; q < texts.size(); ++q) {
    if (texts[q] == texts[0]) continue;
    const std::vector<std::string> other = split(texts[q]);
    size_t i = 0;
    while (i < first.size() && i < other.size() && first[i] == other[i]) ++i;
    std::string theirs = i < other.size() ? other[i] : "nothing more";
    std::string ours = i < first.size() ? first[i] : "nothing more";
    fail(
        "dist::DataParallel: the models differ across processes: process {} has {} where "
        "process 0 has {} (entry {} of the parameters and buffers: name, shape, dtype, whether "
        "it takes gradients)",
        q, theirs, ours, i);
  }
}

// Rank 0's values of every parameter and buffer, on every process: one broadcast of all bytes.
void take_rank0_values(ProcessGroup& group, const NamedTensors& state) {
  std::vector<Tensor> values;
  for (const auto& entry : state) values.push_back(entry.second);
  eval(values);
  int64_t total = 0;
  for (const Tensor& t : values) total += t.node()->value->size_bytes();
  std::vector<std::byte> bytes(static_cast<size_t>(total));
  int64_t at = 0;
  if (group.rank() == 0)
    for (const Tensor& t : values) {
      const Storage& value = *t.node()->value;
      if (value.size_bytes() == 0) continue;  // an empty tensor's data may be null
      std::memcpy(bytes.data() + at, value.host_data(), static_cast<size_t>(value.size_bytes()));
      at += value.size_bytes();
    }
  group.broadcast(bytes.data(), total, 0);
  if (group.rank() == 0) return;
  at = 0;
  for (Tensor& t : values) {
    auto storage = std::make_shared<Storage>(t.dtype(), t.numel(), Storage::Uninitialized{});
    if (storage->size_bytes() > 0)
      std::memcpy(storage->host_data(), bytes.data() + at,
                  static_cast<size_t>(storage->size_bytes()));
    at += storage->size_bytes();
    t.assign(from_storage(std::move(storage), t.shape()));
  }
}

}  // namespace

DataParallel::DataParallel(Module& module, DataParallelOptions options)
    : module_(&module), options_(options), local_(std::make_unique<LocalGradients>()) {
  if (options_.bucket_bytes < 1)
    fail("dist::DataParallel: bucket_bytes {} must be positive", options_.bucket_bytes);
  if (options_.reduce_dtype && !is_floating(*options_.reduce_dtype))
    fail("dist::DataParallel: reduce_dtype must be a floating type, got {}",
         mixtape::name(*options_.reduce_dtype));
  // Made before dist::init() under an MPI launcher, it checked and broadcast nothing, yet
  // averaged gradients once init() had run: it joins the processes itself (init() is once).
  if (!process_group()) init();
  // Frozen ones too: unfrozen later, their gradients are averaged (PyTorch's DDP leaves out
  // what was frozen when it was made, and the processes drift apart).
  for (const Tensor& p : module.parameters()) params_.push_back(p.impl());
  if (ProcessGroup* group = process_group(); group && group->size() > 1) {
    // Every buffer, non-persistent ones too (a rotary table, a mask): each backward gives them
    // all rank 0's values (take_rank0_buffers), which paired buffers of different sizes.
    NamedTensors state = module.named_parameters();
    for (auto& entry : module.named_buffers()) state.push_back(std::move(entry));
    check_same_model(*group, state);
    take_rank0_values(*group, state);
  }
  hook_ = add_gradient_hook([this](LeafGradients& gradients) { average(gradients); });
}

DataParallel::~DataParallel() { remove_gradient_hook(hook_); }

DataParallel::NoSync::NoSync() { hold_gradient_sync(); }
DataParallel::NoSync::~NoSync() { release_gradient_sync(); }

void DataParallel::take_rank0_buffers(std::vector<Tensor>& collectives) {
  // Grouped by type, in the module's order (the same on every process): one all_reduce each,
  // to which the other processes add zeros, so that the sum is rank 0's value bit for bit (a
  // -0 becomes +0): a broadcast from one more all_reduce, in the step's graph.
  const bool root = process_rank() == 0;
  NamedTensors buffers = module_->named_buffers();
  std::vector<DType> types;
  for (const auto& entry : buffers)
    if (std::find(types.begin(), types.end(), entry.second.dtype()) == types.end())
      types.push_back(entry.second.dtype());
  for (DType type : types) {
    std::vector<Tensor> flat;
    for (const auto& [name, buffer] : buffers)
      if (buffer.dtype() == type)
        flat.push_back(root ? reshape(buffer, {-1}) : zeros({buffer.numel()}, type));
    Tensor rank0 = all_reduce(flat.size() == 1 ? flat[0] : concat(flat));
    collectives.push_back(rank0);
    int64_t at = 0;
    for (auto& [name, buffer] : buffers) {
      if (buffer.dtype() != type) continue;
      const int64_t n = buffer.numel();
      // The value the next evaluation stores, as batch norm's own update of it.
      buffer.assign_later(reshape(slice(rank0, 0, at, at + n), buffer.shape()));
      at += n;
    }
  }
}

void DataParallel::average(LeafGradients& gradients) {
  const int processes = process_count();
  if (processes == 1) return;
  // Every parameter, in the module's order, whether or not this process's backward reached it
  // (a branch taken on one process only, a layer used by some batches): one that some other
  // process reached contributes zeros and receives the others' average, as with PyTorch's
  // find_unused_parameters. Buckets made from the gradients a process happens to have would
  // pair one process's layer with another's. A backward that reached none of the module's
  // parameters reduces nothing. A ZeRO optimizer (dist/zero.h) reduce-scatters its parameters'
  // gradients itself; they count as reached here (the buffers follow), but are not reduced.
  std::vector<std::shared_ptr<TensorImpl>> owners(params_.size()), reduced(params_.size());
  std::unordered_map<const TensorImpl*, size_t> param_of;
  for (size_t p = 0; p < params_.size(); ++p) {
    owners[p] = params_[p].lock();
    if (owners[p] && !gradient_sharded(owners[p].get())) reduced[p] = owners[p];
    if (owners[p]) param_of.emplace(owners[p].get(), p);
  }
  std::vector<size_t> slot = gradient_slots(gradients, param_of, params_.size());
  if (local_->skip(!slot.empty())) return;
  if (local_->fold(
          gradients, [&]() -> const auto& { return reduced; }))
    slot = gradient_slots(gradients, param_of, params_.size());
  if (slot.empty()) return;
  const std::vector<bool> reached = reached_by_any_process(slot);
  NoGradGuard no_grad;
  // The reduction keeps the types the gradients have (or reduce_dtype), whatever policy the
  // caller's backward() runs under.
  NoPolicyScope no_policy;
  for (size_t p = 0; p < params_.size(); ++p) {
    // A parameter gone was replaced in the module (a tensor assigned to its member): it would
    // never be averaged again, and the processes would drift apart.
    if (!owners[p])
      fail(
          "dist::DataParallel: parameter {} of the module was replaced or dropped after "
          "DataParallel was made: make it after assigning parameters (load_checkpoint and "
          "load_state_dict write in place)",
          p);
    if (!reduced[p]) {
      slot[p] = SIZE_MAX;
      continue;
    }
    if (slot[p] != SIZE_MAX || !reached[p]) continue;
    const Node& leaf = *owners[p]->node;
    gradients.emplace_back(owners[p], zeros(leaf.shape, leaf.precision.storage_type));
    slot[p] = gradients.size() - 1;
  }
  // Grouped by the type they are reduced in (the parameter's own, an f32 master's by default,
  // as PyTorch AMP's gradients are; reduce_dtype on request), then cut into buckets of about
  // bucket_bytes.
  std::vector<std::vector<size_t>> by_type;
  std::vector<DType> types;
  for (size_t p = 0; p < params_.size(); ++p) {
    if (slot[p] == SIZE_MAX) continue;
    DType t = options_.reduce_dtype.value_or(owners[p]->node->precision.storage_type);
    auto found = std::find(types.begin(), types.end(), t);
    if (found == types.end()) {
      types.push_back(t);
      by_type.emplace_back();
      found = types.end() - 1;
    }
    by_type[found - types.begin()].push_back(slot[p]);
  }
  last_buckets_ = 0;
  std::vector<Tensor> averaged;
  for (size_t k = 0; k < types.size(); ++k) {
    // The module's parameters backwards, as PyTorch DDP orders them: a backward pass reaches
    // the last layers first, so the first bucket's gradients are final early, and its
    // reduction can run beside the rest of the backward pass (runtime/program.h). The first
    // bucket is small (DDP's 1 MB), so that it is ready soon.
    std::vector<size_t> members(by_type[k].rbegin(), by_type[k].rend());
    for (size_t first = 0; first < members.size();) {
      std::vector<Tensor> flat;
      int64_t bytes = 0;
      size_t last = first;
      const int64_t limit = first == 0
                                ? std::min(options_.first_bucket_bytes, options_.bucket_bytes)
                                : options_.bucket_bytes;
      while (last < members.size() && (last == first || bytes < limit)) {
        const Tensor& g = gradients[members[last]].second;
        flat.push_back(reshape(g.dtype() == types[k] ? g : cast(g, types[k]), {-1}));
        bytes += g.numel() * static_cast<int64_t>(size_of(types[k]));
        ++last;
      }
      Tensor sum = all_reduce(flat.size() == 1 ? flat[0] : concat(flat));
      Tensor mean = sum / static_cast<double>(processes);
      averaged.push_back(mean);
      ++last_buckets_;
      int64_t at = 0;
      for (size_t m = first; m < last; ++m) {
        Tensor& g = gradients[members[m]].second;
        const int64_t n = g.numel();
        Tensor part = reshape(slice(mean, 0, at, at + n), g.shape());
        g = part.dtype() == g.dtype() ? part : cast(part, g.dtype());
        at += n;
      }
      first = last;
    }
  }
  take_rank0_buffers(averaged);
  // The collectives run now, together, in the order made here. Left lazy, each would run when
  // something first read it, and a process that read one layer's gradient before another's
  // (logging on rank 0) would pair its buckets with other buckets of the other processes.
  eval(averaged);
}

}  // namespace mixtape::dist
