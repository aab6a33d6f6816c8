// tests/test_ops.cpp -- forward semantics of every op: hand-worked values and a PyTorch oracle.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "mixtape/dsl/half.h"
#include "mixtape/dsl/random.h"
#include "mixtape/dsl/scalar_math.h"
#include "mixtape/mixtape.h"
#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

using mt::OpCode;
using Tensors = std::vector<mt::Tensor>;
using Doubles = std::vector<double>;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

mt::Tensor make(Doubles values, mt::Shape shape, mt::DType dtype = mt::f64) {
  return mt::tensor(values, std::move(shape), dtype);
}
mt::Tensor ints(std::vector<int64_t> values, mt::Shape shape, mt::DType dtype = mt::i64) {
  return mt::tensor(values, std::move(shape), dtype);
}
Doubles values(const mt::Tensor& t) { return t.to_vector<double>(); }
std::vector<int64_t> int_values(const mt::Tensor& t) { return t.to_vector<int64_t>(); }

// Exact comparison in which NaN equals NaN.
void expect_same(const Doubles& got, const Doubles& want, const std::string& what = "") {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << what << " [" << i << "]: got " << got[i];
    } else {
      EXPECT_EQ(got[i], want[i]) << what << " [" << i << "]";
    }
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const mt::Error& e) {
    return e.what();
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Hand-worked semantics

TEST(Broadcasting, FollowsNumpyRules) {
  mt::Tensor c = make({1, 2, 3}, {3, 1}) + make({10, 20, 30, 40}, {4});
  EXPECT_EQ(c.shape(), (mt::Shape{3, 4}));
  expect_same(values(c), {11, 21, 31, 41, 12, 22, 32, 42, 13, 23, 33, 43});

  // [2,1,3] * [4,1] -> [2,4,3] with out[i,j,k] = x[i,0,k] * y[j,0].
  Doubles x = {1, 2, 3, 4, 5, 6}, y = {1, 10, 100, 1000};
  mt::Tensor p = make(x, {2, 1, 3}) * make(y, {4, 1});
  ASSERT_EQ(p.shape(), (mt::Shape{2, 4, 3}));
  Doubles got = values(p);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 3; ++k) EXPECT_EQ(got[(i * 4 + j) * 3 + k], x[i * 3 + k] * y[j]);

  mt::Tensor s = mt::scalar(2, mt::f64) - make({1, 2, 3, 4}, {2, 2});
  EXPECT_EQ(s.shape(), (mt::Shape{2, 2}));
  expect_same(values(s), {1, 0, -1, -2});

  mt::Tensor empty = make({}, {0, 3}) + make({1, 2, 3}, {3});
  EXPECT_EQ(empty.shape(), (mt::Shape{0, 3}));

  mt::Tensor w = mt::where(mt::tensor(std::vector<int64_t>{1, 0}, {2, 1}, mt::boolean),
                           make({1, 2, 3}, {3}), mt::scalar(-1, mt::f64));
  EXPECT_EQ(w.shape(), (mt::Shape{2, 3}));
  expect_same(values(w), {1, 2, 3, -1, -1, -1});

  mt::Tensor m = mt::matmul(mt::zeros({2, 1, 3, 4}, mt::f64), mt::zeros({5, 4, 6}, mt::f64));
  EXPECT_EQ(m.shape(), (mt::Shape{2, 5, 3, 6}));

  std::string msg = error_of([] { mt::add(make({1, 2, 3}, {3}), make({1, 2, 3, 4}, {4})); });
  EXPECT_NE(msg.find("add"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4]"), std::string::npos) << msg;
  EXPECT_THROW(mt::matmul(mt::zeros({2, 3, 4}), mt::zeros({3, 4, 5})), mt::Error);
}

TEST(NanPropagation, MaximumMinimumMaxMinRelu) {
  for (mt::DType dt : {mt::f32, mt::f64}) {
    SCOPED_TRACE(std::string(mt::name(dt)));
    mt::Tensor a = make({kNan, 1, 2, kNan}, {4}, dt), b = make({0, kNan, 1, kNan}, {4}, dt);
    expect_same(values(mt::maximum(a, b)), {kNan, kNan, 2, kNan}, "maximum");
    expect_same(values(mt::minimum(a, b)), {kNan, kNan, 1, kNan}, "minimum");
    mt::Tensor x = make({1, kNan, 3, 2, 3, 1}, {2, 3}, dt);
    expect_same(values(mt::max(x, {1})), {kNan, 3}, "max rows");
    expect_same(values(mt::min(x, {1})), {kNan, 1}, "min rows");
    expect_same(values(mt::max(x, {0})), {2, kNan, 3}, "max columns");
    expect_same(values(mt::max(x)), {kNan}, "max all");
    // Like torch.argmax: a NaN is the maximum, and the first NaN wins.
    EXPECT_EQ(int_values(mt::argmax(make({1, 3, kNan, kNan}, {4}, dt))), (std::vector<int64_t>{2}));
    expect_same(values(mt::relu(make({kNan, -1, 2}, {3}, dt))), {kNan, 0, 2}, "relu");
  }
}

TEST(Argmax, FirstOccurrenceOnTies) {
  for (mt::DType dt : {mt::f32, mt::f64, mt::i32, mt::i64}) {
    SCOPED_TRACE(std::string(mt::name(dt)));
    mt::Tensor x = make({2, 7, 7, 4, 4, 1}, {2, 3}, dt);
    mt::Tensor rows = mt::argmax(x, 1);
    EXPECT_EQ(rows.dtype(), mt::i64);
    EXPECT_EQ(int_values(rows), (std::vector<int64_t>{1, 0}));
    EXPECT_EQ(int_values(mt::argmax(x, 0)), (std::vector<int64_t>{1, 0, 0}));
    EXPECT_EQ(int_values(mt::argmax(x, -1)), (std::vector<int64_t>{1, 0}));
    EXPECT_EQ(int_values(mt::argmax(x)), (std::vector<int64_t>{1}));
    EXPECT_EQ(mt::argmax(x, 1, true).shape(), (mt::Shape{2, 1}));
    mt::Tensor flat = mt::argmax(x, std::nullopt, true);
    EXPECT_EQ(flat.shape(), (mt::Shape{1, 1}));
    EXPECT_EQ(int_values(mt::argmax(make({5, 5, 5}, {3}, dt))), (std::vector<int64_t>{0}));
  }
}

TEST(IntegerOps, KeepTheirDtypeAndSumsWidenToI64) {
  mt::Tensor a = ints({-3, 7, 2147483647, -5}, {4}, mt::i32);
  mt::Tensor b = ints({4, -2, 0, 5}, {4}, mt::i32);
  mt::Tensor sum = a + b;
  EXPECT_EQ(sum.dtype(), mt::i32);
  EXPECT_EQ(int_values(sum), (std::vector<int64_t>{1, 5, 2147483647, 0}));
  EXPECT_EQ(int_values(a * b), (std::vector<int64_t>{-12, -14, 0, -25}));
  EXPECT_EQ(int_values(a - b), (std::vector<int64_t>{-7, 9, 2147483647, -10}));
  EXPECT_EQ(int_values(-a), (std::vector<int64_t>{3, -7, -2147483647, 5}));
  EXPECT_EQ(int_values(mt::abs(a)), (std::vector<int64_t>{3, 7, 2147483647, 5}));
  EXPECT_EQ(int_values(mt::sign(a)), (std::vector<int64_t>{-1, 1, 1, -1}));
  EXPECT_EQ(int_values(mt::relu(a)), (std::vector<int64_t>{0, 7, 2147483647, 0}));
  EXPECT_EQ(int_values(mt::square(b)), (std::vector<int64_t>{16, 4, 0, 25}));
  EXPECT_EQ((a * 2).dtype(), mt::i32);
  // Two's complement wrap-around, as in C++20 and PyTorch: 70000^2 mod 2^32.
  EXPECT_EQ(int_values(ints({70000}, {1}, mt::i32) * ints({70000}, {1}, mt::i32)),
            (std::vector<int64_t>{605032704}));

  mt::Tensor total = mt::sum(ints({2147483647, 2147483647, 5}, {3}, mt::i32));
  EXPECT_EQ(total.dtype(), mt::i64);
  EXPECT_EQ(int_values(total), (std::vector<int64_t>{4294967299}));
  EXPECT_EQ(mt::sum(a, {0}).dtype(), mt::i64);
  EXPECT_EQ(int_values(mt::max(a)), (std::vector<int64_t>{2147483647}));

  mt::Tensor big = ints({3000000000, -4}, {2}) * ints({3, 5}, {2});
  EXPECT_EQ(big.dtype(), mt::i64);
  EXPECT_EQ(int_values(big), (std::vector<int64_t>{9000000000, -20}));
  EXPECT_EQ((a + ints({1, 1, 1, 1}, {4})).dtype(), mt::i64);
  mt::Tensor half = a + 0.5;
  EXPECT_EQ(half.dtype(), mt::f32);
  EXPECT_EQ(values(half)[0], -2.5);

  EXPECT_THROW(mt::div(a, b), mt::Error);
  EXPECT_THROW(mt::mean(a), mt::Error);
  EXPECT_THROW(mt::exp(a), mt::Error);
  // Bool counts as integers in sums.
  mt::Tensor positives = mt::sum(mt::gt(a, ints({0}, {1}, mt::i32)));
  EXPECT_EQ(positives.dtype(), mt::i64);
  EXPECT_EQ(int_values(positives), (std::vector<int64_t>{2}));
}

TEST(BoolOps, ComparisonsAndWhere) {
  mt::Tensor x = make({1, 2, 3, 4}, {4}), y = make({4, 2, 1, 4}, {4});
  struct Case {
    const char* name;
    mt::Tensor got;
    std::vector<bool> want;
  };
  std::vector<Case> cases = {{"eq", mt::eq(x, y), {0, 1, 0, 1}}, {"ne", mt::ne(x, y), {1, 0, 1, 0}},
                             {"lt", mt::lt(x, y), {1, 0, 0, 0}}, {"le", mt::le(x, y), {1, 1, 0, 1}},
                             {"gt", mt::gt(x, y), {0, 0, 1, 0}}, {"ge", mt::ge(x, y), {0, 1, 1, 1}},
                             {"<", x < y, {1, 0, 0, 0}},         {">=", x >= 2.5, {0, 0, 1, 1}}};
  for (const Case& c : cases) {
    EXPECT_EQ(c.got.dtype(), mt::boolean) << c.name;
    EXPECT_EQ(c.got.to_vector<bool>(), c.want) << c.name;
  }
  expect_same(values(mt::where(mt::lt(x, y), x, y)), {1, 2, 1, 4});
  mt::Tensor wi = mt::where(mt::gt(x, y), ints({1, 2, 3, 4}, {4}), ints({-1}, {1}));
  EXPECT_EQ(wi.dtype(), mt::i64);
  EXPECT_EQ(int_values(wi), (std::vector<int64_t>{-1, -1, 3, -1}));
  EXPECT_THROW(mt::where(x, x, y), mt::Error);  // the condition must be bool
  EXPECT_THROW(mt::add(mt::eq(x, y), mt::eq(x, y)), mt::Error);
}

TEST(Slice, NegativeClampedAndStepped) {
  mt::Tensor x = mt::arange(10);
  auto slice = [&](int64_t start, int64_t stop, int64_t step) {
    return int_values(mt::slice(x, 0, start, stop, step));
  };
  EXPECT_EQ(slice(-3, 100, 1), (std::vector<int64_t>{7, 8, 9}));
  EXPECT_EQ(slice(1, 8, 3), (std::vector<int64_t>{1, 4, 7}));
  EXPECT_EQ(slice(-100, 2, 1), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(slice(2, 9, 4), (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(slice(0, 10, 20), (std::vector<int64_t>{0}));
  EXPECT_EQ(slice(-4, -1, 2), (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(mt::slice(x, 0, 5, 2).shape(), (mt::Shape{0}));
  EXPECT_THROW(mt::slice(x, 0, 0, 5, 0), mt::Error);
  EXPECT_THROW(mt::slice(x, 0, 5, 0, -1), mt::Error);
  EXPECT_THROW(mt::slice(x, 1, 0, 5), mt::Error);

  mt::Tensor m = mt::reshape(mt::arange(12), {3, 4});
  mt::Tensor cols = mt::slice(m, -1, 1, -1);
  EXPECT_EQ(cols.shape(), (mt::Shape{3, 2}));
  EXPECT_EQ(int_values(cols), (std::vector<int64_t>{1, 2, 5, 6, 9, 10}));
  EXPECT_EQ(int_values(mt::slice(m, 0, -2, 3)), (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(int_values(mt::slice(m, {0, 1}, {2, 2}, {2, 2})), (std::vector<int64_t>{1, 3, 9, 11}));
  EXPECT_THROW(mt::slice(m, {0, 1}, {2, 2}, {2, 3}), mt::Error);  // 1 + 2*2 is past 4 columns
  expect_same(values(mt::unslice(make({1, 2}, {2}), {1}, {2}, {5})), {0, 1, 0, 2, 0});
}

// torch.split and torch.chunk: pieces along an axis, views of the input.
TEST(SplitChunk, PiecesAsPyTorchCutsThem) {
  mt::Tensor m = mt::reshape(mt::arange(14), {2, 7});
  auto shapes = [](const std::vector<mt::Tensor>& pieces) {
    std::vector<mt::Shape> out;
    for (const mt::Tensor& p : pieces) out.push_back(p.shape());
    return out;
  };
  std::vector<mt::Tensor> by3 = mt::split(m, 3, 1);
  EXPECT_EQ(shapes(by3), (std::vector<mt::Shape>{{2, 3}, {2, 3}, {2, 1}}));
  EXPECT_EQ(int_values(by3[2]), (std::vector<int64_t>{6, 13}));
  std::vector<mt::Tensor> sized = mt::split(m, std::vector<int64_t>{1, 0, 6}, -1);
  EXPECT_EQ(shapes(sized), (std::vector<mt::Shape>{{2, 1}, {2, 0}, {2, 6}}));
  EXPECT_EQ(int_values(sized[0]), (std::vector<int64_t>{0, 7}));
  // torch.chunk(7, 3): pieces of ceil(7 / 3) = 3; chunk(7, 4): pieces of 2, so 4 of them.
  EXPECT_EQ(shapes(mt::chunk(m, 3, 1)), (std::vector<mt::Shape>{{2, 3}, {2, 3}, {2, 1}}));
  EXPECT_EQ(shapes(mt::chunk(m, 4, 1)), (std::vector<mt::Shape>{{2, 2}, {2, 2}, {2, 2}, {2, 1}}));
  EXPECT_EQ(shapes(mt::chunk(m, 5, 0)), (std::vector<mt::Shape>{{1, 7}, {1, 7}}));
  EXPECT_THROW(mt::split(m, 0, 1), mt::Error);
  EXPECT_THROW(mt::split(m, std::vector<int64_t>{3, 3}, 1), mt::Error);
  EXPECT_THROW(mt::split(m, 2, 2), mt::Error);
  EXPECT_THROW(mt::chunk(m, 0, 1), mt::Error);
  // Each piece's gradient lands on its own part of the input.
  mt::Tensor x = mt::tensor(std::vector<double>{1, 2, 3, 4, 5}, {5}).requires_grad_(true);
  std::vector<mt::Tensor> parts = mt::split(x, 2);
  (mt::sum(parts[0]) + 10.0 * mt::sum(parts[2])).backward();
  expect_same(values(x.grad()), {1, 1, 0, 0, 10});
}

// What a review against torch 1.13 found: chunk of an empty axis gives `chunks` empty pieces
// (it gave one); einsum with a size-0 axis against a missing or size-1 one gives the empty
// result (a broadcast_to error) and takes integers, summed exactly in their type (matmul refused
// them); flip refuses an axis named twice (it flipped back silently); argmax/argmin of a 0-d
// tensor take axis 0 and -1; roll with no axes rolls the flattened tensor; an unsigned operand
// beyond int64 is an error (it wrapped to a negative number).
TEST(Ops, EdgeCasesAsTorchHasThem) {
  auto shapes = [](const std::vector<mt::Tensor>& pieces) {
    std::vector<mt::Shape> out;
    for (const mt::Tensor& p : pieces) out.push_back(p.shape());
    return out;
  };
  EXPECT_EQ(shapes(mt::chunk(mt::ones({0, 2}), 3)),
            (std::vector<mt::Shape>{{0, 2}, {0, 2}, {0, 2}}));
  EXPECT_EQ(mt::einsum("ij,jk->ik", {mt::ones({2, 3}), mt::ones({3, 0})}).shape(),
            (mt::Shape{2, 0}));
  EXPECT_EQ(mt::einsum("ij,jk->ik", {mt::ones({0, 3}), mt::ones({3, 2})}).shape(),
            (mt::Shape{0, 2}));
  mt::Tensor i_empty = mt::einsum("ij,j->i", {mt::ones({3, 0}), mt::ones({1})});
  EXPECT_EQ(i_empty.shape(), (mt::Shape{3}));
  expect_same(values(i_empty), {0, 0, 0});
  // Beyond 2^53, where an f64 product would round: (2^53 + 1) * 3 + 1 * 2.
  const int64_t big = (int64_t{1} << 53) + 1;
  mt::Tensor a = mt::tensor(std::vector<int64_t>{big, 1}, {1, 2}),
             b = mt::tensor(std::vector<int64_t>{3, 2}, {2, 1});
  mt::Tensor product = mt::einsum("ij,jk->ik", {a, b});
  EXPECT_EQ(product.dtype(), mt::i64);
  EXPECT_EQ(int_values(product), (std::vector<int64_t>{big * 3 + 2}));
  mt::Tensor a32 = mt::tensor(std::vector<int32_t>{1, 2, 3, 4}, {2, 2}, mt::i32);
  mt::Tensor trace_product = mt::einsum("ij,ji->", {a32, a32});  // 1 + 2*3*2 + 16 = 29
  EXPECT_EQ(trace_product.dtype(), mt::i32);
  EXPECT_EQ(int_values(trace_product), (std::vector<int64_t>{29}));
  mt::Tensor row = make({1, 2, 3}, {3});
  EXPECT_MT_ERROR(mt::flip(row, {0, 0}), "flip", "axis 0 appears twice");
  EXPECT_MT_ERROR(mt::flip(row, {0, -1}), "flip", "appears twice");
  expect_same(values(mt::flip(row, {-1})), {3, 2, 1});
  for (int64_t axis : {0, -1}) {
    EXPECT_EQ(int_values(mt::argmax(mt::scalar(1.0), axis)), (std::vector<int64_t>{0}));
    EXPECT_EQ(int_values(mt::argmin(mt::scalar(1.0), axis, true)), (std::vector<int64_t>{0}));
  }
  EXPECT_MT_ERROR(mt::argmin(mt::scalar(1.0), 1), "argmin", "out of range");
  EXPECT_MT_ERROR(mt::argmax(mt::scalar(1.0), -2), "argmax", "out of range");
  mt::Tensor m = mt::reshape(mt::arange(6), {2, 3});
  EXPECT_EQ(int_values(mt::roll(m, {1}, {})), (std::vector<int64_t>{5, 0, 1, 2, 3, 4}));
  EXPECT_EQ(mt::roll(m, {-2}, {}).shape(), (mt::Shape{2, 3}));
  EXPECT_EQ(int_values(mt::roll(m, {-2}, {})), (std::vector<int64_t>{2, 3, 4, 5, 0, 1}));
  EXPECT_MT_ERROR(row + (uint64_t{1} << 63), "does not fit in int64");
  EXPECT_MT_ERROR(row * std::numeric_limits<uint64_t>::max(), "does not fit in int64");
  expect_same(values(row + uint64_t{2}), {3, 4, 5});
}

// binary_cross_entropy_with_logits' gradient is (sigmoid(x) - y) / n, finite for confident
// logits too (their log1p branch must not divide by zero in the backward pass).
TEST(BceWithLogits, ConfidentLogitsHaveFiniteGradients) {
  for (mt::DType dt : {mt::f32, mt::f64}) {
    mt::Tensor x = make({0.5, 10, 20, -20, 40}, {5}, dt).requires_grad_(true);
    mt::Tensor y = make({1, 1, 1, 0, 1}, {5}, dt);
    mt::binary_cross_entropy_with_logits(x, y).backward();
    std::vector<double> grad = values(x.grad()), xs = {0.5, 10, 20, -20, 40}, ys = {1, 1, 1, 0, 1};
    for (size_t i = 0; i < grad.size(); ++i) {
      double want = (1 / (1 + std::exp(-xs[i])) - ys[i]) / 5;
      EXPECT_NEAR(grad[i], want, 1e-7) << mt::name(dt) << " element " << i;
    }
  }
}

// Confident predictions keep their gradient's digits, as PyTorch's sigmoid(x) - y: a negative
// logit with target 0 (most labels of a multi-label model) took 1 - 1 + sigmoid(x) in f32, which
// lost 28% at x = -17 and all of it at -20. With pos_weight p: (p y + 1 - y) sigmoid(x) - p y.
TEST(BceWithLogits, ConfidentPredictionsKeepTheirGradientsDigits) {
  const std::vector<double> xs = {-12, -15, -17, -20, -30, 0, 12, 15, 17, 3};
  const std::vector<double> ys = {0, 0, 0, 0, 0, 0, 1, 1, 1, 0.25};
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "pos_weight" : "plain");
    mt::Tensor x = make(xs, {10}, mt::f32).requires_grad_(true);
    mt::Tensor y = make(ys, {10}, mt::f32);
    mt::BceWithLogitsOptions options{.reduction = mt::Reduction::Sum};
    if (weighted) options.pos_weight = mt::full({10}, 3.0);
    mt::Tensor loss = mt::binary_cross_entropy_with_logits(x, y, options);
    loss.backward();
    std::vector<double> grad = values(x.grad()),
                        each = values(mt::binary_cross_entropy_with_logits(x.detach(), y, [&] {
                          mt::BceWithLogitsOptions o = options;
                          o.reduction = mt::Reduction::None;
                          return o;
                        }()));
    const double p = weighted ? 3 : 1;
    for (size_t i = 0; i < xs.size(); ++i) {
      const double s = 1 / (1 + std::exp(-xs[i])), l = 1 + (p - 1) * ys[i];
      const double want = (p * ys[i] + 1 - ys[i]) * s - p * ys[i];
      EXPECT_NEAR(grad[i], want, 2e-7 * std::abs(want) + 1e-30) << "x = " << xs[i];
      // The loss keeps its digits too: (1 - y) x + l log(1 + e^-x), as l log(1 + e^x) - p y x
      // below zero, where the first form cancels in doubles as well.
      const double loss_want = xs[i] < 0 ? l * std::log1p(std::exp(xs[i])) - p * ys[i] * xs[i]
                                         : (1 - ys[i]) * xs[i] + l * std::log1p(std::exp(-xs[i]));
      EXPECT_NEAR(each[i], loss_want, 4e-7 * std::abs(loss_want) + 1e-30) << "x = " << xs[i];
    }
  }
  // Infinite and NaN logits give what PyTorch's do, with a finite gradient elsewhere.
  mt::Tensor x = make({-kInf, kInf, kNan, 1}, {4}, mt::f32).requires_grad_(true);
  mt::Tensor y = make({1, 0, 0, 1}, {4}, mt::f32);
  mt::binary_cross_entropy_with_logits(x, y, {.reduction = mt::Reduction::Sum}).backward();
  std::vector<double> grad = values(x.grad());
  EXPECT_NEAR(grad[3], 1 / (1 + std::exp(-1.0)) - 1, 1e-7);
  EXPECT_EQ(values(mt::binary_cross_entropy_with_logits(x.detach(), y,
                                                        {.reduction = mt::Reduction::None}))[1],
            kInf);
}

// std_dev of 16-bit inputs too, whole: the variance rounded to f16 overflowed above 256^2.
TEST(Reductions, HalfStandardDeviationComputesInF32) {
  mt::Tensor x = make({300, -300, 290, -290}, {4}, mt::f16).requires_grad_(true);
  mt::Tensor s = mt::std_dev(x);
  EXPECT_NEAR(values(s)[0], 340.75, 0.5);
  s.backward();
  EXPECT_NEAR(values(x.grad())[0], 0.2935, 1e-3);
  EXPECT_NEAR(values(mt::std_dev(make({200, -200, 190, -190}, {4}, mt::bf16)))[0], 225.0, 0.5);
}

// Infinite logits: the targets' gradient is -x there, as PyTorch's (0 * inf made it NaN), and a
// cross_entropy row holding +inf is NaN, as log_softmax's and PyTorch's (it was inf).
TEST(BceWithLogits, InfiniteLogitsGiveTheTargetsTheirGradient) {
  mt::Tensor x = make({kInf, -kInf}, {2}, mt::f32);
  mt::Tensor t = make({0.5, 0.5}, {2}, mt::f32).requires_grad_(true);
  mt::sum(mt::binary_cross_entropy_with_logits(x, t, {.reduction = mt::Reduction::None}))
      .backward();
  expect_same(values(t.grad()), {-kInf, kInf});
  mt::Tensor logits = make({kInf, 1, 2}, {1, 3}, mt::f32).requires_grad_(true);
  mt::Tensor loss = mt::cross_entropy(logits, ints({1}, {1}));
  EXPECT_TRUE(std::isnan(values(loss)[0]));
}

// Variances of 16-bit inputs are computed in f32 and rounded once, as PyTorch's: f16 squares of
// deviations of 200 overflowed where the variance, 40000, fits.
TEST(Reductions, HalfVarianceComputesInF32) {
  for (mt::DType dt : {mt::f16, mt::bf16}) {
    mt::Tensor x = make({-200, 200, -200, 200}, {4}, dt);
    EXPECT_EQ(values(mt::var(x, {}, false, 0))[0], values(make({40000}, {1}, dt))[0])
        << mt::name(dt);
    EXPECT_EQ(mt::var(x).dtype(), dt);
    EXPECT_NEAR(values(mt::std_dev(x))[0], 230.9, 0.5) << mt::name(dt);  // Bessel-corrected
  }
}

// A mean over no elements is NaN, as PyTorch's, and so are the losses of an empty batch.
TEST(Reductions, MeanOfNothingIsNaN) {
  EXPECT_TRUE(std::isnan(values(mt::mean(mt::zeros({0})))[0]));
  EXPECT_EQ(mt::mean(mt::zeros({0, 3}), {0}).shape(), mt::Shape{3});
  for (double v : values(mt::mean(mt::zeros({0, 3}), {0}))) EXPECT_TRUE(std::isnan(v));
  mt::Tensor empty = mt::zeros({0, 3});
  EXPECT_TRUE(std::isnan(values(mt::mse_loss(empty, empty))[0]));
  EXPECT_TRUE(std::isnan(values(mt::l1_loss(empty, empty))[0]));
  EXPECT_TRUE(std::isnan(values(mt::binary_cross_entropy_with_logits(empty, empty))[0]));
  EXPECT_TRUE(std::isnan(values(mt::var(mt::zeros({0})))[0]));
}

// A row holding +inf: softmax and log_softmax give NaN throughout, as PyTorch's (the shift that
// keeps an all -inf row from NaN took +inf too, which gave [nan, 0, 0]); logsumexp gives inf.
TEST(Softmax, ARowHoldingInfinityIsNaNAndItsLogSumExpInfinite) {
  mt::Tensor x = make({kInf, 1, 2, 0, 1, 2}, {2, 3}, mt::f32);
  std::vector<double> p = values(mt::softmax(x, -1)), lp = values(mt::log_softmax(x, -1));
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::isnan(p[i])) << i;
    EXPECT_TRUE(std::isnan(lp[i])) << i;
    EXPECT_FALSE(std::isnan(p[3 + i])) << i;
  }
  EXPECT_EQ(values(mt::logsumexp(x, {-1}))[0], kInf);
  std::vector<double> all_masked = values(mt::softmax(make({-kInf, -kInf}, {2}, mt::f32), -1));
  EXPECT_TRUE(std::isnan(all_masked[0]));
}

// Integers above 2^53 are compared and added as integers: through doubles 2^53 + 1 was 2^53
// (argmax picked the first of two "equal" values; scatter_add rounded elements it did not touch).
TEST(Integers, ArgmaxAndScatterAddKeepEverySixtyFourBitValue) {
  const int64_t big = (int64_t{1} << 53) + 1;
  auto i64 = [](std::vector<int64_t> v) {
    const int64_t n = static_cast<int64_t>(v.size());
    return mt::tensor(std::move(v), {n});
  };
  EXPECT_EQ(mt::argmax(i64({big - 1, big})).item(), 1);
  EXPECT_EQ(mt::argmax(i64({-1, INT64_MAX - 1, INT64_MAX})).item(), 2);
  EXPECT_EQ(mt::scatter_add(i64({big, 5}), i64({1}), i64({1}), 0).to_vector<int64_t>(),
            (std::vector<int64_t>{big, 6}));
  EXPECT_EQ(mt::index_add(i64({big, 5}), i64({1}), i64({1}), 0).to_vector<int64_t>(),
            (std::vector<int64_t>{big, 6}));
}

// Integer numbers an integer tensor's type cannot hold: exact, as PyTorch's, where the fills went
// through a double and wrapped (INT64_MAX's double, 2^63, became INT64_MIN) or now refused.
TEST(Integers, NumbersBeyondATensorsTypeAreExact) {
  const mt::Tensor small = mt::tensor(std::vector<int32_t>{1, 2, -5}, {3}, mt::i32);
  EXPECT_EQ(mt::clamp(small, -1e10, std::nullopt).to_vector<int32_t>(),
            (std::vector<int32_t>{1, 2, -5}));
  EXPECT_EQ(mt::clamp(small, std::nullopt, 1e19).dtype(), mt::i32);
  EXPECT_EQ(mt::clamp(small, 0.0, 1.0).to_vector<int32_t>(), (std::vector<int32_t>{1, 1, 0}));
  // Compared as integers, not through f32 (16777217 was above no f32 bound of 16777216).
  EXPECT_EQ(mt::clamp(mt::tensor(std::vector<int32_t>{16777217, 5}, {2}, mt::i32), std::nullopt,
                      16777216.0)
                .to_vector<int32_t>(),
            (std::vector<int32_t>{16777216, 5}));
  EXPECT_EQ(
      mt::clamp(mt::tensor(std::vector<int64_t>{(int64_t{1} << 53) + 1, 100000001}, {2}), 0.0, 1e8)
          .to_vector<int64_t>(),
      (std::vector<int64_t>{100000000, 100000000}));
  EXPECT_EQ((small < int64_t{3000000000}).to_vector<bool>(), (std::vector<bool>{true, true, true}));
  EXPECT_EQ((small == int64_t{-3000000000}).to_vector<bool>(),
            (std::vector<bool>{false, false, false}));
  const mt::Tensor cond = mt::tensor(std::vector<bool>{true, false}, {2});
  const mt::Tensor ids = mt::tensor(std::vector<int64_t>{7, 8}, {2});
  EXPECT_EQ(mt::where(cond, ids, INT64_MAX).to_vector<int64_t>(),
            (std::vector<int64_t>{7, INT64_MAX}));
  EXPECT_EQ(mt::where(cond, int64_t{0}, INT64_MAX).to_vector<int64_t>(),
            (std::vector<int64_t>{0, INT64_MAX}));
  const int64_t big = (int64_t{1} << 60) + 1;
  EXPECT_EQ(mt::full_integer({2}, big).to_vector<int64_t>(), (std::vector<int64_t>{big, big}));
}

// A 0-d operand beside one with dimensions counts only when its category (bool < integer <
// floating) is higher, as torch.result_type: an f16 activation times a 0-d f32 stayed f32.
TEST(Promotion, ZeroDimensionalOperandsFollowTorchsCategories) {
  mt::Tensor h = make({1, 2, 3}, {3}, mt::f16), b = make({1, 2, 3}, {3}, mt::bf16);
  mt::Tensor f = make({1, 2, 3}, {3}, mt::f32), i = ints({1, 2, 3}, {3}, mt::i32);
  mt::Tensor yes = mt::tensor(std::vector<bool>{true, false, true}, {3});
  const std::vector<std::pair<mt::Tensor, mt::DType>> cases = {
      {h * mt::scalar(0.5), mt::f16},
      {mt::add(f, mt::scalar(2, mt::f64)), mt::f32},
      {mt::add(i, mt::scalar(2, mt::i64)), mt::i32},
      {mt::add(h, mt::scalar(2, mt::bf16)), mt::f16},
      {mt::where(yes, b, mt::scalar(2, mt::f32)), mt::bf16},
      {mt::pow(h, mt::scalar(2, mt::f32)), mt::f16},
      // A higher category wins, in the 0-d operand's type.
      {mt::add(i, mt::scalar(2.5, mt::f64)), mt::f64},
      {mt::add(i, mt::scalar(2, mt::f16)), mt::f16},
      {mt::add(yes, mt::scalar(2, mt::i32)), mt::i32},
      // Operands alike in rank promote as before.
      {mt::add(mt::scalar(1, mt::f16), mt::scalar(2, mt::f32)), mt::f32},
      {mt::add(h, f), mt::f32},
  };
  for (size_t k = 0; k < cases.size(); ++k)
    EXPECT_EQ(cases[k].first.dtype(), cases[k].second) << "case " << k;
  expect_same(values(h * mt::scalar(0.5)), {0.5, 1, 1.5});
}

// == and != compare elementwise, as PyTorch's: `ids != 0` is the padding mask a user writes.
TEST(Operators, EqualityComparesElementwise) {
  mt::Tensor ids = ints({0, 3, 0, 5}, {4});
  mt::Tensor mask = ids != 0;
  EXPECT_EQ(mask.dtype(), mt::boolean);
  expect_same(values(mask), {0, 1, 0, 1});
  expect_same(values(0 == ids), {1, 0, 1, 0});
  expect_same(values(make({1, kNan}, {2}, mt::f32) == make({1, kNan}, {2}, mt::f32)), {1, 0});
  expect_same(values(make({1, kNan}, {2}, mt::f32) != make({1, kNan}, {2}, mt::f32)), {0, 1});
  // Integers beyond 2^53 compare and add exactly (the number went through a double).
  const int64_t big = (int64_t{1} << 53) + 1;
  mt::Tensor wide = ints({big - 1, big}, {2});
  expect_same(values(wide == big), {0, 1});
  expect_same(values(wide != big), {1, 0});
  EXPECT_EQ(int_values(wide - big), (std::vector<int64_t>{-1, 0}));
}

// Class-probability targets take a negative ignore_index (it selects no class) and refuse one
// that names a class, as PyTorch's check.
TEST(CrossEntropy, ProbabilityTargetsRefuseOnlyAnIgnoreIndexOfAClass) {
  mt::Tensor x = make({1, 2, 3, 3, 1, 0}, {2, 3}, mt::f32);
  mt::Tensor p = make({0.2, 0.3, 0.5, 1, 0, 0}, {2, 3}, mt::f32);
  EXPECT_EQ(values(mt::cross_entropy(x, p, {.ignore_index = -1})), values(mt::cross_entropy(x, p)));
  EXPECT_MT_ERROR(mt::cross_entropy(x, p, {.ignore_index = 0}), "ignore_index (0)");
}

// Embedding's padding_idx, as torch's: the row starts at zeros and gets no gradient from the
// places that read it (the others' gradients are summed as before); negative counts from the end.
TEST(Embedding, PaddingRowStartsAtZeroAndGetsNoGradient) {
  mt::Generator gen(2);
  mt::Embedding table(5, 3, &gen, -1);
  ASSERT_EQ(table.padding_idx, 4);
  std::vector<double> w = values(table.weight);
  for (int i = 12; i < 15; ++i) EXPECT_EQ(w[i], 0.0);
  EXPECT_NE(w[0], 0.0);
  mt::Tensor ids = ints({4, 1, 4, 1, 0}, {5});
  mt::sum(table(ids) * make({1, 2, 3, 4, 5}, {5, 1}, mt::f32)).backward();
  std::vector<double> g = values(table.weight.grad());
  expect_same(g, {5, 5, 5, 6, 6, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  EXPECT_THROW(mt::Embedding(5, 3, nullptr, 5), mt::Error);
  // torch's Embedding(10, 4, 0) means padding_idx 0; here the 0 would be a null generator.
  static_assert(!std::is_constructible_v<mt::Embedding, int64_t, int64_t, int>);
  EXPECT_THROW(mt::Embedding(5, 3, nullptr, -6), mt::Error);
  EXPECT_THROW(mt::embedding(table.weight, ids, 7), mt::Error);
}

// LSTM and GRU refuse an empty sequence by name, and LSTM an h0 without its c0 (torch takes
// them as one tuple); "stack: needs at least one tensor" and zeros for c0 were the answers.
TEST(Recurrent, EmptySequencesAndHalfAnInitialStateAreRefused) {
  mt::LSTM lstm(2, 3, 1, true, true);
  mt::GRU gru(2, 3);
  EXPECT_MT_ERROR(lstm(mt::zeros({4, 0, 2})), "LSTM", "at least one step", "[4, 0, 2]");
  EXPECT_MT_ERROR(gru(mt::zeros({0, 2})), "GRU", "at least one step");
  EXPECT_MT_ERROR(lstm(mt::zeros({4, 5, 2}), mt::zeros({1, 4, 3})), "LSTM", "h0 and c0 together");
  EXPECT_MT_ERROR(lstm(mt::zeros({4, 5, 2}), mt::Tensor(), mt::zeros({1, 4, 3})), "only c0");
  // Integer inputs are refused, as torch refuses them (they were multiplied by the weights).
  EXPECT_MT_ERROR(lstm(mt::zeros({4, 5, 2}, mt::i64)), "LSTM", "floating-point", "i64");
  EXPECT_MT_ERROR(gru(mt::zeros({5, 2}, mt::i32)), "GRU", "floating-point", "i32");
  mt::MultiheadAttention mha(4, 2);
  mt::Tensor ids = mt::zeros({3, 1, 4}, mt::i64);
  EXPECT_MT_ERROR(mha(ids, ids, ids), "MultiheadAttention", "floating-point", "i64");
  // Bidirectional: the reverse direction's weights after the forward one's, as torch's names.
  mt::GRU both(2, 3, 2, true, false, 0.0, nullptr, true);
  std::vector<std::string> names;
  for (const auto& [name, p] : both.named_parameters()) names.push_back(name);
  EXPECT_EQ(names[4], "weight_ih_l0_reverse");
  EXPECT_EQ(both.named_parameters()[8].second.shape(), (mt::Shape{9, 6}));  // weight_ih_l1: 2 H in
  auto out = both(mt::zeros({4, 5, 2}));
  EXPECT_EQ(out.output.shape(), (mt::Shape{4, 5, 6}));
  EXPECT_EQ(out.h_n.shape(), (mt::Shape{4, 5, 3}));
}

// The losses' class and element weights and reductions refuse what PyTorch refuses.
TEST(LossOptions, BadWeightsAndReductionsAreErrors) {
  mt::Tensor lp = mt::log_softmax(mt::zeros({4, 5})), y = ints({1, 0, 4, 2}, {4});
  EXPECT_THROW(mt::nll_loss(lp, y, {.weight = mt::ones({4})}), mt::Error);           // not [C]
  EXPECT_THROW(mt::nll_loss(lp, y, {.weight = mt::ones({5}, mt::i64)}), mt::Error);  // integer
  EXPECT_THROW(mt::cross_entropy(lp, y, {.weight = mt::ones({1, 5})}), mt::Error);
  EXPECT_THROW(mt::cross_entropy(lp, y, {.weight = mt::ones({5}, mt::boolean)}), mt::Error);
  EXPECT_THROW(mt::cross_entropy(lp, y, {.reduction = mt::Reduction::BatchMean}), mt::Error);
  EXPECT_THROW(mt::nll_loss(lp, y, mt::Reduction::BatchMean), mt::Error);
  mt::Tensor p = mt::full({4, 5}, 0.5);
  EXPECT_THROW(mt::binary_cross_entropy(p, p, {.weight = mt::ones({4})}), mt::Error);
  EXPECT_THROW(mt::binary_cross_entropy(p, p, {.weight = mt::ones({5}, mt::i32)}), mt::Error);
  EXPECT_THROW(mt::binary_cross_entropy_with_logits(p, p, {.weight = mt::ones({3, 5})}), mt::Error);
  EXPECT_THROW(mt::binary_cross_entropy_with_logits(p, p, {.pos_weight = mt::ones({4})}),
               mt::Error);
  EXPECT_THROW(mt::mse_loss(p, p, mt::Reduction::BatchMean), mt::Error);
  EXPECT_THROW(mt::l1_loss(p, p, mt::Reduction::BatchMean), mt::Error);
  // The weights that fit give PyTorch's means: all weight on class 1 gives its own -log p.
  mt::Tensor only1 = mt::tensor(std::vector<float>{0, 1, 0, 0, 0}, {5});
  EXPECT_NEAR(mt::nll_loss(lp, y, {.weight = only1}).item(), std::log(5.0), 1e-6);
  EXPECT_NEAR(mt::kl_div(lp, mt::full({4, 5}, 0.2), mt::Reduction::BatchMean).item(), 0.0, 1e-6);
}

// OneCycleLR's cycle_momentum: asked for explicitly, an optimizer without a momentum or beta1
// refuses the schedule (as PyTorch's OneCycleLR raises); by default such an optimizer keeps the
// schedule for its rate alone. The momentum falls while the rate rises and returns with it.
TEST(OneCycleMomentum, CyclesAgainstTheRateAndIsRefusedWithoutAMomentum) {
  mt::Tensor p = mt::zeros({2});
  p.requires_grad_();
  mt::Adagrad adagrad({p});
  EXPECT_THROW(adagrad.set_schedule(std::make_shared<mt::OneCycleLR>(
                   0.1, 10, mt::OneCycleOptions{.cycle_momentum = true})),
               mt::Error);
  adagrad.set_schedule(std::make_shared<mt::OneCycleLR>(0.1, 10));
  EXPECT_FALSE(adagrad.current_momentum().defined());
  EXPECT_THROW(mt::OneCycleLR(0.1, 10, {.base_momentum = 0.9, .max_momentum = 0.8}), mt::Error);
  EXPECT_THROW(mt::OneCycleLR(0.1, 10, {.max_momentum = 1.0}), mt::Error);
  mt::OneCycleLR schedule(0.1, 10);
  EXPECT_DOUBLE_EQ(*schedule.momentum(0), 0.95);
  EXPECT_DOUBLE_EQ(*schedule.momentum(2), 0.85);  // the rate's peak, pct_start * 10 - 1
  EXPECT_DOUBLE_EQ(*schedule.momentum(9), 0.95);
  EXPECT_FALSE(mt::OneCycleLR(0.1, 10, {.cycle_momentum = false}).momentum(3).has_value());
  EXPECT_FALSE(mt::StepLR(0.1, 2).momentum(3).has_value());
}

// where with numbers takes PyTorch's result type: the tensor's, unless the number is of a higher
// kind; two numbers give f32 or i64.
TEST(WhereNumbers, PromotesAsPyTorch) {
  mt::Tensor c = mt::tensor(std::vector<int64_t>{1, 0, 1}, {3}, mt::boolean);
  mt::Tensor i = ints({4, 5, 6}, {3}),
             b = mt::tensor(std::vector<int64_t>{0, 1, 0}, {3}, mt::boolean);
  EXPECT_EQ(mt::where(c, i, 2).dtype(), mt::i64);
  EXPECT_EQ(mt::where(c, i, 2.5).dtype(), mt::f32);
  EXPECT_EQ(mt::where(c, 2.5, i).to_vector<double>(), (std::vector<double>{2.5, 5, 2.5}));
  EXPECT_EQ(mt::where(c, b, 3).dtype(), mt::i64);
  EXPECT_EQ(mt::where(c, b, true).dtype(), mt::boolean);
  EXPECT_EQ(mt::where(c, mt::zeros({3}, mt::f64), 1).dtype(), mt::f64);
  EXPECT_EQ(mt::where(c, 1.0, 0.0).to_vector<float>(), (std::vector<float>{1, 0, 1}));
  EXPECT_EQ(mt::where(c, 1, 0).dtype(), mt::i64);
  EXPECT_THROW(mt::where(i, i, 1.0), mt::Error);  // the condition must be bool
  EXPECT_THROW(mt::where(mt::Tensor(), 1.0, i), mt::Error);
}

// masked_softmax: a row that is all masked gives NaN forward (0/0) but a zero gradient, as
// where() followed by softmax gave; a mask that does not broadcast to the input is refused.
TEST(MaskedSoftmax, AllMaskedRowsGetZeroGradients) {
  mt::Tensor x = make({0.5, -1, 2, 1, 3, -2}, {2, 3}, mt::f32).requires_grad_(true);
  mt::Tensor mask = mt::tensor(std::vector<int64_t>{1, 1, 0, 0, 0, 0}, {2, 3}, mt::boolean);
  mt::Tensor y = mt::masked_softmax(x, mask);
  mt::sum(mt::slice(y, 0, 0, 1) * 2.0).backward();
  std::vector<double> grad = values(x.grad());
  for (double g : grad) EXPECT_TRUE(std::isfinite(g));
  EXPECT_EQ(grad[2], 0.0);
  EXPECT_EQ(grad[3], 0.0);
  EXPECT_EQ(grad[4], 0.0);
  EXPECT_EQ(grad[5], 0.0);
  EXPECT_THROW(mt::masked_softmax(mt::zeros({3}), mt::zeros({2, 3}, mt::boolean)), mt::Error);
}

// bernoulli and randint: seeded draws with the right support and roughly the right moments.
TEST(RandomComposites, BernoulliAndRandint) {
  mt::Generator gen(11);
  mt::Tensor p = mt::full({20000}, 0.3, mt::f64);
  std::vector<double> b = values(mt::bernoulli(p, &gen));
  double ones = 0;
  for (double v : b) {
    EXPECT_TRUE(v == 0 || v == 1);
    ones += v;
  }
  EXPECT_NEAR(ones / b.size(), 0.3, 0.02);
  mt::Tensor r = mt::randint(-3, 4, {20000}, &gen);
  EXPECT_EQ(r.dtype(), mt::i64);
  std::vector<int64_t> ints = int_values(r);
  std::vector<int> counts(7, 0);
  for (int64_t v : ints) {
    ASSERT_GE(v, -3);
    ASSERT_LT(v, 4);
    ++counts[v + 3];
  }
  for (int c : counts) EXPECT_NEAR(c / 20000.0, 1.0 / 7, 0.02);
  EXPECT_THROW(mt::randint(2, 2, {3}, &gen), mt::Error);
  // Wide ranges: every value reachable (f64 draws carry 53 bits; 24 left multiples of 2^16 in
  // [0, 2^40)), an offset beyond 2^53 added exactly, and no range the draws cannot cover.
  std::vector<int64_t> wide = int_values(mt::randint(0, int64_t{1} << 40, {64}, &gen));
  EXPECT_TRUE(std::any_of(wide.begin(), wide.end(), [](int64_t v) { return v % 65536 != 0; }));
  const int64_t far = (int64_t{1} << 60) + 12345;
  for (int64_t v : int_values(mt::randint(far, far + 3, {64}, &gen))) {
    EXPECT_GE(v, far);
    EXPECT_LT(v, far + 3);
  }
  try {
    mt::randint(std::numeric_limits<int64_t>::min(), int64_t{1} << 62, {2}, &gen);
    ADD_FAILURE() << "a range of more than 2^53 values was drawn";
  } catch (const mt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("at most 2^53 values"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mt::norm(p, 3.0), mt::Error);
  EXPECT_THROW(mt::tril(p), mt::Error);
  EXPECT_THROW(mt::roll(p, {1, 2}, {0}), mt::Error);
  EXPECT_THROW(mt::repeat(mt::zeros({2, 3}), {2}), mt::Error);
}

// multinomial and randperm: seeded, reproducible draws with the right support and frequencies.
TEST(RandomComposites, MultinomialAndRandperm) {
  mt::Generator gen(5);
  // Unnormalized weights; category 1 has none.
  mt::Tensor w = make({0.2, 0.0, 1.2, 0.6}, {4});
  std::vector<int64_t> draws = int_values(mt::multinomial(w, 20000, true, &gen));
  std::vector<int> counts(4, 0);
  for (int64_t v : draws) {
    ASSERT_GE(v, 0);
    ASSERT_LT(v, 4);
    ++counts[v];
  }
  EXPECT_EQ(counts[1], 0);
  EXPECT_NEAR(counts[0] / 20000.0, 0.1, 0.01);
  EXPECT_NEAR(counts[2] / 20000.0, 0.6, 0.015);
  EXPECT_NEAR(counts[3] / 20000.0, 0.3, 0.015);
  // Without replacement: each row a set of distinct categories, zero weights only when forced,
  // and the first draw distributed as the weights.
  mt::Tensor rows = mt::broadcast_to(make({1.0, 0.0, 6.0, 3.0}, {1, 4}), {5000, 4});
  std::vector<int64_t> picks = int_values(mt::multinomial(rows, 3, false, &gen));
  std::vector<int> first(4, 0);
  for (size_t r = 0; r < 5000; ++r) {
    std::set<int64_t> seen(picks.begin() + 3 * r, picks.begin() + 3 * r + 3);
    EXPECT_EQ(seen.size(), 3u);
    EXPECT_FALSE(seen.count(1)) << "row " << r;
    ++first[picks[3 * r]];
  }
  EXPECT_NEAR(first[2] / 5000.0, 0.6, 0.03);
  EXPECT_NEAR(first[0] / 5000.0, 0.1, 0.02);
  std::vector<int64_t> all =
      int_values(mt::multinomial(make({1.0, 0.0, 2.0}, {3}), 3, false, &gen));
  EXPECT_EQ(all.back(), 1) << "the zero-weight category comes last";
  mt::Generator a(9), b(9), c(10);
  EXPECT_EQ(int_values(mt::multinomial(w, 50, true, &a)),
            int_values(mt::multinomial(w, 50, true, &b)));
  std::vector<int64_t> perm = int_values(mt::randperm(50, &c));
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_NE(perm, sorted);
  EXPECT_EQ(int_values(mt::randperm(50, &a)), int_values(mt::randperm(50, &b)));
  EXPECT_NE(int_values(mt::randperm(50, &a)), perm);
  EXPECT_EQ(mt::randperm(0).numel(), 0);
  EXPECT_EQ(mt::randperm(4, &a, mt::i32).dtype(), mt::i32);
  // Weights torch.multinomial refuses give an mt::Error when the draws are evaluated: a
  // negative, infinite or NaN weight, or a row without a positive weight, in any one row.
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  for (double bad : {-0.5, inf, nan})
    for (bool replacement : {false, true}) {
      mt::Tensor weights = make({1.0, 2.0, 3.0, 0.5, bad, 1.0}, {2, 3});
      EXPECT_THROW(mt::multinomial(weights, 2, replacement, &a).to_vector<int64_t>(), mt::Error)
          << bad << " replacement " << replacement;
    }
  for (bool replacement : {false, true})
    EXPECT_THROW(mt::multinomial(make({1.0, 2.0, 0.0, 0.0}, {2, 2}), 1, replacement, &a)
                     .to_vector<int64_t>(),
                 mt::Error);
  try {
    mt::multinomial(make({0.0, 0.0}, {2}), 1, true, &a).to_vector<int64_t>();
    ADD_FAILURE() << "no error for a row without a positive weight";
  } catch (const mt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("multinomial"), std::string::npos) << e.what();
  }
}

// torch.nn.init.normal_ / uniform_: in place for every holder, keeping requires_grad.
TEST(RandomComposites, InPlaceInitializers) {
  mt::Generator gen(3);
  mt::Linear layer(100, 200, true, &gen);
  mt::Tensor holder = layer.weight;
  mt::init::normal_(layer.weight, 0.5, 2.0, &gen);
  std::vector<double> w = values(holder);
  double mean = 0, var = 0;
  for (double v : w) mean += v / w.size();
  for (double v : w) var += (v - mean) * (v - mean) / w.size();
  EXPECT_NEAR(mean, 0.5, 0.05);
  EXPECT_NEAR(std::sqrt(var), 2.0, 0.05);
  EXPECT_TRUE(holder.requires_grad());
  mt::init::uniform_(layer.bias, -3.0, -2.0, &gen);
  for (double v : values(layer.bias)) {
    EXPECT_GE(v, -3.0);
    EXPECT_LT(v, -2.0);
  }
}

// Gradients at zeros, which finite differences see only as a smooth polynomial: PyTorch's values.
TEST(ScanGradients, ProductsAtZerosTakeTheOtherFactors) {
  mt::Tensor x = make({2, 0, 3, 0, 5}, {5});
  x.requires_grad_();
  // d/dx sum(cumprod(x)): 1 + x1 (1 + ...) = 1 at 0; at the first zero 2 + 2*3 = 8; after, 0.
  expect_same(values(mt::grad({mt::sum(mt::cumprod(x, 0))}, {x})[0]), {1, 8, 0, 0, 0});
  mt::Tensor one_zero = make({2, 0, 3, 4}, {2, 2});
  one_zero.requires_grad_();
  expect_same(values(mt::grad({mt::sum(mt::prod(one_zero, 1))}, {one_zero})[0]), {0, 2, 4, 3});
  expect_same(values(mt::grad({mt::prod(one_zero)}, {one_zero})[0]), {0, 24, 0, 0});
  mt::Tensor two_zeros = make({0, 3, 0}, {3});
  two_zeros.requires_grad_();
  expect_same(values(mt::grad({mt::prod(two_zeros)}, {two_zeros})[0]), {0, 0, 0});
  // A reversed scan underlies each gradient; the reverse scans' own values:
  expect_same(values(mt::cumulative(mt::OpCode::Cumsum, make({1, 2, 3}, {3}), 0, true)), {6, 5, 3});
  expect_same(values(mt::cumulative(mt::OpCode::Cumprod, make({1, 2, 3}, {3}), 0, true)),
              {6, 6, 3});
}

// Gradients where a composite's pieces are not smooth but the function is (or where PyTorch
// masks a 0 * inf): PyTorch 1.13's values.
TEST(EdgeGradients, AsPyTorchAtZerosAndSaturation) {
  auto grad_of = [](const mt::Tensor& x, const std::function<mt::Tensor(const mt::Tensor&)>& f) {
    return values(mt::grad({mt::sum(f(x))}, {x})[0]);
  };
  auto leaf = [](Doubles v, mt::DType dtype = mt::f64) {
    mt::Tensor x = make(std::move(v), {static_cast<int64_t>(v.size())}, dtype);
    x.requires_grad_();
    return x;
  };
  // -log(sigmoid(0)) has slope -1/2 (relu's and abs's gradients at 0 made it 0).
  mt::Tensor t = make({0, 1}, {2});
  expect_same(
      grad_of(leaf({0, 0}),
              [&](const mt::Tensor& x) { return mt::binary_cross_entropy_with_logits(x, t, {}); }),
      {0.25, -0.25}, "bce_with_logits");
  expect_same(grad_of(leaf({0, 0}),
                      [&](const mt::Tensor& x) {
                        return mt::binary_cross_entropy_with_logits(x, t,
                                                                    {.pos_weight = make({3}, {1})});
                      }),
              {0.25, -0.75}, "bce_with_logits pos_weight");
  // binary_cross_entropy at probabilities of exactly 1 and 0: PyTorch's (p - t) / max(p (1 - p),
  // 1e-12), not 0/0. sigmoid(20) rounds to 1 in f32.
  mt::Tensor saturated = leaf({20, 3}, mt::f32);
  Doubles through_sigmoid = grad_of(saturated, [](const mt::Tensor& x) {
    return mt::binary_cross_entropy(mt::sigmoid(x), mt::ones({2}), mt::Reduction::Mean);
  });
  EXPECT_EQ(through_sigmoid[0], 0.0);
  EXPECT_NEAR(through_sigmoid[1], -0.0237129330635, 1e-9);
  mt::Tensor probs = leaf({1, 0, 0.5}, mt::f32);
  mt::Tensor bce = mt::binary_cross_entropy(probs, mt::tensor(std::vector<float>{0, 1, 0.25}, {3}),
                                            mt::Reduction::None);
  expect_same(values(bce), {100, 100, 0.6931471824645996}, "bce values");
  Doubles slopes = values(mt::grad({mt::sum(bce)}, {probs})[0]);
  EXPECT_NEAR(slopes[0], 1e12, 1e6);
  EXPECT_NEAR(slopes[1], -1e12, 1e6);
  EXPECT_EQ(slopes[2], 1.0);
  // norm and std where the result is 0: gradient 0, not inf * 0.
  mt::Tensor rows = make({0, 0, 3, 4}, {2, 2});
  rows.requires_grad_();
  Doubles norm_slopes = values(mt::grad({mt::sum(mt::norm(rows, 2, {1}))}, {rows})[0]);
  expect_same({norm_slopes[0], norm_slopes[1]}, {0, 0}, "norm at 0");
  EXPECT_NEAR(norm_slopes[2], 0.6, 1e-15);
  EXPECT_NEAR(norm_slopes[3], 0.8, 1e-15);
  expect_same(grad_of(leaf({2, 2, 2}), [](const mt::Tensor& x) { return mt::std_dev(x); }),
              {0, 0, 0}, "std");
  EXPECT_EQ(values(mt::std_dev(make({1, 3}, {2}), {0}, false, 3))[0],
            std::numeric_limits<double>::infinity());
  // clamp passes the gradient where min <= x <= max only (not through NaN).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  mt::Tensor clamped = leaf({nan, 0.5, -1, 2, 0, 1});
  expect_same(values(mt::clamp(clamped, 0.0, 1.0)), {nan, 0.5, 0, 1, 0, 1}, "clamp values");
  expect_same(grad_of(clamped, [](const mt::Tensor& x) { return mt::clamp(x, 0.0, 1.0); }),
              {0, 1, 0, 0, 1, 1}, "clamp");
  // An integer input with fractional bounds is clamped in f32, as PyTorch promotes it.
  mt::Tensor promoted = mt::clamp(ints({0, 1, 2}, {3}), 0.5, 1.5);
  EXPECT_EQ(promoted.dtype(), mt::f32);
  expect_same(values(promoted), {0.5, 1, 1.5}, "clamp of integers");
  EXPECT_EQ(mt::clamp(ints({0, 1, 2}, {3}), 1.0, 1.0).dtype(), mt::i64);
  Doubles hardswish_slopes =
      grad_of(leaf({-3, 3, -4, 1}), [](const mt::Tensor& x) { return mt::hardswish(x); });
  expect_same({hardswish_slopes[0], hardswish_slopes[1], hardswish_slopes[2]}, {-0.5, 1.5, 0},
              "hardswish");
  EXPECT_NEAR(hardswish_slopes[3], 5.0 / 6.0, 1e-15);
  expect_same(grad_of(leaf({0, 2}), [](const mt::Tensor& x) { return mt::pow(x, 0.0); }), {0, 0},
              "pow");
  // A diagonal is selected: an infinity off it does not make it NaN.
  const double inf = std::numeric_limits<double>::infinity();
  expect_same(values(mt::einsum("ii->i", {make({1, inf, nan, 2}, {2, 2})})), {1, 2}, "diagonal");
  expect_same(values(mt::einsum("ii", {make({1, inf, nan, 2}, {2, 2})})), {3}, "trace");
}

// A NaN passes its gradient on through relu, maximum and minimum (masked only where strictly
// beaten), as PyTorch's; detach() gives a leaf a new graph can start at; hardsigmoid keeps its
// digits near -3 and softplus of an f16 tensor is computed in f32.
TEST(EdgeGradients, NansPassGradientsAndDetachedValuesBecomeLeaves) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  mt::Tensor x = make({nan, 2, -1}, {3});
  x.requires_grad_();
  mt::Tensor y = mt::ones({3}, mt::f64);
  y.requires_grad_();
  expect_same(values(mt::grad({mt::sum(mt::relu(x))}, {x})[0]), {1, 1, 0}, "relu");
  std::vector<mt::Tensor> up = mt::grad({mt::sum(mt::maximum(x, y))}, {x, y});
  expect_same(values(up[0]), {1, 1, 0}, "maximum x");
  expect_same(values(up[1]), {1, 0, 1}, "maximum y");
  std::vector<mt::Tensor> down = mt::grad({mt::sum(mt::minimum(x, y))}, {x, y});
  expect_same(values(down[0]), {1, 0, 1}, "minimum x");
  expect_same(values(down[1]), {1, 1, 0}, "minimum y");
  mt::Tensor start = (make({1, 2}, {2}) * 2.0).detach();
  start.requires_grad_();
  EXPECT_TRUE(start.is_leaf());
  mt::sum(start * start).backward();
  expect_same(values(start.grad()), {4, 8}, "a detached value's own gradient");
  const float near_minus_three = -2.99995518f;
  EXPECT_NEAR(mt::hardsigmoid(mt::tensor(std::vector<float>{near_minus_three}, {1})).item(),
              7.470448963431409e-06, 1e-12);
  std::vector<float> soft =
      mt::cast(mt::softplus(mt::cast(make({15, 11.5}, {2}), mt::f16)), mt::f32).to_vector<float>();
  EXPECT_EQ(soft, (std::vector<float>{15, 11.5}));
}

// uniform_(t, a, a) fills a, as PyTorch's, and so do initializers with a gain of 0.
TEST(RandomComposites, AnEmptyRangeIsItsValue) {
  mt::Tensor t = mt::zeros({3});
  mt::init::uniform_(t, 0.5, 0.5);
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{0.5f, 0.5f, 0.5f}));
  EXPECT_EQ(mt::rand({2}, mt::bf16, nullptr, -2.0, -2.0).to_vector<float>(),
            (std::vector<float>{-2.0f, -2.0f}));
}

// The smallest integer is the minimum (min was -max(-x), and -x wraps there).
TEST(IntegerReductions, MinAndArgminOfTheSmallestInteger) {
  const int64_t smallest = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(int_values(mt::min(ints({smallest, 5}, {2})))[0], smallest);
  EXPECT_EQ(int_values(mt::min(ints({-2147483648LL, 5}, {2}, mt::i32)))[0], -2147483648LL);
  EXPECT_EQ(int_values(mt::argmin(ints({5, smallest, 7}, {3})))[0], 1);
}

// Integer arithmetic wraps on every back end, as PyTorch's: the reference executor's loops are
// compiled with -fwrapv (their int64_t overflow was undefined, and UBSan stopped on it).
TEST(IntegerReductions, OverflowWrapsOnTheReferenceAndTheKernels) {
  const int64_t largest = std::numeric_limits<int64_t>::max();
  const int64_t smallest = std::numeric_limits<int64_t>::min();
  const mt::Device previous = mt::current_device();
  for (mt::Device device : {mt::Device::reference, mt::Device::cpu}) {
    mt::set_device(device);
    mt::Tensor x = ints({largest, 1, 2}, {3});
    EXPECT_EQ(int_values(mt::sum(x)), (std::vector<int64_t>{smallest + 2}));
    EXPECT_EQ(int_values(mt::cumsum(x, 0)),
              (std::vector<int64_t>{largest, smallest, smallest + 2}));
    EXPECT_EQ(int_values(x + x), (std::vector<int64_t>{-2, 2, 4}));
    EXPECT_EQ(int_values(mt::prod(ints({largest, 2}, {2}))), (std::vector<int64_t>{-2}));
    EXPECT_EQ(int_values(-ints({smallest}, {1})), (std::vector<int64_t>{smallest}));
    EXPECT_EQ(int_values(ints({2147483647, 1}, {2}, mt::i32) + ints({1, 1}, {2}, mt::i32)),
              (std::vector<int64_t>{-2147483648LL, 2}));
  }
  mt::set_device(previous);
}

// Floats that no integer holds convert to INT64_MIN (wrapped to the width of a narrower type),
// the same on every back end: C++'s cast is undefined there and LLVM's fptosi poison, which
// gave each source type its own answer. tanh stays within [-1, 1].
TEST(Casts, FloatsNoIntegerHoldsAreDefined) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t smallest = std::numeric_limits<int64_t>::min();
  for (mt::DType from : {mt::f32, mt::f64, mt::bf16, mt::f16}) {
    SCOPED_TRACE(mt::name(from));
    mt::Tensor x = mt::cast(make({nan, inf, -inf, -2.5, 256}, {5}), from) * 1.0;
    EXPECT_EQ(int_values(mt::cast(x, mt::i64)),
              (std::vector<int64_t>{smallest, smallest, smallest, -2, 256}));
    EXPECT_EQ(int_values(mt::cast(x, mt::i32)), (std::vector<int64_t>{0, 0, 0, -2, 256}));
  }
  mt::Tensor big = mt::cast(make({3e9, 1e19}, {2}), mt::f32) * 1.0;
  EXPECT_EQ(int_values(mt::cast(big, mt::i64)), (std::vector<int64_t>{3000000000, smallest}));
  EXPECT_EQ(int_values(mt::cast(big, mt::i32)), (std::vector<int64_t>{-1294967296, 0}));
  // The fit gave 1 + 2^-23 for 8.13 < |x| < 9.1.
  std::vector<float> grid;
  for (int i = 0; i < 2000; ++i) grid.push_back(8.0f + 1.2f * static_cast<float>(i) / 2000);
  for (float v : mt::tanh(mt::tensor(grid, {2000})).to_vector<float>()) ASSERT_LE(v, 1.0f);
  for (float v : mt::tanh(-mt::tensor(grid, {2000})).to_vector<float>()) ASSERT_GE(v, -1.0f);
}

// Programs over empty tensors: a keepdim reduction's [1, 0, 1] reshaped and read twice, and the
// gradient of a broadcast over an empty axis, on the CPU back end as on the reference.
TEST(EmptyTensors, ReshapesOfEmptyReductionsAndBroadcastGradients) {
  mt::Tensor s = mt::sum(mt::ones({2, 0, 4}) * mt::ones({2, 0, 4}), {0, 2}, true);
  mt::Tensor r = mt::reshape(s, {0, 1});
  mt::Tensor a = mt::cast(r, mt::f64), b = mt::cast(mt::exp(r), mt::f64);
  mt::eval({a, b});
  EXPECT_EQ(a.shape(), (mt::Shape{0, 1}));
  EXPECT_EQ(b.numel(), 0);
  mt::Tensor c = mt::zeros({0});
  c.requires_grad_();
  mt::Tensor z = mt::zeros({2, 0, 3, 3}) + mt::reshape(c, {1, 0, 1, 1});
  mt::Tensor g = mt::grad({mt::sum(z)}, {c})[0];
  EXPECT_EQ(g.shape(), (mt::Shape{0}));
  EXPECT_EQ(values(g).size(), 0u);
}

// Of repeated positions scatter keeps the last write (PyTorch's CPU order), and the gradient of
// base is zero wherever something was written.
TEST(Scatter, RepeatedPositionsKeepTheLastWrite) {
  mt::Tensor base = make({1, 2, 3, 4}, {4});
  base.requires_grad_();
  mt::Tensor src = make({10, 20, 30}, {3});
  mt::Tensor y = mt::scatter(base, 0, ints({2, 0, 2}, {3}), src);
  expect_same(values(y), {20, 2, 30, 4});
  expect_same(values(mt::grad({mt::sum(y * make({1, 2, 3, 4}, {4}))}, {base})[0]), {0, 2, 0, 4});
  // topk keeps the first of equal elements first, and sort is stable.
  mt::Tensor tied = make({1, 3, 3, 2, 3}, {5});
  EXPECT_EQ(int_values(mt::topk(tied, 2).indices), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(int_values(mt::sort(tied, 0, true).indices), (std::vector<int64_t>{1, 2, 4, 3, 0}));
}

// Padding's errors: the shapes pad refuses, as PyTorch does, with a reason.
TEST(Pad, RefusesWhatItCannotPad) {
  mt::Tensor x = mt::zeros({2, 3});
  EXPECT_THROW(mt::pad(x, {1}), mt::Error);                              // not a pair
  EXPECT_THROW(mt::pad(x, {1, 1, 1, 1, 1, 1}), mt::Error);               // more axes than x
  EXPECT_THROW(mt::pad(x, {3, 0}, mt::PadMode::Reflect), mt::Error);     // not below the size
  EXPECT_THROW(mt::pad(x, {-1, 0}, mt::PadMode::Replicate), mt::Error);  // negative, not constant
  EXPECT_THROW(mt::pad(x, {-2, -2}), mt::Error);                         // crops more than 3
  EXPECT_EQ(mt::pad(x, {-1, -2}).shape(), (mt::Shape{2, 0}));
  EXPECT_THROW(mt::clamp(x, std::nullopt, std::nullopt), mt::Error);
  EXPECT_THROW(mt::masked_fill(x, x, 1.0), mt::Error);  // the mask is not bool
}

TEST(ConcatStack, ValuesShapesAndPromotion) {
  mt::Tensor a = ints({1, 2, 3, 4}, {2, 2}), b = ints({5, 6}, {2, 1}),
             c = ints({7, 8, 9, 10}, {2, 2});
  mt::Tensor cat = mt::concat({a, b, c}, 1);
  EXPECT_EQ(cat.shape(), (mt::Shape{2, 5}));
  EXPECT_EQ(int_values(cat), (std::vector<int64_t>{1, 2, 5, 7, 8, 3, 4, 6, 9, 10}));
  EXPECT_EQ(int_values(mt::concat({a, c}, 0)), (std::vector<int64_t>{1, 2, 3, 4, 7, 8, 9, 10}));
  mt::Tensor s0 = mt::stack({a, c}, 0), s2 = mt::stack({a, c}, -1);
  EXPECT_EQ(s0.shape(), (mt::Shape{2, 2, 2}));
  EXPECT_EQ(int_values(s0), (std::vector<int64_t>{1, 2, 3, 4, 7, 8, 9, 10}));
  EXPECT_EQ(s2.shape(), (mt::Shape{2, 2, 2}));
  EXPECT_EQ(int_values(s2), (std::vector<int64_t>{1, 7, 2, 8, 3, 9, 4, 10}));
  mt::Tensor mixed = mt::concat({a, make({0.5, 1.5}, {2, 1}, mt::f32)}, 1);
  EXPECT_EQ(mixed.dtype(), mt::f32);
  expect_same(values(mixed), {1, 2, 0.5, 3, 4, 1.5});
  EXPECT_THROW(mt::concat({a, b}, 0), mt::Error);
  EXPECT_THROW(mt::stack({a, b}), mt::Error);
}

TEST(OneHotEmbedding, OutOfRangeIdsGiveZeroRows) {
  mt::Tensor oh = mt::one_hot(ints({0, 2, -1, 3, 1}, {5}), 3);
  EXPECT_EQ(oh.dtype(), mt::f32);
  EXPECT_EQ(oh.shape(), (mt::Shape{5, 3}));
  expect_same(values(oh), {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0});
  mt::Tensor oh2 = mt::one_hot(ints({1, 0, 1, 5}, {2, 2}, mt::i32), 2, mt::i64);
  EXPECT_EQ(oh2.shape(), (mt::Shape{2, 2, 2}));
  EXPECT_EQ(int_values(oh2), (std::vector<int64_t>{0, 1, 1, 0, 0, 1, 0, 0}));
  EXPECT_THROW(mt::one_hot(make({1}, {1}), 3), mt::Error);

  mt::Tensor w = make({0, 1, 10, 11, 20, 21, 30, 31}, {4, 2});
  mt::Tensor e = mt::embedding(w, ints({3, 0, 3, 1}, {2, 2}, mt::i32));
  EXPECT_EQ(e.shape(), (mt::Shape{2, 2, 2}));
  expect_same(values(e), {30, 31, 0, 1, 30, 31, 10, 11});
  EXPECT_THROW(values(mt::embedding(w, ints({4}, {1}))), mt::Error);
  EXPECT_THROW(values(mt::embedding(w, ints({-1}, {1}))), mt::Error);
  EXPECT_THROW(mt::embedding(make({1, 2}, {2}), ints({0}, {1})), mt::Error);
}

TEST(Indexing, HandWorked) {
  mt::Tensor base = mt::zeros({3}, mt::f64);
  expect_same(values(mt::index_add(base, ints({0, 2, 0}, {3}), make({1, 2, 3}, {3}))), {4, 0, 2});
  expect_same(values(mt::gather(make({1, 2, 3, 4}, {2, 2}), ints({1, 1, 0, 1}, {2, 2}), 1)),
              {2, 2, 3, 4});
  expect_same(values(mt::scatter_add(mt::zeros({2, 3}, mt::f64), ints({0, 2, 0}, {1, 3}),
                                     make({1, 2, 3}, {1, 3}), 1)),
              {4, 0, 2, 0, 0, 0});
  expect_same(values(mt::index_select(make({1, 2, 3, 4, 5, 6}, {3, 2}), ints({2, 2, 0}, {3}), 0)),
              {5, 6, 5, 6, 1, 2});
}

TEST(MatmulAndComposites, HandWorked) {
  mt::Tensor a = make({1, 2, 3, 4}, {2, 2}), b = make({5, 6, 7, 8}, {2, 2});
  expect_same(values(mt::matmul(a, b)), {19, 22, 43, 50});
  expect_same(values(mt::matmul(a, b, true, false)), {26, 30, 38, 44});
  expect_same(values(mt::matmul(a, b, false, true)), {17, 23, 39, 53});
  expect_same(values(mt::matmul(make({1, 2}, {2}), b)), {19, 22});
  mt::Tensor dot = mt::matmul(make({1, 2}, {2}), make({3, 4}, {2}));
  EXPECT_EQ(dot.shape(), mt::Shape{});
  EXPECT_EQ(dot.item(), 11);

  Doubles sm = values(mt::softmax(make({0, std::log(3.0)}, {2})));
  EXPECT_NEAR(sm[0], 0.25, 1e-15);
  EXPECT_NEAR(sm[1], 0.75, 1e-15);
  EXPECT_NEAR(mt::logsumexp(make({std::log(2.0), std::log(2.0)}, {2})).item(), std::log(4.0),
              1e-15);
  // Large inputs do not overflow; a -inf entry gets exactly zero probability.
  expect_same(values(mt::softmax(make({1000, 1000, -kInf}, {3}))), {0.5, 0.5, 0});
  Doubles ln = values(mt::layer_norm(make({1, 2, 3}, {3}), mt::Tensor(), mt::Tensor(), 0.0));
  EXPECT_NEAR(ln[0], -std::sqrt(1.5), 1e-15);
  EXPECT_NEAR(ln[1], 0, 1e-15);
  EXPECT_NEAR(ln[2], std::sqrt(1.5), 1e-15);
  EXPECT_EQ(mt::var(make({1, 2, 3, 4}, {4}), {}, false, 0).item(), 1.25);
  EXPECT_EQ(mt::var(make({1, 2, 3, 4}, {4})).item(), 5.0 / 3);  // torch.var's correction 1
  EXPECT_NEAR(mt::cross_entropy(make({0, 0}, {1, 2}), ints({1}, {1})).item(), std::log(2.0), 1e-15);
}

TEST(HalfStorage, RoundsToNearestEvenAtEveryNodeOutput) {
  mt::Tensor big = make({2048}, {1}, mt::f16), one = make({1}, {1}, mt::f16);
  mt::Tensor s = big + one;
  EXPECT_EQ(s.dtype(), mt::f16);
  EXPECT_EQ(s.item(), 2048);                    // 2049 is a tie between 2048 and 2050: even wins
  EXPECT_EQ((big + 3.0).item(), 2052);          // 2051: tie between 2050 (odd) and 2052 (even)
  EXPECT_EQ((big + 5.0).item(), 2052);          // 2053: tie between 2052 (even) and 2054
  EXPECT_EQ(((big + one) + one).item(), 2048);  // each node rounds
  EXPECT_EQ(mt::sum(mt::concat({big, one, one})).item(), 2050);  // one rounding at the end
  EXPECT_EQ((big + make({1}, {1}, mt::f32)).item(), 2049);       // promoted to f32: exact
  EXPECT_EQ((big + make({1}, {1}, mt::bf16)).dtype(), mt::f32);

  mt::Tensor b256 = make({256}, {1}, mt::bf16), b1 = make({1}, {1}, mt::bf16);
  EXPECT_EQ((b256 + b1).item(), 256);
  EXPECT_EQ((b1 + 0x1p-8).item(), 1.0);
  EXPECT_EQ((b1 + 3 * 0x1p-8).item(), 1 + 0x1p-6);
  EXPECT_EQ((make({300}, {1}, mt::bf16) * 300.0).item(), 90112);

  EXPECT_EQ(make({0.1}, {1}, mt::f16).item(), 0.0999755859375);
  EXPECT_EQ(make({0.1}, {1}, mt::bf16).item(), 0.10009765625);
  EXPECT_EQ((make({65504}, {1}, mt::f16) + 16.0).item(), kInf);  // 65520 rounds up to inf
  EXPECT_EQ((make({65504}, {1}, mt::f16) + 8.0).item(), 65504);
  EXPECT_EQ((make({300}, {1}, mt::f16) * 300.0).item(), kInf);
  EXPECT_EQ((make({0x1p-24}, {1}, mt::f16) * 0.5).item(), 0);  // tie with 0: even is 0
  EXPECT_EQ((make({0x1p-24}, {1}, mt::f16) * 0.75).item(), 0x1p-24);
  EXPECT_EQ(mt::exp(make({0}, {1}, mt::f16)).dtype(), mt::f16);
  EXPECT_EQ(mt::matmul(make({1, 2}, {1, 2}, mt::f16), make({1024, 1}, {2, 1}, mt::f16)).item(),
            1026);
  EXPECT_EQ(mt::matmul(make({1, 1}, {1, 2}, mt::f16), make({2048, 1}, {2, 1}, mt::f16)).item(),
            2048);
}

// The optimizers' fused arithmetic (ops.def, MT_FUSED) against the same expression of single
// ops: bit for bit in f32, specials included; in bf16 one rounding of the f32 result.
TEST(FusedUpdateArithmetic, StoresWhatItsSingleOpsStoreInF32AndRoundsOnceInHalf) {
  mt::Generator gen(7);
  auto draw = [&](bool positive) {
    std::vector<float> v = (mt::randn({67}, mt::f32, &gen) * 3.0).to_vector<float>();
    if (positive)
      for (float& x : v) x = std::abs(x) + 0.25f;
    else
      v[0] = 0.0f, v[1] = -0.0f, v[2] = INFINITY, v[3] = NAN, v[4] = 1e-39f;  // a subnormal
    return mt::tensor(v, {67});
  };
  std::array<mt::Tensor, 7> x = {draw(false), draw(false), draw(false), draw(true),
                                 draw(false), draw(true),  draw(false)};
  auto [a, b, c, d, e, f, g] = x;
  auto same_bits = [](const mt::Tensor& fused, const mt::Tensor& single) {
    ASSERT_EQ(fused.dtype(), single.dtype());
    std::vector<double> u = fused.to_vector<double>(), w = single.to_vector<double>();
    for (size_t i = 0; i < u.size(); ++i)
      EXPECT_EQ(std::bit_cast<uint64_t>(u[i]), std::bit_cast<uint64_t>(w[i])) << i;
  };
  same_bits(mt::mul_add({a, b, c}), a * b + c);
  same_bits(mt::sub_mul({a, b, c}), a - b * c);
  same_bits(mt::lincomb({a, b, c, d}), a * b + c * d);
  same_bits(mt::lincomb_square({a, b, c, d}), a * b + c * c * d);
  same_bits(mt::adam_step(x), a * b - c / (mt::sqrt(d) * e + f) * g);
  // 0-d weights broadcast, as the single ops' operands do.
  mt::Tensor w = mt::tensor(std::vector<float>{0.9f}, {});
  same_bits(mt::lincomb({a, w, c, 1.0 - w}), a * w + c * (1.0 - w));

  // bf16 inputs: the f32 expression of their values, rounded to bf16 once at the end.
  std::array<mt::Tensor, 7> h;
  for (size_t k = 0; k < 7; ++k) h[k] = mt::cast(x[k], mt::bf16);
  auto f32 = [&](size_t k) { return mt::cast(h[k], mt::f32); };
  mt::Tensor fused = mt::adam_step(h);
  EXPECT_EQ(fused.dtype(), mt::bf16);
  same_bits(
      fused,
      mt::cast(f32(0) * f32(1) - f32(2) / (mt::sqrt(f32(3)) * f32(4) + f32(5)) * f32(6), mt::bf16));
  same_bits(mt::lincomb({h[0], h[1], h[2], h[3]}),
            mt::cast(f32(0) * f32(1) + f32(2) * f32(3), mt::bf16));

  EXPECT_THROW(mt::lincomb({a, b, c, mt::Tensor()}), mt::Error);
  EXPECT_THROW(mt::lincomb({a, b, c, mt::ones({4})}), mt::Error);  // 67 and 4 do not broadcast
  mt::Tensor n = mt::ones({67}, mt::i64);
  EXPECT_THROW(mt::lincomb({n, n, n, n}), mt::Error);
  EXPECT_FALSE(mt::lincomb({a.requires_grad_(true), b, c, d}).requires_grad());
}

TEST(CastRounding, DirectRoundToNearestEvenWithoutDoubleRounding) {
  // v sits just above the midpoint between 1 and the next f16, 1 + 2^-10. Rounded to f32 first,
  // it lands exactly on the midpoint, and the tie then goes to the even neighbour 1.0.
  const double v = 1 + 0x1p-11 + 0x1p-40;
  ASSERT_EQ(static_cast<double>(static_cast<float>(v)), 1 + 0x1p-11);
  ASSERT_EQ(mt::f16_bits_to_f32(mt::f32_to_f16_bits(static_cast<float>(v))), 1.0f);
  expect_same(values(mt::cast(make({v, -v}, {2}), mt::f16)), {1 + 0x1p-10, -1 - 0x1p-10});
  expect_same(values(make({v}, {1}, mt::f16)), {1 + 0x1p-10});
  const double w = 1 + 0x1p-8 + 0x1p-40;  // the same trap for bf16
  ASSERT_EQ(mt::bf16_bits_to_f32(mt::f32_to_bf16_bits(static_cast<float>(w))), 1.0f);
  expect_same(values(mt::cast(make({w, -w}, {2}), mt::bf16)), {1 + 0x1p-7, -1 - 0x1p-7});
  // Exact ties in f64 still go to even.
  expect_same(values(mt::cast(make({1 + 0x1p-11, 1 + 3 * 0x1p-11}, {2}), mt::f16)),
              {1, 1 + 0x1p-9});
  expect_same(values(mt::cast(make({1 + 0x1p-24, 1 + 0x1p-24 + 0x1p-50}, {2}), mt::f32)),
              {1, 1 + 0x1p-23});
  EXPECT_EQ(int_values(mt::cast(make({2.7, -2.7, -0.5, 1e6 + 0.5}, {4}), mt::i32)),
            (std::vector<int64_t>{2, -2, 0, 1000000}));
  EXPECT_EQ(mt::cast(make({0, -0.5, 2, kNan}, {4}), mt::boolean).to_vector<bool>(),
            (std::vector<bool>{false, true, true, true}));
  expect_same(values(mt::cast(ints({2049, -2051}, {2}), mt::f16)), {2048, -2052});
  expect_same(values(mt::cast(make({65504, 0x1p-24}, {2}, mt::f16), mt::f64)), {65504, 0x1p-24});
  expect_same(values(mt::cast(mt::tensor(std::vector<int64_t>{1, 0}, {2}, mt::boolean), mt::f32)),
              {1, 0});
  mt::Tensor x = make({1}, {1});
  EXPECT_TRUE(mt::cast(x, mt::f64).node() == x.node());  // no node for a same-dtype cast
}

TEST(Random, ReproducibleWithASeedAndRoughlyRightMoments) {
  mt::Generator g1(42), g2(42);
  Doubles a = values(mt::rand({1000}, mt::f32, &g1)), b = values(mt::rand({1000}, mt::f32, &g2));
  EXPECT_EQ(a, b);
  EXPECT_EQ(g1.offset(), 1000u);
  Doubles next = values(mt::rand({1000}, mt::f32, &g1));
  EXPECT_NE(a, next);
  mt::Generator g3(43);
  EXPECT_NE(a, values(mt::rand({1000}, mt::f32, &g3)));
  // f64 draws keep one counter per element (dsl/random.h); f32 and narrower ones take four
  // elements from each counter (runtime/random_fill.h, checked in tests/test_random.cpp).
  mt::Generator g4(42);
  Doubles a64 = values(mt::rand({1000}, mt::f64, &g4));
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(a64[i], mt::philox_uniform(42, 0, i)) << i;

  mt::manual_seed(7);
  Doubles d1 = values(mt::randn({5}));
  mt::manual_seed(7);
  EXPECT_EQ(values(mt::randn({5})), d1);

  const int n = 20000;
  mt::Generator g(2024);
  Doubles u = values(mt::rand({n}, mt::f64, &g));
  double mean = 0, var = 0;
  for (double x : u) mean += x / n;
  for (double x : u) var += (x - mean) * (x - mean) / n;
  EXPECT_GE(*std::min_element(u.begin(), u.end()), 0.0);
  EXPECT_LT(*std::max_element(u.begin(), u.end()), 1.0);
  EXPECT_NEAR(mean, 0.5, 0.01);
  EXPECT_NEAR(var, 1.0 / 12, 0.004);

  Doubles z = values(mt::randn({n}, mt::f64, &g));
  double zm = 0, zv = 0, within = 0;
  for (double x : z) zm += x / n;
  for (double x : z) {
    zv += (x - zm) * (x - zm) / n;
    within += std::abs(x) < 1 ? 1.0 / n : 0.0;
  }
  EXPECT_NEAR(zm, 0, 0.03);
  EXPECT_NEAR(zv, 1, 0.05);
  EXPECT_NEAR(within, 0.6827, 0.015);

  Doubles shifted = values(mt::randn({n}, mt::f64, &g, 3.0, 2.0));
  double sm = 0;
  for (double x : shifted) sm += x / n;
  EXPECT_NEAR(sm, 3.0, 0.06);
  Doubles ranged = values(mt::rand({n}, mt::f64, &g, -2.0, 5.0));
  EXPECT_GE(*std::min_element(ranged.begin(), ranged.end()), -2.0);
  EXPECT_LT(*std::max_element(ranged.begin(), ranged.end()), 5.0);

  // Half dtypes must stay below 1 too, although 1 - 2^-24 rounds to 1.0 at nearest.
  for (mt::DType dt : {mt::f16, mt::bf16}) {
    Doubles h = values(mt::rand({n}, dt, &g));
    EXPECT_LT(*std::max_element(h.begin(), h.end()), 1.0) << mt::name(dt);
    EXPECT_GE(*std::min_element(h.begin(), h.end()), 0.0) << mt::name(dt);
  }
  EXPECT_THROW(mt::rand({2}, mt::i32), mt::Error);
  EXPECT_THROW(mt::rand({2}, mt::f32, nullptr, 1.0, 0.5), mt::Error);
  EXPECT_THROW(mt::randn({2}, mt::f32, nullptr, 0.0, -1.0), mt::Error);
}

TEST(Philox, Random123KnownAnswers) {
  // Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11); the vectors of the
  // Random123 distribution's kat_vectors for philox4x32 with 10 rounds. Rederived here with an
  // independent implementation of the paper's round function before being written down.
  using Words = std::array<uint32_t, 4>;
  EXPECT_EQ(mt::philox4x32(0, 0, 0), (Words{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(mt::philox4x32(~0ull, ~0ull, ~0ull),
            (Words{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  // Counter words (lo to hi) 243f6a88 85a308d3 13198a2e 03707344, key a4093822 299f31d0: pi.
  EXPECT_EQ(mt::philox4x32(0x85a308d3243f6a88ull, 0x0370734413198a2eull, 0x299f31d0a4093822ull),
            (Words{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
  // f64 rand's element i of a fresh seed-0 generator: 53 bits, word 0 at counter i and the top
  // 21 of word 1.
  mt::Generator gen(0);
  EXPECT_EQ(mt::rand({1}, mt::f64, &gen).item(),
            static_cast<double>((uint64_t{0x6627e8d5u} << 21) | (0xe169c58du >> 11)) * 0x1p-53);
}

TEST(Dropout, KeepsTheExpectedFractionAndRescales) {
  const int n = 20000;
  for (double p : {0.3, 0.5}) {
    mt::Generator gen(5);
    mt::Tensor x = mt::ones({n});
    Doubles y = values(mt::dropout(x, p, true, &gen));
    const double kept_value = static_cast<float>(1.0 / (1.0 - p));
    double kept = 0, total = 0;
    for (double v : y) {
      if (v != 0) {
        EXPECT_EQ(v, kept_value);
        kept += 1;
      }
      total += v;
    }
    EXPECT_NEAR(kept / n, 1 - p, 0.015) << p;
    EXPECT_NEAR(total / n, 1.0, 0.03) << p;
    mt::Generator again(5);
    EXPECT_EQ(values(mt::dropout(x, p, true, &again)), y);
  }
  mt::Tensor x = make({1, 2, 3}, {3});
  EXPECT_TRUE(mt::dropout(x, 0.5, false).node() == x.node());
  EXPECT_TRUE(mt::dropout(x, 0.0).node() == x.node());
  expect_same(values(mt::dropout(x, 1.0)), {0, 0, 0});
  EXPECT_THROW(mt::dropout(x, 1.5), mt::Error);
  EXPECT_THROW(mt::dropout(ints({1}, {1}), 0.5), mt::Error);
}

TEST(CausalMask, LowerTriangleIncludingTheDiagonal) {
  mt::Tensor m = mt::causal_mask(4);
  EXPECT_EQ(m.dtype(), mt::boolean);
  EXPECT_EQ(m.shape(), (mt::Shape{4, 4}));
  std::vector<bool> got = m.to_vector<bool>();
  for (int q = 0; q < 4; ++q)
    for (int k = 0; k < 4; ++k) EXPECT_EQ(got[q * 4 + k], k <= q) << q << "," << k;
  EXPECT_EQ(mt::causal_mask(0).shape(), (mt::Shape{0, 0}));
  EXPECT_THROW(mt::causal_mask(-1), mt::Error);
}

// ---------------------------------------------------------------------------------------------
// PyTorch oracle: every case runs in mixtape, is saved with its inputs, and is recomputed by one
// Python process (tests/torch/ops_oracle.py).

bool torch_available() {
  return std::system("/usr/bin/python3 -c 'import torch, numpy' >/dev/null 2>&1") == 0;
}

std::string torch_dtype(mt::DType dt) {
  switch (dt) {
    case mt::DType::f32:
      return "torch.float32";
    case mt::DType::f64:
      return "torch.float64";
    case mt::DType::f16:
      return "torch.float16";
    case mt::DType::bf16:
      return "torch.bfloat16";
    case mt::DType::i32:
      return "torch.int32";
    case mt::DType::i64:
      return "torch.int64";
    case mt::DType::boolean:
      return "torch.bool";
  }
  return "";
}

class Oracle {
 public:
  // Tolerances default by output dtype: exact for integers, bool and the half types (whose
  // references round the same f32/f64 value once), a few ulps for f32 and f64.
  void add(const std::string& name, const Tensors& inputs, const mt::Tensor& out,
           const std::string& expr, double rtol = -1, double atol = -1) {
    EXPECT_TRUE(names_.insert(name).second) << "duplicate case " << name;
    EXPECT_EQ(name.find_first_of(" \n:"), std::string::npos) << name;
    if (rtol < 0) {
      rtol = out.dtype() == mt::f64 ? 1e-12 : out.dtype() == mt::f32 ? 1e-5 : 0;
      atol = out.dtype() == mt::f64 ? 1e-13 : out.dtype() == mt::f32 ? 1e-6 : 0;
    }
    for (size_t i = 0; i < inputs.size(); ++i)
      tensors_.emplace_back(fmt::format("{}/in{}", name, i), inputs[i]);
    tensors_.emplace_back(name + "/out", out);
    metadata_.emplace_back("expr/" + name, expr);
    metadata_.emplace_back("tol/" + name, fmt::format("{:.17g} {:.17g}", rtol, atol));
    // Evaluation drops the inputs of nodes no gradient flows through, so record ops now.
    std::vector<const mt::Node*> stack{out.node().get()};
    std::unordered_set<const mt::Node*> seen;
    while (!stack.empty()) {
      const mt::Node* n = stack.back();
      stack.pop_back();
      if (!seen.insert(n).second) continue;
      covered_.insert(n->op);
      for (const mt::NodePtr& input : n->inputs) stack.push_back(input.get());
    }
  }
  const std::set<std::string>& names() const { return names_; }
  const std::set<OpCode>& covered() const { return covered_; }
  const mt::NamedTensors& tensors() const { return tensors_; }
  const mt::Metadata& metadata() const { return metadata_; }

 private:
  std::set<std::string> names_;
  std::set<OpCode> covered_;
  mt::NamedTensors tensors_;
  mt::Metadata metadata_;
};

struct Data {
  mt::Generator gen{20240607};
  Doubles normal(int64_t n, double scale = 1) {
    Doubles v = values(mt::randn({n}, mt::f64, &gen));
    for (double& x : v) x *= scale;
    return v;
  }
  Doubles uniform(int64_t n, double low, double high) {
    return values(mt::rand({n}, mt::f64, &gen, low, high));
  }
  mt::Tensor randn(mt::Shape shape, mt::DType dt, double scale = 1) {
    return make(normal(mt::numel(shape), scale), shape, dt);
  }
};

void add_pointwise_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  const std::map<std::string, std::string> unary_torch = {
      {"neg", "-a"},
      {"abs", "a.abs()"},
      {"sign", "a.sign()"},
      {"exp", "a.exp()"},
      {"log", "a.log()"},
      {"sqrt", "a.sqrt()"},
      {"rsqrt", "a.rsqrt()"},
      {"reciprocal", "a.reciprocal()"},
      {"square", "a * a"},
      {"tanh", "a.tanh()"},
      {"sigmoid", "a.sigmoid()"},
      {"relu", "torch.relu(a)"},
      {"gelu", "F.gelu(a)"},
      {"gelu_tanh", "F.gelu(a, approximate='tanh')"},
      {"silu", "F.silu(a)"},
      {"erf", "torch.erf(a)"},
      {"sin", "a.sin()"},
      {"cos", "a.cos()"},
      {"stop_gradient", "a"},
      {"log1p", "a.log1p()"},
      {"expm1", "a.expm1()"},
      {"asin", "a.asin()"},
      {"acos", "a.acos()"},
      {"atan", "a.atan()"},
      {"sinh", "a.sinh()"},
      {"cosh", "a.cosh()"},
      {"floor", "a.floor()"},
      {"ceil", "a.ceil()"},
      {"trunc", "a.trunc()"},
      {"round", "a.round()"},
  };
  const std::map<std::string, std::string> binary_torch = {
      {"add", "a + b"},
      {"sub", "a - b"},
      {"mul", "a * b"},
      {"div", "a / b"},
      {"pow", "torch.pow(a, b)"},
      {"atan2", "torch.atan2(a, b)"},
      {"fmod", "torch.fmod(a, b)"},
      {"maximum", "torch.maximum(a, b)"},
      {"minimum", "torch.minimum(a, b)"},
      {"eq", "a == b"},
      {"ne", "a != b"},
      {"lt", "a < b"},
      {"le", "a <= b"},
      {"gt", "a > b"},
      {"ge", "a >= b"},
      // ATen's backward ops take same-shaped contiguous tensors (its oneDNN path refuses others).
      {"gelu_backward", "torch.ops.aten.gelu_backward(*same_shape(a, b))"},
      {"gelu_tanh_backward", "torch.ops.aten.gelu_backward(*same_shape(a, b), approximate='tanh')"},
      {"silu_backward", "torch.ops.aten.silu_backward(*same_shape(a, b))"},
  };
  using Binary = std::function<mt::Tensor(const mt::Tensor&, const mt::Tensor&)>;
  std::map<std::string, std::function<mt::Tensor(const mt::Tensor&)>> unary;
  std::map<std::string, Binary> binary;
#define MT_OP(Name, fname, kind, arity, category)
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  unary[#fname] = [](const mt::Tensor& a) { return mt::fname(a); };
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1) \
  binary[#fname] = [](const mt::Tensor& a, const mt::Tensor& b) { return mt::fname(a, b); };
#define MT_COMPARE(Name, fname, REF) \
  binary[#fname] = [](const mt::Tensor& a, const mt::Tensor& b) { return mt::fname(a, b); };
#include "mixtape/dsl/ops.def"

  // Random values around the interesting range plus the IEEE special values.
  Doubles specials = {kNan, kInf, -kInf, 0.0, -0.0, 0.5, -0.5};
  for (const auto& [fname, build] : unary) {
    auto torch = unary_torch.find(fname);
    if (torch == unary_torch.end()) {
      ADD_FAILURE() << "unary op '" << fname << "' has no PyTorch reference";
      continue;
    }
    Doubles v = d.normal(15, 2.0);
    v.insert(v.end(), specials.begin(), specials.end());
    mt::Tensor a = make(v, {2, 11}, dt);
    o.add(fmt::format("unary/{}/{}", fname, t), {a}, build(a), torch->second);
  }
  for (const auto& [fname, build] : binary) {
    auto torch = binary_torch.find(fname);
    if (torch == binary_torch.end()) {
      ADD_FAILURE() << "binary op '" << fname << "' has no PyTorch reference";
      continue;
    }
    // Halves make exact ties for the comparisons; NaN, inf and 0 sit in both operands.
    Doubles av = d.normal(12, 2.0), bv = d.normal(5, 2.0);
    for (double& x : av) x = std::round(x * 2) / 2;
    for (double& x : bv) x = std::round(x * 2) / 2;
    if (fname == "pow")
      for (double& x : av) x = std::abs(x) + 0.25;
    av[0] = kNan;
    av[1] = kInf;
    bv[2] = kNan;
    bv[3] = 0;
    mt::Tensor a = make(av, {3, 1, 4}, dt), b = make(bv, {5, 1}, dt);
    o.add(fmt::format("binary/{}/{}", fname, t), {a, b}, build(a, b), torch->second);
  }
  mt::Tensor cond = mt::tensor(std::vector<int64_t>{1, 0, 1}, {3, 1}, mt::boolean);
  mt::Tensor a = d.randn({5}, dt), b = d.randn({3, 5}, dt);
  o.add("where/" + t, {cond, a, b}, mt::where(cond, a, b), "torch.where(a, b, c)");
  o.add("scalar_operators/" + t, {a}, (a * 3.0 - 1.5) / 2.0 + 1.0 / a, "(a * 3 - 1.5) / 2 + 1 / a");
  // The fused update arithmetic, as torch.optim.Adam's single-tensor step writes it.
  std::array<mt::Tensor, 7> u;
  for (mt::Tensor& x : u) x = d.randn({3, 5}, dt);
  u[3] = mt::abs(u[3]) + 0.1;   // a running mean of squares
  u[5] = mt::abs(u[5]) * 1e-3;  // eps
  o.add("mul_add/" + t, {u[0], u[1], u[2]}, mt::mul_add({u[0], u[1], u[2]}), "a.mul(b).add(c)");
  o.add("sub_mul/" + t, {u[0], u[1], u[2]}, mt::sub_mul({u[0], u[1], u[2]}), "a.sub(b.mul(c))");
  o.add("lincomb/" + t, {u[0], u[1], u[2], u[3]}, mt::lincomb({u[0], u[1], u[2], u[3]}),
        "a.mul(b).add(c.mul(d))");
  o.add("lincomb_square/" + t, {u[0], u[1], u[2], u[3]},
        mt::lincomb_square({u[0], u[1], u[2], u[3]}), "a.mul(b).addcmul(c, c * d)");
  o.add("adam_step/" + t, {u[0], u[1], u[2], u[3], u[4], u[5], u[6]}, mt::adam_step(u),
        "a.mul(b).sub(c.div(d.sqrt().mul(e).add(f)).mul(g))");
}

void add_reduction_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  mt::Tensor x = d.randn({3, 4, 5}, dt);
  double rtol = dt == mt::f32 ? 1e-5 : 1e-12, atol = dt == mt::f32 ? 1e-5 : 1e-12;
  auto add = [&](const std::string& name, const mt::Tensor& y, const std::string& expr) {
    o.add(name + "/" + t, {x}, y, expr, rtol, atol);
  };
  add("sum/all", mt::sum(x), "a.sum()");
  add("sum/axis1", mt::sum(x, {1}), "a.sum(1)");
  add("sum/axes02_keepdim", mt::sum(x, {0, 2}, true), "a.sum((0, 2), keepdim=True)");
  add("mean/last", mt::mean(x, {-1}), "a.mean(-1)");
  add("var/axis0", mt::var(x, {0}, false, 0), "a.var(0, unbiased=False)");
  add("var/all_keepdim", mt::var(x, {}, true, 0), "a.var((0, 1, 2), unbiased=False, keepdim=True)");
  add("var/axis2_unbiased", mt::var(x, {2}), "a.var(2)");
  add("var/axes01_correction2", mt::var(x, {0, 1}, false, 2), "a.var((0, 1), correction=2)");
  add("max/axis2", mt::max(x, {2}), "a.amax(2)");
  add("max/axes01_keepdim", mt::max(x, {0, 1}, true), "a.amax((0, 1), keepdim=True)");
  add("max/all", mt::max(x), "a.amax()");
  add("min/axis1", mt::min(x, {1}), "a.amin(1)");
  add("argmax/axis1", mt::argmax(x, 1), "a.argmax(1)");
  add("argmax/flat_keepdim", mt::argmax(x, std::nullopt, true), "a.argmax().reshape(1, 1, 1)");
  add("logsumexp/last", mt::logsumexp(x), "torch.logsumexp(a, -1)");
  add("logsumexp/axes01_keepdim", mt::logsumexp(x, {0, 1}, true),
      "torch.logsumexp(a, (0, 1), keepdim=True)");
  // Small integers tie often: both pick the first of equal maxima.
  Doubles tied = d.normal(60, 1.5);
  for (double& v : tied) v = std::round(v);
  mt::Tensor ties = make(tied, {3, 4, 5}, dt);
  o.add("argmax/ties_axis2/" + t, {ties}, mt::argmax(ties, 2), "a.argmax(2)");
  o.add("argmax/ties_axis0/" + t, {ties}, mt::argmax(ties, 0), "a.argmax(0)");
}

void add_matmul_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  double rtol = dt == mt::f32 ? 1e-5 : 1e-12, atol = dt == mt::f32 ? 1e-5 : 1e-12;
  struct Case {
    std::string name;
    mt::Shape a, b;
    bool ta, tb;
    std::string expr;
  };
  const std::vector<Case> cases = {
      {"plain", {3, 4}, {4, 5}, false, false, "a @ b"},
      {"ta_tb", {4, 3}, {5, 4}, true, true, "a.mT @ b.mT"},
      {"tb_batched", {2, 3, 4}, {5, 4}, false, true, "a @ b.mT"},
      {"batch_broadcast", {2, 1, 3, 4}, {5, 4, 2}, false, false, "a @ b"},
      {"vector_left", {4}, {2, 4, 3}, false, false, "a @ b"},
      {"vector_right", {2, 3, 4}, {4}, false, false, "a @ b"},
      {"dot", {4}, {4}, false, false, "a @ b"},
  };
  for (const Case& c : cases) {
    mt::Tensor a = d.randn(c.a, dt), b = d.randn(c.b, dt);
    o.add("matmul/" + c.name + "/" + t, {a, b}, mt::matmul(a, b, c.ta, c.tb), c.expr, rtol, atol);
  }
  mt::Tensor x = d.randn({2, 3}, dt), w = d.randn({4, 3}, dt), bias = d.randn({4}, dt);
  o.add("linear/" + t, {x, w, bias}, mt::linear(x, w, bias), "F.linear(a, b, c)", rtol, atol);
}

std::string join_dims(const mt::Shape& shape) {
  std::string text;
  for (int64_t d : shape) text += std::to_string(d) + ", ";
  return text;
}

// The three convolution primitives (torch.nn.grad has the two gradients) and the composites.
void add_conv_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  double rtol = dt == mt::f32 ? 1e-5 : 1e-12, atol = dt == mt::f32 ? 1e-5 : 1e-12;
  struct Case {
    std::string name;
    mt::Shape x, w;
    mt::Conv2dOptions options;
  };
  const std::vector<Case> cases = {
      {"plain", {2, 3, 6, 5}, {4, 3, 3, 3}, {}},
      {"strided_padded",
       {1, 4, 9, 8},
       {6, 2, 3, 2},
       {.stride = {2, 3}, .padding = {1, 2}, .groups = 2}},
      {"dilated_depthwise", {2, 3, 7, 7}, {3, 1, 3, 3}, {.padding = 2, .dilation = 2, .groups = 3}},
  };
  for (const Case& c : cases) {
    const mt::Conv2dOptions& p = c.options;
    const mt::ConvWindow window = mt::ConvWindow::of(p);
    const std::string args =
        fmt::format("stride=({}, {}), padding=({}, {}), dilation=({}, {}), groups={}", p.stride.h,
                    p.stride.w, p.padding.h, p.padding.w, p.dilation.h, p.dilation.w, p.groups);
    mt::Tensor x = d.randn(c.x, dt), w = d.randn(c.w, dt), bias = d.randn({c.w[0]}, dt);
    mt::Tensor y = mt::conv2d(x, w, bias, p);
    o.add("conv2d/" + c.name + "/" + t, {x, w, bias}, y, "F.conv2d(a, b, c, " + args + ")", rtol,
          atol);
    mt::Tensor gy = d.randn(y.shape(), dt);
    o.add("conv2d_input_grad/" + c.name + "/" + t, {gy, w},
          mt::conv2d_input_grad(gy, w, c.x, window),
          fmt::format("torch.nn.grad.conv2d_input(({}), b, a, {})", join_dims(c.x), args), rtol,
          atol);
    o.add("conv2d_weight_grad/" + c.name + "/" + t, {x, gy},
          mt::conv2d_weight_grad(x, gy, c.w, window),
          fmt::format("torch.nn.grad.conv2d_weight(a, ({}), b, {})", join_dims(c.w), args), rtol,
          atol);
  }
  // Padding rules and modes: torch.nn's modules pad as they do (the odd one of 'same' after),
  // and F.conv2d / F.conv1d take 'same' and 'valid'.
  mt::Tensor xs = d.randn({2, 4, 7, 6}, dt), ws = d.randn({6, 2, 4, 3}, dt), bs = d.randn({6}, dt);
  o.add("conv2d/same_even_kernel/" + t, {xs, ws, bs},
        mt::conv2d(xs, ws, bs, {.padding = mt::Padding::Same, .dilation = {1, 2}, .groups = 2}),
        "F.conv2d(a, b, c, padding='same', dilation=(1, 2), groups=2)", rtol, atol);
  o.add("conv2d/valid/" + t, {xs, ws},
        mt::conv2d(xs, ws, {}, {.stride = {2, 1}, .padding = mt::Padding::Valid, .groups = 2}),
        "F.conv2d(a, b, stride=(2, 1), padding='valid', groups=2)", rtol, atol);
  const std::pair<mt::PadMode, const char*> modes[] = {{mt::PadMode::Reflect, "reflect"},
                                                       {mt::PadMode::Replicate, "replicate"},
                                                       {mt::PadMode::Circular, "circular"}};
  for (const auto& [mode, mode_name] : modes) {
    o.add(fmt::format("conv2d/same_{}/{}", mode_name, t), {xs, ws, bs},
          mt::conv2d(xs, ws, bs, {.padding = mt::Padding::Same, .groups = 2, .padding_mode = mode}),
          fmt::format("conv_module(torch.nn.Conv2d, a, b, c, padding='same', groups=2, "
                      "padding_mode='{}')",
                      mode_name),
          rtol, atol);
    o.add(
        fmt::format("conv2d/padded_{}/{}", mode_name, t), {xs, ws},
        mt::conv2d(xs, ws, {}, {.stride = 2, .padding = {2, 1}, .groups = 2, .padding_mode = mode}),
        fmt::format("conv_module(torch.nn.Conv2d, a, b, None, stride=2, padding=(2, 1), "
                    "groups=2, padding_mode='{}')",
                    mode_name),
        rtol, atol);
  }
  mt::Tensor xl = d.randn({2, 4, 9}, dt), wl = d.randn({6, 2, 4}, dt);
  o.add("conv1d/same_even_kernel/" + t, {xl, wl},
        mt::conv1d(xl, wl, {}, {.padding = mt::Padding::Same, .dilation = 3, .groups = 2}),
        "F.conv1d(a, b, padding='same', dilation=3, groups=2)", rtol, atol);
  o.add(
      "conv1d/same_reflect/" + t, {xl, wl},
      mt::conv1d(xl, wl, {},
                 {.padding = mt::Padding::Same, .groups = 2, .padding_mode = mt::PadMode::Reflect}),
      "conv_module(torch.nn.Conv1d, a, b, None, padding='same', groups=2, "
      "padding_mode='reflect')",
      rtol, atol);
  // im2col and col2im, and adaptive max pooling (unequal and equal windows).
  mt::Tensor xu = d.randn({2, 3, 6, 7}, dt);
  o.add("unfold/" + t, {xu}, mt::unfold(xu, {2, 3}, {1, 2}, {1, 0}, {2, 1}),
        "F.unfold(a, (2, 3), dilation=(1, 2), padding=(1, 0), stride=(2, 1))", rtol, atol);
  mt::Tensor xf = d.randn({2, 18, 28}, dt);
  o.add("fold/" + t, {xf}, mt::fold(xf, {7, 6}, {2, 3}, {2, 1}, {1, 2}, {1, 2}),
        "F.fold(a, (7, 6), (2, 3), dilation=(2, 1), padding=(1, 2), stride=(1, 2))", rtol, atol);
  mt::Tensor xr = d.randn({1, 4, 4}, dt);  // the blocks leave the last row and column
  o.add("fold_uncovered/" + t, {xr}, mt::fold(xr, {5, 5}, 2, 1, 0, 2),
        "F.fold(a, (5, 5), 2, stride=2)", rtol, atol);
  mt::Tensor xa = d.randn({2, 3, 7, 6}, dt);
  o.add("adaptive_max_pool2d/" + t, {xa}, mt::adaptive_max_pool2d(xa, {3, 4}),
        "F.adaptive_max_pool2d(a, (3, 4))", rtol, atol);
  o.add("adaptive_max_pool2d_equal/" + t, {xa}, mt::adaptive_max_pool2d(xa, {7, 2}),
        "F.adaptive_max_pool2d(a, (7, 2))", rtol, atol);
  // grid_sample in every mode, padding and align_corners, at points inside and outside the
  // input: values and both gradients (torch.autograd.grad); affine_grid's grids.
  mt::Tensor spread_image = d.randn({2, 3, 5, 4}, dt),
             spread = make(d.uniform(72, -1.3, 1.3), {2, 3, 6, 2}, dt);
  mt::Tensor spread_seed = d.randn({2, 3, 3, 6}, dt);
  const std::pair<mt::GridSampleMode, const char*> sample_modes[] = {
      {mt::GridSampleMode::Bilinear, "bilinear"},
      {mt::GridSampleMode::Nearest, "nearest"},
      {mt::GridSampleMode::Bicubic, "bicubic"}};
  const std::pair<mt::GridPadding, const char*> paddings[] = {
      {mt::GridPadding::Zeros, "zeros"},
      {mt::GridPadding::Border, "border"},
      {mt::GridPadding::Reflection, "reflection"}};
  // Points on the limits, where border and reflection clip (no gradient there, as PyTorch's).
  mt::Tensor limits = make({-1.0, 0.0, 1.0,  0.0, 0.5, -1.0,  0.0, 1.0, -1.0, -1.0, 1.0,  1.0,
                            0.25, 0.5, -0.5, 0.0, 1.0, -0.25, 0.0, 0.0, 0.75, 1.0,  -1.0, 0.5},
                           {1, 3, 4, 2}, dt);
  mt::Tensor limits_image = d.randn({1, 2, 3, 4}, dt), limits_seed = d.randn({1, 2, 3, 4}, dt);
  // Volumes: trilinear and nearest over (x, y, z) points.
  mt::Tensor volume = d.randn({2, 2, 3, 4, 5}, dt),
             volume_points = make(d.uniform(144, -1.3, 1.3), {2, 2, 3, 4, 3}, dt),
             volume_seed = d.randn({2, 2, 2, 3, 4}, dt);
  const std::tuple<const char*, mt::Tensor, mt::Tensor, mt::Tensor> grids[] = {
      {"", spread_image, spread, spread_seed},
      {"limits_", limits_image, limits, limits_seed},
      {"volume_", volume, volume_points, volume_seed}};
  for (const auto& [grid_name, image, points, seed] : grids)
    for (const auto& [mode, mode_name] : sample_modes)
      for (const auto& [padding, padding_name] : paddings)
        for (bool align : {false, true}) {
          // PyTorch's bicubic is 2-d only.
          if (image.dim() == 5 && mode == mt::GridSampleMode::Bicubic) continue;
          const std::string label = fmt::format("{}{}_{}_{}/{}", grid_name, mode_name, padding_name,
                                                align ? "corners" : "edges", t);
          const std::string args = fmt::format("mode='{}', padding_mode='{}', align_corners={}",
                                               mode_name, padding_name, align ? "True" : "False");
          mt::Tensor x = image.detach(), g = points.detach();
          x.requires_grad_();
          g.requires_grad_();
          mt::Tensor y = mt::grid_sample(
              x, g, {.mode = mode, .padding_mode = padding, .align_corners = align});
          // Nearest's grid takes no gradient (PyTorch's is zeros).
          std::vector<mt::Tensor> grads = mt::grad({y}, {x, g}, {seed}, false, true);
          if (!grads[1].defined()) grads[1] = mt::zeros_like(points);
          o.add("grid_sample/" + label, {image, points}, y.detach(),
                "F.grid_sample(a, b, " + args + ")", rtol, atol);
          const std::string both =
              "(lambda x, g: torch.autograd.grad(F.grid_sample(x, g, " + args +
              "), (x, g), c))(a.clone().requires_grad_(), b.clone().requires_grad_())";
          o.add("grid_sample_grad_input/" + label, {image, points, seed}, grads[0], both + "[0]",
                rtol, atol);
          o.add("grid_sample_grad_grid/" + label, {image, points, seed}, grads[1], both + "[1]",
                rtol, atol);
        }
  mt::Tensor theta = d.randn({2, 2, 3}, dt);
  o.add("affine_grid/" + t, {theta}, mt::affine_grid(theta, {2, 3, 4, 5}),
        "F.affine_grid(a, (2, 3, 4, 5), align_corners=False)", rtol, atol);
  o.add("affine_grid_corners/" + t, {theta}, mt::affine_grid(theta, {2, 1, 1, 6}, true),
        "F.affine_grid(a, (2, 1, 1, 6), align_corners=True)", rtol, atol);
  // Points on ties: a volume halved by an identity grid (every point halfway between two voxels,
  // which PyTorch's 3-d nearest rounds away from zero) and a lattice of eighths.
  mt::Tensor cube = d.randn({1, 2, 4, 4, 4}, dt);
  mt::Tensor identity = make({1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0}, {1, 3, 4}, dt);
  std::vector<double> eighths;
  for (int k = 0; k < 3 * 5 * 4 * 3; ++k) eighths.push_back(static_cast<double>(k % 17 - 8) / 8);
  mt::Tensor lattice = make(eighths, {1, 3, 5, 4, 3}, dt);
  for (const auto& [padding, padding_name] : paddings)
    for (bool align : {false, true}) {
      const std::string args = fmt::format("mode='nearest', padding_mode='{}', align_corners={}",
                                           padding_name, align ? "True" : "False");
      const mt::GridSampleOptions options{
          .mode = mt::GridSampleMode::Nearest, .padding_mode = padding, .align_corners = align};
      const std::string label =
          fmt::format("{}_{}/{}", padding_name, align ? "corners" : "edges", t);
      o.add("grid_sample/volume_halved_nearest_" + label, {cube, identity},
            mt::grid_sample(cube, mt::affine_grid(identity, {1, 2, 2, 2, 2}, align), options),
            fmt::format("F.grid_sample(a, F.affine_grid(b, (1, 2, 2, 2, 2), align_corners={}), {})",
                        align ? "True" : "False", args),
            rtol, atol);
      o.add("grid_sample/volume_eighths_nearest_" + label, {cube, lattice},
            mt::grid_sample(cube, lattice, options), "F.grid_sample(a, b, " + args + ")", rtol,
            atol);
    }
  mt::Tensor theta3 = d.randn({2, 3, 4}, dt);
  o.add("affine_grid_3d/" + t, {theta3}, mt::affine_grid(theta3, {2, 3, 4, 5, 6}),
        "F.affine_grid(a, (2, 3, 4, 5, 6), align_corners=False)", rtol, atol);
  o.add("affine_grid_3d_corners/" + t, {theta3}, mt::affine_grid(theta3, {2, 1, 1, 3, 2}, true),
        "F.affine_grid(a, (2, 1, 1, 3, 2), align_corners=True)", rtol, atol);
  // interpolate's other modes: linear and trilinear (values and the input's gradient), nearest
  // on volumes, nearest-exact and area on lines, images and volumes.
  struct Resize {
    std::string name;
    mt::Tensor x;
    mt::InterpolateOptions options;
    std::string args;
  };
  mt::Tensor line = d.randn({2, 3, 7}, dt), image = d.randn({2, 3, 5, 6}, dt),
             box = d.randn({1, 2, 5, 7, 6}, dt);
  const Resize resizes[] = {
      {"linear",
       line,
       {.size = {11}, .mode = mt::InterpolateMode::Linear},
       "size=11, mode='linear'"},
      {"linear_corners_down",
       line,
       {.size = {4}, .mode = mt::InterpolateMode::Linear, .align_corners = true},
       "size=4, mode='linear', align_corners=True"},
      // A long axis, where positions in float throughout moved samples by 1e-3.
      {"linear_long",
       d.randn({1, 1, 3000}, dt),
       {.size = {4711}, .mode = mt::InterpolateMode::Linear},
       "size=4711, mode='linear'"},
      {"linear_scale",
       line,
       {.scale_factor = {1.7}, .mode = mt::InterpolateMode::Linear},
       "scale_factor=1.7, mode='linear'"},
      {"trilinear",
       box,
       {.size = {7, 3, 9}, .mode = mt::InterpolateMode::Trilinear},
       "size=(7, 3, 9), mode='trilinear'"},
      {"trilinear_corners",
       box,
       {.size = {3, 9, 4}, .mode = mt::InterpolateMode::Trilinear, .align_corners = true},
       "size=(3, 9, 4), mode='trilinear', align_corners=True"},
      {"nearest_volume", box, {.size = {7, 3, 9}}, "size=(7, 3, 9), mode='nearest'"},
      {"nearest_exact_line",
       line,
       {.size = {11}, .mode = mt::InterpolateMode::NearestExact},
       "size=11, mode='nearest-exact'"},
      {"nearest_exact_image",
       image,
       {.scale_factor = {1.5, 0.7}, .mode = mt::InterpolateMode::NearestExact},
       "scale_factor=(1.5, 0.7), mode='nearest-exact'"},
      {"nearest_exact_volume",
       box,
       {.size = {3, 9, 4}, .mode = mt::InterpolateMode::NearestExact},
       "size=(3, 9, 4), mode='nearest-exact'"},
      {"area_line", line, {.size = {3}, .mode = mt::InterpolateMode::Area}, "size=3, mode='area'"},
      {"area_image",
       image,
       {.size = {3, 4}, .mode = mt::InterpolateMode::Area},
       "size=(3, 4), mode='area'"},
      {"area_volume",
       box,
       {.size = {2, 3, 4}, .mode = mt::InterpolateMode::Area},
       "size=(2, 3, 4), mode='area'"},
  };
  for (const Resize& r : resizes) {
    mt::Tensor x = r.x.detach();
    x.requires_grad_();
    mt::Tensor y = mt::interpolate(x, r.options);
    mt::Tensor seed = d.randn(y.shape(), dt);
    o.add("interpolate/" + r.name + "/" + t, {r.x}, y.detach(), "F.interpolate(a, " + r.args + ")",
          rtol, atol);
    o.add("interpolate_grad/" + r.name + "/" + t, {r.x, seed}, mt::grad({y}, {x}, {seed})[0],
          "(lambda x: torch.autograd.grad(F.interpolate(x, " + r.args +
              "), x, b))(a.clone().requires_grad_())[0]",
          rtol, atol);
  }
  // Max pooling's two primitives: PyTorch's forward and its autograd gradient.
  mt::Tensor xp = d.randn({2, 3, 9, 8}, dt);
  mt::PoolWindow pool;
  pool.kernel[0] = 3, pool.kernel[1] = 2, pool.stride[0] = pool.stride[1] = 2, pool.pad[0] = 1;
  pool.dil[1] = 2;
  const std::string pool_args = "(3, 2), (2, 2), (1, 0), (1, 2), True";
  mt::Tensor yp = mt::max_pool2d_forward(xp, pool, {5, 4});  // ceil mode: 9 -> 5, 8 -> 4
  o.add("max_pool2d_forward/" + t, {xp}, yp, "F.max_pool2d(a, " + pool_args + ")", rtol, atol);
  mt::ValuesIndices picked =
      mt::max_pool2d_with_indices(xp, {3, 2}, mt::Size2{2, 2}, {1, 0}, {1, 2}, true);
  o.add("max_pool2d_indices/" + t, {xp}, picked.indices,
        "F.max_pool2d(a, " + pool_args + ", return_indices=True)[1]");
  o.add("max_pool2d_with_indices/" + t, {xp}, picked.values,
        "F.max_pool2d(a, " + pool_args + ", return_indices=True)[0]", rtol, atol);
  // Ties, NaN and windows of only -inf (their first tap inside the input), padded.
  mt::Tensor special =
      make({-kInf, -kInf, -kInf, 1.0,   1.0,   0.5, -kInf, -kInf, -kInf, kNan,  2.0, kNan,
            0.0,   0.0,   0.0,   -kInf, -kInf, 3.0, 3.0,   -kInf, -kInf, -kInf, 1.0, 1.0},
           {1, 2, 3, 4}, dt);
  o.add("max_pool2d_indices_special/" + t, {special},
        mt::max_pool2d_with_indices(special, {2, 2}, mt::Size2{1, 2}, {1, 1}).indices,
        "F.max_pool2d(a, (2, 2), (1, 2), (1, 1), return_indices=True)[1]");
  mt::Tensor xq = d.randn({2, 3, 6, 4}, dt);
  mt::ValuesIndices pooled = mt::max_pool2d_with_indices(xq, 2);
  o.add("max_unpool2d/" + t, {pooled.values, pooled.indices},
        mt::max_unpool2d(pooled.values, pooled.indices, 2), "F.max_unpool2d(a, b, 2)", rtol, atol);
  o.add("max_unpool2d_sized/" + t, {pooled.values, pooled.indices},
        mt::max_unpool2d(pooled.values, pooled.indices, 2, std::nullopt, 0, mt::Size2{7, 5}),
        "F.max_unpool2d(a, b, 2, output_size=(7, 5))", rtol, atol);
  // The 1-d and 3-d return_indices (two 2-d passes) and unpooling, with ties (small integers)
  // and NaN: the pick PyTorch's kernels make.
  mt::Tensor xv = mt::round(d.randn({2, 3, 5, 6, 7}, dt));
  const std::string v_args = "(3, 2, 3), (2, 1, 2), (1, 0, 1), (1, 2, 1), True";
  mt::ValuesIndices picked3 =
      mt::max_pool3d_with_indices(xv, {3, 2, 3}, mt::Size3{2, 1, 2}, {1, 0, 1}, {1, 2, 1}, true);
  o.add("max_pool3d_indices/" + t, {xv}, picked3.indices,
        "F.max_pool3d(a, " + v_args + ", return_indices=True)[1]");
  o.add("max_pool3d_with_indices/" + t, {xv}, picked3.values,
        "F.max_pool3d(a, " + v_args + ", return_indices=True)[0]", rtol, atol);
  mt::Tensor special3 = mt::reshape(special, {1, 2, 1, 3, 4});
  o.add("max_pool3d_indices_special/" + t, {special3},
        mt::max_pool3d_with_indices(special3, {1, 2, 2}, mt::Size3{1, 1, 2}, {0, 1, 1}).indices,
        "F.max_pool3d(a, (1, 2, 2), (1, 1, 2), (0, 1, 1), return_indices=True)[1]");
  mt::ValuesIndices pooled3 =
      mt::max_pool3d_with_indices(mt::squeeze(mt::slice(xv, 0, 0, 1), 0), 2);
  o.add("max_unpool3d_sized/" + t, {pooled3.values, pooled3.indices},
        mt::max_unpool3d(pooled3.values, pooled3.indices, 2, std::nullopt, 0, mt::Size3{5, 7, 7}),
        "F.max_unpool3d(a, b, 2, output_size=(5, 7, 7))", rtol, atol);
  mt::Tensor xl1 = mt::round(d.randn({2, 3, 11}, dt));
  mt::ValuesIndices picked1 = mt::max_pool1d_with_indices(xl1, 3, 2, 1, 2, true);
  o.add("max_pool1d_indices/" + t, {xl1}, picked1.indices,
        "F.max_pool1d(a, 3, 2, 1, 2, True, return_indices=True)[1]");
  mt::ValuesIndices pooled1 = mt::max_pool1d_with_indices(xl1, 3, 2, 1);
  o.add("max_unpool1d/" + t, {pooled1.values, pooled1.indices},
        mt::max_unpool1d(pooled1.values, pooled1.indices, 3, 2, 1, 11),
        "F.max_unpool1d(a, b, 3, 2, 1, output_size=(11,))", rtol, atol);
  mt::Tensor gyp = d.randn(yp.shape(), dt);
  o.add("max_pool2d_grad/" + t, {xp, gyp}, mt::max_pool2d_grad(xp, gyp, pool),
        "(lambda x: torch.autograd.grad(F.max_pool2d(x, " + pool_args +
            "), x, b)[0])(a.clone().requires_grad_())",
        rtol, atol);
  mt::Tensor x1 = d.randn({2, 4, 11}, dt), w1 = d.randn({6, 2, 3}, dt), b1 = d.randn({6}, dt);
  o.add("conv1d/" + t, {x1, w1, b1},
        mt::conv1d(x1, w1, b1, {.stride = 2, .padding = 1, .dilation = 2, .groups = 2}),
        "F.conv1d(a, b, c, stride=2, padding=1, dilation=2, groups=2)", rtol, atol);
  mt::Tensor xt = d.randn({2, 4, 3, 4}, dt), wt = d.randn({4, 3, 3, 2}, dt), bt = d.randn({6}, dt);
  o.add(
      "conv_transpose2d/" + t, {xt, wt, bt},
      mt::conv_transpose2d(
          xt, wt, bt, {.stride = {2, 3}, .padding = {1, 0}, .output_padding = {1, 2}, .groups = 2}),
      "F.conv_transpose2d(a, b, c, stride=(2, 3), padding=(1, 0), output_padding=(1, 2), "
      "groups=2)",
      rtol, atol);
  // output_padding of a stride or more (below the dilation), which PyTorch takes.
  mt::Tensor wd = d.randn({4, 3, 2, 3}, dt);
  o.add("conv_transpose2d_dilated/" + t, {xt, wd},
        mt::conv_transpose2d(
            xt, wd, {},
            {.stride = {1, 2}, .padding = {0, 1}, .output_padding = {2, 3}, .dilation = {3, 4}}),
        "F.conv_transpose2d(a, b, stride=(1, 2), padding=(0, 1), output_padding=(2, 3), "
        "dilation=(3, 4))",
        rtol, atol);
}

void add_movement_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  mt::Tensor x = d.randn({2, 3, 4}, dt);
  o.add("reshape/" + t, {x}, mt::reshape(x, {4, -1}), "a.reshape(4, -1)");
  o.add("permute/" + t, {x}, mt::permute(x, {2, 0, 1}), "a.permute(2, 0, 1)");
  o.add("transpose/" + t, {x}, mt::transpose(x, 0, 2), "a.transpose(0, 2)");
  mt::Tensor channels = d.randn({2, 3, 12, 2, 3}, dt);
  o.add("pixel_shuffle/" + t, {channels}, mt::pixel_shuffle(channels, 2), "F.pixel_shuffle(a, 2)");
  mt::Tensor blocks = d.randn({2, 3, 2, 4, 6}, dt);
  o.add("pixel_unshuffle/" + t, {blocks}, mt::pixel_unshuffle(blocks, 2),
        "F.pixel_unshuffle(a, 2)");
  mt::Tensor image = d.randn({1, 18, 2, 3}, dt);
  o.add("pixel_shuffle_3/" + t, {image}, mt::pixel_shuffle(image, 3), "F.pixel_shuffle(a, 3)");
  o.add("flatten/" + t, {x}, mt::flatten(x, 0, 1), "a.flatten(0, 1)");
  o.add("unsqueeze/" + t, {x}, mt::unsqueeze(x, -1), "a.unsqueeze(-1)");
  mt::Tensor col = d.randn({3, 1}, dt);
  o.add("broadcast_to/" + t, {col}, mt::broadcast_to(col, {2, 3, 4}), "a.expand(2, 3, 4)");
  mt::Tensor m = d.randn({3, 7}, dt);
  o.add("slice/negative_step3/" + t, {m}, mt::slice(m, 1, -5, 100, 3), "a[:, -5::3]");
  o.add("slice/clamped_rows/" + t, {m}, mt::slice(m, 0, 1, 8, 2), "a[1:8:2]");
  mt::Tensor cube = d.randn({4, 5, 3}, dt);
  o.add("slice/strided/" + t, {cube}, mt::slice(cube, {1, 0, 2}, {2, 2, 1}, {2, 3, 1}),
        "a[1::2, 0::2, 2:3]");
  mt::Tensor small = d.randn({2, 3}, dt);
  o.add("unslice/" + t, {small}, mt::unslice(small, {1, 0}, {2, 2}, {5, 6}),
        "unslice(a, (1, 0), (2, 2), (5, 6))");
  mt::Tensor c1 = d.randn({2, 1, 3}, dt), c2 = d.randn({2, 2, 3}, dt), c3 = d.randn({2, 3, 3}, dt);
  o.add("concat/" + t, {c1, c2, c3}, mt::concat({c1, c2, c3}, 1), "torch.cat([a, b, c], 1)");
  mt::Tensor s1 = d.randn({2, 3}, dt), s2 = d.randn({2, 3}, dt), s3 = d.randn({2, 3}, dt);
  o.add("stack/" + t, {s1, s2, s3}, mt::stack({s1, s2, s3}, -1), "torch.stack([a, b, c], -1)");
}

void add_indexing_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  mt::Tensor x = d.randn({5, 3}, dt), rows = ints({4, 0, 4, 2}, {4});
  o.add("index_select/" + t, {x, rows}, mt::index_select(x, rows, 0), "a.index_select(0, b)");
  mt::Tensor cube = d.randn({3, 4, 2}, dt), idx2 = ints({3, 0, 3, 1, 1, 2}, {2, 3}, mt::i32);
  o.add("index_select/2d_index/" + t, {cube, idx2}, mt::index_select(cube, idx2, 1),
        "a.index_select(1, b.long().flatten()).reshape(3, 2, 3, 2)");
  mt::Tensor source = d.randn({4, 3}, dt), at = ints({1, 3, 1, 0}, {4});
  o.add("index_add/" + t, {x, at, source}, mt::index_add(x, at, source, 0), "a.index_add(0, b, c)");
  mt::Tensor g = d.randn({3, 4}, dt), gi = ints({0, 3, 2, 2, 1, 0}, {3, 2});
  o.add("gather/" + t, {g, gi}, mt::gather(g, gi, 1), "torch.gather(a, 1, b)");
  mt::Tensor g0 = d.randn({4, 3}, dt), gi0 = ints({3, 0, 3, 3}, {2, 2}, mt::i32);
  o.add("gather/axis0_narrow/" + t, {g0, gi0}, mt::gather(g0, gi0, 0),
        "torch.gather(a, 0, b.long())");
  mt::Tensor src = d.randn({3, 3}, dt), si = ints({0, 3, 0, 2, 2, 2, 1, 0, 3}, {3, 3});
  o.add("scatter_add/" + t, {g, si, src}, mt::scatter_add(g, si, src, 1), "a.scatter_add(1, b, c)");
  mt::Tensor table = d.randn({6, 3}, dt), tok = ints({5, 1, 1, 0, 5, 5}, {2, 3}, mt::i32);
  o.add("embedding/" + t, {table, tok}, mt::embedding(table, tok), "F.embedding(b.long(), a)");
  mt::Tensor classes = ints({0, 3, 1, 1, 2}, {5});
  o.add("one_hot/" + t, {classes}, mt::one_hot(classes, 4, dt),
        "F.one_hot(a, 4).to(" + torch_dtype(dt) + ")");
}

// Scans, sorting and selection (dsl/ops.h, dsl/selection.h), with the special values each
// must order or propagate as PyTorch does.
void add_scan_and_sort_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  mt::Tensor x = d.randn({3, 4, 5}, dt);
  o.add("cumsum/dim1/" + t, {x}, mt::cumsum(x, 1), "torch.cumsum(a, 1)");
  o.add("cumsum/last/" + t, {x}, mt::cumsum(x, -1), "torch.cumsum(a, -1)");
  mt::Tensor special = make({1, kNan, 2, 3, kInf, -kInf, 1, 2, 0.5, -0.5, 0.25, 4}, {3, 4}, dt);
  o.add("cumsum/specials/" + t, {special}, mt::cumsum(special, 1), "torch.cumsum(a, 1)");
  mt::Tensor zeros = make({0.5, 0, 2, 3, 1.5, -2, 0, 0, 0.75, 2, -1, 1.25}, {3, 4}, dt);
  o.add("cumprod/zeros/" + t, {zeros}, mt::cumprod(zeros, 1), "torch.cumprod(a, 1)");
  o.add("cumprod/dim0/" + t, {x}, mt::cumprod(x, 0), "torch.cumprod(a, 0)");
  mt::Tensor lx = d.randn({3, 4, 5}, dt, 10.0);
  o.add("logcumsumexp/" + t, {lx}, mt::logcumsumexp(lx, 2), "torch.logcumsumexp(a, 2)");
  mt::Tensor linf = make({-kInf, -kInf, 1, -kInf, kInf, 2, kInf, 1, 3, kNan, 1, 800}, {3, 4}, dt);
  o.add("logcumsumexp/infinities/" + t, {linf}, mt::logcumsumexp(linf, 1),
        "torch.logcumsumexp(a, 1)");
  o.add("prod/dim1/" + t, {x}, mt::prod(x, 1), "a.prod(1)");
  o.add("prod/keepdim_zeros/" + t, {zeros}, mt::prod(zeros, -1, true), "a.prod(-1, keepdim=True)");
  o.add("prod/all/" + t, {zeros}, mt::prod(zeros * 0.5 + 1.0), "(a * 0.5 + 1).prod()");
  // Ties (kept in order), NaN (above +inf), -0 and +0 (equal).
  mt::Tensor ties =
      make({3, 1, kNan, 1, -0.0, 0.0, kInf, 2, 2, -kInf, 0.0, 7, kNan, 2, 2, 1}, {2, 8}, dt);
  o.add("argsort/ties/" + t, {ties}, mt::argsort(ties, 1), "torch.sort(a, stable=True, dim=1)[1]");
  // A world of one process (tests/mpi has two): torch.distributed.all_reduce leaves it as is.
  o.add("all_reduce/one_process/" + t, {ties}, mt::all_reduce(ties), "a.clone()");
  // torch.distributed.reduce_scatter_tensor and all_gather_into_tensor in a world of one.
  o.add("reduce_scatter/one_process/" + t, {ties}, mt::reduce_scatter(mt::flatten(ties)),
        "a.flatten().clone()");
  o.add("all_gather/one_process/" + t, {ties}, mt::all_gather(mt::flatten(ties)),
        "a.flatten().clone()");
  o.add("argsort/descending/" + t, {ties}, mt::argsort(ties, -1, true),
        "torch.sort(a, stable=True, dim=-1, descending=True)[1]");
  o.add("sort/values/" + t, {ties}, mt::sort(ties, 1).values, "torch.sort(a, 1)[0]");
  o.add("sort/descending_dim0/" + t, {x}, mt::sort(x, 0, true).values,
        "torch.sort(a, 0, descending=True)[0]");
  mt::Tensor distinct = make({0.5, kNan, -1, 3, 2.5, -4, 9, 1.5, 0.25, -2, 6, 4}, {3, 4}, dt);
  o.add("topk/values/" + t, {x}, mt::topk(x, 3, 1).values, "torch.topk(a, 3, 1)[0]");
  o.add("topk/indices_nan/" + t, {distinct}, mt::topk(distinct, 2).indices, "torch.topk(a, 2)[1]");
  o.add("topk/smallest_dim0/" + t, {distinct}, mt::topk(distinct, 2, 0, false).indices,
        "torch.topk(a, 2, 0, largest=False)[1]");
  o.add("topk/smallest_values/" + t, {x}, mt::topk(x, 2, -1, false).values,
        "torch.topk(a, 2, -1, largest=False)[0]");
  mt::Tensor base = d.randn({3, 4}, dt), src = d.randn({3, 3}, dt);
  mt::Tensor at = ints({0, 3, 2, 1, 1, 0}, {3, 2});
  o.add("scatter/" + t, {base, at, src}, mt::scatter(base, 1, at, src), "a.scatter(1, b, c)");
  o.add("scatter/value/" + t, {base, at}, mt::scatter(base, 1, at, 2.5), "a.scatter(1, b, 2.5)");
  mt::Tensor rows = ints({2, 0, 1, 1, 2, 0}, {2, 3}, mt::i32);
  o.add("scatter/dim0/" + t, {base, rows, src}, mt::scatter(base, 0, rows, src),
        "a.scatter(0, b.long(), c)");
  mt::Tensor taken = ints({4, 0, 0, 2, 1, 1}, {1, 2, 3});
  mt::Tensor cube = d.randn({3, 1, 5}, dt);
  o.add("take_along_dim/" + t, {cube, taken}, mt::take_along_dim(cube, taken, 2),
        "torch.take_along_dim(a, b, 2)");
  o.add("take_along_dim/flat/" + t, {cube, taken}, mt::take_along_dim(cube, taken),
        "torch.take_along_dim(a, b)");
  mt::Tensor mask = mt::tensor(std::vector<int64_t>{1, 0, 0, 1, 1}, {1, 5}, mt::boolean);
  o.add("masked_select/" + t, {cube, mask}, mt::masked_select(cube, mask),
        "torch.masked_select(a, b)");
  o.add("nonzero/" + t, {zeros}, mt::nonzero(zeros), "torch.nonzero(a)");
}

// einsum against torch.einsum: matmul-shaped, batched, transposed, outer, reductions, a
// diagonal, implicit outputs, "..." (broadcast from size 1 too) and chains of three operands.
void add_einsum_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  double tol = dt == mt::f32 ? 1e-5 : 1e-12;
  struct Case {
    std::string name, equation;
    std::vector<mt::Shape> shapes;
  };
  const std::vector<Case> cases = {
      {"matmul", "ij,jk->ik", {{3, 4}, {4, 5}}},
      {"bmm", "bij,bjk->bik", {{2, 3, 4}, {2, 4, 5}}},
      {"transposed_out", "ij,kj->ki", {{3, 4}, {5, 4}}},
      {"outer", "i,j->ij", {{3}, {4}}},
      {"dot", "i,i->", {{5}, {5}}},
      {"hadamard", "ij,ij->ij", {{3, 4}, {3, 4}}},
      {"permute", "ijk->kij", {{2, 3, 4}}},
      {"sum_axis", "ijk->ik", {{2, 3, 4}}},
      {"trace", "ii", {{4, 4}}},
      {"diagonal_batch", "iij->ji", {{3, 3, 2}}},
      {"implicit", "jb,ia", {{3, 2}, {4, 5}}},
      {"implicit_upper", "bA,Ab", {{2, 3}, {3, 2}}},
      {"ellipsis_batch", "...ij,...jk->...ik", {{2, 1, 3, 4}, {3, 4, 2}}},
      {"ellipsis_summed", "...ij->ij", {{2, 3, 4}}},
      {"attention", "bhqd,bhkd->bhqk", {{2, 2, 3, 4}, {2, 2, 5, 4}}},
      {"three_chain", "ij,jk,kl->il", {{3, 4}, {4, 5}, {5, 2}}},
      {"three_shared_batch", "bi,bij,bj->b", {{2, 3}, {2, 3, 4}, {2, 4}}},
      {"bilinear", "bn,anm,bm->ba", {{2, 3}, {5, 3, 4}, {2, 4}}},
      {"spaces", "i j , j k -> k i", {{3, 4}, {4, 2}}},
  };
  for (const Case& c : cases) {
    Tensors inputs;
    std::string args;
    for (size_t i = 0; i < c.shapes.size(); ++i) {
      inputs.push_back(d.randn(c.shapes[i], dt));
      args += fmt::format(", {}", "abc"[i]);
    }
    o.add("einsum/" + c.name + "/" + t, inputs, mt::einsum(c.equation, inputs),
          fmt::format("torch.einsum('{}'{})", c.equation, args), tol, tol);
  }
}

void add_composite_cases(Oracle& o, Data& d, mt::DType dt) {
  const std::string t(mt::name(dt));
  mt::Tensor x = d.randn({3, 5}, dt, 2.0);
  o.add("softmax/last/" + t, {x}, mt::softmax(x), "torch.softmax(a, -1)");
  o.add("softmax/axis0/" + t, {x}, mt::softmax(x, 0), "torch.softmax(a, 0)");
  mt::Tensor x3 = d.randn({2, 3, 4}, dt, 2.0);
  o.add("log_softmax/" + t, {x3}, mt::log_softmax(x3, 1), "torch.log_softmax(a, 1)");
  mt::Tensor h = d.randn({3, 4}, dt), w = d.randn({4}, dt), b = d.randn({4}, dt);
  o.add("layer_norm/" + t, {h, w, b}, mt::layer_norm(h, w, b), "F.layer_norm(a, (4,), b, c, 1e-5)",
        dt == mt::f32 ? 1e-4 : 1e-10, dt == mt::f32 ? 1e-5 : 1e-12);
  mt::Tensor w2 = d.randn({3, 4}, dt), b2 = d.randn({3, 4}, dt);
  o.add("layer_norm/two_axes/" + t, {x3, w2, b2}, mt::layer_norm(x3, w2, b2, 1e-5, 2),
        "F.layer_norm(a, (3, 4), b, c, 1e-5)", dt == mt::f32 ? 1e-4 : 1e-10,
        dt == mt::f32 ? 1e-5 : 1e-12);
  o.add("rms_norm/" + t, {h, w}, mt::rms_norm(h, w), "rms_norm(a, b, 1e-6)");
  mt::Tensor logits = d.randn({4, 5}, dt, 2.0), targets = ints({1, -100, 4, 0}, {4});
  o.add("cross_entropy/smoothing_ignore/" + t, {logits, targets},
        mt::cross_entropy(logits, targets, {.label_smoothing = 0.1}),
        "F.cross_entropy(a, b, ignore_index=-100, label_smoothing=0.1)");
  mt::Tensor logits3 = d.randn({2, 3, 5}, dt), targets3 = ints({1, 2, 4, 0, 0, 3}, {2, 3});
  o.add("cross_entropy/sum_3d/" + t, {logits3, targets3},
        mt::cross_entropy(logits3, targets3, {.reduction = mt::Reduction::Sum}),
        "F.cross_entropy(a.permute(0, 2, 1), b, reduction='sum')");
  mt::Tensor targets_i32 = ints({2, 0, 2, 1}, {4}, mt::i32), l43 = d.randn({4, 3}, dt);
  o.add("cross_entropy/none_ignore2/" + t, {l43, targets_i32},
        mt::cross_entropy(
            l43, targets_i32,
            {.reduction = mt::Reduction::None, .ignore_index = 2, .label_smoothing = 0.2}),
        "F.cross_entropy(a, b.long(), ignore_index=2, reduction='none', label_smoothing=0.2)");
  mt::Tensor target = d.randn({3, 4}, dt);
  o.add("mse_loss/mean/" + t, {h, target}, mt::mse_loss(h, target), "F.mse_loss(a, b)");
  o.add("mse_loss/sum/" + t, {h, target}, mt::mse_loss(h, target, mt::Reduction::Sum),
        "F.mse_loss(a, b, reduction='sum')");
  mt::Tensor q = d.randn({2, 3, 4}, dt), k = d.randn({2, 3, 4}, dt), v = d.randn({2, 3, 4}, dt);
  o.add("sdpa/causal/" + t, {q, k, v}, mt::scaled_dot_product_attention(q, k, v, true),
        "sdpa(a, b, c, True)");
  mt::Tensor q2 = d.randn({2, 2, 4}, dt), v2 = d.randn({2, 3, 5}, dt);
  o.add("sdpa/cross/" + t, {q2, k, v2}, mt::scaled_dot_product_attention(q2, k, v2),
        "sdpa(a, b, c, False)");
  // The fused primitives themselves: a bool padding mask broadcast over queries, and the packed
  // gradients of a causal attention against torch.autograd's.
  mt::Tensor qa = d.randn({2, 5, 4}, dt), ka = d.randn({2, 6, 4}, dt), va = d.randn({2, 6, 3}, dt);
  mt::Tensor keep =
      mt::tensor(std::vector<int64_t>{1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0}, {2, 1, 6}, mt::boolean);
  o.add("attention_forward/mask/" + t, {qa, ka, va, keep},
        mt::attention_forward(qa, ka, va, keep, false, 0.3),
        "torch.softmax((a @ b.transpose(-1, -2) * 0.3).masked_fill(~d, float('-inf')), -1) @ c");
  mt::Tensor gq = d.randn({2, 5, 4}, dt), gout = d.randn({2, 5, 4}, dt);
  mt::Tensor out = mt::attention_forward(gq, qa, qa, mt::Tensor(), true, 0.5);
  o.add("attention_backward/causal/" + t, {gq, qa, qa, out, gout},
        mt::attention_backward(gq, qa, qa, out, gout, mt::Tensor(), true, 0.5),
        "(lambda q, k, v: torch.cat([t.flatten(-2) for t in torch.autograd.grad(sdpa(q, k, v, "
        "True), (q, k, v), e)], -1))(a.clone().requires_grad_(), b.clone().requires_grad_(), "
        "c.clone().requires_grad_())");
  mt::Tensor cx =
      make({-2.5, -1.0, 0.0, 0.5, 1.0, 3.0, kNan, kInf, -kInf, 0.75, -0.25, 2.0}, {3, 4}, dt);
  o.add("clamp/both/" + t, {cx}, mt::clamp(cx, -1.0, 1.0), "torch.clamp(a, -1, 1)");
  o.add("clamp/min/" + t, {cx}, mt::clamp(cx, 0.5, std::nullopt), "torch.clamp(a, min=0.5)");
  o.add("clamp/max/" + t, {cx}, mt::clamp(cx, std::nullopt, 0.5), "torch.clamp(a, max=0.5)");
  o.add("clamp/min_above_max/" + t, {cx}, mt::clamp(cx, 1.0, -1.0), "torch.clamp(a, 1, -1)");
  o.add("clip/" + t, {cx}, mt::clip(cx, -0.5, 2.0), "torch.clip(a, -0.5, 2)");
  mt::Tensor fill_mask = mt::tensor(std::vector<int64_t>{1, 0, 0, 1}, {4}, mt::boolean);
  o.add("masked_fill/" + t, {cx, fill_mask}, mt::masked_fill(cx, fill_mask, -7.5),
        "a.masked_fill(b, -7.5)");
  mt::Tensor img = d.randn({2, 3, 4, 5}, dt);
  o.add("pad/constant/" + t, {img}, mt::pad(img, {1, 2, 0, 3}, mt::PadMode::Constant, 0.5),
        "F.pad(a, (1, 2, 0, 3), value=0.5)");
  o.add("pad/constant_crop/" + t, {img}, mt::pad(img, {-1, 2, 1, -2}), "F.pad(a, (-1, 2, 1, -2))");
  o.add("pad/reflect/" + t, {img}, mt::pad(img, {2, 1, 3, 0}, mt::PadMode::Reflect),
        "F.pad(a, (2, 1, 3, 0), mode='reflect')");
  o.add("pad/replicate/" + t, {img}, mt::pad(img, {3, 1, 1, 2}, mt::PadMode::Replicate),
        "F.pad(a, (3, 1, 1, 2), mode='replicate')");
  o.add("pad/circular/" + t, {img}, mt::pad(img, {5, 2, 1, 4}, mt::PadMode::Circular),
        "F.pad(a, (5, 2, 1, 4), mode='circular')");
  Doubles lv = d.normal(12, 4.0);
  lv[0] = 30, lv[1] = -30, lv[2] = 12, lv[3] = -12;
  mt::Tensor bl = make(lv, {3, 4}, dt), by = make(d.uniform(12, 0.0, 1.0), {3, 4}, dt);
  mt::Tensor pw = make({0.5, 1.0, 2.0, 4.0}, {4}, dt);
  o.add("bce_with_logits/mean/" + t, {bl, by}, mt::binary_cross_entropy_with_logits(bl, by),
        "F.binary_cross_entropy_with_logits(a, b)");
  o.add("bce_with_logits/none_pos_weight/" + t, {bl, by, pw},
        mt::binary_cross_entropy_with_logits(bl, by,
                                             {.reduction = mt::Reduction::None, .pos_weight = pw}),
        "F.binary_cross_entropy_with_logits(a, b, pos_weight=c, reduction='none')");
  mt::Tensor ax =
      make({-4.0, -3.0, -1.5, -0.25, 0.0, 0.5, 2.0, 3.0, 3.5, 25.0, kNan, -30.0}, {3, 4}, dt);
  o.add("softplus/" + t, {ax}, mt::softplus(ax), "F.softplus(a)");
  o.add("softplus/beta2/" + t, {ax}, mt::softplus(ax, 2.0, 5.0), "F.softplus(a, 2.0, 5.0)");
  o.add("leaky_relu/" + t, {ax}, mt::leaky_relu(ax, 0.2), "F.leaky_relu(a, 0.2)");
  o.add("elu/" + t, {ax}, mt::elu(ax, 1.5), "F.elu(a, 1.5)");
  o.add("selu/" + t, {ax}, mt::selu(ax), "F.selu(a)");
  o.add("mish/" + t, {ax}, mt::mish(ax), "F.mish(a)");
  o.add("hardsigmoid/" + t, {ax}, mt::hardsigmoid(ax), "F.hardsigmoid(a)");
  o.add("hardswish/" + t, {ax}, mt::hardswish(ax), "F.hardswish(a)");
  mt::Tensor ra = make({5.5, -5.5, 5.5, -5.5, 3.0, -3.0, 0.0, 7.25}, {8}, dt);
  mt::Tensor rb = make({2.0, 2.0, -2.0, -2.0, 1.5, 1.5, 2.0, kInf}, {8}, dt);
  o.add("remainder/" + t, {ra, rb}, mt::remainder(ra, rb), "torch.remainder(a, b)");
  o.add("isnan/" + t, {ax}, mt::isnan(ax), "torch.isnan(a)");
  o.add("isinf/" + t, {cx}, mt::isinf(cx), "torch.isinf(a)");
  o.add("isfinite/" + t, {cx}, mt::isfinite(cx), "torch.isfinite(a)");
  o.add("logical_and/" + t, {ax, cx}, mt::logical_and(ax, cx), "torch.logical_and(a, b)");
  o.add("logical_or/" + t, {ax, cx}, mt::logical_or(ax, cx), "torch.logical_or(a, b)");
  o.add("logical_xor/" + t, {ax, cx}, mt::logical_xor(ax, cx), "torch.logical_xor(a, b)");
  o.add("logical_not/" + t, {ax}, mt::logical_not(ax), "torch.logical_not(a)");
  mt::Tensor lw = make({-0.5, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 0.49}, {8}, dt);
  mt::Tensor le = make({1.0, -2.0, 4.0, 0.5, -3.0, 2.0, 9.0, -1.0}, {8}, dt);
  o.add("lerp/" + t, {ra, le, lw}, mt::lerp(ra, le, lw), "torch.lerp(a, b, c)");
  mt::Tensor lp = mt::log_softmax(d.randn({4, 5}, dt)), nt = ints({1, -100, 4, 0}, {4});
  o.add("nll_loss/mean_ignore/" + t, {lp, nt}, mt::nll_loss(lp, nt), "F.nll_loss(a, b)");
  o.add("nll_loss/none/" + t, {lp, nt}, mt::nll_loss(lp, nt, mt::Reduction::None),
        "F.nll_loss(a, b, reduction='none')");
  mt::Tensor pr = make({0.0, 0.1, 0.5, 0.9, 1.0, 0.25}, {2, 3}, dt);
  mt::Tensor py = make({0.0, 1.0, 0.5, 0.0, 1.0, 0.75}, {2, 3}, dt);
  o.add("binary_cross_entropy/" + t, {pr, py}, mt::binary_cross_entropy(pr, py),
        "F.binary_cross_entropy(a, b)");
  o.add("binary_cross_entropy/none/" + t, {py, pr},
        mt::binary_cross_entropy(py, pr, mt::Reduction::None),
        "F.binary_cross_entropy(a, b, reduction='none')");
  mt::Tensor li = d.randn({3, 4}, dt, 2.0), lt = d.randn({3, 4}, dt, 2.0);
  o.add("l1_loss/" + t, {li, lt}, mt::l1_loss(li, lt), "F.l1_loss(a, b)");
  o.add("smooth_l1_loss/" + t, {li, lt}, mt::smooth_l1_loss(li, lt, mt::Reduction::Sum, 0.5),
        "F.smooth_l1_loss(a, b, reduction='sum', beta=0.5)");
  o.add("huber_loss/" + t, {li, lt}, mt::huber_loss(li, lt, mt::Reduction::None, 1.5),
        "F.huber_loss(a, b, reduction='none', delta=1.5)");
  mt::Tensor kq = mt::log_softmax(d.randn({3, 4}, dt));
  mt::Tensor kp = make({0.0, 0.5, 0.25, 0.25, 0.1, 0.2, 0.3, 0.4, 1.0, 0.0, 0.0, 0.0}, {3, 4}, dt);
  o.add("kl_div/" + t, {kq, kp}, mt::kl_div(kq, kp, mt::Reduction::Sum),
        "F.kl_div(a, b, reduction='sum')");
  o.add("kl_div/log_target/" + t, {kq}, mt::kl_div(kq, kq * 0.5, mt::Reduction::None, true),
        "F.kl_div(a, a * 0.5, reduction='none', log_target=True)");
  // Class and element weights (fixed values, so that the draws of the cases below stay theirs).
  mt::Tensor cw = make({0.5, 2.0, 1.0, 0.25, 3.0}, {5}, dt);
  o.add("nll_loss/weight_mean/" + t, {lp, nt, cw}, mt::nll_loss(lp, nt, {.weight = cw}),
        "F.nll_loss(a, b, weight=c)");
  mt::Tensor nt1 = ints({1, 3, 4, 1}, {4});
  o.add("nll_loss/weight_sum_ignore1/" + t, {lp, nt1, cw},
        mt::nll_loss(lp, nt1, {.weight = cw, .ignore_index = 1, .reduction = mt::Reduction::Sum}),
        "F.nll_loss(a, b, weight=c, ignore_index=1, reduction='sum')");
  o.add("cross_entropy/weight_smoothing/" + t, {lp, nt, cw},
        mt::cross_entropy(lp, nt, {.label_smoothing = 0.3, .weight = cw}),
        "F.cross_entropy(a, b, weight=c, label_smoothing=0.3)");
  mt::Tensor bw = make({1.0, 0.0, 2.0}, {3}, dt);
  o.add("binary_cross_entropy/weight/" + t, {pr, py, bw},
        mt::binary_cross_entropy(pr, py, {.weight = bw}), "F.binary_cross_entropy(a, b, weight=c)");
  o.add("kl_div/batchmean/" + t, {kq, kp}, mt::kl_div(kq, kp, mt::Reduction::BatchMean),
        "F.kl_div(a, b, reduction='batchmean')");
  mt::Tensor wc = mt::tensor(std::vector<int64_t>{1, 0}, {2, 1}, mt::boolean);
  o.add("where/tensor_number/" + t, {wc, pr}, mt::where(wc, pr, -2.5), "torch.where(a, b, -2.5)");
  o.add("where/number_tensor/" + t, {wc, pr}, mt::where(wc, 7, pr), "torch.where(a, 7, b)");
  mt::Tensor sq = d.randn({2, 3, 4}, dt);
  o.add("flip/" + t, {sq}, mt::flip(sq, {0, 2}), "torch.flip(a, (0, 2))");
  o.add("roll/" + t, {sq}, mt::roll(sq, {1, -5}, {1, 2}), "torch.roll(a, (1, -5), (1, 2))");
  o.add("tril/" + t, {sq}, mt::tril(sq, -1), "torch.tril(a, -1)");
  o.add("triu/" + t, {sq}, mt::triu(sq, 1), "torch.triu(a, 1)");
  o.add("repeat/" + t, {sq}, mt::repeat(sq, {2, 1, 1, 3}), "a.repeat(2, 1, 1, 3)");
  o.add("tile/" + t, {sq}, mt::tile(sq, {2, 2}), "torch.tile(a, (2, 2))");
  o.add("std/" + t, {sq}, mt::std_dev(sq, {1}), "a.std(1)");
  o.add("std/all_correction0/" + t, {sq}, mt::std_dev(sq, {}, false, 0.0), "a.std(unbiased=False)");
  o.add("norm/l1/" + t, {sq}, mt::norm(sq, 1.0, {2}), "torch.linalg.vector_norm(a, 1, dim=2)");
  o.add("norm/l2_keepdim/" + t, {sq}, mt::norm(sq, 2.0, {0, 1}, true),
        "torch.linalg.vector_norm(a, 2, dim=(0, 1), keepdim=True)");
  o.add("norm/inf/" + t, {sq}, mt::norm(sq, kInf), "torch.linalg.vector_norm(a, float('inf'))");
  mt::Tensor ties = make({3, 1, 1, 2, kNan, 0, 5, 5, 5, -1, -1, 7}, {3, 4}, dt);
  o.add("argmin/axis1/" + t, {ties}, mt::argmin(ties, 1), "a.argmin(1)");
  o.add("argmin/all/" + t, {sq}, mt::argmin(sq), "a.argmin()");
  mt::Tensor sparse = make({0, 0, 1, 0, 0, 0, 2, 3, 0, 0, 0, 0}, {3, 4}, dt);
  o.add("any/" + t, {sparse}, mt::any(sparse, {1}), "a.any(1)");
  o.add("all/" + t, {sparse}, mt::all(sparse, {0}, true), "a.all(0, keepdim=True)");
  mt::Tensor ca = d.randn({2, 3}, dt), cb = d.randn({2, 3}, dt);
  mt::Tensor custom = mt::custom_op(
      {ca, cb}, [](const Tensors& in) { return in[0] * in[1] + mt::sin(in[0]); },
      [](const Tensors&, const mt::Tensor&, const mt::Tensor&) -> Tensors { return {}; });
  o.add("custom_op/" + t, {ca, cb}, custom, "a * b + torch.sin(a)");
  o.add("full/" + t, {}, mt::full({2, 3}, 2.5, dt),
        "torch.full((2, 3), 2.5, dtype=" + torch_dtype(dt) + ")");
  o.add("arange/" + t, {}, mt::arange(2.0, 9.0, 1.5, dt),
        "torch.arange(2, 9, 1.5, dtype=" + torch_dtype(dt) + ")");
}

void add_integer_cases(Oracle& o, Data& d) {
  for (mt::DType dt : {mt::i32, mt::i64}) {
    const std::string t(mt::name(dt));
    auto draw = [&](int64_t n) {
      Doubles v = d.normal(n, 20.0);
      for (double& x : v) x = std::round(x);
      return v;
    };
    mt::Tensor a = make(draw(12), {3, 4}, dt), b = make(draw(4), {4}, dt);
    o.add("int/add/" + t, {a, b}, a + b, "a + b");
    o.add("int/sub/" + t, {a, b}, a - b, "a - b");
    o.add("int/mul/" + t, {a, b}, a * b, "a * b");
    o.add("int/neg/" + t, {a}, -a, "-a");
    o.add("int/abs/" + t, {a}, mt::abs(a), "a.abs()");
    o.add("int/sign/" + t, {a}, mt::sign(a), "a.sign()");
    o.add("int/relu/" + t, {a}, mt::relu(a), "torch.relu(a)");
    o.add("int/square/" + t, {a}, mt::square(a), "a * a");
    o.add("int/maximum/" + t, {a, b}, mt::maximum(a, b), "torch.maximum(a, b)");
    o.add("int/minimum/" + t, {a, b}, mt::minimum(a, b), "torch.minimum(a, b)");
    o.add("int/lt/" + t, {a, b}, mt::lt(a, b), "a < b");
    o.add("int/sum/" + t, {a}, mt::sum(a), "a.sum()");
    o.add("int/sum_axis0/" + t, {a}, mt::sum(a, {0}), "a.sum(0)");
    o.add("int/max/" + t, {a}, mt::max(a, {1}), "a.amax(1)");
    o.add("int/argmax/" + t, {a}, mt::argmax(a, 0), "a.argmax(0)");
    o.add("int/argmin/" + t, {a}, mt::argmin(a, 1), "a.argmin(1)");
    o.add("int/cumsum/" + t, {a}, mt::cumsum(a, 0), "torch.cumsum(a, 0)");
    o.add("int/cumprod/" + t, {b}, mt::cumprod(b, 0), "torch.cumprod(a, 0)");
    o.add("int/prod/" + t, {a}, mt::prod(a, 1), "a.prod(1)");
    o.add("int/sort/" + t, {a}, mt::sort(a, 1, true).values,
          "torch.sort(a, 1, descending=True)[0]");
    o.add("int/argsort/" + t, {a}, mt::argsort(a, 0), "torch.sort(a, stable=True, dim=0)[1]");
    o.add("int/where/" + t, {a, b}, mt::where(mt::gt(a, b), a, b), "torch.where(a > b, a, b)");
    o.add("int/concat/" + t, {a, b}, mt::concat({a, mt::unsqueeze(b, 0)}, 0),
          "torch.cat([a, b.unsqueeze(0)], 0)");
    o.add("int/scalar_mul/" + t, {a}, a * 3 + 1, "a * 3 + 1");
  }
  mt::Tensor a32 = ints({70000, -70000, 123456}, {3}, mt::i32);
  mt::Tensor b32 = ints({70000, 70000, 54321}, {3}, mt::i32);
  o.add("int/mul_wraps/i32", {a32, b32}, a32 * b32, "a * b");
  mt::Tensor a64 = ints({1, -5, 3}, {3});
  o.add("int/promote_i32_i64", {a32, a64}, a32 + a64, "a + b");
  mt::Tensor f = make({0.5, 1.5, -2.5}, {3}, mt::f32);
  o.add("int/promote_i32_f32", {a32, f}, a32 + f, "a + b");
  mt::Tensor flags = mt::tensor(std::vector<int64_t>{1, 0, 1, 1}, {4}, mt::boolean);
  o.add("bool/sum", {flags}, mt::sum(flags), "a.sum()");
  o.add("bool/cast_f32", {flags}, mt::cast(flags, mt::f32), "a.float()");
  o.add("bool/cumsum", {flags}, mt::cumsum(flags, 0), "torch.cumsum(a, 0)");
  o.add("bool/nonzero", {flags}, mt::nonzero(flags), "torch.nonzero(a)");
  o.add("causal_mask", {}, mt::causal_mask(5), "torch.ones(5, 5, dtype=torch.bool).tril()");
  o.add("arange/i64", {}, mt::arange(7), "torch.arange(7)");
}

void add_cast_and_half_cases(Oracle& o, Data& d) {
  Doubles v = d.normal(20, 1000.0);
  Doubles edge = {70000, -70000, 1e-8, 6e-8, -3e-8, 65519, 65520, 0x1p-25, kNan, kInf};
  v.insert(v.end(), edge.begin(), edge.end());
  Doubles small = d.normal(10, 1e-3);
  v.insert(v.end(), small.begin(), small.end());
  mt::Tensor x32 = make(v, {40}, mt::f32), x64 = make(v, {40}, mt::f64);
  o.add("cast/f32_f16", {x32}, mt::cast(x32, mt::f16), "a.half()");
  o.add("cast/f32_bf16", {x32}, mt::cast(x32, mt::bf16), "a.bfloat16()");
  o.add("cast/f64_f32", {x64}, mt::cast(x64, mt::f32), "a.float()");
  o.add("cast/f64_f16", {x64}, mt::cast(x64, mt::f16), "f16(a)");
  mt::Tensor h = mt::cast(x32, mt::f16);
  o.add("cast/f16_f32", {h}, mt::cast(h, mt::f32), "a.float()");
  o.add("cast/f16_bf16", {h}, mt::cast(h, mt::bf16), "a.bfloat16()");
  mt::Tensor r = make({2.7, -2.7, -0.5, 1e6 + 0.5, 0, 3}, {6}, mt::f32);
  o.add("cast/f32_i32", {r}, mt::cast(r, mt::i32), "a.int()");
  o.add("cast/f32_bool", {r}, mt::cast(r, mt::boolean), "a.bool()");
  mt::Tensor big = ints({16777217, -16777219, 3}, {3});
  o.add("cast/i64_f32", {big}, mt::cast(big, mt::f32), "a.float()");
  mt::Tensor b16 = mt::cast(x32, mt::bf16);
  o.add("cast_like/f32_bf16", {x32, b16}, mt::cast_like(x32, b16), "a.type_as(b)");
  o.add("cast_like/f64_f16", {x64, h}, mt::cast_like(x64, h), "a.type_as(b)");

  // Half arithmetic: the op in f32 registers, one rounding at the node's output.
  for (mt::DType dt : {mt::f16, mt::bf16}) {
    const std::string t(mt::name(dt));
    const std::string back = dt == mt::f16 ? ".half()" : ".bfloat16()";
    mt::Tensor a = d.randn({4, 5}, dt, 100.0), b = d.randn({5}, dt, 3.0);
    o.add("half/add/" + t, {a, b}, a + b, "(a.float() + b.float())" + back);
    o.add("half/sub/" + t, {a, b}, a - b, "(a.float() - b.float())" + back);
    o.add("half/mul/" + t, {a, b}, a * b, "(a.float() * b.float())" + back);
    o.add("half/div/" + t, {a, b}, a / b, "(a.float() / b.float())" + back);
    mt::Tensor s = d.randn({4, 5}, dt);
    o.add("half/exp/" + t, {s}, mt::exp(s), "a.float().exp()" + back);
    o.add("half/tanh/" + t, {s}, mt::tanh(s), "a.float().tanh()" + back);
    o.add("half/slice/" + t, {a}, mt::slice(a, 1, 1, 5, 2), "a[:, 1:5:2]");
    o.add("half/mixed_f32/" + t, {a, make({0.1}, {1}, mt::f32)}, a + make({0.1}, {1}, mt::f32),
          "a.float() + b");
  }
  mt::Tensor hs = d.randn({6, 7}, mt::f16, 10.0), hm = d.randn({7, 3}, mt::f16);
  o.add("half/sum/f16", {hs}, mt::sum(hs, {1}), "f16(a.double().sum(1))");
  o.add("half/matmul/f16", {hs, hm}, mt::matmul(hs, hm), "f16(a.double() @ b.double())");
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(TorchOracle, EveryOpMatchesPyTorch) {
  Oracle oracle;
  Data data;
  for (mt::DType dt : {mt::f32, mt::f64}) {
    add_pointwise_cases(oracle, data, dt);
    add_reduction_cases(oracle, data, dt);
    add_matmul_cases(oracle, data, dt);
    add_conv_cases(oracle, data, dt);
    add_movement_cases(oracle, data, dt);
    add_indexing_cases(oracle, data, dt);
    add_scan_and_sort_cases(oracle, data, dt);
    add_composite_cases(oracle, data, dt);
    add_einsum_cases(oracle, data, dt);
  }
  add_integer_cases(oracle, data);
  add_cast_and_half_cases(oracle, data);

  // Every op of the table is exercised here, except the random leaves (checked against the
  // Philox known answers above: torch has no Philox4x32 stream to compare with).
  for (int i = 0; i < mt::op_count(); ++i) {
    OpCode op = static_cast<OpCode>(i);
    if (op == OpCode::RandUniform || op == OpCode::RandNormal) continue;
    EXPECT_TRUE(oracle.covered().count(op))
        << "no PyTorch case uses op '" << mt::op_name(op) << "'";
  }

  if (!torch_available()) GTEST_SKIP() << "/usr/bin/python3 cannot import torch and numpy";
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / fmt::format("mixtape_test_ops_{}", getpid());
  fs::create_directories(dir);
  mt::save_tensors((dir / "cases.safetensors").string(), oracle.tensors(), oracle.metadata());
  std::string command =
      fmt::format("/usr/bin/python3 {}/tests/torch/ops_oracle.py {} > {} 2>&1", MIXTAPE_SOURCE_DIR,
                  (dir / "cases.safetensors").string(), (dir / "result.txt").string());
  int status = std::system(command.c_str());
  std::string output = read_file(dir / "result.txt");
  fs::remove_all(dir);
  ASSERT_EQ(status, 0) << output;

  std::map<std::string, std::string> results;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("PASS ", 0) == 0) results[line.substr(5)] = "";
    if (line.rfind("FAIL ", 0) == 0) {
      std::string rest = line.substr(5);
      results[rest.substr(0, rest.find(':'))] = rest;
    }
  }
  for (const std::string& name : oracle.names()) {
    auto found = results.find(name);
    if (found == results.end()) {
      ADD_FAILURE() << "PyTorch did not report on " << name << "; its output:\n" << output;
    } else if (!found->second.empty()) {
      ADD_FAILURE() << found->second;
    }
  }
  EXPECT_EQ(results.size(), oracle.names().size());
}

}  // namespace

// tanh in float is mixtape's own rational function (dsl/scalar_math.h), so that compiled kernels
// vectorize it: it must stay within its documented 7 ulp of the true value everywhere, saturate
// to exactly +-1, and keep tanh's symmetry, zeros and NaN.
TEST(Ops, FloatTanhIsWithinSevenUlpOfTheTrueValue) {
  double worst = 0;
  for (uint32_t bits = 0; bits < 0x7F800000u; bits += 97) {
    float x = std::bit_cast<float>(bits);
    double exact = std::tanh(static_cast<double>(x));
    float ulp = std::nextafter(static_cast<float>(exact), 2.0f) - static_cast<float>(exact);
    if (ulp == 0) ulp = std::numeric_limits<float>::denorm_min();
    double error = std::fabs(static_cast<double>(mixtape::math::tanh(x)) - exact) / ulp;
    worst = std::max(worst, error);
    ASSERT_EQ(mixtape::math::tanh(-x), -mixtape::math::tanh(x)) << x;
  }
  EXPECT_LE(worst, 7.0);
  EXPECT_EQ(mixtape::math::tanh(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(mixtape::math::tanh(-std::numeric_limits<float>::infinity()), -1.0f);
  EXPECT_EQ(mixtape::math::tanh(20.0f), 1.0f);
  EXPECT_TRUE(std::signbit(mixtape::math::tanh(-0.0f)));
  EXPECT_TRUE(std::isnan(mixtape::math::tanh(std::nanf(""))));
}

// Under autocast einsum runs as linear does (LowOk): its matmul on bf16 operands with f32
// accumulation, so it gives matmul's bits under the same policy, not the f32 product.
TEST(Ops, EinsumUnderAutocastIsTheHalfTypeMatmul) {
  mt::Generator gen(3);
  mt::Tensor a = mt::randn({4, 6, 8}, mt::f32, &gen), b = mt::randn({8, 5}, mt::f32, &gen);
  mt::Tensor plain = mt::einsum("bij,jk->bik", {a, b});
  mt::Tensor via_einsum, via_matmul;
  {
    mt::autocast guard(mt::bf16);
    via_einsum = mt::einsum("bij,jk->bik", {a, b});
    via_matmul = mt::matmul(a, b);
  }
  EXPECT_EQ(via_einsum.dtype(), via_matmul.dtype());
  std::vector<float> e = via_einsum.to(mt::f32).to_vector<float>();
  std::vector<float> m = via_matmul.to(mt::f32).to_vector<float>();
  std::vector<float> f = plain.to_vector<float>();
  EXPECT_EQ(e, m);
  EXPECT_NE(e, f);
}
