// jit/llvm_jit.h -- compiles LLVM IR text for the host CPU with ORC LLJIT, through the kernel
// cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/cpu_kernels.h"

namespace llvm {
class TargetMachine;
}

namespace mixtape {

/// A kernel loaded into the JIT. Its code stays mapped while the object lives: the last owner's
/// release removes it from the JIT (its own ORC ResourceTracker), so that a process sweeping
/// many shapes holds the code of the kernels its cached programs still use, not of every kernel
/// it ever ran.
class JitKernel {
 public:
  ~JitKernel();
  JitKernel(const JitKernel&) = delete;
  JitKernel& operator=(const JitKernel&) = delete;

  KernelFunction function = nullptr;

 private:
  friend class LlvmJit;
  struct Private;
  explicit JitKernel(std::unique_ptr<Private> p);
  std::unique_ptr<Private> p_;
};

class LlvmJit {
 public:
  static LlvmJit& instance();
  ~LlvmJit();

  /// The function `name` defined by `ir`: from this process's loaded kernels, else from the
  /// kernel cache (memory or disk), else compiled at -O3 for the host CPU and cached.
  std::shared_ptr<const JitKernel> load(const std::string& name, const std::string& ir);

  /// load() for many kernels at once: those neither loaded nor cached compile in parallel, on
  /// every core.
  struct KernelSource {
    std::string name;
    std::string ir;
  };
  std::vector<std::shared_ptr<const JitKernel>> load_all(const std::vector<KernelSource>& kernels);

  /// The relocatable object file of each kernel (its function `name`, position-independent, at
  /// -O3), as load_all() would load it: from the kernel cache, else compiled (misses in
  /// parallel) and cached. The AOT packager links these into an artifact, so kernels the
  /// training run compiled are not compiled again. `cpu` empty: for the host CPU, with all its
  /// features; else for that LLVM CPU name ("x86-64-v3", "x86-64", "znver3") and only the
  /// features it implies (an mt::Error for a name LLVM does not know).
  std::vector<std::vector<std::byte>> objects(const std::vector<KernelSource>& kernels,
                                              const std::string& cpu = "");
  /// Whether LLVM knows the CPU name.
  bool known_cpu(const std::string& cpu) const;
  /// Those of `candidates` (LLVM feature names, runtime/cpu_features.h's table) that code
  /// compiled for `cpu` (empty: the host) may use.
  std::vector<std::string> cpu_features(const std::string& cpu,
                                        const std::vector<std::string>& candidates) const;

  /// LLVM version, host CPU name and features: what makes an object valid for this machine.
  std::string target() const;

  struct Stats {
    int64_t compiled = 0;        // IR compiled to machine code
    int64_t disk_loaded = 0;     // objects taken from the kernel cache
    int64_t memory_hits = 0;     // already loaded in this process
    double compile_seconds = 0;  // wall time waited for compilation (parallel: the longest)
    double load_seconds = 0;
    int64_t resident = 0;        // kernels loaded now (some owner still holds them)
    int64_t resident_bytes = 0;  // their object files' bytes
  };
  Stats stats() const;

 private:
  LlvmJit();
  std::vector<std::byte> compile_object(const std::string& name, const std::string& ir,
                                        const std::string& cpu);
  // Kernel-cache key of an object compiled from ir for cpu (empty: the host).
  std::string cache_key(const std::string& ir, const std::string& cpu) const;
  // A target machine for cpu (empty: the host's, with its features).
  std::unique_ptr<llvm::TargetMachine> target_machine(const std::string& cpu) const;
  // Compiles kernels[i] into objects[i] for each i in missing, on every core; returns the wall
  // time.
  double compile_missing(const std::vector<KernelSource>& kernels,
                         const std::vector<size_t>& missing,
                         std::vector<std::optional<std::vector<std::byte>>>& objects,
                         const std::string& cpu);
  friend class JitKernel;
  struct State;
  // Shared with every JitKernel, so the JIT outlives the last of them (static destruction order
  // is not known).
  std::shared_ptr<State> state_;
};

}  // namespace mixtape
