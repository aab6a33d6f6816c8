
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
