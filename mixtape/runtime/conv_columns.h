// mixtape/runtime/conv_columns.h -- the operands of a convolution's weight gradient run as a GEMM:
// the batch axis moved last, and im2col over it.
#pragma once

#include <cstdint>

#include "mixtape/dsl/conv.h"

namespace mixtape {

/// out [rows, batch] = in [batch, rows] transposed: NCHW activations (or gradients) with the
/// batch axis last, [c, h, w, n], so that one position of one channel is a contiguous run over
/// the batch. T holds the elements' bits: float, or uint16_t for bf16 and f16. Split over the
/// OpenMP team when `team`.
template <typename T>
void batch_last(const T* in, int64_t batch, int64_t rows, T* out, bool team);

/// Fills columns [c kh kw, oh ow n] from x_t [c, h w, n] (batch_last of dense NCHW x, groups 1):
/// row (c, ky, kx) holds, for every output position and image in that order, the input value
/// tap (ky, kx) of channel c reads there, and zero where it reads padding. This is im2col with
/// its axes swapped and the batch innermost, so that each row is a sequence of whole runs of
/// x_t copied or zeroed, one per output position, whatever the stride, padding or dilation (with
/// the batch outermost, ResNet-18's 2x2 and 4x4 planes made runs of 2-4 elements). Rows are
/// shared out among the OpenMP team when `team`.
template <typename T>
void gather_columns(const ConvGeometry& g, const T* x_t, T* columns, bool team);

}  // namespace mixtape
