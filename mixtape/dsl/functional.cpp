// mixtape/dsl/functional.cpp -- composites over primitives: they get gradients, precision and
// fusion free.
#include "mixtape/dsl/functional.h"

#include <fmt/ranges.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>

#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/constant_cache.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/operand_checks.h"

namespace mixtape {
namespace {

// 0, 1, ..., n - 1 as a constant, kept: every step's one-hot compare reads the same buffer.
Tensor class_indices(int64_t n, DType dtype) {
  return cached_constant(fmt::format("class indices {} {}", n, name(dtype)), [&] {
    std::vector<int64_t> values(static_cast<size_t>(n));
    std::iota(values.begin(), values.end(), int64_t{0});
    return tensor(values, {n}, dtype);
  });
}

// Checked here so that a bad axis is reported as the caller's op, not as the max inside it.
void check_axes(const Tensor& x, const std::vector<int64_t>& axes, const char* op, const Loc& loc) {
  for (int64_t axis : axes)
    if (axis < -x.dim() || axis >= x.dim())
      op_fail(op, loc, "axis {} is out of range for shape {}", axis, to_string(x.shape()));
}

// The per-row shift that keeps exp() from overflowing; constant for gradients, and 0 for rows
// that are entirely -inf so that they give -inf / NaN as the math says rather than NaN early. A
// row holding +inf keeps it as its shift, so that softmax and log_softmax make it NaN, as
// PyTorch's; `infinite_rows_unshifted` shifts it by 0 instead, for the log-sum-exp, which is inf
// there (as torch.logsumexp).
Tensor stable_shift(const Tensor& x, const std::vector<int64_t>& axes, const Loc& loc,
                    bool infinite_rows_unshifted = false) {
  Tensor m = max(x, axes, true, loc);
  if (m.requires_grad()) m = m.detach();  // inside a custom op's forward it never does
  constexpr double inf = std::numeric_limits<double>::infinity();
  return where(infinite_rows_unshifted ? abs(m) < inf : m > -inf, m, zeros_like(m), loc);
}

// Softmax and log_softmax take PyTorch's gradients, which read only the output: softmax's
// y (g - sum(g y)) and log_softmax's g - exp(y) sum(g). The composites' own gradients would keep
// exp(x - max) and the broadcast row sums for the backward pass, and take more passes over them.
// Without a gradient to take they are the composites alone. A mask is applied inside (-inf where
// it is false), so that the masked scores are not kept either; masked places get a zero
// gradient, as where()'s would give them. The mask is an input of the op rather than a value
// the vjp captures, so that in a checkpointed module (autograd/recompute.h) the vjp reads the
// recomputed mask, as it reads the recomputed output: the graph around the recomputation is then
// the forward pass's, and so are its kernels and bits.
Tensor softmax_of(const Tensor& x, const Tensor& mask, int64_t axis, const Loc& loc) {
  const DType type = composite::statistics_type(x.dtype());
  auto forward = [&](const std::vector<Tensor>& in) {
    Tensor scores = cast(in[0], type);
    if (in.size() > 1)
      scores = where(in[1], scores, full_like(scores, -std::numeric_limits<double>::infinity()));
    Tensor e = exp(scores - stable_shift(scores, {axis}, loc));
    return cast(e / sum(e, {axis}, true), x.dtype());
  };
  std::vector<Tensor> inputs{x};
  if (mask.defined()) inputs.push_back(mask);
  if (!grad_enabled() || !x.requires_grad()) return forward(inputs);
  return custom_op(
      inputs, forward,
      [axis, type](const std::vector<Tensor>& in, const Tensor& y_in, const Tensor& g_in) {
        Tensor y = cast(y_in, type), g = cast(g_in, type);
        Tensor dx = y * (g - sum(g * y, {axis}, true));
        if (in.size() == 1) return std::vector<Tensor>{dx};
        // Masked places get a zero gradient even in a row that is all masked (whose y is NaN).
        return std::vector<Tensor>{where(in[1], dx, zeros_like(dx)), Tensor()};
      },
      loc);
}

// Each row's max over `axes` (stable_shift) and the log of the sum of exp(x - max) there, kept
// dims: the log-sum-exp is their sum, and log p is (x - max) - log_norm.
struct RowStatistics {
  Tensor shift, log_norm;
};
// `infinite_rows_unshifted`: stable_shift's, true for the log-sum-exp (inf for a +inf row),
// false for log-probabilities (NaN there, as log_softmax's and PyTorch's).
RowStatistics row_statistics(const Tensor& x, const std::vector<int64_t>& axes, const Loc& loc,
                             bool infinite_rows_unshifted) {
  Tensor shift = stable_shift(x, axes, loc, infinite_rows_unshifted);
  return {shift, log(sum(exp(x - shift), axes, true))};
}

// log(sum(exp(x))) over `axes`. Its gradient is PyTorch's, g exp(x - y), which reads only the
// input and the result: the composite's own would keep exp(x - max) for the backward pass. The
// op's result is the one returned (reshaped inside when the axes are dropped), so that a caller
// who evaluates it keeps what the gradient reads.
Tensor logsumexp_of(const Tensor& x, const std::vector<int64_t>& axes, bool keepdim,
                    const Loc& loc) {
  std::vector<int64_t> reduced;
  for (int64_t a : axes) reduced.push_back(a < 0 ? a + x.dim() : a);
  const Shape kept = reduced_shape(x.shape(), reduced, true);
  const DType type = composite::statistics_type(x.dtype());
  auto forward = [&](const std::vector<Tensor>& in) {
    RowStatistics rows = row_statistics(cast(in[0], type), axes, loc, true);
    Tensor result = cast(rows.log_norm + rows.shift, x.dtype());
    return keepdim ? result : reshape(result, reduced_shape(x.shape(), reduced, false));
  };
  if (!grad_enabled() || !x.requires_grad()) return forward({x});
  return custom_op(
      {x}, forward,
      [kept, type, axes, loc](const std::vector<Tensor>& in, const Tensor& y, const Tensor& g) {
        Tensor v = cast(in[0], type), result = cast(reshape(y, kept), type);
        // A result rounded to a half type is read again in f32: rounded, the log-sum-exp of
        // rows near 1000 is off by up to half a unit of 4 or 8, and its gradient by a factor
        // e^2 or e^4 (PyTorch's reads the rounded one).
        if (v.dtype() != in[0].dtype()) {
          RowStatistics rows = row_statistics(v, axes, loc, true);
          result = rows.log_norm + rows.shift;
        }
        return std::vector<Tensor>{cast(reshape(g, kept), type) * exp(v - result)};
      },
      loc);
}

// Where each row's class is its id: [..., C] bools for scores [..., C] and ids [...] (already
// checked to be in range).
Tensor class_hits(const Tensor& scores, const Tensor& ids) {
  return eq(class_indices(scores.size(-1), ids.dtype()), unsqueeze(ids, -1));
}

// Each row's value at its class, as a masked sum over the classes, not a gather: it joins the
// kernel that reads the row, and its gradient is pointwise where a gather's is a scatter into a
// [rows, classes] zero tensor (for a 50k vocabulary, most of a step). Exact: one term is the
// value, the others are +0.
Tensor masked_pick(const Tensor& hits, const Tensor& values) {
  return sum(where(hits, values, zeros_like(values)), {-1});
}

// masked_pick of `values` at `ids`, whose gradient compares the classes with the ids again
// rather than reading the forward pass's [rows, classes] mask, which would be kept for it.
Tensor pick_class(const Tensor& values, const Tensor& ids) {
  auto forward = [](const std::vector<Tensor>& in) {
    return masked_pick(class_hits(in[0], in[1]), in[0]);
  };
  if (!grad_enabled() || !values.requires_grad()) return forward({values, ids});
  return custom_op(
      {values, ids}, forward, [](const std::vector<Tensor>& in, const Tensor&, const Tensor& g) {
        Tensor row = broadcast_to(unsqueeze(g, -1), in[0].shape());
        return std::vector<Tensor>{where(class_hits(in[0], in[1]), row, zeros_like(row)), Tensor()};
      });
}

// layer_norm's and rms_norm's op: x over `axes` (centered first where `center`), divided by its
// root mean square there (+ eps), times the weight and plus the bias where given. The backward
// pass keeps x alone, as PyTorch's does (which keeps the row statistics too): the gradient
// computes each row's statistics again, and the weight's gradient its own normalized rows from
// them, so that neither the centered nor the normalized rows are kept, nor passed between
// kernels.
Tensor normalized_rows(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                       const std::vector<int64_t>& axes, bool center, const Loc& loc) {
  std::vector<int64_t> leading;
  for (int64_t d = 0; d < x.dim() - static_cast<int64_t>(axes.size()); ++d) leading.push_back(d);
  // Inputs: x, then the weight and the bias where given.
  const bool weighted = weight.defined(), biased = bias.defined();
  std::vector<Tensor> inputs{x};
  if (weighted) inputs.push_back(weight);
  if (biased) inputs.push_back(bias);
  // Computed in the statistics type, the result in the type the inputs promote to.
  const DType type = composite::statistics_type(x.dtype());
  DType result_type = x.dtype();
  for (const Tensor& t : inputs) result_type = promote(result_type, t.dtype());
  auto forward = [=](const std::vector<Tensor>& in) {
    Tensor v = cast(in[0], type);
    Tensor centered = center ? v - mean(v, axes, true) : v;
    Tensor y = centered * rsqrt(mean(square(centered), axes, true) + eps);
    if (weighted) y = y * in[1];
    if (biased) y = y + in[weighted ? 2 : 1];
    return cast(y, result_type);
  };
  const bool any_grad =
      std::any_of(inputs.begin(), inputs.end(), [](const Tensor& t) { return t.requires_grad(); });
  if (!grad_enabled() || !any_grad) return forward(inputs);
  return custom_op(
      inputs, forward,
      [=](const std::vector<Tensor>& in, const Tensor&, const Tensor& g_in) {
        Tensor v = cast(in[0], type), g = cast(g_in, type);
        Tensor mu = center ? mean(v, axes, true) : Tensor();
        // Made twice: the input gradient's kernel and the weight gradient's (a sum over the rows,
        // another loop nest) each compute their own.
        auto centered = [&] { return center ? v - mu : v; };
        Tensor c = centered();
        Tensor r = rsqrt(mean(square(c), axes, true) + eps);
        Tensor xhat = c * r;
        Tensor gw = weighted ? g * in[1] : g;
        Tensor row_terms = center ? gw - mean(gw, axes, true) : gw;
        std::vector<Tensor> grads{r * (row_terms - xhat * mean(gw * xhat, axes, true))};
        auto over_rows = [&](const Tensor& t) { return leading.empty() ? t : sum(t, leading); };
        if (weighted) grads.push_back(over_rows(g * (centered() * r)));
        if (biased) grads.push_back(over_rows(g));
        return grads;
      },
      loc);
}

Tensor reduce(const Tensor& loss, Reduction reduction) {
  switch (reduction) {
    case Reduction::None:
      return loss;
    case Reduction::Sum:
      return sum(loss);
    case Reduction::Mean:
      return mean(loss);
    case Reduction::BatchMean:  // kl_div's: the sum over the batch size (all of a 0-d input)
      return loss.dim() == 0 ? sum(loss) : sum(loss) * (1.0 / static_cast<double>(loss.size(0)));
  }
  return loss;
}

// PyTorch accepts 'batchmean' from kl_div alone.
void check_reduction(Reduction reduction, const char* op, const Loc& loc) {
  if (reduction == Reduction::BatchMean)
    op_fail(op, loc, "reduction BatchMean is kl_div's alone; use Mean, Sum or None");
}

int64_t axis_index(const Tensor& x, int64_t axis, const char* op, const Loc& loc) {
  check_axes(x, {axis}, op, loc);
  return axis < 0 ? axis + x.dim() : axis;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t axis, const Loc& loc) {
  CallSiteScope site(loc, composite::softmax);
  require_float(x, "softmax", "input", loc);
  check_axes(x, {axis}, "softmax", loc);
  return softmax_of(x, Tensor(), axis, loc);
}

Tensor masked_softmax(const Tensor& x, const Tensor& mask, int64_t axis, const Loc& loc) {
  CallSiteScope site(loc, composite::softmax);
  require_float(x, "masked_softmax", "input", loc);
  check_axes(x, {axis}, "masked_softmax", loc);
  if (!mask.defined() || mask.dtype() != boolean)
    op_fail("masked_softmax", loc, "the mask must be a bool tensor, got {}",
            mask.defined() ? name(mask.dtype()) : "an undefined tensor");
  if (broadcast_shapes(mask.shape(), x.shape()) != std::optional<Shape>(x.shape()))
    op_fail("masked_softmax", loc, "the mask {} does not broadcast to the input {}",
            to_string(mask.shape()), to_string(x.shape()));
  return softmax_of(x, mask, axis, loc);
}

Tensor log_softmax(const Tensor& x, int64_t axis, const Loc& loc) {
  CallSiteScope site(loc, composite::log_softmax);
  require_float(x, "log_softmax", "input", loc);
  check_axes(x, {axis}, "log_softmax", loc);
  const DType type = composite::statistics_type(x.dtype());
  auto forward = [axis, type, &loc](const std::vector<Tensor>& in) {
    Tensor v = cast(in[0], type);
    Tensor shifted = v - stable_shift(v, {axis}, loc);
    return cast(shifted - log(sum(exp(shifted), {axis}, true)), in[0].dtype());
  };
  if (!grad_enabled() || !x.requires_grad()) return forward({x});
  return custom_op(
      {x}, forward,
      [axis, type](const std::vector<Tensor>&, const Tensor& y_in, const Tensor& g_in) {
        Tensor y = cast(y_in, type), g = cast(g_in, type);
        return std::vector<Tensor>{g - exp(y) * sum(g, {axis}, true)};
      },
      loc);
}

Tensor logsumexp(const Tensor& x, std::vector<int64_t> axes, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc, composite::logsumexp);
  require_float(x, "logsumexp", "input", loc);
  check_axes(x, axes, "logsumexp", loc);
  return logsumexp_of(x, axes, keepdim, loc);
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  int64_t normalized_dims, const Loc& loc) {
  CallSiteScope site(loc, composite::layer_norm);
  require_float(x, "layer_norm", "input", loc);
  if (normalized_dims < 1 || normalized_dims > x.dim())
    op_fail("layer_norm", loc, "cannot normalize the last {} axes of {}", normalized_dims,
            to_string(x.shape()));
  Shape normalized(x.shape().end() - normalized_dims, x.shape().end());
  for (const Tensor* p : {&weight, &bias})
    if (p->defined() && p->shape() != normalized)
      op_fail("layer_norm", loc, "weight/bias shape {} should be {}", to_string(p->shape()),
              to_string(normalized));
  std::vector<int64_t> axes;
  for (int64_t d = x.dim() - normalized_dims; d < x.dim(); ++d) axes.push_back(d);
  return normalized_rows(x, weight, bias, eps, axes, true, loc);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, const Loc& loc) {
  CallSiteScope site(loc, composite::rms_norm);
  require_float(x, "rms_norm", "input", loc);
  if (x.dim() == 0) op_fail("rms_norm", loc, "needs at least one axis");
  if (weight.defined() && weight.shape() != Shape{x.size(-1)})
    op_fail("rms_norm", loc, "weight shape {} should be [{}]", to_string(weight.shape()),
            x.size(-1));
  return normalized_rows(x, weight, Tensor(), eps, {x.dim() - 1}, false, loc);
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Loc& loc) {
  CallSiteScope site(loc, composite::linear);
  require(x, "linear", "input", loc);
  require(weight, "linear", "weight", loc);
  if (weight.dim() != 2)
    op_fail("linear", loc, "weight must be [out, in], got {}", to_string(weight.shape()));
  if (x.dim() == 0 || x.size(-1) != weight.size(1))
    op_fail("linear", loc, "input {} does not end in the weight's in-features {} (weight {})",
            to_string(x.shape()), weight.size(1), to_string(weight.shape()));
  Tensor y = matmul(x, weight, false, true);
  if (bias.defined()) {
    if (bias.shape() != Shape{weight.size(0)})
      op_fail("linear", loc, "bias shape {} should be [{}]", to_string(bias.shape()),
              weight.size(0));
    y = y + bias;
  }
  return y;
}

namespace {

// Integer class targets of the scores' shape [..., C] without its last axis.
void check_targets(const Tensor& scores, const Tensor& targets, const char* op, const Loc& loc) {
  require(targets, op, "targets", loc);
  if (!is_integer(targets.dtype()))
    op_fail(op, loc, "targets must be integer class indices, got {}", name(targets.dtype()));
  Shape expected(scores.shape().begin(), scores.shape().end() - (scores.dim() > 0 ? 1 : 0));
  if (scores.dim() == 0 || targets.shape() != expected)
    op_fail(op, loc, "{} {} need targets of shape {}, got {}",
            std::string_view(op) == "cross_entropy" ? "logits" : "inputs",
            to_string(scores.shape()), to_string(expected), to_string(targets.shape()));
}

// A class weight [C] of floating type for scores [..., C], in the scores' statistics type.
Tensor class_weight(const Tensor& weight, const Tensor& scores, const char* op, const Loc& loc) {
  if (!weight.defined()) return weight;
  if (!is_floating(weight.dtype()))
    op_fail(op, loc, "the class weight must be floating-point, got {}", name(weight.dtype()));
  if (weight.shape() != Shape{scores.size(-1)})
    op_fail(op, loc, "the class weight {} should be [{}], one per class of {}",
            to_string(weight.shape()), scores.size(-1), to_string(scores.shape()));
  return cast(weight, composite::statistics_type(scores.dtype()));
}

// The rows that count (targets other than ignore_index), each row's class id checked to be in
// range (at evaluation; ignored rows read class 0), and each row's class weight where there is
// a class weight: cross_entropy's and nll_loss's.
struct CheckedTargets {
  Tensor valid, ids, weight;  // weight: of the target's class, 0 in ignored rows
};
CheckedTargets check_ids(const Tensor& scores, const Tensor& targets, int64_t ignore_index,
                         const Tensor& class_weight) {
  // A fill of the targets' shape: one node, where a 0-d scalar would need a broadcast too. As an
  // integer, exactly (a double made 2^53 + 1 equal 2^53); one the targets' type cannot hold
  // (past i32's range) ignores nothing.
  const bool representable =
      targets.dtype() != i32 || (ignore_index >= INT32_MIN && ignore_index <= INT32_MAX);
  Tensor valid = representable
                     ? ne(targets, full_integer(targets.shape(), ignore_index, targets.dtype()))
                     : ones(targets.shape(), boolean);
  Tensor safe_targets = where(valid, targets, zeros_like(targets));
  // Picking each target out of the class list is the identity on valid ids, and the check
  // (at evaluation) that none is out of range; it reads only the targets.
  Tensor ids = index_select(class_indices(scores.size(-1), targets.dtype()), safe_targets, 0);
  Tensor weight;
  if (class_weight.defined()) {
    // The target's weight by the same masked sum: exact, one term is w[y].
    Tensor w = pick_class(broadcast_to(class_weight, scores.shape()), ids);
    weight = where(valid, w, zeros_like(w));
  }
  return {valid, ids, weight};
}

// Mean over the rows that count (weighted by their class weights, when given), as PyTorch's
// ignore_index and weight.
Tensor reduce_valid(const Tensor& loss, const CheckedTargets& t, Reduction reduction) {
  Tensor kept = where(t.valid, loss, zeros_like(loss));
  if (reduction != Reduction::Mean) return reduce(kept, reduction);
  Tensor total = t.weight.defined() ? sum(t.weight) : sum(cast(t.valid, loss.dtype()));
  return sum(kept) / total;
}

// cross_entropy's loss per row before the reduction, with log p = log_softmax(logits):
// -w_t log p_t, and with label smoothing eps (1 - eps) of that plus eps / C sum_c w_c (-log p_c)
// (PyTorch's; w = 1 without a class weight). One op, whose gradient is the log_softmax backward
// of the whole row's d loss / d log p (PyTorch's arithmetic: dlogp - exp(log p) sum(dlogp)), with
// log p computed again from the logits and each row's max and log-sum-exp, which the op takes as
// inputs (no gradient flows through them: the rule is the whole derivative). So the backward
// pass keeps the logits in their own type (bf16 after an autocast head) and two values per row
// rather than the [rows, classes] log-probabilities in f32, and the logits get their gradient as
// one term (rounded once to their type, where two terms would each be rounded to a 16-bit type
// before their sum). The class weight takes no gradient, as in PyTorch. The rows' statistics, the
// loss and the gradient are computed in the logits' statistics type; the loss is returned in it.
Tensor cross_entropy_rows(const Tensor& logits, const Tensor& ids, const Tensor& class_weight,
                          double eps, const Loc& loc) {
  const bool weighted = class_weight.defined();
  // Inputs: the logits, the ids, each row's max (stable_shift) and log-sum-exp of the shifted
  // row, then the class weight where given. log p is (x - max) - log-sum-exp, as the
  // log_softmax composite computes it, in the forward pass and again in the gradient's kernel.
  const DType type = composite::statistics_type(logits.dtype());
  RowStatistics rows = row_statistics(cast(logits.detach(), type), {-1}, loc, false);
  std::vector<Tensor> inputs{logits, ids, rows.shift, rows.log_norm};
  if (weighted) inputs.push_back(class_weight);
  auto log_probs = [type](const std::vector<Tensor>& in) {
    return (cast(in[0], type) - in[2]) - in[3];
  };
  auto forward = [=](const std::vector<Tensor>& in) {
    Tensor logp = log_probs(in), hits = class_hits(in[0], in[1]);
    Tensor picked = masked_pick(hits, logp);
    if (eps == 0)
      return weighted ? -picked * masked_pick(hits, broadcast_to(in[4], logp.shape())) : -picked;
    // The minus signs go into the factors: (-a) b and a (-b) are the same number, zeros' signs
    // included (so -(1 - eps), which is -0 at eps = 1, not eps - 1).
    Tensor nll_part =
        weighted ? -picked * masked_pick(hits, broadcast_to(in[4], logp.shape())) * (1.0 - eps)
                 : picked * -(1.0 - eps);
    Tensor log_mean = weighted ? mean(logp * in[4], {-1}) : mean(logp, {-1});
    return nll_part + log_mean * -eps;
  };
  if (!grad_enabled() || !logits.requires_grad()) return forward(inputs);
  return custom_op(
      inputs, forward,
      [=](const std::vector<Tensor>& in, const Tensor&, const Tensor& g) {
        const Shape& shape = in[0].shape();
        // d loss / d log p: at the target (a value per row), and the smoothing's share of every
        // class. Without smoothing the row's sum is its one term at the target; with it, the
        // [rows, classes] terms are made twice, for the sum's kernel and the gradient's, so that
        // none is stored between them.
        Tensor w_t =
            weighted ? masked_pick(class_hits(in[0], in[1]), broadcast_to(in[4], shape)) : Tensor();
        Tensor at_target = eps == 0 ? (weighted ? -(g * w_t) : -g)
                                    : (weighted ? -(g * (1.0 - eps) * w_t) : g * -(1.0 - eps));
        auto dlogp_of = [&] {
          Tensor rows = broadcast_to(unsqueeze(at_target, -1), shape);
          Tensor dlogp = where(class_hits(in[0], in[1]), rows, zeros_like(rows));
          if (eps == 0) return dlogp;
          const double share = -eps / static_cast<double>(shape.back());
          Tensor each = broadcast_to(unsqueeze(g * share, -1), shape);
          return dlogp + (weighted ? each * in[4] : each);
        };
        Tensor total = eps == 0 ? unsqueeze(at_target, -1) : sum(dlogp_of(), {-1}, true);
        // A gradient that is itself differentiated (create_graph) takes log p from the logits
        // alone, so that its own gradient sees the row statistics move with them.
        std::vector<Tensor> from = in;
        if (grad_enabled()) {
          RowStatistics rows = row_statistics(cast(in[0], type), {-1}, loc, false);
          from[2] = rows.shift;
          from[3] = rows.log_norm;
        }
        std::vector<Tensor> grads(in.size());
        grads[0] = dlogp_of() - exp(log_probs(from)) * total;
        return grads;
      },
      loc);
}

}  // namespace

namespace {
// cross_entropy against class probabilities [..., C] (PyTorch's since 1.10): each row's
// -sum_c w_c t_c log p_c, with label smoothing mixing the targets with the uniform ones first;
// Mean is over the rows, whatever the weights (as PyTorch's).
Tensor cross_entropy_with_probabilities(const Tensor& logits, const Tensor& targets,
                                        const CrossEntropyOptions& options, const Loc& loc) {
  if (logits.dim() == 0 || targets.shape() != logits.shape())
    op_fail("cross_entropy", loc,
            "{} targets are class probabilities, which must have the logits' shape {} (classes "
            "last), got {} (class indices must be integer)",
            name(targets.dtype()), to_string(logits.shape()), to_string(targets.shape()));
  if (options.ignore_index >= 0)  // as PyTorch's check: a negative one selects no class
    op_fail("cross_entropy", loc,
            "ignore_index ({}) applies to class indices, not to class probabilities",
            options.ignore_index);
  const DType type = composite::statistics_type(logits.dtype());
  Tensor weight = class_weight(options.weight, logits, "cross_entropy", loc);
  Tensor t = cast(targets, type);
  const double smoothing = options.label_smoothing;
  if (smoothing > 0) t = t * (1.0 - smoothing) + smoothing / static_cast<double>(logits.size(-1));
  Tensor terms = t * log_softmax(cast(logits, type), -1, loc);
  if (weight.defined()) terms = terms * weight;
  Tensor rows = -sum(terms, {-1});
  return cast(reduce(rows, options.reduction), logits.dtype());
}
}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, CrossEntropyOptions options,
                     const Loc& loc) {
  CallSiteScope site(loc, composite::cross_entropy);
  require_float(logits, "cross_entropy", "logits", loc);
  check_reduction(options.reduction, "cross_entropy", loc);
  if (!(options.label_smoothing >= 0 && options.label_smoothing <= 1))
    op_fail("cross_entropy", loc, "label_smoothing must be in [0, 1], got {}",
            options.label_smoothing);
  if (options.weight.defined() && options.weight.requires_grad())
    op_fail("cross_entropy", loc,
            "the class weight takes no gradient (as in PyTorch); pass weight.detach()");
  if (targets.defined() && is_floating(targets.dtype()))
    return cross_entropy_with_probabilities(logits, targets, options, loc);
  check_targets(logits, targets, "cross_entropy", loc);
  Tensor weight = class_weight(options.weight, logits, "cross_entropy", loc);
  CheckedTargets checked = check_ids(logits, targets, options.ignore_index, weight);
  Tensor loss = cross_entropy_rows(logits, checked.ids, weight, options.label_smoothing, loc);
  // In the logits' type, as PyTorch returns it (a no-op under autocast, dsl/composites.h).
  return cast(reduce_valid(loss, checked, options.reduction), logits.dtype());
}

Tensor nll_loss(const Tensor& log_probs, const Tensor& targets, Reduction reduction,
                int64_t ignore_index, const Loc& loc) {
  return nll_loss(log_probs, targets,
                  NllLossOptions{.ignore_index = ignore_index, .reduction = reduction}, loc);
}

Tensor nll_loss(const Tensor& log_probs, const Tensor& targets, const NllLossOptions& options,
                const Loc& loc) {
  CallSiteScope site(loc, composite::nll_loss);
  require_float(log_probs, "nll_loss", "log_probs", loc);
  check_reduction(options.reduction, "nll_loss", loc);
  check_targets(log_probs, targets, "nll_loss", loc);
  Tensor weight = class_weight(options.weight, log_probs, "nll_loss", loc);
  CheckedTargets checked = check_ids(log_probs, targets, options.ignore_index, weight);
  Tensor picked =
      pick_class(cast(log_probs, composite::statistics_type(log_probs.dtype())), checked.ids);
  return cast(reduce_valid(weight.defined() ? -picked * checked.weight : -picked, checked,
                           options.reduction),
              log_probs.dtype());
}

namespace {
void same_shapes(const Tensor& a, const Tensor& b, const char* op, const Loc& loc) {
  require_float(a, op, "input", loc);
  require_float(b, op, "target", loc);
  if (a.shape() != b.shape())
    op_fail(op, loc, "input {} and target {} must have the same shape", to_string(a.shape()),
            to_string(b.shape()));
}

// An element weight (binary_cross_entropy's, bce_with_logits' weight and pos_weight): floating,
// broadcast to the input's shape as PyTorch requires, in the input's type.
Tensor element_weight(const Tensor& weight, const Tensor& input, const char* op, const char* role,
                      const Loc& loc) {
  if (!weight.defined()) return weight;
  if (!is_floating(weight.dtype()))
    op_fail(op, loc, "the {} must be floating-point, got {}", role, name(weight.dtype()));
  if (broadcast_shapes(weight.shape(), input.shape()) != std::optional<Shape>(input.shape()))
    op_fail(op, loc, "the {} {} does not broadcast to the input {}", role,
            to_string(weight.shape()), to_string(input.shape()));
  return cast(weight, input.dtype());
}
}  // namespace

namespace {

// p, with PyTorch's check that every probability is in [0, 1] (none NaN) in the graph: an
// mt::Error where the value is evaluated (binary_cross_entropy, bernoulli).
Tensor checked_probabilities(const Tensor& p) {
  return check(p, logical_and(p >= 0.0, p <= 1.0), CheckKind::Probabilities);
}

}  // namespace

Tensor binary_cross_entropy(const Tensor& probs, const Tensor& targets, Reduction reduction,
                            const Loc& loc) {
  return binary_cross_entropy(probs, targets, BceOptions{.reduction = reduction}, loc);
}

Tensor binary_cross_entropy(const Tensor& probs, const Tensor& targets, const BceOptions& options,
                            const Loc& loc) {
  constexpr const char* op = "binary_cross_entropy";
  CallSiteScope site(loc, composite::binary_cross_entropy);
  same_shapes(probs, targets, op, loc);
  check_reduction(options.reduction, op, loc);
  Tensor weight = element_weight(options.weight, probs, op, "weight", loc);
  // PyTorch clamps each log at -100, so that a probability of 0 or 1 gives a finite loss. The
  // gradient with respect to the probabilities is PyTorch's, (p - t) / max(p (1 - p), 1e-12):
  // the clamped logs' own is 0/0 at a probability of exactly 0 or 1 (what sigmoid rounds to
  // beyond |x| = 17). An op with that rule, built from the inputs themselves, so that a gradient
  // differentiated again (create_graph) has its own; computed in the statistics type (f32 for
  // half inputs, where 1e-12 is 0), as cross_entropy, and the loss returned in it.
  const DType type = composite::statistics_type(probs.dtype());
  auto clamped_logs = [](const Tensor& p) {
    return std::pair(maximum(log(p), full_like(p, -100.0)),
                     maximum(log(1.0 - p), full_like(p, -100.0)));
  };
  auto forward = [=](const std::vector<Tensor>& in) {
    Tensor p = checked_probabilities(cast(in[0], type)), t = cast(in[1], type);
    auto [log_p, log_q] = clamped_logs(p);
    return -(t * log_p + (1.0 - t) * log_q);
  };
  std::vector<Tensor> inputs{probs, targets};
  Tensor loss = !grad_enabled() || !(probs.requires_grad() || targets.requires_grad())
                    ? forward(inputs)
                    : custom_op(
                          inputs, forward,
                          [=](const std::vector<Tensor>& in, const Tensor&, const Tensor& g) {
                            Tensor p = cast(in[0], type), t = cast(in[1], type);
                            std::vector<Tensor> grads(2);
                            if (in[0].requires_grad())
                              grads[0] =
                                  cast(g * (p - t) / maximum(p * (1.0 - p), full_like(p, 1e-12)),
                                       in[0].dtype());
                            if (in[1].requires_grad()) {
                              auto [log_p, log_q] = clamped_logs(p);
                              grads[1] = cast(g * (log_q - log_p), in[1].dtype());
                            }
                            return grads;
                          },
                          loc);
  return reduce(weight.defined() ? loss * cast(weight, type) : loss, options.reduction);
}

Tensor l1_loss(const Tensor& input, const Tensor& target, Reduction reduction, const Loc& loc) {
  CallSiteScope site(loc, composite::l1_loss);
  same_shapes(input, target, "l1_loss", loc);
  check_reduction(reduction, "l1_loss", loc);
  return reduce(abs(input - target), reduction);
}

Tensor smooth_l1_loss(const Tensor& input, const Tensor& target, Reduction reduction, double beta,
                      const Loc& loc) {
  CallSiteScope site(loc, composite::smooth_l1_loss);
  same_shapes(input, target, "smooth_l1_loss", loc);
  check_reduction(reduction, "smooth_l1_loss", loc);
  if (!(beta >= 0)) op_fail("smooth_l1_loss", loc, "beta must be non-negative, got {}", beta);
  Tensor d = abs(input - target);
  if (beta == 0) return reduce(d, reduction);
  // d d / 2 / beta in that order, as PyTorch's: 0.5 / beta of a small beta is past f16's range.
  return reduce(where(d < beta, d * d * 0.5 / beta, d - 0.5 * beta), reduction);
}

Tensor huber_loss(const Tensor& input, const Tensor& target, Reduction reduction, double delta,
                  const Loc& loc) {
  CallSiteScope site(loc, composite::huber_loss);
  same_shapes(input, target, "huber_loss", loc);
  check_reduction(reduction, "huber_loss", loc);
  if (!(delta > 0)) op_fail("huber_loss", loc, "delta must be positive, got {}", delta);
  Tensor d = abs(input - target);
  return reduce(where(d < delta, d * d * 0.5, (d - 0.5 * delta) * delta), reduction);
}

Tensor kl_div(const Tensor& input, const Tensor& target, Reduction reduction, bool log_target,
              const Loc& loc) {
  CallSiteScope site(loc, composite::kl_div);
  same_shapes(input, target, "kl_div", loc);
  // target (log target - input), with 0 log 0 = 0 as PyTorch's xlogy; BatchMean divides the
  // sum by the batch size (dim 0), the true KL divergence per sample that PyTorch recommends.
  Tensor pointwise = log_target ? exp(target) * (target - input)
                                : where(eq(target, zeros_like(target)), zeros_like(target),
                                        target * (log(target) - input));
  return reduce(pointwise, reduction);
}

Tensor mse_loss(const Tensor& prediction, const Tensor& target, Reduction reduction,
                const Loc& loc) {
  CallSiteScope site(loc, composite::mse_loss);
  require_float(prediction, "mse_loss", "prediction", loc);
  require(target, "mse_loss", "target", loc);
  check_reduction(reduction, "mse_loss", loc);
  if (prediction.shape() != target.shape())
    op_fail("mse_loss", loc, "prediction {} and target {} must have the same shape",
            to_string(prediction.shape()), to_string(target.shape()));
  return reduce(square(prediction - target), reduction);
}

Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& targets,
                                        BceWithLogitsOptions options, const Loc& loc) {
  constexpr const char* op = "binary_cross_entropy_with_logits";
  CallSiteScope site(loc, composite::binary_cross_entropy_with_logits);
  require_float(logits, op, "logits", loc);
  require_float(targets, op, "targets", loc);
  if (logits.shape() != targets.shape())
    op_fail(op, loc, "logits {} and targets {} must have the same shape", to_string(logits.shape()),
            to_string(targets.shape()));
  check_reduction(options.reduction, op, loc);
  Tensor weight = element_weight(options.weight, logits, op, "weight", loc);
  Tensor pos_weight = element_weight(options.pos_weight, logits, op, "pos_weight", loc);
  // With l = 1 + (pos_weight - 1) y, the loss (1 - y) x + l softplus(-x) is also
  // l softplus(x) - pos_weight y x. Each form is written where its softplus neither overflows
  // nor cancels: log1p(exp(x)) for x < 0, log1p(exp(-x)) from 0 on, keeping the digits of a
  // confident prediction's small loss. Their gradients are PyTorch's: l sigmoid(x) - pos_weight y
  // below 0, which is exact for a confident negative (the single form's 1 - 1 + sigmoid(x) lost
  // it), and (1 - y) - l sigmoid(-x) above. Each side reads x only where it is selected (0
  // elsewhere), so neither exp overflows into the other's gradient; x = 0 takes the upper side,
  // whose gradient there is (1 - y) - l / 2. The targets' gradients read the selected x alone
  // too (an infinite x in the other side's term made 0 * inf = NaN of them).
  Tensor below = logits < 0.0, zero = zeros_like(logits);
  Tensor negative = where(below, logits, zero), positive = where(below, zero, logits);
  Tensor log_weight = pos_weight.defined() ? 1.0 + (pos_weight - 1.0) * targets : Tensor();
  auto weighted = [&](const Tensor& softplus) {
    return log_weight.defined() ? log_weight * softplus : softplus;
  };
  Tensor positive_targets = pos_weight.defined() ? pos_weight * targets : targets;
  Tensor lower = weighted(log1p(exp(negative))) - positive_targets * negative;
  Tensor upper = (1.0 - targets) * positive + weighted(log1p(exp(-positive)));
  Tensor loss = where(below, lower, upper);
  return reduce(weight.defined() ? loss * weight : loss, options.reduction);
}

Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max,
             const Loc& loc) {
  CallSiteScope site(loc, composite::clamp);
  require(x, "clamp", "input", loc);
  if (!min && !max) op_fail("clamp", loc, "needs a min or a max");
  // An integer or bool input with a bound that is not a whole number is clamped in f32, as
  // PyTorch promotes it; a bool one with whole bounds in i64.
  auto whole = [](std::optional<double> b) { return !b || *b == std::nearbyint(*b); };
  const Tensor input = is_floating(x.dtype())        ? x
                       : !(whole(min) && whole(max)) ? cast(x, f32)
                       : x.dtype() == boolean        ? cast(x, i64)
                                                     : x;
  // Whole bounds of an integer input: compared and filled as integers, exactly (a double bound
  // made the comparison f32's, inexact past 2^24); one at or past the type's range bounds nothing
  // on its side. Integers take no gradient.
  if (!is_floating(input.dtype())) {
    const double range = input.dtype() == i32 ? 0x1p31 : 0x1p63;  // [-range, range)
    Tensor y = input;
    if (min && *min > -range) {
      const auto bound = static_cast<int64_t>(*min);
      y = where(y < bound, full_integer(y.shape(), bound, y.dtype()), y);
    }
    if (max && *max < range) {
      const auto bound = static_cast<int64_t>(*max);
      y = where(y > bound, full_integer(y.shape(), bound, y.dtype()), y);
    }
    return y;
  }
  // Comparisons are false for NaN, so NaN passes both selections unchanged; min > max gives max.
  Tensor y = input.detach();
  if (min) y = where(y < *min, full_like(y, *min), y);
  if (max) y = where(y > *max, full_like(y, *max), y);
  // The gradient is PyTorch's: 1 where min <= x <= max, else 0 (NaN included).
  Tensor inside = min ? input >= *min : input <= *max;
  if (min && max) inside = logical_and(inside, input <= *max);
  return where(inside, input, y);
}

namespace detail {

Tensor where_number(const Tensor& cond, const Tensor& tensor, const Operand& number,
                    bool boolean_number, bool number_first, const Loc& loc) {
  CallSiteScope site(loc);
  require(cond, "where", "condition", loc);
  require(tensor, "where", number_first ? "second value" : "first value", loc);
  // PyTorch's promotion of a number with a tensor: the tensor's type unless the number is of a
  // higher kind (float over integer and bool, integer over bool), then the default of that kind.
  DType t = tensor.dtype();
  if (!is_floating(t) && !number.scalar_is_integral) t = f32;
  if (t == boolean && !boolean_number) t = i64;
  Tensor fill = number_fill(number, t, tensor.shape(), loc);
  Tensor value = cast(tensor, fill.dtype());
  return number_first ? where(cond, fill, value, loc) : where(cond, value, fill, loc);
}

Tensor where_numbers(const Tensor& cond, const Operand& a, const Operand& b, const Loc& loc) {
  CallSiteScope site(loc);
  require(cond, "where", "condition", loc);
  const DType t = a.scalar_is_integral && b.scalar_is_integral ? i64 : f32;
  return where(cond, number_fill(a, t, cond.shape(), loc), number_fill(b, t, cond.shape(), loc),
               loc);
}

}  // namespace detail

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value, const Loc& loc) {
  CallSiteScope site(loc, composite::masked_fill);
  require(x, "masked_fill", "input", loc);
  if (!mask.defined() || mask.dtype() != boolean)
    op_fail("masked_fill", loc, "the mask must be a bool tensor, got {}",
            mask.defined() ? name(mask.dtype()) : "an undefined tensor");
  return where(mask, full_like(x, value), x);
}

Tensor remainder(const Tensor& a, const Tensor& b, const Loc& loc) {
  CallSiteScope site(loc, composite::remainder);
  require_float(a, "remainder", "dividend", loc);
  require_float(b, "remainder", "divisor", loc);
  // fmod has the dividend's sign; a non-zero result of the other sign than b moves by b.
  Tensor r = fmod(a, b);
  Tensor other_sign = logical_and(ne(r, zeros_like(r)), ne(r < 0.0, b < 0.0));
  return where(other_sign, r + b, r);
}

Tensor isnan(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "isnan", "input", loc);
  if (!is_floating(x.dtype())) return zeros(x.shape(), boolean);
  return ne(x, x);
}

Tensor isinf(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "isinf", "input", loc);
  if (!is_floating(x.dtype())) return zeros(x.shape(), boolean);
  return eq(abs(x), full_like(x, std::numeric_limits<double>::infinity()));
}

Tensor isfinite(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "isfinite", "input", loc);
  if (!is_floating(x.dtype())) return ones(x.shape(), boolean);
  return abs(x) < std::numeric_limits<double>::infinity();  // false for NaN
}

namespace {
Tensor truth(const Tensor& x) { return x.dtype() == boolean ? x : ne(x, zeros_like(x)); }
}  // namespace

Tensor logical_not(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "logical_not", "input", loc);
  return eq(truth(x), zeros_like(truth(x)));
}

Tensor logical_and(const Tensor& a, const Tensor& b, const Loc& loc) {
  CallSiteScope site(loc);
  require(a, "logical_and", "input", loc);
  require(b, "logical_and", "other", loc);
  Tensor x = truth(a), y = truth(b);
  return where(x, y, zeros_like(y));
}

Tensor logical_or(const Tensor& a, const Tensor& b, const Loc& loc) {
  CallSiteScope site(loc);
  require(a, "logical_or", "input", loc);
  require(b, "logical_or", "other", loc);
  Tensor x = truth(a), y = truth(b);
  return where(x, ones_like(y), y);
}

Tensor logical_xor(const Tensor& a, const Tensor& b, const Loc& loc) {
  CallSiteScope site(loc);
  require(a, "logical_xor", "input", loc);
  require(b, "logical_xor", "other", loc);
  return ne(truth(a), truth(b));
}

Tensor flip(const Tensor& x, const std::vector<int64_t>& axes, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "flip", "input", loc);
  Tensor y = x;
  std::vector<int64_t> flipped;
  for (int64_t axis : axes) {
    // An axis named twice is an error, as torch's: flipped twice, it silently came back.
    const int64_t a = axis_index(x, axis, "flip", loc);
    if (std::find(flipped.begin(), flipped.end(), a) != flipped.end())
      op_fail("flip", loc, "axis {} appears twice in [{}]", axis, fmt::join(axes, ", "));
    flipped.push_back(a);
    const int64_t n = y.size(axis);
    if (n > 1) y = index_select(y, arange(static_cast<double>(n - 1), -1.0, -1.0), axis);
  }
  return y;
}

Tensor roll(const Tensor& x, const std::vector<int64_t>& shifts, const std::vector<int64_t>& axes,
            const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "roll", "input", loc);
  // No axes and one shift: torch.roll(x, shift) rolls the flattened tensor.
  if (axes.empty() && shifts.size() == 1)
    return reshape(roll(reshape(x, {-1}, loc), shifts, {0}, loc), x.shape(), loc);
  if (shifts.size() != axes.size())
    op_fail("roll", loc, "needs one shift per axis, got {} shifts for {} axes", shifts.size(),
            axes.size());
  check_axes(x, axes, "roll", loc);
  Tensor y = x;
  for (size_t i = 0; i < axes.size(); ++i) {
    const int64_t n = y.size(axes[i]);
    if (n == 0) continue;
    const int64_t shift = ((shifts[i] % n) + n) % n;  // element j moves to (j + shift) mod n
    if (shift == 0) continue;
    y = concat({slice(y, axes[i], n - shift, n), slice(y, axes[i], 0, n - shift)}, axes[i]);
  }
  return y;
}

namespace {
// Whether element (row, col) of the last two axes is on or below the `diagonal`-th diagonal.
Tensor lower_triangle(const Tensor& x, int64_t diagonal) {
  Tensor rows = unsqueeze(arange(x.size(-2)), 1), cols = unsqueeze(arange(x.size(-1)), 0);
  return cols - rows <= static_cast<double>(diagonal);
}
}  // namespace

Tensor tril(const Tensor& x, int64_t diagonal, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "tril", "input", loc);
  if (x.dim() < 2) op_fail("tril", loc, "needs at least 2 dims, got {}", to_string(x.shape()));
  return where(lower_triangle(x, diagonal), x, zeros_like(x));
}

Tensor triu(const Tensor& x, int64_t diagonal, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "triu", "input", loc);
  if (x.dim() < 2) op_fail("triu", loc, "needs at least 2 dims, got {}", to_string(x.shape()));
  return where(lower_triangle(x, diagonal - 1), zeros_like(x), x);
}

Tensor repeat(const Tensor& x, const std::vector<int64_t>& repeats, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "repeat", "input", loc);
  if (repeats.size() < static_cast<size_t>(x.dim()))
    op_fail("repeat", loc, "needs a repeat count for each of the {} dims, got {}", x.dim(),
            repeats.size());
  for (int64_t r : repeats)
    if (r < 0) op_fail("repeat", loc, "repeat counts must be non-negative, got {}", r);
  // x as [1, s0, 1, s1, ...] broadcast to [r0, s0, r1, s1, ...], then merged pairwise.
  Shape padded(repeats.size() - static_cast<size_t>(x.dim()), 1);
  padded.insert(padded.end(), x.shape().begin(), x.shape().end());
  Shape spread, broadcast, result;
  for (size_t d = 0; d < repeats.size(); ++d) {
    spread.insert(spread.end(), {1, padded[d]});
    broadcast.insert(broadcast.end(), {repeats[d], padded[d]});
    result.push_back(repeats[d] * padded[d]);
  }
  return reshape(broadcast_to(reshape(x, spread), broadcast), result);
}

Tensor tile(const Tensor& x, const std::vector<int64_t>& reps, const Loc& loc) {
  CallSiteScope site(loc);
  // torch.tile: fewer counts than dims are padded with leading 1s.
  std::vector<int64_t> repeats(
      static_cast<size_t>(std::max<int64_t>(0, x.dim() - static_cast<int64_t>(reps.size()))), 1);
  repeats.insert(repeats.end(), reps.begin(), reps.end());
  return repeat(x, repeats, loc);
}

namespace {

// sqrt(s) for s >= 0 (or NaN), with a gradient of 0 where s is 0, as PyTorch masks the zero
// results of norm and std: sqrt's own there is inf, which times the zero spread gave NaN.
Tensor sqrt_zero_gradient_at_zero(const Tensor& s) {
  Tensor nonzero = ne(s, zeros_like(s));  // true for NaN
  return where(nonzero, sqrt(where(nonzero, s, ones_like(s))), zeros_like(s));
}

}  // namespace

Tensor std_dev(const Tensor& x, std::vector<int64_t> axes, bool keepdim, double correction,
               const Loc& loc) {
  CallSiteScope site(loc);
  require_float(x, "std", "input", loc);
  check_axes(x, axes, "std", loc);
  // In f64, rounded once, as PyTorch accumulates: var's own rounding to f16 overflowed above
  // 256, and to f32 past 1.8e19, where the deviation itself fits.
  Tensor deviation = sqrt_zero_gradient_at_zero(
      var(x.dtype() == f64 ? x : cast(x, f64), axes, keepdim, correction));
  return deviation.dtype() == x.dtype() ? deviation : cast(deviation, x.dtype());
}

Tensor norm(const Tensor& x, double p, std::vector<int64_t> axes, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc);
  require_float(x, "norm", "input", loc);
  check_axes(x, axes, "norm", loc);
  if (p == 1) return sum(abs(x), axes, keepdim);
  if (p == 2) return sqrt_zero_gradient_at_zero(sum(x * x, axes, keepdim));
  if (std::isinf(p) && p > 0) return max(abs(x), axes, keepdim);
  op_fail("norm", loc, "p must be 1, 2 or inf, got {}", p);
}

Tensor argmin(const Tensor& x, std::optional<int64_t> axis, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "argmin", "input", loc);
  // Checked here so that a bad axis is named as argmin's (a 0-d tensor takes 0 and -1).
  if (axis && !x.shape().empty()) check_axes(x, {*axis}, "argmin", loc);
  if (axis && x.shape().empty() && (*axis < -1 || *axis > 0))
    op_fail("argmin", loc, "axis {} is out of range for a 0-d tensor", *axis);
  // The first smallest is the first largest of an order-reversing map: -x for floats (NaN stays
  // NaN and wins, as torch.argmin), ~x = -1 - x for integers (which does not overflow).
  Tensor reversed = is_floating(x.dtype()) ? -x : -1 - x;
  return argmax(reversed, axis, keepdim, loc);
}

Tensor any(const Tensor& x, std::vector<int64_t> axes, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "any", "input", loc);
  check_axes(x, axes, "any", loc);
  return sum(cast(truth(x), i64), axes, keepdim) > 0.0;
}

Tensor all(const Tensor& x, std::vector<int64_t> axes, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "all", "input", loc);
  return logical_not(any(logical_not(x), std::move(axes), keepdim, loc));
}

Tensor bernoulli(const Tensor& p, Generator* gen, const Loc& loc) {
  CallSiteScope site(loc, composite::bernoulli);
  require_float(p, "bernoulli", "probabilities", loc);
  return cast(rand(p.shape(), f32, gen) < cast(checked_probabilities(p), f32), p.dtype());
}

Tensor randint(int64_t low, int64_t high, Shape shape, Generator* gen, const Loc& loc) {
  CallSiteScope site(loc);
  if (high <= low) op_fail("randint", loc, "needs low < high, got [{}, {})", low, high);
  // floor(u (high - low)) with u = k / 2^53 drawn in f64 is below high - low, and every value
  // of a range up to 2^53 comes as often as every other within one in 2^53 / (high - low); a
  // wider range would leave values out.
  const __int128 range = static_cast<__int128>(high) - low;
  if (range > (__int128{1} << 53))
    op_fail("randint", loc, "draws from at most 2^53 values, got [{}, {})", low, high);
  Tensor u = rand(std::move(shape), f64, gen);
  // low added exactly, also beyond 2^53, as two numbers a double holds: its bits above the
  // lowest 11 (at most 53 significant ones) and those 11.
  const int64_t low_high_bits = low & ~int64_t{2047}, low_low_bits = low & 2047;
  return cast(floor(u * static_cast<double>(range)), i64) +
         scalar(static_cast<double>(low_high_bits), i64) +
         scalar(static_cast<double>(low_low_bits), i64);
}

namespace {
// fn of x computed in f32 for a half x and rounded once, as PyTorch's kernels compute 16-bit
// activations (rounding each step of a composite to f16/bf16 was off by a few ulps).
template <class Fn>
Tensor in_f32_for_half(const Tensor& x, Fn fn) {
  if (!is_half(x.dtype())) return fn(x);
  return cast(fn(cast(x, f32)), x.dtype());
}
}  // namespace

Tensor softplus(const Tensor& x, double beta, double threshold, const Loc& loc) {
  CallSiteScope site(loc, composite::softplus);
  require_float(x, "softplus", "input", loc);
  if (!(beta > 0)) op_fail("softplus", loc, "beta must be positive, got {}", beta);
  // Linear above the threshold, as PyTorch's, where log1p(exp(beta x)) / beta rounds to x. A
  // half input is computed in f32, as PyTorch's: exp overflows f16 from 11.1.
  return in_f32_for_half(x, [&](const Tensor& wide) {
    Tensor scaled = wide * beta;
    // The exponential's branch sees 0 where it is not taken: exp of a large input is inf, whose
    // gradient, 0 * inf, was NaN even where `where` gave the branch none.
    Tensor linear = scaled > threshold;
    return where(linear, wide,
                 log1p(exp(where(linear, zeros_like(scaled), scaled))) * (1.0 / beta));
  });
}

Tensor leaky_relu(const Tensor& x, double negative_slope, const Loc& loc) {
  CallSiteScope site(loc, composite::leaky_relu);
  require_float(x, "leaky_relu", "input", loc);
  return where(x > 0.0, x, x * negative_slope);
}

Tensor elu(const Tensor& x, double alpha, const Loc& loc) {
  CallSiteScope site(loc, composite::elu);
  require_float(x, "elu", "input", loc);
  Tensor positive = x > 0.0;  // expm1 of 0 there: of a large x it is inf, whose gradient is NaN
  return where(positive, x, expm1(where(positive, zeros_like(x), x)) * alpha);
}

Tensor selu(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc, composite::selu);
  require_float(x, "selu", "input", loc);
  // The constants of Klambauer et al. (2017), as PyTorch has them.
  constexpr double alpha = 1.6732632423543772848170429916717;
  constexpr double scale = 1.0507009873554804934193349852946;
  return in_f32_for_half(x, [](const Tensor& x) {
    Tensor positive = x > 0.0;  // expm1 of 0 there, as elu's
    return where(positive, x * scale, expm1(where(positive, zeros_like(x), x)) * (alpha * scale));
  });
}

Tensor mish(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc, composite::mish);
  require_float(x, "mish", "input", loc);
  return in_f32_for_half(x, [](const Tensor& x) { return x * tanh(softplus(x)); });
}

Tensor hardsigmoid(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc, composite::hardsigmoid);
  require_float(x, "hardsigmoid", "input", loc);
  // relu6(x + 3) / 6, whose gradient is 1/6 strictly inside (-3, 3), as PyTorch's.
  // (x + 3) / 6 as PyTorch: x + 3 is exact near -3, where x / 6 + 0.5 cancelled.
  return in_f32_for_half(x, [](const Tensor& x) {
    return where(x <= -3.0, zeros_like(x), where(x >= 3.0, ones_like(x), (x + 3.0) / 6.0));
  });
}

Tensor hardswish(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc, composite::hardswish);
  require_float(x, "hardswish", "input", loc);
  // Zero below -3, as PyTorch's gradient (-1/2 at -3 itself); x (x + 3) / 6 in its order.
  return in_f32_for_half(x, [](const Tensor& x) {
    return where(x < -3.0, zeros_like(x), where(x > 3.0, x, x * (x + 3.0) / 6.0));
  });
}

Tensor lerp(const Tensor& start, const Tensor& end, const Tensor& weight, const Loc& loc) {
  CallSiteScope site(loc, composite::lerp);
  require_float(start, "lerp", "start", loc);
  require_float(end, "lerp", "end", loc);
  require_float(weight, "lerp", "weight", loc);
  // PyTorch's two forms: from start below a weight of 0.5 (negative ones too, as its kernels
  // pick), from end at and above it (exact at both ends). A half result is computed in f32 and
  // rounded once, as PyTorch's: each step rounded to bf16 was off by up to the whole result.
  auto lerped = [](const Tensor& a, const Tensor& b, const Tensor& w) {
    Tensor diff = b - a;
    return where(w < 0.5, a + w * diff, b - diff * (1.0 - w));
  };
  const DType out = promote(promote(start.dtype(), end.dtype()), weight.dtype());
  if (!is_half(out)) return lerped(start, end, weight);
  return cast(lerped(cast(start, f32), cast(end, f32), cast(weight, f32)), out);
}

Tensor pad(const Tensor& x, const std::vector<int64_t>& pads, PadMode mode, double value,
           const Loc& loc) {
  CallSiteScope site(loc, composite::pad);
  require(x, "pad", "input", loc);
  if (pads.size() % 2 != 0 || pads.size() / 2 > static_cast<size_t>(x.dim()))
    op_fail("pad", loc, "needs (before, after) pairs for at most {} axes, got {} values", x.dim(),
            pads.size());
  auto padded = [&](const Tensor& input) {
    Tensor y = input;
    for (size_t pair = 0; pair < pads.size() / 2; ++pair) {
      const int64_t axis = x.dim() - 1 - static_cast<int64_t>(pair);
      int64_t before = pads[2 * pair], after = pads[2 * pair + 1];
      const int64_t size = y.size(axis);
      if (mode != PadMode::Constant && (before < 0 || after < 0))
        op_fail("pad", loc, "negative padding ({}, {}) of axis {} needs constant mode", before,
                after, axis);
      if (mode == PadMode::Reflect && (before >= size || after >= size))
        op_fail("pad", loc, "reflect padding ({}, {}) of axis {} must be below its size {}", before,
                after, axis, size);
      if (mode == PadMode::Circular && (before > size || after > size))
        op_fail("pad", loc, "circular padding ({}, {}) of axis {} must be at most its size {}",
                before, after, axis, size);
      if (mode == PadMode::Replicate && size == 0 && (before > 0 || after > 0))
        op_fail("pad", loc, "cannot replicate the edge of axis {}, which is empty", axis);
      if (before < 0 || after < 0) {  // negative constant pads crop
        const int64_t start = std::max<int64_t>(-before, 0);
        const int64_t stop = size - std::max<int64_t>(-after, 0);
        if (stop < start)
          op_fail("pad", loc, "padding ({}, {}) crops more than axis {} has ({})", before, after,
                  axis, size);
        y = slice(y, axis, start, stop);
        before = std::max<int64_t>(before, 0);
        after = std::max<int64_t>(after, 0);
      }
      const int64_t n = y.size(axis);
      auto block = [&](int64_t count, bool at_start) {
        Shape shape = y.shape();
        shape[axis] = count;
        if (mode == PadMode::Constant) return full(shape, value, y.dtype());
        if (mode == PadMode::Replicate)
          return broadcast_to(slice(y, axis, at_start ? 0 : n - 1, at_start ? 1 : n), shape);
        if (mode == PadMode::Circular)
          return at_start ? slice(y, axis, n - count, n) : slice(y, axis, 0, count);
        // Reflect: the mirror image without the edge, x[count] ... x[1] before, x[n-2] ... after.
        std::vector<Tensor> rows;
        for (int64_t i = 0; i < count; ++i) {
          const int64_t at = at_start ? count - i : n - 2 - i;
          rows.push_back(slice(y, axis, at, at + 1));
        }
        return concat(rows, axis);
      };
      std::vector<Tensor> parts;
      if (before > 0) parts.push_back(block(before, true));
      parts.push_back(y);
      if (after > 0) parts.push_back(block(after, false));
      if (parts.size() > 1) y = concat(parts, axis);
    }
    return y;
  };
  // Replicate, reflect and circular read an element several times, so the backward adds
  // several gradient terms into it: for a 16-bit x in f32, rounded once at the end (per axis, each
  // stage's sums were rounded to bf16: 6 ulps off at a 1x1 input padded (2, 3, 1, 1)). The copies
  // are exact.
  return mode == PadMode::Constant ? padded(x) : in_f32_for_half(x, padded);
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t axis,
                          const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "split", "input", loc);
  const int64_t a = axis_index(x, axis, "split", loc);
  int64_t total = 0;
  for (int64_t size : sizes) {
    if (size < 0) op_fail("split", loc, "sizes must be non-negative, got {}", size);
    total += size;
  }
  if (total != x.size(a))
    op_fail("split", loc, "sizes add up to {}, but axis {} has {}", total, axis, x.size(a));
  std::vector<Tensor> pieces;
  int64_t start = 0;
  for (int64_t size : sizes) {
    pieces.push_back(slice(x, a, start, start + size));
    start += size;
  }
  return pieces;
}

std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t axis, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "split", "input", loc);
  const int64_t a = axis_index(x, axis, "split", loc);
  if (size <= 0) op_fail("split", loc, "the piece size must be positive, got {}", size);
  std::vector<int64_t> sizes;
  for (int64_t start = 0; start < x.size(a); start += size)
    sizes.push_back(std::min(size, x.size(a) - start));
  if (sizes.empty()) sizes.push_back(0);  // torch.split of an empty axis gives one empty piece
  return split(x, sizes, a, loc);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t axis, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "chunk", "input", loc);
  const int64_t a = axis_index(x, axis, "chunk", loc);
  if (chunks <= 0) op_fail("chunk", loc, "the number of chunks must be positive, got {}", chunks);
  // torch.chunk: pieces of ceil(size / chunks), so there may be fewer than `chunks`; an empty
  // axis gives `chunks` empty pieces.
  if (x.size(a) == 0) return split(x, std::vector<int64_t>(static_cast<size_t>(chunks), 0), a, loc);
  return split(x, (x.size(a) + chunks - 1) / chunks, a, loc);
}

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen, const Loc& loc) {
  CallSiteScope site(loc, composite::dropout);
  require_float(x, "dropout", "input", loc);
  if (!(p >= 0 && p <= 1)) op_fail("dropout", loc, "p must be in [0, 1], got {}", p);
  if (!training || p == 0) return x;
  if (p == 1) return x * 0.0;
  Tensor keep = rand(x.shape(), f32, gen) >= p;
  // x times 0 or 1/(1-p) (in x's type), as PyTorch's x * noise: a dropped NaN or inf stays NaN
  // rather than being hidden as 0 from the loss scaler and the gradient checks.
  return x * where(keep, full_like(x, 1.0 / (1.0 - p)), zeros_like(x));
}

Tensor causal_mask(int64_t size, const Loc& loc) {
  CallSiteScope site(loc, composite::causal_mask);
  if (size < 0) op_fail("causal_mask", loc, "size must be non-negative, got {}", size);
  return causal_mask(size, size, loc);
}

Tensor causal_mask(int64_t queries, int64_t keys, const Loc& loc) {
  CallSiteScope site(loc, composite::causal_mask);
  if (queries < 0 || keys < 0)
    op_fail("causal_mask", loc, "sizes must be non-negative, got {} and {}", queries, keys);
  return ge(unsqueeze(arange(queries), 1), unsqueeze(arange(keys), 0));
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    const Loc& loc) {
  CallSiteScope site(loc, composite::scaled_dot_product_attention);
  require_float(q, "scaled_dot_product_attention", "query", loc);
  require_float(k, "scaled_dot_product_attention", "key", loc);
  require_float(v, "scaled_dot_product_attention", "value", loc);
  if (q.dim() < 2 || k.dim() < 2 || v.dim() < 2 || q.size(-1) != k.size(-1) ||
      k.size(-2) != v.size(-2))
    op_fail("scaled_dot_product_attention", loc, "shapes q {} k {} v {} do not fit",
            to_string(q.shape()), to_string(k.shape()), to_string(v.shape()));
  return detail::attention(q, k, v, Tensor(), causal, std::nullopt, true, loc);
}

}  // namespace mixtape
