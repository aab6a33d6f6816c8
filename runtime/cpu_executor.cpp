// runtime/cpu_executor.cpp -- runs fusion groups on the CPU: JIT'd kernels, oneDNN matmuls, host
// ops.
#include "runtime/cpu_executor.h"

#include <omp.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "codegen/emit_llvm.h"
#include "codegen/fusion.h"
#include "codegen/hash.h"
#include "codegen/llvm_jit.h"
#include "codegen/lower.h"
#include "dsl/convert.h"
#include "dsl/error.h"
#include "dsl/log.h"
#include "runtime/gemm.h"
#include "runtime/reference_executor.h"

namespace mixtape {
namespace {

// Below this many elements per launch (tens of microseconds of work), threads cost more than
// they save, above all on a loaded machine.
constexpr int64_t parallel_threshold = 1 << 17;

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

// A node of one evaluation by position: pending[ref] for ref >= 0, else externals[-ref - 1]
// (evaluated inputs, numbered in the order the signature first meets them).
using NodeRef = int32_t;

// What fusion and lowering depend on, as a hash, and the evaluated inputs in a fixed order.
// Two evaluations with equal hashes run the same program on their own nodes. Float fill values
// are left out (they are launch-time scalars), as are the random seeds and custom vjps that host
// ops read from their node when they run.
struct Signature {
  Hash128 hash;
  std::unordered_map<Node*, NodeRef> refs;
  std::vector<Node*> externals;
  // The nodes to store: those asked for, and those something outside this evaluation still
  // owns (a Tensor the user holds, such as the loss read after step()). The rest may stay in
  // registers or be dropped after their last reader.
  std::vector<Node*> stored;

  Node* resolve(NodeRef ref, const std::vector<Node*>& pending) const {
    return ref >= 0 ? pending[ref] : externals[-ref - 1];
  }
};

template <typename T>
void update_all(Hasher& h, const std::vector<T>& values) {
  h.update(values.size());
  for (const T& v : values) h.update(v);
}

Signature sign(const std::vector<Node*>& pending, const std::vector<Node*>& required, bool fuse) {
  Signature sig;
  Hasher h;
  h.update(std::string_view("mixtape-cpu-program-1"));
  h.update(fuse);
  h.update(pending.size());
  for (size_t i = 0; i < pending.size(); ++i) sig.refs.emplace(pending[i], static_cast<int32_t>(i));
  std::vector<int64_t> readers(pending.size(), 0);
  for (Node* node : pending) {
    h.update(node->op).update(node->dtype).update(node->storage).update(node->compute);
    h.update(node->accum);
    update_all(h, node->shape);
    const Attrs& a = node->attrs;
    update_all(h, a.axes);
    h.update(a.keepdim).update(a.axis).update(a.transpose_a).update(a.transpose_b);
    update_all(h, a.starts);
    update_all(h, a.steps);
    if (!(node->op == OpCode::Full && is_floating(node->storage))) h.update(a.value);
    h.update(a.step);
    h.update(node->inputs.size());
    for (const NodePtr& input : node->inputs) {
      auto [it, added] =
          sig.refs.emplace(input.get(), -static_cast<int32_t>(sig.externals.size()) - 1);
      h.update(it->second);
      if (it->second >= 0) ++readers[it->second];
      if (added) {
        sig.externals.push_back(input.get());
        h.update(input->value->dtype);
        update_all(h, input->shape);
      }
    }
  }
  sig.stored = required;
  std::unordered_set<Node*> asked(required.begin(), required.end());
  for (size_t i = 0; i < pending.size(); ++i)
    if (pending[i]->weak_from_this().use_count() > readers[i] && !asked.count(pending[i]))
      sig.stored.push_back(pending[i]);
  h.update(sig.stored.size());
  for (Node* node : sig.stored) h.update(sig.refs.at(node));
  sig.hash = h.finish();
  return sig;
}

// One fusion group, ready to run on any evaluation of the same signature.
struct Step {
  FusionGroup::Kind kind = FusionGroup::Kind::Host;
  NodeRef node = 0;  // MatMul, Host
  // Kernel:
  KernelFunction function = nullptr;
  std::shared_ptr<const kir::Kernel> kernel;
  std::vector<NodeRef> params;        // kernel.params[i]'s node
  std::vector<NodeRef> scalar_nodes;  // the fill behind each scalar slot
  int64_t members = 0;
};

struct Program {
  std::vector<Step> steps;
  // Memory plan: the stored values no later step reads and the caller did not ask for, dropped
  // right after step i (release_after[i]). Their memory goes back to the allocator for the
  // steps that follow; a later evaluation that does need one recomputes it from its inputs, as
  // it would a value fusion kept in registers.
  std::vector<std::vector<NodeRef>> release_after;
};

// What each step reads and stores, by reference, for the memory plan.
void plan_memory(Program& program, const std::vector<Node*>& pending,
                 const std::vector<Node*>& required, const Signature& sig) {
  std::unordered_map<NodeRef, size_t> last_use;
  std::vector<NodeRef> stored_order;
  for (size_t i = 0; i < program.steps.size(); ++i) {
    const Step& step = program.steps[i];
    std::vector<NodeRef> reads, writes;
    if (step.kind == FusionGroup::Kind::Kernel) {
      for (size_t p = 0; p < step.params.size(); ++p)
        (step.kernel->params[p].output ? writes : reads).push_back(step.params[p]);
    } else {
      for (const NodePtr& input : pending[step.node]->inputs)
        reads.push_back(sig.refs.at(input.get()));
      writes.push_back(step.node);
    }
    for (NodeRef ref : reads)
      if (ref >= 0) last_use[ref] = i;
    for (NodeRef ref : writes) {
      last_use.emplace(ref, i);
      stored_order.push_back(ref);
    }
  }
  std::unordered_set<Node*> keep(required.begin(), required.end());
  program.release_after.assign(program.steps.size(), {});
  for (NodeRef ref : stored_order)
    if (!keep.count(pending[ref])) program.release_after[last_use.at(ref)].push_back(ref);
}

KernelFunction load_kernel(const kir::Kernel& kernel) {
  // Emitting is skipped for kernels this process has already loaded.
  static std::mutex mutex;
  static std::unordered_map<std::string, KernelFunction> loaded;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = loaded.find(kernel.name);
    if (found != loaded.end()) return found->second;
  }
  if (log_enabled("kernels")) log_line("kernels", "{}", kir::to_string(kernel));
  KernelFunction function = LlvmJit::instance().load(kernel.name, emit_llvm(kernel));
  std::lock_guard<std::mutex> lock(mutex);
  loaded.emplace(kernel.name, function);
  return function;
}

Program build_program(const std::vector<Node*>& pending, const std::vector<Node*>& required,
                      const FusionOptions& options, const Signature& sig) {
  Program program;
  for (FusionGroup& group : fuse(pending, required, options)) {
    Step step;
    step.kind = group.kind;
    if (group.kind != FusionGroup::Kind::Kernel) {
      step.node = sig.refs.at(group.members[0]);
    } else {
      LoweredKernel lowered = lower(group);
      step.function = load_kernel(lowered.kernel);
      for (Node* node : lowered.nodes) step.params.push_back(sig.refs.at(node));
      for (Node* node : lowered.scalar_nodes) step.scalar_nodes.push_back(sig.refs.at(node));
      step.kernel = std::make_shared<const kir::Kernel>(std::move(lowered.kernel));
      step.members = static_cast<int64_t>(group.members.size());
    }
    program.steps.push_back(std::move(step));
  }
  plan_memory(program, pending, required, sig);
  return program;
}

KernelObserver& observer() {
  static KernelObserver o;
  return o;
}

void run_kernel(const Step& step, const std::vector<Node*>& pending, const Signature& sig) {
  const kir::Kernel& kernel = *step.kernel;
  size_t count = step.params.size();
  std::vector<Node*> nodes(count);
  std::vector<void*> params(count);
  std::vector<std::shared_ptr<Storage>> outputs(count);
  ExecutionStats& s = stats();
  for (size_t i = 0; i < count; ++i) {
    Node* node = nodes[i] = sig.resolve(step.params[i], pending);
    if (kernel.params[i].output) {
      outputs[i] = allocate(*node);
      params[i] = outputs[i]->bytes.data();
      s.bytes_written += bytes_of(*outputs[i]);
    } else {
      params[i] = node->value->bytes.data();
      s.bytes_read += bytes_of(*node->value);
    }
  }
  std::vector<double> scalars;
  for (NodeRef ref : step.scalar_nodes) scalars.push_back(fill_value(*sig.resolve(ref, pending)));
  if (!scalars.empty()) params.push_back(scalars.data());
  if (observer()) {
    LoweredKernel lowered{kernel, nodes, scalars, {}};
    for (NodeRef ref : step.scalar_nodes) lowered.scalar_nodes.push_back(sig.resolve(ref, pending));
    observer()(lowered);
  }
  int64_t extent = kernel.parallel_extent();
  int64_t total = 1;
  for (int64_t d : kernel.dims) total *= d;
  int threads = total >= parallel_threshold ? omp_get_max_threads() : 1;
  if (threads <= 1 || extent < 2) {
    step.function(params.data(), 0, extent);
  } else {
#pragma omp parallel num_threads(threads)
    {
      int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      step.function(params.data(), extent * t / n, extent * (t + 1) / n);
    }
  }
  for (size_t i = 0; i < count; ++i)
    if (outputs[i]) nodes[i]->value = outputs[i];
  ++s.kernels;
  s.kernel_nodes += step.members;
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

// Programs by signature. Steps of one training loop share one entry; a loop that alternates a
// few shapes (train and eval batches) shares a few.
constexpr size_t max_programs = 256;

void execute_cpu(const std::vector<Node*>& pending, const std::vector<Node*>& required) {
  FusionOptions options;
  options.fuse = !eager_mode();
  Signature sig = sign(pending, required, options.fuse);
  static std::mutex mutex;
  static std::unordered_map<Hash128, std::shared_ptr<const Program>> programs;
  std::shared_ptr<const Program> program;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = programs.find(sig.hash);
    if (found != programs.end()) program = found->second;
  }
  ExecutionStats& s = stats();
  if (program) {
    ++s.programs_reused;
  } else {
    program = std::make_shared<const Program>(build_program(pending, sig.stored, options, sig));
    ++s.programs_built;
    std::lock_guard<std::mutex> lock(mutex);
    if (programs.size() >= max_programs) programs.clear();
    programs.emplace(sig.hash, program);
  }
  ++s.evaluations;
  // Bytes of this evaluation's stored values alive at once, for peak_bytes.
  int64_t live = 0, peak = 0;
  auto value_bytes = [](const Node* node) { return node->value ? bytes_of(*node->value) : 0; };
  for (size_t i = 0; i < program->steps.size(); ++i) {
    const Step& step = program->steps[i];
    switch (step.kind) {
      case FusionGroup::Kind::Kernel:
        run_kernel(step, pending, sig);
        break;
      case FusionGroup::Kind::MatMul:
        run_matmul(*sig.resolve(step.node, pending));
        break;
      case FusionGroup::Kind::Host: {
        Node* node = sig.resolve(step.node, pending);
        node->value = reference_compute(*node);
        ++s.host_ops;
        break;
      }
    }
    if (step.kind == FusionGroup::Kind::Kernel) {
      for (size_t p = 0; p < step.params.size(); ++p)
        if (step.kernel->params[p].output)
          live += value_bytes(sig.resolve(step.params[p], pending));
    } else {
      live += value_bytes(sig.resolve(step.node, pending));
    }
    peak = std::max(peak, live);
    for (NodeRef ref : program->release_after[i]) {
      Node* node = pending[ref];
      live -= value_bytes(node);
      node->value.reset();
    }
  }
  s.peak_bytes = std::max(s.peak_bytes, peak);
}

void set_kernel_observer(KernelObserver o) { observer() = std::move(o); }

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
