// mixtape/dsl/sequence_layers.cpp -- attention with masks, MultiheadAttention, LSTM and GRU.
#include "mixtape/dsl/sequence_layers.h"

#include <cmath>
#include <string>

#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"

namespace mixtape {

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, bool causal,
                                    std::optional<double> scale, double dropout_p, Generator* gen,
                                    const Loc& loc) {
  CallSiteScope site(loc, composite::scaled_dot_product_attention);
  const char* op = "scaled_dot_product_attention";
  for (const Tensor* t : {&q, &k, &v})
    if (!t->defined() || !is_floating(t->dtype()) || t->dim() < 2)
      op_fail(op, loc, "query, key and value must be floating tensors of rank >= 2");
  if (q.size(-1) != k.size(-1) || k.size(-2) != v.size(-2))
    op_fail(op, loc, "shapes q {} k {} v {} do not fit", to_string(q.shape()), to_string(k.shape()),
            to_string(v.shape()));
  const Shape scores = [&] {
    Shape qb(q.shape().begin(), q.shape().end() - 2), kb(k.shape().begin(), k.shape().end() - 2);
    Shape shape = broadcast_shapes(qb, kb).value_or(qb);
    shape.push_back(q.size(-2));
    shape.push_back(k.size(-2));
    return shape;
  }();
  if (attn_mask.defined()) {
    if (!broadcast_shapes(attn_mask.shape(), scores))
      op_fail(op, loc, "the mask {} does not broadcast to the scores {}",
              to_string(attn_mask.shape()), to_string(scores));
    if (attn_mask.dtype() != boolean && !is_floating(attn_mask.dtype()))
      op_fail(op, loc, "the mask must be bool or floating, got {}", name(attn_mask.dtype()));
  }
  return detail::attention(q, k, v, attn_mask, causal, scale, true, loc, dropout_p, gen);
}

// ---- MultiheadAttention ----

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout,
                                       bool bias, bool batch_first, Generator* gen)
    : out_proj(embed_dim, embed_dim, bias, gen),
      embed_dim(embed_dim),
      num_heads(num_heads),
      dropout(dropout),
      batch_first(batch_first),
      gen_(gen) {
  if (embed_dim <= 0 || num_heads <= 0 || embed_dim % num_heads != 0)
    fail("MultiheadAttention: embed_dim {} is not divisible by {} heads", embed_dim, num_heads);
  if (!(dropout >= 0 && dropout <= 1))
    fail("MultiheadAttention: dropout {} not in [0, 1]", dropout);
  // PyTorch's _reset_parameters: xavier_uniform_ over the packed [3E, E] weight, zero biases.
  in_proj_weight = init::xavier_uniform({3 * embed_dim, embed_dim}, 1.0, gen);
  register_parameter("in_proj_weight", &in_proj_weight);
  if (bias) {
    in_proj_bias = zeros({3 * embed_dim});
    register_parameter("in_proj_bias", &in_proj_bias);
    out_proj.bias.assign(zeros({embed_dim}));
  }
  register_module("out_proj", out_proj);
}

MultiheadAttention::Result MultiheadAttention::operator()(
    const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& key_padding_mask,
    bool need_weights, const Tensor& attn_mask, bool average_attn_weights, bool is_causal,
    const Loc& loc) const {
  CallSiteScope site(loc);
  ModulePathScope scope = forward_scope();
  const char* op = "MultiheadAttention";
  for (const Tensor* t : {&query, &key, &value}) {
    if (!t->defined() || t->dim() != 3 || t->size(2) != embed_dim)
      op_fail(op, loc, "query, key and value must be [{}, {}], got {}",
              batch_first ? "N, L" : "L, N", embed_dim,
              t->defined() ? to_string(t->shape()) : "undefined");
    // As torch's: an integer input is refused, not multiplied by the float weights.
    if (!is_floating(t->dtype()))
      op_fail(op, loc, "query, key and value must be floating-point, got {}", name(t->dtype()));
  }
  // [L, N, E] inside, as PyTorch's.
  Tensor q_in = batch_first ? transpose(query, 0, 1) : query;
  Tensor k_in = batch_first ? transpose(key, 0, 1) : key;
  Tensor v_in = batch_first ? transpose(value, 0, 1) : value;
  const int64_t L = q_in.size(0), N = q_in.size(1), S = k_in.size(0), H = num_heads,
                D = embed_dim / num_heads;
  if (k_in.size(1) != N || v_in.size(1) != N || v_in.size(0) != S)
    op_fail(op, loc, "query {}, key {} and value {} disagree in batch or length",
            to_string(query.shape()), to_string(key.shape()), to_string(value.shape()));
  auto project = [&](const Tensor& x, int64_t part, int64_t length) {
    Tensor w = slice(in_proj_weight, 0, part * embed_dim, (part + 1) * embed_dim);
    Tensor b = in_proj_bias.defined()
                   ? slice(in_proj_bias, 0, part * embed_dim, (part + 1) * embed_dim)
                   : Tensor();
    // [len, N, E] -> [N, H, len, D]
    return permute(reshape(linear(x, w, b), {length, N, H, D}), {1, 2, 0, 3});
  };
  Tensor q = project(q_in, 0, L), k = project(k_in, 1, S), v = project(v_in, 2, S);
  // Masks in PyTorch's sense (true: ignore) become the pairs that may attend, [N, H, L, S].
  Tensor allowed, additive;
  if (attn_mask.defined()) {
    Shape shape = attn_mask.shape();
    bool shared = shape == Shape{L, S}, per_head = shape == Shape{N * H, L, S};
    if (!shared && !per_head)
      op_fail(op, loc, "attn_mask must be [{}, {}] or [{}, {}, {}], got {}", L, S, N * H, L, S,
              to_string(shape));
    Tensor m = per_head ? reshape(attn_mask, {N, H, L, S}) : attn_mask;
    if (attn_mask.dtype() == boolean)
      allowed = logical_not(m);
    else if (is_floating(attn_mask.dtype()))
      additive = m;
    else
      op_fail(op, loc, "attn_mask must be bool or floating, got {}", name(attn_mask.dtype()));
  }
  if (key_padding_mask.defined()) {
    if (key_padding_mask.dtype() != boolean || key_padding_mask.shape() != Shape{N, S})
      op_fail(op, loc, "key_padding_mask must be bool [{}, {}], got {} {}", N, S,
              name(key_padding_mask.dtype()), to_string(key_padding_mask.shape()));
    Tensor keys = logical_not(reshape(key_padding_mask, {N, 1, 1, S}));
    allowed = allowed.defined() ? logical_and(allowed, keys) : keys;
  }
  if (is_causal)
    allowed = allowed.defined() ? logical_and(allowed, causal_mask(L, S)) : causal_mask(L, S);
  // q scaled before the product, as PyTorch's multi_head_attention_forward: the product of the
  // unscaled q, rounded to f16 under autocast, overflowed at scores of 65504 / sqrt(D).
  Tensor scores = matmul(q / std::sqrt(static_cast<double>(D)), k, false, true);
  if (additive.defined()) scores = scores + additive;
  // With no key (S = 0) nothing is averaged: zeros, so the output is out_proj's bias, as
  // PyTorch's (a softmax over the empty axis has no maximum).
  Tensor weights = S == 0              ? zeros_like(scores)
                   : allowed.defined() ? masked_softmax(scores, broadcast_to(allowed, {N, H, L, S}))
                                       : softmax(scores);
  // As PyTorch: the weights returned are the ones the values are averaged with, after dropout.
  weights = mixtape::dropout(weights, dropout, is_training(), gen_);
  Tensor attended = matmul(weights, v);
  Tensor merged = reshape(permute(attended, {2, 0, 1, 3}), {L, N, embed_dim});  // [L, N, E]
  Result result;
  result.output = out_proj(merged);
  if (batch_first) result.output = transpose(result.output, 0, 1);
  if (need_weights) result.weights = average_attn_weights ? mean(weights, {1}) : weights;
  return result;
}

// ---- LSTM and GRU ----
namespace {

// x[i] along the first axis.
Tensor row(const Tensor& x, int64_t i) { return squeeze(slice(x, 0, i, i + 1), 0); }

struct RecurrentShape {
  Tensor steps;  // [T, N, in]
  bool unbatched = false;
};

// The input as [T, N, in], checked.
RecurrentShape time_major(const char* op, const Tensor& x, int64_t input_size, bool batch_first,
                          const Loc& loc) {
  if (!x.defined() || (x.dim() != 2 && x.dim() != 3) || x.size(-1) != input_size)
    op_fail(op, loc, "expects [{}, {}] or an unbatched [T, {}], got {}",
            batch_first ? "N, T" : "T, N", input_size, input_size,
            x.defined() ? to_string(x.shape()) : "undefined");
  if (x.size(batch_first && x.dim() == 3 ? 1 : 0) == 0)
    op_fail(op, loc, "expects a sequence of at least one step, got {}", to_string(x.shape()));
  if (!is_floating(x.dtype()))  // as torch's: not promoted by the float weights
    op_fail(op, loc, "expects a floating-point input, got {}", name(x.dtype()));
  if (x.dim() == 2) return {unsqueeze(x, 1, loc), true};
  return {batch_first ? transpose(x, 0, 1) : x, false};
}

// The initial state [layers, N, H] (zeros unless given; an unbatched one is [layers, H]).
Tensor initial_state(const char* op, const Tensor& given, int64_t layers, int64_t batch,
                     int64_t hidden, bool unbatched, DType dtype, const Loc& loc) {
  if (!given.defined()) return zeros({layers, batch, hidden}, dtype);
  Shape expected = unbatched ? Shape{layers, hidden} : Shape{layers, batch, hidden};
  if (given.shape() != expected)
    op_fail(op, loc, "the initial state must be {}, got {}", to_string(expected),
            to_string(given.shape()));
  return unbatched ? unsqueeze(given, 1, loc) : given;
}

// The layer output [T, N, H] back in the caller's layout.
Tensor caller_layout(const Tensor& output, bool unbatched, bool batch_first) {
  if (unbatched) return squeeze(output, 1);
  return batch_first ? transpose(output, 0, 1) : output;
}
Tensor caller_state(const Tensor& state, bool unbatched) {
  return unbatched ? squeeze(state, 1) : state;
}

}  // namespace

Recurrent::Recurrent(const char* kind, int64_t gates, int64_t input_size, int64_t hidden_size,
                     int64_t num_layers, bool bias, bool batch_first, double dropout,
                     Generator* gen, bool bidirectional)
    : input_size(input_size),
      hidden_size(hidden_size),
      num_layers(num_layers),
      batch_first(batch_first),
      dropout(dropout),
      bidirectional(bidirectional),
      gen_(gen) {
  if (input_size <= 0 || hidden_size <= 0 || num_layers <= 0)
    fail("{}: sizes must be positive, got input {} hidden {} layers {}", kind, input_size,
         hidden_size, num_layers);
  if (!(dropout >= 0 && dropout <= 1)) fail("{}: dropout {} not in [0, 1]", kind, dropout);
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden_size));
  auto uniform = [&](Shape shape) { return init::uniform(std::move(shape), -bound, bound, gen); };
  // Sized first: the members are registered by address (so that one assigned another tensor is
  // the parameter, as the other layers'), which a growing vector would move.
  const auto count = static_cast<size_t>(num_layers * directions());
  for (auto* list : {&weight_ih, &weight_hh, &bias_ih, &bias_hh}) list->reserve(count);
  auto add = [&](std::vector<Tensor>& list, const std::string& name, Shape shape) {
    list.push_back(uniform(std::move(shape)));
    register_parameter(name, &list.back());
  };
  for (int64_t l = 0; l < num_layers; ++l)
    for (int64_t d = 0; d < directions(); ++d) {
      const std::string suffix = "_l" + std::to_string(l) + (d == 1 ? "_reverse" : "");
      const int64_t in = l == 0 ? input_size : hidden_size * directions(),
                    rows = gates * hidden_size;
      add(weight_ih, "weight_ih" + suffix, {rows, in});
      add(weight_hh, "weight_hh" + suffix, {rows, hidden_size});
      if (bias) {
        add(bias_ih, "bias_ih" + suffix, {rows});
        add(bias_hh, "bias_hh" + suffix, {rows});
      } else {
        bias_ih.emplace_back();
        bias_hh.emplace_back();
      }
    }
}

namespace {

// Runs a recurrent layer of `layers` (each with `directions`) over `steps` [T, N, in]: each
// layer and direction k projects its input at every step at once (weight_ih[k], bias_ih[k]),
// then `cell(k, projected row, states)` updates the states (h first) step by step, forwards in
// time or backwards. Returns the last layer's outputs [T, N, directions * H] and each k's last
// states.
template <typename Cell>
std::pair<Tensor, std::vector<std::vector<Tensor>>> run_layers(const Recurrent& net,
                                                               const Tensor& steps,
                                                               std::vector<Tensor> initial,
                                                               Cell cell, bool training,
                                                               Generator* gen) {
  const int64_t T = steps.size(0), D = net.directions();
  Tensor layer_input = steps;
  std::vector<std::vector<Tensor>> last(initial.size());
  for (int64_t l = 0; l < net.num_layers; ++l) {
    std::vector<Tensor> direction_outputs;
    for (int64_t d = 0; d < D; ++d) {
      const size_t k = static_cast<size_t>(l * D + d);
      Tensor projected = linear(layer_input, net.weight_ih[k], net.bias_ih[k]);  // [T, N, G H]
      std::vector<Tensor> states;
      for (const Tensor& all : initial) states.push_back(row(all, static_cast<int64_t>(k)));
      std::vector<Tensor> outputs(static_cast<size_t>(T));
      for (int64_t s = 0; s < T; ++s) {
        const int64_t t = d == 0 ? s : T - 1 - s;
        cell(k, row(projected, t), states);
        outputs[static_cast<size_t>(t)] = states[0];
      }
      for (size_t i = 0; i < states.size(); ++i) last[i].push_back(states[i]);
      direction_outputs.push_back(stack(outputs, 0));
    }
    layer_input = D == 1 ? direction_outputs[0] : concat(direction_outputs, -1);
    if (l + 1 < net.num_layers)
      layer_input = mixtape::dropout(layer_input, net.dropout, training, gen);
  }
  return {layer_input, last};
}

}  // namespace

LSTM::LSTM(int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias, bool batch_first,
           double dropout, Generator* gen, bool bidirectional)
    : Recurrent("LSTM", 4, input_size, hidden_size, num_layers, bias, batch_first, dropout, gen,
                bidirectional) {}

LSTM::Result LSTM::operator()(const Tensor& x, const Tensor& h0, const Tensor& c0,
                              const Loc& loc) const {
  CallSiteScope site(loc);
  ModulePathScope scope = forward_scope();
  if (h0.defined() != c0.defined())
    op_fail("LSTM", loc, "takes the initial states h0 and c0 together, got only {}",
            h0.defined() ? "h0" : "c0");
  RecurrentShape in = time_major("LSTM", x, input_size, batch_first, loc);
  const int64_t N = in.steps.size(1), H = hidden_size, K = num_layers * directions();
  std::vector<Tensor> initial = {initial_state("LSTM", h0, K, N, H, in.unbatched, x.dtype(), loc),
                                 initial_state("LSTM", c0, K, N, H, in.unbatched, x.dtype(), loc)};
  auto cell = [&](size_t k, const Tensor& projected, std::vector<Tensor>& state) {
    Tensor& h = state[0];
    Tensor& c = state[1];
    Tensor gates = projected + linear(h, weight_hh[k], bias_hh[k]);
    std::vector<Tensor> g = chunk(gates, 4, 1);  // i, f, g, o
    c = sigmoid(g[1]) * c + sigmoid(g[0]) * tanh(g[2]);
    h = sigmoid(g[3]) * tanh(c);
  };
  auto [output, last] = run_layers(*this, in.steps, initial, cell, is_training(), gen_);
  return {caller_layout(output, in.unbatched, batch_first),
          caller_state(stack(last[0], 0), in.unbatched),
          caller_state(stack(last[1], 0), in.unbatched)};
}

GRU::GRU(int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias, bool batch_first,
         double dropout, Generator* gen, bool bidirectional)
    : Recurrent("GRU", 3, input_size, hidden_size, num_layers, bias, batch_first, dropout, gen,
                bidirectional) {}

GRU::Result GRU::operator()(const Tensor& x, const Tensor& h0, const Loc& loc) const {
  CallSiteScope site(loc);
  ModulePathScope scope = forward_scope();
  RecurrentShape in = time_major("GRU", x, input_size, batch_first, loc);
  const int64_t N = in.steps.size(1), H = hidden_size, K = num_layers * directions();
  std::vector<Tensor> initial = {initial_state("GRU", h0, K, N, H, in.unbatched, x.dtype(), loc)};
  auto cell = [&](size_t k, const Tensor& projected, std::vector<Tensor>& state) {
    Tensor& h = state[0];
    std::vector<Tensor> xi = chunk(projected, 3, 1);                            // r, z, n
    std::vector<Tensor> hh = chunk(linear(h, weight_hh[k], bias_hh[k]), 3, 1);  // r, z, n
    Tensor r = sigmoid(xi[0] + hh[0]), z = sigmoid(xi[1] + hh[1]);
    Tensor n = tanh(xi[2] + r * hh[2]);
    h = (1.0 - z) * n + z * h;
  };
  auto [output, last] = run_layers(*this, in.steps, initial, cell, is_training(), gen_);
  return {caller_layout(output, in.unbatched, batch_first),
          caller_state(stack(last[0], 0), in.unbatched)};
}

}  // namespace mixtape
