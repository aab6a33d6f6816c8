// runtime/cpu_executor.cpp -- runs fusion groups on the CPU: JIT'd kernels, oneDNN matmuls, host
// ops.
#include "runtime/cpu_executor.h"

#include <omp.h>

#include <mutex>
#include <unordered_map>

#include "codegen/emit_llvm.h"
#include "codegen/fusion.h"
#include "codegen/llvm_jit.h"
#include "codegen/lower.h"
#include "dsl/convert.h"
#include "dsl/error.h"
#include "dsl/log.h"
#include "runtime/gemm.h"
#include "runtime/reference_executor.h"

namespace mixtape {
namespace {

// Below this many elements per launch, threads cost more than they save.
constexpr int64_t parallel_threshold = 1 << 15;

ExecutionStats& stats() {
  static ExecutionStats s;
  return s;
}

// The JIT keeps its own lifetime counters; a reset remembers them so that stats count from it.
LlvmJit::Stats& jit_baseline() {
  static LlvmJit::Stats baseline;
  return baseline;
}

std::shared_ptr<Storage> allocate(const Node& node) {
  return std::make_shared<Storage>(node.storage, node.numel());
}

int64_t bytes_of(const Storage& s) { return s.count * static_cast<int64_t>(size_of(s.dtype)); }

void run_kernel(const FusionGroup& group) {
  LoweredKernel lowered = lower(group);
  const kir::Kernel& kernel = lowered.kernel;
  // Emitting is skipped for kernels this process has already loaded.
  static std::mutex mutex;
  static std::unordered_map<std::string, KernelFunction> loaded;
  KernelFunction function = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = loaded.find(kernel.name);
    if (found != loaded.end()) function = found->second;
  }
  if (!function) {
    if (log_enabled("kernels")) log_line("kernels", "{}", kir::to_string(kernel));
    function = LlvmJit::instance().load(kernel.name, emit_llvm(kernel));
    std::lock_guard<std::mutex> lock(mutex);
    loaded.emplace(kernel.name, function);
  }
  std::vector<void*> params;
  std::vector<std::shared_ptr<Storage>> outputs(lowered.nodes.size());
  ExecutionStats& s = stats();
  for (size_t i = 0; i < lowered.nodes.size(); ++i) {
    Node* node = lowered.nodes[i];
    if (kernel.params[i].output) {
      outputs[i] = allocate(*node);
      params.push_back(outputs[i]->bytes.data());
      s.bytes_written += bytes_of(*outputs[i]);
    } else {
      params.push_back(node->value->bytes.data());
      s.bytes_read += bytes_of(*node->value);
    }
  }
  int64_t extent = kernel.parallel_extent();
  int64_t total = 1;
  for (int64_t d : kernel.dims) total *= d;
  int threads = total >= parallel_threshold ? omp_get_max_threads() : 1;
  if (threads <= 1 || extent < 2) {
    function(params.data(), 0, extent);
  } else {
#pragma omp parallel num_threads(threads)
    {
      int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      function(params.data(), extent * t / n, extent * (t + 1) / n);
    }
  }
  for (size_t i = 0; i < lowered.nodes.size(); ++i)
    if (outputs[i]) lowered.nodes[i]->value = outputs[i];
  ++s.kernels;
  s.kernel_nodes += static_cast<int64_t>(group.members.size());
}

// An input's value in `dtype` (the matmul's compute type): itself, or converted.
std::shared_ptr<Storage> as_dtype(const std::shared_ptr<Storage>& value, DType dtype) {
  if (value->dtype == dtype) return value;
  auto out = std::make_shared<Storage>(dtype, value->count);
  if (value->dtype == f32 && dtype == bf16)
    narrow_to_bf16(value->as<float>(), out->as<uint16_t>(), value->count);
  else if (value->dtype == f32 && dtype == f16)
    narrow_to_f16(value->as<float>(), out->as<uint16_t>(), value->count);
  else
    for (int64_t i = 0; i < value->count; ++i)
      store_element(*out, i, load_element<double>(*value, i));
  return out;
}

void run_matmul(Node& node) {
  const Shape& a_shape = node.inputs[0]->shape;
  size_t rank = node.shape.size();
  GemmDesc desc;
  desc.m = node.shape[rank - 2];
  desc.n = node.shape[rank - 1];
  desc.k = node.attrs.transpose_a ? a_shape[rank - 2] : a_shape[rank - 1];
  desc.batch = desc.m * desc.n == 0 ? 0 : node.numel() / (desc.m * desc.n);
  desc.transpose_a = node.attrs.transpose_a;
  desc.transpose_b = node.attrs.transpose_b;
  desc.operand = node.compute;
  desc.out = node.storage;
  // A 16-bit accumulator (asked for by a custom policy) is not what oneDNN does: the reference
  // loops honour it.
  if (!gemm_supported(desc) || is_half(node.accum)) {
    node.value = reference_compute(node);
    ++stats().host_ops;
    return;
  }
  auto a = as_dtype(node.inputs[0]->value, desc.operand);
  auto b = as_dtype(node.inputs[1]->value, desc.operand);
  auto out = allocate(node);
  if (desc.batch > 0) gemm(desc, a->bytes.data(), b->bytes.data(), out->bytes.data());
  node.value = out;
  ExecutionStats& s = stats();
  ++s.gemms;
  s.bytes_read += bytes_of(*a) + bytes_of(*b);
  s.bytes_written += bytes_of(*out);
}

}  // namespace

void execute_cpu(const std::vector<Node*>& pending, const std::vector<Node*>& required) {
  FusionOptions options;
  options.fuse = !eager_mode();
  std::vector<FusionGroup> groups = fuse(pending, required, options);
  ++stats().evaluations;
  for (FusionGroup& group : groups) {
    switch (group.kind) {
      case FusionGroup::Kind::Kernel:
        run_kernel(group);
        break;
      case FusionGroup::Kind::MatMul:
        run_matmul(*group.members[0]);
        break;
      case FusionGroup::Kind::Host:
        group.members[0]->value = reference_compute(*group.members[0]);
        ++stats().host_ops;
        break;
    }
  }
}

ExecutionStats execution_stats() {
  ExecutionStats s = stats();
  LlvmJit::Stats jit = LlvmJit::instance().stats();
  const LlvmJit::Stats& base = jit_baseline();
  s.kernels_compiled = jit.compiled - base.compiled;
  s.kernels_from_disk = jit.disk_loaded - base.disk_loaded;
  s.compile_seconds = jit.compile_seconds - base.compile_seconds;
  s.load_seconds = jit.load_seconds - base.load_seconds;
  return s;
}

void reset_execution_stats() {
  stats() = ExecutionStats{};
  jit_baseline() = LlvmJit::instance().stats();
}

}  // namespace mixtape
