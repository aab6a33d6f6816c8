// mixtape/dsl/ops.h -- the functional API over primitive ops: builders that check shapes and
// dtypes.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "mixtape/dsl/tensor.h"

namespace mixtape {

// ---- pointwise ops generated from ops.def: mt::exp(x), mt::add(a, b), mt::lt(a, b), ... ----
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  Tensor fname(const Tensor& x, const Loc& loc = Loc::current());
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1) \
  Tensor fname(const Tensor& a, const Tensor& b, const Loc& loc = Loc::current());
#define MT_COMPARE(Name, fname, REF) \
  Tensor fname(const Tensor& a, const Tensor& b, const Loc& loc = Loc::current());
// The fused update arithmetic takes its inputs in braces: mt::lincomb({x, wx, y, wy}).
#define MT_FUSED(Name, fname, arity, REF) \
  Tensor fname(const std::array<Tensor, arity>& inputs, const Loc& loc = Loc::current());
#include "mixtape/dsl/ops.def"

/// An operand of an overloaded operator: a tensor or a scalar, with the caller's source line.
/// Scalars take the tensor operand's dtype (or f32 when a float scalar meets an integer tensor).
/// An Operand refers to its tensor, as a parameter does: it lives only for the operator's call,
/// within the expression that holds the tensor (a copy was two atomic count updates per operand,
/// and the traced loop applies operators by the hundred every step).
/// An unsigned integer operand above INT64_MAX is an mt::Error (PyTorch raises on such a Python
/// int too): it wrapped to a negative number.
[[noreturn]] void integer_operand_overflow(uint64_t value, const Loc& loc);
struct Operand {
  inline static const Tensor none{};  // the tensor of a scalar operand: undefined
  const Tensor& tensor;
  double scalar = 0;
  bool scalar_is_integral = false;
  int64_t integer = 0;     // an integral scalar exactly (the double rounds beyond 2^53)
  bool is_tensor = false;  // so that an undefined tensor is an error rather than the scalar 0
  Loc loc;
  Operand(const Tensor& t, const Loc& loc = Loc::current())
      : tensor(t), is_tensor(true), loc(loc) {}
  template <typename S>
  requires std::is_arithmetic_v<S> Operand(S s, const Loc& loc = Loc::current())
      : tensor(none),
        scalar(static_cast<double>(s)),
        scalar_is_integral(std::is_integral_v<S>),
        integer(std::is_integral_v<S> ? static_cast<int64_t>(s) : 0),
        loc(loc) {
    if constexpr (std::is_unsigned_v<S> && sizeof(S) >= sizeof(int64_t))
      if (s > static_cast<S>(std::numeric_limits<int64_t>::max())) integer_operand_overflow(s, loc);
  }
};
Tensor operator+(const Operand& a, const Operand& b);
Tensor operator-(const Operand& a, const Operand& b);
Tensor operator*(const Operand& a, const Operand& b);
Tensor operator/(const Operand& a, const Operand& b);
Tensor operator<(const Operand& a, const Operand& b);
Tensor operator<=(const Operand& a, const Operand& b);
Tensor operator>(const Operand& a, const Operand& b);
Tensor operator>=(const Operand& a, const Operand& b);
/// A number as a fill of `shape` in type `t` (an integer number exactly, beyond 2^53 too), or,
/// for an integer number an i32 cannot hold, in i64: the op reading it then promotes, as
/// PyTorch's number operands do.
Tensor number_fill(const Operand& number, DType t, const Shape& shape,
                   const Loc& loc = Loc::current());
/// Elementwise eq and ne, as PyTorch's tensor == and != (`ids != 0`): bool tensors, not a
/// comparison of handles (Tensor::same() is that).
Tensor operator==(const Operand& a, const Operand& b);
Tensor operator!=(const Operand& a, const Operand& b);
// An Operand, not a Tensor, so that the node records the caller's line (operators cannot take
// a defaulted location argument).
Tensor operator-(const Operand& x);
Tensor pow(const Tensor& x, double exponent, const Loc& loc = Loc::current());

/// cond ? a : b elementwise, with broadcasting; cond must be bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b, const Loc& loc = Loc::current());
Tensor cast(const Tensor& x, DType dtype, const Loc& loc = Loc::current());
/// x in the type `like` (of x's shape) is stored in once the precision pass has run: its traced
/// dtype as traced, its storage under a policy (PyTorch's x.type_as(like), where the type is known
/// only after the pass). Only x takes a gradient.
Tensor cast_like(const Tensor& x, const Tensor& like, const Loc& loc = Loc::current());

// ---- reductions; empty axes = all axes ----
Tensor sum(const Tensor& x, std::vector<int64_t> axes = {}, bool keepdim = false,
           const Loc& loc = Loc::current());
Tensor mean(const Tensor& x, std::vector<int64_t> axes = {}, bool keepdim = false,
            const Loc& loc = Loc::current());
/// Largest element (like torch.amax): ties share the gradient evenly. NaN wins.
Tensor max(const Tensor& x, std::vector<int64_t> axes = {}, bool keepdim = false,
           const Loc& loc = Loc::current());
Tensor min(const Tensor& x, std::vector<int64_t> axes = {}, bool keepdim = false,
           const Loc& loc = Loc::current());
/// Index (i64) of the first largest element along `axis`; without an axis, of the flattened x.
Tensor argmax(const Tensor& x, std::optional<int64_t> axis = std::nullopt, bool keepdim = false,
              const Loc& loc = Loc::current());
/// Running sum, product and log-sum-exp along dim, as torch.cumsum, cumprod and logcumsumexp
/// (integer and bool inputs give i64 for the first two; logcumsumexp takes floats only and
/// handles infinities as torch: -inf elements add nothing). cumprod's gradient is exact at zeros.
Tensor cumsum(const Tensor& x, int64_t dim, const Loc& loc = Loc::current());
Tensor cumprod(const Tensor& x, int64_t dim, const Loc& loc = Loc::current());
Tensor logcumsumexp(const Tensor& x, int64_t dim, const Loc& loc = Loc::current());
/// The i64 indices that sort x along dim, as torch.argsort: NaN above +inf (last ascending,
/// first descending). Every sort here is stable, so `stable` changes nothing: equal elements
/// keep their order, a valid answer for stable=false too.
Tensor argsort(const Tensor& x, int64_t dim = -1, bool descending = false, bool stable = false,
               const Loc& loc = Loc::current());
/// torch.var: the squared deviations from the mean summed over max(0, n - correction), Bessel's
/// correction 1 by default (n <= correction gives inf, NaN for no spread); 0 is the population
/// variance layer_norm uses.
Tensor var(const Tensor& x, std::vector<int64_t> axes = {}, bool keepdim = false,
           double correction = 1.0, const Loc& loc = Loc::current());

// ---- matmul: [..., m, k] x [..., k, n] with numpy batch broadcasting; 1-d operands as numpy ----
Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a = false, bool transpose_b = false,
              const Loc& loc = Loc::current());

// ---- shape and data movement ----
/// One dimension may be -1 (inferred).
Tensor reshape(const Tensor& x, Shape shape, const Loc& loc = Loc::current());
Tensor permute(const Tensor& x, std::vector<int64_t> perm, const Loc& loc = Loc::current());
Tensor transpose(const Tensor& x, int64_t a = -2, int64_t b = -1, const Loc& loc = Loc::current());
Tensor broadcast_to(const Tensor& x, Shape shape, const Loc& loc = Loc::current());
Tensor unsqueeze(const Tensor& x, int64_t axis, const Loc& loc = Loc::current());
Tensor squeeze(const Tensor& x, int64_t axis, const Loc& loc = Loc::current());
Tensor flatten(const Tensor& x, int64_t start_axis = 0, int64_t end_axis = -1,
               const Loc& loc = Loc::current());
/// x[start:stop:step] along one axis; negative start/stop count from the end and are clamped
/// like Python slices. step must be positive.
Tensor slice(const Tensor& x, int64_t axis, int64_t start, int64_t stop, int64_t step = 1,
             const Loc& loc = Loc::current());
/// Strided slice over every axis at once: starts, steps per axis; the result has `shape`.
Tensor slice(const Tensor& x, std::vector<int64_t> starts, std::vector<int64_t> steps, Shape shape,
             const Loc& loc = Loc::current());
/// The adjoint of slice: x placed at starts/steps inside zeros of `full_shape`.
Tensor unslice(const Tensor& x, std::vector<int64_t> starts, std::vector<int64_t> steps,
               Shape full_shape, const Loc& loc = Loc::current());
Tensor concat(const std::vector<Tensor>& xs, int64_t axis = 0, const Loc& loc = Loc::current());
Tensor stack(const std::vector<Tensor>& xs, int64_t axis = 0, const Loc& loc = Loc::current());

// ---- indexing ----
/// Rows of x along `axis` picked by integer `index` of any shape:
/// result shape x.shape[:axis] + index.shape + x.shape[axis+1:].
Tensor index_select(const Tensor& x, const Tensor& index, int64_t axis = 0,
                    const Loc& loc = Loc::current());
/// base with `source` added at the rows `index` names along `axis` (repeats accumulate).
Tensor index_add(const Tensor& base, const Tensor& index, const Tensor& source, int64_t axis = 0,
                 const Loc& loc = Loc::current());
/// torch.gather / numpy take_along_axis: index has x's rank; result has index's shape.
Tensor gather(const Tensor& x, const Tensor& index, int64_t axis, const Loc& loc = Loc::current());
/// base plus source scattered to the positions index names along axis (repeats accumulate).
Tensor scatter_add(const Tensor& base, const Tensor& index, const Tensor& source, int64_t axis,
                   const Loc& loc = Loc::current());
/// torch.scatter: x with src's elements written at the positions index (x's rank, fitting x
/// outside dim) names along dim; src may be larger than index (the part index covers is read)
/// and is cast to x's dtype. Of repeated positions the last in index order is kept (PyTorch
/// leaves that unspecified). The value form writes one scalar.
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
               const Loc& loc = Loc::current());
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value,
               const Loc& loc = Loc::current());
/// weight[ids]: [num, dim] table, integer ids of any shape -> ids.shape + [dim].
Tensor embedding(const Tensor& weight, const Tensor& ids, const Loc& loc = Loc::current());
/// The same, where the row `padding_idx` (negative counts from the end) gets no gradient from
/// the places that read it, as torch's F.embedding(padding_idx=...).
Tensor embedding(const Tensor& weight, const Tensor& ids, std::optional<int64_t> padding_idx,
                 const Loc& loc = Loc::current());
/// [..., num_classes] of dtype with 1 at each id; ids outside [0, num_classes) give all zeros.
Tensor one_hot(const Tensor& ids, int64_t num_classes, DType dtype = f32,
               const Loc& loc = Loc::current());

// ---- user-defined ops ----
/// An op whose forward is `forward(inputs)` (traced without gradient) and whose gradient is
/// `vjp(inputs, output, grad)`, returning one gradient (or an undefined Tensor) per input.
Tensor custom_op(const std::vector<Tensor>& inputs,
                 const std::function<Tensor(const std::vector<Tensor>&)>& forward, CustomVjp vjp,
                 const Loc& loc = Loc::current());

/// The conditions mt::check asserts (dsl/checks.def).
enum class CheckKind : int64_t {
#define MT_CHECK(Name, message) Name,
#include "mixtape/dsl/checks.def"
};
/// The message a failed check of `kind` gives.
const char* check_message(CheckKind kind);
/// `value`, once every element of the bool `ok` (any shape) is true; its evaluation is an
/// mt::Error naming the call site's op and `kind`'s condition otherwise. A host step: the values
/// checked are read where they are made, without a sync of their own.
Tensor check(const Tensor& value, const Tensor& ok, CheckKind kind,
             const Loc& loc = Loc::current());

/// The sum of x over every process of the run (dsl/process_group.h), the same bits on each:
/// added in rank order, in f32 for half types; x's value with one process. Every process must
/// evaluate the same all_reduce nodes in the same order (dist::DataParallel makes them).
Tensor all_reduce(const Tensor& x, const Loc& loc = Loc::current());
/// This process's share of the sum over every process of the 1-D x, whose length must be a
/// multiple of the process count N: elements [r S, (r + 1) S) of the sum on process r, S being
/// x's length / N, added in rank order as all_reduce adds them (DeepSpeed's reduce-scatter of
/// flat, padded gradients). x's value with one process.
Tensor reduce_scatter(const Tensor& x, const Loc& loc = Loc::current());
/// The 1-D x of every process, concatenated in rank order (N times x's length), the same bits on
/// every process; every process's x must have the same length. x's value with one process.
Tensor all_gather(const Tensor& x, const Loc& loc = Loc::current());

/// The scan `op` (Cumsum, Cumprod or Logcumsumexp) along axis, from the last element when
/// reverse: what the scans' vjp rules use (their gradients run the other way).
Tensor cumulative(OpCode op, const Tensor& x, int64_t axis, bool reverse,
                  const Loc& loc = Loc::current());

/// Used by ops.def vjp rules: the second derivatives of gelu, the tanh-form gelu and silu (the
/// gradients of gelu_backward, gelu_tanh_backward and silu_backward with respect to x).
Tensor gelu_second_derivative(const Tensor& x);
Tensor gelu_tanh_second_derivative(const Tensor& x);
Tensor silu_second_derivative(const Tensor& x);

}  // namespace mixtape
