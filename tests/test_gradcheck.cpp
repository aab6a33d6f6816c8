// tests/test_gradcheck.cpp -- every op's gradient against f64 central finite differences.
//
// "An op without a passing gradient check does not exist": the per-op suite below is
// instantiated for every OpCode of dsl/ops.def, and an op that has neither a gradient sample nor
// a proof that it never carries a gradient fails. Pointwise samples are generated from ops.def
// itself, so a new unary or binary op is checked the moment it is declared.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "mixtape/codegen/hash.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;

namespace {

using mt::OpCode;
using Tensors = std::vector<mt::Tensor>;
using Builder = std::function<mt::Tensor(const Tensors&)>;
using Values = std::vector<std::vector<double>>;

// Where input values come from. Each distribution keeps central differences (which look eps to
// either side) clear of the points where an op has no derivative.
enum class Dist {
  Normal,        // N(0, 1)
  Positive,      // U[0.5, 2): log, sqrt, rsqrt, the base of pow
  AwayFromZero,  // |x| in [0.3, 1.3): kinks of relu/abs, poles of reciprocal/div
  Grid,          // distinct: ranks 0.25 apart plus jitter < 0.04, so max never ties
  GridShifted,   // the Grid lattice moved by 0.125: at least 0.085 from any Grid value
  Dyadic,        // multiples of 2^-8 in [-2, 2]: exact in f16 and f32, and so are x +- 2^-8
  Inside,        // U[-0.8, 0.8): inside asin's and acos's domain, clear of its ends
  SomeZeros,     // N(0, 1) with every third element exactly 0: products' gradients at zeros
};

struct Input {
  mt::Shape shape;
  Dist dist = Dist::Normal;
};

struct Sample {
  std::string label;
  std::vector<Input> inputs;
  Builder build;
  // The op under test must appear in the built graph; false only where the API is documented to
  // skip the node (a cast to the same dtype returns its input).
  bool makes_node = true;
  double eps = 1e-6;
  Dist weights = Dist::Normal;  // of the fixed random weighting that reduces y to a scalar
};

uint64_t seed_of(const std::string& label) {  // stable across runs and platforms
  return mt::hash_string(label).lo;
}

std::vector<double> draw(Dist dist, int64_t n, mt::Generator& gen) {
  switch (dist) {
    case Dist::Normal:
      return mt::randn({n}, mt::f64, &gen).to_vector<double>();
    case Dist::Positive:
      return mt::rand({n}, mt::f64, &gen, 0.5, 2.0).to_vector<double>();
    case Dist::Inside:
      return mt::rand({n}, mt::f64, &gen, -0.8, 0.8).to_vector<double>();
    case Dist::AwayFromZero: {
      std::vector<double> v = mt::rand({n}, mt::f64, &gen, -1.0, 1.0).to_vector<double>();
      for (double& x : v) x += x < 0 ? -0.3 : 0.3;
      return v;
    }
    case Dist::Grid:
    case Dist::GridShifted: {
      std::vector<double> order = mt::rand({n}, mt::f64, &gen).to_vector<double>();
      std::vector<double> jitter = mt::rand({n}, mt::f64, &gen, 0.0, 0.04).to_vector<double>();
      std::vector<int64_t> rank(static_cast<size_t>(n));
      std::iota(rank.begin(), rank.end(), 0);
      std::sort(rank.begin(), rank.end(),
                [&](int64_t a, int64_t b) { return order[a] < order[b]; });
      std::vector<double> v(static_cast<size_t>(n));
      double shift = dist == Dist::GridShifted ? 0.125 : 0.0;
      for (int64_t r = 0; r < n; ++r)
        v[rank[r]] = 0.25 * static_cast<double>(r - n / 2) + jitter[rank[r]] + shift;
      return v;
    }
    case Dist::SomeZeros: {
      std::vector<double> v = mt::randn({n}, mt::f64, &gen).to_vector<double>();
      for (size_t i = 0; i < v.size(); i += 3) v[i] = 0;
      return v;
    }
    case Dist::Dyadic: {
      std::vector<double> v = mt::rand({n}, mt::f64, &gen, -2.0, 2.0).to_vector<double>();
      for (double& x : v) x = std::round(x * 256.0) / 256.0;
      return v;
    }
  }
  return {};
}

Tensors leaves_of(const Sample& s, const Values& values, bool requires_grad) {
  Tensors leaves;
  for (size_t i = 0; i < s.inputs.size(); ++i) {
    mt::Tensor t = mt::tensor(values[i], s.inputs[i].shape);
    if (requires_grad) t.requires_grad_();
    leaves.push_back(t);
  }
  return leaves;
}

mt::Tensor weighted_sum(const mt::Tensor& y, const std::vector<double>& w) {
  return mt::sum(y * mt::tensor(w, y.shape()));
}

// The sample's inputs and the weighting of its output, both fixed by the label.
struct Prepared {
  Values values;
  std::vector<double> weights;
};

Prepared prepare(const Sample& s) {
  mt::Generator gen(seed_of(s.label));
  Prepared p;
  for (const Input& in : s.inputs) p.values.push_back(draw(in.dist, mt::numel(in.shape), gen));
  mt::Tensor y = s.build(leaves_of(s, p.values, false));
  p.weights = draw(s.weights, y.numel(), gen);
  return p;
}

bool graph_contains(const mt::Tensor& y, OpCode op) {
  std::vector<const mt::Node*> stack{y.node().get()};
  std::unordered_set<const mt::Node*> seen;
  while (!stack.empty()) {
    const mt::Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    if (n->op == op) return true;
    for (const mt::NodePtr& input : n->inputs) stack.push_back(input.get());
  }
  return false;
}

struct Mismatch {
  size_t input;
  size_t element;
  double analytic;
  double numeric;
};

struct Report {
  int64_t checked = 0;
  std::vector<Mismatch> mismatches;
};

// Compares one analytic gradient per input against central differences of `f` over every input
// element. A gradient the autograd left undefined counts as zero.
Report compare_with_fd(const Sample& s, const Values& values, const Tensors& analytic,
                       const std::function<double(const Values&)>& f, double tol) {
  Report report;
  Values x = values;
  for (size_t i = 0; i < values.size(); ++i) {
    std::vector<double> a = analytic[i].defined() ? analytic[i].to_vector<double>()
                                                  : std::vector<double>(values[i].size(), 0.0);
    for (size_t j = 0; j < values[i].size(); ++j) {
      x[i][j] = values[i][j] + s.eps;
      double plus = f(x);
      x[i][j] = values[i][j] - s.eps;
      double minus = f(x);
      x[i][j] = values[i][j];
      double numeric = (plus - minus) / (2 * s.eps);
      ++report.checked;
      if (!(std::abs(a[j] - numeric) <= tol * (1 + std::abs(numeric))))
        report.mismatches.push_back({i, j, a[j], numeric});
    }
  }
  return report;
}

// d/dx sum(build(x) * w) by mt::grad, against central differences of the forward value.
Report check_first_order(const Sample& s, double tol = 1e-6) {
  Prepared p = prepare(s);
  Tensors leaves = leaves_of(s, p.values, true);
  mt::Tensor y = s.build(leaves);
  EXPECT_EQ(y.dtype(), mt::f64) << s.label;
  EXPECT_TRUE(y.requires_grad()) << s.label << ": the output does not require grad";
  Tensors grads = mt::grad({weighted_sum(y, p.weights)}, leaves, {}, false, true);
  auto loss = [&](const Values& v) {
    mt::NoGradGuard no_grad;
    return weighted_sum(s.build(leaves_of(s, v, false)), p.weights).item();
  };
  return compare_with_fd(s, p.values, grads, loss, tol);
}

// With S(x) = sum_i <dL/dx_i, v_i> for fixed random v, mt::grad(S) is the Hessian of L applied to
// v. It is checked against central differences of S computed from first-order gradients only.
Report check_second_order(const Sample& s, double tol = 1e-6) {
  Prepared p = prepare(s);
  mt::Generator gen(seed_of(s.label + "/direction"));
  Values v;
  for (const Input& in : s.inputs) v.push_back(draw(Dist::Normal, mt::numel(in.shape), gen));

  Tensors leaves = leaves_of(s, p.values, true);
  Tensors first = mt::grad({weighted_sum(s.build(leaves), p.weights)}, leaves, {}, true, true);
  mt::Tensor directional;
  for (size_t i = 0; i < first.size(); ++i) {
    if (!first[i].defined()) continue;
    mt::Tensor term = mt::sum(first[i] * mt::tensor(v[i], s.inputs[i].shape));
    directional = directional.defined() ? directional + term : term;
  }
  Report empty;
  if (!directional.defined() || !directional.requires_grad()) {
    ADD_FAILURE() << s.label << ": the first gradient does not depend on the inputs";
    return empty;
  }
  Tensors second = mt::grad({directional}, leaves, {}, false, true);

  auto directional_value = [&](const Values& x) {
    Tensors at = leaves_of(s, x, true);
    Tensors g = mt::grad({weighted_sum(s.build(at), p.weights)}, at, {}, false, true);
    double total = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!g[i].defined()) continue;
      std::vector<double> gi = g[i].to_vector<double>();
      total += std::inner_product(gi.begin(), gi.end(), v[i].begin(), 0.0);
    }
    return total;
  };
  return compare_with_fd(s, p.values, second, directional_value, tol);
}

void expect_passes(const Sample& s, const Report& report) {
  EXPECT_GT(report.checked, 0) << s.label << ": nothing was checked";
  for (size_t k = 0; k < report.mismatches.size() && k < 6; ++k) {
    const Mismatch& m = report.mismatches[k];
    ADD_FAILURE() << s.label << ": d/d input " << m.input << " [" << m.element << "]: analytic "
                  << m.analytic << " vs finite differences " << m.numeric;
  }
  if (report.mismatches.size() > 6)
    ADD_FAILURE() << s.label << ": " << report.mismatches.size() - 6 << " more mismatches";
}

// ---------------------------------------------------------------------------------------------
// The sample table: OpCode -> builders. Pointwise entries come from ops.def.

mt::Tensor ids(std::vector<int64_t> values, mt::Shape shape, mt::DType dtype = mt::i64) {
  return mt::tensor(values, std::move(shape), dtype);
}

Dist unary_dist(OpCode op) {
  switch (op) {
    case OpCode::Log:
    case OpCode::Log1p:
    case OpCode::Sqrt:
    case OpCode::Rsqrt:
      return Dist::Positive;
    case OpCode::Asin:
    case OpCode::Acos:
      return Dist::Inside;
    case OpCode::Abs:
    case OpCode::Relu:
    case OpCode::Reciprocal:
      return Dist::AwayFromZero;
    default:
      return Dist::Normal;
  }
}

std::pair<Dist, Dist> binary_dists(OpCode op) {
  switch (op) {
    case OpCode::Div:
    case OpCode::Fmod:
      return {Dist::Normal, Dist::AwayFromZero};
    case OpCode::Pow:
      return {Dist::Positive, Dist::Normal};
    case OpCode::Maximum:
    case OpCode::Minimum:
      return {Dist::Grid, Dist::GridShifted};
    default:
      return {Dist::Normal, Dist::Normal};
  }
}

using Table = std::map<OpCode, std::vector<Sample>>;

void add(Table& t, OpCode op, std::string label, std::vector<Input> inputs, Builder build) {
  t[op].push_back(Sample{std::move(label), std::move(inputs), std::move(build)});
}

void add_pointwise(Table& t) {
  const std::vector<mt::Shape> unary_shapes = {{}, {5}, {2, 3}};
  // Both operands broadcast, rank differs, a 0-d operand, and plain same-shape.
  const std::vector<std::pair<mt::Shape, mt::Shape>> binary_shapes = {
      {{2, 3}, {2, 3}}, {{3, 1}, {1, 4}}, {{2, 3, 4}, {4}}, {{}, {2, 3}}, {{2, 1, 4}, {3, 1}}};
  std::map<OpCode, Builder> unary, binary;
#define MT_OP(Name, fname, kind, arity, category)
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  unary[OpCode::Name] = [](const Tensors& x) { return mt::fname(x[0]); };
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1) \
  binary[OpCode::Name] = [](const Tensors& x) { return mt::fname(x[0], x[1]); };
#define MT_COMPARE(Name, fname, REF)
#include "mixtape/dsl/ops.def"
  for (auto& [op, build] : unary) {
    if (op == OpCode::Sign || op == OpCode::Detach) continue;  // no gradient: probed below
    for (const mt::Shape& shape : unary_shapes)
      add(t, op, fmt::format("{} {}", mt::op_name(op), mt::to_string(shape)),
          {{shape, unary_dist(op)}}, build);
  }
  for (auto& [op, build] : binary) {
    auto [d0, d1] = binary_dists(op);
    for (const auto& [s0, s1] : binary_shapes)
      add(t, op, fmt::format("{} {}x{}", mt::op_name(op), mt::to_string(s0), mt::to_string(s1)),
          {{s0, d0}, {s1, d1}}, build);
  }
  // Operators with a scalar operand go through the same nodes with a Full leaf.
  add(t, OpCode::Add, "x + 1.5", {{{2, 3}}}, [](const Tensors& x) { return x[0] + 1.5; });
  add(t, OpCode::Sub, "2 - x", {{{2, 3}}}, [](const Tensors& x) { return 2 - x[0]; });
  add(t, OpCode::Mul, "x * x (one input twice)", {{{2, 3}}},
      [](const Tensors& x) { return x[0] * x[0]; });
  add(t, OpCode::Div, "1 / x", {{{2, 3}, Dist::AwayFromZero}},
      [](const Tensors& x) { return 1.0 / x[0]; });
  add(t, OpCode::Pow, "pow(x, 3) negative bases", {{{2, 3}, Dist::AwayFromZero}},
      [](const Tensors& x) { return mt::pow(x[0], 3.0); });
  add(t, OpCode::Pow, "pow(x, -0.5)", {{{2, 3}, Dist::Positive}},
      [](const Tensors& x) { return mt::pow(x[0], -0.5); });
  add(t, OpCode::Maximum, "maximum(x, 0)", {{{2, 3}, Dist::AwayFromZero}},
      [](const Tensors& x) { return mt::maximum(x[0], mt::zeros({}, mt::f64)); });

  // where: the condition is data, the two values are differentiable and broadcast.
  auto cond = [](mt::Shape shape) {
    std::vector<int64_t> bits(static_cast<size_t>(mt::numel(shape)));
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = (i * 7 + 3) % 5 < 2;
    return mt::tensor(bits, shape, mt::boolean);
  };
  add(t, OpCode::Where, "where [3,1] ? [3,4] : [4]", {{{3, 4}}, {{4}}}, [cond](const Tensors& x) {
    return mt::where(cond({3, 1}), x[0], x[1]);
  });
  add(t, OpCode::Where, "where [2,3] ? [2,3] : []", {{{2, 3}}, {{}}}, [cond](const Tensors& x) {
    return mt::where(cond({2, 3}), x[0], x[1]);
  });
  add(t, OpCode::Where, "where [2,3,4] ? [3,1] : [2,1,4]", {{{3, 1}}, {{2, 1, 4}}},
      [cond](const Tensors& x) {
        return mt::where(cond({2, 3, 4}), x[0], x[1]);
      });
}

void add_cast(Table& t) {
  Sample same{"cast f64 -> f64 (no node)", {{{2, 3}}}, [](const Tensors& x) {
                return mt::cast(x[0], mt::f64) * 1.0;
              }};
  same.makes_node = false;
  t[OpCode::Cast].push_back(same);
  // Dyadic inputs, steps and weights keep the round trips exact, so differences see slope 1.
  Sample f32{"cast f64 -> f32 -> f64", {{{2, 3}, Dist::Dyadic}}, [](const Tensors& x) {
               return mt::cast(mt::cast(x[0], mt::f32), mt::f64);
             }};
  Sample f32_math{"square in f32 between casts", {{{2, 3}, Dist::Dyadic}}, [](const Tensors& x) {
                    return mt::cast(mt::square(mt::cast(x[0], mt::f32)), mt::f64);
                  }};
  Sample f16{"cast f64 -> f16 -> f64", {{{2, 3}, Dist::Dyadic}}, [](const Tensors& x) {
               return mt::cast(mt::cast(x[0], mt::f16), mt::f64);
             }};
  Sample promote{"f32 + f64 promotes through a cast",
                 {{{2, 3}, Dist::Dyadic}, {{3}, Dist::Dyadic}},
                 [](const Tensors& x) { return mt::cast(x[0], mt::f32) + x[1]; }};
  for (Sample* s : {&f32, &f32_math, &f16, &promote}) {
    s->eps = 0x1p-8;
    s->weights = Dist::Dyadic;
    t[OpCode::Cast].push_back(*s);
  }
  // cast_like: x takes the gradient, `like` (only a type) none, which its zero differences say.
  Sample like_f64{"cast_like f64 as f64", {{{2, 3}}, {{2, 3}}}, [](const Tensors& x) {
                    return mt::cast_like(x[0], x[1]);
                  }};
  Sample like_f32{"cast_like f64 as f32, back to f64",
                  {{{2, 3}, Dist::Dyadic}, {{2, 3}, Dist::Dyadic}},
                  [](const Tensors& x) {
                    return mt::cast(mt::cast_like(x[0], mt::cast(x[1], mt::f32)), mt::f64);
                  }};
  like_f32.eps = 0x1p-8;
  like_f32.weights = Dist::Dyadic;
  t[OpCode::CastLike] = {like_f64, like_f32};
}

void add_reductions(Table& t) {
  struct Axes {
    std::vector<int64_t> axes;
    bool keepdim;
  };
  const std::vector<Axes> cases = {
      {{}, false}, {{1}, false}, {{0, 2}, true}, {{-1}, true}, {{2, 0}, false}};
  for (const Axes& c : cases) {
    std::string suffix = fmt::format("axes [{}] keepdim {}", fmt::join(c.axes, ","), c.keepdim);
    add(t, OpCode::Sum, "sum [2,3,4] " + suffix, {{{2, 3, 4}}},
        [c](const Tensors& x) { return mt::sum(x[0], c.axes, c.keepdim); });
    add(t, OpCode::Max, "max [2,3,4] " + suffix, {{{2, 3, 4}, Dist::Grid}},
        [c](const Tensors& x) { return mt::max(x[0], c.axes, c.keepdim); });
  }
  add(t, OpCode::Sum, "sum of a 0-d tensor", {{{}}},
      [](const Tensors& x) { return mt::sum(x[0]); });
  add(t, OpCode::Max, "max [6]", {{{6}, Dist::Grid}},
      [](const Tensors& x) { return mt::max(x[0]); });
}

// Scans along an axis. The vjps run the scans the other way, so these check reverse scans too.
void add_scans(Table& t) {
  add(t, OpCode::Cumsum, "cumsum [3,4] dim 1", {{{3, 4}}},
      [](const Tensors& x) { return mt::cumsum(x[0], 1); });
  add(t, OpCode::Cumsum, "cumsum [2,3,2] dim -3", {{{2, 3, 2}}},
      [](const Tensors& x) { return mt::cumsum(x[0], -3); });
  add(t, OpCode::Cumprod, "cumprod [3,4] dim 1", {{{3, 4}}},
      [](const Tensors& x) { return mt::cumprod(x[0], 1); });
  // Rows with two zeros, one zero and none: the gradient at and after a zero.
  add(t, OpCode::Cumprod, "cumprod [3,5] dim 1 with zeros", {{{3, 5}, Dist::SomeZeros}},
      [](const Tensors& x) { return mt::cumprod(x[0], 1); });
  add(t, OpCode::Cumprod, "cumprod [6,2] dim 0 with zeros", {{{6, 2}, Dist::SomeZeros}},
      [](const Tensors& x) { return mt::cumprod(x[0], 0); });
  add(t, OpCode::Logcumsumexp, "logcumsumexp [3,4] dim 1", {{{3, 4}}},
      [](const Tensors& x) { return mt::logcumsumexp(x[0] * 3.0, 1); });
  add(t, OpCode::Logcumsumexp, "logcumsumexp [4,3] dim 0", {{{4, 3}}},
      [](const Tensors& x) { return mt::logcumsumexp(x[0], 0); });
}

void add_matmul(Table& t) {
  struct Case {
    std::string label;
    mt::Shape a, b;
    bool ta, tb;
  };
  const std::vector<Case> cases = {
      {"[3,4]@[4,2]", {3, 4}, {4, 2}, false, false},
      {"[4,3]^T@[4,2]", {4, 3}, {4, 2}, true, false},
      {"[3,4]@[2,4]^T", {3, 4}, {2, 4}, false, true},
      {"[4,3]^T@[2,4]^T", {4, 3}, {2, 4}, true, true},
      {"batch-broadcast [2,1,3,4]@[3,4,2]", {2, 1, 3, 4}, {3, 4, 2}, false, false},
      {"batch-broadcast [2,4,3]^T@[1,2,4]^T", {2, 4, 3}, {1, 2, 4}, true, true},
      {"batched [2,3,4]@[4,2]", {2, 3, 4}, {4, 2}, false, false},
      {"1-d [4]@[4,2]", {4}, {4, 2}, false, false},
      {"1-d [3,4]@[4]", {3, 4}, {4}, false, false},
      {"1-d dot [4]@[4]", {4}, {4}, false, false},
      {"1-d [2,3,4]@[4]", {2, 3, 4}, {4}, false, false},
      {"1-d [4]@[2,4,3]", {4}, {2, 4, 3}, false, false},
      {"1-d [4]@[3,4]^T", {4}, {3, 4}, false, true},
  };
  for (const Case& c : cases)
    add(t, OpCode::MatMul, "matmul " + c.label, {{c.a}, {c.b}},
        [c](const Tensors& x) { return mt::matmul(x[0], x[1], c.ta, c.tb); });
}

// Each convolution primitive with strides, padding, dilation and groups that leave some input
// rows unread (a stride past the last tap) and pad both sides.
void add_conv(Table& t) {
  struct Case {
    std::string label;
    mt::Shape x, w;
    mt::Conv2dOptions options;
  };
  const std::vector<Case> cases = {
      {"[2,3,5,4]*[4,3,3,2]", {2, 3, 5, 4}, {4, 3, 3, 2}, {}},
      {"stride 2 pad 1", {1, 2, 6, 5}, {3, 2, 3, 3}, {.stride = 2, .padding = 1}},
      {"stride (2,1) pad (0,2) dilation (1,2) groups 2",
       {1, 4, 5, 4},
       {2, 2, 2, 3},
       {.stride = {2, 1}, .padding = {0, 2}, .dilation = {1, 2}, .groups = 2}},
      {"depthwise", {2, 3, 4, 4}, {3, 1, 3, 3}, {.padding = 1, .groups = 3}},
  };
  for (const Case& c : cases) {
    const mt::ConvWindow window = mt::ConvWindow::of(c.options);
    mt::Shape y = mt::conv2d(mt::zeros(c.x), mt::zeros(c.w), {}, c.options).shape();
    add(t, OpCode::Conv2d, "conv2d " + c.label, {{c.x}, {c.w}},
        [c](const Tensors& x) { return mt::conv2d(x[0], x[1], {}, c.options); });
    add(t, OpCode::Conv2dInputGrad, "conv2d_input_grad " + c.label, {{y}, {c.w}},
        [c, window](const Tensors& x) { return mt::conv2d_input_grad(x[0], x[1], c.x, window); });
    add(t, OpCode::Conv2dWeightGrad, "conv2d_weight_grad " + c.label, {{c.x}, {y}},
        [c, window](const Tensors& x) { return mt::conv2d_weight_grad(x[0], x[1], c.w, window); });
  }
}

// Both max-pooling primitives on Grid inputs (no ties), with padding, dilation and ceil mode;
// max_pool2d_grad is linear in gy and constant in x away from ties.
void add_max_pool(Table& t) {
  mt::PoolWindow padded_ceil, dilated;
  padded_ceil.kernel[0] = padded_ceil.kernel[1] = 3;
  padded_ceil.stride[0] = padded_ceil.stride[1] = 2;
  padded_ceil.pad[0] = padded_ceil.pad[1] = 1;
  dilated.kernel[0] = 2, dilated.kernel[1] = 3, dilated.stride[1] = 2, dilated.pad[0] = 1;
  dilated.dil[0] = dilated.dil[1] = 2;
  struct Case {
    std::string label;
    mt::Shape x;
    mt::PoolWindow window;
    mt::Size2 out;
  };
  // 6 -> ceil((6 + 2 - 2 - 1) / 2) + 1 = 4 in ceil mode (3 in floor mode); the dilated
  // window: 6 -> 6, 7 -> 2.
  const std::vector<Case> cases = {{"k3 s2 p1 ceil", {1, 2, 6, 6}, padded_ceil, {4, 4}},
                                   {"k(2,3) s(1,2) p(1,0) d2", {2, 1, 6, 7}, dilated, {6, 2}}};
  for (const Case& c : cases) {
    add(t, OpCode::MaxPool2d, "max_pool2d_forward " + c.label, {{c.x, Dist::Grid}},
        [c](const Tensors& x) { return mt::max_pool2d_forward(x[0], c.window, c.out); });
    mt::Shape y = {c.x[0], c.x[1], c.out.h, c.out.w};
    add(t, OpCode::MaxPool2dGrad, "max_pool2d_grad " + c.label, {{c.x, Dist::Grid}, {y}},
        [c](const Tensors& x) { return mt::max_pool2d_grad(x[0], x[1], c.window); });
  }
}

// Fused attention (f64: its kernel's f64 tiles): causal, a bool padding mask with a broadcast
// batch dim, an additive mask, lengths that differ; attention_backward is declared without a
// gradient (a probe below), and a graph-building backward takes the materialized gradient.
void add_attention(Table& t) {
  add(t, OpCode::Attention, "attention_forward causal", {{{2, 5, 3}}, {{2, 5, 3}}, {{2, 5, 2}}},
      [](const Tensors& x) {
        return mt::attention_forward(x[0], x[1], x[2], mt::Tensor(), true, 0.7);
      });
  add(t, OpCode::Attention, "attention_forward padding mask",
      {{{2, 1, 3, 4}}, {{2, 1, 6, 4}}, {{2, 1, 6, 3}}}, [](const Tensors& x) {
        mt::Tensor keep = mt::tensor(std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0},
                                     {2, 1, 1, 6}, mt::boolean);
        return mt::attention_forward(x[0], x[1], x[2], keep, false, 0.5);
      });
  add(t, OpCode::Attention, "attention_forward additive mask",
      {{{1, 4, 3}}, {{1, 4, 3}}, {{1, 4, 3}}}, [](const Tensors& x) {
        mt::Tensor bias = mt::tensor(std::vector<double>{0.5, -1, 0, 2, -0.25, 1, 0.75, -2, 0, 0,
                                                         0.5, 1, -1.5, 0.25, 0, -0.5},
                                     {1, 4, 4}, mt::f64);
        return mt::attention_forward(x[0], x[1], x[2], bias, true, 0.6);
      });
}

void add_data_movement(Table& t) {
  add(t, OpCode::Reshape, "reshape [2,3,4] -> [6,4]", {{{2, 3, 4}}}, [](const Tensors& x) {
    return mt::reshape(x[0], {6, 4});
  });
  add(t, OpCode::Reshape, "reshape [2,3,4] -> [4,-1]", {{{2, 3, 4}}}, [](const Tensors& x) {
    return mt::reshape(x[0], {4, -1});
  });
  add(t, OpCode::Reshape, "reshape [1] -> []", {{{1}}},
      [](const Tensors& x) { return mt::reshape(x[0], {}); });
  add(t, OpCode::Reshape, "unsqueeze/squeeze/flatten", {{{2, 3, 4}}},
      [](const Tensors& x) { return mt::flatten(mt::squeeze(mt::unsqueeze(x[0], 1), 1), 1, 2); });

  add(t, OpCode::Permute, "permute [2,3,4] (2,0,1)", {{{2, 3, 4}}}, [](const Tensors& x) {
    return mt::permute(x[0], {2, 0, 1});
  });
  add(t, OpCode::Permute, "permute [2,3,4] (1,-1,0)", {{{2, 3, 4}}}, [](const Tensors& x) {
    return mt::permute(x[0], {1, -1, 0});
  });
  add(t, OpCode::Permute, "transpose [3,4]", {{{3, 4}}},
      [](const Tensors& x) { return mt::transpose(x[0]); });

  const std::vector<std::pair<mt::Shape, mt::Shape>> broadcasts = {
      {{3, 1}, {2, 3, 4}}, {{4}, {3, 4}}, {{}, {2, 2}}, {{1, 3, 1}, {2, 3, 4}}};
  for (const auto& [from, to] : broadcasts)
    add(t, OpCode::BroadcastTo,
        fmt::format("broadcast_to {} -> {}", mt::to_string(from), mt::to_string(to)), {{from}},
        [to](const Tensors& x) { return mt::broadcast_to(x[0], to); });

  add(t, OpCode::Slice, "slice [5,4] rows 1:5:2", {{{5, 4}}},
      [](const Tensors& x) { return mt::slice(x[0], 0, 1, 5, 2); });
  add(t, OpCode::Slice, "slice [3,7] cols -5:100:3 (negative, clamped)", {{{3, 7}}},
      [](const Tensors& x) { return mt::slice(x[0], 1, -5, 100, 3); });
  add(t, OpCode::Slice, "slice [3,4] last axis 0:-1", {{{3, 4}}},
      [](const Tensors& x) { return mt::slice(x[0], -1, 0, -1); });
  add(t, OpCode::Slice, "strided slice [4,5,3]", {{{4, 5, 3}}}, [](const Tensors& x) {
    return mt::slice(x[0], {1, 0, 2}, {2, 2, 1}, {2, 3, 1});
  });

  add(t, OpCode::Unslice, "unslice [2,3] into [5,6]", {{{2, 3}}}, [](const Tensors& x) {
    return mt::unslice(x[0], {1, 0}, {2, 2}, {5, 6});
  });
  add(t, OpCode::Unslice, "unslice [3] into [7] from 4", {{{3}}},
      [](const Tensors& x) { return mt::unslice(x[0], {4}, {1}, {7}); });
  add(t, OpCode::Unslice, "unslice [2,2,3] rows into [3,4,5]", {{{2, 2, 3}}}, [](const Tensors& x) {
    return mt::unslice(x[0], {1, 2, 1}, {1, 1, 1}, {3, 4, 5});
  });

  add(t, OpCode::Concat, "concat 3 inputs axis 1", {{{2, 1, 3}}, {{2, 2, 3}}, {{2, 3, 3}}},
      [](const Tensors& x) { return mt::concat(x, 1); });
  add(t, OpCode::Concat, "concat 3 inputs axis 0", {{{1, 4}}, {{2, 4}}, {{3, 4}}},
      [](const Tensors& x) { return mt::concat(x, 0); });
  add(t, OpCode::Concat, "concat 3 inputs axis -1", {{{2, 2}}, {{2, 1}}, {{2, 3}}},
      [](const Tensors& x) { return mt::concat(x, -1); });
  add(t, OpCode::Concat, "stack 3 inputs axis 1", {{{2, 3}}, {{2, 3}}, {{2, 3}}},
      [](const Tensors& x) { return mt::stack(x, 1); });
  add(t, OpCode::Concat, "concat one input twice", {{{2, 3}}}, [](const Tensors& x) {
    return mt::concat({x[0], x[0] * 2.0}, 0);
  });
}

void add_indexing(Table& t) {
  add(t, OpCode::IndexSelect, "index_select [5,3] rows 4,0,4,2", {{{5, 3}}}, [](const Tensors& x) {
    return mt::index_select(x[0], ids({4, 0, 4, 2}, {4}), 0);
  });
  add(t, OpCode::IndexSelect, "index_select [3,4,2] axis 1 by a [2,3] index", {{{3, 4, 2}}},
      [](const Tensors& x) {
        return mt::index_select(x[0], ids({3, 0, 3, 1, 1, 2}, {2, 3}, mt::i32), 1);
      });
  add(t, OpCode::IndexSelect, "embedding [6,3] by [2,3] ids", {{{6, 3}}}, [](const Tensors& x) {
    return mt::embedding(x[0], ids({5, 1, 1, 0, 5, 5}, {2, 3}));
  });

  add(t, OpCode::IndexAdd, "index_add [5,3] += [4,3] at 1,3,1,0", {{{5, 3}}, {{4, 3}}},
      [](const Tensors& x) {
        return mt::index_add(x[0], ids({1, 3, 1, 0}, {4}), x[1], 0);
      });
  add(t, OpCode::IndexAdd, "index_add [2,4,3] axis 1 += [2,2,3] at 3,3", {{{2, 4, 3}}, {{2, 2, 3}}},
      [](const Tensors& x) {
        return mt::index_add(x[0], ids({3, 3}, {2}), x[1], 1);
      });

  add(t, OpCode::Gather, "gather [3,4] axis 1 by [3,2]", {{{3, 4}}}, [](const Tensors& x) {
    return mt::gather(x[0], ids({0, 3, 2, 2, 1, 0}, {3, 2}), 1);
  });
  add(t, OpCode::Gather, "gather [4,3] axis 0 by [2,3] (i32)", {{{4, 3}}}, [](const Tensors& x) {
    return mt::gather(x[0], ids({3, 0, 1, 3, 3, 2}, {2, 3}, mt::i32), 0);
  });

  add(t, OpCode::ScatterAdd, "scatter_add [3,4] axis 1 from [3,3]", {{{3, 4}}, {{3, 3}}},
      [](const Tensors& x) {
        return mt::scatter_add(x[0], ids({0, 3, 0, 2, 2, 2, 1, 0, 3}, {3, 3}), x[1], 1);
      });
  add(t, OpCode::ScatterAdd, "scatter_add [4,3] axis 0 from [2,3]", {{{4, 3}}, {{2, 3}}},
      [](const Tensors& x) {
        return mt::scatter_add(x[0], ids({3, 0, 1, 3, 3, 2}, {2, 3}), x[1], 0);
      });

  // Positions written once each: where one is written twice, the overwritten source's
  // derivative is 0 but PyTorch's gradient (and this one) gives it the position's.
  add(t, OpCode::Scatter, "scatter [3,4] dim 1 from [3,2]", {{{3, 4}}, {{3, 2}}},
      [](const Tensors& x) {
        return mt::scatter(x[0], 1, ids({0, 3, 2, 1, 1, 0}, {3, 2}), x[1]);
      });
  add(t, OpCode::Scatter, "scatter [4,3] dim 0 from a larger [3,3] source", {{{4, 3}}, {{3, 3}}},
      [](const Tensors& x) {
        return mt::scatter(x[0], 0, ids({3, 0, 1, 1, 2, 0}, {2, 3}, mt::i32), x[1]);
      });
}

mt::Tensor custom_mul_sin(const Tensors& x) {
  return mt::custom_op(
      {x[0], x[1]}, [](const Tensors& in) { return in[0] * in[1] + mt::sin(in[0]); },
      [](const Tensors& in, const mt::Tensor&, const mt::Tensor& g) -> Tensors {
        return {g * (in[1] + mt::cos(in[0])), g * in[0]};
      });
}

void add_custom(Table& t) {
  add(t, OpCode::Custom, "custom a*b + sin(a)", {{{2, 3}}, {{2, 3}}}, custom_mul_sin);
  add(t, OpCode::Custom, "custom exp, vjp from the output", {{{4}}}, [](const Tensors& x) {
    return mt::custom_op(
        {x[0]}, [](const Tensors& in) { return mt::exp(in[0]); },
        [](const Tensors&, const mt::Tensor& out, const mt::Tensor& g) -> Tensors {
          return {g * out};
        });
  });
  add(t, OpCode::Custom, "custom op inside a graph", {{{3}}}, [](const Tensors& x) {
    return mt::tanh(custom_mul_sin({x[0] * 2.0, mt::square(x[0])}));
  });
}

// With one process a collective is its input, and so is its gradient's (tests/mpi check two).
void add_collectives(Table& t) {
  add(t, OpCode::AllReduce, "all_reduce over one process", {{{3, 4}}},
      [](const Tensors& x) { return mt::all_reduce(x[0]) * x[0]; });
  add(t, OpCode::ReduceScatter, "reduce_scatter over one process", {{{6}}},
      [](const Tensors& x) { return mt::reduce_scatter(x[0]) * x[0]; });
  add(t, OpCode::AllGather, "all_gather over one process", {{{6}}},
      [](const Tensors& x) { return mt::all_gather(x[0]) * x[0]; });
  // A check that holds is its value, and so is its gradient.
  add(t, OpCode::Check, "check of a value that holds", {{{2, 3}}}, [](const Tensors& x) {
    return mt::check(x[0], mt::abs(x[0]) < 1e6, mt::CheckKind::Probabilities) * x[0];
  });
}

const Table& op_samples() {
  static const Table table = [] {
    Table t;
    add_pointwise(t);
    add_cast(t);
    add_reductions(t);
    add_scans(t);
    add_matmul(t);
    add_conv(t);
    add_max_pool(t);
    add_attention(t);
    add_data_movement(t);
    add_indexing(t);
    add_custom(t);
    add_collectives(t);
    return t;
  }();
  return table;
}

// Ops whose result never carries a gradient. Each probe gets an f64 [3,4] input that requires
// grad and must return a node of that op which does not require grad.
const std::map<OpCode, Builder>& no_grad_probes() {
  static const std::map<OpCode, Builder> probes = [] {
    std::map<OpCode, Builder> p;
    p[OpCode::Constant] = [](const Tensors&) {
      return mt::tensor(std::vector<double>{1, 2, 3}, {3});
    };
    p[OpCode::Full] = [](const Tensors& x) { return mt::full_like(x[0], 2.0); };
    p[OpCode::Arange] = [](const Tensors&) { return mt::arange(0.0, 5.0, 1.0, mt::f64); };
    p[OpCode::RandUniform] = [](const Tensors& x) {
      mt::Generator gen(7);
      return mt::rand(x[0].shape(), mt::f64, &gen);
    };
    p[OpCode::RandNormal] = [](const Tensors& x) {
      mt::Generator gen(7);
      return mt::randn(x[0].shape(), mt::f64, &gen);
    };
#define MT_OP(Name, fname, kind, arity, category)
#define MT_UNARY(Name, fname, category, domain, REF, VJP)
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1)
#define MT_COMPARE(Name, fname, REF) \
  p[OpCode::Name] = [](const Tensors& x) { return mt::fname(x[0], x[0] * 0.5); };
#define MT_FUSED(Name, fname, arity, REF)   \
  p[OpCode::Name] = [](const Tensors& x) {  \
    std::array<mt::Tensor, arity> operands; \
    operands.fill(x[0]);                    \
    return mt::fname(operands);             \
  };
#include "mixtape/dsl/ops.def"
    p[OpCode::AttentionBackward] = [](const Tensors& x) {
      return mt::attention_backward(x[0], x[0], x[0], x[0], x[0], mt::Tensor(), true, 0.5);
    };
    p[OpCode::Argmax] = [](const Tensors& x) { return mt::argmax(x[0], 1); };
    p[OpCode::Argsort] = [](const Tensors& x) { return mt::argsort(x[0], 1, true); };
    p[OpCode::Sign] = [](const Tensors& x) { return mt::sign(x[0]); };
    p[OpCode::Detach] = [](const Tensors& x) { return x[0].detach(); };
    return p;
  }();
  return probes;
}

// Composite ops are DSL code over primitives; their gradients are checked end to end.
const std::vector<Sample>& composite_samples() {
  static const std::vector<Sample> samples = [] {
    std::vector<Sample> c;
    auto add_c = [&c](std::string label, std::vector<Input> inputs, Builder build) {
      c.push_back(Sample{std::move(label), std::move(inputs), std::move(build)});
    };
    add_c("softmax_last", {{{3, 4}}}, [](const Tensors& x) { return mt::softmax(x[0]); });
    add_c("conv2d_bias_3d_input", {{{2, 5, 4}}, {{3, 2, 2, 3}}, {{3}}}, [](const Tensors& x) {
      return mt::conv2d(x[0], x[1], x[2], {.padding = {1, 0}});
    });
    add_c("conv1d_bias_stride_dilation", {{{2, 2, 7}}, {{4, 1, 3}}, {{4}}}, [](const Tensors& x) {
      return mt::conv1d(x[0], x[1], x[2], {.stride = 2, .padding = 1, .dilation = 2, .groups = 2});
    });
    add_c("conv_transpose2d_bias_output_padding", {{{1, 4, 3, 2}}, {{4, 3, 3, 2}}, {{6}}},
          [](const Tensors& x) {
            return mt::conv_transpose2d(
                x[0], x[1], x[2],
                {.stride = 2, .padding = {1, 0}, .output_padding = {1, 0}, .groups = 2});
          });
    // An output_padding of a stride or more, below the dilation, as PyTorch takes.
    add_c("conv_transpose2d_output_padding_below_dilation", {{{1, 2, 3, 2}}, {{2, 2, 2, 2}}},
          [](const Tensors& x) {
            return mt::conv_transpose2d(
                x[0], x[1], {}, {.stride = {1, 2}, .output_padding = {2, 2}, .dilation = 3});
          });
    add_c("softmax_axis0", {{{3, 4}}}, [](const Tensors& x) { return mt::softmax(x[0], 0); });
    // einsum's lowerings: a batched matmul with a broadcast "...", a broadcast product, a
    // diagonal, and a chain of three operands with a batch label shared by all.
    add_c("einsum_ellipsis_matmul", {{{2, 1, 3, 4}}, {{3, 4, 2}}}, [](const Tensors& x) {
      return mt::einsum("...ij,...jk->...ik", {x[0], x[1]});
    });
    add_c("einsum_outer_transposed", {{{3}}, {{2, 4}}}, [](const Tensors& x) {
      return mt::einsum("i,jk->kij", {x[0], x[1]});
    });
    add_c("einsum_diagonal", {{{3, 3, 2}}},
          [](const Tensors& x) { return mt::einsum("iij->ji", {x[0]}); });
    add_c("einsum_three_operands", {{{2, 3}}, {{2, 3, 4}}, {{2, 4}}}, [](const Tensors& x) {
      return mt::einsum("bi,bij,bj->b", {x[0], x[1], x[2]});
    });
    add_c("masked_softmax_broadcast_mask", {{{2, 3, 4}}}, [](const Tensors& x) {
      mt::Tensor mask =
          mt::tensor(std::vector<int64_t>{1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0}, {3, 4}, mt::boolean);
      return mt::masked_softmax(x[0], mask);
    });
    add_c("log_softmax_last", {{{2, 3, 4}}},
          [](const Tensors& x) { return mt::log_softmax(x[0]); });
    add_c("log_softmax_axis1", {{{2, 3, 4}}},
          [](const Tensors& x) { return mt::log_softmax(x[0], 1); });
    add_c("logsumexp_last", {{{3, 4}}}, [](const Tensors& x) { return mt::logsumexp(x[0]); });
    add_c("clamp", {{{3, 4}}}, [](const Tensors& x) { return mt::clamp(x[0], -0.4, 0.3); });
    add_c("nll_loss", {{{3, 4}}}, [](const Tensors& x) {
      return mt::nll_loss(mt::log_softmax(x[0]), ids({3, -100, 1}, {3}));
    });
    add_c("binary_cross_entropy", {{{3, 4}}, {{3, 4}}}, [](const Tensors& x) {
      return mt::binary_cross_entropy(mt::sigmoid(x[0]), mt::sigmoid(x[1]), mt::Reduction::Sum);
    });
    add_c("l1_loss", {{{3, 4}, Dist::AwayFromZero}, {{3, 4}, Dist::Dyadic}},
          [](const Tensors& x) { return mt::l1_loss(x[0] * 4.0, x[1]); });
    add_c("smooth_l1_loss", {{{3, 4}}, {{3, 4}}},
          [](const Tensors& x) { return mt::smooth_l1_loss(x[0], x[1], mt::Reduction::Sum, 0.7); });
    add_c("huber_loss", {{{3, 4}}, {{3, 4}}},
          [](const Tensors& x) { return mt::huber_loss(x[0], x[1], mt::Reduction::Mean, 0.7); });
    add_c("kl_div", {{{3, 4}}, {{3, 4}}}, [](const Tensors& x) {
      return mt::kl_div(mt::log_softmax(x[0]), mt::softmax(x[1]), mt::Reduction::Sum);
    });
    add_c("flip_roll", {{{2, 3, 4}}}, [](const Tensors& x) {
      return mt::roll(mt::flip(x[0], {1}), {-1, 2}, {0, 2});
    });
    add_c("tril_triu", {{{3, 4}}},
          [](const Tensors& x) { return mt::tril(x[0], 1) * 2.0 + mt::triu(x[0], 2); });
    add_c("repeat_tile", {{{2, 3}}}, [](const Tensors& x) {
      return mt::repeat(x[0], {2, 1, 2}) + mt::tile(x[0], {2, 1, 2});
    });
    add_c("std_norm", {{{3, 4}}}, [](const Tensors& x) {
      return mt::std_dev(x[0], {1}) + mt::norm(x[0], 2.0, {1}) + mt::norm(x[0], 1.0, {1});
    });
    add_c("softplus_threshold", {{{3, 4}}},
          [](const Tensors& x) { return mt::softplus(x[0] * 3.0, 1.5, 2.0); });
    add_c("leaky_relu", {{{3, 4}, Dist::AwayFromZero}},
          [](const Tensors& x) { return mt::leaky_relu(x[0], 0.2); });
    add_c("elu", {{{3, 4}, Dist::AwayFromZero}},
          [](const Tensors& x) { return mt::elu(x[0], 1.5); });
    add_c("selu", {{{3, 4}, Dist::AwayFromZero}}, [](const Tensors& x) { return mt::selu(x[0]); });
    add_c("mish", {{{3, 4}}}, [](const Tensors& x) { return mt::mish(x[0]); });
    add_c("hardsigmoid", {{{3, 4}, Dist::GridShifted}},
          [](const Tensors& x) { return mt::hardsigmoid(x[0] * 2.0); });
    add_c("hardswish", {{{3, 4}, Dist::GridShifted}},
          [](const Tensors& x) { return mt::hardswish(x[0] * 2.0); });
    add_c("remainder", {{{3, 4}}, {{3, 4}, Dist::AwayFromZero}},
          [](const Tensors& x) { return mt::remainder(x[0], x[1]); });
    add_c("lerp", {{{3, 4}}, {{3, 4}}, {{3, 4}}},
          [](const Tensors& x) { return mt::lerp(x[0], x[1], x[2]); });
    add_c("masked_fill", {{{3, 4}}}, [](const Tensors& x) {
      return mt::masked_fill(x[0], mt::tensor(std::vector<int64_t>{1, 0, 0, 1}, {4}, mt::boolean),
                             2.0);
    });
    add_c("pad_constant_crop", {{{2, 3, 4}}}, [](const Tensors& x) {
      return mt::pad(x[0], {1, -1, -1, 2}, mt::PadMode::Constant, 3.0);
    });
    add_c("pad_reflect", {{{2, 3, 4}}}, [](const Tensors& x) {
      return mt::pad(x[0], {3, 2, 1, 2}, mt::PadMode::Reflect);
    });
    add_c("pad_replicate", {{{2, 3, 4}}}, [](const Tensors& x) {
      return mt::pad(x[0], {2, 1, 0, 3}, mt::PadMode::Replicate);
    });
    // Vision (dsl/vision.h). Grid inputs keep max_pool2d's windows free of ties.
    add_c("max_pool2d_pad_ceil", {{{1, 2, 5, 5}, Dist::Grid}},
          [](const Tensors& x) { return mt::max_pool2d(x[0], 3, 2, 1, 1, true); });
    add_c("max_pool2d_dilated_rect", {{{1, 1, 5, 6}, Dist::Grid}}, [](const Tensors& x) {
      return mt::max_pool2d(x[0], {2, 3}, {{1, 2}}, {1, 0}, 2);
    });
    add_c("avg_pool2d_pad_ceil_exclude_pad", {{{1, 2, 5, 6}}},
          [](const Tensors& x) { return mt::avg_pool2d(x[0], 3, 2, 1, true, false); });
    add_c("adaptive_avg_pool2d", {{{1, 2, 5, 7}}}, [](const Tensors& x) {
      return mt::adaptive_avg_pool2d(x[0], {3, 2});
    });
    add_c("batch_norm_training", {{{3, 2, 2, 2}}, {{2}}, {{2}}}, [](const Tensors& x) {
      // Fresh running buffers per call: training assigns them.
      return mt::batch_norm(x[0], mt::zeros({2}, mt::f64), mt::ones({2}, mt::f64), x[1], x[2], true,
                            0.1, 1e-3);
    });
    add_c("batch_norm_eval", {{{3, 2, 4}}, {{2}}, {{2}}}, [](const Tensors& x) {
      mt::Tensor mean = mt::tensor(std::vector<double>{0.3, -0.2}, {2});
      mt::Tensor var = mt::tensor(std::vector<double>{0.5, 2.0}, {2});
      return mt::batch_norm(x[0], mean, var, x[1], x[2], false);
    });
    add_c("group_norm", {{{2, 4, 3}}, {{4}}, {{4}}},
          [](const Tensors& x) { return mt::group_norm(x[0], 2, x[1], x[2], 1e-3); });
    add_c("instance_norm", {{{2, 3, 4}}}, [](const Tensors& x) { return mt::instance_norm(x[0]); });
    add_c("interpolate_bilinear", {{{1, 2, 3, 4}}}, [](const Tensors& x) {
      return mt::interpolate(x[0], {.size = {5, 7}, .mode = mt::InterpolateMode::Bilinear});
    });
    add_c("interpolate_bilinear_align_corners", {{{1, 1, 3, 3}}}, [](const Tensors& x) {
      return mt::interpolate(
          x[0],
          {.scale_factor = {1.5}, .mode = mt::InterpolateMode::Bilinear, .align_corners = true});
    });
    add_c("interpolate_nearest", {{{1, 2, 3, 4}}}, [](const Tensors& x) {
      return mt::interpolate(x[0], {.size = {5, 3}});
    });
    add_c("interpolate_bicubic", {{{1, 2, 3, 4}}}, [](const Tensors& x) {
      return mt::interpolate(x[0], {.size = {5, 3}, .mode = mt::InterpolateMode::Bicubic});
    });
    add_c("interpolate_bicubic_align_corners", {{{1, 1, 4, 3}}}, [](const Tensors& x) {
      return mt::interpolate(
          x[0],
          {.scale_factor = {1.5}, .mode = mt::InterpolateMode::Bicubic, .align_corners = true});
    });
    add_c("pad_circular", {{{2, 3, 4}}}, [](const Tensors& x) {
      return mt::pad(x[0], {4, 2, 1, 3}, mt::PadMode::Circular);
    });
    add_c("conv2d_same_reflect", {{{1, 2, 4, 3}}, {{3, 2, 2, 3}}}, [](const Tensors& x) {
      return mt::conv2d(x[0], x[1], {},
                        {.padding = mt::Padding::Same, .padding_mode = mt::PadMode::Reflect});
    });
    add_c("conv1d_same_circular", {{{1, 2, 5}}, {{2, 2, 4}}}, [](const Tensors& x) {
      return mt::conv1d(x[0], x[1], {},
                        {.padding = mt::Padding::Same, .padding_mode = mt::PadMode::Circular});
    });
    add_c("unfold", {{{1, 2, 4, 5}}}, [](const Tensors& x) {
      mt::Tensor cols = mt::unfold(x[0], {2, 3}, {1, 2}, {1, 0}, {2, 1});
      return cols * cols;
    });
    add_c("fold", {{{1, 12, 16}}}, [](const Tensors& x) {
      mt::Tensor image = mt::fold(x[0], {4, 5}, {2, 3}, {2, 1}, {1, 2}, {1, 2});
      return image * image;
    });
    add_c("adaptive_max_pool2d", {{{2, 2, 5, 7}}}, [](const Tensors& x) {
      return mt::adaptive_max_pool2d(x[0], {3, 2});
    });
    // Volumes: conv3d over one 2-d convolution of gathered depth taps, the 3-d poolings over
    // two 2-d passes.
    add_c("conv3d_bias_groups_strided", {{{1, 4, 4, 3, 5}}, {{4, 2, 2, 2, 3}}, {{4}}},
          [](const Tensors& x) {
            return mt::conv3d(x[0], x[1], x[2],
                              {.stride = {2, 1, 2}, .padding = {1, 0, 1}, .groups = 2});
          });
    add_c("conv3d_same_reflect_unbatched", {{{2, 3, 4, 3}}, {{2, 2, 2, 3, 2}}},
          [](const Tensors& x) {
            return mt::conv3d(x[0], x[1], {},
                              {.padding = mt::Padding::Same,
                               .dilation = {1, 1, 2},
                               .padding_mode = mt::PadMode::Reflect});
          });
    add_c("conv_transpose3d_bias_groups_output_padding",
          {{{1, 4, 2, 3, 2}}, {{4, 1, 3, 2, 2}}, {{2}}}, [](const Tensors& x) {
            return mt::conv_transpose3d(x[0], x[1], x[2],
                                        {.stride = {2, 1, 2},
                                         .padding = {1, 0, 1},
                                         .output_padding = {1, 0, 1},
                                         .groups = 2});
          });
    add_c("conv_transpose3d_dilated_cropped_unbatched", {{{2, 3, 2, 2}}, {{2, 2, 2, 2, 3}}},
          [](const Tensors& x) {
            return mt::conv_transpose3d(x[0], x[1], {},
                                        {.stride = {1, 2, 1},
                                         .padding = {3, 1, 0},
                                         .output_padding = {2, 1, 0},
                                         .dilation = 3});
          });
    add_c("conv_transpose1d_groups_output_padding", {{{2, 4, 3}}, {{4, 1, 3}}, {{2}}},
          [](const Tensors& x) {
            return mt::conv_transpose1d(
                x[0], x[1], x[2],
                {.stride = 2, .padding = 1, .output_padding = 1, .groups = 2, .dilation = 2});
          });
    add_c("max_pool1d_pad_ceil_dilated", {{{2, 2, 9}, Dist::Grid}},
          [](const Tensors& x) { return mt::max_pool1d(x[0], 3, 2, 1, 2, true); });
    add_c("avg_pool1d_exclude_pad_ceil", {{{2, 7}}},
          [](const Tensors& x) { return mt::avg_pool1d(x[0], 3, 2, 1, true, false); });
    add_c("adaptive_pools1d", {{{2, 3, 7}}}, [](const Tensors& x) {
      return mt::adaptive_avg_pool1d(x[0], 3) + mt::adaptive_max_pool1d(x[0], 3);
    });
    add_c("prelu_per_channel", {{{2, 3, 4}}, {{3}}},
          [](const Tensors& x) { return mt::prelu(x[0], x[1]); });
    add_c("prelu_shared_1d", {{{5}}, {{1}}},
          [](const Tensors& x) { return mt::prelu(x[0], x[1]); });
    add_c("max_pool3d_pad_ceil", {{{1, 2, 4, 5, 5}, Dist::Grid}},
          [](const Tensors& x) { return mt::max_pool3d(x[0], 3, 2, 1, 1, true); });
    add_c("max_pool3d_dilated_rect", {{{1, 1, 5, 4, 6}, Dist::Grid}}, [](const Tensors& x) {
      return mt::max_pool3d(x[0], {2, 2, 3}, {{1, 2, 2}}, {1, 0, 1}, {2, 1, 1});
    });
    add_c("avg_pool3d_pad_ceil_exclude_pad", {{{1, 2, 4, 5, 6}}},
          [](const Tensors& x) { return mt::avg_pool3d(x[0], 3, 2, 1, true, false); });
    add_c("adaptive_avg_pool3d", {{{1, 2, 5, 4, 7}}}, [](const Tensors& x) {
      return mt::adaptive_avg_pool3d(x[0], {3, 4, 2});
    });
    add_c("adaptive_max_pool3d", {{{1, 2, 5, 4, 7}}}, [](const Tensors& x) {
      return mt::adaptive_max_pool3d(x[0], {2, 3, 3});
    });
    add_c("grid_sample_zeros", {{{1, 2, 3, 4}}, {{1, 2, 3, 2}}},
          [](const Tensors& x) { return mt::grid_sample(x[0], x[1] * 0.6); });
    add_c("grid_sample_reflection_corners", {{{1, 2, 3, 4}}, {{1, 2, 3, 2}}}, [](const Tensors& x) {
      return mt::grid_sample(x[0], x[1],
                             {.padding_mode = mt::GridPadding::Reflection, .align_corners = true});
    });
    add_c("grid_sample_bicubic_border", {{{1, 2, 3, 4}}, {{1, 2, 3, 2}}}, [](const Tensors& x) {
      return mt::grid_sample(
          x[0], x[1],
          {.mode = mt::GridSampleMode::Bicubic, .padding_mode = mt::GridPadding::Border});
    });
    add_c("affine_grid_sample", {{{1, 2, 3, 4}}, {{1, 2, 3}}}, [](const Tensors& x) {
      return mt::grid_sample(x[0], mt::affine_grid(x[1] * 0.5, {1, 2, 3, 3}),
                             {.padding_mode = mt::GridPadding::Border});
    });
    add_c("grid_sample_volume_reflection", {{{1, 2, 2, 3, 3}}, {{1, 2, 2, 2, 3}}},
          [](const Tensors& x) {
            return mt::grid_sample(x[0], x[1], {.padding_mode = mt::GridPadding::Reflection});
          });
    add_c("affine_grid_sample_volume", {{{1, 1, 2, 3, 3}}, {{1, 3, 4}}}, [](const Tensors& x) {
      return mt::grid_sample(x[0], mt::affine_grid(x[1] * 0.5, {1, 1, 2, 2, 3}, true),
                             {.padding_mode = mt::GridPadding::Border, .align_corners = true});
    });
    add_c("interpolate_trilinear", {{{1, 2, 2, 3, 3}}}, [](const Tensors& x) {
      return mt::interpolate(x[0], {.size = {3, 2, 5}, .mode = mt::InterpolateMode::Trilinear});
    });
    add_c("interpolate_area_volume", {{{1, 2, 3, 5, 4}}}, [](const Tensors& x) {
      return mt::interpolate(x[0], {.size = {2, 3, 3}, .mode = mt::InterpolateMode::Area});
    });
    add_c("max_unpool2d", {{{1, 2, 2, 3}}}, [](const Tensors& x) {
      // The picks of a fixed image, so that the indices do not move with the input.
      mt::Tensor image = mt::reshape(mt::arange(0.0, 48.0, 1.0, mt::f64), {1, 2, 4, 6});
      mt::Tensor picks = mt::max_pool2d_with_indices(mt::cos(image), 2).indices;
      mt::Tensor y = mt::max_unpool2d(x[0], picks, 2, std::nullopt, 0, mt::Size2{4, 6});
      return y * y;
    });
    add_c("pixel_shuffle_unshuffle", {{{1, 8, 2, 3}}}, [](const Tensors& x) {
      mt::Tensor up = mt::pixel_shuffle(x[0], 2);
      return mt::pixel_unshuffle(up * up, 2);
    });
    add_c("split_weighted", {{{2, 5}}}, [](const Tensors& x) {
      std::vector<mt::Tensor> parts = mt::split(x[0], 2, 1);
      return mt::concat({parts[2] * 3.0, parts[0], parts[1] * parts[1]}, 1);
    });
    add_c("bce_with_logits_pos_weight", {{{3, 4}}, {{4}}}, [](const Tensors& x) {
      mt::Tensor y = mt::tensor(std::vector<double>{0, 1, 0.25, 0.5, 1, 0, 0.75, 1, 0, 0, 1, 0.5},
                                {3, 4}, mt::f64);
      return mt::binary_cross_entropy_with_logits(
          x[0] * 4.0, y, {.reduction = mt::Reduction::Sum, .pos_weight = x[1]});
    });
    add_c("logsumexp_axes01_keepdim", {{{2, 3, 4}}}, [](const Tensors& x) {
      return mt::logsumexp(x[0], {0, 1}, true);
    });
    add_c("layer_norm", {{{3, 4}}, {{4}}, {{4}}},
          [](const Tensors& x) { return mt::layer_norm(x[0], x[1], x[2]); });
    add_c("layer_norm_two_axes", {{{2, 3, 4}}, {{3, 4}}, {{3, 4}}},
          [](const Tensors& x) { return mt::layer_norm(x[0], x[1], x[2], 1e-5, 2); });
    add_c("layer_norm_no_affine", {{{3, 5}}},
          [](const Tensors& x) { return mt::layer_norm(x[0], mt::Tensor(), mt::Tensor()); });
    add_c("rms_norm", {{{3, 4}}, {{4}}}, [](const Tensors& x) { return mt::rms_norm(x[0], x[1]); });
    add_c("linear", {{{2, 3}}, {{4, 3}}, {{4}}},
          [](const Tensors& x) { return mt::linear(x[0], x[1], x[2]); });
    add_c("cross_entropy_ignore_index_label_smoothing", {{{4, 5}}}, [](const Tensors& x) {
      return mt::cross_entropy(x[0], ids({1, -100, 4, 0}, {4}),
                               {.reduction = mt::Reduction::Mean, .label_smoothing = 0.1});
    });
    add_c("cross_entropy_sum_3d", {{{2, 3, 5}}}, [](const Tensors& x) {
      return mt::cross_entropy(x[0], ids({1, 2, 4, 0, 0, 3}, {2, 3}),
                               {.reduction = mt::Reduction::Sum});
    });
    add_c("cross_entropy_none_custom_ignore", {{{4, 3}}}, [](const Tensors& x) {
      return mt::cross_entropy(
          x[0], ids({2, 0, 2, 1}, {4}, mt::i32),
          {.reduction = mt::Reduction::None, .ignore_index = 2, .label_smoothing = 0.2});
    });
    add_c("mse_loss_mean", {{{3, 4}}, {{3, 4}}},
          [](const Tensors& x) { return mt::mse_loss(x[0], x[1]); });
    add_c("mse_loss_sum", {{{3, 4}}, {{3, 4}}},
          [](const Tensors& x) { return mt::mse_loss(x[0], x[1], mt::Reduction::Sum); });
    add_c("gelu_and_gelu_tanh", {{{2, 3}}},
          [](const Tensors& x) { return mt::gelu(x[0]) * mt::gelu_tanh(x[0]); });
    add_c("sdpa_causal", {{{2, 3, 4}}, {{2, 3, 4}}, {{2, 3, 4}}}, [](const Tensors& x) {
      return mt::scaled_dot_product_attention(x[0], x[1], x[2], true);
    });
    add_c("sdpa_cross_lengths", {{{2, 2, 4}}, {{2, 3, 4}}, {{2, 3, 5}}},
          [](const Tensors& x) { return mt::scaled_dot_product_attention(x[0], x[1], x[2]); });
    // A fresh generator per build: every finite-difference rebuild draws the same mask.
    add_c("dropout_fixed_generator", {{{4, 5}}}, [](const Tensors& x) {
      mt::Generator gen(1234);
      return mt::dropout(x[0], 0.3, true, &gen);
    });
    // dsl/selection.h. Grid inputs keep sorts free of ties.
    add_c("prod_dim1_keepdim", {{{3, 4}}},
          [](const Tensors& x) { return mt::prod(x[0], 1, true); });
    add_c("prod_with_zeros", {{{3, 4}, Dist::SomeZeros}},  // rows with two zeros, one, one
          [](const Tensors& x) { return mt::prod(x[0], -1); });
    add_c("prod_all", {{{2, 3}}}, [](const Tensors& x) { return mt::prod(x[0]); });
    add_c("sort_descending_values", {{{3, 4}, Dist::Grid}},
          [](const Tensors& x) { return mt::sort(x[0], 1, true).values; });
    add_c("topk_smallest_dim0", {{{5, 3}, Dist::Grid}},
          [](const Tensors& x) { return mt::topk(x[0], 2, 0, false).values; });
    add_c("take_along_dim_broadcast", {{{3, 1, 4}}}, [](const Tensors& x) {
      return mt::take_along_dim(x[0], ids({3, 0, 0, 2, 1, 1}, {1, 2, 3}), 2);
    });
    add_c("masked_select_broadcast_mask", {{{2, 3}}}, [](const Tensors& x) {
      mt::Tensor mask = mt::tensor(std::vector<int64_t>{1, 0, 1}, {3}, mt::boolean);
      return mt::masked_select(x[0], mask);
    });
    add_c("min_axis1", {{{3, 4}, Dist::Grid}}, [](const Tensors& x) { return mt::min(x[0], {1}); });
    add_c("min_all", {{{3, 4}, Dist::Grid}}, [](const Tensors& x) { return mt::min(x[0]); });
    add_c("var_axis0_keepdim", {{{3, 4}}},
          [](const Tensors& x) { return mt::var(x[0], {0}, true); });
    add_c("var_all", {{{3, 4}}}, [](const Tensors& x) { return mt::var(x[0]); });
    add_c("mean_last", {{{2, 3, 4}}}, [](const Tensors& x) { return mt::mean(x[0], {-1}); });
    add_c("mean_all", {{{2, 3}}}, [](const Tensors& x) { return x[0].mean(); });
    add_c("operators_mixed", {{{2, 3}}, {{3}, Dist::AwayFromZero}},
          [](const Tensors& x) { return (x[0] * 3.0 - 1.5) / x[1] + mt::exp(-x[0]) * x[1]; });
    add_c("one_hot_weighting", {{{4, 3}}}, [](const Tensors& x) {
      return x[0] * mt::one_hot(ids({2, 0, 7, 1}, {4}), 3, mt::f64);
    });
    return c;
  }();
  return samples;
}

// ---------------------------------------------------------------------------------------------
// Tests

std::string test_name(std::string label) {
  for (char& ch : label)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return label;
}

class OpGradCheck : public ::testing::TestWithParam<int> {};

TEST_P(OpGradCheck, MatchesFiniteDifferences) {
  OpCode op = static_cast<OpCode>(GetParam());
  SCOPED_TRACE(mt::op_name(op));
  const Table& table = op_samples();
  const auto& probes = no_grad_probes();
  auto found = table.find(op);
  auto probe = probes.find(op);
  if (probe != probes.end()) {
    EXPECT_TRUE(found == table.end()) << "an op without gradient cannot have gradient samples";
    mt::Generator gen(11);
    mt::Tensor x = mt::tensor(mt::randn({3, 4}, mt::f64, &gen).to_vector<double>(), {3, 4});
    x.requires_grad_();
    mt::Tensor y = probe->second({x});
    EXPECT_EQ(y.node()->op, op) << "the probe does not make the op";
    EXPECT_FALSE(y.requires_grad()) << "the op's output requires grad";
    EXPECT_NO_THROW(y.to_vector<double>());
    return;
  }
  ASSERT_TRUE(found != table.end() && !found->second.empty())
      << "op '" << mt::op_name(op) << "' has no gradient sample and no no-gradient probe";
  bool any_makes_node = false;
  for (const Sample& s : found->second) {
    SCOPED_TRACE(s.label);
    Tensors leaves = leaves_of(s, prepare(s).values, true);
    mt::Tensor y = s.build(leaves);
    bool contains = graph_contains(y, op);
    if (s.makes_node) {
      EXPECT_TRUE(contains) << s.label << " does not make a '" << mt::op_name(op) << "' node";
    }
    any_makes_node |= contains;
    expect_passes(s, check_first_order(s));
  }
  EXPECT_TRUE(any_makes_node);
}

INSTANTIATE_TEST_SUITE_P(AllOps, OpGradCheck, ::testing::Range(0, mt::op_count()),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return test_name(mt::op_name(static_cast<OpCode>(info.param)));
                         });

TEST(GradCheckCoverage, EveryOpHasASampleOrProvablyNoGradient) {
  const Table& table = op_samples();
  const auto& probes = no_grad_probes();
  int missing = 0;
  for (int i = 0; i < mt::op_count(); ++i) {
    OpCode op = static_cast<OpCode>(i);
    bool sampled = table.count(op) && !table.at(op).empty();
    bool probed = probes.count(op) > 0;
    if (sampled == probed) {
      ++missing;
      ADD_FAILURE() << "op '" << mt::op_name(op) << "': " << (sampled ? "both" : "neither")
                    << " a gradient sample and a no-gradient probe";
    }
  }
  EXPECT_EQ(missing, 0);
  for (const auto& [op, samples] : table) EXPECT_LT(static_cast<int>(op), mt::op_count());
  // The leaves, comparisons, argmax, argsort, sign, detach, attention's fused gradient and the
  // fused update arithmetic are exactly the no-gradient ops.
  std::vector<OpCode> expected = {
      OpCode::Constant,   OpCode::Full,   OpCode::Arange,  OpCode::RandUniform,
      OpCode::RandNormal, OpCode::Eq,     OpCode::Ne,      OpCode::Lt,
      OpCode::Le,         OpCode::Gt,     OpCode::Ge,      OpCode::Argmax,
      OpCode::Sign,       OpCode::Detach, OpCode::Argsort, OpCode::AttentionBackward,
      OpCode::MulAdd,     OpCode::SubMul, OpCode::Lincomb, OpCode::LincombSquare,
      OpCode::AdamStep};
  EXPECT_EQ(probes.size(), expected.size());
  for (OpCode op : expected) EXPECT_TRUE(probes.count(op)) << mt::op_name(op);
}

class CompositeGradCheck : public ::testing::TestWithParam<size_t> {};

TEST_P(CompositeGradCheck, MatchesFiniteDifferences) {
  const Sample& s = composite_samples()[GetParam()];
  SCOPED_TRACE(s.label);
  expect_passes(s, check_first_order(s));
}

INSTANTIATE_TEST_SUITE_P(Composites, CompositeGradCheck,
                         ::testing::Range<size_t>(0, composite_samples().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return test_name(composite_samples()[info.param].label);
                         });

// Second order: the vjp rules are graph code, so differentiating a gradient must work too.
std::vector<Sample> second_order_samples() {
  std::vector<Sample> c;
  auto add_s = [&c](std::string label, std::vector<Input> inputs, Builder build) {
    c.push_back(Sample{std::move(label), std::move(inputs), std::move(build)});
  };
  for (const auto& [op, samples] : op_samples()) {
    // Piecewise linear ops have no second derivative; a cast is linear; the steps' gradient is
    // zero everywhere.
    if (op == OpCode::Abs || op == OpCode::Relu || op == OpCode::Neg || op == OpCode::Cast ||
        op == OpCode::Floor || op == OpCode::Ceil || op == OpCode::Trunc || op == OpCode::Round)
      continue;
    if (mt::op_info(op).kind != mt::OpKind::Pointwise || mt::op_info(op).arity != 1) continue;
    c.push_back(samples.back());  // the [2,3] shape
  }
  add_s("mul", {{{2, 3}}, {{3}}}, [](const Tensors& x) { return x[0] * x[1]; });
  add_s("div", {{{2, 3}}, {{3}, Dist::AwayFromZero}}, [](const Tensors& x) { return x[0] / x[1]; });
  add_s("pow", {{{2, 3}, Dist::Positive}, {{2, 3}}},
        [](const Tensors& x) { return mt::pow(x[0], x[1]); });
  add_s("matmul_transposed", {{{4, 3}}, {{2, 4}}},
        [](const Tensors& x) { return mt::matmul(x[0], x[1], true, true); });
  add_s("softmax", {{{3, 4}}}, [](const Tensors& x) { return mt::softmax(x[0]); });
  add_s("log_softmax", {{{3, 4}}}, [](const Tensors& x) { return mt::log_softmax(x[0], 0); });
  add_s("layer_norm", {{{3, 4}}, {{4}}, {{4}}},
        [](const Tensors& x) { return mt::layer_norm(x[0], x[1], x[2]); });
  add_s("cross_entropy", {{{3, 4}}}, [](const Tensors& x) {
    return mt::cross_entropy(x[0], ids({3, 0, -100}, {3}), {.label_smoothing = 0.1});
  });
  add_s("sdpa_causal", {{{1, 3, 2}}, {{1, 3, 2}}, {{1, 3, 2}}},
        [](const Tensors& x) { return mt::scaled_dot_product_attention(x[0], x[1], x[2], true); });
  // Away from zeros: at a zero, cumprod's gradient is exact but its own derivative is not.
  add_s("cumprod", {{{2, 4}}}, [](const Tensors& x) { return mt::cumprod(x[0], 1); });
  add_s("logcumsumexp", {{{2, 3}}}, [](const Tensors& x) { return mt::logcumsumexp(x[0], 1); });
  add_s("sort_values", {{{2, 3}, Dist::Grid}},
        [](const Tensors& x) { return mt::square(mt::sort(x[0], 1).values); });
  add_s("custom_op", {{{2, 3}}, {{2, 3}}}, custom_mul_sin);
  return c;
}

TEST(SecondOrderGradCheck, HessianVectorProductsMatchFiniteDifferences) {
  std::vector<Sample> samples = second_order_samples();
  EXPECT_GE(samples.size(), 20u);
  for (const Sample& s : samples) {
    SCOPED_TRACE("second order: " + s.label);
    expect_passes(s, check_second_order(s, 1e-5));
  }
}

// ---------------------------------------------------------------------------------------------
// The harness itself, and gradient facts that finite differences cannot see.

TEST(GradCheckHarness, CatchesAWrongVjp) {
  Sample wrong{
      "custom op with a vjp off by a factor 2", {{{2, 3}}, {{2, 3}}}, [](const Tensors& x) {
        return mt::custom_op(
            {x[0], x[1]}, [](const Tensors& in) { return in[0] * in[1]; },
            [](const Tensors& in, const mt::Tensor&, const mt::Tensor& g) -> Tensors {
              return {g * in[1], g * in[0] * 2.0};
            });
      }};
  Report report = check_first_order(wrong);
  EXPECT_EQ(report.checked, 12);
  ASSERT_EQ(report.mismatches.size(), 6u);  // every element of the second input, none of the first
  for (const Mismatch& m : report.mismatches) {
    EXPECT_EQ(m.input, 1u);
    EXPECT_NEAR(m.analytic, 2 * m.numeric, 1e-6 * (1 + std::abs(m.numeric)));
  }
}

TEST(GradCheckHarness, DistributionsKeepAwayFromKinks) {
  mt::Generator gen(5);
  for (double v : draw(Dist::AwayFromZero, 200, gen)) EXPECT_GE(std::abs(v), 0.3);
  for (double v : draw(Dist::Positive, 200, gen)) EXPECT_GE(v, 0.5);
  std::vector<double> grid = draw(Dist::Grid, 50, gen), shifted = draw(Dist::GridShifted, 30, gen);
  for (size_t i = 0; i < grid.size(); ++i) {
    for (size_t j = 0; j < i; ++j) EXPECT_GT(std::abs(grid[i] - grid[j]), 0.2);
    for (double s : shifted) EXPECT_GT(std::abs(grid[i] - s), 0.08);
  }
  for (double v : draw(Dist::Dyadic, 100, gen)) EXPECT_EQ(v * 256, std::round(v * 256));
}

// Ties are not differentiable, so the convention (the gradient is shared evenly) is hand-worked.
TEST(GradFacts, MaxAndMaximumShareTiesEvenly) {
  mt::Tensor x = mt::tensor(std::vector<double>{1, 3, 3, 2, 5, 5, 5, 0}, {2, 4});
  x.requires_grad_();
  mt::Tensor g =
      mt::grad({mt::sum(mt::max(x, {1}) * mt::tensor(std::vector<double>{2, 3}, {2}))}, {x})[0];
  std::vector<double> expected = {0, 1, 1, 0, 1, 1, 1, 0};
  EXPECT_EQ(g.to_vector<double>(), expected);

  mt::Tensor a = mt::tensor(std::vector<double>{1, 2, 3}, {3});
  mt::Tensor b = mt::tensor(std::vector<double>{1, 5, 0}, {3});
  a.requires_grad_();
  b.requires_grad_();
  Tensors gs = mt::grad({mt::sum(mt::maximum(a, b))}, {a, b});
  EXPECT_EQ(gs[0].to_vector<double>(), (std::vector<double>{0.5, 0, 1}));
  EXPECT_EQ(gs[1].to_vector<double>(), (std::vector<double>{0.5, 1, 0}));
}

TEST(GradFacts, NonDifferentiableOpsActAsConstants) {
  std::vector<double> v = {-1.5, 0.5, 2.0, -0.25};
  mt::Tensor x = mt::tensor(v, {4});
  x.requires_grad_();
  // d/dx sum(x * stop(x)) = x; d/dx sum(x * sign(x)) = sign(x); comparisons gate, not flow.
  EXPECT_EQ(mt::grad({mt::sum(x * x.detach())}, {x})[0].to_vector<double>(), v);
  EXPECT_EQ(mt::grad({mt::sum(x * mt::sign(x))}, {x})[0].to_vector<double>(),
            (std::vector<double>{-1, 1, 1, -1}));
  EXPECT_EQ(mt::grad({mt::sum(x * mt::cast(x > 0.0, mt::f64))}, {x})[0].to_vector<double>(),
            (std::vector<double>{0, 1, 1, 0}));
  // An argmax-picked row routes the gradient only through the gather, not the index.
  mt::Tensor picked = mt::index_select(x, mt::argmax(x, 0, true), 0);
  EXPECT_EQ(mt::grad({mt::sum(picked * 3.0)}, {x})[0].to_vector<double>(),
            (std::vector<double>{0, 0, 3, 0}));
}

TEST(GradFacts, RandomLeavesAndConstantsStopGradients) {
  mt::Tensor x = mt::tensor(std::vector<double>{0.5, -1.0}, {2});
  x.requires_grad_();
  mt::Generator gen(3);
  mt::Tensor noise = mt::randn({2}, mt::f64, &gen);
  std::vector<double> n = noise.to_vector<double>();
  mt::Tensor g = mt::grad({mt::sum(x * noise + mt::full({2}, 4.0, mt::f64))}, {x})[0];
  EXPECT_EQ(g.to_vector<double>(), n);
}

}  // namespace
