// tests/test_autograd.cpp -- backward() and mt::grad against hand-derived gradients: accumulation,
// explicit seeds, higher order, no-grad scopes, detach, custom vjps, assign and graph lifetime.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <mixtape/mixtape.h>

#include "tests/test_util.h"

namespace mt = mixtape;

namespace {

// Runs the statement and expects an mt::Error whose message contains every fragment; any other
// exception escapes and fails the test.

mt::Tensor leaf(const std::vector<double>& values, mt::Shape shape, mt::DType dtype = mt::f64) {
  mt::Tensor t = mt::tensor(values, std::move(shape), dtype);
  t.requires_grad_();
  return t;
}

std::vector<double> values(const mt::Tensor& t) { return t.to_vector<double>(); }

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want,
                     double tolerance = 1e-12) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tolerance * std::max(1.0, std::abs(want[i]))) << "element " << i;
}

TEST(Backward, AccumulatesAcrossCallsUntilZeroGrad) {
  mt::Tensor x = leaf({1, -2, 3}, {3});
  EXPECT_FALSE(x.grad().defined());
  // d/dx sum(x^2 + 3x) = 2x + 3
  auto loss = [&] { return mt::sum(x * x + x * 3.0); };
  loss().backward();
  expect_near_all(values(x.grad()), {5, -1, 9});
  loss().backward();
  expect_near_all(values(x.grad()), {10, -2, 18});
  loss().backward();
  expect_near_all(values(x.grad()), {15, -3, 27});
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
  loss().backward();
  expect_near_all(values(x.grad()), {5, -1, 9});
}

TEST(Backward, SameGraphTwiceAccumulatesTwiceWhenRetained) {
  mt::Tensor x = leaf({0.5, 2}, {2});
  mt::Tensor loss = mt::sum(mt::exp(x));
  loss.backward(mt::Tensor(), /*retain_graph=*/true);
  loss.backward();
  expect_near_all(values(x.grad()), {2 * std::exp(0.5), 2 * std::exp(2.0)});
  EXPECT_MT_ERROR(loss.backward(), "backward", "second backward()");  // not retained the 2nd time
}

// A retained graph walked again after an optimizer step (which moves the parameter on to a new
// value) still delivers the old graph's gradient to the parameter, as PyTorch accumulates into
// the same parameter; a graph holding the old and the new value sums both.
TEST(Backward, ARetainedGraphAfterAStepStillReachesTheParameter) {
  mt::Tensor w = leaf({0.5, 2}, {2});
  mt::Tensor loss = mt::sum(mt::exp(w));
  loss.backward(mt::Tensor(), /*retain_graph=*/true);
  mt::SGD opt({w}, {.lr = 0.25});
  opt.step();
  const std::vector<double> stepped = values(w);
  expect_near_all(stepped, {0.5 - 0.25 * std::exp(0.5), 2 - 0.25 * std::exp(2.0)});
  opt.zero_grad();
  loss.backward(mt::Tensor(), /*retain_graph=*/true);  // d/dw sum(exp(w_old))
  expect_near_all(values(w.grad()), {std::exp(0.5), std::exp(2.0)});
  opt.zero_grad();
  (loss + mt::sum(w * w)).backward();  // exp(w_old) + 2 w_new, one gradient
  expect_near_all(values(w.grad()),
                  {std::exp(0.5) + 2 * stepped[0], std::exp(2.0) + 2 * stepped[1]});
}

TEST(Backward, ExplicitGradientWeightsTheOutputs) {
  mt::Tensor x = leaf({1, 2, 3}, {3});
  mt::Tensor y = x * x;  // dy_i/dx_i = 2 x_i
  y.backward(mt::tensor(std::vector<double>{1, 10, 100}, {3}));
  expect_near_all(values(x.grad()), {2, 40, 600});
}

TEST(Backward, NonScalarWithoutGradientThrows) {
  mt::Tensor x = leaf({1, 2, 3, 4}, {2, 2});
  mt::Tensor y = x * 2.0;
  EXPECT_MT_ERROR(y.backward(), "backward", "[2, 2]", "test_autograd.cpp");
  EXPECT_MT_ERROR(y.backward(mt::ones({4}, mt::f64)), "backward", "[4]", "[2, 2]");
  EXPECT_FALSE(x.grad().defined());  // a failed call leaves nothing behind
  mt::Tensor constant = mt::ones({2});
  EXPECT_MT_ERROR(mt::sum(constant).backward(), "backward", "does not require grad");
}

TEST(Backward, ScalarOfShapeOneUsesImplicitSeed) {
  mt::Tensor x = leaf({3}, {1});
  (x * x * x).backward();  // a [1] output counts as a single element
  expect_near_all(values(x.grad()), {27});
}

TEST(Grad, SeveralOutputsAndInputs) {
  mt::Tensor x = leaf({1, 2}, {2});
  mt::Tensor y = leaf({3, -4}, {2});
  // d/dx [sum(x*y) + sum(x)] = y + 1, d/dy = x; with weights (2, 5): 2*(y) + 5 for x, 2x for y.
  std::vector<mt::Tensor> outputs{mt::sum(x * y), mt::sum(x)};
  auto g = mt::grad(outputs, {x, y});
  ASSERT_EQ(g.size(), 2u);
  expect_near_all(values(g[0]), {4, -3});
  expect_near_all(values(g[1]), {1, 2});
  auto weighted = mt::grad(outputs, {x, y}, {mt::scalar(2, mt::f64), mt::scalar(5, mt::f64)});
  expect_near_all(values(weighted[0]), {11, -3});
  expect_near_all(values(weighted[1]), {2, 4});
  // mt::grad is functional: it leaves .grad() alone.
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(y.grad().defined());
  EXPECT_FALSE(g[0].requires_grad());
}

TEST(Grad, NonScalarOutputsNeedGradOutputs) {
  mt::Tensor x = leaf({1, 2, 3}, {3});
  mt::Tensor y = mt::sin(x);
  auto g = mt::grad({y}, {x}, {mt::tensor(std::vector<double>{1, 0, -1}, {3})});
  expect_near_all(values(g[0]), {std::cos(1.0), 0, -std::cos(3.0)});
  EXPECT_MT_ERROR(mt::grad({y}, {x}), "grad", "[3]");
}

TEST(Grad, AllowUnused) {
  mt::Tensor x = leaf({1, 2}, {2});
  mt::Tensor unused = leaf({5}, {1});
  mt::Tensor out = mt::sum(x * x);
  EXPECT_MT_ERROR(mt::grad({out}, {x, unused}), "grad", "input 1", "allow_unused");
  auto g = mt::grad({out}, {x, unused}, {}, false, /*allow_unused=*/true);
  ASSERT_EQ(g.size(), 2u);
  expect_near_all(values(g[0]), {2, 4});
  EXPECT_FALSE(g[1].defined());
}

TEST(Grad, CreateGraphGivesSecondDerivatives) {
  std::vector<double> xs{-1.5, 0.5, 2};
  for (int form = 0; form < 2; ++form) {
    SCOPED_TRACE(form == 0 ? "x*x*x" : "pow(x, 3)");
    mt::Tensor x = leaf(xs, {3});
    mt::Tensor y = form == 0 ? x * x * x : mt::pow(x, 3.0);
    auto first = mt::grad({mt::sum(y)}, {x}, {}, /*create_graph=*/true);
    ASSERT_TRUE(first[0].requires_grad());
    expect_near_all(values(first[0]), {3 * 2.25, 3 * 0.25, 12}, 1e-12);
    auto second = mt::grad({mt::sum(first[0])}, {x});
    expect_near_all(values(second[0]), {-9, 3, 12}, 1e-12);  // 6x
    auto third = mt::grad({mt::sum(mt::grad({mt::sum(first[0])}, {x}, {}, true)[0])}, {x});
    expect_near_all(values(third[0]), {6, 6, 6}, 1e-12);
  }
}

TEST(Grad, WithoutCreateGraphTheGradientIsConstant) {
  mt::Tensor x = leaf({2}, {1});
  auto g = mt::grad({mt::sum(x * x * x)}, {x});
  EXPECT_FALSE(g[0].requires_grad());
  EXPECT_MT_ERROR(mt::grad({mt::sum(g[0])}, {x}), "grad");
}

TEST(NoGrad, ResultsDoNotRequireGradAndNestingRestores) {
  mt::Tensor x = leaf({1, 2}, {2});
  EXPECT_TRUE(mt::grad_enabled());
  {
    mt::NoGradGuard outer;
    EXPECT_FALSE(mt::grad_enabled());
    mt::Tensor y = x * 3.0;
    EXPECT_FALSE(y.requires_grad());
    {
      mt::NoGradGuard inner(true);
      EXPECT_TRUE(mt::grad_enabled());
      EXPECT_TRUE((x * 3.0).requires_grad());
      {
        mt::NoGradGuard innermost;
        EXPECT_FALSE((x + 1.0).requires_grad());
      }
      EXPECT_TRUE(mt::grad_enabled());
    }
    EXPECT_FALSE(mt::grad_enabled());
    EXPECT_FALSE(mt::exp(x).requires_grad());
    EXPECT_MT_ERROR(mt::sum(y).backward(), "backward", "does not require grad");
  }
  EXPECT_TRUE(mt::grad_enabled());
  mt::Tensor z = x * 3.0;
  EXPECT_TRUE(z.requires_grad());
  mt::sum(z).backward();
  expect_near_all(values(x.grad()), {3, 3});
}

TEST(Detach, StopsGradients) {
  mt::Tensor x = leaf({1, -2, 4}, {3});
  mt::Tensor d = x.detach();
  EXPECT_FALSE(d.requires_grad());
  expect_near_all(values(d), {1, -2, 4});
  // Only the attached factor contributes: d/dx sum(stop(x) * x) = x, not 2x.
  mt::sum(d * x).backward();
  expect_near_all(values(x.grad()), {1, -2, 4});
  // With every path cut there is nothing to differentiate.
  EXPECT_MT_ERROR(mt::sum(mt::exp(x).detach()).backward(), "backward", "does not require grad");
}

TEST(RequiresGrad, OnlyFloatLeaves) {
  mt::Tensor x = leaf({1, 2}, {2});
  mt::Tensor y = x * 2.0;
  EXPECT_FALSE(y.is_leaf());
  EXPECT_MT_ERROR(y.requires_grad_(), "requires_grad_", "leaf", "mul");
  mt::Tensor ints = mt::tensor(std::vector<int64_t>{1, 2}, {2});
  EXPECT_MT_ERROR(ints.requires_grad_(), "requires_grad_", "i64");
  mt::Tensor flags = mt::tensor(std::vector<bool>{true}, {1});
  EXPECT_MT_ERROR(flags.requires_grad_(), "requires_grad_", "bool");
  EXPECT_FALSE(ints.requires_grad());
  // Integer results of float inputs never require grad.
  EXPECT_FALSE(mt::argmax(x).requires_grad());
  EXPECT_FALSE(mt::cast(x, mt::i32).requires_grad());
  // Switching it off again is allowed on a leaf.
  mt::Tensor z = leaf({1}, {1});
  z.requires_grad_(false);
  EXPECT_FALSE(z.requires_grad());
  EXPECT_FALSE((z * 2.0).requires_grad());
}

TEST(Backward, LeafUsedTwiceGetsTheSumOfBothPaths) {
  mt::Tensor x = leaf({0.3, -1.2}, {2});
  // sum(3x + sin(x) + x*x): 3 + cos(x) + 2x
  mt::sum(x * 3.0 + mt::sin(x) + x * x).backward();
  expect_near_all(values(x.grad()), {3 + std::cos(0.3) + 0.6, 3 + std::cos(-1.2) - 2.4});
  // The same node as both operands of one op.
  mt::Tensor w = leaf({1.5}, {1});
  mt::sum(w * w).backward();
  expect_near_all(values(w.grad()), {3});
}

// Weights with distinct values make misplaced gradients visible.
mt::Tensor weights(mt::Shape shape) {
  std::vector<double> w(static_cast<size_t>(mt::numel(shape)));
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<double>(i + 1) * 0.5;
  return mt::tensor(w, std::move(shape));
}

TEST(Backward, ViewOpsRouteGradientsToTheRightPositions) {
  std::vector<double> data(12);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<double>(i);
  {
    SCOPED_TRACE("slice columns 1..3 of [3, 4]");
    mt::Tensor x = leaf(data, {3, 4});
    mt::sum(mt::slice(x, 1, 1, 3) * weights({3, 2})).backward();
    expect_near_all(values(x.grad()), {0, 0.5, 1, 0, 0, 1.5, 2, 0, 0, 2.5, 3, 0});
  }
  {
    SCOPED_TRACE("strided slice rows 0 and 2");
    mt::Tensor x = leaf(data, {3, 4});
    mt::sum(mt::slice(x, 0, 0, 3, 2) * weights({2, 4})).backward();
    expect_near_all(values(x.grad()), {0.5, 1, 1.5, 2, 0, 0, 0, 0, 2.5, 3, 3.5, 4});
  }
  {
    SCOPED_TRACE("transpose");
    mt::Tensor x = leaf(data, {3, 4});
    mt::sum(mt::transpose(x) * weights({4, 3})).backward();
    // x^T[j][i] = x[i][j] gets w[j][i] = (j*3 + i + 1) / 2
    std::vector<double> want;
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) want.push_back((j * 3 + i + 1) * 0.5);
    expect_near_all(values(x.grad()), want);
  }
  {
    SCOPED_TRACE("reshape");
    mt::Tensor x = leaf(data, {3, 4});
    mt::sum(mt::reshape(x, {2, 6}) * weights({2, 6})).backward();
    expect_near_all(values(x.grad()), values(weights({12})));
  }
  {
    SCOPED_TRACE("broadcast sums over the repeated axis");
    mt::Tensor x = leaf({1, 2, 3}, {3, 1});
    mt::sum(mt::broadcast_to(x, {3, 4}) * weights({3, 4})).backward();
    expect_near_all(values(x.grad()), {0.5 + 1 + 1.5 + 2, 2.5 + 3 + 3.5 + 4, 4.5 + 5 + 5.5 + 6});
  }
  {
    SCOPED_TRACE("concat splits the gradient");
    mt::Tensor a = leaf({1, 2}, {1, 2});
    mt::Tensor b = leaf({3, 4, 5, 6}, {2, 2});
    mt::sum(mt::concat({a, b}, 0) * weights({3, 2})).backward();
    expect_near_all(values(a.grad()), {0.5, 1});
    expect_near_all(values(b.grad()), {1.5, 2, 2.5, 3});
  }
  {
    SCOPED_TRACE("index_select accumulates repeated rows");
    mt::Tensor x = leaf(data, {4, 3});
    mt::Tensor index = mt::tensor(std::vector<int64_t>{2, 0, 2}, {3});
    mt::sum(mt::index_select(x, index, 0) * weights({3, 3})).backward();
    expect_near_all(values(x.grad()), {2, 2.5, 3, 0, 0, 0, 0.5 + 3.5, 1 + 4, 1.5 + 4.5, 0, 0, 0});
  }
  {
    SCOPED_TRACE("gather along the last axis");
    mt::Tensor x = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
    mt::Tensor index = mt::tensor(std::vector<int64_t>{2, 2, 0, 1}, {2, 2});
    mt::sum(mt::gather(x, index, 1) * weights({2, 2})).backward();
    expect_near_all(values(x.grad()), {0, 0, 0.5 + 1, 1.5, 2, 0});
  }
  {
    SCOPED_TRACE("squeeze/unsqueeze/permute chain");
    mt::Tensor x = leaf(data, {2, 3, 2});
    mt::Tensor y = mt::squeeze(mt::unsqueeze(mt::permute(x, {2, 0, 1}), 0), 0);  // [2, 2, 3]
    mt::sum(y * weights({2, 2, 3})).backward();
    // y[k][i][j] = x[i][j][k] gets w[k][i][j] = (k*6 + i*3 + j + 1) / 2
    std::vector<double> want;
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j)
        for (int k = 0; k < 2; ++k) want.push_back((k * 6 + i * 3 + j + 1) * 0.5);
    expect_near_all(values(x.grad()), want);
  }
}

TEST(Backward, GradientsOfAdjacentSlicesAreJoinedNotSummed) {
  // q, k, v = three column blocks of one projection: their gradients concatenate into one
  // buffer (autograd/backward.cpp) instead of summing three zero-padded ones; values unchanged.
  std::vector<double> data(24);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<double>(i) - 7.5;
  mt::Tensor x = leaf(data, {4, 6});
  mt::Tensor loss = mt::sum(mt::slice(x, 1, 4, 6) * 3.0) + mt::sum(mt::slice(x, 1, 0, 2) * 1.0) +
                    mt::sum(mt::square(mt::slice(x, 1, 2, 4)));
  loss.backward();
  const mt::Node& grad = *x.grad().node();
  EXPECT_NE(grad.op, mt::OpCode::Add);
  bool concat = false;
  for (mt::Node* n : mt::nodes_in_tape_order({x.grad().node()})) {
    concat |= n->op == mt::OpCode::Concat;
    EXPECT_NE(n->op, mt::OpCode::Unslice) << "the joined windows cover the whole tensor";
  }
  EXPECT_TRUE(concat);
  EXPECT_EQ(grad.op, mt::OpCode::Concat);
  EXPECT_EQ(grad.inputs.size(), 3u) << "joined twice, into one concatenation";
  std::vector<double> want;
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 6; ++c) want.push_back(c < 2 ? 1.0 : c < 4 ? 2 * data[r * 6 + c] : 3.0);
  expect_near_all(values(x.grad()), want);
  // Windows that do not meet still sum.
  mt::Tensor y = leaf(data, {4, 6});
  (mt::sum(mt::slice(y, 1, 0, 2)) + mt::sum(mt::slice(y, 1, 3, 5))).backward();
  expect_near_all(values(y.grad()),
                  {1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0});
}

TEST(CustomOp, StraightThroughEstimatorIsUsedByBackward) {
  mt::Tensor x = leaf({-2.0, -0.5, 0.25, 3.0}, {4});
  mt::Tensor w = mt::tensor(std::vector<double>{1, 2, 3, 4}, {4});
  auto forward = [](const std::vector<mt::Tensor>& in) { return mt::sign(in[0]); };
  // The clipped straight-through estimator: pass the gradient where |x| <= 1, block it elsewhere.
  int vjp_calls = 0;
  auto vjp = [&vjp_calls](const std::vector<mt::Tensor>& in, const mt::Tensor&,
                          const mt::Tensor& g) -> std::vector<mt::Tensor> {
    ++vjp_calls;
    return {mt::where(mt::abs(in[0]) <= 1.0, g, mt::zeros_like(g))};
  };
  mt::Tensor y = mt::custom_op({x}, forward, vjp);
  EXPECT_TRUE(y.requires_grad());
  expect_near_all(values(y), {-1, -1, 1, 1});
  mt::sum(y * w).backward();
  EXPECT_EQ(vjp_calls, 1);
  expect_near_all(values(x.grad()), {0, 2, 3, 0});
}

// A backward pass marks the nodes it walks (Node::grad_walk/grad_slot); one run inside another,
// by a vjp that takes gradients itself, must leave the outer pass's marks as they were: here the
// outer pass has already given `s` a contribution when the inner one walks `s` again.
TEST(CustomOp, AVjpThatTakesGradientsItselfLeavesTheOuterPassWhole) {
  mt::Tensor x = leaf({1, 2}, {2});
  mt::Tensor s = x * x;
  auto forward = [](const std::vector<mt::Tensor>& in) { return in[0] + 0.0; };
  auto vjp = [&x](const std::vector<mt::Tensor>& in, const mt::Tensor&,
                  const mt::Tensor& g) -> std::vector<mt::Tensor> {
    mt::Tensor ds_dx = mt::grad({in[0]}, {x}, {mt::ones_like(in[0])})[0];  // 2x, a constant here
    return {g * ds_dx};
  };
  mt::Tensor y = mt::custom_op({s}, forward, vjp);
  mt::Tensor loss = mt::sum(y) + mt::sum(s * 2.0);  // s * 2 is later on the tape than y
  loss.backward();
  // d loss / ds = 2x + 2 = {4, 6}; d loss / dx = that times 2x.
  expect_near_all(values(x.grad()), {8, 24});
}

// Node ids come from per-thread blocks; a node made from one that another thread made later
// still gets a larger id, so creation order stays a topological order for the tape and signing.
TEST(Backward, NodesMadeOnAnotherThreadKeepTheTapeInOrder) {
  mt::Tensor x = leaf({1, 2, 3}, {3});
  mt::Tensor a = x * 3.0;
  mt::Tensor b;
  std::thread([&] { b = a * 2.0; }).join();
  mt::Tensor c = b + x;
  EXPECT_GT(b.node()->id, a.node()->id);
  EXPECT_GT(c.node()->id, b.node()->id);
  mt::sum(c).backward();
  expect_near_all(values(x.grad()), {7, 7, 7});
}

TEST(CustomOp, SeveralInputsAndUndefinedGradients) {
  mt::Tensor a = leaf({1, 2}, {2});
  mt::Tensor b = leaf({3, 5}, {2});
  // Forward a*b, but a vjp that claims d/da = 10 g and gives nothing for b.
  auto forward = [](const std::vector<mt::Tensor>& in) { return in[0] * in[1]; };
  auto vjp = [](const std::vector<mt::Tensor>&, const mt::Tensor& out,
                const mt::Tensor& g) -> std::vector<mt::Tensor> {
    EXPECT_EQ(out.shape(), (mt::Shape{2}));
    return {g * 10.0, mt::Tensor()};
  };
  mt::Tensor y = mt::custom_op({a, b}, forward, vjp);
  expect_near_all(values(y), {3, 10});
  mt::sum(y).backward();
  expect_near_all(values(a.grad()), {10, 10});
  EXPECT_FALSE(b.grad().defined());
}

TEST(CustomOp, BadVjpResultsThrow) {
  mt::Tensor x = leaf({1, 2, 3}, {3});
  auto forward = [](const std::vector<mt::Tensor>& in) { return in[0] * 2.0; };
  auto too_many = [](const std::vector<mt::Tensor>&, const mt::Tensor&,
                     const mt::Tensor& g) -> std::vector<mt::Tensor> {
    return {g, g};
  };
  auto wrong_shape = [](const std::vector<mt::Tensor>&, const mt::Tensor&,
                        const mt::Tensor&) -> std::vector<mt::Tensor> {
    return {mt::ones({2}, mt::f64)};
  };
  auto none = [](const std::vector<mt::Tensor>&, const mt::Tensor&,
                 const mt::Tensor&) -> std::vector<mt::Tensor> { return {}; };
  int line = __LINE__ + 1;
  mt::Tensor y1 = mt::custom_op({x}, forward, too_many);
  EXPECT_MT_ERROR(mt::sum(y1).backward(), "custom_op", "2 gradients", "1 input",
                  "test_autograd.cpp:" + std::to_string(line));
  mt::Tensor y2 = mt::custom_op({x}, forward, wrong_shape);
  EXPECT_MT_ERROR(mt::sum(y2).backward(), "custom_op", "[2]", "[3]");
  mt::Tensor y3 = mt::custom_op({x}, forward, none);
  EXPECT_MT_ERROR(mt::grad({mt::sum(y3)}, {x}), "custom_op", "0 gradients");
  EXPECT_FALSE(x.grad().defined());
}

TEST(Assign, KeepsRequiresGradAndUpdatesEveryCopy) {
  mt::Tensor p = leaf({1, 2}, {2});
  mt::Tensor copy = p;
  mt::sum(p * p).backward();
  ASSERT_TRUE(p.grad().defined());
  p.assign(p * 10.0 + 1.0);
  EXPECT_TRUE(copy.requires_grad());
  EXPECT_TRUE(copy.is_leaf());
  EXPECT_TRUE(copy.node()->inputs.empty());
  EXPECT_EQ(copy.node().get(), p.node().get());
  expect_near_all(values(copy), {11, 21});
  // The accumulated gradient survives and keeps accumulating into the same handle.
  expect_near_all(values(copy.grad()), {2, 4});
  mt::sum(copy * copy).backward();
  expect_near_all(values(p.grad()), {2 + 22, 4 + 42});
  // A tensor that did not require grad stays that way.
  mt::Tensor c = mt::zeros({2}, mt::f64);
  mt::Tensor c_copy = c;
  c.assign(mt::ones({2}, mt::f64));
  EXPECT_FALSE(c_copy.requires_grad());
  expect_near_all(values(c_copy), {1, 1});
}

// A chain of 300k nodes, and the backward pass of one of 150k, are dropped without recursing
// through their destructors (which overflowed the stack at about 150k nodes: a long unrolled
// loop, or a running sum kept across steps).
TEST(Graph, LongChainsAreDroppedWithoutRecursion) {
  {
    mt::Tensor running = mt::zeros({});
    for (int i = 0; i < 300000; ++i) running = running + 1.0;
  }
  mt::Tensor x = mt::ones({2});
  x.requires_grad_();
  {
    mt::Tensor y = x;
    for (int i = 0; i < 150000; ++i) y = y * 1.0;
    mt::sum(y).backward();
  }
  EXPECT_TRUE(x.grad().defined());  // a chain of 150k products, dropped with x
}

// assign_later leaves the value to the next evaluation, whatever it was asked for: batch norm's
// running statistics join the training step's program that way.
TEST(AssignLater, TheNextEvaluationComputesAndSettlesIt) {
  mt::Tensor state = mt::zeros({2}, mt::f64);
  mt::eval({state});
  mt::Tensor copy = state;
  mt::Tensor other = mt::ones({3}, mt::f64) * 2.0;
  state.assign_later(state + mt::tensor(std::vector<double>{1, 2}, {2}));
  EXPECT_FALSE(copy.is_leaf()) << "pending: the handle reads as the value's node";
  mt::reset_execution_stats();
  mt::eval({other});  // an unrelated evaluation computes it too, in the same program
  if (mt::current_device() != mt::Device::reference) {  // which counts no evaluations
    EXPECT_EQ(mt::execution_stats().evaluations, 1);
  }
  EXPECT_TRUE(copy.is_leaf());
  EXPECT_TRUE(copy.node()->inputs.empty());
  expect_near_all(values(copy), {1, 2});
  // Assigned twice before any evaluation: the second value wins and reads the first.
  state.assign_later(state * 10.0);
  state.assign_later(state + 1.0);
  expect_near_all(values(state), {11, 21});  // reading it evaluates
  EXPECT_TRUE(state.is_leaf());
  // A tensor dropped before the evaluation is no trouble.
  {
    mt::Tensor temporary = mt::zeros({2}, mt::f64);
    mt::eval({temporary});
    temporary.assign_later(temporary + 1.0);
  }
  mt::eval({other * 3.0});
}

// A value that cannot be computed fails its evaluation, and only that one: later evaluations go
// on, and the tensor keeps the value it had before (as if the forward pass that assigned it had
// not run). An evaluation that fails for another reason still settles a pending assignment.
TEST(AssignLater, AValueThatFailsDoesNotFailLaterEvaluations) {
  mt::Tensor source = mt::tensor(std::vector<double>{1, 2, 3}, {3});
  mt::Tensor buffer = mt::zeros({2}, mt::f64);
  mt::eval({buffer});
  const mt::Tensor bad_ids = mt::tensor(std::vector<int64_t>{0, 7}, {2});
  buffer.assign_later(mt::index_select(source, bad_ids, 0));
  EXPECT_MT_ERROR(mt::eval({source * 2.0}), "index 7");
  expect_near_all(values(source * 3.0), {3, 6, 9});
  expect_near_all(values(buffer), {0, 0});
  EXPECT_TRUE(buffer.is_leaf());
  buffer.assign_later(buffer + 5.0);
  EXPECT_MT_ERROR(mt::eval({mt::index_select(source, bad_ids, 0)}), "index 7");
  EXPECT_TRUE(buffer.is_leaf());
  expect_near_all(values(buffer), {5, 5});
}

// A model with batch norm survives a bad batch caught by the training loop: an index out of
// range before the norm leaves its running statistics as they were; a label out of range after
// it (the loss fails) keeps the forward pass's update, as PyTorch's eager norm has made it.
TEST(AssignLater, BatchNormSurvivesABadBatch) {
  mt::manual_seed(3);
  mt::Embedding embed(10, 4);
  mt::BatchNorm1d norm(4);
  mt::Linear head(4, 3);
  auto loss_of = [&](std::vector<int64_t> ids, std::vector<int64_t> labels) {
    mt::Tensor x = norm(embed(mt::tensor(ids, {4})));
    return mt::cross_entropy(head(x), mt::tensor(labels, {4}));
  };
  mt::SGD opt({embed.weight, norm.weight, norm.bias, head.weight, head.bias}, {.lr = 0.1});
  auto step = [&](std::vector<int64_t> ids, std::vector<int64_t> labels) {
    opt.zero_grad();
    loss_of(std::move(ids), std::move(labels)).backward();
    opt.step();
  };
  step({1, 2, 3, 4}, {0, 1, 2, 0});
  const std::vector<float> mean = norm.running_mean.to_vector<float>();
  EXPECT_MT_ERROR(step({1, 12, 3, 4}, {0, 1, 2, 0}), "index 12");
  EXPECT_EQ(norm.running_mean.to_vector<float>(), mean) << "the failed forward changed nothing";
  EXPECT_MT_ERROR(step({1, 2, 3, 4}, {0, 1, 9, 0}), "9");
  EXPECT_NE(norm.running_mean.to_vector<float>(), mean) << "the forward pass ran";
  step({5, 6, 7, 8}, {2, 1, 0, 1});  // training goes on
  for (float v : norm.running_var.to_vector<float>()) EXPECT_TRUE(std::isfinite(v));
}

// State assigned from a value that requires grad is state, as assign() makes it: no gradient
// flows through it, before or after it settles.
TEST(AssignLater, AValueThatRequiresGradIsAssignedDetached) {
  mt::Tensor w = leaf({1, 2}, {2});
  mt::Tensor b = mt::zeros({2}, mt::f64);
  mt::eval({b});
  b.assign_later(w * 2.0);
  EXPECT_FALSE(b.requires_grad());
  mt::sum(b * w).backward();
  expect_near_all(values(w.grad()), {2, 4});  // d(sum(b w))/dw = b, b a constant
  EXPECT_TRUE(b.is_leaf());
  EXPECT_FALSE(b.requires_grad());
  EXPECT_FALSE(b.grad().defined());
}

TEST(AssignLater, RefusesWhatAssignRefusesAndTensorsThatRequireGrad) {
  mt::Tensor p = leaf({1, 2}, {2});
  EXPECT_MT_ERROR(p.assign_later(p * 2.0), "assign_later", "requires grad");
  mt::Tensor c = mt::zeros({2}, mt::f64);
  EXPECT_MT_ERROR(c.assign_later(mt::ones({3}, mt::f64)), "assign_later", "[3]", "[2]");
  EXPECT_MT_ERROR(c.assign_later(mt::Tensor()), "assign_later", "undefined");
  expect_near_all(values(c), {0, 0});
}

TEST(Assign, WrongShapeOrDtypeThrowsAndChangesNothing) {
  mt::Tensor p = leaf({1, 2}, {2});
  const mt::Node* before = p.node().get();
  int line = __LINE__ + 1;
  EXPECT_MT_ERROR(p.assign(mt::ones({3}, mt::f64)), "assign", "[3]", "[2]",
                  "test_autograd.cpp:" + std::to_string(line));
  EXPECT_MT_ERROR(p.assign(mt::ones({2}, mt::f32)), "assign", "f32", "f64");
  EXPECT_MT_ERROR(p.assign(mt::Tensor()), "assign", "undefined");
  EXPECT_EQ(p.node().get(), before);
  expect_near_all(values(p), {1, 2});
}

TEST(Evaluation, TwiceDoesNotRecompute) {
  mt::Tensor x = mt::rand({5}, mt::f32) * 4.0 - 2.0;
  mt::Tensor y = mt::tanh(x) * mt::exp(x);
  std::vector<float> first = y.to_vector<float>();
  const mt::Storage* storage = y.node()->value.get();
  ASSERT_NE(storage, nullptr);
  std::vector<float> second = y.to_vector<float>();
  EXPECT_EQ(y.node()->value.get(), storage);
  EXPECT_EQ(first, second);
  mt::eval({y, x});
  EXPECT_EQ(y.node()->value.get(), storage);
  EXPECT_EQ(y.to_vector<float>(), first);
}

// A small classifier whose loss is read before backward(), as a training loop that logs would.
struct TinyNet {
  mt::Tensor w1, b1, w2;
  explicit TinyNet(uint64_t seed) {
    mt::Generator gen(seed);
    w1 = mt::randn({4, 3}, mt::f32, &gen);
    b1 = mt::randn({4}, mt::f32, &gen);
    w2 = mt::randn({3, 4}, mt::f32, &gen);
    for (mt::Tensor* p : {&w1, &b1, &w2}) p->requires_grad_();
  }
  mt::Tensor loss(const mt::Tensor& x, const mt::Tensor& y) const {
    mt::Tensor h = mt::relu(mt::linear(x, w1, b1));
    return mt::cross_entropy(mt::linear(h, w2), y);
  }
};

TEST(Evaluation, EvaluatedThenDifferentiatedMatchesDirectBackward) {
  mt::Generator gen(7);
  mt::Tensor x = mt::randn({6, 3}, mt::f32, &gen);
  mt::Tensor y = mt::tensor(std::vector<int64_t>{0, 1, 2, 2, 1, 0}, {6});
  TinyNet direct(3), logged(3);
  mt::Tensor direct_loss = direct.loss(x, y);
  direct_loss.backward();
  mt::Tensor logged_loss = logged.loss(x, y);
  double value = logged_loss.item();
  EXPECT_TRUE(std::isfinite(value));
  logged_loss.backward();
  EXPECT_EQ(direct_loss.item(), value);
  EXPECT_EQ(direct.w1.grad().to_vector<float>(), logged.w1.grad().to_vector<float>());
  EXPECT_EQ(direct.b1.grad().to_vector<float>(), logged.b1.grad().to_vector<float>());
  EXPECT_EQ(direct.w2.grad().to_vector<float>(), logged.w2.grad().to_vector<float>());
  // An independent check of one entry: f64 central differences through the same data.
  TinyNet probe(3);
  std::vector<float> w2 = probe.w2.to_vector<float>();
  auto loss_at = [&](double delta) {
    std::vector<double> shifted(w2.begin(), w2.end());
    shifted[5] += delta;
    TinyNet n(3);
    n.w2 = mt::tensor(shifted, {3, 4});
    n.w1 = mt::cast(n.w1, mt::f64);
    n.b1 = mt::cast(n.b1, mt::f64);
    return n.loss(mt::cast(x, mt::f64), y).item();
  };
  double numeric = (loss_at(1e-6) - loss_at(-1e-6)) / 2e-6;
  EXPECT_NEAR(logged.w2.grad().to_vector<double>()[5], numeric, 1e-4);
}

TEST(Memory, LongTrainingLoopKeepsTheGraphFlat) {
  // y = 2 x0 - x1 + 0.5 x2 + 1, learned by a Linear layer with SGD + momentum.
  mt::Generator gen(11);
  mt::Tensor x = mt::randn({16, 3}, mt::f32, &gen);
  std::vector<float> xs = x.to_vector<float>();
  std::vector<float> ys;
  for (size_t i = 0; i < 16; ++i)
    ys.push_back(2 * xs[3 * i] - xs[3 * i + 1] + 0.5f * xs[3 * i + 2] + 1);
  mt::Tensor y = mt::tensor(ys, {16, 1});
  mt::Linear model(3, 1, true, &gen);
  mt::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
  std::weak_ptr<mt::Node> previous_loss, previous_weight;
  double first_loss = 0, last_loss = 0;
  for (int step = 0; step < 300; ++step) {
    opt.zero_grad();
    mt::Tensor loss = mt::mse_loss(model(x), y);
    if (step == 0) first_loss = loss.item();
    loss.backward();
    std::weak_ptr<mt::Node> weight_before = model.weight.node();
    opt.step();
    // Nothing of the previous step may survive it: not its loss graph, not the old weights.
    ASSERT_TRUE(previous_loss.expired()) << "step " << step;
    ASSERT_TRUE(previous_weight.expired()) << "step " << step;
    previous_loss = loss.node();
    previous_weight = weight_before;
    for (const mt::Tensor& p : model.parameters()) {
      ASSERT_TRUE(p.is_leaf()) << "step " << step;
      ASSERT_TRUE(p.node()->inputs.empty()) << "step " << step;
      ASSERT_TRUE(p.requires_grad());
    }
    for (size_t i = 0; i < opt.params().size(); ++i) {
      mt::NamedTensors state = opt.state(i);
      ASSERT_EQ(state.size(), 1u);
      EXPECT_EQ(state[0].first, "momentum_buffer");
      ASSERT_TRUE(state[0].second.is_leaf()) << "step " << step;
      ASSERT_TRUE(state[0].second.node()->inputs.empty()) << "step " << step;
    }
    if (step == 299) last_loss = loss.item();
  }
  EXPECT_EQ(opt.steps_taken(), 300);
  EXPECT_GT(first_loss, 0.1);
  EXPECT_LT(last_loss, 1e-6);
  std::vector<float> w = model.weight.to_vector<float>();
  EXPECT_NEAR(w[0], 2.0, 1e-3);
  EXPECT_NEAR(w[1], -1.0, 1e-3);
  EXPECT_NEAR(w[2], 0.5, 1e-3);
  EXPECT_NEAR(model.bias.item(), 1.0, 1e-3);
}

// ---- what a review against torch 1.13 found ----

// Gradients of the activations whose exponential branch overflows where it is not taken: 0 * inf
// was NaN, added to the taken branch's gradient. torch: 1 (selu: its scale; softplus(-x): -1).
TEST(ActivationGradients, AreFiniteWhereTheUnusedBranchOverflows) {
  for (mt::DType dt : {mt::f32, mt::f64}) {
    const double big = dt == mt::f32 ? 100.0 : 800.0;
    auto gradient = [&](auto f, double at) {
      mt::Tensor x = mt::full({1}, at, dt).requires_grad_();
      mt::sum(f(x)).backward();
      return x.grad().template to_vector<double>()[0];
    };
    EXPECT_EQ(gradient([](const mt::Tensor& x) { return mt::softplus(x); }, big), 1.0);
    EXPECT_EQ(gradient([](const mt::Tensor& x) { return mt::softplus(-x); }, -big), -1.0);
    EXPECT_EQ(gradient([](const mt::Tensor& x) { return mt::elu(x); }, big), 1.0);
    EXPECT_NEAR(gradient([](const mt::Tensor& x) { return mt::selu(x); }, big), 1.0507009873554805,
                1e-6);
    EXPECT_EQ(gradient([](const mt::Tensor& x) { return mt::mish(x); }, big), 1.0);
    // The taken exponential branch is unchanged: elu'(-1) = exp(-1), softplus'(0) = 1/2.
    EXPECT_NEAR(gradient([](const mt::Tensor& x) { return mt::elu(x); }, -1.0), std::exp(-1.0),
                1e-7);
    EXPECT_NEAR(gradient([](const mt::Tensor& x) { return mt::softplus(x); }, 0.0), 0.5, 1e-7);
  }
}

// A NaN maximum's gradient is NaN, as torch.amax's: eq found no maximum, and zeros hid the NaN
// from the loss scaler's check of the gradients. min and norm(inf) share the rule.
TEST(ReductionGradients, ANanMaximumGivesNanGradients) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  mt::Tensor x = mt::tensor(std::vector<double>{1, nan, 3, 2, 5, 4}, {2, 3}).requires_grad_();
  mt::sum(mt::max(x, {1})).backward();
  std::vector<double> g = x.grad().to_vector<double>();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isnan(g[i])) << i;
  EXPECT_EQ(std::vector<double>(g.begin() + 3, g.end()), (std::vector<double>{0, 1, 0}));
  mt::Tensor y = mt::tensor(std::vector<double>{1, nan}, {2}).requires_grad_();
  mt::min(y).backward();
  EXPECT_TRUE(std::isnan(y.grad().to_vector<double>()[0]));
}

// The exponent's gradient of pow is 0 only where the base is 0 and the exponent not negative,
// as torch's: a negative base gives NaN (the log), a zero base and negative exponent -inf.
TEST(PowGradient, TheExponentsFollowsTorch) {
  auto exponent_gradient = [](double base, double exponent) {
    mt::Tensor e = mt::full({1}, exponent, mt::f64).requires_grad_();
    mt::sum(mt::pow(mt::full({1}, base, mt::f64), e)).backward();
    return e.grad().to_vector<double>()[0];
  };
  EXPECT_TRUE(std::isnan(exponent_gradient(-2, 2)));
  EXPECT_EQ(exponent_gradient(0, -1), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(exponent_gradient(0, 2), 0.0);
  EXPECT_EQ(exponent_gradient(0, 0), 0.0);
  EXPECT_NEAR(exponent_gradient(2, 3), 8 * std::log(2.0), 1e-12);
}

// A tensor assigned to a parameter member (one loaded from a file) is the parameter and trains,
// as module.h says: it required no grad and silently stayed as it was. One frozen in place stays
// frozen.
struct TwoWeights : mt::Module {
  mt::Tensor w = mt::zeros({2}), frozen = mt::zeros({2});
  TwoWeights() {
    register_parameter("w", &w);
    register_parameter("frozen", &frozen);
  }
};

TEST(ModuleParameters, ATensorAssignedToAParameterMemberTrains) {
  TwoWeights m;
  m.frozen.requires_grad_(false);
  m.w = mt::full({2}, 0.5);  // as a loaded tensor: no grad
  mt::SGD opt(m.parameters(), {.lr = 1.0});
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    mt::sum(m.w * 2.0 + m.frozen).backward();
    opt.step();
  }
  EXPECT_TRUE(m.w.requires_grad());
  EXPECT_EQ(m.w.to_vector<float>(), (std::vector<float>{-5.5f, -5.5f}));
  EXPECT_FALSE(m.frozen.requires_grad());
  EXPECT_EQ(m.frozen.to_vector<float>(), (std::vector<float>{0, 0}));
  // Another module's frozen parameter tied to a member stays frozen (a frozen pretrained
  // embedding as a decoder's weight).
  TwoWeights other;
  other.w.requires_grad_(false);
  m.w = other.w;
  (void)m.parameters();
  EXPECT_FALSE(other.w.requires_grad());
  // A computed tensor has no gradient of its own and would never train: refused when the
  // parameters are listed, as torch refuses a plain tensor assigned to a parameter; assign()
  // gives the parameter new values instead.
  m.w = other.w.detach() * 2.0;
  EXPECT_MT_ERROR((void)m.parameters(), "parameter 'w'", "computed tensor", "assign");
  m.w = mt::full({2}, 0.25);
  m.w.assign(other.w.detach() * 2.0);
  EXPECT_EQ(m.parameters().size(), 2u);
  EXPECT_TRUE(m.w.is_leaf());
}

// register_parameter(name, value, false) freezes the module's parameter even where the value
// trains (torch's Parameter(t, requires_grad=False)): the flag was ignored. The value itself
// keeps training.
struct FrozenFromTrainable : mt::Module {
  mt::Tensor source = mt::ones({2}).requires_grad_(), held;
  FrozenFromTrainable() { held = register_parameter("held", source, false); }
};

TEST(ModuleParameters, RegisteredFrozenStaysFrozen) {
  FrozenFromTrainable m;
  EXPECT_FALSE(m.held.requires_grad());
  EXPECT_TRUE(m.source.requires_grad());
  EXPECT_EQ(m.held.to_vector<float>(), (std::vector<float>{1, 1}));
}

// ModuleList's index past the end is an mt::Error (std::out_of_range escaped), and a const list
// iterates.
TEST(ModuleParameters, AModuleListIndexPastTheEndIsAnError) {
  mt::ModuleList<mt::Linear> list;
  list.emplace_back(2, 2);
  EXPECT_MT_ERROR((void)list[5], "index 5 is out of range for 1 modules");
  const mt::ModuleList<mt::Linear>& view = list;
  int count = 0;
  for (const auto& layer : view) count += layer->weight.defined() ? 1 : 0;
  EXPECT_EQ(count, 1);
}

}  // namespace
