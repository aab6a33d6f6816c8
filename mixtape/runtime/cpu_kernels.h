// mixtape/runtime/cpu_kernels.h -- where the CPU back end gets machine code for its kernels: the
// JIT library (jit/) installs LLVM's compiler; an AOT artifact brings a table of compiled kernels.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "mixtape/codegen/kernel_ir.h"
#include "mixtape/runtime/program.h"

namespace mixtape {

/// The entry point of every generated CPU kernel (see codegen/emit_llvm.h).
using KernelFunction = void (*)(void* const* params, int64_t begin, int64_t end);

/// A kernel's machine code: the function, and whatever keeps it mapped (null where it stays
/// for good, as in an artifact's table).
struct CompiledKernel {
  KernelFunction function = nullptr;
  std::shared_ptr<const void> code;
  /// Where a tiered compiler swaps in faster code for the same kernel (kept alive by code): when
  /// set, each launch calls what it holds instead of function.
  const std::atomic<KernelFunction>* entry = nullptr;

  KernelFunction current() const {
    return entry ? entry->load(std::memory_order_acquire) : function;
  }
};

/// Lifetime counters of a compiler, for execution_stats().
struct CompilerStats {
  int64_t compiled = 0;     // kernels compiled
  int64_t disk_loaded = 0;  // kernels taken from the kernel cache on disk
  double compile_seconds = 0;
  double load_seconds = 0;
};

/// Compiles the CPU back end's kernels: execute_cpu() hands it each new program's kernels at once
/// (so that they compile in parallel).
class CpuKernelCompiler {
 public:
  virtual ~CpuKernelCompiler() = default;
  /// One compiled kernel per element of `kernels`, in order; an mt::Error if any fails.
  virtual std::vector<CompiledKernel> compile(const std::vector<const kir::Kernel*>& kernels) = 0;
  virtual CompilerStats stats() const = 0;
};

/// The compiler execute_cpu() uses; null until the JIT library installs LLVM's at start. A graph
/// that needs a kernel no program has yet is then an mt::Error (a program that links only
/// mixtape_runtime can replay AOT artifacts, not compile).
CpuKernelCompiler* cpu_kernel_compiler();
void set_cpu_kernel_compiler(CpuKernelCompiler* compiler);

/// What a KernelLoader returns for a kernel that is already compiled (an artifact's table entry),
/// so that build_program() makes steps replay_cpu() runs.
KernelRef ready_cpu_kernel(CompiledKernel kernel);

}  // namespace mixtape
