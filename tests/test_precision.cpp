// tests/test_precision.cpp -- the precision-policy pass and the executor's faithfulness to it:
// built-in decisions per op category, backward precision, mt::autocast scopes, overrides and user
// policies, exact f16/bf16 results against hand-worked values, gradient underflow, the precision
// report, and a bf16 autocast step against PyTorch's CPU autocast on the same weights.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include <mixtape/mixtape.h>

#include <fmt/format.h>

#include "mixtape/dsl/json.h"
#include "test_util.h"
#include "torch_side.h"

namespace mt = mixtape;

namespace {

using mt::OpCode;

// ---------------------------------------------------------------------------------------------
// Independent references.

// Round-to-nearest-even into a binary format with `bits` significant bits, smallest normal
// exponent `min_exponent` and largest finite value `max_finite`: scale to units of the format's
// spacing at v (exact for powers of two), round with the FPU's default ties-to-even, scale back.
double round_to_format(double v, int bits, int min_exponent, double max_finite) {
  if (v == 0 || !std::isfinite(v)) return v;
  int exponent = 0;
  std::frexp(v, &exponent);  // |v| = m * 2^exponent with m in [0.5, 1)
  int lead = std::max(exponent - 1, min_exponent);
  double quantum = std::ldexp(1.0, lead - (bits - 1));
  double r = std::nearbyint(v / quantum) * quantum;
  if (std::abs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), v);
  return r;
}
double to_f16(double v) { return round_to_format(v, 11, -14, 65504.0); }
double to_bf16(double v) { return round_to_format(v, 8, -126, 0x1.fep127); }
double to_half(mt::DType t, double v) { return t == mt::f16 ? to_f16(v) : to_bf16(v); }
// The spacing of the half type `t` at v.
double ulp_of(mt::DType t, double v) {
  int exponent = 0;
  std::frexp(v, &exponent);
  const int bits = t == mt::f16 ? 11 : 8, min_exponent = t == mt::f16 ? -14 : -126;
  return std::ldexp(1.0, std::max(exponent - 1, min_exponent) - (bits - 1));
}

TEST(IndependentRounding, AgreesWithKnownValues) {
  // The helper the executor is checked against, checked itself against worked values.
  EXPECT_EQ(to_f16(0.1), 0.0999755859375);
  EXPECT_EQ(to_f16(1 + std::ldexp(1, -11)), 1.0);  // a tie: to the even neighbour
  EXPECT_EQ(to_f16(1 + 3 * std::ldexp(1, -11)), 1 + std::ldexp(1, -9));
  EXPECT_EQ(to_f16(std::ldexp(1, -25)), 0.0);                     // half the smallest subnormal
  EXPECT_EQ(to_f16(3 * std::ldexp(1, -26)), std::ldexp(1, -24));  // above half: rounds up
  EXPECT_EQ(to_f16(65519.0), 65504.0);
  EXPECT_TRUE(std::isinf(to_f16(65520.0)));
  EXPECT_EQ(to_bf16(1 + std::ldexp(1, -9)), 1.0);
  EXPECT_EQ(to_bf16(90000.0), 90112.0);
  EXPECT_EQ(to_bf16(1e-30), 162 * std::ldexp(1.0, -107));  // spacing 2^-107 there
}

mt::Tensor values(std::vector<float> v, mt::Shape shape) { return mt::tensor(v, shape); }

// A row of the precision report for one tensor.
mt::PrecisionRow row_of(const mt::Tensor& t) {
  for (const mt::PrecisionRow& row : mt::precision_report({t}).rows)
    if (row.id == t.node()->id) return row;
  ADD_FAILURE() << "no report row for node " << t.node()->id;
  return {};
}

struct Decision {
  mt::DType storage, compute, accum;
  bool operator==(const Decision&) const = default;
};
std::ostream& operator<<(std::ostream& out, const Decision& d) {
  return out << "{storage " << mt::name(d.storage) << ", compute " << mt::name(d.compute)
             << ", accum " << mt::name(d.accum) << "}";
}
Decision decision_of(const mt::Tensor& t) {
  mt::PrecisionRow row = row_of(t);
  EXPECT_FALSE(row.rule.empty()) << "node " << row.id << " (" << row.op << ") has no rule";
  return {row.storage, row.compute, row.accum};
}

// Nodes made by one call: markers (scalar constants) made before and after it bracket their ids.
struct IdRange {
  uint64_t first_marker, last_marker;
  bool contains(uint64_t id) const { return id > first_marker && id < last_marker; }
};
IdRange made_by(const std::function<void()>& call) {
  uint64_t first = mt::scalar(0).node()->id;
  call();
  return {first, mt::scalar(0).node()->id};
}

// Every node `outputs` depend on, by an independent walk.
std::vector<const mt::Node*> reachable(const std::vector<mt::Tensor>& outputs) {
  std::vector<const mt::Node*> nodes, stack;
  std::unordered_set<const mt::Node*> seen;
  for (const mt::Tensor& t : outputs) stack.push_back(t.node().get());
  while (!stack.empty()) {
    const mt::Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    nodes.push_back(n);
    for (const mt::NodePtr& input : n->inputs) stack.push_back(input.get());
  }
  return nodes;
}

// ---------------------------------------------------------------------------------------------
// 1. Built-in policies: decisions per op category.

struct PolicyUnderTest {
  std::string name;
  mt::PolicyPtr policy;
  enum Kind { Fp32, Autocast, Pure } kind;
  mt::DType half;  // f32 for the fp32 policy
};
std::vector<PolicyUnderTest> builtin_policies() {
  return {{"fp32", mt::fp32_policy(), PolicyUnderTest::Fp32, mt::f32},
          {"autocast-f16", mt::autocast_policy(mt::f16), PolicyUnderTest::Autocast, mt::f16},
          {"autocast-bf16", mt::autocast_policy(mt::bf16), PolicyUnderTest::Autocast, mt::bf16},
          {"pure-f16", mt::pure_policy(mt::f16), PolicyUnderTest::Pure, mt::f16},
          {"pure-bf16", mt::pure_policy(mt::bf16), PolicyUnderTest::Pure, mt::bf16}};
}

TEST(BuiltinPolicies, DecideEachCategoryAsDocumented) {
  const mt::DType f32 = mt::f32;
  for (const PolicyUnderTest& p : builtin_policies()) {
    SCOPED_TRACE(p.name);
    EXPECT_EQ(p.policy->name(), p.name);
    EXPECT_EQ(mt::policy_by_name(p.name)->name(), p.name);
    const bool fp32 = p.kind == PolicyUnderTest::Fp32, pure = p.kind == PolicyUnderTest::Pure;
    const mt::DType H = p.half;
    const Decision half{H, H, f32}, full{f32, f32, f32};
    mt::Tensor x = values({0.5f, -1.5f, 2.0f, 0.25f}, {2, 2});  // made outside: f32 leaves
    mt::Tensor w = values({1.0f, 0.1f, -0.3f, 2.0f}, {2, 2});
    mt::Tensor x64 = mt::tensor(std::vector<double>{0.1, 0.2}, {1, 2});
    mt::autocast guard(p.policy);
    mt::Tensor m = mt::matmul(x, w), m2 = mt::matmul(w, x);
    // low-ok: matmul in the half type with f32 accumulation, also inside linear (bias add too).
    EXPECT_EQ(decision_of(m), half);
    mt::Tensor lin = mt::linear(x, w, values({0.5f, 0.5f}, {2}));
    EXPECT_EQ(lin.node()->op, OpCode::Add);
    EXPECT_EQ(decision_of(lin), half) << row_of(lin).rule;
    // fp32-compute: whatever the input is stored as.
    for (auto [name, y] :
         std::vector<std::pair<const char*, mt::Tensor>>{{"exp", mt::exp(m)},
                                                         {"log", mt::log(mt::abs(m))},
                                                         {"tanh", mt::tanh(m)},
                                                         {"pow", mt::pow(m, 2.0)},
                                                         {"rsqrt", mt::rsqrt(mt::abs(m))},
                                                         {"erf", mt::erf(m)},
                                                         {"reciprocal", mt::reciprocal(m)}}) {
      EXPECT_EQ(decision_of(y), full) << name << ": " << row_of(y).rule;
    }
    // fp32-accum: stored in f32, reading the input as it is stored.
    EXPECT_EQ(decision_of(mt::sum(m)), (Decision{f32, H, f32}));
    // The scans too (autocast's fp32 list on CUDA has cumsum and cumprod; its CPU kernels
    // accumulate in f32): what they run along is read as stored.
    EXPECT_EQ(decision_of(mt::cumsum(m, 1)), (Decision{f32, H, f32}));
    EXPECT_EQ(decision_of(mt::cumprod(m, 0)), (Decision{f32, H, f32}));
    EXPECT_EQ(decision_of(mt::logcumsumexp(m, 1)), (Decision{f32, H, f32}));
    // A sort's values follow their input, as torch.sort and topk keep the input's type.
    EXPECT_EQ(decision_of(mt::sort(m, 1).values), half);
    EXPECT_EQ(decision_of(mt::topk(m, 1, 0).values), half);
    // promote: the widest input, except that pure runs everything in the half type.
    EXPECT_EQ(decision_of(m + x), pure ? half : full);
    EXPECT_EQ(decision_of(m + m2), half);
    // Data that is f16 from the start: f16 + f32 is f32 (tracing casts it up); pure: the half.
    mt::Tensor data16 = mt::tensor(std::vector<float>{0.5f, 2.0f, 1.0f, 3.0f}, {2, 2}, mt::f16);
    EXPECT_EQ(decision_of(data16 + x), pure ? half : full);
    // A scalar constant is weak, as a Python number in PyTorch: it does not widen the op.
    EXPECT_EQ(decision_of(m * 0.5), half);
    EXPECT_EQ(decision_of(0.5 - m), half);
    const Decision data16_decision{pure ? H : mt::f16, pure ? H : mt::f16, f32};
    EXPECT_EQ(decision_of(data16 + 1.0), data16_decision);
    // follow: unary ops take their input's type (pure: the half type).
    EXPECT_EQ(decision_of(mt::relu(m)), half);
    EXPECT_EQ(decision_of(mt::relu(x)), pure ? half : full);
    EXPECT_EQ(decision_of(mt::reshape(m, {4})), half);
    // An explicit cast keeps the type asked for, even against the policy's half type.
    mt::DType other = H == mt::f16 ? mt::bf16 : mt::f16;
    EXPECT_EQ(decision_of(mt::cast(x, other)), (Decision{other, other, f32}));
    EXPECT_EQ(decision_of(mt::cast(m, mt::f64)), (Decision{mt::f64, mt::f64, mt::f64}));
    // Leaves keep their own type: data as stored, generators as traced.
    EXPECT_EQ(decision_of(values({1.0f}, {1})), full);
    EXPECT_EQ(decision_of(mt::tensor(std::vector<float>{1.0f}, {1}, mt::f16)),
              (Decision{mt::f16, mt::f16, f32}));
    EXPECT_EQ(decision_of(mt::randn({2})), full);
    EXPECT_EQ(decision_of(mt::full({2}, 3.0)), full);
    // Integers, bools and f64 are never touched; a comparison compares in its value's stored
    // type (the number rounded to it).
    EXPECT_EQ(decision_of(mt::arange(4) + 1), (Decision{mt::i64, mt::i64, f32}));
    EXPECT_EQ(decision_of(m > 0.0), (Decision{mt::boolean, fp32 ? f32 : H, f32}));
    EXPECT_EQ(decision_of(mt::exp(x64)), (Decision{mt::f64, mt::f64, mt::f64}));
    EXPECT_EQ(decision_of(mt::matmul(x64, mt::transpose(x64))),
              (Decision{mt::f64, mt::f64, mt::f64}));
    // Every node softmax, layer_norm, cross_entropy and prod make runs in f32 (fp32 lists), even
    // on a half input.
    mt::Tensor targets = mt::tensor(std::vector<int64_t>{1, 0}, {2});
    for (auto [name, call] : std::vector<std::pair<const char*, std::function<mt::Tensor()>>>{
             {"softmax", [&] { return mt::softmax(m, -1); }},
             {"log_softmax", [&] { return mt::log_softmax(m2, 0); }},
             {"layer_norm",
              [&] {
                return mt::layer_norm(m, values({1.5f, 0.5f}, {2}), mt::Tensor());
              }},
             {"cross_entropy", [&] { return mt::cross_entropy(m, targets); }},
             {"mse_loss", [&] { return mt::mse_loss(m, m2); }},
             {"prod", [&] { return mt::prod(m, 1); }}}) {
      mt::Tensor y;
      IdRange range = made_by([&] { y = call(); });
      int checked = 0;
      for (const mt::PrecisionRow& row : mt::precision_report({y}).rows) {
        if (!range.contains(row.id) || !mt::is_floating(row.traced)) continue;
        ++checked;
        EXPECT_EQ((Decision{row.storage, row.compute, row.accum}), full)
            << name << ": node " << row.id << " " << row.op << ": " << row.rule;
        if (!fp32 && row.op != "full" && row.op != "constant" && row.op != "cast") {
          EXPECT_NE(row.rule.find(name), std::string::npos) << row.rule;
        }
      }
      EXPECT_GE(checked, 3) << name;
    }
    // On half data the composites widen their input themselves (dsl/composites.h): without a
    // policy their inside is f32 and only what they return is rounded to the data's type; under
    // autocast and pure policies their casts run in f32 with the rest, and what they return
    // stays f32.
    for (auto [name, call] : std::vector<std::pair<const char*, std::function<mt::Tensor()>>>{
             {"softmax", [&] { return mt::softmax(data16, -1); }},
             {"log_softmax", [&] { return mt::log_softmax(data16, 0); }},
             {"logsumexp", [&] { return mt::logsumexp(data16, {1}); }},
             {"layer_norm", [&] { return mt::layer_norm(data16, mt::Tensor(), mt::Tensor()); }},
             {"rms_norm", [&] { return mt::rms_norm(data16, mt::Tensor()); }},
             {"cross_entropy", [&] { return mt::cross_entropy(data16, targets); }},
             {"nll_loss", [&] { return mt::nll_loss(data16, targets); }}}) {
      mt::Tensor y;
      IdRange range = made_by([&] { y = call(); });
      int widened = 0;
      for (const mt::PrecisionRow& row : mt::precision_report({y}).rows) {
        if (!range.contains(row.id) || !mt::is_floating(row.traced)) continue;
        widened += row.traced == f32;
        const Decision expected = fp32 ? Decision{row.traced, row.traced, f32} : full;
        EXPECT_EQ((Decision{row.storage, row.compute, row.accum}), expected)
            << name << " on f16 data: node " << row.id << " " << row.op << ": " << row.rule;
      }
      EXPECT_GE(widened, 2) << name;
      EXPECT_EQ(decision_of(y), fp32 ? (Decision{mt::f16, mt::f16, f32}) : full) << name;
    }
    if (fp32) {
      EXPECT_EQ(row_of(m).rule, "fp32: as traced");
    }
  }
}

TEST(BuiltinPolicies, RejectBadArguments) {
  EXPECT_MT_ERROR(mt::autocast_policy(mt::f32), "f16 or bf16", "f32");
  EXPECT_MT_ERROR(mt::pure_policy(mt::i64), "f16 or bf16");
  EXPECT_MT_ERROR(mt::policy_by_name("autocast-f8"), "autocast-f8", "autocast-bf16", "pure-f16");
  EXPECT_MT_ERROR(mt::autocast(mt::PolicyPtr()), "null");
}

// A model with one registered layer, so that its nodes carry the module path "fc".
struct OneLayer : mt::Module {
  mt::Linear fc;
  OneLayer(int64_t in, int64_t out) : fc(in, out) { register_module("fc", fc); }
};

// The policy is recorded on the node when it is made; backward nodes take the forward node's.
TEST(BuiltinPolicies, BackwardNodesTakeThePrecisionOfTheForwardNode) {
  for (mt::DType H : {mt::f16, mt::bf16}) {
    SCOPED_TRACE(mt::name(H));
    OneLayer net(3, 2);
    mt::Tensor x = values({0.5f, -1.0f, 2.0f, 1.5f, 0.25f, -0.75f}, {2, 3});
    x.requires_grad_();
    mt::Tensor loss;
    {
      mt::autocast guard(H);
      mt::Tensor h = net.fc(x);
      mt::ModulePathScope head("head");
      loss = mt::sum(mt::exp(h));
    }
    // Outside the guard, and even under another policy, gradients follow the forward nodes.
    mt::autocast other(mt::pure_policy(H == mt::f16 ? mt::bf16 : mt::f16));
    loss.backward();
    std::vector<mt::Tensor> outputs{loss, x.grad(), net.fc.weight.grad(), net.fc.bias.grad()};
    std::map<std::string, int> backward_rows;
    for (const mt::PrecisionRow& row : mt::precision_report(outputs).rows) {
      if (!row.backward || !mt::is_floating(row.traced) || row.op == "full") continue;
      ++backward_rows[row.module_path];
      if (row.module_path == "head") {  // gradients of exp and sum run in f32
        EXPECT_EQ(row.storage, mt::f32) << row.op << ": " << row.rule;
        EXPECT_TRUE(row.rule.find("gradient of exp") != std::string::npos ||
                    row.rule.find("gradient of sum") != std::string::npos)
            << row.rule;
        EXPECT_NE(row.rule.find("the precision of the forward op"), std::string::npos);
      } else {  // inside fc (linear): the half type, like the forward matmul
        EXPECT_EQ(row.module_path, "fc") << row.op << ": " << row.rule;
        EXPECT_EQ(row.storage, H) << row.op << ": " << row.rule;
        EXPECT_EQ(row.compute, H) << row.op << ": " << row.rule;
        EXPECT_EQ(row.accum, mt::f32);
      }
    }
    EXPECT_GE(backward_rows["head"], 2);
    EXPECT_GE(backward_rows["fc"], 3);
    // The gradients themselves are stored as their producers are: the weight's by a half matmul.
    EXPECT_EQ(row_of(net.fc.weight.grad()).storage, H);
    EXPECT_EQ(row_of(x.grad()).storage, H);
  }
}

// ---------------------------------------------------------------------------------------------
// 2. mt::autocast scopes.

// Type promotion's casts are not explicit casts: under autocast a bf16-stored value plus bf16
// data, an integer tensor or a boolean mask stays bf16, as in PyTorch (bf16 + bf16 is bf16, and
// integer tensors do not widen a float one). Each widened to f32 before.
TEST(Autocast, PromotedOperandsDoNotWidenTheOp) {
  mt::Generator gen(7);
  mt::Tensor x = mt::randn({2, 3}, mt::f32, &gen), w = mt::randn({3, 4}, mt::f32, &gen);
  mt::Tensor data = mt::cast(mt::randn({2, 4}, mt::f32, &gen), mt::bf16);
  mt::Tensor ints = mt::tensor(std::vector<int64_t>{1, -2, 3, 4, 5, 6, -7, 8}, {2, 4});
  mt::Tensor mask = mt::gt(mt::randn({2, 4}, mt::f32, &gen), mt::zeros({2, 4}));
  mt::Tensor m, sums[4];
  {
    mt::autocast guard(mt::bf16);
    m = mt::matmul(x, w);
    sums[0] = m + data;
    sums[1] = m + ints;
    sums[2] = m * mask;
    sums[3] = mt::where(mask, m, data);
  }
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    const mt::PrecisionReport report = mt::precision_report({sums[i]});
    EXPECT_EQ(report.rows.back().storage, mt::bf16) << report.rows.back().rule;
  }
  // The values: bf16 operands added in f32 and rounded once to bf16.
  mt::Tensor expected = mt::cast(mt::cast(m, mt::f32) + mt::cast(data, mt::f32), mt::bf16);
  EXPECT_EQ(mt::cast(sums[0], mt::f32).to_vector<float>(),
            mt::cast(expected, mt::f32).to_vector<float>());
}

// A half value compared with a number meets the number rounded to its type, as PyTorch's
// promotion gives it: bf16(0.1) > 0.1 is false in torch (both are 0.10009765625).
TEST(Autocast, ComparisonsWithANumberRoundItToTheValuesType) {
  mt::Tensor a = mt::tensor(std::vector<float>{0.1f, 0.3f, 1.0f / 3}, {3, 1});
  mt::Tensor one = mt::tensor(std::vector<float>{1}, {1, 1});
  mt::Tensor h, f32_value = mt::tensor(std::vector<float>{0.1f, 0.3f, 1.0f / 3}, {3, 1});
  std::vector<bool> gt, eq, le, wide;
  {
    mt::autocast guard(mt::bf16);
    h = mt::matmul(a, one);  // stored bf16
    gt = (h > 0.1).to_vector<bool>();
    eq = (h == 0.3).to_vector<bool>();
    le = (h <= 1.0 / 3).to_vector<bool>();
    wide = (h > f32_value).to_vector<bool>();  // an f32 tensor promotes: compared in f32
  }
  EXPECT_EQ(gt, (std::vector<bool>{false, true, true}));
  EXPECT_EQ(eq, (std::vector<bool>{false, true, false}));
  EXPECT_EQ(le, (std::vector<bool>{true, true, true}));
  // bf16(0.1) = 0.10009765625 > 0.1f, bf16(0.3) = 0.30078125 > 0.3f, bf16(1/3) = 0.333984375.
  EXPECT_EQ(wide, (std::vector<bool>{true, true, true}));
}

// A 0-d f32 tensor (a learned scale) beside a half value does not widen the op, as
// torch.result_type ranks a 0-d tensor of the same category below dimensioned ones.
TEST(Autocast, AZeroDimTensorBesideAHalfValueKeepsItHalf) {
  mt::Generator gen(7);
  mt::Tensor x = mt::randn({2, 3}, mt::f32, &gen), w = mt::randn({3, 4}, mt::f32, &gen);
  mt::Tensor scale = mt::tensor(std::vector<float>{1.0f / 3}, {});
  mt::Tensor data = mt::cast(mt::randn({2, 4}, mt::f32, &gen), mt::bf16);
  mt::Tensor products[2], reshaped;
  {
    mt::autocast guard(mt::bf16);
    products[0] = mt::matmul(x, w) * scale;
    products[1] = data * scale;
    reshaped = mt::matmul(x, w) * mt::reshape(scale, {1});  // [1]: a tensor like any other
  }
  for (const mt::Tensor& y : products) {
    const mt::PrecisionReport report = mt::precision_report({y});
    EXPECT_EQ(report.rows.back().storage, mt::bf16) << report.rows.back().rule;
  }
  EXPECT_EQ(mt::precision_report({reshaped}).rows.back().storage, mt::f32);
}

// A parameter made by full() counts as the f32 tensor it is, from the first step (before its
// first update it was still a fill, weak as a number, and the op it met stayed bf16 only then).
TEST(Autocast, AParameterMadeByFullWidensTheOpFromTheFirstStep) {
  mt::Generator gen(7);
  mt::Tensor x = mt::randn({2, 3}, mt::f32, &gen), w = mt::randn({3, 4}, mt::f32, &gen);
  mt::Tensor gamma = mt::full({4}, 0.1).requires_grad_();
  mt::Tensor y;
  {
    mt::autocast guard(mt::bf16);
    y = mt::matmul(x, w) * gamma;
  }
  const mt::PrecisionReport report = mt::precision_report({y});
  EXPECT_EQ(report.rows.back().storage, mt::f32) << report.rows.back().rule;
}

// The weak promotion of a mask outlives its input: reading the loss after backward() drops the
// evaluated nodes' inputs, and the policy's question about the mask's cast (whose input it
// read) crashed the gradient's evaluation.
TEST(Autocast, AMaskedLossReadBeforeItsGradientsKeepsTheGradients) {
  mt::Tensor x = mt::tensor(std::vector<float>{1, -2, 3, 4}, {2, 2}).requires_grad_();
  mt::Tensor loss;
  {
    mt::autocast guard(mt::bf16);
    mt::Tensor h = mt::matmul(x, x);
    loss = mt::sum(mt::cast(h * mt::gt(h, mt::zeros({2, 2})), mt::f32));
  }
  loss.backward();
  // PyTorch's (x @ x = [[-5, -10], [15, 10]], exact in bf16).
  EXPECT_EQ(loss.item(), 25.0);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{3, 3, 3, 11}));
}

TEST(Autocast, NestsDisablesAndRestores) {
  mt::Tensor a = values({1.0f, 2.0f}, {1, 2}), b = values({3.0f, 4.0f}, {2, 1});
  auto storage = [](const mt::Tensor& t) { return row_of(t).storage; };
  ASSERT_EQ(mt::current_policy(), nullptr);
  mt::Tensor m[9];
  {
    mt::autocast outer(mt::f16);
    mt::PolicyPtr outer_policy = mt::current_policy();
    ASSERT_NE(outer_policy, nullptr);
    m[0] = mt::matmul(a, b);
    {
      mt::autocast inner(mt::bf16);
      m[1] = mt::matmul(a, b);
      {
        mt::autocast off(false);
        EXPECT_EQ(mt::current_policy(), nullptr);
        m[2] = mt::matmul(a, b);
        {
          mt::autocast again(mt::f16);
          m[3] = mt::matmul(a, b);
        }
        m[4] = mt::matmul(a, b);
      }
      m[5] = mt::matmul(a, b);
    }
    {
      mt::autocast keep(true);  // enabling keeps whatever is active
      EXPECT_EQ(mt::current_policy(), outer_policy);
      m[6] = mt::matmul(a, b);
    }
    m[7] = mt::matmul(a, b);
    EXPECT_EQ(mt::current_policy(), outer_policy);
  }
  EXPECT_EQ(mt::current_policy(), nullptr);
  m[8] = mt::matmul(a, b);
  const mt::DType expected[] = {mt::f16,  mt::bf16, mt::f32, mt::f16, mt::f32,
                                mt::bf16, mt::f16,  mt::f16, mt::f32};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(storage(m[i]), expected[i]) << "matmul " << i;
  EXPECT_EQ(row_of(m[2]).rule, "no policy: as traced");
  EXPECT_EQ(row_of(m[8]).rule, "no policy: as traced");
  {
    mt::autocast enable_nothing(true);  // nothing active: stays off
    EXPECT_EQ(mt::current_policy(), nullptr);
  }
  try {
    mt::autocast guard(mt::bf16);
    throw std::runtime_error("leaving the scope by an exception");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(mt::current_policy(), nullptr);
}

TEST(Autocast, EvaluationAfterTheScopeStillUsesTheRecordedPolicy) {
  mt::Tensor a = values({1 + std::ldexp(1.0f, -9)}, {1, 1}), one = values({1.0f}, {1, 1});
  mt::Tensor y;
  {
    mt::autocast guard(mt::bf16);
    y = mt::matmul(a, one);
  }
  EXPECT_EQ(y.item(), 1.0);  // evaluated in bf16 although evaluated outside the guard
}

// ---------------------------------------------------------------------------------------------
// 3. Overrides and user policies.

TEST(ModulePathMatches, GlobsMatchModulesAndWhatIsInsideThem) {
  struct Case {
    const char* glob;
    const char* path;
    bool match;
  };
  const Case cases[] = {
      {"fc1", "fc1", true},
      {"fc1", "fc1.inner", true},  // a pattern covers everything inside the module
      {"fc1", "fc10", false},      // components are compared whole
      {"fc1", "fc", false},
      {"fc1", "", false},
      {"fc1", "net.fc1", false},  // anchored at the root
      {"blocks.*.attn", "blocks.3.attn", true},
      {"blocks.*.attn", "blocks.12.attn.qkv", true},
      {"blocks.*.attn", "blocks.3.mlp", false},
      {"blocks.*.attn", "blocks.3.attn_dropout", false},
      {"blocks.*.attn", "blocks.attn", false},  // '*' is exactly one component
      {"blocks.*.attn", "blocks.1.2.attn", false},
      {"blocks.*", "blocks.0", true},
      {"blocks.*", "blocks", false},
      {"*.qkv", "attn.qkv", true},
      {"*.qkv", "blocks.0.attn.qkv", false},
      {"**.qkv", "blocks.0.attn.qkv", true},  // '**' spans components ...
      {"**.qkv", "qkv", true},                // ... including none
      {"**.qkv", "blocks.0.attn.qkv_extra", false},
      {"blocks.**.qkv", "blocks.qkv", true},
      {"blocks.**.qkv", "blocks.0.attn.qkv", true},
      {"blocks.**.qkv", "layers.0.qkv", false},
      {"head.**", "head", true},  // a trailing '**' too: the module itself
      {"head.**", "head.fc.w", true},
      {"head.**", "heads", false},
      {"a.**.**", "a", true},
      {"**", "anything.at.all", true},
      {"**", "", true},  // even nodes made outside any module
      {"**.**", "", true},
      {"*", "", false},  // the root has no component for '*' (it retyped the loss before)
      {"*", "fc1", true},
      {"**.*", "", false},
      {"fc*", "", false},
      {"fc*", "fc2", true},
      {"fc*", "fc2.sub", true},
      {"fc*", "head", false},
      {"", "", false},  // an empty pattern matches nothing
      {"", "fc1", false},
  };
  for (const Case& c : cases)
    EXPECT_EQ(mt::module_path_matches(c.glob, c.path), c.match)
        << "'" << c.glob << "' vs '" << c.path << "'";
}

// A matmul made inside the module at `path`.
mt::Tensor matmul_in(const std::string& path) {
  mt::ModulePathScope scope(path);
  return mt::matmul(values({1, 2}, {1, 2}), values({3, 4}, {2, 1}));
}

TEST(OverridePolicy, ByModuleGlob) {
  auto policy = std::make_shared<mt::OverridePolicy>(mt::autocast_policy(mt::f16));
  policy->module("blocks.*.attn", mt::fp32_policy()).module("head", mt::pure_policy(mt::bf16));
  EXPECT_EQ(policy->name(), "autocast-f16+overrides");
  mt::autocast guard(policy);
  const std::pair<const char*, mt::DType> cases[] = {
      {"blocks.0.attn", mt::f32}, {"blocks.11.attn.qkv", mt::f32},
      {"blocks.0.mlp", mt::f16},  {"blocks.0.attn_out", mt::f16},
      {"head", mt::bf16},         {"head.proj", mt::bf16},
      {"headless", mt::f16},      {"", mt::f16}};
  for (auto [path, storage] : cases) {
    mt::PrecisionRow row = row_of(matmul_in(path));
    EXPECT_EQ(row.module_path, path);
    EXPECT_EQ(row.storage, storage) << path << ": " << row.rule;
  }
  EXPECT_EQ(row_of(matmul_in("blocks.2.attn")).rule,
            "override module 'blocks.*.attn' -> fp32: fp32: as traced");
  EXPECT_EQ(row_of(matmul_in("blocks.2.mlp")).rule.rfind("autocast-f16: ", 0), 0u);
  auto everything = std::make_shared<mt::OverridePolicy>(mt::autocast_policy(mt::f16));
  everything->module("**", mt::pure_policy(mt::bf16));
  mt::autocast all(everything);
  for (const char* path : {"", "a", "a.b.c"}) EXPECT_EQ(row_of(matmul_in(path)).storage, mt::bf16);
  EXPECT_EQ(row_of(mt::relu(values({1}, {1}))).storage, mt::bf16) << "pure's relu at the root";
}

// An override that decides no node (a glob with a typo: "block.*" for "blocks.*") is named by
// the precision report, as the model then runs under the base policy without a word.
TEST(OverridePolicy, TheReportNamesOverridesThatDecidedNoNode) {
  auto policy = std::make_shared<mt::OverridePolicy>(mt::autocast_policy(mt::f16));
  policy->module("blocks.*", mt::fp32_policy()).module("block.*", mt::fp32_policy());
  mt::autocast guard(policy);
  mt::PrecisionReport report = mt::precision_report({matmul_in("blocks.0.mlp")});
  ASSERT_EQ(report.unmatched_rules.size(), 1u);
  EXPECT_EQ(report.unmatched_rules[0], "autocast-f16+overrides: module 'block.*' -> fp32");
  EXPECT_NE(report.table().find("override autocast-f16+overrides: module 'block.*' -> fp32 has "
                                "decided no node"),
            std::string::npos);
  EXPECT_EQ(mt::json::parse(report.json()).at("unmatched_rules").size(), 1u);
}

TEST(OverridePolicy, ByOpAlsoCoversTheOpsGradient) {
  auto policy = std::make_shared<mt::OverridePolicy>(mt::autocast_policy(mt::f16));
  policy->op(OpCode::MatMul, mt::fp32_policy());
  mt::Linear fc(2, 2);
  mt::Tensor x = values({1, 2, 3, 4}, {2, 2});
  mt::Tensor y;
  {
    mt::autocast guard(policy);
    y = fc(x);
  }
  mt::Tensor matmul = mt::Tensor(y.node()->inputs[0]);
  ASSERT_EQ(matmul.node()->op, OpCode::MatMul);
  EXPECT_EQ(row_of(matmul).storage, mt::f32);
  EXPECT_EQ(row_of(matmul).rule, "override op matmul -> fp32: fp32: as traced");
  EXPECT_EQ(row_of(y).storage, mt::f16) << "the bias add is not a matmul: " << row_of(y).rule;
  mt::sum(y).backward();
  mt::PrecisionRow grad = row_of(fc.weight.grad());
  EXPECT_TRUE(grad.backward);
  EXPECT_EQ(grad.op, "matmul");
  EXPECT_EQ(grad.storage, mt::f32) << grad.rule;
  EXPECT_NE(grad.rule.find("override op matmul"), std::string::npos) << grad.rule;
}

TEST(OverridePolicy, ByCallableAndFirstMatchingRuleWins) {
  mt::Tensor x = values({0.5f, 1.0f}, {1, 2});
  auto tanh_in_f16 = [](const mt::PrecisionQuery& q) -> std::optional<mt::Precision> {
    if (q.op != OpCode::Tanh || q.backward) return std::nullopt;
    return mt::Precision{mt::f16, mt::f16, mt::f32, "tanh wanted in f16"};
  };
  auto policy = std::make_shared<mt::OverridePolicy>(mt::autocast_policy(mt::bf16));
  policy->rule("tanh in f16", tanh_in_f16);
  {
    mt::autocast guard(policy);
    mt::Tensor t = mt::tanh(x), e = mt::exp(x);
    EXPECT_EQ(row_of(t).storage, mt::f16);
    EXPECT_EQ(row_of(t).rule, "override tanh in f16: tanh wanted in f16");
    EXPECT_EQ(row_of(e).storage, mt::f32) << "other ops fall through to the base";
    EXPECT_EQ(t.to_vector<double>()[0], to_f16(std::tanh(0.5f)));
  }
  // Two rules that both match fc1: the one added first decides.
  auto fc1_first = std::make_shared<mt::OverridePolicy>(mt::autocast_policy(mt::f16));
  fc1_first->module("fc1", mt::fp32_policy()).module("**", mt::pure_policy(mt::bf16));
  auto catch_all_first = std::make_shared<mt::OverridePolicy>(mt::autocast_policy(mt::f16));
  catch_all_first->module("**", mt::pure_policy(mt::bf16)).module("fc1", mt::fp32_policy());
  for (auto [policy_ptr, fc1, fc2] : {std::tuple{fc1_first, mt::f32, mt::bf16},
                                      std::tuple{catch_all_first, mt::bf16, mt::bf16}}) {
    mt::autocast guard(policy_ptr);
    EXPECT_EQ(row_of(matmul_in("fc1")).storage, fc1);
    EXPECT_EQ(row_of(matmul_in("fc2")).storage, fc2);
  }
  // Overrides stack: an OverridePolicy can be the base of another.
  auto stacked = std::make_shared<mt::OverridePolicy>(fc1_first);
  stacked->op(OpCode::MatMul, mt::autocast_policy(mt::f16));
  mt::autocast guard(stacked);
  EXPECT_EQ(row_of(matmul_in("fc1")).storage, mt::f16);
  mt::ModulePathScope scope("fc1");
  EXPECT_EQ(row_of(mt::relu(values({1}, {1}))).storage, mt::f32);  // still fc1_first's rule
}

TEST(OverridePolicy, RejectsIncompleteRules) {
  EXPECT_MT_ERROR(mt::OverridePolicy(nullptr), "base policy is null");
  mt::OverridePolicy policy(mt::fp32_policy());
  EXPECT_MT_ERROR(policy.module("", mt::fp32_policy()), "pattern");
  EXPECT_MT_ERROR(policy.module("fc1", nullptr), "pattern and a policy");
  EXPECT_MT_ERROR(policy.op(OpCode::Exp, nullptr), "null");
  EXPECT_MT_ERROR(policy.rule("nothing", mt::OverridePolicy::Rule()), "'nothing'", "empty");
}

// A user policy: one virtual function. This one runs matmuls (and their gradients) in bf16 and
// everything else as traced, and records what it was asked.
class MatmulsInBf16 : public mt::Policy {
 public:
  MatmulsInBf16() : mt::Policy("matmuls-in-bf16") {}
  mt::Precision decide(const mt::PrecisionQuery& q) const override {
    queries.push_back({q.op, q.category, q.traced, q.input_storage, q.input_is_scalar,
                       q.module_path, q.composite ? q.composite : "", q.backward, q.forward_op});
    if (q.op == OpCode::MatMul) return {mt::bf16, mt::bf16, mt::f32, "user: matmul in bf16"};
    return {q.traced, q.traced, mt::f32, "user: as traced"};
  }
  struct Seen {
    OpCode op;
    mt::Category category;
    mt::DType traced;
    std::vector<mt::DType> input_storage;
    std::vector<bool> input_is_scalar;
    std::string module_path, composite;
    bool backward;
    OpCode forward_op;
  };
  mutable std::vector<Seen> queries;
};

TEST(UserPolicy, SubclassDecidesAndSeesTheQuery) {
  auto policy = std::make_shared<MatmulsInBf16>();
  OneLayer net(2, 1);
  net.fc.weight.assign(values({1 + std::ldexp(1.0f, -9), 1.0f}, {1, 2}));
  net.fc.bias.assign(values({0.0f}, {1}));
  mt::Tensor x = values({1.0f, 3.0f}, {1, 2});
  x.requires_grad_();
  mt::Tensor y, scaled;
  {
    mt::autocast guard(policy);
    y = net.fc(x);
    scaled = y * 0.5;
  }
  mt::sum(scaled).backward();
  EXPECT_EQ(row_of(mt::Tensor(y.node()->inputs[0])).storage, mt::bf16);
  EXPECT_EQ(row_of(y).storage, mt::f32);
  EXPECT_EQ(row_of(y).rule, "user: as traced");
  // (1 + 2^-9) rounds to 1 in bf16: 1*1 + 1*3 + 0.
  EXPECT_EQ(y.item(), 4.0);
  EXPECT_EQ(scaled.item(), 2.0);
  EXPECT_EQ(row_of(x.grad()).storage, mt::bf16) << "gradient of a matmul";
  // What decide() was asked: op, category, types, scalars, module path, composite, pass.
  bool saw_matmul = false, saw_scaled = false, saw_backward_matmul = false;
  for (const MatmulsInBf16::Seen& q : policy->queries) {
    EXPECT_EQ(q.category, mt::op_info(q.op).category);
    if (q.op == OpCode::MatMul && !q.backward) {
      saw_matmul = true;
      EXPECT_EQ(q.module_path, "fc");
      EXPECT_EQ(q.composite, "linear");
      EXPECT_EQ(q.input_storage, (std::vector<mt::DType>{mt::f32, mt::f32}));
    }
    if (q.op == OpCode::Mul && !q.backward) {
      saw_scaled = true;
      EXPECT_EQ(q.composite, "");
      EXPECT_EQ(q.input_is_scalar, (std::vector<bool>{false, true}));
    }
    if (q.op == OpCode::MatMul && q.backward) {
      saw_backward_matmul = true;
      EXPECT_EQ(q.forward_op, OpCode::MatMul);
      EXPECT_EQ(q.composite, "linear");
    }
  }
  EXPECT_TRUE(saw_matmul);
  EXPECT_TRUE(saw_scaled);
  EXPECT_TRUE(saw_backward_matmul);
}

// A policy that says it is pure is asked once per distinct question (the traced loop asks the
// same ones every step); one that does not is asked for every node. Answers are the same.
class CountingPolicy : public mt::Policy {
 public:
  explicit CountingPolicy(bool pure) : mt::Policy("counting"), pure_(pure) {}
  bool pure() const override { return pure_; }
  mt::Precision decide(const mt::PrecisionQuery& q) const override {
    ++asked;
    return {q.op == OpCode::MatMul ? mt::bf16 : q.traced, q.traced, mt::f32,
            fmt::format("counting: {}", mt::op_name(q.op))};
  }
  mutable int asked = 0;

 private:
  bool pure_;
};

TEST(UserPolicy, APurePolicyIsAskedOncePerDistinctQuery) {
  std::vector<std::vector<mt::PrecisionRow>> reports;
  for (bool pure : {false, true}) {
    auto policy = std::make_shared<CountingPolicy>(pure);
    OneLayer net(4, 3);
    int nodes = 0;
    for (int step = 0; step < 3; ++step) {
      mt::autocast guard(policy);
      mt::Tensor y = net.fc(mt::ones({2, 4}));
      std::vector<mt::PrecisionRow> rows = mt::precision_report({y}).rows;
      nodes += static_cast<int>(rows.size());
      if (step == 0) reports.push_back(rows);
    }
    if (pure)
      EXPECT_LT(policy->asked, nodes / 2) << "the second and third steps ask nothing new";
    else
      EXPECT_GE(policy->asked, nodes - 6) << "every node but the leaves";
  }
  ASSERT_EQ(reports[0].size(), reports[1].size());
  for (size_t i = 0; i < reports[0].size(); ++i) {
    EXPECT_EQ(reports[0][i].storage, reports[1][i].storage);
    EXPECT_EQ(reports[0][i].rule, reports[1][i].rule);
  }
  // mixtape's policies are pure; an OverridePolicy is unless a rule of the user's decides.
  EXPECT_TRUE(mt::autocast_policy(mt::bf16)->pure());
  mt::OverridePolicy overrides(mt::autocast_policy(mt::bf16));
  overrides.module("fc", mt::fp32_policy());
  EXPECT_TRUE(overrides.pure());
  overrides.rule("mine", [](const mt::PrecisionQuery&) { return std::nullopt; });
  EXPECT_FALSE(overrides.pure());
}

TEST(UserPolicy, NonFloatDecisionsAreRejected) {
  class Broken : public mt::Policy {
   public:
    Broken() : mt::Policy("broken") {}
    mt::Precision decide(const mt::PrecisionQuery&) const override {
      return {mt::i32, mt::f32, mt::f32, "nonsense"};
    }
  };
  mt::Tensor y;
  {
    mt::autocast guard(std::make_shared<Broken>());
    y = mt::exp(values({1}, {1}));
  }
  EXPECT_MT_ERROR(y.item(), "broken", "exp", "i32");
  // And again: the node stays undecided, not run as traced.
  EXPECT_MT_ERROR(y.item(), "broken", "exp", "i32");
}

// ---------------------------------------------------------------------------------------------
// 4. The executor honours the decisions, bit for bit.

mt::Tensor matmul_under(const mt::PolicyPtr& policy, const mt::Tensor& a, const mt::Tensor& b) {
  std::optional<mt::autocast> guard;
  if (policy) guard.emplace(policy);
  return mt::matmul(a, b);
}

TEST(ExecutorFaithfulness, F16MatmulRoundsInputsAndAccumulatesExactly) {
  const double u = std::ldexp(1.0, -11);  // half of f16's spacing at 1
  mt::PolicyPtr f16 = mt::autocast_policy(mt::f16), bf16 = mt::autocast_policy(mt::bf16);
  // [1 + 2^-11 + 2^-13, 1] . [1, 2^-11]: the first input is not an f16 value and rounds up to
  // 1 + 2^-10; the exact sum 1 + 2^-10 + 2^-11 is then a tie that goes to the even 1 + 2^-9. With
  // unrounded inputs it would be 1 + 2^-10 + 2^-13 -> 1 + 2^-10.
  mt::Tensor a = values({static_cast<float>(1 + u + u / 4), 1.0f}, {1, 2});
  mt::Tensor b = values({1.0f, static_cast<float>(u)}, {2, 1});
  EXPECT_EQ(matmul_under(f16, a, b).item(), 1 + 4 * u);
  EXPECT_EQ(matmul_under(nullptr, a, b).item(), 1 + 2 * u + u / 4);
  // [1, 2^-11, 2^-11] . [1, 1, 1] = 1 + 2^-10 exactly: an f16 accumulator would have lost both
  // small terms (1 + 2^-11 is a tie that rounds back to 1).
  mt::Tensor c = values({1.0f, static_cast<float>(u), static_cast<float>(u)}, {1, 3});
  EXPECT_EQ(matmul_under(f16, c, mt::ones({3, 1})).item(), 1 + 2 * u);
  // bf16 keeps 8 bits: 1 + 2^-9 becomes 1, where f16 and f32 keep it.
  mt::Tensor d = values({static_cast<float>(1 + 4 * u)}, {1, 1});
  EXPECT_EQ(matmul_under(bf16, d, mt::ones({1, 1})).item(), 1.0);
  EXPECT_EQ(matmul_under(f16, d, mt::ones({1, 1})).item(), 1 + 4 * u);
  // ... but bf16 keeps f32's range: 300 * 300 overflows f16 (max 65504), not bf16.
  mt::Tensor e = values({300.0f}, {1, 1});
  EXPECT_TRUE(std::isinf(matmul_under(f16, e, e).item()));
  EXPECT_EQ(matmul_under(bf16, e, e).item(), 90112.0);  // 90000 to 8 bits
  EXPECT_EQ(matmul_under(nullptr, e, e).item(), 90000.0);
}

TEST(ExecutorFaithfulness, MatmulsMatchAnIndependentReferenceExactly) {
  std::mt19937 engine(7);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  auto random = [&](mt::Shape shape) {
    std::vector<float> v(static_cast<size_t>(mt::numel(shape)));
    for (float& x : v) x = dist(engine);
    return mt::tensor(v, shape);
  };
  for (mt::DType H : {mt::f16, mt::bf16})
    for (bool transpose_b : {false, true}) {
      SCOPED_TRACE(std::string(mt::name(H)) + (transpose_b ? " transposed" : ""));
      const int64_t batch = 2, m = 5, k = 9, n = 4;
      mt::Tensor a = random({batch, m, k});
      mt::Tensor b = transpose_b ? random({batch, n, k}) : random({batch, k, n});
      mt::Tensor y;
      {
        mt::autocast guard(H);
        y = mt::matmul(a, b, false, transpose_b);
      }
      std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
      std::vector<double> got = y.to_vector<double>();
      int inexact_in_f32 = 0;
      for (int64_t p = 0; p < batch; ++p)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double exact = 0, unrounded = 0;  // products of 8/11-bit values: exact in f64
            for (int64_t q = 0; q < k; ++q) {
              double x = av[(p * m + i) * k + q];
              double w = transpose_b ? bv[(p * n + j) * k + q] : bv[(p * k + q) * n + j];
              exact += to_half(H, x) * to_half(H, w);
              unrounded += x * w;
            }
            double expected = to_half(H, exact);
            EXPECT_EQ(got[(p * m + i) * n + j], expected) << p << "," << i << "," << j;
            inexact_in_f32 += to_half(H, unrounded) != expected;
          }
      // The inputs' rounding matters for some entries, so the check above can tell.
      EXPECT_GT(inexact_in_f32, 0);
    }
}

TEST(ExecutorFaithfulness, PointwiseOpsStoreAndComputeAsDecided) {
  const float u = std::ldexp(1.0f, -11);
  // autocast(f16): a weak scalar meets an f16 value and is rounded to f16 like the tensor, as
  // PyTorch does (3 * f16(1 + 2^-11) = 3; unrounded, 3 + 3 * 2^-11 would round up to 3 + 2^-9).
  mt::Tensor three = values({3.0f}, {1, 1}), one = values({1.0f}, {1, 1});
  mt::Tensor scaled, e, r;
  {
    mt::autocast guard(mt::f16);
    mt::Tensor m = mt::matmul(three, one);
    scaled = m * (1.0 + u);
    e = mt::exp(m * 0.1);
    r = mt::relu(m * 0.1);
  }
  EXPECT_EQ(scaled.item(), 3.0);
  // 0.1 is stored as f16 first, then m * 0.1 in f32 registers rounded to f16 at the output.
  double tenth = to_f16(3.0 * to_f16(static_cast<float>(0.1)));
  EXPECT_EQ(r.item(), tenth);
  // exp runs and stores in f32: the f32 exp of the f16 input, not rounded further.
  EXPECT_EQ(e.item(), static_cast<double>(std::exp(static_cast<float>(tenth))));
  EXPECT_NE(e.item(), to_f16(e.item()));
  // pure(f16): f32 parameters are used as f16: f16(1 + 2^-11) + 2^-11 = 1 + 2^-11 -> 1 (a tie to
  // even), where the exact sum 1 + 2^-10 is an f16 value.
  mt::Tensor p = values({1 + u}, {1}), q = values({u}, {1}), sum;
  {
    mt::autocast guard(mt::pure_policy(mt::f16));
    sum = p + q;
  }
  EXPECT_EQ(row_of(sum).storage, mt::f16);
  EXPECT_EQ(sum.item(), 1.0);
  EXPECT_EQ((p + q).item(), 1.0 + 2 * u);  // fp32: no rounding to speak of
  // Values outside f16's range become inf at an f16 output and stay finite in f32 nodes: two
  // f16 values of 2^15 sum to 2^16 in the f32-stored sum.
  mt::Tensor big, total;
  {
    mt::autocast guard(mt::f16);
    big = mt::matmul(values({200.0f, 200.0f}, {1, 2}), values({200.0f, 200.0f}, {2, 1}));
    total = mt::sum(mt::matmul(values({256.0f, 256.0f}, {2, 1}), values({128.0f}, {1, 1})));
  }
  EXPECT_TRUE(std::isinf(big.item()));  // 80000 > 65504
  EXPECT_EQ(total.item(), 65536.0);
}

// Half data through softmax, log_softmax, logsumexp, the norms and the losses without a policy:
// computed in f32 and rounded once to the data's type, as PyTorch's CUDA kernels (and its CPU
// kernels since 2.0) do, so within one unit in the last place of the f64 value. Rounding every
// node to 16 bits instead made a confident row's loss log(1 + 3 e^-8) = 0.001 exactly 0 in bf16
// (1 + 0.001 is 1 there), and its gradient at the target 0; and the layer norm of rows near 1000
// centred them on a mean rounded to a multiple of 4 or 16.
TEST(ExecutorFaithfulness, HalfDataThroughF32CompositesIsRoundedOnce) {
  const std::vector<double> rows{8, 0, 0, 0, 0.5, -1, 2, 0.25, 1000, 1004, 996, 1008};
  const std::vector<int64_t> ids{0, 2, 3};
  // The f64 references, row by row.
  std::vector<double> lse, log_p, p, normed, rms;
  for (size_t r = 0; r < 3; ++r) {
    const double* x = &rows[4 * r];
    double top = *std::max_element(x, x + 4), total = 0, mean = 0, square_sum = 0;
    for (int c = 0; c < 4; ++c) total += std::exp(x[c] - top), mean += x[c] / 4;
    for (int c = 0; c < 4; ++c) square_sum += x[c] * x[c] / 4;
    double var = 0;
    for (int c = 0; c < 4; ++c) var += (x[c] - mean) * (x[c] - mean) / 4;
    lse.push_back(top + std::log(total));
    for (int c = 0; c < 4; ++c) {
      log_p.push_back(x[c] - lse.back());
      p.push_back(std::exp(log_p.back()));
      normed.push_back((x[c] - mean) / std::sqrt(var + 1e-5));
      rms.push_back(x[c] / std::sqrt(square_sum + 1e-6));
    }
  }
  for (mt::DType t : {mt::bf16, mt::f16}) {
    SCOPED_TRACE(std::string(mt::name(t)));
    // Within one unit in the last place of the type at the reference value.
    auto expect_rounded_once = [&](const mt::Tensor& y, const std::vector<double>& reference,
                                   const char* what) {
      ASSERT_EQ(y.dtype(), t) << what;
      std::vector<double> got = y.to_vector<double>();
      ASSERT_EQ(got.size(), reference.size()) << what;
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_LE(std::abs(got[i] - reference[i]), ulp_of(t, reference[i])) << what << " " << i;
    };
    mt::Tensor x = mt::tensor(rows, {3, 4}, t);
    ASSERT_EQ(x.to_vector<double>(), rows);  // every input is a value of both types
    x.requires_grad_(true);
    mt::Tensor targets = mt::tensor(ids, {3});
    std::vector<double> loss;
    for (size_t r = 0; r < 3; ++r) loss.push_back(-log_p[4 * r + static_cast<size_t>(ids[r])]);
    expect_rounded_once(mt::logsumexp(x, {1}), lse, "logsumexp");
    expect_rounded_once(mt::log_softmax(x, 1), log_p, "log_softmax");
    expect_rounded_once(mt::softmax(x, 1), p, "softmax");
    expect_rounded_once(mt::layer_norm(x, mt::Tensor(), mt::Tensor()), normed, "layer_norm");
    expect_rounded_once(mt::rms_norm(x, mt::Tensor()), rms, "rms_norm");
    expect_rounded_once(mt::cross_entropy(x, targets, {.reduction = mt::Reduction::None}), loss,
                        "cross_entropy");
    expect_rounded_once(mt::nll_loss(mt::log_softmax(x, 1), targets, mt::Reduction::None), loss,
                        "nll_loss");
    // The loss's gradient, (p - onehot) / rows.
    mt::Tensor mean_loss = mt::cross_entropy(x, targets);
    expect_rounded_once(mean_loss, {(loss[0] + loss[1] + loss[2]) / 3}, "mean cross_entropy");
    mean_loss.backward();
    std::vector<double> expected_grad(p);
    for (size_t r = 0; r < 3; ++r) expected_grad[4 * r + static_cast<size_t>(ids[r])] -= 1;
    for (double& g : expected_grad) g /= 3;
    expect_rounded_once(x.grad(), expected_grad, "cross_entropy's gradient");
    // logsumexp's gradient is the softmax, also of the rows near 1000 whose log-sum-exp, 1008.0,
    // is not a bf16 value.
    x.zero_grad();
    mt::sum(mt::logsumexp(x, {1})).backward();
    expect_rounded_once(x.grad(), p, "logsumexp's gradient");
  }
}

// The premise of loss scaling: gradients below f16's smallest subnormal (2^-24) vanish in an f16
// backward pass; fp32 and bf16 keep them; scaling the loss up first keeps them in f16 too.
TEST(ExecutorFaithfulness, TinyGradientsUnderflowInF16AndLossScalingKeepsThem) {
  // y = x @ W with x = [1, 1/4]; loss = sum(y) * s. dloss/dW = [s, s/4]: the backward matmul
  // rounds its incoming gradient s and its results to the policy's type.
  const double t24 = std::ldexp(1.0, -24);
  struct Case {
    double s;
    std::vector<double> f16;  // hand-worked
  };
  const Case cases[] = {
      {1e-8, {0, 0}},                                     // s < 2^-25 rounds to 0 itself
      {std::ldexp(1.0, -23), {std::ldexp(1.0, -23), 0}},  // 2^-25 is a tie: to the even 0
      {std::ldexp(1.0, -20), {std::ldexp(1.0, -20), std::ldexp(1.0, -22)}},
      {3 * std::ldexp(1.0, -25), {2 * t24, 0}},  // s rounds up to 2^-23 (a tie: even)
  };
  auto weight_grad = [](const mt::PolicyPtr& policy, double s, double loss_scale) {
    mt::Tensor w = values({0.5f, -2.0f}, {2, 1});
    w.requires_grad_();
    mt::Tensor loss;
    {
      std::optional<mt::autocast> guard;
      if (policy) guard.emplace(policy);
      loss = mt::sum(mt::matmul(values({1.0f, 0.25f}, {1, 2}), w)) * s;
      if (loss_scale != 1) loss = loss * loss_scale;
    }
    loss.backward();
    return (mt::cast(w.grad(), mt::f32) * (1.0 / loss_scale)).to_vector<double>();
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.s);
    double s32 = static_cast<float>(c.s);
    std::vector<double> fp32 = weight_grad(nullptr, c.s, 1);
    EXPECT_EQ(fp32, (std::vector<double>{s32, s32 / 4}));
    EXPECT_EQ(weight_grad(mt::autocast_policy(mt::f16), c.s, 1), c.f16);
    double sb = to_bf16(s32);
    EXPECT_EQ(weight_grad(mt::autocast_policy(mt::bf16), c.s, 1),
              (std::vector<double>{sb, sb / 4}));
    // Scaled by 2^16 the gradients are normal f16 values; unscaled in f32 they are fp32's up to
    // f16's rounding of the scaled gradient (powers of two scale exactly).
    std::vector<double> rescued = weight_grad(mt::autocast_policy(mt::f16), c.s, 65536);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_NE(rescued[i], 0.0);
      EXPECT_EQ(rescued[i], to_f16(fp32[i] * 65536) / 65536);
    }
  }
  // The tiny gradient of the first case in f16 is exactly zero, in fp32 it is not.
  EXPECT_EQ(weight_grad(mt::autocast_policy(mt::f16), 1e-8, 1)[1], 0.0);
  EXPECT_GT(weight_grad(nullptr, 1e-8, 1)[1], 0.0);
}

// ---------------------------------------------------------------------------------------------
// 5. The precision report.

TEST(PrecisionReport, ListsEveryNodeWithModuleShapeDtypesAndRule) {
  mt::Generator gen(3);
  mt::MLP net({4, 3, 2}, mt::Activation::Relu, &gen);
  mt::Tensor x = values({0.1f, 0.2f, -0.3f, 0.4f, 1.0f, -1.0f, 0.5f, 0.0f}, {2, 4});
  mt::Tensor targets = mt::tensor(std::vector<int64_t>{1, 0}, {2});
  mt::Tensor loss;
  {
    mt::autocast guard(mt::f16);
    loss = mt::cross_entropy(net(x), targets);
  }
  loss.backward();
  std::vector<mt::Tensor> outputs{loss};
  for (const mt::Tensor& p : net.parameters()) outputs.push_back(p.grad());
  mt::PrecisionReport report = mt::precision_report(outputs);

  // Every node the outputs depend on, once, in tape order, with the node's own facts.
  std::vector<const mt::Node*> nodes = reachable(outputs);
  ASSERT_EQ(report.rows.size(), nodes.size());
  std::map<uint64_t, const mt::Node*> by_id;
  for (const mt::Node* n : nodes) by_id[n->id] = n;
  std::set<std::string> modules;
  int backward_rows = 0, f16_rows = 0;
  for (size_t i = 0; i < report.rows.size(); ++i) {
    const mt::PrecisionRow& row = report.rows[i];
    if (i > 0) {
      EXPECT_LT(report.rows[i - 1].id, row.id);
    }
    ASSERT_TRUE(by_id.count(row.id)) << row.id;
    const mt::Node& n = *by_id.at(row.id);
    EXPECT_EQ(row.op, mt::op_name(n.op));
    EXPECT_EQ(row.module_path, n.origin.module_path);
    EXPECT_EQ(row.shape, n.shape);
    EXPECT_EQ(row.traced, n.dtype);
    EXPECT_EQ(row.storage, n.precision.storage_type);
    EXPECT_EQ(row.compute, n.precision.compute);
    EXPECT_EQ(row.accum, n.precision.accum);
    EXPECT_EQ(row.backward, n.backward);
    EXPECT_FALSE(row.rule.empty()) << row.id << " " << row.op;
    modules.insert(row.module_path);
    backward_rows += row.backward;
    f16_rows += row.storage == mt::f16;
  }
  EXPECT_EQ(modules, (std::set<std::string>{"", "fc1", "fc2"}));
  EXPECT_GT(backward_rows, 10);
  EXPECT_GT(f16_rows, 6);
  // The forward matmul of fc1: its op, module, shape, dtypes and the rule that decided them.
  bool found = false;
  for (const mt::PrecisionRow& row : report.rows)
    if (row.op == "matmul" && row.module_path == "fc1" && !row.backward) {
      found = true;
      EXPECT_EQ(row.shape, (mt::Shape{2, 3}));
      EXPECT_EQ(row.storage, mt::f16);
      EXPECT_EQ(row.compute, mt::f16);
      EXPECT_EQ(row.accum, mt::f32);
      EXPECT_EQ(row.rule, "autocast-f16: inside linear, which runs in f16 with f32 accumulation");
    }
  EXPECT_TRUE(found);

  // The JSON has the same rows.
  mt::json::Value json = mt::json::parse(report.json());
  const mt::json::Value& rows = json.at("nodes");
  ASSERT_EQ(rows.size(), report.rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const mt::PrecisionRow& row = report.rows[i];
    const mt::json::Value& j = rows[i];
    EXPECT_EQ(static_cast<uint64_t>(j.at("id").get<int64_t>()), row.id);
    EXPECT_EQ(j.at("op").get<std::string>(), row.op);
    EXPECT_EQ(j.at("module").get<std::string>(), row.module_path);
    mt::Shape shape;
    for (const mt::json::Value& d : j.at("shape")) shape.push_back(d.get<int64_t>());
    EXPECT_EQ(shape, row.shape);
    EXPECT_EQ(j.at("traced").get<std::string>(), mt::name(row.traced));
    EXPECT_EQ(j.at("storage").get<std::string>(), mt::name(row.storage));
    EXPECT_EQ(j.at("compute").get<std::string>(), mt::name(row.compute));
    EXPECT_EQ(j.at("accum").get<std::string>(), mt::name(row.accum));
    EXPECT_EQ(j.at("pass").get<std::string>(), row.backward ? "backward" : "forward");
    EXPECT_EQ(j.at("rule").get<std::string>(), row.rule);
  }
  // The table: a header, then one line per node.
  std::string table = report.table();
  std::istringstream lines(table);
  std::vector<std::string> text;
  for (std::string line; std::getline(lines, line);) text.push_back(line);
  ASSERT_EQ(text.size(), report.rows.size() + 1);
  for (const char* column : {"op", "module", "shape", "storage", "compute", "accum", "rule"})
    EXPECT_NE(text[0].find(column), std::string::npos) << column;
  for (size_t i = 0; i < report.rows.size(); ++i) {
    const mt::PrecisionRow& row = report.rows[i];
    EXPECT_NE(text[i + 1].find(row.rule), std::string::npos) << text[i + 1];
    EXPECT_NE(text[i + 1].find(std::to_string(row.id)), std::string::npos) << text[i + 1];
  }
  // The report decides without evaluating; evaluation then uses the same decisions.
  EXPECT_FALSE(loss.node()->evaluated());
  std::vector<double> grad = net.layers[0]->weight.grad().to_vector<double>();
  for (double g : grad) EXPECT_EQ(g, to_f16(g)) << "fc1's weight gradient is stored as f16";
}

// After an optimizer step the parameters are leaves the update set, decided before the pass
// sees them: their rows still give the reason, leaf data's, as before the first step.
TEST(PrecisionReport, ParametersKeepARuleAfterAnOptimizerStep) {
  mt::Generator gen(5);
  mt::Linear layer(4, 3, true, &gen);
  mt::SGD opt(layer.parameters(), {.lr = 0.1, .momentum = 0.9});
  mt::Tensor x = mt::randn({2, 4}, mt::f32, &gen);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(step);
    mt::Tensor loss;
    {
      mt::autocast guard(mt::bf16);
      loss = mt::sum(layer(x));
    }
    loss.backward();
    for (const mt::PrecisionRow& row : mt::precision_report({loss}).rows)
      EXPECT_FALSE(row.rule.empty()) << "node " << row.id << " (" << row.op << ") has no rule";
    if (step == 1) {
      EXPECT_EQ(row_of(layer.weight).rule, "leaf data keeps its dtype");
    }
    opt.step();
    opt.zero_grad();
  }
}

TEST(PrecisionReport, NamesNestedModulesOfATransformerBlock) {
  mt::Generator gen(5);
  mt::TransformerBlock block(8, 2, 0.0, &gen);
  mt::Tensor x = mt::randn({1, 3, 8}, mt::f32, &gen);
  mt::Tensor y;
  {
    mt::autocast guard(mt::bf16);
    y = block(x);
  }
  std::map<std::string, std::set<std::string>> storage_by_module_op;
  for (const mt::PrecisionRow& row : mt::precision_report({y}).rows)
    storage_by_module_op[row.module_path + ":" + row.op].insert(std::string(mt::name(row.storage)));
  using S = std::set<std::string>;
  EXPECT_EQ(storage_by_module_op["attn.qkv:matmul"], S{"bf16"});
  EXPECT_EQ(storage_by_module_op["attn.proj:matmul"], S{"bf16"});
  EXPECT_EQ(storage_by_module_op["mlp.fc1:matmul"], S{"bf16"});
  EXPECT_EQ(storage_by_module_op["mlp:gelu_tanh"], S{"bf16"});
  EXPECT_EQ(storage_by_module_op["ln1:rsqrt"], S{"f32"});
  // Fused attention, a bf16 value (its softmax is f32 inside the kernel).
  EXPECT_EQ(storage_by_module_op["attn:attention_forward"], S{"bf16"});
  EXPECT_EQ(storage_by_module_op[":add"], S{"f32"});  // the residual stream
}

// ---------------------------------------------------------------------------------------------
// 6. A bf16 autocast step against PyTorch's CPU autocast, on the same weights and data.
//
// What torch 1.13's CPU autocast does (measured with this torch: ops run under
// torch.autocast('cpu', dtype=torch.bfloat16), output dtypes printed; the script below prints
// the key ones again) differs from its CUDA lists and from mixtape's:
//   - lower precision (bf16): mm, bmm, matmul, linear (addmm), baddbmm, addbmm, conv* - as ours;
//   - fp32: the losses (mse_loss, nll_loss, cross_entropy: f32 out even for bf16 in) - as ours;
//   - NOT on the CPU fp32 list: softmax, log_softmax, logsumexp, layer_norm, gelu, exp, tanh,
//     sum, mean. On an f32 input they stay f32 (autocast does not lower them); on a bf16 input
//     they run in bf16 and return bf16 (layer_norm of a bf16 input with f32 weights is even an
//     error in 1.13). Mixtape's autocast follows PyTorch's CUDA lists instead: softmax,
//     log_softmax, logsumexp, norms, exp, log, tanh, pow... in f32 whatever the input, sums
//     stored in f32.
// In the two models below those list differences cancel: LayerNorm sees the f32 residual stream
// in both, the softmax output is rounded to bf16 by the next matmul in both, relu and gelu
// follow their bf16 input in both. What does not cancel:
//   - torch's nn.Linear is one addmm: the bias joins the f32 accumulator and the sum is rounded
//     once. Mixtape rounds the matmul's output (its node is typed bf16; DESIGN.md decision 6:
//     rounding happens at node outputs, so fusing the bias later cannot change results), then
//     adds the bias rounded to bf16 and rounds again: an ulp apart in ~1/4 of the outputs.
//   - torch 1.13's CPU bf16 gelu kernels round intermediates (only ~60% of gelu_tanh outputs
//     are the correctly rounded value); mixtape computes in f32 and rounds once.
//   - softmax's backward runs in bf16 in torch, in f32 in mixtape.
//   - Both round a scalar operand to the tensor's type (x_bf16 * 0.1 uses bf16(0.1)).
// So the torch side runs two bf16 variants: linear written as mixtape computes it (matmul, then
// + bias in the matmul's type; the MLP's forward is then bit-identical) with a bf16 tolerance
// (norm-wise relative error 2e-2 per tensor) and the check that mixtape's fp32 run is clearly
// further away than its bf16 run; and stock nn.Linear, within bf16 tolerance for loss and
// output and a looser one for gradients (a ReLU whose input is within an ulp of zero flips
// where the two linear roundings disagree; mixtape's fp32 gradients are 0.2 away there).

constexpr double kBf16Tolerance = 2e-2;
constexpr double kFp32Tolerance = 1e-5;  // both libraries in f32: summation order only
constexpr double kAddmmGradTolerance = 5e-2;

namespace fs = std::filesystem;

const std::vector<int64_t> kMlpSizes = {16, 32, 32, 5};
constexpr int64_t kBlockDim = 32, kBlockHeads = 4;

mt::Tensor random_normal(std::mt19937& engine, mt::Shape shape, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(mt::numel(shape)));
  for (float& x : v) x = dist(engine);
  return mt::tensor(v, shape);
}

void write_inputs(const fs::path& dir) {
  std::mt19937 engine(20240612);
  {
    mt::Generator gen(11);
    mt::MLP model(kMlpSizes, mt::Activation::Relu, &gen);
    std::uniform_int_distribution<int64_t> classes(0, 4);
    std::vector<int64_t> y(16);
    for (int64_t& v : y) v = classes(engine);
    mt::save_tensors((dir / "mlp.params.safetensors").string(), model.named_parameters());
    mt::save_tensors((dir / "mlp.in.safetensors").string(),
                     {{"x", random_normal(engine, {16, 16})}, {"y", mt::tensor(y, {16})}});
  }
  {
    mt::Generator gen(12);
    mt::TransformerBlock block(kBlockDim, kBlockHeads, 0.0, &gen);
    // LayerNorm starts at ones/zeros; perturbed values make its gradients more telling.
    for (auto& [name, p] : block.named_parameters())
      if (name.starts_with("ln"))
        p.assign(random_normal(engine, p.shape(), 0.2f) + (name.ends_with("weight") ? 1.0 : 0.0));
    mt::save_tensors((dir / "block.params.safetensors").string(), block.named_parameters());
    mt::save_tensors((dir / "block.in.safetensors").string(),
                     {{"x", random_normal(engine, {2, 8, kBlockDim})},
                      {"target", random_normal(engine, {2, 8, kBlockDim})}});
  }
}

// torch's side: tests/torch/autocast_side.py on the files write_inputs made.
struct AutocastSide {
  static constexpr const char* kScript = "autocast_side.py";
  static void write_inputs(const fs::path& dir) { ::write_inputs(dir); }
};
class TorchAutocast : public torch_side::Suite<AutocastSide> {};

using TensorMap = std::map<std::string, mt::Tensor>;

struct TorchResults {
  TensorMap inputs, params, out;
  std::map<std::string, std::string> meta;
};

TorchResults open_results(const std::string& kind) {
  const fs::path& dir = TorchAutocast::state().dir;
  TorchResults r;
  for (auto& [name, t] : mt::load_tensors((dir / (kind + ".in.safetensors")).string()))
    r.inputs.emplace(name, t);
  mt::Metadata meta;
  for (auto& [name, t] : mt::load_tensors((dir / (kind + ".out.safetensors")).string(), &meta))
    r.out.emplace(name, t);
  for (auto& [key, value] : meta) r.meta[key] = value;
  return r;
}

// ||a - b|| / ||b||.
double relative_error(const mt::Tensor& actual, const mt::Tensor& expected) {
  EXPECT_EQ(actual.shape(), expected.shape());
  std::vector<double> a = actual.to_vector<double>(), b = expected.to_vector<double>();
  if (a.size() != b.size()) return HUGE_VAL;
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    ref += b[i] * b[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

struct StepResult {
  mt::Tensor loss, output;
  std::map<std::string, mt::Tensor> grads;
};

// Distances of a mixtape run from one of torch's runs.
struct Distance {
  double loss, output, worst_grad;
  std::string worst_name;
  std::map<std::string, double> grads;
};
Distance distance(const StepResult& ours, const TorchResults& torch, const std::string& mode) {
  Distance d{relative_error(ours.loss, torch.out.at(mode + ".loss")),
             relative_error(ours.output, torch.out.at(mode + ".output")),
             0,
             "-",
             {}};
  for (auto& [name, g] : ours.grads) {
    double e = relative_error(g, torch.out.at(mode + ".grad." + name));
    d.grads[name] = e;
    if (e >= d.worst_grad) d.worst_grad = e, d.worst_name = name;
  }
  return d;
}

void compare(const std::string& kind, const StepResult& bf16, const StepResult& fp32,
             const TorchResults& torch) {
  EXPECT_EQ(torch.meta.at("bf16.loss_dtype"), "torch.float32");
  EXPECT_EQ(torch.meta.at("bf16.grad_dtypes"), "torch.float32")
      << "torch's gradients of f32 parameters under autocast are f32";
  EXPECT_EQ(bf16.grads.size(), fp32.grads.size());
  // The harness itself: both libraries in fp32 agree to f32 accuracy.
  Distance exact = distance(fp32, torch, "fp32");
  EXPECT_LE(exact.loss, kFp32Tolerance);
  EXPECT_LE(exact.worst_grad, 1e-4) << exact.worst_name;
  // Against torch with linear written as mixtape computes it (matmul, then the bias).
  Distance ours = distance(bf16, torch, "bf16"), theirs = distance(fp32, torch, "bf16");
  EXPECT_LE(ours.loss, kBf16Tolerance);
  EXPECT_LE(ours.output, kBf16Tolerance);
  int grads_closer = 0;
  for (auto& [name, e] : ours.grads) {
    EXPECT_LE(e, kBf16Tolerance) << kind << " grad " << name;
    grads_closer += e < theirs.grads.at(name);
  }
  // The comparison sees precision: mixtape's fp32 run is further from torch's bf16 run, over the
  // output's elements and for most gradients (the loss alone is one number: bf16 rounding can
  // land it near either run, depending on the data).
  EXPECT_LT(ours.output, theirs.output) << kind;
  EXPECT_GT(grads_closer * 2, static_cast<int>(ours.grads.size())) << kind;
  // Against stock nn.Linear (addmm): the bias's different rounding moves values by an ulp here
  // and there, and a ReLU whose input sits near zero can flip, so gradients get more room.
  Distance stock = distance(bf16, torch, "bf16_addmm");
  Distance stock_fp32 = distance(fp32, torch, "bf16_addmm");
  EXPECT_LE(stock.loss, kBf16Tolerance);
  EXPECT_LE(stock.output, kBf16Tolerance);
  // A flipped ReLU moves a bias gradient as much in fp32 as in bf16: past the tolerance, bf16
  // must be no further from stock torch than fp32 is.
  EXPECT_LE(stock.worst_grad, std::max(kAddmmGradTolerance, 1.25 * stock_fp32.worst_grad))
      << stock.worst_name;
  std::printf(
      "[  torch   ] %-5s bf16 vs torch bf16: loss %.1e output %.1e worst grad %.1e (%s), "
      "%d/%zu grads closer than fp32's | fp32 vs torch bf16: loss %.1e output %.1e | "
      "vs stock nn.Linear: bf16 loss %.1e worst grad %.1e, fp32 loss %.1e worst grad %.1e\n",
      kind.c_str(), ours.loss, ours.output, ours.worst_grad, ours.worst_name.c_str(), grads_closer,
      ours.grads.size(), theirs.loss, theirs.output, stock.loss, stock.worst_grad, stock_fp32.loss,
      stock_fp32.worst_grad);
}

TEST_F(TorchAutocast, MlpStepMatchesTorchCpuAutocastBf16) {
  TorchResults torch = open_results("mlp");
  EXPECT_EQ(torch.meta.at("bf16.output_dtype"), "torch.bfloat16");
  auto forward = [&](mt::MLP& model) {
    mt::Tensor out = model(torch.inputs.at("x"));
    return std::pair{out, mt::cross_entropy(out, torch.inputs.at("y"))};
  };
  auto params = mt::load_tensors((TorchAutocast::state().dir / "mlp.params.safetensors").string());
  auto step = [&](const mt::PolicyPtr& policy) {
    mt::MLP model(kMlpSizes, mt::Activation::Relu);
    model.load_state_dict(params);
    StepResult r;
    {
      std::optional<mt::autocast> guard;
      if (policy) guard.emplace(policy);
      std::tie(r.output, r.loss) = forward(model);
    }
    r.loss.backward();
    for (auto& [name, p] : model.named_parameters()) r.grads[name] = p.grad();
    return r;
  };
  StepResult bf16 = step(mt::autocast_policy(mt::bf16)), fp32 = step(nullptr);
  EXPECT_EQ(row_of(bf16.output).storage, mt::bf16);
  compare("mlp", bf16, fp32, torch);
}

TEST_F(TorchAutocast, TransformerBlockStepMatchesTorchCpuAutocastBf16) {
  TorchResults torch = open_results("block");
  EXPECT_EQ(torch.meta.at("bf16.output_dtype"), "torch.float32") << "the residual stream";
  auto params =
      mt::load_tensors((TorchAutocast::state().dir / "block.params.safetensors").string());
  auto step = [&](const mt::PolicyPtr& policy) {
    mt::TransformerBlock block(kBlockDim, kBlockHeads, 0.0);
    block.load_state_dict(params);
    StepResult r;
    {
      std::optional<mt::autocast> guard;
      if (policy) guard.emplace(policy);
      r.output = block(torch.inputs.at("x"));
      r.loss = mt::mse_loss(r.output, torch.inputs.at("target"));
    }
    r.loss.backward();
    for (auto& [name, p] : block.named_parameters()) r.grads[name] = p.grad();
    return r;
  };
  StepResult bf16 = step(mt::autocast_policy(mt::bf16)), fp32 = step(nullptr);
  EXPECT_EQ(bf16.grads.size(), 12u);
  compare("block", bf16, fp32, torch);
}

// A policy may ask for a 16-bit accumulator: every partial sum is then rounded to it. Adding
// 2^-11 to 1 four times in f16 stays at 1 (each sum is a tie that rounds to even), while the f32
// accumulator keeps all four.
TEST(Executor, HonoursAHalfAccumulatorFromACustomPolicy) {
  auto accumulate_in = [](mt::DType accum) {
    auto policy = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
    policy->rule("accumulate sums in " + std::string(mt::name(accum)),
                 [accum](const mt::PrecisionQuery& q) -> std::optional<mt::Precision> {
                   if (q.op != OpCode::Sum && q.op != OpCode::MatMul && q.op != OpCode::IndexAdd &&
                       q.op != OpCode::ScatterAdd)
                     return std::nullopt;
                   return mt::Precision{mt::f32, mt::f32, accum, "test accumulator"};
                 });
    return policy;
  };
  std::vector<float> values{1.0f, 0x1p-11f, 0x1p-11f, 0x1p-11f, 0x1p-11f};
  mt::Tensor x = mt::tensor(values, {5});
  mt::Tensor row = mt::tensor(values, {1, 5});
  mt::Tensor column = mt::ones({5, 1});
  // index_add and scatter_add (an embedding's gradient) of the five values into one zero.
  mt::Tensor to_zero = mt::tensor(std::vector<int64_t>{0, 0, 0, 0, 0}, {5});
  auto sums_in = [&](mt::DType accum) {
    mt::autocast guard(accumulate_in(accum));
    return std::vector<mt::Tensor>{mt::sum(x), mt::matmul(row, column),
                                   mt::index_add(mt::zeros({1}), to_zero, x, 0),
                                   mt::scatter_add(mt::zeros({1}), to_zero, x, 0)};
  };
  for (const mt::Tensor& sum : sums_in(mt::f16)) EXPECT_EQ(sum.to_vector<double>()[0], 1.0);
  for (const mt::Tensor& sum : sums_in(mt::f32))
    EXPECT_EQ(sum.to_vector<double>()[0], 1.0 + 4 * 0x1p-11);
  // Fused attention has no 16-bit accumulator: a policy asking for one is told so.
  auto half_attention = std::make_shared<mt::OverridePolicy>(mt::fp32_policy());
  half_attention->rule("attention accumulates in f16", [](const mt::PrecisionQuery& q) {
    return q.op == OpCode::Attention
               ? std::optional<mt::Precision>(mt::Precision{mt::f32, mt::f32, mt::f16, "f16 sums"})
               : std::nullopt;
  });
  mt::Tensor q = mt::ones({1, 2, 4});
  mt::Tensor attended;
  {
    mt::autocast guard(half_attention);
    attended = mt::scaled_dot_product_attention(q, q, q);
  }
  EXPECT_MT_ERROR(mt::eval({attended}), "f16 accumulator", "fused attention");
}

}  // namespace

// The sums into a leaf's gradient (two uses of one weight, two backward passes) took the policy
// of the caller of backward(): inside an autocast scope they added in 16 bits (256 + 1 in bf16
// is 256; 2048 + 1 in f16 is 2048). PyTorch adds a parameter's gradients in its own type.
// A policy that stores max narrower than its input (pure bf16 of f32 data) still sends the
// gradient to the maximum: the rounded maximum equalled no f32 element, and every gradient was 0.
TEST(Autograd, MaxStoredNarrowerThanItsInputSendsTheGradientToTheMaximum) {
  for (const char* policy : {"fp32", "autocast-bf16", "pure-bf16", "pure-f16"}) {
    SCOPED_TRACE(policy);
    mt::Tensor x = mt::tensor(std::vector<float>{1.1f, 2.3f, -0.7f, 0.31f, 0.2f, 0.1f}, {2, 3});
    x.requires_grad_();
    mt::Tensor y;
    {
      mt::autocast guard(mt::policy_by_name(policy));
      y = mt::sum(mt::max(x, {1}));
    }
    y.backward();
    EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{0, 1, 0, 1, 0, 0}));
  }
}

TEST(Autograd, LeafGradientSumsKeepTheLeafsTypeUnderTheCallersPolicy) {
  auto weight = [] { return mt::tensor(std::vector<float>{1}, {1, 1}).requires_grad_(); };
  auto constant = [](float v) { return mt::tensor(std::vector<float>{v}, {1, 1}); };
  for (bool inside : {true, false}) {
    mt::Tensor w = weight(), loss;
    {
      mt::autocast guard(mt::bf16);
      loss = mt::sum(mt::matmul(constant(256), w)) + mt::sum(mt::matmul(constant(1), w));
      if (inside) loss.backward();
    }
    if (!inside) loss.backward();
    EXPECT_EQ(w.grad().to_vector<float>()[0], 257.0f) << "backward inside autocast: " << inside;
    EXPECT_EQ(w.grad().dtype(), mt::f32);
  }
  mt::Tensor w = weight();
  for (float x : {2048.0f, 1.0f}) {
    mt::autocast guard(mt::f16);
    mt::sum(mt::matmul(constant(x), w)).backward();
  }
  EXPECT_EQ(w.grad().to_vector<float>()[0], 2049.0f);
}

// The library's own arithmetic took the caller's policy: inside a pure-f16 scope the gradient
// norm squared in f16 (300^2 is inf there) and the optimizer wrote its f32 weights from an f16
// update. PyTorch's autocast reaches neither; here they keep their traced types.
TEST(Autograd, OptimizerNormAndScalerArithmeticIgnoreTheCallersPolicy) {
  auto run = [](bool inside) {
    mt::Tensor w = mt::tensor(std::vector<float>{1, 1}, {2}).requires_grad_();
    mt::GradScaler scaler({.init_scale = 2.0});  // f16 gradients 600 and 800: finite
    mt::SGD opt({w}, {.lr = 1e-3});
    std::optional<mt::autocast> guard;
    if (inside) guard.emplace(mt::pure_policy(mt::f16));
    mt::Tensor loss = mt::sum(w * mt::tensor(std::vector<float>{300, 400}, {2}));
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    double norm = mt::clip_grad_norm({w}, 1e4).item();
    scaler.step(opt);
    scaler.update();
    return std::pair{norm, w.to_vector<float>()};
  };
  auto [norm, weights] = run(true);
  EXPECT_EQ(norm, 500.0);
  EXPECT_EQ(weights, run(false).second);
  EXPECT_EQ(weights, (std::vector<float>{1.0f - 0.3f, 1.0f - 0.4f}));
}
