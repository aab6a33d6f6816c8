// mixtape/runtime/cublaslt.h -- GPU matmuls through cuBLASLt (dlopen'ed): row-major, batched,
// epilogues.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mixtape/dsl/dtype.h"

namespace mixtape::cuda {

// cuBLASLt's enum values mixtape uses, declared here (nothing links against the toolkit);
// tests/test_cuda_runtime.cpp checks them against cublasLt.h where it exists.
namespace lt_abi {
inline constexpr int kStatusSuccess = 0;        // CUBLAS_STATUS_SUCCESS
inline constexpr int kStatusNotSupported = 15;  // CUBLAS_STATUS_NOT_SUPPORTED
inline constexpr int kOpN = 0;                  // CUBLAS_OP_N
inline constexpr int kOpT = 1;                  // CUBLAS_OP_T
inline constexpr int kComputeF32 = 68;          // CUBLAS_COMPUTE_32F
inline constexpr int kComputeF32FastTf32 = 77;  // CUBLAS_COMPUTE_32F_FAST_TF32
inline constexpr int kDataF32 = 0;              // CUDA_R_32F
inline constexpr int kDataF16 = 2;              // CUDA_R_16F
inline constexpr int kDataBf16 = 14;            // CUDA_R_16BF
// cublasLtMatmulDescAttributes_t
inline constexpr int kDescTransA = 3;
inline constexpr int kDescTransB = 4;
inline constexpr int kDescEpilogue = 7;
inline constexpr int kDescBiasPointer = 8;
inline constexpr int kDescBiasBatchStride = 10;
inline constexpr int kDescEpilogueAuxPointer = 11;
inline constexpr int kDescEpilogueAuxLd = 12;
inline constexpr int kDescEpilogueAuxBatchStride = 13;
// cublasLtMatrixLayoutAttribute_t
inline constexpr int kLayoutBatchCount = 5;
inline constexpr int kLayoutStridedBatchOffset = 6;
// cublasLtMatmulPreferenceAttributes_t
inline constexpr int kPrefMaxWorkspaceBytes = 1;
inline constexpr int kPrefReductionSchemeMask = 3;
inline constexpr uint32_t kReductionInplace = 1;      // split-K partial sums in the output type
inline constexpr uint32_t kReductionComputeType = 2;  // split-K partial sums in f32
inline constexpr int kPrefMinAlignmentA = 5;
inline constexpr int kPrefMinAlignmentB = 6;
inline constexpr int kPrefMinAlignmentC = 7;
inline constexpr int kPrefMinAlignmentD = 8;
// cublasLtEpilogue_t
inline constexpr uint32_t kEpilogueDefault = 1;
inline constexpr uint32_t kEpilogueBias = 4;
inline constexpr uint32_t kEpilogueReluBias = 6;
inline constexpr uint32_t kEpilogueReluAuxBias = 134;
inline constexpr uint32_t kEpilogueGeluBias = 36;
inline constexpr uint32_t kEpilogueGeluAuxBias = 164;
inline constexpr uint32_t kEpilogueDreluBgrad = 152;
inline constexpr uint32_t kEpilogueDgeluBgrad = 208;
// sizeof(cublasLtMatmulHeuristicResult_t): algo (64 B), workspaceSize, state, wavesCount,
// reserved[4].
inline constexpr size_t kHeuristicResultBytes = 96;
inline constexpr size_t kHeuristicStateOffset = 72;  // of `state` (cublasStatus_t)
}  // namespace lt_abi

/// What follows the product (row-major terms; bias has n elements, one per output column, of the
/// output dtype; GELU is the tanh approximation cuBLASLt computes).
enum class Epilogue : uint8_t {
  none,           // C = alpha op(A) op(B) + beta C
  bias,           // C = AB + bias
  relu_bias,      // C = relu(AB + bias)
  gelu_bias,      // C = gelu(AB + bias)
  relu_aux_bias,  // C = relu(AB + bias); aux = bit mask of (AB + bias > 0), for drelu_bgrad
  gelu_aux_bias,  // C = gelu(AB + bias); aux = AB + bias (output dtype), for dgelu_bgrad
  drelu_bgrad,    // C = AB * relu'(pre) with the mask in aux; bias (written) = column sums of C
  dgelu_bgrad,    // C = AB * gelu'(pre) with pre in aux; bias (written) = column sums of C
};                // The *_bgrad epilogues take batch 1.
const char* name(Epilogue epilogue);

/// out[b] = epilogue(alpha * op(A[b]) @ op(B[b]) + beta * out[b]) for b < batch, every matrix
/// dense and row-major: A is [m, k] ([k, m] when transpose_a), B is [k, n] ([n, k] when
/// transpose_b), C is [m, n]. Products accumulate in f32 (CUBLAS_COMPUTE_32F, split-K partial sums
/// in f32 too); f32 inputs may ask for TF32 tensor cores. Inputs are f16, bf16 or f32; the output
/// is f16, bf16 or f32 for half inputs and f32 for f32 inputs.
/// Precision, as measured on an H200 (tests/gpu/test_gpu_runtime.cpp): without an epilogue the
/// result is the f32 sum rounded once. With a half output and an epilogue some cuBLASLt kernels
/// round the product to the output dtype before adding the bias / applying the activation, so
/// the result may be one more rounding away than runtime/gemm.h's single rounding. The DGELU
/// backward epilogue evaluates gelu' with a fast tanh (about 3e-4 relative error).
struct MatmulDesc {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool transpose_a = false, transpose_b = false;
  DType input = bf16;
  DType output = f32;
  bool allow_tf32 = false;  // f32 inputs only: CUBLAS_COMPUTE_32F_FAST_TF32
  Epilogue epilogue = Epilogue::none;
  // Elements between consecutive batch matrices; -1: dense (m*k, k*n, m*n); 0 broadcasts one
  // matrix to every batch (A and B only).
  int64_t stride_a = -1, stride_b = -1, stride_c = -1;
};

struct MatmulArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  const void* bias = nullptr;  // read by *_bias, written by *_bgrad ([n], output dtype)
  void* aux = nullptr;         // written by *_aux_bias, read by d*_bgrad; see matmul_aux_bytes
  float alpha = 1, beta = 0;
};

/// Leading dimension (in elements, bits for the ReLU mask) and total bytes of the epilogue's
/// auxiliary buffer for all batches; 0 for epilogues without one.
int64_t matmul_aux_ld(const MatmulDesc& desc);
size_t matmul_aux_bytes(const MatmulDesc& desc);

/// True when libcublasLt loads (libcublasLt.so.13, .so.12, .so, then /usr/local/cuda/lib64) and
/// CUDA is available. Never throws.
bool cublaslt_available();
std::string cublaslt_unavailable_reason();

/// Queues the product on the compute stream. The algorithm comes from cuBLASLt's heuristic,
/// cached per (shape, dtypes, transposes, epilogue, pointer alignment); the 32 MiB workspace
/// comes from the device allocator. Throws mt::Error for an invalid description, a missing
/// pointer, a combination cuBLASLt has no kernel for, or a failing call.
void matmul(const MatmulDesc& desc, const MatmulArgs& args);

/// Cached heuristic plans (for tests and reports).
size_t matmul_plan_cache_size();

}  // namespace mixtape::cuda
