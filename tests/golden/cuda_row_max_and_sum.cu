
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
