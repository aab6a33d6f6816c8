// mixtape/dsl/vision.cpp -- max pooling over its two primitives (MaxPool2d, MaxPool2dGrad); avg
// pooling, batch/group/instance norm, interpolate and dropout2d as composites over strided slices,
// pointwise ops and reductions, so that they fuse into the kernels around them and get gradients
// and precision from the primitives.
#include "mixtape/dsl/vision.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/constant_cache.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"

namespace mixtape {
namespace {

void require_float(const Tensor& t, const char* op, const char* role, const Loc& loc) {
  if (!t.defined()) op_fail(op, loc, "the {} is an undefined tensor", role);
  if (!is_floating(t.dtype()))
    op_fail(op, loc, "the {} must be floating-point, got {}", role, name(t.dtype()));
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// The largest pooling window size, stride, dilation and padding (conv2d's bound).
constexpr int64_t kMaxWindow = int64_t{1} << 31;
// Bounds on what ops make per kernel row or window on the host: graph nodes (avg_pool2d's views
// per kernel row and column, adaptive_avg_pool2d's means per window where windows differ) and
// index and weight tables (interpolate's, 8 to 24 bytes per output element of an axis).
constexpr int64_t kMaxNodesPerAxis = int64_t{1} << 16;
constexpr int64_t kMaxWindowsPerAxis = int64_t{1} << 20;
constexpr int64_t kMaxInterpolatedAxis = int64_t{1} << 24;

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
  Tensor y, taken_value;  // the maximum so far and g at its pick
  for (int64_t i = 0; i < p.h.kernel; ++i)
    for (int64_t j = 0; j < p.w.kernel; ++j) {
      WindowElement e = window_element(padded, p, i, j);
      Tensor element = window_slice(padded, e), value = window_slice(padded_g, e);
      if (!y.defined()) {
        y = element;
        taken_value = value;
        continue;
      }
      Tensor take = logical_or(element > y, isnan(element));
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
  // ulps), and given back in the type x is stored in. The cast is a node also where x is traced
  // in f32: a policy may store x in a half type (a convolution's output under autocast), and an
  // explicit cast keeps its traced type, so the sums are f32 then too.
  Tensor windows = pad_for_windows(x, p, 0.0);
  const DType sum_type = composite::statistics_type(x.dtype());
  Tensor padded(make_node(OpCode::Cast, sum_type, windows.shape(), {windows.node()}, {}, loc));
  // x's stored type at the output's shape, for the result (cast_like): one window element of it.
  Tensor stored_like_x = window_slice(windows, window_element(windows, p, 0, 0));
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
  return cast_like(cast(mean, x.dtype()), stored_like_x);
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

Tensor adaptive_avg_pool2d(const Tensor& x, Size2 output_size, const Loc& loc) {
  CallSiteScope site(loc, composite::adaptive_avg_pool2d);
  require_float(x, "adaptive_avg_pool2d", "input", loc);
  if (x.dim() != 3 && x.dim() != 4)
    op_fail("adaptive_avg_pool2d", loc, "needs an NCHW or CHW input, got {}", to_string(x.shape()));
  if (output_size.h <= 0 || output_size.w <= 0)
    op_fail("adaptive_avg_pool2d", loc, "output size ({}, {}) must be positive", output_size.h,
            output_size.w);
  for (auto [in, out] :
       {std::pair{x.size(-2), output_size.h}, std::pair{x.size(-1), output_size.w}})
    if (out > kMaxWindowsPerAxis && in % out != 0)
      op_fail("adaptive_avg_pool2d", loc,
              "output size ({}, {}) is above 2^20 on an axis whose windows differ (it makes a "
              "mean per window)",
              output_size.h, output_size.w);
  if (x.size(-2) == 0 || x.size(-1) == 0)
    op_fail("adaptive_avg_pool2d", loc, "input {} has an empty spatial axis", to_string(x.shape()));
  return adaptive_mean(adaptive_mean(x, x.dim() - 2, output_size.h), x.dim() - 1, output_size.w);
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

namespace {

// PyTorch's compute_scales_value: the source step per output step, in float as PyTorch has it.
float source_scale(const std::vector<double>& factors, size_t axis, int64_t in, int64_t out) {
  if (!factors.empty() && factors[axis] > 0) return static_cast<float>(1.0 / factors[axis]);
  return static_cast<float>(in) / static_cast<float>(out);
}

// A table of an interpolation along one axis, kept under `key` (the table's name and
// everything it depends on).
Tensor axis_table(const std::string& key, const std::vector<int64_t>& indices) {
  return cached_constant(key,
                         [&] { return tensor(indices, {static_cast<int64_t>(indices.size())}); });
}
Tensor axis_table(const std::string& key, const std::vector<double>& weights, const Shape& shape,
                  DType dtype) {
  return cached_constant(key, [&] { return tensor(weights, shape, dtype); });
}

// Nearest: output o reads input min(floor(o scale), in - 1), as PyTorch's NCHW kernels (and its
// CUDA one) compute it. (Its nearest_idx also copies at the same size and reads o / 2 at twice
// the size whatever the scale factor says, which its channels-last kernel follows: a factor of
// 2.2 at twice the size, or 1.3 at the same size, differs there.)
Tensor nearest_axis(const Tensor& x, int64_t axis, int64_t out, float scale) {
  const int64_t in = x.size(axis);
  std::vector<int64_t> source(static_cast<size_t>(out));
  bool identity = in == out;
  for (int64_t o = 0; o < out; ++o) {
    source[static_cast<size_t>(o)] =
        std::min(static_cast<int64_t>(std::floor(static_cast<float>(o) * scale)), in - 1);
    identity &= source[static_cast<size_t>(o)] == o;
  }
  if (identity) return x;
  const auto scale_bits = std::bit_cast<uint32_t>(scale);
  return index_select(x, axis_table(fmt::format("nearest {} {} {}", in, out, scale_bits), source),
                      axis);
}

// The source position of output o along an axis, PyTorch's area_pixel_compute_source_index (a
// linear interpolation clamps it at 0, a cubic one does not).
float source_index(int64_t o, float step, bool align_corners, bool cubic) {
  if (align_corners) return step * static_cast<float>(o);
  const float source = step * (static_cast<float>(o) + 0.5f) - 0.5f;
  return cubic ? source : std::max(source, 0.f);
}

// Along one axis, each output as a weighted sum of taps: Σ_j x[index_j] weight_j, the tables
// kept under `key`. In f32 for a 16-bit x (PyTorch's opmath), rounded once to x's stored type,
// as PyTorch's autocast leaves it.
Tensor weighted_taps(const Tensor& x, int64_t axis, const std::string& key,
                     const std::vector<std::vector<int64_t>>& indices,
                     const std::vector<std::vector<double>>& weights) {
  const DType weight_type = is_half(x.dtype()) ? f32 : x.dtype();
  Shape weight_shape(static_cast<size_t>(x.dim() - axis), 1);
  weight_shape[0] = static_cast<int64_t>(weights[0].size());
  const std::string tables =
      fmt::format("{} {} {}", key, name(weight_type), to_string(weight_shape));
  Tensor sum, first;
  for (size_t j = 0; j < indices.size(); ++j) {
    Tensor selected =
        index_select(x, axis_table(fmt::format("{} index {}", tables, j), indices[j]), axis);
    Tensor tap = selected * axis_table(fmt::format("{} weight {}", tables, j), weights[j],
                                       weight_shape, weight_type);
    sum = j == 0 ? tap : sum + tap;
    if (j == 0) first = selected;
  }
  return cast_like(sum, first);  // the taps are stored as x is
}

// The source step per output step: (in - 1) / (out - 1) with align_corners, else the scale.
float source_step(int64_t in, int64_t out, float scale, bool align_corners) {
  if (!align_corners) return scale;
  return out > 1 ? static_cast<float>(in - 1) / static_cast<float>(out - 1) : 0.f;
}

// Linear along one axis: x[i0] l0 + x[i1] l1 with PyTorch's area_pixel_compute_source_index.
Tensor linear_axis(const Tensor& x, int64_t axis, int64_t out, float scale, bool align_corners) {
  const int64_t in = x.size(axis);
  if (in == out) return x;  // PyTorch copies an axis whose size stays, whatever the factor
  std::vector<std::vector<int64_t>> index(2, std::vector<int64_t>(static_cast<size_t>(out)));
  std::vector<std::vector<double>> weight(2, std::vector<double>(static_cast<size_t>(out)));
  const float step = source_step(in, out, scale, align_corners);
  for (int64_t o = 0; o < out; ++o) {
    const auto k = static_cast<size_t>(o);
    const float source = source_index(o, step, align_corners, false);
    index[0][k] = std::min(static_cast<int64_t>(source), in - 1);
    index[1][k] = std::min(index[0][k] + 1, in - 1);
    const float lambda = std::min(std::max(source - static_cast<float>(index[0][k]), 0.f), 1.f);
    weight[1][k] = lambda;
    weight[0][k] = 1.f - lambda;
  }
  return weighted_taps(
      x, axis,
      fmt::format("linear {} {} {} {}", in, out, std::bit_cast<uint32_t>(scale), align_corners),
      index, weight);
}

// Cubic along one axis: four taps around the source position, clamped to the axis, weighted by
// PyTorch's cubic convolution (Keys, A = -0.75) in float, as get_cubic_upsample_coefficients.
Tensor cubic_axis(const Tensor& x, int64_t axis, int64_t out, float scale, bool align_corners) {
  const int64_t in = x.size(axis);
  constexpr float A = -0.75f;
  auto near = [](float d) { return ((A + 2) * d - (A + 3)) * d * d + 1; };       // |d| <= 1
  auto far = [](float d) { return ((A * d - 5 * A) * d + 8 * A) * d - 4 * A; };  // 1 < |d| < 2
  std::vector<std::vector<int64_t>> index(4, std::vector<int64_t>(static_cast<size_t>(out)));
  std::vector<std::vector<double>> weight(4, std::vector<double>(static_cast<size_t>(out)));
  const float step = source_step(in, out, scale, align_corners);
  bool identity = in == out;
  for (int64_t o = 0; o < out; ++o) {
    const auto k = static_cast<size_t>(o);
    const float source = source_index(o, step, align_corners, true);
    const float start = std::floor(source);
    const float t = source - start;
    const float w[4] = {far(t + 1.f), near(t), near(1.f - t), far(2.f - t)};
    for (size_t j = 0; j < 4; ++j) {
      index[j][k] =
          std::clamp(static_cast<int64_t>(start) - 1 + static_cast<int64_t>(j), int64_t{0}, in - 1);
      weight[j][k] = w[j];
    }
    identity &= t == 0.f && static_cast<int64_t>(start) == o;
  }
  if (identity) return x;  // the weights (0, 1, 0, 0) of every output: a copy
  return weighted_taps(
      x, axis,
      fmt::format("cubic {} {} {} {}", in, out, std::bit_cast<uint32_t>(scale), align_corners),
      index, weight);
}

}  // namespace

Tensor interpolate(const Tensor& x, const InterpolateOptions& options, const Loc& loc) {
  CallSiteScope site(loc, composite::interpolate);
  const char* op = "interpolate";
  require_float(x, op, "input", loc);
  const bool nearest = options.mode == InterpolateMode::Nearest;
  const char* mode = nearest                                     ? "nearest"
                     : options.mode == InterpolateMode::Bilinear ? "bilinear"
                                                                 : "bicubic";
  if (nearest ? (x.dim() != 3 && x.dim() != 4) : x.dim() != 4)
    op_fail(op, loc, "{} needs an {} input, got {}", mode,
            nearest ? "[N, C, L] or [N, C, H, W]" : "[N, C, H, W]", to_string(x.shape()));
  const auto spatial = static_cast<size_t>(x.dim() - 2);
  if (options.size.empty() == options.scale_factor.empty())
    op_fail(op, loc, "needs either size or scale_factor, not {}",
            options.size.empty() ? "neither" : "both");
  std::vector<double> factors = options.scale_factor;
  if (factors.size() == 1) factors.resize(spatial, factors[0]);
  std::vector<int64_t> sizes = options.size;
  if (sizes.size() == 1) sizes.resize(spatial, sizes[0]);
  if (!factors.empty() && factors.size() != spatial)
    op_fail(op, loc, "needs 1 or {} scale factors for input {}, got {}", spatial,
            to_string(x.shape()), factors.size());
  if (!sizes.empty() && sizes.size() != spatial)
    op_fail(op, loc, "needs 1 or {} sizes for input {}, got {}", spatial, to_string(x.shape()),
            sizes.size());
  if (sizes.empty())
    for (size_t a = 0; a < spatial; ++a) {
      if (!(factors[a] > 0)) op_fail(op, loc, "scale factors must be positive, got {}", factors[a]);
      const double size =
          std::floor(static_cast<double>(x.size(static_cast<int64_t>(a) + 2)) * factors[a]);
      if (!(size <= static_cast<double>(kMaxInterpolatedAxis)))
        op_fail(op, loc, "scale factor {} makes an axis of {} from {}, above 2^24", factors[a],
                size, x.size(static_cast<int64_t>(a) + 2));
      sizes.push_back(static_cast<int64_t>(size));
    }
  for (int64_t s : sizes)
    if (s <= 0 || s > kMaxInterpolatedAxis)
      op_fail(op, loc, "output sizes must be positive and at most 2^24, got {}", s);
  if (options.align_corners && nearest)
    op_fail(op, loc, "align_corners applies to the bilinear and bicubic modes only");
  Tensor y = x;
  for (size_t a = 0; a < spatial; ++a) {
    const int64_t axis = static_cast<int64_t>(a) + 2;
    const float scale = source_scale(factors, a, x.size(axis), sizes[a]);
    switch (options.mode) {
      case InterpolateMode::Nearest:
        y = nearest_axis(y, axis, sizes[a], scale);
        break;
      case InterpolateMode::Bilinear:
        y = linear_axis(y, axis, sizes[a], scale, options.align_corners);
        break;
      case InterpolateMode::Bicubic:
        y = cubic_axis(y, axis, sizes[a], scale, options.align_corners);
        break;
    }
  }
  return y;
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

namespace {

// pixel_shuffle's and pixel_unshuffle's checks: x [*, C, H, W] and a positive factor.
void check_shuffle(const char* op, const Tensor& x, int64_t factor, const Loc& loc) {
  if (!x.defined()) op_fail(op, loc, "the input is an undefined tensor");
  if (x.dim() < 3) op_fail(op, loc, "needs an input [*, C, H, W], got {}", to_string(x.shape()));
  if (factor < 1 || factor > (int64_t{1} << 30))
    op_fail(op, loc, "the factor must be in [1, 2^30], got {}", factor);
}

}  // namespace

Tensor pixel_shuffle(const Tensor& x, int64_t upscale_factor, const Loc& loc) {
  CallSiteScope site(loc);
  const char* op = "pixel_shuffle";
  check_shuffle(op, x, upscale_factor, loc);
  const int64_t r = upscale_factor, c = x.size(-3), h = x.size(-2), w = x.size(-1);
  if (c % (r * r) != 0)
    op_fail(op, loc, "the {} channels of input {} are no multiple of the factor {} squared", c,
            to_string(x.shape()), r);
  const int64_t batch = x.dim() - 3;
  Shape split(x.shape().begin(), x.shape().end() - 3);
  for (int64_t size : {c / (r * r), r, r, h, w}) split.push_back(size);
  // [*, C, r, r, H, W] -> [*, C, H, r, W, r]
  std::vector<int64_t> order;
  for (int64_t d = 0; d < batch; ++d) order.push_back(d);
  for (int64_t d : {0, 3, 1, 4, 2}) order.push_back(batch + d);
  Shape out(x.shape().begin(), x.shape().end() - 3);
  for (int64_t size : {c / (r * r), h * r, w * r}) out.push_back(size);
  return reshape(permute(reshape(x, split, loc), order, loc), out, loc);
}

Tensor pixel_unshuffle(const Tensor& x, int64_t downscale_factor, const Loc& loc) {
  CallSiteScope site(loc);
  const char* op = "pixel_unshuffle";
  check_shuffle(op, x, downscale_factor, loc);
  const int64_t r = downscale_factor, c = x.size(-3), h = x.size(-2), w = x.size(-1);
  if (h % r != 0 || w % r != 0)
    op_fail(op, loc, "the height and width of input {} must be multiples of the factor {}",
            to_string(x.shape()), r);
  const int64_t batch = x.dim() - 3;
  Shape split(x.shape().begin(), x.shape().end() - 3);
  for (int64_t size : {c, h / r, r, w / r, r}) split.push_back(size);
  // [*, C, H, r, W, r] -> [*, C, r, r, H, W]
  std::vector<int64_t> order;
  for (int64_t d = 0; d < batch; ++d) order.push_back(d);
  for (int64_t d : {0, 2, 4, 1, 3}) order.push_back(batch + d);
  Shape out(x.shape().begin(), x.shape().end() - 3);
  for (int64_t size : {c * r * r, h / r, w / r}) out.push_back(size);
  return reshape(permute(reshape(x, split, loc), order, loc), out, loc);
}

}  // namespace mixtape
