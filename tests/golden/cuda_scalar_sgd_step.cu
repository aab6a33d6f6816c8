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

// mixtape kernel golden_scalar_sgd_step: pointwise over [300]; launch 2 x 256 threads
extern "C" __global__ void __launch_bounds__(256) golden_scalar_sgd_step(
    const float* __restrict__ p0,
    const float* __restrict__ p1,
    const unsigned char* __restrict__ p2,
    const int* __restrict__ p3,
    float* __restrict__ p4,
    int* __restrict__ p5,
    double s0) {
  const long long total = 300;
  for (long long point = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; point < total;
       point += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i0 = point;
    const float v0 = p0[i0];
    const float v1 = p1[i0];
    const float v2 = __double2float_rn(s0);
    const float v3 = __fmul_rn(v2, v1);
    const float v4 = __fsub_rn(v0, v3);
    const bool v5 = (p2[0] != 0);
    const float v6 = (v5 ? v0 : v4);
    const long long v7 = static_cast<long long>(p3[0]);
    const long long v8 = 1;
    const long long v9 = mt_add_i64(v7, v8);
    const long long v10 = mt_wrap_i32(v9);
    p4[i0] = v6;
    p5[0] = static_cast<int>(mt_wrap_i32(v10));
  }
}
