// mixtape/codegen/scalar_trace.h -- a symbolic scalar that turns ops.def's REF expressions into
// kernel IR.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "mixtape/codegen/kernel_ir.h"

namespace mixtape::kir {

/// Appends values to one list of a kernel (its body or its epilogue). Tracing a REF expression
/// with Sym operands records the expression's operations here, in evaluation order.
class ValueBuilder {
 public:
  explicit ValueBuilder(std::vector<Value>& values) : values_(values) {}
  int32_t add(Value value) {
    values_.push_back(std::move(value));
    return static_cast<int32_t>(values_.size() - 1);
  }
  int32_t constant(Type type, double imm) {
    Value v{Op::Const, type};
    v.imm = imm;
    return add(v);
  }
  int32_t unary(Op op, Type type, int32_t a) {
    Value v{op, type};
    v.a = a;
    return add(v);
  }
  int32_t binary(Op op, Type type, int32_t a, int32_t b) {
    Value v{op, type};
    v.a = a;
    v.b = b;
    return add(v);
  }
  int32_t select(int32_t condition, int32_t a, int32_t b) {
    Value v{Op::Select, type_of(a)};
    v.a = condition;
    v.b = a;
    v.c = b;
    return add(v);
  }
  int32_t convert(int32_t a, Type to) {
    if (type_of(a) == to) return a;
    return unary(Op::Convert, to, a);
  }
  Type type_of(int32_t id) const { return values_[id].type; }

 private:
  std::vector<Value>& values_;
};

/// The builder and the type literals take while a REF expression is traced.
struct TraceContext {
  ValueBuilder* builder = nullptr;
  Type literal_type = Type::f32;
};
TraceContext& trace_context();

/// A scalar of the kernel being built. Arithmetic on it records IR instead of computing.
struct Sym {
  int32_t id;
  Type type;
  Sym(int32_t id, Type type, int) : id(id), type(type) {}
  // Literals in REF expressions (T(1), a < 0) become constants of the traced compute type.
  template <typename A>
  requires std::is_arithmetic_v<A> Sym(
      A literal)  // NOLINT: implicit, as a float literal converts to float
      : id(trace_context().builder->constant(trace_context().literal_type,
                                             static_cast<double>(literal))),
        type(trace_context().literal_type) {}
};

Sym operator-(Sym a);
Sym operator+(Sym a, Sym b);
Sym operator-(Sym a, Sym b);
Sym operator*(Sym a, Sym b);
Sym operator/(Sym a, Sym b);
Sym operator<(Sym a, Sym b);
Sym operator<=(Sym a, Sym b);
Sym operator>(Sym a, Sym b);
Sym operator>=(Sym a, Sym b);
Sym operator==(Sym a, Sym b);
Sym operator!=(Sym a, Sym b);
Sym operator||(Sym a, Sym b);
// Here rather than in math so that argument-dependent lookup finds them from scalar_math.h's
// templates (exp_steps, tanh_steps), which are defined before this header.
Sym select(Sym condition, Sym if_true, Sym if_false);
Sym is_nan(Sym a);
Sym ldexp(Sym a, Sym b);

}  // namespace mixtape::kir

namespace mixtape::math {
using kir::is_nan;
using kir::ldexp;
using kir::select;
using kir::Sym;
Sym sqrt(Sym a);
// dsl/libm.def's functions.
#define MT_LIBM_DECLARE_1(name) Sym name(Sym a);
#define MT_LIBM_DECLARE_2(name) Sym name(Sym a, Sym b);
#define MT_LIBM(Name, name, arity, f32, rounding) MT_LIBM_DECLARE_##arity(name)
#include "mixtape/dsl/libm.def"
#undef MT_LIBM_DECLARE_1
#undef MT_LIBM_DECLARE_2
}  // namespace mixtape::math
