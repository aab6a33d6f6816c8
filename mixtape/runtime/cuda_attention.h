// mixtape/runtime/cuda_attention.h -- fused attention on the GPU: the Attention and
// AttentionBackward primitives as fixed kernels with an online f32 softmax.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "mixtape/dsl/node.h"
#include "mixtape/runtime/cuda_driver.h"

namespace mixtape {

/// The CUDA C++ of the kernels for head dim `dim` (32, 64 or 128; d and dv padded to it with
/// zeros), after the fixed kernels' source, whose loads, stores and Philox they use:
///   mt_attention_forward_DIM  one thread per query row, key and value tiles in shared memory,
///                             an online softmax over them;
///   mt_attention_rows_DIM     backward, one thread per query row: the row's maximum score,
///                             1 / its sum of exponentials and delta = dO . O (kept for the next
///                             two: kAttentionRowStats f32 per row), and dQ;
///   mt_attention_keys_DIM / mt_attention_values_DIM
///                             backward, one thread per key row: dK, and dV, over query tiles.
/// Every sum is one thread's, in key (or query) order: runs repeat bit for bit, with no atomics.
/// One module per dim, compiled when a node first needs it (NVRTC takes seconds for each).
std::string cuda_attention_source(int dim);
/// The f32 values the backward kernels keep per query row (maximum, 1 / sum, delta).
inline constexpr int64_t kAttentionRowStats = 3;
/// The kernels alone, for each of `dims`, to follow the fixed kernels' source (an AOT artifact's
/// module holds them beside its programs' kernels).
std::string cuda_attention_kernels(const std::set<int>& dims);
/// The padded head dim an Attention or AttentionBackward node's kernels have (from its shapes),
/// or 0: another op, or a head dim above 128.
int attention_kernel_dim(const Node& node);
/// The kernels come from `module` (an AOT artifact's) for the dims it holds, NVRTC compiling
/// only the others: the first module given serves the process.
void use_prebuilt_attention_kernels(cuda::CUmodule module);

/// What the kernels read about a node, word for word (mt_attention in the source): sizes, the
/// mask's strides and kind (0 none, 1 bool, 2 additive of mask_dtype), dropout's seed and keep
/// test (its offset is a kernel argument of its own, read on the device), the operands' dtypes
/// and the node's storage and compute types.
struct AttentionKernelArgs {
  int64_t batch, tq, tk, d, dv, mask_row_stride, mask_col_stride;
  uint64_t seed;
  float scale, keep_scale;
  uint32_t threshold;
  int32_t causal, mask_kind, mask_dtype, dropout, q_dtype, k_dtype, v_dtype, o_dtype, go_dtype,
      out_dtype, compute;
};
struct AttentionLaunch {
  AttentionKernelArgs args;
  int dim;                            // the kernels' padded head dim
  std::vector<long long> mask_batch;  // each batch index's first mask element
};
/// A node's kernel argument and head dim, from its inputs' values (dtypes) and attrs; nullopt
/// where the kernels do not cover it (f64, head dims above 128, an integer additive mask). The
/// launches' and the host-run test's one source of the argument.
std::optional<AttentionLaunch> attention_launch(const Node& node);

/// Computes an Attention or AttentionBackward node on the GPU from its inputs' device values:
/// operands rounded to the node's compute type as they load, arithmetic in f32 (as
/// runtime/attention.h's CPU tiles; the bits differ from theirs by the order of the sums and the
/// exp). False, with nothing done, for f64 or head dims above 128: the executor then runs the
/// CPU tiles on the host copies; likewise where NVRTC is missing and no artifact brought them.
bool run_attention_kernels(Node& node);

}  // namespace mixtape
