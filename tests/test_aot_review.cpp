// tests/test_aot_review.cpp -- an adversarial review's failing cases for AOT export: dynamic
// batches whose kernels name the batch outside dims[0], hostile or corrupt artifact files, and
// state an export_step leaves behind. Each test failed (or crashed) before the fix it names.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "aot_test_util.h"
#include "examples/digits_model.h"
#include "mixtape/dsl/json.h"
#include "mixtape/runtime/file_digest.h"
#include "mixtape/runtime/safetensors.h"
#include "tests/test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;
using namespace mt::aot_test;

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// ---- 1. dynamic batch: every batch in 1..max must run, and equal the JIT ----

struct Case {
  const char* name;
  std::function<mt::Tensor(const mt::Tensor&)> fn;
};

class AotReviewDynamicBatch : public testing::TestWithParam<int> {};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      // A row reduction (dims [B, 4]): the batch is dims[0]. The control: this one passes.
      {"row_softmax", [](const mt::Tensor& x) { return mt::softmax(x, 1); }},
      // Rows that see each other without a 1/B constant: export does not refuse these (only a
      // mean is caught), and their kernels carry B outside dims[0].
      {"sum_over_batch", [](const mt::Tensor& x) { return x - mt::sum(x, {0}, true); }},
      {"softmax_over_batch", [](const mt::Tensor& x) { return mt::softmax(x, 0); }},
      // A permute that moves the batch inward, then a row reduction: dims [3, B, 4].
      {"permute_batch_inward",
       [](const mt::Tensor& x) {
         mt::Tensor p = mt::permute(mt::reshape(x, {x.shape()[0], 3, 4}), {1, 0, 2});
         mt::Tensor s = p * mt::sum(p, {2}, true);
         return mt::reshape(mt::permute(s, {1, 0, 2}), {x.shape()[0], 12});
       }},
      // A concat along dim 0 read back through a reshape that puts the batch in dim 1.
      {"concat_dim0",
       [](const mt::Tensor& x) {
         mt::Tensor c = mt::concat({x, x * 2.0}, 0);
         return mt::sum(mt::reshape(c, {2, x.shape()[0], 12}), {0});
       }},
      // A rank-0 value (a whole-tensor reduction, reduce_from 0) broadcast back.
      {"rank0_scale", [](const mt::Tensor& x) { return x * mt::sum(x * x); }},
      // Controls that keep the batch in dim 0 (these pass): rows flattened with the batch
      // (dims[0] = 4 * batch), a reduction over a middle dim (a column reduction whose column
      // dim is not the batch), batch-first attention, and layer norm.
      {"flattened_rows",
       [](const mt::Tensor& x) {
         return mt::reshape(mt::softmax(mt::reshape(x, {x.shape()[0] * 4, 3}), 1),
                            {x.shape()[0], 12});
       }},
      {"middle_dim_sum",
       [](const mt::Tensor& x) {
         mt::Tensor x3 = mt::reshape(x, {x.shape()[0], 3, 4});
         return mt::reshape(x3 * mt::sum(x3, {1}, true), {x.shape()[0], 12});
       }},
      {"attention",
       [](const mt::Tensor& x) {
         mt::Tensor q = mt::reshape(x, {x.shape()[0], 3, 4});
         mt::Tensor p = mt::softmax(mt::matmul(q, q, false, true) * 0.5, -1);
         return mt::reshape(mt::matmul(p, q), {x.shape()[0], 12});
       }},
      {"layer_norm",
       [](const mt::Tensor& x) {
         static const mt::Tensor w = mt::full({12}, 1.5), b = mt::full({12}, 0.25);
         return mt::layer_norm(x, w, b);
       }},
  };
  return all;
}

// The artifact's answers at batches the export did not trace (it traces 1, max/2+1 and max)
// equal the JIT's, bit for bit; an export that cannot promise that must refuse.
TEST_P(AotReviewDynamicBatch, UntracedBatchesRunAndEqualTheJit) {
  const Case& c = cases()[GetParam()];
  std::string dir = temp_dir(std::string("review_dyn_") + c.name);
  mt::aot::Options o{.name = "dyn", .dynamic_batch = {.max = 64}};
  mt::aot::Exported exported;
  try {
    exported =
        mt::aot::export_function(c.fn, {mt::aot::input("x", {64, 12}, mt::f32)}, {"y"}, dir, o);
  } catch (const mt::Error& e) {
    // Refusing at export is a correct answer too: what must not happen is a failure at run.
    SUCCEED() << c.name << ": export refused: " << e.what();
    return;
  }
  Table table(exported);
  Model model(dir, "dyn", table);
  ASSERT_NE(model.m, nullptr);
  for (int64_t batch : {1, 5, 20, 33, 64}) {
    mt::Generator g(batch);
    std::vector<float> x = mt::randn({batch, 12}, mt::f32, &g).to_vector<float>();
    std::vector<float> expected;
    {
      mt::NoGradGuard no_grad;
      expected = c.fn(mt::tensor(x, {batch, 12})).to_vector<float>();
    }
    std::vector<float> got(expected.size());
    const void* in[] = {x.data()};
    void* out[] = {got.data()};
    ASSERT_EQ(mixtape_aot_run(model.m, batch, in, out), 0)
        << c.name << " batch " << batch << ": " << mixtape_aot_error(model.m);
    EXPECT_EQ(first_difference(got, expected), got.size()) << c.name << " batch " << batch;
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Models, AotReviewDynamicBatch, testing::Range(0, 10),
                         [](const testing::TestParamInfo<int>& i) {
                           return std::string(cases()[i.param].name);
                         });

// Every batch in 1..max (more than the plan cache holds, so plans are evicted and rebuilt), and
// two handles of one artifact run from two threads at once, and then one handle from two threads
// (its calls take turns): each answer equals the JIT's.
TEST(AotReviewDigits, EveryBatchAndTwoThreadsEqualTheJit) {
  mt::manual_seed(3);
  DigitsMLP net;
  std::string dir = temp_dir("review_every_batch");
  mt::aot::Options o{.name = "digits", .dynamic_batch = {.max = 40}};
  auto forward = [&](const mt::Tensor& x) { return net(x); };
  auto exported = mt::aot::export_function(forward, {mt::aot::input("x", {40, 64}, mt::f32)},
                                           {"logits"}, dir, o);
  Table table(exported);
  std::vector<std::vector<float>> inputs, expected;
  for (int64_t batch = 1; batch <= 40; ++batch) {
    mt::Generator g(batch);
    inputs.push_back(mt::randn({batch, 64}, mt::f32, &g).to_vector<float>());
    mt::NoGradGuard no_grad;
    expected.push_back(forward(mt::tensor(inputs.back(), {batch, 64})).to_vector<float>());
  }
  auto run_all = [&](mixtape_aot_model* m, bool reverse, std::string& error) {
    for (int64_t i = 0; i < 40 && error.empty(); ++i) {
      int64_t batch = reverse ? 40 - i : i + 1;
      std::vector<float> got(batch * 10);
      const void* in[] = {inputs[batch - 1].data()};
      void* out[] = {got.data()};
      if (mixtape_aot_run(m, batch, in, out) != 0)
        error = fmt::format("batch {}: {}", batch, mixtape_aot_error(m));
      else if (first_difference(got, expected[batch - 1]) != got.size())
        error = fmt::format("batch {}: differs from the JIT", batch);
    }
  };
  Model a(dir, "digits", table), b(dir, "digits", table);
  ASSERT_TRUE(a.m && b.m);
  std::string error_a, error_b;
  run_all(a.m, false, error_a);
  EXPECT_EQ(error_a, "");
  // Two threads at once, three rounds: on two handles, then on one (its calls take turns;
  // before, undefined: both wrote the handle's buffers and plans at once).
  for (mixtape_aot_model* second : {b.m, a.m})
    for (int round = 0; round < 3; ++round) {
      std::thread t([&] { run_all(second, true, error_b); });
      run_all(a.m, false, error_a);
      t.join();
      EXPECT_EQ(error_a, "");
      EXPECT_EQ(error_b, "");
    }
  fs::remove_all(dir);
}

// Outputs that are not a fresh value of their own: the same tensor twice, an input as it came,
// a view of an input. Each export either refuses with an mt::Error or runs and equals the JIT.
class AotReviewOutputs : public testing::TestWithParam<int> {};

TEST_P(AotReviewOutputs, UnusualOutputsExportOrRefuse) {
  using Fn = std::function<std::vector<mt::Tensor>(const mt::Tensor&)>;
  static const std::vector<std::pair<const char*, Fn>> fns = {
      {"same_twice",
       [](const mt::Tensor& x) {
         mt::Tensor y = x * 2.0;
         return std::vector<mt::Tensor>{y, y};
       }},
      {"input_itself",
       [](const mt::Tensor& x) {
         return std::vector<mt::Tensor>{x * 2.0, x};
       }},
      {"input_view",
       [](const mt::Tensor& x) {
         return std::vector<mt::Tensor>{x * 2.0, mt::reshape(x, {x.shape()[0], 2, 2})};
       }},
  };
  const auto& [name, fn] = fns[GetParam()];
  std::string dir = temp_dir(std::string("review_outputs_") + name);
  mt::aot::Options o{.name = "outs", .dynamic_batch = {.max = 8}};
  mt::aot::Exported exported;
  try {
    exported =
        mt::aot::export_artifact([&](const std::vector<mt::Tensor>& a) { return fn(a.at(0)); },
                                 {mt::aot::input("x", {8, 4}, mt::f32)}, {"a", "b"}, dir, o, false);
  } catch (const mt::Error& e) {
    SUCCEED() << name << ": refused: " << e.what();
    return;
  }
  Table table(exported);
  Model model(dir, "outs", table);
  ASSERT_NE(model.m, nullptr);
  std::vector<float> x(8 * 4), a(8 * 4, -1.f), b(8 * 4, -1.f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  const void* in[] = {x.data()};
  void* out[] = {a.data(), b.data()};
  ASSERT_EQ(mixtape_aot_run(model.m, 8, in, out), 0) << mixtape_aot_error(model.m);
  std::vector<mt::Tensor> want;
  {
    mt::NoGradGuard no_grad;
    want = fn(mt::tensor(x, {8, 4}));
  }
  EXPECT_EQ(a, want[0].to_vector<float>()) << name;
  EXPECT_EQ(b, want[1].to_vector<float>()) << name;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Kinds, AotReviewOutputs, testing::Range(0, 3));

// An output whose dim 0 equals the export batch without being the batch (a fixed [8, 4] value
// exported at batch 8) is refused at export, not at the first call at another batch.
TEST(AotReviewOutputsBatch, AFixedOutputThatLooksLikeTheBatchIsRefused) {
  mt::Tensor w = mt::ones({8, 4});
  std::string dir = temp_dir("review_fixed_output");
  mt::aot::Options o{.name = "outs", .dynamic_batch = {.max = 16}};
  try {
    mt::aot::export_artifact(
        [&](const std::vector<mt::Tensor>& a) {
          return std::vector<mt::Tensor>{a.at(0) * 2.0, w * 3.0};
        },
        {mt::aot::input("x", {8, 4}, mt::f32)}, {"a", "b"}, dir, o, false);
    ADD_FAILURE() << "exported an output of fixed size as one with a batch";
  } catch (const mt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("output 'b'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("has no batch dim 0"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// The same for mt::compile, whose replay (runtime/step_plan.cpp) the artifact shares: a stored
// node returned twice gets one result slot (PlannedEvaluation::result_slot), the other result is
// left undefined from the first replay on.
TEST(AotReviewOutputsCompile, CompiledFunctionReturningOneTensorTwice) {
  auto fn = [](const mt::Tensor& x) {
    mt::Tensor y = x * 2.0;
    return std::vector<mt::Tensor>{y, y};
  };
  auto compiled = mt::compile(fn);
  for (int call = 0; call < 4; ++call) {
    std::vector<mt::Tensor> out;
    ASSERT_NO_THROW(out = compiled(mt::full({2, 2}, call, mt::f32))) << "call " << call;
    ASSERT_EQ(out.size(), 2u);
    for (const mt::Tensor& t : out) {
      ASSERT_TRUE(t.defined()) << "call " << call;
      EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 2.0f * call)) << "call " << call;
    }
  }
}

// ---- 2. hostile / corrupt files ----

class AotReviewFiles : public testing::Test {
 protected:
  static void SetUpTestSuite() { art_ = new DigitsArtifact("review_files"); }
  static void TearDownTestSuite() { delete art_; }
  // A copy of the artifact with `file` rewritten by `edit`; an edited plan gets a manifest whose
  // checksum matches it (the manifest itself carries no checksum, so anyone can).
  std::string edited(const std::string& file, const std::function<void(std::string&)>& edit) {
    std::string copy = art_->dir + "_edited";
    fs::remove_all(copy);
    fs::copy(art_->dir, copy);
    std::string text = read(copy + "/" + file);
    edit(text);
    write(copy + "/" + file, text);
    if (file == "digits.plan") {
      mt::FileDigest digest = mt::digest_file(copy + "/digits.plan");
      std::string manifest = read(copy + "/digits.json");
      mt::json::Value doc = mt::json::parse(manifest);
      doc.at("files").at("digits.plan") = {{"bytes", digest.bytes}, {"xxh3_64", digest.xxh3_64}};
      write(copy + "/digits.json", mt::json::dump(doc));
    }
    return copy;
  }
  // Opens `dir` and runs batch 16 on zeros: the first nonzero code, or 0.
  int open_and_run(const std::string& dir) {
    mixtape_aot_model* m = nullptr;
    int code = mixtape_aot_open(dir.c_str(), "digits", art_->table->manifest_xxh3.c_str(), "cpu",
                                &art_->table->variant, 1, &m);
    if (code != 0) return code;
    std::vector<float> x(16 * 64), y(16 * 10);
    const void* in[] = {x.data()};
    void* out[] = {y.data()};
    code = mixtape_aot_run(m, 16, in, out);
    mixtape_aot_close(m);
    return code;
  }
  static void replace(std::string& text, const std::string& from, const std::string& to) {
    auto at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
  }
  static DigitsArtifact* art_;
};
DigitsArtifact* AotReviewFiles::art_ = nullptr;

// Every edit of the manifest or of the plan (the manifest's checksum fixed to match) is refused
// at open as a file the library was not built with: the library carries the manifest's digest
// and the manifest the plan's and weights'. Before, each of these ran and overflowed a buffer,
// crashed or wrote past the caller's output (the review's findings F3, F4 and F10).
struct HostileEdit {
  const char* file;
  const char* from;
  const char* to;
};

class AotReviewHostile : public AotReviewFiles, public testing::WithParamInterface<HostileEdit> {};

TEST_P(AotReviewHostile, IsRefusedAtOpen) {
  const HostileEdit& e = GetParam();
  std::string copy = edited(e.file, [&](std::string& t) { replace(t, e.from, e.to); });
  EXPECT_EQ(open_and_run(copy), MIXTAPE_AOT_ERROR_FILE);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("not the manifest this library"),
            std::string::npos)
      << mixtape_aot_error(nullptr);
  fs::remove_all(copy);
}

INSTANTIATE_TEST_SUITE_P(
    Edits, AotReviewHostile,
    testing::Values(
        // an input shape the plan does not read
        HostileEdit{"digits.json", R"("shape":[16,64])", R"("shape":[16,1])"},
        // an extra output
        HostileEdit{"digits.json", R"("outputs":[{"name":"logits","dtype":"f32","shape":[16,10]}])",
                    R"("outputs":[{"name":"logits","dtype":"f32","shape":[16,10]},)"
                    R"({"name":"extra","dtype":"f32","shape":[16,10]}])"},
        // an output dtype twice as wide as the header's
        HostileEdit{"digits.json", R"("outputs":[{"name":"logits","dtype":"f32")",
                    R"("outputs":[{"name":"logits","dtype":"f64")"},
        // a batch bound past the header's
        HostileEdit{"digits.json", R"("batch":{"export":16,"max":16})",
                    R"("batch":{"export":16,"max":1048576})"},
        // plans with no results, a 0-d argument, a result slot or an argument out of range
        HostileEdit{"digits.plan", R"("results":[[0,0]])", R"("results":[])"},
        HostileEdit{"digits.plan", R"("shape":[[0,1],64],"arg":0)", R"("shape":[],"arg":0)"},
        HostileEdit{"digits.plan", R"("result":0)", R"("result":7)"},
        HostileEdit{"digits.plan", R"("arg":0)", R"("arg":3)"}));

// The runtime checked a file's checksum, then opened it again by name to use it: a file swapped
// in between (another export into the directory, an attacker) ran unchecked. The weights here are
// a FIFO that serves the exported bytes on its first open and weights of zeros after it: the
// model must read it once and compute with the bytes it checked.
TEST_F(AotReviewFiles, AFileSwappedAfterItsCheckIsNeverUsed) {
  std::string copy = art_->dir + "_fifo";
  fs::remove_all(copy);
  fs::copy(art_->dir, copy);
  std::string weights = copy + "/digits.safetensors";
  std::string good = read(weights);
  mt::safetensors::File zeros = mt::safetensors::read(weights);
  for (mt::safetensors::TensorData& t : zeros.tensors)
    std::fill(t.bytes.begin(), t.bytes.end(), std::byte{0});
  std::vector<std::byte> swapped = mt::safetensors::serialize(zeros);
  ASSERT_EQ(swapped.size(), good.size());
  fs::remove(weights);
  ASSERT_EQ(mkfifo(weights.c_str(), 0600), 0) << std::strerror(errno);

  std::atomic<bool> stop = false;
  std::atomic<int> serves = 0;
  auto old_sigpipe = std::signal(SIGPIPE, SIG_IGN);  // a reader that stops early

  std::thread writer([&] {
    for (;;) {
      int fd = ::open(weights.c_str(), O_WRONLY);  // waits for a reader
      if (fd < 0 || stop) {
        if (fd >= 0) ::close(fd);
        return;
      }
      const char* bytes = serves++ == 0 ? good.data() : reinterpret_cast<char*>(swapped.data());
      for (size_t done = 0; done < good.size();) {
        ssize_t n = ::write(fd, bytes + done, good.size() - done);
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      ::close(fd);
      // The next open must be the next reader's: wait for this one to close its end.
      for (int probe; !stop && (probe = ::open(weights.c_str(), O_WRONLY | O_NONBLOCK)) >= 0;) {
        ::close(probe);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  });
  std::vector<float> x(16 * 64, 0.5f), got(16 * 10), expected(16 * 10);
  {
    Model fifo(copy, "digits", *art_->table), file(art_->dir, "digits", *art_->table);
    const void* in[] = {x.data()};
    void* out_fifo[] = {got.data()};
    void* out_file[] = {expected.data()};
    EXPECT_EQ(mixtape_aot_run(fifo.m, 16, in, out_fifo), 0) << mixtape_aot_error(fifo.m);
    EXPECT_EQ(mixtape_aot_run(file.m, 16, in, out_file), 0) << mixtape_aot_error(file.m);
  }
  stop = true;
  int reader = ::open(weights.c_str(), O_RDONLY | O_NONBLOCK);  // lets the writer's open return
  writer.join();
  ::close(reader);
  std::signal(SIGPIPE, old_sigpipe);
  EXPECT_EQ(serves, 1) << "the weights were opened again after their check";
  EXPECT_EQ(first_difference(got, expected), got.size());
  fs::remove_all(copy);
}

// A FIFO in the weights' place that no writer ever opens made the open hang for good (a blocking
// open waits for a writer): it is refused after a wait, and a directory or device at once.
TEST_F(AotReviewFiles, AFifoNobodyWritesIsRefusedNotWaitedOnForever) {
  std::string copy = art_->dir + "_silent";
  fs::remove_all(copy);
  fs::copy(art_->dir, copy);
  std::string weights = copy + "/digits.safetensors";
  fs::remove(weights);
  ASSERT_EQ(mkfifo(weights.c_str(), 0600), 0) << std::strerror(errno);
  mixtape_aot_model* m = nullptr;
  EXPECT_EQ(mixtape_aot_open(copy.c_str(), "digits", art_->table->manifest_xxh3.c_str(), "cpu",
                             &art_->table->variant, 1, &m),
            MIXTAPE_AOT_ERROR_FILE);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("a FIFO that sent nothing"),
            std::string::npos)
      << mixtape_aot_error(nullptr);
  fs::remove(weights);
  fs::create_symlink("/dev/zero", weights);
  EXPECT_EQ(mixtape_aot_open(copy.c_str(), "digits", art_->table->manifest_xxh3.c_str(), "cpu",
                             &art_->table->variant, 1, &m),
            MIXTAPE_AOT_ERROR_FILE);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("not a regular file"), std::string::npos)
      << mixtape_aot_error(nullptr);
  EXPECT_EQ(m, nullptr);
  // An empty folder name and "cpu:" with no target are argument errors.
  EXPECT_EQ(mixtape_aot_open("", "digits", art_->table->manifest_xxh3.c_str(), "cpu",
                             &art_->table->variant, 1, &m),
            MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_EQ(mixtape_aot_open(art_->dir.c_str(), "digits", art_->table->manifest_xxh3.c_str(),
                             "cpu:", &art_->table->variant, 1, &m),
            MIXTAPE_AOT_ERROR_ARGUMENT);
  fs::remove_all(copy);
}

// Each file of an export is replaced atomically, but not the set: the plan and weights are
// written before the libraries are built and the manifest last. An export over a working
// artifact that fails in between (no C compiler, no runtime archive, a full disk) leaves the old
// manifest with checksums of files that are gone: the artifact that was there no longer opens.
TEST(AotReviewExport, FailedExportOverAnArtifactLeavesItWorking) {
  std::string dir = temp_dir("review_reexport");
  mt::manual_seed(1);
  DigitsMLP first, second;
  mt::aot::Options o{.name = "digits"};
  auto exported =
      mt::aot::export_function([&](const mt::Tensor& x) { return first(x); },
                               {mt::aot::input("x", {4, 64}, mt::f32)}, {"logits"}, dir, o);
  Table table(exported);
  {
    Model before(dir, "digits", table);
    ASSERT_NE(before.m, nullptr);
  }
  ::setenv("MIXTAPE_RUNTIME_ARCHIVE", (dir + "/no-such-archive.a").c_str(), 1);
  EXPECT_THROW(
      mt::aot::export_function([&](const mt::Tensor& x) { return second(x); },
                               {mt::aot::input("x", {4, 64}, mt::f32)}, {"logits"}, dir, o),
      mt::Error);
  ::unsetenv("MIXTAPE_RUNTIME_ARCHIVE");
  mixtape_aot_model* m = nullptr;
  EXPECT_EQ(mixtape_aot_open(dir.c_str(), "digits", table.manifest_xxh3.c_str(), "cpu",
                             &table.variant, 1, &m),
            0)
      << "the failed export broke the artifact that was there: " << mixtape_aot_error(nullptr);
  mixtape_aot_close(m);
  fs::remove_all(dir);
}

// ---- 3. state: an export_step that fails must leave the model as it was ----

// Every parameter's values, concatenated (on zero inputs only the biases and later layers move).
std::vector<float> all_parameters(DigitsMLP& net) {
  std::vector<float> out;
  for (const mt::Tensor& p : net.parameters()) {
    std::vector<float> v = p.to_vector<float>();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// A training step of `net` under `opt` with the loss `loss_of(logits, labels)`, taken once on a
// batch of 8 so that the optimizer holds state an export must leave as it was.
template <typename Loss>
auto sgd_step_taken_once(DigitsMLP& net, mt::SGD& opt, Loss loss_of) {
  auto train_step = [&net, &opt, loss_of](const mt::Tensor& x, const mt::Tensor& y) {
    opt.zero_grad();
    mt::Tensor loss = loss_of(net(x), y);
    loss.backward();
    opt.step();
    return loss;
  };
  mt::Generator g(9);
  train_step(mt::randn({8, 64}, mt::f32, &g), mt::zeros({8}, mt::i64));
  return train_step;
}

// export_step traces the step (two real training steps on zeros) before it checks the number of
// outputs, the batch dependence and unnamed state (plan_to_json); it puts the state
// back only after those passed. Such a failed export silently leaves the model trained two (or,
// with a dynamic batch, up to eight) extra steps on zero inputs.
TEST(AotReviewState, FailedExportStepLeavesTheStateAsItWas) {
  mt::manual_seed(5);
  DigitsMLP net;
  mt::SGD opt(net.parameters(), {.lr = 0.5});
  auto train_step = sgd_step_taken_once(
      net, opt,
      [](const mt::Tensor& logits, const mt::Tensor& y) { return mt::cross_entropy(logits, y); });
  std::vector<float> before = all_parameters(net);
  std::string dir = temp_dir("review_failed_step");
  mt::aot::Options o{.name = "train", .module = &net, .optimizer = &opt};
  EXPECT_THROW(
      mt::aot::export_step(
          train_step, {mt::aot::input("x", {8, 64}, mt::f32), mt::aot::input("y", {8}, mt::i64)},
          {"loss", "one_name_too_many"}, dir, o),
      mt::Error);
  std::vector<float> after = all_parameters(net);
  EXPECT_EQ(first_difference(after, before), after.size())
      << "the failed export changed the parameters";
  fs::remove_all(dir);
}

// A weight registered under two names (tied embeddings: one tensor, two checkpoint entries).
struct Tied : mt::Module {
  mt::Linear fc{8, 8};
  mt::Tensor tied;
  Tied() {
    register_module("fc", fc);
    tied = register_parameter("head_weight", fc.weight, true);
  }
  mt::Tensor operator()(const mt::Tensor& x) const { return mt::matmul(fc(x), tied); }
};

// The artifact makes one storage per manifest buffer, so the two names of a tied weight become
// two buffers, of which the plan updates one: NAME_save writes the other as it was at export,
// and load_checkpoint of that file into the C++ model (which assigns both names to the one
// tensor, the second last) throws away what the C program trained.
// (The weight is used twice per call of net, and net runs twice, so backward sums several
// terms for it and the bias: the order it summed leaves in once followed node addresses, and
// export_step failed about one run in eight with "evaluation 0 had a different graph in
// consecutive calls".)
TEST(AotReviewState, TiedWeightsSaveWhatTheStepTrained) {
  mt::manual_seed(2);
  Tied net;
  mt::SGD opt(net.parameters(), {.lr = 0.1});
  auto train_step = [&](const mt::Tensor& x) {
    opt.zero_grad();
    mt::Tensor loss = mt::sum(net(x) * net(x));
    loss.backward();
    opt.step();
    return loss;
  };
  mt::Generator g(4);
  train_step(mt::randn({4, 8}, mt::f32, &g));
  std::string dir = temp_dir("review_tied");
  mt::aot::Options o{.name = "tied", .module = &net, .optimizer = &opt};
  auto exported =
      mt::aot::export_step(train_step, {mt::aot::input("x", {4, 8}, mt::f32)}, {"loss"}, dir, o);
  Table table(exported);
  Model model(dir, "tied", table);
  ASSERT_NE(model.m, nullptr);
  auto compiled = mt::compile(train_step);
  for (int s = 0; s < 3; ++s) {
    std::vector<float> x = mt::randn({4, 8}, mt::f32, &g).to_vector<float>();
    float want = compiled(mt::tensor(x, {4, 8})).to_vector<float>()[0];
    float loss = 0;
    const void* in[] = {x.data()};
    void* out[] = {&loss};
    ASSERT_EQ(mixtape_aot_run(model.m, 4, in, out), 0) << mixtape_aot_error(model.m);
    EXPECT_EQ(loss, want) << "step " << s;
  }
  std::string saved = dir + "/saved.safetensors", reference = dir + "/reference.safetensors";
  ASSERT_EQ(mixtape_aot_save(model.m, saved.c_str()), 0) << mixtape_aot_error(model.m);
  mt::save_checkpoint(reference, net, &opt);
  expect_same_checkpoint(saved, reference);
  fs::remove_all(dir);
}

// Parameters that skipped steps count their own (torch's per-parameter "step"): the artifact
// reads their counts from buffers of their own, NAME_save writes them as save_checkpoint does,
// and NAME_load takes them back, refusing counts the exported step cannot hold.
// In two parameter groups (weight matrices decayed, biases not and at half the rate), whose
// rates the artifact steps with and saves as save_checkpoint does; fc1's weight and bias, in
// different groups, share a count.
TEST(AotReviewState, ParametersThatSkippedStepsKeepTheirOwnCounts) {
  mt::manual_seed(6);
  DigitsMLP net;
  mt::AdamW opt(std::vector<mt::ParamGroup<mt::AdamOptions>>{
      {{net.fc1.weight, net.fc2.weight, net.fc3.weight}, {.lr = 1e-2}},
      {{net.fc1.bias, net.fc2.bias, net.fc3.bias}, {.lr = 5e-3, .weight_decay = 0}}});
  mt::Generator g(8);
  auto train_step = [&](const mt::Tensor& x, const mt::Tensor& y, bool freeze_fc1) {
    opt.zero_grad();
    mt::Tensor loss = mt::cross_entropy(net(x), y);
    loss.backward();
    if (freeze_fc1) {
      net.fc1.weight.zero_grad();
      net.fc1.bias.zero_grad();
    }
    opt.step();
    return loss;
  };
  auto batch = [&] {
    return std::pair{mt::randn({8, 64}, mt::f32, &g), mt::randint(0, 10, {8}, &g)};
  };
  for (bool freeze : {false, true, false}) {
    auto [x, y] = batch();
    train_step(x, y, freeze);
  }
  ASSERT_EQ(opt.steps_taken(0), 2);  // fc1.weight
  ASSERT_EQ(opt.steps_taken(3), 2);  // fc1.bias
  ASSERT_EQ(opt.steps_taken(1), 3);
  auto step = [&](const mt::Tensor& x, const mt::Tensor& y) { return train_step(x, y, false); };
  std::string dir = temp_dir("review_own_counts");
  mt::aot::Options o{.name = "train", .module = &net, .optimizer = &opt};
  auto exported = mt::aot::export_step(
      step, {mt::aot::input("x", {8, 64}, mt::f32), mt::aot::input("y", {8}, mt::i64)}, {"loss"},
      dir, o);
  Table table(exported);
  Model model(dir, "train", table);
  ASSERT_NE(model.m, nullptr);
  auto compiled = mt::compile(step);
  // One batch through the artifact and the compiled C++ step: the same loss.
  auto expect_same_step = [&](int s) {
    auto [x, y] = batch();
    float want = compiled(x, y).to_vector<float>()[0], loss = 0;
    std::vector<float> xs = x.to_vector<float>();
    std::vector<int64_t> ys = y.to_vector<int64_t>();
    const void* in[] = {xs.data(), ys.data()};
    void* out[] = {&loss};
    ASSERT_EQ(mixtape_aot_run(model.m, 8, in, out), 0) << mixtape_aot_error(model.m);
    EXPECT_EQ(loss, want) << "step " << s;
  };
  for (int s = 0; s < 3; ++s) expect_same_step(s);
  EXPECT_EQ(opt.steps_taken(0), 5);
  const std::string saved = dir + "/saved.safetensors", reference = dir + "/reference.safetensors";
  ASSERT_EQ(mixtape_aot_save(model.m, saved.c_str()), 0) << mixtape_aot_error(model.m);
  mt::save_checkpoint(reference, net, &opt);
  expect_same_checkpoint(saved, reference);  // the metadata too: optimizer.fc1.weight.steps = 5
  ASSERT_EQ(mixtape_aot_load(model.m, reference.c_str()), 0) << mixtape_aot_error(model.m);

  auto edited = [&](const std::vector<std::pair<std::string, std::string>>& entries) {
    mt::safetensors::File file = mt::safetensors::read(reference);
    for (const auto& [key, text] : entries) {
      std::erase_if(file.metadata, [&](auto& e) { return e.first == key; });
      if (!text.empty()) file.metadata.emplace_back(key, text);
    }
    const std::string bad = dir + "/bad.safetensors";
    mt::safetensors::write(bad, file);
    return bad;
  };
  struct Refused {
    std::vector<std::pair<std::string, std::string>> entries;
    const char* message;
    bool by_load_checkpoint;  // or a count the C++ optimizer can hold, and the artifact cannot
  };
  const Refused refused[] = {
      // fc1's weight and bias shared a count at export: one buffer cannot hold two.
      {{{"optimizer.fc1.weight.steps", "4"}}, "which the exported step counts with 5", false},
      // fc2 took every update at export: the step counts it with the optimizer.
      {{{"optimizer.fc2.weight.steps", "3"}}, "which the exported step counts with 6", false},
      {{{"optimizer.fc1.weight.steps", "7"}, {"optimizer.fc1.bias.steps", "7"}},
       "more than the optimizer's 6",
       true},
      {{{"optimizer.fc1.weight.steps", "x"}}, "not a step count", true},
      // A count for a parameter the optimizer does not update (it loaded when it equalled the
      // optimizer's).
      {{{"optimizer.fc9.weight.steps", "6"}}, "'fc9.weight', which the step does not update", true},
      // The state of other parameter groups (the step's options are its groups').
      {{{"optimizer.param_groups", ""}}, "other parameter groups", true},
      {{{"optimizer.param_groups", R"([{"params":["fc1.weight","fc2.weight","fc3.bias"]},)"
                                   R"({"params":["fc1.bias","fc2.bias","fc3.weight"]}])"}},
       "other parameter groups",
       true},
      {{{"optimizer.param_groups", "{"}}, "syntax error", true},
  };
  for (const Refused& r : refused) {
    std::string bad = edited(r.entries);
    EXPECT_EQ(mixtape_aot_load(model.m, bad.c_str()), MIXTAPE_AOT_ERROR_FILE) << r.message;
    EXPECT_NE(std::string(mixtape_aot_error(model.m)).find(r.message), std::string::npos)
        << mixtape_aot_error(model.m);
    if (r.by_load_checkpoint) {
      EXPECT_THROW(mt::load_checkpoint(bad, net, &opt), mt::Error) << r.message;
    }
  }
  // Both fc1 counts moved together, and a file without them (the optimizer's count for all)
  // load.
  for (const auto& entries :
       {std::vector<std::pair<std::string, std::string>>{{"optimizer.fc1.weight.steps", "2"},
                                                         {"optimizer.fc1.bias.steps", "2"}},
        std::vector<std::pair<std::string, std::string>>{{"optimizer.fc1.weight.steps", ""},
                                                         {"optimizer.fc1.bias.steps", ""}}}) {
    std::string good = edited(entries);
    EXPECT_EQ(mixtape_aot_load(model.m, good.c_str()), 0) << mixtape_aot_error(model.m);
    mt::load_checkpoint(good, net, &opt);
    expect_same_step(3);
    ASSERT_EQ(mixtape_aot_save(model.m, saved.c_str()), 0) << mixtape_aot_error(model.m);
    mt::save_checkpoint(reference + ".2", net, &opt);
    expect_same_checkpoint(saved, reference + ".2");
  }
  fs::remove_all(dir);
}

// The digits MLP with an optimizer `Rule` (no scaler), trained one step (the optimizer makes its
// state then) and exported at batch 8 as "train", with the generator its inputs came from.
template <typename Rule, typename Options>
struct StepArtifact {
  DigitsMLP net;
  Rule opt;
  mt::Generator g{9};
  std::string dir;
  mt::aot::Exported exported;
  std::optional<Table> table;  // the exported kernels, and the artifact opened with them
  std::optional<Model> model;
  StepArtifact(const std::string& what, Options options)
      : opt(net.parameters(), options), dir(temp_dir(what)) {
    auto train_step = [this](const mt::Tensor& x, const mt::Tensor& y) {
      opt.zero_grad();
      mt::Tensor loss = mt::cross_entropy(net(x), y);
      loss.backward();
      opt.step();
      return loss;
    };
    train_step(mt::randn({8, 64}, mt::f32, &g), mt::zeros({8}, mt::i64));
    mt::aot::Options o{.name = "train", .module = &net, .optimizer = &opt};
    exported = mt::aot::export_step(
        train_step, {mt::aot::input("x", {8, 64}, mt::f32), mt::aot::input("y", {8}, mt::i64)},
        {"loss"}, dir, o);
    table.emplace(exported);
    model.emplace(dir, "train", *table);
  }
  ~StepArtifact() {
    model.reset();  // closed before its folder goes
    table.reset();
    fs::remove_all(dir);
  }
};

// With plain AdamW.
struct AdamStepArtifact : StepArtifact<mt::AdamW, mt::AdamOptions> {
  AdamStepArtifact(const std::string& what, double lr) : StepArtifact(what, {.lr = lr}) {}
};

// NAME_load read optimizer.steps with strtoll: "12abc" loaded as 12 and "abc" as 0 (resetting
// Adam's bias correction), where mt::load_checkpoint refuses both (from_chars, whole text).
TEST(AotReviewState, LoadRefusesAStepCountLoadCheckpointRefuses) {
  mt::manual_seed(5);
  AdamStepArtifact a("review_steps_text", 1e-3);
  auto& [net, opt, g, dir, exported, table, model] = a;
  ASSERT_NE(model->m, nullptr);
  std::string path = dir + "/ck.safetensors";
  ASSERT_EQ(mixtape_aot_save(model->m, path.c_str()), 0) << mixtape_aot_error(model->m);
  // 2^53 + 1: beyond the f64 the count is kept in (INT64_MAX saved back as INT64_MIN).
  for (const char* text : {"12abc", "abc", "99999999999999999999999", "9007199254740993"}) {
    mt::safetensors::File file = mt::safetensors::read(path);
    for (auto& [key, value] : file.metadata)
      if (key == "optimizer.steps") value = text;
    std::string bad = dir + "/bad.safetensors";
    mt::safetensors::write(bad, file);
    EXPECT_THROW(mt::load_checkpoint(bad, net, &opt), mt::Error) << text;
    EXPECT_NE(mixtape_aot_load(model->m, bad.c_str()), 0) << "optimizer.steps = " << text;
  }
}

// A checkpoint with a tensor the artifact has no buffer for (of a larger model) is refused, as
// load_checkpoint refuses it: NAME_load took the tensors it knew and ignored the rest.
TEST(AotReviewState, LoadRefusesATensorTheArtifactDoesNotHave) {
  mt::manual_seed(5);
  AdamStepArtifact a("review_extra_tensor", 1e-3);
  auto& [net, opt, g, dir, exported, table, model] = a;
  ASSERT_NE(model->m, nullptr);
  const std::string path = dir + "/ck.safetensors", bad = dir + "/bad.safetensors";
  ASSERT_EQ(mixtape_aot_save(model->m, path.c_str()), 0) << mixtape_aot_error(model->m);
  ASSERT_EQ(mixtape_aot_load(model->m, path.c_str()), 0) << mixtape_aot_error(model->m);
  mt::safetensors::File file = mt::safetensors::read(path);
  file.tensors.push_back({"fc4.weight", mt::f32, {2}, std::vector<std::byte>(8)});
  mt::safetensors::write(bad, file);
  EXPECT_THROW(mt::load_checkpoint(bad, net, &opt), mt::Error);
  EXPECT_EQ(mixtape_aot_load(model->m, bad.c_str()), MIXTAPE_AOT_ERROR_FILE);
  EXPECT_NE(std::string(mixtape_aot_error(model->m)).find("'fc4.weight'"), std::string::npos)
      << mixtape_aot_error(model->m);
}

// A state entry out of its range (a negative running sum or mean of squares: RMSprop's
// square_avg, Adagrad's sum, Adafactor's factored rows; NAdam's mu_product above 1) is refused by
// NAME_load as load_checkpoint refuses it (optimizer_entries.h): only Adam's exp_avg_sq was, and
// the next run's square root made every weight NaN.
template <typename Rule, typename Options>
void expect_out_of_range_state_refused(Options options, const char* entry, float value = -1.0f,
                                       const char* words = "never below zero") {
  SCOPED_TRACE(entry);
  mt::manual_seed(3);
  StepArtifact<Rule, Options> a("review_state_range", options);
  ASSERT_NE(a.model->m, nullptr);
  const std::string path = a.dir + "/ck.safetensors", bad = a.dir + "/bad.safetensors";
  ASSERT_EQ(mixtape_aot_save(a.model->m, path.c_str()), 0) << mixtape_aot_error(a.model->m);
  mt::safetensors::File file = mt::safetensors::read(path);
  bool edited = false;
  for (auto& t : file.tensors)
    if (t.name == entry) {
      std::memcpy(t.bytes.data(), &value, sizeof value);
      edited = true;
    }
  ASSERT_TRUE(edited) << "the checkpoint has no " << entry;
  mt::safetensors::write(bad, file);
  EXPECT_MT_ERROR(mt::load_checkpoint(bad, a.net, &a.opt), words);
  EXPECT_EQ(mixtape_aot_load(a.model->m, bad.c_str()), MIXTAPE_AOT_ERROR_FILE);
  EXPECT_NE(std::string(mixtape_aot_error(a.model->m)).find(words), std::string::npos)
      << mixtape_aot_error(a.model->m);
}

TEST(AotReviewState, LoadRefusesStateOutOfRangeForEveryRule) {
  expect_out_of_range_state_refused<mt::RMSprop>(mt::RMSpropOptions{.lr = 1e-3},
                                                 "optimizer.fc1.weight.square_avg");
  expect_out_of_range_state_refused<mt::Adagrad>(mt::AdagradOptions{.lr = 0.1},
                                                 "optimizer.fc1.weight.sum");
  expect_out_of_range_state_refused<mt::Adafactor>(mt::AdafactorOptions{},
                                                   "optimizer.fc1.weight.exp_avg_sq_row");
  expect_out_of_range_state_refused<mt::AdamW>(mt::AdamOptions{.lr = 1e-3},
                                               "optimizer.fc1.weight.exp_avg_sq");
  expect_out_of_range_state_refused<mt::AdamW>(mt::AdamOptions{.lr = 1e-3, .amsgrad = true},
                                               "optimizer.fc1.weight.max_exp_avg_sq");
  expect_out_of_range_state_refused<mt::Adamax>(mt::AdamaxOptions{},
                                                "optimizer.fc1.weight.exp_inf");
  expect_out_of_range_state_refused<mt::Adadelta>(mt::AdadeltaOptions{},
                                                  "optimizer.fc1.weight.acc_delta");
  expect_out_of_range_state_refused<mt::NAdam>(
      mt::NAdamOptions{}, "optimizer.fc1.weight.mu_product", 1.5f, "in [0, 1]");
}

// A step that fails part way (a label out of range: cross_entropy's gather refuses it) returns
// an error; the state must then be what it was before the call, not half a step further.
TEST(AotReviewState, FailedStepLeavesTheStateAsItWas) {
  mt::manual_seed(5);
  AdamStepArtifact a("review_failed_run", 1e-2);
  auto& [net, opt, g, dir, exported, table, model] = a;
  ASSERT_NE(model->m, nullptr);
  std::vector<float> x = mt::randn({8, 64}, mt::f32, &g).to_vector<float>();
  std::vector<int64_t> y(8, 3);
  float loss = 0;
  const void* in[] = {x.data(), y.data()};
  void* out[] = {&loss};
  ASSERT_EQ(mixtape_aot_run(model->m, 8, in, out), 0) << mixtape_aot_error(model->m);
  std::string before = dir + "/before.safetensors", after = dir + "/after.safetensors";
  ASSERT_EQ(mixtape_aot_save(model->m, before.c_str()), 0);
  y[5] = 99;  // 10 classes
  EXPECT_NE(mixtape_aot_run(model->m, 8, in, out), 0);
  ASSERT_EQ(mixtape_aot_save(model->m, after.c_str()), 0);
  expect_same_checkpoint(after, before);
}

// A step exported with a dynamic batch: traced at four batch sizes, each trace makes new
// storages for the state, and the restore puts back only the first trace's. Either the export
// says a step takes a fixed batch, or it works and leaves the state as it was.
TEST(AotReviewState, DynamicBatchStepExportsOrRefusesCleanly) {
  mt::manual_seed(5);
  DigitsMLP net;
  mt::SGD opt(net.parameters(), {.lr = 0.5});
  auto train_step =
      sgd_step_taken_once(net, opt, [](const mt::Tensor& logits, const mt::Tensor& y) {
        return mt::sum(mt::cross_entropy(logits, y, {.reduction = mt::Reduction::None}));
      });
  std::vector<float> before = all_parameters(net);
  std::string dir = temp_dir("review_dyn_step");
  mt::aot::Options o{
      .name = "train", .dynamic_batch = {.max = 8}, .module = &net, .optimizer = &opt};
  std::string error;
  try {
    mt::aot::export_step(train_step,
                         {mt::aot::input("x", {8, 64}, mt::f32), mt::aot::input("y", {8}, mt::i64)},
                         {"loss"}, dir, o);
  } catch (const mt::Error& e) {
    error = e.what();
  }
  std::vector<float> after = all_parameters(net);
  EXPECT_EQ(first_difference(after, before), after.size())
      << "the export changed the parameters; its error: " << error;
  fs::remove_all(dir);
}

}  // namespace
