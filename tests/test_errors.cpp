// tests/test_errors.cpp -- every public entry point fed bad input: the mt::Error must name the op,
// the offending shapes/dtypes/values, the caller's file:line for op calls and the module path.
//
// The cases are tables: one row per bad call. To cover a new function, add a row to the table of
// its header. OP_CASE rows are op calls whose message must also end in the caller's location.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <mixtape/mixtape.h>
#include "mixtape/dsl/log.h"
#include "tests/test_util.h"

namespace mt = mixtape;
namespace fs = std::filesystem;

namespace {

struct Case {
  std::string op;  // the message starts with this: the op, class or function that failed
  int line;        // where the row is written (for traces, and the expected call site)
  bool located;    // an op call: the message must end in "at test_errors.cpp:<line>]"
  std::function<void()> call;
  std::vector<std::string> fragments;  // must all appear in the message
};

// In a macro expansion both __LINE__ and std::source_location report the line where the macro is
// invoked, so rows may wrap and still compare exactly.
#define OP_CASE(op, statement, ...)                                           \
  Case {                                                                      \
    op, __LINE__, true, [=]() mutable { (void)(statement); }, { __VA_ARGS__ } \
  }
#define CASE(op, statement, ...)                                               \
  Case {                                                                       \
    op, __LINE__, false, [=]() mutable { (void)(statement); }, { __VA_ARGS__ } \
  }

std::string location_text(int line) { return "at test_errors.cpp:" + std::to_string(line) + "]"; }

void check_message(const Case& c, const std::string& message) {
  EXPECT_EQ(message.rfind(c.op, 0), 0u) << "should start with \"" << c.op << "\": " << message;
  for (const std::string& fragment : c.fragments)
    EXPECT_NE(message.find(fragment), std::string::npos)
        << "missing \"" << fragment << "\" in: " << message;
  if (c.located) {
    EXPECT_NE(message.find(location_text(c.line)), std::string::npos)
        << "missing the call site " << location_text(c.line) << " in: " << message;
  }
}

void run(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE("case at test_errors.cpp:" + std::to_string(c.line) + " (" + c.op + ")");
    try {
      c.call();
      ADD_FAILURE() << "no exception";
    } catch (const mt::Error& error) {
      check_message(c, error.what());
    } catch (const std::exception& error) {
      ADD_FAILURE() << "threw a non-mt::Error exception: " << error.what();
    }
  }
}

std::vector<int64_t> i64s(std::vector<int64_t> v) { return v; }

// ---- shared inputs ----
struct Inputs {
  mt::Tensor f = mt::randn({2, 3});                               // f32 [2, 3]
  mt::Tensor f4 = mt::randn({4});                                 // f32 [4]
  mt::Tensor s0 = mt::scalar(1.5);                                // f32 []
  mt::Tensor i = mt::tensor(i64s({1, 2, 3, 4, 5, 6}), {2, 3});    // i64 [2, 3]
  mt::Tensor b = mt::tensor(std::vector<bool>(6, true), {2, 3});  // bool [2, 3]
  mt::Tensor u;                                                   // undefined
  mt::Tensor idx = mt::tensor(i64s({0, 1}), {2});                 // i64 [2], valid rows of f
  mt::Tensor fidx = mt::tensor(std::vector<float>{0, 1}, {2});    // f32 [2], not an index
};

// ---- pointwise ops, generated from the op table so that a new op gets its rows for free ----
enum class Domain { Float, Numeric, Any };
using UnaryFn = std::function<mt::Tensor(const mt::Tensor&, const mt::Loc&)>;
using BinaryFn = std::function<mt::Tensor(const mt::Tensor&, const mt::Tensor&, const mt::Loc&)>;
struct Unary {
  std::string name;
  Domain domain;
  UnaryFn fn;
};
struct Binary {
  std::string name;
  Domain domain;
  bool compare;
  BinaryFn fn;
};

std::vector<Unary> unary_ops() {
  std::vector<Unary> ops;
#define MT_OP(Name, fname, kind, arity, category)
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  ops.push_back({#fname, Domain::domain,                  \
                 [](const mt::Tensor& x, const mt::Loc& loc) { return mt::fname(x, loc); }});
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1)
#define MT_COMPARE(Name, fname, REF)
#include "mixtape/dsl/ops.def"
  return ops;
}

std::vector<Binary> binary_ops() {
  std::vector<Binary> ops;
#define MT_OP(Name, fname, kind, arity, category)
#define MT_UNARY(Name, fname, category, domain, REF, VJP)
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1)                   \
  ops.push_back({#fname, Domain::domain, false,                                     \
                 [](const mt::Tensor& a, const mt::Tensor& b, const mt::Loc& loc) { \
                   return mt::fname(a, b, loc);                                     \
                 }});
#define MT_COMPARE(Name, fname, REF)                                                \
  ops.push_back({#fname, Domain::Any, true,                                         \
                 [](const mt::Tensor& a, const mt::Tensor& b, const mt::Loc& loc) { \
                   return mt::fname(a, b, loc);                                     \
                 }});
#include "mixtape/dsl/ops.def"
  return ops;
}

std::vector<Case> generated_pointwise_cases() {
  Inputs in;
  std::vector<Case> cases;
  // The op receives this location explicitly and must report it.
  const mt::Loc here = mt::Loc::current();
  const int line = static_cast<int>(here.line());
  auto add = [&](const std::string& op, std::function<void()> call,
                 std::vector<std::string> fragments) {
    cases.push_back({op, line, true, std::move(call), std::move(fragments)});
  };
  for (const Unary& op : unary_ops()) {
    UnaryFn fn = op.fn;
    add(op.name, [=] { fn(in.u, here); }, {"input is an undefined tensor"});
    if (op.domain == Domain::Float) {
      add(op.name, [=] { fn(in.i, here); }, {"floating-point", "got i64"});
      add(op.name, [=] { fn(in.b, here); }, {"floating-point", "got bool"});
    }
    if (op.domain == Domain::Numeric) add(op.name, [=] { fn(in.b, here); }, {"bool"});
  }
  for (const Binary& op : binary_ops()) {
    BinaryFn fn = op.fn;
    add(op.name, [=] { fn(in.u, in.f, here); }, {"first operand is an undefined tensor"});
    add(op.name, [=] { fn(in.f, in.u, here); }, {"second operand is an undefined tensor"});
    add(op.name, [=] { fn(in.f, in.f4, here); },
        {"cannot be broadcast", "[2, 3] (f32) and [4] (f32)"});
    if (op.domain == Domain::Float)
      add(op.name, [=] { fn(in.i, in.i, here); }, {"floating-point", "got i64"});
    if (op.domain == Domain::Numeric) add(op.name, [=] { fn(in.b, in.b, here); }, {"bool"});
  }
  // The fused update arithmetic: an undefined last input, integers, shapes that do not broadcast.
  auto all_but_last = [](const mt::Tensor& all, const mt::Tensor& last, auto operands) {
    operands.fill(all);
    operands.back() = last;
    return operands;
  };
#define MT_OP(Name, fname, kind, arity, category)
#define MT_FUSED(Name, fname, arity, REF)                                                          \
  add(#fname, [=] { mt::fname(all_but_last(in.f, in.u, std::array<mt::Tensor, arity>()), here); }, \
      {fmt::format("input {} is an undefined tensor", (arity)-1)});                                \
  add(#fname, [=] { mt::fname(all_but_last(in.i, in.i, std::array<mt::Tensor, arity>()), here); }, \
      {"floating-point", "got i64"});                                                              \
  add(#fname,                                                                                      \
      [=] { mt::fname(all_but_last(in.f, in.f4, std::array<mt::Tensor, arity>()), here); },        \
      {"cannot be broadcast", "[2, 3]", "[4]"});                                                   \
  EXPECT_NO_THROW(mt::fname(all_but_last(in.f, in.f, std::array<mt::Tensor, arity>()), here));
#include "mixtape/dsl/ops.def"
  return cases;
}

TEST(Errors, GeneratedPointwiseOps) {
  run(generated_pointwise_cases());
  // The same ops accept good input, so the rows above test the checks and not a broken op.
  Inputs in;
  for (const Unary& op : unary_ops()) {
    SCOPED_TRACE(op.name);
    EXPECT_NO_THROW(op.fn(op.domain == Domain::Float ? in.f : in.i, mt::Loc::current()).numel());
  }
  for (const Binary& op : binary_ops()) {
    SCOPED_TRACE(op.name);
    EXPECT_NO_THROW(op.fn(in.f, mt::randn({3}), mt::Loc::current()));
  }
}

// ---- dsl/tensor.h ----
std::vector<Case> tensor_cases() {
  Inputs in;
  mt::Tensor f = in.f, i = in.i, u = in.u, f4 = in.f4;
  mt::Tensor product = f * 2.0;
  mt::Tensor leaf = mt::zeros({2, 3});
  leaf.requires_grad_();
  mt::Tensor wide_loss = leaf * 3.0;
  auto null_storage = std::shared_ptr<mt::Storage>();
  auto four = std::make_shared<mt::Storage>(mt::f32, 4);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  return {
      CASE("item", f.item(), "6 elements", "[2, 3]"),
      CASE("size", f.size(2), "axis 2", "[2, 3]"),
      CASE("size", f.size(-3), "axis -3", "[2, 3]"),
      CASE("use of an undefined tensor", u.shape()),
      CASE("use of an undefined tensor", u.dtype()),
      CASE("use of an undefined tensor", u.item()),
      CASE("use of an undefined tensor", u.to_vector<float>()),
      CASE("use of an undefined tensor", u.grad()),
      CASE("use of an undefined tensor", u.requires_grad_()),
      CASE("requires_grad_", product.requires_grad_(), "leaf", "mul"),
      CASE("requires_grad_", i.requires_grad_(), "floating-point", "i64"),
      CASE("set_grad", leaf.set_grad(f4), "[4]", "[2, 3]"),
      OP_CASE("backward", f.sum().backward(), "does not require grad"),
      OP_CASE("backward", wide_loss.backward(), "single-element", "[2, 3]"),
      OP_CASE("backward", wide_loss.backward(f4), "gradient shape [4]", "output shape [2, 3]"),
      OP_CASE("backward", u.backward(), "undefined"),
      OP_CASE("detach", u.detach(), "undefined"),
      OP_CASE("assign", leaf.assign(f4), "[4] f32", "[2, 3] f32"),
      OP_CASE("assign", leaf.assign(i), "[2, 3] i64", "[2, 3] f32"),
      OP_CASE("assign", leaf.assign(u), "undefined"),
      OP_CASE("cast", u.to(mt::f16), "undefined"),
      OP_CASE("reshape", f.reshape({4, 2}), "[2, 3] (6 elements)", "[4, 2] (8 elements)"),
      OP_CASE("transpose", f4.transpose(), "at least 2 dimensions", "[4]"),
      OP_CASE("sum", f.sum({2}), "axis 2", "rank 2"),
      OP_CASE("mean", i.mean(), "floating-point", "i64"),
      CASE("eval", mt::eval({f, u}), "tensor 1", "undefined"),
      OP_CASE("tensor", mt::tensor(std::vector<float>(5), {2, 3}), "5 values", "[2, 3]"),
      OP_CASE("tensor", mt::tensor(std::vector<int64_t>{}, {-1, 0}), "negative", "[-1, 0]"),
      OP_CASE("tensor", mt::tensor(std::vector<bool>(2), {3}), "2 values", "[3]"),
      OP_CASE("from_storage", mt::from_storage(null_storage, {4}), "null"),
      OP_CASE("from_storage", mt::from_storage(four, {2, 3}), "4 f32 elements", "[2, 3]"),
      OP_CASE("full", mt::full({2, -3}, 1.0), "negative", "[2, -3]"),
      OP_CASE("zeros", mt::zeros({-1}), "negative", "[-1]"),
      // A fill an integer type cannot hold, as PyTorch's full refuses it (it wrapped).
      OP_CASE("full", mt::full({2}, 9223372036854775807.0, mt::i64), "9.223372036854776e+18",
              "cannot be converted to i64 without overflow"),
      OP_CASE("full", mt::full({2}, 1e30, mt::i32), "1e+30", "to i32"),
      OP_CASE("full", mt::full({2}, nan, mt::i64), "nan", "without overflow"),
      OP_CASE("scalar", mt::scalar(-3e9, mt::i32), "-3000000000", "to i32"),
      OP_CASE("ones", mt::ones({3, -2}, mt::i32), "negative", "[3, -2]"),
      OP_CASE("zeros_like", mt::zeros_like(u), "undefined"),
      OP_CASE("ones_like", mt::ones_like(u), "undefined"),
      OP_CASE("full_like", mt::full_like(u, 2.0), "undefined"),
      OP_CASE("arange", mt::arange(0.0, 5.0, 0.0), "non-zero step", "0"),
      OP_CASE("arange", mt::arange(nan, 5.0), "finite", "nan"),
      OP_CASE("arange", mt::arange(int64_t{-3}), "non-negative", "-3"),
      OP_CASE("rand", mt::rand({2}, mt::i32), "floating", "i32"),
      OP_CASE("rand", mt::rand({2}, mt::f32, nullptr, 1.0, 0.5), "low <= high", "[1, 0.5)"),
      // As PyTorch's uniform_: no range wider than the dtype's largest value, no infinity.
      OP_CASE("rand", mt::rand({2}, mt::f16, nullptr, -6e4, 6e4), "does not fit f16", "65504"),
      OP_CASE("rand", mt::rand({2}, mt::f32, nullptr, 0, INFINITY), "[0, inf)", "does not fit"),
      OP_CASE("rand", mt::rand({-2}), "negative", "[-2]"),
      OP_CASE("randn", mt::randn({2}, mt::boolean), "floating", "bool"),
      OP_CASE("randn", mt::randn({2}, mt::f32, nullptr, 0.0, -1.0), "stddev", "-1"),
  };
}

TEST(Errors, Tensor) { run(tensor_cases()); }

// ---- dsl/ops.h ----
std::vector<Case> ops_cases() {
  Inputs in;
  mt::Tensor f = in.f, f4 = in.f4, s0 = in.s0, i = in.i, b = in.b, u = in.u, idx = in.idx,
             fidx = in.fidx;
  mt::Tensor empty = mt::zeros({0, 3});
  mt::Tensor a223 = mt::randn({2, 2, 3}), a332 = mt::randn({3, 3, 2});
  mt::Tensor img = mt::zeros({1, 3, 4, 4}), ker = mt::zeros({2, 3, 3, 3});
  mt::ConvWindow pad_neg, groups2;
  pad_neg.pad[1] = -1;
  mt::PoolWindow pool2;
  pool2.kernel[0] = pool2.kernel[1] = 2;
  groups2.groups = 2;
  mt::Tensor q234 = mt::zeros({2, 3, 4}), k254 = mt::zeros({2, 5, 4}), v253 = mt::zeros({2, 5, 3});
  mt::Tensor o233 = mt::zeros({2, 3, 3}), none;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  mt::Tensor bad_rows = mt::tensor(i64s({0, 5}), {2});
  mt::Tensor negative_rows = mt::tensor(i64s({-1}), {1});
  mt::Tensor col_index = mt::tensor(i64s({0, 3}), {2, 1});
  mt::Tensor f_col_index = mt::tensor(std::vector<float>{0, 1}, {2, 1});
  auto identity = [](const std::vector<mt::Tensor>& xs) { return xs[0]; };
  auto no_tensor = [](const std::vector<mt::Tensor>&) { return mt::Tensor(); };
  auto pass = [](const std::vector<mt::Tensor>&, const mt::Tensor&, const mt::Tensor& g) {
    return std::vector<mt::Tensor>{g};
  };
  std::function<mt::Tensor(const std::vector<mt::Tensor>&)> no_forward;
  return {
      // operators report the line of the expression
      OP_CASE("add", f + f4, "cannot be broadcast", "[2, 3] (f32) and [4] (f32)"),
      OP_CASE("mul", f * u, "second operand", "undefined"),
      OP_CASE("sub", u - 1.0, "first operand", "undefined"),
      OP_CASE("div", 2.0 / u, "second operand", "undefined"),
      OP_CASE("div", i / i, "floating-point", "i64"),
      OP_CASE("add", b + b, "bool"),
      OP_CASE("lt", f < f4, "cannot be broadcast", "[2, 3]", "[4]"),
      OP_CASE("ge", u >= 0.0, "undefined"),
      OP_CASE("neg", -u, "undefined"),
      OP_CASE("neg", -b, "bool"),
      OP_CASE("pow", mt::pow(u, 2.0), "undefined"),
      OP_CASE("where", mt::where(f, f, f), "condition must be bool", "f32"),
      OP_CASE("where", mt::where(b, f, f4), "cannot be broadcast", "[2, 3]", "[4]"),
      OP_CASE("where", mt::where(mt::tensor(std::vector<bool>(4), {4}), f, f),
              "cannot be broadcast", "[4]", "[2, 3]"),
      OP_CASE("where", mt::where(u, f, f), "condition", "undefined"),
      OP_CASE("cast", mt::cast(u, mt::f32), "undefined"),
      OP_CASE("cast_like", mt::cast_like(u, f), "undefined"),
      OP_CASE("cast_like", mt::cast_like(f, u), "like", "undefined"),
      OP_CASE("cast_like", mt::cast_like(f, f4), "[2, 3]", "[4]", "one shape"),
      OP_CASE("sum", mt::sum(f, {2}), "axis 2", "rank 2"),
      OP_CASE("sum", mt::sum(f, {0, -2}), "[0, -2]", "repeats"),
      OP_CASE("sum", mt::sum(u), "undefined"),
      OP_CASE("mean", mt::mean(i), "floating-point", "i64"),
      OP_CASE("mean", mt::mean(f, {3}), "axis 3"),
      OP_CASE("max", mt::max(b), "bool"),
      OP_CASE("max", mt::max(empty, {0}), "empty axis 0"),
      OP_CASE("max", mt::max(f, {-3}), "axis -3"),
      OP_CASE("min", mt::min(b), "bool"),
      OP_CASE("min", mt::min(f, {5}), "axis 5"),
      OP_CASE("min", mt::min(empty, {0}), "empty axis 0"),
      OP_CASE("argmax", mt::argmax(b), "bool"),
      OP_CASE("argmax", mt::argmax(f, 2), "axis 2"),
      OP_CASE("argmax", mt::argmax(mt::zeros({0})), "empty axis"),
      OP_CASE("var", mt::var(i), "floating-point", "i64"),
      OP_CASE("var", mt::var(f, {4}), "axis 4"),
      OP_CASE("matmul", mt::matmul(s0, f), "at least one dimension", "[] (f32)", "[2, 3] (f32)"),
      OP_CASE("matmul", mt::matmul(f, f), "inner dimensions differ (3 vs 2)", "[2, 3] (f32)"),
      OP_CASE("matmul", mt::matmul(f, f, true, true), "inner dimensions differ (2 vs 3)",
              "first transposed", "second transposed"),
      OP_CASE("matmul", mt::matmul(a223, a332), "batch dimensions", "[2, 2, 3]", "[3, 3, 2]"),
      OP_CASE("matmul", mt::matmul(i, mt::transpose(i)), "floating-point", "i64"),
      OP_CASE("matmul", mt::matmul(f4, f4, true), "1-d"),
      OP_CASE("matmul", mt::matmul(f, u), "second operand", "undefined"),
      OP_CASE("conv2d_forward", mt::conv2d_forward(img, ker, pad_neg),
              "padding must not be negative"),
      OP_CASE("conv2d_forward", mt::conv2d_forward(img, mt::zeros({2, 3, 5, 5}), mt::ConvWindow{}),
              "larger than the padded input", "[1, 3, 4, 4]"),
      OP_CASE("conv2d_input_grad", mt::conv2d_input_grad(img, ker, {1, 3, 4, 4}, mt::ConvWindow{}),
              "the output gradient is [1, 3, 4, 4]", "[1, 2, 2, 2]"),
      OP_CASE("conv2d_weight_grad", mt::conv2d_weight_grad(img, img, {2, 3, 3, 3}, groups2),
              "groups 2 must divide", "3"),
      OP_CASE("conv2d", mt::conv2d(img, ker, {}, {.groups = 3}), "groups 3 must divide",
              "output's 2"),
      OP_CASE("conv2d", mt::conv2d(f, ker), "[N, C, H, W]"),
      OP_CASE("conv1d", mt::conv1d(img, ker), "[N, C, L]", "[1, 3, 4, 4]"),
      OP_CASE("conv_transpose2d",
              mt::conv_transpose2d(img, mt::zeros({3, 2, 3, 3}), {}, {.output_padding = 1}),
              "output_padding (1, 1)", "smaller than the stride (1, 1)"),
      OP_CASE("max_pool2d_forward", mt::max_pool2d_forward(img, pool2, {5, 3}),
              "output height of 5", "[1, 3, 4, 4] (3 or 3)"),
      OP_CASE("max_pool2d_forward", mt::max_pool2d_forward(f, pool2, {1, 2}), "NCHW", "[2, 3]"),
      OP_CASE("max_pool2d_grad", mt::max_pool2d_grad(img, mt::zeros({1, 2, 3, 3}), pool2),
              "[1, 2, 3, 3]", "differ in N or C"),
      OP_CASE("attention_forward", mt::attention_forward(f4, f4, f4, none, false, 1.0), "rank >= 2",
              "f32 [4]"),
      OP_CASE("attention_forward", mt::attention_forward(q234, v253, v253, none, false, 1.0),
              "do not fit", "q [2, 3, 4] k [2, 5, 3]"),
      OP_CASE("attention_forward", mt::attention_forward(q234, k254, v253, none, true, 1.0),
              "causal", "q [2, 3, 4] k [2, 5, 4]"),
      OP_CASE(
          "attention_forward",
          mt::attention_forward(q234, k254, v253, mt::zeros({2, 3, 4}, mt::boolean), false, 1.0),
          "the mask [2, 3, 4]", "[2, 3, 5]"),
      OP_CASE("attention_forward",
              mt::attention_forward(q234, k254, v253, mt::zeros({1, 1, 5}, mt::i64), false, 1.0),
              "bool or floating", "i64"),
      OP_CASE("attention_forward", mt::attention_forward(q234, k254, v253, none, false, nan),
              "scale", "not finite"),
      OP_CASE("attention_backward",
              mt::attention_backward(q234, k254, v253, o233, q234, none, false, 1.0), "[2, 3, 3]",
              "f32 [2, 3, 4]"),
      OP_CASE("attention_backward",
              mt::attention_backward(q234, k254, v253, o233, none, none, false, 1.0), "undefined"),
      OP_CASE("reshape", mt::reshape(f, {4, 2}), "[2, 3] (6 elements)", "[4, 2] (8 elements)"),
      OP_CASE("reshape", mt::reshape(f, {-1, -1}), "only one dimension may be -1"),
      OP_CASE("reshape", mt::reshape(f, {-2, 3}), "invalid dimension -2"),
      OP_CASE("reshape", mt::reshape(f, {-1, 4}), "[2, 3]", "[-1, 4]"),
      OP_CASE("reshape", mt::reshape(u, {1}), "undefined"),
      OP_CASE("permute", mt::permute(f, {0}), "[0]", "rank 2", "[2, 3]"),
      OP_CASE("permute", mt::permute(f, {1, 1}), "[1, 1] is not a permutation"),
      OP_CASE("permute", mt::permute(f, {0, 2}), "axis 2"),
      OP_CASE("transpose", mt::transpose(f4), "at least 2 dimensions", "[4]"),
      OP_CASE("transpose", mt::transpose(f, 0, 2), "axis 2"),
      OP_CASE("broadcast_to", mt::broadcast_to(f, {3, 3}), "[2, 3] to [3, 3]"),
      OP_CASE("broadcast_to", mt::broadcast_to(f, {3}), "[2, 3] to [3]"),
      OP_CASE("broadcast_to", mt::broadcast_to(f4, {-1, 4}), "[4] to [-1, 4]"),
      OP_CASE("unsqueeze", mt::unsqueeze(f, 3), "axis 3", "rank 3"),
      OP_CASE("squeeze", mt::squeeze(f, 0), "axis 0", "[2, 3]", "size 2"),
      OP_CASE("squeeze", mt::squeeze(f, 2), "axis 2"),
      OP_CASE("flatten", mt::flatten(f, 1, 0), "start axis 1", "end axis 0"),
      OP_CASE("flatten", mt::flatten(f, 0, 5), "axis 5"),
      OP_CASE("slice", mt::slice(f, 2, 0, 1), "axis 2"),
      OP_CASE("slice", mt::slice(f, 1, 0, 3, 0), "step must be positive", "0"),
      // (explicit vectors: braced single values would pick the axis/start/stop overload)
      OP_CASE("slice", mt::slice(f, i64s({0}), i64s({1}), mt::Shape{1}), "one entry per axis",
              "[2, 3]"),
      OP_CASE("slice", mt::slice(f, i64s({0, 2}), i64s({1, 1}), mt::Shape{2, 2}), "size 2 from 2",
              "axis 1", "[2, 3]"),
      OP_CASE("slice", mt::slice(f, i64s({0, 0}), i64s({1, -1}), mt::Shape{2, 1}), "step -1",
              "axis 1"),
      OP_CASE("unslice", mt::unslice(f, i64s({0, 0}), i64s({1, 1}), mt::Shape{1, 3}), "size 2",
              "axis 0", "[1, 3]"),
      OP_CASE("concat", mt::concat({}), "at least one tensor"),
      OP_CASE("concat", mt::concat({s0, s0}), "0-d"),
      OP_CASE("concat", mt::concat({f, f4}), "[2, 3] and [4]"),
      OP_CASE("concat", mt::concat({f, mt::zeros({2, 4})}, 0), "[2, 3] and [2, 4]", "axis 0"),
      OP_CASE("concat", mt::concat({f, f}, 2), "axis 2"),
      OP_CASE("concat", mt::concat({f, u}), "undefined"),
      OP_CASE("stack", mt::stack({}), "at least one tensor"),
      OP_CASE("stack", mt::stack({f, f4}), "[2, 3] vs [4]"),
      OP_CASE("stack", mt::stack({f, f}, 4), "axis 4", "rank 3"),
      OP_CASE("index_select", mt::index_select(f, fidx), "integer", "f32"),
      OP_CASE("index_select", mt::index_select(s0, idx), "0-d"),
      OP_CASE("index_select", mt::index_select(f, idx, 2), "axis 2"),
      OP_CASE("index_select", mt::index_select(f, u), "index", "undefined"),
      OP_CASE("index_add", mt::index_add(f, idx, f4), "[4]", "[2, 3]", "index [2]"),
      OP_CASE("index_add", mt::index_add(f, fidx, f), "integer", "f32"),
      OP_CASE("index_add", mt::index_add(f, idx, u), "source", "undefined"),
      OP_CASE("gather", mt::gather(f, idx, 1), "[2]", "rank", "[2, 3]"),
      OP_CASE("gather", mt::gather(f, f_col_index, 1), "integer", "f32"),
      OP_CASE("gather", mt::gather(f, mt::zeros({3, 1}, mt::i64), 1), "[3, 1]", "[2, 3]"),
      OP_CASE("gather", mt::gather(f, col_index, 2), "axis 2"),
      OP_CASE("scatter_add", mt::scatter_add(f, col_index, mt::zeros({2, 2}), 1),
              "source shape [2, 2]", "index shape [2, 1]"),
      OP_CASE("scatter_add", mt::scatter_add(f, idx, f4, 0), "[2]", "rank", "[2, 3]"),
      OP_CASE("scatter_add", mt::scatter_add(f, f_col_index, f_col_index, 1), "integer"),
      OP_CASE("embedding", mt::embedding(f4, idx), "[num, dim]", "[4]"),
      OP_CASE("embedding", mt::embedding(f, fidx), "integer", "f32"),
      OP_CASE("embedding", mt::embedding(u, idx), "weight", "undefined"),
      OP_CASE("embedding", mt::embedding(f, u), "undefined"),
      OP_CASE("one_hot", mt::one_hot(fidx, 3), "integer", "f32"),
      OP_CASE("one_hot", mt::one_hot(idx, 0), "num_classes", "0"),
      OP_CASE("one_hot", mt::one_hot(u, 3), "undefined"),
      OP_CASE("custom_op", mt::custom_op({f}, no_forward, pass), "forward and a vjp"),
      OP_CASE("custom_op", mt::custom_op({f}, identity, nullptr), "forward and a vjp"),
      OP_CASE("custom_op", mt::custom_op({f}, no_tensor, pass), "undefined"),
      OP_CASE("custom_op", mt::custom_op({u}, identity, pass), "undefined"),
      // Indices are data, so a bad one shows up at evaluation; it still names the op and the
      // line that made the node.
      OP_CASE("index_select", mt::index_select(f, bad_rows).to_vector<float>(),
              "index 5 is out of range", "axis 0 of size 2"),
      OP_CASE("index_select", mt::index_select(f, negative_rows, 1).to_vector<float>(), "index -1",
              "axis 1 of size 3"),
      OP_CASE("index_add", mt::index_add(f, bad_rows, f).to_vector<float>(), "index 5", "size 2"),
      OP_CASE("gather", mt::gather(f, col_index, 1).to_vector<float>(), "index 3",
              "axis 1 of size 3"),
      OP_CASE("scatter_add", mt::scatter_add(f, col_index, mt::ones({2, 1}), 1).to_vector<float>(),
              "index 3", "axis 1 of size 3"),
      OP_CASE("index_select", mt::embedding(f, bad_rows).to_vector<float>(), "index 5", "size 2"),
  };
}

TEST(Errors, Ops) { run(ops_cases()); }

TEST(Errors, FailedEvaluationCanBeRetriedAndLeavesOtherValuesIntact) {
  mt::Tensor table = mt::tensor(std::vector<float>{1, 2, 3, 4}, {2, 2});
  mt::Tensor good = mt::exp(table);
  mt::Tensor bad = mt::index_select(good, mt::tensor(i64s({2}), {1})) + 1.0;
  for (int attempt = 0; attempt < 2; ++attempt)
    EXPECT_THROW(bad.to_vector<float>(), mt::Error) << "attempt " << attempt;
  EXPECT_FLOAT_EQ(good.to_vector<float>()[3], std::exp(4.0f));
  EXPECT_EQ(mt::index_select(good, mt::tensor(i64s({1}), {1})).to_vector<float>()[0],
            good.to_vector<float>()[2]);
}

// ---- scans and argsort (dsl/ops.h), dsl/selection.h ----
std::vector<Case> selection_cases() {
  Inputs in;
  mt::Tensor f = in.f, f4 = in.f4, i = in.i, b = in.b, u = in.u, idx = in.idx, fidx = in.fidx;
  mt::Tensor col_index = mt::tensor(i64s({0, 3}), {2, 1});
  mt::Tensor col_ok = mt::tensor(i64s({0, 2}), {2, 1});
  mt::Tensor cube = mt::randn({2, 2, 2});
  return {
      OP_CASE("cumsum", mt::cumsum(f, 2), "axis 2", "rank 2"),
      OP_CASE("cumsum", mt::cumsum(u, 0), "undefined"),
      OP_CASE("cumprod", mt::cumprod(f, -3), "axis -3", "rank 2"),
      OP_CASE("logcumsumexp", mt::logcumsumexp(i, 0), "floating-point", "i64"),
      OP_CASE("logcumsumexp", mt::logcumsumexp(f, 5), "axis 5"),
      OP_CASE("argsort", mt::argsort(f, 2), "axis 2", "rank 2"),
      OP_CASE("argsort", mt::argsort(u), "undefined"),
      OP_CASE("check", mt::check(u, b, mt::CheckKind::Probabilities), "undefined"),
      OP_CASE("check", mt::check(b, u, mt::CheckKind::Probabilities), "condition", "undefined"),
      OP_CASE("check", mt::check(b, b * 1.0, mt::CheckKind::Probabilities), "must be bool"),
      OP_CASE("check",
              mt::check(b, mt::zeros({1}, mt::boolean), mt::CheckKind::Probabilities)
                  .to_vector<float>(),
              "every probability must be in [0, 1]"),
      OP_CASE("all_reduce", mt::all_reduce(u), "undefined"),
      OP_CASE("all_reduce", mt::all_reduce(b), "bool"),
      OP_CASE("reduce_scatter", mt::reduce_scatter(mt::flatten(b)), "bool"),
      OP_CASE("reduce_scatter", mt::reduce_scatter(f), "1-D", "[2, 3]"),
      OP_CASE("reduce_scatter", mt::reduce_scatter(u), "undefined"),
      OP_CASE("all_gather", mt::all_gather(f), "1-D", "[2, 3]"),
      OP_CASE("all_gather", mt::all_gather(u), "undefined"),
      OP_CASE("scatter", mt::scatter(f, 1, fidx, f), "integer", "f32"),
      OP_CASE("scatter", mt::scatter(f, 2, col_ok, f), "axis 2"),
      OP_CASE("scatter", mt::scatter(f, 1, idx, f4), "[2]", "rank", "[2, 3]"),
      OP_CASE("scatter", mt::scatter(f, 1, col_ok, mt::ones({1, 1})), "source shape [1, 1]",
              "index shape [2, 1]"),
      OP_CASE("scatter", mt::scatter(f, 1, col_ok, u), "source", "undefined"),
      OP_CASE("scatter", mt::scatter(f, 1, col_index, 1.0).to_vector<float>(), "index 3",
              "axis 1 of size 3"),
      OP_CASE("prod", mt::prod(f, 2), "dim 2", "[2, 3]"),
      OP_CASE("prod", mt::prod(u), "undefined"),
      OP_CASE("sort", mt::sort(f, -3).values, "dim -3", "[2, 3]"),
      OP_CASE("topk", mt::topk(f, 4).values, "k 4", "size 3", "[2, 3]"),
      OP_CASE("topk", mt::topk(f, 3, 0).values, "k 3", "size 2", "dim 0"),
      OP_CASE("topk", mt::topk(f, -1).values, "k -1"),
      OP_CASE("topk", mt::topk(f, 1, 2).values, "dim 2", "[2, 3]"),
      OP_CASE("take_along_dim", mt::take_along_dim(f, idx, 1), "same number of dims", "[2, 3]",
              "[2]"),
      OP_CASE("take_along_dim", mt::take_along_dim(f, fidx), "integer", "f32"),
      OP_CASE("take_along_dim", mt::take_along_dim(f, mt::zeros({3, 2}, mt::i64), 1),
              "cannot be broadcast", "[2, 3]", "[3, 2]"),
      OP_CASE("take_along_dim", mt::take_along_dim(f, col_ok, 2), "dim 2"),
      OP_CASE("masked_select", mt::masked_select(f, f), "bool", "f32"),
      OP_CASE("masked_select", mt::masked_select(f, mt::ones({4}, mt::boolean)),
              "cannot be broadcast", "[2, 3]", "[4]"),
      OP_CASE("masked_select", mt::masked_select(f, u), "mask", "undefined"),
      OP_CASE("nonzero", mt::nonzero(u), "undefined"),
      OP_CASE("multinomial", mt::multinomial(f4, 5), "5 samples", "4 categories", "[4]"),
      OP_CASE("multinomial", mt::multinomial(i, 1), "floating-point", "i64"),
      OP_CASE("multinomial", mt::multinomial(f4, 0, true), "num_samples", "0"),
      OP_CASE("multinomial", mt::multinomial(cube, 1), "1-d or 2-d", "[2, 2, 2]"),
      OP_CASE("multinomial", mt::multinomial(mt::zeros({2, 0}), 1), "at least one category"),
      OP_CASE("randperm", mt::randperm(-1), "non-negative", "-1"),
      // Values only the graph knows are checked where they are made, as PyTorch checks them.
      OP_CASE("multinomial", mt::multinomial(mt::full({2}, -1.0), 1).to_vector<int64_t>(),
              "every weight must be finite and >= 0"),
      OP_CASE("bernoulli", mt::bernoulli(mt::full({2}, 1.5)).to_vector<float>(),
              "every probability must be in [0, 1]"),
      OP_CASE(
          "binary_cross_entropy",
          mt::binary_cross_entropy(mt::full({2}, -0.5), mt::ones({2}), mt::Reduction::Mean).item(),
          "every probability must be in [0, 1]"),
      OP_CASE("randperm", mt::randperm(3, nullptr, mt::f32), "integer type", "f32"),
      OP_CASE("argsort", mt::argsort(b, 3), "axis 3"),
  };
}

TEST(Errors, Selection) { run(selection_cases()); }

// ---- dsl/functional.h ----
std::vector<Case> functional_cases() {
  Inputs in;
  mt::Tensor f = in.f, f4 = in.f4, s0 = in.s0, i = in.i, u = in.u, idx = in.idx, fidx = in.fidx;
  mt::Tensor w3 = mt::ones({3}), w4 = mt::ones({4});
  mt::Tensor w53 = mt::randn({5, 3}), w54 = mt::randn({5, 4});
  mt::Tensor targets3 = mt::tensor(i64s({0, 1, 2}), {3});
  mt::Tensor bad_targets = mt::tensor(i64s({0, 7}), {2});
  mt::Tensor q24 = mt::randn({2, 4}), k25 = mt::randn({2, 5}), k34 = mt::randn({3, 4});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  return {
      OP_CASE("softmax", mt::softmax(i), "floating-point", "i64"),
      OP_CASE("softmax", mt::softmax(f, 2), "axis 2", "[2, 3]"),
      OP_CASE("softmax", mt::softmax(u), "undefined"),
      OP_CASE("log_softmax", mt::log_softmax(i), "floating-point", "i64"),
      OP_CASE("log_softmax", mt::log_softmax(f, -3), "axis -3", "[2, 3]"),
      OP_CASE("logsumexp", mt::logsumexp(i), "floating-point", "i64"),
      OP_CASE("logsumexp", mt::logsumexp(f, {0, 3}), "axis 3", "[2, 3]"),
      OP_CASE("layer_norm", mt::layer_norm(i, w3, w3), "floating-point", "i64"),
      OP_CASE("layer_norm", mt::layer_norm(f, w4, w3), "[4] should be [3]"),
      OP_CASE("layer_norm", mt::layer_norm(f, w3, w4), "[4] should be [3]"),
      OP_CASE("layer_norm", mt::layer_norm(f, w3, w3, 1e-5, 3), "last 3 axes", "[2, 3]"),
      OP_CASE("layer_norm", mt::layer_norm(f, w3, w3, 1e-5, 0), "last 0 axes"),
      OP_CASE("layer_norm", mt::layer_norm(u, w3, w3), "undefined"),
      OP_CASE("rms_norm", mt::rms_norm(i, w3), "floating-point", "i64"),
      OP_CASE("rms_norm", mt::rms_norm(s0, u), "at least one axis"),
      OP_CASE("rms_norm", mt::rms_norm(f, w4), "[4] should be [3]"),
      OP_CASE("linear", mt::linear(f, f4), "[out, in]", "[4]"),
      OP_CASE("linear", mt::linear(f, w54), "input [2, 3]", "in-features 4", "[5, 4]"),
      OP_CASE("linear", mt::linear(f, w53, f4), "bias shape [4] should be [5]"),
      OP_CASE("linear", mt::linear(s0, w53), "input []"),
      OP_CASE("linear", mt::linear(u, w53), "input", "undefined"),
      OP_CASE("linear", mt::linear(f, u), "weight", "undefined"),
      OP_CASE("cross_entropy", mt::cross_entropy(i, idx), "logits", "floating-point", "i64"),
      OP_CASE("cross_entropy", mt::cross_entropy(f, fidx), "integer", "f32"),
      OP_CASE("cross_entropy", mt::cross_entropy(f, targets3), "[2, 3]", "[2]", "got [3]"),
      OP_CASE("cross_entropy", mt::cross_entropy(s0, targets3), "[]"),
      OP_CASE("cross_entropy", mt::cross_entropy(f, idx, {.label_smoothing = 1.5}),
              "label_smoothing", "1.5"),
      OP_CASE("cross_entropy", mt::cross_entropy(f, u), "targets", "undefined"),
      OP_CASE("cross_entropy",
              mt::cross_entropy(f, idx, {.weight = mt::ones({3}).requires_grad_()}),
              "class weight takes no gradient"),
      // A class id beyond the logits is caught where the loss picks it, at evaluation.
      OP_CASE("cross_entropy", mt::cross_entropy(f, bad_targets).item(), "index 7", "size 3",
              "in its index_select"),
      OP_CASE("mse_loss", mt::mse_loss(f, f4), "[2, 3]", "[4]"),
      OP_CASE("mse_loss", mt::mse_loss(i, i), "floating-point", "i64"),
      OP_CASE("mse_loss", mt::mse_loss(f, u), "target", "undefined"),
      OP_CASE("dropout", mt::dropout(f, 1.5), "[0, 1]", "1.5"),
      OP_CASE("dropout", mt::dropout(f, -0.1), "[0, 1]", "-0.1"),
      OP_CASE("dropout", mt::dropout(f, nan), "[0, 1]", "nan"),
      OP_CASE("dropout", mt::dropout(i, 0.5), "floating-point", "i64"),
      OP_CASE("causal_mask", mt::causal_mask(-1), "non-negative", "-1"),
      OP_CASE("scaled_dot_product_attention", mt::scaled_dot_product_attention(q24, k25, k25),
              "q [2, 4] k [2, 5] v [2, 5]"),
      OP_CASE("scaled_dot_product_attention", mt::scaled_dot_product_attention(f4, f4, f4),
              "q [4]"),
      OP_CASE("scaled_dot_product_attention", mt::scaled_dot_product_attention(q24, f4, q24),
              "k [4]"),
      OP_CASE("scaled_dot_product_attention", mt::scaled_dot_product_attention(q24, q24, f4),
              "v [4]"),
      OP_CASE("scaled_dot_product_attention", mt::scaled_dot_product_attention(i, i, i), "query",
              "floating-point", "i64"),
  };
}

TEST(Errors, Functional) { run(functional_cases()); }

// ---- dsl/module.h ----
// Exposes the protected registration functions, as a user's module does in its constructor.
struct Open : mt::Module {
  using mt::Module::register_buffer;
  using mt::Module::register_module;
  using mt::Module::register_parameter;
};

std::vector<Case> module_cases() {
  auto root = std::make_shared<Open>();
  auto inner = std::make_shared<Open>();
  auto stray = std::make_shared<Open>();
  auto adopted = std::make_shared<Open>();
  root->register_module("inner", *inner);
  root->register_module("adopted", *adopted);
  inner->register_parameter("w", mt::zeros({2}));
  mt::Tensor ints = mt::zeros({2}, mt::i64);
  auto net = std::make_shared<mt::MLP>(std::vector<int64_t>{2, 3});
  mt::NamedTensors state = net->state_dict();
  mt::NamedTensors missing(state.begin(), state.end() - 1);
  mt::NamedTensors extra = state;
  extra.emplace_back("fc9.weight", mt::zeros({1}));
  mt::NamedTensors wrong_shape = state;
  wrong_shape[0].second = mt::zeros({2, 2});
  mt::NamedTensors wrong_dtype = state;
  wrong_dtype[1].second = mt::zeros({3}, mt::i32);
  return {
      CASE("Module", stray->register_parameter("", mt::zeros({1})), "invalid name ''"),
      CASE("Module", stray->register_parameter("a.b", mt::zeros({1})), "invalid name 'a.b'"),
      CASE("Module", stray->register_buffer("x.y", mt::zeros({1})), "'x.y'"),
      CASE("Module 'inner'", inner->register_parameter("w", mt::zeros({2})),
           "'w' is already registered"),
      CASE("Module 'inner'", inner->register_buffer("w", mt::zeros({2})), "'w'"),
      CASE("Module 'inner'", inner->register_parameter("p", mt::Tensor()), "'p' is undefined"),
      CASE("Module 'inner'", inner->register_buffer("b", mt::Tensor()), "'b' is undefined"),
      CASE("Module 'inner'", inner->register_parameter("n", ints), "'n'", "i64"),
      CASE("Module", stray->register_module("self", *stray), "own child"),
      CASE("Module", stray->register_module("again", *adopted), "'again'", "'adopted'"),
      CASE("Module", root->register_module("inner", *stray), "'inner' is already registered"),
      CASE("load_state_dict", net->load_state_dict(missing), "missing", "fc1.bias"),
      CASE("load_state_dict", net->load_state_dict(extra), "unexpected", "fc9.weight"),
      CASE("load_state_dict", net->load_state_dict(wrong_shape), "fc1.weight",
           "expected [3, 2] f32", "got [2, 2] f32"),
      CASE("load_state_dict", net->load_state_dict(wrong_dtype, false), "fc1.bias", "i32"),
  };
}

TEST(Errors, Module) { run(module_cases()); }

TEST(Errors, FailedLoadStateDictChangesNothing) {
  mt::MLP net({2, 3});
  std::vector<float> before = net.layers[0]->weight.to_vector<float>();
  mt::NamedTensors state = net.state_dict();
  state[0].second = mt::ones({3, 2});
  state[1].second = mt::zeros({7});  // one bad entry spoils the whole load
  EXPECT_THROW(net.load_state_dict(state), mt::Error);
  EXPECT_EQ(net.layers[0]->weight.to_vector<float>(), before);
}

// ---- dsl/nn.h ----
// A user model with a wiring bug: fc1 makes 6 features, fc2 expects 8.
struct Head : mt::Module {
  mt::Linear fc1{4, 6}, fc2{8, 3};
  Head() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  mt::Tensor operator()(const mt::Tensor& x, const mt::Loc& loc = mt::Loc::current()) const {
    mt::CallSiteScope site(loc);  // errors inside point at the caller, as library modules do
    return fc2(mt::relu(fc1(x)));
  }
};

struct Outer : mt::Module {
  Head head;
  mt::ModuleList<mt::TransformerBlock> blocks;
  mt::Embedding tok{5, 8};
  mt::LayerNorm ln{4};
  mt::RMSNorm rms{4};
  mt::Dropout drop{0.5};
  mt::CausalSelfAttention attn{8, 2};
  Outer() {
    register_module("head", head);
    register_module("blocks", blocks);
    blocks.emplace_back(8, 2);
    register_module("tok", tok);
    register_module("ln", ln);
    register_module("rms", rms);
    register_module("drop", drop);
    register_module("attn", attn);
  }
};

std::vector<Case> nn_cases() {
  Inputs in;
  mt::Tensor f = in.f, i = in.i, fidx = in.fidx;
  auto head = std::make_shared<Head>();
  auto outer = std::make_shared<Outer>();
  auto mlp = std::make_shared<mt::MLP>(std::vector<int64_t>{4, 8, 2});
  mt::Tensor x24 = mt::randn({2, 4}), x26 = mt::randn({2, 6}), x8 = mt::randn({2, 8});
  mt::Tensor x136 = mt::randn({1, 3, 6});
  mt::Tensor bad_ids = mt::tensor(i64s({1, 9}), {2});
  return {
      CASE("init", mt::init::fans({3}), "rank >= 2", "[3]"),
      OP_CASE("normal_", mt::init::normal_(f, 0.0, -1.0), "-1", "[2, 3]"),
      OP_CASE("normal_", mt::init::normal_(i), "floating-point", "i64"),
      OP_CASE("uniform_", mt::init::uniform_(f, 1.0, 0.5), "1", "0.5", "[2, 3]"),
      CASE("init", mt::init::xavier_uniform({3}), "[3]"),
      CASE("init", mt::init::xavier_normal({}), "[]"),
      CASE("init", mt::init::kaiming_uniform({5}), "[5]"),
      CASE("init", mt::init::kaiming_normal({2}), "[2]"),
      CASE("randn", mt::init::normal({2}, 0.0, -1.0), "stddev", "-1"),
      CASE("rand", mt::init::uniform({2}, 1.0, 0.0), "low <= high"),
      CASE("Linear", mt::Linear(0, 3), "in=0 out=3"),
      CASE("Linear", mt::Linear(3, -1), "in=3 out=-1"),
      CASE("Embedding", mt::Embedding(0, 4), "0 x 4"),
      CASE("Embedding", mt::Embedding(4, -2), "4 x -2"),
      CASE("LayerNorm", mt::LayerNorm(0), "got 0"),
      CASE("RMSNorm", mt::RMSNorm(-1), "got -1"),
      CASE("Dropout", mt::Dropout(1.5), "[0, 1]", "1.5"),
      CASE("Dropout", mt::Dropout(-0.5), "-0.5"),
      CASE("MLP", mt::MLP({4}), "input and an output"),
      CASE("Linear", mt::MLP({4, 0}), "out=0"),
      CASE("CausalSelfAttention", mt::CausalSelfAttention(10, 3), "dim 10", "3 heads"),
      CASE("CausalSelfAttention", mt::CausalSelfAttention(8, 0), "0 heads"),
      CASE("CausalSelfAttention", mt::TransformerBlock(10, 4), "dim 10", "4 heads"),
      // Forward errors name the module path of the layer that failed and the caller's line.
      OP_CASE("linear", (*head)(x24), "module 'fc2'", "input [2, 6]", "in-features 8"),
      OP_CASE("linear", head->fc2(x24), "module 'fc2'", "input [2, 4]", "[3, 8]"),
      OP_CASE("linear", (*head)(x26), "module 'fc1'", "input [2, 6]", "in-features 4"),
      OP_CASE("linear", outer->head(x24), "module 'head.fc2'", "input [2, 6]"),
      OP_CASE("linear", (*mlp)(x8), "module 'fc1'", "input [2, 8]", "in-features 4"),
      OP_CASE("layer_norm", outer->blocks[0](x136), "module 'blocks.0.ln1'", "[8] should be [6]"),
      OP_CASE("embedding", outer->tok(fidx), "module 'tok'", "integer", "f32"),
      OP_CASE("index_select", outer->tok(bad_ids).to_vector<float>(), "module 'tok'", "index 9",
              "size 5"),
      OP_CASE("layer_norm", outer->ln(f), "module 'ln'", "[4] should be [3]"),
      OP_CASE("rms_norm", outer->rms(f), "module 'rms'", "[4] should be [3]"),
      OP_CASE("dropout", outer->drop(i), "module 'drop'", "floating-point", "i64"),
      OP_CASE("CausalSelfAttention", outer->attn(x8), "module 'attn'", "[batch, time, 8]",
              "got [2, 8]"),
  };
}

TEST(Errors, Nn) { run(nn_cases()); }

// ---- dsl/optim.h ----
std::vector<Case> optim_cases() {
  mt::Tensor p = mt::zeros({2});
  p.requires_grad_();
  mt::Tensor q = mt::zeros({3});
  q.requires_grad_();
  auto sgd = std::make_shared<mt::SGD>(std::vector<mt::Tensor>{p}, mt::SGDOptions{});
  auto adam = std::make_shared<mt::Adam>(std::vector<mt::Tensor>{p}, mt::AdamOptions{});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  mt::NamedTensors bad_state{{"momentum_buffer", mt::zeros({3})}};
  auto scheduled = std::make_shared<mt::SGD>(std::vector<mt::Tensor>{p}, mt::SGDOptions{});
  scheduled->set_schedule(std::make_shared<mt::ExponentialLR>(0.1, 0.9));
  return {
      CASE("SGD", mt::SGD({}, {}), "empty parameter list"),
      CASE("SGD", mt::SGD({mt::Tensor()}, {}), "parameter 0 is undefined"),
      CASE("SGD", mt::SGD({p, q, p}, {}), "parameter 2 is parameter 0 again", "once"),
      CASE("SGD", mt::SGD({p}, {.lr = -1}), "learning rate", "-1"),
      CASE("SGD", mt::SGD({p}, {.lr = nan}), "learning rate", "nan"),
      CASE("SGD", mt::SGD({p}, {.lr = 0.1, .momentum = -0.5}), "momentum"),
      CASE("SGD", mt::SGD({p}, {.lr = 0.1, .weight_decay = -1}), "weight_decay"),
      CASE("SGD", mt::SGD({p}, {.lr = 0.1, .nesterov = true}), "Nesterov"),
      CASE("Adam", mt::Adam({p}, {.lr = -0.1}), "learning rate", "-0.1"),
      CASE("Adam", mt::Adam({p}, {.beta1 = 1.0}), "betas", "(1, 0.999)"),
      CASE("Adam", mt::Adam({p}, {.beta2 = -0.1}), "betas", "-0.1"),
      CASE("Adam", mt::Adam({p}, {.eps = 0}), "eps"),
      CASE("Adam", mt::Adam({p}, {.weight_decay = -1}), "weight_decay"),
      CASE("Adam", mt::Adam({}, {}), "empty parameter list"),
      CASE("AdamW", mt::AdamW({p}, {.lr = inf}), "learning rate", "inf"),
      CASE("AdamW", mt::AdamW({p}, {.beta1 = 0.9, .beta2 = 1.5}), "betas", "1.5"),
      CASE("SGD", sgd->set_lr(-2), "learning rate", "-2"),
      CASE("Adam", adam->set_lr(inf), "learning rate", "inf"),
      CASE("SGD", sgd->state(5), "index 5", "1 parameters"),
      CASE("SGD", sgd->load_state(3, {}), "index 3"),
      CASE("SGD", sgd->load_state(0, bad_state), "'momentum_buffer'", "[3]", "expected [2]"),
      CASE("SGD", sgd->set_steps_taken(-1), "-1"),
      CASE("clip_grad_norm", mt::clip_grad_norm({p}, 0), "max_norm", "0"),
      CASE("clip_grad_norm", mt::clip_grad_norm({p}, -1), "-1"),
      CASE("clip_grad_norm", mt::clip_grad_norm({p}, nan), "nan"),
      CASE("clip_grad_norm", mt::clip_grad_norm({p}, 1, 0), "norm_type must be > 0", "0"),
      CASE("grad_norm", mt::grad_norm({p}, nan), "norm_type", "nan"),
      CASE("clip_grad_value", mt::clip_grad_value({p}, -0.5), "clip_value", "-0.5"),
      CASE("clip_grad_value", mt::clip_grad_value({p}, inf), "clip_value", "inf"),
      CASE("CosineAnnealingWarmRestarts", mt::CosineAnnealingWarmRestarts(0.1, 0), "T_0", "0"),
      CASE("CosineAnnealingWarmRestarts", mt::CosineAnnealingWarmRestarts(0.1, 2, 0), "T_mult",
           "0"),
      CASE("PolynomialLR", mt::PolynomialLR(0.1, 0), "total_iters", "0"),
      CASE("PolynomialLR", mt::PolynomialLR(0.1, 4, -1), "power", "-1"),
      CASE("CosineWithWarmup", mt::CosineWithWarmup(1e-3, 10, 5), "warmup_steps (10)",
           "total_steps (5)"),
      CASE("CosineWithWarmup", mt::CosineWithWarmup(1e-3, 0, 0), "total_steps (0)"),
      CASE("CosineWithWarmup", mt::CosineWithWarmup(1e-3, -1, 5), "warmup_steps (-1)"),
      CASE("CosineWithWarmup", mt::CosineWithWarmup(-1e-3, 1, 5), "peak_lr"),
      CASE("CosineWithWarmup", mt::CosineWithWarmup(1e-3, 1, 5, nan), "min_lr"),
      CASE("CosineWithWarmup", mt::CosineWithWarmup(inf, 1, 5), "finite"),
      CASE("ConstantLR", mt::ConstantLR(-0.5), "-0.5"),
      CASE("ConstantLR", mt::ConstantLR(inf), "finite"),
      CASE("ConstantLR", mt::ConstantLR(nan), "nan"),
      CASE("ConstantLR", mt::ConstantLR(0.1, 0.5, 0), "total_iters", "0"),
      CASE("StepLR", mt::StepLR(0.1, 0), "step_size", "0"),
      CASE("StepLR", mt::StepLR(-0.1, 2), "base_lr", "-0.1"),
      CASE("MultiStepLR", mt::MultiStepLR(0.1, {3, -1}), "milestones", "-1"),
      CASE("ExponentialLR", mt::ExponentialLR(0.1, nan), "gamma", "nan"),
      CASE("LinearLR", mt::LinearLR(0.1, 0.0), "start_factor (0)"),
      CASE("LinearLR", mt::LinearLR(0.1, 0.5, 1.0, 0), "total_iters", "0"),
      CASE("OneCycleLR", mt::OneCycleLR(0.1, 0), "total_steps", "0"),
      CASE("OneCycleLR", mt::OneCycleLR(0.1, 10, {.pct_start = 1.5}), "pct_start", "1.5"),
      CASE("OneCycleLR", mt::OneCycleLR(0.1, 10, {.pct_start = 0.1}), "no length"),
      CASE("SequentialLR", mt::SequentialLR({}, {}), "no schedules"),
      CASE("SequentialLR", mt::SequentialLR({std::make_shared<mt::ConstantLR>(0.1)}, {3}),
           "1 schedules need 0 milestones, got 1"),
      CASE("SequentialLR",
           mt::SequentialLR(
               {std::make_shared<mt::ConstantLR>(0.1), std::make_shared<mt::ConstantLR>(0.2),
                std::make_shared<mt::ConstantLR>(0.3)},
               {4, 4}),
           "increasing", "4 at index 1"),
      CASE("Lion", mt::Lion({p}, {.beta1 = 1.5}), "betas", "1.5"),
      CASE("Lion", mt::Lion({p}, {.lr = -1}), "learning rate", "-1"),
      CASE("Adafactor", mt::Adafactor({p}, {.lr = 0.1}), "relative_step", "0.1"),
      CASE("Adafactor", mt::Adafactor({p}, {.relative_step = false}), "an lr is required"),
      CASE("Adafactor", mt::Adafactor({p}, {.decay_rate = 0.5}), "decay_rate", "0.5"),
      CASE("Adafactor", mt::Adafactor({p}).set_lr(0.1), "relative_step computes the rate"),
      CASE("Adafactor", mt::Adafactor({p}).current_lr(), "relative_step computes the rate"),
      CASE("SGD", scheduled->set_lr(0.5), "set_lr(0.5)", "schedule is attached"),
  };
}

std::vector<Case> einsum_cases() {
  mt::Tensor a = mt::randn({2, 3}), b = mt::randn({3, 4}), c = mt::randn({5});
  mt::Tensor d = mt::randn({3, 4}, mt::f64), u;
  return {
      OP_CASE("einsum", mt::einsum("ij,jk", {a}), "'ij,jk'", "2 operand terms but got 1 operand"),
      OP_CASE("einsum", mt::einsum("ij,jk->ik", {a, c}), "'ij,jk->ik'", "operand 1", "[5]"),
      OP_CASE("einsum", mt::einsum("ij,jk,kl->il", {a, b, a}), "'ij,jk,kl->il'",
              "'k' is 4 in operand 1 but 2 in operand 2"),
      OP_CASE("einsum", mt::einsum("ij,jk->ik", {a, a}), "'j' is 3 in operand 0 but 2",
              "[2, 3], [2, 3]"),
      OP_CASE("einsum", mt::einsum("i1,jk", {a, b}), "'i1,jk'", "letters", "'1'"),
      OP_CASE("einsum", mt::einsum("i.j", {a}), "'i.j'", "'...'"),
      OP_CASE("einsum", mt::einsum("ij->ii", {a}), "'ij->ii'", "'i' twice"),
      OP_CASE("einsum", mt::einsum("ij->iz", {a}), "'ij->iz'", "'z' is in no operand"),
      OP_CASE("einsum", mt::einsum("ij-ji", {a}), "'ij-ji'", "'->'"),
      OP_CASE("einsum", mt::einsum("ii", {a}), "'ii'", "repeats 'i'", "2 and 3"),
      OP_CASE("einsum", mt::einsum("ij,jk", {a, d}), "'ij,jk'", "operand 1 is f64"),
      OP_CASE("einsum", mt::einsum("ij,jk", {a, u}), "'ij,jk'", "operand 1 is undefined"),
      OP_CASE("einsum", mt::einsum("...ij,jk", {c, b}), "'...ij,jk'", "operand 0", "[5]"),
  };
}

TEST(Errors, Einsum) { run(einsum_cases()); }

TEST(Errors, Optim) { run(optim_cases()); }

// ---- autograd/grad.h ----
std::vector<Case> grad_cases() {
  Inputs in;
  mt::Tensor x = mt::randn({2, 3});
  x.requires_grad_();
  mt::Tensor unused = mt::randn({2});
  unused.requires_grad_();
  mt::Tensor y = mt::sum(x * x);
  mt::Tensor wide = x * 2.0;
  mt::Tensor g = mt::scalar(1.0);
  mt::Tensor f = in.f, f4 = in.f4, u = in.u;
  return {
      OP_CASE("grad", mt::grad({}, {x}), "at least one output"),
      OP_CASE("grad", mt::grad({y}, {x}, {g, g}), "2 gradients", "1 outputs"),
      OP_CASE("grad", mt::grad({y, u}, {x}), "output 1 is undefined"),
      OP_CASE("grad", mt::grad({y}, {u}), "input 0 is undefined"),
      OP_CASE("grad", mt::grad({y}, {x, f}), "input 1 does not require grad"),
      OP_CASE("grad", mt::grad({y}, {unused}), "input 0 is not used", "allow_unused"),
      OP_CASE("grad", mt::grad({wide}, {x}), "single-element", "[2, 3]"),
      OP_CASE("grad", mt::grad({wide}, {x}, {f4}), "gradient shape [4]", "output shape [2, 3]"),
      CASE("backpropagate", mt::backpropagate({y.node()}, {}, false), "0 seeds", "1 roots"),
      CASE("backpropagate", mt::backpropagate({wide.node()}, {f4}, false), "[4]", "[2, 3]"),
  };
}

TEST(Errors, Grad) { run(grad_cases()); }

// ---- runtime/checkpoint.h and dsl/data.h: the rows need files ----
class ErrorsWithFiles : public TestWithFolder {
 protected:
  std::string write(const std::string& name, const std::string& contents) const {
    std::ofstream(path(name), std::ios::binary) << contents;
    return path(name);
  }
};

TEST_F(ErrorsWithFiles, Checkpoint) {
  auto net = std::make_shared<mt::MLP>(std::vector<int64_t>{2, 3});
  auto other = std::make_shared<mt::MLP>(std::vector<int64_t>{2, 3});
  auto bigger = std::make_shared<mt::MLP>(std::vector<int64_t>{2, 4});
  auto foreign_opt = std::make_shared<mt::AdamW>(other->parameters());
  auto opt = std::make_shared<mt::AdamW>(net->parameters());
  std::string good = path("good.safetensors");
  mt::save_checkpoint(good, *net);
  std::string garbage = write("garbage.safetensors", "not a safetensors file at all");
  std::string nowhere = path("missing/dir/x.safetensors");
  std::string absent = path("absent.safetensors");
  mt::Tensor one = mt::ones({1});
  run({
      CASE("save_tensors", mt::save_tensors(good, {{"x", mt::Tensor()}}), "'x' is undefined", good),
      CASE("cannot write", mt::save_tensors(good, {{"x", one}, {"x", one}}), "duplicate", "'x'"),
      CASE("cannot write", mt::save_tensors(good, {{"", one}}), "empty"),
      CASE("cannot write", mt::save_tensors(good, {{"__metadata__", one}}), "reserved"),
      CASE("cannot write", mt::save_tensors(good, {{"x", one}}, {{"k", "1"}, {"k", "2"}}),
           "duplicate metadata key 'k'"),
      CASE("cannot write", mt::save_tensors(nowhere, {{"x", one}}), nowhere),
      CASE("cannot open", mt::load_tensors(absent), absent),
      CASE("not a safetensors file", mt::load_tensors(garbage), garbage, "header length"),
      CASE("checkpoint", mt::save_checkpoint(good, *net, foreign_opt.get()),
           "not part of the module", good),
      CASE("save_checkpoint", mt::save_checkpoint(good, *net, nullptr, {{"format", "mine"}}),
           "metadata key 'format' is the checkpoint's own"),
      CASE("save_checkpoint", mt::save_checkpoint(good, *net, nullptr, {{"scaler.note", "7"}}),
           "metadata key 'scaler.note'"),
      CASE("cannot write", mt::save_checkpoint(nowhere, *net), nowhere),
      CASE("cannot open", mt::load_checkpoint(absent, *net), absent),
      CASE("not a safetensors file", mt::load_checkpoint(garbage, *net), garbage),
      CASE("load_checkpoint", mt::load_checkpoint(good, *bigger), good, "fc1.weight", "[4, 2]",
           "[3, 2]"),
      CASE("load_checkpoint", mt::load_checkpoint(good, *net, opt.get()), good, "step count"),
      CASE("checkpoint", mt::load_checkpoint(good, *net, foreign_opt.get()),
           "not part of the module"),
  });
}

TEST_F(ErrorsWithFiles, Data) {
  std::string absent = path("absent.txt");
  std::string not_gzip_but_says_so = write("bad.gz", std::string("\x1f\x8b\x08\x00", 4) + "junk");
  std::string short_line = write("short.csv", "1,2,3\n");
  std::string row(64 * 2, '0');
  for (size_t k = 1; k < row.size(); k += 2) row[k] = ',';
  std::string bright = write("bright.csv", "17" + row.substr(1) + "3\n");
  std::string bad_label = write("label.csv", row + "10\n");
  std::string words = write("words.csv", row.substr(0, row.size() - 2) + "x,3\n");
  std::string empty = write("empty.csv", "");
  auto vocab = std::make_shared<mt::CharVocab>("abc");
  auto data = std::make_shared<mt::TensorDataset>(std::vector<float>(4), mt::Shape{2},
                                                  std::vector<int64_t>{0, 1});
  std::vector<int64_t> far{0, 9};
  std::string directory = dir_.string();
  run({
      CASE("cannot open", mt::read_file(absent), absent),
      CASE("cannot read", mt::read_file(directory), directory),
      CASE("cannot open", mt::read_gzip_file(absent), absent),
      CASE("cannot read gzip file", mt::read_gzip_file(not_gzip_but_says_so), "bad.gz"),
      CASE(short_line, mt::load_digits(short_line), ":1:", "65", "found 3"),
      CASE(bright, mt::load_digits(bright), ":1:", "pixel 0", "17", "0..16"),
      CASE(bad_label, mt::load_digits(bad_label), ":1:", "label 10", "0..9"),
      CASE(words, mt::load_digits(words), ":1:", "pixel 63", "'x'"),
      CASE(empty, mt::load_digits(empty), "no digits"),
      CASE("cannot open", mt::load_digits(absent), absent),
      CASE("CharVocab", mt::CharVocab(""), "empty"),
      CASE("CharVocab::encode", vocab->encode("abz"), "position 2"),
      CASE("CharVocab::decode", vocab->decode({0, 3}), "id 3", "position 1", "[0, 3)"),
      CASE("CharVocab::decode", vocab->decode({-1}), "id -1"),
      CASE("TensorDataset", mt::TensorDataset({1, 2, 3}, {2}, {0}), "3 feature values", "[2]"),
      CASE("TensorDataset", mt::TensorDataset({1, 2}, {2}, {0, 1}), "1 examples", "got 2"),
      CASE("TensorDataset", mt::TensorDataset({}, {2}, {}), "0 feature values"),
      CASE("TensorDataset", mt::TensorDataset({1}, {0}, {0}), "[0]", "below 1"),
      CASE("TensorDataset::get_batch", data->get_batch(far), "index 9", "[0, 2)"),
      CASE("TextWindows", mt::TextWindows({1, 2, 3}, 0), "context length 0"),
      CASE("TextWindows", mt::TextWindows({1, 2, 3}, 3), "3 tokens", "context 3"),
      CASE("TextWindows::get_batch", mt::TextWindows({1, 2, 3}, 1).get_batch(far), "index 9"),
      CASE("DataLoader", mt::DataLoader(*data, 0, false, 0), "batch_size 0"),
      CASE("DataLoader", mt::DataLoader(*data, 3, false, 0, true), "batch_size 3", "2 examples"),
  });
}

// ---- coverage: every primitive op of the table has rows ----
TEST(Errors, EveryPrimitiveOpHasRows) {
  std::set<std::string> covered;
  for (auto* table : {&generated_pointwise_cases, &tensor_cases, &ops_cases, &selection_cases,
                      &functional_cases, &nn_cases, &grad_cases})
    for (const Case& c : (*table)()) covered.insert(c.op);
  for (int k = 0; k < mt::op_count(); ++k) {
    auto op = static_cast<mt::OpCode>(k);
    if (op == mt::OpCode::Constant) continue;  // made by tensor()/from_storage, which have rows
    std::string name = op == mt::OpCode::Custom ? "custom_op" : mt::op_name(op);
    EXPECT_TRUE(covered.count(name)) << "no error rows for op '" << name << "'";
  }
}

}  // namespace

// MIXTAPE_LOG: a word that names no topic is reported (a typo would otherwise log nothing,
// silently), and library code cannot log under a topic the list does not hold.
TEST(Log, WordsThatNameNoTopicAreFoundAndUnlistedTopicsRefused) {
  EXPECT_EQ(mt::unknown_log_topics("jit,,profil,all,Compile,"),
            (std::vector<std::string>{"profil", "Compile"}));
  EXPECT_TRUE(mt::unknown_log_topics("").empty());
  EXPECT_TRUE(mt::unknown_log_topics("compile,fusion,jit,kernels,llvm,nvrtc,profile").empty());
  EXPECT_THROW(mt::log_enabled("no-such-topic"), mt::Error);
  EXPECT_NO_THROW(mt::log_enabled("profile"));
}
