// tests/test_activation_checkpointing.cpp -- activation checkpointing (mt::checkpoint): the same
// gradient bits with and without it (an MLP, the char GPT with dropout under autocast), the
// saved-activation peak it cuts, compiled replays of checkpointed steps, memory_report, and the
// measured process memory peak of execution_stats().
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <mixtape/mixtape.h>

#include "examples/char_gpt_model.h"
#include "mixtape/dsl/module_path.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

// Every test starts and ends without checkpointed modules: the list is process-wide.
class Checkpointing : public ::testing::Test {
 protected:
  void SetUp() override { mt::clear_checkpoints(); }
  void TearDown() override { mt::clear_checkpoints(); }
};

// Tokens of a fixed pseudo-random sequence, [batch, time] below `vocab`.
mt::Tensor tokens(int64_t batch, int64_t time, int64_t vocab, uint64_t salt) {
  std::vector<int64_t> values(static_cast<size_t>(batch * time));
  uint64_t state = 0x9E3779B97F4A7C15ull ^ salt;
  for (int64_t& v : values) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<int64_t>((state >> 33) % static_cast<uint64_t>(vocab));
  }
  return mt::tensor(values, {batch, time});
}

struct Net : mt::Module {
  mt::Linear in{16, 32};
  mt::MLP body{{32, 64, 64, 32}, mt::Activation::Gelu};
  mt::Linear out{32, 4};
  Net() {
    register_module("in", in);
    register_module("body", body);
    register_module("out", out);
  }
  mt::Tensor operator()(const mt::Tensor& x) const { return out(body(mt::tanh(in(x)))); }
};

mt::Tensor mlp_loss(const Net& net) {
  std::vector<float> x(8 * 16), y(8 * 4);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 19) / 9.0f - 1.0f;
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>((i * 11) % 7) / 3.0f - 1.0f;
  return mt::mse_loss(net(mt::tensor(x, {8, 16})), mt::tensor(y, {8, 4}));
}

// What one backward pass gave: the loss, every parameter's gradient (as bits) and the stored
// values' peak of the one evaluation that computed them.
struct Pass {
  std::vector<uint32_t> loss;
  std::vector<std::vector<uint32_t>> grads;
  int64_t peak_bytes = 0;
};

Pass backward_pass(const mt::Module& model, const mt::Tensor& loss) {
  loss.backward();
  std::vector<mt::Tensor> values{loss};
  for (const mt::Tensor& p : model.parameters()) values.push_back(p.grad());
  mt::reset_execution_stats();
  mt::eval(values);
  Pass pass;
  pass.peak_bytes = mt::execution_stats().peak_bytes;
  pass.loss = f32_bits(loss);
  for (size_t i = 1; i < values.size(); ++i) pass.grads.push_back(f32_bits(values[i]));
  return pass;
}

TEST(ModulePath, TheOutermostModuleAGlobMatches) {
  EXPECT_EQ(mt::matched_module_prefix("blocks.*", "blocks.3.attn.qkv"), size_t{8});
  EXPECT_EQ(mt::matched_module_prefix("**.attn", "blocks.3.attn.qkv"), size_t{13});
  EXPECT_EQ(mt::matched_module_prefix("blocks.3", "blocks.3"), size_t{8});
  EXPECT_FALSE(mt::matched_module_prefix("blocks.3", "blocks.30.mlp").has_value());
  EXPECT_FALSE(mt::matched_module_prefix("blocks.*", "head").has_value());
  EXPECT_FALSE(mt::matched_module_prefix("", "head").has_value());
}

TEST_F(Checkpointing, ModulesAreSelectedByGlobOrByTheModule) {
  GptConfig config{.vocab = 8, .layers = 2, .heads = 1, .width = 8, .context = 4};
  CharGpt model(config);
  model.blocks[1].checkpoint();
  mt::checkpoint("**.mlp");
  mt::checkpoint("**.mlp");  // once
  EXPECT_EQ(mt::checkpoints(), (std::vector<std::string>{"blocks.1", "**.mlp"}));
  model.blocks[1].checkpoint(false);
  EXPECT_EQ(mt::checkpoints(), (std::vector<std::string>{"**.mlp"}));
  EXPECT_FALSE(mt::remove_checkpoint("blocks.1"));
  EXPECT_THROW(model.checkpoint(), mt::Error);  // the root has no path
  EXPECT_THROW(mt::checkpoint(""), mt::Error);
}

TEST_F(Checkpointing, AnMlpGetsTheSameGradientBits) {
  Net net;
  Pass plain = backward_pass(net, mlp_loss(net));
  net.zero_grad();
  net.body.checkpoint();
  mt::Tensor loss = mlp_loss(net);
  loss.backward();
  // The backward pass really recomputed the body: memory_report sees its clones.
  mt::MemoryReport report = mt::memory_report(net, nullptr, loss);
  EXPECT_GT(report.recomputed_nodes, 0);
  net.zero_grad();
  Pass checkpointed = backward_pass(net, mlp_loss(net));
  EXPECT_EQ(plain.loss, checkpointed.loss);
  ASSERT_EQ(plain.grads.size(), checkpointed.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i)
    EXPECT_EQ(plain.grads[i], checkpointed.grads[i]) << "parameter " << i;
}

TEST_F(Checkpointing, MemoryReportShowsTheSavedActivationsWithAndWithout) {
  Net net;
  mt::Tensor loss = mlp_loss(net);
  loss.backward();
  mt::MemoryReport without = mt::memory_report(net, nullptr, loss);
  net.zero_grad();
  mt::checkpoint("body");
  loss = mlp_loss(net);
  loss.backward();
  mt::MemoryReport with = mt::memory_report(net, nullptr, loss);
  EXPECT_EQ(without.recomputed_nodes, 0);
  EXPECT_GT(with.recomputed_activations, 0);
  EXPECT_LT(with.saved_activations, without.saved_activations);
  // Of the values made in the body only its output stays saved (the head's backward reads it);
  // without checkpointing, every layer's input and activation did.
  auto saved_in_body = [](const mt::MemoryReport& report) {
    int64_t count = 0;
    for (const mt::SavedActivationRow& row : report.saved)
      count += mt::module_path_matches("body", row.module_path);
    return count;
  };
  EXPECT_EQ(saved_in_body(with), 1);
  EXPECT_GE(saved_in_body(without), 3);
  EXPECT_NE(with.table().find("recomputed activations"), std::string::npos);
}

// The char GPT of examples/char_gpt.cpp's defaults (4 blocks, 4 heads, width 128, context 64,
// batch 12) with dropout and a small vocabulary.
GptConfig gpt_config() {
  return {.vocab = 32, .layers = 4, .heads = 4, .width = 128, .context = 64, .dropout = 0.1};
}

Pass gpt_pass(CharGpt& model, mt::Generator& gen, uint64_t offset, bool autocast) {
  gen.set_state(gen.seed(), offset);  // the same dropout masks for every pass
  model.zero_grad();
  mt::Tensor loss;
  {
    std::optional<mt::autocast> guard;
    if (autocast) guard.emplace(mt::bf16);
    loss = model.loss(tokens(12, 64, 32, 1), tokens(12, 64, 32, 2));
  }
  return backward_pass(model, loss);
}

void expect_same_gradients(const CharGpt& model, const Pass& plain, const Pass& checkpointed) {
  EXPECT_EQ(plain.loss, checkpointed.loss);
  ASSERT_EQ(plain.grads.size(), checkpointed.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i)
    EXPECT_EQ(plain.grads[i], checkpointed.grads[i]) << model.named_parameters()[i].first;
}

// Recomputation keeps every node's op, types and random counters: op by op (one kernel each,
// as the reference executor computes), the gradients are the same bits, in f32 and under
// autocast-bf16. In fused programs a reduction's bits can follow what else its kernel computes
// (the vectorizer picks its partial sums by the kernel's body), and recomputation changes what
// kernels read from memory and what they compute inline (docs/DESIGN.md, decision 14).
TEST_F(Checkpointing, TheCharGptWithDropoutGetsTheSameBitsOpByOp) {
  mt::eager_scope eager;
  for (bool autocast : {false, true}) {
    mt::clear_checkpoints();
    mt::Generator gen(7);
    CharGpt model(gpt_config(), &gen);
    const uint64_t offset = gen.offset();
    Pass plain = gpt_pass(model, gen, offset, autocast);
    mt::checkpoint("blocks.*");
    Pass checkpointed = gpt_pass(model, gen, offset, autocast);
    SCOPED_TRACE(autocast ? "autocast-bf16" : "f32");
    expect_same_gradients(model, plain, checkpointed);
  }
}

TEST_F(Checkpointing, EveryBlockCheckpointedCutsTheStoredPeakOfTheCharGptBy60Percent) {
  mt::Generator gen(7);
  CharGpt model(gpt_config(), &gen);
  const uint64_t offset = gen.offset();
  gpt_pass(model, gen, offset, false);  // the first pass also evaluates the initial weights
  Pass plain = gpt_pass(model, gen, offset, false);
  mt::checkpoint("blocks.*");
  Pass checkpointed = gpt_pass(model, gen, offset, false);
  EXPECT_EQ(plain.loss, checkpointed.loss);
  // The fused programs' gradients agree to the last bits of their reductions.
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    float largest = 0, worst = 0;
    for (size_t j = 0; j < plain.grads[i].size(); ++j) {
      float a = std::bit_cast<float>(plain.grads[i][j]);
      float b = std::bit_cast<float>(checkpointed.grads[i][j]);
      largest = std::max(largest, std::abs(a));
      worst = std::max(worst, std::abs(a - b));
    }
    EXPECT_LE(worst, 1e-5f * largest) << model.named_parameters()[i].first;
  }
  // The target: at least 60% less of the stored values' peak (bytes are deterministic).
  if (mt::current_device() != mt::Device::reference) {
    EXPECT_LE(checkpointed.peak_bytes * 10, plain.peak_bytes * 4)
        << checkpointed.peak_bytes << " bytes with checkpointing, " << plain.peak_bytes
        << " without";
  }
}

TEST_F(Checkpointing, ACompiledStepReplaysWhatTracingComputes) {
  GptConfig config = gpt_config();
  config.layers = 2;
  config.width = 32;
  config.context = 16;
  mt::checkpoint("blocks.*");
  struct Run {
    mt::Generator gen{11};
    CharGpt model;
    mt::AdamW opt;
    explicit Run(const GptConfig& config)
        : model(config, &gen), opt(model.parameters(), {.lr = 1e-2}) {}
    mt::Tensor step(const mt::Tensor& x, const mt::Tensor& y) {
      opt.zero_grad();
      mt::Tensor loss = model.loss(x, y);
      loss.backward();
      opt.step();
      return loss;
    }
  };
  Run traced(config), compiled(config);
  auto step =
      mt::compile([&](const mt::Tensor& x, const mt::Tensor& y) { return compiled.step(x, y); });
  const int steps = 5;
  for (int i = 0; i < steps; ++i) {
    mt::Tensor x = tokens(4, 16, config.vocab, 10 + i), y = tokens(4, 16, config.vocab, 20 + i);
    EXPECT_EQ(f32_bits(traced.step(x, y)), f32_bits(step(x, y))) << "step " << i;
  }
  std::vector<mt::Tensor> a = traced.model.parameters(), b = compiled.model.parameters();
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(f32_bits(a[i]), f32_bits(b[i])) << "parameter " << i;
  if (mt::current_device() != mt::Device::reference) {
    EXPECT_GT(step.stats().replays, 0) << step.stats().reason;
  }
}

TEST(MeasuredMemory, ThePeakCoversTheStoredValuesAndGrowsWithABigTensor) {
  Net net;
  mt::reset_execution_stats();
  mt::Tensor loss = mlp_loss(net);
  loss.backward();
  std::vector<mt::Tensor> values{loss};
  for (const mt::Tensor& p : net.parameters()) values.push_back(p.grad());
  mt::eval(values);
  mt::ExecutionStats stats = mt::execution_stats();
  EXPECT_GE(stats.memory_peak_bytes, stats.peak_bytes);
  EXPECT_GE(stats.host_peak_bytes, mt::host_memory_stats().live_bytes);
  EXPECT_EQ(stats.memory_peak_bytes, stats.host_peak_bytes + stats.device_peak_bytes);

  const int64_t big = int64_t{16} << 20;  // 64 MiB of f32
  mt::reset_execution_stats();
  const int64_t before = mt::execution_stats().memory_peak_bytes;
  {
    mt::Tensor ones = mt::ones({big}) * 2.0;
    mt::eval({ones});
    EXPECT_GE(mt::execution_stats().memory_peak_bytes - before, big * 4);
  }
  // A reset starts over at what is live now, after the tensor is gone.
  mt::reset_execution_stats();
  EXPECT_LT(mt::execution_stats().memory_peak_bytes, before + big * 4);
}

}  // namespace
