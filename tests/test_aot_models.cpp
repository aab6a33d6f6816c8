// tests/test_aot_models.cpp -- models export bit for bit: the char GPT of
// examples/char_gpt_model.h, a TransformerBlock, a small convolution net and fused attention, as
// functions at batch 1, 7 and the max (rank-3 shapes, attention masks, embedding gathers under a
// dynamic batch) and as training steps against mt::compile, in fp32, autocast bf16 and autocast
// f16 with dynamic loss scaling, and the char GPT with every block checkpointed as a training step.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "examples/char_gpt_model.h"
#include "tests/aot_test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;
using namespace mixtape::aot_test;

namespace {

// Small enough that a test takes a few seconds, big enough to have every part: two blocks of two
// heads, a context of 8. Dropout is 0 here; tests/test_aot_dropout.cpp exports steps with dropout.
constexpr int64_t kVocab = 13, kWidth = 16, kHeads = 2, kTime = 8, kMaxBatch = 360;
GptConfig small_gpt() {
  return {.vocab = kVocab, .layers = 2, .heads = kHeads, .width = kWidth, .context = kTime};
}

// Convolutions of each kind and max pooling, so that an artifact runs all three convolution
// primitives and both pooling ones forward and backward: [batch, 3, 8, 8] to itself through a
// strided convolution and a transposed one.
constexpr int64_t kImage = 8;
struct SmallCnn : mt::Module {
  mt::Conv2d in, down;
  mt::ConvTranspose2d up;
  explicit SmallCnn(mt::Generator* gen)
      : in(3, 4, 3, {.padding = 1}, true, gen),
        down(4, 4, 3, {.stride = 2, .padding = 1}, true, gen),
        up(4, 3, 3, {.stride = 2, .padding = 1, .output_padding = 1}, true, gen) {
    register_module("in", in);
    register_module("down", down);
    register_module("up", up);
  }
  // Max pooling (3x3, stride 1, padding 1: the size stays) between them runs both pooling
  // primitives too.
  mt::Tensor operator()(const mt::Tensor& x) const {
    return up(mt::max_pool2d(mt::relu(down(mt::relu(in(x)))), 3, 1, 1));
  }
};

// Fused attention between two projections, so that an artifact runs scaled_dot_product_attention's
// one op and its gradient: [batch, T, C] to itself, two causal heads.
struct SmallAttention : mt::Module {
  mt::Linear qkv, out;
  explicit SmallAttention(mt::Generator* gen)
      : qkv(kWidth, 3 * kWidth, true, gen), out(kWidth, kWidth, true, gen) {
    register_module("qkv", qkv);
    register_module("out", out);
  }
  mt::Tensor operator()(const mt::Tensor& x) const {
    const int64_t batch = x.size(0), head = kWidth / kHeads;
    mt::Tensor heads =
        mt::permute(mt::reshape(qkv(x), {batch, kTime, 3 * kHeads, head}), {0, 2, 1, 3});
    auto part = [&](int64_t i) { return mt::slice(heads, 1, i * kHeads, (i + 1) * kHeads); };
    mt::Tensor y = mt::scaled_dot_product_attention(part(0), part(1), part(2), true);
    return out(mt::reshape(mt::permute(y, {0, 2, 1, 3}), {batch, kTime, kWidth}));
  }
};

// One of the models under test, with what it takes and how it is trained.
struct Subject {
  std::string kind;  // "gpt", "gpt_checkpointed", "block", "cnn" or "attn"
  std::unique_ptr<mt::Module> module;
  std::function<mt::Tensor(const mt::Tensor&)> forward;  // logits (gpt) or activations (block)

  Subject(const std::string& kind, uint64_t seed) : kind(kind) {
    mt::Generator gen(seed);
    if (gpt()) {
      auto gpt = std::make_unique<CharGpt>(small_gpt(), &gen);
      // "gpt_checkpointed": every block recomputed in the backward pass, which groups its
      // kernels as the plain step does not (runtime/program.cpp); the artifact must group them
      // the same at load.
      if (kind == "gpt_checkpointed")
        for (auto& block : gpt->blocks) block->checkpoint(true);
      forward = [m = gpt.get()](const mt::Tensor& tokens) { return (*m)(tokens); };
      module = std::move(gpt);
    } else if (kind == "cnn") {
      auto cnn = std::make_unique<SmallCnn>(&gen);
      forward = [m = cnn.get()](const mt::Tensor& x) { return (*m)(x); };
      module = std::move(cnn);
    } else if (kind == "attn") {
      auto attn = std::make_unique<SmallAttention>(&gen);
      forward = [m = attn.get()](const mt::Tensor& x) { return (*m)(x); };
      module = std::move(attn);
    } else {
      auto block = std::make_unique<mt::TransformerBlock>(kWidth, kHeads, 0.0, &gen);
      forward = [m = block.get()](const mt::Tensor& x) { return (*m)(x); };
      module = std::move(block);
    }
  }
  bool gpt() const { return kind.starts_with("gpt"); }
  // One example's shape: tokens [T] (gpt), activations [T, C] (block) or images [3, H, W].
  mt::Shape example() const {
    if (gpt()) return {kTime};
    if (kind == "cnn") return {3, kImage, kImage};
    return {kTime, kWidth};
  }
  mt::Shape batched(int64_t batch) const {
    mt::Shape shape = example();
    shape.insert(shape.begin(), batch);
    return shape;
  }
  // The model's input at `batch` rows: tokens i64 or activations f32.
  mt::aot::Input input(int64_t batch) const {
    return gpt() ? mt::aot::input("tokens", batched(batch), mt::i64)
                 : mt::aot::input("x", batched(batch), mt::f32);
  }
  int64_t output_row() const { return gpt() ? kTime * kVocab : mt::numel(example()); }
  // A batch of the model's input; also the training target: next tokens (gpt) or a regression
  // target (block).
  mt::Tensor sample(int64_t batch, std::mt19937_64& g) const {
    if (gpt()) {
      std::vector<int64_t> tokens(static_cast<size_t>(batch * kTime));
      for (int64_t& t : tokens) t = static_cast<int64_t>(g() % kVocab);
      return mt::tensor(tokens, {batch, kTime}, mt::i64);
    }
    std::normal_distribution<float> normal;
    std::vector<float> x(static_cast<size_t>(mt::numel(batched(batch))));
    for (float& v : x) v = normal(g);
    return mt::tensor(x, batched(batch));
  }
  mt::Tensor loss(const mt::Tensor& x, const mt::Tensor& y) const {
    mt::Tensor out = forward(x);
    return gpt() ? mt::cross_entropy(out, y) : mt::mse_loss(mt::cast(out, mt::f32), y);
  }
};

using Case = std::tuple<std::string, std::string>;  // model, policy
std::string case_name(const testing::TestParamInfo<Case>& info) {
  return std::get<0>(info.param) + "_" + std::get<1>(info.param);
}

// The cases both suites run: every model under every policy, and fused attention under autocast
// (half operands, f32 tiles) only, for CI time.
const auto every_model_and_policy = testing::Combine(testing::Values("gpt", "block", "cnn"),
                                                     testing::Values("fp32", "bf16", "f16"));
const auto attention_cases = testing::Combine(testing::Values("attn"), testing::Values("bf16"));
const auto checkpointed_cases =
    testing::Combine(testing::Values("gpt_checkpointed"), testing::Values("bf16"));

// ---- the inference function: equal to the JIT at batch 1, 7 and the max ----

class AotModelFunction : public testing::TestWithParam<Case> {};

TEST_P(AotModelFunction, EqualsTheJitAtEveryBatch) {
  const auto& [kind, policy] = GetParam();
  Subject subject(kind, 3);
  subject.module->eval();
  auto forward = [&](const mt::Tensor& x) {
    auto scope = policy_scope(policy);
    return mt::cast(subject.forward(x), mt::f32);
  };
  std::string name = "model_" + kind;
  std::string dir = temp_dir("models_fn_" + kind + "_" + policy);
  mt::aot::Options o{
      .name = name, .dynamic_batch = {.max = kMaxBatch}, .module = subject.module.get()};
  mt::aot::Exported exported =
      mt::aot::export_function(forward, {subject.input(kMaxBatch)}, {"out"}, dir, o);
  Table table(exported);
  Model model(dir, name, table);
  ASSERT_NE(model.m, nullptr);
  std::mt19937_64 g(11);
  for (int64_t batch : {int64_t{1}, int64_t{7}, kMaxBatch}) {
    mt::Tensor x = subject.sample(batch, g);
    std::vector<float> expected;
    {
      mt::NoGradGuard no_grad;
      expected = forward(x).to_vector<float>();
    }
    std::vector<float> got(static_cast<size_t>(batch * subject.output_row()));
    std::vector<int64_t> tokens;
    std::vector<float> activations;
    const void* in[1];
    if (subject.gpt()) {
      tokens = x.to_vector<int64_t>();
      in[0] = tokens.data();
    } else {
      activations = x.to_vector<float>();
      in[0] = activations.data();
    }
    void* out[] = {got.data()};
    ASSERT_EQ(mixtape_aot_run(model.m, batch, in, out), 0) << mixtape_aot_error(model.m);
    size_t first = first_difference(got, expected);
    ASSERT_EQ(first, got.size()) << "batch " << batch << ": " << got[first] << " against "
                                 << expected[first];
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Models, AotModelFunction, every_model_and_policy, case_name);
INSTANTIATE_TEST_SUITE_P(Attention, AotModelFunction, attention_cases, case_name);

// ---- the training step: N exported steps equal N steps of mt::compile ----

class AotModelStep : public testing::TestWithParam<Case> {};

TEST_P(AotModelStep, EqualsCompile) {
  const auto& [kind, policy] = GetParam();
  constexpr int64_t batch = 4, steps = 6;
  Subject subject(kind, 5);
  mt::AdamW opt(subject.module->parameters(), {.lr = 3e-3, .weight_decay = 0.01});
  // f16: a scale so large that the first steps overflow and are skipped, then backs off, and a
  // short growth interval, so both the skip and the growth are replayed.
  mt::GradScaler scaler({.init_scale = 1 << 20, .growth_interval = 2, .enabled = policy == "f16"});
  auto train_step = [&](const mt::Tensor& x, const mt::Tensor& y) {
    opt.zero_grad();
    mt::Tensor loss;
    {
      auto scope = policy_scope(policy);
      loss = subject.loss(x, y);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    return loss;
  };
  // One step first: the optimizer makes its state at its first step (see export_step).
  std::mt19937_64 g(9);
  train_step(subject.sample(batch, g), subject.sample(batch, g));
  std::string name = "model_" + kind + "_train";
  std::string dir = temp_dir("models_step_" + kind + "_" + policy);
  mt::aot::Options o{
      .name = name, .module = subject.module.get(), .optimizer = &opt, .scaler = &scaler};
  mt::aot::Input target = subject.input(batch);
  target.name = "y";
  if (subject.gpt()) target.dtype = mt::i64;
  // The export's traces (on zeros) are no updates of the run: the scaler's statistics stay.
  const int64_t skipped_before = scaler.skipped_steps();
  const std::vector<double> scales_before = scaler.scale_history();
  mt::aot::Exported exported =
      mt::aot::export_step(train_step, {subject.input(batch), target}, {"loss"}, dir, o);
  EXPECT_EQ(scaler.skipped_steps(), skipped_before);
  EXPECT_EQ(scaler.scale_history(), scales_before);
  Table table(exported);
  Model model(dir, name, table);
  ASSERT_NE(model.m, nullptr);
  auto compiled = mt::compile(train_step);
  for (int64_t s = 0; s < steps; ++s) {
    mt::Tensor x = subject.sample(batch, g), y = subject.sample(batch, g);
    mt::Tensor expected = compiled(x, y);
    std::vector<int64_t> tokens, next;
    std::vector<float> activations, wanted;
    const void* in[2];
    if (subject.gpt()) {
      tokens = x.to_vector<int64_t>();
      next = y.to_vector<int64_t>();
      in[0] = tokens.data();
      in[1] = next.data();
    } else {
      activations = x.to_vector<float>();
      wanted = y.to_vector<float>();
      in[0] = activations.data();
      in[1] = wanted.data();
    }
    float loss = 0;
    void* out[] = {&loss};
    ASSERT_EQ(mixtape_aot_run(model.m, batch, in, out), 0) << mixtape_aot_error(model.m);
    float want = expected.to_vector<float>()[0];
    EXPECT_EQ(std::memcmp(&loss, &want, sizeof loss), 0)
        << "step " << s << ": " << loss << " against " << want;
  }
  if (policy == "f16") {
    // Both paths ran: some steps were skipped for overflow, and some updated the model.
    int64_t skipped = scaler.skipped_steps() - skipped_before;
    EXPECT_GT(skipped, 0);
    EXPECT_LT(skipped, steps);
  }
  std::string saved = dir + "_saved.safetensors", reference = dir + "_reference.safetensors";
  ASSERT_EQ(mixtape_aot_save(model.m, saved.c_str()), 0) << mixtape_aot_error(model.m);
  mt::save_checkpoint(reference, *subject.module, &opt, {}, &scaler);
  expect_same_checkpoint(saved, reference);
  for (const std::string& f : {saved, reference}) fs::remove(f);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Models, AotModelStep, every_model_and_policy, case_name);
INSTANTIATE_TEST_SUITE_P(Attention, AotModelStep, attention_cases, case_name);
INSTANTIATE_TEST_SUITE_P(Checkpointed, AotModelStep, checkpointed_cases, case_name);

}  // namespace
