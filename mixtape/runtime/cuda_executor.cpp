// mixtape/runtime/cuda_executor.cpp -- runs fusion groups on an NVIDIA GPU: NVRTC kernels, cuBLASLt
// matmuls, host ops; values stay in device memory until the host reads them.
#include "mixtape/runtime/cuda_executor.h"

#include "mixtape/runtime/cpu_executor.h"
#include "mixtape/runtime/cuda_collectives.h"
#include "mixtape/runtime/cuda_fixed_kernels.h"
#include "mixtape/runtime/cuda_values.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "mixtape/codegen/emit_cuda.h"
#include "mixtape/codegen/lower.h"
#include "mixtape/codegen/nvrtc.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/log.h"
#include "mixtape/runtime/attention.h"
#include "mixtape/runtime/cublaslt.h"
#include "mixtape/runtime/cuda_allocator.h"
#include "mixtape/runtime/cuda_driver.h"
#include "mixtape/runtime/cudnn.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/matmul_dims.h"
#include "mixtape/runtime/program.h"
#include "mixtape/runtime/reference_executor.h"

namespace mixtape {

/// A value's device memory (dsl/node.h declares it): back to the caching allocator when the last
/// Storage holding it goes. Reuse is ordered on the compute stream, so no synchronization.
struct DeviceCopy {
  cuda::DeviceBuffer buffer;
};

namespace {

ExecutionStats& stats() { return execution_counters(); }

std::shared_ptr<DeviceCopy> device_memory(int64_t bytes) {
  auto copy = std::make_shared<DeviceCopy>();
  copy->buffer = cuda::DeviceBuffer(static_cast<size_t>(std::max<int64_t>(bytes, 1)));
  return copy;
}

// Storage::HostFetch: the download every host reader of a device value goes through. The copy
// is queued after everything that computes the value, so this is where the host waits.
void fetch_to_host(Storage& storage) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (!storage.host_stale.load(std::memory_order_acquire)) return;
  int64_t bytes = storage.size_bytes();
  storage.bytes.resize(static_cast<size_t>(bytes));
  if (bytes > 0) cuda::download(storage.bytes.data(), storage.device->buffer.address(), bytes);
  stats().bytes_downloaded += bytes;
  storage.host_stale.store(false, std::memory_order_release);
}

std::string device_arch() { return nvrtc_target(cuda::compute_capability()); }

// A kernel loaded into the context. `function` stays null from the program build until
// compile_pending() has compiled it with the others the build asked for.
struct LoadedKernel {
  std::shared_ptr<const kir::Kernel> kernel;
  cuda::CUfunction function = nullptr;
  CudaLaunch launch;
  // A split reduction's workspace, zeroed when allocated: every launch leaves it zero, and
  // launches are ordered on the one compute stream. Grown to what a launch needs (a multi-tensor
  // reduction's depends on its segments).
  cuda::DeviceBuffer workspace;

  cuda::CUdeviceptr workspace_for(uint64_t bytes) {
    if (workspace.size() < bytes) {
      workspace = cuda::DeviceBuffer(bytes);
      cuda::memset_async(workspace.address(), 0, bytes);
    }
    return workspace.address();
  }
};

// A kernel with its launch shape, its function not loaded yet.
std::unique_ptr<LoadedKernel> unloaded(const kir::Kernel& kernel) {
  auto loaded = std::make_unique<LoadedKernel>();
  loaded->kernel = std::make_shared<const kir::Kernel>(kernel);
  loaded->launch = cuda_launch_shape(kernel);
  return loaded;
}

std::mutex kernels_mutex;
std::unordered_map<std::string, std::unique_ptr<LoadedKernel>>& loaded_kernels() {
  static std::unordered_map<std::string, std::unique_ptr<LoadedKernel>> loaded;
  return loaded;
}
std::vector<LoadedKernel*>& uncompiled() {
  static std::vector<LoadedKernel*> pending;
  return pending;
}

// The program builder's kernel loader: registers the kernel; compiling waits for the whole
// program's kernels, which compile_pending() compiles in parallel. CUDA modules stay loaded for
// the process's life (no owner).
KernelRef register_kernel(const kir::Kernel& kernel) {
  std::lock_guard<std::mutex> lock(kernels_mutex);
  auto [it, added] = loaded_kernels().try_emplace(kernel.name);
  if (added) {
    it->second = unloaded(kernel);
    uncompiled().push_back(it->second.get());
  }
  return {reinterpret_cast<uintptr_t>(it->second.get()), nullptr};
}

// Compiles (or takes from the kernel cache) every registered kernel not loaded yet, several at
// once: NVRTC runs are independent, and the first step of a model has a hundred kernels.
void compile_pending() {
  std::lock_guard<std::mutex> lock(kernels_mutex);
  std::vector<LoadedKernel*>& todo = uncompiled();
  if (todo.empty()) return;
  std::string arch = device_arch();
  std::vector<std::string> images(todo.size());
  std::vector<std::string> errors(todo.size());
  // A kernel the cache answers is counted as loaded from disk, with the time of its fetch and
  // of its module load: the "a cached kernel loads in under 1 ms".
  std::unique_ptr<bool[]> cached(new bool[todo.size()]());
  std::vector<double> fetch_seconds(todo.size(), 0.0);
  // NVRTC compiles one kernel per thread, on every core whatever the user's OpenMP setting.
  const int threads = static_cast<int>(
      std::min<size_t>(todo.size(), std::max(1u, std::thread::hardware_concurrency())));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (size_t i = 0; i < todo.size(); ++i) {
    try {
      const kir::Kernel& kernel = *todo[i]->kernel;
      if (log_enabled("kernels")) log_line("kernels", "{}", kir::to_string(kernel));
      std::string source = emit_cuda(kernel);
      auto start = std::chrono::steady_clock::now();
      images[i] = compile_cuda(source, arch, kernel.name + ".cu", &cached[i]);
      fetch_seconds[i] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    } catch (const std::exception& e) {
      errors[i] = e.what();
    }
  }
  std::vector<LoadedKernel*> batch = std::move(todo);
  todo.clear();  // a kernel that fails stays unloaded: run_kernel reports it
  for (size_t i = 0; i < batch.size(); ++i)
    if (!errors[i].empty()) fail("{}", errors[i]);
  ExecutionStats& s = stats();
  for (size_t i = 0; i < batch.size(); ++i) {
    std::string& image = images[i];
    auto start = std::chrono::steady_clock::now();
    cuda::CUmodule module = cuda::load_module(std::span<const char>(image.data(), image.size()));
    batch[i]->function = cuda::get_function(module, batch[i]->kernel->name);  // loaded for good
    if (cached[i]) {
      ++s.kernels_from_disk;
      s.load_seconds +=
          fetch_seconds[i] +
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }
}

// Launches a multi-tensor step in chunks of as many segments as the kernel's argument holds
// (emit_cuda.h's ABI): `pointers` and `scalars` hold every segment's in turn.
void launch_multi_tensor(const Step& step, LoadedKernel& loaded,
                         const std::vector<cuda::CUdeviceptr>& pointers,
                         const std::vector<double>& scalars) {
  const kir::Kernel& kernel = *step.kernel;
  std::vector<uint64_t> words(pointers.begin(), pointers.end());
  for (CudaSegmentTable& table :
       cuda_multi_tensor_tables(kernel, std::span(step.segment_table).subspan(1), words, scalars)) {
    if (table.largest == 0 && !kernel.is_reduction()) continue;  // a reduction stores even then
    CudaLaunch shape = cuda_multi_tensor_launch(kernel, table);
    cuda::CUdeviceptr workspace = loaded.workspace_for(shape.workspace_bytes);
    // cuLaunchKernel copies the arguments at the call; a pointwise kernel takes only the table.
    void* args[] = {table.words.data(), &workspace};
    cuda::launch(loaded.function, {shape.grid, 1, 1}, {shape.block, 1, 1}, shape.shared_bytes,
                 args);
  }
}

void run_kernel(const Step& step, const std::vector<Node*>& pending, const Signature& sig) {
  LoadedKernel& loaded = *reinterpret_cast<LoadedKernel*>(step.compiled);
  const kir::Kernel& kernel = *step.kernel;
  if (!loaded.function) fail("CUDA kernel {} failed to compile earlier", kernel.name);
  size_t count = step.params.size();
  // Reused from launch to launch, as the CPU executor's: a replayed step is dozens of launches,
  // each of which the host must queue before the GPU runs dry.
  thread_local std::vector<cuda::CUdeviceptr> pointers;
  thread_local std::vector<Node*> outputs;
  thread_local std::vector<std::shared_ptr<Storage>> values;
  thread_local std::vector<double> scalars;
  thread_local std::vector<void*> args;
  pointers.assign(count, 0);
  outputs.clear();
  values.clear();
  scalars.clear();
  ExecutionStats& s = stats();
  for (size_t i = 0; i < count; ++i) {
    Node* node = sig.resolve(step.params[i], pending);
    if (step.param_is_output(i)) {
      auto value = device_value(node->precision.storage_type, node->numel());
      pointers[i] = value->device->buffer.address();
      s.bytes_written += value->size_bytes();
      outputs.push_back(node);
      values.push_back(std::move(value));
    } else {
      pointers[i] = device_address(*node->value);
      s.bytes_read += node->value->size_bytes();
    }
  }
  for (NodeRef ref : step.scalar_nodes) scalars.push_back(fill_value(*sig.resolve(ref, pending)));
  if (kernel.multi_tensor) {
    launch_multi_tensor(step, loaded, pointers, scalars);
  } else {
    args.clear();
    for (cuda::CUdeviceptr& pointer : pointers) args.push_back(&pointer);
    for (double& scalar : scalars) args.push_back(&scalar);
    cuda::CUdeviceptr workspace = loaded.workspace_for(loaded.launch.workspace_bytes);
    if (loaded.launch.workspace_bytes > 0) args.push_back(&workspace);
    cuda::launch(loaded.function, {loaded.launch.grid, 1, 1}, {loaded.launch.block, 1, 1},
                 loaded.launch.shared_bytes, args.data());
  }
  for (size_t i = 0; i < outputs.size(); ++i) outputs[i]->value = std::move(values[i]);
  values.clear();
  ++s.kernels;
  s.kernel_nodes += step.members;
}

// Host steps: the reference loops, except fused attention the device kernels do not cover (f64,
// head dims above 128), which runs runtime/attention.h's CPU tiles on the host copies of its
// inputs (linear memory, as on the CPU).
void run_on_host(Node& node) {
  if (op_info(node.op).kind == OpKind::Attention && attention_cpu_supported(node)) {
    auto out = allocate_value(node, node.precision.storage_type, node.numel(), true);
    attention_cpu(node, *out);
    node.value = std::move(out);
  } else {
    node.value = reference_compute(node);
  }
  ++stats().host_ops;
}

bool half_or_f32(DType t) { return t == f32 || is_half(t); }

// A convolution primitive through cuDNN (runtime/cudnn.h), as the CPU back end runs them through
// oneDNN: operands rounded to the compute type (f32, f16 or bf16), products summed in f32 and
// rounded once to the storage type. cuDNN's result has its operands' type, so where the node
// stores another the operands are widened to f32 (exactly) and the f32 result rounded. False,
// with no value set, for other dtypes and accumulators (f64, a half accumulator a custom policy
// asks for), with cuDNN off or missing, without a deterministic direct algorithm for the
// problem, or where cuDNN fails to plan or run it: the fixed kernels' direct loops run those.
bool run_cudnn_conv(Node& node) {
  if (node.op != OpCode::Conv2d && node.op != OpCode::Conv2dInputGrad &&
      node.op != OpCode::Conv2dWeightGrad)
    return false;
  const DType compute = node.precision.compute, storage = node.precision.storage_type;
  if (!use_cudnn() || !half_or_f32(compute) || !half_or_f32(storage) ||
      node.precision.accum != f32 || !half_or_f32(node.inputs[0]->value->dtype) ||
      !half_or_f32(node.inputs[1]->value->dtype) || !cuda::cudnn_available())
    return false;
  const DType run = storage == compute ? compute : f32;
  const cuda::CudnnConvDesc desc{node.op, ConvGeometry::of(node), run,
                                 compute == f32 && allow_tf32()};
  if (!cuda::cudnn_conv_supported(desc)) return false;
  try {
    if (!cuda::cudnn_conv_algorithm(desc)) return false;
    // Rounded to the compute type first, then (where it differs) widened to the type cuDNN runs.
    auto operand = [&](size_t i) {
      std::shared_ptr<Storage> v = node.inputs[i]->value;
      if (v->dtype != compute) v = convert_on_device(*v, compute);
      if (v->dtype != run) v = convert_on_device(*v, run);
      return v;
    };
    std::shared_ptr<Storage> a = operand(0), b = operand(1);
    auto out = device_value(run, node.numel());
    if (node.numel() > 0 &&
        !cuda::cudnn_conv(desc, reinterpret_cast<const void*>(device_address(*a)),
                          reinterpret_cast<const void*>(device_address(*b)),
                          reinterpret_cast<void*>(device_address(*out))))
      return false;
    node.value = run == storage ? out : convert_on_device(*out, storage);
    ExecutionStats& s = stats();
    ++s.convolutions;
    s.bytes_read += a->size_bytes() + b->size_bytes();
    s.bytes_written += node.value->size_bytes();
    return true;
  } catch (const Error& e) {
    // cuDNN could not plan it (a sub-library missing, say): the direct loops run it, correctly.
    static std::once_flag once;
    std::call_once(once, [&] {
      std::fprintf(stderr, "mixtape: cuDNN failed (%s); the direct loops run what it cannot\n",
                   e.what());
    });
    return false;
  }
}

// Steps without a generated kernel: convolutions through cuDNN, the data movement ops, random
// fills and convolutions on the GPU where it has fixed kernels for them, collectives through NCCL
// where the run has a communicator, the rest (gathers along an index tensor, MPI's collectives,
// ...) on the host.
void run_other(Node& node) {
  if (!run_cudnn_conv(node) && !run_fixed_kernel(node) && !run_collective_on_device(node))
    run_on_host(node);
}

void run_matmul(const Step& step, const std::vector<Node*>& pending, const Signature& sig) {
  // The CUDA back end fuses no epilogue into its products (FusionOptions::matmul_epilogue).
  if (step.output != step.node) fail("internal: a CUDA matmul step with a fused epilogue");
  Node& node = *sig.resolve(step.node, pending);
  cuda::MatmulDesc desc = matmul_desc<cuda::MatmulDesc>(node);
  desc.input = node.precision.compute, desc.output = node.precision.storage_type;
  desc.allow_tf32 = node.precision.compute == f32 && allow_tf32();
  // cuBLASLt accumulates in f32: other accumulators (f64, 16-bit ones a custom policy asks for)
  // and integer or f64 operands take the reference loops. Results are f32 or the operands' type.
  bool supported = half_or_f32(node.precision.compute) &&
                   half_or_f32(node.precision.storage_type) && node.precision.accum == f32 &&
                   (node.precision.storage_type == f32 ||
                    node.precision.storage_type == node.precision.compute) &&
                   half_or_f32(node.inputs[0]->value->dtype) &&
                   half_or_f32(node.inputs[1]->value->dtype);
  if (!supported) return run_on_host(node);
  auto out = device_value(node.precision.storage_type, node.numel());
  ExecutionStats& s = stats();
  s.bytes_written += out->size_bytes();
  if (desc.batch > 0 && desc.k == 0) {
    cuda::memset_async(out->device->buffer.address(), 0, out->size_bytes());
  } else if (desc.batch > 0) {
    std::shared_ptr<Storage> a = node.inputs[0]->value, b = node.inputs[1]->value;
    if (a->dtype != desc.input) a = convert_on_device(*a, desc.input);
    if (b->dtype != desc.input) b = convert_on_device(*b, desc.input);
    cuda::MatmulArgs args;
    args.a = reinterpret_cast<const void*>(device_address(*a));
    args.b = reinterpret_cast<const void*>(device_address(*b));
    args.c = out->device->buffer.data();
    cuda::matmul(desc, args);
    s.bytes_read += a->size_bytes() + b->size_bytes();
  }
  node.value = std::move(out);
  ++s.gemms;
}

// MIXTAPE_LOG=profile's device timer: events recorded on the compute stream, reused from one
// evaluation to the next (run_program calls these from the one thread that runs it). Never
// destroyed, as the allocator is not: the driver may be gone by the time statics are.
std::vector<std::unique_ptr<cuda::Event>>& timing_events() {
  static auto* events = new std::vector<std::unique_ptr<cuda::Event>>;
  return *events;
}
size_t marks_made = 0;

void mark_on_stream() {
  std::vector<std::unique_ptr<cuda::Event>>& events = timing_events();
  if (marks_made == events.size()) events.push_back(std::make_unique<cuda::Event>());
  events[marks_made++]->record();
}

std::vector<double> seconds_between_marks() {
  std::vector<double> seconds;
  if (marks_made == 0) return seconds;
  std::vector<std::unique_ptr<cuda::Event>>& events = timing_events();
  events[marks_made - 1]->synchronize();
  for (size_t i = 0; i + 1 < marks_made; i += 2)
    seconds.push_back(1e-3 * cuda::Event::elapsed_ms(*events[i], *events[i + 1]));
  marks_made = 0;
  return seconds;
}

const DeviceTimer stream_timer{mark_on_stream, seconds_between_marks};

std::string backend_unavailable_reason() {
  if (!cuda::available()) return cuda::unavailable_reason();
  if (!nvrtc_available()) return "NVRTC (libnvrtc.so) could not be loaded";
  if (!cuda::cublaslt_available()) return cuda::cublaslt_unavailable_reason();
  return {};
}

const std::string& cached_reason() {
  static const std::string reason = backend_unavailable_reason();
  return reason;
}

}  // namespace

cuda::CUdeviceptr device_address(Storage& storage) {
  if (!storage.device) {
    int64_t bytes = storage.size_bytes();
    auto copy = device_memory(bytes);
    if (bytes > 0) cuda::upload(copy->buffer.address(), storage.host_data(), bytes);
    stats().bytes_uploaded += bytes;
    storage.device = std::move(copy);
  }
  return storage.device->buffer.address();
}

std::shared_ptr<Storage> device_value(DType dtype, int64_t count) {
  return std::make_shared<Storage>(dtype, count,
                                   device_memory(count * static_cast<int64_t>(size_of(dtype))));
}

std::shared_ptr<Storage> copy_on_device(Storage& value) {
  auto copy = device_value(value.dtype, value.count);
  int64_t bytes = value.size_bytes();
  if (bytes > 0)
    cuda::copy_device_to_device_async(copy->device->buffer.address(), device_address(value),
                                      static_cast<size_t>(bytes));
  return copy;
}

bool cuda_backend_available() { return cached_reason().empty(); }
std::string cuda_backend_unavailable_reason() { return cached_reason(); }

ExecutedProgram execute_cuda(const std::vector<Node*>& pending,
                             const std::vector<Node*>& required) {
  if (!cuda_backend_available()) fail("device cuda: CUDA is not available: {}", cached_reason());
  Storage::set_host_fetch(fetch_to_host);
  FusionOptions options = fusion_options(Device::cuda);
  ExecutedProgram executed;
  executed.sig =
      sign(pending, required, options.fuse,
           options.multi_tensor ? "mixtape-cuda-program-1/multi-tensor" : "mixtape-cuda-program-1");
  static ProgramCache programs;
  executed.program = programs.get(pending, options, executed.sig, register_kernel);
  compile_pending();
  replay_cuda(executed, pending);
  return executed;
}

KernelRef prebuilt_cuda_kernel(cuda::CUmodule module, const kir::Kernel& kernel) {
  std::shared_ptr<LoadedKernel> loaded = unloaded(kernel);
  loaded->function = cuda::get_function(module, kernel.name);
  return {reinterpret_cast<uintptr_t>(loaded.get()), std::move(loaded)};
}

void replay_cuda(const ExecutedProgram& executed, const std::vector<Node*>& pending) {
  Storage::set_host_fetch(fetch_to_host);  // an artifact's replay may be the first CUDA work
  run_program(*executed.program, pending, executed.sig,
              {run_kernel, run_matmul, run_other, &stream_timer});
}

void cuda_synchronize() {
  if (cuda::available()) cuda::compute_stream().synchronize();
}

}  // namespace mixtape
