// mixtape/runtime/cpu_executor.h -- the compiled CPU back end's entry point.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "mixtape/codegen/lower.h"
#include "mixtape/dsl/node.h"
#include "mixtape/runtime/device.h"
#include "mixtape/runtime/program.h"

namespace mixtape {

/// Computes `pending` (unevaluated nodes in tape order, precision already assigned): fuses them
/// (or not, in eager mode), runs each kernel, matmul and host op, and stores the values of every
/// node in `required` and of every node another group reads. Nodes fused away stay unevaluated;
/// a later evaluation that needs them recomputes them from their inputs.
/// Returns the program it ran, which replay_cpu runs again on the same nodes (mt::compile).
ExecutedProgram execute_cpu(const std::vector<Node*>& pending, const std::vector<Node*>& required);
/// Whether the evaluation under way on this thread came through evaluate_queued() (dsl/graph.h):
/// execute_cpu() may then queue it on the CPU stream.
bool evaluation_may_queue();
/// The signature execute_cpu() gives an evaluation built with `options`.
Signature sign_cpu(const std::vector<Node*>& pending, const std::vector<Node*>& required,
                   const FusionOptions& options);
/// Runs `executed` again on `pending`, the nodes it was signed with: their inputs
/// (sig.externals) hold the values to use, the pending nodes' values are recomputed.
/// `in_place` lists stored nodes, sorted, with the buffer each may be computed into (mt::compile's
/// state, updated in place: runtime/step_plan.cpp): a kernel computes one there when its
/// Step::in_place input holds that very buffer, which the kernel then reads only where it writes.
void replay_cpu(const ExecutedProgram& executed, const std::vector<Node*>& pending,
                const std::vector<std::pair<const Node*, std::shared_ptr<Storage>>>& in_place = {});

/// Called with each kernel the CPU back end is about to run, its inputs already evaluated
/// (kernel.nodes[i]->value for input params): for tools and tests that look at the generated
/// code, such as the NVRTC tests that compile every kernel of a model for the GPU. An empty
/// function removes the observer.
using KernelObserver = std::function<void(const LoweredKernel&)>;
void set_kernel_observer(KernelObserver observer);

/// The CPU back end's program cache (bounded by memory_cache_bytes()), for tests and tools.
ProgramCache::Stats cpu_program_cache_stats();

}  // namespace mixtape
