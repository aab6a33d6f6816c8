// tests/test_attention.cpp -- fused attention against the materialized composite (its oracle),
// f64, autocast's half types, scores beyond f16's range, dropout on the weights (the composite's
// mask), mt::compile, CausalSelfAttention, and memory linear in T.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "examples/char_gpt_model.h"
#include "mixtape/mixtape.h"
#include "mixtape/runtime/attention.h"
#include "mixtape/runtime/cpu_features.h"

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
  uint64_t offset = 0;  // the dropout generator's after the call
};

// Dropout on the weights: the probability, and the seed of a fresh generator to draw from.
struct Drop {
  double p = 0;
  uint64_t seed = 0;
};

// Attention and the gradients of sum(out * weight), fused or composite, with leaves stored as
// `dtype` and an optional autocast policy around the call.
Result run(const Case& c, const Values& x, bool fused, mt::DType dtype,
           std::optional<mt::DType> autocast = std::nullopt, Drop drop = {}) {
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
  mt::Generator gen(drop.seed);
  {
    std::optional<mt::autocast> guard;
    if (autocast) guard.emplace(*autocast);
    out = mt::detail::attention(q, k, v, mask, c.causal, std::nullopt, fused, mt::Loc::current(),
                                drop.p, &gen);
  }
  mt::sum(mt::cast(out, dtype) * weight).backward();
  mt::eval({out, q.grad(), k.grad(), v.grad()});
  return {out.node()->op,
          out.to_vector<double>(),
          q.grad().to_vector<double>(),
          k.grad().to_vector<double>(),
          v.grad().to_vector<double>(),
          gen.offset()};
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

// The AVX-512 loops (16 lanes) give the AVX2 loops' bits (8 lanes): each tile product sums over
// the depth in the same order at either width. Head dims 24, 32, 64 and 128 take the 16- and
// 32-column blocks, the 8-column strips and the scalar edges; f32 and autocast-bf16.
TEST(FusedAttention, TheAvx512LoopsGiveTheAvx2LoopsBits) {
  if (!mt::missing_cpu_features({"avx512f", "avx2", "fma"}).empty())
    GTEST_SKIP() << "this CPU has no AVX-512";
  for (const Case& c : cases())
    for (std::optional<mt::DType> autocast :
         {std::optional<mt::DType>(), std::optional(mt::bf16)}) {
      SCOPED_TRACE(c.label + (autocast ? " bf16" : " f32"));
      const Values x = values_for(c, 11);
      Result wide = run(c, x, true, mt::f32, autocast);
      mt::set_attention_avx512(false);
      Result narrow = run(c, x, true, mt::f32, autocast);
      mt::set_attention_avx512(true);
      EXPECT_EQ(wide.out, narrow.out);
      EXPECT_EQ(wide.gq, narrow.gq);
      EXPECT_EQ(wide.gk, narrow.gk);
      EXPECT_EQ(wide.gv, narrow.gv);
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

// Dropout on the weights draws the mask dropout(softmax(...)) draws from the same generator state
// (rand's f32 stream over the [B, H, Tq, Tk] weights, rows of 67 and 130 keys starting inside a
// Philox block), so with one seed the fused op and the composite agree as they do without
// dropout, and leave the generator at the same offset; its backward pass recomputes that mask.
TEST(FusedAttention, DropoutDrawsTheCompositesMask) {
  const Drop drop{0.25, 5};
  for (const Case& c : {cases()[0], cases()[1], cases()[3]}) {
    SCOPED_TRACE(c.label);
    const Values x = values_for(c, 12);
    Result fused = run(c, x, true, mt::f32, std::nullopt, drop);
    Result composite = run(c, x, false, mt::f32, std::nullopt, drop);
    EXPECT_EQ(fused.op, mt::OpCode::Attention);
    EXPECT_EQ(fused.offset, composite.offset);
    expect_close(fused, composite, 1e-5);
    expect_close(fused, run(c, x, false, mt::f64, std::nullopt, drop), 1e-5);
    expect_close(run(c, x, true, mt::f64, std::nullopt, drop),
                 run(c, x, false, mt::f64, std::nullopt, drop), 1e-12);
    // The masks are there: without dropout, or from another seed, the result moves.
    EXPECT_GT(error(fused.out, run(c, x, true, mt::f32).out), 1e-2);
    EXPECT_GT(error(fused.out, run(c, x, true, mt::f32, std::nullopt, {0.25, 6}).out), 1e-2);
  }
}

// Bad dropout settings are errors; p = 1 drops every weight (zeros, no draw), as dropout() does.
TEST(FusedAttention, DropoutOutsideItsRangeIsAnErrorAndOneDropsEverything) {
  mt::Generator gen(2);
  mt::Tensor q = mt::randn({1, 2, 5, 4}, mt::f32, &gen);
  for (double p : {-0.1, 1.5, std::nan("")})
    EXPECT_THROW(mt::scaled_dot_product_attention(q, q, q, mt::Tensor(), true, std::nullopt, p),
                 mt::Error)
        << p;
  mt::AttentionDropout no_offset;
  no_offset.p = 0.5;
  EXPECT_THROW(mt::attention_forward(q, q, q, mt::Tensor(), true, 0.5, no_offset), mt::Error);
  const uint64_t before = gen.offset();
  mt::Tensor out =
      mt::scaled_dot_product_attention(q, q, q, mt::Tensor(), true, std::nullopt, 1.0, &gen);
  for (double y : out.to_vector<double>()) EXPECT_EQ(y, 0.0);
  EXPECT_EQ(gen.offset(), before);
}

// A backward pass that builds a graph takes the materialized gradient, which draws the forward
// node's mask again from its seed and offset: the fused gradient's values.
TEST(FusedAttention, TheMaterializedGradientDropsTheSameWeights) {
  const Case c = cases()[3];
  const Values x = values_for(c, 13);
  const Drop drop{0.3, 9};
  const Result fused = run(c, x, true, mt::f32, std::nullopt, drop);
  mt::Generator gen(drop.seed);
  mt::Tensor q = mt::tensor(x.q, {c.batch, c.heads, c.tq, c.d}, mt::f32);
  mt::Tensor k = mt::tensor(x.k, {c.batch, c.heads, c.tk, c.d}, mt::f32);
  mt::Tensor v = mt::tensor(x.v, {c.batch, c.heads, c.tk, c.dv}, mt::f32);
  mt::Tensor mask = mt::tensor(x.mask, {c.batch, 1, 1, c.tk}, mt::boolean);
  mt::Tensor out = mt::detail::attention(q, k, v, mask, c.causal, std::nullopt, true,
                                         mt::Loc::current(), drop.p, &gen);
  ASSERT_EQ(out.node()->op, mt::OpCode::Attention);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  auto grads = mt::detail::attention_gradients(
      q, k, v, mask, c.causal, scale, mt::AttentionDropout::of(*out.node()),
      mt::tensor(x.weight, {c.batch, c.heads, c.tq, c.dv}, mt::f32));
  EXPECT_LE(error(out.to_vector<double>(), fused.out), 1e-6);
  EXPECT_LE(error(grads[0].to_vector<double>(), fused.gq), 1e-5);
  EXPECT_LE(error(grads[1].to_vector<double>(), fused.gk), 1e-5);
  EXPECT_LE(error(grads[2].to_vector<double>(), fused.gv), 1e-5);
}

// Five SGD steps through fused attention (dropping weights with probability dropout_p), eager
// and compiled, from one seed: the same losses.
void compile_replays_a_step(double dropout_p) {
  struct Run {
    double dropout_p;
    mt::Generator gen{3};
    mt::Linear proj{8, 24, true, &gen};
    mt::SGD opt{proj.parameters(), mt::SGDOptions{.lr = 0.05}};
    mt::Tensor x = mt::randn({2, 9, 8}, mt::f32, &gen);
    mt::Tensor step(const mt::Tensor& input) {
      opt.zero_grad();
      mt::Tensor qkv = mt::permute(mt::reshape(proj(input), {2, 9, 6, 4}), {0, 2, 1, 3});
      auto part = [&](int64_t i) { return mt::slice(qkv, 1, 2 * i, 2 * i + 2); };
      mt::Tensor loss = mt::mean(mt::square(mt::scaled_dot_product_attention(
          part(0), part(1), part(2), mt::Tensor(), true, std::nullopt, dropout_p, &gen)));
      loss.backward();
      opt.step();
      return loss;
    }
  };
  Run plain{dropout_p}, compiled{dropout_p};
  auto step = mt::compile([&](const mt::Tensor& input) { return compiled.step(input); });
  for (int i = 0; i < 5; ++i) {
    mt::Tensor input = plain.x * (1.0 + 0.1 * i);
    EXPECT_EQ(plain.step(input).item(), step(input).item()) << "step " << i;
  }
  if (mt::current_device() != mt::Device::reference) {
    EXPECT_GT(step.stats().replays, 0);
  }
}

// A step with fused attention is an ordinary node to mt::compile: replays give the traced bits,
// with dropout too (the generator's offset is a value of the step, so each replay draws anew).
TEST(FusedAttention, CompileReplaysAStepBitForBit) {
  for (double p : {0.0, 0.3}) {
    SCOPED_TRACE(p);
    compile_replays_a_step(p);
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

// The CPU loops' tiles come from the values' allocator, so the measured process peak counts
// them: the backward op's key and value gradient tiles (T x d each) live beside its output
// (dQ, dK and dV packed) and the query gradient sliced from it (5.0 operands' bytes without
// the tiles on an AMD EPYC, 7.25 with them).
TEST(FusedAttention, TheMeasuredPeakCountsTheCpuLoopsTiles) {
  if (mt::current_device() != mt::Device::cpu) GTEST_SKIP() << "the CPU back end's loops";
  constexpr int64_t t = 4096, d = 128;
  mt::Generator gen(5);
  auto operand = [&] { return mt::randn({1, 1, t, d}, mt::f32, &gen).requires_grad_(); };
  mt::Tensor q = operand(), k = operand(), v = operand(),
             w = mt::randn({1, 1, t, d}, mt::f32, &gen);
  mt::Tensor loss = mt::sum(mt::scaled_dot_product_attention(q, k, v, true) * w);
  mt::eval({loss, w});
  mt::reset_execution_stats();
  const int64_t before = mt::execution_stats().memory_peak_bytes;
  loss.backward();
  mt::eval({q.grad()});
  const int64_t operand_bytes = t * d * 4;
  EXPECT_GE(mt::execution_stats().memory_peak_bytes - before, 6 * operand_bytes);
}

// CausalSelfAttention as it was before the fused op, over the module's own layers: the
// materialized scores, masked softmax and attn_dropout (the oracle the module is held to).
mt::Tensor composite_block(const mt::CausalSelfAttention& attn, const mt::Tensor& x) {
  const int64_t batch = x.size(0), time = x.size(1), dim = x.size(2), head_dim = dim / attn.heads;
  mt::Tensor projected = attn.qkv(x);
  auto split_heads = [&](int64_t part) {
    mt::Tensor t = mt::slice(projected, 2, part * dim, (part + 1) * dim);
    return mt::permute(mt::reshape(t, {batch, time, attn.heads, head_dim}), {0, 2, 1, 3});
  };
  mt::Tensor q = split_heads(0), k = split_heads(1), v = split_heads(2);
  mt::Tensor scores =
      mt::matmul(q, k, false, true) * (1.0 / std::sqrt(static_cast<double>(head_dim)));
  mt::Tensor weights = attn.attn_dropout(mt::masked_softmax(scores, mt::causal_mask(time), -1));
  return attn.proj(
      mt::reshape(mt::permute(mt::matmul(weights, v), {0, 2, 1, 3}), {batch, time, dim}));
}

// One attention block's forward and backward pass: its output, its parameters' gradients and
// the stored values' peak of the evaluation that computed them.
struct BlockPass {
  std::vector<std::vector<double>> values;  // the output, then the gradients
  int64_t peak_bytes = 0;
};

BlockPass block_pass(int64_t batch, int64_t time, bool fused, bool training) {
  mt::Generator gen(4);
  mt::CausalSelfAttention attn(16, 2, 0.2, &gen);
  attn.train(training);
  mt::Tensor x = mt::randn({batch, time, 16}, mt::f32, &gen);
  mt::Tensor weight = mt::randn({batch, time, 16}, mt::f32, &gen);
  std::vector<mt::Tensor> values{x, weight};
  for (const mt::Tensor& p : attn.parameters()) values.push_back(p);
  mt::eval(values);  // the inputs, before the step is measured
  mt::Tensor out = fused ? attn(x) : composite_block(attn, x);
  mt::sum(out * weight).backward();
  values = {out};
  for (const mt::Tensor& p : attn.parameters()) values.push_back(p.grad());
  mt::reset_execution_stats();
  mt::eval(values);
  BlockPass pass;
  pass.peak_bytes = mt::execution_stats().peak_bytes;
  for (const mt::Tensor& t : values) pass.values.push_back(t.to_vector<double>());
  return pass;
}

// The char GPT's attention block runs one fused node, training (with its dropout, the mask
// attn_dropout would draw) and in eval: its output and gradients are the composite's.
TEST(FusedAttention, CausalSelfAttentionIsTheCompositeBlock) {
  for (bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "eval");
    const BlockPass fused = block_pass(2, 37, true, training);
    const BlockPass composite = block_pass(2, 37, false, training);
    ASSERT_EQ(fused.values.size(), composite.values.size());
    for (size_t i = 0; i < fused.values.size(); ++i)
      EXPECT_LE(error(fused.values[i], composite.values[i]), 1e-5) << "value " << i;
  }
  // Dropout is on when training: the two runs differ.
  EXPECT_GT(
      error(block_pass(2, 37, true, true).values[0], block_pass(2, 37, true, false).values[0]),
      1e-3);
}

// The "no quadratic memory": a training step (forward, dropout, backward) of the char
// GPT's attention block keeps O(T) stored bytes, 4x from T = 512 to 2048, where the composite
// block's [T, T] weights grow 16x.
TEST(FusedAttention, TheAttentionBlocksStoredPeakGrowsLinearlyInT) {
  if (mt::current_device() == mt::Device::reference)
    GTEST_SKIP() << "the reference executor keeps no peak";
  auto ratio = [](bool fused) {
    return static_cast<double>(block_pass(1, 2048, fused, true).peak_bytes) /
           static_cast<double>(block_pass(1, 512, fused, true).peak_bytes);
  };
  const double fused = ratio(true), composite = ratio(false);
  EXPECT_GE(fused, 3.5);
  EXPECT_LE(fused, 4.5);
  EXPECT_GE(composite, 12.0) << "the composite was meant to be O(T^2)";
  std::printf("stored peak, T = 2048 over T = 512: fused %.2f, composite %.2f\n", fused, composite);
}

// The same for a whole char GPT training step (one block, dropout 0.1, batch 1) at context 512
// and 2048: embeddings, norms, MLP, head and loss are O(T), and so now is its attention.
TEST(FusedAttention, TheCharGptsStoredPeakGrowsLinearlyInContext) {
  if (mt::current_device() == mt::Device::reference)
    GTEST_SKIP() << "the reference executor keeps no peak";
  auto peak = [](int64_t context) {
    mt::Generator gen(6);
    CharGpt model(
        {.vocab = 32, .layers = 1, .heads = 2, .width = 16, .context = context, .dropout = 0.1},
        &gen);
    mt::Tensor tokens = mt::randint(0, 32, {1, context}, &gen);
    mt::Tensor targets = mt::randint(0, 32, {1, context}, &gen);
    std::vector<mt::Tensor> values{tokens, targets};
    for (const mt::Tensor& p : model.parameters()) values.push_back(p);
    mt::eval(values);
    mt::Tensor loss = model.loss(tokens, targets);
    loss.backward();
    values = {loss};
    for (const mt::Tensor& p : model.parameters()) values.push_back(p.grad());
    mt::reset_execution_stats();
    mt::eval(values);
    return static_cast<double>(mt::execution_stats().peak_bytes);
  };
  const double ratio = peak(2048) / peak(512);
  EXPECT_GE(ratio, 3.5);
  EXPECT_LE(ratio, 4.5);
  std::printf("char GPT stored peak, context 2048 over 512: %.2f\n", ratio);
}

}  // namespace

namespace {
std::vector<float> values(const mt::Tensor& t) { return mt::cast(t, mt::f32).to_vector<float>(); }
bool all_finite(const mt::Tensor& t) {
  for (float x : values(t))
    if (!std::isfinite(x)) return false;
  return true;
}
mt::Tensor leaf_like(mt::Generator& gen, mt::Shape shape) {
  return mt::tensor(mt::randn(shape, mt::f32, &gen).to_vector<float>(), shape).requires_grad_();
}
}  // namespace

// Queries that see no key (left padding under a causal mask) get zero weights and a zero
// gradient in the fused kernels. The composite (the fallback, and the gradient a create_graph
// backward builds) gave NaN rows, which its products spread to every element of dK and dV.
TEST(FusedAttention, QueriesWithNoKeyGiveZerosAlsoInTheCompositeAndSecondOrder) {
  mt::Generator gen(1);
  const int64_t T = 6, D = 4;
  mt::Tensor q = leaf_like(gen, {1, 1, T, D}), k = leaf_like(gen, {1, 1, T, D}),
             v = leaf_like(gen, {1, 1, T, D});
  mt::Tensor keys =
      mt::cast(mt::tensor(std::vector<float>{0, 0, 1, 1, 1, 1}, {1, 1, 1, T}), mt::boolean);
  mt::Tensor fused = mt::scaled_dot_product_attention(q, k, v, keys, true);
  mt::Tensor composite = mt::detail::attention_composite(q, k, v, keys, true, 0.5, 0, nullptr);
  std::vector<float> c = values(composite), f = values(fused);
  for (size_t j = 0; j < c.size(); ++j) EXPECT_NEAR(c[j], f[j], 1e-6) << j;
  EXPECT_EQ(c[0], 0.0f) << "query 0 sees no key";
  auto first = mt::grad({mt::sum(fused * fused)}, {q, k, v});
  auto second = mt::grad({mt::sum(fused * fused)}, {q, k, v}, {}, /*create_graph=*/true);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(all_finite(second[i])) << "input " << i;
    std::vector<float> a = values(first[i]), b = values(second[i]);
    for (size_t j = 0; j < a.size(); ++j) EXPECT_NEAR(a[j], b[j], 1e-5) << i << " " << j;
  }
  mt::Tensor penalty = mt::sum(second[0] * second[0]) + mt::sum(second[1] * second[1]);
  penalty.backward();
  EXPECT_TRUE(all_finite(q.grad()));
  EXPECT_TRUE(all_finite(k.grad()));
}

// Rows that an additive -inf mask leaves no key (alone, and with the causal mask) are zeros
// with zero, finite gradients in the composite too: its softmax saw the all -inf row, whose
// gradient was NaN (and with causal, its row test ignored the additive -inf: NaN outputs).
TEST(FusedAttention, RowsAnAdditiveMaskEmptiesHaveZeroGradientsInTheComposite) {
  mt::Generator gen(2);
  const int64_t T = 4, D = 4;
  const float ninf = -std::numeric_limits<float>::infinity();
  mt::Tensor q = leaf_like(gen, {1, T, D}), k = leaf_like(gen, {1, T, D}),
             v = leaf_like(gen, {1, T, D});
  std::vector<float> row_one(T * T, 0.0f);
  for (int64_t j = 0; j < T; ++j) row_one[static_cast<size_t>(T + j)] = ninf;  // query 1: none
  std::vector<float> causal_row_one(T * T, 0.0f);
  causal_row_one[static_cast<size_t>(T)] = causal_row_one[static_cast<size_t>(T + 1)] = ninf;
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal);
    mt::Tensor mask = mt::tensor(causal ? causal_row_one : row_one, {T, T}).requires_grad_();
    mt::Tensor out = mt::detail::attention_composite(q, k, v, mask, causal, 0.5, 0, nullptr);
    std::vector<float> o = values(out);
    ASSERT_TRUE(all_finite(out));
    for (int64_t e = 0; e < D; ++e) EXPECT_EQ(o[static_cast<size_t>(T + e)], 0.0f);
    auto grads = mt::grad({mt::sum(out * out)}, {q, k, v, mask});
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(all_finite(grads[i])) << "input " << i;
    for (int64_t e = 0; e < D; ++e) EXPECT_EQ(values(grads[0])[static_cast<size_t>(T + e)], 0.0f);
  }
}

// A NaN score makes its row NaN in the fused kernels, as in the composite and PyTorch: their
// maximum skipped it, found no score, and gave the row zero weights and a finite loss.
TEST(FusedAttention, ANanScoreMakesItsRowNan) {
  mt::Generator gen(3);
  const int64_t T = 3, D = 4;
  std::vector<float> qv = mt::randn({1, T, D}, mt::f32, &gen).to_vector<float>();
  qv[static_cast<size_t>(D)] = std::numeric_limits<float>::quiet_NaN();  // query 1
  mt::Tensor q = mt::tensor(qv, {1, T, D}), k = mt::randn({1, T, D}, mt::f32, &gen),
             v = mt::randn({1, T, D}, mt::f32, &gen);
  for (mt::Device device : {mt::Device::cpu, mt::Device::reference}) {
    const mt::Device previous = mt::current_device();
    mt::set_device(device);
    std::vector<float> out = values(mt::scaled_dot_product_attention(q, k, v, {}));
    mt::set_device(previous);
    for (int64_t e = 0; e < D; ++e) {
      EXPECT_TRUE(std::isnan(out[static_cast<size_t>(D + e)])) << mt::device_name(device);
      EXPECT_FALSE(std::isnan(out[static_cast<size_t>(e)])) << mt::device_name(device);
    }
  }
}

// A mask with batch dims the operands lack ([3, Tq, Tk] beside [1, Tq, D]) broadcasts the result,
// as PyTorch's: it passed the broadcast check and then failed in the fused op's own.
TEST(FusedAttention, AMaskWiderThanTheOperandsBatchBroadcastsTheResult) {
  mt::Generator gen(4);
  mt::Tensor q = mt::randn({1, 5, 4}, mt::f32, &gen), k = mt::randn({1, 7, 4}, mt::f32, &gen),
             v = mt::randn({1, 7, 4}, mt::f32, &gen), mask = mt::randn({3, 5, 7}, mt::f32, &gen);
  mt::Tensor out = mt::scaled_dot_product_attention(q, k, v, mask);
  EXPECT_EQ(out.shape(), (mt::Shape{3, 5, 4}));
  std::vector<float> got = values(out), want = values(mt::detail::attention_composite(
                                            q, k, v, mask, false, 0.5, 0, nullptr));
  for (size_t j = 0; j < want.size(); ++j) EXPECT_NEAR(got[j], want[j], 1e-6) << j;
}

// Causal attention with fewer or more queries than keys: query i sees keys 0..i, PyTorch's
// top-left alignment (torch.ones(L, S).tril()), in the fused op, the masked overload and
// MultiheadAttention; the same as that mask given explicitly, and alone or with another mask.
TEST(FusedAttention, CausalWithOtherQueryAndKeyCountsAlignsTopLeft) {
  mt::Generator gen(6);
  for (auto [L, S] : {std::pair<int64_t, int64_t>{3, 7}, {7, 3}}) {
    SCOPED_TRACE(fmt::format("L {} S {}", L, S));
    mt::Tensor q = mt::randn({2, L, 4}, mt::f32, &gen), k = mt::randn({2, S, 4}, mt::f32, &gen),
               v = mt::randn({2, S, 4}, mt::f32, &gen);
    std::vector<int64_t> tril;
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) tril.push_back(j <= i ? 1 : 0);
    mt::Tensor lower = mt::tensor(tril, {L, S}, mt::boolean);
    std::vector<float> want = values(mt::scaled_dot_product_attention(q, k, v, lower));
    auto expect_want = [&](const mt::Tensor& got, const std::vector<float>& expected) {
      std::vector<float> g = values(got);
      ASSERT_EQ(g.size(), expected.size());
      for (size_t j = 0; j < g.size(); ++j) EXPECT_NEAR(g[j], expected[j], 1e-6) << j;
    };
    expect_want(mt::scaled_dot_product_attention(q, k, v, true), want);
    expect_want(mt::scaled_dot_product_attention(q, k, v, mt::Tensor(), true), want);
    // With a key padding mask as well: the two combined.
    std::vector<int64_t> keep(static_cast<size_t>(S), 1);
    keep[0] = 0;
    mt::Tensor keys = mt::tensor(keep, {S}, mt::boolean);
    expect_want(mt::scaled_dot_product_attention(q, k, v, keys, true),
                values(mt::scaled_dot_product_attention(q, k, v, mt::logical_and(keys, lower))));
  }
}

// ... and so does a bool mask, whose broadcast widened the mask but not the scores.
TEST(FusedAttention, ABoolMaskWiderThanTheOperandsBatchBroadcastsTheResult) {
  mt::Generator gen(4);
  mt::Tensor q = mt::randn({1, 5, 4}, mt::f32, &gen), k = mt::randn({1, 7, 4}, mt::f32, &gen),
             v = mt::randn({1, 7, 4}, mt::f32, &gen), noise = mt::randn({3, 5, 7}, mt::f32, &gen);
  mt::Tensor allowed = noise > -0.5,
             additive = mt::where(allowed, mt::zeros_like(noise), mt::full_like(noise, -INFINITY));
  mt::Tensor out = mt::scaled_dot_product_attention(q, k, v, allowed);
  EXPECT_EQ(out.shape(), (mt::Shape{3, 5, 4}));
  std::vector<float> got = values(out),
                     want = values(mt::scaled_dot_product_attention(q, k, v, additive));
  for (size_t j = 0; j < want.size(); ++j) EXPECT_NEAR(got[j], want[j], 1e-6) << j;
}

// A row whose keys an additive mask of -1e9 (or the f32 minimum, PyTorch's masked_fill value)
// all hides gets the forward pass's weights, exp(s - max) / sum, in the fused backward too: its
// log-sum-exp max + log(sum) lost log(sum) to rounding, so each weight was 1 and the row's
// gradients were the key count times the composite's.
TEST(FusedAttention, RowsAHugeAdditiveMaskHidesGetTheCompositesGradients) {
  if (mt::current_device() == mt::Device::reference)
    GTEST_SKIP() << "the reference loops make these rows' weights in f64, where -1e9 keeps the "
                    "differences of the scores that the f32 composite rounds away";
  const Case c{"hidden rows", 1, 1, 3, 40, 8, 8, false, Case::Additive};
  for (double hide : {-1e9, static_cast<double>(std::numeric_limits<float>::lowest())}) {
    SCOPED_TRACE(hide);
    Values x = values_for(c, 9);
    for (int64_t j = 0; j < c.tk; ++j) x.mask[static_cast<size_t>(j)] = hide;  // query 0
    Result fused = run(c, x, true, mt::f32), composite = run(c, x, false, mt::f32);
    EXPECT_EQ(fused.op, mt::OpCode::Attention);
    expect_close(fused, composite, 1e-5);
  }
}

// PyTorch's argument order (dropout_p before is_causal) does not compile, rather than taking the
// dropout probability as the causal flag.
template <typename... Args>
concept AttentionCall = requires(Args... args) {
  mt::scaled_dot_product_attention(args...);
};
static_assert(!AttentionCall<mt::Tensor, mt::Tensor, mt::Tensor, mt::Tensor, double>);
static_assert(!AttentionCall<mt::Tensor, mt::Tensor, mt::Tensor, mt::Tensor, double, bool>);
static_assert(AttentionCall<mt::Tensor, mt::Tensor, mt::Tensor, mt::Tensor, bool>);
static_assert(AttentionCall<mt::Tensor, mt::Tensor, mt::Tensor, mt::Tensor, bool, double, double>);

// With no key to attend (S = 0) MultiheadAttention averages nothing: its output is out_proj's
// bias and its weights are empty, as PyTorch's (a softmax over the empty axis threw).
TEST(FusedAttention, MultiheadAttentionOverNoKeysGivesTheOutputBias) {
  mt::MultiheadAttention mha(8, 2);
  mha.out_proj.bias.assign(mt::full({8}, 0.25));
  mt::Tensor query = mt::ones({3, 2, 8}), keys = mt::ones({0, 2, 8});
  mt::MultiheadAttention::Result r = mha(query, keys, keys);
  EXPECT_EQ(r.output.shape(), (mt::Shape{3, 2, 8}));
  for (float x : values(r.output)) EXPECT_EQ(x, 0.25f);
  EXPECT_EQ(r.weights.shape(), (mt::Shape{2, 3, 0}));
}

// MultiheadAttention scales q before its product, as PyTorch's: under autocast-f16 the unscaled
// product overflowed to inf (NaN outputs) once the scaled scores passed 65504 / sqrt(E).
TEST(FusedAttention, MultiheadAttentionKeepsLargeScoresFiniteUnderAutocastF16) {
  mt::MultiheadAttention mha(64, 1);
  std::vector<float> identity(64 * 64, 0.0f);
  for (size_t i = 0; i < 64; ++i) identity[i * 65] = 1.0f;
  mt::Tensor eye = mt::tensor(identity, {64, 64});
  mha.in_proj_weight.assign(mt::concat({eye, eye, eye}, 0));
  mha.in_proj_bias.assign(mt::zeros({192}));
  mt::Tensor x = mt::full({2, 1, 64}, 35.0);  // scaled scores 35^2 * 64 / 8 = 9800
  mt::Tensor out;
  {
    mt::autocast guard(mt::f16);
    out = mha(x, x, x).output;
  }
  EXPECT_TRUE(all_finite(out));
}

// Precision-aware saving rounded attention's additive mask for the backward pass, whose softmax
// then differed from the forward's (a mask shifted by 1000, which the softmax ignores, gave q's
// gradient a relative error of 1.2). q, k and v are leaves here, so nothing may be rounded.
TEST(FusedAttention, SavingActivationsNarrowerLeavesTheMaskAsItIs) {
  mt::Generator gen(4);
  const int64_t T = 16, D = 8;
  mt::Tensor q = leaf_like(gen, {1, 1, T, D}), k = leaf_like(gen, {1, 1, T, D}),
             v = leaf_like(gen, {1, 1, T, D});
  mt::Tensor noise = mt::randn({1, 1, T, T}, mt::f32, &gen);
  auto narrow = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  narrow->save_activations("**", mt::bf16);
  auto gradients = [&](const mt::PolicyPtr& policy) {
    mt::Tensor out;
    {
      mt::autocast guard(policy);
      mt::ModulePathScope in_module("attn");
      out = mt::scaled_dot_product_attention(q, k, v, noise * 3.0 + 1000.0, false);
    }
    auto g = mt::grad({mt::sum(out * out)}, {q, k});
    return std::pair{values(g[0]), values(g[1])};
  };
  EXPECT_EQ(gradients(narrow), gradients(mt::fp32_policy()));
}
