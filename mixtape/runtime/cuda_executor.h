// mixtape/runtime/cuda_executor.h -- the CUDA back end's entry point: fusion groups as NVRTC
// kernels, matmuls through cuBLASLt, values resident in device memory.
#pragma once

#include <string>
#include <vector>

#include "mixtape/dsl/node.h"
#include "mixtape/runtime/cuda_driver.h"
#include "mixtape/runtime/program.h"

namespace mixtape {

/// True when the CUDA back end can run: the driver has a device, and NVRTC and cuBLASLt load.
/// Decided once per process; never throws.
bool cuda_backend_available();
/// One line saying why not (empty when available); starts with "cannot load the NVIDIA driver
/// library" when the machine has no driver at all.
std::string cuda_backend_unavailable_reason();

/// Computes `pending` on the GPU with the same programs (fusion, memory plan, program cache by
/// signature) as execute_cpu. Kernel and matmul outputs stay in device memory (Storage::device)
/// until a host reader fetches them; host values the GPU reads are uploaded once per Storage.
/// Ops without a GPU kernel (gathers, random, f64 or 16-bit-accumulating matmuls) run on the
/// host: their inputs are downloaded and their result uploaded when a GPU step reads it. Nothing
/// waits for the GPU except those downloads.
ExecutedProgram execute_cuda(const std::vector<Node*>& pending, const std::vector<Node*>& required);
/// The KernelLoader of programs whose kernels are in `module`, loaded already (an AOT
/// artifact's): no compiler runs. The program's step keeps what it loads. An mt::Error names a
/// kernel the module does not hold.
KernelRef prebuilt_cuda_kernel(cuda::CUmodule module, const kir::Kernel& kernel);
/// execute_cuda's replay_cpu.
void replay_cuda(const ExecutedProgram& executed, const std::vector<Node*>& pending);

/// Waits until all queued GPU work has finished (for timing); a no-op without CUDA.
void cuda_synchronize();

}  // namespace mixtape
