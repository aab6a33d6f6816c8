// mixtape/codegen/emit_cuda.h -- prints a kernel as CUDA C++ for NVRTC, and the launch shape it
// expects.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "mixtape/codegen/kernel_ir.h"

namespace mixtape {

/// One self-contained CUDA C++ translation unit defining
///
///   extern "C" __global__ void <kernel.name>(T0* p0, T1* p1, ..., double s0, double s1, ...)
///
/// ABI (the runtime launches with cuLaunchKernel, kernelParams[i] = &arg_i):
///  - one pointer per kernel parameter, in order: `const T* __restrict__` for inputs,
///    `T* __restrict__` for outputs, where T is float (f32), double (f64), unsigned short
///    (f16 and bf16: the raw 16 bits), int (i32), long long (i64), unsigned char (bool, 0 or 1);
///  - then one double per scalar slot (kernel.scalars), the exact value of the fill;
///  - then, for a reduction split across blocks (cuda_launch_shape's workspace_bytes > 0), an
///    `unsigned char* __restrict__ workspace` of that many bytes, zero before the kernel's first
///    launch; each launch leaves it all zero again, so one buffer serves every launch of the
///    kernel on one stream;
///  - nothing else: dims are compile-time constants, so the kernel reads nothing but these.
///
/// Semantics equal emit_llvm's exactly (same RoundTo, Convert and NaN-propagating max, bf16 as
/// integer operations, f64 -> 16-bit through round-to-odd) except that expf, tanhf, powf, ...
/// are CUDA's, which may differ from the C library's by a few ulps, and that float sums are
/// reduced in a different (but fixed) order than the CPU's vectorized one. Arithmetic uses the
/// _rn intrinsics, so no compiler flag can contract it into FMAs or flush subnormals.
///
/// A multi-tensor kernel (kir::Kernel::multi_tensor) instead takes one argument by value, a
/// struct of 8-byte words that serves up to C = cuda_multi_tensor_capacity(kernel) segments:
///
///   { long long count;                       // S <= C segments in this launch
///     long long start[C + 1];                // segment s covers [start[s], start[s + 1])
///     long long first_block[C + 1];          // reductions: segment s's blocks, from 0
///     void* pointer[C][params];              // segment s's buffer for each kernel param
///     double scalar[C][scalars]; }           // and its scalar slots (absent when none)
///
/// (cuda_multi_tensor_table_bytes in all, unused entries zero), and a reduction then the
/// workspace pointer, as a split reduction's, of the table's workspace_bytes. A step of more
/// segments is launched in chunks of at most C, each with its starts (and blocks) counted from 0.
///
/// Every emitted source starts with the same guarded prelude, so the sources of several kernels
/// can be concatenated into one NVRTC program.
std::string emit_cuda(const kir::Kernel& kernel);

/// The C++ type of a `dtype` buffer in the kernels' parameters (the ABI above).
const char* cuda_element_type(DType dtype);

/// The guarded device helpers every emitted source starts with (f16/bf16 conversions and
/// rounding, ...), for hand-written kernels that must round exactly as emitted ones.
const char* cuda_prelude();

/// How the runtime must launch the kernel emit_cuda printed: a 1-D grid of `grid` blocks of
/// exactly `block` threads (reduction kernels size their shared memory for `block`),
/// `shared_bytes` of dynamic shared memory, and the workspace argument's size (0: none).
struct CudaLaunch {
  uint32_t grid = 1;
  uint32_t block = 32;
  uint32_t shared_bytes = 0;
  uint64_t workspace_bytes = 0;
};
CudaLaunch cuda_launch_shape(const kir::Kernel& kernel);

/// The size of a multi-tensor kernel's argument, and how many segments it holds.
constexpr int64_t cuda_multi_tensor_table_bytes = 4096;
int64_t cuda_multi_tensor_capacity(const kir::Kernel& kernel);
/// The argument of each launch of a multi-tensor step, as the ABI above lays it out: `starts`
/// is the step's {start_0 = 0, ..., start_S}, `pointers` and `scalars` every segment's in
/// turn. One table per chunk of at most cuda_multi_tensor_capacity(kernel) segments, its starts
/// counted from its first segment's.
struct CudaSegmentTable {
  std::vector<uint64_t> words;  // cuda_multi_tensor_table_bytes
  int64_t segments = 0;
  int64_t largest = 0;  // the most elements of one segment
  // Reductions: every segment's blocks (one per 32768 elements), and the workspace they need.
  int64_t blocks = 0;
  uint64_t workspace_bytes = 0;
};
std::vector<CudaSegmentTable> cuda_multi_tensor_tables(const kir::Kernel& kernel,
                                                       std::span<const int64_t> starts,
                                                       std::span<const uint64_t> pointers,
                                                       std::span<const double> scalars);
/// The launch of one table: pointwise, enough blocks for its largest segment, every segment
/// sharing them; a reduction, table.blocks blocks and its workspace.
CudaLaunch cuda_multi_tensor_launch(const kir::Kernel& kernel, const CudaSegmentTable& table);

}  // namespace mixtape
