// tests/test_vision_ops.cpp -- pooling, batch/group/instance norm, interpolate, dropout2d and the
// vision modules against host loops written from PyTorch's definitions; their errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "examples/resnet_model.h"
#include "mixtape/mixtape.h"
#include "test_util.h"

namespace mt = mixtape;

namespace {

std::vector<float> values(const mt::Tensor& t) { return t.to(mt::f32).to_vector<float>(); }

void expect_near(const std::vector<float>& actual, const std::vector<double>& expected,
                 double tolerance = 1e-5) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i)
    EXPECT_NEAR(actual[i], expected[i], tolerance * (1 + std::abs(expected[i]))) << "at " << i;
}

// A host NCHW image with the pooling loops written out from PyTorch's CPU kernels.
struct Image {
  int64_t n, c, h, w;
  std::vector<float> data;
  float at(int64_t b, int64_t ch, int64_t y, int64_t x) const {
    return data[static_cast<size_t>(((b * c + ch) * h + y) * w + x)];
  }
};

Image image_of(const mt::Tensor& t) {
  return {t.size(0), t.size(1), t.size(2), t.size(3), values(t)};
}

int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d, bool ceil_mode) {
  int64_t span = in + 2 * p - d * (k - 1) - 1 + (ceil_mode ? s - 1 : 0);
  int64_t out = span / s + 1;
  if (ceil_mode && (out - 1) * s >= in + p) --out;
  return out;
}

struct PoolArgs {
  int64_t k, s, p, d;
  bool ceil_mode, count_include_pad;
};

// Names a case in a failure's trace.
std::ostream& operator<<(std::ostream& os, const PoolArgs& a) {
  return os << "k" << a.k << " s" << a.s << " p" << a.p << " d" << a.d << " ceil " << a.ceil_mode
            << " include pad " << a.count_include_pad;
}

std::vector<double> host_max_pool(const Image& im, const PoolArgs& a) {
  int64_t oh = out_size(im.h, a.k, a.s, a.p, a.d, a.ceil_mode);
  int64_t ow = out_size(im.w, a.k, a.s, a.p, a.d, a.ceil_mode);
  std::vector<double> out;
  for (int64_t b = 0; b < im.n; ++b)
    for (int64_t ch = 0; ch < im.c; ++ch)
      for (int64_t y = 0; y < oh; ++y)
        for (int64_t x = 0; x < ow; ++x) {
          double best = -INFINITY;
          for (int64_t i = 0; i < a.k; ++i)
            for (int64_t j = 0; j < a.k; ++j) {
              int64_t yy = y * a.s - a.p + i * a.d, xx = x * a.s - a.p + j * a.d;
              if (yy < 0 || yy >= im.h || xx < 0 || xx >= im.w) continue;
              best = std::max<double>(best, im.at(b, ch, yy, xx));
            }
          out.push_back(best);
        }
  return out;
}

std::vector<double> host_avg_pool(const Image& im, const PoolArgs& a) {
  int64_t oh = out_size(im.h, a.k, a.s, a.p, 1, a.ceil_mode);
  int64_t ow = out_size(im.w, a.k, a.s, a.p, 1, a.ceil_mode);
  std::vector<double> out;
  for (int64_t b = 0; b < im.n; ++b)
    for (int64_t ch = 0; ch < im.c; ++ch)
      for (int64_t y = 0; y < oh; ++y)
        for (int64_t x = 0; x < ow; ++x) {
          int64_t y0 = y * a.s - a.p, x0 = x * a.s - a.p;
          int64_t y1 = std::min(y0 + a.k, im.h + a.p), x1 = std::min(x0 + a.k, im.w + a.p);
          int64_t pool = (y1 - y0) * (x1 - x0);
          y0 = std::max<int64_t>(y0, 0), x0 = std::max<int64_t>(x0, 0);
          y1 = std::min(y1, im.h), x1 = std::min(x1, im.w);
          double total = 0;
          for (int64_t yy = y0; yy < y1; ++yy)
            for (int64_t xx = x0; xx < x1; ++xx) total += im.at(b, ch, yy, xx);
          out.push_back(total /
                        static_cast<double>(a.count_include_pad ? pool : (y1 - y0) * (x1 - x0)));
        }
  return out;
}

// Under autocast avg_pool2d of a bf16-stored value (a convolution's output) sums its windows in
// f32, as PyTorch's kernels do, and rounds once to the bf16 it returns: each of the 15 adds was
// rounded to bf16 (results 3 ulps and more off the correctly rounded mean).
TEST(AvgPool2d, SumsHalfStoredWindowsInF32UnderAutocast) {
  mt::Generator gen(4);
  mt::Tensor x = mt::randn({1, 2, 8, 8}, mt::f32, &gen), w = mt::randn({2, 2, 1, 1}, mt::f32, &gen);
  mt::Tensor c, y;
  {
    mt::autocast guard(mt::bf16);
    c = mt::conv2d(x, w);
    y = mt::avg_pool2d(c, {4, 4});
  }
  mt::eval({c, y});
  ASSERT_EQ(y.node()->value->dtype, mt::bf16);  // pooling follows its input's stored type
  const std::vector<float> cv = c.to_vector<float>(), yv = y.to_vector<float>();
  ASSERT_EQ(yv.size(), 8u);
  for (int64_t ch = 0; ch < 2; ++ch)
    for (int64_t oh = 0; oh < 2; ++oh)
      for (int64_t ow = 0; ow < 2; ++ow) {
        double total = 0;  // exact: 16 bf16 values
        for (int64_t i = 0; i < 4; ++i)
          for (int64_t j = 0; j < 4; ++j)
            total += cv[static_cast<size_t>((ch * 8 + oh * 4 + i) * 8 + ow * 4 + j)];
        const double mean = total / 16;
        const float got = yv[static_cast<size_t>((ch * 2 + oh) * 2 + ow)];
        // Correctly rounded to bf16 (8 significant bits): within half an ulp of the mean.
        const double half_ulp = std::ldexp(1.0, std::ilogb(mean) - 8);
        EXPECT_LE(std::abs(got - mean), half_ulp)
            << ch << oh << ow << ": " << got << " vs " << mean;
      }
}

TEST(MaxPool2d, MatchesTheHostLoopWithPaddingDilationAndCeilMode) {
  mt::Generator gen(1);
  mt::Tensor x = mt::randn({2, 3, 9, 8}, mt::f32, &gen);
  Image im = image_of(x);
  for (PoolArgs a : {PoolArgs{2, 2, 0, 1, false, true}, PoolArgs{3, 2, 1, 1, false, true},
                     PoolArgs{3, 2, 1, 1, true, true}, PoolArgs{2, 1, 1, 2, false, true},
                     PoolArgs{3, 3, 0, 1, true, true}}) {
    SCOPED_TRACE(testing::Message() << a);
    mt::Tensor y = mt::max_pool2d(x, a.k, a.s, a.p, a.d, a.ceil_mode);
    EXPECT_EQ(y.shape(), (mt::Shape{2, 3, out_size(9, a.k, a.s, a.p, a.d, a.ceil_mode),
                                    out_size(8, a.k, a.s, a.p, a.d, a.ceil_mode)}));
    expect_near(values(y), host_max_pool(im, a), 0);
  }
  // Ceil mode keeps a last window that starts inside the input: 9 -> 5 rather than 4.
  EXPECT_EQ(mt::max_pool2d(x, 2, 2, 0, 1, true).shape(), (mt::Shape{2, 3, 5, 4}));
  // A rectangular kernel and the CHW form.
  mt::Tensor chw = mt::max_pool2d(mt::slice(x, 0, 0, 1).reshape({3, 9, 8}), {3, 2}, {{2, 1}});
  EXPECT_EQ(chw.shape(), (mt::Shape{3, 4, 7}));
}

TEST(MaxPool2d, TiesSendTheGradientToTheFirstMaximumOfEachWindow) {
  // After a ReLU whole windows are zero: each window's gradient goes to one element (its first,
  // in row-major window order), as PyTorch's, not split four ways as Maximum's vjp would.
  mt::Tensor x = mt::tensor(std::vector<float>{-1, -2, 3, 3,  //
                                               -3, -4, 1, 3,  //
                                               5, 5, 0, 0,    //
                                               5, 5, -1, 0},
                            {1, 1, 4, 4});
  x.requires_grad_();
  mt::Tensor y = mt::max_pool2d(mt::relu(x), 2);
  expect_near(values(y), {0, 3, 5, 0}, 0);
  mt::sum(y * mt::tensor(std::vector<float>{1, 2, 3, 4}, {1, 1, 2, 2})).backward();
  // relu's own gradient is zero at x <= 0, so the first window's pick (x = -1) passes nothing;
  // the windows of 3s and 5s and the one of 0s after relu each pick their first element.
  expect_near(values(x.grad()),
              {0, 0, 2, 0,  //
               0, 0, 0, 0,  //
               3, 0, 0, 0,  //
               0, 0, 0, 0},
              0);
  // Overlapping windows (stride 1) each count once at their own first maximum.
  mt::Tensor z = mt::zeros({1, 1, 3, 3});
  z.requires_grad_();
  mt::sum(mt::max_pool2d(z, 2, 1)).backward();
  expect_near(values(z.grad()), {1, 1, 0, 1, 1, 0, 0, 0, 0}, 0);
}

// ---- the MaxPool2d and MaxPool2dGrad primitives ----

struct PoolCase {
  std::string label;
  mt::Shape x;
  mt::Size2 k, s, p, d;
  bool ceil_mode;
};

// ResNet's stem pooling, overlapping windows, a dilated rectangle in ceil mode, a window past the
// right edge, a row window, and one large enough for the CPU loops' threads.
std::vector<PoolCase> pool_cases() {
  return {{"k3 s2 p1", {2, 3, 11, 10}, 3, 2, 1, 1, false},
          {"k2 s1", {1, 2, 6, 7}, 2, 1, 0, 1, false},
          {"k(2,3) s(1,2) p1 d(2,1) ceil", {2, 3, 9, 8}, {2, 3}, {1, 2}, 1, {2, 1}, true},
          {"k3 s3 p1 ceil", {1, 4, 8, 7}, 3, 3, 1, 1, true},
          {"k(1,4) s(1,4)", {2, 2, 3, 9}, {1, 4}, {1, 4}, 0, 1, false},
          {"k3 s2 p1 threaded", {4, 16, 32, 32}, 3, 2, 1, 1, false}};
}

// Values on 7 levels (ties in most windows) with, when `specials`, NaNs (two in one window),
// -inf, and a whole plane of -inf (windows whose pick is their first tap inside the input).
std::vector<float> tie_heavy(const mt::Shape& shape, uint32_t seed, bool specials) {
  std::vector<float> v(static_cast<size_t>(mt::numel(shape)));
  uint32_t state = seed;
  for (float& e : v) {
    state = state * 1664525u + 1013904223u;
    e = static_cast<float>(static_cast<int>(state >> 29) - 3);
  }
  if (specials) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    v[1] = nan, v[3] = nan, v[9] = -inf, v[10] = -inf, v[v.size() / 2] = nan;
    const size_t plane = static_cast<size_t>(shape[2] * shape[3]);
    std::fill(v.end() - static_cast<std::ptrdiff_t>(plane), v.end(), -inf);
  }
  return v;
}

// Equal bits, or both NaN (payloads are not specified).
bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

struct PoolRun {
  std::vector<double> y, gx;
  mt::OpCode y_op;
  int64_t host_ops;  // steps the reference loops ran
};

// max_pool2d and its gradient (gy * y summed, so x.grad is max_pool2d_grad(x, gy)) on `device`.
PoolRun run_pool(const PoolCase& c, mt::DType dtype, const std::vector<float>& x_values,
                 const std::vector<float>& gy_values, mt::Device device,
                 std::optional<mt::DType> autocast = std::nullopt) {
  mt::Device previous = mt::current_device();
  mt::set_device(device);
  std::optional<mt::autocast> guard;
  if (autocast) guard.emplace(*autocast);
  mt::reset_execution_stats();
  mt::Tensor x = mt::tensor(std::vector<double>(x_values.begin(), x_values.end()), c.x, dtype)
                     .requires_grad_();
  mt::Tensor y = mt::max_pool2d(x, c.k, c.s, c.p, c.d, c.ceil_mode);
  mt::Tensor gy =
      mt::tensor(std::vector<double>(gy_values.begin(), gy_values.end()), y.shape(), dtype);
  if (autocast) {
    // Through a 1x1 identity convolution, as ResNet's stem pooling feeds one: its gradient
    // arrives in the low type (exactly gy, rounded), the pooled values are f32.
    const int64_t ch = c.x[1];
    std::vector<double> eye(static_cast<size_t>(ch * ch), 0.0);
    for (int64_t i = 0; i < ch; ++i) eye[static_cast<size_t>(i * ch + i)] = 1.0;
    mt::sum(mt::conv2d(y, mt::tensor(eye, {ch, ch, 1, 1}, mt::f32)) * gy).backward();
  } else {
    mt::sum(y * gy).backward();
  }
  mt::eval({y, x.grad()});
  PoolRun run{y.to_vector<double>(), x.grad().to_vector<double>(), y.node()->op,
              mt::execution_stats().host_ops};
  mt::set_device(previous);
  return run;
}

TEST(MaxPool2dPrimitive, CpuLoopsStoreTheReferencesBits) {
  for (mt::DType dtype : {mt::f32, mt::bf16, mt::f16})
    for (const PoolCase& c : pool_cases())
      for (bool specials : {false, true}) {
        SCOPED_TRACE(testing::Message() << c.label << " " << mt::name(dtype)
                                        << (specials ? " with NaN and -inf" : ""));
        std::vector<float> x = tie_heavy(c.x, 7, specials);
        mt::Shape y_shape = mt::max_pool2d(mt::zeros(c.x), c.k, c.s, c.p, c.d, c.ceil_mode).shape();
        mt::Generator gen(11);
        std::vector<float> gy = mt::randn(y_shape, mt::f32, &gen).to_vector<float>();
        PoolRun want = run_pool(c, dtype, x, gy, mt::Device::reference);
        PoolRun got = run_pool(c, dtype, x, gy, mt::Device::cpu);
        // Under autocast the step's types mix (f32 values, bf16 gradients): the same bits.
        PoolRun want_autocast = run_pool(c, dtype, x, gy, mt::Device::reference, mt::bf16);
        PoolRun got_autocast = run_pool(c, dtype, x, gy, mt::Device::cpu, mt::bf16);
        ASSERT_EQ(got_autocast.gx.size(), want_autocast.gx.size());
        for (size_t i = 0; i < want_autocast.gx.size(); ++i)
          ASSERT_TRUE(same_value(got_autocast.gx[i], want_autocast.gx[i]))
              << "autocast gx[" << i << "] " << got_autocast.gx[i] << " vs " << want_autocast.gx[i];
        EXPECT_EQ(got.y_op, mt::OpCode::MaxPool2d);
        // The CPU's loops ran both primitives, under autocast's mixed types too.
        EXPECT_EQ(got.host_ops, 0);
        EXPECT_EQ(got_autocast.host_ops, 0);
        ASSERT_EQ(got.y.size(), want.y.size());
        ASSERT_EQ(got.gx.size(), want.gx.size());
        for (size_t i = 0; i < want.y.size(); ++i)
          ASSERT_TRUE(same_value(got.y[i], want.y[i]))
              << "y[" << i << "] " << got.y[i] << " vs " << want.y[i];
        for (size_t i = 0; i < want.gx.size(); ++i)
          ASSERT_TRUE(same_value(got.gx[i], want.gx[i]))
              << "gx[" << i << "] " << got.gx[i] << " vs " << want.gx[i];
      }
}

// The gradient node is the MaxPool2dGrad primitive, and its own gradient (double backward) in gy
// gathers at each window's pick.
TEST(MaxPool2dPrimitive, DoubleBackwardGathersAtThePicks) {
  mt::Tensor x = mt::tensor(std::vector<float>{1, 5, 2, 0,  //
                                               3, 4, 9, 9,  //
                                               0, 0, 7, 1,  //
                                               0, 6, 2, 8},
                            {1, 1, 4, 4});
  x.requires_grad_();
  mt::Tensor gy = mt::tensor(std::vector<float>{1, 2, 3, 4}, {1, 1, 2, 2}).requires_grad_();
  mt::Tensor gx = mt::grad({mt::sum(mt::max_pool2d(x, 2) * gy)}, {x}, {}, true)[0];
  EXPECT_EQ(gx.node()->op, mt::OpCode::MaxPool2dGrad);
  expect_near(values(gx), {0, 1, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 3, 0, 4}, 0);
  mt::Tensor weights = mt::reshape(mt::arange(0.0, 16.0, 1.0, mt::f32), {1, 1, 4, 4});
  mt::Tensor ggy = mt::grad({mt::sum(gx * weights)}, {gy})[0];
  expect_near(values(ggy), {1, 6, 13, 15}, 0);
}

// PyTorch (Debian's python3-torch) on the same inputs: ties, NaN (the last NaN of a window takes
// the gradient), -inf windows (the first tap inside the input does), in f32 and bf16 (f16 max
// pooling is not in PyTorch's CPU build). Integer gradients make every sum exact, so both agree
// to the bit whatever their order.
TEST(MaxPool2dPrimitive, MatchesPyTorchOnTiesNanAndInfinities) {
  if (std::system("/usr/bin/python3 -c 'import torch, numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch and numpy";
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / fmt::format("mixtape_max_pool_{}", ::getpid());
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::vector<float>& v) {
    std::ofstream(dir / name, std::ios::binary)
        .write(reinterpret_cast<const char*>(v.data()),
               static_cast<std::streamsize>(v.size() * sizeof(float)));
  };
  struct Expected {
    std::string name;
    PoolRun run;
  };
  std::vector<Expected> runs;
  std::string cases = "[";
  for (mt::DType dtype : {mt::f32, mt::bf16})
    for (const PoolCase& c : pool_cases()) {
      const std::string name = fmt::format("case{}", runs.size());
      std::vector<float> x = tie_heavy(c.x, 3, true);
      mt::Shape y_shape = mt::max_pool2d(mt::zeros(c.x), c.k, c.s, c.p, c.d, c.ceil_mode).shape();
      std::vector<float> gy = tie_heavy(y_shape, 5, false);
      write(name + ".x", x);
      write(name + ".gy", gy);
      runs.push_back({name, run_pool(c, dtype, x, gy, mt::current_device())});
      cases += fmt::format(
          "{}{{\"name\": \"{}\", \"dtype\": \"{}\", \"x\": [{}, {}, {}, {}], \"y\": [{}, {}, {}, "
          "{}], \"k\": [{}, {}], \"s\": [{}, {}], \"p\": [{}, {}], \"d\": [{}, {}], \"ceil\": {}}}",
          runs.size() > 1 ? ", " : "", name, dtype == mt::f32 ? "float32" : "bfloat16", c.x[0],
          c.x[1], c.x[2], c.x[3], y_shape[0], y_shape[1], y_shape[2], y_shape[3], c.k.h, c.k.w,
          c.s.h, c.s.w, c.p.h, c.p.w, c.d.h, c.d.w, c.ceil_mode ? "true" : "false");
    }
  std::ofstream(dir / "cases.json") << cases << "]";
  std::ofstream(dir / "pool.py") << R"PY(
import json, sys
import numpy as np
import torch
import torch.nn.functional as F
d = sys.argv[1]
for c in json.load(open(d + '/cases.json')):
    dt = getattr(torch, c['dtype'])
    x = torch.from_numpy(np.fromfile(d + '/' + c['name'] + '.x', dtype=np.float32).reshape(c['x']))
    gy = torch.from_numpy(np.fromfile(d + '/' + c['name'] + '.gy', dtype=np.float32).reshape(c['y']))
    x = x.to(dt).requires_grad_()
    y = F.max_pool2d(x, c['k'], c['s'], c['p'], c['d'], c['ceil'])
    assert list(y.shape) == c['y'], (c['name'], y.shape)
    y.backward(gy.to(dt))
    y.detach().float().numpy().tofile(d + '/' + c['name'] + '.ty')
    x.grad.float().numpy().tofile(d + '/' + c['name'] + '.tgx')
)PY";
  const std::string command =
      fmt::format("/usr/bin/python3 {} {} > {} 2>&1", (dir / "pool.py").string(), dir.string(),
                  (dir / "log.txt").string());
  const int status = std::system(command.c_str());
  std::ifstream log_file(dir / "log.txt");
  std::string log((std::istreambuf_iterator<char>(log_file)), {});
  ASSERT_EQ(status, 0) << log;
  auto read = [&](const std::string& name) {
    std::ifstream in(dir / name, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
    std::vector<float> v(bytes.size() / sizeof(float));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
    return v;
  };
  for (const Expected& e : runs) {
    SCOPED_TRACE(e.name);
    std::vector<float> ty = read(e.name + ".ty"), tgx = read(e.name + ".tgx");
    ASSERT_EQ(ty.size(), e.run.y.size());
    ASSERT_EQ(tgx.size(), e.run.gx.size());
    for (size_t i = 0; i < ty.size(); ++i)
      ASSERT_TRUE(same_value(e.run.y[i], ty[i]))
          << "y[" << i << "] " << e.run.y[i] << " vs " << ty[i];
    for (size_t i = 0; i < tgx.size(); ++i)
      ASSERT_TRUE(same_value(e.run.gx[i], tgx[i]))
          << "gx[" << i << "] " << e.run.gx[i] << " vs " << tgx[i];
  }
  fs::remove_all(dir);
}

TEST(AvgPool2d, MatchesTheHostLoopWithPaddingCountIncludePadAndCeilMode) {
  mt::Generator gen(2);
  mt::Tensor x = mt::randn({2, 2, 7, 6}, mt::f32, &gen);
  Image im = image_of(x);
  for (PoolArgs a : {PoolArgs{2, 2, 0, 1, false, true}, PoolArgs{3, 2, 1, 1, false, true},
                     PoolArgs{3, 2, 1, 1, false, false}, PoolArgs{3, 2, 1, 1, true, true},
                     PoolArgs{3, 2, 1, 1, true, false}, PoolArgs{2, 3, 1, 1, true, false}}) {
    SCOPED_TRACE(testing::Message() << a);
    mt::Tensor y = mt::avg_pool2d(x, a.k, a.s, a.p, a.ceil_mode, a.count_include_pad);
    expect_near(values(y), host_avg_pool(im, a));
  }
}

TEST(AdaptiveAvgPool2d, AveragesPyTorchsWindowsForDivisibleAndOtherSizes) {
  mt::Generator gen(3);
  mt::Tensor x = mt::randn({2, 3, 7, 6}, mt::f32, &gen);
  Image im = image_of(x);
  for (auto [oh, ow] : {std::pair<int64_t, int64_t>{3, 4}, {1, 1}, {7, 3}, {5, 6}}) {
    SCOPED_TRACE(testing::Message() << oh << "x" << ow);
    std::vector<double> expected;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t ch = 0; ch < 3; ++ch)
        for (int64_t i = 0; i < oh; ++i)
          for (int64_t j = 0; j < ow; ++j) {
            int64_t y0 = i * 7 / oh, y1 = ((i + 1) * 7 + oh - 1) / oh;
            int64_t x0 = j * 6 / ow, x1 = ((j + 1) * 6 + ow - 1) / ow;
            double total = 0;
            for (int64_t y = y0; y < y1; ++y)
              for (int64_t xx = x0; xx < x1; ++xx) total += im.at(b, ch, y, xx);
            expected.push_back(total / static_cast<double>((y1 - y0) * (x1 - x0)));
          }
    mt::Tensor y = mt::adaptive_avg_pool2d(x, {oh, ow});
    EXPECT_EQ(y.shape(), (mt::Shape{2, 3, oh, ow}));
    expect_near(values(y), expected);
  }
}

TEST(BatchNorm, TrainingNormalizesWithBatchStatisticsAndUpdatesTheRunningOnes) {
  mt::Generator gen(4);
  mt::Tensor x = mt::randn({4, 3, 2, 5}, mt::f32, &gen) * 2.0 + 1.0;
  mt::eval({x});
  std::vector<float> xv = values(x);
  mt::Tensor rm = mt::tensor(std::vector<float>{0.5f, -1, 2}, {3});
  mt::Tensor rv = mt::tensor(std::vector<float>{1, 2, 0.5f}, {3});
  mt::Tensor w = mt::tensor(std::vector<float>{1.5f, -0.5f, 2}, {3});
  mt::Tensor b = mt::tensor(std::vector<float>{0.1f, 0.2f, -0.3f}, {3});
  mt::Tensor y = mt::batch_norm(x, rm, rv, w, b, true, 0.2, 1e-3);
  const double n = 40;
  std::vector<double> mean(3, 0), var(3, 0);
  auto channel = [](size_t i) { return (i / 10) % 3; };
  for (size_t i = 0; i < xv.size(); ++i) mean[channel(i)] += xv[i] / n;
  for (size_t i = 0; i < xv.size(); ++i)
    var[channel(i)] += (xv[i] - mean[channel(i)]) * (xv[i] - mean[channel(i)]) / n;
  std::vector<double> expected, wv{1.5, -0.5, 2}, bv{0.1, 0.2, -0.3};
  for (size_t i = 0; i < xv.size(); ++i) {
    size_t c = channel(i);
    expected.push_back((xv[i] - mean[c]) / std::sqrt(var[c] + 1e-3) * wv[c] + bv[c]);
  }
  expect_near(values(y), expected, 1e-5);
  // The running statistics were assigned: 0.8 old + 0.2 batch, the variance unbiased.
  std::vector<double> rm_old{0.5, -1, 2}, rv_old{1, 2, 0.5}, rm_new, rv_new;
  for (size_t c = 0; c < 3; ++c) {
    rm_new.push_back(0.8 * rm_old[c] + 0.2 * mean[c]);
    rv_new.push_back(0.8 * rv_old[c] + 0.2 * var[c] * n / (n - 1));
  }
  expect_near(values(rm), rm_new);
  expect_near(values(rv), rv_new);
  // Eval mode reads them.
  mt::Tensor e = mt::batch_norm(x, rm, rv, w, b, false, 0.2, 1e-3);
  std::vector<double> expected_eval;
  for (size_t i = 0; i < xv.size(); ++i) {
    size_t c = channel(i);
    expected_eval.push_back((xv[i] - rm_new[c]) / std::sqrt(rv_new[c] + 1e-3) * wv[c] + bv[c]);
  }
  expect_near(values(e), expected_eval);
  expect_near(values(rm), rm_new);  // eval leaves them alone
}

TEST(BatchNorm, ModuleKeepsF32BuffersOutsideItsParametersAndCountsBatches) {
  mt::BatchNorm2d bn(3);
  std::vector<std::string> params, buffers;
  for (const auto& [name, t] : bn.named_parameters()) params.push_back(name);
  for (const auto& [name, t] : bn.named_buffers()) buffers.push_back(name);
  EXPECT_EQ(params, (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(buffers,
            (std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"}));
  EXPECT_EQ(bn.parameters().size(), 2u);
  mt::Generator gen(5);
  for (int i = 0; i < 3; ++i) {
    mt::autocast guard(mt::bf16);
    mt::Tensor x = mt::randn({4, 3, 3, 3}, mt::f32, &gen);
    mt::sum(bn(x)).backward();
  }
  EXPECT_EQ(bn.num_batches_tracked.item(), 3);
  EXPECT_EQ(bn.running_mean.node()->precision.storage_type, mt::f32);
  EXPECT_EQ(bn.running_var.node()->precision.storage_type, mt::f32);
  EXPECT_FALSE(bn.running_mean.requires_grad());
  // Eval mode: the output no longer depends on the batch's statistics.
  bn.eval();
  mt::Tensor one = mt::ones({1, 3, 1, 1});
  std::vector<float> alone = values(bn(one));
  std::vector<float> with_others = values(mt::slice(bn(mt::concat({one, one * 5.0})), 0, 0, 1));
  EXPECT_EQ(alone, with_others);
  EXPECT_EQ(bn.num_batches_tracked.item(), 3);
}

TEST(BatchNorm, MomentumNoneIsTheCumulativeAverage) {
  mt::BatchNorm1d bn(2, 1e-5, std::nullopt);
  std::vector<double> sums(2, 0);
  mt::Generator gen(6);
  for (int i = 0; i < 4; ++i) {
    mt::Tensor x = mt::randn({5, 2}, mt::f32, &gen) + static_cast<double>(i);
    std::vector<float> xv = values(x);
    for (size_t k = 0; k < xv.size(); ++k) sums[k % 2] += xv[k] / 5.0;
    bn(x);
  }
  expect_near(values(bn.running_mean), {sums[0] / 4, sums[1] / 4});
}

TEST(GroupNorm, NormalizesEachGroupOfChannels) {
  mt::Generator gen(7);
  mt::Tensor x = mt::randn({2, 4, 3}, mt::f32, &gen) * 3.0;
  std::vector<float> xv = values(x);
  mt::Tensor w = mt::tensor(std::vector<float>{1, 2, 3, 4}, {4});
  mt::Tensor b = mt::tensor(std::vector<float>{0, 1, 0, -1}, {4});
  // Two groups of 2 channels x 3 positions: 6 values each, contiguous.
  std::vector<double> expected;
  for (size_t g = 0; g < 4; ++g) {
    double mean = 0, var = 0;
    for (size_t k = 0; k < 6; ++k) mean += xv[g * 6 + k] / 6;
    for (size_t k = 0; k < 6; ++k) var += (xv[g * 6 + k] - mean) * (xv[g * 6 + k] - mean) / 6;
    for (size_t k = 0; k < 6; ++k) {
      size_t c = (g % 2) * 2 + k / 3;
      expected.push_back((xv[g * 6 + k] - mean) / std::sqrt(var + 1e-5) * (c + 1.0) +
                         std::vector<double>{0, 1, 0, -1}[c]);
    }
  }
  expect_near(values(mt::group_norm(x, 2, w, b)), expected);
  mt::GroupNorm module(2, 4);
  expect_near(values(module(x)), [&] {
    std::vector<double> plain;
    for (float v : values(mt::group_norm(x, 2))) plain.push_back(v);
    return plain;
  }());
  // instance_norm is one channel per group.
  EXPECT_EQ(values(mt::instance_norm(x)), values(mt::group_norm(x, 4)));
  // An empty batch is an empty result, as PyTorch's, with an empty gradient.
  mt::Tensor none = mt::zeros({0, 4, 5, 5}).requires_grad_();
  for (const mt::Tensor& y :
       {mt::group_norm(none, 2, w, b), mt::instance_norm(none), module(none)}) {
    mt::eval({y});
    EXPECT_EQ(y.shape(), (mt::Shape{0, 4, 5, 5}));
  }
  mt::sum(mt::group_norm(none, 2, w, b)).backward();
  mt::eval({none.grad()});
  EXPECT_EQ(none.grad().shape(), (mt::Shape{0, 4, 5, 5}));
}

TEST(Interpolate, NearestAndBilinearUsePyTorchsSourceIndices) {
  mt::Tensor x = mt::tensor(std::vector<float>{1, 2, 3, 4, 5, 6}, {1, 1, 2, 3});
  // Nearest, 2x3 -> 3x5: rows floor(o 2/3) = 0,0,1; columns floor(o 3/5) = 0,0,1,1,2.
  expect_near(values(mt::interpolate(x, {.size = {3, 5}})),
              {1, 1, 2, 2, 3, 1, 1, 2, 2, 3, 4, 4, 5, 5, 6}, 0);
  // Bilinear with align_corners: the corners stay, the middle averages.
  expect_near(
      values(mt::interpolate(
          x, {.size = {3, 3}, .mode = mt::InterpolateMode::Bilinear, .align_corners = true})),
      {1, 2, 3, 2.5, 3.5, 4.5, 4, 5, 6});
  // Without: 2x upscaling of a row [1, 2, 3] gives 1, 1.25, 1.75, 2.25, 2.75, 3.
  mt::Tensor row = mt::tensor(std::vector<float>{1, 2, 3}, {1, 1, 1, 3});
  expect_near(
      values(mt::interpolate(row, {.scale_factor = {1, 2}, .mode = mt::InterpolateMode::Bilinear})),
      {1, 1.25, 1.75, 2.25, 2.75, 3});
  // Nearest on [N, C, L].
  expect_near(values(mt::interpolate(mt::tensor(std::vector<float>{1, 2}, {1, 1, 2}),
                                     {.scale_factor = {2}})),
              {1, 1, 2, 2}, 0);
}

TEST(Dropout2d, ZeroesWholeChannels) {
  mt::Generator gen(8);
  mt::Tensor x = mt::ones({4, 8, 3, 3});
  std::vector<float> y = values(mt::dropout2d(x, 0.5, true, &gen));
  int dropped = 0;
  for (size_t ch = 0; ch < 32; ++ch) {
    std::vector<float> plane(y.begin() + static_cast<std::ptrdiff_t>(ch * 9),
                             y.begin() + static_cast<std::ptrdiff_t>(ch * 9 + 9));
    EXPECT_TRUE(std::all_of(plane.begin(), plane.end(), [&](float v) { return v == plane[0]; }));
    EXPECT_TRUE(plane[0] == 0.0f || plane[0] == 2.0f);
    dropped += plane[0] == 0.0f;
  }
  EXPECT_GT(dropped, 4);
  EXPECT_LT(dropped, 28);
  mt::Dropout2d module(0.5, &gen);
  module.eval();
  EXPECT_EQ(values(module(x)), values(x));
}

TEST(Sequential, ChainsItsStepsAndNamesThemByIndex) {
  mt::Generator gen(9);
  mt::Sequential net;
  net.emplace_back<mt::BatchNorm2d>(2);
  net.append([](const mt::Tensor& x) { return mt::relu(x); });
  net.emplace_back<mt::MaxPool2d>(2);
  net.emplace_back<mt::Flatten>();
  net.emplace_back<mt::Linear>(8, 3, true, &gen);
  EXPECT_EQ(net.size(), 5u);
  std::vector<std::string> names;
  for (const auto& [name, t] : net.state_dict()) names.push_back(name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"0.weight", "0.bias", "4.weight", "4.bias", "0.running_mean",
                                      "0.running_var", "0.num_batches_tracked"}));
  mt::Tensor x = mt::randn({3, 2, 4, 4}, mt::f32, &gen);
  mt::Tensor y = net(x);
  EXPECT_EQ(y.shape(), (mt::Shape{3, 3}));
  // The same steps written out (eval mode, so that the batch norm reads its running statistics).
  net.eval();
  mt::NamedTensors state = net.state_dict();
  mt::Tensor h =
      mt::flatten(mt::max_pool2d(mt::relu(mt::batch_norm(x, state[4].second, state[5].second,
                                                         state[0].second, state[1].second, false)),
                                 2),
                  1);
  EXPECT_EQ(values(net(x)), values(mt::linear(h, state[2].second, state[3].second)));
}

// examples/resnet_model.h's ResNets in torchvision's layout: the parameter counts torchvision
// documents (11,689,512 and 25,557,032 at 1000 classes), its state_dict sizes (122 and 320 entries:
// parameters, running statistics and batch counters) and names, and logits for a small batch.
TEST(ResNetModels, HaveTorchvisionsParametersAndNames) {
  auto parameters = [](const mt::Module& net) {
    int64_t count = 0;
    for (const mt::Tensor& p : net.parameters()) count += p.numel();
    return count;
  };
  auto names = [](const mt::Module& net) {
    std::vector<std::string> all;
    for (const auto& [name, t] : net.state_dict()) all.push_back(name);
    return all;
  };
  mt::Generator gen(12);
  ResNet18 resnet18(1000, &gen);
  EXPECT_EQ(parameters(resnet18), 11689512);
  EXPECT_EQ(resnet18.state_dict().size(), 122u);
  ResNet50 resnet50(1000, &gen);
  EXPECT_EQ(parameters(resnet50), 25557032);
  const std::vector<std::string> all = names(resnet50);
  EXPECT_EQ(all.size(), 320u);
  for (const char* name :
       {"conv1.weight", "bn1.running_var", "layer1.0.conv3.weight", "layer1.0.bn3.bias",
        "layer1.0.downsample.0.weight", "layer1.0.downsample.1.num_batches_tracked",
        "layer2.3.conv2.weight", "layer3.5.bn2.running_mean", "layer4.0.downsample.0.weight",
        "layer4.2.conv3.weight", "fc.weight", "fc.bias"})
    EXPECT_NE(std::find(all.begin(), all.end(), name), all.end()) << name;
  EXPECT_EQ(std::find(all.begin(), all.end(), "layer1.1.downsample.0.weight"), all.end());
  mt::Tensor logits = resnet50(mt::randn({2, 3, 32, 32}, mt::f32, &gen));
  EXPECT_EQ(logits.shape(), (mt::Shape{2, 1000}));
  for (float v : logits.to_vector<float>()) EXPECT_TRUE(std::isfinite(v));
}

TEST(VisionPrecision, NormsRunInF32AndPoolingFollowsItsInputUnderAutocast) {
  mt::Generator gen(10);
  mt::Tensor x = mt::randn({4, 4, 6, 6}, mt::f32, &gen);
  mt::Tensor p = mt::randn({6, 6}, mt::f32, &gen);
  mt::autocast guard(mt::bf16);
  mt::Tensor h = mt::matmul(x, p);  // bf16
  mt::Tensor pooled =
      mt::max_pool2d(h, 2) + mt::adaptive_avg_pool2d(mt::interpolate(h, {.size = {3, 3}}), {3, 3});
  // avg_pool2d sums in f32 and returns its input's stored type.
  mt::Tensor averaged = mt::avg_pool2d(h, 2);
  int f32_sums = 0;
  for (const mt::PrecisionRow& row : mt::precision_report({averaged}).rows)
    f32_sums += row.op == "add" && row.storage == mt::f32;
  EXPECT_EQ(f32_sums, 2);  // the 2x2 window's: its rows' sum, then its columns'
  EXPECT_EQ(averaged.node()->precision.storage_type, mt::bf16);
  // Bilinear interpolation too (its f32 weights widened the sum).
  mt::Tensor resized = mt::interpolate(h, {.size = {9, 9}, .mode = mt::InterpolateMode::Bilinear});
  mt::eval({resized});
  EXPECT_EQ(resized.node()->precision.storage_type, mt::bf16);
  mt::Tensor normed =
      mt::batch_norm(h, {}, {}, {}, {}, true) + mt::group_norm(h, 2) + mt::instance_norm(h);
  std::map<std::string, int> f32_rows;
  for (const mt::PrecisionRow& row : mt::precision_report({pooled, normed}).rows) {
    for (const char* norm : {"batch_norm", "group_norm", "instance_norm"})
      if (row.rule.find(std::string("inside ") + norm) != std::string::npos) {
        EXPECT_EQ(row.storage, mt::f32) << row.op << ": " << row.rule;
        ++f32_rows[norm];
      }
    // (A scalar operand is a fill in its own type; the op reading it follows the bf16 input.)
    if (row.shape == mt::Shape{4, 4, 3, 3} && !row.backward && row.op != "slice" &&
        row.op != "broadcast_to" && row.op != "full") {
      EXPECT_EQ(row.storage, mt::bf16) << row.op << ": " << row.rule;
    }
  }
  for (const char* norm : {"batch_norm", "group_norm", "instance_norm"})
    EXPECT_GT(f32_rows[norm], 2) << norm << " is not named in the precision report";
  EXPECT_EQ(pooled.node()->precision.storage_type, mt::bf16);
}

// Batch and instance norm return their input's stored type, as PyTorch's autocast does (f32
// statistics inside); group norm, on its f32 list, returns f32. Under fp32 all stay f32, and a
// traced half input comes back in its own type.
TEST(VisionPrecision, BatchAndInstanceNormReturnTheInputsType) {
  mt::Generator gen(12);
  mt::Tensor x = mt::randn({4, 4, 6, 6}, mt::f32, &gen);
  mt::Tensor p = mt::randn({6, 6}, mt::f32, &gen);
  auto stored = [&](const mt::PolicyPtr& policy) {
    mt::autocast guard(policy);
    mt::Tensor h = mt::matmul(x, p);
    std::vector<mt::Tensor> out = {mt::batch_norm(h, {}, {}, {}, {}, true), mt::instance_norm(h),
                                   mt::group_norm(h, 2)};
    mt::precision_report(out);  // runs the pass
    std::vector<mt::DType> types;
    for (const mt::Tensor& t : out) types.push_back(t.node()->precision.storage_type);
    return types;
  };
  EXPECT_EQ(stored(mt::autocast_policy(mt::bf16)),
            (std::vector<mt::DType>{mt::bf16, mt::bf16, mt::f32}));
  EXPECT_EQ(stored(mt::pure_policy(mt::f16)), (std::vector<mt::DType>{mt::f16, mt::f16, mt::f32}));
  EXPECT_EQ(stored(mt::fp32_policy()), (std::vector<mt::DType>{mt::f32, mt::f32, mt::f32}));
  mt::Tensor half = mt::cast(x, mt::bf16);
  EXPECT_EQ(mt::batch_norm(half, {}, {}, {}, {}, true).dtype(), mt::bf16);
  EXPECT_EQ(mt::instance_norm(half).dtype(), mt::bf16);
  EXPECT_EQ(mt::group_norm(half, 2).dtype(), mt::bf16);
}

TEST(VisionErrors, BadArgumentsNameTheOpAndTheShapes) {
  mt::Tensor x = mt::zeros({2, 4, 5, 5});
  EXPECT_MT_ERROR(mt::max_pool2d(x, 3, 1, -1), "max_pool2d", "padding -1", "negative");
  EXPECT_MT_ERROR(mt::avg_pool2d(x, 3, 1, 2), "avg_pool2d", "more than half the kernel");
  EXPECT_MT_ERROR(mt::max_pool2d(x, 7), "max_pool2d", "larger than", "[2, 4, 5, 5]");
  EXPECT_MT_ERROR(mt::max_pool2d(x, 3, 1, 0, 3), "max_pool2d", "dilation 3", "larger than");
  EXPECT_MT_ERROR(mt::max_pool2d(mt::zeros({4, 5}), 2), "max_pool2d", "NCHW", "[4, 5]");
  EXPECT_MT_ERROR(mt::avg_pool2d(x, 0), "avg_pool2d", "positive");
  EXPECT_MT_ERROR(mt::adaptive_avg_pool2d(x, {0, 2}), "adaptive_avg_pool2d", "positive");
  EXPECT_MT_ERROR(mt::group_norm(x, 3), "group_norm", "3 groups", "4 channels", "[2, 4, 5, 5]");
  EXPECT_MT_ERROR(mt::batch_norm(x, mt::zeros({3}), mt::ones({3}), {}, {}, true), "batch_norm",
                  "running_mean shape [3]", "[4]");
  EXPECT_MT_ERROR(mt::batch_norm(mt::zeros({1, 4}), {}, {}, {}, {}, true), "batch_norm",
                  "more than one value per channel");
  EXPECT_MT_ERROR(mt::batch_norm(x, {}, {}, {}, {}, false), "batch_norm", "eval mode");
  mt::BatchNorm2d bn(4);
  EXPECT_MT_ERROR(bn(mt::zeros({2, 4, 5})), "BatchNorm2d", "[2, 4, 5]");
  EXPECT_MT_ERROR(mt::GroupNorm(3, 4), "GroupNorm", "3 groups");
  EXPECT_MT_ERROR(mt::interpolate(x, {}), "interpolate", "size or scale_factor");
  EXPECT_MT_ERROR(
      mt::interpolate(mt::zeros({2, 3, 4}), {.size = {8}, .mode = mt::InterpolateMode::Bilinear}),
      "interpolate", "bilinear", "[2, 3, 4]");
  EXPECT_MT_ERROR(
      mt::interpolate(mt::zeros({2, 3, 4}), {.size = {8}, .mode = mt::InterpolateMode::Bicubic}),
      "interpolate", "bicubic", "[2, 3, 4]");
  EXPECT_MT_ERROR(mt::interpolate(x, {.size = {8, 8}, .align_corners = true}), "interpolate",
                  "align_corners", "linear, bilinear, bicubic and trilinear");
  EXPECT_MT_ERROR(
      mt::interpolate(
          x, {.size = {8, 8}, .mode = mt::InterpolateMode::NearestExact, .align_corners = true}),
      "interpolate", "align_corners");
  EXPECT_MT_ERROR(mt::interpolate(x, {.size = {8}, .mode = mt::InterpolateMode::Linear}),
                  "interpolate", "linear needs an input [N, C, L]", "[2, 4, 5, 5]");
  EXPECT_MT_ERROR(mt::interpolate(x, {.size = {8}, .mode = mt::InterpolateMode::Trilinear}),
                  "interpolate", "trilinear needs an input [N, C, D, H, W]", "[2, 4, 5, 5]");
  EXPECT_MT_ERROR(
      mt::interpolate(mt::zeros({2, 3}), {.size = {8}, .mode = mt::InterpolateMode::Area}),
      "interpolate", "area needs an input [N, C, L], [N, C, H, W] or [N, C, D, H, W]");
  EXPECT_MT_ERROR(mt::interpolate(mt::zeros({1, 1, 2, 2, 2, 2}), {.size = {8}}), "interpolate",
                  "nearest needs an input");
  EXPECT_MT_ERROR(mt::Upsample({.size = {8, 8}, .scale_factor = {2}}), "Upsample", "both");
  EXPECT_MT_ERROR(mt::pixel_shuffle(x, 3), "pixel_shuffle", "4 channels", "[2, 4, 5, 5]");
  EXPECT_MT_ERROR(mt::pixel_shuffle(mt::zeros({4, 5}), 1), "pixel_shuffle", "[*, C, H, W]");
  EXPECT_MT_ERROR(mt::pixel_shuffle(x, 0), "pixel_shuffle", "factor", "got 0");
  EXPECT_MT_ERROR(mt::pixel_shuffle(x, int64_t{1} << 40), "pixel_shuffle", "2^30");
  EXPECT_MT_ERROR(mt::pixel_unshuffle(x, 2), "pixel_unshuffle", "multiples of the factor 2");
  EXPECT_MT_ERROR(mt::pixel_unshuffle(mt::zeros({1, 3, 0, 0}), int64_t{1} << 30), "pixel_unshuffle",
                  "more than 2^60 channels");
  EXPECT_MT_ERROR(mt::interpolate(mt::zeros({1, 2, 0, 3}), {.size = {4, 4}}), "interpolate",
                  "empty spatial axis");
  EXPECT_MT_ERROR(mt::PixelShuffle(-1), "PixelShuffle", "positive");
  EXPECT_MT_ERROR(mt::pad(x, {6, 0}, mt::PadMode::Circular), "pad", "circular",
                  "at most its size 5");
  EXPECT_MT_ERROR(mt::pad(x, {-1, 0}, mt::PadMode::Circular), "pad", "constant mode");
  EXPECT_MT_ERROR(mt::adaptive_max_pool2d(x, {2, 0}), "adaptive_max_pool2d", "positive");
  EXPECT_MT_ERROR(mt::adaptive_max_pool2d(mt::zeros({4, 5}), 2), "adaptive_max_pool2d", "NCHW");
  EXPECT_MT_ERROR(mt::unfold(mt::zeros({4, 5}), 2), "unfold", "[N, C, H, W]", "[4, 5]");
  EXPECT_MT_ERROR(mt::unfold(x, 6), "unfold", "kernel_size (6, 6)", "no block", "(5, 5)");
  EXPECT_MT_ERROR(mt::unfold(x, 2, 1, -1), "unfold", "padding not negative");
  EXPECT_MT_ERROR(mt::unfold(x, {300, 300}, 1, 150), "unfold", "more than 2^16 kernel elements");
  EXPECT_MT_ERROR(mt::unfold(x, 2, int64_t{1} << 40), "unfold", "above 2^31");
  EXPECT_MT_ERROR(mt::fold(mt::zeros({2, 9, 16}), {5, 5}, 2), "fold", "9 rows", "4 elements");
  EXPECT_MT_ERROR(mt::fold(mt::zeros({2, 8, 15}), {5, 5}, 2), "fold", "15 blocks", "takes 4 x 4");
  EXPECT_MT_ERROR(mt::fold(mt::ones({1, 1, 4}), {(int64_t{1} << 62) + 1, 4}, 1), "fold",
                  "above 2^60");
  EXPECT_MT_ERROR(mt::fold(mt::ones({1, 1, 4}), {int64_t{1} << 32, int64_t{1} << 32}, 1), "fold",
                  "4 blocks", "takes 4294967296 x 4294967296");
  EXPECT_MT_ERROR(mt::fold(mt::zeros({2, 4, 16}, mt::i64), {5, 5}, 2), "fold", "floating-point");
  EXPECT_MT_ERROR(mt::fold(mt::zeros({8}), {5, 5}, 2), "fold", "[8]");
  mt::Tensor picks = mt::max_pool2d_with_indices(x, 2).indices;
  EXPECT_MT_ERROR(mt::max_unpool2d(mt::zeros({2, 4, 2, 2}), mt::cast(picks, mt::f32), 2),
                  "max_unpool2d", "i64", "[2, 4, 2, 2]");
  EXPECT_MT_ERROR(mt::max_unpool2d(mt::zeros({2, 4, 3, 2}), picks, 2), "max_unpool2d",
                  "the input's shape [2, 4, 3, 2]");
  EXPECT_MT_ERROR(
      mt::max_unpool2d(mt::zeros({2, 4, 2, 2}), picks, 2, std::nullopt, 0, mt::Size2{0, 4}),
      "max_unpool2d", "the output's height 0");
  EXPECT_MT_ERROR(mt::max_unpool2d(mt::zeros({2, 4, 2, 2}), picks, 0), "max_unpool2d", "range");
  // torch's bounds: (default - stride, default + stride), the default here 4.
  EXPECT_MT_ERROR(
      mt::max_unpool2d(mt::zeros({2, 4, 2, 2}), picks, 2, std::nullopt, 0, mt::Size2{6, 4}),
      "max_unpool2d", "height 6 must be between 2 and 6");
  EXPECT_MT_ERROR(mt::grid_sample(x, mt::zeros({2, 3, 3, 2}, mt::f64)), "grid_sample",
                  "the input (f32) and the grid (f64) must have one dtype");
  // Three spatial axes: a grid of (x, y, z) points; PyTorch has no bicubic there.
  mt::Tensor volume = mt::zeros({2, 4, 3, 5, 5});
  EXPECT_MT_ERROR(mt::grid_sample(volume, mt::zeros({2, 3, 3, 3, 2})), "grid_sample",
                  "[N, D_out, H_out, W_out, 3]", "[2, 3, 3, 3, 2]");
  EXPECT_MT_ERROR(mt::grid_sample(x, mt::zeros({2, 3, 3, 3})), "grid_sample",
                  "[N, H_out, W_out, 2]", "[2, 3, 3, 3]");
  EXPECT_MT_ERROR(
      mt::grid_sample(volume, mt::zeros({2, 1, 3, 3, 3}), {.mode = mt::GridSampleMode::Bicubic}),
      "grid_sample", "bicubic needs an input [N, C, H, W]", "[2, 4, 3, 5, 5]");
  EXPECT_MT_ERROR(mt::grid_sample(mt::zeros({2, 4, 0, 5, 5}), mt::zeros({2, 1, 3, 3, 3})),
                  "grid_sample", "empty spatial axis");
  EXPECT_MT_ERROR(mt::affine_grid(mt::zeros({2, 2, 3}), {2, 4, 3, 5, 5}), "affine_grid",
                  "theta [N, 3, 4] and a size [N, C, D, H, W]", "[2, 2, 3]");
  EXPECT_MT_ERROR(mt::affine_grid(mt::zeros({2, 3, 4}), {2, 4, 0, 5, 5}), "affine_grid",
                  "[1, 2^24]");
  // A base grid larger than memory is refused before any of it is allocated.
  const int64_t side = int64_t{1} << 20;
  EXPECT_MT_ERROR(mt::affine_grid(mt::zeros({1, 3, 4}), {1, 1, side, side, side}), "affine_grid",
                  "needs more host memory than a 64-bit count holds");
  EXPECT_MT_ERROR(mt::affine_grid(mt::zeros({1, 3, 4}), {1, 1, 4 * side, 2 * side, 2 * side}),
                  "affine_grid", "more points than a 64-bit count holds");
  EXPECT_MT_ERROR(mt::affine_grid(mt::zeros({1, 2, 3}), {1, 1, int64_t{1} << 24, int64_t{1} << 24}),
                  "affine_grid's base grid", "out of memory");
  EXPECT_MT_ERROR(
      mt::grid_sample(x, mt::zeros({2, 3, 3, 2}), {.mode = static_cast<mt::GridSampleMode>(7)}),
      "grid_sample", "unknown mode 7");
  EXPECT_MT_ERROR(mt::grid_sample(x, mt::zeros({2, 3, 3, 2}),
                                  {.padding_mode = static_cast<mt::GridPadding>(9)}),
                  "grid_sample", "unknown padding mode 9");
  EXPECT_MT_ERROR(mt::dropout2d(x, 1.5), "dropout2d", "p must be");
  // Huge sizes: an mt::Error, not an allocation failure, an overflow or a graph of 2^40 nodes.
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_MT_ERROR(mt::interpolate(x, {.scale_factor = {inf}}), "interpolate", "above 2^24");
  EXPECT_MT_ERROR(mt::interpolate(x, {.scale_factor = {1e12, 1}}), "interpolate", "above 2^24");
  EXPECT_MT_ERROR(mt::interpolate(x, {.size = {int64_t{1} << 40, 1}}), "interpolate", "2^24");
  EXPECT_MT_ERROR(mt::adaptive_avg_pool2d(x, {int64_t{1} << 40, 1}), "adaptive_avg_pool2d",
                  "above 2^20");
  EXPECT_MT_ERROR(mt::max_pool2d(x, {(int64_t{1} << 40) + 1, 1}, 1, {int64_t{1} << 39, 0}),
                  "max_pool2d", "above 2^31");
  EXPECT_MT_ERROR(mt::avg_pool2d(x, {(int64_t{1} << 24) + 1, 1}, 1, {int64_t{1} << 23, 0}),
                  "avg_pool2d", "above 2^16 on an axis");
  // Large windows torch takes are taken: a global pool over 300 x 300 (a view per kernel row
  // and column), and 70000 windows of one element each.
  mt::Tensor big = mt::ones({1, 1, 300, 300}) * 0.5;
  EXPECT_EQ(values(mt::avg_pool2d(big, 300)), std::vector<float>{0.5f});
  mt::Tensor widened = mt::adaptive_avg_pool2d(mt::full({1, 1, 1, 3}, 2.0), {1, 70000});
  EXPECT_EQ(widened.shape(), (mt::Shape{1, 1, 1, 70000}));
  EXPECT_EQ(mt::sum(widened).item(), 140000.0);
}

// avg_pool2d's divisors (where windows cover different counts) and interpolate's indices and
// weights are host tables; kept by value (dsl/constant_cache.h), a compiled step reading them
// replays, where a new table on every trace kept it tracing.
// A small volume network (Conv3d, BatchNorm3d, the 3-d poolings) trains the same under
// mt::compile as traced, in f32 and under bf16 autocast, its running statistics included.
TEST(VisionVolumes, ANetworkOfVolumesReplaysUnderCompile) {
  mt::Generator data_gen(5);
  const mt::Tensor x = mt::randn({3, 2, 6, 7, 5}, mt::f32, &data_gen);
  for (bool autocast : {false, true}) {
    SCOPED_TRACE(autocast ? "autocast-bf16" : "fp32");
    auto run = [&](bool compiled) {
      mt::Generator gen(9);
      mt::Conv3d conv1(2, 4, 3, {.padding = 1}, true, &gen);
      mt::BatchNorm3d norm(4);
      mt::MaxPool3d pool(3, mt::Size3{2, 2, 1}, 1);
      mt::Conv3d conv2(4, 4, {2, 3, 3}, {.padding = mt::Padding::Same, .groups = 2}, false, &gen);
      mt::AvgPool3d avg(2, std::nullopt, 0, true);
      mt::AdaptiveMaxPool3d top({1, 2, 1});
      mt::AdaptiveAvgPool3d mean3({1, 1, 1});
      std::vector<mt::Tensor> params = conv1.parameters();
      for (mt::Module* m : std::vector<mt::Module*>{&norm, &conv2})
        for (const mt::Tensor& p : m->parameters()) params.push_back(p);
      mt::SGD opt(params, {.lr = 0.05, .momentum = 0.9});
      auto step = [&](const mt::Tensor& input) {
        opt.zero_grad();
        std::optional<mt::autocast> guard;
        if (autocast) guard.emplace(mt::bf16);
        mt::Tensor h = pool(mt::relu(norm(conv1(input))));
        h = conv2(h);
        mt::Tensor loss = mt::mean(mt::square(mean3(avg(h)))) + mt::mean(mt::square(top(h)));
        guard.reset();
        loss.backward();
        opt.step();
        return loss;
      };
      auto compiled_step = mt::compile(step);
      std::vector<double> losses;
      for (int call = 0; call < 4; ++call)
        losses.push_back((compiled ? compiled_step(x) : step(x)).item());
      if (compiled && mt::current_device() != mt::Device::reference) {
        EXPECT_GE(compiled_step.stats().replays, 1) << compiled_step.stats().reason;
      }
      losses.push_back(mt::sum(norm.running_mean).item());
      losses.push_back(static_cast<double>(norm.num_batches_tracked.item()));
      return losses;
    };
    const std::vector<double> traced = run(false);
    EXPECT_EQ(run(true), traced);
    EXPECT_EQ(traced.back(), 4.0);
    EXPECT_NE(traced[4], 0.0);  // the running mean moved
  }
}

TEST(VisionVolumes, ShapesChannelDropoutAndErrors) {
  mt::Tensor v = mt::ones({2, 3, 5, 6, 7});
  EXPECT_EQ(mt::max_pool3d(v, 2).shape(), (mt::Shape{2, 3, 2, 3, 3}));
  EXPECT_EQ(mt::max_pool3d(v, 2, std::nullopt, 0, 1, true).shape(), (mt::Shape{2, 3, 3, 3, 4}));
  EXPECT_EQ(mt::avg_pool3d(mt::ones({3, 5, 6, 7}), {1, 2, 3}).shape(), (mt::Shape{3, 5, 3, 2}));
  EXPECT_EQ(mt::adaptive_avg_pool3d(v, {4, 1, 3}).shape(), (mt::Shape{2, 3, 4, 1, 3}));
  EXPECT_EQ(values(mt::adaptive_max_pool3d(v, {2, 2, 2})), std::vector<float>(48, 1.0f));
  // Whole channels of a volume dropped (or scaled by 2), batched and not.
  mt::Generator gen(3);
  for (const mt::Shape& shape : {mt::Shape{4, 6, 2, 3, 2}, mt::Shape{6, 2, 3, 2}}) {
    std::vector<float> y = values(mt::dropout3d(mt::ones(shape), 0.5, true, &gen));
    for (size_t ch = 0; ch < y.size() / 12; ++ch)
      for (size_t i = 0; i < 12; ++i) {
        EXPECT_EQ(y[ch * 12 + i], y[ch * 12]);
        EXPECT_TRUE(y[ch * 12] == 0.0f || y[ch * 12] == 2.0f);
      }
  }
  mt::Dropout3d drop(0.5, &gen);
  drop.eval();
  EXPECT_EQ(values(drop(v)), values(v));
  EXPECT_MT_ERROR(mt::Dropout3d(1.5), "Dropout3d", "p must be in [0, 1]");
  EXPECT_MT_ERROR(mt::dropout3d(mt::ones({2, 3, 4}), 0.5), "dropout3d", "[N, C, D, H, W]");
  EXPECT_MT_ERROR(mt::max_pool3d(mt::ones({2, 3, 4}), 2), "max_pool3d", "NCDHW or CDHW");
  EXPECT_MT_ERROR(mt::max_pool3d(v, 2, std::nullopt, {2, 0, 0}), "max_pool3d", "depth axis",
                  "more than half the kernel");
  EXPECT_MT_ERROR(mt::avg_pool3d(v, {2, 9, 2}), "avg_pool3d", "height axis", "larger than");
  EXPECT_MT_ERROR(mt::avg_pool3d(v, 2, mt::Size3{1, 0, 1}), "avg_pool3d", "must be positive");
  EXPECT_MT_ERROR(mt::adaptive_avg_pool3d(v, {2, 0, 2}), "adaptive_avg_pool3d", "(2, 0, 2)",
                  "must be positive");
  EXPECT_MT_ERROR(mt::adaptive_max_pool3d(mt::zeros({1, 1, int64_t{1} << 33, 1, 1}), 1),
                  "adaptive_max_pool3d", "along the depth axis", "above 2^31");
  EXPECT_MT_ERROR(mt::adaptive_max_pool3d(mt::ones({2, 3, 4, 5}, mt::i64), 2),
                  "adaptive_max_pool3d", "input");
  mt::BatchNorm3d norm(3);
  EXPECT_MT_ERROR(norm(mt::ones({2, 3, 4, 5})), "BatchNorm3d", "[N, C, D, H, W]");
  std::vector<std::string> names;
  for (const auto& [name, tensor] : norm.state_dict()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias", "running_mean", "running_var",
                                             "num_batches_tracked"}));
}

// InstanceNorm with running statistics against host loops: training moves them towards the
// batch's mean of the instances' means and unbiased variances, eval normalizes with them.
TEST(InstanceNormModules, RunningStatisticsUnbatchedInputsAndNames) {
  mt::Generator gen(12);
  const int64_t n = 3, c = 2, plane = 6;
  const mt::Tensor x = mt::randn({n, c, 2, 3}, mt::f32, &gen) * 2.0 + 1.0;
  const std::vector<float> xv = values(x);
  mt::InstanceNorm2d norm(c, 1e-5, 0.3, true, true);
  std::vector<std::string> names;
  for (const auto& [name, tensor] : norm.state_dict()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias", "running_mean", "running_var",
                                             "num_batches_tracked"}));
  const mt::Tensor trained = norm(x);
  mt::eval({trained});
  std::vector<double> expect_mean(c), expect_var(c);
  for (int64_t ch = 0; ch < c; ++ch) {
    double mean_sum = 0, var_sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* v = xv.data() + (i * c + ch) * plane;
      double m = 0, s2 = 0;
      for (int64_t k = 0; k < plane; ++k) m += v[k];
      m /= plane;
      for (int64_t k = 0; k < plane; ++k) s2 += (v[k] - m) * (v[k] - m);
      mean_sum += m;
      var_sum += s2 / (plane - 1);
    }
    expect_mean[ch] = 0.7 * 0.0 + 0.3 * mean_sum / n;
    expect_var[ch] = 0.7 * 1.0 + 0.3 * var_sum / n;
  }
  const std::vector<float> rm = values(norm.running_mean), rv = values(norm.running_var);
  for (int64_t ch = 0; ch < c; ++ch) {
    EXPECT_NEAR(rm[ch], expect_mean[ch], 1e-5);
    EXPECT_NEAR(rv[ch], expect_var[ch], 1e-5);
  }
  EXPECT_EQ(norm.num_batches_tracked.item(), 0.0);  // PyTorch's instance norm never counts
  // Eval: (x - running_mean) / sqrt(running_var + eps), per channel; an unbatched input too.
  norm.eval();
  const std::vector<float> y = values(norm(x)),
                           y0 = values(norm(mt::squeeze(mt::slice(x, 0, 0, 1), 0)));
  for (int64_t i = 0; i < n * c * plane; ++i) {
    const int64_t ch = (i / plane) % c;
    const double want = (xv[i] - rm[ch]) / std::sqrt(rv[ch] + 1e-5);
    EXPECT_NEAR(y[i], want, 1e-5);
    if (i < c * plane) {
      EXPECT_NEAR(y0[i], want, 1e-5);
    }
  }
  // The defaults: no affine, no running statistics, batch statistics in eval too.
  mt::InstanceNorm1d plain(4);
  EXPECT_TRUE(plain.state_dict().empty());
  plain.eval();
  const mt::Tensor line = mt::randn({2, 4, 5}, mt::f32, &gen);
  EXPECT_EQ(values(plain(line)), values(mt::instance_norm(line)));
  EXPECT_MT_ERROR(plain(mt::ones({2, 4, 5, 6})), "InstanceNorm1d", "[N, C, L] or [C, L]");
  EXPECT_MT_ERROR(mt::InstanceNorm3d(2, 1e-5, 1.5), "InstanceNorm3d", "momentum");
  EXPECT_MT_ERROR(mt::InstanceNorm3d(2, 1e-5, 0.1, false, true)(mt::ones({1, 3, 2, 2, 2})),
                  "running_mean shape [2]", "[1, 3, 2, 2, 2]");
  mt::PReLU prelu(3, 0.1);
  EXPECT_EQ(values(prelu.weight), std::vector<float>(3, 0.1f));
  EXPECT_EQ(values(prelu(mt::tensor(std::vector<float>{-1, 2, -3}, {1, 3}))),
            (std::vector<float>{-0.1f, 2.0f, -0.3f}));
  EXPECT_MT_ERROR(mt::prelu(mt::ones({2, 3}), mt::ones({2})), "prelu", "one per channel");
  EXPECT_MT_ERROR(mt::max_pool1d(mt::ones({2, 3, 4, 5}), 2), "max_pool1d", "NCL or CL");
  EXPECT_MT_ERROR(mt::avg_pool1d(mt::ones({2, 3, 4}), 2, 1, 2), "avg_pool1d", "length axis",
                  "more than half");
  EXPECT_MT_ERROR(mt::adaptive_max_pool1d(mt::ones({2, 3, 4}), 0), "adaptive_max_pool1d",
                  "must be positive");
  EXPECT_MT_ERROR(mt::conv_transpose1d(mt::ones({2, 3, 4}), mt::ones({3, 1, 2}), {},
                                       {.stride = 2, .output_padding = 2}),
                  "conv_transpose1d", "output_padding 2");
  EXPECT_EQ(mt::MaxPool1d(3, 2)(mt::ones({2, 3, 9})).shape(), (mt::Shape{2, 3, 4}));
  EXPECT_EQ(mt::AvgPool1d(2)(mt::ones({3, 9})).shape(), (mt::Shape{3, 4}));
  EXPECT_EQ(mt::AdaptiveAvgPool1d(5)(mt::ones({3, 9})).shape(), (mt::Shape{3, 5}));
  EXPECT_EQ(mt::AdaptiveMaxPool1d(2)(mt::ones({1, 3, 9})).shape(), (mt::Shape{1, 3, 2}));
  mt::Tensor pooled = mt::ones({2, 3, 2, 2, 2});
  mt::Tensor at = mt::zeros({2, 3, 2, 2, 2}, mt::i64);
  EXPECT_EQ(mt::MaxUnpool3d(2)(pooled, at).shape(), (mt::Shape{2, 3, 4, 4, 4}));
  EXPECT_MT_ERROR(mt::max_unpool3d(pooled, mt::zeros({2, 3, 2, 2}, mt::i64), 2), "max_unpool3d",
                  "indices must be i64 of the input's shape");
  EXPECT_MT_ERROR(mt::max_unpool3d(pooled, at, 2, std::nullopt, 0, mt::Size3{4, 9, 4}),
                  "max_unpool3d", "height 9", "between 2 and 6");
  EXPECT_MT_ERROR(mt::max_unpool1d(mt::ones({2, 3, 4, 5}), mt::zeros({2, 3, 4, 5}, mt::i64), 2),
                  "max_unpool1d", "NCL or CL");
  EXPECT_EQ(mt::MaxPool3d(2).with_indices(mt::ones({3, 4, 4, 4})).indices.shape(),
            (mt::Shape{3, 2, 2, 2}));
  EXPECT_EQ(mt::MaxUnpool1d(2)(mt::ones({3, 4}), mt::zeros({3, 4}, mt::i64)).shape(),
            (mt::Shape{3, 8}));
  mt::ConvTranspose1d up(4, 6, 3, {.stride = 2, .groups = 2});
  EXPECT_EQ(up.weight.shape(), (mt::Shape{4, 3, 3}));
  EXPECT_EQ(up(mt::zeros({2, 4, 5})).shape(), (mt::Shape{2, 6, 11}));
}

TEST(VisionCompile, PoolingDivisorsAndInterpolationTablesReplay) {
  mt::Generator gen(21);
  mt::Tensor x = mt::randn({2, 3, 6, 6}, mt::f32, &gen);
  auto run = [&](bool compiled) {
    mt::Tensor w = mt::ones({1, 3, 6, 6});
    w.requires_grad_();
    mt::SGD opt({w}, {.lr = 0.1});
    auto step = [&](const mt::Tensor& input) {
      opt.zero_grad();
      mt::Tensor h = input * w;
      mt::Tensor loss = mt::mean(mt::square(mt::avg_pool2d(h, 3, 2, 1, false, false))) +
                        mt::mean(mt::square(mt::avg_pool2d(h, 2, 1, 1, true, false))) +
                        mt::mean(mt::square(mt::interpolate(
                            h, {.size = {9, 10}, .mode = mt::InterpolateMode::Bilinear}))) +
                        mt::mean(mt::square(mt::interpolate(h, {.scale_factor = {1.5}})));
      loss.backward();
      opt.step();
      return loss;
    };
    auto compiled_step = mt::compile(step);
    std::vector<double> losses;
    for (int call = 0; call < 5; ++call)
      losses.push_back((compiled ? compiled_step(x) : step(x)).item());
    if (compiled && mt::current_device() != mt::Device::reference) {
      EXPECT_GE(compiled_step.stats().replays, 2) << compiled_step.stats().reason;
    }
    return losses;
  };
  EXPECT_EQ(run(true), run(false));
}

// Nearest reads floor(o / factor) also where the output is twice the input (torch 1.13 gives
// 10 10 10 20 20 30 for a factor of 2.2, with one channel or two; the o / 2 shortcut this test
// asserted before was not what PyTorch computes); bilinear copies an axis whose size stays,
// also where the other axis changes (torch: 0 1 2 3 4 for a [1, 1, 1, 5] row at (2, 1.1)).
TEST(VisionInterpolate, FollowsPyTorch) {
  mt::Tensor row = mt::reshape(mt::tensor(std::vector<float>{10, 20, 30}, {3}), {1, 1, 3});
  mt::Tensor near = mt::interpolate(row, {.scale_factor = {2.2}});
  EXPECT_EQ(near.to_vector<float>(), (std::vector<float>{10, 10, 10, 20, 20, 30}));
  mt::Tensor image = mt::reshape(mt::arange(0.0, 25.0, 1.0, mt::f32), {1, 1, 5, 5});
  mt::Tensor same =
      mt::interpolate(image, {.scale_factor = {1.1}, .mode = mt::InterpolateMode::Bilinear});
  EXPECT_EQ(same.to_vector<float>(), image.to_vector<float>());
  mt::Tensor line = mt::reshape(mt::arange(0.0, 5.0, 1.0, mt::f32), {1, 1, 1, 5});
  mt::Tensor taller =
      mt::interpolate(line, {.scale_factor = {2, 1.1}, .mode = mt::InterpolateMode::Bilinear});
  EXPECT_EQ(taller.to_vector<float>(), (std::vector<float>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4}));
  // Bicubic does not copy such an axis (its weights at 1.1 are not (0, 1, 0, 0)), and overshoots
  // at the edge: torch 1.13's values.
  mt::Tensor cubic =
      mt::interpolate(line, {.scale_factor = {2, 1.1}, .mode = mt::InterpolateMode::Bicubic});
  const std::vector<double> torch_row{-0.031062126, 0.80876720, 1.7248309, 2.6423745, 3.6760664};
  std::vector<double> rows = torch_row;
  rows.insert(rows.end(), torch_row.begin(), torch_row.end());
  expect_near(values(cubic), rows, 1e-6);
  mt::Tensor squares = mt::tensor(std::vector<float>{0, 1, 4, 9}, {1, 1, 1, 4});
  mt::Tensor corners = mt::interpolate(
      squares, {.size = {1, 7}, .mode = mt::InterpolateMode::Bicubic, .align_corners = true});
  EXPECT_EQ(corners.to_vector<float>(),
            (std::vector<float>{0, 0.21875f, 1, 2.125f, 4, 6.78125f, 9}));
}

// A 16-bit image is interpolated in f32 along both axes and rounded once (rounding after each
// axis put the centre one bf16 ulp off and flipped the sign of a bicubic value near zero), and an
// f64 one with positions and weights in double, as PyTorch's opmath: torch 1.13's values.
TEST(VisionInterpolate, RoundsAHalfImageOnceAndWeighsF64InDouble) {
  mt::Tensor a = mt::tensor(std::vector<float>{-1.0859375f, -1.3984375f, 0.404296875f, 0.83984375f},
                            {1, 1, 2, 2}, mt::bf16);
  mt::Tensor linear = mt::interpolate(
      a, {.size = {3, 3}, .mode = mt::InterpolateMode::Bilinear, .align_corners = true});
  EXPECT_EQ(values(linear)[4], -0.310546875f);
  mt::Tensor b =
      mt::tensor(std::vector<float>{0.08642578125f, 0.5390625f, 1.234375f, 0.609375f, -1.734375f,
                                    1.0078125f, -1.2109375f, -0.035888671875f, 1.5546875f},
                 {1, 1, 3, 3}, mt::bf16);
  mt::Tensor cubic = mt::interpolate(
      b, {.size = {5, 5}, .mode = mt::InterpolateMode::Bicubic, .align_corners = true});
  EXPECT_EQ(cubic.dtype(), mt::bf16);
  EXPECT_EQ(values(cubic)[18], 0.0015106201171875f);
  mt::Tensor x = mt::tensor(std::vector<double>{0, 1, 4}, {1, 1, 1, 3}, mt::f64);
  const std::vector<double> torch_cubic{
      -0.10932944606414008, 0.08163265306122625, 0.26530612244897966, 1.0,
      2.3644314868804637,   3.650145772594752,   4.327988338192423};
  std::vector<double> got =
      mt::interpolate(x, {.size = {1, 7}, .mode = mt::InterpolateMode::Bicubic})
          .to_vector<double>();
  ASSERT_EQ(got.size(), torch_cubic.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], torch_cubic[i], 1e-14) << i;
  const std::vector<double> torch_linear{0.0,
                                         0.14285714285714282,
                                         0.5714285714285714,
                                         0.9999999999999999,
                                         2.285714285714285,
                                         3.571428571428571,
                                         4.0};
  got = mt::interpolate(x, {.size = {1, 7}, .mode = mt::InterpolateMode::Bilinear})
            .to_vector<double>();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], torch_linear[i], 1e-14) << i;
}

// unfold's and adaptive_max_pool2d's gradients of a bf16 input add their overlapping windows'
// terms in f32 and round once (they were bf16 sums, up to 8 ulps off), and fold adds a conv
// output under autocast, traced f32 but stored bf16, in f32 too: each the f32 result rounded.
TEST(VisionWideSums, HalfGradientsAndAutocastInputsRoundOnce) {
  mt::Generator gen(17);
  auto rounded_once = [&](const mt::Shape& shape,
                          const std::function<mt::Tensor(const mt::Tensor&)>& op) {
    mt::Tensor half = mt::cast(mt::randn(shape, mt::f32, &gen), mt::bf16).detach();
    mt::Tensor wide = mt::cast(half, mt::f32).detach();
    half.requires_grad_();
    wide.requires_grad_();
    mt::Tensor y = op(half);
    mt::Tensor seed = mt::cast(mt::randn(y.shape(), mt::f32, &gen), mt::bf16);
    mt::sum(mt::cast(y, mt::f32) * mt::cast(seed, mt::f32)).backward();
    mt::sum(op(wide) * mt::cast(seed, mt::f32)).backward();
    EXPECT_EQ(values(y), values(mt::cast(op(wide), mt::bf16)));
    EXPECT_EQ(values(half.grad()), values(mt::cast(wide.grad(), mt::bf16)));
  };
  rounded_once({1, 4, 16, 16}, [](const mt::Tensor& x) { return mt::unfold(x, 7, 1, 3); });
  rounded_once({2, 3, 3, 3}, [](const mt::Tensor& x) {
    return mt::adaptive_max_pool2d(x, {5, 7});
  });
  mt::Tensor x = mt::randn({2, 3, 6, 6}, mt::f32, &gen), w = mt::randn({8, 3, 2, 2}, mt::f32, &gen);
  mt::Tensor folded, stored;
  {
    mt::autocast guard(mt::bf16);
    mt::Tensor c = mt::conv2d(x, w);  // [2, 8, 5, 5], stored bf16
    stored = mt::cast(mt::cast(c, mt::f32), mt::bf16);
    folded = mt::fold(mt::reshape(c, {2, 8, 25}), {6, 6}, 2);
  }
  mt::Tensor once =
      mt::cast(mt::fold(mt::reshape(mt::cast(stored, mt::f32), {2, 8, 25}), {6, 6}, 2), mt::bf16);
  EXPECT_EQ(values(folded), values(once));
}

// A spatial transformer starts from the identity, whose grid points lie on the limits border and
// reflection clip at: there they take no gradient, as PyTorch's (torch 1.13's f32 theta
// gradients; in f64 its CPU kernel's fused multiply-add moves some of these points just inside).
// A NaN grid point reads nothing (bilinear NaN, nearest 0, as torch's zeros padding).
TEST(VisionGridSample, IdentityThetaGradientsAndNanPoints) {
  mt::Tensor x = mt::reshape(mt::arange(1.0, 13.0, 1.0, mt::f32), {1, 1, 3, 4});
  const std::tuple<mt::GridPadding, bool, std::vector<double>> cases[] = {
      {mt::GridPadding::Border, false, {0, 0, 12, 0, 0, 24}},
      {mt::GridPadding::Border, true, {0, 0, 9, 0, 0, 16}},
      {mt::GridPadding::Reflection, false, {0, 0, 12, 0, 0, 24}},
      {mt::GridPadding::Reflection, true, {0, 0, 9, 0, 0, 16}}};
  for (const auto& [padding, align, torch_grad] : cases) {
    mt::Tensor theta = mt::tensor(std::vector<float>{1, 0, 0, 0, 1, 0}, {1, 2, 3});
    theta.requires_grad_();
    mt::Tensor y = mt::grid_sample(x, mt::affine_grid(theta, {1, 1, 3, 4}, align),
                                   {.padding_mode = padding, .align_corners = align});
    mt::sum(y).backward();
    const std::vector<float> image = values(x);
    expect_near(values(y), std::vector<double>(image.begin(), image.end()), 1e-6);
    expect_near(values(theta.grad()), torch_grad, 1e-5);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  mt::Tensor point = mt::tensor(std::vector<float>{nan, 0.0f}, {1, 1, 1, 2});
  EXPECT_TRUE(std::isnan(mt::grid_sample(x, point).item()));
  EXPECT_EQ(mt::grid_sample(x, point, {.mode = mt::GridSampleMode::Nearest}).item(), 0.0);
  const float inf = std::numeric_limits<float>::infinity();
  mt::Tensor far = mt::tensor(std::vector<float>{inf, 0.0f}, {1, 1, 1, 2});
  EXPECT_NO_THROW(mt::grid_sample(x, far, {.padding_mode = mt::GridPadding::Reflection}).item());
}

// The modules of the vision ops run them with the options they were made with; a strided
// convolution with padding 'same' fails when it is made, as torch.nn's.
TEST(VisionModules, UpsamplePixelShuffleAndSamePaddedConvolutions) {
  mt::Generator gen(5);
  mt::Sequential net;
  auto& conv = net.emplace_back<mt::Conv2d>(
      3, 8, mt::Size2{2, 3},
      mt::Conv2dOptions{.padding = mt::Padding::Same, .padding_mode = mt::PadMode::Reflect}, true,
      &gen);
  net.emplace_back<mt::PixelShuffle>(2);
  net.emplace_back<mt::Upsample>(
      mt::InterpolateOptions{.scale_factor = {0.5}, .mode = mt::InterpolateMode::Bicubic});
  net.emplace_back<mt::PixelUnshuffle>(2);
  mt::Tensor x = mt::randn({2, 3, 6, 4}, mt::f32, &gen);
  mt::Tensor y = net(x);
  EXPECT_EQ(y.shape(), (mt::Shape{2, 8, 3, 2}));
  mt::Tensor padded = mt::pad(x, {1, 1, 0, 1}, mt::PadMode::Reflect);
  mt::Tensor by_hand = mt::pixel_unshuffle(
      mt::interpolate(mt::pixel_shuffle(mt::conv2d(padded, conv.weight, conv.bias), 2),
                      {.scale_factor = {0.5}, .mode = mt::InterpolateMode::Bicubic}),
      2);
  EXPECT_EQ(values(y), values(by_hand));
  // Non-overlapping blocks: fold puts back what unfold took; the modules run the functions.
  mt::Unfold patches(mt::Size2{2, 3}, 1, 0, mt::Size2{2, 3});
  mt::Fold image(mt::Size2{6, 6}, mt::Size2{2, 3}, 1, 0, mt::Size2{2, 3});
  mt::Tensor z = mt::randn({2, 3, 6, 6}, mt::f32, &gen);
  EXPECT_EQ(patches(z).shape(), (mt::Shape{2, 18, 6}));
  EXPECT_EQ(values(image(patches(z))), values(z));
  // A SegNet-style round trip: each window's maximum back at its place, zeros elsewhere.
  mt::MaxPool2d down(2);
  mt::MaxUnpool2d up(2);
  mt::ValuesIndices picked = down.with_indices(z);
  EXPECT_EQ(values(picked.values), values(down(z)));
  mt::Tensor restored = up(picked.values, picked.indices);
  EXPECT_EQ(values(restored),
            values(mt::where(mt::interpolate(picked.values, {.scale_factor = {2}}) == z, z,
                             mt::zeros_like(z))));
  mt::AdaptiveMaxPool2d pool(mt::Size2{1, 1});
  EXPECT_EQ(values(pool(z)), values(mt::max(z, {2, 3}, true)));
  EXPECT_MT_ERROR(mt::Conv2d(3, 8, 3, {.stride = 2, .padding = mt::Padding::Same}), "Conv2d",
                  "'same'", "stride 1");
  EXPECT_MT_ERROR(mt::Conv1d(3, 8, 3, {.stride = 2, .padding = mt::Padding::Same}), "Conv1d",
                  "'same'", "stride 1, got stride 2");
  EXPECT_MT_ERROR(mt::conv2d(x, conv.weight, {}, {.stride = {1, 2}, .padding = mt::Padding::Same}),
                  "conv2d", "'same'", "got stride 2");
  EXPECT_MT_ERROR(mt::conv2d(x, mt::zeros({8, 3, 3, 3}), {},
                             {.padding = 6, .padding_mode = mt::PadMode::Reflect}),
                  "pad", "reflect padding (6, 6)", "below its size 4");
}

// ceil_mode windows that reach past the padded input are PyTorch's to take (refused before):
// torch gives max [9, 11, 13, 15] and mean [4.5, 6.5, 8.5, 10.5] for this [1, 1, 2, 8] input.
// avg_pool2d sums half inputs in f32 (7 x 7 bf16 values near 0.5: 0.494 before, torch 0.5).
// instance_norm of one spatial element (its statistics of one value) is refused, as PyTorch's.
TEST(VisionPool, CeilModeWindowsHalfSumsAndOneElementInstanceNorm) {
  mt::Tensor x = mt::reshape(mt::arange(0.0, 16.0, 1.0, mt::f32), {1, 1, 2, 8});
  EXPECT_EQ(mt::max_pool2d(x, {3, 2}, mt::Size2{2, 2}, 0, 1, true).to_vector<float>(),
            (std::vector<float>{9, 11, 13, 15}));
  EXPECT_EQ(mt::avg_pool2d(x, {3, 2}, mt::Size2{2, 2}, 0, true).to_vector<float>(),
            (std::vector<float>{4.5, 6.5, 8.5, 10.5}));
  std::vector<float> near_half(49);
  for (size_t i = 0; i < near_half.size(); ++i)
    near_half[i] = 0.5f + (i % 7 == 0 ? 0.0f : 0.001f * (i % 5));
  mt::Tensor h = mt::cast(mt::tensor(near_half, {1, 1, 7, 7}), mt::bf16);
  double exact = 0;
  for (float v : mt::cast(h, mt::f32).to_vector<float>()) exact += v;
  exact /= 49;
  mt::Tensor pooled = mt::avg_pool2d(h, 7);
  EXPECT_EQ(pooled.dtype(), mt::bf16);
  EXPECT_EQ(mt::cast(pooled, mt::f32).to_vector<float>()[0],
            mt::cast(mt::full({}, exact, mt::f32), mt::bf16).to_vector<float>()[0]);
  EXPECT_MT_ERROR(mt::instance_norm(mt::ones({1, 2, 1, 1})), "instance_norm",
                  "more than one spatial element");
}

}  // namespace
