// mixtape/dsl/conv_layers.cpp -- Conv1d, Conv2d, Conv3d and their transposes.
#include "mixtape/dsl/conv_layers.h"

#include <cmath>
#include <string>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/nn.h"

namespace mixtape {
namespace {

// Checks a layer's sizes; returns the bound of its U(-bound, bound) initialization, 1/sqrt(fan_in),
// which PyTorch's kaiming_uniform_(a=sqrt(5)) and its bias rule both give.
double init_bound(const char* kind, int64_t in_channels, int64_t out_channels, int64_t groups,
                  const Shape& weight_shape) {
  if (in_channels <= 0 || out_channels <= 0 || groups <= 0)
    fail("{}: channels and groups must be positive, got in={} out={} groups={}", kind, in_channels,
         out_channels, groups);
  if (in_channels % groups != 0 || out_channels % groups != 0)
    fail("{}: groups {} must divide the input's {} and the output's {} channels", kind, groups,
         in_channels, out_channels);
  int64_t fan_in = 1;
  for (size_t d = 1; d < weight_shape.size(); ++d) {
    if (weight_shape[d] <= 0)
      fail("{}: kernel sizes must be positive, weight {}", kind, to_string(weight_shape));
    fan_in *= weight_shape[d];
  }
  return 1.0 / std::sqrt(static_cast<double>(fan_in));
}

// Draws a layer's weight of `weight_shape` and, with `with_bias`, its bias [bias_size] from
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)), after checking the sizes.
void draw_parameters(const char* kind, int64_t in_channels, int64_t out_channels, int64_t groups,
                     const Shape& weight_shape, int64_t bias_size, bool with_bias, Generator* gen,
                     Tensor& weight, Tensor& bias) {
  const double bound = init_bound(kind, in_channels, out_channels, groups, weight_shape);
  weight = init::uniform(weight_shape, -bound, bound, gen);
  if (with_bias) bias = init::uniform({bias_size}, -bound, bound, gen);
}

// As torch.nn's modules, a strided convolution with padding 'same' fails when it is made.
void check_same_padding(const char* module, bool same, bool strided, const std::string& stride) {
  if (same && strided) fail("{}: padding 'same' needs stride 1, got stride {}", module, stride);
}

}  // namespace

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size,
               const Conv2dOptions& options, bool with_bias, Generator* gen)
    : options(options) {
  check_same_padding("Conv2d", options.padding.same, options.stride.h != 1 || options.stride.w != 1,
                     fmt::format("({}, {})", options.stride.h, options.stride.w));
  Shape shape{out_channels, in_channels / std::max<int64_t>(1, options.groups), kernel_size.h,
              kernel_size.w};
  draw_parameters("Conv2d", in_channels, out_channels, options.groups, shape, out_channels,
                  with_bias, gen, weight, bias);
  register_parameter("weight", &weight);
  if (with_bias) register_parameter("bias", &bias);
}

Tensor Conv2d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return conv2d(x, weight, bias, options, loc);
}

Conv3d::Conv3d(int64_t in_channels, int64_t out_channels, Size3 kernel_size,
               const Conv3dOptions& options, bool with_bias, Generator* gen)
    : options(options) {
  const Size3& s = options.stride;
  check_same_padding("Conv3d", options.padding.same, s.d != 1 || s.h != 1 || s.w != 1,
                     fmt::format("({}, {}, {})", s.d, s.h, s.w));
  Shape shape{out_channels, in_channels / std::max<int64_t>(1, options.groups), kernel_size.d,
              kernel_size.h, kernel_size.w};
  draw_parameters("Conv3d", in_channels, out_channels, options.groups, shape, out_channels,
                  with_bias, gen, weight, bias);
  register_parameter("weight", &weight);
  if (with_bias) register_parameter("bias", &bias);
}

Tensor Conv3d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return conv3d(x, weight, bias, options, loc);
}

Conv1d::Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size,
               const Conv1dOptions& options, bool with_bias, Generator* gen)
    : options(options) {
  check_same_padding("Conv1d", options.padding.same, options.stride != 1,
                     std::to_string(options.stride));
  Shape shape{out_channels, in_channels / std::max<int64_t>(1, options.groups), kernel_size};
  draw_parameters("Conv1d", in_channels, out_channels, options.groups, shape, out_channels,
                  with_bias, gen, weight, bias);
  register_parameter("weight", &weight);
  if (with_bias) register_parameter("bias", &bias);
}

Tensor Conv1d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return conv1d(x, weight, bias, options, loc);
}

ConvTranspose2d::ConvTranspose2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size,
                                 const ConvTranspose2dOptions& options, bool with_bias,
                                 Generator* gen)
    : options(options) {
  Shape shape{in_channels, out_channels / std::max<int64_t>(1, options.groups), kernel_size.h,
              kernel_size.w};
  draw_parameters("ConvTranspose2d", in_channels, out_channels, options.groups, shape, out_channels,
                  with_bias, gen, weight, bias);
  register_parameter("weight", &weight);
  if (with_bias) register_parameter("bias", &bias);
}

Tensor ConvTranspose2d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return conv_transpose2d(x, weight, bias, options, loc);
}

ConvTranspose1d::ConvTranspose1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size,
                                 const ConvTranspose1dOptions& options, bool with_bias,
                                 Generator* gen)
    : options(options) {
  Shape shape{in_channels, out_channels / std::max<int64_t>(1, options.groups), kernel_size};
  draw_parameters("ConvTranspose1d", in_channels, out_channels, options.groups, shape, out_channels,
                  with_bias, gen, weight, bias);
  register_parameter("weight", &weight);
  if (with_bias) register_parameter("bias", &bias);
}

Tensor ConvTranspose1d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return conv_transpose1d(x, weight, bias, options, loc);
}

ConvTranspose3d::ConvTranspose3d(int64_t in_channels, int64_t out_channels, Size3 kernel_size,
                                 const ConvTranspose3dOptions& options, bool with_bias,
                                 Generator* gen)
    : options(options) {
  Shape shape{in_channels, out_channels / std::max<int64_t>(1, options.groups), kernel_size.d,
              kernel_size.h, kernel_size.w};
  draw_parameters("ConvTranspose3d", in_channels, out_channels, options.groups, shape, out_channels,
                  with_bias, gen, weight, bias);
  register_parameter("weight", &weight);
  if (with_bias) register_parameter("bias", &bias);
}

Tensor ConvTranspose3d::operator()(const Tensor& x, const Loc& loc) const {
  ModulePathScope scope = forward_scope();
  return conv_transpose3d(x, weight, bias, options, loc);
}

}  // namespace mixtape
