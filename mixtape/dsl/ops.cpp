// mixtape/dsl/ops.cpp -- op builders: validate shapes and dtypes, insert casts and broadcasts, make
// nodes.
#include "mixtape/dsl/ops.h"

#include "mixtape/dsl/composites.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <span>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/process_group.h"

namespace mixtape {
namespace {

enum class Domain { Float, Numeric, Any };

// Shapes compared in line: std::vector's == calls memcmp, and builders compare a few shapes for
// every node the traced loop makes.
bool same_shape(const Shape& a, const Shape& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

const NodePtr& input(const Tensor& t, const char* op, const Loc& loc, const char* role = "input") {
  if (!t.defined()) op_fail(op, loc, "the {} is an undefined tensor", role);
  return t.node();
}

void check_domain(const char* op, Domain domain, DType t, const Loc& loc) {
  if (domain == Domain::Float && !is_floating(t))
    op_fail(op, loc, "expects a floating-point dtype, got {}", name(t));
  if (domain == Domain::Numeric && t == boolean)
    op_fail(op, loc, "does not accept bool tensors (cast to a numeric dtype first)");
}

std::string shapes_text(const Tensor& a, const Tensor& b) {
  return fmt::format("{} ({}) and {} ({})", to_string(a.shape()), name(a.dtype()),
                     to_string(b.shape()), name(b.dtype()));
}

Shape broadcast_or_fail(const Tensor& a, const Tensor& b, const char* op, const Loc& loc) {
  std::optional<Shape> shape = broadcast_shapes(a.shape(), b.shape());
  if (!shape) op_fail(op, loc, "shapes cannot be broadcast together: {}", shapes_text(a, b));
  return std::move(*shape);
}

// make_node's inputs, each NodePtr copied once (a braced list copies every element twice, and
// each copy of a shared_ptr is an atomic increment).
template <typename... Nodes>
NodeInputs node_list(Nodes&&... nodes) {
  NodeInputs list;
  list.reserve(sizeof...(nodes));
  (list.emplace_back(std::forward<Nodes>(nodes)), ...);
  return list;
}

NodePtr broadcast_node(const NodePtr& node, Shape shape, const Loc& loc);

// The node for `x` cast to `dtype` and broadcast to `shape` (no new node when nothing changes).
// Made as nodes, not Tensors: a handle for each intermediate would be one more heap block.
NodePtr conform(const Tensor& x, DType dtype, const Shape& shape, const Loc& loc) {
  const NodePtr& given = x.node();
  if (given->dtype == dtype && same_shape(given->shape, shape)) return given;
  NodePtr node = given;
  if (given->dtype != dtype) {
    node = make_node(OpCode::Cast, dtype, given->shape, node_list(given), {}, loc);
    node->promotion = true;
    node->weak_promotion = !is_floating(given->dtype);
  }
  if (!same_shape(node->shape, shape)) {
    node = broadcast_node(node, shape, loc);
    // A 0-d operand broadcast beside one with dimensions is weak as a promoted integer is: it
    // does not widen the op under a policy, as torch.result_type ranks a 0-d tensor of the same
    // category below dimensioned ones (precision_policy/assign.cpp).
    node->weak_promotion = given->shape.empty();
  }
  return node;
}

// The type two operands compute in, by PyTorch's rule for 0-d tensors: a 0-d operand beside one
// with dimensions counts only when its category (bool < integer < floating) is higher, so that
// an f16 activation times a 0-d f32 value stays f16 (as a number operand keeps it, scalar_like).
DType result_type(const Tensor& a, const Tensor& b) {
  const bool a0 = a.dim() == 0, b0 = b.dim() == 0;
  if (a0 == b0) return promote(a.dtype(), b.dtype());
  auto category = [](DType t) { return t == boolean ? 0 : is_floating(t) ? 2 : 1; };
  const Tensor& dimensioned = a0 ? b : a;
  const Tensor& zero_d = a0 ? a : b;
  if (category(zero_d.dtype()) > category(dimensioned.dtype()))
    return promote(dimensioned.dtype(), zero_d.dtype());
  return dimensioned.dtype();
}

Tensor pointwise(OpCode op, Domain domain, bool to_bool, const Tensor& a, const Tensor& b,
                 const Loc& loc) {
  const char* opname = op_name(op);
  input(a, opname, loc, "first operand");
  input(b, opname, loc, "second operand");
  DType t = result_type(a, b);
  check_domain(opname, domain, t, loc);
  // Operands of one shape (most of a training step's) need no broadcast.
  Shape shape = same_shape(a.shape(), b.shape()) ? a.shape() : broadcast_or_fail(a, b, opname, loc);
  NodeInputs inputs = node_list(conform(a, t, shape, loc), conform(b, t, shape, loc));
  return Tensor(make_node(op, to_bool ? boolean : t, std::move(shape), std::move(inputs), {}, loc));
}

// A fused pointwise op (MT_FUSED): its floating inputs promoted to one dtype and broadcast to
// one shape. A 0-d input stays 0-d, read at every element (an optimizer's step size and betas):
// a broadcast node per parameter and factor was most of the traced loop's update graph.
Tensor fused(OpCode op, std::span<const Tensor> inputs, const Loc& loc) {
  const char* opname = op_name(op);
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!inputs[i].defined()) op_fail(opname, loc, "input {} is an undefined tensor", i);
  DType t = inputs[0].dtype();
  // Operands of one shape, 0-d ones aside (an update's), need no broadcast: no shape is copied.
  const Shape* one = nullptr;
  bool same = true;
  for (const Tensor& x : inputs) {
    t = promote(t, x.dtype());
    if (x.shape().empty()) continue;
    if (!one)
      one = &x.shape();
    else if (!same_shape(*one, x.shape()))
      same = false;
  }
  check_domain(opname, Domain::Float, t, loc);
  std::optional<Shape> shape = one ? *one : Shape{};
  for (size_t i = 0; !same && shape && i < inputs.size(); ++i)
    shape = broadcast_shapes(*shape, inputs[i].shape());
  if (!shape) {
    std::string shapes;
    for (const Tensor& x : inputs) shapes += (shapes.empty() ? "" : ", ") + to_string(x.shape());
    op_fail(opname, loc, "shapes cannot be broadcast together: {}", shapes);
  }
  static const Shape zero_d;
  NodeInputs list;
  list.reserve(inputs.size());
  for (const Tensor& x : inputs)
    list.emplace_back(conform(x, t, x.shape().empty() ? zero_d : *shape, loc));
  return Tensor(make_node(op, t, std::move(*shape), std::move(list), {}, loc));
}

Tensor unary(OpCode op, Domain domain, const Tensor& x, const Loc& loc) {
  const NodePtr& node = input(x, op_name(op), loc);
  check_domain(op_name(op), domain, x.dtype(), loc);
  return Tensor(make_node(op, x.dtype(), node->shape, node_list(node), {}, loc));
}

}  // namespace

void integer_operand_overflow(uint64_t value, const Loc& loc) {
  op_fail("operator", loc, "the integer {} does not fit in int64 (the widest tensor integer)",
          value);
}

Tensor number_fill(const Operand& number, DType t, const Shape& shape, const Loc& loc) {
  if (is_floating(t) || t == boolean || !number.scalar_is_integral)
    return full(shape, number.scalar, t, loc);
  // An integer exactly (ids == 2^53 + 1 matched 2^53 through a double); one an i32 cannot
  // hold as an i64 (i32 < 3e9 compares exactly, as PyTorch's).
  using i32_limits = std::numeric_limits<int32_t>;
  if (t == i32 && (number.integer < i32_limits::min() || number.integer > i32_limits::max()))
    t = i64;
  return full_integer(shape, number.integer, t, loc);
}

namespace {

// A number operand as a fill of the other operand's shape: one node, where a 0-d fill would need
// a broadcast as well (the traced loop builds a few of these per parameter every step). Either
// way it is a constant that kernels compute in place.
Tensor scalar_like(const Operand& s, const Tensor& other, const Loc& loc) {
  DType t = other.dtype();
  if (!is_floating(t) && !s.scalar_is_integral) t = f32;
  if (t == boolean) t = i64;
  return number_fill(s, t, other.shape(), loc);
}

template <typename Builder>
Tensor apply_operator(const Operand& a, const Operand& b, Builder build) {
  const Loc& loc = b.tensor.defined() ? b.loc : a.loc;
  // The builder reports an undefined tensor operand by position.
  if ((a.is_tensor && !a.tensor.defined()) || (b.is_tensor && !b.tensor.defined()))
    return build(a.is_tensor ? a.tensor : scalar(a.scalar, f32, loc),
                 b.is_tensor ? b.tensor : scalar(b.scalar, f32, loc), loc);
  if (!a.tensor.defined() && !b.tensor.defined())
    op_fail("operator", loc, "needs a tensor operand");
  // The operands as they are, not copies: each copy of a handle is a reference count taken and
  // dropped again.
  if (!a.tensor.defined()) return build(scalar_like(a, b.tensor, loc), b.tensor, loc);
  if (!b.tensor.defined()) return build(a.tensor, scalar_like(b, a.tensor, loc), loc);
  return build(a.tensor, b.tensor, loc);
}

int64_t axis_or_fail(int64_t axis, size_t rank, const char* op, const Loc& loc) {
  int64_t r = static_cast<int64_t>(rank);
  if (axis < -r || axis >= r) op_fail(op, loc, "axis {} is out of range for rank {}", axis, rank);
  return axis < 0 ? axis + r : axis;
}

std::vector<int64_t> axes_or_fail(const std::vector<int64_t>& axes, size_t rank, const char* op,
                                  const Loc& loc) {
  std::vector<int64_t> out;
  if (axes.empty()) {
    out.resize(rank);
    std::iota(out.begin(), out.end(), 0);
    return out;
  }
  for (int64_t a : axes) out.push_back(axis_or_fail(a, rank, op, loc));
  std::sort(out.begin(), out.end());
  if (std::adjacent_find(out.begin(), out.end()) != out.end())
    op_fail(op, loc, "axis list [{}] repeats an axis", fmt::join(axes, ", "));
  return out;
}

Tensor reduce(OpCode op, const Tensor& x, const std::vector<int64_t>& axes, bool keepdim,
              DType dtype, const Loc& loc) {
  const char* opname = op_name(op);
  const NodePtr& node = input(x, opname, loc);
  Attrs attrs;
  attrs.axes = axes_or_fail(axes, node->shape.size(), opname, loc);
  attrs.keepdim = keepdim;
  if (op != OpCode::Sum)
    for (int64_t a : attrs.axes)
      if (node->shape[a] == 0) op_fail(opname, loc, "cannot reduce an empty axis {}", a);
  Shape shape = reduced_shape(node->shape, attrs.axes, keepdim);
  return Tensor(make_node(op, dtype, std::move(shape), node_list(node), std::move(attrs), loc));
}

void check_index_dtype(const char* op, const Tensor& index, const Loc& loc) {
  if (!is_integer(index.dtype()))
    op_fail(op, loc, "index must be an integer tensor, got {}", name(index.dtype()));
}

}  // namespace

// ---- generated pointwise builders ----
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  Tensor fname(const Tensor& x, const Loc& loc) {         \
    return unary(OpCode::Name, Domain::domain, x, loc);   \
  }
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1)     \
  Tensor fname(const Tensor& a, const Tensor& b, const Loc& loc) {    \
    return pointwise(OpCode::Name, Domain::domain, false, a, b, loc); \
  }
#define MT_COMPARE(Name, fname, REF)                               \
  Tensor fname(const Tensor& a, const Tensor& b, const Loc& loc) { \
    return pointwise(OpCode::Name, Domain::Any, true, a, b, loc);  \
  }
#define MT_FUSED(Name, fname, arity, REF)                                 \
  Tensor fname(const std::array<Tensor, arity>& inputs, const Loc& loc) { \
    return fused(OpCode::Name, inputs, loc);                              \
  }
#include "mixtape/dsl/ops.def"

Tensor operator+(const Operand& a, const Operand& b) { return apply_operator(a, b, add); }
Tensor operator-(const Operand& a, const Operand& b) { return apply_operator(a, b, sub); }
Tensor operator*(const Operand& a, const Operand& b) { return apply_operator(a, b, mul); }
Tensor operator/(const Operand& a, const Operand& b) { return apply_operator(a, b, div); }
Tensor operator<(const Operand& a, const Operand& b) { return apply_operator(a, b, lt); }
Tensor operator<=(const Operand& a, const Operand& b) { return apply_operator(a, b, le); }
Tensor operator>(const Operand& a, const Operand& b) { return apply_operator(a, b, gt); }
Tensor operator>=(const Operand& a, const Operand& b) { return apply_operator(a, b, ge); }
Tensor operator==(const Operand& a, const Operand& b) { return apply_operator(a, b, eq); }
Tensor operator!=(const Operand& a, const Operand& b) { return apply_operator(a, b, ne); }
Tensor operator-(const Operand& x) {
  if (!x.is_tensor) op_fail("neg", x.loc, "needs a tensor operand");
  return neg(x.tensor, x.loc);
}

Tensor pow(const Tensor& x, double exponent, const Loc& loc) {
  input(x, "pow", loc);
  return pow(x, scalar(exponent, is_floating(x.dtype()) ? x.dtype() : f32, loc), loc);
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b, const Loc& loc) {
  input(cond, "where", loc, "condition");
  input(a, "where", loc, "first value");
  input(b, "where", loc, "second value");
  if (cond.dtype() != boolean)
    op_fail("where", loc, "the condition must be bool, got {}", name(cond.dtype()));
  DType t = result_type(a, b);
  std::optional<Shape> values = broadcast_shapes(a.shape(), b.shape());
  std::optional<Shape> all = values ? broadcast_shapes(cond.shape(), *values) : std::nullopt;
  if (!all)
    op_fail("where", loc, "shapes cannot be broadcast together: condition {}, values {}",
            to_string(cond.shape()), shapes_text(a, b));
  const Shape& shape = *all;
  return Tensor(make_node(OpCode::Where, t, shape,
                          node_list(conform(cond, boolean, shape, loc), conform(a, t, shape, loc),
                                    conform(b, t, shape, loc)),
                          {}, loc));
}

Tensor cast(const Tensor& x, DType dtype, const Loc& loc) {
  const NodePtr& node = input(x, "cast", loc);
  if (x.dtype() == dtype) return Tensor(node);
  return Tensor(make_node(OpCode::Cast, dtype, node->shape, node_list(node), {}, loc));
}

Tensor cast_like(const Tensor& x, const Tensor& like, const Loc& loc) {
  const NodePtr& node = input(x, "cast_like", loc);
  const NodePtr& type = input(like, "cast_like", loc, "like");
  if (!same_shape(node->shape, type->shape))
    op_fail("cast_like", loc, "x {} and like {} must have one shape", to_string(x.shape()),
            to_string(like.shape()));
  return Tensor(
      make_node(OpCode::CastLike, like.dtype(), node->shape, node_list(node, type), {}, loc));
}

Tensor sum(const Tensor& x, std::vector<int64_t> axes, bool keepdim, const Loc& loc) {
  input(x, "sum", loc);
  DType t = is_floating(x.dtype()) ? x.dtype() : i64;
  return reduce(OpCode::Sum, x, axes, keepdim, t, loc);
}

Tensor mean(const Tensor& x, std::vector<int64_t> axes, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc);
  input(x, "mean", loc);
  check_domain("mean", Domain::Float, x.dtype(), loc);
  std::vector<int64_t> normalized = axes_or_fail(axes, x.shape().size(), "mean", loc);
  int64_t count = 1;
  for (int64_t a : normalized) count *= x.shape()[a];
  // Over zero elements the sum 0 times 1/0 = inf: NaN, as PyTorch's mean of nothing.
  return sum(x, normalized, keepdim, loc) * (1.0 / static_cast<double>(count));
}

Tensor max(const Tensor& x, std::vector<int64_t> axes, bool keepdim, const Loc& loc) {
  input(x, "max", loc);
  check_domain("max", Domain::Numeric, x.dtype(), loc);
  return reduce(OpCode::Max, x, axes, keepdim, x.dtype(), loc);
}

Tensor min(const Tensor& x, std::vector<int64_t> axes, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc);
  input(x, "min", loc);
  check_domain("min", Domain::Numeric, x.dtype(), loc);
  for (int64_t a : axes_or_fail(axes, x.shape().size(), "min", loc))
    if (x.shape()[a] == 0) op_fail("min", loc, "cannot reduce an empty axis {}", a);
  // The largest of an order-reversing map: -x for floats, ~x = -1 - x for integers (-x
  // overflows at the smallest integer, -1 - x never).
  if (is_floating(x.dtype()) || x.dtype() == boolean) return -max(-x, axes, keepdim, loc);
  return -1 - max(-1 - x, axes, keepdim, loc);
}

Tensor argmax(const Tensor& x, std::optional<int64_t> axis, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc);
  input(x, "argmax", loc);
  check_domain("argmax", Domain::Numeric, x.dtype(), loc);
  // A 0-d tensor takes axis 0 or -1, as torch's: its one element is at index 0.
  if (axis && !x.shape().empty()) return reduce(OpCode::Argmax, x, {*axis}, keepdim, i64, loc);
  if (axis && (*axis < -1 || *axis > 0))
    op_fail("argmax", loc, "axis {} is out of range for a 0-d tensor", *axis);
  Tensor flat = reduce(OpCode::Argmax, reshape(x, {-1}, loc), {0}, false, i64, loc);
  return keepdim ? reshape(flat, Shape(x.shape().size(), 1), loc) : flat;
}

Tensor var(const Tensor& x, std::vector<int64_t> axes, bool keepdim, double correction,
           const Loc& loc) {
  CallSiteScope site(loc);
  input(x, "var", loc);
  check_domain("var", Domain::Float, x.dtype(), loc);
  const std::vector<int64_t> normalized = axes_or_fail(axes, x.shape().size(), "var", loc);
  // In f32 for 16-bit inputs, rounded once, as PyTorch's kernel: f16 squares of deviations of
  // 200 overflowed where the variance, 40000, fits.
  const DType type = composite::statistics_type(x.dtype());
  const Tensor wide = x.dtype() == type ? x : cast(x, type, loc);
  // The squares and their sum in f64, as PyTorch accumulates: an f32 deviation of 1e20 has a
  // square f32 cannot hold.
  Tensor centered = wide - mean(wide, axes, true, loc);
  if (type == f32) centered = cast(centered, f64, loc);
  Tensor variance;
  if (correction == 0) {
    variance = mean(square(centered), axes, keepdim, loc);
  } else {
    // Divided by the count less the correction, as PyTorch's, not scaled by a rounded ratio.
    int64_t n = 1;
    for (int64_t axis : normalized) n *= x.size(axis);
    variance = sum(square(centered), axes, keepdim, loc) /
               std::max(0.0, static_cast<double>(n) - correction);
  }
  return variance.dtype() == x.dtype() ? variance : cast(variance, x.dtype(), loc);
}

Tensor matmul(const Tensor& a_in, const Tensor& b_in, bool transpose_a, bool transpose_b,
              const Loc& loc) {
  CallSiteScope site(loc);
  input(a_in, "matmul", loc, "first operand");
  input(b_in, "matmul", loc, "second operand");
  if (a_in.dim() == 0 || b_in.dim() == 0)
    op_fail("matmul", loc, "operands must have at least one dimension: {}",
            shapes_text(a_in, b_in));
  if ((a_in.dim() == 1 && transpose_a) || (b_in.dim() == 1 && transpose_b))
    op_fail("matmul", loc, "cannot transpose a 1-d operand");
  DType t = promote(a_in.dtype(), b_in.dtype());
  check_domain("matmul", Domain::Float, t, loc);
  Tensor a = a_in.dim() == 1 ? reshape(a_in, {1, a_in.size(0)}, loc) : a_in;
  Tensor b = b_in.dim() == 1 ? reshape(b_in, {b_in.size(0), 1}, loc) : b_in;
  const Shape& sa = a.shape();
  const Shape& sb = b.shape();
  int64_t m = transpose_a ? sa[sa.size() - 1] : sa[sa.size() - 2];
  int64_t ka = transpose_a ? sa[sa.size() - 2] : sa[sa.size() - 1];
  int64_t kb = transpose_b ? sb[sb.size() - 1] : sb[sb.size() - 2];
  int64_t n = transpose_b ? sb[sb.size() - 2] : sb[sb.size() - 1];
  if (ka != kb)
    op_fail("matmul", loc, "inner dimensions differ ({} vs {}): {}{}{}", ka, kb,
            shapes_text(a_in, b_in), transpose_a ? ", first transposed" : "",
            transpose_b ? ", second transposed" : "");
  if (b_in.dim() == 2 && sa.size() > 2 && !transpose_a && ka > 0) {
    // A batch of rows times one matrix (a linear layer on [batch, time, features]) is one
    // matrix product over all the rows: no copy of the matrix per batch, and its gradient is
    // one product instead of a batch of them summed.
    Shape rows_out(sa.begin(), sa.end() - 1);
    rows_out.push_back(n);
    Tensor rows = reshape(a, {numel(sa) / ka, ka}, loc);
    return reshape(matmul(rows, b, false, transpose_b, loc), rows_out, loc);
  }
  std::optional<Shape> batch =
      broadcast_shapes(Shape(sa.begin(), sa.end() - 2), Shape(sb.begin(), sb.end() - 2));
  if (!batch)
    op_fail("matmul", loc, "batch dimensions cannot be broadcast: {}", shapes_text(a_in, b_in));
  // Each operand broadcast to the batch shape, then the product's shape (one allocation each).
  auto batched = [&](int64_t rows, int64_t cols) {
    Shape shape;
    shape.reserve(batch->size() + 2);
    shape.assign(batch->begin(), batch->end());
    shape.push_back(rows);
    shape.push_back(cols);
    return shape;
  };
  // Operands without batch dimensions are already whole (the 2-d products of a training step).
  NodeInputs operands =
      batch->empty() ? node_list(conform(a, t, sa, loc), conform(b, t, sb, loc))
                     : node_list(conform(a, t, batched(sa[sa.size() - 2], sa[sa.size() - 1]), loc),
                                 conform(b, t, batched(sb[sb.size() - 2], sb[sb.size() - 1]), loc));
  Attrs attrs;
  attrs.transpose_a = transpose_a;
  attrs.transpose_b = transpose_b;
  Tensor result(
      make_node(OpCode::MatMul, t, batched(m, n), std::move(operands), std::move(attrs), loc));
  if (a_in.dim() == 1) result = squeeze(result, -2, loc);
  if (b_in.dim() == 1) result = squeeze(result, -1, loc);
  return result;
}

Tensor reshape(const Tensor& x, Shape shape, const Loc& loc) {
  const NodePtr& node = input(x, "reshape", loc);
  int64_t known = 1, inferred = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (inferred >= 0)
        op_fail("reshape", loc, "only one dimension may be -1 in {}", to_string(shape));
      inferred = static_cast<int64_t>(i);
    } else if (shape[i] < 0) {
      op_fail("reshape", loc, "invalid dimension {} in {}", shape[i], to_string(shape));
    } else if (__builtin_mul_overflow(known, shape[i], &known)) {
      op_fail("reshape", loc, "shape {} has more elements than a 64-bit count holds",
              to_string(shape));
    }
  }
  if (inferred >= 0) {
    if (known == 0 || node->numel() % known != 0)
      op_fail("reshape", loc, "cannot reshape {} into {}", to_string(node->shape),
              to_string(shape));
    shape[inferred] = node->numel() / known;
  }
  if (numel(shape) != node->numel())
    op_fail("reshape", loc, "cannot reshape {} ({} elements) into {} ({} elements)",
            to_string(node->shape), node->numel(), to_string(shape), numel(shape));
  if (same_shape(shape, node->shape)) return Tensor(node);
  return Tensor(
      make_node(OpCode::Reshape, node->dtype, std::move(shape), node_list(node), {}, loc));
}

Tensor permute(const Tensor& x, std::vector<int64_t> perm, const Loc& loc) {
  const NodePtr& node = input(x, "permute", loc);
  size_t rank = node->shape.size();
  if (perm.size() != rank)
    op_fail("permute", loc, "permutation [{}] does not match rank {} of {}", fmt::join(perm, ", "),
            rank, to_string(node->shape));
  std::vector<bool> seen(rank, false);
  Shape shape(rank);
  bool identity = true;
  for (size_t i = 0; i < rank; ++i) {
    int64_t p = axis_or_fail(perm[i], rank, "permute", loc);
    if (seen[p]) op_fail("permute", loc, "[{}] is not a permutation", fmt::join(perm, ", "));
    seen[p] = true;
    perm[i] = p;
    shape[i] = node->shape[p];
    identity &= p == static_cast<int64_t>(i);
  }
  if (identity) return Tensor(node);
  Attrs attrs;
  attrs.axes = std::move(perm);
  return Tensor(make_node(OpCode::Permute, node->dtype, std::move(shape), node_list(node),
                          std::move(attrs), loc));
}

Tensor transpose(const Tensor& x, int64_t a, int64_t b, const Loc& loc) {
  input(x, "transpose", loc);
  size_t rank = x.shape().size();
  if (rank < 2)
    op_fail("transpose", loc, "needs at least 2 dimensions, got {}", to_string(x.shape()));
  std::vector<int64_t> perm(rank);
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[axis_or_fail(a, rank, "transpose", loc)],
            perm[axis_or_fail(b, rank, "transpose", loc)]);
  return permute(x, perm, loc);
}

namespace {
NodePtr broadcast_node(const NodePtr& node, Shape shape, const Loc& loc) {
  const Shape& from = node->shape;
  bool ok = shape.size() >= from.size();
  for (size_t i = 0; ok && i < from.size(); ++i) {
    int64_t target = shape[shape.size() - from.size() + i];
    ok = from[i] == target || from[i] == 1;
  }
  for (int64_t d : shape) ok &= d >= 0;
  if (!ok)
    op_fail("broadcast_to", loc, "cannot broadcast {} to {}", to_string(from), to_string(shape));
  if (same_shape(shape, from)) return node;
  return make_node(OpCode::BroadcastTo, node->dtype, std::move(shape), node_list(node), {}, loc);
}
}  // namespace

Tensor broadcast_to(const Tensor& x, Shape shape, const Loc& loc) {
  return Tensor(broadcast_node(input(x, "broadcast_to", loc), std::move(shape), loc));
}

Tensor unsqueeze(const Tensor& x, int64_t axis, const Loc& loc) {
  input(x, "unsqueeze", loc);
  Shape shape = x.shape();
  int64_t a = axis_or_fail(axis, shape.size() + 1, "unsqueeze", loc);
  shape.insert(shape.begin() + a, 1);
  return reshape(x, shape, loc);
}

Tensor squeeze(const Tensor& x, int64_t axis, const Loc& loc) {
  input(x, "squeeze", loc);
  Shape shape = x.shape();
  int64_t a = axis_or_fail(axis, shape.size(), "squeeze", loc);
  if (shape[a] != 1)
    op_fail("squeeze", loc, "axis {} of {} has size {}, not 1", axis, to_string(shape), shape[a]);
  shape.erase(shape.begin() + a);
  return reshape(x, shape, loc);
}

Tensor flatten(const Tensor& x, int64_t start_axis, int64_t end_axis, const Loc& loc) {
  input(x, "flatten", loc);
  Shape shape = x.shape();
  if (shape.empty()) return reshape(x, {1}, loc);
  int64_t s = axis_or_fail(start_axis, shape.size(), "flatten", loc);
  int64_t e = axis_or_fail(end_axis, shape.size(), "flatten", loc);
  if (s > e) op_fail("flatten", loc, "start axis {} comes after end axis {}", start_axis, end_axis);
  Shape out(shape.begin(), shape.begin() + s);
  int64_t merged = 1;
  for (int64_t i = s; i <= e; ++i) merged *= shape[i];
  out.push_back(merged);
  out.insert(out.end(), shape.begin() + e + 1, shape.end());
  return reshape(x, out, loc);
}

Tensor slice(const Tensor& x, int64_t axis, int64_t start, int64_t stop, int64_t step,
             const Loc& loc) {
  input(x, "slice", loc);
  const Shape& shape = x.shape();
  int64_t a = axis_or_fail(axis, shape.size(), "slice", loc);
  if (step <= 0) op_fail("slice", loc, "step must be positive, got {}", step);
  int64_t dim = shape[a];
  auto clamp_index = [dim](int64_t i) {
    if (i < 0) i += dim;
    return std::clamp<int64_t>(i, 0, dim);
  };
  start = clamp_index(start);
  stop = clamp_index(stop);
  // ceil((stop - start) / step) without forming stop - start + step - 1, which overflows for a
  // huge step (and wrapped to an empty slice instead of the one element Python gives).
  int64_t count = stop > start ? (stop - start - 1) / step + 1 : 0;
  std::vector<int64_t> starts(shape.size(), 0), steps(shape.size(), 1);
  starts[a] = start;
  steps[a] = step;
  Shape out = shape;
  out[a] = count;
  return slice(x, starts, steps, out, loc);
}

namespace {
void check_strided_window(const char* op, const Shape& window, const Shape& full,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& steps,
                          const Loc& loc) {
  if (starts.size() != full.size() || steps.size() != full.size() || window.size() != full.size())
    op_fail(op, loc, "starts, steps and shape must each have one entry per axis of {}",
            to_string(full));
  for (size_t i = 0; i < full.size(); ++i) {
    if (steps[i] <= 0) op_fail(op, loc, "step {} on axis {} must be positive", steps[i], i);
    // The last index, overflow-checked: a huge step used to wrap it negative and pass the
    // check, and the kernels then read or wrote far outside the buffer.
    int64_t last = 0;
    if (window[i] < 0 || starts[i] < 0 ||
        (window[i] > 0 && (__builtin_mul_overflow(window[i] - 1, steps[i], &last) ||
                           __builtin_add_overflow(starts[i], last, &last) || last >= full[i])))
      op_fail(op, loc, "window of size {} from {} step {} does not fit axis {} of {}", window[i],
              starts[i], steps[i], i, to_string(full));
  }
}
}  // namespace

Tensor slice(const Tensor& x, std::vector<int64_t> starts, std::vector<int64_t> steps, Shape shape,
             const Loc& loc) {
  const NodePtr& node = input(x, "slice", loc);
  check_strided_window("slice", shape, node->shape, starts, steps, loc);
  if (same_shape(shape, node->shape)) return Tensor(node);
  Attrs attrs;
  attrs.starts = std::move(starts);
  attrs.steps = std::move(steps);
  return Tensor(make_node(OpCode::Slice, node->dtype, std::move(shape), node_list(node),
                          std::move(attrs), loc));
}

Tensor unslice(const Tensor& x, std::vector<int64_t> starts, std::vector<int64_t> steps,
               Shape full_shape, const Loc& loc) {
  const NodePtr& node = input(x, "unslice", loc);
  check_strided_window("unslice", node->shape, full_shape, starts, steps, loc);
  if (full_shape == node->shape) return Tensor(node);
  Attrs attrs;
  attrs.starts = std::move(starts);
  attrs.steps = std::move(steps);
  return Tensor(make_node(OpCode::Unslice, node->dtype, std::move(full_shape), node_list(node),
                          std::move(attrs), loc));
}

Tensor concat(const std::vector<Tensor>& xs, int64_t axis, const Loc& loc) {
  if (xs.empty()) op_fail("concat", loc, "needs at least one tensor");
  for (const Tensor& x : xs) input(x, "concat", loc);
  const Shape& first = xs[0].shape();
  if (first.empty()) op_fail("concat", loc, "cannot concatenate 0-d tensors (use stack)");
  int64_t a = axis_or_fail(axis, first.size(), "concat", loc);
  DType t = xs[0].dtype();
  Shape out = first;
  out[a] = 0;
  for (const Tensor& x : xs) {
    const Shape& s = x.shape();
    bool ok = s.size() == first.size();
    for (size_t i = 0; ok && i < s.size(); ++i)
      ok = static_cast<int64_t>(i) == a || s[i] == first[i];
    if (!ok)
      op_fail("concat", loc, "shapes {} and {} differ outside axis {}", to_string(first),
              to_string(s), a);
    if (__builtin_add_overflow(out[a], s[a], &out[a]))
      op_fail("concat", loc, "axis {} would have more elements than a 64-bit count holds", a);
    t = promote(t, x.dtype());
  }
  if (xs.size() == 1) return Tensor(xs[0].node());
  std::vector<NodePtr> nodes;
  for (const Tensor& x : xs) nodes.push_back(conform(x, t, x.shape(), loc));
  Attrs attrs;
  attrs.axis = a;
  return Tensor(
      make_node(OpCode::Concat, t, std::move(out), std::move(nodes), std::move(attrs), loc));
}

Tensor stack(const std::vector<Tensor>& xs, int64_t axis, const Loc& loc) {
  CallSiteScope site(loc);
  if (xs.empty()) op_fail("stack", loc, "needs at least one tensor");
  for (const Tensor& x : xs) {
    input(x, "stack", loc);
    if (x.shape() != xs[0].shape())
      op_fail("stack", loc, "all shapes must match: {} vs {}", to_string(xs[0].shape()),
              to_string(x.shape()));
  }
  int64_t a = axis_or_fail(axis, xs[0].shape().size() + 1, "stack", loc);
  std::vector<Tensor> expanded;
  for (const Tensor& x : xs) expanded.push_back(unsqueeze(x, a, loc));
  return concat(expanded, a, loc);
}

namespace {
// What the index ops check first: the inputs (`source` where the op has one), an integer index
// and a data tensor of at least one dimension, the axis in range.
struct IndexedInputs {
  const NodePtr& node;
  const NodePtr& index;
  const Shape& shape;
  int64_t axis;
};
IndexedInputs indexed_inputs(const char* op, const char* role, const Tensor& data,
                             const Tensor& index, const Tensor* source, int64_t axis,
                             const Loc& loc) {
  const NodePtr& node = input(data, op, loc, role);
  const NodePtr& idx = input(index, op, loc, "index");
  if (source) input(*source, op, loc, "source");
  check_index_dtype(op, index, loc);
  if (node->shape.empty()) op_fail(op, loc, "cannot index a 0-d tensor");
  return {node, idx, node->shape, axis_or_fail(axis, node->shape.size(), op, loc)};
}

// The shape of index_select's result: `data`'s with dimension `axis` replaced by `index`'s.
Shape selected_shape(const Shape& data, const Shape& index, int64_t axis) {
  Shape out(data.begin(), data.begin() + axis);
  out.insert(out.end(), index.begin(), index.end());
  out.insert(out.end(), data.begin() + axis + 1, data.end());
  return out;
}
}  // namespace

Tensor index_select(const Tensor& x, const Tensor& index, int64_t axis, const Loc& loc) {
  auto [node, idx, shape, a] =
      indexed_inputs("index_select", "input", x, index, nullptr, axis, loc);
  Shape out = selected_shape(shape, idx->shape, a);
  Attrs attrs;
  attrs.axis = a;
  return Tensor(make_node(OpCode::IndexSelect, node->dtype, std::move(out), node_list(node, idx),
                          std::move(attrs), loc));
}

namespace {
// index_add and scatter_add: `source` is added into a copy of `base` at the places `index`
// names along `axis`. `expected_source` gives the shape the source must have (or fails).
template <typename ExpectedSource>
Tensor indexed_add(OpCode code, const char* op, const Tensor& base, const Tensor& index,
                   const Tensor& source, int64_t axis, const Loc& loc,
                   ExpectedSource expected_source) {
  auto [node, idx, bs, a] = indexed_inputs(op, "base", base, index, &source, axis, loc);
  Shape expected = expected_source(bs, idx->shape, a);
  DType t = promote(base.dtype(), source.dtype());
  Attrs attrs;
  attrs.axis = a;
  return Tensor(make_node(code, t, bs,
                          {conform(base, t, bs, loc), idx, conform(source, t, expected, loc)},
                          std::move(attrs), loc));
}

void check_gather_index(const char* op, const Shape& data, const Shape& index, int64_t axis,
                        const Loc& loc) {
  bool ok = data.size() == index.size();
  for (size_t i = 0; ok && i < data.size(); ++i)
    ok = static_cast<int64_t>(i) == axis || index[i] <= data[i];
  if (!ok)
    op_fail(op, loc, "index shape {} must have the rank of {} and fit it outside axis {}",
            to_string(index), to_string(data), axis);
}
}  // namespace

Tensor index_add(const Tensor& base, const Tensor& index, const Tensor& source, int64_t axis,
                 const Loc& loc) {
  return indexed_add(
      OpCode::IndexAdd, "index_add", base, index, source, axis, loc,
      [&](const Shape& bs, const Shape& idx, int64_t a) {
        Shape expected = selected_shape(bs, idx, a);
        if (source.shape() != expected)
          op_fail("index_add", loc, "source shape {} should be {} for base {} and index {}",
                  to_string(source.shape()), to_string(expected), to_string(bs), to_string(idx));
        return expected;
      });
}

Tensor gather(const Tensor& x, const Tensor& index, int64_t axis, const Loc& loc) {
  auto [node, idx, shape, a] = indexed_inputs("gather", "input", x, index, nullptr, axis, loc);
  check_gather_index("gather", node->shape, idx->shape, a, loc);
  Attrs attrs;
  attrs.axis = a;
  return Tensor(make_node(OpCode::Gather, node->dtype, idx->shape, node_list(node, idx),
                          std::move(attrs), loc));
}

Tensor scatter_add(const Tensor& base, const Tensor& index, const Tensor& source, int64_t axis,
                   const Loc& loc) {
  return indexed_add(OpCode::ScatterAdd, "scatter_add", base, index, source, axis, loc,
                     [&](const Shape& bs, const Shape& idx, int64_t a) {
                       check_gather_index("scatter_add", bs, idx, a, loc);
                       if (source.shape() != idx)
                         op_fail("scatter_add", loc, "source shape {} must equal index shape {}",
                                 to_string(source.shape()), to_string(idx));
                       return idx;
                     });
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
               const Loc& loc) {
  CallSiteScope site(loc);
  auto [node, idx, bs, a] = indexed_inputs("scatter", "input", x, index, &src, dim, loc);
  check_gather_index("scatter", bs, idx->shape, a, loc);
  // As PyTorch's: the source may be larger than the index; the part the index covers is written.
  bool covers = src.dim() == static_cast<int64_t>(idx->shape.size());
  for (size_t d = 0; covers && d < idx->shape.size(); ++d) covers = src.shape()[d] >= idx->shape[d];
  if (!covers)
    op_fail("scatter", loc, "source shape {} must have the rank of index shape {} and hold it",
            to_string(src.shape()), to_string(idx->shape));
  Tensor source = src;
  if (!same_shape(src.shape(), idx->shape))
    source = slice(src, std::vector<int64_t>(idx->shape.size(), 0),
                   std::vector<int64_t>(idx->shape.size(), 1), idx->shape, loc);
  DType t = x.dtype();
  Attrs attrs;
  attrs.axis = a;
  return Tensor(make_node(OpCode::Scatter, t, bs,
                          node_list(x.node(), idx, conform(source, t, idx->shape, loc)),
                          std::move(attrs), loc));
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value, const Loc& loc) {
  CallSiteScope site(loc);
  input(x, "scatter", loc);
  input(index, "scatter", loc, "index");
  return scatter(x, dim, index, full(index.shape(), value, x.dtype(), loc), loc);
}

Tensor cumulative(OpCode op, const Tensor& x, int64_t axis, bool reverse, const Loc& loc) {
  const char* opname = op_name(op);
  const NodePtr& node = input(x, opname, loc);
  if (node->shape.empty()) {  // a 0-d tensor is a line of one element, as in PyTorch
    CallSiteScope site(loc);
    axis_or_fail(axis, 1, opname, loc);
    return reshape(cumulative(op, reshape(x, {1}, loc), 0, reverse, loc), {}, loc);
  }
  int64_t a = axis_or_fail(axis, node->shape.size(), opname, loc);
  DType t = x.dtype();
  if (op == OpCode::Logcumsumexp)
    check_domain(opname, Domain::Float, t, loc);
  else if (!is_floating(t))
    t = i64;  // as torch: integer and bool scans give int64
  Attrs attrs;
  attrs.axis = a;
  attrs.reverse = reverse;
  return Tensor(make_node(op, t, node->shape, node_list(conform(x, t, node->shape, loc)),
                          std::move(attrs), loc));
}

Tensor cumsum(const Tensor& x, int64_t dim, const Loc& loc) {
  return cumulative(OpCode::Cumsum, x, dim, false, loc);
}
Tensor cumprod(const Tensor& x, int64_t dim, const Loc& loc) {
  return cumulative(OpCode::Cumprod, x, dim, false, loc);
}
Tensor logcumsumexp(const Tensor& x, int64_t dim, const Loc& loc) {
  return cumulative(OpCode::Logcumsumexp, x, dim, false, loc);
}

Tensor argsort(const Tensor& x, int64_t dim, bool descending, bool /*stable*/, const Loc& loc) {
  // Every sort is stable: one of the orders an unstable sort may give, and the same on every
  // back end.
  const NodePtr& node = input(x, "argsort", loc);
  if (node->shape.empty()) {
    CallSiteScope site(loc);
    axis_or_fail(dim, 1, "argsort", loc);
    return reshape(argsort(reshape(x, {1}, loc), 0, descending, true, loc), {}, loc);
  }
  Attrs attrs;
  attrs.axis = axis_or_fail(dim, node->shape.size(), "argsort", loc);
  attrs.reverse = descending;
  return Tensor(
      make_node(OpCode::Argsort, i64, node->shape, node_list(node), std::move(attrs), loc));
}

const char* check_message(CheckKind kind) {
  switch (kind) {
#define MT_CHECK(Name, message) \
  case CheckKind::Name:         \
    return message;
#include "mixtape/dsl/checks.def"
  }
  return "an unknown condition";
}

Tensor check(const Tensor& value, const Tensor& ok, CheckKind kind, const Loc& loc) {
  const NodePtr& node = input(value, "check", loc, "value");
  const NodePtr& flags = input(ok, "check", loc, "condition");
  if (flags->dtype != boolean)
    op_fail("check", loc, "the condition must be bool, got {}", name(flags->dtype));
  Attrs attrs;
  attrs.check = static_cast<int64_t>(kind);
  return Tensor(make_node(OpCode::Check, node->dtype, node->shape, node_list(node, flags),
                          std::move(attrs), loc));
}

Tensor all_reduce(const Tensor& x, const Loc& loc) {
  const NodePtr& node = input(x, "all_reduce", loc);
  if (node->dtype == boolean)
    op_fail("all_reduce", loc, "a bool tensor has no sum; cast it to a number type first");
  return Tensor(make_node(OpCode::AllReduce, node->dtype, node->shape, node_list(node), {}, loc));
}

Tensor reduce_scatter(const Tensor& x, const Loc& loc) {
  const NodePtr& node = input(x, "reduce_scatter", loc);
  if (node->dtype == boolean)
    op_fail("reduce_scatter", loc, "a bool tensor has no sum; cast it to a number type first");
  if (node->shape.size() != 1)
    op_fail("reduce_scatter", loc, "x must be 1-D (flatten it first), got shape {}",
            to_string(node->shape));
  const int64_t processes = process_count();
  if (node->shape[0] % processes != 0)
    op_fail("reduce_scatter", loc,
            "x's {} elements do not split evenly over {} processes (pad it to a multiple)",
            node->shape[0], processes);
  return Tensor(make_node(OpCode::ReduceScatter, node->dtype, {node->shape[0] / processes},
                          node_list(node), {}, loc));
}

Tensor all_gather(const Tensor& x, const Loc& loc) {
  const NodePtr& node = input(x, "all_gather", loc);
  if (node->shape.size() != 1)
    op_fail("all_gather", loc, "x must be 1-D (flatten it first), got shape {}",
            to_string(node->shape));
  return Tensor(make_node(OpCode::AllGather, node->dtype, {node->shape[0] * process_count()},
                          node_list(node), {}, loc));
}

Tensor embedding(const Tensor& weight, const Tensor& ids, const Loc& loc) {
  input(weight, "embedding", loc, "weight");
  if (weight.dim() != 2)
    op_fail("embedding", loc, "weight must be [num, dim], got {}", to_string(weight.shape()));
  input(ids, "embedding", loc, "ids");
  check_index_dtype("embedding", ids, loc);
  return index_select(weight, ids, 0, loc);
}

Tensor embedding(const Tensor& weight, const Tensor& ids, std::optional<int64_t> padding_idx,
                 const Loc& loc) {
  CallSiteScope site(loc);
  Tensor rows = embedding(weight, ids, loc);
  if (!padding_idx) return rows;
  const int64_t num = weight.size(0), pad = *padding_idx < 0 ? *padding_idx + num : *padding_idx;
  if (pad < 0 || pad >= num)
    op_fail("embedding", loc, "padding_idx {} is out of range for {} embeddings", *padding_idx,
            num);
  if (!rows.requires_grad()) return rows;
  // The padding places read the row's value without a path for its gradient.
  Tensor padding = unsqueeze(eq(ids, full({}, static_cast<double>(pad), ids.dtype()), loc), -1);
  return where(padding, rows.detach(), rows, loc);
}

Tensor one_hot(const Tensor& ids, int64_t num_classes, DType dtype, const Loc& loc) {
  CallSiteScope site(loc);
  input(ids, "one_hot", loc, "ids");
  check_index_dtype("one_hot", ids, loc);
  if (num_classes <= 0)
    op_fail("one_hot", loc, "num_classes must be positive, got {}", num_classes);
  Tensor classes = arange(num_classes, ids.dtype(), loc);
  return cast(eq(unsqueeze(ids, -1, loc), classes, loc), dtype, loc);
}

Tensor custom_op(const std::vector<Tensor>& inputs,
                 const std::function<Tensor(const std::vector<Tensor>&)>& forward, CustomVjp vjp,
                 const Loc& loc) {
  std::vector<NodePtr> nodes{nullptr};
  std::vector<Tensor> detached;
  for (const Tensor& x : inputs) {
    nodes.push_back(input(x, "custom_op", loc));
    detached.push_back(x.detach());
  }
  if (!forward || !vjp) op_fail("custom_op", loc, "needs both a forward and a vjp function");
  Tensor out;
  {
    NoGradGuard no_grad;
    out = forward(detached);
  }
  if (!out.defined())
    op_fail("custom_op", loc, "the forward function returned an undefined tensor");
  nodes[0] = out.node();
  Attrs attrs;
  attrs.vjp = std::make_shared<CustomVjp>(std::move(vjp));
  return Tensor(
      make_node(OpCode::Custom, out.dtype(), out.shape(), std::move(nodes), std::move(attrs), loc));
}

Tensor gelu_second_derivative(const Tensor& x) {
  // The slope is Phi(x) + x phi(x); its derivative phi(x) (2 - x^2).
  return exp(x * x * -0.5) * 0.3989422804014327 * (2.0 - x * x);
}

Tensor silu_second_derivative(const Tensor& x) {
  // The slope is s (1 + x (1 - s)) with s = sigmoid(x); its derivative s (1 - s) (2 + x (1 - 2s)).
  Tensor s = sigmoid(x);
  return s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s));
}

Tensor gelu_tanh_second_derivative(const Tensor& x) {
  // With u = k (x + c x^3) and t = tanh(u): the slope is 0.5 (1 + t) + 0.5 x (1 - t^2) u', and its
  // derivative (1 - t^2) (u' - x t u'^2 + 3 c k x^2).
  constexpr double k = 0.7978845608028654, c = 0.044715;
  Tensor t = tanh((x + x * x * x * c) * k);
  Tensor du = k * (1.0 + 3.0 * c * x * x);
  return (1.0 - t * t) * (du - x * t * du * du + 3.0 * c * k * x * x);
}

}  // namespace mixtape
