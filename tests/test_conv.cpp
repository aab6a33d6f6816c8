// tests/test_conv.cpp -- the convolution primitives on the CPU back end (oneDNN) against the
// reference loops, in f32, bf16 and f16, and the errors of conv1d, conv2d, conv_transpose2d and
// their modules. Gradients against finite differences are in test_gradcheck, values against
// PyTorch in test_torch_parity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "mixtape/dsl/convert.h"
#include "mixtape/mixtape.h"
#include "mixtape/runtime/conv.h"
#include "mixtape/runtime/cpu_executor.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

struct Case {
  std::string label;
  mt::Shape x, w;
  mt::Conv2dOptions options;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"3x3 pad 1", {2, 16, 12, 12}, {32, 16, 3, 3}, {.padding = 1}},
      {"1x1 stride 2", {2, 32, 9, 9}, {16, 32, 1, 1}, {.stride = 2}},
      {"7x7 stride 2 pad 3 (a ResNet stem)",
       {2, 3, 20, 20},
       {8, 3, 7, 7},
       {.stride = 2, .padding = 3}},
      {"depthwise 3x3", {2, 8, 10, 10}, {8, 1, 3, 3}, {.padding = 1, .groups = 8}},
      {"grouped, asymmetric, dilated",
       {1, 6, 11, 9},
       {4, 3, 3, 2},
       {.stride = {2, 1}, .padding = {1, 2}, .dilation = {2, 1}, .groups = 2}},
      // Few output positions (ResNet-18's last stages at 32x32 inputs): the weight gradient runs
      // as im2col and a GEMM, and bf16's forward and input gradient widened to f32 at 1x1.
      {"3x3 pad 1 on 1x1", {3, 16, 1, 1}, {24, 16, 3, 3}, {.padding = 1}},
      {"3x3 stride 2 pad 1 to 2x2", {3, 8, 4, 4}, {16, 8, 3, 3}, {.stride = 2, .padding = 1}},
      {"1x1 stride 2 to 2x1, asymmetric", {2, 8, 4, 2}, {16, 8, 1, 1}, {.stride = 2}},
      {"asymmetric, dilated, to 2x1",
       {2, 4, 3, 3},
       {6, 4, 3, 2},
       {.stride = {2, 1}, .padding = {1, 0}, .dilation = {1, 2}}},
      // 4x4 outputs: the weight gradient runs as im2col and a GEMM in bf16 only; the second
      // has enough work (2^24 flops a pass) to gather its columns on the team.
      {"3x3 stride 2 pad 1 to 4x4", {2, 8, 8, 8}, {16, 8, 3, 3}, {.stride = 2, .padding = 1}},
      {"3x3 stride 2 pad 1 to 4x4, on the team",
       {16, 64, 8, 8},
       {64, 64, 3, 3},
       {.stride = 2, .padding = 1}},
      // A weight gradient as a GEMM with 11 images (not a whole number of the 8 or 4 a
      // transpose block takes) and 333 values an image (more than a 256-row strip, not a
      // multiple of 8): every block and edge of the batch-last transposes (conv_columns.h).
      {"3x3 stride 2 pad 1 on 3x3 to 2x2, 11 images",
       {11, 37, 3, 3},
       {10, 37, 3, 3},
       {.stride = 2, .padding = 1}},
      // 1x1 windows at a stride to one output position read one pixel of each image: the
      // forward pass and the input gradient run as a GEMM over those pixels.
      {"1x1 strides 2 and 3 to 1x1", {3, 5, 2, 3}, {6, 5, 1, 1}, {.stride = {2, 3}}},
      {"1x1 stride 2 to 1x1, 2^24 flops", {64, 256, 2, 2}, {512, 256, 1, 1}, {.stride = 2}},
      // Outer taps that only ever cover padding, cut off (runtime/conv.cpp): to the centre tap
      // (the 1x1 case above), to the lower right 2x2 taps, to the middle three rows of five with
      // unequal padding left after the cut, and to one row of a dilated grouped window.
      {"3x3 stride 2 pad 1 on 2x2 to 1x1",
       {3, 8, 2, 2},
       {16, 8, 3, 3},
       {.stride = 2, .padding = 1}},
      {"5x5 pad 2 on 2x3", {2, 4, 2, 3}, {6, 4, 5, 5}, {.padding = 2}},
      {"grouped, dilated 3x3 on one row",
       {2, 4, 1, 5},
       {4, 2, 3, 3},
       {.padding = {2, 1}, .dilation = {2, 1}, .groups = 2}},
      // A window on the whole unpadded image: one matrix product (as the 1x1 and 2x2 cases
      // above are once cut), also dilated along a size-1 axis; not grouped.
      {"1x1 on 1x1", {5, 12, 1, 1}, {7, 12, 1, 1}, {}},
      {"3x2 on 3x2", {4, 5, 3, 2}, {6, 5, 3, 2}, {.stride = 2}},
      {"grouped 2x2 on 2x2", {3, 4, 2, 2}, {6, 2, 2, 2}, {.groups = 2}},
      {"dilated 1x4 on 1x4", {2, 3, 1, 4}, {5, 3, 1, 4}, {.dilation = {3, 1}}},
  };
  return all;
}

// The three primitives of one case on the current device, from inputs cast to `dtype`.
std::vector<std::vector<float>> run_case(const Case& c, mt::DType dtype) {
  mt::Generator gen(7);
  mt::Tensor x = mt::cast(mt::randn(c.x, mt::f32, &gen), dtype);
  mt::Tensor w = mt::cast(mt::randn(c.w, mt::f32, &gen), dtype);
  mt::Tensor y = mt::conv2d(x, w, {}, c.options);
  mt::Tensor gy = mt::cast(mt::randn(y.shape(), mt::f32, &gen), dtype);
  const mt::ConvWindow window = mt::ConvWindow::of(c.options);
  std::vector<mt::Tensor> results = {y, mt::conv2d_input_grad(gy, w, c.x, window),
                                     mt::conv2d_weight_grad(x, gy, c.w, window)};
  for (const mt::Tensor& r : results) EXPECT_EQ(r.dtype(), dtype);
  mt::eval(results);
  std::vector<std::vector<float>> out;
  for (const mt::Tensor& r : results) out.push_back(mt::cast(r, mt::f32).to_vector<float>());
  return out;
}

// Each element within `tol` of the reference, relative to the largest reference magnitude (a
// sum of products has no elementwise relative bound where terms cancel).
void expect_close(const std::vector<float>& reference, const std::vector<float>& got, double tol,
                  const std::string& what) {
  ASSERT_EQ(reference.size(), got.size()) << what;
  double scale = 0;
  for (float r : reference) scale = std::max(scale, std::fabs(double{r}));
  for (size_t i = 0; i < reference.size(); ++i)
    ASSERT_NEAR(reference[i], got[i], tol * scale) << what << " at " << i;
}

class ConvOnCpu : public ::testing::TestWithParam<mt::DType> {};

TEST_P(ConvOnCpu, OneDnnMatchesTheReferenceLoops) {
  const mt::DType dtype = GetParam();
  // f32 sums in another order; a 16-bit result may differ in its last bit (the reference rounds
  // an exact sum once, oneDNN an f32 sum).
  const double tol = dtype == mt::f32 ? 1e-5 : dtype == mt::bf16 ? 1.0 / 128 : 1.0 / 1024;
  const char* names[] = {"forward", "input grad", "weight grad"};
  for (const Case& c : cases()) {
    mt::set_device(mt::Device::reference);
    std::vector<std::vector<float>> reference = run_case(c, dtype);
    mt::set_device(mt::Device::cpu);
    mt::reset_execution_stats();
    std::vector<std::vector<float>> cpu = run_case(c, dtype);
    EXPECT_EQ(mt::execution_stats().convolutions, 3) << c.label << ": not run by oneDNN";
    for (int i = 0; i < 3; ++i)
      expect_close(reference[i], cpu[i], tol,
                   c.label + " " + names[i] + " " + std::string(mt::name(dtype)));
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ConvOnCpu, ::testing::Values(mt::f32, mt::bf16, mt::f16),
                         [](const ::testing::TestParamInfo<mt::DType>& info) {
                           return std::string(mt::name(info.param));
                         });

// The cases above whose outer taps never reach the input run on the kept taps alone, and the
// others on the whole window; windows on the whole unpadded image (once cut) as one GEMM.
// What runtime/conv.h runs for one primitive of a case with `operand` operands.
std::string conv_kernel(const Case& c, mt::OpCode op, mt::DType operand = mt::f32) {
  mt::ConvDesc d;
  d.op = op;
  d.operand = d.out = operand;
  const mt::ConvWindow w = mt::ConvWindow::of(c.options);
  auto out_size = [&](int axis, int64_t size, int64_t k) {
    return (size + 2 * w.pad[axis] - (k - 1) * w.dil[axis] - 1) / w.stride[axis] + 1;
  };
  d.geometry = {c.x[0],
                c.x[1],
                c.x[2],
                c.x[3],
                c.w[0],
                c.w[2],
                c.w[3],
                out_size(0, c.x[2], c.w[2]),
                out_size(1, c.x[3], c.w[3]),
                w};
  return mt::conv_kernel(d);
}

const Case& named_case(const std::string& label) {
  for (const Case& c : cases())
    if (c.label == label) return c;
  throw std::runtime_error("no case " + label);
}

TEST(Conv, TapsThatOnlyCoverPaddingAreCutOff) {
  const std::map<std::string, std::string> cut = {
      {"3x3 pad 1 on 1x1", "taps 1..1 of 3 x 1..1 of 3"},
      {"3x3 stride 2 pad 1 on 2x2 to 1x1", "taps 1..2 of 3 x 1..2 of 3"},
      {"5x5 pad 2 on 2x3", "taps 1..3 of 5 x 0..4 of 5"},
      {"grouped, dilated 3x3 on one row", "taps 1..1 of 3 x 0..2 of 3"}};
  for (const Case& c : cases())
    for (mt::OpCode op :
         {mt::OpCode::Conv2d, mt::OpCode::Conv2dInputGrad, mt::OpCode::Conv2dWeightGrad}) {
      const std::string text = conv_kernel(c, op);
      const bool whole_image = c.label == "3x3 pad 1 on 1x1" || c.label == "1x1 on 1x1" ||
                               c.label == "3x3 stride 2 pad 1 on 2x2 to 1x1" ||
                               c.label == "3x2 on 3x2" || c.label == "dilated 1x4 on 1x4";
      EXPECT_EQ(text.find("one GEMM, ") != std::string::npos, whole_image)
          << c.label << ": " << text;
      const auto found = cut.find(c.label);
      if (found == cut.end())
        EXPECT_EQ(text.find("taps"), std::string::npos) << c.label << ": " << text;
      else
        EXPECT_EQ(text.rfind(found->second + ", ", 0), 0u) << c.label << ": " << text;
    }
}

// The weight gradient at 4x4 outputs runs as im2col and one GEMM with bf16 operands, and on
// oneDNN's direct kernel in f32 (runtime/conv.cpp, kGemmWeightGradMaxPositions); at 2x2 both
// take the GEMM. OneDnnMatchesTheReferenceLoops checks their results.
TEST(Conv, Bf16WeightGradientsAt4x4OutputsRunAsOneGemm) {
  for (const char* label :
       {"3x3 stride 2 pad 1 to 4x4", "3x3 stride 2 pad 1 to 4x4, on the team"}) {
    const Case& c = named_case(label);
    EXPECT_EQ(conv_kernel(c, mt::OpCode::Conv2dWeightGrad, mt::bf16).rfind("im2col, ", 0), 0u)
        << label;
    EXPECT_EQ(conv_kernel(c, mt::OpCode::Conv2dWeightGrad, mt::f32).find("im2col"),
              std::string::npos)
        << label;
  }
  const Case& small = named_case("3x3 stride 2 pad 1 to 2x2");
  EXPECT_EQ(conv_kernel(small, mt::OpCode::Conv2dWeightGrad, mt::f32).rfind("im2col, ", 0), 0u);
}

// An infinite dy: the reference skips the taps that read padding, where the im2col GEMM would
// multiply its gathered zeros by infinity; such a weight gradient runs on oneDNN's direct kernel,
// which skips them too. Each element matches the reference's, infinities in place, no NaN.
TEST(Conv, AnInfiniteGradientLeavesThePaddedTapsFinite) {
  // Outputs 4x4 (the GEMM in bf16) and 2x2 (in both types).
  for (int64_t stride : {1, 2})
    for (mt::DType t : {mt::f32, mt::bf16}) {
      const mt::ConvWindow window =
          mt::ConvWindow::of(mt::Conv2dOptions{.stride = stride, .padding = 1});
      const int64_t out = 4 / stride;
      std::vector<float> ones(16, 1.0f), dy(static_cast<size_t>(out * out), 1.0f);
      dy[0] = INFINITY;
      auto weight_grad = [&](mt::Device device) {
        mt::set_device(device);
        mt::Tensor x = mt::cast(mt::tensor<float>(ones, {1, 1, 4, 4}), t);
        mt::Tensor gy = mt::cast(mt::tensor<float>(dy, {1, 1, out, out}), t);
        return mt::cast(mt::conv2d_weight_grad(x, gy, {1, 1, 3, 3}, window), mt::f32)
            .to_vector<float>();
      };
      const std::vector<float> reference = weight_grad(mt::Device::reference);
      const std::vector<float> cpu = weight_grad(mt::Device::cpu);
      ASSERT_EQ(reference.size(), cpu.size());
      for (size_t i = 0; i < reference.size(); ++i) {
        EXPECT_FALSE(std::isnan(reference[i])) << i;
        EXPECT_EQ(reference[i], cpu[i]) << mt::name(t) << " stride " << stride << " tap " << i;
      }
    }
}

// 1x1 windows without padding at a stride to one output position: the forward pass and the
// input gradient run as a GEMM over the one pixel of each image they read, in every dtype; with
// more outputs, or with padding, on oneDNN's kernel.
TEST(Conv, OnePixelWindowsRunAsOneGemm) {
  for (const char* label : {"1x1 strides 2 and 3 to 1x1", "1x1 stride 2 to 1x1, 2^24 flops"})
    for (mt::DType t : {mt::f32, mt::bf16, mt::f16})
      for (mt::OpCode op : {mt::OpCode::Conv2d, mt::OpCode::Conv2dInputGrad})
        EXPECT_EQ(conv_kernel(named_case(label), op, t).rfind("the one pixel it reads, ", 0), 0u)
            << label << " " << mt::name(t);
  Case padded = named_case("1x1 strides 2 and 3 to 1x1");
  padded.options.padding = 1;
  for (const Case& c :
       {padded, named_case("1x1 stride 2"), named_case("1x1 stride 2 to 2x1, asymmetric")})
    EXPECT_EQ(conv_kernel(c, mt::OpCode::Conv2d).find("one pixel"), std::string::npos) << c.label;
}

// Under autocast the convolution runs in the half type with f32 accumulation, as matmul does,
// and its gradients flow back to the f32 weights.
TEST(Conv, AutocastRunsInTheHalfTypeAndTrains) {
  mt::set_device(mt::Device::cpu);
  mt::Generator gen(3);
  mt::Conv2d conv(3, 4, 3, {.padding = 1}, true, &gen);
  mt::Tensor x = mt::randn({2, 3, 6, 6}, mt::f32, &gen);
  mt::Tensor loss;
  {
    mt::autocast guard(mt::bf16);
    loss = mt::sum(mt::square(conv(x)));
  }
  loss.backward();
  mt::Tensor y = mt::conv2d(x, conv.weight, conv.bias, {.padding = 1});
  EXPECT_EQ(conv.weight.grad().dtype(), mt::f32);
  EXPECT_EQ(conv.weight.grad().shape(), conv.weight.shape());
  EXPECT_EQ(conv.bias.grad().shape(), (mt::Shape{4}));
  // d/db sum(y^2) = 2 sum(y) over N, H, W: the bf16 run agrees with the f32 one to bf16 precision.
  std::vector<float> expected = mt::sum(y * 2.0, {0, 2, 3}).to_vector<float>();
  std::vector<float> got = conv.bias.grad().to_vector<float>();
  for (size_t i = 0; i < expected.size(); ++i)
    EXPECT_NEAR(got[i], expected[i], 0.02 * (1 + std::fabs(expected[i]))) << i;
  mt::PrecisionReport report = mt::precision_report({y});
  EXPECT_NE(report.table().find("conv2d"), std::string::npos);
}

TEST(Conv, ModulesHavePyTorchShapesAndNames) {
  mt::Conv2d c2(6, 4, {3, 2}, {.groups = 2});
  EXPECT_EQ(c2.weight.shape(), (mt::Shape{4, 3, 3, 2}));
  mt::Conv1d c1(4, 8, 5, {.padding = 2});
  EXPECT_EQ(c1.weight.shape(), (mt::Shape{8, 4, 5}));
  EXPECT_EQ(c1(mt::zeros({2, 4, 9})).shape(), (mt::Shape{2, 8, 9}));
  mt::ConvTranspose2d t(4, 6, 3, {.stride = 2, .padding = 1, .output_padding = 1, .groups = 2});
  EXPECT_EQ(t.weight.shape(), (mt::Shape{4, 3, 3, 3}));
  EXPECT_EQ(t(mt::zeros({1, 4, 5, 5})).shape(), (mt::Shape{1, 6, 10, 10}));
  std::vector<std::string> names;
  for (const auto& [name, tensor] : c2.named_parameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias"}));
  // U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = 3 * 3 * 2.
  double bound = 1.0 / std::sqrt(18.0);
  for (float v : c2.weight.to_vector<float>()) EXPECT_LE(std::fabs(v), bound);
}

TEST(Conv, BadArgumentsNameTheOpAndShapes) {
  mt::Tensor x = mt::zeros({1, 4, 5, 5}), w = mt::zeros({6, 2, 3, 3});
  EXPECT_MT_ERROR(mt::conv2d(x, w, {}, {.padding = -1}), "conv2d", "padding must not be negative");
  EXPECT_MT_ERROR(mt::conv2d(x, mt::zeros({6, 4, 3, 3}), {}, {.groups = 3}), "groups 3", "4", "6");
  EXPECT_MT_ERROR(mt::conv2d(x, w, {}, {.groups = 1}), "[6, 2, 3, 3]", "expects 2 input channels");
  EXPECT_MT_ERROR(mt::conv2d(x, mt::zeros({6, 4, 7, 3})), "larger than the padded input",
                  "[1, 4, 5, 5]");
  EXPECT_MT_ERROR(mt::conv2d(x, w, {}, {.stride = 0, .groups = 2}), "stride must be positive");
  EXPECT_MT_ERROR(mt::conv2d(mt::zeros({4, 5, 5, 1, 1}), w), "[N, C, H, W]");
  EXPECT_MT_ERROR(mt::conv2d(x, w, mt::zeros({5}), {.groups = 2}), "bias shape [5]", "[6]");
  EXPECT_MT_ERROR(mt::conv2d(mt::zeros({1, 4, 5, 5}, mt::i64), mt::zeros({6, 2, 3, 3}, mt::i64), {},
                             {.groups = 2}),
                  "floating-point");
  EXPECT_MT_ERROR(mt::conv1d(mt::zeros({2, 4}), mt::zeros({3, 2, 5})), "conv1d",
                  "larger than the padded");
  EXPECT_MT_ERROR(
      mt::conv_transpose2d(x, mt::zeros({4, 3, 3, 3}), {}, {.stride = 2, .output_padding = 2}),
      "output_padding (2, 2)", "smaller than the stride");
  EXPECT_MT_ERROR(mt::conv_transpose2d(x, mt::zeros({5, 3, 3, 3})), "conv_transpose2d",
                  "[5, 3, 3, 3]");
  // Sizes whose products would overflow 64 bits are refused, not wrapped.
  const int64_t huge = int64_t{1} << 40;
  EXPECT_MT_ERROR(mt::conv2d(x, w, {}, {.padding = huge, .groups = 2}), "window sizes above 2^31");
  EXPECT_MT_ERROR(
      mt::conv2d(x, mt::zeros({6, 2, huge, 1}), {}, {.dilation = {1 << 30, 1}, .groups = 2}),
      "spans more than 2^62");
  EXPECT_MT_ERROR(mt::conv_transpose2d(mt::zeros({1, 4, huge, 1}), mt::zeros({4, 3, 3, 3}), {},
                                       {.stride = {1 << 30, 1}}),
                  "more than 2^60 rows");
  EXPECT_MT_ERROR(mt::Conv2d(6, 4, 3, {.groups = 4}), "Conv2d", "groups 4");
  EXPECT_MT_ERROR(mt::Conv2d(6, 4, {0, 3}), "Conv2d", "kernel sizes must be positive");
}

TEST(Conv, Conv3dModuleShapesNamesAndErrors) {
  mt::Conv3d c3(6, 4, {3, 2, 1}, {.padding = {1, 0, 0}, .groups = 2});
  EXPECT_EQ(c3.weight.shape(), (mt::Shape{4, 3, 3, 2, 1}));
  EXPECT_EQ(c3(mt::zeros({2, 6, 5, 4, 3})).shape(), (mt::Shape{2, 4, 5, 3, 3}));
  EXPECT_EQ(c3(mt::zeros({6, 5, 4, 3})).shape(), (mt::Shape{4, 5, 3, 3}));
  std::vector<std::string> names;
  for (const auto& [name, tensor] : c3.named_parameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias"}));
  const double bound = 1.0 / std::sqrt(18.0);  // fan_in 3 * 3 * 2 * 1
  for (float v : c3.weight.to_vector<float>()) EXPECT_LE(std::fabs(v), bound);
  EXPECT_MT_ERROR(mt::Conv3d(4, 4, 3, {.stride = 2, .padding = mt::Padding::Same}), "Conv3d",
                  "needs stride 1", "(2, 2, 2)");
  mt::Tensor x = mt::zeros({1, 4, 5, 5, 5}), w = mt::zeros({6, 2, 3, 3, 3});
  EXPECT_MT_ERROR(mt::conv3d(x, w, {}, {.padding = {0, -1, 0}, .groups = 2}), "conv3d",
                  "padding not negative", "padding (0, -1, 0)");
  EXPECT_MT_ERROR(mt::conv3d(x, w), "conv3d", "[6, 2, 3, 3, 3]", "expects 2 input channels");
  EXPECT_MT_ERROR(mt::conv3d(x, mt::zeros({6, 2, 6, 3, 3}), {}, {.groups = 2}), "conv3d",
                  "larger than the padded input", "[1, 4, 5, 5, 5]");
  EXPECT_MT_ERROR(mt::conv3d(mt::zeros({1, 4, 5, 5}), mt::zeros({6, 2, 3, 3})), "conv3d",
                  "[out_channels, in_channels / groups, KD, KH, KW]");
  EXPECT_MT_ERROR(mt::conv3d(mt::zeros({4, 5, 5}), w), "conv3d", "[N, C, D, H, W]");
  EXPECT_MT_ERROR(mt::conv3d(x, w, mt::zeros({5}), {.groups = 2}), "bias shape [5]", "[6]");
  EXPECT_MT_ERROR(
      mt::conv3d(x, w, {}, {.stride = {1, 2, 1}, .padding = mt::Padding::Same, .groups = 2}),
      "conv3d", "'same' needs stride 1");
  EXPECT_MT_ERROR(mt::conv3d(x, w, {}, {.dilation = {int64_t{1} << 40, 1, 1}, .groups = 2}),
                  "conv3d", "window sizes above 2^31");
  EXPECT_MT_ERROR(mt::conv3d(mt::zeros({1, 4, 5, 5, 5}, mt::i64), mt::zeros(w.shape(), mt::i64)),
                  "conv3d", "floating-point");
  mt::ConvTranspose3d t3(4, 6, {2, 3, 1},
                         {.stride = {2, 1, 1}, .output_padding = {1, 0, 0}, .groups = 2});
  EXPECT_EQ(t3.weight.shape(), (mt::Shape{4, 3, 2, 3, 1}));
  EXPECT_EQ(t3(mt::zeros({1, 4, 3, 4, 5})).shape(), (mt::Shape{1, 6, 7, 6, 5}));
  EXPECT_MT_ERROR(mt::conv_transpose3d(x, mt::zeros({4, 3, 3, 3, 3}), {},
                                       {.stride = 2, .output_padding = {0, 2, 0}}),
                  "conv_transpose3d", "output_padding (0, 2, 0)", "smaller than the stride");
  EXPECT_MT_ERROR(mt::conv_transpose3d(x, mt::zeros({5, 3, 3, 3, 3})), "conv_transpose3d",
                  "[5, 3, 3, 3, 3]", "in_channels 4");
  EXPECT_MT_ERROR(mt::conv_transpose3d(x, mt::zeros({4, 3, 3, 3, 3}), {}, {.groups = 3}),
                  "conv_transpose3d", "divide the input's 4 channels");
  EXPECT_MT_ERROR(mt::conv_transpose3d(mt::zeros({1, 4, 1, 1, 1}), mt::zeros({4, 3, 1, 1, 1}), {},
                                       {.padding = 1}),
                  "conv_transpose3d", "the output would have no rows");
  EXPECT_MT_ERROR(mt::conv_transpose3d(x, mt::zeros({4, 3, 3, 3, 3}), mt::zeros({2})),
                  "bias shape [2]", "[3]");
  // Intermediates of the lowering past 2^60 bytes are refused by the op that makes them.
  EXPECT_MT_ERROR(mt::conv3d(mt::zeros({1 << 25, 1, 1 << 30, 1, 1}), mt::zeros({1, 1, 2, 1, 1}), {},
                             {.padding = {int64_t{1} << 31, 0, 0}}),
                  "conv3d", "the depth taps gathered into channels", "2^60 bytes");
  EXPECT_MT_ERROR(
      mt::conv_transpose3d(mt::zeros({1024, 1, 1 << 28, 1, 1}), mt::zeros({1, 1, 1, 1, 1}), {},
                           {.stride = {int64_t{1} << 31, 1, 1}}),
      "conv_transpose3d", "depths spread a stride apart");
}

// The convolution and its gradients replay under mt::compile, bit for bit as the traced step.
TEST(Conv, CompiledStepReplaysTheTracedOne) {
  mt::set_device(mt::Device::cpu);
  auto train = [](bool compiled) {
    mt::Generator gen(11);
    mt::Conv2d conv(2, 3, 3, {.stride = 2, .padding = 1}, true, &gen);
    mt::SGD opt(conv.parameters(), {.lr = 0.1});
    mt::Tensor x = mt::randn({4, 2, 7, 7}, mt::f32, &gen);
    auto step = [&](const mt::Tensor& batch) {
      opt.zero_grad();
      mt::Tensor loss = mt::mean(mt::square(conv(batch)));
      loss.backward();
      opt.step();
      return loss;
    };
    std::vector<double> losses;
    if (compiled) {
      auto fast = mt::compile(step);
      for (int i = 0; i < 4; ++i) losses.push_back(fast(x).item());
      EXPECT_GE(fast.stats().replays, 1);
    } else {
      for (int i = 0; i < 4; ++i) losses.push_back(step(x).item());
    }
    return losses;
  };
  EXPECT_EQ(train(false), train(true));
}

// An empty input with padding is all padding: zeros, on every back end.
TEST(Conv, AnEmptyPaddedInputGivesZeros) {
  for (mt::Device device : {mt::Device::reference, mt::Device::cpu}) {
    mt::set_device(device);
    mt::Tensor y = mt::conv2d(mt::ones({1, 1, 0, 2}), mt::ones({1, 1, 1, 1}), {}, {.padding = 1});
    EXPECT_EQ(y.shape(), (mt::Shape{1, 1, 2, 4}));
    EXPECT_EQ(y.to_vector<float>(), std::vector<float>(8, 0.0f)) << mt::device_name(device);
  }
  mt::set_device(mt::Device::cpu);
  EXPECT_MT_ERROR(mt::conv_transpose2d(mt::ones({1, 1, 0, 2}), mt::ones({1, 1, 1, 1})),
                  "conv_transpose2d", "empty spatial dimension");
}

}  // namespace
