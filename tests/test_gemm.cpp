// tests/test_gemm.cpp -- the matmul back end (oneDNN and the own bf16 kernel) against a naive f64
// matmul of the same values, and the own kernel bit for bit against a scalar model of VDPBF16PS.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "mixtape/dsl/half.h"
#include "mixtape/dsl/host_memory.h"
#include "mixtape/runtime/gemm.h"
#include "mixtape/runtime/gemm_bf16.h"
#include "mixtape/runtime/half_convert.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

// A tensor stored in `dtype` together with the exact values it holds, for the f64 reference.
struct Stored {
  mt::DType dtype = mt::f32;
  std::vector<float> words;      // f32 storage
  std::vector<uint16_t> halves;  // f16 / bf16 storage
  std::vector<double> values;

  const void* data() const {
    return dtype == mt::f32 ? static_cast<const void*>(words.data()) : halves.data();
  }
};

uint16_t half_bits(mt::DType dtype, float x) {
  return dtype == mt::bf16 ? mt::f32_to_bf16_bits(x) : mt::f32_to_f16_bits(x);
}

double half_value(mt::DType dtype, uint16_t bits) {
  return dtype == mt::bf16 ? mt::bf16_bits_to_f32(bits) : mt::f16_bits_to_f32(bits);
}

// Stores each float rounded to `dtype`.
Stored store(mt::DType dtype, const std::vector<float>& xs) {
  Stored s;
  s.dtype = dtype;
  for (float x : xs) {
    if (dtype == mt::f32) {
      s.words.push_back(x);
      s.values.push_back(x);
    } else {
      s.halves.push_back(half_bits(dtype, x));
      s.values.push_back(half_value(dtype, s.halves.back()));
    }
  }
  return s;
}

// Multiples of 1/8 in [-1, 1]: exact in every operand type, and every partial sum of up to 130
// products (multiples of 1/64 below 2^8) is exact in f32, so the f32 accumulator holds the exact
// result and a half output must be exactly its round-to-nearest-even value.
std::vector<float> eighths(std::mt19937& rng, int64_t count) {
  std::uniform_int_distribution<int> pick(-8, 8);
  std::vector<float> xs(static_cast<size_t>(count));
  for (float& x : xs) x = static_cast<float>(pick(rng)) / 8.0f;
  return xs;
}

std::vector<float> uniform(std::mt19937& rng, int64_t count) {
  std::uniform_real_distribution<float> pick(-1.0f, 1.0f);
  std::vector<float> xs(static_cast<size_t>(count));
  for (float& x : xs) x = pick(rng);
  return xs;
}

// The spacing of `dtype`'s values around |x|.
double half_spacing(mt::DType dtype, double x) {
  int exponent = 0;
  std::frexp(x, &exponent);  // x = f * 2^exponent with f in [0.5, 1)
  int min_exponent = dtype == mt::bf16 ? -126 : -14;
  int mantissa_bits = dtype == mt::bf16 ? 7 : 10;
  return std::ldexp(1.0, std::max(exponent - 1, min_exponent) - mantissa_bits);
}

double reference_relu(double x) { return (x > 0 || std::isnan(x)) ? x : 0.0; }

struct Reference {
  std::vector<double> value;      // act(a@b + bias), summed in f64 from +0 as the reference does
  std::vector<double> magnitude;  // sum of |a||b| + |bias|, the scale of f32 accumulation error
  // A product rounded to a half type before the bias is added may round the other way after f32
  // accumulation: up to one spacing of that type.
  std::vector<double> slack;
};

Reference naive_matmul(const mt::GemmDesc& d, const Stored& a, const Stored& b,
                       const Stored* bias) {
  Reference r;
  r.value.resize(static_cast<size_t>(d.batch * d.m * d.n));
  r.magnitude.resize(r.value.size());
  r.slack.resize(r.value.size());
  for (int64_t bi = 0; bi < d.batch; ++bi)
    for (int64_t i = 0; i < d.m; ++i)
      for (int64_t j = 0; j < d.n; ++j) {
        double sum = 0.0, magnitude = 0.0;
        for (int64_t p = 0; p < d.k; ++p) {
          double av = a.values[bi * d.m * d.k + (d.transpose_a ? p * d.m + i : i * d.k + p)];
          double bv = b.values[bi * d.k * d.n + (d.transpose_b ? j * d.k + p : p * d.n + j)];
          sum += av * bv;
          magnitude += std::fabs(av * bv);
        }
        size_t at = static_cast<size_t>((bi * d.m + i) * d.n + j);
        if (bias != nullptr && d.product_type != mt::f32) {
          r.slack[at] = 2 * half_spacing(d.product_type, sum);
          sum = half_value(d.product_type, half_bits(d.product_type, static_cast<float>(sum)));
        }
        if (bias != nullptr) {
          sum += bias->values[j];
          magnitude += std::fabs(bias->values[j]);
        }
        r.value[at] = d.relu ? reference_relu(sum) : sum;
        r.magnitude[at] = magnitude;
      }
  return r;
}

// Output storage with room for `count` elements of `dtype`, as bytes so one type serves all.
std::vector<uint32_t> output_buffer(int64_t count) {
  return std::vector<uint32_t>(static_cast<size_t>(std::max<int64_t>(count, 1)), 0xDEADBEEFu);
}

double output_value(mt::DType dtype, const std::vector<uint32_t>& out, int64_t i) {
  if (dtype == mt::f32) return std::bit_cast<float>(out[i]);
  return half_value(dtype, reinterpret_cast<const uint16_t*>(out.data())[i]);
}

uint32_t output_bits(mt::DType dtype, const std::vector<uint32_t>& out, int64_t i) {
  if (dtype == mt::f32) return out[i];
  return reinterpret_cast<const uint16_t*>(out.data())[i];
}

// The stored bits of `x` (exact in f32) in `dtype`, rounded to nearest even.
uint32_t expected_bits(mt::DType dtype, double x) {
  float f = static_cast<float>(x);
  return dtype == mt::f32 ? std::bit_cast<uint32_t>(f) : half_bits(dtype, f);
}

// Distance in representable values between two finite half bit patterns (+0 and -0 coincide).
int64_t ulp_distance(uint32_t x, uint32_t y) {
  auto ordered = [](uint32_t bits) -> int64_t {
    return (bits & 0x8000u) ? -static_cast<int64_t>(bits & 0x7FFFu) : (bits & 0x7FFFu);
  };
  return std::abs(ordered(x) - ordered(y));
}

std::string label(const mt::GemmDesc& d) {
  const char* kernel = d.operand != mt::bf16                      ? ""
                       : d.bf16_kernel == mt::Bf16Kernel::native  ? " native"
                       : d.bf16_kernel == mt::Bf16Kernel::widened ? " widened"
                       : d.bf16_kernel == mt::Bf16Kernel::own     ? " own"
                                                                  : " automatic";
  return fmt::format(
      "batch {} m {} n {} k {} ta {} tb {} operand {}{} out {} bias {} after {} relu {}", d.batch,
      d.m, d.n, d.k, d.transpose_a, d.transpose_b, mt::name(d.operand), kernel, mt::name(d.out),
      d.has_bias ? mt::name(d.bias_type) : "none", mt::name(d.product_type), d.relu);
}

// Runs one problem on both families of values and checks every element. Returns false (after
// reporting) on the first failing problem, so a broken build does not print thousands of lines.
bool check_problem(const mt::GemmDesc& d, std::mt19937& rng) {
  for (bool exact : {true, false}) {
    auto values = [&](int64_t count) { return exact ? eighths(rng, count) : uniform(rng, count); };
    Stored a = store(d.operand, values(d.batch * d.m * d.k));
    Stored b = store(d.operand, values(d.batch * d.k * d.n));
    Stored bias = store(d.bias_type, values(d.n));
    const int64_t count = d.batch * d.m * d.n;
    std::vector<uint32_t> out = output_buffer(count);
    mt::gemm(d, a.data(), b.data(), out.data(), d.has_bias ? bias.data() : nullptr);
    if (count == 0) {
      if (out[0] != 0xDEADBEEFu) {
        ADD_FAILURE() << label(d) << ": an empty product wrote its output";
        return false;
      }
      continue;
    }
    Reference ref = naive_matmul(d, a, b, d.has_bias ? &bias : nullptr);
    for (int64_t i = 0; i < count; ++i) {
      const double want = ref.value[i], got = output_value(d.out, out, i);
      const double f32_error = 1e-5 * ref.magnitude[i] + ref.slack[i];
      bool ok;
      if (exact)  // the f32 accumulator is exact: the result must be its RNE rounding, bit for bit
        ok = output_bits(d.out, out, i) == expected_bits(d.out, want);
      else if (d.out == mt::f32)
        ok = std::fabs(got - want) <= f32_error;
      else  // one ulp from the RNE rounding of the f64 value, or as close as f32 sums can be
        ok = ulp_distance(output_bits(d.out, out, i), expected_bits(d.out, want)) <= 1 ||
             std::fabs(got - want) <= f32_error + half_spacing(d.out, want) / 2;
      if (!ok) {
        ADD_FAILURE() << label(d) << (exact ? " (exact values)" : " (random values)")
                      << ": element " << i << " is " << got << ", want " << want;
        return false;
      }
    }
  }
  return true;
}

struct Operand {
  mt::DType dtype;
  mt::Bf16Kernel kernel;
};

// Every operand type and bf16 kernel this CPU runs: f32, f16, bf16 automatic and widened, bf16
// native where oneDNN has it (AVX-512), and bf16
// on the own kernel where the CPU has AVX512-BF16.
std::vector<Operand> all_operands() {
  std::vector<Operand> operands = {{mt::f32, mt::Bf16Kernel::automatic},
                                   {mt::f16, mt::Bf16Kernel::automatic},
                                   {mt::bf16, mt::Bf16Kernel::automatic},
                                   {mt::bf16, mt::Bf16Kernel::widened}};
  if (mt::gemm_bf16_native_available()) operands.push_back({mt::bf16, mt::Bf16Kernel::native});
  if (mt::gemm_bf16_own_available()) operands.push_back({mt::bf16, mt::Bf16Kernel::own});
  return operands;
}

TEST(Gemm, MatchesF64ReferenceForAllDtypesTransposesShapesAndEpilogues) {
  const int64_t shapes[][3] = {{1, 1, 1},   {7, 33, 130}, {130, 7, 33}, {33, 130, 7}, {1, 130, 33},
                               {130, 1, 7}, {7, 7, 0},    {0, 7, 7},    {7, 0, 7}};
  const std::vector<Operand> operands = all_operands();
  const mt::DType floats[] = {mt::f32, mt::bf16, mt::f16};
  std::mt19937 rng(20240611);
  int checked = 0;
  for (const Operand& operand : operands)
    for (mt::DType out : floats)
      for (int transposes = 0; transposes < 4; ++transposes)
        for (int64_t batch : {1, 3})
          for (int epilogue = 0; epilogue < 4; ++epilogue)
            for (const auto& shape : shapes) {
              mt::GemmDesc d;
              d.batch = batch;
              d.m = shape[0], d.n = shape[1], d.k = shape[2];
              d.transpose_a = transposes & 1;
              d.transpose_b = transposes & 2;
              d.operand = operand.dtype;
              d.bf16_kernel = operand.kernel;
              d.out = out;
              d.has_bias = epilogue & 1;
              d.relu = epilogue & 2;
              d.bias_type = floats[(checked / 7) % 3];
              ASSERT_TRUE(mt::gemm_supported(d)) << label(d);
              ASSERT_TRUE(check_problem(d, rng));
              ++checked;
            }
  EXPECT_EQ(checked, static_cast<int>(operands.size()) * 3 * 4 * 2 * 4 * 9);
}

// Large enough for oneDNN's multithreaded kernels (small ones run on the calling thread alone).
TEST(Gemm, MultithreadedProblemsMatchF64Reference) {
  std::mt19937 rng(11);
  const std::vector<Operand> operands = all_operands();
  for (const Operand& operand : operands)
    for (int transposes = 0; transposes < 4; ++transposes) {
      mt::GemmDesc d;
      d.batch = 2, d.m = 97, d.n = 131, d.k = 65;
      d.transpose_a = transposes & 1, d.transpose_b = transposes & 2;
      d.operand = operand.dtype, d.bf16_kernel = operand.kernel;
      d.out = transposes % 2 ? mt::f16 : mt::bf16;
      d.has_bias = true, d.bias_type = mt::bf16, d.relu = transposes < 2;
      ASSERT_TRUE(check_problem(d, rng));
    }
}

// Weight gradients (a transposed, b not, a small result over a long k) are split along k into
// four parts, whatever the number of threads, and their f32 parts summed before the bias, relu
// and one rounding.
TEST(Gemm, KSplitWeightGradientsMatchF64Reference) {
  std::mt19937 rng(13);
  const Operand operands[] = {{mt::f32, mt::Bf16Kernel::automatic},
                              {mt::f16, mt::Bf16Kernel::automatic},
                              {mt::bf16, mt::Bf16Kernel::automatic}};
  for (const Operand& operand : operands)
    for (int epilogue = 0; epilogue < 4; ++epilogue) {
      mt::GemmDesc d;
      d.m = 64, d.n = 48, d.k = 2048;
      d.transpose_a = true;
      d.operand = operand.dtype, d.bf16_kernel = operand.kernel;
      d.out = epilogue % 2 ? mt::f32 : mt::bf16;
      d.has_bias = epilogue & 1, d.bias_type = mt::bf16, d.relu = epilogue & 2;
      EXPECT_NE(mt::gemm_kernel(d).find("k split in"), std::string::npos) << mt::gemm_kernel(d);
      ASSERT_TRUE(check_problem(d, rng));
      d.transpose_b = true;  // not a weight gradient's layout: not split
      EXPECT_EQ(mt::gemm_kernel(d).find("k split"), std::string::npos) << mt::gemm_kernel(d);
      ASSERT_TRUE(check_problem(d, rng));
    }
}

// A fused Linear whose matmul is stored half rounds the product to that type before adding the
// bias (GemmDesc::product_type), as the unfused graph does: on every kernel, including the own
// one's registers, the k split's sums and the team's items, with tails of rows and columns.
TEST(Gemm, BiasAfterRoundingTheProductMatchesF64Reference) {
  std::mt19937 rng(23);
  const int64_t shapes[][4] = {
      {1, 37, 67, 45}, {1, 130, 64, 64}, {3, 7, 33, 130}, {1, 64, 48, 2048}, {2, 97, 131, 65}};
  for (const Operand& operand : all_operands())
    for (mt::DType product : {mt::bf16, mt::f16})
      for (mt::DType out : {mt::f32, mt::bf16})
        for (const auto& shape : shapes) {
          mt::GemmDesc d;
          d.batch = shape[0], d.m = shape[1], d.n = shape[2], d.k = shape[3];
          d.transpose_a = d.k == 2048;  // a weight gradient's layout: split along k
          d.transpose_b = !d.transpose_a;
          d.operand = operand.dtype, d.bf16_kernel = operand.kernel;
          d.out = out, d.has_bias = true, d.bias_type = product, d.product_type = product;
          d.relu = d.m % 2 == 1;
          ASSERT_TRUE(check_problem(d, rng));
        }
}

TEST(Gemm, AutomaticBf16KernelIsCorrectOnBothSidesOfItsThreshold) {
  std::mt19937 rng(7);
  for (int64_t size : {8, 200}) {  // 8 rows: native; 200 x 200: widened
    mt::GemmDesc d;
    d.m = size, d.n = 200, d.k = 40, d.operand = mt::bf16, d.out = mt::bf16;
    d.transpose_b = true, d.has_bias = true, d.relu = true;
    EXPECT_TRUE(check_problem(d, rng));
  }
}

// Where oneDNN runs a bf16 product on AMX tiles (4 to 8 times the f32 kernel's speed at every
// shape measured), the automatic choice is that kernel, for small and large shapes alike; on
// other machines it is one of the two kernels. Either way the choice is fixed per shape.
// On a CPU without AVX-512 (an AMD EPYC of the Zen 2 or 3 kind) oneDNN 2.6 has no bf16 matmul:
// the automatic choice widens every bf16 product, and asking for the native kernel is an error.
TEST(Gemm, Bf16ProductsAreWidenedWhereOneDnnHasNoBf16Matmul) {
  if (mt::gemm_bf16_native_available()) GTEST_SKIP() << "oneDNN has a bf16 matmul on this CPU";
  std::mt19937 rng(31);
  mt::GemmDesc d;
  d.m = 256, d.n = 16, d.k = 64, d.operand = mt::bf16, d.out = mt::bf16, d.transpose_b = true;
  EXPECT_NE(mt::gemm_kernel(d).find("widened to f32"), std::string::npos) << mt::gemm_kernel(d);
  EXPECT_TRUE(check_problem(d, rng));
  d.bf16_kernel = mt::Bf16Kernel::native;
  EXPECT_THROW(mt::gemm_kernel(d), mt::Error);
}

TEST(Gemm, AutomaticBf16KernelIsAmxWhereOneDnnHasIt) {
  if (!mt::gemm_bf16_native_available()) GTEST_SKIP() << "oneDNN has no bf16 matmul on this CPU";
  for (const auto& shape :
       {std::array<int64_t, 3>{256, 64, 64}, {256, 256, 256}, {512, 512, 512}}) {
    mt::GemmDesc d;
    d.m = shape[0], d.n = shape[1], d.k = shape[2], d.operand = mt::bf16;
    mt::GemmDesc native = d, widened = d;
    native.bf16_kernel = mt::Bf16Kernel::native;
    widened.bf16_kernel = mt::Bf16Kernel::widened;
    const std::string automatic_kernel = mt::gemm_kernel(d),
                      native_kernel = mt::gemm_kernel(native);
    EXPECT_EQ(mt::gemm_kernel(d), automatic_kernel) << label(d);
    EXPECT_NE(mt::gemm_kernel(widened).find("widened to f32"), std::string::npos) << label(d);
    mt::GemmDesc own = d;
    own.bf16_kernel = mt::Bf16Kernel::own;
    const double flops = 2.0 * static_cast<double>(d.m * d.n * d.k);
    if (native_kernel.find("amx") != std::string::npos)
      EXPECT_EQ(automatic_kernel, native_kernel) << label(d);
    else if (mt::bf16_dot_speed_over_f32() >= 1.0)  // bf16 stays bf16: own when small
      EXPECT_EQ(automatic_kernel, flops <= 0x1p21 && (d.n >= 64 || (d.n >= 32 && d.m <= 128))
                                      ? mt::gemm_kernel(own)
                                      : native_kernel)
          << label(d);
    else
      EXPECT_TRUE(automatic_kernel == native_kernel || automatic_kernel == mt::gemm_kernel(widened))
          << label(d) << ": " << automatic_kernel;
  }
  std::cout << "[ info ] bf16 256^3 runs " << mt::gemm_kernel([] {
    mt::GemmDesc d;
    d.m = d.n = d.k = 256, d.operand = mt::bf16;
    return d;
  }()) << "\n";
}

// Where oneDNN rounds an AMX product's bf16 result itself, the bits equal the f32 result of the
// same product rounded by dsl/half.h: ties, NaNs (quieted, sign and payload kept) and infinities
// included. Elsewhere the two go through the same epilogue and the test checks that instead.
TEST(Gemm, Bf16ResultsEqualTheF32ResultRoundedOnce) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::array<int64_t, 5> shapes[] = {{1, 4096, 64, 64, 0},
                                           {48, 64, 32, 64, 1},
                                           {1, 768, 512, 128, 2},
                                           {1, 33, 17, 65, 3},
                                           {1, 256, 256, 256, 0}};
  for (const auto& [batch, m, n, k, variant] : shapes) {
    mt::GemmDesc d;
    d.batch = batch, d.m = m, d.n = n, d.k = k, d.operand = mt::bf16;
    d.transpose_a = variant == 1, d.transpose_b = variant == 2, d.has_bias = variant == 3;
    std::vector<uint16_t> a(batch * m * k), b(batch * k * n), out16(batch * m * n);
    for (uint16_t& v : a) v = mt::f32_to_bf16_bits(normal(rng));
    for (uint16_t& v : b) v = mt::f32_to_bf16_bits(normal(rng));
    // A row of NaNs with a payload and a row of infinities (in a's first and last stored rows).
    for (int64_t i = 0; i < k; ++i) a[i] = 0xFFC3, a[a.size() - 1 - i] = 0x7F80;
    std::vector<float> bias(n);
    for (float& v : bias) v = normal(rng);
    if (d.has_bias) {
      // Row 1, column 0: the product 2^-126 (normal) plus the bias -2^-127 is the f32 subnormal
      // 2^-127, which rounds to the bf16 subnormal 0x0040 (a flush would give 0).
      std::fill(a.begin() + k, a.begin() + 2 * k, uint16_t{0});
      a[k] = mt::f32_to_bf16_bits(0x1p-63f);
      b[0] = mt::f32_to_bf16_bits(0x1p-63f);
      bias[0] = -0x1p-127f;
    }
    std::vector<float> out32(out16.size());
    mt::GemmDesc f32_out = d;
    d.out = mt::bf16;
    mt::gemm(f32_out, a.data(), b.data(), out32.data(), bias.data());
    mt::gemm(d, a.data(), b.data(), out16.data(), bias.data());
    SCOPED_TRACE(label(d) + ": " + mt::gemm_kernel(d));
    for (size_t i = 0; i < out16.size(); ++i)
      ASSERT_EQ(out16[i], mt::f32_to_bf16_bits(out32[i])) << "element " << i << " of " << out32[i];
    if (d.has_bias) {
      EXPECT_EQ(out16[n], 0x0040) << "the subnormal sum of row 1, column 0";
    }
  }
}

// Operands copied with padded rows for oneDNN's f32 kernel (OperandRows, which the automatic
// choice takes on AVX2 CPUs for k-major operands a multiple of 256 elements wide) give the f64
// reference's results on every transpose, batch and epilogue, and the same bits as the operands
// read as stored, at the shapes where the automatic choice pads.
TEST(Gemm, PaddedOperandRowsMatchTheReferenceAndTheDenseBits) {
  std::mt19937 rng(29);
  const Operand operands[] = {{mt::f32, mt::Bf16Kernel::automatic},
                              {mt::f16, mt::Bf16Kernel::automatic},
                              {mt::bf16, mt::Bf16Kernel::widened}};
  for (const Operand& operand : operands)
    for (int variant = 0; variant < 8; ++variant) {
      mt::GemmDesc d;
      d.batch = variant < 4 ? 1 : 3, d.m = 33, d.n = 17, d.k = 65;
      d.transpose_a = variant & 1, d.transpose_b = variant & 2;
      d.operand = operand.dtype, d.bf16_kernel = operand.kernel;
      d.out = variant % 3 == 0 ? mt::bf16 : mt::f32;
      d.has_bias = variant % 2 == 0, d.relu = variant == 6;
      d.operand_rows = mt::OperandRows::padded;
      ASSERT_NE(mt::gemm_kernel(d).find("rows"), std::string::npos) << mt::gemm_kernel(d);
      ASSERT_TRUE(check_problem(d, rng));
    }
  // A batch-1 product's whole time is one read of b: b is never copied for it.
  const mt::GemmDesc batch_one{.m = 1, .n = 512, .k = 512};
  EXPECT_EQ(mt::gemm_kernel(batch_one).find("copied"), std::string::npos)
      << mt::gemm_kernel(batch_one);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::array<int64_t, 4> shapes[] = {
      {512, 512, 512, 0}, {512, 512, 512, 1}, {256, 1024, 256, 0}, {1024, 256, 256, 1}};
  for (const auto& [m, n, k, transpose_a] : shapes)
    for (const Operand& operand : operands) {
      mt::GemmDesc d;
      d.m = m, d.n = n, d.k = k, d.transpose_a = transpose_a;
      d.operand = operand.dtype, d.bf16_kernel = operand.kernel;
      std::vector<float> a(m * k), b(k * n);
      for (float& v : a) v = normal(rng);
      for (float& v : b) v = normal(rng);
      Stored a_stored = store(d.operand, a), b_stored = store(d.operand, b);
      std::vector<float> dense(m * n), padded(m * n), automatic(m * n);
      for (auto [rows, out] :
           {std::pair{mt::OperandRows::dense, &dense}, std::pair{mt::OperandRows::padded, &padded},
            std::pair{mt::OperandRows::automatic, &automatic}}) {
        d.operand_rows = rows;
        mt::gemm(d, a_stored.data(), b_stored.data(), out->data());
      }
      SCOPED_TRACE(label(d) + ": " + mt::gemm_kernel(d));
      // The same oneDNN kernel sums in the same order whatever the rows' stride (on AVX-512 CPUs
      // oneDNN may pick another kernel for strided rows, with its own order).
      auto kernel_of = [&](mt::OperandRows rows) {
        d.operand_rows = rows;
        const std::string text = mt::gemm_kernel(d);
        return text.substr(0, text.find(", operands copied"));
      };
      const std::string dense_kernel = kernel_of(mt::OperandRows::dense);
      for (auto [rows, out] : {std::pair{mt::OperandRows::padded, &padded},
                               std::pair{mt::OperandRows::automatic, &automatic}}) {
        if (kernel_of(rows) != dense_kernel) continue;
        for (int64_t i = 0; i < m * n; ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>((*out)[i]), std::bit_cast<uint32_t>(dense[i])) << i;
      }
    }
}

// Halfway cases and the ends of the ranges, with hand-written expected bits: sum = x + y (f32
// operands, b = [1, 1]) must be rounded once, to nearest even.
TEST(Gemm, HalfOutputsRoundOnceToNearestEven) {
  struct Case {
    float x, y;
    mt::DType out;
    uint16_t want;
  };
  const Case cases[] = {
      {1.0f, 0x1p-8f, mt::bf16, 0x3F80},          // halfway to 0x3F81: stays even
      {1.0f, 0x1.8p-7f, mt::bf16, 0x3F82},        // halfway between 0x3F81 and 0x3F82
      {1.0f, 0x1.01p-8f, mt::bf16, 0x3F81},       // just above halfway: up
      {-1.0f, -0x1p-8f, mt::bf16, 0xBF80},        // signs are symmetric
      {0x1p-133f, 0x1p-134f, mt::bf16, 0x0002},   // 1.5 subnormal units: even, up
      {0x1p-134f, 0.0f, mt::bf16, 0x0000},        // half a subnormal unit: down to +0
      {0x1.fep127f, 0x1p119f, mt::bf16, 0x7F80},  // halfway above the largest: inf
      {1.0f, 0x1p-11f, mt::f16, 0x3C00},          // halfway: stays even
      {1.0f, 0x1.8p-10f, mt::f16, 0x3C02},        // halfway between 0x3C01 and 0x3C02
      {0x1p-24f, 0x1p-25f, mt::f16, 0x0002},      // 1.5 subnormal units
      {0x1p-25f, 0.0f, mt::f16, 0x0000},          // half a unit: +0
      {65504.0f, 15.0f, mt::f16, 0x7BFF},         // below halfway above the largest
      {65504.0f, 16.0f, mt::f16, 0x7C00},         // halfway: inf
      {-65504.0f, -16.0f, mt::f16, 0xFC00},
  };
  for (const Case& c : cases) {
    mt::GemmDesc d;
    d.m = 1, d.n = 1, d.k = 2, d.out = c.out;
    const float a[] = {c.x, c.y}, b[] = {1.0f, 1.0f};
    uint16_t got = 0xFFFF;
    mt::gemm(d, a, b, &got);
    EXPECT_EQ(got, c.want) << c.x << " + " << c.y << " to " << mt::name(c.out);
  }
}

// The bias is added to the f32 accumulator and the sum rounded once: (1 + 2^-8) + 2^-9 is 3/4 of a
// bf16 ulp above 1 and rounds up, while rounding the product first (a tie, down to 1) and then
// adding 2^-9 (a quarter ulp, down again) would give 1.
TEST(Gemm, BiasIsAddedBeforeTheSingleRounding) {
  mt::GemmDesc d;
  d.m = 1, d.n = 1, d.k = 2, d.out = mt::bf16, d.has_bias = true, d.bias_type = mt::f32;
  const float a[] = {1.0f, 0x1p-8f}, b[] = {1.0f, 1.0f}, bias[] = {0x1p-9f};
  uint16_t got = 0;
  mt::gemm(d, a, b, &got, bias);
  EXPECT_EQ(got, 0x3F81);
}

TEST(Gemm, ZeroSignsAndReluMatchTheReference) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // a = [1; 0] (m = 2, k = 1), b = [-2, 0, nan, 3, -0]: row 1 is all products of +-0.
  const std::vector<float> a_values = {1.0f, 0.0f}, b_values = {-2.0f, 0.0f, nan, 3.0f, -0.0f};
  for (const Operand& operand : all_operands())
    for (mt::DType out : {mt::f32, mt::bf16, mt::f16})
      for (bool relu : {false, true}) {
        mt::GemmDesc d;
        d.m = 2, d.n = 5, d.k = 1, d.operand = operand.dtype, d.bf16_kernel = operand.kernel;
        d.out = out, d.relu = relu;
        Stored a = store(d.operand, a_values), b = store(d.operand, b_values);
        std::vector<uint32_t> got = output_buffer(10);
        mt::gemm(d, a.data(), b.data(), got.data());
        // The reference sums from +0, so every zero is +0; relu maps negatives to +0.
        const double want[] = {relu ? 0.0 : -2.0, 0.0, nan, 3.0, 0.0, 0.0, 0.0, nan, 0.0, 0.0};
        for (int i = 0; i < 10; ++i) {
          double value = output_value(out, got, i);
          if (std::isnan(want[i])) {
            EXPECT_TRUE(std::isnan(value)) << label(d) << " element " << i;
          } else {
            EXPECT_EQ(value, want[i]) << label(d) << " element " << i;
            EXPECT_FALSE(std::signbit(value) && want[i] == 0.0) << label(d) << " -0 at " << i;
          }
        }
      }
}

TEST(Gemm, EmptySumGivesTheEpilogueOfZero) {
  mt::GemmDesc d;
  d.batch = 2, d.m = 2, d.n = 3, d.k = 0, d.out = mt::bf16, d.has_bias = true;
  d.bias_type = mt::f16, d.relu = true;
  const uint16_t bias[] = {mt::f32_to_f16_bits(-1.5f), mt::f32_to_f16_bits(2.5f),
                           mt::f32_to_f16_bits(-0.0f)};
  std::vector<uint16_t> out(12, 0xFFFF);
  mt::gemm(d, nullptr, nullptr, out.data(), bias);
  for (int i = 0; i < 12; ++i)
    EXPECT_EQ(out[i], i % 3 == 1 ? mt::f32_to_bf16_bits(2.5f) : 0x0000) << "element " << i;
}

// A large product's workspace (f16 operands widened to f32, 8 and 12 MiB, and the f32 result
// before its rounding, 6 MiB) counts in the memory peak while the call runs and is not live after
// it, so that it adds to no later peak (a GPT's largest product kept 0.2 GiB live that way).
TEST(Gemm, LargeWorkspaceIsNotLiveAfterTheCall) {
  mt::GemmDesc d;
  d.m = 1024, d.n = 1536, d.k = 2048, d.operand = mt::f16, d.out = mt::f16;
  std::vector<uint16_t> a(d.m * d.k, mt::f32_to_f16_bits(0.5f));
  std::vector<uint16_t> b(d.k * d.n, mt::f32_to_f16_bits(0.25f)), out(d.m * d.n);
  const int64_t before = mt::host_memory_stats().live_bytes;
  mt::reset_host_memory_peak();
  mt::gemm(d, a.data(), b.data(), out.data());
  EXPECT_EQ(out[0], mt::f32_to_f16_bits(256.0f));
  EXPECT_EQ(out.back(), mt::f32_to_f16_bits(256.0f));
  const mt::HostMemoryStats after = mt::host_memory_stats();
  EXPECT_LE(after.live_bytes, before);
  // At least the 8 + 12 MiB of widened operands at once, less what earlier, smaller calls on
  // this thread kept (at most 4 MiB in each of the a, b and result buffers).
  EXPECT_GE(after.peak_bytes - before, int64_t{8} << 20);
}

// A 16-bit result larger than the workspace's cut (16 MiB as f32) runs in pieces, of rows or of
// whole batch entries, each rounded into its part of the result: the values are the whole
// product's (integers, exact in any order of summation, rounded once) and the f32 copy never
// holds the whole result (64.6 MiB here; an autocast GPT's logits product held 256 MiB that
// way). f16 operands are widened (b once for all the pieces); bf16 ones run oneDNN's bf16
// kernel where it has one.
TEST(Gemm, LargeHalfResultsRunInPiecesOfBoundedWorkspace) {
  std::vector<mt::DType> types{mt::f16};
  if (mt::gemm_bf16_native_available()) types.push_back(mt::bf16);
  struct Case {
    int64_t batch;
    bool transpose_b, epilogue;  // epilogue: a bias added after the product's rounding, a relu
  };
  for (mt::DType type : types)
    for (Case c : {Case{1, false, false}, Case{1, true, false}, Case{6, false, false},
                   Case{6, true, false}, Case{1, false, true}}) {
      SCOPED_TRACE(fmt::format("{}, batch {}, b transposed {}, epilogue {}", mt::name(type),
                               c.batch, c.transpose_b, c.epilogue));
      auto bits = [&](float value) {
        return type == mt::f16 ? mt::f32_to_f16_bits(value) : mt::f32_to_bf16_bits(value);
      };
      auto rounded = [&](float value) {
        return type == mt::f16 ? mt::f16_bits_to_f32(bits(value))
                               : mt::bf16_bits_to_f32(bits(value));
      };
      mt::GemmDesc d;
      d.batch = c.batch, d.k = 64, d.transpose_b = c.transpose_b;
      d.m = c.batch == 1 ? 4133 : 1000, d.n = c.batch == 1 ? 4096 : 1500;
      d.operand = type, d.out = type, d.bf16_kernel = mt::Bf16Kernel::native;
      d.has_bias = d.relu = c.epilogue, d.product_type = type;
      auto a_value = [](int64_t e, int64_t i, int64_t p) { return float((e + i * 7 + p) % 5 - 2); };
      auto b_value = [](int64_t e, int64_t p, int64_t j) { return float((e + p * 3 + j) % 7 - 3); };
      auto bias_value = [](int64_t j) { return 0.5f * float(j % 5) - 1.0f; };
      std::vector<uint16_t> a(d.batch * d.m * d.k), b(d.batch * d.k * d.n);
      std::vector<uint16_t> out(d.batch * d.m * d.n);
      std::vector<float> bias(d.n);
      for (int64_t j = 0; j < d.n; ++j) bias[j] = bias_value(j);
      for (int64_t e = 0; e < d.batch; ++e) {
        for (int64_t i = 0; i < d.m; ++i)
          for (int64_t p = 0; p < d.k; ++p) a[(e * d.m + i) * d.k + p] = bits(a_value(e, i, p));
        for (int64_t p = 0; p < d.k; ++p)
          for (int64_t j = 0; j < d.n; ++j)
            b[e * d.k * d.n + (c.transpose_b ? j * d.k + p : p * d.n + j)] = bits(b_value(e, p, j));
      }
      const int64_t before = mt::host_memory_stats().live_bytes;
      mt::reset_host_memory_peak();
      mt::gemm(d, a.data(), b.data(), out.data(), c.epilogue ? bias.data() : nullptr);
      const mt::HostMemoryStats after = mt::host_memory_stats();
      // Live after the call: at most the small buffers a thread keeps (4 MiB each).
      EXPECT_LE(after.live_bytes - before, int64_t{12} << 20);
      const int64_t whole_copy = d.batch * d.m * d.n * 4;
      ASSERT_GT(whole_copy, int64_t{24} << 20);
      // The f32 copy's 16 MiB, plus b widened (1 MiB) and a piece of a widened.
      EXPECT_LE(after.peak_bytes - before, int64_t{20} << 20)
          << "the f32 copy of the result holds " << whole_copy << " bytes";
      int64_t wrong = 0;
      for (int64_t e = 0; e < d.batch; ++e)
        for (int64_t i = 0; i < d.m; ++i)
          for (int64_t j = 0; j < d.n; j += 7) {
            float sum = 0;
            for (int64_t p = 0; p < d.k; ++p) sum += a_value(e, i, p) * b_value(e, p, j);
            if (c.epilogue) sum = std::max(rounded(sum) + bias_value(j), 0.0f);
            wrong += out[(e * d.m + i) * d.n + j] != bits(sum);
          }
      EXPECT_EQ(wrong, 0);
    }
}

TEST(Gemm, PrimitivesAreCachedAndReused) {
  mt::gemm_clear_primitive_cache();
  ASSERT_EQ(mt::gemm_primitive_cache_size(), 0u);
  mt::GemmDesc d;
  d.m = 5, d.n = 6, d.k = 7;
  std::vector<float> a(35, 1.0f), b(42, 1.0f), out(30);
  std::vector<uint16_t> a16(35, mt::f32_to_f16_bits(1.0f)), b16(42, mt::f32_to_f16_bits(1.0f));
  std::vector<uint16_t> out16(30);
  mt::gemm(d, a.data(), b.data(), out.data());
  EXPECT_EQ(mt::gemm_primitive_cache_size(), 1u);
  mt::gemm(d, a.data(), b.data(), out.data());
  EXPECT_EQ(mt::gemm_primitive_cache_size(), 1u);  // same problem: reused
  // f16 operands and half outputs reach oneDNN as the same f32 problem.
  mt::GemmDesc half = d;
  half.operand = mt::f16, half.out = mt::bf16;
  mt::gemm(half, a16.data(), b16.data(), out16.data());
  EXPECT_EQ(mt::gemm_primitive_cache_size(), 1u);
  EXPECT_EQ(out16[0], mt::f32_to_bf16_bits(7.0f));
  mt::GemmDesc other = d;
  other.transpose_a = true;
  mt::gemm(other, a.data(), b.data(), out.data());
  EXPECT_EQ(mt::gemm_primitive_cache_size(), 2u);
  other.relu = true;  // applied after oneDNN: no new primitive
  mt::gemm(other, a.data(), b.data(), out.data());
  EXPECT_EQ(mt::gemm_primitive_cache_size(), 2u);
  other.has_bias = true;  // with the relu, added in the relu's pass: no new primitive
  mt::gemm(other, a.data(), b.data(), out.data(), b.data());
  EXPECT_EQ(mt::gemm_primitive_cache_size(), 2u);
  other.relu = false;  // oneDNN's bias
  mt::gemm(other, a.data(), b.data(), out.data(), b.data());
  EXPECT_EQ(mt::gemm_primitive_cache_size(), 3u);
  mt::gemm_clear_primitive_cache();
  EXPECT_EQ(mt::gemm_primitive_cache_size(), 0u);
  mt::gemm(d, a.data(), b.data(), out.data());
  EXPECT_EQ(out[29], 7.0f);
}

TEST(Gemm, UnsupportedDescriptionsAreReportedWithShapesAndDtypes) {
  mt::GemmDesc d;
  d.batch = 2, d.m = 3, d.n = 4, d.k = 5;
  EXPECT_TRUE(mt::gemm_supported(d));
  float dummy[64] = {};
  for (mt::DType bad : {mt::f64, mt::i32, mt::i64, mt::boolean}) {
    mt::GemmDesc x = d;
    x.operand = bad;
    EXPECT_FALSE(mt::gemm_supported(x));
    EXPECT_MT_ERROR(mt::gemm(x, dummy, dummy, dummy), "unsupported", std::string(mt::name(bad)),
                    "batch 2, m 3, n 4, k 5");
    x = d;
    x.out = bad;
    EXPECT_FALSE(mt::gemm_supported(x));
    x = d;
    x.has_bias = true, x.bias_type = bad;
    EXPECT_FALSE(mt::gemm_supported(x));
    x.has_bias = false;  // an unused bias type does not matter
    EXPECT_TRUE(mt::gemm_supported(x));
  }
  mt::GemmDesc negative = d;
  negative.k = -1;
  EXPECT_FALSE(mt::gemm_supported(negative));
  EXPECT_MT_ERROR(mt::gemm(negative, dummy, dummy, dummy), "k -1");
  mt::GemmDesc biased = d;
  biased.has_bias = true;
  EXPECT_MT_ERROR(mt::gemm(biased, dummy, dummy, dummy), "null bias");
  EXPECT_MT_ERROR(mt::gemm(d, nullptr, dummy, dummy), "null operand");
  mt::GemmDesc own = d;  // the own kernel needs a CPU with AVX512-BF16
  own.operand = mt::bf16, own.bf16_kernel = mt::Bf16Kernel::own;
  if (mt::gemm_bf16_own_available())
    EXPECT_NE(mt::gemm_kernel(own).find("own"), std::string::npos);
  else
    EXPECT_MT_ERROR(mt::gemm_kernel(own), "own bf16 kernel", "lacks");
}

// The reference's relu, as the matmul epilogue applies it before rounding: x for x > 0 and for
// NaN, +0 otherwise (-0 included). In float: reference_relu's trip through double would quiet
// signalling NaNs.
float relu_keeping_nan_bits(float x) { return x > 0.0f || std::isnan(x) ? x : 0.0f; }

// Every conversion runs once with a count above the parallel threshold (2^18) and once below it,
// with the loops compiled for this CPU (AVX-512 where it has it) and with the baseline ones.
class BulkConversions : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { mt::half_convert_force_baseline(GetParam()); }
  void TearDown() override { mt::half_convert_force_baseline(false); }
};

TEST_P(BulkConversions, MatchHalfHForEveryPattern) {
  SCOPED_TRACE(mt::half_convert_isa());
  if (!GetParam() && std::string(mt::half_convert_isa()) == "baseline")
    GTEST_SKIP() << "this CPU has no AVX-512: the baseline case covers it";
  const int64_t counts[] = {int64_t{1} << 19, 1000};
  std::vector<uint16_t> patterns(size_t{1} << 19);  // every 16-bit pattern, 8 times
  for (size_t i = 0; i < patterns.size(); ++i) patterns[i] = static_cast<uint16_t>(i);
  std::vector<float> widened(patterns.size());
  for (int64_t count : counts) {
    std::fill(widened.begin(), widened.end(), 0.0f);
    mt::widen_f16(patterns.data(), widened.data(), count);
    for (int64_t i = 0; i < count; ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(widened[i]),
                std::bit_cast<uint32_t>(mt::f16_bits_to_f32(patterns[i])))
          << "f16 pattern " << patterns[i];
    mt::widen_bf16(patterns.data(), widened.data(), count);
    for (int64_t i = 0; i < count; ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(widened[i]), uint32_t{patterns[i]} << 16)
          << "bf16 pattern " << patterns[i];
  }
  // Narrowing: for every sign and exponent, mantissas at and around the f16 and bf16 rounding
  // points (ties, carries, NaN payloads), then random bit patterns.
  std::vector<float> xs;
  const uint32_t mantissas[] = {0,        1,        0xFFF,    0x1000,   0x1001,
                                0x1FFF,   0x2000,   0x3000,   0x7FFF,   0x8000,
                                0x8001,   0x18000,  0x7FE000, 0x7FEFFF, 0x7FF000,
                                0x7FF001, 0x7FFFFF, 0x400000, 0x400001, 0x200000};
  for (uint32_t sign_exponent = 0; sign_exponent < 512; ++sign_exponent)
    for (uint32_t mantissa : mantissas)
      xs.push_back(std::bit_cast<float>(sign_exponent << 23 | mantissa));
  std::mt19937 rng(3);
  while (xs.size() < 300000) xs.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  std::vector<uint16_t> narrowed(xs.size());
  for (int64_t count : {static_cast<int64_t>(xs.size()), int64_t{12000}}) {
    for (bool relu : {false, true}) {
      SCOPED_TRACE(relu ? "with relu" : "without relu");
      auto expected = [&](int64_t i) { return relu ? relu_keeping_nan_bits(xs[i]) : xs[i]; };
      std::fill(narrowed.begin(), narrowed.end(), 0);
      mt::narrow_to_f16(xs.data(), narrowed.data(), count, relu);
      for (int64_t i = 0; i < count; ++i)
        ASSERT_EQ(narrowed[i], mt::f32_to_f16_bits(expected(i))) << std::hexfloat << xs[i];
      mt::narrow_to_bf16(xs.data(), narrowed.data(), count, relu);
      for (int64_t i = 0; i < count; ++i)
        ASSERT_EQ(narrowed[i], mt::f32_to_bf16_bits(expected(i))) << std::hexfloat << xs[i];
    }
    std::vector<float> relued(xs.begin(), xs.begin() + count);
    mt::relu_in_place(relued.data(), count);
    for (int64_t i = 0; i < count; ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(relued[i]),
                std::bit_cast<uint32_t>(relu_keeping_nan_bits(xs[i])))
          << std::hexfloat << xs[i];
  }
}

INSTANTIATE_TEST_SUITE_P(Gemm, BulkConversions, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Baseline" : "ForThisCpu";
                         });

TEST(Gemm, ConcurrentCallsGiveCorrectResults) {
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t, &failures] {
      std::mt19937 rng(100 + t);
      for (int repeat = 0; repeat < 3; ++repeat) {
        mt::GemmDesc d;
        d.batch = 2, d.m = 33, d.n = 17 + t / 2, d.k = 65;  // two threads share each problem
        d.operand = t < 2 ? mt::f16 : mt::bf16, d.out = mt::bf16, d.has_bias = true;
        if (!check_problem(d, rng)) ++failures;
      }
    });
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

// A scalar model of VDPBF16PS, written from its definition (Intel SDM): a subnormal bf16 operand
// counts as a zero of its sign (DAZ); each of the two multiply-adds of a pair, the odd element's
// first, is rounded once to nearest even in f32 (the product of two bf16 values is exact, so f64
// holds it and the sum rounds as f32 would round the exact value, see below); an f32 subnormal
// sum becomes a zero of its sign (FTZ).
float daz(uint16_t bits) {
  const float x = mt::bf16_bits_to_f32(bits);
  return (bits & 0x7F80u) == 0 ? std::copysign(0.0f, x) : x;
}

float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }

// acc + x * y rounded once. x * y has 16 significant bits and is exact in f64; acc + x * y is
// exact in f64 too unless their exponents are more than 29 bits apart, and then the smaller is
// below half an f32 ulp of the larger and not at a tie, so f64's rounding then f32's gives the
// f32 rounding of the exact sum.
float multiply_add(float acc, uint16_t x, uint16_t y) {
  const double product = static_cast<double>(daz(x)) * static_cast<double>(daz(y));
  return ftz(static_cast<float>(static_cast<double>(acc) + product));
}

// gemm_bf16.h's definition: k padded with a zero to even, pairs in order from +0, bias added last.
std::vector<float> model_gemm(const mt::GemmDesc& d, const std::vector<uint16_t>& a,
                              const std::vector<uint16_t>& b, const std::vector<float>* bias) {
  std::vector<float> out(static_cast<size_t>(d.batch * d.m * d.n));
  const int64_t kp = (d.k + 1) / 2 * 2;
  for (int64_t bi = 0; bi < d.batch; ++bi)
    for (int64_t i = 0; i < d.m; ++i)
      for (int64_t j = 0; j < d.n; ++j) {
        auto a_at = [&](int64_t p) -> uint16_t {
          if (p >= d.k) return 0;
          return a[bi * d.m * d.k + (d.transpose_a ? p * d.m + i : i * d.k + p)];
        };
        auto b_at = [&](int64_t p) -> uint16_t {
          if (p >= d.k) return 0;
          return b[bi * d.k * d.n + (d.transpose_b ? j * d.k + p : p * d.n + j)];
        };
        float acc = 0.0f;
        for (int64_t p = 0; p < kp; p += 2) {
          acc = multiply_add(acc, a_at(p + 1), b_at(p + 1));
          acc = multiply_add(acc, a_at(p), b_at(p));
        }
        out[(bi * d.m + i) * d.n + j] = bias != nullptr ? acc + (*bias)[j] : acc;
      }
  return out;
}

// bf16 bit patterns that reach every case of the definition: ordinary values over a wide range of
// exponents (products that overflow, and products and sums that fall below 2^-126), subnormals,
// signed zeros, infinities and NaNs.
std::vector<uint16_t> awkward_bf16(std::mt19937& rng, int64_t count) {
  std::uniform_int_distribution<int> kind(0, 99), exponent(1, 254), mantissa(0, 127), sign(0, 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> bits(static_cast<size_t>(count));
  for (uint16_t& x : bits) {
    const int k = kind(rng);
    const uint16_t s = static_cast<uint16_t>(sign(rng) << 15);
    if (k < 60)
      x = mt::f32_to_bf16_bits(normal(rng));
    else if (k < 80)  // any normal exponent
      x = static_cast<uint16_t>(s | exponent(rng) << 7 | mantissa(rng));
    else if (k < 86)  // subnormal
      x = static_cast<uint16_t>(s | std::max(1, mantissa(rng)));
    else if (k < 92)  // small normals: their products are f32 subnormals
      x = static_cast<uint16_t>(s | (1 + mantissa(rng) % 40) << 7 | mantissa(rng));
    else if (k < 96)
      x = s;  // +-0
    else if (k < 98)
      x = static_cast<uint16_t>(s | 0x7F80u);  // +-inf
    else
      x = static_cast<uint16_t>(s | 0x7FC0u | mantissa(rng) % 64);  // NaN
  }
  return bits;
}

// The own kernel's f32 results equal the scalar model's bit for bit (NaN for NaN), at every
// shape: row tails of the 6-row tile, column tails of the 64-column panel, odd k, k over one
// block of 128 (resumed from stored sums), a transposed A over 64 rows (two packed panels),
// transposes,
// batches, a bias, and operands at an odd element offset (rows not 4-byte aligned).
TEST(Gemm, OwnBf16KernelMatchesAScalarModelOfVdpbf16psBitForBit) {
  if (!mt::gemm_bf16_own_available()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  std::mt19937 rng(2026);
  const int64_t shapes[][3] = {{1, 1, 1},    {6, 64, 2},   {7, 65, 3},   {13, 130, 67},
                               {5, 17, 64},  {12, 128, 1}, {2, 200, 33}, {37, 48, 130},
                               {9, 70, 300}, {70, 40, 45}};
  int checked = 0;
  for (const auto& shape : shapes)
    for (int transposes = 0; transposes < 4; ++transposes)
      for (int64_t batch : {1, 2})
        for (bool has_bias : {false, true})
          for (int64_t offset : {0, 1}) {
            mt::GemmDesc d;
            d.batch = batch, d.m = shape[0], d.n = shape[1], d.k = shape[2];
            d.transpose_a = transposes & 1, d.transpose_b = transposes & 2;
            d.operand = mt::bf16, d.bf16_kernel = mt::Bf16Kernel::own;
            d.has_bias = has_bias;
            const int64_t a_count = batch * d.m * d.k, b_count = batch * d.k * d.n;
            std::vector<uint16_t> a = awkward_bf16(rng, a_count + offset);
            std::vector<uint16_t> b = awkward_bf16(rng, b_count + offset);
            std::vector<float> bias = uniform(rng, d.n);
            std::vector<float> got(static_cast<size_t>(batch * d.m * d.n), -1.0f);
            mt::gemm(d, a.data() + offset, b.data() + offset, got.data(),
                     has_bias ? bias.data() : nullptr);
            a.erase(a.begin(), a.begin() + offset);
            b.erase(b.begin(), b.begin() + offset);
            const std::vector<float> want = model_gemm(d, a, b, has_bias ? &bias : nullptr);
            for (size_t i = 0; i < want.size(); ++i) {
              const bool same = std::isnan(want[i]) ? std::isnan(got[i])
                                                    : std::bit_cast<uint32_t>(got[i]) ==
                                                          std::bit_cast<uint32_t>(want[i]);
              ASSERT_TRUE(same) << label(d) << " offset " << offset << ": element " << i << " is "
                                << got[i] << ", the model gives " << want[i];
            }
            ++checked;
          }
  EXPECT_EQ(checked, 10 * 4 * 2 * 2 * 2);
}

// The own kernel rounds a bf16 result and applies the relu in registers, on the team from 2^22
// flops: the bits are the scalar model's f32 result put through the reference's relu and
// dsl/half.h's rounding (subnormals kept; NaN for NaN, as the model's payloads are its own), as
// the f32 result and a separate epilogue pass gave. Shapes: one k block, several (k 300: sums
// staged in f32), 192-row work items with a row tail (m 389, on the team), transposed A in 64-row
// panels.
TEST(Gemm, OwnBf16KernelRoundsItsBf16ResultAndReluAsTheEpilogueDoes) {
  if (!mt::gemm_bf16_own_available()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  std::mt19937 rng(2027);
  const int64_t shapes[][3] = {{7, 65, 3}, {13, 130, 67}, {9, 70, 300}, {389, 130, 64}, {2, 64, 1}};
  auto relu = [](float x) { return x > 0 || std::isnan(x) ? x : 0.0f; };
  int checked = 0;
  for (const auto& shape : shapes)
    for (int transposes = 0; transposes < 4; ++transposes)
      for (bool has_bias : {false, true})
        for (mt::DType out : {mt::f32, mt::bf16})
          for (bool with_relu : {false, true}) {
            mt::GemmDesc d;
            d.m = shape[0], d.n = shape[1], d.k = shape[2];
            d.transpose_a = transposes & 1, d.transpose_b = transposes & 2;
            d.operand = mt::bf16, d.bf16_kernel = mt::Bf16Kernel::own;
            d.has_bias = has_bias, d.out = out, d.relu = with_relu;
            std::vector<uint16_t> a = awkward_bf16(rng, d.m * d.k);
            std::vector<uint16_t> b = awkward_bf16(rng, d.k * d.n);
            std::vector<float> bias = uniform(rng, d.n);
            // Tiny biases make sums near zero, whose bf16 rounding of an f32 subnormal is kept.
            if (has_bias) bias[1] = 0x1p-130f, bias[2] = -0x1p-140f;
            std::vector<float> want = model_gemm(d, a, b, has_bias ? &bias : nullptr);
            std::vector<float> got32(want.size(), -1.0f);
            std::vector<uint16_t> got16(want.size(), 0xFFFF);
            mt::gemm(d, a.data(), b.data(),
                     out == mt::f32 ? static_cast<void*>(got32.data()) : got16.data(),
                     has_bias ? bias.data() : nullptr);
            for (size_t i = 0; i < want.size(); ++i) {
              const float x = with_relu ? relu(want[i]) : want[i];
              const bool same = out == mt::f32
                                    ? (std::isnan(x) ? std::isnan(got32[i])
                                                     : std::bit_cast<uint32_t>(got32[i]) ==
                                                           std::bit_cast<uint32_t>(x))
                                    : (std::isnan(x) ? std::isnan(mt::bf16_bits_to_f32(got16[i]))
                                                     : got16[i] == mt::f32_to_bf16_bits(x));
              ASSERT_TRUE(same) << label(d) << ": element " << i << " is "
                                << (out == mt::f32 ? got32[i] : mt::bf16_bits_to_f32(got16[i]))
                                << ", the model gives " << x;
            }
            ++checked;
          }
  EXPECT_EQ(checked, 5 * 4 * 2 * 2 * 2);
}

// The model is no tautology: it flushes what an f32 loop keeps and orders each pair odd first,
// so the own kernel's bits differ from plain f32 sums on inputs built for that.
TEST(Gemm, OwnBf16KernelFlushesSubnormalsAndSumsPairsOddFirst) {
  if (!mt::gemm_bf16_own_available()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  // A 1 x k row times a k x 1 column.
  auto run = [](const std::vector<float>& a, const std::vector<float>& b) {
    mt::GemmDesc d;
    d.m = 1, d.n = 1, d.k = static_cast<int64_t>(a.size());
    d.operand = mt::bf16, d.bf16_kernel = mt::Bf16Kernel::own;
    std::vector<uint16_t> a16, b16;
    for (float x : a) a16.push_back(mt::f32_to_bf16_bits(x));
    for (float x : b) b16.push_back(mt::f32_to_bf16_bits(x));
    float out = -1.0f;
    mt::gemm(d, a16.data(), b16.data(), &out);
    return out;
  };
  EXPECT_EQ(run({0x1p-70f, 0.0f}, {0x1p-70f, 0.0f}), 0.0f);           // product 2^-140: flushed
  EXPECT_EQ(run({0x1p-127f, 0.0f}, {2.0f, 0.0f}), 0.0f);              // subnormal operand: a zero
  EXPECT_TRUE(std::isnan(run({0x1p-127f, 0.0f}, {INFINITY, 0.0f})));  // so 0 * inf
  EXPECT_EQ(run({0x1p-63f, 0.0f}, {0x1p-63f, 0.0f}), 0x1p-126f);      // the least normal: kept
  // Pairs (0, 1) then (-1, 2^-24) times ones: the odd element's product first gives 1, then
  // 1 + 2^-24 = 1 (a tie, to even), then + -1 = 0; the even one first, or one rounding of the
  // three-term sum, would give 2^-24.
  EXPECT_EQ(run({0.0f, 1.0f, -1.0f, 0x1p-24f}, {1.0f, 1.0f, 1.0f, 1.0f}), 0.0f);
  EXPECT_EQ(run({0.0f, 1.0f, 0x1p-24f, -1.0f}, {1.0f, 1.0f, 1.0f, 1.0f}), 0x1p-24f);
}

// Where bf16 dot products outrun f32 FMAs (measured), automatic bf16 products stay bf16: the own
// kernel up to 2^21 flops with 64 columns, or 32 columns and at most 128 rows, and from 64
// columns with k up to 128, whatever the transposes; oneDNN's bf16 kernel otherwise.
TEST(Gemm, AutomaticBf16KernelFollowsTheMeasuredDotProductSpeed) {
  const double ratio = mt::bf16_dot_speed_over_f32();
  std::cout << "[ info ] VDPBF16PS runs at " << ratio << " times the f32 FMA rate here\n";
  if (!mt::gemm_bf16_own_available()) {
    EXPECT_EQ(ratio, 0.0);
    GTEST_SKIP() << "this CPU has no AVX512-BF16";
  }
  EXPECT_GT(ratio, 0.2);
  EXPECT_LT(ratio, 5.0);
  for (const auto& shape : {std::array<int64_t, 3>{256, 64, 64},
                            {64, 64, 128},
                            {1, 1024, 512},
                            {64, 10, 64},
                            {512, 32, 64},
                            {64, 32, 64},
                            {256, 256, 64},
                            {4096, 64, 64},
                            {4096, 16, 64},
                            {768, 128, 512},
                            {1024, 1024, 1024}}) {
    mt::GemmDesc d;
    d.m = shape[0], d.n = shape[1], d.k = shape[2], d.operand = mt::bf16;
    mt::GemmDesc own = d, native = d;
    own.bf16_kernel = mt::Bf16Kernel::own;
    native.bf16_kernel = mt::Bf16Kernel::native;
    const std::string kernel = mt::gemm_kernel(d);
    if (kernel.find("amx") != std::string::npos || ratio < 1.0) {
      EXPECT_NE(kernel, mt::gemm_kernel(own)) << label(d);
      continue;
    }
    const double flops = 2.0 * static_cast<double>(d.m * d.n * d.k);
    const bool small =
        (flops <= 0x1p21 && (d.n >= 64 || (d.n >= 32 && d.m <= 128))) || (d.n >= 64 && d.k <= 128);
    EXPECT_EQ(kernel, small ? mt::gemm_kernel(own) : mt::gemm_kernel(native)) << label(d);
    for (mt::GemmDesc* transposed : {&d, &own, &native}) transposed->transpose_a = true;
    EXPECT_EQ(mt::gemm_kernel(d), small ? mt::gemm_kernel(own) : mt::gemm_kernel(native))
        << label(d);
    for (mt::GemmDesc* transposed : {&d, &own, &native}) transposed->transpose_b = true;
    EXPECT_EQ(mt::gemm_kernel(d), small ? mt::gemm_kernel(own) : mt::gemm_kernel(native))
        << label(d);
  }
}

// Informational: throughput of a 1024^3 product (not asserted; the machine is shared). A few
// sampled elements are checked so the timed runs are known to compute the right thing.
TEST(Gemm, ReportsThroughputFor1024Cubed) {
  const int64_t size = 1024;
  std::mt19937 rng(5);
  std::vector<float> values = uniform(rng, size * size);
  for (Operand operand :
       {Operand{mt::f32, mt::Bf16Kernel::automatic}, Operand{mt::bf16, mt::Bf16Kernel::automatic},
        Operand{mt::bf16, mt::gemm_bf16_native_available() ? mt::Bf16Kernel::native
                                                           : mt::Bf16Kernel::widened},
        Operand{mt::f16, mt::Bf16Kernel::automatic}}) {
    mt::GemmDesc d;
    d.m = d.n = d.k = size, d.operand = operand.dtype, d.bf16_kernel = operand.kernel;
    Stored a = store(d.operand, values), b = store(d.operand, values);
    std::vector<float> out(static_cast<size_t>(size * size));
    mt::gemm(d, a.data(), b.data(), out.data());  // creates the primitive
    double best = std::numeric_limits<double>::infinity();
    for (int repeat = 0; repeat < 3; ++repeat) {
      auto start = std::chrono::steady_clock::now();
      mt::gemm(d, a.data(), b.data(), out.data());
      best = std::min(
          best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::cout << "[ info ] gemm " << size << "^3 " << label(d) << ": "
              << 2.0 * size * size * size / best / 1e9 << " GFLOP/s (best of 3)\n";
    for (int sample = 0; sample < 16; ++sample) {
      int64_t i = (sample * 389) % size, j = (sample * 631) % size;
      double want = 0, magnitude = 0;
      for (int64_t p = 0; p < size; ++p) {
        want += a.values[i * size + p] * b.values[p * size + j];
        magnitude += std::fabs(a.values[i * size + p] * b.values[p * size + j]);
      }
      EXPECT_NEAR(out[i * size + j], want, 1e-5 * magnitude) << label(d) << " at " << i << "," << j;
    }
  }
}

}  // namespace
