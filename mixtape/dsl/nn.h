// mixtape/dsl/nn.h -- built-in layers (Linear, Embedding, norms, Dropout, MLP, attention,
// TransformerBlock) and seeded initializers.
#pragma once

#include <string>

#include <functional>

#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/module.h"
#include "mixtape/dsl/vision.h"

namespace mixtape {

namespace init {
/// Fresh values of the given shape; each draws from `gen` (the default generator if null).
Tensor normal(Shape shape, double mean, double stddev, Generator* gen = nullptr, DType dtype = f32);
Tensor uniform(Shape shape, double low, double high, Generator* gen = nullptr, DType dtype = f32);
/// torch.nn.init.normal_ / uniform_: fill an existing floating tensor (every holder of it sees
/// the new values; its requires_grad is kept) with N(mean, std^2) or U[a, b) draws.
/// std < 0 or a > b is an error naming the function.
Tensor& normal_(Tensor& t, double mean = 0, double std = 1, Generator* gen = nullptr,
                const Loc& loc = Loc::current());
Tensor& uniform_(Tensor& t, double a = 0, double b = 1, Generator* gen = nullptr,
                 const Loc& loc = Loc::current());
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

/// torch.nn.Embedding: weight [num_embeddings, dim] drawn from N(0, 1). With padding_idx
/// (negative counts from the end) that row starts at zeros and gets no gradient, as torch's.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator* gen = nullptr,
            std::optional<int64_t> padding_idx = std::nullopt);
  /// Embedding(10, 4, 0), torch's padding_idx=0 in its argument order, would take the 0 as a
  /// null generator here: refused at compile time (pass {.., nullptr, 0} for a padding row).
  Embedding(int64_t num_embeddings, int64_t dim, int padding_idx_in_torch_order) = delete;
  Tensor operator()(const Tensor& ids, const Loc& loc = Loc::current()) const;
  Tensor weight;
  std::optional<int64_t> padding_idx;  // normalized to [0, num_embeddings)
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
  /// The generator masks are drawn from (null: the default generator).
  Generator* generator() const { return gen_; }
  double p;

 private:
  Generator* gen_;
};

/// What the batch and instance norm modules hold, with PyTorch's names (its _NormBase): weight
/// and bias parameters; running_mean, running_var and num_batches_tracked buffers, so that a
/// torchvision state_dict loads. The buffers stay f32 under every policy.
class NormBase : public Module {
 public:
  Tensor weight, bias;                                    // undefined without affine
  Tensor running_mean, running_var, num_batches_tracked;  // undefined without tracking
  double eps;

 protected:
  NormBase(const char* kind, int64_t num_features, double eps, bool affine,
           bool track_running_stats);
};

/// Batch normalization over channel 1, as torch.nn.BatchNorm1d/2d/3d. Training normalizes with
/// the batch's statistics and updates the buffers inside the step's graph; eval uses the running
/// statistics. momentum nullopt is the cumulative average.
class BatchNorm : public NormBase {
 public:
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  std::optional<double> momentum;

 protected:
  BatchNorm(const char* kind, int64_t num_features, double eps, std::optional<double> momentum,
            bool affine, bool track_running_stats);

 private:
  virtual void check_rank(const Tensor& x) const = 0;
  const char* kind_;
};

/// Over [N, C] or [N, C, L].
class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, double eps = 1e-5,
                       std::optional<double> momentum = 0.1, bool affine = true,
                       bool track_running_stats = true);

 private:
  void check_rank(const Tensor& x) const override;
};

/// Over [N, C, H, W].
class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5,
                       std::optional<double> momentum = 0.1, bool affine = true,
                       bool track_running_stats = true);

 private:
  void check_rank(const Tensor& x) const override;
};

/// Over [N, C, D, H, W].
class BatchNorm3d : public BatchNorm {
 public:
  explicit BatchNorm3d(int64_t num_features, double eps = 1e-5,
                       std::optional<double> momentum = 0.1, bool affine = true,
                       bool track_running_stats = true);

 private:
  void check_rank(const Tensor& x) const override;
};

/// Instance normalization as torch.nn.InstanceNorm1d/2d/3d: each (sample, channel) over its
/// spatial axes, affine and track_running_stats off by default, as PyTorch's. With running
/// statistics, training moves them towards the batch's (momentum) and eval normalizes with them;
/// num_batches_tracked is kept for PyTorch's state_dict and stays 0, as PyTorch's does. An
/// unbatched input ([C, L], [C, H, W], [C, D, H, W]) is a batch of one.
class InstanceNorm : public NormBase {
 public:
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  double momentum;

 protected:
  InstanceNorm(const char* kind, int64_t spatial_axes, int64_t num_features, double eps,
               double momentum, bool affine, bool track_running_stats);

 private:
  const char* kind_;
  int64_t spatial_axes_;
};

class InstanceNorm1d : public InstanceNorm {
 public:
  explicit InstanceNorm1d(int64_t num_features, double eps = 1e-5, double momentum = 0.1,
                          bool affine = false, bool track_running_stats = false);
};
class InstanceNorm2d : public InstanceNorm {
 public:
  explicit InstanceNorm2d(int64_t num_features, double eps = 1e-5, double momentum = 0.1,
                          bool affine = false, bool track_running_stats = false);
};
class InstanceNorm3d : public InstanceNorm {
 public:
  explicit InstanceNorm3d(int64_t num_features, double eps = 1e-5, double momentum = 0.1,
                          bool affine = false, bool track_running_stats = false);
};

/// torch.nn.PReLU: prelu with a learned weight [num_parameters] (1, shared, or one per channel),
/// every entry `init` at first.
class PReLU : public Module {
 public:
  explicit PReLU(int64_t num_parameters = 1, double init = 0.25);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight;
};

class GroupNorm : public Module {
 public:
  GroupNorm(int64_t num_groups, int64_t num_channels, double eps = 1e-5, bool affine = true);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Tensor weight, bias;
  int64_t num_groups;
  double eps;
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(Size2 kernel, std::optional<Size2> stride = std::nullopt, Size2 padding = 0,
                     Size2 dilation = 1, bool ceil_mode = false);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  /// As PyTorch's module made with return_indices: the values and each one's index.
  ValuesIndices with_indices(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size2 kernel;
  std::optional<Size2> stride;
  Size2 padding, dilation;
  bool ceil_mode;
};

/// torch.nn.MaxUnpool1d and MaxUnpool3d: max_unpool1d / max_unpool3d with the sizes they were
/// made with.
class MaxUnpool1d : public Module {
 public:
  explicit MaxUnpool1d(int64_t kernel, std::optional<int64_t> stride = std::nullopt,
                       int64_t padding = 0);
  Tensor operator()(const Tensor& x, const Tensor& indices,
                    std::optional<int64_t> output_size = std::nullopt,
                    const Loc& loc = Loc::current()) const;
  int64_t kernel;
  std::optional<int64_t> stride;
  int64_t padding;
};
class MaxUnpool3d : public Module {
 public:
  explicit MaxUnpool3d(Size3 kernel, std::optional<Size3> stride = std::nullopt, Size3 padding = 0);
  Tensor operator()(const Tensor& x, const Tensor& indices,
                    std::optional<Size3> output_size = std::nullopt,
                    const Loc& loc = Loc::current()) const;
  Size3 kernel;
  std::optional<Size3> stride;
  Size3 padding;
};

/// torch.nn.MaxUnpool2d: max_unpool2d with the sizes it was made with.
class MaxUnpool2d : public Module {
 public:
  explicit MaxUnpool2d(Size2 kernel, std::optional<Size2> stride = std::nullopt, Size2 padding = 0);
  Tensor operator()(const Tensor& x, const Tensor& indices,
                    std::optional<Size2> output_size = std::nullopt,
                    const Loc& loc = Loc::current()) const;
  Size2 kernel;
  std::optional<Size2> stride;
  Size2 padding;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(Size2 kernel, std::optional<Size2> stride = std::nullopt, Size2 padding = 0,
                     bool ceil_mode = false, bool count_include_pad = true);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size2 kernel;
  std::optional<Size2> stride;
  Size2 padding;
  bool ceil_mode, count_include_pad;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(Size2 output_size);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size2 output_size;
};

class AdaptiveMaxPool2d : public Module {
 public:
  explicit AdaptiveMaxPool2d(Size2 output_size);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size2 output_size;
};

/// The 1-d poolings' modules (dsl/vision.h's max_pool1d, ...), as torch.nn's.
class MaxPool1d : public Module {
 public:
  explicit MaxPool1d(int64_t kernel, std::optional<int64_t> stride = std::nullopt,
                     int64_t padding = 0, int64_t dilation = 1, bool ceil_mode = false);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  /// As PyTorch's module made with return_indices: the values and each one's index.
  ValuesIndices with_indices(const Tensor& x, const Loc& loc = Loc::current()) const;
  int64_t kernel;
  std::optional<int64_t> stride;
  int64_t padding, dilation;
  bool ceil_mode;
};

class AvgPool1d : public Module {
 public:
  explicit AvgPool1d(int64_t kernel, std::optional<int64_t> stride = std::nullopt,
                     int64_t padding = 0, bool ceil_mode = false, bool count_include_pad = true);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  int64_t kernel;
  std::optional<int64_t> stride;
  int64_t padding;
  bool ceil_mode, count_include_pad;
};

class AdaptiveAvgPool1d : public Module {
 public:
  explicit AdaptiveAvgPool1d(int64_t output_size);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  int64_t output_size;
};

class AdaptiveMaxPool1d : public Module {
 public:
  explicit AdaptiveMaxPool1d(int64_t output_size);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  int64_t output_size;
};

/// The 3-d poolings' modules (dsl/vision.h's max_pool3d, ...), as torch.nn's.
class MaxPool3d : public Module {
 public:
  explicit MaxPool3d(Size3 kernel, std::optional<Size3> stride = std::nullopt, Size3 padding = 0,
                     Size3 dilation = 1, bool ceil_mode = false);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  /// As PyTorch's module made with return_indices: the values and each one's index.
  ValuesIndices with_indices(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size3 kernel;
  std::optional<Size3> stride;
  Size3 padding, dilation;
  bool ceil_mode;
};

class AvgPool3d : public Module {
 public:
  explicit AvgPool3d(Size3 kernel, std::optional<Size3> stride = std::nullopt, Size3 padding = 0,
                     bool ceil_mode = false, bool count_include_pad = true);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size3 kernel;
  std::optional<Size3> stride;
  Size3 padding;
  bool ceil_mode, count_include_pad;
};

class AdaptiveAvgPool3d : public Module {
 public:
  explicit AdaptiveAvgPool3d(Size3 output_size);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size3 output_size;
};

class AdaptiveMaxPool3d : public Module {
 public:
  explicit AdaptiveMaxPool3d(Size3 output_size);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size3 output_size;
};

/// torch.nn.Unfold and Fold: unfold / fold with the sizes they were made with.
class Unfold : public Module {
 public:
  explicit Unfold(Size2 kernel_size, Size2 dilation = 1, Size2 padding = 0, Size2 stride = 1);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size2 kernel_size, dilation, padding, stride;
};
class Fold : public Module {
 public:
  Fold(Size2 output_size, Size2 kernel_size, Size2 dilation = 1, Size2 padding = 0,
       Size2 stride = 1);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  Size2 output_size, kernel_size, dilation, padding, stride;
};

/// Zeroes whole channels when training (torch.nn.Dropout2d).
class Dropout2d : public Module {
 public:
  explicit Dropout2d(double p = 0.5, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  double p;

 private:
  Generator* gen_;
};

/// Zeroes whole channels of a volume when training (torch.nn.Dropout3d).
class Dropout3d : public Module {
 public:
  explicit Dropout3d(double p = 0.5, Generator* gen = nullptr);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  double p;

 private:
  Generator* gen_;
};

/// torch.nn.Upsample: interpolate with the options it was made with.
class Upsample : public Module {
 public:
  explicit Upsample(InterpolateOptions options);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  InterpolateOptions options;
};

/// torch.nn.PixelShuffle and PixelUnshuffle.
class PixelShuffle : public Module {
 public:
  explicit PixelShuffle(int64_t upscale_factor);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  int64_t upscale_factor;
};
class PixelUnshuffle : public Module {
 public:
  explicit PixelUnshuffle(int64_t downscale_factor);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  int64_t downscale_factor;
};

/// Flattens axes start_dim..end_dim into one (torch.nn.Flatten: from axis 1 by default).
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  int64_t start_dim, end_dim;
};

/// Modules (and parameterless steps such as relu) applied in order, as torch.nn.Sequential.
/// Each entry takes the next index, "0", "1", ..., as its name, so the parameters of a module
/// at index 3 are "3.weight" whether or not earlier entries have any (torchvision's layout).
class Sequential : public Module {
 public:
  using Step = std::function<Tensor(const Tensor&)>;
  Sequential() = default;
  ~Sequential() override;  // out of line: its containers are destroyed in nn.cpp
  /// Makes and owns an M (a Module with operator()(const Tensor&)) at the next index; a step
  /// without parameters that is no Module goes in with append().
  template <typename M, typename... Args>
  M& emplace_back(Args&&... args) {
    return push_back(std::make_unique<M>(std::forward<Args>(args)...));
  }
  template <typename M>
  M& push_back(std::unique_ptr<M> module) {
    M& m = *module;
    register_module(std::to_string(steps_.size()), m);
    steps_.push_back([&m](const Tensor& x) { return m(x); });
    owned_.push_back(std::move(module));
    return m;
  }
  /// A step without parameters (an activation): takes an index but registers nothing.
  Sequential& append(Step step);
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  size_t size() const { return steps_.size(); }

 private:
  std::vector<Step> steps_;
  std::vector<std::unique_ptr<Module>> owned_;
};

enum class Activation { Relu, Gelu, GeluTanh, Silu, Tanh };
Tensor activate(Activation activation, const Tensor& x);

/// Linear layers fc1..fcN with `activation` between them (not after the last).
class MLP : public Module {
 public:
  explicit MLP(std::vector<int64_t> sizes, Activation activation = Activation::Relu,
               Generator* gen = nullptr);
  ~MLP() override;  // out of line: its containers are destroyed in nn.cpp
  Tensor operator()(const Tensor& x, const Loc& loc = Loc::current()) const;
  std::vector<std::unique_ptr<Linear>> layers;  // registered as fc1, fc2, ...
  Activation activation;
};

/// Multi-head causal self-attention over [batch, time, dim]: qkv projection, per-head fused
/// causal attention (dsl/attention.h: memory linear in time) whose weights attn_dropout drops
/// when training, output projection.
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
