// tests/gpu/test_gpu_models.cpp -- the CUDA back end against the CPU one: every pointwise op,
// reductions, matmuls, and four models trained under every built-in policy.
//
// Each test runs a program on the CPU back end (the baseline) and on the GPU (the device under
// test) from the same inputs and compares. MIXTAPE_GPU_TEST_DRY_RUN=1 runs the same checks with
// the reference executor as the baseline and the CPU back end under test, so that the tests'
// own logic and tolerances can be exercised on a machine without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "examples/char_gpt_model.h"
#include "examples/digits_model.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/conv.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/nn.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/optim.h"
#include "mixtape/dsl/sequence_layers.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/precision_policy/grad_scaler.h"
#include "mixtape/precision_policy/policy.h"
#include "mixtape/runtime/cuda_executor.h"
#include "mixtape/runtime/cudnn.h"
#include "mixtape/runtime/device.h"
#include "tests/pointwise_programs.h"
#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

bool dry_run() {
  const char* env = std::getenv("MIXTAPE_GPU_TEST_DRY_RUN");
  return env && std::string(env) == "1";
}
mt::Device baseline() { return dry_run() ? mt::Device::reference : mt::Device::cpu; }
mt::Device tested() { return dry_run() ? mt::Device::cpu : mt::Device::cuda; }

#define SKIP_WITHOUT_CUDA()                                                          \
  do {                                                                               \
    if (!dry_run() && !mt::cuda_backend_available())                                 \
      GTEST_SKIP() << "CUDA unavailable: " << mt::cuda_backend_unavailable_reason(); \
  } while (0)

// Restores the device the test started with.
class DeviceScope {
 public:
  DeviceScope() : previous_(mt::current_device()) {}
  ~DeviceScope() { mt::set_device(previous_); }

 private:
  mt::Device previous_;
};

// The result of `program` on `device`, as doubles (read through the host accessor, so a GPU
// value is downloaded here).
std::vector<double> run_on(mt::Device device, const std::function<mt::Tensor()>& program,
                           mt::DType* dtype = nullptr) {
  DeviceScope scope;
  mt::set_device(device);
  mt::Tensor result = program();
  mt::eval({result});
  if (dtype) *dtype = result.node()->precision.storage_type;
  return result.to_vector<double>();
}

// One unit in the last place of a value stored as `dtype`, relative to its magnitude.
double relative_ulp(mt::DType dtype) {
  switch (dtype) {
    case mt::f16:
      return 0x1p-10;
    case mt::bf16:
      return 0x1p-7;
    case mt::f64:
      return 0x1p-52;
    default:
      return 0x1p-23;
  }
}

// Where two results differ by more than `ulps` units of `dtype` (plus `absolute`), or "".
std::string first_difference(const std::vector<double>& expected, const std::vector<double>& actual,
                             mt::DType dtype, double ulps, double absolute = 0) {
  if (expected.size() != actual.size())
    return fmt::format("{} elements vs {}", expected.size(), actual.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    double e = expected[i], a = actual[i];
    if (std::isnan(e) && std::isnan(a)) continue;
    if (e == a) continue;
    double tolerance = ulps * relative_ulp(dtype) * std::max(std::fabs(e), std::fabs(a)) + absolute;
    if (std::isfinite(e) && std::isfinite(a) && std::fabs(e - a) <= tolerance) continue;
    return fmt::format("element {}: {} {} vs {} {}", i, mt::device_name(baseline()), e,
                       mt::device_name(tested()), a);
  }
  return "";
}

// Evaluates `outs` and returns their values; `stats`, where given, gets what ran since the last
// mt::reset_execution_stats().
std::vector<std::vector<double>> values_of(const std::vector<mt::Tensor>& outs,
                                           mt::ExecutionStats* stats) {
  mt::eval(outs);
  if (stats) *stats = mt::execution_stats();
  std::vector<std::vector<double>> values;
  for (const mt::Tensor& t : outs) values.push_back(t.to_vector<double>());
  return values;
}

// The tested device's outputs have the baseline's bits, output by output.
void expect_same_bits(const std::vector<std::vector<double>>& expected,
                      const std::vector<std::vector<double>>& actual, mt::DType dtype) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t o = 0; o < expected.size(); ++o)
    EXPECT_EQ(actual[o], expected[o]) << mt::name(dtype) << " output " << o;
}

class GpuEveryPointwiseOp : public ::testing::TestWithParam<mt::DType> {};

// Pointwise programs match the CPU bit for bit, except where they call a math library function
// that CUDA's and glibc's libraries round differently (log1pf, f64 exp, ...): an ulp or two, one
// ulp after rounding to a 16-bit type.
TEST_P(GpuEveryPointwiseOp, MatchesTheCpu) {
  SKIP_WITHOUT_CUDA();
  mt::DType dtype = GetParam();
  std::optional<mt::test::PointwiseInputs> inputs;
  {
    DeviceScope scope;
    mt::set_device(mt::Device::cpu);
    inputs.emplace(dtype, 1031);
    mt::eval({inputs->x, inputs->y, inputs->positive});
  }
  // The programs beyond the table's one-op ones, by the ops they apply.
  const std::map<std::string, std::vector<std::string>> composed = {
      {"chain", {"tanh", "sigmoid", "relu"}}, {"where", {"exp"}}, {"cast", {}}};
  auto faithful = [&](const std::string& name) {
    auto ops = composed.find(name);
    if (ops == composed.end()) return mt::test::calls_faithful_libm(name, dtype);
    return std::any_of(ops->second.begin(), ops->second.end(), [&](const std::string& op) {
      return mt::test::calls_faithful_libm(op, dtype);
    });
  };
  std::vector<mt::test::NamedProgram> programs = mt::test::pointwise_programs(*inputs, dtype);

  // The reference executor is no bit-exact stand-in for libm differences: dry runs compare
  // everything with the libm tolerance.
  for (auto& [name, program] : programs) {
    mt::DType out_dtype = dtype;
    std::vector<double> expected = run_on(baseline(), program, &out_dtype);
    std::vector<double> actual = run_on(tested(), program);
    // libm results differ by an ulp or two of an intermediate; gelu's 1 + erf(x / sqrt 2)
    // cancels for negative x, so that difference is an absolute one, a few ulps of 1.
    bool inexact = faithful(name) || dry_run();
    double ulps = inexact ? (mt::is_half(out_dtype) ? 1.01 : 4) : 0;
    double absolute = inexact ? 8 * relative_ulp(out_dtype) : 0;
    EXPECT_EQ(first_difference(expected, actual, out_dtype, ulps, absolute), "")
        << name << " in " << mt::name(dtype) << " (" << ulps << " ulps + " << absolute
        << " allowed)";
  }
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuEveryPointwiseOp,
                         ::testing::Values(mt::f32, mt::f16, mt::bf16, mt::f64),
                         [](const auto& info) { return std::string(mt::name(info.param)); });

// Sums are reduced in another order on the GPU: a few ulps of the sum of magnitudes.
TEST(GpuReductions, SumsMaxSoftmaxAndLayerNormMatchTheCpu) {
  SKIP_WITHOUT_CUDA();
  mt::Generator gen(5);
  mt::Tensor x = mt::randn({7, 333, 5}, mt::f32, &gen);
  mt::Tensor wide = mt::randn({3, 4099}, mt::f32, &gen);
  {
    DeviceScope scope;
    mt::set_device(mt::Device::cpu);
    mt::eval({x, wide});
  }
  std::vector<std::function<mt::Tensor()>> programs = {
      [&] { return mt::sum(x, {1}); },
      [&] {
        return mt::sum(x * x, {0, 2}, true);
      },
      [&] { return mt::max(x, {2}); },
      [&] { return mt::max(wide, {1}); },
      [&] { return mt::sum(wide, {1}); },
      [&] { return mt::softmax(x, -1); },
      [&] { return mt::softmax(wide, -1); },
      [&] { return mt::layer_norm(x, mt::Tensor(), mt::Tensor(), 1e-5); },
      [&] { return mt::layer_norm(wide, mt::Tensor(), mt::Tensor(), 1e-5); },
      [&] { return mt::mean(mt::exp(x.transpose(0, 2)), {0}); },
      [&] {
        return x.reshape({7, 1665}).sum({1});
      },
      [&] { return mt::cast(mt::softmax(mt::cast(wide, mt::bf16), -1), mt::f32); },
  };
  for (size_t p = 0; p < programs.size(); ++p) {
    mt::DType dtype = mt::f32;
    std::vector<double> expected = run_on(baseline(), programs[p], &dtype);
    std::vector<double> actual = run_on(tested(), programs[p]);
    // bf16 softmax: one bf16 ulp; f32: a few ulps of values of order one.
    EXPECT_EQ(
        first_difference(expected, actual, p == 11 ? mt::bf16 : mt::f32, p == 11 ? 1.01 : 64, 1e-5),
        "")
        << "program " << p;
  }
}

// Reductions over few outer points and many inner ones run split across blocks, the last block
// of each point folding the others' partials from a workspace every launch leaves zeroed: a
// whole-tensor sum and max of 2^20 values, bias-gradient-like column sums of a tall matrix, a
// few long rows' means; each launched three times (the same bits every time) and compared with
// the CPU up to the order of the sums: sums of order 1000 and 256 here, whose CPU sums (a
// column's 65536 terms one after another) are 1e-3 off, where a chunk lost would be 100 off.
TEST(GpuReductions, SplitAcrossBlocksMatchTheCpuAndRepeatExactly) {
  SKIP_WITHOUT_CUDA();
  mt::Generator gen(6);
  mt::Tensor big = mt::randn({1 << 20}, mt::f32, &gen);
  mt::Tensor tall = mt::cast(mt::randn({65536, 64}, mt::f32, &gen), mt::bf16);
  mt::Tensor rows = mt::randn({4, 100000}, mt::f32, &gen);
  {
    DeviceScope scope;
    mt::set_device(mt::Device::cpu);
    mt::eval({big, tall, rows});
  }
  std::vector<std::pair<std::function<mt::Tensor()>, double>> programs = {
      {[&] { return mt::sum(big); }, 1e-2},
      {[&] { return mt::max(big); }, 0},
      {[&] { return mt::sum(tall, {0}); }, 1e-2},
      {[&] { return mt::mean(rows, {1}); }, 1e-6},
  };
  for (size_t p = 0; p < programs.size(); ++p) {
    auto [program, absolute] = programs[p];
    std::vector<double> expected = run_on(baseline(), program);
    std::vector<double> actual = run_on(tested(), program);
    EXPECT_EQ(first_difference(expected, actual, mt::f32, 64, absolute), "") << "program " << p;
    for (int again = 0; again < 2; ++again)
      EXPECT_EQ(run_on(tested(), program), actual) << "program " << p << ", launch " << again + 2;
  }
}

// Matmuls: f32 operands with f32 accumulation; f16/bf16 operands with f32 accumulation, the
// result rounded once (so one ulp of the output type apart at most, plus the sum's order).
TEST(GpuMatmul, F32F16Bf16AndTransposesMatchTheCpu) {
  SKIP_WITHOUT_CUDA();
  for (mt::DType dtype : {mt::f32, mt::f16, mt::bf16}) {
    for (int transposes = 0; transposes < 4; ++transposes) {
      bool ta = transposes & 1, tb = transposes & 2;
      mt::Generator gen(7 + transposes);
      const int64_t batch = 3, m = 37, k = 129, n = 41;
      mt::Tensor a, b;
      {
        DeviceScope scope;
        mt::set_device(mt::Device::cpu);
        a = mt::cast(mt::randn(ta ? mt::Shape{batch, k, m} : mt::Shape{batch, m, k}, mt::f32, &gen),
                     dtype);
        b = mt::cast(mt::randn(tb ? mt::Shape{batch, n, k} : mt::Shape{batch, k, n}, mt::f32, &gen),
                     dtype);
        mt::eval({a, b});
      }
      auto program = [&] {
        return mt::matmul(ta ? a.transpose(1, 2) : a, tb ? b.transpose(1, 2) : b);
      };
      std::vector<double> expected = run_on(baseline(), program);
      std::vector<double> actual = run_on(tested(), program);
      // Products of values of order one summed k times: the f32 error is about sqrt(k) ulps of
      // a sum of magnitudes of order sqrt(k).
      EXPECT_EQ(first_difference(expected, actual, dtype, dtype == mt::f32 ? 0 : 1.01, 2e-5 * k),
                "")
          << mt::name(dtype) << " transposes " << transposes;
    }
  }
}

TEST(GpuMatmul, AutocastConvertsF32OperandsOnTheDevice) {
  SKIP_WITHOUT_CUDA();
  mt::Generator gen(11);
  mt::Tensor a, b;
  {
    DeviceScope scope;
    mt::set_device(mt::Device::cpu);
    a = mt::randn({64, 96}, mt::f32, &gen);
    b = mt::randn({96, 80}, mt::f32, &gen);
    mt::eval({a, b});
  }
  for (const char* policy : {"autocast-bf16", "autocast-f16"}) {
    auto program = [&] {
      mt::autocast guard(mt::policy_by_name(policy));
      return mt::cast(mt::relu(mt::matmul(a, b)), mt::f32);
    };
    std::vector<double> expected = run_on(baseline(), program);
    std::vector<double> actual = run_on(tested(), program);
    mt::DType half = std::string(policy).ends_with("bf16") ? mt::bf16 : mt::f16;
    EXPECT_EQ(first_difference(expected, actual, half, 1.01, 2e-5 * 96), "") << policy;
  }
}

// mt::set_allow_tf32: f32 matmuls take TF32 tensor cores (operands cut to a 10-bit mantissa),
// within TF32's error of the f64 product and visibly not the f32 one; off again, they are f32.
TEST(GpuMatmul, AllowTf32UsesTf32ForF32MatmulsOnly) {
  SKIP_WITHOUT_CUDA();
  mt::Generator gen(13);
  const int64_t m = 64, k = 256, n = 48;
  mt::Tensor a, b;
  {
    DeviceScope scope;
    mt::set_device(mt::Device::cpu);
    a = mt::randn({m, k}, mt::f32, &gen);
    b = mt::randn({k, n}, mt::f32, &gen);
    mt::eval({a, b});
  }
  std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
  // Largest error of `c` against the f64 product, relative to sum |a_ik b_kj| of its element.
  auto worst_error = [&](const std::vector<double>& c) {
    double worst = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double exact = 0, scale = 0;
        for (int64_t q = 0; q < k; ++q) {
          exact += av[i * k + q] * bv[q * n + j];
          scale += std::fabs(av[i * k + q] * bv[q * n + j]);
        }
        worst = std::max(worst, std::fabs(c[i * n + j] - exact) / scale);
      }
    return worst;
  };
  auto program = [&] { return mt::matmul(a, b); };
  ASSERT_FALSE(mt::allow_tf32());
  std::vector<double> strict = run_on(tested(), program);
  mt::set_allow_tf32(true);
  std::vector<double> tf32 = run_on(tested(), program);
  mt::set_allow_tf32(false);
  std::vector<double> strict_again = run_on(tested(), program);
  EXPECT_LT(worst_error(strict), 1e-6);
  EXPECT_EQ(strict_again, strict);
  EXPECT_LT(worst_error(tf32), 2 * 0x1p-10);  // two operands each within 2^-11
  if (!dry_run()) {
    EXPECT_GT(worst_error(tf32), 1e-5) << "TF32 was asked for but not used";
  }
  // Half operands are unaffected.
  auto half_program = [&] { return mt::matmul(mt::cast(a, mt::bf16), mt::cast(b, mt::bf16)); };
  std::vector<double> half = run_on(tested(), half_program);
  mt::set_allow_tf32(true);
  EXPECT_EQ(run_on(tested(), half_program), half);
  mt::set_allow_tf32(false);
}

// ---- training: the same steps on both devices, losses and parameters compared.

const char* policy_names[] = {"fp32", "autocast-f16", "autocast-bf16", "pure-f16", "pure-bf16"};

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<double>> parameters;
  mt::ExecutionStats late;  // counted over the steps after the warm-up
};

constexpr int warmup_steps = 2, steps = 4;

// `steps` training steps with AdamW, the loss under the policy, GradScaler for f16 policies as
// PyTorch would; the loss is read every step.
Trained train(mt::Module& net, const std::function<mt::Tensor()>& loss_of,
              const std::string& policy) {
  mt::PolicyPtr p = mt::policy_by_name(policy);
  mt::AdamW optimizer(net.parameters(), mt::AdamOptions{.lr = 1e-3, .weight_decay = 0.01});
  mt::GradScaler scaler({.enabled = policy.ends_with("-f16")});
  Trained out;
  for (int step = 0; step < steps; ++step) {
    if (step == warmup_steps) mt::reset_execution_stats();
    optimizer.zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(p);
      loss = loss_of();
    }
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
    out.losses.push_back(loss.item());
  }
  out.late = mt::execution_stats();
  for (const mt::Tensor& parameter : net.parameters())
    out.parameters.push_back(parameter.to_vector<double>());
  return out;
}

struct Model {
  std::string name;
  std::function<Trained(const std::string& policy)> train;
};

std::vector<Model> models() {
  std::vector<Model> list;
  list.push_back({"mlp", [](const std::string& policy) {
                    mt::manual_seed(1);
                    mt::MLP net({16, 64, 64, 8}, mt::Activation::Gelu);
                    mt::Tensor x = mt::randn({32, 16});
                    std::vector<int64_t> labels(32);
                    for (size_t i = 0; i < labels.size(); ++i) labels[i] = (i * 5) % 8;
                    mt::Tensor y = mt::tensor(labels, {32});
                    return train(
                        net, [&] { return mt::cross_entropy(net(x), y); }, policy);
                  }});
  list.push_back({"transformer_block", [](const std::string& policy) {
                    mt::manual_seed(2);
                    mt::TransformerBlock block(32, 4);
                    mt::Tensor x = mt::randn({2, 8, 32});
                    return train(
                        block,
                        [&] {
                          mt::Tensor y = mt::cast(block(x), mt::f32);
                          return mt::mean(y * y);
                        },
                        policy);
                  }});
  list.push_back({"digits_mlp", [](const std::string& policy) {
                    mt::manual_seed(3);
                    DigitsMLP net;
                    mt::Tensor x = mt::randn({64, 64});
                    std::vector<int64_t> labels(64);
                    for (size_t i = 0; i < labels.size(); ++i) labels[i] = (i * 7) % 10;
                    mt::Tensor y = mt::tensor(labels, {64});
                    mt::CrossEntropyOptions options{.label_smoothing = 0.1};
                    return train(
                        net, [&] { return mt::cross_entropy(net(x), y, options); }, policy);
                  }});
  list.push_back({"char_gpt", [](const std::string& policy) {
                    mt::Generator gen(4);
                    CharGpt net({.vocab = 11, .layers = 2, .heads = 2, .width = 32, .context = 16},
                                &gen);
                    std::vector<int64_t> tokens(64), targets(64);
                    for (size_t i = 0; i < tokens.size(); ++i) {
                      tokens[i] = (i * 3) % 11;
                      targets[i] = (i * 3 + 1) % 11;
                    }
                    mt::Tensor t = mt::tensor(tokens, {4, 16}), u = mt::tensor(targets, {4, 16});
                    return train(
                        net, [&] { return net.loss(t, u); }, policy);
                  }});
  return list;
}

Trained train_on(mt::Device device, const Model& model, const std::string& policy) {
  DeviceScope scope;
  mt::set_device(device);
  return model.train(policy);
}

// How far two runs may drift: fp32 by the sums' order (and libm ulps); 16-bit policies by an
// ulp of a 16-bit activation here and there, which Adam (normalized steps of about lr) turns
// into parameter differences of a few lr at most.
struct Tolerance {
  double loss, parameter;
};
Tolerance tolerance_of(const std::string& policy) {
  if (policy == "fp32") return {1e-4, 3e-4};
  if (policy.starts_with("autocast")) return {5e-3, 8e-3};
  return {2e-2, 2e-2};
}

class GpuTraining : public ::testing::TestWithParam<int> {};

TEST_P(GpuTraining, EveryPolicyMatchesTheCpuAndLaterStepsCompileNothing) {
  SKIP_WITHOUT_CUDA();
  Model model = models()[GetParam()];
  for (const char* policy : policy_names) {
    Trained expected = train_on(baseline(), model, policy);
    Trained actual = train_on(tested(), model, policy);
    Tolerance tol = tolerance_of(policy);
    std::string what = model.name + " under " + policy;
    ASSERT_EQ(actual.losses.size(), expected.losses.size());
    for (size_t s = 0; s < expected.losses.size(); ++s) {
      EXPECT_TRUE(std::isfinite(actual.losses[s])) << what << " step " << s;
      EXPECT_NEAR(actual.losses[s], expected.losses[s],
                  tol.loss * (1 + std::fabs(expected.losses[s])))
          << what << " step " << s;
    }
    ASSERT_EQ(actual.parameters.size(), expected.parameters.size());
    for (size_t p = 0; p < expected.parameters.size(); ++p) {
      const std::vector<double>& e = expected.parameters[p];
      const std::vector<double>& a = actual.parameters[p];
      ASSERT_EQ(a.size(), e.size());
      double worst = 0;
      size_t at = 0;
      for (size_t i = 0; i < e.size(); ++i) {
        double d = std::fabs(a[i] - e[i]) / (1 + std::fabs(e[i]));
        if (!(d <= worst)) worst = d, at = i;
      }
      EXPECT_LE(worst, tol.parameter)
          << what << " parameter " << p << " element " << at << ": " << e[at] << " vs " << a[at];
    }
    // After the warm-up (Adam's state exists from the first step), every step replays cached
    // programs: nothing is fused, lowered or compiled again.
    EXPECT_EQ(actual.late.programs_built, 0) << what;
    EXPECT_GT(actual.late.programs_reused, 0) << what;
    EXPECT_EQ(actual.late.kernels_compiled, 0) << what;
    EXPECT_GT(actual.late.kernels, 0) << what;
    EXPECT_GT(actual.late.gemms, 0) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuTraining, ::testing::Range(0, 4),
                         [](const auto& info) { return models()[info.param].name; });

// MIXTAPE_LOG=profile (read once at start, so in a child process: this binary running one of
// its training tests): the wall time of every step kind and, on the GPU, a second table of the
// time each took on the device, from events around it, with matmuls and kernels in it.
TEST(GpuProfile, DeviceTimeOfEveryStepKindIsPrinted) {
  SKIP_WITHOUT_CUDA();
  std::string command = fmt::format(
      "MIXTAPE_LOG=profile '{}' --gtest_filter=Gpu/GpuTraining."
      "EveryPolicyMatchesTheCpuAndLaterStepsCompileNothing/digits_mlp 2>&1",
      std::filesystem::read_symlink("/proc/self/exe").string());
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::vector<std::string> lines;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe)) lines.emplace_back(buffer);
  ASSERT_EQ(pclose(pipe), 0);
  // Rows of each table: "mixtape[profile]:   total  share%  runs  us/run  step".
  std::vector<std::string> wall, device;
  std::vector<std::string>* table = &wall;
  for (const std::string& line : lines) {
    if (!line.starts_with("mixtape[profile]:")) continue;
    if (line.find("time on the device") != std::string::npos) table = &device;
    double total = 0, share = 0, us = 0;
    long long runs = 0;
    if (std::sscanf(line.c_str(), "mixtape[profile]: %lf %lf%% %lld %lf", &total, &share, &runs,
                    &us) == 4) {
      EXPECT_GT(runs, 0) << line;
      EXPECT_GE(total, 0) << line;
      table->push_back(line);
    }
  }
  auto has = [](const std::vector<std::string>& rows, const char* kind) {
    return std::any_of(rows.begin(), rows.end(),
                       [&](const std::string& row) { return row.find(kind) != std::string::npos; });
  };
  EXPECT_TRUE(has(wall, " kernel ")) << lines.size() << " lines";
  EXPECT_TRUE(has(wall, " matmul "));
  if (dry_run()) {
    EXPECT_TRUE(device.empty()) << "the CPU runs steps synchronously: no device table";
  } else {
    EXPECT_TRUE(has(device, " kernel "));
    EXPECT_TRUE(has(device, " matmul "));
  }
}

// ---- multi-tensor steps: one launch updates many parameters.

struct ManyUpdates {
  std::vector<std::vector<double>> parameters;
  mt::ExecutionStats last;  // of the last step
};

// 70 parameters of sizes 1 to 3000, one larger than a full grid (so its threads stride), and
// the loss a sum of their squares: every gradient and update is pointwise, and the updates of
// one optimizer form one multi-tensor step whose segments need two of CUDA's launches.
ManyUpdates update_many(mt::Device device, bool adam) {
  DeviceScope scope;
  mt::set_device(device);
  mt::Generator gen(31);
  std::vector<mt::Tensor> params;
  for (int64_t i = 0; i < 70; ++i) {
    int64_t n = i == 7 ? 3'000'000 : 1 + (i * 977) % 3000;
    params.push_back(
        mt::tensor(mt::randn({n}, mt::f32, &gen).to_vector<float>(), {n}).requires_grad_());
  }
  std::unique_ptr<mt::Optimizer> optimizer;
  if (adam)
    optimizer =
        std::make_unique<mt::AdamW>(params, mt::AdamOptions{.lr = 1e-2, .weight_decay = 0.1});
  else
    optimizer = std::make_unique<mt::SGD>(params, mt::SGDOptions{.lr = 0.05, .momentum = 0.9});
  ManyUpdates out;
  for (int step = 0; step < 3; ++step) {
    mt::reset_execution_stats();
    optimizer->zero_grad();
    mt::Tensor loss = mt::sum(params[0] * params[0]);
    for (size_t i = 1; i < params.size(); ++i) loss = loss + mt::sum(params[i] * params[i]);
    loss.backward();
    optimizer->step();
    mt::eval(params);
    out.last = mt::execution_stats();
  }
  for (const mt::Tensor& p : params) out.parameters.push_back(p.to_vector<double>());
  return out;
}

// The updates are pointwise and IEEE, so both devices give the same bits; the GPU runs the
// same number of kernels as the CPU, whose multi-tensor steps it shares.
TEST(GpuMultiTensor, SeventyUpdatesMatchTheCpuInTheSameKernelCount) {
  SKIP_WITHOUT_CUDA();
  for (bool adam : {false, true}) {
    ManyUpdates expected = update_many(baseline(), adam);
    ManyUpdates actual = update_many(tested(), adam);
    ASSERT_EQ(actual.parameters.size(), expected.parameters.size());
    for (size_t p = 0; p < expected.parameters.size(); ++p)
      EXPECT_EQ(first_difference(expected.parameters[p], actual.parameters[p], mt::f32, 0), "")
          << (adam ? "AdamW" : "SGD") << " parameter " << p;
    if (!dry_run()) {
      EXPECT_EQ(actual.last.kernels, expected.last.kernels);
    }
    EXPECT_LT(actual.last.kernels, 70) << "the updates did not share a launch";
  }
}

// 200 whole-tensor sums of independent tensors (empty to 3M elements): one multi-tensor
// reduction step, a block per tensor, in two launches on the GPU. An f32 sum of 3M terms is
// good to a few parts in 10^6 in any order.
TEST(GpuMultiTensor, TwoHundredWholeSumsMatchTheCpu) {
  SKIP_WITHOUT_CUDA();
  auto sums = [](mt::Device device) {
    DeviceScope scope;
    mt::set_device(device);
    mt::Generator gen(41);
    std::vector<mt::Tensor> outs;
    for (int64_t i = 0; i < 200; ++i) {
      int64_t n = i == 11 ? 3'000'000 : (i * 7919) % 5000;
      mt::Tensor x = mt::tensor(mt::randn({n}, mt::f32, &gen).to_vector<float>(), {n});
      outs.push_back(mt::sum(x * x - 0.5));
    }
    mt::reset_execution_stats();
    mt::eval(outs);
    std::vector<double> values;
    for (const mt::Tensor& t : outs) values.push_back(t.item());
    return std::pair{values, mt::execution_stats().kernels};
  };
  auto [expected, expected_kernels] = sums(baseline());
  auto [actual, actual_kernels] = sums(tested());
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i)
    EXPECT_NEAR(actual[i], expected[i], 2e-5 * (1 + std::fabs(expected[i]))) << "sum " << i;
  EXPECT_EQ(actual_kernels, 1);
  if (!dry_run()) {
    EXPECT_EQ(expected_kernels, 1);
  }
}

// ---- data movement on the device: the same bits as the CPU, and nothing through the host.

TEST(GpuMovement, ConcatUnsliceIndexSelectAndIndexAddMatchTheCpuOnTheDevice) {
  SKIP_WITHOUT_CUDA();
  for (mt::DType dtype : {mt::f32, mt::bf16, mt::f16}) {
    auto program = [&](mt::ExecutionStats* stats) {
      mt::Generator gen(43);
      mt::Tensor table = mt::cast(mt::randn({97, 24}, mt::f32, &gen), dtype);
      mt::Tensor a = mt::cast(mt::randn({4, 5, 24}, mt::f32, &gen), dtype);
      mt::Tensor b = mt::cast(mt::randn({4, 3, 24}, mt::f32, &gen), dtype);
      std::vector<int64_t> ids(40);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 37) % 97);
      mt::Tensor index = mt::tensor(ids, {40});
      mt::Tensor grad = mt::cast(mt::randn({40, 24}, mt::f32, &gen), dtype);
      mt::eval({table, a, b, index, grad});
      mt::reset_execution_stats();
      mt::Tensor joined = mt::concat({a, b, a}, 1);                          // [4, 13, 24]
      mt::Tensor placed = mt::unslice(b, {1, 0, 2}, {2, 2, 3}, {9, 6, 75});  // strided window
      mt::Tensor rows = mt::index_select(table, index);                      // [40, 24]
      mt::Tensor summed = mt::index_add(mt::zeros({97, 24}, mt::f32), index, grad);  // repeats
      std::vector<mt::Tensor> outs = {joined, placed, rows, summed};
      return values_of(outs, stats);
    };
    auto run = [&](mt::Device device, mt::ExecutionStats* stats) {
      DeviceScope scope;
      mt::set_device(device);
      return program(stats);
    };
    mt::ExecutionStats stats;
    auto expected = run(baseline(), nullptr);
    auto actual = run(tested(), &stats);
    expect_same_bits(expected, actual, dtype);
    if (!dry_run()) {
      EXPECT_EQ(stats.host_ops, 0) << mt::name(dtype);
      EXPECT_EQ(stats.bytes_downloaded, 0) << mt::name(dtype);
    }
  }
}

// Turns cuDNN off for the scope (the fixed kernels then run convolutions), then back as it was.
class CudnnOff {
 public:
  CudnnOff() : previous_(mt::use_cudnn()) { mt::set_use_cudnn(false); }
  ~CudnnOff() { mt::set_use_cudnn(previous_); }

 private:
  bool previous_;
};

// Convolutions on the device with cuDNN off (runtime/cuda_fixed_kernels.cpp's direct kernels): a
// forward pass with groups, stride and padding, and both gradients, in f32, bf16 and f16, have
// the reference executor's bits, with nothing run on the host. The dry run compares the CPU back
// end (oneDNN, its own order of sums) within rounding.
TEST(GpuConvolution, ForwardAndBothGradientsHaveTheReferencesBitsOnTheDevice) {
  SKIP_WITHOUT_CUDA();
  CudnnOff fixed_kernels;
  for (mt::DType dtype : {mt::f32, mt::bf16, mt::f16}) {
    auto run = [&](mt::Device device, mt::ExecutionStats* stats) {
      DeviceScope scope;
      mt::set_device(device);
      mt::Generator gen(53);
      mt::Tensor x = mt::randn({4, 6, 11, 9}, dtype, &gen).requires_grad_();
      mt::Tensor w = mt::randn({8, 3, 3, 3}, dtype, &gen).requires_grad_();
      mt::Tensor gy = mt::randn({4, 8, 6, 5}, dtype, &gen);
      mt::eval({x, w, gy});
      mt::reset_execution_stats();
      mt::Tensor y = mt::conv2d(x, w, mt::Tensor(), {.stride = 2, .padding = 1, .groups = 2});
      (y * gy).sum().backward();
      std::vector<mt::Tensor> outs = {y, x.grad(), w.grad()};
      return values_of(outs, stats);
    };
    mt::ExecutionStats stats;
    auto expected = run(mt::Device::reference, nullptr);
    auto actual = run(tested(), &stats);
    ASSERT_EQ(actual.size(), expected.size());
    const double tolerance = dtype == mt::f32 ? 1e-5 : 1e-2;
    for (size_t o = 0; o < expected.size(); ++o) {
      ASSERT_EQ(actual[o].size(), expected[o].size());
      if (!dry_run()) {
        EXPECT_EQ(actual[o], expected[o]) << mt::name(dtype) << " output " << o;
        continue;
      }
      for (size_t i = 0; i < expected[o].size(); ++i)
        ASSERT_NEAR(actual[o][i], expected[o][i], tolerance * (1 + std::fabs(expected[o][i])))
            << mt::name(dtype) << " output " << o << " element " << i;
    }
    if (!dry_run()) {
      EXPECT_EQ(stats.host_ops, 0) << mt::name(dtype);
    }
  }
}

// Convolutions through cuDNN (runtime/cudnn.h), the default where it loads: forward, input
// gradient and weight gradient at a ResNet block's, its stem's and shortcut's geometries and at
// depthwise, grouped, dilated and asymmetric ones, in f32 (FMA kernels, TF32 off), bf16 and f16,
// agree with the CPU back end (oneDNN) up to f32 sums in another order and the result's
// rounding, relative to the largest magnitude (two units in the last place of a half result: a
// kernel that rounds a partial sum, as some of cuBLASLt's do, costs one more). Every pass runs on
// cuDNN (three convolutions counted, nothing on the host), and a second run stores the same bits
// (deterministic algorithms only). The dry run checks the CPU back end against the reference.
TEST(GpuConvolution, CudnnAgreesWithTheCpuAndRepeatsItsBits) {
  SKIP_WITHOUT_CUDA();
  if (!dry_run() && !mt::cuda::cudnn_available())
    GTEST_SKIP() << "cuDNN unavailable: " << mt::cuda::cudnn_unavailable_reason();
  struct Case {
    const char* label;
    mt::Shape x, w;
    mt::Conv2dOptions options;
  };
  const Case cases[] = {
      {"3x3 pad 1", {8, 16, 14, 14}, {32, 16, 3, 3}, {.padding = 1}},
      {"7x7 stride 2 pad 3 (a stem)", {4, 3, 32, 32}, {16, 3, 7, 7}, {.stride = 2, .padding = 3}},
      {"1x1 stride 2 (a shortcut)", {4, 32, 9, 9}, {16, 32, 1, 1}, {.stride = 2}},
      {"depthwise 3x3", {2, 8, 10, 10}, {8, 1, 3, 3}, {.padding = 1, .groups = 8}},
      {"grouped, dilated, asymmetric",
       {2, 6, 11, 9},
       {4, 3, 3, 2},
       {.stride = {2, 1}, .padding = {1, 2}, .dilation = {2, 1}, .groups = 2}},
  };
  for (mt::DType dtype : {mt::f32, mt::bf16, mt::f16}) {
    const double tol = dtype == mt::f32 ? 1e-5 : dtype == mt::bf16 ? 1.0 / 64 : 1.0 / 512;
    for (const Case& c : cases) {
      const std::string what = fmt::format("{} {}", c.label, mt::name(dtype));
      auto run = [&](mt::Device device, mt::ExecutionStats* stats) {
        DeviceScope scope;
        mt::set_device(device);
        mt::Generator gen(59);
        mt::Tensor x = mt::randn(c.x, dtype, &gen), w = mt::randn(c.w, dtype, &gen);
        mt::Tensor y = mt::conv2d(x, w, mt::Tensor(), c.options);
        mt::Tensor gy = mt::randn(y.shape(), dtype, &gen);
        mt::eval({x, w, y, gy});
        mt::reset_execution_stats();
        const mt::ConvWindow window = mt::ConvWindow::of(c.options);
        return values_of(
            {mt::conv2d(x, w, mt::Tensor(), c.options), mt::conv2d_input_grad(gy, w, c.x, window),
             mt::conv2d_weight_grad(x, gy, c.w, window)},
            stats);
      };
      mt::ExecutionStats stats;
      const auto expected = run(baseline(), nullptr);
      const auto actual = run(tested(), &stats);
      EXPECT_EQ(stats.convolutions, 3)
          << what
          << ": a pass went to the direct loops (MIXTAPE_LOG=profile shows cuDNN's choices)";
      EXPECT_EQ(stats.host_ops, 0) << what;
      ASSERT_EQ(actual.size(), expected.size());
      for (size_t o = 0; o < expected.size(); ++o) {
        ASSERT_EQ(actual[o].size(), expected[o].size()) << what;
        double scale = 0;
        for (double v : expected[o]) scale = std::max(scale, std::fabs(v));
        for (size_t i = 0; i < expected[o].size(); ++i)
          ASSERT_NEAR(actual[o][i], expected[o][i], tol * scale)
              << what << " output " << o << " element " << i;
      }
      expect_same_bits(actual, run(tested(), nullptr), dtype);
    }
  }
}

// Max pooling on the device (runtime/cuda_fixed_kernels.cpp's mt_max_pool2d and
// mt_max_pool2d_grad): ResNet's stem pooling and a dilated ceil-mode window over values with ties,
// forward and gradient, in f32, bf16 and f16, have the reference executor's bits with nothing run
// on the host. The dry run checks the CPU back end's loops, which store the same bits.
TEST(GpuMaxPool, ForwardAndGradientHaveTheReferencesBitsOnTheDevice) {
  SKIP_WITHOUT_CUDA();
  for (mt::DType dtype : {mt::f32, mt::bf16, mt::f16}) {
    auto run = [&](mt::Device device, mt::ExecutionStats* stats) {
      DeviceScope scope;
      mt::set_device(device);
      mt::Generator gen(59);
      const mt::Shape shape = {4, 6, 17, 15};
      std::vector<double> tied = mt::round(mt::randn(shape, dtype, &gen) * 2.0).to_vector<double>();
      mt::Tensor x = mt::tensor(tied, shape, dtype).requires_grad_();
      mt::eval({x});
      mt::Tensor y = mt::max_pool2d(x, 3, 2, 1);
      mt::Tensor z = mt::max_pool2d(x, {2, 3}, {{1, 2}}, 1, {2, 1}, true);
      mt::Tensor gy = mt::randn(y.shape(), dtype, &gen), gz = mt::randn(z.shape(), dtype, &gen);
      mt::eval({gy, gz});
      mt::reset_execution_stats();
      (mt::sum(y * gy) + mt::sum(z * gz)).backward();
      std::vector<mt::Tensor> outs = {y, z, x.grad()};
      return values_of(outs, stats);
    };
    mt::ExecutionStats stats;
    auto expected = run(mt::Device::reference, nullptr);
    auto actual = run(tested(), &stats);
    expect_same_bits(expected, actual, dtype);
    EXPECT_EQ(stats.host_ops, 0) << mt::name(dtype);
  }
}

// Fused attention runs on the device (runtime/cuda_attention.h): forward and the packed
// gradients, causal, and under a key-padding bool mask (a batch-dependent mask row) with dropout
// drawn as the CPU draws it, in f32 and bf16, with no host step. The kernels sum in f32 in their
// own order: the CPU's values to a few f32 ulps, or an ulp of bf16. The dry run compares the
// CPU's tiles with the reference's materialized loops, to rounding.
TEST(GpuAttention, FusedForwardAndGradientsRunOnTheDevice) {
  SKIP_WITHOUT_CUDA();
  for (bool masked : {false, true})
    for (mt::DType dtype : {mt::f32, mt::bf16}) {
      auto run = [&](mt::Device device, mt::ExecutionStats* stats) {
        DeviceScope scope;
        mt::set_device(device);
        mt::Generator gen(61), drop(62);
        const mt::Shape shape = {2, 3, 70, masked ? 64 : 32};
        auto leaf = [&] {
          return mt::tensor(mt::randn(shape, dtype, &gen).to_vector<double>(), shape, dtype)
              .requires_grad_();
        };
        mt::Tensor q = leaf(), k = leaf(), v = leaf();
        mt::Tensor g = mt::randn(shape, dtype, &gen);
        // Batch 0 sees its first 50 keys, batch 1 all 70.
        std::vector<float> keep(2 * 70);
        for (int64_t i = 0; i < 140; ++i) keep[i] = i < 50 || i >= 70;
        mt::Tensor mask = mt::tensor(keep, {2, 1, 1, 70}) > 0.5;
        mt::eval({q, k, v, g, mask});
        mt::reset_execution_stats();
        mt::Tensor y = masked ? mt::scaled_dot_product_attention(q, k, v, mask, false, std::nullopt,
                                                                 0.2, &drop)
                              : mt::scaled_dot_product_attention(q, k, v, true);
        EXPECT_EQ(y.node()->op, mt::OpCode::Attention);
        mt::sum(y * g).backward();
        std::vector<mt::Tensor> outs = {y, q.grad(), k.grad(), v.grad()};
        return values_of(outs, stats);
      };
      mt::ExecutionStats stats;
      auto expected = run(baseline(), nullptr), actual = run(tested(), &stats);
      ASSERT_EQ(actual.size(), expected.size());
      const bool half = dtype == mt::bf16;
      const double ulps = dry_run() ? 8 : half ? 1.01 : 64;
      const double absolute = dry_run() ? 1e-3 : half ? 0x1p-8 : 1e-5;
      for (size_t o = 0; o < expected.size(); ++o)
        EXPECT_EQ(first_difference(expected[o], actual[o], dtype, ulps, absolute), "")
            << mt::name(dtype) << (masked ? " masked" : " causal") << " output " << o;
      if (!dry_run()) {
        EXPECT_EQ(stats.host_ops, 0) << mt::name(dtype);
      }
    }
}

// rand and randn drawn on the device: the CPU's streams bit for bit, in every 32-bit-or-less
// float dtype, for a size that ends inside a Philox block.
TEST(GpuRandom, DeviceStreamsAreTheCpusBits) {
  SKIP_WITHOUT_CUDA();
  for (mt::DType dtype : {mt::f32, mt::f16, mt::bf16}) {
    auto draw = [&](mt::Device device, mt::ExecutionStats* stats) {
      DeviceScope scope;
      mt::set_device(device);
      mt::Generator gen(47);
      mt::reset_execution_stats();
      mt::Tensor u = mt::rand({1001, 33}, dtype, &gen), n = mt::randn({70001}, dtype, &gen);
      mt::eval({u, n});
      if (stats) *stats = mt::execution_stats();
      return std::pair{u.to_vector<double>(), n.to_vector<double>()};
    };
    mt::ExecutionStats stats;
    auto expected = draw(baseline(), nullptr);
    auto actual = draw(tested(), &stats);
    EXPECT_EQ(actual.first, expected.first) << "rand " << mt::name(dtype);
    EXPECT_EQ(actual.second, expected.second) << "randn " << mt::name(dtype);
    if (!dry_run()) {
      EXPECT_EQ(stats.host_ops, 0) << mt::name(dtype);
    }
  }
}

// GradScaler's decisions against torch.cuda.amp.GradScaler on the same gradient script (finite,
// +inf, NaN, -inf steps; growth after 3 clean ones; a factor that is not a power of two), where
// PyTorch with CUDA is installed: each step's skip and the scale after it.
TEST(GpuLossScaling, DecisionsMatchCudaPyTorch) {
  SKIP_WITHOUT_CUDA();
  const std::string script = "FFFIFNFFFFMFFFFIIF";
  const char* probe =
      "/usr/bin/python3 -c 'import torch,sys; sys.exit(0 if "
      "torch.cuda.is_available() else 1)' > /dev/null 2>&1";
  if (std::system(probe) != 0) GTEST_SKIP() << "PyTorch with CUDA is not installed";
  std::string python = fmt::format(R"(/usr/bin/python3 - <<'PY'
import torch
p = torch.zeros(2, device="cuda", requires_grad=True)
opt = torch.optim.SGD([p], lr=1.0)
scaler = torch.cuda.amp.GradScaler(init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25,
                                   growth_interval=3)
for c in "{}":
    second = {{"I": float("inf"), "M": -float("inf"), "N": float("nan")}}.get(c, -2.0)
    opt.zero_grad()
    p.grad = torch.tensor([1.0, second], device="cuda") * scaler.get_scale()
    before = p.detach().clone()
    scaler.step(opt)
    scaler.update()
    print(int(torch.equal(before, p.detach())), repr(scaler.get_scale()))
PY)",
                                   script);
  FILE* pipe = popen(python.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::vector<std::pair<bool, double>> torch_steps;
  int skipped = 0;
  double scale = 0;
  while (std::fscanf(pipe, "%d %lf", &skipped, &scale) == 2)
    torch_steps.push_back({skipped != 0, scale});
  ASSERT_EQ(pclose(pipe), 0);
  ASSERT_EQ(torch_steps.size(), script.size());

  DeviceScope scope;
  mt::set_device(tested());
  mt::Tensor p = mt::tensor(std::vector<float>{0, 0}, {2}).requires_grad_();
  mt::SGD optimizer({p}, mt::SGDOptions{.lr = 1.0});
  mt::GradScaler scaler(
      {.init_scale = 1024.0, .growth_factor = 3.0, .backoff_factor = 0.25, .growth_interval = 3});
  for (size_t i = 0; i < script.size(); ++i) {
    char c = script[i];
    float second = c == 'I' ? INFINITY : c == 'M' ? -INFINITY : c == 'N' ? NAN : -2.0f;
    optimizer.zero_grad();
    float scale_now = static_cast<float>(scaler.get_scale());
    p.set_grad(mt::tensor(std::vector<float>{scale_now, second * scale_now}, {2}));
    scaler.step(optimizer);
    scaler.update();
    EXPECT_EQ(scaler.skip_history().back(), torch_steps[i].first)
        << "step " << i << " '" << c << "'";
    EXPECT_EQ(scaler.get_scale(), torch_steps[i].second) << "step " << i << " '" << c << "'";
  }
}

// A step whose scaled gradients overflow f16 is skipped and the scale halves, on the GPU as on
// the CPU; the next, finite step updates the parameters.
TEST(GpuLossScaling, AnOverflowStepIsSkippedAndTheScaleHalves) {
  SKIP_WITHOUT_CUDA();
  struct Outcome {
    std::vector<double> scales, after_overflow, after_finite;
    std::vector<bool> skips;
  };
  auto run = [](mt::Device device) {
    DeviceScope scope;
    mt::set_device(device);
    mt::manual_seed(9);
    mt::Linear layer(8, 4);
    mt::Tensor x = mt::randn({16, 8});
    mt::SGD optimizer(layer.parameters(), mt::SGDOptions{.lr = 0.1});
    mt::GradScaler scaler({.init_scale = 65536.0});
    Outcome out;
    for (double magnitude : {1e4, 1.0}) {  // 1e4 * 65536 overflows f16 gradients
      optimizer.zero_grad();
      mt::Tensor loss;
      {
        mt::autocast guard(mt::policy_by_name("pure-f16"));
        loss = mt::mean(mt::cast(layer(x), mt::f32)) * magnitude;
      }
      scaler.scale(loss).backward();
      scaler.step(optimizer);
      scaler.update();
      out.scales.push_back(scaler.get_scale());
      (magnitude > 1 ? out.after_overflow : out.after_finite) = layer.weight.to_vector<double>();
    }
    out.skips = scaler.skip_history();
    return out;
  };
  Outcome expected = run(baseline());
  Outcome actual = run(tested());
  EXPECT_EQ(actual.skips, (std::vector<bool>{true, false}));
  EXPECT_EQ(actual.skips, expected.skips);
  EXPECT_EQ(actual.scales, (std::vector<double>{32768.0, 32768.0}));
  EXPECT_EQ(actual.scales, expected.scales);
  EXPECT_EQ(first_difference(expected.after_overflow, actual.after_overflow, mt::f16, 0), "");
  EXPECT_EQ(first_difference(expected.after_finite, actual.after_finite, mt::f16, 1.01), "");
  EXPECT_NE(actual.after_overflow, actual.after_finite);
}

// Values computed on the GPU stay there until read: a chain of steps downloads only what the
// host asks for.
TEST(GpuResidency, ValuesStayOnTheDeviceUntilRead) {
  SKIP_WITHOUT_CUDA();
  if (dry_run()) GTEST_SKIP() << "device residency needs a GPU";
  DeviceScope scope;
  mt::set_device(mt::Device::cuda);
  mt::Tensor x = mt::tensor(std::vector<float>(4096, 1.5f), {64, 64});
  mt::Tensor y = mt::matmul(x, x) + 1.0;
  mt::eval({y});
  mt::reset_execution_stats();
  mt::Tensor z = mt::relu(mt::matmul(y, x)) * 0.5;
  mt::eval({z});
  mt::ExecutionStats stats = mt::execution_stats();
  EXPECT_EQ(stats.bytes_uploaded, 0);  // x was uploaded once, y never left the device
  EXPECT_EQ(stats.bytes_downloaded, 0);
  EXPECT_TRUE(z.node()->value->host_stale);
  std::vector<float> values = z.to_vector<float>();
  EXPECT_EQ(mt::execution_stats().bytes_downloaded, 4096 * 4);
  float expected = (64 * 1.5f * 1.5f + 1.0f) * 1.5f * 64 * 0.5f;
  EXPECT_FLOAT_EQ(values[0], expected);
  EXPECT_FLOAT_EQ(values[4095], expected);
}

}  // namespace
