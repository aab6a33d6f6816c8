// mixtape/codegen/kernel_ir.h -- the backend-neutral kernel IR that fusion groups lower to and
// emitters print.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mixtape/dsl/dtype.h"

namespace mixtape::kir {

/// Register types: every float storage type computes in f32 registers except f64; integers in
/// i64; bool in i1.
enum class Type : uint8_t { f32, f64, i64, i1 };
/// How a kir type is written: in dumps, in LLVM IR and in CUDA C++.
struct TypeTraits {
  const char* name;
  const char* llvm;
  const char* cuda;
};
const TypeTraits& traits(Type type);

/// The kir ops, from the table in codegen/kir_ops.def (what each reads and means is there).
enum class Op : uint8_t {
#define KIR_OP(Name, name, arity, form, llvm_float, llvm_int, cuda_f32, cuda_f64, cuda_i64) Name,
#include "mixtape/codegen/kir_ops.def"
};

/// The C library functions kernels call (dsl/libm.def): an Op::Call's `param`.
enum class Libm : uint8_t {
#define MT_LIBM(Name, name, arity, f32, rounding) Name,
#include "mixtape/dsl/libm.def"
};
/// Whether every math library returns the same bits (dsl/libm.def).
enum class LibmRounding : uint8_t { Exact, Faithful };
struct LibmTraits {
  const char* name;  // the double function; the float one adds the suffix f
  int arity;
  LibmRounding rounding;
};
const LibmTraits& traits(Libm fn);
int libm_count();

/// How the emitters write an op (codegen/kir_ops.def).
enum class OpForm : uint8_t { Special, Arith, Compare, Libm };

/// An op's row of codegen/kir_ops.def.
struct OpTraits {
  const char* name;
  int arity;
  OpForm form;
  const char* llvm_float;  // Arith: the instruction; Compare: the fcmp predicate
  const char* llvm_int;    // Arith: the instruction; Compare: the icmp predicate
  const char* cuda_f32;    // Arith: the function; Compare: the C operator
  const char* cuda_f64;
  const char* cuda_i64;
};
const OpTraits& traits(Op op);
/// The number of kir ops.
int op_count();

/// An affine function of the loop variables: base + sum(coeff[d] * i_d).
struct Affine {
  int64_t base = 0;
  std::vector<int64_t> coeff;
  bool operator==(const Affine&) const = default;
};

struct Value {
  Value(Op op, Type type) : op(op), type(type) {}
  Op op;
  Type type;
  int32_t a = -1, b = -1, c = -1;  // operands: indices into the same value list
  double imm = 0;                  // Const
  int32_t param = -1;              // Load: param index; Accumulated: reduction index; Scalar: slot
  Affine map;                      // Load: element offset
  DType dtype = DType::f32;        // RoundTo: the storage type
};

struct Param {
  DType dtype;
  bool output;
};

struct Store {
  int32_t param;
  int32_t value;  // index into the list the store belongs to (body or epilogue)
  Affine map;
};

enum class ReduceKind : uint8_t { Sum, Max };

struct Reduction {
  ReduceKind kind;
  Type type;             // accumulator register type
  int32_t value;         // value reduced, in the body of pass `pass`
  DType round_to = f32;  // f16/bf16: every partial sum is rounded to it (a 16-bit accumulator)
  int32_t pass = 0;      // the pass over the inner dims that accumulates it
};

/// One sweep over the inner dims of a reduction kernel after the first (see Kernel).
struct Pass {
  std::vector<Value> body;
  std::vector<Store> stores;
};

/// One kernel: a loop nest over `dims` (outer to inner). Pointwise kernels compute `body` and
/// `stores` at every point. Reduction kernels loop dims[0, reduce_from) outside and, per outer
/// point, sweep dims[reduce_from, end) inside once per pass: pass 0 computes `body` and `stores`,
/// pass p > 0 `later_passes[p - 1]`, at every inner point, and each pass accumulates its
/// `reductions` (Reduction::pass) over the inner dims. A pass's body may read (Accumulated) the
/// final value of any reduction of an earlier pass, so softmax (max; sum of exp(x - max);
/// exp(x - max) / sum) is one kernel of three passes. Each reduction adds its terms in the order
/// a single-pass kernel would. After the last pass, `epilogue` and `epilogue_stores` run once per
/// outer point (their maps use outer dims only) and may read every reduction.
struct Kernel {
  std::string name;
  std::vector<Param> params;
  // Scalar slots, passed by value at each launch so that a value that changes every step (a
  // learning rate) does not change the kernel. Each is a double, exactly the stored constant.
  int32_t scalars = 0;
  std::vector<int64_t> dims;
  int reduce_from = -1;  // -1: pointwise
  std::vector<Value> body;
  std::vector<Store> stores;
  std::vector<Reduction> reductions;
  std::vector<Pass> later_passes;  // reduction kernels: passes 1, 2, ... (pass 0 is body/stores)
  std::vector<Value> epilogue;
  std::vector<Store> epilogue_stores;
  // A multi-tensor kernel (PyTorch's multi_tensor_apply): a rank-1 kernel run over several
  // segments at one launch, each with its own parameter pointers, scalar values and extent:
  // pointwise, or a single-pass reduction of the whole segment (reduce_from 0) whose epilogue
  // stores the segment's result (a gradient's inf check; lowered alone, its outer dims are 1s).
  // dims[0] is 0 here: extents are launch arguments, so one compiled kernel serves any number of
  // segments of any sizes. Maps use i0, the index within the current segment. CPU ABI (emit_llvm):
  // params[0] points to int64 {S, start_0 = 0, start_1, ..., start_S} (segment s covers [start_s,
  // start_s+1) of their concatenation), then each segment's parameter pointers followed, when
  // scalars > 0, by a pointer to its double scalars; begin and end index the concatenation
  // (pointwise) or the segments (reductions: each whole).
  bool multi_tensor = false;

  bool is_reduction() const { return reduce_from >= 0; }
  int pass_count() const { return 1 + static_cast<int>(later_passes.size()); }
  const std::vector<Value>& pass_body(int pass) const {
    return pass == 0 ? body : later_passes[pass - 1].body;
  }
  const std::vector<Store>& pass_stores(int pass) const {
    return pass == 0 ? stores : later_passes[pass - 1].stores;
  }
  /// A reduction whose memory runs fastest along the last outer dim, not the reduced ones (a
  /// bias gradient: a sum over the rows of a row-major matrix). The CPU emitter then keeps one
  /// accumulator per point of that dim and makes it the innermost loop, so that loads are
  /// contiguous and vectorize; each accumulator still adds its terms in the same order.
  bool column_reduction() const;
  /// The most columns a column reduction keeps accumulators for (on the stack).
  static constexpr int64_t max_columns = 16384;
  /// A column reduction whose column dim is dims[0] (a bias gradient: a sum over the rows of a
  /// matrix): no outer dims to split, so threads split the columns instead, each sweeping every
  /// row over its own range. Each column's terms are added in the same order either way.
  bool column_split() const { return reduce_from == 1 && column_reduction(); }
  /// The loop dims the executor splits across threads: every dim but the innermost for
  /// pointwise kernels of rank > 1, else the single dim; the outer dims of a reduction (but the
  /// last one of a column reduction).
  int parallel_dims() const {
    if (column_split()) return 1;
    if (is_reduction()) return column_reduction() ? reduce_from - 1 : reduce_from;
    return dims.size() > 1 ? static_cast<int>(dims.size()) - 1 : 1;
  }
  int64_t parallel_extent() const {
    int64_t n = 1;
    for (int d = 0; d < parallel_dims(); ++d) n *= dims[d];
    return n;
  }
};

/// Whether `map` reads the loop nest's points in row-major order (element i of the flattened
/// nest at offset i), or one element at every point; dims of extent 1 are ignored in both.
bool is_identity_map(const Kernel& kernel, const Affine& map);
bool is_constant_map(const Kernel& kernel, const Affine& map);

/// Rewrites a kernel's loop nest into the fewest dims that visit the same points in the same
/// order: drops dims of extent 1 and merges each pair of adjacent dims that every map walks as
/// one run (the outer dim's coefficient is the inner one's times its extent); a reduction's
/// outer dims and reduced dims each apart. Kernels that differ only in how a contiguous run is
/// shaped ([128, 64], [8192]) then have the same code, which one compile serves (the executor
/// passes the outer extent), and a short inner dim ([256, 10], a loss's [4096, 16]) no longer
/// caps the vectorized loop. Pointwise values and sequential sums keep their bits; a fast sum
/// (fadd reassoc) over merged reduced dims is split into lanes along one loop instead of
/// per row, which rounds differently within the usual tolerance.
void collapse_dims(Kernel& kernel);

/// The multi-tensor form of a pointwise kernel, or of a single-pass whole-tensor reduction
/// without a 16-bit accumulator, whose every map is either the row-major identity over the whole
/// loop nest or a constant (all coefficients zero): the same body over one flat dim. `zero_rank[p]`
/// says whether param p is 0-d, which decides how to read a map that is both (a kernel of one
/// element). nullopt when the kernel does not qualify.
std::optional<Kernel> multi_tensor_form(const Kernel& kernel, const std::vector<bool>& zero_rank);

Type register_type(DType dtype);
const char* op_name(Op op);
/// A readable listing, for MIXTAPE_LOG=kernels and for tests.
std::string to_string(const Kernel& kernel);

}  // namespace mixtape::kir
