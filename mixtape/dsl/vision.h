// mixtape/dsl/vision.h -- image ops: max pooling (two primitives) and, as DSL composites, average
// pooling, batch/group/instance norm, interpolate and channel dropout, with
// torch.nn.functional's names, defaults and semantics.
#pragma once

#include <optional>

#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/selection.h"

namespace mixtape {

/// Pooling over the last two axes of an NCHW (or CHW) input, as torch.nn.functional's.
/// The result's shape per axis is floor((in + 2 pad - dilation (k - 1) - 1) / stride) + 1, or the
/// ceiling with ceil_mode (where a last window starting in the right padding is dropped).
/// `stride` defaults to the kernel. The padding may be at most half the (dilated) kernel.
/// max_pool2d is the MaxPool2d primitive below: its gradient goes to the first maximum of each
/// window in row-major window order (PyTorch's), not shared among ties, and a NaN propagates.
Tensor max_pool2d(const Tensor& x, Size2 kernel, std::optional<Size2> stride = std::nullopt,
                  Size2 padding = 0, Size2 dilation = 1, bool ceil_mode = false,
                  const Loc& loc = Loc::current());
/// max_pool2d with return_indices: also each window's pick, as the flat index h W + w in its
/// input plane (i64), PyTorch's (what max_unpool2d reads).
ValuesIndices max_pool2d_with_indices(const Tensor& x, Size2 kernel,
                                      std::optional<Size2> stride = std::nullopt, Size2 padding = 0,
                                      Size2 dilation = 1, bool ceil_mode = false,
                                      const Loc& loc = Loc::current());
/// torch.nn.functional.max_unpool2d: each value of x [N, C, h, w] (or CHW) written at its index
/// of a zero plane of output_size (by default (h - 1) stride - 2 padding + kernel per axis), the
/// gradient read back from there.
Tensor max_unpool2d(const Tensor& x, const Tensor& indices, Size2 kernel,
                    std::optional<Size2> stride = std::nullopt, Size2 padding = 0,
                    std::optional<Size2> output_size = std::nullopt,
                    const Loc& loc = Loc::current());
/// The max-pooling primitives' window (dsl/attrs.def's `window` attribute of MaxPool2d and
/// MaxPool2dGrad): per spatial axis the kernel, stride, padding and dilation.
struct PoolWindow {
  int64_t kernel[2] = {1, 1}, stride[2] = {1, 1}, pad[2] = {0, 0}, dil[2] = {1, 1};
  Ints attr() const;
  static PoolWindow from(const Ints& attr);
};
/// The sizes of one max pooling x [n, c, h, w] -> y [n, c, oh, ow], read from a MaxPool2d (x ->
/// y) or MaxPool2dGrad ((x, gy) -> gx) node.
struct PoolGeometry {
  int64_t n, c, h, w, oh, ow;
  PoolWindow window;
  static PoolGeometry of(const Node& node);
};
/// The primitives max_pool2d is made of (x NCHW; `output` the spatial size, which ceil_mode
/// decides). Each window's maximum is PyTorch's: scanned in row-major window order over the taps
/// inside the input, a tap taken when greater than the maximum so far or NaN (so a NaN
/// propagates, the last NaN of a window being its pick); a window of only -inf picks its first
/// tap inside the input. max_pool2d_grad(x, gy) adds each gy to x's position of its window's pick,
/// summed per position in output order in f32 (f64 for f64) and rounded once: x's shape.
Tensor max_pool2d_forward(const Tensor& x, const PoolWindow& window, Size2 output,
                          const Loc& loc = Loc::current());
Tensor max_pool2d_grad(const Tensor& x, const Tensor& grad_out, const PoolWindow& window,
                       const Loc& loc = Loc::current());
namespace detail {
/// The gradient of max_pool2d_grad with respect to gy: each window's value of `g` (x's shape) at
/// the window's pick (the primitives' rule), a composite of strided slices.
Tensor max_pool2d_pick(const Tensor& x, const Tensor& g, const PoolWindow& window, Size2 output);
}  // namespace detail

/// The mean of each window; with count_include_pad the padding's zeros count in the divisor,
/// without it only the input's elements do (a window cut by ceil_mode counts only what it covers,
/// as PyTorch's).
Tensor avg_pool2d(const Tensor& x, Size2 kernel, std::optional<Size2> stride = std::nullopt,
                  Size2 padding = 0, bool ceil_mode = false, bool count_include_pad = true,
                  const Loc& loc = Loc::current());
/// The mean over windows [floor(i H / out), ceil((i + 1) H / out)) along each axis, PyTorch's.
Tensor adaptive_avg_pool2d(const Tensor& x, Size2 output_size, const Loc& loc = Loc::current());
/// The maximum over adaptive_avg_pool2d's windows, through the MaxPool2d primitive: its
/// gradient goes to each window's first maximum in row-major order (the last NaN), PyTorch's.
Tensor adaptive_max_pool2d(const Tensor& x, Size2 output_size, const Loc& loc = Loc::current());

/// Pooling over the last axis of an NCL (or CL) input, as torch.nn.functional's max_pool1d,
/// avg_pool1d, adaptive_avg_pool1d and adaptive_max_pool1d: the 2-d poolings over a height of one
/// (their windows, ties, NaN and divisors), the length axis checked as theirs.
Tensor max_pool1d(const Tensor& x, int64_t kernel, std::optional<int64_t> stride = std::nullopt,
                  int64_t padding = 0, int64_t dilation = 1, bool ceil_mode = false,
                  const Loc& loc = Loc::current());
/// max_pool1d with return_indices: also each pick's position along the line (i64).
ValuesIndices max_pool1d_with_indices(const Tensor& x, int64_t kernel,
                                      std::optional<int64_t> stride = std::nullopt,
                                      int64_t padding = 0, int64_t dilation = 1,
                                      bool ceil_mode = false, const Loc& loc = Loc::current());
/// torch.nn.functional.max_unpool1d: max_unpool2d's rule along the line.
Tensor max_unpool1d(const Tensor& x, const Tensor& indices, int64_t kernel,
                    std::optional<int64_t> stride = std::nullopt, int64_t padding = 0,
                    std::optional<int64_t> output_size = std::nullopt,
                    const Loc& loc = Loc::current());
Tensor avg_pool1d(const Tensor& x, int64_t kernel, std::optional<int64_t> stride = std::nullopt,
                  int64_t padding = 0, bool ceil_mode = false, bool count_include_pad = true,
                  const Loc& loc = Loc::current());
Tensor adaptive_avg_pool1d(const Tensor& x, int64_t output_size, const Loc& loc = Loc::current());
Tensor adaptive_max_pool1d(const Tensor& x, int64_t output_size, const Loc& loc = Loc::current());
/// Pooling over the last three axes of an NCDHW (or CDHW) input, as torch.nn.functional's
/// max_pool3d, avg_pool3d, adaptive_avg_pool3d and adaptive_max_pool3d: each axis sized and
/// checked as the 2-d ones' (depth, height, width). Separable, over the 2-d pooling: each depth
/// slice pooled over height and width, then windows of depth. The maximum is PyTorch's: the
/// first in (depth, height, width) order takes the gradient (a NaN, the last); the means count
/// the padding as avg_pool2d does, per axis. A 16-bit input is pooled in f32 where a second
/// pass would round its sums again, and the result rounded once.
Tensor max_pool3d(const Tensor& x, Size3 kernel, std::optional<Size3> stride = std::nullopt,
                  Size3 padding = 0, Size3 dilation = 1, bool ceil_mode = false,
                  const Loc& loc = Loc::current());
/// max_pool3d with return_indices: also each pick's flat index d H W + h W + w in its input
/// volume (i64), PyTorch's (what max_unpool3d reads).
ValuesIndices max_pool3d_with_indices(const Tensor& x, Size3 kernel,
                                      std::optional<Size3> stride = std::nullopt, Size3 padding = 0,
                                      Size3 dilation = 1, bool ceil_mode = false,
                                      const Loc& loc = Loc::current());
/// torch.nn.functional.max_unpool3d: max_unpool2d's rule over a volume.
Tensor max_unpool3d(const Tensor& x, const Tensor& indices, Size3 kernel,
                    std::optional<Size3> stride = std::nullopt, Size3 padding = 0,
                    std::optional<Size3> output_size = std::nullopt,
                    const Loc& loc = Loc::current());
Tensor avg_pool3d(const Tensor& x, Size3 kernel, std::optional<Size3> stride = std::nullopt,
                  Size3 padding = 0, bool ceil_mode = false, bool count_include_pad = true,
                  const Loc& loc = Loc::current());
Tensor adaptive_avg_pool3d(const Tensor& x, Size3 output_size, const Loc& loc = Loc::current());
Tensor adaptive_max_pool3d(const Tensor& x, Size3 output_size, const Loc& loc = Loc::current());
/// torch.nn.functional.unfold (im2col): x [N, C, H, W] (or [C, H, W]) -> [N, C kh kw, L], each
/// column one block of the sliding window (L blocks in row-major order, rows channel-major then
/// kernel row and column), the blocks placed as conv2d's windows with the same arguments.
Tensor unfold(const Tensor& x, Size2 kernel_size, Size2 dilation = 1, Size2 padding = 0,
              Size2 stride = 1, const Loc& loc = Loc::current());
/// torch.nn.functional.fold (col2im), unfold's adjoint: x [N, C kh kw, L] (or unbatched) ->
/// [N, C, output_size], each block's values added at its place (a 16-bit input summed in f32,
/// rounded once); the padding is cut off.
Tensor fold(const Tensor& x, Size2 output_size, Size2 kernel_size, Size2 dilation = 1,
            Size2 padding = 0, Size2 stride = 1, const Loc& loc = Loc::current());

/// torch.nn.functional.batch_norm over [N, C, ...] (statistics per channel C, over every other
/// axis). Training uses the batch's statistics (the biased variance to normalize) and, where the
/// running buffers are defined, updates them with Tensor::assign_later (in the step's next
/// evaluation) as running = (1 - momentum) running + momentum batch (the unbiased variance for
/// running_var), so that mt::compile replays the update. Eval uses the running statistics. The
/// statistics are computed in f32 whatever the input's type and policy (f64 stays f64), the result
/// has x's type. weight and bias ([C]) may be undefined.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                  const Tensor& weight, const Tensor& bias, bool training, double momentum = 0.1,
                  double eps = 1e-5, const Loc& loc = Loc::current());
namespace detail {
/// batch_norm as the BatchNorm modules run it: also counts the batch in `num_batches_tracked`
/// (i64 0-d, may be undefined) in the same evaluation as the running statistics, and momentum
/// nullopt is the cumulative average (factor 1 / num_batches_tracked, a graph value).
Tensor batch_norm_tracked(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                          const Tensor& num_batches_tracked, const Tensor& weight,
                          const Tensor& bias, bool training, std::optional<double> momentum,
                          double eps, const Loc& loc);
}  // namespace detail
/// Normalizes each of `groups` groups of channels of [N, C, ...] over its channels and the other
/// axes, then applies the per-channel weight and bias ([C], optional); statistics in f32.
Tensor group_norm(const Tensor& x, int64_t groups, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5,
                  const Loc& loc = Loc::current());
/// Each (sample, channel) normalized over its spatial axes (torch's instance_norm without running
/// statistics, the default of its modules): group_norm with one channel per group.
Tensor instance_norm(const Tensor& x, const Tensor& weight = Tensor(),
                     const Tensor& bias = Tensor(), double eps = 1e-5,
                     const Loc& loc = Loc::current());

namespace detail {
/// instance_norm as the InstanceNorm modules run it (torch.nn.functional.instance_norm): with
/// `use_input_stats`, each (sample, channel) normalized by its own statistics and, where the
/// running buffers are defined, those updated (in the step's next evaluation, as batch norm's)
/// by `momentum` towards the batch's mean of the instances' means and unbiased variances; else
/// normalized by the running statistics.
Tensor instance_norm_tracked(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                             const Tensor& weight, const Tensor& bias, bool use_input_stats,
                             double momentum, double eps, const Loc& loc);
}  // namespace detail
/// torch.nn.functional.prelu: max(0, x) + weight min(0, x), weight [1] (shared) or [C] (per
/// channel, axis 1 of x, or of a 1-d x's only axis). A low-precision op under autocast, as
/// PyTorch's lists have it.
Tensor prelu(const Tensor& x, const Tensor& weight, const Loc& loc = Loc::current());
/// torch.nn.functional.interpolate's modes, each for the inputs PyTorch takes: Linear [N, C, L],
/// Bilinear and Bicubic [N, C, H, W], Trilinear [N, C, D, H, W]; Nearest, NearestExact
/// ("nearest-exact": output o reads floor((o + 1/2) scale), the pixel centers' nearest) and Area
/// (adaptive average pooling to the output size) any of the three.
enum class InterpolateMode { Nearest, Bilinear, Bicubic, Linear, Trilinear, NearestExact, Area };
struct InterpolateOptions {
  std::vector<int64_t> size{};         // the output's spatial sizes, or
  std::vector<double> scale_factor{};  // a factor per spatial axis (one for all)
  InterpolateMode mode = InterpolateMode::Nearest;
  // The linear modes and bicubic: the corner pixels' centers map onto each other.
  bool align_corners = false;
};
/// torch.nn.functional.interpolate of [N, C, ...spatial] (1 to 3 spatial axes, as the mode
/// takes), with PyTorch's source-index formulas (a given scale_factor is used for the
/// mapping, as PyTorch does without recompute_scale_factor). Bicubic is PyTorch's: Keys' cubic
/// convolution with A = -0.75 over four taps per axis, the edge repeated past the border,
/// without antialiasing (so it overshoots, as PyTorch's does).
Tensor interpolate(const Tensor& x, const InterpolateOptions& options,
                   const Loc& loc = Loc::current());

enum class GridSampleMode { Bilinear, Nearest, Bicubic };
enum class GridPadding { Zeros, Border, Reflection };
struct GridSampleOptions {
  GridSampleMode mode = GridSampleMode::Bilinear;
  GridPadding padding_mode = GridPadding::Zeros;  // what a point outside the input reads
  bool align_corners = false;  // -1 and 1 are the corner pixels' centers (else their edges)
};
/// torch.nn.functional.grid_sample: x [N, C, H, W] read at grid [N, H_out, W_out, 2]'s (x, y)
/// points, -1 to 1 across the input's width and height -> [N, C, H_out, W_out]; or x
/// [N, C, D, H, W] at grid [N, D_out, H_out, W_out, 3]'s (x, y, z) points -> [N, C, D_out, H_out,
/// W_out] (bilinear is then trilinear, over 8 corners). With PyTorch's unnormalization, padding
/// modes and weights (bicubic, 2-d only as PyTorch's: its cubic convolution over 16 taps,
/// A = -0.75, each tap moved by the padding mode); differentiable in x and in the grid (bilinear,
/// bicubic). Computed in f32 (f64 for f64) whatever the policy, as PyTorch's autocast
/// runs grid_sampler, and returned in x's type.
Tensor grid_sample(const Tensor& x, const Tensor& grid, const GridSampleOptions& options = {},
                   const Loc& loc = Loc::current());
/// torch.nn.functional.affine_grid: the grid [N, H, W, 2] that theta [N, 2, 3] maps the output's
/// normalized (x, y, 1) to, for grid_sample into an output of `size` [N, C, H, W]; or the grid
/// [N, D, H, W, 3] of theta [N, 3, 4] and (x, y, z, 1), for a `size` [N, C, D, H, W]. In
/// f32 (f64 for f64) whatever the policy (PyTorch's autocast would run its bmm in the half type,
/// which moves bilinear samples by up to 1/256 of the image).
Tensor affine_grid(const Tensor& theta, const Shape& size, bool align_corners = false,
                   const Loc& loc = Loc::current());

/// torch.nn.functional.pixel_shuffle: [*, C r^2, H, W] -> [*, C, H r, W r], each group of r^2
/// channels spread over an r x r block (sub-pixel convolution's upscaling).
Tensor pixel_shuffle(const Tensor& x, int64_t upscale_factor, const Loc& loc = Loc::current());
/// Its inverse, torch.nn.functional.pixel_unshuffle: [*, C, H r, W r] -> [*, C r^2, H, W].
Tensor pixel_unshuffle(const Tensor& x, int64_t downscale_factor, const Loc& loc = Loc::current());

/// Zeroes whole channels of [N, C, ...] with probability p and scales the rest by 1/(1-p) when
/// training, as torch's dropout2d.
Tensor dropout2d(const Tensor& x, double p, bool training = true, Generator* gen = nullptr,
                 const Loc& loc = Loc::current());
/// torch.nn.functional.dropout3d: dropout2d's channels of [N, C, D, H, W], or of an unbatched
/// [C, D, H, W].
Tensor dropout3d(const Tensor& x, double p, bool training = true, Generator* gen = nullptr,
                 const Loc& loc = Loc::current());

}  // namespace mixtape
