// mixtape/runtime/program.h -- what the compiled back ends share: graph signatures, programs of
// fusion groups cached by signature, the memory plan, and the execution counters.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "mixtape/codegen/fusion.h"
#include "mixtape/codegen/hash.h"
#include "mixtape/codegen/kernel_ir.h"
#include "mixtape/codegen/lru_cache.h"
#include "mixtape/dsl/node.h"
#include "mixtape/runtime/device.h"

namespace mixtape {

/// The counters execution_stats() reports, updated by every back end.
ExecutionStats& execution_counters();

/// Seconds between laps, for the host phases of ExecutionStats (a steady clock read costs tens
/// of nanoseconds: an evaluation reads it a few times).
class PhaseClock {
 public:
  double lap() {
    auto now = std::chrono::steady_clock::now();
    double seconds = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return seconds;
  }

 private:
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

/// A node of one evaluation by position: pending[ref] for ref >= 0, else externals[-ref - 1]
/// (evaluated inputs, numbered in the order the signature first meets them).
using NodeRef = int32_t;

/// What fusion and lowering depend on, as a hash, and the evaluated inputs in a fixed order.
/// Two evaluations with equal hashes run the same program on their own nodes. Float fill values
/// are left out (they are launch-time scalars), as are the random seeds and custom vjps that host
/// ops read from their node when they run.
struct Signature {
  Hash128 hash;
  std::vector<Node*> externals;
  // The nodes to store: those asked for, and those something outside this evaluation still
  // owns (a Tensor the user holds, such as the loss read after step()). The rest may stay in
  // registers or be dropped after their last reader.
  std::vector<Node*> stored;

  Node* resolve(NodeRef ref, const std::vector<Node*>& pending) const {
    return ref >= 0 ? pending[ref] : externals[-ref - 1];
  }
  /// The NodeRef of `node`, one of `pending` (the list this signature was made from) or of the
  /// externals; an mt::Error for any other. Program builds ask; signing itself keeps no map.
  NodeRef ref(const Node* node, const std::vector<Node*>& pending) const;

 private:
  mutable std::unordered_map<const Node*, NodeRef> external_refs_;  // built on first ref()
};

/// How `device` fuses: one kernel per op in eager mode; multi-pass reductions and multi-tensor
/// steps (MIXTAPE_MULTI_TENSOR=0 turns those off) on both compiling back ends.
FusionOptions fusion_options(Device device);

/// Whether the CPU back end forms multi-tensor steps: on unless MIXTAPE_MULTI_TENSOR=0, and
/// settable for tests that compare both.
bool multi_tensor_steps();
void set_multi_tensor_steps(bool enabled);

/// Whether the CPU back end runs a matmul's bias add and relu in its epilogue
/// (FusionOptions::matmul_epilogue): on unless MIXTAPE_MATMUL_EPILOGUE=0, and settable for tests
/// that compare both.
bool matmul_epilogue_steps();
void set_matmul_epilogue_steps(bool enabled);

/// Whether the CPU back end computes outputs into buffers their inputs give up (Step::in_place):
/// on unless MIXTAPE_IN_PLACE=0, and settable for tests and benchmarks that compare both.
bool in_place_outputs();
void set_in_place_outputs(bool enabled);
/// Whether a back end that can (the CPU: StepRunners::start_collective) runs a program's
/// collective steps on the communication thread beside the steps after them, each waited for
/// before the first step that reads its value. By default where the host has a core beyond its
/// processes' OpenMP threads (OMPI_COMM_WORLD_LOCAL_SIZE x omp_get_max_threads()), for the
/// communication thread to run on; MIXTAPE_OVERLAP_COLLECTIVES=1 or 0 decides instead. The values
/// are the same either way.
bool overlap_collectives();
void set_overlap_collectives(bool enabled);

/// The unevaluated nodes that evaluating `outputs` computes, in tape order.
std::vector<Node*> pending_nodes(const std::vector<NodePtr>& outputs);

/// The mt::Error for `reader` (an op's name; null: a read on the host) reading `value` after an
/// evaluation computed into its buffer (Node::overwritten, dsl/reusable_buffers.h).
[[noreturn]] void fail_overwritten(const Node& value, const char* reader);

/// `salt` names the back end, so that its programs never answer another's signatures.
Signature sign(const std::vector<Node*>& pending, const std::vector<Node*>& required, bool fuse,
               std::string_view salt);

/// One fusion group, ready to run on any evaluation of the same signature.
struct Step {
  FusionGroup::Kind kind = FusionGroup::Kind::Host;
  NodeRef node = 0;  // MatMul, Host
  // MatMul: the node the step stores (`node` itself, or the last of the readers fused into its
  // epilogue, FusionGroup::matmul), the bias row the epilogue adds, and its relu.
  NodeRef output = 0;
  NodeRef bias = 0;
  bool has_bias = false;
  bool relu = false;
  DType product_type = f32;  // what the product is rounded to before the bias is added
  DType bias_type = f32;     // what the bias is rounded to first (FusionGroup::bias_type)
  // Kernel:
  std::shared_ptr<const kir::Kernel> kernel;
  uintptr_t compiled = 0;  // what the back end's kernel loader returned (KernelRef::address)
  // Keeps the compiled code alive while a program (cached, or held by a replay plan) has this
  // step; null where the back end keeps its kernels for good.
  std::shared_ptr<const void> code;
  std::vector<NodeRef> params;        // kernel.params[i]'s node
  std::vector<NodeRef> scalar_nodes;  // the fill behind each scalar slot
  int64_t members = 0;
  // From the kernel, once at build time rather than at every launch (column_reduction() walks
  // the kernel's values): the range split across threads, and the loop nest's points.
  int64_t parallel_extent = 1;
  int64_t points = 1;
  // A multi-tensor kernel (kernel->multi_tensor): S segments, params and scalar_nodes hold each
  // segment's in turn, and the table {S, start_0 = 0, ..., start_S} is the kernel's params[0].
  std::vector<int64_t> segment_table;
  // Outputs the kernel may compute into the buffer of one of its inputs instead of a fresh one
  // (dsl/reusable_buffers.h): an evaluated input that it reads only where it stores the same
  // element of the output (in a reduction, in the epilogue), with the output's type, that no
  // later step reads, of a kernel that no host step follows. Each run decides whether it does: the
  // input's node must be one the caller lists, with no holders but `edges` (the input edges of the
  // evaluation's nodes that reach it) and the references the list names, and its buffer none but
  // the node.
  struct InPlace {
    uint32_t output, input;  // indices into params
    long edges;
  };
  std::vector<InPlace> in_place;
  // The last collective step (an index into Program::steps) whose value this step reads, -1 for
  // none: a collective started on the communication thread is waited for before it.
  int32_t awaits = -1;

  int64_t segments() const { return segment_table.empty() ? 1 : segment_table[0]; }
  /// Whether params[i] is a value the kernel stores (params repeat per segment).
  bool param_is_output(size_t i) const { return kernel->params[i % kernel->params.size()].output; }
};

struct Program {
  std::vector<Step> steps;
  // Memory plan: the stored values no later step reads and the caller did not ask for, dropped
  // right after step i (release_after[i]). Their memory goes back to the allocator for the
  // steps that follow; a later evaluation that does need one recomputes it from its inputs, as
  // it would a value fusion kept in registers.
  std::vector<std::vector<NodeRef>> release_after;
  // For each release, whether it frees a buffer the evaluation stored: a reshape (an Alias step)
  // shares its input's buffer, which goes with the last of the nodes holding it, and one of a
  // value evaluated before (a batch) holds nothing the evaluation stored. What peak_bytes counts.
  std::vector<std::vector<uint8_t>> frees_buffer;
};

/// What a back end's kernel loader returns for a kernel: the address its step runner takes, and
/// the owner of the compiled code (Step::code).
struct KernelRef {
  uintptr_t address = 0;
  std::shared_ptr<const void> owner;
};

/// Loads (compiles or fetches from a cache) a lowered kernel for one back end.
using KernelLoader = std::function<KernelRef(const kir::Kernel&)>;

/// Fuses and lowers `pending` into a program whose kernels `load` has loaded. With
/// options.multi_tensor, kernels that take the same multi-tensor form and read none of one
/// another's outputs (directly or through other steps) become one step, placed where the last
/// of them was.
Program build_program(const std::vector<Node*>& pending, const FusionOptions& options,
                      const Signature& sig, const KernelLoader& load);

/// About how many bytes a program holds: its steps, their kernels' IR and (for kernel steps)
/// an allowance for the compiled code they keep loaded.
int64_t approximate_bytes(const Program& program);

/// A back end's programs by signature. Steps of one training loop share one entry; a loop that
/// alternates a few shapes (train and eval batches) shares a few. Least recently used programs
/// are dropped once the cache holds more than memory_cache_bytes() (approximate_bytes each);
/// a dropped program lives on while a caller (an mt::compile plan) still holds it, and the
/// kernel code its steps own is freed with its last holder.
class ProgramCache {
 public:
  /// budget < 0: memory_cache_bytes().
  explicit ProgramCache(int64_t budget = -1) : programs_(budget) {}

  /// The program for `sig`, built with `load` (and counted in programs_built) on a miss.
  std::shared_ptr<const Program> get(const std::vector<Node*>& pending,
                                     const FusionOptions& options, const Signature& sig,
                                     const KernelLoader& load);

  struct Stats {
    int64_t programs = 0;  // held now
    int64_t bytes = 0;     // their approximate_bytes, within the budget
    int64_t evictions = 0;
  };
  Stats stats();

 private:
  std::mutex mutex_;
  LruCache<Hash128, std::shared_ptr<const Program>> programs_;
};

/// What a back end ran for one evaluation: enough to run it again on the same nodes.
struct ExecutedProgram {
  Signature sig;
  std::shared_ptr<const Program> program;
};

/// Times steps on a device that runs them asynchronously, for MIXTAPE_LOG=profile: `mark`
/// queues a timestamp behind the work queued so far; `elapsed` waits for the marks made since it
/// was last called and returns the seconds between marks 2i and 2i+1, for each i.
struct DeviceTimer {
  void (*mark)();
  std::vector<double> (*elapsed)();
};

/// How a back end runs the steps that are its own (run_program shares Alias storage itself).
struct StepRunners {
  void (*kernel)(const Step& step, const std::vector<Node*>& pending, const Signature& sig);
  void (*matmul)(const Step& step, const std::vector<Node*>& pending, const Signature& sig);
  void (*host)(Node& node);  // ops without a kernel: gathers, random numbers, ...
  // Null where a step has finished when its runner returns (the CPU: its wall time is its time).
  const DeviceTimer* timer = nullptr;
  // Where set, a collective step (all_reduce, ...) is started with it on another thread instead
  // of run by `host`, and its value taken from the future when a later step needs it.
  std::future<std::shared_ptr<Storage>> (*start_collective)(const Node& node) = nullptr;
};

/// Runs every step with `run`, drops values as the memory plan says, and records the peak of
/// the stored values' bytes alive at once. Under MIXTAPE_LOG=profile it also sums each step's
/// wall time by what the step is, and with a `run.timer` its device time (waiting for the device
/// at the end of the evaluation), both printed at exit.
void run_program(const Program& program, const std::vector<Node*>& pending, const Signature& sig,
                 const StepRunners& run);

}  // namespace mixtape
