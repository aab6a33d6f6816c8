// mixtape/dsl/conv.cpp -- conv1d, conv2d and conv_transpose2d over the three convolution
// primitives, and the shape checks they share.
#include "mixtape/dsl/conv.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <utility>

#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/ops.h"

namespace mixtape {

Ints ConvWindow::attr() const {
  return {stride[0], stride[1], pad[0], pad[1], dil[0], dil[1], groups};
}

ConvWindow ConvWindow::from(const Ints& attr) {
  if (attr.size() != 7) fail("a convolution's window has 7 entries, got {}", attr.size());
  ConvWindow w;
  for (int d = 0; d < 2; ++d) {
    w.stride[d] = attr[d];
    w.pad[d] = attr[2 + d];
    w.dil[d] = attr[4 + d];
  }
  w.groups = attr[6];
  // A window read back from an artifact's plan is checked as the builders check one.
  for (int d = 0; d < 2; ++d)
    if (w.stride[d] < 1 || w.dil[d] < 1 || w.pad[d] < 0)
      fail("a convolution's window has a stride, dilation or padding out of range");
  if (w.groups < 1) fail("a convolution's window has {} groups", w.groups);
  return w;
}

ConvGeometry ConvGeometry::of(const Node& node) {
  // Conv2d: (x, w) -> y; Conv2dInputGrad: (gy, w) -> x; Conv2dWeightGrad: (x, gy) -> w.
  const Shape* x = &node.inputs[0]->shape;
  const Shape* w = &node.inputs[1]->shape;
  const Shape* y = &node.shape;
  if (node.op == OpCode::Conv2dInputGrad) std::swap(x, y);
  if (node.op == OpCode::Conv2dWeightGrad) std::swap(w, y);
  ConvGeometry g{(*x)[0], (*x)[1], (*x)[2], (*x)[3], (*w)[0],
                 (*w)[2], (*w)[3], (*y)[2], (*y)[3], ConvWindow::from(node.attrs.window)};
  return g;
}

namespace {

std::string window_text(const ConvWindow& w) {
  return fmt::format("stride ({}, {}), padding ({}, {}), dilation ({}, {}), groups {}", w.stride[0],
                     w.stride[1], w.pad[0], w.pad[1], w.dil[0], w.dil[1], w.groups);
}

}  // namespace

std::string ConvGeometry::describe(OpCode op) const {
  return fmt::format("{}(x [{}, {}, {}, {}], w [{}, {}, {}, {}], y [{}, {}, {}, {}], {})",
                     op_name(op), n, c, h, w, o, c / window.groups, kh, kw, n, o, oh, ow,
                     window_text(window));
}

namespace {

// Window sizes up to 2^31: with dims below 2^60 (make_node's bound) every size computed from
// them below fits in 64 bits.
constexpr int64_t kMaxWindow = int64_t{1} << 31;

void check_window(const char* op, const ConvWindow& w, const Loc& loc) {
  for (int d = 0; d < 2; ++d) {
    if (w.stride[d] < 1) op_fail(op, loc, "stride must be positive: {}", window_text(w));
    if (w.dil[d] < 1) op_fail(op, loc, "dilation must be positive: {}", window_text(w));
    if (w.pad[d] < 0) op_fail(op, loc, "padding must not be negative: {}", window_text(w));
    if (w.stride[d] > kMaxWindow || w.dil[d] > kMaxWindow || w.pad[d] > kMaxWindow)
      op_fail(op, loc, "window sizes above 2^31: {}", window_text(w));
  }
  if (w.groups < 1) op_fail(op, loc, "groups must be positive: {}", window_text(w));
  if (w.groups > kMaxWindow) op_fail(op, loc, "window sizes above 2^31: {}", window_text(w));
}

// A kernel's dilated extent, dil (k - 1) + 1, where k may be near 2^60: an mt::Error past 2^62.
int64_t dilated_extent(const char* op, int64_t dil, int64_t k, const Loc& loc) {
  const __int128 extent = static_cast<__int128>(dil) * (k - 1) + 1;
  if (extent > (__int128{1} << 62))
    op_fail(op, loc, "a kernel of {} dilated by {} spans more than 2^62 elements", k, dil);
  return static_cast<int64_t>(extent);
}

// The output shape of x [N, C, H, W] * w [O, C / groups, KH, KW], after checking that they fit.
Shape conv_output_shape(const char* op, const Shape& x, const Shape& w, const ConvWindow& win,
                        const Loc& loc) {
  check_window(op, win, loc);
  if (x.size() != 4) op_fail(op, loc, "input must be [N, C, H, W], got {}", to_string(x));
  if (w.size() != 4)
    op_fail(op, loc, "weight must be [out_channels, in_channels / groups, KH, KW], got {}",
            to_string(w));
  if (x[1] % win.groups != 0 || w[0] % win.groups != 0)
    op_fail(op, loc, "groups {} must divide the input's {} and the output's {} channels",
            win.groups, x[1], w[0]);
  if (w[1] * win.groups != x[1])
    op_fail(op, loc, "weight {} expects {} input channels ({} per group of {}), input {} has {}",
            to_string(w), w[1] * win.groups, w[1], win.groups, to_string(x), x[1]);
  Shape out{x[0], w[0], 0, 0};
  for (int d = 0; d < 2; ++d) {
    if (w[2 + d] < 1) op_fail(op, loc, "kernel {} has an empty spatial dimension", to_string(w));
    int64_t padded = x[2 + d] + 2 * win.pad[d];
    int64_t extent = dilated_extent(op, win.dil[d], w[2 + d], loc);
    if (padded < extent)
      op_fail(op, loc, "kernel {} (dilated {}) is larger than the padded input {} ({} with {})",
              to_string(w), extent, padded, to_string(x), window_text(win));
    out[2 + d] = (padded - extent) / win.stride[d] + 1;
  }
  return out;
}

DType operand_type(const char* op, const Tensor& a, const Tensor& b, const Loc& loc) {
  if (!a.defined() || !b.defined()) op_fail(op, loc, "an operand is an undefined tensor");
  DType t = promote(a.dtype(), b.dtype());
  if (!is_floating(t)) op_fail(op, loc, "expects floating-point tensors, got {}", name(t));
  return t;
}

Tensor conv_node(OpCode op, const Tensor& a, const Tensor& b, DType t, Shape shape,
                 const ConvWindow& window, const Loc& loc) {
  NodeInputs inputs;
  inputs.reserve(2);
  inputs.emplace_back(cast(a, t, loc).node());
  inputs.emplace_back(cast(b, t, loc).node());
  Attrs attrs;
  attrs.window = window.attr();
  return Tensor(make_node(op, t, std::move(shape), std::move(inputs), std::move(attrs), loc));
}

void check_same(const char* op, const Shape& expected, const Tensor& given, const char* what,
                const Loc& loc) {
  if (given.shape() != expected)
    op_fail(op, loc, "{} is {}, the convolution's is {}", what, to_string(given.shape()),
            to_string(expected));
}

// Adds a [channels] bias to y [N, channels, ...].
Tensor add_bias(const char* op, Tensor y, const Tensor& bias, const Loc& loc) {
  if (!bias.defined()) return y;
  if (bias.shape() != Shape{y.size(1)})
    op_fail(op, loc, "bias shape {} should be [{}]", to_string(bias.shape()), y.size(1));
  Shape at(y.dim(), 1);
  at[1] = y.size(1);
  return y + reshape(bias, at, loc);
}

// The forward primitive, its errors naming `op`: what the user called.
Tensor forward(const char* op, const Tensor& x, const Tensor& weight, const ConvWindow& window,
               const Loc& loc) {
  DType t = operand_type(op, x, weight, loc);
  Shape out = conv_output_shape(op, x.shape(), weight.shape(), window, loc);
  return conv_node(OpCode::Conv2d, x, weight, t, std::move(out), window, loc);
}

}  // namespace

Tensor conv2d_forward(const Tensor& x, const Tensor& weight, const ConvWindow& window,
                      const Loc& loc) {
  return forward(op_name(OpCode::Conv2d), x, weight, window, loc);
}

Tensor conv2d_input_grad(const Tensor& grad_out, const Tensor& weight, const Shape& input_shape,
                         const ConvWindow& window, const Loc& loc) {
  const char* op = op_name(OpCode::Conv2dInputGrad);
  DType t = operand_type(op, grad_out, weight, loc);
  check_same(op, conv_output_shape(op, input_shape, weight.shape(), window, loc), grad_out,
             "the output gradient", loc);
  return conv_node(OpCode::Conv2dInputGrad, grad_out, weight, t, input_shape, window, loc);
}

Tensor conv2d_weight_grad(const Tensor& x, const Tensor& grad_out, const Shape& weight_shape,
                          const ConvWindow& window, const Loc& loc) {
  const char* op = op_name(OpCode::Conv2dWeightGrad);
  DType t = operand_type(op, x, grad_out, loc);
  check_same(op, conv_output_shape(op, x.shape(), weight_shape, window, loc), grad_out,
             "the output gradient", loc);
  return conv_node(OpCode::Conv2dWeightGrad, x, grad_out, t, weight_shape, window, loc);
}

namespace {

// x [N, C, H, W] and the window of conv1d's and conv2d's options, their padding resolved as
// PyTorch resolves it: 'same' pads dilation (k - 1) per axis, the odd one after. A padding mode
// other than zeros pads x with mt::pad first, for a convolution without padding; with zeros, the
// window pads both sides alike and mt::pad adds 'same''s odd row or column. The padding happens
// before the convolution's composite opens, as PyTorch's modules pad in x's type before theirs.
std::pair<Tensor, ConvWindow> resolve_padding(const char* op, const Tensor& x, const Tensor& weight,
                                              const Conv2dOptions& options, const Loc& loc) {
  ConvWindow window;
  window.stride[0] = options.stride.h, window.stride[1] = options.stride.w;
  window.dil[0] = options.dilation.h, window.dil[1] = options.dilation.w;
  window.groups = options.groups;
  if (!options.padding.same) window.pad[0] = options.padding.h, window.pad[1] = options.padding.w;
  check_window(op, window, loc);
  if (!options.padding.same && options.padding_mode == PadMode::Constant) return {x, window};
  // The shapes' own errors come from the convolution.
  if (x.dim() != 4 || weight.dim() != 4) return {x, window};
  int64_t before[2], after[2];
  for (int d = 0; d < 2; ++d) {
    before[d] = after[d] = window.pad[d];
    if (!options.padding.same) continue;
    if (window.stride[d] != 1)
      op_fail(op, loc, "padding 'same' needs stride 1, got stride {}", window.stride[d]);
    const int64_t total =
        std::max<int64_t>(0, dilated_extent(op, window.dil[d], weight.size(2 + d), loc) - 1);
    before[d] = total / 2;
    after[d] = total - before[d];
  }
  if (options.padding_mode == PadMode::Constant) {
    window.pad[0] = before[0], window.pad[1] = before[1];
    check_window(op, window, loc);
    if (after[0] == before[0] && after[1] == before[1]) return {x, window};
    return {pad(x, {0, after[1] - before[1], 0, after[0] - before[0]}, PadMode::Constant, 0.0, loc),
            window};
  }
  window.pad[0] = window.pad[1] = 0;
  return {pad(x, {before[1], after[1], before[0], after[0]}, options.padding_mode, 0.0, loc),
          window};
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
              const Conv2dOptions& options, const Loc& loc) {
  if (!x.defined() || !weight.defined())
    op_fail("conv2d", loc, "the input or the weight is an undefined tensor");
  if (x.dim() == 3) {
    Tensor y = conv2d(unsqueeze(x, 0, loc), weight, bias, options, loc);
    CallSiteScope site(loc, composite::conv2d);
    return squeeze(y, 0, loc);
  }
  const auto [input, window] = resolve_padding("conv2d", x, weight, options, loc);
  CallSiteScope site(loc, composite::conv2d);
  return add_bias("conv2d", forward("conv2d", input, weight, window, loc), bias, loc);
}

Tensor conv1d(const Tensor& x, const Tensor& weight, const Tensor& bias,
              const Conv1dOptions& options, const Loc& loc) {
  if (!x.defined() || !weight.defined())
    op_fail("conv1d", loc, "the input or the weight is an undefined tensor");
  if (x.dim() == 2) {
    Tensor y = conv1d(unsqueeze(x, 0, loc), weight, bias, options, loc);
    CallSiteScope site(loc, composite::conv1d);
    return squeeze(y, 0, loc);
  }
  if (x.dim() != 3) op_fail("conv1d", loc, "input must be [N, C, L], got {}", to_string(x.shape()));
  if (weight.dim() != 3)
    op_fail("conv1d", loc, "weight must be [out_channels, in_channels / groups, K], got {}",
            to_string(weight.shape()));
  // A 2-d convolution over a height of one.
  const Tensor x2 = unsqueeze(x, 2, loc), weight2 = unsqueeze(weight, 2, loc);
  const Conv2dOptions options2{.stride = {1, options.stride},
                               .padding = options.padding.same
                                              ? ConvPadding2(Padding::Same)
                                              : ConvPadding2(0, options.padding.size),
                               .dilation = {1, options.dilation},
                               .groups = options.groups,
                               .padding_mode = options.padding_mode};
  const auto [input, window] = resolve_padding("conv1d", x2, weight2, options2, loc);
  CallSiteScope site(loc, composite::conv1d);
  Tensor y = forward("conv1d", input, weight2, window, loc);
  return add_bias("conv1d", squeeze(y, 2, loc), bias, loc);
}

namespace {

// A 3-d window's strides, dilations and paddings per axis (depth, height, width), checked as
// conv2d's; `text` describes the window for the message.
template <typename Text>
void check_window3(const char* op, const int64_t (&stride)[3], const int64_t (&dil)[3],
                   const int64_t (&padding)[3], const Text& text, const Loc& loc) {
  for (int a = 0; a < 3; ++a) {
    if (stride[a] < 1 || dil[a] < 1 || padding[a] < 0)
      op_fail(op, loc, "stride and dilation must be positive, padding not negative: {}", text());
    if (std::max({stride[a], dil[a], padding[a]}) > kMaxWindow)
      op_fail(op, loc, "window sizes above 2^31: {}", text());
  }
}

// Refuses a volume op's intermediate `what` of `shape` past max_tensor_bytes, naming `op`.
void check_intermediate(const char* op, const char* what, const Shape& shape, DType type,
                        const Loc& loc) {
  const std::optional<int64_t> elements = checked_numel(shape);
  if (!elements || *elements > max_tensor_bytes / static_cast<int64_t>(size_of(type)))
    op_fail(op, loc, "{} {} would span more than 2^60 bytes", what, to_string(shape));
}

// The depth taps of x [N, C, D, H, W] as channels: [N count, C kd, H, W], whose channel c kd + t
// holds depth z step + t dil of output depth z (each group's channels stay together).
Tensor depth_taps(const char* op, const Tensor& x, int64_t kd, int64_t dil, int64_t step,
                  int64_t count, const Loc& loc) {
  const int64_t n = x.size(0), c = x.size(1), h = x.size(3), w = x.size(4);
  check_intermediate(op, "the depth taps gathered into channels (kernel depth times the output)",
                     {n, count, c, kd, h, w}, x.dtype(), loc);
  std::vector<Tensor> taps;
  taps.reserve(static_cast<size_t>(kd));
  for (int64_t t = 0; t < kd; ++t)
    taps.push_back(slice(x, {0, 0, t * dil, 0, 0}, {1, 1, step, 1, 1}, {n, c, count, h, w}, loc));
  return reshape(permute(stack(taps, 2, loc), {0, 3, 1, 2, 4, 5}, loc), {n * count, c * kd, h, w},
                 loc);
}

// y [N count, O, H, W] of depth_taps' columns as [N, O, count, H, W].
Tensor volume_of(const Tensor& y, int64_t n, int64_t count, const Loc& loc) {
  return permute(reshape(y, {n, count, y.size(1), y.size(2), y.size(3)}, loc), {0, 2, 1, 3, 4},
                 loc);
}

}  // namespace

Tensor conv3d(const Tensor& x, const Tensor& weight, const Tensor& bias,
              const Conv3dOptions& options, const Loc& loc) {
  const char* op = "conv3d";
  if (!x.defined() || !weight.defined())
    op_fail(op, loc, "the input or the weight is an undefined tensor");
  if (x.dim() == 4) {
    Tensor y = conv3d(unsqueeze(x, 0, loc), weight, bias, options, loc);
    CallSiteScope site(loc, composite::conv3d);
    return squeeze(y, 0, loc);
  }
  operand_type(op, x, weight, loc);
  if (x.dim() != 5) op_fail(op, loc, "input must be [N, C, D, H, W], got {}", to_string(x.shape()));
  if (weight.dim() != 5)
    op_fail(op, loc, "weight must be [out_channels, in_channels / groups, KD, KH, KW], got {}",
            to_string(weight.shape()));
  const int64_t stride[3] = {options.stride.d, options.stride.h, options.stride.w};
  const int64_t dil[3] = {options.dilation.d, options.dilation.h, options.dilation.w};
  const int64_t padding[3] = {options.padding.d, options.padding.h, options.padding.w};
  const int64_t groups = options.groups;
  const auto text = [&] {
    return fmt::format(
        "stride ({}, {}, {}), padding ({}, {}, {}), dilation ({}, {}, {}), groups {}", stride[0],
        stride[1], stride[2], padding[0], padding[1], padding[2], dil[0], dil[1], dil[2], groups);
  };
  check_window3(op, stride, dil, padding, text, loc);
  if (groups < 1 || groups > kMaxWindow)
    op_fail(op, loc, "groups must be positive and at most 2^31: {}", text());
  const Shape& xs = x.shape();
  const Shape& ws = weight.shape();
  if (xs[1] % groups != 0 || ws[0] % groups != 0)
    op_fail(op, loc, "groups {} must divide the input's {} and the output's {} channels", groups,
            xs[1], ws[0]);
  if (ws[1] * groups != xs[1])
    op_fail(op, loc, "weight {} expects {} input channels ({} per group of {}), input {} has {}",
            to_string(ws), ws[1] * groups, ws[1], groups, to_string(xs), xs[1]);
  // PyTorch's padding per axis: 'same' pads dilation (k - 1), the odd one after.
  int64_t before[3], after[3], extent[3];
  for (int a = 0; a < 3; ++a) {
    if (ws[2 + a] < 1) op_fail(op, loc, "kernel {} has an empty spatial dimension", to_string(ws));
    extent[a] = dilated_extent(op, dil[a], ws[2 + a], loc);
    before[a] = after[a] = options.padding.same ? 0 : padding[a];
    if (!options.padding.same) continue;
    if (stride[a] != 1) op_fail(op, loc, "padding 'same' needs stride 1, got {}", text());
    before[a] = (extent[a] - 1) / 2;
    after[a] = extent[a] - 1 - before[a];
  }
  for (int a = 0; a < 3; ++a)
    if (xs[2 + a] + before[a] + after[a] < extent[a])
      op_fail(op, loc, "kernel {} (dilated {}) is larger than the padded input {} padded by {}",
              to_string(ws), extent[a], to_string(xs), text());
  // A padding mode other than zeros pads in x's type before the convolution, as PyTorch's
  // modules do; zeros pad inside it.
  Tensor input = x;
  if (options.padding_mode != PadMode::Constant) {
    input = pad(x, {before[2], after[2], before[1], after[1], before[0], after[0]},
                options.padding_mode, 0.0, loc);
    std::fill(std::begin(before), std::end(before), 0);
    std::fill(std::begin(after), std::end(after), 0);
  }
  CallSiteScope site(loc, composite::conv3d);
  // The depth padding, and 'same''s odd row and column: the 2-d window pads the rest.
  if (before[0] || after[0] || after[1] != before[1] || after[2] != before[2])
    input = pad(input, {0, after[2] - before[2], 0, after[1] - before[1], before[0], after[0]},
                PadMode::Constant, 0.0, loc);
  const int64_t o = ws[0], kd = ws[2];
  const int64_t od = (input.size(2) - extent[0]) / stride[0] + 1;
  const Tensor columns = depth_taps(op, input, kd, dil[0], stride[0], od, loc);
  ConvWindow window;
  for (int a = 1; a < 3; ++a) {
    window.stride[a - 1] = stride[a];
    window.pad[a - 1] = before[a];
    window.dil[a - 1] = dil[a];
  }
  window.groups = groups;
  const Tensor y2 =
      forward(op, columns, reshape(weight, {o, ws[1] * kd, ws[3], ws[4]}, loc), window, loc);
  return add_bias(op, volume_of(y2, xs[0], od, loc), bias, loc);
}

Tensor conv_transpose1d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const ConvTranspose1dOptions& options, const Loc& loc) {
  const char* op = "conv_transpose1d";
  if (!x.defined() || !weight.defined())
    op_fail(op, loc, "the input or the weight is an undefined tensor");
  if (x.dim() == 2) {
    Tensor y = conv_transpose1d(unsqueeze(x, 0, loc), weight, bias, options, loc);
    CallSiteScope site(loc, composite::conv_transpose1d);
    return squeeze(y, 0, loc);
  }
  if (x.dim() != 3) op_fail(op, loc, "input must be [N, C, L], got {}", to_string(x.shape()));
  if (weight.dim() != 3 || weight.size(0) != x.size(1))
    op_fail(op, loc, "weight {} must be [in_channels {}, out_channels / groups, K]",
            to_string(weight.shape()), x.size(1));
  const ConvTranspose1dOptions& o = options;
  if (o.output_padding < 0 || o.output_padding >= std::max(o.stride, o.dilation))
    op_fail(op, loc, "output_padding {} must be smaller than the stride {} or the dilation {}",
            o.output_padding, o.stride, o.dilation);
  CallSiteScope site(loc, composite::conv_transpose1d);
  const Tensor y = conv_transpose2d(unsqueeze(x, 2, loc), unsqueeze(weight, 2, loc), bias,
                                    {.stride = {1, o.stride},
                                     .padding = {0, o.padding},
                                     .output_padding = {0, o.output_padding},
                                     .groups = o.groups,
                                     .dilation = {1, o.dilation}},
                                    loc);
  return squeeze(y, 2, loc);
}

Tensor conv_transpose3d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const ConvTranspose3dOptions& options, const Loc& loc) {
  const char* op = "conv_transpose3d";
  if (!x.defined() || !weight.defined())
    op_fail(op, loc, "the input or the weight is an undefined tensor");
  if (x.dim() == 4) {
    Tensor y = conv_transpose3d(unsqueeze(x, 0, loc), weight, bias, options, loc);
    CallSiteScope site(loc, composite::conv_transpose3d);
    return squeeze(y, 0, loc);
  }
  operand_type(op, x, weight, loc);
  if (x.dim() != 5) op_fail(op, loc, "input must be [N, C, D, H, W], got {}", to_string(x.shape()));
  const Shape& xs = x.shape();
  const Shape& ws = weight.shape();
  if (weight.dim() != 5 || ws[0] != xs[1])
    op_fail(op, loc, "weight {} must be [in_channels {}, out_channels / groups, KD, KH, KW]",
            to_string(ws), xs[1]);
  const int64_t stride[3] = {options.stride.d, options.stride.h, options.stride.w};
  const int64_t dil[3] = {options.dilation.d, options.dilation.h, options.dilation.w};
  const int64_t padding[3] = {options.padding.d, options.padding.h, options.padding.w};
  const int64_t extra[3] = {options.output_padding.d, options.output_padding.h,
                            options.output_padding.w};
  const int64_t groups = options.groups;
  const auto text = [&] {
    return fmt::format(
        "stride ({}, {}, {}), padding ({}, {}, {}), output_padding ({}, {}, {}), dilation ({}, {}, "
        "{}), groups {}",
        stride[0], stride[1], stride[2], padding[0], padding[1], padding[2], extra[0], extra[1],
        extra[2], dil[0], dil[1], dil[2], groups);
  };
  check_window3(op, stride, dil, padding, text, loc);
  for (int a = 0; a < 3; ++a) {
    if (extra[a] < 0 || extra[a] >= std::max(stride[a], dil[a]))
      op_fail(op, loc, "output_padding must be smaller than the stride or the dilation: {}",
              text());
  }
  if (groups < 1 || groups > kMaxWindow || xs[1] % groups != 0)
    op_fail(op, loc, "groups must be positive and divide the input's {} channels: {}", xs[1],
            text());
  int64_t extent[3], out[3];
  for (int a = 0; a < 3; ++a) {
    if (xs[2 + a] < 1 || ws[2 + a] < 1)
      op_fail(op, loc, "input {} or weight {} has an empty spatial dimension", to_string(xs),
              to_string(ws));
    extent[a] = dilated_extent(op, dil[a], ws[2 + a], loc);
    const __int128 size =
        static_cast<__int128>(xs[2 + a] - 1) * stride[a] - 2 * padding[a] + extent[a] + extra[a];
    if (size > (__int128{1} << 60) || size < 1)
      op_fail(op, loc, "the output would have {} rows on an axis: input {}, weight {}, {}",
              size < 1 ? "no" : "more than 2^60", to_string(xs), to_string(ws), text());
    out[a] = static_cast<int64_t>(size);
  }
  const __int128 channels = static_cast<__int128>(ws[1]) * groups;
  if (channels > (__int128{1} << 60))
    op_fail(op, loc, "{} groups of {} output channels are more than 2^60", groups, ws[1]);
  CallSiteScope site(loc, composite::conv_transpose3d);
  // Along the depth, the transposed convolution is a direct one: x's depths spread a stride apart
  // (zeros between), padded by dilation (KD - 1) - padding each side (output_padding more after),
  // read by the kernel reversed. Its taps gathered into channels as conv3d gathers them, height
  // and width are conv_transpose2d's: one 2-d convolution, each output one f32 sum.
  const int64_t n = xs[0], c = xs[1], kd = ws[2], h = xs[3], w = xs[4];
  Tensor spread = x;
  if (stride[0] > 1) {
    check_intermediate(op, "the input's depths spread a stride apart",
                       {n, c, xs[2], stride[0], h, w}, x.dtype(), loc);
    spread = pad(unsqueeze(x, 3, loc), {0, 0, 0, 0, 0, stride[0] - 1}, PadMode::Constant, 0.0, loc);
    spread = reshape(spread, {n, c, xs[2] * stride[0], h, w}, loc);
  }
  const int64_t margin = dil[0] * (kd - 1) - padding[0];
  const int64_t trailing = stride[0] > 1 ? -(stride[0] - 1) : 0;
  if (margin != 0 || trailing + margin + extra[0] != 0)
    spread = pad(spread, {0, 0, 0, 0, margin, trailing + margin + extra[0]}, PadMode::Constant, 0.0,
                 loc);
  const Tensor columns = depth_taps(op, spread, kd, dil[0], 1, out[0], loc);
  // [Cin, Cout / groups, KD, KH, KW] -> [Cin KD, Cout / groups, KH, KW], the depth reversed.
  const Tensor kernels = reshape(permute(flip(weight, {2}, loc), {0, 2, 1, 3, 4}, loc),
                                 {c * kd, ws[1], ws[3], ws[4]}, loc);
  const Tensor y2 = conv_transpose2d(columns, kernels, Tensor(),
                                     {.stride = {stride[1], stride[2]},
                                      .padding = {padding[1], padding[2]},
                                      .output_padding = {extra[1], extra[2]},
                                      .groups = groups,
                                      .dilation = {dil[1], dil[2]}},
                                     loc);
  return add_bias(op, volume_of(y2, n, out[0], loc), bias, loc);
}

Tensor conv_transpose2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const ConvTranspose2dOptions& options, const Loc& loc) {
  CallSiteScope site(loc, composite::conv_transpose2d);
  const char* op = "conv_transpose2d";
  if (!x.defined() || !weight.defined())
    op_fail(op, loc, "the input or the weight is an undefined tensor");
  if (x.dim() == 3)
    return squeeze(conv_transpose2d(unsqueeze(x, 0, loc), weight, bias, options, loc), 0, loc);
  if (x.dim() != 4) op_fail(op, loc, "input must be [N, C, H, W], got {}", to_string(x.shape()));
  if (x.size(2) < 1 || x.size(3) < 1)
    op_fail(op, loc, "input {} has an empty spatial dimension", to_string(x.shape()));
  if (weight.dim() != 4 || weight.size(0) != x.size(1))
    op_fail(op, loc, "weight {} must be [in_channels {}, out_channels / groups, KH, KW]",
            to_string(weight.shape()), x.size(1));
  const ConvWindow window = ConvWindow::of(options);
  check_window(op, window, loc);
  if (x.size(1) % options.groups != 0)
    op_fail(op, loc, "groups {} must divide the input's {} channels", options.groups, x.size(1));
  const int64_t output_padding[2] = {options.output_padding.h, options.output_padding.w};
  const __int128 channels = static_cast<__int128>(weight.size(1)) * options.groups;
  if (channels > (__int128{1} << 60))
    op_fail(op, loc, "{} groups of {} output channels are more than 2^60", options.groups,
            weight.size(1));
  Shape out{x.size(0), static_cast<int64_t>(channels), 0, 0};
  // PyTorch takes fewer extra rows than a stride or than a dilation step. The output must be an
  // input size of the convolution this one is the gradient of, which holds below a stride; a
  // padding of a stride or more is the same as appending padding / stride rows of zeros to x
  // (they add nothing), and keeping the remainder.
  int64_t zero_rows[2] = {0, 0};
  for (int d = 0; d < 2; ++d) {
    if (output_padding[d] < 0 || output_padding[d] >= std::max(window.stride[d], window.dil[d]))
      op_fail(op, loc,
              "output_padding ({}, {}) must be smaller than the stride ({}, {}) or the "
              "dilation ({}, {})",
              output_padding[0], output_padding[1], window.stride[0], window.stride[1],
              window.dil[0], window.dil[1]);
    zero_rows[d] = output_padding[d] / window.stride[d];
    if (weight.size(2 + d) < 1)
      op_fail(op, loc, "weight {} has an empty spatial dimension", to_string(weight.shape()));
    const __int128 size =
        static_cast<__int128>(x.size(2 + d) - 1) * window.stride[d] - 2 * window.pad[d] +
        dilated_extent(op, window.dil[d], weight.size(2 + d), loc) + output_padding[d];
    if (size > (__int128{1} << 60))
      op_fail(op, loc, "the output would have more than 2^60 rows: input {}, weight {}, {}",
              to_string(x.shape()), to_string(weight.shape()), window_text(window));
    out[2 + d] = static_cast<int64_t>(size);
    if (out[2 + d] < 1)
      op_fail(op, loc, "the output would be empty: input {}, weight {}, {}", to_string(x.shape()),
              to_string(weight.shape()), window_text(window));
  }
  const Tensor rows = zero_rows[0] || zero_rows[1]
                          ? pad(x, {0, zero_rows[1], 0, zero_rows[0]}, PadMode::Constant, 0.0, loc)
                          : x;
  return add_bias(op, conv2d_input_grad(rows, weight, out, window, loc), bias, loc);
}

}  // namespace mixtape
