// mixtape/dsl/attention.h -- fused attention: the Attention and AttentionBackward primitives, the
// geometry their kernels read, and the materialized composite kept as the oracle.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "mixtape/dsl/node.h"
#include "mixtape/dsl/random.h"
#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// Dropout on attention's weights (torch's dropout_p): the probability p a weight is dropped,
/// and the Philox stream it is drawn from, a generator's seed and the offset (0-d i64) it handed
/// out for the [batch..., Tq, Tk] weights. p == 0: none (offset undefined).
struct AttentionDropout {
  double p = 0;
  uint64_t seed = 0;
  Tensor offset;
  /// Draws Tq*Tk counters per batch element from `gen` (the default generator where null), as
  /// dropout(weights, p, true, gen) does; none where p == 0.
  static AttentionDropout draw(double p, Generator* gen, const Shape& weights);
  /// An Attention or AttentionBackward node's dropout (its attrs and last input).
  static AttentionDropout of(const Node& node);
};

/// The keep-or-drop decision of each weight, for kernels: weight n (row-major over [batch...,
/// Tq, Tk]) is kept, times 1/(1-p), where element n of rand's f32 stream (seed, offset) is >= p
/// rounded to f32, as `rand(shape, f32, gen) >= p` decides it (runtime/random_fill.h: word n % 4
/// of philox4x32(offset + n / 4, 0, seed), its top 24 bits times 2^-24).
struct DropoutDraw {
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;  // kept where the top 24 bits of the word are >= this
  float p = 0;             // the same test on rand's f32 element: kept where it is >= p
  double keep_scale = 1;   // 1/(1-p); 0 where p == 1
  /// The draw of a node whose offset input has its value.
  static DropoutDraw of(const Node& node);
  /// The same without reading the offset (left 0), for kernels that read it on the device.
  static DropoutDraw decisions(const Node& node);
  /// out[j] = keep_scale (as T) or 0 for weights first .. first + count - 1.
  template <typename T>
  void scales(uint64_t first, int64_t count, T* out) const {
    const T kept = static_cast<T>(keep_scale);
    for (int64_t j = 0; j < count;) {
      const std::array<uint32_t, 4> w = philox4x32(offset + first / 4, 0, seed);
      for (uint64_t lane = first % 4; lane < 4 && j < count; ++lane, ++j, ++first)
        out[j] = (w[lane] >> 8) >= threshold ? kept : T(0);
    }
  }
};

/// dropout(softmax(q k^T * scale + mask)) v over q [batch..., Tq, D], k [batch..., Tk, D], v
/// [batch..., Tk, Dv] of one batch shape, as one node whose kernels never hold the [Tq, Tk]
/// scores. `mask` (may be undefined) has the scores' rank, each dim 1 or the scores': bool (true
/// where a query may attend) or floating (added to the scaled scores); it must not require grad.
/// `causal` masks keys after each query (Tq == Tk). A query that may attend to no key gets zeros
/// and zero gradients. `dropout` (p < 1) drops weights after the softmax, as torch's dropout_p.
Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                         bool causal, double scale, const AttentionDropout& dropout = {},
                         const Loc& loc = Loc::current());
/// The gradients of attention_forward's q, k and v for the output gradient `grad_out`, given its
/// output `out`, packed along the last axis: [batch..., Tq*D + Tk*D + Tk*Dv]. Not differentiable
/// itself (the op table says so): a backward pass that builds a graph (create_graph) uses the
/// materialized gradient instead (attention_gradients).
Tensor attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& grad_out, const Tensor& mask, bool causal, double scale,
                          const AttentionDropout& dropout = {}, const Loc& loc = Loc::current());

/// What the kernels of an Attention or AttentionBackward node read: sizes, and where each
/// (batch, query) row of the mask starts.
struct AttentionGeometry {
  int64_t batch = 1, tq = 0, tk = 0, d = 0, dv = 0;
  bool causal = false;
  double scale = 1;
  bool has_mask = false, bool_mask = false, has_dropout = false;
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
/// The materialized form: scores [.., Tq, Tk], a softmax, dropout(weights, dropout_p, true, gen)
/// where dropout_p > 0, a matmul (every node in the policy's types). scaled_dot_product_attention's
/// oracle, and what it runs where the fused op does not apply (a floating mask that requires grad).
Tensor attention_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                           bool causal, double scale, double dropout_p = 0,
                           Generator* gen = nullptr);
/// The gradients of attention_forward for `grad_out` as DSL code over the materialized weights
/// (and the dropout mask, drawn again from the same stream): differentiable, for backward passes
/// that build a graph.
std::array<Tensor, 3> attention_gradients(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& mask, bool causal, double scale,
                                          const AttentionDropout& dropout, const Tensor& grad_out);
/// q, k, v (and the mask, raised to the scores' rank) with one batch shape and dtype, checked;
/// then the fused op if `fused` and the mask takes no gradient, else the composite. Weights are
/// dropped with probability dropout_p (from `gen`, the default generator where null): both forms
/// draw the same mask from the same generator state. The entry point of both
/// scaled_dot_product_attention overloads and of CausalSelfAttention.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                 std::optional<double> scale, bool fused, const Loc& loc, double dropout_p = 0,
                 Generator* gen = nullptr);
}  // namespace detail

}  // namespace mixtape
