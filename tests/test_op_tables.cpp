// tests/test_op_tables.cpp -- every fact about an op lives in its table: the kernel IR's ops
// (codegen/kir_ops.def) each have their spellings, and both emitters write every op from them;
// the composites (dsl/composites.def) name their nodes and carry their autocast category.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mixtape/codegen/emit_cuda.h"
#include "mixtape/codegen/emit_llvm.h"
#include "mixtape/codegen/kernel_ir.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/composites.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/runtime/cpu_kernels.h"
#include "mixtape/runtime/program.h"
#include "tests/pointwise_programs.h"

#include <mixtape/mixtape.h>

namespace mt = mixtape;
namespace kir = mixtape::kir;
using kir::Op;
using kir::OpForm;
using kir::Type;

namespace {

TEST(KirOpTable, EveryOpHasItsFacts) {
  std::set<std::string> names;
  for (int i = 0; i < kir::op_count(); ++i) {
    const Op op = static_cast<Op>(i);
    const kir::OpTraits& t = kir::traits(op);
    ASSERT_NE(t.name, nullptr);
    EXPECT_TRUE(names.insert(t.name).second) << "two kir ops are named " << t.name;
    EXPECT_STREQ(kir::op_name(op), t.name);
    EXPECT_GE(t.arity, t.form == OpForm::Libm ? -1 : 0) << t.name;
    EXPECT_LE(t.arity, 3) << t.name;
    switch (t.form) {
      case OpForm::Arith:
      case OpForm::Compare:
        EXPECT_EQ(t.arity, 2) << t.name;
        EXPECT_STRNE(t.llvm_float, "") << t.name;
        EXPECT_STRNE(t.llvm_int, "") << t.name;
        EXPECT_STRNE(t.cuda_f32, "") << t.name;
        EXPECT_STRNE(t.cuda_f64, "") << t.name;
        EXPECT_STRNE(t.cuda_i64, "") << t.name;
        break;
      case OpForm::Libm:  // the function (dsl/libm.def) is the value's param
        for (int fn = 0; fn < kir::libm_count(); ++fn) {
          const kir::LibmTraits& libm = kir::traits(static_cast<kir::Libm>(fn));
          EXPECT_TRUE(names.insert(std::string("libm ") + libm.name).second) << libm.name;
          EXPECT_TRUE(libm.arity == 1 || libm.arity == 2) << libm.name;
        }
        break;
      case OpForm::Special:
        for (const char* spelling : {t.llvm_float, t.llvm_int, t.cuda_f32, t.cuda_f64, t.cuda_i64})
          EXPECT_STREQ(spelling, "") << t.name << " is written by hand; its row has spellings";
        break;
    }
  }
}

kir::Value load(int32_t param, Type type) {
  kir::Value v{Op::Load, type};
  v.param = param;
  v.map.coeff = {1};
  return v;
}

kir::Value value(Op op, Type type, int32_t a = -1, int32_t b = -1, int32_t c = -1) {
  kir::Value v{op, type};
  v.a = a, v.b = b, v.c = c;
  return v;
}

// Operands that name the loads every kernel starts with; others index `body`.
constexpr int32_t kInputs = 1000, f32_in = kInputs, f64_in = kInputs + 1, i64_in = kInputs + 2;

// A kernel over 8 points that reads an f32, an f64 and an i64 input (values 0, 1, 2) and stores
// `body`'s last value, converted to f64, in param 3.
kir::Kernel pointwise(const std::string& name, std::vector<kir::Value> body, int scalars = 0) {
  kir::Kernel k;
  k.name = name;
  k.dims = {8};
  k.params = {{mt::f32, false}, {mt::f64, false}, {mt::i64, false}, {mt::f64, true}};
  k.scalars = scalars;
  std::vector<kir::Value> values = {load(0, Type::f32), load(1, Type::f64), load(2, Type::i64)};
  const int32_t offset = static_cast<int32_t>(values.size());
  for (kir::Value v : body) {
    for (int32_t* operand : {&v.a, &v.b, &v.c})
      if (*operand >= kInputs)
        *operand -= kInputs;
      else if (*operand >= 0)
        *operand += offset;
    values.push_back(v);
  }
  values.push_back(value(Op::Convert, Type::f64, static_cast<int32_t>(values.size() - 1)));
  k.body = values;
  k.stores = {{3, static_cast<int32_t>(values.size() - 1), kir::Affine{0, {1}}}};
  return k;
}

// One kernel per op and operand type it takes, each using the op once.
std::vector<std::pair<Op, kir::Kernel>> kernels_using_every_op() {
  std::vector<std::pair<Op, kir::Kernel>> out;
  auto add = [&](Op op, std::vector<kir::Value> body, int scalars = 0) {
    std::string name = fmt::format("op_table_{}_{}", kir::op_name(op), out.size());
    out.push_back({op, pointwise(name, std::move(body), scalars)});
  };
  const std::pair<Type, int32_t> inputs[] = {
      {Type::f32, f32_in}, {Type::f64, f64_in}, {Type::i64, i64_in}};
  for (int i = 0; i < kir::op_count(); ++i) {
    const Op op = static_cast<Op>(i);
    const kir::OpTraits& t = kir::traits(op);
    switch (t.form) {
      case OpForm::Arith:
        for (auto [type, in] : inputs) add(op, {value(op, type, in, in)});
        break;
      case OpForm::Compare:
        for (auto [type, in] : inputs) add(op, {value(op, Type::i1, in, in)});
        break;
      case OpForm::Libm:
        for (int fn = 0; fn < kir::libm_count(); ++fn)
          for (auto [type, in] : inputs) {
            if (type == Type::i64) continue;
            kir::Value v =
                value(op, type, in, kir::traits(static_cast<kir::Libm>(fn)).arity > 1 ? in : -1);
            v.param = fn;
            add(op, {v});
          }
        break;
      case OpForm::Special:
        break;
    }
  }
  kir::Value one{Op::Const, Type::f32};
  one.imm = 1;
  add(Op::Const, {one});
  add(Op::Load, {value(Op::Neg, Type::f32, f32_in)});  // the loads are in every kernel
  add(Op::Neg, {value(Op::Neg, Type::i64, i64_in)});
  add(Op::Or, {value(Op::Lt, Type::i1, f32_in, f32_in), value(Op::Le, Type::i1, f32_in, f32_in),
               value(Op::Or, Type::i1, 0, 1)});
  add(Op::Select,
      {value(Op::Lt, Type::i1, f32_in, f32_in), value(Op::Select, Type::f32, 0, f32_in, f32_in)});
  add(Op::IsNan, {value(Op::IsNan, Type::i1, f64_in)});
  add(Op::Sqrt, {value(Op::Sqrt, Type::f32, f32_in)});
  add(Op::Sqrt, {value(Op::Sqrt, Type::f64, f64_in)});
  add(Op::Ldexp, {value(Op::Ldexp, Type::f32, f32_in, f32_in)});
  add(Op::Ldexp, {value(Op::Ldexp, Type::f64, f64_in, f64_in)});
  add(Op::Convert, {value(Op::Convert, Type::f32, i64_in)});
  kir::Value round = value(Op::RoundTo, Type::f32, f32_in);
  round.dtype = mt::bf16;
  add(Op::RoundTo, {round});
  kir::Value scalar{Op::Scalar, Type::f32};
  scalar.param = 0;
  add(Op::Scalar, {scalar}, 1);
  // Accumulated: a sum over the inner dim, read in the epilogue.
  kir::Kernel sum;
  sum.name = "op_table_accumulated";
  sum.dims = {2, 4};
  sum.reduce_from = 1;
  sum.params = {{mt::f32, false}, {mt::f32, true}};
  kir::Value in{Op::Load, Type::f32};
  in.param = 0;
  in.map.coeff = {4, 1};
  sum.body = {in};
  sum.reductions = {{kir::ReduceKind::Sum, Type::f32, 0}};
  kir::Value accumulated{Op::Accumulated, Type::f32};
  accumulated.param = 0;
  sum.epilogue = {accumulated};
  sum.epilogue_stores = {{1, 0, kir::Affine{0, {1, 0}}}};
  out.push_back({Op::Accumulated, sum});
  return out;
}

// Both emitters write every op of the table (a new op without its emitter code, or a spelling
// the emitter does not read, fails here), and LLVM compiles what its emitter wrote.
TEST(KirOpTable, BothEmittersWriteEveryOp) {
  std::vector<std::pair<Op, kir::Kernel>> kernels = kernels_using_every_op();
  std::set<Op> covered;
  std::vector<const kir::Kernel*> to_compile;
  for (const auto& [op, kernel] : kernels) {
    covered.insert(op);
    std::string ir, cuda;
    ASSERT_NO_THROW(ir = mt::emit_llvm(kernel)) << kernel.name;
    ASSERT_NO_THROW(cuda = mt::emit_cuda(kernel)) << kernel.name;
    const kir::OpTraits& t = kir::traits(op);
    if (t.form == OpForm::Libm) {
      const char* fn = kir::traits(static_cast<kir::Libm>(kernel.body[3].param)).name;
      EXPECT_NE(ir.find(std::string("@") + fn), std::string::npos) << ir;
      EXPECT_NE(cuda.find(fn), std::string::npos) << cuda;
    } else if (t.form != OpForm::Special) {
      EXPECT_TRUE(ir.find(std::string(" ") + t.llvm_float + " ") != std::string::npos ||
                  ir.find(std::string(" ") + t.llvm_int + " ") != std::string::npos)
          << ir;
      EXPECT_TRUE(cuda.find(t.cuda_f32) != std::string::npos ||
                  cuda.find(t.cuda_f64) != std::string::npos ||
                  cuda.find(t.cuda_i64) != std::string::npos)
          << cuda;
    }
    to_compile.push_back(&kernel);
  }
  EXPECT_EQ(static_cast<int>(covered.size()), kir::op_count());
  ASSERT_NE(mt::cpu_kernel_compiler(), nullptr);
  EXPECT_EQ(mt::cpu_kernel_compiler()->compile(to_compile).size(), to_compile.size());
  // NVRTC, where it is installed, compiles the CUDA of them all as one program.
  if (mt::nvrtc_available()) {
    std::string program;
    for (const kir::Kernel* kernel : to_compile) program += mt::emit_cuda(*kernel);
    EXPECT_NO_THROW(mt::compile_cuda(program, "compute_80"));
  }
}

// f(a) or f(a, b) computed in float, and in double rounded to float.
template <int Arity, typename F>
std::pair<float, float> in_float_and_double(F f, double a, double b) {
  if constexpr (Arity == 1)
    return {f(static_cast<float>(a)), static_cast<float>(f(a))};
  else
    return {f(static_cast<float>(a), static_cast<float>(b)), static_cast<float>(f(a, b))};
}

// dsl/libm.def's Exact functions are exactly rounded: their float result is the double one
// rounded to float (the double one is exact for these), which is what lets a back end use any
// library's. Checked on values across the float range, halves and ties included.
TEST(LibmTable, ExactFunctionsRoundOnce) {
  mt::Generator gen(11);
  std::vector<float> x = (mt::randn({4096}, mt::f32, &gen) * 1e3).to_vector<float>();
  for (float v : {0.5f, -0.5f, 1.5f, 2.5f, -2.5f, 0x1p23f + 1, 1e30f, -0.0f}) x.push_back(v);
  for (int fn = 0; fn < kir::libm_count(); ++fn) {
    const kir::LibmTraits& t = kir::traits(static_cast<kir::Libm>(fn));
    if (t.rounding != kir::LibmRounding::Exact) continue;
    for (size_t i = 0; i + 1 < x.size(); ++i) {
      double a = x[i], b = x[i + 1] == 0 ? 3.0 : x[i + 1];
      float single = 0, wide = 0;
      switch (static_cast<kir::Libm>(fn)) {
#define MT_LIBM(Name, name, arity, f32, rounding)                                    \
  case kir::Libm::Name:                                                              \
    std::tie(single, wide) =                                                         \
        in_float_and_double<arity>([](auto... v) { return std::name(v...); }, a, b); \
    break;
#include "mixtape/dsl/libm.def"
      }
      ASSERT_EQ(std::bit_cast<uint32_t>(single), std::bit_cast<uint32_t>(wide))
          << t.name << "(" << a << ", " << b << ")";
    }
  }
}

// The GPU tests allow an ulp where an op calls a Faithful function; tracing its reference
// expression finds the calls, in the compute type: float exp is our own arithmetic, double exp
// the library's.
TEST(LibmTable, TracingFindsTheFaithfulCallsOfAnOp) {
  using mt::test::calls_faithful_libm;
  for (const char* op : {"log1p", "expm1", "sinh", "atan2", "pow", "log"}) {
    EXPECT_TRUE(calls_faithful_libm(op, mt::f32)) << op;
    EXPECT_TRUE(calls_faithful_libm(op, mt::f64)) << op;
  }
  for (const char* op : {"exp", "tanh", "sigmoid", "gelu", "silu", "gelu_backward"}) {
    EXPECT_FALSE(calls_faithful_libm(op, mt::f32)) << op;
    EXPECT_FALSE(calls_faithful_libm(op, mt::bf16)) << op;
    EXPECT_TRUE(calls_faithful_libm(op, mt::f64)) << op;
  }
  for (const char* op : {"add", "mul", "div", "relu", "floor", "round", "fmod", "abs", "sqrt"})
    EXPECT_FALSE(calls_faithful_libm(op, mt::f64)) << op;
}

}  // namespace

namespace {

// Every composite of dsl/composites.def is made by the library under its name (a row no code
// uses, or code that names its nodes otherwise, fails here), and autocast reads its category.
TEST(CompositeTable, EveryCompositeNamesItsNodes) {
  mt::Tensor x = mt::randn({2, 3, 4}), w = mt::randn({5, 4}), b = mt::randn({5});
  mt::Tensor norm_weight = mt::ones({4}), norm_bias = mt::zeros({4});
  mt::Tensor labels = mt::zeros({2, 3}, mt::i64);
  mt::Tensor image = mt::randn({2, 3, 4, 4});
  mt::Tensor volume = mt::randn({2, 3, 4, 4, 4});
  mt::Generator gen(1);
  const std::map<std::string, std::function<mt::Tensor()>> builders = {
      {"softmax", [&] { return mt::softmax(x); }},
      {"log_softmax", [&] { return mt::log_softmax(x); }},
      {"logsumexp", [&] { return mt::logsumexp(x); }},
      {"layer_norm", [&] { return mt::layer_norm(x, norm_weight, norm_bias); }},
      {"rms_norm", [&] { return mt::rms_norm(x, norm_weight); }},
      {"cross_entropy", [&] { return mt::cross_entropy(x, labels); }},
      {"mse_loss", [&] { return mt::mse_loss(x, x * 2.0); }},
      {"binary_cross_entropy_with_logits",
       [&] { return mt::binary_cross_entropy_with_logits(x, mt::sigmoid(x)); }},
      {"clamp", [&] { return mt::clamp(x, -1.0, 1.0); }},
      {"masked_fill", [&] { return mt::masked_fill(x, x > 0.0, 1.0); }},
      {"pad",
       [&] {
         return mt::pad(x, {1, 1}, mt::PadMode::Reflect);
       }},
      {"remainder", [&] { return mt::remainder(x, x + 3.0); }},
      {"nll_loss", [&] { return mt::nll_loss(mt::log_softmax(x), labels); }},
      {"binary_cross_entropy",
       [&] { return mt::binary_cross_entropy(mt::sigmoid(x), mt::sigmoid(x * 2.0)); }},
      {"l1_loss", [&] { return mt::l1_loss(x, x * 2.0); }},
      {"smooth_l1_loss", [&] { return mt::smooth_l1_loss(x, x * 2.0); }},
      {"huber_loss", [&] { return mt::huber_loss(x, x * 2.0); }},
      {"kl_div", [&] { return mt::kl_div(mt::log_softmax(x), mt::softmax(x * 2.0)); }},
      {"prod", [&] { return mt::prod(x, 1); }},
      {"softplus", [&] { return mt::softplus(x); }},
      {"leaky_relu", [&] { return mt::leaky_relu(x); }},
      {"elu", [&] { return mt::elu(x); }},
      {"selu", [&] { return mt::selu(x); }},
      {"mish", [&] { return mt::mish(x); }},
      {"hardsigmoid", [&] { return mt::hardsigmoid(x); }},
      {"hardswish", [&] { return mt::hardswish(x); }},
      {"lerp", [&] { return mt::lerp(x, x * 2.0, mt::sigmoid(x)); }},
      {"linear", [&] { return mt::linear(x, w, b); }},
      {"conv1d",
       [&] {
         return mt::conv1d(x, mt::ones({5, 3, 2}), b);
       }},
      {"conv2d",
       [&] {
         return mt::conv2d(x, mt::ones({5, 2, 2, 2}), b);
       }},
      {"conv3d",
       [&] {
         return mt::conv3d(volume, mt::ones({5, 3, 2, 2, 2}), b);
       }},
      {"conv_transpose2d",
       [&] {
         return mt::conv_transpose2d(x, mt::ones({2, 5, 2, 2}), b);
       }},
      {"conv_transpose3d",
       [&] {
         return mt::conv_transpose3d(volume, mt::ones({3, 5, 2, 2, 2}), b);
       }},
      {"conv_transpose1d",
       [&] {
         return mt::conv_transpose1d(x, mt::ones({3, 5, 2}), b);
       }},
      {"prelu", [&] { return mt::prelu(x, mt::full({3}, 0.25)); }},
      {"max_pool1d", [&] { return mt::max_pool1d(x, 2); }},
      {"avg_pool1d", [&] { return mt::avg_pool1d(x, 2); }},
      {"adaptive_avg_pool1d", [&] { return mt::adaptive_avg_pool1d(x, 3); }},
      {"adaptive_max_pool1d", [&] { return mt::adaptive_max_pool1d(x, 3); }},
      {"dropout", [&] { return mt::dropout(x, 0.5, true, &gen); }},
      {"causal_mask", [&] { return mt::causal_mask(3); }},
      {"scaled_dot_product_attention",
       [&] { return mt::scaled_dot_product_attention(x, x, x, true); }},
      {"batch_norm", [&] { return mt::batch_norm(image, {}, {}, {}, {}, true); }},
      {"group_norm", [&] { return mt::group_norm(image, 1); }},
      {"instance_norm", [&] { return mt::instance_norm(image); }},
      {"max_pool2d", [&] { return mt::max_pool2d(image, 2); }},
      {"avg_pool2d", [&] { return mt::avg_pool2d(image, 2); }},
      {"adaptive_avg_pool2d",
       [&] {
         return mt::adaptive_avg_pool2d(image, {2, 1});
       }},
      {"adaptive_max_pool2d",
       [&] {
         return mt::adaptive_max_pool2d(image, {2, 1});
       }},
      {"max_pool3d", [&] { return mt::max_pool3d(volume, 2); }},
      {"avg_pool3d", [&] { return mt::avg_pool3d(volume, 2); }},
      {"adaptive_avg_pool3d",
       [&] {
         return mt::adaptive_avg_pool3d(volume, {2, 1, 3});
       }},
      {"adaptive_max_pool3d",
       [&] {
         return mt::adaptive_max_pool3d(volume, {2, 1, 3});
       }},
      {"grid_sample",
       [&] {
         return mt::grid_sample(image, mt::zeros({2, 3, 2, 2}));
       }},
      {"interpolate",
       [&] {
         return mt::interpolate(image, {.size = {5, 6}});
       }},
      {"einsum",
       [&] {
         return mt::einsum("bij,kj->bik", {x, w});
       }},
      {"multinomial", [&] { return mt::multinomial(mt::softmax(w), 2, false, &gen); }},
      {"bernoulli", [&] { return mt::bernoulli(mt::sigmoid(w), &gen); }},
  };
  EXPECT_EQ(mt::composite::names().size(), builders.size());
  for (const char* name : mt::composite::names()) {
    auto builder = builders.find(name);
    ASSERT_NE(builder, builders.end()) << name << " is in the table but not in this test";
    mt::Tensor y = builder->second();
    EXPECT_EQ(y.node()->origin.composite, name) << name << ": the result is named otherwise";
    const mt::Category category = mt::composite::category(name);
    EXPECT_TRUE(category == mt::Category::Fp32 || category == mt::Category::LowOk ||
                category == mt::Category::Follow)
        << name;
  }
  EXPECT_EQ(mt::composite::category("softmax"), mt::Category::Fp32);
  EXPECT_EQ(mt::composite::category(nullptr), mt::Category::Follow);
  EXPECT_EQ(mt::composite::category("not_a_composite"), mt::Category::Follow);
}

}  // namespace

namespace {

// The facts fusion and autograd read come from dsl/ops.def's columns: the affine views and the
// fusable reductions by their kind, the ops whose result never requires grad by their vjp.
TEST(OpTable, EveryOpHasItsFacts) {
  using mt::OpCode;
  using mt::OpKind;
  std::set<std::string> names;
  std::set<OpCode> views, reductions, no_gradient;
  for (int i = 0; i < mt::op_count(); ++i) {
    const OpCode op = static_cast<OpCode>(i);
    const mt::OpInfo& info = mt::op_info(op);
    ASSERT_NE(info.name, nullptr);
    EXPECT_TRUE(names.insert(info.name).second) << "two ops are named " << info.name;
    EXPECT_GE(info.arity, -1) << info.name;
    if (info.kind == OpKind::View) views.insert(op);
    if (info.kind == OpKind::Reduce) reductions.insert(op);
    if (!info.differentiable) no_gradient.insert(op);
    if (info.kind == OpKind::Pointwise) {
      EXPECT_GE(info.arity, 1) << info.name;
    }
  }
  EXPECT_EQ(views, (std::set<OpCode>{OpCode::Reshape, OpCode::Permute, OpCode::BroadcastTo,
                                     OpCode::Slice}));
  EXPECT_EQ(reductions, (std::set<OpCode>{OpCode::Sum, OpCode::Max}));
  EXPECT_EQ(no_gradient,
            (std::set<OpCode>{OpCode::Sign, OpCode::Detach, OpCode::Eq, OpCode::Ne, OpCode::Lt,
                              OpCode::Le, OpCode::Gt, OpCode::Ge, OpCode::AttentionBackward,
                              OpCode::MulAdd, OpCode::SubMul, OpCode::Lincomb,
                              OpCode::LincombSquare, OpCode::AdamStep}));
  // The table is what the graph reads: a result of such an op never requires grad.
  mt::Tensor x = mt::ones({3}).requires_grad_(true);
  EXPECT_FALSE(mt::sign(x).requires_grad());
  EXPECT_FALSE(x.detach().requires_grad());
  EXPECT_TRUE(mt::floor(x).requires_grad());
  mt::Tensor q = mt::ones({2, 3}).requires_grad_(true);
  EXPECT_FALSE(mt::attention_backward(q, q, q, q, q, mt::Tensor(), false, 1.0).requires_grad());
  EXPECT_TRUE(mt::attention_forward(q, q, q, mt::Tensor(), false, 1.0).requires_grad());
}

}  // namespace

namespace {

// A value of each attribute type other than the given one.
mt::Ints other(const mt::Ints&) { return {1, 2}; }
bool other(bool b) { return !b; }
int64_t other(int64_t i) { return i + 3; }
double other(double d) { return d + 0.25; }
uint64_t other(uint64_t u) { return u + 7; }

// The program signature of one node of `op` over a [2, 3] input, with `attrs`.
mt::Hash128 signature_of(mt::OpCode op, mt::DType dtype, mt::Attrs attrs) {
  mt::Tensor x = mt::ones({2, 3}, dtype);
  mt::eval({x});
  mt::NodeInputs inputs;
  inputs.emplace_back(x.node());
  mt::NodePtr node = mt::make_node(op, dtype, {2, 3}, std::move(inputs), std::move(attrs),
                                   std::source_location::current());
  std::vector<mt::Node*> pending{node.get()};
  return mt::sign(pending, pending, true, "attr-table").hash;
}

// Every attribute of dsl/attrs.def is in the program signature exactly when the table says it is
// structural: one left out would let two programs that differ in it share compiled code.
TEST(AttrTable, TheSignatureHoldsExactlyTheStructuralAttributes) {
  int attributes = 0;
  for (auto [op, dtype] : {std::pair{mt::OpCode::Sum, mt::f32},
                           {mt::OpCode::Full, mt::f32},
                           {mt::OpCode::Full, mt::i64}}) {
    const mt::Hash128 base = signature_of(op, dtype, {});
    const mt::Node probe(op, dtype, {2, 3}, {}, {}, "");
#define MT_ATTR(type, field, default_value, hashed, ops)            \
  {                                                                 \
    using namespace mixtape;                                        \
    const Node& node = probe;                                       \
    (void)node;                                                     \
    const bool structural = (hashed);                               \
    Attrs changed;                                                  \
    changed.field = other(changed.field);                           \
    const Hash128 hash = signature_of(op, dtype, changed);          \
    EXPECT_EQ(hash.lo != base.lo || hash.hi != base.hi, structural) \
        << #field << " of " << op_name(op) << " " << name(dtype);   \
    ++attributes;                                                   \
  }
#include "mixtape/dsl/attrs.def"
  }
  EXPECT_GE(attributes, 3 * 11);  // the 11 attributes of the table when this was written
  // The table's one value-dependent row: a float Full's fill value is a launch-time argument.
  mt::Attrs fill;
  fill.value = 2.5;
  EXPECT_EQ(signature_of(mt::OpCode::Full, mt::f32, fill).lo,
            signature_of(mt::OpCode::Full, mt::f32, {}).lo);
  EXPECT_NE(signature_of(mt::OpCode::Full, mt::i64, fill).lo,
            signature_of(mt::OpCode::Full, mt::i64, {}).lo);
}

}  // namespace
