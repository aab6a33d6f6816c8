// mixtape/runtime/half_convert.cpp -- bulk f32 <-> f16 / bf16 conversions, compiled twice: for the
// build's baseline and for x86-64-v4 (AVX-512), chosen by the CPU at run time.
#include "mixtape/runtime/half_convert.h"

#include <atomic>
#include <bit>
#include <string>
#include <vector>

#include <omp.h>

#include "mixtape/dsl/half.h"
#include "mixtape/runtime/cpu_features.h"

namespace mixtape {
namespace {

// f16 <-> f32 as bitwise selects between constant shifts, instead of dsl/half.h's branches,
// countl_zero and variable shifts, so that the loops vectorize (with SSE2 already). Both are
// bit-identical to dsl/half.h: widening checked for all 2^16 inputs by the tests, narrowing for all
// 2^32 inputs once by hand and for a sample by the tests.

// c ? a : b without a branch: GCC will not if-convert a ?: whose arms hold float math (it might
// trap), and a branch stops vectorization.
[[gnu::always_inline]] inline uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// The reference's relu: x for x > 0 and NaN, +0 otherwise (-0 included).
[[gnu::always_inline]] inline float reference_relu(float x) {
  return std::bit_cast<float>(select_bits(!(x <= 0.0f), std::bit_cast<uint32_t>(x), 0u));
}

[[gnu::always_inline]] inline float f16_bits_to_f32_vectorizable(uint16_t bits) {
  const uint32_t sign = (static_cast<uint32_t>(bits) & 0x8000u) << 16;
  const uint32_t em = bits & 0x7FFFu;
  const uint32_t normal = (em << 13) + 0x38000000u;   // rebias the exponent, 15 -> 127
  const uint32_t special = (em << 13) | 0x7F800000u;  // inf, or NaN with its payload
  // A subnormal (or zero) f16 is em * 2^-24; both factors and the product are exact f32s (the
  // signed conversion because SSE2 has no unsigned one).
  const float scaled = static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f;
  const uint32_t subnormal = std::bit_cast<uint32_t>(scaled);
  const uint32_t magnitude =
      select_bits(em >= 0x7C00u, special, select_bits(em >= 0x0400u, normal, subnormal));
  return std::bit_cast<float>(sign | magnitude);
}

[[gnu::always_inline]] inline uint16_t f32_to_f16_bits_vectorizable(float x) {
  const uint32_t f = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7FFFFFFFu;
  const uint32_t nan = 0x7E00u | ((a >> 13) & 0x3FFu);  // quiet, with the top payload bits
  // Normal results as in dsl/half.h: rebias, round away 13 bits; the clamp makes overflow inf.
  const uint32_t n = (a < 0x47800000u ? a : 0x47800000u) - 0x38000000u;
  const uint32_t normal = (n + 0x0FFFu + ((n >> 13) & 1u)) >> 13;
  // Subnormal results (|x| < 2^-14): in 0.5 + |x| the f32 ulp is 2^-24, the f16 subnormal step, so
  // the add rounds |x| to nearest even in units of 2^-24, which land in the low bits. This needs
  // the default round-to-nearest mode; DAZ/FTZ cannot matter (f32 subnormals give 0 either way).
  const uint32_t subnormal = std::bit_cast<uint32_t>(std::bit_cast<float>(a) + 0.5f) - 0x3F000000u;
  const uint32_t magnitude =
      select_bits(a > 0x7F800000u, nan, select_bits(a >= 0x38800000u, normal, subnormal));
  return static_cast<uint16_t>(sign | magnitude);
}

// The loop bodies, written once and inlined into each instruction set's functions below.
[[gnu::always_inline]] inline void widen_f16_loop(const uint16_t* __restrict in,
                                                  float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = f16_bits_to_f32_vectorizable(in[i]);
}
[[gnu::always_inline]] inline void widen_bf16_loop(const uint16_t* __restrict in,
                                                   float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_f32(in[i]);
}
[[gnu::always_inline]] inline void narrow_f16_loop(const float* __restrict in,
                                                   uint16_t* __restrict out, int64_t n, bool relu) {
  if (relu)
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16_bits_vectorizable(reference_relu(in[i]));
  else
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16_bits_vectorizable(in[i]);
}
[[gnu::always_inline]] inline void narrow_bf16_loop(const float* __restrict in,
                                                    uint16_t* __restrict out, int64_t n,
                                                    bool relu) {
  if (relu)
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16_bits(reference_relu(in[i]));
  else
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16_bits(in[i]);
}
[[gnu::always_inline]] inline void relu_loop(float* __restrict values, int64_t n) {
  for (int64_t i = 0; i < n; ++i) values[i] = reference_relu(values[i]);
}

// One instruction set's loops over a range [0, n) of already-offset pointers.
struct Loops {
  void (*widen_f16)(const uint16_t*, float*, int64_t);
  void (*widen_bf16)(const uint16_t*, float*, int64_t);
  void (*narrow_f16)(const float*, uint16_t*, int64_t, bool);
  void (*narrow_bf16)(const float*, uint16_t*, int64_t, bool);
  void (*relu)(float*, int64_t);
  const char* isa;
};

constexpr Loops baseline_loops{
    [](const uint16_t* in, float* out, int64_t n) { widen_f16_loop(in, out, n); },
    [](const uint16_t* in, float* out, int64_t n) { widen_bf16_loop(in, out, n); },
    [](const float* in, uint16_t* out, int64_t n, bool relu) { narrow_f16_loop(in, out, n, relu); },
    [](const float* in, uint16_t* out, int64_t n, bool relu) {
      narrow_bf16_loop(in, out, n, relu);
    },
    [](float* values, int64_t n) { relu_loop(values, n); },
    "baseline"};

#if defined(__x86_64__)
// The library is built for baseline x86-64 (SSE2), where these loops take about 0.5 ns an
// element; compiled for x86-64-v4 they run on 512-bit vectors, 5-10x faster. The same inline
// bodies give the same bits: they are integer operations and one exactly rounded f32 add.
#define MIXTAPE_V4 [[gnu::target("arch=x86-64-v4")]]
MIXTAPE_V4 void widen_f16_v4(const uint16_t* in, float* out, int64_t n) {
  widen_f16_loop(in, out, n);
}
MIXTAPE_V4 void widen_bf16_v4(const uint16_t* in, float* out, int64_t n) {
  widen_bf16_loop(in, out, n);
}
MIXTAPE_V4 void narrow_f16_v4(const float* in, uint16_t* out, int64_t n, bool relu) {
  narrow_f16_loop(in, out, n, relu);
}
MIXTAPE_V4 void narrow_bf16_v4(const float* in, uint16_t* out, int64_t n, bool relu) {
  narrow_bf16_loop(in, out, n, relu);
}
MIXTAPE_V4 void relu_v4(float* values, int64_t n) { relu_loop(values, n); }
#undef MIXTAPE_V4

constexpr Loops v4_loops{widen_f16_v4,   widen_bf16_v4, narrow_f16_v4,
                         narrow_bf16_v4, relu_v4,       "x86-64-v4"};
#endif

std::atomic<bool> force_baseline{false};

const Loops& loops() {
#if defined(__x86_64__)
  if (cpu_runs_x86_64_v4() && !force_baseline.load(std::memory_order_relaxed)) return v4_loops;
#endif
  return baseline_loops;
}

// Runs body(begin, end) over [0, count): whole on the calling thread for small counts, else one
// contiguous share per member of the OpenMP team (the shares a static loop schedule gives, as
// a parallel matmul's row blocks are).
template <typename Body>
void split(int64_t count, Body body, ConvertThreads threads = ConvertThreads::automatic) {
  if (threads == ConvertThreads::automatic && count < kParallelConversionMinimum) {
    body(int64_t{0}, count);
    return;
  }
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    body(count * t / n, count * (t + 1) / n);
  }
}

}  // namespace

void widen_f16(const uint16_t* bits, float* out, int64_t count) {
  auto loop = loops().widen_f16;
  split(count, [=](int64_t b, int64_t e) { loop(bits + b, out + b, e - b); });
}

void widen_bf16(const uint16_t* bits, float* out, int64_t count) {
  auto loop = loops().widen_bf16;
  split(count, [=](int64_t b, int64_t e) { loop(bits + b, out + b, e - b); });
}

void narrow_to_f16(const float* in, uint16_t* bits, int64_t count, bool relu,
                   ConvertThreads threads) {
  auto loop = loops().narrow_f16;
  split(
      count, [=](int64_t b, int64_t e) { loop(in + b, bits + b, e - b, relu); }, threads);
}

void narrow_to_bf16(const float* in, uint16_t* bits, int64_t count, bool relu,
                    ConvertThreads threads) {
  auto loop = loops().narrow_bf16;
  split(
      count, [=](int64_t b, int64_t e) { loop(in + b, bits + b, e - b, relu); }, threads);
}

void relu_in_place(float* values, int64_t count, ConvertThreads threads) {
  auto loop = loops().relu;
  split(
      count, [=](int64_t b, int64_t e) { loop(values + b, e - b); }, threads);
}

const char* half_convert_isa() { return loops().isa; }

void half_convert_force_baseline(bool force) { force_baseline.store(force); }

}  // namespace mixtape
