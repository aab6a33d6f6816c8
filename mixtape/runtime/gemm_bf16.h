// mixtape/runtime/gemm_bf16.h -- mixtape's own AVX512-BF16 matmul for small and shallow bf16
// products, and the measured speed of bf16 dot products against f32 FMAs that decides where bf16
// stays bf16.
#pragma once

#include <cstdint>

namespace mixtape {

/// Whether this CPU (and its OS) can run gemm_bf16_own: AVX512F, AVX512BW and AVX512-BF16.
bool gemm_bf16_own_available();

/// How many times the f32 FMA rate this core multiplies and adds bf16 pairs with VDPBF16PS, in
/// flops, measured once per process (a few ms, interleaved bursts, best of each): about 2 on AMD
/// Zen 4, about 0.5 on Intel CPUs without AMX. 0 where the CPU lacks AVX512-BF16.
double bf16_dot_speed_over_f32();

/// out[b] = act(a[b] @ b[b] (+ bias)) for every batch index, bf16 operands. a is [batch, m, k]
/// row-major, or [batch, k, m] when transpose_a; b is [batch, k, n], or [batch, n, k] when
/// transpose_b; bias (f32, n values, or null) is added to every row. `out` is f32, or bf16 when
/// bf16_out: the f32 result rounded as dsl/half.h's f32_to_bf16_bits rounds (nearest even, NaNs
/// quieted), in registers, without an f32 pass through memory. With relu, act is the reference's
/// relu (x for x > 0 and NaN, +0 otherwise), applied before the rounding. With team, blocks of 64
/// rows (of every batch) are shared out among the OpenMP team; else all run on the calling thread.
/// Either way every element is computed alike. With round_product, acc is rounded to bf16 (as
/// f32_to_bf16_bits rounds) before the bias is added: a fused Linear whose matmul is stored bf16.
///
/// The exact result, bit for bit, whatever the shape and the alignment (tests/test_gemm.cpp checks
/// it against a scalar model): k is padded with one zero to an even length kp, and each element is
///   acc = +0
///   for p in 0 .. kp/2 - 1:
///     acc = ftz(round(acc + daz(a[2p+1]) * daz(b[2p+1])))
///     acc = ftz(round(acc + daz(a[2p]) * daz(b[2p])))
///   out = bias ? acc + bias[j] : acc                       (an ordinary f32 add)
///         (acc rounded to bf16 first with round_product)
/// which is VDPBF16PS's definition: daz turns a subnormal bf16 operand into a zero of its sign,
/// each multiply-add is rounded once to nearest even in f32 (the product itself is exact, so a
/// product below 2^-126 still counts), and ftz turns an f32 subnormal sum into a zero of its sign.
/// Values in the normal range are summed like an f32 loop in that order (the odd element of each
/// pair first); the reference executor's f64 sums differ by f32 rounding only.
void gemm_bf16_own(int64_t batch, int64_t m, int64_t n, int64_t k, bool transpose_a,
                   bool transpose_b, const uint16_t* a, const uint16_t* b, const float* bias,
                   void* out, bool bf16_out = false, bool relu = false, bool team = false,
                   bool round_product = false);

}  // namespace mixtape
