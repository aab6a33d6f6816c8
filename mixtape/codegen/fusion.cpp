// mixtape/codegen/fusion.cpp -- greedy producer-into-consumer fusion with access maps (DESIGN.md
// decision 7).
#include "mixtape/codegen/fusion.h"

#include <algorithm>
#include <numeric>
#include <unordered_set>

#include <fmt/ranges.h>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/log.h"
#include "mixtape/dsl/shape.h"

namespace mixtape {
namespace {

using kir::Affine;

// The ops' kinds are in dsl/ops.def: views are affine index maps, reductions the ones kernels
// fuse (sum and max).
bool is_view(OpCode op) { return op_info(op).kind == OpKind::View; }

Affine unit(size_t rank, int var) {
  Affine a;
  a.coeff.assign(rank, 0);
  if (var >= 0) a.coeff[var] = 1;
  return a;
}

bool is_reduction(const Node& node) { return op_info(node.op).kind == OpKind::Reduce; }

// A gradient sum of a module call (GradientSumCalls), or null.
const ModuleCall* sum_call(const Node& node) {
  return node.backward && is_reduction(node) ? node.origin.module_call.get() : nullptr;
}

bool reduced_axis(const Node& reduction, size_t d) {
  const std::vector<int64_t>& axes = reduction.attrs.axes;
  return std::find(axes.begin(), axes.end(), static_cast<int64_t>(d)) != axes.end();
}

// Reductions that loop over the same nest: the same input shape and the same reduced axes (the
// nest keeps the axes in input order, whatever order they were named in).
bool same_loop_nest(const Node& a, const Node& b) {
  const Shape& in = a.inputs[0]->shape;
  if (in != b.inputs[0]->shape) return false;
  for (size_t d = 0; d < in.size(); ++d)
    if (reduced_axis(a, d) != reduced_axis(b, d)) return false;
  return true;
}

Affine scaled_sum(const std::vector<Affine>& coords, const std::vector<int64_t>& strides) {
  Affine sum;
  sum.coeff.assign(coords.empty() ? 0 : coords[0].coeff.size(), 0);
  for (size_t j = 0; j < coords.size(); ++j) {
    sum.base += coords[j].base * strides[j];
    for (size_t d = 0; d < sum.coeff.size(); ++d) sum.coeff[d] += coords[j].coeff[d] * strides[j];
  }
  return sum;
}

// The coordinates over `shape` of a flat row-major index that a nest over `dims` walks, where
// no loop variable's steps carry from one coordinate into the next at any point of the nest (a
// reshape of [64, 16, 64] read as [64, 16, 8, 8]: each variable stays inside one coordinate);
// false otherwise. Views below a reshape (a batch norm's broadcast statistics reshaped back to the
// image) then keep their own maps instead of being stored for the reshape's reader.
bool unflatten(const Affine& flat, const Shape& shape, const std::vector<int64_t>& dims,
               std::vector<Affine>& coords) {
  const std::vector<int64_t> strides = strides_of(shape);
  const int64_t count = numel(shape);
  if (flat.base < 0 || flat.base >= count) return false;
  coords.assign(shape.size(), unit(dims.size(), -1));
  int64_t rest = flat.base;
  for (size_t j = 0; j < shape.size(); ++j) {
    coords[j].base = rest / strides[j];
    rest %= strides[j];
  }
  for (size_t d = 0; d < flat.coeff.size(); ++d) {
    const int64_t c = flat.coeff[d];
    if (c == 0) continue;
    if (c < 0 || c >= count) return false;
    // The one coordinate whose digit c is: strides[j] <= c < strides[j] * shape[j].
    size_t j = 0;
    while (j < shape.size() && !(c >= strides[j] && c < strides[j] * shape[j])) ++j;
    if (j == shape.size() || c % strides[j] != 0) return false;
    coords[j].coeff[d] += c / strides[j];
  }
  for (size_t j = 0; j < shape.size(); ++j) {
    int64_t last = coords[j].base;
    for (size_t d = 0; d < dims.size(); ++d) last += coords[j].coeff[d] * (dims[d] - 1);
    if (last >= shape[j]) return false;
  }
  return true;
}

}  // namespace

bool kernel_reads(const Node& node, size_t k) { return node.op != OpCode::Custom || k == 0; }

bool transfer_access(const Node& node, size_t k, const Access& access,
                     const std::vector<int64_t>& dims, Access& out, std::string& why) {
  const size_t rank = dims.size();
  const Shape& in_shape = node.inputs[k]->shape;
  out = Access{};
  if (node.op == OpCode::Custom) {  // its forward result, element for element
    if (!kernel_reads(node, k)) {
      why = "a custom op's kernels read its forward result alone";
      return false;
    }
    out = access;
    return true;
  }
  switch (op_info(node.op).kind) {
    case OpKind::Pointwise:
      if (in_shape.empty() && !node.shape.empty())  // a fused op's 0-d operand: one element
        return true;
      if (in_shape != node.shape) {
        why = "pointwise inputs of different shapes";
        return false;
      }
      out = access;
      return true;
    case OpKind::View:
      break;
    default:
      why = "not a kernel op";
      return false;
  }
  if (node.op == OpCode::Reshape) {
    out.flat = true;
    out.coords = {access.flat ? access.coords[0]
                              : scaled_sum(access.coords, strides_of(node.shape))};
    return true;
  }
  Access unflat;
  const Access* at = &access;
  if (access.flat) {
    // Below a reshape a view reads through its own map where the flat index splits into the
    // view's coordinates; an element-for-element broadcast reads as the reshape does.
    if (numel(in_shape) == node.numel() && node.op == OpCode::BroadcastTo) {
      out = access;
      return true;
    }
    if (!unflatten(access.coords[0], node.shape, dims, unflat.coords)) {
      why = fmt::format("{} below a reshape", op_name(node.op));
      return false;
    }
    at = &unflat;
  }
  out.coords.resize(in_shape.size());
  if (node.op == OpCode::Permute) {
    for (size_t j = 0; j < node.attrs.axes.size(); ++j)
      out.coords[node.attrs.axes[j]] = at->coords[j];
  } else if (node.op == OpCode::BroadcastTo) {
    size_t lead = node.shape.size() - in_shape.size();
    for (size_t d = 0; d < in_shape.size(); ++d)
      out.coords[d] = in_shape[d] == 1 ? unit(rank, -1) : at->coords[lead + d];
  } else {  // Slice
    for (size_t d = 0; d < in_shape.size(); ++d) {
      Affine a = at->coords[d];
      a.base = a.base * node.attrs.steps[d] + node.attrs.starts[d];
      for (int64_t& c : a.coeff) c *= node.attrs.steps[d];
      out.coords[d] = a;
    }
  }
  return true;
}

namespace {

// A flat (row-major element) index that the loops over the first `loop_dims` of `dims` walk
// through every element of `shape` once: the loop variables it moves with, ordered by step,
// step as the row-major strides of their extents (a reshape stored from its input's loop nest).
bool flat_bijective(const Affine& flat, const Shape& shape, const std::vector<int64_t>& dims,
                    size_t loop_dims) {
  if (flat.base != 0) return false;
  std::vector<std::pair<int64_t, int64_t>> steps;  // (step, extent) of each variable it moves with
  for (size_t d = 0; d < flat.coeff.size(); ++d) {
    if (flat.coeff[d] == 0) continue;
    if (flat.coeff[d] < 0 || d >= loop_dims) return false;
    // A variable over one value never moves the index (its row-major step may equal another's:
    // [1, 0, 1]'s strides are [0, 1, 1]).
    if (dims[d] != 1) steps.emplace_back(flat.coeff[d], dims[d]);
  }
  std::sort(steps.begin(), steps.end());
  int64_t stride = 1;
  for (auto [step, extent] : steps) {
    if (step != stride) return false;
    stride *= extent;
  }
  int64_t total = std::accumulate(dims.begin(), dims.begin() + static_cast<ptrdiff_t>(loop_dims),
                                  int64_t{1}, std::multiplies<>());
  return stride == numel(shape) && total == stride;
}

// Each coordinate is one distinct loop variable of dims[0, loop_dims) over exactly that extent:
// every element once per point of those dims.
bool bijective(const Access& access, const Shape& shape, const std::vector<int64_t>& dims,
               size_t loop_dims) {
  if (access.flat) return flat_bijective(access.coords[0], shape, dims, loop_dims);
  std::vector<bool> used(dims.size(), false);
  int64_t covered = 1;
  for (size_t j = 0; j < shape.size(); ++j) {
    const Affine& a = access.coords[j];
    if (a.base != 0) return false;
    int var = -1;
    for (size_t d = 0; d < a.coeff.size(); ++d) {
      if (a.coeff[d] == 0) continue;
      if (a.coeff[d] != 1 || var >= 0 || used[d] || d >= loop_dims || dims[d] != shape[j])
        return false;
      var = static_cast<int>(d);
    }
    if (var < 0 && shape[j] != 1) return false;
    if (var >= 0) used[var] = true;
    covered *= shape[j];
  }
  int64_t total = std::accumulate(dims.begin(), dims.begin() + static_cast<ptrdiff_t>(loop_dims),
                                  int64_t{1}, std::multiplies<>());
  return covered == total;
}

// The row-major element offset an access reads of a value of `shape`.
Affine element_offset(const Access& access, const Shape& shape) {
  if (access.flat) return access.coords[0];
  return scaled_sum(access.coords, strides_of(shape));
}

// Whether two accesses read the same element at every point (a reshape's flat access and the
// coordinates it came from, say).
bool same_elements(const Access& a, const Access& b, const Shape& shape) {
  if (a == b) return true;
  Affine x = element_offset(a, shape), y = element_offset(b, shape);
  x.coeff.resize(std::max(x.coeff.size(), y.coeff.size()), 0);
  y.coeff.resize(x.coeff.size(), 0);
  return x == y;
}

bool varies_along(const Access& access, int from) {
  for (const Affine& a : access.coords)
    for (size_t d = static_cast<size_t>(from); d < a.coeff.size(); ++d)
      if (a.coeff[d] != 0) return true;
  return false;
}

// A kernel's loop nest (it sets the group's dims and reduce_from) and the accesses that read its
// (epilogue) domain, the reduction's input and the reductions' results in it.
struct LoopNest {
  Node* reduction;
  Shape domain;
  std::vector<int> domain_var;  // loop var of each domain coordinate
  std::vector<int> input_var;   // reduction: loop var of each input axis
  size_t rank = 0;
  Access identity;        // an output of the (epilogue) domain
  Access input_identity;  // the reduction's input

  explicit LoopNest(FusionGroup& group)
      : reduction(group.reductions.empty() ? nullptr : group.reductions.front()) {
    Node* root = *std::max_element(group.members.begin(), group.members.end(),
                                   [](Node* a, Node* b) { return a->id < b->id; });
    domain = reduction ? reduction->shape : root->shape;
    // A kernel that ends in a reshape (laying a value out for a matmul) loops over the reshape's
    // input and stores the reshape at the row-major index of each point (access_outputs): the
    // members below it, broadcasts among them, keep their own maps instead of being reached
    // through the reshape's flat index, which no broadcast below a reshape can be.
    if (!reduction && root->op == OpCode::Reshape && !root->inputs[0]->shape.empty())
      domain = root->inputs[0]->shape;
    domain_var.assign(domain.size(), -1);
    group.dims.clear();
    group.reduce_from = -1;
    if (reduction)
      reduction_dims(group);
    else {
      group.dims = domain;
      for (size_t d = 0; d < domain.size(); ++d) domain_var[d] = static_cast<int>(d);
      if (group.dims.empty()) group.dims = {1};
    }
    rank = group.dims.size();
    for (int v : domain_var) identity.coords.push_back(unit(rank, v));
    for (int v : input_var) input_identity.coords.push_back(unit(rank, v));
  }

  // Where each reduction's result is read: every reduction shares the nest, but may keep the
  // reduced axes as size-1 dims or drop them.
  Access result_identity(bool keepdim) const {
    Access access;
    for (size_t d = 0; d < input_var.size(); ++d) {
      if (!reduced_axis(*reduction, d))
        access.coords.push_back(unit(rank, input_var[d]));
      else if (keepdim)
        access.coords.push_back(unit(rank, -1));
    }
    return access;
  }

  // The outer domain as the reductions give it, with the reduced axes kept or dropped.
  Shape outer_shape(bool keepdim) const {
    Shape shape;
    for (size_t d = 0; d < input_var.size(); ++d)
      if (!reduced_axis(*reduction, d))
        shape.push_back(reduction->inputs[0]->shape[d]);
      else if (keepdim)
        shape.push_back(1);
    return shape;
  }

 private:
  // A reduction's nest: the kept axes outside, the reduced ones inside (from reduce_from).
  void reduction_dims(FusionGroup& group) {
    const Shape& in = reduction->inputs[0]->shape;
    input_var.assign(in.size(), -1);
    for (size_t d = 0; d < in.size(); ++d)
      if (!reduced_axis(*reduction, d)) {
        input_var[d] = static_cast<int>(group.dims.size());
        group.dims.push_back(in[d]);
      }
    group.reduce_from = static_cast<int>(group.dims.size());
    for (size_t d = 0; d < in.size(); ++d)
      if (reduced_axis(*reduction, d)) {
        input_var[d] = static_cast<int>(group.dims.size());
        group.dims.push_back(in[d]);
      }
    if (group.reduce_from == 0) {  // a full reduction: one outer point
      group.dims.insert(group.dims.begin(), 1);
      group.reduce_from = 1;
      for (int& v : input_var) ++v;
    }
    size_t j = 0;  // domain coordinate -> loop var
    for (size_t d = 0; d < in.size(); ++d) {
      if (reduced_axis(*reduction, d) && !reduction->attrs.keepdim) continue;
      domain_var[j++] = reduced_axis(*reduction, d) ? -1 : input_var[d];
    }
  }
};

class Fuser {
 public:
  Fuser(const std::vector<Node*>& pending, const std::vector<Node*>& required,
        const FusionOptions& options)
      : pending_(pending), options_(options), log_(log_enabled("fusion")) {
    for (Node* node : pending) in_pending_.insert(node);
    for (Node* node : required) required_.insert(node);
    for (Node* node : pending)
      for (size_t k = 0; k < node->inputs.size(); ++k)
        if (in_pending_.count(node->inputs[k].get()) && kernel_reads(*node, k))
          users_[node->inputs[k].get()].push_back(node);
    if (options_.fuse && options_.matmul_epilogue) find_epilogues();
  }

  std::vector<FusionGroup> run() {
    for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) place(*it);
    std::vector<FusionGroup> out;
    for (FusionGroup& group : groups_) {
      if (group.members.empty()) continue;
      std::sort(group.members.begin(), group.members.end(),
                [](Node* a, Node* b) { return a->id < b->id; });
      std::sort(group.outputs.begin(), group.outputs.end(),
                [](Node* a, Node* b) { return a->id < b->id; });
      if (is_alias(group)) group.kind = FusionGroup::Kind::Alias;
      out.push_back(std::move(group));
    }
    // A group's inputs are stored by groups whose newest member is older than any reader (see
    // place()), so ordering by the newest member is a valid execution order.
    std::sort(out.begin(), out.end(), [](const FusionGroup& a, const FusionGroup& b) {
      return a.members.back()->id < b.members.back()->id;
    });
    if (options_.fuse) merge_copies_into_producers(out);
    if (options_.fuse) merge_single_element_kernels(out);
    if (log_)
      for (const FusionGroup& group : out) log_group(group);
    return out;
  }

 private:
  void place(Node* node) {
    if (auto found = epilogue_of_.find(node); found != epilogue_of_.end())
      return place_in_epilogue(node, epilogues_.at(found->second));
    const std::vector<Node*>& users = users_[node];
    bool required = required_.count(node) > 0;
    if (!kernel_op(*node)) {
      new_group(node,
                node->op == OpCode::MatMul ? FusionGroup::Kind::MatMul : FusionGroup::Kind::Host);
      if (node->op == OpCode::MatMul) groups_.back().matmul = node;
      return;
    }
    if (!required && is_constant_fill(*node) &&
        std::all_of(users.begin(), users.end(), [&](Node* u) {
          if (inlined_.count(u)) return true;
          std::vector<size_t> readers = groups_of(u);
          return std::all_of(readers.begin(), readers.end(), [&](size_t g) {
            return groups_[g].kind == FusionGroup::Kind::Kernel;
          });
        })) {
      inlined_.insert(node);  // recomputed as a constant inside every reader
      return;
    }
    if (options_.fuse && !users.empty()) {
      if (!required && copy_into_readers(node)) return;
      // Candidate groups, earliest root first: a reader outside the chosen group must come
      // after that group's root, or the groups could depend on each other.
      std::vector<size_t> candidates;
      for (Node* user : users) {
        if (inlined_.count(user)) continue;
        for (size_t g : groups_of(user))
          if (groups_[g].kind == FusionGroup::Kind::Kernel &&
              std::find(candidates.begin(), candidates.end(), g) == candidates.end())
            candidates.push_back(g);
      }
      std::sort(candidates.begin(), candidates.end(),
                [&](size_t a, size_t b) { return root_id(a) < root_id(b); });
      for (size_t g : candidates) {
        bool stored = required;
        bool ordered = true;
        for (Node* user : users) {
          if (inlined_.count(user)) continue;
          // A copied view's reader is each group holding a copy: it runs after this one when
          // its root is newer (groups run in the order of their roots).
          const bool copied = copies_.count(user) > 0;
          for (size_t h : groups_of(user)) {
            if (h == g) continue;
            stored = true;
            if ((copied ? root_id(h) : user->id) <= root_id(g)) ordered = false;
          }
        }
        if (!ordered) {
          reject(node, g, "read by another kernel that runs before this one");
          continue;
        }
        if (try_join(node, g, stored)) return;
      }
    }
    new_group(node, FusionGroup::Kind::Kernel);
  }

  uint64_t root_id(size_t g) const { return groups_[g].members.front()->id; }

  // The groups that read a placed node: its own, or each one holding a copy of it.
  std::vector<size_t> groups_of(Node* node) const {
    if (auto found = copies_.find(node); found != copies_.end()) return found->second;
    return {group_of_.at(node)};
  }

  // A view read by kernels of several groups (a batch norm's statistics broadcast over the
  // image, read by the forward and the backward kernels; a convolution's output reshaped for the
  // statistics, read by the sums and by the normalization) is copied into each of them: every
  // one reads the view's input through the view's map, and no kernel stores the view (which
  // took a kernel, or an output, writing it whole). All or nothing: a reader that cannot take
  // the copy keeps the view stored as before. Not a transpose of a pending pointwise value (a
  // permute of exp(x)): that value, computed inside the transpose's first reader while the
  // transpose is stored, would need a kernel of its own to be stored for the copies, and each
  // copy would read it strided. One-element views are left to the one-element merge
  // (merge_single_element_kernels), which finds a value's kernel by its members.
  bool copy_into_readers(Node* node) {
    if (!is_view(node->op) || numel(node->shape) == 1) return false;
    Node* source = node->inputs[0].get();
    if (node->op == OpCode::Permute && in_pending_.count(source) && kernel_op(*source) &&
        !is_reduction(*source))
      return false;
    std::vector<size_t> readers;
    for (Node* user : users_[node]) {
      if (inlined_.count(user)) continue;
      for (size_t g : groups_of(user)) {
        if (groups_[g].kind != FusionGroup::Kind::Kernel) return false;
        if (std::find(readers.begin(), readers.end(), g) == readers.end()) readers.push_back(g);
      }
    }
    if (readers.size() < 2) return false;
    std::vector<FusionGroup> before;
    for (size_t g : readers) before.push_back(groups_[g]);
    for (size_t i = 0; i < readers.size(); ++i) {
      if (try_join(node, readers[i], false)) continue;
      for (size_t j = 0; j < i; ++j) groups_[readers[j]] = std::move(before[j]);
      group_of_.erase(node);
      return false;
    }
    copies_[node] = std::move(readers);
    return true;
  }

  // A kernel that only copies another kernel's stored value into a new shape and type (a
  // gradient computed in f32 by an f32 composite, rounded to bf16 and laid out for the matmul
  // that reads it) becomes one more stored value of the kernel that computes it: the value is
  // then stored only in its 16-bit form where nothing else reads it (the cross-entropy's
  // [rows, classes] gradient: 4 bytes an element less). The merged kernel keeps the producer's
  // place, before the copy's readers; the copy's value is the same conversion of the same
  // element, so the bits are the same.
  void merge_copies_into_producers(std::vector<FusionGroup>& groups) const {
    std::unordered_map<const Node*, size_t> stored_by;
    for (size_t g = 0; g < groups.size(); ++g)
      if (groups[g].kind == FusionGroup::Kind::Kernel)
        for (const Node* output : groups[g].outputs) stored_by[output] = g;
    for (FusionGroup& copy : groups) {
      if (copy.kind != FusionGroup::Kind::Kernel || copy.members.size() != 1 ||
          copy.members[0]->op != OpCode::Reshape)
        continue;
      Node* reshape = copy.members[0];
      auto found = stored_by.find(reshape->inputs[0].get());
      if (found == stored_by.end()) continue;
      FusionGroup merged = groups[found->second];
      merged.members.push_back(reshape);
      merged.outputs.push_back(reshape);
      std::sort(merged.members.begin(), merged.members.end(),
                [](Node* a, Node* b) { return a->id < b->id; });
      Node* source = reshape->inputs[0].get();
      std::unordered_set<const Node*> inside(merged.members.begin(), merged.members.end());
      const std::vector<Node*>& readers = users_.at(source);
      if (!required_.count(source) &&
          std::all_of(readers.begin(), readers.end(), [&](Node* r) { return inside.count(r); }))
        std::erase(merged.outputs, source);
      std::string why;
      if (static_cast<int>(merged.members.size()) > options_.max_members ||
          !plan_access(merged, why) || count_params(merged) > options_.max_params) {
        if (log_)
          log_line("fusion", "not merging the copy {} #{} into the kernel that stores #{}: {}",
                   op_name(reshape->op), reshape->id, source->id,
                   why.empty() ? "the kernel is at its size limit" : why);
        continue;
      }
      for (const Node* output : merged.outputs) stored_by[output] = found->second;
      groups[found->second] = std::move(merged);
      copy.members.clear();
    }
    std::erase_if(groups, [](const FusionGroup& g) { return g.members.empty(); });
  }

  // Kernels of a single element (an optimizer's step count and bias corrections, a learning
  // rate's casts, a clipping coefficient) become one kernel where no group between two of them
  // reads the first or is read by the second: each was a launch of its own on every step, and
  // a compile of its own on the first. The merged kernel runs at the first one's place, where
  // the second's inputs are ready (none comes from a group in between). Each value is computed
  // by the same operations, so the bits are the same.
  void merge_single_element_kernels(std::vector<FusionGroup>& groups) const {
    auto single = [](const FusionGroup& g) {
      return g.kind == FusionGroup::Kind::Kernel && g.reductions.empty() &&
             std::all_of(g.members.begin(), g.members.end(),
                         [](const Node* m) { return numel(m->shape) == 1; });
    };
    std::unordered_map<const Node*, size_t> made_by;
    for (size_t g = 0; g < groups.size(); ++g)
      for (const Node* m : groups[g].members) made_by[m] = g;
    auto reads = [&](const FusionGroup& reader, size_t g) {
      for (const Node* m : reader.members)
        for (const NodePtr& input : m->inputs)
          if (auto found = made_by.find(input.get()); found != made_by.end() && found->second == g)
            return true;
      return false;
    };
    constexpr size_t none = SIZE_MAX;
    size_t into = none;
    for (size_t c = 0; c < groups.size(); ++c) {
      if (!single(groups[c])) continue;
      bool apart = into != none;
      for (size_t h = into + 1; apart && h < c; ++h)
        apart = groups[h].members.empty() || (!reads(groups[h], into) && !reads(groups[c], h));
      FusionGroup merged;
      std::string why;
      if (apart) {
        merged = groups[into];
        const FusionGroup& other = groups[c];
        merged.members.insert(merged.members.end(), other.members.begin(), other.members.end());
        merged.outputs.insert(merged.outputs.end(), other.outputs.begin(), other.outputs.end());
        auto by_id = [](const Node* a, const Node* b) { return a->id < b->id; };
        std::sort(merged.members.begin(), merged.members.end(), by_id);
        std::sort(merged.outputs.begin(), merged.outputs.end(), by_id);
        // A value stored only for the other kernel is now read inside this one.
        std::unordered_set<const Node*> inside(merged.members.begin(), merged.members.end());
        std::erase_if(merged.outputs, [&](Node* output) {
          if (required_.count(output)) return false;
          auto found = users_.find(output);
          return found == users_.end() ||
                 std::all_of(found->second.begin(), found->second.end(),
                             [&](const Node* user) { return inside.count(user) > 0; });
        });
        if (static_cast<int>(merged.members.size()) > options_.max_members)
          why = "the kernel is at its size limit";
        else if (plan_access(merged, why) && count_params(merged) > options_.max_params)
          why = "too many kernel parameters";
      }
      if (!apart || !why.empty()) {
        if (apart && log_)
          log_line("fusion", "not merging the one-element kernel of {} #{} into that of {} #{}: {}",
                   op_name(groups[c].members.front()->op), groups[c].members.front()->id,
                   op_name(groups[into].members.front()->op), groups[into].members.front()->id,
                   why);
        into = c;
        continue;
      }
      for (const Node* m : groups[c].members) made_by[m] = into;
      groups[into] = std::move(merged);
      groups[c].members.clear();
    }
    std::erase_if(groups, [](const FusionGroup& g) { return g.members.empty(); });
  }

  // A matmul with the readers its epilogue absorbs (FusionOptions::matmul_epilogue). They are
  // found before placing: placing walks from the newest node, so the relu and the add are placed
  // before the matmul whose group they join.
  struct Epilogue {
    Node* matmul = nullptr;
    Node* output = nullptr;  // the last node of the chain, the one the group stores
    Node* bias = nullptr;
    bool relu = false;
    DType product_type = f32, bias_type = f32;
    std::vector<Node*> absorbed;  // the matmul's readers it takes in
    size_t group = SIZE_MAX;      // the group, once its first member is placed
  };

  // The one node that reads `node`, where nothing else needs its value.
  Node* sole_reader(Node* node) const {
    if (required_.count(node)) return nullptr;
    auto found = users_.find(node);
    return found != users_.end() && found->second.size() == 1 ? found->second[0] : nullptr;
  }

  static DType stored_type(const Node& node) {
    return node.value ? node.value->dtype : node.precision.storage_type;
  }
  static bool gemm_float(DType t) { return t == f32 || is_half(t); }

  // Whether `add` is product + a row broadcast over the product's rows that the epilogue can add
  // with the reference's roundings; then sets the bias and the type the product is rounded to
  // first. The reference rounds the product to its storage type, then rounds both operands of a
  // 16-bit add to its compute type (an f32 bias entering a bf16 add is used as bf16), adds in
  // f32 and rounds to the add's storage type.
  bool bias_add(Node* product, Node* add, Epilogue& e) const {
    if (add->op != OpCode::Add || add->shape != product->shape) return false;
    Node* row = add->inputs[add->inputs[0].get() == product ? 1 : 0].get();
    if (row->op != OpCode::BroadcastTo || !in_pending_.count(row) || sole_reader(row) != add)
      return false;
    Node* bias = row->inputs[0].get();
    const int64_t n = product->shape.back();
    if (bias->shape.empty() || bias->shape.back() != n || numel(bias->shape) != n) return false;
    // The broadcast stores the bias in its own type (an f32 parameter viewed in a bf16 region is
    // rounded to bf16), and that is the type the epilogue reads it in.
    const DType bias_type = row->precision.storage_type;
    const DType product_type = product->precision.storage_type;
    const DType compute = add->precision.compute;
    if (!gemm_float(stored_type(*bias)) || !gemm_float(bias_type) ||
        !gemm_float(add->precision.storage_type))
      return false;
    if (is_half(compute)) {
      if ((product_type != f32 && product_type != compute) || bias_type != compute) return false;
      e.product_type = compute;
    } else {
      if (compute != f32) return false;
      e.product_type = product_type;
    }
    e.bias = bias;
    e.bias_type = bias_type;
    e.absorbed = {row, add};
    return true;
  }

  // A relu of `value` that changes no type (so that it commutes with the rounding to it).
  static bool exact_relu(const Node& value, const Node& relu) {
    const DType type = value.precision.storage_type;
    return relu.op == OpCode::Relu && relu.precision.storage_type == type &&
           (!is_half(relu.precision.compute) || relu.precision.compute == type);
  }

  void find_epilogues() {
    for (Node* node : pending_) {
      const NodePrecision& p = node->precision;
      if (node->op != OpCode::MatMul || !gemm_float(p.compute) || !gemm_float(p.storage_type) ||
          is_half(p.accum))
        continue;
      Epilogue e;
      e.matmul = e.output = node;
      if (Node* add = sole_reader(node); add && bias_add(node, add, e)) e.output = add;
      if (Node* relu = sole_reader(e.output); relu && exact_relu(*e.output, *relu)) {
        e.relu = true;
        e.absorbed.push_back(relu);
        e.output = relu;
      }
      if (e.output == node) continue;
      epilogue_of_[node] = epilogues_.size();
      for (Node* reader : e.absorbed) epilogue_of_[reader] = epilogues_.size();
      epilogues_.push_back(std::move(e));
    }
  }

  void place_in_epilogue(Node* node, Epilogue& e) {
    if (e.group == SIZE_MAX) {
      FusionGroup group;
      group.kind = FusionGroup::Kind::MatMul;
      group.outputs = {e.output};
      group.matmul = e.matmul;
      group.bias = e.bias;
      group.relu = e.relu;
      group.product_type = e.product_type;
      group.bias_type = e.bias_type;
      e.group = groups_.size();
      groups_.push_back(std::move(group));
    }
    groups_[e.group].members.push_back(node);
    group_of_[node] = e.group;
  }

  // A kernel that would only copy a stored value into a new shape (a reshape read by a matmul),
  // or a custom op's forward result that a matmul or a host op computed (kernel_reads): row-major
  // storage is the same bytes in any shape, so the node shares its input 0's buffer. Not a
  // stop_gradient: a detached copy of a parameter keeps its value when a replay updates the
  // parameter in place (README, "What mt::compile replays").
  static bool is_alias(const FusionGroup& group) {
    if (group.kind != FusionGroup::Kind::Kernel || group.members.size() != 1) return false;
    const Node& node = *group.members[0];
    if (node.op != OpCode::Reshape && node.op != OpCode::Custom) return false;
    const Node& input = *node.inputs[0];
    if (is_constant_fill(input)) return false;
    DType stored = input.value ? input.value->dtype : input.precision.storage_type;
    return stored == node.precision.storage_type;
  }

  void new_group(Node* node, FusionGroup::Kind kind) {
    FusionGroup group;
    group.kind = kind;
    group.members = {node};
    group.outputs = {node};
    if (kind == FusionGroup::Kind::Kernel) {
      if (is_reduction(*node)) group.reductions = {node};
      std::string why;
      if (!plan_access(group, why))
        fail("fusion: cannot lower a single {} node: {}", op_name(node->op), why);
    }
    group_of_[node] = groups_.size();
    groups_.push_back(std::move(group));
  }

  bool try_join(Node* node, size_t g, bool stored) {
    FusionGroup trial = groups_[g];
    trial.members.push_back(node);
    if (stored) trial.outputs.push_back(node);
    std::string why;
    if (is_reduction(*node) && !trial.reductions.empty() && !options_.multi_pass) {
      why = "the kernel already has a reduction";
    } else if (is_reduction(*node) && !trial.reductions.empty() &&
               !same_loop_nest(*node, *trial.reductions.front())) {
      why = fmt::format(
          "the kernel's reduction runs over other axes or another shape ({} over {} of {}, "
          "this one over {} of {})",
          op_name(trial.reductions.front()->op),
          fmt::join(trial.reductions.front()->attrs.axes, ","),
          to_string(trial.reductions.front()->inputs[0]->shape), fmt::join(node->attrs.axes, ","),
          to_string(node->inputs[0]->shape));
    } else if (const ModuleCall* call = sum_call(*node);
               call &&
               std::any_of(trial.reductions.begin(), trial.reductions.end(),
                           [&](const Node* r) { return sum_call(*r) && sum_call(*r) != call; })) {
      why =
          "the kernel's reductions sum the gradients of another call of the module "
          "(GradientSumCalls)";
    } else if (static_cast<int>(trial.members.size()) > options_.max_members) {
      why = "the kernel is at its size limit";
    } else {
      if (is_reduction(*node)) {
        trial.reductions.push_back(node);
        std::sort(trial.reductions.begin(), trial.reductions.end(),
                  [](Node* a, Node* b) { return a->id < b->id; });
      }
      if (plan_access(trial, why) && count_params(trial) > options_.max_params)
        why = "too many kernel parameters";
    }
    if (!why.empty()) {
      reject(node, g, why);
      return false;
    }
    groups_[g] = std::move(trial);
    group_of_[node] = g;
    return true;
  }

  int count_params(const FusionGroup& group) const {
    std::unordered_set<Node*> members(group.members.begin(), group.members.end());
    std::unordered_set<Node*> loads;
    for (Node* m : group.members)
      for (size_t k = 0; k < m->inputs.size(); ++k) {
        Node* input = m->inputs[k].get();
        if (!members.count(input) && !is_constant_fill(*input) && kernel_reads(*m, k))
          loads.insert(input);
      }
    return static_cast<int>(loads.size() + group.outputs.size());
  }

  // Builds the loop nest and every member's accesses from the stored outputs down; false (with
  // the reason) when some member cannot be reached by an affine access or stored exactly once.
  bool plan_access(FusionGroup& group, std::string& why) const {
    group.access.clear();
    std::unordered_set<Node*> members(group.members.begin(), group.members.end());
    const LoopNest nest(group);
    if (!access_outputs(group, nest, why) || !propagate_access(group, nest, members, why))
      return false;
    if (nest.reduction && !options_.multi_pass && !epilogue_stays_outside(group, members, why))
      return false;
    return stored_once(group, nest.reduction, why);
  }

  static bool is_member_reduction(const FusionGroup& group, Node* node) {
    return std::find(group.reductions.begin(), group.reductions.end(), node) !=
           group.reductions.end();
  }

  // Seeds the stored outputs' accesses: each is one of the nest's identities.
  static bool access_outputs(FusionGroup& group, const LoopNest& nest, std::string& why) {
    for (Node* output : group.outputs) {
      if (is_member_reduction(group, output)) {
        group.access[output].push_back(nest.result_identity(output->attrs.keepdim));
      } else if (output->shape == nest.domain) {
        group.access[output].push_back(nest.identity);
      } else if (nest.reduction && output->shape == nest.reduction->inputs[0]->shape) {
        group.access[output].push_back(nest.input_identity);
      } else if (nest.reduction && output->shape == nest.outer_shape(true)) {
        group.access[output].push_back(nest.result_identity(true));
      } else if (nest.reduction && output->shape == nest.outer_shape(false)) {
        group.access[output].push_back(nest.result_identity(false));
      } else if (output->op == OpCode::Reshape) {
        // A reshape of the domain or of the reduction's input, stored at the row-major index of
        // each point (the copy that rounds a gradient to a matmul's 16-bit type, made by the
        // kernel that computes the gradient: see merge_copies_into_producers).
        const bool of_input =
            nest.reduction && numel(output->shape) == numel(nest.reduction->inputs[0]->shape);
        const Shape& walked = of_input ? nest.reduction->inputs[0]->shape : nest.domain;
        if (numel(output->shape) != numel(walked)) {
          why = "stored values of different shapes";
          return false;
        }
        Access flat;
        flat.flat = true;
        flat.coords = {scaled_sum((of_input ? nest.input_identity : nest.identity).coords,
                                  strides_of(walked))};
        group.access[output].push_back(std::move(flat));
      } else {
        why = "stored values of different shapes";
        return false;
      }
    }
    return true;
  }

  // Hands every member's accesses on to its inputs, newest member first, so that each member
  // has all its readers' accesses before its own are passed on.
  static bool propagate_access(FusionGroup& group, const LoopNest& nest,
                               const std::unordered_set<Node*>& members, std::string& why) {
    std::vector<Node*> order(group.members.begin(), group.members.end());
    std::sort(order.begin(), order.end(), [](Node* a, Node* b) { return a->id > b->id; });
    for (Node* node : order) {
      std::vector<Access>& accesses = group.access[node];
      if (accesses.empty()) {
        why = fmt::format("{} has no reader in the kernel", op_name(node->op));
        return false;
      }
      if (is_member_reduction(group, node)) {
        if (!std::all_of(accesses.begin(), accesses.end(), [&](const Access& access) {
              return same_elements(access, nest.result_identity(node->attrs.keepdim), node->shape);
            })) {
          why = "the reduction's result is read at other points than its own";
          return false;
        }
        push_access(group, node->inputs[0].get(), nest.input_identity, members);
        continue;
      }
      for (size_t k = 0; k < node->inputs.size(); ++k) {
        Node* input = node->inputs[k].get();
        if (!kernel_reads(*node, k)) continue;
        if (!members.count(input) && (!is_view(node->op) || is_constant_fill(*input))) continue;
        for (const Access& access : accesses) {
          Access out;
          if (!transfer_access(*node, k, access, group.dims, out, why)) return false;
          push_access(group, input, out, members);
        }
      }
    }
    return true;
  }

  // Every stored value other than a reduction's result is written exactly once per element.
  static bool stored_once(FusionGroup& group, const Node* reduction, std::string& why) {
    for (Node* output : group.outputs) {
      const std::vector<Access>& accesses = group.access[output];
      if (is_member_reduction(group, output)) continue;
      // A stored value that does not vary along the reduced axes is stored once per outer
      // point, after the reductions.
      size_t loop_dims = reduction && !varies_along(accesses[0], group.reduce_from)
                             ? static_cast<size_t>(group.reduce_from)
                             : group.dims.size();
      bool once = std::all_of(accesses.begin(), accesses.end(), [&](const Access& access) {
        return same_elements(access, accesses[0], output->shape);
      });
      if (!once || !bijective(accesses[0], output->shape, group.dims, loop_dims)) {
        why = fmt::format("stored {} is not read exactly once per element", op_name(output->op));
        return false;
      }
    }
    return true;
  }

  // Single-pass kernels: members after the reduction run once per outer point, so they may not
  // vary along the reduced axes (that needs a second pass over them).
  static bool epilogue_stays_outside(const FusionGroup& group,
                                     const std::unordered_set<Node*>& members, std::string& why) {
    std::unordered_set<Node*> prologue;
    std::vector<Node*> stack = {group.reductions.front()->inputs[0].get()};
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      if (!members.count(node) || !prologue.insert(node).second) continue;
      for (const NodePtr& input : node->inputs) stack.push_back(input.get());
    }
    for (Node* member : group.members) {
      if (member == group.reductions.front() || prologue.count(member)) continue;
      for (const Access& access : group.access.at(member))
        if (varies_along(access, group.reduce_from)) {
          why = "a value after the reduction varies along the reduced axes";
          return false;
        }
    }
    return true;
  }

  static void push_access(FusionGroup& group, Node* node, const Access& access,
                          const std::unordered_set<Node*>& members) {
    if (!members.count(node)) return;
    // Lowering traces each access on its own, so accesses that read the same elements in
    // another form (flat or coordinates) are kept apart.
    std::vector<Access>& list = group.access[node];
    if (std::find(list.begin(), list.end(), access) == list.end()) list.push_back(access);
  }

  void reject(Node* node, size_t g, const std::string& why) {
    if (log_)
      log_line("fusion", "not merging {} #{} into the kernel of {} #{}: {}", op_name(node->op),
               node->id, op_name(groups_[g].members.front()->op), root_id(g), why);
  }

  void log_group(const FusionGroup& group) const {
    std::string names;
    for (Node* m : group.members) names += fmt::format(" {}#{}", op_name(m->op), m->id);
    const char* kind = group.kind == FusionGroup::Kind::Kernel   ? "kernel"
                       : group.kind == FusionGroup::Kind::MatMul ? "matmul"
                       : group.kind == FusionGroup::Kind::Alias  ? "alias"
                                                                 : "host";
    std::string epilogue;
    if (group.bias)
      epilogue = fmt::format(", epilogue: bias {} added after rounding to {}",
                             to_string(group.bias->shape), name(group.product_type));
    if (group.relu) epilogue += group.bias ? ", relu" : ", epilogue: relu";
    log_line("fusion", "{} [{} nodes, {} stored{}]:{}", kind, group.members.size(),
             group.outputs.size(), epilogue, names);
  }

  const std::vector<Node*>& pending_;
  FusionOptions options_;
  bool log_;
  std::unordered_set<Node*> in_pending_, required_, inlined_;
  std::unordered_map<Node*, std::vector<Node*>> users_;
  std::unordered_map<Node*, size_t> group_of_;
  std::unordered_map<Node*, std::vector<size_t>> copies_;  // copy_into_readers()
  std::vector<FusionGroup> groups_;
  std::vector<Epilogue> epilogues_;
  std::unordered_map<Node*, size_t> epilogue_of_;  // a matmul or a reader its epilogue absorbs
};

}  // namespace

bool is_constant_fill(const Node& node) {
  if (node.evaluated()) return false;
  if (node.op == OpCode::Full) return true;
  return is_view(node.op) && is_constant_fill(*node.inputs[0]);
}

std::vector<FusionGroup> fuse(const std::vector<Node*>& pending, const std::vector<Node*>& required,
                              const FusionOptions& options) {
  return Fuser(pending, required, options).run();
}

uint64_t GradientSumCalls::number(const Node& node) {
  const ModuleCall* call = sum_call(node);
  if (!call) return 0;
  auto found = std::find(calls_.begin(), calls_.end(), call);
  if (found == calls_.end()) found = calls_.insert(calls_.end(), call);
  return static_cast<uint64_t>(found - calls_.begin()) + 1;
}

}  // namespace mixtape
