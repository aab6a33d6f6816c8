// mixtape/runtime/cuda_attention.cpp -- fused attention's CUDA kernels (one NVRTC module per head
// dim, on top of the fixed kernels' source) and their launches.
#include "mixtape/runtime/cuda_attention.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/attention.h"
#include "mixtape/dsl/error.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_fixed_kernels.h"
#include "mixtape/runtime/cuda_values.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/program.h"

namespace mixtape {
namespace {

// Rows (query or key) per block: one thread each.
constexpr unsigned kRowsPerBlock = 128;
static_assert(sizeof(int64_t) == sizeof(long long));

static_assert(sizeof(AttentionKernelArgs) == 120, "mt_attention's layout");

constexpr const char* source = R"(
// ---- fused attention (runtime/cuda_attention.h). Tiles of 32 key (or query) rows are staged in
// shared memory as f32, zero-padded to the head dim D; each thread keeps its own row in
// registers and sums in order, so every element is one thread's sequence of f32 operations.
struct mt_attention {
  long long batch, tq, tk, d, dv, mask_row_stride, mask_col_stride;
  unsigned long long seed;
  float scale, keep_scale;
  unsigned threshold;
  int causal, mask_kind, mask_dtype, dropout, q_dtype, k_dtype, v_dtype, o_dtype, go_dtype,
      out_dtype, compute;
};
#define MT_ATT_TILE 32
static __device__ __forceinline__ long long mt_att_min(long long a, long long b) {
  return a < b ? a : b;
}
static __device__ __forceinline__ float mt_att_ninf() { return __int_as_float(0xff800000); }
// An operand element as f32, rounded to the compute type where that is a 16-bit type the value
// is not stored in (as the CPU tiles load it).
static __device__ __forceinline__ float mt_att_load(const void* p, int dtype, int compute,
                                                    long long i) {
  const float v = static_cast<float>(mt_load_as_double(p, dtype, i));
  if (dtype == compute) return v;
  return compute == MT_F16 ? mt_round_f16(v) : compute == MT_BF16 ? mt_round_bf16(v) : v;
}
// The scaled score of query i and key j of batch b with the mask applied: -inf where masked.
static __device__ __forceinline__ float mt_att_mask(const mt_attention& g, const void* mask,
                                                    const long long* mask_batch, long long b,
                                                    long long i, long long j, float scaled) {
  if (g.mask_kind != 0) {
    const long long at = mask_batch[b] + i * g.mask_row_stride + j * g.mask_col_stride;
    if (g.mask_kind == 1) {
      if (!static_cast<const unsigned char*>(mask)[at]) return mt_att_ninf();
    } else {
      scaled = __fadd_rn(scaled, static_cast<float>(mt_load_as_double(mask, g.mask_dtype, at)));
    }
  }
  return g.causal && j > i ? mt_att_ninf() : scaled;
}
// Weight (b, i, j)'s dropout factor: DropoutDraw::scales' test on its Philox word, the stream's
// offset read on the device (the generator's, computed there), as mt_random_fill reads it.
static __device__ __forceinline__ float mt_att_keep(const mt_attention& g,
                                                    const unsigned long long* offset, long long b,
                                                    long long i, long long j) {
  if (!g.dropout) return 1.0f;
  const unsigned long long first = static_cast<unsigned long long>((b * g.tq + i) * g.tk + j);
  unsigned w[4];
  mt_philox(*offset + first / 4, g.seed, w);
  return (w[first % 4] >> 8) >= g.threshold ? g.keep_scale : 0.0f;
}
// Rows [first, first + MT_ATT_TILE) of a [rows, width] operand of batch b into tile (padded).
template <int D>
static __device__ __forceinline__ void mt_att_stage(float (*tile)[D], const void* p, int dtype,
                                                    int compute, long long b, long long rows,
                                                    long long width, long long first) {
  for (int t = threadIdx.x; t < MT_ATT_TILE * D; t += blockDim.x) {
    const int r = t / D, e = t % D;
    const long long row = first + r;
    tile[r][e] = row < rows && e < width
                     ? mt_att_load(p, dtype, compute, (b * rows + row) * width + e)
                     : 0.0f;
  }
}
template <int D>
static __device__ __forceinline__ float mt_att_dot(const float* a, const float* b) {
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < D; ++e) sum = fmaf(a[e], b[e], sum);
  return sum;
}
// The scaled, masked score of query i (row qi) and key j (row kj) of batch b.
template <int D>
static __device__ __forceinline__ float mt_att_score(const mt_attention& g, const void* mask,
                                                     const long long* mask_batch, long long b,
                                                     long long i, long long j, const float* qi,
                                                     const float* kj) {
  return mt_att_mask(g, mask, mask_batch, b, i, j, __fmul_rn(mt_att_dot<D>(qi, kj), g.scale));
}
// This block's batch index and first row, and this thread's row, for blocks of blockDim.x rows
// of `rows` per batch index.
struct mt_att_rows {
  long long b, first, row;
  bool active;
};
static __device__ __forceinline__ mt_att_rows mt_att_rows_of(long long rows) {
  const long long tiles = (rows + blockDim.x - 1) / blockDim.x;
  mt_att_rows r;
  r.b = blockIdx.x / tiles;
  r.first = (blockIdx.x % tiles) * blockDim.x;
  r.row = r.first + threadIdx.x;
  r.active = r.row < rows;
  return r;
}
// The keys a block of query rows from `first` sees: all, or up to its last row when causal.
static __device__ __forceinline__ long long mt_att_keys_seen(const mt_attention& g,
                                                             long long first) {
  const long long last = mt_att_min(g.tq, first + blockDim.x) - 1;
  return g.causal ? mt_att_min(g.tk, last + 1) : g.tk;
}
// This thread's row of a [rows, width] operand of batch b (padded), zeros past the last row. The
// dtype's branch is taken once per row, outside the unrolled loops.
template <int D, typename T, typename Widen>
static __device__ __forceinline__ void mt_att_row_of(float* out, const T* p, long long width,
                                                     bool live, Widen widen) {
#pragma unroll
  for (int e = 0; e < D; ++e) out[e] = live && e < width ? widen(p[e]) : 0.0f;
}
template <int D>
static __device__ __forceinline__ void mt_att_row(float* out, const void* p, int dtype, int compute,
                                                  long long b, long long rows, long long width,
                                                  long long row) {
  const bool live = row < rows;
  const long long at = live ? (b * rows + row) * width : 0;
  const unsigned short* half = static_cast<const unsigned short*>(p) + at;
  if (dtype == MT_F16)
    mt_att_row_of<D>(out, half, width, live, [](unsigned short h) { return mt_f16_to_f32(h); });
  else if (dtype == MT_BF16)
    mt_att_row_of<D>(out, half, width, live, [](unsigned short h) { return mt_bf16_to_f32(h); });
  else
    mt_att_row_of<D>(out, static_cast<const float*>(p) + at, width, live, [](float f) { return f; });
  if (dtype == compute || (compute != MT_F16 && compute != MT_BF16)) return;
#pragma unroll
  for (int e = 0; e < D; ++e) out[e] = compute == MT_F16 ? mt_round_f16(out[e]) : mt_round_bf16(out[e]);
}
// Stores row[e] * factor for e < width at p[at + e] in dtype, rounded to nearest even (as
// mt_store_double stores a float's value).
template <int D>
static __device__ __forceinline__ void mt_att_store_row(void* p, int dtype, long long at,
                                                        const float* row, float factor,
                                                        long long width) {
  if (dtype == MT_F32) {
#pragma unroll
    for (int e = 0; e < D; ++e)
      if (e < width) static_cast<float*>(p)[at + e] = row[e] * factor;
    return;
  }
  unsigned short* half = static_cast<unsigned short*>(p) + at;
#pragma unroll
  for (int e = 0; e < D; ++e)
    if (e < width)
      half[e] = dtype == MT_F16 ? mt_f32_to_f16(row[e] * factor)
                                : mt_f32_to_bf16(mt_round_bf16(row[e] * factor));
}

// The online softmax of this thread's query row qi over the keys its block sees, tile by tile:
// top and total end as the scores' maximum and the sum of exp(s - top), and with Values, acc as
// sum_j exp(s_ij - top) z_ij v_j (the CPU tiles' recurrence). Every thread of the block calls it.
template <int D, bool Values>
static __device__ __forceinline__ void mt_att_softmax(
    const mt_attention& g, const void* k, const void* v, const void* mask,
    const long long* mask_batch, const unsigned long long* offset, const mt_att_rows& at,
    float (*keys)[D], float (*values)[D], const float* qi, float* acc, float& top, float& total) {
  top = mt_att_ninf(), total = 0.0f;
  const long long end = mt_att_keys_seen(g, at.first);
  for (long long j0 = 0; j0 < end; j0 += MT_ATT_TILE) {
    __syncthreads();  // the last tile is read
    mt_att_stage<D>(keys, k, g.k_dtype, g.compute, at.b, g.tk, g.d, j0);
    if (Values) mt_att_stage<D>(values, v, g.v_dtype, g.compute, at.b, g.tk, g.dv, j0);
    __syncthreads();
    if (!at.active) continue;
    const int cols = static_cast<int>(mt_att_min(MT_ATT_TILE, end - j0));
#pragma unroll 1
    for (int r = 0; r < cols; ++r) {
      const float s = mt_att_score<D>(g, mask, mask_batch, at.b, at.row, j0 + r, qi, keys[r]);
      if (s == mt_att_ninf()) continue;  // weight 0
      if (s > top) {  // a new maximum: rescale what was summed
        const float correction = expf(top - s);
        total *= correction;
        if (Values) {
#pragma unroll
          for (int e = 0; e < D; ++e) acc[e] *= correction;
        }
        top = s;
      }
      float p = expf(s - top);
      total += p;  // the sum is over every weight, the values meet the kept ones
      if (Values) {
        p *= mt_att_keep(g, offset, at.b, at.row, j0 + r);
#pragma unroll
        for (int e = 0; e < D; ++e) acc[e] = fmaf(p, values[r][e], acc[e]);
      }
    }
  }
}

// out[b, i] = sum_j softmax_j(s_ij) z_ij v_j.
template <int D>
static __device__ __forceinline__ void mt_attention_forward(
    const void* q, const void* k, const void* v, const void* mask, const long long* mask_batch,
    const unsigned long long* offset, void* out, const mt_attention& g) {
  __shared__ float keys[MT_ATT_TILE][D], values[MT_ATT_TILE][D];
  const mt_att_rows at = mt_att_rows_of(g.tq);
  const long long b = at.b, i = at.row;
  const bool active = at.active;
  float qi[D], acc[D];
  mt_att_row<D>(qi, q, g.q_dtype, g.compute, b, g.tq, g.d, i);
#pragma unroll
  for (int e = 0; e < D; ++e) acc[e] = 0.0f;
  float top, total;
  mt_att_softmax<D, true>(g, k, v, mask, mask_batch, offset, at, keys, values, qi, acc, top,
                          total);
  if (!active) return;
  const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
  mt_att_store_row<D>(out, g.out_dtype, (b * g.tq + i) * g.dv, acc, inverse, g.dv);
}

// Backward, per query row i: the row's maximum score top_i and sum of exponentials online over
// the keys, delta_i = dO_i . O_i (top, 1 / sum and delta into stats[MT_ATT_ROW_STATS (b tq + i)],
// kAttentionRowStats of the host), then
// dQ_i = sum_j dS_ij k_j with dS = P (Z dP - delta) scale. P = exp(s - top) / sum, as the
// forward pass makes it: a log-sum-exp top + log(sum) loses log(sum) to rounding when top is
// huge (a row whose keys an additive mask of -1e9 hides), which made each weight 1.
template <int D>
static __device__ __forceinline__ void mt_attention_rows(
    const void* q, const void* k, const void* v, const void* o, const void* go, const void* mask,
    const long long* mask_batch, const unsigned long long* offset, float* stats, void* out,
    const mt_attention& g) {
  __shared__ float keys[MT_ATT_TILE][D], values[MT_ATT_TILE][D];
  const mt_att_rows at = mt_att_rows_of(g.tq);
  const long long b = at.b, i = at.row;
  const bool active = at.active;
  float qi[D], gi[D], dq[D];
  mt_att_row<D>(qi, q, g.q_dtype, g.compute, b, g.tq, g.d, i);
  mt_att_row<D>(gi, go, g.go_dtype, g.compute, b, g.tq, g.dv, i);
  mt_att_row<D>(dq, o, g.o_dtype, g.compute, b, g.tq, g.dv, i);  // O, until delta is taken
  float delta = 0.0f;
#pragma unroll
  for (int e = 0; e < D; ++e) {
    delta = fmaf(gi[e], dq[e], delta);
    dq[e] = 0.0f;
  }
  float top, total;
  mt_att_softmax<D, false>(g, k, v, mask, mask_batch, offset, at, keys, values, qi, nullptr, top,
                           total);
  const long long end = mt_att_keys_seen(g, at.first);
  const float inverse_sum = 1.0f / total;
  for (long long j0 = 0; j0 < end; j0 += MT_ATT_TILE) {
    __syncthreads();
    mt_att_stage<D>(keys, k, g.k_dtype, g.compute, b, g.tk, g.d, j0);
    mt_att_stage<D>(values, v, g.v_dtype, g.compute, b, g.tk, g.dv, j0);
    __syncthreads();
    if (!active || top == mt_att_ninf()) continue;
    const int cols = static_cast<int>(mt_att_min(MT_ATT_TILE, end - j0));
#pragma unroll 1
    for (int r = 0; r < cols; ++r) {
      const float s = mt_att_score<D>(g, mask, mask_batch, b, i, j0 + r, qi, keys[r]);
      const float p = expf(s - top) * inverse_sum;
      const float dp = mt_att_dot<D>(gi, values[r]);
      const float ds = p * (mt_att_keep(g, offset, b, i, j0 + r) * dp - delta) * g.scale;
#pragma unroll
      for (int e = 0; e < D; ++e) dq[e] = fmaf(ds, keys[r][e], dq[e]);
    }
  }
  if (!active) return;
  float* row_stats = stats + MT_ATT_ROW_STATS * (b * g.tq + i);
  row_stats[0] = top;
  row_stats[1] = inverse_sum;
  row_stats[2] = delta;
  const long long per_batch = g.tq * g.d + g.tk * (g.d + g.dv);
  mt_att_store_row<D>(out, g.out_dtype, b * per_batch + i * g.d, dq, 1.0f, g.d);
}

// Backward, per key row j, over the query tiles that see it: dV_j = sum_i P_ij Z_ij dO_i
// (Values), or dK_j = sum_i dS_ij q_i.
template <int D, bool Values>
static __device__ __forceinline__ void mt_attention_keys(
    const void* q, const void* k, const void* v, const void* go, const void* mask,
    const long long* mask_batch, const unsigned long long* offset, const float* stats, void* out,
    const mt_attention& g) {
  __shared__ float queries[MT_ATT_TILE][D], grads[MT_ATT_TILE][D],
      rows[MT_ATT_TILE][MT_ATT_ROW_STATS];
  const mt_att_rows at = mt_att_rows_of(g.tk);
  const long long b = at.b, j = at.row;
  const bool active = at.active;
  float kj[D], vj[D], acc[D];
  mt_att_row<D>(kj, k, g.k_dtype, g.compute, b, g.tk, g.d, j);
  if (!Values) mt_att_row<D>(vj, v, g.v_dtype, g.compute, b, g.tk, g.dv, j);
#pragma unroll
  for (int e = 0; e < D; ++e) acc[e] = 0.0f;
  // A causal key is seen from its own position on: the block's first key bounds the queries.
  const long long start = g.causal ? mt_att_min(at.first, g.tq) / MT_ATT_TILE * MT_ATT_TILE : 0;
  for (long long i0 = start; i0 < g.tq; i0 += MT_ATT_TILE) {
    __syncthreads();
    mt_att_stage<D>(queries, q, g.q_dtype, g.compute, b, g.tq, g.d, i0);
    mt_att_stage<D>(grads, go, g.go_dtype, g.compute, b, g.tq, g.dv, i0);
    for (int t = threadIdx.x; t < MT_ATT_ROW_STATS * MT_ATT_TILE; t += blockDim.x) {
      const long long row = i0 + t / MT_ATT_ROW_STATS;
      rows[t / MT_ATT_ROW_STATS][t % MT_ATT_ROW_STATS] =
          row < g.tq ? stats[MT_ATT_ROW_STATS * (b * g.tq + row) + t % MT_ATT_ROW_STATS] : 0.0f;
    }
    __syncthreads();
    if (!active) continue;
    const int count = static_cast<int>(mt_att_min(MT_ATT_TILE, g.tq - i0));
#pragma unroll 1
    for (int r = 0; r < count; ++r) {
      const long long i = i0 + r;
      const float top = rows[r][0];
      if (top == mt_att_ninf()) continue;  // a row that sees no key: zero gradients
      const float s = mt_att_score<D>(g, mask, mask_batch, b, i, j, queries[r], kj);
      const float p = expf(s - top) * rows[r][1], z = mt_att_keep(g, offset, b, i, j);
      if (Values) {
        const float weight = p * z;
#pragma unroll
        for (int e = 0; e < D; ++e) acc[e] = fmaf(weight, grads[r][e], acc[e]);
      } else {
        const float ds = p * (z * mt_att_dot<D>(grads[r], vj) - rows[r][2]) * g.scale;
#pragma unroll
        for (int e = 0; e < D; ++e) acc[e] = fmaf(ds, queries[r][e], acc[e]);
      }
    }
  }
  if (!active) return;
  const long long per_batch = g.tq * g.d + g.tk * (g.d + g.dv);
  const long long width = Values ? g.dv : g.d;
  const long long to = b * per_batch + g.tq * g.d + (Values ? g.tk * g.d : 0) + j * width;
  mt_att_store_row<D>(out, g.out_dtype, to, acc, 1.0f, width);
}

#define MT_ATTENTION_KERNELS(D)                                                                 \
  extern "C" __global__ void mt_attention_forward_##D(                                         \
      const void* q, const void* k, const void* v, const void* mask,                           \
      const long long* mask_batch, const unsigned long long* offset, void* out,                \
      const mt_attention g) {                                                                   \
    mt_attention_forward<D>(q, k, v, mask, mask_batch, offset, out, g);                        \
  }                                                                                             \
  extern "C" __global__ void mt_attention_rows_##D(                                            \
      const void* q, const void* k, const void* v, const void* o, const void* go,              \
      const void* mask, const long long* mask_batch, const unsigned long long* offset,         \
      float* stats, void* out, const mt_attention g) {                                         \
    mt_attention_rows<D>(q, k, v, o, go, mask, mask_batch, offset, stats, out, g);             \
  }                                                                                             \
  extern "C" __global__ void mt_attention_keys_##D(                                            \
      const void* q, const void* k, const void* v, const void* go, const void* mask,           \
      const long long* mask_batch, const unsigned long long* offset, const float* stats,       \
      void* out, const mt_attention g) {                                                        \
    mt_attention_keys<D, false>(q, k, v, go, mask, mask_batch, offset, stats, out, g);         \
  }                                                                                             \
  extern "C" __global__ void mt_attention_values_##D(                                          \
      const void* q, const void* k, const void* v, const void* go, const void* mask,           \
      const long long* mask_batch, const unsigned long long* offset, const float* stats,       \
      void* out, const mt_attention g) {                                                        \
    mt_attention_keys<D, true>(q, k, v, go, mask, mask_batch, offset, stats, out, g);          \
  }
)";

bool f32_or_half(DType t) { return t == f32 || is_half(t); }

// The padded head dim of the kernels that cover d and dv, or 0 where none does.
int padded_dim(int64_t d, int64_t dv) {
  const int64_t widest = std::max(d, dv);
  for (int dim : {32, 64, 128})
    if (widest <= dim) return dim;
  return 0;
}

std::atomic<cuda::CUmodule> prebuilt_module{nullptr};

// The four kernels of one head dim.
struct AttentionKernels {
  cuda::CUfunction forward = nullptr, rows = nullptr, keys = nullptr, values = nullptr;
};

// The kernels for head dim `dim`: an artifact's module's where it holds them, else compiled by
// NVRTC (or taken from the kernel cache) the first time a node needs them, one module per dim,
// so a process compiles only the dims it runs. Null where neither is possible.
const AttentionKernels* kernels_for(int dim) {
  static std::mutex mutex;
  static std::map<int, AttentionKernels> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto at = loaded.find(dim); at != loaded.end()) return &at->second;
  auto from = [&](cuda::CUmodule module) {
    auto function = [&](const char* kind) {
      return cuda::get_function(module, fmt::format("mt_attention_{}_{}", kind, dim));
    };
    return AttentionKernels{function("forward"), function("rows"), function("keys"),
                            function("values")};
  };
  if (cuda::CUmodule module = prebuilt_module.load()) {
    try {
      return &(loaded[dim] = from(module));
    } catch (const Error&) {  // the artifact's programs have no attention of this dim
    }
  }
  if (!nvrtc_available()) return nullptr;
  std::string image =
      compile_cuda(cuda_attention_source(dim), nvrtc_target(cuda::compute_capability()),
                   fmt::format("mixtape_attention_{}.cu", dim));
  return &(loaded[dim] =
               from(cuda::load_module(std::span<const char>(image.data(), image.size()))));
}

void launch_rows(cuda::CUfunction function, int64_t batch, int64_t rows, void** params) {
  const int64_t blocks = batch * ((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  if (blocks == 0) return;
  cuda::launch(function, {static_cast<unsigned>(blocks), 1, 1}, {kRowsPerBlock, 1, 1}, 0, params);
  ++execution_counters().kernels;
}

}  // namespace

std::string cuda_attention_kernels(const std::set<int>& dims) {
  std::string out = fmt::format("#define MT_ATT_ROW_STATS {}\n", kAttentionRowStats) + source;
  for (int dim : dims) out += fmt::format("MT_ATTENTION_KERNELS({})\n", dim);
  return out;
}

std::string cuda_attention_source(int dim) {
  return cuda_fixed_kernels_source() + cuda_attention_kernels({dim});
}

int attention_kernel_dim(const Node& node) {
  if (op_info(node.op).kind != OpKind::Attention) return 0;
  return padded_dim(node.inputs[0]->shape.back(), node.inputs[2]->shape.back());
}

void use_prebuilt_attention_kernels(cuda::CUmodule module) {
  cuda::CUmodule none = nullptr;
  prebuilt_module.compare_exchange_strong(none, module);
}

std::optional<AttentionLaunch> attention_launch(const Node& node) {
  const bool forward = node.op == OpCode::Attention;
  const size_t operands = forward ? 3 : 5;
  const DType compute = node.precision.compute, storage = node.precision.storage_type;
  if (!f32_or_half(compute) || !f32_or_half(storage)) return std::nullopt;
  for (size_t i = 0; i < operands; ++i)
    if (!f32_or_half(node.inputs[i]->value->dtype)) return std::nullopt;
  const AttentionGeometry g = AttentionGeometry::of(node);
  const int dim = padded_dim(g.d, g.dv);
  const int64_t tiles = (std::max(g.tq, g.tk) + kRowsPerBlock - 1) / kRowsPerBlock;
  if (dim == 0 || g.batch * tiles >= (int64_t{1} << 31)) return std::nullopt;
  const Storage* mask = g.has_mask ? node.inputs[operands]->value.get() : nullptr;
  if (mask && !g.bool_mask && !f32_or_half(mask->dtype) && mask->dtype != f64) return std::nullopt;

  AttentionLaunch launch{{}, dim, {g.mask_batch_offset.begin(), g.mask_batch_offset.end()}};
  AttentionKernelArgs& args = launch.args;
  args.batch = g.batch, args.tq = g.tq, args.tk = g.tk, args.d = g.d, args.dv = g.dv;
  args.mask_row_stride = g.mask_row_stride, args.mask_col_stride = g.mask_col_stride;
  args.scale = static_cast<float>(g.scale);
  args.causal = g.causal;
  args.mask_kind = !g.has_mask ? 0 : g.bool_mask ? 1 : 2;
  args.mask_dtype = mask ? static_cast<int32_t>(mask->dtype) : 0;
  if (g.has_dropout) {  // the offset stays on the device: the kernels read it there
    const DropoutDraw draw = DropoutDraw::decisions(node);
    args.dropout = 1, args.seed = draw.seed;
    args.threshold = draw.threshold, args.keep_scale = static_cast<float>(draw.keep_scale);
  }
  auto dtype_of = [&](size_t i) { return static_cast<int32_t>(node.inputs[i]->value->dtype); };
  args.q_dtype = dtype_of(0), args.k_dtype = dtype_of(1), args.v_dtype = dtype_of(2);
  if (!forward) args.o_dtype = dtype_of(3), args.go_dtype = dtype_of(4);
  args.out_dtype = static_cast<int32_t>(storage);
  args.compute = static_cast<int32_t>(compute);
  return launch;
}

bool run_attention_kernels(Node& node) {
  std::optional<AttentionLaunch> launch = attention_launch(node);
  const AttentionKernels* found = launch ? kernels_for(launch->dim) : nullptr;
  if (!found) return false;
  const AttentionKernels& kernels = *found;
  const bool forward = node.op == OpCode::Attention;
  const size_t operands = forward ? 3 : 5;
  AttentionKernelArgs& args = launch->args;
  auto out = device_value(node.precision.storage_type, node.numel());
  if (node.numel() > 0) {
    const std::vector<long long>& offsets = launch->mask_batch;
    cuda::DeviceBuffer mask_batch(std::max<size_t>(offsets.size(), 1) * sizeof(long long));
    if (!offsets.empty()) {
      cuda::upload(mask_batch.address(), offsets.data(), offsets.size() * sizeof(long long));
      execution_counters().bytes_uploaded +=
          static_cast<int64_t>(offsets.size() * sizeof(long long));
    }
    auto address = [&](size_t i) { return device_address(*node.inputs[i]->value); };
    cuda::CUdeviceptr q = address(0), k = address(1), v = address(2),
                      m = args.mask_kind != 0 ? address(operands) : 0,
                      batch_offsets = mask_batch.address(),
                      offset = args.dropout ? address(node.inputs.size() - 1) : 0,
                      to = device_address(*out);
    if (forward) {
      void* params[] = {&q, &k, &v, &m, &batch_offsets, &offset, &to, &args};
      launch_rows(kernels.forward, args.batch, args.tq, params);
    } else {
      cuda::CUdeviceptr o = address(3), go = address(4);
      cuda::DeviceBuffer stats(std::max<int64_t>(kAttentionRowStats * args.batch * args.tq, 1) *
                               sizeof(float));
      cuda::CUdeviceptr stats_at = stats.address();
      void* rows[] = {&q, &k, &v, &o, &go, &m, &batch_offsets, &offset, &stats_at, &to, &args};
      launch_rows(kernels.rows, args.batch, args.tq, rows);
      void* keys[] = {&q, &k, &v, &go, &m, &batch_offsets, &offset, &stats_at, &to, &args};
      launch_rows(kernels.keys, args.batch, args.tk, keys);
      launch_rows(kernels.values, args.batch, args.tk, keys);
    }
  }
  node.value = std::move(out);
  return true;
}

}  // namespace mixtape
