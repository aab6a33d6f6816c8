// jit/aot_cuda.cpp -- collects the kernels an artifact's CUDA programs use and compiles them,
// with the fixed kernels, into one NVRTC program per architecture.
#include "jit/aot_cuda.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "codegen/emit_cuda.h"
#include "codegen/nvrtc.h"
#include "dsl/error.h"
#include "runtime/aot_plan.h"
#include "runtime/cuda_fixed_kernels.h"

namespace mixtape::aot {

std::vector<int64_t> cuda_batches(int64_t batch, int64_t max) {
  std::vector<int64_t> out{batch};
  if (max > 0) {
    for (int64_t b = 1; b < max; b *= 2) out.push_back(b);
    out.push_back(max);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string cuda_image_file(const std::string& name, const CudaImage& image) {
  return fmt::format("{}.{}.{}", name, image.arch, image.arch.starts_with("sm_") ? "cubin" : "ptx");
}

CudaKernels compile_cuda_kernels(const json::Value& plan_doc,
                                 const std::vector<StoragePtr>& buffers,
                                 const std::vector<int64_t>& batches, const std::vector<int>& archs,
                                 const std::string& name) {
  if (!nvrtc_available())
    fail("aot: {}: the cuda device needs NVRTC (libnvrtc.so) at export, to compile its kernels",
         name);
  if (archs.empty()) fail("aot: {}: the cuda device needs at least one arch (cuda_archs)", name);
  std::vector<int> supported = nvrtc_supported_archs();
  for (int arch : archs)
    if (!supported.empty() &&
        std::find(supported.begin(), supported.end(), arch) == supported.end())
      fail("aot: {}: NVRTC {} cannot compile for sm_{} (it supports {})", name, nvrtc_version(),
           arch, fmt::join(supported, ", "));

  // The kernels by name (a hash of the whole listing, dims included), as the runtime looks
  // them up: the same programs, built by the same code.
  std::map<std::string, kir::Kernel> kernels;
  KernelLoader collect = [&](const kir::Kernel& kernel) {
    kernels.try_emplace(kernel.name, kernel);
    return KernelRef{};
  };
  for (int64_t batch : batches) {
    std::unique_ptr<Plan> plan = plan_from_json(plan_doc, batch, buffers, collect, Device::cuda);
    release(*plan);
  }
  CudaKernels out;
  std::string source = cuda_fixed_kernels_source();
  for (const auto& [function, kernel] : kernels) {
    out.functions.push_back(function);
    source += '\n';
    source += emit_cuda(kernel);
  }
  std::vector<int> sorted = archs;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  for (int arch : sorted)
    out.images.push_back({fmt::format("sm_{}", arch),
                          compile_cuda(source, fmt::format("sm_{}", arch), name + ".cu")});
  std::string ptx = fmt::format("compute_{}", sorted.front());
  out.images.push_back({ptx, compile_cuda(source, ptx, name + ".cu")});
  return out;
}

}  // namespace mixtape::aot
