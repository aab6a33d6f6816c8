// mixtape/codegen/scalar_trace.cpp -- the operators of Sym: each records one kernel IR value.
#include "mixtape/codegen/scalar_trace.h"

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/scalar_math.h"

namespace mixtape::kir {

TraceContext& trace_context() {
  thread_local TraceContext context;
  return context;
}

namespace {

ValueBuilder& builder() { return *trace_context().builder; }

Sym arith(Op op, Sym a, Sym b) {
  if (a.type != b.type) fail("kernel trace: {} of mismatched register types", op_name(op));
  return Sym(builder().binary(op, a.type, a.id, b.id), a.type, 0);
}

Sym compare(Op op, Sym a, Sym b) {
  if (a.type != b.type) fail("kernel trace: {} of mismatched register types", op_name(op));
  return Sym(builder().binary(op, Type::i1, a.id, b.id), Type::i1, 0);
}

Sym float_op(Op op, Sym a) {
  if (a.type != Type::f32 && a.type != Type::f64)
    fail("kernel trace: {} needs a float operand", op_name(op));
  return Sym(builder().unary(op, a.type, a.id), a.type, 0);
}

// A call of the C library's `fn` (dsl/libm.def) on one or two float operands of one type.
Sym libm_call(Libm fn, Sym a, const Sym* b = nullptr) {
  const char* name = traits(fn).name;
  if ((a.type != Type::f32 && a.type != Type::f64) || (b && b->type != a.type))
    fail("kernel trace: {} needs float operands of one type", name);
  Value v{Op::Call, a.type};
  v.a = a.id;
  if (b) v.b = b->id;
  v.param = static_cast<int32_t>(fn);
  return Sym(builder().add(v), a.type, 0);
}

}  // namespace

Sym operator-(Sym a) { return Sym(builder().unary(Op::Neg, a.type, a.id), a.type, 0); }
Sym operator+(Sym a, Sym b) { return arith(Op::Add, a, b); }
Sym operator-(Sym a, Sym b) { return arith(Op::Sub, a, b); }
Sym operator*(Sym a, Sym b) { return arith(Op::Mul, a, b); }
Sym operator/(Sym a, Sym b) { return arith(Op::Div, a, b); }
Sym operator<(Sym a, Sym b) { return compare(Op::Lt, a, b); }
Sym operator<=(Sym a, Sym b) { return compare(Op::Le, a, b); }
Sym operator>(Sym a, Sym b) { return compare(Op::Gt, a, b); }
Sym operator>=(Sym a, Sym b) { return compare(Op::Ge, a, b); }
Sym operator==(Sym a, Sym b) { return compare(Op::Eq, a, b); }
Sym operator!=(Sym a, Sym b) { return compare(Op::Ne, a, b); }
Sym operator||(Sym a, Sym b) {
  if (a.type != Type::i1 || b.type != Type::i1) fail("kernel trace: || of non-bool values");
  return Sym(builder().binary(Op::Or, Type::i1, a.id, b.id), Type::i1, 0);
}

Sym select(Sym condition, Sym if_true, Sym if_false) {
  if (condition.type != Type::i1 || if_true.type != if_false.type)
    fail("kernel trace: select of mismatched register types");
  return Sym(builder().select(condition.id, if_true.id, if_false.id), if_true.type, 0);
}

Sym is_nan(Sym a) {
  if (a.type == Type::i64 || a.type == Type::i1)  // never NaN
    return Sym(builder().constant(Type::i1, 0), Type::i1, 0);
  return Sym(builder().unary(Op::IsNan, Type::i1, a.id), Type::i1, 0);
}

Sym ldexp(Sym a, Sym b) {
  if (a.type != b.type || (a.type != Type::f32 && a.type != Type::f64))
    fail("kernel trace: ldexp needs float operands of one type");
  return arith(Op::Ldexp, a, b);
}

}  // namespace mixtape::kir

namespace mixtape::math {

using kir::Op;
using kir::Type;

namespace {
// Runs one of scalar_math.h's float templates on f32 registers: its literals become f32
// constants, whatever the expression being traced uses.
template <typename Steps>
Sym f32_steps(Steps steps) {
  kir::TraceContext& context = kir::trace_context();
  Type saved = context.literal_type;
  context.literal_type = Type::f32;
  Sym result = steps();
  context.literal_type = saved;
  return result;
}
}  // namespace

Sym exp(Sym a) {
  if (a.type != Type::f32) return kir::libm_call(kir::Libm::Exp, a);
  return f32_steps([a] { return exp_steps(a); });
}
Sym tanh(Sym a) {
  if (a.type != Type::f32) return kir::libm_call(kir::Libm::Tanh, a);
  return f32_steps([a] { return tanh_steps(a); });
}
Sym erf(Sym a) {
  if (a.type != Type::f32) return kir::libm_call(kir::Libm::Erf, a);
  return f32_steps([a] { return erf_steps(a); });
}
Sym sqrt(Sym a) { return kir::float_op(Op::Sqrt, a); }
// The rest of dsl/libm.def: a call for every float type.
#define MT_LIBM_TRACE_Libm_1(Name, name) \
  Sym name(Sym a) { return kir::libm_call(kir::Libm::Name, a); }
#define MT_LIBM_TRACE_Libm_2(Name, name) \
  Sym name(Sym a, Sym b) { return kir::libm_call(kir::Libm::Name, a, &b); }
#define MT_LIBM_TRACE_Own_1(Name, name)
#define MT_LIBM(Name, name, arity, f32, rounding) MT_LIBM_TRACE_##f32##_##arity(Name, name)
#include "mixtape/dsl/libm.def"
#undef MT_LIBM_TRACE_Libm_1
#undef MT_LIBM_TRACE_Libm_2
#undef MT_LIBM_TRACE_Own_1

}  // namespace mixtape::math
