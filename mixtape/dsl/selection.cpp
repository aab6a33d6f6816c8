// mixtape/dsl/selection.cpp -- prod, sort, topk, take_along_dim, masked_select, nonzero,
// multinomial and randperm as DSL code over the scan, sort and gather primitives (dsl/ops.h).
#include "mixtape/dsl/selection.h"

#include <limits>

#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/operand_checks.h"

namespace mixtape {
namespace {

// dim counted from the end when negative; a 0-d tensor takes 0 and -1, as in PyTorch.
int64_t dim_or_fail(const Tensor& x, int64_t dim, const char* op, const Loc& loc) {
  const int64_t rank = std::max<int64_t>(x.dim(), 1);
  if (dim < -rank || dim >= rank)
    op_fail(op, loc, "dim {} is out of range for shape {}", dim, to_string(x.shape()));
  return dim < 0 ? dim + rank : dim;
}

}  // namespace

Tensor prod(const Tensor& x, std::optional<int64_t> dim, bool keepdim, const Loc& loc) {
  CallSiteScope site(loc, composite::prod);
  require(x, "prod", "input", loc);
  if (!dim) {
    Tensor all = prod(reshape(x, {-1}), 0, false, loc);
    return keepdim ? reshape(all, Shape(x.shape().size(), 1)) : all;
  }
  if (x.dim() == 0) {
    dim_or_fail(x, *dim, "prod", loc);
    return cast(x, is_floating(x.dtype()) ? x.dtype() : i64);
  }
  const int64_t axis = dim_or_fail(x, *dim, "prod", loc);
  const int64_t n = x.size(axis);
  Shape kept = x.shape();
  kept[axis] = 1;
  Tensor last = n == 0 ? ones(kept, is_floating(x.dtype()) ? x.dtype() : i64)
                       : slice(cumprod(x, axis), axis, n - 1, n);
  return keepdim ? last : squeeze(last, axis);
}

ValuesIndices sort(const Tensor& x, int64_t dim, bool descending, bool stable, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "sort", "input", loc);
  const int64_t axis = dim_or_fail(x, dim, "sort", loc);
  Tensor indices = argsort(x, axis, descending, stable);
  if (x.dim() == 0) return {x, indices};
  return {gather(x, indices, axis), indices};
}

ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim, bool largest, bool /*sorted*/,
                   const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "topk", "input", loc);
  const int64_t axis = dim_or_fail(x, dim, "topk", loc);
  const int64_t size = x.dim() == 0 ? 1 : x.size(axis);
  if (k < 0 || k > size)
    op_fail("topk", loc, "k {} is out of range for size {} of dim {} of shape {}", k, size, axis,
            to_string(x.shape()));
  if (x.dim() == 0) return {x, argsort(x, axis)};
  Tensor indices = slice(argsort(x, axis, largest, true), axis, 0, k);
  return {gather(x, indices, axis), indices};
}

Tensor take_along_dim(const Tensor& x, const Tensor& indices, std::optional<int64_t> dim,
                      const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "take_along_dim", "input", loc);
  require(indices, "take_along_dim", "indices", loc);
  if (!is_integer(indices.dtype()))
    op_fail("take_along_dim", loc, "indices must be an integer tensor, got {}",
            name(indices.dtype()));
  if (!dim) return gather(reshape(x, {-1}), reshape(indices, {-1}), 0);
  if (x.dim() != indices.dim())
    op_fail("take_along_dim", loc, "input {} and indices {} must have the same number of dims",
            to_string(x.shape()), to_string(indices.shape()));
  const int64_t axis = dim_or_fail(x, *dim, "take_along_dim", loc);
  if (x.dim() == 0) return gather(reshape(x, {1}), reshape(indices, {1}), 0).reshape({});
  Shape xs = x.shape(), is = indices.shape();
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d == axis || xs[d] == is[d]) continue;
    if (xs[d] == 1)
      xs[d] = is[d];
    else if (is[d] == 1)
      is[d] = xs[d];
    else
      op_fail("take_along_dim", loc,
              "input {} and indices {} cannot be broadcast together outside dim {}",
              to_string(x.shape()), to_string(indices.shape()), axis);
  }
  return gather(broadcast_to(x, xs), broadcast_to(indices, is), axis);
}

Tensor masked_select(const Tensor& x, const Tensor& mask, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "masked_select", "input", loc);
  require(mask, "masked_select", "mask", loc);
  if (mask.dtype() != boolean)
    op_fail("masked_select", loc, "the mask must be bool, got {}", name(mask.dtype()));
  std::optional<Shape> shape = broadcast_shapes(x.shape(), mask.shape());
  if (!shape)
    op_fail("masked_select", loc, "input {} and mask {} cannot be broadcast together",
            to_string(x.shape()), to_string(mask.shape()));
  std::vector<bool> keep = broadcast_to(mask, *shape).to_vector<bool>();
  std::vector<int64_t> positions;
  for (size_t i = 0; i < keep.size(); ++i)
    if (keep[i]) positions.push_back(static_cast<int64_t>(i));
  const int64_t count = static_cast<int64_t>(positions.size());
  return index_select(reshape(broadcast_to(x, *shape), {-1}), tensor(positions, {count}), 0);
}

Tensor nonzero(const Tensor& x, const Loc& loc) {
  CallSiteScope site(loc);
  require(x, "nonzero", "input", loc);
  std::vector<double> values = x.to_vector<double>();
  const Shape& shape = x.shape();
  std::vector<int64_t> positions;
  std::vector<int64_t> at(shape.size(), 0);
  for (double v : values) {
    if (v != 0) positions.insert(positions.end(), at.begin(), at.end());
    for (size_t d = shape.size(); d-- > 0;) {
      if (++at[d] < shape[d]) break;
      at[d] = 0;
    }
  }
  const int64_t rank = x.dim();
  const int64_t count =
      rank == 0 ? (values[0] != 0 ? 1 : 0) : static_cast<int64_t>(positions.size()) / rank;
  return tensor(positions, {count, rank});
}

namespace {

// p with torch.multinomial's check of its weights in the graph (each finite and >= 0, each
// row's sum positive), evaluated with the draws: never read on the host.
Tensor checked_weights(const Tensor& p) {
  const double inf = std::numeric_limits<double>::infinity();
  Tensor good = where(p < 0.0, zeros(p.shape(), boolean), p < inf);  // NaN is not below inf
  Tensor rows = logical_and(all(good, {-1}, true), any(p > 0.0, {-1}, true));
  return check(p, rows, CheckKind::SamplingWeights);
}

}  // namespace

Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement, Generator* gen,
                   const Loc& loc) {
  CallSiteScope site(loc, composite::multinomial);
  require(probs, "multinomial", "probabilities", loc);
  if (!is_floating(probs.dtype()))
    op_fail("multinomial", loc, "the probabilities must be floating-point, got {}",
            name(probs.dtype()));
  if (probs.dim() != 1 && probs.dim() != 2)
    op_fail("multinomial", loc, "the probabilities must be 1-d or 2-d, got {}",
            to_string(probs.shape()));
  const int64_t n = probs.size(-1);
  if (n == 0)
    op_fail("multinomial", loc, "needs at least one category, got {}", to_string(probs.shape()));
  if (num_samples <= 0)
    op_fail("multinomial", loc, "num_samples must be positive, got {}", num_samples);
  if (!replacement && num_samples > n)
    op_fail("multinomial", loc,
            "cannot draw {} samples without replacement from {} categories (shape {})", num_samples,
            n, to_string(probs.shape()));
  Tensor p = checked_weights(cast(probs, f64).detach());
  Shape drawn = probs.shape();
  drawn.back() = num_samples;
  if (replacement) {
    // The category of u * total is the number of cumulative weights at or below it: a category
    // of zero weight never is, since its cumulative weight equals the one before it. The weights
    // are divided by the row's largest first, so that the total is in [1, n]: a subnormal total
    // rounded u * total up to it (drawing a last category of zero weight), an infinite one made
    // every draw the last category.
    Tensor cdf = cumsum(p / max(p, {-1}, true), -1);
    Tensor total = slice(cdf, -1, n - 1, n);
    Tensor u = rand(drawn, f64, gen) * total;
    Tensor below = cast(unsqueeze(cdf, -2) <= unsqueeze(u, -1), i64);
    return minimum(sum(below, {-1}), scalar(static_cast<double>(n - 1), i64));
  }
  // -log(1 - u) with u in [0, 1) is an Exp(1) draw, finite and positive.
  Tensor exponential = -log1p(-rand(probs.shape(), f64, gen));
  // A zero weight's key is -1, never 0 / 0 (an exponential draw of 0 made it NaN, which topk
  // ranks first).
  return topk(where(p > 0.0, p / exponential, full_like(p, -1.0)), num_samples, -1).indices;
}

Tensor randperm(int64_t n, Generator* gen, DType dtype, const Loc& loc) {
  CallSiteScope site(loc);
  if (n < 0) op_fail("randperm", loc, "n must be non-negative, got {}", n);
  if (is_floating(dtype) || dtype == boolean)
    op_fail("randperm", loc, "the dtype must be an integer type, got {}", name(dtype));
  if (n == 0) return zeros({0}, dtype);
  return cast(argsort(rand({n}, f64, gen)), dtype);
}

}  // namespace mixtape
