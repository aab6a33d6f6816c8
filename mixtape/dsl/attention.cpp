// mixtape/dsl/attention.cpp -- fused attention's builders and geometry, and the materialized
// composite that is its oracle.
#include "mixtape/dsl/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>

#include "mixtape/dsl/convert.h"
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

Attrs attention_attrs(bool causal, double scale, const AttentionDropout& dropout) {
  Attrs attrs;
  attrs.causal = causal;
  attrs.scale = scale;
  attrs.dropout = dropout.p;
  attrs.seed = dropout.seed;
  return attrs;
}

// p in [0, 1) with an offset where p > 0.
void check_dropout(const char* op, const Loc& loc, const AttentionDropout& dropout) {
  if (!(dropout.p >= 0 && dropout.p < 1))
    op_fail(op, loc, "the dropout probability must be in [0, 1), got {}", dropout.p);
  if (dropout.p > 0 &&
      (!dropout.offset.defined() || dropout.offset.dtype() != i64 || dropout.offset.dim() != 0))
    op_fail(op, loc, "dropout needs its generator's offset as a 0-d i64 tensor, got {}",
            describe(dropout.offset));
}

// The inputs after q, k, v (and out, grad_out): the mask, then the dropout offset.
void add_mask_and_offset(NodeInputs& inputs, const Tensor& mask, const AttentionDropout& dropout) {
  if (mask.defined()) inputs.emplace_back(mask.node());
  if (dropout.p > 0) inputs.emplace_back(dropout.offset.node());
}

}  // namespace

Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                         bool causal, double scale, const AttentionDropout& dropout,
                         const Loc& loc) {
  const char* op = op_name(OpCode::Attention);
  const DType t = checked_operands(op, loc, q, k, v, mask, causal, scale);
  check_dropout(op, loc, dropout);
  NodeInputs inputs;
  for (const Tensor* x : {&q, &k, &v}) inputs.emplace_back(cast(*x, t, loc).node());
  add_mask_and_offset(inputs, mask, dropout);
  return Tensor(make_node(OpCode::Attention, t,
                          with_last_two(batch_of(q.shape()), q.size(-2), v.size(-1)),
                          std::move(inputs), attention_attrs(causal, scale, dropout), loc));
}

Tensor attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& grad_out, const Tensor& mask, bool causal, double scale,
                          const AttentionDropout& dropout, const Loc& loc) {
  const char* op = op_name(OpCode::AttentionBackward);
  DType t = checked_operands(op, loc, q, k, v, mask, causal, scale);
  check_dropout(op, loc, dropout);
  const Shape out_shape = with_last_two(batch_of(q.shape()), q.size(-2), v.size(-1));
  for (const Tensor* x : {&out, &grad_out})
    if (!x->defined() || !is_floating(x->dtype()) || x->shape() != out_shape)
      op_fail(op, loc, "the output and its gradient must be floating {}, got {}",
              to_string(out_shape), describe(*x));
  t = promote(t, promote(out.dtype(), grad_out.dtype()));
  NodeInputs inputs;
  for (const Tensor* x : {&q, &k, &v, &out, &grad_out})
    inputs.emplace_back(cast(*x, t, loc).node());
  add_mask_and_offset(inputs, mask, dropout);
  Shape packed = batch_of(q.shape());
  packed.push_back(q.size(-2) * q.size(-1) + k.size(-2) * (k.size(-1) + v.size(-1)));
  return Tensor(make_node(OpCode::AttentionBackward, t, std::move(packed), std::move(inputs),
                          attention_attrs(causal, scale, dropout), loc));
}

AttentionDropout AttentionDropout::draw(double p, Generator* gen, const Shape& weights) {
  AttentionDropout out;
  if (p == 0) return out;
  Generator& g = gen ? *gen : default_generator();
  out.p = p;
  out.seed = g.seed();
  out.offset = g.draw(static_cast<uint64_t>(numel(weights)));
  return out;
}

AttentionDropout AttentionDropout::of(const Node& node) {
  AttentionDropout out;
  if (node.attrs.dropout == 0) return out;
  out.p = node.attrs.dropout;
  out.seed = node.attrs.seed;
  out.offset = Tensor(node.inputs.back());
  return out;
}

DropoutDraw DropoutDraw::of(const Node& node) {
  DropoutDraw out = decisions(node);
  out.offset = std::bit_cast<uint64_t>(load_element<int64_t>(*node.inputs.back()->value, 0));
  return out;
}

DropoutDraw DropoutDraw::decisions(const Node& node) {
  DropoutDraw out;
  const double p = node.attrs.dropout;
  out.seed = node.attrs.seed;
  // rand's f32 elements are k 2^-24 (k < 2^24), compared with p as an f32 fill holds it.
  out.threshold =
      static_cast<uint32_t>(std::ceil(static_cast<double>(static_cast<float>(p)) * 0x1p24));
  out.p = static_cast<float>(p);
  out.keep_scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
  return out;
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
  g.has_dropout = node.attrs.dropout > 0;
  g.has_mask = node.inputs.size() > mask_input + (g.has_dropout ? 1 : 0);
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
  if (allowed.defined()) {  // a bool mask with batch dims q and k lack widens the scores too
    Shape wide = broadcast_shapes(allowed.shape(), scores.shape()).value();
    allowed = broadcast_to(allowed, wide);
    if (scores.shape() != wide) scores = broadcast_to(scores, wide);
  }
  // A query with no key to attend (every key masked, or -inf by an additive mask, the two
  // together too) attends to nothing: zero weights and zero gradients, as the fused kernels
  // give, not the 0/0 of a softmax over no key. Such a row never reaches the softmax (zeros in
  // its place), whose gradient through it was NaN even where its weights were replaced.
  // (A NaN row stays NaN: a NaN is no -inf.)
  const double inf = std::numeric_limits<double>::infinity();
  Tensor visible = allowed.defined() ? where(allowed, scores, full_like(scores, -inf)) : scores;
  Tensor row_max = max(visible, {-1}, true);
  Tensor some = logical_not(logical_and(isinf(row_max), row_max < 0.0));
  Tensor kept = broadcast_to(some, scores.shape());
  Tensor safe = where(kept, scores, zeros_like(scores));
  Tensor p = allowed.defined() ? masked_softmax(safe, logical_or(allowed, logical_not(kept)))
                               : softmax(safe);
  return where(kept, p, zeros_like(p));
}
}  // namespace

Tensor attention_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                           bool causal, double scale, double dropout_p, Generator* gen) {
  return matmul(dropout(composite_weights(q, k, mask, causal, scale), dropout_p, true, gen), v);
}

// With Z the kept weights' factor (1/(1-p) or 0) and P' = P Z the weights the values meet:
// dV = P'^T dO, dS = P (Z dO V^T - rowsum(P' dO V^T)), the second sum being rowsum(dO O).
std::array<Tensor, 3> attention_gradients(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& mask, bool causal, double scale,
                                          const AttentionDropout& dropout, const Tensor& grad_out) {
  Tensor p = composite_weights(q, k, mask, causal, scale);
  Tensor dp = matmul(grad_out, v, false, true);
  Tensor kept_p = p, kept_dp = dp;
  if (dropout.p > 0) {
    // The forward pass's mask: rand's f32 stream at the node's seed and offset, as dropout().
    Attrs attrs;
    attrs.seed = dropout.seed;
    Tensor u(make_node(OpCode::RandUniform, f32, p.shape(), {dropout.offset.node()}, attrs,
                       Loc::current()));
    Tensor keep = u >= dropout.p;
    const double factor = 1.0 / (1.0 - dropout.p);
    kept_p = where(keep, p * factor, zeros_like(p));
    kept_dp = where(keep, dp * factor, zeros_like(dp));
  }
  Tensor ds = p * (kept_dp - sum(kept_p * dp, {-1}, true));
  return {matmul(ds, k) * scale, matmul(ds, q, true, false) * scale,
          matmul(kept_p, grad_out, true, false)};
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                 std::optional<double> scale, bool fused, const Loc& loc, double dropout_p,
                 Generator* gen) {
  const char* op = "scaled_dot_product_attention";
  if (!(dropout_p >= 0 && dropout_p <= 1))
    op_fail(op, loc, "dropout_p must be in [0, 1], got {}", dropout_p);
  // Causal with more queries than keys or fewer: query i sees keys 0..i, the top-left alignment
  // of PyTorch's is_causal (torch.ones(L, S).tril()), as a mask the kernels take.
  if (causal && q.dim() >= 2 && k.dim() >= 2 && q.size(-2) != k.size(-2)) {
    Tensor lower = causal_mask(q.size(-2), k.size(-2), loc);
    Tensor combined = !mask.defined()           ? lower
                      : mask.dtype() == boolean ? logical_and(mask, lower)
                                                : where(lower, mask, full_like(mask, -INFINITY));
    return attention(q, k, v, combined, false, scale, fused, loc, dropout_p, gen);
  }
  const double factor = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const size_t rank = std::max(std::max(q.dim(), k.dim()), v.dim());
  // dropout_p == 1 zeroes every weight without a draw, as dropout() does.
  if (!fused || dropout_p == 1 ||
      (mask.defined() && (mask.requires_grad() || static_cast<size_t>(mask.dim()) > rank)))
    return attention_composite(q, k, v, mask, causal, factor, dropout_p, gen);
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
  // A mask with batch dims the operands lack ([3, Tq, Tk] beside q [1, Tq, D]) widens the
  // scores: the composite broadcasts it, where the kernels run over the operands' batch.
  if (raised.defined())
    for (size_t d = 0; d < batch->size(); ++d)
      if (raised.size(static_cast<int64_t>(d)) != 1 &&
          raised.size(static_cast<int64_t>(d)) != (*batch)[d])
        return attention_composite(q, k, v, mask, causal, factor, dropout_p, gen);
  const AttentionDropout dropout =
      AttentionDropout::draw(dropout_p, gen, with_last_two(*batch, q.size(-2), k.size(-2)));
  return attention_forward(operand(q), operand(k), operand(v), raised, causal, factor, dropout,
                           loc);
}

}  // namespace detail

}  // namespace mixtape
