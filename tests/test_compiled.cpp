// tests/test_compiled.cpp -- the compiled CPU back end against the reference executor: bitwise
// pointwise results, fusion, kernel reuse, eager mode and the emitted IR.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>

#if __has_include(<omp.h>)
#include <omp.h>
#define MIXTAPE_TEST_HAS_OMP 1
#endif

#include <fmt/format.h>

#include "mixtape/codegen/emit_llvm.h"
#include "mixtape/codegen/fusion.h"
#include "mixtape/codegen/kernel_ir.h"
#include "mixtape/codegen/lower.h"
#include "mixtape/dsl/functional.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/half.h"
#include "mixtape/dsl/nn.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/optim.h"
#include "mixtape/dsl/tensor.h"
#include "mixtape/precision_policy/grad_scaler.h"
#include "mixtape/precision_policy/policy.h"
#include "mixtape/runtime/cpu_executor.h"
#include "mixtape/runtime/cuda_executor.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/program.h"
#include "pointwise_programs.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

// Runs `program` on the reference executor and on the compiled back end from the same inputs and
// returns both results' raw bytes.
std::pair<std::vector<std::byte>, std::vector<std::byte>> both(
    const std::function<mt::Tensor()>& program) {
  std::vector<std::byte> out[2];
  mt::Device devices[2] = {mt::Device::reference, mt::Device::cpu};
  mt::Device previous = mt::current_device();
  for (int d = 0; d < 2; ++d) {
    mt::set_device(devices[d]);
    mt::Tensor result = program();
    mt::eval({result});
    const mt::Storage& s = *result.node()->value;
    out[d].assign(s.host_data(), s.host_data() + s.size_bytes());
  }
  mt::set_device(previous);
  return {out[0], out[1]};
}

// f32 results equal within tol * (1 + |reference|), element by element.
void expect_close_f32(const std::vector<std::byte>& reference,
                      const std::vector<std::byte>& compiled, double tol) {
  ASSERT_EQ(reference.size(), compiled.size());
  const float* r = reinterpret_cast<const float*>(reference.data());
  const float* c = reinterpret_cast<const float*>(compiled.data());
  for (size_t i = 0; i < reference.size() / 4; ++i)
    ASSERT_NEAR(r[i], c[i], tol * (1 + std::fabs(r[i]))) << i;
}

bool same_bits_or_both_nan(const std::vector<std::byte>& a, const std::vector<std::byte>& b,
                           mt::DType dtype, std::string& where) {
  if (a.size() != b.size()) return false;
  size_t width = mt::size_of(dtype);
  for (size_t i = 0; i < a.size(); i += width) {
    if (std::memcmp(&a[i], &b[i], width) == 0) continue;
    double x, y;
    if (dtype == mt::f32) {
      float fx, fy;
      std::memcpy(&fx, &a[i], 4);
      std::memcpy(&fy, &b[i], 4);
      x = fx;
      y = fy;
    } else if (dtype == mt::f64) {
      std::memcpy(&x, &a[i], 8);
      std::memcpy(&y, &b[i], 8);
    } else {
      x = y = 0;
    }
    if (std::isnan(x) && std::isnan(y)) continue;
    uint16_t ha = 0, hb = 0;
    if (width == 2) {
      std::memcpy(&ha, &a[i], 2);
      std::memcpy(&hb, &b[i], 2);
      // NaN payloads may differ: both NaN is equal enough.
      uint16_t exp_mask = dtype == mt::f16 ? 0x7C00 : 0x7F80;
      uint16_t man_mask = dtype == mt::f16 ? 0x03FF : 0x007F;
      if ((ha & exp_mask) == exp_mask && (ha & man_mask) && (hb & exp_mask) == exp_mask &&
          (hb & man_mask))
        continue;
    }
    where = fmt::format("element {}: reference {} vs compiled {} (bits {:04x} {:04x})", i / width,
                        x, y, ha, hb);
    return false;
  }
  return true;
}

class EveryPointwiseOp : public ::testing::TestWithParam<mt::DType> {};

// Pointwise-only programs match the reference bit for bit (DESIGN.md decision 6), for every
// unary and binary op of the op table, in every float storage type.
TEST_P(EveryPointwiseOp, MatchesTheReferenceBitForBit) {
  mt::DType dtype = GetParam();
  mt::test::PointwiseInputs inputs(dtype, 257);
  mt::eval({inputs.x, inputs.y, inputs.positive});
  std::vector<mt::test::NamedProgram> programs = mt::test::pointwise_programs(inputs, dtype);
  for (auto& [name, program] : programs) {
    auto [reference, compiled] = both(program);
    std::string where;
    mt::Tensor probe = program();
    EXPECT_TRUE(
        same_bits_or_both_nan(reference, compiled, probe.node()->precision.storage_type, where))
        << name << " in " << mt::name(dtype) << ": " << where;
  }
}

INSTANTIATE_TEST_SUITE_P(Compiled, EveryPointwiseOp,
                         ::testing::Values(mt::f32, mt::f16, mt::bf16, mt::f64),
                         [](const auto& info) { return std::string(mt::name(info.param)); });

TEST(Compiled, ReductionsAndBroadcastsMatchTheReferenceClosely) {
  mt::Generator gen(5);
  mt::Tensor x = mt::randn({7, 33, 5}, mt::f32, &gen);
  mt::Tensor rows = mt::randn({300, 70}, mt::f32, &gen);
  mt::eval({x, rows});
  // Sums over rows (bias gradients) take the column schedule: count the kernels that did.
  int column_kernels = 0;
  mt::set_kernel_observer(
      [&](const mt::LoweredKernel& k) { column_kernels += k.kernel.column_reduction(); });
  std::vector<std::function<mt::Tensor()>> programs = {
      [&] { return mt::sum(mt::relu(rows) * 0.5, {0}); },
      [&] { return mt::max(rows, {0}, true) - rows; },
      [&] { return mt::softmax(rows, 0); },
      [&] { return mt::sum(x, {1}); },
      [&] {
        return mt::sum(x * x, {0, 2}, true);
      },
      [&] { return mt::max(x, {2}); },
      [&] { return mt::softmax(x, -1); },
      [&] { return mt::layer_norm(x, mt::Tensor(), mt::Tensor(), 1e-5); },
      [&] { return mt::mean(mt::exp(x.transpose(0, 2)), {0}); },
      [&] {
        return x.reshape({7, 165}).sum({1});
      },
  };
  for (size_t p = 0; p < programs.size(); ++p) {
    auto [reference, compiled] = both(programs[p]);
    ASSERT_EQ(reference.size(), compiled.size());
    const float* r = reinterpret_cast<const float*>(reference.data());
    const float* c = reinterpret_cast<const float*>(compiled.data());
    for (size_t i = 0; i < reference.size() / 4; ++i)
      ASSERT_NEAR(r[i], c[i], 2e-6 * (1 + std::fabs(r[i]))) << "program " << p << " at " << i;
  }
  mt::set_kernel_observer({});
  EXPECT_GE(column_kernels, 4);
}

// A row op (softmax, layer_norm, ...) over the last axis, run forward and backward under a
// policy on one device: its outputs, the gradients, and the kernels each half ran.
struct RowRun {
  std::vector<std::vector<float>> values;
  int64_t forward_kernels = 0, backward_kernels = 0;
};

using RowOp = std::function<mt::Tensor(const mt::Tensor& x, const mt::Tensor& w)>;

RowRun run_row_op(mt::Device device, const std::string& policy, const RowOp& op) {
  mt::set_device(device);
  mt::Generator gen(21);
  mt::Tensor x =
      mt::tensor((mt::randn({37, 83}, mt::f32, &gen) * 2.0).to_vector<float>(), {37, 83});
  mt::Tensor w = mt::tensor((mt::randn({83}, mt::f32, &gen) + 1.0).to_vector<float>(), {83});
  x.requires_grad_();
  w.requires_grad_();
  RowRun run;
  mt::Tensor y;
  {
    mt::autocast guard(mt::policy_by_name(policy));
    y = op(x, w);
  }
  mt::Tensor upstream = mt::cast(mt::randn(y.shape(), mt::f32, &gen), y.dtype());
  mt::eval({upstream});
  mt::reset_execution_stats();
  mt::eval({y});
  run.forward_kernels = mt::execution_stats().kernels;
  mt::reset_execution_stats();
  y.backward(upstream);
  std::vector<mt::Tensor> grads = {x.grad()};
  if (w.grad().defined()) grads.push_back(w.grad());
  mt::eval(grads);
  run.backward_kernels = mt::execution_stats().kernels;
  run.values.push_back(mt::cast(y, mt::f32).to_vector<float>());
  for (const mt::Tensor& g : grads) run.values.push_back(mt::cast(g, mt::f32).to_vector<float>());
  mt::set_device(mt::Device::reference);
  return run;
}

class RowOps : public ::testing::TestWithParam<std::string> {};

// Softmax, log_softmax, logsumexp and layer_norm are one kernel forward (several passes over each
// row: max, then sum of exp(x - max), then the normalized row), the first three one kernel
// backward too (layer_norm two), and they match the reference executor within the reductions'
// tolerance (sums run in another order).
TEST_P(RowOps, AreOneKernelAndMatchTheReference) {
  const std::string policy = GetParam();
  struct Case {
    const char* name;
    RowOp op;
    int64_t forward_kernels, backward_kernels;
  };
  std::vector<Case> cases = {
      {"softmax", [](const mt::Tensor& x, const mt::Tensor&) { return mt::softmax(x); }, 1, 1},
      {"log_softmax", [](const mt::Tensor& x, const mt::Tensor&) { return mt::log_softmax(x); }, 1,
       1},
      {"logsumexp", [](const mt::Tensor& x, const mt::Tensor&) { return mt::logsumexp(x); }, 1, 1},
      {"layer_norm",
       [](const mt::Tensor& x, const mt::Tensor& w) {
         return mt::layer_norm(x, w, mt::Tensor(), 1e-5);
       },
       // Backward: the input gradient (the row statistics again, then the row sums of the
       // gradient) and the weight gradient (a sum over rows: another nest, which reads the
       // statistics the first kernel stores).
       1, 2},
  };
  bool half = policy != "fp32";
  for (const Case& c : cases) {
    RowRun reference = run_row_op(mt::Device::reference, policy, c.op);
    RowRun compiled = run_row_op(mt::Device::cpu, policy, c.op);
    EXPECT_EQ(compiled.forward_kernels, c.forward_kernels) << c.name;
    EXPECT_EQ(compiled.backward_kernels, c.backward_kernels) << c.name;
    ASSERT_EQ(reference.values.size(), compiled.values.size()) << c.name;
    for (size_t v = 0; v < reference.values.size(); ++v) {
      const std::vector<float>& r = reference.values[v];
      const std::vector<float>& got = compiled.values[v];
      ASSERT_EQ(r.size(), got.size());
      double scale = 0;
      for (float e : r) scale = std::max(scale, double(std::fabs(e)));
      for (size_t i = 0; i < r.size(); ++i)
        ASSERT_NEAR(r[i], got[i], (half ? 1e-2 : 1e-5) * (std::fabs(r[i]) + 1e-2 * scale))
            << c.name << " value " << v << " at " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Compiled, RowOps, ::testing::Values("fp32", "pure-bf16", "autocast-bf16"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// Reductions over different axes do not share a loop nest: they stay separate kernels.
TEST(Compiled, ReductionsOverDifferentAxesStaySeparate) {
  mt::Generator gen(4);
  mt::Tensor x = mt::randn({29, 41}, mt::f32, &gen);
  mt::eval({x});
  auto program = [&] { return x * mt::sum(x, {0}, true) - mt::max(x, {1}, true); };
  auto [reference, compiled] = both(program);
  mt::set_device(mt::Device::cpu);
  mt::reset_execution_stats();
  mt::eval({program()});
  EXPECT_EQ(mt::execution_stats().kernels, 2);
  mt::set_device(mt::Device::reference);
  expect_close_f32(reference, compiled, 2e-6);
}

// FusionOptions::multi_pass = false keeps kernels single-pass: softmax is then a kernel per
// reduction plus one for the division, and each lowered kernel has one pass.
TEST(Compiled, SinglePassFusionSplitsSoftmax) {
  mt::Generator gen(6);
  mt::Tensor x = mt::randn({5, 40}, mt::f32, &gen);
  mt::eval({x});
  mt::Tensor y = mt::softmax(x);
  std::vector<mt::Node*> pending = mt::nodes_in_tape_order({y.node()});
  std::erase_if(pending, [](mt::Node* n) { return n->evaluated(); });
  auto kernels = [&](bool multi_pass) {
    mt::FusionOptions options;
    options.multi_pass = multi_pass;
    std::vector<int> passes;
    for (const mt::FusionGroup& group : mt::fuse(pending, {y.node().get()}, options))
      if (group.kind == mt::FusionGroup::Kind::Kernel)
        passes.push_back(mt::lower(group).kernel.pass_count());
    return passes;
  };
  EXPECT_EQ(kernels(true), std::vector<int>({3}));
  EXPECT_EQ(kernels(false), std::vector<int>({1, 1, 1}));
}

// A value an earlier pass computed is read back by later passes rather than computed again:
// softmax's last pass divides exp(x - max) by the row sum with no second exp, reading it from
// its own buffer when it is stored, or else from the buffer of the result.
TEST(Compiled, LaterPassesReadBackWhatEarlierPassesStored) {
  mt::Generator gen(6);
  mt::Tensor x = mt::randn({5, 40}, mt::f32, &gen);
  mt::eval({x});
  mt::Tensor e = mt::exp(x - mt::max(x, {1}, true));
  mt::Tensor y = e / mt::sum(e, {1}, true);
  std::vector<mt::Node*> pending = mt::nodes_in_tape_order({y.node()});
  std::erase_if(pending, [](mt::Node* n) { return n->evaluated(); });
  std::vector<mt::FusionGroup> groups = mt::fuse(pending, {e.node().get(), y.node().get()}, {});
  ASSERT_EQ(groups.size(), 1u);
  mt::LoweredKernel lowered = mt::lower(groups[0]);
  ASSERT_EQ(lowered.kernel.pass_count(), 3);
  int32_t e_param = -1;
  for (size_t i = 0; i < lowered.nodes.size(); ++i)
    if (lowered.nodes[i] == e.node().get() && lowered.kernel.params[i].output)
      e_param = static_cast<int32_t>(i);
  ASSERT_GE(e_param, 0);
  auto count = [](const std::vector<mt::kir::Value>& body, auto&& match) {
    return std::count_if(body.begin(), body.end(), match);
  };
  auto is_ldexp = [](const mt::kir::Value& v) { return v.op == mt::kir::Op::Ldexp; };
  std::vector<mt::kir::Value> exp_pass = lowered.kernel.later_passes[0].body;
  std::vector<mt::kir::Value> last_pass = lowered.kernel.later_passes[1].body;
  EXPECT_EQ(count(exp_pass, is_ldexp), 1);
  EXPECT_EQ(count(last_pass, is_ldexp), 0) << mt::kir::to_string(lowered.kernel);
  EXPECT_EQ(count(last_pass,
                  [&](const mt::kir::Value& v) {
                    return v.op == mt::kir::Op::Load && v.param == e_param;
                  }),
            1);
  // Unstored, exp(x - max) waits in the result's buffer: the pass of the sum leaves it there,
  // the last pass reads it back before it stores the quotient over it.
  groups = mt::fuse(pending, {y.node().get()}, {});
  ASSERT_EQ(groups.size(), 1u);
  lowered = mt::lower(groups[0]);
  ASSERT_EQ(lowered.kernel.pass_count(), 3);
  ASSERT_EQ(lowered.nodes.size(), 2u);  // x and y
  const mt::kir::Pass& sum_pass = lowered.kernel.later_passes[0];
  const mt::kir::Pass& quotient_pass = lowered.kernel.later_passes[1];
  EXPECT_EQ(count(quotient_pass.body, is_ldexp), 0) << mt::kir::to_string(lowered.kernel);
  ASSERT_EQ(sum_pass.stores.size(), 1u);
  EXPECT_EQ(sum_pass.stores[0].param, 1);
  EXPECT_EQ(
      count(quotient_pass.body,
            [&](const mt::kir::Value& v) { return v.op == mt::kir::Op::Load && v.param == 1; }),
      1);
  // And the results are the reference's.
  auto [reference, compiled] = both([&] {
    mt::Tensor e2 = mt::exp(x - mt::max(x, {1}, true));
    return mt::concat({e2, e2 / mt::sum(e2, {1}, true)}, 0);
  });
  expect_close_f32(reference, compiled, 2e-6);
}

// A value kept in an output's buffer is read back only after the pass that stored it: here exp(x)
// is first needed in pass 1 (o1 = e + r0) but only kept, in o3's buffer, by pass 2 (found by the
// review; pass 1 read o3's buffer before anything was written there).
TEST(Compiled, AKeptValueIsReadOnlyAfterThePassThatStoredIt) {
  mt::Generator gen(8);
  mt::Tensor x = mt::randn({3, 50}, mt::f32, &gen);
  mt::eval({x});
  auto program = [&] {
    mt::Tensor r0 = mt::sum(x, {-1}, true), r1 = mt::sum(x * r0, {-1}, true);
    mt::Tensor e = mt::exp(x), o1 = e + r0;
    mt::Tensor r2 = mt::sum(e * r1, {-1}, true), r3 = mt::sum((o1 + e) * r2, {-1}, true);
    return mt::concat({e * r3, o1}, 0);
  };
  for (int run = 0; run < 2; ++run) {  // the second run reuses the first one's freed blocks
    auto [reference, compiled] = both(program);
    expect_close_f32(reference, compiled, 1e-4);
  }
}

TEST(Compiled, APointwiseChainIsOneKernelAndTheSecondRunCompilesNothing) {
  mt::set_device(mt::Device::cpu);
  mt::Tensor x = mt::tensor(std::vector<float>(1000, 1.5f), {10, 100});
  mt::Tensor b = mt::tensor(std::vector<float>(100, 0.25f), {100});
  auto program = [&] { return mt::relu(x * 2.0 + b) - mt::sigmoid(x); };
  mt::eval({program()});
  mt::reset_execution_stats();
  mt::Tensor again = program();
  mt::eval({again});
  mt::ExecutionStats stats = mt::execution_stats();
  EXPECT_EQ(stats.kernels, 1);
  EXPECT_GE(stats.kernel_nodes, 5);
  EXPECT_EQ(stats.kernels_compiled + stats.kernels_from_disk, 0);  // counted from the reset
  EXPECT_EQ(stats.bytes_written, 1000 * 4);
  EXPECT_FLOAT_EQ(again.to_vector<float>()[0], 3.25f - 1.0f / (1.0f + std::exp(-1.5f)));
  {
    mt::eager_scope eager;
    mt::reset_execution_stats();
    mt::eval({program()});
    EXPECT_GE(mt::execution_stats().kernels, 5);  // one per op
  }
  mt::set_device(mt::Device::reference);
}

// Pointwise kernels walk a contiguous run as one dim (kir::collapse_dims): the same chain over
// [128, 64], [8192] and [64, 2, 64] is one code, which the second and third shapes take from the
// first's compile; a broadcast operand keeps its dim apart; the bits are the reference's.
TEST(Compiled, PointwiseKernelsOfOneRunShareTheirCode) {
  mt::set_device(mt::Device::cpu);
  std::vector<std::vector<int64_t>> dims;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) { dims.push_back(k.kernel.dims); });
  std::vector<float> values(8192);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.001f * static_cast<float>(i) - 3.0f;
  auto chain = [&](const mt::Shape& shape) {
    mt::Tensor x = mt::tensor(values, shape);
    return mt::tanh(x * 1.5 + 0.25);
  };
  mt::Tensor first = chain({128, 64});
  mt::eval({first});
  int64_t compiled_before = mt::execution_stats().kernels_compiled;
  mt::Tensor flat = chain({8192});
  mt::eval({flat});  // alone: evaluated together, the two would be one multi-tensor launch
  mt::Tensor deeper = chain({64, 2, 64});
  mt::eval({deeper});
  EXPECT_EQ(mt::execution_stats().kernels_compiled, compiled_before)
      << "one code for every shape of the run";
  mt::Tensor bias = mt::tensor(std::vector<float>(64, 0.5f), {64});
  mt::Tensor broadcast = mt::tensor(values, {128, 64}) * 2.0 + bias;
  mt::eval({broadcast});
  mt::set_kernel_observer({});
  ASSERT_EQ(dims.size(), 4u);
  EXPECT_EQ(dims[0], (std::vector<int64_t>{8192}));
  EXPECT_EQ(dims[1], (std::vector<int64_t>{8192}));
  EXPECT_EQ(dims[2], (std::vector<int64_t>{8192}));
  EXPECT_EQ(dims[3], (std::vector<int64_t>{128, 64}));
  std::vector<float> got = deeper.to_vector<float>(), wide = broadcast.to_vector<float>();
  mt::set_device(mt::Device::reference);
  EXPECT_EQ(got, chain({64, 2, 64}).to_vector<float>());
  EXPECT_EQ(wide, (mt::tensor(values, {128, 64}) * 2.0 + bias).to_vector<float>());
}

// A reduction's outer dims and its reduced dims collapse apart: a sum over the two trailing dims
// of [8, 64, 16] is one loop of 1024 per outer point, a whole-tensor mean of [4096, 16] one loop
// of 65536 (it was a loop of 16 per row, its lanes summed each row), within the reference's
// rounding.
TEST(Compiled, ReductionsCollapseTheirOuterAndReducedDimsApart) {
  mt::set_device(mt::Device::cpu);
  std::vector<std::vector<int64_t>> dims;
  std::vector<int> reduce_from;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) {
    dims.push_back(k.kernel.dims);
    reduce_from.push_back(k.kernel.reduce_from);
  });
  mt::Generator gen(5);
  mt::Tensor x = mt::randn({8, 64, 16}, mt::f32, &gen), y = mt::randn({4096, 16}, mt::f32, &gen);
  mt::eval({x, y});
  // A sum over the batch of [4, 160, 128] stays a column reduction over 128 columns: merged,
  // its 20480 outer points would outgrow the column accumulators (kir::Kernel::max_columns).
  mt::Tensor wide = mt::randn({4, 160, 128}, mt::f32, &gen);
  mt::eval({wide});
  auto inner = [&] { return mt::sum(x * 2.0, {1, 2}); };
  auto whole = [&] { return mt::mean(mt::square(y - 0.5)); };
  auto batch = [&] { return mt::sum(wide * 2.0, {0}); };
  auto [inner_reference, inner_compiled] = both(inner);
  auto [whole_reference, whole_compiled] = both(whole);
  bool column = false;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) {
    dims.push_back(k.kernel.dims);
    column = k.kernel.column_reduction();
  });
  auto [batch_reference, batch_compiled] = both(batch);
  mt::set_kernel_observer({});
  ASSERT_EQ(dims.size(), 3u);
  EXPECT_EQ(dims[0], (std::vector<int64_t>{8, 1024}));
  EXPECT_EQ(reduce_from[0], 1);
  EXPECT_EQ(dims[1], (std::vector<int64_t>{1, 65536}));
  EXPECT_EQ(reduce_from[1], 1);
  EXPECT_EQ(dims[2], (std::vector<int64_t>{160, 128, 4}));
  EXPECT_TRUE(column);
  expect_close_f32(inner_reference, inner_compiled, 1e-5);
  expect_close_f32(whole_reference, whole_compiled, 1e-5);
  expect_close_f32(batch_reference, batch_compiled, 1e-5);
}

// One-element kernels (the optimizer's step count, bias corrections and learning-rate casts)
// are one launch: Adam's scalar work is one kernel a step. Two of them that a group between
// connects (the second reads a product the first feeds) stay two, and compute what the reference
// does.
TEST(Compiled, OneElementKernelsMergeUnlessAKernelBetweenConnectsThem) {
  mt::set_device(mt::Device::cpu);
  int single = 0, launches = 0;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) {
    ++launches;
    int64_t n = 1;
    for (int64_t d : k.kernel.dims) n *= d;
    if (!k.kernel.multi_tensor && n == 1) ++single;
  });
  mt::manual_seed(3);
  mt::MLP net({8, 16, 4}, mt::Activation::Relu);
  mt::AdamW opt(net.parameters(), {.lr = 1e-2});
  mt::Tensor x = mt::randn({32, 8}), y = mt::randn({32, 4});
  mt::eval({x, y});
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    mt::mse_loss(net(x), y).backward();
    single = launches = 0;
    opt.step();
  }
  EXPECT_EQ(single, 1) << "of " << launches << " launches";

  mt::Tensor a = mt::tensor(std::vector<float>{1.5f}, {1, 1});
  mt::Tensor w = mt::tensor(std::vector<float>{0.75f}, {1, 1});
  auto program = [&] {
    mt::Tensor twice = a * 2.0 + 1.0;                            // one element
    mt::Tensor product = mt::matmul(twice, w);                   // a library call reading it
    return std::vector<mt::Tensor>{twice, product * 0.5 - 3.0};  // one element reading that
  };

  single = 0;
  std::vector<mt::Tensor> got = program();
  mt::eval(got);
  mt::set_kernel_observer({});
  EXPECT_EQ(single, 2);
  double twice = got[0].item(), last = got[1].item();
  mt::set_device(mt::Device::reference);
  std::vector<mt::Tensor> want = program();
  EXPECT_EQ(twice, want[0].item());
  EXPECT_EQ(last, want[1].item());
}

// A training loop whose learning rate changes every step, as under a schedule: the rate and
// Adam's bias corrections are launch-time scalars, so once the step's shape settles nothing is
// fused, lowered or compiled again; and the results still follow the reference executor.
TEST(Compiled, ATrainingStepIsBuiltOnceAndReplayedWithNewScalars) {
  auto train = [](mt::Device device, std::vector<mt::ExecutionStats>& per_step) {
    mt::set_device(device);
    mt::Generator gen(11);
    mt::MLP model({8, 16, 4}, mt::Activation::Relu, &gen);
    mt::Adam optimizer(model.parameters(), mt::AdamOptions{});
    mt::Tensor x = mt::randn({32, 8}, mt::f32, &gen);
    mt::Tensor y = mt::randn({32, 4}, mt::f32, &gen);
    for (int step = 0; step < 4; ++step) {
      optimizer.set_lr(1e-2 / (step + 1));
      mt::reset_execution_stats();
      optimizer.zero_grad();
      mt::Tensor loss = mt::mse_loss(model(x), y);
      loss.backward();
      optimizer.step();
      per_step.push_back(mt::execution_stats());
    }
    return model.parameters()[0].to_vector<float>();
  };
  std::vector<mt::ExecutionStats> reference_stats, stats;
  std::vector<float> reference = train(mt::Device::reference, reference_stats);
  std::vector<float> compiled = train(mt::Device::cpu, stats);
  mt::set_device(mt::Device::reference);
  for (size_t i = 0; i < reference.size(); ++i) ASSERT_NEAR(reference[i], compiled[i], 1e-5) << i;
  // The first step differs from the rest: Adam's moments start as fills, later they are stored.
  EXPECT_GE(stats[0].programs_built, 1);
  EXPECT_GE(stats[1].programs_built, 1);
  for (size_t step = 2; step < stats.size(); ++step) {
    EXPECT_EQ(stats[step].programs_built, 0) << "step " << step;
    EXPECT_GE(stats[step].programs_reused, 1) << "step " << step;
    EXPECT_EQ(stats[step].kernels_compiled + stats[step].kernels_from_disk, 0) << "step " << step;
    EXPECT_GE(stats[step].kernels, 1);
  }
}

// The memory plan drops each stored value after its last reader in the step, unless something
// outside the step still holds it.
TEST(Compiled, StoredValuesLiveOnlyUntilTheirLastReader) {
  mt::set_device(mt::Device::cpu);
  mt::Generator gen(3);
  mt::MLP model({64, 256, 256, 256, 256, 8}, mt::Activation::Relu, &gen);
  mt::Adam optimizer(model.parameters(), mt::AdamOptions{});
  mt::Tensor x = mt::randn({512, 64}, mt::f32, &gen);
  mt::Tensor y = mt::randn({512, 8}, mt::f32, &gen);
  std::vector<float> reference;
  for (int step = 0; step < 2; ++step) {
    optimizer.zero_grad();
    mt::Tensor loss = mt::mse_loss(model(x), y);
    loss.backward();
    mt::reset_execution_stats();
    optimizer.step();
    mt::ExecutionStats stats = mt::execution_stats();
    // Four 512x256 f32 activations are stored for backward (and more gradients besides); they
    // are not all alive at once.
    EXPECT_GT(stats.bytes_written, 4 * 512 * 256 * 4);
    EXPECT_GT(stats.peak_bytes, 0);
    EXPECT_LT(stats.peak_bytes, stats.bytes_written * 3 / 4);
    // The loss itself is not part of the step's graph (no gradient reads it), so reading it runs
    // its last kernels, from the model output the step stored, but no matmul of the forward.
    mt::reset_execution_stats();
    float value = loss.item();
    EXPECT_EQ(mt::execution_stats().gemms, 0);
    EXPECT_LE(mt::execution_stats().kernels, 2);
    EXPECT_TRUE(std::isfinite(value));
  }
  mt::set_device(mt::Device::reference);
}

// A reshape of a stored value that a matmul reads shares the value's buffer: no copy kernel.
TEST(Compiled, AReshapeOfAStoredValueSharesItsBuffer) {
  mt::set_device(mt::Device::cpu);
  mt::Generator gen(9);
  mt::Tensor a = mt::randn({4, 6, 8}, mt::f32, &gen);
  mt::Tensor w = mt::randn({8, 5}, mt::f32, &gen);
  mt::eval({a, w});
  mt::Tensor rows = a.reshape({24, 8});
  mt::Tensor product = mt::matmul(rows, w);
  mt::reset_execution_stats();
  mt::eval({product});
  EXPECT_EQ(mt::execution_stats().kernels, 0);
  EXPECT_EQ(mt::execution_stats().gemms, 1);
  ASSERT_TRUE(rows.node()->evaluated());
  EXPECT_EQ(rows.node()->value, a.node()->value);
  std::vector<float> got = product.to_vector<float>(), av = a.to_vector<float>(),
                     wv = w.to_vector<float>();
  for (int i = 0; i < 24; ++i)
    for (int j = 0; j < 5; ++j) {
      double expected = 0;
      for (int k = 0; k < 8; ++k) expected += double(av[i * 8 + k]) * wv[k * 5 + j];
      ASSERT_NEAR(got[i * 5 + j], expected, 1e-5 * (1 + std::fabs(expected)));
    }
  mt::set_device(mt::Device::reference);
}

// A custom op whose forward result a matmul computes shares that result's buffer: it runs the
// kernels the same matmul of its (detached) inputs runs, no copy kernel more. The gradient is
// the vjp's.
TEST(Compiled, ACustomOpOverAMatmulSharesItsResult) {
  mt::set_device(mt::Device::cpu);
  mt::Generator gen(9);
  mt::Tensor a = mt::randn({6, 8}, mt::f32, &gen), w = mt::randn({8, 5}, mt::f32, &gen);
  w.requires_grad_(true);
  mt::eval({a, w});
  auto forward = [](const std::vector<mt::Tensor>& in) { return mt::matmul(in[0], in[1]); };
  auto vjp = [](const std::vector<mt::Tensor>& in, const mt::Tensor&, const mt::Tensor& g) {
    return std::vector<mt::Tensor>{mt::Tensor(), mt::matmul(in[0], g, true, false) * 2.0};
  };
  auto run = [](const mt::Tensor& t) {
    mt::reset_execution_stats();
    mt::eval({t});
    return mt::execution_stats();
  };
  mt::ExecutionStats plain = run(mt::matmul(a.detach(), w.detach()));
  mt::Tensor product = mt::custom_op({a, w}, forward, vjp);
  mt::ExecutionStats custom = run(product);
  EXPECT_EQ(custom.kernels, plain.kernels);
  EXPECT_EQ(custom.kernel_nodes, plain.kernel_nodes);
  EXPECT_EQ(custom.gemms, 1);
  EXPECT_EQ(product.to_vector<float>(), mt::matmul(a, w.detach()).to_vector<float>());
  mt::sum(mt::square(product)).backward();
  std::vector<float> expected =
      (mt::matmul(a, product.detach() * 2.0, true, false) * 2.0).to_vector<float>();
  EXPECT_EQ(w.grad().to_vector<float>(), expected);
  mt::set_device(mt::Device::reference);
}

TEST(Compiled, ColumnSumsSplitAcrossThreadsGiveTheSameBits) {
  // A bias gradient (the sum over a matrix's rows) has no outer dims to split: threads split the
  // columns (kir::Kernel::column_split), and each column still adds its rows in order.
  mt::Generator gen(9);
  mt::Tensor rows = mt::randn({4096, 96}, mt::f32, &gen);
  mt::Tensor upstream = mt::randn({4096, 96}, mt::f32, &gen);
  mt::eval({rows, upstream});
  auto program = [&] { return mt::sum(mt::relu(rows) * upstream * 0.5, {0}); };
  bool split = false;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) { split |= k.kernel.column_split(); });
  auto [reference, compiled] = both(program);
  mt::set_kernel_observer({});
  EXPECT_TRUE(split);
  const float* r = reinterpret_cast<const float*>(reference.data());
  const float* c = reinterpret_cast<const float*>(compiled.data());
  for (size_t i = 0; i < reference.size() / 4; ++i)
    ASSERT_NEAR(r[i], c[i], 1e-4 * (1 + std::fabs(r[i]))) << "column " << i;
#ifdef MIXTAPE_TEST_HAS_OMP
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  auto [unused1, one_thread] = both(program);
  omp_set_num_threads(2);
  auto [unused2, two_threads] = both(program);
  omp_set_num_threads(saved);
  EXPECT_EQ(one_thread, two_threads);
  EXPECT_EQ(one_thread, compiled);
#endif
}

// A column's sum as the CPU back end adds it: its rows in order, in blocks of
// mt::sum_chain_terms rows summed in f32, the blocks' sums added in f64, rounded to f32 once.
float blocked_column_sum(const std::function<float(int)>& term, int rows) {
  double total = 0;
  for (int start = 0; start < rows; start += static_cast<int>(mt::sum_chain_terms)) {
    float block = 0;
    for (int r = start; r < std::min<int>(rows, start + mt::sum_chain_terms); ++r) block += term(r);
    total += block;
  }
  return static_cast<float>(total);
}

// Column sums add each column's rows in order (in blocks, blocked_column_sum), sixteen columns
// at a time in vector registers and the columns left over one by one: the same bits either way,
// for f32 columns read through arithmetic (40 columns: on two threads a block of 16 and 4 left
// over each) and for bf16 columns (72: four blocks and 8 left over), rounded to bf16 at the end.
TEST(Compiled, ColumnSumsAreBlockedSequentialSumsPerColumnBitForBit) {
  mt::set_device(mt::Device::cpu);
  mt::Generator gen(11);
  mt::Tensor rows = mt::randn({4096, 40}, mt::f32, &gen), upstream = mt::randn({4096, 40});
  mt::Tensor halves = mt::randn({1000, 72}, mt::f32, &gen).to(mt::bf16);
  mt::eval({rows, upstream, halves});
  std::vector<float> sums = mt::sum(mt::relu(rows) * upstream * 0.5, {0}).to_vector<float>();
  mt::Tensor half_sums = mt::sum(halves, {0});
  mt::eval({half_sums});
  const mt::Storage& stored = *half_sums.node()->value;
  ASSERT_EQ(stored.dtype, mt::bf16);
  std::vector<float> x = rows.to_vector<float>(), u = upstream.to_vector<float>();
  for (int c = 0; c < 40; ++c) {
    float acc = blocked_column_sum(
        [&](int r) {
          float relu = x[r * 40 + c] > 0 ? x[r * 40 + c] : 0.0f;
          return relu * u[r * 40 + c] * 0.5f;
        },
        4096);
    ASSERT_EQ(std::bit_cast<uint32_t>(acc), std::bit_cast<uint32_t>(sums[c])) << "column " << c;
  }
  std::vector<float> h = halves.to_vector<float>();
  const uint16_t* got = reinterpret_cast<const uint16_t*>(stored.host_data());
  for (int c = 0; c < 72; ++c) {
    float acc = blocked_column_sum([&](int r) { return h[r * 72 + c]; }, 1000);
    ASSERT_EQ(mt::f32_to_bf16_bits(acc), got[c]) << "column " << c;
  }
  mt::set_device(mt::Device::reference);
}

// A fast sum over short rows (a batch norm's statistics over [N, 4 * 4] and [N, 8 * 8]) keeps a
// vector of sixteen partial sums per sixteen elements of a row, across all its rows; at the end
// the vectors are added in order and then their lanes: the emitter fixes the split, so the bits
// are those of that order, whatever the pipeline.
TEST(Compiled, SumsOverShortRowsKeepOnePartialSumPerLane) {
  mt::set_device(mt::Device::cpu);
  mt::Generator gen(13);
  for (int64_t row : {16, 64}) {
    SCOPED_TRACE(row);
    mt::Tensor x = mt::randn({64, 32, row}, mt::f32, &gen);
    mt::eval({x});
    std::vector<float> got = mt::sum(x * 1.5, {0, 2}).to_vector<float>();
    std::vector<float> v = x.to_vector<float>();
    for (int64_t c = 0; c < 32; ++c) {
      std::vector<float> lanes(static_cast<size_t>(row), 0.0f);  // block b's lane l at 16 b + l
      for (int64_t n = 0; n < 64; ++n)
        for (int64_t e = 0; e < row; ++e) lanes[e] += v[(n * 32 + c) * row + e] * 1.5f;
      for (int64_t e = 16; e < row; ++e) lanes[e % 16] += lanes[e];  // blocks in order, per lane
      float sum = 0;
      for (int l = 0; l < 16; ++l) sum += lanes[l];
      ASSERT_EQ(std::bit_cast<uint32_t>(sum), std::bit_cast<uint32_t>(got[c])) << "channel " << c;
    }
  }
  mt::set_device(mt::Device::reference);
}

// A two-pass kernel over short rows (a batch norm's variance: the mean's sum, then the centred
// squares' sum, which reads it) keeps the partial-sum lanes in both passes: each sum's bits are
// that order, lanes added in order at the end.
TEST(Compiled, TwoPassSumsOverShortRowsKeepTheirLanesInBothPasses) {
  mt::set_device(mt::Device::cpu);
  mt::Generator gen(17);
  std::vector<int> passes;
  mt::set_kernel_observer(
      [&](const mt::LoweredKernel& k) { passes.push_back(k.kernel.pass_count()); });
  auto lane_order_sum = [](const std::vector<float>& terms) {  // terms of one channel, in order
    std::vector<float> lanes(16, 0.0f);
    size_t row = terms.size() / 64;
    std::vector<float> blocks(row, 0.0f);
    for (size_t n = 0; n < 64; ++n)
      for (size_t e = 0; e < row; ++e) blocks[e] += terms[n * row + e];
    for (size_t e = 0; e < row; ++e) lanes[e % 16] += blocks[e];
    float sum = 0;
    for (float lane : lanes) sum += lane;
    return sum;
  };
  for (int64_t row : {16, 32}) {
    SCOPED_TRACE(row);
    passes.clear();
    mt::Tensor x = mt::randn({64, 8, row}, mt::f32, &gen);
    mt::eval({x});
    const double scale = 1.0 / static_cast<double>(64 * row);
    mt::Tensor mean = mt::sum(x, {0, 2}, true) * scale;
    mt::Tensor centred = x - mean;
    std::vector<float> got = mt::sum(centred * centred, {0, 2}).to_vector<float>();
    ASSERT_EQ(std::count(passes.begin(), passes.end(), 2), 1) << "one kernel of two passes";
    std::vector<float> v = x.to_vector<float>();
    for (int64_t c = 0; c < 8; ++c) {
      std::vector<float> terms;
      for (int64_t n = 0; n < 64; ++n)
        for (int64_t e = 0; e < row; ++e) terms.push_back(v[(n * 8 + c) * row + e]);
      const float m = lane_order_sum(terms) * static_cast<float>(scale);
      for (float& t : terms) t = (t - m) * (t - m);
      ASSERT_EQ(std::bit_cast<uint32_t>(lane_order_sum(terms)), std::bit_cast<uint32_t>(got[c]))
          << "channel " << c;
    }
  }
  mt::set_kernel_observer({});
  mt::set_device(mt::Device::reference);
}

// A long f32 sum keeps its accuracy whatever its count and whichever schedule adds it: a whole
// tensor, long rows, many rows of columns (vector columns, and columns read through a call,
// which take the column loop), short rows, and whole-tensor sums sharing one multi-tensor
// launch. Before blocked sums, 2^22 values of 0.1 summed 6e-4 off (PyTorch's cascade sum:
// 1.5e-7 whole, 6e-7 by columns); now every sum is within 1e-6 of the f64 sum of its terms.
TEST(Compiled, LongF32SumsStayAccurate) {
  mt::set_device(mt::Device::cpu);
  constexpr int64_t n = int64_t(40) << 16;  // 2.6 million: 40 columns, 64 rows, 32 x 16 blocks
  mt::Generator gen(41);
  mt::Tensor tenths = mt::full({n}, 0.1, mt::f32);
  mt::Tensor uniform = mt::rand({n}, mt::f32, &gen);
  for (const mt::Tensor& x : {tenths, uniform}) {
    std::vector<float> v = x.to_vector<float>();
    auto exact = [&](int64_t first, int64_t count, int64_t step, double (*f)(double)) {
      double sum = 0;
      for (int64_t i = 0; i < count; ++i) sum += f(v[static_cast<size_t>(first + i * step)]);
      return sum;
    };
    auto same = [](double t) { return t; };
    auto check = [](double got, double want, const char* what, int64_t index) {
      ASSERT_LE(std::fabs(got - want), 1e-6 * std::fabs(want)) << what << " " << index;
    };
    std::vector<mt::Tensor> wholes = {mt::sum(x), mt::sum(x * 2.0), mt::sum(x.reshape({64, -1}))};
    mt::eval(wholes);  // one multi-tensor launch of three segments
    check(wholes[0].item(), exact(0, n, 1, same), "whole", 0);
    check(wholes[1].item(), 2 * exact(0, n, 1, same), "whole doubled", 0);
    check(wholes[2].item(), exact(0, n, 1, same), "whole reshaped", 0);
    std::vector<double> rows = mt::sum(x.reshape({64, n / 64}), {1}).to_vector<double>();
    for (int64_t r = 0; r < 64; ++r) check(rows[r], exact(r * (n / 64), n / 64, 1, same), "row", r);
    std::vector<double> columns = mt::sum(x.reshape({n / 40, 40}), {0}).to_vector<double>();
    for (int64_t c = 0; c < 40; ++c) check(columns[c], exact(c, n / 40, 40, same), "column", c);
    std::vector<double> logs =
        mt::sum(mt::log(x.reshape({n / 40, 40}) + 1.0), {0}).to_vector<double>();
    for (int64_t c = 0; c < 40; ++c) {
      double want = exact(c, n / 40, 40, [](double t) {
        return static_cast<double>(std::log(static_cast<float>(t) + 1.0f));
      });
      check(logs[c], want, "log column", c);
    }
    // A body calling the C library (fmod: no vector form) leaves the row's loop scalar, one
    // chain per block, which must still be short.
    std::vector<double> fmods =
        mt::sum(mt::fmod(x.reshape({64, n / 64}) * 3.0, mt::full({}, 1.0, mt::f32)), {1})
            .to_vector<double>();
    for (int64_t r = 0; r < 64; ++r) {
      double want = exact(r * (n / 64), n / 64, 1, [](double t) {
        return static_cast<double>(std::fmod(static_cast<float>(t) * 3.0f, 1.0f));
      });
      check(fmods[r], want, "fmod row", r);
    }
    std::vector<double> short_rows =
        mt::sum(x.reshape({n / 512, 32, 16}), {0, 2}).to_vector<double>();
    for (int64_t c = 0; c < 32; ++c) {
      double want = 0;
      for (int64_t b = 0; b < n / 512; ++b) want += exact(b * 512 + c * 16, 16, 1, same);
      check(short_rows[c], want, "short-row channel", c);
    }
  }
  mt::set_device(mt::Device::reference);
}

// A view below a reshape (a per-channel statistic broadcast over [N, C, H * W], read as
// [N, C, H, W]) is read through its own map inside its reader's kernel: no kernel stores the
// broadcast. Where the reshape's flat index does not split into the view's coordinates (a
// transpose read back flat), the view is still stored first; both match the reference.
TEST(Compiled, ViewsBelowAReshapeKeepTheirMaps) {
  mt::set_device(mt::Device::cpu);
  std::vector<size_t> stored_full;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) {
    if (!k.kernel.is_reduction()) stored_full.push_back(k.kernel.stores.size());
  });
  mt::Generator gen(23);
  mt::Tensor x = mt::randn({4, 6, 3, 5}, mt::f32, &gen), s = mt::randn({6}, mt::f32, &gen);
  mt::Tensor t = mt::randn({6, 10}, mt::f32, &gen);
  mt::eval({x, s, t});
  auto statistic = [&] {
    mt::Tensor wide = mt::broadcast_to(mt::reshape(s, {1, 6, 1}), {4, 6, 15});
    return x * mt::reshape(wide, {4, 6, 3, 5});
  };
  auto transposed = [&] { return mt::reshape(mt::permute(t, {1, 0}), {6, 10}) * 2.0; };
  auto [statistic_reference, statistic_compiled] = both(statistic);
  ASSERT_EQ(stored_full, (std::vector<size_t>{1})) << "one kernel, storing the product only";
  stored_full.clear();
  auto [transposed_reference, transposed_compiled] = both(transposed);
  mt::set_kernel_observer({});
  EXPECT_EQ(statistic_reference, statistic_compiled);
  EXPECT_EQ(transposed_reference, transposed_compiled);
  mt::set_device(mt::Device::reference);
}

// A view read by kernels on both sides of a host step (a statistic broadcast over the image,
// read by the forward and the backward kernels) is copied into both: each reads the statistic
// through the broadcast, and no kernel stores the broadcast whole.
TEST(Compiled, AViewReadBySeveralKernelsIsCopiedIntoEach) {
  mt::set_device(mt::Device::cpu);
  size_t stores = 0, kernels = 0;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) {
    ++kernels;
    stores += k.kernel.stores.size() + k.kernel.epilogue_stores.size();
  });
  mt::Generator gen(29);
  mt::Tensor x = mt::randn({4, 6, 5}, mt::f32, &gen), s = mt::randn({6}, mt::f32, &gen);
  mt::eval({x, s});
  auto program = [&] {
    mt::Tensor wide = mt::broadcast_to(mt::reshape(s, {1, 6, 1}), {4, 6, 5});
    return mt::cumsum(x * wide, 2) * wide;
  };
  auto [reference, compiled] = both(program);
  EXPECT_EQ(kernels, 2u);
  EXPECT_EQ(stores, 2u) << "the two products only";
  EXPECT_EQ(reference, compiled);
  // A view of a pointwise value of its size stays stored by its first reader, which computes
  // the value too: copied, the value would need a kernel of its own.
  kernels = stores = 0;
  auto permuted = [&] {
    mt::Tensor p = mt::permute(mt::exp(x), {2, 1, 0});
    return mt::cumsum(p * 2.0, 0) + p;
  };
  auto [permuted_reference, permuted_compiled] = both(permuted);
  mt::set_kernel_observer({});
  EXPECT_EQ(kernels, 2u);
  EXPECT_EQ(permuted_reference, permuted_compiled);
  mt::set_device(mt::Device::reference);
}

TEST(Compiled, FlushDenormalIsOptInAndReversible) {
  // 1e-20 * 1e-20 is subnormal in f32, and so is 2e-39 * 3: IEEE keeps both, flush-to-zero
  // (mt::set_flush_denormal, as torch.set_flush_denormal) gives 0 for a subnormal result and
  // reads a subnormal input as 0.
  mt::Device before = mt::current_device();
  mt::set_device(mt::Device::cpu);
  auto x = mt::tensor(std::vector<float>{1e-20f, 2e-39f, 1.0f}, {3});
  auto run = [&] {
    std::vector<float> small = (x * 1e-20).to_vector<float>(),
                       tripled = (x * 3.0).to_vector<float>();
    return std::vector<float>{small[0], tripled[1], small[2], tripled[2]};
  };
  EXPECT_FALSE(mt::flush_denormal());
  std::vector<float> ieee = run();
  EXPECT_GT(ieee[0], 0.0f);
  EXPECT_LT(ieee[0], std::numeric_limits<float>::min());
  EXPECT_EQ(ieee[1], 2e-39f * 3.0f);
  ASSERT_TRUE(mt::set_flush_denormal(true));
  std::vector<float> flushed = run();
  mt::set_flush_denormal(false);
  EXPECT_EQ(flushed[0], 0.0f);
  EXPECT_EQ(flushed[1], 0.0f);
  EXPECT_EQ(flushed[2], 1e-20f);  // normal values are untouched
  EXPECT_EQ(flushed[3], 3.0f);
  EXPECT_EQ(run(), ieee);  // and IEEE again once it is off
  mt::set_device(before);
}

TEST(Compiled, AllowTf32IsOffByDefaultAndLeavesCpuMatmulsF32) {
  // TF32 is a cuda-device setting (tests/gpu checks it takes effect there): the CPU's f32
  // matmuls stay IEEE f32 products whatever it says.
  mt::Generator gen(5);
  mt::Tensor a = mt::randn({33, 70}, mt::f32, &gen), b = mt::randn({70, 21}, mt::f32, &gen);
  EXPECT_FALSE(mt::allow_tf32());
  std::vector<float> strict = mt::matmul(a, b).to_vector<float>();
  mt::set_allow_tf32(true);
  EXPECT_TRUE(mt::allow_tf32());
  std::vector<float> asked = mt::matmul(a, b).to_vector<float>();
  mt::set_allow_tf32(false);
  EXPECT_EQ(asked, strict);
}

TEST(Compiled, FloatMaxOrdersSignedZerosAndPropagatesNan) {
  // Max reductions run on integer order keys in the compiled kernels (so that they vectorize);
  // the reference defines the same order: -0 below +0 in either position, any NaN gives the
  // quiet NaN. Rows (last axis) and columns (axis 0, a column reduction) of every case.
  const float inf = INFINITY, nan = NAN;
  std::vector<float> rows = {-0.0f, 0.0f,  -1.0f, -2.0f,  0.0f, -0.0f, -3.0f, -5.0f,
                             -inf,  -inf,  -inf,  -inf,   1.0f, nan,   7.0f,  -nan,
                             -7.5f, -2.5f, -9.0f, -2.25f, inf,  3.0f,  -0.0f, 1e-40f};
  for (mt::DType dtype : {mt::f32, mt::bf16, mt::f64})
    for (int64_t axis : {1, 0}) {
      auto program = [&] { return mt::max(mt::tensor(rows, {6, 4}, dtype), {axis}); };
      auto [reference, compiled] = both(program);
      EXPECT_EQ(reference, compiled) << mt::name(dtype) << " axis " << axis;
    }
  mt::Device previous = mt::current_device();
  mt::set_device(mt::Device::cpu);
  std::vector<float> got = mt::max(mt::tensor(rows, {6, 4}), {1}).to_vector<float>();
  mt::set_device(previous);
  EXPECT_FALSE(std::signbit(got[0]));
  EXPECT_FALSE(std::signbit(got[1]));
  EXPECT_EQ(got[2], -inf);
  EXPECT_TRUE(std::isnan(got[3]));
  EXPECT_EQ(got[4], -2.25f);
  EXPECT_EQ(got[5], inf);
}

TEST(Compiled, EmittedLlvmIrForABf16ChainIsStable) {
  // A golden check of the emitter's output for a small mixed-precision group: bf16 storage is
  // converted with integer operations, exp is inline arithmetic (scalar_math.h's exp_steps, its
  // power of two from exponent bits) and other math calls go to the C library.
  auto x = mt::tensor(std::vector<float>{1, 2, 3, 4}, {4}, mt::bf16);
  mt::Tensor y = mt::log(mt::exp(x)) * 2.0;
  std::vector<mt::Node*> pending = mt::nodes_in_tape_order({y.node()});
  std::erase_if(pending, [](mt::Node* n) { return n->evaluated(); });
  std::vector<mt::FusionGroup> groups = mt::fuse(pending, {y.node().get()}, {});
  ASSERT_EQ(groups.size(), 1u);
  mt::LoweredKernel lowered = mt::lower(groups[0]);
  std::string ir = mt::emit_llvm(lowered.kernel);
  EXPECT_NE(ir.find("declare float @logf(float)"), std::string::npos) << ir;
  EXPECT_EQ(ir.find("@expf"), std::string::npos) << ir;
  EXPECT_NE(ir.find("shl i32 %"), std::string::npos) << ir;
  EXPECT_NE(ir.find("bitcast i32 %"), std::string::npos) << ir;
  EXPECT_NE(ir.find("load i16"), std::string::npos) << ir;
  EXPECT_NE(ir.find("store i16"), std::string::npos) << ir;
  EXPECT_NE(ir.find("and i32 %"), std::string::npos) << ir;  // RNE to bf16 in integer ops
  EXPECT_EQ(ir.find("bfloat"), std::string::npos) << ir;
  // Each buffer its own alias scope, so that loops vectorize without runtime overlap checks.
  EXPECT_NE(ir.find("load i16, ptr %t2, !alias.scope !4, !noalias !6"), std::string::npos) << ir;
  EXPECT_NE(ir.find(", !alias.scope !5, !noalias !7"), std::string::npos) << ir;
  EXPECT_NE(ir.find("!6 = !{!3}"), std::string::npos) << ir;
  EXPECT_NE(ir.find("!7 = !{!2}"), std::string::npos) << ir;
  EXPECT_EQ(lowered.kernel.params.size(), 2u);
}

TEST(Compiled, CudaWithoutAGpuIsAClearError) {
  if (mt::cuda_backend_available()) GTEST_SKIP() << "CUDA is available on this machine";
  mt::Device before = mt::current_device();
  EXPECT_MT_ERROR(mt::set_device(mt::Device::cuda), "device cuda", "CUDA is not available",
                  mt::cuda_backend_unavailable_reason());
  EXPECT_EQ(mt::current_device(), before);  // the failed selection changed nothing
}

// Multi-tensor steps: the per-parameter optimizer updates of a network without biases (every
// gradient is a matmul's, so every update is a pointwise kernel of its own).
enum class Update { SgdMomentum, Adam, AdamW, ScaledF16 };

struct UpdateRun {
  std::vector<std::vector<std::byte>> params;  // the final values' bytes
  std::vector<mt::ExecutionStats> stats;       // per step
  std::vector<int64_t> segments;               // of each multi-tensor launch, all steps
  std::set<std::string> multi_kernels;         // their names
  // Multi-tensor form listing -> the names of the ordinary kernels of that form that ran, and
  // the forms of the multi-tensor kernels that ran.
  std::map<std::string, std::set<std::string>> per_shape_kernels;
  std::set<std::string> multi_forms;
  std::vector<float> losses;
};

UpdateRun train_updates(Update kind, mt::Device device, bool multi_tensor) {
  mt::set_multi_tensor_steps(multi_tensor);
  mt::set_device(device);
  UpdateRun run;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) {
    if (k.kernel.multi_tensor) {
      run.segments.push_back(static_cast<int64_t>(k.nodes.size() / k.kernel.params.size()));
      run.multi_kernels.insert(k.kernel.name);
      mt::kir::Kernel unnamed = k.kernel;
      unnamed.name.clear();
      run.multi_forms.insert(mt::kir::to_string(unnamed));
      return;
    }
    std::vector<bool> zero_rank;
    for (mt::Node* node : k.nodes) zero_rank.push_back(node->shape.empty());
    if (auto form = mt::kir::multi_tensor_form(k.kernel, zero_rank))
      run.per_shape_kernels[mt::kir::to_string(*form)].insert(k.kernel.name);
  });
  mt::Generator gen(23);
  std::vector<int64_t> widths = {12, 24, 20, 16, 6};
  std::vector<mt::Tensor> weights;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    mt::Shape shape = {widths[l], widths[l + 1]};
    mt::Tensor init = mt::randn(shape, mt::f32, &gen) * 0.3;
    weights.push_back(mt::tensor(init.to_vector<float>(), shape).requires_grad_());
  }
  mt::Tensor x = mt::randn({32, 12}, mt::f32, &gen);
  mt::Tensor y = mt::randn({32, 6}, mt::f32, &gen);
  mt::eval({x, y});
  std::unique_ptr<mt::Optimizer> optimizer;
  // Hyperparameters no other test uses: the kernels compiled here are this test's own (the
  // multi-tensor ones fit every shape, so any other Adam of the same options would share them).
  if (kind == Update::SgdMomentum)
    optimizer = std::make_unique<mt::SGD>(weights, mt::SGDOptions{.lr = 0.05, .momentum = 0.85});
  else if (kind == Update::AdamW)
    optimizer = std::make_unique<mt::AdamW>(
        weights, mt::AdamOptions{.lr = 1e-2, .beta1 = 0.85, .beta2 = 0.995, .weight_decay = 0.01});
  else
    optimizer = std::make_unique<mt::Adam>(
        weights, mt::AdamOptions{.lr = 1e-2, .beta1 = 0.85, .beta2 = 0.995});
  mt::GradScaler scaler({.enabled = kind == Update::ScaledF16});
  mt::PolicyPtr policy = mt::policy_by_name(kind == Update::ScaledF16 ? "autocast-f16" : "fp32");
  for (int step = 0; step < 4; ++step) {
    mt::reset_execution_stats();
    optimizer->zero_grad();
    mt::Tensor loss;
    {
      mt::autocast guard(policy);
      mt::Tensor h = x;
      for (size_t l = 0; l < weights.size(); ++l) {
        h = mt::matmul(h, weights[l]);
        if (l + 1 < weights.size()) h = mt::relu(h);
      }
      loss = mt::mse_loss(h, y);
    }
    scaler.scale(loss).backward();
    scaler.step(*optimizer);
    scaler.update();
    for (mt::Tensor& w : weights) mt::eval({w});
    run.stats.push_back(mt::execution_stats());
    run.losses.push_back(loss.item());
  }
  mt::set_kernel_observer({});
  for (mt::Tensor& w : weights) {
    const mt::Storage& s = *w.node()->value;
    run.params.emplace_back(s.host_data(), s.host_data() + s.size_bytes());
  }
  mt::set_device(mt::Device::reference);
  mt::set_multi_tensor_steps(true);
  return run;
}

std::string update_name(Update kind) {
  static const char* names[] = {"SgdMomentum", "Adam", "AdamW", "ScaledF16"};
  return names[static_cast<int>(kind)];
}

class MultiTensorUpdates : public ::testing::TestWithParam<Update> {};

// Each update is bit for bit what the per-parameter kernels compute (pointwise kernels are
// exact); the step runs one kernel for the four updates instead of four, and that kernel is
// compiled once for all four shapes.
TEST_P(MultiTensorUpdates, MatchPerParameterKernelsBitForBitInOneLaunch) {
  Update kind = GetParam();
  UpdateRun reference = train_updates(kind, mt::Device::reference, false);
  UpdateRun separate = train_updates(kind, mt::Device::cpu, false);
  UpdateRun merged = train_updates(kind, mt::Device::cpu, true);
  const int64_t params = 4;
  ASSERT_EQ(merged.params.size(), static_cast<size_t>(params));
  for (size_t p = 0; p < merged.params.size(); ++p) {
    EXPECT_EQ(merged.params[p], separate.params[p]) << "param " << p;
    ASSERT_EQ(reference.params[p].size(), merged.params[p].size());
    const float* r = reinterpret_cast<const float*>(reference.params[p].data());
    const float* c = reinterpret_cast<const float*>(merged.params[p].data());
    for (size_t i = 0; i < reference.params[p].size() / 4; ++i)
      ASSERT_NEAR(r[i], c[i], 1e-4 * (1 + std::fabs(r[i]))) << "param " << p << " at " << i;
  }
  EXPECT_EQ(merged.losses, separate.losses);
  EXPECT_TRUE(separate.segments.empty());
  // One multi-tensor launch per step over every parameter's update. Under the GradScaler the
  // unscale fuses into each update, and a second launch holds the selects that keep Adam's two
  // moments when a gradient is not finite (two kernels per parameter before). The inf checks
  // before them (a whole-gradient sum each) share a launch too, but for the last, whose
  // epilogue also combines the four into the flag.
  std::vector<int64_t> per_step = {params};
  if (kind == Update::ScaledF16) per_step = {params - 1, params, 2 * params};
  std::vector<int64_t> expected_segments;
  int64_t kernels_saved = 0;
  for (int64_t segments : per_step) kernels_saved += segments - 1;
  for (int step = 0; step < 4; ++step)
    expected_segments.insert(expected_segments.end(), per_step.begin(), per_step.end());
  EXPECT_EQ(merged.segments, expected_segments);
  for (size_t step = 0; step < merged.stats.size(); ++step)
    EXPECT_EQ(merged.stats[step].kernels, separate.stats[step].kernels - kernels_saved)
        << "step " << step;
  // Without multi-tensor steps each form ran as one kernel per shape; with them, one kernel per
  // form serves all four shapes. Every other kernel `separate` compiled already: `merged`
  // compiles at most its multi-tensor kernels (fewer when an earlier test's optimizer of the
  // same form compiled them: their extents are launch arguments).
  EXPECT_EQ(merged.multi_kernels.size(), merged.multi_forms.size());
  EXPECT_LE(merged.multi_forms.size(), 2 * per_step.size());  // the first step's differ
  for (const std::string& form : merged.multi_forms) {
    bool inf_check = form.find("reduce from 0") != std::string::npos;
    EXPECT_EQ(separate.per_shape_kernels[form].size(),
              static_cast<size_t>(inf_check ? params - 1 : params))
        << form;
  }
  int64_t compiled = 0;
  for (const mt::ExecutionStats& s : merged.stats)
    compiled += s.kernels_compiled + s.kernels_from_disk;
  EXPECT_LE(compiled, static_cast<int64_t>(merged.multi_kernels.size()));
}

INSTANTIATE_TEST_SUITE_P(Compiled, MultiTensorUpdates,
                         ::testing::Values(Update::SgdMomentum, Update::Adam, Update::AdamW,
                                           Update::ScaledF16),
                         [](const auto& info) { return update_name(info.param); });

// Kernels of the same structure merge only when neither needs the other: `b` reads `a` through a
// matmul, so they stay apart, while `d` (independent of both) joins `b`. Segments of different
// ranks and sizes, one of them a broadcast 0-d read, and enough elements to split across threads
// inside and across segments.
// A program run on the reference, then on the CPU without and with multi-tensor steps: each
// run's outputs and kernel count, and the segments of every multi-tensor launch.
struct ThreeWays {
  std::vector<mt::Tensor> outs[3];
  int64_t kernels[3] = {0, 0, 0};
  std::vector<int64_t> segments;
};

ThreeWays run_three_ways(const std::function<void(std::vector<mt::Tensor>&)>& program) {
  ThreeWays runs;
  mt::set_kernel_observer([&](const mt::LoweredKernel& k) {
    if (k.kernel.multi_tensor)
      runs.segments.push_back(static_cast<int64_t>(k.nodes.size() / k.kernel.params.size()));
  });
  for (int run = 0; run < 3; ++run) {
    mt::set_device(run == 0 ? mt::Device::reference : mt::Device::cpu);
    mt::set_multi_tensor_steps(run == 2);
    mt::reset_execution_stats();
    program(runs.outs[run]);
    runs.kernels[run] = mt::execution_stats().kernels;
  }
  mt::set_kernel_observer({});
  mt::set_multi_tensor_steps(true);
  mt::set_device(mt::Device::reference);
  return runs;
}

TEST(Compiled, MultiTensorStepsKeepDependentKernelsApart) {
  auto program = [](std::vector<mt::Tensor>& outs) {
    mt::Generator gen(31);
    mt::Tensor scale = mt::tensor(std::vector<float>{0.75f}, {});
    auto update = [&](const mt::Tensor& p, const mt::Tensor& g) { return p * scale + g * 0.5; };
    mt::Tensor p1 = mt::randn({8, 8}, mt::f32, &gen), g1 = mt::randn({8, 8}, mt::f32, &gen);
    mt::Tensor w = mt::randn({8, 8}, mt::f32, &gen), p2 = mt::randn({8, 8}, mt::f32, &gen);
    mt::Tensor p3 = mt::randn({300, 500}, mt::f32, &gen), g3 = mt::randn({300, 500}, mt::f32, &gen);
    mt::Tensor p4 = mt::randn({70001}, mt::f32, &gen), g4 = mt::randn({70001}, mt::f32, &gen);
    mt::eval({scale, p1, g1, w, p2, p3, g3, p4, g4});
    mt::Tensor a = update(p1, g1);
    mt::Tensor b = update(p2, mt::matmul(a, w));
    outs = {a, b, update(p3, g3), update(p4, g4)};
    mt::eval(outs);
  };
  ThreeWays runs = run_three_ways(program);
  const int64_t* kernels = runs.kernels;
  const std::vector<int64_t>& segments = runs.segments;
  std::vector<std::vector<float>> results[3];
  for (int run = 0; run < 3; ++run)
    for (mt::Tensor& t : runs.outs[run]) results[run].push_back(t.to_vector<float>());
  EXPECT_EQ(kernels[1], 4);
  EXPECT_EQ(kernels[2], 2);  // a; then b, c and d in one launch
  EXPECT_EQ(segments, std::vector<int64_t>({3}));
  for (size_t o = 0; o < results[0].size(); ++o) {
    EXPECT_EQ(results[1][o], results[2][o]) << "output " << o;
    if (o != 1)  // pointwise from the same inputs: exact
      EXPECT_EQ(results[0][o], results[2][o]) << "output " << o;
    else
      for (size_t i = 0; i < results[0][o].size(); ++i)
        ASSERT_NEAR(results[0][o][i], results[2][o][i], 1e-5 * (1 + std::fabs(results[0][o][i])));
  }
}

// Whole-tensor sums of independent tensors share a launch, each segment swept whole: with
// enough elements the threads take segments by their share of the elements (one tensor holds
// most of them), and an empty tensor's sum is still stored.
TEST(Compiled, WholeTensorSumsShareALaunchAndSplitBySegment) {
  std::vector<int64_t> sizes = {3, 0, 200'000, 1, 4097, 0, 65'536, 17, 300'000, 5};
  auto program = [&](std::vector<mt::Tensor>& outs) {
    mt::Generator gen(37);
    std::vector<mt::Tensor> inputs;
    for (int64_t n : sizes) inputs.push_back(mt::randn({n}, mt::f32, &gen));
    mt::eval(inputs);
    outs.clear();
    for (const mt::Tensor& x : inputs) outs.push_back(mt::sum(x * x - 0.5));
    mt::eval(outs);
  };
  ThreeWays runs = run_three_ways(program);
  const int64_t* kernels = runs.kernels;
  const std::vector<int64_t>& segments = runs.segments;
  std::vector<double> results[3];
  for (int run = 0; run < 3; ++run)
    for (mt::Tensor& t : runs.outs[run]) results[run].push_back(t.item());
  EXPECT_EQ(kernels[2], 1);
  EXPECT_EQ(kernels[1], static_cast<int64_t>(sizes.size()));
  EXPECT_EQ(segments, std::vector<int64_t>({static_cast<int64_t>(sizes.size())}));
  for (size_t o = 0; o < sizes.size(); ++o) {
    double tolerance = 1e-5 * static_cast<double>(sizes[o]);
    EXPECT_NEAR(results[1][o], results[0][o], tolerance) << "sum " << o;
    EXPECT_NEAR(results[2][o], results[0][o], tolerance) << "sum " << o;
    if (sizes[o] == 0) {
      EXPECT_EQ(results[2][o], 0.0) << "sum " << o;
    }
  }
}

}  // namespace
