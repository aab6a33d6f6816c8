// mixtape/codegen/kernel_ir.cpp -- register types, kernel listings and loop-nest rewrites.
#include "mixtape/codegen/kernel_ir.h"

#include <algorithm>
#include <cstddef>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace mixtape::kir {

Type register_type(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return Type::f64;
    case DType::f32:
    case DType::f16:
    case DType::bf16:
      return Type::f32;
    case DType::i32:
    case DType::i64:
      return Type::i64;
    case DType::boolean:
      return Type::i1;
  }
  return Type::f32;
}

bool Kernel::column_reduction() const {
  if (!is_reduction() || reduce_from < 1 || dims[reduce_from - 1] > max_columns) return false;
  size_t column = reduce_from - 1, last = dims.size() - 1;
  // The loop order in which fewer of the kernel's loads and stores jump through memory: a map
  // strided along a dim (neither fixed nor contiguous there) does, when that dim is the inner
  // loop. A bias gradient computed from its [rows, classes] terms reads them strided along the
  // rows, however many per-row values (contiguous along the rows) it reads besides. Even, the
  // order with more contiguous maps.
  int strided_column = 0, strided_last = 0, unit_column = 0, unit_last = 0;
  auto count = [&](const Affine& map) {  // a 0-d value's map has no coefficients
    if (map.coeff.size() != dims.size()) return;
    auto strided = [](int64_t c) { return c != 0 && c != 1; };
    strided_column += strided(map.coeff[column]);
    strided_last += strided(map.coeff[last]);
    unit_column += map.coeff[column] == 1;
    unit_last += map.coeff[last] == 1;
  };
  for (int pass = 0; pass < pass_count(); ++pass) {
    for (const Value& v : pass_body(pass))
      if (v.op == Op::Load) count(v.map);
    for (const Store& s : pass_stores(pass)) count(s.map);
  }
  if (strided_column != strided_last) return strided_last > strided_column;
  return unit_column > unit_last;
}

namespace {
constexpr OpTraits kTraits[] = {
#define KIR_OP(Name, name, arity, form, llvm_float, llvm_int, cuda_f32, cuda_f64, cuda_i64) \
  {#name, arity, OpForm::form, llvm_float, llvm_int, cuda_f32, cuda_f64, cuda_i64},
#include "mixtape/codegen/kir_ops.def"
};
constexpr LibmTraits kLibm[] = {
#define MT_LIBM(Name, name, arity, f32, rounding) {#name, arity, LibmRounding::rounding},
#include "mixtape/dsl/libm.def"
};
}  // namespace

// In the order of enum class Type.
constexpr TypeTraits kTypes[] = {{"f32", "float", "float"},
                                 {"f64", "double", "double"},
                                 {"i64", "i64", "long long"},
                                 {"i1", "i1", "bool"}};
static_assert(std::size(kTypes) == static_cast<size_t>(Type::i1) + 1);

const TypeTraits& traits(Type type) { return kTypes[static_cast<size_t>(type)]; }
const OpTraits& traits(Op op) { return kTraits[static_cast<size_t>(op)]; }
const LibmTraits& traits(Libm fn) { return kLibm[static_cast<size_t>(fn)]; }
int libm_count() { return static_cast<int>(std::size(kLibm)); }
int op_count() { return static_cast<int>(std::size(kTraits)); }
const char* op_name(Op op) { return traits(op).name; }

namespace {

std::string affine(const Affine& a) {
  std::string out = fmt::format("{}", a.base);
  for (size_t d = 0; d < a.coeff.size(); ++d)
    if (a.coeff[d] != 0) out += fmt::format(" + {}*i{}", a.coeff[d], d);
  return out;
}

void list_values(std::string& out, const std::vector<Value>& values, const char* prefix) {
  for (size_t i = 0; i < values.size(); ++i) {
    const Value& v = values[i];
    out += fmt::format("  {}{} = {}.{}", prefix, i, op_name(v.op), traits(v.type).name);
    for (int32_t operand : {v.a, v.b, v.c})
      if (operand >= 0) out += fmt::format(" {}{}", prefix, operand);
    if (v.op == Op::Const) out += fmt::format(" {}", v.imm);
    if (v.op == Op::Load) out += fmt::format(" p{}[{}]", v.param, affine(v.map));
    if (v.op == Op::Accumulated) out += fmt::format(" r{}", v.param);
    if (v.op == Op::Scalar) out += fmt::format(" s{}", v.param);
    if (v.op == Op::Call) out += fmt::format(" {}", traits(static_cast<Libm>(v.param)).name);
    if (v.op == Op::RoundTo) out += fmt::format(" {}", name(v.dtype));
    out += "\n";
  }
}

void list_stores(std::string& out, const std::vector<Store>& stores, const char* prefix) {
  for (const Store& s : stores)
    out += fmt::format("  p{}[{}] = {}{}\n", s.param, affine(s.map), prefix, s.value);
}

}  // namespace

bool is_identity_map(const Kernel& kernel, const Affine& map) {
  size_t rank = kernel.dims.size();
  if (map.base != 0 || map.coeff.size() != rank) return rank == 0 && map.base == 0;
  // Row-major strides; a dim of extent 1 contributes nothing, whatever its coefficient.
  int64_t stride = 1;
  for (size_t d = rank; d-- > 0;) {
    if (kernel.dims[d] > 1 && map.coeff[d] != stride) return false;
    stride *= kernel.dims[d];
  }
  return true;
}

bool is_constant_map(const Kernel& kernel, const Affine& map) {
  for (size_t d = 0; d < map.coeff.size() && d < kernel.dims.size(); ++d)
    if (kernel.dims[d] > 1 && map.coeff[d] != 0) return false;
  return true;
}

void collapse_dims(Kernel& kernel) {
  if (kernel.multi_tensor || kernel.dims.size() < 2) return;
  std::vector<Affine*> maps;
  for (int pass = 0; pass < kernel.pass_count(); ++pass) {
    for (Value& v : pass == 0 ? kernel.body : kernel.later_passes[pass - 1].body)
      if (v.op == Op::Load) maps.push_back(&v.map);
    for (Store& s : pass == 0 ? kernel.stores : kernel.later_passes[pass - 1].stores)
      maps.push_back(&s.map);
  }
  for (Value& v : kernel.epilogue)
    if (v.op == Op::Load) maps.push_back(&v.map);
  for (Store& s : kernel.epilogue_stores) maps.push_back(&s.map);
  // A 0-d value's map has no coefficients: the same element at every point, whatever the dims.
  std::erase_if(maps, [](const Affine* map) { return map->coeff.empty(); });
  for (const Affine* map : maps)
    if (map->coeff.size() != kernel.dims.size()) return;
  // The outer dims and the reduced ones are rewritten apart, each kept at one dim at least.
  auto rank = [&] { return static_cast<int>(kernel.dims.size()); };
  auto segment_end = [&](int d) {
    return kernel.is_reduction() && d < kernel.reduce_from ? kernel.reduce_from : rank();
  };
  auto segment_start = [&](int d) {
    return kernel.is_reduction() && d >= kernel.reduce_from ? kernel.reduce_from : 0;
  };
  auto drop = [&](int d) {
    kernel.dims.erase(kernel.dims.begin() + d);
    for (Affine* map : maps) map->coeff.erase(map->coeff.begin() + d);
    if (kernel.is_reduction() && d < kernel.reduce_from) --kernel.reduce_from;
  };
  // A dim of extent 1 adds nothing to any offset, whatever its coefficient.
  for (int d = rank(); d-- > 0;)
    if (kernel.dims[d] == 1 && segment_end(d) - segment_start(d) > 1) drop(d);
  for (int d = rank() - 1; d-- > 0;) {
    if (segment_end(d) != segment_end(d + 1)) continue;  // d is the last outer dim
    const int64_t inner = kernel.dims[d + 1];
    // A column reduction stays one: its column dim is the last outer one, which must not outgrow
    // the accumulators' stack array.
    if (d + 2 == kernel.reduce_from && kernel.dims[d] * inner > Kernel::max_columns &&
        kernel.column_reduction())
      continue;
    bool one_run = std::all_of(maps.begin(), maps.end(), [&](const Affine* map) {
      return map->coeff[d] == map->coeff[d + 1] * inner;
    });
    if (!one_run) continue;
    kernel.dims[d] *= inner;
    for (Affine* map : maps) map->coeff[d] = map->coeff[d + 1];
    drop(d + 1);
  }
}

std::optional<Kernel> multi_tensor_form(const Kernel& kernel, const std::vector<bool>& zero_rank) {
  if (kernel.multi_tensor) return std::nullopt;
  if (kernel.is_reduction()) {
    // Whole-tensor reductions in one pass, with 32-bit or wider accumulators: each segment is
    // then one sweep, as on its own (a 16-bit accumulator's CUDA order would be a thread's).
    if (kernel.pass_count() != 1) return std::nullopt;
    for (int d = 0; d < kernel.reduce_from; ++d)
      if (kernel.dims[d] != 1) return std::nullopt;
    for (const Reduction& r : kernel.reductions)
      if (is_half(r.round_to)) return std::nullopt;
  }
  int64_t numel = 1;
  for (int64_t d : kernel.dims) numel *= d;
  auto identity = [&](const Affine& map) { return is_identity_map(kernel, map); };
  auto constant = [&](const Affine& map) { return is_constant_map(kernel, map); };
  auto flat = [](int64_t base, int64_t coeff) {
    Affine a;
    a.base = base;
    a.coeff = {coeff};
    return a;
  };
  Kernel out = kernel;
  out.name.clear();
  out.dims = {0};
  if (kernel.is_reduction()) out.reduce_from = 0;
  out.multi_tensor = true;
  for (Value& v : out.body) {
    if (v.op != Op::Load) continue;
    // A one-element kernel cannot tell a whole-tensor read from a broadcast 0-d one: a 0-d param
    // is the broadcast, as it is in every larger kernel of the same structure.
    if (identity(v.map) && !(numel == 1 && zero_rank[v.param]))
      v.map = flat(0, 1);
    else if (constant(v.map))
      v.map = flat(v.map.base, 0);
    else
      return std::nullopt;
  }
  for (Store& s : out.stores) {
    if (!identity(s.map)) return std::nullopt;
    s.map = flat(0, 1);
  }
  // A whole-tensor reduction's epilogue runs once: every map in it is constant.
  for (Value& v : out.epilogue) {
    if (v.op != Op::Load) continue;
    if (!constant(v.map)) return std::nullopt;
    v.map = flat(v.map.base, 0);
  }
  for (Store& s : out.epilogue_stores) {
    if (!constant(s.map)) return std::nullopt;
    s.map = flat(s.map.base, 0);
  }
  return out;
}

std::string to_string(const Kernel& kernel) {
  std::string out = kernel.multi_tensor ? fmt::format("kernel {} multi_tensor", kernel.name)
                                        : fmt::format("kernel {} dims [{}]", kernel.name,
                                                      fmt::join(kernel.dims, ", "));
  if (kernel.is_reduction()) out += fmt::format(" reduce from {}", kernel.reduce_from);
  if (kernel.scalars > 0) out += fmt::format(" scalars {}", kernel.scalars);
  out += "\n";
  for (size_t p = 0; p < kernel.params.size(); ++p)
    out += fmt::format("  p{}: {} {}\n", p, name(kernel.params[p].dtype),
                       kernel.params[p].output ? "out" : "in");
  // Pass 0 lists exactly as a single-pass kernel always has (its names are kernel hashes).
  for (int pass = 0; pass < kernel.pass_count(); ++pass) {
    std::string prefix = pass == 0 ? "v" : fmt::format("w{}.", pass);
    if (pass > 0) out += fmt::format("  pass {}\n", pass);
    list_values(out, kernel.pass_body(pass), prefix.c_str());
    list_stores(out, kernel.pass_stores(pass), prefix.c_str());
    for (size_t r = 0; r < kernel.reductions.size(); ++r) {
      const Reduction& red = kernel.reductions[r];
      if (red.pass != pass) continue;
      out += fmt::format(
          "  r{} = {}.{} {}{}{}\n", r, red.kind == ReduceKind::Sum ? "sum" : "max",
          traits(red.type).name, prefix, red.value,
          is_half(red.round_to) ? fmt::format(" rounding to {}", name(red.round_to)) : "");
    }
  }
  list_values(out, kernel.epilogue, "e");
  list_stores(out, kernel.epilogue_stores, "e");
  return out;
}

}  // namespace mixtape::kir
