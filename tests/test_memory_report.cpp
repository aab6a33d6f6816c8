// tests/test_memory_report.cpp -- mt::memory_report against byte counts and liveness peaks worked
// out by hand for tiny graphs and an MLP under fp32, autocast-f16 and pure-bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <mixtape/mixtape.h>

#include "mixtape/dsl/json.h"
#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

std::vector<float> iota_values(size_t n, float start, float step) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = start + step * static_cast<float>(i);
  return out;
}

// One parameter of any shape, for hand-sized graphs.
struct OneParam : mt::Module {
  explicit OneParam(mt::Shape shape) {
    const int64_t n = mt::numel(shape);
    w = register_parameter("w", mt::tensor(iota_values(n, 0.25f, 0.125f), shape));
  }
  mt::Tensor w;
};

struct Mlp : mt::Module {
  mt::Linear fc1{3, 6}, fc2{6, 2};
  Mlp() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
};

// The MLP's step with handles on the values the hand count needs.
struct MlpStep {
  mt::Tensor x, h, r, y, d, loss;
};

MlpStep mlp_step(const Mlp& net, const mt::PolicyPtr& policy, int64_t batch = 4) {
  MlpStep s;
  s.x = mt::tensor(iota_values(static_cast<size_t>(batch) * 3, -1.0f, 0.125f), {batch, 3});
  mt::Tensor target =
      mt::tensor(iota_values(static_cast<size_t>(batch) * 2, 0.5f, -0.0625f), {batch, 2});
  {
    std::optional<mt::autocast> guard;
    if (policy) guard.emplace(policy);
    s.h = net.fc1(s.x);
    s.r = mt::relu(s.h);
    s.y = net.fc2(s.r);
    s.d = s.y - target;
    s.loss = mt::mean(mt::square(s.d));
  }
  s.loss.backward();
  return s;
}

int64_t grad_bytes(const mt::Module& model) {
  // A gradient's bytes from the dtype its node was given, as read back from the precision report.
  int64_t total = 0;
  for (const auto& [name, p] : model.named_parameters()) {
    mt::PrecisionReport report = mt::precision_report({p.grad()});
    total += p.numel() * static_cast<int64_t>(mt::size_of(report.rows.back().storage));
  }
  return total;
}

// ---- hand-worked graphs ----

// loss = sum(w * x), w a parameter [8], x data [8], fp32 throughout. Buffers in tape order:
//   x 32 B (data), m = w*x 32 B, loss 4 B, seed/reshape/broadcast (fills and
//   views of them: free), gw = broadcast * x 32 B. Masters 32 B live always.
//   at m: x + m = 64; at loss: x + m + loss = 68; at gw: x + loss + gw = 68. Peak 32 + 68 = 100,
//   first reached at the sum.
TEST(MemoryReport, HandWorkedPeakInF32) {
  OneParam model({8});
  mt::Tensor x = mt::tensor(iota_values(8, 1.0f, 1.0f), {8});
  mt::Tensor loss = mt::sum(model.w * x);
  loss.backward();
  mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
  EXPECT_EQ(report.policy, "none");
  EXPECT_EQ(report.master_weights, 32);
  EXPECT_EQ(report.half_copies, 0);
  EXPECT_EQ(report.gradients, 32);
  EXPECT_EQ(report.optimizer_state, 0);
  EXPECT_FALSE(report.optimizer_state_estimated);
  EXPECT_EQ(report.saved_activations, 32);  // x, read by the backward mul
  ASSERT_EQ(report.saved.size(), 1u);
  EXPECT_EQ(report.saved[0].id, x.node()->id);
  EXPECT_EQ(report.peak, 100);
  EXPECT_EQ(report.peak_node, loss.node()->id);
  EXPECT_EQ(report.peak_op, "sum");
  EXPECT_FALSE(report.peak_backward);

  // Adam will create two f32 tensors per parameter on its first step: 64 B more, all the time.
  mt::Adam adam(model.parameters(), {});
  mt::MemoryReport with_adam = mt::memory_report(model, &adam, loss);
  EXPECT_EQ(with_adam.optimizer_state, 64);
  EXPECT_TRUE(with_adam.optimizer_state_estimated);
  EXPECT_EQ(with_adam.persistent(), 96);
  EXPECT_EQ(with_adam.peak, 164);
  EXPECT_EQ(with_adam.parameters.at(0).state_bytes, 64);
}

// A tied weight (one tensor registered under two names, as an embedding shared with the output
// head) is one master and one gradient: the graph of HandWorkedPeakInF32, with its figures.
TEST(MemoryReport, ATiedWeightIsCountedOnce) {
  struct Tied : mt::Module {
    Tied() {
      w = register_parameter("w", mt::ones({8}));
      register_parameter("w_tied", w);
    }
    mt::Tensor w;
  } model;
  mt::Tensor x = mt::tensor(iota_values(8, 1.0f, 1.0f), {8});
  mt::Tensor loss = mt::sum(model.w * x);
  loss.backward();
  mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
  EXPECT_EQ(report.master_weights, 32);
  EXPECT_EQ(report.gradients, 32);
  EXPECT_EQ(report.peak, 100);
  ASSERT_EQ(report.parameters.size(), 1u);
  EXPECT_EQ(report.parameters[0].name, "w");
}

// Two parameters a, b [16] (128 B of masters), x data [16]; loss = sum(a * x) + sum(b * x).
// Backward makes gb = broadcast(seed) * x first, then ga; both are outputs and stay. Live values:
//   a*x 64 + x 64 = 128; + sum 4 = 132; b*x: x + s1 + m2 = 132; at s2: 136; at the add: 76;
//   gb: x + loss + gb = 132; ga: x + loss + gb + ga = 196, the peak: 128 + 196 = 324.
TEST(MemoryReport, HandWorkedPeakKeepsGradientsToTheEnd) {
  struct TwoParams : mt::Module {
    TwoParams() {
      a = register_parameter("a", mt::tensor(iota_values(16, 1.0f, 0.5f), {16}));
      b = register_parameter("b", mt::tensor(iota_values(16, -1.0f, 0.25f), {16}));
    }
    mt::Tensor a, b;
  } model;
  mt::Tensor x = mt::tensor(iota_values(16, 0.5f, 0.5f), {16});
  mt::Tensor s1 = mt::sum(model.a * x);  // in this order: the operands of + are unsequenced
  mt::Tensor s2 = mt::sum(model.b * x);
  mt::Tensor loss = s1 + s2;
  loss.backward();
  mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
  EXPECT_EQ(report.master_weights, 128);
  EXPECT_EQ(report.gradients, 128);
  EXPECT_EQ(report.saved_activations, 64);
  EXPECT_EQ(report.peak, 324);
  EXPECT_EQ(report.peak_node, model.a.grad().node()->id);
  EXPECT_TRUE(report.peak_backward);
}

// A gradient handed to backward() is read only by the backward pass: not an activation. Of the
// forward values only x (read by the mul's vjp) is.
TEST(MemoryReport, AnExplicitSeedIsNotASavedActivation) {
  OneParam model({8});
  mt::Tensor x = mt::tensor(iota_values(8, 1.0f, 1.0f), {8});
  mt::Tensor y = model.w * x;
  y.backward(mt::tensor(iota_values(8, 2.0f, 1.0f), {8}));
  mt::MemoryReport report = mt::memory_report(model, nullptr, y);
  ASSERT_EQ(report.saved.size(), 1u);
  EXPECT_EQ(report.saved[0].id, x.node()->id);
  EXPECT_EQ(report.saved_activations, 32);
}

// The same where the parameter's two gradients are summed (y = p + p * c): the sum is made
// outside any vjp, and its read of the seed counted as a forward read, which listed the seed.
TEST(MemoryReport, ASeedReadByALeafGradientSumIsNotASavedActivation) {
  OneParam model({4});
  mt::Tensor c = mt::tensor(iota_values(4, 1.0f, 1.0f), {4});
  mt::Tensor y = model.w + model.w * c;
  y.backward(mt::tensor(iota_values(4, 2.0f, 1.0f), {4}));
  mt::MemoryReport report = mt::memory_report(model, nullptr, y);
  ASSERT_EQ(report.saved.size(), 1u);
  EXPECT_EQ(report.saved[0].id, c.node()->id);
  EXPECT_EQ(report.saved_activations, 16);
}

// Softmax, masked_softmax and log_softmax keep only their output (and the mask) for the backward
// pass, as PyTorch's do: their composites' own gradients would also keep exp(x - max), the
// broadcast row sums and the masked scores. loss = sum(softmax(w) * c) + sum(log_softmax(w) * c)
// + sum(masked_softmax(w, causal) * c) saves c (96 B), the three outputs (96 B each) and the
// [4, 6] bool mask (24 B).
TEST(MemoryReport, SoftmaxKeepsOnlyItsOutputForBackward) {
  OneParam model({4, 6});
  mt::Tensor c = mt::tensor(iota_values(24, -1.0f, 0.125f), {4, 6});
  mt::Tensor mask = mt::ge(mt::unsqueeze(mt::arange(6), 0), mt::unsqueeze(mt::arange(4), 1));
  mt::Tensor y = mt::softmax(model.w, -1), logp = mt::log_softmax(model.w, 0);
  mt::Tensor masked = mt::masked_softmax(model.w, mask, -1);
  mt::Tensor loss = mt::sum(y * c) + mt::sum(logp * c) + mt::sum(masked * c);
  loss.backward();
  mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
  EXPECT_EQ(report.saved_activations, 4 * 96 + 24) << report.table();
  for (const mt::SavedActivationRow& row : report.saved)
    EXPECT_EQ(row.bytes, row.storage == mt::boolean ? 24 : 96);
}

// layer_norm and rms_norm keep their input alone for the backward pass, as PyTorch's do (which
// also keep each row's statistics): loss = sum(norm(2 x, w, b) * c) saves the norm's input and c.
// The composites' own gradients kept the centered and the normalized rows, and 1/std.
TEST(MemoryReport, NormsKeepTheirInputAlone) {
  constexpr int64_t kRows = 8, kCols = 16;
  for (bool layer : {true, false}) {
    mt::Linear affine(kCols, kCols);  // its bias (the parameter) makes the norm's weight and bias
    mt::Tensor x = mt::tensor(iota_values(kRows * kCols, -1.0f, 0.0625f), {kRows, kCols});
    mt::Tensor c = mt::tensor(iota_values(kRows * kCols, 0.5f, -0.03125f), {kRows, kCols});
    mt::Tensor w = affine.bias * 0.5 + 1.0, b = affine.bias;
    mt::Tensor h = x * 2.0;
    mt::Tensor y = layer ? mt::layer_norm(h, w, b) : mt::rms_norm(h, w);
    mt::Tensor loss = mt::sum(y * c);
    loss.backward();
    mt::MemoryReport report = mt::memory_report(affine, nullptr, loss);
    EXPECT_EQ(report.saved_activations, 2 * kRows * kCols * 4)
        << (layer ? "layer_norm" : "rms_norm") << "\n"
        << report.table();
  }
}

// A vocabulary head's loss, cross_entropy(x W^T, y) over [batch, time] tokens, keeps the logits
// in their own type and one id per token for the backward pass, and computes the gradient from
// them in one kernel: no [tokens, classes] value in f32 is kept (the log-probabilities, their
// gradient) and no bool mask. Under autocast-bf16 that kernel also lays the gradient out for the
// weight gradient's matmul in bf16, and the f32 gradient is never stored.
TEST(MemoryReport, CrossEntropyKeepsTheLogitsNotTheLogProbabilities) {
  constexpr int64_t kBatch = 4, kTime = 16, kClasses = 4096, kWidth = 16;
  constexpr int64_t kTokens = kBatch * kTime;
  for (const char* policy : {"fp32", "autocast-bf16"}) {
    const int64_t logit_bytes = kTokens * kClasses * (std::string(policy) == "fp32" ? 4 : 2);
    mt::Generator gen(8);
    OneParam head({kClasses, kWidth});
    mt::Tensor x = mt::randn({kBatch, kTime, kWidth}, mt::f32, &gen);
    std::vector<int64_t> ids(kTokens);
    for (int64_t r = 0; r < kTokens; ++r) ids[static_cast<size_t>(r)] = (r * 37) % kClasses;
    mt::Tensor y = mt::tensor(ids, {kBatch, kTime});
    mt::eval({x});
    mt::Tensor loss;
    {
      mt::autocast guard(mt::policy_by_name(policy));
      loss = mt::cross_entropy(mt::linear(x, head.w), y);
    }
    loss.backward();
    mt::MemoryReport report = mt::memory_report(head, nullptr, loss);
    // The logits, the class list the ids are checked against, per token its id, whether it
    // counts, its row's max and log-sum-exp and x, and the loss's denominator.
    EXPECT_LE(report.saved_activations,
              logit_bytes + kClasses * 8 + kTokens * (8 + 1 + 8 + kWidth * 4) + 4)
        << report.table();
    if (mt::current_device() == mt::Device::reference) continue;  // runs no program
    mt::reset_execution_stats();
    mt::eval({loss, head.w.grad()});
    // At the peak: the logits and their gradient, both in the logits' type, x and a few values
    // per token.
    EXPECT_LE(mt::execution_stats().peak_bytes, 2 * logit_bytes + kTokens * (32 + kWidth * 4))
        << policy;
  }
}

// loss = sum(x @ w^T) under autocast-f16, w [3, 4], x data [2, 4]. The matmul reads w's f16 copy
// (24 B, alive only while the forward matmul runs: backward only needs x for dW).
//   at the matmul: x 32 + copy 24 + y (f16 [2, 3]) 12 = 68 -> 48 + 68 = 116;
//   at the sum: x 32 + y 12 + loss 4 = 48; at dW: x 32 + loss 4 + dW = 36 + dW.
TEST(MemoryReport, HandWorkedHalfCopyAndPeakUnderAutocast) {
  OneParam model({3, 4});
  mt::Tensor x = mt::tensor(iota_values(8, -0.5f, 0.25f), {2, 4});
  mt::Tensor y, loss;
  {
    mt::autocast guard(mt::f16);
    y = mt::matmul(x, model.w, false, true);
    loss = mt::sum(y);
  }
  loss.backward();
  mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
  ASSERT_EQ(y.node()->precision.storage_type, mt::f16)
      << "precondition: autocast keeps matmul results in f16";
  ASSERT_EQ(loss.node()->precision.storage_type, mt::f32) << "precondition: sums are stored in f32";
  const int64_t dw = grad_bytes(model);
  EXPECT_EQ(report.policy, "autocast-f16");
  EXPECT_EQ(report.master_weights, 48);
  EXPECT_EQ(report.half_copies, 24);
  ASSERT_EQ(report.parameters.at(0).half_copies, std::vector<mt::DType>{mt::f16});
  EXPECT_EQ(report.gradients, dw);
  EXPECT_EQ(report.saved_activations, 32);
  EXPECT_EQ(report.peak, std::max<int64_t>(116, 48 + 36 + dw));
  if (dw < 32) {
    EXPECT_EQ(report.peak_node, y.node()->id);
    EXPECT_EQ(report.peak_op, "matmul");
  }
}

// ---- the MLP under three policies ----

// Masters 38 params x 4 B = 152 B whatever the policy. The backward pass reads x (data [4, 3],
// f32: 48 B), r = relu's output (dW2 and relu's own gradient need it, [4, 6]) and d = y - target
// (square's input, [4, 2]); nothing else of the forward pass (not h = fc1's output: relu's
// gradient reads its output, as PyTorch's does).
//   fp32:         48 + 96 + 32 = 176
//   autocast-f16: 48 + 48 + 32 = 128 (linear and relu in f16; y - target promotes to f32)
//   pure-bf16:    48 + 48 + 16 = 112 (the subtraction runs in bf16 too)
// Every parameter is read by a 16-bit matmul or bias broadcast under both half policies: one
// 2-byte copy each, 76 B. Adam's state is 2 x 152 B.
TEST(MemoryReport, MlpUnderThreePolicies) {
  struct Case {
    mt::PolicyPtr policy;
    mt::DType half_storage;  // h and r
    mt::DType diff_storage;  // d
    int64_t half_copies, saved;
  };
  const std::vector<Case> cases{{mt::fp32_policy(), mt::f32, mt::f32, 0, 176},
                                {mt::autocast_policy(mt::f16), mt::f16, mt::f32, 76, 128},
                                {mt::pure_policy(mt::bf16), mt::bf16, mt::bf16, 76, 112}};
  std::vector<mt::MemoryReport> reports;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.policy->name());
    Mlp net;
    mt::Adam adam(net.parameters(), {});
    MlpStep s = mlp_step(net, c.policy);
    mt::MemoryReport report = mt::memory_report(net, &adam, s.loss);
    // The precision pass ran; these are what the hand count assumed of the policy.
    ASSERT_EQ(s.h.node()->precision.storage_type, c.half_storage);
    ASSERT_EQ(s.r.node()->precision.storage_type, c.half_storage);
    ASSERT_EQ(s.d.node()->precision.storage_type, c.diff_storage);

    EXPECT_EQ(report.policy, c.policy->name());
    EXPECT_EQ(report.master_weights, 152);
    EXPECT_EQ(report.half_copies, c.half_copies);
    EXPECT_EQ(report.gradients, grad_bytes(net));
    if (c.policy == mt::fp32_policy()) {
      EXPECT_EQ(report.gradients, 152);
    }
    EXPECT_EQ(report.optimizer_state, 304);
    EXPECT_TRUE(report.optimizer_state_estimated);
    EXPECT_EQ(report.saved_activations, c.saved);
    std::vector<uint64_t> saved_ids;
    for (const mt::SavedActivationRow& row : report.saved) saved_ids.push_back(row.id);
    EXPECT_EQ(saved_ids, (std::vector<uint64_t>{s.x.node()->id, s.r.node()->id, s.d.node()->id}));

    // Per-parameter rows add up to the totals.
    ASSERT_EQ(report.parameters.size(), 4u);
    EXPECT_EQ(report.parameters[0].name, "fc1.weight");
    EXPECT_EQ(report.parameters[0].master_bytes, 72);
    EXPECT_EQ(report.parameters[0].state_bytes, 144);
    int64_t masters = 0, halves = 0, grads = 0, state = 0;
    for (const mt::MemoryParamRow& p : report.parameters) {
      masters += p.master_bytes;
      halves += p.half_copy_bytes;
      grads += p.grad_bytes;
      state += p.state_bytes;
      EXPECT_EQ(p.half_copies.empty(), c.half_copies == 0) << p.name;
    }
    EXPECT_EQ(masters, report.master_weights);
    EXPECT_EQ(halves, report.half_copies);
    EXPECT_EQ(grads, report.gradients);
    EXPECT_EQ(state, report.optimizer_state);

    // Whatever the liveness details: the first backward node runs while every saved activation
    // is kept, and the last one while every gradient and the loss are.
    EXPECT_GE(report.peak, report.persistent() + report.saved_activations);
    EXPECT_GE(report.peak, report.persistent() + report.gradients + 4);
    // ... and no more can be live at once than every value of the step (views and fills take
    // less) plus the half copies.
    std::vector<mt::Tensor> outputs{s.loss};
    std::vector<uint64_t> param_ids;
    for (const mt::Tensor& p : net.parameters()) {
      outputs.push_back(p.grad());
      param_ids.push_back(p.node()->id);
    }
    int64_t all_values = 0;
    for (const mt::PrecisionRow& row : mt::precision_report(outputs).rows)
      if (std::find(param_ids.begin(), param_ids.end(), row.id) == param_ids.end())
        all_values += mt::numel(row.shape) * static_cast<int64_t>(mt::size_of(row.storage));
    EXPECT_LE(report.peak, report.persistent() + report.half_copies + all_values);

    mt::json::Value json = mt::json::parse(report.json());
    EXPECT_EQ(json.at("policy").get<std::string>(), c.policy->name());
    EXPECT_EQ(json.at("master_weights").get<int64_t>(), report.master_weights);
    EXPECT_EQ(json.at("half_copies").get<int64_t>(), report.half_copies);
    EXPECT_EQ(json.at("gradients").get<int64_t>(), report.gradients);
    EXPECT_EQ(json.at("optimizer_state").get<int64_t>(), report.optimizer_state);
    EXPECT_EQ(json.at("saved_activations").get<int64_t>(), report.saved_activations);
    EXPECT_EQ(json.at("peak").get<int64_t>(), report.peak);
    EXPECT_EQ(json.at("peak_at").at("id").get<int64_t>(), static_cast<int64_t>(report.peak_node));
    EXPECT_EQ(json.at("parameters").size(), 4u);
    EXPECT_EQ(json.at("saved").size(), 3u);
    std::string table = report.table();
    for (const char* fragment : {"fc1.weight", "fc2.bias", "saved activations", "peak"})
      EXPECT_NE(table.find(fragment), std::string::npos) << fragment;
    reports.push_back(report);
  }
  std::string comparison = mt::memory_comparison_table(reports);
  EXPECT_NE(comparison.find("autocast-f16"), std::string::npos);
  EXPECT_NE(comparison.find("pure-bf16"), std::string::npos);
}

// A parameter is cast once per step and type however often it is read, also through views.
TEST(MemoryReport, HalfCopiesAreMadeOncePerStepAndType) {
  {  // used twice (tied weights): one f16 copy
    OneParam model({4, 4});
    mt::Tensor x = mt::tensor(iota_values(8, 0.5f, 0.25f), {2, 4});
    mt::Tensor loss;
    {
      mt::autocast guard(mt::f16);
      loss = mt::sum(mt::matmul(mt::matmul(x, model.w), model.w));
    }
    loss.backward();
    mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
    EXPECT_EQ(report.half_copies, 32);
  }
  {  // used under f16 and under bf16: one copy of each
    OneParam model({4, 4});
    mt::Tensor x = mt::tensor(iota_values(8, 0.5f, 0.25f), {2, 4});
    mt::Tensor a, b;
    {
      mt::autocast guard(mt::f16);
      a = mt::sum(mt::matmul(x, model.w));
    }
    {
      mt::autocast guard(mt::bf16);
      b = mt::sum(mt::matmul(x, model.w));
    }
    mt::Tensor loss = a + b;
    loss.backward();
    mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
    EXPECT_EQ(report.half_copies, 64);
    EXPECT_EQ(report.parameters.at(0).half_copies, (std::vector<mt::DType>{mt::f16, mt::bf16}));
    EXPECT_EQ(report.policy, "autocast-f16, autocast-bf16");
  }
  {  // reshaped outside autocast (an f32 view of the master), read by an f16 matmul
    OneParam model({12});
    mt::Tensor x = mt::tensor(iota_values(8, 0.5f, 0.25f), {2, 4});
    mt::Tensor w = mt::reshape(model.w, {3, 4});
    mt::Tensor loss;
    {
      mt::autocast guard(mt::f16);
      loss = mt::sum(mt::matmul(x, w, false, true));
    }
    loss.backward();
    mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
    EXPECT_EQ(report.half_copies, 24);
  }
  {  // the same graph in f32: no copies
    OneParam model({4, 4});
    mt::Tensor x = mt::tensor(iota_values(8, 0.5f, 0.25f), {2, 4});
    mt::Tensor loss = mt::sum(mt::matmul(mt::matmul(x, model.w), model.w));
    loss.backward();
    EXPECT_EQ(mt::memory_report(model, nullptr, loss).half_copies, 0);
  }
}

// Real state once it exists; nothing for a plain SGD.
TEST(MemoryReport, OptimizerStateBeforeAndAfterTheFirstStep) {
  Mlp net;
  mt::SGD momentum(net.parameters(), {.lr = 0.01, .momentum = 0.9});
  MlpStep first = mlp_step(net, nullptr);
  mt::MemoryReport before = mt::memory_report(net, &momentum, first.loss);
  EXPECT_EQ(before.optimizer_state, 152);
  EXPECT_TRUE(before.optimizer_state_estimated);
  momentum.step();
  momentum.zero_grad();
  MlpStep second = mlp_step(net, nullptr);
  mt::MemoryReport after = mt::memory_report(net, &momentum, second.loss);
  EXPECT_EQ(after.optimizer_state, 152);
  EXPECT_FALSE(after.optimizer_state_estimated);

  Mlp plain_net;
  mt::SGD plain(plain_net.parameters(), {.lr = 0.01});
  MlpStep step = mlp_step(plain_net, nullptr);
  EXPECT_EQ(mt::memory_report(plain_net, &plain, step.loss).optimizer_state, 0);
}

// Makes a rule's optimizer over the parameters.
using MakeOptimizer = std::function<std::unique_ptr<mt::Optimizer>(std::vector<mt::Tensor>)>;

template <class Rule, class Options>
MakeOptimizer rule_with(Options options) {
  return [options](std::vector<mt::Tensor> p) -> std::unique_ptr<mt::Optimizer> {
    return std::make_unique<Rule>(std::move(p), options);
  };
}

// Every built-in rule's estimate before its first step is the state that step makes (each rule
// says what it keeps: Optimizer::state_elements and state_dtype), Adafactor's factored rows and
// columns too, for an f32 and a bf16 model (whose plain rules keep bf16 state, Adafactor f32),
// and RMSprop's momentum buffer when a schedule cycles the momentum.
TEST(MemoryReport, EveryRulesEstimateIsTheStateItsFirstStepMakes) {
  MakeOptimizer cycled = [](std::vector<mt::Tensor> p) -> std::unique_ptr<mt::Optimizer> {
    auto opt = std::make_unique<mt::RMSprop>(std::move(p), mt::RMSpropOptions{.lr = 1e-3});
    opt->set_schedule(std::make_shared<mt::OneCycleLR>(1e-3, 100));
    return opt;
  };
  const std::vector<std::pair<const char*, MakeOptimizer>> rules{
      {"SGD", rule_with<mt::SGD>(mt::SGDOptions{.momentum = 0.9})},
      {"AdamW", rule_with<mt::AdamW>(mt::AdamOptions{.weight_decay = 0.01})},
      {"RMSprop centered with momentum",
       rule_with<mt::RMSprop>(mt::RMSpropOptions{.momentum = 0.5, .centered = true})},
      {"Adagrad", rule_with<mt::Adagrad>(mt::AdagradOptions{})},
      {"Lion", rule_with<mt::Lion>(mt::LionOptions{})},
      {"Adafactor", rule_with<mt::Adafactor>(mt::AdafactorOptions{})},
      {"Adafactor with beta1", rule_with<mt::Adafactor>(mt::AdafactorOptions{.beta1 = 0.9})},
      {"AdamW with amsgrad", rule_with<mt::AdamW>(mt::AdamOptions{.amsgrad = true})},
      {"Adamax", rule_with<mt::Adamax>(mt::AdamaxOptions{})},
      {"NAdam (its mu_product in f32 for a bf16 model)", rule_with<mt::NAdam>(mt::NAdamOptions{})},
      {"RAdam", rule_with<mt::RAdam>(mt::RAdamOptions{})},
      {"Adadelta", rule_with<mt::Adadelta>(mt::AdadeltaOptions{})},
      {"RMSprop, its momentum cycled by OneCycleLR", cycled}};
  for (const auto& [name, make] : rules) {
    for (mt::DType model : {mt::f32, mt::bf16}) {
      SCOPED_TRACE(std::string(name) + " on an " + std::string(mt::name(model)) + " model");
      Mlp net;
      net.to(model);
      std::unique_ptr<mt::Optimizer> opt = make(net.parameters());
      mt::MemoryReport before = mt::memory_report(net, opt.get(), mlp_step(net, nullptr).loss);
      EXPECT_TRUE(before.optimizer_state_estimated);
      EXPECT_GT(before.optimizer_state, 0);
      opt->step();
      opt->zero_grad();
      mt::MemoryReport after = mt::memory_report(net, opt.get(), mlp_step(net, nullptr).loss);
      EXPECT_FALSE(after.optimizer_state_estimated);
      EXPECT_EQ(before.optimizer_state, after.optimizer_state);
    }
  }
}

// With a real batch the activations dominate and a half policy lowers the peak.
TEST(MemoryReport, HalfPoliciesLowerThePeakOfALargeBatch) {
  Mlp a, b;
  MlpStep fp32 = mlp_step(a, mt::fp32_policy(), 256);
  MlpStep half = mlp_step(b, mt::autocast_policy(mt::bf16), 256);
  mt::MemoryReport r32 = mt::memory_report(a, nullptr, fp32.loss);
  mt::MemoryReport r16 = mt::memory_report(b, nullptr, half.loss);
  EXPECT_EQ(r32.saved_activations, 256 * (12 + 24 + 8));
  EXPECT_EQ(r16.saved_activations, 256 * (12 + 12 + 8));
  EXPECT_LT(r16.peak, r32.peak);
}

// The compiled back end's figure is its memory plan's: running the same evaluation reports the
// same peak, exactly, under fp32 and under a half policy.
TEST(MemoryReport, CompiledPeakIsWhatTheProgramReports) {
  for (const char* policy : {"fp32", "autocast-bf16"}) {
    mt::Generator gen(4);
    mt::MLP model({16, 96, 96, 8}, mt::Activation::Relu, &gen);
    mt::Tensor x = mt::randn({256, 16}, mt::f32, &gen);
    mt::Tensor y = mt::randn({256, 8}, mt::f32, &gen);
    mt::eval({x, y});
    mt::Tensor loss;
    {
      mt::autocast guard(mt::policy_by_name(policy));
      loss = mt::mse_loss(model(x), y);
    }
    loss.backward();
    mt::MemoryReport report = mt::memory_report(model, nullptr, loss);
    // Forward activations of 256 x 96 floats are stored for backward, so the plan holds more
    // than one of them, and a value dropped after its last reader makes it less than all.
    EXPECT_GT(report.compiled_peak, 256 * 96 * 2) << policy;
    EXPECT_NE(report.json().find("\"compiled_peak\""), std::string::npos);
    if (mt::current_device() == mt::Device::reference) continue;  // runs no program
    std::vector<mt::Tensor> outputs{loss};
    for (const mt::Tensor& p : model.parameters()) outputs.push_back(p.grad());
    mt::reset_execution_stats();
    mt::eval(outputs);
    EXPECT_EQ(mt::execution_stats().peak_bytes, report.compiled_peak) << policy;
  }
}

// A reshape shares its input's buffer: flatten of a batch evaluated before stores nothing (both
// peaks counted the batch's 768 KiB again), and the program's peak is the report's.
TEST(MemoryReport, AFlattenedBatchIsNotCountedAgain) {
  mt::Generator gen(2);
  mt::Linear fc(3072, 10, true, &gen);
  mt::Tensor x = mt::randn({64, 3, 32, 32}, mt::f32, &gen), y = mt::randn({64, 10}, mt::f32, &gen);
  mt::eval({x, y});
  mt::Tensor loss = mt::mse_loss(fc(mt::flatten(x, 1)), y);
  loss.backward();
  mt::MemoryReport report = mt::memory_report(fc, nullptr, loss);
  const int64_t batch = 64 * 3072 * 4, weight_grad = 3072 * 10 * 4;
  EXPECT_GE(report.compiled_peak, weight_grad);
  EXPECT_LT(report.compiled_peak, batch / 4);
  if (mt::current_device() == mt::Device::reference) return;  // runs no program
  mt::reset_execution_stats();
  mt::eval({loss, fc.weight.grad(), fc.bias.grad()});
  EXPECT_EQ(mt::execution_stats().peak_bytes, report.compiled_peak);
}

// An embedding's gradient is its rows added into a table of zeros (index_add): that fill is a
// stored buffer, not folded into a kernel, so the peak holds the master, the zeros and the
// gradient (it missed one whole table).
TEST(MemoryReport, AnEmbeddingsZeroTableIsStored) {
  mt::Generator gen(3);
  mt::Embedding emb(20000, 64, &gen);
  mt::eval({emb.weight});
  mt::Tensor loss = mt::sum(mt::square(emb(mt::tensor(std::vector<int64_t>(16, 7), {16}))));
  loss.backward();
  mt::MemoryReport report = mt::memory_report(emb, nullptr, loss);
  const int64_t table = 20000 * 64 * 4;
  EXPECT_GE(report.peak, 3 * table);
  EXPECT_LT(report.peak, 3 * table + table / 10);
}

// The report's policy is the step's, not that of a constant made once by an earlier step under
// another policy (cross_entropy's class indices), and module buffers are persistent memory.
TEST(MemoryReport, NamesTheStepsPolicyAndCountsModuleBuffers) {
  std::string named;
  for (const char* policy : {"autocast-f16", "autocast-bf16"}) {
    mt::Generator gen(5);
    mt::Sequential net;
    net.emplace_back<mt::Linear>(8, 6, true, &gen);
    net.emplace_back<mt::BatchNorm1d>(6);
    mt::Tensor x = mt::randn({4, 8}, mt::f32, &gen);
    mt::Tensor loss;
    {
      mt::autocast guard(mt::policy_by_name(policy));
      loss = mt::cross_entropy(net(x), mt::tensor(std::vector<int64_t>{0, 1, 2, 5}, {4}));
    }
    loss.backward();
    mt::MemoryReport report = mt::memory_report(net, nullptr, loss);
    EXPECT_EQ(report.policy, policy);
    int64_t buffers = 0;
    for (const auto& [name, b] : net.named_buffers())
      buffers += b.numel() * static_cast<int64_t>(mt::size_of(b.dtype()));
    EXPECT_EQ(buffers, 6 * 4 * 2 + 8);  // running mean and variance, num_batches_tracked
    EXPECT_EQ(report.buffers, buffers);
    EXPECT_EQ(report.persistent(), report.master_weights + buffers);
    EXPECT_NE(report.table().find("module buffers"), std::string::npos);
    EXPECT_NE(report.json().find("\"buffers\":56"), std::string::npos);
  }
}

TEST(MemoryReport, RejectsAnUndefinedLoss) {
  Mlp net;
  EXPECT_MT_ERROR(mt::memory_report(net, nullptr, mt::Tensor()), "memory_report", "undefined");
}

}  // namespace
