// tests/test_grad_health.cpp -- mt::gradient_health against hand-classified values at every fp16
// and bf16 rounding boundary, a threshold oracle on random bit patterns, and a real tiny model.
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <mixtape/mixtape.h>

#include "mixtape/dsl/json.h"
#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

mt::Tensor f32_tensor(const std::vector<float>& values) {
  return mt::tensor(values, {static_cast<int64_t>(values.size())});
}

float below(float x) { return std::nextafter(x, 0.0f); }
float above(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }

// What rounding to nearest-even does, stated as magnitude ranges (the oracle the encoder-based
// implementation is checked against): a value exactly halfway to the next representable value
// goes to the even one, which at the bottom is zero and at the top of the subnormals the smallest
// normal, and at the top of the range inf.
struct Expected {
  int64_t nonzero = 0, nonfinite = 0;
  int64_t f16_zero = 0, f16_subnormal = 0, f16_overflow = 0;
  int64_t bf16_zero = 0, bf16_subnormal = 0, bf16_overflow = 0;
  void add(double x) {
    if (!std::isfinite(x)) {
      ++nonfinite;
      return;
    }
    const double a = std::fabs(x);
    if (a == 0) return;
    ++nonzero;
    if (a <= 0x1p-25)
      ++f16_zero;
    else if (a < 0x1p-14 - 0x1p-25)
      ++f16_subnormal;
    else if (a >= 65520)
      ++f16_overflow;
    if (a <= 0x1p-134)
      ++bf16_zero;
    else if (a < 0x1p-126 - 0x1p-134)
      ++bf16_subnormal;
    else if (a >= 0x1.ffp127)
      ++bf16_overflow;
  }
};

void expect_row(const mt::GradientHealthRow& row, const Expected& e) {
  EXPECT_EQ(row.nonzero, e.nonzero) << row.name;
  EXPECT_EQ(row.nonfinite, e.nonfinite) << row.name;
  EXPECT_EQ(row.f16.zero, e.f16_zero) << row.name;
  EXPECT_EQ(row.f16.subnormal, e.f16_subnormal) << row.name;
  EXPECT_EQ(row.f16.overflow, e.f16_overflow) << row.name;
  EXPECT_EQ(row.bf16.zero, e.bf16_zero) << row.name;
  EXPECT_EQ(row.bf16.subnormal, e.bf16_subnormal) << row.name;
  EXPECT_EQ(row.bf16.overflow, e.bf16_overflow) << row.name;
}

// ---- hand-classified boundaries ----

TEST(GradientHealth, ClassifiesEveryBoundaryByHand) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // f16's bottom: subnormals are k * 2^-24, k = 1..1023.
  mt::Tensor small = f32_tensor({
      0x1p-24f,                    // smallest subnormal: subnormal
      0x1p-25f,                    // halfway to it: ties to even, zero
      above(0x1p-25f),             // just past halfway: rounds up to 2^-24, subnormal
      below(0x1p-25f),             // zero
      -0x1p-25f,                   // zero (negative)
      0x1.8p-25f,                  // 0.75 * 2^-24: subnormal
      0x1.8p-24f,                  // 1.5 * 2^-24: tie, to even 2 * 2^-24, subnormal
      0x1p-14f,                    // smallest normal: fine
      0x1p-14f - 0x1p-24f,         // largest subnormal: subnormal
      0x1p-14f - 0x1p-25f,         // halfway between it and 2^-14: to even, normal
      below(0x1p-14f - 0x1p-25f),  // rounds down to the largest subnormal
      1e-8f,                       // 0.17 * 2^-24: zero
      0.0f,
      -0.0f,  // zeros are not counted at all
      1.0f,
  });
  // f16's top: 65504 is the largest finite value, 65520 the halfway point to the next binade.
  mt::Tensor large = f32_tensor({
      65504.0f,
      65519.99f,           // below halfway: 65504
      65520.0f,            // halfway: inf
      -65520.0f,           // -inf
      1e30f,               // f16 inf, bf16 fine
      FLT_MAX,             // inf in both (bf16 rounds it up)
      -FLT_MAX,            // -inf in both
      0x1.ffp127f,         // halfway above bf16's largest 0x1.fep127: ties to even, inf
      below(0x1.ffp127f),  // bf16 0x1.fep127, finite
  });
  mt::Tensor specials = f32_tensor({nan, inf, -inf, -2.0f, 1.0f, 0x1p-30f});
  // bf16 keeps f32's exponent range, and its subnormals are k * 2^-133, k = 1..127.
  mt::Tensor tiny = f32_tensor({
      1e-39f,                        // an f32 subnormal: bf16 subnormal, f16 zero
      0x1p-133f,                     // bf16's smallest subnormal
      0x1p-134f,                     // halfway to it: zero
      above(0x1p-134f),              // subnormal
      0x1p-149f,                     // f32's smallest subnormal: zero
      0x1p-126f,                     // f32's smallest normal: bf16 normal
      0x1p-126f - 0x1p-134f,         // halfway between bf16's largest subnormal and 2^-126: normal
      below(0x1p-126f - 0x1p-134f),  // bf16's largest subnormal
      1e-30f,                        // bf16 normal, f16 zero
  });
  mt::GradientHealth health = mt::gradient_health({{"small", small},
                                                   {"none", mt::Tensor()},
                                                   {"large", large},
                                                   {"specials", specials},
                                                   {"tiny", tiny}});
  ASSERT_EQ(health.rows.size(), 4u);  // the undefined gradient is skipped

  const mt::GradientHealthRow& s = health.rows[0];
  EXPECT_EQ(s.name, "small");
  EXPECT_EQ(s.numel, 15);
  EXPECT_EQ(s.nonzero, 13);
  EXPECT_EQ(s.f16.zero, 4);
  EXPECT_EQ(s.f16.subnormal, 6);
  EXPECT_EQ(s.f16.overflow, 0);
  EXPECT_EQ(s.bf16.zero + s.bf16.subnormal + s.bf16.overflow, 0);
  EXPECT_EQ(s.amax, 1.0);
  EXPECT_FALSE(s.found_inf());
  EXPECT_DOUBLE_EQ(s.f16_zero_fraction(), 4.0 / 13.0);
  EXPECT_DOUBLE_EQ(s.f16_subnormal_fraction(), 6.0 / 13.0);

  const mt::GradientHealthRow& l = health.rows[1];
  EXPECT_EQ(l.nonzero, 9);
  EXPECT_EQ(l.f16.overflow, 7);
  EXPECT_EQ(l.bf16.overflow, 3);
  EXPECT_EQ(l.f16.zero + l.f16.subnormal + l.bf16.zero + l.bf16.subnormal, 0);
  EXPECT_EQ(l.amax, static_cast<double>(FLT_MAX));
  EXPECT_FALSE(l.found_inf());

  const mt::GradientHealthRow& x = health.rows[2];
  EXPECT_EQ(x.nonfinite, 3);
  EXPECT_TRUE(x.found_inf());
  EXPECT_EQ(x.nonzero, 3);
  EXPECT_EQ(x.f16.zero, 1);
  EXPECT_EQ(x.amax, 2.0);  // the largest magnitude over the finite values

  const mt::GradientHealthRow& t = health.rows[3];
  EXPECT_EQ(t.nonzero, 9);
  EXPECT_EQ(t.f16.zero, 9);
  EXPECT_EQ(t.bf16.zero, 2);
  EXPECT_EQ(t.bf16.subnormal, 4);
  EXPECT_EQ(t.bf16.overflow, 0);

  const mt::GradientHealthRow& total = health.total;
  EXPECT_EQ(total.name, "total");
  EXPECT_EQ(total.numel, 15 + 9 + 6 + 9);
  EXPECT_EQ(total.nonzero, 34);
  EXPECT_EQ(total.nonfinite, 3);
  EXPECT_EQ(total.f16.zero, 14);
  EXPECT_EQ(total.f16.subnormal, 6);
  EXPECT_EQ(total.f16.overflow, 7);
  EXPECT_EQ(total.bf16.zero, 2);
  EXPECT_EQ(total.bf16.subnormal, 4);
  EXPECT_EQ(total.bf16.overflow, 3);
  EXPECT_EQ(total.amax, static_cast<double>(FLT_MAX));
  EXPECT_TRUE(health.found_inf());

  // The oracle agrees value by value on the same inputs.
  const std::vector<mt::Tensor> given{small, large, specials, tiny};
  for (size_t i = 0; i < health.rows.size(); ++i) {
    Expected e;
    for (float v : given[i].to_vector<float>()) e.add(v);
    expect_row(health.rows[i], e);
  }

  // JSON carries the same figures (and no NaN or inf, which JSON cannot hold).
  mt::json::Value json = mt::json::parse(health.json());
  EXPECT_EQ(json.at("tensors").size(), 4u);
  const mt::json::Value& first = json.at("tensors").at(0);
  EXPECT_EQ(first.at("name").get<std::string>(), "small");
  EXPECT_EQ(first.at("dtype").get<std::string>(), "f32");
  EXPECT_EQ(first.at("f16").at("zero").get<int64_t>(), 4);
  EXPECT_EQ(first.at("f16").at("subnormal").get<int64_t>(), 6);
  EXPECT_DOUBLE_EQ(first.at("f16").at("zero_fraction").get<double>(), 4.0 / 13.0);
  EXPECT_TRUE(json.at("tensors").at(2).at("found_inf").get<bool>());
  EXPECT_EQ(json.at("total").at("bf16").at("overflow").get<int64_t>(), 3);
  EXPECT_EQ(json.at("total").at("amax").get<double>(), static_cast<double>(FLT_MAX));
  std::string table = health.table();
  for (const char* fragment : {"small", "tiny", "total", "found inf"})
    EXPECT_NE(table.find(fragment), std::string::npos) << fragment;
}

// Random f32 bit patterns (every exponent, subnormals, NaN and inf) against the oracle.
TEST(GradientHealth, AgreesWithTheThresholdOracleOnRandomBitPatterns) {
  std::mt19937 rng(1234);
  std::vector<float> values(100000);
  for (float& v : values) {
    uint32_t bits = rng();
    // Three quarters are drawn near the edges: f16's range, bf16's bottom and its top.
    switch (rng() % 4) {
      case 1:
        bits = (bits & 0x807FFFFFu) | ((96u + (rng() % 48u)) << 23);
        break;
      case 2:
        bits &= 0x80FFFFFFu;  // exponent field 0 or 1
        break;
      case 3:
        bits = (bits & 0x8000FFFFu) | 0x7F7F0000u;  // around bf16's largest finite value
        break;
    }
    v = std::bit_cast<float>(bits);
  }
  mt::GradientHealth health = mt::gradient_health({{"g", f32_tensor(values)}});
  Expected e;
  for (float v : values) e.add(v);
  expect_row(health.rows.at(0), e);
  EXPECT_GT(e.f16_zero, 1000);  // the sample reaches every class
  EXPECT_GT(e.f16_subnormal, 1000);
  EXPECT_GT(e.bf16_subnormal, 10);
  EXPECT_GT(e.bf16_overflow, 10);
}

// A loss scale moves values out of the underflow range (and large ones into overflow).
TEST(GradientHealth, ScaleJudgesTheScaledValues) {
  mt::Tensor g = f32_tensor({0x1p-30f, 0x1p-26f, 100.0f, 0x1p-25f});
  mt::GradientHealth plain = mt::gradient_health({{"g", g}});
  EXPECT_EQ(plain.total.f16.zero, 3);
  mt::GradientHealth scaled = mt::gradient_health({{"g", g}}, 1024);
  EXPECT_EQ(scaled.scale, 1024);
  EXPECT_EQ(scaled.total.f16.zero, 0);
  EXPECT_EQ(scaled.total.f16.subnormal, 3);  // 2^-20, 2^-16, 2^-15
  EXPECT_EQ(scaled.total.f16.overflow, 1);   // 102400
  EXPECT_EQ(scaled.total.amax, 100.0);       // of the gradient itself
  // 3 * 2^-26 = 0.75 * 2^-24 rounds up to the smallest subnormal; 3 * 2^-30 is still zero.
  mt::GradientHealth three = mt::gradient_health({{"g", g}}, 3);
  EXPECT_EQ(three.total.f16.zero, 1);
  EXPECT_EQ(three.total.f16.subnormal, 2);
  EXPECT_MT_ERROR(mt::gradient_health({{"g", g}}, 0), "gradient_health", "scale");
  EXPECT_MT_ERROR(mt::gradient_health({{"g", g}}, std::nan("")), "gradient_health", "scale");
}

// Gradients stored in other types are judged from their exact values, rounded once.
TEST(GradientHealth, OtherStorageTypes) {
  // In f64, 2^-25 + 2^-60 is just past the halfway point: f16 rounds it up. Rounding it to f32
  // first would land exactly on the tie and give zero.
  mt::Tensor wide = mt::tensor(std::vector<double>{0x1p-25 + 0x1p-60, 0x1p-25}, {2}, mt::f64);
  mt::GradientHealth health = mt::gradient_health({{"wide", wide}});
  EXPECT_EQ(health.rows[0].dtype, mt::f64);
  EXPECT_EQ(health.rows[0].f16.subnormal, 1);
  EXPECT_EQ(health.rows[0].f16.zero, 1);

  mt::Tensor half = mt::tensor(std::vector<float>{0x1p-24f, 1.0f, 0x1p-30f}, {3}, mt::f16);
  health = mt::gradient_health({{"half", half}});
  EXPECT_EQ(health.rows[0].dtype, mt::f16);
  EXPECT_EQ(health.rows[0].nonzero, 2);  // 2^-30 was already lost when it was stored
  EXPECT_EQ(health.rows[0].f16.subnormal, 1);
  EXPECT_EQ(health.rows[0].f16.zero, 0);
}

// ---- a real model ----

struct Deep : mt::Module {
  mt::MLP mlp{{16, 32, 32, 32, 4}};
  Deep() {
    register_module("mlp", mlp);
    // A small initialisation: gradients shrink layer by layer, far below f16's subnormals.
    for (auto& [name, p] : named_parameters()) p.assign(p * 0.01);
  }
};

TEST(GradientHealth, ShowsWhatATinyModelInF32WouldLoseInF16) {
  mt::manual_seed(7);
  Deep model;
  mt::Tensor x = mt::randn({8, 16});
  mt::Tensor y = mt::tensor(std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3}, {8});
  mt::cross_entropy(model.mlp(x), y).backward();
  mt::GradientHealth health = mt::gradient_health(model);
  ASSERT_EQ(health.rows.size(), 8u);
  EXPECT_EQ(health.rows[0].name, "mlp.fc1.weight");
  // Check every row against the oracle on the values read back independently.
  Expected all;
  for (size_t i = 0; i < health.rows.size(); ++i) {
    Expected e;
    for (float v : model.named_parameters()[i].second.grad().to_vector<float>()) {
      e.add(v);
      all.add(v);
    }
    expect_row(health.rows[i], e);
  }
  expect_row(health.total, all);
  std::cout << health.table();
  // Most of the gradient would be flushed to zero by fp16 storage, none of it by bf16.
  EXPECT_GE(health.total.f16_zero_fraction(), 0.5);
  EXPECT_EQ(health.total.bf16.zero, 0);
  EXPECT_FALSE(health.found_inf());
  // Loss scaling by 2^16 keeps most of it.
  mt::GradientHealth scaled = mt::gradient_health(model, 65536);
  EXPECT_LT(scaled.total.f16_zero_fraction(), health.total.f16_zero_fraction() / 2);
  EXPECT_EQ(scaled.total.f16.overflow, 0);
}

}  // namespace
