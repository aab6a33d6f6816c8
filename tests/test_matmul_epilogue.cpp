// tests/test_matmul_epilogue.cpp -- a Linear's bias add and relu run in the matmul's epilogue on
// the CPU: one step instead of two, the reference's results within f32 accumulation, and the
// unfused program's bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "mixtape/codegen/fusion.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/nn.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/optim.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/precision_policy/assign.h"
#include "mixtape/precision_policy/policy.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/program.h"

namespace mt = mixtape;

namespace {

struct Case {
  const char* policy;  // policy_by_name
  bool bias, relu;
  int64_t rows, in, out;  // in and out away from the kernels' multiples of 16 and 64
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  std::string name = info.param.policy;
  for (char& c : name)
    if (c == '-') c = '_';
  return name + (info.param.bias ? "_bias" : "") + (info.param.relu ? "_relu" : "") + "_" +
         std::to_string(info.param.rows) + "x" + std::to_string(info.param.in) + "x" +
         std::to_string(info.param.out);
}

struct LayerRun {
  std::vector<double> values;
  mt::DType dtype = mt::f32;
  std::vector<std::byte> bits;
  mt::ExecutionStats stats;
  std::vector<mt::FusionGroup> plan;  // the CPU back end's groups for the layer, before it ran
};

// The groups the CPU back end makes of `y`'s pending graph.
std::vector<mt::FusionGroup> plan_of(const mt::Tensor& y) {
  std::vector<mt::Node*> pending = mt::pending_nodes({y.node()});
  mt::assign_precision(pending);
  return mt::fuse(pending, {y.node().get()}, mt::fusion_options(mt::Device::cpu));
}

// One forward pass of the case's layer on `device`, from the same seed each time.
LayerRun forward(const Case& c, mt::Device device) {
  mt::set_device(device);
  mt::Generator gen(29);
  mt::Linear layer(c.in, c.out, c.bias, &gen);
  mt::Tensor x = mt::randn({c.rows, c.in}, mt::f32, &gen);
  mt::Tensor y;
  {
    mt::autocast guard(mt::policy_by_name(c.policy));
    y = layer(x);
    if (c.relu) y = mt::relu(y);
  }
  LayerRun run;
  if (device == mt::Device::cpu) run.plan = plan_of(y);
  mt::reset_execution_stats();
  mt::eval({y});
  run.stats = mt::execution_stats();
  const mt::Storage& value = *y.node()->value;
  run.dtype = value.dtype;
  run.bits.assign(value.host_data(), value.host_data() + value.size_bytes());
  run.values = y.to_vector<double>();
  mt::set_device(mt::Device::reference);
  return run;
}

class LinearEpilogue : public testing::TestWithParam<Case> {};

TEST_P(LinearEpilogue, IsOneGemmStepAndMatchesTheReferenceAndTheUnfusedBits) {
  const Case& c = GetParam();
  LayerRun reference = forward(c, mt::Device::reference);
  LayerRun fused = forward(c, mt::Device::cpu);
  mt::set_matmul_epilogue_steps(false);
  LayerRun unfused = forward(c, mt::Device::cpu);
  mt::set_matmul_epilogue_steps(true);

  // The bias add and the relu run inside the gemm step, the one group that stores the layer's
  // output; unfused, a kernel after the gemm does. (A bias rounded to bf16 first is a kernel of
  // n values before the product.)
  auto last_group = [](const std::vector<mt::FusionGroup>& plan) {
    return plan.back().kind == mt::FusionGroup::Kind::MatMul ? "matmul" : "kernel";
  };
  ASSERT_FALSE(fused.plan.empty());
  EXPECT_STREQ(last_group(fused.plan), "matmul");
  EXPECT_STREQ(last_group(unfused.plan), "kernel");
  const mt::FusionGroup& step = fused.plan.back();
  EXPECT_EQ(step.members.size(), 1u + (c.bias ? 2 : 0) + (c.relu ? 1 : 0));
  EXPECT_EQ(step.outputs.size(), 1u);
  EXPECT_EQ(step.bias != nullptr, c.bias);
  EXPECT_EQ(step.relu, c.relu);
  EXPECT_EQ(fused.stats.gemms, 1);
  EXPECT_EQ(unfused.stats.gemms, 1);
  EXPECT_LT(fused.stats.bytes_written, unfused.stats.bytes_written);

  // The epilogue rounds as the unfused graph does (the product to the matmul's type, then the
  // sum to the add's), so the fused step gives the unfused program's bits.
  ASSERT_EQ(fused.dtype, unfused.dtype);
  EXPECT_EQ(fused.bits, unfused.bits);

  // And the reference's values within f32 accumulation, plus one rounding of a half result.
  ASSERT_EQ(reference.values.size(), fused.values.size());
  const double half_step = fused.dtype == mt::bf16 ? 0x1p-7 : fused.dtype == mt::f16 ? 0x1p-10 : 0;
  for (size_t i = 0; i < fused.values.size(); ++i) {
    const double want = reference.values[i], got = fused.values[i];
    const double tolerance = (1e-5 + half_step) * (1 + std::fabs(want));
    ASSERT_NEAR(got, want, tolerance) << "element " << i;
    if (c.relu) {
      ASSERT_GE(got, 0.0) << "element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, LinearEpilogue,
                         testing::Values(Case{"fp32", true, true, 37, 45, 67},
                                         Case{"fp32", true, false, 37, 45, 67},
                                         Case{"fp32", false, true, 37, 45, 67},
                                         Case{"fp32", true, true, 300, 130, 70},
                                         Case{"autocast-bf16", true, true, 37, 45, 67},
                                         Case{"autocast-bf16", true, false, 37, 45, 67},
                                         Case{"autocast-bf16", false, true, 37, 45, 67},
                                         Case{"autocast-bf16", true, true, 300, 130, 70},
                                         Case{"pure-bf16", true, true, 37, 45, 67},
                                         Case{"pure-bf16", true, true, 300, 130, 70},
                                         Case{"autocast-f16", true, true, 37, 45, 67}),
                         case_name);

// A product that something else also reads keeps its value: the add and the relu stay a kernel.
TEST(MatmulEpilogue, AProductReadElsewhereIsNotFused) {
  mt::set_device(mt::Device::cpu);
  mt::Generator gen(5);
  mt::Tensor x = mt::randn({33, 20}, mt::f32, &gen);
  mt::Tensor w = mt::randn({20, 18}, mt::f32, &gen);
  mt::Tensor b = mt::randn({18}, mt::f32, &gen);
  mt::Tensor h = mt::matmul(x, w);
  mt::Tensor y = mt::relu(h + b);
  mt::Tensor z = h * 2.0;
  mt::reset_execution_stats();
  mt::eval({y, z});
  EXPECT_EQ(mt::execution_stats().gemms, 1);
  EXPECT_GE(mt::execution_stats().kernels, 1);
  std::vector<float> hv = h.to_vector<float>(), yv = y.to_vector<float>(),
                     bv = b.to_vector<float>();
  for (size_t i = 0; i < yv.size(); ++i) {
    float sum = hv[i] + bv[i % 18];
    ASSERT_EQ(yv[i], sum > 0 ? sum : 0.0f) << i;
  }
  mt::set_device(mt::Device::reference);
}

// Training through fused layers: relu's gradient reads its output, which the epilogue stores, and
// the parameters after a few steps match the reference executor's.
TEST(MatmulEpilogue, AnMlpTrainsAsOnTheReference) {
  auto train = [](mt::Device device) {
    mt::set_device(device);
    mt::Generator gen(17);
    mt::MLP model({24, 40, 40, 6}, mt::Activation::Relu, &gen);
    mt::Adam optimizer(model.parameters(), mt::AdamOptions{});
    mt::Tensor x = mt::randn({50, 24}, mt::f32, &gen);
    mt::Tensor y = mt::randn({50, 6}, mt::f32, &gen);
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      mt::Tensor loss = mt::mse_loss(model(x), y);
      loss.backward();
      optimizer.step();
    }
    std::vector<float> all;
    for (mt::Tensor& p : model.parameters()) {
      std::vector<float> v = p.to_vector<float>();
      all.insert(all.end(), v.begin(), v.end());
    }
    mt::set_device(mt::Device::reference);
    return all;
  };
  std::vector<float> reference = train(mt::Device::reference);
  std::vector<float> compiled = train(mt::Device::cpu);
  ASSERT_EQ(reference.size(), compiled.size());
  for (size_t i = 0; i < reference.size(); ++i) ASSERT_NEAR(reference[i], compiled[i], 1e-5) << i;
}

}  // namespace
