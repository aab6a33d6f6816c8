// mixtape/runtime/cuda_fixed_kernels.h -- hand-written CUDA kernels for the ops without a kernel-IR
// form (data movement, random fills), so that their values stay in device memory.
#pragma once

#include <string>

#include "mixtape/dsl/node.h"
#include "mixtape/runtime/cuda_driver.h"

namespace mixtape {

/// The CUDA C++ of the fixed kernels (the emitted kernels' prelude first): box copies for
/// 1/2/4/8-byte elements, row gathers, row sums in the reference's order and rounding, direct
/// 2-d convolutions (forward and both gradients) with the reference's sums, max pooling and its
/// gradient with the reference's picks and sums, the
/// f32/f16/bf16 rand and randn streams of runtime/random_fill.h, and conversions between f32, f16
/// and bf16 (convert_on_device).
std::string cuda_fixed_kernels_source();

/// The fixed kernels come from `module` (an AOT artifact's, compiled from
/// cuda_fixed_kernels_source() with its other kernels) instead of NVRTC: the first module given
/// before their first use serves the process (every module holds the same kernels).
void use_prebuilt_fixed_kernels(cuda::CUmodule module);

/// Runs `node` on the GPU when it is a Concat, Unslice, IndexSelect, IndexAdd, RandUniform,
/// RandNormal, one of the three convolution primitives, MaxPool2d / MaxPool2dGrad, or Attention /
/// AttentionBackward (runtime/cuda_attention.h) of dtypes these kernels cover, its inputs' values
/// there or uploaded. False, with nothing done, otherwise (the executor then runs it on the
/// host). The results are the bits the reference computes, but for attention's (f32 sums of
/// their own order). Indices are checked on the host first,
/// as the reference checks them: an index computed on the device is downloaded for that.
bool run_fixed_kernel(Node& node);

/// out[i] = pieces[i] + pieces[width + i] + ... over `processes` pieces of `width` elements of
/// out's dtype, added left to right in `accum` (f32, f64, or i64 for integers) and rounded once:
/// runtime/all_reduce.h's rank-order sum, with the host's bits, queued on the compute stream.
void add_pieces_on_device(Storage& pieces, int processes, int64_t width, DType accum, Storage& out);

}  // namespace mixtape
