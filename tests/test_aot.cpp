// tests/test_aot.cpp -- exported artifacts replay bit for bit what the JIT computes (functions at
// any allowed batch, N training steps against mt::compile), and refuse bad input with a code.
#include <gtest/gtest.h>
#include <immintrin.h>
#include <unistd.h>

#include <fmt/format.h>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "examples/digits_model.h"
#include "mixtape/runtime/safetensors.h"
#include "tests/aot_test_util.h"
#include "tests/test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;

namespace {

using namespace mt::aot_test;

std::vector<float> digits_inputs(int64_t batch, uint64_t seed) {
  mt::Generator g(seed);
  return mt::rand({batch, 64}, mt::f32, &g).to_vector<float>();
}

class AotFunction : public testing::TestWithParam<std::string> {};

TEST_P(AotFunction, DigitsMlpEqualsTheJitAtEveryBatch) {
  mt::manual_seed(3);
  DigitsMLP net;
  std::string dir = temp_dir("fn_" + GetParam());
  auto forward = [&](const mt::Tensor& x) {
    auto scope = policy_scope(GetParam());
    return mt::cast(net(x), mt::f32);
  };
  mt::aot::Options o{.name = "digits", .dynamic_batch = {.max = getenv("FIXED") ? 0 : 1024}};
  mt::aot::Exported exported = mt::aot::export_function(
      forward, {mt::aot::input("x", {1024, 64}, mt::f32)}, {"logits"}, dir, o);
  Table table(exported);
  Model model(dir, "digits", table);
  ASSERT_NE(model.m, nullptr);
  for (int64_t batch : {1024, 1, 7, 360}) {
    std::vector<float> x = digits_inputs(batch, 10 + batch);
    std::vector<float> expected;
    {
      mt::NoGradGuard no_grad;
      expected = forward(mt::tensor(x, {batch, 64})).to_vector<float>();
    }
    std::vector<float> got(batch * 10);
    const void* in[] = {x.data()};
    void* out[] = {got.data()};
    ASSERT_EQ(mixtape_aot_run(model.m, batch, in, out), 0) << mixtape_aot_error(model.m);
    size_t first = 0;
    while (first < got.size() && std::memcmp(&got[first], &expected[first], sizeof(float)) == 0)
      ++first;
    ASSERT_EQ(first, got.size()) << "batch " << batch << ": " << got[first] << " against "
                                 << expected[first];
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Policies, AotFunction, testing::Values("fp32", "bf16", "f16"));

// N exported steps leave parameters, optimizer and scaler state bit-identical to N steps of
// mt::compile from the same state, and NAME_save writes a checkpoint load_checkpoint reads.
class AotStep : public testing::TestWithParam<std::string> {};

TEST_P(AotStep, TrainingStepEqualsCompile) {
  const std::string policy = GetParam();
  constexpr int64_t batch = 32, steps = 5;
  mt::manual_seed(5);
  DigitsTrainer trainer(policy);
  auto& [_, net, opt, scaler] = trainer;
  auto train_step = trainer.step_function();
  // One step first: the optimizer makes its state at its first step (see export_step).
  mt::Generator g(9);
  train_step(mt::randn({batch, 64}, mt::f32, &g), mt::zeros({batch}, mt::i64));
  std::string dir = temp_dir("step_" + policy);
  std::string start = dir + "_start.safetensors";
  mt::save_checkpoint(start, net, &opt, {}, &scaler);
  mt::aot::Options o{.name = "digits_train", .module = &net, .optimizer = &opt, .scaler = &scaler};
  mt::aot::Exported exported = mt::aot::export_step(
      train_step,
      {mt::aot::input("x", {batch, 64}, mt::f32), mt::aot::input("y", {batch}, mt::i64)}, {"loss"},
      dir, o);
  // The export put the state back: the model still saves what it did before.
  std::string after_export = dir + "_after.safetensors";
  mt::save_checkpoint(after_export, net, &opt, {}, &scaler);
  EXPECT_EQ(mt::load_tensors(after_export).size(), mt::load_tensors(start).size());
  for (auto& [name, t] : mt::load_tensors(start)) {
    auto again = mt::load_tensors(after_export);
    auto found = std::find_if(again.begin(), again.end(), [&](auto& e) { return e.first == name; });
    ASSERT_NE(found, again.end());
    EXPECT_EQ(t.to_vector<double>(), found->second.to_vector<double>()) << name;
  }

  Table table(exported);
  Model model(dir, "digits_train", table);
  ASSERT_NE(model.m, nullptr);
  auto compiled = mt::compile(train_step);
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<float> x = mt::randn({batch, 64}, mt::f32, &g).to_vector<float>();
    // Large inputs in one step overflow f16 and make the scaler skip it.
    if (s == 2)
      for (float& v : x) v *= 3e4f;
    std::vector<int64_t> y(batch);
    for (int64_t i = 0; i < batch; ++i) y[i] = (i * 7 + s) % 10;
    mt::Tensor expected = compiled(mt::tensor(x, {batch, 64}), mt::tensor(y, {batch}, mt::i64));
    float loss = 0;
    const void* in[] = {x.data(), y.data()};
    void* out[] = {&loss};
    ASSERT_EQ(mixtape_aot_run(model.m, batch, in, out), 0) << mixtape_aot_error(model.m);
    float want = expected.to_vector<float>()[0];
    EXPECT_EQ(std::memcmp(&loss, &want, sizeof loss), 0) << "step " << s;
  }
  std::string saved = dir + "_saved.safetensors";
  ASSERT_EQ(mixtape_aot_save(model.m, saved.c_str()), 0) << mixtape_aot_error(model.m);
  // Over the artifact's own weights or manifest (through another spelling of the path too) the
  // save is refused, and the artifact still opens.
  for (const std::string& own :
       {dir + "/digits_train.safetensors",
        dir + "/../" + fs::path(dir).filename().string() + "/digits_train.json"}) {
    EXPECT_EQ(mixtape_aot_save(model.m, own.c_str()), MIXTAPE_AOT_ERROR_ARGUMENT) << own;
    EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("the artifact's own"), std::string::npos)
        << mixtape_aot_error(model.m);
  }
  // Nor over its library or header, nor over what an export beside it wrote (a sibling
  // artifact's weights, named by its manifest; any library, header, package or plan file).
  for (const std::string& own : {dir + "/libdigits_train.so", dir + "/digits_train.h"}) {
    EXPECT_EQ(mixtape_aot_save(model.m, own.c_str()), MIXTAPE_AOT_ERROR_ARGUMENT) << own;
    EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("the artifact's own"), std::string::npos)
        << mixtape_aot_error(model.m);
  }
  std::ofstream(dir + "/sibling.json") << "{}";
  for (const std::string& beside : {dir + "/sibling.safetensors", dir + "/libsibling.so",
                                    dir + "/sibling.h", dir + "/sibling.plan"}) {
    EXPECT_EQ(mixtape_aot_save(model.m, beside.c_str()), MIXTAPE_AOT_ERROR_ARGUMENT) << beside;
    EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("a file an export wrote"),
              std::string::npos)
        << mixtape_aot_error(model.m);
    EXPECT_FALSE(fs::exists(beside) && fs::file_size(beside) > 0) << beside;
  }
  fs::remove(dir + "/sibling.json");
  const std::string in_folder = dir + "/state.safetensors";  // a checkpoint of its own is fine
  EXPECT_EQ(mixtape_aot_save(model.m, in_folder.c_str()), 0) << mixtape_aot_error(model.m);
  fs::remove(in_folder);
  Model again(dir, "digits_train", table);
  EXPECT_NE(again.m, nullptr);
  std::string reference = dir + "_reference.safetensors";
  mt::save_checkpoint(reference, net, &opt, {}, &scaler);
  expect_same_checkpoint(saved, reference);
  // And the C++ side reads it, and the artifact reads what C++ wrote.
  mt::load_checkpoint(saved, net, &opt, nullptr, &scaler);
  EXPECT_EQ(mixtape_aot_load(model.m, reference.c_str()), 0) << mixtape_aot_error(model.m);
  {
    // A file of one group from before one group's parameters were listed: its rate as
    // optimizer.lr, no optimizer.param_groups. load_checkpoint takes it, and so does the artifact.
    mt::Metadata meta;
    mt::NamedTensors entries = mt::load_tensors(reference, &meta);
    std::erase_if(meta, [](const auto& entry) { return entry.first == "optimizer.param_groups"; });
    meta.emplace_back("optimizer.lr", fmt::format("{}", opt.lr()));
    const std::string older = dir + "_older.safetensors";
    mt::save_tensors(older, entries, meta);
    EXPECT_EQ(mixtape_aot_load(model.m, older.c_str()), 0) << mixtape_aot_error(model.m);
    mt::load_checkpoint(older, net, &opt, nullptr, &scaler);
    fs::remove(older);
  }
  {
    // The optimizer's options but the rate are compiled into the step too: a file of others is
    // refused (load_checkpoint restores them, as torch's load_state_dict).
    const std::string other = dir + "_options.safetensors";
    mt::safetensors::File file = mt::safetensors::read(reference);
    bool found = false;
    for (auto& [key, value] : file.metadata)
      if (key == "optimizer.options") {
        found = true;
        value = R"([{"beta1":0.5,"beta2":0.999,"eps":1e-08,"weight_decay":0.0}])";
      }
    EXPECT_TRUE(found);
    mt::safetensors::write(other, file);
    EXPECT_EQ(mixtape_aot_load(model.m, other.c_str()), MIXTAPE_AOT_ERROR_FILE);
    EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("holds optimizer options"),
              std::string::npos)
        << mixtape_aot_error(model.m);
    // A file from before amsgrad and maximize were options names neither: it loads, as
    // load_checkpoint loads it, the options it names being the step's.
    for (auto& [key, value] : file.metadata)
      if (key == "optimizer.options")
        value = R"([{"beta1":0.9,"beta2":0.999,"eps":1e-08,"weight_decay":0.01}])";
    mt::safetensors::write(other, file);
    EXPECT_EQ(mixtape_aot_load(model.m, other.c_str()), 0) << mixtape_aot_error(model.m);
    mt::load_checkpoint(other, net, &opt, nullptr, &scaler);
    fs::remove(other);
  }
  if (policy == "f16") {
    // NAME_load took any scaler settings and growth tracker: the step's are compiled in, so a
    // file of other settings is refused (load_checkpoint adopts them, as PyTorch's), and a
    // tracker that is no count below the interval as load_checkpoint refuses it.
    const std::string bad = dir + "_bad.safetensors";
    mt::safetensors::File file = mt::safetensors::read(reference);
    for (auto& [key, value] : file.metadata)
      if (key == "scaler.growth_interval") value = "1000";
    mt::safetensors::write(bad, file);
    EXPECT_EQ(mixtape_aot_load(model.m, bad.c_str()), MIXTAPE_AOT_ERROR_FILE);
    EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("scaler.growth_interval = 1000"),
              std::string::npos)
        << mixtape_aot_error(model.m);
    for (double tracker : {-1.0, 2000.0}) {
      mt::safetensors::File file = mt::safetensors::read(reference);
      for (mt::safetensors::TensorData& t : file.tensors)
        if (t.name == "scaler.growth_tracker") {
          mt::Tensor value = mt::full(t.shape, tracker, t.dtype);
          mt::eval({value});
          const std::byte* bytes = value.node()->value->host_data();
          t.bytes.assign(bytes, bytes + t.bytes.size());
        }
      mt::safetensors::write(bad, file);
      EXPECT_EQ(mixtape_aot_load(model.m, bad.c_str()), MIXTAPE_AOT_ERROR_FILE) << tracker;
      EXPECT_THROW(mt::load_checkpoint(bad, net, &opt, nullptr, &scaler), mt::Error) << tracker;
    }
    fs::remove(bad);
  }
  for (const std::string& f : {start, after_export, saved, reference}) fs::remove(f);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Policies, AotStep, testing::Values("fp32", "bf16", "f16"));

// The rate of each parameter group without a schedule is state: NAME_load takes a checkpoint's
// (a rate lowered in C++, as ReduceLROnPlateau does), the steps then equal mt::compile's at
// that rate, and NAME_save writes it back; a file with a rate that is none is refused whole.
TEST(AotRates, LoadTakesEachGroupsRateAndSaveWritesItBack) {
  constexpr int64_t batch = 16;
  mt::manual_seed(3);
  DigitsMLP net;
  std::vector<mt::Tensor> matrices, vectors;
  for (const mt::Tensor& p : net.parameters()) (p.dim() > 1 ? matrices : vectors).push_back(p);
  mt::AdamW opt(std::vector<mt::ParamGroup<mt::AdamOptions>>{
      {matrices, {.lr = 1e-2, .weight_decay = 0.1}}, {vectors, {.lr = 5e-3, .weight_decay = 0}}});
  auto train_step = [&](const mt::Tensor& x, const mt::Tensor& y) {
    opt.zero_grad();
    mt::Tensor loss = mt::cross_entropy(net(x), y);
    loss.backward();
    opt.step();
    return loss;
  };
  mt::Generator g(4);
  std::vector<int64_t> labels(batch);
  for (int64_t i = 0; i < batch; ++i) labels[i] = i % 10;
  const mt::Tensor y = mt::tensor(labels, {batch}, mt::i64);
  train_step(mt::randn({batch, 64}, mt::f32, &g), y);
  std::string dir = temp_dir("rates");
  mt::aot::Options o{.name = "rates_train", .module = &net, .optimizer = &opt};
  mt::aot::Exported exported = mt::aot::export_step(
      train_step,
      {mt::aot::input("x", {batch, 64}, mt::f32), mt::aot::input("y", {batch}, mt::i64)}, {"loss"},
      dir, o);
  Table table(exported);
  Model model(dir, "rates_train", table);
  ASSERT_NE(model.m, nullptr);
  auto compiled = mt::compile(train_step);
  auto same_steps = [&](int64_t steps) {
    for (int64_t s = 0; s < steps; ++s) {
      std::vector<float> x = mt::randn({batch, 64}, mt::f32, &g).to_vector<float>();
      float want = compiled(mt::tensor(x, {batch, 64}), y).to_vector<float>()[0], loss = 0;
      const void* in[] = {x.data(), labels.data()};
      void* out[] = {&loss};
      ASSERT_EQ(mixtape_aot_run(model.m, batch, in, out), 0) << mixtape_aot_error(model.m);
      EXPECT_EQ(std::memcmp(&loss, &want, sizeof loss), 0) << "step " << s;
    }
  };
  opt.set_lr(0, 2e-3);
  opt.set_lr(1, 1e-4);
  const std::string lowered = dir + "_lowered.safetensors";
  mt::save_checkpoint(lowered, net, &opt);
  ASSERT_EQ(mixtape_aot_load(model.m, lowered.c_str()), 0) << mixtape_aot_error(model.m);
  same_steps(3);
  // A rate that is none: refused, and the artifact goes on at the rates it had.
  const std::string bad = dir + "_bad.safetensors";
  mt::safetensors::File file = mt::safetensors::read(lowered);
  for (auto& [key, value] : file.metadata)
    if (key == "optimizer.param_groups") value.replace(value.find("0.0001"), 6, "-1");
  mt::safetensors::write(bad, file);
  EXPECT_EQ(mixtape_aot_load(model.m, bad.c_str()), MIXTAPE_AOT_ERROR_FILE);
  EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("group 1's rate = -1"), std::string::npos)
      << mixtape_aot_error(model.m);
  same_steps(1);
  const std::string saved = dir + "_saved.safetensors", reference = dir + "_reference.safetensors";
  ASSERT_EQ(mixtape_aot_save(model.m, saved.c_str()), 0) << mixtape_aot_error(model.m);
  mt::save_checkpoint(reference, net, &opt);
  expect_same_checkpoint(saved, reference);
  for (const std::string& f : {lowered, bad, saved, reference}) fs::remove(f);
  fs::remove_all(dir);
}

// A step that returns its logits beside the loss, which reads them, and keeps the last loss in
// a buffer it writes but never reads: the artifact returns both outputs, equal to mt::compile's,
// and the export leaves the buffer, in the model and in the artifact's weights, as it was.
TEST(AotStepOutputs, TheLogitsTheLossReadsAreReturnedAndAWrittenBufferKept) {
  constexpr int64_t batch = 8;
  struct Tracked : mt::Module {
    DigitsMLP net;
    mt::Tensor last_loss = mt::full({}, 42.0);
    Tracked() {
      register_module("net", net);
      register_buffer("last_loss", &last_loss);
    }
  };
  mt::manual_seed(6);
  Tracked model;
  mt::SGD opt(model.net.parameters(), {.lr = 0.05, .momentum = 0.9});
  auto train_step = [&](const mt::Tensor& x, const mt::Tensor& y) {
    opt.zero_grad();
    mt::Tensor logits = model.net(x);
    mt::Tensor loss = mt::cross_entropy(logits, y);
    loss.backward();
    opt.step();
    model.last_loss.assign(loss.detach() * 1.0f);
    return std::vector<mt::Tensor>{loss, logits};
  };
  mt::Generator g(2);
  std::vector<int64_t> labels(batch);
  for (int64_t i = 0; i < batch; ++i) labels[i] = (3 * i) % 10;
  const mt::Tensor y = mt::tensor(labels, {batch}, mt::i64);
  train_step(mt::randn({batch, 64}, mt::f32, &g), y);
  const std::vector<float> last_loss = model.last_loss.to_vector<float>();
  std::string dir = temp_dir("logits");
  mt::aot::Options o{.name = "logits_train", .module = &model, .optimizer = &opt};
  mt::aot::Exported exported = mt::aot::export_step(
      train_step,
      {mt::aot::input("x", {batch, 64}, mt::f32), mt::aot::input("y", {batch}, mt::i64)},
      {"loss", "logits"}, dir, o);
  EXPECT_EQ(model.last_loss.to_vector<float>(), last_loss);
  for (const auto& [name, value] : mt::load_tensors(dir + "/logits_train.safetensors"))
    if (name == "last_loss") {
      EXPECT_EQ(value.to_vector<float>(), last_loss);
    }
  Table table(exported);
  Model artifact(dir, "logits_train", table);
  ASSERT_NE(artifact.m, nullptr);
  auto compiled = mt::compile(train_step);
  for (int s = 0; s < 4; ++s) {
    std::vector<float> x = mt::randn({batch, 64}, mt::f32, &g).to_vector<float>();
    std::vector<mt::Tensor> want = compiled(mt::tensor(x, {batch, 64}), y);
    float loss = 0;
    std::vector<float> logits(batch * 10);
    const void* in[] = {x.data(), labels.data()};
    void* out[] = {&loss, logits.data()};
    ASSERT_EQ(mixtape_aot_run(artifact.m, batch, in, out), 0) << mixtape_aot_error(artifact.m);
    EXPECT_EQ(f32_bits(want[0])[0], std::bit_cast<uint32_t>(loss)) << "step " << s;
    EXPECT_EQ(want[1].to_vector<float>(), logits) << "step " << s;
  }
  EXPECT_GE(compiled.stats().replays, 2) << compiled.stats().reason;
  const std::string saved = dir + "_saved.safetensors", reference = dir + "_reference.safetensors";
  ASSERT_EQ(mixtape_aot_save(artifact.m, saved.c_str()), 0) << mixtape_aot_error(artifact.m);
  mt::save_checkpoint(reference, model, &opt);
  expect_same_checkpoint(saved, reference);
  for (const std::string& f : {saved, reference}) fs::remove(f);
  fs::remove_all(dir);
  // With the loss read before backward(), the backward pass computes the forward values again
  // from inputs no plan can bind for both evaluations: the export says so.
  auto reading_first = [&](const mt::Tensor& x, const mt::Tensor& y) {
    opt.zero_grad();
    mt::Tensor loss = mt::cross_entropy(model.net(x), y);
    mt::eval({loss});
    loss.backward();
    opt.step();
    return loss;
  };
  EXPECT_MT_ERROR(mt::aot::export_step(reading_first,
                                       {mt::aot::input("x", {batch, 64}, mt::f32),
                                        mt::aot::input("y", {batch}, mt::i64)},
                                       {"loss"}, dir, o),
                  "two evaluations of the call compute");
  fs::remove_all(dir);
}

// ---- bad input: a code and words, never a crash ----

class AotErrors : public testing::Test {
 protected:
  static void SetUpTestSuite() { art_ = new DigitsArtifact("errors"); }
  static void TearDownTestSuite() { delete art_; }
  int open(const std::string& dir, const char* device, mixtape_aot_model** m) {
    return mixtape_aot_open(dir.c_str(), "digits", art_->table->manifest_xxh3.c_str(), device,
                            art_->table->bind(), 1, m);
  }
  // A copy of the artifact whose file `file` is rewritten by `edit`.
  std::string edited(const std::string& file, const std::function<void(std::string&)>& edit) {
    std::string copy = art_->dir + "_edited";
    fs::remove_all(copy);
    fs::copy(art_->dir, copy);
    std::ifstream in(copy + "/" + file, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    in.close();
    edit(text);
    std::ofstream(copy + "/" + file, std::ios::binary) << text;
    return copy;
  }
  static DigitsArtifact* art_;
};
DigitsArtifact* AotErrors::art_ = nullptr;

TEST_F(AotErrors, BatchOutOfRange) {
  Model model(art_->dir, "digits", *art_->table);
  std::vector<float> x(17 * 64), y(17 * 10);
  const void* in[] = {x.data()};
  void* out[] = {y.data()};
  EXPECT_EQ(mixtape_aot_run(model.m, 0, in, out), MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("outside 1..16"), std::string::npos);
  EXPECT_EQ(mixtape_aot_run(model.m, 17, in, out), MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_EQ(mixtape_aot_run(model.m, 16, in, out), 0) << mixtape_aot_error(model.m);
}

// NAME_run leaves the caller's float mode as it found it (a program built with -ffast-math runs
// with FTZ and DAZ on): it cleared both bits, for good, to run under mixtape's own setting.
TEST_F(AotErrors, RunKeepsTheCallersFloatMode) {
#if defined(__SSE__)
  Model model(art_->dir, "digits", *art_->table);
  std::vector<float> x(64, 0.5f), y(10);
  const void* in[] = {x.data()};
  void* out[] = {y.data()};
  const unsigned before = _mm_getcsr();
  _mm_setcsr(before | 0x8040);  // FTZ and DAZ
  const int status = mixtape_aot_run(model.m, 1, in, out);
  const unsigned after = _mm_getcsr();
  _mm_setcsr(before);
  ASSERT_EQ(status, 0) << mixtape_aot_error(model.m);
  EXPECT_EQ(after & 0x8040, 0x8040u);
#else
  GTEST_SKIP() << "no MXCSR on this CPU";
#endif
}

TEST_F(AotErrors, NullPointers) {
  Model model(art_->dir, "digits", *art_->table);
  std::vector<float> x(64), y(10);
  const void* in[] = {x.data()};
  const void* null_in[] = {nullptr};
  void* out[] = {y.data()};
  EXPECT_EQ(mixtape_aot_run(nullptr, 1, in, out), MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("NULL"), std::string::npos);
  EXPECT_EQ(mixtape_aot_run(model.m, 1, nullptr, out), MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_EQ(mixtape_aot_run(model.m, 1, null_in, out), MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("input 'x'"), std::string::npos);
  EXPECT_EQ(mixtape_aot_save(model.m, nullptr), MIXTAPE_AOT_ERROR_ARGUMENT);
  mixtape_aot_model* m = nullptr;
  EXPECT_EQ(mixtape_aot_open(nullptr, "digits", "0", nullptr, nullptr, 0, &m),
            MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_EQ(mixtape_aot_open(art_->dir.c_str(), "digits", "0", nullptr, nullptr, 0, nullptr),
            MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_EQ(
      mixtape_aot_open(art_->dir.c_str(), "digits", nullptr, nullptr, art_->table->bind(), 1, &m),
      MIXTAPE_AOT_ERROR_ARGUMENT);
  mixtape_aot_close(nullptr);
}

TEST_F(AotErrors, MissingAndCorruptFiles) {
  mixtape_aot_model* m = nullptr;
  EXPECT_EQ(open(art_->dir + "_nowhere", nullptr, &m), MIXTAPE_AOT_ERROR_FILE);
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("cannot open"), std::string::npos);
  // One changed byte of the weights: the manifest's checksum no longer matches.
  std::string copy = edited("digits.safetensors", [](std::string& t) { t[t.size() - 3] ^= 1; });
  EXPECT_EQ(open(copy, nullptr, &m), MIXTAPE_AOT_ERROR_FILE);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("corrupt"), std::string::npos)
      << mixtape_aot_error(nullptr);
  fs::remove(copy + "/digits.plan");
  EXPECT_EQ(open(copy, nullptr, &m), MIXTAPE_AOT_ERROR_FILE);
  copy = edited("digits.json", [](std::string& t) { t.resize(t.size() / 2); });
  EXPECT_EQ(open(copy, nullptr, &m), MIXTAPE_AOT_ERROR_FILE);
  fs::remove_all(copy);
}

TEST_F(AotErrors, ManifestFromAnotherVersion) {
  std::string copy = edited("digits.json", [](std::string& t) {
    auto at = t.find("\"mixtape_version\":\"");
    t.replace(at, std::strlen("\"mixtape_version\":\"0"), "\"mixtape_version\":\"9");
  });
  mixtape_aot_model* m = nullptr;
  EXPECT_EQ(open(copy, nullptr, &m), MIXTAPE_AOT_ERROR_VERSION);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("export the model again"),
            std::string::npos);
  fs::remove_all(copy);
}

TEST_F(AotErrors, CudaAndUnknownDevices) {
  mixtape_aot_model* m = nullptr;
  EXPECT_EQ(open(art_->dir, "cuda", &m), MIXTAPE_AOT_ERROR_DEVICE);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("exported for: cpu"), std::string::npos);
  EXPECT_EQ(open(art_->dir, "tpu", &m), MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_EQ(m, nullptr);
}

TEST_F(AotErrors, CpuWithoutTheKernelsFeatures) {
  mixtape_aot_model* m = nullptr;
  art_->table->features.push_back("avx1024");
  EXPECT_EQ(open(art_->dir, nullptr, &m), MIXTAPE_AOT_ERROR_DEVICE);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("native needs avx1024"), std::string::npos)
      << mixtape_aot_error(nullptr);
  EXPECT_EQ(open(art_->dir, "cpu:x86-64", &m), MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("has: native"), std::string::npos);
  art_->table->features.pop_back();
  EXPECT_EQ(open(art_->dir, "cpu:native", &m), 0) << mixtape_aot_error(nullptr);
  mixtape_aot_close(m);
}

// A dynamic batch needs rows that do not see each other: a mean over the batch is refused at
// export, naming the node, rather than exported wrong.
TEST(AotExport, DynamicBatchRefusesMixingRows) {
  std::string dir = temp_dir("mixing");
  mt::aot::Options o{.name = "centered", .dynamic_batch = {.max = 8}};
  EXPECT_THROW(
      {
        try {
          mt::aot::export_function([](const mt::Tensor& x) { return x - mt::mean(x, {0}, true); },
                                   {mt::aot::input("x", {8, 4}, mt::f32)}, {"y"}, dir, o);
        } catch (const mt::Error& e) {
          EXPECT_NE(std::string(e.what()).find("depends on the batch size"), std::string::npos)
              << e.what();
          throw;
        }
      },
      mt::Error);
  o.dynamic_batch.max = 0;  // at a fixed batch it exports
  mt::aot::export_function([](const mt::Tensor& x) { return x - mt::mean(x, {0}, true); },
                           {mt::aot::input("x", {8, 4}, mt::f32)}, {"y"}, dir, o);
  fs::remove_all(dir);
}

TEST(AotExport, StepsTakeAFixedBatch) {
  DigitsMLP net;
  mt::AdamW opt(net.parameters(), {.lr = 1e-3});
  mt::aot::Options o{
      .name = "step", .dynamic_batch = {.max = 8}, .module = &net, .optimizer = &opt};
  auto step = [&](const mt::Tensor& x) {
    opt.zero_grad();
    mt::Tensor loss = mt::mean(net(x));
    loss.backward();
    opt.step();
    return loss;
  };
  EXPECT_THROW(mt::aot::export_step(step, {mt::aot::input("x", {8, 64}, mt::f32)}, {"loss"},
                                    temp_dir("fixed"), o),
               mt::Error);
}

// A step that updates a non-persistent buffer (left out of the checkpoint) is refused naming it;
// the message called it a "f32 [1] value ... or a buffer of its own".
TEST(AotExport, AStepUpdatingANonPersistentBufferIsRefusedByName) {
  struct Counting : mt::Module {
    mt::Linear fc{4, 2};
    mt::Tensor seen = mt::zeros({});
    Counting() {
      register_module("fc", fc);
      register_buffer("seen", &seen, false);
    }
  } net;
  mt::SGD opt(net.parameters(), {.lr = 0.1});
  auto step = [&](const mt::Tensor& x) {
    opt.zero_grad();
    mt::Tensor loss = mt::mean(net.fc(x));
    loss.backward();
    opt.step();
    net.seen.assign(net.seen + 1.0);
    return loss;
  };
  mt::aot::Options o{.name = "step", .module = &net, .optimizer = &opt};
  EXPECT_MT_ERROR(mt::aot::export_step(step, {mt::aot::input("x", {3, 4}, mt::f32)}, {"loss"},
                                       temp_dir("non_persistent"), o),
                  "buffer 'seen'", "not persistent");
}

TEST_F(AotErrors, FunctionsHaveNoCheckpoints) {
  Model model(art_->dir, "digits", *art_->table);
  EXPECT_EQ(mixtape_aot_save(model.m, (art_->dir + "/x.safetensors").c_str()),
            MIXTAPE_AOT_ERROR_ARGUMENT);
}

}  // namespace
