// mixtape/autograd/recompute.cpp -- cloning checkpointed forward subgraphs for the backward pass.
#include "mixtape/autograd/recompute.h"

#include <algorithm>
#include <optional>
#include <string_view>
#include <utility>

#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/module_path.h"

namespace mixtape {

Recomputation::Recomputation(std::shared_ptr<const std::vector<std::string>> globs)
    : globs_(std::move(globs)) {}

CheckpointRegion Recomputation::region_of(const Node& node) {
  auto [it, added] = region_length_by_path_.try_emplace(node.origin.module_path, -1);
  if (added) {
    const std::string& path = node.origin.module_path;
    size_t shortest = std::string::npos;
    for (const std::string& glob : *globs_)
      if (std::optional<size_t> prefix = matched_module_prefix(glob, path))
        shortest = std::min(shortest, *prefix);
    if (shortest != std::string::npos) it->second = static_cast<ptrdiff_t>(shortest);
  }
  if (it->second < 0) return {};
  const std::string_view module(it->first.data(), static_cast<size_t>(it->second));
  auto inside = [&](const std::string& path) {
    return path.starts_with(module) && (path.size() == module.size() || path[module.size()] == '.');
  };
  // The module's outermost call (one that opened its own scope again is still one call), where
  // its calls can be told apart; else the innermost call around the module.
  auto [apart, asked] = apart_by_module_.try_emplace(std::string(module), false);
  if (asked) apart->second = calls_apart(apart->first);
  const ModuleCall *own = nullptr, *around = nullptr;
  for (const ModuleCall* call = node.origin.module_call.get(); call; call = call->parent.get())
    if (call->path == module)
      own = call;
    else if (!around && !inside(call->path))
      around = call;
  return {module, own && apart->second ? own : around};
}

bool Recomputation::clonable(const Node& node, const CheckpointRegion& region) {
  // An evaluated node has its value to read; a collective's recomputation would be a collective
  // that the other processes never join (DESIGN.md decision 13).
  return !node.evaluated() && op_info(node.op).kind != OpKind::Collective &&
         region_of(node) == region;
}

NodePtr Recomputation::for_vjp(const NodePtr& node) {
  if (node->evaluated()) return node;
  const CheckpointRegion region = region_of(*node);
  if (!region || !clonable(*node, region)) return node;
  return clone_within(node, region);
}

NodePtr Recomputation::clone_within(const NodePtr& root, const CheckpointRegion& region) {
  // Depth first, inputs before their readers, without recursion (a module may be deep). Each
  // entry is an edge of the graph (a reader's input, or `root`), which stays put meanwhile.
  struct Visit {
    const NodePtr* node;
    bool inputs_done;
  };
  std::vector<Visit> stack{{&root, false}};
  while (!stack.empty()) {
    Visit& top = stack.back();
    const Node* original = top.node->get();
    if (clones_.count(original)) {
      stack.pop_back();
      continue;
    }
    if (!top.inputs_done) {
      top.inputs_done = true;
      for (const NodePtr& input : original->inputs)  // may reallocate the stack: `top` is done
        if (!clones_.count(input.get()) && clonable(*input, region))
          stack.push_back({&input, false});
      continue;
    }
    stack.pop_back();
    std::vector<NodePtr> inputs;
    inputs.reserve(original->inputs.size());
    for (const NodePtr& input : original->inputs) {
      auto found = clones_.find(input.get());
      inputs.push_back(found != clones_.end() ? found->second : input);
    }
    NodePtr clone = make_node(original->op, original->dtype, original->shape, std::move(inputs),
                              Attrs(original->attrs), original->origin.location);
    // make_node typed it as a gradient node of the one being differentiated (BackwardScope):
    // it is the original again, but for the mark.
    clone->requires_grad = original->requires_grad;
    clone->backward = original->backward;
    clone->forward_op = original->forward_op;
    clone->recomputed = true;
    clone->promotion = original->promotion;
    clone->weak_promotion = original->weak_promotion;
    clone->precision = original->precision;
    clone->origin = original->origin;
    clones_.emplace(original, std::move(clone));
  }
  return clones_.at(root.get());
}

}  // namespace mixtape
