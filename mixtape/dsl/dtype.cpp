// mixtape/dsl/dtype.cpp -- dtype names, parsing and promotion.
#include "mixtape/dsl/dtype.h"

#include "mixtape/dsl/error.h"

namespace mixtape {

std::string_view name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::boolean:
      return "bool";
  }
  return "?";
}

std::string_view safetensors_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::boolean:
      return "BOOL";
  }
  return "?";
}

DType parse_dtype(std::string_view text) {
  for (DType t : {f32, f64, f16, bf16, i32, i64, boolean})
    if (text == name(t)) return t;
  fail("unknown dtype '{}' (expected one of f32, f64, f16, bf16, i32, i64, bool)", text);
}

DType promote(DType a, DType b) {
  if (a == b) return a;
  auto rank = [](DType t) {
    switch (t) {
      case DType::boolean:
        return 0;
      case DType::i32:
        return 1;
      case DType::i64:
        return 2;
      case DType::f16:
      case DType::bf16:
        return 3;
      case DType::f32:
        return 4;
      case DType::f64:
        return 5;
    }
    return 0;
  };
  if (is_half(a) && is_half(b)) return f32;
  return rank(a) >= rank(b) ? a : b;
}

}  // namespace mixtape
