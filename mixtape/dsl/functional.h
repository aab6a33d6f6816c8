// mixtape/dsl/functional.h -- composite ops written as DSL code: softmax, norms, losses, dropout,
// attention.
#pragma once

#include <optional>
#include <type_traits>

#include "mixtape/dsl/ops.h"

namespace mixtape {

Tensor softmax(const Tensor& x, int64_t axis = -1, const Loc& loc = Loc::current());
/// softmax(where(mask, x, -inf)) with the mask (bool, broadcast to x) applied inside, so that
/// the backward pass keeps only the result, as attention's causal or padding masks want.
Tensor masked_softmax(const Tensor& x, const Tensor& mask, int64_t axis = -1,
                      const Loc& loc = Loc::current());
Tensor log_softmax(const Tensor& x, int64_t axis = -1, const Loc& loc = Loc::current());
Tensor logsumexp(const Tensor& x, std::vector<int64_t> axes = {-1}, bool keepdim = false,
                 const Loc& loc = Loc::current());

/// Normalizes over the last `normalized_dims` axes; weight and bias (optional) have that shape.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5,
                  int64_t normalized_dims = 1, const Loc& loc = Loc::current());
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6,
                const Loc& loc = Loc::current());

/// x @ weight^T + bias with weight [out, in] as in PyTorch; bias may be undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              const Loc& loc = Loc::current());

/// PyTorch's reduction strings. BatchMean ('batchmean': the sum over the size of the first
/// dim) is kl_div's alone; the other losses refuse it with an mt::Error, as PyTorch does.
enum class Reduction { Mean, Sum, None, BatchMean };

struct CrossEntropyOptions {
  Reduction reduction = Reduction::Mean;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  Tensor weight = Tensor();  // optional: one floating-point weight per class, [C]
};
/// logits [..., C] against integer class targets [...]. Mean is over the targets that are not
/// ignore_index, as in PyTorch; with a class weight it is PyTorch's weighted mean,
/// sum(w[y] l) / sum(w[y]), and label smoothing's term weighs each class's -log p by its weight
/// (normalized by the same sum(w[y]), as PyTorch's). Floating-point targets of the logits' shape
/// are class probabilities (PyTorch's soft targets): -sum_c w_c t_c log p_c per row, smoothed as
/// t (1 - label_smoothing) + label_smoothing / C, Mean over the rows; an ignore_index of a class
/// (>= 0) is refused.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, CrossEntropyOptions options = {},
                     const Loc& loc = Loc::current());
Tensor mse_loss(const Tensor& prediction, const Tensor& target,
                Reduction reduction = Reduction::Mean, const Loc& loc = Loc::current());
/// Losses with PyTorch's definitions. nll_loss takes log-probabilities [..., C] (classes last, as
/// cross_entropy's logits) and integer targets [...]; binary_cross_entropy probabilities, each
/// log clamped at -100 as PyTorch's; kl_div the input as log-probabilities and the target as
/// probabilities (or log-probabilities with log_target), 0 log 0 taken as 0.
Tensor nll_loss(const Tensor& log_probs, const Tensor& targets,
                Reduction reduction = Reduction::Mean, int64_t ignore_index = -100,
                const Loc& loc = Loc::current());
struct NllLossOptions {
  Tensor weight = Tensor();  // optional: one floating-point weight per class, [C]
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
};
/// F.nll_loss(input, target, weight, ignore_index=, reduction=): -w[y] log_probs[y] per target,
/// the mean being sum(w[y] l) / sum(w[y]) over the targets that are not ignore_index.
Tensor nll_loss(const Tensor& log_probs, const Tensor& targets, const NllLossOptions& options,
                const Loc& loc = Loc::current());
Tensor binary_cross_entropy(const Tensor& probs, const Tensor& targets,
                            Reduction reduction = Reduction::Mean, const Loc& loc = Loc::current());
struct BceOptions {
  Tensor weight =
      Tensor();  // optional: broadcast to the input's shape, multiplies each element's loss
  Reduction reduction = Reduction::Mean;
};
Tensor binary_cross_entropy(const Tensor& probs, const Tensor& targets, const BceOptions& options,
                            const Loc& loc = Loc::current());
Tensor l1_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean,
               const Loc& loc = Loc::current());
Tensor smooth_l1_loss(const Tensor& input, const Tensor& target,
                      Reduction reduction = Reduction::Mean, double beta = 1.0,
                      const Loc& loc = Loc::current());
Tensor huber_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean,
                  double delta = 1.0, const Loc& loc = Loc::current());
Tensor kl_div(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean,
              bool log_target = false, const Loc& loc = Loc::current());

struct BceWithLogitsOptions {
  Reduction reduction = Reduction::Mean;
  Tensor weight =
      Tensor();  // optional: broadcast to the logits' shape, multiplies each element's loss
  Tensor pos_weight =
      Tensor();  // optional: the weight of the positive term, broadcast over the classes
};
/// Binary cross-entropy of sigmoid(logits) against targets in [0, 1], as PyTorch's
/// binary_cross_entropy_with_logits: max(x, 0) - x y + log(1 + exp(-|x|)), which neither
/// overflows nor loses the small probabilities, with weight and pos_weight as PyTorch's.
Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& targets,
                                        BceWithLogitsOptions options = {},
                                        const Loc& loc = Loc::current());

/// x limited to [min, max] (either optional), as torch.clamp: NaN stays NaN, min > max gives max,
/// and the gradient passes where min <= x <= max.
Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max,
             const Loc& loc = Loc::current());
/// torch.clip: clamp under its other name.
inline Tensor clip(const Tensor& x, std::optional<double> min, std::optional<double> max,
                   const Loc& loc = Loc::current()) {
  return clamp(x, min, max, loc);
}
/// torch.where with a number for either value or both: the number takes the tensor's type as
/// PyTorch's promotion gives it (a float number with an integer tensor gives f32, an integer
/// one with a bool tensor i64); two numbers give f32, or i64 when both are integers.
/// Integer numbers are exact (beyond 2^53 too); one an i32 tensor cannot hold gives i64.
namespace detail {
Tensor where_number(const Tensor& cond, const Tensor& tensor, const Operand& number,
                    bool boolean_number, bool number_first, const Loc& loc);
Tensor where_numbers(const Tensor& cond, const Operand& a, const Operand& b, const Loc& loc);
}  // namespace detail
template <typename S>
requires std::is_arithmetic_v<S> Tensor where(const Tensor& cond, S a, const Tensor& b,
                                              const Loc& loc = Loc::current()) {
  return detail::where_number(cond, b, Operand(a, loc), std::is_same_v<S, bool>, true, loc);
}
template <typename S>
requires std::is_arithmetic_v<S> Tensor where(const Tensor& cond, const Tensor& a, S b,
                                              const Loc& loc = Loc::current()) {
  return detail::where_number(cond, a, Operand(b, loc), std::is_same_v<S, bool>, false, loc);
}
template <typename S, typename T>
requires std::is_arithmetic_v<S> && std::is_arithmetic_v<T> Tensor
where(const Tensor& cond, S a, T b, const Loc& loc = Loc::current()) {
  return detail::where_numbers(cond, Operand(a, loc), Operand(b, loc), loc);
}
/// value where mask (bool, broadcast to x) is true, else x: torch's masked_fill.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value,
                   const Loc& loc = Loc::current());

/// PyTorch's remainder: a - b floor(a / b), with the sign of the divisor (Python's %).
Tensor remainder(const Tensor& a, const Tensor& b, const Loc& loc = Loc::current());
/// Bool tests of each element; false for every integer but isfinite's true.
Tensor isnan(const Tensor& x, const Loc& loc = Loc::current());
Tensor isinf(const Tensor& x, const Loc& loc = Loc::current());
Tensor isfinite(const Tensor& x, const Loc& loc = Loc::current());
/// Element-wise logic on truth values (non-zero is true), as torch.logical_*: bool results.
Tensor logical_not(const Tensor& x, const Loc& loc = Loc::current());
Tensor logical_and(const Tensor& a, const Tensor& b, const Loc& loc = Loc::current());
Tensor logical_or(const Tensor& a, const Tensor& b, const Loc& loc = Loc::current());
Tensor logical_xor(const Tensor& a, const Tensor& b, const Loc& loc = Loc::current());

/// Activations with PyTorch's definitions, defaults and gradients at the kinks.
Tensor softplus(const Tensor& x, double beta = 1.0, double threshold = 20.0,
                const Loc& loc = Loc::current());
Tensor leaky_relu(const Tensor& x, double negative_slope = 0.01, const Loc& loc = Loc::current());
Tensor elu(const Tensor& x, double alpha = 1.0, const Loc& loc = Loc::current());
Tensor selu(const Tensor& x, const Loc& loc = Loc::current());
Tensor mish(const Tensor& x, const Loc& loc = Loc::current());
Tensor hardsigmoid(const Tensor& x, const Loc& loc = Loc::current());
Tensor hardswish(const Tensor& x, const Loc& loc = Loc::current());
/// start + weight (end - start), in PyTorch's two forms (exact at weights 0 and 1).
Tensor lerp(const Tensor& start, const Tensor& end, const Tensor& weight,
            const Loc& loc = Loc::current());

/// Shape and indexing with PyTorch's semantics: flip reverses the axes; roll shifts elements
/// along each axis (those pushed off the end come back at the start; no axes and one shift roll
/// the flattened tensor, as torch.roll(x, shift)); tril/triu keep the
/// elements on and below / above the `diagonal`-th diagonal of the last two axes; repeat
/// tiles x (torch.Tensor.repeat: one count per dim, extra counts add leading dims); tile pads
/// the counts with leading 1s instead (torch.tile).
Tensor flip(const Tensor& x, const std::vector<int64_t>& axes, const Loc& loc = Loc::current());
Tensor roll(const Tensor& x, const std::vector<int64_t>& shifts, const std::vector<int64_t>& axes,
            const Loc& loc = Loc::current());
Tensor tril(const Tensor& x, int64_t diagonal = 0, const Loc& loc = Loc::current());
Tensor triu(const Tensor& x, int64_t diagonal = 0, const Loc& loc = Loc::current());
Tensor repeat(const Tensor& x, const std::vector<int64_t>& repeats,
              const Loc& loc = Loc::current());
Tensor tile(const Tensor& x, const std::vector<int64_t>& reps, const Loc& loc = Loc::current());

/// torch.std (Bessel's correction 1 by default); `std` would shadow the namespace.
Tensor std_dev(const Tensor& x, std::vector<int64_t> axes = {}, bool keepdim = false,
               double correction = 1.0, const Loc& loc = Loc::current());
/// The vector p-norm over `axes` (all when empty) for p = 1, 2 or inf.
Tensor norm(const Tensor& x, double p = 2.0, std::vector<int64_t> axes = {}, bool keepdim = false,
            const Loc& loc = Loc::current());
/// Index (i64) of the first smallest element, as torch.argmin (a NaN wins).
Tensor argmin(const Tensor& x, std::optional<int64_t> axis = std::nullopt, bool keepdim = false,
              const Loc& loc = Loc::current());
/// Whether any / every element over `axes` (all when empty) is non-zero: bool.
Tensor any(const Tensor& x, std::vector<int64_t> axes = {}, bool keepdim = false,
           const Loc& loc = Loc::current());
Tensor all(const Tensor& x, std::vector<int64_t> axes = {}, bool keepdim = false,
           const Loc& loc = Loc::current());
/// 1 with probability p (each element of p), else 0, in p's dtype.
Tensor bernoulli(const Tensor& p, Generator* gen = nullptr, const Loc& loc = Loc::current());
/// Uniform integers (i64) in [low, high).
Tensor randint(int64_t low, int64_t high, Shape shape, Generator* gen = nullptr,
               const Loc& loc = Loc::current());

enum class PadMode { Constant, Reflect, Replicate, Circular };
/// Pads x as torch.nn.functional.pad: `pads` holds (before, after) pairs from the last axis
/// backwards, (left, right, top, bottom, ...). Constant fills with `value` and takes negative
/// pads (which crop); Reflect mirrors without repeating the edge (each pad below the axis's
/// size); Replicate repeats the edge; Circular wraps around, the axis's end before it and its
/// start after it (each pad at most the axis's size).
Tensor pad(const Tensor& x, const std::vector<int64_t>& pads, PadMode mode = PadMode::Constant,
           double value = 0.0, const Loc& loc = Loc::current());

/// x cut along `axis` into pieces of `size` (the last may be smaller), or of the given sizes,
/// as torch.split; chunk into `chunks` pieces as torch.chunk. The pieces are views of x.
std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t axis = 0,
                          const Loc& loc = Loc::current());
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t axis = 0,
                          const Loc& loc = Loc::current());
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t axis = 0,
                          const Loc& loc = Loc::current());

/// Zeroes each element with probability p and scales the rest by 1/(1-p) when training;
/// the mask comes from the Philox stream, so a seeded run is reproducible.
Tensor dropout(const Tensor& x, double p, bool training = true, Generator* gen = nullptr,
               const Loc& loc = Loc::current());

/// [size, size] bool, true where key position <= query position.
Tensor causal_mask(int64_t size, const Loc& loc = Loc::current());
/// The same for `queries` rows over `keys` columns, aligned at the top left (query i sees keys
/// 0..i), as PyTorch's is_causal (torch.ones(L, S).tril()).
Tensor causal_mask(int64_t queries, int64_t keys, const Loc& loc = Loc::current());
/// softmax(q k^T / sqrt(d) [masked]) v over [..., T, d] operands.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal = false, const Loc& loc = Loc::current());

}  // namespace mixtape
