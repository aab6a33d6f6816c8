// mixtape/dsl/tensor.cpp -- Tensor handle methods, evaluation requests and creation functions.
#include "mixtape/dsl/tensor.h"

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/in_place.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/pool_allocator.h"

namespace mixtape {

namespace {
std::atomic<Storage::HostFetch> host_fetch{nullptr};
void become_leaf(const std::shared_ptr<TensorImpl>& impl, const NodePtr& value, const Loc& loc);
}  // namespace

void Storage::set_host_fetch(HostFetch fetch) { host_fetch.store(fetch); }

std::shared_ptr<Storage> host_copy(const Storage& value) {
  auto copy = std::make_shared<Storage>(value.dtype, value.count, Storage::Uninitialized{});
  if (value.size_bytes() > 0)
    std::memcpy(copy->bytes.data(), value.host_data(), static_cast<size_t>(value.size_bytes()));
  return copy;
}

void Storage::settle_host() {
  // The stream's worker reads what its earlier work wrote: that ran first.
  if ((queued_uses.load(std::memory_order_acquire) > 0 ||
       queued_writes.load(std::memory_order_acquire) > 0) &&
      !on_cpu_stream()) {
    finish_cpu_stream();  // reports a failure of queued work, once
    // All queued work has run: a write still counted is one that failed.
    if (queued_writes.load(std::memory_order_acquire) > 0)
      fail(
          "this value was never computed: the asynchronous CPU evaluation that was to compute "
          "it failed, or read a value that failed");
  }
  if (!host_stale.load(std::memory_order_acquire)) return;
  HostFetch fetch = host_fetch.load();
  if (!fetch) fail("a value lives on a device, but no device back end can fetch it");
  fetch(*this);
}

Tensor::Tensor(NodePtr node)
    : impl_(std::allocate_shared<TensorImpl>(PoolAllocator<TensorImpl>())) {
  impl_->node = std::move(node);
}

void Tensor::undefined() {
  throw Error("use of an undefined tensor (default-constructed mt::Tensor)");
}

int64_t Tensor::size(int64_t axis) const {
  const Shape& s = shape();
  int64_t rank = static_cast<int64_t>(s.size());
  if (axis < -rank || axis >= rank)
    fail("size: axis {} is out of range for shape {}", axis, to_string(s));
  return s[axis < 0 ? axis + rank : axis];
}

double Tensor::item() const {
  if (numel() != 1)
    fail("item: the tensor has {} elements (shape {}), not 1", numel(), to_string(shape()));
  note_side_effect("reads a value on the host (item())");
  evaluate({node()});
  return load_element<double>(*node()->value, 0);
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  note_side_effect("reads values on the host (to_vector())");
  evaluate({node()});
  return load_all<T>(*node()->value);
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;

template <>
std::vector<bool> Tensor::to_vector<bool>() const {
  note_side_effect("reads values on the host (to_vector())");
  evaluate({node()});
  std::vector<bool> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = load_element<double>(*node()->value, i) != 0;
  return out;
}

Tensor& Tensor::requires_grad_(bool enabled) {
  if (enabled && node()->op == OpCode::Detach) {
    // As PyTorch's detach(), whose result is a leaf: x.detach().requires_grad_() starts a new
    // graph at x's value (input gradients, adversarial examples).
    const NodePtr detached = node();
    evaluate({detached});
    become_leaf(impl_, detached, Loc::current());
  }
  const NodePtr& n = node();
  if (!is_leaf())
    fail(
        "requires_grad_: only leaf tensors (made from data or creation functions) can be marked; "
        "this one is the result of '{}' — use detach() first",
        op_name(n->op));
  if (enabled && !is_floating(n->dtype))
    fail("requires_grad_: only floating-point tensors can require gradients, got {}",
         name(n->dtype));
  // A compiled step that read this value traces again: what it computes depends on the flag.
  if (n->requires_grad != enabled && n->value)
    n->value->moves_off.fetch_add(1, std::memory_order_relaxed);
  n->requires_grad = enabled;
  n->grad_owner = enabled ? std::weak_ptr<TensorImpl>(impl_) : std::weak_ptr<TensorImpl>();
  return *this;
}

bool Tensor::is_leaf() const { return op_info(node()->op).kind == OpKind::Leaf; }

Tensor Tensor::grad() const {
  node();
  return impl_->grad ? Tensor(impl_->grad) : Tensor();
}

void Tensor::set_grad(const Tensor& grad) {
  node();
  if (!grad.defined()) {
    zero_grad();
    return;
  }
  if (grad.shape() != shape())
    fail("set_grad: gradient shape {} does not match tensor shape {}", to_string(grad.shape()),
         to_string(shape()));
  NodePtr next = grad.dtype() == dtype() ? grad.node() : cast(grad, dtype()).node();
  note_gradient_change(impl_, false);
  moved_off(impl_->grad.get(), next.get());
  impl_->grad = std::move(next);
}

void Tensor::zero_grad() {
  node();
  note_gradient_change(impl_, false);
  moved_off(impl_->grad.get(), nullptr);
  impl_->grad = nullptr;
}

Tensor Tensor::detach(const Loc& loc) const {
  if (!defined()) op_fail("detach", loc, "called on an undefined tensor");
  return stop_gradient(*this, loc);
}

namespace {

void check_assignable(const NodePtr& current, const Tensor& value, const char* op, const Loc& loc) {
  if (!value.defined()) op_fail(op, loc, "the value is an undefined tensor");
  if (value.shape() != current->shape || value.dtype() != current->dtype)
    op_fail(op, loc, "value {} {} does not match tensor {} {}", to_string(value.shape()),
            name(value.dtype()), to_string(current->shape), name(current->dtype));
}

// Makes `impl` a leaf holding `value`'s (evaluated) data: state, as the optimizers keep it. The
// data is shared, but for a buffer a compiled step updates in place (a parameter, a gradient),
// which is copied: the assigned tensor keeps the value (the best weights so far) as tracing
// would keep it.
void become_leaf(const std::shared_ptr<TensorImpl>& impl, const NodePtr& value, const Loc& loc) {
  const NodePtr current = impl->node;
  if (value != current) note_assignment(impl, value);
  auto leaf = make_node(OpCode::Constant, value->dtype, current->shape, {}, {}, loc);
  leaf->value = value->value;
  if (written_in_place(leaf->value.get())) leaf->value = host_copy(*leaf->value);
  leaf->precision.storage_type = leaf->precision.compute = leaf->value->dtype;
  leaf->precision.assigned = true;
  leaf->origin.module_path = current->origin.module_path;
  leaf->origin.module_call = current->origin.module_call;
  leaf->requires_grad = current->requires_grad;
  // Also for a tensor without gradients (a loss scale): mt::compile reads a value assigned
  // outside the step through its tensor.
  leaf->grad_owner = impl;
  moved_off(current.get(), leaf.get());
  impl->node = std::move(leaf);
}

struct DeferredAssignment {
  std::weak_ptr<TensorImpl> impl;
  NodePtr value;
  NodePtr previous;  // the tensor's value before: what it keeps if `value` cannot be computed
  Loc loc;
};
std::vector<DeferredAssignment>& deferred_assignments() {
  thread_local std::vector<DeferredAssignment> list;
  return list;
}

}  // namespace

void Tensor::assign(const Tensor& value, const Loc& loc) {
  const NodePtr& current = node();
  check_assignable(current, value, "assign", loc);
  evaluate({value.node()});
  become_leaf(impl_, value.node(), loc);
}

void Tensor::assign_later(const Tensor& value, const Loc& loc) {
  const NodePtr& current = node();
  check_assignable(current, value, "assign_later", loc);
  if (current->requires_grad)
    op_fail("assign_later", loc, "a tensor that requires grad is assigned with assign()");
  if (value.node()->evaluated()) return assign(value, loc);
  // State, as assign() makes it: no gradient flows through it into what computed the value.
  NodePtr state = value.requires_grad() ? value.detach(loc).node() : value.node();
  NodePtr previous = current;
  moved_off(current.get(), state.get());
  impl_->node = state;
  // Settled without an assign() the trace hears (become_leaf finds the value in place): named
  // here for the plans of a compiled step's other shapes (runtime/compile.cpp).
  note_kept_state(impl_, "assign_later", state);
  deferred_assignments().push_back({impl_, std::move(state), std::move(previous), loc});
}

void Tensor::convert(DType dtype, const Loc& loc) {
  const NodePtr& current = node();
  if (!is_floating(dtype) || !is_floating(current->dtype))
    op_fail("convert", loc, "converts floating-point tensors to floating-point types, not {} to {}",
            name(current->dtype), name(dtype));
  if (!is_leaf())
    op_fail("convert", loc,
            "converts a leaf (a parameter, a buffer, data), not the result of '{}', whose graph "
            "it would cut; use .to(dtype) for a converted value",
            op_name(current->op));
  if (current->dtype == dtype) return;
  Tensor value = cast(detach(loc), dtype, loc);
  evaluate({value.node()});
  zero_grad();
  become_leaf(impl_, value.node(), loc);
}

std::vector<NodePtr> deferred_assignment_values() {
  std::vector<NodePtr> values;
  for (const DeferredAssignment& d : deferred_assignments()) values.push_back(d.value);
  return values;
}

void recover_deferred_assignments(const std::function<void(const NodePtr&)>& compute) {
  std::vector<DeferredAssignment> list = std::move(deferred_assignments());
  deferred_assignments().clear();
  for (DeferredAssignment& d : list) {
    std::shared_ptr<TensorImpl> impl = d.impl.lock();
    if (!impl || impl->node != d.value) continue;  // dropped, or assigned again since
    try {
      if (!d.value->evaluated()) compute(d.value);
      become_leaf(impl, d.value, d.loc);
    } catch (...) {
      moved_off(d.value.get(), d.previous.get());
      impl->node = d.previous;
    }
  }
}

void settle_deferred_assignments() {
  std::vector<DeferredAssignment>& list = deferred_assignments();
  std::vector<DeferredAssignment> waiting;
  for (DeferredAssignment& d : list) {
    std::shared_ptr<TensorImpl> impl = d.impl.lock();
    if (!d.value->evaluated()) {
      waiting.push_back(std::move(d));
      continue;
    }
    // A tensor dropped since, or assigned again (its node is no longer this value), is left.
    if (impl && impl->node == d.value) become_leaf(impl, d.value, d.loc);
  }
  list = std::move(waiting);
}

Tensor Tensor::to(DType dtype, const Loc& loc) const { return cast(*this, dtype, loc); }
Tensor Tensor::reshape(Shape shape, const Loc& loc) const {
  return mixtape::reshape(*this, std::move(shape), loc);
}
Tensor Tensor::transpose(int64_t a, int64_t b, const Loc& loc) const {
  return mixtape::transpose(*this, a, b, loc);
}
Tensor Tensor::sum(std::vector<int64_t> axes, bool keepdim, const Loc& loc) const {
  return mixtape::sum(*this, std::move(axes), keepdim, loc);
}
Tensor Tensor::mean(std::vector<int64_t> axes, bool keepdim, const Loc& loc) const {
  return mixtape::mean(*this, std::move(axes), keepdim, loc);
}

void eval(const std::vector<Tensor>& tensors) {
  std::vector<NodePtr> nodes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) fail("eval: tensor {} is undefined", i);
    nodes.push_back(tensors[i].node());
  }
  evaluate(nodes);
}

// ---- creation ----
namespace {

void check_shape(const char* op, const Shape& shape, DType dtype, const Loc& loc) {
  for (int64_t d : shape)
    if (d < 0) op_fail(op, loc, "negative dimension in shape {}", to_string(shape));
  check_shape_size(op, shape, dtype, loc);
}

// A fill an integer type cannot hold (NaN, infinite, past its range) is refused, as PyTorch's
// full refuses it: converting it is undefined (INT64_MAX's double, 2^63, became INT64_MIN).
void check_fill(const char* op, double value, DType dtype, const Loc& loc) {
  if (dtype != i32 && dtype != i64) return;
  const double bound = dtype == i32 ? 0x1p31 : 0x1p63;
  if (!(std::trunc(value) >= -bound && std::trunc(value) < bound))  // NaN fails both
    op_fail(op, loc, "{} cannot be converted to {} without overflow", value, name(dtype));
}

Tensor leaf(OpCode op, DType dtype, Shape shape, Attrs attrs, const Loc& loc) {
  return Tensor(make_node(op, dtype, std::move(shape), {}, std::move(attrs), loc));
}

}  // namespace

template <typename T>
Tensor tensor(std::span<const T> values, Shape shape, std::optional<DType> dtype, const Loc& loc) {
  DType t = dtype.value_or(dtype_of<T>());
  check_shape("tensor", shape, t, loc);
  if (static_cast<int64_t>(values.size()) != numel(shape))
    op_fail("tensor", loc, "{} values do not fill shape {} ({} elements)", values.size(),
            to_string(shape), numel(shape));
  auto storage =
      std::make_shared<Storage>(t, static_cast<int64_t>(values.size()), Storage::Uninitialized{});
  if (t == dtype_of<T>()) {  // a training loop's batches: the bytes as they are
    if (!values.empty()) std::memcpy(storage->host_data(), values.data(), values.size_bytes());
  } else {
    for (size_t i = 0; i < values.size(); ++i)
      store_element(*storage, static_cast<int64_t>(i), values[i]);
  }
  return from_storage(std::move(storage), std::move(shape), loc);
}
template Tensor tensor<float>(std::span<const float>, Shape, std::optional<DType>, const Loc&);
template Tensor tensor<double>(std::span<const double>, Shape, std::optional<DType>, const Loc&);
template Tensor tensor<int32_t>(std::span<const int32_t>, Shape, std::optional<DType>, const Loc&);
template Tensor tensor<int64_t>(std::span<const int64_t>, Shape, std::optional<DType>, const Loc&);

template <>
Tensor tensor<bool>(std::span<const bool> values, Shape shape, std::optional<DType> dtype,
                    const Loc& loc) {
  std::vector<uint8_t> bytes(values.begin(), values.end());
  check_shape("tensor", shape, dtype.value_or(boolean), loc);
  if (static_cast<int64_t>(values.size()) != numel(shape))
    op_fail("tensor", loc, "{} values do not fill shape {}", values.size(), to_string(shape));
  auto storage = std::make_shared<Storage>(dtype.value_or(boolean), numel(shape));
  for (size_t i = 0; i < bytes.size(); ++i)
    store_element(*storage, static_cast<int64_t>(i), bytes[i]);
  return from_storage(std::move(storage), std::move(shape), loc);
}

Tensor tensor(const std::vector<bool>& values, Shape shape, std::optional<DType> dtype,
              const Loc& loc) {
  std::unique_ptr<bool[]> unpacked(new bool[values.size()]);
  std::copy(values.begin(), values.end(), unpacked.get());
  return tensor(std::span<const bool>(unpacked.get(), values.size()), std::move(shape), dtype, loc);
}

Tensor scalar(double value, DType dtype, const Loc& loc) {
  check_fill("scalar", value, dtype, loc);
  Attrs attrs;
  attrs.value = value;
  return leaf(OpCode::Full, dtype, {}, std::move(attrs), loc);
}

Tensor from_storage(std::shared_ptr<Storage> storage, Shape shape, const Loc& loc) {
  if (!storage) op_fail("from_storage", loc, "storage is null");
  check_shape("from_storage", shape, storage->dtype, loc);
  if (storage->count != numel(shape) ||
      (!storage->host_stale &&
       storage->bytes.size() != static_cast<size_t>(storage->count) * size_of(storage->dtype)))
    op_fail("from_storage", loc, "storage of {} {} elements does not fit shape {}", storage->count,
            name(storage->dtype), to_string(shape));
  auto node = make_node(OpCode::Constant, storage->dtype, std::move(shape), {}, {}, loc);
  node->value = std::move(storage);
  return Tensor(std::move(node));
}

Tensor full(Shape shape, double value, DType dtype, const Loc& loc) {
  check_shape("full", shape, dtype, loc);
  check_fill("full", value, dtype, loc);
  Attrs attrs;
  attrs.value = value;
  return leaf(OpCode::Full, dtype, std::move(shape), std::move(attrs), loc);
}
Tensor full_integer(Shape shape, int64_t value, DType dtype, const Loc& loc) {
  constexpr int64_t exact = int64_t{1} << 53;
  if (dtype != i64 || (value >= -exact && value <= exact))
    return full(std::move(shape), static_cast<double>(value), dtype, loc);
  check_shape("full", shape, dtype, loc);
  // A stored value, broadcast: a fill's double would round it.
  return broadcast_to(tensor(std::vector<int64_t>{value}, {}, i64, loc), shape, loc);
}
Tensor zeros(Shape shape, DType dtype, const Loc& loc) {
  check_shape("zeros", shape, dtype, loc);
  return full(std::move(shape), 0, dtype, loc);
}
Tensor ones(Shape shape, DType dtype, const Loc& loc) {
  check_shape("ones", shape, dtype, loc);
  return full(std::move(shape), 1, dtype, loc);
}
namespace {
void check_like_input(const char* op, const Tensor& x, const Loc& loc) {
  if (!x.defined()) op_fail(op, loc, "the input is an undefined tensor");
}
}  // namespace
Tensor zeros_like(const Tensor& x, const Loc& loc) {
  check_like_input("zeros_like", x, loc);
  return full(x.shape(), 0, x.dtype(), loc);
}
Tensor ones_like(const Tensor& x, const Loc& loc) {
  check_like_input("ones_like", x, loc);
  return full(x.shape(), 1, x.dtype(), loc);
}
Tensor full_like(const Tensor& x, double value, const Loc& loc) {
  check_like_input("full_like", x, loc);
  return full(x.shape(), value, x.dtype(), loc);
}

Tensor arange(double start, double stop, double step, DType dtype, const Loc& loc) {
  if (step == 0 || !std::isfinite(start) || !std::isfinite(stop) || !std::isfinite(step))
    op_fail("arange", loc, "needs finite start/stop and a non-zero step (got {}, {}, {})", start,
            stop, step);
  double steps = std::ceil((stop - start) / step);
  // Checked in double: converting a count past int64's range is undefined.
  if (!(steps < 0x1p62))
    op_fail("arange", loc, "[{}, {}) in steps of {} has more elements than a tensor can hold",
            start, stop, step);
  int64_t count = std::max<int64_t>(0, static_cast<int64_t>(steps));
  Attrs attrs;
  attrs.value = start;
  attrs.step = step;
  return leaf(OpCode::Arange, dtype, {count}, std::move(attrs), loc);
}
Tensor arange(int64_t n, DType dtype, const Loc& loc) {
  if (n < 0) op_fail("arange", loc, "count must be non-negative, got {}", n);
  return arange(0.0, static_cast<double>(n), 1.0, dtype, loc);
}

struct Generator::State {
  uint64_t seed = 0;
  Tensor offset;  // 0-d i64 holding the offset's bits
  // Counts every change made other than by a replay of a compiled step: a draw, a reseed, a
  // restore. A compiled step replays only while the count is where its last call left it.
  uint64_t changes = 0;
};

namespace {
Tensor offset_value(uint64_t offset) {
  auto storage = std::make_shared<Storage>(i64, 1);
  storage->as<int64_t>()[0] = std::bit_cast<int64_t>(offset);
  return from_storage(std::move(storage), {});
}

// A new value rather than a write in place: draws not evaluated yet keep the offset they read.
// The buffer it leaves counts a move off (Storage::moves_off): a compiled step's plan that reads
// it, or takes it up from a trace of other shapes, sees it is no longer the offset, whoever still
// holds it (a trace that read it, another plan).
void replace_offset(Tensor& offset, Tensor next) {
  moved_off(offset.node().get(), next.node().get());
  offset = std::move(next);
}
}  // namespace

Generator::Generator(uint64_t seed) : state_(std::make_shared<State>()) {
  state_->seed = seed;
  state_->offset = offset_value(0);
}
Generator::Generator(const Generator& other) : Generator(other.seed()) {
  state_->offset = offset_value(other.offset());
}
Generator& Generator::operator=(const Generator& other) {
  if (this != &other) set_state(other.seed(), other.offset());
  return *this;
}
Generator::~Generator() = default;

uint64_t Generator::seed() const { return state_->seed; }

uint64_t Generator::offset() const {
  return std::bit_cast<uint64_t>(state_->offset.to_vector<int64_t>().at(0));
}

void Generator::manual_seed(uint64_t seed) { set_state(seed, 0); }

void Generator::set_state(uint64_t seed, uint64_t offset) {
  state_->seed = seed;
  replace_offset(state_->offset, offset_value(offset));
  ++state_->changes;
}

uint64_t Generator::advance(uint64_t count) {
  uint64_t first = offset();
  set_state(state_->seed, first + count);
  return first;
}

Tensor Generator::draw(uint64_t count) {
  // What tracing a compiled step cannot see: that the generator is changed outside the step
  // between its calls (reseeded, restored, drawn from by other code). The replays would then
  // go on from the offset they keep, so they stop, and the step is traced again.
  class Unchanged final : public StepHook {
   public:
    explicit Unchanged(const std::shared_ptr<State>& state) : state_(state), seed_(state->seed) {}
    const char* stale() const override {
      std::shared_ptr<State> state = state_.lock();
      if (!state || state->changes == changes_) return nullptr;
      return "a generator it draws from was reseeded, restored or drawn from outside it since the "
             "last call";
    }
    void ran(const std::vector<std::shared_ptr<Storage>>&) override {
      if (std::shared_ptr<State> state = state_.lock()) changes_ = state->changes;
    }
    // The offset is state kept by name (below): a plan that took it up from a trace of other
    // shapes follows that trace's draws. A change before that trace left this hook stale then,
    // so the plan takes nothing up; one after it moved off the offset that trace left, which
    // the plan then cannot take up (replace_offset). The seed is in the traced graph.
    bool take_up() override {
      std::shared_ptr<State> state = state_.lock();
      if (!state || state->seed != seed_) return false;
      changes_ = state->changes;
      return true;
    }

   private:
    std::weak_ptr<State> state_;
    uint64_t seed_;
    uint64_t changes_ = 0;
  };
  Tensor first = state_->offset;
  const NodePtr& node = first.node();
  if (!trace_observer() && node->evaluated() && node->value->host_ready()) {
    // Outside a compiled step, with the offset at hand on the host, no graph code is needed.
    uint64_t at = std::bit_cast<uint64_t>(load_element<int64_t>(*node->value, 0));
    replace_offset(state_->offset, offset_value(at + count));
  } else {
    NoGradGuard no_grad;
    replace_offset(state_->offset, add(first, full({}, static_cast<double>(count), i64)));
    note_kept_state(state_, "offset", state_->offset.node());
  }
  ++state_->changes;
  if (trace_observer()) on_each_call(std::make_shared<Unchanged>(state_));
  return first;
}

const Tensor& Generator::offset_tensor() const { return state_->offset; }

Generator& default_generator() {
  static Generator generator(0);
  return generator;
}
void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

namespace {
Tensor random_leaf(OpCode op, const char* opname, Shape shape, DType dtype, Generator* gen,
                   const Loc& loc) {
  check_shape(opname, shape, dtype, loc);
  if (!is_floating(dtype)) op_fail(opname, loc, "needs a floating dtype, got {}", name(dtype));
  Generator& g = gen ? *gen : default_generator();
  Attrs attrs;
  attrs.seed = g.seed();
  Tensor offset = g.draw(static_cast<uint64_t>(numel(shape)));
  return Tensor(make_node(op, dtype, std::move(shape), {offset.node()}, std::move(attrs), loc));
}
}  // namespace

Tensor rand(Shape shape, DType dtype, Generator* gen, double low, double high, const Loc& loc) {
  if (!is_floating(dtype)) op_fail("rand", loc, "needs a floating dtype, got {}", name(dtype));
  if (!(low <= high)) op_fail("rand", loc, "needs low <= high, got [{}, {})", low, high);
  // As PyTorch's uniform_: bounds the dtype holds, and a range no wider than its largest value
  // (u (high - low) overflowed to inf, or NaN in f16 for [-1e5, 1e5)).
  const double largest = largest_finite(dtype);
  if (!(std::abs(low) <= largest && std::abs(high) <= largest && high - low <= largest))
    op_fail("rand", loc, "the range [{}, {}) does not fit {}, whose largest value is {}", low, high,
            name(dtype), largest);
  // An empty range is its one value, as PyTorch's uniform_(a, a) fills a.
  if (low == high) return full(std::move(shape), low, dtype, loc);
  Tensor u = random_leaf(OpCode::RandUniform, "rand", std::move(shape), dtype, gen, loc);
  if (low == 0 && high == 1) return u;
  CallSiteScope site(loc);
  return u * (high - low) + low;
}

Tensor randn(Shape shape, DType dtype, Generator* gen, double mean, double stddev, const Loc& loc) {
  if (!(stddev >= 0)) op_fail("randn", loc, "stddev must be non-negative, got {}", stddev);
  Tensor z = random_leaf(OpCode::RandNormal, "randn", std::move(shape), dtype, gen, loc);
  if (mean == 0 && stddev == 1) return z;
  CallSiteScope site(loc);
  return z * stddev + mean;
}

}  // namespace mixtape
