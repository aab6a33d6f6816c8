// mixtape/runtime/cudnn.h -- cuDNN's convolutions for the CUDA back end, loaded with dlopen as
// cuBLASLt is: absent-tolerant, nothing links against the toolkit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mixtape/dsl/conv.h"
#include "mixtape/dsl/dtype.h"
#include "mixtape/dsl/ops.h"

namespace mixtape::cuda {

// The enum values and structure layout mixtape uses, from cudnn_graph.h, cudnn_ops.h and
// cudnn_cnn.h (cuDNN 9); tests/test_cuda_runtime.cpp checks them against the headers where they
// exist.
namespace cudnn_abi {
inline constexpr int kStatusSuccess = 0;     // CUDNN_STATUS_SUCCESS
inline constexpr int kDataFloat = 0;         // CUDNN_DATA_FLOAT
inline constexpr int kDataHalf = 2;          // CUDNN_DATA_HALF
inline constexpr int kDataBfloat16 = 9;      // CUDNN_DATA_BFLOAT16
inline constexpr int kTensorNchw = 0;        // CUDNN_TENSOR_NCHW
inline constexpr int kCrossCorrelation = 1;  // CUDNN_CROSS_CORRELATION
inline constexpr int kDefaultMath = 0;       // CUDNN_DEFAULT_MATH
inline constexpr int kTensorOpMath = 1;      // CUDNN_TENSOR_OP_MATH
inline constexpr int kFmaMath = 3;           // CUDNN_FMA_MATH
inline constexpr int kDeterministic = 1;     // CUDNN_DETERMINISTIC
// The algorithms that compute a direct convolution's products (the others are FFT and Winograd
// ones): forward IMPLICIT_GEMM, IMPLICIT_PRECOMP_GEMM, GEMM and DIRECT (0-3); backward data
// ALGO_0 and ALGO_1 (0-1); backward filter ALGO_0, ALGO_1 and ALGO_3 (0, 1, 3).
inline constexpr int kFwdAlgoDirect = 3;     // CUDNN_CONVOLUTION_FWD_ALGO_DIRECT
inline constexpr int kBwdDataAlgo1 = 1;      // CUDNN_CONVOLUTION_BWD_DATA_ALGO_1
inline constexpr int kBwdFilterAlgo3 = 3;    // CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3
inline constexpr int kBwdFilterAlgoFft = 2;  // CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT
/// cudnnConvolutionFwdAlgoPerf_t, and the backward passes' structures, which are laid out alike.
struct AlgoPerf {
  int algo;
  int status;
  float time;
  size_t memory;
  int determinism;
  int math_type;
  int reserved[3];
};
}  // namespace cudnn_abi

/// The library's version (cudnnGetVersion: 91900 for 9.19.0), or 0 when libcudnn does not load.
/// Needs no GPU. Never throws.
size_t cudnn_library_version();

/// True when libcudnn loads (libcudnn.so.9, .so, then /usr/local/cuda/lib64), is cuDNN 9 or later,
/// CUDA is available and a handle could be made; decided once per process. Never throws.
bool cudnn_available();
std::string cudnn_unavailable_reason();

/// One convolution primitive (dsl/ops.def's Conv2d, Conv2dInputGrad or Conv2dWeightGrad) on dense
/// NCHW activations and [O, C / groups, KH, KW] weights, every operand and the result of one
/// dtype (f32, f16 or bf16), summed in f32: cuDNN's FLOAT, PSEUDO_HALF and PSEUDO_BFLOAT16
/// configurations. Half operands use tensor cores; f32 ones TF32 tensor cores only with
/// allow_tf32. Only deterministic algorithms are used, and none that changes the arithmetic
/// (FFT, Winograd): the products are those of a direct convolution, summed in f32 in an order of
/// cuDNN's, the same on every call.
struct CudnnConvDesc {
  OpCode op = OpCode::Conv2d;
  ConvGeometry geometry{};
  DType dtype = f32;
  bool allow_tf32 = false;
};

/// An algorithm a convolution may run on, as cuDNN's heuristic reported it.
struct CudnnAlgorithm {
  int algo, math_type;
  size_t workspace;  // bytes
};

/// Of the heuristic's `results` for primitive `op` (in its order), those cudnn_conv may use: a
/// success, deterministic, computing a direct convolution's products (see cudnn_abi), within
/// 1 GiB of workspace, and FMA math (no TF32) where `fma_only`.
std::vector<CudnnAlgorithm> cudnn_usable_algorithms(OpCode op,
                                                    std::span<const cudnn_abi::AlgoPerf> results,
                                                    bool fma_only);

/// Whether cuDNN can take the problem at all: a dtype above, sizes that fit its int descriptors.
bool cudnn_conv_supported(const CudnnConvDesc& desc);

/// The algorithm cudnn_conv runs first for the problem, as "fwd IMPLICIT_PRECOMP_GEMM, tensor
/// ops": cuDNN's first heuristic choice that is deterministic and direct, within 1 GiB of
/// workspace (planned once per problem and cached, with the other such choices behind it).
/// Nothing when cuDNN offers no such algorithm. Throws mt::Error when cuDNN is unavailable, the
/// problem unsupported or a call fails.
std::optional<std::string> cudnn_conv_algorithm(const CudnnConvDesc& desc);

/// Queues the convolution on the compute stream: a = x, b = w, out = y (Conv2d); a = dy, b = w,
/// out = dx (Conv2dInputGrad); a = x, b = dy, out = dw (Conv2dWeightGrad); device addresses; the
/// workspace from the device allocator. Where an algorithm fails (or its workspace does not fit)
/// the next is tried, as PyTorch does, and dropped from the plan (one line on stderr the first
/// time). False, when none ran: the caller runs the problem another way. Throws mt::Error where
/// cudnn_conv_algorithm does. Calls from several threads are serialized (one handle).
bool cudnn_conv(const CudnnConvDesc& desc, const void* a, const void* b, void* out);

}  // namespace mixtape::cuda
