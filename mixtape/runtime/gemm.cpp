// mixtape/runtime/gemm.cpp -- the CPU matmul back end: oneDNN matmul primitives, cached per
// problem.
#include "mixtape/runtime/gemm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>

#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "mixtape/dsl/error.h"
#include "mixtape/dsl/half.h"
#include "mixtape/dsl/log.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/gemm_bf16.h"
#include "mixtape/runtime/half_convert.h"
#include "mixtape/runtime/onednn_team.h"
#include "mixtape/runtime/scratch_buffer.h"

// Findings about oneDNN 2.6 (Debian 2.6.3) on an Intel CPU with AVX512-BF16 and AVX512-FP16 but no
// AMX that shape the choices below:
// - Matmul supports f32 x f32 -> f32 and bf16 x bf16 -> f32/bf16 only: no f16 operands (the
//   AVX512-FP16 units go unused), and no f16 or bf16 destination for f32 operands. So f16
//   operands are widened to f32 (exactly: every f16 is an f32 and f16 * f16 products are exact in
//   f32), and half results are rounded here from an f32 destination with dsl/half.h.
// - Its bf16 destination rounds to nearest even like dsl/half.h for normal values, but the bf16
//   kernel (VDPBF16PS) treats subnormal operands and products as zero. Rounding here keeps one
//   code path for both half types and keeps f32 subnormal sums of the f32 kernel exact.
// - How fast its bf16 kernel is depends on the CPU, not on oneDNN. On that Intel CPU VDPBF16PS
//   runs at half the f32 FMA rate in flops, so for large enough matrices widening bf16 operands to
//   f32 is faster despite the conversion pass. On an AMD EPYC (Zen 4) it runs at twice the FMA
//   rate, and the same bf16 matmul reached 0.71-0.95 of one core's bf16 peak where the widened one
//   reached 0.34-0.46. So Bf16Kernel::automatic measures the two rates once (gemm_bf16.h) and
//   keeps bf16 operands bf16 where dot products are the faster; only then does it pick by shape.
// - Around a small product (256x64x64: about 4 us at the bf16 peak of one Zen 4 core) oneDNN
//   spends a good part of its time outside its kernel; mixtape's own VDPBF16PS tile
//   (gemm_bf16.h), which packs B and runs, takes those on CPUs where bf16 dot products are fast.
// - On a CPU with AMX (Sapphire Rapids and later, with Linux granting the tile state, which oneDNN
//   asks for) the same bf16 matmul runs on AMX tiles (its implementation "brg:avx512_core_amx..."),
//   4 to 8 times faster than the f32 kernel at every shape measured, from 256x64x64 to 2048^3
//   (bench_gemm: 1.4 TFLOP/s at 256^3 on one core against 190 for f32), so there
//   Bf16Kernel::automatic takes it for every shape oneDNN runs on AMX. TDPBF16PS flushes
//   subnormal operands and results like VDPBF16PS.
// - Its relu post-op is max(x, 0), which turns NaN into 0, where the reference keeps NaN (and the
//   loss scaler's overflow check relies on seeing it), so relu runs here, fused with the rounding
//   to half outputs (a separate pass only for f32 outputs).
// - Its library-managed scratchpad is shared by all primitives unless the library was built for
//   concurrent execution, so primitives are made with a user scratchpad, owned by each calling
//   thread, which makes concurrent gemm calls safe.

namespace mixtape {
namespace {

using OnednnType = dnnl::memory::data_type;

// Bf16Kernel::automatic widens bf16 operands when the matmul does at least this many flops per
// widened operand element, 2mn / (m + n). Measured per core here (best of 7, GFLOP/s widened vs
// native): 128^3 (128) 135 vs 107, 4096x64x64 (126) 165 vs 101, 64x1024x1024 (120) 118 vs 99,
// 1024^3 (1024) 112 vs 67; 32x1024x1024 (62) 90 vs 98, 64^3 (64) 74 vs 88, 8x1024x1024 (16)
// 35 vs 67, 1x1024x1024 (2) 4 vs 17.
constexpr double kWidenBf16MinFlopsPerElement = 96.0;

// Products below about 20 us of one core's work run on the calling thread alone: splitting them
// saves less than an OpenMP fork and join costs on a loaded machine, where a descheduled team
// member stalls the whole region (digits_mlp's 64x64x128 products: 710 steps/s split over 2
// threads against 1810 on one, at load 4 on 2 cores). In flops that is 2^22 for the f32 kernel
// (about 200 GFLOP/s a core) and 2^24 on AMX tiles (about 1,000 at these sizes). With 2^24 for
// both, the demo's 256x128x128 f32 products ran on one thread: 10% fewer steps/s.
constexpr double kSingleThreadMaxFlops = double{1 << 22};

// Bf16Kernel::automatic runs products of at most this many flops (all batches) with at least 64
// columns, or at least 32 columns and at most 128 rows, on the own kernel, where bf16 dot products
// are fast: below kSingleThreadMaxFlops, so oneDNN would run them on one thread too. CPU time per
// product, one thread, as a fraction of the bf16 peak (545 GFLOP/s), own vs oneDNN, on the AMD
// EPYC of bench/README.md (load 2-4, 2-3 runs):
// - ahead: 16x64x64 0.80 vs 0.40, 32x32x64 0.6-0.8 vs 0.40, 64x64x128 0.92-0.96 vs 0.77-0.84,
//   128x64x128 0.94-0.99 vs 0.87-0.89, 256x64x64 0.94-0.96 vs 0.87-0.92, 512x64x32 0.92-0.94 vs
//   0.86-0.89, 1024x32x32 0.80-0.87 vs 0.69-0.73; a transposed (packed like b): 64x64x256
//   0.79-0.82 vs 0.74, 256x64x64 0.84-0.89 vs 0.77-0.82; b transposed (a 16x16 word transpose):
//   64x64x128 0.87-0.92 vs 0.80-0.84, 128x64x64 0.92-0.96 vs 0.80-0.84, 256x64x64 0.94-0.96 vs
//   0.89-0.94, 32x64x64 0.80 vs 0.53, 256x32x64 0.84-0.87 vs 0.80;
// - behind: 32 columns from 256 rows, b untransposed (512x32x64 0.80-0.82 vs 0.84-0.89,
//   256x32x128 0.84-0.89 vs 0.87-0.92: 8 accumulators a row); 256x10x64 0.35 vs 0.40 (one vector
//   of columns leaves 6 accumulators, too few to hide VDPBF16PS's latency).
//
// Larger products with at least 64 columns and k up to 128 (one k block of the own kernel, so its
// bf16 result is rounded in registers and written once) run on it too, on the team: it reaches
// oneDNN's rate there, and oneDNN's f32 result and the separate pass that rounds it to bf16 cost
// about a tenth of mlp_w64_b4096's bf16 step. CPU time per product, one thread, own vs oneDNN
// (f32 results, load 6-8): 4096x64x64 0.92 vs 0.90, b transposed 0.91 vs 0.91; 4096x64x16 0.77
// vs 0.66; 4096x64x32 b transposed 0.88 vs 0.85; 768x512x128 0.96 vs 0.96, b transposed 0.94 vs
// 0.96; 768x384x128 b transposed 0.95 vs 0.96; 768x128x128 0.94 vs 0.94, b transposed 0.93 vs
// 0.90; 48 x 64x64x32 b transposed 0.78 vs 0.76. Behind at 16 columns (4096x16x64 b transposed
// 0.59 vs 0.77), which stay with oneDNN.
constexpr int64_t kOwnBf16MaxDepth = 128;
constexpr int64_t kOwnBf16WideColumns = 64;
constexpr int64_t kOwnBf16MinColumns = 32;
constexpr int64_t kOwnBf16MaxRowsWhenNarrow = 128;
constexpr double kOwnBf16MaxFlops = double{1 << 21};
constexpr double kAmxSingleThreadMaxFlops = double{1 << 24};

// Per thread, so that concurrent calls never share a buffer and need no lock.
struct ThreadScratch {
  ScratchBuffer a, b, bias, result, onednn, partials;
  // While a product runs in row pieces (run_in_chunks), which all read the same b: that b
  // (nullptr otherwise) and the row stride of its f32 copy in `b` (-1: not made yet), so that
  // each piece does not widen it again.
  const void* shared_b = nullptr;
  int64_t shared_b_stride = -1;
  void trim() {
    for (ScratchBuffer* buffer : {&a, &b, &bias, &result, &onednn, &partials}) buffer->trim();
  }
};

ThreadScratch& thread_scratch() {
  thread_local ThreadScratch scratch;
  return scratch;
}

// Everything a oneDNN matmul primitive depends on. f16 and widened bf16 operands reach oneDNN as
// f32, and the destination is f32 (bf16 only for an AMX product's bf16 result, see choose()), so
// those share primitives with f32 problems.
struct PrimitiveKey {
  int64_t batch, m, n, k;
  bool transpose_a, transpose_b;
  int64_t a_row_stride, b_row_stride;  // elements between the stored rows of a and of b
  OnednnType operand;
  OnednnType result;
  bool has_bias;
  auto operator<=>(const PrimitiveKey&) const = default;
};

struct CachedPrimitive {
  dnnl::matmul matmul;
  dnnl::memory::desc a, b, bias, result, scratchpad;
  std::string implementation;  // oneDNN's name for the kernel it picked, e.g. "brg:avx512_core"
  bool amx = false;            // that kernel runs on AMX tiles (read on every call)
  uint64_t id = 0;  // unique for the process's life (a cleared cache's addresses are reused)
};

struct Backend {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;  // guards cache
  std::map<PrimitiveKey, std::shared_ptr<const CachedPrimitive>> cache;
  std::set<std::string> logged_choices;  // MIXTAPE_LOG=profile: each choice is logged once
};

// Never destroyed: oneDNN's own globals may be gone by the time static destructors run.
Backend& backend() {
  static Backend* const instance = new Backend;
  return *instance;
}

std::string describe(const GemmDesc& d) {
  std::string text = fmt::format("gemm(batch {}, m {}, n {}, k {}, a {}{}, b {}{}, out {}", d.batch,
                                 d.m, d.n, d.k, name(d.operand), d.transpose_a ? " transposed" : "",
                                 name(d.operand), d.transpose_b ? " transposed" : "", name(d.out));
  if (d.has_bias) text += fmt::format(", bias {}", name(d.bias_type));
  if (d.has_bias && d.product_type != f32)
    text += fmt::format(" added after rounding to {}", name(d.product_type));
  if (d.relu) text += ", relu";
  return text + ")";
}

bool is_gemm_float(DType t) { return t == f32 || t == bf16 || t == f16; }

// A row-major [batch,] rows x cols operand, or its transpose stored as cols x rows, with its
// stored rows row_stride elements apart.
dnnl::memory::desc matrix_desc(int64_t batch, int64_t rows, int64_t cols, bool transposed,
                               OnednnType type, int64_t row_stride) {
  const dnnl::memory::dims inner =
      transposed ? dnnl::memory::dims{1, row_stride} : dnnl::memory::dims{row_stride, 1};
  if (batch == 1) return dnnl::memory::desc({rows, cols}, type, inner);
  const int64_t stored_rows = transposed ? cols : rows;
  return dnnl::memory::desc({batch, rows, cols}, type,
                            {stored_rows * row_stride, inner[0], inner[1]});
}

std::shared_ptr<const CachedPrimitive> create_primitive(const PrimitiveKey& key) {
  const Backend& state = backend();
  auto made = std::make_shared<CachedPrimitive>();
  made->a = matrix_desc(key.batch, key.m, key.k, key.transpose_a, key.operand, key.a_row_stride);
  made->b = matrix_desc(key.batch, key.k, key.n, key.transpose_b, key.operand, key.b_row_stride);
  made->result = matrix_desc(key.batch, key.m, key.n, false, key.result, key.n);
  if (key.has_bias)  // one row, broadcast over rows and batches
    made->bias = key.batch == 1
                     ? dnnl::memory::desc({1, key.n}, OnednnType::f32, {key.n, 1})
                     : dnnl::memory::desc({1, 1, key.n}, OnednnType::f32, {key.n, key.n, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(made->a, made->b, made->bias, made->result),
                                  attr, state.engine);
  made->scratchpad = pd.scratchpad_desc();
  made->implementation = pd.impl_info_str();
  made->amx = made->implementation.find("amx") != std::string::npos;
  made->matmul = dnnl::matmul(pd);
  static std::atomic<uint64_t> next_id{1};
  made->id = next_id++;
  return made;
}

std::shared_ptr<const CachedPrimitive> cached_primitive(const PrimitiveKey& key) {
  Backend& state = backend();
  {
    std::lock_guard lock(state.mutex);
    auto found = state.cache.find(key);
    if (found != state.cache.end()) return found->second;
  }
  // Built outside the lock (JIT compilation takes a while); a racing thread's copy is dropped.
  // Made under the team settings it runs under (onednn_team.h): oneDNN may plan a primitive's
  // work split when it makes it, as its convolutions do.
  std::shared_ptr<const CachedPrimitive> made;
  {
    OnednnTeam threads(false);
    made = create_primitive(key);
  }
  std::lock_guard lock(state.mutex);
  return state.cache.emplace(key, std::move(made)).first->second;
}

// Whether oneDNN may use AMX on this machine at all (the CPU has it and the kernel granted the tile
// state): elsewhere no bf16 primitive is made just to ask which kernel it would run.
bool onednn_may_use_amx() {
  static const bool amx = dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx;
  return amx;
}

// The stored rows of a and b: [batch x rows, cols] (a transposed operand's rows are its columns).
struct StoredRows {
  int64_t rows, cols;
};
StoredRows stored_a(const GemmDesc& d) {
  return d.transpose_a ? StoredRows{d.batch * d.k, d.m} : StoredRows{d.batch * d.m, d.k};
}
StoredRows stored_b(const GemmDesc& d) {
  return d.transpose_b ? StoredRows{d.batch * d.n, d.k} : StoredRows{d.batch * d.k, d.n};
}

PrimitiveKey primitive_key(const GemmDesc& d, OnednnType operand,
                           OnednnType result = OnednnType::f32, int64_t a_row_stride = 0,
                           int64_t b_row_stride = 0) {
  return {d.batch,
          d.m,
          d.n,
          d.k,
          d.transpose_a,
          d.transpose_b,
          a_row_stride > 0 ? a_row_stride : stored_a(d).cols,
          b_row_stride > 0 ? b_row_stride : stored_b(d).cols,
          operand,
          result,
          d.has_bias};
}

// The kernel for a product: widened (f32 operands) or oneDNN's bf16 one, and its primitive. The
// choice depends only on the description and the machine, so a shape always runs the same kernel
// and gives the same bits.
struct Choice {
  bool own = false;  // gemm_bf16_own, no primitive
  bool widen = false;
  bool bf16_result = false;  // oneDNN writes the bf16 result itself: there is no epilogue pass
  std::shared_ptr<const CachedPrimitive> primitive;
  // Where set, the operand is copied for oneDNN's f32 kernel with its rows this many elements
  // apart (operand_row_stride); 0: read as stored (or widened densely).
  int64_t a_row_stride = 0, b_row_stride = 0;
};

// Whether oneDNN's f32 matmul is its AVX2 sgemm here (no AVX-512): see operand_row_stride.
bool onednn_f32_is_avx2_sgemm() {
  static const bool avx2 = [] {
    const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
    return isa == dnnl::cpu_isa::avx2 || isa == dnnl::cpu_isa::avx2_vnni;
  }();
  return avx2;
}

// oneDNN 2.6's AVX2 sgemm reads its operands in place, without packing them, when 1/m + 1/n >=
// 0.0038 (m and n below about 526: gemm_driver.cpp's nocopy_checker_avx2, which unlike its
// AVX-512 twin does not look at the leading dimensions). There, an operand stored k-major (a
// transposed, or b as it is) is read a row per k step, and rows a multiple of 1 KiB apart fall
// into a few of the L1 cache's sets and evict each other. Such an operand is copied with its rows
// one cache line further apart: a pass over it, which a bf16 or f16 operand's widening makes
// anyway. Measured through gemm() (bench_gemm :dense / :padded, AMD EPYC with AVX2, one thread,
// best of 7 windows, GFLOP/s as stored vs padded): 512^3 63 vs 92, a transposed 60 vs 90;
// 256x1024x256 47 vs 92; 1024x256x256 a transposed 41 vs 83; 64x512x512 60 vs 80; 256^3 a
// transposed 72 vs 86. Operands stored m- or n-major (rows along k) gain nothing: 512^3 b
// transposed 91 vs 88. An f32 operand's copy is one more pass over it against 2 x `reuse` flops
// per element (reuse: the product's other side, n for a, m for b), so it is made only from 16:
// Mx512x512 as stored vs both operands padded, one thread, best of 3: M = 1 29.8 vs 11.1, 2 23.4
// vs 19.3, 4 41.5 vs 36.2, 8 49.4 vs 51.7, 16 61.3 vs 66.5, 32 59.7 vs 75.7, 64 63.4 vs 85.2;
// 16x1024x1024 44.8 vs 61.7 (a batch-1 product's whole time is one read of b). The stride
// oneDNN's f32 kernel reads an operand's rows at: 0 (as stored) or a padded one.
int64_t operand_row_stride(const GemmDesc& d, int64_t cols, bool k_major, int64_t reuse,
                           bool widened) {
  constexpr int64_t kCacheLineFloats = 16;
  constexpr int64_t kAliasingRowFloats = 256;
  constexpr int64_t kMinReuseForACopy = 16;
  switch (d.operand_rows) {
    case OperandRows::dense:
      return 0;
    case OperandRows::padded:
      return cols + kCacheLineFloats;
    case OperandRows::automatic:
      break;
  }
  const double m = static_cast<double>(d.m), n = static_cast<double>(d.n);
  const bool read_in_place = 1.0 / m + 1.0 / n >= 0.0038;
  const bool aliasing = k_major && cols % kAliasingRowFloats == 0;
  const bool worth_a_copy = widened || reuse >= kMinReuseForACopy;
  return onednn_f32_is_avx2_sgemm() && read_in_place && aliasing && worth_a_copy
             ? cols + kCacheLineFloats
             : 0;
}

// An AMX product's bf16 result is rounded by oneDNN as it stores the tiles (VCVTNEPS2BF16), which
// saves an f32 result's round trip through memory and a pass, about as long as the product itself
// at 4096x64x64. That rounding is dsl/half.h's for every f32 but the subnormal ones (nearest even,
// NaNs quieted with their sign and top payload bits), and those it flushes to zero, as the AMX
// products themselves already flush subnormals (TDPBF16PS). A relu stays with the epilogue, since
// oneDNN's would turn NaN into 0, and so does a bias: a product plus a bias can be an f32
// subnormal that the products alone never are. The AMX choice, or nothing where oneDNN would not
// run the product on AMX; one primitive lookup per call where it does.
std::optional<Choice> amx_choice(const GemmDesc& d) {
  if (d.out == bf16 && !d.relu && !d.has_bias) {
    std::shared_ptr<const CachedPrimitive> direct =
        cached_primitive(primitive_key(d, OnednnType::bf16, OnednnType::bf16));
    if (direct->amx) return Choice{false, false, true, std::move(direct)};
  }
  std::shared_ptr<const CachedPrimitive> native =
      cached_primitive(primitive_key(d, OnednnType::bf16));
  if (native->amx) return Choice{false, false, false, std::move(native)};
  return std::nullopt;
}

// Whether oneDNN has a bf16 matmul on this CPU: it needs AVX-512 (on a CPU with AVX2 alone,
// an AMD EPYC of the Zen 2 or 3 kind, making one fails). Asked once, with a small product.
bool onednn_has_bf16_matmul() {
  static const bool has = [] {
    try {
      cached_primitive(
          {1, 16, 16, 16, false, false, 16, 16, OnednnType::bf16, OnednnType::f32, false});
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return has;
}

double flops_of(const GemmDesc& d) {
  return 2.0 * static_cast<double>(d.batch) * static_cast<double>(d.m) * static_cast<double>(d.n) *
         static_cast<double>(d.k);
}

// Whether VDPBF16PS outruns f32 FMAs on this CPU (measured once; logged under MIXTAPE_LOG=profile
// with the measured ratio). The ratio is about 2 or about 0.5 on the CPUs measured, far from 1,
// so the answer does not flip between runs of one machine.
bool bf16_dots_are_faster() {
  static const bool faster = [] {
    const double ratio = bf16_dot_speed_over_f32();
    const bool result = ratio >= 1.0;
    if (log_enabled("profile"))
      log_line("profile",
               "bf16 dot products (VDPBF16PS) run at {:.2f} times the f32 FMA rate here: automatic "
               "bf16 products {}",
               ratio,
               result ? "stay bf16 (own kernel up to 2^21 flops from 64 columns, or from 32 "
                        "up to 128 rows, and from 64 columns with k up to 128; else oneDNN bf16)"
                      : "are widened to f32 or not by shape");
    return result;
  }();
  return faster;
}

Choice choose(const GemmDesc& d) {
  bool widen = d.operand == f16;
  if (d.operand == bf16) {
    switch (d.bf16_kernel) {
      case Bf16Kernel::native:
        if (!onednn_has_bf16_matmul())
          fail("{}: oneDNN has no bf16 matmul on this CPU (it needs AVX-512); widen instead",
               describe(d));
        widen = false;
        break;
      case Bf16Kernel::widened:
        widen = true;
        break;
      case Bf16Kernel::own:
        if (!gemm_bf16_own_available())
          fail(
              "{}: the own bf16 kernel needs AVX512F, AVX512BW and AVX512-BF16, which this CPU "
              "lacks",
              describe(d));
        return Choice{true, false, false, nullptr};
      case Bf16Kernel::automatic: {
        if (!onednn_has_bf16_matmul()) {  // AVX2 alone: every bf16 product is widened
          widen = true;
          break;
        }
        if (onednn_may_use_amx())
          if (std::optional<Choice> amx = amx_choice(d)) return std::move(*amx);
        if (bf16_dots_are_faster()) {
          const bool columns_fit = d.n >= kOwnBf16WideColumns ||
                                   (d.n >= kOwnBf16MinColumns && d.m <= kOwnBf16MaxRowsWhenNarrow);
          const bool shallow = d.n >= kOwnBf16WideColumns && d.k <= kOwnBf16MaxDepth;
          if ((flops_of(d) <= kOwnBf16MaxFlops && columns_fit) || shallow)
            return Choice{true, false, false, nullptr};
          widen = false;
          break;
        }
        const double m = static_cast<double>(d.m), n = static_cast<double>(d.n);
        widen = 2.0 * m * n / (m + n) >= kWidenBf16MinFlopsPerElement;
        break;
      }
    }
  }
  if (d.operand == bf16 && !widen)
    return {false, false, false, cached_primitive(primitive_key(d, OnednnType::bf16))};
  const int64_t a_stride = operand_row_stride(d, stored_a(d).cols, d.transpose_a, d.n, widen);
  const int64_t b_stride = operand_row_stride(d, stored_b(d).cols, !d.transpose_b, d.m, widen);
  return {false,
          widen,
          false,
          cached_primitive(primitive_key(d, OnednnType::f32, OnednnType::f32, a_stride, b_stride)),
          a_stride,
          b_stride};
}

std::string describe(const Choice& choice, const GemmDesc& d) {
  if (choice.own)
    return flops_of(d) >= kSingleThreadMaxFlops
               ? "mixtape's own bf16 kernel (6x64 VDPBF16PS tile, 64-row blocks on the team)"
               : "mixtape's own bf16 kernel (6x64 VDPBF16PS tile, one thread)";
  std::string padded;
  if (choice.a_row_stride > 0 || choice.b_row_stride > 0)
    padded = fmt::format(", operands copied with rows {} and {} elements apart",
                         choice.a_row_stride > 0 ? choice.a_row_stride : stored_a(d).cols,
                         choice.b_row_stride > 0 ? choice.b_row_stride : stored_b(d).cols);
  if (choice.widen)
    return fmt::format("{} widened to f32, oneDNN f32 {}{}", name(d.operand),
                       choice.primitive->implementation, padded);
  std::string scratchpad;
  if (const size_t bytes = choice.primitive->scratchpad.get_size(); bytes > 0)
    scratchpad = fmt::format(", {:.1f} MiB of scratchpad", static_cast<double>(bytes) / (1 << 20));
  return fmt::format("oneDNN {} {}{}{}{}", name(d.operand), choice.primitive->implementation,
                     choice.bf16_result ? ", rounding the bf16 result itself" : "", padded,
                     scratchpad);
}

// An operand as oneDNN's f32 kernel reads it: widened to f32 where it is bf16 or f16, and with its
// rows row_stride elements apart where that is set (else dense), in `buffer`.
const float* f32_operand(DType type, const void* stored, StoredRows shape, int64_t row_stride,
                         ScratchBuffer& buffer) {
  auto widen = type == f16 ? widen_f16 : widen_bf16;
  if (row_stride == 0) {  // widened densely
    float* widened = buffer.get<float>(shape.rows * shape.cols);
    widen(static_cast<const uint16_t*>(stored), widened, shape.rows * shape.cols);
    return widened;
  }
  float* copy = buffer.get<float>(shape.rows * row_stride);
  // Shared out among the team from the size where the widening conversions are.
  const bool parallel = shape.rows * shape.cols >= kParallelConversionMinimum;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t row = 0; row < shape.rows; ++row) {
    float* to = copy + row * row_stride;
    if (type == f32)
      std::copy_n(static_cast<const float*>(stored) + row * shape.cols, shape.cols, to);
    else
      widen(static_cast<const uint16_t*>(stored) + row * shape.cols, to, shape.cols);
  }
  return copy;
}

// MIXTAPE_LOG=profile: which kernel each distinct product runs, once per product.
template <typename Kernel>
void log_choice(const GemmDesc& d, Kernel&& kernel) {
  static const bool enabled = log_enabled("profile");
  if (!enabled) return;
  std::string line = fmt::format("{} runs {}", describe(d), kernel());
  Backend& state = backend();
  {
    std::lock_guard lock(state.mutex);
    if (!state.logged_choices.insert(line).second) return;
  }
  log_line("profile", "{}", line);
}

// A primitive's arguments for the calling thread, made once: each call only points them at its
// buffers. Making dnnl::memory objects and their map on every call was about a fifth of a small
// matmul's time (an exported MLP's batch-1 latency, perf); the C API takes them as they are,
// where the C++ one copies its map into a fresh array every call.
struct BoundArguments {
  std::vector<dnnl::memory> memories;  // src, weights, dst, then bias and scratchpad if any
  std::vector<dnnl_exec_arg_t> args;
};

BoundArguments& bound_arguments(const CachedPrimitive& primitive, bool has_bias) {
  thread_local std::unordered_map<uint64_t, BoundArguments> bound;
  auto [it, added] = bound.try_emplace(primitive.id);
  if (added) {
    const dnnl::engine& engine = backend().engine;
    BoundArguments& b = it->second;
    auto add = [&](int arg, const dnnl::memory::desc& desc) {
      b.memories.push_back(dnnl::memory(desc, engine, DNNL_MEMORY_NONE));
      b.args.push_back({arg, b.memories.back().get()});
    };
    b.memories.reserve(5);
    add(DNNL_ARG_SRC, primitive.a);
    add(DNNL_ARG_WEIGHTS, primitive.b);
    add(DNNL_ARG_DST, primitive.result);
    if (has_bias) add(DNNL_ARG_BIAS, primitive.bias);
    if (primitive.scratchpad.get_size() > 0) add(DNNL_ARG_SCRATCHPAD, primitive.scratchpad);
  }
  return it->second;
}

// Whether oneDNN runs the product on the OpenMP team (else on the calling thread alone).
bool runs_on_team(const GemmDesc& d, const CachedPrimitive& primitive) {
  return flops_of(d) >= (primitive.amx ? kAmxSingleThreadMaxFlops : kSingleThreadMaxFlops);
}

void run_onednn(const GemmDesc& d, const CachedPrimitive& primitive, bool team, const void* a,
                const void* b, const float* bias, void* result) {
  OnednnTeam threads(!team);
  // One stream per thread: oneDNN does not promise that a stream may be used concurrently.
  thread_local dnnl::stream stream(backend().engine);
  BoundArguments& bound = bound_arguments(primitive, d.has_bias);
  std::vector<dnnl::memory>& memory = bound.memories;
  memory[0].set_data_handle(const_cast<void*>(a));
  memory[1].set_data_handle(const_cast<void*>(b));
  memory[2].set_data_handle(result);
  size_t next = 3;
  if (d.has_bias) memory[next++].set_data_handle(const_cast<float*>(bias));
  const size_t scratchpad_bytes = primitive.scratchpad.get_size();
  if (scratchpad_bytes > 0)
    memory[next].set_data_handle(
        thread_scratch().onednn.get<std::byte>(static_cast<int64_t>(scratchpad_bytes)));
  dnnl::error::wrap_c_api(
      dnnl_primitive_execute(primitive.matmul.get(), stream.get(),
                             static_cast<int>(bound.args.size()), bound.args.data()),
      "could not execute a matmul");
  stream.wait();
}

// k == 0: the empty sum is +0, plus the bias.
void fill_empty_product(const GemmDesc& d, const float* bias, float* result) {
  const int64_t rows = d.batch * d.m;
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t j = 0; j < d.n; ++j)
      result[row * d.n + j] = bias != nullptr ? 0.0f + bias[j] : 0.0f;
}

// A bias oneDNN does not add: one added after the product is rounded (GemmDesc::product_type;
// oneDNN adds its bias to the f32 accumulator), and one followed by a relu, which oneDNN's bias
// pass and our relu pass would each take a pass over the result for. The epilogue adds it (with
// the relu, in one pass), or the own kernel does in registers.
bool late_bias(const GemmDesc& d) { return d.has_bias && (d.product_type != f32 || d.relu); }

// The product alone, as an f32 result: what runs before a late bias.
GemmDesc product_only(const GemmDesc& d) {
  GemmDesc product = d;
  product.out = f32;
  product.has_bias = product.relu = false;
  product.product_type = f32;
  return product;
}

GemmDesc without_late_bias(const GemmDesc& d) { return late_bias(d) ? product_only(d) : d; }

// An f32 value rounded to `type` (f32: itself), as dsl/half.h rounds.
float round_to(DType type, float x) {
  if (type == bf16) return bf16_bits_to_f32(f32_to_bf16_bits(x));
  if (type == f16) return f16_bits_to_f32(f32_to_f16_bits(x));
  return x;
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define MIXTAPE_BIAS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MIXTAPE_BIAS_CLONES
#endif

// Rows of a result whose product is rounded (by `round`) before the bias is added, and the relu
// applied when asked: a plain loop the vectorizer takes.
template <typename Round>
[[gnu::always_inline]] inline void add_bias_rows(float* values, int64_t rows, int64_t n,
                                                 const float* bias, bool relu, Round round) {
  for (int64_t row = 0; row < rows; ++row, values += n)
    for (int64_t j = 0; j < n; ++j) {
      const float x = round(values[j]) + bias[j];
      values[j] = relu && !(x > 0.0f || std::isnan(x)) ? 0.0f : x;
    }
}

// The same, one loop per product type, built for AVX-512, AVX2 and the baseline and chosen by
// the CPU (on an AVX2 CPU the baseline's loop cost bf16 steps about a tenth more than the kernels
// it replaced).
MIXTAPE_BIAS_CLONES void bias_after_rounding_rows(float* values, int64_t rows, int64_t n,
                                                  const float* bias, DType product_type,
                                                  bool relu) {
  if (product_type == bf16)
    add_bias_rows(values, rows, n, bias, relu,
                  [](float x) { return bf16_bits_to_f32(f32_to_bf16_bits(x)); });
  else if (product_type == f16)
    add_bias_rows(values, rows, n, bias, relu,
                  [](float x) { return f16_bits_to_f32(f32_to_f16_bits(x)); });
  else
    add_bias_rows(values, rows, n, bias, relu, [](float x) { return x; });
}

// A product rounded to d.product_type before the bias is added (GemmDesc): oneDNN adds its bias
// to the f32 accumulator, so this runs on its f32 result, in place, before finish() (which has
// nothing left to do for an f32 result: its relu is applied here, in the same pass). Large
// results are shared out among the team in blocks of rows.
void add_bias_after_rounding(const GemmDesc& d, const float* bias, float* result) {
  const int64_t rows = d.batch * d.m;
  const bool relu = d.relu && d.out == f32;
  constexpr int64_t kBlockRows = 64;
  if (rows * d.n < (int64_t{1} << 17)) {
    bias_after_rounding_rows(result, rows, d.n, bias, d.product_type, relu);
    return;
  }
#pragma omp parallel
  {
    FlushDenormalScope float_mode;  // the team's threads may be the caller's too
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; row += kBlockRows)
      bias_after_rounding_rows(result + row * d.n, std::min(kBlockRows, rows - row), d.n, bias,
                               d.product_type, relu);
  }
}

// The epilogue after oneDNN: relu, and the one rounding to a half output.
// A product the team computed is finished by the team, each member converting the rows it wrote
// (still in its cache): on one thread the other member's half crosses between cores, which
// doubled the epilogue's time (768x128 bf16 result: 41 us against 12 us for the loop alone).
void finish(const GemmDesc& d, bool team, float* result, void* out, int64_t count) {
  uint16_t* bits = static_cast<uint16_t*>(out);
  const ConvertThreads threads = team ? ConvertThreads::team : ConvertThreads::automatic;
  if (d.out == f32 && d.relu)
    relu_in_place(result, count, threads);
  else if (d.out == bf16)
    narrow_to_bf16(result, bits, count, d.relu, threads);
  else if (d.out == f16)
    narrow_to_f16(result, bits, count, d.relu, threads);
}

// A weight gradient (x^T dy: a transposed, b not) has few output blocks and a long k, and
// oneDNN gives each thread whole output blocks: a 64x64 result over k = 4096 ran on one core
// (mlp_w64_b4096's weight gradients, a fifth of its step). Such a product is split along k
// instead: each part is a contiguous run of rows of both operands, the parts run as one batched
// product on the team, and their f32 results are summed. The same f32 accumulation, in another
// order, as a blocked kernel's own order is. The number of parts is fixed, whatever the number
// of threads, so that the bits do not depend on it. The number of parts, 1 when not split.
int64_t k_split_parts(const GemmDesc& d) {
  constexpr int64_t kParts = 4;
  constexpr int64_t kBlock = 64;            // oneDNN's output blocks are about this size
  constexpr int64_t kMinRowsPerPart = 256;  // each part at least this much of k
  if (d.batch != 1 || !d.transpose_a || d.transpose_b) return 1;
  const int64_t blocks = ((d.m + kBlock - 1) / kBlock) * ((d.n + kBlock - 1) / kBlock);
  if (blocks >= kParts || d.k % kParts != 0 || d.k / kParts < kMinRowsPerPart) return 1;
  const double flops =
      2.0 * static_cast<double>(d.m) * static_cast<double>(d.n) * static_cast<double>(d.k);
  return flops >= kSingleThreadMaxFlops ? kParts : 1;
}

// The batched product of the parts: f32 results, the epilogue left for after their sum.
GemmDesc k_split_part(const GemmDesc& d, int64_t parts) {
  GemmDesc part = d;
  part.batch = parts;
  part.k = d.k / parts;
  part.out = f32;
  part.has_bias = false;
  part.relu = false;
  return part;
}

std::string describe_k_split(const GemmDesc& d, int64_t parts) {
  const GemmDesc part = k_split_part(d, parts);
  return fmt::format("k split in {} parts of {}, each {}", parts, part.k,
                     describe(choose(part), part));
}

}  // namespace

// The least of the kernels' team thresholds (AMX tiles start theirs higher).
bool gemm_on_calling_thread(const GemmDesc& d) { return flops_of(d) < kSingleThreadMaxFlops; }

bool gemm_supported(const GemmDesc& d) {
  return d.batch >= 0 && d.m >= 0 && d.n >= 0 && d.k >= 0 && is_gemm_float(d.operand) &&
         is_gemm_float(d.out) && (!d.has_bias || is_gemm_float(d.bias_type)) &&
         is_gemm_float(d.product_type);
}

namespace {

// A 16-bit result that goes through an f32 copy before its rounding (every oneDNN product here
// but AMX's bf16 ones, widened ones included) takes that copy from the workspace: 4 bytes per
// element while the call runs. A language model's logits product made it 2x its bf16 result (256
// MiB for [8192, 8192]), the largest part of an autocast step's peak outside its stored values.
// Past this size such a product runs in pieces (whole batch entries, else blocks of rows), each
// rounded into its part of the result, so the copy never holds more than this.
constexpr int64_t kMaxResultCopyBytes = int64_t{16} << 20;

void gemm_keeping_scratch(const GemmDesc& d, const void* a, const void* b, void* out,
                          const void* bias, const Choice* whole);

// One piece's kernel (run_in_chunks): the whole product's, so that every row of its result comes
// from the same kernel and summation (choose() would pick by the piece's own shape, and a short
// last piece could take another kernel): oneDNN's bf16 one, or its f32 one on operands widened or
// copied at the whole's row strides, as a primitive of the piece's shape.
Choice piece_choice(const GemmDesc& piece, const Choice& whole) {
  Choice choice = whole;
  const bool f32_kernel = whole.widen || piece.operand != bf16;
  choice.primitive =
      cached_primitive(f32_kernel ? primitive_key(piece, OnednnType::f32, OnednnType::f32,
                                                  whole.a_row_stride, whole.b_row_stride)
                                  : primitive_key(piece, OnednnType::bf16));
  return choice;
}

// How many batch entries (batch > 1) or rows (batch 1) each piece of the product holds, where
// it runs in pieces: an f32 copy of its result, larger than kMaxResultCopyBytes, that can be cut.
// Rows are cut only where a is stored row by row (not transposed), so that a piece's rows of a
// and of the result are contiguous. The pieces are the same for the same description, so a
// shape always gives the same bits.
std::optional<int64_t> result_chunk(const GemmDesc& d, const Choice& choice) {
  if (d.out == f32 || choice.bf16_result) return std::nullopt;
  const int64_t entry_bytes = d.m * d.n * static_cast<int64_t>(sizeof(float));
  if (d.batch * entry_bytes <= kMaxResultCopyBytes) return std::nullopt;
  if (d.batch > 1) return std::max<int64_t>(1, kMaxResultCopyBytes / entry_bytes);
  if (d.transpose_a) return std::nullopt;
  constexpr int64_t kRowMultiple = 64;  // oneDNN's blocks
  const int64_t rows = kMaxResultCopyBytes / (d.n * static_cast<int64_t>(sizeof(float)));
  const int64_t chunk = std::max(kRowMultiple, rows / kRowMultiple * kRowMultiple);
  return chunk < d.m ? std::optional<int64_t>(chunk) : std::nullopt;
}

// b as oneDNN's f32 kernel reads it (f32_operand), made once for all the row pieces of a product:
// widening it again for each piece made the 8192x8192x768 logits product 5-12% slower.
const void* shared_b_operand(const GemmDesc& d, const Choice& choice, const void* b,
                             ThreadScratch& scratch) {
  const StoredRows rows = stored_b(d);
  const bool shared = scratch.shared_b == b;
  if (shared && scratch.shared_b_stride == choice.b_row_stride)
    return scratch.b.get<float>(rows.rows *
                                (choice.b_row_stride > 0 ? choice.b_row_stride : rows.cols));
  const float* copy = f32_operand(d.operand, b, rows, choice.b_row_stride, scratch.b);
  if (shared) scratch.shared_b_stride = choice.b_row_stride;
  return copy;
}

// The product as pieces of `chunk` batch entries or rows (result_chunk), each a product of its
// own on the same operands, written into its part of `out`. Row pieces share b's f32 copy.
void run_in_chunks(const GemmDesc& d, const Choice& whole, int64_t chunk, const void* a,
                   const void* b, void* out, const void* bias) {
  struct SharedB {
    ThreadScratch& scratch;
    SharedB(ThreadScratch& s, const void* b) : scratch(s) {
      scratch.shared_b = b, scratch.shared_b_stride = -1;
    }
    ~SharedB() { scratch.shared_b = nullptr, scratch.shared_b_stride = -1; }
  } sharing(thread_scratch(), d.batch == 1 ? b : nullptr);
  const int64_t operand_size = static_cast<int64_t>(size_of(d.operand));
  const int64_t out_size = static_cast<int64_t>(size_of(d.out));
  const bool by_entry = d.batch > 1;
  const int64_t pieces_of = by_entry ? d.batch : d.m;
  for (int64_t start = 0; start < pieces_of; start += chunk) {
    GemmDesc piece = d;
    const int64_t count = std::min(chunk, pieces_of - start);
    const auto* a_bytes = static_cast<const std::byte*>(a);
    const auto* b_bytes = static_cast<const std::byte*>(b);
    auto* out_bytes = static_cast<std::byte*>(out);
    if (by_entry) {
      piece.batch = count;
      a_bytes += start * d.m * d.k * operand_size;
      b_bytes += start * d.k * d.n * operand_size;
      out_bytes += start * d.m * d.n * out_size;
    } else {
      piece.m = count;
      a_bytes += start * d.k * operand_size;
      out_bytes += start * d.n * out_size;
    }
    gemm_keeping_scratch(piece, a_bytes, b_bytes, out_bytes, bias, &whole);
  }
}

// gemm(), whose workspace stays with the calling thread until the outermost call returns (a
// k-split or late-bias product runs this again on its caller's buffers). `whole`: the kernel of
// the product that this one is a piece of (run_in_chunks), which it runs as it is.
void gemm_keeping_scratch(const GemmDesc& d, const void* a, const void* b, void* out,
                          const void* bias = nullptr, const Choice* whole = nullptr) {
  if (!gemm_supported(d))
    fail(
        "{}: unsupported; gemm takes f32, bf16 or f16 operands, outputs and biases and "
        "non-negative sizes",
        describe(d));
  if (d.batch == 0 || d.m == 0 || d.n == 0) return;
  if (out == nullptr || (d.k > 0 && (a == nullptr || b == nullptr)) ||
      (d.has_bias && bias == nullptr))
    fail("{}: null {} pointer", describe(d),
         out == nullptr ? "output" : (d.has_bias && bias == nullptr ? "bias" : "operand"));

  ThreadScratch& scratch = thread_scratch();
  const int64_t result_count = d.batch * d.m * d.n;
  const float* bias_f32 = static_cast<const float*>(bias);
  if (d.has_bias && d.bias_type != f32) {
    float* widened = scratch.bias.get<float>(d.n);
    const uint16_t* bits = static_cast<const uint16_t*>(bias);
    d.bias_type == f16 ? widen_f16(bits, widened, d.n) : widen_bf16(bits, widened, d.n);
    bias_f32 = widened;
  }
  auto f32_result = [&] {
    return d.out == f32 ? static_cast<float*>(out) : scratch.result.get<float>(result_count);
  };

  if (d.k == 0) {
    float* result = f32_result();
    fill_empty_product(d, bias_f32, result);
    finish(d, false, result, out, result_count);
    return;
  }
  if (const int64_t parts = whole ? 1 : k_split_parts(d); parts > 1) {
    const GemmDesc part = k_split_part(d, parts);
    const int64_t count = d.m * d.n;
    float* partials = scratch.partials.get<float>(parts * count);
    gemm_keeping_scratch(part, a, b, partials);
    log_choice(d, [&] { return describe_k_split(d, parts); });
    float* result = f32_result();
#pragma omp parallel
    {
      FlushDenormalScope float_mode;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < count; ++i) {
        float sum = partials[i];
        for (int64_t p = 1; p < parts; ++p) sum += partials[p * count + i];
        result[i] = bias_f32 != nullptr ? round_to(d.product_type, sum) + bias_f32[i % d.n] : sum;
      }
    }
    finish(d, true, result, out, count);
    return;
  }
  Choice choice;
  try {
    choice = whole ? piece_choice(without_late_bias(d), *whole) : choose(without_late_bias(d));
  } catch (const dnnl::error& error) {
    fail("{}: oneDNN failed: {}", describe(d), error.what());
  }
  log_choice(d, [&] { return describe(choice, d); });
  if (choice.own && !(d.has_bias && d.product_type == f16)) {
    // An f32 or bf16 result is written by the kernel itself, bias and relu included (the product
    // rounded to bf16 first where asked); an f16 one goes through the f32 result and the epilogue.
    const bool team = flops_of(d) >= kSingleThreadMaxFlops;
    const bool direct = d.out == f32 || d.out == bf16;
    void* result = direct ? out : f32_result();
    gemm_bf16_own(d.batch, d.m, d.n, d.k, d.transpose_a, d.transpose_b,
                  static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), bias_f32,
                  result, d.out == bf16, direct && d.relu, team,
                  d.has_bias && d.product_type == bf16);
    if (!direct) finish(d, team, static_cast<float*>(result), out, result_count);
    return;
  }
  if (std::optional<int64_t> chunk = whole ? std::nullopt : result_chunk(d, choice)) {
    run_in_chunks(d, choice, *chunk, a, b, out, bias);
    return;
  }
  if (late_bias(d)) {
    // The product alone as f32, then the bias after its rounding, then finish().
    float* result = f32_result();
    gemm_keeping_scratch(product_only(d), a, b, result, nullptr, whole);
    add_bias_after_rounding(d, bias_f32, result);
    if (d.out != f32) finish(d, flops_of(d) >= kSingleThreadMaxFlops, result, out, result_count);
    return;
  }
  const void* a_operand = a;
  const void* b_operand = b;
  if (choice.widen || choice.a_row_stride > 0)
    a_operand = f32_operand(d.operand, a, stored_a(d), choice.a_row_stride, scratch.a);
  if (choice.widen || choice.b_row_stride > 0) b_operand = shared_b_operand(d, choice, b, scratch);
  float* result = choice.bf16_result ? nullptr : f32_result();
  const bool team = runs_on_team(d, *choice.primitive);
  try {
    run_onednn(d, *choice.primitive, team, a_operand, b_operand, bias_f32,
               choice.bf16_result ? out : static_cast<void*>(result));
  } catch (const dnnl::error& error) {
    fail("{}: oneDNN failed: {}", describe(d), error.what());
  }
  if (!choice.bf16_result) finish(d, team, result, out, result_count);
}

}  // namespace

void gemm(const GemmDesc& d, const void* a, const void* b, void* out, const void* bias) {
  struct Trim {
    ~Trim() { thread_scratch().trim(); }
  } trim_on_return;
  gemm_keeping_scratch(d, a, b, out, bias);
}

std::string gemm_kernel(const GemmDesc& d) {
  if (!gemm_supported(d))
    fail("{}: unsupported; gemm takes f32, bf16 or f16 operands, outputs and biases", describe(d));
  if (d.batch == 0 || d.m == 0 || d.n == 0) return "nothing (an empty result)";
  if (d.k == 0) return "no product (k = 0): the epilogue of zeros";
  try {
    if (const int64_t parts = k_split_parts(d); parts > 1) return describe_k_split(d, parts);
    return describe(choose(without_late_bias(d)), d);
  } catch (const dnnl::error& error) {
    fail("{}: oneDNN failed: {}", describe(d), error.what());
  }
}

bool gemm_bf16_native_available() {
  try {
    return onednn_has_bf16_matmul();
  } catch (const dnnl::error& error) {
    fail("oneDNN failed: {}", error.what());
  }
}

size_t gemm_primitive_cache_size() {
  Backend& state = backend();
  std::lock_guard lock(state.mutex);
  return state.cache.size();
}

void gemm_clear_primitive_cache() {
  Backend& state = backend();
  std::lock_guard lock(state.mutex);
  state.cache.clear();
}

}  // namespace mixtape
