// mixtape/dsl/transformer_layers.cpp -- torch.nn.TransformerEncoderLayer and TransformerEncoder.
#include "mixtape/dsl/transformer_layers.h"

#include <string>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/ops.h"

namespace mixtape {

TransformerEncoderLayer::TransformerEncoderLayer(int64_t d_model, int64_t nhead,
                                                 TransformerEncoderLayerOptions options,
                                                 Generator* gen)
    : self_attn(d_model, nhead, options.dropout, true, options.batch_first, gen),
      linear1(d_model, options.dim_feedforward, true, gen),
      dropout(options.dropout, gen),
      linear2(options.dim_feedforward, d_model, true, gen),
      norm1(d_model, options.layer_norm_eps),
      norm2(d_model, options.layer_norm_eps),
      dropout1(options.dropout, gen),
      dropout2(options.dropout, gen),
      options(options) {
  register_module("self_attn", self_attn);
  register_module("linear1", linear1);
  register_module("dropout", dropout);
  register_module("linear2", linear2);
  register_module("norm1", norm1);
  register_module("norm2", norm2);
  register_module("dropout1", dropout1);
  register_module("dropout2", dropout2);
}

Tensor TransformerEncoderLayer::operator()(const Tensor& src, const Tensor& src_mask,
                                           const Tensor& src_key_padding_mask, bool is_causal,
                                           const Loc& loc) const {
  CallSiteScope site(loc);
  ModulePathScope scope = forward_scope();
  const char* op = "TransformerEncoderLayer";
  if (!src.defined() || (src.dim() != 2 && src.dim() != 3))
    op_fail(op, loc, "src must be [{}, E] or an unbatched [S, E], got {}",
            options.batch_first ? "N, S" : "S, N",
            src.defined() ? to_string(src.shape()) : "undefined");
  // An unbatched sequence runs as a batch of one, as torch's.
  const bool unbatched = src.dim() == 2;
  const int64_t batch_axis = options.batch_first ? 0 : 1;
  Tensor x = unbatched ? unsqueeze(src, batch_axis, loc) : src;
  Tensor padding = src_key_padding_mask;
  if (unbatched && padding.defined()) {
    if (padding.dim() != 1)
      op_fail(op, loc, "an unbatched src takes a key padding mask [S], got {}",
              to_string(padding.shape()));
    padding = unsqueeze(padding, 0, loc);
  }
  auto self_attention = [&](const Tensor& h) {
    return dropout1(self_attn(h, h, h, padding, false, src_mask, true, is_causal).output);
  };
  auto feed_forward = [&](const Tensor& h) {
    return dropout2(linear2(dropout(activate(options.activation, linear1(h)))));
  };
  if (options.norm_first) {
    x = x + self_attention(norm1(x));
    x = x + feed_forward(norm2(x));
  } else {
    x = norm1(x + self_attention(x));
    x = norm2(x + feed_forward(x));
  }
  return unbatched ? squeeze(x, batch_axis) : x;
}

TransformerEncoder::TransformerEncoder(int64_t d_model, int64_t nhead, int64_t num_layers,
                                       TransformerEncoderLayerOptions options, bool final_norm,
                                       Generator* gen) {
  if (num_layers < 1) fail("TransformerEncoder: num_layers must be at least 1, got {}", num_layers);
  for (int64_t i = 0; i < num_layers; ++i) layers.emplace_back(d_model, nhead, options, gen);
  register_module("layers", layers);
  if (final_norm) {
    norm = std::make_unique<LayerNorm>(d_model, options.layer_norm_eps);
    register_module("norm", *norm);
  }
}

TransformerEncoder::~TransformerEncoder() = default;

Tensor TransformerEncoder::operator()(const Tensor& src, const Tensor& mask,
                                      const Tensor& src_key_padding_mask, bool is_causal,
                                      const Loc& loc) const {
  CallSiteScope site(loc);
  ModulePathScope scope = forward_scope();
  Tensor x = src;
  for (const auto& layer : layers) x = (*layer)(x, mask, src_key_padding_mask, is_causal);
  return norm ? (*norm)(x) : x;
}

}  // namespace mixtape
