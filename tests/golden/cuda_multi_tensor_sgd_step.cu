
// mixtape kernel golden_multi_tensor_sgd_step: multi-tensor pointwise, up to 85 segments a launch
struct golden_multi_tensor_sgd_step_segments {
  long long count;
  long long start[86];
  void* pointer[85][4];
  double scalar[85][1];
};
extern "C" __global__ void __launch_bounds__(256) golden_multi_tensor_sgd_step(const golden_multi_tensor_sgd_step_segments table) {
  for (long long seg = 0; seg < table.count; ++seg) {
    const long long total = table.start[seg + 1] - table.start[seg];
    const float* __restrict__ p0 = static_cast<const float*>(table.pointer[seg][0]);
    const float* __restrict__ p1 = static_cast<const float*>(table.pointer[seg][1]);
    const unsigned char* __restrict__ p2 = static_cast<const unsigned char*>(table.pointer[seg][2]);
    float* __restrict__ p3 = static_cast<float*>(table.pointer[seg][3]);
    const double s0 = table.scalar[seg][0];
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
      p3[i0] = v6;
    }
  }
}
