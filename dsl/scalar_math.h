// dsl/scalar_math.h -- the scalar functions the REF expressions of ops.def are written in.
#pragma once

#include <cmath>
#include <cstdint>

namespace mixtape::math {

// ops.def's REF expressions call these (math::exp(a), math::select(c, a, b), ...) instead of
// std:: functions and ?:, so that the same expression can also be traced with a symbolic scalar
// type to generate kernel code (codegen/scalar_trace.h overloads every function here).

template <typename T>
T select(bool condition, T if_true, T if_false) {
  return condition ? if_true : if_false;
}
inline bool is_nan(float a) { return std::isnan(a); }
inline bool is_nan(double a) { return std::isnan(a); }
inline bool is_nan(int64_t) { return false; }

// Float-only ops are still instantiated for integer T (the domain check in ops.cpp keeps them
// from running); the int64_t overloads compute in double as std:: would.
#define MT_SCALAR_MATH(fn)                          \
  inline float fn(float a) { return std::fn(a); }   \
  inline double fn(double a) { return std::fn(a); } \
  inline double fn(int64_t a) { return std::fn(static_cast<double>(a)); }
MT_SCALAR_MATH(exp)
MT_SCALAR_MATH(log)
MT_SCALAR_MATH(sqrt)
MT_SCALAR_MATH(tanh)
MT_SCALAR_MATH(erf)
MT_SCALAR_MATH(sin)
MT_SCALAR_MATH(cos)
#undef MT_SCALAR_MATH
inline float pow(float a, float b) { return std::pow(a, b); }
inline double pow(double a, double b) { return std::pow(a, b); }
inline double pow(int64_t a, int64_t b) {
  return std::pow(static_cast<double>(a), static_cast<double>(b));
}

}  // namespace mixtape::math
