// tests/test_aot_dropout.cpp -- exported training steps with dropout carry their generator's
// offset: N steps equal mt::compile's bit for bit, NAME_save / load_checkpoint and save_checkpoint
// / NAME_load continue each other's streams exactly, and a checkpoint of another seed, or a
// generator the export is not told about, is refused with what to do.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "tests/aot_test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;
using namespace mixtape::aot_test;

namespace {

constexpr int64_t kBatch = 6, kIn = 8, kHidden = 32, kOut = 4;  // the MLP
constexpr int64_t kTime = 4, kWidth = 16, kHeads = 2;           // the block
constexpr uint64_t kDropoutSeed = 42;

// fc1, ReLU, dropout, fc2.
class DropoutMlp : public mt::Module {
 public:
  DropoutMlp(mt::Generator* init, mt::Generator* masks)
      : fc1(kIn, kHidden, true, init), fc2(kHidden, kOut, true, init), drop(0.25, masks) {
    register_module("fc1", fc1);
    register_module("drop", drop);
    register_module("fc2", fc2);
  }
  mt::Tensor operator()(const mt::Tensor& x) const { return fc2(drop(mt::relu(fc1(x)))); }
  mt::Linear fc1, fc2;
  mt::Dropout drop;
};

// A model with dropout drawn from `masks` (its own stream), trained by AdamW on a regression
// target in `policy`; one step has run, so the optimizer has its state (see export_step).
struct Trainer {
  std::string kind, policy;
  mt::Generator masks;
  std::unique_ptr<mt::Module> module;
  std::function<mt::Tensor(const mt::Tensor&)> forward;
  std::unique_ptr<mt::AdamW> opt;

  Trainer(std::string kind_, std::string policy_, uint64_t init_seed, uint64_t mask_seed)
      : kind(std::move(kind_)), policy(std::move(policy_)), masks(mask_seed) {
    mt::Generator init(init_seed);
    if (kind == "mlp") {
      auto mlp = std::make_unique<DropoutMlp>(&init, &masks);
      forward = [m = mlp.get()](const mt::Tensor& x) { return (*m)(x); };
      module = std::move(mlp);
    } else {
      // The block's dropouts draw from the generator it is built with (which also draws its
      // initial weights).
      masks.manual_seed(init_seed);
      auto block = std::make_unique<mt::TransformerBlock>(kWidth, kHeads, 0.2, &masks);
      masks.manual_seed(mask_seed);
      forward = [m = block.get()](const mt::Tensor& x) { return (*m)(x); };
      module = std::move(block);
    }
    opt = std::make_unique<mt::AdamW>(module->parameters(),
                                      mt::AdamOptions{.lr = 3e-3, .weight_decay = 0.01});
    std::mt19937_64 g(init_seed);
    auto [x, y] = sample(g);
    step(x, y);
  }
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  mt::Shape x_shape() const {
    return kind == "mlp" ? mt::Shape{kBatch, kIn} : mt::Shape{kBatch, kTime, kWidth};
  }
  mt::Shape y_shape() const {
    return kind == "mlp" ? mt::Shape{kBatch, kOut} : mt::Shape{kBatch, kTime, kWidth};
  }
  std::pair<mt::Tensor, mt::Tensor> sample(std::mt19937_64& g) const {
    std::normal_distribution<float> normal;
    auto draw = [&](const mt::Shape& shape) {
      std::vector<float> v(static_cast<size_t>(mt::numel(shape)));
      for (float& e : v) e = normal(g);
      return mt::tensor(v, shape);
    };
    return {draw(x_shape()), draw(y_shape())};
  }
  mt::Tensor step(const mt::Tensor& x, const mt::Tensor& y) {
    opt->zero_grad();
    mt::Tensor loss;
    {
      auto scope = policy_scope(policy);
      loss = mt::mse_loss(mt::cast(forward(x), mt::f32), y);
    }
    loss.backward();
    opt->step();
    return loss;
  }
  std::function<mt::Tensor(const mt::Tensor&, const mt::Tensor&)> step_fn() {
    return [this](const mt::Tensor& x, const mt::Tensor& y) { return step(x, y); };
  }
  mt::CheckpointOptions extras() { return {.generators = {{"dropout", &masks}}}; }
  void save(const std::string& path) {
    mt::save_checkpoint(path, *module, opt.get(), {}, nullptr, extras());
  }
  void load(const std::string& path) {
    mt::load_checkpoint(path, *module, opt.get(), nullptr, nullptr, extras());
  }
  mt::aot::Exported export_to(const std::string& dir, const std::string& name) {
    mt::aot::Options o{.name = name,
                       .module = module.get(),
                       .optimizer = opt.get(),
                       .generators = {{"dropout", &masks}}};
    auto fn = step_fn();
    return mt::aot::export_step(
        fn, {mt::aot::input("x", x_shape(), mt::f32), mt::aot::input("y", y_shape(), mt::f32)},
        {"loss"}, dir, o);
  }
};

// One step of the artifact on (x, y): its loss.
float run(const Model& model, const mt::Tensor& x, const mt::Tensor& y) {
  std::vector<float> xs = x.to_vector<float>(), ys = y.to_vector<float>();
  const void* in[] = {xs.data(), ys.data()};
  float loss = 0;
  void* out[] = {&loss};
  EXPECT_EQ(mixtape_aot_run(model.m, kBatch, in, out), 0) << mixtape_aot_error(model.m);
  return loss;
}

// `steps` steps of the artifact and of `compiled` on the same batches give the same losses, bit
// for bit.
template <typename Compiled>
void expect_same_steps(const Model& model, Compiled& compiled, const Trainer& t, std::mt19937_64& g,
                       int steps, const std::string& what) {
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = t.sample(g);
    mt::Tensor expected = compiled(x, y);
    float want = expected.to_vector<float>()[0];
    float got = run(model, x, y);
    EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0)
        << what << ", step " << s << ": " << got << " against " << want;
  }
}

using Case = std::tuple<std::string, std::string>;  // model, policy

class AotDropoutStep : public testing::TestWithParam<Case> {};

TEST_P(AotDropoutStep, EqualsCompileAndSavesTheGeneratorAsSaveCheckpoint) {
  const auto& [kind, policy] = GetParam();
  Trainer t(kind, policy, 5, kDropoutSeed);
  std::string name = "dropout_" + kind, dir = temp_dir("dropout_" + kind + "_" + policy);
  uint64_t offset = t.masks.offset();
  mt::aot::Exported exported = t.export_to(dir, name);
  EXPECT_EQ(t.masks.offset(), offset) << "the export puts the generator back";
  Table table(exported);
  Model model(dir, name, table);
  ASSERT_NE(model.m, nullptr);
  auto compiled = mt::compile(t.step_fn());
  std::mt19937_64 g(9);
  expect_same_steps(model, compiled, t, g, 5, kind + " " + policy);
  EXPECT_GT(t.masks.offset(), offset) << "the steps drew masks";
  std::string saved = dir + "_saved.safetensors", reference = dir + "_reference.safetensors";
  ASSERT_EQ(mixtape_aot_save(model.m, saved.c_str()), 0) << mixtape_aot_error(model.m);
  t.save(reference);
  expect_same_checkpoint(saved, reference);
  for (const std::string& f : {saved, reference}) fs::remove(f);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Models, AotDropoutStep,
                         testing::Values(Case{"mlp", "fp32"}, Case{"mlp", "bf16"},
                                         Case{"block", "fp32"}),
                         [](const testing::TestParamInfo<Case>& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param);
                         });

// A trainer's step exported into a fresh folder named for `name`, and opened from there.
struct ExportedModel {
  std::string dir;
  Table table;
  Model model;
  ExportedModel(Trainer& trainer, const std::string& name)
      : dir(temp_dir(name)), table(trainer.export_to(dir, name)), model(dir, name, table) {}
};

// Trained in C and saved, loaded into C++ (another model, its generator elsewhere in the stream),
// both go on alike; saved from C++ and loaded into a fresh artifact, both go on alike again.
TEST(AotDropout, CheckpointsContinueTheStreamBothWays) {
  Trainer exporter("mlp", "fp32", 5, kDropoutSeed);
  ExportedModel exported(exporter, "dropout_resume");
  auto& [dir, table, c_side] = exported;
  ASSERT_NE(c_side.m, nullptr);
  std::mt19937_64 g(3);
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = exporter.sample(g);
    run(c_side, x, y);
  }
  std::string from_c = dir + "_from_c.safetensors", from_cpp = dir + "_from_cpp.safetensors";
  ASSERT_EQ(mixtape_aot_save(c_side.m, from_c.c_str()), 0) << mixtape_aot_error(c_side.m);

  Trainer cpp_side("mlp", "fp32", 77, kDropoutSeed);  // other weights, other offset
  ASSERT_NE(cpp_side.masks.offset(), exporter.masks.offset() + 3 * kBatch * kHidden);
  cpp_side.load(from_c);
  EXPECT_EQ(cpp_side.masks.offset(), exporter.masks.offset() + 3 * kBatch * kHidden)
      << "3 steps of masks of " << kBatch * kHidden << " counters";
  auto compiled = mt::compile(cpp_side.step_fn());
  expect_same_steps(c_side, compiled, cpp_side, g, 3, "C to C++");

  cpp_side.save(from_cpp);
  Model fresh(dir, "dropout_resume", table);  // at the export's state
  ASSERT_NE(fresh.m, nullptr);
  ASSERT_EQ(mixtape_aot_load(fresh.m, from_cpp.c_str()), 0) << mixtape_aot_error(fresh.m);
  expect_same_steps(fresh, compiled, cpp_side, g, 3, "C++ to C");
  for (const std::string& f : {from_c, from_cpp}) fs::remove(f);
  fs::remove_all(dir);
}

// The seed is compiled into the step's draws: a checkpoint of another seed, or one without the
// generator's state, is refused with a code and words, and the model is left as it was.
TEST(AotDropout, LoadRefusesAnotherSeedOrNoGeneratorState) {
  Trainer t("mlp", "fp32", 5, kDropoutSeed);
  ExportedModel exported(t, "dropout_seed");
  auto& [dir, table, model] = exported;
  ASSERT_NE(model.m, nullptr);
  std::string before = dir + "_before.safetensors", after = dir + "_after.safetensors";
  std::string other_seed = dir + "_other_seed.safetensors", none = dir + "_none.safetensors";
  ASSERT_EQ(mixtape_aot_save(model.m, before.c_str()), 0) << mixtape_aot_error(model.m);

  Trainer reseeded("mlp", "fp32", 6, kDropoutSeed + 1);
  reseeded.save(other_seed);
  EXPECT_EQ(mixtape_aot_load(model.m, other_seed.c_str()), MIXTAPE_AOT_ERROR_FILE);
  std::string error = mixtape_aot_error(model.m);
  EXPECT_NE(error.find("generator 'dropout' with seed 43"), std::string::npos) << error;
  EXPECT_NE(error.find("compiled with seed 42"), std::string::npos) << error;

  mt::save_checkpoint(none, *reseeded.module, reseeded.opt.get());
  EXPECT_EQ(mixtape_aot_load(model.m, none.c_str()), MIXTAPE_AOT_ERROR_FILE);
  error = mixtape_aot_error(model.m);
  EXPECT_NE(error.find("no state for generator 'dropout'"), std::string::npos) << error;

  ASSERT_EQ(mixtape_aot_save(model.m, after.c_str()), 0) << mixtape_aot_error(model.m);
  expect_same_checkpoint(after, before);
  for (const std::string& f : {before, after, other_seed, none}) fs::remove(f);
  fs::remove_all(dir);
}

// A step that draws from a generator Options does not name says how to name it, and one named
// without a generator is refused.
TEST(AotDropout, ExportRefusesAGeneratorItIsNotTold) {
  Trainer t("mlp", "fp32", 5, kDropoutSeed);
  std::string dir = temp_dir("dropout_unnamed");
  auto fn = t.step_fn();
  std::vector<mt::aot::Input> inputs{mt::aot::input("x", t.x_shape(), mt::f32),
                                     mt::aot::input("y", t.y_shape(), mt::f32)};
  mt::aot::Options o{.name = "unnamed", .module = t.module.get(), .optimizer = t.opt.get()};
  try {
    mt::aot::export_step(fn, inputs, {"loss"}, dir, o);
    ADD_FAILURE() << "exported a step whose generator nothing names";
  } catch (const mt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Options::generators"), std::string::npos) << e.what();
  }
  o.generators = {{"dropout", nullptr}};
  EXPECT_THROW(mt::aot::export_step(fn, inputs, {"loss"}, dir, o), mt::Error);
  EXPECT_FALSE(fs::exists(dir + "/unnamed.json"));
  fs::remove_all(dir);
}

}  // namespace
