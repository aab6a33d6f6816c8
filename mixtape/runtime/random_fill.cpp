// mixtape/runtime/random_fill.cpp -- vectorized f32/f16/bf16 fills of the Philox rand and randn
// streams.

// Every value must come out bit for bit the same from the vector loop, its scalar remainder and
// each target clone: CMakeLists.txt builds with -ffp-contract=off, so no a * b + c becomes an FMA.

#include "mixtape/runtime/random_fill.h"

#include <algorithm>
#include <bit>
#include <cmath>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/half.h"

namespace mixtape {
namespace {

// Blocks (of four elements) per kernel call: the words of a chunk stay in L1, and threads
// split a large draw on chunk boundaries.
constexpr int64_t kChunkBlocks = 128;
constexpr int64_t kChunkElements = 4 * kChunkBlocks;
// A chunk takes about a microsecond; below two per thread a fork does not pay for itself.
constexpr int64_t kParallelChunks = 4;

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define MIXTAPE_RANDOM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MIXTAPE_RANDOM_CLONES
#endif
#define MIXTAPE_RANDOM_INLINE [[gnu::always_inline]] inline

// Philox4x32-10 (dsl/random.h) of counters first .. first + n - 1 (high counter words 0), one
// block per lane: the four output words go to separate arrays so the loop vectorizes.
MIXTAPE_RANDOM_INLINE void philox_blocks(uint64_t first, uint64_t key, int64_t n,
                                         uint32_t* __restrict w0, uint32_t* __restrict w1,
                                         uint32_t* __restrict w2, uint32_t* __restrict w3) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t k0[10], k1[10];
  k0[0] = static_cast<uint32_t>(key);
  k1[0] = static_cast<uint32_t>(key >> 32);
  for (int round = 1; round < 10; ++round) {
    k0[round] = k0[round - 1] + kWeyl0;
    k1[round] = k1[round - 1] + kWeyl1;
  }
  const uint32_t first_lo = static_cast<uint32_t>(first),
                 first_hi = static_cast<uint32_t>(first >> 32);
  for (int64_t j = 0; j < n; ++j) {
    uint32_t c0 = first_lo + static_cast<uint32_t>(j);
    uint32_t c1 = first_hi + (c0 < first_lo ? 1u : 0u);  // the carry into the counter's high word
    uint32_t c2 = 0, c3 = 0;
#pragma GCC unroll 10
    for (int round = 0; round < 10; ++round) {
      uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
      uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
      uint32_t next0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0[round];
      uint32_t next2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1[round];
      c1 = static_cast<uint32_t>(p1);
      c3 = static_cast<uint32_t>(p0);
      c0 = next0;
      c2 = next2;
    }
    w0[j] = c0;
    w1[j] = c1;
    w2[j] = c2;
    w3[j] = c3;
  }
}

// The top 24 bits of a word times 2^-24: exact, through int32 so it converts in one instruction.
MIXTAPE_RANDOM_INLINE float top24_unit(uint32_t word) {
  return static_cast<float>(static_cast<int32_t>(word >> 8)) * 0x1p-24f;
}

// ln x for positive normal x (FreeBSD's e_logf.c, as in musl): x = 2^k m with m in
// [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s) with s = f / (2 + f), f = m - 1 (exact). Within 1 ulp.
MIXTAPE_RANDOM_INLINE float log_poly(float x) {
  constexpr float kLn2Hi = 6.9313812256e-01f;  // 0x3f317180: k * kLn2Hi is exact
  constexpr float kLn2Lo = 9.0580006145e-06f;  // 0x3717f7d1
  constexpr float kLg1 = 0xaaaaaa.0p-24f, kLg2 = 0xccce13.0p-25f;
  constexpr float kLg3 = 0x91e9ee.0p-25f, kLg4 = 0xf89e26.0p-26f;
  // Shifting the bits by 1 - sqrt(1/2) moves the exponent boundary to sqrt(1/2).
  uint32_t bits = std::bit_cast<uint32_t>(x) + (0x3f800000u - 0x3f3504f3u);
  int32_t k = static_cast<int32_t>(bits >> 23) - 0x7f;
  float m = std::bit_cast<float>((bits & 0x007fffffu) + 0x3f3504f3u);
  float f = m - 1.0f;
  float s = f / (2.0f + f);
  float z = s * s;
  float w = z * z;
  float t1 = w * (kLg2 + w * kLg4);
  float t2 = z * (kLg1 + w * kLg3);
  float r = t2 + t1;
  float half_f_squared = 0.5f * f * f;
  float dk = static_cast<float>(k);
  return s * (half_f_squared + r) + dk * kLn2Lo - half_f_squared + f + dk * kLn2Hi;
}

// sin and cos of 2 pi k 2^-24 = (pi/2) (q + f), within 1.25 ulp. The quadrant q (the top 2 of
// k's 24 bits) and f (the low 22, times 2^-22) are exact, so there is no range-reduction error;
// f above 1/2 is reflected to 1 - f (exact too), so the polynomials (Taylor series of sin and
// cos (pi/2 t), truncated below 0.05 ulp) only see t in [0, 1/2] and keep relative accuracy
// near every zero.
MIXTAPE_RANDOM_INLINE void sincos_poly(uint32_t k, float& sin_out, float& cos_out) {
  constexpr float kS1Rest = 0.0707963267948966192f;  // pi/2 - 1.5: 1.5 t is exact
  constexpr float kS3 = -0.645964097506246254f, kS5 = 0.0796926262461670451f;
  constexpr float kS7 = -0.00468175413531868810f, kS9 = 0.000160441184787359821f;
  constexpr float kC2 = -1.23370055013616983f, kC4 = 0.253669507901048014f;
  constexpr float kC6 = -0.0208634807633529609f, kC8 = 0.000919260274839426256f;
  constexpr float kC10 = -0.0000252020423730606054f;
  const uint32_t quadrant = k >> 22;
  const uint32_t fraction = k & 0x3fffffu;
  const bool reflect = fraction > 0x200000u;
  const uint32_t reduced = reflect ? 0x400000u - fraction : fraction;  // <= 2^21
  const float t = static_cast<float>(static_cast<int32_t>(reduced)) * 0x1p-22f;
  const float t2 = t * t;
  const float sin_rest = kS1Rest + t2 * (kS3 + t2 * (kS5 + t2 * (kS7 + t2 * kS9)));
  const float sin_t = 1.5f * t + t * sin_rest;
  const float cos_t = 1.0f + t2 * (kC2 + t2 * (kC4 + t2 * (kC6 + t2 * (kC8 + t2 * kC10))));
  // sin and cos of (pi/2) f, then rotated by q quarter turns.
  const float sin_f = reflect ? cos_t : sin_t, cos_f = reflect ? sin_t : cos_t;
  const bool odd = (quadrant & 1u) != 0;
  const float sin_q = odd ? cos_f : sin_f, cos_q = odd ? sin_f : cos_f;
  const uint32_t sin_sign = (quadrant >> 1) << 31;                      // q = 2, 3
  const uint32_t cos_sign = ((quadrant ^ (quadrant >> 1)) & 1u) << 31;  // q = 1, 2
  sin_out = std::bit_cast<float>(std::bit_cast<uint32_t>(sin_q) ^ sin_sign);
  cos_out = std::bit_cast<float>(std::bit_cast<uint32_t>(cos_q) ^ cos_sign);
}

// u1 = (top 24 bits + 1) * 2^-24, in (0, 1] so that its logarithm is finite.
MIXTAPE_RANDOM_INLINE float top24_unit_open(uint32_t word) {
  return static_cast<float>(static_cast<int32_t>((word >> 8) + 1u)) * 0x1p-24f;
}

// Square roots of n values (n a multiple of 4, v 16-byte aligned). GCC vectorizes sqrt only
// under -fno-math-errno (else it calls sqrtf for negative arguments), which neither the build nor
// an optimize pragma gives this file, so the loop uses SSE's sqrtps, baseline on x86-64 and
// correctly rounded like the scalar sqrt.
MIXTAPE_RANDOM_INLINE void sqrt_in_place(float* v, int64_t n) {
#if defined(__SSE__)
  for (int64_t i = 0; i < n; i += 4) _mm_store_ps(v + i, _mm_sqrt_ps(_mm_load_ps(v + i)));
#else
  for (int64_t i = 0; i < n; ++i) v[i] = std::sqrt(v[i]);
#endif
}

// Elements 4 first .. 4 (first + n) - 1 of the stream whose block b uses counter offset + b,
// for n <= kChunkBlocks.
MIXTAPE_RANDOM_CLONES void uniform_chunk(float* __restrict out, int64_t n, uint64_t seed,
                                         uint64_t counter) {
  alignas(64) uint32_t w0[kChunkBlocks], w1[kChunkBlocks], w2[kChunkBlocks], w3[kChunkBlocks];
  philox_blocks(counter, seed, n, w0, w1, w2, w3);
  for (int64_t j = 0; j < n; ++j) {
    out[4 * j] = top24_unit(w0[j]);
    out[4 * j + 1] = top24_unit(w1[j]);
    out[4 * j + 2] = top24_unit(w2[j]);
    out[4 * j + 3] = top24_unit(w3[j]);
  }
}

MIXTAPE_RANDOM_CLONES void normal_chunk(float* __restrict out, int64_t n, uint64_t seed,
                                        uint64_t counter) {
  // Blocks up to a multiple of 4 are computed (and the extra ones dropped), for sqrt_in_place.
  const int64_t padded = (n + 3) & ~int64_t{3};
  alignas(64) uint32_t w0[kChunkBlocks], w1[kChunkBlocks], w2[kChunkBlocks], w3[kChunkBlocks];
  philox_blocks(counter, seed, padded, w0, w1, w2, w3);
  // Pair 0 of each block from words 0 and 1, pair 1 from words 2 and 3.
  alignas(64) float radius[2][kChunkBlocks], sin_angle[2][kChunkBlocks], cos_angle[2][kChunkBlocks];
  for (int64_t j = 0; j < padded; ++j) {
    radius[0][j] = -2.0f * log_poly(top24_unit_open(w0[j]));
    sincos_poly(w1[j] >> 8, sin_angle[0][j], cos_angle[0][j]);
    radius[1][j] = -2.0f * log_poly(top24_unit_open(w2[j]));
    sincos_poly(w3[j] >> 8, sin_angle[1][j], cos_angle[1][j]);
  }
  sqrt_in_place(radius[0], padded);
  sqrt_in_place(radius[1], padded);
  for (int64_t j = 0; j < n; ++j) {
    out[4 * j] = radius[0][j] * cos_angle[0][j];
    out[4 * j + 1] = radius[0][j] * sin_angle[0][j];
    out[4 * j + 2] = radius[1][j] * cos_angle[1][j];
    out[4 * j + 3] = radius[1][j] * sin_angle[1][j];
  }
}

using ChunkKernel = void (*)(float*, int64_t, uint64_t, uint64_t);

// Rounds f32 values to 16-bit storage.
void store_half(DType dtype, bool below_one, const float* in, uint16_t* out, int64_t n) {
  if (dtype == DType::f16) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16_bits(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16_bits(in[i]);
  }
  if (!below_one) return;
  // Nearest rounding carries the top of [0, 1) up to 1.0 in f16/bf16; those values take the
  // largest one below 1 instead, so the stream stays in [0, 1) in every dtype.
  const uint16_t one = dtype == DType::f16 ? f32_to_f16_bits(1.0f) : f32_to_bf16_bits(1.0f);
  for (int64_t i = 0; i < n; ++i) out[i] -= out[i] == one ? 1 : 0;
}

void fill(Storage& out, ChunkKernel kernel, bool below_one, uint64_t seed, uint64_t offset) {
  const DType dtype = out.dtype;
  if (!has_random_fill(dtype)) fail("random fill: no fast stream for {} storage", name(dtype));
  const int64_t count = out.count;
  const int64_t full_blocks = count / 4;
  const int64_t chunks = (full_blocks + kChunkBlocks - 1) / kChunkBlocks;
  std::byte* data = out.host_data();
  float* f32_out = dtype == DType::f32 ? reinterpret_cast<float*>(data) : nullptr;
  uint16_t* half_out = dtype == DType::f32 ? nullptr : reinterpret_cast<uint16_t*>(data);
#pragma omp parallel for schedule(static) if (chunks >= kParallelChunks)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t first = chunk * kChunkBlocks;
    const int64_t n = std::min(kChunkBlocks, full_blocks - first);
    if (f32_out) {
      kernel(f32_out + 4 * first, n, seed, offset + static_cast<uint64_t>(first));
    } else {
      alignas(64) float staged[kChunkElements];
      kernel(staged, n, seed, offset + static_cast<uint64_t>(first));
      store_half(dtype, below_one, staged, half_out + 4 * first, 4 * n);
    }
  }
  // The last partial block is computed whole, by the same kernel, and cut.
  const int64_t rest = count - 4 * full_blocks;
  if (rest == 0) return;
  alignas(64) float staged[4];
  kernel(staged, 1, seed, offset + static_cast<uint64_t>(full_blocks));
  if (f32_out) {
    std::copy(staged, staged + rest, f32_out + 4 * full_blocks);
  } else {
    store_half(dtype, below_one, staged, half_out + 4 * full_blocks, rest);
  }
}

}  // namespace

void fill_uniform(Storage& out, uint64_t seed, uint64_t offset) {
  fill(out, uniform_chunk, /*below_one=*/true, seed, offset);
}

void fill_normal(Storage& out, uint64_t seed, uint64_t offset) {
  fill(out, normal_chunk, /*below_one=*/false, seed, offset);
}

void uniform_blocks(float* out, int64_t blocks, uint64_t seed, uint64_t counter) {
  for (int64_t done = 0; done < blocks; done += kChunkBlocks)
    uniform_chunk(out + 4 * done, std::min(kChunkBlocks, blocks - done), seed,
                  counter + static_cast<uint64_t>(done));
}

float random_fill_log(float x) { return log_poly(x); }

void random_fill_sincos(uint32_t k, float& sin_out, float& cos_out) {
  sincos_poly(k, sin_out, cos_out);
}

}  // namespace mixtape
