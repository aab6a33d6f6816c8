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
MT_SCALAR_MATH(erf)
MT_SCALAR_MATH(sin)
MT_SCALAR_MATH(cos)
#undef MT_SCALAR_MATH
// tanh in float is a rational function of x, with |x| clamped to 9.1 (where tanh rounds to 1):
// tanh(x) = x P(x^2) / Q(x^2). It is only arithmetic, so generated kernels vectorize it (libm's
// tanhf does not), and codegen/scalar_trace.cpp traces the same steps in the same order, so the
// reference executor and every back end agree bit for bit. At most 7 ulp from the true value
// (glibc's tanhf: 1), at most 1 ulp on average; fitted for mixtape by weighted least squares on
// the relative error. Coefficients are highest power first, as Horner's rule uses them.
inline constexpr float tanh_limit = 9.1f;
inline constexpr float tanh_p[] = {1.357146395264408e-08f, 2.077439785352908e-05f,
                                   0.0035060143563896418f, 0.13389933109283447f, 1.0f};
inline constexpr float tanh_q[] = {7.867919862292183e-07f, 0.00033024183358065784f,
                                   0.025917043909430504f, 0.4672325551509857f, 1.0f};
inline float tanh(float a) {
  float x = a > tanh_limit ? tanh_limit : (a < -tanh_limit ? -tanh_limit : a);
  float s = x * x, p = tanh_p[0], q = tanh_q[0];
  for (int i = 1; i < 5; ++i) p = p * s + tanh_p[i];
  for (int i = 1; i < 5; ++i) q = q * s + tanh_q[i];
  return x * p / q;
}
inline double tanh(double a) { return std::tanh(a); }
inline double tanh(int64_t a) { return std::tanh(static_cast<double>(a)); }
inline float pow(float a, float b) { return std::pow(a, b); }
inline double pow(double a, double b) { return std::pow(a, b); }
inline double pow(int64_t a, int64_t b) {
  return std::pow(static_cast<double>(a), static_cast<double>(b));
}

}  // namespace mixtape::math
