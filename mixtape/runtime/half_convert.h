// mixtape/runtime/half_convert.h -- bulk f32 <-> f16 / bf16 conversions (and a matmul epilogue's
// relu): vectorized for the CPU, OpenMP-parallel when large, bit-identical to dsl/half.h.
#pragma once

#include <cstdint>

namespace mixtape {

/// Below this many elements a conversion (or a copy like it) runs on the calling thread: waking
/// the OpenMP team costs microseconds on an idle machine and milliseconds on a loaded one, where
/// a spinning or descheduled team member stalls the region. (AVX-512 loops convert about 16
/// elements a nanosecond from cache; the baseline ones about 2.)
constexpr int64_t kParallelConversionMinimum = int64_t{1} << 18;

/// Where a conversion runs. `automatic`: large counts on the OpenMP team, small ones on the
/// calling thread. `team`: on the team whatever the count, for data the team has just written
/// (a parallel matmul's result), whose shares already sit in each member's cache.
enum class ConvertThreads { automatic, team };

/// Every conversion gives dsl/half.h's bits for every input (NaN payloads included). `bits` point
/// to raw 16-bit f16 / bf16 storage; the ranges must not overlap.
void widen_f16(const uint16_t* bits, float* out, int64_t count);
void widen_bf16(const uint16_t* bits, float* out, int64_t count);
/// With `relu`, each value first goes through the reference's relu (x for x > 0 and for NaN, +0
/// otherwise, -0 included): a matmul's fused epilogue.
void narrow_to_f16(const float* in, uint16_t* bits, int64_t count, bool relu = false,
                   ConvertThreads threads = ConvertThreads::automatic);
void narrow_to_bf16(const float* in, uint16_t* bits, int64_t count, bool relu = false,
                    ConvertThreads threads = ConvertThreads::automatic);
/// The same relu on f32 values in place: the epilogue of a matmul with an f32 result.
void relu_in_place(float* values, int64_t count,
                   ConvertThreads threads = ConvertThreads::automatic);

/// The instruction set the loops run with: "x86-64-v4" (AVX-512 on 512-bit vectors) where the CPU
/// and the operating system support it, else "baseline" (the build's own target, SSE2 on x86-64).
const char* half_convert_isa();

/// For tests: run the baseline loops even on an AVX-512 CPU (true), or choose by CPU again.
void half_convert_force_baseline(bool force);

}  // namespace mixtape
