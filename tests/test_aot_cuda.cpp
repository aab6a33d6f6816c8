// tests/test_aot_cuda.cpp -- an artifact's CUDA half where there is no GPU: NVRTC compiles the
// kernels of every batch the GPU runs into CUBINs and PTX, ptxas assembles the PTX, and opening
// "cuda" without a driver is an error with a code (tests/gpu/test_gpu_aot.cpp runs them).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "examples/digits_model.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/json.h"
#include "mixtape/dsl/sequence_layers.h"
#include "mixtape/jit/aot_cuda.h"
#include "mixtape/runtime/aot_cuda_image.h"
#include "mixtape/runtime/cuda_driver.h"
#include "tests/aot_test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;

namespace {

using namespace mt::aot_test;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

TEST(AotCudaBatches, PowersOfTwoUpToTheMaxAndTheExportBatch) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(mt::aot::cuda_batches(16, 0), V({16}));
  EXPECT_EQ(mt::aot::cuda_batches(24, 100), V({1, 2, 4, 8, 16, 24, 32, 64, 100}));
  EXPECT_EQ(mt::aot::cuda_batches(1, 1), V({1}));
  EXPECT_EQ(mt::aot::cuda_batches(64, 64), V({1, 2, 4, 8, 16, 32, 64}));
}

// The image each GPU runs: an sm_80 CUBIN on every 8.x, sm_90 on 9.0, PTX (which the driver
// compiles) on newer majors, the newest PTX of several, nothing on a 7.5.
TEST(AotCudaImage, EachComputeCapabilityRunsTheImageItCan) {
  std::vector<std::string> archs{"sm_80", "sm_90", "compute_80"};
  for (auto [cc, index] : std::vector<std::pair<int, int>>{
           {80, 0}, {86, 0}, {87, 0}, {89, 0}, {90, 1}, {100, 2}, {120, 2}, {75, -1}})
    EXPECT_EQ(mt::aot::cuda_image_for(archs, cc), index) << "compute capability " << cc;
  EXPECT_EQ(mt::aot::cuda_image_for({"compute_80", "compute_90"}, 100), 1);
  EXPECT_EQ(mt::aot::cuda_image_for({"compute_90", "compute_80"}, 89), 1);
  EXPECT_EQ(mt::aot::cuda_image_for({"compute_90", "sm_86"}, 89), 1);
  EXPECT_EQ(mt::aot::cuda_image_for({"sm_86"}, 80), -1);
  EXPECT_EQ(mt::aot::cuda_image_for({}, 90), -1);
  for (const char* bad : {"sm_", "sm_9x", "gfx90", "compute_"})
    EXPECT_THROW(mt::aot::cuda_image_for({bad}, 90), mt::Error) << bad;
}

// The digits MLP under autocast-bf16 (conversions, bf16 matmuls) as a function with a dynamic
// batch up to 16, and its AdamW + f16-scaler training step, both for cpu and cuda.
class AotCuda : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!mt::nvrtc_available()) return;
    mt::manual_seed(4);
    net_ = new DigitsMLP;
    opt_ = new mt::AdamW(net_->parameters(), {.lr = 1e-3});
    scaler_ = new mt::GradScaler({.init_scale = 1024});
    function_dir_ = new std::string(temp_dir("cuda_fn"));
    step_dir_ = new std::string(temp_dir("cuda_step"));
    auto step = [](const mt::Tensor& x, const mt::Tensor& y) {
      opt_->zero_grad();
      mt::Tensor loss;
      {
        mt::autocast scope(mt::f16);
        loss = mt::cross_entropy((*net_)(x), y);
      }
      scaler_->scale(loss).backward();
      scaler_->step(*opt_);
      scaler_->update();
      return loss;
    };
    step(mt::ones({8, 64}), mt::zeros({8}, mt::i64));  // the optimizer's state exists
    mt::aot::Options o{
        .name = "digits", .dynamic_batch = {.max = 16}, .module = net_, .devices = {"cpu", "cuda"}};
    function_ = new mt::aot::Exported(mt::aot::export_function(
        [](const mt::Tensor& x) {
          mt::autocast scope(mt::bf16);
          return mt::cast((*net_)(x), mt::f32);
        },
        {mt::aot::input("x", {16, 64}, mt::f32)}, {"logits"}, *function_dir_, o));
    mt::aot::Options so{.name = "digits_train",
                        .module = net_,
                        .optimizer = opt_,
                        .scaler = scaler_,
                        .devices = {"cpu", "cuda"}};
    step_ = new mt::aot::Exported(mt::aot::export_step(
        step, {mt::aot::input("x", {8, 64}, mt::f32), mt::aot::input("y", {8}, mt::i64)}, {"loss"},
        *step_dir_, so));
  }
  static void TearDownTestSuite() {
    if (function_dir_) fs::remove_all(*function_dir_);
    if (step_dir_) fs::remove_all(*step_dir_);
    delete function_;
    delete step_;
    delete function_dir_;
    delete step_dir_;
    delete scaler_;
    delete opt_;
    delete net_;
  }
  void SetUp() override {
    if (!mt::nvrtc_available()) GTEST_SKIP() << "NVRTC cannot be dlopened: no CUDA export here";
  }
  static mt::json::Value manifest(const std::string& dir, const std::string& name) {
    return mt::json::parse(read_file(dir + "/" + name + ".json"));
  }
  // (arch, path) of each image the manifest lists.
  static std::vector<std::pair<std::string, std::string>> images(const std::string& dir,
                                                                 const std::string& name) {
    std::vector<std::pair<std::string, std::string>> out;
    mt::json::Value doc = manifest(dir, name);
    for (const auto& image : doc.at("cuda").at("images"))
      out.emplace_back(image.at("arch").get<std::string>(),
                       dir + "/" + image.at("file").get<std::string>());
    return out;
  }
  static DigitsMLP* net_;
  static mt::AdamW* opt_;
  static mt::GradScaler* scaler_;
  static std::string *function_dir_, *step_dir_;
  static mt::aot::Exported *function_, *step_;
};
DigitsMLP* AotCuda::net_ = nullptr;
mt::AdamW* AotCuda::opt_ = nullptr;
mt::GradScaler* AotCuda::scaler_ = nullptr;
std::string* AotCuda::function_dir_ = nullptr;
std::string* AotCuda::step_dir_ = nullptr;
mt::aot::Exported* AotCuda::function_ = nullptr;
mt::aot::Exported* AotCuda::step_ = nullptr;

TEST_F(AotCuda, ManifestListsTheBatchesAndACubinPerArchAndPtx) {
  mt::json::Value m = manifest(*function_dir_, "digits");
  std::vector<std::string> devices;
  for (const auto& d : m.at("devices")) devices.push_back(d.get<std::string>());
  EXPECT_EQ(devices, std::vector<std::string>({"cpu", "cuda"}));
  std::vector<int64_t> batches;
  for (const auto& b : m.at("cuda").at("batches")) batches.push_back(b.get<int64_t>());
  EXPECT_EQ(batches, std::vector<int64_t>({1, 2, 4, 8, 16}));
  std::vector<std::string> archs;
  for (const auto& [arch, path] : images(*function_dir_, "digits")) {
    archs.push_back(arch);
    EXPECT_TRUE(fs::exists(path)) << path;
    // Every file is checksummed: NAME_open refuses a changed one.
    std::string file = fs::path(path).filename().string();
    EXPECT_EQ(m.at("files").at(file).at("bytes").get<int64_t>(),
              static_cast<int64_t>(fs::file_size(path)));
    EXPECT_NE(std::find(function_->files.begin(), function_->files.end(), file),
              function_->files.end());
  }
  EXPECT_EQ(archs, std::vector<std::string>({"sm_80", "sm_90", "compute_80"}));
}

// Each CUBIN is a CUDA ELF object holding every kernel of every batch's programs and the fixed
// kernels; the PTX defines them as entries.
TEST_F(AotCuda, EveryImageHoldsEveryKernel) {
  for (const std::string* dir : {function_dir_, step_dir_}) {
    std::string name = dir == function_dir_ ? "digits" : "digits_train";
    std::vector<std::string> kernels;
    mt::json::Value doc = manifest(*dir, name);
    for (const auto& k : doc.at("cuda").at("kernels")) kernels.push_back(k.get<std::string>());
    ASSERT_GE(kernels.size(), 3u) << name;
    kernels.push_back("mt_convert");
    kernels.push_back("mt_copy_box_4");
    for (const auto& [arch, path] : images(*dir, name)) {
      std::string bytes = read_file(path);
      if (arch.starts_with("sm_")) {
        ASSERT_GT(bytes.size(), 64u);
        EXPECT_EQ(bytes.substr(0, 4),
                  "\x7f"
                  "ELF")
            << path;
        EXPECT_EQ(
            static_cast<unsigned char>(bytes[18]) | static_cast<unsigned char>(bytes[19]) << 8, 190)
            << path << ": e_machine is not EM_CUDA";
        for (const std::string& k : kernels)
          EXPECT_NE(bytes.find(k + '\0'), std::string::npos) << path << " lacks " << k;
      } else {
        EXPECT_NE(bytes.find(".target sm_80"), std::string::npos) << path;
        for (const std::string& k : kernels)
          EXPECT_NE(bytes.find(".entry " + k + "("), std::string::npos) << path << " lacks " << k;
      }
    }
  }
}

// The driver compiles the PTX on GPUs newer than the CUBINs: ptxas, the same assembler, takes it.
TEST_F(AotCuda, PtxasAssemblesThePtx) {
  std::string ptxas;
  for (std::string candidate :
       {std::string(std::getenv("CUDA_HOME") ? std::getenv("CUDA_HOME") : "") + "/bin/ptxas",
        std::string("/usr/local/cuda/bin/ptxas")})
    if (fs::exists(candidate)) ptxas = candidate;
  if (ptxas.empty()) GTEST_SKIP() << "no ptxas (CUDA_HOME/bin, /usr/local/cuda/bin)";
  for (const std::string* dir : {function_dir_, step_dir_}) {
    std::string name = dir == function_dir_ ? "digits" : "digits_train";
    for (const auto& [arch, path] : images(*dir, name)) {
      if (arch.starts_with("sm_")) continue;
      for (const char* target : {"sm_80", "sm_90"}) {
        std::string out = *dir + "/ptxas_" + target + ".cubin";
        std::string command =
            fmt::format("'{}' -arch={} -o '{}' '{}' 2>&1", ptxas, target, out, path);
        int status = std::system(command.c_str());
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command;
        EXPECT_GT(fs::file_size(out), 0u);
        fs::remove(out);
      }
    }
  }
}

TEST_F(AotCuda, OpeningCudaWithoutADriverIsAnErrorAndNullPicksTheCpu) {
  if (mt::cuda::available())
    GTEST_SKIP() << "a CUDA driver is here: tests/gpu/test_gpu_aot.cpp runs the artifact on it";
  Table table(*function_);
  mixtape_aot_model* m = nullptr;
  EXPECT_EQ(mixtape_aot_open(function_dir_->c_str(), "digits", table.manifest_xxh3.c_str(), "cuda",
                             &table.variant, 1, &m),
            MIXTAPE_AOT_ERROR_DEVICE);
  EXPECT_EQ(m, nullptr);
  std::string error = mixtape_aot_error(nullptr);
  EXPECT_NE(error.find("digits: device cuda: cannot load the NVIDIA driver library"),
            std::string::npos)
      << error;
  // NULL: the best available, the CPU here; it runs, and refuses device pointers.
  Model model(*function_dir_, "digits", table, nullptr);
  ASSERT_NE(model.m, nullptr);
  std::vector<float> x(3 * 64, 0.5f), y(3 * 10), device_y(3 * 10);
  const void* in[] = {x.data()};
  void* out[] = {y.data()};
  EXPECT_EQ(mixtape_aot_run(model.m, 3, in, out), 0) << mixtape_aot_error(model.m);
  std::vector<float> expected;
  {
    mt::NoGradGuard no_grad;
    mt::autocast scope(mt::bf16);
    expected = mt::cast((*net_)(mt::tensor(x, {3, 64})), mt::f32).to_vector<float>();
  }
  EXPECT_EQ(first_difference(y, expected), y.size());
  void* device_out[] = {device_y.data()};
  EXPECT_EQ(mixtape_aot_run_device(model.m, 3, in, device_out), MIXTAPE_AOT_ERROR_ARGUMENT);
  EXPECT_NE(std::string(mixtape_aot_error(model.m)).find("needs a model opened on cuda"),
            std::string::npos);
}

TEST_F(AotCuda, ExportRefusesUnknownDevicesAndArchs) {
  std::string dir = temp_dir("cuda_bad");
  auto fn = [](const mt::Tensor& x) { return (*net_)(x); };
  mt::aot::Options o{.name = "digits", .module = net_, .devices = {"cpu", "tpu"}};
  try {
    mt::aot::export_function(fn, {mt::aot::input("x", {4, 64}, mt::f32)}, {"logits"}, dir, o);
    ADD_FAILURE() << "exported for a tpu";
  } catch (const mt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown device 'tpu'"), std::string::npos) << e.what();
  }
  o.devices = {"cpu", "cuda"};
  o.cuda_archs = {12};
  try {
    mt::aot::export_function(fn, {mt::aot::input("x", {4, 64}, mt::f32)}, {"logits"}, dir, o);
    ADD_FAILURE() << "exported for sm_12";
  } catch (const mt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot compile for sm_12"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(dir + "/digits.json"));
  fs::remove_all(dir);
}

}  // namespace

namespace {

using namespace mt::aot_test;

// On cuda a batch between two compiled batches runs padded with zero rows. A function whose rows
// see one another through a matmul over the batch (no kernel names the batch outside dims[0],
// so the cpu export takes it) would answer wrongly there: the cuda export refuses it; the cpu
// export still runs it at every batch.
// A function with fused attention carries the attention kernels of its head dim in every image
// (runtime/cuda_attention.h), and no others, so that the target compiles nothing at run time.
TEST(AotCudaAttention, ImagesCarryTheKernelsOfTheHeadDimsUsed) {
  if (!mt::nvrtc_available()) GTEST_SKIP() << "NVRTC cannot be dlopened: no CUDA export here";
  std::string dir = temp_dir("cuda_attention");
  auto fn = [](const mt::Tensor& x) {
    mt::Tensor q = mt::reshape(x, {1, 8, 16});
    return mt::scaled_dot_product_attention(q, q * 0.5, q, true);
  };
  mt::aot::Options o{.name = "attention", .devices = {"cpu", "cuda"}};
  mt::aot::export_function(fn, {mt::aot::input("x", {8, 16}, mt::f32)}, {"y"}, dir, o);
  mt::json::Value doc = mt::json::parse(read_file(dir + "/attention.json"));
  int images = 0;
  for (const auto& image : doc.at("cuda").at("images")) {
    std::string bytes = read_file(dir + "/" + image.at("file").get<std::string>());
    for (const char* kind : {"forward", "rows", "keys", "values"})
      EXPECT_NE(bytes.find(fmt::format("mt_attention_{}_32", kind)), std::string::npos)
          << image.at("arch").get<std::string>() << " lacks the dim-32 " << kind << " kernel";
    EXPECT_EQ(bytes.find("mt_attention_forward_64"), std::string::npos);
    ++images;
  }
  EXPECT_EQ(images, 3);
  fs::remove_all(dir);
}

TEST(AotCudaPadding, ACudaExportRefusesAFunctionWhoseRowsSeeOneAnother) {
  std::string dir = temp_dir("cuda_mixing");
  auto fn = [](const mt::Tensor& x) {
    mt::Tensor y = x + 1.0;
    return mt::matmul(x, mt::matmul(y, y, true, false));
  };
  mt::aot::Options o{.name = "mixing", .dynamic_batch = {.max = 8}, .devices = {"cpu", "cuda"}};
  try {
    mt::aot::export_function(fn, {mt::aot::input("x", {8, 4}, mt::f32)}, {"y"}, dir, o);
    ADD_FAILURE() << "a cuda export padded a function whose rows see one another";
  } catch (const mt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("output 'y' of this function changes with that padding"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(dir + "/mixing.json"));
  // The padding would change the answer: batch 3 against batch 4 with a zero row, on the cpu.
  o.devices = {"cpu"};
  mt::aot::Exported exported =
      mt::aot::export_function(fn, {mt::aot::input("x", {8, 4}, mt::f32)}, {"y"}, dir, o);
  Table table(exported);
  Model model(dir, "mixing", table);
  ASSERT_NE(model.m, nullptr);
  std::vector<float> x(3 * 4, 0.5f), padded(4 * 4, 0.0f), y(3 * 4), y_padded(4 * 4);
  std::copy(x.begin(), x.end(), padded.begin());
  const void* in[] = {x.data()};
  void* out[] = {y.data()};
  ASSERT_EQ(mixtape_aot_run(model.m, 3, in, out), 0) << mixtape_aot_error(model.m);
  const void* padded_in[] = {padded.data()};
  void* padded_out[] = {y_padded.data()};
  ASSERT_EQ(mixtape_aot_run(model.m, 4, padded_in, padded_out), 0) << mixtape_aot_error(model.m);
  EXPECT_NE(y[0], y_padded[0]);
  fs::remove_all(dir);
}

}  // namespace

namespace {

using namespace mt::aot_test;

// An export over an artifact with CUDA images that has none (or other archs) removes the old
// images: the new manifest does not list them, and a copy of the directory would carry them.
TEST(AotCudaFiles, AnExportRemovesTheImagesOfAnEarlierOne) {
  if (!mt::nvrtc_available()) GTEST_SKIP() << "NVRTC cannot be dlopened: no CUDA export here";
  std::string dir = temp_dir("cuda_stale");
  auto fn = [](const mt::Tensor& x) { return x * 2.0; };
  mt::aot::Options o{.name = "twice", .devices = {"cpu", "cuda"}, .cuda_archs = {80}};
  mt::aot::export_function(fn, {mt::aot::input("x", {4, 4}, mt::f32)}, {"y"}, dir, o);
  for (const char* file : {"twice.sm_80.cubin", "twice.compute_80.ptx"})
    EXPECT_TRUE(fs::exists(dir + "/" + file)) << file;
  std::ofstream(dir + "/other.sm_80.cubin") << "another artifact's";
  o.cuda_archs = {90};
  mt::aot::export_function(fn, {mt::aot::input("x", {4, 4}, mt::f32)}, {"y"}, dir, o);
  EXPECT_FALSE(fs::exists(dir + "/twice.sm_80.cubin"));
  EXPECT_FALSE(fs::exists(dir + "/twice.compute_80.ptx"));
  EXPECT_TRUE(fs::exists(dir + "/twice.sm_90.cubin"));
  EXPECT_TRUE(fs::exists(dir + "/twice.compute_90.ptx"));
  o.devices = {"cpu"};
  mt::aot::Exported exported =
      mt::aot::export_function(fn, {mt::aot::input("x", {4, 4}, mt::f32)}, {"y"}, dir, o);
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::string file = entry.path().filename().string();
    EXPECT_FALSE(file.starts_with("twice.") && (file.ends_with(".cubin") || file.ends_with(".ptx")))
        << file;
  }
  EXPECT_TRUE(fs::exists(dir + "/other.sm_80.cubin"));
  Table table(exported);
  Model model(dir, "twice", table);
  EXPECT_NE(model.m, nullptr);
  fs::remove_all(dir);
}

}  // namespace
