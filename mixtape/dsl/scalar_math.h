// mixtape/dsl/scalar_math.h -- the scalar functions the REF expressions of ops.def are written in.
#pragma once

#include <bit>
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
inline float sqrt(float a) { return std::sqrt(a); }
inline double sqrt(double a) { return std::sqrt(a); }
inline double sqrt(int64_t a) { return std::sqrt(static_cast<double>(a)); }

// The C library's functions of dsl/libm.def: a double (and an integer, as a double) calls the
// library; a float the library's float function, but for those computed below (Own).
#define MT_LIBM_FLOAT_Libm_1(name) \
  inline float name(float a) { return std::name(a); }
#define MT_LIBM_FLOAT_Libm_2(name) \
  inline float name(float a, float b) { return std::name(a, b); }
#define MT_LIBM_FLOAT_Own_1(name)
#define MT_LIBM_DOUBLE_1(name)                          \
  inline double name(double a) { return std::name(a); } \
  inline double name(int64_t a) { return std::name(static_cast<double>(a)); }
#define MT_LIBM_DOUBLE_2(name)                                        \
  inline double name(double a, double b) { return std::name(a, b); }  \
  inline double name(int64_t a, int64_t b) {                          \
    return std::name(static_cast<double>(a), static_cast<double>(b)); \
  }
#define MT_LIBM(Name, name, arity, f32, rounding) \
  MT_LIBM_FLOAT_##f32##_##arity(name) MT_LIBM_DOUBLE_##arity(name)
#include "mixtape/dsl/libm.def"
#undef MT_LIBM_FLOAT_Libm_1
#undef MT_LIBM_FLOAT_Libm_2
#undef MT_LIBM_FLOAT_Own_1
#undef MT_LIBM_DOUBLE_1
#undef MT_LIBM_DOUBLE_2

/// a * 2^b for an integer-valued b in [-252, 254] (f64: [-2044, 2046]), as two exact powers of
/// two built from exponent bits: a result that overflows or is subnormal rounds once, at the
/// second product. kir::Op::Ldexp, which the emitters print with the same steps.
inline float ldexp(float a, float b) {
  int32_t k = static_cast<int32_t>(b), half = k >> 1;
  return a * std::bit_cast<float>((half + 127) << 23) *
         std::bit_cast<float>((k - half + 127) << 23);
}
inline double ldexp(double a, double b) {
  int64_t k = static_cast<int64_t>(b), half = k >> 1;
  return a * std::bit_cast<double>((half + 1023) << 52) *
         std::bit_cast<double>((k - half + 1023) << 52);
}

// exp, tanh and erf in float are written as arithmetic, select and ldexp only, as templates over
// the scalar type: the reference executor runs them on float, and codegen/scalar_trace.cpp runs the
// very same steps on its symbolic scalar to print kernel code. So every back end agrees with the
// reference bit for bit, and generated kernels vectorize them (libm's functions do not).
// Literals are written F(...) so that both types take them.

// exp(a) = 2^n e^r with n = round(a / ln 2) and |r| <= ln(2)/2, e^r by Cephes' expf polynomial,
// ln 2 split in two so that n * ln2_hi is exact. Under 1 ulp from the true value (0.96 at worst
// on every 97th float, tests/test_scalar_math.cpp; glibc's expf: 0.5). Inputs are clamped to
// where exp rounds to inf or 0.
inline constexpr float exp_high = 88.8f, exp_low = -104.0f;
inline constexpr float exp_p[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
template <typename F>
F exp_steps(F a) {
  // Below exp_low the result is 0: those lanes compute exp(0) instead, because a product that
  // underflows to a subnormal or zero costs a microcode assist on x86, and masked attention
  // scores (-inf) are half of a causal softmax. A NaN must not reach ldexp's integer conversion.
  auto underflow = a < F(exp_low);
  F x = select(a > F(exp_high), F(exp_high), a);
  x = select(underflow || is_nan(a), F(0.0f), x);
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
  F n = (x * F(1.44269504088896341f) + F(12582912.0f)) - F(12582912.0f);
  F r = (x - n * F(0.693359375f)) - n * F(-2.12194440e-4f);
  F p = F(exp_p[0]);
  for (int i = 1; i < 6; ++i) p = p * r + F(exp_p[i]);
  F y = (p * (r * r) + r) + F(1.0f);
  return select(underflow, F(0.0f), select(is_nan(a), a, ldexp(y, n)));
}

// tanh(x) = x P(x^2) / Q(x^2) with |x| clamped to 9.1 (where tanh rounds to 1), the result to
// [-1, 1]. At most 7 ulp
// from the true value (glibc's tanhf: 1), at most 1 ulp on average; fitted for mixtape by
// weighted least squares on the relative error. Coefficients are highest power first, as
// Horner's rule uses them.
inline constexpr float tanh_limit = 9.1f;
inline constexpr float tanh_p[] = {1.357146395264408e-08f, 2.077439785352908e-05f,
                                   0.0035060143563896418f, 0.13389933109283447f, 1.0f};
inline constexpr float tanh_q[] = {7.867919862292183e-07f, 0.00033024183358065784f,
                                   0.025917043909430504f, 0.4672325551509857f, 1.0f};
template <typename F>
F tanh_steps(F a) {
  F limit = F(tanh_limit);
  F x = select(a > limit, limit, select(a < -limit, -limit, a));
  F s = x * x, p = F(tanh_p[0]), q = F(tanh_q[0]);
  for (int i = 1; i < 5; ++i) p = p * s + F(tanh_p[i]);
  for (int i = 1; i < 5; ++i) q = q * s + F(tanh_q[i]);
  // Within [-1, 1]: the fit gives 1 + 2^-23 for 8.13 < |x| < 9.1, which flipped the sign of
  // tanh's gradient there and of gelu_tanh's value below -5.
  F r = x * p / q;
  return select(r > F(1.0f), F(1.0f), select(r < F(-1.0f), F(-1.0f), r));
}

// erf(x) = x P(x^2) below 0.875; above, 1 - exp(-x^2) Q(1/|x|) (erfc(x) e^(x^2) is smooth in
// 1/x), and 1 from 3.92, where erf rounds to 1 in f32. Fitted for mixtape by weighted least
// squares on the relative error; at most 2.5 ulp from the true value (glibc's erff: 1),
// tests/test_scalar_math.cpp measures it. Coefficients highest power first.
inline constexpr float erf_split = 0.875f, erf_one = 3.92f;
inline constexpr float erf_small[] = {-0.000623512314632535f, 0.005038732662796974f,
                                      -0.02679630182683468f,  0.11282607913017273f,
                                      -0.376125693321228f,    1.1283791065216064f};
inline constexpr float erf_large[] = {
    -0.018222704529762268f, 0.12226223200559616f,  -0.3569706678390503f, 0.5783224105834961f,
    -0.5072371363639832f,   0.051396358758211136f, 0.557679295539856f,   0.0003537950979080051f};
template <typename F>
F erf_steps(F a) {
  F ax = select(a < F(0.0f), -a, a);
  F t = a * a, p = F(erf_small[0]);
  for (int i = 1; i < 6; ++i) p = p * t + F(erf_small[i]);
  F small = a * p;
  F u = F(1.0f) / ax, q = F(erf_large[0]);
  for (int i = 1; i < 8; ++i) q = q * u + F(erf_large[i]);
  F large = F(1.0f) - exp_steps(-(ax * ax)) * q;
  large = select(ax >= F(erf_one), F(1.0f), large);
  large = select(a < F(0.0f), -large, large);
  return select(ax < F(erf_split), small, select(is_nan(a), a, large));
}

// The tanh-form gelu's slope 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2), given
// t = tanh(k (x + c x^3)): PyTorch's gelu_backward (approximate="tanh") in one expression.
template <typename F>
F gelu_tanh_slope(F x, F t) {
  return F(0.5) * (F(1) + t) +
         F(0.5) * x * (F(1) - t * t) * F(0.7978845608028654) * (F(1) + F(3 * 0.044715) * x * x);
}

// silu's slope s (1 + x (1 - s)), given s = sigmoid(x): PyTorch's silu_backward in one expression.
template <typename F>
F silu_slope(F x, F s) {
  return s * (F(1) + x * (F(1) - s));
}

// The float functions dsl/libm.def marks Own.
inline float exp(float a) { return exp_steps(a); }
inline float tanh(float a) { return tanh_steps(a); }
inline float erf(float a) { return erf_steps(a); }

}  // namespace mixtape::math
