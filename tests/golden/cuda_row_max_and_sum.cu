#ifndef MIXTAPE_CUDA_PRELUDE_V1
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
// NaN-propagating max, one element after another (emit_llvm's accumulate): a NaN wins, and
// nothing replaces a NaN but a later NaN.
template <typename T>
static __device__ __forceinline__ T mt_max_step(T acc, T x) {
  return (x != x || (acc == acc && x > acc)) ? x : acc;
}
// The same with the index of the element kept, for reductions split across threads: merging
// two partial results then gives exactly what the sequential loop gives (the last NaN, else the
// first of the largest values), in whatever order the partials come.
template <typename T>
static __device__ __forceinline__ void mt_max_step_at(T& acc, long long& at, T x, long long x_at) {
  if (x != x || (acc == acc && x > acc)) {
    acc = x;
    at = x_at;
  }
}
template <typename T>
static __device__ __forceinline__ void mt_max_merge(T& acc, long long& at, T other,
                                                    long long other_at) {
  bool acc_nan = acc != acc, other_nan = other != other;
  bool take = other_nan ? (!acc_nan || other_at > at)
                        : (!acc_nan && (other > acc || (other == acc && other_at < at)));
  if (take) {
    acc = other;
    at = other_at;
  }
}
#endif  // MIXTAPE_CUDA_PRELUDE_V1

// mixtape kernel golden_row_max_and_sum: reduction, a block per outer point over [6, 100], reduced from dim 1; launch 6 x 128 threads
extern "C" __global__ void __launch_bounds__(128) golden_row_max_and_sum(
    const unsigned short* __restrict__ p0,
    float* __restrict__ p1,
    float* __restrict__ p2) {
  // Launched with exactly 128 threads per block.
  const long long outer_total = 6, inner_total = 100;
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ float partial0[4];
  __shared__ long long partial0_at[4];
  __shared__ float partial1[4];
  for (long long outer = blockIdx.x; outer < outer_total; outer += gridDim.x) {
    const long long i0 = outer;
    float acc0 = __uint_as_float(0xFF800000u);
    long long acc0_at = 9223372036854775807LL;
    float acc1 = 0.0f;
    for (long long inner = threadIdx.x; inner < inner_total; inner += blockDim.x) {
      const long long i1 = inner;
      const float v0 = mt_f16_to_f32(p0[i0 * 100 + i1]);
      mt_max_step_at(acc0, acc0_at, v0, inner);
      acc1 = __fadd_rn(acc1, v0);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      mt_max_merge(acc0, acc0_at, __shfl_down_sync(0xFFFFFFFFu, acc0, offset), __shfl_down_sync(0xFFFFFFFFu, acc0_at, offset));
      acc1 = __fadd_rn(acc1, __shfl_down_sync(0xFFFFFFFFu, acc1, offset));
    }
    if (lane == 0) {
      partial0[warp] = acc0;
      partial0_at[warp] = acc0_at;
      partial1[warp] = acc1;
    }
    __syncthreads();
    if (warp == 0) {
      acc0 = lane < 4 ? partial0[lane] : __uint_as_float(0xFF800000u);
      acc0_at = lane < 4 ? partial0_at[lane] : 9223372036854775807LL;
      acc1 = lane < 4 ? partial1[lane] : 0.0f;
      for (int offset = 16; offset > 0; offset >>= 1) {
        mt_max_merge(acc0, acc0_at, __shfl_down_sync(0xFFFFFFFFu, acc0, offset), __shfl_down_sync(0xFFFFFFFFu, acc0_at, offset));
        acc1 = __fadd_rn(acc1, __shfl_down_sync(0xFFFFFFFFu, acc1, offset));
      }
      if (lane == 0) {
        const float e0 = acc0;
        const float e1 = acc1;
        const float e2 = logf(e1);
        const float e3 = __fsub_rn(e2, e0);
        p1[i0] = e0;
        p2[i0] = e3;
      }
    }
    __syncthreads();  // the partials are rewritten for the next outer point
  }
}
