// mixtape/jit/aot_cuda.h -- an artifact's CUDA kernels: the programs its runtime builds at each
// batch it runs on the GPU, with the fixed kernels, compiled by NVRTC into one module per
// architecture.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mixtape/runtime/aot_plan.h"
#include "mixtape/runtime/step_plan.h"

namespace mixtape::aot {

/// The batch sizes a CUDA artifact has kernels for (its kernels' dims are compile-time
/// constants): the export batch, and for a dynamic batch up to `max` every power of two below
/// `max` and `max` itself. The runtime runs a batch at the smallest of them that holds it, its
/// rows beyond the batch zero (a dynamic batch's rows do not see one another).
std::vector<int64_t> cuda_batches(int64_t batch, int64_t max);

/// An mt::Error unless padding keeps the rows of `plan_doc`'s function: on cuda a batch between
/// two of `batches` runs at the next one with zero rows added, which is only right when no row
/// sees another (a matmul over the batch, which the kernel check does not catch, does). Replays
/// the plan on the CPU at a batch that pads and at the batch it runs at, on the same rows, and
/// compares the rows asked for. `inputs` are the dtypes and export-batch shapes of the inputs.
void check_padding_keeps_rows(const PlanDocument& plan_doc, const std::vector<StoragePtr>& buffers,
                              const std::vector<std::pair<DType, Shape>>& inputs,
                              const std::vector<std::string>& outputs,
                              const std::vector<int64_t>& batches, const std::string& name);

/// One compiled module: a CUBIN ("sm_90") or PTX ("compute_80", which the driver compiles for
/// newer GPUs).
struct CudaImage {
  std::string arch;
  std::string bytes;
};

/// The image's file in the artifact: NAME.sm_90.cubin, NAME.compute_80.ptx.
std::string cuda_image_file(const std::string& name, const CudaImage& image);

struct CudaKernels {
  std::vector<std::string> functions;  // every kernel the programs launch, fixed ones excepted
  std::vector<CudaImage> images;       // a CUBIN per arch, then PTX for the oldest
};

/// Builds the programs of `plan_doc` at each of `batches` for the cuda device as the artifact's
/// runtime will (aot::plan_from_json), and compiles their kernels and the fixed kernels with
/// NVRTC: one CUBIN per compute capability in `archs` (80: sm_80) and PTX for the lowest. An
/// mt::Error when NVRTC is missing or does not support an arch, with NVRTC's log on a compile
/// error.
CudaKernels compile_cuda_kernels(const PlanDocument& plan_doc,
                                 const std::vector<StoragePtr>& buffers,
                                 const std::vector<int64_t>& batches, const std::vector<int>& archs,
                                 const std::string& name);

}  // namespace mixtape::aot
