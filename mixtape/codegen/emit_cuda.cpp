// mixtape/codegen/emit_cuda.cpp -- kernel IR -> CUDA C++ for NVRTC (one extern "C" __global__
// kernel).
#include "mixtape/codegen/emit_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "mixtape/dsl/error.h"

namespace mixtape {
namespace {

using kir::Affine;
using kir::Op;
using kir::Type;
using kir::Value;

// Device helpers shared by every kernel, guarded so that concatenated sources compile once. Each
// mirrors a piece of emit_llvm.cpp; the comments say which.
constexpr const char* prelude = R"(#ifndef MIXTAPE_CUDA_PRELUDE_V1
#define MIXTAPE_CUDA_PRELUDE_V1
// f16 conversions as the PTX instructions cuda_fp16.h uses: round to nearest even, subnormals
// kept, overflow to inf (emit_llvm: fptrunc/fpext half).
static __device__ __forceinline__ float mt_f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
static __device__ __forceinline__ unsigned short mt_f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
static __device__ __forceinline__ float mt_round_f16(float x) {
  return mt_f16_to_f32(mt_f32_to_f16(x));
}
// bf16 as integer operations (DESIGN.md decision 8; emit_llvm's round_bf16): RNE on the high 16
// bits, NaN kept quiet.
static __device__ __forceinline__ float mt_bf16_to_f32(unsigned short h) {
  return __uint_as_float(static_cast<unsigned>(h) << 16);
}
static __device__ __forceinline__ unsigned short mt_f32_to_bf16(float rounded) {
  return static_cast<unsigned short>(__float_as_uint(rounded) >> 16);
}
static __device__ __forceinline__ float mt_round_bf16(float x) {
  unsigned bits = __float_as_uint(x);
  unsigned rounded = (bits + (0x7FFFu + ((bits >> 16) & 1u))) & 0xFFFF0000u;
  unsigned quiet = (bits & 0xFFFF0000u) | 0x400000u;
  return __uint_as_float((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}
// f64 -> f32 rounding to odd, so that one more rounding to a 16-bit type is correctly rounded
// (emit_llvm's round_to_odd).
static __device__ __forceinline__ float mt_f64_to_f32_odd(double x) {
  float f = __double2float_rn(x);
  double back = static_cast<double>(f);
  if (back == x || x != x) return f;
  unsigned bits = __float_as_uint(f);
  if (fabs(back) > fabs(x)) bits -= 1u;
  return __uint_as_float(bits | 1u);
}
// i64 arithmetic wraps, as LLVM's add/sub/mul without nsw do.
// A float to a 64-bit integer as the other back ends convert it: INT64_MIN for NaN and outside
// [-2^63, 2^63) (dsl/convert.h's to_int64), not the hardware's saturation.
static __device__ __forceinline__ long long mt_to_i64(double x) {
  return x >= -0x1p63 && x < 0x1p63 ? static_cast<long long>(x) : (-0x7fffffffffffffffLL - 1);
}
static __device__ __forceinline__ long long mt_add_i64(long long a, long long b) {
  return static_cast<long long>(static_cast<unsigned long long>(a) +
                                static_cast<unsigned long long>(b));
}
static __device__ __forceinline__ long long mt_sub_i64(long long a, long long b) {
  return static_cast<long long>(static_cast<unsigned long long>(a) -
                                static_cast<unsigned long long>(b));
}
static __device__ __forceinline__ long long mt_mul_i64(long long a, long long b) {
  return static_cast<long long>(static_cast<unsigned long long>(a) *
                                static_cast<unsigned long long>(b));
}
// An i64 stored as i32 and read back: C's wrapping conversion (emit_llvm: trunc + sext).
static __device__ __forceinline__ long long mt_wrap_i32(long long a) {
  return static_cast<int>(static_cast<unsigned>(static_cast<unsigned long long>(a)));
}
// a * 2^b for an integer-valued b, as two exact power-of-two factors (emit_llvm: Ldexp).
static __device__ __forceinline__ float mt_ldexp_f32(float a, float b) {
  int k = static_cast<int>(b), half = k >> 1;
  return __fmul_rn(__fmul_rn(a, __int_as_float((half + 127) << 23)),
                   __int_as_float((k - half + 127) << 23));
}
static __device__ __forceinline__ double mt_ldexp_f64(double a, double b) {
  long long k = static_cast<long long>(b), half = k >> 1;
  return __dmul_rn(__dmul_rn(a, __longlong_as_double((half + 1023) << 52)),
                   __longlong_as_double((k - half + 1023) << 52));
}
// Max in the reference's total order (ref_Max; emit_llvm reduces order keys): -0 below +0, and
// any NaN gives the quiet NaN. The order is total, so partials merge in any order to the same
// bits; the index kept alongside is only where the value came from.
static __device__ __forceinline__ bool mt_max_above(float x, float acc) {
  return x > acc || (x == acc && signbit(acc) && !signbit(x));
}
static __device__ __forceinline__ bool mt_max_above(double x, double acc) {
  return x > acc || (x == acc && signbit(acc) && !signbit(x));
}
static __device__ __forceinline__ bool mt_max_above(long long x, long long acc) { return x > acc; }
static __device__ __forceinline__ float mt_quiet_nan(float) { return __int_as_float(0x7fc00000); }
static __device__ __forceinline__ double mt_quiet_nan(double) {
  return __longlong_as_double(0x7ff8000000000000LL);
}
static __device__ __forceinline__ long long mt_quiet_nan(long long x) { return x; }
template <typename T>
static __device__ __forceinline__ T mt_max_step(T acc, T x) {
  if (acc != acc) return acc;
  if (x != x) return mt_quiet_nan(x);
  return mt_max_above(x, acc) ? x : acc;
}
template <typename T>
static __device__ __forceinline__ void mt_max_step_at(T& acc, long long& at, T x, long long x_at) {
  T next = mt_max_step(acc, x);
  if (next != acc || (next == next) != (acc == acc)) at = x_at;
  acc = next;
}
template <typename T>
static __device__ __forceinline__ void mt_max_merge(T& acc, long long& at, T other,
                                                    long long other_at) {
  mt_max_step_at(acc, at, other, other_at);
}
// N consecutive elements moved by one aligned load or store (vectorized pointwise kernels).
template <typename T, int N>
struct alignas(sizeof(T) * N) mt_pack {
  T x[N];
};
#endif  // MIXTAPE_CUDA_PRELUDE_V1
)";

constexpr uint32_t warp_size = 32;
constexpr uint32_t max_block = 256;
constexpr int64_t max_pointwise_grid = 8192;
constexpr int64_t max_reduction_grid = 65535;
// A reduction over few outer points but many inner ones splits each outer point's inner range
// across blocks (about split_target_blocks in all, for a GPU of a hundred-odd SMs), each block
// taking at least split_min_points of them. A multi-tensor reduction gives each segment a block
// per multi_tensor_chunk_points of its elements.
constexpr int64_t split_target_blocks = 512;
constexpr int64_t split_min_points = 4096;
constexpr int64_t multi_tensor_chunk_points = 32768;
// A column reduction's blocks take 32 columns each and at least this many of their rows.
constexpr int64_t column_min_rows = 1024;

// How a kernel is spread over the GPU.
enum class Mapping : uint8_t {
  pointwise,     // grid-stride loop over all points, one point per thread at a time
  block_reduce,  // one block per outer point (or per chunk of one: LaunchPlan::chunks); the block's
                 // threads share its inner points
  thread_reduce,  // one thread per outer point; the inner loop runs sequentially, as on the CPU
  column_tiles    // a column reduction (kir::Kernel::column_reduction): a block per 32 columns
                  // (or per chunk of their rows), a lane per column, the warps sharing the rows
};

struct LaunchPlan {
  Mapping mapping = Mapping::pointwise;
  int64_t outer = 1, inner = 1;  // reductions: points outside and inside; pointwise: all in outer
  uint32_t block = warp_size;
  uint32_t grid = 1;
  // block_reduce: blocks per outer point, each taking a chunk of `chunk_points` inner points;
  // column_tiles: blocks per tile of columns, likewise. With more than one, each block leaves
  // its partials in the workspace and the last block of an outer point (or tile) to finish
  // folds them in chunk order and runs the epilogue.
  int64_t chunks = 1, chunk_points = 0;
  int64_t columns = 0, tiles = 0;  // column_tiles: the column dim's extent; tiles in all
};

// How a split reduction's workspace is laid out: arrays of one 8-byte word per block (every
// accumulator type fits one) for each reduction's partial and each carried max's index, then a
// 4-byte count per outer point (or segment) of the blocks that finished it.
struct Workspace {
  std::vector<int> partial, at;  // per reduction: its arrays' places (-1: none)
  int arrays = 0;

  int64_t array_offset(int array, int64_t blocks) const { return 8 * array * blocks; }
  int64_t arrivals_offset(int64_t blocks) const { return array_offset(arrays, blocks); }
  int64_t bytes(int64_t blocks, int64_t points) const {
    return arrivals_offset(blocks) + 4 * points;
  }
};

int64_t product(const std::vector<int64_t>& dims, size_t from, size_t to) {
  int64_t n = 1;
  for (size_t d = from; d < to; ++d) n *= dims[d];
  return n;
}

uint32_t round_up_to_warps(int64_t threads) {
  int64_t warps = std::max<int64_t>(1, (threads + warp_size - 1) / warp_size);
  return static_cast<uint32_t>(std::min<int64_t>(warps * warp_size, max_block));
}

uint32_t clamp_grid(int64_t blocks, int64_t cap) {
  return static_cast<uint32_t>(std::clamp<int64_t>(blocks, 1, cap));
}

// How many consecutive points a thread of a pointwise kernel takes at once: where every map is
// the identity or a constant, each buffer read or written whole moves 16 bytes (for its widest
// element type; fewer for narrower ones) per thread with one aligned access. Buffers are whole
// allocations (256-byte aligned), so point `vec * width` starts an aligned pack. 1: scalar code.
int vector_width(const kir::Kernel& k) {
  if (k.is_reduction() || k.multi_tensor) return 1;
  size_t widest = 0;
  for (const Value& v : k.body) {
    if (v.op != Op::Load) continue;
    if (kir::is_identity_map(k, v.map))
      widest = std::max(widest, size_of(k.params[v.param].dtype));
    else if (!kir::is_constant_map(k, v.map))
      return 1;
  }
  for (const kir::Store& s : k.stores) {
    if (!kir::is_identity_map(k, s.map)) return 1;
    widest = std::max(widest, size_of(k.params[s.param].dtype));
  }
  if (widest == 0) return 1;
  int width = static_cast<int>(16 / widest);
  return product(k.dims, 0, k.dims.size()) >= 4 * width ? width : 1;  // tiny: not worth it
}

LaunchPlan plan(const kir::Kernel& k) {
  LaunchPlan p;
  size_t rank = k.dims.size();
  if (k.multi_tensor) {  // the grid depends on the segments: cuda_multi_tensor_launch
    p.mapping = k.is_reduction() ? Mapping::block_reduce : Mapping::pointwise;
    p.block = max_block;
    return p;
  }
  if (!k.is_reduction()) {
    p.outer = product(k.dims, 0, rank);
    int64_t threads = p.outer / vector_width(k);
    p.block = round_up_to_warps(threads);
    p.grid = clamp_grid((threads + p.block - 1) / p.block, max_pointwise_grid);
    return p;
  }
  size_t split = static_cast<size_t>(k.reduce_from);
  p.outer = product(k.dims, 0, split);
  p.inner = product(k.dims, split, rank);
  bool half_accumulator = std::any_of(k.reductions.begin(), k.reductions.end(),
                                      [](const kir::Reduction& r) { return is_half(r.round_to); });
  // A 16-bit accumulator rounds every partial sum: only the CPU's sequential order gives the
  // CPU's result. Short inner loops are not worth a block either.
  if (half_accumulator || p.inner < static_cast<int64_t>(warp_size)) {
    p.mapping = Mapping::thread_reduce;
    p.block = round_up_to_warps(p.outer);
    p.grid = clamp_grid((p.outer + p.block - 1) / p.block, max_pointwise_grid);
    return p;
  }
  // Memory runs along the columns (a bias gradient): lanes take consecutive columns, so each
  // warp's loads are contiguous. One pass only: a later pass would need every row's results.
  if (!k.multi_tensor && k.pass_count() == 1 && k.column_reduction() && p.outer > 0) {
    p.columns = k.dims[split - 1];
    p.tiles = p.outer / p.columns * ((p.columns + warp_size - 1) / warp_size);
    p.chunks = std::clamp<int64_t>(
        std::min((p.inner + column_min_rows - 1) / column_min_rows, split_target_blocks / p.tiles),
        1, max_reduction_grid);
    if (p.tiles * p.chunks <= max_reduction_grid) {
      p.mapping = Mapping::column_tiles;
      p.chunk_points = (p.inner + p.chunks - 1) / p.chunks;
      p.block = max_block;
      p.grid = static_cast<uint32_t>(p.tiles * p.chunks);
      return p;
    }
    p.chunks = 1;  // too many tiles for one grid: a block per outer point
  }
  p.mapping = Mapping::block_reduce;
  uint32_t block = warp_size;
  while (block < max_block && block < p.inner) block *= 2;
  p.block = block;
  p.grid = clamp_grid(p.outer, max_reduction_grid);
  // A later pass reads the whole row's results, which a block of one chunk does not have.
  if (k.multi_tensor || k.pass_count() != 1 || p.outer == 0) return p;
  int64_t chunks =
      std::min((p.inner + split_min_points - 1) / split_min_points, split_target_blocks / p.outer);
  if (chunks < 2) return p;
  p.chunks = chunks;
  p.chunk_points = (p.inner + chunks - 1) / chunks;
  p.block = max_block;
  p.grid = static_cast<uint32_t>(p.outer * chunks);
  return p;
}

bool is_float(Type type) { return type == Type::f32 || type == Type::f64; }

// Max reductions of floats that a block's threads split carry the index of the value they keep.
bool carries_index(const kir::Reduction& red, const LaunchPlan& p) {
  return p.mapping == Mapping::block_reduce && red.kind == kir::ReduceKind::Max &&
         is_float(red.type);
}

Workspace workspace(const kir::Kernel& k, const LaunchPlan& p) {
  Workspace w;
  for (const kir::Reduction& red : k.reductions) {
    w.partial.push_back(w.arrays++);
    w.at.push_back(carries_index(red, p) ? w.arrays++ : -1);
  }
  return w;
}

// The workspace bytes of a kernel split LaunchPlan::chunks ways (0 when it is not): column tiles
// keep a word per column of each block, and count arrivals per tile.
int64_t split_workspace_bytes(const kir::Kernel& k, const LaunchPlan& p) {
  if (k.multi_tensor || p.chunks < 2) return 0;
  if (p.mapping == Mapping::column_tiles)
    return workspace(k, p).bytes(p.tiles * p.chunks * warp_size, p.tiles);
  return workspace(k, p).bytes(p.outer * p.chunks, p.outer);
}

const char* cuda_type(Type type) { return traits(type).cuda; }

// The element type of a parameter buffer (see emit_cuda.h for the ABI).
const char* element_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "float";
    case DType::f64:
      return "double";
    case DType::f16:
    case DType::bf16:
      return "unsigned short";
    case DType::i32:
      return "int";
    case DType::i64:
      return "long long";
    case DType::boolean:
      return "unsigned char";
  }
  return "";
}

std::string integer(int64_t value) {
  if (value == std::numeric_limits<int64_t>::min()) return "(-9223372036854775807LL - 1)";
  if (value > std::numeric_limits<int32_t>::max() || value < -std::numeric_limits<int32_t>::max())
    return fmt::format("{}LL", value);
  return fmt::format("{}", value);
}

// The shortest decimal that reads back as the same value (fmt's guarantee), as a literal.
std::string decimal(std::string text) {
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

std::string constant(Type type, double imm) {
  switch (type) {
    case Type::f32: {
      float f = static_cast<float>(imm);
      if (!std::isfinite(f)) {
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        return fmt::format("__uint_as_float(0x{:08X}u)", bits);
      }
      return decimal(fmt::format("{}", f)) + "f";
    }
    case Type::f64: {
      if (!std::isfinite(imm)) {
        uint64_t bits;
        std::memcpy(&bits, &imm, 8);
        return fmt::format("__longlong_as_double(static_cast<long long>(0x{:016X}ULL))", bits);
      }
      return decimal(fmt::format("{}", imm));
    }
    case Type::i64:
      return integer(static_cast<int64_t>(imm));
    case Type::i1:
      return imm != 0 ? "true" : "false";
  }
  return "";
}

std::string neg_infinity(Type type) {
  return type == Type::f32 ? "__uint_as_float(0xFF800000u)"
                           : "__longlong_as_double(static_cast<long long>(0xFFF0000000000000ULL))";
}

class Emitter {
 public:
  explicit Emitter(const kir::Kernel& kernel) : k_(kernel), plan_(plan(kernel)) {}

  std::string run() {
    find_used_dims();
    out_ = prelude;
    out_ += "\n";
    if (k_.multi_tensor) {
      multi_tensor();
      return std::move(out_);
    }
    header();
    indent_ = 1;
    switch (plan_.mapping) {
      case Mapping::pointwise:
        pointwise();
        break;
      case Mapping::block_reduce:
        block_reduce();
        break;
      case Mapping::thread_reduce:
        thread_reduce();
        break;
      case Mapping::column_tiles:
        column_tiles();
        break;
    }
    out_ += "}\n";
    return std::move(out_);
  }

 private:
  template <typename... Args>
  void line(fmt::format_string<Args...> format, Args&&... args) {
    out_.append(static_cast<size_t>(2 * indent_), ' ');
    out_ += fmt::format(format, std::forward<Args>(args)...);
    out_ += "\n";
  }
  void open(const std::string& text) {
    line("{} {{", text);
    ++indent_;
  }
  void close() {
    --indent_;
    line("}}");
  }

  void find_used_dims() {
    used_.assign(k_.dims.size(), false);
    auto mark = [&](const Affine& map) {
      for (size_t d = 0; d < map.coeff.size() && d < used_.size(); ++d)
        if (map.coeff[d] != 0) used_[d] = true;
    };
    for (int pass = 0; pass <= k_.pass_count(); ++pass) {
      bool epilogue = pass == k_.pass_count();
      for (const Value& v : epilogue ? k_.epilogue : k_.pass_body(pass))
        if (v.op == Op::Load) mark(v.map);
      for (const kir::Store& s : epilogue ? k_.epilogue_stores : k_.pass_stores(pass)) mark(s.map);
    }
  }

  void header() {
    std::string per = plan_.chunks > 1 ? fmt::format("{} blocks per", plan_.chunks) : "a block per";
    std::string shape =
        plan_.mapping == Mapping::pointwise      ? "pointwise"
        : plan_.mapping == Mapping::column_tiles ? "column reduction, " + per + " 32 columns"
        : plan_.mapping == Mapping::block_reduce ? "reduction, " + per + " outer point"
                                                 : "reduction, a thread per outer point";
    std::string dims;
    for (size_t d = 0; d < k_.dims.size(); ++d)
      dims += fmt::format("{}{}", d ? ", " : "", k_.dims[d]);
    out_ += fmt::format("// mixtape kernel {}: {} over [{}]", k_.name, shape, dims);
    if (k_.is_reduction()) out_ += fmt::format(", reduced from dim {}", k_.reduce_from);
    out_ += fmt::format("; launch {} x {} threads\n", plan_.grid, plan_.block);
    std::string args;
    for (size_t p = 0; p < k_.params.size(); ++p) {
      const kir::Param& param = k_.params[p];
      args += fmt::format("{}    {}{}* __restrict__ p{}", p ? ",\n" : "",
                          param.output ? "" : "const ", element_type(param.dtype), p);
    }
    for (int32_t s = 0; s < k_.scalars; ++s)
      args += fmt::format("{}    double s{}", args.empty() ? "" : ",\n", s);
    if (plan_.chunks > 1) args += ",\n    unsigned char* __restrict__ workspace";
    out_ += fmt::format("extern \"C\" __global__ void __launch_bounds__({}) {}(\n{}) {{\n",
                        plan_.block, k_.name, args);
  }

  // Declares the loop variables i<from> .. i<to - 1> of the flat index `flat` over those dims
  // (innermost fastest), skipping the ones no map reads.
  void coordinates(const std::string& flat, int from, int to) {
    int outermost_used = -1;
    for (int d = to - 1; d >= from; --d)
      if (used_[d]) outermost_used = d;
    if (outermost_used < 0) return;
    if (to - from == 1) {
      line("const long long i{} = {};", from, flat);
      return;
    }
    std::string rest = flat + "_rest";
    line("long long {} = {};", rest, flat);
    for (int d = to - 1; d >= from; --d) {
      if (d == from) {
        line("const long long i{} = {};", d, rest);
        break;
      }
      if (used_[d]) line("const long long i{} = {} % {};", d, rest, integer(k_.dims[d]));
      if (d == outermost_used) break;
      line("{} /= {};", rest, integer(k_.dims[d]));
    }
  }

  std::string offset(const Affine& map) const {
    std::string text;
    for (size_t d = 0; d < map.coeff.size(); ++d) {
      int64_t c = map.coeff[d];
      if (c == 0) continue;
      std::string term = c == 1 ? fmt::format("i{}", d) : fmt::format("i{} * {}", d, integer(c));
      text += text.empty() ? term : " + " + term;
    }
    if (map.base != 0 || text.empty())
      text += text.empty() ? integer(map.base) : " + " + integer(map.base);
    return text;
  }

  // The f32 value `x` (of register type `from`) rounded to the 16-bit `dtype` and widened back.
  static std::string round_half(DType dtype, Type from, const std::string& x) {
    std::string narrow = from == Type::f64 ? fmt::format("mt_f64_to_f32_odd({})", x) : x;
    return fmt::format("{}({})", dtype == DType::bf16 ? "mt_round_bf16" : "mt_round_f16", narrow);
  }

  std::string round_to(const Value& v, const std::string& a, Type from) const {
    if (v.dtype == DType::i32 && from == Type::i64) return fmt::format("mt_wrap_i32({})", a);
    if (is_half(v.dtype) && is_float(from)) return round_half(v.dtype, from, a);
    fail("cuda emitter: kernel {}: no rounding of {} to {}", k_.name, cuda_type(from),
         name(v.dtype));
  }

  std::string convert(const std::string& a, Type from, Type to) const {
    if (from == to) return a;
    if (from == Type::f32 && to == Type::f64) return fmt::format("static_cast<double>({})", a);
    if (from == Type::f64 && to == Type::f32) return fmt::format("__double2float_rn({})", a);
    if (is_float(from) && to == Type::i64) return fmt::format("mt_to_i64({})", a);
    if (is_float(from) && to == Type::i1)  // une: NaN converts to true, as in C
      return fmt::format("({} != {})", a, constant(from, 0.0));
    if (from == Type::i64 && to == Type::f32) return fmt::format("__ll2float_rn({})", a);
    if (from == Type::i64 && to == Type::f64) return fmt::format("__ll2double_rn({})", a);
    if (from == Type::i64 && to == Type::i1) return fmt::format("({} != 0)", a);
    if (from == Type::i1 && to == Type::i64) return fmt::format("static_cast<long long>({})", a);
    if (from == Type::i1 && is_float(to))
      return fmt::format("({} ? {} : {})", a, constant(to, 1.0), constant(to, 0.0));
    fail("cuda emitter: kernel {}: no conversion from {} to {}", k_.name, cuda_type(from),
         cuda_type(to));
  }

  // Param p's element at the current point. In a vectorized loop (no loop variables there),
  // an identity map reads lane `lane` of its pack, a constant one its base.
  std::string element(int32_t param, const Affine& map) const {
    if (width_ > 1 && kir::is_identity_map(k_, map))
      return fmt::format("{}{}.x[lane]", k_.params[param].output ? "out" : "in", param);
    if (width_ > 1) return fmt::format("p{}[{}]", param, integer(map.base));
    return fmt::format("p{}[{}]", param, offset(map));
  }

  std::string load(const Value& v) const {
    std::string element = this->element(v.param, v.map);
    switch (k_.params[v.param].dtype) {
      case DType::f32:
      case DType::f64:
      case DType::i64:
        return element;
      case DType::f16:
        return fmt::format("mt_f16_to_f32({})", element);
      case DType::bf16:
        return fmt::format("mt_bf16_to_f32({})", element);
      case DType::i32:
        return fmt::format("static_cast<long long>({})", element);
      case DType::boolean:
        return fmt::format("({} != 0)", element);
    }
    return element;
  }

  void store(const kir::Store& s, const std::string& value) {
    std::string element = this->element(s.param, s.map);
    switch (k_.params[s.param].dtype) {
      case DType::f32:
      case DType::f64:
      case DType::i64:
        line("{} = {};", element, value);
        return;
      case DType::f16:  // the value is already rounded: the conversion is exact
        line("{} = mt_f32_to_f16({});", element, value);
        return;
      case DType::bf16:
        line("{} = mt_f32_to_bf16({});", element, value);
        return;
      case DType::i32:
        line("{} = static_cast<int>(mt_wrap_i32({}));", element, value);
        return;
      case DType::boolean:
        line("{} = static_cast<unsigned char>({} ? 1 : 0);", element, value);
        return;
    }
  }

  // Declares every value of `list` as a const local named <prefix><index>.
  void values(const std::vector<Value>& list, const char* prefix) {
    names_.assign(list.size(), "");
    for (size_t i = 0; i < list.size(); ++i) {
      names_[i] = fmt::format("{}{}", prefix, i);
      line("const {} {} = {};", cuda_type(list[i].type), names_[i], expression(list[i], list));
    }
  }

  std::string expression(const Value& v, const std::vector<Value>& list) const {
    auto operand = [&](int32_t id) { return names_[id]; };
    auto operand_type = [&](int32_t id) { return list[id].type; };
    std::string a = v.a >= 0 ? operand(v.a) : "", b = v.b >= 0 ? operand(v.b) : "";
    Type ta = v.a >= 0 ? operand_type(v.a) : v.type;
    bool f32 = ta == Type::f32;
    const kir::OpTraits& op = kir::traits(v.op);
    switch (op.form) {
      case kir::OpForm::Arith: {
        const char* fn = ta == Type::f32   ? op.cuda_f32
                         : ta == Type::f64 ? op.cuda_f64
                                           : op.cuda_i64;
        if (ta == Type::i1 || !*fn) break;
        if (std::string_view(fn) == "/") return fmt::format("({} / {})", a, b);
        return fmt::format("{}({}, {})", fn, a, b);
      }
      case kir::OpForm::Compare:
        if (ta == Type::i1 && v.op != Op::Eq && v.op != Op::Ne)  // icmp slt i1: true is -1
          return fmt::format("(-static_cast<int>({}) {} -static_cast<int>({}))", a, op.cuda_f32, b);
        return fmt::format("({} {} {})", a, op.cuda_f32, b);
      case kir::OpForm::Libm: {
        const kir::LibmTraits& fn = kir::traits(static_cast<kir::Libm>(v.param));
        if (fn.arity == 2) return fmt::format("{}{}({}, {})", fn.name, f32 ? "f" : "", a, b);
        return fmt::format("{}{}({})", fn.name, f32 ? "f" : "", a);
      }
      case kir::OpForm::Special:
        break;
    }
    switch (v.op) {
      case Op::Const:
        return constant(v.type, v.imm);
      case Op::Load:
        return load(v);
      case Op::Accumulated:
        return fmt::format("acc{}", v.param);
      case Op::Scalar:
        return convert(fmt::format("s{}", v.param), Type::f64, v.type);
      case Op::Neg:
        if (is_float(ta)) return fmt::format("-{}", a);
        if (ta == Type::i64) return fmt::format("mt_sub_i64(0, {})", a);
        break;
      case Op::Or:
        return fmt::format("({} || {})", a, b);
      case Op::Select:
        return fmt::format("({} ? {} : {})", a, b, operand(v.c));
      case Op::IsNan:
        return fmt::format("({} != {})", a, a);
      case Op::Sqrt:
        return fmt::format("{}({})", f32 ? "__fsqrt_rn" : "__dsqrt_rn", a);
      case Op::Ldexp:  // math::ldexp, with the same two exact factors
        return f32 ? fmt::format("mt_ldexp_f32({}, {})", a, b)
                   : fmt::format("mt_ldexp_f64({}, {})", a, b);
      case Op::Convert:
        return convert(a, ta, v.type);
      case Op::RoundTo:
        return round_to(v, a, ta);
      default:  // Arith, Compare and Libm ops: above
        break;
    }
    fail("cuda emitter: kernel {}: {} of {} is not supported", k_.name, kir::op_name(v.op),
         cuda_type(ta));
  }

  void stores(const std::vector<kir::Store>& list) {
    for (const kir::Store& s : list) store(s, names_[s.value]);
  }

  std::string init(const kir::Reduction& red) const {
    if (red.kind == kir::ReduceKind::Sum) return constant(red.type, 0.0);
    return is_float(red.type) ? neg_infinity(red.type)
                              : integer(std::numeric_limits<int64_t>::min());
  }

  void declare_accumulators() {
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      const kir::Reduction& red = k_.reductions[r];
      line("{} acc{} = {};", cuda_type(red.type), r, init(red));
      if (carries_index(red, plan_)) line("long long acc{}_at = 9223372036854775807LL;", r);
    }
  }

  // acc = acc (+|max) x for the reductions of `pass`, with the reduction's rounding; `at` is the
  // element's inner index.
  void accumulate(int pass, const std::string& at) {
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      const kir::Reduction& red = k_.reductions[r];
      if (red.pass != pass) continue;
      std::string x = names_[red.value];
      if (red.kind == kir::ReduceKind::Sum) {
        if (!is_float(red.type)) {
          line("acc{} = mt_add_i64(acc{}, {});", r, r, x);
          continue;
        }
        std::string sum =
            fmt::format("{}(acc{}, {})", red.type == Type::f32 ? "__fadd_rn" : "__dadd_rn", r, x);
        if (is_half(red.round_to)) sum = round_half(red.round_to, red.type, sum);
        line("acc{} = {};", r, sum);
      } else if (carries_index(red, plan_)) {
        line("mt_max_step_at(acc{}, acc{}_at, {}, {});", r, r, x, at);
      } else if (is_float(red.type)) {
        line("acc{} = mt_max_step(acc{}, {});", r, r, x);
      } else {
        line("acc{} = {} > acc{} ? {} : acc{};", r, x, r, x, r);
      }
    }
  }

  // Folds each lane's accumulators into lane 0's with a fixed shuffle tree, so the result does
  // not depend on timing: lane i takes lane i + offset's partial, which covers later elements.
  void warp_tree(int pass) {
    open("for (int offset = 16; offset > 0; offset >>= 1)");
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      if (k_.reductions[r].pass != pass) continue;
      merge(r, fmt::format("__shfl_down_sync(0xFFFFFFFFu, acc{}, offset)", r),
            fmt::format("__shfl_down_sync(0xFFFFFFFFu, acc{}_at, offset)", r));
    }
    close();
  }

  // acc<r> takes in a partial that covers later elements, `other` (and its index `other_at`).
  void merge(size_t r, const std::string& other, const std::string& other_at) {
    const kir::Reduction& red = k_.reductions[r];
    if (red.kind == kir::ReduceKind::Sum && is_float(red.type))
      line("acc{} = {}(acc{}, {});", r, red.type == Type::f32 ? "__fadd_rn" : "__dadd_rn", r,
           other);
    else if (red.kind == kir::ReduceKind::Sum)
      line("acc{} = mt_add_i64(acc{}, {});", r, r, other);
    else if (carries_index(red, plan_))
      line("mt_max_merge(acc{}, acc{}_at, {}, {});", r, r, other, other_at);
    else
      line("acc{} = mt_max_step(acc{}, {});", r, r, other);
  }

  void epilogue() {
    values(k_.epilogue, "e");
    stores(k_.epilogue_stores);
  }

  // vector_width() points per thread: every identity-mapped buffer is read or written as one
  // pack per thread, the body runs once per lane, and the points past the last whole pack run
  // one per thread as in pointwise().
  void vector_pointwise() {
    int width = vector_width(k_);
    std::vector<bool> packed(k_.params.size(), false);
    for (const Value& v : k_.body)
      if (v.op == Op::Load && kir::is_identity_map(k_, v.map)) packed[v.param] = true;
    for (const kir::Store& st : k_.stores) packed[st.param] = true;
    auto pack = [&](size_t p) {
      return fmt::format("mt_pack<{}, {}>", element_type(k_.params[p].dtype), width);
    };
    line("const long long total = {}, packs = {};", integer(plan_.outer),
         integer(plan_.outer / width));
    line(
        "const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x, "
        "stride = static_cast<long long>(gridDim.x) * blockDim.x;");
    open("for (long long vec = first; vec < packs; vec += stride)");
    for (size_t p = 0; p < k_.params.size(); ++p) {
      if (!packed[p]) continue;
      if (k_.params[p].output)
        line("{} out{};", pack(p), p);
      else
        line("const {} in{} = reinterpret_cast<const {}*>(p{})[vec];", pack(p), p, pack(p), p);
    }
    line("#pragma unroll");
    open(fmt::format("for (int lane = 0; lane < {}; ++lane)", width));
    width_ = width;
    values(k_.body, "v");
    stores(k_.stores);
    width_ = 1;
    close();
    for (size_t p = 0; p < k_.params.size(); ++p)
      if (packed[p] && k_.params[p].output)
        line("reinterpret_cast<{}*>(p{})[vec] = out{};", pack(p), p, p);
    close();
    open("for (long long point = packs * " + integer(width) +
         " + first; point < total; point += stride)");
    coordinates("point", 0, static_cast<int>(k_.dims.size()));
    values(k_.body, "v");
    stores(k_.stores);
    close();
  }

  void pointwise() {
    if (vector_width(k_) > 1) return vector_pointwise();
    line("const long long total = {};", integer(plan_.outer));
    open(
        "for (long long point = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; "
        "point < total;\n       point += static_cast<long long>(gridDim.x) * blockDim.x)");
    coordinates("point", 0, static_cast<int>(k_.dims.size()));
    values(k_.body, "v");
    stores(k_.stores);
    close();
  }

  // emit_cuda.h's multi-tensor ABI: the segment table arrives by value (a reduction's workspace
  // after it). Pointwise, each segment runs the grid-stride loop of a rank-1 kernel over its own
  // extent; a reduction gives each segment blocks by its size (multi_tensor_reduce).
  void multi_tensor() {
    if (k_.dims.size() != 1 || (k_.is_reduction() && k_.reduce_from != 0))
      fail("cuda emitter: multi-tensor kernel {} is neither rank-1 pointwise nor a whole reduction",
           k_.name);
    int64_t capacity = cuda_multi_tensor_capacity(k_);
    std::string table = k_.name + "_segments";
    out_ += fmt::format(
        "// mixtape kernel {}: multi-tensor {}, up to {} segments a launch\n", k_.name,
        k_.is_reduction() ? "reduction, blocks by segment size" : "pointwise", capacity);
    out_ += fmt::format("struct {} {{\n  long long count;\n  long long start[{}];\n", table,
                        capacity + 1);
    if (k_.is_reduction()) out_ += fmt::format("  long long first_block[{}];\n", capacity + 1);
    out_ += fmt::format("  void* pointer[{}][{}];\n", capacity, k_.params.size());
    if (k_.scalars > 0) out_ += fmt::format("  double scalar[{}][{}];\n", capacity, k_.scalars);
    out_ += "};\n";
    out_ += fmt::format(
        "extern \"C\" __global__ void __launch_bounds__({}) {}(const {} table{}) {{\n", plan_.block,
        k_.name, table, k_.is_reduction() ? ", unsigned char* __restrict__ workspace" : "");
    indent_ = 1;
    if (k_.is_reduction()) {
      multi_tensor_reduce();
    } else {
      open("for (long long seg = 0; seg < table.count; ++seg)");
      line("const long long total = table.start[seg + 1] - table.start[seg];");
      bind_segment();
      open(
          "for (long long point = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; "
          "point < total;\n       point += static_cast<long long>(gridDim.x) * blockDim.x)");
      line("const long long i0 = point;");
      values(k_.body, "v");
      stores(k_.stores);
      close();
      close();
    }
    out_ += "}\n";
  }

  // A multi-tensor segment's pointers and scalars, under the names ordinary kernels' have.
  void bind_segment() {
    for (size_t p = 0; p < k_.params.size(); ++p) {
      const kir::Param& param = k_.params[p];
      std::string type =
          fmt::format("{}{}*", param.output ? "" : "const ", element_type(param.dtype));
      line("{} __restrict__ p{} = static_cast<{}>(table.pointer[seg][{}]);", type, p, type, p);
    }
    for (int32_t slot = 0; slot < k_.scalars; ++slot)
      line("const double s{} = table.scalar[seg][{}];", slot, slot);
  }

  void thread_reduce() {
    int split = k_.reduce_from, rank = static_cast<int>(k_.dims.size());
    line("const long long outer_total = {}, inner_total = {};", integer(plan_.outer),
         integer(plan_.inner));
    open(
        "for (long long outer = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; "
        "outer < outer_total;\n       outer += static_cast<long long>(gridDim.x) * blockDim.x)");
    coordinates("outer", 0, split);
    declare_accumulators();
    for (int pass = 0; pass < k_.pass_count(); ++pass) {
      if (pass > 0) line("// pass {}: reads the reductions of the passes before", pass);
      open("for (long long inner = 0; inner < inner_total; ++inner)");
      coordinates("inner", split, rank);
      values(k_.pass_body(pass), "v");
      stores(k_.pass_stores(pass));
      accumulate(pass, "inner");
      close();
    }
    epilogue();
    close();
  }

  // One sweep of the block's threads over the inner points: pass `pass`'s values, stores and
  // per-thread partials.
  void block_pass(int pass, int split, int rank, const std::string& begin = "0",
                  const std::string& end = "inner_total") {
    if (pass > 0) line("// pass {}: reads the reductions of the passes before", pass);
    // A blockDim.x stride (== the block size above) rather than the constant: NVRTC 13.0 crashes
    // on a constant-stride inner loop inside the grid-stride outer loop for some kernels.
    open(fmt::format("for (long long inner = {}threadIdx.x; inner < {}; inner += blockDim.x)",
                     begin == "0" ? "" : begin + " + ", end));
    coordinates("inner", split, rank);
    values(k_.pass_body(pass), "v");
    stores(k_.pass_stores(pass));
    accumulate(pass, "inner");
    close();
    warp_tree(pass);
  }

  // Every pass but the last: the reductions of `pass` are folded as in the last pass, then every
  // thread of the block takes the result, which later passes read.
  void broadcast(int pass, uint32_t warps) {
    std::vector<size_t> reduced;
    for (size_t r = 0; r < k_.reductions.size(); ++r)
      if (k_.reductions[r].pass == pass) reduced.push_back(r);
    if (warps == 1) {
      for (size_t r : reduced) line("acc{} = __shfl_sync(0xFFFFFFFFu, acc{}, 0);", r, r);
      return;
    }
    fold_partials(pass, warps);
    open("if (lane == 0)");
    for (size_t r : reduced) line("partial{}[0] = acc{};", r, r);
    close();
    close();
    line("__syncthreads();");
    for (size_t r : reduced) line("acc{} = partial{}[0];", r, r);
    line("__syncthreads();  // the partials are rewritten by the next pass");
  }

  // Warps' lane 0 leave their partials of `pass` in shared memory; warp 0 folds them in warp
  // order. Leaves the `if (warp == 0)` scope open.
  void fold_partials(int pass, uint32_t warps) {
    open("if (lane == 0)");
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      if (k_.reductions[r].pass != pass) continue;
      line("partial{}[warp] = acc{};", r, r);
      if (carries_index(k_.reductions[r], plan_)) line("partial{}_at[warp] = acc{}_at;", r, r);
    }
    close();
    line("__syncthreads();");
    open("if (warp == 0)");
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      const kir::Reduction& red = k_.reductions[r];
      if (red.pass != pass) continue;
      line("acc{} = lane < {} ? partial{}[lane] : {};", r, warps, r, init(red));
      if (carries_index(red, plan_))
        line("acc{}_at = lane < {} ? partial{}_at[lane] : 9223372036854775807LL;", r, warps, r);
    }
    warp_tree(pass);
  }

  void block_reduce() {
    if (plan_.chunks > 1) return split_reduce();
    int split = k_.reduce_from, rank = static_cast<int>(k_.dims.size());
    uint32_t warps = plan_.block / warp_size;
    line("// Launched with exactly {} threads per block.", plan_.block);
    line("const long long outer_total = {}, inner_total = {};", integer(plan_.outer),
         integer(plan_.inner));
    if (warps > 1) {
      line("const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;");
      for (size_t r = 0; r < k_.reductions.size(); ++r) {
        line("__shared__ {} partial{}[{}];", cuda_type(k_.reductions[r].type), r, warps);
        if (carries_index(k_.reductions[r], plan_))
          line("__shared__ long long partial{}_at[{}];", r, warps);
      }
    }
    open("for (long long outer = blockIdx.x; outer < outer_total; outer += gridDim.x)");
    coordinates("outer", 0, split);
    declare_accumulators();
    int last = k_.pass_count() - 1;
    for (int pass = 0; pass < last; ++pass) {
      block_pass(pass, split, rank);
      broadcast(pass, warps);
    }
    block_pass(last, split, rank);
    if (warps == 1) {
      open("if (threadIdx.x == 0)");
      epilogue();
      close();
      close();
      return;
    }
    fold_partials(last, warps);
    open("if (lane == 0)");
    epilogue();
    close();
    close();
    line("__syncthreads();  // the partials are rewritten for the next outer point");
    close();
  }

  // LaunchPlan::chunks blocks per outer point, each over its chunk of the inner points
  // (fold_chunks).
  void split_reduce() {
    int split = k_.reduce_from, rank = static_cast<int>(k_.dims.size());
    uint32_t warps = plan_.block / warp_size;
    std::string chunks = integer(plan_.chunks);
    line("// Launched with exactly {} threads per block, {} blocks.", plan_.block, plan_.grid);
    line("const long long inner_total = {}, chunk_points = {};", integer(plan_.inner),
         integer(plan_.chunk_points));
    line("const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;");
    declare_shared_partials(warps);
    declare_workspace(integer(plan_.outer * plan_.chunks));
    line("const long long outer = blockIdx.x / {}, chunk = blockIdx.x % {};", chunks, chunks);
    chunk_range();
    coordinates("outer", 0, split);
    declare_accumulators();
    block_pass(0, split, rank, "chunk_begin", "chunk_end");
    fold_partials(0, warps);
    fold_chunks("outer", "outer * " + chunks, chunks);
  }

  // The shared partials of a block's warps (one per lane of each with `per_lane`).
  void declare_shared_partials(uint32_t warps, bool per_lane = false) {
    std::string lanes = per_lane ? "[32]" : "";
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      line("__shared__ {} partial{}[{}]{};", cuda_type(k_.reductions[r].type), r, warps, lanes);
      if (carries_index(k_.reductions[r], plan_))
        line("__shared__ long long partial{}_at[{}]{};", r, warps, lanes);
    }
  }

  // The workspace's arrays (Workspace), of `words` words each.
  void declare_workspace(const std::string& words) {
    Workspace w = workspace(k_, plan_);
    auto array = [&](int index) {
      return index == 0 ? std::string("workspace")
                        : fmt::format("workspace + {} * {}", 8 * index, words);
    };
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      std::string type = cuda_type(k_.reductions[r].type);
      line("{}* const chunk_partial{} = reinterpret_cast<{}*>({});", type, r, type,
           array(w.partial[r]));
      if (w.at[r] >= 0)
        line("long long* const chunk_partial{}_at = reinterpret_cast<long long*>({});", r,
             array(w.at[r]));
    }
    line("unsigned* const arrivals = reinterpret_cast<unsigned*>({});", array(w.arrays));
  }

  // This block's share of the inner points, from `chunk` and `chunk_points`.
  void chunk_range() {
    line("const long long chunk_begin = chunk * chunk_points;");
    line("const long long chunk_end =");
    line(
        "    chunk_begin + chunk_points < inner_total ? chunk_begin + chunk_points : inner_total;");
  }

  // A block of a split reduction, inside warp 0 once it holds the block's result (in lane 0;
  // with `per_lane`, each lane its column's): the result goes to the workspace, and the block
  // that finds itself the last of `point`'s `chunks` blocks to arrive folds their partials (from
  // block `first` on) in chunk order: lane l takes chunks l, l + 32, ..., then the warp tree
  // (per lane: every chunk of its own column in turn), so the result does not depend on which
  // block came last. It runs the epilogue and zeroes what it read, leaving the workspace as the
  // next launch needs it.
  void fold_chunks(const std::string& point, const std::string& first, const std::string& chunks,
                   bool per_lane = false) {
    Workspace w = workspace(k_, plan_);
    std::string slot = per_lane ? "blockIdx.x * 32 + lane" : "blockIdx.x";
    line("int last = 0;");
    if (!per_lane) open("if (lane == 0)");
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      line("chunk_partial{}[{}] = acc{};", r, slot, r);
      if (w.at[r] >= 0) line("chunk_partial{}_at[{}] = acc{}_at;", r, slot, r);
    }
    line("__threadfence();  // the partials are visible before the count says so");
    if (per_lane) line("__syncwarp();  // every lane's, before lane 0 counts the block");
    line("{}last = atomicAdd(&arrivals[{}], 1u) + 1u == static_cast<unsigned>({});",
         per_lane ? "if (lane == 0) " : "", point, chunks);
    if (!per_lane) close();
    line("last = __shfl_sync(0xFFFFFFFFu, last, 0);");
    open("if (last)");
    line("__threadfence();");
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      line("acc{} = {};", r, init(k_.reductions[r]));
      if (w.at[r] >= 0) line("acc{}_at = 9223372036854775807LL;", r);
    }
    if (per_lane) {
      open(fmt::format("for (long long c = 0; c < {}; ++c)", chunks));
      line("const long long at = ({} + c) * 32 + lane;", first);
    } else {
      open(fmt::format("for (long long c = lane; c < {}; c += 32)", chunks));
      line("const long long at = {} + c;", first);
    }
    for (size_t r = 0; r < k_.reductions.size(); ++r) {
      line("const {} chunk{} = __ldcg(&chunk_partial{}[at]);", cuda_type(k_.reductions[r].type), r,
           r);
      line("chunk_partial{}[at] = 0;", r);
      if (w.at[r] >= 0) {
        line("const long long chunk{}_at = __ldcg(&chunk_partial{}_at[at]);", r, r);
        line("chunk_partial{}_at[at] = 0;", r);
      }
      merge(r, fmt::format("chunk{}", r), fmt::format("chunk{}_at", r));
    }
    close();
    if (per_lane) {
      line("if (lane == 0) arrivals[{}] = 0u;  // ready for the next launch", point);
      open("if (active)");
    } else {
      warp_tree(0);
      open("if (lane == 0)");
      line("arrivals[{}] = 0u;  // ready for the next launch", point);
    }
    epilogue();
    close();
    close();
    close();
  }

  // Column tiles: block b takes 32 consecutive columns of one tile (lane l column l, those past
  // the last column idle) and its chunk of their rows, which the warps share (warp w rows w,
  // w + 8, ...), so each warp reads 32 neighbouring elements at a time. The warps' partials of
  // each column fold in warp order through shared memory; with several chunks, each block's go
  // to the workspace and the tile's last block to arrive folds them in chunk order, lane by
  // lane. Every column's result is then the same whichever block came last.
  void column_tiles() {
    int split = k_.reduce_from, rank = static_cast<int>(k_.dims.size());
    uint32_t warps = plan_.block / warp_size;
    std::string chunks = integer(plan_.chunks);
    int64_t tiles_per_row = (plan_.columns + warp_size - 1) / warp_size;
    line("// Launched with exactly {} threads per block, {} blocks.", plan_.block, plan_.grid);
    line("const long long inner_total = {}, chunk_points = {};", integer(plan_.inner),
         integer(plan_.chunk_points));
    line("const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;");
    line("const long long tile = blockIdx.x / {}, chunk = blockIdx.x % {};", chunks, chunks);
    line("const long long column = tile % {} * 32 + lane;", integer(tiles_per_row));
    line("const bool active = column < {};", integer(plan_.columns));
    line("const long long outer = tile / {} * {} + column;", integer(tiles_per_row),
         integer(plan_.columns));
    chunk_range();
    coordinates("outer", 0, split);
    declare_accumulators();
    open("if (active)");
    // A blockDim.x / 32 stride rather than the constant, as block_pass explains.
    open("for (long long inner = chunk_begin + warp; inner < chunk_end; inner += blockDim.x / 32)");
    coordinates("inner", split, rank);
    values(k_.pass_body(0), "v");
    stores(k_.pass_stores(0));
    accumulate(0, "inner");
    close();
    close();
    declare_shared_partials(warps, true);
    for (size_t r = 0; r < k_.reductions.size(); ++r) line("partial{}[warp][lane] = acc{};", r, r);
    line("__syncthreads();");
    open("if (warp == 0)");
    open(fmt::format("for (int w = 1; w < {}; ++w)", warps));
    for (size_t r = 0; r < k_.reductions.size(); ++r)
      merge(r, fmt::format("partial{}[w][lane]", r), "");
    close();
    if (plan_.chunks == 1) {
      open("if (active)");
      epilogue();
      close();
      close();
      return;
    }
    declare_workspace(integer(plan_.tiles * plan_.chunks * warp_size));
    fold_chunks("tile", "tile * " + chunks, chunks, true);
  }

  // A multi-tensor reduction: segment s has the blocks [first_block[s], first_block[s + 1]),
  // each over a chunk of its elements, folded as in split_reduce.
  void multi_tensor_reduce() {
    uint32_t warps = plan_.block / warp_size;
    line("// Launched with exactly {} threads per block, table.first_block[table.count] blocks.",
         plan_.block);
    line("const long long blocks = table.first_block[table.count];");
    line("const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;");
    declare_shared_partials(warps);
    declare_workspace("blocks");
    line("long long seg = 0;");
    line("while (table.first_block[seg + 1] <= blockIdx.x) ++seg;");
    line("const long long chunks = table.first_block[seg + 1] - table.first_block[seg];");
    line("const long long chunk = blockIdx.x - table.first_block[seg];");
    line("const long long inner_total = table.start[seg + 1] - table.start[seg];");
    line("const long long chunk_points = (inner_total + chunks - 1) / chunks;");
    chunk_range();
    bind_segment();
    declare_accumulators();
    block_pass(0, 0, 1, "chunk_begin", "chunk_end");
    fold_partials(0, warps);
    fold_chunks("seg", "table.first_block[seg]", "chunks");
  }

  const kir::Kernel& k_;
  LaunchPlan plan_;
  std::string out_;
  std::vector<std::string> names_;
  std::vector<bool> used_;
  int indent_ = 0;
  int width_ = 1;  // inside a vectorized loop: loads and stores of identity maps use packs
};

}  // namespace

std::string emit_cuda(const kir::Kernel& kernel) { return Emitter(kernel).run(); }

const char* cuda_prelude() { return prelude; }

const char* cuda_element_type(DType dtype) { return element_type(dtype); }

CudaLaunch cuda_launch_shape(const kir::Kernel& kernel) {
  LaunchPlan p = plan(kernel);
  return CudaLaunch{p.grid, p.block, 0, static_cast<uint64_t>(split_workspace_bytes(kernel, p))};
}

int64_t cuda_multi_tensor_capacity(const kir::Kernel& kernel) {
  // count, start[capacity + 1] (and for a reduction first_block[capacity + 1]), then a pointer
  // per param and a double per scalar per segment, all 8-byte words, within the 4 KiB every
  // architecture takes as kernel parameters.
  int64_t arrays = kernel.is_reduction() ? 2 : 1;
  int64_t words_per_segment = arrays + static_cast<int64_t>(kernel.params.size()) + kernel.scalars;
  return (cuda_multi_tensor_table_bytes / 8 - 1 - arrays) / words_per_segment;
}

std::vector<CudaSegmentTable> cuda_multi_tensor_tables(const kir::Kernel& kernel,
                                                       std::span<const int64_t> starts,
                                                       std::span<const uint64_t> pointers,
                                                       std::span<const double> scalars) {
  int64_t capacity = cuda_multi_tensor_capacity(kernel);
  int64_t params = static_cast<int64_t>(kernel.params.size()), slots = kernel.scalars;
  int64_t segments = static_cast<int64_t>(starts.size()) - 1;
  if (segments < 0 || static_cast<int64_t>(pointers.size()) != segments * params ||
      static_cast<int64_t>(scalars.size()) != segments * slots)
    fail("multi-tensor kernel {}: {} starts, {} pointers and {} scalars do not make segments",
         kernel.name, starts.size(), pointers.size(), scalars.size());
  bool reduction = kernel.is_reduction();
  // A reduction's segment takes a block per multi_tensor_chunk_points elements (at least one),
  // and a launch at most max_reduction_grid blocks.
  auto blocks_of = [&](int64_t s) {
    int64_t extent = starts[s + 1] - starts[s];
    return std::clamp<int64_t>((extent + multi_tensor_chunk_points - 1) / multi_tensor_chunk_points,
                               1, max_reduction_grid);
  };
  std::vector<CudaSegmentTable> tables;
  for (int64_t first = 0; first < segments;) {
    int64_t count = 0, blocks = 0;
    for (; first + count < segments && count < capacity; ++count) {
      int64_t more = reduction ? blocks_of(first + count) : 0;
      if (count > 0 && blocks + more > max_reduction_grid) break;
      blocks += more;
    }
    CudaSegmentTable table;
    table.segments = count;
    table.words.assign(cuda_multi_tensor_table_bytes / 8, 0);
    uint64_t* start_words = table.words.data() + 1;
    uint64_t* block_words = start_words + capacity + 1;
    uint64_t* pointer_words = block_words + (reduction ? capacity + 1 : 0);
    uint64_t* scalar_words = pointer_words + capacity * params;
    table.words[0] = static_cast<uint64_t>(table.segments);
    for (int64_t s = 0; s < table.segments; ++s) {
      int64_t at = first + s;
      start_words[s + 1] = static_cast<uint64_t>(starts[at + 1] - starts[first]);
      if (reduction) {
        table.blocks += blocks_of(at);
        block_words[s + 1] = static_cast<uint64_t>(table.blocks);
      }
      table.largest = std::max(table.largest, starts[at + 1] - starts[at]);
      for (int64_t p = 0; p < params; ++p)
        pointer_words[s * params + p] = pointers[at * params + p];
      for (int64_t k = 0; k < slots; ++k)
        std::memcpy(&scalar_words[s * slots + k], &scalars[at * slots + k], 8);
    }
    if (reduction)
      table.workspace_bytes = static_cast<uint64_t>(
          workspace(kernel, plan(kernel)).bytes(table.blocks, table.segments));
    tables.push_back(std::move(table));
    first += count;
  }
  return tables;
}

CudaLaunch cuda_multi_tensor_launch(const kir::Kernel& kernel, const CudaSegmentTable& table) {
  if (kernel.is_reduction())
    return CudaLaunch{static_cast<uint32_t>(table.blocks), max_block, 0, table.workspace_bytes};
  return CudaLaunch{clamp_grid((table.largest + max_block - 1) / max_block, max_pointwise_grid),
                    max_block, 0, 0};
}

}  // namespace mixtape
