// tests/test_special_values.cpp -- ops at the values where rounding, signs and non-finite numbers
// decide the answer: signed zeros, NaN through dropout, half results rounded once, squares past
// f32's range, sampling weights at the ends of f64's, and probabilities of exactly 0 and 1.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "mixtape/mixtape.h"
#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
using Doubles = std::vector<double>;

Doubles values(const mt::Tensor& t) { return t.to_vector<double>(); }

// |-0| is +0, as IEEE and torch.abs give it (1 / abs(x) is +inf, not -inf), in every float type
// and fused with other ops.
TEST(SpecialValues, AbsOfNegativeZeroIsPositiveZero) {
  for (mt::DType type : {mt::f32, mt::f64, mt::f16, mt::bf16}) {
    SCOPED_TRACE(mt::name(type));
    mt::Tensor x = mt::tensor(Doubles{-0.0, 0.0, -1.5}, {3}, type);
    for (const mt::Tensor& y : {mt::abs(x), mt::abs(x * 1.0) * 1.0}) {
      Doubles got = values(y);
      EXPECT_FALSE(std::signbit(got[0]));
      EXPECT_FALSE(std::signbit(got[1]));
      EXPECT_EQ(got[2], 1.5);
    }
    EXPECT_EQ(values(1.0 / mt::abs(x))[0], kInf);
  }
}

// lerp in bf16/f16 is computed in f32 and rounded once (each step rounded to bf16 lost the whole
// result here), and a weight below -0.5 takes the start form, as torch's (the end form gave
// -inf + inf = NaN).
TEST(SpecialValues, LerpRoundsHalfResultsOnceAndTakesTorchsForm) {
  auto bf16 = [](double v) { return mt::tensor(Doubles{v}, {1}, mt::bf16); };
  EXPECT_EQ(values(mt::lerp(bf16(-4.125), bf16(-8.875), bf16(-0.875)))[0], 0.03125);
  auto f16 = [](double v) { return mt::tensor(Doubles{v}, {1}, mt::f16); };
  // -1.5576171875 + 0.17578125 (7.296875 + 1.5576171875) = -0.00116348..., in f16
  mt::Tensor half = mt::lerp(f16(-1.5576171875), f16(7.296875), f16(0.17578125));
  EXPECT_EQ(half.dtype(), mt::f16);
  EXPECT_EQ(values(half)[0], values(mt::tensor(Doubles{-0.0011634826660156}, {1}, mt::f16))[0]);
  mt::Tensor far =
      mt::lerp(mt::tensor(Doubles{-0.02}, {1}, mt::f32), mt::tensor(Doubles{-kInf}, {1}, mt::f32),
               mt::tensor(Doubles{-5.0}, {1}, mt::f32));
  EXPECT_EQ(values(far)[0], kInf);
  // Exact at both ends in every form.
  mt::Tensor a = mt::tensor(Doubles{1.1, -3.7}, {2}), b = mt::tensor(Doubles{9.3, 2.2}, {2});
  EXPECT_EQ(values(mt::lerp(a, b, mt::zeros({2}))), values(a));
  EXPECT_EQ(values(mt::lerp(a, b, mt::ones({2}))), values(b));
}

// hardswish, hardsigmoid, selu and mish of a half input: the f32 result rounded once (each step
// rounded to bf16 made hardswish(2.046875) 1.734375 where the exact 1.72172 rounds to 1.71875).
TEST(SpecialValues, HalfActivationsRoundOnce) {
  mt::Tensor x = mt::tensor(Doubles{2.046875}, {1}, mt::bf16);
  EXPECT_EQ(values(mt::hardswish(x))[0], 1.71875);
  // Every bf16 input in [-4, 4) against the f32 computation rounded once.
  std::vector<double> inputs;
  for (double v = -4; v < 4; v += 1.0 / 64) inputs.push_back(v);
  mt::Tensor all = mt::tensor(inputs, {static_cast<int64_t>(inputs.size())}, mt::bf16);
  mt::Tensor wide = mt::cast(all, mt::f32);
  const std::pair<const char*, mt::Tensor (*)(const mt::Tensor&, const mt::Loc&)> ops[] = {
      {"hardswish", mt::hardswish},
      {"hardsigmoid", mt::hardsigmoid},
      {"selu", mt::selu},
      {"mish", mt::mish}};
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    mt::Tensor got = op(all, mt::Loc::current());
    EXPECT_EQ(got.dtype(), mt::bf16);
    EXPECT_EQ(values(got), values(mt::cast(op(wide, mt::Loc::current()), mt::bf16)));
  }
}

// clamp of a bool tensor gives a number, as torch promotes it with the bounds: f32 for bounds
// that are not whole, i64 for whole ones.
TEST(SpecialValues, ClampOfBoolPromotesWithTheBounds) {
  mt::Tensor flags = mt::tensor(std::vector<int64_t>{1, 0}, {2}, mt::boolean);
  mt::Tensor both = mt::clamp(flags, 2.5, 0.5);
  EXPECT_EQ(both.dtype(), mt::f32);
  EXPECT_EQ(values(both), (Doubles{0.5, 0.5}));
  mt::Tensor low = mt::clamp(flags, 0.5, std::nullopt);
  EXPECT_EQ(values(low), (Doubles{1.0, 0.5}));
  mt::Tensor whole = mt::clamp(flags, std::nullopt, 0.0);
  EXPECT_EQ(whole.dtype(), mt::i64);
  EXPECT_EQ(values(whole), (Doubles{0, 0}));
}

// var and std square the deviations in f64: an f32 deviation of 1e20 squared is past f32's range,
// and the variance (2e40 here) is not, as a standard deviation.
TEST(SpecialValues, StdOfHugeF32ValuesIsFinite) {
  mt::Tensor x = mt::tensor(Doubles{1e20, -1e20}, {2}, mt::f32);
  EXPECT_NEAR(mt::std_dev(x).item() / 1.4142135623730951e20, 1.0, 1e-6);
  EXPECT_EQ(mt::var(x).dtype(), mt::f32);
  EXPECT_EQ(mt::var(x).item(), kInf);  // 2e40 is past f32, as torch's f32 result
  mt::Tensor half = mt::tensor(Doubles{30000, -30000}, {2}, mt::f16);
  EXPECT_EQ(mt::var(half).item(), kInf);                 // 1.8e9: past f16
  EXPECT_NEAR(mt::std_dev(half).item(), 42426.4, 32.0);  // ... and its root is not
}

// dropout multiplies: a dropped NaN or inf is NaN, as torch's x * noise, not a 0 that hides a
// divergence from the loss scaler and the gradient checks.
TEST(SpecialValues, DropoutKeepsNonFiniteValuesVisible) {
  mt::Generator gen(3);
  for (double bad : {kNan, kInf}) {
    Doubles got = values(mt::dropout(mt::full({64}, bad), 0.5, true, &gen));
    int finite = 0;
    for (double v : got) finite += std::isfinite(v) ? 1 : 0;
    EXPECT_EQ(finite, 0) << bad;
    Doubles channels = values(mt::dropout2d(mt::full({2, 8, 3}, bad), 0.5, true, &gen));
    for (double v : channels) EXPECT_FALSE(std::isfinite(v)) << bad;
  }
  // Finite inputs: 0 or x / (1 - p), as before.
  Doubles kept = values(mt::dropout(mt::full({256}, 3.0), 0.25, true, &gen));
  for (double v : kept) EXPECT_TRUE(v == 0 || v == 4.0) << v;
}

// multinomial with replacement never draws a zero weight, also where a row's total is subnormal
// (u * total rounded up to the total) or overflows f64 (every draw was the last category).
TEST(SpecialValues, MultinomialNeverDrawsZeroWeightsAtF64sEnds) {
  mt::Generator gen(1);
  auto counts = [&](Doubles weights) {
    mt::Tensor draws = mt::multinomial(mt::tensor(weights, {3}, mt::f64), 4000, true, &gen);
    std::vector<int64_t> out(3);
    for (int64_t d : draws.to_vector<int64_t>()) ++out.at(static_cast<size_t>(d));
    return out;
  };
  std::vector<int64_t> tiny = counts({5e-324, 5e-324, 0});
  EXPECT_EQ(tiny[2], 0);
  EXPECT_NEAR(tiny[0], 2000, 200);
  EXPECT_EQ(counts({0, 1e-320, 0}), (std::vector<int64_t>{0, 4000, 0}));
  std::vector<int64_t> huge = counts({1e308, 1e308, 0});
  EXPECT_EQ(huge[2], 0);
  EXPECT_NEAR(huge[0], 2000, 200);
}

// kaiming_uniform of a shape without elements is that empty tensor, as torch's (the bound
// sqrt(3 / 0) was refused by rand).
TEST(SpecialValues, KaimingUniformOfNoElementsIsEmpty) {
  mt::Tensor w = mt::init::kaiming_uniform({4, 0});
  EXPECT_EQ(w.shape(), (mt::Shape{4, 0}));
}

// binary_cross_entropy of f16 probabilities of exactly 0 and 1: torch's finite values (each log
// clamped at -100) and gradients, computed in f32 where 1e-12 is not 0 (the f16 constant was,
// and the loss was NaN).
TEST(SpecialValues, BinaryCrossEntropyOfHalfZerosAndOnesIsFinite) {
  const Doubles p{0, 1, 0.5, 0.999, 1}, t{0, 1, 0.5, 1, 0};
  mt::Tensor probs = mt::tensor(p, {5}, mt::f16).requires_grad_();
  mt::Tensor targets = mt::tensor(t, {5}, mt::f16);
  mt::Tensor loss = mt::binary_cross_entropy(probs, targets, mt::Reduction::None);
  Doubles got = values(loss);
  const double p3 = values(mt::tensor(Doubles{0.999}, {1}, mt::f16))[0];
  const Doubles want{0, 0, std::log(2.0), -std::log(static_cast<float>(p3)), 100};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << i;
  mt::sum(loss).backward();
  Doubles grad = values(probs.grad());
  EXPECT_EQ(grad[0], 0);
  EXPECT_EQ(grad[1], 0);
  EXPECT_EQ(grad[2], 0);
  EXPECT_TRUE(std::isinf(grad[4]));  // 1 / 1e-12 is past f16, as torch's f16 gradient
  mt::Tensor mean = mt::binary_cross_entropy(mt::tensor(p, {5}, mt::f16), targets);
  EXPECT_NEAR(mean.item(), (want[2] + want[3] + 100) / 5, 1e-5);
}

// Its second derivative: d/dp of (p - t) / (p (1 - p)) is (p^2 - 2pt + t) / (p (1 - p))^2, as
// torch's double backward (the gradient was built from detached inputs and had none).
TEST(SpecialValues, BinaryCrossEntropyHasASecondDerivative) {
  const Doubles p{0.3, 0.7, 0.1, 0.9, 0.5, 0.2}, t{1, 0, 0.5, 1, 0, 0.25};
  mt::Tensor probs = mt::tensor(p, {6}, mt::f64).requires_grad_();
  mt::Tensor targets = mt::tensor(t, {6}, mt::f64);
  mt::Tensor loss = mt::binary_cross_entropy(probs, targets, mt::Reduction::Sum);
  mt::Tensor first = mt::grad({loss}, {probs}, {}, true)[0];
  mt::Tensor second = mt::grad({mt::sum(first)}, {probs})[0];
  Doubles got = values(second);
  for (size_t i = 0; i < p.size(); ++i) {
    const double q = p[i] * (1 - p[i]);
    EXPECT_NEAR(got[i], (p[i] * p[i] - 2 * p[i] * t[i] + t[i]) / (q * q), 1e-9) << i;
  }
  // Through a sigmoid, against the closed form sigmoid'' chain: d2/dx2 of bce(s(x), t) is s(1-s).
  mt::Tensor x = mt::tensor(Doubles{-1.5, 0.25, 2.0}, {3}, mt::f64).requires_grad_();
  mt::Tensor through = mt::binary_cross_entropy(
      mt::sigmoid(x), mt::tensor(Doubles{1, 0, 0.5}, {3}, mt::f64), mt::Reduction::Sum);
  mt::Tensor dx = mt::grad({through}, {x}, {}, true)[0];
  Doubles curvature = values(mt::grad({mt::sum(dx)}, {x})[0]);
  for (size_t i = 0; i < 3; ++i) {
    const double xi = values(x)[i], s = 1 / (1 + std::exp(-xi));
    EXPECT_NEAR(curvature[i], s * (1 - s), 1e-9) << i;
  }
}

}  // namespace

namespace {

// ignore_index is compared as an integer: 2^53 + 1 is not 2^53 (as a double it was, and an
// out-of-range target 2^53 was silently ignored), and one i32 targets cannot hold ignores
// nothing (it was an error about the fill).
TEST(SpecialValues, IgnoreIndexIsComparedExactly) {
  mt::Tensor logits = mt::zeros({2, 3});
  const int64_t big = (int64_t{1} << 53) + 1;
  mt::Tensor targets = mt::tensor(std::vector<int64_t>{int64_t{1} << 53, 1}, {2});
  EXPECT_THROW(mt::cross_entropy(logits, targets, {.ignore_index = big}).item(), mt::Error);
  mt::Tensor narrow = mt::tensor(std::vector<int64_t>{0, 2}, {2}, mt::i32);
  EXPECT_NEAR(mt::cross_entropy(logits, narrow, {.ignore_index = int64_t{1} << 40}).item(),
              std::log(3.0), 1e-6);
}

// smooth_l1_loss of f16 values with a small beta: d d / 2 / beta, whose constant 0.5 / beta is
// past f16's range (0 times it was NaN); torch's half kernel gives 0 and the finite values.
TEST(SpecialValues, SmoothL1OfHalvesWithASmallBeta) {
  mt::Tensor a = mt::tensor(Doubles{1, 2}, {2}, mt::f16),
             b = mt::tensor(Doubles{1, 2.5}, {2}, mt::f16);
  Doubles got = values(mt::smooth_l1_loss(a, b, mt::Reduction::None, 1e-6));
  EXPECT_EQ(got[0], 0);
  EXPECT_NEAR(got[1], 0.5, 1e-3);
}

// Replicate and reflect padding add every copy's gradient into the element copied: for a bf16
// input in f32, rounded once (each axis' stage was rounded to bf16 first: 6 ulps off here).
TEST(SpecialValues, HalfPaddingGradientsRoundOnce) {
  for (mt::PadMode mode : {mt::PadMode::Replicate, mt::PadMode::Reflect}) {
    SCOPED_TRACE(mode == mt::PadMode::Replicate ? "replicate" : "reflect");
    mt::Generator gen(5);
    const bool replicate = mode == mt::PadMode::Replicate;
    mt::Tensor x = mt::randn({1, 2, 2, 2}, mt::f32, &gen).to(mt::bf16).detach();
    x.requires_grad_();
    const std::vector<int64_t> pads =
        replicate ? std::vector<int64_t>{6, 6, 6, 6} : std::vector<int64_t>{1, 1, 1, 1};
    mt::Tensor y = mt::pad(x, pads, mode);
    ASSERT_EQ(y.dtype(), mt::bf16);
    mt::Tensor gy = mt::randn(y.shape(), mt::f32, &gen).to(mt::bf16);
    mt::sum(mt::cast(y, mt::f32) * mt::cast(gy, mt::f32)).backward();
    // The f64 sum of the gradients each input element's copies receive, rounded to bf16 once.
    Doubles g = values(gy), want(8, 0.0);
    const int64_t h = y.size(2), w = y.size(3);
    auto source = [&](int64_t i, int64_t n, int64_t before) {
      const int64_t at = i - before;
      if (replicate) return std::min<int64_t>(std::max<int64_t>(at, 0), n - 1);
      return at < 0 ? -at : at >= n ? 2 * (n - 1) - at : at;
    };
    for (int64_t c = 0; c < 2; ++c)
      for (int64_t i = 0; i < h; ++i)
        for (int64_t j = 0; j < w; ++j)
          want[static_cast<size_t>(c * 4 + source(i, 2, pads[2]) * 2 + source(j, 2, pads[0]))] +=
              g[static_cast<size_t>((c * h + i) * w + j)];
    EXPECT_EQ(values(x.grad()), values(mt::tensor(want, {1, 2, 2, 2}).to(mt::bf16)));
  }
}

}  // namespace
