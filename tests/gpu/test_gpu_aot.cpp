// tests/gpu/test_gpu_aot.cpp -- an artifact's CUDA half on a GPU: the exported function's cuda
// outputs equal the JIT's on cuda (host and device pointers), and N exported training steps on
// cuda leave the state mt::compile's N steps on cuda leave, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "examples/digits_model.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/convert.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_executor.h"
#include "mixtape/runtime/cuda_values.h"
#include "tests/aot_test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;

namespace {

using namespace mt::aot_test;

#define SKIP_WITHOUT_CUDA()                                                          \
  do {                                                                               \
    if (!mt::cuda_backend_available())                                               \
      GTEST_SKIP() << "CUDA unavailable: " << mt::cuda_backend_unavailable_reason(); \
  } while (0)

struct DeviceScope {
  mt::Device previous = mt::current_device();
  ~DeviceScope() { mt::set_device(previous); }
};

std::vector<float> inputs(int64_t batch, uint64_t seed) {
  mt::Generator g(seed);
  return mt::rand({batch, 64}, mt::f32, &g).to_vector<float>();
}

mixtape_aot_model* open_cuda(const std::string& dir, const std::string& name,
                             const mt::aot::Exported& exported) {
  mixtape_aot_model* m = nullptr;
  int code = mixtape_aot_open(dir.c_str(), name.c_str(), exported.manifest_xxh3.c_str(), "cuda",
                              nullptr, 0, &m);
  EXPECT_EQ(code, 0) << mixtape_aot_error(nullptr);
  return m;
}

class GpuAotFunction : public testing::TestWithParam<std::string> {};

// At a batch the kernels were compiled for, the artifact runs the JIT's programs: equal bits. A
// batch between runs at the next one, padded with zero rows: equal to the JIT there.
TEST_P(GpuAotFunction, CudaOutputsEqualTheJitsOnCuda) {
  SKIP_WITHOUT_CUDA();
  DeviceScope scope;
  mt::manual_seed(3);
  DigitsMLP net;
  std::string dir = temp_dir("gpu_fn_" + GetParam());
  auto forward = [&](const mt::Tensor& x) {
    auto policy = policy_scope(GetParam());
    return mt::cast(net(x), mt::f32);
  };
  mt::aot::Options o{
      .name = "digits", .dynamic_batch = {.max = 64}, .module = &net, .devices = {"cpu", "cuda"}};
  mt::aot::Exported exported = mt::aot::export_function(
      forward, {mt::aot::input("x", {64, 64}, mt::f32)}, {"logits"}, dir, o);
  mixtape_aot_model* m = open_cuda(dir, "digits", exported);
  ASSERT_NE(m, nullptr);
  mt::set_device(mt::Device::cuda);
  for (auto [batch, padded] : {std::pair<int64_t, int64_t>{64, 64}, {1, 1}, {16, 16}, {7, 8}}) {
    std::vector<float> x = inputs(batch, 10 + batch), x_padded = x;
    x_padded.resize(padded * 64, 0.0f);
    std::vector<float> expected;
    {
      mt::NoGradGuard no_grad;
      expected = forward(mt::tensor(x_padded, {padded, 64})).to_vector<float>();
    }
    expected.resize(batch * 10);
    std::vector<float> got(batch * 10), got_device(batch * 10);
    const void* in[] = {x.data()};
    void* out[] = {got.data()};
    ASSERT_EQ(mixtape_aot_run(m, batch, in, out), 0) << mixtape_aot_error(m);
    EXPECT_EQ(first_difference(got, expected), got.size()) << "batch " << batch;
    // The same through device pointers.
    mt::cuda::DeviceBuffer x_device(x.size() * sizeof(float)), y_device(got.size() * sizeof(float));
    mt::cuda::upload(x_device.address(), x.data(), x.size() * sizeof(float));
    const void* device_in[] = {x_device.data()};
    void* device_out[] = {y_device.data()};
    ASSERT_EQ(mixtape_aot_run_device(m, batch, device_in, device_out), 0) << mixtape_aot_error(m);
    mt::cuda::download(got_device.data(), y_device.address(), got_device.size() * sizeof(float));
    EXPECT_EQ(first_difference(got_device, expected), got.size()) << "batch " << batch;
  }
  mixtape_aot_close(m);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Policies, GpuAotFunction, testing::Values("fp32", "bf16"));

TEST(GpuAotStep, CudaStepsEqualCompileOnCuda) {
  SKIP_WITHOUT_CUDA();
  DeviceScope scope;
  constexpr int64_t batch = 32, steps = 5;
  mt::manual_seed(5);
  DigitsTrainer trainer("f16");
  auto& [_, net, opt, scaler] = trainer;
  auto train_step = trainer.step_function();
  mt::Generator g(9);
  train_step(mt::randn({batch, 64}, mt::f32, &g), mt::zeros({batch}, mt::i64));
  std::string dir = temp_dir("gpu_step");
  mt::aot::Options o{.name = "digits_train",
                     .module = &net,
                     .optimizer = &opt,
                     .scaler = &scaler,
                     .devices = {"cpu", "cuda"}};
  mt::aot::Exported exported = mt::aot::export_step(
      train_step,
      {mt::aot::input("x", {batch, 64}, mt::f32), mt::aot::input("y", {batch}, mt::i64)}, {"loss"},
      dir, o);
  mixtape_aot_model* m = open_cuda(dir, "digits_train", exported);
  ASSERT_NE(m, nullptr);
  mt::set_device(mt::Device::cuda);
  auto compiled = mt::compile(train_step);
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<float> x = mt::randn({batch, 64}, mt::f32, &g).to_vector<float>();
    if (s == 2)
      for (float& v : x) v *= 3e4f;  // overflows f16: the scaler skips the step
    std::vector<int64_t> y(batch);
    for (int64_t i = 0; i < batch; ++i) y[i] = (i * 7 + s) % 10;
    float want =
        compiled(mt::tensor(x, {batch, 64}), mt::tensor(y, {batch}, mt::i64)).to_vector<float>()[0];
    float loss = 0;
    const void* in[] = {x.data(), y.data()};
    void* out[] = {&loss};
    ASSERT_EQ(mixtape_aot_run(m, batch, in, out), 0) << mixtape_aot_error(m);
    EXPECT_EQ(std::memcmp(&loss, &want, sizeof loss), 0)
        << "step " << s << ": " << loss << " against " << want;
  }
  std::string saved = dir + "_saved.safetensors", reference = dir + "_reference.safetensors";
  ASSERT_EQ(mixtape_aot_save(m, saved.c_str()), 0) << mixtape_aot_error(m);
  mt::save_checkpoint(reference, net, &opt, {}, &scaler);
  expect_same_checkpoint(saved, reference);
  mixtape_aot_close(m);
  for (const std::string& f : {saved, reference}) fs::remove(f);
  fs::remove_all(dir);
}

// convert_on_device (the fixed kernel mt_convert, which artifacts carry) gives the CPU back end's
// bits for every f16 and bf16 value and for f32's edges (NaN, inf, subnormals, overflow, ties):
// NaN as a NaN, whose payload the GPU's cvt may canonicalize.
TEST(GpuAotConvert, FixedConvertKernelGivesTheCpusBits) {
  SKIP_WITHOUT_CUDA();
  DeviceScope scope;
  mt::set_device(mt::Device::cuda);
  (mt::ones({1}) * 2.0).to_vector<float>();  // the executor registers its host fetch
  std::vector<uint16_t> halves(65536);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  std::vector<uint32_t> floats;
  for (uint32_t sign : {0u, 0x80000000u})
    for (uint32_t bits :
         {0x00000000u, 0x00000001u, 0x007FFFFFu, 0x00800000u, 0x33000000u, 0x33000001u, 0x387FC000u,
          0x387FE000u, 0x38800000u, 0x3F800000u, 0x3F808000u, 0x3F818000u, 0x3F800FFFu, 0x3F801000u,
          0x3F801001u, 0x477FEFFFu, 0x477FF000u, 0x477FE000u, 0x47800000u, 0x7F7FFFFFu, 0x7F7F8000u,
          0x7F800000u, 0x7FC00000u, 0x7F800001u, 0x7FBFFFFFu, 0x7FFFFFFFu})
      floats.push_back(sign | bits);
  for (uint32_t i = 0; i < 4096; ++i) floats.push_back(i * 0x000FFFF1u);  // spread over all bits
  auto host = [](mt::DType dtype, const void* data, size_t count) {
    auto s = std::make_shared<mt::Storage>(dtype, static_cast<int64_t>(count));
    std::memcpy(s->bytes.data(), data, static_cast<size_t>(s->size_bytes()));
    return s;
  };
  struct Case {
    mt::DType from, to;
  };
  for (Case c : {Case{mt::f32, mt::f16}, Case{mt::f32, mt::bf16}, Case{mt::f16, mt::bf16},
                 Case{mt::bf16, mt::f16}, Case{mt::f16, mt::f32}, Case{mt::bf16, mt::f32}}) {
    std::shared_ptr<mt::Storage> in = c.from == mt::f32
                                          ? host(mt::f32, floats.data(), floats.size())
                                          : host(c.from, halves.data(), halves.size());
    std::shared_ptr<mt::Storage> gpu = mt::convert_on_device(*in, c.to);
    mt::set_device(mt::Device::cpu);
    mt::Tensor cpu = mt::cast(mt::from_storage(in, {in->count}), c.to);
    mt::eval({cpu});  // tensors are lazy: the node holds no value before
    const mt::Storage& want = *cpu.node()->value;
    for (int64_t i = 0; i < in->count; ++i) {
      double a = mt::load_element<double>(*gpu, i), b = mt::load_element<double>(want, i);
      bool same = std::isnan(a) ? std::isnan(b)
                                : std::memcmp(gpu->host_data() + i * mt::size_of(c.to),
                                              want.host_data() + i * mt::size_of(c.to),
                                              mt::size_of(c.to)) == 0;
      ASSERT_TRUE(same) << mt::name(c.from) << " -> " << mt::name(c.to) << " element " << i
                        << ": gpu " << a << ", cpu " << b;
    }
  }
}

// An artifact whose CUDA builds this GPU cannot run (a newer major's CUBIN and PTX): "cuda" is an
// error that says so, and NULL (the best available) opens it on the CPU instead.
TEST(GpuAotOpen, NullOpensOnTheCpuWhereTheGpuRunsNoImage) {
  SKIP_WITHOUT_CUDA();
  int cc = mt::cuda::compute_capability(), newer = 0;
  for (int arch : mt::nvrtc_supported_archs())
    if (arch / 10 > cc / 10 && newer == 0) newer = arch;
  if (newer == 0) GTEST_SKIP() << "NVRTC compiles for no major version above this GPU's";
  mt::manual_seed(3);
  DigitsMLP net;
  std::string dir = temp_dir("gpu_newer");
  mt::aot::Options o{.name = "digits", .module = &net, .devices = {"cpu", "cuda"}};
  o.cuda_archs = {newer};
  mt::aot::Exported exported =
      mt::aot::export_function([&](const mt::Tensor& x) { return net(x); },
                               {mt::aot::input("x", {4, 64}, mt::f32)}, {"logits"}, dir, o);
  Table table(exported);
  mixtape_aot_model* m = nullptr;
  EXPECT_EQ(mixtape_aot_open(dir.c_str(), "digits", exported.manifest_xxh3.c_str(), "cuda",
                             &table.variant, 1, &m),
            MIXTAPE_AOT_ERROR_DEVICE);
  EXPECT_NE(std::string(mixtape_aot_error(nullptr)).find("runs none of the artifact's CUDA builds"),
            std::string::npos)
      << mixtape_aot_error(nullptr);
  Model model(dir, "digits", table, nullptr);
  ASSERT_NE(model.m, nullptr);
  std::vector<float> x(4 * 64, 0.25f), y(4 * 10, -1.0f), device_y(4 * 10);
  const void* in[] = {x.data()};
  void* out[] = {y.data()};
  EXPECT_EQ(mixtape_aot_run(model.m, 4, in, out), 0) << mixtape_aot_error(model.m);
  void* device_out[] = {device_y.data()};
  EXPECT_EQ(mixtape_aot_run_device(model.m, 4, in, device_out), MIXTAPE_AOT_ERROR_ARGUMENT);
  fs::remove_all(dir);
}

}  // namespace
