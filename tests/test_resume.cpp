// tests/test_resume.cpp -- exact resume: a checkpoint with its generators and data loaders lets a
// char GPT run (dropout, shuffling, input noise) killed at step k go on with the same losses and
// end with the same checkpoint bytes as a run that was never stopped.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <mixtape/mixtape.h>

#include "examples/char_gpt_model.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

constexpr int64_t kSteps = 24;
constexpr int64_t kBatch = 4;
constexpr int64_t kContext = 12;
// 53 characters: 41 windows of 12 tokens, so an epoch is 10 batches of 4 (one window dropped).
constexpr const char* kText = "the quick brown fox jumps over the lazy dog, twice...";

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Everything a training process holds, built from scratch as a new process would build it.
struct GptRun {
  mt::CharVocab vocab{kText};
  mt::TextWindows windows{vocab.encode(kText), kContext};
  mt::Generator model_generator{7};  // initial weights, then dropout masks
  std::unique_ptr<CharGpt> model;
  std::unique_ptr<mt::AdamW> opt;
  std::unique_ptr<mt::DataLoader> loader;
  mt::CosineWithWarmup schedule{3e-3, 4, kSteps, 3e-4};

  GptRun() {
    mt::manual_seed(11);  // the default generator draws the input noise
    GptConfig config{
        .vocab = vocab.size(), .layers = 2, .heads = 2, .width = 16, .context = kContext};
    config.dropout = 0.2;
    model = std::make_unique<CharGpt>(config, &model_generator);
    opt = std::make_unique<mt::AdamW>(model->parameters(),
                                      mt::AdamOptions{.lr = 3e-3, .weight_decay = 0.1});
    loader = std::make_unique<mt::DataLoader>(windows, kBatch, /*shuffle=*/true, /*seed=*/5);
  }

  mt::CheckpointOptions extras() {
    return {.generators = {{"model", &model_generator}, {"default", &mt::default_generator()}},
            .loaders = {loader.get()}};
  }

  // Step `step` (0-based) of the run: its loss, read on the host.
  double train_step(int64_t step) {
    mt::Batch batch = loader->next();
    opt->set_lr(schedule.lr(step));
    opt->zero_grad();
    const CharGpt& m = *model;
    mt::Tensor x = m.token_embedding(batch.inputs) + m.position_embedding(mt::arange(kContext));
    x = x + mt::randn(x.shape(), mt::f32, nullptr, 0, 0.05);  // input noise
    x = m.embed_dropout(x);
    for (size_t i = 0; i < m.blocks.size(); ++i) x = m.blocks[i](x);
    mt::Tensor loss = mt::cross_entropy(m.head(m.ln_f(x)), batch.targets);
    loss.backward();
    opt->step();
    return loss.item();
  }

  std::vector<double> train(int64_t from, int64_t to) {
    std::vector<double> losses;
    for (int64_t step = from; step < to; ++step) losses.push_back(train_step(step));
    return losses;
  }

  void save(const std::string& path, int64_t step) {
    mt::save_checkpoint(path, *model, opt.get(), {{"step", std::to_string(step)}}, nullptr,
                        extras());
  }

  // The step the checkpoint was saved at.
  int64_t load(const std::string& path) {
    mt::Metadata meta;
    mt::load_checkpoint(path, *model, opt.get(), &meta, nullptr, extras());
    for (const auto& [key, value] : meta)
      if (key == "step") return std::stoll(value);
    ADD_FAILURE() << "no step in " << path;
    return 0;
  }
};

class Resume : public TestWithFolder {};

// The losses of every step and the final checkpoint's bytes of a run never stopped.
struct Reference {
  std::vector<double> losses;
  std::string final_bytes;
};

Reference uninterrupted(const std::string& final_path) {
  GptRun run;
  Reference reference{run.train(0, kSteps), ""};
  run.save(final_path, kSteps);
  reference.final_bytes = read_all(final_path);
  return reference;
}

// Resumes from the checkpoint of step k in a fresh GptRun, trains to the end and checks the
// losses and final bytes against the reference.
void resume_and_compare(const std::string& checkpoint, int64_t k, const Reference& reference,
                        const std::string& final_path) {
  GptRun resumed;
  mt::manual_seed(999);  // whatever a new process's default generator holds, the load replaces
  ASSERT_EQ(resumed.load(checkpoint), k);
  EXPECT_EQ(resumed.opt->steps_taken(), k);
  std::vector<double> losses = resumed.train(k, kSteps);
  for (int64_t step = k; step < kSteps; ++step)
    EXPECT_EQ(losses[static_cast<size_t>(step - k)], reference.losses[static_cast<size_t>(step)])
        << "step " << step;
  resumed.save(final_path, kSteps);
  EXPECT_TRUE(read_all(final_path) == reference.final_bytes) << "the final checkpoints differ";
}

TEST_F(Resume, CharGptKilledAndResumedMatchesAnUninterruptedRun) {
  Reference reference = uninterrupted(path("uninterrupted.safetensors"));
  // Training really moves: the losses fall and no two steps give the same loss.
  EXPECT_LT(reference.losses.back(), reference.losses.front());
  // k = 10 is an epoch boundary, 15 the middle of the second epoch.
  for (int64_t k : {10, 15}) {
    SCOPED_TRACE("killed at step " + std::to_string(k));
    std::string checkpoint = path("step" + std::to_string(k) + ".safetensors");
    {
      GptRun killed;
      std::vector<double> losses = killed.train(0, k);
      for (int64_t step = 0; step < k; ++step) {
        ASSERT_EQ(losses[static_cast<size_t>(step)], reference.losses[static_cast<size_t>(step)]);
      }
      killed.save(checkpoint, k);
      EXPECT_EQ(killed.loader->state().position, k % 10);
    }  // the "killed" process is gone: nothing of it survives but the file
    resume_and_compare(checkpoint, k, reference, path("resumed.safetensors"));
  }
}

// The same with a real process: a child trains to step k, saves, and is killed with SIGKILL; the
// parent resumes from what the child left on disk.
TEST_F(Resume, CharGptResumesFromAProcessKilledWithSigkill) {
  Reference reference = uninterrupted(path("uninterrupted.safetensors"));
  constexpr int64_t k = 13;
  std::string checkpoint = path("child.safetensors");
  // Everything the child needs is made before the fork: between fork and exec only
  // async-signal-safe calls are allowed, as other threads may hold locks.
  ::setenv("MIXTAPE_RESUME_CHILD_FILE", checkpoint.c_str(), 1);
  ::setenv("MIXTAPE_RESUME_CHILD_STEP", std::to_string(k).c_str(), 1);
  std::string log = path("child.log");
  int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(log_fd, 0);
  char exe[] = "/proc/self/exe", disabled[] = "--gtest_also_run_disabled_tests",
       filter[] = "--gtest_filter=Resume.DISABLED_TrainAndSelfKill";
  char* argv[] = {exe, disabled, filter, nullptr};
  // The child re-executes this test binary rather than going on after the fork, as a fork of a
  // process with running back-end threads must not compute.
  pid_t child = ::fork();
  if (child == 0) {
    ::dup2(log_fd, 1);
    ::dup2(log_fd, 2);
    ::execv(exe, argv);
    ::_exit(127);
  }
  ::close(log_fd);
  ::unsetenv("MIXTAPE_RESUME_CHILD_FILE");
  ::unsetenv("MIXTAPE_RESUME_CHILD_STEP");
  ASSERT_NE(child, -1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  // The killed child never ran its fixture's TearDown: its folder is removed here.
  std::filesystem::remove_all(
      std::filesystem::temp_directory_path() /
      ("mixtape_test_Resume_" + std::to_string(child) + "_DISABLED_TrainAndSelfKill"));
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "the child was not killed by SIGKILL (status " << status << "):\n"
      << read_all(log);
  resume_and_compare(checkpoint, k, reference, path("resumed.safetensors"));
}

// Run only as CharGptResumesFromAProcessKilledWithSigkill's child.
TEST_F(Resume, DISABLED_TrainAndSelfKill) {
  const char* file = std::getenv("MIXTAPE_RESUME_CHILD_FILE");
  const char* step = std::getenv("MIXTAPE_RESUME_CHILD_STEP");
  if (!file || !step) GTEST_SKIP() << "runs only as a child of the SIGKILL test";
  GptRun run;
  int64_t k = std::stoll(step);
  run.train(0, k);
  run.save(file, k);
  run.train(k, k + 2);  // work the kill throws away
  std::raise(SIGKILL);
}

// What a checkpoint records of generators and loaders, and that the load restores exactly that.
TEST_F(Resume, GeneratorsAndLoadersRoundTrip) {
  GptRun run;
  run.train(0, 3);
  mt::Generator unused(3);
  (void)mt::rand({5}, mt::f32, &unused);
  mt::CheckpointOptions extras = run.extras();
  extras.generators.emplace_back("unused", &unused);
  mt::save_checkpoint(path("c.safetensors"), *run.model, run.opt.get(), {}, nullptr, extras);
  mt::Metadata meta;
  mt::NamedTensors entries = mt::load_tensors(path("c.safetensors"), &meta);
  std::map<std::string, std::string> value(meta.begin(), meta.end());  // an absent key reads ""
  EXPECT_EQ(value["generator.model.seed"], "7");
  EXPECT_EQ(value["generator.model.offset"], std::to_string(run.model_generator.offset()));
  EXPECT_EQ(value["generator.default.seed"], "11");
  EXPECT_EQ(value["generator.unused.offset"], std::to_string(unused.offset()));
  EXPECT_NE(unused.offset(), 0u);
  EXPECT_EQ(value["loader.0.epoch"], "0");
  EXPECT_EQ(value["loader.0.position"], "3");
  EXPECT_EQ(value["loader.0.batch_size"], "4");
  EXPECT_EQ(value["loader.0.shuffle"], "true");
  EXPECT_EQ(value["loader.0.seed"], "5");
  EXPECT_EQ(value["loader.0.drop_last"], "true");
  const mt::Tensor* order = nullptr;
  for (const auto& [name, tensor] : entries)
    if (name == "loader.0.order") order = &tensor;
  ASSERT_NE(order, nullptr);
  EXPECT_EQ(order->to_vector<int64_t>(), run.loader->state().order);

  GptRun fresh;
  mt::Generator other(4);
  mt::CheckpointOptions fresh_extras = fresh.extras();
  fresh_extras.generators.emplace_back("unused", &other);
  mt::load_checkpoint(path("c.safetensors"), *fresh.model, fresh.opt.get(), nullptr, nullptr,
                      fresh_extras);
  EXPECT_EQ(other.seed(), 3u);
  EXPECT_EQ(other.offset(), unused.offset());
  EXPECT_EQ(fresh.model_generator.offset(), run.model_generator.offset());
  EXPECT_EQ(std::to_string(mt::default_generator().offset()), value["generator.default.offset"]);
  EXPECT_EQ(fresh.loader->state().position, 3);
  EXPECT_EQ(fresh.loader->state().order, run.loader->state().order);
  // State nobody asks for is ignored: the model alone loads from the same file.
  GptRun plain;
  mt::load_checkpoint(path("c.safetensors"), *plain.model);
}

// A load with generators or loaders the file does not have, or whose loader state cannot be
// right, fails naming the file and the entry, and changes nothing.
TEST_F(Resume, MissingOrInvalidStateIsRejectedWithoutChanges) {
  GptRun run;
  run.train(0, 2);
  std::string file = path("c.safetensors");
  run.save(file, 2);
  mt::Metadata meta;
  mt::NamedTensors entries = mt::load_tensors(file, &meta);

  GptRun target;
  target.train(0, 1);
  std::string target_file = path("target.safetensors");
  target.save(target_file, 1);
  auto expect_unchanged = [&] {
    target.save(path("now.safetensors"), 1);
    EXPECT_TRUE(read_all(path("now.safetensors")) == read_all(target_file))
        << "the failed load changed the target";
  };
  mt::Generator stranger(1);
  mt::CheckpointOptions extras = target.extras();
  extras.generators.emplace_back("stranger", &stranger);
  EXPECT_MT_ERROR(
      mt::load_checkpoint(file, *target.model, target.opt.get(), nullptr, nullptr, extras), file,
      "generator 'stranger'");
  expect_unchanged();
  mt::TextWindows other_windows(target.vocab.encode(kText), kContext);
  mt::DataLoader second(other_windows, kBatch, true, 5);
  extras = target.extras();
  extras.loaders.push_back(&second);
  EXPECT_MT_ERROR(
      mt::load_checkpoint(file, *target.model, target.opt.get(), nullptr, nullptr, extras), file,
      "loader 1");
  expect_unchanged();
  {
    SCOPED_TRACE("an order that is not a permutation");
    mt::NamedTensors bad = entries;
    for (auto& [name, tensor] : bad)
      if (name == "loader.0.order") {
        std::vector<int64_t> order = tensor.to_vector<int64_t>();
        order[1] = order[0];
        tensor = mt::tensor(order, {static_cast<int64_t>(order.size())}, mt::i64);
      }
    mt::save_tensors(path("bad.safetensors"), bad, meta);
    EXPECT_MT_ERROR(mt::load_checkpoint(path("bad.safetensors"), *target.model, target.opt.get(),
                                        nullptr, nullptr, target.extras()),
                    "bad.safetensors", "loader 0", "not a permutation");
    expect_unchanged();
  }
  for (const auto& [key, text] : std::vector<std::pair<std::string, std::string>>{
           {"loader.0.position", "12"},
           {"loader.0.position", "x"},
           {"loader.0.batch_size", "8"},
           {"loader.0.seed", "6"},
           {"loader.0.shuffle", "yes"},
           {"generator.model.offset", "-1"},
           {"generator.default.seed", "18446744073709551616"}}) {
    SCOPED_TRACE(key + " = " + text);
    mt::Metadata bad_meta = meta;
    for (auto& [k, v] : bad_meta)
      if (k == key) v = text;
    mt::save_tensors(path("bad.safetensors"), entries, bad_meta);
    EXPECT_MT_ERROR(mt::load_checkpoint(path("bad.safetensors"), *target.model, target.opt.get(),
                                        nullptr, nullptr, target.extras()),
                    "bad.safetensors", key.substr(0, key.find('.')));
    expect_unchanged();
  }
  // A duplicated or null generator, or a null loader, is an error on save as on load.
  for (int broken = 0; broken < 3; ++broken) {
    extras = target.extras();
    if (broken == 0) extras.generators.push_back(extras.generators[0]);
    if (broken == 1) extras.generators.emplace_back("null", nullptr);
    if (broken == 2) extras.loaders.push_back(nullptr);
    const char* what = broken == 0   ? "two generators are called 'model'"
                       : broken == 1 ? "generator 'null' is null"
                                     : "loader 1 is null";
    EXPECT_MT_ERROR(
        mt::save_checkpoint(path("x.safetensors"), *target.model, nullptr, {}, nullptr, extras),
        what);
    EXPECT_FALSE(fs::exists(path("x.safetensors")));
    EXPECT_MT_ERROR(
        mt::load_checkpoint(file, *target.model, target.opt.get(), nullptr, nullptr, extras), what);
    expect_unchanged();
  }
}

}  // namespace
