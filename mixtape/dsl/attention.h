// mixtape/dsl/attention.h -- fused attention: the Attention and AttentionBackward primitives, the
// geometry their kernels read, and the materialized composite kept as the oracle.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "mixtape/dsl/node.h"
#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// softmax(q k^T * scale + mask) v over q [batch..., Tq, D], k [batch..., Tk, D], v [batch...,
/// Tk, Dv] of one batch shape, as one node whose kernels never hold the [Tq, Tk] scores. `mask`
/// (may be undefined) has the scores' rank, each dim 1 or the scores': bool (true where a query
/// may attend) or floating (added to the scaled scores); it must not require grad. `causal`
/// masks keys after each query (Tq == Tk). A query that may attend to no key gets zeros and zero
/// gradients.
Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                         bool causal, double scale, const Loc& loc = Loc::current());
/// The gradients of attention_forward's q, k and v for the output gradient `grad_out`, given its
/// output `out`, packed along the last axis: [batch..., Tq*D + Tk*D + Tk*Dv]. Not differentiable
/// itself (the op table says so): a backward pass that builds a graph (create_graph) uses the
/// materialized gradient instead (attention_gradients).
Tensor attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& grad_out, const Tensor& mask, bool causal, double scale,
                          const Loc& loc = Loc::current());

/// What the kernels of an Attention or AttentionBackward node read: sizes, and where each
/// (batch, query) row of the mask starts.
struct AttentionGeometry {
  int64_t batch = 1, tq = 0, tk = 0, d = 0, dv = 0;
  bool causal = false;
  double scale = 1;
  bool has_mask = false, bool_mask = false;
  int64_t mask_row_stride = 0, mask_col_stride = 0;  // 0 where the mask broadcasts
  std::vector<int64_t> mask_batch_offset;            // per flattened batch index
  static AttentionGeometry of(const Node& node);
  int64_t mask_offset(int64_t b, int64_t i) const {
    return mask_batch_offset[static_cast<size_t>(b)] + i * mask_row_stride;
  }
  /// The first key a causal query i may not see (tk without a causal mask).
  int64_t key_end(int64_t i) const { return causal ? i + 1 : tk; }
};

namespace detail {
/// The materialized form: scores [.., Tq, Tk], a softmax, a matmul (every node in the policy's
/// types). scaled_dot_product_attention's oracle, and what it runs where the fused op does not
/// apply (a floating mask that requires grad).
Tensor attention_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                           bool causal, double scale);
/// The gradients of attention_composite for `grad_out` as DSL code over the materialized
/// weights: differentiable, for backward passes that build a graph.
std::array<Tensor, 3> attention_gradients(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& mask, bool causal, double scale,
                                          const Tensor& grad_out);
/// q, k, v (and the mask, raised to the scores' rank) with one batch shape and dtype, checked;
/// then the fused op if `fused` and the mask takes no gradient, else the composite. The entry
/// point of both scaled_dot_product_attention overloads.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                 std::optional<double> scale, bool fused, const Loc& loc);
}  // namespace detail

}  // namespace mixtape
