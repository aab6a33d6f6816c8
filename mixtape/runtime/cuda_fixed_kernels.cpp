// mixtape/runtime/cuda_fixed_kernels.cpp -- the fixed kernels' source, their lazy compile, and
// launches (data movement from the plans of runtime/movement_plan.h).
#include "mixtape/runtime/cuda_fixed_kernels.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <mutex>
#include <span>
#include <type_traits>

#include <fmt/format.h>

#include "mixtape/codegen/emit_cuda.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/conv.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/vision.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_attention.h"
#include "mixtape/runtime/cuda_values.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/movement_plan.h"
#include "mixtape/runtime/program.h"
#include "mixtape/runtime/random_fill.h"
#include "mixtape/runtime/reference_executor.h"

namespace mixtape {
namespace {

constexpr int max_box_rank = 8;
constexpr unsigned block = 256;
constexpr int64_t max_grid = 8192;

// The kernels' box argument, word for word (mt_box in the source).
struct BoxArgs {
  int64_t count, src_base, dst_base, rank;
  int64_t shape[max_box_rank], src_stride[max_box_rank], dst_stride[max_box_rank];
};

constexpr const char* kernels = R"(
// mixtape's fixed kernels (runtime/cuda_fixed_kernels.h): box copies, row gathers and row sums
// for the data movement ops, and the rand/randn streams.
struct mt_box {
  long long count, src_base, dst_base, rank;
  long long shape[8], src_stride[8], dst_stride[8];
};
template <typename T>
static __device__ __forceinline__ void mt_copy_box(const T* __restrict__ src, T* __restrict__ dst,
                                                   const mt_box& box) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < box.count;
       e += stride) {
    long long rest = e, s = box.src_base, d = box.dst_base;
    for (long long k = box.rank - 1; k >= 0; --k) {
      const long long c = rest % box.shape[k];
      rest /= box.shape[k];
      s += c * box.src_stride[k];
      d += c * box.dst_stride[k];
    }
    dst[d] = src[s];
  }
}
// dst[o, j, i] = src[o, index[j], i] over [outer, count, inner]; indices checked on the host.
template <typename T>
static __device__ __forceinline__ void mt_index_select(const T* __restrict__ src,
                                                       const long long* __restrict__ index,
                                                       T* __restrict__ dst, long long total,
                                                       long long count, long long dim,
                                                       long long inner) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += stride) {
    const long long i = e % inner, row = e / inner, j = row % count, o = row / count;
    dst[e] = src[(o * dim + index[j]) * inner + i];
  }
}
#define MT_MOVEMENT(BYTES, T)                                                                   \
  extern "C" __global__ void mt_copy_box_##BYTES(const T* __restrict__ src, T* __restrict__ dst, \
                                                 const mt_box box) {                            \
    mt_copy_box(src, dst, box);                                                                 \
  }                                                                                             \
  extern "C" __global__ void mt_index_select_##BYTES(                                           \
      const T* __restrict__ src, const long long* __restrict__ index, T* __restrict__ dst,      \
      long long total, long long count, long long dim, long long inner) {                       \
    mt_index_select(src, index, dst, total, count, dim, inner);                                 \
  }
MT_MOVEMENT(1, unsigned char)
MT_MOVEMENT(2, unsigned short)
MT_MOVEMENT(4, unsigned int)
MT_MOVEMENT(8, unsigned long long)

// Float values as the reference's index_add reads them (exactly, as doubles) and stores them
// (f64 -> f32 round to nearest even; -> f16/bf16 through round-to-odd f32).
static __device__ __forceinline__ double mt_load_as_double(const void* p, int dtype, long long i) {
  switch (dtype) {
    case MT_F32:
      return static_cast<const float*>(p)[i];
    case MT_F64:
      return static_cast<const double*>(p)[i];
    case MT_F16:
      return mt_f16_to_f32(static_cast<const unsigned short*>(p)[i]);
    default:
      return mt_bf16_to_f32(static_cast<const unsigned short*>(p)[i]);
  }
}
static __device__ __forceinline__ void mt_store_double(void* p, int dtype, long long i, double v) {
  switch (dtype) {
    case MT_F32:
      static_cast<float*>(p)[i] = __double2float_rn(v);
      break;
    case MT_F64:
      static_cast<double*>(p)[i] = v;
      break;
    case MT_F16:
      static_cast<unsigned short*>(p)[i] = mt_f32_to_f16(mt_f64_to_f32_odd(v));
      break;
    default:
      static_cast<unsigned short*>(p)[i] = mt_f32_to_bf16(mt_round_bf16(mt_f64_to_f32_odd(v)));
      break;
  }
}
// out[o, r, i] = base[o, r, i] + the sources of row r in plan order, summed in f64 as the
// reference sums: the same bits, whatever the schedule.
extern "C" __global__ void mt_index_add(const void* base, int base_dtype, const void* source,
                                        int source_dtype, const long long* __restrict__ offsets,
                                        const long long* __restrict__ order, void* out,
                                        int out_dtype, long long total, long long count,
                                        long long dim, long long inner) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += stride) {
    const long long i = e % inner, r = (e / inner) % dim, o = e / inner / dim;
    double acc = mt_load_as_double(base, base_dtype, e);
    for (long long q = offsets[r]; q < offsets[r + 1]; ++q)
      acc = __dadd_rn(acc, mt_load_as_double(source, source_dtype, (o * count + order[q]) * inner + i));
    mt_store_double(out, out_dtype, e, acc);
  }
}

// out[i] = pieces[i] + pieces[width + i] + ... over `processes` pieces, added left to right in
// the accumulator (MT_F32: f32, MT_F64: f64, else 64-bit integers) and rounded once, as the host
// path of the collectives adds (runtime/all_reduce.cpp): the rank-order sum of a data-parallel
// reduction, the same bits on every back end.
static __device__ __forceinline__ long long mt_load_integer(const void* p, int dtype, long long i) {
  return dtype == MT_I64   ? static_cast<const long long*>(p)[i]
         : dtype == MT_I32 ? static_cast<const int*>(p)[i]
                           : static_cast<const unsigned char*>(p)[i];
}
extern "C" __global__ void mt_rank_order_sum(const void* pieces, void* out, int dtype, int accum,
                                             long long width, int processes) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < width;
       i += stride) {
    if (accum == MT_F32) {
      float acc = static_cast<float>(mt_load_as_double(pieces, dtype, i));
      for (int q = 1; q < processes; ++q)
        acc = __fadd_rn(acc, static_cast<float>(mt_load_as_double(pieces, dtype, q * width + i)));
      mt_store_double(out, dtype, i, acc);  // exact in f64, so rounded once to dtype
    } else if (accum == MT_F64) {
      double acc = mt_load_as_double(pieces, dtype, i);
      for (int q = 1; q < processes; ++q)
        acc = __dadd_rn(acc, mt_load_as_double(pieces, dtype, q * width + i));
      mt_store_double(out, dtype, i, acc);
    } else {
      long long acc = mt_load_integer(pieces, dtype, i);
      for (int q = 1; q < processes; ++q) acc += mt_load_integer(pieces, dtype, q * width + i);
      if (dtype == MT_I64)
        static_cast<long long*>(out)[i] = acc;
      else if (dtype == MT_I32)
        static_cast<int*>(out)[i] = static_cast<int>(acc);
      else
        static_cast<unsigned char*>(out)[i] = acc != 0;
    }
  }
}

// ---- convolutions (dsl/conv.h's three primitives), the reference's sums: operands rounded to the
// compute type, exact products summed in f64 (rounded through a half accumulator where the node
// accumulates in one) in the reference's order, one thread per result element, so every element
// has the reference's bits whatever the schedule. Direct loops: correct everywhere, far from a
// tensor-core convolution's speed.
struct mt_conv {
  long long n, c, h, w, o, kh, kw, oh, ow;
  long long stride[2], pad[2], dil[2], groups;
  int a_dtype, b_dtype, out_dtype, compute, accum, unused;
};
static __device__ __forceinline__ double mt_round_through(double v, int dtype) {
  unsigned long long slot = 0;
  mt_store_double(&slot, dtype, 0, v);
  return mt_load_as_double(&slot, dtype, 0);
}
static __device__ __forceinline__ double mt_conv_operand(const void* p, int dtype, int compute,
                                                         long long i) {
  const double v = mt_load_as_double(p, dtype, i);
  return compute == dtype || compute == MT_F64 ? v : mt_round_through(v, compute);
}
static __device__ __forceinline__ double mt_conv_add(const mt_conv& g, double sum, double a,
                                                     double b) {
  const double s = __dadd_rn(sum, __dmul_rn(a, b));
  return g.accum == MT_F16 || g.accum == MT_BF16 ? mt_round_through(s, g.accum) : s;
}
#define MT_CONV_ELEMENTS(COUNT)                                                             \
  for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < (COUNT); \
       e += static_cast<long long>(gridDim.x) * blockDim.x)
// y[n, o, oy, ox] = sum over (ic, ky, kx) of x * w.
extern "C" __global__ void mt_conv2d(const void* x, const void* w, void* y, const mt_conv g) {
  const long long cg = g.c / g.groups, og = g.o / g.groups;
  MT_CONV_ELEMENTS(g.n * g.o * g.oh * g.ow) {
    const long long ox = e % g.ow, oy = e / g.ow % g.oh, o = e / g.ow / g.oh % g.o,
                    n = e / g.ow / g.oh / g.o, first = o / og * cg;
    double acc = 0;
    for (long long ic = 0; ic < cg; ++ic)
      for (long long ky = 0; ky < g.kh; ++ky) {
        const long long iy = oy * g.stride[0] - g.pad[0] + ky * g.dil[0];
        if (iy < 0 || iy >= g.h) continue;
        for (long long kx = 0; kx < g.kw; ++kx) {
          const long long ix = ox * g.stride[1] - g.pad[1] + kx * g.dil[1];
          if (ix < 0 || ix >= g.w) continue;
          acc = mt_conv_add(
              g, acc,
              mt_conv_operand(x, g.a_dtype, g.compute, ((n * g.c + first + ic) * g.h + iy) * g.w + ix),
              mt_conv_operand(w, g.b_dtype, g.compute, ((o * cg + ic) * g.kh + ky) * g.kw + kx));
        }
      }
    mt_store_double(y, g.out_dtype, e, acc);
  }
}
// The first output position at or after `low` (in input coordinates) along one axis: outputs p
// whose window reaches input i through a tap k = (i + pad - p stride) / dil with 0 <= k < size.
static __device__ __forceinline__ long long mt_first_output(long long i, long long pad,
                                                            long long stride, long long dil,
                                                            long long size) {
  const long long reach = i + pad - (size - 1) * dil;  // p stride >= reach
  return reach <= 0 ? 0 : (reach + stride - 1) / stride;
}
// gx[n, c, iy, ix] = sum over (o, oy, ox) whose window holds (iy, ix) of gy * w, in that order.
extern "C" __global__ void mt_conv2d_input_grad(const void* gy, const void* w, void* gx,
                                                const mt_conv g) {
  const long long cg = g.c / g.groups, og = g.o / g.groups;
  MT_CONV_ELEMENTS(g.n * g.c * g.h * g.w) {
    const long long ix = e % g.w, iy = e / g.w % g.h, c = e / g.w / g.h % g.c,
                    n = e / g.w / g.h / g.c, ic = c % cg, first = c / cg * og;
    const long long oy0 = mt_first_output(iy, g.pad[0], g.stride[0], g.dil[0], g.kh);
    const long long ox0 = mt_first_output(ix, g.pad[1], g.stride[1], g.dil[1], g.kw);
    double acc = 0;
    for (long long o = first; o < first + og; ++o)
      for (long long oy = oy0; oy < g.oh && oy * g.stride[0] <= iy + g.pad[0]; ++oy) {
        const long long dy = iy + g.pad[0] - oy * g.stride[0];
        if (dy % g.dil[0] != 0) continue;
        const long long ky = dy / g.dil[0];
        for (long long ox = ox0; ox < g.ow && ox * g.stride[1] <= ix + g.pad[1]; ++ox) {
          const long long dx = ix + g.pad[1] - ox * g.stride[1];
          if (dx % g.dil[1] != 0) continue;
          const long long kx = dx / g.dil[1];
          acc = mt_conv_add(
              g, acc,
              mt_conv_operand(gy, g.a_dtype, g.compute, ((n * g.o + o) * g.oh + oy) * g.ow + ox),
              mt_conv_operand(w, g.b_dtype, g.compute, ((o * cg + ic) * g.kh + ky) * g.kw + kx));
        }
      }
    mt_store_double(gx, g.out_dtype, e, acc);
  }
}
// gw[o, ic, ky, kx] = sum over (n, oy, ox) of x * gy, in that order.
extern "C" __global__ void mt_conv2d_weight_grad(const void* x, const void* gy, void* gw,
                                                 const mt_conv g) {
  const long long cg = g.c / g.groups, og = g.o / g.groups;
  MT_CONV_ELEMENTS(g.o * cg * g.kh * g.kw) {
    const long long kx = e % g.kw, ky = e / g.kw % g.kh, ic = e / g.kw / g.kh % cg,
                    o = e / g.kw / g.kh / cg, c = o / og * cg + ic;
    double acc = 0;
    for (long long n = 0; n < g.n; ++n)
      for (long long oy = 0; oy < g.oh; ++oy) {
        const long long iy = oy * g.stride[0] - g.pad[0] + ky * g.dil[0];
        if (iy < 0 || iy >= g.h) continue;
        for (long long ox = 0; ox < g.ow; ++ox) {
          const long long ix = ox * g.stride[1] - g.pad[1] + kx * g.dil[1];
          if (ix < 0 || ix >= g.w) continue;
          acc = mt_conv_add(
              g, acc,
              mt_conv_operand(x, g.a_dtype, g.compute, ((n * g.c + c) * g.h + iy) * g.w + ix),
              mt_conv_operand(gy, g.b_dtype, g.compute, ((n * g.o + o) * g.oh + oy) * g.ow + ox));
        }
      }
    mt_store_double(gw, g.out_dtype, e, acc);
  }
}

// The random streams' arithmetic: runtime/random_fill.h's, operation for operation (correctly rounded
// IEEE steps only, in the same order), so every element has the CPU's bits. A thread makes the
// four elements of one Philox block.
static __device__ __forceinline__ void mt_philox(unsigned long long counter, unsigned long long key,
                                                 unsigned w[4]) {
  unsigned k0 = static_cast<unsigned>(key), k1 = static_cast<unsigned>(key >> 32);
  unsigned c0 = static_cast<unsigned>(counter), c1 = static_cast<unsigned>(counter >> 32);
  unsigned c2 = 0, c3 = 0;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned long long p0 = static_cast<unsigned long long>(0xD2511F53u) * c0;
    const unsigned long long p1 = static_cast<unsigned long long>(0xCD9E8D57u) * c2;
    const unsigned next0 = static_cast<unsigned>(p1 >> 32) ^ c1 ^ k0;
    const unsigned next2 = static_cast<unsigned>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<unsigned>(p1);
    c3 = static_cast<unsigned>(p0);
    c0 = next0;
    c2 = next2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  w[0] = c0;
  w[1] = c1;
  w[2] = c2;
  w[3] = c3;
}
static __device__ __forceinline__ float mt_top24_unit(unsigned word) {
  return __fmul_rn(static_cast<float>(static_cast<int>(word >> 8)), 0x1p-24f);
}
static __device__ __forceinline__ float mt_top24_unit_open(unsigned word) {
  return __fmul_rn(static_cast<float>(static_cast<int>((word >> 8) + 1u)), 0x1p-24f);
}
static __device__ __forceinline__ float mt_random_log(float x) {
  const float ln2_hi = 6.9313812256e-01f, ln2_lo = 9.0580006145e-06f;
  const float lg1 = 0xaaaaaa.0p-24f, lg2 = 0xccce13.0p-25f, lg3 = 0x91e9ee.0p-25f,
              lg4 = 0xf89e26.0p-26f;
  const unsigned bits = __float_as_uint(x) + (0x3f800000u - 0x3f3504f3u);
  const int k = static_cast<int>(bits >> 23) - 0x7f;
  const float m = __uint_as_float((bits & 0x007fffffu) + 0x3f3504f3u);
  const float f = __fsub_rn(m, 1.0f);
  const float s = __fdiv_rn(f, __fadd_rn(2.0f, f));
  const float z = __fmul_rn(s, s);
  const float w = __fmul_rn(z, z);
  const float t1 = __fmul_rn(w, __fadd_rn(lg2, __fmul_rn(w, lg4)));
  const float t2 = __fmul_rn(z, __fadd_rn(lg1, __fmul_rn(w, lg3)));
  const float r = __fadd_rn(t2, t1);
  const float half_f_squared = __fmul_rn(__fmul_rn(0.5f, f), f);
  const float dk = static_cast<float>(k);
  float sum = __fmul_rn(s, __fadd_rn(half_f_squared, r));
  sum = __fadd_rn(sum, __fmul_rn(dk, ln2_lo));
  sum = __fsub_rn(sum, half_f_squared);
  sum = __fadd_rn(sum, f);
  return __fadd_rn(sum, __fmul_rn(dk, ln2_hi));
}
static __device__ __forceinline__ void mt_random_sincos(unsigned k, float& sin_out,
                                                        float& cos_out) {
  const float s1_rest = 0.0707963267948966192f, s3 = -0.645964097506246254f,
              s5 = 0.0796926262461670451f, s7 = -0.00468175413531868810f,
              s9 = 0.000160441184787359821f;
  const float c2 = -1.23370055013616983f, c4 = 0.253669507901048014f,
              c6 = -0.0208634807633529609f, c8 = 0.000919260274839426256f,
              c10 = -0.0000252020423730606054f;
  const unsigned quadrant = k >> 22, fraction = k & 0x3fffffu;
  const bool reflect = fraction > 0x200000u;
  const unsigned reduced = reflect ? 0x400000u - fraction : fraction;
  const float t = __fmul_rn(static_cast<float>(static_cast<int>(reduced)), 0x1p-22f);
  const float t2 = __fmul_rn(t, t);
  // Horner's rule, innermost first, as the CPU's nested expressions evaluate.
  float sin_rest = __fadd_rn(s7, __fmul_rn(t2, s9));
  sin_rest = __fadd_rn(s5, __fmul_rn(t2, sin_rest));
  sin_rest = __fadd_rn(s3, __fmul_rn(t2, sin_rest));
  sin_rest = __fadd_rn(s1_rest, __fmul_rn(t2, sin_rest));
  const float sin_t = __fadd_rn(__fmul_rn(1.5f, t), __fmul_rn(t, sin_rest));
  float cos_t = __fadd_rn(c8, __fmul_rn(t2, c10));
  cos_t = __fadd_rn(c6, __fmul_rn(t2, cos_t));
  cos_t = __fadd_rn(c4, __fmul_rn(t2, cos_t));
  cos_t = __fadd_rn(c2, __fmul_rn(t2, cos_t));
  cos_t = __fadd_rn(1.0f, __fmul_rn(t2, cos_t));
  const float sin_f = reflect ? cos_t : sin_t, cos_f = reflect ? sin_t : cos_t;
  const bool odd = (quadrant & 1u) != 0;
  const float sin_q = odd ? cos_f : sin_f, cos_q = odd ? sin_f : cos_f;
  const unsigned sin_sign = (quadrant >> 1) << 31;
  const unsigned cos_sign = ((quadrant ^ (quadrant >> 1)) & 1u) << 31;
  sin_out = __uint_as_float(__float_as_uint(sin_q) ^ sin_sign);
  cos_out = __uint_as_float(__float_as_uint(cos_q) ^ cos_sign);
}
// The four f32 values of Philox block `counter`: rand's, or randn's when `normal`.
static __device__ __forceinline__ void mt_random_block(unsigned long long counter,
                                                       unsigned long long seed, int normal,
                                                       float v[4]) {
  unsigned w[4];
  mt_philox(counter, seed, w);
  if (!normal) {
    for (int k = 0; k < 4; ++k) v[k] = mt_top24_unit(w[k]);
    return;
  }
  for (int pair = 0; pair < 2; ++pair) {
    const float radius =
        __fsqrt_rn(__fmul_rn(-2.0f, mt_random_log(mt_top24_unit_open(w[2 * pair]))));
    float sin_angle, cos_angle;
    mt_random_sincos(w[2 * pair + 1] >> 8, sin_angle, cos_angle);
    v[2 * pair] = __fmul_rn(radius, cos_angle);
    v[2 * pair + 1] = __fmul_rn(radius, sin_angle);
  }
}

// ---- max pooling (dsl/vision.h's two primitives), the reference's bits: each window's pick is
// the reference's (over the taps inside the input in row-major window order: the first, then any
// greater or NaN); the gradient gathers, per input element, the gradients of the windows that
// pick it in output order, summed in f32 (f64 when wide) as the reference sums them.
struct mt_pool {
  long long n, c, h, w, oh, ow;
  long long kernel[2], stride[2], pad[2], dil[2];
  int x_dtype, g_dtype, out_dtype, wide;
};
// The x index window (plane, oy, ox) picks, or -1 where it has no tap inside the input.
static __device__ __forceinline__ long long mt_pool_pick(const void* x, const mt_pool& g,
                                                         long long plane, long long oy,
                                                         long long ox) {
  long long pick = -1;
  double best = 0;
  for (long long ky = 0; ky < g.kernel[0]; ++ky) {
    const long long iy = oy * g.stride[0] - g.pad[0] + ky * g.dil[0];
    if (iy < 0 || iy >= g.h) continue;
    for (long long kx = 0; kx < g.kernel[1]; ++kx) {
      const long long ix = ox * g.stride[1] - g.pad[1] + kx * g.dil[1];
      if (ix < 0 || ix >= g.w) continue;
      const long long at = (plane * g.h + iy) * g.w + ix;
      const double v = mt_load_as_double(x, g.x_dtype, at);
      if (pick < 0 || v > best || v != v) {
        pick = at;
        best = v;
      }
    }
  }
  return pick;
}
extern "C" __global__ void mt_max_pool2d(const void* x, void* y, const mt_pool g) {
  MT_CONV_ELEMENTS(g.n * g.c * g.oh * g.ow) {
    const long long ox = e % g.ow, oy = e / g.ow % g.oh, plane = e / g.ow / g.oh;
    const long long pick = mt_pool_pick(x, g, plane, oy, ox);
    mt_store_double(y, g.out_dtype, e,
                    pick < 0 ? __longlong_as_double(static_cast<long long>(0xFFF0000000000000ULL))
                             : mt_load_as_double(x, g.x_dtype, pick));
  }
}
static __device__ __forceinline__ long long mt_pool_last(long long outputs, long long at,
                                                         long long stride) {
  const long long last = at / stride;
  return last < outputs - 1 ? last : outputs - 1;
}
extern "C" __global__ void mt_max_pool2d_grad(const void* x, const void* gy, void* gx,
                                              const mt_pool g) {
  MT_CONV_ELEMENTS(g.n * g.c * g.h * g.w) {
    const long long ix = e % g.w, iy = e / g.w % g.h, plane = e / g.w / g.h;
    double acc = 0;
    // The last windows that can reach (iy, ix): those starting at or before it.
    const long long oy_end = mt_pool_last(g.oh, iy + g.pad[0], g.stride[0]);
    const long long ox_end = mt_pool_last(g.ow, ix + g.pad[1], g.stride[1]);
    for (long long oy = mt_first_output(iy, g.pad[0], g.stride[0], g.dil[0], g.kernel[0]);
         oy <= oy_end; ++oy) {
      if ((iy + g.pad[0] - oy * g.stride[0]) % g.dil[0] != 0) continue;
      for (long long ox = mt_first_output(ix, g.pad[1], g.stride[1], g.dil[1], g.kernel[1]);
           ox <= ox_end; ++ox) {
        if ((ix + g.pad[1] - ox * g.stride[1]) % g.dil[1] != 0) continue;
        if (mt_pool_pick(x, g, plane, oy, ox) != e) continue;
        const double v = mt_load_as_double(gy, g.g_dtype, (plane * g.oh + oy) * g.ow + ox);
        acc = g.wide ? __dadd_rn(acc, v)
                     : static_cast<double>(__fadd_rn(static_cast<float>(acc), static_cast<float>(v)));
      }
    }
    mt_store_double(gx, g.out_dtype, e, acc);
  }
}

// out[i] = in[i] converted between f32, f16 and bf16, rounded to nearest even as emitted stores
// round (a Load, then RoundTo for a 16-bit result).
extern "C" __global__ void mt_convert(const void* __restrict__ in, int in_dtype,
                                      void* __restrict__ out, int out_dtype, long long count) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const float v = in_dtype == MT_F32   ? static_cast<const float*>(in)[i]
                    : in_dtype == MT_F16 ? mt_f16_to_f32(static_cast<const unsigned short*>(in)[i])
                                         : mt_bf16_to_f32(static_cast<const unsigned short*>(in)[i]);
    if (out_dtype == MT_F32)
      static_cast<float*>(out)[i] = v;
    else if (out_dtype == MT_F16)
      static_cast<unsigned short*>(out)[i] = mt_f32_to_f16(mt_round_f16(v));
    else
      static_cast<unsigned short*>(out)[i] = mt_f32_to_bf16(mt_round_bf16(v));
  }
}
// Elements [0, count) of the stream (seed, offset): rand, or randn when `normal`, stored as
// dtype (f32, f16 or bf16; rand's values that round up to 1 take the largest one below).
extern "C" __global__ void mt_random_fill(void* out, int dtype, int normal, long long count,
                                          unsigned long long seed,
                                          const unsigned long long* offset_value) {
  const unsigned long long offset = *offset_value;  // the generator's, computed on the device
  const long long blocks = (count + 3) / 4;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long b = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += stride) {
    float v[4];
    mt_random_block(offset + static_cast<unsigned long long>(b), seed, normal, v);
    for (int k = 0; k < 4; ++k) {
      const long long i = 4 * b + k;
      if (i >= count) break;
      if (dtype == MT_F32) {
        static_cast<float*>(out)[i] = v[k];
        continue;
      }
      unsigned short bits = dtype == MT_F16 ? mt_f32_to_f16(v[k]) : mt_f32_to_bf16(mt_round_bf16(v[k]));
      const unsigned short one = dtype == MT_F16 ? 0x3C00 : 0x3F80;
      if (!normal && bits == one) bits -= 1;
      static_cast<unsigned short*>(out)[i] = bits;
    }
  }
}
)";

bool is_float_dtype(DType t) { return t == f32 || t == f64 || is_half(t); }

// The compiled module's functions, compiled (or taken from the kernel cache) on first use.
struct FixedKernels {
  cuda::CUfunction copy_box[4] = {}, index_select[4] = {}, index_add = nullptr,
                   random_fill = nullptr, convert = nullptr, conv[3] = {}, pool[2] = {},
                   rank_order_sum = nullptr;
};

// The max-pooling kernels' geometry argument, word for word (mt_pool in the source).
struct PoolArgs {
  int64_t n, c, h, w, oh, ow;
  int64_t kernel[2], stride[2], pad[2], dil[2];
  int32_t x_dtype, g_dtype, out_dtype, wide;
};

// The convolution kernels' geometry argument, word for word (mt_conv in the source): a
// ConvGeometry is mt_conv's sixteen leading words (n ... ow, then the window's stride, pad, dil
// and groups), so it is passed as it is.
struct ConvArgs {
  ConvGeometry geometry;
  int32_t a_dtype, b_dtype, out_dtype, compute, accum, unused;
};
static_assert(std::is_standard_layout_v<ConvArgs> && sizeof(ConvGeometry) == 16 * sizeof(int64_t) &&
              offsetof(ConvArgs, a_dtype) == 16 * sizeof(int64_t) &&
              sizeof(ConvArgs) == 16 * sizeof(int64_t) + 6 * sizeof(int32_t));

std::atomic<cuda::CUmodule> prebuilt_module{nullptr};

const FixedKernels& fixed_kernels() {
  static FixedKernels loaded;
  static std::once_flag once;
  std::call_once(once, [] {
    cuda::CUmodule module = prebuilt_module.load();
    if (!module) {
      std::string arch = nvrtc_target(cuda::compute_capability());
      std::string image =
          compile_cuda(cuda_fixed_kernels_source(), arch, "mixtape_fixed_kernels.cu");
      module = cuda::load_module(std::span<const char>(image.data(), image.size()));
    }
    for (int w = 0; w < 4; ++w) {
      loaded.copy_box[w] = cuda::get_function(module, fmt::format("mt_copy_box_{}", 1 << w));
      loaded.index_select[w] =
          cuda::get_function(module, fmt::format("mt_index_select_{}", 1 << w));
    }
    loaded.index_add = cuda::get_function(module, "mt_index_add");
    loaded.random_fill = cuda::get_function(module, "mt_random_fill");
    loaded.convert = cuda::get_function(module, "mt_convert");
    loaded.conv[0] = cuda::get_function(module, "mt_conv2d");
    loaded.conv[1] = cuda::get_function(module, "mt_conv2d_input_grad");
    loaded.conv[2] = cuda::get_function(module, "mt_conv2d_weight_grad");
    loaded.pool[0] = cuda::get_function(module, "mt_max_pool2d");
    loaded.pool[1] = cuda::get_function(module, "mt_max_pool2d_grad");
    try {  // an artifact exported before the collectives came to the GPU has no such kernel
      loaded.rank_order_sum = cuda::get_function(module, "mt_rank_order_sum");
    } catch (const Error&) {
    }
  });
  return loaded;
}

int width_slot(DType dtype) { return std::countr_zero(static_cast<unsigned>(size_of(dtype))); }

unsigned grid_for(int64_t elements) {
  return static_cast<unsigned>(std::clamp<int64_t>((elements + block - 1) / block, 1, max_grid));
}

void launch(cuda::CUfunction function, int64_t elements, void** args) {
  cuda::launch(function, {grid_for(elements), 1, 1}, {block, 1, 1}, 0, args);
  ++execution_counters().kernels;
}

}  // namespace

std::shared_ptr<Storage> input_on_device(const Node& node, size_t i) {
  std::shared_ptr<Storage> value = node.inputs[i]->value;
  if (value->dtype == node.precision.storage_type) return value;
  bool convertible = (value->dtype == f32 || is_half(value->dtype)) &&
                     (node.precision.storage_type == f32 || is_half(node.precision.storage_type));
  return convertible ? convert_on_device(*value, node.precision.storage_type) : nullptr;
}

namespace {

void copy_box(const CopyBox& box, Storage& src, Storage& dst) {
  if (box.count() == 0) return;
  BoxArgs args{};
  args.count = box.count();
  args.src_base = box.src_base;
  args.dst_base = box.dst_base;
  args.rank = static_cast<int64_t>(box.shape.size());
  for (size_t k = 0; k < box.shape.size(); ++k) {
    args.shape[k] = box.shape[k];
    args.src_stride[k] = box.src_stride[k];
    args.dst_stride[k] = box.dst_stride[k];
  }
  cuda::CUdeviceptr from = device_address(src), to = device_address(dst);
  void* params[] = {&from, &to, &args};
  launch(fixed_kernels().copy_box[width_slot(dst.dtype)], args.count, params);
}

// A device copy of host integers (plans and indices), freed in stream order after its reader.
cuda::DeviceBuffer upload_int64(const std::vector<int64_t>& values) {
  cuda::DeviceBuffer buffer(std::max<size_t>(values.size(), 1) * sizeof(int64_t));
  if (!values.empty())
    cuda::upload(buffer.address(), values.data(), values.size() * sizeof(int64_t));
  execution_counters().bytes_uploaded += static_cast<int64_t>(values.size() * sizeof(int64_t));
  return buffer;
}

bool run_concat(Node& node) {
  std::vector<CopyBox> boxes = concat_boxes(node);
  for (const CopyBox& box : boxes)
    if (box.shape.size() > max_box_rank) return false;
  std::vector<std::shared_ptr<Storage>> inputs;
  for (size_t i = 0; i < node.inputs.size(); ++i) {
    inputs.push_back(input_on_device(node, i));
    if (!inputs.back()) return false;
  }
  auto out = device_value(node.precision.storage_type, node.numel());
  for (size_t i = 0; i < boxes.size(); ++i) copy_box(boxes[i], *inputs[i], *out);
  node.value = std::move(out);
  return true;
}

bool run_unslice(Node& node) {
  CopyBox box = unslice_box(node);
  if (box.shape.size() > max_box_rank) return false;
  std::shared_ptr<Storage> input = input_on_device(node, 0);
  if (!input) return false;
  auto out = device_value(node.precision.storage_type, node.numel());
  cuda::memset_async(device_address(*out), 0, static_cast<size_t>(out->size_bytes()));
  copy_box(box, *input, *out);
  node.value = std::move(out);
  return true;
}

// outer, dim (of the indexed axis) and inner of `shape` around `axis`.
struct AxisSplit {
  int64_t outer = 1, dim = 1, inner = 1;
};
AxisSplit split_at(const Shape& shape, int64_t axis) {
  AxisSplit s;
  for (int64_t d = 0; d < axis; ++d) s.outer *= shape[d];
  s.dim = shape[axis];
  for (size_t d = static_cast<size_t>(axis) + 1; d < shape.size(); ++d) s.inner *= shape[d];
  return s;
}

bool run_index_select(Node& node) {
  std::shared_ptr<Storage> input = input_on_device(node, 0);
  if (!input) return false;
  std::vector<int64_t> index = checked_indices(node);
  AxisSplit s = split_at(node.inputs[0]->shape, node.attrs.axis);
  auto out = device_value(node.precision.storage_type, node.numel());
  int64_t total = node.numel(), count = static_cast<int64_t>(index.size());
  if (total > 0) {
    cuda::DeviceBuffer rows = upload_int64(index);
    cuda::CUdeviceptr from = device_address(*input), at = rows.address(), to = device_address(*out);
    void* params[] = {&from, &at, &to, &total, &count, &s.dim, &s.inner};
    launch(fixed_kernels().index_select[width_slot(node.precision.storage_type)], total, params);
  }
  node.value = std::move(out);
  return true;
}

bool run_index_add(Node& node) {
  Storage& base = *node.inputs[0]->value;
  Storage& source = *node.inputs[2]->value;
  // A 16-bit accumulator (a custom policy's) is the reference loops' to honour.
  if (!is_float_dtype(node.precision.storage_type) || !is_float_dtype(base.dtype) ||
      !is_float_dtype(source.dtype) || is_half(node.precision.accum))
    return false;
  std::vector<int64_t> index = checked_indices(node);
  AxisSplit s = split_at(node.shape, node.attrs.axis);
  IndexAddPlan plan = index_add_plan(index, s.dim);
  auto out = device_value(node.precision.storage_type, node.numel());
  int64_t total = node.numel(), count = static_cast<int64_t>(index.size());
  if (total > 0) {
    cuda::DeviceBuffer offsets = upload_int64(plan.offsets), order = upload_int64(plan.order);
    cuda::CUdeviceptr base_ptr = device_address(base), source_ptr = device_address(source),
                      offsets_ptr = offsets.address(), order_ptr = order.address(),
                      out_ptr = device_address(*out);
    int base_dtype = static_cast<int>(base.dtype), source_dtype = static_cast<int>(source.dtype),
        out_dtype = static_cast<int>(node.precision.storage_type);
    void* params[] = {&base_ptr, &base_dtype, &source_ptr, &source_dtype, &offsets_ptr, &order_ptr,
                      &out_ptr,  &out_dtype,  &total,      &count,        &s.dim,       &s.inner};
    launch(fixed_kernels().index_add, total, params);
  }
  node.value = std::move(out);
  return true;
}

bool run_random_fill(Node& node) {
  if (!has_random_fill(node.precision.storage_type)) return false;
  auto out = device_value(node.precision.storage_type, node.numel());
  long long count = node.numel();
  if (count > 0) {
    cuda::CUdeviceptr to = device_address(*out);
    int dtype = static_cast<int>(node.precision.storage_type),
        normal = node.op == OpCode::RandNormal;
    unsigned long long seed = node.attrs.seed;
    cuda::CUdeviceptr offset = device_address(*node.inputs.at(0)->value);
    void* params[] = {&to, &dtype, &normal, &count, &seed, &offset};
    launch(fixed_kernels().random_fill, (count + 3) / 4, params);
  }
  node.value = std::move(out);
  return true;
}

bool is_float_operand(DType t) { return t == f32 || t == f64 || is_half(t); }

// Conv2d, Conv2dInputGrad and Conv2dWeightGrad: one thread per result element, the reference's
// bits (see mt_conv in the source).
bool run_conv(Node& node) {
  Storage &a = *node.inputs[0]->value, &b = *node.inputs[1]->value;
  if (!is_float_operand(a.dtype) || !is_float_operand(b.dtype) ||
      !is_float_operand(node.precision.storage_type) || !is_float_operand(node.precision.compute))
    return false;
  ConvArgs args{ConvGeometry::of(node),
                static_cast<int32_t>(a.dtype),
                static_cast<int32_t>(b.dtype),
                static_cast<int32_t>(node.precision.storage_type),
                static_cast<int32_t>(node.precision.compute),
                static_cast<int32_t>(node.precision.accum),
                0};
  auto out = device_value(node.precision.storage_type, node.numel());
  if (node.numel() > 0) {
    cuda::CUdeviceptr a_ptr = device_address(a), b_ptr = device_address(b),
                      out_ptr = device_address(*out);
    void* params[] = {&a_ptr, &b_ptr, &out_ptr, &args};
    const int which = node.op == OpCode::Conv2d ? 0 : node.op == OpCode::Conv2dInputGrad ? 1 : 2;
    launch(fixed_kernels().conv[which], node.numel(), params);
  }
  node.value = std::move(out);
  return true;
}

// MaxPool2d and MaxPool2dGrad: one thread per result element, the reference's bits (see
// mt_pool in the source).
bool run_pool(Node& node) {
  Storage& x = *node.inputs[0]->value;
  const bool backward = node.op == OpCode::MaxPool2dGrad;
  Storage* gy = backward ? node.inputs[1]->value.get() : nullptr;
  if (!is_float_operand(x.dtype) || !is_float_operand(node.precision.storage_type) ||
      (gy && !is_float_operand(gy->dtype)))
    return false;
  const PoolGeometry g = PoolGeometry::of(node);
  const PoolWindow& w = g.window;
  PoolArgs args{g.n,
                g.c,
                g.h,
                g.w,
                g.oh,
                g.ow,
                {w.kernel[0], w.kernel[1]},
                {w.stride[0], w.stride[1]},
                {w.pad[0], w.pad[1]},
                {w.dil[0], w.dil[1]},
                static_cast<int32_t>(x.dtype),
                static_cast<int32_t>(gy ? gy->dtype : x.dtype),
                static_cast<int32_t>(node.precision.storage_type),
                node.precision.storage_type == f64 || (gy && gy->dtype == f64)};
  auto out = device_value(node.precision.storage_type, node.numel());
  if (node.numel() > 0) {
    cuda::CUdeviceptr x_ptr = device_address(x), out_ptr = device_address(*out);
    if (backward) {
      cuda::CUdeviceptr gy_ptr = device_address(*gy);
      void* params[] = {&x_ptr, &gy_ptr, &out_ptr, &args};
      launch(fixed_kernels().pool[1], node.numel(), params);
    } else {
      void* params[] = {&x_ptr, &out_ptr, &args};
      launch(fixed_kernels().pool[0], node.numel(), params);
    }
  }
  node.value = std::move(out);
  return true;
}

}  // namespace

void use_prebuilt_fixed_kernels(cuda::CUmodule module) {
  cuda::CUmodule none = nullptr;
  prebuilt_module.compare_exchange_strong(none, module);
}

std::shared_ptr<Storage> convert_on_device(Storage& value, DType dtype) {
  auto out = device_value(dtype, value.count);
  if (value.count > 0) {
    cuda::CUdeviceptr from = device_address(value), to = device_address(*out);
    int in_dtype = static_cast<int>(value.dtype), out_dtype = static_cast<int>(dtype);
    long long count = value.count;
    void* params[] = {&from, &in_dtype, &to, &out_dtype, &count};
    launch(fixed_kernels().convert, count, params);
  }
  return out;
}

std::string cuda_fixed_kernels_source() {
  return std::string(cuda_prelude()) +
         fmt::format(
             "#define MT_F32 {}\n#define MT_F64 {}\n#define MT_F16 {}\n#define MT_BF16 {}\n"
             "#define MT_I32 {}\n#define MT_I64 {}\n",
             static_cast<int>(f32), static_cast<int>(f64), static_cast<int>(f16),
             static_cast<int>(bf16), static_cast<int>(i32), static_cast<int>(i64)) +
         kernels;
}

void add_pieces_on_device(Storage& pieces, int processes, int64_t width, DType accum,
                          Storage& out) {
  if (!fixed_kernels().rank_order_sum)
    fail(
        "the fixed CUDA kernels in use (an exported artifact's) lack mt_rank_order_sum: export "
        "it again with this mixtape to run collectives through NCCL");
  cuda::CUdeviceptr from = device_address(pieces), to = device_address(out);
  int dtype = static_cast<int>(out.dtype), accumulator = static_cast<int>(accum);
  long long count = width;
  void* params[] = {&from, &to, &dtype, &accumulator, &count, &processes};
  launch(fixed_kernels().rank_order_sum, width, params);
}

bool run_fixed_kernel(Node& node) {
  switch (node.op) {
    case OpCode::Concat:
      return run_concat(node);
    case OpCode::Unslice:
      return run_unslice(node);
    case OpCode::IndexSelect:
      return run_index_select(node);
    case OpCode::IndexAdd:
      return run_index_add(node);
    case OpCode::RandUniform:
    case OpCode::RandNormal:
      return run_random_fill(node);
    case OpCode::Conv2d:
    case OpCode::Conv2dInputGrad:
    case OpCode::Conv2dWeightGrad:
      return run_conv(node);
    case OpCode::MaxPool2d:
    case OpCode::MaxPool2dGrad:
      return run_pool(node);
    case OpCode::Attention:
    case OpCode::AttentionBackward:
      return run_attention_kernels(node);
    default:
      return false;
  }
}

}  // namespace mixtape
