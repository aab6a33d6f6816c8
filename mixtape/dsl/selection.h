// mixtape/dsl/selection.h -- products, sorting and selection along an axis, data-dependent
// selection and sampling without replacement: torch.prod, sort, topk, take_along_dim,
// masked_select, nonzero, multinomial and randperm, over the scan, sort and gather primitives.
#pragma once

#include <optional>

#include "mixtape/dsl/ops.h"

namespace mixtape {

/// A sort's or topk's result, as PyTorch's (values, indices) named tuple: `auto [v, i] = ...`.
struct ValuesIndices {
  Tensor values;
  Tensor indices;  // i64
};

/// The product of the elements along dim (of all elements without one), as torch.prod: integer
/// and bool inputs give i64, an empty axis gives 1. Autocast runs it in f32 (PyTorch's fp32
/// list). The gradient is exact where x has zeros (one zero: the product of the others there).
Tensor prod(const Tensor& x, std::optional<int64_t> dim = std::nullopt, bool keepdim = false,
            const Loc& loc = Loc::current());

/// x sorted along dim and the indices that sort it, as torch.sort: NaN above +inf, every sort
/// stable (equal elements keep their order; `stable` is accepted for PyTorch's signature).
/// The values' gradient flows back through the indices.
ValuesIndices sort(const Tensor& x, int64_t dim = -1, bool descending = false, bool stable = false,
                   const Loc& loc = Loc::current());
/// The k largest (smallest) elements along dim and their indices, as torch.topk, in sorted order
/// (also when sorted is false, which PyTorch leaves unspecified); NaN counts as the largest, and
/// of equal elements the first comes first. k above the size is an error.
ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true,
                   bool sorted = true, const Loc& loc = Loc::current());

/// torch.take_along_dim: x and indices broadcast against each other outside dim, then gathered
/// along it; without dim, both are flattened.
Tensor take_along_dim(const Tensor& x, const Tensor& indices,
                      std::optional<int64_t> dim = std::nullopt, const Loc& loc = Loc::current());

/// The elements of x where the bool mask (broadcast with x) is true, as a 1-d tensor in row-major
/// order (torch.masked_select), with the gradient scattered back to those elements. The result's
/// size depends on the mask's values, so the mask is evaluated and read on the host when this is
/// called (a sync with a device; inside mt::compile, a side effect that stops the replay).
Tensor masked_select(const Tensor& x, const Tensor& mask, const Loc& loc = Loc::current());
/// The positions of x's non-zero elements (NaN counts), [count, x.dim()] i64 in row-major order,
/// as torch.nonzero. Like masked_select it reads x on the host when called.
Tensor nonzero(const Tensor& x, const Loc& loc = Loc::current());

/// num_samples category indices (i64) per row of probs ([n] or [rows, n], non-negative weights
/// that need not sum to 1), as torch.multinomial. With replacement: inverse-CDF draws, compared
/// against every category at once ([rows, num_samples, n] bools). Without: PyTorch's own
/// method, the num_samples largest of probs / Exp(1) draws, so zero weights come last. The
/// weights are checked as torch's are, in the graph (no host read, and compiled replays check
/// too): evaluating the draws is an mt::Error naming multinomial and the caller's line when a
/// row holds a negative, infinite or NaN weight (reported as index -1) or no positive weight
/// (-2). As torch's CPU kernel, draws without replacement past a row's positive weights take its
/// zero-weight categories last.
Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement = false,
                   Generator* gen = nullptr, const Loc& loc = Loc::current());
/// A random permutation of 0 .. n-1 (i64), as torch.randperm: the order of n uniform draws.
Tensor randperm(int64_t n, Generator* gen = nullptr, DType dtype = i64,
                const Loc& loc = Loc::current());

}  // namespace mixtape
