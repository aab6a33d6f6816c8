// mixtape/jit/cpu_jit.cpp -- installs LLVM's JIT as the CPU back end's kernel compiler when the
// mixtape library is linked.
#include "mixtape/codegen/emit_llvm.h"
#include "mixtape/dsl/log.h"
#include "mixtape/jit/llvm_jit.h"
#include "mixtape/runtime/cpu_kernels.h"

namespace mixtape {
namespace {

class JitCompiler final : public CpuKernelCompiler {
 public:
  std::vector<CompiledKernel> compile(const std::vector<const kir::Kernel*>& kernels) override {
    std::vector<LlvmJit::KernelSource> sources;
    for (const kir::Kernel* kernel : kernels) {
      sources.push_back({kernel->name, emit_llvm(*kernel)});
      if (log_enabled("llvm")) log_line("llvm", "{}", sources.back().ir);
    }
    std::vector<std::shared_ptr<const JitKernel>> loaded = LlvmJit::instance().load_all(sources);
    std::vector<CompiledKernel> out;
    for (auto& kernel : loaded) out.push_back({kernel->function(), kernel, &kernel->entry()});
    return out;
  }
  CompilerStats stats() const override {
    LlvmJit::Stats s = LlvmJit::instance().stats();
    return {s.compiled, s.disk_loaded, s.compile_seconds, s.load_seconds};
  }
};

// Installed before main(): a program that links mixtape compiles graphs without asking.
const bool installed = [] {
  static JitCompiler compiler;
  set_cpu_kernel_compiler(&compiler);
  return true;
}();

}  // namespace
}  // namespace mixtape

// The mixtape library's link interface names this symbol (CMakeLists.txt), so that the linker
// keeps this object, and its installer, in every program that links the static library.
extern "C" const bool* mixtape_jit_anchor() { return &mixtape::installed; }
