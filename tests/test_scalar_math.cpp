// tests/test_scalar_math.cpp -- dsl/scalar_math.h's float exp, tanh, erf and ldexp against f64
// libm, and the compiled CPU kernels against them bit for bit.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/scalar_math.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/runtime/device.h"

namespace mt = mixtape;

namespace {

// Distance in units in the last place between a float and the f64 value it approximates: how
// many f32 values lie between `got` and `want` rounded, plus the rounding's own fraction.
double ulp_error(float got, double want) {
  if (std::isinf(want) || std::fabs(want) > std::numeric_limits<float>::max())
    return std::isinf(got) && (got > 0) == (want > 0) ? 0 : 1e9;
  float rounded = static_cast<float>(want);
  float next = std::nextafter(rounded, std::numeric_limits<float>::infinity());
  double ulp = static_cast<double>(next) - static_cast<double>(rounded);
  if (std::fabs(rounded) < std::numeric_limits<float>::min())  // subnormal: fixed spacing
    ulp = std::ldexp(1.0, -149);
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

struct ErrorSweep {
  double max = 0, sum = 0;
  int64_t count = 0;
  float worst_input = 0;
};

// Every `stride`-th float bit pattern from `from` up to `to` (both positive or both negative
// magnitudes are walked by bits), plus the ends.
template <typename F, typename Want>
ErrorSweep sweep(float from, float to, int64_t stride, F got, Want want) {
  ErrorSweep s;
  auto visit = [&](float x) {
    double e = ulp_error(got(x), want(static_cast<double>(x)));
    s.sum += e;
    ++s.count;
    if (e > s.max) s.max = e, s.worst_input = x;
  };
  for (float sign : {1.0f, -1.0f}) {
    uint32_t lo = std::bit_cast<uint32_t>(std::fabs(from)), hi = std::bit_cast<uint32_t>(to);
    for (uint64_t bits = lo; bits <= hi; bits += stride)
      visit(sign * std::bit_cast<float>(uint32_t(bits)));
    visit(sign * to);
  }
  return s;
}

// Sweeps `got` against `want` from 2^-30 to `to` (both signs) and checks the worst and the mean
// error in ulps, printing both for the record.
template <typename F, typename Want>
void expect_within(const char* name, float to, double max_ulp, double mean_ulp, F got, Want want) {
  ErrorSweep s = sweep(0x1p-30f, to, 97, got, want);
  std::printf("%s: max %.3f ulp at %a, mean %.3f ulp over %lld inputs\n", name, s.max,
              s.worst_input, s.sum / s.count, static_cast<long long>(s.count));
  EXPECT_LE(s.max, max_ulp) << name << " worst at " << s.worst_input;
  EXPECT_LE(s.sum / s.count, mean_ulp) << name;
  EXPECT_GT(s.count, 5'000'000) << name;
}

TEST(ScalarMath, ExpIsWithinOneUlp) {
  // From 2^-30 (where exp rounds to 1) to 104 (beyond both the overflow and the underflow
  // boundary, 88.72 and -103.97), both signs: the subnormal results below -87.3 included.
  expect_within(
      "exp", 104.0f, 1.0, 0.6, [](float x) { return mt::math::exp(x); },
      [](double x) { return std::exp(x); });
}

TEST(ScalarMath, ExpSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(mt::math::exp(0.0f), 1.0f);
  EXPECT_EQ(mt::math::exp(-0.0f), 1.0f);
  EXPECT_EQ(mt::math::exp(inf), inf);
  EXPECT_EQ(std::bit_cast<uint32_t>(mt::math::exp(-inf)), 0u);  // +0
  EXPECT_TRUE(std::isnan(mt::math::exp(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(mt::math::exp(88.72283f), std::exp(88.72283f));  // the largest finite result
  EXPECT_EQ(mt::math::exp(88.72284f), inf);                  // the first that overflows
  EXPECT_EQ(mt::math::exp(-103.972f), 0x1p-149f);            // the smallest subnormal
  EXPECT_EQ(mt::math::exp(-103.98f), 0.0f);
  EXPECT_EQ(mt::math::exp(1.0f), std::exp(1.0f));
}

TEST(ScalarMath, TanhIsWithinSevenUlp) {
  expect_within(
      "tanh", 12.0f, 7.0, 1.0, [](float x) { return mt::math::tanh(x); },
      [](double x) { return std::tanh(x); });
  EXPECT_EQ(mt::math::tanh(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(mt::math::tanh(-std::numeric_limits<float>::infinity()), -1.0f);
}

TEST(ScalarMath, ErfIsWithinThreeUlp) {
  // Both pieces and the switch between them (0.875), up to beyond where erf rounds to 1.
  expect_within(
      "erf", 6.0f, 3.0, 0.75, [](float x) { return mt::math::erf(x); },
      [](double x) { return std::erf(x); });
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(mt::math::erf(inf), 1.0f);
  EXPECT_EQ(mt::math::erf(-inf), -1.0f);
  EXPECT_TRUE(std::signbit(mt::math::erf(-0.0f)));
  EXPECT_TRUE(std::isnan(mt::math::erf(std::numeric_limits<float>::quiet_NaN())));
}

TEST(ScalarMath, LdexpScalesExactlyAndRoundsOnce) {
  EXPECT_EQ(mt::math::ldexp(1.5f, 10.0f), 1536.0f);
  EXPECT_EQ(mt::math::ldexp(1.5f, -130.0f), 1.5f * 0x1p-130f);  // subnormal, exact
  EXPECT_EQ(mt::math::ldexp(1.75f, -149.0f), 0x1p-148f);        // 1.75 * 2^-149 rounds up
  EXPECT_EQ(mt::math::ldexp(1.0f, 128.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(mt::math::ldexp(0x1.fffffep-1f, 128.0f), std::numeric_limits<float>::max());
  EXPECT_EQ(mt::math::ldexp(-3.0, -1074.0 + 1), -3.0 * 0x1p-1073);
  EXPECT_EQ(mt::math::ldexp(1.0, 1000.0), 0x1p1000);
}

TEST(ScalarMath, CompiledKernelsEqualTheReferenceBitForBit) {
  // Every region of exp (overflow, the finite range, subnormal results, underflow, NaN and the
  // infinities) and of tanh, through the LLVM kernels of the compiled CPU back end.
  std::vector<float> x;
  for (float v = -110.0f; v <= 95.0f; v += 0.173f) x.push_back(v);
  for (float v : {0.0f, -0.0f, 88.72283f, 88.72284f, -103.972f, -87.33f, 1e-30f}) x.push_back(v);
  x.push_back(std::numeric_limits<float>::infinity());
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  mt::Device before = mt::current_device();
  mt::set_device(mt::Device::cpu);
  mt::Tensor input = mt::tensor(x, {static_cast<int64_t>(x.size())});
  std::vector<float> e = mt::exp(input).to_vector<float>(), t = mt::tanh(input).to_vector<float>(),
                     r = mt::erf(input * 0.05).to_vector<float>();
  mt::set_device(before);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(e[i]), std::bit_cast<uint32_t>(mt::math::exp(x[i])))
        << "exp(" << x[i] << ")";
    EXPECT_EQ(std::bit_cast<uint32_t>(t[i]), std::bit_cast<uint32_t>(mt::math::tanh(x[i])))
        << "tanh(" << x[i] << ")";
    float scaled = x[i] * 0.05f;
    EXPECT_EQ(std::bit_cast<uint32_t>(r[i]), std::bit_cast<uint32_t>(mt::math::erf(scaled)))
        << "erf(" << scaled << ")";
  }
}

}  // namespace
