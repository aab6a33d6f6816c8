// mixtape/runtime/conv.h -- CPU convolutions through oneDNN's convolution primitives (weight
// gradients with few output positions as im2col and a GEMM; taps that only ever cover padding cut
// off): forward, input gradient and weight gradient, f32 and bf16 operands (f16, and bf16 at some
// shapes, widened exactly to f32), f32 accumulation.
#pragma once

#include <cstdint>
#include <string>

#include "mixtape/dsl/conv.h"
#include "mixtape/dsl/dtype.h"
#include "mixtape/runtime/gemm.h"

namespace mixtape {

/// One of the three convolution primitives (dsl/ops.def), in oneDNN's terms: forward propagation,
/// backward data, backward weights.
struct ConvDesc {
  OpCode op = OpCode::Conv2d;  // Conv2d, Conv2dInputGrad or Conv2dWeightGrad
  ConvGeometry geometry{};
  DType operand = f32;  // both inputs: f32, bf16 or f16
  DType out = f32;      // the result: f32, bf16 or f16, rounded once from the f32 sum
  // bf16 operands: oneDNN's bf16 kernel (native) or widened exactly to f32 (runtime/gemm.h's
  // Bf16Kernel); automatic picks by shape (conv.cpp).
  Bf16Kernel bf16_kernel = Bf16Kernel::automatic;
  // The padding at the bottom and right where it differs from geometry.window.pad's (the top and
  // left): conv.cpp's problems with their outer taps cut off. -1: the same as the top and left.
  int64_t pad_end[2] = {-1, -1};
};

/// False for dtypes oneDNN cannot take (f64, integers) and empty problems; the caller then uses
/// the reference loops.
bool conv_supported(const ConvDesc& desc);

/// Runs the primitive on dense NCHW activations and [O, C / groups, KH, KW] weights: Conv2d
/// (a = x, b = w, out = y), Conv2dInputGrad (a = dy, b = w, out = dx), Conv2dWeightGrad (a = x,
/// b = dy, out = dw). Safe to call from several threads. Throws mt::Error naming the problem for
/// an unsupported description or a oneDNN failure.
void conv(const ConvDesc& desc, const void* a, const void* b, void* out);

/// Which kernel `conv(desc, ...)` runs, in oneDNN's names: "jit:avx512_core_amx_bf16", "bf16
/// widened to f32, jit:avx512_core", or "im2col, oneDNN f32 brg:avx512_core" for a weight gradient
/// run as a GEMM, after "taps 1..2 of 3 x 1..2 of 3, " where the outer taps that never reach the
/// input are cut off; also logged under MIXTAPE_LOG=profile the first time each distinct problem
/// runs.
std::string conv_kernel(const ConvDesc& desc);

}  // namespace mixtape
