
// mixtape kernel golden_half_accumulator_sum: reduction, a thread per outer point over [5, 64], reduced from dim 1; launch 1 x 32 threads
extern "C" __global__ void __launch_bounds__(32) golden_half_accumulator_sum(
    const unsigned short* __restrict__ p0,
    unsigned short* __restrict__ p1) {
  const long long outer_total = 5, inner_total = 64;
  for (long long outer = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; outer < outer_total;
       outer += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i0 = outer;
    float acc0 = 0.0f;
    for (long long inner = 0; inner < inner_total; ++inner) {
      const long long i1 = inner;
      const float v0 = mt_bf16_to_f32(p0[i0 + i1 * 5]);
      acc0 = mt_round_bf16(__fadd_rn(acc0, v0));
    }
    const float e0 = acc0;
    const float e1 = mt_round_bf16(e0);
    p1[i0] = mt_f32_to_bf16(e1);
  }
}
