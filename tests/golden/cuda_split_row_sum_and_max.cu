
// mixtape kernel golden_split_row_sum_and_max: reduction, 5 blocks per outer point over [3, 20000], reduced from dim 1; launch 15 x 256 threads
extern "C" __global__ void __launch_bounds__(256) golden_split_row_sum_and_max(
    const unsigned short* __restrict__ p0,
    float* __restrict__ p1,
    float* __restrict__ p2,
    unsigned char* __restrict__ workspace) {
  // Launched with exactly 256 threads per block, 15 blocks.
  const long long inner_total = 20000, chunk_points = 4000;
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ float partial0[8];
  __shared__ float partial1[8];
  __shared__ long long partial1_at[8];
  float* const chunk_partial0 = reinterpret_cast<float*>(workspace);
  float* const chunk_partial1 = reinterpret_cast<float*>(workspace + 8 * 15);
  long long* const chunk_partial1_at = reinterpret_cast<long long*>(workspace + 16 * 15);
  unsigned* const arrivals = reinterpret_cast<unsigned*>(workspace + 24 * 15);
  const long long outer = blockIdx.x / 5, chunk = blockIdx.x % 5;
  const long long chunk_begin = chunk * chunk_points;
  const long long chunk_end =
      chunk_begin + chunk_points < inner_total ? chunk_begin + chunk_points : inner_total;
  const long long i0 = outer;
  float acc0 = 0.0f;
  float acc1 = __uint_as_float(0xFF800000u);
  long long acc1_at = 9223372036854775807LL;
  for (long long inner = chunk_begin + threadIdx.x; inner < chunk_end; inner += blockDim.x) {
    const long long i1 = inner;
    const float v0 = mt_bf16_to_f32(p0[i0 * 20000 + i1]);
    acc0 = __fadd_rn(acc0, v0);
    mt_max_step_at(acc1, acc1_at, v0, inner);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    acc0 = __fadd_rn(acc0, __shfl_down_sync(0xFFFFFFFFu, acc0, offset));
    mt_max_merge(acc1, acc1_at, __shfl_down_sync(0xFFFFFFFFu, acc1, offset), __shfl_down_sync(0xFFFFFFFFu, acc1_at, offset));
  }
  if (lane == 0) {
    partial0[warp] = acc0;
    partial1[warp] = acc1;
    partial1_at[warp] = acc1_at;
  }
  __syncthreads();
  if (warp == 0) {
    acc0 = lane < 8 ? partial0[lane] : 0.0f;
    acc1 = lane < 8 ? partial1[lane] : __uint_as_float(0xFF800000u);
    acc1_at = lane < 8 ? partial1_at[lane] : 9223372036854775807LL;
    for (int offset = 16; offset > 0; offset >>= 1) {
      acc0 = __fadd_rn(acc0, __shfl_down_sync(0xFFFFFFFFu, acc0, offset));
      mt_max_merge(acc1, acc1_at, __shfl_down_sync(0xFFFFFFFFu, acc1, offset), __shfl_down_sync(0xFFFFFFFFu, acc1_at, offset));
    }
    int last = 0;
    if (lane == 0) {
      chunk_partial0[blockIdx.x] = acc0;
      chunk_partial1[blockIdx.x] = acc1;
      chunk_partial1_at[blockIdx.x] = acc1_at;
      __threadfence();  // the partials are visible before the count says so
      last = atomicAdd(&arrivals[outer], 1u) + 1u == static_cast<unsigned>(5);
    }
    last = __shfl_sync(0xFFFFFFFFu, last, 0);
    if (last) {
      __threadfence();
      acc0 = 0.0f;
      acc1 = __uint_as_float(0xFF800000u);
      acc1_at = 9223372036854775807LL;
      for (long long c = lane; c < 5; c += 32) {
        const long long at = outer * 5 + c;
        const float chunk0 = __ldcg(&chunk_partial0[at]);
        chunk_partial0[at] = 0;
        acc0 = __fadd_rn(acc0, chunk0);
        const float chunk1 = __ldcg(&chunk_partial1[at]);
        chunk_partial1[at] = 0;
        const long long chunk1_at = __ldcg(&chunk_partial1_at[at]);
        chunk_partial1_at[at] = 0;
        mt_max_merge(acc1, acc1_at, chunk1, chunk1_at);
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        acc0 = __fadd_rn(acc0, __shfl_down_sync(0xFFFFFFFFu, acc0, offset));
        mt_max_merge(acc1, acc1_at, __shfl_down_sync(0xFFFFFFFFu, acc1, offset), __shfl_down_sync(0xFFFFFFFFu, acc1_at, offset));
      }
      if (lane == 0) {
        arrivals[outer] = 0u;  // ready for the next launch
        const float e0 = acc0;
        const float e1 = acc1;
        p1[i0] = e0;
        p2[i0] = e1;
      }
    }
  }
}
