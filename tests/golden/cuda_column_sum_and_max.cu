
// mixtape kernel golden_column_sum_and_max: column reduction, 20 blocks per 32 columns over [6, 20000], reduced from dim 1; launch 20 x 256 threads
extern "C" __global__ void __launch_bounds__(256) golden_column_sum_and_max(
    const unsigned short* __restrict__ p0,
    float* __restrict__ p1,
    float* __restrict__ p2,
    unsigned char* __restrict__ workspace) {
  // Launched with exactly 256 threads per block, 20 blocks.
  const long long inner_total = 20000, chunk_points = 1000;
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long tile = blockIdx.x / 20, chunk = blockIdx.x % 20;
  const long long column = tile % 1 * 32 + lane;
  const bool active = column < 6;
  const long long outer = tile / 1 * 6 + column;
  const long long chunk_begin = chunk * chunk_points;
  const long long chunk_end =
      chunk_begin + chunk_points < inner_total ? chunk_begin + chunk_points : inner_total;
  const long long i0 = outer;
  float acc0 = 0.0f;
  float acc1 = __uint_as_float(0xFF800000u);
  if (active) {
    for (long long inner = chunk_begin + warp; inner < chunk_end; inner += blockDim.x / 32) {
      const long long i1 = inner;
      const float v0 = mt_bf16_to_f32(p0[i0 + i1 * 6]);
      acc0 = __fadd_rn(acc0, v0);
      acc1 = mt_max_step(acc1, v0);
    }
  }
  __shared__ float partial0[8][32];
  __shared__ float partial1[8][32];
  partial0[warp][lane] = acc0;
  partial1[warp][lane] = acc1;
  __syncthreads();
  if (warp == 0) {
    for (int w = 1; w < 8; ++w) {
      acc0 = __fadd_rn(acc0, partial0[w][lane]);
      acc1 = mt_max_step(acc1, partial1[w][lane]);
    }
    float* const chunk_partial0 = reinterpret_cast<float*>(workspace);
    float* const chunk_partial1 = reinterpret_cast<float*>(workspace + 8 * 640);
    unsigned* const arrivals = reinterpret_cast<unsigned*>(workspace + 16 * 640);
    int last = 0;
    chunk_partial0[blockIdx.x * 32 + lane] = acc0;
    chunk_partial1[blockIdx.x * 32 + lane] = acc1;
    __threadfence();  // the partials are visible before the count says so
    __syncwarp();  // every lane's, before lane 0 counts the block
    if (lane == 0) last = atomicAdd(&arrivals[tile], 1u) + 1u == static_cast<unsigned>(20);
    last = __shfl_sync(0xFFFFFFFFu, last, 0);
    if (last) {
      __threadfence();
      acc0 = 0.0f;
      acc1 = __uint_as_float(0xFF800000u);
      for (long long c = 0; c < 20; ++c) {
        const long long at = (tile * 20 + c) * 32 + lane;
        const float chunk0 = __ldcg(&chunk_partial0[at]);
        chunk_partial0[at] = 0;
        acc0 = __fadd_rn(acc0, chunk0);
        const float chunk1 = __ldcg(&chunk_partial1[at]);
        chunk_partial1[at] = 0;
        acc1 = mt_max_step(acc1, chunk1);
      }
      if (lane == 0) arrivals[tile] = 0u;  // ready for the next launch
      if (active) {
        const float e0 = acc0;
        const float e1 = acc1;
        p1[i0] = e0;
        p2[i0] = e1;
      }
    }
  }
}
