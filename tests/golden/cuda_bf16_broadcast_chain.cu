
// mixtape kernel golden_bf16_broadcast_chain: pointwise over [4, 8]; launch 1 x 32 threads
extern "C" __global__ void __launch_bounds__(32) golden_bf16_broadcast_chain(
    const unsigned short* __restrict__ p0,
    const unsigned short* __restrict__ p1,
    unsigned short* __restrict__ p2) {
  const long long total = 32;
  for (long long point = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; point < total;
       point += static_cast<long long>(gridDim.x) * blockDim.x) {
    long long point_rest = point;
    const long long i1 = point_rest % 8;
    point_rest /= 8;
    const long long i0 = point_rest;
    const float v0 = mt_bf16_to_f32(p0[i0 * 8 + i1]);
    const float v1 = 0.5f;
    const float v2 = __fmul_rn(v0, v1);
    const float v3 = mt_bf16_to_f32(p1[i1]);
    const float v4 = __fadd_rn(v2, v3);
    const float v5 = mt_round_bf16(v4);
    const float v6 = tanhf(v5);
    const float v7 = mt_round_bf16(v6);
    p2[i0 * 8 + i1] = mt_f32_to_bf16(v7);
  }
}
