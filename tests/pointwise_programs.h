// tests/pointwise_programs.h -- every pointwise op of the op table as a one-op program over inputs
// that exercise rounding: what each back end is checked against the reference with, op by op.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mixtape/codegen/scalar_trace.h"
#include "mixtape/dsl/ops.h"
#include "mixtape/dsl/scalar_math.h"
#include "mixtape/dsl/tensor.h"

namespace mixtape::test {

// Values that exercise rounding: wide magnitudes, both signs, zero, ties, inf and NaN. Drawn on
// the current device.
inline Tensor interesting(DType dtype, int64_t n, uint64_t seed) {
  Generator gen(seed);
  Tensor x = randn({n}, f32, &gen) * 3.0;
  std::vector<float> v = x.to_vector<float>();
  v[0] = 0.0f;
  v[1] = -0.0f;
  v[2] = INFINITY;
  v[3] = NAN;
  v[4] = 1.0f + 0x1p-11f;  // an f16 tie
  v[5] = 70000.0f;         // overflows f16
  v[6] = 1e-6f;            // an f16 subnormal
  return tensor(v, {n}, dtype);
}

// The operands of the programs: log and pow's exponent read `positive`.
struct PointwiseInputs {
  Tensor x, y, positive;
  PointwiseInputs(DType dtype, int64_t n)
      : x(interesting(dtype, n, 1)),
        y(interesting(dtype, n, 2)),
        positive(abs(interesting(dtype, n, 3)) + 0.5) {}
};

// A fused op's operands: x, y and positive in turn, so that each meets the special values and
// adam_step's square root (its fourth) reads `positive`.
template <size_t N>
std::array<Tensor, N> fused_operands(const PointwiseInputs& in) {
  std::array<Tensor, N> operands;
  const Tensor* cycle[] = {&in.x, &in.y, &in.positive};
  for (size_t k = 0; k < N; ++k) operands[k] = *cycle[k % 3];
  return operands;
}

using NamedProgram = std::pair<const char*, std::function<Tensor()>>;

// One program per unary, binary and comparison op of dsl/ops.def, plus a chain of them, a where
// and a round trip through f64. The programs read `in`, which must outlive them.
inline std::vector<NamedProgram> pointwise_programs(const PointwiseInputs& in, DType dtype) {
  return {
#define MT_OP(Name, fname, kind, arity, category)
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  {#fname, [&in] { return fname(std::string(#fname) == "log" ? in.positive : in.x); }},
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1) \
  {#fname, [&in] { return fname(in.x, std::string(#fname) == "pow" ? in.positive : in.y); }},
#define MT_COMPARE(Name, fname, REF) {#fname, [&in] { return fname(in.x, in.y); }},
#define MT_FUSED(Name, fname, arity, REF) \
  {#fname, [&in] { return fname(fused_operands<arity>(in)); }},
#include "mixtape/dsl/ops.def"
      {"chain", [&in] { return tanh(in.x * 0.5 + sigmoid(in.y)) - relu(in.x) / in.positive; }},
      {"where", [&in] { return where(in.x > in.y, exp(in.x), in.y * 2.0); }},
      {"cast", [&in, dtype] { return cast(cast(in.x, f64) * 3.0, dtype); }},
  };
}

// Whether the op's reference expression, in the compute type of `dtype`, calls a C library
// function that libraries round differently (dsl/libm.def's Faithful ones: glibc's and CUDA's
// differ by an ulp or two). Traced as the kernels are (codegen/scalar_trace.h), so the answer
// comes from the op table: a float `exp` is the library's in f64 only.
inline bool calls_faithful_libm(std::string_view op, DType dtype) {
  using kir::Sym;
  std::vector<kir::Value> values;
  kir::ValueBuilder builder(values);
  kir::Type t = dtype == f64 ? kir::Type::f64 : kir::Type::f32;
  struct Scope {  // the trace context of the tracing, restored however it ends
    kir::TraceContext saved = kir::trace_context();
    ~Scope() { kir::trace_context() = saved; }
  } scope;
  kir::trace_context() = {&builder, t};
  auto input = [&] { return Sym(builder.constant(t, 0.5), t, 0); };
#define MT_OP(Name, fname, kind, arity, category)
#define MT_UNARY(Name, fname, category, domain, REF, VJP) \
  if (op == #fname) {                                     \
    using T = Sym;                                        \
    Sym a = input();                                      \
    static_cast<void>(static_cast<T>(REF));               \
  }
#define MT_BINARY(Name, fname, category, domain, REF, VJP0, VJP1) \
  if (op == #fname) {                                             \
    using T = Sym;                                                \
    Sym a = input(), b = input();                                 \
    static_cast<void>(T(REF));                                    \
  }
#define MT_FUSED(Name, fname, arity, REF)                                                 \
  if (op == #fname) {                                                                     \
    using T = Sym;                                                                        \
    [[maybe_unused]] Sym a = input(), b = input(), c = input(), d = input(), e = input(), \
                         f = input(), g = input();                                        \
    static_cast<void>(T(REF));                                                            \
  }
#include "mixtape/dsl/ops.def"
  return std::any_of(values.begin(), values.end(), [](const kir::Value& v) {
    return v.op == kir::Op::Call &&
           kir::traits(static_cast<kir::Libm>(v.param)).rounding == kir::LibmRounding::Faithful;
  });
}

}  // namespace mixtape::test
