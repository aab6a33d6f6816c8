// tests/test_compile.cpp -- mt::compile against the same loop traced every step: bit-identical
// losses, parameters, optimizer and loss-scaler state; replay only where it is sound.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/nn.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/optim.h"
#include "mixtape/dsl/selection.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/precision_policy/grad_scaler.h"
#include "mixtape/precision_policy/policy.h"
#include "mixtape/runtime/compile.h"
#include "mixtape/runtime/device.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

bool replays_here() { return mt::current_device() != mt::Device::reference; }

// At least `count` replays, where the back end replays at all (the reference executor has no
// programs to replay); else the step's last reason to trace in the message.
template <typename Step>
testing::AssertionResult replayed_at_least(const Step& step, int64_t count) {
  if (!replays_here() || step.stats().replays >= count) return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << step.stats().replays << " replays, fewer than " << count << ": " << step.stats().reason;
}

// Everything a training run leaves behind, as bits.
struct Snapshot {
  std::vector<uint32_t> losses;
  std::vector<std::vector<uint32_t>> params, state;
  int64_t steps = 0;
  std::vector<double> scales;
  bool operator==(const Snapshot&) const = default;
};

void snapshot_model(Snapshot& s, const mt::Module& model, const mt::Optimizer& opt) {
  for (const mt::Tensor& p : model.parameters()) s.params.push_back(f32_bits(p));
  for (size_t i = 0; i < opt.params().size(); ++i)
    for (const auto& [name, value] : opt.state(i)) s.state.push_back(f32_bits(value));
  s.steps = opt.steps_taken();
}

// One step of an MLP under AdamW; the learning rate follows a schedule set outside the step.
struct MlpRun {
  mt::Generator gen{21};
  mt::MLP model{{8, 32, 32, 4}, mt::Activation::Gelu, &gen};
  mt::AdamW opt{model.parameters(), mt::AdamOptions{.lr = 1e-2, .weight_decay = 0.1}};
  mt::Tensor x = mt::randn({64, 8}, mt::f32, &gen);
  mt::Tensor y = mt::randn({64, 4}, mt::f32, &gen);

  // One training step; the gradients' zeroing and the optimizer's step may be left to the caller
  // (outside a compiled step).
  mt::Tensor step(const mt::Tensor& input, const mt::Tensor& target, bool zero_inside = true,
                  bool optimizer_inside = true) {
    if (zero_inside) opt.zero_grad();
    mt::Tensor loss = mt::mse_loss(model(input), target);
    loss.backward();
    if (optimizer_inside) opt.step();
    return loss;
  }
  mt::Tensor batch(int i) const { return x * (1.0 + 0.01 * i); }
};

// MlpRun's loss and backward pass, without zero_grad or the optimizer's step: a step whose
// loop does those outside it.
mt::Tensor forward_backward(MlpRun& run, const mt::Tensor& x, const mt::Tensor& y) {
  mt::Tensor loss = mt::mse_loss(run.model(x), y);
  loss.backward();
  return loss;
}

// forward_backward through mt::compile.
auto compile_forward_backward(MlpRun& run) {
  return mt::compile(
      [&run](const mt::Tensor& x, const mt::Tensor& y) { return forward_backward(run, x, y); });
}

// Two runs' parameters, optimizer state and step counts are the same bits.
void expect_same_state(const MlpRun& a, const MlpRun& b) {
  Snapshot first, second;
  snapshot_model(first, a.model, a.opt);
  snapshot_model(second, b.model, b.opt);
  EXPECT_TRUE(first == second);
}

// Twelve steps of two runs, one traced every step and one through the compiled `step`, with
// `reload` applied to both before the seventh: the same losses, bit for bit.
template <typename Step, typename Reload>
void expect_same_losses_across_a_reload(MlpRun& plain_run, MlpRun& compiled_run, Step& step,
                                        Reload&& reload) {
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 12; ++i) {
    if (i == 6) {
      reload(plain_run);
      reload(compiled_run);
    }
    plain.push_back(f32_bits(plain_run.step(plain_run.batch(i), plain_run.y))[0]);
    compiled.push_back(f32_bits(step(compiled_run.batch(i), compiled_run.y))[0]);
  }
  EXPECT_EQ(plain, compiled);
}

template <typename Step>
Snapshot train_mlp(int steps, Step&& step_fn, MlpRun& run) {
  Snapshot s;
  for (int i = 0; i < steps; ++i) {
    run.opt.set_lr(1e-2 / (1 + i));
    s.losses.push_back(f32_bits(step_fn(run.batch(i), run.y))[0]);
  }
  snapshot_model(s, run.model, run.opt);
  return s;
}

TEST(Compile, AReplayedStepMatchesTracingEveryStepBitForBit) {
  const int steps = 8;
  MlpRun plain_run, compiled_run;
  Snapshot plain = train_mlp(
      steps, [&](const mt::Tensor& x, const mt::Tensor& y) { return plain_run.step(x, y); },
      plain_run);
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return compiled_run.step(x, y); });
  Snapshot compiled = train_mlp(steps, step, compiled_run);
  EXPECT_EQ(plain.losses, compiled.losses);
  EXPECT_EQ(plain.params, compiled.params);
  EXPECT_EQ(plain.state, compiled.state);
  EXPECT_EQ(compiled.steps, steps);
  EXPECT_EQ(step.stats().calls, steps);
  if (replays_here()) {
    // Adam's moments and step count start as stored zeros, so calls 1 and 2 are alike.
    EXPECT_EQ(step.stats().traces, 2) << step.stats().reason;
    EXPECT_EQ(step.stats().replays, steps - 2);
    EXPECT_EQ(step.stats().plans, 1);
  } else {
    EXPECT_EQ(step.stats().replays, 0);
  }
  // Gradients are state too: p.grad() shows the last step's.
  EXPECT_EQ(f32_bits(plain_run.model.parameters()[0].grad()),
            f32_bits(compiled_run.model.parameters()[0].grad()));
}

TEST(Compile, AReplayBuildsAndCompilesNothingAndRunsNoHostCode) {
  if (!replays_here()) GTEST_SKIP() << "the reference executor has no programs to replay";
  MlpRun run;
  auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) { return run.step(x, y); });
  for (int i = 0; i < 3; ++i) step(run.batch(i), run.y);
  ASSERT_EQ(step.stats().replays, 1);
  mt::Tensor input = run.batch(4);
  mt::eval({input});
  mt::reset_execution_stats();
  int64_t traces_before = step.stats().traces;
  step(input, run.y);
  mt::ExecutionStats stats = mt::execution_stats();
  EXPECT_EQ(step.stats().traces, traces_before);
  EXPECT_EQ(stats.programs_built + stats.programs_reused, 0);  // no signature was even computed
  EXPECT_EQ(stats.kernels_compiled + stats.kernels_from_disk, 0);
  EXPECT_GE(stats.kernels, 1);
  EXPECT_GE(stats.gemms, 1);
}

TEST(Compile, ResultsAreFreshTensorsEveryCall) {
  MlpRun run;
  auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) { return run.step(x, y); });
  std::vector<mt::Tensor> losses;
  for (int i = 0; i < 6; ++i) losses.push_back(step(run.batch(i), run.y));
  std::vector<double> first_values;
  for (const mt::Tensor& l : losses) first_values.push_back(l.item());
  for (int i = 6; i < 9; ++i) step(run.batch(i), run.y);
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i].item(), first_values[i]) << i;
  // Training makes progress, so the replayed losses are not one value repeated.
  EXPECT_LT(first_values.back(), first_values.front());
}

// An MLP trained with Adam under f16 autocast and dynamic loss scaling, on fixed random data.
struct ScaledRun {
  explicit ScaledRun(uint64_t seed = 13, const std::vector<int64_t>& sizes = {8, 16, 4},
                     int64_t batch_size = 16,
                     mt::GradScalerOptions scaling = {.init_scale = 0x1p12, .growth_interval = 4})
      : gen(seed),
        model(sizes, mt::Activation::Relu, &gen),
        scaler(scaling),
        x(mt::randn({batch_size, sizes.front()}, mt::f32, &gen)),
        y(mt::randn({batch_size, sizes.back()}, mt::f32, &gen)) {}
  mt::Generator gen;
  mt::MLP model;
  mt::Adam opt{model.parameters(), mt::AdamOptions{.lr = 1e-3}};
  mt::GradScaler scaler;
  mt::Tensor x, y;
  mt::Tensor step(const mt::Tensor& input, const mt::Tensor& target) {
    opt.zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(mt::f16);
      loss = mt::mse_loss(model(input), target);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    return loss;
  }
};

// Dynamic loss scaling under f16 autocast: the first scale overflows, steps are skipped and the
// scale halves inside the replayed program, then grows every 3 clean steps.
TEST(Compile, LossScalingSkipsAndRescalesInsideReplays) {
  auto run_all = [](ScaledRun& run, const std::function<mt::Tensor(mt::Tensor, mt::Tensor)>& step) {
    Snapshot s;
    for (int i = 0; i < 40; ++i) {
      s.losses.push_back(f32_bits(step(run.x * (1.0 - 0.01 * i), run.y))[0]);
      s.scales.push_back(run.scaler.get_scale());
    }
    snapshot_model(s, run.model, run.opt);
    return s;
  };
  const mt::GradScalerOptions scaling{.init_scale = 0x1p40, .growth_interval = 3};
  ScaledRun plain_run(5, {16, 64, 8}, 32, scaling), compiled_run(5, {16, 64, 8}, 32, scaling);
  Snapshot plain =
      run_all(plain_run, [&](mt::Tensor x, mt::Tensor y) { return plain_run.step(x, y); });
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return compiled_run.step(x, y); });
  Snapshot compiled = run_all(compiled_run, [&](mt::Tensor x, mt::Tensor y) { return step(x, y); });
  EXPECT_EQ(plain, compiled);
  // The run really skipped steps and moved the scale both ways.
  EXPECT_LT(plain.steps, 40);
  EXPECT_GT(plain.steps, 0);
  bool grew = false;
  for (size_t i = 1; i < plain.scales.size(); ++i) grew |= plain.scales[i] > plain.scales[i - 1];
  EXPECT_LT(plain.scales[10], 0x1p40);
  EXPECT_TRUE(grew);
  EXPECT_TRUE(replayed_at_least(step, 30));
}

// Every statistic the loss scaler offers, read after a run.
struct ScalerStats {
  int64_t skipped = 0, tracker = 0;
  double scale = 0;
  std::vector<double> scales;
  std::vector<bool> skips;
  bool operator==(const ScalerStats&) const = default;
};

ScalerStats scaler_stats(const mt::GradScaler& scaler) {
  return {scaler.skipped_steps(), scaler.get_growth_tracker(), scaler.get_scale(),
          scaler.scale_history(), scaler.skip_history()};
}

void expect_same_statistics(const ScalerStats& compiled, const ScalerStats& traced) {
  EXPECT_EQ(compiled.skipped, traced.skipped);
  EXPECT_EQ(compiled.scales, traced.scales);
  EXPECT_EQ(compiled.skips, traced.skips);
  EXPECT_EQ(compiled.scale, traced.scale);
  EXPECT_EQ(compiled.tracker, traced.tracker);
}

// Runs `steps` steps of the default ScaledRun, poisoned where `poisoned(i)` (the input times inf,
// so every gradient is non-finite), traced every call or compiled; returns the scaler's
// statistics and the run's losses and weights.
std::pair<ScalerStats, Snapshot> scaled_run(int steps, const std::function<bool(int)>& poisoned,
                                            bool compiled, int64_t* replays = nullptr) {
  ScaledRun run;
  auto compiled_step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& poison) { return run.step(x * poison, run.y); });
  Snapshot s;
  for (int i = 0; i < steps; ++i) {
    mt::Tensor x = run.x * (1.0 + 0.01 * (i % 7));
    mt::Tensor poison = mt::scalar(poisoned(i) ? INFINITY : 1.0);
    s.losses.push_back(
        f32_bits(compiled ? compiled_step(x, poison) : run.step(x * poison, run.y))[0]);
  }
  snapshot_model(s, run.model, run.opt);
  if (replays) *replays = compiled_step.stats().replays;
  return {scaler_stats(run.scaler), s};
}

TEST(Compile, LossScalerStatisticsAreThoseOfTracingEveryCall) {
  // 24 of 60 steps overflow.
  auto some = [](int i) { return i % 5 == 1 || i % 5 == 3; };
  int64_t replays = 0;
  auto [traced, traced_run] = scaled_run(60, some, false);
  auto [compiled, compiled_run] = scaled_run(60, some, true, &replays);
  EXPECT_EQ(traced.skipped, 24);
  EXPECT_EQ(traced.scales.size(), 60u);
  expect_same_statistics(compiled, traced);
  EXPECT_EQ(compiled_run, traced_run);
  if (replays_here()) {
    EXPECT_GE(replays, 50);
  }
}

TEST(Compile, LossScalerStatisticsSurviveALongPoisonedStretch) {
  // 200 poisoned steps, then clean ones.
  auto first_200 = [](int i) { return i < 200; };
  int64_t replays = 0;
  auto [traced, traced_run] = scaled_run(210, first_200, false);
  auto [compiled, compiled_run] = scaled_run(210, first_200, true, &replays);
  EXPECT_GE(traced.skipped, 200);
  expect_same_statistics(compiled, traced);
  EXPECT_EQ(compiled_run, traced_run);
  if (replays_here()) {
    EXPECT_GE(replays, 200);
  }
}

// The records a replay leaves are copies held by the scaler: a scaler that is gone before the
// compiled function is harmless, and reading the statistics in between does not disturb them.
TEST(Compile, LossScalerRecordsOutliveReplaysAndTheirScaler) {
  auto run = std::make_unique<ScaledRun>();
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& poison) { return run->step(x * poison, run->y); });
  mt::Tensor clean = mt::scalar(1.0), bad = mt::scalar(INFINITY);
  for (int i = 0; i < 6; ++i) step(run->x, i == 4 ? bad : clean);
  std::vector<bool> early = run->scaler.skip_history();
  for (int i = 0; i < 4; ++i) step(run->x, clean);
  std::vector<bool> skips = run->scaler.skip_history();
  ASSERT_EQ(skips.size(), 10u);
  EXPECT_EQ(std::vector<bool>(skips.begin(), skips.begin() + 6), early);
  EXPECT_EQ(std::count(skips.begin(), skips.end(), true), 1);
  mt::GradScaler copy = run->scaler;  // statistics of its own, from here on
  EXPECT_EQ(copy.skip_history(), skips);
  // The hook a replay runs holds the statistics weakly; the step's own state stays alive.
  run->scaler = mt::GradScaler(mt::GradScalerOptions{.init_scale = 0x1p12, .growth_interval = 4});
  step(run->x, clean);
  EXPECT_EQ(copy.skip_history(), skips);
}

// A scaler replaced by assignment between calls (PyTorch: rebinding the scaler takes effect at
// the next step), enabled or disabled before: the compiled step follows the new scale, settings
// and statistics as tracing every call does, an overflow after the swap included.
TEST(Compile, AScalerAssignedBetweenCallsIsFollowed) {
  struct Run {
    mt::Tensor w = mt::tensor(std::vector<float>{1, 2, 3, 4}, {2, 2}).requires_grad_();
    mt::SGD opt{{w}, mt::SGDOptions{.lr = 0.01}};
    mt::GradScaler scaler;
    explicit Run(bool enabled)
        : scaler(mt::GradScalerOptions{
              .init_scale = 1024, .growth_interval = 2, .enabled = enabled}) {}
    mt::Tensor step(const mt::Tensor& x) {
      opt.zero_grad();
      scaler.scale(mt::sum(w * x)).backward();
      scaler.step(opt);
      scaler.update();
      return mt::Tensor();
    }
  };
  for (bool enabled_before : {true, false}) {
    SCOPED_TRACE(enabled_before ? "enabled before" : "disabled before");
    Run plain_run(enabled_before), compiled_run(enabled_before);
    auto step = mt::compile([&](const mt::Tensor& x) { return compiled_run.step(x); });
    const mt::Tensor clean = mt::ones({2, 2}), poisoned = mt::full({2, 2}, INFINITY);
    for (int i = 0; i < 9; ++i) {
      if (i == 5)
        for (Run* run : {&plain_run, &compiled_run})
          run->scaler =
              mt::GradScaler(mt::GradScalerOptions{.init_scale = 8, .growth_interval = 1000});
      const mt::Tensor& x = i == 7 ? poisoned : clean;
      plain_run.step(x);
      step(x);
      EXPECT_EQ(compiled_run.scaler.get_scale(), plain_run.scaler.get_scale()) << "call " << i;
      EXPECT_EQ(compiled_run.scaler.skipped_steps(), plain_run.scaler.skipped_steps()) << i;
      EXPECT_EQ(f32_bits(compiled_run.w), f32_bits(plain_run.w)) << "call " << i;
    }
    EXPECT_EQ(compiled_run.scaler.scale_history(), plain_run.scaler.scale_history());
    EXPECT_TRUE(replayed_at_least(step, 2));
  }
}

// A copy of a scaler that a compiled step updates keeps the values it had when taken: the replays
// update the scaler's buffers in place. (Its state_dict, like a module's, names those buffers.)
TEST(Compile, ACopyOfAReplayedScalerKeepsItsValues) {
  mt::Tensor w = mt::tensor(std::vector<float>{1, 2, 3, 4}, {2, 2});
  w.requires_grad_();
  mt::SGD opt({w}, mt::SGDOptions{.lr = 0.01});
  mt::GradScaler scaler(mt::GradScalerOptions{.init_scale = 8, .growth_interval = 1});
  auto step = mt::compile([&](const mt::Tensor& x) {
    opt.zero_grad();
    scaler.scale(mt::sum(w * x)).backward();
    scaler.step(opt);
    scaler.update();
    return mt::Tensor();
  });
  const mt::Tensor ones = mt::ones({2, 2});
  for (int i = 0; i < 4; ++i) step(ones);
  mt::GradScaler copy = scaler;
  const double before = scaler.get_scale();
  step(ones);
  step(ones);
  EXPECT_EQ(scaler.get_scale(), before * 4);  // grows every step
  EXPECT_EQ(copy.get_scale(), before);
  EXPECT_TRUE(replayed_at_least(step, 2));
}

// PyTorch's AMP loop with the model compiled alone: the scaler's scale() inside the function,
// its step() and update() outside. The scaler keeps its tensors and assigns them new values, so
// the function reads the scale through its tensor and replays, with the traced loop's bits: a
// skip (an overflow on one step) and the scale's backoff and growth included.
TEST(Compile, ALossScalerOutsideACompiledModelReplays) {
  ScaledRun plain_run, compiled_run;
  auto forward_backward = [](ScaledRun& run, const mt::Tensor& x, const mt::Tensor& poison) {
    run.opt.zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(mt::f16);
      loss = mt::mse_loss(run.model(x * poison), run.y);
    }
    run.scaler.scale(loss).backward();
    return loss;
  };
  auto model_step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& poison) {
    return forward_backward(compiled_run, x, poison);
  });
  mt::Tensor clean = mt::scalar(1.0), bad = mt::scalar(INFINITY);
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 12; ++i) {
    const mt::Tensor& poison = i == 7 ? bad : clean;
    plain.push_back(f32_bits(forward_backward(plain_run, plain_run.x, poison))[0]);
    plain_run.scaler.step(plain_run.opt);
    plain_run.scaler.update();
    compiled.push_back(f32_bits(model_step(compiled_run.x, poison))[0]);
    compiled_run.scaler.step(compiled_run.opt);
    compiled_run.scaler.update();
  }
  EXPECT_EQ(plain, compiled);
  const std::vector<mt::Tensor> a = plain_run.model.parameters(),
                                b = compiled_run.model.parameters();
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(f32_bits(a[i]), f32_bits(b[i])) << "parameter " << i;
  EXPECT_EQ(plain_run.scaler.scale_history(), compiled_run.scaler.scale_history());
  const std::vector<bool> skips = compiled_run.scaler.skip_history();
  EXPECT_EQ(plain_run.scaler.skip_history(), skips);
  EXPECT_EQ(std::count(skips.begin(), skips.end(), true), 1);
  // Both traced calls passed `clean`, which the plan then cannot tell from a captured tensor:
  // the call passing `bad` traces (AnArgumentThatIsAlsoCapturedIsNotReplacedByTheNextOne).
  EXPECT_TRUE(replayed_at_least(model_step, 7));
}

// Scans, sorts and scatter are host steps of the program: replays run them as tracing does, and
// masked_select's host read keeps the function traced every call.
TEST(Compile, ScansSortsAndScatterReplayBitForBit) {
  auto loss_of = [](MlpRun& run, const mt::Tensor& x, const mt::Tensor& y) {
    run.opt.zero_grad();
    mt::Tensor h = run.model(x);
    mt::Tensor top = mt::topk(h, 2).values;
    mt::Tensor order = mt::slice(mt::argsort(h, 1, true), 1, 0, 2);
    mt::Tensor z = mt::cumsum(h, 1) * 0.1 + mt::scatter(h, 1, order, top * 2.0) +
                   mt::logcumsumexp(h, 1) * 0.1 + mt::cumprod(h, 0) * 0.01;
    mt::Tensor loss = mt::mse_loss(z, y);
    loss.backward();
    run.opt.step();
    return loss;
  };
  MlpRun plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return loss_of(compiled_run, x, y); });
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 6; ++i) {
    plain.push_back(f32_bits(loss_of(plain_run, plain_run.batch(i), plain_run.y))[0]);
    compiled.push_back(f32_bits(step(compiled_run.batch(i), compiled_run.y))[0]);
  }
  EXPECT_EQ(plain, compiled);
  EXPECT_EQ(f32_bits(plain_run.model.parameters()[0]),
            f32_bits(compiled_run.model.parameters()[0]));
  if (replays_here()) {
    EXPECT_GT(step.stats().replays, 0) << step.stats().reason;
  }

  MlpRun selecting;
  auto select_step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
    (void)mt::masked_select(x, x > 0.0);
    return selecting.step(x, y);
  });
  for (int i = 0; i < 3; ++i) select_step(selecting.batch(i), selecting.y);
  EXPECT_EQ(select_step.stats().replays, 0);
}

// A function whose trace would not replay faithfully keeps working, traced every call.
TEST(Compile, SideEffectsKeepTheFunctionTracedEveryCall) {
  struct Case {
    const char* reason;
    std::function<void(MlpRun&)> inside;
  };
  std::vector<Case> cases = {
      {"reads a value on the host", [](MlpRun& run) { (void)run.x.sum().item(); }},
      {"sets the learning rate", [](MlpRun& run) { run.opt.set_lr(run.opt.lr() * 0.9); }},
  };
  for (const Case& c : cases) {
    MlpRun plain_run, compiled_run;
    auto plain_step = [&](const mt::Tensor& x, const mt::Tensor& y) {
      c.inside(plain_run);
      return plain_run.step(x, y);
    };
    auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
      c.inside(compiled_run);
      return compiled_run.step(x, y);
    });
    std::vector<uint32_t> plain_losses, compiled_losses;
    for (int i = 0; i < 5; ++i) {
      plain_losses.push_back(f32_bits(plain_step(plain_run.batch(i), plain_run.y))[0]);
      compiled_losses.push_back(f32_bits(step(compiled_run.batch(i), compiled_run.y))[0]);
    }
    EXPECT_EQ(plain_losses, compiled_losses) << c.reason;
    EXPECT_EQ(step.stats().replays, 0) << c.reason;
    if (replays_here()) {
      EXPECT_NE(step.stats().reason.find(c.reason), std::string::npos) << step.stats().reason;
    }
  }
}

// Dropout and input noise drawn inside the step: each replay draws fresh numbers, those that
// tracing every call draws, because the draws read and advance their generator's offset as
// graph values.
struct DropoutRun {
  mt::Generator init{31}, noise{32}, drop{33};
  mt::Linear fc1{8, 32, true, &init}, fc2{32, 4, true, &init};
  mt::AdamW opt{{fc1.weight, fc1.bias, fc2.weight, fc2.bias}, mt::AdamOptions{.lr = 1e-2}};
  mt::Tensor x = mt::randn({16, 8}, mt::f32, &init);
  mt::Tensor y = mt::randn({16, 4}, mt::f32, &init);
  mt::Tensor step(const mt::Tensor& input) {
    opt.zero_grad();
    mt::Tensor noisy = input + mt::randn(input.shape(), mt::f32, &noise, 0.0, 0.05);
    mt::Tensor h = mt::dropout(mt::gelu(fc1(noisy)), 0.3, true, &drop);
    mt::Tensor loss = mt::mse_loss(fc2(mt::dropout(h, 0.1, true, &drop)), y);
    loss.backward();
    opt.step();
    return loss;
  }
  std::vector<std::vector<uint32_t>> params() const {
    return {f32_bits(fc1.weight), f32_bits(fc1.bias), f32_bits(fc2.weight), f32_bits(fc2.bias)};
  }
};

// Steps `plain_run` eagerly and `compiled_run` through `step` (which traces it) side by side,
// `steps` times, with `outside(i, run)` applied to both runs before step i; expects the same
// losses, parameters and dropout stream position, and returns the compiled losses' first bits.
template <typename Step>
std::vector<uint32_t> expect_side_by_side(
    DropoutRun& plain_run, DropoutRun& compiled_run, Step& step, int steps,
    const std::function<void(int, DropoutRun&)>& outside = nullptr) {
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < steps; ++i) {
    if (outside) {
      outside(i, plain_run);
      outside(i, compiled_run);
    }
    plain.push_back(f32_bits(plain_run.step(plain_run.x))[0]);
    compiled.push_back(f32_bits(step(compiled_run.x))[0]);
  }
  EXPECT_EQ(plain, compiled);
  EXPECT_EQ(plain_run.params(), compiled_run.params());
  EXPECT_EQ(plain_run.drop.offset(), compiled_run.drop.offset());
  return compiled;
}

TEST(Compile, DropoutReplaysWithFreshNumbersBitForBit) {
  DropoutRun plain_run, compiled_run;
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled_run.step(x); });
  const std::vector<uint32_t> compiled = expect_side_by_side(plain_run, compiled_run, step, 12);
  EXPECT_EQ(plain_run.noise.offset(), compiled_run.noise.offset());
  EXPECT_EQ(compiled_run.noise.offset(), 12u * 16 * 8);
  // The same input every step: only fresh masks and noise make the losses differ.
  EXPECT_NE(compiled[10], compiled[11]);
  EXPECT_TRUE(replayed_at_least(step, 9));
}

// Reseeding, restoring or drawing from a generator outside the step is followed: the replays
// stop and the step is traced again from the generator's new state.
TEST(Compile, GeneratorsChangedOutsideTheStepAreFollowed) {
  DropoutRun plain_run, compiled_run;
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled_run.step(x); });
  std::vector<std::function<void(DropoutRun&)>> outside = {
      [](DropoutRun& run) { run.drop.manual_seed(99); },
      [](DropoutRun& run) { run.drop.set_state(5, 1000); },
      [](DropoutRun& run) { (void)mt::rand({3}, mt::f32, &run.noise).to_vector<float>(); },
      [](DropoutRun& run) { run.noise.advance(64); },
  };
  expect_side_by_side(plain_run, compiled_run, step, 28, [&](int i, DropoutRun& run) {
    if (i % 7 == 6) outside[i / 7](run);
  });
  EXPECT_EQ(plain_run.drop.seed(), compiled_run.drop.seed());
  if (replays_here()) {
    EXPECT_GE(step.stats().plans, 4) << step.stats().reason;
    EXPECT_GE(step.stats().replays, 8);
  }
}

// A character-level GPT block with attention and residual dropout, as examples/char_gpt.cpp
// trains it.
TEST(Compile, TransformerWithDropoutReplaysBitForBit) {
  struct Run {
    mt::Generator gen{41};
    mt::Embedding embed{16, 32, &gen};
    mt::TransformerBlock block{32, 4, 0.1, &gen};
    mt::Linear head{32, 16, true, &gen};
    std::unique_ptr<mt::AdamW> opt;
    Run() {
      std::vector<mt::Tensor> params = embed.parameters();
      for (const mt::Tensor& p : block.parameters()) params.push_back(p);
      for (const mt::Tensor& p : head.parameters()) params.push_back(p);
      opt = std::make_unique<mt::AdamW>(params, mt::AdamOptions{.lr = 3e-3});
    }
    mt::Tensor step(const mt::Tensor& ids, const mt::Tensor& targets) {
      opt->zero_grad();
      mt::Tensor logits = head(block(embed(ids)));
      mt::Tensor loss = mt::cross_entropy(logits.reshape({-1, 16}), targets.reshape({-1}));
      loss.backward();
      opt->step();
      return loss;
    }
  };
  std::vector<int64_t> text(2 * 9);
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<int64_t>((i * 7 + i / 3) % 16);
  std::vector<int64_t> ids, targets;
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 8; ++t) {
      ids.push_back(text[b * 9 + t]);
      targets.push_back(text[b * 9 + t + 1]);
    }
  mt::Tensor x = mt::tensor(ids, {2, 8}), y = mt::tensor(targets, {2, 8});
  Run plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& a, const mt::Tensor& b) { return compiled_run.step(a, b); });
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 8; ++i) {
    plain.push_back(f32_bits(plain_run.step(x, y))[0]);
    compiled.push_back(f32_bits(step(x, y))[0]);
  }
  EXPECT_EQ(plain, compiled);
  for (size_t i = 0; i < plain_run.opt->params().size(); ++i)
    EXPECT_EQ(f32_bits(plain_run.opt->params()[i]), f32_bits(compiled_run.opt->params()[i])) << i;
  EXPECT_TRUE(replayed_at_least(step, 4));
}

// A returned loss that the backward pass does not need (the gradient of a mean needs no forward
// value) is evaluated after the optimizer's step, from the weights as they were before it: the
// replay hands that evaluation the values the step replaced.
TEST(Compile, ALossEvaluatedAfterTheStepReadsTheWeightsItWasComputedFrom) {
  struct Run {
    mt::Generator gen{7};
    mt::TransformerBlock block{16, 2, 0.1, &gen};
    mt::AdamW opt{block.parameters(), {.lr = 1e-2}};
    mt::Tensor step(const mt::Tensor& x) {
      opt.zero_grad();
      mt::Tensor loss = mt::mean(block(x));
      loss.backward();
      opt.step();
      return loss;
    }
  };
  mt::Generator data(3);
  mt::Tensor x = mt::randn({2, 8, 16}, mt::f32, &data);
  Run plain_run, compiled_run;
  auto step = mt::compile([&](const mt::Tensor& a) { return compiled_run.step(a); });
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 6; ++i) {
    plain.push_back(f32_bits(plain_run.step(x))[0]);
    compiled.push_back(f32_bits(step(x))[0]);
  }
  EXPECT_EQ(plain, compiled);
  for (size_t i = 0; i < plain_run.opt.params().size(); ++i)
    EXPECT_EQ(f32_bits(plain_run.opt.params()[i]), f32_bits(compiled_run.opt.params()[i])) << i;
  EXPECT_TRUE(replayed_at_least(step, 3));
}

// A training step that returns its logits beside the loss (for the accuracy): the optimizer's
// evaluation stores the logits, which the returned loss, evaluated after it, reads. The replay
// hands the loss the logits it returns, fresh every call, and replays with tracing's bits. With
// the loss evaluated before backward() (read for a log line), the backward pass computes the
// forward values it needs again, from inputs a plan would bind for both evaluations at once: it
// traces every call, with tracing's bits and a reason that says so (its replays crashed).
TEST(Compile, AStepReturningTheLogitsTheLossReadsReplays) {
  struct Run {
    bool evaluate_loss_first;
    mt::Generator gen{5};
    mt::MLP model{{8, 16, 4}, mt::Activation::Gelu, &gen};
    mt::SGD opt{model.parameters(), {.lr = 0.1, .momentum = 0.9}};
    std::vector<mt::Tensor> step(const mt::Tensor& x, const mt::Tensor& y) {
      opt.zero_grad();
      mt::Tensor logits = model(x);
      mt::Tensor loss = mt::cross_entropy(logits, y);
      if (evaluate_loss_first) mt::eval({loss});
      loss.backward();
      opt.step();
      return {loss, logits};
    }
  };
  for (bool evaluate_loss_first : {false, true}) {
    SCOPED_TRACE(evaluate_loss_first ? "loss evaluated before backward()" : "lazy loss");
    mt::Generator data(8);
    const mt::Tensor y = mt::tensor(std::vector<int64_t>{0, 3, 1, 2, 2, 0}, {6}, mt::i64);
    Run plain_run{evaluate_loss_first}, compiled_run{evaluate_loss_first};
    auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& labels) {
      return compiled_run.step(x, labels);
    });
    mt::Tensor first_logits;
    std::vector<uint32_t> first_bits;
    for (int i = 0; i < 6; ++i) {
      const mt::Tensor x = mt::randn({6, 8}, mt::f32, &data);
      std::vector<mt::Tensor> want = plain_run.step(x, y), got = step(x, y);
      ASSERT_EQ(got.size(), 2u);
      EXPECT_EQ(f32_bits(want[0]), f32_bits(got[0])) << "loss, call " << i;
      EXPECT_EQ(f32_bits(want[1]), f32_bits(got[1])) << "logits, call " << i;
      if (i == 0) first_logits = got[1], first_bits = f32_bits(got[1]);
    }
    // Every call's results are its own: the first call's logits still hold their values.
    EXPECT_EQ(f32_bits(first_logits), first_bits);
    for (size_t i = 0; i < plain_run.opt.params().size(); ++i)
      EXPECT_EQ(f32_bits(plain_run.opt.params()[i]), f32_bits(compiled_run.opt.params()[i])) << i;
    if (!evaluate_loss_first) {
      EXPECT_TRUE(replayed_at_least(step, 3));
    } else if (replays_here()) {
      EXPECT_EQ(step.stats().replays, 0);
      EXPECT_NE(step.stats().reason.find("two evaluations of the call compute"), std::string::npos)
          << step.stats().reason;
    }
  }
}

// A tensor made from host data inside the function is a new input every call: no replay.
TEST(Compile, HostDataMadeInsideTheFunctionIsNotFrozen) {
  MlpRun run;
  int call = 0;
  auto step = mt::compile([&](const mt::Tensor& x) {
    std::vector<float> offsets(4, static_cast<float>(call++));
    return (x.sum({0}) + mt::tensor(offsets, {4})).sum();
  });
  mt::Tensor x = mt::ones({3, 4});
  for (int i = 0; i < 5; ++i) EXPECT_EQ(step(x).item(), 12.0 + 4.0 * i);
  EXPECT_EQ(step.stats().replays, 0);
  if (replays_here()) {
    EXPECT_NE(step.stats().reason.find("host data"), std::string::npos) << step.stats().reason;
  }
}

// Replacing state from outside (loading weights) is followed: the plan is dropped and rebuilt.
TEST(Compile, ReplacedParametersAreFollowed) {
  MlpRun plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return compiled_run.step(x, y); });
  auto reload = [](MlpRun& run) {
    mt::Tensor w = run.model.parameters()[0];
    w.assign(mt::full(w.shape(), 0.05, w.dtype()));
  };
  expect_same_losses_across_a_reload(plain_run, compiled_run, step, reload);
  if (replays_here()) {
    EXPECT_EQ(step.stats().plans, 2) << step.stats().reason;
    EXPECT_GE(step.stats().replays, 4);
  }
}

// The same with two argument signatures planned (full batches and a short last one): each plan
// binds the parameters' buffers, so a replacement outside the step must be seen by both, whatever
// the other plan holds of those buffers and whichever signature comes first after it.
TEST(Compile, ReplacedParametersAreFollowedWithTwoShapesPlanned) {
  MlpRun plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return compiled_run.step(x, y); });
  mt::Generator gen(5);
  const mt::Tensor short_x = mt::randn({40, 8}, mt::f32, &gen);
  const mt::Tensor short_y = mt::randn({40, 4}, mt::f32, &gen);
  auto reload = [](MlpRun& run, double value) {
    for (mt::Tensor w : run.model.parameters()) w.assign(mt::full(w.shape(), value, w.dtype()));
  };
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 36; ++i) {
    if (i == 16 || i == 27) {  // before a full batch, then before a short one
      reload(plain_run, 0.01 * i);
      reload(compiled_run, 0.01 * i);
    }
    const bool full = i % 9 < 5;  // runs of five full batches and four short ones
    const mt::Tensor x = full ? plain_run.batch(i) : short_x, y = full ? plain_run.y : short_y;
    plain.push_back(f32_bits(plain_run.step(x, y))[0]);
    compiled.push_back(f32_bits(step(x, y))[0]);
  }
  EXPECT_EQ(plain, compiled);
  expect_same_state(plain_run, compiled_run);
  EXPECT_TRUE(replayed_at_least(step, 12));
}

// Every parameter's gradient, as bits (empty where it has none).
std::vector<std::vector<uint32_t>> gradient_bits(const mt::Module& model) {
  std::vector<std::vector<uint32_t>> out;
  for (const mt::Tensor& p : model.parameters())
    out.push_back(p.grad().defined() ? f32_bits(p.grad()) : std::vector<uint32_t>{});
  return out;
}

// Gradients zeroed outside the step (PyTorch's usual loop: zero_grad, then the step) are made
// afresh by each backward: a replay only writes them, so the move off them does not stop replays,
// and it leaves them in each parameter's grad() as tracing does.
TEST(Compile, GradientsZeroedOutsideTheStepStillReplay) {
  MlpRun plain_run, compiled_run;
  auto body = [](MlpRun& run, const mt::Tensor& x, const mt::Tensor& y) {
    return run.step(x, y, /*zero_inside=*/false);
  };
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return body(compiled_run, x, y); });
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 10; ++i) {
    plain_run.opt.zero_grad();
    compiled_run.opt.zero_grad();
    plain.push_back(f32_bits(body(plain_run, plain_run.batch(i), plain_run.y))[0]);
    compiled.push_back(f32_bits(step(compiled_run.batch(i), compiled_run.y))[0]);
    EXPECT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model))
        << "step " << i;
  }
  EXPECT_EQ(plain, compiled);
  EXPECT_TRUE(replayed_at_least(step, 7));
}

// A gradient kept from an earlier step keeps its value: the next replay writes the new gradient
// elsewhere than into the buffer the kept tensor reads.
TEST(Compile, GradientsKeptFromAnEarlierStepAreNotOverwritten) {
  MlpRun run;
  auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
    mt::Tensor loss = mt::mse_loss(run.model(x), y);
    loss.backward();
    return loss;
  });
  std::vector<std::pair<mt::Tensor, std::vector<uint32_t>>> kept;
  for (int i = 0; i < 8; ++i) {
    run.opt.zero_grad();
    step(run.batch(i), run.y);
    const mt::Tensor g = run.model.parameters()[0].grad();
    ASSERT_TRUE(g.defined()) << "step " << i;
    if (i % 3 != 1) kept.emplace_back(g, f32_bits(g));
  }
  for (const auto& [g, at_the_time] : kept) EXPECT_EQ(f32_bits(g), at_the_time);
  EXPECT_TRUE(replayed_at_least(step, 5));
}

// Gradient accumulation decided outside the step: after calls whose gradients were zeroed first,
// a call whose gradients were left adds to them, as tracing does, rather than replaying a plan
// that makes them afresh.
TEST(Compile, GradientsLeftFromTheLastCallAreAddedTo) {
  MlpRun plain_run, compiled_run;
  auto step = compile_forward_backward(compiled_run);
  for (int i = 0; i < 14; ++i) {
    if (i < 6 || i % 3 == 0) {  // one micro-batch per step, then three
      plain_run.opt.zero_grad();
      compiled_run.opt.zero_grad();
    }
    EXPECT_EQ(f32_bits(forward_backward(plain_run, plain_run.batch(i), plain_run.y)),
              f32_bits(step(compiled_run.batch(i), compiled_run.y)));
    EXPECT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model))
        << "step " << i;
  }
  EXPECT_TRUE(replayed_at_least(step, 3));
}

// The forward and backward pass compiled, the optimizer's step outside it (torch.compile's usual
// use: the model compiled, not the optimizer): each step outside gives the parameters new
// buffers, which a replay reads through the parameters rather than from where they were.
TEST(Compile, OptimizerOutsideTheStepStillReplays) {
  MlpRun plain_run, compiled_run;
  auto step = compile_forward_backward(compiled_run);
  for (int i = 0; i < 10; ++i) {
    for (MlpRun* run : {&plain_run, &compiled_run}) run->opt.zero_grad();
    EXPECT_EQ(f32_bits(forward_backward(plain_run, plain_run.batch(i), plain_run.y)),
              f32_bits(step(compiled_run.batch(i), compiled_run.y)));
    for (MlpRun* run : {&plain_run, &compiled_run}) run->opt.step();
  }
  expect_same_state(plain_run, compiled_run);
  EXPECT_TRUE(replayed_at_least(step, 7));
}

// Gradient accumulation in the loop users write (torch.compile's usual use): the forward and
// backward pass compiled, four micro-batches per optimizer step, zero_grad and the optimizer's
// step outside. The call after zero_grad and the calls that add to the gradients replay one plan
// (its gradients start from -0 where the call finds none, which leaves every sum exact), so
// after the first calls every call replays, and what it leaves is tracing's, bit for bit: in f32
// and under bf16 autocast.
TEST(Compile, GradientAccumulationWithTheOptimizerOutsideReplays) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "autocast bf16" : "f32");
    std::optional<mt::autocast> guard;
    if (bf16) guard.emplace(mt::bf16);
    MlpRun plain_run, compiled_run;
    auto step = compile_forward_backward(compiled_run);
    const int micro = 4, steps = 6;
    for (int s = 0; s < steps; ++s) {
      for (int m = 0; m < micro; ++m) {
        const int i = s * micro + m;
        EXPECT_EQ(f32_bits(forward_backward(plain_run, plain_run.batch(i), plain_run.y)),
                  f32_bits(step(compiled_run.batch(i), compiled_run.y)));
        EXPECT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model))
            << "call " << i;
      }
      for (MlpRun* run : {&plain_run, &compiled_run}) {
        run->opt.step();
        run->opt.zero_grad();
      }
    }
    expect_same_state(plain_run, compiled_run);
    if (replays_here()) {  // under autocast the first sum reads a bf16 gradient, later ones f32
      EXPECT_LE(step.stats().traces, bf16 ? 4 : 3) << step.stats().reason;
      EXPECT_EQ(step.stats().plans, 1) << step.stats().reason;
    }
  }
}

// The same for a bf16 tensor used twice in the step (two contributions to its bf16 gradient)
// and for a gradient dropped in the middle of accumulating (the next call makes it afresh):
// the replays leave tracing's bits.
TEST(Compile, AccumulatedHalfGradientsMatchTracing) {
  mt::Generator gen(5);
  const mt::Tensor x = mt::randn({16, 8}, mt::f32, &gen).to(mt::bf16);
  mt::Tensor plain_w = mt::randn({8, 8}, mt::bf16, &gen).requires_grad_();
  mt::Tensor compiled_w = plain_w.detach().requires_grad_();
  auto body = [&](mt::Tensor& w, const mt::Tensor& input) {
    mt::Tensor h = mt::matmul(mt::matmul(input, w), w);
    mt::Tensor loss = mt::mean(mt::cast(h * h, mt::f32));
    loss.backward();
    return loss;
  };
  auto step = mt::compile([&](const mt::Tensor& input) { return body(compiled_w, input); });
  for (int i = 0; i < 18; ++i) {
    if (i % 3 == 0 || i == 10)
      for (mt::Tensor* w : {&plain_w, &compiled_w}) w->zero_grad();
    const mt::Tensor input = x * (1.0 + 0.125 * i);
    EXPECT_EQ(f32_bits(body(plain_w, input)), f32_bits(step(input)));
    ASSERT_TRUE(compiled_w.grad().defined());
    EXPECT_EQ(compiled_w.grad().dtype(), mt::bf16);
    EXPECT_EQ(f32_bits(plain_w.grad()), f32_bits(compiled_w.grad())) << "call " << i;
  }
  EXPECT_TRUE(replayed_at_least(step, 14));
}

// A gradient the step adds to that is, in the traced calls, also read in another role (another
// parameter's gradient: set_grad of one tensor, or of cached zeros, to two parameters; the
// parameter itself; an argument) is not bound to one of them: the step traces, and leaves what
// tracing leaves when the roles part.
TEST(Compile, AGradientAlsoReadInAnotherRoleIsNotBoundToOne) {
  for (int scenario = 0; scenario < 4; ++scenario) {
    SCOPED_TRACE(testing::Message() << "scenario " << scenario);
    MlpRun plain_run, compiled_run;
    auto body = [](MlpRun& run, const mt::Tensor& x, const mt::Tensor& y, const mt::Tensor& aux) {
      mt::Tensor loss = mt::mse_loss(run.model(x), y) + 0.0 * mt::sum(aux);
      loss.backward();
      return loss;
    };
    auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y, const mt::Tensor& aux) {
      return body(compiled_run, x, y, aux);
    });
    for (int i = 0; i < 12; ++i) {
      const bool together = i < 6;  // the roles share a buffer, then part
      std::vector<mt::Tensor> aux;
      for (MlpRun* run : {&plain_run, &compiled_run}) {
        std::vector<mt::Tensor> p = run->model.parameters();  // biases 1 and 3: [32]
        if (scenario == 0 && p[3].grad().defined())
          p[1].set_grad(together ? p[3].grad() : p[3].grad() * 2.0);
        if (scenario == 1 && i % 3 == 0) {  // set_to_none=False with one zeros per shape
          const mt::Tensor zeros = mt::zeros({32});
          p[1].set_grad(zeros);
          p[3].set_grad(together ? zeros : mt::zeros({32}));
        }
        if (scenario == 2) p[5].set_grad(together ? p[5] : mt::full({4}, 1000.0));
        aux.push_back(scenario == 3 && together && p[5].grad().defined() ? p[5].grad()
                                                                         : mt::full({4}, 7.0));
        mt::eval(p);
      }
      mt::eval(aux);
      ASSERT_EQ(f32_bits(body(plain_run, plain_run.batch(i), plain_run.y, aux[0])),
                f32_bits(step(compiled_run.batch(i), compiled_run.y, aux[1])))
          << "call " << i;
      ASSERT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model))
          << "call " << i;
      if (i % 4 == 3)
        for (MlpRun* run : {&plain_run, &compiled_run}) run->opt.step();
    }
    expect_same_state(plain_run, compiled_run);
  }
}

// A step that reads the gradient it found both before and after the evaluation that adds to it
// (the gradient before, then the sum minus it): the later read sees the gradient the call
// found, as tracing does, not the sum a replay wrote into its buffer first.
TEST(Compile, TheGradientFoundIsReadAsItWasAfterTheSumIsWritten) {
  MlpRun plain_run, compiled_run;
  auto body = [](MlpRun& run, const mt::Tensor& x, const mt::Tensor& y) {
    const mt::Tensor bias = run.model.parameters()[5];
    const mt::Tensor before = bias.grad();
    mt::Tensor loss = mt::mse_loss(run.model(x), y);
    loss.backward();
    mt::eval({loss, bias.grad()});  // the sum, in an evaluation of its own
    return std::vector<mt::Tensor>{loss, mt::sum(bias.grad() - before)};
  };
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return body(compiled_run, x, y); });
  for (MlpRun* run : {&plain_run, &compiled_run}) forward_backward(*run, run->batch(0), run->y);
  for (int i = 1; i < 9; ++i) {
    const std::vector<mt::Tensor> traced = body(plain_run, plain_run.batch(i), plain_run.y);
    const std::vector<mt::Tensor> compiled = step(compiled_run.batch(i), compiled_run.y);
    EXPECT_EQ(f32_bits(traced[0]), f32_bits(compiled[0])) << "call " << i;
    EXPECT_EQ(f32_bits(traced[1]), f32_bits(compiled[1])) << "call " << i;
    EXPECT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model));
  }
  EXPECT_TRUE(replayed_at_least(step, 4));
}

// A parameter frozen (requires_grad_(false)) or unfrozen between calls is followed, with the
// optimizer inside the step and outside it.
TEST(Compile, FrozenParametersAreFollowed) {
  for (bool optimizer_inside : {true, false}) {
    SCOPED_TRACE(optimizer_inside ? "optimizer inside" : "optimizer outside");
    MlpRun plain_run, compiled_run;
    auto body = [&](MlpRun& run, const mt::Tensor& x, const mt::Tensor& y) {
      return run.step(x, y, true, optimizer_inside);
    };
    auto step = mt::compile(
        [&](const mt::Tensor& x, const mt::Tensor& y) { return body(compiled_run, x, y); });
    for (int i = 0; i < 15; ++i) {
      if (i == 5 || i == 10)
        for (MlpRun* run : {&plain_run, &compiled_run})
          run->model.parameters()[0].requires_grad_(i == 10);
      EXPECT_EQ(f32_bits(body(plain_run, plain_run.batch(i), plain_run.y)),
                f32_bits(step(compiled_run.batch(i), compiled_run.y)));
      EXPECT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model));
      if (!optimizer_inside)
        for (MlpRun* run : {&plain_run, &compiled_run}) run->opt.step();
    }
    expect_same_state(plain_run, compiled_run);
    EXPECT_TRUE(replayed_at_least(step, 6));
  }
}

// One step of MlpRun's with the batch as an input that requires grad (saliency maps,
// adversarial examples): a fresh tensor every call, whose gradient the replay gives to the
// call's own argument.
TEST(Compile, GradientsOfArgumentsGoToEachCallsArgument) {
  MlpRun plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return compiled_run.step(x, y); });
  auto input = [](const MlpRun& run, int i) {
    return mt::tensor(run.batch(i).to_vector<float>(), {64, 8}).requires_grad_();
  };
  std::vector<std::pair<mt::Tensor, std::vector<uint32_t>>> kept;
  for (int i = 0; i < 8; ++i) {
    mt::Tensor plain_x = input(plain_run, i), compiled_x = input(compiled_run, i);
    EXPECT_EQ(f32_bits(plain_run.step(plain_x, plain_run.y)),
              f32_bits(step(compiled_x, compiled_run.y)));
    ASSERT_TRUE(compiled_x.grad().defined()) << "call " << i;
    EXPECT_EQ(f32_bits(plain_x.grad()), f32_bits(compiled_x.grad())) << "call " << i;
    kept.emplace_back(compiled_x.grad(), f32_bits(compiled_x.grad()));
  }
  for (const auto& [g, at_the_time] : kept) EXPECT_EQ(f32_bits(g), at_the_time);
  // Inputs the caller keeps (a list of tensors requiring grad) replay as well.
  std::vector<mt::Tensor> inputs;
  for (int i = 0; i < 8; ++i) inputs.push_back(input(compiled_run, i));
  const int64_t before = step.stats().replays;
  for (const mt::Tensor& x : inputs) step(x, compiled_run.y);
  if (replays_here()) {
    EXPECT_GE(before, 5) << step.stats().reason;
    EXPECT_GE(step.stats().replays - before, 7) << step.stats().reason;
  }
}

// Two compiled functions over micro-batches with zero_grad outside: the second adds to the
// gradients the first left. Both replay, and the gradients are tracing's.
TEST(Compile, AStepAddingToAnotherStepsGradientsReplays) {
  MlpRun plain_run, compiled_run;
  auto micro = forward_backward;
  auto first = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return micro(compiled_run, x, y); });
  auto second = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return micro(compiled_run, x, y) * 2.0; });
  for (int i = 0; i < 12; ++i) {
    plain_run.opt.zero_grad();
    compiled_run.opt.zero_grad();
    const mt::Tensor a = plain_run.batch(2 * i), b = plain_run.batch(2 * i + 1);
    EXPECT_EQ(f32_bits(micro(plain_run, a, plain_run.y)), f32_bits(first(a, compiled_run.y)));
    EXPECT_EQ(f32_bits(micro(plain_run, b, plain_run.y) * 2.0),
              f32_bits(second(b, compiled_run.y)));
    EXPECT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model)) << i;
  }
  if (replays_here()) {
    EXPECT_GE(first.stats().replays, 9) << first.stats().reason;
    EXPECT_GE(second.stats().replays, 9) << second.stats().reason;
  }
}

// Gradients handed in as arguments (computed elsewhere) with set_grad, and a gradient returned
// for logging: a replay leaves them where tracing does.
TEST(Compile, GradientsSetFromArgumentsOrReturnedReplay) {
  MlpRun plain_run, compiled_run;
  auto apply = [](MlpRun& run, const mt::Tensor& g) {
    mt::Tensor p = run.model.parameters()[0];
    p.set_grad(g);
    run.opt.step();
    return p.grad() * 1.0;
  };
  auto step = mt::compile([&](const mt::Tensor& g) { return apply(compiled_run, g); });
  mt::Generator gen(3);
  const mt::Shape shape = plain_run.model.parameters()[0].shape();
  for (int i = 0; i < 10; ++i) {
    const mt::Tensor g = mt::randn(shape, mt::f32, &gen);
    EXPECT_EQ(f32_bits(apply(plain_run, g)), f32_bits(step(g)));
    EXPECT_EQ(compiled_run.model.parameters()[0].grad().node(), g.node()) << i;
  }
  expect_same_state(plain_run, compiled_run);

  MlpRun logged_run;
  auto logged = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
    mt::Tensor loss = logged_run.step(x, y);
    return std::vector<mt::Tensor>{loss, logged_run.model.parameters()[0].grad()};
  });
  for (int i = 0; i < 8; ++i) {
    std::vector<mt::Tensor> out = logged(logged_run.batch(i), logged_run.y);
    EXPECT_EQ(logged_run.model.parameters()[0].grad().node(), out[1].node()) << i;
  }
  if (replays_here()) {
    EXPECT_GE(step.stats().replays, 7) << step.stats().reason;
    EXPECT_GE(logged.stats().replays, 5) << logged.stats().reason;
  }
}

// ---- cases found by review: each differed from tracing before its fix ----

// The forward and backward of MlpRun with zero_grad inside; the optimizer is run outside.
mt::Tensor fwd_bwd(MlpRun& run, const mt::Tensor& x, const mt::Tensor& y) {
  run.opt.zero_grad();
  return forward_backward(run, x, y);
}

mt::Tensor copy_of(const mt::Tensor& t) { return mt::tensor(t.to_vector<float>(), t.shape()); }

// set_grad with a tensor made before the call (traced every call: a replay cannot tell whether
// the tensor changed). The user later assigns it a new value, which tracing takes as the gradient.
TEST(Compile, GradientSetFromAValueMadeBeforeTheCallFollowsIt) {
  MlpRun plain_run, compiled_run;
  const mt::Shape shape = plain_run.model.parameters()[0].shape();
  mt::Generator gen(5);
  mt::Tensor plain_g = mt::randn(shape, mt::f32, &gen);
  mt::Tensor compiled_g = copy_of(plain_g);
  auto body = [](MlpRun& run, const mt::Tensor& g, const mt::Tensor& x, const mt::Tensor& y) {
    mt::Tensor loss = fwd_bwd(run, x, y);
    run.model.parameters()[0].set_grad(g);  // e.g. a synthetic / externally supplied gradient
    return loss;
  };
  auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
    return body(compiled_run, compiled_g, x, y);
  });
  for (int i = 0; i < 10; ++i) {
    SCOPED_TRACE(testing::Message() << "call " << i);
    if (i == 5) {
      mt::Tensor fresh = mt::randn(shape, mt::f32, &gen);
      plain_g.assign(fresh);
      compiled_g.assign(copy_of(fresh));
    }
    EXPECT_EQ(f32_bits(body(plain_run, plain_g, plain_run.batch(i), plain_run.y)),
              f32_bits(step(compiled_run.batch(i), compiled_run.y)));
    EXPECT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model));
    for (MlpRun* run : {&plain_run, &compiled_run}) run->opt.step();
  }
  expect_same_state(plain_run, compiled_run);
}

// a probe that measures a second backward and then restores the gradients it found
// (saved = p.grad(); ...; p.set_grad(saved)): the gradient left is the one at call start, made
// before the call, so it becomes slot.fixed = that call's node. A later call restores the
// gradient from the trace, not the one found.
TEST(Compile, SavedAndRestoredGradientsAreTheCurrentOnes) {
  MlpRun plain_run, compiled_run;
  auto probe = [](MlpRun& run, const mt::Tensor& x, const mt::Tensor& y) {
    std::vector<mt::Tensor> saved;
    for (const mt::Tensor& p : run.model.parameters()) saved.push_back(p.grad());
    run.opt.zero_grad();
    mt::mse_loss(run.model(x), y).backward();
    mt::Tensor norm = mt::zeros({});
    for (const mt::Tensor& p : run.model.parameters()) norm = norm + (p.grad() * p.grad()).sum();
    std::vector<mt::Tensor> params = run.model.parameters();
    for (size_t k = 0; k < params.size(); ++k) params[k].set_grad(saved[k]);
    return norm;
  };
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return probe(compiled_run, x, y); });
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(testing::Message() << "iteration " << i);
    for (MlpRun* run : {&plain_run, &compiled_run}) {
      run->opt.zero_grad();
      mt::mse_loss(run->model(run->batch(i)), run->y).backward();  // the main gradients
    }
    for (int k = 0; k < 2; ++k) {
      EXPECT_EQ(f32_bits(probe(plain_run, plain_run.batch(10 + k), plain_run.y)),
                f32_bits(step(compiled_run.batch(10 + k), compiled_run.y)));
      EXPECT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model)) << k;
    }
  }
}

// the same compiled step called first with plain batches, then with a batch that requires
// grad (adversarial example): signature_key has no requires_grad, so the replay gives the
// argument no gradient where tracing does.
TEST(Compile, AnArgumentThatStartsRequiringGradGetsItsGradient) {
  MlpRun plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return compiled_run.step(x, y); });
  for (int i = 0; i < 8; ++i) {
    SCOPED_TRACE(testing::Message() << "call " << i);
    const bool adversarial = i >= 5;
    mt::Tensor xp = copy_of(plain_run.batch(i)), xc = copy_of(compiled_run.batch(i));
    if (adversarial) {
      xp.requires_grad_();
      xc.requires_grad_();
    }
    EXPECT_EQ(f32_bits(plain_run.step(xp, plain_run.y)), f32_bits(step(xc, compiled_run.y)));
    EXPECT_EQ(xp.grad().defined(), xc.grad().defined());
    if (xp.grad().defined() && xc.grad().defined()) {
      EXPECT_EQ(f32_bits(xp.grad()), f32_bits(xc.grad()));
    }
  }
}

// parameter binding + in-place state. The step keeps slow weights (Lookahead) it updates
// with assign; the optimizer is outside. Every 4 calls the user resets the fast weights to the
// slow ones with p.assign(slow): p now shares the buffer the replay overwrites in place, which a
// Binding::parameter does not guard as at_call_start does for carried buffers.
TEST(Compile, AParameterAssignedFromStateTheStepUpdatesInPlace) {
  MlpRun plain_run, compiled_run;
  auto make_slow = [](MlpRun& run) {
    std::vector<mt::Tensor> slow;
    for (const mt::Tensor& p : run.model.parameters()) slow.push_back(copy_of(p));
    return slow;
  };
  std::vector<mt::Tensor> plain_slow = make_slow(plain_run),
                          compiled_slow = make_slow(compiled_run);
  auto body = [](MlpRun& run, std::vector<mt::Tensor>& slow, const mt::Tensor& x,
                 const mt::Tensor& y) {
    mt::Tensor loss = fwd_bwd(run, x, y);
    std::vector<mt::Tensor> params = run.model.parameters();
    for (size_t k = 0; k < params.size(); ++k)
      slow[k].assign(slow[k] * 0.9 + params[k].detach() * 0.1 + 0.01);
    return loss;
  };
  auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
    return body(compiled_run, compiled_slow, x, y);
  });
  for (int i = 0; i < 12; ++i) {
    SCOPED_TRACE(testing::Message() << "call " << i);
    if (i % 4 == 3) {
      std::vector<mt::Tensor> pp = plain_run.model.parameters(),
                              cp = compiled_run.model.parameters();
      for (size_t k = 0; k < pp.size(); ++k) {
        pp[k].assign(plain_slow[k]);
        cp[k].assign(compiled_slow[k]);
      }
    }
    EXPECT_EQ(f32_bits(body(plain_run, plain_slow, plain_run.batch(i), plain_run.y)),
              f32_bits(step(compiled_run.batch(i), compiled_run.y)));
    Snapshot a, b;
    snapshot_model(a, plain_run.model, plain_run.opt);
    snapshot_model(b, compiled_run.model, compiled_run.opt);
    EXPECT_TRUE(a.params == b.params) << "parameters after the call";
    for (MlpRun* run : {&plain_run, &compiled_run}) run->opt.step();
  }
  expect_same_state(plain_run, compiled_run);
}

// the same through SGD: an optimizer (outside the step) that starts after the plan, e.g. a
// phase switch to SGD with momentum: its first momentum_buffer is the gradient itself.
TEST(Compile, SgdMomentumStartedAfterThePlanKeepsItsBuffer) {
  MlpRun plain_run, compiled_run;
  mt::SGD plain_sgd(plain_run.model.parameters(), mt::SGDOptions{.lr = 1e-2, .momentum = 0.9});
  mt::SGD compiled_sgd(compiled_run.model.parameters(),
                       mt::SGDOptions{.lr = 1e-2, .momentum = 0.9});
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return fwd_bwd(compiled_run, x, y); });
  for (int i = 0; i < 10; ++i) {
    SCOPED_TRACE(testing::Message() << "call " << i);
    EXPECT_EQ(f32_bits(fwd_bwd(plain_run, plain_run.batch(i), plain_run.y)),
              f32_bits(step(compiled_run.batch(i), compiled_run.y)));
    if (i < 5) {
      plain_run.opt.step();
      compiled_run.opt.step();
    } else {
      plain_sgd.step();
      compiled_sgd.step();
    }
  }
  std::vector<mt::Tensor> a = plain_run.model.parameters(), b = compiled_run.model.parameters();
  for (size_t k = 0; k < a.size(); ++k) EXPECT_EQ(f32_bits(a[k]), f32_bits(b[k])) << "param " << k;
  for (size_t k = 0; k < a.size(); ++k)
    EXPECT_EQ(f32_bits(plain_sgd.state(k)[0].second), f32_bits(compiled_sgd.state(k)[0].second))
        << "momentum " << k;
}

// A copy of the weights taken with assign between calls (the best weights so far) keeps its
// value while later replays update the weights in place.
TEST(Compile, WeightsCopiedWithAssignKeepTheirValue) {
  MlpRun run;
  auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) { return run.step(x, y); });
  mt::Tensor best = mt::zeros(run.model.parameters()[0].shape());
  std::vector<uint32_t> at_the_time;
  for (int i = 0; i < 10; ++i) {
    step(run.batch(i), run.y);
    if (i == 5) {
      best.assign(run.model.parameters()[0]);
      at_the_time = f32_bits(best);
    }
  }
  EXPECT_EQ(f32_bits(best), at_the_time);
  EXPECT_TRUE(replayed_at_least(step, 6));
}

// A gradient copied with assign (for a log of successive gradients) keeps its value: assign
// copies a buffer that replays update in place rather than sharing it.
TEST(Compile, AGradientCopiedWithAssignKeepsItsValue) {
  MlpRun plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return fwd_bwd(compiled_run, x, y); });
  std::vector<std::pair<mt::Tensor, std::vector<uint32_t>>> kept;
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(f32_bits(fwd_bwd(plain_run, plain_run.batch(i), plain_run.y)),
              f32_bits(step(compiled_run.batch(i), compiled_run.y)));
    mt::Tensor prev = mt::zeros(compiled_run.model.parameters()[0].shape());
    prev.assign(compiled_run.model.parameters()[0].grad());  // e.g. for a gradient-cosine log
    kept.emplace_back(prev, f32_bits(prev));
    for (MlpRun* run : {&plain_run, &compiled_run}) run->opt.step();
  }
  for (size_t i = 0; i < kept.size(); ++i)
    EXPECT_EQ(f32_bits(kept[i].first), kept[i].second) << "kept after call " << i;
}

// Random training loops: each scenario fixes what the step does (zero_grad inside it or not, the
// optimizer's step inside it or outside), and before each call does at random what users do
// outside a step: the optimizer's step, zero_grad or not (accumulation), weights or optimizer
// state loaded, the learning rate set, a short batch, a gradient kept. The compiled step leaves
// what tracing leaves, bit for bit, after every call, and a kept gradient keeps its value.
TEST(Compile, RandomLoopsLeaveWhatTracingLeaves) {
  int64_t replays = 0;
  for (int scenario = 0; scenario < 8; ++scenario) {
    SCOPED_TRACE(testing::Message() << "scenario " << scenario);
    std::mt19937 rng(1000 + scenario);
    auto chance = [&](int percent) { return static_cast<int>(rng() % 100) < percent; };
    const bool zero_inside = scenario % 2 == 1, optimizer_inside = scenario % 4 < 2;
    MlpRun plain_run, compiled_run;
    auto body = [&](MlpRun& run, const mt::Tensor& x, const mt::Tensor& y) {
      return run.step(x, y, zero_inside, optimizer_inside);
    };
    auto step = mt::compile(
        [&](const mt::Tensor& x, const mt::Tensor& y) { return body(compiled_run, x, y); });
    mt::Generator gen(7);
    const mt::Tensor short_x = mt::randn({40, 8}, mt::f32, &gen);
    const mt::Tensor short_y = mt::randn({40, 4}, mt::f32, &gen);
    std::vector<std::pair<mt::Tensor, std::vector<uint32_t>>> kept;
    for (int i = 0; i < 24; ++i) {
      SCOPED_TRACE(testing::Message() << "call " << i);
      const bool outside_step = !optimizer_inside && i > 0 && chance(60);
      const bool zero = chance(70), reload = chance(8), load_state = i > 2 && chance(8);
      const bool new_rate = chance(15), short_batch = chance(25), keep = chance(30);
      const double value = 0.001 * static_cast<double>(rng() % 50);
      for (MlpRun* run : {&plain_run, &compiled_run}) {
        if (outside_step) run->opt.step();
        if (zero) run->opt.zero_grad();
        if (reload)
          for (mt::Tensor w : run->model.parameters()) w.assign(mt::full(w.shape(), value));
        for (size_t p = 0; load_state && p < run->opt.params().size(); ++p) {
          mt::NamedTensors fresh;
          for (const auto& [name, old] : run->opt.state(p))
            fresh.emplace_back(name, mt::full(old.shape(), value, old.dtype()));
          run->opt.load_state(p, fresh);
        }
        if (new_rate) run->opt.set_lr(1e-3 + value);
      }
      const mt::Tensor& x = short_batch ? short_x : plain_run.batch(i);
      const mt::Tensor& y = short_batch ? short_y : plain_run.y;
      ASSERT_EQ(f32_bits(body(plain_run, x, y)), f32_bits(step(x, y)));
      ASSERT_TRUE(gradient_bits(plain_run.model) == gradient_bits(compiled_run.model));
      Snapshot plain_state, compiled_state;
      snapshot_model(plain_state, plain_run.model, plain_run.opt);
      snapshot_model(compiled_state, compiled_run.model, compiled_run.opt);
      ASSERT_TRUE(plain_state == compiled_state);
      const mt::Tensor g = compiled_run.model.parameters()[0].grad();
      if (keep && g.defined()) kept.emplace_back(g, f32_bits(g));
    }
    for (const auto& [g, at_the_time] : kept) EXPECT_EQ(f32_bits(g), at_the_time);
    replays += step.stats().replays;
  }
  if (replays_here()) {
    EXPECT_GE(replays, 40);
  }
}

// Optimizer state loaded from outside (a resumed checkpoint) is followed even while handles to
// the old state, which share its buffers, are still held.
TEST(Compile, LoadedOptimizerStateIsFollowedWhileOldHandlesAreHeld) {
  MlpRun plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return compiled_run.step(x, y); });
  std::vector<mt::NamedTensors> held;
  auto reload = [&](MlpRun& run) {
    for (size_t p = 0; p < run.opt.params().size(); ++p) {
      held.push_back(run.opt.state(p));
      mt::NamedTensors fresh;
      for (const auto& [name, value] : held.back())
        fresh.emplace_back(name, mt::full(value.shape(), 0.001, value.dtype()));
      run.opt.load_state(p, fresh);
    }
  };
  expect_same_losses_across_a_reload(plain_run, compiled_run, step, reload);
  expect_same_state(plain_run, compiled_run);
  EXPECT_TRUE(replayed_at_least(step, 6));
}

// Each argument signature gets its own trace and plan; a function may return several values.
TEST(Compile, ShapesArePlannedSeparately) {
  auto stats_of = mt::compile([](const mt::Tensor& x) {
    return std::vector<mt::Tensor>{x.mean(), (x * x).sum()};
  });
  for (int i = 0; i < 8; ++i) {
    int64_t rows = i % 2 == 0 ? 3 : 5;
    std::vector<mt::Tensor> s = stats_of(mt::full({rows, 2}, static_cast<double>(i)));
    ASSERT_EQ(s.size(), 2u);
    EXPECT_EQ(s[0].item(), i);
    EXPECT_EQ(s[1].item(), static_cast<double>(rows * 2 * i * i));
  }
  if (replays_here()) {
    EXPECT_EQ(stats_of.stats().plans, 2) << stats_of.stats().reason;
    EXPECT_EQ(stats_of.stats().replays, 4);
  }
}

// A model with state of every kind a shape switch replaces: weights (assigned), Adam's moments
// and counts (kept by name), batch-norm running statistics (assigned) and the offset of the
// generator dropout draws from (kept by name).
struct SwitchRun {
  mt::Generator gen{8}, drop_gen{5};
  mt::Linear first{3, 6, true, &gen};
  mt::BatchNorm1d norm{6};
  mt::Dropout drop{0.25, &drop_gen};
  mt::Linear last{6, 2, true, &gen};
  mt::Adam opt;
  SwitchRun() : opt(params(), mt::AdamOptions{.lr = 0.05}) {}
  std::vector<mt::Tensor> params() {
    std::vector<mt::Tensor> all = first.parameters();
    for (const mt::Tensor& p : norm.parameters()) all.push_back(p);
    for (const mt::Tensor& p : last.parameters()) all.push_back(p);
    return all;
  }
  std::vector<mt::Tensor> step(const mt::Tensor& x) {
    opt.zero_grad();
    mt::Tensor loss = mt::mean(mt::square(last(drop(mt::relu(norm(first(x)))))));
    loss.backward();
    opt.step();
    return {loss};
  }
  std::vector<uint32_t> state() {
    std::vector<uint32_t> bits;
    for (const mt::Tensor& t : {norm.running_mean, norm.running_var})
      for (uint32_t b : f32_bits(t)) bits.push_back(b);
    for (const mt::Tensor& p : params())
      for (uint32_t b : f32_bits(p)) bits.push_back(b);
    for (size_t p = 0; p < opt.params().size(); ++p)
      for (const auto& [name, value] : opt.state(p))
        for (uint32_t b : f32_bits(value.to(mt::f32))) bits.push_back(b);
    return bits;
  }
};

// Batches of 4, 4, 4 and a short last one of 2, each epoch.
mt::Tensor switch_batch(int call) {
  const int64_t rows = call % 4 == 3 ? 2 : 4;
  mt::Tensor x = mt::arange(0, static_cast<double>(rows * 3)).reshape({rows, 3});
  return mt::sin(x * (0.3 + 0.01 * call));
}

// A training step whose batches switch shape (a short last batch each epoch): the short batch's
// trace replaces the state the full batches' plan updates in place, and the plan takes up the
// buffers it left, by name, instead of tracing twice again. The short batch's next trace, an epoch
// later, reads the buffers its last one left (the plan updated them in place), so it makes a plan
// too, which the full batches' plan takes up once more; from then on every call replays, on one
// set of state buffers. Bit for bit the eager step's.
TEST(Compile, ASwitchOfBatchShapeTakesUpTheStateTheOtherShapeLeft) {
  constexpr int kEpochs = 4;
  SwitchRun eager, compiled;
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled.step(x); });
  int64_t traces_after_first_epoch = 0;
  for (int call = 0; call < 4 * kEpochs; ++call) {
    mt::Tensor x = switch_batch(call);
    EXPECT_EQ(f32_bits(step(x)[0]), f32_bits(eager.step(x)[0])) << "call " << call;
    if (call == 3) traces_after_first_epoch = step.stats().traces;
  }
  EXPECT_EQ(compiled.state(), eager.state());
  if (replays_here()) {
    EXPECT_EQ(step.stats().traces - traces_after_first_epoch, 1) << step.stats().reason;
    EXPECT_EQ(step.stats().rebinds, 2);
    EXPECT_EQ(step.stats().plans, 2);
  }
}

// What the caller replaces between the short batch and the next full one (a weight assigned, the
// optimizer's state loaded) is no buffer the short batch's trace left: the full batches' plan is
// made again, and the reason names the switch of shapes; so is the short batch's, whose state the
// change replaced too before the full batches' traces.
TEST(Compile, StateReplacedAfterASwitchOfShapesIsFollowed) {
  for (int replace = 0; replace < 2; ++replace) {
    SwitchRun eager, compiled;
    auto step = mt::compile([&](const mt::Tensor& x) { return compiled.step(x); });
    std::string reason;
    auto outside = [&](SwitchRun& run) {
      if (replace == 0) {
        run.last.weight.assign(run.last.weight * 0.5);
      } else {
        mt::NamedTensors fresh;
        for (const auto& [name, value] : run.opt.state(0))
          fresh.emplace_back(name, mt::full(value.shape(), 0.01, value.dtype()));
        run.opt.load_state(0, fresh);
      }
    };
    for (int call = 0; call < 12; ++call) {
      mt::Tensor x = switch_batch(call);
      if (call == 8) {
        outside(eager);
        outside(compiled);
      }
      EXPECT_EQ(f32_bits(step(x)[0]), f32_bits(eager.step(x)[0])) << "call " << call;
      if (call == 8) reason = step.stats().reason;
    }
    EXPECT_EQ(compiled.state(), eager.state());
    if (replays_here()) {
      EXPECT_NE(reason.find("other argument shapes"), std::string::npos) << reason;
      EXPECT_EQ(step.stats().rebinds, 1);
    }
  }
}

// Two short batches of different shapes in a row: the full batches' plan takes up what the
// second one's trace left, as nothing outside changed the state between the two traces.
TEST(Compile, TwoShortShapesInARowAreTakenUpFrom) {
  SwitchRun eager, compiled;
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled.step(x); });
  for (int call = 0; call < 20; ++call) {
    const int64_t rows = std::array<int64_t, 5>{4, 4, 4, 3, 2}[call % 5];
    mt::Tensor x = mt::sin(mt::arange(0, static_cast<double>(rows * 3)).reshape({rows, 3}) *
                           (0.3 + 0.01 * call));
    ASSERT_EQ(f32_bits(step(x)[0]), f32_bits(eager.step(x)[0])) << "call " << call;
  }
  EXPECT_EQ(compiled.state(), eager.state());
  if (replays_here()) {
    EXPECT_GE(step.stats().rebinds, 3) << step.stats().reason;
  }
}

// Runs `calls` calls of Run::step through mt::compile and eagerly on two copies built alike,
// batches of 4, 4, 4 and a short 2 (switch_batch), calling `outside(run, call)` on both copies
// before each call; the losses and the final state are the same bits.
template <class Run>
void expect_switching_loop_matches_eager(int calls, const std::function<void(Run&, int)>& outside) {
  Run eager, compiled;
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled.step(x); });
  for (int call = 0; call < calls; ++call) {
    outside(eager, call);
    outside(compiled, call);
    mt::Tensor x = switch_batch(call);
    ASSERT_EQ(f32_bits(step(x)[0]), f32_bits(eager.step(x)[0])) << "call " << call;
  }
  EXPECT_EQ(compiled.state(), eager.state());
}

// What changed outside the step before the short batch's trace is not that trace's doing: the
// full batches' plan does not take up the state it leaves, but traces again (new options, a new
// schedule, a generator reseeded or drawn from); nor after it, where that state was changed
// again (the generator drawn from before the next full batch).
TEST(Compile, ChangesOutsideAroundASwitchOfShapesAreFollowed) {
  const std::vector<std::pair<const char*, std::function<void(SwitchRun&, int)>>> cases = {
      {"set_options before the short batch",
       [](SwitchRun& run, int call) {
         if (call != 3) return;
         mt::AdamOptions options = run.opt.options(0);
         options.weight_decay = 0.5;
         run.opt.set_options(0, options);
       }},
      {"set_schedule before the short batch",
       [](SwitchRun& run, int call) {
         if (call == 3) run.opt.set_schedule(std::make_shared<mt::ExponentialLR>(0.05, 0.5));
       }},
      {"same seed before the short batch",
       [](SwitchRun& run, int call) {
         if (call == 3) run.drop_gen.manual_seed(5);
       }},
      {"same seed after the short batch",
       [](SwitchRun& run, int call) {
         if (call % 4 == 0 && call > 0) run.drop_gen.manual_seed(5);
       }},
      {"a draw after the short batch",
       [](SwitchRun& run, int call) {
         if (call % 4 == 0 && call > 0) mt::eval({mt::rand({3}, mt::f32, &run.drop_gen)});
       }},
  };
  for (const auto& [name, outside] : cases) {
    SCOPED_TRACE(name);
    expect_switching_loop_matches_eager<SwitchRun>(12, outside);
  }
}

// Another compiled function drawing from the generator after the short batch (noise on the next
// input) leaves the offset that batch's trace left behind: the full batches' plan does not take
// that up.
TEST(Compile, ADrawOfAnotherCompiledFunctionAfterASwitchOfShapesIsFollowed) {
  SwitchRun eager, compiled;
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled.step(x); });
  auto noisy = mt::compile([&](const mt::Tensor& x) {
    return std::vector<mt::Tensor>{x + mt::rand(x.shape(), mt::f32, &compiled.drop_gen)};
  });
  for (int call = 0; call < 16; ++call) {
    mt::Tensor x = switch_batch(call);
    if (call % 4 == 0 && call > 0) {
      mt::Tensor eager_x = x + mt::rand(x.shape(), mt::f32, &eager.drop_gen);
      x = noisy(x)[0];
      ASSERT_EQ(f32_bits(x), f32_bits(eager_x)) << "call " << call;
    }
    ASSERT_EQ(f32_bits(step(x)[0]), f32_bits(eager.step(x)[0])) << "call " << call;
  }
  EXPECT_EQ(compiled.state(), eager.state());
}

// An optimizer's state goes with it: a new optimizer over the same parameters, which both
// shapes' plans updated the state of, makes them trace again (the buffers' holders, which the
// other plan also holds, cannot tell).
TEST(Compile, ANewOptimizerAfterASwitchOfShapesIsFollowed) {
  struct Run {
    mt::Generator gen{8};
    mt::Linear layer{3, 2, true, &gen};
    std::unique_ptr<mt::Adam> opt =
        std::make_unique<mt::Adam>(layer.parameters(), mt::AdamOptions{.lr = 0.05});
    std::vector<mt::Tensor> step(const mt::Tensor& x) {
      opt->zero_grad();
      mt::Tensor loss = mt::mean(mt::square(layer(x)));
      loss.backward();
      opt->step();
      return {loss};
    }
    std::vector<uint32_t> state() {
      std::vector<uint32_t> bits = f32_bits(layer.weight);
      for (size_t p = 0; p < opt->params().size(); ++p)
        for (const auto& [name, value] : opt->state(p))
          for (uint32_t b : f32_bits(value.to(mt::f32))) bits.push_back(b);
      bits.push_back(static_cast<uint32_t>(opt->steps_taken()));
      return bits;
    }
  };
  for (int at : {5, 9, 13}) {
    SCOPED_TRACE(at);
    expect_switching_loop_matches_eager<Run>(16, [at](Run& run, int call) {
      if (call == at)
        run.opt = std::make_unique<mt::Adam>(run.layer.parameters(), mt::AdamOptions{.lr = 0.05});
    });
  }
}

// A parameter the short batch does not reach keeps its own count of updates, apart from the
// optimizer's, which the short batch's trace leaves in a new buffer: the full batches' plan,
// which traced both as one buffer, cannot take that up and traces again.
TEST(Compile, AParameterOneShapeDoesNotReachKeepsItsCount) {
  struct Run {
    mt::Generator gen{4};
    mt::Linear layer{3, 2, true, &gen};
    mt::Tensor extra = mt::full({2}, 0.1, mt::f32).requires_grad_();
    mt::Adam opt{{layer.weight, layer.bias, extra}, mt::AdamOptions{.lr = 0.02}};
    std::vector<mt::Tensor> step(const mt::Tensor& x) {
      opt.zero_grad();
      mt::Tensor y = layer(x);
      if (x.size(0) == 4) y = y + extra;
      mt::Tensor loss = mt::mean(mt::square(y));
      loss.backward();
      opt.step();
      return {loss};
    }
    std::vector<uint32_t> state() {
      std::vector<uint32_t> bits = f32_bits(extra);
      for (size_t p = 0; p < opt.params().size(); ++p)
        bits.push_back(static_cast<uint32_t>(opt.steps_taken(p)));
      return bits;
    }
  };
  expect_switching_loop_matches_eager<Run>(12, [](Run&, int) {});
}

// That reason replaces only the replaced-buffer one: a parameter frozen outside the step after a
// call of other shapes is still named as the cause.
TEST(Compile, ARealChangeKeepsItsReasonAfterASwitchOfShapes) {
  mt::Generator gen(9);
  mt::Linear layer(4, 2, true, &gen);
  auto infer = mt::compile([&](const mt::Tensor& x) {
    mt::NoGradGuard no_grad;
    return mt::sum(layer(x));
  });
  for (int call = 0; call < 3; ++call) infer(mt::full({2, 4}, call + 1.0));
  infer(mt::ones({3, 4}));
  layer.bias.requires_grad_(false);
  infer(mt::full({2, 4}, 5.0));
  if (replays_here()) {
    EXPECT_NE(infer.stats().reason.find("frozen"), std::string::npos) << infer.stats().reason;
  }
}

// State a function keeps in a captured tensor through assign() is carried from call to call;
// a function may return nothing.
TEST(Compile, StateAssignedInsideTheFunctionIsCarried) {
  mt::Tensor total = mt::zeros({});
  auto accumulate = mt::compile([&](const mt::Tensor& x) { total.assign(total + x.sum()); });
  double expected = 0;
  for (int i = 0; i < 8; ++i) {
    accumulate(mt::full({3, 2}, static_cast<double>(i)));
    expected += 6.0 * i;
    EXPECT_EQ(total.item(), expected) << i;
  }
  if (replays_here()) {
    EXPECT_EQ(accumulate.stats().replays, 5) << accumulate.stats().reason;
  }
}

// A step that leaves an assign_later pending when it returns (batch norm in a forward-only step,
// or a model run again after opt.step()): the end of the trace computes it once, and replays
// carry it as state.
TEST(Compile, AnAssignmentLeftPendingAtTheEndOfTheStepReplays) {
  mt::Tensor state = mt::zeros({2});
  auto step = mt::compile([&](const mt::Tensor& x) {
    state.assign_later(state + x);
    return x * 2.0;
  });
  for (int i = 1; i <= 6; ++i) {
    mt::Tensor y = step(mt::ones({2}));
    EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{2, 2}));
    EXPECT_EQ(state.to_vector<float>(), (std::vector<float>(2, static_cast<float>(i)))) << i;
  }
  EXPECT_TRUE(replayed_at_least(step, 3));
}

// A module whose buffers hold running statistics, written with assign() inside the step: an
// average, a counter, and a view of a value the step also stores (a keepdim mean reshaped).
struct RunningStats : mt::Module {
  mt::Generator gen{17};
  mt::Linear fc{6, 4, true, &gen};
  mt::Tensor running_mean, last_mean, count;
  RunningStats() {
    register_module("fc", fc);
    running_mean = register_buffer("running_mean", mt::zeros({4}));
    last_mean = register_buffer("last_mean", mt::zeros({4}));
    count = register_buffer("count", mt::zeros({}, mt::i64));
  }
  mt::Tensor operator()(const mt::Tensor& x) {
    mt::Tensor h = fc(x);
    mt::Tensor mean = h.mean({0}, true);
    // The detached mean is alive while the assign evaluates its view, so both are stored.
    last_mean.assign(mean.detach().reshape({4}));
    running_mean.assign(running_mean * 0.9 + last_mean * 0.1);
    count.assign(count + 1);
    return h - mean;
  }
};

TEST(Compile, BuffersAssignedInsideTheStepReplayLikeOptimizerState) {
  struct Run {
    RunningStats net;
    mt::SGD opt{net.parameters(), mt::SGDOptions{.lr = 0.05, .momentum = 0.9}};
    mt::Tensor step(const mt::Tensor& x) {
      opt.zero_grad();
      mt::Tensor loss = mt::square(net(x)).mean();
      loss.backward();
      opt.step();
      return loss;
    }
  };
  Run plain_run, compiled_run;
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled_run.step(x); });
  mt::Generator data(3);
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 10; ++i) {
    mt::Tensor x = mt::randn({8, 6}, mt::f32, &data) + 0.1 * i;
    mt::eval({x});
    plain.push_back(f32_bits(plain_run.step(x))[0]);
    compiled.push_back(f32_bits(step(x))[0]);
  }
  EXPECT_EQ(plain, compiled);
  for (const auto& [name, value] : plain_run.net.named_buffers()) {
    mt::Tensor other;
    for (const auto& [n, v] : compiled_run.net.named_buffers())
      if (n == name) other = v;
    EXPECT_EQ(f32_bits(value), f32_bits(other)) << name;
  }
  EXPECT_EQ(compiled_run.net.count.item(), 10);
  EXPECT_TRUE(replayed_at_least(step, 7));
}

// A BatchNorm2d updates its running statistics and batch count inside the step's graph: each
// replay updates them exactly as tracing the loop every step does.
TEST(Compile, BatchNormRunningStatisticsUpdateOnEveryReplay) {
  struct Run {
    mt::Generator gen{23};
    mt::Sequential net;
    mt::BatchNorm2d* bn;
    std::unique_ptr<mt::SGD> opt;
    Run() {
      bn = &net.emplace_back<mt::BatchNorm2d>(3);
      net.append([](const mt::Tensor& x) { return mt::relu(x); });
      net.emplace_back<mt::MaxPool2d>(2);
      net.emplace_back<mt::Flatten>();
      net.emplace_back<mt::Linear>(12, 2, true, &gen);
      opt =
          std::make_unique<mt::SGD>(net.parameters(), mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
    }
    mt::Tensor step(const mt::Tensor& x, const mt::Tensor& y) {
      opt->zero_grad();
      mt::Tensor loss = mt::mse_loss(net(x), y);
      loss.backward();
      opt->step();
      return loss;
    }
  };
  Run plain_run, compiled_run;
  auto step = mt::compile(
      [&](const mt::Tensor& x, const mt::Tensor& y) { return compiled_run.step(x, y); });
  mt::Generator data(4);
  mt::Tensor target = mt::randn({6, 2}, mt::f32, &data);
  std::vector<uint32_t> plain, compiled;
  std::vector<std::vector<uint32_t>> plain_means;
  for (int i = 0; i < 10; ++i) {
    mt::Tensor x = mt::randn({6, 3, 4, 4}, mt::f32, &data) * (1.0 + 0.2 * i) + 0.1 * i;
    mt::eval({x});
    plain.push_back(f32_bits(plain_run.step(x, target))[0]);
    compiled.push_back(f32_bits(step(x, target))[0]);
    // The statistics move every step (the batches differ), in both runs alike.
    EXPECT_EQ(f32_bits(plain_run.bn->running_mean), f32_bits(compiled_run.bn->running_mean)) << i;
    EXPECT_EQ(f32_bits(plain_run.bn->running_var), f32_bits(compiled_run.bn->running_var)) << i;
    plain_means.push_back(f32_bits(plain_run.bn->running_mean));
  }
  EXPECT_EQ(plain, compiled);
  EXPECT_NE(plain_means[8], plain_means[9]);
  for (const auto& [name, value] : plain_run.net.state_dict()) {
    mt::Tensor other;
    for (const auto& [n, v] : compiled_run.net.state_dict())
      if (n == name) other = v;
    EXPECT_EQ(f32_bits(value), f32_bits(other)) << name;
  }
  EXPECT_EQ(compiled_run.bn->num_batches_tracked.item(), 10);
  EXPECT_TRUE(replayed_at_least(step, 7));
}

// A result fed back as the next call's argument (a recurrent state) is an argument like any
// other; an exception inside the function reaches the caller and leaves it usable.
TEST(Compile, ResultsFedBackAsArgumentsAndErrorsPassThrough) {
  mt::Generator gen(8);
  mt::Tensor w = mt::randn({6, 6}, mt::f32, &gen) * 0.3;
  mt::Tensor x = mt::randn({2, 6}, mt::f32, &gen);
  mt::eval({w, x});
  bool fail_now = false;
  auto cell = mt::compile([&](const mt::Tensor& h) {
    if (fail_now) mt::fail("the function failed on purpose");
    return mt::tanh(mt::matmul(h, w) + x);
  });
  mt::Tensor traced = mt::zeros({2, 6}), replayed = mt::zeros({2, 6});
  for (int i = 0; i < 8; ++i) {
    traced = mt::tanh(mt::matmul(traced, w) + x);
    replayed = cell(replayed);
    EXPECT_EQ(f32_bits(traced), f32_bits(replayed)) << i;
  }
  EXPECT_TRUE(replayed_at_least(cell, 5));
  // A new shape traces; the error inside propagates and nothing is recorded.
  fail_now = true;
  EXPECT_THROW(cell(mt::zeros({3, 6})), mt::Error);
  fail_now = false;
  EXPECT_EQ(f32_bits(cell(replayed)), f32_bits(mt::tanh(mt::matmul(replayed, w) + x)));
}

// Every parameter here gets its gradient from several uses (the model runs twice per backward
// pass, and the tied weight is used twice per run), so backward sums several terms for each
// leaf, and a second backward pass adds to each gradient. The order it did both in once came
// from a hash map keyed by node address, which differs between calls: the graph of one call
// then differed from the next's now and then, and mt::compile traced again. Fresh runs each plan at
// their third call (the first also creates the step count) and replay every call after it, bit for
// bit what tracing every call computes.
struct TwiceTied : mt::Module {
  mt::Linear first, second;
  mt::Tensor head;
  explicit TwiceTied(mt::Generator* gen) : first(8, 8, true, gen), second(8, 8, true, gen) {
    register_module("first", first);
    register_module("second", second);
    head = register_parameter("head", second.weight);
  }
  mt::Tensor operator()(const mt::Tensor& x) const {
    return mt::matmul(second(mt::tanh(first(x))), head);
  }
};

TEST(Compile, AStepWithParametersUsedSeveralTimesIsTracedTheSameEveryCall) {
  struct Run {
    mt::Generator gen{5};
    TwiceTied net{&gen};
    mt::SGD opt{net.parameters(), mt::SGDOptions{.lr = 1e-3}};
    mt::Tensor step(const mt::Tensor& x) {
      opt.zero_grad();
      mt::Tensor loss = mt::sum(net(x) * net(x));
      loss.backward();
      // A second micro-batch adds its gradients to those of the first, parameter by parameter.
      mt::Tensor half = x * 0.5;
      mt::sum(net(half) * net(half)).backward();
      opt.step();
      return loss;
    }
  };
  mt::Generator data(6);
  mt::Tensor x = mt::randn({4, 8}, mt::f32, &data);
  mt::eval({x});
  const int calls = 5;
  for (int run = 0; run < 12; ++run) {
    Run plain_run, compiled_run;
    auto step = mt::compile([&](const mt::Tensor& a) { return compiled_run.step(a); });
    std::vector<uint32_t> plain, compiled;
    for (int i = 0; i < calls; ++i) {
      plain.push_back(f32_bits(plain_run.step(x))[0]);
      compiled.push_back(f32_bits(step(x))[0]);
    }
    ASSERT_EQ(plain, compiled) << "run " << run;
    for (size_t i = 0; i < plain_run.opt.params().size(); ++i)
      ASSERT_EQ(f32_bits(plain_run.opt.params()[i]), f32_bits(compiled_run.opt.params()[i]))
          << "run " << run << ", parameter " << i;
    if (replays_here()) {
      ASSERT_EQ(step.stats().traces, 2) << "run " << run << ": " << step.stats().reason;
      ASSERT_EQ(step.stats().replays, calls - 2) << "run " << run;
    }
  }
}

// ---- learning-rate schedules as graph values, and the optimizers whose state is not all of
// the parameter's shape ----

// An MLP whose optimizer is made by `make` (so that every kind can be compared).
struct ScheduledRun {
  mt::Generator gen{5};
  mt::MLP model{{6, 16, 3}, mt::Activation::Tanh, &gen};
  std::unique_ptr<mt::Optimizer> opt;
  mt::Tensor x = mt::randn({32, 6}, mt::f32, &gen);
  mt::Tensor y = mt::randn({32, 3}, mt::f32, &gen);

  explicit ScheduledRun(
      const std::function<std::unique_ptr<mt::Optimizer>(std::vector<mt::Tensor>)>& make)
      : opt(make(model.parameters())) {}
  mt::Tensor step(const mt::Tensor& input) {
    opt->zero_grad();
    mt::Tensor loss = mt::mse_loss(model(input), y);
    loss.backward();
    opt->step();
    return loss;
  }
  mt::Tensor batch(int i) const { return x * (1.0 + 0.02 * i); }
};

using MakeOptimizer = std::function<std::unique_ptr<mt::Optimizer>(std::vector<mt::Tensor>)>;

// Runs `steps` steps traced and under mt::compile, expects the same bits in both and one plan
// replayed, and hands the compiled run to `check`.
void expect_replays_match_tracing(const MakeOptimizer& make, int steps,
                                  const std::function<void(ScheduledRun&)>& check) {
  ScheduledRun plain_run(make), compiled_run(make);
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled_run.step(x); });
  Snapshot plain, compiled;
  for (int i = 0; i < steps; ++i) {
    plain.losses.push_back(f32_bits(plain_run.step(plain_run.batch(i)))[0]);
    compiled.losses.push_back(f32_bits(step(compiled_run.batch(i)))[0]);
  }
  snapshot_model(plain, plain_run.model, *plain_run.opt);
  snapshot_model(compiled, compiled_run.model, *compiled_run.opt);
  EXPECT_EQ(plain, compiled);
  EXPECT_EQ(compiled.steps, steps);
  check(compiled_run);
  if (replays_here()) {
    EXPECT_EQ(step.stats().plans, 1) << step.stats().reason;
    EXPECT_GE(step.stats().replays, steps - 3) << step.stats().reason;
  }
}

std::shared_ptr<const mt::LRSchedule> warmup_then_steps() {
  return std::make_shared<mt::SequentialLR>(
      std::vector<std::shared_ptr<const mt::LRSchedule>>{
          std::make_shared<mt::LinearLR>(2e-2, 0.2, 1.0, 3),
          std::make_shared<mt::StepLR>(2e-2, 2, 0.5)},
      std::vector<int64_t>{3});
}

// Nothing is set between calls: the rate is computed inside the step from the optimizer's step
// count, so replays advance it, bit for bit as tracing every step does; Lion and Adafactor (its
// factored row and column state) replay the same way, with and without a schedule.
TEST(Compile, SchedulesAndTheNewOptimizersReplayBitForBit) {
  const std::pair<const char*, MakeOptimizer> kinds[] = {
      {"AdamW + schedule",
       [](std::vector<mt::Tensor> p) {
         auto opt = std::make_unique<mt::AdamW>(std::move(p));
         opt->set_schedule(warmup_then_steps());
         return opt;
       }},
      {"Lion + schedule",
       [](std::vector<mt::Tensor> p) {
         auto opt = std::make_unique<mt::Lion>(std::move(p), mt::LionOptions{.weight_decay = 0.1});
         opt->set_schedule(warmup_then_steps());
         return opt;
       }},
      {"AdamW groups: the matrices scheduled, the vectors at a set rate without decay",
       [](std::vector<mt::Tensor> p) {
         std::vector<mt::ParamGroup<mt::AdamOptions>> groups(2);
         for (mt::Tensor& t : p) groups[t.dim() > 1 ? 0 : 1].params.push_back(t);
         groups[1].options = {.lr = 3e-3, .weight_decay = 0};
         auto opt = std::make_unique<mt::AdamW>(std::move(groups));
         opt->set_schedule(0, warmup_then_steps());
         return opt;
       }},
      {"Adafactor relative_step",
       [](std::vector<mt::Tensor> p) {
         return std::make_unique<mt::Adafactor>(std::move(p), mt::AdafactorOptions{.beta1 = 0.9});
       }},
      {"Adafactor + schedule",
       [](std::vector<mt::Tensor> p) {
         auto opt = std::make_unique<mt::Adafactor>(
             std::move(p), mt::AdafactorOptions{.lr = 1e-2, .relative_step = false});
         opt->set_schedule(std::make_shared<mt::OneCycleLR>(0.05, 10));
         return opt;
       }},
  };
  const int steps = 10;
  for (const auto& [name, make] : kinds) {
    SCOPED_TRACE(name);
    expect_replays_match_tracing(make, steps, [&](ScheduledRun& run) {
      // The rate moved with the replays.
      if (run.opt->schedule()) {
        EXPECT_EQ(run.opt->current_lr().item(), run.opt->schedule()->lr(steps));
      }
    });
  }
}

// OneCycleLR's cycle_momentum is graph code too: replays move SGD's momentum and Adam's and
// Lion's beta1 with the step count, bit for bit as tracing every step does, and the momentum
// reached is the schedule's closed form at that step.
TEST(Compile, OneCycleMomentumReplaysBitForBit) {
  const std::pair<const char*, MakeOptimizer> kinds[] = {
      {"SGD",
       [](std::vector<mt::Tensor> p) {
         auto opt = std::make_unique<mt::SGD>(std::move(p), mt::SGDOptions{.lr = 0.05});
         opt->set_schedule(std::make_shared<mt::OneCycleLR>(0.05, 10));
         return opt;
       }},
      {"AdamW",
       [](std::vector<mt::Tensor> p) {
         auto opt = std::make_unique<mt::AdamW>(std::move(p));
         opt->set_schedule(
             std::make_shared<mt::OneCycleLR>(1e-2, 10, mt::OneCycleOptions{.base_momentum = 0.6}));
         return opt;
       }},
      {"Lion",
       [](std::vector<mt::Tensor> p) {
         auto opt = std::make_unique<mt::Lion>(std::move(p));
         opt->set_schedule(std::make_shared<mt::OneCycleLR>(1e-3, 10));
         return opt;
       }},
  };
  const int steps = 8;
  for (const auto& [name, make] : kinds) {
    SCOPED_TRACE(name);
    expect_replays_match_tracing(make, steps, [&](ScheduledRun& run) {
      mt::Tensor momentum = run.opt->current_momentum();
      ASSERT_TRUE(momentum.defined());
      EXPECT_EQ(momentum.item(), *run.opt->schedule()->momentum(steps));
      EXPECT_NE(momentum.item(), *run.opt->schedule()->momentum(0)) << "it moved";
    });
  }
}

// multinomial checks its weights inside the graph: a replay of a compiled sampler refuses a
// negative or NaN weight or an all-zero row with an mt::Error, as eager evaluation does, and
// draws as tracing does while they are fine.
TEST(Compile, MultinomialChecksItsWeightsInReplays) {
  mt::Generator gen_compiled(3), gen_plain(3);
  auto sample = [](const mt::Tensor& w, mt::Generator* gen) {
    return mt::multinomial(w * 1.0, 4, true, gen);
  };
  auto step = mt::compile([&](const mt::Tensor& w) { return sample(w, &gen_compiled); });
  mt::Tensor good = mt::tensor(std::vector<float>{0.5, 1.0, 0.0, 2.0, 0.25, 0.25}, {2, 3});
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(step(good).to_vector<int64_t>(), sample(good, &gen_plain).to_vector<int64_t>());
  EXPECT_TRUE(replayed_at_least(step, 2));
  const float nan = std::nanf("");
  for (const std::vector<float>& bad : {std::vector<float>{0.5, -1.0, 0.0, 2.0, 0.25, 0.25},
                                        std::vector<float>{0.5, 1.0, 0.0, nan, 0.25, 0.25},
                                        std::vector<float>{0.5, 1.0, 0.0, 0.0, 0.0, 0.0}})
    EXPECT_THROW(step(mt::tensor(bad, {2, 3})).to_vector<int64_t>(), mt::Error);
}

// A schedule attached or replaced between calls is followed (the step traces again), and set_lr
// is refused while one is attached: the schedule would override it.
TEST(Compile, AScheduleChangedOutsideTheStepIsFollowed) {
  auto make = [](std::vector<mt::Tensor> p) -> std::unique_ptr<mt::Optimizer> {
    return std::make_unique<mt::SGD>(std::move(p), mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
  };
  ScheduledRun plain_run(make), compiled_run(make);
  auto step = mt::compile([&](const mt::Tensor& x) { return compiled_run.step(x); });
  std::vector<uint32_t> plain, compiled;
  for (int i = 0; i < 12; ++i) {
    if (i == 4 || i == 8) {
      std::shared_ptr<const mt::LRSchedule> schedule =
          i == 4 ? warmup_then_steps() : std::make_shared<mt::ExponentialLR>(0.05, 0.7);
      plain_run.opt->set_schedule(schedule);
      compiled_run.opt->set_schedule(schedule);
    }
    plain.push_back(f32_bits(plain_run.step(plain_run.batch(i)))[0]);
    compiled.push_back(f32_bits(step(compiled_run.batch(i)))[0]);
  }
  EXPECT_EQ(plain, compiled);
  Snapshot a, b;
  snapshot_model(a, plain_run.model, *plain_run.opt);
  snapshot_model(b, compiled_run.model, *compiled_run.opt);
  EXPECT_EQ(a, b);
  // The schedule's pow runs in the device's math library: the same bits as the traced run's,
  // within an ulp of the host's.
  EXPECT_EQ(compiled_run.opt->current_lr().item(), plain_run.opt->current_lr().item());
  EXPECT_DOUBLE_EQ(compiled_run.opt->current_lr().item(), 0.05 * std::pow(0.7, 12));
  if (replays_here()) {
    EXPECT_EQ(step.stats().plans, 3) << step.stats().reason;
  }
  EXPECT_THROW(compiled_run.opt->set_lr(0.1), mt::Error);
  compiled_run.opt->set_schedule(nullptr);
  compiled_run.opt->set_lr(0.1);
  EXPECT_EQ(compiled_run.opt->current_lr().item(), 0.1);
}

// `body(run, kept, x, y)` traced every call on one MlpRun and its `Kept` tensors, and through
// mt::compile on another, `calls` times: the returned losses and every tensor `tensors(kept)`
// lists equal bit for bit after each call. The compiled step's statistics.
template <typename Kept, typename Body, typename Tensors>
mt::CompileStats compare_assigning_step(Body body, Tensors tensors, int calls) {
  MlpRun plain_run, compiled_run;
  Kept plain_kept, compiled_kept;
  auto step = mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) {
    return body(compiled_run, compiled_kept, x, y);
  });
  for (int i = 0; i < calls; ++i) {
    SCOPED_TRACE(testing::Message() << "call " << i);
    EXPECT_EQ(f32_bits(body(plain_run, plain_kept, plain_run.batch(i), plain_run.y)),
              f32_bits(step(compiled_run.batch(i), compiled_run.y)));
    const std::vector<mt::Tensor> plain = tensors(plain_kept), compiled = tensors(compiled_kept);
    for (size_t t = 0; t < plain.size(); ++t)
      EXPECT_EQ(f32_bits(plain[t]), f32_bits(compiled[t])) << "kept tensor " << t;
  }
  return step.stats();
}

// Copies of the weights the step updates, taken with assign inside the step (the weights before
// the update, kept for a later comparison): each call's copies hold what tracing gives them. A
// replay hands an assigned tensor its value by writing that value's buffer again, which a weight
// from before the call is not (nor a view of one, which shares the weight's buffer): such a step
// traces every call.
TEST(Compile, CopiesOfWeightsTakenInsideTheStepHoldWhatTracingGives) {
  struct Copies {
    mt::Tensor weight = mt::zeros({32, 8}), detached = mt::zeros({32}), flat = mt::zeros({256});
  };
  const mt::CompileStats stats = compare_assigning_step<Copies>(
      [](MlpRun& run, Copies& c, const mt::Tensor& x, const mt::Tensor& y) {
        std::vector<mt::Tensor> params = run.model.parameters();
        c.weight.assign(params[0]);
        c.detached.assign(params[1].detach());
        c.flat.assign(params[0].reshape({-1}));
        return run.step(x, y);
      },
      [](const Copies& c) {
        return std::vector<mt::Tensor>{c.weight, c.detached, c.flat};
      },
      6);
  if (replays_here()) {
    EXPECT_EQ(stats.replays, 0);
    EXPECT_NE(stats.reason.find("did not compute"), std::string::npos) << stats.reason;
  }
}

// Values the step computes and assigns (a statistic of the batch, the weights before the update
// as the step's own copy, a constant filled in, the loss detached) are written again by each
// replay, before the optimizer's update or after it.
TEST(Compile, ValuesComputedInsideTheStepAndAssignedReplay) {
  struct Kept {
    mt::Tensor gram = mt::zeros({8, 8}), weight = mt::zeros({32, 8}), last = mt::zeros({});
    mt::Tensor filled = mt::zeros({4});
  };
  const mt::CompileStats stats = compare_assigning_step<Kept>(
      [](MlpRun& run, Kept& k, const mt::Tensor& x, const mt::Tensor& y) {
        k.gram.assign(mt::matmul(x.transpose(0, 1), x));
        k.weight.assign(run.model.parameters()[0] * 1.0);
        k.filled.assign(mt::full({4}, 3.0));
        mt::Tensor loss = run.step(x, y);
        k.last.assign(loss.detach());
        return loss;
      },
      [](const Kept& k) {
        return std::vector<mt::Tensor>{k.gram, k.weight, k.last, k.filled};
      },
      8);
  if (replays_here()) {
    EXPECT_GE(stats.replays, 5) << stats.reason;
  }
}

// A value the step both assigns and returns (the last loss kept in a member): a replay returns
// each result in a buffer of its own, so the kept tensor would stay at the trace's value. Such a
// step traces every call, and the kept loss follows each call's.
TEST(Compile, AValueAssignedAndReturnedFollowsEachCall) {
  struct Kept {
    mt::Tensor last = mt::zeros({});
  };
  const mt::CompileStats stats = compare_assigning_step<Kept>(
      [](MlpRun& run, Kept& k, const mt::Tensor& x, const mt::Tensor& y) {
        mt::Tensor loss = run.step(x, y);
        k.last.assign(loss);
        return loss;
      },
      [](const Kept& k) { return std::vector<mt::Tensor>{k.last}; }, 6);
  if (replays_here()) {
    EXPECT_EQ(stats.replays, 0);
    EXPECT_NE(stats.reason.find("also returns"), std::string::npos) << stats.reason;
  }
}

// A detached copy of a parameter keeps its value while mt::compile's replays update the
// parameter in place: a stop_gradient is a copy, not a buffer shared as a reshape's is.
TEST(Compile, ADetachedParameterKeepsItsValueThroughReplays) {
  mt::Generator gen(3);
  mt::Linear fc(8, 4, true, &gen);
  mt::SGD opt(fc.parameters(), {.lr = 0.1, .momentum = 0.9});
  mt::Tensor x = mt::randn({5, 8}, mt::f32, &gen);
  auto step = mt::compile([&](const mt::Tensor& in) {
    opt.zero_grad();
    mt::Tensor loss = mt::sum(mt::square(fc(in)));
    loss.backward();
    opt.step();
    return loss;
  });
  for (int s = 0; s < 3; ++s) mt::eval({step(x)});
  mt::Tensor copy = fc.weight.detach();
  std::vector<float> before = copy.to_vector<float>();
  for (int s = 0; s < 4; ++s) mt::eval({step(x)});
  if (mt::current_device() != mt::Device::reference) {  // which has no programs to replay
    EXPECT_GE(step.stats().replays, 4);
  }
  EXPECT_EQ(copy.to_vector<float>(), before);
  EXPECT_NE(fc.weight.to_vector<float>(), before);
}

// One tensor passed as two arguments was one input of the trace's programs, which a later call
// with two tensors replayed: |x - y| summed to 0.
TEST(Compile, OneTensorAsTwoArgumentsIsNotReplayedForTwo) {
  auto distance =
      mt::compile([](const mt::Tensor& a, const mt::Tensor& b) { return mt::sum(mt::abs(a - b)); });
  mt::Tensor x = mt::full({4}, 1.0), y = mt::full({4}, 3.0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(distance(x, x).item(), 0.0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(distance(x, y).item(), 8.0) << i;
  EXPECT_TRUE(replayed_at_least(distance, 2));
}

// A replay wrote the value into the tensor the trace assigned: an argument assigned is another
// tensor from call to call (traced on every call), and so is a captured one that changes (ping-
// pong buffers: no plan).
TEST(Compile, AssignmentsGoToTheTensorOfEachCall) {
  auto update =
      mt::compile([](const mt::Tensor& x, mt::Tensor acc) { acc.assign(acc * 0.5 + mt::sum(x)); });
  mt::Tensor a = mt::zeros({}), b = mt::zeros({}), x = mt::ones({2});
  for (mt::Tensor* target : {&a, &b, &a, &a, &b}) update(x, *target);
  EXPECT_EQ(a.item(), 3.5);  // 2, 3, 3.5
  EXPECT_EQ(b.item(), 3.0);  // 2, 3
  if (replays_here()) {
    EXPECT_NE(update.stats().reason.find("passed as an argument"), std::string::npos)
        << update.stats().reason;
  }
  std::vector<mt::Tensor> buffers = {mt::zeros({}), mt::zeros({})};
  int call = 0;
  auto ping_pong = mt::compile([&](const mt::Tensor& x) {
    mt::Tensor& target = buffers[call++ % 2];
    target.assign(target + mt::sum(x));
  });
  for (int i = 0; i < 6; ++i) ping_pong(x);
  EXPECT_EQ(buffers[0].item(), 6.0);
  EXPECT_EQ(buffers[1].item(), 6.0);
}

// What the caller sets around a compiled call, which the trace read: a module's train()/eval()
// setting (dropout kept dropping in eval), the autocast policy and the grad mode.
TEST(Compile, SettingsAroundTheCallAreFollowed) {
  mt::Dropout dropout(0.5);
  auto total = mt::compile([&](const mt::Tensor& x) { return mt::sum(dropout(x)); });
  mt::Tensor x = mt::full({1000}, 1.0);
  for (int i = 0; i < 3; ++i) EXPECT_NE(total(x).item(), 1000.0);
  dropout.eval();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(total(x).item(), 1000.0) << i;
  dropout.train();
  EXPECT_NE(total(x).item(), 1000.0);

  mt::Linear fc(8, 4);
  auto forward = mt::compile([&](const mt::Tensor& in) {
    mt::NoGradGuard inference;  // a result that requires grad is traced every call
    return fc(in);
  });
  mt::Tensor in = mt::full({2, 8}, 0.3);
  auto eager = [&](bool autocast) {
    std::optional<mt::autocast> guard;
    if (autocast) guard.emplace(mt::bf16);
    return fc(in).to_vector<float>();
  };
  const std::vector<float> f32 = eager(false), bf16 = eager(true);
  ASSERT_NE(f32, bf16);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(forward(in).to_vector<float>(), f32);
  for (int i = 0; i < 3; ++i) {
    mt::autocast guard(mt::bf16);  // a policy object of its own every call
    EXPECT_EQ(forward(in).to_vector<float>(), bf16) << i;
  }
  EXPECT_TRUE(replayed_at_least(forward, 2));
  // A training step called under no_grad: its backward has nothing to differentiate, as when
  // traced, and the weights stay.
  mt::SGD opt(fc.parameters(), mt::SGDOptions{.lr = 0.1});
  auto train = mt::compile([&](const mt::Tensor& batch) {
    opt.zero_grad();
    mt::Tensor loss = mt::sum(fc(batch));
    loss.backward();
    opt.step();
    return loss;
  });
  for (int i = 0; i < 3; ++i) train(in);
  const std::vector<float> weights = fc.weight.to_vector<float>();
  {
    mt::NoGradGuard no_grad;
    EXPECT_THROW(train(in), mt::Error);
  }
  EXPECT_EQ(fc.weight.to_vector<float>(), weights);
}

// A linear layer's inference, compiled, and run under a policy compiled or eagerly.
struct ForwardUnderPolicies {
  mt::Linear fc{8, 4};
  mt::Tensor in = mt::full({2, 8}, 0.37);
  using Function = std::function<mt::Tensor(const mt::Tensor&)>;
  mt::Compiled<Function> forward = mt::compile(Function([this](const mt::Tensor& x) {
    mt::NoGradGuard inference;
    return fc(x);
  }));
  std::vector<float> under(const mt::PolicyPtr& policy, bool compiled) {
    mt::autocast guard(policy);
    if (compiled) return forward(in).to_vector<float>();
    mt::NoGradGuard inference;
    return fc(in).to_vector<float>();
  }
};

// Two policies of one name (every OverridePolicy on fp32 is "fp32+overrides") replayed each
// other's program: the key held the policy's name. A policy changed between calls (a rule
// added) made no new trace either. Both run as the traced loop does now.
TEST(Compile, EachPolicyAndEachEditOfOneIsTracedAnew) {
  ForwardUnderPolicies f;
  auto under = [&f](const mt::PolicyPtr& policy, bool compiled) {
    return f.under(policy, compiled);
  };
  auto f16_matmul = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  f16_matmul->op(mt::OpCode::MatMul, mt::autocast_policy(mt::f16));
  auto f32_matmul = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  f32_matmul->op(mt::OpCode::MatMul, mt::fp32_policy());
  ASSERT_EQ(f16_matmul->name(), f32_matmul->name());
  const std::vector<float> f16 = under(f16_matmul, false), f32 = under(f32_matmul, false);
  ASSERT_NE(f16, f32);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(under(f16_matmul, true), f16) << i;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(under(f32_matmul, true), f32) << i;
  EXPECT_TRUE(replayed_at_least(f.forward, 2));
  // An override added to a policy after its replays (its f16 matmul is traced anew) ...
  auto edited = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(under(edited, true), f32) << i;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(under(edited, false), f32) << i;  // answers cached
  edited->op(mt::OpCode::MatMul, mt::autocast_policy(mt::f16));
  EXPECT_EQ(under(edited, false), f16);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(under(edited, true), f16) << i;
  // ... and to a policy another one delegates to.
  auto inner = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  auto outer = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  outer->op(mt::OpCode::MatMul, inner);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(under(outer, true), f32) << i;
  inner->op(mt::OpCode::MatMul, mt::autocast_policy(mt::f16));
  EXPECT_EQ(under(outer, false), f16);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(under(outer, true), f16) << i;
}

// A policy built (given its rules) but not yet in use changes no answer: building one between
// steps, or inside each step (mt::autocast guard(make_policy())), made every call trace anew and
// keep one more trace, for good.
TEST(Compile, PoliciesBuiltBetweenStepsKeepTheStepReplaying) {
  mt::Linear fc(8, 4);
  mt::SGD opt(fc.parameters(), {.lr = 0.01});
  mt::Tensor in = mt::full({2, 8}, 0.37);
  auto step = mt::compile([&](const mt::Tensor& x) {
    opt.zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(mt::bf16);
      loss = mt::sum(fc(x));
    }
    loss.backward();
    opt.step();
    return loss;
  });
  for (int i = 0; i < 8; ++i) {
    step(in);
    auto unused = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
    unused->module("head", mt::fp32_policy()).op(mt::OpCode::MatMul, mt::fp32_policy());
  }
  EXPECT_TRUE(replayed_at_least(step, 5)) << step.stats().reason;
}

// A policy that another asks only inside a rule() is never current, but in use from its first
// answer: an edit to it after that made no new trace, and the step replayed the old precision.
TEST(Compile, AnEditToAPolicyAskedInsideARuleIsTracedAnew) {
  ForwardUnderPolicies f;
  auto inner = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  auto outer = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  outer->rule("ask inner", [inner](const mt::PrecisionQuery& q) -> std::optional<mt::Precision> {
    return inner->decide(q);
  });
  auto run = [&](bool compiled) { return f.under(outer, compiled); };
  const std::vector<float> f32 = run(false);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(run(true), f32) << i;
  inner->op(mt::OpCode::MatMul, mt::autocast_policy(mt::f16));
  const std::vector<float> f16 = run(false);
  ASSERT_NE(f16, f32);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(run(true), f16) << i;
}

// A forward compiled alone, differentiated outside: a replay's results have no graph, so from
// the third call on backward() found nothing to differentiate (or, beside another trainable
// term, silently left the compiled part's parameters without gradients). It is traced every call.
TEST(Compile, AForwardDifferentiatedOutsideKeepsItsGradients) {
  mt::Linear fc(4, 2);
  auto forward = mt::compile([&](const mt::Tensor& x) { return fc(x); });
  mt::Tensor x = mt::full({3, 4}, 0.5);
  for (int i = 0; i < 4; ++i) {
    fc.weight.zero_grad();
    mt::Tensor out = forward(x);
    ASSERT_TRUE(out.requires_grad()) << i;
    mt::sum(out).backward();
    ASSERT_TRUE(fc.weight.grad().defined()) << i;
    EXPECT_EQ(mt::sum(fc.weight.grad()).item(), 12.0) << i;  // 3 rows of 0.5, 4 inputs, 2 outputs
  }
  if (replays_here()) {
    EXPECT_EQ(forward.stats().replays, 0);
    EXPECT_NE(forward.stats().reason.find("requires grad"), std::string::npos)
        << forward.stats().reason;
  }
}

// A tensor passed as the argument in both traced calls that the function also reads captured is
// one input node for both: the plan bound it to the argument, so a call with another tensor
// replaced the captured one too (sum(2 d + d) instead of sum(2 d + c)). Such a call traces again.
TEST(Compile, AnArgumentThatIsAlsoCapturedIsNotReplacedByTheNextOne) {
  mt::Tensor c = mt::tensor(std::vector<float>{1, 2, 3, 4}, {4});
  mt::Tensor d = mt::tensor(std::vector<float>{10, 20, 30, 40}, {4});
  auto plain = [&](const mt::Tensor& x) { return mt::sum(x * 2.0 + c); };
  auto f = mt::compile(plain);
  // The reference executor traces every call: the values are checked there too.
  const bool replays = mt::current_device() != mt::Device::reference;
  for (int call = 0; call < 3; ++call) EXPECT_EQ(f(c).item(), 30.0);
  EXPECT_TRUE(!replays || f.stats().replays > 0);
  EXPECT_EQ(f(d).item(), 210.0);
  EXPECT_TRUE(!replays || f.stats().reason.find("another tensor now") != std::string::npos)
      << f.stats().reason;
  for (int call = 0; call < 3; ++call) EXPECT_EQ(f(d).item(), 210.0);
  EXPECT_EQ(f(c).item(), 30.0);
  // The same tensor every call (full-batch training) still replays.
  const int64_t before = f.stats().replays;
  for (int call = 0; call < 3; ++call) EXPECT_EQ(f(c).item(), 30.0);
  EXPECT_TRUE(!replays || f.stats().replays > before);
}

// Each batch passed to two calls in a row (several passes over one minibatch, SAM, a GAN's
// sub-steps): the pair of calls on one batch made a pinned plan that the next batch dropped,
// every batch. After one such drop the plan waits for two calls on different tensors, and then
// replays every call.
TEST(Compile, EachBatchPassedToTwoCallsReplays) {
  mt::Generator gen(3);
  mt::Linear plain_layer(4, 2, true, &gen);
  mt::Generator gen2(3);
  mt::Linear layer(4, 2, true, &gen2);
  mt::SGD plain_opt(plain_layer.parameters(), {.lr = 0.1}), opt(layer.parameters(), {.lr = 0.1});
  auto step_of = [](mt::Linear& l, mt::SGD& o) {
    return [&l, &o](const mt::Tensor& x) {
      o.zero_grad();
      mt::Tensor loss = mt::sum(mt::square(l(x)));
      loss.backward();
      o.step();
      return std::vector<mt::Tensor>{loss};
    };
  };
  auto plain = step_of(plain_layer, plain_opt);
  auto compiled = mt::compile(step_of(layer, opt));
  mt::Generator data(4);
  for (int batch = 0; batch < 10; ++batch) {
    mt::Tensor x = mt::randn({3, 4}, mt::f32, &data);
    for (int pass = 0; pass < 2; ++pass)
      EXPECT_EQ(plain(x)[0].item(), compiled(x)[0].item()) << batch << " " << pass;
  }
  if (mt::current_device() != mt::Device::reference) {
    EXPECT_GE(compiled.stats().replays, 13) << compiled.stats().reason;
  }
}

}  // namespace
