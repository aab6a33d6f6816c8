
// mixtape kernel golden_multi_tensor_inf_check: multi-tensor reduction, a block per segment, up to 170 segments a launch
struct golden_multi_tensor_inf_check_segments {
  long long count;
  long long start[171];
  void* pointer[170][2];
};
extern "C" __global__ void __launch_bounds__(256) golden_multi_tensor_inf_check(const golden_multi_tensor_inf_check_segments table) {
  // Launched with exactly 256 threads per block.
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ float partial0[8];
  for (long long seg = blockIdx.x; seg < table.count; seg += gridDim.x) {
    const long long inner_total = table.start[seg + 1] - table.start[seg];
    const unsigned short* __restrict__ p0 = static_cast<const unsigned short*>(table.pointer[seg][0]);
    float* __restrict__ p1 = static_cast<float*>(table.pointer[seg][1]);
    float acc0 = 0.0f;
    for (long long inner = threadIdx.x; inner < inner_total; inner += blockDim.x) {
      const long long i0 = inner;
      const float v0 = mt_bf16_to_f32(p0[i0]);
      const float v1 = __fsub_rn(v0, v0);
      acc0 = __fadd_rn(acc0, v1);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      acc0 = __fadd_rn(acc0, __shfl_down_sync(0xFFFFFFFFu, acc0, offset));
    }
    if (lane == 0) {
      partial0[warp] = acc0;
    }
    __syncthreads();
    if (warp == 0) {
      acc0 = lane < 8 ? partial0[lane] : 0.0f;
      for (int offset = 16; offset > 0; offset >>= 1) {
        acc0 = __fadd_rn(acc0, __shfl_down_sync(0xFFFFFFFFu, acc0, offset));
      }
      if (lane == 0) {
        const float e0 = acc0;
        p1[0] = e0;
      }
    }
    __syncthreads();  // the partials are rewritten for the next outer point
  }
}
