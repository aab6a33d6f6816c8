// mixtape/runtime/random_fill.h -- vectorized f32/f16/bf16 fills of the Philox rand and randn
// streams.
#pragma once

#include <cstdint>

#include "mixtape/dsl/node.h"

namespace mixtape {

// The streams for storage of 32 bits or fewer. One philox4x32(offset + i / 4, 0, seed) call
// serves the four elements 4b..4b+3 of block b = i / 4 (a draw of n elements uses counters
// offset .. offset + ceil(n / 4) - 1, inside the n counters its generator reserved). With w the
// top 24 bits of a word:
//   rand:  element i is w[i % 4] * 2^-24, exact in f32.
//   randn: words (0, 1) and (2, 3) are Box-Muller pairs: u1 = (w[0] + 1) * 2^-24 in (0, 1],
//          u2 = w[1] * 2^-24, r = sqrt(-2 ln u1); element 4b is r cos(2 pi u2), 4b+1 is
//          r sin(2 pi u2), and 4b+2, 4b+3 the same from words 2 and 3.
// The f32 arithmetic is fixed (ln and sincos are the polynomials below, and only correctly
// rounded IEEE operations are used), so a value depends on (seed, offset, i, dtype) alone: not
// on the tensor's size, the thread count or the CPU's vector width. f16 and bf16 round the f32
// value to nearest even; rand then takes the largest value below 1 for one that rounded up to 1.
// f64 tensors keep the one-counter-per-element streams of dsl/random.h.

/// Whether fill_uniform and fill_normal handle storage of this dtype (f32, f16, bf16).
constexpr bool has_random_fill(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

/// Writes elements [0, out.count) of the uniform [0, 1) stream (seed, offset) into `out`.
void fill_uniform(Storage& out, uint64_t seed, uint64_t offset);
/// Writes elements [0, out.count) of the standard normal stream (seed, offset) into `out`.
void fill_normal(Storage& out, uint64_t seed, uint64_t offset);

/// The f32 uniform stream's blocks counter .. counter + blocks - 1 of `seed` (four elements each,
/// as fill_uniform computes them) into out[0 .. 4 blocks): a stream's elements from any block on,
/// for kernels that draw their own (fused attention's dropout).
void uniform_blocks(float* out, int64_t blocks, uint64_t seed, uint64_t counter);

/// ln x in f32 for positive normal x, within 1 ulp: the logarithm fill_normal uses.
float random_fill_log(float x);
/// sin and cos of 2 pi k 2^-24 for k < 2^24, within 1.25 ulp: the rotation fill_normal uses.
void random_fill_sincos(uint32_t k, float& sin_out, float& cos_out);

}  // namespace mixtape
