// mixtape/dsl/transformer_layers.h -- torch.nn.TransformerEncoderLayer and TransformerEncoder.
#pragma once

#include <cstdint>
#include <memory>

#include "mixtape/dsl/module.h"
#include "mixtape/dsl/nn.h"
#include "mixtape/dsl/sequence_layers.h"

namespace mixtape {

/// torch.nn.TransformerEncoderLayer's options after d_model and nhead, PyTorch's defaults.
struct TransformerEncoderLayerOptions {
  int64_t dim_feedforward = 2048;
  double dropout = 0.1;
  /// Between linear1 and linear2: Relu or Gelu (torch's "relu" and "gelu", the erf form); any
  /// other Activation is accepted too (GeluTanh, Silu, Tanh), as torch accepts a callable.
  Activation activation = Activation::Relu;
  double layer_norm_eps = 1e-5;
  bool batch_first = false;
  /// Pre-norm (x + sa(norm1(x)), then x + ff(norm2(x))); false: post-norm, torch's default
  /// (norm1(x + sa(x)), then norm2(x + ff(x))).
  bool norm_first = false;
};

/// torch.nn.TransformerEncoderLayer: self-attention and a feed-forward block, each with dropout
/// and a residual sum, with its submodules' names (self_attn, linear1, dropout, linear2, norm1,
/// norm2, dropout1, dropout2), so its state_dict loads torch's. Input [S, N, E] ([N, S, E] batch
/// first) or an unbatched [S, E]; src_mask: bool [S, S] or [N * nhead, S, S] (true: not
/// attended) or float (added to the scores); src_key_padding_mask: bool [N, S] ([S] unbatched),
/// true for padding keys; is_causal: each position attends to itself and those before it.
class TransformerEncoderLayer : public Module {
 public:
  TransformerEncoderLayer(int64_t d_model, int64_t nhead,
                          TransformerEncoderLayerOptions options = {}, Generator* gen = nullptr);
  Tensor operator()(const Tensor& src, const Tensor& src_mask = Tensor(),
                    const Tensor& src_key_padding_mask = Tensor(), bool is_causal = false,
                    const Loc& loc = Loc::current()) const;
  MultiheadAttention self_attn;
  Linear linear1;
  Dropout dropout;
  Linear linear2;
  LayerNorm norm1, norm2;
  Dropout dropout1, dropout2;
  TransformerEncoderLayerOptions options;
};

/// torch.nn.TransformerEncoder: num_layers encoder layers run in turn (registered layers.0,
/// layers.1, ...), then, with final_norm, a LayerNorm ("norm", the layers' eps). Unlike torch's,
/// which deep-copies one layer so that every layer starts from the same weights, each layer
/// draws its own initial weights from `gen`; a torch state_dict loads either way.
class TransformerEncoder : public Module {
 public:
  TransformerEncoder(int64_t d_model, int64_t nhead, int64_t num_layers,
                     TransformerEncoderLayerOptions options = {}, bool final_norm = false,
                     Generator* gen = nullptr);
  ~TransformerEncoder() override;  // out of line: its containers are destroyed in the .cpp
  Tensor operator()(const Tensor& src, const Tensor& mask = Tensor(),
                    const Tensor& src_key_padding_mask = Tensor(), bool is_causal = false,
                    const Loc& loc = Loc::current()) const;
  ModuleList<TransformerEncoderLayer> layers;
  std::unique_ptr<LayerNorm> norm;  // with final_norm
};

}  // namespace mixtape
