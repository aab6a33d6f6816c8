// mixtape/dsl/attention.cpp -- fused attention's builders and geometry, and the materialized
// composite that is its oracle.
#include "mixtape/dsl/attention.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"

namespace mixtape {
namespace {

Shape batch_of(const Shape& shape) { return Shape(shape.begin(), shape.end() - 2); }

Shape with_last_two(Shape shape, int64_t rows, int64_t cols) {
  shape.push_back(rows);
  shape.push_back(cols);
  return shape;
}

std::string describe(const Tensor& t) {
  return t.defined() ? std::string(name(t.dtype())) + " " + to_string(t.shape())
                     : std::string("an undefined tensor");
}

// The checks both primitives share; returns the common dtype.
DType checked_operands(const char* op, const Loc& loc, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& mask, bool causal, double scale) {
  for (const Tensor* t : {&q, &k, &v})
    if (!t->defined() || !is_floating(t->dtype()) || t->dim() < 2)
      op_fail(op, loc, "query, key and value must be floating tensors of rank >= 2, got {}",
              describe(*t));
  if (q.size(-1) != k.size(-1) || k.size(-2) != v.size(-2) || q.dim() != k.dim() ||
      k.dim() != v.dim() || batch_of(q.shape()) != batch_of(k.shape()) ||
      batch_of(k.shape()) != batch_of(v.shape()))
    op_fail(op, loc, "shapes q {} k {} v {} do not fit (one batch shape, q and k of one depth)",
            to_string(q.shape()), to_string(k.shape()), to_string(v.shape()));
  if (causal && q.size(-2) != k.size(-2))
    op_fail(op, loc, "a causal mask needs as many queries as keys: q {} k {}", to_string(q.shape()),
            to_string(k.shape()));
  if (!std::isfinite(scale)) op_fail(op, loc, "the scale {} is not finite", scale);
  if (mask.defined()) {
    const Shape scores = with_last_two(batch_of(q.shape()), q.size(-2), k.size(-2));
    bool fits = mask.dim() == static_cast<int64_t>(scores.size());
    for (size_t d = 0; fits && d < scores.size(); ++d)
      fits = mask.shape()[d] == 1 || mask.shape()[d] == scores[d];
    if (!fits)
      op_fail(op, loc, "the mask {} must have the scores' rank and each dim 1 or the scores' {}",
              to_string(mask.shape()), to_string(scores));
    if (mask.dtype() != boolean && !is_floating(mask.dtype()))
      op_fail(op, loc, "the mask must be bool or floating, got {}", name(mask.dtype()));
    if (mask.requires_grad())
      op_fail(op, loc, "a mask that requires grad has no fused gradient (use the composite)");
  }
  return promote(promote(q.dtype(), k.dtype()), v.dtype());
}

Attrs attention_attrs(bool causal, double scale) {
  Attrs attrs;
  attrs.causal = causal;
  attrs.scale = scale;
  return attrs;
}

}  // namespace

Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                         bool causal, double scale, const Loc& loc) {
  const char* op = op_name(OpCode::Attention);
  const DType t = checked_operands(op, loc, q, k, v, mask, causal, scale);
  NodeInputs inputs;
  for (const Tensor* x : {&q, &k, &v}) inputs.emplace_back(cast(*x, t, loc).node());
  if (mask.defined()) inputs.emplace_back(mask.node());
  return Tensor(make_node(OpCode::Attention, t,
                          with_last_two(batch_of(q.shape()), q.size(-2), v.size(-1)),
                          std::move(inputs), attention_attrs(causal, scale), loc));
}

Tensor attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& grad_out, const Tensor& mask, bool causal, double scale,
                          const Loc& loc) {
  const char* op = op_name(OpCode::AttentionBackward);
  DType t = checked_operands(op, loc, q, k, v, mask, causal, scale);
  const Shape out_shape = with_last_two(batch_of(q.shape()), q.size(-2), v.size(-1));
  for (const Tensor* x : {&out, &grad_out})
    if (!x->defined() || !is_floating(x->dtype()) || x->shape() != out_shape)
      op_fail(op, loc, "the output and its gradient must be floating {}, got {}",
              to_string(out_shape), describe(*x));
  t = promote(t, promote(out.dtype(), grad_out.dtype()));
  NodeInputs inputs;
  for (const Tensor* x : {&q, &k, &v, &out, &grad_out})
    inputs.emplace_back(cast(*x, t, loc).node());
  if (mask.defined()) inputs.emplace_back(mask.node());
  Shape packed = batch_of(q.shape());
  packed.push_back(q.size(-2) * q.size(-1) + k.size(-2) * (k.size(-1) + v.size(-1)));
  return Tensor(make_node(OpCode::AttentionBackward, t, std::move(packed), std::move(inputs),
                          attention_attrs(causal, scale), loc));
}

AttentionGeometry AttentionGeometry::of(const Node& node) {
  const Shape& q = node.inputs[0]->shape;
  const Shape& v = node.inputs[2]->shape;
  AttentionGeometry g;
  const size_t rank = q.size();
  for (size_t d = 0; d + 2 < rank; ++d) g.batch *= q[d];
  g.tq = q[rank - 2];
  g.d = q[rank - 1];
  g.tk = v[rank - 2];
  g.dv = v[rank - 1];
  g.causal = node.attrs.causal;
  g.scale = node.attrs.scale;
  const size_t mask_input = node.op == OpCode::Attention ? 3 : 5;
  g.has_mask = node.inputs.size() > mask_input;
  if (!g.has_mask) return g;
  const Node& mask = *node.inputs[mask_input];
  g.bool_mask = mask.dtype == boolean;
  // Row-major strides of the mask, 0 along its broadcast (size-1) dims.
  std::vector<int64_t> stride(rank, 0);
  int64_t step = 1;
  for (size_t d = rank; d-- > 0;) {
    stride[d] = mask.shape[d] == 1 ? 0 : step;
    step *= mask.shape[d];
  }
  g.mask_col_stride = stride[rank - 1];
  g.mask_row_stride = stride[rank - 2];
  g.mask_batch_offset.assign(static_cast<size_t>(g.batch), 0);
  for (int64_t b = 0; b < g.batch; ++b) {
    int64_t rest = b, offset = 0;
    for (size_t d = rank - 2; d-- > 0;) {
      offset += (rest % q[d]) * stride[d];
      rest /= q[d];
    }
    g.mask_batch_offset[static_cast<size_t>(b)] = offset;
  }
  return g;
}

namespace detail {

namespace {
// The softmax weights of the composite, [.., Tq, Tk].
Tensor composite_weights(const Tensor& q, const Tensor& k, const Tensor& mask, bool causal,
                         double scale) {
  Tensor scores = matmul(q, k, false, true) * scale;
  Tensor allowed;  // bool, true where a query may attend
  if (mask.defined()) {
    if (mask.dtype() == boolean)
      allowed = mask;
    else
      scores = scores + mask;
  }
  if (causal) {
    Tensor lower = causal_mask(q.size(-2));
    allowed = allowed.defined() ? logical_and(allowed, lower) : lower;
  }
  if (!allowed.defined()) return softmax(scores);
  return masked_softmax(
      scores, broadcast_to(allowed, broadcast_shapes(allowed.shape(), scores.shape()).value()));
}
}  // namespace

Tensor attention_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                           bool causal, double scale) {
  return matmul(composite_weights(q, k, mask, causal, scale), v);
}

std::array<Tensor, 3> attention_gradients(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& mask, bool causal, double scale,
                                          const Tensor& grad_out) {
  Tensor p = composite_weights(q, k, mask, causal, scale);
  Tensor dp = matmul(grad_out, v, false, true);
  Tensor ds = p * (dp - sum(p * dp, {-1}, true));
  return {matmul(ds, k) * scale, matmul(ds, q, true, false) * scale,
          matmul(p, grad_out, true, false)};
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                 std::optional<double> scale, bool fused, const Loc& loc) {
  const char* op = "scaled_dot_product_attention";
  const double factor = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const size_t rank = std::max(std::max(q.dim(), k.dim()), v.dim());
  if (!fused ||
      (mask.defined() && (mask.requires_grad() || static_cast<size_t>(mask.dim()) > rank)))
    return attention_composite(q, k, v, mask, causal, factor);
  auto batch = broadcast_shapes(batch_of(q.shape()), batch_of(k.shape()));
  if (batch) batch = broadcast_shapes(*batch, batch_of(v.shape()));
  if (!batch)
    op_fail(op, loc, "the batch dims of q {} k {} v {} do not broadcast", to_string(q.shape()),
            to_string(k.shape()), to_string(v.shape()));
  const DType t = promote(promote(q.dtype(), k.dtype()), v.dtype());
  auto operand = [&](const Tensor& x) {
    Tensor typed = cast(x, t, loc);  // x itself where it has the type
    Shape shape = with_last_two(*batch, x.size(-2), x.size(-1));
    return typed.shape() == shape ? typed : broadcast_to(typed, shape, loc);
  };
  Tensor raised = mask;  // the mask at the scores' rank
  if (mask.defined() && static_cast<size_t>(mask.dim()) < rank) {
    Shape shape(rank - static_cast<size_t>(mask.dim()), 1);
    shape.insert(shape.end(), mask.shape().begin(), mask.shape().end());
    raised = reshape(mask, shape, loc);
  }
  return attention_forward(operand(q), operand(k), operand(v), raised, causal, factor, loc);
}

}  // namespace detail

}  // namespace mixtape
