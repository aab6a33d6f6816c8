// mixtape/autograd/backward.cpp -- the tape walk: backward() and grad() emit gradient nodes into
// the graph.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "mixtape/autograd/grad.h"
#include "mixtape/autograd/recompute.h"
#include "mixtape/autograd/saved_values.h"
#include "mixtape/autograd/vjp.h"
#include "mixtape/dsl/activation_checkpointing.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/orphan_parameters.h"
#include "mixtape/dsl/sort_by_id.h"

namespace mixtape {
namespace {

// The hooks add_gradient_hook installed (dist::DataParallel's), run by every backward().
struct GradientHooks {
  std::mutex mutex;
  std::vector<std::pair<int64_t, std::shared_ptr<const GradientHook>>> hooks;
  int64_t next_id = 1;
  std::atomic<size_t> count{0};  // read unlocked by every backward()
};
GradientHooks& gradient_hooks() {
  static GradientHooks* hooks = new GradientHooks;  // never destroyed: used until exit
  return *hooks;
}

// Each backward pass marks the nodes it walks with a number of its own (Node::grad_walk) and
// finds a node's gradient terms through Node::grad_slot, instead of keeping maps keyed by address:
// the traced loop runs a backward pass every step. A pass started inside another (a custom
// vjp that calls grad()) puts back the marks of the nodes it walked when it ends, so the outer
// pass finds its own again.
std::atomic<uint64_t> grad_walks{0};

thread_local int passes_running = 0;

class WalkMarks {
 public:
  WalkMarks() : walk_(++grad_walks), nested_(passes_running++ > 0) {}
  ~WalkMarks() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      it->node->grad_walk = it->walk;
      it->node->grad_slot = it->slot;
    }
    --passes_running;
  }
  WalkMarks(const WalkMarks&) = delete;
  WalkMarks& operator=(const WalkMarks&) = delete;

  bool seen(const Node& node) const { return node.grad_walk == walk_; }
  void see(Node& node) {
    if (nested_) saved_.push_back({&node, node.grad_walk, node.grad_slot});
    node.grad_walk = walk_;
    node.grad_slot = -1;
  }
  /// The slot of `node`'s gradient terms in this pass, or -1 (none yet, or not on the tape).
  int32_t slot(const Node& node) const { return seen(node) ? node.grad_slot : -1; }

 private:
  struct Saved {
    Node* node;
    uint64_t walk;
    int32_t slot;
  };
  uint64_t walk_;
  bool nested_;
  std::vector<Saved> saved_;
};

// Every node that requires grad and leads to a root, latest first (reverse tape order), each
// marked as seen by this pass. The walk keeps the edges it came through (a root, or an entry of
// a reader's inputs), which stay put while it runs, with their nodes' ids: ordering them takes no
// second trip to each node, and each node's reference is a copy of its edge's, not a
// shared_from_this().
std::vector<NodePtr> tape_in_reverse(const std::vector<NodePtr>& roots, WalkMarks& marks) {
  // Scratch kept per thread (the walk runs to its end before any vjp could start another).
  thread_local std::vector<std::pair<uint64_t, const NodePtr*>> found;
  thread_local std::vector<const NodePtr*> stack;
  found.clear();
  stack.clear();
  for (const NodePtr& root : roots)
    if (root->requires_grad) stack.push_back(&root);
  while (!stack.empty()) {
    const NodePtr& node = *stack.back();
    stack.pop_back();
    if (marks.seen(*node)) continue;
    marks.see(*node);
    for (const NodePtr& input : node->inputs)
      if (input->requires_grad && !marks.seen(*input)) stack.push_back(&input);
    found.emplace_back(node->id, &node);
  }
  sort_by_id(found);
  std::vector<NodePtr> order;
  order.reserve(found.size());
  for (auto it = found.rbegin(); it != found.rend(); ++it) order.push_back(*it->second);
  return order;
}

// Gradients of slices of one tensor (the q, k and v of a fused projection) arrive as zero-padded
// unslices. Two whose windows sit side by side along one axis become one unslice of their
// concatenation, so n windows cost one copy instead of n padded buffers and n - 1 sums. (The sum
// would turn a -0 of a window into +0; the concatenation keeps it.)
std::optional<Tensor> join_adjacent_unslices(const Tensor& a, const Tensor& b) {
  const Node& x = *a.node();
  const Node& y = *b.node();
  if (x.op != OpCode::Unslice || y.op != OpCode::Unslice || x.shape != y.shape ||
      x.dtype != y.dtype)
    return std::nullopt;
  const Shape &wx = x.inputs[0]->shape, &wy = y.inputs[0]->shape;
  int64_t axis = -1;
  for (size_t d = 0; d < x.shape.size(); ++d) {
    if (x.attrs.steps[d] != 1 || y.attrs.steps[d] != 1) return std::nullopt;
    if (x.attrs.starts[d] == y.attrs.starts[d] && wx[d] == wy[d]) continue;
    if (axis >= 0) return std::nullopt;
    axis = static_cast<int64_t>(d);
  }
  if (axis < 0) return std::nullopt;
  const Node& first = x.attrs.starts[axis] < y.attrs.starts[axis] ? x : y;
  const Node& second = &first == &x ? y : x;
  if (first.attrs.starts[axis] + first.inputs[0]->shape[axis] != second.attrs.starts[axis])
    return std::nullopt;
  // A window joined before is already a concatenation along the axis: extend it instead.
  std::vector<Tensor> parts;
  for (const Node* window : {&first, &second}) {
    const NodePtr& part = window->inputs[0];
    if (part->op == OpCode::Concat && part->attrs.axis == axis && !part->evaluated())
      for (const NodePtr& input : part->inputs) parts.emplace_back(input);
    else
      parts.emplace_back(part);
  }
  Tensor joined = concat(parts, axis);
  return unslice(joined, first.attrs.starts, first.attrs.steps, x.shape);
}

// The contributions to one node's gradient, in the order they arrived. Most nodes get exactly
// one, which is kept in place: a list of its own per node was most of a backward pass's heap
// blocks, and the traced loop runs one every step.
struct TermList {
  Tensor first;
  std::vector<Tensor> more;
};

// The contributions to each node's gradient, and the nodes in the order their first
// contribution arrived (a node's slot). Whatever emits graph nodes per node walks them in that
// order, so that the ids of the emitted nodes (the order a traced step's graph is signed in) are
// the same from call to call, as mt::compile needs.
struct Terms {
  explicit Terms(WalkMarks& marks) : marks(marks) {}
  WalkMarks& marks;
  std::vector<TermList> of;    // by slot
  std::vector<Node*> arrival;  // by slot

  TermList* find(const Node& node) {
    int32_t slot = marks.slot(node);
    return slot >= 0 ? &of[static_cast<size_t>(slot)] : nullptr;
  }
};

// Every node that receives a contribution is on the tape (it requires grad), so it is marked.
void accumulate(Terms& grads, const NodePtr& node, Tensor g) {
  if (g.dtype() != node->dtype) g = cast(g, node->dtype);
  int32_t slot = grads.marks.slot(*node);
  if (slot < 0) {
    node->grad_slot = static_cast<int32_t>(grads.of.size());
    grads.of.push_back({std::move(g), {}});
    grads.arrival.push_back(node.get());
    return;
  }
  grads.of[static_cast<size_t>(slot)].more.push_back(std::move(g));
}

// A node's gradient once every contribution is in (reverse tape order sees to that): adjacent
// unslices joined, in whatever order they arrived, then the rest summed in arrival order.
// Sums of a leaf's gradients are the leaf's own, not the forward pass's: they are made with no
// policy (as traced, in the leaf's type, as PyTorch accumulates a parameter's gradient). Inside
// a BackwardScope the forward node's policy types the nodes, so only the sums made outside one
// need this (NoPolicyScope).
const Tensor& combine(TermList& list) {
  if (list.more.empty()) return list.first;
  std::vector<Tensor> terms;
  terms.reserve(list.more.size() + 1);
  terms.push_back(std::move(list.first));
  for (Tensor& t : list.more) terms.push_back(std::move(t));
  list.more.clear();
  for (bool joined = true; joined && terms.size() > 1;) {
    joined = false;
    for (size_t i = 0; i < terms.size() && !joined; ++i)
      for (size_t j = i + 1; j < terms.size() && !joined; ++j)
        if (std::optional<Tensor> both = join_adjacent_unslices(terms[i], terms[j])) {
          terms[i] = std::move(*both);
          terms.erase(terms.begin() + static_cast<ptrdiff_t>(j));
          joined = true;
        }
  }
  Tensor sum = terms[0];
  for (size_t i = 1; i < terms.size(); ++i) sum = sum + terms[i];
  list.first = std::move(sum);
  return list.first;
}

}  // namespace

std::vector<std::pair<const Node*, Tensor>> backpropagate(const std::vector<NodePtr>& roots,
                                                          const std::vector<Tensor>& seeds,
                                                          bool create_graph) {
  if (seeds.size() != roots.size())
    fail("backpropagate: {} seeds for {} roots", seeds.size(), roots.size());
  for (size_t i = 0; i < roots.size(); ++i)
    if (!seeds[i].defined() || seeds[i].shape() != roots[i]->shape)
      fail("backpropagate: seed {} has shape {}, its root has {}", i,
           seeds[i].defined() ? to_string(seeds[i].shape()) : "undefined",
           to_string(roots[i]->shape));
  NoGradGuard mode(create_graph);
  WalkMarks marks;
  std::vector<NodePtr> tape = tape_in_reverse(roots, marks);
  Terms grads(marks);
  // A pass that builds a graph to differentiate again reads the forward nodes themselves: its
  // gradient nodes keep what they read alive anyway, and gradients of clones would reach the
  // module's inputs along a second path, summed in another order than the unchecked graph's.
  std::optional<Recomputation> recompute;
  if (auto globs = checkpoint_globs(); globs && !create_graph) recompute.emplace(std::move(globs));
  std::unique_ptr<SavedValues> saved =
      saved_values_for(roots, tape, create_graph, recompute ? &*recompute : nullptr);
  SavedValuesScope reading(saved.get());
  // Only nodes on the tape get a slot, so `of` never reallocates: the terms combine() returns
  // stay where they are while the vjp's contributions go into other slots.
  grads.of.reserve(tape.size());
  grads.arrival.reserve(tape.size());
  for (size_t i = 0; i < roots.size(); ++i)
    if (roots[i]->requires_grad) accumulate(grads, roots[i], seeds[i]);
  for (const NodePtr& node : tape) {
    if (op_info(node->op).kind == OpKind::Leaf) continue;
    TermList* terms = grads.find(*node);
    if (!terms) continue;
    BackwardScope scope(*node);
    // The rule reads the node, or its recomputation where the node's module is checkpointed.
    std::vector<Tensor> input_grads =
        vjp(recompute ? recompute->for_vjp(node) : node, combine(*terms));
    for (size_t i = 0; i < input_grads.size() && i < node->inputs.size(); ++i)
      if (input_grads[i].defined() && node->inputs[i]->requires_grad)
        accumulate(grads, node->inputs[i], std::move(input_grads[i]));
  }
  NoPolicyScope leaf_sums;
  std::vector<std::pair<const Node*, Tensor>> result;
  result.reserve(grads.arrival.size());
  for (size_t slot = 0; slot < grads.arrival.size(); ++slot)
    result.emplace_back(grads.arrival[slot], combine(grads.of[slot]));
  return result;
}

namespace {

Tensor seed_for(const Tensor& output, const Tensor& grad, const char* op, const Loc& loc) {
  if (!grad.defined()) {
    if (output.numel() != 1)
      op_fail(op, loc,
              "an implicit gradient needs a single-element output, got shape {}; pass a "
              "gradient of the output's shape",
              to_string(output.shape()));
    return ones_like(output);
  }
  if (grad.shape() != output.shape())
    op_fail(op, loc, "gradient shape {} does not match output shape {}", to_string(grad.shape()),
            to_string(output.shape()));
  return grad;
}

}  // namespace

void Tensor::backward(const Tensor& grad, bool retain_graph, const Loc& loc) const {
  if (!defined()) op_fail("backward", loc, "called on an undefined tensor");
  if (!requires_grad())
    op_fail("backward", loc,
            "the tensor does not require grad: no input of the computation was "
            "marked with requires_grad_() (or it was built under no_grad)");
  Tensor seed = seed_for(*this, grad, "backward", loc);
  auto grads = backpropagate({node()}, {seed}, false);
  // The graph is lazy and outlives a backward pass, so a second walk through it would add every
  // gradient again. Checked before any gradient is accumulated, so an error changes nothing.
  std::vector<Node*> walked;
  walked.reserve(grads.size());
  for (const auto& [node, g] : grads) {
    if (op_info(node->op).kind == OpKind::Leaf) continue;
    if (node->backward_done)
      op_fail("backward", loc,
              "a second backward() through the same graph (its {} node from {} was already "
              "walked by an earlier backward(), and would add its gradients again); pass "
              "retain_graph = true to the earlier call to walk it twice, or build the graph "
              "again",
              op_name(node->op), short_location(node->origin.location));
    walked.push_back(const_cast<Node*>(node));
  }
  // A leaf's gradient goes to its tensor, also where the tensor has moved on to another value
  // since the graph was built (an optimizer step between two backward passes of a retained
  // graph), as PyTorch accumulates into the parameter: the old value and the new one are one
  // parameter. Both values in one graph give the tensor one summed gradient.
  // Only a tensor reached through an old value can appear twice, so the search for its entry
  // runs from the first such leaf on: the usual backward (every leaf current) makes no search.
  LeafGradients leaves;
  NoPolicyScope leaf_sums;  // also for the hooks (data parallel's reduction sets none either)
  bool old_value_seen = false;
  for (auto& [node, g] : grads) {
    if (op_info(node->op).kind != OpKind::Leaf) continue;
    std::shared_ptr<TensorImpl> owner = node->grad_owner.lock();
    if (!owner || !owner->node->requires_grad) continue;
    old_value_seen = old_value_seen || owner->node.get() != node;
    auto same = old_value_seen ? std::find_if(leaves.begin(), leaves.end(),
                                              [&](const auto& l) { return l.first == owner; })
                               : leaves.end();
    if (same != leaves.end())
      same->second = same->second + g;
    else
      leaves.emplace_back(std::move(owner), std::move(g));
  }
  GradientHooks& hooks = gradient_hooks();
  if (hooks.count.load(std::memory_order_acquire) > 0) {
    std::vector<std::shared_ptr<const GradientHook>> now;
    {
      std::lock_guard<std::mutex> lock(hooks.mutex);
      for (const auto& hook : hooks.hooks) now.push_back(hook.second);
    }
    for (const auto& hook : now) (*hook)(leaves);
    for (const auto& [owner, g] : leaves)
      if (!g.defined() || g.shape() != owner->node->shape)
        op_fail("backward", loc,
                "a gradient hook gave a gradient of shape {} for a parameter of shape {}",
                g.defined() ? to_string(g.shape()) : "(none)", to_string(owner->node->shape));
  }
  // Marked only now that nothing can fail: a backward that threw (a hook's collective whose
  // peer died) can be called again.
  if (!retain_graph)
    for (Node* node : walked) node->backward_done = true;
  for (auto& [owner, g] : leaves) {
    note_gradient_change(owner, true);
    NodePtr sum = owner->grad ? (Tensor(owner->grad) + g).node() : g.node();
    moved_off(owner->grad.get(), sum.get());
    owner->grad = std::move(sum);
    note_gradient(owner);
  }
}

int64_t add_gradient_hook(GradientHook hook) {
  GradientHooks& hooks = gradient_hooks();
  std::lock_guard<std::mutex> lock(hooks.mutex);
  const int64_t id = hooks.next_id++;
  hooks.hooks.emplace_back(id, std::make_shared<const GradientHook>(std::move(hook)));
  hooks.count.store(hooks.hooks.size(), std::memory_order_release);
  return id;
}

void remove_gradient_hook(int64_t id) {
  GradientHooks& hooks = gradient_hooks();
  std::lock_guard<std::mutex> lock(hooks.mutex);
  std::erase_if(hooks.hooks, [id](const auto& hook) { return hook.first == id; });
  hooks.count.store(hooks.hooks.size(), std::memory_order_release);
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs, bool create_graph,
                         bool allow_unused, const Loc& loc) {
  if (outputs.empty()) op_fail("grad", loc, "needs at least one output");
  if (!grad_outputs.empty() && grad_outputs.size() != outputs.size())
    op_fail("grad", loc, "{} gradients given for {} outputs", grad_outputs.size(), outputs.size());
  std::vector<NodePtr> roots;
  std::vector<Tensor> seeds;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined()) op_fail("grad", loc, "output {} is undefined", i);
    roots.push_back(outputs[i].node());
    seeds.push_back(
        seed_for(outputs[i], grad_outputs.empty() ? Tensor() : grad_outputs[i], "grad", loc));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) op_fail("grad", loc, "input {} is undefined", i);
    if (!inputs[i].requires_grad()) op_fail("grad", loc, "input {} does not require grad", i);
  }
  std::unordered_map<const Node*, Tensor> grads;
  for (auto& [node, g] : backpropagate(roots, seeds, create_graph)) grads.emplace(node, g);
  std::vector<Tensor> result;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto found = grads.find(inputs[i].node().get());
    if (found != grads.end()) {
      result.push_back(found->second);
    } else if (allow_unused) {
      result.push_back(Tensor());
    } else {
      op_fail("grad", loc, "input {} is not used to compute the outputs (pass allow_unused)", i);
    }
  }
  return result;
}

}  // namespace mixtape
