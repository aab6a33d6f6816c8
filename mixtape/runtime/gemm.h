// mixtape/runtime/gemm.h -- CPU matmuls through oneDNN: f32/bf16/f16 operands, f32 accumulation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mixtape/dsl/dtype.h"

namespace mixtape {

/// How bf16 operands are multiplied. All accumulate in f32 and give the same results for values
/// in the normal range up to f32 rounding (each in its own summation order); they differ in speed,
/// and in subnormals (below 2^-126): the native and own kernels' VDPBF16PS or AMX TDPBF16PS treat
/// subnormal operands as zero and flush subnormal sums, the widened one keeps them.
enum class Bf16Kernel : uint8_t {
  automatic,  // by machine, then by shape (gemm.cpp): AMX where oneDNN runs it; where bf16 dot
              // products outrun f32 FMAs (measured once, bf16_dot_speed_over_f32 in gemm_bf16.h)
              // own for small products (2^21 flops, n >= 64 or n >= 32 with m <= 128) and for
              // shallow ones (n >= 64, k <= 128), native otherwise; elsewhere widened when there
              // are enough flops per
              // converted element. Fixed per shape and machine; MIXTAPE_LOG=profile logs it.
  native,     // oneDNN's bf16 matmul (AMX tiles or AVX512-BF16 dot products); an mt::Error on a
              // CPU without AVX-512, where oneDNN has none (automatic widens there)
  widened,    // operands widened exactly to f32, then oneDNN's f32 matmul
  own,        // mixtape's VDPBF16PS kernel, on the team from 2^22 flops (gemm_bf16.h gives its
              // exact result); an mt::Error on a CPU without AVX512-BF16
};

/// How f32 (and widened) operands reach oneDNN's f32 kernel: as stored, or copied with their
/// rows a cache line further apart. Both give the same bits (the copy changes no arithmetic);
/// they differ in speed where oneDNN reads operands in place (gemm.cpp, operand_row_stride).
enum class OperandRows : uint8_t {
  automatic,  // padded where rows a multiple of 512 bytes apart would share cache sets
  dense,      // as stored
  padded,     // always copied with padded rows (for tests and benchmarks)
};

struct GemmDesc {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool transpose_a = false;  // a is [batch, m, k] row-major, or [batch, k, m] when transposed
  bool transpose_b = false;  // b is [batch, k, n] row-major, or [batch, n, k] when transposed
  DType operand = f32;       // dtype of a and b: f32, bf16 or f16
  DType out = f32;           // dtype of the result [batch, m, n]: f32, bf16 or f16
  // Optional epilogue: out = act(round_p(a@b) + bias[n]); bias has dtype bias_type (f32, bf16 or
  // f16). round_p rounds the f32 accumulator to product_type (nothing for f32); the bias add and
  // the relu run in f32 and the result is rounded to `out` once. With product_type the matmul
  // node's own storage type this is the unfused graph's sequence of roundings (the matmul's value
  // rounded, then the add's), which a fused Linear keeps (codegen/fusion.h).
  bool has_bias = false;
  DType bias_type = f32;
  bool relu = false;         // max(x, 0) with +0 for x <= 0 and NaN kept, as the reference's Relu
  DType product_type = f32;  // f32, bf16 or f16; read only with a bias
  Bf16Kernel bf16_kernel = Bf16Kernel::automatic;     // only read when operand is bf16
  OperandRows operand_rows = OperandRows::automatic;  // only read for oneDNN's f32 kernel
};

/// False for operand, output or bias dtypes gemm cannot take (f64, integers, bool) and for
/// negative sizes; the caller then uses the reference executor.
bool gemm_supported(const GemmDesc& desc);

/// out[b] = act(op(a[b]) @ op(b[b]) + bias) for every batch index b, all operands dense and
/// row-major. Products are exact and accumulated in f32; the f32 result is rounded once,
/// to nearest even, to desc.out. k == 0 gives act(bias) (or zeros); m * n == 0 writes nothing.
/// `out` must not overlap a, b or bias. Safe to call from several threads at once. Throws mt::Error
/// naming the shapes and dtypes for an unsupported description, a missing pointer or a oneDNN
/// failure.
void gemm(const GemmDesc& desc, const void* a, const void* b, void* out,
          const void* bias = nullptr);

/// Whether `gemm(desc, ...)` runs on the calling thread alone, whatever its OpenMP team: products
/// below about 20 us of one core's work, which threads would slow down.
bool gemm_on_calling_thread(const GemmDesc& desc);
/// Which kernel `gemm(desc, ...)` runs, in words: "oneDNN bf16 brg:avx512_core_amx_bf16", or
/// "bf16 widened to f32, oneDNN f32 brg:avx512_core" (oneDNN's implementation names). The same
/// text is logged under MIXTAPE_LOG=profile the first time each distinct product runs. Makes
/// and caches the primitive; throws mt::Error as gemm does for an unsupported description.
std::string gemm_kernel(const GemmDesc& desc);

/// Whether Bf16Kernel::native runs on this CPU (oneDNN's bf16 matmul needs AVX-512).
bool gemm_bf16_native_available();

/// The number of oneDNN matmul primitives created and cached so far (one per distinct oneDNN
/// problem: shapes, transposes, oneDNN operand type, bias); for tests and reports.
size_t gemm_primitive_cache_size();
/// Drops every cached primitive (they are rebuilt on demand).
void gemm_clear_primitive_cache();

}  // namespace mixtape
