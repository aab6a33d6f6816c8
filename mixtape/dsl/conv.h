// mixtape/dsl/conv.h -- convolutions as PyTorch has them (conv1d, conv2d, conv3d and their
// transposes) and the geometry their three primitives share.
#pragma once

#include <compare>
#include <cstdint>
#include <string>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/tensor.h"

namespace mixtape {

/// PyTorch's padding='same' and padding='valid' of conv1d and conv2d. Same pads each axis by
/// dilation (kernel - 1) in all, the odd one after (right, bottom), so that the output is as large
/// as the input; it needs stride 1. Valid pads nothing.
enum class Padding { Same, Valid };

/// conv2d's padding: sizes, as PyTorch's `int or tuple` (`.padding = 1`, `.padding = {1, 0}`),
/// or a rule (`.padding = mt::Padding::Same`).
struct ConvPadding2 : Size2 {
  ConvPadding2(int64_t both) : Size2(both) {}  // NOLINT: implicit, as PyTorch's int argument
  ConvPadding2(int64_t h, int64_t w) : Size2(h, w) {}
  ConvPadding2(Padding rule) : Size2(0), same(rule == Padding::Same) {}  // NOLINT: as 'same'
  bool same = false;
};
/// conv1d's padding: a size or a rule.
struct ConvPadding1 {
  ConvPadding1(int64_t size) : size(size) {}  // NOLINT: implicit, as PyTorch's int argument
  ConvPadding1(Padding rule) : same(rule == Padding::Same) {}  // NOLINT: as 'same'
  int64_t size = 0;
  bool same = false;
};

/// conv3d's padding: sizes (one for all axes, or depth, height, width) or a rule.
struct ConvPadding3 : Size3 {
  ConvPadding3(int64_t all) : Size3(all) {}  // NOLINT: implicit, as PyTorch's int argument
  ConvPadding3(int64_t d, int64_t h, int64_t w) : Size3(d, h, w) {}
  ConvPadding3(Padding rule) : Size3(0), same(rule == Padding::Same) {}  // NOLINT: as 'same'
  bool same = false;
};

/// `padding_mode` is the modules' argument in PyTorch (Conv1d, Conv2d), which their functions
/// take here too: Constant pads zeros ('zeros'), Reflect, Replicate and Circular pad the input
/// with mt::pad before a convolution without padding, as PyTorch's modules do.
struct Conv2dOptions {
  Size2 stride = 1;
  ConvPadding2 padding = 0;
  Size2 dilation = 1;
  int64_t groups = 1;
  PadMode padding_mode = PadMode::Constant;
};
struct Conv1dOptions {
  int64_t stride = 1;
  ConvPadding1 padding = 0;
  int64_t dilation = 1, groups = 1;
  PadMode padding_mode = PadMode::Constant;
};
struct Conv3dOptions {
  Size3 stride = 1;
  ConvPadding3 padding = 0;
  Size3 dilation = 1;
  int64_t groups = 1;
  PadMode padding_mode = PadMode::Constant;
};
struct ConvTranspose1dOptions {
  int64_t stride = 1, padding = 0, output_padding = 0, groups = 1, dilation = 1;
};
struct ConvTranspose3dOptions {
  Size3 stride = 1, padding = 0, output_padding = 0;
  int64_t groups = 1;
  Size3 dilation = 1;
};
struct ConvTranspose2dOptions {
  Size2 stride = 1, padding = 0, output_padding = 0;
  int64_t groups = 1;
  Size2 dilation = 1;
};

/// torch.nn.functional.conv2d: x [N, C, H, W] (or [C, H, W]), weight [O, C / groups, KH, KW],
/// bias [O] or undefined -> [N, O, OH, OW] with OH = (H + 2 pad - dil (KH - 1) - 1) / stride + 1.
/// A low-precision op with f32 accumulation under autocast, as matmul. Padding 'same', or a
/// padding mode other than zeros, pads x with mt::pad first (in x's type, as PyTorch).
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              const Conv2dOptions& options = {}, const Loc& loc = Loc::current());
/// torch.nn.functional.conv1d: x [N, C, L] (or [C, L]), weight [O, C / groups, K].
Tensor conv1d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              const Conv1dOptions& options = {}, const Loc& loc = Loc::current());
/// torch.nn.functional.conv3d: x [N, C, D, H, W] (or [C, D, H, W]), weight [O, C / groups, KD, KH,
/// KW], bias [O] -> [N, O, OD, OH, OW], each axis sized as conv2d's, with its options per axis
/// (depth, height, width). Lowered to one 2-d convolution, so that every back end runs it on its
/// conv2d primitives and each output is one f32 sum rounded once: the KD depth taps of each
/// output depth are gathered into channels (x as [N OD, C KD, H, W], KD / stride times its size;
/// the weight as [O, C / groups KD, KH, KW], a view).
Tensor conv3d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              const Conv3dOptions& options = {}, const Loc& loc = Loc::current());
/// torch.nn.functional.conv_transpose2d: x [N, Cin, H, W], weight [Cin, Cout / groups, KH, KW]
/// -> [N, Cout, (H - 1) stride - 2 pad + dil (KH - 1) + output_padding + 1, ...]: the gradient
/// of conv2d with respect to its input.
Tensor conv_transpose2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
                        const ConvTranspose2dOptions& options = {},
                        const Loc& loc = Loc::current());

/// torch.nn.functional.conv_transpose1d: x [N, Cin, L] (or [Cin, L]), weight [Cin, Cout / groups,
/// K]: conv_transpose2d over a height of one.
Tensor conv_transpose1d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
                        const ConvTranspose1dOptions& options = {},
                        const Loc& loc = Loc::current());
/// torch.nn.functional.conv_transpose3d: x [N, Cin, D, H, W] (or unbatched), weight [Cin,
/// Cout / groups, KD, KH, KW] -> [N, Cout, (D - 1) stride - 2 pad + dil (KD - 1) + output_padding
/// + 1, ...]: conv3d's gradient with respect to its input. Lowered to one 2-d transposed
/// convolution, each output one f32 sum: along the depth a direct convolution of x's depths
/// spread a stride apart, its KD taps gathered into channels (stride KD times x's size).
Tensor conv_transpose3d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
                        const ConvTranspose3dOptions& options = {},
                        const Loc& loc = Loc::current());

/// The primitives' window attribute (dsl/attrs.def): strides, paddings, dilations, groups.
struct ConvWindow {
  int64_t stride[2] = {1, 1}, pad[2] = {0, 0}, dil[2] = {1, 1}, groups = 1;
  Ints attr() const;
  static ConvWindow from(const Ints& attr);
  auto operator<=>(const ConvWindow&) const = default;
  /// The window of conv2d's (or conv_transpose2d's) options with padding in sizes (conv2d
  /// resolves a rule and a padding mode into an explicit pad and this window).
  template <typename Options>
  static ConvWindow of(const Options& o) {
    if constexpr (requires { o.padding.same; })
      if (o.padding.same) fail("ConvWindow::of: padding 'same' has no window before a kernel");
    ConvWindow w;
    w.stride[0] = o.stride.h, w.stride[1] = o.stride.w;
    w.pad[0] = o.padding.h, w.pad[1] = o.padding.w;
    w.dil[0] = o.dilation.h, w.dil[1] = o.dilation.w;
    w.groups = o.groups;
    return w;
  }
};

/// The sizes of one 2-d convolution x [n, c, h, w] * w [o, c / groups, kh, kw] -> [n, o, oh, ow],
/// read from a node of any of the three primitives.
struct ConvGeometry {
  int64_t n, c, h, w, o, kh, kw, oh, ow;
  ConvWindow window;
  static ConvGeometry of(const Node& node);
  auto operator<=>(const ConvGeometry&) const = default;
  /// "<op>(x [n, c, h, w], w [o, c / groups, kh, kw], y [n, o, oh, ow], stride (...), padding
  /// (...), dilation (...), groups g)": one primitive's problem, for the back ends' messages.
  std::string describe(OpCode op) const;
};

/// The primitives, made by the functions above and by each other's vjps. conv2d_input_grad(gy,
/// w) has the shape of the convolution's input, `input_shape` (several input sizes give one
/// output size); conv2d_weight_grad(x, gy) has the weight's.
Tensor conv2d_forward(const Tensor& x, const Tensor& weight, const ConvWindow& window,
                      const Loc& loc = Loc::current());
Tensor conv2d_input_grad(const Tensor& grad_out, const Tensor& weight, const Shape& input_shape,
                         const ConvWindow& window, const Loc& loc = Loc::current());
Tensor conv2d_weight_grad(const Tensor& x, const Tensor& grad_out, const Shape& weight_shape,
                          const ConvWindow& window, const Loc& loc = Loc::current());

}  // namespace mixtape
