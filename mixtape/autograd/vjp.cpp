// mixtape/autograd/vjp.cpp -- gradient rules: pointwise ones come from ops.def, the rest are
// written here.
#include "mixtape/autograd/vjp.h"

#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <string_view>

#include "mixtape/autograd/saved_values.h"
#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/conv.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/vision.h"

namespace mixtape {
namespace {

using Grads = std::vector<Tensor>;

// The forward values a rule reads: through saved_value, which gives the narrower copy a policy
// keeps for the backward pass where it keeps one.
Tensor in(const Node& node, size_t i) { return Tensor(saved_value(node.inputs[i])); }
Tensor out(const Node& node) {
  return Tensor(saved_value(std::const_pointer_cast<Node>(node.shared_from_this())));
}

// Whether a gradient rule of ops.def (its text) reads the identifier `name`: handles to the
// inputs and output it does not read are not made (each is an allocation, and the traced loop
// takes a vjp per node every step).
constexpr bool reads(std::string_view rule, std::string_view name) {
  auto is_word = [](char c) {
    return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
  };
  for (size_t at = rule.find(name); at != std::string_view::npos; at = rule.find(name, at + 1)) {
    size_t end = at + name.size();
    if ((at == 0 || !is_word(rule[at - 1])) && (end == rule.size() || !is_word(rule[end])))
      return true;
  }
  return false;
}
Tensor in_if(bool read, const Node& node, size_t i) { return read ? in(node, i) : Tensor(); }

// Whether input i takes a gradient: the backward pass drops the others' (a constant operand, a
// batch of data), so their nodes are not made at all (the traced loop makes a step's every
// step).
bool wanted(const Node& node, size_t i) { return node.inputs[i]->requires_grad; }

Grads vjp_leaf(const Node&, const Tensor&) { return {}; }
Grads vjp_Constant(const Node& n, const Tensor& g) { return vjp_leaf(n, g); }
Grads vjp_Full(const Node& n, const Tensor& g) { return vjp_leaf(n, g); }
Grads vjp_Arange(const Node& n, const Tensor& g) { return vjp_leaf(n, g); }
Grads vjp_RandUniform(const Node& n, const Tensor& g) { return vjp_leaf(n, g); }
Grads vjp_RandNormal(const Node& n, const Tensor& g) { return vjp_leaf(n, g); }
Grads vjp_Argmax(const Node&, const Tensor&) { return {Tensor()}; }

Grads vjp_Where(const Node& n, const Tensor& g) {
  Tensor cond = in(n, 0), zero = zeros_like(g);
  return {Tensor(), wanted(n, 1) ? where(cond, g, zero) : Tensor(),
          wanted(n, 2) ? where(cond, zero, g) : Tensor()};
}

Grads vjp_Cast(const Node& n, const Tensor& g) {
  DType from = n.inputs[0]->dtype;
  return {is_floating(from) ? cast(g, from) : Tensor()};
}

Grads vjp_CastLike(const Node& n, const Tensor& g) {
  DType from = n.inputs[0]->dtype;
  return {is_floating(from) && wanted(n, 0) ? cast(g, from) : Tensor(), Tensor()};
}

// g of a reduced shape, brought back to the shape of the reduction's input.
Tensor unreduce(const Node& n, const Tensor& g) {
  const Shape& input_shape = n.inputs[0]->shape;
  // Leading axes reduced away come back by broadcasting alone (it adds leading dimensions): no
  // reshape node, as for a full reduction to a scalar. The index map is the same.
  const size_t leading = input_shape.size() - g.shape().size();
  bool only_leading = !n.attrs.keepdim && n.attrs.axes.size() == leading;
  for (size_t i = 0; only_leading && i < n.attrs.axes.size(); ++i)
    only_leading = n.attrs.axes[i] == static_cast<int64_t>(i);
  if (only_leading) return broadcast_to(g, input_shape);
  Shape kept = input_shape;
  for (int64_t axis : n.attrs.axes) kept[axis] = 1;
  return broadcast_to(reshape(g, kept), input_shape);
}

Grads vjp_Sum(const Node& n, const Tensor& g) { return {unreduce(n, g)}; }

// The gradient goes to the elements equal to the maximum, shared evenly between ties. Compared
// in the type the maximum is stored in: a policy may store it narrower than its input (pure bf16
// of an f32 value), and the rounded maximum then equalled no element.
Grads vjp_Max(const Node& n, const Tensor& g) {
  Tensor x = in(n, 0);
  Shape kept = x.shape();
  for (int64_t axis : n.attrs.axes) kept[axis] = 1;
  Tensor max = broadcast_to(reshape(out(n), kept), x.shape());
  Tensor is_max = eq(cast_like(x, max), max);
  Tensor count = sum(cast(is_max, x.dtype()), n.attrs.axes, true);
  Tensor share = broadcast_to(reshape(g, kept) / count, x.shape());
  // A NaN maximum equals no element: its group's gradient is NaN, as torch.amax's (0 / 0), not
  // zeros that hid the NaN from a loss scaler's check of the gradients.
  Tensor nan_share = share * 0.0;  // g / 0 times 0
  return {where(is_max, share, where(isnan(max), nan_share, zeros_like(share)))};
}

// ---- scans (attrs: axis, reverse) ----
// A running sum's gradient is the running sum of g from the other end.
Grads vjp_Cumsum(const Node& n, const Tensor& g) {
  return {cumulative(OpCode::Cumsum, g, n.attrs.axis, !n.attrs.reverse)};
}

// d out[j] / d x[k] = prod of x[i], i <= j, i != k (in the scan's direction). Written without
// dividing by x, as PyTorch's cumprod_backward, so that zeros get their true gradient: before
// the first zero of a line it is the running sum of g y from the end over x; at the first zero,
// the running sum over the outputs from there on of g times the products with that zero taken
// as 1; after it, zero (every product holds the first zero). Differentiable again, exactly away
// from zeros (at a zero, the dropped terms' derivatives in x are not 0 though their values are).
Grads vjp_Cumprod(const Node& n, const Tensor& g) {
  Tensor x = in(n, 0), y = out(n);
  const int64_t axis = n.attrs.axis;
  const bool reverse = n.attrs.reverse;
  Tensor zero = zeros_like(x), one = ones_like(x);
  Tensor zeros_so_far = cumulative(OpCode::Cumsum, cast(eq(x, zero), x.dtype()), axis, reverse);
  Tensor before = eq(zeros_so_far, zero);
  Tensor first = eq(where(eq(x, zero), zeros_so_far, zero), one);
  Tensor before_grad = cumulative(OpCode::Cumsum, where(before, g * y, zero), axis, !reverse) /
                       where(before, x, one);
  Tensor y_without_first = cumulative(OpCode::Cumprod, where(first, one, x), axis, reverse);
  Tensor first_grad =
      cumulative(OpCode::Cumsum, where(before, zero, g * y_without_first), axis, !reverse);
  return {where(before, before_grad, where(first, first_grad, zero))};
}

// sum over j >= k of g[j] exp(x[k] - y[j]), with g split by sign so that each part is a
// logcumsumexp from the other end of log|g| - y: PyTorch's logcumsumexp_backward.
Grads vjp_Logcumsumexp(const Node& n, const Tensor& g) {
  Tensor x = in(n, 0), y = out(n);
  const int64_t axis = n.attrs.axis;
  const bool reverse = n.attrs.reverse;
  // The lowest finite value, not -inf, where g has the other sign: log|g| - y stays finite
  // (not -inf - -inf) where y is -inf.
  Tensor log_abs = log(abs(g)), lowest = full_like(g, -largest_finite(g.dtype()));
  Tensor zero = zeros_like(g);
  auto part = [&](const Tensor& log_g) {
    return exp(cumulative(OpCode::Logcumsumexp, log_g - y, axis, !reverse) + x);
  };
  return {part(where(g > zero, log_abs, lowest)) - part(where(g < zero, log_abs, lowest))};
}

Grads vjp_Argsort(const Node&, const Tensor&) { return {Tensor()}; }

// Every process's output is the sum of every process's input, so each input's gradient is the
// sum of every output's.
Grads vjp_AllReduce(const Node&, const Tensor& g) { return {all_reduce(g)}; }
// Process r's output is the sum of every input's chunk r, so every input's chunk r gets process
// r's output gradient: the gradients gathered. And the other way round.
Grads vjp_ReduceScatter(const Node&, const Tensor& g) { return {all_gather(g)}; }
Grads vjp_AllGather(const Node&, const Tensor& g) { return {reduce_scatter(g)}; }

Grads vjp_MatMul(const Node& n, const Tensor& g) {
  Tensor a = in(n, 0), b = in(n, 1);
  bool ta = n.attrs.transpose_a, tb = n.attrs.transpose_b;
  Tensor ga, gb;
  if (wanted(n, 0)) ga = ta ? matmul(b, g, tb, true) : matmul(g, b, false, !tb);
  if (wanted(n, 1)) gb = tb ? matmul(g, a, true, ta) : matmul(a, g, !ta, false);
  return {ga, gb};
}

// Each convolution primitive is linear in both inputs, and its gradients are the other two.
Grads vjp_Conv2d(const Node& n, const Tensor& g) {
  Tensor x = in(n, 0), w = in(n, 1);
  ConvWindow window = ConvWindow::from(n.attrs.window);
  return {wanted(n, 0) ? conv2d_input_grad(g, w, x.shape(), window) : Tensor(),
          wanted(n, 1) ? conv2d_weight_grad(x, g, w.shape(), window) : Tensor()};
}
Grads vjp_Conv2dInputGrad(const Node& n, const Tensor& g) {
  Tensor gy = in(n, 0), w = in(n, 1);
  ConvWindow window = ConvWindow::from(n.attrs.window);
  return {wanted(n, 0) ? conv2d_forward(g, w, window) : Tensor(),
          wanted(n, 1) ? conv2d_weight_grad(g, gy, w.shape(), window) : Tensor()};
}
Grads vjp_Conv2dWeightGrad(const Node& n, const Tensor& g) {
  Tensor x = in(n, 0), gy = in(n, 1);
  ConvWindow window = ConvWindow::from(n.attrs.window);
  return {wanted(n, 0) ? conv2d_input_grad(gy, g, x.shape(), window) : Tensor(),
          wanted(n, 1) ? conv2d_forward(x, g, window) : Tensor()};
}

// max_pool2d_grad is linear in gy (a scatter to the windows' picks): its adjoint gathers the
// picks; in x it is piecewise constant (zero almost everywhere, as PyTorch has it).
Grads vjp_MaxPool2d(const Node& n, const Tensor& g) {
  return {max_pool2d_grad(in(n, 0), g, PoolWindow::from(n.attrs.window))};
}
Grads vjp_MaxPool2dGrad(const Node& n, const Tensor& g) {
  Tensor x = in(n, 0), gy = in(n, 1);
  return {wanted(n, 0) ? zeros_like(x) : Tensor(),
          wanted(n, 1) ? detail::max_pool2d_pick(x, g, PoolWindow::from(n.attrs.window),
                                                 {gy.size(2), gy.size(3)})
                       : Tensor()};
}

// Without a graph to build, the fused gradient (packed q, k, v gradients, cut apart here);
// with one (create_graph), the materialized gradient, whose own gradient exists.
Grads vjp_Attention(const Node& n, const Tensor& g) {
  Tensor q = in(n, 0), k = in(n, 1), v = in(n, 2);
  const AttentionDropout dropout = AttentionDropout::of(n);
  Tensor mask = AttentionGeometry::of(n).has_mask ? in(n, 3) : Tensor();
  std::array<Tensor, 3> grads;
  if (grad_enabled()) {
    grads = detail::attention_gradients(q, k, v, mask, n.attrs.causal, n.attrs.scale, dropout, g);
  } else {
    Tensor packed =
        attention_backward(q, k, v, out(n), g, mask, n.attrs.causal, n.attrs.scale, dropout);
    const int64_t axis = packed.dim() - 1;
    int64_t start = 0;
    for (size_t i = 0; i < 3; ++i) {
      const Shape& shape = n.inputs[i]->shape;
      const int64_t size = shape[shape.size() - 2] * shape.back();
      grads[i] = reshape(slice(packed, axis, start, start + size), shape);
      start += size;
    }
  }
  Grads result;
  for (size_t i = 0; i < 3; ++i) result.push_back(wanted(n, i) ? grads[i] : Tensor());
  if (mask.defined()) result.push_back(Tensor());  // a mask that takes a gradient is refused
  if (dropout.p > 0) result.push_back(Tensor());   // the generator's offset
  return result;
}
Grads vjp_AttentionBackward(const Node& n, const Tensor&) {
  return Grads(n.inputs.size());  // never called: the op table marks it without gradient
}

Grads vjp_Reshape(const Node& n, const Tensor& g) { return {reshape(g, n.inputs[0]->shape)}; }

Grads vjp_Permute(const Node& n, const Tensor& g) {
  std::vector<int64_t> inverse(n.attrs.axes.size());
  for (size_t i = 0; i < inverse.size(); ++i) inverse[n.attrs.axes[i]] = static_cast<int64_t>(i);
  return {permute(g, inverse)};
}

Grads vjp_BroadcastTo(const Node& n, const Tensor& g) {
  const Shape& from = n.inputs[0]->shape;
  size_t lead = n.shape.size() - from.size();
  std::vector<int64_t> axes;
  for (size_t d = 0; d < n.shape.size(); ++d)
    if (d < lead || (from[d - lead] == 1 && n.shape[d] != 1))
      axes.push_back(static_cast<int64_t>(d));
  return {reshape(sum(g, axes, false), from)};
}

Grads vjp_Slice(const Node& n, const Tensor& g) {
  return {unslice(g, n.attrs.starts, n.attrs.steps, n.inputs[0]->shape)};
}

Grads vjp_Unslice(const Node& n, const Tensor& g) {
  return {slice(g, n.attrs.starts, n.attrs.steps, n.inputs[0]->shape)};
}

Grads vjp_Concat(const Node& n, const Tensor& g) {
  Grads grads;
  int64_t start = 0, axis = n.attrs.axis;
  for (const NodePtr& input : n.inputs) {
    int64_t size = input->shape[axis];
    grads.push_back(slice(g, axis, start, start + size));
    start += size;
  }
  return grads;
}

Grads vjp_IndexSelect(const Node& n, const Tensor& g) {
  return {index_add(zeros_like(in(n, 0)), in(n, 1), g, n.attrs.axis), Tensor()};
}

Grads vjp_Check(const Node&, const Tensor& g) { return {g, Tensor()}; }

Grads vjp_IndexAdd(const Node& n, const Tensor& g) {
  return {g, Tensor(), index_select(g, in(n, 1), n.attrs.axis)};
}

Grads vjp_Gather(const Node& n, const Tensor& g) {
  return {scatter_add(zeros_like(in(n, 0)), in(n, 1), g, n.attrs.axis), Tensor()};
}

Grads vjp_ScatterAdd(const Node& n, const Tensor& g) {
  return {g, Tensor(), gather(g, in(n, 1), n.attrs.axis)};
}

// The written positions take nothing from base; each source element gets the gradient at the
// position it was written to, as PyTorch's (a repeated position gives every writer its gradient).
Grads vjp_Scatter(const Node& n, const Tensor& g) {
  Tensor index = in(n, 1);
  return {scatter(g, n.attrs.axis, index, zeros_like(in(n, 2))), Tensor(),
          gather(g, index, n.attrs.axis)};
}

Grads vjp_Custom(const Node& n, const Tensor& g) {
  std::vector<Tensor> inputs;
  for (size_t i = 1; i < n.inputs.size(); ++i) inputs.push_back(in(n, i));
  Grads user = (*n.attrs.vjp)(inputs, out(n), g);
  if (user.size() != inputs.size())
    op_fail("custom_op", n.origin.location, "the vjp returned {} gradients for {} inputs",
            user.size(), inputs.size());
  Grads grads{Tensor()};
  for (size_t i = 0; i < user.size(); ++i) {
    if (user[i].defined() && user[i].shape() != inputs[i].shape())
      op_fail("custom_op", n.origin.location,
              "the vjp's gradient {} has shape {}, the input has {}", i, to_string(user[i].shape()),
              to_string(inputs[i].shape()));
    grads.push_back(user[i]);
  }
  return grads;
}

constexpr ValueReads read_if(bool reads) { return reads ? ValueReads::Other : ValueReads::None; }

constexpr GradientReads reads_of_kind(OpKind kind) {
  switch (kind) {
    case OpKind::Leaf:
    case OpKind::View:
    case OpKind::Copy:
    case OpKind::Gather:  // the indices, which are no floating values
      return {ValueReads::None, ValueReads::None};
    case OpKind::MatMul:
    case OpKind::Conv:
      return {ValueReads::AsProduct, ValueReads::AsProduct};
    case OpKind::Attention:  // q, k and v are products' operands; the mask is not
      return {ValueReads::AsProduct, ValueReads::AsProduct, 3};
    default:
      return {ValueReads::Other, ValueReads::Other};
  }
}

}  // namespace

GradientReads gradient_reads(OpCode op) {
  switch (op) {
#define MT_OP(Name, fname, kind, arity, category) \
  case OpCode::Name:                              \
    return reads_of_kind(OpKind::kind);
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  case OpCode::Name:                                      \
    return {read_if(reads(#VJP, "x")), read_if(reads(#VJP, "y"))};
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1)                     \
  case OpCode::Name:                                                                  \
    return {read_if(reads(#VJP0, "x0") || reads(#VJP0, "x1") || reads(#VJP1, "x0") || \
                    reads(#VJP1, "x1")),                                              \
            read_if(reads(#VJP0, "y") || reads(#VJP1, "y"))};
#define MT_COMPARE(Name, fname, REF) \
  case OpCode::Name:                 \
    return {ValueReads::None, ValueReads::None};
#define MT_FUSED(Name, fname, arity, REF) \
  case OpCode::Name:                      \
    return {ValueReads::None, ValueReads::None};
#include "mixtape/dsl/ops.def"
  }
  fail("gradient_reads: unknown op code {}", static_cast<int>(op));
}

std::vector<Tensor> vjp(const NodePtr& node, const Tensor& g) {
  const Node& n = *node;
  switch (n.op) {
#define MT_OP(Name, fname, kind, arity, category) \
  case OpCode::Name:                              \
    return vjp_##Name(n, g);
#define MT_UNARY(Name, fname, category, domain, REF, VJP)                \
  case OpCode::Name: {                                                   \
    constexpr bool read_x = reads(#VJP, "x"), read_y = reads(#VJP, "y"); \
    Tensor x = in_if(read_x, n, 0);                                      \
    Tensor y = read_y ? out(n) : Tensor();                               \
    (void)x;                                                             \
    (void)y;                                                             \
    return {VJP};                                                        \
  }
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1)                            \
  case OpCode::Name: {                                                                       \
    constexpr bool read_x0 = reads(#VJP0, "x0") || reads(#VJP1, "x0");                       \
    constexpr bool read_x1 = reads(#VJP0, "x1") || reads(#VJP1, "x1");                       \
    constexpr bool read_y = reads(#VJP0, "y") || reads(#VJP1, "y");                          \
    Tensor x0 = in_if(read_x0, n, 0), x1 = in_if(read_x1, n, 1);                             \
    Tensor y = read_y ? out(n) : Tensor();                                                   \
    (void)x0;                                                                                \
    (void)x1;                                                                                \
    (void)y;                                                                                 \
    return {wanted(n, 0) ? Tensor(VJP0) : Tensor(), wanted(n, 1) ? Tensor(VJP1) : Tensor()}; \
  }
#define MT_COMPARE(Name, fname, REF) \
  case OpCode::Name:                 \
    return {Tensor(), Tensor()};
#define MT_FUSED(Name, fname, arity, REF) \
  case OpCode::Name:                      \
    return std::vector<Tensor>(arity);
// An op whose result never requires grad has no gradient to give.
#define NoGradient Tensor()
#include "mixtape/dsl/ops.def"
#undef NoGradient
  }
  fail("vjp: unknown op code {}", static_cast<int>(n.op));
}

}  // namespace mixtape
