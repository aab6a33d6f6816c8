// mixtape/dsl/sequence_layers.h -- PyTorch's sequence layers as DSL code over the existing ops:
// scaled_dot_product_attention with masks, MultiheadAttention, LSTM and GRU, with torch.nn's
// parameter names, layouts, initialization and defaults.
#pragma once

#include <concepts>
#include <optional>
#include <utility>
#include <vector>

#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/module.h"
#include "mixtape/dsl/nn.h"

namespace mixtape {

/// torch.nn.functional.scaled_dot_product_attention over [..., L, E] queries and [..., S, E]
/// keys, [..., S, Ev] values: softmax(q k^T * scale + mask) v with scale 1/sqrt(E) by default.
/// `attn_mask` broadcasts to [..., L, S]: bool (true where a query may attend) or a float added to
/// the scores; `causal` masks keys after each query too (query i sees keys 0..i, PyTorch's top-left
/// alignment where L != S). A query whose keys are all masked gets
/// zeros and a zero gradient (PyTorch gives NaN there). dropout_p drops weights after the
/// softmax (PyTorch's dropout_p: the rest scaled by 1/(1-p)), drawn from `gen` (the default
/// generator where null) as dropout(weights, dropout_p, true, gen) draws them; pass 0 in eval.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, bool causal = false,
                                    std::optional<double> scale = std::nullopt,
                                    double dropout_p = 0, Generator* gen = nullptr,
                                    const Loc& loc = Loc::current());
/// PyTorch's order puts dropout_p before is_causal: (q, k, v, mask, 0.1) or (q, k, v, mask, 0.0,
/// true) would take the float as `causal` and the bool as the scale here, so they are refused at
/// compile time (pass the causal flag as a bool, dropout_p after the scale).
template <std::floating_point DropoutInTorchOrder>
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, DropoutInTorchOrder dropout_p,
                                    bool is_causal = false) = delete;

/// torch.nn.MultiheadAttention: in_proj_weight [3E, E], in_proj_bias [3E], out_proj.weight [E, E],
/// out_proj.bias [E]; batch_first false takes [L, N, E] as PyTorch's default does.
class MultiheadAttention : public Module {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout = 0.0, bool bias = true,
                     bool batch_first = false, Generator* gen = nullptr);
  struct Result {
    Tensor output;  // [L, N, E] ([N, L, E] batch first)
    Tensor
        weights;  // [N, L, S] averaged over heads (per head: [N, H, L, S]); undefined unless asked
  };
  /// key_padding_mask: bool [N, S], true for keys to ignore (PyTorch's sense); attn_mask: bool
  /// [L, S] or [N * H, L, S], true for pairs to ignore, or float added to the scores.
  Result operator()(const Tensor& query, const Tensor& key, const Tensor& value,
                    const Tensor& key_padding_mask = Tensor(), bool need_weights = true,
                    const Tensor& attn_mask = Tensor(), bool average_attn_weights = true,
                    bool is_causal = false, const Loc& loc = Loc::current()) const;
  Tensor in_proj_weight, in_proj_bias;
  Linear out_proj;
  int64_t embed_dim, num_heads;
  double dropout;
  bool batch_first;

 private:
  Generator* gen_;
};

/// What torch.nn.LSTM and torch.nn.GRU share: weight_ih_l{k} [G H, in], weight_hh_l{k} [G H, H],
/// bias_ih_l{k}, bias_hh_l{k} with G = 4 gates (i, f, g, o) or 3 (r, z, n), all
/// U(-1/sqrt(H), 1/sqrt(H)); dropout between layers when training. Bidirectional: each layer
/// also runs backwards in time with its own weight_ih_l{k}_reverse, ... (registered after the
/// forward direction's, as torch's), the directions' outputs concatenated [..., 2 H] (the next
/// layer's input) and their states in h_n as (layer 0 forward, layer 0 backward, layer 1
/// forward, ...). Input [T, N, in] ([N, T, in] batch first, or [T, in] unbatched), T >= 1; each
/// returns the last layer's outputs at every step and each layer's and direction's last state
/// [layers * directions, N, H] (LSTM: h and c). The bidirectional flag comes last (after gen),
/// so that a torch-ordered `true` there does not compile as a Generator*.
class Recurrent : public Module {
 public:
  int64_t input_size, hidden_size, num_layers;
  bool batch_first;
  double dropout;
  bool bidirectional;
  /// Per layer and direction, index layer * directions() + direction. Registered by address: an
  /// element may be assigned another tensor (which is then the parameter), the vectors not resized.
  std::vector<Tensor> weight_ih, weight_hh, bias_ih, bias_hh;
  int64_t directions() const { return bidirectional ? 2 : 1; }

 protected:
  Recurrent(const char* kind, int64_t gates, int64_t input_size, int64_t hidden_size,
            int64_t num_layers, bool bias, bool batch_first, double dropout, Generator* gen,
            bool bidirectional);
  Generator* gen_;
};

class LSTM : public Recurrent {
 public:
  LSTM(int64_t input_size, int64_t hidden_size, int64_t num_layers = 1, bool bias = true,
       bool batch_first = false, double dropout = 0.0, Generator* gen = nullptr,
       bool bidirectional = false);
  struct Result {
    Tensor output, h_n, c_n;
  };
  /// h0 and c0 are given together or not at all (zeros), as torch's (h0, c0) tuple.
  Result operator()(const Tensor& x, const Tensor& h0 = Tensor(), const Tensor& c0 = Tensor(),
                    const Loc& loc = Loc::current()) const;
};

class GRU : public Recurrent {
 public:
  GRU(int64_t input_size, int64_t hidden_size, int64_t num_layers = 1, bool bias = true,
      bool batch_first = false, double dropout = 0.0, Generator* gen = nullptr,
      bool bidirectional = false);
  struct Result {
    Tensor output, h_n;
  };
  Result operator()(const Tensor& x, const Tensor& h0 = Tensor(),
                    const Loc& loc = Loc::current()) const;
};

}  // namespace mixtape
