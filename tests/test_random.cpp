// tests/test_random.cpp -- the f32/f16/bf16 rand and randn streams: values, determinism, law.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>

#if __has_include(<omp.h>)
#include <omp.h>
#define MIXTAPE_TEST_HAS_OMP 1
#endif

#include "mixtape/dsl/half.h"
#include "mixtape/dsl/random.h"
#include "mixtape/mixtape.h"
#include "mixtape/runtime/random_fill.h"

namespace mt = mixtape;

namespace {

// The exhaustive sweeps take ~1 s in Release; instrumented builds check every 7th input.
#if defined(__SANITIZE_ADDRESS__)
constexpr uint32_t kSweepStride = 7;
#else
constexpr uint32_t kSweepStride = 1;
#endif

// One f32 ulp at the magnitude of v (v a nonzero value in the f32 normal range).
double ulp_f32(double v) { return std::ldexp(1.0, std::ilogb(v) - 23); }

// The spec of runtime/random_fill.h, recomputed element by element in f64: element i reads
// words of philox4x32(offset + i / 4, 0, seed).
std::array<uint32_t, 4> block_words(uint64_t seed, uint64_t offset, int64_t i) {
  return mt::philox4x32(offset + static_cast<uint64_t>(i / 4), 0, seed);
}
double spec_uniform(uint64_t seed, uint64_t offset, int64_t i) {
  return static_cast<double>(block_words(seed, offset, i)[i % 4] >> 8) * 0x1p-24;
}
double spec_normal(uint64_t seed, uint64_t offset, int64_t i) {
  auto w = block_words(seed, offset, i);
  const int pair = static_cast<int>(i % 4) / 2;
  double u1 = (static_cast<double>(w[2 * pair] >> 8) + 1.0) * 0x1p-24;
  double u2 = static_cast<double>(w[2 * pair + 1] >> 8) * 0x1p-24;
  double radius = std::sqrt(-2.0 * std::log(u1));
  double angle = 2.0 * std::numbers::pi * u2;
  return i % 2 == 0 ? radius * std::cos(angle) : radius * std::sin(angle);
}

std::vector<float> draw(bool normal, mt::Shape shape, mt::DType dtype, uint64_t seed,
                        uint64_t skip) {
  mt::Generator gen(seed);
  gen.advance(skip);
  mt::Tensor t =
      normal ? mt::randn(std::move(shape), dtype, &gen) : mt::rand(std::move(shape), dtype, &gen);
  return t.to_vector<float>();
}

std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> bits(v.size());
  std::transform(v.begin(), v.end(), bits.begin(),
                 [](float x) { return std::bit_cast<uint32_t>(x); });
  return bits;
}

// Rounds an f32 value to f16/bf16 and back, as the 16-bit dtypes store it.
float round_to(mt::DType dtype, float v) {
  if (dtype == mt::f16) return mt::f16_bits_to_f32(mt::f32_to_f16_bits(v));
  if (dtype == mt::bf16) return mt::bf16_bits_to_f32(mt::f32_to_bf16_bits(v));
  return v;
}

TEST(RandomStream, ElementsFollowTheSpec) {
  // An offset that is not a multiple of 4 and a size with a partial last block.
  const uint64_t seed = 0x5eed5eed1234ull, skip = 6;
  const int64_t n = 4099;
  std::vector<float> u = draw(false, {n}, mt::f32, seed, skip);
  std::vector<float> z = draw(true, {n}, mt::f32, seed, skip);
  double worst_normal = 0;
  for (int64_t i = 0; i < n; ++i) {
    // Uniforms are 24-bit values, exact in f32.
    ASSERT_EQ(static_cast<double>(u[i]), spec_uniform(seed, skip, i)) << i;
    double want = spec_normal(seed, skip, i);
    if (want == 0) {
      ASSERT_EQ(z[i], 0.0f) << i;
      continue;
    }
    worst_normal = std::max(worst_normal, std::abs(z[i] - want) / ulp_f32(want));
  }
  // The f32 value compounds the errors of ln (< 1 ulp), sqrt, sincos (1.25 ulp) and the product;
  // 2.34 ulp at the most here.
  EXPECT_LE(worst_normal, 4.0);
  EXPECT_GT(worst_normal, 0.0);  // f32 arithmetic does differ from f64

  // Blocks whose counters cross 2^32 carry into the counter's high word.
  const uint64_t near_carry = (1ull << 32) - 100;
  std::vector<float> across = draw(false, {1000}, mt::f32, seed, near_carry);
  for (int64_t i = 0; i < 1000; ++i)
    ASSERT_EQ(static_cast<double>(across[i]), spec_uniform(seed, near_carry, i)) << i;

  // 16-bit dtypes store the f32 value rounded to nearest even; rand stays below 1.
  for (mt::DType dt : {mt::f16, mt::bf16}) {
    std::vector<float> hu = draw(false, {n}, dt, seed, skip), hz = draw(true, {n}, dt, seed, skip);
    for (int64_t i = 0; i < n; ++i) {
      float want_u = round_to(dt, u[i]);
      if (want_u == 1.0f) want_u = dt == mt::f16 ? 1.0f - 0x1p-11f : 1.0f - 0x1p-8f;
      ASSERT_EQ(hu[i], want_u) << mt::name(dt) << " rand [" << i << "]";
      ASSERT_EQ(hz[i], round_to(dt, z[i])) << mt::name(dt) << " randn [" << i << "]";
    }
  }
}

TEST(RandomStream, ValuesDoNotDependOnSizeOrThreads) {
  for (mt::DType dt : {mt::f32, mt::f16, mt::bf16}) {
    for (bool normal : {false, true}) {
      const std::string what = std::string(normal ? "randn " : "rand ") + std::string(mt::name(dt));
      for (uint64_t skip : {0, 3}) {
        std::vector<float> few = draw(normal, {5}, dt, 99, skip);
        std::vector<float> many = draw(normal, {1003}, dt, 99, skip);
        EXPECT_EQ(bits_of(few), bits_of({many.begin(), many.begin() + 5})) << what;
        std::vector<float> matrix = draw(normal, {17, 59}, dt, 99, skip);
        EXPECT_EQ(bits_of({matrix.begin(), matrix.begin() + 1003}), bits_of(many)) << what;
      }
#ifdef MIXTAPE_TEST_HAS_OMP
      // Large enough to be split across threads.
      const int saved = omp_get_max_threads();
      omp_set_num_threads(1);
      std::vector<float> one = draw(normal, {1 << 16}, dt, 7, 1);
      omp_set_num_threads(2);
      std::vector<float> two = draw(normal, {1 << 16}, dt, 7, 1);
      omp_set_num_threads(saved);
      EXPECT_EQ(bits_of(one), bits_of(two)) << what;
#endif
    }
  }
  // Consecutive draws from one generator use disjoint counters: no values repeat.
  mt::Generator gen(5);
  std::vector<float> a = mt::randn({6}, mt::f32, &gen).to_vector<float>();
  std::vector<float> b = mt::randn({6}, mt::f32, &gen).to_vector<float>();
  for (float x : a) EXPECT_EQ(std::count(b.begin(), b.end(), x), 0);
}

// Kolmogorov-Smirnov distance between a sample and a continuous CDF.
template <typename Cdf>
double ks_distance(std::vector<float> sample, Cdf cdf) {
  std::sort(sample.begin(), sample.end());
  const double n = static_cast<double>(sample.size());
  double d = 0;
  for (size_t i = 0; i < sample.size(); ++i) {
    double f = cdf(static_cast<double>(sample[i]));
    d = std::max({d, f - static_cast<double>(i) / n, static_cast<double>(i + 1) / n - f});
  }
  return d;
}

// Correlation of elements k apart: the four words of a block must be independent.
double lag_correlation(const std::vector<float>& v, size_t lag) {
  const size_t n = v.size() - lag;
  double ma = 0, mb = 0;
  for (size_t i = 0; i < n; ++i) ma += v[i], mb += v[i + lag];
  ma /= static_cast<double>(n), mb /= static_cast<double>(n);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    double a = v[i] - ma, b = v[i + lag] - mb;
    sab += a * b, saa += a * a, sbb += b * b;
  }
  return sab / std::sqrt(saa * sbb);
}

TEST(RandomStream, DistributionsPassKolmogorovSmirnov) {
  const int64_t n = 100000;
  // The 0.1% critical value of the KS distance is 1.95 / sqrt(n); a correct generator's expected
  // distance is ~0.87 / sqrt(n). The seeds are fixed, so the check is deterministic.
  const double critical = 1.95 / std::sqrt(static_cast<double>(n));
  const double correlation_bound = 4.0 / std::sqrt(static_cast<double>(n));
  std::vector<float> u = draw(false, {n}, mt::f32, 31337, 0);
  EXPECT_LT(ks_distance(u, [](double x) { return x; }), critical);
  EXPECT_GE(*std::min_element(u.begin(), u.end()), 0.0f);
  EXPECT_LT(*std::max_element(u.begin(), u.end()), 1.0f);
  std::vector<float> z = draw(true, {n}, mt::f32, 31337, n);
  EXPECT_LT(ks_distance(z, [](double x) { return 0.5 * std::erfc(-x / std::numbers::sqrt2); }),
            critical);
  double mean = 0, second = 0;
  for (float x : z) mean += x, second += static_cast<double>(x) * x;
  mean /= static_cast<double>(n), second /= static_cast<double>(n);
  EXPECT_NEAR(mean, 0.0, 4.0 / std::sqrt(static_cast<double>(n)));
  EXPECT_NEAR(second, 1.0, 4.0 * std::sqrt(2.0 / static_cast<double>(n)));
  for (size_t lag : {1, 2, 3, 4}) {
    EXPECT_LT(std::abs(lag_correlation(u, lag)), correlation_bound) << "rand lag " << lag;
    EXPECT_LT(std::abs(lag_correlation(z, lag)), correlation_bound) << "randn lag " << lag;
  }
}

TEST(RandomStream, LogIsWithinOneUlpOnEveryInput) {
  // Every u1 = (k + 1) 2^-24 that randn takes a logarithm of.
  double worst = 0;
  for (uint32_t k = 0; k < (1u << 24); k += kSweepStride) {
    float x = static_cast<float>(k + 1) * 0x1p-24f;
    double want = std::log(static_cast<double>(x));
    float got = mt::random_fill_log(x);
    if (want == 0) {
      ASSERT_EQ(got, 0.0f);
      continue;
    }
    worst = std::max(worst, std::abs(got - want) / ulp_f32(want));
  }
  EXPECT_LE(worst, 1.0);  // 0.83 at the most
}

TEST(RandomStream, SinCosAreWithinFiveQuartersOfAnUlpOnEveryInput) {
  // Every angle 2 pi k 2^-24. The f64 reference reduces by quarter turns too (an identity:
  // 2 pi k 2^-24 = (pi/2) (q + f) exactly), so its values at the zeros are exact zeros.
  double worst = 0;
  for (uint32_t k = 0; k < (1u << 24); k += kSweepStride) {
    const uint32_t q = k >> 22;
    const double f = static_cast<double>(k & 0x3fffffu) * 0x1p-22;
    const double s = std::sin(std::numbers::pi / 2 * f), c = std::cos(std::numbers::pi / 2 * f);
    const double want_sin = q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
    const double want_cos = q == 0 ? c : q == 1 ? -s : q == 2 ? -c : s;
    float got_sin, got_cos;
    mt::random_fill_sincos(k, got_sin, got_cos);
    for (auto [got, want] : {std::pair{got_sin, want_sin}, std::pair{got_cos, want_cos}}) {
      if (want == 0) {
        ASSERT_EQ(got, 0.0f) << k;
        continue;
      }
      worst = std::max(worst, std::abs(got - want) / ulp_f32(want));
    }
  }
  EXPECT_LE(worst, 1.25);  // 1.235 at the most, in cos (pi/2 t) near t = 1/2
}

}  // namespace
