// mixtape/dsl/vision.cpp -- max pooling over its two primitives (MaxPool2d, MaxPool2dGrad); avg
// pooling, batch/group/instance norm and dropout2d as composites over strided slices, pointwise
// ops and reductions, so that they fuse into the kernels around them and get gradients and
// precision from the primitives. (Interpolation is in resample.cpp.)
#include "mixtape/dsl/vision.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/constant_cache.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/operand_checks.h"
#include "mixtape/dsl/wide_sums.h"

namespace mixtape {
namespace {

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// The largest pooling window size, stride, dilation and padding (conv2d's bound).
constexpr int64_t kMaxWindow = int64_t{1} << 31;
// Bounds on what ops make per kernel row or window on the host: graph nodes (avg_pool2d's views
// per kernel row and column, adaptive_avg_pool2d's means per window where windows differ).
constexpr int64_t kMaxNodesPerAxis = int64_t{1} << 16;
constexpr int64_t kMaxWindowsPerAxis = int64_t{1} << 20;

// One spatial axis of a pooling window: sizes as given and the output size they make.
struct PoolAxis {
  int64_t in, kernel, stride, pad, dilation, out;
  // The padded extent the windows read: left pad, then the input, then `right` more (negative
  // where the last windows end before the input does).
  int64_t right() const { return (out - 1) * stride + dilation * (kernel - 1) + 1 - in - pad; }
  // Every size, for the key of a table made from them.
  std::string key() const {
    return fmt::format("{},{},{},{},{},{}", in, kernel, stride, pad, dilation, out);
  }
};

// PyTorch's pooling_output_shape, with its checks reported as `op`'s.
PoolAxis pool_axis(const char* op, const Loc& loc, const Shape& shape, const char* axis, int64_t in,
                   int64_t kernel, int64_t stride, int64_t pad, int64_t dilation, bool ceil_mode,
                   bool half_dilated_kernel) {
  if (kernel <= 0 || stride <= 0 || dilation <= 0)
    op_fail(op, loc, "kernel {}, stride {} and dilation {} of the {} axis must be positive", kernel,
            stride, dilation, axis);
  if (pad < 0) op_fail(op, loc, "padding {} of the {} axis is negative", pad, axis);
  // As conv2d's windows: sizes past 2^31 would overflow the products below.
  if (std::max({kernel, stride, dilation, pad}) > kMaxWindow)
    op_fail(op, loc, "kernel {}, stride {}, dilation {} or padding {} of the {} axis is above 2^31",
            kernel, stride, dilation, pad, axis);
  const int64_t effective = half_dilated_kernel ? (kernel - 1) * dilation + 1 : kernel;
  if (pad > effective / 2)
    op_fail(op, loc, "padding {} of the {} axis is more than half the kernel {}", pad, axis,
            effective);
  const int64_t span = in + 2 * pad - dilation * (kernel - 1) - 1;
  int64_t out = floor_div(span + (ceil_mode ? stride - 1 : 0), stride) + 1;
  // A last window that would start in the right padding is dropped.
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  // With ceil_mode a window may reach past the padded input (PyTorch takes it): only no window
  // at all is refused.
  if (out < 1)
    op_fail(op, loc,
            "the kernel {} (dilation {}) is larger than the {} axis of input {} padded "
            "by {}",
            kernel, dilation, axis, to_string(shape), pad);
  return {in, kernel, stride, pad, dilation, out};
}

struct Pool {
  PoolAxis h, w;
};

// The NCHW input's window geometry; a CHW input is checked as such.
Pool pool_geometry(const char* op, const Loc& loc, const Tensor& x, Size2 kernel,
                   std::optional<Size2> stride, Size2 padding, Size2 dilation, bool ceil_mode,
                   bool half_dilated_kernel) {
  require_float(x, op, "input", loc);
  if (x.dim() != 3 && x.dim() != 4)
    op_fail(op, loc, "needs an NCHW or CHW input, got {}", to_string(x.shape()));
  Size2 s = stride.value_or(kernel);
  return {pool_axis(op, loc, x.shape(), "height", x.size(-2), kernel.h, s.h, padding.h, dilation.h,
                    ceil_mode, half_dilated_kernel),
          pool_axis(op, loc, x.shape(), "width", x.size(-1), kernel.w, s.w, padding.w, dilation.w,
                    ceil_mode, half_dilated_kernel)};
}

// x padded with `value` to the extent the windows read (cropped where they read less).
Tensor pad_for_windows(const Tensor& x, const Pool& p, double value) {
  if (p.h.pad == 0 && p.w.pad == 0 && p.h.right() == 0 && p.w.right() == 0) return x;
  return pad(x, {p.w.pad, p.w.right(), p.h.pad, p.h.right()}, PadMode::Constant, value);
}

// The (i, j)-th element of every window of the padded input: a strided view [..., oh, ow].
struct WindowElement {
  std::vector<int64_t> starts, steps;
  Shape shape;
};
WindowElement window_element(const Tensor& padded, const Pool& p, int64_t i, int64_t j) {
  const auto lead = static_cast<size_t>(padded.dim() - 2);
  WindowElement e{std::vector<int64_t>(lead, 0), std::vector<int64_t>(lead, 1),
                  Shape(padded.shape().begin(), padded.shape().end() - 2)};
  e.starts.insert(e.starts.end(), {i * p.h.dilation, j * p.w.dilation});
  e.steps.insert(e.steps.end(), {p.h.stride, p.w.stride});
  e.shape.insert(e.shape.end(), {p.h.out, p.w.out});
  return e;
}
Tensor window_slice(const Tensor& padded, const WindowElement& e) {
  return slice(padded, e.starts, e.steps, e.shape);
}

// t[..., start : start + step * count : step, ...] along `axis`, the other axes whole.
Tensor strided_axis(const Tensor& t, int64_t axis, int64_t start, int64_t step, int64_t count) {
  const auto at = static_cast<size_t>(axis);
  WindowElement e{std::vector<int64_t>(static_cast<size_t>(t.dim()), 0),
                  std::vector<int64_t>(static_cast<size_t>(t.dim()), 1), t.shape()};
  e.starts[at] = start;
  e.steps[at] = step;
  e.shape[at] = count;
  return window_slice(t, e);
}

// The window of one of max_pool2d's geometries.
PoolWindow window_of(const Pool& p) {
  PoolWindow w;
  const PoolAxis* axes[2] = {&p.h, &p.w};
  for (int d = 0; d < 2; ++d) {
    w.kernel[d] = axes[d]->kernel;
    w.stride[d] = axes[d]->stride;
    w.pad[d] = axes[d]->pad;
    w.dil[d] = axes[d]->dilation;
  }
  return w;
}

// The geometry of `window` over x's spatial axes with `output`'s sizes, checked as the builders
// check one: `output` must be what floor or ceil mode makes of the input.
Pool checked_pool(const char* op, const Loc& loc, const Shape& x, const PoolWindow& w,
                  Size2 output) {
  Pool p;
  PoolAxis* axes[2] = {&p.h, &p.w};
  const int64_t outs[2] = {output.h, output.w};
  const char* names[2] = {"height", "width"};
  for (int d = 0; d < 2; ++d) {
    const int64_t in = x[2 + static_cast<size_t>(d)];
    // ceil_mode's count (refused where no window fits at all), and floor mode's, which may be
    // none where ceil_mode's last window reaches past the padded input.
    PoolAxis ceil_axis = pool_axis(op, loc, x, names[d], in, w.kernel[d], w.stride[d], w.pad[d],
                                   w.dil[d], true, true);
    const int64_t floor_out =
        floor_div(in + 2 * w.pad[d] - w.dil[d] * (w.kernel[d] - 1) - 1, w.stride[d]) + 1;
    if (outs[d] != floor_out && outs[d] != ceil_axis.out)
      op_fail(op, loc, "an output {} of {} is not what the window makes of input {} ({} or {})",
              names[d], outs[d], to_string(x), floor_out, ceil_axis.out);
    *axes[d] = ceil_axis;
    axes[d]->out = outs[d];
  }
  return p;
}

void require_nchw(const char* op, const Loc& loc, const Tensor& t, const char* role) {
  require_float(t, op, role, loc);
  if (t.dim() != 4) op_fail(op, loc, "the {} must be NCHW, got {}", role, to_string(t.shape()));
}

// Each window's pick of x (the primitives' rule: the last NaN, else the first maximum) as a mask
// per window element, applied to g's (x's shape) elements: the sum over the window elements of
// g where that element is the window's pick. -inf padding is never the pick where the window
// has a finite value.
Tensor pick_windows(const Tensor& x, const Tensor& g, const Pool& p) {
  const double inf = std::numeric_limits<double>::infinity();
  Tensor padded = pad_for_windows(x, p, -inf), padded_g = pad_for_windows(g, p, 0.0);
  // Where the windows read padding, which a tap inside the input replaces also when equal (a
  // window of only -inf picks its first tap inside the input).
  const bool padding = p.h.pad > 0 || p.w.pad > 0 || p.h.right() > 0 || p.w.right() > 0;
  const Tensor inside_input =
      padding ? pad_for_windows(full(x.shape(), 1.0, boolean), p, 0.0) : Tensor();
  Tensor y, taken_value, taken_inside;  // the maximum so far, g at its pick, the pick inside
  for (int64_t i = 0; i < p.h.kernel; ++i)
    for (int64_t j = 0; j < p.w.kernel; ++j) {
      WindowElement e = window_element(padded, p, i, j);
      Tensor element = window_slice(padded, e), value = window_slice(padded_g, e);
      Tensor inside = padding ? window_slice(inside_input, e) : Tensor();
      if (!y.defined()) {
        y = element;
        taken_value = value;
        taken_inside = inside;
        continue;
      }
      Tensor take = logical_or(element > y, isnan(element));
      if (padding) {
        take = logical_or(take, logical_and(inside, logical_not(taken_inside)));
        taken_inside = logical_or(taken_inside, inside);
      }
      y = where(take, element, y);
      taken_value = where(take, value, taken_value);
    }
  return taken_value;
}

}  // namespace

Ints PoolWindow::attr() const {
  return {kernel[0], kernel[1], stride[0], stride[1], pad[0], pad[1], dil[0], dil[1]};
}

PoolWindow PoolWindow::from(const Ints& attr) {
  if (attr.size() != 8) fail("a pooling window has 8 entries, got {}", attr.size());
  PoolWindow w;
  for (int d = 0; d < 2; ++d) {
    w.kernel[d] = attr[static_cast<size_t>(d)];
    w.stride[d] = attr[static_cast<size_t>(2 + d)];
    w.pad[d] = attr[static_cast<size_t>(4 + d)];
    w.dil[d] = attr[static_cast<size_t>(6 + d)];
    // A window read back from an artifact's plan is checked as the builders check one.
    if (w.kernel[d] < 1 || w.stride[d] < 1 || w.dil[d] < 1 || w.pad[d] < 0)
      fail("a pooling window has a kernel, stride, dilation or padding out of range");
  }
  return w;
}

PoolGeometry PoolGeometry::of(const Node& node) {
  const Shape& x = node.inputs[0]->shape;
  const Shape& y = node.op == OpCode::MaxPool2dGrad ? node.inputs[1]->shape : node.shape;
  return {x[0], x[1], x[2], x[3], y[2], y[3], PoolWindow::from(node.attrs.window)};
}

Tensor max_pool2d_forward(const Tensor& x, const PoolWindow& window, Size2 output, const Loc& loc) {
  const char* op = op_name(OpCode::MaxPool2d);
  require_nchw(op, loc, x, "input");
  checked_pool(op, loc, x.shape(), window, output);
  Attrs attrs;
  attrs.window = window.attr();
  return Tensor(make_node(OpCode::MaxPool2d, x.dtype(), {x.size(0), x.size(1), output.h, output.w},
                          {x.node()}, std::move(attrs), loc));
}

Tensor max_pool2d_grad(const Tensor& x, const Tensor& grad_out, const PoolWindow& window,
                       const Loc& loc) {
  const char* op = op_name(OpCode::MaxPool2dGrad);
  require_nchw(op, loc, x, "input");
  require_nchw(op, loc, grad_out, "output gradient");
  if (grad_out.size(0) != x.size(0) || grad_out.size(1) != x.size(1))
    op_fail(op, loc, "the output gradient {} and the input {} differ in N or C",
            to_string(grad_out.shape()), to_string(x.shape()));
  checked_pool(op, loc, x.shape(), window, {grad_out.size(2), grad_out.size(3)});
  const DType t = promote(x.dtype(), grad_out.dtype());
  Attrs attrs;
  attrs.window = window.attr();
  NodeInputs inputs;
  inputs.emplace_back(cast(x, t, loc).node());
  inputs.emplace_back(cast(grad_out, t, loc).node());
  return Tensor(
      make_node(OpCode::MaxPool2dGrad, t, x.shape(), std::move(inputs), std::move(attrs), loc));
}

namespace detail {
Tensor max_pool2d_pick(const Tensor& x, const Tensor& g, const PoolWindow& window, Size2 output) {
  const Pool p = checked_pool("max_pool2d_grad", Loc::current(), x.shape(), window, output);
  return pick_windows(x, g, p);
}
}  // namespace detail

namespace {

// Runs an NCHW op on a CHW input as a batch of one.
template <typename F>
Tensor batched(const Tensor& x, F&& f) {
  if (x.dim() == 4) return f(x);
  return squeeze(f(unsqueeze(x, 0)), 0);
}

}  // namespace

Tensor max_pool2d(const Tensor& x, Size2 kernel, std::optional<Size2> stride, Size2 padding,
                  Size2 dilation, bool ceil_mode, const Loc& loc) {
  CallSiteScope site(loc, composite::max_pool2d);
  const Pool p =
      pool_geometry("max_pool2d", loc, x, kernel, stride, padding, dilation, ceil_mode, true);
  return batched(x, [&](const Tensor& nchw) {
    return max_pool2d_forward(nchw, window_of(p), {p.h.out, p.w.out}, loc);
  });
}

ValuesIndices max_pool2d_with_indices(const Tensor& x, Size2 kernel, std::optional<Size2> stride,
                                      Size2 padding, Size2 dilation, bool ceil_mode,
                                      const Loc& loc) {
  CallSiteScope site(loc, composite::max_pool2d);
  const Pool p =
      pool_geometry("max_pool2d", loc, x, kernel, stride, padding, dilation, ceil_mode, true);
  const Tensor nchw = x.dim() == 4 ? x : unsqueeze(x, 0);
  const Tensor values = max_pool2d_forward(nchw, window_of(p), {p.h.out, p.w.out}, loc);
  // Each element's index in its plane, picked as the primitive picks.
  const int64_t h = nchw.size(2), w = nchw.size(3);
  const Tensor plane = cached_constant(fmt::format("max_pool2d plane {} {}", h, w), [&] {
    std::vector<int64_t> index(static_cast<size_t>(h * w));
    std::iota(index.begin(), index.end(), int64_t{0});
    return tensor(index, {h, w});
  });
  const Tensor indices = pick_windows(nchw, broadcast_to(plane, nchw.shape()), p);
  if (x.dim() == 4) return {values, indices};
  return {squeeze(values, 0), squeeze(indices, 0)};
}

namespace {

// max_unpool1d/2d/3d over x's last kernel.size() axes (1 to 3), the sizes per axis.
Tensor max_unpool(const char* op, const Tensor& x, const Tensor& indices,
                  const std::vector<int64_t>& kernel, const std::vector<int64_t>& stride,
                  const std::vector<int64_t>& padding,
                  const std::optional<std::vector<int64_t>>& output_size, const Loc& loc) {
  const auto spatial = static_cast<int64_t>(kernel.size());
  const char* layouts[3] = {"NCL or CL", "NCHW or CHW", "NCDHW or CDHW"};
  const char* axis_names[3][3] = {{"length"}, {"height", "width"}, {"depth", "height", "width"}};
  require_float(x, op, "input", loc);
  require(indices, op, "indices", loc);
  if (x.dim() != spatial + 1 && x.dim() != spatial + 2)
    op_fail(op, loc, "needs an {} input, got {}", layouts[spatial - 1], to_string(x.shape()));
  if (indices.dtype() != i64 || indices.shape() != x.shape())
    op_fail(op, loc, "indices must be i64 of the input's shape {}, got {} {}", to_string(x.shape()),
            name(indices.dtype()), to_string(indices.shape()));
  if (output_size && static_cast<int64_t>(output_size->size()) != spatial)
    op_fail(op, loc, "output_size must have {} sizes, got {}", spatial, output_size->size());
  const auto sizes_text = [&] {
    return fmt::format("kernel ({}), stride ({}) and padding ({})", fmt::join(kernel, ", "),
                       fmt::join(stride, ", "), fmt::join(padding, ", "));
  };
  std::vector<int64_t> size(kernel.size());
  for (size_t d = 0; d < kernel.size(); ++d) {
    const int64_t k = kernel[d], step = stride[d], pad = padding[d];
    const int64_t in = x.size(x.dim() - spatial + static_cast<int64_t>(d));
    const char* axis = axis_names[spatial - 1][d];
    if (k <= 0 || step <= 0 || pad < 0 || std::max({k, step, pad}) > kMaxWindow)
      op_fail(op, loc, "{} must be in range", sizes_text());
    // PyTorch's default size: the input max pooling made x from, without ceil_mode's extra; a
    // size given must be one the pooling with this stride could have made x from, as its
    // check. In 128 bits: an input of up to 2^60 rows times a stride of up to 2^31.
    const __int128 wide = static_cast<__int128>(in - 1) * step - 2 * pad + k;
    if (wide > (int64_t{1} << 60)) op_fail(op, loc, "the output's {} would be above 2^60", axis);
    const auto natural = static_cast<int64_t>(wide);
    size[d] = output_size ? (*output_size)[d] : natural;
    if (output_size && !(natural - step < size[d] && size[d] < natural + step))
      op_fail(op, loc, "the output's {} {} must be between {} and {} (exclusive)", axis, size[d],
              natural - step, natural + step);
    if (size[d] <= 0 || size[d] > (int64_t{1} << 31))
      op_fail(op, loc, "the output's {} {} must be positive and at most 2^31", axis, size[d]);
  }
  // Each value written at its index of a zero plane (of repeated indices the last is kept);
  // an index outside the plane is an mt::Error when it is evaluated.
  Shape planes(x.shape().begin(), x.shape().end() - spatial);
  Shape flat = planes, out_flat = planes;
  int64_t in_plane = 1, out_plane = 1;
  for (size_t d = 0; d < kernel.size(); ++d) {
    in_plane *= x.size(x.dim() - spatial + static_cast<int64_t>(d));
    out_plane *= size[d];
  }
  if (out_plane > (int64_t{1} << 60))
    op_fail(op, loc, "the output plane would hold more than 2^60 elements");
  flat.push_back(in_plane);
  out_flat.push_back(out_plane);
  const int64_t axis = static_cast<int64_t>(planes.size());
  Tensor y = scatter(zeros(out_flat, x.dtype()), axis, reshape(indices, flat), reshape(x, flat));
  planes.insert(planes.end(), size.begin(), size.end());
  return reshape(y, planes);
}

}  // namespace

Tensor max_unpool1d(const Tensor& x, const Tensor& indices, int64_t kernel,
                    std::optional<int64_t> stride, int64_t padding,
                    std::optional<int64_t> output_size, const Loc& loc) {
  CallSiteScope site(loc);
  std::optional<std::vector<int64_t>> size;
  if (output_size) size = std::vector<int64_t>{*output_size};
  return max_unpool("max_unpool1d", x, indices, {kernel}, {stride.value_or(kernel)}, {padding},
                    size, loc);
}

Tensor max_unpool2d(const Tensor& x, const Tensor& indices, Size2 kernel,
                    std::optional<Size2> stride, Size2 padding, std::optional<Size2> output_size,
                    const Loc& loc) {
  CallSiteScope site(loc);
  const Size2 s = stride.value_or(kernel);
  std::optional<std::vector<int64_t>> size;
  if (output_size) size = std::vector<int64_t>{output_size->h, output_size->w};
  return max_unpool("max_unpool2d", x, indices, {kernel.h, kernel.w}, {s.h, s.w},
                    {padding.h, padding.w}, size, loc);
}

Tensor max_unpool3d(const Tensor& x, const Tensor& indices, Size3 kernel,
                    std::optional<Size3> stride, Size3 padding, std::optional<Size3> output_size,
                    const Loc& loc) {
  CallSiteScope site(loc);
  const Size3 s = stride.value_or(kernel);
  std::optional<std::vector<int64_t>> size;
  if (output_size) size = std::vector<int64_t>{output_size->d, output_size->h, output_size->w};
  return max_unpool("max_unpool3d", x, indices, {kernel.d, kernel.h, kernel.w}, {s.d, s.h, s.w},
                    {padding.d, padding.h, padding.w}, size, loc);
}

Tensor avg_pool2d(const Tensor& x, Size2 kernel, std::optional<Size2> stride, Size2 padding,
                  bool ceil_mode, bool count_include_pad, const Loc& loc) {
  CallSiteScope site(loc, composite::avg_pool2d);
  const Pool p = pool_geometry("avg_pool2d", loc, x, kernel, stride, padding, 1, ceil_mode, false);
  if (std::max(p.h.kernel, p.w.kernel) > kMaxNodesPerAxis)
    op_fail("avg_pool2d", loc,
            "kernel {}x{} is above 2^16 on an axis (it adds a view per kernel row and column); "
            "adaptive_avg_pool2d or mean take any window",
            p.h.kernel, p.w.kernel);
  // Summed in f32, as PyTorch's kernels accumulate (k*k adds rounded to bf16 each lost several
  // ulps), and given back in the type x is stored in (dsl/wide_sums.h).
  Tensor padded = widened(pad_for_windows(x, p, 0.0), loc);
  // Separably: the kernel's rows first (a view per row, every column kept), then its columns
  // of their sum, kh + kw views rather than kh * kw (a global pool over 300 x 300 made 90000).
  auto sum_views = [&](const Tensor& t, int64_t axis, const PoolAxis& a) {
    Tensor sum;
    for (int64_t k = 0; k < a.kernel; ++k) {
      Tensor view = strided_axis(t, axis, k * a.dilation, a.stride, a.out);
      sum = sum.defined() ? sum + view : view;
    }
    return sum;
  };
  Tensor total = sum_views(sum_views(padded, padded.dim() - 2, p.h), padded.dim() - 1, p.w);
  // PyTorch's divisor per window: the part inside the padded input (ceil_mode windows can reach
  // past it), or only the part inside the input without count_include_pad.
  auto covered = [count_include_pad](const PoolAxis& a, int64_t o) {
    int64_t start = o * a.stride - a.pad;
    int64_t end = std::min(start + a.kernel, a.in + a.pad);
    if (!count_include_pad) return std::min(end, a.in) - std::max<int64_t>(start, 0);
    return end - start;
  };
  std::vector<double> divisors;
  divisors.reserve(static_cast<size_t>(p.h.out * p.w.out));
  for (int64_t oh = 0; oh < p.h.out; ++oh)
    for (int64_t ow = 0; ow < p.w.out; ++ow)
      divisors.push_back(static_cast<double>(covered(p.h, oh) * covered(p.w, ow)));
  const std::string key = fmt::format("avg_pool2d divisors {} {} {} {}", p.h.key(), p.w.key(),
                                      count_include_pad, name(total.dtype()));
  Tensor mean =
      std::all_of(divisors.begin(), divisors.end(), [&](double d) { return d == divisors[0]; })
          ? total / divisors[0]
          : total / cached_constant(key, [&] {
              return tensor(divisors, {p.h.out, p.w.out}, total.dtype());
            });
  return narrowed_like(mean, x, loc);
}

namespace {
// The mean over each output's window [floor(i in / out), ceil((i + 1) in / out)) of one axis.
Tensor adaptive_mean(const Tensor& x, int64_t axis, int64_t out) {
  const int64_t in = x.size(axis);
  if (in == out) return x;
  if (in % out == 0) {  // equal windows: one reduction
    Shape split = x.shape();
    split[static_cast<size_t>(axis)] = out;
    split.insert(split.begin() + axis + 1, in / out);
    return mean(reshape(x, split), {axis + 1});
  }
  std::vector<Tensor> parts;
  for (int64_t i = 0; i < out; ++i) {
    const int64_t start = i * in / out, end = ((i + 1) * in + out - 1) / out;
    parts.push_back(mean(slice(x, axis, start, end), {axis}, true));
  }
  return concat(parts, axis);
}
}  // namespace

namespace {

// adaptive pooling's checks of x (NCHW or CHW; NCL or CL, NCDHW or CDHW for one or three sizes)
// and the output size per spatial axis; `max_windows`: the windows go to the max-pooling
// primitive, whose windows are at most 2^31 long.
void check_adaptive(const char* op, const Loc& loc, const Tensor& x,
                    const std::vector<int64_t>& output_size, bool max_windows = false) {
  require_float(x, op, "input", loc);
  const auto spatial = static_cast<int64_t>(output_size.size());
  if (x.dim() != spatial + 1 && x.dim() != spatial + 2)
    op_fail(op, loc, "needs an {} input, got {}",
            spatial == 3 ? "NCDHW or CDHW" : (spatial == 2 ? "NCHW or CHW" : "NCL or CL"),
            to_string(x.shape()));
  const std::string sizes = fmt::format("({})", fmt::join(output_size, ", "));
  for (int64_t a = 0; a < spatial; ++a) {
    const int64_t in = x.size(a - spatial), out = output_size[static_cast<size_t>(a)];
    if (out <= 0) op_fail(op, loc, "output size {} must be positive", sizes);
    if (out > kMaxWindowsPerAxis && in % out != 0)
      op_fail(op, loc,
              "output size {} is above 2^20 on an axis whose windows differ (it makes a node per "
              "window)",
              sizes);
  }
  for (int64_t a = 0; a < spatial; ++a)
    if (x.size(a - spatial) == 0)
      op_fail(op, loc, "input {} has an empty spatial axis", to_string(x.shape()));
  if (!max_windows) return;
  const char* names[3][3] = {{"length"}, {"height", "width"}, {"depth", "height", "width"}};
  for (int64_t a = 0; a < spatial; ++a) {
    const int64_t in = x.size(a - spatial), out = output_size[static_cast<size_t>(a)];
    const int64_t widest = in % out == 0 ? in / out : in / out + 2;  // ceil(in / out) + 1 at most
    if (widest > kMaxWindow)
      op_fail(op, loc,
              "windows of up to {} elements along the {} axis of input {} are above 2^31, the "
              "bound of a max pooling window",
              widest, names[spatial - 1][a], to_string(x.shape()));
  }
}

// The maximum over each output's window of one axis (2 or 3) of NCHW x, as adaptive_mean's,
// through the MaxPool2d primitive: ties and NaN pick as PyTorch's.
Tensor adaptive_max(const Tensor& x, int64_t axis, int64_t out) {
  const int64_t in = x.size(axis);
  if (in == out) return x;
  auto pool = [&](const Tensor& t, int64_t kernel, int64_t count) {
    PoolWindow window;
    const auto d = static_cast<size_t>(axis - 2);
    window.kernel[d] = window.stride[d] = kernel;
    Size2 output(t.size(2), t.size(3));
    (d == 0 ? output.h : output.w) = count;
    return max_pool2d_forward(t, window, output);
  };
  if (in % out == 0) return pool(x, in / out, out);  // equal windows: one pooling
  std::vector<Tensor> parts;
  for (int64_t i = 0; i < out; ++i) {
    const int64_t start = i * in / out, end = ((i + 1) * in + out - 1) / out;
    parts.push_back(pool(slice(x, axis, start, end), end - start, 1));
  }
  return concat(parts, axis);
}

}  // namespace

Tensor adaptive_avg_pool2d(const Tensor& x, Size2 output_size, const Loc& loc) {
  CallSiteScope site(loc, composite::adaptive_avg_pool2d);
  check_adaptive("adaptive_avg_pool2d", loc, x, {output_size.h, output_size.w});
  return adaptive_mean(adaptive_mean(x, x.dim() - 2, output_size.h), x.dim() - 1, output_size.w);
}

Tensor adaptive_max_pool2d(const Tensor& x, Size2 output_size, const Loc& loc) {
  CallSiteScope site(loc, composite::adaptive_max_pool2d);
  check_adaptive("adaptive_max_pool2d", loc, x, {output_size.h, output_size.w}, true);
  // Along the width first: each window's pick is then the first maximum (the last NaN) in
  // row-major order, PyTorch's. In f32 for a 16-bit x, as the gradients of overlapping windows
  // add up in the passes' outputs.
  const Tensor y = batched(widened(x, loc), [&](const Tensor& nchw) {
    return adaptive_max(adaptive_max(nchw, 3, output_size.w), 2, output_size.h);
  });
  return narrowed_like(y, x, loc);
}

namespace {

// A 1-d pooling of x (NCL or CL) as `pool2d` of x over a height of one ([N, C, 1, L]).
template <typename Pool2d>
Tensor over_unit_height(const char* op, const Loc& loc, const Tensor& x, Pool2d&& pool2d) {
  require_float(x, op, "input", loc);
  if (x.dim() != 2 && x.dim() != 3)
    op_fail(op, loc, "needs an NCL or CL input, got {}", to_string(x.shape()));
  return squeeze(pool2d(unsqueeze(x, x.dim() - 1, loc)), x.dim() - 1, loc);
}

}  // namespace

Tensor max_pool1d(const Tensor& x, int64_t kernel, std::optional<int64_t> stride, int64_t padding,
                  int64_t dilation, bool ceil_mode, const Loc& loc) {
  CallSiteScope site(loc, composite::max_pool1d);
  const char* op = "max_pool1d";
  return over_unit_height(op, loc, x, [&](const Tensor& t) {
    const int64_t s = stride.value_or(kernel);
    pool_axis(op, loc, x.shape(), "length", x.size(-1), kernel, s, padding, dilation, ceil_mode,
              true);
    return max_pool2d(t, {1, kernel}, Size2{1, s}, {0, padding}, {1, dilation}, ceil_mode, loc);
  });
}

ValuesIndices max_pool1d_with_indices(const Tensor& x, int64_t kernel,
                                      std::optional<int64_t> stride, int64_t padding,
                                      int64_t dilation, bool ceil_mode, const Loc& loc) {
  CallSiteScope site(loc, composite::max_pool1d);
  const char* op = "max_pool1d";
  ValuesIndices picked;
  over_unit_height(op, loc, x, [&](const Tensor& t) {
    const int64_t s = stride.value_or(kernel);
    pool_axis(op, loc, x.shape(), "length", x.size(-1), kernel, s, padding, dilation, ceil_mode,
              true);
    picked = max_pool2d_with_indices(t, {1, kernel}, Size2{1, s}, {0, padding}, {1, dilation},
                                     ceil_mode, loc);
    return picked.values;
  });
  // Flat indices h W + w of a height of one: the position along the line, PyTorch's.
  return {squeeze(picked.values, x.dim() - 1, loc), squeeze(picked.indices, x.dim() - 1, loc)};
}

Tensor avg_pool1d(const Tensor& x, int64_t kernel, std::optional<int64_t> stride, int64_t padding,
                  bool ceil_mode, bool count_include_pad, const Loc& loc) {
  CallSiteScope site(loc, composite::avg_pool1d);
  const char* op = "avg_pool1d";
  return over_unit_height(op, loc, x, [&](const Tensor& t) {
    const int64_t s = stride.value_or(kernel);
    pool_axis(op, loc, x.shape(), "length", x.size(-1), kernel, s, padding, 1, ceil_mode, false);
    if (kernel > kMaxNodesPerAxis)
      op_fail(op, loc, "kernel {} is above 2^16 (it adds a view per kernel element)", kernel);
    return avg_pool2d(t, {1, kernel}, Size2{1, s}, {0, padding}, ceil_mode, count_include_pad, loc);
  });
}

Tensor adaptive_avg_pool1d(const Tensor& x, int64_t output_size, const Loc& loc) {
  CallSiteScope site(loc, composite::adaptive_avg_pool1d);
  check_adaptive("adaptive_avg_pool1d", loc, x, {output_size});
  return over_unit_height("adaptive_avg_pool1d", loc, x, [&](const Tensor& t) {
    return adaptive_avg_pool2d(t, {1, output_size}, loc);
  });
}

Tensor adaptive_max_pool1d(const Tensor& x, int64_t output_size, const Loc& loc) {
  CallSiteScope site(loc, composite::adaptive_max_pool1d);
  check_adaptive("adaptive_max_pool1d", loc, x, {output_size}, true);
  return over_unit_height("adaptive_max_pool1d", loc, x, [&](const Tensor& t) {
    return adaptive_max_pool2d(t, {1, output_size}, loc);
  });
}

namespace {

// The three axes of a 3-d pooling of x (NCDHW or CDHW), each checked as the 2-d poolings' are.
struct Pool3 {
  PoolAxis d, h, w;
};
Pool3 pool3_geometry(const char* op, const Loc& loc, const Tensor& x, Size3 kernel,
                     std::optional<Size3> stride, Size3 padding, Size3 dilation, bool ceil_mode,
                     bool half_dilated_kernel) {
  require_float(x, op, "input", loc);
  if (x.dim() != 4 && x.dim() != 5)
    op_fail(op, loc, "needs an NCDHW or CDHW input, got {}", to_string(x.shape()));
  const Size3 s = stride.value_or(kernel);
  const auto axis = [&](const char* name, int64_t at, int64_t k, int64_t step, int64_t pad,
                        int64_t dil) {
    return pool_axis(op, loc, x.shape(), name, x.size(at), k, step, pad, dil, ceil_mode,
                     half_dilated_kernel);
  };
  return {axis("depth", -3, kernel.d, s.d, padding.d, dilation.d),
          axis("height", -2, kernel.h, s.h, padding.h, dilation.h),
          axis("width", -1, kernel.w, s.w, padding.w, dilation.w)};
}

// Whether an axis's windows overlap, so that its gradient adds several outputs' into one input.
bool overlapping(const PoolAxis& a) { return a.stride < a.dilation * (a.kernel - 1) + 1; }

// Whether max_pool3d pools a 16-bit input in f32: each pass's gradient is summed in f32 and
// rounded once; only where both passes add several outputs' gradients into one element would a
// 16-bit second pass round again.
bool max_pool3d_widens(const Pool3& p) {
  return overlapping(p.d) && (overlapping(p.h) || overlapping(p.w));
}

// A 3-d pooling of x (NCDHW, or CDHW as a batch of one), separably: `planes` pools each depth
// slice ([N, C D, H, W]) over height and width, `lines` then the depth axis of [N, C, D, OH OW]
// (as a 2-d pooling with one column per window).
template <typename Planes, typename Lines>
Tensor separable3d(const Tensor& x, Planes&& planes, Lines&& lines) {
  const Tensor v = x.dim() == 5 ? x : unsqueeze(x, 0);
  const int64_t n = v.size(0), c = v.size(1), d = v.size(2);
  const Tensor pooled = planes(reshape(v, {n, c * d, v.size(3), v.size(4)}));
  const int64_t oh = pooled.size(2), ow = pooled.size(3);
  const Tensor y = lines(reshape(pooled, {n, c, d, oh * ow}));
  const Tensor volume = reshape(y, {n, c, y.size(2), oh, ow});
  return x.dim() == 5 ? volume : squeeze(volume, 0);
}

// The 2-d window of a pooling's two axes `first` (height, or depth) and `second` (width, or a
// window of one over the columns).
PoolWindow window_of(const PoolAxis& first, const PoolAxis& second) {
  return window_of(Pool{first, second});
}
PoolAxis column_axis(int64_t in) { return {in, 1, 1, 0, 1, in}; }

}  // namespace

Tensor max_pool3d(const Tensor& x, Size3 kernel, std::optional<Size3> stride, Size3 padding,
                  Size3 dilation, bool ceil_mode, const Loc& loc) {
  CallSiteScope site(loc, composite::max_pool3d);
  const Pool3 p =
      pool3_geometry("max_pool3d", loc, x, kernel, stride, padding, dilation, ceil_mode, true);
  const bool wide = max_pool3d_widens(p);
  const Tensor y = separable3d(
      wide ? widened(x, loc) : x,
      [&](const Tensor& t) {
        return max_pool2d_forward(t, window_of(p.h, p.w), {p.h.out, p.w.out}, loc);
      },
      [&](const Tensor& t) {
        return max_pool2d_forward(t, window_of(p.d, column_axis(t.size(3))), {p.d.out, t.size(3)},
                                  loc);
      });
  return wide ? narrowed_like(y, x, loc) : y;
}

ValuesIndices max_pool3d_with_indices(const Tensor& x, Size3 kernel, std::optional<Size3> stride,
                                      Size3 padding, Size3 dilation, bool ceil_mode,
                                      const Loc& loc) {
  CallSiteScope site(loc, composite::max_pool3d);
  const Pool3 p =
      pool3_geometry("max_pool3d", loc, x, kernel, stride, padding, dilation, ceil_mode, true);
  // max_pool3d's two passes, with each pass's picks: each depth slice's (h W + w), made
  // (d H W + h W + w); then the depth window's pick (d (OH OW) + column) reads it.
  const bool wide = max_pool3d_widens(p);
  const Tensor input = wide ? widened(x, loc) : x;
  const Tensor v = x.dim() == 5 ? input : unsqueeze(input, 0, loc);
  const int64_t n = v.size(0), c = v.size(1), d = v.size(2), h = v.size(3), w = v.size(4);
  const ValuesIndices planes = max_pool2d_with_indices(
      reshape(v, {n, c * d, h, w}, loc), {p.h.kernel, p.w.kernel}, Size2{p.h.stride, p.w.stride},
      {p.h.pad, p.w.pad}, {p.h.dilation, p.w.dilation}, ceil_mode, loc);
  const int64_t columns = p.h.out * p.w.out;
  const Tensor depth_offsets =
      cached_constant(fmt::format("max_pool3d depths {} {}", d, h * w), [&] {
        std::vector<int64_t> offsets(static_cast<size_t>(d));
        for (int64_t i = 0; i < d; ++i) offsets[static_cast<size_t>(i)] = i * h * w;
        return tensor(offsets, {d, 1});
      });
  const Tensor volume_index = reshape(planes.indices, {n, c, d, columns}, loc) + depth_offsets;
  const ValuesIndices depth = max_pool2d_with_indices(
      reshape(planes.values, {n, c, d, columns}, loc), {p.d.kernel, 1}, Size2{p.d.stride, 1},
      {p.d.pad, 0}, {p.d.dilation, 1}, ceil_mode, loc);
  const Tensor picked = take_along_dim(reshape(volume_index, {n, c, d * columns}, loc),
                                       reshape(depth.indices, {n, c, p.d.out * columns}, loc), 2);
  Tensor indices = reshape(picked, {n, c, p.d.out, p.h.out, p.w.out}, loc);
  Tensor values = reshape(depth.values, {n, c, p.d.out, p.h.out, p.w.out}, loc);
  if (x.dim() == 4) {
    indices = squeeze(indices, 0, loc);
    values = squeeze(values, 0, loc);
  }
  return {wide ? narrowed_like(values, x, loc) : values, indices};
}

Tensor avg_pool3d(const Tensor& x, Size3 kernel, std::optional<Size3> stride, Size3 padding,
                  bool ceil_mode, bool count_include_pad, const Loc& loc) {
  CallSiteScope site(loc, composite::avg_pool3d);
  const Pool3 p =
      pool3_geometry("avg_pool3d", loc, x, kernel, stride, padding, 1, ceil_mode, false);
  if (std::max({p.d.kernel, p.h.kernel, p.w.kernel}) > kMaxNodesPerAxis)
    op_fail("avg_pool3d", loc,
            "kernel {}x{}x{} is above 2^16 on an axis (it adds a view per kernel row); "
            "adaptive_avg_pool3d or mean take any window",
            p.d.kernel, p.h.kernel, p.w.kernel);
  // PyTorch's divisor is the product of each axis's count, so the mean of the depth windows of
  // the height-and-width means is the window's mean; summed in f32 and rounded once.
  const Size3 s = stride.value_or(kernel);
  const Tensor y = separable3d(
      widened(x, loc),
      [&](const Tensor& t) {
        return avg_pool2d(t, {kernel.h, kernel.w}, Size2{s.h, s.w}, {padding.h, padding.w},
                          ceil_mode, count_include_pad, loc);
      },
      [&](const Tensor& t) {
        return avg_pool2d(t, {kernel.d, 1}, Size2{s.d, 1}, {padding.d, 0}, ceil_mode,
                          count_include_pad, loc);
      });
  return narrowed_like(y, x, loc);
}

Tensor adaptive_avg_pool3d(const Tensor& x, Size3 output_size, const Loc& loc) {
  CallSiteScope site(loc, composite::adaptive_avg_pool3d);
  check_adaptive("adaptive_avg_pool3d", loc, x, {output_size.d, output_size.h, output_size.w});
  const Tensor wide = widened(x, loc);
  const int64_t at = x.dim() - 3;
  const Tensor y =
      adaptive_mean(adaptive_mean(adaptive_mean(wide, at, output_size.d), at + 1, output_size.h),
                    at + 2, output_size.w);
  return narrowed_like(y, x, loc);
}

Tensor adaptive_max_pool3d(const Tensor& x, Size3 output_size, const Loc& loc) {
  CallSiteScope site(loc, composite::adaptive_max_pool3d);
  check_adaptive("adaptive_max_pool3d", loc, x, {output_size.d, output_size.h, output_size.w},
                 true);
  // Width, height, then depth: each window's pick is the first maximum (the last NaN) in
  // (depth, height, width) order, PyTorch's. In f32, as adaptive_max_pool2d.
  const Tensor y = separable3d(
      widened(x, loc),
      [&](const Tensor& t) {
        return adaptive_max(adaptive_max(t, 3, output_size.w), 2, output_size.h);
      },
      [&](const Tensor& t) { return adaptive_max(t, 2, output_size.d); });
  return narrowed_like(y, x, loc);
}

namespace {

// unfold's and fold's sliding blocks over a spatial size: every size checked as conv2d's, at
// least one block per axis and at most 2^16 kernel elements (each makes a view), as PyTorch's
// im2col checks.
Pool block_geometry(const char* op, const Loc& loc, Size2 in, Size2 kernel, Size2 dilation,
                    Size2 padding, Size2 stride) {
  const auto text = [&] {
    return fmt::format("kernel_size ({}, {}), dilation ({}, {}), padding ({}, {}), stride ({}, {})",
                       kernel.h, kernel.w, dilation.h, dilation.w, padding.h, padding.w, stride.h,
                       stride.w);
  };
  Pool p;
  PoolAxis* axes[2] = {&p.h, &p.w};
  const Size2* sizes[5] = {&in, &kernel, &dilation, &padding, &stride};
  for (int d = 0; d < 2; ++d) {
    int64_t v[5];
    for (int s = 0; s < 5; ++s) v[s] = d == 0 ? sizes[s]->h : sizes[s]->w;
    const auto [size, k, dil, pad, step] = v;
    if (k <= 0 || dil <= 0 || step <= 0 || pad < 0)
      op_fail(op, loc, "{}: kernel, dilation and stride must be positive, padding not negative",
              text());
    if (std::max({k, dil, pad, step}) > kMaxWindow) op_fail(op, loc, "{}: above 2^31", text());
    if (size < 0) op_fail(op, loc, "spatial size ({}, {}) is negative", in.h, in.w);
    if (size > (int64_t{1} << 60))
      op_fail(op, loc, "spatial size ({}, {}) is above 2^60", in.h, in.w);
    const int64_t span = size + 2 * pad - dil * (k - 1) - 1;  // below 2^62: no overflow
    if (span < 0)
      op_fail(op, loc, "{} makes no block of spatial size ({}, {})", text(), in.h, in.w);
    *axes[d] = {size, k, step, pad, dil, span / step + 1};
  }
  if (kernel.h * kernel.w > kMaxNodesPerAxis)
    op_fail(op, loc, "{}: more than 2^16 kernel elements (a view each)", text());
  return p;
}

}  // namespace

Tensor unfold(const Tensor& x, Size2 kernel_size, Size2 dilation, Size2 padding, Size2 stride,
              const Loc& loc) {
  CallSiteScope site(loc);
  const char* op = "unfold";
  require(x, op, "input", loc);
  if (x.dim() != 3 && x.dim() != 4)
    op_fail(op, loc, "needs an [N, C, H, W] or [C, H, W] input, got {}", to_string(x.shape()));
  const Pool p =
      block_geometry(op, loc, {x.size(-2), x.size(-1)}, kernel_size, dilation, padding, stride);
  // A floating x in f32 (f64 for f64): the gradients of overlapping blocks add up in x's.
  const bool floating = is_floating(x.dtype());
  const Tensor y = batched(floating ? widened(x, loc) : x, [&](const Tensor& nchw) {
    const Tensor padded = pad_for_windows(nchw, p, 0.0);
    std::vector<Tensor> elements;
    for (int64_t i = 0; i < p.h.kernel; ++i)
      for (int64_t j = 0; j < p.w.kernel; ++j)
        elements.push_back(window_slice(padded, window_element(padded, p, i, j)));
    // [N, C, kernel elements, OH, OW]: channel-major rows, as PyTorch's.
    return reshape(stack(elements, 2),
                   {nchw.size(0), nchw.size(1) * p.h.kernel * p.w.kernel, p.h.out * p.w.out});
  });
  return floating ? narrowed_like(y, x, loc) : y;
}

Tensor fold(const Tensor& x, Size2 output_size, Size2 kernel_size, Size2 dilation, Size2 padding,
            Size2 stride, const Loc& loc) {
  CallSiteScope site(loc);
  const char* op = "fold";
  require_float(x, op, "input", loc);
  if (x.dim() != 2 && x.dim() != 3)
    op_fail(op, loc, "needs an [N, C * kernel elements, blocks] or unbatched input, got {}",
            to_string(x.shape()));
  const Pool p = block_geometry(op, loc, output_size, kernel_size, dilation, padding, stride);
  const int64_t elements = p.h.kernel * p.w.kernel;
  if (x.size(-2) % elements != 0)
    op_fail(op, loc, "the {} rows of input {} are no multiple of the kernel's {} elements",
            x.size(-2), to_string(x.shape()), elements);
  if (static_cast<__int128>(x.size(-1)) != static_cast<__int128>(p.h.out) * p.w.out)
    op_fail(op, loc, "input {} has {} blocks, output size ({}, {}) takes {} x {}",
            to_string(x.shape()), x.size(-1), output_size.h, output_size.w, p.h.out, p.w.out);
  auto folded = [&](const Tensor& batch) {
    const int64_t n = batch.size(0), c = batch.size(1) / elements;
    const Tensor blocks = reshape(batch, {n, c, elements, p.h.out, p.w.out});
    // The extent the blocks cover, from the top-left padding on; each kernel element's values
    // are added at their strided places (the adjoint of unfold's views).
    const Shape extent{n, c, p.h.pad + p.h.in + p.h.right(), p.w.pad + p.w.in + p.w.right()};
    Tensor sum;
    for (int64_t i = 0; i < p.h.kernel; ++i)
      for (int64_t j = 0; j < p.w.kernel; ++j) {
        const int64_t e = i * p.w.kernel + j;
        const Tensor placed = unslice(squeeze(slice(blocks, 2, e, e + 1), 2),
                                      {0, 0, i * p.h.dilation, j * p.w.dilation},
                                      {1, 1, p.h.stride, p.w.stride}, extent);
        sum = sum.defined() ? sum + placed : placed;
      }
    // The padding cropped, and zeros where no block reaches.
    return pad(sum, {-p.w.pad, -p.w.right(), -p.h.pad, -p.h.right()});
  };
  // Many blocks may add into one element: a 16-bit input sums in f32, rounded once.
  const Tensor wide = widened(x, loc);
  const Tensor y = x.dim() == 3 ? folded(wide) : squeeze(folded(unsqueeze(wide, 0)), 0);
  return narrowed_like(y, x, loc);
}

namespace {

// [C] as [1, C, 1, ...] of x's rank, in `dtype`.
Tensor per_channel(const Tensor& v, const Tensor& x, DType dtype) {
  Shape shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = x.size(1);
  return reshape(cast(v, dtype), shape);
}

void check_channel_vector(const Tensor& v, const Tensor& x, const char* op, const char* role,
                          const Loc& loc) {
  if (!v.defined()) return;
  if (!is_floating(v.dtype()))
    op_fail(op, loc, "the {} must be floating-point, got {}", role, name(v.dtype()));
  if (v.shape() != Shape{x.size(1)})
    op_fail(op, loc, "{} shape {} should be [{}] for input {}", role, to_string(v.shape()),
            x.size(1), to_string(x.shape()));
}

Tensor affine(Tensor y, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (weight.defined()) y = y * per_channel(weight, x, y.dtype());
  if (bias.defined()) y = y + per_channel(bias, x, y.dtype());
  return cast(y, x.dtype());
}

}  // namespace

namespace detail {

Tensor batch_norm_tracked(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                          const Tensor& num_batches_tracked, const Tensor& weight,
                          const Tensor& bias, bool training, std::optional<double> momentum,
                          double eps, const Loc& loc) {
  CallSiteScope site(loc, composite::batch_norm);
  const char* op = "batch_norm";
  require_float(x, op, "input", loc);
  if (x.dim() < 2) op_fail(op, loc, "needs an [N, C, ...] input, got {}", to_string(x.shape()));
  check_channel_vector(running_mean, x, op, "running_mean", loc);
  check_channel_vector(running_var, x, op, "running_var", loc);
  check_channel_vector(weight, x, op, "weight", loc);
  check_channel_vector(bias, x, op, "bias", loc);
  if (running_mean.defined() != running_var.defined())
    op_fail(op, loc, "running_mean and running_var must both be given or both be undefined");
  if (!training && !running_mean.defined())
    op_fail(op, loc, "eval mode needs running_mean and running_var");
  if (momentum && !(*momentum >= 0 && *momentum <= 1))
    op_fail(op, loc, "momentum must be in [0, 1], got {}", *momentum);
  if (training && running_mean.defined() && !momentum && !num_batches_tracked.defined())
    op_fail(op, loc, "a cumulative average (momentum None) needs num_batches_tracked");
  const DType type = composite::statistics_type(x.dtype());
  Tensor xs = cast(x, type);
  Tensor mu, var;
  if (training) {
    const int64_t n = x.numel() / std::max<int64_t>(x.size(1), 1);
    if (n <= 1)
      op_fail(op, loc, "training needs more than one value per channel, got input {}",
              to_string(x.shape()));
    // Training normalizes x viewed as [N, C, rest]: the mean per channel is the sum of each
    // contiguous (sample, channel) plane first, then over the samples (row reductions that
    // vectorize, where one reduction over axes (0, 2, ...) reads the input with a stride per
    // channel), and the backward pass's reductions of the broadcast statistics see the same
    // three axes.
    if (x.dim() > 3) xs = reshape(xs, {x.size(0), x.size(1), n / x.size(0)});
    Shape stats_shape(static_cast<size_t>(xs.dim()), 1);
    stats_shape[1] = x.size(1);
    auto channel_mean = [&](const Tensor& t) {
      Tensor planes = t.dim() > 2 ? sum(t, {2}) : t;
      return reshape(sum(planes, {0}) / static_cast<double>(n), stats_shape);
    };
    mu = channel_mean(xs);
    var = channel_mean(square(xs - mu));
    if (running_mean.defined()) {
      std::vector<Tensor> updates;
      Tensor count;
      if (num_batches_tracked.defined()) count = num_batches_tracked + 1;
      auto step = [&](const Tensor& running, const Tensor& batch, double scale) {
        Tensor value = cast(reshape(batch.detach(), {x.size(1)}), running.dtype());
        if (momentum) return running * (1.0 - *momentum) + value * (*momentum * scale);
        Tensor factor = 1.0 / cast(count, running.dtype());  // the cumulative average
        return running * (1.0 - factor) + value * factor * scale;
      };
      updates.push_back(step(running_mean, mu, 1.0));
      // The unbiased variance, as PyTorch keeps.
      updates.push_back(step(running_var, var, static_cast<double>(n) / (n - 1)));
      if (count.defined()) updates.push_back(count);
      // Computed by the step's next evaluation (its backward pass or optimizer), in its program.
      Tensor(running_mean).assign_later(updates[0]);
      Tensor(running_var).assign_later(updates[1]);
      if (count.defined()) Tensor(num_batches_tracked).assign_later(updates[2]);
    }
  } else {
    mu = per_channel(running_mean, x, type);
    var = per_channel(running_var, x, type);
  }
  Tensor y = affine((xs - mu) * rsqrt(var + eps), xs, weight, bias);
  // In the type x is stored in, as PyTorch's autocast returns batch norm's result (on the CPU and
  // CUDA alike): the ReLU and residual add after it, and the next convolution's input, stay half.
  return cast_like(reshape(y, x.shape()), x);
}

}  // namespace detail

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum,
                  double eps, const Loc& loc) {
  return detail::batch_norm_tracked(x, running_mean, running_var, Tensor(), weight, bias, training,
                                    momentum, eps, loc);
}

Tensor group_norm(const Tensor& x, int64_t groups, const Tensor& weight, const Tensor& bias,
                  double eps, const Loc& loc) {
  CallSiteScope site(loc, composite::group_norm);
  const char* op = "group_norm";
  require_float(x, op, "input", loc);
  if (x.dim() < 2) op_fail(op, loc, "needs an [N, C, ...] input, got {}", to_string(x.shape()));
  if (groups <= 0 || x.size(1) % groups != 0)
    op_fail(op, loc, "{} groups do not divide the {} channels of input {}", groups, x.size(1),
            to_string(x.shape()));
  check_channel_vector(weight, x, op, "weight", loc);
  check_channel_vector(bias, x, op, "bias", loc);
  // The group's size spelled out: an empty batch (N = 0) leaves nothing to infer a -1 from.
  int64_t group_size = x.size(1) / groups;
  for (int64_t d = 2; d < x.dim(); ++d) group_size *= x.size(d);
  Tensor grouped =
      reshape(cast(x, composite::statistics_type(x.dtype())), {x.size(0), groups, group_size});
  Tensor centered = grouped - mean(grouped, {-1}, true);
  Tensor y = centered * rsqrt(mean(square(centered), {-1}, true) + eps);
  return affine(reshape(y, x.shape()), x, weight, bias);
}

Tensor instance_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                     const Loc& loc) {
  CallSiteScope site(loc, composite::instance_norm);
  require_float(x, "instance_norm", "input", loc);
  if (x.dim() < 3)
    op_fail("instance_norm", loc, "needs an [N, C, spatial...] input, got {}",
            to_string(x.shape()));
  if (x.numel() / std::max<int64_t>(x.size(0) * x.size(1), 1) <= 1 && x.numel() > 0)
    op_fail("instance_norm", loc,
            "needs more than one spatial element to normalize over (its statistics), got {}",
            to_string(x.shape()));
  // In x's stored type, as batch norm (PyTorch's autocast lists neither; group norm is on its f32
  // list).
  return cast_like(group_norm(x, x.size(1), weight, bias, eps, loc), x);
}

namespace detail {

Tensor instance_norm_tracked(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                             const Tensor& weight, const Tensor& bias, bool use_input_stats,
                             double momentum, double eps, const Loc& loc) {
  CallSiteScope site(loc, composite::instance_norm);
  const char* op = "instance_norm";
  require_float(x, op, "input", loc);
  if (x.dim() < 3)
    op_fail(op, loc, "needs an [N, C, spatial...] input, got {}", to_string(x.shape()));
  check_channel_vector(running_mean, x, op, "running_mean", loc);
  check_channel_vector(running_var, x, op, "running_var", loc);
  if (running_mean.defined() != running_var.defined())
    op_fail(op, loc, "running_mean and running_var must both be given or both be undefined");
  if (!(momentum >= 0 && momentum <= 1))
    op_fail(op, loc, "momentum must be in [0, 1], got {}", momentum);
  if (!use_input_stats) {
    if (!running_mean.defined())
      op_fail(op, loc, "without the input's statistics it needs running_mean and running_var");
    // The running statistics per channel: batch norm's eval mode.
    return batch_norm(x, running_mean, running_var, weight, bias, false, momentum, eps, loc);
  }
  Tensor y = instance_norm(x, weight, bias, eps, loc);
  const int64_t n = x.size(0), c = x.size(1);
  // An empty batch has no statistics to move the running ones towards (PyTorch's would be NaN).
  if (!running_mean.defined() || n == 0) return y;
  // PyTorch's: batch norm of x as one sample of N C channels, its running statistics repeated N
  // times and then averaged: the running ones move towards the instances' mean mean and mean
  // unbiased variance. In f32, computed by the step's next evaluation.
  const int64_t plane = x.numel() / (n * c);
  const Tensor xs = reshape(cast(x.detach(), composite::statistics_type(x.dtype())), {n, c, plane});
  const Tensor mu = mean(xs, {2}, true);
  const Tensor var = sum(square(xs - mu), {2}) / static_cast<double>(plane - 1);
  auto moved = [&](const Tensor& running, const Tensor& instances) {
    return running * (1.0 - momentum) +
           cast(mean(reshape(instances, {n, c}), {0}), running.dtype()) * momentum;
  };
  const Tensor new_mean = moved(running_mean, mu), new_var = moved(running_var, var);
  Tensor(running_mean).assign_later(new_mean);
  Tensor(running_var).assign_later(new_var);
  return y;
}

}  // namespace detail

Tensor prelu(const Tensor& x, const Tensor& weight, const Loc& loc) {
  CallSiteScope site(loc, composite::prelu);
  const char* op = "prelu";
  require_float(x, op, "input", loc);
  require_float(weight, op, "weight", loc);
  const int64_t channels = x.dim() >= 2 ? x.size(1) : (x.dim() == 1 ? x.size(0) : 1);
  if (weight.dim() > 1 || (weight.numel() != 1 && weight.numel() != channels))
    op_fail(op, loc, "weight {} must hold 1 value or one per channel ({} of input {})",
            to_string(weight.shape()), channels, to_string(x.shape()));
  Shape at(static_cast<size_t>(x.dim()), 1);  // one weight per channel, broadcast over the rest
  if (x.dim() > 0) at[x.dim() >= 2 ? 1 : 0] = channels;
  const Tensor w = reshape(weight, weight.numel() == 1 ? Shape{} : at, loc);
  // PyTorch's: x where x > 0, else weight x (also at 0, for the gradients; a NaN stays NaN).
  return where(x > 0.0, x, w * x, loc);
}

Tensor dropout3d(const Tensor& x, double p, bool training, Generator* gen, const Loc& loc) {
  require_float(x, "dropout3d", "input", loc);
  if (!(p >= 0 && p <= 1)) op_fail("dropout3d", loc, "p must be in [0, 1], got {}", p);
  if (x.dim() != 4 && x.dim() != 5)
    op_fail("dropout3d", loc, "needs an [N, C, D, H, W] or [C, D, H, W] input, got {}",
            to_string(x.shape()));
  if (x.dim() == 5) return dropout2d(x, p, training, gen, loc);
  return squeeze(dropout2d(unsqueeze(x, 0, loc), p, training, gen, loc), 0, loc);
}

Tensor dropout2d(const Tensor& x, double p, bool training, Generator* gen, const Loc& loc) {
  CallSiteScope site(loc, composite::dropout);
  require_float(x, "dropout2d", "input", loc);
  if (x.dim() < 2)
    op_fail("dropout2d", loc, "needs an [N, C, ...] input, got {}", to_string(x.shape()));
  if (!(p >= 0 && p <= 1)) op_fail("dropout2d", loc, "p must be in [0, 1], got {}", p);
  if (!training || p == 0) return x;
  if (p == 1) return x * 0.0;
  Shape mask_shape(static_cast<size_t>(x.dim()), 1);
  mask_shape[0] = x.size(0);
  mask_shape[1] = x.size(1);
  Tensor keep = rand(mask_shape, f32, gen) >= p;
  // Multiplied, as dropout's: a dropped channel's NaN stays NaN.
  return x *
         where(keep, full(mask_shape, 1.0 / (1.0 - p), x.dtype()), zeros(mask_shape, x.dtype()));
}

}  // namespace mixtape
