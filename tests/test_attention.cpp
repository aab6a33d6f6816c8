// tests/test_attention.cpp -- fused attention against the materialized composite (its oracle),
// f64, autocast's half types, scores beyond f16's range, mt::compile, and memory linear in T.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;

namespace {

struct Case {
  std::string label;
  int64_t batch, heads, tq, tk, d, dv;
  bool causal;
  enum Mask { None, Padding, Additive } mask;
};

struct Values {
  std::vector<double> q, k, v, weight, mask;
};

// Random inputs for a case; `weight` makes the loss sum(out * weight).
Values values_for(const Case& c, uint64_t seed) {
  mt::Generator gen(seed);
  auto draw = [&](mt::Shape shape) { return mt::randn(shape, mt::f64, &gen).to_vector<double>(); };
  Values v{draw({c.batch, c.heads, c.tq, c.d}),
           draw({c.batch, c.heads, c.tk, c.d}),
           draw({c.batch, c.heads, c.tk, c.dv}),
           draw({c.batch, c.heads, c.tq, c.dv}),
           {}};
  if (c.mask == Case::Padding) {  // batch b keeps its first tk - 3 b keys
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t j = 0; j < c.tk; ++j) v.mask.push_back(j < c.tk - 3 * b ? 1.0 : 0.0);
  } else if (c.mask == Case::Additive) {
    v.mask = draw({1, 1, c.tq, c.tk});
  }
  return v;
}

struct Result {
  mt::OpCode op;  // what made the output
  std::vector<double> out, gq, gk, gv;
};

// Attention and the gradients of sum(out * weight), fused or composite, with leaves stored as
// `dtype` and an optional autocast policy around the call.
Result run(const Case& c, const Values& x, bool fused, mt::DType dtype,
           std::optional<mt::DType> autocast = std::nullopt) {
  auto leaf = [&](const std::vector<double>& values, mt::Shape shape) {
    return mt::tensor(values, shape, dtype).requires_grad_();
  };
  mt::Tensor q = leaf(x.q, {c.batch, c.heads, c.tq, c.d});
  mt::Tensor k = leaf(x.k, {c.batch, c.heads, c.tk, c.d});
  mt::Tensor v = leaf(x.v, {c.batch, c.heads, c.tk, c.dv});
  mt::Tensor weight = mt::tensor(x.weight, {c.batch, c.heads, c.tq, c.dv}, dtype);
  mt::Tensor mask;
  if (c.mask == Case::Padding) mask = mt::tensor(x.mask, {c.batch, 1, 1, c.tk}, mt::boolean);
  if (c.mask == Case::Additive) mask = mt::tensor(x.mask, {1, 1, c.tq, c.tk}, dtype);
  mt::Tensor out;
  {
    std::optional<mt::autocast> guard;
    if (autocast) guard.emplace(*autocast);
    out = mt::detail::attention(q, k, v, mask, c.causal, std::nullopt, fused, mt::Loc::current());
  }
  mt::sum(mt::cast(out, dtype) * weight).backward();
  mt::eval({out, q.grad(), k.grad(), v.grad()});
  return {out.node()->op, out.to_vector<double>(), q.grad().to_vector<double>(),
          k.grad().to_vector<double>(), v.grad().to_vector<double>()};
}

// max |got - want| / (1 + max |want|): the error relative to the tensor's scale.
double error(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    worst = std::max(worst, std::isfinite(got[i]) ? std::fabs(got[i] - want[i]) : INFINITY);
    scale = std::max(scale, std::fabs(want[i]));
  }
  return worst / (1 + scale);
}

void expect_close(const Result& got, const Result& want, double tolerance) {
  EXPECT_LE(error(got.out, want.out), tolerance) << "output";
  EXPECT_LE(error(got.gq, want.gq), tolerance) << "dq";
  EXPECT_LE(error(got.gk, want.gk), tolerance) << "dk";
  EXPECT_LE(error(got.gv, want.gv), tolerance) << "dv";
}

// Head dims 32, 64 and 128; lengths that are no multiple of the tiles (64 queries, 16 to 256
// keys); causal, padding and additive masks; queries and keys of different lengths.
std::vector<Case> cases() {
  return {{"causal d32 T67", 1, 2, 67, 67, 32, 32, true, Case::None},
          {"padding d64 Tq45 Tk130", 2, 2, 45, 130, 64, 64, false, Case::Padding},
          {"additive causal d128 T70", 1, 1, 70, 70, 128, 128, true, Case::Additive},
          {"padding causal d32 dv24 T129", 2, 1, 129, 129, 32, 24, true, Case::Padding}};
}

TEST(FusedAttention, F32MatchesTheCompositeAndF64To1e5) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.label);
    const Values x = values_for(c, 7);
    Result fused = run(c, x, true, mt::f32), composite = run(c, x, false, mt::f32);
    EXPECT_EQ(fused.op, mt::OpCode::Attention);
    EXPECT_EQ(composite.op, mt::OpCode::MatMul);
    expect_close(fused, composite, 1e-5);
    expect_close(fused, run(c, x, false, mt::f64), 1e-5);
  }
}

// The fused op's f64 tiles against the f64 composite, to rounding.
TEST(FusedAttention, F64MatchesTheComposite) {
  const Case c = cases()[1];
  const Values x = values_for(c, 8);
  expect_close(run(c, x, true, mt::f64), run(c, x, false, mt::f64), 1e-12);
}

// Under autocast both are rounded to the half type at their outputs (the composite at every
// step), both within the tolerance autocast runs are held to (tests/test_precision.cpp: 2e-2
// for bf16); f16 keeps 3 more bits.
TEST(FusedAttention, HalfAutocastMatchesTheCompositeWithinAutocastTolerance) {
  for (mt::DType half : {mt::bf16, mt::f16})
    for (const Case& c : cases()) {
      SCOPED_TRACE(c.label + " " + std::string(mt::name(half)));
      const Values x = values_for(c, 9);
      Result fused = run(c, x, true, mt::f32, half);
      Result composite = run(c, x, false, mt::f32, half);
      const double tolerance = half == mt::bf16 ? 2e-2 : 5e-3;
      expect_close(fused, composite, tolerance);
      expect_close(fused, run(c, x, false, mt::f64), tolerance);
      // Half leaves without a policy: stored, computed and returned in the half type.
      expect_close(run(c, x, true, half), run(c, x, false, half), tolerance);
    }
}

// Scores near 1e5 overflow f16 (65504) in the composite's q k^T; the fused op keeps them in f32,
// so under autocast-f16 it gives the f64 answer where the composite gives NaN.
TEST(FusedAttention, ScoresBeyondF16RangeDoNotOverflowUnderAutocastF16) {
  const Case c{"large scores", 1, 2, 24, 24, 16, 16, true, Case::None};
  Values x = values_for(c, 10);
  // 160 and its f16 neighbours: q.k about 16 * 25600, times 1/4: scores about 1e5 that differ
  // by a few units between keys.
  const double near[3] = {159.875, 160.0, 160.125};
  for (size_t i = 0; i < x.q.size(); ++i) x.q[i] = near[i % 3];
  for (size_t i = 0; i < x.k.size(); ++i) x.k[i] = near[(i * 7 / 5) % 3];
  Result composite = run(c, x, false, mt::f32, mt::f16);
  EXPECT_TRUE(std::any_of(composite.out.begin(), composite.out.end(), [](double y) {
    return !std::isfinite(y);
  })) << "the composite was meant to overflow";
  Result fused = run(c, x, true, mt::f32, mt::f16);
  const Result exact = run(c, x, false, mt::f64);
  EXPECT_LE(error(fused.out, exact.out), 5e-3);
  EXPECT_LE(error(fused.gv, exact.gv), 5e-3);
  for (const auto* g : {&fused.gq, &fused.gk})
    EXPECT_TRUE(std::all_of(g->begin(), g->end(), [](double y) { return std::isfinite(y); }));
}

// A step with fused attention is an ordinary node to mt::compile: replays give the traced bits.
TEST(FusedAttention, CompileReplaysAStepBitForBit) {
  struct Run {
    mt::Generator gen{3};
    mt::Linear proj{8, 24, true, &gen};
    mt::SGD opt{proj.parameters(), mt::SGDOptions{.lr = 0.05}};
    mt::Tensor x = mt::randn({2, 9, 8}, mt::f32, &gen);
    mt::Tensor step(const mt::Tensor& input) {
      opt.zero_grad();
      mt::Tensor qkv = mt::permute(mt::reshape(proj(input), {2, 9, 6, 4}), {0, 2, 1, 3});
      auto part = [&](int64_t i) { return mt::slice(qkv, 1, 2 * i, 2 * i + 2); };
      mt::Tensor loss =
          mt::mean(mt::square(mt::scaled_dot_product_attention(part(0), part(1), part(2), true)));
      loss.backward();
      opt.step();
      return loss;
    }
  };
  Run plain, compiled;
  auto step = mt::compile([&](const mt::Tensor& input) { return compiled.step(input); });
  for (int i = 0; i < 5; ++i) {
    mt::Tensor input = plain.x * (1.0 + 0.1 * i);
    EXPECT_EQ(plain.step(input).item(), step(input).item()) << "step " << i;
  }
  if (mt::current_device() != mt::Device::reference) {
    EXPECT_GT(step.stats().replays, 0);
  }
}

// Forward and backward keep O(T) bytes: the peak of stored values grows 4x from T = 512 to
// 2048 (the composite's [T, T] scores grow 16x).
TEST(FusedAttention, PeakStoredBytesGrowLinearlyInT) {
  if (mt::current_device() == mt::Device::reference)
    GTEST_SKIP() << "the reference executor keeps no peak";
  auto peak = [](int64_t t, bool fused) {
    const Case c{"memory", 1, 2, t, t, 32, 32, true, Case::None};
    const Values x = values_for(c, 11);
    mt::reset_execution_stats();
    run(c, x, fused, mt::f32);
    return static_cast<double>(mt::execution_stats().peak_bytes);
  };
  const double fused_ratio = peak(2048, true) / peak(512, true);
  EXPECT_LE(fused_ratio, 4.5);
  EXPECT_GE(fused_ratio, 3.5);
  EXPECT_GE(peak(2048, false) / peak(512, false), 10.0) << "the composite was meant to be O(T^2)";
}

}  // namespace
