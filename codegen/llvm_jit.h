// codegen/llvm_jit.h -- compiles LLVM IR text for the host CPU with ORC LLJIT, through the kernel
// cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mixtape {

/// The entry point of every generated CPU kernel (see codegen/emit_llvm.h).
using KernelFunction = void (*)(void* const* params, int64_t begin, int64_t end);

class LlvmJit {
 public:
  static LlvmJit& instance();
  ~LlvmJit();

  /// The function `name` defined by `ir`: from this process's loaded kernels, else from the
  /// kernel cache (memory or disk), else compiled at -O3 for the host CPU and cached.
  KernelFunction load(const std::string& name, const std::string& ir);

  /// load() for many kernels at once: those neither loaded nor cached compile in parallel, on
  /// every core.
  struct KernelSource {
    std::string name;
    std::string ir;
  };
  std::vector<KernelFunction> load_all(const std::vector<KernelSource>& kernels);

  /// LLVM version, host CPU name and features: what makes an object valid for this machine.
  std::string target() const;

  struct Stats {
    int64_t compiled = 0;        // IR compiled to machine code
    int64_t disk_loaded = 0;     // objects taken from the kernel cache
    int64_t memory_hits = 0;     // already loaded in this process
    double compile_seconds = 0;  // wall time waited for compilation (parallel: the longest)
    double load_seconds = 0;
  };
  Stats stats() const;

 private:
  LlvmJit();
  std::vector<std::byte> compile_object(const std::string& name, const std::string& ir);
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace mixtape
