// tests/test_half.cpp -- proves dsl/half.h against F16C hardware and double-arithmetic references.
#include "mixtape/dsl/half.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define MT_TEST_HAVE_X86 1
#else
#define MT_TEST_HAVE_X86 0
#endif

namespace mt = mixtape;

namespace {

using mt::bf16_bits_to_f32;
using mt::f16_bits_to_f32;
using mt::f32_to_bf16_bits;
using mt::f32_to_f16_bits;

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
constexpr float float_of(uint32_t bits) { return std::bit_cast<float>(bits); }

// ---------------------------------------------------------------------------------------------
// Hardware reference. The F16C helpers carry their own target attribute so the rest of the
// suite builds without -mf16c; they are only called after the runtime CPU check.

bool have_f16c() {
#if MT_TEST_HAVE_X86 && defined(__clang__)
  // Older clang rejects "f16c" below. F16C is VEX-encoded, so it also needs OS-enabled AVX state.
  unsigned eax, ebx, ecx, edx;
  return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) &&
         (ecx & bit_F16C);
#elif MT_TEST_HAVE_X86
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

#if MT_TEST_HAVE_X86
__attribute__((target("f16c"))) float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) uint16_t hw_f32_to_f16(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}
#else
float hw_f16_to_f32(uint16_t) { return 0; }
uint16_t hw_f32_to_f16(float) { return 0; }
#endif

#define SKIP_WITHOUT_F16C() \
  if (!have_f16c()) GTEST_SKIP() << "CPU has no F16C instructions"

// ---------------------------------------------------------------------------------------------
// Arithmetic references, written from the format definitions in double precision and sharing
// no code with the bit tricks under test.

struct Format {
  int mant_bits;  // stored mantissa bits
  int emin;       // exponent of the smallest normal
  int emax;       // exponent of the largest finite binade (also the bias)
};
constexpr Format kF16{10, -14, 15};
constexpr Format kBF16{7, -126, 127};

int exp_bits(Format f) { return 15 - f.mant_bits; }
uint16_t inf_bits(Format f) {
  return static_cast<uint16_t>(((1u << exp_bits(f)) - 1) << f.mant_bits);
}
uint16_t quiet_bit(Format f) { return static_cast<uint16_t>(1u << (f.mant_bits - 1)); }

// sign * significand * 2^exponent, straight from the encoding.
double ref_decode(uint16_t h, Format f) {
  const int e = (h >> f.mant_bits) & ((1 << exp_bits(f)) - 1);
  const int m = h & ((1 << f.mant_bits) - 1);
  double mag;
  if (e == (1 << exp_bits(f)) - 1) {
    mag = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    mag = std::ldexp(m, f.emin - f.mant_bits);
  } else {
    mag = std::ldexp((1 << f.mant_bits) + m, e - f.emax - f.mant_bits);
  }
  return (h & 0x8000) ? -mag : mag;
}

// Rounds a finite, non-NaN float to the format: scale so the format's quantum at this magnitude
// is 1, take the two neighbouring integers, pick the nearer (ties to the even one), then encode.
uint16_t ref_encode(float x, Format f) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double d = std::fabs(static_cast<double>(x));
  if (std::isinf(d)) return sign | inf_bits(f);
  if (d == 0) return sign;
  int ex;
  std::frexp(d, &ex);  // d in [2^(ex-1), 2^ex)
  const int qexp = std::max(ex - 1 - f.mant_bits, f.emin - f.mant_bits);
  const double n = std::ldexp(d, -qexp);  // exact: a power-of-two scaling
  const double lo = std::floor(n);
  const double frac = n - lo;
  const bool up = frac > 0.5 || (frac == 0.5 && std::fmod(lo, 2.0) == 1.0);
  const double r = std::ldexp(up ? lo + 1 : lo, qexp);
  if (r >= std::ldexp(1.0, f.emax + 1)) return sign | inf_bits(f);
  if (r < std::ldexp(1.0, f.emin)) return sign | static_cast<uint16_t>(up ? lo + 1 : lo);
  int rex;
  std::frexp(r, &rex);
  const int e = rex - 1;  // r in [2^e, 2^(e+1))
  const auto mant = static_cast<uint32_t>(std::ldexp(r, f.mant_bits - e)) - (1u << f.mant_bits);
  return sign | static_cast<uint16_t>(((e + f.emax) << f.mant_bits) | mant);
}

// What a NaN must become: a quiet NaN with the same sign and the top payload bits kept.
bool nan_converted_ok(float x, uint16_t h, Format f) {
  const uint32_t b = bits_of(x);
  const uint16_t payload_mask = static_cast<uint16_t>((1u << f.mant_bits) - 1) & ~quiet_bit(f);
  const uint16_t top_payload = static_cast<uint16_t>((b & 0x7FFFFFu) >> (23 - f.mant_bits));
  return (h & 0x8000) == ((b >> 16) & 0x8000) && (h & inf_bits(f)) == inf_bits(f) &&
         (h & quiet_bit(f)) && (h & payload_mask) == (top_payload & payload_mask);
}

// Reports only the first few mismatches of a big sweep, then a count.
class Mismatches {
 public:
  explicit Mismatches(const char* what) : what_(what) {}
  ~Mismatches() { EXPECT_EQ(count_, 0) << what_ << ": total mismatches"; }
  bool check(bool ok, uint32_t input, uint32_t got, uint32_t want) {
    if (ok) return true;
    if (++count_ <= 8) {
      ADD_FAILURE() << what_ << ": input 0x" << std::hex << input << " got 0x" << got << " want 0x"
                    << want;
    }
    return false;
  }

 private:
  const char* what_;
  int count_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Input sets for the f32 -> half directions.

std::vector<float> with_negatives(std::vector<float> v) {
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) v.push_back(-v[i]);
  return v;
}

// For every pair of adjacent finite non-negative values (plus the largest finite value and the
// next power of two, the overflow boundary), the exact midpoint and one f32 ulp either side.
std::vector<float> halfway_points(Format f) {
  std::vector<float> out;
  const uint16_t largest = static_cast<uint16_t>(inf_bits(f) - 1);
  for (uint16_t k = 0; k <= largest; ++k) {
    const double lo = ref_decode(k, f);
    const double hi = k == largest ? std::ldexp(1.0, f.emax + 1) : ref_decode(k + 1, f);
    const double mid = (lo + hi) / 2;
    const auto m = static_cast<float>(mid);
    EXPECT_EQ(static_cast<double>(m), mid) << "midpoint not exact in f32 above 0x" << std::hex << k;
    out.push_back(m);
    out.push_back(std::nextafter(m, 0.0f));
    out.push_back(std::nextafter(m, std::numeric_limits<float>::infinity()));
  }
  return with_negatives(std::move(out));
}

std::vector<float> special_floats() {
  const float inf = std::numeric_limits<float>::infinity();
  const float denorm_min = std::numeric_limits<float>::denorm_min();
  std::vector<float> v = {0.0f,      inf,      FLT_MAX,  FLT_MIN,  std::nextafter(FLT_MIN, 0.0f),
                          1.0f,      65504.0f, 65520.0f, 65536.0f, denorm_min,
                          0x1p-24f,  0x1p-25f, 0x1p-26f, 0x1p-14f, 0x1p-133f,
                          0x1p-134f, 0x1p127f};
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0x7FBFFFFFu, 0x7FFFFFFFu, 0x7F801FFFu, 0x7F802000u,
                       0x7F807FFFu, 0x7F808000u, 0x7FA00000u}) {
    v.push_back(float_of(nan));
  }
  return with_negatives(std::move(v));
}

// Uniform bit patterns (mostly far outside f16 range), then patterns with exponents confined to
// around the f16 range so rounding, subnormals and overflow get most of the draws.
std::vector<float> random_floats() {
  std::mt19937 rng(0x5eed1234u);
  std::vector<float> v;
  constexpr int kEach = 1'500'000;
  v.reserve(2 * kEach);
  for (int i = 0; i < kEach; ++i) v.push_back(float_of(static_cast<uint32_t>(rng())));
  std::uniform_int_distribution<uint32_t> exp(95, 145);
  for (int i = 0; i < kEach; ++i) {
    const uint32_t r = static_cast<uint32_t>(rng());
    v.push_back(float_of((r & 0x807FFFFFu) | (exp(rng) << 23)));
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// f16 -> f32

TEST(HalfF16, AllPatternsDecodeLikeF16C) {
  SKIP_WITHOUT_F16C();
  Mismatches bad("f16_bits_to_f32 vs F16C");
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float got = f16_bits_to_f32(h);
    const float want = hw_f16_to_f32(h);
    const bool ok = std::isnan(want) ? std::isnan(got) && std::signbit(got) == std::signbit(want)
                                     : bits_of(got) == bits_of(want);
    bad.check(ok, b, bits_of(got), bits_of(want));
  }
}

TEST(HalfF16, AllPatternsDecodeLikeArithmeticReference) {
  Mismatches bad("f16_bits_to_f32 vs ldexp reference");
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float got = f16_bits_to_f32(h);
    const double want = ref_decode(h, kF16);
    const bool ok = std::isnan(want) ? std::isnan(got)
                                     : static_cast<double>(got) == want &&
                                           std::signbit(got) == std::signbit(want);
    bad.check(ok, b, bits_of(got), bits_of(static_cast<float>(want)));
  }
}

TEST(HalfF16, NanPayloadIsKeptBitForBit) {
  Mismatches bad("f16 NaN payload");
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    if ((b & 0x7C00) != 0x7C00 || (b & 0x3FF) == 0) continue;
    const uint32_t want = ((b & 0x8000u) << 16) | 0x7F800000u | ((b & 0x3FFu) << 13);
    const uint32_t got = bits_of(f16_bits_to_f32(static_cast<uint16_t>(b)));
    bad.check(got == want, b, got, want);
  }
}

// Every 16-bit pattern of `f` decoded to f32 and encoded back: a signalling NaN comes back
// quieted; everything else comes back unchanged.
void expect_every_pattern_round_trips(Format f, uint16_t (*encode)(float),
                                      float (*decode)(uint16_t), const char* what) {
  Mismatches bad(what);
  const uint16_t mantissa = static_cast<uint16_t>((1u << f.mant_bits) - 1);
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const bool nan = (h & inf_bits(f)) == inf_bits(f) && (h & mantissa) != 0;
    const uint16_t want = nan ? static_cast<uint16_t>(h | quiet_bit(f)) : h;
    const uint16_t got = encode(decode(h));
    bad.check(got == want, b, got, want);
  }
}

TEST(HalfF16, RoundTripsEveryPattern) {
  expect_every_pattern_round_trips(kF16, f32_to_f16_bits, f16_bits_to_f32, "f16 -> f32 -> f16");
}

// ---------------------------------------------------------------------------------------------
// f32 -> f16

void expect_f16_matches_f16c(const std::vector<float>& inputs, const char* what) {
  Mismatches bad(what);
  for (float x : inputs) {
    const uint16_t got = f32_to_f16_bits(x);
    const uint16_t want = hw_f32_to_f16(x);
    bad.check(got == want, bits_of(x), got, want);
  }
}

// `encode` against the arithmetic reference for format `f` on each of `inputs`; a NaN need only
// stay a quiet NaN of the same sign and top payload bits.
void expect_encoding_matches_reference(Format f, uint16_t (*encode)(float),
                                       const std::vector<float>& inputs, const char* what) {
  Mismatches bad(what);
  for (float x : inputs) {
    const uint16_t got = encode(x);
    if (std::isnan(x)) {
      bad.check(nan_converted_ok(x, got, f), bits_of(x), got, inf_bits(f) | quiet_bit(f));
    } else {
      const uint16_t want = ref_encode(x, f);
      bad.check(got == want, bits_of(x), got, want);
    }
  }
}

TEST(HalfF16, HalfwayPointsRoundLikeF16C) {
  SKIP_WITHOUT_F16C();
  expect_f16_matches_f16c(halfway_points(kF16), "f16 halfway points vs F16C");
}

TEST(HalfF16, HalfwayPointsRoundLikeArithmeticReference) {
  expect_encoding_matches_reference(kF16, f32_to_f16_bits, halfway_points(kF16),
                                    "f16 halfway points vs reference");
}

TEST(HalfF16, SpecialsConvertLikeF16C) {
  SKIP_WITHOUT_F16C();
  expect_f16_matches_f16c(special_floats(), "f16 specials vs F16C");
}

TEST(HalfF16, SpecialsConvertLikeArithmeticReference) {
  expect_encoding_matches_reference(kF16, f32_to_f16_bits, special_floats(),
                                    "f16 specials vs reference");
}

TEST(HalfF16, RandomPatternsRoundLikeF16CAndReference) {
  const std::vector<float> inputs = random_floats();
  expect_encoding_matches_reference(kF16, f32_to_f16_bits, inputs, "f16 random vs reference");
  if (have_f16c()) expect_f16_matches_f16c(inputs, "f16 random vs F16C");
}

struct Case {
  float in;
  uint16_t want;
  const char* what;
};

TEST(HalfF16, HardCases) {
  const float inf = std::numeric_limits<float>::infinity();
  const Case cases[] = {
      {0.0f, 0x0000, "+0"},
      {-0.0f, 0x8000, "-0 keeps its sign"},
      {1.0f, 0x3C00, "1"},
      {-2.0f, 0xC000, "-2"},
      {0x1.002p0f, 0x3C00, "1 + 2^-11: tie, to even (down)"},
      {0x1.006p0f, 0x3C02, "1 + 3*2^-11: tie, to even (up)"},
      {0x1.004p0f, 0x3C01, "1 + 2^-10: exact"},
      {0x1.002002p0f, 0x3C01, "1 + 2^-11 + 2^-23: just above the tie"},
      {2049.0f, 0x6800, "2049: tie between 2048 and 2050, to even"},
      {2051.0f, 0x6802, "2051: tie between 2050 and 2052, to even"},
      {0.1f, 0x2E66, "0.1"},
      {float_of(0x3EAAAAABu), 0x3555, "1/3"},
      {65504.0f, 0x7BFF, "largest finite"},
      {65512.0f, 0x7BFF, "below the overflow halfway point"},
      {0x1.ffdffep15f, 0x7BFF, "65520 - 1 f32 ulp"},
      {65520.0f, 0x7C00, "65520: tie between 65504 (odd) and 2^16, to inf"},
      {65536.0f, 0x7C00, "2^16 overflows"},
      {FLT_MAX, 0x7C00, "FLT_MAX overflows"},
      {-65520.0f, 0xFC00, "-65520 overflows to -inf"},
      {inf, 0x7C00, "inf"},
      {-inf, 0xFC00, "-inf"},
      {0x1p-14f, 0x0400, "smallest normal"},
      {0x1.ffcp-15f, 0x0400, "2^-14 - 2^-25: tie between 0x3FF and 0x400, to even (normal)"},
      {0x1.ff4p-15f, 0x03FE, "2^-14 - 3*2^-25: tie, to even 0x3FE"},
      {0x1.ff8p-15f, 0x03FF, "largest subnormal"},
      {0x1p-24f, 0x0001, "smallest subnormal"},
      {0x1p-25f, 0x0000, "2^-25: tie between 0 and 2^-24, to even (zero)"},
      {-0x1p-25f, 0x8000, "-2^-25: underflows to -0"},
      {0x1.000002p-25f, 0x0001, "2^-25 * (1 + 2^-23): just above the tie"},
      {0x1.fffffep-26f, 0x0000, "just below 2^-25"},
      {0x1.8p-24f, 0x0002, "3*2^-25: tie between 1 and 2 units, to even"},
      {0x1.4p-23f, 0x0002, "5*2^-25: tie between 2 and 3 units, to even"},
      {FLT_MIN, 0x0000, "f32 smallest normal underflows"},
      {std::numeric_limits<float>::denorm_min(), 0x0000, "f32 subnormal underflows"},
      {-std::numeric_limits<float>::denorm_min(), 0x8000, "negative f32 subnormal -> -0"},
      {float_of(0x7FC00000u), 0x7E00, "quiet NaN"},
      {float_of(0xFFC00000u), 0xFE00, "negative quiet NaN"},
      {float_of(0x7F800001u), 0x7E00, "signalling NaN with only a low payload bit stays NaN"},
      {float_of(0xFF800001u), 0xFE00, "same, negative"},
      {float_of(0x7F801FFFu), 0x7E00, "NaN with payload only below the kept bits"},
      {float_of(0x7F802000u), 0x7E01, "lowest kept payload bit survives"},
      {float_of(0x7FFFFFFFu), 0x7FFF, "all-ones NaN"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(f32_to_f16_bits(c.in), c.want)
        << c.what << " (input 0x" << std::hex << bits_of(c.in) << ")";
    if (have_f16c()) {
      EXPECT_EQ(hw_f32_to_f16(c.in), c.want) << "F16C disagrees: " << c.what;
    }
  }
  const struct {
    uint16_t in;
    uint32_t want;
  } decode[] = {
      {0x0000, 0x00000000u},           {0x8000, 0x80000000u},       {0x0001, bits_of(0x1p-24f)},
      {0x03FF, bits_of(0x1.ff8p-15f)}, {0x0400, bits_of(0x1p-14f)}, {0x3C00, 0x3F800000u},
      {0x7BFF, bits_of(65504.0f)},     {0xC000, 0xC0000000u},       {0x7C00, 0x7F800000u},
      {0xFC00, 0xFF800000u},           {0x7E00, 0x7FC00000u},       {0x7C01, 0x7F802000u},
  };
  for (const auto& d : decode) {
    EXPECT_EQ(bits_of(f16_bits_to_f32(d.in)), d.want) << "decoding 0x" << std::hex << d.in;
  }
}

// ---------------------------------------------------------------------------------------------
// bf16

TEST(HalfBF16, AllPatternsDecodeExactly) {
  Mismatches bad("bf16_bits_to_f32");
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float got = bf16_bits_to_f32(h);
    const float by_bits = std::bit_cast<float>(b << 16);
    const double by_math = ref_decode(h, kBF16);
    bool ok = bits_of(got) == bits_of(by_bits);
    ok = ok && (std::isnan(by_math) ? std::isnan(got)
                                    : static_cast<double>(got) == by_math &&
                                          std::signbit(got) == std::signbit(by_math));
    bad.check(ok, b, bits_of(got), bits_of(by_bits));
  }
}

TEST(HalfBF16, RoundTripsEveryPattern) {
  expect_every_pattern_round_trips(kBF16, f32_to_bf16_bits, bf16_bits_to_f32,
                                   "bf16 -> f32 -> bf16");
}

TEST(HalfBF16, HalfwayPointsRoundLikeArithmeticReference) {
  expect_encoding_matches_reference(kBF16, f32_to_bf16_bits, halfway_points(kBF16),
                                    "bf16 halfway points vs reference");
}

TEST(HalfBF16, SpecialsConvertLikeArithmeticReference) {
  expect_encoding_matches_reference(kBF16, f32_to_bf16_bits, special_floats(),
                                    "bf16 specials vs reference");
}

TEST(HalfBF16, RandomPatternsRoundLikeArithmeticReference) {
  expect_encoding_matches_reference(kBF16, f32_to_bf16_bits, random_floats(),
                                    "bf16 random vs reference");
}

TEST(HalfBF16, HardCases) {
  const float inf = std::numeric_limits<float>::infinity();
  const Case cases[] = {
      {0.0f, 0x0000, "+0"},
      {-0.0f, 0x8000, "-0 keeps its sign"},
      {1.0f, 0x3F80, "1"},
      {3.0f, 0x4040, "3"},
      {-1.5f, 0xBFC0, "-1.5"},
      {0x1.01p0f, 0x3F80, "1 + 2^-8: tie, to even (down)"},
      {0x1.03p0f, 0x3F82, "1 + 3*2^-8: tie, to even (up)"},
      {0x1.010002p0f, 0x3F81, "1 + 2^-8 + 2^-23: just above the tie"},
      {0.1f, 0x3DCD, "0.1 (0x3DCCCCCD) rounds up"},
      {float_of(0x3EAAAAABu), 0x3EAB, "1/3"},
      {FLT_MAX, 0x7F80, "FLT_MAX is above the last halfway point: inf"},
      {float_of(0x7F7F7FFFu), 0x7F7F, "just below the overflow halfway point"},
      {float_of(0x7F7F8000u), 0x7F80, "overflow halfway point: 0x7F7F is odd, ties to inf"},
      {float_of(0x7F7E8000u), 0x7F7E, "tie below it goes to even 0x7F7E"},
      {float_of(0xFF7FFFFFu), 0xFF80, "-FLT_MAX -> -inf"},
      {inf, 0x7F80, "inf"},
      {-inf, 0xFF80, "-inf"},
      {FLT_MIN, 0x0080, "f32 smallest normal is exact"},
      {std::numeric_limits<float>::denorm_min(), 0x0000,
       "f32 smallest subnormal (2^-149) is far below half of bf16's 2^-133"},
      {-std::numeric_limits<float>::denorm_min(), 0x8000, "negative one -> -0"},
      {float_of(0x00008000u), 0x0000, "2^-134: tie between 0 and 2^-133, to even"},
      {float_of(0x00008001u), 0x0001, "just above that tie"},
      {float_of(0x00018000u), 0x0002, "3*2^-134: tie, to even 0x0002"},
      {float_of(0x00010000u), 0x0001, "smallest bf16 subnormal is exact"},
      {float_of(0x007FFFFFu), 0x0080, "largest f32 subnormal rounds up to the smallest normal"},
      {float_of(0x7FC00000u), 0x7FC0, "quiet NaN"},
      {float_of(0xFFC00000u), 0xFFC0, "negative quiet NaN"},
      {float_of(0x7F800001u), 0x7FC0, "signalling NaN with only a low payload bit stays NaN"},
      {float_of(0xFF800001u), 0xFFC0, "same, negative"},
      {float_of(0x7F80FFFFu), 0x7FC0, "payload only below the kept bits must not round to inf"},
      {float_of(0x7F810000u), 0x7FC1, "lowest kept payload bit survives"},
      {float_of(0x7FFFFFFFu), 0x7FFF, "all-ones NaN must not carry into -0"},
      {float_of(0xFFFFFFFFu), 0xFFFF, "negative all-ones NaN must not wrap"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(f32_to_bf16_bits(c.in), c.want)
        << c.what << " (input 0x" << std::hex << bits_of(c.in) << ")";
  }
  EXPECT_EQ(bits_of(bf16_bits_to_f32(0x0001)), 0x00010000u);
  EXPECT_EQ(bits_of(bf16_bits_to_f32(0x8000)), 0x80000000u);
  EXPECT_EQ(bits_of(bf16_bits_to_f32(0x7F7F)), 0x7F7F0000u);
  EXPECT_EQ(bits_of(bf16_bits_to_f32(0xFF80)), 0xFF800000u);
  EXPECT_EQ(bits_of(bf16_bits_to_f32(0x7F81)), 0x7F810000u);
}

// ---------------------------------------------------------------------------------------------
// The storage types and compile-time use

static_assert(mt::f32_to_f16_bits(65520.0f) == 0x7C00);
static_assert(mt::f32_to_f16_bits(0x1p-25f) == 0x0000);
static_assert(mt::f16_bits_to_f32(0x0001) == 0x1p-24f);
static_assert(mt::f32_to_bf16_bits(0x1.03p0f) == 0x3F82);
static_assert(mt::bf16_bits_to_f32(0x3F80) == 1.0f);
static_assert(static_cast<float>(mt::f16_t(0.5f)) == 0.5f);
static_assert(mt::bf16_t::from_bits(0x4040).bits == 0x4040);

// Half values must never take part in float math by accident, in either direction.
static_assert(!std::is_convertible_v<float, mt::f16_t>);
static_assert(!std::is_convertible_v<mt::f16_t, float>);
static_assert(!std::is_convertible_v<float, mt::bf16_t>);
static_assert(!std::is_convertible_v<mt::bf16_t, float>);
static_assert(std::is_constructible_v<mt::f16_t, float>);
static_assert(std::is_constructible_v<float, mt::bf16_t>);
static_assert(std::is_trivially_copyable_v<mt::f16_t>);
static_assert(std::is_trivially_copyable_v<mt::bf16_t>);

TEST(HalfTypes, WrapTheBitConversions) {
  EXPECT_EQ(mt::f16_t().bits, 0);
  EXPECT_EQ(mt::bf16_t().bits, 0);
  EXPECT_EQ(mt::f16_t(1.0f).bits, 0x3C00);
  EXPECT_EQ(mt::bf16_t(1.0f).bits, 0x3F80);
  EXPECT_EQ(mt::f16_t(65520.0f).bits, 0x7C00);
  EXPECT_EQ(static_cast<float>(mt::f16_t::from_bits(0x3555)), 0x1.554p-2f);
  EXPECT_EQ(static_cast<float>(mt::bf16_t::from_bits(0xC040)), -3.0f);
  EXPECT_TRUE(std::isnan(static_cast<float>(mt::f16_t(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(static_cast<float>(mt::bf16_t(std::numeric_limits<float>::quiet_NaN()))));
}

}  // namespace
