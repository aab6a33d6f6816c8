// mixtape/dsl/tensor.h -- mt::Tensor, the user's handle to a lazy graph node, and tensor creation.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/node.h"

namespace mixtape {

/// Shared state behind every copy of one Tensor handle: the node it currently names and the
/// gradient accumulated for it. Copies of a Tensor share this, so a parameter updated by an
/// optimizer (assign) is updated for every holder, as in PyTorch.
struct TensorImpl {
  NodePtr node;
  NodePtr grad;
};

class Tensor {
 public:
  Tensor() = default;  // undefined: no node; most operations on it throw mt::Error
  explicit Tensor(NodePtr node);

  bool defined() const { return impl_ != nullptr; }
  /// How many Tensor objects are this one (copies share it, and see its assign()s); 0 when
  /// undefined.
  long use_count() const { return impl_.use_count(); }
  const NodePtr& node() const {
    if (!impl_) [[unlikely]]
      undefined();
    return impl_->node;
  }
  const Shape& shape() const { return node()->shape; }
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t size(int64_t axis) const;
  int64_t numel() const { return node()->numel(); }
  DType dtype() const { return node()->dtype; }

  // ---- evaluation (each call evaluates what is not yet computed) ----
  /// The single element as a double; mt::Error unless numel() == 1.
  double item() const;
  /// All elements converted to T, row-major.
  template <typename T>
  std::vector<T> to_vector() const;

  // ---- autograd ----
  /// Marks a leaf (a tensor made from data or by a creation function) as requiring gradients.
  Tensor& requires_grad_(bool enabled = true);
  bool requires_grad() const { return node()->requires_grad; }
  bool is_leaf() const;
  /// The gradient accumulated by backward(); undefined when none has been accumulated.
  Tensor grad() const;
  void set_grad(const Tensor& grad);
  void zero_grad();
  /// Accumulates d(this)/d(leaf) into leaf.grad() for every leaf that requires grad. `grad`
  /// defaults to ones for a single-element tensor. As in PyTorch, a graph is walked once:
  /// another backward() through a node an earlier one went through (which would add its
  /// gradients again) is an mt::Error, unless that earlier call passed retain_graph = true.
  /// Defined in autograd/.
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false,
                const Loc& loc = Loc::current()) const;
  /// The same value, cut from the graph: no gradient flows through it.
  Tensor detach(const Loc& loc = Loc::current()) const;
  /// Evaluates `value` and makes this handle (and every copy of it) a leaf holding that data.
  /// Shape and dtype must match. Keeps requires_grad and the accumulated gradient.
  void assign(const Tensor& value, const Loc& loc = Loc::current());
  /// The same, with the evaluation left to the next one anything asks for, which computes
  /// `value` along with what it was asked for: a module's state update made during the forward
  /// pass (batch norm's running statistics) joins the training step's program instead of
  /// running one of its own. Until then this handle reads as `value` (reading it evaluates).
  /// Not for tensors that require grad.
  void assign_later(const Tensor& value, const Loc& loc = Loc::current());
  /// Makes this handle (and every copy of it) a leaf of another floating-point type holding its
  /// value rounded to that type, as PyTorch's `p.data = p.data.to(dtype)`: requires_grad is
  /// kept, the gradient (of the old type) dropped. Module::to converts a model with it. Only for
  /// leaves (an mt::Error for the result of an op).
  void convert(DType dtype, const Loc& loc = Loc::current());

  // ---- method spellings of common ops (see ops.h) ----
  Tensor to(DType dtype, const Loc& loc = Loc::current()) const;
  Tensor reshape(Shape shape, const Loc& loc = Loc::current()) const;
  Tensor transpose(int64_t a = -2, int64_t b = -1, const Loc& loc = Loc::current()) const;
  Tensor sum(std::vector<int64_t> axes = {}, bool keepdim = false,
             const Loc& loc = Loc::current()) const;
  Tensor mean(std::vector<int64_t> axes = {}, bool keepdim = false,
              const Loc& loc = Loc::current()) const;

  /// True when both handles share state (copies of one another).
  bool same(const Tensor& other) const { return impl_ == other.impl_; }
  /// What same() compares, for sets and maps of tensors by identity.
  const void* identity() const { return impl_.get(); }
  /// The handle's shared state: a parameter's identity for its gradient whether or not it
  /// requires grad now (optimizers and data parallelism keep track of frozen parameters too).
  const std::shared_ptr<TensorImpl>& impl() const { return impl_; }

 private:
  [[noreturn]] static void undefined();  // the mt::Error for a use of an undefined tensor

  std::shared_ptr<TensorImpl> impl_;
};

/// Evaluates all given tensors in one go (one program for the reference executor).
void eval(const std::vector<Tensor>& tensors);

// ---- creation ----
/// The dtype mixtape uses for host values of type T.
template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return f32;
  else if constexpr (std::is_same_v<T, double>)
    return f64;
  else if constexpr (std::is_same_v<T, int32_t>)
    return i32;
  else if constexpr (std::is_same_v<T, int64_t>)
    return i64;
  else if constexpr (std::is_same_v<T, bool>)
    return boolean;
  else
    static_assert(sizeof(T) == 0, "no mixtape dtype for this host type");
}

/// A tensor holding a copy of `values` converted to `dtype` (f16/bf16 rounded to nearest even).
template <typename T>
Tensor tensor(std::span<const T> values, Shape shape, std::optional<DType> dtype = std::nullopt,
              const Loc& loc = Loc::current());
template <typename T>
Tensor tensor(const std::vector<T>& values, Shape shape, std::optional<DType> dtype = std::nullopt,
              const Loc& loc = Loc::current()) {
  return tensor(std::span<const T>(values), std::move(shape), dtype, loc);
}
/// std::vector<bool> packs its bits and has no span, so it gets its own overload.
Tensor tensor(const std::vector<bool>& values, Shape shape,
              std::optional<DType> dtype = std::nullopt, const Loc& loc = Loc::current());
/// A 0-d tensor.
Tensor scalar(double value, DType dtype = f32, const Loc& loc = Loc::current());
/// A tensor that wraps already converted storage (its dtype and count must fit `shape`).
Tensor from_storage(std::shared_ptr<Storage> storage, Shape shape, const Loc& loc = Loc::current());

/// mt::Error for a value an integer dtype cannot hold (NaN, infinite, past its range), as
/// PyTorch's full refuses it.
Tensor full(Shape shape, double value, DType dtype = f32, const Loc& loc = Loc::current());
/// full() of an integer exactly (a double rounds it beyond 2^53), as torch.full of a Python int.
Tensor full_integer(Shape shape, int64_t value, DType dtype = i64, const Loc& loc = Loc::current());
Tensor zeros(Shape shape, DType dtype = f32, const Loc& loc = Loc::current());
Tensor ones(Shape shape, DType dtype = f32, const Loc& loc = Loc::current());
Tensor zeros_like(const Tensor& x, const Loc& loc = Loc::current());
Tensor ones_like(const Tensor& x, const Loc& loc = Loc::current());
Tensor full_like(const Tensor& x, double value, const Loc& loc = Loc::current());
/// start, start+step, ... below stop (as numpy.arange).
Tensor arange(double start, double stop, double step = 1, DType dtype = i64,
              const Loc& loc = Loc::current());
Tensor arange(int64_t n, DType dtype = i64, const Loc& loc = Loc::current());

/// Counter-based random streams (Philox4x32-10): a (seed, offset) pair fixes every value, so
/// results are reproducible and the same on every back end. As in PyTorch's graph-safe Philox,
/// the offset is a graph value (0-d i64) that each draw reads and advances with graph code, so a
/// step compiled by mt::compile draws fresh numbers on every replay: those tracing every call
/// would draw. A copy is a stream of its own that starts where the original stood.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0);
  Generator(const Generator& other);
  Generator& operator=(const Generator& other);
  ~Generator();

  uint64_t seed() const;
  /// The first counter of the next draw. Reads the offset on the host (with a device, a sync).
  uint64_t offset() const;
  /// Sets the seed and starts the stream over (offset 0).
  void manual_seed(uint64_t seed);
  /// Restores a saved (seed(), offset()) pair, e.g. from a checkpoint: the streams go on exactly
  /// where they were.
  void set_state(uint64_t seed, uint64_t offset);
  /// Reserves `count` counters and returns the first (reads the offset, as offset() does).
  uint64_t advance(uint64_t count);
  /// For draws (rand, randn): the offset a draw of `count` counters starts at, as a graph value;
  /// the generator's offset moves on past them as graph code, without a host read.
  Tensor draw(uint64_t count);
  /// The offset as the graph value draws read (0-d i64 holding its bits): the state a traced
  /// step carries for this generator, which AOT export names (mt::aot::Options::generators).
  const Tensor& offset_tensor() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};
/// The process-wide generator used when none is passed.
Generator& default_generator();
void manual_seed(uint64_t seed);

/// Uniform in [low, high).
Tensor rand(Shape shape, DType dtype = f32, Generator* gen = nullptr, double low = 0,
            double high = 1, const Loc& loc = Loc::current());
/// Normal with the given mean and standard deviation.
Tensor randn(Shape shape, DType dtype = f32, Generator* gen = nullptr, double mean = 0,
             double stddev = 1, const Loc& loc = Loc::current());

}  // namespace mixtape
