// mixtape/dsl/resample.cpp -- resampling images and volumes: interpolate (every PyTorch mode) over
// host index and weight tables (area by adaptive average pooling), pixel_shuffle /
// pixel_unshuffle as views, and grid_sample / affine_grid as gathers at positions computed in
// the graph.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/constant_cache.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/host_memory.h"
#include "mixtape/dsl/operand_checks.h"
#include "mixtape/dsl/vision.h"
#include "mixtape/dsl/wide_sums.h"

namespace mixtape {
namespace {

// The largest interpolated axis: its index and weight tables take 8 to 24 bytes per output
// element on the host.
constexpr int64_t kMaxInterpolatedAxis = int64_t{1} << 24;

// PyTorch's compute_scales_value: the source step per output step, in the type PyTorch computes
// positions in (float for nearest, its opmath type for linear and cubic: double for f64).
template <typename Real>
Real source_scale(const std::vector<double>& factors, size_t axis, int64_t in, int64_t out) {
  if (!factors.empty() && factors[axis] > 0) return static_cast<Real>(1.0 / factors[axis]);
  return static_cast<Real>(in) / static_cast<Real>(out);
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
// 2.2 at twice the size, or 1.3 at the same size, differs there.) Nearest-exact reads
// min(floor((o + 0.5) scale), in - 1), the product in double rounded to float as PyTorch's
// nearest_neighbor_exact_compute_source_index rounds it for floorf.
Tensor nearest_axis(const Tensor& x, int64_t axis, int64_t out, float scale, bool exact) {
  const int64_t in = x.size(axis);
  std::vector<int64_t> source(static_cast<size_t>(out));
  bool identity = in == out;
  for (int64_t o = 0; o < out; ++o) {
    const float at = exact ? static_cast<float>((static_cast<double>(o) + 0.5) * scale)
                           : static_cast<float>(o) * scale;
    source[static_cast<size_t>(o)] = std::min(static_cast<int64_t>(std::floor(at)), in - 1);
    identity &= source[static_cast<size_t>(o)] == o;
  }
  if (identity) return x;
  return index_select(
      x,
      axis_table(fmt::format("nearest{} {} {} {:a}", exact ? "-exact" : "", in, out, scale),
                 source),
      axis);
}

// The source position of output o along an axis, PyTorch's area_pixel_compute_source_index (a
// linear interpolation clamps it at 0, a cubic one does not). In double from the step in Real,
// as PyTorch's CPU kernels compute positions, their fractions rounded to Real only as weights
// (in float throughout, an axis of thousands moved samples by 1e-3).
template <typename Real>
double source_index(int64_t o, Real step, bool align_corners, bool cubic) {
  const auto scale = static_cast<double>(step);
  if (align_corners) return scale * static_cast<double>(o);
  const double source = scale * (static_cast<double>(o) + 0.5) - 0.5;
  return cubic ? source : std::max(source, 0.0);
}

// The source step per output step: (in - 1) / (out - 1) with align_corners, else the scale.
template <typename Real>
Real source_step(int64_t in, int64_t out, Real scale, bool align_corners) {
  if (!align_corners) return scale;
  return out > 1 ? static_cast<Real>(in - 1) / static_cast<Real>(out - 1) : Real(0);
}

// Along one axis, each output as a weighted sum of taps: Σ_j x[index_j] weight_j, the tables
// kept under `key` with x's type (f32 or f64: interpolate sums a 16-bit input in f32).
Tensor weighted_taps(const Tensor& x, int64_t axis, const std::string& key,
                     const std::vector<std::vector<int64_t>>& indices,
                     const std::vector<std::vector<double>>& weights) {
  Shape weight_shape(static_cast<size_t>(x.dim() - axis), 1);
  weight_shape[0] = static_cast<int64_t>(weights[0].size());
  const std::string tables = fmt::format("{} {} {}", key, name(x.dtype()), to_string(weight_shape));
  Tensor sum;
  for (size_t j = 0; j < indices.size(); ++j) {
    Tensor tap =
        index_select(x, axis_table(fmt::format("{} index {}", tables, j), indices[j]), axis) *
        axis_table(fmt::format("{} weight {}", tables, j), weights[j], weight_shape, x.dtype());
    sum = j == 0 ? tap : sum + tap;
  }
  return sum;
}

// The key of an axis's tables: the mode, the sizes, the scale (exactly, and its type) and
// align_corners.
template <typename Real>
std::string axis_key(const char* mode, int64_t in, int64_t out, Real scale, bool align_corners) {
  return fmt::format("{} {} {} {:a} {} {}", mode, in, out, static_cast<double>(scale), sizeof(Real),
                     align_corners);
}

// Linear along one axis: x[i0] l0 + x[i1] l1 with PyTorch's area_pixel_compute_source_index.
template <typename Real>
Tensor linear_axis(const Tensor& x, int64_t axis, int64_t out, Real scale, bool align_corners) {
  const int64_t in = x.size(axis);
  if (in == out) return x;  // PyTorch copies an axis whose size stays, whatever the factor
  std::vector<std::vector<int64_t>> index(2, std::vector<int64_t>(static_cast<size_t>(out)));
  std::vector<std::vector<double>> weight(2, std::vector<double>(static_cast<size_t>(out)));
  const Real step = source_step(in, out, scale, align_corners);
  for (int64_t o = 0; o < out; ++o) {
    const auto k = static_cast<size_t>(o);
    const double source = source_index(o, step, align_corners, false);
    index[0][k] = std::min(static_cast<int64_t>(source), in - 1);
    index[1][k] = std::min(index[0][k] + 1, in - 1);
    const auto lambda =
        static_cast<Real>(std::min(std::max(source - static_cast<double>(index[0][k]), 0.0), 1.0));
    weight[1][k] = lambda;
    weight[0][k] = Real(1) - lambda;
  }
  return weighted_taps(x, axis, axis_key("linear", in, out, scale, align_corners), index, weight);
}

// PyTorch's cubic convolution (Keys, A = -0.75), as get_cubic_upsample_coefficients: the
// weights of the four taps around a position t past the second, of host values (S their type)
// or graph values (S double).
template <typename V, typename S = V>
std::array<V, 4> cubic_weights(const V& t) {
  constexpr S A = S(-0.75);
  auto near = [](const V& d) { return ((A + 2) * d - (A + 3)) * d * d + S(1); };  // |d| <= 1
  auto far = [](const V& d) {                                                     // 1 < |d| < 2
    return ((A * d - S(5) * A) * d + S(8) * A) * d - S(4) * A;
  };
  return {far(t + S(1)), near(t), near(S(1) - t), far(S(2) - t)};
}

// Cubic along one axis: four taps around the source position, clamped to the axis, weighted by
// cubic_weights.
template <typename Real>
Tensor cubic_axis(const Tensor& x, int64_t axis, int64_t out, Real scale, bool align_corners) {
  const int64_t in = x.size(axis);
  std::vector<std::vector<int64_t>> index(4, std::vector<int64_t>(static_cast<size_t>(out)));
  std::vector<std::vector<double>> weight(4, std::vector<double>(static_cast<size_t>(out)));
  const Real step = source_step(in, out, scale, align_corners);
  bool identity = in == out;
  for (int64_t o = 0; o < out; ++o) {
    const auto k = static_cast<size_t>(o);
    const double source = source_index(o, step, align_corners, true);
    const double start = std::floor(source);
    const auto t = static_cast<Real>(source - start);
    const std::array<Real, 4> w = cubic_weights(t);
    for (size_t j = 0; j < 4; ++j) {
      index[j][k] =
          std::clamp(static_cast<int64_t>(start) - 1 + static_cast<int64_t>(j), int64_t{0}, in - 1);
      weight[j][k] = w[j];
    }
    identity &= t == 0 && static_cast<int64_t>(start) == o;
  }
  if (identity) return x;  // the weights (0, 1, 0, 0) of every output: a copy
  return weighted_taps(x, axis, axis_key("cubic", in, out, scale, align_corners), index, weight);
}

// Linear or cubic along one axis, positions and weights in Real, PyTorch's opmath type.
template <typename Real>
Tensor smooth_axis(const Tensor& x, int64_t axis, int64_t out, const std::vector<double>& factors,
                   size_t a, bool cubic, bool align_corners) {
  const Real scale = source_scale<Real>(factors, a, x.size(axis), out);
  return cubic ? cubic_axis<Real>(x, axis, out, scale, align_corners)
               : linear_axis<Real>(x, axis, out, scale, align_corners);
}

// What interpolate needs to know of a mode: its name in PyTorch, the ranks of input it takes
// (and their shapes, for the error), and whether it interpolates (takes align_corners).
struct InterpolationModeInfo {
  const char* name;
  std::vector<int64_t> ranks;
  const char* inputs;
  bool interpolates;
};

InterpolationModeInfo interpolation_mode(InterpolateMode mode) {
  const char* any = "[N, C, L], [N, C, H, W] or [N, C, D, H, W]";
  switch (mode) {
    case InterpolateMode::Nearest:
      return {"nearest", {3, 4, 5}, any, false};
    case InterpolateMode::NearestExact:
      return {"nearest-exact", {3, 4, 5}, any, false};
    case InterpolateMode::Area:
      return {"area", {3, 4, 5}, any, false};
    case InterpolateMode::Linear:
      return {"linear", {3}, "[N, C, L]", true};
    case InterpolateMode::Bilinear:
      return {"bilinear", {4}, "[N, C, H, W]", true};
    case InterpolateMode::Bicubic:
      return {"bicubic", {4}, "[N, C, H, W]", true};
    case InterpolateMode::Trilinear:
      return {"trilinear", {5}, "[N, C, D, H, W]", true};
  }
  fail("interpolate: unknown mode {}", static_cast<int>(mode));
}

// Area: adaptive average pooling to `sizes`, as PyTorch's interpolate does.
Tensor area(const Tensor& x, const std::vector<int64_t>& sizes, const Loc& loc) {
  if (x.dim() == 3) return adaptive_avg_pool1d(x, sizes[0], loc);
  if (x.dim() == 4) return adaptive_avg_pool2d(x, {sizes[0], sizes[1]}, loc);
  return adaptive_avg_pool3d(x, {sizes[0], sizes[1], sizes[2]}, loc);
}

}  // namespace

Tensor interpolate(const Tensor& x, const InterpolateOptions& options, const Loc& loc) {
  CallSiteScope site(loc, composite::interpolate);
  const char* op = "interpolate";
  require_float(x, op, "input", loc);
  const InterpolationModeInfo mode = interpolation_mode(options.mode);
  if (std::find(mode.ranks.begin(), mode.ranks.end(), x.dim()) == mode.ranks.end())
    op_fail(op, loc, "{} needs an input {}, got {}", mode.name, mode.inputs, to_string(x.shape()));
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
  for (int64_t axis = 2; axis < x.dim(); ++axis)
    if (x.size(axis) == 0)
      op_fail(op, loc, "input {} has an empty spatial axis", to_string(x.shape()));
  if (options.align_corners && !mode.interpolates)
    op_fail(op, loc,
            "align_corners applies to the linear, bilinear, bicubic and trilinear modes only");
  if (options.mode == InterpolateMode::Area) return area(x, sizes, loc);
  if (!mode.interpolates) {
    Tensor y = x;
    for (size_t a = 0; a < spatial; ++a) {
      const int64_t axis = static_cast<int64_t>(a) + 2;
      y = nearest_axis(y, axis, sizes[a], source_scale<float>(factors, a, x.size(axis), sizes[a]),
                       options.mode == InterpolateMode::NearestExact);
    }
    return y;
  }
  // Summed in f32 (f64 for f64) over every axis and rounded once, as PyTorch's opmath kernels.
  Tensor y = widened(x, loc);
  const DType sum_type = y.dtype();
  const bool cubic = options.mode == InterpolateMode::Bicubic;  // else linear along each axis
  for (size_t a = 0; a < spatial; ++a) {
    const int64_t axis = static_cast<int64_t>(a) + 2;
    y = sum_type == f64
            ? smooth_axis<double>(y, axis, sizes[a], factors, a, cubic, options.align_corners)
            : smooth_axis<float>(y, axis, sizes[a], factors, a, cubic, options.align_corners);
  }
  return narrowed_like(y, x, loc);
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
  if (c > (int64_t{1} << 60) / (r * r))
    op_fail(op, loc, "input {} would have more than 2^60 channels at factor {}",
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

namespace {

// One grid coordinate (-1 to 1 across an axis of `size`) as a position on that axis, as
// PyTorch's CPU grid sampler unnormalizes it (ComputeLocation): (coord + 1) times (size - 1) / 2,
// or times size / 2 less 0.5 (its rounding decides whether a point of the identity grid lies on
// a limit).
Tensor grid_position(const Tensor& coord, int64_t size, const GridSampleOptions& o) {
  const auto n = static_cast<double>(size);
  return o.align_corners ? (coord + 1.0) * ((n - 1) / 2) : (coord + 1.0) * (n / 2) - 0.5;
}

// A position on an axis of `size` as the padding mode moves it (compute_coordinates): clipped
// (border), reflected and clipped (reflection), or left (zeros).
Tensor padded_position(Tensor at, int64_t size, const GridSampleOptions& o) {
  const auto n = static_cast<double>(size);
  if (o.padding_mode == GridPadding::Zeros) return at;
  if (o.padding_mode == GridPadding::Reflection) {
    // reflect_coordinates over [low, high] (the pixel centers' span, or the pixels' edges)
    const double low = o.align_corners ? 0.0 : -0.5, high = o.align_corners ? n - 1 : n - 0.5;
    if (high <= low) {
      at = at * 0.0;
    } else {
      const double span = high - low;
      const Tensor span_t = full({}, span, at.dtype());
      const Tensor distance = abs(at - low);
      const Tensor extra = fmod(distance, span_t);
      const Tensor flips = floor(distance / span);
      at = where(fmod(flips, full({}, 2.0, at.dtype())) == 0.0, extra + low, span - extra + low);
    }
  }
  // Clipped to the axis, as PyTorch's clip_coordinates: a point on or past a limit takes no
  // gradient (its bilinear taps there would read past the input).
  return where(logical_and(at > 0.0, at < n - 1), at, clamp(at, 0.0, n - 1).detach());
}

}  // namespace

Tensor grid_sample(const Tensor& x, const Tensor& grid, const GridSampleOptions& options,
                   const Loc& loc) {
  CallSiteScope site(loc, composite::grid_sample);
  const char* op = "grid_sample";
  require_float(x, op, "input", loc);
  require_float(grid, op, "grid", loc);
  // Two or three spatial axes; the grid's last axis holds a point's coordinates (x, y[, z]),
  // which run along the input's last, second-to-last[, third-to-last] axis.
  const int64_t spatial = x.dim() - 2;
  if ((spatial != 2 && spatial != 3) || grid.dim() != x.dim() || grid.size(-1) != spatial ||
      grid.size(0) != x.size(0))
    op_fail(op, loc,
            "needs an input [N, C, H, W] and a grid [N, H_out, W_out, 2], or an input "
            "[N, C, D, H, W] and a grid [N, D_out, H_out, W_out, 3], got {} and {}",
            to_string(x.shape()), to_string(grid.shape()));
  for (int64_t axis = 2; axis < x.dim(); ++axis)
    if (x.size(axis) == 0)
      op_fail(op, loc, "input {} has an empty spatial axis", to_string(x.shape()));
  if (x.dtype() != grid.dtype())
    op_fail(op, loc, "the input ({}) and the grid ({}) must have one dtype, as PyTorch's",
            name(x.dtype()), name(grid.dtype()));
  if (options.mode != GridSampleMode::Bilinear && options.mode != GridSampleMode::Nearest &&
      options.mode != GridSampleMode::Bicubic)
    op_fail(op, loc, "unknown mode {}", static_cast<int>(options.mode));
  if (options.padding_mode != GridPadding::Zeros && options.padding_mode != GridPadding::Border &&
      options.padding_mode != GridPadding::Reflection)
    op_fail(op, loc, "unknown padding mode {}", static_cast<int>(options.padding_mode));
  if (options.mode == GridSampleMode::Bicubic && spatial == 3)
    op_fail(op, loc, "bicubic needs an input [N, C, H, W] (as PyTorch's), got {}",
            to_string(x.shape()));
  const int64_t n = x.size(0), c = x.size(1);
  // Coordinate j's axis size, and its stride in a sample's pixels (x varies fastest).
  std::vector<int64_t> sizes, strides;
  int64_t volume = 1;
  for (int64_t j = 0; j < spatial; ++j) {
    sizes.push_back(x.size(x.dim() - 1 - j));
    strides.push_back(volume);
    volume *= sizes.back();
  }
  Shape out_shape{n, c};
  int64_t points = 1;
  for (int64_t axis = 1; axis <= spatial; ++axis) {
    out_shape.push_back(grid.size(axis));
    points *= grid.size(axis);
  }
  // In f32 (f64 for f64) whatever the policy, as PyTorch's autocast runs grid_sampler.
  const DType t = composite::statistics_type(x.dtype());
  // The input as a table of pixels [N D H W, C], read a row per point (an embedding lookup,
  // whose gradient adds rows back: several times faster than gathering each channel's element).
  std::vector<int64_t> channels_last{0};
  for (int64_t axis = 2; axis < x.dim(); ++axis) channels_last.push_back(axis);
  channels_last.push_back(1);
  const Tensor pixels = reshape(permute(cast(x, t, loc), channels_last), {n * volume, c});
  const Tensor coords = reshape(cast(grid, t, loc), {n, points, spatial});
  // Each coordinate's position on its axis [N, points, 1].
  std::vector<Tensor> g;
  for (int64_t j = 0; j < spatial; ++j)
    g.push_back(grid_position(slice(coords, 2, j, j + 1), sizes[j], options));
  // Each sample's first row in the table.
  const Tensor first_row = reshape(
      arange(0.0, static_cast<double>(n * volume), static_cast<double>(volume), i64), {n, 1});
  // The input at integer positions p (one [N, points, 1] per coordinate): [N, points, C], zero
  // outside it.
  auto at = [&](const std::vector<Tensor>& p) {
    Tensor inside, row;
    for (int64_t j = 0; j < spatial; ++j) {
      const auto high = static_cast<double>(sizes[j] - 1);
      const Tensor within = logical_and(p[j] >= 0.0, p[j] <= high);
      inside = j == 0 ? within : logical_and(inside, within);
      // A NaN point (a NaN grid value, or an infinite one reflected) reads nothing.
      const Tensor index = cast(clamp(where(isnan(p[j]), zeros({}, t), p[j]), 0.0, high), i64);
      row = j == 0 ? index : row + index * strides[j];
    }
    const Tensor rows = reshape(row, {n, points}) + first_row;
    return where(inside, embedding(pixels, rows), zeros({}, t));
  };
  Tensor y;
  if (options.mode == GridSampleMode::Bicubic) {
    // PyTorch's: sixteen taps around the unpadded position, each moved by the padding mode
    // (get_value_bounded), weighted by the cubic weights of the position's fraction, summed
    // along x for each row of taps, then along y. The weights carry the grid's gradient.
    const Tensor x0 = floor(g[0]), y0 = floor(g[1]);
    const std::array<Tensor, 4> wx = cubic_weights<Tensor, double>(g[0] - x0);
    const std::array<Tensor, 4> wy = cubic_weights<Tensor, double>(g[1] - y0);
    auto tap = [&](const Tensor& start, int64_t k, int64_t size) {
      return padded_position((start + static_cast<double>(k - 1)).detach(), size, options);
    };
    for (int64_t j = 0; j < 4; ++j) {
      const Tensor py = tap(y0, j, sizes[1]);
      Tensor row = at({tap(x0, 0, sizes[0]), py}) * wx[0];
      for (int64_t i = 1; i < 4; ++i) row = row + at({tap(x0, i, sizes[0]), py}) * wx[i];
      y = j == 0 ? row * wy[0] : y + row * wy[j];
    }
  } else if (options.mode == GridSampleMode::Nearest) {
    // PyTorch's nearest pixel: std::nearbyint (half to even) in its 2-d kernels, std::round
    // (half away from zero) in its 3-d one, where a volume halved by an identity grid ties.
    std::vector<Tensor> p;
    for (int64_t j = 0; j < spatial; ++j) {
      const Tensor at = padded_position(g[j], sizes[j], options);
      if (spatial == 2) {
        p.push_back(round(at));
      } else {
        const Tensor whole = trunc(at), fraction = at - whole;  // the fraction is exact
        p.push_back(whole + where(abs(fraction) >= 0.5, sign(at), zeros({}, t)));
      }
    }
    y = at(p);
  } else {
    // PyTorch's (tri)linear weights and order: the corners with x varying fastest (north-west,
    // north-east, south-west, south-east; then the same one slice further along z), each corner's
    // weight the product of its coordinates' weights in the order x, y, z.
    std::vector<Tensor> i, low, high;
    for (int64_t j = 0; j < spatial; ++j) {
      i.push_back(padded_position(g[j], sizes[j], options));
      low.push_back(floor(i[j]));
      high.push_back(low[j] + 1.0);
    }
    for (int64_t corner = 0; corner < (int64_t{1} << spatial); ++corner) {
      std::vector<Tensor> p;
      Tensor weight;
      for (int64_t j = 0; j < spatial; ++j) {
        const bool far = (corner >> j) & 1;
        p.push_back(far ? high[j] : low[j]);
        const Tensor w = far ? i[j] - low[j] : high[j] - i[j];
        weight = j == 0 ? w : weight * w;
      }
      const Tensor term = at(p) * weight;
      y = corner == 0 ? term : y + term;
    }
  }
  // [N, points, C] -> [N, C, (D_out,) H_out, W_out]
  return cast(reshape(permute(y, {0, 2, 1}), out_shape), x.dtype());
}

namespace {

// PyTorch's linspace_from_neg_one: -1 to 1 in `steps` (computed from both ends, as its linspace
// kernel), scaled by (steps - 1) / steps without align_corners; 0 for one step.
template <typename Real>
std::vector<double> neg_one_to_one(int64_t steps, bool align_corners) {
  std::vector<double> out(static_cast<size_t>(steps), 0.0);
  if (steps <= 1) return out;
  const Real step = Real(2) / static_cast<Real>(steps - 1);
  for (int64_t i = 0; i < steps; ++i) {
    Real v = i < steps / 2 ? Real(-1) + step * static_cast<Real>(i)
                           : Real(1) - step * static_cast<Real>(steps - i - 1);
    if (!align_corners) v = v * static_cast<Real>(steps - 1) / static_cast<Real>(steps);
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

}  // namespace

Tensor affine_grid(const Tensor& theta, const Shape& size, bool align_corners, const Loc& loc) {
  CallSiteScope site(loc, composite::grid_sample);
  const char* op = "affine_grid";
  require_float(theta, op, "theta", loc);
  // Two spatial axes (theta [N, 2, 3]) or three (theta [N, 3, 4]).
  const auto spatial = static_cast<int64_t>(size.size()) - 2;
  if ((spatial != 2 && spatial != 3) || theta.dim() != 3 || theta.size(1) != spatial ||
      theta.size(2) != spatial + 1 || theta.size(0) != size[0])
    op_fail(op, loc,
            "needs theta [N, 2, 3] and a size [N, C, H, W], or theta [N, 3, 4] and a size "
            "[N, C, D, H, W], got {} and {}",
            to_string(theta.shape()), to_string(size));
  for (size_t axis = 2; axis < size.size(); ++axis)
    if (size[axis] <= 0 || size[axis] > kMaxInterpolatedAxis)
      op_fail(op, loc, "the size's spatial axes must be in [1, 2^24], got {}", to_string(size));
  const DType t = composite::statistics_type(theta.dtype());
  const Shape axes(size.begin() + 2, size.end());
  // The base grid is a host table of `points` rows of spatial + 1 doubles: refused whole, before
  // any of it is allocated, when it would not fit.
  uint64_t points = 1, bytes = 0;
  for (int64_t s : axes)
    if (__builtin_mul_overflow(points, static_cast<uint64_t>(s), &points))
      op_fail(op, loc, "a grid of size {} has more points than a 64-bit count holds",
              to_string(size));
  if (__builtin_mul_overflow(points, static_cast<uint64_t>(spatial + 1) * sizeof(double), &bytes))
    op_fail(op, loc, "a grid of size {} needs more host memory than a 64-bit count holds",
            to_string(size));
  check_memory_request(bytes, fmt::format("affine_grid's base grid of size {}", to_string(size)));
  // The base grid [D H W, 3 or 4] of (x, y[, z], 1) rows, x varying fastest: a host table kept
  // by value.
  const Tensor base = cached_constant(
      fmt::format("affine_grid {} {} {}", to_string(axes), align_corners, name(t)), [&] {
        // Each coordinate's steps: x along the last axis, y the one before[, z the first].
        std::vector<std::vector<double>> steps;
        for (int64_t j = 0; j < spatial; ++j) {
          const int64_t length = axes[static_cast<size_t>(spatial - 1 - j)];
          steps.push_back(t == f64 ? neg_one_to_one<double>(length, align_corners)
                                   : neg_one_to_one<float>(length, align_corners));
        }
        std::vector<double> rows;
        rows.reserve(bytes / sizeof(double));
        for (uint64_t point = 0; point < points; ++point) {
          auto rest = static_cast<int64_t>(point);
          for (int64_t j = 0; j < spatial; ++j) {
            const auto length = static_cast<int64_t>(steps[static_cast<size_t>(j)].size());
            rows.push_back(steps[static_cast<size_t>(j)][static_cast<size_t>(rest % length)]);
            rest /= length;
          }
          rows.push_back(1.0);
        }
        return tensor(rows, {static_cast<int64_t>(points), spatial + 1}, t);
      });
  // [D H W, 4] @ theta^T [N, 4, 3] -> [N, D H W, 3]
  const Tensor grid = matmul(base, cast(theta, t, loc), false, true);
  Shape grid_shape{size[0]};
  grid_shape.insert(grid_shape.end(), axes.begin(), axes.end());
  grid_shape.push_back(spatial);
  return cast(reshape(grid, grid_shape), theta.dtype());
}

}  // namespace mixtape
