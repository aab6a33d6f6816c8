// mixtape/dsl/graph.cpp -- node creation and the thread-local scopes that annotate new nodes.
#include "mixtape/dsl/graph.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <functional>
#include <mutex>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/pool_allocator.h"

namespace mixtape {

void release_input(NodePtr& input) noexcept {
  if (!input || input.use_count() != 1) return input.reset();
  // The last hold: the node goes, and so may its inputs and theirs. Each node's inputs are
  // taken out before it is destroyed, so no destructor drops a node that still holds any.
  std::vector<NodePtr> dying;
  dying.push_back(std::move(input));
  while (!dying.empty()) {
    NodePtr node = std::move(dying.back());
    dying.pop_back();
    if (node.use_count() == 1)
      for (NodePtr& producer : node->inputs)
        if (producer) dying.push_back(std::move(producer));
    node.reset();
  }
}
namespace {

constexpr OpInfo kOpInfo[] = {
#define MT_OP(Name, fname, kind, arity, category) \
  {#fname, OpKind::kind, arity, Category::category, true},
#define MT_OP_NO_GRADIENT(Name, fname, kind, arity, category) \
  {#fname, OpKind::kind, arity, Category::category, false},
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  {#fname, OpKind::Pointwise, 1, Category::category, std::string_view(#VJP) != "NoGradient"},
#define MT_COMPARE(Name, fname, REF) {#fname, OpKind::Pointwise, 2, Category::Follow, false},
#include "mixtape/dsl/ops.def"
};

// Node ids come in blocks, one per thread at a time, so that making a node needs no atomic
// increment of a shared counter. A node's id exceeds its inputs' (make_node takes a fresh block
// when an input made on another thread has a later one), so ids stay a topological order.
// They are odd: the even id after a node's is its companion's (dsl/graph.h), which runs right
// after it.
constexpr uint64_t kIdBlock = uint64_t{1} << 16;
std::atomic<uint64_t> next_id_block{1};
thread_local uint64_t next_node_id = 0, id_block_end = 0;

uint64_t new_node_id(uint64_t after) {
  if (next_node_id == id_block_end || after >= next_node_id) [[unlikely]] {
    next_node_id = next_id_block.fetch_add(kIdBlock, std::memory_order_relaxed);
    id_block_end = next_node_id + kIdBlock;
  }
  uint64_t id = next_node_id;
  next_node_id += 2;
  return id;
}
thread_local bool grad_mode = true;
thread_local std::string module_path;
thread_local std::shared_ptr<const ModuleCall> module_call;
thread_local const Loc* call_site = nullptr;
thread_local const char* composite = nullptr;
thread_local const Node* differentiating = nullptr;
thread_local std::shared_ptr<const Policy> policy;
thread_local TraceObserver* tracer = nullptr;

// Ops whose result is never differentiable, whatever their inputs (dsl/ops.def).
bool blocks_gradient(OpCode op) { return !kOpInfo[static_cast<size_t>(op)].differentiable; }

}  // namespace

const OpInfo& op_info(OpCode op) { return kOpInfo[static_cast<size_t>(op)]; }
int op_count() { return static_cast<int>(std::size(kOpInfo)); }

NodePtr make_node(OpCode op, DType dtype, Shape shape, NodeInputs inputs, Attrs attrs,
                  const Loc& loc) {
  // Every size computed later (buffers, strides, kernel loops) is exact once these hold. Up to
  // four dimensions below 2^14 each hold fewer than 2^56 elements, well within the limit: most
  // nodes need no more than that look.
  bool small = shape.size() <= 4;
  for (int64_t d : shape) small &= static_cast<uint64_t>(d) < (uint64_t{1} << 14);
  if (!small) check_shape_size(op_name(op), shape, dtype, loc);
  bool any_input_requires_grad = false;
  uint64_t latest_input = 0;
  for (const NodePtr& input : inputs) {
    any_input_requires_grad |= input->requires_grad;
    latest_input = std::max(latest_input, input->id);
  }
  auto node = std::allocate_shared<Node>(PoolAllocator<Node>(), op, dtype, std::move(shape),
                                         std::move(inputs), std::move(attrs), module_path);
  node->origin.module_call = module_call;
  node->id = new_node_id(latest_input);
  node->requires_grad =
      grad_mode && any_input_requires_grad && is_floating(dtype) && !blocks_gradient(op);
  node->origin.location = user_call_site(loc);
  if (differentiating) {
    node->origin.policy = differentiating->origin.policy;
    node->origin.composite = differentiating->origin.composite;
    node->backward = true;
    node->forward_op = differentiating->op;
  } else {
    node->origin.policy = policy;
    node->origin.composite = composite;
  }
  if (tracer) [[unlikely]]
    tracer->node_made(node);
  return node;
}

bool kernel_op(const Node& node) {
  // A custom op's value is its traced forward result (input 0), which kernels read through it
  // as through a view; its other inputs are there for its gradient (fusion.h, kernel_reads).
  if (node.op == OpCode::Custom) return true;
  switch (op_info(node.op).kind) {
    case OpKind::Pointwise:
    case OpKind::View:
    case OpKind::Reduce:
      return true;
    case OpKind::Leaf:
      return node.op == OpCode::Full;  // the one leaf a kernel computes: a constant
    default:
      return false;
  }
}

NodePtr make_companion(const NodePtr& of, OpCode op, DType dtype, Attrs attrs) {
  if (NodePtr made = of->companion.lock()) return made;
  NodePtr node =
      make_node(op, dtype, Shape(of->shape), NodeInputs{of}, std::move(attrs), of->origin.location);
  node->id = of->id + 1;
  make_forward(*node, of->origin);
  of->companion = node;
  return node;
}

void make_forward(Node& node, const NodeOrigin& origin) {
  node.requires_grad = false;
  node.backward = false;
  node.forward_op = OpCode::Constant;
  node.origin = origin;
}

bool is_companion(const Node& node) {
  return node.inputs.size() == 1 && node.inputs[0]->companion.lock().get() == &node;
}

void check_shape_size(const char* op, const Shape& shape, DType dtype, const Loc& loc) {
  std::optional<int64_t> count = checked_numel(shape);
  if (!count)
    op_fail(op, loc, "shape {} has a negative dimension or more elements than a 64-bit count holds",
            to_string(shape));
  // Element sizes are powers of two: a shift, not a division, on a path every node takes.
  if (*count > max_tensor_bytes >> std::countr_zero(size_of(dtype)))
    op_fail(op, loc,
            "a {} tensor of shape {} would span {} elements of {} bytes, more than the 2^60 bytes "
            "one tensor may take",
            name(dtype), to_string(shape), *count, size_of(dtype));
}

std::shared_ptr<Storage> allocate_value(const Node& node, DType dtype, int64_t count,
                                        bool uninitialized) {
  try {
    return uninitialized ? std::make_shared<Storage>(dtype, count, Storage::Uninitialized{})
                         : std::make_shared<Storage>(dtype, count);
  } catch (const Error& e) {
    std::string where = short_location(node.origin.location);
    if (!node.origin.module_path.empty())
      where = fmt::format("module '{}', at {}", node.origin.module_path, where);
    fail("{}: cannot hold its {} value of shape {}: {} [{}]", op_name(node.op), name(dtype),
         to_string(node.shape), e.what(), where);
  }
}

TraceObserver* trace_observer() { return tracer; }
TraceObserver* exchange_trace_observer(TraceObserver* observer) {
  return std::exchange(tracer, observer);
}
void note_side_effect(const char* what) {
  if (tracer) tracer->side_effect(what);
}
void note_gradient_change(const std::shared_ptr<TensorImpl>& owner, bool reads_current) {
  if (tracer) tracer->gradient_changing(owner, reads_current);
}
void note_assignment(const std::shared_ptr<TensorImpl>& target, const NodePtr& value) {
  if (tracer) tracer->assigning(target, value);
}
void note_kept_state(const std::shared_ptr<const void>& anchor, const std::string& role,
                     const NodePtr& value) {
  if (tracer) tracer->keeping(anchor, role, value);
}

namespace {
// A step that read a module's setting replays while the setting is what the trace read.
class TrainingSettingHook final : public StepHook {
 public:
  explicit TrainingSettingHook(std::shared_ptr<const bool> setting)
      : setting_(std::move(setting)), read_(*setting_) {}
  const char* stale() const override {
    return *setting_ != read_ ? "a module it reads was switched between train() and eval()"
                              : nullptr;
  }
  void ran(const std::vector<std::shared_ptr<Storage>>&) override {}

 private:
  std::shared_ptr<const bool> setting_;
  bool read_;
};
}  // namespace

void note_training_read(const std::shared_ptr<const bool>& setting) {
  if (tracer) tracer->each_call(std::make_shared<TrainingSettingHook>(setting), {});
}
bool on_each_call(std::shared_ptr<StepHook> hook, std::vector<NodePtr> values) {
  if (!tracer) return false;
  tracer->each_call(std::move(hook), std::move(values));
  return true;
}

void op_error(const char* op, const Loc& loc, const std::string& detail) {
  const Loc& site = user_call_site(loc);
  std::string where = short_location(site);
  if (!module_path.empty())
    throw Error(fmt::format("{}: {} [module '{}', at {}]", op, detail, module_path, where));
  throw Error(fmt::format("{}: {} [at {}]", op, detail, where));
}

bool grad_enabled() { return grad_mode; }

NoGradGuard::NoGradGuard() : NoGradGuard(false) {}
NoGradGuard::NoGradGuard(bool enabled) : previous_(grad_mode) { grad_mode = enabled; }
NoGradGuard::~NoGradGuard() { grad_mode = previous_; }

namespace {
// The modules whose children were called outside a scope of the module's own (see
// calls_apart): only ever added to, from any thread.
struct ScopelessModules {
  std::mutex mutex;
  std::unordered_set<std::string> paths;
};
ScopelessModules& scopeless_modules() {
  static ScopelessModules* modules = new ScopelessModules;  // read until exit
  return *modules;
}
// Looked up by a view of the path, so a module call allocates nothing for a parent noted before.
struct PathHash {
  using is_transparent = void;
  size_t operator()(std::string_view path) const { return std::hash<std::string_view>{}(path); }
};
thread_local std::unordered_set<std::string, PathHash, std::equal_to<>>
    scopeless_seen;  // this thread's additions

// Notes every module above `path` ("blocks.0" above "blocks.0.attn") that has no call in
// progress in `calls`: its child is called outside a scope of its own.
void note_scopeless_parents(const std::string& path, const ModuleCall* calls) {
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
    const std::string_view parent(path.data(), dot);
    bool open = false;
    for (const ModuleCall* call = calls; call && !open; call = call->parent.get())
      open = call->path == parent;
    if (open || scopeless_seen.count(parent)) continue;
    scopeless_seen.emplace(parent);
    ScopelessModules& modules = scopeless_modules();
    std::lock_guard<std::mutex> lock(modules.mutex);
    modules.paths.emplace(parent);
  }
}
}  // namespace

bool calls_apart(const std::string& path) {
  ScopelessModules& modules = scopeless_modules();
  std::lock_guard<std::mutex> lock(modules.mutex);
  return !modules.paths.count(path);
}

ModulePathScope::ModulePathScope(const std::string& path)
    : previous_(module_path), previous_call_(module_call) {
  note_scopeless_parents(path, previous_call_.get());
  module_path = path;
  module_call = std::make_shared<const ModuleCall>(ModuleCall{path, previous_call_});
}
ModulePathScope::ModulePathScope(const NodeOrigin& origin)
    : previous_(module_path), previous_call_(module_call) {
  module_path = origin.module_path;
  module_call = origin.module_call;
}
ModulePathScope::~ModulePathScope() {
  module_path = previous_;
  module_call = std::move(previous_call_);
}

CallSiteScope::CallSiteScope(const Loc& loc, const char* name)
    : owns_site_(call_site == nullptr), owns_composite_(name && composite == nullptr) {
  if (owns_site_) call_site = &loc;
  if (owns_composite_) composite = name;
}
CallSiteScope::~CallSiteScope() {
  if (owns_site_) call_site = nullptr;
  if (owns_composite_) composite = nullptr;
}
const Loc& user_call_site(const Loc& loc) { return call_site ? *call_site : loc; }

std::vector<Node*> nodes_in_tape_order(const std::vector<NodePtr>& roots) {
  std::vector<Node*> nodes;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (const NodePtr& root : roots) stack.push_back(root.get());
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    nodes.push_back(node);
    for (const NodePtr& input : node->inputs) stack.push_back(input.get());
  }
  std::sort(nodes.begin(), nodes.end(), [](Node* a, Node* b) { return a->id < b->id; });
  return nodes;
}

const std::shared_ptr<const Policy>& current_policy() { return policy; }
std::shared_ptr<const Policy> exchange_current_policy(std::shared_ptr<const Policy> next) {
  std::swap(policy, next);
  return next;
}

BackwardScope::BackwardScope(const Node& forward)
    : previous_(differentiating), path_(forward.origin), site_(forward.origin.location) {
  differentiating = &forward;
}
BackwardScope::~BackwardScope() { differentiating = previous_; }

}  // namespace mixtape
