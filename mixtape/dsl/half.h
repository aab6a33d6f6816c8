// mixtape/dsl/half.h -- exact IEEE conversions between f32 and the f16 / bf16 storage formats.
#pragma once

#include <bit>
#include <cstdint>

namespace mixtape {

// Everything here is integer bit manipulation rather than F16C/AVX-512 intrinsics, so results do
// not depend on the CPU, on MXCSR rounding or flush-to-zero modes, or on compiler flags, and every
// function works in constant expressions.

/// f32 -> IEEE binary16, rounding to nearest-even. Subnormal results are produced exactly, finite
/// values >= 65520 become inf, and a NaN stays a quiet NaN with its sign and top 10 payload bits.
inline constexpr uint16_t f32_to_f16_bits(float x) {
  const uint32_t f = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) {
    // Setting the quiet bit keeps a NaN whose payload sits only in the low 13 bits from turning
    // into inf once those bits are dropped.
    const uint32_t special = a == 0x7F800000u ? 0x7C00u : 0x7E00u | ((a >> 13) & 0x3FFu);
    return static_cast<uint16_t>(sign | special);
  }
  if (a >= 0x38800000u) {  // |x| >= 2^-14, the smallest normal f16
    // Rebias the exponent (127 -> 15) and round away 13 mantissa bits. A carry out of the mantissa
    // bumps the exponent, which is exactly right; clamping at 2^16 makes every finite overflow
    // carry into the inf encoding 0x7C00 (65520, halfway above 65504, is the first to get there).
    const uint32_t n = (a < 0x47800000u ? a : 0x47800000u) - 0x38000000u;
    return static_cast<uint16_t>(sign | ((n + 0x0FFFu + ((n >> 13) & 1u)) >> 13));
  }
  // Subnormal result: |x| in units of 2^-24 is the 24-bit significand shifted right by 126 - e.
  // Shifts past 25 all give 0, so clamping at 31 keeps the shift defined and also covers zero and
  // f32 subnormals (whose wrongly-set implicit bit cannot matter at that distance). A result of
  // 0x400 after rounding is the smallest normal, as it should be.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t s = e >= 95u ? 126u - e : 31u;  // 14..31
  return static_cast<uint16_t>(sign | ((m + (1u << (s - 1)) - 1u + ((m >> s) & 1u)) >> s));
}

/// IEEE binary16 -> f32, exact for every bit pattern (subnormals included; NaN payloads are kept
/// bit for bit, signalling ones are not quieted).
inline constexpr float f16_bits_to_f32(uint16_t bits) {
  const uint32_t sign = (static_cast<uint32_t>(bits) & 0x8000u) << 16;
  const uint32_t em = bits & 0x7FFFu;
  if (em >= 0x7C00u) return std::bit_cast<float>(sign | 0x7F800000u | ((em & 0x3FFu) << 13));
  if (em >= 0x0400u) return std::bit_cast<float>(sign | ((em << 13) + 0x38000000u));
  if (em == 0) return std::bit_cast<float>(sign);
  // A subnormal f16 is em * 2^-24, normal in f32: its leading bit becomes the implicit one.
  const uint32_t p = 31u - static_cast<uint32_t>(std::countl_zero(em));  // leading bit, 0..9
  return std::bit_cast<float>(sign | ((p + 103u) << 23) | ((em << (23u - p)) & 0x7FFFFFu));
}

/// f32 -> bfloat16, rounding to nearest-even (so FLT_MAX becomes inf). A NaN stays a quiet NaN
/// with its sign and top 7 payload bits.
inline constexpr uint16_t f32_to_bf16_bits(float x) {
  const uint32_t f = std::bit_cast<uint32_t>(x);
  // The rounding add would carry a NaN's payload into inf (or, for 0x7FFFFFFF, into -0), so NaNs
  // take the quieted top half instead. Both are computed and one selected, without a branch, so
  // that loops of conversions vectorize.
  const uint32_t quiet_nan = (f >> 16) | 0x0040u;
  const uint32_t rounded = (f + 0x7FFFu + ((f >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((f & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

/// bfloat16 -> f32, exact: bf16 is the top half of an f32.
inline constexpr float bf16_bits_to_f32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

/// Storage types with explicit conversion, so half values never silently mix with float math.
/// They deliberately have no arithmetic or comparison operators: compute in float, store as half.
/// One template over the format's two conversions; f16_t and bf16_t below are its two types.
template <uint16_t (*to_bits)(float), float (*to_f32)(uint16_t)>
struct half_storage {
  uint16_t bits = 0;

  half_storage() = default;
  constexpr explicit half_storage(float x) : bits(to_bits(x)) {}
  constexpr explicit operator float() const { return to_f32(bits); }
  static constexpr half_storage from_bits(uint16_t b) {
    half_storage h;
    h.bits = b;
    return h;
  }
};

using f16_t = half_storage<f32_to_f16_bits, f16_bits_to_f32>;
using bf16_t = half_storage<f32_to_bf16_bits, bf16_bits_to_f32>;

// Tensors of these are read and written as raw 2-byte elements.
static_assert(sizeof(f16_t) == 2 && alignof(f16_t) == 2);
static_assert(sizeof(bf16_t) == 2 && alignof(bf16_t) == 2);

}  // namespace mixtape
