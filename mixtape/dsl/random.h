// mixtape/dsl/random.h -- Philox4x32-10, the counter-based generator behind rand, randn and
// dropout.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

namespace mixtape {

/// Philox4x32 with 10 rounds (Salmon et al., SC'11): four random 32-bit words for a 128-bit
/// counter under a 64-bit key. Stateless, so element i of any stream is computable alone.
inline std::array<uint32_t, 4> philox4x32(uint64_t counter_lo, uint64_t counter_hi, uint64_t key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

/// 53 random bits from two words: a whole number in [0, 2^53).
inline uint64_t top53(uint32_t high, uint32_t low) {
  return (static_cast<uint64_t>(high) << 21) | (low >> 11);
}

/// Element `index` of the uniform [0, 1) stream (seed, offset) of f64 tensors, with 53 random
/// bits, as torch's f64 draws: every double k / 2^53. (f32, f16 and bf16 tensors draw four
/// elements per counter with 24 bits each: runtime/random_fill.h.)
inline double philox_uniform(uint64_t seed, uint64_t offset, uint64_t index) {
  auto w = philox4x32(offset + index, 0, seed);
  return static_cast<double>(top53(w[0], w[1])) * 0x1.0p-53;
}

/// Element `index` of the standard normal stream (seed, offset) of f64 tensors, by Box-Muller
/// on two 53-bit uniforms (tails out to |z| = 8.57).
inline double philox_normal(uint64_t seed, uint64_t offset, uint64_t index) {
  auto w = philox4x32(offset + index, 0, seed);
  double u1 = (static_cast<double>(top53(w[0], w[1])) + 1.0) * 0x1.0p-53;  // (0, 1]: finite log
  double u2 = static_cast<double>(top53(w[2], w[3])) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace mixtape
