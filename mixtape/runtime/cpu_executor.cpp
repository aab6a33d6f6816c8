// mixtape/runtime/cpu_executor.cpp -- runs fusion groups on the CPU: JIT'd kernels, oneDNN matmuls,
// host ops.
#include "mixtape/runtime/cpu_executor.h"

#include <omp.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "mixtape/codegen/fusion.h"
#include "mixtape/codegen/hash.h"
#include "mixtape/codegen/lower.h"
#include "mixtape/dsl/convert.h"
#include "mixtape/dsl/error.h"
#include "mixtape/dsl/graph.h"
#include "mixtape/dsl/log.h"
#include "mixtape/dsl/reusable_buffers.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/attention.h"
#include "mixtape/runtime/conv.h"
#include "mixtape/runtime/cpu_kernels.h"
#include "mixtape/runtime/gemm.h"
#include "mixtape/runtime/half_convert.h"
#include "mixtape/runtime/matmul_dims.h"
#include "mixtape/runtime/pool.h"
#include "mixtape/runtime/program.h"
#include "mixtape/runtime/reference_executor.h"

namespace mixtape {
namespace {

// Below this many elements per launch (tens of microseconds of work), threads cost more than
// they save, above all on a loaded machine.
constexpr int64_t parallel_threshold = 1 << 17;

ExecutionStats& stats() { return execution_counters(); }

std::shared_ptr<Storage> allocate(const Node& node) {
  return allocate_value(node, node.precision.storage_type, node.numel(), true);
}

// The 16-bit copies of f32 leaves (weights, a batch of inputs) that half matmuls read during one
// program run, kept until it ends: a leaf read by several (the forward product and the weight
// gradient's) is rounded once, the "cast once" of memory_report. Leaves live through the run
// anyway; a value the run computes is rounded per reader instead, so that its copy does not
// outlive it. Holding the source keeps its address from being reused while the entry lives.
struct NarrowedCopy {
  std::shared_ptr<Storage> source, copy;
};
std::vector<NarrowedCopy>& narrowed_copies() {
  thread_local std::vector<NarrowedCopy> copies;
  return copies;
}

// A buffer given to an output in place holds a new value: its 16-bit copies are no longer its.
void forget_narrowed_copies(const std::shared_ptr<Storage>& buffer) {
  std::erase_if(narrowed_copies(), [&](const NarrowedCopy& c) { return c.source == buffer; });
}

// replay_cpu's in_place list while it runs.
const std::vector<std::pair<const Node*, std::shared_ptr<Storage>>>*& replay_outputs() {
  thread_local const std::vector<std::pair<const Node*, std::shared_ptr<Storage>>>* list = nullptr;
  return list;
}

// The buffers two or more of a replay's inputs are bound to, sorted: found once per replay, not
// per in-place output.
std::vector<const Storage*>& replay_shared_buffers() {
  thread_local std::vector<const Storage*> shared;
  return shared;
}

// Step::in_place in a replay: the buffer replay_cpu lists for param `c.output`, when param
// `c.input` holds it and no other input of the evaluation does (two nodes bound to one buffer,
// one of which a later step may read).
std::shared_ptr<Storage> replay_buffer(const Step& step, const Step::InPlace& c,
                                       const std::vector<Node*>& pending, const Signature& sig) {
  const Node* output = sig.resolve(step.params[c.output], pending);
  const Node* input = sig.resolve(step.params[c.input], pending);
  const auto& list = *replay_outputs();  // sorted by node
  auto found =
      std::lower_bound(list.begin(), list.end(), output,
                       [](const auto& entry, const Node* node) { return entry.first < node; });
  if (found == list.end() || found->first != output) return nullptr;
  const std::shared_ptr<Storage>& buffer = found->second;
  if (input->value != buffer) return nullptr;
  const std::vector<const Storage*>& shared = replay_shared_buffers();  // `input` is an input
  if (std::binary_search(shared.begin(), shared.end(), buffer.get())) return nullptr;
  forget_narrowed_copies(buffer);
  ++stats().outputs_in_place;
  return buffer;
}

// Step::in_place: `input`'s buffer for `output`, taken when the caller lists `input`
// (dsl/reusable_buffers.h) and nothing but the listed references and `edges` graph edges holds it,
// nor anything but it its buffer; null otherwise. Never while mt::compile traces: its replays
// bind the buffers the trace read.
std::shared_ptr<Storage> reusable_buffer(Node& input, const Node& output, long edges) {
  const long holders = reusable_holders(&input);
  if (holders < 0 || input.overwritten || !input.value || trace_observer()) return nullptr;
  const std::shared_ptr<Storage>& buffer = input.value;
  // Besides its node, only this run's 16-bit copies of it (a weight a half matmul read) may hold
  // the buffer.
  long copies = 0;
  for (const NarrowedCopy& c : narrowed_copies()) copies += c.source == buffer;
  if (buffer.use_count() != 1 + copies || input.weak_from_this().use_count() != edges + holders ||
      buffer->dtype != output.precision.storage_type || buffer->count != output.numel() ||
      buffer->device)
    return nullptr;
  forget_narrowed_copies(buffer);
  input.overwritten = true;
  ++stats().outputs_in_place;
  return buffer;
}

int64_t bytes_of(const Storage& s) { return s.size_bytes(); }

// A kernel's entry point: null from the program build until compile_pending() has loaded it
// together with the rest of the program's new kernels. Owned by the steps that run it (and,
// until then, by the list of kernels to compile), so that its code is freed with the last program
// that uses it.
using KernelCell = CompiledKernel;

std::mutex cells_mutex;
// By name, for programs that share a kernel; an entry expires with its cell.
std::unordered_map<std::string, std::weak_ptr<KernelCell>>& kernel_cells() {
  static std::unordered_map<std::string, std::weak_ptr<KernelCell>> cells;
  return cells;
}
std::vector<std::pair<std::shared_ptr<KernelCell>, kir::Kernel>>& unloaded() {
  static std::vector<std::pair<std::shared_ptr<KernelCell>, kir::Kernel>> kernels;
  return kernels;
}

CpuKernelCompiler*& installed_compiler() {
  static CpuKernelCompiler* compiler = nullptr;
  return compiler;
}

// Forgets the expired entries once they are as many as the live ones (so the sweep's cost is
// shared by as many registrations as it frees).
void forget_expired_cells() {
  auto& cells = kernel_cells();
  static size_t sweep_at = 64;
  if (cells.size() < sweep_at) return;
  std::erase_if(cells, [](const auto& entry) { return entry.second.expired(); });
  sweep_at = std::max<size_t>(64, 2 * cells.size());
}

// The program builder's kernel loader: leaves a kernel new to this process for
// compile_pending(), so that a new program's kernels compile in parallel.
KernelRef register_kernel(const kir::Kernel& kernel) {
  std::lock_guard<std::mutex> lock(cells_mutex);
  std::shared_ptr<KernelCell> cell = kernel_cells()[kernel.name].lock();
  if (!cell) {
    forget_expired_cells();
    cell = std::make_shared<KernelCell>();
    kernel_cells()[kernel.name] = cell;
    if (log_enabled("kernels")) log_line("kernels", "{}", kir::to_string(kernel));
    unloaded().push_back({cell, kernel});
  }
  return {reinterpret_cast<uintptr_t>(cell.get()), cell};
}

void compile_pending() {
  std::lock_guard<std::mutex> lock(cells_mutex);
  // Taken off the queue first: a batch that fails to compile leaves its cells without code
  // (run_kernel then says so) instead of failing every later compile with it.
  auto todo = std::move(unloaded());
  unloaded().clear();
  if (todo.empty()) return;
  CpuKernelCompiler* compiler = cpu_kernel_compiler();
  if (!compiler)
    fail(
        "the CPU back end has no kernel compiler: this program links only mixtape_runtime, which "
        "runs exported artifacts; link the mixtape library to compile graphs ({} new kernels, "
        "the first {})",
        todo.size(), todo[0].second.name);
  std::vector<const kir::Kernel*> kernels;
  for (auto& [cell, kernel] : todo) kernels.push_back(&kernel);
  std::vector<CompiledKernel> compiled = compiler->compile(kernels);
  for (size_t i = 0; i < todo.size(); ++i) *todo[i].first = std::move(compiled[i]);
}

ProgramCache& cpu_programs() {
  static ProgramCache programs;
  return programs;
}

KernelObserver& observer() {
  static KernelObserver o;
  return o;
}

void run_kernel(const Step& step, const std::vector<Node*>& pending, const Signature& sig) {
  const kir::Kernel& kernel = *step.kernel;
  KernelFunction function = reinterpret_cast<const KernelCell*>(step.compiled)->current();
  if (!function) fail("CPU kernel {} failed to compile earlier", kernel.name);
  size_t count = step.params.size();
  // Reused from launch to launch: a replayed step launches dozens of small kernels, and these
  // allocations were a visible share of them.
  thread_local std::vector<Node*> nodes;
  thread_local std::vector<void*> params;
  thread_local std::vector<std::shared_ptr<Storage>> outputs;
  thread_local std::vector<double> scalars;
  nodes.assign(count, nullptr);
  params.clear();
  outputs.assign(count, nullptr);
  scalars.clear();
  ExecutionStats& s = stats();
  for (NodeRef ref : step.scalar_nodes) scalars.push_back(fill_value(*sig.resolve(ref, pending)));
  if (!step.in_place.empty() && !observer() && in_place_outputs())
    for (const Step::InPlace& c : step.in_place) {
      if (outputs[c.output]) continue;
      outputs[c.output] =
          replay_outputs() ? replay_buffer(step, c, pending, sig)
                           : reusable_buffer(*sig.resolve(step.params[c.input], pending),
                                             *sig.resolve(step.params[c.output], pending), c.edges);
    }
  // A multi-tensor kernel takes its segment table first, then each segment's pointers and
  // scalars (kir::Kernel::multi_tensor); an ordinary one is a single segment without the table.
  if (kernel.multi_tensor) params.push_back(const_cast<int64_t*>(step.segment_table.data()));
  size_t per_segment = kernel.params.size();
  for (size_t i = 0; i < count; ++i) {
    Node* node = nodes[i] = sig.resolve(step.params[i], pending);
    if (step.param_is_output(i)) {
      if (!outputs[i]) outputs[i] = allocate(*node);
      params.push_back(outputs[i]->host_data());
      s.bytes_written += bytes_of(*outputs[i]);
    } else {
      params.push_back(node->value->host_data());
      s.bytes_read += bytes_of(*node->value);
    }
    if (kernel.scalars > 0 && (i + 1) % per_segment == 0)
      params.push_back(scalars.data() + (i / per_segment) * kernel.scalars);
  }
  if (observer()) {
    LoweredKernel lowered{kernel, nodes, scalars, {}};
    for (NodeRef ref : step.scalar_nodes) lowered.scalar_nodes.push_back(sig.resolve(ref, pending));
    observer()(lowered);
  }
  int64_t extent = step.parallel_extent;
  int threads = step.points >= parallel_threshold ? omp_get_max_threads() : 1;
  // The scratch vectors are this thread's: the team gets their data by pointer.
  void** args = params.data();
  if (threads <= 1 || extent < 2) {
    function(args, 0, extent);
  } else {
#pragma omp parallel num_threads(threads)
    {
      apply_flush_denormal();
      int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      if (kernel.multi_tensor && kernel.is_reduction()) {
        // Whole segments, a thread taking those that start in its share of the elements.
        const int64_t* starts = step.segment_table.data() + 1;
        int64_t total = starts[extent];
        auto first_from = [&](int64_t share) {
          return std::lower_bound(starts, starts + extent, total * share / n) - starts;
        };
        function(args, first_from(t), t + 1 == n ? extent : first_from(t + 1));
      } else {
        function(args, extent * t / n, extent * (t + 1) / n);
      }
    }
  }
  for (size_t i = 0; i < count; ++i)
    if (outputs[i]) nodes[i]->value = std::move(outputs[i]);
  ++s.kernels;
  s.kernel_nodes += step.members;
}

// An input's value in `dtype` (the matmul's compute type): itself, or converted. A leaf's copy
// is kept for the run when `cache` (only inside replay_cpu, which drops them at its end).
std::shared_ptr<Storage> as_dtype(const Node& input, DType dtype, bool cache = true) {
  const std::shared_ptr<Storage>& value = input.value;
  if (value->dtype == dtype) return value;
  const bool leaf = cache && op_info(input.op).kind == OpKind::Leaf;
  std::vector<NarrowedCopy>& copies = narrowed_copies();
  if (leaf)
    for (const NarrowedCopy& c : copies)
      if (c.source == value && c.copy->dtype == dtype) return c.copy;
  auto out = std::make_shared<Storage>(dtype, value->count, Storage::Uninitialized{});
  if (leaf) copies.push_back({value, out});
  if (value->dtype == f32 && dtype == bf16)
    narrow_to_bf16(value->as<float>(), out->as<uint16_t>(), value->count);
  else if (value->dtype == f32 && dtype == f16)
    narrow_to_f16(value->as<float>(), out->as<uint16_t>(), value->count);
  else
    for (int64_t i = 0; i < value->count; ++i)
      store_element(*out, i, load_element<double>(*value, i));
  return out;
}

// A matmul, with the bias add and relu fusion gave its epilogue (FusionGroup::matmul): the step
// stores only its output node's value.
void run_matmul(const Step& step, const std::vector<Node*>& pending, const Signature& sig) {
  Node& node = *sig.resolve(step.node, pending);
  Node& output = *sig.resolve(step.output, pending);
  // The bias in the type the add reads it in (an f32 parameter's bf16 copy is made once a run).
  std::shared_ptr<Storage> bias =
      step.has_bias ? as_dtype(*sig.resolve(step.bias, pending), step.bias_type) : nullptr;
  GemmDesc desc = matmul_desc<GemmDesc>(node);
  desc.operand = node.precision.compute, desc.out = output.precision.storage_type;
  desc.has_bias = bias != nullptr, desc.bias_type = bias ? bias->dtype : f32;
  desc.relu = step.relu, desc.product_type = step.product_type;
  // A 16-bit accumulator (asked for by a custom policy) is not what oneDNN does: the reference
  // loops honour it. Fusion gives such products no epilogue.
  if (!gemm_supported(desc) || is_half(node.precision.accum)) {
    if (&output != &node)
      fail("internal: a {} matmul with a fused epilogue, which gemm does not run",
           name(desc.operand));
    node.value = reference_compute(node);
    ++stats().host_ops;
    return;
  }
  auto a = as_dtype(*node.inputs[0], desc.operand);
  auto b = as_dtype(*node.inputs[1], desc.operand);
  auto out = allocate(output);
  if (desc.batch > 0)
    gemm(desc, a->host_data(), b->host_data(), out->host_data(),
         bias ? bias->host_data() : nullptr);
  output.value = out;
  ExecutionStats& s = stats();
  ++s.gemms;
  s.bytes_read += bytes_of(*a) + bytes_of(*b) + (bias ? bytes_of(*bias) : 0);
  s.bytes_written += bytes_of(*out);
}

// A convolution primitive through oneDNN; other dtypes and accumulators (f64, a 16-bit
// accumulator a custom policy asks for) take the reference loops. Leaves' narrowed copies are
// kept for the step (replay_cpu drops them at its end).
void run_conv(Node& node) {
  ConvDesc desc;
  desc.op = node.op;
  desc.geometry = ConvGeometry::of(node);
  desc.operand = node.precision.compute;
  desc.out = node.precision.storage_type;
  if (!conv_supported(desc) || is_half(node.precision.accum)) {
    node.value = reference_compute(node);
    ++stats().host_ops;
    return;
  }
  auto a = as_dtype(*node.inputs[0], desc.operand, true);
  auto b = as_dtype(*node.inputs[1], desc.operand, true);
  auto out = allocate(node);
  conv(desc, a->host_data(), b->host_data(), out->host_data());
  node.value = out;
  ExecutionStats& s = stats();
  ++s.convolutions;
  s.bytes_read += bytes_of(*a) + bytes_of(*b);
  s.bytes_written += bytes_of(*out);
}

// A host step with CPU loops of its own (max pooling, attention) where they take its dtypes;
// others by the reference's loops.
void run_own_loops(Node& node, bool supported, void (*compute)(const Node&, Storage&)) {
  if (!supported) {
    node.value = reference_compute(node);
    ++stats().host_ops;
    return;
  }
  auto out = allocate(node);
  compute(node, *out);
  node.value = out;
  ExecutionStats& s = stats();
  ++s.kernels;
  ++s.kernel_nodes;
  for (const NodePtr& input : node.inputs) s.bytes_read += bytes_of(*input->value);
  s.bytes_written += bytes_of(*out);
}

// Steps without a generated kernel: convolutions through oneDNN, max pooling and attention by
// their loops, the rest by the reference loops.
void run_host_step(Node& node) {
  if (op_info(node.op).kind == OpKind::Conv) return run_conv(node);
  if (op_info(node.op).kind == OpKind::Pool)
    return run_own_loops(node, max_pool_cpu_supported(node), max_pool_cpu);
  if (op_info(node.op).kind == OpKind::Attention)
    return run_own_loops(node, attention_cpu_supported(node), attention_cpu);
  node.value = reference_compute(node);
  ++stats().host_ops;
}

}  // namespace

Signature sign_cpu(const std::vector<Node*>& pending, const std::vector<Node*>& required,
                   const FusionOptions& options) {
  // Programs with and without multi-tensor steps or matmul epilogues differ for the same graph.
  static constexpr std::string_view salts[2][2] = {
      {"mixtape-cpu-program-1/no-epilogue", "mixtape-cpu-program-1/multi-tensor/no-epilogue"},
      {"mixtape-cpu-program-1", "mixtape-cpu-program-1/multi-tensor"}};
  return sign(pending, required, options.fuse,
              salts[options.matmul_epilogue][options.multi_tensor]);
}

ExecutedProgram execute_cpu(const std::vector<Node*>& pending, const std::vector<Node*>& required) {
  FusionOptions options = fusion_options(Device::cpu);
  ExecutedProgram executed;
  PhaseClock clock;
  executed.sig = sign_cpu(pending, required, options);
  const double sign_seconds = clock.lap();
  executed.program = cpu_programs().get(pending, options, executed.sig, register_kernel);
  compile_pending();
  const double lookup_seconds = clock.lap();
  // The run phase (runtime/eval.cpp) counts from before the signature: take these out of it.
  ExecutionStats& counters = execution_counters();
  counters.sign_seconds += sign_seconds;
  counters.lookup_seconds += lookup_seconds;
  counters.run_seconds -= sign_seconds + lookup_seconds;
  replay_cpu(executed, pending);
  return executed;
}

void replay_cpu(const ExecutedProgram& executed, const std::vector<Node*>& pending,
                const std::vector<std::pair<const Node*, std::shared_ptr<Storage>>>& in_place) {
  struct DropCopies {  // also when a step throws
    ~DropCopies() {
      narrowed_copies().clear();
      replay_outputs() = nullptr;
    }
  } drop_copies;
  replay_outputs() = in_place.empty() ? nullptr : &in_place;
  if (!in_place.empty()) {
    thread_local std::vector<const Storage*> bound;
    bound.clear();
    for (const Node* external : executed.sig.externals)
      if (external->value) bound.push_back(external->value.get());
    std::sort(bound.begin(), bound.end());
    std::vector<const Storage*>& shared = replay_shared_buffers();
    shared.clear();
    for (size_t i = 1; i < bound.size(); ++i)
      if (bound[i] == bound[i - 1] && (shared.empty() || shared.back() != bound[i]))
        shared.push_back(bound[i]);
  }
  narrowed_copies().clear();
  run_program(*executed.program, pending, executed.sig,
              {run_kernel, run_matmul, run_host_step, nullptr, start_collective});
}

void set_kernel_observer(KernelObserver o) { observer() = std::move(o); }

CpuKernelCompiler* cpu_kernel_compiler() { return installed_compiler(); }
void set_cpu_kernel_compiler(CpuKernelCompiler* compiler) { installed_compiler() = compiler; }

KernelRef ready_cpu_kernel(CompiledKernel kernel) {
  auto cell = std::make_shared<KernelCell>(std::move(kernel));
  return {reinterpret_cast<uintptr_t>(cell.get()), cell};
}

ProgramCache::Stats cpu_program_cache_stats() { return cpu_programs().stats(); }

}  // namespace mixtape
