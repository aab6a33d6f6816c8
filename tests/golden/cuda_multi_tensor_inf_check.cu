
// mixtape kernel golden_multi_tensor_inf_check: multi-tensor reduction, blocks by segment size, up to 127 segments a launch
struct golden_multi_tensor_inf_check_segments {
  long long count;
  long long start[128];
  long long first_block[128];
  void* pointer[127][2];
};
extern "C" __global__ void __launch_bounds__(256) golden_multi_tensor_inf_check(const golden_multi_tensor_inf_check_segments table, unsigned char* __restrict__ workspace) {
  // Launched with exactly 256 threads per block, table.first_block[table.count] blocks.
  const long long blocks = table.first_block[table.count];
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ float partial0[8];
  float* const chunk_partial0 = reinterpret_cast<float*>(workspace);
  unsigned* const arrivals = reinterpret_cast<unsigned*>(workspace + 8 * blocks);
  long long seg = 0;
  while (table.first_block[seg + 1] <= blockIdx.x) ++seg;
  const long long chunks = table.first_block[seg + 1] - table.first_block[seg];
  const long long chunk = blockIdx.x - table.first_block[seg];
  const long long inner_total = table.start[seg + 1] - table.start[seg];
  const long long chunk_points = (inner_total + chunks - 1) / chunks;
  const long long chunk_begin = chunk * chunk_points;
  const long long chunk_end =
      chunk_begin + chunk_points < inner_total ? chunk_begin + chunk_points : inner_total;
  const unsigned short* __restrict__ p0 = static_cast<const unsigned short*>(table.pointer[seg][0]);
  float* __restrict__ p1 = static_cast<float*>(table.pointer[seg][1]);
  float acc0 = 0.0f;
  for (long long inner = chunk_begin + threadIdx.x; inner < chunk_end; inner += blockDim.x) {
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
    int last = 0;
    if (lane == 0) {
      chunk_partial0[blockIdx.x] = acc0;
      __threadfence();  // the partials are visible before the count says so
      last = atomicAdd(&arrivals[seg], 1u) + 1u == static_cast<unsigned>(chunks);
    }
    last = __shfl_sync(0xFFFFFFFFu, last, 0);
    if (last) {
      __threadfence();
      acc0 = 0.0f;
      for (long long c = lane; c < chunks; c += 32) {
        const long long at = table.first_block[seg] + c;
        const float chunk0 = __ldcg(&chunk_partial0[at]);
        chunk_partial0[at] = 0;
        acc0 = __fadd_rn(acc0, chunk0);
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        acc0 = __fadd_rn(acc0, __shfl_down_sync(0xFFFFFFFFu, acc0, offset));
      }
      if (lane == 0) {
        arrivals[seg] = 0u;  // ready for the next launch
        const float e0 = acc0;
        p1[0] = e0;
      }
    }
  }
}
