// mixtape/dsl/dtype.h -- element types, their sizes and names, and type promotion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

namespace mixtape {

enum class DType : uint8_t { f32, f64, f16, bf16, i32, i64, boolean };

inline constexpr DType f32 = DType::f32;
inline constexpr DType f64 = DType::f64;
inline constexpr DType f16 = DType::f16;
inline constexpr DType bf16 = DType::bf16;
inline constexpr DType i32 = DType::i32;
inline constexpr DType i64 = DType::i64;
inline constexpr DType boolean = DType::boolean;

constexpr size_t size_of(DType t) {
  switch (t) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::boolean:
      return 1;
  }
  return 0;
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}
constexpr bool is_integer(DType t) { return t == DType::i32 || t == DType::i64; }
constexpr bool is_half(DType t) { return t == DType::f16 || t == DType::bf16; }

/// The largest finite value of a dtype, as a double (exact for every dtype but i64, whose
/// 2^63 - 1 rounds up to 2^63); its negation is the lowest finite value of the floating dtypes.
constexpr double largest_finite(DType t) {
  switch (t) {
    case DType::f64:
      return std::numeric_limits<double>::max();
    case DType::f32:
      return std::numeric_limits<float>::max();
    case DType::f16:
      return 65504.0;
    case DType::bf16:
      return 3.3895313892515355e38;  // 0x7f7f: f32's exponent, 7 mantissa bits
    case DType::i64:
      return static_cast<double>(std::numeric_limits<int64_t>::max());
    case DType::i32:
      return std::numeric_limits<int32_t>::max();
    case DType::boolean:
      return 1.0;
  }
  return 0.0;
}

/// The short name used in errors, reports and safetensors headers' counterpart ("f32", "bf16",
/// ...).
std::string_view name(DType t);
/// The safetensors dtype tag ("F32", "BF16", "I64", "BOOL", ...).
std::string_view safetensors_name(DType t);
/// Parses a name as printed by name(); throws mt::Error for anything else.
DType parse_dtype(std::string_view text);

/// The dtype a binary op computes in: floats beat ints beat bool; among floats the wider wins and
/// f16 with bf16 gives f32 (neither holds the other), as in PyTorch.
DType promote(DType a, DType b);

}  // namespace mixtape
