// tests/test_grad_scaler.cpp -- loss scaling: PyTorch's scale-update rule step by step, skipped
// steps that leave weights and optimizer state bit-identical, predicated optimizer steps,
// unscale before clipping, several optimizers, losses and micro-batches, state and checkpoint
// round trips, and bad inputs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <mixtape/mixtape.h>

#include <fmt/format.h>

#include "tests/test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using Bytes = std::vector<std::byte>;

Bytes bytes_of(const mt::Tensor& t) {
  mt::eval({t});
  const mt::Storage& s = *t.node()->value;
  return Bytes(s.host_data(), s.host_data() + s.size_bytes());
}

// Every bit an optimizer step may change: parameters, state (exp_avg, exp_avg_sq,
// momentum_buffer) and the step count.
std::vector<Bytes> optimizer_bits(const mt::Optimizer& opt) {
  std::vector<Bytes> bits;
  for (size_t i = 0; i < opt.params().size(); ++i) {
    bits.push_back(bytes_of(opt.params()[i]));
    for (const auto& [name, value] : opt.state(i)) bits.push_back(bytes_of(value));
  }
  bits.push_back(bytes_of(opt.step_count()));
  return bits;
}

std::vector<Bytes> grad_bits(const std::vector<mt::Tensor>& params) {
  std::vector<Bytes> bits;
  for (const mt::Tensor& p : params) bits.push_back(bytes_of(p.grad()));
  return bits;
}

mt::Tensor param(std::vector<float> values) {
  int64_t n = static_cast<int64_t>(values.size());
  mt::Tensor p = mt::tensor(values, {n});
  p.requires_grad_();
  return p;
}

// A 2x2 linear layer on fixed data: small enough for thousands of real steps.
struct Tiny {
  Tiny() = default;
  explicit Tiny(uint64_t seed) : gen(seed) {}
  mt::Generator gen{7};
  mt::Linear lin{2, 2, true, &gen};
  mt::Tensor x = mt::tensor(std::vector<float>{0.5f, -1.0f, 1.5f, 0.25f, -0.75f, 2.0f}, {3, 2});
  mt::Tensor y = mt::tensor(std::vector<float>{1.0f, 0.0f, -1.0f, 0.5f, 0.25f, 2.0f}, {3, 2});
  mt::Tensor loss() { return mt::mse_loss(lin(x), y); }
  mt::Tensor loss_on(const mt::Tensor& input) { return mt::mse_loss(lin(input), y); }
};

// Adds +inf to one element of the weight's gradient.
void inject_inf(mt::Linear& lin) {
  mt::Tensor w = lin.weight;
  w.set_grad(w.grad() + mt::tensor(std::vector<float>{0, kInf, 0, 0}, {2, 2}));
}

// ---------------------------------------------------------------------------------------------
// The scale-update rule against a table worked out from PyTorch's _amp_update_scale_ kernel
// (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp): on inf/NaN scale = f32(scale * backoff)
// and tracker = 0; otherwise tracker + 1, and when that equals growth_interval the scale becomes
// f32(scale * growth) if that is finite, and the tracker 0. The clamps are our extension. The
// tables were cross-checked with a separate Python/numpy model of that kernel.

struct Row {
  char grad;  // the scaled gradient: 'F' finite, 'I' +inf, 'M' -inf, 'N' NaN in one element
  bool skipped;
  double scale;  // after update()
  int64_t tracker;
};

void run_script(const mt::GradScalerOptions& options, const std::vector<Row>& table) {
  mt::Tensor p = param({0, 0});
  mt::SGD opt({p}, {.lr = 1});
  mt::GradScaler scaler(options);
  int64_t taken = 0;
  std::vector<bool> skips;
  std::vector<double> scales;
  for (size_t i = 0; i < table.size(); ++i) {
    const Row& row = table[i];
    SCOPED_TRACE(fmt::format("step {} ('{}')", i, row.grad));
    float second = row.grad == 'I' ? kInf : row.grad == 'M' ? -kInf : row.grad == 'N' ? kNaN : -2;
    opt.zero_grad();
    p.set_grad(mt::tensor(std::vector<float>{1, second}, {2}));
    Bytes before = bytes_of(p);
    scaler.step(opt);
    scaler.update();
    EXPECT_EQ(bytes_of(p) == before, row.skipped);  // a taken step always moves p here
    EXPECT_EQ(scaler.get_scale(), row.scale);
    EXPECT_EQ(scaler.get_growth_tracker(), row.tracker);
    taken += row.skipped ? 0 : 1;
    EXPECT_EQ(opt.steps_taken(), taken);
    skips.push_back(row.skipped);
    scales.push_back(row.scale);
  }
  EXPECT_EQ(scaler.skip_history(), skips);
  EXPECT_EQ(scaler.scale_history(), scales);
  EXPECT_EQ(scaler.skipped_steps(), static_cast<int64_t>(table.size()) - taken);
}

// One table row per line.
// clang-format off
TEST(GradScalerRule, BurstsLongRunsAndOverflowRightAfterGrowth) {
  run_script({.init_scale = 1024, .growth_interval = 3}, {
      {'F', false, 1024, 1},
      {'F', false, 1024, 2},
      {'F', false, 2048, 0},  // growth
      {'I', true, 1024, 0},   // overflow right after growth
      {'F', false, 1024, 1},
      {'F', false, 1024, 2},
      {'I', true, 512, 0},    // overflow one step before growth: the count restarts
      {'F', false, 512, 1},
      {'F', false, 512, 2},
      {'F', false, 1024, 0},
      {'N', true, 512, 0},    // NaN right after growth
      {'I', true, 256, 0},    // a burst
      {'I', true, 128, 0},
      {'I', true, 64, 0},
      {'F', false, 64, 1},    // a long clean run: two growths
      {'F', false, 64, 2},
      {'F', false, 128, 0},
      {'F', false, 128, 1},
      {'F', false, 128, 2},
      {'F', false, 256, 0},
      {'F', false, 256, 1},
      {'M', true, 128, 0},    // -inf
      {'F', false, 128, 1},
      {'F', false, 128, 2},
      {'F', false, 256, 0},
  });
}

TEST(GradScalerRule, MinAndMaxClampTheScale) {
  run_script({.init_scale = 8, .growth_interval = 2, .min_scale = 4, .max_scale = 16}, {
      {'F', false, 8, 1},
      {'F', false, 16, 0},
      {'F', false, 16, 1},
      {'F', false, 16, 0},    // 32 clamped to max; the tracker still restarts
      {'I', true, 8, 0},
      {'I', true, 4, 0},
      {'I', true, 4, 0},      // 2 clamped to min
      {'N', true, 4, 0},
      {'F', false, 4, 1},
      {'F', false, 8, 0},
      {'F', false, 8, 1},
      {'F', false, 16, 0},
      {'F', false, 16, 1},
      {'F', false, 16, 0},
  });
}

TEST(GradScalerRule, NonPowerOfTwoFactorsRoundThroughDoubleToF32) {
  // f32(0.1) = 0x1.99999ap-4; every product is formed in double and rounded to f32 (f32
  // arithmetic would give other values at 9 of these 12 steps).
  run_script({.init_scale = 0.1, .growth_factor = 1.3, .backoff_factor = 0.9,
              .growth_interval = 2}, {
      {'F', false, 0x1.99999ap-4, 1},
      {'F', false, 0x1.0a3d70p-3, 0},
      {'F', false, 0x1.0a3d70p-3, 1},
      {'F', false, 0x1.5a1cacp-3, 0},
      {'F', false, 0x1.5a1cacp-3, 1},
      {'F', false, 0x1.c1f212p-3, 0},
      {'I', true, 0x1.94f376p-3, 0},
      {'N', true, 0x1.6c74b8p-3, 0},
      {'F', false, 0x1.6c74b8p-3, 1},
      {'F', false, 0x1.d9caf0p-3, 0},
      {'F', false, 0x1.d9caf0p-3, 1},
      {'I', true, 0x1.aa69d8p-3, 0},
  });
}

TEST(GradScalerRule, GrowthNeverOverflowsF32) {
  run_script({.init_scale = 0x1p127, .growth_interval = 1}, {
      {'F', false, 0x1p127, 0},  // 2^128 is inf in f32: the scale stays
      {'F', false, 0x1p127, 0},
      {'I', true, 0x1p126, 0},
      {'F', false, 0x1p127, 0},
      {'F', false, 0x1p127, 0},
  });
}

TEST(GradScalerRule, StaticScaleNeverChangesButStillSkips) {
  run_script({.init_scale = 256, .growth_interval = 2, .dynamic = false}, {
      {'F', false, 256, 0},
      {'F', false, 256, 0},
      {'F', false, 256, 0},
      {'I', true, 256, 0},
      {'N', true, 256, 0},
      {'F', false, 256, 0},
  });
}
// clang-format on

// ---------------------------------------------------------------------------------------------
// Real training steps.

TEST(GradScaler, InjectedInfSkipsExactlyThatStepAnd2000CleanStepsDoubleTheScale) {
  Tiny m;
  mt::AdamW opt(m.lin.parameters(), {.lr = 1e-3, .weight_decay = 0.01});
  mt::GradScaler scaler;  // PyTorch's defaults: 65536, x2 every 2000 clean steps, x0.5 on inf
  auto step = [&](bool inject) {
    opt.zero_grad();
    scaler.scale(m.loss()).backward();
    if (inject) inject_inf(m.lin);
    scaler.step(opt);
    scaler.update();
  };
  for (int i = 0; i < 5; ++i) step(false);
  EXPECT_EQ(scaler.get_scale(), 65536);
  EXPECT_EQ(scaler.get_growth_tracker(), 5);
  ASSERT_EQ(opt.state(0).size(), 2u);  // exp_avg and exp_avg_sq exist and are compared

  std::vector<Bytes> before = optimizer_bits(opt);
  step(true);
  EXPECT_EQ(optimizer_bits(opt), before);  // weights, exp_avg, exp_avg_sq, step: every bit
  EXPECT_EQ(opt.steps_taken(), 5);
  EXPECT_EQ(scaler.get_scale(), 32768);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);

  step(false);  // the next clean step is taken again
  EXPECT_NE(optimizer_bits(opt), before);
  EXPECT_EQ(opt.steps_taken(), 6);
  for (int i = 1; i < 1999; ++i) step(false);
  EXPECT_EQ(scaler.get_scale(), 32768);
  EXPECT_EQ(scaler.get_growth_tracker(), 1999);
  step(false);
  EXPECT_EQ(scaler.get_scale(), 65536);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  EXPECT_EQ(opt.steps_taken(), 2005);

  EXPECT_EQ(scaler.skipped_steps(), 1);
  std::vector<bool> skips = scaler.skip_history();
  ASSERT_EQ(skips.size(), 2006u);
  for (size_t i = 0; i < skips.size(); ++i) EXPECT_EQ(skips[i], i == 5) << i;
  std::vector<double> scales = scaler.scale_history();
  ASSERT_EQ(scales.size(), 2006u);
  EXPECT_EQ(scales[4], 65536);
  EXPECT_EQ(scales[5], 32768);
  EXPECT_EQ(scales[2004], 32768);
  EXPECT_EQ(scales[2005], 65536);
}

TEST(GradScaler, UnscaleThenClipSeesTrueGradients) {
  Tiny plain, scaled;  // same seed: same weights
  mt::SGD plain_opt(plain.lin.parameters(), {.lr = 0.1});
  mt::SGD scaled_opt(scaled.lin.parameters(), {.lr = 0.1});
  mt::GradScaler scaler({.init_scale = 1024});

  plain.loss().backward();
  std::vector<Bytes> true_grads = grad_bits(plain.lin.parameters());
  std::vector<float> true_w = plain.lin.weight.grad().to_vector<float>();
  double true_norm = mt::clip_grad_norm(plain.lin.parameters(), 0.05).item();
  ASSERT_GT(true_norm, 0.05);  // so clipping changes the gradients
  std::vector<Bytes> clipped_grads = grad_bits(plain.lin.parameters());
  plain_opt.step();

  scaler.scale(scaled.loss()).backward();
  // Before unscale_ the gradients carry the scale (a power of two, so exactly).
  std::vector<float> scaled_w = scaled.lin.weight.grad().to_vector<float>();
  for (size_t i = 0; i < true_w.size(); ++i) EXPECT_EQ(scaled_w[i], true_w[i] * 1024) << i;
  scaler.unscale_(scaled_opt);
  EXPECT_EQ(grad_bits(scaled.lin.parameters()), true_grads);
  EXPECT_EQ(mt::clip_grad_norm(scaled.lin.parameters(), 0.05).item(), true_norm);
  EXPECT_EQ(grad_bits(scaled.lin.parameters()), clipped_grads);
  scaler.step(scaled_opt);  // no second unscale
  scaler.update();
  EXPECT_EQ(optimizer_bits(scaled_opt), optimizer_bits(plain_opt));
}

// f64 gradients are clipped by an f64 norm: their f32 squares overflowed at 1e20 (the norm inf,
// every gradient zeroed) and underflowed at 1e-30 (the norm 0), where torch gives 5e20 and 5e-30.
TEST(ClipGradNorm, F64GradientsKeepF64Range) {
  for (double scale : {1e20, 1e-30, 1.0}) {
    SCOPED_TRACE(scale);
    mt::Tensor w = mt::zeros({2}, mt::f64).requires_grad_();
    mt::sum(w * mt::tensor(std::vector<double>{3 * scale, 4 * scale}, {2})).backward();
    const double norm = mt::clip_grad_norm({w}, 1.0).item();
    EXPECT_NEAR(norm, 5 * scale, 1e-12 * 5 * scale);
    const std::vector<double> g = w.grad().to_vector<double>();
    const double clip = std::min(1.0, 1.0 / (5 * scale + 1e-6));  // torch's coefficient
    EXPECT_NEAR(g[0], 3 * scale * clip, 1e-12 * 3 * scale * clip);
    EXPECT_NEAR(g[1], 4 * scale * clip, 1e-12 * 4 * scale * clip);
  }
}

TEST(GradScaler, SeveralOptimizersShareOneScaler) {
  Tiny a, b;
  mt::SGD opt_a(a.lin.parameters(), {.lr = 0.1, .momentum = 0.9});
  mt::Adam opt_b(b.lin.parameters(), {.lr = 0.01});
  mt::GradScaler scaler({.init_scale = 4096, .growth_interval = 2});
  auto step = [&](bool inf_in_a, bool inf_in_b) {
    opt_a.zero_grad();
    opt_b.zero_grad();
    scaler.scale(a.loss() + b.loss()).backward();
    if (inf_in_a) inject_inf(a.lin);
    if (inf_in_b) inject_inf(b.lin);
    scaler.step(opt_a);
    scaler.step(opt_b);
    scaler.update();
  };
  step(false, false);
  std::vector<Bytes> a0 = optimizer_bits(opt_a), b0 = optimizer_bits(opt_b);
  step(false, true);  // each optimizer is skipped on its own flag, as in PyTorch
  EXPECT_NE(optimizer_bits(opt_a), a0);
  EXPECT_EQ(optimizer_bits(opt_b), b0);
  EXPECT_EQ(scaler.get_scale(), 2048);  // the flags are OR-ed for the update
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  std::vector<Bytes> a1 = optimizer_bits(opt_a), b1 = optimizer_bits(opt_b);
  step(true, true);  // both overflow: the scale backs off once, not twice
  EXPECT_EQ(optimizer_bits(opt_a), a1);
  EXPECT_EQ(optimizer_bits(opt_b), b1);
  EXPECT_EQ(scaler.get_scale(), 1024);
  step(false, false);
  step(false, false);
  EXPECT_EQ(scaler.get_scale(), 2048);
  EXPECT_NE(optimizer_bits(opt_b), b1);
  EXPECT_EQ(opt_a.steps_taken(), 4);
  EXPECT_EQ(opt_b.steps_taken(), 3);
  EXPECT_EQ(scaler.skipped_steps(), 2);
}

TEST(GradScaler, GradientAccumulationAndSeveralLosses) {
  // Two micro-batches and two losses per micro-batch, accumulated before one step. With a
  // power-of-two scale the unscaled gradients equal the unscaled run's bit for bit.
  Tiny plain, scaled;
  mt::Adam plain_opt(plain.lin.parameters(), {.lr = 0.01});
  mt::Adam scaled_opt(scaled.lin.parameters(), {.lr = 0.01});
  mt::GradScaler scaler({.init_scale = 0x1p20});
  mt::Tensor x2 = mt::tensor(std::vector<float>{1, 2, -1, 0.5f, 0, -2}, {3, 2});
  auto second_loss = [](Tiny& m) { return mt::mean(mt::square(m.lin.weight)) * 0.1; };
  for (int step = 0; step < 3; ++step) {
    plain_opt.zero_grad();
    scaled_opt.zero_grad();
    for (const mt::Tensor& input : {plain.x, x2}) {
      (plain.loss_on(input) * 0.5).backward();
      second_loss(plain).backward();
      scaler.scale(scaled.loss_on(input) * 0.5).backward();
      scaler.scale(second_loss(scaled)).backward();
    }
    scaler.unscale_(scaled_opt);
    EXPECT_EQ(grad_bits(scaled.lin.parameters()), grad_bits(plain.lin.parameters()));
    plain_opt.step();
    scaler.step(scaled_opt);
    scaler.update();
    EXPECT_EQ(optimizer_bits(scaled_opt), optimizer_bits(plain_opt));
  }
  // An overflow in one micro-batch skips the whole accumulated step.
  std::vector<Bytes> before = optimizer_bits(scaled_opt);
  scaled_opt.zero_grad();
  scaler.scale(scaled.loss()).backward();
  mt::Tensor huge = mt::tensor(std::vector<float>{3e38f, 0, 0, 0, 0, 0}, {3, 2});
  scaler.scale(scaled.loss_on(huge)).backward();
  scaler.step(scaled_opt);
  scaler.update();
  EXPECT_EQ(optimizer_bits(scaled_opt), before);
  EXPECT_EQ(scaler.get_scale(), 0x1p19);
  EXPECT_EQ(scaler.skip_history(), (std::vector<bool>{false, false, false, true}));
}

TEST(GradScaler, HalfLossIsScaledInF32) {
  mt::GradScaler scaler({.init_scale = 0x1p16});
  mt::Tensor loss = mt::tensor(std::vector<float>{3.0f}, {}, mt::f16);
  mt::Tensor scaled = scaler.scale(loss);
  EXPECT_EQ(scaled.dtype(), mt::f32);
  EXPECT_EQ(scaled.item(), 3.0 * 65536);  // 196608 would overflow f16 (max 65504)
}

TEST(GradScaler, UpdateIsGraphCodeEvaluatedWithTheNextStep) {
  Tiny m;
  mt::SGD opt(m.lin.parameters(), {.lr = 0.1});
  mt::GradScaler scaler({.growth_interval = 1});
  scaler.scale(m.loss()).backward();
  scaler.step(opt);
  scaler.update();
  // No host read: the new scale is a graph value that nothing has evaluated yet ...
  EXPECT_FALSE(scaler.scale_tensor().node()->evaluated());
  EXPECT_FALSE(scaler.growth_tracker_tensor().node()->evaluated());
  mt::Tensor pending_scale = scaler.scale_tensor(),
             pending_tracker = scaler.growth_tracker_tensor();
  opt.zero_grad();
  scaler.scale(m.loss()).backward();
  scaler.step(opt);
  // ... until the next step's program computes it along with the update.
  EXPECT_TRUE(pending_scale.node()->evaluated());
  EXPECT_TRUE(pending_tracker.node()->evaluated());
  EXPECT_EQ(pending_scale.item(), 131072);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 262144);
}

TEST(GradScaler, DisabledScalerIsAPassThrough) {
  Tiny plain, scaled;
  mt::Adam plain_opt(plain.lin.parameters(), {.lr = 0.01});
  mt::Adam scaled_opt(scaled.lin.parameters(), {.lr = 0.01});
  mt::GradScaler scaler({.enabled = false});
  for (int i = 0; i < 2; ++i) {
    plain_opt.zero_grad();
    scaled_opt.zero_grad();
    plain.loss().backward();
    mt::Tensor loss = scaled.loss();
    mt::Tensor same = scaler.scale(loss);
    EXPECT_TRUE(same.same(loss));
    same.backward();
    mt::Tensor w = scaled.lin.weight;
    mt::Tensor g = w.grad();
    scaler.unscale_(scaled_opt);
    EXPECT_EQ(w.grad().node(), g.node());
    plain_opt.step();
    scaler.step(scaled_opt);
    scaler.update();
    EXPECT_EQ(optimizer_bits(scaled_opt), optimizer_bits(plain_opt));
  }
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_EQ(scaler.skipped_steps(), 0);
  EXPECT_TRUE(scaler.scale_history().empty());
  EXPECT_TRUE(scaler.state_dict().empty());
  scaler.load_state_dict({});  // as PyTorch: a disabled scaler ignores state
}

// ---------------------------------------------------------------------------------------------
// Predicated optimizer steps.

TEST(OptimizerStepUnless, SkippedStepLeavesEveryBitAndTakenStepMatchesStep) {
  for (const char* kind : {"adam", "sgd"}) {
    SCOPED_TRACE(kind);
    Tiny a, b;
    auto make = [&](Tiny& m) -> std::unique_ptr<mt::Optimizer> {
      if (std::string(kind) == "adam")
        return std::make_unique<mt::Adam>(m.lin.parameters(), mt::AdamOptions{.lr = 0.01});
      return std::make_unique<mt::SGD>(m.lin.parameters(),
                                       mt::SGDOptions{.lr = 0.1, .momentum = 0.9});
    };
    auto opt_a = make(a), opt_b = make(b);
    for (int i = 0; i < 4; ++i) {
      opt_a->zero_grad();
      opt_b->zero_grad();
      a.loss().backward();
      b.loss().backward();
      // (Before the first real step there is no state to keep: see SkippedFirstStepLeavesNoTrace.)
      if (i > 0) {
        std::vector<Bytes> before = optimizer_bits(*opt_b);
        opt_b->step_unless(mt::tensor(std::vector<bool>{true}, {}));  // skipped
        EXPECT_EQ(optimizer_bits(*opt_b), before);
        opt_b->step_unless(mt::scalar(1.0));  // non-zero numeric: skipped too
        EXPECT_EQ(optimizer_bits(*opt_b), before);
      }
      opt_a->step();
      opt_b->step_unless(mt::scalar(0.0));  // taken: exactly as step()
      EXPECT_EQ(optimizer_bits(*opt_b), optimizer_bits(*opt_a));
    }
    EXPECT_EQ(opt_b->steps_taken(), 4);
  }
}

TEST(OptimizerStepUnless, SkippedFirstStepLeavesNoTrace) {
  // A skipped first step creates zero state; the next real step must still act as a first step:
  // Adam's bias correction uses t = 1 and SGD's dampened momentum buffer starts as the gradient.
  struct Case {
    const char* name;
    std::function<std::unique_ptr<mt::Optimizer>(std::vector<mt::Tensor>)> make;
  };
  std::vector<Case> cases = {
      {"adam", [](auto p) { return std::make_unique<mt::Adam>(p, mt::AdamOptions{.lr = 0.01}); }},
      {"sgd dampening",
       [](auto p) {
         return std::make_unique<mt::SGD>(
             p, mt::SGDOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.5});
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Tiny a, b;
    auto opt_a = c.make(a.lin.parameters()), opt_b = c.make(b.lin.parameters());
    for (int i = 0; i < 3; ++i) {
      opt_a->zero_grad();
      opt_b->zero_grad();
      a.loss().backward();
      b.loss().backward();
      if (i == 0) {
        opt_b->step_unless(mt::scalar(1.0));
        opt_b->step_unless(mt::scalar(1.0));
      }
      opt_a->step();
      opt_b->step_unless(mt::scalar(0.0));
      EXPECT_EQ(optimizer_bits(*opt_b), optimizer_bits(*opt_a)) << "step " << i;
    }
  }
}

TEST(OptimizerStepUnless, RejectsBadFlags) {
  mt::Tensor p = param({1, 2});
  mt::SGD opt({p}, {.lr = 0.1});
  p.set_grad(mt::ones({2}));
  EXPECT_MT_ERROR(opt.step_unless(mt::zeros({2}, mt::boolean)), "SGD", "one element", "[2]");
  EXPECT_MT_ERROR(opt.step_unless(mt::Tensor()), "SGD", "undefined");
  EXPECT_EQ(opt.steps_taken(), 0);
  opt.set_steps_taken(7);
  EXPECT_EQ(opt.steps_taken(), 7);
}

// ---------------------------------------------------------------------------------------------
// State and checkpoints.

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("mixtape_grad_scaler_{}_{}", getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

// Drives a scaler with synthetic gradients: 'F' finite, 'I' with an inf.
void drive(mt::GradScaler& scaler, mt::Optimizer& opt, mt::Tensor& p, const std::string& codes) {
  for (char code : codes) {
    opt.zero_grad();
    p.set_grad(mt::tensor(std::vector<float>{1, code == 'I' ? kInf : 2}, {2}));
    scaler.step(opt);
    scaler.update();
  }
}

TEST(GradScalerState, StateDictRoundTrip) {
  mt::GradScalerOptions options{.init_scale = 1024,
                                .growth_factor = 3,
                                .backoff_factor = 0.25,
                                .growth_interval = 4,
                                .min_scale = 1,
                                .max_scale = 1e6};
  mt::Tensor p = param({0, 0}), q = param({0, 0});
  mt::SGD opt_p({p}, {.lr = 1}), opt_q({q}, {.lr = 1});
  mt::GradScaler source(options);
  drive(source, opt_p, p, "FFFFFIFF");  // 1024 -> 3072 -> 768, tracker 2
  ASSERT_EQ(source.get_scale(), 768);
  ASSERT_EQ(source.get_growth_tracker(), 2);

  mt::GradScaler target;  // defaults everywhere
  target.load_state_dict(source.state_dict());
  EXPECT_EQ(target.get_scale(), 768);
  EXPECT_EQ(target.get_growth_tracker(), 2);
  EXPECT_EQ(target.options().growth_factor, 3);
  EXPECT_EQ(target.options().backoff_factor, 0.25);
  EXPECT_EQ(target.options().growth_interval, 4);
  EXPECT_EQ(target.options().min_scale, 1);
  EXPECT_EQ(target.options().max_scale, 1e6);
  // Both continue identically.
  for (const char* codes : {"F", "F", "I", "F", "F", "F", "F"}) {
    drive(source, opt_p, p, codes);
    drive(target, opt_q, q, codes);
    EXPECT_EQ(target.get_scale(), source.get_scale());
    EXPECT_EQ(target.get_growth_tracker(), source.get_growth_tracker());
  }
  // Bounds that the source did not have are unset by loading.
  mt::GradScaler plain({.init_scale = 16});
  target.load_state_dict(plain.state_dict());
  EXPECT_FALSE(target.options().min_scale.has_value());
  EXPECT_EQ(target.get_scale(), 16);
}

// Bounds f32 cannot hold exactly (1e-5 rounds down, 0.3 up): a scale clamped to one is the bound
// rounded to f32, and its state loads, as does a scaler made with it. Before, the scale was
// compared with the bound as a double, found outside, and a checkpoint saved after the scale
// reached the bound could not be resumed.
TEST(GradScalerState, AScaleClampedToABoundF32CannotHoldRoundTrips) {
  mt::Tensor p = param({0, 0});
  mt::SGD opt({p}, {.lr = 1});
  mt::GradScaler low({.init_scale = 1, .min_scale = 1e-5});
  drive(low, opt, p, "IIIIIIIIIIIIIIIIIIII");  // 2^-20 < 1e-5: clamped
  ASSERT_EQ(low.get_scale(), static_cast<double>(1e-5f));
  mt::GradScaler again({.init_scale = 1, .min_scale = 1e-5});
  again.load_state_dict(low.state_dict());
  EXPECT_EQ(again.get_scale(), low.get_scale());
  again.update(low.get_scale());
  mt::GradScaler from_scale({.init_scale = low.get_scale(), .min_scale = 1e-5});
  EXPECT_EQ(from_scale.get_scale(), low.get_scale());

  mt::GradScaler high({.init_scale = 0.3, .max_scale = 0.3});
  ASSERT_GT(high.get_scale(), 0.3);  // f32(0.3)
  mt::GradScaler copy({.init_scale = 0.25, .max_scale = 0.3});
  copy.load_state_dict(high.state_dict());
  EXPECT_EQ(copy.get_scale(), high.get_scale());
  // A scale really outside stays refused.
  EXPECT_MT_ERROR(copy.update(0.31), "outside");
  EXPECT_MT_ERROR(again.update(0.9e-5), "outside");
}

TEST(GradScalerState, LoadStateDictRejectsBadState) {
  mt::GradScaler scaler({.init_scale = 32});
  mt::NamedTensors good = mt::GradScaler({.init_scale = 64}).state_dict();
  auto with = [&](const std::string& key, mt::Tensor value) {
    mt::NamedTensors state = good;
    for (auto& [k, v] : state)
      if (k == key) v = value;
    return state;
  };
  auto without = [&](const std::string& key) {
    mt::NamedTensors state;
    for (const auto& entry : good)
      if (entry.first != key) state.push_back(entry);
    return state;
  };
  EXPECT_MT_ERROR(scaler.load_state_dict({}), "empty", "disabled");
  EXPECT_MT_ERROR(scaler.load_state_dict(without("scale")), "'scale'");
  mt::NamedTensors extra = good;
  extra.emplace_back("surprise", mt::scalar(1));
  EXPECT_MT_ERROR(scaler.load_state_dict(extra), "unknown", "surprise");
  EXPECT_MT_ERROR(scaler.load_state_dict(with("growth_factor", mt::scalar(0.5, mt::f64))),
                  "growth_factor", "> 1");
  EXPECT_MT_ERROR(scaler.load_state_dict(with("growth_tracker", mt::scalar(2000, mt::i32))),
                  "growth_tracker", "[0, growth_interval = 2000)");
  EXPECT_MT_ERROR(scaler.load_state_dict(with("scale", mt::scalar(kInf))), "scale", "finite");
  // A scale of 0 or a subnormal one would make 1/scale inf in f32 and poison the next update.
  EXPECT_MT_ERROR(scaler.load_state_dict(with("scale", mt::scalar(0.0))), "scale", "zero");
  EXPECT_MT_ERROR(scaler.load_state_dict(with("scale", mt::scalar(1e-39))), "scale", "subnormal");
  EXPECT_MT_ERROR(scaler.load_state_dict(with("scale", mt::scalar(-2.0))), "scale", "negative");
  EXPECT_MT_ERROR(scaler.load_state_dict(with("scale", mt::zeros({2}))), "'scale'", "single");
  EXPECT_MT_ERROR(scaler.load_state_dict(with("growth_interval", mt::scalar(2.5, mt::f64))),
                  "growth_interval", "integer");
  mt::NamedTensors both = good;
  both.emplace_back("_growth_tracker", mt::scalar(3, mt::i32));
  EXPECT_MT_ERROR(scaler.load_state_dict(both), "growth_tracker", "_growth_tracker");
  EXPECT_EQ(scaler.get_scale(), 32);  // nothing changed
}

// The keys torch.cuda.amp.GradScaler.state_dict() writes (its tracker as "_growth_tracker", the
// numbers as Python floats and ints) load as ours.
TEST(GradScalerState, LoadsPyTorchsKeys) {
  mt::GradScaler scaler({.init_scale = 32});
  scaler.load_state_dict({{"scale", mt::scalar(1024.0, mt::f64)},
                          {"growth_factor", mt::scalar(2.0, mt::f64)},
                          {"backoff_factor", mt::scalar(0.5, mt::f64)},
                          {"growth_interval", mt::scalar(100, mt::i64)},
                          {"_growth_tracker", mt::scalar(7, mt::i64)}});
  EXPECT_EQ(scaler.get_scale(), 1024);
  EXPECT_EQ(scaler.get_growth_tracker(), 7);
  EXPECT_EQ(scaler.options().growth_interval, 100);
}

TEST_F(TempDir, CheckpointRoundTripWithScaler) {
  Tiny m;
  mt::AdamW opt(m.lin.parameters());
  mt::GradScaler scaler({.init_scale = 512, .growth_interval = 3, .max_scale = 4096});
  auto train = [](Tiny& model, mt::Optimizer& o, mt::GradScaler& s, const std::string& codes) {
    for (char code : codes) {
      o.zero_grad();
      s.scale(model.loss()).backward();
      if (code == 'I') inject_inf(model.lin);
      s.step(o);
      s.update();
    }
  };
  train(m, opt, scaler, "FFFFIFF");  // 512 -> 1024 -> 512, tracker 2
  ASSERT_EQ(scaler.get_scale(), 512);
  ASSERT_EQ(scaler.get_growth_tracker(), 2);
  mt::save_checkpoint(path("ckpt.safetensors"), m.lin, &opt, {{"note", "x"}}, &scaler);

  mt::Metadata meta;
  mt::NamedTensors entries = mt::load_tensors(path("ckpt.safetensors"), &meta);
  auto value = [&](const std::string& key) {
    for (const auto& [k, v] : meta)
      if (k == key) return v;
    return std::string("<missing>");
  };
  EXPECT_EQ(value("scaler.growth_interval"), "3");
  EXPECT_EQ(value("scaler.max_scale"), "4096");
  EXPECT_EQ(value("scaler.min_scale"), "<missing>");
  EXPECT_EQ(value("optimizer.steps"), "6");
  bool found_scale = false;
  for (const auto& [name, tensor] : entries)
    if (name == "scaler.scale") {
      found_scale = true;
      EXPECT_EQ(tensor.dtype(), mt::f32);
      EXPECT_EQ(tensor.item(), 512);
    }
  EXPECT_TRUE(found_scale);

  Tiny resumed(99);  // other initial weights
  mt::AdamW resumed_opt(resumed.lin.parameters());
  mt::GradScaler resumed_scaler({.init_scale = 8});
  mt::load_checkpoint(path("ckpt.safetensors"), resumed.lin, &resumed_opt, nullptr,
                      &resumed_scaler);
  EXPECT_EQ(resumed_scaler.get_scale(), 512);
  EXPECT_EQ(resumed_scaler.get_growth_tracker(), 2);
  EXPECT_EQ(resumed_scaler.options().growth_interval, 3);
  EXPECT_EQ(resumed_scaler.options().max_scale, 4096);
  EXPECT_EQ(resumed_opt.steps_taken(), 6);
  EXPECT_EQ(optimizer_bits(resumed_opt), optimizer_bits(opt));
  // Both continue bit for bit, through growth, an overflow and the max clamp.
  train(m, opt, scaler, "FIFFFFFF");
  train(resumed, resumed_opt, resumed_scaler, "FIFFFFFF");
  EXPECT_EQ(optimizer_bits(resumed_opt), optimizer_bits(opt));
  EXPECT_EQ(resumed_scaler.get_scale(), scaler.get_scale());
  EXPECT_EQ(resumed_scaler.get_growth_tracker(), scaler.get_growth_tracker());

  // Without a scaler the same file still loads the model and optimizer.
  Tiny other;
  mt::AdamW other_opt(other.lin.parameters());
  mt::load_checkpoint(path("ckpt.safetensors"), other.lin, &other_opt);
  EXPECT_EQ(other_opt.steps_taken(), 6);
}

TEST_F(TempDir, CheckpointRejectsBadScalerState) {
  Tiny m;
  mt::AdamW opt(m.lin.parameters());
  mt::GradScaler scaler;
  mt::save_checkpoint(path("no_scaler.safetensors"), m.lin, &opt);
  EXPECT_MT_ERROR(mt::load_checkpoint(path("no_scaler.safetensors"), m.lin, &opt, nullptr, &scaler),
                  "no_scaler.safetensors", "no scaler state");

  mt::save_checkpoint(path("good.safetensors"), m.lin, &opt, {}, &scaler);
  mt::Metadata meta;
  mt::NamedTensors entries = mt::load_tensors(path("good.safetensors"), &meta);
  Tiny target(5);
  Bytes weight_before = bytes_of(target.lin.weight);
  mt::AdamW target_opt(target.lin.parameters());
  mt::GradScaler target_scaler({.init_scale = 8});
  for (auto [key, text, fragment] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"scaler.growth_factor", "two", "not a number"},
           {"scaler.growth_factor", "0.5", "growth_factor must be"},
           {"scaler.backoff_factor", "1", "backoff_factor must be"},
           {"scaler.min_scale", "1e9", "min_scale"}}) {
    SCOPED_TRACE(key + " = " + text);
    mt::Metadata bad = meta;
    bool replaced = false;
    for (auto& [k, v] : bad)
      if (k == key) {
        v = text;
        replaced = true;
      }
    if (!replaced) bad.emplace_back(key, text);
    mt::save_tensors(path("bad.safetensors"), entries, bad);
    EXPECT_MT_ERROR(mt::load_checkpoint(path("bad.safetensors"), target.lin, &target_opt, nullptr,
                                        &target_scaler),
                    "bad.safetensors", fragment);
    // Validated before anything changed.
    EXPECT_EQ(bytes_of(target.lin.weight), weight_before);
    EXPECT_EQ(target_scaler.get_scale(), 8);
  }
}

// ---------------------------------------------------------------------------------------------
// No non-finite value reaches the master weights, however long the scale backs off.

bool all_finite(const mt::Optimizer& opt) {
  for (size_t i = 0; i < opt.params().size(); ++i) {
    std::vector<mt::Tensor> values = {opt.params()[i]};
    for (const auto& [name, value] : opt.state(i)) values.push_back(value);
    for (const mt::Tensor& t : values)
      for (double v : mt::cast(t, mt::f64).to_vector<double>())
        if (!std::isfinite(v)) return false;
  }
  return true;
}

// 200 batches holding a NaN, then clean ones. Before the fix the scale halved from 2^16 to
// 2^-128 (subnormal), where 1/scale is inf in f32, and the first clean step wrote NaN into
// every weight and Adam moment.
void poisoned_then_clean(bool compiled) {
  Tiny m;
  mt::Adam opt(m.lin.parameters(), {.lr = 0.01});
  mt::GradScaler scaler({.init_scale = 0x1p16, .growth_interval = 1});
  auto body = [&](const mt::Tensor& x) {
    opt.zero_grad();
    scaler.scale(m.loss_on(x)).backward();
    scaler.step(opt);
    scaler.update();
  };
  auto compiled_body = mt::compile(body);
  auto step = [&](const mt::Tensor& x) { compiled ? compiled_body(x) : body(x); };
  mt::Tensor poisoned =
      mt::tensor(std::vector<float>{0.5f, kNaN, 1.5f, 0.25f, -0.75f, 2.0f}, {3, 2});
  std::vector<Bytes> weights = {bytes_of(m.lin.weight), bytes_of(m.lin.bias)};
  for (int i = 0; i < 200; ++i) step(poisoned);
  // Every poisoned step skipped.
  EXPECT_EQ((std::vector<Bytes>{bytes_of(m.lin.weight), bytes_of(m.lin.bias)}), weights);
  EXPECT_EQ(opt.steps_taken(), 0);
  // The scale stops at the smallest normal f32 instead of going subnormal.
  EXPECT_EQ(scaler.get_scale(), 0x1p-126);
  for (int i = 0; i < 30; ++i) step(m.x);
  EXPECT_TRUE(all_finite(opt));
  EXPECT_EQ(opt.steps_taken(), 30);
  EXPECT_NE(bytes_of(m.lin.weight), weights[0]);
  EXPECT_EQ(scaler.get_scale(), 0x1p-96);  // recovering: doubled at every clean step
  // The reference executor has no programs to replay: there the compiled body is traced.
  if (compiled && mt::current_device() != mt::Device::reference) {
    EXPECT_GT(compiled_body.stats().replays, 0) << compiled_body.stats().reason;
  }
}

TEST(GradScalerReliability, PoisonedStepsThenCleanOnesLeaveTheWeightsFinite) {
  poisoned_then_clean(false);
}

TEST(GradScalerReliability, PoisonedStepsThenCleanOnesLeaveTheWeightsFiniteCompiled) {
  poisoned_then_clean(true);
}

// PyTorch's AMP step on `m`, compiled.
auto compiled_amp_step(Tiny& m, mt::Optimizer& opt, mt::GradScaler& scaler) {
  return mt::compile([m = &m, opt = &opt, scaler = &scaler](const mt::Tensor& x) {
    opt->zero_grad();
    scaler->scale(m->loss_on(x)).backward();
    scaler->step(*opt);
    scaler->update();
  });
}

// A state loaded between replays of a compiled step (e.g. resuming into a running loop) is the
// state the next call uses, not the one the replay plan last wrote.
TEST(GradScalerReliability, StateLoadedBetweenCompiledStepsIsFollowed) {
  Tiny m;
  mt::SGD opt(m.lin.parameters(), {.lr = 0.01});
  mt::GradScaler scaler({.init_scale = 1024});
  auto step = compiled_amp_step(m, opt, scaler);
  for (int i = 0; i < 4; ++i) step(m.x);
  EXPECT_EQ(scaler.get_scale(), 1024);
  mt::NamedTensors state = mt::GradScaler({.init_scale = 8}).state_dict();
  scaler.load_state_dict(state);
  step(m.x);
  EXPECT_EQ(scaler.get_scale(), 8);
  EXPECT_EQ(scaler.scale_history().back(), 8);
  scaler.update(64.0);  // set from outside, as PyTorch's update(new_scale)
  step(m.x);
  EXPECT_EQ(scaler.get_scale(), 64);
}

// state_dict() holds the values when it was taken, as PyTorch's numbers: replays of a compiled
// step (which update the scale in place) do not change it, so it rolls the scaler back.
TEST(GradScalerReliability, AStateDictTakenBetweenCompiledStepsIsASnapshot) {
  Tiny m;
  mt::SGD opt(m.lin.parameters(), {.lr = 0.01});
  mt::GradScaler scaler({.init_scale = 4, .growth_interval = 1});  // doubles every step
  auto step = compiled_amp_step(m, opt, scaler);
  for (int i = 0; i < 4; ++i) step(m.x);
  if (mt::current_device() != mt::Device::reference) {  // which traces every call
    EXPECT_GE(step.stats().replays, 1);
  }
  const double scale = scaler.get_scale();
  mt::NamedTensors saved = scaler.state_dict();
  for (int i = 0; i < 3; ++i) step(m.x);
  EXPECT_EQ(scaler.get_scale(), scale * 8);
  EXPECT_EQ(saved[0].first, "scale");
  EXPECT_EQ(saved[0].second.item(), scale) << "the snapshot did not follow the replays";
  scaler.load_state_dict(saved);
  EXPECT_EQ(scaler.get_scale(), scale);
  step(m.x);
  EXPECT_EQ(scaler.get_scale(), scale * 2);
}

TEST(GradScalerReliability, GradientsThatOverflowOnlyWhenUnscaledAreSkipped) {
  // A scale below 1 (as fp16 runs reach after overflows) unscales a finite 3e38 into inf: the
  // check must look at what the optimizer would apply, as PyTorch's does.
  mt::Tensor p = param({1, 2});
  mt::SGD opt({p}, {.lr = 1});
  mt::GradScaler scaler({.init_scale = 0x1p-10});
  p.set_grad(mt::tensor(std::vector<float>{3e38f, 1}, {2}));
  Bytes before = bytes_of(p);
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(bytes_of(p), before);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  EXPECT_EQ(scaler.get_scale(), 0x1p-11);
}

TEST(GradScalerReliability, ScalesOutsideTheNormalF32RangeAreRejected) {
  using O = mt::GradScalerOptions;
  EXPECT_MT_ERROR(mt::GradScaler(O{.init_scale = 1e-39}), "init_scale", "normal f32");
  EXPECT_MT_ERROR(mt::GradScaler(O{.init_scale = 1, .min_scale = 1e-40}), "min_scale");
  mt::GradScaler scaler;
  EXPECT_MT_ERROR(scaler.update(1e-39), "update", "normal f32");
  EXPECT_EQ(scaler.get_scale(), 65536);
  mt::GradScaler smallest({.init_scale = 0x1p-126});  // the edge itself is fine
  EXPECT_EQ(smallest.get_scale(), 0x1p-126);
}

TEST_F(TempDir, CheckpointWithAZeroOrSubnormalScaleIsRejected) {
  Tiny m;
  mt::AdamW opt(m.lin.parameters());
  mt::GradScaler scaler;
  mt::save_checkpoint(path("good.safetensors"), m.lin, &opt, {}, &scaler);
  mt::Metadata meta;
  mt::NamedTensors entries = mt::load_tensors(path("good.safetensors"), &meta);
  for (float bad : {0.0f, 1e-39f}) {
    SCOPED_TRACE(bad);
    mt::NamedTensors edited = entries;
    for (auto& [name, tensor] : edited)
      if (name == "scaler.scale") tensor = mt::scalar(bad);
    mt::save_tensors(path("bad.safetensors"), edited, meta);
    mt::GradScaler target({.init_scale = 8});
    EXPECT_MT_ERROR(mt::load_checkpoint(path("bad.safetensors"), m.lin, &opt, nullptr, &target),
                    "bad.safetensors", "scale", "normal f32");
    EXPECT_EQ(target.get_scale(), 8);
  }
}

// ---------------------------------------------------------------------------------------------
// Misuse.

TEST(GradScalerErrors, BadOptions) {
  using O = mt::GradScalerOptions;
  EXPECT_MT_ERROR(mt::GradScaler(O{.init_scale = 0}), "init_scale", "normal f32");
  EXPECT_MT_ERROR(mt::GradScaler(O{.init_scale = -1}), "init_scale");
  EXPECT_MT_ERROR(mt::GradScaler(O{.init_scale = 1e39}), "init_scale", "f32");
  EXPECT_MT_ERROR(mt::GradScaler(O{.init_scale = kNaN}), "init_scale");
  EXPECT_MT_ERROR(mt::GradScaler(O{.growth_factor = 1}), "growth_factor", "> 1");
  EXPECT_MT_ERROR(mt::GradScaler(O{.growth_factor = 0.5}), "growth_factor");
  EXPECT_MT_ERROR(mt::GradScaler(O{.backoff_factor = 1}), "backoff_factor", "(0, 1)");
  EXPECT_MT_ERROR(mt::GradScaler(O{.backoff_factor = 0}), "backoff_factor");
  EXPECT_MT_ERROR(mt::GradScaler(O{.growth_interval = 0}), "growth_interval");
  EXPECT_MT_ERROR(mt::GradScaler(O{.growth_interval = -5}), "growth_interval");
  EXPECT_MT_ERROR(mt::GradScaler(O{.growth_interval = int64_t{1} << 40}), "growth_interval");
  EXPECT_MT_ERROR(mt::GradScaler(O{.min_scale = 0}), "min_scale");
  EXPECT_MT_ERROR(mt::GradScaler(O{.min_scale = 8, .max_scale = 4}), "min_scale", "max_scale");
  EXPECT_MT_ERROR(mt::GradScaler(O{.init_scale = 2, .min_scale = 4}), "init_scale", "outside");
  EXPECT_MT_ERROR(mt::GradScaler(O{.max_scale = 1024}), "init_scale", "outside");
}

TEST(GradScalerErrors, CallsOutOfOrder) {
  mt::Tensor p = param({0, 0});
  mt::SGD opt({p}, {.lr = 1});
  mt::GradScaler scaler;
  EXPECT_MT_ERROR(scaler.update(), "update", "no inf checks");
  EXPECT_MT_ERROR(scaler.step(opt), "step", "none of the 1 parameters", "SGD", "backward()");
  EXPECT_MT_ERROR(scaler.update(), "update", "no inf checks");  // no grads: nothing recorded

  mt::GradScaler fresh;
  p.set_grad(mt::ones({2}));
  fresh.unscale_(opt);
  EXPECT_MT_ERROR(fresh.unscale_(opt), "unscale_", "already", "update()");
  fresh.step(opt);
  EXPECT_MT_ERROR(fresh.unscale_(opt), "unscale_", "after step()");
  EXPECT_MT_ERROR(fresh.step(opt), "step", "already");
  fresh.update();
  fresh.unscale_(opt);  // allowed again after update()
  fresh.step(opt);
  fresh.update();
  EXPECT_EQ(opt.steps_taken(), 2);

  EXPECT_MT_ERROR(fresh.scale(mt::Tensor()), "scale", "undefined");
  EXPECT_MT_ERROR(fresh.scale(mt::ones({}, mt::i64)), "scale", "floating");
  EXPECT_MT_ERROR(fresh.update(0.0), "update", "normal f32");
  mt::GradScaler bounded({.init_scale = 8, .max_scale = 16});
  EXPECT_MT_ERROR(bounded.update(32.0), "update", "outside");
  bounded.update(12.0);
  EXPECT_EQ(bounded.get_scale(), 12);
}

}  // namespace
