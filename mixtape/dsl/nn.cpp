// mixtape/dsl/nn.cpp -- built-in layers and initializers.
#include "mixtape/dsl/nn.h"

#include <cmath>
#include <optional>
#include <utility>

#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/error.h"

namespace mixtape {

namespace init {

Tensor normal(Shape shape, double mean, double stddev, Generator* gen, DType dtype) {
  return randn(std::move(shape), dtype, gen, mean, stddev);
}

Tensor uniform(Shape shape, double low, double high, Generator* gen, DType dtype) {
  return rand(std::move(shape), dtype, gen, low, high);
}

namespace {
void check_fill(const Tensor& t, const char* op, bool bad_range, double a, double b,
                const Loc& loc) {
  if (!t.defined()) op_fail(op, loc, "the tensor is undefined");
  if (!is_floating(t.dtype()))
    op_fail(op, loc, "the tensor must be floating-point, got {}", name(t.dtype()));
  if (bad_range)
    op_fail(op, loc, "bad parameters {} and {} for shape {}", a, b, to_string(t.shape()));
}
}  // namespace

Tensor& normal_(Tensor& t, double mean, double std, Generator* gen, const Loc& loc) {
  check_fill(t, "normal_", !(std >= 0), mean, std, loc);
  t.assign(normal(t.shape(), mean, std, gen, t.dtype()), loc);
  return t;
}

Tensor& uniform_(Tensor& t, double a, double b, Generator* gen, const Loc& loc) {
  check_fill(t, "uniform_", !(a <= b), a, b, loc);
  t.assign(uniform(t.shape(), a, b, gen, t.dtype()), loc);
  return t;
}

std::pair<int64_t, int64_t> fans(const Shape& shape) {
  if (shape.size() < 2)
    fail("init: fan in/out needs a weight of rank >= 2, got {}", to_string(shape));
  int64_t receptive = 1;
  for (size_t d = 2; d < shape.size(); ++d) receptive *= shape[d];
  return {shape[1] * receptive, shape[0] * receptive};
}

Tensor xavier_uniform(Shape shape, double gain, Generator* gen) {
  auto [fan_in, fan_out] = fans(shape);
  double bound = gain * std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  return uniform(std::move(shape), -bound, bound, gen);
}

Tensor xavier_normal(Shape shape, double gain, Generator* gen) {
  auto [fan_in, fan_out] = fans(shape);
  return normal(std::move(shape), 0, gain * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out)),
                gen);
}

Tensor kaiming_uniform(Shape shape, double gain, Generator* gen) {
  // No elements, no fan: the empty tensor, as torch's (sqrt(3 / 0) is not a bound).
  if (numel(shape) == 0) return zeros(std::move(shape));
  double bound = gain * std::sqrt(3.0 / static_cast<double>(fans(shape).first));
  return uniform(std::move(shape), -bound, bound, gen);
}

Tensor kaiming_normal(Shape shape, double gain, Generator* gen) {
  double stddev = gain / std::sqrt(static_cast<double>(fans(shape).first));
  return normal(std::move(shape), 0, stddev, gen);
}

}  // namespace init

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, Generator* gen) {
  if (in_features <= 0 || out_features <= 0)
    fail("Linear: features must be positive, got in={} out={}", in_features, out_features);
  double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  weight = init::uniform({out_features, in_features}, -bound, bound, gen);
  register_parameter("weight", &weight);
  if (with_bias) {
    bias = init::uniform({out_features}, -bound, bound, gen);
    register_parameter("bias", &bias);
  }
}

Tensor Linear::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return linear(x, weight, bias, loc);
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Generator* gen,
                     std::optional<int64_t> padding_idx) {
  if (num_embeddings <= 0 || dim <= 0)
    fail("Embedding: sizes must be positive, got {} x {}", num_embeddings, dim);
  if (padding_idx) {
    if (*padding_idx < -num_embeddings || *padding_idx >= num_embeddings)
      fail("Embedding: padding_idx {} is out of range for {} embeddings", *padding_idx,
           num_embeddings);
    this->padding_idx = *padding_idx < 0 ? *padding_idx + num_embeddings : *padding_idx;
  }
  weight = init::normal({num_embeddings, dim}, 0, 1, gen);
  if (this->padding_idx) {  // torch zeroes the padding row after drawing the others
    Tensor row = eq(arange(num_embeddings, i64), full({}, double(*this->padding_idx), i64));
    weight = where(unsqueeze(row, -1), zeros_like(weight), weight);
  }
  register_parameter("weight", &weight);
}

Tensor Embedding::operator()(const Tensor& ids, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return embedding(weight, ids, padding_idx, loc);
}

LayerNorm::LayerNorm(int64_t dim, double eps) : eps(eps) {
  if (dim <= 0) fail("LayerNorm: dim must be positive, got {}", dim);
  weight = ones({dim});
  register_parameter("weight", &weight);
  bias = zeros({dim});
  register_parameter("bias", &bias);
}

Tensor LayerNorm::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return layer_norm(x, weight, bias, eps, 1, loc);
}

RMSNorm::RMSNorm(int64_t dim, double eps) : eps(eps) {
  if (dim <= 0) fail("RMSNorm: dim must be positive, got {}", dim);
  weight = ones({dim});
  register_parameter("weight", &weight);
}

Tensor RMSNorm::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return rms_norm(x, weight, eps, loc);
}

Dropout::Dropout(double p, Generator* gen) : p(p), gen_(gen) {
  if (!(p >= 0 && p <= 1)) fail("Dropout: p must be in [0, 1], got {}", p);
}

Tensor Dropout::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return dropout(x, p, is_training(), gen_, loc);
}

NormBase::NormBase(const char* kind, int64_t num_features, double eps, bool affine,
                   bool track_running_stats)
    : eps(eps) {
  if (num_features <= 0) fail("{}: num_features must be positive, got {}", kind, num_features);
  if (affine) {
    weight = ones({num_features});
    register_parameter("weight", &weight);
    bias = zeros({num_features});
    register_parameter("bias", &bias);
  }
  if (track_running_stats) {
    running_mean = zeros({num_features});
    register_buffer("running_mean", &running_mean);
    running_var = ones({num_features});
    register_buffer("running_var", &running_var);
    num_batches_tracked = zeros({}, i64);
    register_buffer("num_batches_tracked", &num_batches_tracked);
    // Files from before PyTorch 0.4.1, and converted weights, lack it: torch starts it at 0.
    zero_when_missing("num_batches_tracked");
  }
}

BatchNorm::BatchNorm(const char* kind, int64_t num_features, double eps,
                     std::optional<double> momentum, bool affine, bool track_running_stats)
    : NormBase(kind, num_features, eps, affine, track_running_stats),
      momentum(momentum),
      kind_(kind) {
  if (momentum && !(*momentum >= 0 && *momentum <= 1))
    fail("{}: momentum must be in [0, 1], got {}", kind, *momentum);
}

Tensor BatchNorm::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  if (!x.defined()) fail("{} '{}': the input is an undefined tensor", kind_, path());
  check_rank(x);
  // Without running statistics the batch's are used in eval mode too, as PyTorch's.
  const bool use_batch = is_training() || !running_mean.defined();
  return detail::batch_norm_tracked(x, running_mean, running_var, num_batches_tracked, weight, bias,
                                    use_batch, momentum, eps, loc);
}

BatchNorm1d::BatchNorm1d(int64_t num_features, double eps, std::optional<double> momentum,
                         bool affine, bool track_running_stats)
    : BatchNorm("BatchNorm1d", num_features, eps, momentum, affine, track_running_stats) {}

void BatchNorm1d::check_rank(const Tensor& x) const {
  if (x.dim() != 2 && x.dim() != 3)
    fail("BatchNorm1d '{}': needs an [N, C] or [N, C, L] input, got {}", path(),
         to_string(x.shape()));
}

BatchNorm2d::BatchNorm2d(int64_t num_features, double eps, std::optional<double> momentum,
                         bool affine, bool track_running_stats)
    : BatchNorm("BatchNorm2d", num_features, eps, momentum, affine, track_running_stats) {}

void BatchNorm2d::check_rank(const Tensor& x) const {
  if (x.dim() != 4)
    fail("BatchNorm2d '{}': needs an [N, C, H, W] input, got {}", path(), to_string(x.shape()));
}

BatchNorm3d::BatchNorm3d(int64_t num_features, double eps, std::optional<double> momentum,
                         bool affine, bool track_running_stats)
    : BatchNorm("BatchNorm3d", num_features, eps, momentum, affine, track_running_stats) {}

void BatchNorm3d::check_rank(const Tensor& x) const {
  if (x.dim() != 5)
    fail("BatchNorm3d '{}': needs an [N, C, D, H, W] input, got {}", path(), to_string(x.shape()));
}

InstanceNorm::InstanceNorm(const char* kind, int64_t spatial_axes, int64_t num_features, double eps,
                           double momentum, bool affine, bool track_running_stats)
    : NormBase(kind, num_features, eps, affine, track_running_stats),
      momentum(momentum),
      kind_(kind),
      spatial_axes_(spatial_axes) {
  if (!(momentum >= 0 && momentum <= 1))
    fail("{}: momentum must be in [0, 1], got {}", kind, momentum);
}

Tensor InstanceNorm::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  const char* layouts[3] = {"[N, C, L] or [C, L]", "[N, C, H, W] or [C, H, W]",
                            "[N, C, D, H, W] or [C, D, H, W]"};
  if (x.dim() != spatial_axes_ + 1 && x.dim() != spatial_axes_ + 2)
    fail("{} '{}': needs an {} input, got {}", kind_, path(), layouts[spatial_axes_ - 1],
         to_string(x.shape()));
  const bool batched = x.dim() == spatial_axes_ + 2;
  const bool use_input_stats = is_training() || !running_mean.defined();
  const Tensor y =
      detail::instance_norm_tracked(batched ? x : unsqueeze(x, 0, loc), running_mean, running_var,
                                    weight, bias, use_input_stats, momentum, eps, loc);
  return batched ? y : squeeze(y, 0, loc);
}

InstanceNorm1d::InstanceNorm1d(int64_t num_features, double eps, double momentum, bool affine,
                               bool track_running_stats)
    : InstanceNorm("InstanceNorm1d", 1, num_features, eps, momentum, affine, track_running_stats) {}
InstanceNorm2d::InstanceNorm2d(int64_t num_features, double eps, double momentum, bool affine,
                               bool track_running_stats)
    : InstanceNorm("InstanceNorm2d", 2, num_features, eps, momentum, affine, track_running_stats) {}
InstanceNorm3d::InstanceNorm3d(int64_t num_features, double eps, double momentum, bool affine,
                               bool track_running_stats)
    : InstanceNorm("InstanceNorm3d", 3, num_features, eps, momentum, affine, track_running_stats) {}

PReLU::PReLU(int64_t num_parameters, double init) {
  if (num_parameters <= 0) fail("PReLU: num_parameters must be positive, got {}", num_parameters);
  weight = full({num_parameters}, init);
  register_parameter("weight", &weight);
}

Tensor PReLU::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return prelu(x, weight, loc);
}

GroupNorm::GroupNorm(int64_t num_groups, int64_t num_channels, double eps, bool affine)
    : num_groups(num_groups), eps(eps) {
  if (num_groups <= 0 || num_channels <= 0 || num_channels % num_groups != 0)
    fail("GroupNorm: {} groups do not divide {} channels", num_groups, num_channels);
  if (affine) {
    weight = ones({num_channels});
    register_parameter("weight", &weight);
    bias = zeros({num_channels});
    register_parameter("bias", &bias);
  }
}

Tensor GroupNorm::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return group_norm(x, num_groups, weight, bias, eps, loc);
}

MaxPool2d::MaxPool2d(Size2 kernel, std::optional<Size2> stride, Size2 padding, Size2 dilation,
                     bool ceil_mode)
    : kernel(kernel), stride(stride), padding(padding), dilation(dilation), ceil_mode(ceil_mode) {}

Tensor MaxPool2d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, loc);
}

ValuesIndices MaxPool2d::with_indices(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode, loc);
}

MaxUnpool2d::MaxUnpool2d(Size2 kernel, std::optional<Size2> stride, Size2 padding)
    : kernel(kernel), stride(stride), padding(padding) {}

Tensor MaxUnpool2d::operator()(const Tensor& x, const Tensor& indices,
                               std::optional<Size2> output_size, const Loc& loc) const {
  return max_unpool2d(x, indices, kernel, stride, padding, output_size, loc);
}

MaxUnpool1d::MaxUnpool1d(int64_t kernel, std::optional<int64_t> stride, int64_t padding)
    : kernel(kernel), stride(stride), padding(padding) {}

Tensor MaxUnpool1d::operator()(const Tensor& x, const Tensor& indices,
                               std::optional<int64_t> output_size, const Loc& loc) const {
  return max_unpool1d(x, indices, kernel, stride, padding, output_size, loc);
}

MaxUnpool3d::MaxUnpool3d(Size3 kernel, std::optional<Size3> stride, Size3 padding)
    : kernel(kernel), stride(stride), padding(padding) {}

Tensor MaxUnpool3d::operator()(const Tensor& x, const Tensor& indices,
                               std::optional<Size3> output_size, const Loc& loc) const {
  return max_unpool3d(x, indices, kernel, stride, padding, output_size, loc);
}

AvgPool2d::AvgPool2d(Size2 kernel, std::optional<Size2> stride, Size2 padding, bool ceil_mode,
                     bool count_include_pad)
    : kernel(kernel),
      stride(stride),
      padding(padding),
      ceil_mode(ceil_mode),
      count_include_pad(count_include_pad) {}

Tensor AvgPool2d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, loc);
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(Size2 output_size) : output_size(output_size) {}

Tensor AdaptiveAvgPool2d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return adaptive_avg_pool2d(x, output_size, loc);
}

AdaptiveMaxPool2d::AdaptiveMaxPool2d(Size2 output_size) : output_size(output_size) {}

Tensor AdaptiveMaxPool2d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return adaptive_max_pool2d(x, output_size, loc);
}

MaxPool1d::MaxPool1d(int64_t kernel, std::optional<int64_t> stride, int64_t padding,
                     int64_t dilation, bool ceil_mode)
    : kernel(kernel), stride(stride), padding(padding), dilation(dilation), ceil_mode(ceil_mode) {}

Tensor MaxPool1d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return max_pool1d(x, kernel, stride, padding, dilation, ceil_mode, loc);
}

ValuesIndices MaxPool1d::with_indices(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return max_pool1d_with_indices(x, kernel, stride, padding, dilation, ceil_mode, loc);
}

AvgPool1d::AvgPool1d(int64_t kernel, std::optional<int64_t> stride, int64_t padding, bool ceil_mode,
                     bool count_include_pad)
    : kernel(kernel),
      stride(stride),
      padding(padding),
      ceil_mode(ceil_mode),
      count_include_pad(count_include_pad) {}

Tensor AvgPool1d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return avg_pool1d(x, kernel, stride, padding, ceil_mode, count_include_pad, loc);
}

AdaptiveAvgPool1d::AdaptiveAvgPool1d(int64_t output_size) : output_size(output_size) {}

Tensor AdaptiveAvgPool1d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return adaptive_avg_pool1d(x, output_size, loc);
}

AdaptiveMaxPool1d::AdaptiveMaxPool1d(int64_t output_size) : output_size(output_size) {}

Tensor AdaptiveMaxPool1d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return adaptive_max_pool1d(x, output_size, loc);
}

MaxPool3d::MaxPool3d(Size3 kernel, std::optional<Size3> stride, Size3 padding, Size3 dilation,
                     bool ceil_mode)
    : kernel(kernel), stride(stride), padding(padding), dilation(dilation), ceil_mode(ceil_mode) {}

Tensor MaxPool3d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return max_pool3d(x, kernel, stride, padding, dilation, ceil_mode, loc);
}

ValuesIndices MaxPool3d::with_indices(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return max_pool3d_with_indices(x, kernel, stride, padding, dilation, ceil_mode, loc);
}

AvgPool3d::AvgPool3d(Size3 kernel, std::optional<Size3> stride, Size3 padding, bool ceil_mode,
                     bool count_include_pad)
    : kernel(kernel),
      stride(stride),
      padding(padding),
      ceil_mode(ceil_mode),
      count_include_pad(count_include_pad) {}

Tensor AvgPool3d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return avg_pool3d(x, kernel, stride, padding, ceil_mode, count_include_pad, loc);
}

AdaptiveAvgPool3d::AdaptiveAvgPool3d(Size3 output_size) : output_size(output_size) {}

Tensor AdaptiveAvgPool3d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return adaptive_avg_pool3d(x, output_size, loc);
}

AdaptiveMaxPool3d::AdaptiveMaxPool3d(Size3 output_size) : output_size(output_size) {}

Tensor AdaptiveMaxPool3d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return adaptive_max_pool3d(x, output_size, loc);
}

Unfold::Unfold(Size2 kernel_size, Size2 dilation, Size2 padding, Size2 stride)
    : kernel_size(kernel_size), dilation(dilation), padding(padding), stride(stride) {}

Tensor Unfold::operator()(const Tensor& x, const Loc& loc) const {
  return unfold(x, kernel_size, dilation, padding, stride, loc);
}

Fold::Fold(Size2 output_size, Size2 kernel_size, Size2 dilation, Size2 padding, Size2 stride)
    : output_size(output_size),
      kernel_size(kernel_size),
      dilation(dilation),
      padding(padding),
      stride(stride) {}

Tensor Fold::operator()(const Tensor& x, const Loc& loc) const {
  return fold(x, output_size, kernel_size, dilation, padding, stride, loc);
}

Dropout2d::Dropout2d(double p, Generator* gen) : p(p), gen_(gen) {
  if (!(p >= 0 && p <= 1)) fail("Dropout2d: p must be in [0, 1], got {}", p);
}

Tensor Dropout2d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return dropout2d(x, p, is_training(), gen_, loc);
}

Dropout3d::Dropout3d(double p, Generator* gen) : p(p), gen_(gen) {
  if (!(p >= 0 && p <= 1)) fail("Dropout3d: p must be in [0, 1], got {}", p);
}

Tensor Dropout3d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return dropout3d(x, p, is_training(), gen_, loc);
}

Upsample::Upsample(InterpolateOptions options) : options(std::move(options)) {
  if (this->options.size.empty() == this->options.scale_factor.empty())
    fail("Upsample: needs either size or scale_factor, not {}",
         this->options.size.empty() ? "neither" : "both");
}

Tensor Upsample::operator()(const Tensor& x, const Loc& loc) const {
  return interpolate(x, options, loc);
}

PixelShuffle::PixelShuffle(int64_t upscale_factor) : upscale_factor(upscale_factor) {
  if (upscale_factor < 1) fail("PixelShuffle: the factor must be positive, got {}", upscale_factor);
}

Tensor PixelShuffle::operator()(const Tensor& x, const Loc& loc) const {
  return pixel_shuffle(x, upscale_factor, loc);
}

PixelUnshuffle::PixelUnshuffle(int64_t downscale_factor) : downscale_factor(downscale_factor) {
  if (downscale_factor < 1)
    fail("PixelUnshuffle: the factor must be positive, got {}", downscale_factor);
}

Tensor PixelUnshuffle::operator()(const Tensor& x, const Loc& loc) const {
  return pixel_unshuffle(x, downscale_factor, loc);
}

Flatten::Flatten(int64_t start_dim, int64_t end_dim) : start_dim(start_dim), end_dim(end_dim) {}

Tensor Flatten::operator()(const Tensor& x, const Loc& loc) const {
  return flatten(x, start_dim, end_dim, loc);
}

Sequential::~Sequential() = default;

Sequential& Sequential::append(Step step) {
  if (!step) fail("Sequential '{}': an empty step at index {}", path(), steps_.size());
  steps_.push_back(std::move(step));
  return *this;
}

Tensor Sequential::operator()(const Tensor& x, const Loc& loc) const {
  CallSiteScope site(loc);
  ModulePathScope scope = forward_scope();  // one call, its steps' calls inside it
  Tensor y = x;
  for (const Step& step : steps_) y = step(y);
  return y;
}

Tensor activate(Activation activation, const Tensor& x) {
  switch (activation) {
    case Activation::Relu:
      return relu(x);
    case Activation::Gelu:
      return gelu(x);
    case Activation::GeluTanh:
      return gelu_tanh(x);
    case Activation::Silu:
      return silu(x);
    case Activation::Tanh:
      return tanh(x);
  }
  return x;
}

MLP::MLP(std::vector<int64_t> sizes, Activation activation, Generator* gen)
    : activation(activation) {
  if (sizes.size() < 2) fail("MLP: needs at least an input and an output size");
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    layers.push_back(std::make_unique<Linear>(sizes[i], sizes[i + 1], true, gen));
    register_module("fc" + std::to_string(i + 1), *layers.back());
  }
}

MLP::~MLP() = default;

Tensor MLP::operator()(const Tensor& x, const Loc& loc) const {
  CallSiteScope site(loc);
  ModulePathScope scope = forward_scope();  // one call, its layers' calls inside it
  Tensor h = x;
  for (size_t i = 0; i < layers.size(); ++i) {
    h = (*layers[i])(h);
    if (i + 1 < layers.size()) h = activate(activation, h);
  }
  return h;
}

CausalSelfAttention::CausalSelfAttention(int64_t dim, int64_t heads, double dropout, Generator* gen)
    : qkv(dim, 3 * dim, true, gen),
      proj(dim, dim, true, gen),
      heads(heads),
      attn_dropout(dropout, gen) {
  if (heads <= 0 || dim % heads != 0)
    fail("CausalSelfAttention: dim {} is not divisible by {} heads", dim, heads);
  register_module("qkv", qkv);
  register_module("proj", proj);
  register_module("attn_dropout", attn_dropout);
}

Tensor CausalSelfAttention::operator()(const Tensor& x, const Loc& loc) const {
  CallSiteScope site(loc);
  ModulePathScope scope = forward_scope();
  if (!x.defined() || x.dim() != 3 || x.size(2) * 3 != qkv.weight.size(0))
    op_fail("CausalSelfAttention", loc, "expects [batch, time, {}], got {}", qkv.weight.size(1),
            x.defined() ? to_string(x.shape()) : "undefined");
  int64_t batch = x.size(0), time = x.size(1), dim = x.size(2), head_dim = dim / heads;
  Tensor projected = qkv(x);  // [B, T, 3C]
  auto split_heads = [&](int64_t part) {
    Tensor t = slice(projected, 2, part * dim, (part + 1) * dim);
    return permute(reshape(t, {batch, time, heads, head_dim}), {0, 2, 1, 3});  // [B, H, T, D]
  };
  Tensor q = split_heads(0), k = split_heads(1), v = split_heads(2);
  // One fused node (memory linear in T): attn_dropout's p and generator drop its weights, the
  // mask drawn as attn_dropout(weights) would draw it.
  const double p = attn_dropout.is_training() ? attn_dropout.p : 0.0;
  Tensor attended = detail::attention(q, k, v, Tensor(), true, std::nullopt, true, loc, p,
                                      attn_dropout.generator());
  Tensor merged = reshape(permute(attended, {0, 2, 1, 3}), {batch, time, dim});
  return proj(merged);
}

TransformerBlock::TransformerBlock(int64_t dim, int64_t heads, double dropout, Generator* gen)
    : ln1(dim),
      attn(dim, heads, dropout, gen),
      ln2(dim),
      mlp({dim, 4 * dim, dim}, Activation::GeluTanh, gen),
      resid_dropout(dropout, gen) {
  register_module("ln1", ln1);
  register_module("attn", attn);
  register_module("ln2", ln2);
  register_module("mlp", mlp);
  register_module("resid_dropout", resid_dropout);
}

Tensor TransformerBlock::operator()(const Tensor& x, const Loc& loc) const {
  CallSiteScope site(loc);
  // The residual sums are the block's own nodes, so that checkpointing the block covers them.
  ModulePathScope scope = forward_scope();
  Tensor h = x + resid_dropout(attn(ln1(x)));
  return h + resid_dropout(mlp(ln2(h)));
}

}  // namespace mixtape
