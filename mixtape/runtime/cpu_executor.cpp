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
#include "mixtape/dsl/process_group.h"
#include "mixtape/dsl/reusable_buffers.h"
#include "mixtape/runtime/all_reduce.h"
#include "mixtape/runtime/attention.h"
#include "mixtape/runtime/compile.h"
#include "mixtape/runtime/conv.h"
#include "mixtape/runtime/cpu_indexing.h"
#include "mixtape/runtime/cpu_kernels.h"
#include "mixtape/runtime/cpu_sort.h"
#include "mixtape/runtime/cpu_stream.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/gemm.h"
#include "mixtape/runtime/half_convert.h"
#include "mixtape/runtime/matmul_dims.h"
#include "mixtape/runtime/onednn_team.h"
#include "mixtape/runtime/pool.h"
#include "mixtape/runtime/program.h"
#include "mixtape/runtime/reference_executor.h"

namespace mixtape {
namespace {

// Below this many elements per launch (tens of microseconds of work), threads cost more than
// they save, above all on a loaded machine.
constexpr int64_t parallel_threshold = 1 << 17;
// The largest steps a queued evaluation may hold when the caller's OpenMP team is one thread
// (runs_on_one_thread).
constexpr int64_t kQueuedMaxPointsAlone = int64_t{1} << 20;
constexpr double kQueuedMaxFlopsAlone = double{1 << 24};

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
  // Work queued on the CPU stream that reads it runs before this output is written, whether the
  // output is queued too or waits for the stream (host_data). Its holds go with queued_uses,
  // the count dropped first (cpu_stream.cpp): read after the holders, through the fence, the
  // count is never older than the holders, so `held` may err high (no reuse), never low.
  const long held = buffer.use_count();
  std::atomic_thread_fence(std::memory_order_acquire);
  if (held - buffer->queued_uses.load(std::memory_order_relaxed) != 1 + copies ||
      input.weak_from_this().use_count() != edges + holders ||
      buffer->dtype != output.precision.storage_type || buffer->count != output.numel() ||
      buffer->device)
    return nullptr;
  forget_narrowed_copies(buffer);
  input.overwritten = true;
  ++stats().outputs_in_place;
  return buffer;
}

int64_t bytes_of(const Storage& s) { return s.size_bytes(); }

// A kernel launch: the parameter list, the range and how to split it across threads.
struct KernelLaunch {
  KernelFunction function = nullptr;
  void** args = nullptr;
  int64_t extent = 0;
  int threads = 1;
  // A multi-tensor reduction's segment starts (Step::segment_table past its count): each thread
  // takes whole segments. Null for a plain split of the range.
  const int64_t* segment_starts = nullptr;
};

void launch(const KernelLaunch& k) {
  if (k.threads <= 1 || k.extent < 2) return k.function(k.args, 0, k.extent);
#pragma omp parallel num_threads(k.threads)
  {
    FlushDenormalScope float_mode;  // the team's threads may be the caller's too
    int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    if (k.segment_starts) {
      // Whole segments, a thread taking those that start in its share of the elements.
      const int64_t* starts = k.segment_starts;
      int64_t total = starts[k.extent];
      auto first_from = [&](int64_t share) {
        return std::lower_bound(starts, starts + k.extent, total * share / n) - starts;
      };
      k.function(k.args, first_from(t), t + 1 == n ? k.extent : first_from(t + 1));
    } else {
      k.function(k.args, k.extent * t / n, k.extent * (t + 1) / n);
    }
  }
}

void convert(const Storage& value, Storage& out);

// The part of an evaluation queued on the CPU stream (async_evaluation()): kernel launches and
// matmuls, bound to their buffers as replay_cpu went through the program, run in that order on
// the stream's worker.
class QueuedRun final : public StreamWork {
 public:
  // Raw pointers: the run holds each storage once (StreamWork::read/write), so that
  // use_count() - queued_uses is what else holds it (reusable_buffer).
  // An operand in the type the product reads: the value itself (copy null), or a copy that the
  // run converts it into before the first product that reads it.
  struct Operand {
    Storage* value = nullptr;
    std::shared_ptr<Storage> copy;
    bool fill = false;  // this product converts into copy (a leaf's copy is shared)
    const Storage& read() const {
      if (!copy) return *value;
      if (fill) convert(*value, *copy);
      return *copy;
    }
  };
  struct MatMul {
    GemmDesc desc;
    Operand a, b, bias;
    Storage* out = nullptr;
  };
  struct Launch {
    KernelLaunch kernel;
    size_t first_arg = 0;
    int64_t matmul = -1;  // an index into matmuls, or -1 for a kernel launch
  };

  explicit QueuedRun(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
  const std::shared_ptr<const Program>& program() const { return program_; }

  std::vector<void*> args;
  // Scalar slots: args[first] is to point at scalars[second] once scalars stops growing.
  std::vector<std::pair<size_t, size_t>> scalar_args;
  std::vector<double> scalars;
  std::vector<Launch> launches;
  std::vector<MatMul> matmuls;

  // `value` read in `dtype`. A copy is allocated here, on the thread that queues the run, so
  // that running out of memory (a memory limit) is an mt::Error of this evaluation before any
  // of it runs, not a failure of the queued work, which would mark everything it writes (the
  // parameters an optimizer updates in place) never computed. A leaf (a weight read by the
  // forward product and the weight gradient) is converted once a run.
  Operand operand(Storage& value, DType dtype, bool leaf) {
    Operand o;
    o.value = &value;
    if (value.dtype == dtype) return o;
    if (leaf)
      for (const auto& [source, copy] : converted_)
        if (source == &value && copy->dtype == dtype) {
          o.copy = copy;
          return o;
        }
    o.copy = std::make_shared<Storage>(dtype, value.count, Storage::Uninitialized{});
    o.fill = true;
    if (leaf) converted_.emplace_back(&value, o.copy);
    return o;
  }

  void run() override {
    for (auto [arg, scalar] : scalar_args) args[arg] = scalars.data() + scalar;
    for (Launch& l : launches) {
      if (l.matmul < 0) {
        l.kernel.args = args.data() + l.first_arg;
        launch(l.kernel);
        continue;
      }
      MatMul& m = matmuls[static_cast<size_t>(l.matmul)];
      const Storage& a = m.a.read();
      const Storage& b = m.b.read();
      const Storage* bias = m.bias.value ? &m.bias.read() : nullptr;
      gemm(m.desc, a.host_data(), b.host_data(), m.out->bytes.data(),
           bias ? bias->host_data() : nullptr);
      m.a.copy.reset(), m.b.copy.reset(), m.bias.copy.reset();
    }
    converted_.clear();
  }

 private:
  std::shared_ptr<const Program> program_;  // its kernels' code
  std::vector<std::pair<const Storage*, std::shared_ptr<Storage>>> converted_;
};

// The evaluation replay_cpu is queuing on this thread, or null when it runs synchronously.
std::unique_ptr<QueuedRun>& queued_run() {
  thread_local std::unique_ptr<QueuedRun> run;
  return run;
}

// Hands what the evaluation has queued so far to the stream, before a step that runs on this
// thread (and waits for it where the step reads its values); later steps queue anew.
void submit_queued() {
  std::unique_ptr<QueuedRun>& run = queued_run();
  if (!run || run->holds_nothing()) return;
  std::unique_ptr<QueuedRun> full = std::move(run);
  run = std::make_unique<QueuedRun>(full->program());
  submit_to_cpu_stream(std::move(full));
}

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
  // Queued on the CPU stream, the parameters go into the queued run's list, their scalars'
  // addresses set once its scalars stop growing.
  QueuedRun* queued = queued_run().get();
  std::vector<void*>& args = queued ? queued->args : params;
  const size_t first_arg = args.size();
  if (kernel.multi_tensor) args.push_back(const_cast<int64_t*>(step.segment_table.data()));
  size_t per_segment = kernel.params.size();
  for (size_t i = 0; i < count; ++i) {
    Node* node = nodes[i] = sig.resolve(step.params[i], pending);
    if (step.param_is_output(i)) {
      if (!outputs[i]) outputs[i] = allocate(*node);
      args.push_back(queued ? queued->write(outputs[i]) : outputs[i]->host_data());
      s.bytes_written += bytes_of(*outputs[i]);
    } else {
      args.push_back(queued ? queued->read(node->value) : node->value->host_data());
      s.bytes_read += bytes_of(*node->value);
    }
    if (kernel.scalars > 0 && (i + 1) % per_segment == 0) {
      const size_t first_scalar = (i / per_segment) * kernel.scalars;
      if (!queued) {
        args.push_back(scalars.data() + first_scalar);
      } else {
        queued->scalar_args.emplace_back(args.size(), queued->scalars.size() + first_scalar);
        args.push_back(nullptr);
      }
    }
  }
  if (observer()) {
    LoweredKernel lowered{kernel, nodes, scalars, {}};
    for (NodeRef ref : step.scalar_nodes) lowered.scalar_nodes.push_back(sig.resolve(ref, pending));
    observer()(lowered);
  }
  KernelLaunch k;
  k.function = function;
  k.extent = step.parallel_extent;
  k.threads = step.points >= parallel_threshold ? omp_get_max_threads() : 1;
  if (kernel.multi_tensor && kernel.is_reduction())
    k.segment_starts = step.segment_table.data() + 1;
  if (queued) {
    queued->scalars.insert(queued->scalars.end(), scalars.begin(), scalars.end());
    queued->launches.push_back({k, first_arg, -1});
  } else {
    // The scratch vectors are this thread's: the team gets their data by pointer.
    k.args = params.data();
    launch(k);
  }
  for (size_t i = 0; i < count; ++i)
    if (outputs[i]) nodes[i]->value = std::move(outputs[i]);
  ++s.kernels;
  s.kernel_nodes += step.members;
}

// `value`'s elements in `out`'s dtype (a matmul's compute type).
void convert(const Storage& value, Storage& out) {
  if (value.dtype == f32 && out.dtype == bf16)
    narrow_to_bf16(value.as<float>(), out.as<uint16_t>(), value.count);
  else if (value.dtype == f32 && out.dtype == f16)
    narrow_to_f16(value.as<float>(), out.as<uint16_t>(), value.count);
  else
    for (int64_t i = 0; i < value.count; ++i) store_element(out, i, load_element<double>(value, i));
}

bool is_leaf(const Node& node) { return op_info(node.op).kind == OpKind::Leaf; }

// An input's value in `dtype` (the matmul's compute type): itself, or converted. A leaf's copy
// is kept for the run (replay_cpu drops them at its end).
std::shared_ptr<Storage> as_dtype(const Node& input, DType dtype) {
  const std::shared_ptr<Storage>& value = input.value;
  if (value->dtype == dtype) return value;
  const bool leaf = is_leaf(input);
  std::vector<NarrowedCopy>& copies = narrowed_copies();
  if (leaf)
    for (const NarrowedCopy& c : copies)
      if (c.source == value && c.copy->dtype == dtype) return c.copy;
  auto out = std::make_shared<Storage>(dtype, value->count, Storage::Uninitialized{});
  if (leaf) copies.push_back({value, out});
  convert(*value, *out);
  return out;
}

// A matmul, with the bias add and relu fusion gave its epilogue (FusionGroup::matmul): the step
// stores only its output node's value.
void run_matmul(const Step& step, const std::vector<Node*>& pending, const Signature& sig) {
  Node& node = *sig.resolve(step.node, pending);
  Node& output = *sig.resolve(step.output, pending);
  // The bias, read in the type the add reads it in (an f32 parameter's bf16 copy is made once a
  // run).
  const Node* bias_node = step.has_bias ? sig.resolve(step.bias, pending) : nullptr;
  GemmDesc desc = matmul_desc<GemmDesc>(node);
  desc.operand = node.precision.compute, desc.out = output.precision.storage_type;
  desc.has_bias = bias_node != nullptr, desc.bias_type = bias_node ? step.bias_type : f32;
  desc.relu = step.relu, desc.product_type = step.product_type;
  // A 16-bit accumulator (asked for by a custom policy) is not what oneDNN does: the reference
  // loops honour it. Fusion gives such products no epilogue.
  if (!gemm_supported(desc) || is_half(node.precision.accum)) {
    if (&output != &node)
      fail("internal: a {} matmul with a fused epilogue, which gemm does not run",
           name(desc.operand));
    submit_queued();
    node.value = reference_compute(node);
    ++stats().host_ops;
    return;
  }
  const Node &a = *node.inputs[0], &b = *node.inputs[1];
  auto out = allocate(output);
  ExecutionStats& s = stats();
  ++s.gemms;
  s.bytes_read +=
      (a.value->count + b.value->count) * static_cast<int64_t>(size_of(desc.operand)) +
      (bias_node ? bias_node->value->count * static_cast<int64_t>(size_of(step.bias_type)) : 0);
  s.bytes_written += bytes_of(*out);
  if (desc.batch == 0) {
    output.value = out;
    return;
  }
  if (QueuedRun* queued = queued_run().get()) {
    output.value = out;  // a failure of the work marks it never computed
    // Converted on the stream: the conversion reads the values.
    QueuedRun::MatMul m;
    m.desc = desc;
    m.a = queued->operand(*a.value, desc.operand, is_leaf(a));
    m.b = queued->operand(*b.value, desc.operand, is_leaf(b));
    m.out = out.get();
    queued->read(a.value), queued->read(b.value), queued->write(out);
    if (bias_node) {
      m.bias = queued->operand(*bias_node->value, step.bias_type, is_leaf(*bias_node));
      queued->read(bias_node->value);
    }
    queued->launches.push_back({{}, 0, static_cast<int64_t>(queued->matmuls.size())});
    queued->matmuls.push_back(m);
    return;
  }
  std::shared_ptr<Storage> bias = bias_node ? as_dtype(*bias_node, step.bias_type) : nullptr;
  auto a_value = as_dtype(a, desc.operand), b_value = as_dtype(b, desc.operand);
  gemm(desc, a_value->host_data(), b_value->host_data(), out->host_data(),
       bias ? bias->host_data() : nullptr);
  // Only once computed: where reading an operand throws (it reports an earlier queued failure,
  // or names a value never computed) or the product fails, the node stays unevaluated, so that
  // nothing later reads its unwritten buffer as a value.
  output.value = out;
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
  auto a = as_dtype(*node.inputs[0], desc.operand);
  auto b = as_dtype(*node.inputs[1], desc.operand);
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

// Steps without a generated kernel: convolutions through oneDNN, max pooling, attention, indexing
// and sorting by their loops, the rest by the reference loops.
void run_host_step(Node& node) {
  submit_queued();  // what it reads may be queued
  if (op_info(node.op).kind == OpKind::Conv) return run_conv(node);
  if (op_info(node.op).kind == OpKind::Pool)
    return run_own_loops(node, max_pool_cpu_supported(node), max_pool_cpu);
  if (op_info(node.op).kind == OpKind::Attention)
    return run_own_loops(node, attention_cpu_supported(node), attention_cpu);
  if (op_info(node.op).kind == OpKind::Gather)
    return run_own_loops(node, indexing_cpu_supported(node), indexing_cpu);
  if (op_info(node.op).kind == OpKind::Sort)
    return run_own_loops(node, argsort_cpu_supported(node), argsort_cpu);
  node.value = reference_compute(node);
  ++stats().host_ops;
}

// Whether every step of `program` runs on one thread whatever the OpenMP team: its kernels and
// products below their team thresholds, and no host step of those that split their work
// (convolutions, pooling, attention, large indexing and sorting steps, collectives). Only such a
// program is queued on the CPU stream, whose worker runs it alone on its own core: an OpenMP team
// there would share a core with the thread that traces on, and every region of it would wait for
// the descheduled member.
bool runs_on_one_thread(const Program& program, const std::vector<Node*>& pending,
                        const Signature& sig) {
  // With a team of one (OMP_NUM_THREADS=1) every step runs on one thread anyway, and what bounds
  // the queue is a step's cost: digits_demo's batch-256 products (2^22-2^23 flops) ran 25% (fp32)
  // and 35% (bf16) more traced steps a second queued at one thread, mlp_w64_b4096's (2^25 flops)
  // 5-10% fewer, their time dwarfing the tracing it would hide.
  const bool team_of_one = omp_get_max_threads() == 1;
  for (const Step& step : program.steps) {
    if (step.kind == FusionGroup::Kind::Kernel) {
      if (step.points >= (team_of_one ? kQueuedMaxPointsAlone : parallel_threshold)) return false;
    } else if (step.kind == FusionGroup::Kind::MatMul) {
      const GemmDesc desc = matmul_desc<GemmDesc>(*sig.resolve(step.node, pending));
      const double flops = 2.0 * static_cast<double>(desc.batch) * static_cast<double>(desc.m) *
                           static_cast<double>(desc.n) * static_cast<double>(desc.k);
      if (team_of_one ? flops >= kQueuedMaxFlopsAlone : !gemm_on_calling_thread(desc)) return false;
    } else if (step.kind != FusionGroup::Kind::Alias) {
      const Node& node = *sig.resolve(step.node, pending);
      OpKind kind = op_info(node.op).kind;
      if (kind == OpKind::Conv || kind == OpKind::Pool || kind == OpKind::Attention ||
          kind == OpKind::Collective || (kind == OpKind::Gather && indexing_cpu_splits(node)) ||
          (kind == OpKind::Sort && argsort_cpu_splits(node)))
        return false;
    }
  }
  return true;
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
  ExecutionStats& counters = execution_counters();
  executed.sig = sign_cpu(pending, required, options);
  const double sign_seconds = clock.lap();
  const int64_t built = counters.programs_built;
  executed.program = cpu_programs().get(pending, options, executed.sig, register_kernel);
  compile_pending();
  const bool first_run = counters.programs_built != built;
  const double lookup_seconds = clock.lap();
  // The run phase (runtime/eval.cpp) counts from before the signature: take these out of it.
  counters.sign_seconds += sign_seconds;
  counters.lookup_seconds += lookup_seconds;
  counters.run_seconds -= sign_seconds + lookup_seconds;
  // Queued on the CPU stream: an optimizer's step (evaluate_queued) of a small program
  // (runs_on_one_thread) that ran before (its first run
  // makes the statics its work uses, which the stream must outlive at exit), where nothing
  // watches the steps run one by one (a kernel observer, the profile, mt::compile's trace) and
  // no collective waits for other processes.
  const bool may_queue = evaluation_may_queue() && async_evaluation();
  const bool queue = may_queue && !first_run && !observer() && !log_enabled("profile") &&
                     !tracing_step() && process_count() <= 1 && !on_cpu_stream() &&
                     runs_on_one_thread(*executed.program, pending, executed.sig);
  if (!queue) {
    replay_cpu(executed, pending);
    if (first_run && may_queue) keep_cpu_stream_ahead_of_exit();
    return executed;
  }
  ++counters.evaluations_queued;
  queued_run() = std::make_unique<QueuedRun>(executed.program);
  struct Submit {  // also when binding a step throws: the steps bound before it still run
    ~Submit() {
      try {
        submit_queued();
      } catch (...) {
        // No worker could be started: the work is dropped, and what it was to write reads as
        // never computed (an mt::Error), never as a value.
      }
      queued_run().reset();
    }
  } submit;
  // Its host steps (random draws split their work) run beside the worker, without a team.
  OnednnTeam one_thread(true);
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
