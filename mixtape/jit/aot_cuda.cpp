// mixtape/jit/aot_cuda.cpp -- collects the kernels an artifact's CUDA programs use and compiles
// them, with the fixed kernels, into one NVRTC program per architecture.
#include "mixtape/jit/aot_cuda.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>

#include "mixtape/codegen/emit_cuda.h"
#include "mixtape/codegen/emit_llvm.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/random.h"
#include "mixtape/jit/llvm_jit.h"
#include "mixtape/runtime/aot_plan.h"
#include "mixtape/runtime/cpu_kernels.h"
#include "mixtape/runtime/cuda_attention.h"
#include "mixtape/runtime/cuda_fixed_kernels.h"

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

void check_padding_keeps_rows(const PlanDocument& plan_doc, const std::vector<StoragePtr>& buffers,
                              const std::vector<std::pair<DType, Shape>>& inputs,
                              const std::vector<std::string>& outputs,
                              const std::vector<int64_t>& batches, const std::string& name) {
  // The smallest batch that runs padded, and the batch it runs at.
  int64_t batch = 0, padded = 0;
  for (int64_t b = 1; b <= batches.back() && batch == 0; ++b)
    if (std::find(batches.begin(), batches.end(), b) == batches.end()) {
      batch = b;
      padded = *std::lower_bound(batches.begin(), batches.end(), b);
    }
  if (batch == 0) return;  // every batch has kernels of its own
  KernelLoader jit = [](const kir::Kernel& kernel) {
    auto code = LlvmJit::instance().load(kernel.name, emit_llvm(kernel));
    return ready_cpu_kernel({code->function(), code, &code->entry()});
  };
  // Each replay on copies of the buffers, so that nothing the artifact saves changes.
  auto run = [&](int64_t rows) {
    std::vector<StoragePtr> copies;
    for (const StoragePtr& buffer : buffers) copies.push_back(host_copy(*buffer));
    std::vector<Tensor> args;
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto [dtype, shape] = inputs[i];
      shape[0] = rows;
      auto value = std::make_shared<Storage>(dtype, numel(shape));  // zeros: padding, indices
      int64_t given = numel(shape) / rows * std::min(rows, batch);
      if (is_floating(dtype)) {
        // Values of every sign and size around 1, the same rows in both runs.
        for (int64_t k = 0; k < given; ++k)
          store_element(*value, k, 4.0 * philox_uniform(0x5eed + i, 0, k) - 2.0);
      }
      args.push_back(from_storage(std::move(value), shape));
    }
    std::unique_ptr<Plan> plan = plan_from_json(plan_doc, rows, copies, jit);
    std::vector<Tensor> results = replay(*plan, args);
    std::vector<StoragePtr> values;
    for (const Tensor& r : results) values.push_back(r.node()->value);
    release(*plan);
    return values;
  };
  std::vector<StoragePtr> exact = run(batch), padded_values = run(padded);
  for (size_t o = 0; o < exact.size(); ++o) {
    const Storage &want = *exact[o], &got = *padded_values[o];
    double largest = 0;
    for (int64_t k = 0; k < want.count; ++k)
      largest = std::max(largest, std::abs(load_element<double>(want, k)));
    for (int64_t k = 0; k < want.count; ++k) {
      double a = load_element<double>(want, k), b = load_element<double>(got, k);
      // Rows that do not see one another give the same values, up to a GEMM's summation
      // order at another batch; rows that do differ by a part of the whole.
      if ((std::isnan(a) && std::isnan(b)) || a == b || std::abs(a - b) <= 1e-2 * (1 + largest))
        continue;
      fail(
          "aot: {}: on cuda a batch runs padded with zero rows to the next batch its kernels "
          "were compiled for ({} as {}), and output '{}' of this function changes with that "
          "padding (element {}: {} at batch {}, {} padded): its rows see one another (a matmul "
          "over the batch, say). Export it for the cpu only, or at a fixed batch",
          name, batch, padded, o < outputs.size() ? outputs[o] : "?", k, a, batch, b);
    }
  }
}

CudaKernels compile_cuda_kernels(const PlanDocument& plan_doc,
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
  // And the head dims of the fused attention nodes, whose kernels the module carries too, so that
  // the target compiles nothing (runtime/cuda_attention.h).
  std::set<int> attention_dims;
  for (int64_t batch : batches) {
    std::unique_ptr<Plan> plan = plan_from_json(plan_doc, batch, buffers, collect, Device::cuda);
    for (const PlannedEvaluation& planned : plan->evals)
      for (const NodePtr& node : planned.eval.pending)
        if (int dim = attention_kernel_dim(*node)) attention_dims.insert(dim);
    release(*plan);
  }
  CudaKernels out;
  std::string source = cuda_fixed_kernels_source();
  if (!attention_dims.empty()) source += cuda_attention_kernels(attention_dims);
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
