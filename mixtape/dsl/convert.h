// mixtape/dsl/convert.h -- element conversion between storage dtypes and host compute types.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "mixtape/dsl/half.h"
#include "mixtape/dsl/node.h"

namespace mixtape {

/// Rounds to f32 with round-to-odd, so that rounding the result once more to a narrower float
/// type (f16, bf16) gives the correctly rounded value of `v`: no double-rounding error.
inline float round_to_odd_f32(double v) {
  float f = static_cast<float>(v);
  if (static_cast<double>(f) == v || std::isnan(v)) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | 1u);
}

template <typename T>
inline float to_f32_for_half(T v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return round_to_odd_f32(static_cast<double>(v));
}

/// A value converted to a 64-bit integer as every back end converts it: truncated toward zero;
/// a float that is NaN or outside [-2^63, 2^63) gives INT64_MIN (C++'s cast is undefined there,
/// LLVM's fptosi poison, and x86 gives INT64_MIN). A narrower integer type wraps it.
template <typename T>
inline int64_t to_int64(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    if (!(v >= T(-0x1p63) && v < T(0x1p63))) return std::numeric_limits<int64_t>::min();
  }
  return static_cast<int64_t>(v);
}

/// Converts one host value to the storage representation of `dtype` and writes it at `out[i]`.
/// Floats are rounded to nearest even (f16/bf16 as IEEE defines); integers are truncated toward
/// zero like a C cast; bool is value != 0.
template <typename T>
inline void store_element(Storage& out, int64_t i, T v) {
  switch (out.dtype) {
    case DType::f32:
      out.as<float>()[i] = static_cast<float>(v);
      break;
    case DType::f64:
      out.as<double>()[i] = static_cast<double>(v);
      break;
    case DType::f16:
      out.as<uint16_t>()[i] = f32_to_f16_bits(to_f32_for_half(v));
      break;
    case DType::bf16:
      out.as<uint16_t>()[i] = f32_to_bf16_bits(to_f32_for_half(v));
      break;
    case DType::i32:
      out.as<int32_t>()[i] = static_cast<int32_t>(to_int64(v));
      break;
    case DType::i64:
      out.as<int64_t>()[i] = to_int64(v);
      break;
    case DType::boolean:
      out.as<uint8_t>()[i] = v != T(0);
      break;
  }
}

template <typename T>
inline T load_element(const Storage& in, int64_t i) {
  switch (in.dtype) {
    case DType::f32:
      return static_cast<T>(in.as<float>()[i]);
    case DType::f64:
      return static_cast<T>(in.as<double>()[i]);
    case DType::f16:
      return static_cast<T>(f16_bits_to_f32(in.as<uint16_t>()[i]));
    case DType::bf16:
      return static_cast<T>(bf16_bits_to_f32(in.as<uint16_t>()[i]));
    case DType::i32:
      return static_cast<T>(in.as<int32_t>()[i]);
    case DType::i64:
      return static_cast<T>(in.as<int64_t>()[i]);
    case DType::boolean:
      return static_cast<T>(in.as<uint8_t>()[i] != 0);
  }
  return T(0);
}

/// All elements of `in` as T.
template <typename T>
std::vector<T> load_all(const Storage& in) {
  std::vector<T> out(static_cast<size_t>(in.count));
  switch (in.dtype) {  // the common cases without a per-element switch
    case DType::f32: {
      const float* data = in.as<float>();  // once: the device check is not hoisted by itself
      for (int64_t i = 0; i < in.count; ++i) out[i] = static_cast<T>(data[i]);
      return out;
    }
    case DType::f64: {
      const double* data = in.as<double>();
      for (int64_t i = 0; i < in.count; ++i) out[i] = static_cast<T>(data[i]);
      return out;
    }
    case DType::i64: {  // indices
      const int64_t* data = in.as<int64_t>();
      for (int64_t i = 0; i < in.count; ++i) out[i] = static_cast<T>(data[i]);
      return out;
    }
    default:
      if (in.count > 0) in.host_data();  // fetch once, outside the loop
      for (int64_t i = 0; i < in.count; ++i) out[i] = load_element<T>(in, i);
      return out;
  }
}

/// The index of the first NaN or infinite element of `in`, or -1 when there is none (always for
/// integer and bool dtypes). Reads the host copy; f16 and bf16 are tested on their bits, so no
/// element is converted.
inline int64_t first_nonfinite(const Storage& in) {
  if (in.count == 0) return -1;
  auto find = [&](const auto* data, auto finite) -> int64_t {
    for (int64_t i = 0; i < in.count; ++i)
      if (!finite(data[i])) return i;
    return -1;
  };
  switch (in.dtype) {
    case DType::f32:
      return find(in.as<float>(), [](float v) { return std::isfinite(v); });
    case DType::f64:
      return find(in.as<double>(), [](double v) { return std::isfinite(v); });
    case DType::f16:  // all-ones exponent: infinity or NaN
      return find(in.as<uint16_t>(), [](uint16_t b) { return (b & 0x7c00u) != 0x7c00u; });
    case DType::bf16:
      return find(in.as<uint16_t>(), [](uint16_t b) { return (b & 0x7f80u) != 0x7f80u; });
    default:
      return -1;
  }
}

/// Whether none of `count` values of type `t` at `data` is NaN or infinite (always true for integer
/// and bool dtypes): each value's exponent bits, all ones for NaN and infinity, tested without an
/// early exit, so that the scan vectorizes where every value passes (first_nonfinite's loop with
/// one does not).
inline bool all_finite(const void* data, int64_t count, DType t) {
  auto none = [&](const auto* bits, auto exponent) {
    bool finite = true;
    for (int64_t i = 0; i < count; ++i) finite &= (bits[i] & exponent) != exponent;
    return finite;
  };
  switch (t) {
    case DType::f32:
      return none(static_cast<const uint32_t*>(data), uint32_t{0x7f800000});
    case DType::f64:
      return none(static_cast<const uint64_t*>(data), uint64_t{0x7ff0000000000000});
    case DType::f16:
      return none(static_cast<const uint16_t*>(data), uint16_t{0x7c00});
    case DType::bf16:
      return none(static_cast<const uint16_t*>(data), uint16_t{0x7f80});
    default:
      return true;
  }
}

/// A new storage of `dtype` holding `in`'s elements converted (floats through f64, so rounded
/// once; integers and bools through i64, as a C cast).
inline std::shared_ptr<Storage> converted(const Storage& in, DType dtype) {
  auto out = std::make_shared<Storage>(dtype, in.count);
  if (is_floating(in.dtype) || is_floating(dtype))
    for (int64_t k = 0; k < in.count; ++k) store_element(*out, k, load_element<double>(in, k));
  else
    for (int64_t k = 0; k < in.count; ++k) store_element(*out, k, load_element<int64_t>(in, k));
  return out;
}

/// A new storage of `dtype` holding `values` converted.
template <typename T>
std::shared_ptr<Storage> store_all(DType dtype, const std::vector<T>& values) {
  auto out = std::make_shared<Storage>(dtype, static_cast<int64_t>(values.size()));
  switch (dtype) {
    case DType::f32: {
      float* data = out->as<float>();
      for (size_t i = 0; i < values.size(); ++i) data[i] = static_cast<float>(values[i]);
      return out;
    }
    case DType::f64: {
      double* data = out->as<double>();
      for (size_t i = 0; i < values.size(); ++i) data[i] = static_cast<double>(values[i]);
      return out;
    }
    default:
      for (size_t i = 0; i < values.size(); ++i)
        store_element(*out, static_cast<int64_t>(i), values[i]);
      return out;
  }
}

}  // namespace mixtape
