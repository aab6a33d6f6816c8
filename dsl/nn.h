// dsl/nn.h -- built-in layers (Linear, Embedding, norms, Dropout, MLP, attention, TransformerBlock)
// and seeded initializers.
#pragma once

#include <string>

#include "dsl/functional.h"
#include "dsl/module.h"

namespace mixtape {

namespace init {
/// Fresh values of the given shape; each draws from `gen` (the default generator if null).
Tensor normal(Shape shape, double mean, double stddev, Generator* gen = nullptr, DType dtype = f32);
Tensor uniform(Shape shape, double low, double high, Generator* gen = nullptr, DType dtype = f32);
/// fan_in / fan_out of a [out, in, ...] weight shape.
std::pair<int64_t, int64_t> fans(const Shape& shape);
Tensor xavier_uniform(Shape shape, double gain = 1.0, Generator* gen = nullptr);
Tensor xavier_normal(Shape shape, double gain = 1.0, Generator* gen = nullptr);
/// He initialization for ReLU networks (gain sqrt(2)), using fan_in.
Tensor kaiming_uniform(Shape shape, double gain = 1.4142135623730951, Generator* gen = nullptr);
Tensor kaiming_normal(Shape shape, double gain = 1.4142135623730951, Generator* gen = nullptr);
}  // namespace init

/// y = x W^T + b with W [out, in]; initialized like PyTorch: U(-1/sqrt(in), 1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator* gen = nullptr);
  Tensor operator()(const Tensor& ids, const Loc& loc = Loc::current()) const;
  Tensor weight;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
  double eps;
};

class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight;
  double eps;
};

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  double p;

 private:
  Generator* gen_;
};

enum class Activation { Relu, Gelu, GeluTanh, Silu, Tanh };
Tensor activate(Activation activation, const Tensor& x);

/// Linear layers fc1..fcN with `activation` between them (not after the last).
class MLP : public Module {
 public:
  explicit MLP(std::vector<int64_t> sizes, Activation activation = Activation::Relu,
               Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  std::vector<std::unique_ptr<Linear>> layers;  // registered as fc1, fc2, ...
  Activation activation;
};

/// Multi-head causal self-attention over [batch, time, dim]: qkv projection, per-head scaled
/// dot-product attention with a causal mask, output projection.
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(int64_t dim, int64_t heads, double dropout = 0.0, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Linear qkv, proj;
  int64_t heads;
  Dropout attn_dropout;
};

/// Pre-norm GPT block: x + attn(ln1(x)), then x + mlp(ln2(x)) with a 4x GELU(tanh) MLP.
class TransformerBlock : public Module {
 public:
  TransformerBlock(int64_t dim, int64_t heads, double dropout = 0.0, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  LayerNorm ln1;
  CausalSelfAttention attn;
  LayerNorm ln2;
  MLP mlp;
  Dropout resid_dropout;
};

}  // namespace mixtape
