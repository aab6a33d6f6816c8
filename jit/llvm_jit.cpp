// jit/llvm_jit.cpp -- LLVM IR text -> host machine code: O3 pipeline, object emission, ORC
// LLJIT.
#include "jit/llvm_jit.h"

#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/LegacyPassManager.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Verifier.h>
#include <llvm/IRReader/IRReader.h>
#include <llvm/MC/MCSubtargetInfo.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/SourceMgr.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Target/TargetMachine.h>
#include <llvm/TargetParser/Host.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "codegen/kernel_cache.h"
#include "dsl/error.h"
#include "dsl/log.h"

namespace mixtape {
namespace {

// Bumped whenever emitted code for the same IR could change (pipeline, flags): part of the key.
// 3: position-independent code, so that the AOT packager links cached objects into shared
// libraries.
constexpr int jit_version = 3;

std::string to_text(llvm::Error error) {
  std::string text;
  llvm::handleAllErrors(std::move(error),
                        [&](const llvm::ErrorInfoBase& info) { text += info.message(); });
  return text;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <typename T>
T unwrap(llvm::Expected<T> value, const char* what) {
  if (!value) fail("LLVM JIT: {}: {}", what, to_text(value.takeError()));
  return std::move(*value);
}

}  // namespace

struct LlvmJit::State {
  std::mutex mutex;
  std::unique_ptr<llvm::orc::LLJIT> jit;
  std::optional<llvm::orc::JITTargetMachineBuilder> builder;  // one target machine per compile
  std::unique_ptr<llvm::TargetMachine> machine;
  std::string cpu, features;
  // An entry expires when its kernel's last owner lets go; the kernel's destructor then erases
  // it (under the mutex) as it removes the code.
  std::unordered_map<std::string, std::weak_ptr<const JitKernel>> loaded;
  Stats stats;

  // The loaded kernel `name`, or null when there is none. A kernel whose last owner has just let
  // go is waited for (the lock released meanwhile) until its destructor has removed its code, so
  // that the caller may define the symbol again.
  std::shared_ptr<const JitKernel> live(const std::string& name,
                                        std::unique_lock<std::mutex>& lock) {
    for (;;) {
      auto found = loaded.find(name);
      if (found == loaded.end()) return nullptr;
      if (std::shared_ptr<const JitKernel> kernel = found->second.lock()) return kernel;
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    }
  }
};

struct JitKernel::Private {
  // First, so destroyed last: the tracker's destructor still calls into the JIT, which the last
  // kernel alive at exit keeps (after the LlvmJit instance is gone).
  std::shared_ptr<LlvmJit::State> state;
  std::string name;
  llvm::orc::ResourceTrackerSP tracker;
  int64_t bytes = 0;
};

JitKernel::JitKernel(std::unique_ptr<Private> p) : p_(std::move(p)) {}

JitKernel::~JitKernel() {
  LlvmJit::State& state = *p_->state;
  std::lock_guard<std::mutex> lock(state.mutex);
  state.loaded.erase(p_->name);
  // Removing code cannot fail in a way the caller could act on; the bytes are then leaked.
  llvm::consumeError(p_->tracker->remove());
  p_->tracker = nullptr;
  --state.stats.resident;
  state.stats.resident_bytes -= p_->bytes;
}

LlvmJit::LlvmJit() : state_(std::make_shared<State>()) {
  llvm::InitializeNativeTarget();
  llvm::InitializeNativeTargetAsmPrinter();
  llvm::InitializeNativeTargetAsmParser();
  auto builder = unwrap(llvm::orc::JITTargetMachineBuilder::detectHost(), "detecting the host");
  state_->cpu = llvm::sys::getHostCPUName().str();
  llvm::StringMap<bool> host_features;
  llvm::SubtargetFeatures features;
  if (llvm::sys::getHostCPUFeatures(host_features))
    for (auto& feature : host_features) features.AddFeature(feature.first(), feature.second);
  state_->features = features.getString();
  builder.setCPU(state_->cpu);
  builder.addFeatures(features.getFeatures());
  builder.setCodeGenOptLevel(llvm::CodeGenOpt::Aggressive);
  // The same objects go into AOT artifacts' shared libraries (jit/aot_package.h), which need
  // position-independent code; the JIT links it as well.
  builder.setRelocationModel(llvm::Reloc::PIC_);
  state_->machine = unwrap(builder.createTargetMachine(), "creating the target machine");
  state_->builder = builder;
  state_->jit = unwrap(llvm::orc::LLJITBuilder().setJITTargetMachineBuilder(builder).create(),
                       "creating the ORC LLJIT");
  // Kernels call the C library's math functions (expf, tanhf, ...): resolve them in-process.
  auto generator = unwrap(llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(
                              state_->jit->getDataLayout().getGlobalPrefix()),
                          "opening the process's symbols");
  state_->jit->getMainJITDylib().addGenerator(std::move(generator));
}

LlvmJit::~LlvmJit() = default;

LlvmJit& LlvmJit::instance() {
  static LlvmJit jit;
  return jit;
}

std::string LlvmJit::target() const {
  return fmt::format("llvm{}-{}-{}", LLVM_VERSION_STRING, state_->cpu, state_->features);
}

LlvmJit::Stats LlvmJit::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

std::vector<std::byte> LlvmJit::compile_object(const std::string& name, const std::string& ir,
                                               const std::string& cpu) {
  llvm::LLVMContext context;
  llvm::SMDiagnostic diagnostic;
  std::unique_ptr<llvm::Module> module =
      llvm::parseIR(llvm::MemoryBufferRef(ir, name), diagnostic, context);
  if (!module) {
    std::string message;
    llvm::raw_string_ostream os(message);
    diagnostic.print(name.c_str(), os, false);
    fail("LLVM JIT: kernel {} does not parse: {}", name, os.str());
  }
  // Compilations run on several threads at once: each gets its own target machine.
  std::unique_ptr<llvm::TargetMachine> machine = target_machine(cpu);
  module->setDataLayout(machine->createDataLayout());
  module->setTargetTriple(machine->getTargetTriple().str());
  std::string problems;
  llvm::raw_string_ostream verify_os(problems);
  if (llvm::verifyModule(*module, &verify_os))
    fail("LLVM JIT: kernel {} is invalid IR: {}", name, verify_os.str());

  llvm::LoopAnalysisManager loops;
  llvm::FunctionAnalysisManager functions;
  llvm::CGSCCAnalysisManager cgscc;
  llvm::ModuleAnalysisManager modules;
  // No loop unrolling beyond the vectorizer's interleaving (which keeps several accumulators):
  // it cut compile time by about a third without slowing the benchmark's kernels.
  llvm::PipelineTuningOptions tuning;
  tuning.LoopUnrolling = false;
  llvm::PassBuilder passes(machine.get(), tuning);
  passes.registerModuleAnalyses(modules);
  passes.registerCGSCCAnalyses(cgscc);
  passes.registerFunctionAnalyses(functions);
  passes.registerLoopAnalyses(loops);
  passes.crossRegisterProxies(loops, functions, cgscc, modules);
  passes.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3).run(*module, modules);

  llvm::SmallVector<char, 0> object;
  llvm::raw_svector_ostream os(object);
  llvm::legacy::PassManager codegen;
  if (machine->addPassesToEmitFile(codegen, os, nullptr, llvm::CGFT_ObjectFile))
    fail("LLVM JIT: the target cannot emit object files");
  codegen.run(*module);
  const auto* begin = reinterpret_cast<const std::byte*>(object.data());
  return std::vector<std::byte>(begin, begin + object.size());
}

std::string LlvmJit::cache_key(const std::string& ir, const std::string& cpu) const {
  return fmt::format("llvm-jit v{}\n{}\n{}", jit_version, cpu.empty() ? target() : "cpu " + cpu,
                     ir);
}

std::unique_ptr<llvm::TargetMachine> LlvmJit::target_machine(const std::string& cpu) const {
  if (cpu.empty())
    return unwrap(state_->builder->createTargetMachine(), "creating the target machine");
  // A named CPU brings its own features; nothing of the host's is added.
  llvm::orc::JITTargetMachineBuilder builder(state_->builder->getTargetTriple());
  builder.setCPU(cpu);
  builder.setCodeGenOptLevel(llvm::CodeGenOpt::Aggressive);
  builder.setRelocationModel(llvm::Reloc::PIC_);
  return unwrap(builder.createTargetMachine(), "creating the target machine for a named CPU");
}

bool LlvmJit::known_cpu(const std::string& cpu) const {
  return state_->machine->getMCSubtargetInfo()->isCPUStringValid(cpu);
}

std::vector<std::string> LlvmJit::cpu_features(const std::string& cpu,
                                               const std::vector<std::string>& candidates) const {
  std::unique_ptr<llvm::TargetMachine> machine = target_machine(cpu);
  std::vector<std::string> out;
  for (const std::string& feature : candidates)
    if (machine->getMCSubtargetInfo()->checkFeatures("+" + feature)) out.push_back(feature);
  return out;
}

double LlvmJit::compile_missing(const std::vector<KernelSource>& kernels,
                                const std::vector<size_t>& missing,
                                std::vector<std::optional<std::vector<std::byte>>>& objects,
                                const std::string& cpu) {
  // Cache misses compile in parallel, one LLVM context and target machine per thread: a new
  // model's first step waits for its slowest share, not for the sum.
  auto start = std::chrono::steady_clock::now();
  if (missing.empty()) return 0;
  std::atomic<size_t> next{0};
  std::mutex error_mutex;
  std::optional<Error> error;
  auto work = [&] {
    for (size_t k; (k = next.fetch_add(1)) < missing.size();) {
      size_t i = missing[k];
      try {
        objects[i] = compile_object(kernels[i].name, kernels[i].ir, cpu);
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = e;
      }
    }
  };
  size_t threads =
      std::min<size_t>(missing.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& thread : pool) thread.join();
  if (error) throw *error;
  return seconds_since(start);
}

std::vector<std::vector<std::byte>> LlvmJit::objects(const std::vector<KernelSource>& kernels,
                                                     const std::string& cpu) {
  if (!cpu.empty() && !known_cpu(cpu)) fail("LLVM: '{}' is not a CPU this LLVM knows", cpu);
  std::vector<std::optional<std::vector<std::byte>>> objects(kernels.size());
  std::vector<std::string> keys(kernels.size());
  std::vector<size_t> missing;
  for (size_t i = 0; i < kernels.size(); ++i) {
    keys[i] = cache_key(kernels[i].ir, cpu);
    objects[i] = kernel_cache().load(keys[i]);
    if (!objects[i]) missing.push_back(i);
  }
  double compile_seconds = compile_missing(kernels, missing, objects, cpu);
  for (size_t i : missing) kernel_cache().store(keys[i], *objects[i]);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stats.compiled += static_cast<int64_t>(missing.size());
    state_->stats.compile_seconds += compile_seconds;
  }
  std::vector<std::vector<std::byte>> result;
  for (auto& object : objects) result.push_back(std::move(*object));
  return result;
}

std::shared_ptr<const JitKernel> LlvmJit::load(const std::string& name, const std::string& ir) {
  return load_all({{name, ir}})[0];
}

std::vector<std::shared_ptr<const JitKernel>> LlvmJit::load_all(
    const std::vector<KernelSource>& kernels) {
  // Declared before any lock: should a kernel made here be dropped (an error midway), its
  // destructor takes the lock.
  std::vector<std::shared_ptr<const JitKernel>> result(kernels.size());
  std::vector<std::optional<std::vector<std::byte>>> objects(kernels.size());
  std::vector<std::string> keys(kernels.size());
  std::vector<size_t> missing;
  auto start = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(state_->mutex);
    for (size_t i = 0; i < kernels.size(); ++i) {
      if ((result[i] = state_->live(kernels[i].name, lock))) {
        ++state_->stats.memory_hits;
        continue;
      }
      keys[i] = cache_key(kernels[i].ir, "");
      objects[i] = kernel_cache().load(keys[i]);
      if (!objects[i]) missing.push_back(i);
    }
  }
  double load_seconds = seconds_since(start);
  double compile_seconds = compile_missing(kernels, missing, objects, "");
  std::unique_lock<std::mutex> lock(state_->mutex);
  for (size_t i = 0; i < kernels.size(); ++i) {
    if (result[i]) continue;
    const std::string& name = kernels[i].name;
    if ((result[i] = state_->live(name, lock))) continue;  // a racing call loaded it meanwhile
    bool compiled = std::find(missing.begin(), missing.end(), i) != missing.end();
    if (compiled) kernel_cache().store(keys[i], *objects[i]);
    auto load_start = std::chrono::steady_clock::now();
    llvm::StringRef bytes(reinterpret_cast<const char*>(objects[i]->data()), objects[i]->size());
    auto buffer = llvm::MemoryBuffer::getMemBufferCopy(bytes, name);
    auto p = std::make_unique<JitKernel::Private>();
    p->name = name;
    p->tracker = state_->jit->getMainJITDylib().createResourceTracker();
    p->bytes = static_cast<int64_t>(objects[i]->size());
    p->state = state_;
    if (llvm::Error e = state_->jit->addObjectFile(p->tracker, std::move(buffer))) {
      llvm::consumeError(p->tracker->remove());
      fail("LLVM JIT: loading kernel {}: {}", name, to_text(std::move(e)));
    }
    auto address = state_->jit->lookup(name);
    if (!address) {
      std::string problem = to_text(address.takeError());
      llvm::consumeError(p->tracker->remove());
      fail("LLVM JIT: looking up kernel {}: {}", name, problem);
    }
    std::shared_ptr<JitKernel> kernel(new JitKernel(std::move(p)));
    kernel->function = address->toPtr<KernelFunction>();
    state_->loaded.emplace(name, kernel);
    ++state_->stats.resident;
    state_->stats.resident_bytes += kernel->p_->bytes;
    result[i] = std::move(kernel);
    load_seconds += seconds_since(load_start);
    (compiled ? state_->stats.compiled : state_->stats.disk_loaded) += 1;
    if (log_enabled("jit"))
      log_line("jit", "{} {}", compiled ? "compiled" : "loaded from disk", name);
  }
  state_->stats.compile_seconds += compile_seconds;
  state_->stats.load_seconds += load_seconds;
  if (log_enabled("jit") && !missing.empty())
    log_line("jit", "compiled {} kernels in {:.1f} ms", missing.size(), compile_seconds * 1e3);
  return result;
}

}  // namespace mixtape
