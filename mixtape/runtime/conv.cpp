// mixtape/runtime/conv.cpp -- the CPU convolution back end: oneDNN convolution primitives, cached
// per problem, with the reorders between our plain layouts and the blocked ones oneDNN picks.
#include "mixtape/runtime/conv.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/log.h"
#include "mixtape/runtime/conv_columns.h"
#include "mixtape/runtime/gemm.h"
#include "mixtape/runtime/half_convert.h"
#include "mixtape/runtime/onednn_team.h"
#include "mixtape/runtime/scratch_buffer.h"

// Choices:
// - Formats are left to oneDNN (format_tag::any): its direct convolutions run on blocked layouts
//   (nChw16c, OIhw16i16o), several times faster than on plain NCHW. Operands are reordered into
//   them and the result out of them on every call; the reorders are a few memory passes next to
//   a convolution's k-fold reuse of each element.
// - The result is always f32, rounded here to a half output with dsl/half.h's rounding, as gemm.cpp
//   does: one rounding path for both half types, and the same bits as the reference's one
//   rounding of the f32 sum.
// - f16 operands are widened to f32, exactly (oneDNN 2.6 has no f16 convolution on the CPU). bf16
//   operands go to oneDNN's bf16 kernels (AVX512-BF16 dot products or AMX tiles), which accumulate
//   in f32 and flush subnormal operands, as its bf16 matmul; or, at the shapes where those lose
//   to the f32 kernels (kWidenBf16*), are widened to f32 as f16 is (Bf16Kernel, as gemm.h's).
// - Weight gradients with few output positions per image are an im2col and one mt::gemm instead
//   of oneDNN's direct kernel (kGemmWeightGradMaxPositions).
// - Padding on the right equals the padding on the left, as PyTorch passes it: oneDNN then checks
//   that the output size is the floor of (padded - extent) / stride + 1, which the shapes have.
// - The algorithm is convolution_direct: Winograd would change the numerics.
// - Problems below kSingleThreadMaxFlops run on the calling thread alone, as gemm.cpp's small
//   products do: digits_cnn's 64x16x8x8 3x3 convolution took 170 us on one thread and 6 ms on a
//   team of two sharing a core with a compiler. The choice depends on the problem only, and the
//   primitive is made under it too (oneDNN plans its work split when it makes one), so a shape
//   always runs the same kernel and gives the same bits.

namespace mixtape {
namespace {

using OnednnType = dnnl::memory::data_type;
using Tag = dnnl::memory::format_tag;
using Dims = dnnl::memory::dims;

constexpr double kSingleThreadMaxFlops = double{1 << 24};

// Bf16Kernel::automatic widens bf16 operands to f32 where oneDNN 2.6's AMX kernels lose to its
// f32 ones (bench_conv at ResNet-18's shapes, one thread): the forward pass and input gradient at
// one output position per image (ResNet-18's last stage at 32x32 inputs: 4-7x faster widened),
// and the weight gradient at this few input channels (the stem's, c = 3: 2x).
constexpr int64_t kWidenBf16MaxPositions = 1;
constexpr int64_t kWidenBf16WeightGradMaxChannels = 4;

// Weight gradients at this many output positions per image or fewer run as one GEMM over the
// gathered input windows (im2col) instead of oneDNN's direct kernel, which at such shapes spends
// its time on the filter's many outputs with a reduction of only n * oh * ow terms each:
// ResNet-18's last stage (512 channels, 1x1 outputs) took 12 ms in f32 and 24 ms in bf16 per call,
// 15-17% of its training step; the GEMM [o, n oh ow] x [n oh ow, c kh kw] takes about a tenth of
// that. With bf16 operands the GEMM also wins at 4x4 outputs (bench_conv at ResNet-18's 8x8
// inputs, stride 2, and 4x4 inputs, AMD EPYC Zen 5, two threads: 0.18 -> 0.45-0.51 of the bf16
// peak for the 3x3 filter, 0.13 -> 0.35 for the 1x1 one, 0.2-0.45 -> 0.37-0.48 at 4x4 stride 1),
// though not at 8x8 (0.48-0.51 direct, 0.34-0.37 as a GEMM); in f32 it does not at 4x4. With the
// batch axis last in the gather (runtime/conv_columns.h; session 32, best of 4 runs, two threads):
// 4x4 stride 1, 128 channels, 0.66-0.69 of the peak; 2x2, 256 channels, 0.73-0.75; 8x8, 64
// channels, still behind (0.46 against 0.55 direct); f32 at 4x4 level with the direct kernel or
// behind.
constexpr int64_t kGemmWeightGradMaxPositions = 4;
constexpr int64_t kGemmWeightGradMaxPositionsBf16 = 16;

struct ConvKey {
  OpCode op;
  ConvGeometry geometry;
  int64_t pad_end[2];
  OnednnType operand;
  auto operator<=>(const ConvKey&) const = default;
};

// One argument as we hold it (plain layout) and as the primitive takes it.
struct Argument {
  int role = 0;  // DNNL_ARG_*
  dnnl::memory::desc plain, primitive;
  std::optional<dnnl::reorder> reorder;  // plain -> primitive for inputs, back for the result
};

struct CachedConv {
  dnnl::primitive primitive;
  Argument a, b, out;
  dnnl::memory::desc scratchpad;
  std::string implementation;
};

struct Backend {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;  // guards cache
  std::map<ConvKey, std::shared_ptr<const CachedConv>> cache;
  std::set<ConvKey> logged_gemms;  // problems run as a GEMM whose choice has been logged
};

// Never destroyed: oneDNN's own globals may be gone by the time static destructors run.
Backend& backend() {
  static Backend* const instance = new Backend;
  return *instance;
}

struct ThreadScratch {
  ScratchBuffer widened_a, widened_b, reordered_a, reordered_b, result, plain_result, onednn;
  ScratchBuffer dy_t, x_t, columns;  // a weight gradient or a one-pixel window as a GEMM
  ScratchBuffer cropped_weights, cropped_result;  // a problem with its outer taps cut off
  void trim() {
    for (ScratchBuffer* buffer :
         {&widened_a, &widened_b, &reordered_a, &reordered_b, &result, &plain_result, &onednn,
          &dy_t, &x_t, &columns, &cropped_weights, &cropped_result})
      buffer->trim();
  }
};
ThreadScratch& thread_scratch() {
  thread_local ThreadScratch scratch;
  return scratch;
}

// The padding after the input along axis 0 (rows) or 1 (columns).
int64_t pad_end(const ConvDesc& d, int axis) {
  return d.pad_end[axis] >= 0 ? d.pad_end[axis] : d.geometry.window.pad[axis];
}

std::string describe(const ConvDesc& d) {
  std::string text = d.geometry.describe(d.op);
  if (pad_end(d, 0) != d.geometry.window.pad[0] || pad_end(d, 1) != d.geometry.window.pad[1])
    text += fmt::format(", padding after ({}, {})", pad_end(d, 0), pad_end(d, 1));
  return text + fmt::format(", operands {}, result {}", name(d.operand), name(d.out));
}

// Whether bf16 operands are widened to f32 (the products are exact in f32, so only the order of
// the f32 sums and the flushing of subnormals differ from the native kernel). See kWidenBf16.
bool widens_bf16(const ConvDesc& d) {
  if (d.operand != bf16) return false;
  switch (d.bf16_kernel) {
    case Bf16Kernel::own:  // gemm's own kernel has no convolution: oneDNN's bf16 one, as native
    case Bf16Kernel::native:
      return false;
    case Bf16Kernel::widened:
      return true;
    case Bf16Kernel::automatic:
      break;
  }
  // Without AVX-512 (an AVX2 EPYC) oneDNN 2.6 has no bf16 convolution, as it has no bf16 matmul.
  if (!gemm_bf16_native_available()) return true;
  const ConvGeometry& g = d.geometry;
  return d.op == OpCode::Conv2dWeightGrad ? g.c / g.window.groups <= kWidenBf16WeightGradMaxChannels
                                          : g.oh * g.ow <= kWidenBf16MaxPositions;
}

// Whether a weight gradient runs as im2col and one GEMM (see kGemmWeightGradMaxPositions).
bool weight_grad_as_gemm(const ConvDesc& d) {
  const ConvGeometry& g = d.geometry;
  return d.op == OpCode::Conv2dWeightGrad && g.window.groups == 1 &&
         g.oh * g.ow <=
             (d.operand == bf16 ? kGemmWeightGradMaxPositionsBf16 : kGemmWeightGradMaxPositions);
}

// The GEMM kernel a convolution run as a GEMM asks for: Bf16Kernel::own names oneDNN's bf16
// convolution here (widens_bf16), not gemm's own kernel, so it asks for oneDNN's bf16 matmul.
Bf16Kernel gemm_kernel_of(const ConvDesc& d) {
  return d.bf16_kernel == Bf16Kernel::own ? Bf16Kernel::native : d.bf16_kernel;
}

// dw [o, c kh kw] = dy_t [o, oh ow n] x columns [c kh kw, oh ow n]^T, the batch axis last in both
// (runtime/conv_columns.h). (dw^T = columns x dy_t^T, computed in f32 and transposed, measured
// level with it where o is 64 and behind it elsewhere.)
GemmDesc weight_grad_gemm_desc(const ConvDesc& d) {
  const ConvGeometry& g = d.geometry;
  return GemmDesc{.m = g.o,
                  .n = g.c * g.kh * g.kw,
                  .k = g.n * g.oh * g.ow,
                  .transpose_b = true,
                  .operand = d.operand,
                  .out = d.out,
                  .bf16_kernel = gemm_kernel_of(d)};
}

// The type oneDNN computes in: bf16, or f32 for f32, f16 and widened bf16 operands.
OnednnType onednn_operand(const ConvDesc& d) {
  return d.operand == bf16 && !widens_bf16(d) ? OnednnType::bf16 : OnednnType::f32;
}

ConvKey key_of(const ConvDesc& d) {
  return {d.op, d.geometry, {pad_end(d, 0), pad_end(d, 1)}, onednn_operand(d)};
}

bool runs_on_team(const ConvKey& key) {
  const ConvGeometry& g = key.geometry;
  const double flops =
      2.0 * static_cast<double>(g.n) * static_cast<double>(g.o) * static_cast<double>(g.oh * g.ow) *
      static_cast<double>(g.c / g.window.groups) * static_cast<double>(g.kh * g.kw);
  return flops >= kSingleThreadMaxFlops;
}

// The weight gradient as a GEMM: the operands gathered in their own type (16-bit ones stay 16-bit,
// and the GEMM multiplies them as runtime/gemm.h does), the result rounded once to d.out.
template <typename T>
void weight_grad_gemm(const ConvDesc& d, const void* x, const void* dy, void* out) {
  const ConvGeometry& g = d.geometry;
  const GemmDesc desc = weight_grad_gemm_desc(d);
  const bool team = runs_on_team(key_of(d));
  ThreadScratch& scratch = thread_scratch();
  T* dy_t = scratch.dy_t.get<T>(desc.m * desc.k);
  T* x_t = scratch.x_t.get<T>(g.n * g.c * g.h * g.w);
  T* columns = scratch.columns.get<T>(desc.n * desc.k);
  batch_last(static_cast<const T*>(dy), g.n, g.o * g.oh * g.ow, dy_t, team);
  batch_last(static_cast<const T*>(x), g.n, g.c * g.h * g.w, x_t, team);
  gather_columns(g, x_t, columns, team);
  gemm(desc, dy_t, columns, out);
}

std::shared_ptr<const CachedConv> create(const ConvKey& key) {
  const dnnl::engine& engine = backend().engine;
  const ConvGeometry& g = key.geometry;
  const ConvWindow& window = g.window;
  const OnednnType t = key.operand, f32 = OnednnType::f32;
  const Dims x_dims{g.n, g.c, g.h, g.w}, y_dims{g.n, g.o, g.oh, g.ow};
  const Dims w_dims = window.groups == 1 ? Dims{g.o, g.c, g.kh, g.kw}
                                         : Dims{window.groups, g.o / window.groups,
                                                g.c / window.groups, g.kh, g.kw};
  const Tag w_tag = window.groups == 1 ? Tag::oihw : Tag::goihw;
  // oneDNN counts dilation from 0 (a dense kernel has dilation 0).
  const Dims strides{window.stride[0], window.stride[1]},
      dilates{window.dil[0] - 1, window.dil[1] - 1}, padding{window.pad[0], window.pad[1]},
      padding_end{key.pad_end[0], key.pad_end[1]};
  auto any = [](const Dims& dims, OnednnType type) {
    return dnnl::memory::desc(dims, type, Tag::any);
  };
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  // The forward primitive's descriptor: the forward pass itself, and the hint both backward
  // passes need for their layouts.
  dnnl::convolution_forward::primitive_desc forward(
      dnnl::convolution_forward::desc(
          dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, any(x_dims, t),
          any(w_dims, t), any(y_dims, key.op == OpCode::Conv2d ? f32 : t), strides, dilates,
          padding, padding_end),
      attr, engine);
  auto made = std::make_shared<CachedConv>();
  auto argument = [&](int role, const Dims& dims, Tag tag, OnednnType type,
                      const dnnl::memory::desc& chosen, bool result) {
    Argument arg;
    arg.role = role;
    arg.plain = dnnl::memory::desc(dims, type, tag);
    arg.primitive = chosen;
    if (arg.plain != arg.primitive)
      arg.reorder = result ? dnnl::reorder(dnnl::reorder::primitive_desc(engine, arg.primitive,
                                                                         engine, arg.plain))
                           : dnnl::reorder(dnnl::reorder::primitive_desc(engine, arg.plain, engine,
                                                                         arg.primitive));
    return arg;
  };
  dnnl::primitive_desc_base pd = forward;
  if (key.op == OpCode::Conv2d) {
    made->primitive = dnnl::convolution_forward(forward);
    made->a = argument(DNNL_ARG_SRC, x_dims, Tag::nchw, t, forward.src_desc(), false);
    made->b = argument(DNNL_ARG_WEIGHTS, w_dims, w_tag, t, forward.weights_desc(), false);
    made->out = argument(DNNL_ARG_DST, y_dims, Tag::nchw, f32, forward.dst_desc(), true);
  } else if (key.op == OpCode::Conv2dInputGrad) {
    dnnl::convolution_backward_data::primitive_desc data(
        dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, any(x_dims, f32),
                                              any(w_dims, t), any(y_dims, t), strides, dilates,
                                              padding, padding_end),
        attr, engine, forward);
    pd = data;
    made->primitive = dnnl::convolution_backward_data(data);
    made->a = argument(DNNL_ARG_DIFF_DST, y_dims, Tag::nchw, t, data.diff_dst_desc(), false);
    made->b = argument(DNNL_ARG_WEIGHTS, w_dims, w_tag, t, data.weights_desc(), false);
    made->out = argument(DNNL_ARG_DIFF_SRC, x_dims, Tag::nchw, f32, data.diff_src_desc(), true);
  } else {
    dnnl::convolution_backward_weights::primitive_desc weights(
        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct,
                                                 any(x_dims, t), any(w_dims, f32), any(y_dims, t),
                                                 strides, dilates, padding, padding_end),
        attr, engine, forward);
    pd = weights;
    made->primitive = dnnl::convolution_backward_weights(weights);
    made->a = argument(DNNL_ARG_SRC, x_dims, Tag::nchw, t, weights.src_desc(), false);
    made->b = argument(DNNL_ARG_DIFF_DST, y_dims, Tag::nchw, t, weights.diff_dst_desc(), false);
    made->out =
        argument(DNNL_ARG_DIFF_WEIGHTS, w_dims, w_tag, f32, weights.diff_weights_desc(), true);
  }
  made->scratchpad = pd.scratchpad_desc();
  made->implementation = pd.impl_info_str();
  return made;
}

std::shared_ptr<const CachedConv> cached(const ConvDesc& d) {
  Backend& state = backend();
  const ConvKey key = key_of(d);
  {
    std::lock_guard lock(state.mutex);
    auto found = state.cache.find(key);
    if (found != state.cache.end()) return found->second;
  }
  // Made outside the lock (oneDNN JIT-compiles its kernels); a racing thread's copy is dropped.
  std::shared_ptr<const CachedConv> made;
  try {
    OnednnTeam threads(!runs_on_team(key));
    made = create(key);
  } catch (const dnnl::error& e) {
    fail("{}: oneDNN has no primitive for it: {}", describe(d), e.what());
  }
  std::lock_guard lock(state.mutex);
  auto [it, added] = state.cache.emplace(key, std::move(made));
  if (added && log_enabled("profile"))
    log_line("profile", "{}: {}oneDNN {}", describe(d),
             widens_bf16(d) ? "bf16 widened to f32, " : "", it->second->implementation);
  return it->second;
}

// An input in the operand type oneDNN gets: itself, or f16 or bf16 widened to f32.
const void* as_operand(const ConvDesc& d, const void* data, int64_t count, ScratchBuffer& scratch) {
  if (d.operand == f32 || onednn_operand(d) != OnednnType::f32) return data;
  float* widened = scratch.get<float>(count);
  if (d.operand == f16)
    widen_f16(static_cast<const uint16_t*>(data), widened, count);
  else
    widen_bf16(static_cast<const uint16_t*>(data), widened, count);
  return widened;
}

// MIXTAPE_LOG=profile: the GEMM a weight gradient runs as, once per problem (the GEMM logs its
// own kernel).
void log_gemm_choice(const ConvDesc& d, const char* how) {
  static const bool enabled = log_enabled("profile");
  if (!enabled) return;
  Backend& state = backend();
  std::lock_guard lock(state.mutex);
  if (state.logged_gemms.insert(key_of(d)).second) log_line("profile", "{}: {}", describe(d), how);
}

int64_t count_of(const dnnl::memory::desc& desc, OnednnType type) {
  return static_cast<int64_t>(desc.get_size()) / (type == OnednnType::bf16 ? 2 : 4);
}

// The taps [begin, end) of one axis of the window that cover the input (not only padding) at some
// output position: tap t reads index o * stride - pad + t * dilation at output position o.
struct TapRange {
  int64_t begin, end;
};
TapRange taps_reaching_input(int64_t size, int64_t out, int64_t kernel, int64_t stride, int64_t pad,
                             int64_t dilation) {
  TapRange range{kernel, 0};
  for (int64_t t = 0; t < kernel; ++t)
    for (int64_t o = 0; o < out; ++o)
      if (const int64_t i = o * stride - pad + t * dilation; i >= 0 && i < size) {
        range.begin = std::min(range.begin, t);
        range.end = t + 1;
        break;
      }
  return range;
}

// A problem with the outer taps that never reach the input cut off. At small images most of a
// window lies in the padding at every output position (ResNet-18's last stages at 32x32 inputs:
// 3x3 windows on 2x2 and 1x1 images), and oneDNN multiplies those zeros: at 1x1 only the centre
// tap of nine touches data. Without them the problem is the same sums, less their zero terms, on
// a smaller kernel with as much less padding before the input; the padding after it is what
// keeps the output's size (0 where no output reads it, as oneDNN's floor of the size allows).
struct Crop {
  ConvDesc cropped;
  TapRange rows, cols;
};

std::optional<Crop> crop_of(const ConvDesc& d) {
  const ConvGeometry& g = d.geometry;
  const ConvWindow& w = g.window;
  const TapRange rows = taps_reaching_input(g.h, g.oh, g.kh, w.stride[0], w.pad[0], w.dil[0]);
  const TapRange cols = taps_reaching_input(g.w, g.ow, g.kw, w.stride[1], w.pad[1], w.dil[1]);
  const bool none_reach = rows.begin >= rows.end || cols.begin >= cols.end;
  const bool all_reach = rows.end - rows.begin == g.kh && cols.end - cols.begin == g.kw;
  if (none_reach || all_reach) return std::nullopt;
  Crop crop{d, rows, cols};
  ConvGeometry& c = crop.cropped.geometry;
  c.kh = rows.end - rows.begin, c.kw = cols.end - cols.begin;
  const TapRange ranges[2] = {rows, cols};
  const int64_t sizes[2] = {g.h, g.w}, outs[2] = {g.oh, g.ow}, kernels[2] = {c.kh, c.kw};
  for (int axis = 0; axis < 2; ++axis) {
    const int64_t before = w.pad[axis] - ranges[axis].begin * w.dil[axis];
    if (before < 0) return std::nullopt;  // the first tap that reaches is past the padding
    const int64_t reach = (outs[axis] - 1) * w.stride[axis] + (kernels[axis] - 1) * w.dil[axis] + 1;
    c.window.pad[axis] = before;
    crop.cropped.pad_end[axis] = std::max<int64_t>(0, reach - sizes[axis] - before);
  }
  return crop;
}

std::string describe(const Crop& crop, const ConvGeometry& g) {
  return fmt::format("taps {}..{} of {} x {}..{} of {}", crop.rows.begin, crop.rows.end - 1, g.kh,
                     crop.cols.begin, crop.cols.end - 1, g.kw);
}

// Copies the kept taps of every plane of weights [planes, full_kh, full_kw], starting `offset`
// elements into each plane, into [planes, kh, kw] (kCut), or back (!kCut) with zeros in the
// other taps. kh and kw are std::integral_constant for the common kept sizes: with loops of one
// or two iterations the per-element index arithmetic made the copy about 5x slower, several ms a
// ResNet-18 step. Going back, each plane is zeroed just before its taps are written, so the
// full weights (9.4 MB at 512x512x3x3 in f32) are written in one pass: zeroing them all first,
// then writing the taps, made a second pass through memory (about half of the 1x1 stage's
// weight gradient, whose product is a tenth of it).
template <bool kCut, typename T, typename FullPlane, typename FullKw, typename Size>
void move_planes(int64_t planes, FullPlane full_plane, FullKw full_kw, int64_t offset, Size kh,
                 Size kw, const T* from, T* to) {
  for (int64_t p = 0; p < planes; ++p) {
    const int64_t full = p * full_plane + offset, kept = p * kh * kw;
    if constexpr (!kCut) std::fill_n(to + p * full_plane, full_plane, T{0});
    for (int64_t y = 0; y < kh; ++y)
      for (int64_t x = 0; x < kw; ++x) {
        if constexpr (kCut)
          to[kept + y * kw + x] = from[full + y * full_kw + x];
        else
          to[full + y * full_kw + x] = from[kept + y * kw + x];
      }
  }
}

// Copies the kept taps of weights [o, c, kh, kw] (cut = true) into [o, c, kh', kw'], or back into
// the full window with zeros elsewhere (cut = false). T: the elements' bits.
template <typename T>
void move_taps(const ConvGeometry& g, const Crop& crop, const T* from, T* to, bool cut) {
  const int64_t planes = g.o * (g.c / g.window.groups);
  const int64_t kh = crop.rows.end - crop.rows.begin, kw = crop.cols.end - crop.cols.begin;
  const int64_t offset = crop.rows.begin * g.kw + crop.cols.begin;
  // The full window's sizes as constants too where it is 3x3 (ResNet's), for the zeroing.
  auto move_in = [&](auto full_plane, auto full_kw, auto rows, auto cols) {
    if (cut)
      move_planes<true>(planes, full_plane, full_kw, offset, rows, cols, from, to);
    else
      move_planes<false>(planes, full_plane, full_kw, offset, rows, cols, from, to);
  };
  auto move = [&](auto rows, auto cols) {
    if (g.kh == 3 && g.kw == 3)
      move_in(std::integral_constant<int64_t, 9>{}, std::integral_constant<int64_t, 3>{}, rows,
              cols);
    else
      move_in(g.kh * g.kw, g.kw, rows, cols);
  };
  using One = std::integral_constant<int64_t, 1>;
  using Two = std::integral_constant<int64_t, 2>;
  if (kh == 1 && kw == 1)
    move(One{}, One{});
  else if (kh == 2 && kw == 2)
    move(Two{}, Two{});
  else
    move(kh, kw);
}

void move_taps(const ConvGeometry& g, const Crop& crop, DType type, const void* from, void* to,
               bool cut) {
  if (type == f32)
    move_taps(g, crop, static_cast<const uint32_t*>(from), static_cast<uint32_t*>(to), cut);
  else
    move_taps(g, crop, static_cast<const uint16_t*>(from), static_cast<uint16_t*>(to), cut);
}

int64_t element_bytes(DType type) { return type == f32 ? 4 : 2; }

// A window that covers the whole unpadded image, one output position (a 3x3 window on
// ResNet-18's last stages once its taps are cut: 1x1 on 1x1 images, or 2x2 on 2x2 at stride 2):
// the convolution is a matrix product over the batch, y [n, o] = x [n, k] w [o, k]^T with k = c *
// kh * kw (x and w flatten in the same (c, ky, kx) order), which runs without the layout reorders
// that are most of oneDNN's convolution time at this size. The product for each primitive, or
// nothing for other problems.
std::optional<GemmDesc> as_matrix_product(const ConvDesc& d) {
  const ConvGeometry& g = d.geometry;
  const ConvWindow& w = g.window;
  const bool whole_image = w.groups == 1 && g.kh == g.h && g.kw == g.w && g.oh == 1 && g.ow == 1 &&
                           w.pad[0] == 0 && w.pad[1] == 0 && (g.kh == 1 || w.dil[0] == 1) &&
                           (g.kw == 1 || w.dil[1] == 1);
  if (!whole_image) return std::nullopt;
  const int64_t k = g.c * g.kh * g.kw;
  GemmDesc product{.operand = d.operand, .out = d.out, .bf16_kernel = gemm_kernel_of(d)};
  if (d.op == OpCode::Conv2d)  // a = x [n, k], b = w [o, k]
    product.m = g.n, product.n = g.o, product.k = k, product.transpose_b = true;
  else if (d.op == OpCode::Conv2dInputGrad)  // a = dy [n, o], b = w [o, k]
    product.m = g.n, product.n = k, product.k = g.o;
  else  // a = x [n, k], b = dy [n, o]: dw [o, k] = dy^T x
    product.m = g.o, product.n = k, product.k = g.n, product.transpose_a = true;
  return product;
}

// A 1x1 window without padding at a stride that leaves one output position (ResNet-18's last
// shortcut at 32x32 inputs: 2x2 images to 1x1) reads one pixel of each image, the first: the
// forward pass is the GEMM y [n, o] = x' [n, c] w [o, c]^T over those pixels, and the input
// gradient dx' [n, c] = dy [n, o] w [o, c] put back on them (every other pixel's gradient is
// zero). oneDNN's 1x1 kernel (bf16 widened) ran these at 0.1-0.3 of the peak, 0.45-0.73 as
// GEMMs (bench_conv, two threads). With more outputs a gather, a GEMM and a transpose measured
// level with it at 2x2 and behind it at 4x4 (0.28 against 0.54 in f32).
std::optional<GemmDesc> one_pixel_product(const ConvDesc& d) {
  const ConvGeometry& g = d.geometry;
  const ConvWindow& w = g.window;
  const bool one_pixel = (d.op == OpCode::Conv2d || d.op == OpCode::Conv2dInputGrad) &&
                         w.groups == 1 && g.kh == 1 && g.kw == 1 && w.pad[0] == 0 &&
                         w.pad[1] == 0 && g.oh == 1 && g.ow == 1 && g.h * g.w > 1;
  if (!one_pixel) return std::nullopt;
  GemmDesc product{.m = g.n, .operand = d.operand, .out = d.out, .bf16_kernel = gemm_kernel_of(d)};
  if (d.op == OpCode::Conv2d)  // a = x' [n, c], b = w [o, c]
    product.n = g.o, product.k = g.c, product.transpose_b = true;
  else  // a = dy [n, o], b = w [o, c]
    product.n = g.c, product.k = g.o;
  return product;
}

// one_pixel_product's convolution; T and Out hold the operands' and the result's bits.
template <typename T, typename Out>
void one_pixel_conv(const ConvDesc& d, const GemmDesc& product, const T* a, const T* b, Out* out) {
  const ConvGeometry& g = d.geometry;
  const int64_t plane = g.h * g.w, pixels = g.n * g.c;
  ThreadScratch& scratch = thread_scratch();
  if (d.op == OpCode::Conv2d) {
    T* first = scratch.columns.get<T>(pixels);
    for (int64_t i = 0; i < pixels; ++i) first[i] = a[i * plane];
    return gemm(product, first, b, out);
  }
  Out* result = scratch.columns.get<Out>(pixels);
  gemm(product, a, b, result);
  std::fill_n(out, pixels * plane, Out{});
  for (int64_t i = 0; i < pixels; ++i) out[i * plane] = result[i];
}

void one_pixel_conv(const ConvDesc& d, const GemmDesc& product, const void* a, const void* b,
                    void* out) {
  auto run = [&](auto operand_bits, auto out_bits) {
    using T = decltype(operand_bits);
    using Out = decltype(out_bits);
    one_pixel_conv(d, product, static_cast<const T*>(a), static_cast<const T*>(b),
                   static_cast<Out*>(out));
  };
  if (d.operand == f32)
    d.out == f32 ? run(uint32_t{}, uint32_t{}) : run(uint32_t{}, uint16_t{});
  else
    d.out == f32 ? run(uint16_t{}, uint32_t{}) : run(uint16_t{}, uint16_t{});
}

void run_onednn(const ConvDesc& d, const void* a, const void* b, void* out);

// conv() with its workspace kept until the outermost call returns (a cropped problem runs this
// again on its caller's buffers).
void conv_keeping_scratch(const ConvDesc& d, const void* a, const void* b, void* out) {
  if (std::optional<Crop> crop = crop_of(d)) {
    // The weights are b for the forward pass and the input gradient, the result for the weight
    // gradient (whose cut-off taps are exact zeros: they multiply only padding).
    const ConvGeometry& g = d.geometry;
    ThreadScratch& scratch = thread_scratch();
    const ConvGeometry& c = crop->cropped.geometry;
    const int64_t kept = g.o * (g.c / g.window.groups) * c.kh * c.kw;
    if (d.op == OpCode::Conv2dWeightGrad) {
      void* cropped = scratch.cropped_result.get<std::byte>(kept * element_bytes(d.out));
      conv_keeping_scratch(crop->cropped, a, b, cropped);
      move_taps(g, *crop, d.out, cropped, out, false);
    } else {
      void* cropped = scratch.cropped_weights.get<std::byte>(kept * element_bytes(d.operand));
      move_taps(g, *crop, d.operand, b, cropped, true);
      conv_keeping_scratch(crop->cropped, a, cropped, out);
    }
    return;
  }
  if (std::optional<GemmDesc> product = as_matrix_product(d)) {
    log_gemm_choice(d, "one GEMM");
    if (d.op == OpCode::Conv2dWeightGrad) return gemm(*product, b, a, out);
    return gemm(*product, a, b, out);
  }
  if (std::optional<GemmDesc> product = one_pixel_product(d)) {
    log_gemm_choice(d, "the one pixel it reads, a GEMM");
    return one_pixel_conv(d, *product, a, b, out);
  }
  // The im2col GEMM multiplies the zeros it gathers for padding by dy, so an infinite dy would make
  // NaN of the taps the reference (and oneDNN's direct kernel) skip: such a gradient goes to
  // oneDNN.
  const ConvGeometry& g = d.geometry;
  if (weight_grad_as_gemm(d) && all_finite(b, g.n * g.o * g.oh * g.ow, d.operand)) {
    log_gemm_choice(d, "im2col and a GEMM");
    return d.operand == f32 ? weight_grad_gemm<float>(d, a, b, out)
                            : weight_grad_gemm<uint16_t>(d, a, b, out);
  }
  run_onednn(d, a, b, out);
}

}  // namespace

bool conv_supported(const ConvDesc& d) {
  auto ok = [](DType t) { return t == f32 || t == bf16 || t == f16; };
  const ConvGeometry& g = d.geometry;
  return ok(d.operand) && ok(d.out) && g.n > 0 && g.c > 0 && g.o > 0 && g.h > 0 && g.w > 0 &&
         g.oh > 0 && g.ow > 0;
}

std::string conv_kernel(const ConvDesc& d) {
  if (!conv_supported(d)) fail("{}: not a problem oneDNN can run", describe(d));
  if (std::optional<Crop> crop = crop_of(d))
    return describe(*crop, d.geometry) + ", " + conv_kernel(crop->cropped);
  if (std::optional<GemmDesc> product = as_matrix_product(d))
    return "one GEMM, " + gemm_kernel(*product);
  if (std::optional<GemmDesc> product = one_pixel_product(d))
    return "the one pixel it reads, " + gemm_kernel(*product);
  if (weight_grad_as_gemm(d)) return "im2col, " + gemm_kernel(weight_grad_gemm_desc(d));
  const std::string& implementation = cached(d)->implementation;
  return widens_bf16(d) ? "bf16 widened to f32, " + implementation : implementation;
}

void conv(const ConvDesc& d, const void* a, const void* b, void* out) {
  if (!conv_supported(d)) fail("{}: not a problem oneDNN can run", describe(d));
  struct Trim {  // see ScratchBuffer::trim
    ~Trim() { thread_scratch().trim(); }
  } trim_on_return;
  if (a == nullptr || b == nullptr || out == nullptr) fail("{}: a null pointer", describe(d));
  conv_keeping_scratch(d, a, b, out);
}

namespace {

// The problem on oneDNN's convolution primitive, reordering into and out of its layouts.
void run_onednn(const ConvDesc& d, const void* a, const void* b, void* out) {
  const std::shared_ptr<const CachedConv> conv = cached(d);
  const dnnl::engine& engine = backend().engine;
  // One stream per thread: oneDNN does not promise that a stream may be used concurrently.
  thread_local dnnl::stream stream(engine);
  ThreadScratch& scratch = thread_scratch();
  const OnednnType t = onednn_operand(d);
  OnednnTeam threads(!runs_on_team(key_of(d)));
  try {
    // Inputs: widened if f16, then reordered into the primitive's layout if it differs.
    auto input = [&](const Argument& arg, const void* data, ScratchBuffer& widened,
                     ScratchBuffer& reordered) {
      const void* plain = as_operand(d, data, count_of(arg.plain, t), widened);
      dnnl::memory source(arg.plain, engine, const_cast<void*>(plain));
      if (!arg.reorder) return source;
      dnnl::memory target(arg.primitive, engine,
                          reordered.get<std::byte>(static_cast<int64_t>(arg.primitive.get_size())));
      arg.reorder->execute(stream, source, target);
      return target;
    };
    std::unordered_map<int, dnnl::memory> args;
    args.emplace(conv->a.role, input(conv->a, a, scratch.widened_a, scratch.reordered_a));
    args.emplace(conv->b.role, input(conv->b, b, scratch.widened_b, scratch.reordered_b));
    // The f32 result: straight into `out` when it is f32 and plain, else through scratch.
    const Argument& res = conv->out;
    const int64_t count = count_of(res.plain, OnednnType::f32);
    float* plain_result =
        d.out == f32 ? static_cast<float*>(out) : scratch.plain_result.get<float>(count);
    dnnl::memory plain(res.plain, engine, plain_result);
    dnnl::memory result =
        res.reorder
            ? dnnl::memory(
                  res.primitive, engine,
                  scratch.result.get<std::byte>(static_cast<int64_t>(res.primitive.get_size())))
            : plain;
    args.emplace(res.role, result);
    if (conv->scratchpad.get_size() > 0)
      args.emplace(DNNL_ARG_SCRATCHPAD,
                   dnnl::memory(conv->scratchpad, engine,
                                scratch.onednn.get<std::byte>(
                                    static_cast<int64_t>(conv->scratchpad.get_size()))));
    conv->primitive.execute(stream, args);
    if (res.reorder) res.reorder->execute(stream, result, plain);
    stream.wait();
    if (d.out == bf16)
      narrow_to_bf16(plain_result, static_cast<uint16_t*>(out), count);
    else if (d.out == f16)
      narrow_to_f16(plain_result, static_cast<uint16_t*>(out), count);
  } catch (const dnnl::error& e) {
    fail("{}: oneDNN failed: {}", describe(d), e.what());
  }
}

}  // namespace

}  // namespace mixtape
