// tests/test_reliability.cpp -- hostile sizes, allocation failures, the memory limit and misuse
// that used to crash, answer wrongly or double gradients silently: each is a clear mt::Error.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <mixtape/mixtape.h>

#include "mixtape/dsl/byte_count.h"
#include "mixtape/dsl/host_memory.h"
#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

constexpr int64_t k32 = int64_t{1} << 32;
constexpr int64_t k62 = int64_t{1} << 62;

// Each used to segfault in a release build (or return 0 on the reference executor), with UBSan
// reporting the signed overflow in numel.
TEST(Reliability, ElementCountsThatOverflowAreErrorsNamingTheOpAndShape) {
  EXPECT_MT_ERROR(mt::sum(mt::zeros({k32, k32}) + 1).item(), "zeros", "[4294967296, 4294967296]",
                  "64-bit");
  EXPECT_MT_ERROR(mt::sum(mt::broadcast_to(mt::ones({1}), {k62, 4})).item(), "broadcast_to",
                  "[4611686018427387904, 4]");
  EXPECT_MT_ERROR(mt::matmul(mt::ones({k62, 1}), mt::ones({1, 8})).item(), "ones",
                  "[4611686018427387904, 1]", "2^60 bytes");
  EXPECT_MT_ERROR(mt::sum(mt::zeros({k62}) + 1).item(), "zeros", "2^60 bytes");
  // (2^62 + 1) * 4 wraps to 4 in int64: four values used to be accepted for it.
  EXPECT_MT_ERROR(mt::tensor(std::vector<float>{1, 2, 3, 4}, {k62 + 1, 4}), "tensor",
                  "[4611686018427387905, 4]");
  EXPECT_MT_ERROR(mt::arange(0, 1e300), "arange", "more elements");
  EXPECT_MT_ERROR(mt::reshape(mt::ones({4}), {k32, k32, 0, 4}), "reshape");
}

// Huge steps and many huge inputs used to overflow before any node was made: a strided slice's
// last index wrapped negative and passed its bounds check (segfault reading, a write far outside
// the buffer), a single-axis slice with a huge step came out empty, and concat's axis wrapped.
TEST(Reliability, HugeStepsAndConcatenatedSizesDoNotWrap) {
  mt::Tensor x = mt::arange(10, mt::f32);
  const std::vector<int64_t> start{0}, huge_step{k62};
  EXPECT_MT_ERROR(mt::slice(x, start, huge_step, mt::Shape{3}), "slice", "does not fit");
  EXPECT_MT_ERROR(mt::unslice(mt::ones({3}), start, huge_step, mt::Shape{10}), "unslice",
                  "does not fit");
  // As Python's x[0:10:huge]: the first element alone.
  mt::Tensor first = mt::slice(x, 0, 0, 10, INT64_MAX);
  ASSERT_EQ(first.shape(), (mt::Shape{1}));
  EXPECT_EQ(first.to_vector<float>(), std::vector<float>{0});
  std::vector<mt::Tensor> parts;
  for (int i = 0; i < 16; ++i)
    parts.push_back(mt::broadcast_to(mt::ones({1}, mt::boolean), {int64_t{1} << 60}));
  parts.push_back(mt::ones({5}, mt::boolean));  // 16 * 2^60 + 5 wrapped to 5
  EXPECT_MT_ERROR(mt::concat(parts), "concat", "64-bit");
}

// Allocations that the system cannot satisfy were std::bad_alloc / std::length_error.
TEST(Reliability, AllocationFailuresAreErrorsWithTheBytesAskedFor) {
  EXPECT_MT_ERROR(mt::sum(mt::zeros({int64_t{1} << 40}) + 1).item(), "out of memory", "4.0 TiB",
                  "[1099511627776]");
  EXPECT_MT_ERROR(mt::sum(mt::arange(0, 1e12)).item(), "arange", "out of memory", "7.3 TiB");
  // The process goes on as if nothing happened.
  EXPECT_EQ(mt::sum(mt::ones({1000}) + 1).item(), 2000);
}

struct MemoryLimit : ::testing::Test {
  ~MemoryLimit() override { mt::set_memory_limit(0); }
};

TEST_F(MemoryLimit, AnEvaluationPastTheLimitFailsCleanly) {
  mt::set_memory_limit(int64_t{32} << 20);
  EXPECT_EQ(mt::memory_limit(), int64_t{32} << 20);
  // 64 MiB of f32: an error naming the op, the bytes and the limit, not an OOM kill.
  EXPECT_MT_ERROR(mt::sum(mt::exp(mt::ones({int64_t{16} << 20}))).item(), "out of memory",
                  "64.0 MiB", "32.0 MiB", "memory limit", "[16777216]");
  // Within the limit everything still works, and the values freed on the way do not count.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(mt::sum(mt::ones({1 << 20}) * 2).item(), 2 << 20);
  EXPECT_LE(mt::host_memory_stats().live_bytes, int64_t{32} << 20);
  mt::set_memory_limit(0);
  EXPECT_EQ(mt::sum(mt::exp(mt::zeros({int64_t{16} << 20}))).item(), 16 << 20);
  EXPECT_MT_ERROR(mt::set_memory_limit(-1), "set_memory_limit");
}

TEST_F(MemoryLimit, ACheckpointPastTheLimitIsRefusedBeforeAllocating) {
  std::string path = ::testing::TempDir() + "/reliability_limit.safetensors";
  mt::save_tensors(path, {{"big", mt::ones({int64_t{1} << 20})}});  // 4 MiB
  mt::set_memory_limit(int64_t{2} << 20);
  EXPECT_MT_ERROR(mt::load_tensors(path), "out of memory", "loading", "reliability_limit",
                  "memory limit");
  mt::set_memory_limit(0);
  EXPECT_EQ(mt::load_tensors(path).at(0).second.numel(), int64_t{1} << 20);
  std::remove(path.c_str());
}

TEST(Reliability, MemoryLimitSyntax) {
  EXPECT_EQ(mt::parse_byte_count("8G"), int64_t{8} << 30);
  EXPECT_EQ(mt::parse_byte_count("512M"), int64_t{512} << 20);
  EXPECT_EQ(mt::parse_byte_count("64KiB"), int64_t{64} << 10);
  EXPECT_EQ(mt::parse_byte_count("2T"), int64_t{2} << 40);
  EXPECT_EQ(mt::parse_byte_count("1000000"), 1000000);
  for (const char* bad : {"", "G", "8X", "-1", "1.5G", "99999999999999999999", "9000000000T"})
    EXPECT_FALSE(mt::parse_byte_count(bad).has_value()) << bad;
}

// The reference executor bound a reference to a null element (UBSan) for k = 0.
TEST(Reliability, MatmulOverAnEmptyInnerDimensionIsZeros) {
  mt::Tensor c = mt::matmul(mt::zeros({2, 0}), mt::zeros({0, 3}));
  EXPECT_EQ(c.shape(), (mt::Shape{2, 3}));
  EXPECT_EQ(c.to_vector<float>(), std::vector<float>(6, 0.0f));
  mt::Tensor batched = mt::matmul(mt::ones({2, 4, 0}), mt::ones({2, 0, 5}));
  EXPECT_EQ(batched.to_vector<float>(), std::vector<float>(40, 0.0f));
}

// The error used to name index_select, which the user never called.
TEST(Reliability, CrossEntropyLabelOutOfRangeNamesCrossEntropyTheLabelAndTheClassCount) {
  mt::Tensor logits = mt::zeros({2, 10});
  mt::Tensor labels = mt::tensor(std::vector<int64_t>{3, 12}, {2});
  EXPECT_MT_ERROR(mt::cross_entropy(logits, labels).item(), "cross_entropy", "index 12", "size 10");
}

// A second backward() through the same graph silently doubled the gradients.
TEST(Reliability, BackwardTwiceThroughOneGraphIsAnErrorUnlessRetained) {
  mt::Tensor x = mt::tensor(std::vector<float>{1, 2, 3}, {3});
  x.requires_grad_();
  mt::Tensor y = mt::sum(x * x);
  y.backward();
  std::vector<float> once = x.grad().to_vector<float>();
  EXPECT_EQ(once, (std::vector<float>{2, 4, 6}));
  EXPECT_MT_ERROR(y.backward(), "backward", "second backward()", "retain_graph");
  EXPECT_EQ(x.grad().to_vector<float>(), once);  // nothing accumulated
  mt::sum(x * x * 2).backward();                 // a fresh graph over the same leaf is fine
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{6, 12, 18}));
  // Two losses sharing a walked part: the second walk needs the first to retain the graph.
  mt::Tensor z = mt::tensor(std::vector<float>{1, 2, 3}, {3});
  z.requires_grad_();
  mt::Tensor shared = z * z;
  mt::Tensor first = mt::sum(shared), second = mt::mean(shared);
  first.backward(mt::Tensor(), /*retain_graph=*/true);
  second.backward();  // allowed: the first call kept the graph
  std::vector<float> expected = {2 + 2.0f / 3, 4 + 4.0f / 3, 8}, got = z.grad().to_vector<float>();
  for (size_t i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(got[i], expected[i]);
  EXPECT_MT_ERROR(first.backward(), "backward", "second backward()");
}

// A submodule that was never register_module'd trains silently nowhere: its parameters get
// gradients, but net.parameters() (and so the optimizer) does not list them.
struct Forgetful : mt::Module {
  mt::Linear registered{3, 4}, forgotten{4, 2};
  Forgetful() { register_module("registered", registered); }
  mt::Tensor operator()(const mt::Tensor& x) const { return forgotten(mt::relu(registered(x))); }
};

TEST(Reliability, AParameterNoOptimizerUpdatesGetsOneWarningAtTheStep) {
  Forgetful net;
  mt::SGD opt(net.parameters(), {.lr = 0.1});
  mt::Tensor x = mt::ones({5, 3});
  auto step = [&] {
    opt.zero_grad();
    mt::sum(net(x)).backward();
    testing::internal::CaptureStderr();
    opt.step();
    return testing::internal::GetCapturedStderr();
  };
  std::string first = step();
  // Two parameters of the forgotten Linear, each named with its shape, once.
  EXPECT_NE(first.find("parameter 'weight' [2, 4]"), std::string::npos) << first;
  EXPECT_NE(first.find("parameter 'bias' [2]"), std::string::npos) << first;
  EXPECT_NE(first.find("register_module"), std::string::npos) << first;
  EXPECT_EQ(first.find("[4, 3]"), std::string::npos) << first;  // the registered one is fine
  EXPECT_EQ(step(), "");                                        // once per parameter
  // Inputs that take gradients with no optimizer step (saliency, adversarial examples) are not
  // parameters: nothing is remembered or reported for them.
  for (int i = 0; i < 3; ++i) {
    mt::Tensor input = mt::ones({5, 3});
    input.requires_grad_();
    mt::sum(net(input)).backward();
  }
  EXPECT_EQ(step(), "");
  // A model whose every parameter trains is never warned about.
  mt::Linear whole(3, 2);
  mt::SGD whole_opt(whole.parameters(), {.lr = 0.1});
  whole_opt.zero_grad();
  mt::sum(whole(x)).backward();
  testing::internal::CaptureStderr();
  whole_opt.step();
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

// An optimizer refuses a computed tensor, as torch's ("can't optimize a non-leaf Tensor"): it
// took w * 2, never updated it, and the next backward failed with an unrelated message.
TEST(Reliability, AnOptimizerRefusesANonLeafTensor) {
  mt::Tensor w = mt::ones({3});
  w.requires_grad_();
  mt::Tensor y = w * 2.0;
  EXPECT_MT_ERROR(mt::SGD({y}, {.lr = 0.1}), "SGD", "parameter 0", "not a leaf");
  EXPECT_MT_ERROR(mt::AdamW({w, y}), "AdamW", "parameter 1", "not a leaf");
}

// A step whose graph fails to evaluate (a target out of range) leaves the GradScaler ready for
// the next: its unscaled gradients and inf flag were of the failed graph, which every later
// step() evaluated again (the same error for good) and update() folded into the scale.
TEST(Reliability, AGradScalerGoesOnAfterAStepThatFailedToEvaluate) {
  mt::Generator gen(3);
  mt::Linear lin(4, 3, true, &gen);
  mt::SGD opt(lin.parameters(), {.lr = 0.1});
  mt::GradScaler scaler({.init_scale = 1024});
  mt::Tensor x = mt::randn({2, 4}, mt::f32, &gen);
  auto step = [&](std::vector<int64_t> labels) {
    opt.zero_grad();
    scaler.scale(mt::cross_entropy(lin(x), mt::tensor(labels, {2}))).backward();
    scaler.step(opt);
    scaler.update();
  };
  step({1, 2});
  std::vector<float> before = lin.weight.to_vector<float>();
  EXPECT_MT_ERROR(step({1, 9}), "out of range");
  EXPECT_EQ(lin.weight.to_vector<float>(), before) << "the failed step changed nothing";
  step({1, 2});
  EXPECT_NE(lin.weight.to_vector<float>(), before) << "the next step trains";
  EXPECT_EQ(scaler.get_scale(), 1024.0);
  EXPECT_EQ(opt.steps_taken(), 2);
}

}  // namespace
