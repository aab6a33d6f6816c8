// dsl/functional.h -- composite ops written as DSL code: softmax, norms, losses, dropout,
// attention.
#pragma once

#include <optional>

#include "dsl/ops.h"

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

enum class Reduction { Mean, Sum, None };

struct CrossEntropyOptions {
  Reduction reduction = Reduction::Mean;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
};
/// logits [..., C] against integer class targets [...]. Mean is over the targets that are not
/// ignore_index, as in PyTorch.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, CrossEntropyOptions options = {},
                     const Loc& loc = Loc::current());
Tensor mse_loss(const Tensor& prediction, const Tensor& target,
                Reduction reduction = Reduction::Mean, const Loc& loc = Loc::current());

/// Zeroes each element with probability p and scales the rest by 1/(1-p) when training;
/// the mask comes from the Philox stream, so a seeded run is reproducible.
Tensor dropout(const Tensor& x, double p, bool training = true, Generator* gen = nullptr,
               const Loc& loc = Loc::current());

/// [size, size] bool, true where key position <= query position.
Tensor causal_mask(int64_t size, const Loc& loc = Loc::current());
/// softmax(q k^T / sqrt(d) [masked]) v over [..., T, d] operands.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal = false, const Loc& loc = Loc::current());

}  // namespace mixtape
